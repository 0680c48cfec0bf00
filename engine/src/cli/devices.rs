//! `ember devices`: the CPU, the GPU runtimes looked for (and from where they were loaded), each
//! GPU with its architecture, memory, VMM support, the memory pool it would get and why, and the
//! kernels this build carries for it.

use std::path::PathBuf;

use clap::Args;
use ember::backend::cpu::physical_cores;
use ember_gpu::devices::{list, ListOptions};
use ember_gpu::pool::PoolSelectOptions;

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// ROCm installation to load the HIP runtime from (default: ROCM_PATH, then /opt/rocm, then
    /// the system loader).
    #[arg(long, env = "ROCM_PATH")]
    pub rocm_path: Option<PathBuf>,
    /// Folder holding the per-architecture code objects (default: `kernels/` beside the binary,
    /// or EMBER_KERNELS_DIR).
    #[arg(long, env = "EMBER_KERNELS_DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Run the VMM probe on each GPU (maps, grows, sets access and touches memory) instead of
    /// reporting the gate and the device's VMM attribute only.
    #[arg(long)]
    pub probe: bool,
}

pub fn run(args: DevicesArgs) -> anyhow::Result<()> {
    println!(
        "cpu0  {}  {} SIMD  {} physical cores",
        std::env::consts::ARCH,
        ember_quant::simd::detected(),
        physical_cores()
    );
    // The build's VMM gate is the run-time default; a development build has no gate and lets the
    // probe decide.
    let vmm = ember::build_manifest::feature("vmm");
    let vmm_gate = vmm.is_none_or(|f| f.enabled);
    let vmm_reason = vmm.and_then(|f| f.reason.clone());
    let options = ListOptions {
        rocm_path: args.rocm_path,
        kernels_dir: args.kernels_dir,
        pool: PoolSelectOptions::from_env(vmm_gate, vmm_reason),
        probe: args.probe,
    };
    print!("{}", list(&options));
    Ok(())
}
