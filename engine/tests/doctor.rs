//! `ember doctor` against fake system trees built here: every branch of every check, and the
//! command's exit status.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use ember::doctor::{
    self, Check, GpuView, ModelNeeds, RuntimeOutcome, RuntimeView, Status, SystemView, VmmProbe,
};

/// A fake root with helpers to lay files into it.
struct Tree {
    dir: tempfile::TempDir,
}

impl Tree {
    fn new() -> Tree {
        Tree {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn root(&self) -> &Path {
        self.dir.path()
    }

    fn file(&self, path: &str, text: &str) -> &Tree {
        let p = self.root().join(path.trim_start_matches('/'));
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(&p, text).unwrap();
        self
    }

    #[cfg(unix)]
    fn node(&self, path: &str, mode: u32) -> &Tree {
        use std::os::unix::fs::PermissionsExt;
        self.file(path, "");
        let p = self.root().join(path.trim_start_matches('/'));
        fs::set_permissions(&p, fs::Permissions::from_mode(mode)).unwrap();
        self
    }

    fn dir(&self, path: &str) -> &Tree {
        fs::create_dir_all(self.root().join(path.trim_start_matches('/'))).unwrap();
        self
    }

    /// A user `alice` (uid 1000) whose groups are `gids`.
    fn view(&self, env: &[(&str, &str)], gids: &[u32]) -> SystemView {
        SystemView {
            root: self.root().to_owned(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<BTreeMap<_, _>>(),
            uid: 1000,
            user: "alice".into(),
            gids: gids.to_vec(),
            kernels_dir: self.root().join("kernels"),
            gpus: Vec::new(),
            runtimes: Vec::new(),
        }
    }
}

/// The check called `name`, asserted to have `status` and a detail (or fix) containing `text`.
fn expect(checks: &[Check], name: &str, status: Status, text: &str) {
    let Some(c) = checks.iter().find(|c| c.name == name) else {
        panic!("no check {name:?} in\n{}", doctor::render(checks));
    };
    assert_eq!(c.status, status, "{name}:\n{}", doctor::render(checks));
    let all = format!("{} {}", c.detail, c.fix.as_deref().unwrap_or(""));
    assert!(all.contains(text), "{name}: expected {text:?} in {all:?}");
}

/// A healthy AMD machine: one ROCm install, amdgpu loaded, device nodes that the user's groups
/// may open (the test's files belong to group 0, which plays `render` here), a gfx1100 GPU and
/// kernels for it.
fn amd_machine() -> Tree {
    let t = Tree::new();
    t.file("/opt/rocm-6.4.0/lib/libamdhip64.so.6.4.43482", "")
        .file("/opt/rocm-6.4.0/.info/version", "6.4.0-47\n")
        .dir("/sys/module/amdgpu")
        .file("/proc/sys/kernel/osrelease", "6.8.0-45-generic\n")
        .file(
            "/etc/group",
            "root:x:0:\nrender:x:0:alice\nvideo:x:44:alice\n",
        )
        .file(
            "/sys/class/kfd/kfd/topology/nodes/0/properties",
            "cpu_cores_count 16\ngfx_target_version 0\n",
        )
        .file(
            "/sys/class/kfd/kfd/topology/nodes/1/properties",
            "simd_count 96\ngfx_target_version 110000\n",
        )
        .dir("/kernels/gfx1100");
    #[cfg(unix)]
    {
        t.node("/dev/kfd", 0o660).node("/dev/dri/renderD128", 0o660);
        std::os::unix::fs::symlink("rocm-6.4.0", t.root().join("opt/rocm")).unwrap();
    }
    t
}

#[test]
fn an_empty_system_warns_that_ember_runs_on_the_cpu() {
    let t = Tree::new();
    let checks = doctor::run(&t.view(&[], &[1000]));
    expect(&checks, "hip runtime", Status::Warn, "no libamdhip64 found");
    expect(
        &checks,
        "cuda driver library",
        Status::Warn,
        "no libcuda.so found",
    );
    expect(
        &checks,
        "gpu kernel driver",
        Status::Warn,
        "neither amdgpu nor the NVIDIA driver",
    );
    expect(&checks, "environment", Status::Ok, "no GPU overrides");
    assert!(!checks.iter().any(|c| c.name.starts_with("/dev")));
    assert!(!doctor::blocks_gpu(&checks));
}

#[cfg(unix)]
#[test]
fn a_healthy_amd_machine_is_all_ok() {
    let t = amd_machine();
    let checks = doctor::run(&t.view(&[], &[1000, 0]));
    // /opt/rocm links to /opt/rocm-6.4.0: one install, not two.
    expect(
        &checks,
        "hip runtime",
        Status::Ok,
        "/opt/rocm (ROCm 6.4.0-47)",
    );
    expect(
        &checks,
        "amdgpu driver",
        Status::Ok,
        "amdgpu in the kernel 6.8.0-45-generic",
    );
    expect(&checks, "/dev/kfd", Status::Ok, "readable and writable");
    expect(
        &checks,
        "/dev/dri/render*",
        Status::Ok,
        "/dev/dri/renderD128",
    );
    expect(&checks, "groups", Status::Ok, "member of render and video");
    expect(
        &checks,
        "gpu (kfd node 1)",
        Status::Ok,
        "gfx1100: kernels in this build",
    );
    assert!(!doctor::blocks_gpu(&checks), "{}", doctor::render(&checks));
}

#[cfg(unix)]
#[test]
fn several_rocm_installs_and_a_dkms_driver() {
    let t = amd_machine();
    t.file("/opt/rocm-7.0.1/lib/libamdhip64.so.7.0.1", "")
        .file("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5", "")
        .file("/sys/module/amdgpu/version", "6.12.12\n");
    let checks = doctor::run(&t.view(&[("ROCM_PATH", "/opt/rocm-7.0.1")], &[1000, 0]));
    expect(
        &checks,
        "hip runtime",
        Status::Warn,
        "3 ROCm installs side by side",
    );
    expect(
        &checks,
        "hip runtime",
        Status::Warn,
        "/opt/rocm-7.0.1 (ROCm 7.0.1)",
    );
    expect(
        &checks,
        "hip runtime",
        Status::Warn,
        "ember loads from /opt/rocm-7.0.1 first",
    );
    expect(
        &checks,
        "amdgpu driver",
        Status::Ok,
        "amdgpu 6.12.12 (DKMS)",
    );

    // One install too old for ember.
    let old = Tree::new();
    old.file("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5.2.21153", "");
    let checks = doctor::run(&old.view(&[], &[1000]));
    expect(
        &checks,
        "hip runtime",
        Status::Warn,
        "ember needs ROCm 6 or 7",
    );
    expect(&checks, "hip runtime", Status::Warn, "ROCm 5.2.21153");
}

#[cfg(unix)]
#[test]
fn device_nodes_the_user_cannot_open_block_the_gpu() {
    let t = amd_machine();
    t.file("/etc/group", "render:x:0:\nvideo:x:44:\n");
    let checks = doctor::run(&t.view(&[], &[1000]));
    expect(
        &checks,
        "/dev/kfd",
        Status::Fail,
        "usermod -aG render,video alice",
    );
    expect(
        &checks,
        "/dev/dri/render*",
        Status::Fail,
        "not readable and writable by this user: /dev/dri/renderD128",
    );
    expect(
        &checks,
        "groups",
        Status::Warn,
        "not a member of render and video",
    );
    assert!(doctor::blocks_gpu(&checks));

    // World-writable nodes open for anyone, groups or not.
    t.node("/dev/kfd", 0o666).node("/dev/dri/renderD128", 0o666);
    let checks = doctor::run(&t.view(&[], &[1000]));
    expect(&checks, "/dev/kfd", Status::Ok, "readable and writable");
    expect(&checks, "/dev/dri/render*", Status::Ok, "renderD128");

    fs::remove_file(t.root().join("dev/kfd")).unwrap();
    fs::remove_file(t.root().join("dev/dri/renderD128")).unwrap();
    let checks = doctor::run(&t.view(&[], &[1000]));
    expect(&checks, "/dev/kfd", Status::Fail, "missing");
    expect(&checks, "/dev/dri/render*", Status::Fail, "no render nodes");
}

#[cfg(unix)]
#[test]
fn overrides_in_the_environment_are_named() {
    let t = amd_machine();
    let checks = doctor::run(&t.view(
        &[
            ("HSA_OVERRIDE_GFX_VERSION", "11.0.0"),
            ("HIP_VISIBLE_DEVICES", ""),
            ("CUDA_VISIBLE_DEVICES", "-1"),
            ("ROCR_VISIBLE_DEVICES", "0"),
        ],
        &[1000, 0],
    ));
    expect(
        &checks,
        "HSA_OVERRIDE_GFX_VERSION",
        Status::Warn,
        "report another architecture",
    );
    expect(
        &checks,
        "HIP_VISIBLE_DEVICES",
        Status::Fail,
        "hides every GPU",
    );
    expect(
        &checks,
        "CUDA_VISIBLE_DEVICES",
        Status::Fail,
        "hides every GPU",
    );
    expect(
        &checks,
        "ROCR_VISIBLE_DEVICES",
        Status::Warn,
        "unset ROCR_VISIBLE_DEVICES",
    );
    assert!(!checks.iter().any(|c| c.name == "environment"));
}

#[cfg(unix)]
#[test]
fn a_gpu_without_kernels_names_the_build_that_serves_it() {
    let t = amd_machine();
    t.file(
        "/sys/class/kfd/kfd/topology/nodes/1/properties",
        "gfx_target_version 120001\n",
    );
    let checks = doctor::run(&t.view(&[], &[1000, 0]));
    let archive = format!(
        "ember-{}-linux-gfx1201-x64.tar.gz",
        env!("CARGO_PKG_VERSION")
    );
    expect(&checks, "gpu (kfd node 1)", Status::Fail, &archive);
    expect(
        &checks,
        "gpu (kfd node 1)",
        Status::Fail,
        "this build has kernels for gfx1100",
    );
    assert!(doctor::blocks_gpu(&checks));
    // An override that makes it report gfx1100 lets this build's kernels run (with a warning
    // about the override itself).
    let checks = doctor::run(&t.view(&[("HSA_OVERRIDE_GFX_VERSION", "11.0.0")], &[1000, 0]));
    expect(&checks, "gpu (kfd node 1)", Status::Ok, "gfx1201");
    expect(&checks, "HSA_OVERRIDE_GFX_VERSION", Status::Warn, "11.0.0");
}

#[test]
fn an_nvidia_machine_shows_its_driver() {
    let t = Tree::new();
    t.file(
        "/proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14  Thu Feb 22 01:44:30 UTC 2024\nGCC version: gcc 12\n",
    )
    .file("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14", "")
    .file("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "");
    let checks = doctor::run(&t.view(&[], &[1000]));
    expect(
        &checks,
        "nvidia driver",
        Status::Ok,
        "Kernel Module  550.54.14",
    );
    expect(
        &checks,
        "cuda driver library",
        Status::Ok,
        "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.14",
    );
    assert!(!checks.iter().any(|c| c.name == "gpu kernel driver"));
}

#[cfg(unix)]
#[test]
fn the_command_exits_non_zero_when_the_gpu_is_blocked() {
    let run = |root: &PathBuf| {
        Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(["doctor", "--root"])
            .arg(root)
            .arg("--kernels-dir")
            .arg(root.join("kernels"))
            .env_remove("HSA_OVERRIDE_GFX_VERSION")
            .env_remove("HIP_VISIBLE_DEVICES")
            .env_remove("ROCR_VISIBLE_DEVICES")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("GPU_DEVICE_ORDINAL")
            .env_remove("ROCM_PATH")
            .output()
            .unwrap()
    };
    let empty = Tree::new();
    let out = run(&empty.root().to_owned());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("warn  hip runtime"), "{stdout}");
    assert!(stdout.contains("      fix: "), "{stdout}");

    let t = amd_machine();
    t.file(
        "/sys/class/kfd/kfd/topology/nodes/1/properties",
        "gfx_target_version 90010\n",
    );
    let out = run(&t.root().to_owned());
    let stdout = String::from_utf8(out.stdout).unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("fail  gpu (kfd node 1)"), "{stdout}");
    assert!(stdout.contains("gfx90a"), "{stdout}");
    assert!(stderr.contains("blocks GPU use"), "{stderr}");
}

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn gpu(id: &str, total: u64, free: Option<u64>, vmm: VmmProbe) -> GpuView {
    GpuView {
        id: id.to_string(),
        name: "Radeon RX 7900 XTX".to_string(),
        arch: "gfx1100".to_string(),
        total_bytes: total,
        free_bytes: free,
        vmm,
        kernels: true,
    }
}

#[test]
fn free_vram_and_the_vmm_probe_of_each_gpu() {
    let t = amd_machine();
    let mut view = t.view(&[], &[1000, 0]);
    view.gpus = vec![
        gpu("hip:0", 24 * GIB, Some(23 * GIB), VmmProbe::Passed),
        gpu(
            "hip:1",
            24 * GIB,
            Some(GIB),
            VmmProbe::Failed("hipMemSetAccess failed with 1".into()),
        ),
        gpu(
            "hip:2",
            16 * GIB,
            None,
            VmmProbe::NotRun("the build manifest gates VMM off for this target".into()),
        ),
    ];
    let checks = doctor::run(&view);
    expect(
        &checks,
        "hip:0 memory",
        Status::Ok,
        "23.0 GiB free of 24.0 GiB",
    );
    expect(&checks, "hip:0 vmm probe", Status::Ok, "passed");
    expect(
        &checks,
        "hip:1 memory",
        Status::Warn,
        "only 1.0 GiB free of 24.0 GiB",
    );
    expect(
        &checks,
        "hip:1 memory",
        Status::Warn,
        "another process holds",
    );
    expect(
        &checks,
        "hip:1 vmm probe",
        Status::Warn,
        "hipMemSetAccess failed",
    );
    expect(
        &checks,
        "hip:1 vmm probe",
        Status::Warn,
        "caching pool instead",
    );
    expect(&checks, "hip:2 memory", Status::Warn, "free memory unknown");
    expect(
        &checks,
        "hip:2 vmm probe",
        Status::Ok,
        "not run: the build manifest gates VMM off",
    );
    // Neither a busy GPU nor a failed probe blocks the GPU.
    assert!(!doctor::blocks_gpu(&checks), "{}", doctor::render(&checks));
}

/// A model of `n_layer` layers of 100 MiB weights and 10 MiB KV each, 50 MiB outside the
/// layers and 20 MiB of scratch.
fn model(n_layer: usize) -> ModelNeeds {
    ModelNeeds {
        name: "test.gguf".into(),
        layer_bytes: vec![100 * MIB; n_layer],
        other_bytes: 50 * MIB,
        kv_layer_bytes: vec![10 * MIB; n_layer],
        n_ctx: 4096,
        scratch_bytes: 20 * MIB,
    }
}

#[test]
fn a_model_that_fits_goes_to_the_gpu() {
    let t = amd_machine();
    let mut view = t.view(&[], &[1000, 0]);
    view.gpus = vec![gpu("hip:0", 24 * GIB, Some(20 * GIB), VmmProbe::Passed)];
    let checks = doctor::run_with_model(&view, &model(32));
    expect(
        &checks,
        "model fit",
        Status::Ok,
        "fits, all 32 layers on the GPU",
    );
    expect(
        &checks,
        "model fit",
        Status::Ok,
        "layers 0..31 on hip:0 (3.4 GiB)",
    );
    assert!(!doctor::blocks_gpu(&checks));
}

#[test]
fn a_model_too_large_for_vram_spreads_over_gpus_and_the_cpu() {
    let t = amd_machine();
    t.file(
        "/proc/meminfo",
        "MemTotal: 67108864 kB\nMemAvailable: 33554432 kB\n",
    );
    let mut view = t.view(&[], &[1000, 0]);
    // Room after the 256 MiB reserve: hip:0 1 GiB less the 70 MiB outside the layers and the
    // scratch (954 MiB), 8 layers of 110 MiB; hip:1 (no kernels) is passed over; hip:2 1 GiB,
    // 9 layers more. The GPUs take the last 17 layers, the CPU the first 15 (1650 MiB).
    let mut no_kernels = gpu("hip:1", 8 * GIB, Some(8 * GIB), VmmProbe::Passed);
    no_kernels.kernels = false;
    view.gpus = vec![
        gpu("hip:0", 4 * GIB, Some(GIB + 256 * MIB), VmmProbe::Passed),
        no_kernels,
        gpu("hip:2", 4 * GIB, Some(GIB + 256 * MIB), VmmProbe::Passed),
    ];
    let checks = doctor::run_with_model(&view, &model(32));
    expect(
        &checks,
        "model fit",
        Status::Warn,
        "does not fit in VRAM at context 4096",
    );
    expect(
        &checks,
        "model fit",
        Status::Warn,
        "layers 15..22 on hip:0 (880.0 MiB)",
    );
    expect(
        &checks,
        "model fit",
        Status::Warn,
        "layers 23..31 on hip:2 (990.0 MiB)",
    );
    expect(
        &checks,
        "model fit",
        Status::Warn,
        "layers 0..14 on the CPU (1.6 GiB needed on the CPU, 32.0 GiB available)",
    );
    expect(&checks, "model fit", Status::Warn, "-ngl 17 puts");
    let c = checks.iter().find(|c| c.name == "model fit").unwrap();
    assert!(!c.detail.contains("hip:1"), "{}", c.detail);
    assert!(!doctor::blocks_gpu(&checks));

    // A GPU with no room for one layer: everything on the CPU, and the fix says why.
    view.gpus = vec![gpu("hip:0", 4 * GIB, Some(300 * MIB), VmmProbe::Passed)];
    let checks = doctor::run_with_model(&view, &model(32));
    expect(
        &checks,
        "model fit",
        Status::Warn,
        "layers 0..31 on the CPU",
    );
    expect(&checks, "model fit", Status::Warn, "not one layer fits");
}

#[test]
fn without_a_gpu_the_model_is_checked_against_system_memory() {
    let t = Tree::new();
    t.file("/proc/meminfo", "MemAvailable: 33554432 kB\n");
    let checks = doctor::run_with_model(&t.view(&[], &[1000]), &model(32));
    expect(&checks, "model fit", Status::Warn, "no usable GPU, so all 32 layers would run on the CPU (3.5 GiB needed on the CPU, 32.0 GiB available");
    assert!(!doctor::blocks_gpu(&checks));

    let small = Tree::new();
    small.file("/proc/meminfo", "MemAvailable: 1048576 kB\n");
    let checks = doctor::run_with_model(&small.view(&[], &[1000]), &model(32));
    expect(
        &checks,
        "model fit",
        Status::Fail,
        "3.5 GiB needed on the CPU, 1.0 GiB available",
    );
    expect(&checks, "model fit", Status::Fail, "does not fit in memory");
    assert!(doctor::blocks_gpu(&checks));
}

#[cfg(unix)]
#[test]
fn the_command_checks_a_model() {
    let model = common_model_path();
    let run = |root: &Path| {
        Command::new(env!("CARGO_BIN_EXE_ember"))
            .args(["doctor", "--root"])
            .arg(root)
            .arg("--kernels-dir")
            .arg(root.join("kernels"))
            .arg("-m")
            .arg(&model)
            .env_remove("HSA_OVERRIDE_GFX_VERSION")
            .env_remove("HIP_VISIBLE_DEVICES")
            .env_remove("ROCR_VISIBLE_DEVICES")
            .env_remove("CUDA_VISIBLE_DEVICES")
            .env_remove("GPU_DEVICE_ORDINAL")
            .env_remove("ROCM_PATH")
            .output()
            .unwrap()
    };
    let roomy = Tree::new();
    roomy.file("/proc/meminfo", "MemAvailable: 33554432 kB\n");
    let out = run(roomy.root());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stdout}");
    assert!(stdout.contains("warn  model fit"), "{stdout}");
    assert!(
        stdout.contains("all 30 layers would run on the CPU"),
        "{stdout}"
    );

    let tight = Tree::new();
    tight.file("/proc/meminfo", "MemAvailable: 1024 kB\n");
    let out = run(tight.root());
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("fail  model fit"), "{stdout}");
}

/// The pinned SmolLM2 file (30 layers), by the cache lookup `ember pull` uses.
fn common_model_path() -> PathBuf {
    let entry = ember::models::find("smollm2-135m-instruct-q4_1").unwrap();
    let path = ember::models::cached_path(entry).unwrap();
    assert!(
        path.is_file(),
        "run `ember pull smollm2-135m-instruct-q4_1` first"
    );
    path
}

fn runtime(backend: &str, outcome: RuntimeOutcome) -> RuntimeView {
    RuntimeView {
        backend: backend.to_string(),
        outcome,
    }
}

#[test]
fn a_runtime_that_loads_but_does_not_initialise() {
    let init_failed =
        || RuntimeOutcome::InitFailed("hipInit failed with 101 (hipErrorInvalidDevice)".into());
    // No GPU driver: expected, a warning.
    let t = Tree::new();
    let mut view = t.view(&[], &[1000]);
    view.runtimes = vec![
        runtime("hip", init_failed()),
        runtime("cuda", RuntimeOutcome::NotFound),
    ];
    let checks = doctor::run(&view);
    expect(
        &checks,
        "hip load",
        Status::Warn,
        "the library loaded, but hipInit failed with 101",
    );
    expect(&checks, "hip load", Status::Warn, "no GPU driver is loaded");
    // A runtime not found is told by the library checks, not twice.
    assert!(!checks.iter().any(|c| c.name == "cuda load"));
    assert!(!doctor::blocks_gpu(&checks));

    // With /dev/kfd there, the same failure blocks the GPU.
    let t = amd_machine();
    let mut view = t.view(&[], &[1000, 0]);
    view.runtimes = vec![runtime("hip", init_failed())];
    let checks = doctor::run(&view);
    expect(&checks, "hip load", Status::Fail, "hipInit failed");
    expect(
        &checks,
        "hip load",
        Status::Fail,
        "does not match the kernel driver",
    );
    assert!(doctor::blocks_gpu(&checks));

    // Loaded: shown with what the listing says of it.
    view.runtimes = vec![runtime(
        "hip",
        RuntimeOutcome::Loaded(
            "hip: loaded /opt/rocm-6.4.0/lib/libamdhip64.so.6, runtime version 60443482".into(),
        ),
    )];
    let checks = doctor::run(&view);
    expect(&checks, "hip load", Status::Ok, "runtime version 60443482");
    assert!(!doctor::blocks_gpu(&checks));

    // The NVIDIA driver present and cuInit failing blocks the GPU too.
    let t = Tree::new();
    t.file(
        "/proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.14\n",
    );
    let mut view = t.view(&[], &[1000]);
    view.runtimes = vec![runtime(
        "cuda",
        RuntimeOutcome::InitFailed("cuInit failed with 999 (CUDA_ERROR_UNKNOWN)".into()),
    )];
    let checks = doctor::run(&view);
    expect(&checks, "cuda load", Status::Fail, "cuInit failed");
}
