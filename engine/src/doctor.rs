//! `ember doctor`: a preflight that answers "why is my GPU not used" without loading a model.
//!
//! Every check reads the system through a [`SystemView`]: a root folder (`/`, or a fake tree
//! in tests), the environment as a map, and the user's identity. So each branch runs against
//! fake `/sys`, `/dev`, `/etc` and library trees built by a test. Each check gives ok, warn or
//! fail with the fix; a fail means something blocks GPU use.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// How a check came out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Status {
    Ok,
    Warn,
    Fail,
}

impl Status {
    pub fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

/// One line of the report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// What was checked (`hip runtime`, `/dev/kfd`, ...).
    pub name: String,
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about it, for warn and fail.
    pub fix: Option<String>,
}

impl Check {
    fn new(name: &str, status: Status, detail: impl Into<String>, fix: Option<&str>) -> Check {
        Check {
            name: name.to_string(),
            status,
            detail: detail.into(),
            fix: fix.map(str::to_string),
        }
    }
}

/// The system as the checks see it.
#[derive(Debug, Clone)]
pub struct SystemView {
    /// Where `/` is: the real root, or a fake tree.
    pub root: PathBuf,
    pub env: BTreeMap<String, String>,
    /// The user's id, name and group ids (primary and supplementary).
    pub uid: u32,
    pub user: String,
    pub gids: Vec<u32>,
    /// The kernels folder of this build (per-architecture subfolders).
    pub kernels_dir: PathBuf,
    /// The GPUs the runtimes reported (filled by the caller from the device listing; tests
    /// give fakes).
    pub gpus: Vec<GpuView>,
    /// What loading each GPU runtime gave (filled by the caller; empty when not asked).
    pub runtimes: Vec<RuntimeView>,
}

/// A GPU runtime as ember loaded it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeView {
    /// `hip` or `cuda`.
    pub backend: String,
    pub outcome: RuntimeOutcome,
}

/// What loading a runtime gave.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RuntimeOutcome {
    /// Loaded and initialised: the library and its version, as the listing says them.
    Loaded(String),
    /// No library of the runtime was found.
    NotFound,
    /// The library loaded, but initialising it failed (the error).
    InitFailed(String),
}

/// One GPU as a runtime reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuView {
    /// `hip:0`, `cuda:1`, ...
    pub id: String,
    pub name: String,
    pub arch: String,
    pub total_bytes: u64,
    /// `None` when the runtime could not say.
    pub free_bytes: Option<u64>,
    pub vmm: VmmProbe,
    /// Whether this build has every kernel module for the architecture.
    pub kernels: bool,
}

/// What the start-up VMM probe said on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmProbe {
    /// It mapped, grew, set access and touched memory: the VMM pool is used.
    Passed,
    /// It failed at a step (the reason): the caching pool is used.
    Failed(String),
    /// Not run: the build gates VMM off for this target, or the device lacks it (the reason).
    NotRun(String),
}

/// What a model needs, for `ember doctor -m`: weights per layer and beside the layers, and
/// the KV cache and scratch at the default context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelNeeds {
    pub name: String,
    /// Weight bytes of each layer (`blk.N.*` tensors).
    pub layer_bytes: Vec<u64>,
    /// Weight bytes outside the layers (embeddings, output norm and head).
    pub other_bytes: u64,
    /// KV cache bytes of each layer for a full context of `n_ctx`.
    pub kv_layer_bytes: Vec<u64>,
    pub n_ctx: usize,
    /// Activation buffers of a prompt batch.
    pub scratch_bytes: u64,
}

impl ModelNeeds {
    fn layer_total(&self, il: usize) -> u64 {
        self.layer_bytes[il] + self.kv_layer_bytes.get(il).copied().unwrap_or(0)
    }

    /// Everything at once.
    pub fn total_bytes(&self) -> u64 {
        (0..self.layer_bytes.len())
            .map(|il| self.layer_total(il))
            .sum::<u64>()
            + self.other_bytes
            + self.scratch_bytes
    }
}

impl SystemView {
    /// The machine this process runs on.
    pub fn current(kernels_dir: PathBuf) -> SystemView {
        let env: BTreeMap<String, String> = std::env::vars().collect();
        #[cfg(unix)]
        let (uid, gids) = {
            // SAFETY: getuid, getgid and getgroups only read the process's credentials; the
            // buffer passed to getgroups has room for the count given.
            unsafe {
                let uid = libc::getuid();
                let mut gids = vec![libc::getgid()];
                let n = libc::getgroups(0, std::ptr::null_mut());
                if n > 0 {
                    let mut buf = vec![0 as libc::gid_t; n as usize];
                    let got = libc::getgroups(n, buf.as_mut_ptr());
                    if got > 0 {
                        gids.extend(&buf[..got as usize]);
                    }
                }
                (uid, gids)
            }
        };
        #[cfg(not(unix))]
        let (uid, gids) = (0u32, Vec::new());
        let user = env
            .get("USER")
            .or_else(|| env.get("LOGNAME"))
            .cloned()
            .unwrap_or_default();
        SystemView {
            root: PathBuf::from("/"),
            env,
            uid,
            user,
            gids,
            kernels_dir,
            gpus: Vec::new(),
            runtimes: Vec::new(),
        }
    }

    /// `path` (absolute, as on the real system) inside the root.
    pub fn path(&self, path: &str) -> PathBuf {
        self.root.join(path.trim_start_matches('/'))
    }

    fn read(&self, path: &str) -> Option<String> {
        crate::limits::read_text_file(&self.path(path), 1 << 20).ok()
    }

    fn var(&self, key: &str) -> Option<&str> {
        self.env.get(key).map(String::as_str)
    }
}

/// Every check, in the order they are shown.
pub fn run(system: &SystemView) -> Vec<Check> {
    let mut checks = Vec::new();
    checks.extend(hip_runtimes(system));
    checks.push(cuda_runtime(system));
    checks.extend(runtime_loads(system));
    checks.extend(kernel_driver(system));
    checks.extend(device_nodes(system));
    checks.extend(environment(system));
    checks.extend(gpu_architectures(system));
    checks.extend(gpu_memory(system));
    checks
}

/// Every check of [`run`], then whether `model` fits and where its layers would go.
pub fn run_with_model(system: &SystemView, model: &ModelNeeds) -> Vec<Check> {
    let mut checks = run(system);
    checks.push(model_fit(system, model));
    checks
}

/// Free VRAM (warn when another process holds most of it) and the VMM probe of each GPU.
fn gpu_memory(system: &SystemView) -> Vec<Check> {
    let mut checks = Vec::new();
    for gpu in &system.gpus {
        let name = format!("{} memory", gpu.id);
        let total = ember_gpu::pool::format_bytes(gpu.total_bytes);
        checks.push(match gpu.free_bytes {
            None => Check::new(
                &name,
                Status::Warn,
                format!("{} ({}): {total} total, free memory unknown", gpu.name, gpu.arch),
                Some("the runtime did not report free memory; ember sizes the KV cache from --vram-budget then (set it)"),
            ),
            // Less than a tenth free: something else holds the device.
            Some(free) if free < gpu.total_bytes / 10 => Check::new(
                &name,
                Status::Warn,
                format!(
                    "{} ({}): only {} free of {total}",
                    gpu.name,
                    gpu.arch,
                    ember_gpu::pool::format_bytes(free)
                ),
                Some("another process holds most of the VRAM: stop it (`rocm-smi --showpids` or `nvidia-smi` names it), or models will not fit"),
            ),
            Some(free) => Check::new(
                &name,
                Status::Ok,
                format!(
                    "{} ({}): {} free of {total}",
                    gpu.name,
                    gpu.arch,
                    ember_gpu::pool::format_bytes(free)
                ),
                None,
            ),
        });
        let name = format!("{} vmm probe", gpu.id);
        checks.push(match &gpu.vmm {
            VmmProbe::Passed => Check::new(
                &name,
                Status::Ok,
                "passed: the VMM pool maps memory on demand and unmaps it when idle",
                None,
            ),
            VmmProbe::NotRun(reason) => Check::new(
                &name,
                Status::Ok,
                format!("not run: {reason}; the caching pool returns memory when idle"),
                None,
            ),
            VmmProbe::Failed(reason) => Check::new(
                &name,
                Status::Warn,
                format!("failed: {reason}"),
                Some("ember uses the caching pool instead (memory still goes back when idle), so nothing blocks the GPU; report the failure with `ember devices --probe -v`"),
            ),
        });
    }
    checks
}

/// Where each layer of `model` would go: as many of the last layers as the GPUs' free memory
/// holds (less a reserve for the runtime), in device order, the first ones on the CPU.
fn model_fit(system: &SystemView, model: &ModelNeeds) -> Check {
    let name = "model fit";
    let n_layer = model.layer_bytes.len();
    let fmt = ember_gpu::pool::format_bytes;
    let usable: Vec<&GpuView> = system
        .gpus
        .iter()
        .filter(|g| g.kernels && g.free_bytes.is_some())
        .collect();
    let cpu_available = system.read("/proc/meminfo").and_then(|text| {
        text.lines().find_map(|l| {
            let kib: u64 = l
                .strip_prefix("MemAvailable:")?
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse()
                .ok()?;
            Some(kib * 1024)
        })
    });
    let cpu_note = |bytes: u64| match cpu_available {
        Some(free) if bytes > free => (
            Status::Fail,
            format!("{} needed on the CPU, {} available", fmt(bytes), fmt(free)),
        ),
        Some(free) => (
            Status::Ok,
            format!("{} needed on the CPU, {} available", fmt(bytes), fmt(free)),
        ),
        None => (Status::Ok, format!("{} needed on the CPU", fmt(bytes))),
    };
    if usable.is_empty() {
        let (status, memory) = cpu_note(model.total_bytes());
        return Check::new(
            name,
            if status == Status::Fail { Status::Fail } else { Status::Warn },
            format!(
                "{}: no usable GPU, so all {n_layer} layers would run on the CPU ({memory}, context {})",
                model.name, model.n_ctx
            ),
            Some(if status == Status::Fail {
                "the model does not fit in memory: use a smaller quant or a shorter context (-c)"
            } else {
                "fix the GPU checks above to run it on a GPU"
            }),
        );
    }
    // A reserve per device for the runtime, kernels and fragmentation: 5% of the device, at
    // least 256 MiB.
    // How many layers each GPU can hold, in device order. As with llama.cpp's -ngl, the GPU
    // layers are the last ones: the first layers stay on the CPU, the rest go to the GPUs in
    // contiguous ranges. Layers are of nearly equal size, so the count is taken with the
    // largest.
    let largest = (0..n_layer)
        .map(|il| model.layer_total(il))
        .max()
        .unwrap_or(0)
        .max(1);
    let mut capacities: Vec<(&GpuView, usize)> = Vec::new();
    for (i, gpu) in usable.iter().enumerate() {
        let reserve = (gpu.total_bytes / 20).max(256 << 20);
        let mut room = gpu.free_bytes.unwrap_or(0).saturating_sub(reserve);
        // The scratch and the output head: charged to the first GPU (the embeddings are read
        // from the file's mapping on the CPU).
        if i == 0 {
            room = room.saturating_sub(model.other_bytes + model.scratch_bytes);
        }
        capacities.push((gpu, (room / largest) as usize));
    }
    let on_gpu = capacities
        .iter()
        .map(|&(_, n)| n)
        .sum::<usize>()
        .min(n_layer);
    let mut parts: Vec<String> = Vec::new();
    let mut next = n_layer - on_gpu;
    for (gpu, capacity) in capacities {
        let end = (next + capacity).min(n_layer);
        if end > next {
            let used: u64 = (next..end).map(|il| model.layer_total(il)).sum();
            parts.push(format!(
                "layers {next}..{} on {} ({})",
                end - 1,
                gpu.id,
                fmt(used)
            ));
        }
        next = end;
    }
    if on_gpu == n_layer {
        return Check::new(
            name,
            Status::Ok,
            format!(
                "{}: fits, all {n_layer} layers on the GPU: {} (context {})",
                model.name,
                parts.join(", "),
                model.n_ctx
            ),
            None,
        );
    }
    let n_cpu = n_layer - on_gpu;
    let rest: u64 = (0..n_cpu).map(|il| model.layer_total(il)).sum();
    let (status, memory) = cpu_note(rest);
    parts.insert(0, format!("layers 0..{} on the CPU ({memory})", n_cpu - 1));
    Check::new(
        name,
        if status == Status::Fail {
            Status::Fail
        } else {
            Status::Warn
        },
        format!(
            "{}: does not fit in VRAM at context {}: {}",
            model.name,
            model.n_ctx,
            parts.join(", ")
        ),
        Some(&if on_gpu == 0 {
            "not one layer fits in the GPUs' free memory: free VRAM (see the memory lines above), or use a smaller quant or a shorter context (-c)".to_string()
        } else {
            format!("-ngl {on_gpu} puts the last {on_gpu} layers on the GPU and the rest on the CPU (slower); a smaller quant or a shorter context (-c) fits more")
        }),
    )
}

/// Whether anything blocks GPU use (the exit status of `ember doctor`).
pub fn blocks_gpu(checks: &[Check]) -> bool {
    checks.iter().any(|c| c.status == Status::Fail)
}

/// A ROCm install: its prefix, the HIP runtime libraries in it and its version.
#[derive(Debug, Clone, PartialEq, Eq)]
struct RocmInstall {
    prefix: String,
    libraries: Vec<String>,
    version: Option<String>,
}

fn hip_libraries(system: &SystemView, dir: &str) -> Vec<String> {
    let Ok(entries) = fs::read_dir(system.path(dir)) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("libamdhip64.so"))
        .collect();
    names.sort();
    names
}

fn rocm_installs(system: &SystemView) -> Vec<RocmInstall> {
    let mut prefixes: Vec<String> = Vec::new();
    if let Some(p) = system.var("ROCM_PATH").filter(|p| !p.is_empty()) {
        prefixes.push(p.trim_end_matches('/').to_string());
    }
    if let Ok(entries) = fs::read_dir(system.path("/opt")) {
        let mut found: Vec<String> = entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("rocm"))
            .map(|n| format!("/opt/{n}"))
            .collect();
        found.sort();
        prefixes.extend(found);
    }
    prefixes.extend(["/usr".to_string()]);
    let mut installs: Vec<RocmInstall> = Vec::new();
    for prefix in prefixes {
        let mut libraries = Vec::new();
        for sub in ["lib", "lib64", "lib/x86_64-linux-gnu"] {
            for name in hip_libraries(system, &format!("{prefix}/{sub}")) {
                libraries.push(format!("{prefix}/{sub}/{name}"));
            }
        }
        if libraries.is_empty() {
            continue;
        }
        // /opt/rocm is usually a link to /opt/rocm-X.Y.Z: one install, not two.
        let real = fs::canonicalize(system.path(&prefix)).ok();
        if installs.iter().any(|i| {
            i.prefix == prefix
                || (real.is_some() && fs::canonicalize(system.path(&i.prefix)).ok() == real)
        }) {
            continue;
        }
        let version = system
            .read(&format!("{prefix}/.info/version"))
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .or_else(|| {
                libraries.iter().find_map(|l| {
                    let suffix = l.rsplit_once("libamdhip64.so.")?.1;
                    (suffix.contains('.')).then(|| suffix.to_string())
                })
            });
        installs.push(RocmInstall {
            prefix,
            libraries,
            version,
        });
    }
    installs
}

fn hip_runtimes(system: &SystemView) -> Vec<Check> {
    let installs = rocm_installs(system);
    let describe = |i: &RocmInstall| {
        format!(
            "{} (ROCm {}): {}",
            i.prefix,
            i.version.as_deref().unwrap_or("version unknown"),
            i.libraries.join(", ")
        )
    };
    match installs.as_slice() {
        [] => vec![Check::new(
            "hip runtime",
            Status::Warn,
            "no libamdhip64 found (ROCM_PATH, /opt/rocm*, /usr/lib)",
            Some("for an AMD GPU install ROCm 6 or 7 (the HIP runtime, e.g. `hip-runtime-amd`) or set ROCM_PATH; without it ember runs on the CPU"),
        )],
        [one] => {
            // ember loads libamdhip64.so.6 or .so.7 (ROCm 6 and 7); an older install is not used.
            let major = one
                .version
                .as_deref()
                .and_then(|v| v.split('.').next()?.parse::<u32>().ok());
            match major {
                Some(m) if m < 6 => vec![Check::new(
                    "hip runtime",
                    Status::Warn,
                    describe(one),
                    Some("ember needs ROCm 6 or 7 (libamdhip64.so.6 or .so.7): install a newer ROCm for the GPU, or ember runs on the CPU"),
                )],
                _ => vec![Check::new("hip runtime", Status::Ok, describe(one), None)],
            }
        }
        many => {
            let chosen = system
                .var("ROCM_PATH")
                .filter(|p| !p.is_empty())
                .unwrap_or("/opt/rocm");
            vec![Check::new(
                "hip runtime",
                Status::Warn,
                format!(
                    "{} ROCm installs side by side: {}",
                    many.len(),
                    many.iter().map(describe).collect::<Vec<_>>().join("; ")
                ),
                Some(&format!(
                    "mixing installs is a known cause of weights landing in system RAM: ember loads from {chosen} first; pass --rocm-path or set ROCM_PATH to the one your driver matches, and remove the others from LD_LIBRARY_PATH"
                )),
            )]
        }
    }
}

fn cuda_runtime(system: &SystemView) -> Check {
    let dirs = [
        "/usr/lib/x86_64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
        "/usr/local/cuda/lib64",
        "/usr/lib/wsl/lib",
    ];
    let mut found = Vec::new();
    for dir in dirs {
        if let Ok(entries) = fs::read_dir(system.path(dir)) {
            let mut names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("libcuda.so"))
                .collect();
            names.sort();
            found.extend(names.into_iter().map(|n| format!("{dir}/{n}")));
        }
    }
    if found.is_empty() {
        Check::new(
            "cuda driver library",
            Status::Warn,
            "no libcuda.so found",
            Some("for an NVIDIA GPU install the NVIDIA driver (it ships libcuda); without it ember runs on the CPU"),
        )
    } else {
        Check::new("cuda driver library", Status::Ok, found.join(", "), None)
    }
}

/// What loading each runtime gave: a library that loads but does not initialise while its
/// kernel driver is there blocks the GPU; without the driver it is only expected.
fn runtime_loads(system: &SystemView) -> Vec<Check> {
    system
        .runtimes
        .iter()
        .filter_map(|runtime| {
            let name = format!("{} load", runtime.backend);
            match &runtime.outcome {
                RuntimeOutcome::Loaded(detail) => {
                    Some(Check::new(&name, Status::Ok, detail.clone(), None))
                }
                // The library checks above already say what is missing and how to install it.
                RuntimeOutcome::NotFound => None,
                RuntimeOutcome::InitFailed(error) => {
                    let driver_present = match runtime.backend.as_str() {
                        "hip" => system.path("/dev/kfd").exists(),
                        _ => system.path("/proc/driver/nvidia/version").exists(),
                    };
                    Some(if driver_present {
                        Check::new(
                            &name,
                            Status::Fail,
                            format!("the library loaded, but {error}"),
                            Some("the runtime does not match the kernel driver, or the device nodes cannot be opened: see the driver and device checks; install the runtime release that goes with the driver"),
                        )
                    } else {
                        Check::new(
                            &name,
                            Status::Warn,
                            format!("the library loaded, but {error} (no GPU driver is loaded, so this is expected)"),
                            Some("nothing to do without a GPU; with one, load its driver (see the kernel driver check)"),
                        )
                    })
                }
            }
        })
        .collect()
}

fn kernel_driver(system: &SystemView) -> Vec<Check> {
    let mut checks = Vec::new();
    let kernel = system
        .read("/proc/sys/kernel/osrelease")
        .map(|k| k.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    if system.path("/sys/module/amdgpu").is_dir() {
        let detail = match system.read("/sys/module/amdgpu/version") {
            Some(v) if !v.trim().is_empty() => {
                format!("amdgpu {} (DKMS), kernel {kernel}", v.trim())
            }
            _ => format!("amdgpu in the kernel {kernel}"),
        };
        checks.push(Check::new("amdgpu driver", Status::Ok, detail, None));
    }
    if let Some(text) = system.read("/proc/driver/nvidia/version") {
        let first = text.lines().next().unwrap_or("").trim().to_string();
        checks.push(Check::new("nvidia driver", Status::Ok, first, None));
    }
    if checks.is_empty() {
        checks.push(Check::new(
            "gpu kernel driver",
            Status::Warn,
            format!("neither amdgpu nor the NVIDIA driver is loaded (kernel {kernel})"),
            Some("load the GPU's driver (`modprobe amdgpu`, or install the NVIDIA driver); in a container, pass the devices through (--device /dev/kfd --device /dev/dri, or --gpus all)"),
        ));
    }
    checks
}

/// Group names by id, and members by group name, from `/etc/group`.
fn groups(system: &SystemView) -> Vec<(String, u32, Vec<String>)> {
    system
        .read("/etc/group")
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut f = line.split(':');
            let name = f.next()?.to_string();
            let _ = f.next();
            let gid = f.next()?.parse().ok()?;
            let members = f
                .next()
                .unwrap_or("")
                .split(',')
                .filter(|m| !m.is_empty())
                .map(str::to_string)
                .collect();
            Some((name, gid, members))
        })
        .collect()
}

/// Whether the user may read and write `path`, judged from its mode and group as the kernel
/// would (root may always).
#[cfg(unix)]
fn accessible(system: &SystemView, path: &Path) -> Result<bool, String> {
    use std::os::unix::fs::MetadataExt;
    let meta = fs::metadata(path).map_err(|e| e.to_string())?;
    if system.uid == 0 {
        return Ok(true);
    }
    let mode = meta.mode();
    let rw = |shift: u32| (mode >> shift) & 0o6 == 0o6;
    Ok(
        (meta.uid() == system.uid && rw(6))
            || (system.gids.contains(&meta.gid()) && rw(3))
            || rw(0),
    )
}

#[cfg(not(unix))]
fn accessible(_system: &SystemView, path: &Path) -> Result<bool, String> {
    fs::metadata(path).map(|_| true).map_err(|e| e.to_string())
}

fn device_nodes(system: &SystemView) -> Vec<Check> {
    let amd = system.path("/sys/module/amdgpu").is_dir() || system.path("/dev/kfd").exists();
    if !amd {
        return Vec::new();
    }
    let mut checks = Vec::new();
    let groups = groups(system);
    let member_of = |name: &str| {
        groups.iter().any(|(g, gid, members)| {
            g == name && (system.gids.contains(gid) || members.iter().any(|m| m == &system.user))
        })
    };
    let group_fix = format!(
        "add the user to the render and video groups (`sudo usermod -aG render,video {}`), then log in again; in a container add `--group-add render --group-add video`",
        if system.user.is_empty() { "$USER" } else { system.user.as_str() }
    );
    let kfd = system.path("/dev/kfd");
    checks.push(match accessible(system, &kfd) {
        Ok(true) => Check::new("/dev/kfd", Status::Ok, "present, readable and writable", None),
        Ok(false) => Check::new(
            "/dev/kfd",
            Status::Fail,
            "present but not readable and writable by this user",
            Some(&group_fix),
        ),
        Err(e) => Check::new(
            "/dev/kfd",
            Status::Fail,
            format!("missing ({e})"),
            Some("the ROCm compute interface is absent: load amdgpu, or pass --device /dev/kfd to the container"),
        ),
    });
    let mut renders: Vec<PathBuf> = fs::read_dir(system.path("/dev/dri"))
        .map(|d| {
            d.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("renderD"))
                })
                .collect()
        })
        .unwrap_or_default();
    renders.sort();
    let name_of = |p: &Path| {
        format!(
            "/dev/dri/{}",
            p.file_name().unwrap_or_default().to_string_lossy()
        )
    };
    if renders.is_empty() {
        checks.push(Check::new(
            "/dev/dri/render*",
            Status::Fail,
            "no render nodes",
            Some("load amdgpu, or pass --device /dev/dri to the container"),
        ));
    } else {
        let blocked: Vec<String> = renders
            .iter()
            .filter(|p| !matches!(accessible(system, p), Ok(true)))
            .map(|p| name_of(p))
            .collect();
        let all: Vec<String> = renders.iter().map(|p| name_of(p)).collect();
        checks.push(if blocked.is_empty() {
            Check::new("/dev/dri/render*", Status::Ok, all.join(", "), None)
        } else {
            Check::new(
                "/dev/dri/render*",
                Status::Fail,
                format!(
                    "not readable and writable by this user: {}",
                    blocked.join(", ")
                ),
                Some(&group_fix),
            )
        });
    }
    let missing: Vec<&str> = ["render", "video"]
        .into_iter()
        .filter(|g| groups.iter().any(|(name, _, _)| name == g) && !member_of(g))
        .collect();
    checks.push(if system.uid == 0 || missing.is_empty() {
        Check::new(
            "groups",
            Status::Ok,
            if system.uid == 0 {
                "root".to_string()
            } else {
                "member of render and video".to_string()
            },
            None,
        )
    } else {
        Check::new(
            "groups",
            Status::Warn,
            format!("not a member of {}", missing.join(" and ")),
            Some(&group_fix),
        )
    });
    checks
}

/// Environment variables that change which GPUs the runtimes show, or what they claim to be.
const OVERRIDES: [(&str, &str); 8] = [
    ("HSA_OVERRIDE_GFX_VERSION", "makes the runtime report another architecture: kernels built for that one then run on this GPU, which works only between close relatives and can fault otherwise"),
    ("HIP_VISIBLE_DEVICES", "hides the HIP devices it does not list"),
    ("ROCR_VISIBLE_DEVICES", "hides the ROCm devices it does not list"),
    ("GPU_DEVICE_ORDINAL", "hides the ROCm devices it does not list"),
    ("CUDA_VISIBLE_DEVICES", "hides the CUDA devices it does not list"),
    ("HSA_ENABLE_SDMA", "changes how the runtime copies memory"),
    ("HSA_XNACK", "changes page-fault handling on the GPU"),
    ("HIP_PLATFORM", "chooses the HIP platform"),
];

fn environment(system: &SystemView) -> Vec<Check> {
    let mut checks = Vec::new();
    for (key, effect) in OVERRIDES {
        let Some(value) = system.var(key) else {
            continue;
        };
        let hides_all = key.ends_with("VISIBLE_DEVICES") || key == "GPU_DEVICE_ORDINAL";
        let (status, fix) = if hides_all && (value.trim().is_empty() || value.trim() == "-1") {
            (
                Status::Fail,
                format!("{key}={value:?} hides every GPU: unset it or list the devices to use"),
            )
        } else {
            (
                Status::Warn,
                format!("unset {key} unless it is meant (`unset {key}`)"),
            )
        };
        checks.push(Check::new(
            key,
            status,
            format!("{key}={value}: {effect}"),
            Some(&fix),
        ));
    }
    if checks.is_empty() {
        checks.push(Check::new(
            "environment",
            Status::Ok,
            "no GPU overrides set (HSA_OVERRIDE_GFX_VERSION, *_VISIBLE_DEVICES, ...)",
            None,
        ));
    }
    checks
}

/// `gfx_target_version 110001` of a KFD topology node as `gfx1101`: major, minor and stepping
/// (the stepping in hex, as in gfx90a).
pub fn gfx_name(target_version: u32) -> Option<String> {
    if target_version == 0 {
        return None;
    }
    let major = target_version / 10000;
    let minor = (target_version / 100) % 100;
    let stepping = target_version % 100;
    (minor < 16 && stepping < 16).then(|| format!("gfx{major}{minor:x}{stepping:x}"))
}

/// The AMD GPUs the KFD topology lists (the CPU nodes have no target version).
fn kfd_gpus(system: &SystemView) -> Vec<(String, String)> {
    let nodes = system.path("/sys/class/kfd/kfd/topology/nodes");
    let Ok(entries) = fs::read_dir(&nodes) else {
        return Vec::new();
    };
    let mut found: Vec<(String, String)> = entries
        .flatten()
        .filter_map(|node| {
            let text =
                crate::limits::read_text_file(&node.path().join("properties"), 1 << 16).ok()?;
            let version = text.lines().find_map(|l| {
                l.strip_prefix("gfx_target_version ")?
                    .trim()
                    .parse::<u32>()
                    .ok()
            })?;
            Some((
                node.file_name().to_string_lossy().into_owned(),
                gfx_name(version)?,
            ))
        })
        .collect();
    found.sort();
    found
}

fn gpu_architectures(system: &SystemView) -> Vec<Check> {
    let gpus = kfd_gpus(system);
    if gpus.is_empty() {
        return Vec::new();
    }
    let have = ember_gpu::kernels::available_archs(&system.kernels_dir);
    let override_arch = system.var("HSA_OVERRIDE_GFX_VERSION").and_then(|v| {
        let parts: Vec<u32> = v.split('.').filter_map(|p| p.parse().ok()).collect();
        (parts.len() == 3).then(|| gfx_name(parts[0] * 10000 + parts[1] * 100 + parts[2]))?
    });
    gpus.into_iter()
        .map(|(node, arch)| {
            let effective = override_arch.clone().unwrap_or_else(|| arch.clone());
            let name = format!("gpu (kfd node {node})");
            if have.contains(&effective) {
                Check::new(&name, Status::Ok, format!("{arch}: kernels in this build"), None)
            } else {
                Check::new(
                    &name,
                    Status::Fail,
                    format!(
                        "{arch}{}: this build has kernels for {}",
                        if effective != arch { format!(" (reported as {effective})") } else { String::new() },
                        if have.is_empty() { "no GPU".to_string() } else { have.join(", ") }
                    ),
                    Some(&format!(
                        "use the release built for {arch}: the archive ember-{v}-linux-{arch}-x64.tar.gz or the image ember:{v}-{arch}; or build it with `cargo xtask build --target {arch}`",
                        v = env!("CARGO_PKG_VERSION")
                    )),
                )
            }
        })
        .collect()
}

/// The report as text: one line per check, the fix indented below warns and fails.
pub fn render(checks: &[Check]) -> String {
    let mut out = String::new();
    for c in checks {
        out.push_str(&format!(
            "{:<5} {:<22} {}\n",
            c.status.label(),
            c.name,
            c.detail
        ));
        if let Some(fix) = &c.fix {
            if c.status != Status::Ok {
                out.push_str(&format!("      fix: {fix}\n"));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn target_versions_name_architectures() {
        assert_eq!(gfx_name(110001).as_deref(), Some("gfx1101"));
        assert_eq!(gfx_name(120001).as_deref(), Some("gfx1201"));
        assert_eq!(gfx_name(90010).as_deref(), Some("gfx90a"));
        assert_eq!(gfx_name(90402).as_deref(), Some("gfx942"));
        assert_eq!(gfx_name(0), None);
    }
}
