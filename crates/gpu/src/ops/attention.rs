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
//! - decode (flash decoding): one thread block per (key partition of 64, head, token), merged
//!   by a reduce kernel when a token has more than one partition; right when each token is the
//!   only query of its sequence in the batch;
//! - prefill (tiled flash attention): one thread block per (16 consecutive batch tokens, head),
//!   key tiles of 32 staged in shared memory and reused by all 16 queries, online softmax.
//!   On NVIDIA targets, heads of exactly 64 or 128 take its tensor-core form instead
//!   (`ember_attention_prefill_mma_dN`: 64 queries per block, key tiles of 64, S = Q K^T and
//!   O += P V with mma.sync, the weights P rounded to f16); see `prefill_kernel`.
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
const PARTITION: usize = 64;
/// Query tokens per prefill thread block (EMBER_ATTN_TILE_Q).
const TILE_Q: usize = 16;
/// Query tokens per block of the tensor-core prefill kernels (EMBER_FA_ROWS).
const MMA_TILE_Q: usize = 64;
/// The tensor-core prefill runs when the batch averages at least this many tokens per table. A
/// block walks each table of its 64 tokens in turn, so a block of many short sequences (decode
/// tokens batched with a prefill) would walk many caches with one busy warp: such batches keep
/// the 16-token tiled kernel.
const MMA_MIN_TOKENS_PER_TABLE: usize = MMA_TILE_Q / 2;
/// Largest head size the kernels handle (EMBER_ATTN_MAX_HEAD_DIM): Gemma 4's global layers have
/// heads of 512.
pub const MAX_HEAD_DIM: usize = 512;
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
    /// Tiled flash attention: 16 queries per thread block share each key tile (64 per block on
    /// the tensor cores where `prefill_kernel` picks that form).
    Prefill,
}

/// Attention of every query token over its sequence's cached keys and values. Asynchronous on
/// the context's stream; long decode contexts take a scratch buffer from the pool. In reference
/// numerics, the exact kernel for the context's reference thread count.
pub fn attention(ctx: &GpuContext, args: &AttentionArgs) -> Result<(), OpsError> {
    if ctx.reference() {
        return super::exact_attention::attention_exact(ctx, args, ctx.reference_threads());
    }
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
            let mma = args.n_tokens >= MMA_MIN_TOKENS_PER_TABLE * args.n_tables.max(1);
            let (name, tile_q) = prefill_kernel(ctx.arch(), args.head_dim, mma);
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
                grid: [n_tokens.div_ceil(tile_q as u32), n_heads, 1],
                block: [ATTENTION_THREADS, 1, 1],
                shared_mem_bytes: 0,
            };
            // SAFETY: ember_attention_prefill_dN and ember_attention_prefill_mma_dN (float* out,
            // const float* q, const uint64_t* k_blocks, const uint64_t* v_blocks, const int32_t*
            // block_tables, const int32_t* table_of_token, const int32_t* positions, uint32_t
            // n_tokens, uint32_t n_heads, uint32_t n_kv_heads, uint32_t head_dim, uint32_t
            // block_size, uint32_t max_blocks_per_table, float scale, int32_t window, float
            // softcap) with head_dim <= N (checked; prefill_kernel picks an mma kernel only for
            // head_dim == N), 128 threads per block (ATTENTION_THREADS = EMBER_FA_THREADS). It
            // reads q and writes out for n_tokens tokens, and reads the cache slots of positions
            // the caller declared stored through its tables.
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
/// The prefill kernel for a head size on an architecture, and its query tokens per block. When
/// the batch suits it (`mma`), NVIDIA targets (every sm_* target ember builds, sm_80 and newer,
/// has m16n8k16 mma) take the tensor-core kernel for heads of exactly 64 or 128; everything else
/// the tiled kernel of the smallest sufficient width.
fn prefill_kernel(arch: &str, head_dim: usize, mma: bool) -> (&'static str, usize) {
    if mma && arch.starts_with("sm_") {
        match head_dim {
            64 => return ("ember_attention_prefill_mma_d64", MMA_TILE_Q),
            128 => return ("ember_attention_prefill_mma_d128", MMA_TILE_Q),
            _ => {}
        }
    }
    let name = if head_dim <= 64 {
        "ember_attention_prefill_d64"
    } else if head_dim <= 128 {
        "ember_attention_prefill_d128"
    } else if head_dim <= 256 {
        "ember_attention_prefill_d256"
    } else {
        "ember_attention_prefill_d512"
    };
    (name, TILE_Q)
}

fn check_shape(args: &AttentionArgs) -> Result<(), OpsError> {
    const OP: &str = "attention";
    if args.n_kv_heads == 0 || !args.n_heads.is_multiple_of(args.n_kv_heads) {
        return Err(OpsError::shape(
            OP,
            format!("a KV head count dividing the {} query heads", args.n_heads),
            format!("{}", args.n_kv_heads),
        ));
    }
    if args.head_dim == 0 || !args.head_dim.is_multiple_of(2) || args.head_dim > MAX_HEAD_DIM {
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
pub(super) mod tests {
    //! Shape checks, and the wrappers run on the host driver against Rust twins of the kernels:
    //! the twins decode the arguments in the order the kernels' C signatures declare them and
    //! do the work of the blocks the launch asks for, so wrong argument order, a wrong grid or a
    //! wrong scratch layout fails here. The kernels' arithmetic is tested on the GPU by
    //! kernels/tests/harness_attention.cu.

    use std::sync::Arc;

    use half::f16;

    use super::*;
    use crate::driver::Driver;
    use crate::host::{HostDriver, HostDriverConfig, HostLaunch};
    use crate::kernels::{KernelLibrary, KERNEL_MODULES};
    use crate::ops::GpuContextOptions;
    use crate::pool::{DevicePool, PoolBuffer, PoolConfig, PoolKind};

    /// A context on the host driver with a code object file for every module; `register` adds
    /// the kernel twins a test needs.
    pub(in crate::ops) fn host_context(
        register: impl FnOnce(&HostDriver),
    ) -> (GpuContext, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        for spec in KERNEL_MODULES {
            let path = dir.path().join("host").join(format!("{}.hsaco", spec.stem));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b"host code object").unwrap();
        }
        let driver = Arc::new(HostDriver::new(HostDriverConfig::default()));
        register(&driver);
        let dyn_driver: Arc<dyn Driver> = driver;
        let pool = DevicePool::with_kind(
            dyn_driver,
            0,
            PoolKind::Caching,
            "test".to_string(),
            PoolConfig::default(),
        )
        .unwrap();
        let ctx = GpuContext::with_options(
            Arc::new(pool),
            Arc::new(KernelLibrary::new(dir.path().to_path_buf())),
            &GpuContextOptions { disable_blas: true },
        )
        .unwrap();
        (ctx, dir)
    }

    pub(in crate::ops) fn upload_bytes(ctx: &GpuContext, bytes: &[u8]) -> PoolBuffer {
        let buffer = ctx
            .alloc(Purpose::Scratch, bytes.len().max(4) as u64)
            .unwrap();
        ctx.upload(buffer.ptr(), bytes).unwrap();
        buffer
    }

    pub(in crate::ops) fn upload_f32(ctx: &GpuContext, values: &[f32]) -> PoolBuffer {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        upload_bytes(ctx, &bytes)
    }

    pub(in crate::ops) fn download_f32(ctx: &GpuContext, ptr: DevicePtr, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; n * 4];
        ctx.download(ptr, &mut bytes).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }

    /// Deterministic values in [-1, 1).
    pub(in crate::ops) fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let h = (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)).rotate_left(13);
                (h % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn read_u64(l: &HostLaunch<'_>, ptr: DevicePtr, index: usize) -> Result<u64, String> {
        let mut bytes = [0u8; 8];
        l.read(ptr.offset(index as u64 * 8), &mut bytes)?;
        Ok(u64::from_le_bytes(bytes))
    }

    fn read_i32(l: &HostLaunch<'_>, ptr: DevicePtr, index: usize) -> Result<i32, String> {
        let mut bytes = [0u8; 4];
        l.read(ptr.offset(index as u64 * 4), &mut bytes)?;
        Ok(i32::from_le_bytes(bytes))
    }

    fn i32_arg(l: &HostLaunch<'_>, index: usize) -> Result<i32, String> {
        match l.args().get(index) {
            Some(KernelArg::I32(v)) => Ok(*v),
            other => Err(format!(
                "argument {index}: expected an i32, found {other:?}"
            )),
        }
    }

    /// What the attention kernels share: the cache, the batch and the score parameters.
    struct Cache {
        k_blocks: DevicePtr,
        v_blocks: DevicePtr,
        tables: DevicePtr,
        table_of_token: DevicePtr,
        positions: DevicePtr,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        block_size: usize,
        max_blocks: usize,
        scale: f64,
        window: i32,
        softcap: f64,
    }

    impl Cache {
        /// One K or V row of `kv_head` at `position` of `table`.
        fn row(
            &self,
            l: &HostLaunch<'_>,
            blocks: DevicePtr,
            table: usize,
            position: usize,
            kv_head: usize,
        ) -> Result<Vec<f64>, String> {
            let block = read_i32(
                l,
                self.tables,
                table * self.max_blocks + position / self.block_size,
            )?;
            let address = read_u64(l, blocks, block as usize)?;
            let row_values = self.n_kv_heads * self.head_dim;
            let offset = ((position % self.block_size) * row_values + kv_head * self.head_dim) * 2;
            let mut bytes = vec![0u8; self.head_dim * 2];
            l.read(DevicePtr(address).offset(offset as u64), &mut bytes)?;
            Ok(bytes
                .chunks_exact(2)
                .map(|c| f64::from(f16::from_le_bytes([c[0], c[1]]).to_f32()))
                .collect())
        }

        /// (max, sum of exp, unnormalised value sum) of token t, head h over keys begin..end.
        fn partial(
            &self,
            l: &HostLaunch<'_>,
            q: DevicePtr,
            t: usize,
            h: usize,
            keys: std::ops::Range<usize>,
        ) -> Result<(f64, f64, Vec<f64>), String> {
            let hd = self.head_dim;
            let kv_head = h / (self.n_heads / self.n_kv_heads);
            let table = read_i32(l, self.table_of_token, t)? as usize;
            let query: Vec<f64> = l
                .read_f32(q.offset(((t * self.n_heads + h) * hd * 4) as u64), hd)?
                .into_iter()
                .map(|v| f64::from(f16::from_f32(v).to_f32()))
                .collect();
            let mut scores = Vec::new();
            for p in keys.clone() {
                let k = self.row(l, self.k_blocks, table, p, kv_head)?;
                let mut s = query.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>() * self.scale;
                if self.softcap > 0.0 {
                    s = self.softcap * (s / self.softcap).tanh();
                }
                scores.push(s);
            }
            let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mut acc = vec![0.0; hd];
            let mut sum = 0.0;
            for (p, s) in keys.zip(&scores) {
                let e = (s - m).exp();
                sum += e;
                let v = self.row(l, self.v_blocks, table, p, kv_head)?;
                acc.iter_mut().zip(&v).for_each(|(a, v)| *a += e * v);
            }
            Ok((m, sum, acc))
        }

        fn first(&self, position: usize) -> usize {
            if self.window > 0 {
                (position + 1).saturating_sub(self.window as usize)
            } else {
                0
            }
        }
    }

    fn register_attention_twins(driver: &HostDriver) {
        // ember_kv_store_f16(const uint64_t* k_blocks, const uint64_t* v_blocks, const float* k,
        // const float* v, const int32_t* slots, uint32_t row_values, uint32_t block_size)
        driver.register_kernel("ember_kv_store_f16", |l| {
            let (k_blocks, v_blocks, k, v, slots) = (
                l.ptr_arg(0)?,
                l.ptr_arg(1)?,
                l.ptr_arg(2)?,
                l.ptr_arg(3)?,
                l.ptr_arg(4)?,
            );
            let (row_values, block_size) = (l.u32_arg(5)? as usize, l.u32_arg(6)? as usize);
            for t in 0..l.config().grid[0] as usize {
                let slot = read_i32(l, slots, t)?;
                if slot < 0 {
                    continue;
                }
                let (block, offset) = (slot as usize / block_size, slot as usize % block_size);
                for (blocks, src) in [(k_blocks, k), (v_blocks, v)] {
                    let address = read_u64(l, blocks, block)?;
                    let row = l.read_f32(src.offset((t * row_values * 4) as u64), row_values)?;
                    let bytes: Vec<u8> = row
                        .iter()
                        .flat_map(|&x| f16::from_f32(x).to_le_bytes())
                        .collect();
                    l.write(
                        DevicePtr(address).offset((offset * row_values * 2) as u64),
                        &bytes,
                    )?;
                }
            }
            Ok(())
        });
        // ember_attention_decode_partial(float* out, float* partial_acc, float2* partial_ms,
        // const float* q, k_blocks, v_blocks, block_tables, table_of_token, positions, uint32_t
        // n_heads, n_kv_heads, head_dim, block_size, max_blocks_per_table, n_partitions, float
        // scale, int32_t window, float softcap); grid (n_partitions, n_heads, n_tokens).
        driver.register_kernel("ember_attention_decode_partial", |l| {
            let (out, acc_ptr, ms_ptr, q) =
                (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?, l.ptr_arg(3)?);
            let cache = Cache {
                k_blocks: l.ptr_arg(4)?,
                v_blocks: l.ptr_arg(5)?,
                tables: l.ptr_arg(6)?,
                table_of_token: l.ptr_arg(7)?,
                positions: l.ptr_arg(8)?,
                n_heads: l.u32_arg(9)? as usize,
                n_kv_heads: l.u32_arg(10)? as usize,
                head_dim: l.u32_arg(11)? as usize,
                block_size: l.u32_arg(12)? as usize,
                max_blocks: l.u32_arg(13)? as usize,
                scale: f64::from(l.f32_arg(15)?),
                window: i32_arg(l, 16)?,
                softcap: f64::from(l.f32_arg(17)?),
            };
            let n_partitions = l.u32_arg(14)? as usize;
            let [grid_p, grid_h, grid_t] = l.config().grid;
            if grid_p as usize != n_partitions || grid_h as usize != cache.n_heads {
                return Err(format!(
                    "grid {:?} for {n_partitions} partitions",
                    l.config().grid
                ));
            }
            let hd = cache.head_dim;
            for t in 0..grid_t as usize {
                let position = read_i32(l, cache.positions, t)? as usize;
                for h in 0..cache.n_heads {
                    for p in 0..n_partitions {
                        let begin = cache.first(position) + p * PARTITION;
                        let end = (position + 1).min(begin + PARTITION);
                        let index = (t * cache.n_heads + h) * n_partitions + p;
                        let (m, sum, acc) = if begin < end {
                            cache.partial(l, q, t, h, begin..end)?
                        } else {
                            (f64::NEG_INFINITY, 0.0, vec![0.0; hd])
                        };
                        if n_partitions == 1 {
                            let row: Vec<f32> = acc.iter().map(|a| (a / sum) as f32).collect();
                            l.write_f32(
                                out.offset(((t * cache.n_heads + h) * hd * 4) as u64),
                                &row,
                            )?;
                        } else {
                            let row: Vec<f32> = acc.iter().map(|&a| a as f32).collect();
                            l.write_f32(acc_ptr.offset((index * hd * 4) as u64), &row)?;
                            l.write_f32(
                                ms_ptr.offset((index * 8) as u64),
                                &[m as f32, sum as f32],
                            )?;
                        }
                    }
                }
            }
            Ok(())
        });
        // ember_attention_decode_reduce(float* out, const float* partial_acc, const float2*
        // partial_ms, uint32_t n_heads, uint32_t head_dim, uint32_t n_partitions); grid
        // (n_heads, n_tokens).
        driver.register_kernel("ember_attention_decode_reduce", |l| {
            let (out, acc_ptr, ms_ptr) = (l.ptr_arg(0)?, l.ptr_arg(1)?, l.ptr_arg(2)?);
            let (n_heads, hd, n_partitions) = (
                l.u32_arg(3)? as usize,
                l.u32_arg(4)? as usize,
                l.u32_arg(5)? as usize,
            );
            let [grid_h, grid_t, _] = l.config().grid;
            if grid_h as usize != n_heads {
                return Err(format!("grid {:?} for {n_heads} heads", l.config().grid));
            }
            for t in 0..grid_t as usize {
                for h in 0..n_heads {
                    let base = (t * n_heads + h) * n_partitions;
                    let ms = l.read_f32(ms_ptr.offset((base * 8) as u64), 2 * n_partitions)?;
                    let m = (0..n_partitions)
                        .map(|p| ms[2 * p])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let mut num = vec![0.0f32; hd];
                    let mut den = 0.0f32;
                    for p in 0..n_partitions {
                        let w = (ms[2 * p] - m).exp();
                        den += w * ms[2 * p + 1];
                        let acc = l.read_f32(acc_ptr.offset(((base + p) * hd * 4) as u64), hd)?;
                        num.iter_mut().zip(&acc).for_each(|(n, a)| *n += w * a);
                    }
                    let row: Vec<f32> = num.iter().map(|n| n / den).collect();
                    l.write_f32(out.offset(((t * n_heads + h) * hd * 4) as u64), &row)?;
                }
            }
            Ok(())
        });
        // ember_attention_prefill_dN(float* out, const float* q, k_blocks, v_blocks,
        // block_tables, table_of_token, positions, uint32_t n_tokens, n_heads, n_kv_heads,
        // head_dim, block_size, max_blocks_per_table, float scale, int32_t window, float
        // softcap); grid (ceil(n_tokens / 16), n_heads).
        for (name, d_max) in [
            ("ember_attention_prefill_d64", 64usize),
            ("ember_attention_prefill_d128", 128),
            ("ember_attention_prefill_d256", 256),
            ("ember_attention_prefill_d512", 512),
        ] {
            driver.register_kernel(name, move |l| {
                let (out, q) = (l.ptr_arg(0)?, l.ptr_arg(1)?);
                let n_tokens = l.u32_arg(7)? as usize;
                let cache = Cache {
                    k_blocks: l.ptr_arg(2)?,
                    v_blocks: l.ptr_arg(3)?,
                    tables: l.ptr_arg(4)?,
                    table_of_token: l.ptr_arg(5)?,
                    positions: l.ptr_arg(6)?,
                    n_heads: l.u32_arg(8)? as usize,
                    n_kv_heads: l.u32_arg(9)? as usize,
                    head_dim: l.u32_arg(10)? as usize,
                    block_size: l.u32_arg(11)? as usize,
                    max_blocks: l.u32_arg(12)? as usize,
                    scale: f64::from(l.f32_arg(13)?),
                    window: i32_arg(l, 14)?,
                    softcap: f64::from(l.f32_arg(15)?),
                };
                let [grid_x, grid_y, _] = l.config().grid;
                if cache.head_dim > d_max || (d_max > 64 && cache.head_dim <= d_max / 2) {
                    return Err(format!("{name} launched for head_dim {}", cache.head_dim));
                }
                if grid_y as usize != cache.n_heads || (grid_x as usize) * TILE_Q < n_tokens {
                    return Err(format!("grid {:?} for {n_tokens} tokens", l.config().grid));
                }
                let hd = cache.head_dim;
                for t in 0..n_tokens {
                    let position = read_i32(l, cache.positions, t)? as usize;
                    for h in 0..cache.n_heads {
                        let (_, sum, acc) =
                            cache.partial(l, q, t, h, cache.first(position)..position + 1)?;
                        let row: Vec<f32> = acc.iter().map(|a| (a / sum) as f32).collect();
                        l.write_f32(out.offset(((t * cache.n_heads + h) * hd * 4) as u64), &row)?;
                    }
                }
                Ok(())
            });
        }
    }

    /// Two sequences in blocks of 4 at scattered physical ids: sequence 0 has 7 cached
    /// positions and 3 new, sequence 1 has 600 cached and 1 new (ten decode partitions).
    #[test]
    fn attention_and_kv_store_pass_their_arguments_in_kernel_order() {
        attention_and_kv_store_case(80);
    }

    /// The same with Gemma 4's head sizes: 256 (sliding layers) and 512 (global layers, the
    /// widest prefill kernel).
    #[test]
    fn attention_with_gemma4_head_sizes_launches_the_kernel_of_that_size() {
        attention_and_kv_store_case(256);
        attention_and_kv_store_case(512);
    }

    fn attention_and_kv_store_case(head_dim: usize) {
        let (ctx, _dir) = host_context(register_attention_twins);
        let (n_heads, n_kv_heads, block_size) = (4usize, 2usize, 4usize);
        let row_values = n_kv_heads * head_dim;
        let lengths = [10usize, 601];
        let added = [3usize, 1];
        let blocks_per_table: Vec<usize> = lengths.iter().map(|l| l.div_ceil(block_size)).collect();
        let max_blocks = blocks_per_table.iter().max().unwrap() + 1;
        let n_physical = blocks_per_table.iter().sum::<usize>() + 3;
        // Physical ids in a scrambled order (7 is coprime to n_physical), 3 of them unused.
        let ids: Vec<usize> = (0..n_physical).map(|i| (i * 7 + 2) % n_physical).collect();
        assert!(n_physical % 7 != 0, "7 must be coprime to {n_physical}");
        let mut tables = vec![-1i32; 2 * max_blocks];
        let mut k_addresses = vec![0u64; n_physical];
        let mut v_addresses = vec![0u64; n_physical];
        let mut buffers = Vec::new();
        let mut next = 0;
        for (table, &blocks) in blocks_per_table.iter().enumerate() {
            for b in 0..blocks {
                let id = ids[next];
                next += 1;
                tables[table * max_blocks + b] = id as i32;
                for addresses in [&mut k_addresses, &mut v_addresses] {
                    let buffer = ctx
                        .alloc(Purpose::Kv, (block_size * row_values * 2) as u64)
                        .unwrap();
                    addresses[id] = buffer.ptr().0;
                    buffers.push(buffer);
                }
            }
        }
        let as_bytes_u64 =
            |v: &[u64]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let as_bytes_i32 =
            |v: &[i32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        let k_blocks = upload_bytes(&ctx, &as_bytes_u64(&k_addresses));
        let v_blocks = upload_bytes(&ctx, &as_bytes_u64(&v_addresses));
        let block_tables = upload_bytes(&ctx, &as_bytes_i32(&tables));

        // Every position's keys and values, stored in one kv_store call with a padding slot.
        let k_all: Vec<Vec<f32>> = (0..2)
            .map(|s| values(lengths[s] * row_values, 10 + s as u32))
            .collect();
        let v_all: Vec<Vec<f32>> = (0..2)
            .map(|s| values(lengths[s] * row_values, 20 + s as u32))
            .collect();
        let (mut k_rows, mut v_rows, mut slots) = (Vec::new(), Vec::new(), Vec::new());
        for s in 0..2 {
            for p in 0..lengths[s] {
                slots.push(
                    tables[s * max_blocks + p / block_size] * block_size as i32
                        + (p % block_size) as i32,
                );
                k_rows.extend_from_slice(&k_all[s][p * row_values..(p + 1) * row_values]);
                v_rows.extend_from_slice(&v_all[s][p * row_values..(p + 1) * row_values]);
            }
        }
        slots.push(-1);
        k_rows.extend(std::iter::repeat_n(9.0, row_values));
        v_rows.extend(std::iter::repeat_n(9.0, row_values));
        let (dk, dv) = (upload_f32(&ctx, &k_rows), upload_f32(&ctx, &v_rows));
        let dslots = upload_bytes(&ctx, &as_bytes_i32(&slots));
        kv_store(
            &ctx,
            k_blocks.ptr(),
            v_blocks.ptr(),
            dk.ptr(),
            dv.ptr(),
            dslots.ptr(),
            slots.len(),
            row_values,
            block_size,
        )
        .unwrap();

        // The batch: the new tokens of both sequences.
        let mut positions = Vec::new();
        let mut table_of_token = Vec::new();
        for s in 0..2 {
            for i in 0..added[s] {
                positions.push((lengths[s] - added[s] + i) as i32);
                table_of_token.push(s as i32);
            }
        }
        let n_tokens = positions.len();
        let q = values(n_tokens * n_heads * head_dim, 30);
        let dq = upload_f32(&ctx, &q);
        let dpositions = upload_bytes(&ctx, &as_bytes_i32(&positions));
        let dtables = upload_bytes(&ctx, &as_bytes_i32(&table_of_token));
        let out = ctx
            .alloc(Purpose::Scratch, (n_tokens * n_heads * head_dim * 4) as u64)
            .unwrap();
        for (window, softcap) in [(None, None), (Some(5usize), Some(0.7f32))] {
            let args = AttentionArgs {
                q: dq.ptr(),
                out: out.ptr(),
                k_blocks: k_blocks.ptr(),
                v_blocks: v_blocks.ptr(),
                block_tables: block_tables.ptr(),
                table_of_token: dtables.ptr(),
                positions: dpositions.ptr(),
                n_tokens,
                n_tables: 2,
                max_blocks_per_table: max_blocks,
                max_position: 600,
                n_heads,
                n_kv_heads,
                head_dim,
                block_size,
                scale: 0.3,
                window,
                softcap,
            };
            // The reference: f16-rounded q, k, v in f64.
            let round = |x: f32| f64::from(f16::from_f32(x).to_f32());
            let mut expected = vec![0.0f64; n_tokens * n_heads * head_dim];
            for t in 0..n_tokens {
                let (s, pos) = (table_of_token[t] as usize, positions[t] as usize);
                let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
                for h in 0..n_heads {
                    let kvh = h / (n_heads / n_kv_heads);
                    let qh: Vec<f64> = q[(t * n_heads + h) * head_dim..][..head_dim]
                        .iter()
                        .map(|&x| round(x))
                        .collect();
                    let scores: Vec<f64> = (first..=pos)
                        .map(|p| {
                            let k = &k_all[s][p * row_values + kvh * head_dim..][..head_dim];
                            let dot =
                                qh.iter().zip(k).map(|(a, &b)| a * round(b)).sum::<f64>() * 0.3;
                            softcap.map_or(dot, |c| f64::from(c) * (dot / f64::from(c)).tanh())
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let sum: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (i, p) in (first..=pos).enumerate() {
                        let w = (scores[i] - m).exp() / sum;
                        let v = &v_all[s][p * row_values + kvh * head_dim..][..head_dim];
                        for d in 0..head_dim {
                            expected[(t * n_heads + h) * head_dim + d] += w * round(v[d]);
                        }
                    }
                }
            }
            for kernel in [
                AttentionKernel::Auto,
                AttentionKernel::Decode,
                AttentionKernel::Prefill,
            ] {
                ctx.zero(out.ptr(), (expected.len() * 4) as u64).unwrap();
                attention_with(&ctx, &args, kernel).unwrap();
                let got = download_f32(&ctx, out.ptr(), expected.len());
                for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
                    assert!(
                        (f64::from(*g) - e).abs() < 1e-5,
                        "head_dim {head_dim} {kernel:?} window {window:?}: value {i}: {g} vs {e}"
                    );
                }
            }
        }
        drop(buffers);
    }

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
    fn nvidia_prefills_with_heads_of_64_and_128_take_the_tensor_cores() {
        assert_eq!(
            prefill_kernel("sm_90", 128, true),
            ("ember_attention_prefill_mma_d128", MMA_TILE_Q)
        );
        assert_eq!(
            prefill_kernel("sm_80", 64, true),
            ("ember_attention_prefill_mma_d64", MMA_TILE_Q)
        );
        // Other head sizes, and every AMD or host target, keep the tiled kernel.
        assert_eq!(
            prefill_kernel("sm_90", 80, true),
            ("ember_attention_prefill_d128", TILE_Q)
        );
        assert_eq!(
            prefill_kernel("sm_90", 256, true),
            ("ember_attention_prefill_d256", TILE_Q)
        );
        assert_eq!(
            prefill_kernel("gfx1100", 128, true),
            ("ember_attention_prefill_d128", TILE_Q)
        );
        assert_eq!(
            prefill_kernel("host", 64, true),
            ("ember_attention_prefill_d64", TILE_Q)
        );
        // Batches of many short sequences keep the tiled kernel on NVIDIA too.
        assert_eq!(
            prefill_kernel("sm_90", 128, false),
            ("ember_attention_prefill_d128", TILE_Q)
        );
    }

    #[test]
    fn shapes_the_kernels_cannot_serve_are_errors() {
        check_shape(&args()).unwrap();
        check_rejected(
            |a| a.n_kv_heads = 5,
            "a KV head count dividing the 32 query heads",
        );
        check_rejected(|a| a.n_kv_heads = 0, "found 0");
        check_rejected(|a| a.head_dim = 514, "an even head size of at most 512");
        let mut gemma4_global = args();
        gemma4_global.head_dim = 512;
        check_shape(&gemma4_global).unwrap();
        check_rejected(|a| a.head_dim = 81, "found 81");
        check_rejected(|a| a.block_size = 0, "a block size above 0");
        check_rejected(|a| a.window = Some(0), "a window of at least 1");
        check_rejected(|a| a.softcap = Some(-1.0), "a positive finite softcap");
        check_rejected(|a| a.scale = f32::NAN, "a finite score scale");
        check_rejected(|a| a.n_tables = 0, "at least one block table");
    }
}
