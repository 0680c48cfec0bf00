//! `cargo xtask build --target T --in-container [--image IMAGE | --build-base BASE]`: the whole
//! build (`cargo xtask build` itself, kernels, engine, package) run inside a build image, so a
//! release is made with the toolchain of the image that targets.toml names, not with whatever the
//! host has installed (the reports behind this project: weights left in system RAM with local
//! ROCm 7.11 to 7.14, placed correctly in the official 7.2.1 container).
//!
//! Images: the official `rocm/dev-*` build image of the default ROCm release in targets.toml (the
//! default), any `--image`, or the project's own `docker/build.Dockerfile` built on `--build-base`
//! (how CI runs it here, where the official images cannot be pulled).
//!
//! The container: no network (`--network none`, cargo `--offline` against the host's registry
//! cache), the checkout mounted read-only, and the checkout, cargo's target directory, cargo's home
//! and the Rust toolchain mounted at the paths they have on the host. Same paths mean the same
//! path remapping (`build::remap_flags`), so the container's artifacts can equal the host's byte for
//! byte, and cargo's fingerprints match, so an engine the host already compiled with the same
//! toolchain and flags is reused rather than compiled again. The Rust toolchain is the host's (one
//! rustc for host and container builds, and none needs to be downloaded into an image); the kernel
//! toolchain, the C compiler and linker and the system libraries are the image's. Outputs land in
//! `dist/` under cargo's target directory, as with a host build. The container runs as the
//! calling user, so nothing it writes is owned by root.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use xshell::{cmd, Shell};

use crate::targets::{Os, Target, Targets};

/// The project's build image definition.
pub const BUILD_DOCKERFILE: &str = "docker/build.Dockerfile";

/// Which image a container build runs in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildImage {
    /// An image by reference (the official one by default).
    Image(String),
    /// `docker/build.Dockerfile` built on this base.
    Project { base: String },
}

impl BuildImage {
    /// `--image`, else `--build-base`, else the official build image of the default ROCm release.
    pub fn choose(targets: &Targets, image: Option<String>, build_base: Option<String>) -> Self {
        match (image, build_base) {
            (Some(image), _) => BuildImage::Image(image),
            (None, Some(base)) => BuildImage::Project { base },
            (None, None) => BuildImage::Image(targets.default_rocm().build_image.reference()),
        }
    }

    fn describe(&self) -> String {
        match self {
            BuildImage::Image(image) => image.clone(),
            BuildImage::Project { base } => format!("{BUILD_DOCKERFILE} on {base}"),
        }
    }
}

/// Whether a docker client with a running daemon is here.
pub fn docker_available(sh: &Shell) -> bool {
    crate::toolchain::which("docker").is_some()
        && cmd!(sh, "docker info")
            .quiet()
            .ignore_stdout()
            .ignore_stderr()
            .run()
            .is_ok()
}

/// Builds `docker/build.Dockerfile` on `base` (once: the tag is a digest of the Dockerfile, the
/// setup script it runs and the base image's id) and returns its tag.
pub fn project_image(sh: &Shell, root: &Path, base: &str) -> Result<String> {
    let dockerfile = std::fs::read(root.join(BUILD_DOCKERFILE))
        .with_context(|| format!("reading {BUILD_DOCKERFILE}"))?;
    let setup =
        std::fs::read(root.join(".ci/setup-kernels.sh")).context("reading .ci/setup-kernels.sh")?;
    let id_format = "{{.Id}}";
    let base_id = cmd!(sh, "docker image inspect --format {id_format} {base}")
        .quiet()
        .read()
        .with_context(|| {
            format!(
                "base image {base} not found (.ci/setup-docker.sh makes ember-test-base:bookworm)"
            )
        })?;
    let mut hasher_input = dockerfile;
    hasher_input.extend_from_slice(&setup);
    hasher_input.extend_from_slice(base_id.as_bytes());
    let digest = crate::package::sha256_hex(&hasher_input);
    let tag = format!("ember-build:{}", &digest[..16]);
    if cmd!(sh, "docker image inspect {tag}")
        .quiet()
        .ignore_stdout()
        .ignore_stderr()
        .run()
        .is_ok()
    {
        println!("build: build image {tag} exists");
        return Ok(tag);
    }
    let context = crate::target_dir().join("build-image-context");
    let _ = std::fs::remove_dir_all(&context);
    std::fs::create_dir_all(&context)?;
    std::fs::copy(root.join(BUILD_DOCKERFILE), context.join("Dockerfile"))?;
    std::fs::copy(
        root.join(".ci/setup-kernels.sh"),
        context.join("setup-kernels.sh"),
    )?;
    println!("build: building the build image {tag} on {base}");
    cmd!(
        sh,
        "docker build --build-arg BASE_IMAGE={base} --tag {tag} {context}"
    )
    .run()
    .with_context(|| format!("building {BUILD_DOCKERFILE} on {base}"))?;
    std::fs::remove_dir_all(&context)?;
    Ok(tag)
}

/// The Rust toolchain that runs this xtask: rustup's home and the active toolchain's name, both
/// mounted or passed into the container so it runs the very same rustc and cargo.
struct RustToolchain {
    rustup_home: PathBuf,
    cargo_home: PathBuf,
    name: String,
}

impl RustToolchain {
    fn find() -> Result<RustToolchain> {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let rustup_home = std::env::var_os("RUSTUP_HOME")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".rustup")))
            .context("neither RUSTUP_HOME nor HOME is set")?;
        let cargo_home = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".cargo")))
            .context("neither CARGO_HOME nor HOME is set")?;
        // The sysroot is <rustup home>/toolchains/<name>: the name pins the toolchain inside.
        let sysroot = crate::toolchain::rustc_sysroot()?;
        let name = sysroot
            .strip_prefix(rustup_home.join("toolchains"))
            .ok()
            .and_then(|rest| rest.iter().next())
            .map(|n| n.to_string_lossy().to_string())
            .with_context(|| {
                format!(
                    "the Rust toolchain at {} is not a rustup toolchain under {}: a container build mounts rustup's",
                    sysroot.display(),
                    rustup_home.display()
                )
            })?;
        Ok(RustToolchain {
            rustup_home,
            cargo_home,
            name,
        })
    }
}

/// Runs `cargo xtask build --target T --os linux` inside `image`; returns the archive's path.
pub fn build(
    sh: &Shell,
    root: &Path,
    target: &Target,
    os: Os,
    version: &str,
    image: &BuildImage,
) -> Result<PathBuf> {
    if os != Os::Linux {
        bail!(
            "--in-container builds Linux artifacts; {os} artifacts are built on their own runners"
        );
    }
    if !docker_available(sh) {
        bail!("--in-container needs docker with a running daemon (.ci/setup-docker.sh starts one), found none");
    }
    let reference = match image {
        BuildImage::Image(image) => image.clone(),
        BuildImage::Project { base } => project_image(sh, root, base)?,
    };
    println!(
        "build: building {} in the container {reference} ({})",
        target.name,
        image.describe()
    );
    // The container has no network: every crate must be in cargo's cache before it starts.
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    cmd!(sh, "{cargo} fetch --locked").quiet().run().context(
        "fetching the locked crates into cargo's cache before the (offline) container build",
    )?;
    let rust = RustToolchain::find()?;
    let target_dir = crate::target_dir();
    std::fs::create_dir_all(&target_dir)?;
    let (commit, dirty) = crate::manifest::git_state(root);
    let epoch = crate::package::source_date_epoch(root);

    let mut args: Vec<String> = vec![
        "run".into(),
        "--rm".into(),
        "--network".into(),
        "none".into(),
        "--user".into(),
        format!("{}:{}", id("-u")?, id("-g")?),
    ];
    let mut mount = |host: &Path, read_only: bool| {
        args.push("--volume".into());
        args.push(format!(
            "{0}:{0}{1}",
            host.display(),
            if read_only { ":ro" } else { "" }
        ));
    };
    mount(root, true);
    mount(&target_dir, false);
    mount(&rust.rustup_home, true);
    mount(&rust.cargo_home, false);
    let mut env = vec![
        (
            "HOME".to_string(),
            target_dir.join("container-home").display().to_string(),
        ),
        ("RUSTUP_HOME".into(), rust.rustup_home.display().to_string()),
        ("RUSTUP_TOOLCHAIN".into(), rust.name.clone()),
        ("CARGO_HOME".into(), rust.cargo_home.display().to_string()),
        ("CARGO_TARGET_DIR".into(), target_dir.display().to_string()),
        ("CARGO_NET_OFFLINE".into(), "true".into()),
        (crate::package::EPOCH_VAR.into(), epoch.to_string()),
        ("EMBER_BUILD_COMMIT".into(), commit.unwrap_or_default()),
        ("EMBER_BUILD_DIRTY".into(), dirty.to_string()),
    ];
    // The caller's compiler flags go in unchanged: with the same paths they give the same bytes.
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CFLAGS",
        "CXXFLAGS",
        "SOURCE_DATE_EPOCH",
    ] {
        if let Ok(value) = std::env::var(var) {
            env.push((var.into(), value));
        }
    }
    std::fs::create_dir_all(target_dir.join("container-home"))?;
    for (key, value) in env {
        args.push("--env".into());
        args.push(format!("{key}={value}"));
    }
    args.push("--workdir".into());
    args.push(root.display().to_string());
    args.push(reference.clone());
    // PATH: the image's own, after cargo's bin (rustup's proxies).
    let cargo_bin = rust.cargo_home.join("bin");
    let script = format!(
        "export PATH={}:$PATH; exec cargo xtask build --target {} --os linux --release-version {version}",
        cargo_bin.display(),
        target.name
    );
    args.extend(["sh".into(), "-c".into(), script]);
    cmd!(sh, "docker {args...}")
        .run()
        .with_context(|| format!("building {} in {reference}", target.name))?;
    let archive = crate::package::archive_path(version, os, &target.name);
    if !archive.is_file() {
        bail!(
            "the container build of {} finished but left no {}",
            target.name,
            archive.display()
        );
    }
    println!("build: {} was built in {reference}", archive.display());
    Ok(archive)
}

fn id(flag: &str) -> Result<String> {
    let output = std::process::Command::new("id")
        .arg(flag)
        .output()
        .context("running `id`")?;
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_build_image_is_the_default_rocm_release_s() {
        let targets = crate::targets::load().unwrap();
        let official = targets.default_rocm().build_image.reference();
        assert!(official.starts_with("rocm/dev-"), "{official}");
        assert_eq!(
            BuildImage::choose(&targets, None, None),
            BuildImage::Image(official)
        );
        assert_eq!(
            BuildImage::choose(&targets, None, Some("base".into())),
            BuildImage::Project {
                base: "base".into()
            }
        );
        assert_eq!(
            BuildImage::choose(&targets, Some("img".into()), Some("base".into())),
            BuildImage::Image("img".into())
        );
    }
}
