//! `cargo xtask verify ARCHIVE|DIR`: what a user runs on a download. It checks, naming the file
//! at fault: the archive against the `<archive>.sha256` beside it (when present), every file
//! against `SHA256SUMS`, every file against its record in `manifest.json`, the build manifest
//! written into the binary against `manifest.json`, and the manifest's features against this
//! checkout's `targets.toml`.

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use xshell::Shell;

use crate::manifest::{FeatureRecord, PackageManifest};
use crate::targets::Os;

impl crate::flags::Verify {
    pub fn run(self, _sh: &Shell) -> Result<()> {
        let targets = crate::targets::load()?;
        let summary = verify(&self.path, &targets)?;
        println!("verify: {}: {summary}", self.path.display());
        Ok(())
    }
}

/// Verifies an archive or an unpacked package folder; returns a one-line summary.
pub fn verify(path: &Path, targets: &crate::targets::Targets) -> Result<String> {
    let mut checked = Vec::new();
    let folder = if path.is_dir() {
        path.to_path_buf()
    } else {
        let name = path.file_name().and_then(|n| n.to_str()).with_context(|| {
            format!("expected an archive or a folder, found {}", path.display())
        })?;
        if path.with_file_name(format!("{name}.sha256")).is_file() {
            crate::smoke::verify_archive_checksum(path, path)?;
            checked.push(format!("{name}.sha256"));
        }
        let stem = name
            .strip_suffix(".tar.gz")
            .or_else(|| name.strip_suffix(".zip"))
            .with_context(|| format!("expected a .tar.gz or .zip archive, found {name}"))?;
        let into = crate::target_dir().join("verify").join(stem);
        if into.exists() {
            std::fs::remove_dir_all(&into)
                .with_context(|| format!("removing {}", into.display()))?;
        }
        std::fs::create_dir_all(&into)?;
        if name.ends_with(".zip") {
            crate::smoke::unpack_zip(path, &into)?;
        } else {
            crate::smoke::unpack_tar_gz(path, &into)?;
        }
        let folder = into.join(stem);
        ensure!(
            folder.is_dir(),
            "expected {name} to hold the folder {stem}, found none"
        );
        folder
    };

    let count = crate::smoke::verify_sha256sums(&folder).map_err(|problems| {
        anyhow::anyhow!("SHA256SUMS does not match:\n  {}", problems.join("\n  "))
    })?;
    checked.push(format!("SHA256SUMS ({count} files)"));

    let manifest_path = folder.join("manifest.json");
    let text = std::fs::read_to_string(&manifest_path)
        .with_context(|| format!("reading {}", manifest_path.display()))?;
    let manifest: PackageManifest =
        serde_json::from_str(&text).context("manifest.json: not a package manifest")?;
    let mut problems = Vec::new();
    for record in &manifest.files {
        let file = folder.join(&record.path);
        match std::fs::read(&file) {
            Ok(bytes) if crate::package::sha256_hex(&bytes) == record.sha256 => {}
            Ok(_) => problems.push(format!(
                "{}: SHA-256 differs from manifest.json's record",
                record.path
            )),
            Err(error) => problems.push(format!(
                "{}: listed in manifest.json but unreadable: {error}",
                record.path
            )),
        }
    }
    ensure!(
        problems.is_empty(),
        "manifest.json does not match the files:\n  {}",
        problems.join("\n  ")
    );
    checked.push(format!("manifest.json ({} files)", manifest.files.len()));

    let os = if folder.join(Os::Windows.exe_name()).is_file() {
        Os::Windows
    } else {
        Os::Linux
    };
    let binary: PathBuf = folder.join(os.exe_name());
    let bytes = std::fs::read(&binary).with_context(|| format!("reading {}", binary.display()))?;
    let embedded = crate::manifest_slot::read(&bytes)
        .with_context(|| format!("{}: reading its build manifest", os.exe_name()))?
        .with_context(|| {
            format!(
                "{}: carries no build manifest (a development build)",
                os.exe_name()
            )
        })?;
    let embedded: serde_json::Value = serde_json::from_str(&embedded)
        .with_context(|| format!("{}: its build manifest is not JSON", os.exe_name()))?;
    if embedded != serde_json::to_value(&manifest.build)? {
        bail!(
            "{}: the build manifest it carries differs from manifest.json's",
            os.exe_name()
        );
    }
    checked.push(format!("the manifest inside {}", os.exe_name()));

    let target = targets.target(&manifest.build.target).with_context(|| {
        format!(
            "manifest.json: target {} is not in targets.toml",
            manifest.build.target
        )
    })?;
    let expected: Vec<FeatureRecord> = target
        .features
        .iter()
        .map(FeatureRecord::from_feature)
        .collect();
    if manifest.build.features != expected {
        bail!(
            "manifest.json: the features of {} differ from targets.toml's (this checkout's; the artifact was built at commit {})",
            target.name,
            manifest.build.engine.commit.as_deref().unwrap_or("unknown")
        );
    }
    checked.push(format!("{}'s features against targets.toml", target.name));
    Ok(checked.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{BuildInfo, BuildManifest};
    use crate::package::{write_package, PackageInput};

    /// A real package of a fake engine binary that carries its manifest in a slot.
    fn package(dir: &Path) -> PathBuf {
        let targets = crate::targets::load().unwrap();
        let info = BuildInfo {
            version: "0.1.0".into(),
            commit: Some("abc".into()),
            dirty: false,
            rustc: "rustc 1.90.0".into(),
            kernel_compiler: None,
            toolchain_rocm: None,
            kernel_modules: vec![],
        };
        let target = targets.target("cpu").unwrap();
        let manifest = BuildManifest::new(&targets, target, Os::Linux, info).unwrap();
        let mut binary = b"\x7fELF engine".to_vec();
        binary.extend_from_slice(&crate::manifest_slot::MARKER);
        binary.extend(std::iter::repeat_n(0u8, 4 + crate::manifest_slot::CAPACITY));
        let binary = crate::manifest_slot::write(&binary, &manifest.to_json()).unwrap();
        std::fs::create_dir_all(dir).unwrap();
        std::fs::write(dir.join("ember"), binary).unwrap();
        std::fs::write(dir.join("LICENSE-MIT"), b"MIT").unwrap();
        let input = PackageInput {
            version: "0.1.0".into(),
            os: Os::Linux,
            target: "cpu".into(),
            binary: dir.join("ember"),
            kernel_objects: vec![],
            licenses: vec![dir.join("LICENSE-MIT")],
            manifest,
            mtime: 1_796_020_765,
        };
        write_package(&input, &dir.join("dist")).unwrap()
    }

    fn error(path: &Path) -> String {
        let targets = crate::targets::load().unwrap();
        format!("{:#}", verify(path, &targets).unwrap_err())
    }

    #[test]
    fn a_good_package_verifies_and_tampering_is_named() {
        let dir = std::env::temp_dir().join(format!("ember-xtask-verify-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let archive = package(&dir);
        let targets = crate::targets::load().unwrap();
        let summary = verify(&archive, &targets).unwrap();
        assert!(summary.contains("SHA256SUMS"), "{summary}");
        assert!(summary.contains("the manifest inside ember"), "{summary}");

        // A tampered archive: one byte flipped after packaging.
        let good = std::fs::read(&archive).unwrap();
        let mut bad = good.clone();
        let middle = bad.len() / 2;
        bad[middle] ^= 1;
        std::fs::write(&archive, &bad).unwrap();
        let message = error(&archive);
        assert!(
            message.contains("ember-0.1.0-linux-cpu-x64.tar.gz"),
            "{message}"
        );
        std::fs::write(&archive, &good).unwrap();

        // An unpacked package whose manifest.json was edited (with SHA256SUMS updated to match,
        // as a careful forger would): the binary's own manifest still disagrees.
        let folder = crate::target_dir()
            .join("verify")
            .join("ember-0.1.0-linux-cpu-x64")
            .join("ember-0.1.0-linux-cpu-x64");
        verify(&archive, &targets).unwrap();
        let manifest_path = folder.join("manifest.json");
        let edited = std::fs::read_to_string(&manifest_path)
            .unwrap()
            .replace("\"dirty\": false", "\"dirty\": true");
        std::fs::write(&manifest_path, &edited).unwrap();
        let message = error(&folder);
        assert!(message.contains("manifest.json"), "{message}");
        let sums = std::fs::read_to_string(folder.join("SHA256SUMS")).unwrap();
        let sums: String = sums
            .lines()
            .map(|line| {
                if line.ends_with("  manifest.json") {
                    format!(
                        "{}  manifest.json\n",
                        crate::package::sha256_hex(edited.as_bytes())
                    )
                } else {
                    format!("{line}\n")
                }
            })
            .collect();
        std::fs::write(folder.join("SHA256SUMS"), sums).unwrap();
        let message = error(&folder);
        assert!(
            message.contains("ember: the build manifest it carries differs from manifest.json's"),
            "{message}"
        );

        // A replaced binary is caught by SHA256SUMS, naming it.
        verify(&archive, &targets).unwrap();
        std::fs::write(folder.join("ember"), b"another engine").unwrap();
        let message = error(&folder);
        assert!(message.contains("ember: expected SHA-256"), "{message}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
