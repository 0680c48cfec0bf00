//! Launch wrappers for the row-wise and element-wise kernels: embedding lookup, RMSNorm, RoPE,
//! element-wise arithmetic, activations, row gathers, argmax and f32 to f16 conversion.
//!
//! Each wrapper checks the shape against what its kernel handles (32-bit counts; the kernel's own
//! file documents its launch), then queues the launch on the context's stream. The kernels' CPU
//! twins are the engine's CPU backend (engine/src/backend/cpu/ops.rs) and the harness's
//! reference functions (kernels/tests/harness.cu).

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;

use super::exact_elementwise;

use super::{
    as_u32, stride_launch, DeviceMatrix, GpuContext, OpsError, WeightFormat, BLOCK_THREADS,
};

/// How rotary position embedding pairs up the values of a head (GGML's modes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Llama: pairs are adjacent values `(2i, 2i + 1)`.
    Normal,
    /// NeoX (Gemma, Qwen): pairs are `(i, i + n_dims / 2)`.
    Neox,
}

fn ptr(p: DevicePtr) -> KernelArg {
    KernelArg::Ptr(p)
}

/// `out[t, :] = dequantise(table row ids[t]) * scale` for `n` ids (i32 on the device).
///
/// An id outside `0..table.rows` gives a row of NaNs (never an out-of-bounds read), which the
/// caller's output checks then show.
pub fn get_rows(
    ctx: &GpuContext,
    table: &DeviceMatrix,
    ids: DevicePtr,
    n: usize,
    scale: f32,
    out: DevicePtr,
) -> Result<(), OpsError> {
    if ctx.reference() {
        return exact_elementwise::get_rows_exact(ctx, table, ids, n, scale, out);
    }
    const OP: &str = "get_rows";
    if n == 0 {
        return Ok(());
    }
    let n = as_u32(OP, "the id count", n)?;
    let n_cols = as_u32(OP, "the table's column count", table.cols)?;
    let n_rows = as_u32(OP, "the table's row count", table.rows)?;
    if table.format.row_bytes(table.cols).is_none() {
        return Err(OpsError::shape(
            OP,
            format!(
                "a column count that is a multiple of {}",
                table.format.block_values()
            ),
            format!("{}", table.cols),
        ));
    }
    let name = get_rows_kernel(table.format);
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(table.ptr()))
        .arg(ptr(ids))
        .arg(KernelArg::U32(n_rows))
        .arg(KernelArg::U32(n_cols))
        .arg(KernelArg::F32(scale));
    // SAFETY: ember_get_rows_*(float* out, const uint8_t* table, const int32_t* ids, uint32_t
    // n_rows, uint32_t n_cols, float scale); one block per id reads one table row (ids are range
    // checked in the kernel) and writes n_cols floats of out's row; the caller sized out and ids.
    unsafe {
        ctx.launch(
            KernelModule::Embedding,
            name,
            LaunchConfig::linear(n, BLOCK_THREADS),
            &args,
        )
    }
}

/// The embedding kernel of `format` (a static name: no formatting on the launch path).
pub(super) fn get_rows_kernel(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::F32 => "ember_get_rows_f32",
        WeightFormat::F16 => "ember_get_rows_f16",
        WeightFormat::BF16 => "ember_get_rows_bf16",
        WeightFormat::Q4_0 => "ember_get_rows_q4_0",
        WeightFormat::Q4_1 => "ember_get_rows_q4_1",
        WeightFormat::Q5_0 => "ember_get_rows_q5_0",
        WeightFormat::Q5_1 => "ember_get_rows_q5_1",
        WeightFormat::Q8_0 => "ember_get_rows_q8_0",
        WeightFormat::Q2K => "ember_get_rows_q2_k",
        WeightFormat::Q3K => "ember_get_rows_q3_k",
        WeightFormat::Q4K => "ember_get_rows_q4_k",
        WeightFormat::Q5K => "ember_get_rows_q5_k",
        WeightFormat::Q6K => "ember_get_rows_q6_k",
    }
}

/// RMS normalisation of `n_rows` rows of `dim` values: `out = x / sqrt(mean(x^2) + eps) * weight`,
/// or without the weight when `weight` is [`DevicePtr::NULL`] (GGML's bare `ggml_rms_norm`).
/// `out` may equal `x`.
pub fn rms_norm(
    ctx: &GpuContext,
    x: DevicePtr,
    weight: DevicePtr,
    n_rows: usize,
    dim: usize,
    eps: f32,
    out: DevicePtr,
) -> Result<(), OpsError> {
    if ctx.reference() {
        if weight == DevicePtr::NULL {
            return Err(OpsError::Unsupported {
                op: "rms_norm",
                what: "reference numerics without a weight (the exact kernel multiplies by one)"
                    .into(),
            });
        }
        return exact_elementwise::rms_norm_exact(ctx, x, weight, n_rows, dim, eps, out);
    }
    const OP: &str = "rms_norm";
    if n_rows == 0 {
        return Ok(());
    }
    let n_rows = as_u32(OP, "the row count", n_rows)?;
    let dim = as_u32(OP, "the row length", dim)?;
    if dim == 0 {
        return Err(OpsError::shape(OP, "a row length above 0", "0"));
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(x))
        .arg(ptr(weight))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::F32(eps));
    let threads = norm_block_threads(dim);
    // SAFETY: ember_rms_norm_f32(float* out, const float* x, const float* weight, uint32_t n_cols,
    // float eps); one block per row touches only that row of x/out and dim weights (none when
    // the weight is null, which the kernel checks).
    unsafe {
        ctx.launch(
            KernelModule::Norm,
            "ember_rms_norm_f32",
            LaunchConfig::linear(n_rows, threads),
            &args,
        )
    }
}

/// Gemma 4's router input in one launch: `out[r] = rms_norm(x[r]) * scale * weight` for
/// `n_rows` rows of `dim` values, the bare norm (no weight of its own), then the scalar, then the
/// vector, each product rounded to f32 in that order: the values of [`rms_norm`] without a
/// weight, [`scale`] and [`mul`] with the row broadcast (same block size, so the same summation
/// order). `out` may be `x`. Fast numerics only (the reference numerics have no bare norm).
#[allow(clippy::too_many_arguments)]
pub fn rms_norm_scale_mul(
    ctx: &GpuContext,
    x: DevicePtr,
    weight: DevicePtr,
    n_rows: usize,
    dim: usize,
    eps: f32,
    scale: f32,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "rms_norm_scale_mul";
    let Some((n_rows, dim)) = gemma4_norm_rows(ctx, OP, n_rows, dim)? else {
        return Ok(());
    };
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(x))
        .arg(ptr(weight))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::F32(eps))
        .arg(KernelArg::F32(scale));
    // SAFETY: ember_rms_norm_scale_mul_f32(float* out, const float* x, const float* weight,
    // uint32_t n_cols, float eps, float scale); one block per row touches only that row of x/out
    // and the dim values of weight, which the caller sized.
    unsafe {
        ctx.launch(
            KernelModule::Norm,
            "ember_rms_norm_scale_mul_f32",
            LaunchConfig::linear(n_rows, norm_block_threads(dim)),
            &args,
        )
    }
}

/// RMS normalisation then a residual add in one launch: `x[r] = rms_norm(x[r]) * weight`, then
/// `dst[r] += x[r]`, for `n_rows` rows of `dim` values: the values of [`rms_norm`] in place and
/// [`add`] (same block size, so the same summation order). `dst` must be a buffer other than
/// `x`. Fast numerics only (the reference numerics' norm is another kernel).
pub fn rms_norm_add(
    ctx: &GpuContext,
    x: DevicePtr,
    weight: DevicePtr,
    n_rows: usize,
    dim: usize,
    eps: f32,
    dst: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "rms_norm_add";
    if ctx.reference() {
        return Err(OpsError::Unsupported {
            op: OP,
            what: "reference numerics (rms_norm then add runs the exact norm)".into(),
        });
    }
    if n_rows == 0 {
        return Ok(());
    }
    let n_rows = as_u32(OP, "the row count", n_rows)?;
    let dim = as_u32(OP, "the row length", dim)?;
    if dim == 0 {
        return Err(OpsError::shape(OP, "a row length above 0", "0"));
    }
    let args = KernelArgs::new()
        .arg(ptr(dst))
        .arg(ptr(x))
        .arg(ptr(weight))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::F32(eps));
    // SAFETY: ember_rms_norm_add_f32(float* dst, float* x, const float* weight, uint32_t n_cols,
    // float eps); one block per row touches only that row of x and dst and the dim values of
    // weight, which the caller sized.
    unsafe {
        ctx.launch(
            KernelModule::Norm,
            "ember_rms_norm_add_f32",
            LaunchConfig::linear(n_rows, norm_block_threads(dim)),
            &args,
        )
    }
}

/// The buffers of [`gemma4_ffn_inputs`]: f32 rows of `dim` values (`n_rows` of each) and weight
/// vectors of `dim` values.
#[derive(Clone, Copy, Debug)]
pub struct Gemma4FfnInputs {
    /// The residual stream; the normalised attention output is added to it.
    pub x: DevicePtr,
    /// The attention output; normalised in place.
    pub proj: DevicePtr,
    pub post_attn_norm: DevicePtr,
    pub ffn_norm: DevicePtr,
    pub pre_norm: DevicePtr,
    pub router_weight: DevicePtr,
    pub router_scale: f32,
    /// The dense FFN's input.
    pub xn: DevicePtr,
    /// The experts' input.
    pub moe_in: DevicePtr,
    /// The router's input.
    pub router_in: DevicePtr,
}

/// Gemma 4's step from attention to its FFN blocks in one launch: [`rms_norm_add`] of `proj`
/// into `x` (with `post_attn_norm`), then from the new `x` the dense FFN's input
/// ([`rms_norm`] with `ffn_norm`), the experts' input ([`rms_norm`] with `pre_norm`) and the
/// router's input ([`rms_norm_scale_mul`] with `router_scale` and `router_weight`), with the
/// values of those four launches (same block size, same expressions).
pub fn gemma4_ffn_inputs(
    ctx: &GpuContext,
    b: &Gemma4FfnInputs,
    n_rows: usize,
    dim: usize,
    eps: f32,
) -> Result<(), OpsError> {
    const OP: &str = "gemma4_ffn_inputs";
    let Some((n_rows, dim)) = gemma4_norm_rows(ctx, OP, n_rows, dim)? else {
        return Ok(());
    };
    let args = KernelArgs::new()
        .arg(ptr(b.x))
        .arg(ptr(b.proj))
        .arg(ptr(b.post_attn_norm))
        .arg(ptr(b.xn))
        .arg(ptr(b.ffn_norm))
        .arg(ptr(b.moe_in))
        .arg(ptr(b.pre_norm))
        .arg(ptr(b.router_in))
        .arg(ptr(b.router_weight))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::F32(eps))
        .arg(KernelArg::F32(b.router_scale));
    // SAFETY: ember_gemma4_ffn_inputs_f32(float* x, float* proj, const float* post_attn, float*
    // xn, const float* ffn_norm, float* moe_in, const float* pre_norm, float* router_in, const
    // float* router_weight, uint32_t n_cols, float eps, float router_scale); block r touches only
    // row r of x, proj, xn, moe_in and router_in and the dim values of each weight, which the
    // caller sized.
    unsafe {
        ctx.launch(
            KernelModule::Norm,
            "ember_gemma4_ffn_inputs_f32",
            LaunchConfig::linear(n_rows, norm_block_threads(dim)),
            &args,
        )
    }
}

/// The row count and length of a launch of Gemma 4's norm kernels (which reference numerics
/// lack), or `None` when there is no row to launch for.
fn gemma4_norm_rows(
    ctx: &GpuContext,
    op: &'static str,
    n_rows: usize,
    dim: usize,
) -> Result<Option<(u32, u32)>, OpsError> {
    if ctx.reference() {
        return Err(OpsError::Unsupported {
            op,
            what: "reference numerics (the exact kernels have no bare RMS norm)".into(),
        });
    }
    if n_rows == 0 {
        return Ok(None);
    }
    let n_rows = as_u32(op, "the row count", n_rows)?;
    let dim = as_u32(op, "the row length", dim)?;
    if dim == 0 {
        return Err(OpsError::shape(op, "a row length above 0", "0"));
    }
    Ok(Some((n_rows, dim)))
}

/// Threads per block of the row-normalisation kernels: wide rows get a full block, short ones a
/// block of their own size (rounded to 64). `rms_norm` and `add_rms_norm` must agree on it, since
/// the block size fixes the order in which a row's squares are summed.
fn norm_block_threads(dim: u32) -> u32 {
    dim.next_multiple_of(64).clamp(64, 1024)
}

/// Residual add fused with the next RMS normalisation: `x[r] += proj[r]`, then
/// `out[r] = rms_norm(x[r]) * weight` for `n_rows` rows of `dim` values. Gives exactly the values
/// of [`add`] followed by [`rms_norm`] (same block size, so the same summation order), in one
/// launch. `out` must be a buffer other than `x` and `proj`.
#[allow(clippy::too_many_arguments)]
pub fn add_rms_norm(
    ctx: &GpuContext,
    x: DevicePtr,
    proj: DevicePtr,
    weight: DevicePtr,
    n_rows: usize,
    dim: usize,
    eps: f32,
    out: DevicePtr,
) -> Result<(), OpsError> {
    if ctx.reference() {
        return exact_elementwise::add_rms_norm_exact(ctx, x, proj, weight, n_rows, dim, eps, out);
    }
    const OP: &str = "add_rms_norm";
    if n_rows == 0 {
        return Ok(());
    }
    if out == x || out == proj {
        return Err(OpsError::shape(
            OP,
            "an output buffer other than x and proj",
            "the same buffer",
        ));
    }
    let n_rows = as_u32(OP, "the row count", n_rows)?;
    let dim = as_u32(OP, "the row length", dim)?;
    if dim == 0 {
        return Err(OpsError::shape(OP, "a row length above 0", "0"));
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(x))
        .arg(ptr(proj))
        .arg(ptr(weight))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::F32(eps));
    // The block size rms_norm uses (one rule for both): the same threads own the same columns,
    // so the sum of squares is taken in the same order, bit for bit that of add + rms_norm.
    let threads = norm_block_threads(dim);
    // SAFETY: ember_add_rms_norm_f32(float* out, float* x, const float* proj, const float*
    // weight, uint32_t n_cols, float eps); one block per row touches only that row of x, proj and
    // out, and dim weights.
    unsafe {
        ctx.launch(
            KernelModule::Norm,
            "ember_add_rms_norm_f32",
            LaunchConfig::linear(n_rows, threads),
            &args,
        )
    }
}

/// Checks an element count and launches a grid-stride kernel of `module`.
/// An element count for a grid-stride kernel. The kernels index with 32-bit counters, and the
/// last stride must not wrap around 2^32, so counts stay below 2^31.
fn stride_count(op: &'static str, n: usize) -> Result<u32, OpsError> {
    if n > i32::MAX as usize {
        return Err(OpsError::shape(
            op,
            "an element count below 2^31",
            format!("{n}"),
        ));
    }
    Ok(n as u32)
}

fn stride_kernel(
    ctx: &GpuContext,
    op: &'static str,
    name: &str,
    n: usize,
    args: KernelArgs,
) -> Result<(), OpsError> {
    let n = stride_count(op, n)?;
    // SAFETY: every caller passes `name`'s exact parameter list, and each kernel touches elements
    // below n (grid-stride loop) of buffers the caller sized for n elements.
    unsafe { ctx.launch(KernelModule::Elementwise, name, stride_launch(n), &args) }
}

/// `out[i] = a[i] + b[i % n_b]` for `i < n` (`n_b = n` adds; `n_b = dim` adds a bias per row).
/// `out` may equal `a`.
pub fn add(
    ctx: &GpuContext,
    out: DevicePtr,
    a: DevicePtr,
    b: DevicePtr,
    n: usize,
    n_b: usize,
) -> Result<(), OpsError> {
    broadcast(ctx, "add", "ember_add_f32", out, a, b, n, n_b)
}

/// `out[i] = a[i] * b[i % n_b]` for `i < n` (`n_b = dim` scales every row by one weight vector,
/// GGML's broadcast `ggml_mul`). `out` may equal `a`.
pub fn mul(
    ctx: &GpuContext,
    out: DevicePtr,
    a: DevicePtr,
    b: DevicePtr,
    n: usize,
    n_b: usize,
) -> Result<(), OpsError> {
    broadcast(ctx, "mul", "ember_mul_f32", out, a, b, n, n_b)
}

/// The binary kernels with a broadcast second operand (`ember_add_f32`, `ember_mul_f32`).
#[allow(clippy::too_many_arguments)]
fn broadcast(
    ctx: &GpuContext,
    op: &'static str,
    name: &'static str,
    out: DevicePtr,
    a: DevicePtr,
    b: DevicePtr,
    n: usize,
    n_b: usize,
) -> Result<(), OpsError> {
    if n == 0 {
        return Ok(());
    }
    if n_b == 0 || !n.is_multiple_of(n_b) {
        return Err(OpsError::shape(
            op,
            format!("a broadcast length dividing {n}"),
            format!("{n_b}"),
        ));
    }
    let n_b = as_u32(op, "the broadcast length", n_b)?;
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(a))
        .arg(ptr(b))
        .arg(KernelArg::U32(stride_count(op, n)?))
        .arg(KernelArg::U32(n_b));
    stride_kernel(ctx, op, name, n, args)
}

/// `out[i] = x[i] * scale` for `i < n`. `out` may equal `x`.
pub fn scale(
    ctx: &GpuContext,
    out: DevicePtr,
    x: DevicePtr,
    scale: f32,
    n: usize,
) -> Result<(), OpsError> {
    const OP: &str = "scale";
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(x))
        .arg(KernelArg::F32(scale))
        .arg(KernelArg::U32(stride_count(OP, n)?));
    stride_kernel(ctx, OP, "ember_scale_f32", n, args)
}

/// In place `x[i] = cap * tanh(x[i] / cap)` for `i < n` (Gemma's logit soft-capping).
pub fn softcap(ctx: &GpuContext, x: DevicePtr, n: usize, cap: f32) -> Result<(), OpsError> {
    const OP: &str = "softcap";
    if n == 0 {
        return Ok(());
    }
    if !(cap.is_finite() && cap > 0.0) {
        return Err(OpsError::shape(
            OP,
            "a positive finite cap",
            format!("{cap}"),
        ));
    }
    let args = KernelArgs::new()
        .arg(ptr(x))
        .arg(ptr(x))
        .arg(KernelArg::F32(cap))
        .arg(KernelArg::U32(stride_count(OP, n)?));
    stride_kernel(ctx, OP, "ember_softcap_f32", n, args)
}

/// SwiGLU: `out[i] = silu(gate[i]) * up[i]`. `out` may equal `gate` or `up`.
pub fn swiglu(
    ctx: &GpuContext,
    out: DevicePtr,
    gate: DevicePtr,
    up: DevicePtr,
    n: usize,
) -> Result<(), OpsError> {
    if ctx.reference() {
        return exact_elementwise::swiglu_exact(ctx, out, gate, up, n);
    }
    glu(ctx, "swiglu", "ember_silu_mul_f32", out, gate, up, n)
}

/// GeGLU: `out[i] = gelu(gate[i]) * up[i]`, GELU with the tanh approximation evaluated as GGML's
/// CPU path does (input and GELU rounded to f16; exact limits beyond +-10), so GPU and CPU agree.
/// `out` may equal `gate` or `up`.
pub fn geglu(
    ctx: &GpuContext,
    out: DevicePtr,
    gate: DevicePtr,
    up: DevicePtr,
    n: usize,
) -> Result<(), OpsError> {
    glu(ctx, "geglu", "ember_gelu_mul_f32", out, gate, up, n)
}

fn glu(
    ctx: &GpuContext,
    op: &'static str,
    name: &str,
    out: DevicePtr,
    gate: DevicePtr,
    up: DevicePtr,
    n: usize,
) -> Result<(), OpsError> {
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(gate))
        .arg(ptr(up))
        .arg(KernelArg::U32(stride_count(op, n)?));
    stride_kernel(ctx, op, name, n, args)
}

/// Rotary position embedding, in place on `x` `[n_tokens, n_heads, head_dim]`: token `t` is
/// rotated by `positions[t]` (i32 on the device). The first `n_dims` values of each head are
/// rotated, the rest are left as they are. Pair `i` turns by
/// `freq_scale * (p * base^(-2i / n_dims)) / freq_factors[i]` (no factors: 1), the power built by
/// repeated f32 multiplication as GGML's (and ember's CPU) tables are.
#[allow(clippy::too_many_arguments)]
pub fn rope(
    ctx: &GpuContext,
    x: DevicePtr,
    positions: DevicePtr,
    n_tokens: usize,
    n_heads: usize,
    head_dim: usize,
    n_dims: usize,
    mode: RopeMode,
    freq_base: f32,
    freq_scale: f32,
    freq_factors: Option<DevicePtr>,
) -> Result<(), OpsError> {
    const OP: &str = "rope";
    if n_tokens == 0 || n_heads == 0 || n_dims == 0 {
        return Ok(());
    }
    if !n_dims.is_multiple_of(2) || n_dims > head_dim {
        return Err(OpsError::shape(
            OP,
            format!("an even rotated dimension count of at most the head size {head_dim}"),
            format!("{n_dims}"),
        ));
    }
    let n_blocks = n_tokens.saturating_mul(n_heads);
    let n_blocks = as_u32(OP, "tokens times heads", n_blocks)?;
    // The same f32 value the CPU backend multiplies by (engine/src/backend/cpu/mod.rs).
    let theta_scale = freq_base.powf(-2.0 / n_dims as f32);
    let name = match mode {
        RopeMode::Normal => "ember_rope_norm_f32",
        RopeMode::Neox => "ember_rope_neox_f32",
    };
    let args = KernelArgs::new()
        .arg(ptr(x))
        .arg(ptr(positions))
        .arg(ptr(freq_factors.unwrap_or(DevicePtr::NULL)))
        .arg(KernelArg::U32(as_u32(OP, "the head count", n_heads)?))
        .arg(KernelArg::U32(as_u32(OP, "the head size", head_dim)?))
        .arg(KernelArg::U32(as_u32(
            OP,
            "the rotated dimensions",
            n_dims,
        )?))
        .arg(KernelArg::F32(theta_scale))
        .arg(KernelArg::F32(freq_scale));
    let threads = ((n_dims / 2) as u32).next_multiple_of(32).clamp(32, 256);
    // SAFETY: ember_rope_*_f32(float* x, const int32_t* positions, const float* freq_factors,
    // uint32_t n_heads, uint32_t head_dim, uint32_t n_dims, float theta_scale, float freq_scale);
    // block b rotates head b of x (n_tokens * n_heads heads) reading positions[b / n_heads] and,
    // when not null, n_dims / 2 factors.
    unsafe {
        ctx.launch(
            KernelModule::Rope,
            name,
            LaunchConfig::linear(n_blocks, threads),
            &args,
        )
    }
}

/// The arguments of [`rope_kv_store`].
#[derive(Clone, Copy, Debug)]
pub struct RopeKvStoreArgs {
    /// f32 `[n_tokens, n_heads, head_dim]`, rotated in place.
    pub q: DevicePtr,
    /// f32 `[n_tokens, n_kv_heads, head_dim]`, rotated in place and stored.
    pub k: DevicePtr,
    /// f32 `[n_tokens, n_kv_heads, head_dim]`, stored.
    pub v: DevicePtr,
    /// i32 `[n_tokens]`: the position of each token.
    pub positions: DevicePtr,
    /// `n_dims / 2` f32 frequency divisors, or none.
    pub freq_factors: Option<DevicePtr>,
    pub n_tokens: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub n_dims: usize,
    pub mode: RopeMode,
    pub freq_base: f32,
    pub freq_scale: f32,
    /// u64 device addresses of the K blocks and the V blocks (as [`super::kv_store`] takes them).
    pub k_blocks: DevicePtr,
    pub v_blocks: DevicePtr,
    /// i32 `[n_tokens]`: `block * block_size + offset`, negative for none.
    pub slots: DevicePtr,
    pub block_size: usize,
    /// QK-norm: per-head RMS-norm weights (`head_dim` f32 each) applied to the q and the k heads
    /// before rope, with `norm_eps`, as [`rms_norm`] of `n_tokens * heads` rows of `head_dim`
    /// would; none skips that norm.
    pub q_norm: Option<DevicePtr>,
    pub k_norm: Option<DevicePtr>,
    pub norm_eps: f32,
}

/// [`rope`] of q, [`rope`] of k and [`super::kv_store`] of the rotated k and of v, in one launch
/// with the same values (the same expressions in one kernel, kernels/rope.hip). With
/// `q_norm` / `k_norm`, [`rms_norm`] of each q / k head comes first, in the same launch and with
/// the same bits (the block size of [`rms_norm`] for `head_dim`, so the same summation order).
/// For the decode step, where these are tiny launches each.
pub fn rope_kv_store(ctx: &GpuContext, a: &RopeKvStoreArgs) -> Result<(), OpsError> {
    const OP: &str = "rope_kv_store";
    if a.n_tokens == 0 || a.head_dim == 0 || (a.n_heads == 0 && a.n_kv_heads == 0) {
        return Ok(());
    }
    if !a.n_dims.is_multiple_of(2) || a.n_dims > a.head_dim {
        return Err(OpsError::shape(
            OP,
            format!(
                "an even rotated dimension count of at most the head size {}",
                a.head_dim
            ),
            format!("{}", a.n_dims),
        ));
    }
    if a.block_size == 0 {
        return Err(OpsError::shape(OP, "a block size above 0", "0"));
    }
    let heads = a.n_heads.saturating_add(a.n_kv_heads);
    let n_blocks = as_u32(OP, "tokens times heads", a.n_tokens.saturating_mul(heads))?;
    as_u32(
        OP,
        "a KV row",
        a.n_kv_heads
            .saturating_mul(a.head_dim)
            .saturating_mul(a.block_size),
    )?;
    // The same f32 value rope (and the CPU backend) multiplies by.
    let theta_scale = if a.n_dims == 0 {
        1.0
    } else {
        a.freq_base.powf(-2.0 / a.n_dims as f32)
    };
    let name = match a.mode {
        RopeMode::Normal => "ember_rope_kv_store_norm_f32",
        RopeMode::Neox => "ember_rope_kv_store_neox_f32",
    };
    let args = KernelArgs::new()
        .arg(ptr(a.q))
        .arg(ptr(a.k))
        .arg(ptr(a.v))
        .arg(ptr(a.positions))
        .arg(ptr(a.freq_factors.unwrap_or(DevicePtr::NULL)))
        .arg(KernelArg::U32(as_u32(OP, "the token count", a.n_tokens)?))
        .arg(KernelArg::U32(as_u32(OP, "the head count", a.n_heads)?))
        .arg(KernelArg::U32(as_u32(
            OP,
            "the KV head count",
            a.n_kv_heads,
        )?))
        .arg(KernelArg::U32(as_u32(OP, "the head size", a.head_dim)?))
        .arg(KernelArg::U32(as_u32(
            OP,
            "the rotated dimensions",
            a.n_dims,
        )?))
        .arg(KernelArg::F32(theta_scale))
        .arg(KernelArg::F32(a.freq_scale))
        .arg(ptr(a.k_blocks))
        .arg(ptr(a.v_blocks))
        .arg(ptr(a.slots))
        .arg(KernelArg::U32(as_u32(OP, "the block size", a.block_size)?))
        .arg(ptr(a.q_norm.unwrap_or(DevicePtr::NULL)))
        .arg(ptr(a.k_norm.unwrap_or(DevicePtr::NULL)))
        .arg(KernelArg::F32(a.norm_eps));
    let head_dim = as_u32(OP, "the head size", a.head_dim)?;
    let threads = if a.q_norm.is_some() || a.k_norm.is_some() {
        // The norm's summation order is its block size's: rms_norm's for a row of head_dim.
        norm_block_threads(head_dim)
    } else {
        (head_dim / 2).next_multiple_of(32).clamp(32, 256)
    };
    // SAFETY: ember_rope_kv_store_{norm,neox}_f32(float* q, float* k, const float* v, const
    // int32_t* positions, const float* freq_factors, uint32_t n_tokens, uint32_t n_heads,
    // uint32_t n_kv_heads, uint32_t head_dim, uint32_t n_dims, float theta_scale, float
    // freq_scale, const uint64_t* k_blocks, const uint64_t* v_blocks, const int32_t* slots,
    // uint32_t block_size, const float* q_norm, const float* k_norm, float eps); block
    // b < n_tokens * n_heads normalises (with a q_norm) and rotates head b of q, the others head
    // b - n_tokens * n_heads of k and store it and the same head of v into the block its token's
    // slot names (the caller's buffers hold n_tokens rows of each; the block tables as for
    // kv_store; the norm weights, when given, head_dim values each).
    unsafe {
        ctx.launch(
            KernelModule::Rope,
            name,
            LaunchConfig::linear(n_blocks, threads),
            &args,
        )
    }
}

/// `out[i, :] = src[rows[i], :]` for `n` rows of `dim` f32 values (`rows` i32 on the device).
pub fn gather_rows(
    ctx: &GpuContext,
    src: DevicePtr,
    dim: usize,
    rows: DevicePtr,
    n: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "gather_rows";
    if n == 0 || dim == 0 {
        return Ok(());
    }
    let n = as_u32(OP, "the row count", n)?;
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(src))
        .arg(ptr(rows))
        .arg(KernelArg::U32(as_u32(OP, "the row length", dim)?));
    // SAFETY: ember_gather_rows_f32(float* out, const float* src, const int32_t* rows, uint32_t
    // dim); block i copies dim floats from row rows[i] of src to row i of out, which the caller
    // sized for n rows and for every listed row.
    unsafe {
        ctx.launch(
            KernelModule::Embedding,
            "ember_gather_rows_f32",
            LaunchConfig::linear(n, BLOCK_THREADS),
            &args,
        )
    }
}

/// [`gather_rows`] of the `n` rows `first, first + stride, ...` of `src` (rows of `dim` values),
/// with no row list on the device.
pub fn gather_rows_strided(
    ctx: &GpuContext,
    src: DevicePtr,
    dim: usize,
    first: usize,
    stride: usize,
    n: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "gather_rows_strided";
    if n == 0 || dim == 0 {
        return Ok(());
    }
    let last = (n - 1)
        .checked_mul(stride)
        .and_then(|d| d.checked_add(first))
        .ok_or_else(|| {
            OpsError::shape(
                OP,
                "rows that fit in memory",
                format!("{n} rows from {first} by {stride}"),
            )
        })?;
    as_u32(OP, "the last row", last)?;
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(src))
        .arg(KernelArg::U32(as_u32(OP, "the first row", first)?))
        .arg(KernelArg::U32(as_u32(OP, "the row stride", stride)?))
        .arg(KernelArg::U32(as_u32(OP, "the row length", dim)?));
    // SAFETY: ember_gather_rows_strided_f32(float* out, const float* src, uint32_t first,
    // uint32_t stride, uint32_t dim); block i copies dim floats from row first + i * stride of
    // src to row i of out; the caller sized src for row `last` and out for n rows.
    unsafe {
        ctx.launch(
            KernelModule::Embedding,
            "ember_gather_rows_strided_f32",
            LaunchConfig::linear(as_u32(OP, "the row count", n)?, BLOCK_THREADS),
            &args,
        )
    }
}

/// Values of a row that one block of the first argmax pass reads (argmax.hip's
/// EMBER_ARGMAX_PART).
const ARGMAX_PART: usize = 1024;

/// Bytes of the `parts` scratch of [`argmax`] for `n_rows` rows of `n_cols` values: a value and
/// an index per part of each row.
pub fn argmax_scratch_bytes(n_rows: usize, n_cols: usize) -> usize {
    n_rows
        .saturating_mul(n_cols.div_ceil(ARGMAX_PART))
        .saturating_mul(8)
}

/// `out[r] = argmax_c x[r, c]` (i32, ties to the lowest index, -inf never chosen), or -1 for a
/// row holding NaN or +inf, for `n_rows` rows of `n_cols`. Two launches: each row's parts of
/// 1024 values by a block each (their winners into `parts`, [`argmax_scratch_bytes`] bytes),
/// then one block per row over its parts; the result does not depend on the split.
pub fn argmax(
    ctx: &GpuContext,
    x: DevicePtr,
    n_rows: usize,
    n_cols: usize,
    parts: DevicePtr,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "argmax";
    if n_rows == 0 {
        return Ok(());
    }
    // Parts are the grid's second dimension (at most 65,535 blocks).
    let max_cols = 65_535 * ARGMAX_PART;
    if n_cols == 0 || n_cols > max_cols {
        return Err(OpsError::shape(
            OP,
            format!("a row length between 1 and {max_cols}"),
            format!("{n_cols}"),
        ));
    }
    let rows = as_u32(OP, "the row count", n_rows)?;
    let n_parts = n_cols.div_ceil(ARGMAX_PART);
    let part_slots = as_u32(OP, "rows times parts", n_rows.saturating_mul(n_parts))?;
    let part_indices = parts.offset(u64::from(part_slots) * 4);
    let partial = KernelArgs::new()
        .arg(ptr(parts))
        .arg(ptr(part_indices))
        .arg(ptr(x))
        .arg(KernelArg::U32(n_cols as u32));
    let config = LaunchConfig {
        grid: [rows, n_parts as u32, 1],
        block: [256, 1, 1],
        shared_mem_bytes: 0,
    };
    // SAFETY: ember_argmax_partial_f32(float* part_values, int32_t* part_indices, const float*
    // x, uint32_t n_cols); block (r, p) reads values p * 1024.. of row r of x and writes part
    // slot r * n_parts + p of both arrays, which lie in the argmax_scratch_bytes of `parts`;
    // 256 threads is a multiple of every warp size.
    unsafe {
        ctx.launch(
            KernelModule::Argmax,
            "ember_argmax_partial_f32",
            config,
            &partial,
        )
    }?;
    let merge = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(parts))
        .arg(ptr(part_indices))
        .arg(KernelArg::U32(n_parts as u32));
    // SAFETY: ember_argmax_merge_f32(int32_t* out, const float* part_values, const int32_t*
    // part_indices, uint32_t n_parts); block r reads row r's n_parts slots (written by the
    // launch above on the same stream) and writes out[r], which the caller sized for n_rows.
    unsafe {
        ctx.launch(
            KernelModule::Argmax,
            "ember_argmax_merge_f32",
            LaunchConfig::linear(rows, 256),
            &merge,
        )
    }
}

/// `out[i] = (f16) x[i]` (round to nearest even) for `i < n`: activations for the f16 GEMM.
pub fn convert_f32_to_f16(
    ctx: &GpuContext,
    out: DevicePtr,
    x: DevicePtr,
    n: usize,
) -> Result<(), OpsError> {
    const OP: &str = "convert_f32_to_f16";
    if n == 0 {
        return Ok(());
    }
    let args = KernelArgs::new()
        .arg(ptr(out))
        .arg(ptr(x))
        .arg(KernelArg::U32(stride_count(OP, n)?));
    stride_kernel(ctx, OP, "ember_convert_f16_f32", n, args)
}
