//! A trimmed pool measurably gives memory back: the process's resident set (`/proc/self/statm`)
//! drops by what the pool released. This is its own test binary so no other test's allocations
//! move the number while it runs.
#![cfg(target_os = "linux")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use ember_gpu::driver::{Driver, StreamHandle};
use ember_gpu::host::{process_resident_bytes, HostDriver, HostDriverConfig};
use ember_gpu::pool::{DevicePool, PoolConfig, PoolKind, Purpose, TrimOutcome};

const MIB: u64 = 1 << 20;

#[test]
fn trimmed_pools_lower_the_process_resident_set() {
    for kind in [PoolKind::Vmm, PoolKind::Caching] {
        let driver = Arc::new(HostDriver::new(HostDriverConfig::default()));
        let config = PoolConfig {
            idle_after: Duration::from_millis(10),
            vmm_reserve_bytes: Some(1 << 30),
            vmm_chunk_bytes: 8 * MIB,
            ..PoolConfig::default()
        };
        let pool =
            DevicePool::with_kind(driver.clone(), 0, kind, "test".to_string(), config).unwrap();
        let before = process_resident_bytes().unwrap();
        let buffers: Vec<_> = (0..8)
            .map(|_| pool.alloc(Purpose::Scratch, 32 * MIB).unwrap())
            .collect();
        for buffer in &buffers {
            driver
                .memset_d8_async(0, buffer.ptr(), 0xa5, buffer.len(), StreamHandle::DEFAULT)
                .unwrap();
        }
        let peak = process_resident_bytes().unwrap();
        // 256 MiB were touched; allow 16 MiB for whatever else the process did meanwhile.
        assert!(
            peak >= before + 240 * MIB,
            "{kind}: resident {before} -> {peak}"
        );
        drop(buffers);
        let cached = process_resident_bytes().unwrap();
        assert!(
            cached + 16 * MIB >= peak,
            "{kind}: freed buffers stay cached until idle ({peak} -> {cached})"
        );
        let TrimOutcome::Trimmed {
            released,
            held_after,
        } = pool
            .trim_if_idle(Instant::now() + Duration::from_secs(1))
            .unwrap()
        else {
            panic!("{kind}: expected a trim");
        };
        assert_eq!((released, held_after), (256 * MIB, 0), "{kind}");
        let after = process_resident_bytes().unwrap();
        assert!(
            after + 240 * MIB <= peak,
            "{kind}: resident {peak} -> {after} after the trim"
        );
    }
}
