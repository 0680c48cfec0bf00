//! Choosing a pool per device: the build manifest's VMM gate, then a start-up probe, then the
//! caching pool with a recorded reason.
//!
//! The probe exercises exactly the sequence the VMM pool relies on, on a tiny range: reserve two
//! granules, map one, set access, grow by mapping the adjacent granule, set access on the grown
//! range, touch all of it from the device (a kernel when one is supplied, else a device memset),
//! read it back, and tear it down. On gfx1201 the set-access-after-growth step is known to fault
//! (see targets.toml), which is why the gate exists in addition to the probe. Any failure selects
//! the caching pool; nothing here aborts.

use std::fmt;

use crate::driver::{DeviceOrdinal, DevicePtr, Driver, DriverError, PhysicalHandle, StreamHandle};
use crate::pool::PoolKind;

/// Setting this environment variable to `1` makes the probe fail (for tests and for users who
/// want the caching pool without rebuilding).
pub const FORCE_PROBE_FAIL_ENV: &str = "EMBER_FORCE_VMM_PROBE_FAIL";

/// Fills `count` 32-bit words at `ptr` with `pattern` from the device, queued on `stream`.
pub type ProbeTouch<'a> = &'a dyn Fn(
    &dyn Driver,
    DeviceOrdinal,
    DevicePtr,
    u64,
    u32,
    StreamHandle,
) -> Result<(), DriverError>;

/// Inputs to pool selection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PoolSelectOptions {
    /// The build manifest's VMM gate for this target (passed in by the engine).
    pub vmm_gate: bool,
    /// The manifest's reason when the gate is off.
    pub vmm_gate_reason: Option<String>,
    /// Make the probe fail, as if a step had failed.
    pub force_probe_failure: bool,
}

impl PoolSelectOptions {
    /// Options with `force_probe_failure` taken from [`FORCE_PROBE_FAIL_ENV`].
    pub fn from_env(vmm_gate: bool, vmm_gate_reason: Option<String>) -> PoolSelectOptions {
        let forced = std::env::var(FORCE_PROBE_FAIL_ENV).is_ok_and(|v| v.trim() == "1");
        PoolSelectOptions {
            vmm_gate,
            vmm_gate_reason,
            force_probe_failure: forced,
        }
    }
}

/// A step of the VMM probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeStep {
    Granularity,
    Reserve,
    CreateFirst,
    MapFirst,
    SetAccessFirst,
    CreateSecond,
    MapSecondAdjacent,
    SetAccessGrown,
    Touch,
    ReadBack,
    Teardown,
    Forced,
}

impl fmt::Display for ProbeStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProbeStep::Granularity => "query granularity",
            ProbeStep::Reserve => "reserve address range",
            ProbeStep::CreateFirst => "create first physical granule",
            ProbeStep::MapFirst => "map first granule",
            ProbeStep::SetAccessFirst => "set access on first granule",
            ProbeStep::CreateSecond => "create second physical granule",
            ProbeStep::MapSecondAdjacent => "grow by mapping the adjacent granule",
            ProbeStep::SetAccessGrown => "set access on the grown range",
            ProbeStep::Touch => "touch the range from the device",
            ProbeStep::ReadBack => "read back",
            ProbeStep::Teardown => "unmap and release",
            ProbeStep::Forced => "forced failure",
        })
    }
}

/// Why the probe failed.
#[derive(Clone, Debug, PartialEq)]
pub struct ProbeFailure {
    pub step: ProbeStep,
    pub detail: String,
}

impl fmt::Display for ProbeFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "VMM probe failed at step '{}': {}",
            self.step, self.detail
        )
    }
}

/// What a passing probe established.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProbeReport {
    pub granularity: u64,
    /// "kernel" or "device memset".
    pub touched_with: &'static str,
}

/// The pool kind chosen for a device and why.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolSelection {
    pub kind: PoolKind,
    pub reason: String,
    /// The probe's result, when it ran.
    pub probe: Option<Result<ProbeReport, ProbeFailure>>,
}

/// Picks the pool for `device`. See the module docs.
pub fn select_pool(
    driver: &dyn Driver,
    device: DeviceOrdinal,
    options: &PoolSelectOptions,
    touch: Option<ProbeTouch<'_>>,
) -> PoolSelection {
    if !options.vmm_gate {
        let why = options
            .vmm_gate_reason
            .as_deref()
            .unwrap_or("no reason recorded");
        return PoolSelection {
            kind: PoolKind::Caching,
            reason: format!(
                "caching pool: the build manifest gates VMM off for this target ({why})"
            ),
            probe: None,
        };
    }
    match driver.device_info(device) {
        Ok(info) if !info.vmm_supported => {
            return PoolSelection {
                kind: PoolKind::Caching,
                reason: format!(
                    "caching pool: {} ({}) reports no virtual memory management support",
                    info.name, info.arch
                ),
                probe: None,
            }
        }
        Ok(_) => {}
        Err(error) => {
            return PoolSelection {
                kind: PoolKind::Caching,
                reason: format!(
                    "caching pool: querying the device for VMM support failed: {error}"
                ),
                probe: None,
            }
        }
    }
    let result = if options.force_probe_failure {
        Err(ProbeFailure {
            step: ProbeStep::Forced,
            detail: format!("forced by {FORCE_PROBE_FAIL_ENV}=1 or the force-probe-failure option"),
        })
    } else {
        probe_vmm(driver, device, touch)
    };
    match result {
        Ok(report) => PoolSelection {
            kind: PoolKind::Vmm,
            reason: format!(
                "vmm pool: gate on, device supports VMM, probe passed (granularity {} bytes, touched with {})",
                report.granularity, report.touched_with
            ),
            probe: Some(Ok(report)),
        },
        Err(failure) => {
            tracing::warn!(device, %failure, "falling back to the caching pool");
            PoolSelection {
                kind: PoolKind::Caching,
                reason: format!("caching pool: {failure}"),
                probe: Some(Err(failure)),
            }
        }
    }
}

/// Runs the VMM probe on `device`. See the module docs.
pub fn probe_vmm(
    driver: &dyn Driver,
    device: DeviceOrdinal,
    touch: Option<ProbeTouch<'_>>,
) -> Result<ProbeReport, ProbeFailure> {
    let fail = |step: ProbeStep| {
        move |error: DriverError| ProbeFailure {
            step,
            detail: error.to_string(),
        }
    };
    let granularity = driver
        .vmm_granularity(device)
        .map_err(fail(ProbeStep::Granularity))?;
    if granularity == 0 || granularity % 4 != 0 {
        return Err(ProbeFailure {
            step: ProbeStep::Granularity,
            detail: format!("expected a positive multiple of 4 bytes, found {granularity}"),
        });
    }
    let base = driver
        .vmm_reserve(device, 2 * granularity)
        .map_err(fail(ProbeStep::Reserve))?;
    let mut guard = ProbeGuard {
        driver,
        device,
        base,
        granularity,
        handles: Vec::new(),
        mapped: Vec::new(),
    };
    let result = guard.run(touch);
    let teardown = guard.teardown();
    let report = result?;
    teardown.map_err(fail(ProbeStep::Teardown))?;
    Ok(report)
}

/// Owns what the probe created so that every exit path tears it down.
struct ProbeGuard<'a> {
    driver: &'a dyn Driver,
    device: DeviceOrdinal,
    base: DevicePtr,
    granularity: u64,
    handles: Vec<PhysicalHandle>,
    mapped: Vec<DevicePtr>,
}

impl ProbeGuard<'_> {
    fn run(&mut self, touch: Option<ProbeTouch<'_>>) -> Result<ProbeReport, ProbeFailure> {
        let fail = |step: ProbeStep| {
            move |error: DriverError| ProbeFailure {
                step,
                detail: error.to_string(),
            }
        };
        let (driver, device, g) = (self.driver, self.device, self.granularity);
        let first = driver
            .vmm_create(device, g)
            .map_err(fail(ProbeStep::CreateFirst))?;
        self.handles.push(first);
        driver
            .vmm_map(device, self.base, g, first)
            .map_err(fail(ProbeStep::MapFirst))?;
        self.mapped.push(self.base);
        driver
            .vmm_set_access(device, self.base, g)
            .map_err(fail(ProbeStep::SetAccessFirst))?;
        let second = driver
            .vmm_create(device, g)
            .map_err(fail(ProbeStep::CreateSecond))?;
        self.handles.push(second);
        let second_ptr = self.base.offset(g);
        driver
            .vmm_map(device, second_ptr, g, second)
            .map_err(fail(ProbeStep::MapSecondAdjacent))?;
        self.mapped.push(second_ptr);
        driver
            .vmm_set_access(device, self.base, 2 * g)
            .map_err(fail(ProbeStep::SetAccessGrown))?;

        const PATTERN: u32 = 0x9e37_79b9;
        let words = 2 * g / 4;
        let stream = StreamHandle::DEFAULT;
        let touched_with = match touch {
            Some(touch) => {
                touch(driver, device, self.base, words, PATTERN, stream)
                    .map_err(fail(ProbeStep::Touch))?;
                "kernel"
            }
            None => {
                driver
                    .memset_d32_async(device, self.base, PATTERN, words, stream)
                    .map_err(fail(ProbeStep::Touch))?;
                "device memset"
            }
        };
        driver
            .stream_synchronize(device, stream)
            .map_err(fail(ProbeStep::Touch))?;
        let mut back = vec![0u8; (2 * g) as usize];
        driver
            .download(device, &mut back, self.base, stream)
            .map_err(fail(ProbeStep::ReadBack))?;
        if let Some(index) = back
            .chunks_exact(4)
            .position(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]) != PATTERN)
        {
            return Err(ProbeFailure {
                step: ProbeStep::ReadBack,
                detail: format!(
                    "word {index} of {words} does not hold the pattern written by the device"
                ),
            });
        }
        Ok(ProbeReport {
            granularity: g,
            touched_with,
        })
    }

    fn teardown(&mut self) -> Result<(), DriverError> {
        let mut first_error = None;
        for ptr in self.mapped.drain(..).rev() {
            if let Err(error) = self.driver.vmm_unmap(self.device, ptr, self.granularity) {
                first_error.get_or_insert(error);
            }
        }
        for handle in self.handles.drain(..) {
            if let Err(error) = self.driver.vmm_release(self.device, handle) {
                first_error.get_or_insert(error);
            }
        }
        if let Err(error) =
            self.driver
                .vmm_free_reserved(self.device, self.base, 2 * self.granularity)
        {
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), Err)
    }
}
