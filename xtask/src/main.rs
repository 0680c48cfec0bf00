//! `cargo xtask`: ember's build-and-release toolchain. One command, one module; `main` is a flat
//! match over the flags declared in `flags.rs`.

mod build;
mod container;
mod docker;
mod elf;
mod flags;
mod kernels;
mod manifest;
mod manifest_slot;
mod matrix;
mod package;
mod release;
mod repro;
mod sbom;
mod setup;
mod sign;
mod smoke;
mod targets;
mod test;
#[cfg(test)]
mod tidy;
mod toolchain;
mod verify;
mod wine;

use anyhow::Result;
use clap::Parser;
use xshell::Shell;

fn main() -> Result<()> {
    forget_cargo_run_environment();
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
        flags::Command::Setup(cmd) => cmd.run(&sh),
        flags::Command::Verify(cmd) => cmd.run(&sh),
        flags::Command::Release(cmd) => cmd.run(&sh),
        flags::Command::Repro(cmd) => cmd.run(&sh),
    }
}

/// Removes the variables `cargo run` gives xtask about xtask's own package (`CARGO_PKG_NAME`,
/// `CARGO_MANIFEST_DIR`, ...), so the cargo builds xtask starts see the same environment however
/// xtask was started (`cargo xtask`, the executable itself, inside the build container). Build
/// scripts that watch these names (ring's does, through the cc crate) would otherwise run again,
/// and the engine compile again, whenever the way xtask was started changed. `CARGO` stays: it
/// names the cargo to run.
fn forget_cargo_run_environment() {
    let names: Vec<std::ffi::OsString> = std::env::vars_os()
        .map(|(name, _)| name)
        .filter(|name| {
            let name = name.to_string_lossy();
            name.starts_with("CARGO_PKG_")
                || name.starts_with("CARGO_MANIFEST_")
                || matches!(
                    name.as_ref(),
                    "CARGO_PRIMARY_PACKAGE" | "CARGO_CRATE_NAME" | "CARGO_BIN_NAME"
                )
        })
        .collect();
    for name in names {
        // Edition 2021: safe here, and nothing else runs yet (no other thread reads the
        // environment).
        std::env::remove_var(name);
    }
}

/// Cargo's target directory for this workspace, as `cargo metadata` reports it: `target/` under
/// the workspace root unless `CARGO_TARGET_DIR`, `build.target-dir` or `--target-dir` moved it.
/// Every path xtask reads or writes under the target directory (the engine binary, manifests,
/// kernels, `dist/`) starts here, so builds work wherever cargo puts them. Asked once per process.
pub fn target_dir() -> std::path::PathBuf {
    static TARGET_DIR: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    TARGET_DIR
        .get_or_init(|| match cargo_target_dir(&project_root()) {
            Ok(dir) => dir,
            Err(error) => {
                // `cargo metadata` only fails when cargo itself is broken; the default is right
                // for every checkout that does not move the target directory.
                eprintln!("warning: {error:#}; using target/ under the workspace root");
                project_root().join("target")
            }
        })
        .clone()
}

fn cargo_target_dir(root: &std::path::Path) -> Result<std::path::PathBuf> {
    cargo_target_dir_with(root, &[])
}

/// [`cargo_target_dir`] with `env` added to cargo's environment (tests move the directory).
fn cargo_target_dir_with(
    root: &std::path::Path,
    env: &[(&str, &std::path::Path)],
) -> Result<std::path::PathBuf> {
    use anyhow::Context;
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let output = std::process::Command::new(&cargo)
        .envs(env.iter().copied())
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running `{cargo} metadata`"))?;
    anyhow::ensure!(
        output.status.success(),
        "`{cargo} metadata` failed ({})",
        output.status
    );
    let metadata: serde_json::Value =
        serde_json::from_slice(&output.stdout).context("parsing `cargo metadata` output")?;
    let dir = metadata
        .get("target_directory")
        .and_then(serde_json::Value::as_str)
        .context("expected `target_directory` in `cargo metadata` output, found none")?;
    Ok(std::path::PathBuf::from(dir))
}

/// The workspace root (the folder holding `targets.toml`): `$EMBER_PROJECT_ROOT` when set (how
/// `cargo xtask repro` builds another checkout of the same commit with this xtask), else the
/// checkout this xtask was compiled in.
pub fn project_root() -> std::path::PathBuf {
    if let Some(root) = std::env::var_os("EMBER_PROJECT_ROOT") {
        return std::path::PathBuf::from(root);
    }
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives one level below the workspace root")
        .to_path_buf()
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_target_directory_follows_cargo_target_dir() {
        let root = super::project_root();
        let moved = std::env::temp_dir().join(format!("ember-target-{}", std::process::id()));
        let found = super::cargo_target_dir_with(&root, &[("CARGO_TARGET_DIR", &moved)]).unwrap();
        assert_eq!(found, moved);
        let unmoved = super::cargo_target_dir(&root).unwrap();
        assert_ne!(unmoved, moved);
    }
}
