//! The GPU backend's mixture-of-experts pieces beside `moe_ffn` (mod.rs): the shape checks both
//! paths share, the shared expert, and the decode path. At decode a step is latency-bound (a
//! 30B-A3B token reads under 2 GB at a small fraction of the bandwidth), so what counts is the
//! launches and the blocks that wait: the decode path routes, then runs the gate and up
//! products with the activation in one kernel and the down product with the weighted sum (and
//! the shared expert's addition) in another, one block column per (token, rank) pair, with no
//! sort into tiles. Its values equal the tile path's bit for bit (crates/gpu/src/ops/moe.rs,
//! kernels/matvec.hip; kernels/tests/harness_moe.cu checks it on the device).

use ember_gpu::ops::{self, DeviceMatrix, OpsError};

use super::{lock, GpuBackend, GpuBuf, MoeScratch};
use crate::backend::{Backend, ExpertGating, MoeFfn, SharedExpert};
use crate::ops::FfnActivation;

/// The stacked experts' shapes against the layer's: `n_expert` experts of `n_ff` x `n_embd` (gate
/// and up) and `n_embd` x `n_ff` (down), and a down scale per expert when there are scales.
pub(super) fn check_moe_shapes(moe: &MoeFfn<'_, DeviceMatrix>) -> Result<(), OpsError> {
    let op = "moe_ffn";
    let n_expert = moe.routing.n_expert;
    let (n_embd, n_ff) = (moe.gate.cols, moe.n_ff);
    if let Some(scale) = moe.expert_scale {
        if scale.len() != n_expert {
            return Err(OpsError::Shape {
                op,
                expected: format!("a down-projection scale per expert ({n_expert})"),
                found: format!("{} scales", scale.len()),
            });
        }
    }
    if moe.gate.rows != n_expert * n_ff
        || moe.up.rows != n_expert * n_ff
        || moe.up.cols != n_embd
        || moe.down.rows != n_expert * n_embd
        || moe.down.cols != n_ff
    {
        return Err(OpsError::Shape {
            op,
            expected: format!(
                "{n_expert} experts of {n_ff}x{n_embd} (gate, up) and {n_embd}x{n_ff} (down)"
            ),
            found: format!(
                "{}x{}, {}x{}, {}x{} in all",
                moe.gate.rows,
                moe.gate.cols,
                moe.up.rows,
                moe.up.cols,
                moe.down.rows,
                moe.down.cols
            ),
        });
    }
    Ok(())
}

/// The kernel-name part of an activation (`ember_moe_swiglu_*`, `ember_moe_geglu_*`).
fn activation_name(activation: FfnActivation) -> &'static str {
    match activation {
        FfnActivation::SwiGlu => "swiglu",
        FfnActivation::GeGlu => "geglu",
    }
}

impl GpuBackend {
    /// The shared expert's output into `s.shared_out` (`[n_tokens, n_embd]`) and, when it has a
    /// gate, its gate logits into `s.shared_logit` (`[n_tokens]`).
    pub(super) fn moe_shared_expert(
        &self,
        shared: &SharedExpert<'_, DeviceMatrix>,
        activation: FfnActivation,
        x: &GpuBuf,
        n_tokens: usize,
        n_embd: usize,
        s: &mut MoeScratch,
    ) {
        let n_ff = shared.n_ff;
        self.ensure_len(&mut s.shared_gate, n_tokens * n_ff);
        self.ensure_len(&mut s.shared_up, n_tokens * n_ff);
        self.ensure_len(&mut s.shared_out, n_tokens * n_embd);
        self.ffn_gate_up(
            shared.gate,
            shared.up,
            x,
            n_tokens,
            n_ff,
            activation,
            &mut s.shared_gate,
            &mut s.shared_up,
        );
        self.matmul(shared.down, &s.shared_gate, n_tokens, &mut s.shared_out);
        if let Some(gate_inp) = shared.gate_inp {
            self.ensure_len(&mut s.shared_logit, n_tokens);
            self.matmul(gate_inp, x, n_tokens, &mut s.shared_logit);
        }
    }

    /// `moe_ffn` for a few tokens (the caller checked [`ops::moe_decode_fits`] and the formats):
    /// the shared expert first, then route, the fused gate/up/activation and the fused
    /// down/combination that also adds the shared expert's output.
    pub(super) fn moe_ffn_decode(
        &self,
        moe: &MoeFfn<'_, DeviceMatrix>,
        router_logits: &GpuBuf,
        x: &GpuBuf,
        n_tokens: usize,
        out: &mut GpuBuf,
    ) {
        let routing = &moe.routing;
        let (n_expert, n_used) = (routing.n_expert, routing.n_expert_used);
        let (n_embd, n_ff) = (moe.gate.cols, moe.n_ff);
        let n_pairs = n_tokens * n_used;
        let mut guard = lock(&self.moe_scratch);
        let s = &mut *guard;
        if let Some(shared) = &moe.shared {
            self.moe_shared_expert(shared, moe.activation, x, n_tokens, n_embd, s);
        }
        self.ensure_len(&mut s.experts, n_pairs);
        self.ensure_len(&mut s.weights, n_pairs);
        self.ensure_len(&mut s.gate, n_pairs * n_ff);
        // Bytes, held in f32s.
        let quantized_len = ops::moe_down_scratch_bytes(n_tokens, n_used, n_ff).div_ceil(4);
        self.ensure_len(&mut s.gate_quantized, quantized_len);
        self.run("moe_ffn", || {
            let op = "moe_ffn";
            check_moe_shapes(moe)?;
            let experts = s.experts.ptr(op, n_pairs)?;
            let weights = s.weights.ptr(op, n_pairs)?;
            let h = s.gate.ptr(op, n_pairs * n_ff)?;
            ops::moe_route(
                &self.ctx,
                router_logits.ptr(op, n_tokens * n_expert)?,
                n_tokens,
                n_expert,
                n_used,
                routing.gating == ExpertGating::Sigmoid,
                routing.normalize_weights,
                routing.weights_scale.unwrap_or(1.0),
                experts,
                weights,
            )?;
            ops::moe_glu(
                &self.ctx,
                moe.gate,
                moe.up,
                n_expert,
                x.ptr(op, n_tokens * n_embd)?,
                experts,
                n_tokens,
                n_used,
                activation_name(moe.activation),
                h,
            )?;
            let expert_scale = moe
                .expert_scale
                .map(|scale| self.expert_scale_ptr(scale))
                .transpose()?;
            let shared = match &moe.shared {
                Some(shared) => Some(ops::SharedOutput {
                    output: s.shared_out.ptr(op, n_tokens * n_embd)?,
                    logit: match shared.gate_inp {
                        Some(_) => Some(s.shared_logit.ptr(op, n_tokens)?),
                        None => None,
                    },
                }),
                None => None,
            };
            ops::moe_down(
                &self.ctx,
                moe.down,
                n_expert,
                h,
                s.gate_quantized.ptr(op, quantized_len)?,
                experts,
                weights,
                expert_scale,
                shared,
                n_tokens,
                n_used,
                out.ptr(op, n_tokens * n_embd)?,
            )
        });
    }
}
