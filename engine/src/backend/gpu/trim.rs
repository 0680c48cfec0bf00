//! The idle trimmer: a thread per GPU backend that asks the device pool every
//! [`TRIM_INTERVAL`] to trim itself if it has been idle, so device memory goes back to the
//! post-load floor after a burst without any call from the user (the pool trims once
//! `PoolConfig::idle_after` has passed with no allocation or free, after synchronising the
//! device).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use ember_gpu::pool::TrimOutcome;
use ember_gpu::DevicePool;

/// How often the pool is asked. With the pool's default idle time of 1 s, memory is back within
/// 1.1 s of the last free.
pub const TRIM_INTERVAL: Duration = Duration::from_millis(100);

/// The running thread; stopped and joined on drop.
pub(crate) struct IdleTrimmer {
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
}

impl IdleTrimmer {
    /// Starts the thread. If the OS refuses a thread, memory is still trimmed by the pool when
    /// an allocation needs it; the refusal is logged.
    pub(crate) fn start(pool: Arc<DevicePool>) -> Option<IdleTrimmer> {
        let stop = Arc::new(AtomicBool::new(false));
        let stop_flag = Arc::clone(&stop);
        let spawned = std::thread::Builder::new()
            .name(format!("ember-gpu{}-trim", pool.device()))
            .spawn(move || trim_loop(&pool, &stop_flag));
        match spawned {
            Ok(handle) => Some(IdleTrimmer {
                stop,
                handle: Some(handle),
            }),
            Err(error) => {
                tracing::warn!(%error, "cannot start the idle-trim thread; device memory is given back only when allocations need it");
                None
            }
        }
    }
}

fn trim_loop(pool: &DevicePool, stop: &AtomicBool) {
    let mut reported_error = false;
    while !stop.load(Ordering::Acquire) {
        std::thread::park_timeout(TRIM_INTERVAL);
        if stop.load(Ordering::Acquire) {
            break;
        }
        match pool.trim_if_idle(Instant::now()) {
            Ok(TrimOutcome::Trimmed {
                released,
                held_after,
            }) => {
                tracing::debug!(device = pool.device(), released, held_after, "idle trim");
                reported_error = false;
            }
            Ok(TrimOutcome::NotIdle { .. } | TrimOutcome::AlreadyTrimmed) => {}
            Err(error) => {
                // Reported once per streak: the same failure every 100 ms would flood the log.
                if !reported_error {
                    tracing::warn!(device = pool.device(), %error, "idle trim failed");
                    reported_error = true;
                }
            }
        }
    }
}

impl Drop for IdleTrimmer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(handle) = self.handle.take() {
            handle.thread().unpark();
            if handle.join().is_err() {
                tracing::warn!("the idle-trim thread panicked");
            }
        }
    }
}
