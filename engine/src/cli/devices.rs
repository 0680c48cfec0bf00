//! `ember devices`: the CPU, the GPU runtimes looked for (and from where they were loaded), each
//! GPU with its architecture, memory, VMM support, the memory pool it would get and why, and the
//! kernels this build carries for it. One line per runtime and per device by default; `-v` adds
//! every library name tried, the pool's reason and the kernel modules; `--format json` gives all
//! of it to scripts.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;

use ember::backend::cpu::physical_cores;
use ember::peer_report::PeerReport;
use ember_gpu::devices::{list, DeviceListing};
use ember_gpu::driver::{AttemptOutcome, DriverError, LibraryAttempt};
use ember_gpu::pool::{format_bytes, PoolSelectOptions};

use super::Format;

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// ROCm installation to load the HIP runtime from (default: ROCM_PATH, then /opt/rocm, then
    /// the system loader).
    #[arg(long, env = "ROCM_PATH")]
    pub rocm_path: Option<PathBuf>,
    /// Folder holding the per-architecture code objects (default: `kernels/` beside the binary,
    /// or EMBER_KERNELS_DIR).
    #[arg(long, env = "EMBER_KERNELS_DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Run the VMM probe on each GPU (maps, grows, sets access and touches memory) instead of
    /// reporting the gate and the device's VMM attribute only; with several GPUs, also the
    /// start-up peer-copy self-test of every pair (where the build's peer_copy gate is probe).
    #[arg(long)]
    pub probe: bool,
    /// Also show every runtime library name tried and what became of it, why each GPU gets the
    /// memory pool it gets, and the kernel modules found.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    /// Output format. `json` prints one object for scripts, with stable field names: `cpu`
    /// (`arch`, `simd`, `physical_cores`), `runtimes` (each `backend`, `loaded`, `library`,
    /// `runtime_version`, `driver_version`, `other_installs`, `error`, `attempts` with
    /// `candidate`, `outcome` = absent|load_failed|loaded, `reason`), `kernels` (`dir`,
    /// `architectures`), `devices` (each `id` such as `hip:0`, `backend`, `ordinal`, `name`,
    /// `arch`, `total_memory_bytes`, `free_memory_bytes`, `vmm_supported`, `integrated`, `pool`,
    /// `pool_reason`, `kernels_complete`, `kernel_modules`, `kernels_error`) and `failures`
    /// (each `id`, `backend`, `ordinal`, `error`), `peer_copy` (`gate` on|off|probe, `reason`,
    /// `pairs`: each `src`, `dst`, `peer`, `reason`, `self_test` passed|failed|not run).
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

#[derive(Debug, Serialize)]
struct DevicesReport {
    cpu: CpuEntry,
    runtimes: Vec<RuntimeEntry>,
    kernels: KernelsEntry,
    devices: Vec<DeviceEntry>,
    failures: Vec<FailureEntry>,
    peer_copy: PeerReport,
}

#[derive(Debug, Serialize)]
struct CpuEntry {
    arch: &'static str,
    simd: String,
    physical_cores: usize,
}

#[derive(Debug, Serialize)]
struct RuntimeEntry {
    backend: String,
    loaded: bool,
    library: Option<String>,
    runtime_version: Option<i32>,
    driver_version: Option<i32>,
    other_installs: Vec<String>,
    /// Why the runtime is not usable, in one line (null when loaded).
    error: Option<String>,
    attempts: Vec<AttemptEntry>,
}

#[derive(Debug, Serialize)]
struct AttemptEntry {
    candidate: String,
    /// `absent`, `load_failed` or `loaded`.
    outcome: &'static str,
    reason: Option<String>,
}

#[derive(Debug, Serialize)]
struct KernelsEntry {
    dir: String,
    architectures: Vec<String>,
}

#[derive(Debug, Serialize)]
struct DeviceEntry {
    id: String,
    backend: String,
    ordinal: usize,
    name: String,
    arch: String,
    total_memory_bytes: u64,
    free_memory_bytes: Option<u64>,
    vmm_supported: bool,
    integrated: bool,
    /// `vmm` or `caching`.
    pool: String,
    pool_reason: String,
    kernels_complete: bool,
    kernel_modules: Vec<String>,
    kernels_error: Option<String>,
}

#[derive(Debug, Serialize)]
struct FailureEntry {
    id: String,
    backend: String,
    ordinal: usize,
    error: String,
}

fn attempt_entry(attempt: &LibraryAttempt) -> AttemptEntry {
    let (outcome, reason) = match &attempt.outcome {
        AttemptOutcome::Absent => ("absent", None),
        AttemptOutcome::LoadFailed(reason) => ("load_failed", Some(reason.clone())),
        AttemptOutcome::Loaded => ("loaded", None),
    };
    AttemptEntry {
        candidate: attempt.candidate.clone(),
        outcome,
        reason,
    }
}

/// A runtime's failure in one line: a missing library is summed up (the names tried are in
/// `attempts`, shown with -v), any other error is shown whole.
fn short_error(error: &DriverError) -> String {
    match error {
        DriverError::LibraryNotFound {
            runtime,
            attempts,
            hint,
        } => format!(
            "no {runtime} runtime library found ({} names tried); {hint}",
            attempts.len()
        ),
        // The library was found and loaded; its initialisation (hipInit, cuInit) refused.
        DriverError::Call { .. } => format!("the runtime library loaded, but {error}"),
        other => other.to_string(),
    }
}

fn report(listing: &DeviceListing, probe: bool) -> DevicesReport {
    let runtimes = listing
        .runtimes
        .iter()
        .map(|runtime| match &runtime.outcome {
            Ok(info) => RuntimeEntry {
                backend: runtime.backend.to_string(),
                loaded: true,
                library: info.library.as_ref().map(|p| p.display().to_string()),
                runtime_version: info.runtime_version,
                driver_version: info.driver_version,
                other_installs: info
                    .other_installs
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect(),
                error: None,
                attempts: info.attempts.iter().map(attempt_entry).collect(),
            },
            Err(error) => RuntimeEntry {
                backend: runtime.backend.to_string(),
                loaded: false,
                library: None,
                runtime_version: None,
                driver_version: None,
                other_installs: Vec::new(),
                error: Some(short_error(error)),
                attempts: match error {
                    DriverError::LibraryNotFound { attempts, .. } => {
                        attempts.iter().map(attempt_entry).collect()
                    }
                    _ => Vec::new(),
                },
            },
        })
        .collect();
    let devices: Vec<DeviceEntry> = listing
        .devices
        .iter()
        .map(|d| {
            let (kernels_complete, kernel_modules, kernels_error) = match &d.kernels {
                Ok(modules) => (true, modules.iter().map(|m| m.to_string()).collect(), None),
                Err(error) => (false, Vec::new(), Some(error.clone())),
            };
            DeviceEntry {
                id: device_id(d),
                backend: d.backend.to_string(),
                ordinal: d.ordinal,
                name: d.name.clone(),
                arch: d.arch.clone(),
                total_memory_bytes: d.total_memory,
                free_memory_bytes: d.free_memory,
                vmm_supported: d.vmm_supported,
                integrated: d.integrated,
                pool: d.pool.to_string(),
                pool_reason: d.pool_reason.clone(),
                kernels_complete,
                kernel_modules,
                kernels_error,
            }
        })
        .collect();
    let failures = listing
        .failures
        .iter()
        .map(|f| FailureEntry {
            id: format!("{}:{}", f.backend, f.ordinal),
            backend: f.backend.to_string(),
            ordinal: f.ordinal,
            error: f.error.to_string(),
        })
        .collect();
    DevicesReport {
        cpu: CpuEntry {
            arch: std::env::consts::ARCH,
            simd: ember_quant::simd::detected().to_string(),
            physical_cores: physical_cores(),
        },
        runtimes,
        kernels: KernelsEntry {
            dir: listing.kernels_dir.display().to_string(),
            architectures: listing.kernel_archs.clone(),
        },
        peer_copy: match (probe, &listing.peer_link) {
            // --probe runs the start-up peer-copy self-test over the listed GPUs, as a load
            // over them would.
            (true, Some(link)) => {
                // `run` has checked EMBER_PEER_COPY; a value that went bad since keeps copies
                // in host memory, with the error as the reason.
                let (gate, reason) = ember::build_manifest::peer_gate()
                    .unwrap_or_else(|error| (ember_gpu::peer::PeerGate::Off, Some(error)));
                PeerReport::probe(&gpu_names(&devices), gate, reason, Some(link))
            }
            _ => PeerReport::for_gpus(&gpu_names(&devices)),
        },
        devices,
        failures,
    }
}

fn gpu_names(devices: &[DeviceEntry]) -> Vec<String> {
    devices.iter().map(|d| d.id.clone()).collect()
}

/// A listed GPU's name as `--device` writes it (`hip:0`).
fn device_id(device: &ember_gpu::devices::DeviceEntry) -> String {
    format!("{}:{}", device.backend, device.ordinal)
}

/// The names of the GPUs listed, as `ember devices` names them, for the peer-copy report of
/// `ember info`.
pub fn listed_gpu_names(listing: &DeviceListing) -> Vec<String> {
    listing.devices.iter().map(device_id).collect()
}

fn render_text(report: &DevicesReport, verbose: bool) -> String {
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!(
        "cpu0    {}, {} SIMD, {} physical cores",
        report.cpu.arch, report.cpu.simd, report.cpu.physical_cores
    ));
    for runtime in &report.runtimes {
        let text = match &runtime.error {
            None => {
                let mut text = format!(
                    "loaded {}",
                    runtime.library.as_deref().unwrap_or("(path unknown)")
                );
                if let Some(version) = runtime.runtime_version {
                    text.push_str(&format!(", runtime version {version}"));
                }
                if let Some(version) = runtime.driver_version {
                    text.push_str(&format!(", driver version {version}"));
                }
                if !runtime.other_installs.is_empty() {
                    text.push_str(&format!(
                        "; other installs found: {}",
                        runtime.other_installs.join(", ")
                    ));
                }
                text
            }
            Some(error) => format!("not available: {error}"),
        };
        line(format!("{:<7} {text}", runtime.backend));
        if verbose {
            for attempt in &runtime.attempts {
                let outcome = match (attempt.outcome, &attempt.reason) {
                    (_, Some(reason)) => format!("load failed: {reason}"),
                    (outcome, None) => outcome.to_string(),
                };
                line(format!("          tried {}: {outcome}", attempt.candidate));
            }
        }
    }
    let archs = if report.kernels.architectures.is_empty() {
        "none".to_string()
    } else {
        report.kernels.architectures.join(", ")
    };
    line(format!(
        "kernels {} (architectures: {archs})",
        report.kernels.dir
    ));
    if report.devices.is_empty() && report.failures.is_empty() {
        line("devices: none; ember runs on the CPU".to_string());
    }
    for d in &report.devices {
        let free = d
            .free_memory_bytes
            .map(format_bytes)
            .unwrap_or_else(|| "unknown".to_string());
        let kernels = if d.kernels_complete {
            format!("kernels: all {} modules", d.kernel_modules.len())
        } else {
            "kernels: missing".to_string()
        };
        line(format!(
            "{:<7} {} ({}{}), {} total, {free} free, vmm {}, {} pool, {kernels}",
            d.id,
            d.name,
            d.arch,
            if d.integrated { ", integrated" } else { "" },
            format_bytes(d.total_memory_bytes),
            if d.vmm_supported {
                "supported"
            } else {
                "not supported"
            },
            d.pool,
        ));
        if verbose {
            line(format!("          pool: {}", d.pool_reason));
            if d.kernels_complete {
                line(format!(
                    "          kernels: {}",
                    d.kernel_modules.join(", ")
                ));
            }
        }
        if let Some(error) = &d.kernels_error {
            line(format!("          kernels: {error}"));
        }
    }
    for f in &report.failures {
        line(format!("{:<7} could not be queried: {}", f.id, f.error));
    }
    // Fewer than two GPUs: no pair to copy between, and nothing to say.
    if !report.peer_copy.pairs.is_empty() {
        for text in report.peer_copy.lines() {
            line(text);
        }
    }
    out
}

/// Lists the runtimes and GPUs without probing them.
pub fn list_devices(
    rocm_path: Option<PathBuf>,
    kernels_dir: Option<PathBuf>,
    probe: bool,
) -> DeviceListing {
    // The build's VMM gate is the run-time default; a development build has no gate and lets the
    // probe decide.
    let vmm = ember::build_manifest::feature("vmm");
    let vmm_gate = vmm.is_none_or(|f| f.enabled);
    let vmm_reason = vmm.and_then(|f| f.reason.clone());
    let options = ember_gpu::devices::ListOptions {
        rocm_path,
        kernels_dir,
        pool: PoolSelectOptions::from_env(vmm_gate, vmm_reason),
        probe,
    };
    list(&options)
}

pub fn run(args: DevicesArgs) -> anyhow::Result<()> {
    if args.probe {
        ember::build_manifest::peer_gate().map_err(anyhow::Error::msg)?;
    }
    let report = report(
        &list_devices(args.rocm_path, args.kernels_dir, args.probe),
        args.probe,
    );
    match args.format {
        Format::Json => println!("{}", serde_json::to_string_pretty(&report)?),
        Format::Text => print!("{}", render_text(&report, args.verbose)),
    }
    Ok(())
}
