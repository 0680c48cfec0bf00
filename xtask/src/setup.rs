//! `cargo xtask setup [--all]`: installs the host toolchain, so that the command a new user runs
//! first (`cargo xtask build --target gfx1201`) has a compiler. The work is done by the scripts in
//! `.ci/` that CI itself runs, so there is one way to set a machine up and CI tests it.

use anyhow::{Context, Result};
use xshell::{cmd, Shell};

/// The scripts `--all` runs, in order (the package install first, so the others find their
/// packages present).
const ALL: [&str; 7] = [
    ".ci/setup-packages.sh",
    ".ci/setup-kernels.sh",
    ".ci/setup-windows.sh",
    ".ci/setup-wine.sh",
    ".ci/setup-docker.sh",
    ".ci/setup-actionlint.sh",
    ".ci/setup-python.sh",
];

impl crate::flags::Setup {
    pub fn run(self, sh: &Shell) -> Result<()> {
        let scripts: &[&str] = if self.all {
            &ALL
        } else {
            &[".ci/setup-kernels.sh"]
        };
        let root = crate::project_root();
        for script in scripts {
            let path = root.join(script);
            println!("setup: {script}");
            cmd!(sh, "bash {path}")
                .run()
                .with_context(|| format!("{script} failed"))?;
        }
        println!(
            "setup: done; `cargo xtask build --target <gfx target>` now finds the kernel compiler"
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_setup_script_is_run_by_setup_all() {
        let root = crate::project_root();
        let mut scripts: Vec<String> = std::fs::read_dir(root.join(".ci"))
            .unwrap()
            .filter_map(|entry| {
                let name = entry.unwrap().file_name().into_string().unwrap();
                name.starts_with("setup-").then(|| format!(".ci/{name}"))
            })
            .collect();
        scripts.sort();
        let mut all: Vec<String> = super::ALL.iter().map(|s| s.to_string()).collect();
        all.sort();
        assert_eq!(scripts, all);
    }
}
