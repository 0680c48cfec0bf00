//! `ember doctor`: the preflight checks of [`ember::doctor`], printed one per line with the fix
//! under each warn and fail; exits 1 when something blocks GPU use.

use std::path::PathBuf;

use clap::Args;
use ember::doctor::{self, SystemView};

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Folder holding the per-architecture kernel code objects (default: `kernels/` beside the
    /// binary, or EMBER_KERNELS_DIR).
    #[arg(long, env = "EMBER_KERNELS_DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Check this folder as the system root instead of `/` (for tests and for inspecting a
    /// container's or another system's tree).
    #[arg(long, value_name = "DIR", hide = true)]
    pub root: Option<PathBuf>,
}

/// Whether the checks passed well enough for GPU use.
pub fn run(args: DoctorArgs) -> anyhow::Result<bool> {
    let kernels_dir = args
        .kernels_dir
        .unwrap_or_else(ember_gpu::kernels::default_kernels_dir);
    let mut system = SystemView::current(kernels_dir);
    if let Some(root) = args.root {
        system.root = root;
    }
    let checks = doctor::run(&system);
    print!("{}", doctor::render(&checks));
    let blocked = doctor::blocks_gpu(&checks);
    if blocked {
        eprintln!("doctor: something above blocks GPU use (see the fix lines); ember runs on the CPU until it is fixed");
    }
    Ok(!blocked)
}
