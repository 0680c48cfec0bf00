//! Device memory pools that give memory back, with accounting by purpose and a VRAM budget.
//!
//! Every device allocation of the engine goes through a [`DevicePool`]. Two strategies sit under
//! it: the [`vmm`] pool (a virtual reservation with physical chunks mapped on demand and unmapped
//! when idle) and the [`caching`] pool (plain allocations cached best-fit and freed when idle).
//! [`select`] picks one per device: the build manifest's gate, then a start-up probe, then the
//! caching pool with a recorded reason. Neither strategy ever aborts on a driver error.
//!
//! The pool has no background thread: the caller drives trimming with
//! [`DevicePool::trim_if_idle`] (the engine's scheduler calls it when it has had no work for a
//! while). Trimming synchronises the device first, because unmapping or freeing memory a queued
//! kernel still reads would fault.
//!
//! Accounting is kept per purpose (weights, KV cache, scratch): current and peak bytes, plus the
//! physical memory held from the driver. A [`MemoryReport`] renders it at load, at peak and after
//! idle, which is what `--memory-report` prints.

pub mod caching;
pub mod select;
pub mod vmm;

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::driver::{DeviceOrdinal, DevicePtr, Driver, DriverError, StreamHandle};
use caching::CachingPool;
use vmm::VmmPool;

pub use select::{
    probe_vmm, select_pool, PoolSelectOptions, PoolSelection, ProbeFailure, ProbeReport, ProbeStep,
    ProbeTouch, FORCE_PROBE_FAIL_ENV,
};

/// What an allocation is for; accounting and budget errors name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Purpose {
    Weights,
    Kv,
    Scratch,
    /// The per-sequence recurrent and convolution states of hybrid models' linear-attention
    /// layers, made with a sequence and freed with it, like its KV blocks.
    RecurrentState,
}

impl Purpose {
    pub const ALL: [Purpose; 4] = [
        Purpose::Weights,
        Purpose::Kv,
        Purpose::Scratch,
        Purpose::RecurrentState,
    ];

    fn index(self) -> usize {
        match self {
            Purpose::Weights => 0,
            Purpose::Kv => 1,
            Purpose::Scratch => 2,
            Purpose::RecurrentState => 3,
        }
    }
}

impl fmt::Display for Purpose {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Purpose::Weights => "weights",
            Purpose::Kv => "kv cache",
            Purpose::Scratch => "scratch",
            Purpose::RecurrentState => "recurrent state",
        })
    }
}

/// Which strategy a pool uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolKind {
    Vmm,
    Caching,
}

impl fmt::Display for PoolKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PoolKind::Vmm => "vmm",
            PoolKind::Caching => "caching",
        })
    }
}

/// Pool tuning.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    /// Most bytes that may be live at once on this device (`--vram-budget`); `None` is unlimited.
    pub budget: Option<u64>,
    /// Physical memory kept after an idle trim beyond what is live (0: keep only live memory).
    pub floor_bytes: u64,
    /// How long the pool must see no allocation or free before a trim.
    pub idle_after: Duration,
    /// Virtual space the VMM pool reserves; `None` is twice the device's memory.
    pub vmm_reserve_bytes: Option<u64>,
    /// Size of the VMM pool's physical chunks (rounded up to the device granularity).
    pub vmm_chunk_bytes: u64,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            budget: None,
            floor_bytes: 0,
            idle_after: Duration::from_secs(1),
            vmm_reserve_bytes: None,
            vmm_chunk_bytes: 32 << 20,
        }
    }
}

/// A failed pool request. The pool stays usable after any of these.
#[derive(Debug, Error)]
pub enum PoolError {
    #[error("device {device}: allocating {requested} bytes for {purpose} would exceed the VRAM budget of {budget} bytes ({in_use} bytes in use)")]
    BudgetExceeded {
        device: DeviceOrdinal,
        purpose: Purpose,
        requested: u64,
        budget: u64,
        in_use: u64,
    },
    #[error("device {device} is out of memory allocating {requested} bytes for {purpose} ({in_use} bytes in use, {held} bytes held by the pool): {source}")]
    OutOfMemory {
        device: DeviceOrdinal,
        purpose: Purpose,
        requested: u64,
        in_use: u64,
        held: u64,
        source: DriverError,
    },
    #[error("device {device}: allocating {requested} bytes for {purpose} failed: {source}")]
    Alloc {
        device: DeviceOrdinal,
        purpose: Purpose,
        requested: u64,
        source: DriverError,
    },
    #[error("device {device}: expected a non-zero allocation size for {purpose}, found 0 bytes")]
    ZeroSized {
        device: DeviceOrdinal,
        purpose: Purpose,
    },
    #[error("device {device}: {operation} failed: {source}")]
    Driver {
        device: DeviceOrdinal,
        operation: &'static str,
        source: DriverError,
    },
}

/// Current and peak bytes of one purpose.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PurposeUsage {
    pub current: u64,
    pub peak: u64,
}

/// Memory of one pool at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// Live bytes by purpose, in [`Purpose::ALL`] order.
    pub live_by_purpose: [u64; 4],
    pub live: u64,
    /// Physical memory held from the driver (mapped chunks or allocated blocks).
    pub held: u64,
    /// The device's free memory when the snapshot was taken, where it was asked.
    pub device_free: Option<u64>,
}

impl MemorySnapshot {
    pub fn live_for(&self, purpose: Purpose) -> u64 {
        self.live_by_purpose[purpose.index()]
    }
}

/// Accounting of one pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolUsage {
    pub by_purpose: [PurposeUsage; 4],
    pub live: u64,
    pub peak_live: u64,
    pub held: u64,
    pub peak_held: u64,
    pub allocations: u64,
}

impl PoolUsage {
    pub fn purpose(&self, purpose: Purpose) -> PurposeUsage {
        self.by_purpose[purpose.index()]
    }
}

/// What [`DevicePool::trim_if_idle`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrimOutcome {
    /// Work happened too recently; try again after `remaining`.
    NotIdle {
        remaining: Duration,
    },
    /// Idle, and already trimmed since the last activity.
    AlreadyTrimmed,
    Trimmed {
        released: u64,
        held_after: u64,
    },
}

enum Strategy {
    Vmm(VmmPool),
    Caching(CachingPool),
}

impl Strategy {
    fn held(&self) -> u64 {
        match self {
            Strategy::Vmm(pool) => pool.mapped_bytes(),
            Strategy::Caching(pool) => pool.held_bytes(),
        }
    }

    fn alloc(&mut self, driver: &dyn Driver, bytes: u64) -> Result<(DevicePtr, u64), DriverError> {
        match self {
            Strategy::Vmm(pool) => pool.alloc(driver, bytes),
            Strategy::Caching(pool) => pool.alloc(driver, bytes),
        }
    }

    fn free(&mut self, ptr: DevicePtr, size: u64) {
        match self {
            Strategy::Vmm(pool) => pool.free(ptr, size),
            Strategy::Caching(pool) => pool.free(ptr),
        }
    }

    fn trim(&mut self, driver: &dyn Driver, floor: u64) -> Result<u64, DriverError> {
        match self {
            Strategy::Vmm(pool) => pool.trim(driver, floor),
            Strategy::Caching(pool) => pool.trim(driver, floor),
        }
    }

    fn destroy(self, driver: &dyn Driver) -> Result<(), DriverError> {
        match self {
            Strategy::Vmm(pool) => pool.destroy(driver),
            Strategy::Caching(pool) => pool.destroy(driver),
        }
    }
}

struct PoolState {
    strategy: Option<Strategy>,
    usage: PoolUsage,
    last_activity: Instant,
    trimmed_since_activity: bool,
    /// Trims that gave memory back so far (see [`DevicePool::trim_generation`]).
    trim_generation: u64,
    at_load: Option<MemorySnapshot>,
    at_peak: MemorySnapshot,
    after_idle: Option<MemorySnapshot>,
    /// Graph captures open on the device ([`DevicePool::hold_idle_trim`]): no idle trim while
    /// one is, since the trim's device synchronisation would invalidate the recording and its
    /// unmapping could free memory the recorded ops are about to use.
    capture_holds: u32,
}

impl PoolState {
    fn strategy(&mut self) -> &mut Strategy {
        self.strategy
            .as_mut()
            .expect("the strategy is only taken when the pool is dropped")
    }

    fn snapshot(&self, device_free: Option<u64>) -> MemorySnapshot {
        MemorySnapshot {
            live_by_purpose: self.usage.by_purpose.map(|u| u.current),
            live: self.usage.live,
            held: self.usage.held,
            device_free,
        }
    }
}

struct PoolShared {
    driver: Arc<dyn Driver>,
    device: DeviceOrdinal,
    device_name: String,
    kind: PoolKind,
    reason: String,
    config: PoolConfig,
    state: Mutex<PoolState>,
}

impl PoolShared {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn release(&self, ptr: DevicePtr, size: u64, bytes: u64, purpose: Purpose) {
        let mut state = self.lock();
        state.strategy().free(ptr, size);
        let usage = &mut state.usage.by_purpose[purpose.index()];
        usage.current = usage.current.saturating_sub(bytes);
        state.usage.live = state.usage.live.saturating_sub(bytes);
        state.last_activity = Instant::now();
        state.trimmed_since_activity = false;
    }
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(strategy) = state.strategy.take() {
            if let Err(error) = self
                .driver
                .synchronize(self.device)
                .and_then(|()| strategy.destroy(&*self.driver))
            {
                tracing::warn!(device = self.device, %error, "device pool could not release its memory");
            }
        }
    }
}

/// A device's memory pool. Cheap to clone (shared state); see the module docs.
#[derive(Clone)]
pub struct DevicePool {
    shared: Arc<PoolShared>,
}

impl fmt::Debug for DevicePool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevicePool")
            .field("device", &self.shared.device)
            .field("kind", &self.shared.kind)
            .field("usage", &self.usage())
            .finish()
    }
}

impl DevicePool {
    /// Chooses the strategy with [`select_pool`] and builds the pool. VMM trouble never fails
    /// this: it falls back to the caching pool and the reason says why.
    pub fn new(
        driver: Arc<dyn Driver>,
        device: DeviceOrdinal,
        options: &PoolSelectOptions,
        config: PoolConfig,
        touch: Option<ProbeTouch<'_>>,
    ) -> Result<DevicePool, PoolError> {
        let selection = select_pool(&*driver, device, options, touch);
        tracing::info!(device, pool = %selection.kind, reason = %selection.reason, "device memory pool selected");
        DevicePool::with_kind(driver, device, selection.kind, selection.reason, config)
    }

    /// Builds a pool of the given kind. If the VMM reservation fails, falls back to caching.
    pub fn with_kind(
        driver: Arc<dyn Driver>,
        device: DeviceOrdinal,
        kind: PoolKind,
        reason: String,
        config: PoolConfig,
    ) -> Result<DevicePool, PoolError> {
        let info = driver
            .device_info(device)
            .map_err(|source| PoolError::Driver {
                device,
                operation: "querying the device",
                source,
            })?;
        let (kind, reason, strategy) = match kind {
            PoolKind::Caching => (
                PoolKind::Caching,
                reason,
                Strategy::Caching(CachingPool::new(device)),
            ),
            PoolKind::Vmm => {
                let reserve = config
                    .vmm_reserve_bytes
                    .unwrap_or(info.total_memory.saturating_mul(2).max(1 << 30));
                match VmmPool::new(&*driver, device, reserve, config.vmm_chunk_bytes) {
                    Ok(pool) => (PoolKind::Vmm, reason, Strategy::Vmm(pool)),
                    Err(error) => {
                        let reason = format!("{reason}; but reserving {reserve} bytes of virtual space failed ({error}), so the caching pool is used");
                        tracing::warn!(device, %reason, "VMM pool unavailable");
                        (
                            PoolKind::Caching,
                            reason,
                            Strategy::Caching(CachingPool::new(device)),
                        )
                    }
                }
            }
        };
        Ok(DevicePool {
            shared: Arc::new(PoolShared {
                driver,
                device,
                device_name: info.name,
                kind,
                reason,
                config,
                state: Mutex::new(PoolState {
                    strategy: Some(strategy),
                    usage: PoolUsage::default(),
                    last_activity: Instant::now(),
                    trimmed_since_activity: false,
                    trim_generation: 0,
                    at_load: None,
                    at_peak: MemorySnapshot::default(),
                    after_idle: None,
                    capture_holds: 0,
                }),
            }),
        })
    }

    pub fn device(&self) -> DeviceOrdinal {
        self.shared.device
    }

    pub fn kind(&self) -> PoolKind {
        self.shared.kind
    }

    /// Why this pool kind was chosen.
    pub fn reason(&self) -> &str {
        &self.shared.reason
    }

    pub fn driver(&self) -> &Arc<dyn Driver> {
        &self.shared.driver
    }

    pub fn config(&self) -> &PoolConfig {
        &self.shared.config
    }

    pub fn usage(&self) -> PoolUsage {
        self.shared.lock().usage
    }

    /// Bytes new allocations can still get: the device's free memory plus what this pool holds
    /// idle (mapped or cached but not live), within the budget's room (budget minus live bytes).
    /// `None` when neither the driver's figure nor a budget is known.
    pub fn available_bytes(&self) -> Option<u64> {
        let usage = self.usage();
        let idle = usage.held.saturating_sub(usage.live);
        let device = self
            .shared
            .driver
            .mem_info(self.shared.device)
            .ok()
            .map(|info| info.free.saturating_add(idle));
        let budget = self
            .shared
            .config
            .budget
            .map(|budget| budget.saturating_sub(usage.live));
        match (device, budget) {
            (Some(d), Some(b)) => Some(d.min(b)),
            (d, b) => d.or(b),
        }
    }

    /// Allocates `bytes` for `purpose`. A budget or out-of-memory failure fails this request only.
    pub fn alloc(&self, purpose: Purpose, bytes: u64) -> Result<PoolBuffer, PoolError> {
        let shared = &self.shared;
        let device = shared.device;
        if bytes == 0 {
            return Err(PoolError::ZeroSized { device, purpose });
        }
        let driver = &*shared.driver;
        let mut state = shared.lock();
        if let Some(budget) = shared.config.budget {
            if state.usage.live.saturating_add(bytes) > budget {
                return Err(PoolError::BudgetExceeded {
                    device,
                    purpose,
                    requested: bytes,
                    budget,
                    in_use: state.usage.live,
                });
            }
            // Idle memory the pool holds must not push the device past the budget either.
            if state.usage.held.saturating_add(bytes) > budget {
                Self::trim_locked(shared, &mut state, 0)?;
            }
        }
        let result = match state.strategy().alloc(driver, bytes) {
            Err(error) if error.is_out_of_memory() => {
                // Cached or mapped-but-idle memory may be what is missing: give it back, retry once.
                Self::trim_locked(shared, &mut state, 0)?;
                state.strategy().alloc(driver, bytes)
            }
            other => other,
        };
        let (ptr, size) = match result {
            Ok(allocation) => allocation,
            Err(source) if source.is_out_of_memory() => {
                return Err(PoolError::OutOfMemory {
                    device,
                    purpose,
                    requested: bytes,
                    in_use: state.usage.live,
                    held: state.strategy().held(),
                    source,
                })
            }
            Err(source) => {
                return Err(PoolError::Alloc {
                    device,
                    purpose,
                    requested: bytes,
                    source,
                })
            }
        };
        let held = state.strategy().held();
        let usage = &mut state.usage;
        let by_purpose = &mut usage.by_purpose[purpose.index()];
        by_purpose.current += bytes;
        by_purpose.peak = by_purpose.peak.max(by_purpose.current);
        usage.live += bytes;
        usage.peak_live = usage.peak_live.max(usage.live);
        usage.held = held;
        usage.allocations += 1;
        if held > state.at_peak.held
            || (held == state.at_peak.held && state.usage.live > state.at_peak.live)
        {
            state.at_peak = state.snapshot(None);
        }
        state.usage.peak_held = state.usage.peak_held.max(held);
        state.last_activity = Instant::now();
        state.trimmed_since_activity = false;
        Ok(PoolBuffer {
            shared: Arc::clone(shared),
            ptr,
            bytes,
            size,
            purpose,
        })
    }

    /// A counter that grows whenever a trim gives memory back to the driver. Idle memory the
    /// pool held may then be unmapped, so anything that kept device addresses of freed buffers
    /// (a recorded graph) compares this before reusing them.
    pub fn trim_generation(&self) -> u64 {
        self.shared.lock().trim_generation
    }

    /// Trims to the floor if no allocation or free happened for `idle_after` before `now`.
    pub fn trim_if_idle(&self, now: Instant) -> Result<TrimOutcome, PoolError> {
        let shared = &self.shared;
        let mut state = shared.lock();
        if state.capture_holds > 0 {
            return Ok(TrimOutcome::NotIdle {
                remaining: shared.config.idle_after,
            });
        }
        let idle_for = now.saturating_duration_since(state.last_activity);
        if idle_for < shared.config.idle_after {
            return Ok(TrimOutcome::NotIdle {
                remaining: shared.config.idle_after - idle_for,
            });
        }
        if state.trimmed_since_activity {
            return Ok(TrimOutcome::AlreadyTrimmed);
        }
        let released = Self::trim_locked(shared, &mut state, shared.config.floor_bytes)?;
        state.trimmed_since_activity = true;
        let free = shared.driver.mem_info(shared.device).ok().map(|m| m.free);
        state.after_idle = Some(state.snapshot(free));
        Ok(TrimOutcome::Trimmed {
            released,
            held_after: state.usage.held,
        })
    }

    /// A graph capture begins on the device: [`DevicePool::trim_if_idle`] trims nothing until
    /// the matching [`DevicePool::release_idle_trim`]. The pool's lock orders this with a trim in
    /// progress: a capture never begins while the idle trim synchronises and unmaps.
    pub fn hold_idle_trim(&self) {
        self.shared.lock().capture_holds += 1;
    }

    /// The capture that [`DevicePool::hold_idle_trim`] announced has ended. The idle time counts
    /// from now, as after any other work.
    pub fn release_idle_trim(&self) {
        let mut state = self.shared.lock();
        state.capture_holds = state.capture_holds.saturating_sub(1);
        state.last_activity = Instant::now();
    }

    /// Trims to the floor now, whether idle or not (after synchronising the device).
    pub fn trim_now(&self) -> Result<u64, PoolError> {
        let shared = &self.shared;
        let mut state = shared.lock();
        Self::trim_locked(shared, &mut state, shared.config.floor_bytes)
    }

    fn trim_locked(
        shared: &PoolShared,
        state: &mut PoolState,
        floor: u64,
    ) -> Result<u64, PoolError> {
        let device = shared.device;
        shared
            .driver
            .synchronize(device)
            .map_err(|source| PoolError::Driver {
                device,
                operation: "synchronising before a trim",
                source,
            })?;
        let driver = &*shared.driver;
        let result = state.strategy().trim(driver, floor);
        let held_before = state.usage.held;
        state.usage.held = state.strategy().held();
        if state.usage.held != held_before || result.as_ref().is_ok_and(|&released| released > 0) {
            state.trim_generation += 1;
        }
        result.map_err(|source| PoolError::Driver {
            device,
            operation: "trimming the pool",
            source,
        })
    }

    /// Records the "at load" snapshot (call once the weights are placed).
    pub fn mark_loaded(&self) {
        let free = self
            .shared
            .driver
            .mem_info(self.shared.device)
            .ok()
            .map(|m| m.free);
        let mut state = self.shared.lock();
        state.at_load = Some(state.snapshot(free));
    }

    /// The pool's memory report.
    pub fn report(&self) -> DeviceMemoryReport {
        let free = self
            .shared
            .driver
            .mem_info(self.shared.device)
            .ok()
            .map(|m| m.free);
        let state = self.shared.lock();
        DeviceMemoryReport {
            device: self.shared.device,
            device_name: self.shared.device_name.clone(),
            pool_kind: self.shared.kind,
            pool_reason: self.shared.reason.clone(),
            budget: self.shared.config.budget,
            floor_bytes: self.shared.config.floor_bytes,
            at_load: state.at_load,
            at_peak: state.at_peak,
            after_idle: state.after_idle,
            now: state.snapshot(free),
            peak_by_purpose: state.usage.by_purpose.map(|u| u.peak),
        }
    }
}

/// A live allocation; returns to its pool when dropped. Never `Clone`: copying device memory can
/// fail, so it is [`PoolBuffer::try_clone`].
///
/// Dropping makes the memory reusable at once, which is safe for work queued on one stream
/// (a later kernel reusing it runs after the earlier ones); with several streams, synchronise
/// the stream that used the buffer before dropping it. Trims always synchronise the device.
pub struct PoolBuffer {
    shared: Arc<PoolShared>,
    ptr: DevicePtr,
    bytes: u64,
    size: u64,
    purpose: Purpose,
}

impl fmt::Debug for PoolBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PoolBuffer")
            .field("device", &self.shared.device)
            .field("ptr", &self.ptr)
            .field("bytes", &self.bytes)
            .field("purpose", &self.purpose)
            .finish()
    }
}

impl PoolBuffer {
    pub fn ptr(&self) -> DevicePtr {
        self.ptr
    }

    /// The requested length.
    pub fn len(&self) -> u64 {
        self.bytes
    }

    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The bytes the allocation occupies in the pool (rounded up).
    pub fn capacity(&self) -> u64 {
        self.size
    }

    pub fn purpose(&self) -> Purpose {
        self.purpose
    }

    pub fn device(&self) -> DeviceOrdinal {
        self.shared.device
    }

    /// A new buffer of the same purpose holding a copy of this one, queued on `stream`.
    pub fn try_clone(&self, stream: StreamHandle) -> Result<PoolBuffer, PoolError> {
        let pool = DevicePool {
            shared: Arc::clone(&self.shared),
        };
        let copy = pool.alloc(self.purpose, self.bytes)?;
        self.shared
            .driver
            .copy_dtod_async(self.shared.device, copy.ptr, self.ptr, self.bytes, stream)
            .map_err(|source| PoolError::Driver {
                device: self.shared.device,
                operation: "copying a buffer",
                source,
            })?;
        Ok(copy)
    }
}

impl Drop for PoolBuffer {
    fn drop(&mut self) {
        self.shared
            .release(self.ptr, self.size, self.bytes, self.purpose);
    }
}

/// One device's memory at load, at peak, after idle and now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceMemoryReport {
    pub device: DeviceOrdinal,
    pub device_name: String,
    pub pool_kind: PoolKind,
    pub pool_reason: String,
    pub budget: Option<u64>,
    pub floor_bytes: u64,
    pub at_load: Option<MemorySnapshot>,
    pub at_peak: MemorySnapshot,
    pub after_idle: Option<MemorySnapshot>,
    pub now: MemorySnapshot,
    pub peak_by_purpose: [u64; 4],
}

/// The memory report of every device (`--memory-report`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryReport {
    pub devices: Vec<DeviceMemoryReport>,
}

impl MemoryReport {
    pub fn from_pools(pools: &[DevicePool]) -> MemoryReport {
        MemoryReport {
            devices: pools.iter().map(DevicePool::report).collect(),
        }
    }
}

/// Renders a byte count with a binary unit.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

impl fmt::Display for DeviceMemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let budget = self
            .budget
            .map(format_bytes)
            .unwrap_or_else(|| "none".to_string());
        writeln!(
            f,
            "device {} ({}): {} pool, budget {budget}, idle floor {}",
            self.device,
            self.device_name,
            self.pool_kind,
            format_bytes(self.floor_bytes)
        )?;
        writeln!(f, "  pool choice: {}", self.pool_reason)?;
        writeln!(
            f,
            "  {:<11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>12}",
            "stage", "weights", "kv cache", "scratch", "state", "live", "held", "device free"
        )?;
        let row =
            |f: &mut fmt::Formatter<'_>, stage: &str, s: Option<&MemorySnapshot>| -> fmt::Result {
                match s {
                    None => writeln!(f, "  {stage:<11} {:>11}", "not reached"),
                    Some(s) => writeln!(
                        f,
                        "  {stage:<11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>12}",
                        format_bytes(s.live_by_purpose[0]),
                        format_bytes(s.live_by_purpose[1]),
                        format_bytes(s.live_by_purpose[2]),
                        format_bytes(s.live_by_purpose[3]),
                        format_bytes(s.live),
                        format_bytes(s.held),
                        s.device_free
                            .map(format_bytes)
                            .unwrap_or_else(|| "-".to_string()),
                    ),
                }
            };
        row(f, "at load", self.at_load.as_ref())?;
        row(f, "at peak", Some(&self.at_peak))?;
        row(f, "after idle", self.after_idle.as_ref())?;
        row(f, "now", Some(&self.now))?;
        writeln!(
            f,
            "  peak by purpose: weights {}, kv cache {}, scratch {}, recurrent state {}",
            format_bytes(self.peak_by_purpose[0]),
            format_bytes(self.peak_by_purpose[1]),
            format_bytes(self.peak_by_purpose[2]),
            format_bytes(self.peak_by_purpose[3])
        )
    }
}

impl fmt::Display for MemoryReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "memory report")?;
        if self.devices.is_empty() {
            return writeln!(f, "  no GPU devices in use");
        }
        for device in &self.devices {
            write!(f, "{device}")?;
        }
        Ok(())
    }
}

#[cfg(all(test, unix))]
mod tests;
