//! The GPU backend: the [`Backend`] ops over `ember_gpu::ops` on one device (CUDA or HIP, the
//! same kernels behind either driver).
//!
//! Memory: weights are copied from the GGUF mapping into device buffers of the device's pool
//! (purpose weights) in chunks, with no full host copy; activations are pool buffers of purpose
//! scratch that grow to the largest batch and are then reused; the KV cache is one pool buffer
//! per physical block and layer for K and one for V (purpose KV), given memory when the engine
//! materialises a block and returned when it releases it, with a device table of the blocks'
//! addresses per layer that the attention kernels read. A background thread asks the pool to trim
//! itself when idle, so device memory returns to the post-load floor after a burst without any
//! call from the user ([`trim`]).
//!
//! Launch overhead: every op is queued on the context's stream and nothing waits inside the
//! layer loop. The per-batch arrays (token ids, positions, slots, block tables, output rows) are
//! packed and uploaded once per forward pass in [`Backend::begin_forward`]; the only waits are
//! that upload, uploads of changed KV block tables (when a sequence crosses into a new block),
//! for hybrid models the table of the batch's sequences and recurrent states
//! ([`Backend::begin_states`], see [`delta_net`]), and the final download of the logits.
//!
//! Decode steps (batches of at most [`graph::GRAPH_MAX_TOKENS`] tokens) are recorded into a
//! device graph after that upload and run with one launch ([`graph`]); `EMBER_GPU_GRAPHS=0`
//! turns this off.
//!
//! Numerics ([`numerics`]): in the default `fast` mode the ops are the tuned kernels above; in
//! `reference` mode every op gives the CPU's bits (the context's `ember_gpu::ops::Numerics`
//! makes each op's one wrapper pick its bit-exact kernel, `kernels/exact_*.hip`, where the fast
//! one rounds differently), one op per launch with no fused kernels and no graphs, so the logits
//! equal the CPU backend's bit for bit. [`GpuBackend::set_numerics`] chooses; [`open()`] takes the choice from its options.
//!
//! Failures: the ops cannot return errors through the [`Backend`] trait, so the first failure is
//! recorded with the op's name, later ops are skipped, and [`Backend::take_failure`] hands it to
//! the forward pass, which fails alone (see the trait's module docs). One backend serves one
//! forward pass at a time; the recorded failure is per backend, not per thread.

// `ember_gpu::ops::OpsError` carries the pool's and the driver's errors whole (so callers can
// tell out-of-memory apart), which makes it large; it only travels on failure paths.
#![allow(clippy::result_large_err)]

mod batch;
mod delta_net;
mod gemma4;
mod moe;
mod op_times;
use moe::check_moe_shapes;
pub mod graph;
pub mod numerics;
pub mod open;
pub(crate) mod trim;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use ember_gguf::{Gguf, TensorInfo};
use ember_gpu::ops::{self, AttentionArgs, DeviceMatrix, GpuContext, OpsError, WeightFormat};
use ember_gpu::{DevicePool, DevicePtr, PoolBuffer, Purpose};

use super::{
    Backend, BackendError, ExpertGating, GatedDeltaNet, Gemma4FfnNorms, MoeFfn, OpFailure, QkNorm,
    RopeMode, RopeParams, SequenceState,
};
use crate::batch::Batch;
use crate::ops::{AttentionPlan, FfnActivation};
use batch::BatchArrays;
use graph::Graphs;
pub use graph::{GraphStats, GRAPHS_ENV, GRAPH_MAX_TOKENS};
pub use numerics::{
    Numerics, NumericsError, DEFAULT_REFERENCE_THREADS, NUMERICS_ENV, REFERENCE_THREADS_ENV,
};
pub use open::{open, select, GpuKind, GpuOpenError, GpuSelection, OpenOptions, Opened};
use trim::IdleTrimmer;

// Activations are moved between host and device as raw bytes of f32s and u32s (see `read`).
const _: () = assert!(
    cfg!(target_endian = "little"),
    "the GPU backend expects a little-endian host, like every GPU it drives"
);

/// Bytes copied per upload while placing weights: large enough that the per-copy cost vanishes,
/// small enough that the staging stays in the page cache the mapping already uses.
const UPLOAD_CHUNK_BYTES: usize = 64 << 20;

/// One device's backend. See the module docs.
pub struct GpuBackend {
    ctx: GpuContext,
    name: &'static str,
    description: String,
    /// Set when `failure` holds a failure, so the ops' fast path is one atomic load.
    failed: AtomicBool,
    failure: Mutex<Option<OpFailure>>,
    /// The next op fails as if out of memory (see [`GpuBackend::inject_out_of_memory`]).
    inject_oom: AtomicBool,
    batch: Mutex<BatchArrays>,
    /// Every weight buffer placed (tensor name, address, bytes), for the placement check.
    placed: Mutex<Vec<(String, DevicePtr, u64)>>,
    trimmer: Option<IdleTrimmer>,
    graphs: Mutex<Graphs>,
    /// How the ops round (see [`numerics`]).
    numerics: Numerics,
    /// The CPU thread count whose split-KV attention the reference mode reproduces.
    reference_threads: usize,
    /// The CPU's f16 GELU table on the device ([`numerics::gelu_table`]), uploaded by the first
    /// GeGLU of the reference mode.
    gelu_table: Mutex<Option<PoolBuffer>>,
    /// Scratch of the mixture-of-experts layers ([`Backend::moe_ffn`]), grown to the largest
    /// batch and given back with the other activation buffers ([`Backend::release_op_scratch`]).
    moe_scratch: Mutex<MoeScratch>,
    /// The sequence table and scratch of the linear-attention layers ([`delta_net`]).
    delta_net: Mutex<delta_net::DeltaNetScratch>,
    /// Device copies of Gemma 4's per-expert down-projection scales ([`gemma4`]).
    expert_scales: Mutex<gemma4::ExpertScales>,
    /// CPU time per op when `EMBER_GPU_OP_TIMES=1` ([`op_times`]).
    op_times: op_times::OpTimes,
}

/// Device buffers of [`GpuBackend::moe_ffn`]; the i32 arrays (experts, pairs, tiles) live in
/// f32-sized buffers (4 bytes a value either way).
#[derive(Default)]
pub(super) struct MoeScratch {
    experts: GpuBuf,
    weights: GpuBuf,
    pairs: GpuBuf,
    tiles: GpuBuf,
    gate: GpuBuf,
    /// The decode path's `gate` (h) rounded for the down product ([`ops::moe_down`]).
    gate_quantized: GpuBuf,
    up: GpuBuf,
    routed: GpuBuf,
    shared_gate: GpuBuf,
    shared_up: GpuBuf,
    shared_out: GpuBuf,
    shared_logit: GpuBuf,
}

impl std::fmt::Debug for GpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuBackend")
            .field("description", &self.description)
            .finish()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding one of these locks leaves plain data behind; the next op rewrites it.
    mutex
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl GpuBackend {
    /// A backend over an opened context. `name` is the driver's (`cuda`, `hip`); `description`
    /// says which device and pool, for headers. `idle_trim` starts the trimming thread. The
    /// numerics are `fast` with [`DEFAULT_REFERENCE_THREADS`] (see [`GpuBackend::set_numerics`]).
    pub fn new(
        mut ctx: GpuContext,
        name: &'static str,
        description: String,
        idle_trim: bool,
    ) -> GpuBackend {
        ctx.set_numerics(ops::Numerics::Fast);
        ctx.set_reference_threads(DEFAULT_REFERENCE_THREADS);
        let op_times = op_times::OpTimes::from_env();
        ctx.set_launch_timing(op_times.enabled());
        let trimmer = if idle_trim {
            IdleTrimmer::start(Arc::clone(ctx.pool()))
        } else {
            None
        };
        let batch = BatchArrays::new(&ctx);
        GpuBackend {
            ctx,
            name,
            description,
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            inject_oom: AtomicBool::new(false),
            batch: Mutex::new(batch),
            placed: Mutex::new(Vec::new()),
            trimmer,
            graphs: Mutex::new(Graphs::from_env()),
            numerics: Numerics::Fast,
            reference_threads: DEFAULT_REFERENCE_THREADS,
            gelu_table: Mutex::new(None),
            moe_scratch: Mutex::new(MoeScratch::default()),
            delta_net: Mutex::new(delta_net::DeltaNetScratch::default()),
            expert_scales: Mutex::new(gemma4::ExpertScales::default()),
            op_times,
        }
    }

    /// Chooses how the ops round (see [`numerics`]). `Reference` also turns decode graphs off:
    /// the reference ops run one launch each, as the CPU runs them. Weights placed so far stay.
    pub fn set_numerics(&mut self, numerics: Numerics) {
        self.numerics = numerics;
        self.ctx.set_numerics(match numerics {
            Numerics::Fast => ops::Numerics::Fast,
            Numerics::Reference => ops::Numerics::Reference,
        });
        if numerics == Numerics::Reference {
            self.set_graphs(false);
        }
    }

    /// How the ops round.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// Sets the CPU thread count whose split-KV attention the reference mode reproduces (0
    /// counts as 1, as a one-thread CPU pool).
    pub fn set_reference_threads(&mut self, threads: usize) {
        self.reference_threads = threads.max(1);
        self.ctx.set_reference_threads(threads);
    }

    /// The CPU thread count the reference mode reproduces.
    pub fn reference_threads(&self) -> usize {
        self.reference_threads
    }

    /// Whether the ops are the bit-exact ones.
    fn reference(&self) -> bool {
        self.numerics == Numerics::Reference
    }

    /// Copies `values` to the start of `buf` (which must hold at least as many), waiting for the
    /// copy: for checks and tools that feed a backend op chosen inputs. A failure is recorded as
    /// any op's is.
    pub fn write(&self, buf: &mut GpuBuf, values: &[f32]) {
        self.run("writing values", || {
            let ptr = buf.ptr("write", values.len())?;
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            self.ctx.upload(ptr, &bytes)
        });
    }

    /// The f16 bits of the K rows (`k == true`) or V rows of block `block` of `layer`, in the
    /// device layout (`[slot][head][dim]`), downloaded: for checks of the KV store.
    pub fn kv_block_bits(
        &self,
        layer: &GpuKvLayer,
        block: usize,
        k: bool,
    ) -> Result<Vec<u16>, OpsError> {
        let store = if k { &layer.k } else { &layer.v };
        let Some(Some(buf)) = store.get(block) else {
            return Err(OpsError::Shape {
                op: "kv_block_bits",
                expected: "a block with memory".into(),
                found: format!("block {block}, which has none"),
            });
        };
        let mut bytes = vec![0u8; layer.block_bytes() as usize];
        self.ctx.download(buf.ptr(), &mut bytes)?;
        Ok(bytes
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect())
    }

    /// The device copy of the CPU's GELU table, uploaded on first use.
    fn gelu_table_ptr(&self) -> Result<DevicePtr, OpsError> {
        let mut table = lock(&self.gelu_table);
        if let Some(buf) = table.as_ref() {
            return Ok(buf.ptr());
        }
        let bytes: Vec<u8> = numerics::gelu_table()
            .iter()
            .flat_map(|v| v.to_bits().to_le_bytes())
            .collect();
        debug_assert_eq!(bytes.len(), 2 * ops::GELU_TABLE_LEN);
        let buf = self.upload_new(Purpose::Weights, &bytes)?;
        let ptr = buf.ptr();
        *table = Some(buf);
        Ok(ptr)
    }

    /// Turns decode graphs on or off (they start as `EMBER_GPU_GRAPHS` says: on unless `0`).
    pub fn set_graphs(&self, enabled: bool) {
        let mut graphs = lock(&self.graphs);
        graphs.drop_execs(&self.ctx);
        let segment_layers = graphs.segment_layers();
        *graphs = Graphs::new(enabled);
        graphs.set_segment_layers(segment_layers);
    }

    /// Sets how many layers each recorded part of a decode step holds (0: the whole step as one
    /// graph; the default comes from `EMBER_GPU_GRAPH_SEGMENT`).
    pub fn set_graph_segment_layers(&self, layers: usize) {
        lock(&self.graphs).set_segment_layers(layers);
    }

    /// Whether decode steps are recorded as graphs (off after a failure to record or run one).
    pub fn graphs_enabled(&self) -> bool {
        lock(&self.graphs).enabled()
    }

    /// What the backend did with graphs so far.
    pub fn graph_stats(&self) -> GraphStats {
        lock(&self.graphs).stats()
    }

    /// Ends the graph capture of this pass, if one is in progress, and runs the recorded graph.
    fn finish_graph(&self) {
        let mut graphs = lock(&self.graphs);
        if graphs.is_capturing() {
            graphs.finish(&self.ctx, self.failed.load(Ordering::Acquire));
        }
    }

    /// The ops context (device, stream, pool, kernels).
    pub fn context(&self) -> &GpuContext {
        &self.ctx
    }

    /// The device's pool.
    pub fn pool(&self) -> &Arc<DevicePool> {
        self.ctx.pool()
    }

    /// The weight buffers placed so far: (tensor name, device address, bytes).
    pub fn placed_weights(&self) -> Vec<(String, DevicePtr, u64)> {
        lock(&self.placed).clone()
    }

    /// Whether the idle-trimming thread runs.
    pub fn trims_when_idle(&self) -> bool {
        self.trimmer.is_some()
    }

    /// Makes the next op fail as an out-of-memory failure would, once: for showing that a
    /// request failing for lack of memory fails alone (`ember stress --oom-request`) on a device
    /// with more memory than is practical to fill.
    pub fn inject_out_of_memory(&self) {
        self.inject_oom.store(true, Ordering::Release);
    }

    /// Records `error` as the failure of `op` unless one is already recorded.
    fn record(&self, op: &'static str, error: OpsError) {
        self.record_failure(OpFailure {
            backend: self.name,
            op,
            cause: error_chain(&error),
            out_of_memory: error.is_out_of_memory(),
        });
    }

    fn record_failure(&self, new: OpFailure) {
        let mut failure = lock(&self.failure);
        if failure.is_none() {
            tracing::debug!(failure = %new, "device op failed");
            *failure = Some(new);
            self.failed.store(true, Ordering::Release);
        }
    }

    /// Runs `f` unless an op already failed, recording its error.
    fn run(&self, op: &'static str, f: impl FnOnce() -> Result<(), OpsError>) {
        if self.failed.load(Ordering::Acquire) {
            return;
        }
        if self.inject_oom.swap(false, Ordering::AcqRel) {
            self.record_failure(OpFailure {
                backend: self.name,
                op,
                cause: "injected out-of-memory failure (ember stress --oom-request without --vram-budget)".into(),
                out_of_memory: true,
            });
            return;
        }
        if let Err(error) = self.op_times.time(op, f) {
            self.record(op, error);
        }
    }

    fn alloc_f32(&self, len: usize) -> Result<Option<PoolBuffer>, OpsError> {
        if len == 0 {
            return Ok(None);
        }
        let bytes = f32_bytes(len);
        self.ctx.alloc(Purpose::Scratch, bytes).map(Some)
    }

    /// Uploads `bytes` into a new buffer of `purpose`.
    fn upload_new(&self, purpose: Purpose, bytes: &[u8]) -> Result<PoolBuffer, OpsError> {
        let buf = self.ctx.alloc(purpose, bytes.len().max(1) as u64)?;
        let mut offset = 0;
        for chunk in bytes.chunks(UPLOAD_CHUNK_BYTES) {
            self.ctx.upload(buf.ptr().offset(offset as u64), chunk)?;
            offset += chunk.len();
        }
        Ok(buf)
    }

    /// The device copy of a per-batch array, from the arrays uploaded for this forward pass, or
    /// uploaded now when the caller passes other values.
    fn batch_ptr(&self, kind: batch::Array, host: &[u32]) -> Result<DevicePtr, OpsError> {
        let mut arrays = lock(&self.batch);
        arrays.device_ptr(&self.ctx, kind, host)
    }
}

impl Drop for GpuBackend {
    fn drop(&mut self) {
        // The trimmer holds the pool; stop it before the buffers and the context go.
        self.trimmer = None;
        let graphs = self
            .graphs
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        graphs.discard(&self.ctx);
        graphs.drop_execs(&self.ctx);
        if graphs.stats().launched > 0 {
            tracing::info!(device = self.ctx.device(), "{}", graphs.stats().summary());
        }
        let (launches, launch_time) = self.ctx.launch_stats();
        if let Some(table) = self.op_times.report(launches, launch_time) {
            tracing::info!(device = self.ctx.device(), "{table}");
        }
    }
}

/// The error and its sources, joined, so the cause reaches the user whole.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn f32_bytes(len: usize) -> u64 {
    (len as u64) * 4
}

/// An f32 activation buffer on the device. `buf` is `None` for an empty buffer, or when its
/// allocation failed (the failure is recorded and ops on it are skipped).
#[derive(Default)]
pub struct GpuBuf {
    buf: Option<PoolBuffer>,
    len: usize,
}

impl GpuBuf {
    /// Values the buffer holds.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address of a buffer that must hold at least `needed` values.
    fn ptr(&self, op: &'static str, needed: usize) -> Result<DevicePtr, OpsError> {
        match &self.buf {
            Some(buf) if self.len >= needed => Ok(buf.ptr()),
            _ => Err(OpsError::Shape {
                op,
                expected: format!("a device buffer of at least {needed} f32 values"),
                found: format!("{} values", self.len),
            }),
        }
    }
}

/// An f32 vector (norm weights, biases) on the device.
pub struct GpuVector {
    buf: PoolBuffer,
    len: usize,
}

/// Rotary parameters and the batch's positions on the device (the cosines and sines are computed
/// by the kernel). In reference mode the cosines and sines themselves, computed on the host as
/// the CPU backend computes them.
pub struct GpuRopeTable {
    n_dims: usize,
    freq_base: f32,
    freq_scale: f32,
    positions: DevicePtr,
    n_positions: usize,
    /// The frequency divisors on the device, with the host values they were made from.
    factors: Option<(Vec<f32>, PoolBuffer)>,
    /// Reference mode: `n_dims` cosines and sines per token ([`numerics::rope_cos_sin`]) on the
    /// device, for `cos_sin_tokens` tokens; the buffer is kept and reused while large enough.
    cos_sin: Option<PoolBuffer>,
    cos_sin_tokens: usize,
    /// Host staging of the cosines and sines.
    cos_sin_host: Vec<f32>,
}

/// Entries per half of a layer's device address table when its context is made: the table
/// then grows with the blocks used ([`GpuKvLayer::grow_table`]), not with the context length
/// (`-c 100000000` would otherwise cost gigabytes of tables before the first token).
pub const INITIAL_TABLE_BLOCKS: usize = 16;

/// One layer's K/V storage: one K and one V buffer per physical block that has memory, and the
/// device table of their addresses (`[k of block 0..capacity, v of block 0..capacity]`, 0 for a
/// block without memory). The table covers the first `capacity` block ids and doubles (up to
/// `max_blocks`) when a block beyond it is given memory; block ids are handed out lowest first,
/// so it follows the tokens cached.
pub struct GpuKvLayer {
    block_size: usize,
    n_kv_heads: usize,
    head_dim: usize,
    /// Block ids are below this (the cache's capacity in blocks).
    max_blocks: usize,
    /// One entry per block id below the table's capacity.
    k: Vec<Option<PoolBuffer>>,
    v: Vec<Option<PoolBuffer>>,
    /// The device table's contents: `2 * capacity` addresses.
    table_host: Vec<u64>,
    table: Option<PoolBuffer>,
    /// The device table is older than `table_host`.
    dirty: bool,
    bytes: usize,
}

/// Bytes of a device address table for `capacity` blocks (K and V halves; 8 bytes at least, so
/// an empty layer still has an address).
fn table_bytes(capacity: usize) -> u64 {
    (2 * 8 * capacity as u64).max(8)
}

impl GpuKvLayer {
    /// Block ids the address table covers now.
    pub fn table_capacity(&self) -> usize {
        self.k.len()
    }

    fn block_bytes(&self) -> u64 {
        (self.block_size * self.n_kv_heads * self.head_dim * 2) as u64
    }

    /// Makes the address table cover block ids below `needed`: the capacity doubles until it
    /// does, capped at `max_blocks`. The larger device table is taken from the pool first, so a
    /// refusal (the budget) leaves the layer as it was; the entries move to their places in the
    /// new layout (the V half starts at the new capacity) and reach the device with the next
    /// [`GpuKvLayer::sync_table`]. The old table goes back to the pool in stream order: passes
    /// queued before read it before any later use of its memory, and passes queued after take
    /// both halves' addresses from [`GpuKvLayer::tables`], which reads the new table and
    /// capacity. Decode graphs are recorded anew each step, so none holds the old address.
    fn grow_table(&mut self, ctx: &GpuContext, needed: usize) -> Result<(), OpsError> {
        let old = self.table_capacity();
        if needed <= old {
            return Ok(());
        }
        if needed > self.max_blocks {
            return Err(OpsError::Shape {
                op: "kv_materialize",
                expected: format!("a block id below {}", self.max_blocks),
                found: format!("block {}", needed - 1),
            });
        }
        let mut capacity = old.max(1);
        while capacity < needed {
            capacity = capacity.saturating_mul(2);
        }
        let capacity = capacity.min(self.max_blocks);
        let table = ctx.alloc(Purpose::Kv, table_bytes(capacity))?;
        let mut table_host = vec![0u64; 2 * capacity];
        table_host[..old].copy_from_slice(&self.table_host[..old]);
        table_host[capacity..capacity + old].copy_from_slice(&self.table_host[old..2 * old]);
        self.table_host = table_host;
        self.k.resize_with(capacity, || None);
        self.v.resize_with(capacity, || None);
        self.table = Some(table);
        self.dirty = true;
        Ok(())
    }

    /// Uploads the block table if it changed.
    fn sync_table(&mut self, ctx: &GpuContext) -> Result<(), OpsError> {
        if !self.dirty {
            return Ok(());
        }
        if self.table.is_none() {
            self.table = Some(ctx.alloc(Purpose::Kv, table_bytes(self.table_capacity()))?);
        }
        let table = self.table.as_ref().expect("allocated above");
        let bytes: Vec<u8> = self
            .table_host
            .iter()
            .flat_map(|p| p.to_le_bytes())
            .collect();
        ctx.upload(table.ptr(), &bytes)?;
        self.dirty = false;
        Ok(())
    }

    /// Device addresses of the K and V pointer tables: the V half starts after the K half's
    /// `capacity` entries, so both come from the same table and capacity.
    fn tables(&self) -> Result<(DevicePtr, DevicePtr), OpsError> {
        match &self.table {
            Some(table) if !self.dirty => Ok((
                table.ptr(),
                table.ptr().offset((self.table_capacity() * 8) as u64),
            )),
            _ => Err(OpsError::Shape {
                op: "attention",
                expected: "a KV block table uploaded to the device".into(),
                found: "a layer whose blocks were never given memory".into(),
            }),
        }
    }
}

fn weight_format(info: &TensorInfo) -> Result<WeightFormat, BackendError> {
    WeightFormat::from_ggml_type_id(info.ty as u32).ok_or_else(|| BackendError::UnsupportedType {
        tensor: info.name.clone(),
        ty: info.ty.name().to_string(),
        backend: "gpu",
        supported: WeightFormat::ALL
            .iter()
            .map(|f| f.name())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

fn shape_of(info: &TensorInfo) -> Result<(usize, usize), BackendError> {
    if info.dims.is_empty() || info.dims.len() > 2 {
        return Err(BackendError::BadTensor {
            tensor: info.name.clone(),
            expected: "a matrix (1 or 2 dimensions)".into(),
            found: format!("dims {:?}", info.dims),
        });
    }
    let cols = info.dims[0] as usize;
    let rows = info.dims.get(1).copied().unwrap_or(1) as usize;
    Ok((rows, cols))
}

fn device_error(tensor: &str, error: OpsError) -> BackendError {
    BackendError::Device {
        tensor: tensor.to_string(),
        cause: error_chain(&error),
    }
}

fn rope_mode(mode: RopeMode) -> ops::RopeMode {
    match mode {
        RopeMode::Normal => ops::RopeMode::Normal,
        RopeMode::Neox => ops::RopeMode::Neox,
    }
}

impl Backend for GpuBackend {
    type Buf = GpuBuf;
    type Matrix = DeviceMatrix;
    type Vector = GpuVector;
    type RopeTable = GpuRopeTable;
    type KvLayer = GpuKvLayer;

    fn name(&self) -> &'static str {
        self.name
    }

    fn describe(&self) -> String {
        match self.numerics {
            Numerics::Fast => self.description.clone(),
            Numerics::Reference => format!(
                "{}, reference numerics ({} reference threads)",
                self.description, self.reference_threads
            ),
        }
    }

    fn take_failure(&self) -> Option<OpFailure> {
        if !self.failed.load(Ordering::Acquire) {
            return None;
        }
        let failure = lock(&self.failure).take();
        self.failed.store(false, Ordering::Release);
        failure
    }

    fn begin_forward(&self, batch: &Batch, plan: &AttentionPlan, out_rows: &[usize]) {
        // A capture left open by a pass that never reached its end is dropped, not run.
        lock(&self.graphs).discard(&self.ctx);
        self.run("uploading the batch", || {
            lock(&self.batch).upload(&self.ctx, batch, plan, out_rows)
        });
        // The reference ops upload per-batch rotary tables mid-pass, which a capture cannot
        // record; they run with plain launches.
        if !self.failed.load(Ordering::Acquire) && !self.reference() {
            lock(&self.graphs).begin(&self.ctx, batch.len(), out_rows.len());
        }
    }

    fn end_forward(&self) -> bool {
        self.finish_graph();
        lock(&self.graphs).take_redo()
    }

    fn layer_done(&self, layer: usize, n_layers: usize) {
        let failed = self.failed.load(Ordering::Acquire);
        lock(&self.graphs).layer_done(&self.ctx, layer, n_layers, failed);
    }

    fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        f()
    }

    fn matrix(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<DeviceMatrix, BackendError> {
        let format = weight_format(info)?;
        let (rows, cols) = shape_of(info)?;
        let expected =
            DeviceMatrix::bytes_for(format, rows, cols).map_err(|e| device_error(&info.name, e))?;
        let data = gguf.tensor_data(info);
        if data.len() != expected {
            return Err(BackendError::BadTensor {
                tensor: info.name.clone(),
                expected: format!("{expected} bytes for {rows} rows of {cols} {format} values"),
                found: format!("{} bytes", data.len()),
            });
        }
        let buf = self
            .upload_new(Purpose::Weights, data)
            .map_err(|e| device_error(&info.name, e))?;
        lock(&self.placed).push((info.name.clone(), buf.ptr(), buf.len()));
        DeviceMatrix::new(buf, format, rows, cols).map_err(|e| device_error(&info.name, e))
    }

    fn vector(&self, gguf: &Arc<Gguf>, info: &TensorInfo) -> Result<GpuVector, BackendError> {
        let (rows, cols) = shape_of(info)?;
        let len = rows * cols;
        let mut values = vec![0f32; len];
        ember_quant::dequantize(info.ty, gguf.tensor_data(info), &mut values).map_err(|e| {
            BackendError::BadTensor {
                tensor: info.name.clone(),
                expected: format!("{len} {} values", info.ty.name()),
                found: e.to_string(),
            }
        })?;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let buf = self
            .upload_new(Purpose::Weights, &bytes)
            .map_err(|e| device_error(&info.name, e))?;
        lock(&self.placed).push((info.name.clone(), buf.ptr(), buf.len()));
        Ok(GpuVector { buf, len })
    }

    fn matrix_private_bytes(&self, matrix: &DeviceMatrix) -> usize {
        matrix.buf.len() as usize
    }

    fn alloc(&self, len: usize) -> GpuBuf {
        let mut buf = GpuBuf { buf: None, len: 0 };
        self.ensure_len(&mut buf, len);
        buf
    }

    fn ensure_len(&self, buf: &mut GpuBuf, len: usize) {
        if buf.len >= len && (buf.buf.is_some() || len == 0) {
            return;
        }
        // The old memory goes back to the pool first so that it can serve the new request.
        buf.buf = None;
        buf.len = 0;
        self.run("allocating an activation buffer", || {
            buf.buf = self.alloc_f32(len)?;
            buf.len = len;
            Ok(())
        });
    }

    fn buf_bytes(&self, buf: &GpuBuf) -> usize {
        buf.buf.as_ref().map_or(0, |b| b.capacity() as usize)
    }

    fn gather_rows(&self, src: &GpuBuf, dim: usize, rows: &[usize], out: &mut GpuBuf) {
        self.run("gather_rows", || {
            let max_row = rows.iter().copied().max().unwrap_or(0);
            let src_ptr = src.ptr("gather_rows", (max_row + 1) * dim)?;
            let out_ptr = out.ptr("gather_rows", rows.len() * dim)?;
            // Evenly spaced rows (a copy; one layer's slice of Gemma 4's per-layer inputs) need
            // no row list uploaded mid-pass, which would end a graph capture.
            if let Some((first, stride)) = evenly_spaced(rows) {
                return ops::gather_rows_strided(
                    &self.ctx,
                    src_ptr,
                    dim,
                    first,
                    stride,
                    rows.len(),
                    out_ptr,
                );
            }
            let host: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
            let rows_ptr = self.batch_ptr(batch::Array::OutRows, &host)?;
            ops::gather_rows(&self.ctx, src_ptr, dim, rows_ptr, rows.len(), out_ptr)
        });
    }

    fn write(&self, buf: &mut GpuBuf, values: &[f32]) {
        GpuBackend::write(self, buf, values);
    }

    fn copy_from_peer(
        &self,
        from: &GpuBackend,
        src: &GpuBuf,
        dst: &mut GpuBuf,
        len: usize,
    ) -> Result<bool, String> {
        if len == 0 {
            return Ok(true);
        }
        // The source's recorded pass runs now, and its stream drains, so the copy reads what
        // the source's ops wrote (as a host read of the source would).
        from.finish_graph();
        if from.failed.load(Ordering::Acquire) {
            return Err("the source device has failed an op".into());
        }
        from.ctx.synchronize().map_err(|e| e.to_string())?;
        let src_ptr = src.ptr("peer copy", len).map_err(|e| e.to_string())?;
        let dst_ptr = dst.ptr("peer copy", len).map_err(|e| e.to_string())?;
        self.ctx
            .copy_from_peer(dst_ptr, &from.ctx, src_ptr, (len * 4) as u64)
            .map_err(|e| e.to_string())?;
        Ok(true)
    }

    fn read(&self, buf: &GpuBuf, len: usize, out: &mut Vec<f32>) {
        out.clear();
        // The recorded pass runs now, before its results are read.
        self.finish_graph();
        if len == 0 || lock(&self.graphs).redo_pending() {
            // A pass to be run again leaves no results behind (see `end_forward`).
            return;
        }
        self.run("reading results", || {
            let ptr = buf.ptr("read", len)?;
            out.resize(len, 0.0);
            // Straight into the f32s: the logits of a large vocabulary are half a megabyte per
            // token, and a staging copy plus conversion would cost a few percent of a decode step.
            // SAFETY: the byte view covers exactly the `len` initialised f32s of `out`, which it
            // borrows mutably for its whole life; every byte pattern is a valid f32, and u8 has
            // no alignment requirement. Device and host are both little-endian (x86-64, AArch64
            // and every GPU these drivers support), so the bytes are the device's f32s.
            let bytes =
                unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), len * 4) };
            let result = self.ctx.download(ptr, bytes);
            if result.is_err() {
                out.clear();
            }
            result
        });
    }

    fn argmax_rows(
        &self,
        x: &GpuBuf,
        n_rows: usize,
        n_cols: usize,
        scratch: &mut GpuBuf,
        out: &mut Vec<u32>,
    ) {
        out.clear();
        // The recorded pass runs now, before its results are read (as in `read`).
        self.finish_graph();
        if n_rows == 0 || lock(&self.graphs).redo_pending() {
            return;
        }
        // The indices, then the kernels' per-part winners (f32-sized slots).
        let parts_len = ops::argmax_scratch_bytes(n_rows, n_cols).div_ceil(4);
        self.ensure_len(scratch, n_rows + parts_len);
        self.run("argmax", || {
            let x_ptr = x.ptr("argmax", n_rows * n_cols)?;
            let index_ptr = scratch.ptr("argmax", n_rows + parts_len)?;
            let parts_ptr = index_ptr.offset(4 * n_rows as u64);
            ops::argmax(&self.ctx, x_ptr, n_rows, n_cols, parts_ptr, index_ptr)?;
            let mut bytes = vec![0u8; n_rows * 4];
            self.ctx.download(index_ptr, &mut bytes)?;
            // The kernel writes i32s below `n_cols`, or -1 for a row holding NaN or +inf, whose
            // bits are `NON_FINITE_ROW` read as a u32.
            const _: () = assert!(crate::sample::NON_FINITE_ROW == (-1i32) as u32);
            out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            );
            Ok(())
        });
    }

    fn expert_matrix(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
    ) -> Result<DeviceMatrix, BackendError> {
        let architecture = || {
            gguf.architecture()
                .map_or_else(|e| format!("unreadable: {e}"), str::to_string)
        };
        if self.reference() {
            return Err(BackendError::NotBuilt {
                tensor: info.name.clone(),
                feature: "mixture of experts in reference numerics (--numerics fast runs it)",
                architecture: architecture(),
                backend: self.name,
            });
        }
        let format = weight_format(info)?;
        if !ops::has_moe_kernels(format) {
            return Err(BackendError::UnsupportedType {
                tensor: info.name.clone(),
                ty: format.to_string(),
                backend: self.name,
                supported: "q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K for expert weights"
                    .into(),
            });
        }
        let &[cols, rows, n_expert] = info.dims.as_slice() else {
            return Err(BackendError::BadTensor {
                tensor: info.name.clone(),
                expected: "a stack of experts (3 dimensions)".into(),
                found: format!("dims {:?}", info.dims),
            });
        };
        let (cols, rows) = (cols as usize, rows as usize * n_expert as usize);
        let expected =
            DeviceMatrix::bytes_for(format, rows, cols).map_err(|e| device_error(&info.name, e))?;
        let data = gguf.tensor_data(info);
        if data.len() != expected {
            return Err(BackendError::BadTensor {
                tensor: info.name.clone(),
                expected: format!(
                    "{expected} bytes for {n_expert} experts of {cols} {format} columns"
                ),
                found: format!("{} bytes", data.len()),
            });
        }
        let buf = self
            .upload_new(Purpose::Weights, data)
            .map_err(|e| device_error(&info.name, e))?;
        lock(&self.placed).push((info.name.clone(), buf.ptr(), buf.len()));
        DeviceMatrix::new(buf, format, rows, cols).map_err(|e| device_error(&info.name, e))
    }

    fn moe_ffn(
        &self,
        moe: &MoeFfn<'_, DeviceMatrix>,
        router_logits: &GpuBuf,
        x: &GpuBuf,
        n_tokens: usize,
        out: &mut GpuBuf,
    ) {
        if n_tokens == 0 {
            return;
        }
        let routing = &moe.routing;
        let (n_expert, n_used) = (routing.n_expert, routing.n_expert_used);
        let n_embd = moe.gate.cols;
        let n_ff = moe.n_ff;
        let n_pairs = n_tokens * n_used;
        // Decode (a few tokens) takes the fused kernels, one block column per pair, no sort into
        // tiles (`moe::moe_ffn_decode`).
        if ops::moe_decode_fits(n_tokens, n_used, n_embd, n_ff)
            && moe.gate.format == moe.up.format
            && [moe.gate, moe.up, moe.down]
                .iter()
                .all(|w| ops::has_moe_kernels(w.format))
        {
            self.moe_ffn_decode(moe, router_logits, x, n_tokens, out);
            return;
        }
        // Prompts take the grouped mmq product (tiles of up to 64 pairs of one expert), smaller
        // batches the grouped matrix-vector product (tiles of 8); both need every product's
        // format.
        let mmq_tile = ops::moe_mmq_tile(n_tokens, n_used, n_expert).filter(|_| {
            [moe.gate, moe.up, moe.down]
                .iter()
                .all(|w| ops::has_mmq_kernels(w.format))
        });
        let tile = mmq_tile.unwrap_or(ops::MOE_TILE);
        let slots = ops::moe_tile_slots(n_pairs, n_expert, tile);
        let mut guard = lock(&self.moe_scratch);
        let s = &mut *guard;
        self.ensure_len(&mut s.experts, n_pairs);
        self.ensure_len(&mut s.weights, n_pairs);
        self.ensure_len(&mut s.pairs, n_pairs);
        self.ensure_len(&mut s.tiles, 4 * slots);
        self.ensure_len(&mut s.gate, n_pairs * n_ff);
        self.ensure_len(&mut s.up, n_pairs * n_ff);
        self.ensure_len(&mut s.routed, n_pairs * n_embd);
        // Routing, the sort into tiles, and the gate and up products of every pair.
        self.run("moe_ffn", || {
            let op = "moe_ffn";
            check_moe_shapes(moe)?;
            let logits = router_logits.ptr(op, n_tokens * n_expert)?;
            let x_ptr = x.ptr(op, n_tokens * n_embd)?;
            let experts = s.experts.ptr(op, n_pairs)?;
            let weights = s.weights.ptr(op, n_pairs)?;
            let pairs = s.pairs.ptr(op, n_pairs)?;
            let tiles = s.tiles.ptr(op, 4 * slots)?;
            ops::moe_route(
                &self.ctx,
                logits,
                n_tokens,
                n_expert,
                n_used,
                routing.gating == ExpertGating::Sigmoid,
                routing.normalize_weights,
                routing.weights_scale.unwrap_or(1.0),
                experts,
                weights,
            )?;
            ops::moe_tiles(&self.ctx, experts, n_pairs, n_expert, tile, pairs, tiles)?;
            let gate = s.gate.ptr(op, n_pairs * n_ff)?;
            let up = s.up.ptr(op, n_pairs * n_ff)?;
            for (w, y) in [(moe.gate, gate), (moe.up, up)] {
                match mmq_tile {
                    Some(tile) => ops::moe_mmq(
                        &self.ctx, w, n_expert, x_ptr, n_tokens, n_used, pairs, tiles, n_pairs,
                        tile, y,
                    )?,
                    None => ops::moe_matvec(
                        &self.ctx, w, n_expert, x_ptr, n_used, pairs, tiles, n_pairs, y,
                    )?,
                }
            }
            Ok(())
        });
        match moe.activation {
            FfnActivation::SwiGlu => self.swiglu(&mut s.gate, &s.up, n_pairs * n_ff),
            FfnActivation::GeGlu => self.geglu(&mut s.gate, &s.up, n_pairs * n_ff),
        }
        // The down product of every pair, then each token's weighted sum in rank order.
        self.run("moe_ffn", || {
            let op = "moe_ffn";
            let h = s.gate.ptr(op, n_pairs * n_ff)?;
            let pairs = s.pairs.ptr(op, n_pairs)?;
            let tiles = s.tiles.ptr(op, 4 * slots)?;
            let routed = s.routed.ptr(op, n_pairs * n_embd)?;
            match mmq_tile {
                Some(tile) => ops::moe_mmq(
                    &self.ctx, moe.down, n_expert, h, n_pairs, 1, pairs, tiles, n_pairs, tile,
                    routed,
                )?,
                None => ops::moe_matvec(
                    &self.ctx, moe.down, n_expert, h, 1, pairs, tiles, n_pairs, routed,
                )?,
            }
            let weights = s.weights.ptr(op, n_pairs)?;
            let experts = s.experts.ptr(op, n_pairs)?;
            let expert_scale = moe
                .expert_scale
                .map(|scale| self.expert_scale_ptr(scale))
                .transpose()?;
            let out_ptr = out.ptr(op, n_tokens * n_embd)?;
            ops::moe_combine(
                &self.ctx,
                routed,
                weights,
                experts,
                expert_scale,
                n_tokens,
                n_used,
                n_embd,
                out_ptr,
            )
        });
        if let Some(shared) = &moe.shared {
            self.moe_shared_expert(shared, moe.activation, x, n_tokens, n_embd, s);
            match shared.gate_inp {
                Some(_) => self.run("moe_ffn", || {
                    let op = "moe_ffn";
                    ops::moe_add_gated(
                        &self.ctx,
                        out.ptr(op, n_tokens * n_embd)?,
                        s.shared_out.ptr(op, n_tokens * n_embd)?,
                        s.shared_logit.ptr(op, n_tokens)?,
                        n_tokens,
                        n_embd,
                    )
                }),
                None => self.add_inplace(out, &s.shared_out, n_tokens * n_embd),
            }
        }
    }

    fn release_op_scratch(&self) {
        *lock(&self.moe_scratch) = MoeScratch::default();
        self.release_delta_net_scratch();
    }

    fn linear_attention_supported(&self) -> bool {
        // The reference numerics have no bit-exact delta-net kernels (refused at load with
        // that reason, see `numerics::reference_unsupported_recurrent`).
        !self.reference()
    }

    fn state_alloc(&self, len: usize) -> GpuBuf {
        self.state_alloc_on_device(len)
    }

    fn begin_states(&self, states: &[SequenceState<'_, GpuBuf>]) {
        self.upload_sequence_table(states);
    }

    fn split_query_gate(
        &self,
        q_full: &GpuBuf,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        q: &mut GpuBuf,
        gate: &mut GpuBuf,
    ) {
        self.split_query_gate_on_device(q_full, n_tokens, n_heads, head_dim, q, gate);
    }

    fn mul_sigmoid(&self, x: &mut GpuBuf, gate: &GpuBuf, len: usize) {
        self.mul_sigmoid_on_device(x, gate, len);
    }

    fn gated_delta_net(
        &self,
        op: &GatedDeltaNet<'_, GpuVector>,
        qkv: &GpuBuf,
        z: &GpuBuf,
        beta: &GpuBuf,
        alpha: &GpuBuf,
        states: &mut [SequenceState<'_, GpuBuf>],
        out: &mut GpuBuf,
    ) {
        self.gated_delta_net_on_device(op, qkv, z, beta, alpha, states, out);
    }

    fn get_rows(&self, table: &DeviceMatrix, ids: &[u32], scale: f32, out: &mut GpuBuf) {
        self.run("get_rows", || {
            let out_ptr = out.ptr("get_rows", ids.len() * table.cols)?;
            let ids_ptr = self.batch_ptr(batch::Array::Tokens, ids)?;
            ops::get_rows(&self.ctx, table, ids_ptr, ids.len(), scale, out_ptr)
        });
    }

    fn matmul(&self, w: &DeviceMatrix, x: &GpuBuf, n_tokens: usize, out: &mut GpuBuf) {
        self.run("matmul", || {
            let x_ptr = x.ptr("matmul", n_tokens * w.cols)?;
            let out_ptr = out.ptr("matmul", n_tokens * w.rows)?;
            ops::matmul(&self.ctx, w, x_ptr, n_tokens, out_ptr)
        });
    }

    fn streams_weights(&self) -> bool {
        true
    }

    fn matmul_streamed(
        &self,
        gguf: &Arc<Gguf>,
        info: &TensorInfo,
        x: &GpuBuf,
        n_tokens: usize,
        out: &mut GpuBuf,
    ) -> bool {
        // Checked as `matrix` checks a weight placed here; a weight this device cannot hold
        // runs where it lives.
        let (Ok(format), Ok((rows, cols))) = (weight_format(info), shape_of(info)) else {
            return false;
        };
        let data = gguf.tensor_data(info);
        if DeviceMatrix::bytes_for(format, rows, cols).ok() != Some(data.len())
            || self.failed.load(Ordering::Acquire)
        {
            return false;
        }
        // A copy the pool cannot make room for is no failure: the CPU still has the weight.
        let buf = match self.upload_new(Purpose::Scratch, data) {
            Ok(buf) => buf,
            Err(error) if error.is_out_of_memory() => {
                tracing::debug!(tensor = %info.name, %error, "no room to stream a weight; the product runs where it lives");
                return false;
            }
            Err(error) => {
                self.run("streaming a weight", || Err(error));
                return true;
            }
        };
        self.run("matmul (streamed weight)", || {
            let w = DeviceMatrix::new(buf, format, rows, cols)?;
            let x_ptr = x.ptr("matmul", n_tokens * cols)?;
            let out_ptr = out.ptr("matmul", n_tokens * rows)?;
            ops::matmul(&self.ctx, &w, x_ptr, n_tokens, out_ptr)
        });
        true
    }

    fn matmul_shared(
        &self,
        ws: &[&DeviceMatrix],
        x: &GpuBuf,
        n_tokens: usize,
        outs: &mut [&mut GpuBuf],
    ) {
        // The fused kernels take up to three matrices (Q, K and V); more run one by one (as do
        // all of them in reference numerics, which ops::matmul_shared decides).
        if ws.len() > 3 {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                self.matmul(w, x, n_tokens, out);
            }
            return;
        }
        self.run("matmul", || {
            let cols = ws.first().map_or(0, |w| w.cols);
            if let Some(w) = ws.iter().find(|w| w.cols != cols) {
                return Err(OpsError::Shape {
                    op: "matmul_shared",
                    expected: format!("matrices of {cols} columns"),
                    found: format!("{} columns", w.cols),
                });
            }
            let x_ptr = x.ptr("matmul", n_tokens * cols)?;
            let mut ptrs = [DevicePtr::NULL; 3];
            if ws.len() != outs.len() {
                return Err(OpsError::Shape {
                    op: "matmul_shared",
                    expected: "one output per matrix".to_string(),
                    found: format!("{} matrices, {} outputs", ws.len(), outs.len()),
                });
            }
            for ((ptr, w), out) in ptrs.iter_mut().zip(ws).zip(outs.iter()) {
                *ptr = out.ptr("matmul", n_tokens * w.rows)?;
            }
            ops::matmul_shared(&self.ctx, ws, x_ptr, n_tokens, &ptrs[..ws.len()])
        });
    }

    fn ffn_gate_up(
        &self,
        w_gate: &DeviceMatrix,
        w_up: &DeviceMatrix,
        x: &GpuBuf,
        n_tokens: usize,
        n_ff: usize,
        activation: FfnActivation,
        gate: &mut GpuBuf,
        up: &mut GpuBuf,
    ) {
        if self.reference() {
            // The trait's default: both products, then the activation, as the CPU runs them.
            self.matmul_shared(&[w_gate, w_up], x, n_tokens, &mut [&mut *gate, &mut *up]);
            match activation {
                FfnActivation::SwiGlu => self.swiglu(gate, up, n_tokens * n_ff),
                FfnActivation::GeGlu => self.geglu(gate, up, n_tokens * n_ff),
            }
            return;
        }
        self.run("ffn_gate_up", || {
            let x_ptr = x.ptr("ffn_gate_up", n_tokens * w_gate.cols)?;
            let gate_ptr = gate.ptr("ffn_gate_up", n_tokens * n_ff)?;
            let up_ptr = up.ptr("ffn_gate_up", n_tokens * n_ff)?;
            if w_gate.rows != n_ff || w_up.rows != n_ff || w_up.cols != w_gate.cols {
                return Err(OpsError::Shape {
                    op: "ffn_gate_up",
                    expected: format!("gate and up matrices of {n_ff} rows and equal columns"),
                    found: format!(
                        "{}x{} and {}x{}",
                        w_gate.rows, w_gate.cols, w_up.rows, w_up.cols
                    ),
                });
            }
            let glu = match activation {
                FfnActivation::SwiGlu => ops::Glu::SwiGlu,
                FfnActivation::GeGlu => ops::Glu::GeGlu,
            };
            ops::matmul_glu(
                &self.ctx, w_gate, w_up, x_ptr, n_tokens, glu, gate_ptr, up_ptr,
            )
        });
    }

    fn rms_norm(
        &self,
        x: &GpuBuf,
        weight: &GpuVector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf,
    ) {
        self.run("rms_norm", || {
            check_vector("rms_norm", weight, dim)?;
            let x_ptr = x.ptr("rms_norm", n_rows * dim)?;
            let out_ptr = out.ptr("rms_norm", n_rows * dim)?;
            ops::rms_norm(
                &self.ctx,
                x_ptr,
                weight.buf.ptr(),
                n_rows,
                dim,
                eps,
                out_ptr,
            )
        });
    }

    fn rms_norm_inplace(
        &self,
        x: &mut GpuBuf,
        weight: &GpuVector,
        n_rows: usize,
        dim: usize,
        eps: f32,
    ) {
        self.run("rms_norm", || {
            check_vector("rms_norm", weight, dim)?;
            let x_ptr = x.ptr("rms_norm", n_rows * dim)?;
            ops::rms_norm(&self.ctx, x_ptr, weight.buf.ptr(), n_rows, dim, eps, x_ptr)
        });
    }

    fn has_gemma4_ops(&self) -> bool {
        self.gemma4_ops_available()
    }

    fn rms_norm_unit_inplace(&self, x: &mut GpuBuf, n_rows: usize, dim: usize, eps: f32) {
        self.gemma4_rms_norm_unit(x, n_rows, dim, eps);
    }

    fn mul_rows_inplace(&self, x: &mut GpuBuf, weight: &GpuVector, n_rows: usize, dim: usize) {
        self.gemma4_mul_rows(x, weight, n_rows, dim);
    }

    fn rms_norm_add(
        &self,
        x: &mut GpuBuf,
        weight: &GpuVector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        dst: &mut GpuBuf,
    ) {
        if self.reference() {
            // The exact norm is another kernel: the two ops one after another.
            self.rms_norm_inplace(x, weight, n_rows, dim, eps);
            self.add_inplace(dst, x, n_rows * dim);
            return;
        }
        self.run("rms_norm_add", || {
            check_vector("rms_norm_add", weight, dim)?;
            let len = n_rows * dim;
            ops::rms_norm_add(
                &self.ctx,
                x.ptr("rms_norm_add", len)?,
                weight.buf.ptr(),
                n_rows,
                dim,
                eps,
                dst.ptr("rms_norm_add", len)?,
            )
        });
    }

    fn gemma4_ffn_inputs(
        &self,
        proj: &mut GpuBuf,
        x: &mut GpuBuf,
        norms: &Gemma4FfnNorms<'_, GpuVector>,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: [&mut GpuBuf; 3],
    ) {
        self.gemma4_ffn_inputs_fused(proj, x, norms, n_rows, dim, eps, out);
    }

    fn rms_norm_unit_scale_mul(
        &self,
        x: &GpuBuf,
        n_rows: usize,
        dim: usize,
        eps: f32,
        scale: f32,
        weight: &GpuVector,
        out: &mut GpuBuf,
    ) {
        self.gemma4_rms_norm_unit_scale_mul(x, n_rows, dim, eps, scale, weight, out);
    }

    fn max_head_dim(&self) -> Option<usize> {
        Some(self.ctx.max_head_dim())
    }

    fn add_inplace(&self, dst: &mut GpuBuf, src: &GpuBuf, len: usize) {
        self.run("add", || {
            let dst_ptr = dst.ptr("add", len)?;
            let src_ptr = src.ptr("add", len)?;
            ops::add(&self.ctx, dst_ptr, dst_ptr, src_ptr, len, len)
        });
    }

    fn add_rms_norm(
        &self,
        x: &mut GpuBuf,
        proj: &GpuBuf,
        weight: &GpuVector,
        n_rows: usize,
        dim: usize,
        eps: f32,
        out: &mut GpuBuf,
    ) {
        self.run("add_rms_norm", || {
            check_vector("add_rms_norm", weight, dim)?;
            let x_ptr = x.ptr("add_rms_norm", n_rows * dim)?;
            let proj_ptr = proj.ptr("add_rms_norm", n_rows * dim)?;
            let out_ptr = out.ptr("add_rms_norm", n_rows * dim)?;
            if !ops::fusion_enabled() {
                let n = n_rows * dim;
                ops::add(&self.ctx, x_ptr, x_ptr, proj_ptr, n, n)?;
                return ops::rms_norm(
                    &self.ctx,
                    x_ptr,
                    weight.buf.ptr(),
                    n_rows,
                    dim,
                    eps,
                    out_ptr,
                );
            }
            ops::add_rms_norm(
                &self.ctx,
                x_ptr,
                proj_ptr,
                weight.buf.ptr(),
                n_rows,
                dim,
                eps,
                out_ptr,
            )
        });
    }

    fn add_bias(&self, x: &mut GpuBuf, bias: &GpuVector, n_rows: usize, dim: usize) {
        self.run("add_bias", || {
            check_vector("add_bias", bias, dim)?;
            let x_ptr = x.ptr("add_bias", n_rows * dim)?;
            ops::add(&self.ctx, x_ptr, x_ptr, bias.buf.ptr(), n_rows * dim, dim)
        });
    }

    fn scale(&self, x: &mut GpuBuf, len: usize, scale: f32) {
        self.run("scale", || {
            let x_ptr = x.ptr("scale", len)?;
            ops::scale(&self.ctx, x_ptr, x_ptr, scale, len)
        });
    }

    fn swiglu(&self, gate: &mut GpuBuf, up: &GpuBuf, len: usize) {
        self.run("swiglu", || {
            let gate_ptr = gate.ptr("swiglu", len)?;
            let up_ptr = up.ptr("swiglu", len)?;
            ops::swiglu(&self.ctx, gate_ptr, gate_ptr, up_ptr, len)
        });
    }

    fn geglu(&self, gate: &mut GpuBuf, up: &GpuBuf, len: usize) {
        self.run("geglu", || {
            let gate_ptr = gate.ptr("geglu", len)?;
            let up_ptr = up.ptr("geglu", len)?;
            if self.reference() {
                let table = self.gelu_table_ptr()?;
                return ops::geglu_exact(&self.ctx, gate_ptr, gate_ptr, up_ptr, table, len);
            }
            ops::geglu(&self.ctx, gate_ptr, gate_ptr, up_ptr, len)
        });
    }

    fn softcap(&self, x: &mut GpuBuf, len: usize, cap: f32) {
        self.run("softcap", || {
            if self.reference() {
                // Refused at load (numerics::reference_unsupported); reached only by callers that
                // skipped that check.
                return Err(OpsError::Unsupported {
                    op: "softcap",
                    what: "reference numerics (the CPU's glibc tanhf has no bit-exact kernel)"
                        .into(),
                });
            }
            let x_ptr = x.ptr("softcap", len)?;
            ops::softcap(&self.ctx, x_ptr, len, cap)
        });
    }

    fn rope_table_new(&self) -> GpuRopeTable {
        GpuRopeTable {
            n_dims: 0,
            freq_base: 0.0,
            freq_scale: 1.0,
            positions: DevicePtr::NULL,
            n_positions: 0,
            factors: None,
            cos_sin: None,
            cos_sin_tokens: 0,
            cos_sin_host: Vec::new(),
        }
    }

    fn rope_table(&self, positions: &[u32], params: &RopeParams<'_>, table: &mut GpuRopeTable) {
        table.n_dims = params.n_dims;
        table.freq_base = params.freq_base;
        table.freq_scale = params.freq_scale;
        table.positions = DevicePtr::NULL;
        table.n_positions = 0;
        table.cos_sin_tokens = 0;
        if self.reference() {
            self.run("rope_table", || {
                numerics::rope_cos_sin(positions, params, &mut table.cos_sin_host);
                let bytes = f32_bytes(table.cos_sin_host.len());
                if table.cos_sin.as_ref().is_none_or(|buf| buf.len() < bytes) {
                    table.cos_sin = None;
                    table.cos_sin = self.alloc_f32(table.cos_sin_host.len())?;
                }
                if let Some(buf) = &table.cos_sin {
                    let host: Vec<u8> = table
                        .cos_sin_host
                        .iter()
                        .flat_map(|v| v.to_le_bytes())
                        .collect();
                    self.ctx.upload(buf.ptr(), &host)?;
                }
                table.cos_sin_tokens = positions.len();
                Ok(())
            });
            return;
        }
        self.run("rope_table", || {
            table.positions = self.batch_ptr(batch::Array::Positions, positions)?;
            table.n_positions = positions.len();
            match params.freq_factors {
                None => table.factors = None,
                Some(factors) => {
                    let current = table
                        .factors
                        .as_ref()
                        .is_some_and(|(host, _)| host.as_slice() == factors);
                    if !current {
                        table.factors = None;
                        let bytes: Vec<u8> = factors.iter().flat_map(|v| v.to_le_bytes()).collect();
                        let buf = self.upload_new(Purpose::Scratch, &bytes)?;
                        table.factors = Some((factors.to_vec(), buf));
                    }
                }
            }
            Ok(())
        });
    }

    fn rope(
        &self,
        x: &mut GpuBuf,
        table: &GpuRopeTable,
        n_tokens: usize,
        n_heads: usize,
        head_dim: usize,
        mode: RopeMode,
    ) {
        if self.reference() {
            self.run("rope", || {
                let cos_sin = match &table.cos_sin {
                    Some(buf) if table.cos_sin_tokens >= n_tokens => buf.ptr(),
                    _ if table.n_dims == 0 => return Ok(()),
                    _ => {
                        return Err(OpsError::Shape {
                            op: "rope",
                            expected: format!("rotary cosines and sines for {n_tokens} tokens"),
                            found: format!("{} tokens", table.cos_sin_tokens),
                        })
                    }
                };
                let x_ptr = x.ptr("rope", n_tokens * n_heads * head_dim)?;
                ops::rope_exact(
                    &self.ctx,
                    x_ptr,
                    cos_sin,
                    n_tokens,
                    n_heads,
                    head_dim,
                    table.n_dims,
                    rope_mode(mode),
                )
            });
            return;
        }
        self.run("rope", || {
            if table.n_positions < n_tokens || table.positions == DevicePtr::NULL {
                return Err(OpsError::Shape {
                    op: "rope",
                    expected: format!("positions for {n_tokens} tokens"),
                    found: format!("{} positions", table.n_positions),
                });
            }
            let x_ptr = x.ptr("rope", n_tokens * n_heads * head_dim)?;
            ops::rope(
                &self.ctx,
                x_ptr,
                table.positions,
                n_tokens,
                n_heads,
                head_dim,
                table.n_dims,
                rope_mode(mode),
                table.freq_base,
                table.freq_scale,
                table.factors.as_ref().map(|(_, buf)| buf.ptr()),
            )
        });
    }

    fn kv_layer(
        &self,
        max_blocks: usize,
        block_size: usize,
        n_kv_heads: usize,
        head_dim: usize,
    ) -> GpuKvLayer {
        // The address table starts small and grows with the blocks used. Its first allocation is
        // made now, when the context is made, rather than with the first blocks: the pools place
        // allocations lowest address first, and a long-lived table among the first KV blocks
        // would keep their memory mapped after they are released. If it cannot be had now, the
        // first `kv_materialize` asks again.
        let capacity = max_blocks.min(INITIAL_TABLE_BLOCKS);
        let table = self.ctx.alloc(Purpose::Kv, table_bytes(capacity)).ok();
        GpuKvLayer {
            block_size,
            n_kv_heads,
            head_dim,
            max_blocks,
            k: (0..capacity).map(|_| None).collect(),
            v: (0..capacity).map(|_| None).collect(),
            table_host: vec![0; 2 * capacity],
            table,
            dirty: true,
            bytes: 0,
        }
    }

    fn kv_materialize(&self, layer: &mut GpuKvLayer, blocks: &[u32]) {
        self.run("kv_materialize", || {
            let block_bytes = layer.block_bytes();
            if let Some(&highest) = blocks.iter().max() {
                layer.grow_table(&self.ctx, highest as usize + 1)?;
            }
            let capacity = layer.table_capacity();
            for &block in blocks {
                let b = block as usize;
                if layer.k[b].is_some() {
                    continue;
                }
                let k = self.ctx.alloc(Purpose::Kv, block_bytes)?;
                let v = self.ctx.alloc(Purpose::Kv, block_bytes)?;
                layer.table_host[b] = k.ptr().0;
                layer.table_host[capacity + b] = v.ptr().0;
                layer.k[b] = Some(k);
                layer.v[b] = Some(v);
                layer.bytes += 2 * block_bytes as usize;
                layer.dirty = true;
            }
            layer.sync_table(&self.ctx)
        });
    }

    fn kv_release(&self, layer: &mut GpuKvLayer, blocks: &[u32]) {
        let capacity = layer.table_capacity();
        let block_bytes = layer.block_bytes() as usize;
        for &block in blocks {
            let b = block as usize;
            // A block beyond the table never had memory.
            if b >= capacity {
                continue;
            }
            // Stream order makes the memory safe to reuse at once: kernels queued before any
            // later use of it have finished reading by then.
            if layer.k[b].take().is_some() {
                layer.bytes -= block_bytes;
            }
            if layer.v[b].take().is_some() {
                layer.bytes -= block_bytes;
            }
            layer.table_host[b] = 0;
            layer.table_host[capacity + b] = 0;
            layer.dirty = true;
        }
        // A stale table only names released blocks, which no block table refers to any more;
        // it is uploaded with the next change if this upload cannot run now.
        if layer.table.is_some() {
            self.run("kv_release", || layer.sync_table(&self.ctx));
        }
    }

    fn kv_bytes(&self, layer: &GpuKvLayer) -> usize {
        layer.bytes
    }

    fn kv_store(&self, layer: &mut GpuKvLayer, k: &GpuBuf, v: &GpuBuf, plan: &AttentionPlan) {
        self.run("kv_store", || {
            layer.sync_table(&self.ctx)?;
            let n_tokens = plan.n_tokens();
            let row = layer.n_kv_heads * layer.head_dim;
            let k_ptr = k.ptr("kv_store", n_tokens * row)?;
            let v_ptr = v.ptr("kv_store", n_tokens * row)?;
            let (k_blocks, v_blocks) = layer.tables()?;
            let slots = lock(&self.batch).plan_ptr(plan, batch::Array::Slots)?;
            ops::kv_store(
                &self.ctx,
                k_blocks,
                v_blocks,
                k_ptr,
                v_ptr,
                slots,
                n_tokens,
                row,
                layer.block_size,
            )
        });
    }

    fn rope_kv_store(
        &self,
        q: &mut GpuBuf,
        k: &mut GpuBuf,
        v: &GpuBuf,
        norm: QkNorm<'_, GpuVector>,
        table: &GpuRopeTable,
        n_tokens: usize,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        mode: RopeMode,
        layer: &mut GpuKvLayer,
        plan: &AttentionPlan,
    ) {
        if !ops::fusion_enabled() || self.reference() {
            norm.apply(self, q, k, n_tokens, n_heads, n_kv_heads, head_dim);
            self.rope(q, table, n_tokens, n_heads, head_dim, mode);
            self.rope(k, table, n_tokens, n_kv_heads, head_dim, mode);
            self.kv_store(layer, k, v, plan);
            return;
        }
        self.run("rope_kv_store", || {
            if table.n_positions < n_tokens || table.positions == DevicePtr::NULL {
                return Err(OpsError::Shape {
                    op: "rope_kv_store",
                    expected: format!("positions for {n_tokens} tokens"),
                    found: format!("{} positions", table.n_positions),
                });
            }
            if plan.n_tokens() != n_tokens
                || layer.n_kv_heads != n_kv_heads
                || layer.head_dim != head_dim
            {
                return Err(OpsError::Shape {
                    op: "rope_kv_store",
                    expected: format!(
                        "a plan of {n_tokens} tokens and a layer of {n_kv_heads} heads of {head_dim}"
                    ),
                    found: format!(
                        "{} tokens, {} heads of {}",
                        plan.n_tokens(),
                        layer.n_kv_heads,
                        layer.head_dim
                    ),
                });
            }
            for weight in [norm.q, norm.k].into_iter().flatten() {
                check_vector("rope_kv_store", weight, head_dim)?;
            }
            layer.sync_table(&self.ctx)?;
            let row = n_kv_heads * head_dim;
            let q_ptr = q.ptr("rope_kv_store", n_tokens * n_heads * head_dim)?;
            let k_ptr = k.ptr("rope_kv_store", n_tokens * row)?;
            let v_ptr = v.ptr("rope_kv_store", n_tokens * row)?;
            let (k_blocks, v_blocks) = layer.tables()?;
            let slots = lock(&self.batch).plan_ptr(plan, batch::Array::Slots)?;
            ops::rope_kv_store(
                &self.ctx,
                &ops::RopeKvStoreArgs {
                    q: q_ptr,
                    k: k_ptr,
                    v: v_ptr,
                    positions: table.positions,
                    freq_factors: table.factors.as_ref().map(|(_, buf)| buf.ptr()),
                    n_tokens,
                    n_heads,
                    n_kv_heads,
                    head_dim,
                    n_dims: table.n_dims,
                    mode: rope_mode(mode),
                    freq_base: table.freq_base,
                    freq_scale: table.freq_scale,
                    k_blocks,
                    v_blocks,
                    slots,
                    block_size: layer.block_size,
                    q_norm: norm.q.map(|w| w.buf.ptr()),
                    k_norm: norm.k.map(|w| w.buf.ptr()),
                    norm_eps: norm.eps,
                },
            )
        });
    }

    fn attention(
        &self,
        q: &GpuBuf,
        layer: &GpuKvLayer,
        plan: &AttentionPlan,
        n_heads: usize,
        n_kv_heads: usize,
        head_dim: usize,
        kq_scale: f32,
        window: Option<usize>,
        out: &mut GpuBuf,
    ) {
        self.run("attention", || {
            let n_tokens = plan.n_tokens();
            let q_ptr = q.ptr("attention", n_tokens * n_heads * head_dim)?;
            let out_ptr = out.ptr("attention", n_tokens * n_heads * head_dim)?;
            let (k_blocks, v_blocks) = layer.tables()?;
            let arrays = lock(&self.batch);
            let args = AttentionArgs {
                q: q_ptr,
                out: out_ptr,
                k_blocks,
                v_blocks,
                block_tables: arrays.plan_ptr(plan, batch::Array::BlockTables)?,
                table_of_token: arrays.plan_ptr(plan, batch::Array::TableOfToken)?,
                positions: arrays.plan_ptr(plan, batch::Array::Positions)?,
                n_tokens,
                n_tables: plan.tables.len(),
                max_blocks_per_table: arrays.max_blocks_per_table(),
                max_position: arrays.max_position(),
                n_heads,
                n_kv_heads,
                head_dim,
                block_size: layer.block_size,
                scale: kq_scale,
                window,
                softcap: None,
            };
            drop(arrays);
            ops::attention(&self.ctx, &args)
        });
    }
}

#[cfg(all(test, unix))]
mod tests;

#[cfg(all(test, unix))]
mod split_tests;

/// `(first, stride)` when `rows` are `first, first + stride, first + 2 stride, ...` (stride 0
/// only for a single row).
fn evenly_spaced(rows: &[usize]) -> Option<(usize, usize)> {
    let (&first, rest) = rows.split_first()?;
    let stride = rest
        .first()
        .map_or(Some(0), |&second| second.checked_sub(first))?;
    if !rest.is_empty() && stride == 0 {
        return None;
    }
    let mut expected = first;
    for &row in rest {
        expected += stride;
        if row != expected {
            return None;
        }
    }
    Some((first, stride))
}

fn check_vector(op: &'static str, vector: &GpuVector, len: usize) -> Result<(), OpsError> {
    if vector.len < len {
        return Err(OpsError::Shape {
            op,
            expected: format!("a weight vector of {len} values"),
            found: format!("{} values", vector.len),
        });
    }
    Ok(())
}
