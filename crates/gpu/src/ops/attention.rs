//! Causal grouped-query attention over a paged f16 KV cache, and the store of new keys and
//! values into it (kernels/attention.hip).
//!
//! The cache of one layer is a set of physical blocks, each allocated on its own (so the engine
//! can take blocks from the pool as sequences grow and give them back when they end): block `b`
//! holds `block_size` token slots of `n_kv_heads * head_dim` f16 keys at `k_blocks[b]` and as
//! many values at `v_blocks[b]`, where `k_blocks`/`v_blocks` are device arrays of u64 addresses.
//! A sequence's block table maps its logical blocks to physical ones (vLLM's paged attention).
//!
//! Two kernels compute the same function; [`attention`] picks one per call:
//! - decode (flash decoding): one thread block per (key partition of 256, head, token), merged
//!   by a reduce kernel when a token has more than one partition; right when each token is the
//!   only query of its sequence in the batch;
//! - prefill (tiled flash attention): one thread block per (16 consecutive batch tokens, head),
//!   key tiles of 32 staged in shared memory and reused by all 16 queries, online softmax.
//!
//! Masking is by position, as in the CPU backend (engine/src/backend/cpu/attention.rs): token `t`
//! sees the positions `p` of its table with `p <= positions[t]` and, with a window `w`,
//! `positions[t] - p < w`. Queries are rounded to f16 before the dot products as there.

use crate::driver::{DevicePtr, KernelArg, KernelArgs, LaunchConfig};
use crate::kernels::KernelModule;
use crate::pool::Purpose;

use super::{as_u32, GpuContext, OpsError};

/// Threads per block of the attention kernels (attention.hip's EMBER_ATTN_THREADS).
const ATTENTION_THREADS: u32 = 128;
/// Keys per decode partition (EMBER_ATTN_PARTITION).
const PARTITION: usize = 256;
/// Query tokens per prefill thread block (EMBER_ATTN_TILE_Q).
const TILE_Q: usize = 16;
/// Largest head size the kernels handle (EMBER_ATTN_MAX_HEAD_DIM).
pub const MAX_HEAD_DIM: usize = 256;
/// Threads per block of `ember_kv_store_f16`.
const KV_STORE_THREADS: u32 = 256;
/// grid.y and grid.z limit of every runtime.
const MAX_GRID_YZ: usize = 65_535;

/// One attention launch over a paged K/V cache (see the module docs for the cache layout).
#[derive(Clone, Copy, Debug)]
pub struct AttentionArgs {
    /// f32 `[n_tokens, n_heads, head_dim]`.
    pub q: DevicePtr,
    /// f32 `[n_tokens, n_heads, head_dim]`.
    pub out: DevicePtr,
    /// u64 device addresses of each physical K block (0 for a block without memory).
    pub k_blocks: DevicePtr,
    /// u64 device addresses of each physical V block.
    pub v_blocks: DevicePtr,
    /// i32 `[n_tables, max_blocks_per_table]`: physical block of each logical block.
    pub block_tables: DevicePtr,
    /// i32 `[n_tokens]`: the block table of each token.
    pub table_of_token: DevicePtr,
    /// i32 `[n_tokens]`: token t attends to positions `0..=positions[t]` of its table (the last
    /// `window` of them with a window); their keys and values must be stored already.
    pub positions: DevicePtr,
    pub n_tokens: usize,
    pub n_tables: usize,
    pub max_blocks_per_table: usize,
    /// An upper bound of `positions[t]` over the batch (sizes the decode partitions).
    pub max_position: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// Even and at most [`MAX_HEAD_DIM`]; multiples of 8 load fastest.
    pub head_dim: usize,
    pub block_size: usize,
    /// Multiplies `q . k` (usually `1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Sliding window: a token at `p` sees positions `q` with `p - q < window`.
    pub window: Option<usize>,
    /// Scores become `softcap * tanh(score / softcap)` (after `scale`).
    pub softcap: Option<f32>,
}

/// Which kernel [`attention_with`] runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    /// Decode when the batch has at most one token per table on average, else prefill.
    Auto,
    /// Flash decoding: parallel over key partitions, one query per thread block.
    Decode,
    /// Tiled flash attention: 16 queries per thread block share each key tile.
    Prefill,
}

/// Attention of every query token over its sequence's cached keys and values. Asynchronous on
/// the context's stream; long decode contexts take a scratch buffer from the pool.
pub fn attention(ctx: &GpuContext, args: &AttentionArgs) -> Result<(), OpsError> {
    attention_with(ctx, args, AttentionKernel::Auto)
}

/// [`attention`] with a chosen kernel (tests compare the two; both give the same results).
pub fn attention_with(
    ctx: &GpuContext,
    args: &AttentionArgs,
    kernel: AttentionKernel,
) -> Result<(), OpsError> {
    const OP: &str = "attention";
    if args.n_tokens == 0 || args.n_heads == 0 {
        return Ok(());
    }
    check_shape(args)?;
    let kernel = match kernel {
        AttentionKernel::Auto if args.n_tokens <= args.n_tables => AttentionKernel::Decode,
        AttentionKernel::Auto => AttentionKernel::Prefill,
        chosen => chosen,
    };
    // The decode grid has one z-slice per token.
    let kernel = if kernel == AttentionKernel::Decode && args.n_tokens > MAX_GRID_YZ {
        AttentionKernel::Prefill
    } else {
        kernel
    };
    let window = match args.window {
        None => 0,
        Some(w) => i32::try_from(w).unwrap_or(i32::MAX),
    };
    let softcap = args.softcap.unwrap_or(0.0);
    let n_tokens = as_u32(OP, "the token count", args.n_tokens)?;
    let n_heads = as_u32(OP, "the head count", args.n_heads)?;
    let n_kv_heads = as_u32(OP, "the KV head count", args.n_kv_heads)?;
    let head_dim = as_u32(OP, "the head size", args.head_dim)?;
    let block_size = as_u32(OP, "the block size", args.block_size)?;
    let max_blocks = as_u32(OP, "the blocks per table", args.max_blocks_per_table)?;

    match kernel {
        AttentionKernel::Prefill | AttentionKernel::Auto => {
            let name = if args.head_dim <= 64 {
                "ember_attention_prefill_d64"
            } else if args.head_dim <= 128 {
                "ember_attention_prefill_d128"
            } else {
                "ember_attention_prefill_d256"
            };
            let launch_args = KernelArgs::new()
                .arg(KernelArg::Ptr(args.out))
                .arg(KernelArg::Ptr(args.q))
                .arg(KernelArg::Ptr(args.k_blocks))
                .arg(KernelArg::Ptr(args.v_blocks))
                .arg(KernelArg::Ptr(args.block_tables))
                .arg(KernelArg::Ptr(args.table_of_token))
                .arg(KernelArg::Ptr(args.positions))
                .arg(KernelArg::U32(n_tokens))
                .arg(KernelArg::U32(n_heads))
                .arg(KernelArg::U32(n_kv_heads))
                .arg(KernelArg::U32(head_dim))
                .arg(KernelArg::U32(block_size))
                .arg(KernelArg::U32(max_blocks))
                .arg(KernelArg::F32(args.scale))
                .arg(KernelArg::I32(window))
                .arg(KernelArg::F32(softcap));
            let config = LaunchConfig {
                grid: [n_tokens.div_ceil(TILE_Q as u32), n_heads, 1],
                block: [ATTENTION_THREADS, 1, 1],
                shared_mem_bytes: 0,
            };
            // SAFETY: ember_attention_prefill_dN(float* out, const float* q, const uint64_t*
            // k_blocks, const uint64_t* v_blocks, const int32_t* block_tables, const int32_t*
            // table_of_token, const int32_t* positions, uint32_t n_tokens, uint32_t n_heads,
            // uint32_t n_kv_heads, uint32_t head_dim, uint32_t block_size, uint32_t
            // max_blocks_per_table, float scale, int32_t window, float softcap) with head_dim <= N
            // (checked). It reads q and writes out for n_tokens tokens, and reads the cache
            // slots of positions the caller declared stored through its tables.
            unsafe { ctx.launch(KernelModule::Attention, name, config, &launch_args) }
        }
        AttentionKernel::Decode => {
            let n_keys = args.max_position.saturating_add(1);
            let n_keys = args.window.map_or(n_keys, |w| n_keys.min(w));
            let n_partitions = n_keys.div_ceil(PARTITION).max(1);
            let n_partitions_u32 = as_u32(OP, "the key partitions", n_partitions)?;
            // Partial results only when a token can have more than one partition.
            let partials = if n_partitions > 1 {
                let n_partials = args
                    .n_tokens
                    .checked_mul(args.n_heads)
                    .and_then(|n| n.checked_mul(n_partitions))
                    .ok_or_else(|| {
                        OpsError::shape(
                            OP,
                            "tokens x heads x partitions that fit in memory",
                            format!("{} x {} x {n_partitions}", args.n_tokens, args.n_heads),
                        )
                    })?;
                let acc_bytes = (n_partials * args.head_dim * 4).next_multiple_of(256);
                let buffer = ctx.alloc(Purpose::Scratch, (acc_bytes + n_partials * 8) as u64)?;
                Some((buffer, acc_bytes))
            } else {
                None
            };
            let (partial_acc, partial_ms) = match &partials {
                Some((buffer, acc_bytes)) => (buffer.ptr(), buffer.ptr().offset(*acc_bytes as u64)),
                None => (DevicePtr::NULL, DevicePtr::NULL),
            };
            let launch_args = KernelArgs::new()
                .arg(KernelArg::Ptr(args.out))
                .arg(KernelArg::Ptr(partial_acc))
                .arg(KernelArg::Ptr(partial_ms))
                .arg(KernelArg::Ptr(args.q))
                .arg(KernelArg::Ptr(args.k_blocks))
                .arg(KernelArg::Ptr(args.v_blocks))
                .arg(KernelArg::Ptr(args.block_tables))
                .arg(KernelArg::Ptr(args.table_of_token))
                .arg(KernelArg::Ptr(args.positions))
                .arg(KernelArg::U32(n_heads))
                .arg(KernelArg::U32(n_kv_heads))
                .arg(KernelArg::U32(head_dim))
                .arg(KernelArg::U32(block_size))
                .arg(KernelArg::U32(max_blocks))
                .arg(KernelArg::U32(n_partitions_u32))
                .arg(KernelArg::F32(args.scale))
                .arg(KernelArg::I32(window))
                .arg(KernelArg::F32(softcap));
            let config = LaunchConfig {
                grid: [n_partitions_u32, n_heads, n_tokens],
                block: [ATTENTION_THREADS, 1, 1],
                shared_mem_bytes: 0,
            };
            // SAFETY: ember_attention_decode_partial(float* out, float* partial_acc, float2*
            // partial_ms, const float* q, const uint64_t* k_blocks, const uint64_t* v_blocks,
            // const int32_t* block_tables, const int32_t* table_of_token, const int32_t*
            // positions, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t
            // block_size, uint32_t max_blocks_per_table, uint32_t n_partitions, float scale,
            // int32_t window, float softcap). Partition p of (token, head) writes entry p of its
            // partial rows (n_tokens x n_heads x n_partitions, allocated above) or, with one
            // partition, its row of out; it reads q and the declared cache slots.
            unsafe {
                ctx.launch(
                    KernelModule::Attention,
                    "ember_attention_decode_partial",
                    config,
                    &launch_args,
                )
            }?;
            if partials.is_some() {
                let reduce_args = KernelArgs::new()
                    .arg(KernelArg::Ptr(args.out))
                    .arg(KernelArg::Ptr(partial_acc))
                    .arg(KernelArg::Ptr(partial_ms))
                    .arg(KernelArg::U32(n_heads))
                    .arg(KernelArg::U32(head_dim))
                    .arg(KernelArg::U32(n_partitions_u32));
                let config = LaunchConfig {
                    grid: [n_heads, n_tokens, 1],
                    block: [ATTENTION_THREADS, 1, 1],
                    shared_mem_bytes: 0,
                };
                // SAFETY: ember_attention_decode_reduce(float* out, const float* partial_acc,
                // const float2* partial_ms, uint32_t n_heads, uint32_t head_dim, uint32_t
                // n_partitions) reads the partials written above (same stream, so after them)
                // and writes out's n_tokens x n_heads rows.
                unsafe {
                    ctx.launch(
                        KernelModule::Attention,
                        "ember_attention_decode_reduce",
                        config,
                        &reduce_args,
                    )
                }?;
            }
            Ok(())
        }
    }
}

/// Checks what the kernels require of the shape.
fn check_shape(args: &AttentionArgs) -> Result<(), OpsError> {
    const OP: &str = "attention";
    if args.n_kv_heads == 0 || args.n_heads % args.n_kv_heads != 0 {
        return Err(OpsError::shape(
            OP,
            format!("a KV head count dividing the {} query heads", args.n_heads),
            format!("{}", args.n_kv_heads),
        ));
    }
    if args.head_dim == 0 || args.head_dim % 2 != 0 || args.head_dim > MAX_HEAD_DIM {
        return Err(OpsError::shape(
            OP,
            format!("an even head size of at most {MAX_HEAD_DIM}"),
            format!("{}", args.head_dim),
        ));
    }
    if args.block_size == 0 {
        return Err(OpsError::shape(OP, "a block size above 0", "0"));
    }
    if args.n_tables == 0 || args.max_blocks_per_table == 0 {
        return Err(OpsError::shape(
            OP,
            "at least one block table with at least one block",
            format!(
                "{} tables of {} blocks",
                args.n_tables, args.max_blocks_per_table
            ),
        ));
    }
    if args.n_heads > MAX_GRID_YZ {
        return Err(OpsError::shape(
            OP,
            format!("at most {MAX_GRID_YZ} heads"),
            format!("{}", args.n_heads),
        ));
    }
    if args.window == Some(0) {
        return Err(OpsError::shape(OP, "a window of at least 1 position", "0"));
    }
    if !args.scale.is_finite() {
        return Err(OpsError::shape(
            OP,
            "a finite score scale",
            format!("{}", args.scale),
        ));
    }
    if let Some(cap) = args.softcap {
        if !(cap.is_finite() && cap > 0.0) {
            return Err(OpsError::shape(
                OP,
                "a positive finite softcap",
                format!("{cap}"),
            ));
        }
    }
    Ok(())
}

/// Stores `n_tokens` rows of K and V (f32, `row_values = n_kv_heads * head_dim` each) as f16
/// into their slots: `slots[t] = block * block_size + offset` (i32 on the device) puts token t in
/// slot `offset` of physical block `block` (`k_blocks[block]`, `v_blocks[block]`). A negative
/// slot is skipped (padding). Asynchronous on the context's stream.
#[allow(clippy::too_many_arguments)]
pub fn kv_store(
    ctx: &GpuContext,
    k_blocks: DevicePtr,
    v_blocks: DevicePtr,
    k: DevicePtr,
    v: DevicePtr,
    slots: DevicePtr,
    n_tokens: usize,
    row_values: usize,
    block_size: usize,
) -> Result<(), OpsError> {
    const OP: &str = "kv_store";
    if n_tokens == 0 || row_values == 0 {
        return Ok(());
    }
    if block_size == 0 {
        return Err(OpsError::shape(OP, "a block size above 0", "0"));
    }
    let n_tokens = as_u32(OP, "the token count", n_tokens)?;
    let args = KernelArgs::new()
        .arg(KernelArg::Ptr(k_blocks))
        .arg(KernelArg::Ptr(v_blocks))
        .arg(KernelArg::Ptr(k))
        .arg(KernelArg::Ptr(v))
        .arg(KernelArg::Ptr(slots))
        .arg(KernelArg::U32(as_u32(OP, "the row length", row_values)?))
        .arg(KernelArg::U32(as_u32(OP, "the block size", block_size)?));
    // SAFETY: ember_kv_store_f16(const uint64_t* k_blocks, const uint64_t* v_blocks, const float*
    // k, const float* v, const int32_t* slots, uint32_t row_values, uint32_t block_size); block t
    // reads slots[t] and row t of k and v (sized by the caller for n_tokens rows) and writes one
    // row of row_values halves into the block that slot names (skipping negative slots and
    // blocks whose address is 0).
    unsafe {
        ctx.launch(
            KernelModule::Attention,
            "ember_kv_store_f16",
            LaunchConfig::linear(n_tokens, KV_STORE_THREADS),
            &args,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> AttentionArgs {
        AttentionArgs {
            q: DevicePtr::NULL,
            out: DevicePtr::NULL,
            k_blocks: DevicePtr::NULL,
            v_blocks: DevicePtr::NULL,
            block_tables: DevicePtr::NULL,
            table_of_token: DevicePtr::NULL,
            positions: DevicePtr::NULL,
            n_tokens: 4,
            n_tables: 1,
            max_blocks_per_table: 8,
            max_position: 100,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            block_size: 16,
            scale: 0.088,
            window: None,
            softcap: None,
        }
    }

    fn check_rejected(change: impl FnOnce(&mut AttentionArgs), expected: &str) {
        let mut a = args();
        change(&mut a);
        let error = check_shape(&a).unwrap_err().to_string();
        assert!(error.contains(expected), "{error}");
    }

    #[test]
    fn shapes_the_kernels_cannot_serve_are_errors() {
        check_shape(&args()).unwrap();
        check_rejected(
            |a| a.n_kv_heads = 5,
            "a KV head count dividing the 32 query heads",
        );
        check_rejected(|a| a.n_kv_heads = 0, "found 0");
        check_rejected(|a| a.head_dim = 257, "an even head size of at most 256");
        check_rejected(|a| a.head_dim = 81, "found 81");
        check_rejected(|a| a.block_size = 0, "a block size above 0");
        check_rejected(|a| a.window = Some(0), "a window of at least 1");
        check_rejected(|a| a.softcap = Some(-1.0), "a positive finite softcap");
        check_rejected(|a| a.scale = f32::NAN, "a finite score scale");
        check_rejected(|a| a.n_tables = 0, "at least one block table");
    }
}
