//! CPU time of the GPU backend's ops, for finding what makes a decode step slow to record:
//! `EMBER_GPU_OP_TIMES=1` times every op body ([`GpuBackend::run`](super::GpuBackend)) and the
//! driver launch calls, and the backend logs the table (`info`) when it is dropped. Off, an op
//! and a launch pay one branch each.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Environment variable: `1` turns the op timing on.
pub const OP_TIMES_ENV: &str = "EMBER_GPU_OP_TIMES";

/// One op's calls, total CPU time and slowest call.
#[derive(Clone, Copy, Debug)]
struct Row {
    op: &'static str,
    calls: u64,
    total: Duration,
    slowest: Duration,
}

/// Per op name: calls and CPU time.
#[derive(Debug, Default)]
pub(super) struct OpTimes {
    enabled: bool,
    table: Mutex<Vec<Row>>,
}

impl OpTimes {
    pub(super) fn from_env() -> OpTimes {
        OpTimes {
            enabled: std::env::var(OP_TIMES_ENV).is_ok_and(|v| v.trim() == "1"),
            table: Mutex::new(Vec::new()),
        }
    }

    /// Whether timing is on.
    pub(super) fn enabled(&self) -> bool {
        self.enabled
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
        match table.iter_mut().find(|row| row.op == op) {
            Some(row) => {
                row.calls += 1;
                row.total += elapsed;
                row.slowest = row.slowest.max(elapsed);
            }
            None => table.push(Row {
                op,
                calls: 1,
                total: elapsed,
                slowest: elapsed,
            }),
        }
        result
    }

    /// The table, most time first, one line per op, with the driver's launch calls
    /// (`launches`, `launch_time`) as the last line; none when timing is off. The mean leaves
    /// out each op's slowest call, which holds one-time costs (a kernel module's first load).
    pub(super) fn report(&self, launches: u64, launch_time: Duration) -> Option<String> {
        if !self.enabled {
            return None;
        }
        let mut table = super::lock(&self.table).clone();
        table.sort_by_key(|row| std::cmp::Reverse(row.total));
        let mut text =
            String::from("CPU time of the ops (calls, total, slowest call, mean of the others):");
        for row in table {
            let rest = (row.total - row.slowest).as_secs_f64() * 1e6;
            let mean = rest / row.calls.saturating_sub(1).max(1) as f64;
            text.push_str(&format!(
                "\n  {:<32} {:>8} {:>10.1} ms {:>10.1} us {mean:>8.2} us",
                row.op,
                row.calls,
                row.total.as_secs_f64() * 1e3,
                row.slowest.as_secs_f64() * 1e6
            ));
        }
        let mean = launch_time.as_secs_f64() * 1e6 / launches.max(1) as f64;
        text.push_str(&format!(
            "\n  {:<32} {launches:>8} {:>10.1} ms {:>13} {mean:>8.2} us",
            "(driver launch calls)",
            launch_time.as_secs_f64() * 1e3,
            "-"
        ));
        Some(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_counts_calls_and_leaves_the_slowest_out_of_the_mean() {
        let times = OpTimes {
            enabled: true,
            table: Mutex::new(Vec::new()),
        };
        for i in 0..3 {
            let value = times.time("matmul", || {
                if i == 0 {
                    std::thread::sleep(Duration::from_millis(20));
                }
                i * 2
            });
            assert_eq!(value, i * 2, "the op's result comes back");
        }
        times.time("attention", || ());
        let rows = super::super::lock(&times.table).clone();
        let matmul = rows.iter().find(|r| r.op == "matmul").unwrap();
        assert_eq!(matmul.calls, 3);
        assert!(matmul.slowest >= Duration::from_millis(20));
        assert!(matmul.total - matmul.slowest < Duration::from_millis(20));
        let text = times.report(4, Duration::from_micros(8)).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "a header, two ops, the launch line: {text}");
        assert!(
            lines[1].trim_start().starts_with("matmul"),
            "most time first: {text}"
        );
        assert!(
            lines[3].ends_with("2.00 us"),
            "8 us over 4 launches: {text}"
        );
    }

    #[test]
    fn off_it_records_nothing() {
        let times = OpTimes::default();
        assert_eq!(times.time("matmul", || 7), 7);
        assert!(super::super::lock(&times.table).is_empty());
        assert!(times.report(1, Duration::from_micros(1)).is_none());
    }
}
