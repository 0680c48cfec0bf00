//! Embeds the build manifest into the engine.
//!
//! `cargo xtask build` writes the target's manifest (target, features with reasons, ROCm release,
//! commit, toolchain versions) to a file and builds with `EMBER_BUILD_MANIFEST=<that file>`; this
//! script copies it into OUT_DIR, where `src/build_manifest.rs` includes it. A plain `cargo build`
//! gets a development manifest instead: target "dev", no features, clearly labelled, so `ember
//! info` never passes a developer's build off as a release build.
//!
//! Only std is available here (the engine's build-dependencies are not ours to add), so the
//! development manifest is written by hand and the given manifest is only checked for shape;
//! `src/build_manifest.rs` parses and validates it.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    println!("cargo:rerun-if-env-changed=EMBER_BUILD_MANIFEST");
    println!("cargo:rerun-if-changed=build.rs");
    let Some(out_dir) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        eprintln!("error: expected cargo to set OUT_DIR for the build script, found it unset");
        return ExitCode::FAILURE;
    };
    let json = match env::var_os("EMBER_BUILD_MANIFEST").filter(|v| !v.is_empty()) {
        Some(path) => {
            let path = PathBuf::from(path);
            println!("cargo:rerun-if-changed={}", path.display());
            match read_manifest(&path) {
                Ok(json) => json,
                Err(message) => {
                    eprintln!("error: EMBER_BUILD_MANIFEST={}: {message}", path.display());
                    return ExitCode::FAILURE;
                }
            }
        }
        None => development_manifest(),
    };
    let dest = out_dir.join("build_manifest.json");
    // Rewriting identical content would change the file's time and rebuild the crate for nothing.
    if fs::read_to_string(&dest).ok().as_deref() != Some(json.as_str()) {
        if let Err(error) = fs::write(&dest, &json) {
            eprintln!("error: writing {}: {error}", dest.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

fn read_manifest(path: &Path) -> Result<String, String> {
    let text = fs::read_to_string(path)
        .map_err(|error| format!("cannot read the build manifest: {error}"))?;
    let trimmed = text.trim();
    if !(trimmed.starts_with('{') && trimmed.ends_with('}')) {
        return Err(
            "expected a JSON object (a manifest written by `cargo xtask build`), found other text"
                .to_string(),
        );
    }
    if !trimmed.contains("\"target\"") || !trimmed.contains("\"features\"") {
        return Err("expected a build manifest with \"target\" and \"features\", found a JSON object without them".to_string());
    }
    Ok(text)
}

/// The manifest of a plain `cargo build`: no target, no features, labelled as a development build.
fn development_manifest() -> String {
    let version = env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let rust_target = env::var("TARGET").unwrap_or_default();
    let rustc = env::var_os("RUSTC")
        .and_then(|rustc| Command::new(rustc).arg("--version").output().ok())
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string());
    format!(
        r#"{{
  "schema": 1,
  "development_build": true,
  "target": "dev",
  "kind": "dev",
  "family": "dev",
  "family_description": "development build (plain cargo build, not cargo xtask build): no target or feature gates recorded",
  "os": {os},
  "wave_size": null,
  "flash_attention": null,
  "features": [],
  "rocm": {{ "release": null, "toolchain_rocm": null, "hip_runtime": [] }},
  "engine": {{ "version": {version}, "commit": null, "dirty": false }},
  "toolchain": {{ "rustc": {rustc}, "rust_target": {rust_target}, "kernel_compiler": null }},
  "kernels": {{ "dir": null, "modules": [] }}
}}
"#,
        os = json_string(&os),
        version = json_string(&version),
        rustc = json_string(&rustc),
        rust_target = json_string(&rust_target),
    )
}

/// A JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}
