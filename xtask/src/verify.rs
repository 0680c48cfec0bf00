//! `cargo xtask verify ARCHIVE|DIR|IMAGE`: what a user runs on a download. It checks, naming the
//! file at fault: the archive against the `<archive>.sha256` beside it (when present), every file
//! against `SHA256SUMS`, every file against its record in `manifest.json`, the build manifest
//! written into the binary against `manifest.json`, and the manifest's features against
//! `targets.toml` at the commit the manifest names (this checkout's when that commit is not in it).
//!
//! A release folder (what `cargo xtask release --dry-run` writes and the release publishes) is
//! checked as a whole: `SHA256SUMS` covers every file, its signature holds, every archive verifies
//! as above, and the CycloneDX SBOM lists exactly the crates that the binaries' embedded build
//! manifests name. An image is checked by copying its package folder out of a container created
//! from it (never started).

use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use xshell::Shell;

use crate::manifest::{FeatureRecord, PackageManifest};
use crate::targets::Os;

/// Files of a release folder that `SHA256SUMS` does not cover: itself and its signatures.
pub const UNSUMMED: [&str; 4] = [
    "SHA256SUMS",
    crate::sign::SIGNATURE_FILE,
    crate::sign::PUBLIC_KEY_FILE,
    "SHA256SUMS.sigstore.json",
];

impl crate::flags::Verify {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let targets = crate::targets::load()?;
        let summary = if self.path.is_dir() && !self.path.join("manifest.json").exists() {
            verify_release(&self.path, &targets, self.public_key.as_deref())?
        } else if !self.path.exists() && self.path.to_string_lossy().contains(':') {
            verify_image(sh, &self.path.to_string_lossy(), &targets)?
        } else {
            verify(&self.path, &targets)?
        };
        println!("verify: {}: {summary}", self.path.display());
        Ok(())
    }
}

/// Verifies an archive or an unpacked package folder; returns a one-line summary.
pub fn verify(path: &Path, targets: &crate::targets::Targets) -> Result<String> {
    verify_package(path, targets).map(|(summary, _)| summary)
}

/// [`verify`], also returning the package's manifest.
fn verify_package(
    path: &Path,
    targets: &crate::targets::Targets,
) -> Result<(String, PackageManifest)> {
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

    let (at_commit, targets_source) = targets_at_commit(manifest.build.engine.commit.as_deref());
    let targets = at_commit.as_ref().unwrap_or(targets);
    let target = targets.target(&manifest.build.target).with_context(|| {
        format!(
            "manifest.json: target {} is not in {targets_source}",
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
            "manifest.json: the features of {} differ from {targets_source} (the artifact was built at commit {})",
            target.name,
            manifest.build.engine.commit.as_deref().unwrap_or("unknown")
        );
    }
    checked.push(format!(
        "{}'s features against {targets_source}",
        target.name
    ));
    Ok((checked.join(", "), manifest))
}

/// `targets.toml` as it was at `commit`, read with `git show` from this checkout, and how to name
/// it in messages; `None` (use this checkout's file) when the commit is unknown here.
fn targets_at_commit(commit: Option<&str>) -> (Option<crate::targets::Targets>, String) {
    let this_checkout = "this checkout's targets.toml".to_string();
    let Some(commit) = commit.filter(|c| c.chars().all(|ch| ch.is_ascii_hexdigit())) else {
        return (None, this_checkout);
    };
    let output = std::process::Command::new("git")
        .args(["show", &format!("{commit}:targets.toml")])
        .current_dir(crate::project_root())
        .stderr(std::process::Stdio::null())
        .output();
    let Some(output) = output.ok().filter(|o| o.status.success()) else {
        return (
            None,
            format!("{this_checkout} (commit {commit} is not in this checkout)"),
        );
    };
    let text = String::from_utf8_lossy(&output.stdout);
    let name = format!("targets.toml at commit {commit}");
    match crate::targets::Targets::parse(&text, Path::new(&name)) {
        Ok(targets) => (Some(targets), name),
        Err(_) => (
            None,
            format!("{this_checkout} (targets.toml at {commit} does not parse with this xtask)"),
        ),
    }
}

/// Verifies a release folder; returns a one-line summary. `public_key` is the hex Ed25519 key
/// file to check the dry run's signature with (default: the one inside the folder).
pub fn verify_release(
    dir: &Path,
    targets: &crate::targets::Targets,
    public_key: Option<&Path>,
) -> Result<String> {
    let mut checked = Vec::new();
    let sums_path = dir.join("SHA256SUMS");
    let sums = std::fs::read_to_string(&sums_path)
        .with_context(|| format!("reading {}", sums_path.display()))?;
    let mut listed = std::collections::BTreeSet::new();
    let mut problems = Vec::new();
    for line in sums.lines() {
        let Some((digest, name)) = line.split_once("  ") else {
            bail!("SHA256SUMS: expected `<sha256>  <file>` lines, found {line:?}");
        };
        ensure!(
            !name.contains('/') && !name.contains('\\') && name != "..",
            "SHA256SUMS: names a file outside the release folder: {name}"
        );
        listed.insert(name.to_string());
        match std::fs::read(dir.join(name)) {
            Ok(bytes) if crate::package::sha256_hex(&bytes) == digest => {}
            Ok(_) => problems.push(format!("{name}: SHA-256 differs from SHA256SUMS")),
            Err(error) => problems.push(format!(
                "{name}: listed in SHA256SUMS but unreadable: {error}"
            )),
        }
    }
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().to_string();
        if !UNSUMMED.contains(&name.as_str()) && !listed.contains(&name) {
            problems.push(format!("{name}: not listed in SHA256SUMS"));
        }
    }
    ensure!(
        problems.is_empty(),
        "{} does not match its files:\n  {}",
        sums_path.display(),
        problems.join("\n  ")
    );
    checked.push(format!("SHA256SUMS ({} files)", listed.len()));

    let signature = dir.join(crate::sign::SIGNATURE_FILE);
    if signature.is_file() {
        let key_path = public_key
            .map(Path::to_path_buf)
            .unwrap_or_else(|| dir.join(crate::sign::PUBLIC_KEY_FILE));
        let key = std::fs::read_to_string(&key_path)
            .with_context(|| format!("reading the public key {}", key_path.display()))?;
        let sig = std::fs::read_to_string(&signature)?;
        crate::sign::verify_hex(&key, sums.as_bytes(), &sig).with_context(|| {
            format!(
                "{}: not a signature of SHA256SUMS",
                crate::sign::SIGNATURE_FILE
            )
        })?;
        checked.push(format!(
            "{} with {}",
            crate::sign::SIGNATURE_FILE,
            key_path
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default()
        ));
    } else if dir.join("SHA256SUMS.sigstore.json").is_file() {
        checked.push(
            "SHA256SUMS.sigstore.json present: check it with `cosign verify-blob` (README, Install)"
                .to_string(),
        );
    } else {
        bail!(
            "{}: no signature over SHA256SUMS (expected {} or SHA256SUMS.sigstore.json)",
            dir.display(),
            crate::sign::SIGNATURE_FILE
        );
    }

    let mut embedded = std::collections::BTreeSet::new();
    let mut archives = 0;
    for name in &listed {
        if name.ends_with(".tar.gz") || name.ends_with(".zip") {
            let (_, manifest) = verify_package(&dir.join(name), targets)
                .with_context(|| format!("{name}: does not verify"))?;
            ensure!(
                !manifest.build.dependencies.is_empty(),
                "{name}: its binary embeds no dependency list to check the SBOM against"
            );
            embedded.extend(manifest.build.dependencies.iter().cloned());
            archives += 1;
        }
    }
    checked.push(format!("{archives} archives"));

    let sboms: Vec<&String> = listed.iter().filter(|n| n.ends_with(".cdx.json")).collect();
    let [sbom_name] = sboms.as_slice() else {
        bail!(
            "{}: expected one CycloneDX SBOM (*.cdx.json), found {}",
            dir.display(),
            sboms.len()
        );
    };
    let sbom = crate::sbom::sbom_crates(&std::fs::read_to_string(dir.join(sbom_name))?)
        .with_context(|| format!("{sbom_name}: not a CycloneDX SBOM"))?;
    let missing: Vec<&String> = embedded.difference(&sbom).collect();
    let extra: Vec<&String> = sbom.difference(&embedded).collect();
    ensure!(
        missing.is_empty() && extra.is_empty(),
        "{sbom_name}: differs from the dependency lists embedded in the binaries: missing {missing:?}, not in any binary {extra:?}"
    );
    checked.push(format!(
        "{sbom_name} ({} crates) against the binaries",
        sbom.len()
    ));
    Ok(checked.join(", "))
}

/// Verifies the package folder inside an image, copied out of a container created (not started)
/// from it.
pub fn verify_image(sh: &Shell, image: &str, targets: &crate::targets::Targets) -> Result<String> {
    use xshell::cmd;
    let container = cmd!(sh, "docker create {image}")
        .quiet()
        .read()
        .with_context(|| {
            format!("creating a container from {image} (is it pulled, and is dockerd running?)")
        })?;
    let into = crate::target_dir().join("verify").join(format!(
        "image-{}",
        container.get(..12).unwrap_or(&container)
    ));
    let _ = std::fs::remove_dir_all(&into);
    std::fs::create_dir_all(&into)?;
    let copied = cmd!(sh, "docker cp {container}:/opt/ember-dist/. {into}")
        .quiet()
        .run();
    cmd!(sh, "docker rm {container}")
        .quiet()
        .ignore_stdout()
        .run()?;
    copied.with_context(|| format!("{image}: copying /opt/ember-dist out"))?;
    let folders: Vec<PathBuf> = std::fs::read_dir(&into)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    let [folder] = folders.as_slice() else {
        bail!(
            "{image}: expected one package folder in /opt/ember-dist, found {}",
            folders.len()
        );
    };
    let summary = verify(folder, targets)?;
    std::fs::remove_dir_all(&into)?;
    Ok(format!("the package in /opt/ember-dist: {summary}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::{BuildInfo, BuildManifest};
    use crate::package::{write_package, PackageInput};

    /// A real package of a fake engine binary that carries its manifest in a slot.
    fn package(dir: &Path) -> PathBuf {
        package_claiming(dir, |_| {})
    }

    /// [`package`], with `edit` applied to the manifest.json that the package ships (not to the
    /// one inside the binary): what a forger who repacks an archive produces.
    fn package_claiming(dir: &Path, edit: impl Fn(&mut BuildManifest)) -> PathBuf {
        let targets = crate::targets::load().unwrap();
        let info = BuildInfo {
            version: "0.1.0".into(),
            commit: Some("abc".into()),
            dirty: false,
            rustc: "rustc 1.90.0".into(),
            kernel_compiler: None,
            toolchain_rocm: None,
            kernel_modules: vec![],
            dependencies: vec!["ember@0.1.0".into(), "half@2.4.1".into()],
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
        let mut manifest = manifest;
        edit(&mut manifest);
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

    /// Every test here unpacks into the same `verify/<stem>` folder under the target directory;
    /// they take turns.
    static UNPACK: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn unpack_turn() -> std::sync::MutexGuard<'static, ()> {
        UNPACK
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn error(path: &Path) -> String {
        let targets = crate::targets::load().unwrap();
        format!("{:#}", verify(path, &targets).unwrap_err())
    }

    #[test]
    fn a_good_package_verifies_and_tampering_is_named() {
        let _turn = unpack_turn();
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

    /// A release folder as `cargo xtask release --dry-run` writes it, around [`package`].
    fn release(dir: &Path, sbom_crates: &[(&str, &str)]) -> (PathBuf, crate::sign::ThrowawayKey) {
        let archive = package(&dir.join("work"));
        let release = dir.join("release");
        std::fs::create_dir_all(&release).unwrap();
        std::fs::copy(&archive, release.join(archive.file_name().unwrap())).unwrap();
        write_sbom(&release, sbom_crates);
        let key = crate::sign::ThrowawayKey::generate().unwrap();
        crate::release::write_sums_and_sign(&release, &key).unwrap();
        (release, key)
    }

    fn write_sbom(release: &Path, crates: &[(&str, &str)]) {
        let crates: Vec<crate::sbom::Crate> = crates
            .iter()
            .map(|(name, version)| crate::sbom::Crate {
                name: name.to_string(),
                version: version.to_string(),
                license: Some("MIT".into()),
            })
            .collect();
        let sbom = crate::sbom::cyclonedx("0.1.0", &crates, &[], 0).unwrap();
        std::fs::write(release.join("ember-0.1.0.cdx.json"), sbom).unwrap();
    }

    fn release_error(release: &Path, public_key: Option<&Path>) -> String {
        let targets = crate::targets::load().unwrap();
        format!(
            "{:#}",
            verify_release(release, &targets, public_key).unwrap_err()
        )
    }

    const ARCHIVE: &str = "ember-0.1.0-linux-cpu-x64.tar.gz";
    const SBOM: [(&str, &str); 2] = [("ember", "0.1.0"), ("half", "2.4.1")];

    #[test]
    fn a_release_folder_verifies() {
        let _turn = unpack_turn();
        let dir =
            std::env::temp_dir().join(format!("ember-xtask-release-ok-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (release, _) = release(&dir, &SBOM);
        let targets = crate::targets::load().unwrap();
        let summary = verify_release(&release, &targets, None).unwrap();
        assert!(summary.contains("SHA256SUMS (2 files)"), "{summary}");
        assert!(summary.contains(crate::sign::SIGNATURE_FILE), "{summary}");
        assert!(
            summary.contains("ember-0.1.0.cdx.json (2 crates)"),
            "{summary}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_tampered_archive_in_a_release_is_named() {
        let _turn = unpack_turn();
        let dir =
            std::env::temp_dir().join(format!("ember-xtask-release-tamper-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (release, _) = release(&dir, &SBOM);
        let mut bytes = std::fs::read(release.join(ARCHIVE)).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 1;
        std::fs::write(release.join(ARCHIVE), bytes).unwrap();
        let message = release_error(&release, None);
        assert!(
            message.contains(&format!("{ARCHIVE}: SHA-256 differs from SHA256SUMS")),
            "{message}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_changed_manifest_in_a_release_is_named() {
        let _turn = unpack_turn();
        let dir = std::env::temp_dir().join(format!(
            "ember-xtask-release-manifest-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let (release, key) = release(&dir, &SBOM);
        // The archive repacked with a manifest.json claiming another commit, and SHA256SUMS
        // rewritten and signed again by a forger with the release key: only the binary's own
        // manifest gives it away.
        let forged = package_claiming(&dir.join("forged"), |m| {
            m.engine.commit = Some("0000000000000000000000000000000000000000".into())
        });
        std::fs::copy(&forged, release.join(ARCHIVE)).unwrap();
        crate::release::write_sums_and_sign(&release, &key).unwrap();
        let message = release_error(&release, None);
        assert!(message.contains(ARCHIVE), "{message}");
        assert!(
            message.contains("ember: the build manifest it carries differs from manifest.json's"),
            "{message}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_wrong_signature_is_named() {
        let _turn = unpack_turn();
        let dir =
            std::env::temp_dir().join(format!("ember-xtask-release-sig-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (release, key) = release(&dir, &SBOM);
        let trusted = dir.join("trusted.pub");
        std::fs::write(&trusted, key.public_key_hex()).unwrap();
        // Signed again by another key, which is also put into the folder: the folder's own key
        // agrees, the trusted key does not.
        let other = crate::sign::ThrowawayKey::generate().unwrap();
        other.sign_release(&release).unwrap();
        let message = release_error(&release, Some(&trusted));
        assert!(
            message.contains(&format!(
                "{}: not a signature of SHA256SUMS",
                crate::sign::SIGNATURE_FILE
            )),
            "{message}"
        );
        // A signature that does not match the folder's key either.
        std::fs::write(
            release.join(crate::sign::PUBLIC_KEY_FILE),
            key.public_key_hex(),
        )
        .unwrap();
        let message = release_error(&release, None);
        assert!(message.contains(crate::sign::SIGNATURE_FILE), "{message}");
        // No signature at all.
        std::fs::remove_file(release.join(crate::sign::SIGNATURE_FILE)).unwrap();
        let message = release_error(&release, None);
        assert!(
            message.contains("no signature over SHA256SUMS"),
            "{message}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_sbom_that_disagrees_with_the_binaries_is_named() {
        let _turn = unpack_turn();
        let dir =
            std::env::temp_dir().join(format!("ember-xtask-release-sbom-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (release, key) = release(&dir, &[("ember", "0.1.0"), ("half", "2.3.0")]);
        let message = release_error(&release, None);
        assert!(
            message.contains("ember-0.1.0.cdx.json: differs"),
            "{message}"
        );
        assert!(
            message.contains("half@2.4.1") && message.contains("half@2.3.0"),
            "{message}"
        );
        // A file added after signing is not covered.
        write_sbom(&release, &SBOM);
        crate::release::write_sums_and_sign(&release, &key).unwrap();
        std::fs::write(release.join("extra.txt"), b"x").unwrap();
        let message = release_error(&release, None);
        assert!(
            message.contains("extra.txt: not listed in SHA256SUMS"),
            "{message}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
