//! The CUDA driver: the [`Driver`] trait over cudarc's raw driver API, loaded at run time.
//!
//! cudarc 0.19's dynamic loading panics when `libcuda` (or one of its symbols) is missing. This
//! module therefore looks for the library itself first, recording each name tried, and runs every
//! call inside `catch_unwind`, so a missing runtime or an old driver becomes a [`DriverError`].
//! Each device's primary context is retained on first use and made current before every call.

use std::cell::Cell;
use std::ffi::{c_int, c_uint, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::sys;

use crate::driver::{
    AttemptOutcome, Backend, DeviceInfo, DeviceOrdinal, DevicePtr, Driver, DriverError,
    EventHandle, FunctionHandle, GraphExecHandle, GraphHandle, KernelArgs, LaunchConfig,
    LibraryAttempt, MemInfo, MemoryType, ModuleHandle, PhysicalHandle, PointerInfo, RuntimeInfo,
    StreamHandle,
};
use crate::kernels::cuda_arch;

const INSTALL_HINT: &str = "install the NVIDIA driver (it provides libcuda.so.1 / nvcuda.dll)";

/// Runs a cudarc call, turning a panic (missing library or symbol) into an error.
fn guarded<T>(call: &'static str, f: impl FnOnce() -> T) -> Result<T, DriverError> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|payload| {
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".to_string());
        DriverError::RuntimePanicked {
            runtime: "CUDA",
            call,
            message,
        }
    })
}

fn error_name(result: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: cuGetErrorName writes a static string pointer (or leaves it null) for any code.
    let ok = guarded("cuGetErrorName", || unsafe {
        sys::cuGetErrorName(result, &mut name)
    });
    match ok {
        Ok(sys::CUresult::CUDA_SUCCESS) if !name.is_null() => {
            // SAFETY: non-null names are static NUL-terminated strings.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        }
        _ => format!("{result:?}"),
    }
}

fn check(call: &'static str, result: sys::CUresult) -> Result<(), DriverError> {
    match result {
        sys::CUresult::CUDA_SUCCESS => Ok(()),
        other => Err(DriverError::Call {
            call,
            code: other as i64,
            name: error_name(other),
        }),
    }
}

fn check_alloc(call: &'static str, result: sys::CUresult, bytes: u64) -> Result<(), DriverError> {
    if result == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(DriverError::OutOfMemory { call, bytes });
    }
    check(call, result)
}

thread_local! {
    /// The primary context this thread last made current through [`CudaDriver`] (its address;
    /// 0: none). ember makes no other context current, so it is what the thread has.
    static BOUND_CONTEXT: Cell<usize> = const { Cell::new(0) };
}

/// Runs a cudarc call under the panic guard and checks its result.
macro_rules! cu {
    ($call:literal, $body:expr) => {
        check($call, guarded($call, || $body)?)
    };
}

/// The candidate library names cudarc will try, and whether each loads.
fn probe_library() -> (Option<(String, libloading::Library)>, Vec<LibraryAttempt>) {
    let mut attempts = Vec::new();
    // cudarc's candidate list repeats names and mixes in Windows' nvcuda; try each distinct name
    // once, and nvcuda only on Windows, so the error a user reads lists what was really looked for.
    let base_names: &[&str] = if cfg!(windows) {
        &["cuda", "nvcuda"]
    } else {
        &["cuda"]
    };
    let mut names: Vec<String> = Vec::new();
    for name in base_names
        .iter()
        .flat_map(|n| cudarc::get_lib_name_candidates(n))
    {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    for name in names {
        // SAFETY: loading libcuda runs its initialisers; that is how the driver API is used.
        match unsafe { libloading::Library::new(&name) } {
            Ok(library) => {
                attempts.push(LibraryAttempt {
                    candidate: name.clone(),
                    outcome: AttemptOutcome::Loaded,
                });
                return (Some((name, library)), attempts);
            }
            Err(error) => attempts.push(LibraryAttempt {
                candidate: name,
                outcome: AttemptOutcome::LoadFailed(error.to_string()),
            }),
        }
    }
    (None, attempts)
}

#[cfg(unix)]
fn loaded_path(library: &libloading::Library) -> Option<PathBuf> {
    // SAFETY: looking up a symbol only reads the library's tables.
    let symbol: libloading::Symbol<'_, unsafe extern "C" fn()> =
        unsafe { library.get(b"cuInit\0") }.ok()?;
    let address = *symbol as *const c_void;
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads loader tables and writes `info`.
    if unsafe { libc::dladdr(address, info.as_mut_ptr()) } == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so `info` is initialised.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader while the library is loaded.
    let path = PathBuf::from(
        unsafe { CStr::from_ptr(info.dli_fname) }
            .to_string_lossy()
            .into_owned(),
    );
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

#[cfg(not(unix))]
fn loaded_path(_library: &libloading::Library) -> Option<PathBuf> {
    None
}

/// The CUDA driver. See the module docs.
pub struct CudaDriver {
    info: RuntimeInfo,
    device_count: usize,
    /// Retained primary contexts by ordinal (stored as addresses so the driver is `Send + Sync`).
    contexts: Vec<OnceLock<usize>>,
    /// Serialises the first retain of each device's primary context.
    retain_lock: Mutex<()>,
    _library: libloading::Library,
}

impl std::fmt::Debug for CudaDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDriver")
            .field("runtime", &self.info)
            .field("devices", &self.device_count)
            .finish()
    }
}

impl CudaDriver {
    /// Loads libcuda and initialises the driver API.
    pub fn load() -> Result<CudaDriver, DriverError> {
        let (found, attempts) = probe_library();
        let Some((name, library)) = found else {
            return Err(DriverError::LibraryNotFound {
                runtime: "CUDA",
                attempts,
                hint: INSTALL_HINT.to_string(),
            });
        };
        // SAFETY: cuInit takes flags (must be 0).
        cu!("cuInit", unsafe { sys::cuInit(0) })?;
        let mut version: c_int = 0;
        // SAFETY: the out-pointer is a live local.
        cu!("cuDriverGetVersion", unsafe {
            sys::cuDriverGetVersion(&mut version)
        })?;
        let mut count: c_int = 0;
        // SAFETY: as above.
        cu!("cuDeviceGetCount", unsafe {
            sys::cuDeviceGetCount(&mut count)
        })?;
        let count = count.max(0) as usize;
        let info = RuntimeInfo {
            backend: Backend::Cuda,
            library: loaded_path(&library).or_else(|| Some(PathBuf::from(name))),
            attempts,
            other_installs: Vec::new(),
            driver_version: Some(version),
            runtime_version: None,
        };
        tracing::info!(runtime = %info, devices = count, "CUDA driver loaded");
        Ok(CudaDriver {
            info,
            device_count: count,
            contexts: (0..count).map(|_| OnceLock::new()).collect(),
            retain_lock: Mutex::new(()),
            _library: library,
        })
    }

    fn cu_device(&self, device: DeviceOrdinal) -> Result<sys::CUdevice, DriverError> {
        if device >= self.device_count {
            return Err(DriverError::NoSuchDevice {
                device,
                count: self.device_count,
            });
        }
        let mut cu_device: sys::CUdevice = 0;
        // SAFETY: the out-pointer is a live local and the ordinal is in range.
        cu!("cuDeviceGet", unsafe {
            sys::cuDeviceGet(&mut cu_device, device as c_int)
        })?;
        Ok(cu_device)
    }

    /// Makes `device`'s primary context current on this thread.
    fn bind(&self, device: DeviceOrdinal) -> Result<(), DriverError> {
        // Fast path (every launch goes through here): the context is already current on this
        // thread, so neither a lock nor a driver call is needed.
        if let Some(&context) = self.contexts.get(device).and_then(OnceLock::get) {
            if BOUND_CONTEXT.with(Cell::get) == context {
                return Ok(());
            }
        }
        let cu_device = self.cu_device(device)?;
        let context = match self.contexts[device].get() {
            Some(&context) => context,
            None => {
                let _retain = self.retain_lock.lock().unwrap_or_else(|e| e.into_inner());
                match self.contexts[device].get() {
                    Some(&context) => context,
                    None => {
                        let mut context: sys::CUcontext = std::ptr::null_mut();
                        // SAFETY: the out-pointer is a live local; the primary context is
                        // retained once per device and kept for the life of the driver.
                        cu!("cuDevicePrimaryCtxRetain", unsafe {
                            sys::cuDevicePrimaryCtxRetain(&mut context, cu_device)
                        })?;
                        let _ = self.contexts[device].set(context as usize);
                        context as usize
                    }
                }
            }
        };
        // SAFETY: the context was retained above and is never released while the driver lives.
        cu!("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(context as sys::CUcontext)
        })?;
        BOUND_CONTEXT.with(|bound| bound.set(context));
        Ok(())
    }

    /// `device`'s primary context (retained on first use), for the calls that name contexts.
    fn context_of(&self, device: DeviceOrdinal) -> Result<sys::CUcontext, DriverError> {
        self.bind(device)?;
        let context = self.contexts[device]
            .get()
            .copied()
            .expect("bind retains the device's primary context");
        Ok(context as sys::CUcontext)
    }

    fn attribute(
        &self,
        cu_device: sys::CUdevice,
        attribute: sys::CUdevice_attribute,
    ) -> Result<c_int, DriverError> {
        let mut value: c_int = 0;
        // SAFETY: the out-pointer is a live local.
        cu!("cuDeviceGetAttribute", unsafe {
            sys::cuDeviceGetAttribute(&mut value, attribute, cu_device)
        })?;
        Ok(value)
    }

    fn allocation_prop(device: DeviceOrdinal) -> sys::CUmemAllocationProp {
        // SAFETY: the struct is plain C data for which all-zero is a valid (empty) value.
        let mut prop: sys::CUmemAllocationProp = unsafe { std::mem::zeroed() };
        prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
        prop.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        prop.location.id = device as c_int;
        prop
    }

    fn stream(stream: StreamHandle) -> sys::CUstream {
        stream.0 as usize as sys::CUstream
    }
}

impl Driver for CudaDriver {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }

    fn runtime_info(&self) -> RuntimeInfo {
        self.info.clone()
    }

    fn device_count(&self) -> Result<usize, DriverError> {
        Ok(self.device_count)
    }

    fn device_info(&self, device: DeviceOrdinal) -> Result<DeviceInfo, DriverError> {
        use sys::CUdevice_attribute as A;
        let cu_device = self.cu_device(device)?;
        let mut name = [0 as std::ffi::c_char; 256];
        // SAFETY: the buffer holds 256 bytes and its length is passed.
        cu!("cuDeviceGetName", unsafe {
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, cu_device)
        })?;
        // Force termination in case the driver filled the whole buffer.
        name[255] = 0;
        // SAFETY: the buffer is NUL-terminated (last byte set above).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total: usize = 0;
        // SAFETY: the out-pointer is a live local.
        cu!("cuDeviceTotalMem_v2", unsafe {
            sys::cuDeviceTotalMem_v2(&mut total, cu_device)
        })?;
        let major = self.attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = self.attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let arch = cuda_arch(major, minor);
        Ok(DeviceInfo {
            ordinal: device,
            name,
            arch_raw: arch.clone(),
            arch,
            total_memory: total as u64,
            warp_size: self
                .attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_WARP_SIZE)?
                .max(0) as u32,
            multiprocessor_count: self
                .attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
                .max(0) as u32,
            vmm_supported: self.attribute(
                cu_device,
                A::CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
            )? != 0,
            integrated: self.attribute(cu_device, A::CU_DEVICE_ATTRIBUTE_INTEGRATED)? != 0,
        })
    }

    fn mem_info(&self, device: DeviceOrdinal) -> Result<MemInfo, DriverError> {
        self.bind(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are live locals.
        cu!("cuMemGetInfo_v2", unsafe {
            sys::cuMemGetInfo_v2(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn alloc(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError> {
        self.bind(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the out-pointer is a live local.
        let result = guarded("cuMemAlloc_v2", || unsafe {
            sys::cuMemAlloc_v2(&mut ptr, bytes as usize)
        })?;
        check_alloc("cuMemAlloc_v2", result, bytes)?;
        Ok(DevicePtr(ptr))
    }

    fn free(&self, device: DeviceOrdinal, ptr: DevicePtr) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the driver rejects pointers it did not allocate.
        cu!("cuMemFree_v2", unsafe { sys::cuMemFree_v2(ptr.0) })
    }

    unsafe fn copy_htod_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the caller keeps `src` readable until the stream is synchronised.
        cu!("cuMemcpyHtoDAsync_v2", unsafe {
            sys::cuMemcpyHtoDAsync_v2(
                dst.0,
                src as *const c_void,
                bytes as usize,
                Self::stream(stream),
            )
        })
    }

    unsafe fn copy_dtoh_async(
        &self,
        device: DeviceOrdinal,
        dst: *mut u8,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the caller keeps `dst` writable and otherwise untouched until the stream is synchronised.
        cu!("cuMemcpyDtoHAsync_v2", unsafe {
            sys::cuMemcpyDtoHAsync_v2(
                dst as *mut c_void,
                src.0,
                bytes as usize,
                Self::stream(stream),
            )
        })
    }

    fn copy_dtod_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: DevicePtr,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: both are device addresses, validated by the driver.
        cu!("cuMemcpyDtoDAsync_v2", unsafe {
            sys::cuMemcpyDtoDAsync_v2(dst.0, src.0, bytes as usize, Self::stream(stream))
        })
    }

    fn can_access_peer(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        let cu_device = self.cu_device(device)?;
        let cu_peer = self.cu_device(peer)?;
        if device == peer {
            return Ok(true);
        }
        let mut can: c_int = 0;
        // SAFETY: the out-pointer is a live local; both devices were checked above.
        cu!("cuDeviceCanAccessPeer", unsafe {
            sys::cuDeviceCanAccessPeer(&mut can, cu_device, cu_peer)
        })?;
        Ok(can != 0)
    }

    fn enable_peer_access(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        if device == peer {
            self.cu_device(device)?;
            return Ok(());
        }
        let peer_context = self.context_of(peer)?;
        self.bind(device)?;
        // SAFETY: the peer's primary context is retained for the life of the driver; the
        // flags must be 0.
        let result = guarded("cuCtxEnablePeerAccess", || unsafe {
            sys::cuCtxEnablePeerAccess(peer_context, 0)
        })?;
        match result {
            sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => Ok(()),
            other => check("cuCtxEnablePeerAccess", other),
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
        if dst_device == src_device {
            return self.copy_dtod_async(dst_device, dst, src, bytes, stream);
        }
        let src_context = self.context_of(src_device)?;
        let dst_context = self.context_of(dst_device)?;
        self.bind(dst_device)?;
        // SAFETY: both are device addresses of the devices named, validated by the driver;
        // both contexts are retained for the life of the driver.
        cu!("cuMemcpyPeerAsync", unsafe {
            sys::cuMemcpyPeerAsync(
                dst.0,
                dst_context,
                src.0,
                src_context,
                bytes as usize,
                Self::stream(stream),
            )
        })
    }

    fn memset_d8_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        value: u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the destination is a device address, validated by the driver.
        cu!("cuMemsetD8Async", unsafe {
            sys::cuMemsetD8Async(dst.0, value, bytes as usize, Self::stream(stream))
        })
    }

    fn memset_d32_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        value: u32,
        count: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: as above.
        cu!("cuMemsetD32Async", unsafe {
            sys::cuMemsetD32Async(dst.0, value as c_uint, count as usize, Self::stream(stream))
        })
    }

    fn stream_create(&self, device: DeviceOrdinal) -> Result<StreamHandle, DriverError> {
        self.bind(device)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local; flag 1 is CU_STREAM_NON_BLOCKING.
        cu!("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut stream, 1)
        })?;
        Ok(StreamHandle(stream as usize as u64))
    }

    fn stream_destroy(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the handle came from stream_create.
        cu!("cuStreamDestroy_v2", unsafe {
            sys::cuStreamDestroy_v2(Self::stream(stream))
        })
    }

    fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: as above (0 is the default stream).
        cu!("cuStreamSynchronize", unsafe {
            sys::cuStreamSynchronize(Self::stream(stream))
        })
    }

    fn event_create(&self, device: DeviceOrdinal) -> Result<EventHandle, DriverError> {
        self.bind(device)?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local; flag 0 is CU_EVENT_DEFAULT.
        cu!("cuEventCreate", unsafe {
            sys::cuEventCreate(&mut event, 0)
        })?;
        Ok(EventHandle(event as usize as u64))
    }

    fn event_destroy(&self, device: DeviceOrdinal, event: EventHandle) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the handle came from event_create.
        cu!("cuEventDestroy_v2", unsafe {
            sys::cuEventDestroy_v2(event.0 as usize as sys::CUevent)
        })
    }

    fn event_record(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: as above.
        cu!("cuEventRecord", unsafe {
            sys::cuEventRecord(event.0 as usize as sys::CUevent, Self::stream(stream))
        })
    }

    fn event_synchronize(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: as above.
        cu!("cuEventSynchronize", unsafe {
            sys::cuEventSynchronize(event.0 as usize as sys::CUevent)
        })
    }

    fn event_query(&self, device: DeviceOrdinal, event: EventHandle) -> Result<bool, DriverError> {
        self.bind(device)?;
        // SAFETY: as above.
        match guarded("cuEventQuery", || unsafe {
            sys::cuEventQuery(event.0 as usize as sys::CUevent)
        })? {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => check("cuEventQuery", other).map(|()| false),
        }
    }

    fn event_elapsed_ms(
        &self,
        device: DeviceOrdinal,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError> {
        self.bind(device)?;
        let mut ms = 0f32;
        // SAFETY: the out-pointer is a live local; handles are validated by the driver.
        cu!("cuEventElapsedTime_v2", unsafe {
            sys::cuEventElapsedTime_v2(
                &mut ms,
                start.0 as usize as sys::CUevent,
                end.0 as usize as sys::CUevent,
            )
        })?;
        Ok(ms)
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: no arguments.
        cu!("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
    }

    fn module_load(
        &self,
        device: DeviceOrdinal,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError> {
        self.bind(device)?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: the image is borrowed for the call (PTX images are NUL-terminated by the caller).
        cu!("cuModuleLoadData", unsafe {
            sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void)
        })?;
        Ok(ModuleHandle(module as usize as u64))
    }

    fn module_unload(
        &self,
        device: DeviceOrdinal,
        module: ModuleHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the handle came from module_load.
        cu!("cuModuleUnload", unsafe {
            sys::cuModuleUnload(module.0 as usize as sys::CUmodule)
        })
    }

    fn module_function(
        &self,
        device: DeviceOrdinal,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        self.bind(device)?;
        let c_name = std::ffi::CString::new(name).map_err(|_| DriverError::InvalidArgument {
            call: "cuModuleGetFunction",
            reason: format!("function name {name:?} contains a NUL byte"),
        })?;
        let mut function: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local and the name is NUL-terminated.
        cu!("cuModuleGetFunction", unsafe {
            sys::cuModuleGetFunction(
                &mut function,
                module.0 as usize as sys::CUmodule,
                c_name.as_ptr(),
            )
        })?;
        Ok(FunctionHandle(function as usize as u64))
    }

    unsafe fn launch(
        &self,
        device: DeviceOrdinal,
        function: FunctionHandle,
        config: &LaunchConfig,
        stream: StreamHandle,
        args: &KernelArgs,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        let [gx, gy, gz] = config.grid;
        let [bx, by, bz] = config.block;
        args.with_slot_pointers(|pointers| {
            // SAFETY: the caller guarantees the arguments match the kernel; `pointers` points
            // into `args`, both alive until the call returns (the driver copies arguments at
            // launch, and only reads through the pointers).
            cu!("cuLaunchKernel", unsafe {
                sys::cuLaunchKernel(
                    function.0 as usize as sys::CUfunction,
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    config.shared_mem_bytes,
                    Self::stream(stream),
                    pointers,
                    std::ptr::null_mut(),
                )
            })
        })
    }

    fn stream_begin_capture(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the handle came from stream_create. Relaxed mode: allocations and other calls
        // that do not touch the stream stay legal while it captures (the pool may grow).
        cu!("cuStreamBeginCapture_v2", unsafe {
            sys::cuStreamBeginCapture_v2(
                Self::stream(stream),
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
            )
        })
    }

    fn stream_end_capture(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError> {
        self.bind(device)?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local; the handle came from stream_create.
        cu!("cuStreamEndCapture", unsafe {
            sys::cuStreamEndCapture(Self::stream(stream), &mut graph)
        })?;
        if graph.is_null() {
            return Err(DriverError::InvalidArgument {
                call: "cuStreamEndCapture",
                reason: "the runtime returned no graph".into(),
            });
        }
        Ok(GraphHandle(graph as usize as u64))
    }

    fn graph_instantiate(
        &self,
        device: DeviceOrdinal,
        graph: GraphHandle,
    ) -> Result<GraphExecHandle, DriverError> {
        self.bind(device)?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local; the graph came from stream_end_capture.
        cu!("cuGraphInstantiateWithFlags", unsafe {
            sys::cuGraphInstantiateWithFlags(&mut exec, graph.0 as usize as sys::CUgraph, 0)
        })?;
        Ok(GraphExecHandle(exec as usize as u64))
    }

    fn graph_exec_update(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError> {
        self.bind(device)?;
        // SAFETY: an all-zero CUgraphExecUpdateResultInfo is valid (an enum 0 and null nodes).
        let mut info: sys::CUgraphExecUpdateResultInfo = unsafe { std::mem::zeroed() };
        // SAFETY: both handles came from this driver; the out-pointer is a live local.
        let result = guarded("cuGraphExecUpdate_v2", || unsafe {
            sys::cuGraphExecUpdate_v2(
                exec.0 as usize as sys::CUgraphExec,
                graph.0 as usize as sys::CUgraph,
                &mut info,
            )
        })?;
        match result {
            sys::CUresult::CUDA_SUCCESS => Ok(true),
            // The runtime refuses updates that change the graph's shape; the caller instantiates.
            sys::CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE => Ok(false),
            other => check("cuGraphExecUpdate_v2", other).map(|()| false),
        }
    }

    fn graph_launch(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the exec came from graph_instantiate, the stream from stream_create.
        cu!("cuGraphLaunch", unsafe {
            sys::cuGraphLaunch(exec.0 as usize as sys::CUgraphExec, Self::stream(stream))
        })
    }

    fn graph_destroy(&self, device: DeviceOrdinal, graph: GraphHandle) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the graph came from stream_end_capture and is destroyed once.
        cu!("cuGraphDestroy", unsafe {
            sys::cuGraphDestroy(graph.0 as usize as sys::CUgraph)
        })
    }

    fn graph_exec_destroy(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the exec came from graph_instantiate and is destroyed once.
        cu!("cuGraphExecDestroy", unsafe {
            sys::cuGraphExecDestroy(exec.0 as usize as sys::CUgraphExec)
        })
    }

    fn pointer_info(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
    ) -> Result<PointerInfo, DriverError> {
        use sys::CUpointer_attribute as P;
        self.bind(device)?;
        let mut memory_type: c_uint = 0;
        // SAFETY: MEMORY_TYPE writes one CUmemorytype (32-bit) into the live local.
        let result = guarded("cuPointerGetAttribute", || unsafe {
            sys::cuPointerGetAttribute(
                &mut memory_type as *mut c_uint as *mut c_void,
                P::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
                ptr.0,
            )
        })?;
        if result == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
            // Memory the driver has never seen: plain pageable host memory.
            return Ok(PointerInfo {
                memory_type: MemoryType::Unregistered,
                device: None,
            });
        }
        check("cuPointerGetAttribute", result)?;
        let mut is_managed: c_uint = 0;
        // SAFETY: IS_MANAGED writes a boolean (at most 4 bytes) into the zeroed live local.
        let managed = guarded("cuPointerGetAttribute", || unsafe {
            sys::cuPointerGetAttribute(
                &mut is_managed as *mut c_uint as *mut c_void,
                P::CU_POINTER_ATTRIBUTE_IS_MANAGED,
                ptr.0,
            )
        })? == sys::CUresult::CUDA_SUCCESS
            && is_managed != 0;
        let mut ordinal: c_int = -1;
        // SAFETY: DEVICE_ORDINAL writes an int into the live local.
        let _ = guarded("cuPointerGetAttribute", || unsafe {
            sys::cuPointerGetAttribute(
                &mut ordinal as *mut c_int as *mut c_void,
                P::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                ptr.0,
            )
        })?;
        let memory_type = match (managed, memory_type) {
            (true, _) => MemoryType::Managed,
            (false, 1) => MemoryType::Host,
            (false, 2) | (false, 3) => MemoryType::Device,
            (false, 4) => MemoryType::Managed,
            (false, other) => MemoryType::Unknown(other),
        };
        Ok(PointerInfo {
            memory_type,
            device: (ordinal >= 0).then_some(ordinal as usize),
        })
    }

    fn vmm_granularity(&self, device: DeviceOrdinal) -> Result<u64, DriverError> {
        self.bind(device)?;
        let prop = Self::allocation_prop(device);
        let mut granularity = 0usize;
        // SAFETY: both pointers are live locals.
        cu!("cuMemGetAllocationGranularity", unsafe {
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_MINIMUM,
            )
        })?;
        Ok(granularity as u64)
    }

    fn vmm_reserve(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError> {
        self.bind(device)?;
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: the out-pointer is a live local; no fixed address is requested.
        let result = guarded("cuMemAddressReserve", || unsafe {
            sys::cuMemAddressReserve(&mut ptr, bytes as usize, 0, 0, 0)
        })?;
        check_alloc("cuMemAddressReserve", result, bytes)?;
        Ok(DevicePtr(ptr))
    }

    fn vmm_free_reserved(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the driver validates the range.
        cu!("cuMemAddressFree", unsafe {
            sys::cuMemAddressFree(ptr.0, bytes as usize)
        })
    }

    fn vmm_create(&self, device: DeviceOrdinal, bytes: u64) -> Result<PhysicalHandle, DriverError> {
        self.bind(device)?;
        let prop = Self::allocation_prop(device);
        let mut handle: sys::CUmemGenericAllocationHandle = 0;
        // SAFETY: both pointers are live locals.
        let result = guarded("cuMemCreate", || unsafe {
            sys::cuMemCreate(&mut handle, bytes as usize, &prop, 0)
        })?;
        check_alloc("cuMemCreate", result, bytes)?;
        Ok(PhysicalHandle(handle))
    }

    fn vmm_release(
        &self,
        device: DeviceOrdinal,
        handle: PhysicalHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the handle came from vmm_create; the driver validates it.
        cu!("cuMemRelease", unsafe { sys::cuMemRelease(handle.0) })
    }

    fn vmm_map(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
        handle: PhysicalHandle,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the driver validates the range and the handle.
        cu!("cuMemMap", unsafe {
            sys::cuMemMap(ptr.0, bytes as usize, 0, handle.0, 0)
        })
    }

    fn vmm_set_access(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: plain C data for which all-zero is valid; the fields are set below.
        let mut desc: sys::CUmemAccessDesc = unsafe { std::mem::zeroed() };
        desc.location.type_ = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE;
        desc.location.id = device as c_int;
        desc.flags = sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        // SAFETY: one descriptor, passed with count 1; the driver validates the range.
        cu!("cuMemSetAccess", unsafe {
            sys::cuMemSetAccess(ptr.0, bytes as usize, &desc, 1)
        })
    }

    fn vmm_unmap(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        self.bind(device)?;
        // SAFETY: the driver validates the range.
        cu!("cuMemUnmap", unsafe {
            sys::cuMemUnmap(ptr.0, bytes as usize)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loading_without_libcuda_is_an_error_not_a_panic() {
        match CudaDriver::load() {
            Ok(driver) => {
                // A machine with the NVIDIA driver: it must say what it loaded.
                assert!(driver.runtime_info().library.is_some());
            }
            Err(DriverError::LibraryNotFound { attempts, hint, .. }) => {
                assert!(!attempts.is_empty());
                assert!(
                    attempts.iter().any(|a| a.candidate.contains("cuda")),
                    "{attempts:?}"
                );
                assert!(attempts
                    .iter()
                    .all(|a| matches!(a.outcome, AttemptOutcome::LoadFailed(_))));
                assert!(hint.contains("NVIDIA driver"));
            }
            Err(other) => {
                // libcuda present but unusable (no GPU, driver mismatch): still an error value.
                assert!(!other.to_string().is_empty());
            }
        }
    }

    #[test]
    fn panics_inside_guarded_calls_become_errors() {
        let error = guarded("cuInit", || -> u32 {
            panic!("Unable to dynamically load the \"cuda\" shared library")
        })
        .unwrap_err();
        assert!(
            error
                .to_string()
                .contains("panicked in cuInit: Unable to dynamically load"),
            "{error}"
        );
    }
}
