//! The terminal side of loading a model ([`ember::load`]): download and tensor progress as
//! indicatif bars on stderr (hidden when stderr is not a terminal), and the device, numerics,
//! placement and memory-report lines printed as the load reports them.

use std::path::PathBuf;

use ember::backend::gpu::{self, Numerics};
use ember::backend::Backend;
use ember::load::{self as engine_load, AnyLoaded, LoadEvent, LoadOptions, Loaded};
use ember::models::PullProgress;
use ember_gpu::pool::format_bytes;
use indicatif::{ProgressBar, ProgressStyle};

use super::device::DeviceArgs;

/// Pull progress as an indicatif byte bar on stderr (hidden when stderr is not a terminal).
pub struct BarProgress {
    bar: Option<ProgressBar>,
}

impl BarProgress {
    pub fn new() -> Self {
        BarProgress { bar: None }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

impl PullProgress for BarProgress {
    fn message(&mut self, text: &str) {
        match &self.bar {
            // A hidden bar (stderr not a terminal) would swallow the line.
            Some(bar) if !bar.is_hidden() => bar.println(text),
            _ => eprintln!("{text}"),
        }
    }

    fn bytes(&mut self, done: u64, total: u64) {
        let bar = self.bar.get_or_insert_with(|| {
            let bar = ProgressBar::new(total);
            bar.set_style(
                ProgressStyle::with_template(
                    "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            bar
        });
        bar.set_position(done);
    }
}

/// Shows load events on stderr. A bar is cleared before any line is printed after it, so lines
/// and bars never overwrite each other.
struct TerminalEvents {
    pull: BarProgress,
    tensors: Option<ProgressBar>,
    /// -ngl asked for GPU layers: falling back to the CPU is then a warning, not news.
    gpu_asked: bool,
}

impl TerminalEvents {
    fn new() -> Self {
        TerminalEvents {
            pull: BarProgress::new(),
            tensors: None,
            gpu_asked: false,
        }
    }

    /// Clears the bars still shown (at the end of a load, whether it worked or not).
    fn finish(&mut self) {
        self.pull.finish();
        if let Some(bar) = self.tensors.take() {
            bar.finish_and_clear();
        }
    }

    fn show(&mut self, event: LoadEvent<'_>) {
        match event {
            LoadEvent::PullMessage(text) => self.pull.message(text),
            LoadEvent::PullBytes { done, total } => self.pull.bytes(done, total),
            LoadEvent::Resolved { .. } => self.pull.finish(),
            LoadEvent::Tensors {
                file_name,
                done,
                total,
            } => {
                let bar = self.tensors.get_or_insert_with(|| {
                    let bar = ProgressBar::new(total as u64);
                    bar.set_style(
                        ProgressStyle::with_template("loading {msg} {bar:30} {pos}/{len} tensors")
                            .unwrap_or_else(|_| ProgressStyle::default_bar()),
                    );
                    bar.set_message(file_name.to_string());
                    bar
                });
                bar.set_position(done as u64);
            }
            LoadEvent::CpuFallback { reason } if self.gpu_asked => {
                self.finish();
                eprintln!("warning: -ngl asks for GPU layers, but no GPU is usable, so the model runs on the CPU: {reason}");
            }
            line => {
                self.finish();
                print_line(&line);
            }
        }
    }
}

/// Prints the events that are lines rather than progress.
fn print_line(event: &LoadEvent<'_>) {
    match event {
        LoadEvent::CpuFallback { reason } => eprintln!("info: running on the CPU: {reason}"),
        LoadEvent::DeviceOpened {
            device,
            info,
            pool_reason,
            blas,
        } => eprintln!(
            "{device}: {} ({}), {} VRAM; {pool_reason}; {blas}",
            info.name,
            info.arch,
            format_bytes(info.total_memory),
        ),
        LoadEvent::Numerics {
            device,
            numerics: Numerics::Fast,
            ..
        } => eprintln!("{device}: fast numerics"),
        LoadEvent::Numerics {
            device,
            numerics: Numerics::Reference,
            reference_threads,
        } => eprintln!(
            "{device}: reference numerics: every op bit-identical to the CPU backend with {reference_threads} threads ({}); no fused kernels, no decode graphs",
            gpu::REFERENCE_THREADS_ENV
        ),
        LoadEvent::WeightsPlaced { device, verdict } => eprintln!("{device}: {verdict}"),
        LoadEvent::MemoryReport(report) => eprint!("{report}"),
        LoadEvent::SplitMemory(devices) => {
            eprintln!("memory report of the split's devices as the split counts them (weights as stored in the file, KV blocks, activation buffers and the ops' own scratch):");
            for device in devices.iter() {
                eprintln!("  {device}");
            }
        }
        LoadEvent::NoDeviceMemory => {
            eprintln!("memory report: the model runs on the CPU; nothing to report")
        }
        LoadEvent::IdleTrimFailed(error) => {
            eprintln!("warning: trimming device memory failed: {error}")
        }
        LoadEvent::Plan(plan) => eprintln!("load plan:\n{plan}"),
        LoadEvent::SimHostWeights { devices } => eprintln!(
            "warning: {}: the weights of {} are observed in host memory (simulated)",
            ember::backend::sim::HOST_WEIGHTS_ENV,
            devices.join(", ")
        ),
        LoadEvent::PeerPairs {
            pairs,
            names,
            corrupting,
        } => {
            for &(src, dst) in corrupting.iter() {
                eprintln!(
                    "warning: {}: peer copies from {} to {} corrupt (simulated)",
                    ember_gpu::peer::CORRUPT_PEER_ENV,
                    names[src],
                    names[dst]
                );
            }
            for pair in pairs.iter() {
                let how = if pair.peer { "peer copies" } else { "host staging" };
                eprintln!(
                    "{} -> {}: {how} ({})",
                    names[pair.src], names[pair.dst], pair.reason
                );
            }
        }
        LoadEvent::PullMessage(_)
        | LoadEvent::PullBytes { .. }
        | LoadEvent::Resolved { .. }
        | LoadEvent::Tensors { .. } => {}
    }
}

/// The file `-m` names, fetching a pinned model on first use (with a download bar).
pub fn resolve_model(spec: &str) -> anyhow::Result<PathBuf> {
    let mut events = TerminalEvents::new();
    let path = engine_load::resolve_model(spec, &mut |event| events.show(event));
    events.finish();
    Ok(path?)
}

/// Resolves, opens and loads a model and its tokenizer where the device flags say: on the CPU
/// with `threads` threads (0 for the physical core count), or on a GPU; progress on stderr.
/// A `-t` beyond the machine's available parallelism is refused before anything is loaded.
pub fn load_on(spec: &str, threads: usize, device: &DeviceArgs) -> anyhow::Result<AnyLoaded> {
    ember::limits::check_threads(threads).map_err(|e| anyhow::anyhow!("-t {e}"))?;
    let options = LoadOptions {
        model: spec.to_string(),
        threads,
        device: device.options(),
    };
    let mut events = TerminalEvents::new();
    events.gpu_asked =
        matches!(device.gpu_layers, Some(g) if g != ember::device::GpuLayers::Count(0));
    let loaded = engine_load::load(&options, &mut |event| events.show(event));
    events.finish();
    Ok(loaded?)
}

/// With `--memory-report` on a GPU: waits (at most 3 s) for the pool to trim itself after the
/// work, then prints the report (at load, at peak, after idle). Call it once the command's
/// contexts are dropped, so the report shows what idling gives back.
pub fn finish<B: Backend>(loaded: &Loaded<B>) {
    loaded.report_memory_after_idle(&mut |event| print_line(&event));
}

/// [`finish`] for a command whose model went to an engine (now shut down): the memory report of
/// its devices after idling.
pub fn print_memory_report_after_idle(reporter: &ember::load::MemoryReporter) {
    reporter.report_after_idle(&mut |event| print_line(&event));
}
