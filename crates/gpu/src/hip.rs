//! The HIP driver: libamdhip64 resolved at run time with libloading.
//!
//! One binary runs on ROCm 6.x and 7.x and builds with no ROCm installed. The HIP C ABI is
//! declared here rather than taken from `hip-sys` (whose bindings are HIP 5.4: ROCm 6 changed
//! `hipDeviceProp_t`, `hipMemoryType` and more, and it links at build time). Where layouts
//! changed between ROCm 5 and 6 this module either avoids the struct (device attributes are asked
//! one by one) or uses the ROCm 6 symbol explicitly (`hipGetDevicePropertiesR0600` for the
//! architecture name) and decodes values by the runtime version.
//!
//! The library is looked for under `--rocm-path`, `ROCM_PATH` and `/opt/rocm` (`lib/`), newest
//! soname first, then by bare name through the system loader; on Windows under `HIP_PATH\bin`
//! (`amdhip64_7.dll`, `amdhip64_6.dll`). Every attempt is recorded, the file actually loaded is
//! reported, and other installs found on the host are listed, because several ROCm installs on
//! one host are a known cause of weights landing in system memory.

use std::collections::BTreeSet;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::{Path, PathBuf};

use libloading::Library;

use crate::driver::{
    AttemptOutcome, Backend, DeviceInfo, DeviceOrdinal, DevicePtr, Driver, DriverError,
    EventHandle, FunctionHandle, GraphExecHandle, GraphHandle, KernelArgs, LaunchConfig,
    LibraryAttempt, MemInfo, MemoryType, ModuleHandle, PhysicalHandle, PointerInfo, RuntimeInfo,
    StreamHandle,
};
use crate::kernels::normalize_arch;

/// Where to look for libamdhip64.
#[derive(Clone, Debug)]
pub struct HipLoadOptions {
    /// `--rocm-path`: searched first.
    pub rocm_path: Option<PathBuf>,
    /// Also search `ROCM_PATH`/`HIP_PATH`, `/opt/rocm` and the system loader path.
    pub search_system: bool,
}

impl Default for HipLoadOptions {
    fn default() -> Self {
        HipLoadOptions {
            rocm_path: None,
            search_system: true,
        }
    }
}

/// A place to try: a full path, or a bare name for the system loader.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HipCandidate {
    Path(PathBuf),
    Name(&'static str),
}

#[cfg(not(windows))]
const LIBRARY_NAMES: [&str; 3] = ["libamdhip64.so.7", "libamdhip64.so.6", "libamdhip64.so"];
#[cfg(windows)]
const LIBRARY_NAMES: [&str; 2] = ["amdhip64_7.dll", "amdhip64_6.dll"];
#[cfg(not(windows))]
const LIBRARY_SUBDIR: &str = "lib";
#[cfg(windows)]
const LIBRARY_SUBDIR: &str = "bin";
#[cfg(not(windows))]
const INSTALL_HINT: &str = "install ROCm 6 or 7 (the HIP runtime package, e.g. `hip-runtime-amd`), or pass --rocm-path / set ROCM_PATH to its prefix";
#[cfg(windows)]
const INSTALL_HINT: &str = "install the AMD HIP SDK 6 or 7, or set HIP_PATH to its prefix";

/// The ordered candidates for `options`; `env_prefix` is `ROCM_PATH` (Linux) or `HIP_PATH` (Windows).
pub fn candidates(options: &HipLoadOptions, env_prefix: Option<PathBuf>) -> Vec<HipCandidate> {
    let mut prefixes: Vec<PathBuf> = Vec::new();
    if let Some(path) = &options.rocm_path {
        prefixes.push(path.clone());
    }
    if options.search_system {
        if let Some(path) = env_prefix {
            prefixes.push(path);
        }
        #[cfg(not(windows))]
        prefixes.push(PathBuf::from("/opt/rocm"));
    }
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for prefix in prefixes {
        for name in LIBRARY_NAMES {
            let path = prefix.join(LIBRARY_SUBDIR).join(name);
            if seen.insert(path.clone()) {
                out.push(HipCandidate::Path(path));
            }
        }
    }
    if options.search_system {
        out.extend(LIBRARY_NAMES.iter().map(|&n| HipCandidate::Name(n)));
    }
    out
}

/// Library directories of the ROCm installs under `/opt` (`/opt/rocm`, `/opt/rocm-6.4.0`, ...).
#[cfg(not(windows))]
fn system_install_dirs() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir("/opt") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_name().to_string_lossy().starts_with("rocm"))
        .map(|entry| entry.path().join("lib"))
        .collect()
}

/// The HIP SDK on Windows lives under HIP_PATH only, which the prefixes already cover.
#[cfg(windows)]
fn system_install_dirs() -> Vec<PathBuf> {
    Vec::new()
}

/// Other HIP runtime files on this host (`/opt/rocm*/lib/libamdhip64.so*`, the prefixes tried),
/// excluding `loaded`.
pub fn other_installs(prefixes: &[PathBuf], loaded: Option<&Path>) -> Vec<PathBuf> {
    let loaded = loaded.and_then(|p| std::fs::canonicalize(p).ok());
    let dirs: Vec<PathBuf> = prefixes
        .iter()
        .map(|p| p.join(LIBRARY_SUBDIR))
        .chain(system_install_dirs())
        .collect();
    let mut found = BTreeSet::new();
    for dir in dirs {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.filter_map(Result::ok) {
            let name = entry.file_name().to_string_lossy().into_owned();
            if LIBRARY_NAMES.iter().any(|n| {
                name.starts_with(n.trim_end_matches(|c: char| c == '.' || c.is_ascii_digit()))
            }) {
                if let Ok(real) = std::fs::canonicalize(entry.path()) {
                    if Some(&real) != loaded.as_ref() {
                        found.insert(real);
                    }
                }
            }
        }
    }
    found.into_iter().collect()
}

type HipStatus = c_int;
type Handle = *mut c_void;

const HIP_SUCCESS: HipStatus = 0;
const HIP_ERROR_INVALID_VALUE: HipStatus = 1;
const HIP_ERROR_OUT_OF_MEMORY: HipStatus = 2;
const HIP_ERROR_NOT_READY: HipStatus = 600;
/// `hipErrorPeerAccessAlreadyEnabled`: what enabling peer access a second time answers.
const HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED: HipStatus = 704;

const MEMCPY_HOST_TO_DEVICE: c_int = 1;
const MEMCPY_DEVICE_TO_HOST: c_int = 2;
const MEMCPY_DEVICE_TO_DEVICE: c_int = 3;

// hipDeviceAttribute_t values (ROCm 6 and later).
const ATTR_INTEGRATED: c_int = 16;
const ATTR_MULTIPROCESSOR_COUNT: c_int = 63;
const ATTR_WARP_SIZE: c_int = 87;
const ATTR_VMM_SUPPORTED: c_int = 89;

/// Size and `gcnArchName` offset of `hipDeviceProp_tR0600` (x86-64 and aarch64 layouts agree).
const DEVICE_PROP_R0600_SIZE: usize = 1472;
const GCN_ARCH_NAME_OFFSET: usize = 1160;
const _: () = assert!(GCN_ARCH_NAME_OFFSET + 256 <= DEVICE_PROP_R0600_SIZE);

const STREAM_NON_BLOCKING: c_uint = 1;
const EVENT_DEFAULT: c_uint = 0;

#[repr(C)]
#[derive(Clone, Copy)]
struct HipMemLocation {
    location_type: c_int,
    id: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct HipMemAllocationProp {
    allocation_type: c_int,
    requested_handle_type: c_int,
    location: HipMemLocation,
    win32_handle_meta_data: *mut c_void,
    compression_type: u8,
    gpu_direct_rdma_capable: u8,
    usage: u16,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct HipMemAccessDesc {
    location: HipMemLocation,
    flags: c_int,
}

#[repr(C)]
#[derive(Clone, Copy)]
struct HipPointerAttribute {
    memory_type: c_uint,
    device: c_int,
    device_pointer: *mut c_void,
    host_pointer: *mut c_void,
    is_managed: c_int,
    allocation_flags: c_uint,
}

const MEM_ALLOCATION_TYPE_PINNED: c_int = 1;
const MEM_LOCATION_TYPE_DEVICE: c_int = 1;
const MEM_ACCESS_PROT_READ_WRITE: c_int = 3;
const MEM_GRANULARITY_MINIMUM: c_int = 0;

struct VmmApi {
    address_reserve: unsafe extern "C" fn(*mut Handle, usize, usize, Handle, u64) -> HipStatus,
    address_free: unsafe extern "C" fn(Handle, usize) -> HipStatus,
    create: unsafe extern "C" fn(*mut Handle, usize, *const HipMemAllocationProp, u64) -> HipStatus,
    release: unsafe extern "C" fn(Handle) -> HipStatus,
    map: unsafe extern "C" fn(Handle, usize, usize, Handle, u64) -> HipStatus,
    unmap: unsafe extern "C" fn(Handle, usize) -> HipStatus,
    set_access: unsafe extern "C" fn(Handle, usize, *const HipMemAccessDesc, usize) -> HipStatus,
    granularity: unsafe extern "C" fn(*mut usize, *const HipMemAllocationProp, c_int) -> HipStatus,
}

/// `hipStreamCaptureModeRelaxed` (hip_runtime_api.h: Global 0, ThreadLocal 1, Relaxed 2).
const STREAM_CAPTURE_MODE_RELAXED: c_int = 2;
/// `hipErrorGraphExecUpdateFailure`: the update was refused (same value as CUDA's).
const HIP_ERROR_GRAPH_EXEC_UPDATE_FAILURE: HipStatus = 910;

/// Graph entry points (hip_runtime_api.h); optional so a runtime without them still loads.
struct GraphApi {
    stream_begin_capture: unsafe extern "C" fn(Handle, c_int) -> HipStatus,
    stream_end_capture: unsafe extern "C" fn(Handle, *mut Handle) -> HipStatus,
    instantiate:
        unsafe extern "C" fn(*mut Handle, Handle, *mut Handle, *mut c_char, usize) -> HipStatus,
    exec_update: unsafe extern "C" fn(Handle, Handle, *mut Handle, *mut c_int) -> HipStatus,
    launch: unsafe extern "C" fn(Handle, Handle) -> HipStatus,
    destroy: unsafe extern "C" fn(Handle) -> HipStatus,
    exec_destroy: unsafe extern "C" fn(Handle) -> HipStatus,
}

struct HipApi {
    init: unsafe extern "C" fn(c_uint) -> HipStatus,
    get_device_count: unsafe extern "C" fn(*mut c_int) -> HipStatus,
    set_device: unsafe extern "C" fn(c_int) -> HipStatus,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> HipStatus,
    device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> HipStatus,
    device_total_mem: unsafe extern "C" fn(*mut usize, c_int) -> HipStatus,
    get_device_properties_r0600: Option<unsafe extern "C" fn(*mut c_void, c_int) -> HipStatus>,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> HipStatus,
    malloc: unsafe extern "C" fn(*mut Handle, usize) -> HipStatus,
    free: unsafe extern "C" fn(Handle) -> HipStatus,
    memcpy_async: unsafe extern "C" fn(Handle, *const c_void, usize, c_int, Handle) -> HipStatus,
    memset_d8_async: unsafe extern "C" fn(Handle, u8, usize, Handle) -> HipStatus,
    memset_d32_async: unsafe extern "C" fn(Handle, c_int, usize, Handle) -> HipStatus,
    stream_create_with_flags: unsafe extern "C" fn(*mut Handle, c_uint) -> HipStatus,
    stream_destroy: unsafe extern "C" fn(Handle) -> HipStatus,
    stream_synchronize: unsafe extern "C" fn(Handle) -> HipStatus,
    event_create_with_flags: unsafe extern "C" fn(*mut Handle, c_uint) -> HipStatus,
    event_destroy: unsafe extern "C" fn(Handle) -> HipStatus,
    event_record: unsafe extern "C" fn(Handle, Handle) -> HipStatus,
    event_synchronize: unsafe extern "C" fn(Handle) -> HipStatus,
    event_query: unsafe extern "C" fn(Handle) -> HipStatus,
    event_elapsed_time: unsafe extern "C" fn(*mut f32, Handle, Handle) -> HipStatus,
    device_synchronize: unsafe extern "C" fn() -> HipStatus,
    module_load_data: unsafe extern "C" fn(*mut Handle, *const c_void) -> HipStatus,
    module_unload: unsafe extern "C" fn(Handle) -> HipStatus,
    module_get_function: unsafe extern "C" fn(*mut Handle, Handle, *const c_char) -> HipStatus,
    #[allow(clippy::type_complexity)]
    module_launch_kernel: unsafe extern "C" fn(
        Handle,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        Handle,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> HipStatus,
    pointer_get_attributes:
        unsafe extern "C" fn(*mut HipPointerAttribute, *const c_void) -> HipStatus,
    get_error_name: unsafe extern "C" fn(HipStatus) -> *const c_char,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> HipStatus,
    runtime_get_version: unsafe extern "C" fn(*mut c_int) -> HipStatus,
    vmm: Option<VmmApi>,
    graph: Option<GraphApi>,
    peer: Option<PeerApi>,
}

/// The peer-to-peer entry points (`hipDeviceCanAccessPeer(int*, int deviceId, int
/// peerDeviceId)`, `hipDeviceEnablePeerAccess(int peerDeviceId, unsigned flags)`,
/// `hipMemcpyPeerAsync(void* dst, int dstDeviceId, const void* src, int srcDevice, size_t,
/// hipStream_t)`).
struct PeerApi {
    can_access_peer: unsafe extern "C" fn(*mut c_int, c_int, c_int) -> HipStatus,
    enable_peer_access: unsafe extern "C" fn(c_int, c_uint) -> HipStatus,
    memcpy_peer_async:
        unsafe extern "C" fn(Handle, c_int, *const c_void, c_int, usize, Handle) -> HipStatus,
}

/// The HIP driver. See the module docs.
pub struct HipDriver {
    api: HipApi,
    info: RuntimeInfo,
    device_count: usize,
    /// Keeps the function pointers in `api` valid; dropped last.
    _library: Library,
}

impl std::fmt::Debug for HipDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HipDriver")
            .field("runtime", &self.info)
            .field("devices", &self.device_count)
            .finish()
    }
}

fn env_prefix() -> Option<PathBuf> {
    #[cfg(not(windows))]
    let name = "ROCM_PATH";
    #[cfg(windows)]
    let name = "HIP_PATH";
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Opens the first loadable candidate, recording every attempt.
pub fn open_library(
    options: &HipLoadOptions,
) -> Result<(Library, String, Vec<LibraryAttempt>), DriverError> {
    let mut attempts = Vec::new();
    for candidate in candidates(options, env_prefix()) {
        let (name, exists) = match &candidate {
            HipCandidate::Path(path) => (path.display().to_string(), path.exists()),
            HipCandidate::Name(name) => (name.to_string(), true),
        };
        if !exists {
            attempts.push(LibraryAttempt {
                candidate: name,
                outcome: AttemptOutcome::Absent,
            });
            continue;
        }
        let target: &std::ffi::OsStr = match &candidate {
            HipCandidate::Path(path) => path.as_os_str(),
            HipCandidate::Name(name) => std::ffi::OsStr::new(*name),
        };
        // SAFETY: loading libamdhip64 runs its initialisers; that is the documented way to use
        // the HIP runtime and it has no preconditions on our side.
        match unsafe { Library::new(target) } {
            Ok(library) => {
                attempts.push(LibraryAttempt {
                    candidate: name.clone(),
                    outcome: AttemptOutcome::Loaded,
                });
                return Ok((library, name, attempts));
            }
            Err(error) => attempts.push(LibraryAttempt {
                candidate: name,
                outcome: AttemptOutcome::LoadFailed(error.to_string()),
            }),
        }
    }
    Err(DriverError::LibraryNotFound {
        runtime: "HIP",
        attempts,
        hint: INSTALL_HINT.to_string(),
    })
}

/// The file a symbol was loaded from, resolved by the dynamic loader.
#[cfg(unix)]
fn library_path_of(symbol: *const c_void) -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads loader tables and writes `info`; a zero return means no result.
    let found = unsafe { libc::dladdr(symbol, info.as_mut_ptr()) };
    if found == 0 {
        return None;
    }
    // SAFETY: dladdr succeeded, so `info` is initialised.
    let info = unsafe { info.assume_init() };
    if info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader, valid while the library
    // stays loaded (it is, for the duration of this call).
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    let path = PathBuf::from(name.to_string_lossy().into_owned());
    Some(std::fs::canonicalize(&path).unwrap_or(path))
}

#[cfg(not(unix))]
fn library_path_of(_symbol: *const c_void) -> Option<PathBuf> {
    None
}

macro_rules! symbol {
    ($library:expr, $library_name:expr, $name:literal) => {{
        // SAFETY: the declared type matches the HIP C prototype of this symbol (hip_runtime_api.h,
        // ROCm 6), and the library outlives the copied function pointer (both live in HipDriver).
        match unsafe { $library.get(concat!($name, "\0").as_bytes()) } {
            Ok(symbol) => *symbol,
            Err(error) => {
                return Err(DriverError::MissingSymbol {
                    runtime: "HIP",
                    library: $library_name.clone(),
                    symbol: $name,
                    reason: error.to_string(),
                })
            }
        }
    }};
}

macro_rules! optional_symbol {
    ($library:expr, $name:literal) => {{
        // SAFETY: as for `symbol!`.
        unsafe { $library.get(concat!($name, "\0").as_bytes()) }
            .ok()
            .map(|symbol| *symbol)
    }};
}

impl HipDriver {
    /// Loads libamdhip64 and initialises HIP.
    pub fn load(options: &HipLoadOptions) -> Result<HipDriver, DriverError> {
        let (library, name, attempts) = open_library(options)?;
        let vmm = (|| {
            Some(VmmApi {
                address_reserve: optional_symbol!(library, "hipMemAddressReserve")?,
                address_free: optional_symbol!(library, "hipMemAddressFree")?,
                create: optional_symbol!(library, "hipMemCreate")?,
                release: optional_symbol!(library, "hipMemRelease")?,
                map: optional_symbol!(library, "hipMemMap")?,
                unmap: optional_symbol!(library, "hipMemUnmap")?,
                set_access: optional_symbol!(library, "hipMemSetAccess")?,
                granularity: optional_symbol!(library, "hipMemGetAllocationGranularity")?,
            })
        })();
        let graph = (|| {
            Some(GraphApi {
                stream_begin_capture: optional_symbol!(library, "hipStreamBeginCapture")?,
                stream_end_capture: optional_symbol!(library, "hipStreamEndCapture")?,
                instantiate: optional_symbol!(library, "hipGraphInstantiate")?,
                exec_update: optional_symbol!(library, "hipGraphExecUpdate")?,
                launch: optional_symbol!(library, "hipGraphLaunch")?,
                destroy: optional_symbol!(library, "hipGraphDestroy")?,
                exec_destroy: optional_symbol!(library, "hipGraphExecDestroy")?,
            })
        })();
        let peer = (|| {
            Some(PeerApi {
                can_access_peer: optional_symbol!(library, "hipDeviceCanAccessPeer")?,
                enable_peer_access: optional_symbol!(library, "hipDeviceEnablePeerAccess")?,
                memcpy_peer_async: optional_symbol!(library, "hipMemcpyPeerAsync")?,
            })
        })();
        let api = HipApi {
            init: symbol!(library, name, "hipInit"),
            get_device_count: symbol!(library, name, "hipGetDeviceCount"),
            set_device: symbol!(library, name, "hipSetDevice"),
            device_get_attribute: symbol!(library, name, "hipDeviceGetAttribute"),
            device_get_name: symbol!(library, name, "hipDeviceGetName"),
            device_total_mem: symbol!(library, name, "hipDeviceTotalMem"),
            get_device_properties_r0600: optional_symbol!(library, "hipGetDevicePropertiesR0600"),
            mem_get_info: symbol!(library, name, "hipMemGetInfo"),
            malloc: symbol!(library, name, "hipMalloc"),
            free: symbol!(library, name, "hipFree"),
            memcpy_async: symbol!(library, name, "hipMemcpyAsync"),
            memset_d8_async: symbol!(library, name, "hipMemsetD8Async"),
            memset_d32_async: symbol!(library, name, "hipMemsetD32Async"),
            stream_create_with_flags: symbol!(library, name, "hipStreamCreateWithFlags"),
            stream_destroy: symbol!(library, name, "hipStreamDestroy"),
            stream_synchronize: symbol!(library, name, "hipStreamSynchronize"),
            event_create_with_flags: symbol!(library, name, "hipEventCreateWithFlags"),
            event_destroy: symbol!(library, name, "hipEventDestroy"),
            event_record: symbol!(library, name, "hipEventRecord"),
            event_synchronize: symbol!(library, name, "hipEventSynchronize"),
            event_query: symbol!(library, name, "hipEventQuery"),
            event_elapsed_time: symbol!(library, name, "hipEventElapsedTime"),
            device_synchronize: symbol!(library, name, "hipDeviceSynchronize"),
            module_load_data: symbol!(library, name, "hipModuleLoadData"),
            module_unload: symbol!(library, name, "hipModuleUnload"),
            module_get_function: symbol!(library, name, "hipModuleGetFunction"),
            module_launch_kernel: symbol!(library, name, "hipModuleLaunchKernel"),
            pointer_get_attributes: symbol!(library, name, "hipPointerGetAttributes"),
            get_error_name: symbol!(library, name, "hipGetErrorName"),
            driver_get_version: symbol!(library, name, "hipDriverGetVersion"),
            runtime_get_version: symbol!(library, name, "hipRuntimeGetVersion"),
            vmm,
            graph,
            peer,
        };
        let loaded_path =
            library_path_of(api.init as *const c_void).or_else(|| Some(PathBuf::from(&name)));
        let mut prefixes: Vec<PathBuf> = options.rocm_path.iter().cloned().collect();
        prefixes.extend(env_prefix());
        let other = other_installs(&prefixes, loaded_path.as_deref());
        let mut driver = HipDriver {
            api,
            info: RuntimeInfo {
                backend: Backend::Hip,
                library: loaded_path,
                attempts,
                other_installs: other,
                driver_version: None,
                runtime_version: None,
            },
            device_count: 0,
            _library: library,
        };
        // SAFETY: hipInit takes flags (must be 0) and has no other preconditions.
        driver.check("hipInit", unsafe { (driver.api.init)(0) })?;
        let mut version: c_int = 0;
        // SAFETY: the out-pointer is a live local.
        if unsafe { (driver.api.runtime_get_version)(&mut version) } == HIP_SUCCESS {
            driver.info.runtime_version = Some(version);
        }
        // SAFETY: as above.
        if unsafe { (driver.api.driver_get_version)(&mut version) } == HIP_SUCCESS {
            driver.info.driver_version = Some(version);
        }
        let mut count: c_int = 0;
        // SAFETY: as above.
        driver.check("hipGetDeviceCount", unsafe {
            (driver.api.get_device_count)(&mut count)
        })?;
        driver.device_count = count.max(0) as usize;
        tracing::info!(runtime = %driver.info, devices = driver.device_count, "HIP runtime loaded");
        Ok(driver)
    }

    fn error_name(&self, status: HipStatus) -> String {
        // SAFETY: hipGetErrorName accepts any status and returns a static string or null.
        let name = unsafe { (self.api.get_error_name)(status) };
        if name.is_null() {
            return "unknown HIP error".to_string();
        }
        // SAFETY: non-null results are static NUL-terminated strings.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    /// The graph entry points, or why graphs cannot be used.
    fn graph_api(&self, what: &str) -> Result<&GraphApi, DriverError> {
        self.api
            .graph
            .as_ref()
            .ok_or_else(|| DriverError::Unsupported {
                backend: Backend::Hip,
                what: format!("{what}: the runtime lacks the hipGraph entry points"),
            })
    }

    /// The peer-to-peer entry points, or why peer copies cannot be used.
    fn peer_api(&self) -> Result<&PeerApi, DriverError> {
        self.api.peer.as_ref().ok_or_else(|| DriverError::Unsupported {
            backend: Backend::Hip,
            what: "peer copies: the runtime lacks hipDeviceCanAccessPeer, hipDeviceEnablePeerAccess or hipMemcpyPeerAsync".to_string(),
        })
    }

    fn check(&self, call: &'static str, status: HipStatus) -> Result<(), DriverError> {
        if status == HIP_SUCCESS {
            Ok(())
        } else {
            Err(DriverError::Call {
                call,
                code: i64::from(status),
                name: self.error_name(status),
            })
        }
    }

    fn check_alloc(
        &self,
        call: &'static str,
        status: HipStatus,
        bytes: u64,
    ) -> Result<(), DriverError> {
        if status == HIP_ERROR_OUT_OF_MEMORY {
            return Err(DriverError::OutOfMemory { call, bytes });
        }
        self.check(call, status)
    }

    fn set_device(&self, device: DeviceOrdinal) -> Result<(), DriverError> {
        if device >= self.device_count {
            return Err(DriverError::NoSuchDevice {
                device,
                count: self.device_count,
            });
        }
        // SAFETY: the ordinal is in range.
        self.check("hipSetDevice", unsafe {
            (self.api.set_device)(device as c_int)
        })
    }

    fn attribute(&self, device: DeviceOrdinal, attribute: c_int) -> Result<c_int, DriverError> {
        let mut value: c_int = 0;
        // SAFETY: the out-pointer is a live local and the ordinal was checked by the caller.
        self.check("hipDeviceGetAttribute", unsafe {
            (self.api.device_get_attribute)(&mut value, attribute, device as c_int)
        })?;
        Ok(value)
    }

    fn vmm(&self) -> Result<&VmmApi, DriverError> {
        self.api
            .vmm
            .as_ref()
            .ok_or_else(|| DriverError::Unsupported {
                backend: Backend::Hip,
                what: "virtual memory management (this libamdhip64 lacks hipMemCreate/hipMemMap)"
                    .to_string(),
            })
    }

    fn allocation_prop(device: DeviceOrdinal) -> HipMemAllocationProp {
        HipMemAllocationProp {
            allocation_type: MEM_ALLOCATION_TYPE_PINNED,
            requested_handle_type: 0,
            location: HipMemLocation {
                location_type: MEM_LOCATION_TYPE_DEVICE,
                id: device as c_int,
            },
            win32_handle_meta_data: std::ptr::null_mut(),
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
        }
    }

    /// Decodes `hipMemoryType`, whose values changed in ROCm 6 (they now follow CUDA's).
    fn memory_type(&self, raw: c_uint, is_managed: bool) -> MemoryType {
        if is_managed {
            return MemoryType::Managed;
        }
        let rocm6 = self.info.runtime_version.is_none_or(|v| v >= 60_000_000);
        match (rocm6, raw) {
            (true, 0) => MemoryType::Unregistered,
            (true, 1) => MemoryType::Host,
            (true, 2) | (true, 10) => MemoryType::Device,
            (true, 3) | (true, 11) => MemoryType::Managed,
            (false, 0) => MemoryType::Host,
            (false, 1) | (false, 2) => MemoryType::Device,
            (false, 3) | (false, 4) => MemoryType::Managed,
            (_, other) => MemoryType::Unknown(other),
        }
    }
}

fn handle(raw: u64) -> Handle {
    raw as usize as Handle
}

impl Driver for HipDriver {
    fn backend(&self) -> Backend {
        Backend::Hip
    }

    fn runtime_info(&self) -> RuntimeInfo {
        self.info.clone()
    }

    fn device_count(&self) -> Result<usize, DriverError> {
        Ok(self.device_count)
    }

    fn device_info(&self, device: DeviceOrdinal) -> Result<DeviceInfo, DriverError> {
        self.set_device(device)?;
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds 256 bytes and its length is passed.
        self.check("hipDeviceGetName", unsafe {
            (self.api.device_get_name)(name.as_mut_ptr(), name.len() as c_int, device as c_int)
        })?;
        // Force termination in case the runtime filled the whole buffer.
        name[255] = 0;
        // SAFETY: the buffer is NUL-terminated (last byte set above).
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut total: usize = 0;
        // SAFETY: the out-pointer is a live local.
        self.check("hipDeviceTotalMem", unsafe {
            (self.api.device_total_mem)(&mut total, device as c_int)
        })?;
        let get_properties =
            self.api
                .get_device_properties_r0600
                .ok_or_else(|| DriverError::MissingSymbol {
                    runtime: "HIP",
                    library: self
                        .info
                        .library
                        .as_ref()
                        .map(|p| p.display().to_string())
                        .unwrap_or_default(),
                    symbol: "hipGetDevicePropertiesR0600",
                    reason: "ROCm 6 or newer is required to read the architecture name".to_string(),
                })?;
        // Generous, 8-byte aligned room: later ROCm releases may append fields.
        let mut properties = vec![0u64; 4096 / 8];
        // SAFETY: the buffer is larger than hipDeviceProp_tR0600 (1472 bytes) and aligned for it.
        self.check("hipGetDevicePropertiesR0600", unsafe {
            get_properties(properties.as_mut_ptr() as *mut c_void, device as c_int)
        })?;
        let bytes: Vec<u8> = properties.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let arch_field = &bytes[GCN_ARCH_NAME_OFFSET..GCN_ARCH_NAME_OFFSET + 256];
        let end = arch_field
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(arch_field.len());
        let arch_raw = String::from_utf8_lossy(&arch_field[..end]).into_owned();
        Ok(DeviceInfo {
            ordinal: device,
            name,
            arch: normalize_arch(&arch_raw),
            arch_raw,
            total_memory: total as u64,
            warp_size: self.attribute(device, ATTR_WARP_SIZE)?.max(0) as u32,
            multiprocessor_count: self.attribute(device, ATTR_MULTIPROCESSOR_COUNT)?.max(0) as u32,
            vmm_supported: self.api.vmm.is_some()
                && self.attribute(device, ATTR_VMM_SUPPORTED).unwrap_or(0) != 0,
            integrated: self.attribute(device, ATTR_INTEGRATED)? != 0,
        })
    }

    fn mem_info(&self, device: DeviceOrdinal) -> Result<MemInfo, DriverError> {
        self.set_device(device)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both out-pointers are live locals.
        self.check("hipMemGetInfo", unsafe {
            (self.api.mem_get_info)(&mut free, &mut total)
        })?;
        Ok(MemInfo {
            free: free as u64,
            total: total as u64,
        })
    }

    fn alloc(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError> {
        self.set_device(device)?;
        let mut ptr: Handle = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local.
        let status = unsafe { (self.api.malloc)(&mut ptr, bytes as usize) };
        self.check_alloc("hipMalloc", status, bytes)?;
        Ok(DevicePtr(ptr as usize as u64))
    }

    fn free(&self, device: DeviceOrdinal, ptr: DevicePtr) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: freeing an invalid pointer is reported as an error by the runtime.
        self.check("hipFree", unsafe { (self.api.free)(handle(ptr.0)) })
    }

    unsafe fn copy_htod_async(
        &self,
        device: DeviceOrdinal,
        dst: DevicePtr,
        src: *const u8,
        bytes: u64,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: the caller keeps `src` readable until the stream is synchronised.
        self.check("hipMemcpyAsync", unsafe {
            (self.api.memcpy_async)(
                handle(dst.0),
                src as *const c_void,
                bytes as usize,
                MEMCPY_HOST_TO_DEVICE,
                handle(stream.0),
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
        self.set_device(device)?;
        // SAFETY: the caller keeps `dst` writable and otherwise untouched until the stream is synchronised.
        self.check("hipMemcpyAsync", unsafe {
            (self.api.memcpy_async)(
                dst as Handle,
                handle(src.0) as *const c_void,
                bytes as usize,
                MEMCPY_DEVICE_TO_HOST,
                handle(stream.0),
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
        self.set_device(device)?;
        // SAFETY: both pointers are device addresses; the runtime validates them.
        self.check("hipMemcpyAsync", unsafe {
            (self.api.memcpy_async)(
                handle(dst.0),
                handle(src.0) as *const c_void,
                bytes as usize,
                MEMCPY_DEVICE_TO_DEVICE,
                handle(stream.0),
            )
        })
    }

    fn can_access_peer(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<bool, DriverError> {
        for ordinal in [device, peer] {
            if ordinal >= self.device_count {
                return Err(DriverError::NoSuchDevice {
                    device: ordinal,
                    count: self.device_count,
                });
            }
        }
        // HIP answers 0 for a device and itself; a device reaches its own memory.
        if device == peer {
            return Ok(true);
        }
        let api = self.peer_api()?;
        let mut can: c_int = 0;
        // SAFETY: the out-pointer is a live local; both ordinals are in range.
        self.check("hipDeviceCanAccessPeer", unsafe {
            (api.can_access_peer)(&mut can, device as c_int, peer as c_int)
        })?;
        Ok(can != 0)
    }

    fn enable_peer_access(
        &self,
        device: DeviceOrdinal,
        peer: DeviceOrdinal,
    ) -> Result<(), DriverError> {
        self.set_device(device)?;
        if device == peer {
            return Ok(());
        }
        let api = self.peer_api()?;
        // SAFETY: `device` is current; the flags must be 0; the runtime validates `peer`.
        let status = unsafe { (api.enable_peer_access)(peer as c_int, 0) };
        if status == HIP_ERROR_PEER_ACCESS_ALREADY_ENABLED {
            return Ok(());
        }
        self.check("hipDeviceEnablePeerAccess", status)
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
        let api = self.peer_api()?;
        self.set_device(dst_device)?;
        // SAFETY: both pointers are device addresses of the devices named; the runtime
        // validates them and the stream.
        self.check("hipMemcpyPeerAsync", unsafe {
            (api.memcpy_peer_async)(
                handle(dst.0),
                dst_device as c_int,
                handle(src.0) as *const c_void,
                src_device as c_int,
                bytes as usize,
                handle(stream.0),
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
        self.set_device(device)?;
        // SAFETY: the destination is a device address; the runtime validates it.
        self.check("hipMemsetD8Async", unsafe {
            (self.api.memset_d8_async)(handle(dst.0), value, bytes as usize, handle(stream.0))
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
        self.set_device(device)?;
        // SAFETY: as above.
        self.check("hipMemsetD32Async", unsafe {
            (self.api.memset_d32_async)(
                handle(dst.0),
                value as c_int,
                count as usize,
                handle(stream.0),
            )
        })
    }

    fn stream_create(&self, device: DeviceOrdinal) -> Result<StreamHandle, DriverError> {
        self.set_device(device)?;
        let mut stream: Handle = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local.
        self.check("hipStreamCreateWithFlags", unsafe {
            (self.api.stream_create_with_flags)(&mut stream, STREAM_NON_BLOCKING)
        })?;
        Ok(StreamHandle(stream as usize as u64))
    }

    fn stream_destroy(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: the handle came from stream_create; the runtime rejects unknown handles.
        self.check("hipStreamDestroy", unsafe {
            (self.api.stream_destroy)(handle(stream.0))
        })
    }

    fn stream_synchronize(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: as above.
        self.check("hipStreamSynchronize", unsafe {
            (self.api.stream_synchronize)(handle(stream.0))
        })
    }

    fn event_create(&self, device: DeviceOrdinal) -> Result<EventHandle, DriverError> {
        self.set_device(device)?;
        let mut event: Handle = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local.
        self.check("hipEventCreateWithFlags", unsafe {
            (self.api.event_create_with_flags)(&mut event, EVENT_DEFAULT)
        })?;
        Ok(EventHandle(event as usize as u64))
    }

    fn event_destroy(&self, device: DeviceOrdinal, event: EventHandle) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: the handle came from event_create; the runtime rejects unknown handles.
        self.check("hipEventDestroy", unsafe {
            (self.api.event_destroy)(handle(event.0))
        })
    }

    fn event_record(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: as above.
        self.check("hipEventRecord", unsafe {
            (self.api.event_record)(handle(event.0), handle(stream.0))
        })
    }

    fn event_synchronize(
        &self,
        device: DeviceOrdinal,
        event: EventHandle,
    ) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: as above.
        self.check("hipEventSynchronize", unsafe {
            (self.api.event_synchronize)(handle(event.0))
        })
    }

    fn event_query(&self, device: DeviceOrdinal, event: EventHandle) -> Result<bool, DriverError> {
        self.set_device(device)?;
        // SAFETY: as above.
        match unsafe { (self.api.event_query)(handle(event.0)) } {
            HIP_SUCCESS => Ok(true),
            HIP_ERROR_NOT_READY => Ok(false),
            status => self.check("hipEventQuery", status).map(|()| false),
        }
    }

    fn event_elapsed_ms(
        &self,
        device: DeviceOrdinal,
        start: EventHandle,
        end: EventHandle,
    ) -> Result<f32, DriverError> {
        self.set_device(device)?;
        let mut ms = 0f32;
        // SAFETY: the out-pointer is a live local; handles are validated by the runtime.
        self.check("hipEventElapsedTime", unsafe {
            (self.api.event_elapsed_time)(&mut ms, handle(start.0), handle(end.0))
        })?;
        Ok(ms)
    }

    fn synchronize(&self, device: DeviceOrdinal) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: no arguments.
        self.check("hipDeviceSynchronize", unsafe {
            (self.api.device_synchronize)()
        })
    }

    fn module_load(
        &self,
        device: DeviceOrdinal,
        image: &[u8],
    ) -> Result<ModuleHandle, DriverError> {
        self.set_device(device)?;
        let mut module: Handle = std::ptr::null_mut();
        // SAFETY: the image is borrowed for the call; hipModuleLoadData copies what it keeps.
        self.check("hipModuleLoadData", unsafe {
            (self.api.module_load_data)(&mut module, image.as_ptr() as *const c_void)
        })?;
        Ok(ModuleHandle(module as usize as u64))
    }

    fn module_unload(
        &self,
        device: DeviceOrdinal,
        module: ModuleHandle,
    ) -> Result<(), DriverError> {
        self.set_device(device)?;
        // SAFETY: the handle came from module_load.
        self.check("hipModuleUnload", unsafe {
            (self.api.module_unload)(handle(module.0))
        })
    }

    fn module_function(
        &self,
        device: DeviceOrdinal,
        module: ModuleHandle,
        name: &str,
    ) -> Result<FunctionHandle, DriverError> {
        self.set_device(device)?;
        let c_name = std::ffi::CString::new(name).map_err(|_| DriverError::InvalidArgument {
            call: "hipModuleGetFunction",
            reason: format!("function name {name:?} contains a NUL byte"),
        })?;
        let mut function: Handle = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local and the name is NUL-terminated.
        self.check("hipModuleGetFunction", unsafe {
            (self.api.module_get_function)(&mut function, handle(module.0), c_name.as_ptr())
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
        self.set_device(device)?;
        let [gx, gy, gz] = config.grid;
        let [bx, by, bz] = config.block;
        args.with_slot_pointers(|pointers| {
            // SAFETY: the caller guarantees the arguments match the kernel; `pointers` points
            // into `args`, both alive until the call returns (HIP copies kernel arguments at
            // launch, and only reads through the pointers).
            self.check("hipModuleLaunchKernel", unsafe {
                (self.api.module_launch_kernel)(
                    handle(function.0),
                    gx,
                    gy,
                    gz,
                    bx,
                    by,
                    bz,
                    config.shared_mem_bytes,
                    handle(stream.0),
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
        let graph = self.graph_api("graphs (stream capture)")?;
        self.set_device(device)?;
        // SAFETY: the handle came from stream_create. Relaxed mode: allocations and other calls
        // that do not touch the stream stay legal while it captures (the pool may grow).
        self.check("hipStreamBeginCapture", unsafe {
            (graph.stream_begin_capture)(handle(stream.0), STREAM_CAPTURE_MODE_RELAXED)
        })
    }

    fn stream_end_capture(
        &self,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<GraphHandle, DriverError> {
        let graph_api = self.graph_api("graphs (stream capture)")?;
        self.set_device(device)?;
        let mut graph: Handle = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local; the handle came from stream_create.
        self.check("hipStreamEndCapture", unsafe {
            (graph_api.stream_end_capture)(handle(stream.0), &mut graph)
        })?;
        if graph.is_null() {
            return Err(DriverError::InvalidArgument {
                call: "hipStreamEndCapture",
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
        let graph_api = self.graph_api("graphs (instantiate)")?;
        self.set_device(device)?;
        let mut exec: Handle = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local; the graph came from stream_end_capture; no
        // error node or log buffer is asked for (null, 0).
        self.check("hipGraphInstantiate", unsafe {
            (graph_api.instantiate)(
                &mut exec,
                handle(graph.0),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        })?;
        Ok(GraphExecHandle(exec as usize as u64))
    }

    fn graph_exec_update(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        graph: GraphHandle,
    ) -> Result<bool, DriverError> {
        let graph_api = self.graph_api("graphs (update)")?;
        self.set_device(device)?;
        let mut error_node: Handle = std::ptr::null_mut();
        let mut result: c_int = 0;
        // SAFETY: both handles came from this driver; the out-pointers are live locals.
        let status = unsafe {
            (graph_api.exec_update)(
                handle(exec.0),
                handle(graph.0),
                &mut error_node,
                &mut result,
            )
        };
        match status {
            HIP_SUCCESS => Ok(result == 0),
            // The runtime refuses updates that change the graph's shape; the caller instantiates.
            HIP_ERROR_GRAPH_EXEC_UPDATE_FAILURE => Ok(false),
            other => self.check("hipGraphExecUpdate", other).map(|()| false),
        }
    }

    fn graph_launch(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
        stream: StreamHandle,
    ) -> Result<(), DriverError> {
        let graph_api = self.graph_api("graphs (launch)")?;
        self.set_device(device)?;
        // SAFETY: the exec came from graph_instantiate, the stream from stream_create.
        self.check("hipGraphLaunch", unsafe {
            (graph_api.launch)(handle(exec.0), handle(stream.0))
        })
    }

    fn graph_destroy(&self, device: DeviceOrdinal, graph: GraphHandle) -> Result<(), DriverError> {
        let graph_api = self.graph_api("graphs (destroy)")?;
        self.set_device(device)?;
        // SAFETY: the graph came from stream_end_capture and is destroyed once.
        self.check("hipGraphDestroy", unsafe {
            (graph_api.destroy)(handle(graph.0))
        })
    }

    fn graph_exec_destroy(
        &self,
        device: DeviceOrdinal,
        exec: GraphExecHandle,
    ) -> Result<(), DriverError> {
        let graph_api = self.graph_api("graphs (destroy)")?;
        self.set_device(device)?;
        // SAFETY: the exec came from graph_instantiate and is destroyed once.
        self.check("hipGraphExecDestroy", unsafe {
            (graph_api.exec_destroy)(handle(exec.0))
        })
    }

    fn pointer_info(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
    ) -> Result<PointerInfo, DriverError> {
        self.set_device(device)?;
        let mut attributes = HipPointerAttribute {
            memory_type: 0,
            device: -1,
            device_pointer: std::ptr::null_mut(),
            host_pointer: std::ptr::null_mut(),
            is_managed: 0,
            allocation_flags: 0,
        };
        // SAFETY: the out-pointer is a live local of the ROCm 6 layout (unchanged from ROCm 5
        // apart from the enum values, which `memory_type` decodes by version).
        let status = unsafe {
            (self.api.pointer_get_attributes)(&mut attributes, handle(ptr.0) as *const c_void)
        };
        if status == HIP_ERROR_INVALID_VALUE {
            // Memory the runtime has never seen: plain pageable host memory.
            return Ok(PointerInfo {
                memory_type: MemoryType::Unregistered,
                device: None,
            });
        }
        self.check("hipPointerGetAttributes", status)?;
        Ok(PointerInfo {
            memory_type: self.memory_type(attributes.memory_type, attributes.is_managed != 0),
            device: (attributes.device >= 0).then_some(attributes.device as usize),
        })
    }

    fn vmm_granularity(&self, device: DeviceOrdinal) -> Result<u64, DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        let prop = Self::allocation_prop(device);
        let mut granularity = 0usize;
        // SAFETY: both pointers are live locals of the declared layouts.
        self.check("hipMemGetAllocationGranularity", unsafe {
            (vmm.granularity)(&mut granularity, &prop, MEM_GRANULARITY_MINIMUM)
        })?;
        Ok(granularity as u64)
    }

    fn vmm_reserve(&self, device: DeviceOrdinal, bytes: u64) -> Result<DevicePtr, DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        let mut ptr: Handle = std::ptr::null_mut();
        // SAFETY: the out-pointer is a live local; no fixed address is requested.
        let status =
            unsafe { (vmm.address_reserve)(&mut ptr, bytes as usize, 0, std::ptr::null_mut(), 0) };
        self.check_alloc("hipMemAddressReserve", status, bytes)?;
        Ok(DevicePtr(ptr as usize as u64))
    }

    fn vmm_free_reserved(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        // SAFETY: the runtime validates the range.
        self.check("hipMemAddressFree", unsafe {
            (vmm.address_free)(handle(ptr.0), bytes as usize)
        })
    }

    fn vmm_create(&self, device: DeviceOrdinal, bytes: u64) -> Result<PhysicalHandle, DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        let prop = Self::allocation_prop(device);
        let mut physical: Handle = std::ptr::null_mut();
        // SAFETY: both pointers are live locals of the declared layouts.
        let status = unsafe { (vmm.create)(&mut physical, bytes as usize, &prop, 0) };
        self.check_alloc("hipMemCreate", status, bytes)?;
        Ok(PhysicalHandle(physical as usize as u64))
    }

    fn vmm_release(
        &self,
        device: DeviceOrdinal,
        physical: PhysicalHandle,
    ) -> Result<(), DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        // SAFETY: the handle came from vmm_create; the runtime validates it.
        self.check("hipMemRelease", unsafe {
            (vmm.release)(handle(physical.0))
        })
    }

    fn vmm_map(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
        physical: PhysicalHandle,
    ) -> Result<(), DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        // SAFETY: the runtime validates the range and the handle.
        self.check("hipMemMap", unsafe {
            (vmm.map)(handle(ptr.0), bytes as usize, 0, handle(physical.0), 0)
        })
    }

    fn vmm_set_access(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        let desc = HipMemAccessDesc {
            location: HipMemLocation {
                location_type: MEM_LOCATION_TYPE_DEVICE,
                id: device as c_int,
            },
            flags: MEM_ACCESS_PROT_READ_WRITE,
        };
        // SAFETY: one descriptor, passed with count 1; the runtime validates the range.
        self.check("hipMemSetAccess", unsafe {
            (vmm.set_access)(handle(ptr.0), bytes as usize, &desc, 1)
        })
    }

    fn vmm_unmap(
        &self,
        device: DeviceOrdinal,
        ptr: DevicePtr,
        bytes: u64,
    ) -> Result<(), DriverError> {
        let vmm = self.vmm()?;
        self.set_device(device)?;
        // SAFETY: the runtime validates the range.
        self.check("hipMemUnmap", unsafe {
            (vmm.unmap)(handle(ptr.0), bytes as usize)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_put_the_explicit_prefix_first_then_the_environment_then_the_loader() {
        let options = HipLoadOptions {
            rocm_path: Some(PathBuf::from("/custom/rocm")),
            search_system: true,
        };
        let list = candidates(&options, Some(PathBuf::from("/env/rocm")));
        let first = &list[0];
        #[cfg(not(windows))]
        {
            assert_eq!(
                first,
                &HipCandidate::Path(PathBuf::from("/custom/rocm/lib/libamdhip64.so.7"))
            );
            assert!(list.contains(&HipCandidate::Path(PathBuf::from(
                "/env/rocm/lib/libamdhip64.so.6"
            ))));
            assert!(list.contains(&HipCandidate::Path(PathBuf::from(
                "/opt/rocm/lib/libamdhip64.so"
            ))));
            assert_eq!(list.last(), Some(&HipCandidate::Name("libamdhip64.so")));
            assert_eq!(list.len(), 12);
        }
        #[cfg(windows)]
        assert_eq!(
            first,
            &HipCandidate::Path(PathBuf::from("/custom/rocm/bin/amdhip64_7.dll"))
        );
    }

    #[test]
    fn no_library_present_lists_every_path_tried_and_what_to_install() {
        let empty = tempfile::tempdir().unwrap();
        let options = HipLoadOptions {
            rocm_path: Some(empty.path().to_path_buf()),
            search_system: false,
        };
        let error = HipDriver::load(&options).unwrap_err();
        let DriverError::LibraryNotFound { attempts, .. } = &error else {
            panic!("expected LibraryNotFound, found {error}");
        };
        assert_eq!(attempts.len(), LIBRARY_NAMES.len());
        assert!(attempts.iter().all(|a| a.outcome == AttemptOutcome::Absent));
        let text = error.to_string();
        for name in LIBRARY_NAMES {
            let path = empty.path().join(LIBRARY_SUBDIR).join(name);
            assert!(
                text.contains(&format!("{} (absent)", path.display())),
                "{text}"
            );
        }
        assert!(text.contains(INSTALL_HINT), "{text}");
    }

    #[test]
    fn a_broken_library_file_is_reported_with_the_loader_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join(LIBRARY_SUBDIR)).unwrap();
        let broken = dir.path().join(LIBRARY_SUBDIR).join(LIBRARY_NAMES[1]);
        std::fs::write(&broken, b"not a shared object").unwrap();
        let options = HipLoadOptions {
            rocm_path: Some(dir.path().to_path_buf()),
            search_system: false,
        };
        let error = HipDriver::load(&options).unwrap_err();
        let DriverError::LibraryNotFound { attempts, .. } = &error else {
            panic!("expected LibraryNotFound, found {error}");
        };
        assert!(
            matches!(attempts[1].outcome, AttemptOutcome::LoadFailed(_)),
            "{attempts:?}"
        );
        assert!(
            error
                .to_string()
                .contains(&format!("{} (load failed:", broken.display())),
            "{error}"
        );
    }

    #[test]
    fn the_system_search_never_panics() {
        // On a machine without ROCm this is LibraryNotFound naming the loader names; with ROCm it
        // loads (and may find no devices). Either way it returns.
        match HipDriver::load(&HipLoadOptions::default()) {
            Ok(driver) => assert!(driver.runtime_info().library.is_some()),
            Err(DriverError::LibraryNotFound { attempts, .. }) => {
                assert!(
                    attempts.iter().any(|a| a.candidate == LIBRARY_NAMES[0]),
                    "{attempts:?}"
                );
            }
            Err(other) => assert!(!other.to_string().is_empty()),
        }
    }

    #[test]
    fn other_installs_lists_extra_copies_but_not_the_loaded_one() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        for prefix in [&a, &b] {
            std::fs::create_dir_all(prefix.join(LIBRARY_SUBDIR)).unwrap();
            std::fs::write(prefix.join(LIBRARY_SUBDIR).join(LIBRARY_NAMES[0]), b"x").unwrap();
        }
        let loaded = a.join(LIBRARY_SUBDIR).join(LIBRARY_NAMES[0]);
        let others = other_installs(&[a.clone(), b.clone()], Some(&loaded));
        let expected =
            std::fs::canonicalize(b.join(LIBRARY_SUBDIR).join(LIBRARY_NAMES[0])).unwrap();
        assert!(others.contains(&expected), "{others:?}");
        assert!(
            !others.contains(&std::fs::canonicalize(&loaded).unwrap()),
            "{others:?}"
        );
    }
}
