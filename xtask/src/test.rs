//! `cargo xtask test`: the project's one "run all tests" entry point.
//!
//! In order, each under its own header: fetch the pinned models, `cargo test --workspace
//! --release`, the server tests through the official `openai` Python client (`pytest
//! tests/server`, in a venv under `target/` built from the pinned `tests/server/requirements.txt`;
//! xtask's own tests run in the workspace test, not again in a debug build), then the toolchain
//! checks: kernels for every target, a wrong target name failing, the gfx1201 and gfx1151
//! artifacts and their manifests and `ember info`, the Windows artifact under wine, the release
//! matrix and its drift detection, actionlint, no build path in the artifacts, `xtask verify` on
//! them, the container image (built twice: its file layers must have the same digests) with its
//! smoke test, with `--repro`, reproducibility (`xtask repro`: cpu and gfx1201
//! again from another folder with a clean CARGO_TARGET_DIR, archives and images' file layers, then
//! a flipped source byte), the
//! gfx1201 build with the host kernel toolchain hidden (it builds in the container and must equal
//! the host build) and `xtask release --dry-run` for cpu and gfx1201. Every step runs even after an earlier one failed (a
//! later failure is often the more telling one); the summary lists them all and the command fails
//! if any did. A missing system tool is a failure that names the setup script to run.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, ensure, Context, Result};
use xshell::{cmd, Shell};

use crate::build;
use crate::kernels::{self, KernelOutcome, Toolchains};
use crate::manifest::{self, BuildManifest, FeatureRecord, PackageManifest};
use crate::matrix;
use crate::package;
use crate::targets::{Kind, Os, Selection, Targets};
use crate::toolchain;

struct Outcome {
    name: String,
    result: Result<(), String>,
    seconds: f64,
}

struct Steps {
    total: usize,
    outcomes: Vec<Outcome>,
}

impl Steps {
    fn run(&mut self, name: &str, step: impl FnOnce() -> Result<()>) {
        let index = self.outcomes.len() + 1;
        println!("\n==> [{index}/{}] {name}{}", self.total, free_disk_note());
        let started = Instant::now();
        let result = step().map_err(|error| format!("{error:#}"));
        let seconds = started.elapsed().as_secs_f64();
        let disk = free_disk_note();
        match &result {
            Ok(()) => println!("<== {name}: ok ({seconds:.1} s){disk}"),
            Err(error) => println!("<== {name}: FAILED ({seconds:.1} s){disk}\n{error}"),
        }
        self.outcomes.push(Outcome {
            name: name.to_string(),
            result,
            seconds,
        });
    }

    fn finish(self) -> Result<()> {
        println!("\n==> summary");
        for outcome in &self.outcomes {
            let status = if outcome.result.is_ok() {
                "ok    "
            } else {
                "FAILED"
            };
            println!("  {status} {:>7.1} s  {}", outcome.seconds, outcome.name);
        }
        let failed: Vec<&Outcome> = self.outcomes.iter().filter(|o| o.result.is_err()).collect();
        println!(
            "{} passed, {} failed",
            self.outcomes.len() - failed.len(),
            failed.len()
        );
        if !failed.is_empty() {
            let mut message = String::from("cargo xtask test failed:");
            for outcome in failed {
                let first_line = outcome
                    .result
                    .as_ref()
                    .err()
                    .and_then(|e| e.lines().next())
                    .unwrap_or("");
                message.push_str(&format!("\n  {}: {first_line}", outcome.name));
            }
            bail!(message);
        }
        Ok(())
    }
}

/// ", N GiB free on the target directory's disk" for a step's header and footer, or nothing when
/// `df` cannot tell. A run that fills the disk then shows which step took the space.
fn free_disk_note() -> String {
    free_disk_bytes(&crate::target_dir())
        .map(|bytes| format!(", {:.1} GiB free", bytes as f64 / (1u64 << 30) as f64))
        .unwrap_or_default()
}

/// Free bytes on the file system holding `path`, from `df -Pk` (POSIX output: the fourth
/// column of the second line is the space available, in KiB).
fn free_disk_bytes(path: &Path) -> Option<u64> {
    let output = std::process::Command::new("df")
        .arg("-Pk")
        .arg(path)
        .output()
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let text = String::from_utf8(output.stdout).ok()?;
    let kib: u64 = text
        .lines()
        .nth(1)?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Deletes the test executables that `cargo test --release` linked into `deps` (the
/// `<crate>-<hash>` files with no extension, executable, with one link: the binaries cargo also
/// places under `target/release` have two), returning how many bytes that freed. Nothing later
/// in the run executes them, and together they are gigabytes that the artifact and image steps
/// need on a small CI disk; a later `cargo test` links them again.
#[cfg(unix)]
fn remove_test_executables(deps: &Path) -> Result<u64> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let mut freed = 0;
    let entries = match std::fs::read_dir(deps) {
        Ok(entries) => entries,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(error) => return Err(error).with_context(|| format!("reading {}", deps.display())),
    };
    for entry in entries {
        let entry = entry.with_context(|| format!("reading {}", deps.display()))?;
        let path = entry.path();
        let meta = entry.metadata()?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let test_like = meta.is_file()
            && path.extension().is_none()
            && name.contains('-')
            && meta.permissions().mode() & 0o111 != 0
            && meta.nlink() == 1;
        if test_like {
            std::fs::remove_file(&path)
                .with_context(|| format!("removing the test executable {}", path.display()))?;
            freed += meta.len();
        }
    }
    Ok(freed)
}

/// Elsewhere the executables keep their extension and their link counts are not at hand: keep
/// them.
#[cfg(not(unix))]
fn remove_test_executables(_deps: &Path) -> Result<u64> {
    Ok(0)
}

/// One step: its header and what it runs.
type Step<'a> = (String, Box<dyn FnOnce() -> Result<()> + 'a>);

fn step<'a>(name: impl Into<String>, run: impl FnOnce() -> Result<()> + 'a) -> Step<'a> {
    (name.into(), Box::new(run))
}

impl crate::flags::Test {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let root = crate::project_root();
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
        // Copy the executable now, before a parallel build can replace it.
        let _ = xtask_exe()?;
        let targets = crate::targets::load()?;
        let version = manifest::workspace_version(&root)?;
        let model = crate::smoke::ModelFile::find(&root, &self.model)?.path;
        let image = format!("ember:{version}-cpu");

        let mut plan: Vec<Step<'_>> = Vec::new();
        let cargo_steps: Vec<Step<'_>> = vec![
            step("fetch the pinned models (ember pull --all)", || {
                cmd!(sh, "{cargo} run --release -p ember -- pull --all").run()?;
                Ok(())
            }),
            step("cargo test --workspace --release --no-fail-fast", || {
                let tested = cmd!(sh, "{cargo} test --workspace --release --no-fail-fast").run();
                let deps = crate::target_dir().join("release").join("deps");
                let freed = remove_test_executables(&deps)?;
                println!(
                    "test: removed the test executables from {} ({:.1} GiB) to leave disk for the artifact steps",
                    deps.display(),
                    freed as f64 / (1u64 << 30) as f64
                );
                tested?;
                Ok(())
            }),
            step(
                "server tests through the openai client (pytest tests/server)",
                || server_tests(sh, &root, &cargo),
            ),
        ];
        if !self.toolchain_only {
            plan.extend(cargo_steps);
        }
        // The kernels of every target (some 250 clang runs, the largest CPU cost here after the
        // engine's compilation) compile in a background thread at the lowest CPU priority from
        // the start, so they use the cores the cargo steps leave idle (single-threaded compiler
        // front ends, linking, tests that use one thread); their step waits for them. Without the
        // cargo steps (--toolchain-only) they run in their step as before.
        let mut background_kernels = None;
        if !self.skip_toolchain && !self.toolchain_only {
            let (root, targets) = (root.clone(), targets.clone());
            background_kernels = Some(std::thread::spawn(move || {
                all_kernels(&root, &targets, kernels::Priority::Background)
            }));
        }
        if !self.skip_toolchain {
            plan.push(step(
                "kernels for every target (xtask kernels --all)",
                || {
                    let report = match background_kernels {
                        Some(handle) => {
                            println!(
                                "kernels: waiting for the compilation started in the background"
                            );
                            handle.join().map_err(|_| {
                                anyhow::anyhow!("the kernel compilation thread panicked")
                            })?
                        }
                        None => all_kernels(&root, &targets, kernels::Priority::Normal),
                    };
                    let report = report?;
                    print!("{report}");
                    Ok(())
                },
            ));
            plan.push(step("a wrong target name fails", || wrong_target_fails(sh)));
            for target in ["gfx1201", "gfx1151"] {
                plan.push(step(format!("build --target {target}"), || {
                    build::build(sh, &root, &targets, target, Os::Linux, &version).map(drop)
                }));
            }
            plan.push(step(
                "gfx1201 and gfx1151: manifest.json and `ember info` match targets.toml",
                || compare_gpu_artifacts(sh, &targets, &version),
            ));
            plan.push(step(
                "build --target cpu --os windows, run ember.exe under wine",
                || windows_under_wine(sh, &root, &targets, &version, &model),
            ));
            plan.push(step("matrix --check", || {
                matrix::check_workflow(&targets, &matrix::default_workflow_path(&root))?;
                println!("matrix: the release workflow matches targets.toml");
                Ok(())
            }));
            plan.push(step("matrix --check fails after a target is added", || {
                matrix_drift_fails(sh, &root)
            }));
            plan.push(step("actionlint", || actionlint(sh, &root)));
            plan.push(step("build --target cpu (for the image)", || {
                build::build(sh, &root, &targets, "cpu", Os::Linux, &version).map(drop)
            }));
            plan.push(step(
                "cpu and gfx1201 artifacts hold no path of this machine",
                || no_build_paths(&root, &version),
            ));
            plan.push(step(
                "xtask verify: the cpu, gfx1201 and Windows archives",
                || {
                    for (os, target) in [
                        (Os::Linux, "cpu"),
                        (Os::Linux, "gfx1201"),
                        (Os::Windows, "cpu"),
                    ] {
                        let archive = package::archive_path(&version, os, target);
                        let summary = crate::verify::verify(&archive, &targets)?;
                        println!("verify: {}: {summary}", archive.display());
                    }
                    Ok(())
                },
            ));
            plan.push(step(
                format!(
                    "docker --target cpu --base {} --check-reproducible, smoke --image {image}",
                    self.base
                ),
                || docker_and_smoke(sh, &self.base, &image, &self.model),
            ));
            if self.repro {
                plan.push(step(
                "repro: cpu and gfx1201 built again in another folder with a clean CARGO_TARGET_DIR are byte-identical, archives and images' file layers; a flipped kernel byte changes the sums",
                || {
                    crate::flags::Repro {
                        targets: vec!["cpu".into(), "gfx1201".into()],
                        no_flip: false,
                        base: Some(self.base.clone()),
                    }
                    .run(sh)
                },
            ));
            }
            plan.push(step(
                format!(
                    "build --target gfx1201 with the host kernel toolchain hidden: built in the build container (docker/build.Dockerfile on {}), equal to the host build",
                    self.base
                ),
                || container_fallback(sh, &self.base, &version),
            ));
            plan.push(step(
                format!(
                    "release --dry-run --targets cpu,gfx1201 --base {}, then verify",
                    self.base
                ),
                || {
                    crate::flags::Release {
                        dry_run: true,
                        targets: vec!["cpu".into(), "gfx1201".into()],
                        base: Some(self.base.clone()),
                        no_images: false,
                        model: self.model.clone(),
                    }
                    .run(sh)
                },
            ));
        }

        let mut steps = Steps {
            total: plan.len(),
            outcomes: Vec::new(),
        };
        for (name, run) in plan {
            steps.run(&name, run);
        }
        steps.finish()
    }
}

/// A private copy of the xtask executable, to run sub-commands whose failure is the point. The
/// copy matters: a parallel build may replace `target/debug/xtask` while this run is still going.
static SELF_COPIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn xtask_exe() -> Result<PathBuf> {
    let current = std::env::current_exe().context("locating the xtask executable")?;
    let copy = crate::target_dir().join("xtask-test").join("xtask-self");
    if !SELF_COPIED.swap(true, std::sync::atomic::Ordering::Relaxed) || !copy.is_file() {
        std::fs::create_dir_all(copy.parent().context("copy path has a parent")?)?;
        std::fs::copy(&current, &copy)
            .with_context(|| format!("copying {} to {}", current.display(), copy.display()))?;
    }
    Ok(copy)
}

/// Compiles every target's kernels (at `priority`) and returns the report to print: the step
/// runs in a background thread while the cargo steps print, so it must not print as it goes.
fn all_kernels(root: &Path, targets: &Targets, priority: kernels::Priority) -> Result<String> {
    use std::fmt::Write as _;
    let sh = Shell::new()?;
    sh.change_dir(root);
    let mut report = String::new();
    if toolchain::which("clang++-19").is_none()
        && std::env::var_os("ROCM_PATH").is_none()
        && !Path::new("/opt/rocm").is_dir()
    {
        bail!(
            "no AMDGPU kernel compiler (clang++-19 or ROCm) found: run {}",
            toolchain::SETUP_KERNELS
        );
    }
    let mut toolchains = Toolchains::default();
    let compiler = toolchains.amdgpu().map_err(anyhow::Error::msg)?.clone();
    writeln!(report, "kernels: compiler {}", compiler.describe())?;
    let mut problems = Vec::new();
    let selected = targets.select(&Selection::All)?;
    let outcomes = kernels::compile_targets_at(&sh, root, &selected, &mut toolchains, priority);
    for (target, outcome) in selected.iter().zip(outcomes) {
        match (&outcome, target.kind) {
            (Ok(KernelOutcome::Compiled { objects }), _) => writeln!(
                report,
                "  {:<8} {} code object(s), architecture verified",
                target.name,
                objects.len()
            )?,
            (Ok(KernelOutcome::NoKernels), _) => {
                writeln!(report, "  {:<8} no kernels (CPU target)", target.name)?
            }
            (Ok(KernelOutcome::NotCompiled { reason }), kind) => {
                writeln!(report, "  {:<8} not compiled: {reason}", target.name)?;
                // Only a target newer than the compiler may be left out; anything else this
                // toolchain should have built.
                let expected = match kind {
                    Kind::Amdgpu => target.min_llvm.is_some_and(|min| min > compiler.llvm_major),
                    Kind::Nvidia => reason == "nvcc not found",
                    Kind::Cpu => false,
                };
                if !expected {
                    problems.push(format!("{}: not compiled: {reason}", target.name));
                }
            }
            (Err(error), _) => problems.push(format!("{}: {error:#}", target.name)),
        }
    }
    ensure!(
        problems.is_empty(),
        "{report}kernels failed:\n  {}",
        problems.join("\n  ")
    );
    Ok(report)
}

fn wrong_target_fails(sh: &Shell) -> Result<()> {
    let xtask = xtask_exe()?;
    let output = cmd!(sh, "{xtask} kernels --target gfx9999")
        .ignore_status()
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success(),
        "`xtask kernels --target gfx9999` succeeded; expected it to fail"
    );
    ensure!(
        stderr.contains("unknown target `gfx9999`"),
        "`xtask kernels --target gfx9999` failed without naming the target:\n{stderr}"
    );
    println!(
        "wrong target: failed as expected: {}",
        stderr.lines().find(|l| l.contains("gfx9999")).unwrap_or("")
    );
    Ok(())
}

/// Unpacks an archive into `target/xtask-test/<stem>/` and returns the package folder.
fn unpack(archive: &Path) -> Result<PathBuf> {
    let dest = crate::target_dir().join("xtask-test");
    let name = archive
        .file_name()
        .and_then(|n| n.to_str())
        .context("archive name is not UTF-8")?;
    let stem = name.trim_end_matches(".tar.gz").trim_end_matches(".zip");
    let folder = dest.join(stem);
    if folder.exists() {
        std::fs::remove_dir_all(&folder)?;
    }
    std::fs::create_dir_all(&dest)?;
    let file =
        std::fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
    if name.ends_with(".zip") {
        zip::ZipArchive::new(file)?.extract(&dest)?;
    } else {
        tar::Archive::new(flate2::read::GzDecoder::new(file)).unpack(&dest)?;
    }
    ensure!(
        folder.is_dir(),
        "expected {} to hold the folder {stem}, found none",
        archive.display()
    );
    Ok(folder)
}

fn compare_gpu_artifacts(sh: &Shell, targets: &Targets, version: &str) -> Result<()> {
    let mut manifests = Vec::new();
    for name in ["gfx1201", "gfx1151"] {
        let archive = package::archive_path(version, Os::Linux, name);
        let folder = unpack(&archive)?;
        sh.change_dir(&folder);
        let sums = cmd!(sh, "sha256sum -c --strict --quiet SHA256SUMS")
            .ignore_status()
            .output()?;
        sh.change_dir(crate::project_root());
        ensure!(
            sums.status.success(),
            "sha256sum -c SHA256SUMS failed in {}:\n{}",
            folder.display(),
            String::from_utf8_lossy(&sums.stdout)
        );
        let text = std::fs::read_to_string(folder.join("manifest.json"))?;
        let manifest: PackageManifest =
            serde_json::from_str(&text).context("parsing manifest.json")?;
        let target = targets.target(name)?;
        let expected: Vec<FeatureRecord> = target
            .features
            .iter()
            .map(FeatureRecord::from_feature)
            .collect();
        ensure!(
            manifest.build.target == name,
            "{name}: manifest.json names target {}",
            manifest.build.target
        );
        ensure!(
            manifest.build.features == expected,
            "{name}: manifest.json features {:?} differ from targets.toml's {:?}",
            manifest.build.features,
            expected
        );
        check_ember_info(sh, &folder, &manifest.build)?;
        manifests.push(manifest.build);
    }
    // Apart from what targets.toml says differs, the two builds record the same things.
    let a = serde_json::to_value(&manifests[0])?;
    let b = serde_json::to_value(&manifests[1])?;
    let (a, b) = (
        a.as_object().context("manifest is an object")?,
        b.as_object().context("manifest is an object")?,
    );
    let differing: Vec<&str> = a
        .keys()
        .filter(|k| a[*k] != b[*k])
        .map(String::as_str)
        .collect();
    ensure!(
        differing == ["family", "family_description", "features", "kernels", "target"],
        "gfx1201 and gfx1151 manifests differ in {differing:?}; expected only family, family_description, features, kernels, target"
    );
    let vmm = |m: &BuildManifest| m.feature("vmm").map(|f| f.state.clone());
    ensure!(
        vmm(&manifests[0]).as_deref() == Some("off"),
        "gfx1201: expected vmm off"
    );
    ensure!(
        vmm(&manifests[1]).as_deref() == Some("on"),
        "gfx1151: expected vmm on"
    );
    println!(
        "artifacts: gfx1201 says vmm off ({}), gfx1151 says vmm on",
        manifests[0]
            .feature("vmm")
            .and_then(|f| f.reason.clone())
            .unwrap_or_default()
    );
    Ok(())
}

/// `ember info` from the unpacked package prints the target and every feature as the manifest
/// has it (the format of engine/src/build_manifest.rs's `render_text`).
fn check_ember_info(sh: &Shell, folder: &Path, manifest: &BuildManifest) -> Result<()> {
    let exe = folder.join("ember");
    let output = cmd!(sh, "{exe} info --format json")
        .ignore_status()
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "`{} info --format json` failed ({}):\n{}{}",
        exe.display(),
        output.status,
        stdout,
        String::from_utf8_lossy(&output.stderr)
    );
    let info: serde_json::Value = serde_json::from_str(&stdout)
        .with_context(|| format!("`ember info --format json` printed no JSON object:\n{stdout}"))?;
    let shown: BuildManifest =
        serde_json::from_value(info["build"].clone()).with_context(|| {
            format!("`ember info --format json` has no build manifest under `build`:\n{stdout}")
        })?;
    ensure!(
        shown.target == manifest.target,
        "`ember info` of the {} artifact names target {}",
        manifest.target,
        shown.target
    );
    ensure!(
        shown.features == manifest.features,
        "`ember info` of the {} artifact shows the features {:?}, expected {:?}",
        manifest.target,
        shown.features,
        manifest.features
    );
    let lines: Vec<String> = manifest.features.iter().map(feature_line).collect();
    println!(
        "ember info ({}): target {}, {}",
        manifest.target,
        shown.target,
        lines.join(" | ")
    );
    Ok(())
}

/// How `render_text` prints one feature: `vmm: off (reason)` or `peer_copy: on`.
pub fn feature_line(feature: &FeatureRecord) -> String {
    match &feature.reason {
        Some(reason) if feature.state != "on" => {
            format!("{}: {} ({reason})", feature.name, feature.state)
        }
        _ => format!("{}: {}", feature.name, feature.state),
    }
}

fn windows_under_wine(
    sh: &Shell,
    root: &Path,
    targets: &Targets,
    version: &str,
    model: &Path,
) -> Result<()> {
    let wine = crate::wine::find_wine()?;
    let archive = build::build(sh, root, targets, "cpu", Os::Windows, version)?;
    let folder = unpack(&archive)?;
    let exe = folder.join("ember.exe");
    let prefix = crate::wine::prepare_prefix(sh)?;
    let model_arg = format!("Z:{}", model.display()).replace('/', "\\");
    let _env = (
        sh.push_env("WINEPREFIX", &prefix),
        sh.push_env("WINEDEBUG", "-all"),
    );
    let output = cmd!(sh, "{wine} {exe} --version")
        .ignore_status()
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "`ember.exe --version` under wine failed ({}):\n{stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        stdout.contains(version),
        "`ember.exe --version` printed {stdout:?}; expected the version {version}"
    );
    println!("wine: {}", stdout.trim());
    let output = cmd!(sh, "{wine} {exe} info -m {model_arg}")
        .ignore_status()
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    ensure!(
        output.status.success(),
        "`ember.exe info -m {model_arg}` under wine failed ({}):\n{stdout}{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    ensure!(
        stdout.contains("target: cpu"),
        "`ember.exe info` under wine does not print `target: cpu`:\n{stdout}"
    );
    println!(
        "wine: ember.exe info -m {model_arg}: ok ({} lines)",
        stdout.lines().count()
    );
    Ok(())
}

/// Every file of the cpu and gfx1201 archives (binary, kernels, manifest) is free of the paths a
/// build could leak: the workspace root, cargo's target directory and cargo's home. Their
/// remapping is what lets checkouts in different places build the same bytes.
/// `cargo xtask build --target gfx1201` on a machine whose kernel toolchain is hidden (an empty
/// toolchain directory) and that has docker: it must say it builds in the container, and its
/// archive must equal the host build's of the same commit (or the step names what differs).
fn container_fallback(sh: &Shell, base: &str, version: &str) -> Result<()> {
    let archive = package::archive_path(version, Os::Linux, "gfx1201");
    let host = std::fs::read(&archive)
        .with_context(|| format!("reading the host build {}", archive.display()))?;
    let host_copy = crate::target_dir()
        .join("xtask-test")
        .join("gfx1201-host.tar.gz");
    std::fs::create_dir_all(host_copy.parent().context("has a parent")?)?;
    std::fs::write(&host_copy, &host)?;
    let hidden = crate::target_dir().join("xtask-test").join("no-toolchain");
    std::fs::create_dir_all(&hidden)?;
    let xtask = xtask_exe()?;
    let output = cmd!(sh, "{xtask} build --target gfx1201")
        .env("EMBER_TOOLCHAIN_DIR", &hidden)
        .env("EMBER_BUILD_BASE", base)
        .ignore_status()
        .output()?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    eprint!("{}", String::from_utf8_lossy(&output.stderr));
    ensure!(
        output.status.success(),
        "`xtask build --target gfx1201` with no host kernel toolchain failed"
    );
    ensure!(
        stdout.contains("building in the build container instead"),
        "expected the build to say it builds in the container, found:\n{stdout}"
    );
    let container = std::fs::read(&archive)?;
    if container != host {
        bail!(
            "the container build of gfx1201 differs from the host build: {}",
            crate::repro::differing_files(&host_copy, &archive)?
        );
    }
    println!(
        "container: gfx1201 built in the container equals the host build (SHA-256 {})",
        package::sha256_hex(&container)
    );
    Ok(())
}

fn no_build_paths(root: &Path, version: &str) -> Result<()> {
    let paths = build::build_paths(root)?;
    let mut found = Vec::new();
    let mut checked = 0;
    for target in ["cpu", "gfx1201"] {
        let folder = unpack(&package::archive_path(version, Os::Linux, target))?;
        for file in files_under(&folder)? {
            let bytes = std::fs::read(&file)?;
            checked += 1;
            for (path, _) in &paths {
                let needle = path.to_string_lossy();
                if contains(&bytes, &needle) {
                    found.push(format!("{} holds {needle}", file.display()));
                }
            }
        }
    }
    ensure!(
        found.is_empty(),
        "build paths in the artifacts:\n  {}",
        found.join("\n  ")
    );
    println!(
        "paths: none of {} in the {checked} files of the cpu and gfx1201 artifacts",
        paths
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Whether `haystack` holds the text `needle`. Through std's (always optimised) UTF-8 decoding
/// and string search, since xtask is a debug build and binaries are tens of megabytes; a match
/// of valid UTF-8 survives the lossy decoding unchanged, and the replacement character is in no
/// path looked for.
fn contains(haystack: &[u8], needle: &str) -> bool {
    !needle.is_empty() && String::from_utf8_lossy(haystack).contains(needle)
}

/// The regular files under `dir`, recursively.
fn files_under(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

fn matrix_drift_fails(sh: &Shell, root: &Path) -> Result<()> {
    let dir = crate::target_dir().join("xtask-test");
    std::fs::create_dir_all(&dir)?;
    let copy = dir.join("targets-with-added-target.toml");
    let text = std::fs::read_to_string(root.join("targets.toml"))?;
    std::fs::write(
        &copy,
        format!("{text}\n[[target]]\nname = \"gfx1036\"\nfamily = \"gfx103X\"\nmin_llvm = 15\n"),
    )?;
    let xtask = xtask_exe()?;
    let output = cmd!(sh, "{xtask} matrix --check --targets {copy}")
        .ignore_status()
        .output()?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    ensure!(
        !output.status.success(),
        "`xtask matrix --check` passed with a target added to targets.toml; expected drift"
    );
    ensure!(
        stderr.contains("has drifted"),
        "`xtask matrix --check` failed for another reason:\n{stderr}"
    );
    println!("matrix: drift detected as expected");
    Ok(())
}

fn actionlint(sh: &Shell, root: &Path) -> Result<()> {
    let actionlint = toolchain::actionlint()
        .with_context(|| format!("actionlint not found: run {}", toolchain::SETUP_ACTIONLINT))?;
    let files = matrix::workflow_files(root);
    ensure!(!files.is_empty(), "no workflows in .github/workflows");
    let files_ref = &files;
    cmd!(sh, "{actionlint} {files_ref...}").run()?;
    println!("actionlint: {} clean", files.join(", "));
    Ok(())
}

/// Where the server tests' Python environment lives, and the stamp that says what it was built from.
/// Under the target directory.
const SERVER_TESTS_VENV: &str = "server-tests-venv";
const SERVER_TESTS_REQUIREMENTS: &str = "tests/server/requirements.txt";
const VENV_STAMP: &str = "ember-requirements.stamp";
/// What installs `python3` with `venv` and `ensurepip` on a fresh Debian machine.
pub const SETUP_PYTHON: &str = ".ci/setup-python.sh";

/// The Python of the venv that the server tests and the image smoke test use, with the pinned
/// `openai` client, httpx and pytest installed. Built once and reused while the requirements file
/// and the system Python are unchanged (a stamp in the venv records both), so a CI run that
/// changed neither installs nothing.
pub fn server_test_python(sh: &Shell, root: &Path) -> Result<PathBuf> {
    let venv = crate::target_dir().join(SERVER_TESTS_VENV);
    let python = venv.join("bin").join("python");
    let requirements = root.join(SERVER_TESTS_REQUIREMENTS);
    let requirements_text = std::fs::read(&requirements)
        .with_context(|| format!("reading {}", requirements.display()))?;
    let system_python = cmd!(sh, "python3 --version")
        .quiet()
        .read()
        .with_context(|| format!("python3 not found: run {SETUP_PYTHON}"))?;
    let stamp = format!(
        "{}  {SERVER_TESTS_REQUIREMENTS}\n{}\n",
        hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&requirements_text)),
        system_python.trim()
    );
    let stamp_path = venv.join(VENV_STAMP);
    if python.is_file() && std::fs::read_to_string(&stamp_path).ok().as_deref() == Some(&stamp) {
        println!(
            "python: reusing {} ({} unchanged)",
            venv.display(),
            SERVER_TESTS_REQUIREMENTS
        );
        return Ok(python);
    }
    println!(
        "python: creating {} from {SERVER_TESTS_REQUIREMENTS} ({})",
        venv.display(),
        system_python.trim()
    );
    cmd!(sh, "python3 -m venv --clear {venv}")
        .run()
        .with_context(|| {
            format!("`python3 -m venv` failed (Debian needs python3-venv): run {SETUP_PYTHON}")
        })?;
    cmd!(
        sh,
        "{python} -m pip install --quiet --disable-pip-version-check --no-input -r {requirements}"
    )
    .run()
    .with_context(|| {
        format!(
            "installing {SERVER_TESTS_REQUIREMENTS} into {}",
            venv.display()
        )
    })?;
    // Written last: an interrupted install leaves no stamp, so the next run starts over.
    std::fs::write(&stamp_path, stamp)
        .with_context(|| format!("writing {}", stamp_path.display()))?;
    Ok(python)
}

/// `pytest tests/server` against the release `ember` that `cargo test --workspace --release`
/// built (built here only when it is missing, so this step never rebuilds with other features).
fn server_tests(sh: &Shell, root: &Path, cargo: &str) -> Result<()> {
    let ember = crate::target_dir().join("release").join("ember");
    if !ember.is_file() {
        println!("server tests: {} is missing; building it", ember.display());
        cmd!(sh, "{cargo} build --release -p ember").run()?;
    }
    let python = server_test_python(sh, root)?;
    // std::process rather than xshell: the exit status itself matters (5 is "no tests").
    let status = std::process::Command::new(&python)
        .args(["-m", "pytest", "tests/server"])
        .current_dir(root)
        .env("EMBER_BIN", &ember)
        // No __pycache__ folders in the source tree.
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .status()
        .with_context(|| format!("starting {} -m pytest", python.display()))?;
    pytest_verdict(status.code())
}

/// What pytest's exit status means for the step. pytest exits 5 when it collected no tests, which
/// must fail the step: a suite that silently stopped running is not a passing suite.
fn pytest_verdict(code: Option<i32>) -> Result<()> {
    match code {
        Some(0) => Ok(()),
        Some(5) => bail!("pytest collected no tests in tests/server (exit status 5)"),
        Some(code) => bail!("pytest tests/server failed (exit status {code})"),
        None => bail!("pytest tests/server was killed by a signal"),
    }
}

fn docker_and_smoke(sh: &Shell, base: &str, image: &str, model: &str) -> Result<()> {
    if toolchain::which("docker").is_none()
        || cmd!(sh, "docker info")
            .quiet()
            .ignore_stdout()
            .ignore_stderr()
            .run()
            .is_err()
    {
        bail!("docker (with a running daemon) not found: run .ci/setup-docker.sh");
    }
    crate::flags::Docker {
        target: "cpu".to_string(),
        base: Some(base.to_string()),
        check_reproducible: true,
    }
    .run(sh)?;
    crate::flags::Smoke {
        artifact: None,
        image: Some(image.to_string()),
        model: model.to_string(),
    }
    .run(sh)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(unix)]
    #[test]
    fn only_single_link_test_executables_are_removed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("xtask-deps-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, bytes: usize, mode: u32| {
            let path = dir.join(name);
            std::fs::write(&path, vec![7u8; bytes]).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            path
        };
        let test = write("engine-0123abcd", 1000, 0o755);
        let bin = write("ember-89abcdef", 300, 0o755);
        std::fs::hard_link(&bin, dir.join("ember-placed")).unwrap();
        let rlib = write("libember-0123abcd.rlib", 50, 0o644);
        let so = write("libserde_derive-00ff.so", 70, 0o755);
        let data = write("notes-0001", 20, 0o644);
        let freed = remove_test_executables(&dir).unwrap();
        assert_eq!(freed, 1000);
        assert!(!test.exists());
        for kept in [&bin, &rlib, &so, &data] {
            assert!(kept.exists(), "{} was removed", kept.display());
        }
        assert_eq!(remove_test_executables(&dir.join("missing")).unwrap(), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn contains_finds_paths_in_binary_bytes() {
        let mut bytes = vec![0xff, 0xfe, 0x00];
        bytes.extend_from_slice(b"/build/worker/ember/engine/src/lib.rs");
        bytes.extend_from_slice(&[0xc3, 0x28]);
        assert!(contains(&bytes, "/build/worker/ember"));
        assert!(!contains(&bytes, "/root/.cargo"));
        assert!(!contains(&bytes, ""));
    }

    #[test]
    fn pytest_exit_statuses() {
        assert!(pytest_verdict(Some(0)).is_ok());
        let message = |code| pytest_verdict(code).unwrap_err().to_string();
        assert_eq!(
            message(Some(5)),
            "pytest collected no tests in tests/server (exit status 5)"
        );
        assert_eq!(
            message(Some(1)),
            "pytest tests/server failed (exit status 1)"
        );
        assert_eq!(message(None), "pytest tests/server was killed by a signal");
    }

    #[test]
    fn feature_lines_match_render_text() {
        let on = FeatureRecord {
            name: "vmm".into(),
            state: "on".into(),
            enabled: true,
            reason: None,
            tracking: vec![],
        };
        assert_eq!(feature_line(&on), "vmm: on");
        let off = FeatureRecord {
            name: "vmm".into(),
            state: "off".into(),
            enabled: false,
            reason: Some("faults".into()),
            tracking: vec!["https://example.org/1".into()],
        };
        assert_eq!(feature_line(&off), "vmm: off (faults)");
    }

    #[test]
    fn model_paths_come_from_models_toml() {
        let root = crate::project_root();
        let model = crate::smoke::ModelFile::find(&root, "smollm2-135m-instruct-q4_1").unwrap();
        assert!(
            model.path.ends_with("SmolLM2-135M-Instruct.Q4_1.gguf"),
            "{}",
            model.path.display()
        );
        let error = crate::smoke::ModelFile::find(&root, "nope")
            .err()
            .expect("an unknown model name is an error")
            .to_string();
        assert_eq!(
            error,
            "expected a model name from models.toml (smollm2-135m-instruct-q4_1, gemma3-270m-q4_k_m), found \"nope\""
        );
    }
}
