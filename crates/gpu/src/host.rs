//! A host implementation of [`Driver`]: real memory from the OS, kernels as Rust closures.
//!
//! It exists so the pool, probe and placement logic can be tested for real on a machine with no
//! GPU. Virtual memory behaves like the GPU runtimes' VMM API: a reservation is an
//! `mmap(PROT_NONE)` range, mapping records which physical allocation backs a sub-range (still
//! inaccessible, as on a GPU), setting access is `mprotect(PROT_READ|PROT_WRITE)`, and unmapping is
//! `madvise(MADV_DONTNEED)` + `mprotect(PROT_NONE)`, which hands the pages back to the OS. So a
//! trimmed pool measurably lowers the process's resident memory.
//!
//! Every access made through the driver (copies, memsets, kernels) is checked against what is
//! allocated and accessible, so a pool bug shows up as an error rather than a segfault. Work runs
//! synchronously; streams and events exist so call sequences match the GPU drivers'.
//!
//! Graphs: while a stream captures, launches, device copies and memsets queued on it are recorded
//! instead of run, and a launched graph replays them in order, so the engine's capture and replay
//! logic runs for real here. A synchronisation or a host copy on a capturing stream invalidates
//! the capture, as on a GPU. [`HostDriver::fail_graphs`] makes every capture fail, to test the
//! fallbacks.
//!
//! Peer copies: each host driver is one device, so drivers standing for several GPUs are made
//! peers of each other with [`HostDriver::connect_peers`]; a peer copy then reads the source
//! driver's memory (checked there) and writes this one's, and is recorded like any stream op
//! while the stream captures. [`HostDriverConfig::corrupt_peer_from`] makes the copies from
//! chosen devices arrive changed, as a broken copy engine's do, to exercise the start-up
//! self-test and its fallback to host staging.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, Weak};
use std::time::Instant;

use crate::driver::{
    Backend, DeviceInfo, DeviceOrdinal, DevicePtr, Driver, DriverError, EventHandle,
    FunctionHandle, GraphExecHandle, GraphHandle, KernelArg, KernelArgs, LaunchConfig, MemInfo,
    MemoryType, ModuleHandle, PhysicalHandle, PointerInfo, RuntimeInfo, StreamHandle,
};

/// A virtual-memory step the host driver can be told to fail, to test fallbacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostVmmFailure {
    Reserve,
    Create,
    Map,
    SetAccess,
}

/// How the host device presents itself.
#[derive(Clone, Debug)]
pub struct HostDriverConfig {
    pub device_name: String,
    /// The ordinal the device answers to (0 by default). A simulated device `sim:N`, one of
    /// several on a host, is ordinal N, so the pool's and the placement check's messages name
    /// it as the engine does; other ordinals are no such device.
    pub ordinal: DeviceOrdinal,
    pub arch: String,
    /// The memory the device pretends to have; allocations beyond it fail with out-of-memory.
    pub total_memory: u64,
    /// VMM granularity; a multiple of the OS page size.
    pub granularity: u64,
    pub vmm_supported: bool,
    pub fail_vmm: Option<HostVmmFailure>,
    /// What pointer attributes report for this driver's allocations (`Host` simulates a runtime
    /// that fell back to system memory).
    pub reported_memory_type: MemoryType,
    /// Simulates a runtime whose free-memory figure does not move when memory is allocated.
    pub free_memory_frozen: bool,
    pub integrated: bool,
    /// Peer copies from these devices into this one arrive corrupted
    /// ([`crate::peer::corrupt`]): a broken peer path, for tests of the start-up self-test.
    pub corrupt_peer_from: Vec<DeviceOrdinal>,
}

impl Default for HostDriverConfig {
    fn default() -> Self {
        HostDriverConfig {
            device_name: "ember host device".to_string(),
            ordinal: 0,
            arch: "host".to_string(),
            total_memory: 1 << 30,
            granularity: 2 << 20,
            vmm_supported: true,
            fail_vmm: None,
            reported_memory_type: MemoryType::Device,
            free_memory_frozen: false,
            integrated: false,
            corrupt_peer_from: Vec::new(),
        }
    }
}

/// A kernel of the host driver.
pub type HostKernel = Arc<dyn Fn(&HostLaunch<'_>) -> Result<(), String> + Send + Sync>;

/// What a host kernel sees: its launch configuration, its arguments, and checked memory access.
pub struct HostLaunch<'a> {
    driver: &'a HostDriver,
    config: LaunchConfig,
    args: &'a KernelArgs,
}

impl HostLaunch<'_> {
    pub fn config(&self) -> &LaunchConfig {
        &self.config
    }

    pub fn args(&self) -> &[KernelArg] {
        self.args.args()
    }

    pub fn ptr_arg(&self, index: usize) -> Result<DevicePtr, String> {
        match self.args().get(index) {
            Some(KernelArg::Ptr(ptr)) => Ok(*ptr),
            other => Err(format!(
                "argument {index}: expected a pointer, found {other:?}"
            )),
        }
    }

    pub fn u32_arg(&self, index: usize) -> Result<u32, String> {
        match self.args().get(index) {
            Some(KernelArg::U32(v)) => Ok(*v),
            other => Err(format!("argument {index}: expected a u32, found {other:?}")),
        }
    }

    pub fn f32_arg(&self, index: usize) -> Result<f32, String> {
        match self.args().get(index) {
            Some(KernelArg::F32(v)) => Ok(*v),
            other => Err(format!(
                "argument {index}: expected an f32, found {other:?}"
            )),
        }
    }

    /// Reads device memory (checked).
    pub fn read(&self, src: DevicePtr, dst: &mut [u8]) -> Result<(), String> {
        let state = self.driver.lock();
        state
            .check_accessible(src, dst.len() as u64)
            .map_err(|e| e.to_string())?;
        // SAFETY: the range was just checked to be allocated and readable, and the state lock
        // keeps it mapped for the duration of the copy.
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Writes device memory (checked).
    pub fn write(&self, dst: DevicePtr, src: &[u8]) -> Result<(), String> {
        let state = self.driver.lock();
        state
            .check_accessible(dst, src.len() as u64)
            .map_err(|e| e.to_string())?;
        // SAFETY: the range was just checked to be allocated and writable, and the state lock
        // keeps it mapped for the duration of the copy.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0 as *mut u8, src.len()) };
        Ok(())
    }

    pub fn read_f32(&self, src: DevicePtr, count: usize) -> Result<Vec<f32>, String> {
        let mut bytes = vec![0u8; count * 4];
        self.read(src, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub fn write_f32(&self, dst: DevicePtr, values: &[f32]) -> Result<(), String> {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.write(dst, &bytes)
    }
}

#[derive(Debug)]
struct Physical {
    bytes: u64,
    mapped_at: Option<u64>,
    released: bool,
}

#[derive(Debug)]
struct Mapping {
    bytes: u64,
    handle: u64,
    accessible: bool,
}

/// One piece of stream work recorded into a host graph.
#[derive(Clone, Debug)]
enum HostOp {
    Launch {
        function: FunctionHandle,
        config: LaunchConfig,
        args: KernelArgs,
    },
    CopyDtoD {
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
    },
    MemsetD8 {
        dst: DevicePtr,
        value: u8,
        bytes: u64,
    },
    MemsetD32 {
        dst: DevicePtr,
        value: u32,
        count: u64,
    },
    /// A copy from another host driver's device (see [`HostDriver::connect_peers`]).
    CopyPeer {
        dst: DevicePtr,
        src_device: DeviceOrdinal,
        src: DevicePtr,
        bytes: u64,
    },
}

impl HostOp {
    /// Whether an exec holding `self` can be updated to `other` (same kind, same kernel), as the
    /// GPU runtimes allow.
    fn same_shape(&self, other: &HostOp) -> bool {
        match (self, other) {
            (HostOp::Launch { function: a, .. }, HostOp::Launch { function: b, .. }) => a == b,
            (HostOp::CopyDtoD { .. }, HostOp::CopyDtoD { .. })
            | (HostOp::CopyPeer { .. }, HostOp::CopyPeer { .. })
            | (HostOp::MemsetD8 { .. }, HostOp::MemsetD8 { .. })
            | (HostOp::MemsetD32 { .. }, HostOp::MemsetD32 { .. }) => true,
            _ => false,
        }
    }
}

/// A stream being captured: the work recorded so far, or why the capture is invalid.
#[derive(Debug, Default)]
struct Capture {
    ops: Vec<HostOp>,
    invalidated: Option<String>,
}

#[derive(Debug, Default)]
struct HostState {
    /// Streams being captured.
    captures: HashMap<u64, Capture>,
    graphs: HashMap<u64, Arc<Vec<HostOp>>>,
    execs: HashMap<u64, Arc<Vec<HostOp>>>,
    /// Plain allocations: address -> length (each its own RW anonymous mapping).
    blocks: BTreeMap<u64, u64>,
    reservations: BTreeMap<u64, u64>,
    physical: HashMap<u64, Physical>,
    mappings: BTreeMap<u64, Mapping>,
    modules: HashMap<u64, ()>,
    functions: HashMap<u64, String>,
    streams: HashMap<u64, ()>,
    events: HashMap<u64, Option<Instant>>,
    next_handle: u64,
    used_bytes: u64,
}

impl HostState {
    fn handle(&mut self) -> u64 {
        self.next_handle += 1;
        self.next_handle
    }

    /// Checks that `[ptr, ptr+len)` lies in one plain allocation or in contiguous accessible mappings.
    fn check_accessible(&self, ptr: DevicePtr, len: u64) -> Result<(), DriverError> {
        if len == 0 {
            return Ok(());
        }
        let start = ptr.0;
        let end = start
            .checked_add(len)
            .ok_or_else(|| invalid("access", format!("range at {ptr} of {len} bytes overflows")))?;
        if let Some((&addr, &bytes)) = self.blocks.range(..=start).next_back() {
            if end <= addr + bytes {
                return Ok(());
            }
            if start < addr + bytes {
                return Err(invalid("access", format!("{len} bytes at {ptr} run past the allocation at {addr:#x} of {bytes} bytes")));
            }
        }
        let mut cursor = start;
        let first = self.mappings.range(..=start).next_back();
        let Some((&addr, mapping)) = first else {
            return Err(invalid(
                "access",
                format!("{ptr} is not device memory of this driver"),
            ));
        };
        if start >= addr + mapping.bytes {
            return Err(invalid(
                "access",
                format!("{ptr} is not device memory of this driver"),
            ));
        }
        for (&addr, mapping) in self.mappings.range(addr..) {
            if addr > cursor {
                return Err(invalid(
                    "access",
                    format!(
                        "{:#x} is not mapped (access of {len} bytes at {ptr})",
                        cursor
                    ),
                ));
            }
            if !mapping.accessible {
                return Err(invalid("access", format!("{addr:#x} is mapped but access was never set (access of {len} bytes at {ptr})")));
            }
            cursor = addr + mapping.bytes;
            if cursor >= end {
                return Ok(());
            }
        }
        Err(invalid(
            "access",
            format!("{cursor:#x} is not mapped (access of {len} bytes at {ptr})"),
        ))
    }

    fn owns(&self, ptr: DevicePtr) -> bool {
        let in_block = self
            .blocks
            .range(..=ptr.0)
            .next_back()
            .is_some_and(|(&a, &b)| ptr.0 < a + b);
        let in_mapping = self
            .mappings
            .range(..=ptr.0)
            .next_back()
            .is_some_and(|(&a, m)| ptr.0 < a + m.bytes);
        in_block || in_mapping
    }
}

fn invalid(call: &'static str, reason: String) -> DriverError {
    DriverError::InvalidArgument { call, reason }
}

fn injected(call: &'static str) -> DriverError {
    DriverError::Call {
        call,
        code: 1,
        name: "failure injected by the host driver's configuration".to_string(),
    }
}

fn os_error(call: &'static str) -> DriverError {
    let error = std::io::Error::last_os_error();
    DriverError::Call {
        call,
        code: i64::from(error.raw_os_error().unwrap_or(-1)),
        name: error.to_string(),
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 {
        size as u64
    } else {
        4096
    }
}

fn round_up(value: u64, to: u64) -> u64 {
    value.div_ceil(to) * to
}

/// A device's driver found for a peer copy: this one, or a peer held alive for the copy.
enum DriverRef<'a> {
    This(&'a HostDriver),
    Peer(Arc<HostDriver>),
}

impl DriverRef<'_> {
    fn get(&self) -> &HostDriver {
        match self {
            DriverRef::This(driver) => driver,
            DriverRef::Peer(driver) => driver,
        }
    }
}

/// The host driver. See the module docs.
pub struct HostDriver {
    config: HostDriverConfig,
    state: Mutex<HostState>,
    kernels: RwLock<HashMap<String, HostKernel>>,
    fail_graphs: AtomicBool,
    direct_launches: AtomicU64,
    graph_launches: AtomicU64,
    /// The other devices' drivers, for peer copies (weak: peers refer to each other).
    peers: RwLock<Vec<Weak<HostDriver>>>,
}

impl std::fmt::Debug for HostDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostDriver")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl HostDriver {
    pub fn new(config: HostDriverConfig) -> HostDriver {
        HostDriver {
            config,
            state: Mutex::new(HostState::default()),
            kernels: RwLock::new(HashMap::new()),
            fail_graphs: AtomicBool::new(false),
            direct_launches: AtomicU64::new(0),
            graph_launches: AtomicU64::new(0),
            peers: RwLock::new(Vec::new()),
        }
    }

    /// Makes every driver of `drivers` (devices of distinct ordinals) a peer of every other, so
    /// peer copies between their devices work as between GPUs of one host.
    pub fn connect_peers(drivers: &[Arc<HostDriver>]) {
        for driver in drivers {
            let others: Vec<Weak<HostDriver>> = drivers
                .iter()
                .filter(|other| !Arc::ptr_eq(other, driver))
                .map(Arc::downgrade)
                .collect();
            *driver.peers.write().unwrap_or_else(|e| e.into_inner()) = others;
        }
    }

    /// The driver of device `ordinal`: this one, or a connected peer.
    fn driver_of(&self, ordinal: DeviceOrdinal) -> Option<DriverRef<'_>> {
        if ordinal == self.config.ordinal {
            return Some(DriverRef::This(self));
        }
        self.peers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter_map(Weak::upgrade)
            .find(|peer| peer.config.ordinal == ordinal)
            .map(DriverRef::Peer)
    }

    /// Makes every later stream capture fail at its start (`fail = true`), to test fallbacks.
    pub fn fail_graphs(&self, fail: bool) {
        self.fail_graphs.store(fail, Ordering::Release);
    }

    /// Kernels launched directly (not by a graph) so far.
    pub fn direct_launches(&self) -> u64 {
        self.direct_launches.load(Ordering::Acquire)
    }

    /// Graphs launched so far.
    pub fn graph_launches(&self) -> u64 {
        self.graph_launches.load(Ordering::Acquire)
    }

    /// Records `op` if `stream` is capturing; `false` when it should run now.
    fn record(&self, stream: StreamHandle, op: impl FnOnce() -> HostOp) -> bool {
        match self.lock().captures.get_mut(&stream.0) {
            Some(capture) => {
                capture.ops.push(op());
                true
            }
            None => false,
        }
    }

    /// Fails a call that may not run on a capturing stream, invalidating the capture.
    fn refuse_if_capturing(
        &self,
        stream: Option<StreamHandle>,
        call: &'static str,
    ) -> Result<(), DriverError> {
        let mut state = self.lock();
        let capturing: Vec<u64> = match stream {
            Some(stream) => state
                .captures
                .contains_key(&stream.0)
                .then_some(stream.0)
                .into_iter()
                .collect(),
            None => state.captures.keys().copied().collect(),
        };
        if capturing.is_empty() {
            return Ok(());
        }
        for id in capturing {
            if let Some(capture) = state.captures.get_mut(&id) {
                capture
                    .invalidated
                    .get_or_insert_with(|| format!("{call} was called while stream {id} captured"));
            }
        }
        Err(invalid(
            call,
            "not allowed while a stream captures; the capture is invalidated".into(),
        ))
    }

    fn execute(&self, op: &HostOp) -> Result<(), DriverError> {
        match op {
            HostOp::Launch {
                function,
                config,
                args,
            } => self.run_kernel(*function, config, args),
            HostOp::CopyDtoD { dst, src, bytes } => {
                let state = self.lock();
                state.check_accessible(*src, *bytes)?;
                state.check_accessible(*dst, *bytes)?;
                // SAFETY: both ranges are checked accessible and kept mapped by the lock; `copy`
                // allows overlap.
                unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, *bytes as usize) };
                Ok(())
            }
            HostOp::MemsetD8 { dst, value, bytes } => {
                let state = self.lock();
                state.check_accessible(*dst, *bytes)?;
                // SAFETY: the range is checked accessible and kept mapped by the lock.
                unsafe { std::ptr::write_bytes(dst.0 as *mut u8, *value, *bytes as usize) };
                Ok(())
            }
            HostOp::MemsetD32 { dst, value, count } => {
                if !dst.0.is_multiple_of(4) {
                    return Err(invalid(
                        "hostMemsetD32",
                        format!("{dst} is not 4-byte aligned"),
                    ));
                }
                let state = self.lock();
                state.check_accessible(*dst, count * 4)?;
                // SAFETY: the range is checked accessible, 4-byte aligned, and kept mapped by the
                // lock.
                let words =
                    unsafe { std::slice::from_raw_parts_mut(dst.0 as *mut u32, *count as usize) };
                words.fill(*value);
                Ok(())
            }
            HostOp::CopyPeer {
                dst,
                src_device,
                src,
                bytes,
            } => self.copy_from_peer(*dst, *src_device, *src, *bytes),
        }
    }

    /// Runs a peer copy: reads the source device's memory (checked by its driver), then writes
    /// this one's, corrupted when this device is told to corrupt copies from the source.
    fn copy_from_peer(
        &self,
        dst: DevicePtr,
        src_device: DeviceOrdinal,
        src: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let source = self.driver_of(src_device).ok_or_else(|| {
            invalid(
                "hostMemcpyPeerAsync",
                format!("device {src_device} is not a peer of device {}: connect the host drivers with HostDriver::connect_peers", self.config.ordinal),
            )
        })?;
        let mut data = vec![0u8; bytes as usize];
        {
            let state = source.get().lock();
            state.check_accessible(src, bytes)?;
            // SAFETY: the source range is checked accessible and kept mapped by its driver's
            // lock; `data` is a separate host buffer of `bytes` bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(src.0 as *const u8, data.as_mut_ptr(), data.len())
            };
        }
        if self.config.corrupt_peer_from.contains(&src_device) {
            crate::peer::corrupt(&mut data);
        }
        let state = self.lock();
        state.check_accessible(dst, bytes)?;
        // SAFETY: the destination range is checked accessible and kept mapped by the lock.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), dst.0 as *mut u8, data.len()) };
        Ok(())
    }

    fn run_kernel(
        &self,
        function: FunctionHandle,
        config: &LaunchConfig,
        args: &KernelArgs,
    ) -> Result<(), DriverError> {
        let name = self
            .lock()
            .functions
            .get(&function.0)
            .cloned()
            .ok_or_else(|| {
                invalid(
                    "hostModuleLaunchKernel",
                    format!("unknown function {}", function.0),
                )
            })?;
        let kernel = self
            .kernels
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&name)
            .cloned()
            .ok_or_else(|| {
                invalid(
                    "hostModuleLaunchKernel",
                    format!("kernel {name} is no longer registered"),
                )
            })?;
        let launch = HostLaunch {
            driver: self,
            config: *config,
            args,
        };
        kernel(&launch).map_err(|reason| DriverError::KernelFailed { name, reason })
    }

    pub fn config(&self) -> &HostDriverConfig {
        &self.config
    }

    /// Registers a kernel under `name`; any module "contains" every registered kernel.
    pub fn register_kernel<F>(&self, name: &str, kernel: F)
    where
        F: Fn(&HostLaunch<'_>) -> Result<(), String> + Send + Sync + 'static,
    {
        let mut kernels = self.kernels.write().unwrap_or_else(|e| e.into_inner());
        kernels.insert(name.to_string(), Arc::new(kernel));
    }

    /// Bytes currently backed by this driver (plain allocations plus live physical allocations).
    pub fn used_bytes(&self) -> u64 {
        self.lock().used_bytes
    }

    fn lock(&self) -> MutexGuard<'_, HostState> {
        // A panicking test thread must not poison the driver for the others.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn check_device(&self, device: DeviceOrdinal) -> Result<(), DriverError> {
        if device == self.config.ordinal {
            Ok(())
        } else {
            Err(DriverError::NoSuchDevice {
                device,
                count: self.config.ordinal + 1,
            })
        }
    }

    fn fail_if(&self, step: HostVmmFailure, call: &'static str) -> Result<(), DriverError> {
        if self.config.fail_vmm == Some(step) {
            Err(injected(call))
        } else {
            Ok(())
        }
    }
}

impl Drop for HostDriver {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (&addr, &bytes) in &state.blocks {
            // SAFETY: each block is an anonymous mapping this driver created with exactly this
            // address and length, and nothing can use it once the driver is dropped.
            unsafe { libc::munmap(addr as *mut libc::c_void, bytes as usize) };
        }
        for (&addr, &bytes) in &state.reservations {
            // SAFETY: as above, for reservations.
            unsafe { libc::munmap(addr as *mut libc::c_void, bytes as usize) };
        }
    }
}

impl Driver for HostDriver {
    fn backend(&self) -> Backend {
        Backend::Host
    }

    fn runtime_info(&self) -> RuntimeInfo {
        RuntimeInfo {
            backend: Backend::Host,
            library: None,
            attempts: Vec::new(),
            other_installs: Vec::new(),
            driver_version: None,
            runtime_version: None,
        }
    }

    /// The ordinals up to this device's (those below it belong to other simulated devices).
    fn device_count(&self) -> Result<usize, DriverError> {
        Ok(self.config.ordinal + 1)
    }

    fn device_info(&self, device: DeviceOrdinal) -> Result<DeviceInfo, DriverError> {
        self.check_device(device)?;
        Ok(DeviceInfo {
            ordinal: self.config.ordinal,
            name: self.config.device_name.clone(),
            arch: crate::kernels::normalize_arch(&self.config.arch),
            arch_raw: self.config.arch.clone(),
            total_memory: self.config.total_memory,
            warp_size: 32,
            multiprocessor_count: 1,
            vmm_supported: self.config.vmm_supported,
            integrated: self.config.integrated,
        })
    }

    fn mem_info(&self, device: DeviceOrdinal) -> Result<MemInfo, DriverError> {
        self.check_device(device)?;
        let used = if self.config.free_memory_frozen {
            0
        } else {
            self.lock().used_bytes
        };
        Ok(MemInfo {
            free: self.config.total_memory.saturating_sub(used),
            total: self.config.total_memory,
        })
    }

    fn alloc(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError> {
        self.check_device(device)?;
        if bytes == 0 {
            return Err(invalid("hostMalloc", "zero-byte allocation".to_string()));
        }
        let length = round_up(bytes, page_size());
        let mut state = self.lock();
        if state.used_bytes + length > self.config.total_memory {
            return Err(DriverError::OutOfMemory {
                call: "hostMalloc",
                bytes,
            });
        }
        // SAFETY: an anonymous private mapping at an address of the kernel's choosing touches no
        // existing memory.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                length as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        state.blocks.insert(addr as u64, length);
        state.used_bytes += length;
        Ok(DevicePtr(addr as u64))
    }

    fn free(&self, device: DeviceOrdinal, ptr: DevicePtr) -> Result<(), DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let Some(length) = state.blocks.remove(&ptr.0) else {
            return Err(invalid(
                "hostFree",
                format!("{ptr} is not the start of an allocation"),
            ));
        };
        // SAFETY: the block was created by `alloc` with this address and length and has just been
        // removed from the table, so no checked access can reach it any more.
        let rc = unsafe { libc::munmap(ptr.0 as *mut libc::c_void, length as usize) };
        state.used_bytes -= length;
        if rc != 0 {
            return Err(os_error("munmap"));
        }
        Ok(())
    }

    unsafe fn copy_htod_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.refuse_if_capturing(Some(stream), "hostMemcpyHtoDAsync")?;
        let state = self.lock();
        state.check_accessible(dst, bytes)?;
        // SAFETY: the destination range is checked accessible and kept mapped by the lock; the
        // caller guarantees `src` is readable for `bytes`.
        unsafe { std::ptr::copy(src, dst.0 as *mut u8, bytes as usize) };
        Ok(())
    }

    unsafe fn copy_dtoh_async(
        &self,
        device: DeviceOrdinal,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.refuse_if_capturing(Some(stream), "hostMemcpyDtoHAsync")?;
        let state = self.lock();
        state.check_accessible(src, bytes)?;
        // SAFETY: the source range is checked accessible and kept mapped by the lock; the caller
        // guarantees `dst` is writable for `bytes`.
        unsafe { std::ptr::copy(src.0 as *const u8, dst, bytes as usize) };
        Ok(())
    }

    fn copy_dtod_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let op = HostOp::CopyDtoD { dst, src, bytes };
        if self.record(stream, || op.clone()) {
            return Ok(());
        }
        self.execute(&op)
    }

    fn can_access_peer(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        self.check_device(device)?;
        Ok(self.driver_of(peer).is_some())
    }

    fn enable_peer_access(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        match self.driver_of(peer) {
            Some(_) => Ok(()),
            None => Err(invalid(
                "hostDeviceEnablePeerAccess",
                format!("device {peer} is not a peer of device {device}"),
            )),
        }
    }

    fn copy_peer_async(
        &self,
        dst_device: DeviceOrdinal,
        dst: DevicePtr,
        src_device: DeviceOrdinal,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(dst_device)?;
        let op = if src_device == dst_device {
            HostOp::CopyDtoD { dst, src, bytes }
        } else {
            HostOp::CopyPeer {
                dst,
                src_device,
                src,
                bytes,
            }
        };
        if self.record(stream, || op.clone()) {
            return Ok(());
        }
        self.execute(&op)
    }

    fn memset_d8_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let op = HostOp::MemsetD8 { dst, value, bytes };
        if self.record(stream, || op.clone()) {
            return Ok(());
        }
        self.execute(&op)
    }

    fn memset_d32_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        value: u32,
        count: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let op = HostOp::MemsetD32 { dst, value, count };
        if self.record(stream, || op.clone()) {
            return Ok(());
        }
        self.execute(&op)
    }

    fn stream_create(&self, device: DeviceOrdinal) -> Result<StreamHandle, DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let handle = state.handle();
        state.streams.insert(handle, ());
        Ok(StreamHandle(handle))
    }

    fn stream_destroy(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.lock()
            .streams
            .remove(&stream.0)
            .ok_or_else(|| invalid("hostStreamDestroy", format!("unknown stream {}", stream.0)))
    }

    fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.refuse_if_capturing(Some(stream), "hostStreamSynchronize")?;
        if stream != StreamHandle::DEFAULT && !self.lock().streams.contains_key(&stream.0) {
            return Err(invalid(
                "hostStreamSynchronize",
                format!("unknown stream {}", stream.0),
            ));
        }
        Ok(())
    }

    fn event_create(&self, device: DeviceOrdinal) -> Result<EventHandle, DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let handle = state.handle();
        state.events.insert(handle, None);
        Ok(EventHandle(handle))
    }

    fn event_destroy(&self, device: DeviceOrdinal, event: EventHandle) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.lock()
            .events
            .remove(&event.0)
            .map(|_| ())
            .ok_or_else(|| invalid("hostEventDestroy", format!("unknown event {}", event.0)))
    }

    fn event_record(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
        _stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let slot = state
            .events
            .get_mut(&event.0)
            .ok_or_else(|| invalid("hostEventRecord", format!("unknown event {}", event.0)))?;
        *slot = Some(Instant::now());
        Ok(())
    }

    fn event_synchronize(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.event_query(device, event).map(|_| ())
    }

    fn event_query(&self, device: DeviceOrdinal, event: EventHandle) -> Result<bool, DriverError> {
        self.check_device(device)?;
        match self.lock().events.get(&event.0) {
            Some(_) => Ok(true),
            None => Err(invalid(
                "hostEventQuery",
                format!("unknown event {}", event.0),
            )),
        }
    }

    fn event_elapsed_ms(
        &self,
        device: DeviceOrdinal,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError> {
        self.check_device(device)?;
        let state = self.lock();
        let time = |event: EventHandle| match state.events.get(&event.0) {
            Some(Some(t)) => Ok(*t),
            Some(None) => Err(invalid(
                "hostEventElapsedTime",
                format!("event {} was never recorded", event.0),
            )),
            None => Err(invalid(
                "hostEventElapsedTime",
                format!("unknown event {}", event.0),
            )),
        };
        let (t0, t1) = (time(start)?, time(end)?);
        Ok(t1.saturating_duration_since(t0).as_secs_f32() * 1000.0)
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.refuse_if_capturing(None, "hostDeviceSynchronize")
    }

    fn module_load(
        &self,
        device: DeviceOrdinal,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError> {
        self.check_device(device)?;
        if image.is_empty() {
            return Err(invalid(
                "hostModuleLoadData",
                "empty code object".to_string(),
            ));
        }
        let mut state = self.lock();
        let handle = state.handle();
        state.modules.insert(handle, ());
        Ok(ModuleHandle(handle))
    }

    fn module_unload(
        &self,
        device: DeviceOrdinal,
        module: ModuleHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.lock()
            .modules
            .remove(&module.0)
            .ok_or_else(|| invalid("hostModuleUnload", format!("unknown module {}", module.0)))
    }

    fn module_function(
        &self,
        device: DeviceOrdinal,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        self.check_device(device)?;
        let registered = self
            .kernels
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(name);
        let mut state = self.lock();
        if !state.modules.contains_key(&module.0) {
            return Err(invalid(
                "hostModuleGetFunction",
                format!("unknown module {}", module.0),
            ));
        }
        if !registered {
            return Err(DriverError::Call {
                call: "hostModuleGetFunction",
                code: 500,
                name: format!("no kernel named {name} is registered"),
            });
        }
        let handle = state.handle();
        state.functions.insert(handle, name.to_string());
        Ok(FunctionHandle(handle))
    }

    unsafe fn launch(
        &self,
        device: DeviceOrdinal,
        function: FunctionHandle,
        config: &LaunchConfig,
        stream: StreamHandle,
        args: &KernelArgs,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        if self.record(stream, || HostOp::Launch {
            function,
            config: *config,
            args: args.clone(),
        }) {
            return Ok(());
        }
        self.direct_launches.fetch_add(1, Ordering::AcqRel);
        self.run_kernel(function, config, args)
    }

    fn stream_begin_capture(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        if self.fail_graphs.load(Ordering::Acquire) {
            return Err(injected("hostStreamBeginCapture"));
        }
        let mut state = self.lock();
        if stream == StreamHandle::DEFAULT || !state.streams.contains_key(&stream.0) {
            return Err(invalid(
                "hostStreamBeginCapture",
                format!("stream {} is not a created stream", stream.0),
            ));
        }
        if state.captures.contains_key(&stream.0) {
            return Err(invalid(
                "hostStreamBeginCapture",
                format!("stream {} is already capturing", stream.0),
            ));
        }
        state.captures.insert(stream.0, Capture::default());
        Ok(())
    }

    fn stream_end_capture(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let capture = state.captures.remove(&stream.0).ok_or_else(|| {
            invalid(
                "hostStreamEndCapture",
                format!("stream {} is not capturing", stream.0),
            )
        })?;
        if let Some(reason) = capture.invalidated {
            return Err(invalid(
                "hostStreamEndCapture",
                format!("the capture was invalidated: {reason}"),
            ));
        }
        let handle = state.handle();
        state.graphs.insert(handle, Arc::new(capture.ops));
        Ok(GraphHandle(handle))
    }

    fn graph_instantiate(
        &self,
        device: DeviceOrdinal,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let ops =
            state.graphs.get(&graph.0).cloned().ok_or_else(|| {
                invalid("hostGraphInstantiate", format!("unknown graph {}", graph.0))
            })?;
        let handle = state.handle();
        state.execs.insert(handle, ops);
        Ok(GraphExecHandle(handle))
    }

    fn graph_exec_update(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let new =
            state.graphs.get(&graph.0).cloned().ok_or_else(|| {
                invalid("hostGraphExecUpdate", format!("unknown graph {}", graph.0))
            })?;
        let old = state
            .execs
            .get_mut(&exec.0)
            .ok_or_else(|| invalid("hostGraphExecUpdate", format!("unknown exec {}", exec.0)))?;
        let same =
            old.len() == new.len() && old.iter().zip(new.iter()).all(|(a, b)| a.same_shape(b));
        if same {
            *old = new;
        }
        Ok(same)
    }

    fn graph_launch(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let ops = {
            let state = self.lock();
            if state.captures.contains_key(&stream.0) {
                return Err(invalid(
                    "hostGraphLaunch",
                    "launching a graph into a capture is not supported".into(),
                ));
            }
            state
                .execs
                .get(&exec.0)
                .cloned()
                .ok_or_else(|| invalid("hostGraphLaunch", format!("unknown exec {}", exec.0)))?
        };
        self.graph_launches.fetch_add(1, Ordering::AcqRel);
        ops.iter().try_for_each(|op| self.execute(op))
    }

    fn graph_destroy(&self, device: DeviceOrdinal, graph: GraphHandle) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.lock()
            .graphs
            .remove(&graph.0)
            .map(|_| ())
            .ok_or_else(|| invalid("hostGraphDestroy", format!("unknown graph {}", graph.0)))
    }

    fn graph_exec_destroy(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.lock()
            .execs
            .remove(&exec.0)
            .map(|_| ())
            .ok_or_else(|| invalid("hostGraphExecDestroy", format!("unknown exec {}", exec.0)))
    }

    fn pointer_info(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
    ) -> Result<PointerInfo, DriverError> {
        self.check_device(device)?;
        if self.lock().owns(ptr) {
            Ok(PointerInfo {
                memory_type: self.config.reported_memory_type,
                device: Some(self.config.ordinal),
            })
        } else {
            Ok(PointerInfo {
                memory_type: MemoryType::Unregistered,
                device: None,
            })
        }
    }

    fn vmm_granularity(&self, device: DeviceOrdinal) -> Result<u64, DriverError> {
        self.check_device(device)?;
        if !self.config.vmm_supported {
            return Err(DriverError::Unsupported {
                backend: Backend::Host,
                what: "virtual memory management on this configured device".to_string(),
            });
        }
        Ok(self.config.granularity)
    }

    fn vmm_reserve(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError> {
        self.check_device(device)?;
        self.fail_if(HostVmmFailure::Reserve, "hostMemAddressReserve")?;
        if bytes == 0 || !bytes.is_multiple_of(self.config.granularity) {
            return Err(invalid(
                "hostMemAddressReserve",
                format!(
                    "{bytes} bytes is not a positive multiple of the granularity {}",
                    self.config.granularity
                ),
            ));
        }
        // SAFETY: an anonymous PROT_NONE reservation at an address of the kernel's choosing
        // touches no existing memory and commits none.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(os_error("mmap"));
        }
        self.lock().reservations.insert(addr as u64, bytes);
        Ok(DevicePtr(addr as u64))
    }

    fn vmm_free_reserved(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        match state.reservations.get(&ptr.0) {
            Some(&length) if length == bytes => {}
            Some(&length) => {
                return Err(invalid(
                    "hostMemAddressFree",
                    format!("reservation at {ptr} is {length} bytes, not {bytes}"),
                ))
            }
            None => {
                return Err(invalid(
                    "hostMemAddressFree",
                    format!("{ptr} is not a reservation"),
                ))
            }
        }
        if state.mappings.range(ptr.0..ptr.0 + bytes).next().is_some() {
            return Err(invalid(
                "hostMemAddressFree",
                format!("reservation at {ptr} still has mapped memory"),
            ));
        }
        state.reservations.remove(&ptr.0);
        // SAFETY: the reservation was created by `vmm_reserve` with this address and length and
        // nothing is mapped in it.
        if unsafe { libc::munmap(ptr.0 as *mut libc::c_void, bytes as usize) } != 0 {
            return Err(os_error("munmap"));
        }
        Ok(())
    }

    fn vmm_create(&self, device: DeviceOrdinal, bytes: u64) -> Result<PhysicalHandle, DriverError> {
        self.check_device(device)?;
        self.fail_if(HostVmmFailure::Create, "hostMemCreate")?;
        if bytes == 0 || !bytes.is_multiple_of(self.config.granularity) {
            return Err(invalid(
                "hostMemCreate",
                format!(
                    "{bytes} bytes is not a positive multiple of the granularity {}",
                    self.config.granularity
                ),
            ));
        }
        let mut state = self.lock();
        if state.used_bytes + bytes > self.config.total_memory {
            return Err(DriverError::OutOfMemory {
                call: "hostMemCreate",
                bytes,
            });
        }
        let handle = state.handle();
        state.physical.insert(
            handle,
            Physical {
                bytes,
                mapped_at: None,
                released: false,
            },
        );
        state.used_bytes += bytes;
        Ok(PhysicalHandle(handle))
    }

    fn vmm_release(
        &self,
        device: DeviceOrdinal,
        handle: PhysicalHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let physical = state
            .physical
            .get_mut(&handle.0)
            .filter(|p| !p.released)
            .ok_or_else(|| {
                invalid(
                    "hostMemRelease",
                    format!("unknown physical allocation {}", handle.0),
                )
            })?;
        physical.released = true;
        if physical.mapped_at.is_none() {
            let bytes = physical.bytes;
            state.physical.remove(&handle.0);
            state.used_bytes -= bytes;
        }
        Ok(())
    }

    fn vmm_map(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
        handle: PhysicalHandle,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.fail_if(HostVmmFailure::Map, "hostMemMap")?;
        let mut state = self.lock();
        let inside = state
            .reservations
            .range(..=ptr.0)
            .next_back()
            .is_some_and(|(&a, &len)| ptr.0 + bytes <= a + len);
        if !inside {
            return Err(invalid(
                "hostMemMap",
                format!("{bytes} bytes at {ptr} are not inside a reservation"),
            ));
        }
        if !ptr.0.is_multiple_of(self.config.granularity) {
            return Err(invalid(
                "hostMemMap",
                format!(
                    "{ptr} is not aligned to the granularity {}",
                    self.config.granularity
                ),
            ));
        }
        let overlaps = state
            .mappings
            .range(..ptr.0 + bytes)
            .next_back()
            .is_some_and(|(&a, m)| a + m.bytes > ptr.0);
        if overlaps {
            return Err(invalid(
                "hostMemMap",
                format!("{bytes} bytes at {ptr} overlap an existing mapping"),
            ));
        }
        let physical = state
            .physical
            .get_mut(&handle.0)
            .filter(|p| !p.released)
            .ok_or_else(|| {
                invalid(
                    "hostMemMap",
                    format!("unknown physical allocation {}", handle.0),
                )
            })?;
        if physical.bytes != bytes {
            return Err(invalid(
                "hostMemMap",
                format!(
                    "physical allocation is {} bytes, mapping asks for {bytes}",
                    physical.bytes
                ),
            ));
        }
        if let Some(at) = physical.mapped_at {
            return Err(invalid(
                "hostMemMap",
                format!("physical allocation is already mapped at {at:#x}"),
            ));
        }
        physical.mapped_at = Some(ptr.0);
        state.mappings.insert(
            ptr.0,
            Mapping {
                bytes,
                handle: handle.0,
                accessible: false,
            },
        );
        Ok(())
    }

    fn vmm_set_access(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        self.fail_if(HostVmmFailure::SetAccess, "hostMemSetAccess")?;
        let mut state = self.lock();
        let end = ptr.0 + bytes;
        let mut cursor = ptr.0;
        let keys: Vec<u64> = state.mappings.range(ptr.0..end).map(|(&a, _)| a).collect();
        for addr in &keys {
            if *addr != cursor {
                return Err(invalid(
                    "hostMemSetAccess",
                    format!("{cursor:#x} is not mapped (set access on {bytes} bytes at {ptr})"),
                ));
            }
            cursor += state.mappings[addr].bytes;
        }
        if cursor != end {
            return Err(invalid(
                "hostMemSetAccess",
                format!("range of {bytes} bytes at {ptr} does not cover whole mappings"),
            ));
        }
        // SAFETY: the range is exactly a set of mappings inside a reservation this driver owns.
        if unsafe {
            libc::mprotect(
                ptr.0 as *mut libc::c_void,
                bytes as usize,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        } != 0
        {
            return Err(os_error("mprotect"));
        }
        for addr in keys {
            if let Some(mapping) = state.mappings.get_mut(&addr) {
                mapping.accessible = true;
            }
        }
        Ok(())
    }

    fn vmm_unmap(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.check_device(device)?;
        let mut state = self.lock();
        let end = ptr.0 + bytes;
        let mut cursor = ptr.0;
        let keys: Vec<u64> = state.mappings.range(ptr.0..end).map(|(&a, _)| a).collect();
        for addr in &keys {
            if *addr != cursor {
                return Err(invalid(
                    "hostMemUnmap",
                    format!("{cursor:#x} is not mapped (unmap of {bytes} bytes at {ptr})"),
                ));
            }
            cursor += state.mappings[addr].bytes;
        }
        if cursor != end || keys.is_empty() {
            return Err(invalid(
                "hostMemUnmap",
                format!("range of {bytes} bytes at {ptr} does not cover whole mappings"),
            ));
        }
        // SAFETY: the range is exactly a set of mappings inside a reservation this driver owns;
        // dropping the pages and revoking access is what unmapping means.
        unsafe {
            if libc::madvise(
                ptr.0 as *mut libc::c_void,
                bytes as usize,
                libc::MADV_DONTNEED,
            ) != 0
            {
                return Err(os_error("madvise"));
            }
            if libc::mprotect(ptr.0 as *mut libc::c_void, bytes as usize, libc::PROT_NONE) != 0 {
                return Err(os_error("mprotect"));
            }
        }
        for addr in keys {
            if let Some(mapping) = state.mappings.remove(&addr) {
                let release = match state.physical.get_mut(&mapping.handle) {
                    Some(physical) => {
                        physical.mapped_at = None;
                        physical.released
                    }
                    None => false,
                };
                if release {
                    state.physical.remove(&mapping.handle);
                    state.used_bytes -= mapping.bytes;
                }
            }
        }
        Ok(())
    }
}

/// The process's resident set size in bytes, from `/proc/self/statm`.
pub fn process_resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let resident_pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(resident_pages * page_size())
}

/// How many bytes of `[ptr, ptr+bytes)` are resident in RAM (`mincore`); `ptr` must be page aligned.
pub fn resident_bytes_in(ptr: DevicePtr, bytes: u64) -> Result<u64, DriverError> {
    let page = page_size();
    if !ptr.0.is_multiple_of(page) {
        return Err(invalid("mincore", format!("{ptr} is not page aligned")));
    }
    let pages = bytes.div_ceil(page) as usize;
    let mut vector = vec![0u8; pages];
    // SAFETY: `vector` has one byte per page of the range, as mincore requires; mincore only
    // reads page tables and fails cleanly on unmapped ranges.
    let rc = unsafe {
        libc::mincore(
            ptr.0 as *mut libc::c_void,
            bytes as usize,
            vector.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(os_error("mincore"));
    }
    Ok(vector.iter().filter(|&&v| v & 1 != 0).count() as u64 * page)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn driver() -> HostDriver {
        HostDriver::new(HostDriverConfig::default())
    }

    #[test]
    fn plain_allocation_round_trips_and_rejects_stray_access() {
        let d = driver();
        let ptr = d.alloc(0, 1000).unwrap();
        d.upload(0, ptr, &[1, 2, 3], StreamHandle::DEFAULT).unwrap();
        let mut back = [0u8; 3];
        d.download(0, &mut back, ptr, StreamHandle::DEFAULT)
            .unwrap();
        assert_eq!(back, [1, 2, 3]);
        // Past the end of the (page-rounded) block.
        let error = d
            .upload(0, ptr.offset(4096), &[1], StreamHandle::DEFAULT)
            .unwrap_err();
        assert!(error.to_string().contains("not device memory"), "{error}");
        d.free(0, ptr).unwrap();
        assert!(d.free(0, ptr).is_err());
    }

    #[test]
    fn mapped_memory_is_inaccessible_until_access_is_set() {
        let d = driver();
        let base = d.vmm_reserve(0, 8 * MIB).unwrap();
        let phys = d.vmm_create(0, 2 * MIB).unwrap();
        d.vmm_map(0, base, 2 * MIB, phys).unwrap();
        let error = d
            .memset_d8_async(0, base, 1, 16, StreamHandle::DEFAULT)
            .unwrap_err();
        assert!(
            error.to_string().contains("access was never set"),
            "{error}"
        );
        d.vmm_set_access(0, base, 2 * MIB).unwrap();
        d.memset_d8_async(0, base, 1, 16, StreamHandle::DEFAULT)
            .unwrap();
        // An access crossing into the unmapped next granule fails.
        assert!(d
            .memset_d8_async(0, base.offset(2 * MIB - 8), 1, 16, StreamHandle::DEFAULT)
            .is_err());
        d.vmm_unmap(0, base, 2 * MIB).unwrap();
        d.vmm_release(0, phys).unwrap();
        assert_eq!(d.used_bytes(), 0);
        d.vmm_free_reserved(0, base, 8 * MIB).unwrap();
    }

    #[test]
    fn unmapping_returns_pages_to_the_os() {
        let d = driver();
        let base = d.vmm_reserve(0, 16 * MIB).unwrap();
        let phys = d.vmm_create(0, 8 * MIB).unwrap();
        d.vmm_map(0, base, 8 * MIB, phys).unwrap();
        d.vmm_set_access(0, base, 8 * MIB).unwrap();
        d.memset_d8_async(0, base, 0xab, 8 * MIB, StreamHandle::DEFAULT)
            .unwrap();
        assert_eq!(resident_bytes_in(base, 8 * MIB).unwrap(), 8 * MIB);
        d.vmm_unmap(0, base, 8 * MIB).unwrap();
        assert_eq!(resident_bytes_in(base, 8 * MIB).unwrap(), 0);
        d.vmm_release(0, phys).unwrap();
        d.vmm_free_reserved(0, base, 16 * MIB).unwrap();
    }

    #[test]
    fn allocation_beyond_total_memory_is_out_of_memory() {
        let d = HostDriver::new(HostDriverConfig {
            total_memory: 4 * MIB,
            ..HostDriverConfig::default()
        });
        let error = d.alloc(0, 8 * MIB).unwrap_err();
        assert!(error.is_out_of_memory(), "{error}");
        let error = d.vmm_create(0, 6 * MIB).unwrap_err();
        assert!(error.is_out_of_memory(), "{error}");
    }

    #[test]
    fn registered_kernels_run_with_checked_memory() {
        let d = driver();
        d.register_kernel("scale", |launch| {
            let ptr = launch.ptr_arg(0)?;
            let n = launch.u32_arg(1)? as usize;
            let factor = launch.f32_arg(2)?;
            let values: Vec<f32> = launch
                .read_f32(ptr, n)?
                .into_iter()
                .map(|v| v * factor)
                .collect();
            launch.write_f32(ptr, &values)
        });
        let ptr = d.alloc(0, 16).unwrap();
        let input: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        d.upload(0, ptr, &input, StreamHandle::DEFAULT).unwrap();
        let module = d.module_load(0, b"host").unwrap();
        let function = d.module_function(0, module, "scale").unwrap();
        let args = KernelArgs::new()
            .arg(KernelArg::Ptr(ptr))
            .arg(KernelArg::U32(4))
            .arg(KernelArg::F32(2.0));
        // SAFETY: the host driver checks every access the kernel makes.
        unsafe {
            d.launch(
                0,
                function,
                &LaunchConfig::linear(1, 4),
                StreamHandle::DEFAULT,
                &args,
            )
            .unwrap()
        };
        let mut out = [0u8; 16];
        d.download(0, &mut out, ptr, StreamHandle::DEFAULT).unwrap();
        assert_eq!(out[12..16], 8.0f32.to_le_bytes());
        assert!(d.module_function(0, module, "missing").is_err());
    }

    /// A driver with an `add_scalar(ptr, n, value)` kernel, a stream and 4 f32s at `ptr`.
    fn graph_fixture() -> (HostDriver, StreamHandle, FunctionHandle, DevicePtr) {
        let d = driver();
        d.register_kernel("add_scalar", |launch| {
            let ptr = launch.ptr_arg(0)?;
            let n = launch.u32_arg(1)? as usize;
            let value = launch.f32_arg(2)?;
            let values: Vec<f32> = launch
                .read_f32(ptr, n)?
                .into_iter()
                .map(|v| v + value)
                .collect();
            launch.write_f32(ptr, &values)
        });
        let stream = d.stream_create(0).unwrap();
        let module = d.module_load(0, b"host").unwrap();
        let function = d.module_function(0, module, "add_scalar").unwrap();
        let ptr = d.alloc(0, 16).unwrap();
        d.upload(0, ptr, &[0u8; 16], stream).unwrap();
        (d, stream, function, ptr)
    }

    fn add_scalar(
        d: &HostDriver,
        stream: StreamHandle,
        function: FunctionHandle,
        ptr: DevicePtr,
        value: f32,
    ) {
        let args = KernelArgs::new()
            .arg(KernelArg::Ptr(ptr))
            .arg(KernelArg::U32(4))
            .arg(KernelArg::F32(value));
        // SAFETY: the host driver checks every access the kernel makes.
        unsafe { d.launch(0, function, &LaunchConfig::linear(1, 4), stream, &args) }.unwrap();
    }

    fn read4(d: &HostDriver, stream: StreamHandle, ptr: DevicePtr) -> Vec<f32> {
        let mut out = [0u8; 16];
        d.download(0, &mut out, ptr, stream).unwrap();
        out.chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// Two connected host devices, 0 and 1, the second told to corrupt copies from the first
    /// when `corrupt`.
    fn peer_pair(corrupt: bool) -> (Arc<HostDriver>, Arc<HostDriver>) {
        let a = Arc::new(HostDriver::new(HostDriverConfig::default()));
        let b = Arc::new(HostDriver::new(HostDriverConfig {
            ordinal: 1,
            corrupt_peer_from: if corrupt { vec![0] } else { Vec::new() },
            ..HostDriverConfig::default()
        }));
        HostDriver::connect_peers(&[Arc::clone(&a), Arc::clone(&b)]);
        (a, b)
    }

    #[test]
    fn peer_copies_reach_connected_devices_only_and_corrupt_when_told() {
        for corrupt in [false, true] {
            let (a, b) = peer_pair(corrupt);
            let (sa, sb) = (a.stream_create(0).unwrap(), b.stream_create(1).unwrap());
            let data: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
            let src = a.alloc(0, 1000).unwrap();
            let dst = b.alloc(1, 1000).unwrap();
            a.upload(0, src, &data, sa).unwrap();
            assert!(b.can_access_peer(1, 0).unwrap());
            b.enable_peer_access(1, 0).unwrap();
            b.enable_peer_access(1, 0).unwrap();
            b.copy_peer_async(1, dst, 0, src, 1000, sb).unwrap();
            let mut out = vec![0u8; 1000];
            b.download(1, &mut out, dst, sb).unwrap();
            assert_eq!(out == data, !corrupt);
            if corrupt {
                let changed: Vec<usize> = (0..1000).filter(|&i| out[i] != data[i]).collect();
                assert_eq!(changed, [3, 391, 779]);
            }
            // The source is checked by its own driver: an address it does not own fails.
            let error = b.copy_peer_async(1, dst, 0, dst, 8, sb).unwrap_err();
            assert!(
                error
                    .to_string()
                    .contains("is not device memory of this driver"),
                "{error}"
            );
        }
        // A driver not connected is no peer.
        let lone = HostDriver::new(HostDriverConfig::default());
        assert!(!lone.can_access_peer(0, 1).unwrap());
        assert!(lone.can_access_peer(0, 0).unwrap());
        let stream = lone.stream_create(0).unwrap();
        let error = lone
            .copy_peer_async(0, DevicePtr(64), 1, DevicePtr(64), 8, stream)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("device 1 is not a peer of device 0"),
            "{error}"
        );
    }

    #[test]
    fn a_peer_copy_on_a_capturing_stream_is_recorded_and_replayed() {
        let (a, b) = peer_pair(false);
        let (sa, sb) = (a.stream_create(0).unwrap(), b.stream_create(1).unwrap());
        let src = a.alloc(0, 16).unwrap();
        let dst = b.alloc(1, 16).unwrap();
        a.upload(0, src, &[5u8; 16], sa).unwrap();
        b.upload(1, dst, &[0u8; 16], sb).unwrap();
        b.stream_begin_capture(1, sb).unwrap();
        b.copy_peer_async(1, dst, 0, src, 16, sb).unwrap();
        let graph = b.stream_end_capture(1, sb).unwrap();
        let mut out = [0u8; 16];
        b.download(1, &mut out, dst, sb).unwrap();
        assert_eq!(out, [0u8; 16], "nothing copied while capturing");
        let exec = b.graph_instantiate(1, graph).unwrap();
        a.upload(0, src, &[9u8; 16], sa).unwrap();
        b.graph_launch(1, exec, sb).unwrap();
        b.download(1, &mut out, dst, sb).unwrap();
        assert_eq!(
            out, [9u8; 16],
            "the replay copies what the source holds then"
        );
    }

    #[test]
    fn captured_work_runs_only_when_the_graph_is_launched() {
        let (d, stream, function, ptr) = graph_fixture();
        d.stream_begin_capture(0, stream).unwrap();
        add_scalar(&d, stream, function, ptr, 1.0);
        d.memset_d32_async(0, ptr.offset(12), 7.0f32.to_bits(), 1, stream)
            .unwrap();
        add_scalar(&d, stream, function, ptr, 2.0);
        let graph = d.stream_end_capture(0, stream).unwrap();
        assert_eq!(
            read4(&d, stream, ptr),
            [0.0; 4],
            "nothing ran while capturing"
        );
        assert_eq!(d.direct_launches(), 0);

        let exec = d.graph_instantiate(0, graph).unwrap();
        d.graph_launch(0, exec, stream).unwrap();
        assert_eq!(read4(&d, stream, ptr), [3.0, 3.0, 3.0, 9.0]);
        d.graph_launch(0, exec, stream).unwrap();
        assert_eq!(read4(&d, stream, ptr), [6.0, 6.0, 6.0, 9.0]);
        assert_eq!(d.graph_launches(), 2);

        // The same work with another scalar updates in place; other work is refused.
        d.stream_begin_capture(0, stream).unwrap();
        add_scalar(&d, stream, function, ptr, 10.0);
        d.memset_d32_async(0, ptr.offset(12), 0, 1, stream).unwrap();
        add_scalar(&d, stream, function, ptr, 0.5);
        let same_shape = d.stream_end_capture(0, stream).unwrap();
        assert!(d.graph_exec_update(0, exec, same_shape).unwrap());
        d.graph_launch(0, exec, stream).unwrap();
        assert_eq!(read4(&d, stream, ptr), [16.5, 16.5, 16.5, 0.5]);
        d.stream_begin_capture(0, stream).unwrap();
        add_scalar(&d, stream, function, ptr, 1.0);
        let shorter = d.stream_end_capture(0, stream).unwrap();
        assert!(!d.graph_exec_update(0, exec, shorter).unwrap());

        for graph in [graph, same_shape, shorter] {
            d.graph_destroy(0, graph).unwrap();
        }
        d.graph_exec_destroy(0, exec).unwrap();
        assert!(d.graph_launch(0, exec, stream).is_err());
    }

    #[test]
    fn waiting_on_a_capturing_stream_invalidates_the_capture() {
        let (d, stream, function, ptr) = graph_fixture();
        d.stream_begin_capture(0, stream).unwrap();
        add_scalar(&d, stream, function, ptr, 1.0);
        assert!(d.upload(0, ptr, &[0u8; 4], stream).is_err());
        let error = d.stream_end_capture(0, stream).unwrap_err();
        assert!(error.to_string().contains("invalidated"), "{error}");
        // The stream works directly again.
        add_scalar(&d, stream, function, ptr, 1.0);
        assert_eq!(read4(&d, stream, ptr), [1.0; 4]);

        d.fail_graphs(true);
        assert!(d.stream_begin_capture(0, stream).is_err());
        d.fail_graphs(false);
        assert!(d.stream_begin_capture(0, StreamHandle::DEFAULT).is_err());
    }
}
