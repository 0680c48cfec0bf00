//! `cargo xtask package`: turns a built engine and its kernels into the release artifact
//! `target/dist/ember-<version>-<os>-<target>-x64.tar.gz` (Linux) or `.zip` (Windows).
//!
//! The archive holds one folder named like the archive, containing `ember` (or `ember.exe`),
//! `kernels/<target>/` (where the engine's GPU loader looks, beside the executable), README.md,
//! the licence files, `manifest.json` (the build manifest plus every file's SHA-256) and
//! `SHA256SUMS`, which `sha256sum -c` accepts from inside that folder. A `<archive>.sha256` file
//! beside the archive covers the archive itself.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use xshell::Shell;

use crate::kernels;
use crate::manifest::{self, BuildManifest, FileRecord, PackageManifest};
use crate::targets::{Os, Target};

/// The licence files of the workspace (MIT OR Apache-2.0), shipped in every package.
pub const LICENSE_FILES: [&str; 2] = ["LICENSE-MIT", "LICENSE-APACHE"];

/// `ember-<version>-<os>-<target>-x64`: the archive's name without extension, and its top folder.
pub fn package_stem(version: &str, os: Os, target: &str) -> String {
    format!("ember-{version}-{os}-{target}-x64")
}

/// The archive's file name: `.tar.gz` on Linux, `.zip` on Windows.
pub fn archive_name(version: &str, os: Os, target: &str) -> String {
    let extension = match os {
        Os::Linux => "tar.gz",
        Os::Windows => "zip",
    };
    format!("{}.{extension}", package_stem(version, os, target))
}

/// `target/dist/<archive>`.
pub fn archive_path(version: &str, os: Os, target: &str) -> PathBuf {
    dist_dir().join(archive_name(version, os, target))
}

pub fn dist_dir() -> PathBuf {
    crate::target_dir().join("dist")
}

/// The engine executable for `os` as cargo builds it, under cargo's target directory
/// `target_dir`: the same for every target, with an empty manifest slot.
pub fn engine_binary(target_dir: &Path, os: Os, rust_target: &str) -> PathBuf {
    match os {
        Os::Linux => target_dir.join("release").join(os.exe_name()),
        Os::Windows => target_dir
            .join(rust_target)
            .join("release")
            .join(os.exe_name()),
    }
}

/// The engine executable that `cargo xtask build` stamped with `target`'s manifest, which the
/// package ships: `xtask-build/<os>-<target>/ember[.exe]` under cargo's target directory.
pub fn stamped_binary(os: Os, target: &str) -> PathBuf {
    crate::target_dir()
        .join("xtask-build")
        .join(format!("{os}-{target}"))
        .join(os.exe_name())
}

/// A `sha256sum`-compatible line: the hex digest, two spaces (text mode), the path.
pub fn sha256sums(entries: &[(String, String)]) -> String {
    entries
        .iter()
        .map(|(path, digest)| format!("{digest}  {path}\n"))
        .collect()
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// Everything a package is made of.
pub struct PackageInput {
    pub version: String,
    pub os: Os,
    pub target: String,
    pub binary: PathBuf,
    pub kernel_objects: Vec<PathBuf>,
    pub licenses: Vec<PathBuf>,
    pub manifest: BuildManifest,
    /// Seconds since the epoch for every archive entry (reproducible archives).
    pub mtime: u64,
}

/// Writes the archive into `dist` and returns its path.
pub fn write_package(input: &PackageInput, dist: &Path) -> Result<PathBuf> {
    let stem = package_stem(&input.version, input.os, &input.target);
    // (path inside the package, contents, executable)
    let mut files: Vec<(String, Vec<u8>, bool)> = Vec::new();
    let binary = std::fs::read(&input.binary)
        .with_context(|| format!("reading the engine binary {}", input.binary.display()))?;
    files.push((input.os.exe_name().to_string(), binary, true));
    for object in &input.kernel_objects {
        let name = object
            .file_name()
            .and_then(|n| n.to_str())
            .context("kernel object name is not UTF-8")?;
        let bytes =
            std::fs::read(object).with_context(|| format!("reading {}", object.display()))?;
        files.push((format!("kernels/{}/{name}", input.target), bytes, false));
    }
    for license in &input.licenses {
        let name = license
            .file_name()
            .and_then(|n| n.to_str())
            .context("licence file name is not UTF-8")?;
        let bytes =
            std::fs::read(license).with_context(|| format!("reading {}", license.display()))?;
        files.push((name.to_string(), bytes, false));
    }
    files.push(("README.md".to_string(), readme(input).into_bytes(), false));
    files.sort_by(|a, b| a.0.cmp(&b.0));

    let records: Vec<FileRecord> = files
        .iter()
        .map(|(path, bytes, _)| FileRecord {
            path: path.clone(),
            sha256: sha256_hex(bytes),
            bytes: bytes.len() as u64,
        })
        .collect();
    let archive = archive_name(&input.version, input.os, &input.target);
    let package_manifest = PackageManifest {
        build: input.manifest.clone(),
        archive: archive.clone(),
        files: records,
    };
    let mut manifest_json = serde_json::to_string_pretty(&package_manifest)?;
    manifest_json.push('\n');
    files.push((
        "manifest.json".to_string(),
        manifest_json.into_bytes(),
        false,
    ));
    files.sort_by(|a, b| a.0.cmp(&b.0));
    let sums: Vec<(String, String)> = files
        .iter()
        .map(|(path, bytes, _)| (path.clone(), sha256_hex(bytes)))
        .collect();
    files.push((
        "SHA256SUMS".to_string(),
        sha256sums(&sums).into_bytes(),
        false,
    ));

    std::fs::create_dir_all(dist)?;
    let archive_path = dist.join(&archive);
    // A private name renamed into place: two packagers of one archive in a shared checkout must
    // not write into the same file.
    let partial = dist.join(format!("{archive}.partial-{}", std::process::id()));
    match input.os {
        Os::Linux => write_tar_gz(&partial, &stem, &files, input.mtime)?,
        Os::Windows => write_zip(&partial, &stem, &files, input.mtime)?,
    }
    let archive_sum = sha256_hex(&std::fs::read(&partial)?);
    std::fs::rename(&partial, &archive_path)?;
    std::fs::write(
        dist.join(format!("{archive}.sha256")),
        sha256sums(&[(archive.clone(), archive_sum)]),
    )?;
    Ok(archive_path)
}

fn write_tar_gz(
    path: &Path,
    stem: &str,
    files: &[(String, Vec<u8>, bool)],
    mtime: u64,
) -> Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let encoder = flate2::write::GzEncoder::new(file, flate2::Compression::best());
    let mut builder = tar::Builder::new(encoder);
    // Directory entries first, parents before children (BTreeSet order), so every extractor
    // creates them with the intended mode.
    let mut dirs = std::collections::BTreeSet::from([stem.to_string()]);
    for (name, _, _) in files {
        for ancestor in Path::new(name).ancestors().skip(1) {
            if !ancestor.as_os_str().is_empty() {
                dirs.insert(format!("{stem}/{}", ancestor.to_string_lossy()));
            }
        }
    }
    for dir in &dirs {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Directory);
        header.set_mode(0o755);
        header.set_size(0);
        header.set_mtime(mtime);
        builder.append_data(&mut header, format!("{dir}/"), std::io::empty())?;
    }
    for (name, bytes, executable) in files {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(if *executable { 0o755 } else { 0o644 });
        header.set_size(bytes.len() as u64);
        header.set_mtime(mtime);
        builder.append_data(&mut header, format!("{stem}/{name}"), bytes.as_slice())?;
    }
    builder.into_inner()?.finish()?.sync_all()?;
    Ok(())
}

fn write_zip(path: &Path, stem: &str, files: &[(String, Vec<u8>, bool)], mtime: u64) -> Result<()> {
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut zip = zip::ZipWriter::new(file);
    let time = zip_time(mtime);
    for (name, bytes, executable) in files {
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Deflated)
            .last_modified_time(time)
            .unix_permissions(if *executable { 0o755 } else { 0o644 });
        zip.start_file(format!("{stem}/{name}"), options)?;
        zip.write_all(bytes)?;
    }
    zip.finish()?.sync_all()?;
    Ok(())
}

/// Converts seconds since the epoch to a zip (MS-DOS) timestamp; zip cannot hold dates before 1980.
fn zip_time(mtime: u64) -> zip::DateTime {
    let (year, month, day) = civil_from_days((mtime / 86_400) as i64);
    let secs = mtime % 86_400;
    zip::DateTime::from_date_and_time(
        (year as u16).max(1980),
        month as u8,
        day as u8,
        (secs / 3600) as u8,
        ((secs % 3600) / 60) as u8,
        (secs % 60) as u8,
    )
    .unwrap_or_default()
}

/// (year, month, day) of a day count since 1970-01-01 (proleptic Gregorian), as in Howard
/// Hinnant's date algorithms.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// The package's README: what the artifact is and how to run it.
fn readme(input: &PackageInput) -> String {
    let manifest = &input.manifest;
    let exe = input.os.exe_name();
    let mut text = format!(
        "# ember {version} for {target} ({os})\n\n\
         ember is a GGUF inference engine and OpenAI-compatible server. This archive is the build for\n\
         target `{target}` (family {family}: {description}).\n\n\
         ## Run\n\n\
         ```\n./{exe} info                    # this build's target, features and where it looks for a GPU\n\
         ./{exe} info -m MODEL.gguf       # plus what the model is\n```\n\n",
        version = input.version,
        target = input.target,
        os = input.os,
        family = manifest.family,
        description = manifest.family_description,
    );
    if manifest.kernels.dir.is_some() {
        text.push_str(&format!(
            "The GPU code objects are in `kernels/{}/`; keep that folder beside `{exe}` (or point\n\
             `EMBER_KERNELS_DIR` at it).\n\n",
            input.target
        ));
    }
    if !manifest.rocm.hip_runtime.is_empty() {
        text.push_str(&format!(
            "The HIP runtime is loaded at run time; this build tries {} in that order.\n\n",
            manifest.rocm.hip_runtime.join(", ")
        ));
    }
    text.push_str("## Features of this build\n\n");
    for feature in &manifest.features {
        text.push_str(&format!("- `{}`: {}", feature.name, feature.state));
        if let Some(reason) = &feature.reason {
            text.push_str(&format!(" ({reason})"));
        }
        for link in &feature.tracking {
            text.push_str(&format!(" <{link}>"));
        }
        text.push('\n');
    }
    text.push_str(
        "\n## Verify\n\n`sha256sum -c SHA256SUMS` in this folder checks every file; `manifest.json` records the\n\
         build (target, features, ROCm release, engine commit, toolchain versions, file checksums).\n\n\
         ## Licence\n\nMIT OR Apache-2.0, at your option (LICENSE-MIT, LICENSE-APACHE).\n",
    );
    text
}

/// Packages what `kernels` and the engine build left in `target/` for `target` and `os`.
pub fn package(
    root: &Path,
    target: &Target,
    os: Os,
    version: &str,
    manifest: BuildManifest,
) -> Result<PathBuf> {
    let binary = stamped_binary(os, &target.name);
    if !binary.is_file() {
        bail!(
            "expected the engine binary {}, found none: run `cargo xtask build --target {} --os {os}`",
            binary.display(),
            target.name
        );
    }
    let embedded = crate::manifest_slot::read(
        &std::fs::read(&binary).with_context(|| format!("reading {}", binary.display()))?,
    )
    .with_context(|| format!("reading the build manifest of {}", binary.display()))?;
    if embedded.as_deref() != Some(manifest.to_json().as_str()) {
        bail!(
            "the build manifest in {} differs from the one being packaged: rebuild with `cargo xtask build --target {} --os {os}`",
            binary.display(),
            target.name
        );
    }
    let kernel_objects = kernels::built_objects(target)?;
    if target.code_object_extension().is_some() && kernel_objects.is_empty() {
        bail!(
            "expected code objects in {} for {}, found none: run `cargo xtask kernels --target {}`",
            kernels::kernel_out_dir(&target.name).display(),
            target.name,
            target.name
        );
    }
    let module_names: Vec<String> = kernel_objects
        .iter()
        .filter_map(|p| p.file_name().and_then(|n| n.to_str()).map(str::to_string))
        .collect();
    if manifest.kernels.modules != module_names {
        bail!(
            "the embedded build manifest lists kernels {:?} but {} holds {:?}: rebuild with `cargo xtask build`",
            manifest.kernels.modules,
            kernels::kernel_out_dir(&target.name).display(),
            module_names
        );
    }
    let mut licenses = Vec::new();
    for name in LICENSE_FILES {
        let path = root.join(name);
        if !path.is_file() {
            bail!(
                "expected the licence file {} at the workspace root, found none",
                path.display()
            );
        }
        licenses.push(path);
    }
    let input = PackageInput {
        version: version.to_string(),
        os,
        target: target.name.clone(),
        binary,
        kernel_objects,
        licenses,
        manifest,
        mtime: source_date_epoch(root),
    };
    write_package(&input, &dist_dir())
}

/// The variable xtask passes the archive time to the builds it starts in.
pub const EPOCH_VAR: &str = "EMBER_SOURCE_DATE_EPOCH";

/// `$SOURCE_DATE_EPOCH`, else `$EMBER_SOURCE_DATE_EPOCH`, else the commit time, else now: every
/// archive entry gets this time.
///
/// xtask hands the time to the builds it starts (the container build, repro's second build) as
/// `EMBER_SOURCE_DATE_EPOCH`: cargo reruns build scripts that watch `SOURCE_DATE_EPOCH` (ring's,
/// through the cc crate) when it appears, which would compile the engine again for nothing.
pub fn source_date_epoch(root: &Path) -> u64 {
    for var in ["SOURCE_DATE_EPOCH", EPOCH_VAR] {
        if let Some(epoch) = std::env::var(var).ok().and_then(|v| v.parse().ok()) {
            return epoch;
        }
    }
    let commit_time = std::process::Command::new("git")
        .args(["log", "-1", "--format=%ct"])
        .current_dir(root)
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|s| s.trim().parse().ok());
    commit_time.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    })
}

impl crate::flags::Package {
    pub fn run(self, _sh: &Shell) -> Result<()> {
        let root = crate::project_root();
        let targets = crate::targets::load()?;
        let target = targets.target(&self.target)?;
        let os = self.os;
        let version = match self.release_version {
            Some(version) => version,
            None => manifest::workspace_version(&root)?,
        };
        // The manifest the engine was built with is the one to ship; a package must not claim
        // something the binary does not embed.
        let path = manifest::manifest_path(os, &target.name);
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading {} (written by `cargo xtask build --target {} --os {os}`)",
                path.display(),
                target.name
            )
        })?;
        let manifest: BuildManifest =
            serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        if manifest.engine.version != version {
            bail!(
                "expected the built engine to be version {version}, found {} in {}: rebuild with --release-version {version}",
                manifest.engine.version,
                path.display()
            );
        }
        let archive = package(&root, target, os, &version, manifest)?;
        println!("package: wrote {}", archive.display());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::manifest::BuildInfo;

    #[test]
    fn archive_names() {
        assert_eq!(
            archive_name("0.1.0", Os::Linux, "gfx1201"),
            "ember-0.1.0-linux-gfx1201-x64.tar.gz"
        );
        assert_eq!(
            archive_name("0.1.0", Os::Windows, "cpu"),
            "ember-0.1.0-windows-cpu-x64.zip"
        );
        assert_eq!(
            archive_name("1.2.3-rc.1", Os::Linux, "sm_90"),
            "ember-1.2.3-rc.1-linux-sm_90-x64.tar.gz"
        );
        let target_dir = Path::new("/w/target");
        assert_eq!(
            engine_binary(target_dir, Os::Linux, "x86_64-unknown-linux-gnu"),
            Path::new("/w/target/release/ember")
        );
        assert_eq!(
            engine_binary(target_dir, Os::Windows, "x86_64-pc-windows-gnu"),
            Path::new("/w/target/x86_64-pc-windows-gnu/release/ember.exe")
        );
    }

    #[test]
    fn sha256sums_format_is_what_sha256sum_reads() {
        let digest = sha256_hex(b"abc");
        assert_eq!(
            digest,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(
            sha256sums(&[
                ("ember".into(), digest.clone()),
                ("kernels/gfx1201/a.hsaco".into(), digest.clone())
            ]),
            format!("{digest}  ember\n{digest}  kernels/gfx1201/a.hsaco\n")
        );
    }

    #[test]
    fn zip_times_convert_from_the_epoch() {
        // 2026-11-30 06:39:25 UTC.
        let time = zip_time(1_796_020_765);
        assert_eq!((time.year(), time.month(), time.day()), (2026, 11, 30));
        assert_eq!((time.hour(), time.minute(), time.second()), (6, 39, 24)); // DOS time has 2 s steps
        assert_eq!(zip_time(0).year(), 1980);
    }

    fn fixture(os: Os, target: &str) -> (PathBuf, PackageInput) {
        let dir = std::env::temp_dir().join(format!(
            "ember-xtask-package-{}-{os}-{target}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("kernels")).unwrap();
        std::fs::write(dir.join("ember"), b"\x7fELF engine").unwrap();
        std::fs::write(dir.join("kernels").join("matmul.hsaco"), b"code object").unwrap();
        std::fs::write(dir.join("LICENSE-MIT"), b"MIT").unwrap();
        std::fs::write(dir.join("LICENSE-APACHE"), b"Apache").unwrap();
        let targets = crate::targets::load().unwrap();
        let info = BuildInfo {
            version: "0.1.0".into(),
            commit: Some("abc".into()),
            dirty: false,
            rustc: "rustc 1.90.0".into(),
            kernel_compiler: Some("clang 19".into()),
            toolchain_rocm: None,
            kernel_modules: vec!["matmul.hsaco".into()],
            dependencies: vec![],
        };
        let manifest =
            BuildManifest::new(&targets, targets.target(target).unwrap(), os, info).unwrap();
        let input = PackageInput {
            version: "0.1.0".into(),
            os,
            target: target.into(),
            binary: dir.join("ember"),
            kernel_objects: vec![dir.join("kernels").join("matmul.hsaco")],
            licenses: vec![dir.join("LICENSE-MIT"), dir.join("LICENSE-APACHE")],
            manifest,
            mtime: 1_796_020_765,
        };
        (dir, input)
    }

    #[test]
    fn linux_package_passes_sha256sum_and_lists_every_file() {
        let (dir, input) = fixture(Os::Linux, "gfx1201");
        let archive = write_package(&input, &dir.join("dist")).unwrap();
        assert_eq!(
            archive.file_name().unwrap(),
            "ember-0.1.0-linux-gfx1201-x64.tar.gz"
        );
        let unpacked = dir.join("unpacked");
        std::fs::create_dir_all(&unpacked).unwrap();
        let file = std::fs::File::open(&archive).unwrap();
        tar::Archive::new(flate2::read::GzDecoder::new(file))
            .unpack(&unpacked)
            .unwrap();
        let root = unpacked.join("ember-0.1.0-linux-gfx1201-x64");
        let mut names: Vec<String> = Vec::new();
        for entry in walk(&root) {
            names.push(
                entry
                    .strip_prefix(&root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
        }
        names.sort();
        assert_eq!(
            names,
            [
                "LICENSE-APACHE",
                "LICENSE-MIT",
                "README.md",
                "SHA256SUMS",
                "ember",
                "kernels/gfx1201/matmul.hsaco",
                "manifest.json"
            ]
        );
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(root.join("ember"))
                .unwrap()
                .permissions()
                .mode()
                & 0o777,
            0o755
        );

        // The real sha256sum accepts both checksum files.
        let status = std::process::Command::new("sha256sum")
            .arg("-c")
            .arg("--strict")
            .arg("SHA256SUMS")
            .current_dir(&root)
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}",
            String::from_utf8_lossy(&status.stdout)
        );
        let status = std::process::Command::new("sha256sum")
            .args([
                "-c",
                "--strict",
                "ember-0.1.0-linux-gfx1201-x64.tar.gz.sha256",
            ])
            .current_dir(dir.join("dist"))
            .output()
            .unwrap();
        assert!(
            status.status.success(),
            "{}",
            String::from_utf8_lossy(&status.stdout)
        );

        let manifest: PackageManifest =
            serde_json::from_slice(&std::fs::read(root.join("manifest.json")).unwrap()).unwrap();
        assert_eq!(manifest.archive, "ember-0.1.0-linux-gfx1201-x64.tar.gz");
        let listed: Vec<&str> = manifest.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            listed,
            [
                "LICENSE-APACHE",
                "LICENSE-MIT",
                "README.md",
                "ember",
                "kernels/gfx1201/matmul.hsaco"
            ]
        );
        assert_eq!(manifest.files[3].sha256, sha256_hex(b"\x7fELF engine"));
        assert_eq!(manifest.build.feature("vmm").unwrap().state, "off");
        let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
        assert!(
            readme.contains("- `vmm`: off (hipMemSetAccess fails"),
            "{readme}"
        );

        // Packaging twice from the same inputs gives the same bytes.
        let first = std::fs::read(&archive).unwrap();
        write_package(&input, &dir.join("dist")).unwrap();
        assert_eq!(std::fs::read(&archive).unwrap(), first);

        // Where the inputs and the output live does not enter the archive.
        let elsewhere = dir.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        let mut moved = input;
        for path in std::iter::once(&mut moved.binary)
            .chain(moved.kernel_objects.iter_mut())
            .chain(moved.licenses.iter_mut())
        {
            let copy = elsewhere.join(path.file_name().unwrap());
            std::fs::copy(&*path, &copy).unwrap();
            *path = copy;
        }
        let moved_archive = write_package(&moved, &elsewhere.join("dist")).unwrap();
        assert_eq!(std::fs::read(&moved_archive).unwrap(), first);

        // One flipped byte of the engine changes the archive's sum.
        let mut engine = std::fs::read(&moved.binary).unwrap();
        engine[1] ^= 1;
        std::fs::write(&moved.binary, engine).unwrap();
        let flipped = write_package(&moved, &elsewhere.join("dist")).unwrap();
        assert_ne!(
            sha256_hex(&std::fs::read(flipped).unwrap()),
            sha256_hex(&first)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn windows_package_is_a_zip_with_ember_exe() {
        let (dir, mut input) = fixture(Os::Windows, "gfx1151");
        input.kernel_objects.clear();
        input.manifest.kernels.modules.clear();
        let archive = write_package(&input, &dir.join("dist")).unwrap();
        assert_eq!(
            archive.file_name().unwrap(),
            "ember-0.1.0-windows-gfx1151-x64.zip"
        );
        let mut zip = zip::ZipArchive::new(std::fs::File::open(&archive).unwrap()).unwrap();
        let names: Vec<String> = zip.file_names().map(str::to_string).collect();
        assert!(
            names.contains(&"ember-0.1.0-windows-gfx1151-x64/ember.exe".to_string()),
            "{names:?}"
        );
        let mut manifest = String::new();
        std::io::Read::read_to_string(
            &mut zip
                .by_name("ember-0.1.0-windows-gfx1151-x64/manifest.json")
                .unwrap(),
            &mut manifest,
        )
        .unwrap();
        assert!(
            manifest.contains("amdhip64_6.dll") && manifest.contains("amdhip64_7.dll"),
            "{manifest}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn walk(dir: &Path) -> Vec<PathBuf> {
        let mut files = Vec::new();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                files.extend(walk(&path));
            } else {
                files.push(path);
            }
        }
        files
    }
}
