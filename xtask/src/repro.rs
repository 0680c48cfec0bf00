//! `cargo xtask repro [--targets cpu,gfx1201]`: two builds of one commit give the same bytes.
//!
//! Build A is this checkout's, in cargo's target directory (`cargo xtask build`, which reuses
//! what earlier steps compiled). Build B is the same tree (every file git tracks) copied into a
//! folder elsewhere, built by this very xtask (`EMBER_PROJECT_ROOT`) with a clean target directory
//! given through `CARGO_TARGET_DIR`: other paths for the sources, the build outputs and the kernels,
//! nothing shared but the Rust toolchain and cargo's registry. Both date archive entries from
//! the commit. The archives' SHA-256 must be equal; when they are not, the files inside that differ
//! are named. Then one byte of a kernel source in B's copy is changed (the first digit after the
//! point of a float literal in `kernels/elementwise.hip`) and the AMDGPU targets are built again:
//! their sums must now differ, which shows the comparison can fail.
//!
//! With `--base IMAGE`, each target's image is built from A's archive and sources and from B's,
//! both with `--no-cache`, and their file layers must have the same digests.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, ensure, Context, Result};
use xshell::{cmd, Shell};

use crate::package;
use crate::targets::{Kind, Os};

/// The kernel source whose byte the flip test changes.
const FLIP_SOURCE: &str = "kernels/elementwise.hip";

impl crate::flags::Repro {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let root = crate::project_root();
        let targets = crate::targets::load()?;
        let version = crate::manifest::workspace_version(&root)?;
        let (commit, dirty) = crate::manifest::git_state(&root);
        let commit = commit.context("repro needs a git checkout: found no commit")?;
        let epoch = package::source_date_epoch(&root);
        for name in &self.targets {
            targets.target(name)?;
        }

        let mut a = BTreeMap::new();
        for name in &self.targets {
            let archive = crate::build::build(sh, &root, &targets, name, Os::Linux, &version)?;
            a.insert(name.clone(), archive);
        }

        let work = crate::target_dir().join("repro");
        let source = work.join(format!("src-{}", &commit[..12]));
        let target_dir = work.join("target-b");
        for dir in [&source, &target_dir] {
            if dir.exists() {
                std::fs::remove_dir_all(dir)
                    .with_context(|| format!("removing {}", dir.display()))?;
            }
        }
        copy_tracked_files(sh, &root, &source)?;

        let started = std::time::Instant::now();
        let b = build_b(
            sh,
            &source,
            &target_dir,
            (&commit, dirty),
            epoch,
            &self.targets,
            &version,
        )?;
        println!(
            "repro: build B (clean target directory) took {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let mut problems = Vec::new();
        for name in &self.targets {
            let (sum_a, sum_b) = (sha256_file(&a[name])?, sha256_file(&b[name])?);
            println!(
                "repro: {name}\n  A {sum_a}  {}\n  B {sum_b}  {}",
                a[name].display(),
                b[name].display()
            );
            if sum_a != sum_b {
                problems.push(format!("{name}: {}", differing_files(&a[name], &b[name])?));
            }
        }
        ensure!(
            problems.is_empty(),
            "the two builds differ:\n  {}",
            problems.join("\n  ")
        );
        println!(
            "repro: A and B are byte-identical for {}",
            self.targets.join(", ")
        );
        if let Some(base) = &self.base {
            compare_images(
                sh,
                (&root, &a),
                (&source, &b),
                (&version, epoch),
                base,
                &target_dir,
            )?;
        }

        if self.no_flip {
            remove_work(&work);
            return Ok(());
        }
        let gpu: Vec<String> = self
            .targets
            .iter()
            .filter(|t| targets.target(t).is_ok_and(|t| t.kind == Kind::Amdgpu))
            .cloned()
            .collect();
        ensure!(
            !gpu.is_empty(),
            "the flipped-byte build needs an AMDGPU target among --targets (or pass --no-flip)"
        );
        let flipped = flip_one_byte(&source.join(FLIP_SOURCE))?;
        println!("repro: flipped one byte of {FLIP_SOURCE} in B's copy: {flipped}");
        let c = build_b(
            sh,
            &source,
            &target_dir,
            (&commit, dirty),
            epoch,
            &gpu,
            &version,
        )?;
        for name in &gpu {
            let (sum_a, sum_c) = (sha256_file(&a[name])?, sha256_file(&c[name])?);
            println!("repro: {name} after the flip\n  A {sum_a}\n  B {sum_c}");
            if sum_a == sum_c {
                bail!("{name}: the archive built from the changed source has the same SHA-256 as the original: the comparison cannot tell builds apart");
            }
        }
        println!("repro: the flipped byte changes the sums, as it must");
        remove_work(&work);
        Ok(())
    }
}

/// Builds each target's image twice with `--no-cache`: from A's archive with this checkout's
/// `docker/` files, and from B's archive with B's copy, its build context in B's target directory;
/// their file layers must have the same digests (the image configs differ in their `created`
/// times, which the issue does not ask to fix).
fn compare_images(
    sh: &Shell,
    (root_a, a): (&Path, &BTreeMap<String, PathBuf>),
    (root_b, b): (&Path, &BTreeMap<String, PathBuf>),
    (version, epoch): (&str, u64),
    base: &str,
    target_dir_b: &Path,
) -> Result<()> {
    let mut problems = Vec::new();
    for (name, archive_a) in a {
        let started = std::time::Instant::now();
        let layers_a = crate::docker::fresh_image_layers(
            sh,
            (root_a, archive_a),
            (name, version),
            base,
            epoch,
            (
                &crate::target_dir()
                    .join("docker-context")
                    .join(format!("{name}-repro-a")),
                &format!("ember-repro-a:{version}-{name}"),
            ),
        )?;
        let layers_b = crate::docker::fresh_image_layers(
            sh,
            (root_b, &b[name]),
            (name, version),
            base,
            epoch,
            (
                &target_dir_b
                    .join("docker-context")
                    .join(format!("{name}-repro-b")),
                &format!("ember-repro-b:{version}-{name}"),
            ),
        )?;
        let differences = crate::docker::compare_layers(&layers_a, &layers_b);
        println!(
            "repro: {name}'s images on {base} (A's, then B's archive and sources): {} ({:.1} s)",
            if differences.is_empty() {
                format!("the same {} file layers", layers_a.len())
            } else {
                differences.join("; ")
            },
            started.elapsed().as_secs_f64()
        );
        if !differences.is_empty() {
            problems.push(format!("{name}'s image: {}", differences.join("; ")));
        }
    }
    ensure!(
        problems.is_empty(),
        "the two builds' images have different file layers (see them with `docker save`):\n  {}",
        problems.join("\n  ")
    );
    Ok(())
}

/// Removes B's copy of the sources and its target directory once the comparisons passed (a
/// second engine build is gigabytes that a small CI disk needs for the steps after this one); a
/// failed comparison keeps them for inspection.
fn remove_work(work: &Path) {
    match std::fs::remove_dir_all(work) {
        Ok(()) => println!("repro: removed {}", work.display()),
        Err(error) => println!("repro: could not remove {}: {error}", work.display()),
    }
}

/// Runs this xtask's `build` for `names` on the checkout `source` with cargo's target directory
/// at `target_dir`; returns each target's archive.
fn build_b(
    sh: &Shell,
    source: &Path,
    target_dir: &Path,
    (commit, dirty): (&str, bool),
    epoch: u64,
    names: &[String],
    version: &str,
) -> Result<BTreeMap<String, PathBuf>> {
    let xtask = std::env::current_exe().context("locating the xtask executable")?;
    let mut archives = BTreeMap::new();
    for name in names {
        // Only the variables that decide the build are set; the caller's path remapping (which
        // names A's folders) is replaced by the one xtask derives for B's.
        cmd!(sh, "{xtask} build --target {name} --os linux")
            .env("EMBER_PROJECT_ROOT", source)
            .env("CARGO_TARGET_DIR", target_dir)
            .env(package::EPOCH_VAR, epoch.to_string())
            .env("EMBER_BUILD_COMMIT", commit)
            .env("EMBER_BUILD_DIRTY", dirty.to_string())
            .env_remove("RUSTFLAGS")
            .env_remove("CARGO_ENCODED_RUSTFLAGS")
            .env_remove("CFLAGS")
            .env_remove("CXXFLAGS")
            .run()
            .with_context(|| format!("build B of {name} in {}", source.display()))?;
        let archive = target_dir
            .join("dist")
            .join(package::archive_name(version, Os::Linux, name));
        ensure!(
            archive.is_file(),
            "build B of {name} left no {}",
            archive.display()
        );
        archives.insert(name.clone(), archive);
    }
    Ok(archives)
}

/// Copies every file git tracks, as it is in the working tree (so uncommitted changes are built by
/// both A and B, and both manifests say `dirty`), into `dest`.
fn copy_tracked_files(sh: &Shell, root: &Path, dest: &Path) -> Result<()> {
    let listed = cmd!(sh, "git -C {root} ls-files -z").quiet().read()?;
    for name in listed.split('\0').filter(|n| !n.is_empty()) {
        let from = root.join(name);
        if !from.is_file() {
            // Deleted in the working tree, or a submodule.
            continue;
        }
        let to = dest.join(name);
        std::fs::create_dir_all(to.parent().context("a tracked file has a parent")?)?;
        std::fs::copy(&from, &to).with_context(|| format!("copying {name}"))?;
    }
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String> {
    Ok(package::sha256_hex(
        &std::fs::read(path).with_context(|| format!("reading {}", path.display()))?,
    ))
}

/// The files whose records differ between the two archives' manifest.json, or why the archives
/// differ when every file matches (entry metadata).
pub fn differing_files(a: &Path, b: &Path) -> Result<String> {
    let (ma, mb) = (
        crate::release::archive_manifest(a)?,
        crate::release::archive_manifest(b)?,
    );
    let records = |m: &crate::manifest::PackageManifest| -> BTreeMap<String, String> {
        m.files
            .iter()
            .map(|f| (f.path.clone(), f.sha256.clone()))
            .collect()
    };
    let (ra, rb) = (records(&ma), records(&mb));
    let mut names: Vec<String> = ra
        .keys()
        .chain(rb.keys())
        .filter(|k| ra.get(*k) != rb.get(*k))
        .cloned()
        .collect();
    names.dedup();
    if ma.build != mb.build {
        names.push("manifest.json (build manifest)".into());
    }
    Ok(if names.is_empty() {
        "every file is the same: the archives differ in entry metadata or compression".into()
    } else {
        format!("differing files: {}", names.join(", "))
    })
}

/// Changes the first digit after the point of the first float literal (`1.25f`) in `path`, by one;
/// returns a description of the change.
fn flip_one_byte(path: &Path) -> Result<String> {
    let mut bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let at = find_float_digit(&bytes)
        .with_context(|| format!("{}: no float literal like 1.5f to change", path.display()))?;
    let before = bytes[at];
    bytes[at] = if before == b'9' { b'0' } else { before + 1 };
    std::fs::write(path, &bytes)?;
    let line = bytes[..at].iter().filter(|&&b| b == b'\n').count() + 1;
    Ok(format!(
        "line {line}: '{}' -> '{}'",
        before as char, bytes[at] as char
    ))
}

/// The index of the first digit after the point in the first `D.DDDf` literal outside comments.
fn find_float_digit(bytes: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(bytes).ok()?;
    let mut offset = 0;
    for line in text.split_inclusive('\n') {
        let code = line.split("//").next().unwrap_or("");
        let b = code.as_bytes();
        for i in 1..b.len().saturating_sub(2) {
            if b[i] == b'.' && b[i - 1].is_ascii_digit() && b[i + 1].is_ascii_digit() {
                let end = b[i + 1..].iter().position(|c| !c.is_ascii_digit())? + i + 1;
                if b.get(end) == Some(&b'f') {
                    return Some(offset + i + 1);
                }
            }
        }
        offset += line.len();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flip_changes_a_float_literal_outside_comments() {
        let text = b"// 1.5f in a comment\nfloat x = a * 0.79f;\n";
        let at = find_float_digit(text).unwrap();
        assert_eq!(&text[at..at + 3], b"79f");
        assert_eq!(find_float_digit(b"int x = 3; // 1.5f\n"), None);
    }

    #[test]
    fn the_kernel_source_has_a_literal_to_flip() {
        let text = std::fs::read(crate::project_root().join(FLIP_SOURCE)).unwrap();
        assert!(find_float_digit(&text).is_some());
    }
}
