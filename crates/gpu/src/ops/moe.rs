//! The mixture-of-experts ops (kernels/moe.hip and matvec.hip's `ember_moe_matvec_*`): routing
//! each token to its experts, sorting the (token, rank) pairs by expert into tiles, the grouped
//! products over the tiles, and the weighted combination. Together they are the GPU form of the
//! CPU backend's `moe_ffn` (engine/src/backend/cpu/moe.rs), in the same order of operations.
//!
//! Everything runs on the device and nothing waits for the host, so a decode step of a MoE
//! model is captured in a graph like any other; the price is that the tile table is sized for
//! the worst case (`moe_tile_slots`), and blocks of unused slots return at once.

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;

use super::matvec::has_int8_path;
use super::mmq::activation_suffix;
use super::{as_u32, DeviceMatrix, GpuContext, OpsError, WeightFormat};

/// Pairs per tile (matvec.hip's EMBER_MOE_TILE).
pub const MOE_TILE: usize = 8;
/// Most experts a layer may have (moe.hip's EMBER_MOE_MAX_EXPERTS).
pub const MOE_MAX_EXPERTS: usize = 512;
/// Threads per block of the grouped products (matvec.hip's EMBER_MATVEC_THREADS).
const THREADS: u32 = 256;
/// Rows one block serves per pass (threads over matvec.hip's EMBER_MATVEC_LANES).
const ROWS_PER_BLOCK: u32 = THREADS / LANES;
/// Lanes per row of the grouped products (matvec.hip's EMBER_MATVEC_LANES).
const LANES: u32 = 32;
/// Blocks a grouped product aims for in all: about one resident wave on an H200. Every block
/// rounds its tile's activations into shared memory before it reads weights, so the blocks along
/// the rows of one tile repeat that work; with many tiles (a prompt) each tile gets few such
/// blocks that walk its rows grid-stride, with few tiles (decode) each gets many so that the
/// weight stream still fills the device.
const TARGET_BLOCKS: u32 = 1024;
/// Dynamic shared memory a launch may use without an opt-in.
const MAX_SHARED_BYTES: usize = 48 * 1024;

/// Whether the grouped products have kernels for `format` (the formats with the int8 path).
pub fn has_moe_kernels(format: WeightFormat) -> bool {
    has_int8_path(format)
}

/// Tile slots for `n_pairs` pairs over `n_expert` experts in tiles of at most `tile` pairs
/// ([`MOE_TILE`] for `moe_matvec`, [`moe_mmq_tile`]'s for `moe_mmq`): every expert's last tile
/// may be partial, and no tile is empty.
pub fn moe_tile_slots(n_pairs: usize, n_expert: usize, tile: usize) -> usize {
    (n_pairs / tile.max(1) + n_expert).min(n_pairs)
}

/// Fewest tokens for which a MoE layer's products take the grouped mmq kernels (`moe_mmq`)
/// rather than `moe_matvec`. With 8 of 128 experts, 32 tokens give each expert 2 pairs on
/// average: from there on the tensor-core (or dp4a) tiles cost about what the matrix-vector
/// kernel does for one tile of 8 while reading the weights no more often; decode batches keep
/// the matrix-vector kernel, which streams an expert's rows fastest for a pair or two.
pub const MOE_MMQ_MIN_TOKENS: usize = 32;

/// Environment variable overriding [`MOE_MMQ_MIN_TOKENS`] (a positive integer), for tuning and
/// for comparing both paths on one binary (a value above the batch keeps the matrix-vector path).
pub const MOE_MMQ_MIN_TOKENS_ENV: &str = "EMBER_MOE_MMQ_MIN_TOKENS";

fn mmq_min_tokens() -> usize {
    static VALUE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| {
        std::env::var(MOE_MMQ_MIN_TOKENS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&v| v > 0)
            .unwrap_or(MOE_MMQ_MIN_TOKENS)
    })
}

/// The pairs per tile of the grouped mmq product for `n_tokens` tokens with `n_used` of
/// `n_expert` experts each, or None below [`MOE_MMQ_MIN_TOKENS`] (or its environment override:
/// the matrix-vector path).
pub fn moe_mmq_tile(n_tokens: usize, n_used: usize, n_expert: usize) -> Option<usize> {
    mmq_tile_from(n_tokens, n_used, n_expert, mmq_min_tokens())
}

/// [`moe_mmq_tile`] with the threshold given: the smallest tile of 16, 32 or 64 pairs that holds
/// one and a half times the average pairs per expert, so that most experts take one tile
/// (their weights read once) while few rows of the tile are empty.
fn mmq_tile_from(
    n_tokens: usize,
    n_used: usize,
    n_expert: usize,
    min_tokens: usize,
) -> Option<usize> {
    if n_tokens < min_tokens || n_expert == 0 {
        return None;
    }
    let average = (n_tokens * n_used).div_ceil(n_expert);
    Some(match average + average / 2 {
        0..=16 => 16,
        17..=32 => 32,
        _ => 64,
    })
}

/// Per token, its `n_used` experts (most probable first) and their weights from `n_expert`
/// router logits: `experts` i32 and `weights` f32, `[n_tokens, n_used]` each. `sigmoid` picks the
/// gating (else a softmax), `normalize` divides the weights by their sum, `scale` multiplies them.
#[allow(clippy::too_many_arguments)]
pub fn moe_route(
    ctx: &GpuContext,
    logits: DevicePtr,
    n_tokens: usize,
    n_expert: usize,
    n_used: usize,
    sigmoid: bool,
    normalize: bool,
    scale: f32,
    experts: DevicePtr,
    weights: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "moe_route";
    if n_tokens == 0 {
        return Ok(());
    }
    if n_expert == 0 || n_expert > MOE_MAX_EXPERTS || n_used == 0 || n_used > n_expert {
        return Err(OpsError::shape(
            OP,
            format!("1 to {MOE_MAX_EXPERTS} experts, of which 1 to all are used"),
            format!("{n_used} of {n_expert}"),
        ));
    }
    let tokens = as_u32(OP, "the token count", n_tokens)?;
    as_u32(
        OP,
        "tokens times experts",
        n_tokens.saturating_mul(n_expert),
    )?;
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(experts))
        .arg(KernelArg::Ptr(weights))
        .arg(KernelArg::Ptr(logits))
        .arg(KernelArg::U32(tokens))
        .arg(KernelArg::U32(n_expert as u32))
        .arg(KernelArg::U32(n_used as u32))
        .arg(KernelArg::U32(sigmoid as u32))
        .arg(KernelArg::U32(normalize as u32))
        .arg(KernelArg::F32(scale));
    // One warp per token, four warps per block.
    let warp = ctx.warp_size();
    let blocks = tokens.div_ceil(4);
    // SAFETY: ember_moe_route_f32(int32_t* experts, float* weights, const float* logits, uint32_t
    // n_tokens, uint32_t n_expert, uint32_t n_used, uint32_t gating, uint32_t normalize, float
    // scale); warp t < n_tokens reads row t of logits and writes row t of experts and weights,
    // which the caller sized; n_expert is within the kernel's registers (checked above); the
    // block is a whole number of warps.
    unsafe {
        ctx.launch(
            KernelModule::Moe,
            "ember_moe_route_f32",
            LaunchConfig::linear(blocks, 4 * warp),
            &args,
        )
    }
}

/// Sorts the `n_pairs` (token, rank) pairs of `experts` by expert into `pairs` (i32 `[n_pairs]`)
/// and cuts them into tiles of at most `tile` pairs (`tiles`, i32 `[moe_tile_slots(n_pairs,
/// n_expert, tile), 4]`).
pub fn moe_tiles(
    ctx: &GpuContext,
    experts: DevicePtr,
    n_pairs: usize,
    n_expert: usize,
    tile: usize,
    pairs: DevicePtr,
    tiles: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "moe_tiles";
    if n_pairs == 0 {
        return Ok(());
    }
    if tile == 0 {
        return Err(OpsError::shape(OP, "tiles of at least one pair", "0"));
    }
    let slots = moe_tile_slots(n_pairs, n_expert, tile);
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(pairs))
        .arg(KernelArg::Ptr(tiles))
        .arg(KernelArg::Ptr(experts))
        .arg(KernelArg::U32(as_u32(OP, "the pair count", n_pairs)?))
        .arg(KernelArg::U32(as_u32(OP, "the expert count", n_expert)?))
        .arg(KernelArg::U32(slots as u32))
        .arg(KernelArg::U32(as_u32(OP, "the tile size", tile)?));
    let config = LaunchConfig {
        shared_mem_bytes: (8 * n_expert) as u32,
        ..LaunchConfig::linear(1, 256)
    };
    // SAFETY: ember_moe_tiles(int32_t* pairs, int32_t* tiles, const int32_t* experts, uint32_t
    // n_pairs, uint32_t n_expert, uint32_t n_slots, uint32_t tile) with 8 * n_expert bytes of
    // dynamic shared memory; it reads n_pairs experts (each below n_expert, as moe_route wrote
    // them) and writes n_pairs pairs and n_slots tiles, which the caller sized.
    unsafe { ctx.launch(KernelModule::Moe, "ember_moe_tiles", config, &args) }
}

/// The grouped product: `out[p] = W[expert of p] x[p / x_div]` for every pair of the tiles, `w`
/// a stack of `n_expert` experts (`w.rows / n_expert` rows each), `out` f32 `[n_pairs,
/// w.rows / n_expert]`. Reads only the experts the tiles name.
#[allow(clippy::too_many_arguments)]
pub fn moe_matvec(
    ctx: &GpuContext,
    w: &DeviceMatrix,
    n_expert: usize,
    x: DevicePtr,
    x_div: usize,
    pairs: DevicePtr,
    tiles: DevicePtr,
    n_pairs: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "moe_matvec";
    if n_pairs == 0 {
        return Ok(());
    }
    if !has_moe_kernels(w.format) {
        return Err(OpsError::shape(
            OP,
            "expert weights in q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K or q6_K",
            w.format.to_string(),
        ));
    }
    if n_expert == 0 || !w.rows.is_multiple_of(n_expert) || !w.cols.is_multiple_of(32) {
        return Err(OpsError::shape(
            OP,
            format!("a stack of {n_expert} experts of equal rows, columns a multiple of 32"),
            format!("{} rows of {} columns", w.rows, w.cols),
        ));
    }
    let shared = MOE_TILE * w.cols / 4 * 5;
    if shared > MAX_SHARED_BYTES {
        return Err(OpsError::shape(
            OP,
            format!(
                "at most {} columns (a tile's int8 activations in 48 KiB of shared memory)",
                MAX_SHARED_BYTES * 4 / 5 / MOE_TILE
            ),
            format!("{}", w.cols),
        ));
    }
    let rows = w.rows / n_expert;
    let expert_bytes = DeviceMatrix::bytes_for(w.format, rows, w.cols)? as u64;
    let rows32 = as_u32(OP, "the rows of an expert", rows)?;
    let slots = as_u32(
        OP,
        "the tile slots",
        moe_tile_slots(n_pairs, n_expert, MOE_TILE),
    )?;
    as_u32(OP, "pairs times rows", n_pairs.saturating_mul(rows))?;
    let config = LaunchConfig {
        grid: [
            rows32
                .div_ceil(ROWS_PER_BLOCK)
                .min(TARGET_BLOCKS.div_ceil(slots))
                .max(1),
            slots,
            1,
        ],
        block: [THREADS, 1, 1],
        shared_mem_bytes: shared as u32,
    };
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(w.ptr()))
        .arg(KernelArg::Ptr(x))
        .arg(KernelArg::Ptr(pairs))
        .arg(KernelArg::Ptr(tiles))
        .arg(KernelArg::U32(rows32))
        .arg(KernelArg::U32(as_u32(OP, "the column count", w.cols)?))
        .arg(KernelArg::U64(expert_bytes))
        .arg(KernelArg::U32(as_u32(
            OP,
            "the ranks per token",
            x_div.max(1),
        )?));
    let name = format!("ember_moe_matvec_{}", w.format.kernel_suffix());
    // SAFETY: ember_moe_matvec_<format>(float* y, const uint8_t* w, const float* x, const int32_t*
    // pairs, const int32_t* tiles, uint32_t n_rows, uint32_t n_cols, uint64_t expert_bytes,
    // uint32_t x_div) with the shared memory of a full tile (checked above); the tiles name
    // experts below n_expert, whose bytes lie inside W (n_expert * expert_bytes, checked by
    // DeviceMatrix::new), and pairs below n_pairs, whose rows of x and out the caller sized.
    unsafe { ctx.launch(KernelModule::MatVec, &name, config, &args) }
}

/// Most tokens for which a MoE layer takes the decode kernels ([`moe_glu`], [`moe_down`]): one
/// block column per (token, rank) pair, no sort into tiles. With 8 of 128 experts, 4 tokens'
/// 32 pairs name about 28.5 distinct experts, so reading an expert once per pair costs about 12%
/// more weight bytes than the tiles (the repeats mostly come from L2), and saves the sort, the
/// separate activation and combination and their launches; from 5 tokens on the tiles read
/// fewer bytes.
pub const MOE_DECODE_MAX_TOKENS: usize = 4;

/// Environment variable overriding [`MOE_DECODE_MAX_TOKENS`] (an integer, 0 turns the decode
/// kernels off), for tuning and for comparing both paths on one binary.
pub const MOE_DECODE_MAX_TOKENS_ENV: &str = "EMBER_MOE_DECODE_MAX_TOKENS";

fn decode_max_tokens() -> usize {
    static VALUE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *VALUE.get_or_init(|| {
        std::env::var(MOE_DECODE_MAX_TOKENS_ENV)
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(MOE_DECODE_MAX_TOKENS)
    })
}

/// Whether a MoE layer over `n_tokens` tokens takes the decode kernels ([`moe_glu`] and
/// [`moe_down`]) for experts of `n_ff` rows over `n_embd` columns with `n_used` experts per
/// token: at most [`MOE_DECODE_MAX_TOKENS`] tokens (or its environment override), and the
/// gate/up kernel's activations (a row of `n_embd`, rounded to int8 in shared memory) fit. The
/// down product reads its rounded input from global scratch, so `n_ff` has no bound here.
pub fn moe_decode_fits(n_tokens: usize, n_used: usize, n_embd: usize, n_ff: usize) -> bool {
    decode_fits_from(n_tokens, n_used, n_embd, n_ff, decode_max_tokens())
}

fn decode_fits_from(
    n_tokens: usize,
    n_used: usize,
    n_embd: usize,
    n_ff: usize,
    max_tokens: usize,
) -> bool {
    (1..=max_tokens).contains(&n_tokens)
        && n_used > 0
        && n_ff > 0
        && n_embd / 4 * 5 <= MAX_SHARED_BYTES
}

/// Checks the format and shape of one stack of experts for the decode kernels and returns the
/// rows of one expert and its bytes.
fn decode_stack(
    op: &'static str,
    w: &DeviceMatrix,
    n_expert: usize,
) -> Result<(u32, u64), OpsError> {
    if !has_moe_kernels(w.format) {
        return Err(OpsError::shape(
            op,
            "expert weights in q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K or q6_K",
            w.format.to_string(),
        ));
    }
    if n_expert == 0 || !w.rows.is_multiple_of(n_expert) || !w.cols.is_multiple_of(32) {
        return Err(OpsError::shape(
            op,
            format!("a stack of {n_expert} experts of equal rows, columns a multiple of 32"),
            format!("{} rows of {} columns", w.rows, w.cols),
        ));
    }
    let rows = w.rows / n_expert;
    let expert_bytes = DeviceMatrix::bytes_for(w.format, rows, w.cols)? as u64;
    Ok((as_u32(op, "the rows of an expert", rows)?, expert_bytes))
}

/// The grid along the rows of a decode launch: a block per `ROWS_PER_BLOCK`-row group of lane
/// groups of `lanes` lanes, at most about [`TARGET_BLOCKS`] blocks in all over `columns` block
/// columns (the rest is walked grid-stride).
fn decode_grid_x(rows: u32, lanes: u32, columns: u32) -> u32 {
    rows.div_ceil(THREADS / lanes)
        .min(TARGET_BLOCKS.div_ceil(columns.max(1)))
        .max(1)
}

/// Bytes of the scratch [`moe_down`] rounds its input into: `n_tokens * n_used` rows of `cols`
/// int8 values and a pair of f32 per 32 of them.
pub fn moe_down_scratch_bytes(n_tokens: usize, n_used: usize, cols: usize) -> usize {
    n_tokens.saturating_mul(n_used).saturating_mul(cols) / 4 * 5
}

/// Lanes per row of the fused down kernel for rows of `cols` values in `format`: 16 when a row
/// has at most 16 units (64 values for the k-quants, 32 for the others), which gives the same
/// sums as 32 lanes (matvec.hip) with half the lanes idle no more; else 32.
fn down_lanes(format: WeightFormat, cols: usize) -> u32 {
    if cols / format.block_values().min(64) <= 16 {
        16
    } else {
        LANES
    }
}

/// The gate and up products of a few tokens with the activation, fused (matvec.hip's
/// ember_moe_{swiglu,geglu}_<format>): `out[p] = act(G_e x[p / n_used]) * (U_e x[p / n_used])`
/// for every pair p of `experts` (i32 `[n_tokens, n_used]`, as [`moe_route`] writes them), e the
/// pair's expert, `gate` and `up` stacks of `n_expert` experts in one format and shape, `out` f32
/// `[n_pairs, gate.rows / n_expert]`. The values equal [`moe_matvec`] of both and the element-wise
/// activation. `activation` is "swiglu" or "geglu".
#[allow(clippy::too_many_arguments)]
pub fn moe_glu(
    ctx: &GpuContext,
    gate: &DeviceMatrix,
    up: &DeviceMatrix,
    n_expert: usize,
    x: DevicePtr,
    experts: DevicePtr,
    n_tokens: usize,
    n_used: usize,
    activation: &str,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "moe_glu";
    let n_pairs = n_tokens * n_used;
    if n_pairs == 0 {
        return Ok(());
    }
    if gate.format != up.format || gate.rows != up.rows || gate.cols != up.cols {
        return Err(OpsError::shape(
            OP,
            format!(
                "an up stack like the gate ({} {}x{})",
                gate.format, gate.rows, gate.cols
            ),
            format!("{} {}x{}", up.format, up.rows, up.cols),
        ));
    }
    if !matches!(activation, "swiglu" | "geglu") {
        return Err(OpsError::shape(OP, "swiglu or geglu", activation));
    }
    let (rows, expert_bytes) = decode_stack(OP, gate, n_expert)?;
    if gate.cols / 4 * 5 > MAX_SHARED_BYTES {
        return Err(OpsError::shape(
            OP,
            format!(
                "at most {} columns (a token's int8 activations in 48 KiB of shared memory)",
                MAX_SHARED_BYTES * 4 / 5
            ),
            format!("{}", gate.cols),
        ));
    }
    let pairs = as_u32(OP, "the pair count", n_pairs)?;
    as_u32(
        OP,
        "pairs times rows",
        n_pairs.saturating_mul(rows as usize),
    )?;
    let config = LaunchConfig {
        grid: [decode_grid_x(rows, LANES, pairs), pairs, 1],
        block: [THREADS, 1, 1],
        shared_mem_bytes: (gate.cols / 4 * 5) as u32,
    };
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(gate.ptr()))
        .arg(KernelArg::Ptr(up.ptr()))
        .arg(KernelArg::Ptr(x))
        .arg(KernelArg::Ptr(experts))
        .arg(KernelArg::U32(rows))
        .arg(KernelArg::U32(as_u32(OP, "the column count", gate.cols)?))
        .arg(KernelArg::U64(expert_bytes))
        .arg(KernelArg::U32(as_u32(OP, "the ranks per token", n_used)?));
    let name = format!("ember_moe_{activation}_{}", gate.format.kernel_suffix());
    // SAFETY: ember_moe_{swiglu,geglu}_<format>(float* y, const uint8_t* w_gate, const uint8_t*
    // w_up, const float* x, const int32_t* experts, uint32_t n_rows, uint32_t n_cols, uint64_t
    // expert_bytes, uint32_t n_used) with one token's shared memory (checked to fit); block
    // column p reads experts[p] (below n_expert, as moe_route wrote it), whose bytes lie inside
    // both stacks (same shape, checked; DeviceMatrix::new checked the buffers), row p / n_used of
    // x and writes row p of out, which the caller sized for n_pairs rows.
    unsafe { ctx.launch(KernelModule::MatVec, &name, config, &args) }
}

/// A shared expert's output added by [`moe_down`]: `out[t] += output[t]`, times
/// `sigmoid(logit[t])` when a gate is given.
#[derive(Clone, Copy, Debug)]
pub struct SharedOutput {
    /// f32 `[n_tokens, n_embd]`.
    pub output: DevicePtr,
    /// f32 `[n_tokens]`, the shared expert's gate logits.
    pub logit: Option<DevicePtr>,
}

/// The down product of a few tokens fused with the weighted combination (matvec.hip's
/// ember_moe_down_<format>_l<lanes>): `out[t] = sum_k weights[t, k] scale_e D_e h[t n_used + k]`
/// in rank order, e = `experts[t n_used + k]`, `scale_e` the expert's factor when `expert_scale`
/// is given, then plus `shared`'s output. `down` a stack of `n_expert` experts, `h` f32
/// `[n_tokens * n_used, down.cols]`, `out` f32 `[n_tokens, down.rows / n_expert]`. The values
/// equal [`moe_matvec`], [`moe_combine`] and [`moe_add_gated`] (or an add) bit for bit.
///
/// Two launches: h rounded to the format's 8-bit activations once (matvec.hip's
/// ember_quantize_act_*, into `h_quantized`, a scratch of [`moe_down_scratch_bytes`] bytes), then
/// the product, whose blocks read those instead of each rounding all of h again.
#[allow(clippy::too_many_arguments)]
pub fn moe_down(
    ctx: &GpuContext,
    down: &DeviceMatrix,
    n_expert: usize,
    h: DevicePtr,
    h_quantized: DevicePtr,
    experts: DevicePtr,
    weights: DevicePtr,
    expert_scale: Option<DevicePtr>,
    shared: Option<SharedOutput>,
    n_tokens: usize,
    n_used: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "moe_down";
    if n_tokens == 0 {
        return Ok(());
    }
    if n_used == 0 {
        return Err(OpsError::shape(OP, "at least one expert per token", "0"));
    }
    let (rows, expert_bytes) = decode_stack(OP, down, n_expert)?;
    let tokens = as_u32(OP, "the token count", n_tokens)?;
    as_u32(
        OP,
        "tokens times rows",
        n_tokens.saturating_mul(rows as usize),
    )?;
    let n_pairs = n_tokens
        .checked_mul(n_used)
        .ok_or_else(|| OpsError::shape(OP, "tokens times ranks below 2^64", "an overflow"))?;
    as_u32(OP, "pairs times columns", n_pairs.saturating_mul(down.cols))?;
    let pairs = as_u32(OP, "the pair count", n_pairs)?;
    let cols = as_u32(OP, "the column count", down.cols)?;
    let h_values = (n_pairs * down.cols) as u64;
    let quantize = LaunchConfig {
        grid: [pairs.min(TARGET_BLOCKS), 1, 1],
        block: [THREADS, 1, 1],
        shared_mem_bytes: 0,
    };
    let quantize_args = KernelArgs::new()
        .arg(KernelArg::Ptr(h_quantized))
        .arg(KernelArg::Ptr(h_quantized.offset(h_values)))
        .arg(KernelArg::Ptr(h))
        .arg(KernelArg::U32(pairs))
        .arg(KernelArg::U32(cols));
    // SAFETY: ember_quantize_act_<act>(int8_t* xq, float2* xds, const float* x, uint32_t n_rows,
    // uint32_t n_cols) reads n_pairs rows of down.cols f32 of h and writes n_pairs * down.cols
    // int8 values at h_quantized and a float2 per 32 of them right after (down.cols is a multiple
    // of 32, checked by decode_stack, so the float2s are 8-byte aligned): the
    // moe_down_scratch_bytes the caller provides.
    unsafe {
        ctx.launch(
            KernelModule::MatVec,
            &format!("ember_quantize_act_{}", activation_suffix(down.format)),
            quantize,
            &quantize_args,
        )?;
    }
    // A block takes a wave's worth of rows (wave / lanes: 32 or 64 lanes per wave) and walks
    // them grid-stride, so the grid is sized for 32-lane waves (blocks with no rows of a 64-lane
    // target leave at once) and the shared terms for 64.
    let lanes = down_lanes(down.format, down.cols);
    let config = LaunchConfig {
        grid: [rows.div_ceil(32 / lanes), tokens, 1],
        block: [THREADS, 1, 1],
        shared_mem_bytes: as_u32(
            OP,
            "the ranks' terms",
            n_used.saturating_mul(64 / lanes as usize) * 4,
        )?,
    };
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(down.ptr()))
        .arg(KernelArg::Ptr(h_quantized))
        .arg(KernelArg::Ptr(h_quantized.offset(h_values)))
        .arg(KernelArg::Ptr(experts))
        .arg(KernelArg::Ptr(weights))
        .arg(KernelArg::Ptr(expert_scale.unwrap_or(DevicePtr::NULL)))
        .arg(KernelArg::Ptr(shared.map_or(DevicePtr::NULL, |s| s.output)))
        .arg(KernelArg::Ptr(
            shared.and_then(|s| s.logit).unwrap_or(DevicePtr::NULL),
        ))
        .arg(KernelArg::U32(rows))
        .arg(KernelArg::U32(cols))
        .arg(KernelArg::U64(expert_bytes))
        .arg(KernelArg::U32(as_u32(OP, "the ranks per token", n_used)?));
    let name = format!("ember_moe_down_{}_l{lanes}", down.format.kernel_suffix());
    // SAFETY: ember_moe_down_<format>_l<lanes>(float* out, const uint8_t* w, const int8_t* hq,
    // const float2* hds, const int32_t* experts, const float* weights, const float*
    // expert_scale, const float* shared, const float* shared_logit, uint32_t n_rows, uint32_t
    // n_cols, uint64_t expert_bytes, uint32_t n_used) with n_used terms per row of a block in
    // shared memory; block column t reads rows t * n_used.. of the rounded h (written by the
    // launch above), experts and weights, the experts (below n_expert, as moe_route wrote them)
    // lie inside W (DeviceMatrix::new checked the buffer), a scale per expert when given, row t
    // of the shared output and logit t when given, and writes row t of out, all sized by the
    // caller for n_tokens.
    unsafe { ctx.launch(KernelModule::MatVec, &name, config, &args) }
}

/// `out[t] = sum_k weights[t, k] routed[t * n_used + k]` for `n_tokens` tokens of `n_embd`
/// values, in rank order. With `expert_scale` (f32, one factor per expert, Gemma 4's
/// `ffn_down_exps.scale`), each routed row is first multiplied by the factor of its expert,
/// `experts[t * n_used + k]` (i32, as [`moe_route`] writes them).
#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    ctx: &GpuContext,
    routed: DevicePtr,
    weights: DevicePtr,
    experts: DevicePtr,
    expert_scale: Option<DevicePtr>,
    n_tokens: usize,
    n_used: usize,
    n_embd: usize,
    out: DevicePtr,
) -> Result<(), OpsError> {
    const OP: &str = "moe_combine";
    if n_tokens == 0 || n_embd == 0 {
        return Ok(());
    }
    if n_used == 0 {
        return Err(OpsError::shape(OP, "at least one expert per token", "0"));
    }
    let dim = as_u32(OP, "the row length", n_embd)?;
    as_u32(OP, "pairs times the row length", n_tokens * n_used * n_embd)?;
    let config = LaunchConfig {
        grid: [
            dim.div_ceil(256),
            as_u32(OP, "the token count", n_tokens)?,
            1,
        ],
        block: [256, 1, 1],
        shared_mem_bytes: 0,
    };
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(routed))
        .arg(KernelArg::Ptr(weights))
        .arg(KernelArg::Ptr(experts))
        .arg(KernelArg::Ptr(expert_scale.unwrap_or(DevicePtr::NULL)))
        .arg(KernelArg::U32(dim))
        .arg(KernelArg::U32(as_u32(OP, "the ranks per token", n_used)?));
    // SAFETY: ember_moe_combine_f32(float* out, const float* routed, const float* weights, const
    // int32_t* experts, const float* expert_scale, uint32_t n_embd, uint32_t n_used); block (bx,
    // t) reads rows t * n_used.. of routed, weights and experts and writes row t of out, all sized
    // by the caller; with a scale it reads the factor of each expert named there (the caller's
    // scale vector holds one per expert of the layer, and the router names no other).
    unsafe { ctx.launch(KernelModule::Moe, "ember_moe_combine_f32", config, &args) }
}

/// `out[t] += x[t] * sigmoid(logit[t])` for `n_tokens` rows of `n_embd` (a shared expert's
/// per-token gate).
pub fn moe_add_gated(
    ctx: &GpuContext,
    out: DevicePtr,
    x: DevicePtr,
    logit: DevicePtr,
    n_tokens: usize,
    n_embd: usize,
) -> Result<(), OpsError> {
    const OP: &str = "moe_add_gated";
    if n_tokens == 0 || n_embd == 0 {
        return Ok(());
    }
    let dim = as_u32(OP, "the row length", n_embd)?;
    as_u32(OP, "tokens times the row length", n_tokens * n_embd)?;
    let config = LaunchConfig {
        grid: [
            dim.div_ceil(256),
            as_u32(OP, "the token count", n_tokens)?,
            1,
        ],
        block: [256, 1, 1],
        shared_mem_bytes: 0,
    };
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(out))
        .arg(KernelArg::Ptr(x))
        .arg(KernelArg::Ptr(logit))
        .arg(KernelArg::U32(dim));
    // SAFETY: ember_moe_add_gated_f32(float* out, const float* x, const float* logit, uint32_t
    // n_embd); block (bx, t) reads row t of x and logit[t] and updates row t of out.
    unsafe { ctx.launch(KernelModule::Moe, "ember_moe_add_gated_f32", config, &args) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_take_the_grouped_mmq_tiles_and_decode_the_matvec() {
        // Qwen3-30B-A3B's routing, 8 of 128 experts.
        let tile = |n_tokens| mmq_tile_from(n_tokens, 8, 128, MOE_MMQ_MIN_TOKENS);
        assert_eq!(tile(1), None);
        assert_eq!(tile(31), None);
        // 2 pairs per expert on average: tiles of 16.
        assert_eq!(tile(32), Some(16));
        // 16 pairs (1.5 x 16 = 24): tiles of 32; 32 pairs (pp512): tiles of 64.
        assert_eq!(tile(256), Some(32));
        assert_eq!(tile(512), Some(64));
        assert_eq!(tile(4096), Some(64));
        assert_eq!(mmq_tile_from(64, 8, 0, MOE_MMQ_MIN_TOKENS), None);
        // A threshold above the batch keeps the matrix-vector path.
        assert_eq!(mmq_tile_from(512, 8, 128, 513), None);
    }

    #[test]
    fn decode_kernels_serve_a_few_tokens_whose_activations_fit() {
        // Qwen3-30B-A3B (8 of 128, n_embd 2048, expert n_ff 768) and Gemma 4 26B-A4B (2816, 704).
        let fits = |n_tokens, max| decode_fits_from(n_tokens, 8, 2048, 768, max);
        assert!(fits(1, MOE_DECODE_MAX_TOKENS));
        assert!(fits(4, MOE_DECODE_MAX_TOKENS));
        assert!(!fits(5, MOE_DECODE_MAX_TOKENS));
        assert!(!fits(0, MOE_DECODE_MAX_TOKENS));
        // 0 turns the decode kernels off.
        assert!(!fits(1, 0));
        assert!(decode_fits_from(1, 8, 2816, 704, MOE_DECODE_MAX_TOKENS));
        // The down product's input is rounded into global scratch, so any n_ff serves; the
        // gate/up input (a row of n_embd) must fit 48 KiB as int8 plus scales: 39296 columns do,
        // 39360 do not.
        assert!(decode_fits_from(1, 8, 2048, 4928, 4));
        assert!(decode_fits_from(1, 8, 39296, 768, 4));
        assert!(!decode_fits_from(1, 8, 39360, 768, 4));
        assert!(!decode_fits_from(1, 0, 2048, 768, 4));
    }

    #[test]
    fn down_rows_of_at_most_16_units_take_16_lanes() {
        // Qwen3-30B-A3B's 768 columns: 12 units of q4_K or q6_K, 24 of q8_0.
        assert_eq!(down_lanes(WeightFormat::Q4K, 768), 16);
        assert_eq!(down_lanes(WeightFormat::Q6K, 768), 16);
        assert_eq!(down_lanes(WeightFormat::Q8_0, 768), 32);
        // Gemma 4's 704 columns (22 blocks of 32), Qwen3.5-35B-A3B's 512.
        assert_eq!(down_lanes(WeightFormat::Q5_0, 704), 32);
        assert_eq!(down_lanes(WeightFormat::Q8_0, 512), 16);
        assert_eq!(down_lanes(WeightFormat::Q4K, 1024), 16);
        assert_eq!(down_lanes(WeightFormat::Q4K, 1280), 32);
    }

    #[test]
    fn tile_slots_cover_a_partial_last_tile_per_expert() {
        assert_eq!(moe_tile_slots(8, 128, MOE_TILE), 8);
        assert_eq!(moe_tile_slots(4096, 128, 64), 192);
        assert_eq!(moe_tile_slots(4096, 128, MOE_TILE), 640);
    }
}
