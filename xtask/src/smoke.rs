//! `cargo xtask smoke`: runs an artifact or image against a real model.

use anyhow::{bail, Result};
use xshell::Shell;

impl crate::flags::Smoke {
    pub fn run(self, _sh: &Shell) -> Result<()> {
        bail!("xtask smoke is not implemented yet (model {})", self.model)
    }
}
