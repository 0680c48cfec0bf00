//! `cargo xtask`: ember's build-and-release toolchain. One command, one module; `main` is a flat
//! match over the flags declared in `flags.rs`.

mod build;
mod docker;
mod elf;
mod flags;
mod kernels;
mod manifest;
mod matrix;
mod package;
mod smoke;
mod targets;
mod test;
#[cfg(test)]
mod tidy;
mod toolchain;
mod wine;

use anyhow::Result;
use clap::Parser;
use xshell::Shell;

fn main() -> Result<()> {
    let flags = flags::Xtask::parse();
    let sh = Shell::new()?;
    sh.change_dir(project_root());
    match flags.command {
        flags::Command::Kernels(cmd) => cmd.run(&sh),
        flags::Command::Build(cmd) => cmd.run(&sh),
        flags::Command::Package(cmd) => cmd.run(&sh),
        flags::Command::Matrix(cmd) => cmd.run(&sh),
        flags::Command::Test(cmd) => cmd.run(&sh),
        flags::Command::Docker(cmd) => cmd.run(&sh),
        flags::Command::Smoke(cmd) => cmd.run(&sh),
    }
}

/// The workspace root (the folder holding `targets.toml`).
pub fn project_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}
