//! `cargo xtask release --dry-run [--targets a,b] [--base IMAGE]`: the release workflow
//! (.github/workflows/release.yml) rehearsed on one machine, with the same xtask commands the
//! workflow's jobs run, so what the release does can be run and tested anywhere (the approach of
//! cargo-dist's `dist build` and TheRock's local release builds).
//!
//! Stages, each timed: the Linux archive of every chosen target; the Windows zip of the CPU target
//! and of one GPU target; a smoke test of every archive; the images of the CPU target and of one
//! GPU target, each smoke-tested; then the release folder `release-dry-run/` under cargo's target
//! directory with the archives, `images.json` (each image's id and layer digests), the CycloneDX
//! SBOM, one `SHA256SUMS` over all of them and its signature with a throwaway Ed25519 key
//! (`sign.rs`). A failed smoke test fails the run before anything is summed or signed, as the
//! workflow's `publish` job needs every smoke job. The folder is then checked with
//! `cargo xtask verify`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde::Serialize;
use xshell::{cmd, Shell};

use crate::kernels::Toolchains;
use crate::manifest::{self, PackageManifest};
use crate::package;
use crate::sbom::{self, Tool};
use crate::targets::{Kind, Os, Target, Targets};

/// The release folder under cargo's target directory.
pub fn release_dir() -> PathBuf {
    crate::target_dir().join("release-dry-run")
}

/// The SBOM's file name in the release folder.
pub fn sbom_name(version: &str) -> String {
    format!("ember-{version}.cdx.json")
}

pub const IMAGES_FILE: &str = "images.json";

/// One image of the release as `images.json` records it.
#[derive(Debug, Clone, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct ImageRecord {
    pub target: String,
    pub tag: String,
    pub base: String,
    /// The image's id (the digest of its configuration).
    pub id: String,
    /// The digests of its file-system layers, base first.
    pub layers: Vec<String>,
}

struct Stages {
    timings: Vec<(String, f64)>,
}

impl Stages {
    fn run<T>(&mut self, name: &str, stage: impl FnOnce() -> Result<T>) -> Result<T> {
        println!("\n==> release: {name}");
        let started = Instant::now();
        let result = stage();
        let seconds = started.elapsed().as_secs_f64();
        self.timings.push((name.to_string(), seconds));
        println!("<== release: {name} ({seconds:.1} s)");
        result.with_context(|| format!("release stage `{name}` failed"))
    }
}

impl crate::flags::Release {
    pub fn run(self, sh: &Shell) -> Result<()> {
        // clap requires --dry-run; a real release is published by the workflow only.
        debug_assert!(self.dry_run);
        let root = crate::project_root();
        let targets = crate::targets::load()?;
        let version = manifest::workspace_version(&root)?;
        let selected: Vec<&Target> = if self.targets.is_empty() {
            buildable_targets(&targets)
        } else {
            self.targets
                .iter()
                .map(|name| targets.target(name))
                .collect::<Result<_>>()?
        };
        let names: Vec<&str> = selected.iter().map(|t| t.name.as_str()).collect();
        println!(
            "release: dry run of ember {version} for {}",
            names.join(", ")
        );
        let mut stages = Stages {
            timings: Vec::new(),
        };

        let mut archives: Vec<(PathBuf, Os, String)> = Vec::new();
        for target in &selected {
            let archive = stages.run(&format!("build {} (linux)", target.name), || {
                crate::build::build(sh, &root, &targets, &target.name, Os::Linux, &version)
            })?;
            archives.push((archive, Os::Linux, target.name.clone()));
        }
        for target in windows_targets(&selected) {
            let archive = stages.run(&format!("build {} (windows)", target.name), || {
                crate::build::build(sh, &root, &targets, &target.name, Os::Windows, &version)
            })?;
            archives.push((archive, Os::Windows, target.name.clone()));
        }

        // Every smoke test runs, then the run refuses to go on if any failed.
        let mut failures = Vec::new();
        for (archive, _, target) in &archives {
            let name = archive.file_name().map(|n| n.to_string_lossy().to_string());
            let result = stages.run(&format!("smoke {}", name.unwrap_or_default()), || {
                crate::flags::Smoke {
                    artifact: Some(archive.clone()),
                    image: None,
                    model: self.model.clone(),
                }
                .run(sh)
            });
            if let Err(error) = result {
                failures.push(format!("{target}: {error:#}"));
            }
        }

        let mut images = Vec::new();
        if self.no_images {
            println!("release: --no-images: the dry run builds no container images");
        } else {
            for target in image_targets(&selected) {
                let record = stages.run(&format!("image {}", target.name), || {
                    image(sh, &targets, target, self.base.as_deref(), &version)
                })?;
                let result = stages.run(&format!("smoke {}", record.tag), || {
                    crate::flags::Smoke {
                        artifact: None,
                        image: Some(record.tag.clone()),
                        model: self.model.clone(),
                    }
                    .run(sh)
                });
                if let Err(error) = result {
                    failures.push(format!("{}: {error:#}", record.tag));
                }
                images.push(record);
            }
        }
        if !failures.is_empty() {
            bail!(
                "the release is refused: {} smoke test(s) failed:\n  {}",
                failures.len(),
                failures.join("\n  ")
            );
        }

        let dir = release_dir();
        stages.run("release folder: SBOM, SHA256SUMS, signature", || {
            assemble(&root, &targets, &dir, &version, &archives, &images)
        })?;
        let summary = stages.run("verify the release folder", || {
            crate::verify::verify_release(&dir, &targets, None)
        })?;
        println!("verify: {}: {summary}", dir.display());

        println!("\nrelease: {}", dir.display());
        let mut entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<std::io::Result<_>>()?;
        entries.sort_by_key(std::fs::DirEntry::file_name);
        for entry in entries {
            println!(
                "  {:>12}  {}",
                entry.metadata()?.len(),
                entry.file_name().to_string_lossy()
            );
        }
        println!("release: stages");
        for (name, seconds) in &stages.timings {
            println!("  {seconds:>8.1} s  {name}");
        }
        Ok(())
    }
}

/// Every target this machine's toolchain builds: the CPU target always, AMDGPU targets that the
/// found kernel compiler supports, NVIDIA targets when nvcc is installed.
fn buildable_targets(targets: &Targets) -> Vec<&Target> {
    let mut toolchains = Toolchains::default();
    let amdgpu = toolchains.amdgpu().ok().cloned();
    let nvcc = toolchains.nvcc().ok().flatten().is_some();
    targets
        .targets
        .iter()
        .filter(|t| match t.kind {
            Kind::Cpu => true,
            Kind::Amdgpu => amdgpu.as_ref().is_some_and(|c| c.can_compile(t).is_ok()),
            Kind::Nvidia => nvcc,
        })
        .collect()
}

/// The CPU target and the first GPU target that has a Windows build, as the release's Windows
/// rehearsal.
fn windows_targets<'a>(selected: &[&'a Target]) -> Vec<&'a Target> {
    let cpu = selected.iter().find(|t| t.kind == Kind::Cpu);
    let gpu = selected
        .iter()
        .find(|t| t.kind != Kind::Cpu && t.supports(Os::Windows));
    cpu.into_iter().chain(gpu).copied().collect()
}

/// The CPU target and the first GPU target with an image (the release builds images for the
/// Linux targets).
fn image_targets<'a>(selected: &[&'a Target]) -> Vec<&'a Target> {
    let cpu = selected.iter().find(|t| t.kind == Kind::Cpu);
    let gpu = selected
        .iter()
        .find(|t| t.kind == Kind::Amdgpu && t.supports(Os::Linux));
    cpu.into_iter().chain(gpu).copied().collect()
}

/// Builds `target`'s image (`cargo xtask docker`) and records what it is made of.
fn image(
    sh: &Shell,
    targets: &Targets,
    target: &Target,
    base: Option<&str>,
    version: &str,
) -> Result<ImageRecord> {
    let base = match base {
        Some(base) => base.to_string(),
        None => targets.default_base_image(target)?.reference(),
    };
    crate::flags::Docker {
        target: target.name.clone(),
        base: Some(base.clone()),
        check_reproducible: false,
    }
    .run(sh)?;
    let tag = crate::docker::image_tag(version, &target.name);
    let id_format = "{{.Id}}";
    let layers_format = "{{json .RootFS.Layers}}";
    let id = cmd!(sh, "docker image inspect --format {id_format} {tag}")
        .quiet()
        .read()?;
    let layers = cmd!(sh, "docker image inspect --format {layers_format} {tag}")
        .quiet()
        .read()?;
    let layers: Vec<String> =
        serde_json::from_str(&layers).with_context(|| format!("reading {tag}'s layers"))?;
    Ok(ImageRecord {
        target: target.name.clone(),
        tag,
        base,
        id: id.trim().to_string(),
        layers,
    })
}

/// Writes the release folder: archives, `images.json`, the SBOM, `SHA256SUMS` and its signature.
fn assemble(
    root: &Path,
    targets: &Targets,
    dir: &Path,
    version: &str,
    archives: &[(PathBuf, Os, String)],
    images: &[ImageRecord],
) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    let mut tools = Vec::new();
    let mut crates = Vec::new();
    let mut oses = Vec::new();
    for (archive, os, _) in archives {
        let name = archive
            .file_name()
            .context("archive path has a file name")?;
        std::fs::copy(archive, dir.join(name))
            .with_context(|| format!("copying {}", archive.display()))?;
        let manifest = archive_manifest(archive)?;
        tools.push(Tool {
            kind: "application",
            name: "rustc".into(),
            version: manifest.build.toolchain.rustc.clone(),
            role: "Rust compiler".into(),
        });
        if let Some(compiler) = &manifest.build.toolchain.kernel_compiler {
            tools.push(Tool {
                kind: "application",
                name: match manifest.build.kind {
                    Kind::Nvidia => "nvcc".into(),
                    _ => "amdgpu-kernel-compiler".into(),
                },
                version: compiler.clone(),
                role: format!("kernel compiler ({})", manifest.build.target),
            });
        }
        if !oses.contains(os) {
            oses.push(*os);
        }
    }
    for os in oses {
        crates.extend(sbom::engine_crates(
            root,
            &targets.platform(os)?.rust_target,
        )?);
    }
    crates.sort();
    crates.dedup();
    for image in images {
        tools.push(Tool {
            kind: "container",
            name: image.base.clone(),
            version: image.layers.first().cloned().unwrap_or_default(),
            role: format!("base image of {}", image.tag),
        });
    }
    let mut images_json = serde_json::to_string_pretty(images)?;
    images_json.push('\n');
    std::fs::write(dir.join(IMAGES_FILE), images_json)?;
    let epoch = package::source_date_epoch(root);
    std::fs::write(
        dir.join(sbom_name(version)),
        sbom::cyclonedx(version, &crates, &tools, epoch)?,
    )?;
    write_sums_and_sign(dir, &crate::sign::ThrowawayKey::generate()?)
}

/// `SHA256SUMS` over every file of `dir` (sorted by name), then its signature with `key`.
pub fn write_sums_and_sign(dir: &Path, key: &crate::sign::ThrowawayKey) -> Result<()> {
    let mut entries = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().to_string();
        if crate::verify::UNSUMMED.contains(&name.as_str()) || !entry.file_type()?.is_file() {
            continue;
        }
        let bytes = std::fs::read(entry.path())?;
        entries.push((name, package::sha256_hex(&bytes)));
    }
    entries.sort();
    std::fs::write(dir.join("SHA256SUMS"), package::sha256sums(&entries))?;
    key.sign_release(dir)
}

/// The `manifest.json` inside an archive.
pub fn archive_manifest(archive: &Path) -> Result<PackageManifest> {
    let name = archive
        .file_name()
        .and_then(|n| n.to_str())
        .context("archive name is not UTF-8")?;
    let stem = name
        .strip_suffix(".tar.gz")
        .or_else(|| name.strip_suffix(".zip"))
        .with_context(|| format!("expected a .tar.gz or .zip archive, found {name}"))?;
    let inner = format!("{stem}/manifest.json");
    let file =
        std::fs::File::open(archive).with_context(|| format!("opening {}", archive.display()))?;
    let text = if name.ends_with(".zip") {
        let mut zip = zip::ZipArchive::new(file)?;
        let mut entry = zip
            .by_name(&inner)
            .with_context(|| format!("{name}: no {inner}"))?;
        let mut text = String::new();
        std::io::Read::read_to_string(&mut entry, &mut text)?;
        text
    } else {
        let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(file));
        let mut found = None;
        for entry in tar.entries()? {
            let mut entry = entry?;
            if entry.path()?.to_string_lossy() == inner {
                let mut text = String::new();
                std::io::Read::read_to_string(&mut entry, &mut text)?;
                found = Some(text);
                break;
            }
        }
        found.with_context(|| format!("{name}: no {inner}"))?
    };
    serde_json::from_str(&text)
        .with_context(|| format!("{name}: {inner} is not a package manifest"))
}
