//! `cargo xtask build --target T [--os linux|windows]`: one target's artifact, end to end:
//! kernels for T, the engine (`cargo build --release`, the same build for every target), a copy of
//! it with T's build manifest written into its manifest slot (`manifest_slot.rs`), then the
//! package in `dist/` under cargo's target directory.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use xshell::{cmd, Shell};

use crate::container::{self, BuildImage};
use crate::kernels::{self, KernelOutcome, Toolchains};
use crate::manifest::{self, BuildInfo, BuildManifest};
use crate::manifest_slot;
use crate::package;
use crate::targets::{Kind, Os, Target, Targets};
use crate::toolchain;

/// The script that installs the Windows cross-compilation toolchain.
pub const SETUP_WINDOWS: &str = ".ci/setup-windows.sh";

impl crate::flags::Build {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let root = crate::project_root();
        let targets = crate::targets::load()?;
        let version = match self.release_version {
            Some(version) => version,
            None => manifest::workspace_version(&root)?,
        };
        let target = targets.target(&self.target)?;
        let image = BuildImage::choose(&targets, self.image, self.build_base);
        let archive = if self.in_container {
            container::build(sh, &root, target, self.os, &version, &image)?
        } else if let Some(reason) = missing_kernel_toolchain(target) {
            // The first command a new user runs must work on a machine with docker and nothing
            // else, and otherwise say both ways forward.
            if self.os == Os::Linux && container::docker_available(sh) {
                println!(
                    "build: no kernel toolchain on this machine ({reason}); building in the build container instead (--in-container)"
                );
                container::build(sh, &root, target, self.os, &version, &image)?
            } else {
                return Err(no_kernel_toolchain(&target.name, &reason));
            }
        } else {
            build(sh, &root, &targets, &self.target, self.os, &version)?
        };
        println!("build: wrote {}", archive.display());
        Ok(())
    }
}

/// The error of a GPU build on a machine with neither a kernel toolchain nor docker: it names
/// both ways forward.
fn no_kernel_toolchain(target: &str, reason: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "cannot build {target}: no AMDGPU kernel compiler on this machine ({reason}); install one with {}, or build in the build container with `--in-container` (needs docker)",
        crate::toolchain::SETUP_KERNELS
    )
}

/// Why this machine cannot compile `target`'s kernels when the reason is that it has no kernel
/// toolchain at all; `None` when it has one (or the target needs none, or is not AMDGPU).
fn missing_kernel_toolchain(target: &Target) -> Option<String> {
    if target.kind != Kind::Amdgpu {
        return None;
    }
    crate::toolchain::AmdgpuCompiler::discover()
        .err()
        .map(|error| {
            // The caller names the ways forward itself; the toolchain's own hint would repeat one.
            let reason = format!("{error:#}");
            let hint = format!(": run {}", crate::toolchain::SETUP_KERNELS);
            reason.replace(&hint, "")
        })
}

/// Builds and packages `target` for `os`; returns the archive's path.
pub fn build(
    sh: &Shell,
    root: &Path,
    targets: &Targets,
    target: &str,
    os: Os,
    version: &str,
) -> Result<PathBuf> {
    let target = targets.target(target)?;
    if !target.supports(os) {
        bail!(
            "target {} is not built for {os}: targets.toml gives it platforms {:?}",
            target.name,
            target
                .platforms
                .iter()
                .map(|o| o.name())
                .collect::<Vec<_>>()
        );
    }
    let platform = targets.platform(os)?;
    check_rust_target(os, &platform.rust_target)?;

    println!("build: kernels for {}", target.name);
    let mut toolchains = Toolchains::default();
    let modules = match kernels::compile_target(sh, root, target, &mut toolchains)? {
        KernelOutcome::Compiled { objects } => objects
            .iter()
            .filter_map(|p| p.file_name()?.to_str().map(str::to_string))
            .collect(),
        KernelOutcome::NoKernels => Vec::new(),
        KernelOutcome::NotCompiled { reason } => {
            bail!(
                "cannot build {}: its kernels are not compiled: {reason}",
                target.name
            )
        }
    };

    let manifest = build_manifest(root, targets, target, os, version, modules, &mut toolchains)?;
    let manifest_path = manifest::manifest_path(os, &target.name);
    std::fs::create_dir_all(
        manifest_path
            .parent()
            .context("manifest path has a parent")?,
    )?;
    std::fs::write(&manifest_path, manifest.to_json())
        .with_context(|| format!("writing {}", manifest_path.display()))?;

    println!("build: engine for {os}");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let cross: Vec<String> = match os {
        Os::Linux => Vec::new(),
        Os::Windows => vec!["--target".to_string(), platform.rust_target.clone()],
    };
    cmd!(
        sh,
        "{cargo} build --release -p ember --bin ember {cross...}"
    )
    .env("CARGO_ENCODED_RUSTFLAGS", encoded_rustflags(root)?)
    .env("CFLAGS", c_flags(root, "CFLAGS")?)
    .env("CXXFLAGS", c_flags(root, "CXXFLAGS")?)
    .run()
    .with_context(|| format!("building the engine for {os}"))?;
    let binary = package::engine_binary(&crate::target_dir(), os, &platform.rust_target);
    if !binary.is_file() {
        bail!(
            "cargo built the engine for {os} but left no executable at {}: is cargo's target directory (`cargo metadata`'s target_directory) the one this build wrote to?",
            binary.display()
        );
    }
    let stamped = package::stamped_binary(os, &target.name);
    manifest_slot::stamp(&binary, &stamped, &manifest.to_json())?;
    println!(
        "build: {} carries the {} manifest ({})",
        stamped.display(),
        target.name,
        manifest_path.display()
    );

    package::package(root, target, os, version, manifest)
}

/// The places on this machine whose paths a build could leak into its artifacts, with what
/// [`remap_flags`] maps each to: the workspace root, cargo's target directory (build-script
/// output, when it is not under the root) and cargo's home (the registry sources).
pub fn build_paths(root: &Path) -> Result<Vec<(PathBuf, &'static str)>> {
    let cargo_home = match std::env::var_os("CARGO_HOME") {
        Some(home) => PathBuf::from(home),
        None => {
            PathBuf::from(std::env::var_os("HOME").context("neither CARGO_HOME nor HOME is set")?)
                .join(".cargo")
        }
    };
    Ok(vec![
        (root.to_path_buf(), "/ember"),
        (crate::target_dir(), "/ember/target"),
        (cargo_home, "/cargo"),
    ])
}

/// The flags that keep this machine's paths out of the binary (see [`build_paths`]), in panic
/// locations and debug line tables alike, so two checkouts in different places build the same
/// bytes. rustc applies the last matching remapping, so the target directory, which is usually
/// under the root, comes after it.
pub fn remap_flags(root: &Path) -> Result<Vec<String>> {
    Ok(build_paths(root)?
        .into_iter()
        .map(|(from, to)| format!("--remap-path-prefix={}={to}", from.display()))
        .collect())
}

/// The caller's rustflags (`CARGO_ENCODED_RUSTFLAGS`, else `RUSTFLAGS`) followed by whichever
/// [`remap_flags`] they lack, in cargo's `CARGO_ENCODED_RUSTFLAGS` form. `.ci/run` exports the
/// same flags as `RUSTFLAGS`, so its test build and these builds compile the engine once.
pub fn encoded_rustflags(root: &Path) -> Result<String> {
    let mut flags: Vec<String> = match std::env::var("CARGO_ENCODED_RUSTFLAGS") {
        Ok(encoded) if !encoded.is_empty() => encoded.split('\x1f').map(str::to_string).collect(),
        _ => std::env::var("RUSTFLAGS")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect(),
    };
    for flag in remap_flags(root)? {
        if !flags.contains(&flag) {
            flags.push(flag);
        }
    }
    Ok(flags.join("\x1f"))
}

/// The caller's `var` (`CFLAGS` or `CXXFLAGS`) followed by whichever `-ffile-prefix-map` flags
/// for [`build_paths`] it lacks: C and C++ code that crates compile in their build scripts (`cc`
/// reads these variables) embeds source paths too (`__FILE__`, debug line tables), which rustc's
/// remapping does not reach. `.ci/run` exports the same flags, so the build scripts do not run
/// again for these builds.
pub fn c_flags(root: &Path, var: &str) -> Result<String> {
    let mut flags: Vec<String> = std::env::var(var)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect();
    for (from, to) in build_paths(root)? {
        let flag = format!("-ffile-prefix-map={}={to}", from.display());
        if !flags.contains(&flag) {
            flags.push(flag);
        }
    }
    Ok(flags.join(" "))
}

/// The manifest of this build: targets.toml's view of `target` plus the build environment.
pub fn build_manifest(
    root: &Path,
    targets: &Targets,
    target: &Target,
    os: Os,
    version: &str,
    kernel_modules: Vec<String>,
    toolchains: &mut Toolchains,
) -> Result<BuildManifest> {
    let (commit, dirty) = manifest::git_state(root);
    let toolchain_rocm = match target.kind {
        crate::targets::Kind::Amdgpu => toolchains.amdgpu().ok().and_then(|c| c.rocm_version()),
        _ => None,
    };
    let info = BuildInfo {
        version: version.to_string(),
        commit,
        dirty,
        rustc: toolchain::rustc_version()?,
        kernel_compiler: toolchains.describe(target),
        toolchain_rocm,
        kernel_modules,
        dependencies: crate::sbom::engine_crates(root, &targets.platform(os)?.rust_target)?
            .iter()
            .map(crate::sbom::Crate::id)
            .collect(),
    };
    BuildManifest::new(targets, target, os, info)
}

/// A Windows build needs the Rust standard library for the target and MinGW's linker.
fn check_rust_target(os: Os, rust_target: &str) -> Result<()> {
    if os == Os::Linux {
        return Ok(());
    }
    if !toolchain::rust_target_installed(rust_target)? {
        bail!("the Rust target {rust_target} is not installed (rustup target add {rust_target}): run {SETUP_WINDOWS}");
    }
    // On a Linux host Rust links windows-gnu binaries with MinGW's cross gcc; a Windows host
    // (the release runners) links with its own `gcc`.
    if !cfg!(windows) && toolchain::which("x86_64-w64-mingw32-gcc").is_none() {
        bail!("x86_64-w64-mingw32-gcc (Debian's gcc-mingw-w64-x86-64) not found on PATH: run {SETUP_WINDOWS}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_gpu_build_without_toolchain_or_docker_names_both_ways_forward() {
        let message =
            super::no_kernel_toolchain("gfx1201", "no AMDGPU kernel compiler found").to_string();
        assert!(message.contains("cannot build gfx1201"), "{message}");
        assert!(message.contains("`cargo xtask setup`"), "{message}");
        assert!(message.contains("`--in-container`"), "{message}");
        // Never the command the user just ran.
        assert!(!message.contains("cargo xtask build"), "{message}");
    }
}
