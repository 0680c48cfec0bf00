//! CPU time of the GPU backend's ops, for finding what makes a decode step slow to record:
//! `EMBER_GPU_OP_TIMES=1` times every op body ([`GpuBackend::run`](super::GpuBackend)) and the
//! driver launch calls, and the backend logs the table (`info`) when it is dropped. Off, an op
//! pays one branch on a constant.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Environment variable: `1` turns the op timing on.
pub const OP_TIMES_ENV: &str = "EMBER_GPU_OP_TIMES";

/// Per op name: calls and total CPU time.
#[derive(Debug, Default)]
pub(super) struct OpTimes {
    enabled: bool,
    table: Mutex<Vec<(&'static str, u64, Duration)>>,
}

impl OpTimes {
    pub(super) fn from_env() -> OpTimes {
        OpTimes {
            enabled: std::env::var(OP_TIMES_ENV).is_ok_and(|v| v.trim() == "1"),
            table: Mutex::new(Vec::new()),
        }
    }

    /// Runs `f`, adding its CPU time to `op`'s row when timing is on.
    pub(super) fn time<R>(&self, op: &'static str, f: impl FnOnce() -> R) -> R {
        if !self.enabled {
            return f();
        }
        let started = Instant::now();
        let result = f();
        let elapsed = started.elapsed();
        let mut table = super::lock(&self.table);
        match table.iter_mut().find(|(name, _, _)| *name == op) {
            Some(row) => {
                row.1 += 1;
                row.2 += elapsed;
            }
            None => table.push((op, 1, elapsed)),
        }
        result
    }

    /// The table, most time first, one line per op, with the driver's launch calls
    /// (`launches`, `launch_time`) as the last line; none when timing is off.
    pub(super) fn report(&self, launches: u64, launch_time: Duration) -> Option<String> {
        if !self.enabled {
            return None;
        }
        let mut table = super::lock(&self.table).clone();
        table.sort_by(|a, b| b.2.cmp(&a.2));
        let mut text = String::from("CPU time of the ops (calls, total, mean):");
        for (op, calls, total) in table {
            let mean = total.as_secs_f64() * 1e6 / calls.max(1) as f64;
            text.push_str(&format!(
                "\n  {op:<28} {calls:>8} {:>10.1} ms {mean:>8.2} us",
                total.as_secs_f64() * 1e3
            ));
        }
        let mean = launch_time.as_secs_f64() * 1e6 / launches.max(1) as f64;
        text.push_str(&format!(
            "\n  {:<28} {launches:>8} {:>10.1} ms {mean:>8.2} us",
            "(driver launch calls)",
            launch_time.as_secs_f64() * 1e3
        ));
        Some(text)
    }
}
