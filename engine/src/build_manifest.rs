//! The build manifest this binary was built with: which target it is for, which features that
//! target gates on or off and why, the ROCm release, the engine commit and the toolchain versions.
//!
//! `cargo xtask build` writes the manifest from `targets.toml` into the linked binary, into a slot
//! reserved for it ([`MANIFEST_SLOT`]); a binary whose slot is empty (a plain `cargo build`) uses
//! the development manifest that `build.rs` writes (target `dev`, no gates). Writing after linking
//! rather than compiling the manifest in means one compiled engine serves every target's package,
//! and the engine that `cargo test` built is the one that `cargo xtask build` ships. `ember info` prints
//! [`render_text`]; the engine uses [`feature_enabled`] as the run-time default of a gated feature
//! (flags override it, and a run-time probe can still turn an enabled feature off).

use std::sync::OnceLock;

use serde::Deserialize;

/// The manifest schema this engine reads (xtask's `MANIFEST_SCHEMA`).
pub const MANIFEST_SCHEMA: u32 = 1;

/// The manifest of a plain `cargo build`, from build.rs.
const DEVELOPMENT_MANIFEST_JSON: &str =
    include_str!(concat!(env!("OUT_DIR"), "/build_manifest.json"));

/// The bytes that start the slot; xtask's `manifest_slot.rs` finds the slot by them (exactly once
/// in the binary) and writes the manifest's length and bytes after them.
pub const MANIFEST_SLOT_MARKER: [u8; 32] = *b"ember:build-manifest-slot:v1:3f9";
/// The most manifest bytes the slot holds.
pub const MANIFEST_SLOT_CAPACITY: usize = 64 * 1024;

/// The slot's layout: the marker, the manifest's length (little-endian u32; 0 = empty), the bytes.
#[repr(C)]
pub struct ManifestSlot {
    marker: [u8; 32],
    len: [u8; 4],
    bytes: [u8; MANIFEST_SLOT_CAPACITY],
}

/// Initialised data (the marker is not zero), so the slot's bytes are in the executable file
/// where xtask can rewrite them.
pub static MANIFEST_SLOT: ManifestSlot = ManifestSlot {
    marker: MANIFEST_SLOT_MARKER,
    len: [0; 4],
    bytes: [0; MANIFEST_SLOT_CAPACITY],
};

/// The manifest written into the slot, or `None` when the slot is empty or holds something that
/// is not a manifest-sized UTF-8 text.
fn slot_json() -> Option<String> {
    let len_ptr: *const [u8; 4] = &MANIFEST_SLOT.len;
    let bytes_ptr: *const u8 = MANIFEST_SLOT.bytes.as_ptr();
    // SAFETY: `len_ptr` points to a field of a live static. The read is volatile because xtask
    // rewrites these bytes in the file after linking: the compiler must read them at run time,
    // not fold in the initialiser.
    let len = u32::from_le_bytes(unsafe { std::ptr::read_volatile(len_ptr) });
    let len = usize::try_from(len).ok()?;
    if len == 0 || len > MANIFEST_SLOT_CAPACITY {
        return None;
    }
    let bytes: Vec<u8> = (0..len)
        // SAFETY: `bytes_ptr.add(i)` stays inside the static's `bytes` array (`len` is at most
        // its capacity); volatile for the reason above.
        .map(|i| unsafe { std::ptr::read_volatile(bytes_ptr.add(i)) })
        .collect();
    String::from_utf8(bytes).ok()
}

/// The manifest this binary carries: the slot's when xtask wrote one, else the development one.
fn embedded_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| slot_json().unwrap_or_else(|| DEVELOPMENT_MANIFEST_JSON.to_string()))
}

/// Why the embedded manifest cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildManifestError {
    #[error("embedded build manifest is not valid JSON of the expected shape: {0}")]
    Parse(String),
    #[error("embedded build manifest has schema {found}, expected schema {expected}")]
    Schema { expected: u32, found: u32 },
}

/// The embedded manifest, typed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BuildManifest {
    pub schema: u32,
    /// True for a plain `cargo build` (no target, no gates).
    pub development_build: bool,
    pub target: String,
    /// `cpu`, `amdgpu`, `nvidia`, or `dev` for a development build.
    pub kind: String,
    pub family: String,
    pub family_description: String,
    pub os: String,
    pub wave_size: Option<u32>,
    pub flash_attention: Option<String>,
    pub features: Vec<Feature>,
    pub rocm: Rocm,
    pub engine: Engine,
    pub toolchain: Toolchain,
    pub kernels: Kernels,
}

/// One feature gate.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Feature {
    pub name: String,
    /// `on`, `off` or `unsupported`.
    pub state: String,
    pub enabled: bool,
    pub reason: Option<String>,
    pub tracking: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Rocm {
    /// The ROCm release the build is for (targets.toml).
    pub release: Option<String>,
    /// The ROCm install the kernels were compiled with, if any.
    pub toolchain_rocm: Option<String>,
    /// HIP runtime libraries to try, in order.
    pub hip_runtime: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Engine {
    pub version: String,
    pub commit: Option<String>,
    pub dirty: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Toolchain {
    pub rustc: String,
    pub rust_target: String,
    pub kernel_compiler: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Kernels {
    /// Relative to the executable: `kernels/<target>`.
    pub dir: Option<String>,
    pub modules: Vec<String>,
}

/// The embedded manifest exactly as it was built in.
pub fn manifest_json() -> &'static str {
    embedded_json()
}

/// The embedded manifest, parsed once.
pub fn manifest() -> Result<&'static BuildManifest, &'static BuildManifestError> {
    static PARSED: OnceLock<Result<BuildManifest, BuildManifestError>> = OnceLock::new();
    PARSED.get_or_init(|| parse(embedded_json())).as_ref()
}

/// Parses and checks a manifest's JSON.
pub fn parse(json: &str) -> Result<BuildManifest, BuildManifestError> {
    let manifest: BuildManifest =
        serde_json::from_str(json).map_err(|error| BuildManifestError::Parse(error.to_string()))?;
    if manifest.schema != MANIFEST_SCHEMA {
        return Err(BuildManifestError::Schema {
            expected: MANIFEST_SCHEMA,
            found: manifest.schema,
        });
    }
    Ok(manifest)
}

/// Whether this build enables feature `name` by default: `None` when the build does not gate it
/// (development builds, features the target does not list, an unreadable manifest).
pub fn feature_enabled(name: &str) -> Option<bool> {
    feature(name).map(|feature| feature.enabled)
}

/// Feature `name`'s gate, with its reason and tracking links.
pub fn feature(name: &str) -> Option<&'static Feature> {
    manifest()
        .ok()?
        .features
        .iter()
        .find(|feature| feature.name == name)
}

/// The environment variable that overrides the build's `peer_copy` gate at run time: `on`, `off`
/// or `probe`. `off` is the run-time form of the workaround that setups with corrupting peer
/// copies otherwise needed a rebuild for.
pub const PEER_COPY_ENV: &str = "EMBER_PEER_COPY";

/// The `peer_copy` gate and its reason, as the split uses it: [`PEER_COPY_ENV`] when set, else this
/// build's gate: `on` and `probe` as written; `off` and `unsupported` keep every copy in host
/// memory. A development build (no manifest, or no `peer_copy` feature) probes, as the targets
/// that need it most do. An unknown value of the variable is an error naming it.
pub fn peer_gate() -> Result<(ember_gpu::peer::PeerGate, Option<String>), String> {
    gate_with_override(
        feature("peer_copy"),
        std::env::var(PEER_COPY_ENV).ok().as_deref(),
    )
}

fn gate_with_override(
    feature: Option<&Feature>,
    value: Option<&str>,
) -> Result<(ember_gpu::peer::PeerGate, Option<String>), String> {
    use ember_gpu::peer::PeerGate;
    let Some(value) = value else {
        return Ok(gate_of(feature));
    };
    let gate = match value.trim().to_ascii_lowercase().as_str() {
        "on" => PeerGate::On,
        "off" => PeerGate::Off,
        "probe" => PeerGate::Probe,
        _ => {
            return Err(format!(
                "{PEER_COPY_ENV}: expected on, off or probe, found {value:?}"
            ))
        }
    };
    Ok((
        gate,
        Some(format!("{PEER_COPY_ENV}={gate} in the environment")),
    ))
}

fn gate_of(feature: Option<&Feature>) -> (ember_gpu::peer::PeerGate, Option<String>) {
    use ember_gpu::peer::PeerGate;
    match feature {
        None => (
            PeerGate::Probe,
            Some("a development build has no peer_copy gate".into()),
        ),
        Some(f) => {
            let gate = match f.state.as_str() {
                "on" => PeerGate::On,
                "probe" => PeerGate::Probe,
                _ => PeerGate::Off,
            };
            (gate, f.reason.clone())
        }
    }
}

/// The warning to give when the HIP runtime that was loaded comes from another major ROCm release
/// than the one this build was made for (`rocm.release` of the manifest), else `None` (same
/// major, a development or CPU build, or a runtime that did not say its version).
/// `runtime_version` is `hipRuntimeGetVersion`'s number: major × 10,000,000 + minor × 100,000 +
/// patch.
pub fn rocm_release_mismatch(
    built_for: Option<&str>,
    runtime_version: Option<i32>,
    library: &str,
) -> Option<String> {
    let built_for = built_for?;
    let built_major: i32 = built_for.split('.').next()?.trim().parse().ok()?;
    let runtime_version = runtime_version.filter(|v| *v > 0)?;
    let runtime_major = runtime_version / 10_000_000;
    let runtime_minor = (runtime_version / 100_000) % 100;
    (runtime_major != built_major).then(|| {
        format!(
            "this build is for ROCm {built_for} but the HIP runtime loaded ({library}) is from ROCm {runtime_major}.{runtime_minor}: kernels and memory behaviour were tested against {built_major}.x; use the build for ROCm {runtime_major}.x or point ROCM_PATH at a ROCm {built_major}.x install"
        )
    })
}

/// The human-readable form `ember info` prints.
pub fn render_text() -> String {
    match manifest() {
        Ok(manifest) => render(manifest),
        Err(error) => format!("build manifest: unreadable ({error})\n"),
    }
}

/// Renders `manifest` (what [`render_text`] does for the embedded one).
pub fn render(manifest: &BuildManifest) -> String {
    let mut text = String::from("build manifest:\n");
    let mut line = |s: String| {
        text.push_str("  ");
        text.push_str(&s);
        text.push('\n');
    };
    if manifest.development_build {
        line(format!(
            "target: {} (development build: made by plain `cargo build`, not `cargo xtask build`; no target or feature gates recorded, features use their built-in defaults)",
            manifest.target
        ));
    } else {
        line(format!(
            "target: {} (family {}: {}), {}",
            manifest.target, manifest.family, manifest.family_description, manifest.os
        ));
    }
    if let Some(wave_size) = manifest.wave_size {
        line(format!("wave size: {wave_size}"));
    }
    if let Some(flavour) = &manifest.flash_attention {
        line(format!("flash attention: {flavour}"));
    }
    if !manifest.features.is_empty() {
        line("features:".to_string());
        for feature in &manifest.features {
            let mut entry = format!("  {}: {}", feature.name, feature.state);
            if let Some(reason) = &feature.reason {
                entry.push_str(&format!(" ({reason})"));
            }
            line(entry);
            for link in &feature.tracking {
                line(format!("    tracking: {link}"));
            }
        }
    }
    match (&manifest.rocm.release, &manifest.rocm.toolchain_rocm) {
        (Some(release), Some(toolchain)) => line(format!(
            "ROCm: built for {release} (kernels compiled with ROCm {toolchain})"
        )),
        (Some(release), None) => line(format!("ROCm: built for {release}")),
        (None, _) => {}
    }
    if !manifest.rocm.hip_runtime.is_empty() {
        line(format!(
            "HIP runtime: {} (first found is loaded)",
            manifest.rocm.hip_runtime.join(", ")
        ));
    }
    if let Some(dir) = &manifest.kernels.dir {
        line(format!(
            "kernels: {dir}/ beside the executable ({})",
            manifest.kernels.modules.join(", ")
        ));
    }
    let commit = match &manifest.engine.commit {
        Some(commit) => format!(
            "commit {commit}{}",
            if manifest.engine.dirty {
                " (with uncommitted changes)"
            } else {
                ""
            }
        ),
        None => "commit not recorded".to_string(),
    };
    line(format!("engine: {}, {commit}", manifest.engine.version));
    line(format!(
        "rustc: {} ({})",
        manifest.toolchain.rustc, manifest.toolchain.rust_target
    ));
    if let Some(compiler) = &manifest.toolchain.kernel_compiler {
        line(format!("kernel compiler: {compiler}"));
    }
    text
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_peer_copy_gate_follows_the_feature_state() {
        use ember_gpu::peer::PeerGate;
        let feature = |state: &str, reason: Option<&str>| super::Feature {
            name: "peer_copy".into(),
            state: state.into(),
            enabled: state == "on",
            reason: reason.map(str::to_string),
            tracking: Vec::new(),
        };
        let gate = |f: &super::Feature| super::gate_of(Some(f));
        assert_eq!(gate(&feature("on", None)), (PeerGate::On, None));
        assert_eq!(
            gate(&feature("probe", Some("corrupts on gfx1201"))),
            (PeerGate::Probe, Some("corrupts on gfx1201".into()))
        );
        assert_eq!(gate(&feature("off", Some("x"))).0, PeerGate::Off);
        assert_eq!(gate(&feature("unsupported", None)).0, PeerGate::Off);
        assert_eq!(super::gate_of(None).0, PeerGate::Probe);
        // The environment overrides the build, in any case, with a reason naming it.
        let on = feature("on", Some("peer copies work on this family"));
        assert_eq!(
            super::gate_with_override(Some(&on), Some("OFF")).unwrap(),
            (
                PeerGate::Off,
                Some("EMBER_PEER_COPY=off in the environment".into())
            )
        );
        assert_eq!(
            super::gate_with_override(None, Some("probe")).unwrap().0,
            PeerGate::Probe
        );
        assert_eq!(
            super::gate_with_override(Some(&on), None).unwrap(),
            super::gate_of(Some(&on))
        );
        assert_eq!(
            super::gate_with_override(Some(&on), Some("sometimes")).unwrap_err(),
            "EMBER_PEER_COPY: expected on, off or probe, found \"sometimes\""
        );
    }

    use super::*;

    const GFX1201: &str = r#"{
  "schema": 1,
  "development_build": false,
  "target": "gfx1201",
  "kind": "amdgpu",
  "family": "gfx120X",
  "family_description": "RDNA4 (Radeon RX 9000, AI PRO R9700)",
  "os": "linux",
  "wave_size": 32,
  "flash_attention": "wmma",
  "features": [
    { "name": "peer_copy", "state": "on", "enabled": true, "reason": null, "tracking": [] },
    { "name": "vmm", "state": "off", "enabled": false,
      "reason": "hipMemSetAccess fails when a mapping is grown while several reservations exist",
      "tracking": ["https://github.com/ROCm/rocm-systems/issues/2516", "https://github.com/ggml-org/llama.cpp/issues/18650"] }
  ],
  "rocm": { "release": "7.0", "toolchain_rocm": null, "hip_runtime": ["libamdhip64.so.7", "libamdhip64.so.6"] },
  "engine": { "version": "0.1.0", "commit": "0123abc", "dirty": true },
  "toolchain": { "rustc": "rustc 1.90.0", "rust_target": "x86_64-unknown-linux-gnu", "kernel_compiler": "Debian clang version 19.1.7" },
  "kernels": { "dir": "kernels/gfx1201", "modules": ["matmul.hsaco"] }
}"#;

    #[test]
    fn embedded_manifest_parses() {
        let manifest = manifest().expect("the embedded manifest parses");
        assert_eq!(manifest.schema, MANIFEST_SCHEMA);
        assert!(manifest_json().contains(&format!("\"target\": \"{}\"", manifest.target)));
        if manifest.development_build {
            assert_eq!(manifest.target, "dev");
            assert!(manifest.features.is_empty());
            assert_eq!(feature_enabled("vmm"), None);
            assert!(render_text().contains("target: dev (development build"));
        }
    }

    #[test]
    fn gfx1201_renders_vmm_off_with_reason_and_links() {
        let manifest = parse(GFX1201).unwrap();
        let text = render(&manifest);
        assert!(
            text.contains(
                "  target: gfx1201 (family gfx120X: RDNA4 (Radeon RX 9000, AI PRO R9700)), linux\n"
            ),
            "{text}"
        );
        assert!(text.contains("    vmm: off (hipMemSetAccess fails when a mapping is grown while several reservations exist)\n"), "{text}");
        assert!(
            text.contains("      tracking: https://github.com/ROCm/rocm-systems/issues/2516\n"),
            "{text}"
        );
        assert!(text.contains("    peer_copy: on\n"), "{text}");
        assert!(
            text.contains("  engine: 0.1.0, commit 0123abc (with uncommitted changes)\n"),
            "{text}"
        );
        assert!(
            text.contains("  HIP runtime: libamdhip64.so.7, libamdhip64.so.6"),
            "{text}"
        );
        assert!(!manifest.features[1].enabled);
    }

    #[test]
    fn rocm_major_mismatch_is_warned() {
        let warn = |built_for, runtime| rocm_release_mismatch(built_for, runtime, "libamdhip64.so");
        // 7.2.1 runtime (70_201_000-ish numbers) against a 7.2.1 build: no warning.
        assert_eq!(warn(Some("7.2.1"), Some(70_251_021)), None);
        assert_eq!(warn(Some("7.2.1"), Some(71_100_000)), None);
        let message = warn(Some("7.2.1"), Some(60_443_483)).expect("6.4 runtime under a 7.2 build");
        assert!(message.contains("for ROCm 7.2.1"), "{message}");
        assert!(message.contains("from ROCm 6.4"), "{message}");
        assert!(message.contains("libamdhip64.so"), "{message}");
        assert!(warn(Some("6.4.1"), Some(70_251_021)).is_some());
        // Nothing to compare: development build, unknown runtime version.
        assert_eq!(warn(None, Some(60_443_483)), None);
        assert_eq!(warn(Some("7.2.1"), None), None);
        assert_eq!(warn(Some("7.2.1"), Some(0)), None);
        assert_eq!(warn(Some("not a version"), Some(60_443_483)), None);
    }

    #[test]
    fn bad_manifests_are_errors_not_panics() {
        assert!(matches!(parse("{}"), Err(BuildManifestError::Parse(_))));
        assert!(matches!(
            parse("not json"),
            Err(BuildManifestError::Parse(_))
        ));
        let future = GFX1201.replace("\"schema\": 1", "\"schema\": 2");
        assert_eq!(
            parse(&future).unwrap_err().to_string(),
            "embedded build manifest has schema 2, expected schema 1"
        );
    }
}
