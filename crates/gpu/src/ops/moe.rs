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
use super::{as_u32, DeviceMatrix, GpuContext, OpsError, WeightFormat};

/// Pairs per tile (matvec.hip's EMBER_MOE_TILE).
pub const MOE_TILE: usize = 8;
/// Most experts a layer may have (moe.hip's EMBER_MOE_MAX_EXPERTS).
pub const MOE_MAX_EXPERTS: usize = 512;
/// Threads per block of the grouped products (matvec.hip's EMBER_MATVEC_THREADS).
const THREADS: u32 = 256;
/// Rows one block serves per pass (threads over matvec.hip's EMBER_MATVEC_LANES).
const ROWS_PER_BLOCK: u32 = 256 / 32;
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
    fn tile_slots_cover_a_partial_last_tile_per_expert() {
        assert_eq!(moe_tile_slots(8, 128, MOE_TILE), 8);
        assert_eq!(moe_tile_slots(4096, 128, 64), 192);
        assert_eq!(moe_tile_slots(4096, 128, MOE_TILE), 640);
    }
}
