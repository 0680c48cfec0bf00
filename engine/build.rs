//! Writes the development build manifest into OUT_DIR, where `src/build_manifest.rs` includes it.
//!
//! A plain `cargo build` carries this manifest: target "dev", no features, clearly labelled, so
//! `ember info` never passes a developer's build off as a release build. `cargo xtask build`
//! writes the target's real manifest (target, features with reasons, ROCm release, commit,
//! toolchain versions) into the linked binary's manifest slot instead, so the engine is compiled
//! once for every target (see `src/build_manifest.rs`). Nothing here depends on the environment,
//! so the script never makes cargo rebuild the engine.
//!
//! Only std is available here (the engine's build-dependencies are not ours to add), so the
//! development manifest is written by hand.

use std::env;
use std::fs;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

fn main() -> ExitCode {
    println!("cargo:rerun-if-changed=build.rs");
    let Some(out_dir) = env::var_os("OUT_DIR").map(PathBuf::from) else {
        eprintln!("error: expected cargo to set OUT_DIR for the build script, found it unset");
        return ExitCode::FAILURE;
    };
    let json = development_manifest();
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
