//! The ops only Gemma 4 asks of the GPU backend: the bare RMS normalisation (of V, and of the
//! router's input), the broadcast product of rows with a weight vector (the router's input
//! scale), and the per-expert down-projection scales of its mixture-of-experts layers, which the
//! model keeps on the host and the device needs beside the expert weights.
//!
//! Everything else Gemma 4's layer loop (`crate::model::gemma4`) calls is shared with the other
//! architectures: the attention kernels take its 512-wide global heads (see
//! `ember_gpu::ops::attention`), the rotary kernels its per-layer bases and proportional
//! frequency factors, and the KV cache maps its KV-sharing layers to the layer they read.
//!
//! Reference numerics have no exact kernels for these ops; Gemma 4 is refused in that mode when
//! the model is loaded (`Backend::has_gemma4_ops` is false there, and its logit soft-cap is
//! refused by `numerics::reference_unsupported` first).

use ember_gpu::ops::{self, OpsError};
use ember_gpu::{DevicePtr, PoolBuffer, Purpose};

use super::{check_vector, lock, GpuBackend, GpuBuf, GpuVector};
use crate::backend::{gemma4_ffn_inputs_separately, Gemma4FfnNorms};

/// Device copies of the per-expert scales the MoE layers passed so far, each with the host
/// values it was made from. A model has one per MoE layer (30 for Gemma 4 26B-A4B), so a linear
/// search by address is cheap; the values are compared too, so a slice freed and reallocated at
/// the same address with other values is uploaded again rather than read stale.
#[derive(Default)]
pub(super) struct ExpertScales {
    entries: Vec<ExpertScale>,
}

struct ExpertScale {
    host_address: usize,
    values: Vec<f32>,
    buf: PoolBuffer,
}

impl ExpertScales {
    /// Entries kept at most: more than any model has MoE layers; past it the oldest goes (a
    /// backend that serves models one after another does not grow without bound).
    const MAX_ENTRIES: usize = 512;

    /// Device copies held.
    #[cfg(test)]
    pub(super) fn entries_len(&self) -> usize {
        self.entries.len()
    }
}

impl GpuBackend {
    /// [`Backend::gemma4_ffn_inputs`]: one kernel ([`ops::gemma4_ffn_inputs`], the values of the
    /// four ops it replaces) unless the fused kernels are off (`EMBER_GPU_FUSION=0`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemma4_ffn_inputs_fused(
        &self,
        proj: &mut GpuBuf,
        x: &mut GpuBuf,
        norms: &Gemma4FfnNorms<'_, GpuVector>,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: [&mut GpuBuf; 3],
    ) {
        if !ops::fusion_enabled() {
            gemma4_ffn_inputs_separately(self, proj, x, norms, n_rows, dim, eps, out);
            return;
        }
        let [xn, moe_in, router_in] = out;
        self.run("gemma4_ffn_inputs", || {
            const OP: &str = "gemma4_ffn_inputs";
            self.gemma4_fast_only(OP)?;
            for weight in [norms.post_attn, norms.ffn, norms.experts, norms.router] {
                check_vector(OP, weight, dim)?;
            }
            let len = n_rows * dim;
            let buffers = ops::Gemma4FfnInputs {
                x: x.ptr(OP, len)?,
                proj: proj.ptr(OP, len)?,
                post_attn_norm: norms.post_attn.buf.ptr(),
                ffn_norm: norms.ffn.buf.ptr(),
                pre_norm: norms.experts.buf.ptr(),
                router_weight: norms.router.buf.ptr(),
                router_scale: norms.router_scale,
                xn: xn.ptr(OP, len)?,
                moe_in: moe_in.ptr(OP, len)?,
                router_in: router_in.ptr(OP, len)?,
            };
            ops::gemma4_ffn_inputs(&self.ctx, &buffers, n_rows, dim, eps)
        });
    }

    /// Whether the Gemma 4 ops run in the current numerics (only the fast ones have kernels).
    pub(super) fn gemma4_ops_available(&self) -> bool {
        !self.reference()
    }

    /// `x = rms_norm(x)` without a weight, `n_rows` rows of `dim` values.
    pub(super) fn gemma4_rms_norm_unit(&self, x: &mut GpuBuf, n_rows: usize, dim: usize, eps: f32) {
        self.run("rms_norm_unit", || {
            self.gemma4_fast_only("rms_norm_unit")?;
            let x_ptr = x.ptr("rms_norm_unit", n_rows * dim)?;
            ops::rms_norm(&self.ctx, x_ptr, DevicePtr::NULL, n_rows, dim, eps, x_ptr)
        });
    }

    /// Gemma 4's router input, `out[r] = rms_norm(x[r]) * scale * weight`, in one launch with
    /// the values of the bare norm, the scale and the row product one after another.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemma4_rms_norm_unit_scale_mul(
        &self,
        x: &GpuBuf,
        n_rows: usize,
        dim: usize,
        eps: f32,
        scale: f32,
        weight: &GpuVector,
        out: &mut GpuBuf,
    ) {
        self.run("rms_norm_scale_mul", || {
            self.gemma4_fast_only("rms_norm_scale_mul")?;
            check_vector("rms_norm_scale_mul", weight, dim)?;
            let len = n_rows * dim;
            ops::rms_norm_scale_mul(
                &self.ctx,
                x.ptr("rms_norm_scale_mul", len)?,
                weight.buf.ptr(),
                n_rows,
                dim,
                eps,
                scale,
                out.ptr("rms_norm_scale_mul", len)?,
            )
        });
    }

    /// `x[r * dim + i] *= weight[i]` for `n_rows` rows.
    pub(super) fn gemma4_mul_rows(
        &self,
        x: &mut GpuBuf,
        weight: &GpuVector,
        n_rows: usize,
        dim: usize,
    ) {
        self.run("mul_rows", || {
            self.gemma4_fast_only("mul_rows")?;
            check_vector("mul_rows", weight, dim)?;
            let len = n_rows * dim;
            let x_ptr = x.ptr("mul_rows", len)?;
            ops::mul(&self.ctx, x_ptr, x_ptr, weight.buf.ptr(), len, dim)
        });
    }

    /// The device copy of a layer's per-expert scales, uploaded on first use (the first forward
    /// pass; a decode step being captured as a graph then runs again with plain launches, as
    /// after any upload inside a capture).
    pub(super) fn expert_scale_ptr(&self, scale: &[f32]) -> Result<DevicePtr, OpsError> {
        let mut cache = lock(&self.expert_scales);
        let address = scale.as_ptr() as usize;
        if let Some(at) = cache.entries.iter().position(|e| e.host_address == address) {
            if cache.entries[at].values == scale {
                return Ok(cache.entries[at].buf.ptr());
            }
            cache.entries.remove(at);
        }
        let bytes: Vec<u8> = scale.iter().flat_map(|v| v.to_le_bytes()).collect();
        let buf = self.upload_new(Purpose::Weights, &bytes)?;
        let ptr = buf.ptr();
        if cache.entries.len() >= ExpertScales::MAX_ENTRIES {
            cache.entries.remove(0);
        }
        cache.entries.push(ExpertScale {
            host_address: address,
            values: scale.to_vec(),
            buf,
        });
        Ok(ptr)
    }

    fn gemma4_fast_only(&self, op: &'static str) -> Result<(), OpsError> {
        if self.reference() {
            // Refused at load (has_gemma4_ops is false in reference numerics).
            return Err(OpsError::Unsupported {
                op,
                what: "reference numerics (Gemma 4 runs on the GPU in fast numerics only)".into(),
            });
        }
        Ok(())
    }
}
