//! Pool behaviour over the host driver: real mappings, real page release.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::*;
use crate::driver::StreamHandle;
use crate::host::{resident_bytes_in, HostDriver, HostDriverConfig, HostVmmFailure};

const MIB: u64 = 1 << 20;

fn host(config: HostDriverConfig) -> Arc<HostDriver> {
    Arc::new(HostDriver::new(config))
}

fn config() -> PoolConfig {
    PoolConfig {
        idle_after: Duration::from_millis(50),
        vmm_reserve_bytes: Some(512 * MIB),
        vmm_chunk_bytes: 4 * MIB,
        ..PoolConfig::default()
    }
}

fn pool(kind: PoolKind, driver: &Arc<HostDriver>, config: PoolConfig) -> DevicePool {
    DevicePool::with_kind(driver.clone(), 0, kind, "test".to_string(), config).unwrap()
}

fn gate_on() -> PoolSelectOptions {
    PoolSelectOptions {
        vmm_gate: true,
        vmm_gate_reason: None,
        force_probe_failure: false,
    }
}

#[test]
fn buffers_hold_data_and_freed_memory_is_reused() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = host(HostDriverConfig::default());
        let pool = pool(kind, &driver, config());
        let a = pool.alloc(Purpose::Scratch, 3 * MIB).unwrap();
        driver
            .upload(0, a.ptr(), &[7u8; 1024], StreamHandle::DEFAULT)
            .unwrap();
        let copy = a.try_clone(StreamHandle::DEFAULT).unwrap();
        let mut back = [0u8; 1024];
        driver
            .download(0, &mut back, copy.ptr(), StreamHandle::DEFAULT)
            .unwrap();
        assert_eq!(back, [7u8; 1024], "{kind}");
        let first = a.ptr();
        drop(a);
        let held = pool.usage().held;
        let b = pool.alloc(Purpose::Scratch, 3 * MIB).unwrap();
        assert_eq!(b.ptr(), first, "{kind}: the freed block is reused");
        assert_eq!(
            pool.usage().held,
            held,
            "{kind}: reuse maps or allocates nothing new"
        );
    }
}

#[test]
fn accounting_tracks_each_purpose_and_peaks() {
    let driver = host(HostDriverConfig::default());
    let pool = pool(PoolKind::Vmm, &driver, config());
    let weights = pool.alloc(Purpose::Weights, 10 * MIB).unwrap();
    let kv = pool.alloc(Purpose::Kv, 2 * MIB).unwrap();
    let scratch: Vec<_> = (0..3)
        .map(|_| pool.alloc(Purpose::Scratch, MIB).unwrap())
        .collect();
    let usage = pool.usage();
    assert_eq!(usage.purpose(Purpose::Weights).current, 10 * MIB);
    assert_eq!(usage.purpose(Purpose::Kv).current, 2 * MIB);
    assert_eq!(usage.purpose(Purpose::Scratch).current, 3 * MIB);
    assert_eq!(usage.live, 15 * MIB);
    drop(scratch);
    drop(kv);
    let usage = pool.usage();
    assert_eq!(
        usage.purpose(Purpose::Scratch),
        PurposeUsage {
            current: 0,
            peak: 3 * MIB
        }
    );
    assert_eq!(
        usage.purpose(Purpose::Kv),
        PurposeUsage {
            current: 0,
            peak: 2 * MIB
        }
    );
    assert_eq!(usage.live, 10 * MIB);
    assert_eq!(usage.peak_live, 15 * MIB);
    assert_eq!(usage.allocations, 5);
    drop(weights);
}

#[test]
fn idle_trim_returns_memory_to_the_floor() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = host(HostDriverConfig::default());
        let pool = pool(
            kind,
            &driver,
            PoolConfig {
                floor_bytes: 8 * MIB,
                ..config()
            },
        );
        let weights = pool.alloc(Purpose::Weights, 8 * MIB).unwrap();
        let burst: Vec<_> = (0..8)
            .map(|i| pool.alloc(Purpose::Scratch, (i + 1) * MIB).unwrap())
            .collect();
        let peak_used = driver.used_bytes();
        assert!(peak_used >= 44 * MIB, "{kind}: {peak_used}");
        drop(burst);
        assert_eq!(
            driver.used_bytes(),
            peak_used,
            "{kind}: freed memory is cached until idle"
        );

        let start = Instant::now();
        assert!(
            matches!(
                pool.trim_if_idle(start).unwrap(),
                TrimOutcome::NotIdle { .. }
            ),
            "{kind}"
        );
        let later = Instant::now() + Duration::from_millis(60);
        let TrimOutcome::Trimmed {
            released,
            held_after,
        } = pool.trim_if_idle(later).unwrap()
        else {
            panic!("{kind}: expected a trim after the idle period");
        };
        assert!(
            released >= peak_used - 12 * MIB,
            "{kind}: released {released} of {peak_used}"
        );
        assert!(
            held_after <= 12 * MIB,
            "{kind}: held {held_after} after trim"
        );
        assert_eq!(
            driver.used_bytes(),
            held_after,
            "{kind}: the driver got the memory back"
        );
        assert_eq!(
            pool.trim_if_idle(later).unwrap(),
            TrimOutcome::AlreadyTrimmed,
            "{kind}"
        );
        // The weights are untouched and the pool still serves requests.
        driver
            .upload(
                0,
                weights.ptr().offset(8 * MIB - 4),
                &[1, 2, 3, 4],
                StreamHandle::DEFAULT,
            )
            .unwrap();
        let again = pool.alloc(Purpose::Scratch, 16 * MIB).unwrap();
        driver
            .upload(0, again.ptr(), &[9; 16], StreamHandle::DEFAULT)
            .unwrap();
        let report = pool.report();
        assert_eq!(report.after_idle.unwrap().held, held_after, "{kind}");
        assert!(report.at_peak.held >= peak_used, "{kind}");
    }
}

#[test]
fn vmm_trim_gives_pages_back_to_the_os() {
    let driver = host(HostDriverConfig::default());
    let pool = pool(PoolKind::Vmm, &driver, config());
    let buffer = pool.alloc(Purpose::Scratch, 32 * MIB).unwrap();
    let ptr = buffer.ptr();
    driver
        .memset_d8_async(0, ptr, 0x5a, 32 * MIB, StreamHandle::DEFAULT)
        .unwrap();
    assert_eq!(resident_bytes_in(ptr, 32 * MIB).unwrap(), 32 * MIB);
    drop(buffer);
    pool.trim_now().unwrap();
    assert_eq!(resident_bytes_in(ptr, 32 * MIB).unwrap(), 0);
    assert_eq!(driver.used_bytes(), 0);
}

#[test]
fn budget_failure_fails_one_request_and_the_pool_keeps_serving() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = host(HostDriverConfig::default());
        let pool = pool(
            kind,
            &driver,
            PoolConfig {
                budget: Some(64 * MIB),
                ..config()
            },
        );
        let weights = pool.alloc(Purpose::Weights, 40 * MIB).unwrap();
        let error = pool.alloc(Purpose::Kv, 30 * MIB).unwrap_err();
        match &error {
            PoolError::BudgetExceeded {
                purpose,
                requested,
                budget,
                in_use,
                ..
            } => assert_eq!(
                (*purpose, *requested, *budget, *in_use),
                (Purpose::Kv, 30 * MIB, 64 * MIB, 40 * MIB)
            ),
            other => panic!("{kind}: expected a budget error, found {other}"),
        }
        let text = error.to_string();
        assert!(
            text.contains("kv cache")
                && text.contains("budget of 67108864 bytes")
                && text.contains("41943040 bytes in use"),
            "{text}"
        );
        let kv = pool.alloc(Purpose::Kv, 20 * MIB).unwrap();
        assert_eq!(pool.usage().live, 60 * MIB, "{kind}");
        drop(kv);
        drop(weights);
    }
}

#[test]
fn budget_counts_idle_cached_memory_and_trims_it_first() {
    let driver = host(HostDriverConfig::default());
    let pool = pool(
        PoolKind::Caching,
        &driver,
        PoolConfig {
            budget: Some(32 * MIB),
            ..config()
        },
    );
    drop(pool.alloc(Purpose::Scratch, 20 * MIB).unwrap());
    assert_eq!(driver.used_bytes(), 20 * MIB);
    // 20 MiB cached + 24 MiB new would hold 44 MiB, over the budget: the cache is released first.
    let b = pool.alloc(Purpose::Scratch, 24 * MIB).unwrap();
    assert_eq!(driver.used_bytes(), 24 * MIB);
    drop(b);
}

#[test]
fn device_out_of_memory_fails_one_request_and_the_pool_keeps_serving() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = host(HostDriverConfig {
            total_memory: 64 * MIB,
            ..HostDriverConfig::default()
        });
        let pool = pool(kind, &driver, config());
        // Idle cached memory is given back and the request retried before it fails.
        drop(pool.alloc(Purpose::Scratch, 40 * MIB).unwrap());
        let big = pool.alloc(Purpose::Kv, 48 * MIB).unwrap();
        let error = pool.alloc(Purpose::Scratch, 32 * MIB).unwrap_err();
        assert!(
            matches!(
                error,
                PoolError::OutOfMemory {
                    purpose: Purpose::Scratch,
                    ..
                }
            ),
            "{kind}: {error}"
        );
        let small = pool.alloc(Purpose::Scratch, 8 * MIB).unwrap();
        driver
            .upload(0, small.ptr(), &[1; 8], StreamHandle::DEFAULT)
            .unwrap();
        drop(big);
    }
}

#[test]
fn zero_sized_requests_are_errors() {
    let driver = host(HostDriverConfig::default());
    let pool = pool(PoolKind::Caching, &driver, config());
    assert!(matches!(
        pool.alloc(Purpose::Scratch, 0),
        Err(PoolError::ZeroSized { .. })
    ));
}

#[test]
fn probe_passes_on_a_working_vmm_device() {
    let driver = host(HostDriverConfig::default());
    let selection = select_pool(&*driver, 0, &gate_on(), None);
    assert_eq!(selection.kind, PoolKind::Vmm, "{}", selection.reason);
    assert!(
        selection.reason.contains("probe passed"),
        "{}",
        selection.reason
    );
    assert_eq!(driver.used_bytes(), 0, "the probe cleans up after itself");
}

#[test]
fn probe_touches_with_a_kernel_when_given_one() {
    let driver = host(HostDriverConfig::default());
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let touch = |d: &dyn Driver,
                 device: DeviceOrdinal,
                 ptr: DevicePtr,
                 words: u64,
                 pattern: u32,
                 stream: StreamHandle| {
        calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        d.memset_d32_async(device, ptr, pattern, words, stream)
    };
    let report = probe_vmm(&*driver, 0, Some(&touch)).unwrap();
    assert_eq!(report.touched_with, "kernel");
    assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[test]
fn probe_failures_select_the_caching_pool_with_the_reason() {
    let cases = [
        (HostVmmFailure::Reserve, ProbeStep::Reserve),
        (HostVmmFailure::Create, ProbeStep::CreateFirst),
        (HostVmmFailure::Map, ProbeStep::MapFirst),
        (HostVmmFailure::SetAccess, ProbeStep::SetAccessFirst),
    ];
    for (failure, step) in cases {
        let driver = host(HostDriverConfig {
            fail_vmm: Some(failure),
            ..HostDriverConfig::default()
        });
        let selection = select_pool(&*driver, 0, &gate_on(), None);
        assert_eq!(selection.kind, PoolKind::Caching);
        assert_eq!(
            selection.probe.as_ref().unwrap().as_ref().unwrap_err().step,
            step
        );
        assert!(
            selection.reason.contains(&format!("'{step}'")),
            "{}",
            selection.reason
        );
        assert!(
            selection.reason.contains("failure injected"),
            "{}",
            selection.reason
        );
        assert_eq!(
            driver.used_bytes(),
            0,
            "{failure:?}: nothing leaks from a failed probe"
        );
        // The engine still gets a working pool.
        let pool = DevicePool::new(driver.clone(), 0, &gate_on(), config(), None).unwrap();
        assert_eq!(pool.kind(), PoolKind::Caching);
        assert!(
            pool.reason().contains("VMM probe failed"),
            "{}",
            pool.reason()
        );
        drop(pool.alloc(Purpose::Scratch, MIB).unwrap());
    }
}

#[test]
fn a_touch_that_writes_the_wrong_data_fails_the_probe_at_read_back() {
    let driver = host(HostDriverConfig::default());
    let touch =
        |d: &dyn Driver,
         device: DeviceOrdinal,
         ptr: DevicePtr,
         words: u64,
         _pattern: u32,
         stream: StreamHandle| d.memset_d32_async(device, ptr, 0, words, stream);
    let failure = probe_vmm(&*driver, 0, Some(&touch)).unwrap_err();
    assert_eq!(failure.step, ProbeStep::ReadBack);
    assert!(failure.detail.contains("word 0"), "{}", failure.detail);
}

#[test]
fn forced_probe_failure_selects_the_caching_pool() {
    let driver = host(HostDriverConfig::default());
    let options = PoolSelectOptions {
        force_probe_failure: true,
        ..gate_on()
    };
    let pool = DevicePool::new(driver.clone(), 0, &options, config(), None).unwrap();
    assert_eq!(pool.kind(), PoolKind::Caching);
    assert!(
        pool.reason().contains(FORCE_PROBE_FAIL_ENV),
        "{}",
        pool.reason()
    );
}

#[test]
fn gate_off_and_unsupported_devices_never_probe() {
    let driver = host(HostDriverConfig {
        fail_vmm: Some(HostVmmFailure::Reserve),
        ..HostDriverConfig::default()
    });
    let options = PoolSelectOptions {
        vmm_gate: false,
        vmm_gate_reason: Some("hipMemSetAccess faults on gfx1201".to_string()),
        force_probe_failure: false,
    };
    let selection = select_pool(&*driver, 0, &options, None);
    assert_eq!(selection.kind, PoolKind::Caching);
    assert!(selection.probe.is_none());
    assert!(
        selection
            .reason
            .contains("gates VMM off for this target (hipMemSetAccess faults on gfx1201)"),
        "{}",
        selection.reason
    );

    let driver = host(HostDriverConfig {
        vmm_supported: false,
        ..HostDriverConfig::default()
    });
    let selection = select_pool(&*driver, 0, &gate_on(), None);
    assert_eq!(selection.kind, PoolKind::Caching);
    assert!(
        selection
            .reason
            .contains("reports no virtual memory management support"),
        "{}",
        selection.reason
    );
}

#[test]
fn memory_report_renders_every_stage() {
    let driver = host(HostDriverConfig::default());
    let pool = pool(PoolKind::Vmm, &driver, config());
    let weights = pool.alloc(Purpose::Weights, 12 * MIB).unwrap();
    pool.mark_loaded();
    let scratch = pool.alloc(Purpose::Scratch, 20 * MIB).unwrap();
    drop(scratch);
    let state = pool.alloc(Purpose::RecurrentState, 3 * MIB).unwrap();
    drop(state);
    pool.trim_if_idle(Instant::now() + Duration::from_secs(1))
        .unwrap();
    let report = MemoryReport::from_pools(std::slice::from_ref(&pool));
    let text = report.to_string();
    for expected in [
        "memory report",
        "device 0 (ember host device): vmm pool",
        "at load",
        "at peak",
        "after idle",
        "12.0 MiB",
        "32.0 MiB",
        "peak by purpose: weights 12.0 MiB, kv cache 0 B, scratch 20.0 MiB, recurrent state 3.0 MiB",
    ] {
        assert!(text.contains(expected), "missing {expected:?} in\n{text}");
    }
    let device = &report.devices[0];
    assert_eq!(device.at_load.unwrap().live_for(Purpose::Weights), 12 * MIB);
    assert_eq!(device.at_peak.live, 32 * MIB);
    assert_eq!(device.after_idle.unwrap().held, 12 * MIB);
    drop(weights);
}

#[test]
fn the_trim_generation_counts_trims_that_gave_memory_back() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = host(HostDriverConfig::default());
        let pool = pool(kind, &driver, config());
        assert_eq!(pool.trim_generation(), 0);
        let buffer = pool.alloc(Purpose::Scratch, 8 * MIB).unwrap();
        // Nothing idle to give back: the generation stays.
        pool.trim_now().unwrap();
        assert_eq!(pool.trim_generation(), 0, "{kind:?}");
        drop(buffer);
        pool.trim_now().unwrap();
        assert_eq!(pool.trim_generation(), 1, "{kind:?}");
        pool.trim_now().unwrap();
        assert_eq!(
            pool.trim_generation(),
            1,
            "{kind:?}: the second trim had nothing to give"
        );
    }
}

#[test]
fn available_bytes_are_the_device_free_memory_and_idle_memory_within_the_budget() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = host(HostDriverConfig {
            total_memory: 256 * MIB,
            ..HostDriverConfig::default()
        });
        let device = pool(kind, &driver, config());
        assert_eq!(device.available_bytes(), Some(256 * MIB), "{kind}");
        let weights = device.alloc(Purpose::Weights, 96 * MIB).unwrap();
        let scratch = device.alloc(Purpose::Scratch, 32 * MIB).unwrap();
        let held = device.usage().held;
        assert_eq!(
            device.available_bytes(),
            Some(256 * MIB - held),
            "{kind}: what the driver has left"
        );
        // Freed memory the pool keeps counts as available: the next allocation reuses it.
        drop(scratch);
        let usage = device.usage();
        assert_eq!(
            device.available_bytes(),
            Some(256 * MIB - usage.held + (usage.held - usage.live)),
            "{kind}: idle memory of the pool is available"
        );
        drop(weights);

        // A budget caps it at the budget's room.
        let driver = host(HostDriverConfig {
            total_memory: 256 * MIB,
            ..HostDriverConfig::default()
        });
        let budget = PoolConfig {
            budget: Some(128 * MIB),
            ..config()
        };
        let capped = pool(kind, &driver, budget);
        let _weights = capped.alloc(Purpose::Weights, 96 * MIB).unwrap();
        assert_eq!(capped.available_bytes(), Some(32 * MIB), "{kind}");
    }
}

#[test]
fn no_idle_trim_while_a_capture_is_open() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = host(HostDriverConfig::default());
        let pool = pool(kind, &driver, config());
        drop(pool.alloc(Purpose::Scratch, 4 * MIB).unwrap());
        let held = driver.used_bytes();
        assert!(held >= 4 * MIB, "{kind}: {held}");
        pool.hold_idle_trim();
        // Long past the idle time: a capture is open, so nothing is trimmed.
        let later = Instant::now() + Duration::from_secs(5);
        assert!(
            matches!(
                pool.trim_if_idle(later).unwrap(),
                TrimOutcome::NotIdle { .. }
            ),
            "{kind}"
        );
        assert_eq!(driver.used_bytes(), held, "{kind}: nothing given back");
        pool.release_idle_trim();
        // The idle time counts from the capture's end.
        assert!(
            matches!(
                pool.trim_if_idle(Instant::now()).unwrap(),
                TrimOutcome::NotIdle { .. }
            ),
            "{kind}"
        );
        assert!(
            matches!(
                pool.trim_if_idle(later).unwrap(),
                TrimOutcome::Trimmed { .. }
            ),
            "{kind}: trimmed once the capture ended and the idle time passed"
        );
        assert!(driver.used_bytes() < held, "{kind}: memory given back");
    }
}
