//! Finding and opening a GPU: loading the runtime (HIP or CUDA, at run time), checking that this
//! build has kernels for the device's architecture, choosing the device's memory pool (the build
//! manifest's VMM gate, then the start-up probe, then the caching pool with a reason),
//! creating the ops context, and setting the backend's numerics mode.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use ember_gpu::cuda::CudaDriver;
use ember_gpu::hip::{HipDriver, HipLoadOptions};
use ember_gpu::kernels::{default_kernels_dir, find_code_object, KernelLibrary, KERNEL_MODULES};
use ember_gpu::ops::{GpuContext, OpsError};
use ember_gpu::pool::{PoolSelectOptions, ProbeTouch};
use ember_gpu::{
    DeviceInfo, DeviceOrdinal, DevicePool, DevicePtr, Driver, DriverError, PoolConfig, PoolError,
    StreamHandle,
};

use super::numerics::{self, Numerics, NumericsError};
use super::GpuBackend;

/// A GPU runtime.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GpuKind {
    Cuda,
    Hip,
}

impl GpuKind {
    /// The prefix of device names (`cuda:0`) and the backend's name.
    pub fn name(self) -> &'static str {
        match self {
            GpuKind::Cuda => "cuda",
            GpuKind::Hip => "hip",
        }
    }
}

impl fmt::Display for GpuKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How to find and open a GPU.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    /// A runtime and a device ordinal, or `None` for the first usable GPU of any runtime (HIP
    /// first, then CUDA).
    pub device: Option<(GpuKind, DeviceOrdinal)>,
    /// `--rocm-path`: where to load the HIP runtime from first.
    pub rocm_path: Option<PathBuf>,
    /// Where the per-architecture code objects are (`None`: beside the binary, or
    /// `EMBER_KERNELS_DIR`).
    pub kernels_dir: Option<PathBuf>,
    /// `--vram-budget` in bytes.
    pub budget: Option<u64>,
    /// Run the idle-trimming thread (tests that drive trimming themselves turn it off).
    pub idle_trim: bool,
    /// `--numerics`: how the ops round; `None` takes `EMBER_GPU_NUMERICS`, else `fast`.
    pub numerics: Option<Numerics>,
    /// The CPU thread count the reference numerics reproduce; `None` takes
    /// `EMBER_REFERENCE_THREADS`, else 2.
    pub reference_threads: Option<usize>,
}

/// Why no GPU could be opened.
#[derive(Debug, thiserror::Error)]
pub enum GpuOpenError {
    // The causes are in the messages and deliberately not `source`s: anyhow's `{:#}` would
    // print them twice.
    /// The runtime library is missing or unusable.
    #[error("the {kind} runtime is not available: {}", runtime_problem(.error))]
    Runtime { kind: GpuKind, error: DriverError },
    /// The runtime has no such device.
    #[error("{kind}:{ordinal} does not exist: the {kind} runtime reports {count} device(s)")]
    NoSuchDevice {
        kind: GpuKind,
        ordinal: DeviceOrdinal,
        count: usize,
    },
    /// The device could not be queried.
    #[error("{kind}:{ordinal} could not be queried: {error}")]
    Query {
        kind: GpuKind,
        ordinal: DeviceOrdinal,
        error: DriverError,
    },
    /// This build has no kernels for the device's architecture.
    #[error("{kind}:{ordinal} ({name}, architecture {arch}) has no kernels in this build: {detail}; run with --device cpu, or use a build for {arch}")]
    NoKernels {
        kind: GpuKind,
        ordinal: DeviceOrdinal,
        name: String,
        arch: String,
        detail: String,
    },
    /// Automatic selection found no usable GPU; each entry says why a runtime or device was
    /// passed over.
    #[error("no usable GPU: {}", .reasons.join("; "))]
    NoneUsable { reasons: Vec<String> },
    /// The memory pool could not be created.
    #[error("{kind}:{ordinal}: creating the memory pool failed: {error}")]
    Pool {
        kind: GpuKind,
        ordinal: DeviceOrdinal,
        error: PoolError,
    },
    /// The ops context (stream, kernels, BLAS) could not be created.
    #[error("{kind}:{ordinal}: creating the ops context failed: {error}")]
    Context {
        kind: GpuKind,
        ordinal: DeviceOrdinal,
        error: OpsError,
    },
    /// The numerics settings (flag or environment) are not valid.
    #[error(transparent)]
    Numerics(#[from] NumericsError),
}

/// A device chosen to run on, before its pool and context exist.
#[derive(Clone)]
pub struct GpuSelection {
    pub kind: GpuKind,
    pub ordinal: DeviceOrdinal,
    pub driver: Arc<dyn Driver>,
    pub info: DeviceInfo,
    pub kernels_dir: PathBuf,
}

impl fmt::Debug for GpuSelection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GpuSelection")
            .field("device", &format_args!("{}:{}", self.kind, self.ordinal))
            .field("name", &self.info.name)
            .field("arch", &self.info.arch)
            .finish()
    }
}

fn load_driver(kind: GpuKind, options: &OpenOptions) -> Result<Arc<dyn Driver>, GpuOpenError> {
    let loaded: Result<Arc<dyn Driver>, DriverError> = match kind {
        GpuKind::Hip => HipDriver::load(&HipLoadOptions {
            rocm_path: options.rocm_path.clone(),
            search_system: true,
        })
        .map(|d| Arc::new(d) as Arc<dyn Driver>),
        GpuKind::Cuda => CudaDriver::load().map(|d| Arc::new(d) as Arc<dyn Driver>),
    };
    loaded.map_err(|error| GpuOpenError::Runtime { kind, error })
}

/// Checks that every kernel module exists for `info.arch` in `dir`.
fn check_kernels(
    kind: GpuKind,
    ordinal: DeviceOrdinal,
    info: &DeviceInfo,
    dir: &std::path::Path,
) -> Result<(), GpuOpenError> {
    for spec in KERNEL_MODULES {
        if let Err(error) = find_code_object(dir, &info.arch, spec.module) {
            return Err(GpuOpenError::NoKernels {
                kind,
                ordinal,
                name: info.name.clone(),
                arch: info.arch.clone(),
                detail: error.to_string(),
            });
        }
    }
    Ok(())
}

/// Picks the device: the one asked for (checked), or the first GPU whose architecture has
/// kernels in this build.
pub fn select(options: &OpenOptions) -> Result<GpuSelection, GpuOpenError> {
    let kernels_dir = options
        .kernels_dir
        .clone()
        .unwrap_or_else(default_kernels_dir);
    if let Some((kind, ordinal)) = options.device {
        let driver = load_driver(kind, options)?;
        let count = driver.device_count().map_err(|error| GpuOpenError::Query {
            kind,
            ordinal,
            error,
        })?;
        if ordinal >= count {
            return Err(GpuOpenError::NoSuchDevice {
                kind,
                ordinal,
                count,
            });
        }
        let info = driver
            .device_info(ordinal)
            .map_err(|error| GpuOpenError::Query {
                kind,
                ordinal,
                error,
            })?;
        check_kernels(kind, ordinal, &info, &kernels_dir)?;
        return Ok(GpuSelection {
            kind,
            ordinal,
            driver,
            info,
            kernels_dir,
        });
    }
    let mut reasons = Vec::new();
    for kind in [GpuKind::Hip, GpuKind::Cuda] {
        let driver = match load_driver(kind, options) {
            Ok(driver) => driver,
            Err(GpuOpenError::Runtime { error, .. }) => {
                reasons.push(format!("{kind}: {}", short(&error)));
                continue;
            }
            Err(other) => {
                reasons.push(other.to_string());
                continue;
            }
        };
        let count = match driver.device_count() {
            Ok(count) => count,
            Err(error) => {
                reasons.push(format!("{kind}: counting devices failed ({error})"));
                continue;
            }
        };
        if count == 0 {
            reasons.push(format!("{kind}: no devices"));
        }
        for ordinal in 0..count {
            let info = match driver.device_info(ordinal) {
                Ok(info) => info,
                Err(error) => {
                    reasons.push(format!("{kind}:{ordinal}: query failed ({error})"));
                    continue;
                }
            };
            match check_kernels(kind, ordinal, &info, &kernels_dir) {
                Ok(()) => {
                    return Ok(GpuSelection {
                        kind,
                        ordinal,
                        driver,
                        info,
                        kernels_dir,
                    })
                }
                Err(error) => reasons.push(error.to_string()),
            }
        }
    }
    Err(GpuOpenError::NoneUsable { reasons })
}

/// The first line of a driver error: enough to say why a runtime was passed over.
fn short(error: &DriverError) -> String {
    match error {
        DriverError::LibraryNotFound { runtime, .. } => {
            format!("runtime not loaded (no {runtime} library found)")
        }
        // The library loaded; its initialisation or first query failed.
        DriverError::Call { .. } => format!("runtime library loaded, but {error}"),
        other => format!("runtime not usable ({other})"),
    }
}

/// Why a runtime asked for by name cannot be used, in a line: how many library names were tried
/// (not each of them: `ember devices -v` lists them) and what to install, or which call of a
/// loaded library failed.
fn runtime_problem(error: &DriverError) -> String {
    match error {
        DriverError::LibraryNotFound {
            runtime,
            attempts,
            hint,
        } => format!(
            "no {runtime} library found ({} names tried; `ember devices -v` lists them); {hint}",
            attempts.len()
        ),
        DriverError::Call { .. } => format!("its library loaded, but {error}"),
        other => other.to_string(),
    }
}

/// What [`open`] made, with the facts the CLI prints.
pub struct Opened {
    pub backend: GpuBackend,
    /// `cuda:0`.
    pub device: String,
    pub info: DeviceInfo,
    /// Why the pool kind was chosen (printed at load so a forced or failed VMM probe is seen).
    pub pool_reason: String,
}

/// Creates the pool (with the VMM probe touching memory through the device's fill kernel), the
/// ops context and the backend.
pub fn open(selection: GpuSelection, options: &OpenOptions) -> Result<Opened, GpuOpenError> {
    let GpuSelection {
        kind,
        ordinal,
        driver,
        info,
        kernels_dir,
    } = selection;
    // Bad settings are refused before any device memory is touched.
    let numerics = Numerics::resolve(options.numerics)?;
    let reference_threads = match options.reference_threads {
        Some(threads) => threads,
        None => numerics::reference_threads_from_env()?,
    };
    let kernels = Arc::new(KernelLibrary::new(kernels_dir));
    // A runtime from another major ROCm release than the build's is the set-up the reports behind
    // this project traced misplaced weights to; say so at start rather than let it pass silently.
    if let (GpuKind::Hip, Ok(manifest)) = (kind, crate::build_manifest::manifest()) {
        let runtime = driver.runtime_info();
        let library = runtime
            .library
            .as_ref()
            .map_or_else(|| runtime.backend.to_string(), |p| p.display().to_string());
        if let Some(warning) = crate::build_manifest::rocm_release_mismatch(
            manifest.rocm.release.as_deref(),
            runtime.runtime_version,
            &library,
        ) {
            tracing::warn!("{warning}");
        }
    }
    // The build's VMM gate is the run-time default; a development build has no gate and lets the
    // probe decide (as `ember devices` does).
    let vmm = crate::build_manifest::feature("vmm");
    let vmm_gate = vmm.is_none_or(|f| f.enabled);
    let vmm_reason = vmm.and_then(|f| f.reason.clone());
    let select_options = PoolSelectOptions::from_env(vmm_gate, vmm_reason);
    let config = PoolConfig {
        budget: options.budget,
        ..PoolConfig::default()
    };
    let touch_kernels = Arc::clone(&kernels);
    let touch = move |driver: &dyn Driver,
                      device: DeviceOrdinal,
                      ptr: DevicePtr,
                      count: u64,
                      value: u32,
                      stream: StreamHandle|
          -> Result<(), DriverError> {
        touch_kernels
            .fill_u32(driver, device, ptr, count, value, stream)
            .map_err(|error| DriverError::KernelFailed {
                name: "ember_fill_u32".to_string(),
                reason: error.to_string(),
            })
    };
    let touch: ProbeTouch<'_> = &touch;
    let pool = DevicePool::new(
        Arc::clone(&driver),
        ordinal,
        &select_options,
        config,
        Some(touch),
    )
    .map_err(|error| GpuOpenError::Pool {
        kind,
        ordinal,
        error,
    })?;
    let pool_kind = pool.kind();
    let pool_reason = pool.reason().to_string();
    let ctx = GpuContext::new(Arc::new(pool), kernels).map_err(|error| GpuOpenError::Context {
        kind,
        ordinal,
        error,
    })?;
    let device = format!("{kind}:{ordinal}");
    let description = format!("{device} {} ({}), {pool_kind} pool", info.name, info.arch);
    let mut backend = GpuBackend::new(ctx, kind.name(), description, options.idle_trim);
    backend.set_reference_threads(reference_threads);
    backend.set_numerics(numerics);
    tracing::info!(%device, %numerics, reference_threads, "numerics mode");
    Ok(Opened {
        backend,
        device,
        info,
        pool_reason,
    })
}
