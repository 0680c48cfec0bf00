//! `matmul`: `out[t] = W x[t]` for a weight matrix in any [`WeightFormat`] and f32 activations.
//!
//! Four paths, chosen by the number of tokens:
//! - decode (at most [`MATVEC_MAX_TOKENS`] tokens): the quantised matrix-vector kernel
//!   (`ops::matvec`), which reads each weight once per token straight from its blocks;
//! - batched decode and short prompts (up to [`MMQ_MAX_TOKENS`] tokens, integer formats but q2_K
//!   and q3_K): the quantised matrix kernel (`ops::mmq`), which reads each weight block once per
//!   64 tokens and multiplies int8 tiles, with the activations rounded as for the matrix-vector
//!   kernel. On GPUs with int8 tensor cores it takes over from the matrix-vector kernel below
//!   [`MATVEC_MAX_TOKENS`] already (from 4 tokens for the k-quants, 8 for the others: see
//!   [`auto_path`]);
//! - prefill with BLAS: the weights are expanded to f16 in scratch memory (`dequantize.hip`), the
//!   activations converted to f16, and the vendor GEMM multiplies them with f32 accumulation. The
//!   expansion is a memory pass over the weights, small next to the GEMM's arithmetic once many
//!   tokens share it;
//! - prefill without BLAS: ember's tiled GEMM kernel (`gemm.hip`), which dequantises weight tiles
//!   on the fly into shared memory and accumulates in f32.
//!
//! Row-major to column-major: W is stored row-major `[rows, cols]`, which BLAS (column-major)
//! reads as the `cols x rows` matrix `W^T` with leading dimension `cols`; likewise x `[n, cols]`
//! is `x^T` (`cols x n`, ld `cols`) and out `[n, rows]` is `out^T` (`rows x n`, ld `rows`).
//! `out^T = W x^T`, i.e. `C = op(A) B` with `A` the stored `W^T` transposed (`Op::T`), `B` the
//! stored `x^T` as is (`Op::N`), `m = rows`, `n = n_tokens`, `k = cols`.
//!
//! Scratch buffers come from the pool (purpose scratch) and are dropped right after the launches
//! that use them are queued. That is safe because every op runs on the context's one stream: the
//! pool may hand the memory to the next allocation at once, but whatever writes it next is queued
//! after the kernels that read it now; and the pool's trims synchronise the device before giving
//! memory back to the driver (pool/mod.rs). cuBLAS and hipBLAS allocate their own small
//! workspace outside the pool on first use.

use crate::blas::Op;
use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;
use crate::pool::Purpose;

use super::elementwise::convert_f32_to_f16;
use super::exact_matmul;
use super::matvec::{has_glu_kernels, matvec, matvec_glu, matvec_multi, shared_fits_one_token};
use super::mmq::{has_mmq_kernels, mmq};
use super::{as_u32, DeviceMatrix, GpuContext, OpsError, WeightFormat};

/// Up to this many tokens `matmul` uses the matrix-vector kernel; beyond, the quantised matrix
/// kernel or a GEMM. On GPUs with int8 tensor cores the quantised matrix kernel takes over earlier
/// for the formats it covers (see [`auto_path`]). The environment variable
/// [`MATVEC_MAX_TOKENS_ENV`] overrides it, for every format (for measuring the crossover).
pub const MATVEC_MAX_TOKENS: usize = 8;

/// Environment variable overriding [`MATVEC_MAX_TOKENS`] (a positive integer).
pub const MATVEC_MAX_TOKENS_ENV: &str = "EMBER_MATVEC_MAX_TOKENS";

/// The token count up to which `matmul` takes the matrix-vector path: [`MATVEC_MAX_TOKENS_ENV`]
/// when set to a positive integer (read once), else [`MATVEC_MAX_TOKENS`].
pub fn matvec_max_tokens() -> usize {
    static VALUE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| {
        std::env::var(MATVEC_MAX_TOKENS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&v| v > 0)
            .unwrap_or(MATVEC_MAX_TOKENS)
    })
}

/// Up to this many tokens `matmul` uses the quantised matrix kernel (`ops::mmq`) for the formats
/// it covers; beyond, the BLAS GEMM (or the tiled kernel without BLAS). Measured on an H200
/// against dequantisation plus cuBLAS on the Llama-3.1-8B shapes (`examples/matmul_bench.rs`):
/// at 64 tokens mmq is 1.2 to 1.6 times faster for q4_K on every shape and within 8% either way
/// for q4_0 and q6_K; from 96 tokens on the GEMM wins except on the smallest matrices.
/// The environment variable [`MMQ_MAX_TOKENS_ENV`] overrides it (`0` turns the path off).
pub const MMQ_MAX_TOKENS: usize = 64;

/// Environment variable overriding [`MMQ_MAX_TOKENS`] (a non-negative integer).
pub const MMQ_MAX_TOKENS_ENV: &str = "EMBER_MMQ_MAX_TOKENS";

/// The token count up to which `matmul` takes the quantised matrix path: [`MMQ_MAX_TOKENS_ENV`]
/// when set to an integer (read once), else [`MMQ_MAX_TOKENS`].
pub fn mmq_max_tokens() -> usize {
    static VALUE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| {
        std::env::var(MMQ_MAX_TOKENS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(MMQ_MAX_TOKENS)
    })
}

/// Which implementation [`matmul_with`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatmulPath {
    /// By token count and BLAS availability (what [`matmul`] does).
    Auto,
    /// The matrix-vector kernel, whatever the token count.
    MatVec,
    /// The quantised matrix kernel, whatever the token count (an error for formats it does not
    /// cover: f32, f16, bf16, q2_K, q3_K).
    Mmq,
    /// Dequantise to f16 and call the vendor GEMM (an error without BLAS).
    Blas,
    /// ember's tiled GEMM kernel.
    Tiled,
}

/// Tile of the tiled GEMM kernel: rows of W and tokens per block (gemm.hip's EMBER_GEMM_TILE_*).
const GEMM_TILE_ROWS: usize = 64;
const GEMM_TILE_TOKENS: usize = 64;
const GEMM_THREADS: u32 = 256;
/// grid.y limit of every runtime.
const MAX_GRID_Y: usize = 65_535;

/// `out[t, :] = W x[t, :]` for `n_tokens` rows of x (`w.cols` f32 each) into `n_tokens` rows of
/// out (`w.rows` f32 each). Asynchronous on the context's stream.
pub fn matmul(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    matmul_with(ctx, w, x, n_tokens, out, MatmulPath::Auto)
}

/// The gated activation of an FFN's input projections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Glu {
    /// SwiGLU: `silu(gate) * up` (as [`super::swiglu`]).
    SwiGlu,
    /// GeGLU: `gelu(gate) * up` (as [`super::geglu`]).
    GeGlu,
}

/// Environment variable that turns the fused decode kernels off (`0`): [`matmul_glu`] and
/// [`super::add_rms_norm`]'s callers then run the separate ops, for A/B measurements.
pub const FUSION_ENV: &str = "EMBER_GPU_FUSION";

/// Whether the fused decode kernels are used: unless [`FUSION_ENV`] is `0` (read once).
pub fn fusion_enabled() -> bool {
    static VALUE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| std::env::var(FUSION_ENV).map_or(true, |v| v.trim() != "0"))
}

/// An FFN's gated input: `out[t] = act(gate x[t]) * (up x[t])` for `n_tokens` rows of x.
/// For one token with `gate` and `up` in the same format and shape (the decode case) it is one
/// kernel that reads both matrices once and writes only `out`, with the values of the unfused
/// ops; otherwise it runs [`matmul`] for both (the up projection into `up_out`, a buffer of
/// `n_tokens * up.rows` values) and the element-wise activation. `out` may not alias `x` or
/// `up_out`.
#[allow(clippy::too_many_arguments)]
pub fn matmul_glu(
    ctx: &GpuContext,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    glu: Glu,
    out: DevicePtr,
    up_out: DevicePtr,
) -> Result<(), OpsError> {
    let fused = n_tokens == 1
        && fusion_enabled()
        && matvec_max_tokens() >= 1
        && gate.format == up.format
        && gate.rows == up.rows
        && gate.cols == up.cols
        && has_glu_kernels(gate.format)
        && gate.cols > 0
        && gate.cols.is_multiple_of(32)
        && shared_fits_one_token(gate.format, gate.cols);
    let name = match glu {
        Glu::SwiGlu => "swiglu",
        Glu::GeGlu => "geglu",
    };
    if fused {
        return matvec_glu(ctx, gate, up, x, name, out);
    }
    if gate.rows != up.rows {
        return Err(OpsError::shape(
            "matmul_glu",
            format!("an up projection of {} rows like the gate", gate.rows),
            format!("{}", up.rows),
        ));
    }
    matmul(ctx, gate, x, n_tokens, out)?;
    matmul(ctx, up, x, n_tokens, up_out)?;
    let n = n_tokens * gate.rows;
    match glu {
        Glu::SwiGlu => super::swiglu(ctx, out, out, up_out, n),
        Glu::GeGlu => super::geglu(ctx, out, out, up_out, n),
    }
}

/// `outs[i] = ws[i] x` for several matrices sharing one input (Q, K and V), `n_tokens` rows of
/// x. For one token, consecutive matrices of the same format and column count run as one launch
/// (one pass over the activations; the values equal separate [`matmul`]s); everything else runs
/// [`matmul`] per matrix.
pub fn matmul_shared(
    ctx: &GpuContext,
    ws: &[&DeviceMatrix],
    x: DevicePtr,
    n_tokens: usize,
    outs: &[DevicePtr],
) -> Result<(), OpsError> {
    if ws.len() != outs.len() {
        return Err(OpsError::shape(
            "matmul_shared",
            format!("{} outputs, one per matrix", ws.len()),
            format!("{}", outs.len()),
        ));
    }
    // Reference numerics take the matrices one by one: the CPU quantizes the shared input once
    // per matrix, each time to the same bits, so products one by one are its products.
    let fusable = |w: &DeviceMatrix| {
        n_tokens == 1
            && !ctx.reference()
            && fusion_enabled()
            && matvec_max_tokens() >= 1
            && has_glu_kernels(w.format)
            && w.cols > 0
            && w.cols.is_multiple_of(32)
            && shared_fits_one_token(w.format, w.cols)
    };
    let mut i = 0;
    while i < ws.len() {
        // The run of matrices from i on that share i's format and column count (at most 3).
        let mut end = i + 1;
        while end < ws.len()
            && end - i < 3
            && fusable(ws[i])
            && ws[end].format == ws[i].format
            && ws[end].cols == ws[i].cols
        {
            end += 1;
        }
        if end - i >= 2 {
            matvec_multi(ctx, &ws[i..end], x, &outs[i..end])?;
        } else {
            matmul(ctx, ws[i], x, n_tokens, outs[i])?;
        }
        i = end;
    }
    Ok(())
}

/// Whether [`MATVEC_MAX_TOKENS_ENV`] was set (read once): the matrix-vector boundary then holds
/// for every format and device.
fn matvec_max_tokens_overridden() -> bool {
    static VALUE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| std::env::var_os(MATVEC_MAX_TOKENS_ENV).is_some())
}

/// Whether `arch` is an NVIDIA architecture with int8 tensor-core instructions (`sm_80` and
/// newer), where the quantised matrix kernel multiplies on them.
fn has_int8_tensor_cores(arch: &str) -> bool {
    arch.strip_prefix("sm_")
        .map(|digits| digits.trim_end_matches(|c: char| c.is_ascii_alphabetic()))
        .and_then(|digits| digits.parse::<u32>().ok())
        .is_some_and(|number| number >= 80)
}

/// The smallest token count for which [`auto_path`] prefers the quantised matrix kernel over the
/// matrix-vector kernel. With int8 tensor cores, measured on an H200 over the matrices of a
/// Llama-3.1-8B layer (`examples/matmul_bench.rs`): from 4 tokens for the k-quants, whose
/// matrix-vector kernels fit only two tokens of a 14336-column row in shared memory and so read
/// the FFN's down projection once per two tokens (a q4_K layer's seven matrices at 4 tokens:
/// 184 us against 246 us; at 8 tokens 185 us against 469 us), and from 8 tokens for the 32-value
/// formats (a q4_0 layer at 8 tokens: 246 us against 300 us; at 4, 245 us against 161 us).
/// Elsewhere the boundary stays at [`matvec_max_tokens`].
fn mmq_min_tokens(ctx: &GpuContext, format: WeightFormat) -> usize {
    if matvec_max_tokens_overridden() || !has_int8_tensor_cores(ctx.arch()) {
        return matvec_max_tokens() + 1;
    }
    if format.block_values() == 256 {
        4
    } else {
        8
    }
}

/// The path [`matmul`] takes for `n_tokens` tokens of `w` on `ctx` (never `Auto`).
pub fn auto_path(ctx: &GpuContext, w: &DeviceMatrix, n_tokens: usize) -> MatmulPath {
    let mmq = has_mmq_kernels(w.format) && n_tokens <= mmq_max_tokens();
    if mmq && n_tokens >= mmq_min_tokens(ctx, w.format) {
        MatmulPath::Mmq
    } else if n_tokens <= matvec_max_tokens() {
        MatmulPath::MatVec
    } else if mmq {
        MatmulPath::Mmq
    } else if ctx.blas_handle().is_some() {
        MatmulPath::Blas
    } else {
        MatmulPath::Tiled
    }
}

/// [`matmul`] on a chosen path.
pub fn matmul_with(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
    path: MatmulPath,
) -> Result<(), OpsError> {
    if ctx.reference() {
        return exact_matmul::matmul_exact(ctx, w, x, n_tokens, out);
    }
    const OP: &str = "matmul";
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    if w.format.row_bytes(w.cols).is_none() || w.cols == 0 {
        return Err(OpsError::shape(
            OP,
            format!(
                "a column count that is a positive multiple of {} for {}",
                w.format.block_values(),
                w.format
            ),
            format!("{}", w.cols),
        ));
    }
    let path = match path {
        MatmulPath::Auto => auto_path(ctx, w, n_tokens),
        other => other,
    };
    match path {
        MatmulPath::MatVec => matvec(ctx, w, x, n_tokens, out),
        MatmulPath::Mmq => mmq(ctx, w, x, n_tokens, out),
        MatmulPath::Blas => matmul_blas(ctx, w, x, n_tokens, out),
        MatmulPath::Tiled | MatmulPath::Auto => matmul_tiled(ctx, w, x, n_tokens, out),
    }
}

fn matmul_blas(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "matmul (BLAS)";
    let Some(blas) = ctx.blas_handle() else {
        return Err(OpsError::Unsupported {
            op: OP,
            what: format!("this context: {}", ctx.blas()),
        });
    };
    let x_values = n_tokens
        .checked_mul(w.cols)
        .ok_or_else(|| OpsError::shape(OP, "tokens times columns below 2^64", "an overflow"))?;
    let x_f16 = ctx.alloc(Purpose::Scratch, x_values as u64 * 2)?;
    convert_f32_to_f16(ctx, x_f16.ptr(), x, x_values)?;
    let chunk_rows = f16_chunk_rows(w);
    let row_bytes = w.row_bytes() as u64;
    // One scratch buffer for every chunk: chunk i + 1's expansion is queued after chunk i's GEMM
    // on the same stream, so it never overwrites values the GEMM still reads.
    let scratch = if w.format == WeightFormat::F16 {
        None
    } else {
        Some(ctx.alloc(Purpose::Scratch, (chunk_rows * w.cols * 2) as u64)?)
    };
    let mut first_row = 0usize;
    while first_row < w.rows {
        let rows = chunk_rows.min(w.rows - first_row);
        let chunk = w.ptr().offset(first_row as u64 * row_bytes);
        let a = match &scratch {
            None => chunk,
            Some(buffer) => {
                expand_rows_to_f16(ctx, w.format, chunk, rows, w.cols, buffer.ptr())?;
                buffer.ptr()
            }
        };
        // Rows first_row.. of W give rows first_row.. of out^T (ld = w.rows), i.e. an offset of
        // first_row floats into out.
        let c = out.offset(first_row as u64 * 4);
        // SAFETY: `a` holds rows x cols f16 values (the f16 matrix's own rows, or their expansion
        // queued above on the same stream), x_f16 n_tokens x cols, and the caller sized out for
        // n_tokens x w.rows f32, of which this GEMM writes columns first_row..first_row + rows;
        // the scratch buffers are released only after the GEMMs are queued, and stream order
        // keeps any reuse after them (module docs).
        unsafe {
            blas.gemm_f16_f32(
                Op::T,
                Op::N,
                rows,
                n_tokens,
                w.cols,
                a,
                w.cols,
                x_f16.ptr(),
                w.cols,
                c,
                w.rows,
            )
        }?;
        first_row += rows;
    }
    Ok(())
}

/// Most bytes of f16 weights expanded at once. Expanding a large matrix in row chunks bounds the
/// scratch memory (a 128k-row output matrix would otherwise take 1 GiB) and keeps each chunk
/// mostly in L2 between its expansion and its GEMM.
const F16_SCRATCH_BYTES: usize = 64 << 20;

/// Rows of `w` expanded and multiplied per GEMM: as many as fit in [`F16_SCRATCH_BYTES`], a
/// multiple of 256 so every GEMM keeps a tile-friendly shape, and all rows when they fit.
fn f16_chunk_rows(w: &DeviceMatrix) -> usize {
    let fit = F16_SCRATCH_BYTES / (w.cols * 2).max(1);
    let rounded = (fit / 256 * 256).max(256);
    rounded.min(w.rows)
}

/// Expands `rows` rows of `cols` values starting at `src` (in `format`) to f16 at `dst`.
fn expand_rows_to_f16(
    ctx: &GpuContext,
    format: WeightFormat,
    src: DevicePtr,
    rows: usize,
    cols: usize,
    dst: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "matmul (BLAS)";
    if format == WeightFormat::F32 {
        return convert_f32_to_f16(ctx, dst, src, rows * cols);
    }
    let name = format!("ember_dequantize_f16_{}", format.kernel_suffix());
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(dst))
        .arg(KernelArg::Ptr(src))
        .arg(KernelArg::U32(as_u32(OP, "the column count", cols)?));
    let rows = as_u32(OP, "the row count", rows)?;
    // SAFETY: ember_dequantize_f16_*(ember_half* out, const uint8_t* w, uint32_t n_cols); block r
    // reads row r of the chunk at src (rows x row_bytes(cols), inside W) and writes cols halves
    // of row r at dst, which the caller allocated for rows x cols halves.
    unsafe {
        ctx.launch(
            KernelModule::Dequantize,
            &name,
            LaunchConfig::linear(rows, 256),
            &args,
        )
    }
}

fn matmul_tiled(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "matmul (tiled)";
    let rows = as_u32(OP, "the row count", w.rows)?;
    let cols = as_u32(OP, "the column count", w.cols)?;
    let name = format!("ember_gemm_{}", w.format.kernel_suffix());
    let grid_x = w.rows.div_ceil(GEMM_TILE_ROWS) as u32;
    // grid.y is capped at 65535 blocks by every runtime: larger batches go in slices.
    let tokens_per_launch = MAX_GRID_Y * GEMM_TILE_TOKENS;
    let mut first = 0usize;
    while first < n_tokens {
        let count = (n_tokens - first).min(tokens_per_launch);
        let x_slice = x.offset((first * w.cols * 4) as u64);
        let out_slice = out.offset((first * w.rows * 4) as u64);
        let args = KernelArgs::new()
            .arg(KernelArg::Ptr(out_slice))
            .arg(KernelArg::Ptr(w.ptr()))
            .arg(KernelArg::Ptr(x_slice))
            .arg(KernelArg::U32(count as u32))
            .arg(KernelArg::U32(rows))
            .arg(KernelArg::U32(cols));
        let config = LaunchConfig {
            grid: [grid_x, count.div_ceil(GEMM_TILE_TOKENS) as u32, 1],
            block: [GEMM_THREADS, 1, 1],
            shared_mem_bytes: 0,
        };
        // SAFETY: ember_gemm_*(float* out, const uint8_t* w, const float* x, uint32_t n_tokens,
        // uint32_t n_rows, uint32_t n_cols); the kernel bounds-checks rows and tokens of its tile,
        // reads W (rows x row_bytes(cols)) and count rows of x from x_slice, and writes count rows
        // of rows floats from out_slice, inside what the caller sized for n_tokens.
        unsafe { ctx.launch(KernelModule::Gemm, &name, config, &args) }?;
        first += count;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::has_int8_tensor_cores;

    #[test]
    fn int8_tensor_cores_are_recognised_by_architecture() {
        for arch in ["sm_80", "sm_86", "sm_90", "sm_90a", "sm_120"] {
            assert!(has_int8_tensor_cores(arch), "{arch}");
        }
        for arch in ["sm_75", "sm_70", "gfx1201", "gfx942", "host", "sm_"] {
            assert!(!has_int8_tensor_cores(arch), "{arch}");
        }
    }
}
