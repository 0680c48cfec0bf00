//! The compute backend interface: the ops the model code is written in.
//!
//! Model code (`crate::model`) never touches memory directly: it asks a [`Backend`] to place
//! weights, allocate activation buffers and K/V blocks, and run ops on them. The CPU backend
//! ([`cpu::CpuBackend`]) borrows weights from the GGUF memory map and runs the ops on a rayon
//! thread pool; a GPU backend (HIP/CUDA) implements the same trait with device buffers, so the
//! model code does not change. Shapes are passed explicitly (row counts and row lengths) because a
//! device buffer carries no shape of its own.
//!
//! Layout conventions shared by every implementation:
//! - An activation buffer holding `n_tokens` rows of `dim` values is token-major:
//!   `buf[t * dim + i]`.
//! - Matrices follow GGUF: a weight with `rows` output features and `cols` input features maps a
//!   row of `cols` values to a row of `rows` values.
//! - K/V blocks hold `block_size` token slots; see [`crate::kv_cache`] for the addressing.
//!
//! Failures: the ops return nothing, because on the CPU they cannot fail. A device backend's ops
//! can (out of memory, a VRAM budget, a driver fault), so such a backend records the first
//! failure, turns later ops into no-ops, and hands the failure over through
//! [`Backend::take_failure`]; the forward pass asks once at its end and turns it into
//! `ForwardError::Backend`, undoing the batch's changes to the KV cache, so the next forward on
//! the same context works.

pub mod cpu;
pub mod gpu;
pub mod mixed;
pub mod sim;
pub mod split;
pub mod split_memory;

use std::sync::Arc;

use ember_gguf::{Gguf, TensorInfo};

use crate::batch::Batch;
use crate::ops::{AttentionPlan, FfnActivation};
pub use crate::ops::{RopeMode, RopeParams};

/// An error raised by a backend while placing weights or allocating memory.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The tensor's element type has no kernels in this backend.
    #[error("tensor {tensor}: type {ty} is not supported by the {backend} backend (supported: {supported})")]
    UnsupportedType {
        tensor: String,
        ty: String,
        backend: &'static str,
        supported: String,
    },
    /// The device could not take the tensor (out of memory, over the VRAM budget, a driver
    /// fault).
    #[error("tensor {tensor}: placing it on the device failed: {cause}")]
    Device { tensor: String, cause: String },
    /// The tensor is not a matrix or vector of the expected size.
    #[error("tensor {tensor}: expected {expected}, found {found}")]
    BadTensor {
        tensor: String,
        expected: String,
        found: String,
    },
    /// A layer's attention heads are wider than the backend's attention kernels handle.
    #[error("tensor {tensor}: attention heads of {head_dim} values (layer {layer}) are wider than the {backend} backend's attention kernels handle (at most {max}): run the model on the CPU (--device cpu)")]
    HeadDimTooLarge {
        tensor: String,
        layer: usize,
        head_dim: usize,
        max: usize,
        backend: &'static str,
    },
    /// The model needs a feature this backend does not have yet.
    #[error("tensor {tensor}: {feature} (architecture {architecture}) is not built for the {backend} backend yet: run the model on the CPU (--device cpu)")]
    NotBuilt {
        tensor: String,
        feature: &'static str,
        architecture: String,
        backend: &'static str,
    },
}

/// How a mixture-of-experts router turns a token's router logits into expert probabilities.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertGating {
    /// A softmax over all experts (Qwen3-MoE, Qwen 3.5 MoE, Gemma 4).
    Softmax,
    /// An independent sigmoid per expert (DeepSeek V3 and its descendants).
    Sigmoid,
}

/// How a mixture-of-experts layer picks and weighs its experts, as llama.cpp's `build_moe_ffn`
/// does: probabilities from the router logits by [`ExpertGating`], the `n_expert_used` most
/// probable experts (ties to the lower index), their probabilities as weights, divided by their
/// sum when `normalize_weights` (the sum clamped below at 2^-14, the smallest normal f16), then
/// multiplied by `weights_scale` when there is one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeRouting {
    pub n_expert: usize,
    pub n_expert_used: usize,
    pub gating: ExpertGating,
    pub normalize_weights: bool,
    pub weights_scale: Option<f32>,
}

/// The norm weights of [`Backend::gemma4_ffn_inputs`]: after attention, before the residual
/// add (`post_attn`); of the dense FFN's input (`ffn`), of the experts' (`experts`), and of the
/// router's input (`router`, after the bare norm and the factor `router_scale`).
pub struct Gemma4FfnNorms<'a, V> {
    pub post_attn: &'a V,
    pub ffn: &'a V,
    pub experts: &'a V,
    pub router: &'a V,
    pub router_scale: f32,
}

/// [`Backend::gemma4_ffn_inputs`] as the four ops it stands for (its default, and a device
/// backend's path when its fused kernels are off).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemma4_ffn_inputs_separately<B: Backend>(
    b: &B,
    proj: &mut B::Buf,
    x: &mut B::Buf,
    norms: &Gemma4FfnNorms<'_, B::Vector>,
    n_rows: usize,
    dim: usize,
    eps: f32,
    out: [&mut B::Buf; 3],
) {
    let [xn, moe_in, router_in] = out;
    b.rms_norm_add(proj, norms.post_attn, n_rows, dim, eps, x);
    b.rms_norm(x, norms.ffn, n_rows, dim, eps, xn);
    b.rms_norm(x, norms.experts, n_rows, dim, eps, moe_in);
    b.rms_norm_unit_scale_mul(
        x,
        n_rows,
        dim,
        eps,
        norms.router_scale,
        norms.router,
        router_in,
    );
}

/// QK-norm (Qwen3, Gemma 3 and 4, Qwen 3.5): per-head RMS-norm weights (`head_dim` values each)
/// for the queries and the keys, applied before rope, as [`Backend::rms_norm_inplace`] of every
/// head would. `None` skips that norm.
pub struct QkNorm<'a, V> {
    pub q: Option<&'a V>,
    pub k: Option<&'a V>,
    pub eps: f32,
}

impl<'a, V> QkNorm<'a, V> {
    /// No norm on either side.
    pub fn none() -> Self {
        QkNorm {
            q: None,
            k: None,
            eps: 0.0,
        }
    }

    /// The norms as separate ops on `b`: [`Backend::rms_norm_inplace`] of every q head
    /// (`n_tokens * n_heads` rows of `head_dim`) and every k head, what a fused
    /// [`Backend::rope_kv_store`] does first.
    #[allow(clippy::too_many_arguments)]
    pub fn apply<B: Backend<Vector = V>>(
        &self,
        b: &B,
        q: &mut B::Buf,
        k: &mut B::Buf,
        n_tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) {
        if let Some(weight) = self.q {
            b.rms_norm_inplace(q, weight, n_tokens * n_heads, head_dim, self.eps);
        }
        if let Some(weight) = self.k {
            b.rms_norm_inplace(k, weight, n_tokens * n_kv_heads, head_dim, self.eps);
        }
    }

    /// The same norms with each weight mapped (a composite backend's per-device part).
    pub fn map<W>(&self, f: impl Fn(&'a V) -> &'a W) -> QkNorm<'a, W> {
        QkNorm {
            q: self.q.map(&f),
            k: self.k.map(&f),
            eps: self.eps,
        }
    }
}

/// A shared expert: a gated FFN every token goes through beside its routed experts (Qwen 3.5
/// MoE), its output optionally scaled per token by `sigmoid(gate_inp x)` before it is added.
pub struct SharedExpert<'a, M> {
    /// Plain matrices (placed with [`Backend::matrix`]): `n_ff` rows each for gate and up.
    pub gate: &'a M,
    pub up: &'a M,
    pub down: &'a M,
    pub n_ff: usize,
    /// One row: the per-token gate of the shared expert's output.
    pub gate_inp: Option<&'a M>,
}

/// The experts of one mixture-of-experts layer, as [`Backend::moe_ffn`] takes them.
pub struct MoeFfn<'a, M> {
    /// Stacked expert projections placed with [`Backend::expert_matrix`]: expert `e`'s gate and
    /// up are rows `e * n_ff .. (e + 1) * n_ff` of `gate` and `up`, its down projection rows
    /// `e * n_embd .. (e + 1) * n_embd` of `down`.
    pub gate: &'a M,
    pub up: &'a M,
    pub down: &'a M,
    /// Rows of each expert's gate and up projections.
    pub n_ff: usize,
    pub activation: FfnActivation,
    pub routing: MoeRouting,
    /// A factor per expert on its down projection's output, before the routing weight
    /// (Gemma 4's `ffn_down_exps.scale`, `n_expert` values), when the layer has one.
    pub expert_scale: Option<&'a [f32]>,
    pub shared: Option<SharedExpert<'a, M>>,
}

/// The fixed parts of one Gated DeltaNet layer (Qwen 3.5's linear attention), as
/// [`Backend::gated_delta_net`] takes them. Shapes: `n_k_heads` query and key heads and
/// `n_v_heads` value heads, all of `head_dim` values; value head `h` reads query and key head
/// `h % n_k_heads` (llama.cpp's converter orders the value heads so that this tiling is right).
pub struct GatedDeltaNet<'a, V> {
    /// `conv_kernel` taps per channel, channel by channel (Q, K, then V channels).
    pub conv: &'a V,
    /// Added to the decay input before the softplus, one per value head.
    pub dt_bias: &'a V,
    /// The decay rate (`-exp(A_log)`), one per value head.
    pub a: &'a V,
    /// The RMS norm weight of each value head's output (`head_dim` values).
    pub norm: &'a V,
    pub conv_kernel: usize,
    pub n_k_heads: usize,
    pub n_v_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
}

impl<V> GatedDeltaNet<'_, V> {
    /// Convolution channels: the query, key and value heads.
    pub fn channels(&self) -> usize {
        (2 * self.n_k_heads + self.n_v_heads) * self.head_dim
    }

    /// Values of one sequence's convolution state in the layer.
    pub fn conv_state_len(&self) -> usize {
        self.conv_kernel.saturating_sub(1) * self.channels()
    }

    /// Values of one sequence's delta-rule state in the layer.
    pub fn ssm_state_len(&self) -> usize {
        self.n_v_heads * self.head_dim * self.head_dim
    }
}

/// One sequence's part of a [`Backend::gated_delta_net`] call: its rows in the batch, in
/// position order, and its state buffer ([`Backend::state_alloc`]; every linear-attention layer's
/// state, one after the other), whose layer part starting at `offset` is read and then replaced
/// by the state after the rows. A layer's part is the convolution state (the last
/// `conv_kernel - 1` inputs of each channel, channel by channel), then the delta-rule state (one
/// `head_dim` x `head_dim` matrix per value head: row `j`, a value index, holds the state's
/// column over the key index, as GGML stores it).
pub struct SequenceState<'a, Buf> {
    pub rows: &'a [usize],
    pub state: &'a mut Buf,
    /// Where the layer's part starts, in values.
    pub offset: usize,
}

/// An op that failed on a device backend: which op, and why. Recorded by the backend and
/// returned by [`Backend::take_failure`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{backend} backend: {op} failed: {cause}")]
pub struct OpFailure {
    /// The backend's name (`cuda`, `hip`).
    pub backend: &'static str,
    /// The op that failed first (`matmul`, `kv_materialize`, ...).
    pub op: &'static str,
    /// The cause, as the device layer describes it.
    pub cause: String,
    /// Whether the op failed for lack of device memory (out of memory or over the VRAM budget),
    /// which a caller may answer by retrying with less work at once.
    pub out_of_memory: bool,
}

/// Compute primitives over device-resident buffers.
///
/// Every op takes the shapes it works on; buffers must be at least as long as those shapes say
/// (the model code sizes them, and implementations may panic on a violated precondition since that
/// is a bug in the model code, not bad input).
pub trait Backend: Send + Sync + Sized + 'static {
    /// An f32 activation buffer.
    type Buf: Send;
    /// A weight matrix in its stored (possibly quantized) format.
    type Matrix: Send + Sync;
    /// A small f32 vector (norm weights, biases).
    type Vector: Send + Sync;
    /// A table of per-token cosines and sines for one [`RopeParams`] and one batch of positions.
    type RopeTable: Send;
    /// The K and V storage of one layer: a growable array of fixed-size blocks.
    type KvLayer: Send;

    /// A short name for messages (`cpu`, `hip`, `cuda`).
    fn name(&self) -> &'static str;
    /// What the backend runs on, for headers and logs (`cpu, 8 threads`, `cuda:0 NVIDIA H200
    /// (sm_90), vmm pool`).
    fn describe(&self) -> String {
        self.name().to_string()
    }
    /// The first op failure since the last call, clearing it; later ops run again afterwards.
    /// Backends whose ops cannot fail (the CPU) never have one.
    fn take_failure(&self) -> Option<OpFailure> {
        None
    }
    /// Called once per forward pass before any op, with the batch, its attention plan and the
    /// rows whose logits are wanted, so a device backend can upload the per-batch arrays (token
    /// ids, positions, slots, block tables) once instead of once per layer.
    fn begin_forward(&self, batch: &Batch, plan: &AttentionPlan, out_rows: &[usize]) {
        let _ = (batch, plan, out_rows);
    }
    /// Called once per forward pass after the layers ran. `true` asks the model code to run the
    /// layers once more: a device backend that recorded the pass into a graph (see
    /// [`Backend::begin_forward`]) and could not run the recording has run nothing, and runs the
    /// repeat with plain launches. A pass is idempotent (same inputs, same KV slots).
    fn end_forward(&self) -> bool {
        false
    }
    /// Called by the layer loop after layer `layer` (of `n_layers`) of a pass that may be re-run from its start
    /// (every layer idempotent: no recurrent state absorbed the batch). A device backend that
    /// records the pass into a graph may end the recording here, run it, and record the next
    /// layers while the device works through this part: the host's recording of the rest of
    /// the pass then overlaps the device's work instead of preceding it. Passes with recurrent
    /// state never call it (see [`Backend::end_forward`]: a repeat after a part already ran
    /// would apply their state update twice).
    fn layer_done(&self, layer: usize, n_layers: usize) {
        let _ = (layer, n_layers);
    }
    /// Runs `f` in the backend's execution context (the CPU thread pool); model code wraps each
    /// forward pass in it.
    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R;

    /// Places a weight matrix (`info.dims[0]` columns, `info.dims[1]` rows).
    fn matrix(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Self::Matrix, BackendError>;
    /// Places a vector, converting it to f32.
    fn vector(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<Self::Vector, BackendError>;
    /// Bytes of weight memory a matrix takes on this backend that are not shared with the file
    /// mapping (0 for the CPU backend, which reads weights in place).
    fn matrix_private_bytes(&self, matrix: &Self::Matrix) -> usize;
    /// Places the stacked matrices of a mixture-of-experts layer: a 3-D tensor of `info.dims[2]`
    /// experts, each `info.dims[1]` rows of `info.dims[0]` columns, for [`Backend::moe_ffn`]. A
    /// backend without mixture-of-experts support refuses it (the default), so such a model
    /// fails at load time, before any token runs.
    fn expert_matrix(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
    ) -> Result<Self::Matrix, BackendError> {
        Err(BackendError::NotBuilt {
            tensor: info.name.clone(),
            feature: "mixture of experts",
            architecture: gguf
                .architecture()
                .map_or_else(|e| format!("unreadable: {e}"), str::to_string),
            backend: self.name(),
        })
    }

    /// Gives back the scratch memory the backend's own ops keep between calls (the expert
    /// activations of [`Backend::moe_ffn`]); the next such op allocates it again. Called with
    /// the model's activation buffers when a context goes idle.
    fn release_op_scratch(&self) {}

    /// Bytes of the scratch memory the backend's own ops keep between calls, beside the
    /// buffers of [`Backend::alloc`] (the CPU's quantized activations and expert buffers): how
    /// a split counts each device's scratch whole. A backend whose op scratch is in a pool
    /// that reports itself (the GPU's) leaves it at 0.
    fn op_scratch_bytes(&self) -> usize {
        0
    }

    /// A zeroed buffer of `len` values.
    fn alloc(&self, len: usize) -> Self::Buf;
    /// Makes sure `buf` holds at least `len` values, keeping its allocation when it already does.
    fn ensure_len(&self, buf: &mut Self::Buf, len: usize);
    /// Bytes of memory `buf` holds now (its allocation, which may exceed its length): how a
    /// split counts each device's scratch ([`split_memory::SplitMemory`]).
    fn buf_bytes(&self, buf: &Self::Buf) -> usize;
    /// Copies rows `rows` of `src` (rows of `dim` values) to the first rows of `out`, in order.
    fn gather_rows(&self, src: &Self::Buf, dim: usize, rows: &[usize], out: &mut Self::Buf);
    /// Copies `values` from host memory to the start of `buf` (which holds at least as many):
    /// how activations reach a device when they cross from another one
    /// ([`split::SplitBackend`]).
    fn write(&self, buf: &mut Self::Buf, values: &[f32]);
    /// Copies the first `len` values of `buf` to host memory (replacing the contents of `out`).
    fn read(&self, buf: &Self::Buf, len: usize, out: &mut Vec<f32>);
    /// Greedy sampling where the values live: `out[r]` (replacing the contents of `out`) is the
    /// index of the largest of the `n_cols` values of row `r` of `x`, for `n_rows` rows, by
    /// [`crate::sample::greedy_token`]'s rule (the first largest; NaN and -inf never chosen; 0
    /// when nothing else is), or [`crate::sample::NON_FINITE_ROW`] for a row holding NaN or +inf
    /// (every backend checks: the device kernel writes -1, which reads back as that value). Only
    /// the indices reach host memory, not the rows: for the logits of a batch of greedy
    /// sequences that is 4 bytes a sequence instead of the whole vocabulary.
    /// `scratch` is a buffer the op may use (a device backend writes the indices there first).
    fn argmax_rows(
        &self,
        x: &Self::Buf,
        n_rows: usize,
        n_cols: usize,
        scratch: &mut Self::Buf,
        out: &mut Vec<u32>,
    );

    /// `out[t] = table.row(ids[t]) * scale`, each row dequantized to f32.
    fn get_rows(&self, table: &Self::Matrix, ids: &[u32], scale: f32, out: &mut Self::Buf);
    /// `out[t] = w * x[t]` for `n_tokens` rows of `x`, activations quantized to the weight's
    /// dot-product type first, as GGML does.
    fn matmul(&self, w: &Self::Matrix, x: &Self::Buf, n_tokens: usize, out: &mut Self::Buf);
    /// Copies the first `len` values of `src`, a buffer of `from` (another device of a split),
    /// into `dst` on this device without host staging: a GPU's peer copy, queued on its stream
    /// (so a decode graph records it). `Ok(false)` when this pair of devices has no such path
    /// (the split then stages the values through host memory); `Err` says why a copy it tried
    /// failed (the split logs it and stages). `dst` holds at least `len` values.
    fn copy_from_peer(
        &self,
        from: &Self,
        src: &Self::Buf,
        dst: &mut Self::Buf,
        len: usize,
    ) -> Result<bool, String> {
        let _ = (from, src, dst, len);
        Ok(false)
    }
    /// Whether this device can run [`Backend::matmul_streamed`]: a product with a weight that
    /// lives on another device of a split, its bytes copied from the file for that product.
    fn streams_weights(&self) -> bool {
        false
    }
    /// `out = w x` as [`Backend::matmul`], for the weight `info` of `gguf` that this device does
    /// not hold: its file bytes are copied here for this product and let go after it. A partial
    /// offload runs the prompt products of the CPU's layers so (see
    /// [`crate::backend::split::STREAM_MIN_TOKENS`]): copying a layer's weights to a GPU costs
    /// less than the CPU's product over hundreds of tokens. `false` when the device cannot take
    /// the weight now (no memory for it; a device that does not stream): nothing ran, and the
    /// caller runs the product where the weight lives.
    fn matmul_streamed(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) -> bool {
        let _ = (gguf, info, x, n_tokens, out);
        false
    }
    /// `outs[i] = ws[i] * x` for several matrices sharing one input (Q, K and V; gate and up), so
    /// the input is quantized once per dot-product type rather than once per matrix.
    fn matmul_shared(
        &self,
        ws: &[&Self::Matrix],
        x: &Self::Buf,
        n_tokens: usize,
        outs: &mut [&mut Self::Buf],
    ) {
        for (w, out) in ws.iter().zip(outs.iter_mut()) {
            self.matmul(w, x, n_tokens, out);
        }
    }
    /// The gated input of a feed-forward block: `gate = act(w_gate x) * (w_up x)` for
    /// `n_tokens` rows of `x` (`n_ff` values per row of `gate`), the activation as
    /// [`Backend::swiglu`] / [`Backend::geglu`] compute it. `up` is scratch of the same size; what
    /// it holds afterwards is unspecified (a device backend may fuse both projections and the
    /// activation into one kernel and never write it).
    #[allow(clippy::too_many_arguments)]
    fn ffn_gate_up(
        &self,
        w_gate: &Self::Matrix,
        w_up: &Self::Matrix,
        x: &Self::Buf,
        n_tokens: usize,
        n_ff: usize,
        activation: FfnActivation,
        gate: &mut Self::Buf,
        up: &mut Self::Buf,
    ) {
        self.matmul_shared(&[w_gate, w_up], x, n_tokens, &mut [&mut *gate, &mut *up]);
        match activation {
            FfnActivation::SwiGlu => self.swiglu(gate, up, n_tokens * n_ff),
            FfnActivation::GeGlu => self.geglu(gate, up, n_tokens * n_ff),
        }
    }
    /// The router logits of a mixture-of-experts layer: `out[t] = router * x[t]` for `n_tokens`
    /// rows, one logit per expert, as [`Backend::matmul`] computes them (the default). Which
    /// experts a token gets can hinge on the last bits of these logits, so a backend that
    /// reproduces llama.cpp's rounding elsewhere does so here too (the CPU does).
    fn moe_router(
        &self,
        router: &Self::Matrix,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) {
        self.matmul(router, x, n_tokens, out);
    }
    /// The feed-forward block of a mixture-of-experts layer for `n_tokens` rows of `x` (the
    /// normalised input, `n_embd` values per row): each token's experts chosen from its row of
    /// `router_logits` (`routing.n_expert` values per token, computed by the model code, which
    /// lets an architecture route on another input than the experts see) by [`MoeRouting`];
    /// each chosen expert's gated FFN (`down(act(gate x) * up x)`) on the token; the outputs
    /// weighted and summed in the order of the ranking; plus the shared expert when there is
    /// one. `out` gets `n_tokens` rows of `n_embd` values (it is not added to).
    ///
    /// Only reachable with matrices placed by [`Backend::expert_matrix`]; the default refuses
    /// those, so a backend that implements one implements both, and the default body here is
    /// never run.
    fn moe_ffn(
        &self,
        moe: &MoeFfn<'_, Self::Matrix>,
        router_logits: &Self::Buf,
        x: &Self::Buf,
        n_tokens: usize,
        out: &mut Self::Buf,
    ) {
        let _ = (moe, router_logits, x, n_tokens, out);
        unreachable!(
            "the {} backend places no expert matrices, so no model can reach its moe_ffn",
            self.name()
        );
    }
    /// Whether the backend runs the ops of hybrid models' linear-attention layers
    /// ([`Backend::gated_delta_net`], [`Backend::split_query_gate`],
    /// [`Backend::mul_sigmoid`]). A backend without them (the default) refuses such models at
    /// load time, so those ops' default bodies are never run.
    fn linear_attention_supported(&self) -> bool {
        false
    }
    /// A zeroed buffer of `len` values for one sequence's recurrent state
    /// ([`crate::recurrent_state`]); a device backend accounts it as such rather than as scratch.
    fn state_alloc(&self, len: usize) -> Self::Buf {
        self.alloc(len)
    }
    /// Called once per forward pass of a model with recurrent state, before
    /// [`Backend::begin_forward`], with the batch's sequences (their rows and state buffers, in
    /// the order every [`Backend::gated_delta_net`] of the pass gets them), so a device backend
    /// can upload their table once, before it starts recording the pass.
    fn begin_states(&self, states: &[SequenceState<'_, Self::Buf>]) {
        let _ = states;
    }
    /// Splits a gated query projection (`n_tokens` rows of `n_heads` heads, each `head_dim`
    /// query values followed by `head_dim` gate values) into `q` and `gate`, `n_heads *
    /// head_dim` values per row each.
    fn split_query_gate(
        &self,
        q_full: &Self::Buf,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        q: &mut Self::Buf,
        gate: &mut Self::Buf,
    ) {
        let _ = (q_full, n_tokens, n_heads, head_dim, q, gate);
        unreachable!(
            "the {} backend refuses models with a query gate at load",
            self.name()
        );
    }
    /// `x[i] *= sigmoid(gate[i])` for `len` values.
    fn mul_sigmoid(&self, x: &mut Self::Buf, gate: &Self::Buf, len: usize) {
        let _ = (x, gate, len);
        unreachable!(
            "the {} backend refuses models with a query gate at load",
            self.name()
        );
    }
    /// The core of a Gated DeltaNet layer, after its input projections, as llama.cpp computes
    /// it: for each sequence in `states`, the causal convolution of its `qkv` rows (`2 *
    /// n_k_heads * head_dim + n_v_heads * head_dim` channels) continuing its convolution
    /// state, SiLU, L2 normalisation of each query and key head, then per value head the gated
    /// delta rule over its tokens in order (decay `exp(softplus(alpha + dt_bias) * a)`, write
    /// strength `sigmoid(beta)`, queries scaled by `1 / sqrt(head_dim)`), and each head's output
    /// RMS-normalised times `norm` times `silu(z)`. `out` gets `n_v_heads * head_dim` values
    /// per row of the batch (rows of no sequence in `states` are left as they are); the states
    /// are replaced by those after the sequences' rows.
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_net(
        &self,
        op: &GatedDeltaNet<'_, Self::Vector>,
        qkv: &Self::Buf,
        z: &Self::Buf,
        beta: &Self::Buf,
        alpha: &Self::Buf,
        states: &mut [SequenceState<'_, Self::Buf>],
        out: &mut Self::Buf,
    ) {
        let _ = (op, qkv, z, beta, alpha, states, out);
        unreachable!(
            "the {} backend refuses linear-attention models at load",
            self.name()
        );
    }
    /// RMS normalisation of `n_rows` rows of `dim` values, times `weight` (length `dim`).
    fn rms_norm(
        &self,
        x: &Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    );
    /// In-place [`Backend::rms_norm`].
    fn rms_norm_inplace(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
    );
    /// The widest attention head the backend's attention kernels handle, or `None` when any
    /// width runs (the CPU). Models with wider heads are refused at load time, before any
    /// weight is placed, never at a kernel launch.
    fn max_head_dim(&self) -> Option<usize> {
        None
    }
    /// Whether the backend has the ops only Gemma 4 uses ([`Backend::rms_norm_unit_inplace`],
    /// [`Backend::mul_rows_inplace`]). A backend without them (the default) refuses Gemma 4 at
    /// load time, before any token runs.
    fn has_gemma4_ops(&self) -> bool {
        false
    }
    /// RMS normalisation without a weight (GGML's bare `ggml_rms_norm`), in place, of `n_rows`
    /// rows of `dim` values. Only reachable where [`Backend::has_gemma4_ops`] says so; the
    /// default is never run.
    fn rms_norm_unit_inplace(&self, x: &mut Self::Buf, n_rows: usize, dim: usize, eps: f32) {
        let _ = (x, n_rows, dim, eps);
        unreachable!(
            "the {} backend refuses Gemma 4 at load, so no model reaches rms_norm_unit_inplace",
            self.name()
        );
    }
    /// `x[r * dim + i] *= weight[i]` for `n_rows` rows (GGML's broadcast `ggml_mul`). Only
    /// reachable where [`Backend::has_gemma4_ops`] says so; the default is never run.
    fn mul_rows_inplace(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
    ) {
        let _ = (x, weight, n_rows, dim);
        unreachable!(
            "the {} backend refuses Gemma 4 at load, so no model reaches mul_rows_inplace",
            self.name()
        );
    }
    /// `x[r] = rms_norm(x[r]) * weight`, then `dst[r] += x[r]`, for `n_rows` rows of `dim`
    /// values (a post-norm before a residual add). The default runs
    /// [`Backend::rms_norm_inplace`] and [`Backend::add_inplace`]; a backend may fuse them into
    /// one pass with the same values.
    fn rms_norm_add(
        &self,
        x: &mut Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        dst: &mut Self::Buf,
    ) {
        self.rms_norm_inplace(x, weight, n_rows, dim, eps);
        self.add_inplace(dst, x, n_rows * dim);
    }
    /// `out[r] = rms_norm(x[r]) * scale * weight` for `n_rows` rows of `dim` values (Gemma 4's
    /// router input: the bare norm, a scalar, then a vector broadcast over the rows, each product
    /// rounded to f32 in that order). The default copies `x` and runs
    /// [`Backend::rms_norm_unit_inplace`], [`Backend::scale`] and [`Backend::mul_rows_inplace`]
    /// on the copy; a backend may fuse them into one pass with the same values. Only reachable
    /// where [`Backend::has_gemma4_ops`] says so.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_unit_scale_mul(
        &self,
        x: &Self::Buf,
        n_rows: usize,
        dim: usize,
        eps: f32,
        scale: f32,
        weight: &Self::Vector,
        out: &mut Self::Buf,
    ) {
        let rows: Vec<usize> = (0..n_rows).collect();
        self.gather_rows(x, dim, &rows, out);
        self.rms_norm_unit_inplace(out, n_rows, dim, eps);
        self.scale(out, n_rows * dim, scale);
        self.mul_rows_inplace(out, weight, n_rows, dim);
    }
    /// Gemma 4's step from attention to a layer with experts: [`Backend::rms_norm_add`] of
    /// `proj` into `x` with `norms.post_attn`, then from the new `x` the dense FFN's input
    /// (`out[0] = rms_norm(x) * norms.ffn`), the experts' (`out[1] = rms_norm(x) *
    /// norms.experts`) and the router's (`out[2]`, [`Backend::rms_norm_unit_scale_mul`] with
    /// `norms.router_scale` and `norms.router`), `n_rows` rows of `dim` values each. The default
    /// runs those four ops; a device backend runs one kernel with their values. Only reachable
    /// where [`Backend::has_gemma4_ops`] says so.
    #[allow(clippy::too_many_arguments)]
    fn gemma4_ffn_inputs(
        &self,
        proj: &mut Self::Buf,
        x: &mut Self::Buf,
        norms: &Gemma4FfnNorms<'_, Self::Vector>,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: [&mut Self::Buf; 3],
    ) {
        gemma4_ffn_inputs_separately(self, proj, x, norms, n_rows, dim, eps, out);
    }
    /// `dst[i] += src[i]` for `len` values.
    fn add_inplace(&self, dst: &mut Self::Buf, src: &Self::Buf, len: usize);
    /// The residual add fused with the following normalisation: `x[i] += proj[i]` for
    /// `n_rows * dim` values, then `out = rms_norm(x) * weight` (as [`Backend::rms_norm`]). A
    /// device backend runs it as one kernel; the values are those of the two ops. `out` is a
    /// buffer other than `x` and `proj`.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(
        &self,
        x: &mut Self::Buf,
        proj: &Self::Buf,
        weight: &Self::Vector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        self.add_inplace(x, proj, n_rows * dim);
        self.rms_norm(x, weight, n_rows, dim, eps, out);
    }
    /// `x[r * dim + i] += bias[i]` for `n_rows` rows.
    fn add_bias(&self, x: &mut Self::Buf, bias: &Self::Vector, n_rows: usize, dim: usize);
    /// `x[i] *= scale` for `len` values.
    fn scale(&self, x: &mut Self::Buf, len: usize, scale: f32);
    /// `gate[i] = silu(gate[i]) * up[i]` for `len` values (SwiGLU).
    fn swiglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize);
    /// `gate[i] = gelu(gate[i]) * up[i]` with GELU's tanh approximation (GeGLU).
    fn geglu(&self, gate: &mut Self::Buf, up: &Self::Buf, len: usize);
    /// `x[i] = cap * tanh(x[i] * (1 / cap))` for `len` values (Gemma's logit soft-capping, in
    /// GGML's order: a scale by `1 / cap`, `tanh`, a scale by `cap`).
    fn softcap(&self, x: &mut Self::Buf, len: usize, cap: f32);

    /// An empty rotary table.
    fn rope_table_new(&self) -> Self::RopeTable;
    /// Fills `table` with the cosines and sines of every token of a batch, reusing its memory.
    fn rope_table(&self, positions: &[u32], params: &RopeParams<'_>, table: &mut Self::RopeTable);
    /// Rotates `n_heads` heads of `head_dim` values in each of `n_tokens` rows.
    fn rope(
        &self,
        x: &mut Self::Buf,
        table: &Self::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        mode: RopeMode,
    );

    /// K/V storage for one layer with room for `max_blocks` blocks of `block_size` tokens of
    /// `n_kv_heads` heads of `head_dim` values; no block has memory yet.
    fn kv_layer(
        &self,
        max_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> Self::KvLayer;
    /// Gives memory to `blocks` (those that have none); their contents are unspecified.
    fn kv_materialize(&self, layer: &mut Self::KvLayer, blocks: &[u32]);
    /// Takes the memory of `blocks` back (they are free; they are materialized again before reuse).
    fn kv_release(&self, layer: &mut Self::KvLayer, blocks: &[u32]);
    /// Bytes of K/V memory the layer holds now.
    fn kv_bytes(&self, layer: &Self::KvLayer) -> usize;
    /// Writes the K and V rows of a batch into their slots (`plan.slots[t]` for token `t`).
    fn kv_store(
        &self,
        layer: &mut Self::KvLayer,
        k: &Self::Buf,
        v: &Self::Buf,
        plan: &AttentionPlan,
    );
    /// The QK-norm of `norm` ([`Backend::rms_norm_inplace`] of every q and k head), then
    /// [`Backend::rope`] of `q` (`n_heads` heads) and of `k` (`n_kv_heads` heads), then
    /// [`Backend::kv_store`] of the rotated `k` and of `v` into `layer`. A device backend runs
    /// them as one kernel with the same values; `plan` covers the same `n_tokens` tokens.
    #[allow(clippy::too_many_arguments)]
    fn rope_kv_store(
        &self,
        q: &mut Self::Buf,
        k: &mut Self::Buf,
        v: &Self::Buf,
        norm: QkNorm<'_, Self::Vector>,
        table: &Self::RopeTable,
        n_tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        mode: RopeMode,
        layer: &mut Self::KvLayer,
        plan: &AttentionPlan,
    ) {
        norm.apply(self, q, k, n_tokens, n_heads, n_kv_heads, head_dim);
        self.rope(q, table, n_tokens, n_heads, head_dim, mode);
        self.rope(k, table, n_tokens, n_kv_heads, head_dim, mode);
        self.kv_store(layer, k, v, plan);
    }
    /// Causal multi-head attention of the batch's queries over the cache, through the block tables
    /// of `plan`. `q` has `n_heads * head_dim` values per token; the layer has `n_kv_heads` heads
    /// (grouped-query attention when fewer). Keys older than `window` positions are masked when a
    /// window is given. Scores are multiplied by `kq_scale` before the softmax.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        q: &Self::Buf,
        layer: &Self::KvLayer,
        plan: &AttentionPlan,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kq_scale: f32,
        window: Option<usize>,
        out: &mut Self::Buf,
    );
}
