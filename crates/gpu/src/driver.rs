//! The GPU driver interface: everything the engine asks of a GPU runtime, as one trait.
//!
//! The GPU backend is written once over [`Driver`]; `hip` (libamdhip64, loaded at run time),
//! `cuda` (cudarc's driver API, loaded at run time) and `host` (the OS's own virtual memory and
//! Rust closures as kernels, for tests) implement it. Handles are plain numbers so they can be
//! stored and compared without lifetimes; ownership lives in the pools and caches above.
//!
//! Every call returns a [`DriverError`] instead of aborting: a failing runtime must never take the
//! process down, because the engine can still fall back (to the caching pool, to the CPU).

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

/// The ordinal of a device within one driver (0-based, as the runtime numbers them).
pub type DeviceOrdinal = usize;

/// A device virtual address (or, for the host driver, a process address).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The null device pointer.
    pub const NULL: DevicePtr = DevicePtr(0);

    /// This pointer advanced by `bytes`.
    pub fn offset(self, bytes: u64) -> DevicePtr {
        DevicePtr(self.0 + bytes)
    }
}

impl fmt::Display for DevicePtr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

macro_rules! handle {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);
    };
}

handle!(
    /// A stream (an in-order queue of device work). `StreamHandle(0)` is the runtime's default stream.
    StreamHandle
);
handle!(
    /// An event recorded on a stream.
    EventHandle
);
handle!(
    /// A loaded code object.
    ModuleHandle
);
handle!(
    /// A kernel function inside a loaded module.
    FunctionHandle
);
handle!(
    /// A physical memory allocation for the virtual memory API (`hipMemCreate`/`cuMemCreate`).
    PhysicalHandle
);
handle!(
    /// A graph of device work recorded by stream capture (`hipGraph_t`/`CUgraph`).
    GraphHandle
);
handle!(
    /// An instantiated, launchable graph (`hipGraphExec_t`/`CUgraphExec`).
    GraphExecHandle
);

impl StreamHandle {
    /// The runtime's default (null) stream.
    pub const DEFAULT: StreamHandle = StreamHandle(0);
}

/// Which runtime a driver talks to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// AMD ROCm through libamdhip64.
    Hip,
    /// NVIDIA through the CUDA driver API.
    Cuda,
    /// The host implementation used by tests.
    Host,
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Hip => "hip",
            Backend::Cuda => "cuda",
            Backend::Host => "host",
        })
    }
}

/// Static facts about a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: DeviceOrdinal,
    pub name: String,
    /// Normalised architecture name that selects code objects: `gfx1201`, `sm_90`.
    pub arch: String,
    /// The architecture string exactly as the runtime reported it (`gfx1201:sramecc-:xnack-`).
    pub arch_raw: String,
    pub total_memory: u64,
    pub warp_size: u32,
    pub multiprocessor_count: u32,
    /// The runtime reports virtual memory management support (reserve/map/set access).
    pub vmm_supported: bool,
    /// An integrated GPU (APU) that shares system memory: weights in "host" memory are expected there.
    pub integrated: bool,
}

/// Free and total device memory as the runtime reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemInfo {
    pub free: u64,
    pub total: u64,
}

/// Where a pointer's memory lives, from the runtime's pointer attributes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryType {
    /// Device memory (VRAM on a discrete GPU).
    Device,
    /// Pinned or registered host memory.
    Host,
    /// Managed (unified) memory that migrates on demand.
    Managed,
    /// Memory the runtime does not know about (plain pageable host memory).
    Unregistered,
    /// A value this crate does not know how to interpret.
    Unknown(u32),
}

impl fmt::Display for MemoryType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryType::Device => f.write_str("device"),
            MemoryType::Host => f.write_str("host"),
            MemoryType::Managed => f.write_str("managed"),
            MemoryType::Unregistered => f.write_str("unregistered host"),
            MemoryType::Unknown(value) => write!(f, "unknown memory type {value}"),
        }
    }
}

/// Pointer attributes: used by the placement check.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PointerInfo {
    pub memory_type: MemoryType,
    /// The device the memory belongs to, when the runtime says.
    pub device: Option<DeviceOrdinal>,
}

/// Grid, block and dynamic shared memory of a kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A one-dimensional launch.
    pub fn linear(grid_x: u32, block_x: u32) -> LaunchConfig {
        LaunchConfig {
            grid: [grid_x, 1, 1],
            block: [block_x, 1, 1],
            shared_mem_bytes: 0,
        }
    }
}

/// One kernel argument. Every kernel in `kernels/` takes only pointers and scalars.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KernelArg {
    Ptr(DevicePtr),
    U32(u32),
    I32(i32),
    F32(f32),
    U64(u64),
}

/// Kernel arguments in declaration order, stored so that runtimes can be handed a `void**`.
#[derive(Clone, Debug, Default)]
pub struct KernelArgs {
    args: Vec<KernelArg>,
    /// One 8-byte slot per argument; scalars narrower than 8 bytes sit in the low bytes, which is
    /// where a little-endian kernel reads them.
    slots: Vec<u64>,
}

impl KernelArgs {
    pub fn new() -> KernelArgs {
        KernelArgs::default()
    }

    /// Appends an argument (builder style).
    pub fn arg(mut self, arg: KernelArg) -> KernelArgs {
        self.push(arg);
        self
    }

    pub fn push(&mut self, arg: KernelArg) {
        let slot = match arg {
            KernelArg::Ptr(ptr) => ptr.0,
            KernelArg::U32(v) => u64::from(v),
            KernelArg::I32(v) => u64::from(v as u32),
            KernelArg::F32(v) => u64::from(v.to_bits()),
            KernelArg::U64(v) => v,
        };
        self.args.push(arg);
        self.slots.push(slot);
    }

    pub fn args(&self) -> &[KernelArg] {
        &self.args
    }

    pub fn len(&self) -> usize {
        self.args.len()
    }

    pub fn is_empty(&self) -> bool {
        self.args.is_empty()
    }

    /// Pointers to each argument's slot, as `hipModuleLaunchKernel`/`cuLaunchKernel` expect.
    /// The pointers stay valid while `self` is borrowed and not modified.
    pub fn slot_pointers(&mut self) -> Vec<*mut std::ffi::c_void> {
        self.slots
            .iter_mut()
            .map(|slot| slot as *mut u64 as *mut std::ffi::c_void)
            .collect()
    }

    /// Calls `f` with the `void**` array of argument pointers that `hipModuleLaunchKernel` and
    /// `cuLaunchKernel` take, built on the stack (no allocation on the launch path). Kernels in
    /// `kernels/` take at most [`KernelArgs::MAX_INLINE`] arguments; longer lists fall back to a
    /// heap array. The runtimes only read through the pointers.
    pub fn with_slot_pointers<R>(&self, f: impl FnOnce(*mut *mut std::ffi::c_void) -> R) -> R {
        let slots = self.slots.as_ptr();
        if self.slots.len() <= Self::MAX_INLINE {
            let mut pointers = [std::ptr::null_mut::<std::ffi::c_void>(); Self::MAX_INLINE];
            for (i, pointer) in pointers.iter_mut().take(self.slots.len()).enumerate() {
                // SAFETY: `i` is below the slot count, so the offset stays inside the vector.
                *pointer = unsafe { slots.add(i) } as *mut std::ffi::c_void;
            }
            f(pointers.as_mut_ptr())
        } else {
            let mut pointers: Vec<*mut std::ffi::c_void> = (0..self.slots.len())
                // SAFETY: as above.
                .map(|i| unsafe { slots.add(i) } as *mut std::ffi::c_void)
                .collect();
            f(pointers.as_mut_ptr())
        }
    }

    /// Arguments [`KernelArgs::with_slot_pointers`] handles without allocating.
    pub const MAX_INLINE: usize = 24;
}

/// One place a runtime library was looked for, and what happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LibraryAttempt {
    /// A full path, or a bare name handed to the system loader.
    pub candidate: String,
    pub outcome: AttemptOutcome,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AttemptOutcome {
    /// The file does not exist (full paths only).
    Absent,
    /// The loader refused it (missing file for bare names, wrong architecture, missing dependency).
    LoadFailed(String),
    Loaded,
}

impl fmt::Display for LibraryAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.outcome {
            AttemptOutcome::Absent => write!(f, "{} (absent)", self.candidate),
            AttemptOutcome::LoadFailed(reason) => {
                write!(f, "{} (load failed: {reason})", self.candidate)
            }
            AttemptOutcome::Loaded => write!(f, "{} (loaded)", self.candidate),
        }
    }
}

/// Which runtime library a driver loaded, from where, and what else was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeInfo {
    pub backend: Backend,
    /// The file that was loaded, resolved to a path when the loader can say.
    pub library: Option<PathBuf>,
    pub attempts: Vec<LibraryAttempt>,
    /// Other copies of the runtime present on this host (several ROCm installs cause trouble).
    pub other_installs: Vec<PathBuf>,
    pub driver_version: Option<i32>,
    pub runtime_version: Option<i32>,
}

impl fmt::Display for RuntimeInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.backend)?;
        match &self.library {
            Some(path) => write!(f, "loaded {}", path.display())?,
            None => write!(f, "no library loaded")?,
        }
        if let Some(version) = self.runtime_version {
            write!(f, ", runtime version {version}")?;
        }
        if let Some(version) = self.driver_version {
            write!(f, ", driver version {version}")?;
        }
        if !self.other_installs.is_empty() {
            let others: Vec<String> = self
                .other_installs
                .iter()
                .map(|p| p.display().to_string())
                .collect();
            write!(f, "; other installs found: {}", others.join(", "))?;
        }
        Ok(())
    }
}

/// Joins library attempts for error messages.
pub fn describe_attempts(attempts: &[LibraryAttempt]) -> String {
    if attempts.is_empty() {
        return "nothing".to_string();
    }
    attempts
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// A failed driver call. Never a panic: callers fall back or report.
#[derive(Debug, Error, Clone, PartialEq)]
pub enum DriverError {
    #[error("no {runtime} runtime library could be loaded; tried: {}; {hint}", describe_attempts(.attempts))]
    LibraryNotFound {
        runtime: &'static str,
        attempts: Vec<LibraryAttempt>,
        hint: String,
    },
    #[error("{runtime} library {library} lacks the symbol {symbol}: {reason}")]
    MissingSymbol {
        runtime: &'static str,
        library: String,
        symbol: &'static str,
        reason: String,
    },
    #[error("{call} failed with {code} ({name})")]
    Call {
        call: &'static str,
        code: i64,
        name: String,
    },
    #[error("{call} ran out of device memory asking for {bytes} bytes")]
    OutOfMemory { call: &'static str, bytes: u64 },
    #[error("device {device} does not exist: the runtime reports {count} device(s)")]
    NoSuchDevice { device: DeviceOrdinal, count: usize },
    #[error("invalid argument to {call}: {reason}")]
    InvalidArgument { call: &'static str, reason: String },
    #[error("{backend} driver does not support {what}")]
    Unsupported { backend: Backend, what: String },
    #[error("kernel {name} failed: {reason}")]
    KernelFailed { name: String, reason: String },
    #[error("the {runtime} runtime panicked in {call}: {message}")]
    RuntimePanicked {
        runtime: &'static str,
        call: &'static str,
        message: String,
    },
}

impl DriverError {
    /// Whether this error means "not enough device memory" (callers trim caches and retry).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, DriverError::OutOfMemory { .. })
    }
}

/// The operations the engine needs from a GPU runtime.
///
/// Every method that touches a device takes its ordinal, so implementations can make the right
/// device current (HIP's `hipSetDevice`, CUDA's context) without hidden thread state.
pub trait Driver: Send + Sync + fmt::Debug {
    fn backend(&self) -> Backend;
    fn runtime_info(&self) -> RuntimeInfo;
    fn device_count(&self) -> Result<usize, DriverError>;
    fn device_info(&self, device: DeviceOrdinal) -> Result<DeviceInfo, DriverError>;
    fn mem_info(&self, device: DeviceOrdinal) -> Result<MemInfo, DriverError>;

    /// Plain device allocation (`hipMalloc`/`cuMemAlloc`).
    fn alloc(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError>;
    fn free(&self, device: DeviceOrdinal, ptr: DevicePtr) -> Result<(), DriverError>;

    /// Queues a host-to-device copy.
    ///
    /// # Safety
    /// `src` must be valid for reads of `bytes` bytes until the stream has been synchronised.
    unsafe fn copy_htod_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    /// Queues a device-to-host copy.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `bytes` bytes, and not otherwise accessed, until the
    /// stream has been synchronised.
    unsafe fn copy_dtoh_async(
        &self,
        device: DeviceOrdinal,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    fn copy_dtod_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    fn memset_d8_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    fn memset_d32_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        value: u32,
        count: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;

    fn stream_create(&self, device: DeviceOrdinal) -> Result<StreamHandle, DriverError>;
    fn stream_destroy(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    fn event_create(&self, device: DeviceOrdinal) -> Result<EventHandle, DriverError>;
    fn event_destroy(&self, device: DeviceOrdinal, event: EventHandle) -> Result<(), DriverError>;
    fn event_record(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError>;
    fn event_synchronize(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
    ) -> Result<(), DriverError>;
    /// Whether all work before the event has completed.
    fn event_query(&self, device: DeviceOrdinal, event: EventHandle) -> Result<bool, DriverError>;
    fn event_elapsed_ms(
        &self,
        device: DeviceOrdinal,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError>;
    /// Waits for all work on the device.
    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DriverError>;

    /// Loads a code object (`.hsaco`, `.cubin` or `.ptx` bytes).
    fn module_load(&self, device: DeviceOrdinal, image: &[u8])
        -> Result<ModuleHandle, DriverError>;
    fn module_unload(&self, device: DeviceOrdinal, module: ModuleHandle)
        -> Result<(), DriverError>;
    fn module_function(
        &self,
        device: DeviceOrdinal,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError>;

    /// Queues a kernel launch.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list, and every pointer argument must be valid
    /// device memory for the accesses the kernel makes with this configuration.
    unsafe fn launch(
        &self,
        device: DeviceOrdinal,
        function: FunctionHandle,
        config: &LaunchConfig,
        stream: StreamHandle,
        args: &KernelArgs,
    ) -> Result<(), DriverError>;

    /// Where `ptr` lives, according to the runtime.
    fn pointer_info(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
    ) -> Result<PointerInfo, DriverError>;

    /// The physical allocation granularity for the virtual memory API.
    fn vmm_granularity(&self, device: DeviceOrdinal) -> Result<u64, DriverError>;
    /// Reserves `bytes` of virtual address space (no memory behind it).
    fn vmm_reserve(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError>;
    /// Returns a reservation made by [`Driver::vmm_reserve`]; everything in it must be unmapped.
    fn vmm_free_reserved(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError>;
    /// Creates a physical allocation of `bytes` (a multiple of the granularity).
    fn vmm_create(&self, device: DeviceOrdinal, bytes: u64) -> Result<PhysicalHandle, DriverError>;
    /// Releases a physical allocation; its memory returns once it is also unmapped.
    fn vmm_release(&self, device: DeviceOrdinal, handle: PhysicalHandle)
        -> Result<(), DriverError>;
    /// Maps a whole physical allocation at `ptr`. The range is not accessible until
    /// [`Driver::vmm_set_access`].
    fn vmm_map(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
        handle: PhysicalHandle,
    ) -> Result<(), DriverError>;
    /// Grants the device read/write access to a mapped range.
    fn vmm_set_access(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError>;
    fn vmm_unmap(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError>;

    /// Starts recording the work queued on `stream` into a graph instead of running it.
    ///
    /// The capture is in relaxed mode, so allocations, pool growth and other calls that do not
    /// touch the stream keep working meanwhile; a call that waits on the stream (a synchronous
    /// copy, a synchronisation) invalidates the capture, which [`Driver::stream_end_capture`]
    /// then reports. Drivers without graphs return [`DriverError::Unsupported`].
    fn stream_begin_capture(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _ = (device, stream);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "graphs (stream capture)".into(),
        })
    }

    /// Ends a capture started by [`Driver::stream_begin_capture`] and returns the recorded graph.
    /// Fails when the capture was invalidated; the stream is no longer capturing either way.
    fn stream_end_capture(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError> {
        let _ = (device, stream);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "graphs (stream capture)".into(),
        })
    }

    /// Makes a launchable graph of `graph` (which stays owned by the caller).
    fn graph_instantiate(
        &self,
        device: DeviceOrdinal,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, DriverError> {
        let _ = (device, graph);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "graphs (instantiate)".into(),
        })
    }

    /// Updates `exec` in place to run `graph` (same topology, other parameters). `Ok(false)`
    /// when the runtime refuses the update (the topology or a kernel changed): the caller
    /// instantiates `graph` instead, and `exec` is left as it was.
    fn graph_exec_update(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError> {
        let _ = (device, exec, graph);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "graphs (update)".into(),
        })
    }

    /// Queues one run of `exec` on `stream`.
    fn graph_launch(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _ = (device, exec, stream);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "graphs (launch)".into(),
        })
    }

    fn graph_destroy(&self, device: DeviceOrdinal, graph: GraphHandle) -> Result<(), DriverError> {
        let _ = (device, graph);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "graphs (destroy)".into(),
        })
    }

    /// Destroys an instantiated graph; runs already queued complete first (the runtimes defer
    /// the release).
    fn graph_exec_destroy(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError> {
        let _ = (device, exec);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "graphs (destroy)".into(),
        })
    }

    /// Whether `device` can read and write memory of `peer` directly
    /// (`cuDeviceCanAccessPeer`/`hipDeviceCanAccessPeer`). A device always reaches its own
    /// memory, so `device == peer` is true (a split over one GPU named twice).
    fn can_access_peer(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        let _ = (device, peer);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "peer access".into(),
        })
    }

    /// Lets `device` access `peer`'s memory (`cuCtxEnablePeerAccess`/
    /// `hipDeviceEnablePeerAccess`); access already enabled is success, and so is
    /// `device == peer`.
    fn enable_peer_access(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        let _ = (device, peer);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "peer access".into(),
        })
    }

    /// Queues a copy of `bytes` bytes from `src` on `src_device` to `dst` on `dst_device`, on
    /// `stream` (a stream of `dst_device`), without host staging (`cuMemcpyPeerAsync`/
    /// `hipMemcpyPeerAsync`); with `src_device == dst_device`, a device-to-device copy. Like
    /// every stream op it is recorded, not run, while `stream` captures a graph. The caller
    /// makes sure the work that wrote `src` has finished.
    #[allow(clippy::too_many_arguments)]
    fn copy_peer_async(
        &self,
        dst_device: DeviceOrdinal,
        dst: DevicePtr,
        src_device: DeviceOrdinal,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let _ = (dst_device, dst, src_device, src, bytes, stream);
        Err(DriverError::Unsupported {
            backend: self.backend(),
            what: "peer copies".into(),
        })
    }

    /// Copies `src` to device memory and waits for the copy to finish.
    fn upload(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: &[u8],
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        // SAFETY: `src` is borrowed for the whole call, and the stream is synchronised before
        // returning, so the copy never reads it after the borrow ends.
        unsafe { self.copy_htod_async(device, dst, src.as_ptr(), src.len() as u64, stream)? };
        self.stream_synchronize(device, stream)
    }

    /// Copies device memory into `dst` and waits for the copy to finish.
    fn download(
        &self,
        device: DeviceOrdinal,
        dst: &mut [u8],
        src: DevicePtr,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        // SAFETY: `dst` is mutably borrowed for the whole call, and the stream is synchronised
        // before returning, so the copy never writes it after the borrow ends.
        unsafe { self.copy_dtoh_async(device, dst.as_mut_ptr(), src, dst.len() as u64, stream)? };
        self.stream_synchronize(device, stream)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_args_store_scalars_in_low_bytes() {
        let mut args = KernelArgs::new()
            .arg(KernelArg::Ptr(DevicePtr(0x1234_5678_9abc)))
            .arg(KernelArg::U32(7))
            .arg(KernelArg::I32(-2))
            .arg(KernelArg::F32(1.5));
        let pointers = args.slot_pointers();
        assert_eq!(pointers.len(), 4);
        // SAFETY: each pointer points at a live u64 slot of `args`, which is not modified here.
        let read_u32 = |i: usize| unsafe { *(pointers[i] as *const u32) };
        assert_eq!(read_u32(1), 7);
        assert_eq!(read_u32(2) as i32, -2);
        assert_eq!(f32::from_bits(read_u32(3)), 1.5);
        // SAFETY: as above.
        assert_eq!(unsafe { *(pointers[0] as *const u64) }, 0x1234_5678_9abc);
    }

    #[test]
    fn library_not_found_lists_every_attempt() {
        let error = DriverError::LibraryNotFound {
            runtime: "HIP",
            attempts: vec![
                LibraryAttempt {
                    candidate: "/opt/rocm/lib/libamdhip64.so.7".into(),
                    outcome: AttemptOutcome::Absent,
                },
                LibraryAttempt {
                    candidate: "libamdhip64.so.6".into(),
                    outcome: AttemptOutcome::LoadFailed("cannot open shared object file".into()),
                },
            ],
            hint: "install ROCm".into(),
        };
        let text = error.to_string();
        assert!(
            text.contains("/opt/rocm/lib/libamdhip64.so.7 (absent)"),
            "{text}"
        );
        assert!(
            text.contains("libamdhip64.so.6 (load failed: cannot open shared object file)"),
            "{text}"
        );
        assert!(text.ends_with("install ROCm"), "{text}");
    }
}
