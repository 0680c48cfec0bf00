//! Simulated devices (`--device sim:0,sim:1,...`): devices that compute with the CPU's ops but
//! hold memory as a GPU does, so a layer split runs end to end, with every per-device memory
//! rule of a GPU, on a machine without one.
//!
//! Each simulated device is a [`HostDriver`] device (its ordinal is the `N` of `sim:N`) with a
//! [`DevicePool`] of its own: the pool code the GPUs use, with its budget (`--vram-budget`,
//! per device), accounting by purpose and trim to a floor. The split reserves from a device's
//! pool every byte it places or allocates there (weights, KV blocks, activation buffers, op
//! scratch; see [`super::split`]), so a device over its budget refuses what does not fit, and
//! the placement check observes the reserved weight buffers through the driver as it does on a
//! GPU. The values themselves stay where the CPU backend keeps them (the mapped file, its own
//! buffers): the reservation is the device's memory, untouched, so it costs address space and
//! not resident memory, and compute stays bit-identical to the CPU's.
//!
//! [`HOST_WEIGHTS_ENV`] (`EMBER_SIM_HOST_WEIGHTS=1`) makes the named devices' driver report
//! their memory as host memory, as a runtime that fell back to system RAM does, so the
//! placement check's refusal (and its warning under `--allow-host-weights`) can be exercised;
//! `EMBER_SIM_CORRUPT_PEER` ([`ember_gpu::peer`]) does the same for peer copies.
//!
//! The host driver maps memory with the Unix `mmap`: elsewhere there are no simulated devices.

#[cfg(unix)]
use std::sync::Arc;

#[cfg(unix)]
use ember_gpu::host::{HostDriver, HostDriverConfig};
#[cfg(unix)]
use ember_gpu::pool::{DevicePool, PoolConfig, PoolError, PoolKind};
#[cfg(unix)]
use ember_gpu::MemoryType;

/// The memory a simulated device has when no `--vram-budget` asks for more.
pub const SIM_DEVICE_MEMORY: u64 = 16 << 30;

/// The environment variable naming the simulated devices whose weights are observed in host
/// memory: device numbers separated by `,` (`1` for `sim:1`).
pub const HOST_WEIGHTS_ENV: &str = "EMBER_SIM_HOST_WEIGHTS";

/// One simulated device: its driver and its memory pool.
#[cfg(unix)]
#[derive(Debug, Clone)]
pub struct SimDevice {
    /// `sim:N`.
    pub name: String,
    pub driver: Arc<HostDriver>,
    pub pool: Arc<DevicePool>,
}

#[cfg(unix)]
impl SimDevice {
    /// Opens `sim:index` with `budget` bytes of VRAM budget (`None`: the whole device, of
    /// [`SIM_DEVICE_MEMORY`]); `host_weights` makes its driver report host memory.
    pub fn open(
        index: usize,
        budget: Option<u64>,
        host_weights: bool,
    ) -> Result<SimDevice, PoolError> {
        let name = format!("sim:{index}");
        let driver = Arc::new(HostDriver::new(HostDriverConfig {
            device_name: name.clone(),
            ordinal: index,
            arch: "sim".to_string(),
            total_memory: budget.unwrap_or(0).max(SIM_DEVICE_MEMORY),
            reported_memory_type: if host_weights {
                MemoryType::Host
            } else {
                MemoryType::Device
            },
            ..HostDriverConfig::default()
        }));
        // The caching pool: its blocks are the driver's own allocations, so a trim hands them
        // back and the device's free memory rises, as on a GPU without VMM.
        let pool = DevicePool::with_kind(
            driver.clone(),
            index,
            PoolKind::Caching,
            "a simulated device: the caching pool over host-driver memory".to_string(),
            PoolConfig {
                budget,
                ..PoolConfig::default()
            },
        )?;
        Ok(SimDevice {
            name,
            driver,
            pool: Arc::new(pool),
        })
    }

    /// Opens `sim:0` to `sim:{n - 1}`, the devices [`HOST_WEIGHTS_ENV`] names reporting host
    /// memory.
    pub fn open_all(n: usize, budget: Option<u64>) -> Result<Vec<SimDevice>, String> {
        let host_weights = host_weights_from_env(n)?;
        (0..n)
            .map(|i| {
                SimDevice::open(i, budget, host_weights.contains(&i))
                    .map_err(|error| format!("sim:{i}: {error}"))
            })
            .collect()
    }
}

/// The devices [`HOST_WEIGHTS_ENV`] names, checked against the `n` simulated devices; unset or
/// empty names none.
pub fn host_weights_from_env(n: usize) -> Result<Vec<usize>, String> {
    match std::env::var(HOST_WEIGHTS_ENV) {
        Ok(text) => parse_host_weights(&text, n),
        Err(_) => Ok(Vec::new()),
    }
}

/// Parses `N[,N...]`, device numbers below `n`.
pub fn parse_host_weights(text: &str, n: usize) -> Result<Vec<usize>, String> {
    text.split(',')
        .map(str::trim)
        .filter(|part| !part.is_empty())
        .map(|part| match part.parse::<usize>() {
            Ok(index) if index < n => Ok(index),
            _ => Err(format!(
                "{HOST_WEIGHTS_ENV}: expected numbers of the {n} simulated devices (0 to {}) separated by commas, found {text:?}",
                n.saturating_sub(1)
            )),
        })
        .collect()
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use ember_gpu::pool::Purpose;
    use ember_gpu::Driver;

    #[test]
    fn host_weights_lists_are_device_numbers() {
        assert_eq!(parse_host_weights("1", 2), Ok(vec![1]));
        assert_eq!(parse_host_weights(" 0, 2 ", 3), Ok(vec![0, 2]));
        assert_eq!(parse_host_weights("", 2), Ok(vec![]));
        let error = parse_host_weights("2", 2).unwrap_err();
        assert_eq!(
            error,
            "EMBER_SIM_HOST_WEIGHTS: expected numbers of the 2 simulated devices (0 to 1) separated by commas, found \"2\""
        );
        assert!(parse_host_weights("sim:1", 2).is_err());
    }

    #[test]
    fn a_simulated_device_is_its_ordinal_with_its_own_budget() {
        let device = SimDevice::open(2, Some(8 << 20), true).unwrap();
        assert_eq!(device.pool.device(), 2);
        let info = device.driver.device_info(2).unwrap();
        assert_eq!(info.name, "sim:2");
        assert!(device.driver.device_info(0).is_err());
        let buffer = device.pool.alloc(Purpose::Weights, 6 << 20).unwrap();
        let pointer = device.driver.pointer_info(2, buffer.ptr()).unwrap();
        assert_eq!(pointer.memory_type, MemoryType::Host);
        let error = device.pool.alloc(Purpose::Kv, 4 << 20).unwrap_err();
        assert_eq!(
            error.to_string(),
            "device 2: allocating 4194304 bytes for kv cache would exceed the VRAM budget of 8388608 bytes (6291456 bytes in use)"
        );
    }
}
