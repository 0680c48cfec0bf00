//! Every xtask flag, declared in one place; the doc comments are the `--help` text.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "cargo xtask", about = "ember's build-and-release toolchain")]
pub struct Xtask {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Build the container image for one target from docker/Dockerfile.
    Docker(Docker),
    /// Run an artifact or an image against a real model and check what it reports.
    Smoke(Smoke),
}

#[derive(Debug, clap::Args)]
pub struct Docker {
    /// The target (from targets.toml) whose artifact goes into the image.
    #[arg(long)]
    pub target: String,
    /// Base image; defaults to the official ROCm runtime image pinned in targets.toml.
    #[arg(long)]
    pub base: Option<String>,
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
