//! Every xtask flag, declared in one place; the doc comments are the `--help` text.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

use crate::targets::{Os, Selection};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "ember's build-and-release toolchain")]
pub struct Xtask {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Compile kernels/*.hip into verified code objects under target/kernels/<target>/.
    Kernels(Kernels),
    /// Build one target: its kernels, the engine with the target's build manifest, and the package.
    Build(Build),
    /// Package an already built engine and kernels into target/dist/.
    Package(Package),
    /// Print the release matrix generated from targets.toml and write it into the release
    /// workflow; with --check, fail instead of writing when the workflow has drifted.
    Matrix(Matrix),
    /// Run every test of the project: models, cargo tests, then the toolchain checks.
    Test(Test),
    /// Build the container image for one target from docker/Dockerfile.
    Docker(Docker),
    /// Run an artifact or an image against a real model and check what it reports.
    Smoke(Smoke),
    /// Check a downloaded archive or unpacked package: checksums, manifest.json, the manifest
    /// inside the binary, and the features against targets.toml.
    Verify(Verify),
    /// Install the host toolchain that builds GPU kernels (clang-19, HIP headers, ROCm device
    /// libraries) on Debian or Ubuntu; with --all, everything `cargo xtask test` needs.
    Setup(Setup),
    /// Rehearse the release workflow on this machine: archives, images, smoke tests, one
    /// SHA256SUMS, a CycloneDX SBOM and a signature with a throwaway key, in target/release-dry-run/.
    Release(Release),
    /// Check that builds are reproducible: build the targets again from a copy of the commit in
    /// another folder with a clean target directory (CARGO_TARGET_DIR), compare the archives'
    /// SHA-256, then flip one byte of a kernel source there and show that the sums differ.
    Repro(Repro),
}

/// Which targets to act on: exactly one of --target, --family, --all.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
pub struct TargetSelection {
    /// One target from targets.toml (gfx1201, sm_90, cpu, ...).
    #[arg(long)]
    pub target: Option<String>,
    /// Every target of one family from targets.toml (gfx120X, cdna, ...).
    #[arg(long)]
    pub family: Option<String>,
    /// Every target in targets.toml.
    #[arg(long)]
    pub all: bool,
}

impl TargetSelection {
    pub fn selection(&self) -> Selection {
        match (&self.target, &self.family) {
            (Some(target), _) => Selection::Target(target.clone()),
            (None, Some(family)) => Selection::Family(family.clone()),
            (None, None) => Selection::All,
        }
    }
}

#[derive(Debug, clap::Args)]
pub struct Kernels {
    #[command(flatten)]
    pub selection: TargetSelection,
}

#[derive(Debug, clap::Args)]
pub struct Build {
    /// The target (from targets.toml) to build.
    #[arg(long)]
    pub target: String,
    /// The operating system the artifact is for; windows cross-compiles ember.exe.
    #[arg(long, value_enum, default_value_t = Os::Linux)]
    pub os: Os,
    /// The version in the artifact's name and manifest; defaults to the workspace version.
    #[arg(long)]
    pub release_version: Option<String>,
    /// Run the whole build inside the build image (docker): the official ROCm build image that
    /// targets.toml names for the default ROCm release, unless --image or --build-base says
    /// otherwise. Without this flag a GPU build falls back to it when this machine has no kernel
    /// toolchain and docker is here.
    #[arg(long)]
    pub in_container: bool,
    /// The build image for --in-container.
    #[arg(long, env = "EMBER_BUILD_IMAGE")]
    pub image: Option<String>,
    /// Build the project's build image (docker/build.Dockerfile) on this base and build in it.
    #[arg(long, env = "EMBER_BUILD_BASE", conflicts_with = "image")]
    pub build_base: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct Package {
    /// The target (from targets.toml) whose built engine and kernels to package.
    #[arg(long)]
    pub target: String,
    /// The operating system the artifact is for.
    #[arg(long, value_enum, default_value_t = Os::Linux)]
    pub os: Os,
    /// The version in the artifact's name and manifest; defaults to the workspace version.
    #[arg(long)]
    pub release_version: Option<String>,
}

#[derive(Debug, clap::Args)]
pub struct Matrix {
    /// Fail when the committed release workflow differs from what targets.toml generates,
    /// instead of rewriting it.
    #[arg(long)]
    pub check: bool,
    /// Also fail when an image the release builds on is not pinned by digest.
    #[arg(long)]
    pub require_pinned: bool,
    /// The targets file to generate from (default: targets.toml at the workspace root).
    #[arg(long)]
    pub targets: Option<PathBuf>,
    /// The workflow to write or check (default: .github/workflows/release.yml).
    #[arg(long)]
    pub workflow: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct Test {
    /// Run only the model fetch and the cargo tests, not the toolchain checks (kernels, builds,
    /// wine, matrix, actionlint, docker).
    #[arg(long)]
    pub skip_toolchain: bool,
    /// Run only the toolchain checks (for iterating on xtask, kernels or packaging).
    #[arg(long, conflicts_with = "skip_toolchain")]
    pub toolchain_only: bool,
    /// The base image for the container check (built by .ci/setup-docker.sh).
    #[arg(long, default_value = "ember-test-base:bookworm")]
    pub base: String,
    /// The model (a name from models.toml) the artifact checks run.
    #[arg(long, default_value = "smollm2-135m-instruct-q4_1")]
    pub model: String,
    /// Also run `xtask repro` for cpu and gfx1201 (a second clean build of the engine from
    /// another folder: 5-10 more minutes on 2 cores; `.ci/run` passes it).
    #[arg(long, conflicts_with = "skip_toolchain")]
    pub repro: bool,
}

#[derive(Debug, clap::Args)]
pub struct Verify {
    /// An archive (`.tar.gz`, `.zip`; its `.sha256` beside it is checked when present), an
    /// unpacked package folder, a release folder (SHA256SUMS, its signature, the SBOM and the
    /// archives) or a container image (`ember:0.1.0-cpu`).
    pub path: PathBuf,
    /// The hex Ed25519 public key file to check a release folder's signature with; default: the
    /// `release-key.ed25519.pub` inside the folder (which proves integrity, not origin).
    #[arg(long)]
    pub public_key: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
pub struct Release {
    /// Rehearse only: sign with a throwaway key and publish nothing (the only mode; the real
    /// release is the workflow in .github/workflows/release.yml).
    #[arg(long, required = true)]
    pub dry_run: bool,
    /// The targets to build, comma-separated (default: every target the local toolchain builds).
    #[arg(long, value_delimiter = ',')]
    pub targets: Vec<String>,
    /// Base image for the container images (default: the ones targets.toml pins).
    #[arg(long)]
    pub base: Option<String>,
    /// Skip the container images (a machine without docker); the run says so.
    #[arg(long)]
    pub no_images: bool,
    /// The model (a name from models.toml) the smoke tests run.
    #[arg(long, default_value = "smollm2-135m-instruct-q4_1")]
    pub model: String,
}

#[derive(Debug, clap::Args)]
pub struct Setup {
    /// Also install the Windows cross toolchain, wine, docker with its test base image,
    /// actionlint and python3-venv: everything `cargo xtask test` uses.
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, clap::Args)]
pub struct Docker {
    /// The target (from targets.toml) whose artifact goes into the image.
    #[arg(long)]
    pub target: String,
    /// Base image; defaults to the official ROCm runtime image pinned in targets.toml.
    #[arg(long)]
    pub base: Option<String>,
    /// Then build the image again with --no-cache from the same artifact and fail unless its file
    /// layers have the same digests; the second image is removed.
    #[arg(long)]
    pub check_reproducible: bool,
}

#[derive(Debug, clap::Args)]
pub struct Smoke {
    /// A packaged artifact (.tar.gz or .zip) to unpack and run.
    #[arg(long, conflicts_with = "image")]
    pub artifact: Option<PathBuf>,
    /// A container image tag to run.
    #[arg(long)]
    pub image: Option<String>,
    /// The model (a name from models.toml) to answer a prompt with.
    #[arg(long, default_value = "smollm2-135m-instruct-q4_1")]
    pub model: String,
}

#[derive(Debug, clap::Args)]
pub struct Repro {
    /// The targets to build twice, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "cpu,gfx1201")]
    pub targets: Vec<String>,
    /// Skip the flipped-byte build (it needs an AMDGPU target among --targets).
    #[arg(long)]
    pub no_flip: bool,
    /// Also build each target's image (docker/Dockerfile on this base) from each build's archive
    /// and sources, with --no-cache, and compare their file layers; the images are removed.
    #[arg(long)]
    pub base: Option<String>,
}
