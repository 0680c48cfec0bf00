//! The vendor GEMM (cuBLAS for the CUDA driver, hipBLAS for HIP), loaded at run time.
//!
//! Prefill multiplies many tokens by each weight matrix; there a vendor GEMM on tensor cores (or
//! AMD's matrix cores) beats any kernel of ours, so `ops::matmul` expands the quantised weights to
//! f16 and calls `GemmEx` with f16 inputs and f32 accumulation and output. Like the GPU runtimes
//! themselves, the library is opened with `libloading`, so ember builds and runs without it:
//! [`Blas::new`] fails with every candidate it tried, and the ops fall back to ember's own tiled
//! GEMM kernel.
//!
//! Declared ABIs (the C declarations come from the vendors' headers, looked up in their docs):
//! - cuBLAS (`cublas_api.h`, CUDA 11 and later): `cublasCreate_v2(cublasHandle_t*)`,
//!   `cublasSetStream_v2(handle, cudaStream_t)`, `cublasDestroy_v2(handle)` and
//!   `cublasGemmEx(handle, cublasOperation_t transa, transb, int m, n, k, const void* alpha,
//!   const void* A, cudaDataType Atype, int lda, const void* B, cudaDataType Btype, int ldb,
//!   const void* beta, void* C, cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
//!   cublasGemmAlgo_t algo)`. Values: `CUBLAS_OP_N` 0, `CUBLAS_OP_T` 1, `CUDA_R_16F` 2,
//!   `CUDA_R_32F` 0, `CUBLAS_COMPUTE_32F` 68, `CUBLAS_GEMM_DEFAULT` -1. Every enum is a C `int`.
//! - hipBLAS (`hipblas/hipblas.h`): `hipblasCreate`, `hipblasSetStream`, `hipblasDestroy`, and a
//!   GEMM with the same argument list as cuBLAS's. hipBLAS 2.x (ROCm 6) exports
//!   `hipblasGemmEx_v2` with `hipDataType` (`HIP_R_16F` 2, `HIP_R_32F` 0) and
//!   `hipblasComputeType_t` (`HIPBLAS_COMPUTE_32F` 2); its plain `hipblasGemmEx` takes the legacy
//!   `hipblasDatatype_t` (`HIPBLAS_R_16F` 150, `HIPBLAS_R_32F` 151, also as the compute type).
//!   hipBLAS 3.0 (ROCm 7) removed `hipblasDatatype_t`: its `hipblasGemmEx` takes the v2 types.
//!   So: `hipblasGemmEx_v2` when exported, else `hipblasGemmEx` with the v2 values, and if that
//!   refuses the types (an older library), the legacy values from then on. The argument lists
//!   have the same arity and C types in every version, so a wrong guess is an error status, never
//!   undefined behaviour. `HIPBLAS_OP_N` 111, `HIPBLAS_OP_T` 112, `HIPBLAS_GEMM_DEFAULT` 160.
//!
//! BLAS is column-major; see `ops::matmul` for how the row-major product maps onto it.

use std::ffi::{c_char, c_int, c_void, CStr, OsString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Mutex;

use libloading::Library;
use thiserror::Error;

use crate::driver::{
    describe_attempts, AttemptOutcome, Backend, DeviceOrdinal, DevicePtr, Driver, DriverError,
    LibraryAttempt, StreamHandle,
};

/// Environment variable with the full path of the BLAS library to load (tried first).
pub const BLAS_LIBRARY_ENV: &str = "EMBER_BLAS_LIBRARY";

/// Whether a context has BLAS, and from where or why not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlasStatus {
    Loaded { library: PathBuf },
    Unavailable { reason: String },
}

impl BlasStatus {
    pub fn is_loaded(&self) -> bool {
        matches!(self, BlasStatus::Loaded { .. })
    }
}

impl fmt::Display for BlasStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlasStatus::Loaded { library } => write!(f, "BLAS loaded from {}", library.display()),
            BlasStatus::Unavailable { reason } => write!(f, "no BLAS: {reason}"),
        }
    }
}

/// Which vendor library.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlasKind {
    Cublas,
    Hipblas,
}

impl fmt::Display for BlasKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BlasKind::Cublas => "cuBLAS",
            BlasKind::Hipblas => "hipBLAS",
        })
    }
}

#[derive(Debug, Error)]
pub enum BlasError {
    #[error("no {kind} library could be loaded; tried: {}; install it or set {BLAS_LIBRARY_ENV} to its full path", describe_attempts(.attempts))]
    LibraryNotFound {
        kind: BlasKind,
        attempts: Vec<LibraryAttempt>,
    },
    #[error("the {backend} driver has no BLAS library (expected the cuda or hip driver)")]
    UnsupportedBackend { backend: Backend },
    #[error("{kind} library {library} lacks the symbol {symbol}: {reason}")]
    MissingSymbol {
        kind: BlasKind,
        library: String,
        symbol: &'static str,
        reason: String,
    },
    #[error("{call} failed with status {status} ({name})")]
    Call {
        call: &'static str,
        status: i32,
        name: String,
    },
    #[error("{call}: expected dimensions below 2^31, found {what} = {value}")]
    TooLarge {
        call: &'static str,
        what: &'static str,
        value: usize,
    },
    #[error("binding device {device} for {kind}: {source}")]
    Device {
        kind: BlasKind,
        device: DeviceOrdinal,
        source: DriverError,
    },
}

/// The library names and paths to try for `kind`, in order. `env_library` is
/// `EMBER_BLAS_LIBRARY`; `prefixes` are install directories (`ROCM_PATH`, `CUDA_PATH`, ...) whose
/// `lib`/`lib64`/`bin` folders are searched after the loader's own path.
pub fn candidates(
    kind: BlasKind,
    env_library: Option<OsString>,
    prefixes: &[PathBuf],
) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Some(path) = env_library.filter(|p| !p.is_empty()) {
        out.push(PathBuf::from(path));
    }
    let names: &[&str] = match (kind, cfg!(windows)) {
        (BlasKind::Cublas, false) => &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
        (BlasKind::Cublas, true) => &["cublas64_13.dll", "cublas64_12.dll"],
        (BlasKind::Hipblas, false) => &["libhipblas.so.3", "libhipblas.so.2", "libhipblas.so"],
        (BlasKind::Hipblas, true) => &["hipblas.dll"],
    };
    out.extend(names.iter().map(PathBuf::from));
    let subdirs: &[&str] = if cfg!(windows) {
        &["bin", "bin/x64"]
    } else {
        &["lib", "lib64", "targets/x86_64-linux/lib"]
    };
    for prefix in prefixes {
        for subdir in subdirs {
            for name in names {
                out.push(prefix.join(subdir).join(name));
            }
        }
    }
    out
}

/// Install directories searched for `kind` on this host (from the environment and the usual
/// locations).
pub fn default_prefixes(kind: BlasKind) -> Vec<PathBuf> {
    let env_names: &[&str] = match kind {
        BlasKind::Cublas => &["CUDA_PATH", "CUDA_HOME"],
        BlasKind::Hipblas => &["ROCM_PATH", "HIP_PATH"],
    };
    let mut prefixes: Vec<PathBuf> = env_names
        .iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .collect();
    if !cfg!(windows) {
        prefixes.push(PathBuf::from(match kind {
            BlasKind::Cublas => "/usr/local/cuda",
            BlasKind::Hipblas => "/opt/rocm",
        }));
    }
    prefixes.dedup();
    prefixes
}

/// Opens the first candidate that loads, recording every attempt.
pub fn open_library(
    kind: BlasKind,
    candidates: &[PathBuf],
) -> Result<(Library, PathBuf, Vec<LibraryAttempt>), BlasError> {
    let mut attempts = Vec::new();
    for candidate in candidates {
        let is_path = candidate.components().count() > 1;
        let name = candidate.display().to_string();
        if is_path && !candidate.exists() {
            attempts.push(LibraryAttempt {
                candidate: name,
                outcome: AttemptOutcome::Absent,
            });
            continue;
        }
        // SAFETY: loading a vendor BLAS runs its initialisers, which have no preconditions on
        // our side; that is how these libraries are meant to be used.
        match unsafe { Library::new(candidate.as_os_str()) } {
            Ok(library) => {
                attempts.push(LibraryAttempt {
                    candidate: name,
                    outcome: AttemptOutcome::Loaded,
                });
                return Ok((library, candidate.clone(), attempts));
            }
            Err(error) => attempts.push(LibraryAttempt {
                candidate: name,
                outcome: AttemptOutcome::LoadFailed(error.to_string()),
            }),
        }
    }
    Err(BlasError::LibraryNotFound { kind, attempts })
}

/// A matrix operand's transposition, as BLAS takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    N,
    T,
}

type Handle = *mut c_void;
type CreateFn = unsafe extern "C" fn(*mut Handle) -> c_int;
type DestroyFn = unsafe extern "C" fn(Handle) -> c_int;
type SetStreamFn = unsafe extern "C" fn(Handle, *mut c_void) -> c_int;
type StatusStringFn = unsafe extern "C" fn(c_int) -> *const c_char;
#[allow(clippy::type_complexity)]
type GemmExFn = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
) -> c_int;
type HipSetDeviceFn = unsafe extern "C" fn(c_int) -> c_int;

/// The enum values one library's GEMM takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct GemmAbi {
    op_n: c_int,
    op_t: c_int,
    r_16f: c_int,
    r_32f: c_int,
    compute_32f: c_int,
    algo_default: c_int,
}

const CUBLAS_ABI: GemmAbi = GemmAbi {
    op_n: 0,
    op_t: 1,
    r_16f: 2,
    r_32f: 0,
    compute_32f: 68,
    algo_default: -1,
};

const HIPBLAS_V2_ABI: GemmAbi = GemmAbi {
    op_n: 111,
    op_t: 112,
    r_16f: 2,
    r_32f: 0,
    compute_32f: 2,
    algo_default: 160,
};

const HIPBLAS_LEGACY_ABI: GemmAbi = GemmAbi {
    op_n: 111,
    op_t: 112,
    r_16f: 150,
    r_32f: 151,
    compute_32f: 151,
    algo_default: 160,
};

/// hipBLAS status codes meaning "these enum values are not mine" (`HIPBLAS_STATUS_NOT_SUPPORTED`
/// 7, `HIPBLAS_STATUS_INVALID_ENUM` 10, `HIPBLAS_STATUS_INVALID_VALUE` 3).
const HIPBLAS_TYPE_REFUSALS: [c_int; 3] = [3, 7, 10];

const ABI_UNKNOWN: u8 = 0;
const ABI_V2: u8 = 1;
const ABI_LEGACY: u8 = 2;

/// How the thread's current device is set before a call.
enum DeviceBinder {
    /// The device's primary context (retained here, released on drop), made current with
    /// `cuCtxSetCurrent`: cuBLAS works in the calling thread's current context.
    Cuda { context: usize },
    /// `hipSetDevice` from the runtime the driver loaded: hipBLAS works on the current device.
    Hip {
        set_device: HipSetDeviceFn,
        _runtime: Library,
    },
}

/// A BLAS handle bound to one device and one stream. Calls are serialised by a mutex, because a
/// BLAS handle must not be used from two threads at once.
pub struct Blas {
    kind: BlasKind,
    device: DeviceOrdinal,
    path: PathBuf,
    handle: Mutex<usize>,
    gemm: GemmExFn,
    /// Whether `gemm` is hipBLAS's `_v2` entry point (its ABI is then known).
    hip_abi: AtomicU8,
    destroy: DestroyFn,
    status_string: Option<StatusStringFn>,
    binder: DeviceBinder,
    _library: Library,
}

impl fmt::Debug for Blas {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Blas")
            .field("kind", &self.kind)
            .field("device", &self.device)
            .field("library", &self.path)
            .finish()
    }
}

// SAFETY: the raw handle is only used under the mutex; the function pointers and libraries are
// immutable after construction, and both vendors document handles as usable from any thread when
// not used concurrently.
unsafe impl Send for Blas {}
// SAFETY: as above: every use of the handle goes through the mutex.
unsafe impl Sync for Blas {}

fn symbol<T: Copy>(
    library: &Library,
    kind: BlasKind,
    path: &Path,
    name: &'static str,
) -> Result<T, BlasError> {
    let mut bytes = name.as_bytes().to_vec();
    bytes.push(0);
    // SAFETY: the caller names the symbol's C type as `T`, taken from the vendor header.
    unsafe { library.get::<T>(&bytes) }
        .map(|s| *s)
        .map_err(|error| BlasError::MissingSymbol {
            kind,
            library: path.display().to_string(),
            symbol: name,
            reason: error.to_string(),
        })
}

impl Blas {
    /// Loads the BLAS library that goes with `driver`, creates a handle on `device` and binds it
    /// to `stream`.
    pub fn new(
        driver: &dyn Driver,
        device: DeviceOrdinal,
        stream: StreamHandle,
    ) -> Result<Blas, BlasError> {
        let kind = match driver.backend() {
            Backend::Cuda => BlasKind::Cublas,
            Backend::Hip => BlasKind::Hipblas,
            backend => return Err(BlasError::UnsupportedBackend { backend }),
        };
        let list = candidates(
            kind,
            std::env::var_os(BLAS_LIBRARY_ENV),
            &default_prefixes(kind),
        );
        let (library, path, _attempts) = open_library(kind, &list)?;
        let binder = match kind {
            BlasKind::Cublas => DeviceBinder::cuda(device)?,
            BlasKind::Hipblas => DeviceBinder::hip(driver, device)?,
        };
        binder.bind(kind, device)?;
        let (create, destroy, set_stream, gemm, hip_abi, status_string): (
            CreateFn,
            DestroyFn,
            SetStreamFn,
            GemmExFn,
            u8,
            Option<StatusStringFn>,
        ) = match kind {
            BlasKind::Cublas => (
                symbol(&library, kind, &path, "cublasCreate_v2")?,
                symbol(&library, kind, &path, "cublasDestroy_v2")?,
                symbol(&library, kind, &path, "cublasSetStream_v2")?,
                symbol(&library, kind, &path, "cublasGemmEx")?,
                ABI_V2,
                symbol(&library, kind, &path, "cublasGetStatusString").ok(),
            ),
            BlasKind::Hipblas => {
                let (gemm, abi) = match symbol(&library, kind, &path, "hipblasGemmEx_v2") {
                    Ok(gemm) => (gemm, ABI_V2),
                    Err(_) => (symbol(&library, kind, &path, "hipblasGemmEx")?, ABI_UNKNOWN),
                };
                (
                    symbol(&library, kind, &path, "hipblasCreate")?,
                    symbol(&library, kind, &path, "hipblasDestroy")?,
                    symbol(&library, kind, &path, "hipblasSetStream")?,
                    gemm,
                    abi,
                    symbol(&library, kind, &path, "hipblasStatusToString").ok(),
                )
            }
        };
        let mut handle: Handle = std::ptr::null_mut();
        let blas_call =
            |call: &'static str, status: c_int| check(kind, status_string, call, status);
        // SAFETY: the out-pointer is a live local; the device's context is current (bound above).
        blas_call(create_name(kind), unsafe { create(&mut handle) })?;
        // SAFETY: the handle was just created; the stream handle is the runtime's own stream
        // object (cudarc's CUstream / HIP's hipStream_t), which both libraries accept.
        let status = unsafe { set_stream(handle, stream.0 as usize as *mut c_void) };
        if let Err(error) = blas_call(set_stream_name(kind), status) {
            // SAFETY: the handle was created above and is not used again.
            unsafe { destroy(handle) };
            return Err(error);
        }
        let path = loaded_path(&library, gemm as *const c_void).unwrap_or(path);
        tracing::info!(device, library = %path.display(), "{kind} loaded");
        Ok(Blas {
            kind,
            device,
            path,
            handle: Mutex::new(handle as usize),
            gemm,
            hip_abi: AtomicU8::new(hip_abi),
            destroy,
            status_string,
            binder,
            _library: library,
        })
    }

    pub fn kind(&self) -> BlasKind {
        self.kind
    }

    /// The file the library was loaded from.
    pub fn library_path(&self) -> &Path {
        &self.path
    }

    /// Column-major `C = op(A) op(B)` with `C` `m` x `n` in f32 (`ldc`), `op(A)` `m` x `k` and
    /// `op(B)` `k` x `n` in f16 (`lda`, `ldb` are the leading dimensions of the stored matrices),
    /// accumulated in f32, queued on the handle's stream.
    ///
    /// # Safety
    /// `a`, `b` and `c` must be device memory of this handle's device holding the matrices the
    /// dimensions describe, and stay valid until the stream has run the GEMM.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_f16_f32(
        &self,
        op_a: Op,
        op_b: Op,
        m: usize,
        n: usize,
        k: usize,
        a: DevicePtr,
        lda: usize,
        b: DevicePtr,
        ldb: usize,
        c: DevicePtr,
        ldc: usize,
    ) -> Result<(), BlasError> {
        let call = gemm_name(self.kind, self.hip_abi.load(Ordering::Relaxed));
        let dim = |what: &'static str, value: usize| {
            c_int::try_from(value).map_err(|_| BlasError::TooLarge { call, what, value })
        };
        let (m, n, k) = (dim("m", m)?, dim("n", n)?, dim("k", k)?);
        let (lda, ldb, ldc) = (dim("lda", lda)?, dim("ldb", ldb)?, dim("ldc", ldc)?);
        let handle = self.handle.lock().unwrap_or_else(|e| e.into_inner());
        self.binder.bind(self.kind, self.device)?;
        let alpha: f32 = 1.0;
        let beta: f32 = 0.0;
        let run = |abi: &GemmAbi| {
            let op = |o: Op| if o == Op::N { abi.op_n } else { abi.op_t };
            // SAFETY: the argument list is the GemmEx declaration of the module docs; alpha and
            // beta are host f32 scalars (the default host pointer mode) that live for the call;
            // the matrices are the caller's contract.
            unsafe {
                (self.gemm)(
                    *handle as Handle,
                    op(op_a),
                    op(op_b),
                    m,
                    n,
                    k,
                    &alpha as *const f32 as *const c_void,
                    a.0 as usize as *const c_void,
                    abi.r_16f,
                    lda,
                    b.0 as usize as *const c_void,
                    abi.r_16f,
                    ldb,
                    &beta as *const f32 as *const c_void,
                    c.0 as usize as *mut c_void,
                    abi.r_32f,
                    ldc,
                    abi.compute_32f,
                    abi.algo_default,
                )
            }
        };
        let status = match (self.kind, self.hip_abi.load(Ordering::Relaxed)) {
            (BlasKind::Cublas, _) => run(&CUBLAS_ABI),
            (BlasKind::Hipblas, ABI_V2) => run(&HIPBLAS_V2_ABI),
            (BlasKind::Hipblas, ABI_LEGACY) => run(&HIPBLAS_LEGACY_ABI),
            (BlasKind::Hipblas, _) => {
                // hipBLAS 3 takes the v2 values in plain hipblasGemmEx; older versions refuse
                // them with a status (same arity and C types), and then take the legacy ones.
                let status = run(&HIPBLAS_V2_ABI);
                if HIPBLAS_TYPE_REFUSALS.contains(&status) {
                    let legacy = run(&HIPBLAS_LEGACY_ABI);
                    if legacy == 0 {
                        self.hip_abi.store(ABI_LEGACY, Ordering::Relaxed);
                    }
                    legacy
                } else {
                    if status == 0 {
                        self.hip_abi.store(ABI_V2, Ordering::Relaxed);
                    }
                    status
                }
            }
        };
        check(self.kind, self.status_string, call, status)
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let handle = *self.handle.get_mut().unwrap_or_else(|e| e.into_inner());
        if self.binder.bind(self.kind, self.device).is_ok() {
            // SAFETY: the handle was created in `new` and is destroyed once, here.
            let status = unsafe { (self.destroy)(handle as Handle) };
            if status != 0 {
                tracing::warn!(
                    device = self.device,
                    status,
                    "destroying the {} handle failed",
                    self.kind
                );
            }
        }
        if let DeviceBinder::Cuda { .. } = self.binder {
            self.binder.release(self.device);
        }
    }
}

impl DeviceBinder {
    fn cuda(device: DeviceOrdinal) -> Result<DeviceBinder, BlasError> {
        use cudarc::driver::sys;
        let error = |call: &'static str, code: sys::CUresult| BlasError::Device {
            kind: BlasKind::Cublas,
            device,
            source: DriverError::Call {
                call,
                code: code as i64,
                name: format!("{code:?}"),
            },
        };
        let mut cu_device: sys::CUdevice = 0;
        // SAFETY: the CUDA driver was loaded and initialised by the driver this context runs on
        // (the only way to reach here); the out-pointer is a live local.
        let result = unsafe { sys::cuDeviceGet(&mut cu_device, device as c_int) };
        if result != sys::CUresult::CUDA_SUCCESS {
            return Err(error("cuDeviceGet", result));
        }
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: as above; the retain is balanced by `release` when the handle is dropped.
        let result = unsafe { sys::cuDevicePrimaryCtxRetain(&mut context, cu_device) };
        if result != sys::CUresult::CUDA_SUCCESS {
            return Err(error("cuDevicePrimaryCtxRetain", result));
        }
        Ok(DeviceBinder::Cuda {
            context: context as usize,
        })
    }

    fn hip(driver: &dyn Driver, device: DeviceOrdinal) -> Result<DeviceBinder, BlasError> {
        let info = driver.runtime_info();
        let missing = |reason: String| BlasError::Device {
            kind: BlasKind::Hipblas,
            device,
            source: DriverError::MissingSymbol {
                runtime: "HIP",
                library: info
                    .library
                    .as_ref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_else(|| "(unknown)".to_string()),
                symbol: "hipSetDevice",
                reason,
            },
        };
        let Some(path) = info.library.clone() else {
            return Err(missing(
                "the HIP driver did not say which runtime library it loaded".to_string(),
            ));
        };
        // SAFETY: this is the runtime library the driver already loaded; opening it again only
        // takes another reference.
        let runtime = unsafe { Library::new(&path) }.map_err(|e| missing(e.to_string()))?;
        // SAFETY: hipSetDevice is `hipError_t hipSetDevice(int)` in hip_runtime_api.h.
        let set_device = unsafe { runtime.get::<HipSetDeviceFn>(b"hipSetDevice\0") }
            .map(|s| *s)
            .map_err(|e| missing(e.to_string()))?;
        Ok(DeviceBinder::Hip {
            set_device,
            _runtime: runtime,
        })
    }

    fn bind(&self, kind: BlasKind, device: DeviceOrdinal) -> Result<(), BlasError> {
        match self {
            DeviceBinder::Cuda { context } => {
                use cudarc::driver::sys;
                // SAFETY: the context was retained in `cuda` and is released only on drop.
                let result = unsafe { sys::cuCtxSetCurrent(*context as sys::CUcontext) };
                if result != sys::CUresult::CUDA_SUCCESS {
                    return Err(BlasError::Device {
                        kind,
                        device,
                        source: DriverError::Call {
                            call: "cuCtxSetCurrent",
                            code: result as i64,
                            name: format!("{result:?}"),
                        },
                    });
                }
                Ok(())
            }
            DeviceBinder::Hip { set_device, .. } => {
                // SAFETY: hipSetDevice takes a device ordinal and has no other preconditions.
                let code = unsafe { set_device(device as c_int) };
                if code != 0 {
                    return Err(BlasError::Device {
                        kind,
                        device,
                        source: DriverError::Call {
                            call: "hipSetDevice",
                            code: i64::from(code),
                            name: format!("hipError_t {code}"),
                        },
                    });
                }
                Ok(())
            }
        }
    }

    fn release(&self, device: DeviceOrdinal) {
        if let DeviceBinder::Cuda { .. } = self {
            use cudarc::driver::sys;
            let mut cu_device: sys::CUdevice = 0;
            // SAFETY: balances the retain in `cuda`; the out-pointer is a live local.
            unsafe {
                if sys::cuDeviceGet(&mut cu_device, device as c_int) == sys::CUresult::CUDA_SUCCESS
                {
                    sys::cuDevicePrimaryCtxRelease_v2(cu_device);
                }
            }
        }
    }
}

fn create_name(kind: BlasKind) -> &'static str {
    match kind {
        BlasKind::Cublas => "cublasCreate_v2",
        BlasKind::Hipblas => "hipblasCreate",
    }
}

fn set_stream_name(kind: BlasKind) -> &'static str {
    match kind {
        BlasKind::Cublas => "cublasSetStream_v2",
        BlasKind::Hipblas => "hipblasSetStream",
    }
}

fn gemm_name(kind: BlasKind, hip_abi: u8) -> &'static str {
    match (kind, hip_abi) {
        (BlasKind::Cublas, _) => "cublasGemmEx",
        (BlasKind::Hipblas, ABI_V2) => "hipblasGemmEx (v2 types)",
        (BlasKind::Hipblas, ABI_LEGACY) => "hipblasGemmEx (legacy types)",
        (BlasKind::Hipblas, _) => "hipblasGemmEx",
    }
}

fn check(
    kind: BlasKind,
    status_string: Option<StatusStringFn>,
    call: &'static str,
    status: c_int,
) -> Result<(), BlasError> {
    if status == 0 {
        return Ok(());
    }
    let name = status_string
        .map(|f| {
            // SAFETY: both vendors' status-string functions return a static NUL-terminated string
            // (or null) for any value.
            let text = unsafe { f(status) };
            if text.is_null() {
                String::new()
            } else {
                // SAFETY: non-null, static and NUL-terminated, as above.
                unsafe { CStr::from_ptr(text) }
                    .to_string_lossy()
                    .into_owned()
            }
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("{kind} status {status}"));
    Err(BlasError::Call { call, status, name })
}

/// The file the loader took `address` from.
#[cfg(unix)]
fn loaded_path(_library: &Library, address: *const c_void) -> Option<PathBuf> {
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
fn loaded_path(_library: &Library, _address: *const c_void) -> Option<PathBuf> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_start_with_the_environment_then_names_then_prefixes() {
        let list = candidates(
            BlasKind::Hipblas,
            Some(OsString::from("/custom/libhipblas.so")),
            &[PathBuf::from("/rocm")],
        );
        assert_eq!(list[0], PathBuf::from("/custom/libhipblas.so"));
        if cfg!(unix) {
            assert_eq!(list[1], PathBuf::from("libhipblas.so.3"));
            assert_eq!(list[2], PathBuf::from("libhipblas.so.2"));
            assert!(list.contains(&PathBuf::from("/rocm/lib/libhipblas.so.2")));
            let cublas = candidates(BlasKind::Cublas, None, &[]);
            assert_eq!(
                cublas,
                vec![
                    PathBuf::from("libcublas.so.13"),
                    PathBuf::from("libcublas.so.12"),
                    PathBuf::from("libcublas.so")
                ]
            );
        }
        // An empty variable is no candidate.
        let list = candidates(BlasKind::Cublas, Some(OsString::new()), &[]);
        assert!(!list.iter().any(|p| p.as_os_str().is_empty()));
    }

    #[test]
    fn a_missing_library_lists_every_attempt() {
        let dir = tempfile::tempdir().unwrap();
        let absent = dir.path().join("libcublas.so.99");
        let list = vec![absent.clone(), PathBuf::from("libember-no-such-blas.so.1")];
        let error = open_library(BlasKind::Cublas, &list).unwrap_err();
        let text = error.to_string();
        assert!(
            text.starts_with("no cuBLAS library could be loaded; tried: "),
            "{text}"
        );
        assert!(
            text.contains(&format!("{} (absent)", absent.display())),
            "{text}"
        );
        assert!(
            text.contains("libember-no-such-blas.so.1 (load failed: "),
            "{text}"
        );
        assert!(
            text.ends_with(&format!("set {BLAS_LIBRARY_ENV} to its full path")),
            "{text}"
        );
        match error {
            BlasError::LibraryNotFound { attempts, .. } => assert_eq!(attempts.len(), 2),
            other => panic!("expected LibraryNotFound, found {other:?}"),
        }
    }

    #[test]
    fn a_file_that_is_not_a_library_fails_to_load_with_the_loader_reason() {
        let dir = tempfile::tempdir().unwrap();
        let fake = dir.path().join("libhipblas.so.3");
        std::fs::write(&fake, b"not an ELF file").unwrap();
        let error = open_library(BlasKind::Hipblas, std::slice::from_ref(&fake)).unwrap_err();
        let BlasError::LibraryNotFound { attempts, .. } = error else {
            panic!("expected LibraryNotFound");
        };
        assert!(
            matches!(&attempts[0].outcome, AttemptOutcome::LoadFailed(reason) if !reason.is_empty()),
            "{attempts:?}"
        );
    }

    #[cfg(unix)]
    #[test]
    fn the_host_driver_has_no_blas() {
        use crate::host::{HostDriver, HostDriverConfig};
        let driver = HostDriver::new(HostDriverConfig::default());
        let error = Blas::new(&driver, 0, StreamHandle::DEFAULT).unwrap_err();
        assert_eq!(
            error.to_string(),
            "the host driver has no BLAS library (expected the cuda or hip driver)"
        );
    }

    #[test]
    fn status_without_a_string_function_names_the_library_and_code() {
        let error = check(BlasKind::Hipblas, None, "hipblasCreate", 6).unwrap_err();
        assert_eq!(
            error.to_string(),
            "hipblasCreate failed with status 6 (hipBLAS status 6)"
        );
        assert!(check(BlasKind::Cublas, None, "cublasGemmEx", 0).is_ok());
    }
}
