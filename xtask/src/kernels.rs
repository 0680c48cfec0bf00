//! `cargo xtask kernels`: compiles `kernels/*.hip` into one code object per module and target,
//! `target/kernels/<target>/<module>.hsaco` (AMDGPU) or `.cubin` (NVIDIA), and verifies that each
//! object's ELF header names the requested architecture.
//!
//! The target's settings reach the kernel sources as preprocessor defines (see [`defines`]), so a
//! kernel can pick its flash-attention flavour and wave size at compile time. A target the found
//! toolchain cannot build is reported as not compiled, with the reason, never skipped silently.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use xshell::Shell;

use crate::elf;
use crate::targets::{Kind, Selection, Target};
use crate::toolchain::{AmdgpuCompiler, Nvcc};

/// What happened to one target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KernelOutcome {
    /// Verified code objects, one per module, sorted.
    Compiled { objects: Vec<PathBuf> },
    /// The toolchain cannot build this target; the reason says why.
    NotCompiled { reason: String },
    /// CPU targets have no kernels.
    NoKernels,
}

/// The compilers, discovered once per run and only when a target needs them.
#[derive(Default)]
pub struct Toolchains {
    amdgpu: Option<std::result::Result<AmdgpuCompiler, String>>,
    nvcc: Option<Option<Nvcc>>,
}

impl Toolchains {
    pub fn amdgpu(&mut self) -> std::result::Result<&AmdgpuCompiler, String> {
        self.amdgpu
            .get_or_insert_with(|| AmdgpuCompiler::discover().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(Clone::clone)
    }

    pub fn nvcc(&mut self) -> Result<Option<&Nvcc>> {
        if self.nvcc.is_none() {
            self.nvcc = Some(Nvcc::discover()?);
        }
        Ok(self.nvcc.as_ref().and_then(Option::as_ref))
    }

    /// One line describing the compiler used for `target`, for the build manifest.
    /// Everything about the compiler for `target` that decides its output, for the kernel cache:
    /// [`Self::describe`] (version, ROCm release or Debian HIP headers and device-library
    /// package) plus, for Debian's clang, the names and sizes of the device libraries, which
    /// `.ci/setup-kernels.sh` builds partly by hand.
    pub fn identity(&mut self, target: &Target) -> String {
        let mut identity = self.describe(target).unwrap_or_default();
        if target.kind == Kind::Amdgpu {
            if let Ok(AmdgpuCompiler {
                source: crate::toolchain::AmdgpuSource::Debian { device_libs, .. },
                ..
            }) = self.amdgpu()
            {
                let mut libraries: Vec<String> = std::fs::read_dir(device_libs)
                    .into_iter()
                    .flatten()
                    .filter_map(|entry| {
                        let entry = entry.ok()?;
                        let size = entry.metadata().ok()?.len();
                        Some(format!("{} {size}", entry.file_name().to_string_lossy()))
                    })
                    .collect();
                libraries.sort();
                identity.push('\n');
                identity.push_str(&libraries.join("\n"));
            }
        }
        identity
    }

    pub fn describe(&mut self, target: &Target) -> Option<String> {
        match target.kind {
            Kind::Cpu => None,
            Kind::Amdgpu => self.amdgpu().ok().map(AmdgpuCompiler::describe),
            Kind::Nvidia => self.nvcc().ok().flatten().map(|nvcc| nvcc.version.clone()),
        }
    }
}

impl crate::flags::Kernels {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let targets = crate::targets::load()?;
        let selection = self.selection.selection();
        let selected = targets.select(&selection)?;
        let root = crate::project_root();
        let mut toolchains = Toolchains::default();
        let mut failures = Vec::new();
        let mut rows = Vec::new();
        let outcomes = compile_targets(sh, &root, &selected, &mut toolchains);
        for (target, outcome) in selected.iter().zip(outcomes) {
            match outcome {
                Ok(KernelOutcome::Compiled { objects }) => rows.push(format!(
                    "  {:<8} compiled {} code object(s), architecture verified",
                    target.name,
                    objects.len()
                )),
                Ok(KernelOutcome::NotCompiled { reason }) => {
                    rows.push(format!("  {:<8} not compiled: {reason}", target.name));
                    if matches!(selection, Selection::Target(_)) {
                        failures.push(format!("{}: not compiled: {reason}", target.name));
                    }
                }
                Ok(KernelOutcome::NoKernels) => {
                    rows.push(format!("  {:<8} no kernels (CPU target)", target.name))
                }
                Err(error) => {
                    rows.push(format!("  {:<8} FAILED: {error:#}", target.name));
                    failures.push(format!("{}: {error:#}", target.name));
                }
            }
        }
        println!("kernels: summary for {} target(s):", selected.len());
        for row in rows {
            println!("{row}");
        }
        if !failures.is_empty() {
            bail!(
                "kernels failed for {} target(s):\n  {}",
                failures.len(),
                failures.join("\n  ")
            );
        }
        Ok(())
    }
}

/// The kernel sources, `kernels/*.hip`, sorted.
pub fn sources(root: &Path) -> Result<Vec<PathBuf>> {
    let dir = root.join("kernels");
    let mut sources = Vec::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "hip") {
            sources.push(path);
        }
    }
    sources.sort();
    Ok(sources)
}

/// Where a target's code objects go: `target/kernels/<target>/`.
pub fn kernel_out_dir(target: &str) -> PathBuf {
    crate::target_dir().join("kernels").join(target)
}

/// The preprocessor defines that carry a target's settings into the kernel sources.
pub fn defines(target: &Target) -> Vec<String> {
    let mut defines = vec![format!("-DEMBER_TARGET_NAME=\"{}\"", target.name)];
    if let Some(wave_size) = target.wave_size {
        defines.push(format!("-DEMBER_WAVE_SIZE={wave_size}"));
    }
    if let Some(flavour) = target.flash_attention {
        defines.push(format!("-DEMBER_FA_{}=1", flavour.name().to_uppercase()));
    }
    for feature in &target.features {
        defines.push(format!(
            "-DEMBER_FEATURE_{}={}",
            feature.name.to_uppercase(),
            u8::from(feature.enabled())
        ));
    }
    defines
}

/// Compiles every kernel module for `target` into [`kernel_out_dir`], replacing what was there.
pub fn compile_target(
    sh: &Shell,
    root: &Path,
    target: &Target,
    toolchains: &mut Toolchains,
) -> Result<KernelOutcome> {
    compile_targets(sh, root, &[target], toolchains)
        .pop()
        .context("expected one kernel outcome for one target, found none")?
}

/// How the compiler processes run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Priority {
    /// As xtask itself, with each command echoed.
    Normal,
    /// Under `nice -n 19` (when `nice` exists) and without echoing the commands: for compiling
    /// beside other work that should keep the CPU first.
    Background,
}

/// [`compile_targets`] at normal priority.
pub fn compile_targets(
    sh: &Shell,
    root: &Path,
    targets: &[&Target],
    toolchains: &mut Toolchains,
) -> Vec<Result<KernelOutcome>> {
    compile_targets_at(sh, root, targets, toolchains, Priority::Normal)
}

/// Compiles the kernels of every target in `targets`, each into its [`kernel_out_dir`]; returns
/// one outcome per target, in order. The (target, module) compilations of all targets share one
/// pool of workers, so no CPU idles while the slowest module of one target finishes before the
/// next target starts. A code object whose inputs were compiled before (same source and headers,
/// compiler, flags) is copied from the cache (see [`cache_key`]) instead of compiled again.
pub fn compile_targets_at(
    sh: &Shell,
    root: &Path,
    targets: &[&Target],
    toolchains: &mut Toolchains,
    priority: Priority,
) -> Vec<Result<KernelOutcome>> {
    let mut plans: Vec<Result<Plan>> = targets
        .iter()
        .map(|target| plan_target(root, target, toolchains))
        .collect();
    let jobs: Vec<&CompileJob> = plans
        .iter()
        .filter_map(|plan| match plan {
            Ok(Plan::Compile(jobs)) => Some(jobs.iter()),
            _ => None,
        })
        .flatten()
        .collect();
    let errors = run_jobs(sh, &jobs, priority);
    plans
        .drain(..)
        .zip(targets)
        .map(|(plan, target)| match plan? {
            Plan::Done(outcome) => Ok(outcome),
            Plan::Compile(jobs) => finish_target(target, jobs, &errors),
        })
        .collect()
}

/// What one target needs: nothing more (CPU target, or one the toolchain cannot build), or these
/// compilations.
enum Plan {
    Done(KernelOutcome),
    Compile(Vec<CompileJob>),
}

/// Resolves the compiler for `target`, clears its output folder and lists its compile jobs.
fn plan_target(root: &Path, target: &Target, toolchains: &mut Toolchains) -> Result<Plan> {
    if target.kind == Kind::Cpu {
        return Ok(Plan::Done(KernelOutcome::NoKernels));
    }
    let sources = sources(root)?;
    if sources.is_empty() {
        bail!(
            "no kernel sources (kernels/*.hip) to compile for {}",
            target.name
        );
    }
    let out_dir = kernel_out_dir(&target.name);
    let extension = target.code_object_extension().unwrap_or("bin");
    let defines = defines(target);
    let include = root.join("kernels");
    let include_arg = format!("-I{}", include.display());

    // Resolve the compiler before touching the output folder, so a target that cannot be built
    // keeps no stale objects that a later package step might pick up.
    let compiler: Compiler = match target.kind {
        Kind::Amdgpu => match toolchains.amdgpu() {
            Ok(compiler) => match compiler.can_compile(target) {
                Ok(()) => Compiler::Amdgpu(compiler.clone()),
                Err(reason) => return not_compiled(&out_dir, reason).map(Plan::Done),
            },
            Err(error) => bail!("{error}"),
        },
        Kind::Nvidia => match toolchains.nvcc()? {
            Some(nvcc) => Compiler::Nvcc(nvcc.clone()),
            None => return not_compiled(&out_dir, "nvcc not found".to_string()).map(Plan::Done),
        },
        Kind::Cpu => unreachable!("handled above"),
    };
    if out_dir.exists() {
        std::fs::remove_dir_all(&out_dir)
            .with_context(|| format!("removing {}", out_dir.display()))?;
    }
    std::fs::create_dir_all(&out_dir)?;
    let headers = header_digest(&include)?;
    let compiler_identity = toolchains.identity(target);

    // One compiler invocation per module.
    let mut jobs = Vec::new();
    for source in &sources {
        let module = source
            .file_stem()
            .and_then(|s| s.to_str())
            .context("kernel file name is not UTF-8")?;
        let object = out_dir.join(format!("{module}.{extension}"));
        // Written under a private name and renamed into place, so a reader never sees half an
        // object and two builds of one target in a shared checkout cannot interleave their bytes.
        let partial = out_dir.join(format!(
            "{module}.{extension}.partial-{}",
            std::process::id()
        ));
        let name = &target.name;
        let (program, mut args): (PathBuf, Vec<String>) = match &compiler {
            Compiler::Amdgpu(compiler) => {
                let mut args: Vec<String> = [
                    "-x",
                    "hip",
                    &format!("--offload-arch={name}"),
                    "--cuda-device-only",
                    "--no-gpu-bundle-output",
                    "-O3",
                    "-std=c++17",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                args.extend(compiler.location_args());
                // The compilation unit id names the module's device symbols
                // (`__hip_cuid_<id>`); left to clang it hashes the command line, output path and
                // device-library location included, so every build and every machine would
                // produce other bytes. One module is one unit, so its name is unique enough.
                args.push(format!("-cuid={module}"));
                // gfx9 is wave64 only; RDNA defaults to wave32 and needs asking for wave64.
                if target.wave_size == Some(64) && !name.starts_with("gfx9") {
                    args.push("-mwavefrontsize64".to_string());
                }
                (compiler.clang.clone(), args)
            }
            Compiler::Nvcc(nvcc) => (
                nvcc.path.clone(),
                [
                    "-cubin",
                    &format!("-arch={name}"),
                    "-O3",
                    "-std=c++17",
                    "-x",
                    "cu",
                ]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ),
        };
        args.push(include_arg.clone());
        args.extend(defines.iter().cloned());
        let source_bytes =
            std::fs::read(source).with_context(|| format!("reading {}", source.display()))?;
        let key = cache_key(&compiler_identity, &program, &args, &source_bytes, &headers);
        let cached = cache_dir().join(format!("{module}-{key}.{extension}"));
        args.extend([
            "-o".to_string(),
            partial.display().to_string(),
            source.display().to_string(),
        ]);
        jobs.push(CompileJob {
            program,
            args,
            source: source.clone(),
            partial,
            object,
            cached,
        });
    }
    Ok(Plan::Compile(jobs))
}

/// Checks the objects of one target's finished jobs, fills the cache and moves them into place.
fn finish_target(
    target: &Target,
    jobs: Vec<CompileJob>,
    errors: &[(PathBuf, String)],
) -> Result<KernelOutcome> {
    if let Some((_, error)) = errors
        .iter()
        .find(|(partial, _)| jobs.iter().any(|job| &job.partial == partial))
    {
        for job in &jobs {
            let _ = std::fs::remove_file(&job.partial);
        }
        bail!("{error}");
    }
    let mut objects = Vec::new();
    for job in jobs {
        let bytes = std::fs::read(&job.partial)
            .with_context(|| format!("reading {}", job.partial.display()))?;
        elf::verify_code_object(&bytes, &target.name)
            .with_context(|| format!("checking the architecture of {}", job.object.display()))?;
        if !job.cached.is_file() {
            store_in_cache(&job.cached, &bytes)?;
        }
        std::fs::rename(&job.partial, &job.object)?;
        objects.push(job.object);
    }
    Ok(KernelOutcome::Compiled { objects })
}

/// Where compiled code objects are kept by [`cache_key`]: `<target dir>/kernel-cache/`.
pub fn cache_dir() -> PathBuf {
    crate::target_dir().join("kernel-cache")
}

/// The cache key of one compilation: a SHA-256 over everything that decides the object's bytes:
/// the compiler's identity (its version line, its HIP headers and device libraries), the program,
/// every flag (target, defines, include and library locations), the module's source and every
/// header under `kernels/`. The output and source paths are left out: they name where, not what.
pub fn cache_key(
    compiler_identity: &str,
    program: &Path,
    args: &[String],
    source: &[u8],
    headers: &str,
) -> String {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    let mut field = |bytes: &[u8]| {
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    };
    field(b"ember kernel cache v1");
    field(compiler_identity.as_bytes());
    field(program.to_string_lossy().as_bytes());
    for arg in args {
        field(arg.as_bytes());
    }
    field(source);
    field(headers.as_bytes());
    hex::encode(hasher.finalize())
}

/// The names and SHA-256 digests of the headers (`*.h`) in `dir`, sorted: a module's object
/// depends on whichever of them it includes, so a change to any header misses the cache.
fn header_digest(dir: &Path) -> Result<String> {
    use sha2::Digest;
    let mut headers = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "h") {
            let bytes =
                std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
            let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
            headers.push(format!(
                "{}  {}\n",
                hex::encode(sha2::Sha256::digest(&bytes)),
                name.unwrap_or_default()
            ));
        }
    }
    headers.sort();
    Ok(headers.concat())
}

/// Writes a verified object into the cache under a private name, then renames it into place, so
/// a concurrent build never reads half an object.
fn store_in_cache(cached: &Path, bytes: &[u8]) -> Result<()> {
    let dir = cached.parent().context("cache path has a parent")?;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let partial = cached.with_extension(format!("partial-{}", std::process::id()));
    std::fs::write(&partial, bytes).with_context(|| format!("writing {}", partial.display()))?;
    std::fs::rename(&partial, cached).with_context(|| format!("renaming {}", partial.display()))?;
    Ok(())
}

struct CompileJob {
    program: PathBuf,
    args: Vec<String>,
    source: PathBuf,
    partial: PathBuf,
    object: PathBuf,
    /// The object in the cache: copied from when present, filled after a verified compile.
    cached: PathBuf,
}

/// Runs the compile jobs at `priority` on up to `$EMBER_KERNEL_JOBS` (default: the CPU count) threads, copying
/// each object from the cache when it is there; returns the failures as (the job's partial
/// output, the compiler's output).
fn run_jobs(sh: &Shell, jobs: &[&CompileJob], priority: Priority) -> Vec<(PathBuf, String)> {
    let nice = match priority {
        Priority::Normal => None,
        Priority::Background => crate::toolchain::which("nice"),
    };
    let workers = std::env::var("EMBER_KERNEL_JOBS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(usize::from)
                .unwrap_or(1)
        })
        .clamp(1, jobs.len().max(1));
    let cwd = sh.current_dir();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let hits = std::sync::atomic::AtomicUsize::new(0);
    let errors = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers {
            scope.spawn(|| loop {
                let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = jobs.get(index) else { break };
                if job.cached.is_file() && std::fs::copy(&job.cached, &job.partial).is_ok() {
                    hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    continue;
                }
                let mut command = match &nice {
                    Some(nice) => {
                        let mut command = std::process::Command::new(nice);
                        command.args(["-n", "19"]).arg(&job.program);
                        command
                    }
                    None => std::process::Command::new(&job.program),
                };
                if priority == Priority::Normal {
                    eprintln!("$ {} {}", job.program.display(), job.args.join(" "));
                }
                let result = command.args(&job.args).current_dir(&cwd).output();
                let error = match result {
                    Ok(out) if out.status.success() => None,
                    Ok(out) => Some(format!(
                        "compiling {} failed ({}):\n{}{}",
                        job.source.display(),
                        out.status,
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    )),
                    Err(error) => Some(format!("running {}: {error}", job.program.display())),
                };
                if let Some(error) = error {
                    errors
                        .lock()
                        .unwrap_or_else(|poisoned| poisoned.into_inner())
                        .push((job.partial.clone(), error));
                }
            });
        }
    });
    let hits = hits.into_inner();
    if hits > 0 && priority == Priority::Normal {
        println!(
            "kernels: {hits} of {} code object(s) reused from {}",
            jobs.len(),
            cache_dir().display()
        );
    }
    errors
        .into_inner()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

enum Compiler {
    Amdgpu(AmdgpuCompiler),
    Nvcc(Nvcc),
}

fn not_compiled(out_dir: &Path, reason: String) -> Result<KernelOutcome> {
    if out_dir.exists() {
        std::fs::remove_dir_all(out_dir)
            .with_context(|| format!("removing stale {}", out_dir.display()))?;
    }
    Ok(KernelOutcome::NotCompiled { reason })
}

/// The code objects already built for `target` (what `package` ships), sorted.
pub fn built_objects(target: &Target) -> Result<Vec<PathBuf>> {
    let Some(extension) = target.code_object_extension() else {
        return Ok(Vec::new());
    };
    let dir = kernel_out_dir(&target.name);
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut objects = Vec::new();
    for entry in std::fs::read_dir(&dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == extension) {
            let bytes = std::fs::read(&path)?;
            elf::verify_code_object(&bytes, &target.name)
                .with_context(|| format!("checking the architecture of {}", path.display()))?;
            objects.push(path);
        }
    }
    objects.sort();
    Ok(objects)
}

/// Used by tests: the selection a flag set resolves to must exist in `targets`.
#[cfg(test)]
fn resolve(targets: &crate::targets::Targets, selection: Selection) -> Result<Vec<String>> {
    Ok(targets
        .select(&selection)?
        .into_iter()
        .map(|t| t.name.clone())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defines_carry_the_target_settings() {
        let targets = crate::targets::load().unwrap();
        assert_eq!(
            defines(targets.target("gfx1201").unwrap()),
            [
                "-DEMBER_TARGET_NAME=\"gfx1201\"",
                "-DEMBER_WAVE_SIZE=32",
                "-DEMBER_FA_WMMA=1",
                "-DEMBER_FEATURE_PEER_COPY=1",
                "-DEMBER_FEATURE_VMM=0",
            ]
        );
        assert_eq!(
            defines(targets.target("gfx942").unwrap()),
            [
                "-DEMBER_TARGET_NAME=\"gfx942\"",
                "-DEMBER_WAVE_SIZE=64",
                "-DEMBER_FA_MFMA=1",
                "-DEMBER_FEATURE_PEER_COPY=1",
                "-DEMBER_FEATURE_VMM=1",
            ]
        );
    }

    #[test]
    fn cache_key_changes_with_every_input() {
        let args = |define: &str| vec!["-O3".to_string(), define.to_string()];
        let clang = Path::new("/usr/bin/clang++-19");
        let key = cache_key("clang 19", clang, &args("-DX=1"), b"kernel", "h1");
        assert_eq!(key.len(), 64);
        assert_eq!(
            key,
            cache_key("clang 19", clang, &args("-DX=1"), b"kernel", "h1")
        );
        for other in [
            cache_key("clang 20", clang, &args("-DX=1"), b"kernel", "h1"),
            cache_key(
                "clang 19",
                Path::new("/opt/rocm/llvm/bin/clang++"),
                &args("-DX=1"),
                b"kernel",
                "h1",
            ),
            cache_key("clang 19", clang, &args("-DX=0"), b"kernel", "h1"),
            cache_key("clang 19", clang, &args("-DX=1"), b"kernel!", "h1"),
            cache_key("clang 19", clang, &args("-DX=1"), b"kernel", "h2"),
            // Field boundaries count: moving a byte from one field to the next is another key.
            cache_key(
                "clang 19",
                clang,
                &["-O3-DX=1".to_string()],
                b"kernel",
                "h1",
            ),
        ] {
            assert_ne!(key, other);
        }
    }

    #[test]
    fn background_jobs_run_at_the_lowest_priority() {
        let dir = std::env::temp_dir().join(format!("ember-xtask-jobs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let job = |name: &str, script: &str| CompileJob {
            program: PathBuf::from("sh"),
            args: vec!["-c".to_string(), script.to_string()],
            source: dir.join(name),
            partial: dir.join(format!("{name}.partial")),
            object: dir.join(name),
            cached: dir.join(format!("{name}.cached")),
        };
        let sh = Shell::new().unwrap();
        let niceness = job(
            "niceness",
            &format!("nice > {}", dir.join("niceness.partial").display()),
        );
        let failing = job("failing", "echo broken >&2; exit 3");
        let errors = run_jobs(&sh, &[&niceness, &failing], Priority::Background);
        let written = std::fs::read_to_string(dir.join("niceness.partial")).unwrap();
        if crate::toolchain::which("nice").is_some() {
            assert_eq!(written.trim(), "19");
        }
        assert_eq!(errors.len(), 1, "{errors:?}");
        assert_eq!(errors[0].0, failing.partial);
        assert!(errors[0].1.contains("broken"), "{}", errors[0].1);
        let errors = run_jobs(&sh, &[&niceness], Priority::Normal);
        assert!(errors.is_empty(), "{errors:?}");
        let written = std::fs::read_to_string(dir.join("niceness.partial")).unwrap();
        let own = std::process::Command::new("nice").output().unwrap().stdout;
        assert_eq!(written.trim(), String::from_utf8_lossy(&own).trim());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn wrong_target_name_fails_with_the_name() {
        let targets = crate::targets::load().unwrap();
        let error = resolve(&targets, Selection::Target("gfx9999".into()))
            .unwrap_err()
            .to_string();
        assert!(error.contains("unknown target `gfx9999`"), "{error}");
        assert_eq!(
            resolve(&targets, Selection::Family("gfx120X".into())).unwrap(),
            ["gfx1200", "gfx1201"]
        );
    }

    #[test]
    fn cpu_targets_have_no_kernels() {
        let targets = crate::targets::load().unwrap();
        let sh = Shell::new().unwrap();
        let outcome = compile_target(
            &sh,
            &crate::project_root(),
            targets.target("cpu").unwrap(),
            &mut Toolchains::default(),
        );
        assert_eq!(outcome.unwrap(), KernelOutcome::NoKernels);
    }
}
