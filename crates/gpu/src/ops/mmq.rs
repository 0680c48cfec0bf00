//! The quantised matrix product for batches of more than eight tokens (kernels/mmq.hip): many
//! sequences decoding at once, short prompts.
//!
//! Why: above eight tokens the matrix-vector kernels read the weights once per eight tokens, and
//! the BLAS path expands the weights to f16 in scratch memory every call (a write and a read of
//! four times the bytes of a 4-bit matrix) before the GEMM reads them again; with 9 to 64
//! decoding sequences that expansion is most of a decode step. These kernels read each weight
//! block once per 64 tokens and never expand it: a pre-pass rounds the activations to the
//! weights' 8-bit activation format exactly as the CPU backend does (the rounding of
//! `ops::matvec`), then a tiled kernel multiplies int8 weights and activations with exact integer
//! dot products per group of 32 values (the int8 tensor-core instruction on NVIDIA sm_80 and
//! newer, 4-byte dot products elsewhere) and the f32 scales of `matvec`. The idea of quantising
//! activations to Q8 and multiplying int8 tiles comes from GGML's CUDA backend ("MMQ").
//!
//! Small matrices are split along K so that enough blocks run (see [`k_splits`]); the splits'
//! partial results go to scratch memory and a reduction adds them in a fixed order, so results
//! are deterministic. No host synchronisation: the op can be captured in a graph.

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;
use crate::pool::{PoolBuffer, Purpose};

use super::{as_u32, stride_launch, DeviceMatrix, GpuContext, OpsError, WeightFormat};

/// Threads per block of `ember_mmq_*` (mmq.hip's EMBER_MMQ_THREADS).
const MMQ_THREADS: u32 = 128;
/// Rows of W per block (EMBER_MMQ_ROWS).
const MMQ_ROWS: usize = 64;
/// Values of K per step (EMBER_MMQ_STEP).
const MMQ_STEP: usize = 256;
/// Threads per block of the activation pre-pass (any multiple of 32 works).
const QUANTIZE_THREADS: u32 = 256;
/// Most blocks in grid.y and grid.z on every runtime.
const MAX_GRID_YZ: usize = 65_535;

/// Blocks a launch should have before its K dimension is split: about two per multiprocessor of
/// an H200 (132), which keeps enough weight loads in flight; matrices with fewer row tiles than
/// this are split along K. The environment variable [`MMQ_TARGET_BLOCKS_ENV`] overrides it.
pub const MMQ_TARGET_BLOCKS: usize = 256;

/// Environment variable overriding [`MMQ_TARGET_BLOCKS`] (a positive integer), for tuning.
pub const MMQ_TARGET_BLOCKS_ENV: &str = "EMBER_MMQ_TARGET_BLOCKS";

fn target_blocks() -> usize {
    static VALUE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| {
        std::env::var(MMQ_TARGET_BLOCKS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&v| v > 0)
            .unwrap_or(MMQ_TARGET_BLOCKS)
    })
}

/// Whether `format` has `ember_mmq_*` kernels: the formats whose matrix-vector kernels take
/// int8 dot products (every integer format but q2_K and q3_K).
pub fn has_mmq_kernels(format: WeightFormat) -> bool {
    matches!(
        format,
        WeightFormat::Q4_0
            | WeightFormat::Q4_1
            | WeightFormat::Q5_0
            | WeightFormat::Q5_1
            | WeightFormat::Q8_0
            | WeightFormat::Q4K
            | WeightFormat::Q5K
            | WeightFormat::Q6K
    )
}

/// The activation format `format`'s weights are dotted against, as named by the pre-pass kernels
/// (and matvec.hip's ember_quantize_act_*).
pub(crate) fn activation_suffix(format: WeightFormat) -> &'static str {
    match format {
        WeightFormat::Q4_1 | WeightFormat::Q5_1 => "q8_1",
        WeightFormat::Q2K
        | WeightFormat::Q3K
        | WeightFormat::Q4K
        | WeightFormat::Q5K
        | WeightFormat::Q6K => "q8_k",
        _ => "q8_0",
    }
}

/// Tokens per block for a batch of `n_tokens`: the smallest tile of 16, 32 or 64 that holds them
/// (larger batches take several tiles of 64, each reading the weights again).
pub(crate) fn token_tile(n_tokens: usize) -> usize {
    match n_tokens {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    }
}

/// How K is split for a grid of `tiles` blocks over `n_steps` steps: `(splits, steps per
/// split)`. Enough splits to reach the target block count (never more than the steps), each
/// split a whole number of steps and none empty.
pub(crate) fn k_splits(tiles: usize, n_steps: usize, target: usize) -> (usize, usize) {
    let wanted = (target / tiles.max(1)).clamp(1, n_steps.max(1));
    let steps_per_split = n_steps.div_ceil(wanted).max(1);
    (n_steps.div_ceil(steps_per_split).max(1), steps_per_split)
}

/// `out[t, :] = W x[t, :]` for `n_tokens` rows of x (`w.cols` f32 each) into `n_tokens` rows of
/// out (`w.rows` f32 each) with the mmq kernels. Asynchronous on the context's stream; scratch
/// memory for the rounded activations (and the partial results of a K split) comes from the pool
/// and is released once the launches are queued (stream order keeps it alive long enough; see
/// `ops::matmul`'s module docs).
pub(crate) fn mmq(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    mmq_with_target(ctx, w, x, n_tokens, out, target_blocks())
}

pub(crate) fn mmq_with_target(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    x: DevicePtr,
    n_tokens: usize,
    out: DevicePtr,
    target: usize,
) -> Result<(), OpsError> {
    const OP: &str = "matmul (mmq)";
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    if !has_mmq_kernels(w.format) {
        return Err(OpsError::Unsupported {
            op: OP,
            what: format!(
                "{} weights (it has kernels for the int8 formats but q2_K and q3_K)",
                w.format
            ),
        });
    }
    if w.cols == 0 || w.format.row_bytes(w.cols).is_none() {
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
    let rows = as_u32(OP, "the row count", w.rows)?;
    let cols = as_u32(OP, "the column count", w.cols)?;
    let tokens = as_u32(OP, "the token count", n_tokens)?;
    let outputs = as_u32(OP, "tokens times rows", n_tokens.saturating_mul(w.rows))?;
    let values = n_tokens
        .checked_mul(w.cols)
        .ok_or_else(|| OpsError::shape(OP, "tokens times columns below 2^64", "an overflow"))?;

    let tile = token_tile(n_tokens);
    let row_tiles = w.rows.div_ceil(MMQ_ROWS);
    let token_tiles = n_tokens.div_ceil(tile);
    if token_tiles > MAX_GRID_YZ {
        return Err(OpsError::shape(
            OP,
            format!("at most {} tokens", MAX_GRID_YZ * 64),
            format!("{n_tokens}"),
        ));
    }
    let n_steps = w.cols.div_ceil(MMQ_STEP);
    let (splits, steps_per_split) = k_splits(row_tiles * token_tiles, n_steps, target);

    let (activations, xds) = quantize(ctx, w.format, x, tokens, cols, values)?;
    let xq = activations.ptr();

    let partials = if splits > 1 {
        Some(ctx.alloc(Purpose::Scratch, (splits * n_tokens * w.rows * 4) as u64)?)
    } else {
        None
    };
    let y = partials.as_ref().map_or(out, |buffer| buffer.ptr());
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(y))
        .arg(KernelArg::Ptr(w.ptr()))
        .arg(KernelArg::Ptr(xq))
        .arg(KernelArg::Ptr(xds))
        .arg(KernelArg::U32(rows))
        .arg(KernelArg::U32(cols))
        .arg(KernelArg::U32(tokens))
        .arg(KernelArg::U32(steps_per_split as u32));
    let config = LaunchConfig {
        grid: [row_tiles as u32, token_tiles as u32, splits as u32],
        block: [MMQ_THREADS, 1, 1],
        shared_mem_bytes: 0,
    };
    let name = kernel_name(w.format, tile);
    // SAFETY: ember_mmq_<format>_n<NT>(float* y, const uint8_t* w, const int8_t* xq, const
    // float2* xds, uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens, uint32_t steps_per_split)
    // with the grid of mmq.hip (row tiles, token tiles of NT, splits of steps_per_split steps);
    // it reads W (DeviceMatrix::new checked the buffer), the activations written above, and
    // writes n_tokens x rows floats per split at y: the caller's out without a split, else the
    // partial buffer of splits x n_tokens x rows floats allocated above.
    unsafe { ctx.launch(KernelModule::Mmq, &name, config, &args) }?;

    if let Some(partials) = &partials {
        let reduce_args = KernelArgs::new()
            .arg(KernelArg::Ptr(out))
            .arg(KernelArg::Ptr(partials.ptr()))
            .arg(KernelArg::U32(outputs))
            .arg(KernelArg::U32(splits as u32));
        // SAFETY: ember_mmq_reduce(float* y, const float* partial, uint32_t n, uint32_t
        // n_splits) reads splits x n floats of the partial buffer and writes n = n_tokens x rows
        // floats of out, which the caller sized for that; any grid is correct.
        unsafe {
            ctx.launch(
                KernelModule::Mmq,
                "ember_mmq_reduce",
                stride_launch(outputs),
                &reduce_args,
            )
        }?;
    }
    Ok(())
}

/// The activation pre-pass: `n_tokens` rows of `cols` f32 at x rounded to `format`'s activation
/// format into a scratch buffer (`values` = n_tokens x cols int8 values, then, 256-byte aligned,
/// one float2 per group of 32, whose address comes second).
fn quantize(
    ctx: &GpuContext,
    format: WeightFormat,
    x: DevicePtr,
    n_tokens: u32,
    cols: u32,
    values: usize,
) -> Result<(PoolBuffer, DevicePtr), OpsError> {
    let scales_offset = values.next_multiple_of(256);
    let activations = ctx.alloc(Purpose::Scratch, (scales_offset + values / 32 * 8) as u64)?;
    let xq = activations.ptr();
    let xds = xq.offset(scales_offset as u64);
    let quantize_args = KernelArgs::new()
        .arg(KernelArg::Ptr(xq))
        .arg(KernelArg::Ptr(xds))
        .arg(KernelArg::Ptr(x))
        .arg(KernelArg::U32(cols));
    let quantize = format!("ember_mmq_quantize_{}", activation_suffix(format));
    // SAFETY: ember_mmq_quantize_*(int8_t* xq, float2* xds, const float* x, uint32_t n_cols);
    // block t reads row t of x (n_tokens rows of cols f32, the caller's) and writes cols bytes at
    // xq + t cols and cols / 32 float2 at xds + t cols / 32, inside the scratch buffer sized above.
    unsafe {
        ctx.launch(
            KernelModule::Mmq,
            &quantize,
            LaunchConfig::linear(n_tokens, QUANTIZE_THREADS),
            &quantize_args,
        )
    }?;
    Ok((activations, xds))
}

/// The grouped product of the mixture-of-experts layers with the mmq kernels (mmq.hip's
/// `ember_mmq_moe_*`): `out[p] = W[expert of p] x[p / x_div]` for every pair of the tiles, `w` a
/// stack of `n_expert` experts, `x` `x_rows` rows of `w.cols` f32, `out` f32 `[n_pairs,
/// w.rows / n_expert]`. The tiles (`moe_tiles` with tile size `tile`, 16, 32 or 64) hold at most
/// `tile` pairs of one expert each; every block multiplies one tile by 64 rows of its expert, so
/// an expert's weights are read once per tile rather than once per 8 pairs as in `moe_matvec`.
/// The x rows are rounded once, as the dense mmq rounds them, and gathered by pair.
#[allow(clippy::too_many_arguments)]
pub fn moe_mmq(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    n_expert: usize,
    x: DevicePtr,
    x_rows: usize,
    x_div: usize,
    pairs: DevicePtr,
    tiles: DevicePtr,
    n_pairs: usize,
    tile: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "moe_mmq";
    if n_pairs == 0 || x_rows == 0 {
        return Ok(());
    }
    if !has_mmq_kernels(w.format) {
        return Err(OpsError::Unsupported {
            op: OP,
            what: format!(
                "{} weights (it has kernels for the int8 formats but q2_K and q3_K)",
                w.format
            ),
        });
    }
    if ![16, 32, 64].contains(&tile) {
        return Err(OpsError::shape(
            OP,
            "tiles of 16, 32 or 64 pairs",
            format!("{tile}"),
        ));
    }
    if n_expert == 0
        || !w.rows.is_multiple_of(n_expert)
        || w.cols == 0
        || w.format.row_bytes(w.cols).is_none()
    {
        return Err(OpsError::shape(
            OP,
            format!(
                "a stack of {n_expert} experts of equal rows, columns a positive multiple of {}",
                w.format.block_values()
            ),
            format!("{} rows of {} columns", w.rows, w.cols),
        ));
    }
    if x_div == 0 || n_pairs.div_ceil(x_div) > x_rows {
        return Err(OpsError::shape(
            OP,
            format!(
                "{} rows of x for {n_pairs} pairs",
                n_pairs.div_ceil(x_div.max(1))
            ),
            format!("{x_rows} rows, {x_div} pairs per row"),
        ));
    }
    let rows = w.rows / n_expert;
    let expert_bytes = DeviceMatrix::bytes_for(w.format, rows, w.cols)? as u64;
    let rows32 = as_u32(OP, "the rows of an expert", rows)?;
    let cols = as_u32(OP, "the column count", w.cols)?;
    let x_rows32 = as_u32(OP, "the rows of x", x_rows)?;
    as_u32(OP, "pairs times rows", n_pairs.saturating_mul(rows))?;
    let values = x_rows
        .checked_mul(w.cols)
        .ok_or_else(|| OpsError::shape(OP, "rows times columns below 2^64", "an overflow"))?;
    let slots = super::moe::moe_tile_slots(n_pairs, n_expert, tile);
    if slots > MAX_GRID_YZ {
        return Err(OpsError::shape(
            OP,
            format!("at most {MAX_GRID_YZ} tiles"),
            format!("{slots}"),
        ));
    }
    let (activations, xds) = quantize(ctx, w.format, x, x_rows32, cols, values)?;
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(w.ptr()))
        .arg(KernelArg::Ptr(activations.ptr()))
        .arg(KernelArg::Ptr(xds))
        .arg(KernelArg::Ptr(pairs))
        .arg(KernelArg::Ptr(tiles))
        .arg(KernelArg::U32(rows32))
        .arg(KernelArg::U32(cols))
        .arg(KernelArg::U64(expert_bytes))
        .arg(KernelArg::U32(as_u32(OP, "the pairs per row of x", x_div)?));
    let config = LaunchConfig {
        grid: [rows.div_ceil(MMQ_ROWS) as u32, slots as u32, 1],
        block: [MMQ_THREADS, 1, 1],
        shared_mem_bytes: 0,
    };
    let name = moe_kernel_name(w.format, tile);
    // SAFETY: ember_mmq_moe_<format>_n<NT>(float* y, const uint8_t* w, const int8_t* xq, const
    // float2* xds, const int32_t* pairs, const int32_t* tiles, uint32_t n_rows, uint32_t n_cols,
    // uint64_t expert_bytes, uint32_t x_div) with grid (row tiles of one expert, tile slots);
    // the tiles (moe_tiles with this tile size, slots as moe_tile_slots counts them) name
    // experts below n_expert, whose bytes lie inside W (DeviceMatrix::new checked n_expert x
    // expert_bytes), and pairs below n_pairs, whose rows p / x_div < x_rows of the activations
    // (written above) and p of out (the caller's, n_pairs x rows floats) exist.
    unsafe { ctx.launch(KernelModule::Mmq, &name, config, &args) }
}

/// The grouped kernel for `format` with tiles of `tile` pairs (16, 32 or 64).
pub(crate) fn moe_kernel_name(format: WeightFormat, tile: usize) -> String {
    format!("ember_mmq_moe_{}_n{tile}", format.kernel_suffix())
}

/// The kernel for `format` with token tiles of `tile` (16, 32 or 64).
pub(crate) fn kernel_name(format: WeightFormat, tile: usize) -> String {
    format!("ember_mmq_{}_n{tile}", format.kernel_suffix())
}

#[cfg(test)]
mod tests {
    //! The wrapper on the host driver against Rust twins of the kernels (q8_0): the activation
    //! pre-pass lays out what the CPU's quantiser produces, the grid covers every row, token
    //! tile and K split, and split results are added in order; the result must equal the CPU's
    //! own matmul up to f32 reordering. The kernels' arithmetic is checked on GPUs by
    //! kernels/tests/harness_mmq.cu and the ops_check example.

    use ember_quant::{quantize_activations, GgmlType, QMatrix};
    use half::f16;

    use super::*;
    use crate::host::{HostDriver, HostLaunch};
    use crate::kernels::KERNEL_MODULES;
    use crate::ops::attention::tests::{
        download_f32, host_context, upload_bytes, upload_f32, values,
    };

    /// Token count, column count and the byte offset of value `v` of token `t` in the
    /// pre-pass's int8 layout (per token: the first 16 bytes of every group, then the second).
    fn xq_offset(cols: usize, t: usize, v: usize) -> usize {
        let n_groups = cols / 32;
        t * cols + ((v % 32) / 16 * n_groups + v / 32) * 16 + v % 16
    }

    fn register_twins(driver: &HostDriver) {
        // ember_mmq_quantize_q8_0(int8_t* xq, float2* xds, const float* x, uint32_t n_cols);
        // grid = n_tokens. Q8_0 blocks are (f16 d, 32 int8), as the CPU backend rounds them.
        driver.register_kernel("ember_mmq_quantize_q8_0", |l| {
            let (xq, xds, x) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
            let cols = l.u32_arg(3)? as usize;
            let n_tokens = l.config().grid[0] as usize;
            let values = l.read_f32(x, n_tokens * cols)?;
            let act = quantize_activations(GgmlType::Q8_0, &values, n_tokens, cols)
                .map_err(|e| e.to_string())?;
            let mut q = vec![0u8; n_tokens * cols];
            let mut ds = Vec::new();
            for t in 0..n_tokens {
                for (g, block) in act.row(t).chunks_exact(34).enumerate() {
                    let d = f16::from_le_bytes([block[0], block[1]]).to_f32();
                    let mut sum = 0i32;
                    for (i, &byte) in block[2..].iter().enumerate() {
                        q[xq_offset(cols, t, 32 * g + i)] = byte;
                        sum += i32::from(byte as i8);
                    }
                    ds.extend([d, sum as f32]);
                }
            }
            l.write(xq, &q)?;
            l.write_f32(xds, &ds)
        });
        for tile in [16usize, 32, 64] {
            let name = kernel_name(WeightFormat::Q8_0, tile);
            driver.register_kernel(&name, move |l| mmq_q8_0_twin(l, tile));
            let name = moe_kernel_name(WeightFormat::Q8_0, tile);
            driver.register_kernel(&name, move |l| moe_mmq_q8_0_twin(l, tile));
        }
        // ember_mmq_reduce(float* y, const float* partial, uint32_t n, uint32_t n_splits)
        driver.register_kernel("ember_mmq_reduce", |l| {
            let (y, partial) = (l.ptr_arg(0)?, l.ptr_arg(1)?);
            let (n, splits) = (l.u32_arg(2)? as usize, l.u32_arg(3)? as usize);
            let values = l.read_f32(partial, n * splits)?;
            let sums: Vec<f32> = (0..n)
                .map(|i| (1..splits).fold(values[i], |sum, z| sum + values[z * n + i]))
                .collect();
            l.write_f32(y, &sums)
        });
    }

    /// ember_mmq_q8_0_n<tile>(float* y, const uint8_t* w, const int8_t* xq, const float2* xds,
    /// uint32_t n_rows, uint32_t n_cols, uint32_t n_tokens, uint32_t steps_per_split): block
    /// (bx, by, bz) writes rows 64 bx.., tokens tile by.. of split bz at y + bz n_tokens n_rows.
    fn mmq_q8_0_twin(l: &HostLaunch<'_>, tile: usize) -> Result<(), String> {
        let (y, w, xq, xds) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?, l.ptr_arg(3)?);
        let (rows, cols, n_tokens, steps_per_split) = (
            l.u32_arg(4)? as usize,
            l.u32_arg(5)? as usize,
            l.u32_arg(6)? as usize,
            l.u32_arg(7)? as usize,
        );
        let config = l.config();
        if config.block[0] != MMQ_THREADS || config.shared_mem_bytes != 0 {
            return Err(format!("launched with {config:?}"));
        }
        let [grid_x, grid_y, grid_z] = config.grid.map(|v| v as usize);
        let n_steps = cols.div_ceil(MMQ_STEP);
        if grid_x != rows.div_ceil(MMQ_ROWS)
            || grid_y != n_tokens.div_ceil(tile)
            || grid_z != n_steps.div_ceil(steps_per_split)
        {
            return Err(format!(
                "grid {:?} for {rows}x{cols}, {n_tokens} tokens",
                config.grid
            ));
        }
        let n_groups = cols / 32;
        let mut weights = vec![0u8; rows * n_groups * 34];
        l.read(w, &mut weights)?;
        let mut q = vec![0u8; n_tokens * cols];
        l.read(xq, &mut q)?;
        let ds = l.read_f32(xds, n_tokens * n_groups * 2)?;
        let mut out = l.read_f32(y, grid_z * n_tokens * rows)?;
        for bz in 0..grid_z {
            let groups = (bz * steps_per_split * 8).min(n_groups)
                ..((bz + 1) * steps_per_split * 8).min(n_groups);
            for t in 0..n_tokens {
                for r in 0..rows {
                    let mut acc = 0.0f32;
                    for g in groups.clone() {
                        let block = &weights[(r * n_groups + g) * 34..][..34];
                        let wd = f16::from_le_bytes([block[0], block[1]]).to_f32();
                        let c: i32 = (0..32)
                            .map(|i| {
                                i32::from(block[2 + i] as i8)
                                    * i32::from(q[xq_offset(cols, t, 32 * g + i)] as i8)
                            })
                            .sum();
                        acc += (wd * ds[(t * n_groups + g) * 2]) * c as f32;
                    }
                    out[(bz * n_tokens + t) * rows + r] = acc;
                }
            }
        }
        l.write_f32(y, &out)
    }

    /// ember_mmq_moe_q8_0_n<tile>(float* y, const uint8_t* w, const int8_t* xq, const float2*
    /// xds, const int32_t* pairs, const int32_t* tiles, uint32_t n_rows, uint32_t n_cols,
    /// uint64_t expert_bytes, uint32_t x_div): block (bx, slot) writes rows 64 bx.. of the slot's
    /// expert for its pairs, pair p reading activation row p / x_div and writing row p of y.
    fn moe_mmq_q8_0_twin(l: &HostLaunch<'_>, tile: usize) -> Result<(), String> {
        let (y, w, xq, xds) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?, l.ptr_arg(3)?);
        let (pairs, tiles) = (l.ptr_arg(4)?, l.ptr_arg(5)?);
        let (rows, cols) = (l.u32_arg(6)? as usize, l.u32_arg(7)? as usize);
        let expert_bytes = match l.args().get(8) {
            Some(KernelArg::U64(v)) => *v as usize,
            other => return Err(format!("argument 8: expected a u64, found {other:?}")),
        };
        let x_div = l.u32_arg(9)? as usize;
        let config = l.config();
        if config.block[0] != MMQ_THREADS || config.shared_mem_bytes != 0 || config.grid[2] != 1 {
            return Err(format!("launched with {config:?}"));
        }
        if config.grid[0] as usize != rows.div_ceil(MMQ_ROWS) {
            return Err(format!("grid {:?} for {rows} rows", config.grid));
        }
        let slots = config.grid[1] as usize;
        let read_i32 = |ptr: DevicePtr, n: usize| -> Result<Vec<i32>, String> {
            let mut bytes = vec![0u8; 4 * n];
            l.read(ptr, &mut bytes)?;
            Ok(bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect())
        };
        let table = read_i32(tiles, 4 * slots)?;
        let n_groups = cols / 32;
        for slot in table.chunks_exact(4) {
            let (expert, first, count) = (slot[0] as usize, slot[1] as usize, slot[2] as usize);
            if count == 0 {
                continue;
            }
            if count > tile {
                return Err(format!("a tile of {count} pairs for kernel tile {tile}"));
            }
            let mut weights = vec![0u8; expert_bytes];
            l.read(w.offset((expert * expert_bytes) as u64), &mut weights)?;
            for pair in read_i32(pairs.offset(4 * first as u64), count)? {
                let (pair, x_row) = (pair as usize, pair as usize / x_div);
                let mut q = vec![0u8; cols];
                l.read(xq.offset((x_row * cols) as u64), &mut q)?;
                let ds = l.read_f32(xds.offset((x_row * n_groups * 8) as u64), 2 * n_groups)?;
                let out: Vec<f32> = (0..rows)
                    .map(|r| {
                        (0..n_groups).fold(0.0f32, |acc, g| {
                            let block = &weights[(r * n_groups + g) * 34..][..34];
                            let wd = f16::from_le_bytes([block[0], block[1]]).to_f32();
                            let c: i32 = (0..32)
                                .map(|i| {
                                    i32::from(block[2 + i] as i8)
                                        * i32::from(q[xq_offset(cols, 0, 32 * g + i)] as i8)
                                })
                                .sum();
                            acc + (wd * ds[2 * g]) * c as f32
                        })
                    })
                    .collect();
                l.write_f32(y.offset((pair * rows * 4) as u64), &out)?;
            }
        }
        Ok(())
    }

    /// Random q8_0 weights: scale 1/64 and values -64..63.
    fn q8_0_weights(rows: usize, cols: usize, seed: usize) -> Vec<u8> {
        let mut bytes = Vec::new();
        for block in 0..rows * cols / 32 {
            bytes.extend(f16::from_f32(1.0 / 64.0).to_le_bytes());
            bytes.extend((0..32).map(|i| ((block * 7 + i * 13 + seed) % 128) as u8 ^ 0x40));
        }
        bytes
    }

    #[test]
    fn every_tile_and_split_is_covered_and_added_in_order() {
        let (ctx, _dir) = host_context(register_twins);
        // 1184 columns: 37 groups, so the last of 5 steps is partial.
        let (rows, cols) = (70usize, 1184usize);
        let bytes = q8_0_weights(rows, cols, 3);
        let matrix =
            DeviceMatrix::new(upload_bytes(&ctx, &bytes), WeightFormat::Q8_0, rows, cols).unwrap();
        for (n_tokens, target) in [(9usize, 1usize), (20, 4), (70, 10), (33, 1000)] {
            let x = values(n_tokens * cols, n_tokens as u32);
            let dx = upload_f32(&ctx, &x);
            let out = upload_f32(&ctx, &vec![f32::NAN; n_tokens * rows]);
            mmq_with_target(&ctx, &matrix, dx.ptr(), n_tokens, out.ptr(), target).unwrap();
            let got = download_f32(&ctx, out.ptr(), n_tokens * rows);
            let mut expected = vec![0f32; n_tokens * rows];
            let qm = QMatrix {
                ty: GgmlType::Q8_0,
                rows,
                cols,
                data: &bytes,
            };
            ember_quant::matmul_f32(&qm, &x, n_tokens, &mut expected).unwrap();
            for (i, (&g, &e)) in got.iter().zip(&expected).enumerate() {
                // Both sum the same exact integer group products times the same scales; only
                // the order of the 37 f32 terms differs.
                assert!(
                    (g - e).abs() <= 1e-5 * (1.0 + e.abs()),
                    "{n_tokens} tokens, target {target}: output {i}: {g} vs {e}"
                );
            }
        }
    }

    /// Writes i32 values into a new device buffer.
    fn upload_i32(ctx: &GpuContext, values: &[i32]) -> PoolBuffer {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        upload_bytes(ctx, &bytes)
    }

    #[test]
    fn grouped_product_gathers_each_pairs_row_and_writes_its_output() {
        let (ctx, _dir) = host_context(register_twins);
        // 3 experts of 70 rows (a partial row tile) by 96 columns; 5 tokens, 2 experts each.
        let (n_expert, rows, cols, n_tokens, n_used) = (3usize, 70usize, 96usize, 5usize, 2usize);
        let bytes = q8_0_weights(n_expert * rows, cols, 5);
        let matrix = DeviceMatrix::new(
            upload_bytes(&ctx, &bytes),
            WeightFormat::Q8_0,
            n_expert * rows,
            cols,
        )
        .unwrap();
        let experts: Vec<usize> = (0..n_tokens * n_used)
            .map(|p| (p / n_used + p % n_used * 2) % n_expert)
            .collect();
        let n_pairs = experts.len();
        // The pairs sorted by expert and cut into tiles as ember_moe_tiles cuts them.
        for tile in [16usize, 32, 64] {
            let mut pairs = Vec::new();
            let mut table = Vec::new();
            for e in 0..n_expert {
                let first = pairs.len() as i32;
                pairs.extend((0..n_pairs).filter(|&p| experts[p] == e).map(|p| p as i32));
                let count = pairs.len() as i32 - first;
                if count > 0 {
                    table.extend([e as i32, first, count, 0]);
                }
            }
            table.resize(4 * crate::ops::moe_tile_slots(n_pairs, n_expert, tile), 0);
            let (dpairs, dtiles) = (upload_i32(&ctx, &pairs), upload_i32(&ctx, &table));
            // Gate/up: pair p reads token p / n_used; down: pair p reads its own row.
            for (x_rows, x_div) in [(n_tokens, n_used), (n_pairs, 1)] {
                let x = values(x_rows * cols, (tile + x_div) as u32);
                let dx = upload_f32(&ctx, &x);
                let out = upload_f32(&ctx, &vec![f32::NAN; n_pairs * rows]);
                moe_mmq(
                    &ctx,
                    &matrix,
                    n_expert,
                    dx.ptr(),
                    x_rows,
                    x_div,
                    dpairs.ptr(),
                    dtiles.ptr(),
                    n_pairs,
                    tile,
                    out.ptr(),
                )
                .unwrap();
                let got = download_f32(&ctx, out.ptr(), n_pairs * rows);
                for (p, &e) in experts.iter().enumerate() {
                    let row_bytes = cols / 32 * 34;
                    let qm = QMatrix {
                        ty: GgmlType::Q8_0,
                        rows,
                        cols,
                        data: &bytes[e * rows * row_bytes..][..rows * row_bytes],
                    };
                    let mut expected = vec![0f32; rows];
                    let x_row = &x[p / x_div * cols..][..cols];
                    ember_quant::matmul_f32(&qm, x_row, 1, &mut expected).unwrap();
                    for (r, &want) in expected.iter().enumerate() {
                        let have = got[p * rows + r];
                        // The same exact group sums and scales; only the f32 order may differ.
                        assert!(
                            (have - want).abs() <= 1e-5 * (1.0 + want.abs()),
                            "tile {tile}, x_div {x_div}: pair {p} row {r}: {have} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn grouped_product_refuses_bad_shapes() {
        let (ctx, _dir) = host_context(|_| {});
        let matrix = DeviceMatrix {
            buf: ctx.alloc(Purpose::Scratch, 34 * 30).unwrap(),
            format: WeightFormat::Q8_0,
            rows: 30,
            cols: 32,
        };
        let p = matrix.ptr();
        let error = moe_mmq(&ctx, &matrix, 4, p, 4, 1, p, p, 4, 16, p).unwrap_err();
        assert_eq!(
            error.to_string(),
            "moe_mmq: expected a stack of 4 experts of equal rows, columns a positive multiple of 32, found 30 rows of 32 columns"
        );
        let error = moe_mmq(&ctx, &matrix, 3, p, 4, 1, p, p, 4, 8, p).unwrap_err();
        assert_eq!(
            error.to_string(),
            "moe_mmq: expected tiles of 16, 32 or 64 pairs, found 8"
        );
        let error = moe_mmq(&ctx, &matrix, 3, p, 2, 1, p, p, 4, 16, p).unwrap_err();
        assert_eq!(
            error.to_string(),
            "moe_mmq: expected 4 rows of x for 4 pairs, found 2 rows, 1 pairs per row"
        );
    }

    #[test]
    fn token_tiles_and_k_splits() {
        assert_eq!(token_tile(9), 16);
        assert_eq!(token_tile(16), 16);
        assert_eq!(token_tile(17), 32);
        assert_eq!(token_tile(33), 64);
        assert_eq!(token_tile(128), 64);
        // 14336 rows (224 row tiles) need no split; 4096 rows (64 tiles) split 4 ways over 16
        // steps; 1024 rows (16 tiles) take one step per split.
        assert_eq!(k_splits(224, 16, 256), (1, 16));
        assert_eq!(k_splits(64, 16, 256), (4, 4));
        assert_eq!(k_splits(64, 56, 256), (4, 14));
        assert_eq!(k_splits(16, 16, 256), (16, 1));
        // Never more splits than steps, and none empty.
        assert_eq!(k_splits(1, 3, 256), (3, 1));
        assert_eq!(k_splits(10, 5, 35), (3, 2));
    }

    #[test]
    fn formats_without_kernels_are_refused() {
        let (ctx, _dir) = host_context(|_| {});
        let matrix = DeviceMatrix {
            buf: ctx.alloc(Purpose::Scratch, 1024).unwrap(),
            format: WeightFormat::Q3K,
            rows: 2,
            cols: 256,
        };
        let error = mmq(&ctx, &matrix, matrix.ptr(), 16, matrix.ptr()).unwrap_err();
        assert_eq!(
            error.to_string(),
            "matmul (mmq) does not support q3_K weights (it has kernels for the int8 formats but q2_K and q3_K)"
        );
    }

    #[test]
    fn every_covered_format_and_tile_has_a_listed_kernel() {
        let spec = KERNEL_MODULES
            .iter()
            .find(|spec| spec.module == KernelModule::Mmq)
            .unwrap();
        for format in WeightFormat::ALL
            .into_iter()
            .filter(|&f| has_mmq_kernels(f))
        {
            for tile in [16, 32, 64] {
                let name = kernel_name(format, tile);
                assert!(spec.functions.contains(&name.as_str()), "{name}");
            }
            for tile in [16, 32, 64] {
                let name = moe_kernel_name(format, tile);
                assert!(spec.functions.contains(&name.as_str()), "{name}");
            }
            let quantize = format!("ember_mmq_quantize_{}", activation_suffix(format));
            assert!(spec.functions.contains(&quantize.as_str()), "{quantize}");
        }
        assert!(spec.functions.contains(&"ember_mmq_reduce"));
    }
}
