//! Device ops the engine's GPU backend is written in: one [`GpuContext`] per device (driver,
//! stream, pool, kernels, optional BLAS) and one function per op, each a kernel launch (or a BLAS
//! call) queued on the context's stream.
//!
//! Contract with the engine (B):
//! - Every op is asynchronous on [`GpuContext::stream`] and returns `Result<(), OpsError>`; only
//!   [`GpuContext::download`] and [`GpuContext::synchronize`] wait. Stream order is what makes
//!   reusing a scratch buffer for the next op safe.
//! - Pointers are [`DevicePtr`]s into buffers the caller owns; element counts are `usize`.
//!   Activations are row-major f32: a buffer of `n` rows of `dim` values is `buf[t * dim + i]`.
//! - Shapes are checked against what the kernels can do (32-bit counts, block multiples) and a
//!   violation is an [`OpsError::Shape`], never a launch with wrong sizes. Buffer lengths are not
//!   known to the ops (a `DevicePtr` carries none): they are the caller's responsibility.
//!
//! Beyond the plan's list (all additions; every planned signature is as agreed):
//! [`matmul_with`] and [`MatmulPath`] force the matrix-vector, BLAS or tiled path (tests and the
//! `ops_check` example use them); [`matvec_max_tokens`] (the decode/GEMM crossover, overridable
//! with `EMBER_MATVEC_MAX_TOKENS`); [`convert_f32_to_f16`]; [`GpuContext::with_options`] (turn BLAS
//! off without the environment), [`GpuContext::copy`], [`GpuContext::zero`],
//! [`GpuContext::warp_size`], [`GpuContext::kernels`]; [`WeightFormat::ALL`],
//! [`WeightFormat::ggml_type_id`] / [`WeightFormat::from_ggml_type_id`] (GGUF type ids, so the
//! engine needs no name round trip); [`DeviceMatrix::new`] (checks the buffer size) and
//! [`DeviceMatrix::bytes_for`]; [`OpsError::is_out_of_memory`]. `get_rows` ids, `rope`
//! positions, `gather_rows` rows and `argmax` output are i32 on the device. An out-of-range
//! `get_rows` id gives a row of NaNs rather than a fault.
//!
//! Graphs: [`GpuContext::begin_capture`] / [`GpuContext::end_capture`] record the ops queued in
//! between into a graph instead of running them (the engine replays decode steps this way, one
//! launch instead of hundreds); [`GpuContext::instantiate_graph`], [`GpuContext::update_graph`],
//! [`GpuContext::launch_graph`] and the destroy calls wrap the driver's. A synchronous call made
//! while capturing ([`GpuContext::upload`], [`GpuContext::download`],
//! [`GpuContext::synchronize`]) ends the capture first (the ops recorded so far are dropped, not
//! run) and runs as usual; [`GpuContext::end_capture`] then says why the capture was aborted.
//! A capture that has recorded nothing yet is not aborted: it ends, the call runs, and it begins
//! again (in a layer split, a device's first op of a pass follows the copy of the activations
//! from the previous device; the pass is still recorded whole). While a capture is open the
//! device pool's idle trim waits ([`DevicePool::hold_idle_trim`]).
//!
//! Launch cost: kernel function handles are cached per context in a table resolved once per
//! function (no lock and no allocation on the launch path).
//!
//! The shape of this module (a context owning the stream and a kernel table, free functions per op)
//! follows candle's CUDA backend; the kernels themselves are ember's own (`kernels/*.hip`).

mod attention;
mod delta_net;
mod elementwise;
mod exact_attention;
mod exact_elementwise;
mod exact_matmul;
mod matmul;
mod matvec;
mod mmq;
mod moe;

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use thiserror::Error;

use crate::blas::{Blas, BlasError, BlasStatus};
use crate::driver::{
    DeviceOrdinal, DevicePtr, Driver, DriverError, FunctionHandle, GraphExecHandle, GraphHandle,
    KernelArgs, LaunchConfig, StreamHandle,
};
use crate::kernels::{KernelError, KernelLibrary, KernelModule, KERNEL_MODULES};
use crate::pool::{DevicePool, PoolBuffer, PoolError, Purpose};

pub use attention::{attention, kv_store, AttentionArgs, MAX_HEAD_DIM};
pub use delta_net::{
    gated_delta_net, mul_sigmoid, split_query_gate, DeltaNetIo, DeltaNetLayer, DeltaNetSeqs,
    DELTA_NET_CHUNKED_MIN_ROWS, DELTA_NET_MAX_HEAD_DIM, DELTA_NET_MAX_TAPS,
};
pub use elementwise::{
    add, add_rms_norm, argmax, argmax_scratch_bytes, convert_f32_to_f16, gather_rows,
    gather_rows_strided, geglu, gemma4_ffn_inputs, get_rows, mul, rms_norm, rms_norm_add,
    rms_norm_scale_mul, rope, rope_kv_store, scale, softcap, swiglu, Gemma4FfnInputs,
    RopeKvStoreArgs, RopeMode,
};
pub use exact_attention::{attention_exact, exp_exact, ExactExp, EXACT_MAX_HEAD_DIM};
pub use exact_elementwise::{geglu_exact, rope_exact, GELU_TABLE_LEN};
pub use exact_matmul::matmul_exact;
pub use matmul::{
    auto_path, fusion_enabled, matmul, matmul_glu, matmul_shared, matmul_with, matvec_max_tokens,
    mmq_max_tokens, Glu, MatmulPath, FUSION_ENV, MATVEC_MAX_TOKENS, MATVEC_MAX_TOKENS_ENV,
    MMQ_MAX_TOKENS, MMQ_MAX_TOKENS_ENV,
};
pub use mmq::{has_mmq_kernels, moe_mmq, MMQ_TARGET_BLOCKS, MMQ_TARGET_BLOCKS_ENV};
pub use moe::{
    has_moe_kernels, moe_add_gated, moe_combine, moe_decode_fits, moe_down, moe_down_scratch_bytes,
    moe_glu, moe_matvec, moe_mmq_tile, moe_route, moe_tile_slots, moe_tiles, SharedOutput,
    MOE_DECODE_MAX_TOKENS, MOE_DECODE_MAX_TOKENS_ENV, MOE_MAX_EXPERTS, MOE_MMQ_MIN_TOKENS,
    MOE_MMQ_MIN_TOKENS_ENV, MOE_TILE,
};

/// Environment variable that turns the BLAS library off (`1`): `matmul` then uses the tiled
/// kernel for prefill. For comparisons and for hosts whose BLAS misbehaves.
pub const DISABLE_BLAS_ENV: &str = "EMBER_DISABLE_BLAS";

/// A failed op. Every variant names the op or call that failed.
#[derive(Debug, Error)]
pub enum OpsError {
    #[error("{operation} on device {device}: {source}")]
    Driver {
        device: DeviceOrdinal,
        operation: String,
        source: DriverError,
    },
    /// Kept whole so callers can tell out-of-memory and budget refusals apart.
    #[error(transparent)]
    Pool(#[from] PoolError),
    #[error(transparent)]
    Kernel(#[from] KernelError),
    #[error(transparent)]
    Blas(#[from] BlasError),
    #[error("{op}: expected {expected}, found {found}")]
    Shape {
        op: &'static str,
        expected: String,
        found: String,
    },
    #[error("{op} does not support {what}")]
    Unsupported { op: &'static str, what: String },
    #[error("{0} is not built yet")]
    NotBuilt(&'static str),
    /// [`GpuContext::end_capture`] after a synchronous call ended the capture early.
    #[error("the graph capture was aborted: {reason}")]
    CaptureAborted { reason: String },
}

impl OpsError {
    /// Whether the op failed for lack of device memory (pool out of memory or over budget).
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            OpsError::Pool(PoolError::OutOfMemory { .. })
            | OpsError::Pool(PoolError::BudgetExceeded { .. }) => true,
            OpsError::Driver { source, .. } => source.is_out_of_memory(),
            _ => false,
        }
    }

    pub(crate) fn shape(
        op: &'static str,
        expected: impl Into<String>,
        found: impl Into<String>,
    ) -> OpsError {
        OpsError::Shape {
            op,
            expected: expected.into(),
            found: found.into(),
        }
    }
}

/// Storage formats a [`DeviceMatrix`] can hold: GGUF's tensor types that have kernels.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightFormat {
    F32,
    F16,
    BF16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl WeightFormat {
    pub const ALL: [WeightFormat; 13] = [
        WeightFormat::F32,
        WeightFormat::F16,
        WeightFormat::BF16,
        WeightFormat::Q4_0,
        WeightFormat::Q4_1,
        WeightFormat::Q5_0,
        WeightFormat::Q5_1,
        WeightFormat::Q8_0,
        WeightFormat::Q2K,
        WeightFormat::Q3K,
        WeightFormat::Q4K,
        WeightFormat::Q5K,
        WeightFormat::Q6K,
    ];

    /// Values per block (1 for the float formats).
    pub fn block_values(self) -> usize {
        match self {
            WeightFormat::F32 | WeightFormat::F16 | WeightFormat::BF16 => 1,
            WeightFormat::Q4_0
            | WeightFormat::Q4_1
            | WeightFormat::Q5_0
            | WeightFormat::Q5_1
            | WeightFormat::Q8_0 => 32,
            WeightFormat::Q2K
            | WeightFormat::Q3K
            | WeightFormat::Q4K
            | WeightFormat::Q5K
            | WeightFormat::Q6K => 256,
        }
    }

    /// Bytes per block, as GGML lays the blocks out.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightFormat::F32 => 4,
            WeightFormat::F16 | WeightFormat::BF16 => 2,
            // f16 scale + 16 bytes of nibbles.
            WeightFormat::Q4_0 => 18,
            // f16 scale and minimum + 16 bytes of nibbles.
            WeightFormat::Q4_1 => 20,
            // f16 scale + 4 bytes of high bits + 16 bytes of nibbles.
            WeightFormat::Q5_0 => 22,
            WeightFormat::Q5_1 => 24,
            WeightFormat::Q8_0 => 34,
            WeightFormat::Q2K => 84,
            WeightFormat::Q3K => 110,
            WeightFormat::Q4K => 144,
            WeightFormat::Q5K => 176,
            WeightFormat::Q6K => 210,
        }
    }

    /// Bytes of one row of `cols` values, or `None` when `cols` is not a whole number of blocks.
    pub fn row_bytes(self, cols: usize) -> Option<usize> {
        let block_values = self.block_values();
        if !cols.is_multiple_of(block_values) {
            return None;
        }
        (cols / block_values).checked_mul(self.block_bytes())
    }

    /// The GGML name (`q4_K`, `f16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::BF16 => "bf16",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q5_1 => "q5_1",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q2K => "q2_K",
            WeightFormat::Q3K => "q3_K",
            WeightFormat::Q4K => "q4_K",
            WeightFormat::Q5K => "q5_K",
            WeightFormat::Q6K => "q6_K",
        }
    }

    /// The suffix of this format's kernel names (`ember_matvec_q4_k`).
    pub fn kernel_suffix(self) -> &'static str {
        match self {
            WeightFormat::F32 => "f32",
            WeightFormat::F16 => "f16",
            WeightFormat::BF16 => "bf16",
            WeightFormat::Q4_0 => "q4_0",
            WeightFormat::Q4_1 => "q4_1",
            WeightFormat::Q5_0 => "q5_0",
            WeightFormat::Q5_1 => "q5_1",
            WeightFormat::Q8_0 => "q8_0",
            WeightFormat::Q2K => "q2_k",
            WeightFormat::Q3K => "q3_k",
            WeightFormat::Q4K => "q4_k",
            WeightFormat::Q5K => "q5_k",
            WeightFormat::Q6K => "q6_k",
        }
    }

    /// Parses a GGML type name, case-insensitively and with or without the underscore of the
    /// k-quants (`Q4_K`, `q4_k`, `q4k`).
    pub fn from_name(name: &str) -> Option<WeightFormat> {
        let wanted = name.trim().to_ascii_lowercase().replace('_', "");
        WeightFormat::ALL
            .into_iter()
            .find(|format| format.name().to_ascii_lowercase().replace('_', "") == wanted)
    }

    /// The GGUF tensor type id (`ggml_type`) of this format.
    pub fn ggml_type_id(self) -> u32 {
        match self {
            WeightFormat::F32 => 0,
            WeightFormat::F16 => 1,
            WeightFormat::Q4_0 => 2,
            WeightFormat::Q4_1 => 3,
            WeightFormat::Q5_0 => 6,
            WeightFormat::Q5_1 => 7,
            WeightFormat::Q8_0 => 8,
            WeightFormat::Q2K => 10,
            WeightFormat::Q3K => 11,
            WeightFormat::Q4K => 12,
            WeightFormat::Q5K => 13,
            WeightFormat::Q6K => 14,
            WeightFormat::BF16 => 30,
        }
    }

    /// The format of a GGUF tensor type id (`ggml_type`), when it has kernels.
    pub fn from_ggml_type_id(id: u32) -> Option<WeightFormat> {
        Some(match id {
            0 => WeightFormat::F32,
            1 => WeightFormat::F16,
            2 => WeightFormat::Q4_0,
            3 => WeightFormat::Q4_1,
            6 => WeightFormat::Q5_0,
            7 => WeightFormat::Q5_1,
            8 => WeightFormat::Q8_0,
            10 => WeightFormat::Q2K,
            11 => WeightFormat::Q3K,
            12 => WeightFormat::Q4K,
            13 => WeightFormat::Q5K,
            14 => WeightFormat::Q6K,
            30 => WeightFormat::BF16,
            _ => return None,
        })
    }
}

impl fmt::Display for WeightFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A weight matrix in device memory: `rows` rows of `cols` values in `format`, row-major, each
/// row `format.row_bytes(cols)` bytes, rows packed back to back.
#[derive(Debug)]
pub struct DeviceMatrix {
    pub buf: PoolBuffer,
    pub format: WeightFormat,
    pub rows: usize,
    pub cols: usize,
}

impl DeviceMatrix {
    /// Checks that `buf` is large enough for the shape and builds the matrix.
    pub fn new(
        buf: PoolBuffer,
        format: WeightFormat,
        rows: usize,
        cols: usize,
    ) -> Result<DeviceMatrix, OpsError> {
        let needed = DeviceMatrix::bytes_for(format, rows, cols)?;
        if buf.len() < needed as u64 {
            return Err(OpsError::shape(
                "DeviceMatrix::new",
                format!("a buffer of at least {needed} bytes for {rows}x{cols} {format}"),
                format!("{} bytes", buf.len()),
            ));
        }
        Ok(DeviceMatrix {
            buf,
            format,
            rows,
            cols,
        })
    }

    /// Bytes a `rows` x `cols` matrix in `format` occupies.
    pub fn bytes_for(format: WeightFormat, rows: usize, cols: usize) -> Result<usize, OpsError> {
        format
            .row_bytes(cols)
            .and_then(|row| row.checked_mul(rows))
            .ok_or_else(|| {
                OpsError::shape(
                    "DeviceMatrix",
                    format!(
                        "a column count that is a multiple of {} for {format}",
                        format.block_values()
                    ),
                    format!("{rows}x{cols}"),
                )
            })
    }

    pub fn ptr(&self) -> DevicePtr {
        self.buf.ptr()
    }

    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.format.row_bytes(self.cols).unwrap_or(0)
    }
}

/// Options of a [`GpuContext`].
#[derive(Clone, Debug, Default)]
pub struct GpuContextOptions {
    /// Do not load a BLAS library (as `EMBER_DISABLE_BLAS=1` does).
    pub disable_blas: bool,
}

/// How the ops round, held by the [`GpuContext`] ([`GpuContext::set_numerics`]): each op has one
/// wrapper, which picks its kernel by this setting.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Numerics {
    /// The tuned kernels, rounding as suits the GPU (the default).
    #[default]
    Fast,
    /// The bit-exact twins of the CPU backend's ops (`kernels/exact_*.hip`) where the fast kernel
    /// rounds differently; ops whose fast kernel already rounds as the CPU does (an add, a scale,
    /// a copy, the f16 K/V store) run it in both modes.
    Reference,
}

/// One device as the ops see it: its driver, its own stream, its pool, its kernels, BLAS when a
/// library could be loaded, and how its ops round.
pub struct GpuContext {
    driver: Arc<dyn Driver>,
    device: DeviceOrdinal,
    stream: StreamHandle,
    pool: Arc<DevicePool>,
    kernels: Arc<KernelLibrary>,
    arch: String,
    warp_size: u32,
    blas_status: BlasStatus,
    blas: Option<Blas>,
    /// Function handles, resolved once each (see [`FunctionTable`]).
    functions: FunctionTable,
    /// The stream is capturing (set by `begin_capture`, cleared when the capture ends).
    capturing: AtomicBool,
    /// Why the last capture ended early, for `end_capture` to report.
    capture_aborted: Mutex<Option<String>>,
    /// Ops (kernels, copies, fills) queued since the capture began: while none is, a
    /// synchronous call restarts the capture instead of aborting it.
    captured_ops: AtomicU64,
    /// How the ops round.
    numerics: Numerics,
    /// The CPU thread count whose split-KV attention the reference numerics reproduce.
    reference_threads: usize,
    /// Whether launches are counted and timed ([`GpuContext::set_launch_timing`]).
    time_launches: bool,
    /// Kernel launches queued and the CPU time spent in the driver's launch calls (nanoseconds),
    /// while timing is on.
    launches: AtomicU64,
    launch_nanos: AtomicU64,
}

/// Every kernel function of [`KERNEL_MODULES`] by name, with a slot for its handle on this
/// context's device. The map is built once and only read afterwards, so a launch looks its kernel
/// up without a lock; each slot is filled on first use.
struct FunctionTable {
    index: HashMap<&'static str, usize>,
    handles: Vec<OnceLock<FunctionHandle>>,
}

impl FunctionTable {
    fn new() -> FunctionTable {
        let index: HashMap<&'static str, usize> = KERNEL_MODULES
            .iter()
            .flat_map(|spec| spec.functions.iter().copied())
            .enumerate()
            .map(|(i, name)| (name, i))
            .collect();
        let handles = (0..index.len()).map(|_| OnceLock::new()).collect();
        FunctionTable { index, handles }
    }
}

impl fmt::Debug for GpuContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuContext")
            .field("backend", &self.driver.backend())
            .field("device", &self.device)
            .field("arch", &self.arch)
            .field("stream", &self.stream)
            .field("blas", &self.blas_status)
            .finish()
    }
}

impl GpuContext {
    /// Creates the context's stream, resolves the device's architecture and tries to load BLAS
    /// (unless `EMBER_DISABLE_BLAS=1`); a missing BLAS is recorded in [`GpuContext::blas`], not
    /// an error.
    pub fn new(pool: Arc<DevicePool>, kernels: Arc<KernelLibrary>) -> Result<GpuContext, OpsError> {
        let disable_blas = std::env::var(DISABLE_BLAS_ENV).is_ok_and(|v| v.trim() == "1");
        GpuContext::with_options(pool, kernels, &GpuContextOptions { disable_blas })
    }

    /// [`GpuContext::new`] with explicit options (the environment is not read).
    pub fn with_options(
        pool: Arc<DevicePool>,
        kernels: Arc<KernelLibrary>,
        options: &GpuContextOptions,
    ) -> Result<GpuContext, OpsError> {
        let driver = Arc::clone(pool.driver());
        let device = pool.device();
        let arch = kernels.arch(&*driver, device)?;
        let warp_size = driver
            .device_info(device)
            .map_err(|source| OpsError::Driver {
                device,
                operation: "querying the device".to_string(),
                source,
            })?
            .warp_size;
        let stream = driver
            .stream_create(device)
            .map_err(|source| OpsError::Driver {
                device,
                operation: "creating the ops stream".to_string(),
                source,
            })?;
        let (blas, blas_status) = if options.disable_blas {
            (
                None,
                BlasStatus::Unavailable {
                    reason: format!("turned off ({DISABLE_BLAS_ENV}=1 or a context option)"),
                },
            )
        } else {
            match Blas::new(&*driver, device, stream) {
                Ok(blas) => {
                    let status = BlasStatus::Loaded {
                        library: blas.library_path().to_path_buf(),
                    };
                    (Some(blas), status)
                }
                Err(error) => {
                    tracing::info!(device, %error, "no BLAS library: prefill uses ember's tiled GEMM kernel");
                    (
                        None,
                        BlasStatus::Unavailable {
                            reason: error.to_string(),
                        },
                    )
                }
            }
        };
        Ok(GpuContext {
            driver,
            device,
            stream,
            pool,
            kernels,
            arch,
            warp_size,
            blas_status,
            blas,
            functions: FunctionTable::new(),
            capturing: AtomicBool::new(false),
            capture_aborted: Mutex::new(None),
            captured_ops: AtomicU64::new(0),
            numerics: Numerics::Fast,
            reference_threads: 1,
            time_launches: false,
            launches: AtomicU64::new(0),
            launch_nanos: AtomicU64::new(0),
        })
    }

    /// Counts and times the driver's launch calls from now on (off by default: the launch path
    /// then reads no clock).
    pub fn set_launch_timing(&mut self, on: bool) {
        self.time_launches = on;
    }

    /// Kernel launches queued so far and the CPU time the driver's launch calls took, while
    /// launch timing was on.
    pub fn launch_stats(&self) -> (u64, std::time::Duration) {
        (
            self.launches.load(Ordering::Relaxed),
            std::time::Duration::from_nanos(self.launch_nanos.load(Ordering::Relaxed)),
        )
    }

    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.driver
    }

    pub fn device(&self) -> DeviceOrdinal {
        self.device
    }

    pub fn pool(&self) -> &Arc<DevicePool> {
        &self.pool
    }

    pub fn kernels(&self) -> &Arc<KernelLibrary> {
        &self.kernels
    }

    pub fn stream(&self) -> StreamHandle {
        self.stream
    }

    /// Chooses how the ops launched on this context round.
    pub fn set_numerics(&mut self, numerics: Numerics) {
        self.numerics = numerics;
    }

    /// How the ops launched on this context round.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    /// Sets the CPU thread count whose split-KV attention the reference numerics reproduce (the
    /// CPU cuts a long single-token attention into one chunk per thread, so the count shows in
    /// its digits); 0 counts as 1. Until set, 1.
    pub fn set_reference_threads(&mut self, threads: usize) {
        self.reference_threads = threads.max(1);
    }

    /// The CPU thread count the reference numerics reproduce.
    pub fn reference_threads(&self) -> usize {
        self.reference_threads
    }

    /// The largest attention head [`attention`] takes in this context's numerics.
    pub fn max_head_dim(&self) -> usize {
        match self.numerics {
            Numerics::Fast => MAX_HEAD_DIM,
            Numerics::Reference => EXACT_MAX_HEAD_DIM,
        }
    }

    /// Whether the ops run their bit-exact kernels.
    pub(crate) fn reference(&self) -> bool {
        self.numerics == Numerics::Reference
    }

    /// The architecture name kernels are selected by (`sm_90`, `gfx1201`).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// Lanes per warp (32 on NVIDIA, 32 or 64 on AMD).
    pub fn warp_size(&self) -> u32 {
        self.warp_size
    }

    /// Whether BLAS was loaded, and from where or why not.
    pub fn blas(&self) -> &BlasStatus {
        &self.blas_status
    }

    pub(crate) fn blas_handle(&self) -> Option<&Blas> {
        self.blas.as_ref()
    }

    /// Waits for everything queued on the context's stream.
    pub fn synchronize(&self) -> Result<(), OpsError> {
        self.outside_capture("synchronize", || {
            self.driver
                .stream_synchronize(self.device, self.stream)
                .map_err(|source| self.driver_error("synchronizing the ops stream", source))
        })
    }

    /// Allocates from the device's pool.
    pub fn alloc(&self, purpose: Purpose, bytes: u64) -> Result<PoolBuffer, OpsError> {
        Ok(self.pool.alloc(purpose, bytes)?)
    }

    /// Copies `bytes` to `dst` on the context's stream and returns once the copy is done, so the
    /// host memory may be reused at once.
    pub fn upload(&self, dst: DevicePtr, bytes: &[u8]) -> Result<(), OpsError> {
        if bytes.is_empty() {
            return Ok(());
        }
        self.outside_capture("upload", || {
            self.driver
                .upload(self.device, dst, bytes, self.stream)
                .map_err(|source| self.driver_error("uploading to the device", source))
        })
    }

    /// Waits for the stream, then copies `out.len()` bytes from `src` into `out`.
    pub fn download(&self, src: DevicePtr, out: &mut [u8]) -> Result<(), OpsError> {
        if out.is_empty() {
            return self.synchronize();
        }
        self.outside_capture("download", || {
            self.driver
                .download(self.device, out, src, self.stream)
                .map_err(|source| self.driver_error("downloading from the device", source))
        })
    }

    /// Queues a device-to-device copy of `bytes` bytes on the context's stream.
    pub fn copy(&self, dst: DevicePtr, src: DevicePtr, bytes: u64) -> Result<(), OpsError> {
        if bytes == 0 {
            return Ok(());
        }
        self.queued();
        self.driver
            .copy_dtod_async(self.device, dst, src, bytes, self.stream)
            .map_err(|source| self.driver_error("copying on the device", source))
    }

    /// Queues a copy of `bytes` bytes from `src` on `from`'s device to `dst` on this one, on
    /// this context's stream, without host staging ([`Driver::copy_peer_async`]; recorded like
    /// any queued op while the stream captures). The caller has made sure `from`'s work that
    /// wrote `src` is done.
    pub fn copy_from_peer(
        &self,
        dst: DevicePtr,
        from: &GpuContext,
        src: DevicePtr,
        bytes: u64,
    ) -> Result<(), OpsError> {
        if bytes == 0 {
            return Ok(());
        }
        self.queued();
        self.driver
            .copy_peer_async(self.device, dst, from.device, src, bytes, self.stream)
            .map_err(|source| self.driver_error("copying from a peer device", source))
    }

    /// Queues a fill of `bytes` bytes at `dst` with zeros on the context's stream.
    pub fn zero(&self, dst: DevicePtr, bytes: u64) -> Result<(), OpsError> {
        if bytes == 0 {
            return Ok(());
        }
        self.queued();
        self.driver
            .memset_d8_async(self.device, dst, 0, bytes, self.stream)
            .map_err(|source| self.driver_error("zeroing device memory", source))
    }

    fn driver_error(&self, operation: &str, source: DriverError) -> OpsError {
        OpsError::Driver {
            device: self.device,
            operation: operation.to_string(),
            source,
        }
    }

    /// Queues `name` of `module` with `args` on the context's stream.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every pointer in it must be valid for
    /// the accesses the kernel makes with `config`.
    pub(crate) unsafe fn launch(
        &self,
        module: KernelModule,
        name: &str,
        config: LaunchConfig,
        args: &KernelArgs,
    ) -> Result<(), OpsError> {
        let function = self.function(module, name)?;
        self.queued();
        let started = self.time_launches.then(std::time::Instant::now);
        // SAFETY: forwarded from this function's contract.
        let launched = unsafe {
            self.driver
                .launch(self.device, function, &config, self.stream, args)
        };
        if let Some(started) = started {
            self.launch_nanos
                .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            self.launches.fetch_add(1, Ordering::Relaxed);
        }
        launched.map_err(|source| self.driver_error(&format!("launching {name}"), source))
    }

    /// The handle of `name` of `module`, from the context's table once resolved.
    fn function(&self, module: KernelModule, name: &str) -> Result<FunctionHandle, OpsError> {
        let slot = self
            .functions
            .index
            .get(name)
            .and_then(|&i| self.functions.handles.get(i));
        if let Some(&handle) = slot.and_then(OnceLock::get) {
            return Ok(handle);
        }
        // First use (or a name no module exports, which the library reports in full).
        let handle = self
            .kernels
            .function(&*self.driver, self.device, module, name)?;
        if let Some(slot) = slot {
            let _ = slot.set(handle);
        }
        Ok(handle)
    }

    /// Starts recording the ops queued on the context's stream into a graph (see the module
    /// docs). Nothing queued until [`GpuContext::end_capture`] runs.
    pub fn begin_capture(&self) -> Result<(), OpsError> {
        if self.capturing.load(Ordering::Acquire) {
            return Err(OpsError::Unsupported {
                op: "begin_capture",
                what: "a second capture while one is in progress".into(),
            });
        }
        *self
            .capture_aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = None;
        self.pool.hold_idle_trim();
        if let Err(source) = self.driver.stream_begin_capture(self.device, self.stream) {
            self.pool.release_idle_trim();
            return Err(self.driver_error("beginning a graph capture", source));
        }
        self.captured_ops.store(0, Ordering::Release);
        self.capturing.store(true, Ordering::Release);
        Ok(())
    }

    /// Counts an op queued while capturing (see [`GpuContext::outside_capture`]).
    fn queued(&self) {
        if self.capturing.load(Ordering::Relaxed) {
            self.captured_ops.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Runs the synchronous `call` (`f`) while no capture records: a capture holding ops is
    /// aborted first (its ops are dropped, see [`GpuContext::end_capture`]); an empty one ends,
    /// `f` runs, and it begins again, so nothing is lost and the pass is still recorded whole.
    fn outside_capture<T>(
        &self,
        call: &str,
        f: impl FnOnce() -> Result<T, OpsError>,
    ) -> Result<T, OpsError> {
        if !self.capturing.load(Ordering::Acquire) {
            return f();
        }
        if self.captured_ops.load(Ordering::Acquire) > 0 {
            self.abort_capture(call);
            return f();
        }
        // An empty recording: end it, run the call, record again.
        let ended = self
            .driver
            .stream_end_capture(self.device, self.stream)
            .and_then(|graph| self.driver.graph_destroy(self.device, graph));
        if let Err(error) = ended {
            self.capturing.store(false, Ordering::Release);
            self.pool.release_idle_trim();
            self.set_abort_reason(format!(
                "{call} was called while capturing, and ending the empty capture failed: {error}"
            ));
            return f();
        }
        let result = f();
        if let Err(error) = self.driver.stream_begin_capture(self.device, self.stream) {
            self.capturing.store(false, Ordering::Release);
            self.pool.release_idle_trim();
            self.set_abort_reason(format!(
                "the capture could not begin again after {call}: {error}"
            ));
        }
        result
    }

    fn set_abort_reason(&self, reason: String) {
        *self
            .capture_aborted
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(reason);
    }

    /// Whether the context's stream is capturing.
    pub fn is_capturing(&self) -> bool {
        self.capturing.load(Ordering::Acquire)
    }

    /// Ends the capture and returns the recorded graph (the caller destroys it with
    /// [`GpuContext::destroy_graph`]). [`OpsError::CaptureAborted`] when a synchronous call ended
    /// it early; the ops recorded were then never run.
    pub fn end_capture(&self) -> Result<GraphHandle, OpsError> {
        if !self.capturing.swap(false, Ordering::AcqRel) {
            let reason = self
                .capture_aborted
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_else(|| "no capture was in progress".to_string());
            return Err(OpsError::CaptureAborted { reason });
        }
        self.pool.release_idle_trim();
        self.driver
            .stream_end_capture(self.device, self.stream)
            .map_err(|source| self.driver_error("ending a graph capture", source))
    }

    /// Ends a capture in progress because `call` must run now; the recorded work is dropped.
    fn abort_capture(&self, call: &str) {
        if !self.capturing.swap(false, Ordering::AcqRel) {
            return;
        }
        self.pool.release_idle_trim();
        let mut reason = format!("{call} was called while capturing");
        match self.driver.stream_end_capture(self.device, self.stream) {
            Ok(graph) => {
                if let Err(error) = self.driver.graph_destroy(self.device, graph) {
                    reason.push_str(&format!(" (destroying the partial graph failed: {error})"));
                }
            }
            Err(error) => reason.push_str(&format!(" (ending the capture failed: {error})")),
        }
        self.set_abort_reason(reason);
    }

    /// Makes a launchable graph of `graph`.
    pub fn instantiate_graph(&self, graph: GraphHandle) -> Result<GraphExecHandle, OpsError> {
        self.driver
            .graph_instantiate(self.device, graph)
            .map_err(|source| self.driver_error("instantiating a graph", source))
    }

    /// Updates `exec` to run `graph`; `Ok(false)` when the runtime refuses (instantiate instead).
    pub fn update_graph(
        &self,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, OpsError> {
        self.driver
            .graph_exec_update(self.device, exec, graph)
            .map_err(|source| self.driver_error("updating a graph", source))
    }

    /// Queues one run of `exec` on the context's stream.
    pub fn launch_graph(&self, exec: GraphExecHandle) -> Result<(), OpsError> {
        self.driver
            .graph_launch(self.device, exec, self.stream)
            .map_err(|source| self.driver_error("launching a graph", source))
    }

    pub fn destroy_graph(&self, graph: GraphHandle) -> Result<(), OpsError> {
        self.driver
            .graph_destroy(self.device, graph)
            .map_err(|source| self.driver_error("destroying a graph", source))
    }

    pub fn destroy_graph_exec(&self, exec: GraphExecHandle) -> Result<(), OpsError> {
        self.driver
            .graph_exec_destroy(self.device, exec)
            .map_err(|source| self.driver_error("destroying a graph exec", source))
    }
}

impl Drop for GpuContext {
    fn drop(&mut self) {
        // A capture left open (a caller that panicked mid-step) is ended so the stream can go.
        self.abort_capture("dropping the context");
        // BLAS is torn down first: its handle refers to the stream.
        self.blas = None;
        let result = self
            .driver
            .stream_synchronize(self.device, self.stream)
            .and_then(|()| self.driver.stream_destroy(self.device, self.stream));
        if let Err(error) = result {
            tracing::warn!(device = self.device, %error, "destroying the ops stream failed");
        }
    }
}

/// A count as the `u32` a kernel takes, or a shape error naming the op.
pub(crate) fn as_u32(op: &'static str, what: &str, value: usize) -> Result<u32, OpsError> {
    u32::try_from(value).map_err(|_| {
        OpsError::shape(
            op,
            format!("{what} below 2^32"),
            format!("{what} = {value}"),
        )
    })
}

/// Threads per block of the row-wise and element-wise kernels.
pub(crate) const BLOCK_THREADS: u32 = 256;

/// Largest grid.x of a grid-stride kernel: enough blocks to fill any current GPU many times over,
/// well under every runtime's limit (2^31 - 1).
pub(crate) const MAX_STRIDE_BLOCKS: u32 = 1 << 16;

/// The launch of a grid-stride kernel over `n` elements.
pub(crate) fn stride_launch(n: u32) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK_THREADS).clamp(1, MAX_STRIDE_BLOCKS);
    LaunchConfig::linear(blocks, BLOCK_THREADS)
}

#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) mod test_support {
    //! A context on the host driver for the ops' unit tests.

    use std::sync::Arc;

    use super::{GpuContext, GpuContextOptions};
    use crate::driver::Driver;
    use crate::host::{HostDriver, HostDriverConfig};
    use crate::kernels::{KernelLibrary, KERNEL_MODULES};
    use crate::pool::{DevicePool, PoolConfig, PoolKind};

    /// A context and the directory holding its stand-in code objects.
    pub(crate) struct Fixture {
        pub(crate) ctx: GpuContext,
        _dir: tempfile::TempDir,
    }

    /// A context on the host driver, with a code object file for every module (the host driver
    /// "contains" every registered kernel) and the Rust twins `register` adds to the driver.
    pub(crate) fn host_fixture(register: impl FnOnce(&HostDriver)) -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        for spec in KERNEL_MODULES {
            let path = dir.path().join("host").join(format!("{}.hsaco", spec.stem));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b"host code object").unwrap();
        }
        let driver = Arc::new(HostDriver::new(HostDriverConfig::default()));
        register(&driver);
        let dyn_driver: Arc<dyn Driver> = driver.clone();
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
        Fixture { ctx, _dir: dir }
    }
}

#[cfg(test)]
mod capture_tests {
    //! Graph capture through the context on the host driver: recorded ops run only when the
    //! graph is launched, and a synchronous call ends the capture instead of failing.

    use super::*;
    use crate::host::{HostDriver, HostDriverConfig};
    use crate::pool::{PoolConfig, PoolKind};

    fn context() -> (GpuContext, Arc<HostDriver>, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        for spec in KERNEL_MODULES {
            let path = dir.path().join("host").join(format!("{}.hsaco", spec.stem));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b"host code object").unwrap();
        }
        let driver = Arc::new(HostDriver::new(HostDriverConfig::default()));
        // ember_scale_f32(float* out, const float* x, float scale, uint32_t n)
        driver.register_kernel("ember_scale_f32", |launch| {
            let out = launch.ptr_arg(0)?;
            let x = launch.ptr_arg(1)?;
            let scale = launch.f32_arg(2)?;
            let n = launch.u32_arg(3)? as usize;
            let values: Vec<f32> = launch.read_f32(x, n)?.iter().map(|v| v * scale).collect();
            launch.write_f32(out, &values)
        });
        let dyn_driver: Arc<dyn Driver> = driver.clone();
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
        (ctx, driver, dir)
    }

    fn upload(ctx: &GpuContext, ptr: DevicePtr, values: &[f32]) {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        ctx.upload(ptr, &bytes).unwrap();
    }

    fn download(ctx: &GpuContext, ptr: DevicePtr, n: usize) -> Vec<f32> {
        let mut bytes = vec![0u8; n * 4];
        ctx.download(ptr, &mut bytes).unwrap();
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn captured_ops_run_when_the_graph_is_launched() {
        let (ctx, driver, _dir) = context();
        let buf = ctx.alloc(Purpose::Scratch, 16).unwrap();
        upload(&ctx, buf.ptr(), &[1.0, 2.0, 3.0, 4.0]);
        ctx.begin_capture().unwrap();
        assert!(ctx.is_capturing());
        scale(&ctx, buf.ptr(), buf.ptr(), 2.0, 4).unwrap();
        scale(&ctx, buf.ptr(), buf.ptr(), 3.0, 4).unwrap();
        let graph = ctx.end_capture().unwrap();
        assert!(!ctx.is_capturing());
        assert_eq!(download(&ctx, buf.ptr(), 4), [1.0, 2.0, 3.0, 4.0]);
        let exec = ctx.instantiate_graph(graph).unwrap();
        ctx.launch_graph(exec).unwrap();
        assert_eq!(download(&ctx, buf.ptr(), 4), [6.0, 12.0, 18.0, 24.0]);
        assert_eq!(driver.direct_launches(), 0);
        ctx.destroy_graph(graph).unwrap();
        ctx.destroy_graph_exec(exec).unwrap();
        // The handle was cached on first use and serves direct launches too.
        scale(&ctx, buf.ptr(), buf.ptr(), 0.5, 4).unwrap();
        assert_eq!(download(&ctx, buf.ptr(), 4), [3.0, 6.0, 9.0, 12.0]);
        assert_eq!(driver.direct_launches(), 1);
    }

    #[test]
    fn an_empty_capture_survives_a_synchronous_call() {
        // A split device's pass: the capture opens, the activations arrive by an upload before
        // any op of this device, then its ops are recorded. The whole pass is still one graph.
        let (ctx, driver, _dir) = context();
        let buf = ctx.alloc(Purpose::Scratch, 16).unwrap();
        upload(&ctx, buf.ptr(), &[9.0, 9.0, 9.0, 9.0]);
        ctx.begin_capture().unwrap();
        upload(&ctx, buf.ptr(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(ctx.is_capturing(), "the empty capture began again");
        ctx.synchronize().unwrap();
        assert!(ctx.is_capturing(), "and again");
        scale(&ctx, buf.ptr(), buf.ptr(), 2.0, 4).unwrap();
        let graph = ctx.end_capture().unwrap();
        assert_eq!(
            driver.direct_launches(),
            0,
            "the scale was recorded, not run"
        );
        assert_eq!(download(&ctx, buf.ptr(), 4), [1.0, 2.0, 3.0, 4.0]);
        let exec = ctx.instantiate_graph(graph).unwrap();
        ctx.launch_graph(exec).unwrap();
        assert_eq!(download(&ctx, buf.ptr(), 4), [2.0, 4.0, 6.0, 8.0]);
        ctx.destroy_graph(graph).unwrap();
        ctx.destroy_graph_exec(exec).unwrap();
    }

    #[test]
    fn a_synchronous_call_aborts_the_capture_and_runs() {
        let (ctx, _driver, _dir) = context();
        let buf = ctx.alloc(Purpose::Scratch, 16).unwrap();
        ctx.begin_capture().unwrap();
        scale(&ctx, buf.ptr(), buf.ptr(), 2.0, 4).unwrap();
        upload(&ctx, buf.ptr(), &[1.0, 1.0, 1.0, 1.0]);
        assert!(!ctx.is_capturing(), "the upload ended the capture");
        // Later ops run directly.
        scale(&ctx, buf.ptr(), buf.ptr(), 5.0, 4).unwrap();
        let error = ctx.end_capture().unwrap_err();
        match &error {
            OpsError::CaptureAborted { reason } => {
                assert!(reason.contains("upload"), "{reason}")
            }
            other => panic!("expected an aborted capture, found {other:?}"),
        }
        assert_eq!(
            download(&ctx, buf.ptr(), 4),
            [5.0; 4],
            "the recorded scale by 2 never ran"
        );
        // A new capture starts clean.
        ctx.begin_capture().unwrap();
        let graph = ctx.end_capture().unwrap();
        ctx.destroy_graph(graph).unwrap();
    }

    #[test]
    fn every_get_rows_kernel_name_is_exported() {
        let spec = KernelModule::Embedding.spec();
        for format in WeightFormat::ALL {
            let name = elementwise::get_rows_kernel(format);
            assert!(spec.functions.contains(&name), "{name}");
            assert_eq!(name, format!("ember_get_rows_{}", format.kernel_suffix()));
        }
    }
}
