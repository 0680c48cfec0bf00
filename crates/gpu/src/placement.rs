//! Verifying that weights really live in VRAM after load.
//!
//! On some installs the runtime silently places "device" allocations in system memory and the
//! only symptom is speed. After load the engine observes, for every weight buffer, what the
//! runtime's pointer attributes say, and how far the device's free memory dropped; the pure rules
//! in [`evaluate`] turn that into a verdict: fine, a warning (with `--allow-host-weights`, or on a
//! unified-memory APU where host placement is expected), or an error naming the likely causes.

use std::fmt;
use std::path::PathBuf;

use thiserror::Error;

use crate::driver::{Backend, DeviceOrdinal, DevicePtr, Driver, DriverError, MemoryType};
use crate::pool::format_bytes;

/// Default tolerance on the free-memory drop: runtimes round allocations and reserve some memory
/// of their own, so the drop can be a little smaller than what the buffers add up to.
pub const DEFAULT_SLACK_BYTES: u64 = 64 << 20;

/// Where one weight buffer lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferObservation {
    pub name: String,
    pub bytes: u64,
    pub memory_type: MemoryType,
}

/// Everything the placement rules look at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementObservation {
    pub device: DeviceOrdinal,
    pub device_name: String,
    pub backend: Backend,
    /// The runtime library that was loaded, and other installs found on the host.
    pub runtime_library: Option<PathBuf>,
    pub other_runtime_libraries: Vec<PathBuf>,
    /// An integrated GPU sharing system memory.
    pub integrated: bool,
    pub free_before: u64,
    pub free_after: u64,
    pub buffers: Vec<BufferObservation>,
}

/// How strict to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlacementPolicy {
    /// Warn instead of refusing (`--allow-host-weights`).
    pub allow_host_weights: bool,
    pub slack_bytes: u64,
}

impl Default for PlacementPolicy {
    fn default() -> Self {
        PlacementPolicy {
            allow_host_weights: false,
            slack_bytes: DEFAULT_SLACK_BYTES,
        }
    }
}

/// A placement that passed (possibly with warnings to print).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementVerdict {
    pub placed_bytes: u64,
    pub free_drop: u64,
    pub warnings: Vec<String>,
}

#[derive(Clone, Debug, Error, PartialEq, Eq)]
#[error("weights are not in VRAM on device {device} ({device_name}): {}; likely causes: {}; pass --allow-host-weights to run anyway", .problems.join("; "), .likely_causes.join("; "))]
pub struct PlacementError {
    pub device: DeviceOrdinal,
    pub device_name: String,
    pub problems: Vec<String>,
    pub likely_causes: Vec<String>,
}

/// Applies the placement rules. See the module docs.
pub fn evaluate(
    observation: &PlacementObservation,
    policy: &PlacementPolicy,
) -> Result<PlacementVerdict, PlacementError> {
    let placed_bytes: u64 = observation.buffers.iter().map(|b| b.bytes).sum();
    let free_drop = observation
        .free_before
        .saturating_sub(observation.free_after);
    let mut problems = Vec::new();

    let off_device: Vec<&BufferObservation> = observation
        .buffers
        .iter()
        .filter(|b| b.memory_type != MemoryType::Device)
        .collect();
    if let Some(first) = off_device.first() {
        let bytes: u64 = off_device.iter().map(|b| b.bytes).sum();
        problems.push(format!(
            "{} of {} weight buffers ({} of {}) are not device memory, e.g. {} is {} memory",
            off_device.len(),
            observation.buffers.len(),
            format_bytes(bytes),
            format_bytes(placed_bytes),
            first.name,
            first.memory_type
        ));
    }
    let expected_drop = placed_bytes.saturating_sub(policy.slack_bytes);
    if free_drop < expected_drop {
        problems.push(format!(
            "device free memory dropped by {} while {} of weights were placed (expected a drop of at least {}, allowing {} of slack)",
            format_bytes(free_drop),
            format_bytes(placed_bytes),
            format_bytes(expected_drop),
            format_bytes(policy.slack_bytes)
        ));
    }
    if problems.is_empty() {
        return Ok(PlacementVerdict {
            placed_bytes,
            free_drop,
            warnings: Vec::new(),
        });
    }

    if observation.integrated {
        // An APU's "VRAM" is carved from system memory; host-typed pointers and a free-memory
        // figure that barely moves are normal there.
        let warnings = problems
            .into_iter()
            .map(|p| {
                format!(
                    "{p} (expected on {}, an integrated GPU sharing system memory)",
                    observation.device_name
                )
            })
            .collect();
        return Ok(PlacementVerdict {
            placed_bytes,
            free_drop,
            warnings,
        });
    }

    let likely_causes = likely_causes(observation);
    if policy.allow_host_weights {
        let warnings = problems
            .into_iter()
            .map(|p| format!("{p}; likely causes: {}", likely_causes.join("; ")))
            .collect();
        return Ok(PlacementVerdict {
            placed_bytes,
            free_drop,
            warnings,
        });
    }
    Err(PlacementError {
        device: observation.device,
        device_name: observation.device_name.clone(),
        problems,
        likely_causes,
    })
}

fn likely_causes(observation: &PlacementObservation) -> Vec<String> {
    let mut causes = Vec::new();
    let loaded = observation
        .runtime_library
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_else(|| format!("the {} runtime", observation.backend));
    if !observation.other_runtime_libraries.is_empty() {
        let others: Vec<String> = observation
            .other_runtime_libraries
            .iter()
            .map(|p| p.display().to_string())
            .collect();
        causes.push(format!(
            "several runtime installs on this host: loaded {loaded}, also found {} (a mismatch between the runtime and the kernel driver can place memory in RAM)",
            others.join(", ")
        ));
    }
    causes.push(format!("the loaded runtime ({loaded}) fell back to host memory (check that the GPU kernel driver is loaded and that this user may access it)"));
    causes.push("another process allocated or freed device memory during load (the free-memory drop is then misleading)".to_string());
    causes
}

/// Observes where `buffers` (name, pointer, bytes) live on `device`. `free_before` is the device's
/// free memory before the weights were placed.
pub fn observe(
    driver: &dyn Driver,
    device: DeviceOrdinal,
    buffers: &[(&str, DevicePtr, u64)],
    free_before: u64,
) -> Result<PlacementObservation, DriverError> {
    let info = driver.device_info(device)?;
    let runtime = driver.runtime_info();
    let free_after = driver.mem_info(device)?.free;
    let mut observed = Vec::with_capacity(buffers.len());
    for &(name, ptr, bytes) in buffers {
        let pointer = driver.pointer_info(device, ptr)?;
        observed.push(BufferObservation {
            name: name.to_string(),
            bytes,
            memory_type: pointer.memory_type,
        });
    }
    Ok(PlacementObservation {
        device,
        device_name: info.name,
        backend: driver.backend(),
        runtime_library: runtime.library,
        other_runtime_libraries: runtime.other_installs,
        integrated: info.integrated,
        free_before,
        free_after,
        buffers: observed,
    })
}

impl fmt::Display for PlacementVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} of weights placed, device free memory dropped by {}",
            format_bytes(self.placed_bytes),
            format_bytes(self.free_drop)
        )?;
        for warning in &self.warnings {
            write!(f, "\n  warning: {warning}")?;
        }
        Ok(())
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use crate::driver::StreamHandle;
    use crate::host::{HostDriver, HostDriverConfig};
    use crate::pool::{DevicePool, PoolConfig, PoolKind, Purpose};
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;

    fn observation(types: &[MemoryType], free_drop: u64) -> PlacementObservation {
        PlacementObservation {
            device: 0,
            device_name: "Radeon RX 9070 XT".to_string(),
            backend: Backend::Hip,
            runtime_library: Some(PathBuf::from("/opt/rocm-6.4.0/lib/libamdhip64.so.6")),
            other_runtime_libraries: vec![],
            integrated: false,
            free_before: 16 << 30,
            free_after: (16 << 30) - free_drop,
            buffers: types
                .iter()
                .enumerate()
                .map(|(i, &t)| BufferObservation {
                    name: format!("blk.{i}.attn_q.weight"),
                    bytes: 512 * MIB,
                    memory_type: t,
                })
                .collect(),
        }
    }

    #[test]
    fn device_memory_with_a_matching_drop_passes() {
        let verdict = evaluate(
            &observation(&[MemoryType::Device; 4], 2048 * MIB),
            &PlacementPolicy::default(),
        )
        .unwrap();
        assert_eq!(verdict.placed_bytes, 2048 * MIB);
        assert!(verdict.warnings.is_empty());
    }

    #[test]
    fn a_drop_within_the_slack_passes_and_beyond_it_fails() {
        let policy = PlacementPolicy::default();
        assert!(evaluate(
            &observation(&[MemoryType::Device; 4], 2048 * MIB - 60 * MIB),
            &policy
        )
        .is_ok());
        let error = evaluate(
            &observation(&[MemoryType::Device; 4], 2048 * MIB - 100 * MIB),
            &policy,
        )
        .unwrap_err();
        assert_eq!(error.problems.len(), 1);
        assert!(
            error.problems[0].contains("dropped by 1.9 GiB while 2.0 GiB of weights were placed"),
            "{}",
            error.problems[0]
        );
    }

    #[test]
    fn host_memory_is_refused_with_likely_causes() {
        let mut obs = observation(
            &[
                MemoryType::Device,
                MemoryType::Host,
                MemoryType::Host,
                MemoryType::Device,
            ],
            1024 * MIB,
        );
        obs.other_runtime_libraries = vec![PathBuf::from("/opt/rocm-7.0.0/lib/libamdhip64.so.7")];
        let error = evaluate(&obs, &PlacementPolicy::default()).unwrap_err();
        let text = error.to_string();
        assert!(text.contains("2 of 4 weight buffers (1.0 GiB of 2.0 GiB) are not device memory, e.g. blk.1.attn_q.weight is host memory"), "{text}");
        assert!(text.contains("several runtime installs on this host: loaded /opt/rocm-6.4.0/lib/libamdhip64.so.6, also found /opt/rocm-7.0.0/lib/libamdhip64.so.7"), "{text}");
        assert!(text.contains("fell back to host memory"), "{text}");
        assert!(text.contains("--allow-host-weights"), "{text}");
    }

    #[test]
    fn allow_host_weights_turns_the_error_into_warnings() {
        let policy = PlacementPolicy {
            allow_host_weights: true,
            ..PlacementPolicy::default()
        };
        let verdict = evaluate(&observation(&[MemoryType::Managed; 2], 0), &policy).unwrap();
        assert_eq!(verdict.warnings.len(), 2);
        assert!(
            verdict.warnings[0].contains("managed memory"),
            "{}",
            verdict.warnings[0]
        );
        assert!(verdict.to_string().contains("warning:"));
    }

    #[test]
    fn integrated_gpus_expect_host_placement() {
        let mut obs = observation(&[MemoryType::Host; 2], 0);
        obs.integrated = true;
        let verdict = evaluate(&obs, &PlacementPolicy::default()).unwrap();
        assert_eq!(verdict.warnings.len(), 2);
        assert!(
            verdict.warnings[0].contains("integrated GPU"),
            "{}",
            verdict.warnings[0]
        );
    }

    fn place(config: HostDriverConfig) -> Result<PlacementVerdict, PlacementError> {
        let driver = Arc::new(HostDriver::new(config));
        let pool = DevicePool::with_kind(
            driver.clone(),
            0,
            PoolKind::Caching,
            "test".to_string(),
            PoolConfig::default(),
        )
        .unwrap();
        let free_before = driver.mem_info(0).unwrap().free;
        let buffers: Vec<_> = (0..3)
            .map(|_| pool.alloc(Purpose::Weights, 48 * MIB).unwrap())
            .collect();
        for b in &buffers {
            driver
                .memset_d8_async(0, b.ptr(), 1, b.len(), StreamHandle::DEFAULT)
                .unwrap();
        }
        let names = ["token_embd.weight", "blk.0.ffn_up.weight", "output.weight"];
        let listed: Vec<_> = buffers
            .iter()
            .zip(names)
            .map(|(b, n)| (n, b.ptr(), b.len()))
            .collect();
        let observation = observe(&*driver, 0, &listed, free_before).unwrap();
        evaluate(
            &observation,
            &PlacementPolicy {
                slack_bytes: 4 * MIB,
                ..PlacementPolicy::default()
            },
        )
    }

    #[test]
    fn observed_host_driver_placements() {
        let verdict = place(HostDriverConfig::default()).unwrap();
        assert_eq!(verdict.placed_bytes, 144 * MIB);
        assert!(verdict.free_drop >= 144 * MIB);

        let error = place(HostDriverConfig {
            reported_memory_type: MemoryType::Host,
            ..HostDriverConfig::default()
        })
        .unwrap_err();
        assert!(
            error.problems[0].contains("token_embd.weight is host memory"),
            "{error}"
        );

        let error = place(HostDriverConfig {
            free_memory_frozen: true,
            ..HostDriverConfig::default()
        })
        .unwrap_err();
        assert!(error.problems[0].contains("dropped by 0 B"), "{error}");
    }
}
