//! The build manifest: what a build of one target is (target, family, wave size, features with
//! state, reason and tracking links, ROCm, engine commit, toolchain versions, kernels).
//!
//! `cargo xtask build` writes it to `manifests/<os>-<target>.json` under cargo's target directory
//! and into the engine binary's manifest slot (`manifest_slot.rs`), where `ember info` and the
//! engine read it (engine/src/build_manifest.rs reads the same JSON). The package's `manifest.json` is this
//! manifest plus the checksums of the files in the archive.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::targets::{Feature, FeatureState, Kind, Os, Target, Targets};

/// Bumped when a field changes meaning; the engine checks it.
pub const MANIFEST_SCHEMA: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildManifest {
    pub schema: u32,
    /// False for every manifest xtask writes; engine/build.rs writes `true` for plain cargo builds.
    pub development_build: bool,
    pub target: String,
    pub kind: Kind,
    pub family: String,
    pub family_description: String,
    pub os: Os,
    pub wave_size: Option<u32>,
    pub flash_attention: Option<String>,
    pub features: Vec<FeatureRecord>,
    pub rocm: RocmRecord,
    pub engine: EngineRecord,
    pub toolchain: ToolchainRecord,
    pub kernels: KernelsRecord,
    /// The crates compiled into the engine binary, `name@version`, sorted: the list the release's
    /// SBOM is checked against (`cargo xtask verify`), in the spirit of `cargo auditable`.
    /// Empty in manifests written before the list existed.
    #[serde(default)]
    pub dependencies: Vec<String>,
}

/// One feature gate as the engine reads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FeatureRecord {
    pub name: String,
    /// `on`, `off` or `unsupported`.
    pub state: String,
    /// Whether the engine uses it by default (`state == "on"`).
    pub enabled: bool,
    pub reason: Option<String>,
    pub tracking: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RocmRecord {
    /// The ROCm release (from targets.toml) this build is made for; `None` for CPU and NVIDIA.
    pub release: Option<String>,
    /// The ROCm install the kernel compiler came from; `None` when it was Debian's clang.
    pub toolchain_rocm: Option<String>,
    /// The HIP runtime libraries the engine tries to load, in order.
    pub hip_runtime: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineRecord {
    pub version: String,
    pub commit: Option<String>,
    /// Whether the working tree had uncommitted changes.
    pub dirty: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolchainRecord {
    pub rustc: String,
    pub rust_target: String,
    /// The kernel compiler's description; `None` for CPU targets.
    pub kernel_compiler: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelsRecord {
    /// Where the code objects sit relative to the executable: `kernels/<target>`.
    pub dir: Option<String>,
    /// Module file names.
    pub modules: Vec<String>,
}

/// What the build environment contributes (everything targets.toml does not say).
#[derive(Debug, Clone)]
pub struct BuildInfo {
    pub version: String,
    pub commit: Option<String>,
    pub dirty: bool,
    pub rustc: String,
    pub kernel_compiler: Option<String>,
    pub toolchain_rocm: Option<String>,
    pub kernel_modules: Vec<String>,
    /// `name@version` of every crate linked into the engine (see `sbom::engine_crates`).
    pub dependencies: Vec<String>,
}

impl FeatureRecord {
    pub fn from_feature(feature: &Feature) -> FeatureRecord {
        FeatureRecord {
            name: feature.name.clone(),
            state: feature.state.name().to_string(),
            enabled: feature.state == FeatureState::On,
            reason: feature.reason.clone(),
            tracking: feature.tracking.clone(),
        }
    }
}

impl BuildManifest {
    /// The manifest of `target` built for `os`.
    pub fn new(
        targets: &Targets,
        target: &Target,
        os: Os,
        info: BuildInfo,
    ) -> Result<BuildManifest> {
        let platform = targets.platform(os)?;
        let (release, hip_runtime) = match target.kind {
            Kind::Amdgpu => (
                Some(targets.default_rocm().version.clone()),
                platform.hip_runtime_libs.clone(),
            ),
            Kind::Cpu | Kind::Nvidia => (None, Vec::new()),
        };
        let kernels_dir = match target.kind {
            Kind::Cpu => None,
            Kind::Amdgpu | Kind::Nvidia => Some(format!("kernels/{}", target.name)),
        };
        Ok(BuildManifest {
            schema: MANIFEST_SCHEMA,
            development_build: false,
            target: target.name.clone(),
            kind: target.kind,
            family: target.family.clone(),
            family_description: target.family_description.clone(),
            os,
            wave_size: target.wave_size,
            flash_attention: target.flash_attention.map(|f| f.name().to_string()),
            features: target
                .features
                .iter()
                .map(FeatureRecord::from_feature)
                .collect(),
            rocm: RocmRecord {
                release,
                toolchain_rocm: info.toolchain_rocm,
                hip_runtime,
            },
            engine: EngineRecord {
                version: info.version,
                commit: info.commit,
                dirty: info.dirty,
            },
            toolchain: ToolchainRecord {
                rustc: info.rustc,
                rust_target: platform.rust_target.clone(),
                kernel_compiler: info.kernel_compiler,
            },
            kernels: KernelsRecord {
                dir: kernels_dir,
                modules: info.kernel_modules,
            },
            dependencies: info.dependencies,
        })
    }

    pub fn to_json(&self) -> String {
        // Serialising these plain structs cannot fail.
        let mut json = serde_json::to_string_pretty(self).unwrap_or_default();
        json.push('\n');
        json
    }

    pub fn feature(&self, name: &str) -> Option<&FeatureRecord> {
        self.features.iter().find(|f| f.name == name)
    }
}

/// `manifest.json` in a package: the build manifest and the archive's files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackageManifest {
    #[serde(flatten)]
    pub build: BuildManifest,
    /// The archive's file name.
    pub archive: String,
    /// Every file of the package except manifest.json and SHA256SUMS, sorted by path.
    pub files: Vec<FileRecord>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Relative to the package root, with `/` separators.
    pub path: String,
    pub sha256: String,
    pub bytes: u64,
}

/// Where `cargo xtask build` writes a target's manifest for the engine build.
pub fn manifest_path(os: Os, target: &str) -> PathBuf {
    crate::target_dir()
        .join("manifests")
        .join(format!("{os}-{target}.json"))
}

/// The current commit and whether the tree is dirty; `None` outside a git checkout.
pub fn git_state(root: &Path) -> (Option<String>, bool) {
    // A container build (container.rs) has the checkout but not always its git directory (a
    // worktree's lives elsewhere) nor git itself: the host passes what it read.
    if let Ok(commit) = std::env::var("EMBER_BUILD_COMMIT") {
        let dirty = std::env::var("EMBER_BUILD_DIRTY").is_ok_and(|d| d == "true");
        return ((!commit.is_empty()).then_some(commit), dirty);
    }
    let run = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let commit = run(&["rev-parse", "HEAD"]);
    let dirty =
        run(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
    (commit, dirty)
}

/// The workspace version from the root Cargo.toml.
pub fn workspace_version(root: &Path) -> Result<String> {
    let path = root.join("Cargo.toml");
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let manifest: toml::Table =
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    manifest
        .get("workspace")
        .and_then(|w| w.get("package"))
        .and_then(|p| p.get("version"))
        .and_then(toml::Value::as_str)
        .map(str::to_string)
        .with_context(|| {
            format!(
                "expected [workspace.package] version in {}, found none",
                path.display()
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> BuildInfo {
        BuildInfo {
            version: "0.1.0".into(),
            commit: Some("0123456789abcdef0123456789abcdef01234567".into()),
            dirty: false,
            rustc: "rustc 1.90.0".into(),
            kernel_compiler: Some("Debian clang version 19.1.7".into()),
            toolchain_rocm: None,
            kernel_modules: vec!["attention.hsaco".into()],
            dependencies: vec!["ember@0.1.0".into(), "half@2.4.1".into()],
        }
    }

    fn manifest(target: &str, os: Os) -> BuildManifest {
        let targets = crate::targets::load().unwrap();
        BuildManifest::new(&targets, targets.target(target).unwrap(), os, info()).unwrap()
    }

    #[test]
    fn gfx1201_manifest_records_vmm_off_with_reason_and_links() {
        let manifest = manifest("gfx1201", Os::Linux);
        assert_eq!(manifest.target, "gfx1201");
        assert_eq!(manifest.family, "gfx120X");
        assert_eq!(manifest.wave_size, Some(32));
        assert_eq!(manifest.flash_attention.as_deref(), Some("wmma"));
        assert!(!manifest.development_build);
        let vmm = manifest.feature("vmm").unwrap();
        assert_eq!((vmm.state.as_str(), vmm.enabled), ("off", false));
        assert!(vmm
            .reason
            .as_deref()
            .unwrap()
            .starts_with("hipMemSetAccess fails"));
        assert_eq!(vmm.tracking.len(), 2);
        assert_eq!(manifest.rocm.release.as_deref(), Some("7.2.1"));
        assert_eq!(
            manifest.rocm.hip_runtime,
            ["libamdhip64.so.7", "libamdhip64.so.6"]
        );
        assert_eq!(manifest.kernels.dir.as_deref(), Some("kernels/gfx1201"));
        assert_eq!(manifest.toolchain.rust_target, "x86_64-unknown-linux-gnu");
    }

    #[test]
    fn gfx1201_and_gfx1151_differ_exactly_where_targets_toml_says() {
        let a = serde_json::to_value(manifest("gfx1201", Os::Linux)).unwrap();
        let b = serde_json::to_value(manifest("gfx1151", Os::Linux)).unwrap();
        let (a, b) = (a.as_object().unwrap(), b.as_object().unwrap());
        let differing: Vec<&str> = a
            .keys()
            .filter(|k| a[*k] != b[*k])
            .map(String::as_str)
            .collect();
        assert_eq!(
            differing,
            [
                "family",
                "family_description",
                "features",
                "kernels",
                "target"
            ]
        );
        let features = |m: &serde_json::Map<String, serde_json::Value>| m["features"].clone();
        assert_eq!(features(b)[1]["name"], "vmm");
        assert_eq!(features(b)[1]["enabled"], true);
        assert_eq!(features(a)[1]["enabled"], false);
        // peer_copy: probed per pair at start on the discrete RDNA4 card (not enabled
        // unconditionally), unsupported on the APU.
        assert_eq!(features(a)[0]["state"], "probe");
        assert_eq!(features(a)[0]["enabled"], false);
        assert_eq!(features(b)[0]["state"], "unsupported");
    }

    #[test]
    fn windows_manifest_records_the_hip_runtime_dlls() {
        let manifest = manifest("gfx1201", Os::Windows);
        assert_eq!(
            manifest.rocm.hip_runtime,
            ["amdhip64_7.dll", "amdhip64_6.dll"]
        );
        assert_eq!(manifest.toolchain.rust_target, "x86_64-pc-windows-gnu");
        let json = manifest.to_json();
        assert!(json.contains("\"amdhip64_6.dll\""), "{json}");
    }

    #[test]
    fn cpu_manifest_has_no_gpu_parts() {
        let manifest = manifest("cpu", Os::Linux);
        assert_eq!(manifest.kind, Kind::Cpu);
        assert_eq!(manifest.wave_size, None);
        assert_eq!(manifest.kernels.dir, None);
        assert_eq!(manifest.rocm.release, None);
        assert!(manifest
            .features
            .iter()
            .all(|f| f.state == "unsupported" && !f.enabled));
    }

    #[test]
    fn manifest_round_trips_through_json() {
        let manifest = manifest("gfx1151", Os::Linux);
        let parsed: BuildManifest = serde_json::from_str(&manifest.to_json()).unwrap();
        assert_eq!(parsed, manifest);
    }
}
