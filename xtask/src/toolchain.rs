//! Finding the compilers: the AMDGPU kernel compiler (ROCm's clang, or Debian's clang-19 with
//! the HIP headers of libamdhip64-dev and the device libraries `.ci/setup-kernels.sh` assembles),
//! nvcc for `sm_*` targets, and the version strings the build manifest records.
//!
//! Discovery never guesses silently: a target the found compiler cannot build gets a reason
//! ("needs LLVM >= 20 (found clang 19)"), and a missing compiler is an error naming the setup
//! script that installs it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::targets::Target;

/// The script that installs the AMDGPU kernel toolchain.
pub const SETUP_KERNELS: &str = "`cargo xtask setup` (.ci/setup-kernels.sh)";

/// Where the AMDGPU compiler came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AmdgpuSource {
    /// A ROCm install (`$ROCM_PATH`, `/opt/rocm`) or the Windows HIP SDK (`$HIP_PATH`).
    Rocm {
        rocm_path: PathBuf,
        rocm_version: Option<String>,
    },
    /// Debian's clang with the HIP headers under `hip_root` and device libraries in `device_libs`.
    Debian {
        hip_root: PathBuf,
        device_libs: PathBuf,
    },
}

/// A clang that can compile HIP for AMDGPU targets.
#[derive(Debug, Clone)]
pub struct AmdgpuCompiler {
    pub clang: PathBuf,
    pub source: AmdgpuSource,
    /// `clang --version`'s first line.
    pub version: String,
    pub llvm_major: u32,
    /// The processors this clang knows (`--print-supported-cpus`).
    pub supported: BTreeSet<String>,
}

impl AmdgpuCompiler {
    /// Finds the AMDGPU compiler: `$ROCM_PATH` (or /opt/rocm), `$HIP_PATH` (Windows HIP SDK),
    /// then Debian's clang-19 (or `$EMBER_CLANG`) with HIP headers and device libraries.
    pub fn discover() -> Result<AmdgpuCompiler> {
        let mut looked = Vec::new();
        let rocm_roots = [
            std::env::var_os("ROCM_PATH"),
            Some("/opt/rocm".into()),
            std::env::var_os("HIP_PATH"),
        ];
        for root in rocm_roots.into_iter().flatten() {
            let root = PathBuf::from(root);
            let clang = root.join("llvm").join("bin").join(exe("clang++"));
            let clang = if clang.is_file() {
                clang
            } else {
                root.join("bin").join(exe("clang++"))
            };
            looked.push(clang.display().to_string());
            if clang.is_file() {
                let rocm_version = std::fs::read_to_string(root.join(".info").join("version"))
                    .ok()
                    .map(|v| v.trim().to_string());
                return AmdgpuCompiler::probe(
                    clang,
                    AmdgpuSource::Rocm {
                        rocm_path: root,
                        rocm_version,
                    },
                );
            }
        }
        let clang = std::env::var_os("EMBER_CLANG")
            .map(PathBuf::from)
            .or_else(|| which("clang++-19"));
        looked.push("clang++-19 on PATH (or $EMBER_CLANG)".to_string());
        let Some(clang) = clang else {
            bail!(
                "no AMDGPU kernel compiler found (looked for {}): run {SETUP_KERNELS}",
                looked.join(", ")
            );
        };
        let hip_root = PathBuf::from("/usr");
        if !hip_root.join("include/hip/hip_runtime.h").is_file() {
            bail!(
                "found {} but no HIP headers (expected /usr/include/hip/hip_runtime.h from libamdhip64-dev): run {SETUP_KERNELS}",
                clang.display()
            );
        }
        let device_libs = device_libs_dir()?;
        AmdgpuCompiler::probe(
            clang,
            AmdgpuSource::Debian {
                hip_root,
                device_libs,
            },
        )
    }

    fn probe(clang: PathBuf, source: AmdgpuSource) -> Result<AmdgpuCompiler> {
        let version = first_line(&output(Command::new(&clang).arg("--version"))?);
        let llvm_major = llvm_major(&version).with_context(|| {
            format!(
                "expected `clang version N.M` from {} --version, found {version:?}",
                clang.display()
            )
        })?;
        // clang prints the processor list on stderr.
        let cpus = output_and_errors(Command::new(&clang).args([
            "--target=amdgcn-amd-amdhsa",
            "-nogpulib",
            "--print-supported-cpus",
        ]))?;
        let supported = parse_supported_cpus(&cpus);
        Ok(AmdgpuCompiler {
            clang,
            source,
            version,
            llvm_major,
            supported,
        })
    }

    /// `Ok` when this compiler can build `target`, else the reason it cannot.
    pub fn can_compile(&self, target: &Target) -> Result<(), String> {
        if !self.supported.contains(&target.name) {
            return Err(match target.min_llvm {
                Some(min) if min > self.llvm_major => {
                    format!("needs LLVM >= {min} (found clang {})", self.llvm_major)
                }
                _ => format!("{} does not know {}", self.version, target.name),
            });
        }
        if let AmdgpuSource::Debian { device_libs, .. } = &self.source {
            let isa = device_libs.join(isa_version_library(&target.name));
            if !isa.is_file() {
                return Err(format!(
                    "device library {} missing from {} (run {SETUP_KERNELS})",
                    isa_version_library(&target.name),
                    device_libs.display()
                ));
            }
        }
        Ok(())
    }

    /// The compiler's arguments that locate HIP headers and device libraries.
    pub fn location_args(&self) -> Vec<String> {
        match &self.source {
            AmdgpuSource::Rocm { rocm_path, .. } => {
                vec![format!("--rocm-path={}", rocm_path.display())]
            }
            AmdgpuSource::Debian {
                hip_root,
                device_libs,
            } => vec![
                format!("--rocm-path={}", hip_root.display()),
                format!("--rocm-device-lib-path={}", device_libs.display()),
            ],
        }
    }

    /// The ROCm version of the install the compiler came from, if it came from one.
    pub fn rocm_version(&self) -> Option<String> {
        match &self.source {
            AmdgpuSource::Rocm { rocm_version, .. } => rocm_version.clone(),
            AmdgpuSource::Debian { .. } => None,
        }
    }

    /// One line for logs and the manifest.
    pub fn describe(&self) -> String {
        match &self.source {
            AmdgpuSource::Rocm {
                rocm_path,
                rocm_version,
            } => format!(
                "{} (ROCm {} at {})",
                self.version,
                rocm_version.as_deref().unwrap_or("of unknown version"),
                rocm_path.display()
            ),
            AmdgpuSource::Debian {
                hip_root,
                device_libs,
            } => {
                let source =
                    std::fs::read_to_string(device_libs.join(".source")).unwrap_or_default();
                let headers = std::fs::read_to_string(hip_root.join("include/hip/hip_version.h"))
                    .ok()
                    .and_then(|text| hip_header_version(&text))
                    .unwrap_or_else(|| "of unknown version".to_string());
                format!(
                    "{} with Debian's HIP headers {headers} and device libraries {}",
                    self.version,
                    source.trim().strip_suffix(".deb").unwrap_or("(unrecorded)")
                )
            }
        }
    }
}

/// `5.2.21153` from hip_version.h's HIP_VERSION_MAJOR/MINOR/PATCH defines.
pub fn hip_header_version(text: &str) -> Option<String> {
    let define = |name: &str| {
        text.lines().find_map(|line| {
            let rest = line.trim().strip_prefix("#define ")?.strip_prefix(name)?;
            let value = rest.trim();
            value
                .chars()
                .all(|c| c.is_ascii_digit())
                .then(|| value.to_string())
                .filter(|v| !v.is_empty())
        })
    };
    Some(format!(
        "{}.{}.{}",
        define("HIP_VERSION_MAJOR")?,
        define("HIP_VERSION_MINOR")?,
        define("HIP_VERSION_PATCH")?
    ))
}

/// nvcc, for `sm_*` targets.
#[derive(Debug, Clone)]
pub struct Nvcc {
    pub path: PathBuf,
    pub version: String,
}

impl Nvcc {
    /// Finds nvcc on PATH, in `$CUDA_PATH/bin` or `/usr/local/cuda/bin`; `None` when absent.
    pub fn discover() -> Result<Option<Nvcc>> {
        let candidates = [
            which("nvcc"),
            std::env::var_os("CUDA_PATH").map(|p| PathBuf::from(p).join("bin").join(exe("nvcc"))),
            Some(PathBuf::from("/usr/local/cuda/bin/nvcc")),
        ];
        for path in candidates.into_iter().flatten() {
            if path.is_file() {
                let text = output(Command::new(&path).arg("--version"))?;
                let version = text
                    .lines()
                    .find(|line| line.contains("release"))
                    .map(|line| line.trim().to_string())
                    .unwrap_or_else(|| first_line(&text));
                return Ok(Some(Nvcc { path, version }));
            }
        }
        Ok(None)
    }
}

/// The device-library directory for Debian's clang: `$EMBER_DEVICE_LIBS`, else the one
/// `.ci/setup-kernels.sh` assembles in the toolchain cache.
pub fn device_libs_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("EMBER_DEVICE_LIBS") {
        let dir = PathBuf::from(dir);
        if !dir.join("ocml.bc").is_file() {
            bail!(
                "EMBER_DEVICE_LIBS={} holds no ocml.bc: expected a ROCm device-library directory",
                dir.display()
            );
        }
        return Ok(dir);
    }
    let dir = toolchain_cache_dir()?.join("rocm-device-libs");
    if !dir.join(".complete").is_file() {
        bail!(
            "no ROCm device libraries in {} (the directory .ci/setup-kernels.sh assembles): run {SETUP_KERNELS}",
            dir.display()
        );
    }
    Ok(dir)
}

/// `$EMBER_TOOLCHAIN_DIR`, else `${XDG_CACHE_HOME:-~/.cache}/ember/toolchain` (as the setup script).
pub fn toolchain_cache_dir() -> Result<PathBuf> {
    if let Some(dir) = std::env::var_os("EMBER_TOOLCHAIN_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let cache = match std::env::var_os("XDG_CACHE_HOME") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(
            std::env::var_os("HOME").context("expected $HOME to be set, found nothing")?,
        )
        .join(".cache"),
    };
    Ok(cache.join("ember").join("toolchain"))
}

/// The script that installs actionlint.
pub const SETUP_ACTIONLINT: &str = ".ci/setup-actionlint.sh";

/// actionlint: on PATH, else where `.ci/setup-actionlint.sh` installs it.
pub fn actionlint() -> Option<PathBuf> {
    which("actionlint").or_else(|| {
        let path = toolchain_cache_dir()
            .ok()?
            .join("actionlint")
            .join("bin")
            .join(exe("actionlint"));
        path.is_file().then_some(path)
    })
}

/// `gfx1201` -> `oclc_isa_version_1201.bc`.
pub fn isa_version_library(target: &str) -> String {
    format!("oclc_isa_version_{}.bc", target.trim_start_matches("gfx"))
}

/// `rustc --version`.
pub fn rustc_version() -> Result<String> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    Ok(first_line(&output(Command::new(rustc).arg("--version"))?))
}

/// `rustc --print sysroot`: where the active Rust toolchain lives.
pub fn rustc_sysroot() -> Result<PathBuf> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    Ok(PathBuf::from(
        output(Command::new(rustc).args(["--print", "sysroot"]))?.trim(),
    ))
}

/// Finds an executable on PATH.
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(exe(name)))
        .find(|candidate| candidate.is_file())
}

fn exe(name: &str) -> String {
    if cfg!(windows) {
        format!("{name}.exe")
    } else {
        name.to_string()
    }
}

fn output(command: &mut Command) -> Result<String> {
    let program = command.get_program().to_string_lossy().into_owned();
    let out = command
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Like [`output`], but stdout and stderr together.
fn output_and_errors(command: &mut Command) -> Result<String> {
    let program = command.get_program().to_string_lossy().into_owned();
    let out = command
        .output()
        .with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!(
            "{program} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or("").trim().to_string()
}

/// `Debian clang version 19.1.7 (3~deb12u1)` -> 19; ROCm's `AMD clang version 19.0.0git` -> 19.
pub fn llvm_major(version_line: &str) -> Option<u32> {
    let rest = &version_line[version_line.find("clang version ")? + "clang version ".len()..];
    rest.split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// The gfx processor names in `clang --print-supported-cpus` output.
pub fn parse_supported_cpus(text: &str) -> BTreeSet<String> {
    text.split_whitespace()
        .filter(|word| {
            word.starts_with("gfx")
                && word[3..].chars().all(|c| c.is_ascii_hexdigit())
                && word.len() > 3
        })
        .map(str::to_string)
        .collect()
}

/// Finds the directory of the current Rust toolchain's standard library for `rust_target`, to
/// tell whether `rustup target add` has been run.
pub fn rust_target_installed(rust_target: &str) -> Result<bool> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let sysroot = output(Command::new(rustc).args(["--print", "sysroot"]))?;
    Ok(Path::new(sysroot.trim())
        .join("lib")
        .join("rustlib")
        .join(rust_target)
        .join("lib")
        .is_dir())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llvm_major_from_version_lines() {
        assert_eq!(
            llvm_major("Debian clang version 19.1.7 (3~deb12u1)"),
            Some(19)
        );
        assert_eq!(llvm_major("AMD clang version 20.0.0git (https://github.com/RadeonOpenCompute/llvm-project roc-7.0.0)"), Some(20));
        assert_eq!(llvm_major("gcc (Debian 12.2.0-14) 12.2.0"), None);
    }

    #[test]
    fn hip_header_versions() {
        let text = "// generated\n#define HIP_VERSION_MAJOR 5\n#define HIP_VERSION_MINOR 2\n#define HIP_VERSION_PATCH 21153\n#define HIP_VERSION_GITHASH \"abc\"\n";
        assert_eq!(hip_header_version(text).as_deref(), Some("5.2.21153"));
        assert_eq!(hip_header_version("#define HIP_VERSION_MAJOR 5\n"), None);
    }

    #[test]
    fn supported_cpus_keep_concrete_processors_only() {
        let text = "Available CPUs for this target:\n\n\tgfx10\n\tgfx1030\n\tgfx11\n\tgfx1201\n\tgfx90a\n\tgfx942\n\ttahiti\n\nUse -mcpu or -mtune";
        let cpus = parse_supported_cpus(text);
        assert_eq!(
            cpus.into_iter().collect::<Vec<_>>(),
            ["gfx10", "gfx1030", "gfx11", "gfx1201", "gfx90a", "gfx942"]
        );
    }

    #[test]
    fn reasons_for_targets_the_compiler_cannot_build() {
        let targets = crate::targets::load().unwrap();
        let dir = std::env::temp_dir().join(format!("ember-xtask-devlibs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("oclc_isa_version_1151.bc"), b"").unwrap();
        let compiler = AmdgpuCompiler {
            clang: PathBuf::from("clang++-19"),
            source: AmdgpuSource::Debian {
                hip_root: "/usr".into(),
                device_libs: dir.clone(),
            },
            version: "Debian clang version 19.1.7".into(),
            llvm_major: 19,
            supported: ["gfx1151", "gfx1201"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
        };
        assert_eq!(
            compiler.can_compile(targets.target("gfx1151").unwrap()),
            Ok(())
        );
        assert_eq!(
            compiler.can_compile(targets.target("gfx950").unwrap()),
            Err("needs LLVM >= 20 (found clang 19)".to_string())
        );
        assert_eq!(
            compiler.can_compile(targets.target("gfx1201").unwrap()),
            Err(format!(
                "device library oclc_isa_version_1201.bc missing from {} (run `cargo xtask setup` (.ci/setup-kernels.sh))",
                dir.display()
            ))
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
