//! The device listing behind `ember devices`: which runtimes were looked for and loaded, each GPU
//! with its architecture, memory, VMM support, the pool it would get and why, and the kernels this
//! build has for it.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use crate::cuda::CudaDriver;
use crate::driver::{describe_attempts, Backend, DeviceOrdinal, Driver, DriverError, RuntimeInfo};
use crate::hip::{HipDriver, HipLoadOptions};
use crate::kernels::{available_archs, default_kernels_dir, find_code_object, KERNEL_MODULES};
use crate::peer::DriverPeerLink;
use crate::pool::{format_bytes, select_pool, PoolKind, PoolSelectOptions};

/// A runtime's load result, as `list_with` takes it.
pub type DriverLoad = (Backend, Result<Arc<dyn Driver>, DriverError>);

/// What to look for and how to judge it.
#[derive(Clone, Debug, Default)]
pub struct ListOptions {
    /// `--rocm-path`.
    pub rocm_path: Option<PathBuf>,
    /// Where code objects are (`None`: [`default_kernels_dir`]).
    pub kernels_dir: Option<PathBuf>,
    pub pool: PoolSelectOptions,
    /// Run the VMM probe (touches each device); without it the listing reports the gate and the
    /// device's VMM attribute only.
    pub probe: bool,
}

/// One runtime: loaded, or why not.
#[derive(Clone, Debug)]
pub struct RuntimeReport {
    pub backend: Backend,
    pub outcome: Result<RuntimeInfo, DriverError>,
}

/// One GPU.
#[derive(Clone, Debug)]
pub struct DeviceEntry {
    pub backend: Backend,
    pub ordinal: DeviceOrdinal,
    pub name: String,
    pub arch: String,
    pub total_memory: u64,
    pub free_memory: Option<u64>,
    pub vmm_supported: bool,
    pub integrated: bool,
    pub pool: PoolKind,
    pub pool_reason: String,
    /// Kernel modules this build has for the device, or what is missing.
    pub kernels: Result<Vec<&'static str>, String>,
}

/// A device that could not be queried.
#[derive(Clone, Debug)]
pub struct DeviceFailure {
    pub backend: Backend,
    pub ordinal: DeviceOrdinal,
    pub error: DriverError,
}

/// Everything `ember devices` prints.
#[derive(Clone, Debug)]
pub struct DeviceListing {
    pub runtimes: Vec<RuntimeReport>,
    pub devices: Vec<DeviceEntry>,
    pub failures: Vec<DeviceFailure>,
    pub kernels_dir: PathBuf,
    pub kernel_archs: Vec<String>,
    /// The peer path between the listed GPUs, in listing order (each GPU's driver and
    /// ordinal): for the peer-copy self-test of a probing listing. `None` with fewer than two.
    pub peer_link: Option<DriverPeerLink>,
}

impl DeviceListing {
    /// Whether no usable GPU was found (ember then runs on the CPU).
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }
}

/// Loads the HIP and CUDA drivers (whichever are present) and lists their devices.
pub fn list(options: &ListOptions) -> DeviceListing {
    let hip = HipDriver::load(&HipLoadOptions {
        rocm_path: options.rocm_path.clone(),
        search_system: true,
    })
    .map(|d| Arc::new(d) as Arc<dyn Driver>);
    let cuda = CudaDriver::load().map(|d| Arc::new(d) as Arc<dyn Driver>);
    list_with(vec![(Backend::Hip, hip), (Backend::Cuda, cuda)], options)
}

/// Lists devices of already-loaded (or failed) drivers.
pub fn list_with(drivers: Vec<DriverLoad>, options: &ListOptions) -> DeviceListing {
    let kernels_dir = options
        .kernels_dir
        .clone()
        .unwrap_or_else(default_kernels_dir);
    let mut listing = DeviceListing {
        runtimes: Vec::new(),
        devices: Vec::new(),
        failures: Vec::new(),
        kernel_archs: available_archs(&kernels_dir),
        kernels_dir,
        peer_link: None,
    };
    let mut peer_devices: Vec<(Arc<dyn Driver>, DeviceOrdinal)> = Vec::new();
    for (backend, driver) in drivers {
        let driver = match driver {
            Ok(driver) => driver,
            Err(error) => {
                listing.runtimes.push(RuntimeReport {
                    backend,
                    outcome: Err(error),
                });
                continue;
            }
        };
        listing.runtimes.push(RuntimeReport {
            backend,
            outcome: Ok(driver.runtime_info()),
        });
        let count = match driver.device_count() {
            Ok(count) => count,
            Err(error) => {
                listing.failures.push(DeviceFailure {
                    backend,
                    ordinal: 0,
                    error,
                });
                continue;
            }
        };
        for ordinal in 0..count {
            match entry(&*driver, ordinal, options, &listing.kernels_dir) {
                Ok(entry) => {
                    listing.devices.push(entry);
                    peer_devices.push((Arc::clone(&driver), ordinal));
                }
                Err(error) => listing.failures.push(DeviceFailure {
                    backend,
                    ordinal,
                    error,
                }),
            }
        }
    }
    if peer_devices.len() > 1 {
        listing.peer_link = Some(DriverPeerLink::new(peer_devices));
    }
    listing
}

fn entry(
    driver: &dyn Driver,
    ordinal: DeviceOrdinal,
    options: &ListOptions,
    kernels_dir: &std::path::Path,
) -> Result<DeviceEntry, DriverError> {
    let info = driver.device_info(ordinal)?;
    let free_memory = driver.mem_info(ordinal).ok().map(|m| m.free);
    let (pool, pool_reason) = if options.probe {
        let selection = select_pool(driver, ordinal, &options.pool, None);
        (selection.kind, selection.reason)
    } else if !options.pool.vmm_gate {
        let why = options
            .pool
            .vmm_gate_reason
            .as_deref()
            .unwrap_or("no reason recorded");
        (
            PoolKind::Caching,
            format!("caching pool: the build manifest gates VMM off for this target ({why})"),
        )
    } else if !info.vmm_supported {
        (
            PoolKind::Caching,
            "caching pool: the device reports no virtual memory management support".to_string(),
        )
    } else {
        (
            PoolKind::Vmm,
            "vmm pool if the start-up probe passes (not run for this listing)".to_string(),
        )
    };
    let mut present = Vec::new();
    let mut missing = None;
    for spec in KERNEL_MODULES {
        match find_code_object(kernels_dir, &info.arch, spec.module) {
            Ok(_) => present.push(spec.stem),
            Err(error) => {
                missing.get_or_insert(error.to_string());
            }
        }
    }
    let kernels = match missing {
        None => Ok(present),
        Some(first_error) if present.is_empty() => Err(first_error),
        Some(first_error) => Err(format!(
            "only {} present; {first_error}",
            present.join(", ")
        )),
    };
    Ok(DeviceEntry {
        backend: driver.backend(),
        ordinal,
        name: info.name,
        arch: info.arch,
        total_memory: info.total_memory,
        free_memory,
        vmm_supported: info.vmm_supported,
        integrated: info.integrated,
        pool,
        pool_reason,
        kernels,
    })
}

impl fmt::Display for DeviceListing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "runtimes:")?;
        for runtime in &self.runtimes {
            match &runtime.outcome {
                Ok(info) => {
                    writeln!(f, "  {info}")?;
                    if !info.attempts.is_empty() {
                        writeln!(f, "    looked for: {}", describe_attempts(&info.attempts))?;
                    }
                }
                Err(error) => writeln!(f, "  {}: not available: {error}", runtime.backend)?,
            }
        }
        let archs = if self.kernel_archs.is_empty() {
            "none".to_string()
        } else {
            self.kernel_archs.join(", ")
        };
        writeln!(
            f,
            "kernels: {} (architectures: {archs})",
            self.kernels_dir.display()
        )?;
        if self.devices.is_empty() && self.failures.is_empty() {
            return writeln!(f, "devices: none; ember runs on the CPU");
        }
        writeln!(f, "devices:")?;
        for d in &self.devices {
            let free = d
                .free_memory
                .map(format_bytes)
                .unwrap_or_else(|| "unknown".to_string());
            let kind = if d.integrated { ", integrated" } else { "" };
            writeln!(
                f,
                "  {}:{} {} ({}{kind})",
                d.backend, d.ordinal, d.name, d.arch
            )?;
            writeln!(
                f,
                "    vram: {} total, {free} free",
                format_bytes(d.total_memory)
            )?;
            writeln!(
                f,
                "    vmm: {}; {}",
                if d.vmm_supported {
                    "supported"
                } else {
                    "not supported"
                },
                d.pool_reason
            )?;
            match &d.kernels {
                Ok(modules) => writeln!(
                    f,
                    "    kernels: all {} modules ({})",
                    modules.len(),
                    modules.join(", ")
                )?,
                Err(error) => writeln!(f, "    kernels: {error}")?,
            }
        }
        for failure in &self.failures {
            writeln!(
                f,
                "  {}:{} could not be queried: {}",
                failure.backend, failure.ordinal, failure.error
            )?;
        }
        Ok(())
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::host::{HostDriver, HostDriverConfig};

    #[test]
    fn listing_shows_runtimes_devices_pools_and_kernels() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("gfx1100")).unwrap();
        for spec in KERNEL_MODULES {
            std::fs::write(
                dir.path()
                    .join("gfx1100")
                    .join(format!("{}.hsaco", spec.stem)),
                b"x",
            )
            .unwrap();
        }
        let host = HostDriver::new(HostDriverConfig {
            device_name: "Radeon test".to_string(),
            arch: "gfx1201:sramecc-:xnack-".to_string(),
            ..HostDriverConfig::default()
        });
        let missing = DriverError::LibraryNotFound {
            runtime: "CUDA",
            attempts: vec![crate::driver::LibraryAttempt {
                candidate: "libcuda.so".to_string(),
                outcome: crate::driver::AttemptOutcome::LoadFailed(
                    "libcuda.so: cannot open shared object file".to_string(),
                ),
            }],
            hint: "install the NVIDIA driver".to_string(),
        };
        let options = ListOptions {
            kernels_dir: Some(dir.path().to_path_buf()),
            pool: PoolSelectOptions {
                vmm_gate: false,
                vmm_gate_reason: Some("hipMemSetAccess faults on gfx1201".to_string()),
                force_probe_failure: false,
            },
            ..ListOptions::default()
        };
        let listing = list_with(
            vec![
                (Backend::Host, Ok(Arc::new(host) as Arc<dyn Driver>)),
                (Backend::Cuda, Err(missing)),
            ],
            &options,
        );
        let text = listing.to_string();
        for expected in [
            "cuda: not available: no CUDA runtime library could be loaded; tried: libcuda.so (load failed:",
            "host:0 Radeon test (gfx1201)",
            "vram: 1.0 GiB total, 1.0 GiB free",
            "gates VMM off for this target (hipMemSetAccess faults on gfx1201)",
            "kernels: no memory kernels for architecture gfx1201",
            "this build has gfx1100",
            "(architectures: gfx1100)",
        ] {
            assert!(text.contains(expected), "missing {expected:?} in\n{text}");
        }
        assert_eq!(listing.devices[0].pool, PoolKind::Caching);
    }

    #[test]
    fn probing_listing_uses_the_probe_result() {
        let host = HostDriver::new(HostDriverConfig {
            arch: "gfx1151".to_string(),
            ..HostDriverConfig::default()
        });
        let options = ListOptions {
            kernels_dir: Some(tempfile::tempdir().unwrap().path().to_path_buf()),
            pool: PoolSelectOptions {
                vmm_gate: true,
                vmm_gate_reason: None,
                force_probe_failure: false,
            },
            probe: true,
            ..ListOptions::default()
        };
        let listing = list_with(
            vec![(Backend::Host, Ok(Arc::new(host) as Arc<dyn Driver>))],
            &options,
        );
        assert_eq!(
            listing.devices[0].pool,
            PoolKind::Vmm,
            "{}",
            listing.devices[0].pool_reason
        );
        assert!(listing.to_string().contains("probe passed"), "{listing}");
    }

    #[test]
    fn a_listing_of_several_gpus_carries_their_peer_link_for_the_self_test() {
        use crate::peer::{plan_pairs, PeerGate};

        let drivers: Vec<Arc<HostDriver>> = (0..2)
            .map(|ordinal| {
                Arc::new(HostDriver::new(HostDriverConfig {
                    ordinal,
                    corrupt_peer_from: if ordinal == 1 { vec![0] } else { Vec::new() },
                    ..HostDriverConfig::default()
                }))
            })
            .collect();
        HostDriver::connect_peers(&drivers);
        let listing = list_with(
            drivers
                .iter()
                .map(|d| (Backend::Host, Ok(Arc::clone(d) as Arc<dyn Driver>)))
                .collect(),
            &ListOptions::default(),
        );
        // The second host driver answers for ordinals 0 and 1 but is only device 1.
        let listed: Vec<DeviceOrdinal> = listing.devices.iter().map(|d| d.ordinal).collect();
        assert_eq!(listed, [0, 1]);
        let link = listing
            .peer_link
            .as_ref()
            .expect("two GPUs have a peer link");
        let pairs = plan_pairs(2, PeerGate::Probe, Some(link));
        // Copies into device 1 from device 0 corrupt: the pair falls back both ways.
        assert!(pairs.iter().all(|p| !p.peer), "{pairs:?}");
        assert!(pairs[0].reason.contains("arrived changed"), "{pairs:?}");
        let one = list_with(
            vec![(
                Backend::Host,
                Ok(Arc::clone(&drivers[0]) as Arc<dyn Driver>),
            )],
            &ListOptions::default(),
        );
        assert!(one.peer_link.is_none());
    }

    #[test]
    fn no_runtime_means_cpu() {
        let listing = list_with(vec![], &ListOptions::default());
        assert!(listing
            .to_string()
            .contains("devices: none; ember runs on the CPU"));
    }
}
