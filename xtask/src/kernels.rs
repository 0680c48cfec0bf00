//! `cargo xtask kernels`: compiles `kernels/*.hip` into one code object per module and target,
//! `target/kernels/<target>/<module>.hsaco` (AMDGPU) or `.cubin` (NVIDIA), and verifies that each
//! object's ELF header names the requested architecture.
//!
//! The target's settings reach the kernel sources as preprocessor defines (see [`defines`]), so a
//! kernel can pick its flash-attention flavour and wave size at compile time. A target the found
//! toolchain cannot build is reported as not compiled, with the reason, never skipped silently.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use xshell::{cmd, Shell};

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
        for target in &selected {
            match compile_target(sh, &root, target, &mut toolchains) {
                Ok(KernelOutcome::Compiled { objects }) => {
                    rows.push(format!("  {:<8} compiled {} code object(s), architecture verified", target.name, objects.len()))
                }
                Ok(KernelOutcome::NotCompiled { reason }) => {
                    rows.push(format!("  {:<8} not compiled: {reason}", target.name));
                    if matches!(selection, Selection::Target(_)) {
                        failures.push(format!("{}: not compiled: {reason}", target.name));
                    }
                }
                Ok(KernelOutcome::NoKernels) => rows.push(format!("  {:<8} no kernels (CPU target)", target.name)),
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
            bail!("kernels failed for {} target(s):\n  {}", failures.len(), failures.join("\n  "));
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
pub fn kernel_out_dir(root: &Path, target: &str) -> PathBuf {
    root.join("target").join("kernels").join(target)
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
        defines.push(format!("-DEMBER_FEATURE_{}={}", feature.name.to_uppercase(), u8::from(feature.enabled())));
    }
    defines
}

/// Compiles every kernel module for `target` into [`kernel_out_dir`], replacing what was there.
pub fn compile_target(sh: &Shell, root: &Path, target: &Target, toolchains: &mut Toolchains) -> Result<KernelOutcome> {
    if target.kind == Kind::Cpu {
        return Ok(KernelOutcome::NoKernels);
    }
    let sources = sources(root)?;
    if sources.is_empty() {
        bail!("no kernel sources (kernels/*.hip) to compile for {}", target.name);
    }
    let out_dir = kernel_out_dir(root, &target.name);
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
                Err(reason) => return not_compiled(&out_dir, reason),
            },
            Err(error) => bail!("{error}"),
        },
        Kind::Nvidia => match toolchains.nvcc()? {
            Some(nvcc) => Compiler::Nvcc(nvcc.clone()),
            None => return not_compiled(&out_dir, "nvcc not found".to_string()),
        },
        Kind::Cpu => unreachable!("handled above"),
    };
    if out_dir.exists() {
        std::fs::remove_dir_all(&out_dir).with_context(|| format!("removing {}", out_dir.display()))?;
    }
    std::fs::create_dir_all(&out_dir)?;

    let mut objects = Vec::new();
    for source in &sources {
        let module = source.file_stem().and_then(|s| s.to_str()).context("kernel file name is not UTF-8")?;
        let object = out_dir.join(format!("{module}.{extension}"));
        let partial = out_dir.join(format!("{module}.{extension}.partial"));
        let name = &target.name;
        let defines_ref = &defines;
        match &compiler {
            Compiler::Amdgpu(compiler) => {
                let clang = &compiler.clang;
                let location = compiler.location_args();
                let wave = if target.wave_size == Some(64) && !name.starts_with("gfx9") {
                    vec!["-mwavefrontsize64".to_string()]
                } else {
                    Vec::new()
                };
                cmd!(
                    sh,
                    "{clang} -x hip --offload-arch={name} --cuda-device-only --no-gpu-bundle-output -O3 -std=c++17 {location...} {wave...} {include_arg} {defines_ref...} -o {partial} {source}"
                )
                .run()
                .with_context(|| format!("compiling {} for {name}", source.display()))?;
            }
            Compiler::Nvcc(nvcc) => {
                let nvcc = &nvcc.path;
                let arch = format!("-arch={name}");
                cmd!(sh, "{nvcc} -cubin {arch} -O3 -std=c++17 -x cu {include_arg} {defines_ref...} -o {partial} {source}")
                    .run()
                    .with_context(|| format!("compiling {} for {name}", source.display()))?;
            }
        }
        let bytes = std::fs::read(&partial).with_context(|| format!("reading {}", partial.display()))?;
        elf::verify_code_object(&bytes, name)
            .with_context(|| format!("checking the architecture of {}", object.display()))?;
        std::fs::rename(&partial, &object)?;
        objects.push(object);
    }
    Ok(KernelOutcome::Compiled { objects })
}

enum Compiler {
    Amdgpu(AmdgpuCompiler),
    Nvcc(Nvcc),
}

fn not_compiled(out_dir: &Path, reason: String) -> Result<KernelOutcome> {
    if out_dir.exists() {
        std::fs::remove_dir_all(out_dir).with_context(|| format!("removing stale {}", out_dir.display()))?;
    }
    Ok(KernelOutcome::NotCompiled { reason })
}

/// The code objects already built for `target` (what `package` ships), sorted.
pub fn built_objects(root: &Path, target: &Target) -> Result<Vec<PathBuf>> {
    let Some(extension) = target.code_object_extension() else {
        return Ok(Vec::new());
    };
    let dir = kernel_out_dir(root, &target.name);
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
    Ok(targets.select(&selection)?.into_iter().map(|t| t.name.clone()).collect())
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
    fn wrong_target_name_fails_with_the_name() {
        let targets = crate::targets::load().unwrap();
        let error = resolve(&targets, Selection::Target("gfx9999".into())).unwrap_err().to_string();
        assert!(error.contains("unknown target `gfx9999`"), "{error}");
        assert_eq!(resolve(&targets, Selection::Family("gfx120X".into())).unwrap(), ["gfx1200", "gfx1201"]);
    }

    #[test]
    fn cpu_targets_have_no_kernels() {
        let targets = crate::targets::load().unwrap();
        let sh = Shell::new().unwrap();
        let outcome = compile_target(&sh, &crate::project_root(), targets.target("cpu").unwrap(), &mut Toolchains::default());
        assert_eq!(outcome.unwrap(), KernelOutcome::NoKernels);
    }
}
