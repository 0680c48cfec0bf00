//! `cargo xtask docker`: container images per target.

use anyhow::{bail, Result};
use xshell::Shell;

impl crate::flags::Docker {
    pub fn run(self, _sh: &Shell) -> Result<()> {
        bail!("xtask docker is not implemented yet (target {})", self.target)
    }
}
