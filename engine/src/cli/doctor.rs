//! `ember doctor`: the preflight checks of [`ember::doctor`], printed one per line with the fix
//! under each warn and fail; exits 1 when something blocks GPU use.

use std::path::PathBuf;

use clap::Args;
use ember::doctor::{self, GpuView, ModelNeeds, RuntimeOutcome, RuntimeView, SystemView, VmmProbe};
use ember::load::open_gguf;
use ember::model::{architecture_of, HParams, DEFAULT_N_CTX};
use ember_gpu::devices::{list, ListOptions};
use ember_gpu::driver::DriverError;
use ember_gpu::pool::{PoolKind, PoolSelectOptions};

use super::{info, load};

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Also check whether this model fits and where its layers would go (a GGUF path, a pinned
    /// name, or hf://OWNER/REPO[:QUANT]).
    #[arg(short = 'm', long)]
    pub model: Option<String>,
    /// Context length to size the model's KV cache for (default: the model's, at most 4096).
    #[arg(short = 'c', long, requires = "model")]
    pub ctx_size: Option<usize>,
    /// ROCm installation to load the HIP runtime from (default: ROCM_PATH, then /opt/rocm, then
    /// the system loader).
    #[arg(long, env = "ROCM_PATH")]
    pub rocm_path: Option<PathBuf>,
    /// Folder holding the per-architecture kernel code objects (default: `kernels/` beside the
    /// binary, or EMBER_KERNELS_DIR).
    #[arg(long, env = "EMBER_KERNELS_DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// Check this folder as the system root instead of `/` (for tests and for inspecting a
    /// container's or another system's tree); the GPU runtimes are then not asked.
    #[arg(long, value_name = "DIR", hide = true)]
    pub root: Option<PathBuf>,
}

/// The runtimes as loaded, and the GPUs they report with the VMM probe run on each.
fn gpus(args: &DoctorArgs, kernels_dir: &std::path::Path) -> (Vec<RuntimeView>, Vec<GpuView>) {
    let vmm = ember::build_manifest::feature("vmm");
    let vmm_gate = vmm.is_none_or(|f| f.enabled);
    let vmm_reason = vmm.and_then(|f| f.reason.clone());
    let listing = list(&ListOptions {
        rocm_path: args.rocm_path.clone(),
        kernels_dir: Some(kernels_dir.to_owned()),
        pool: PoolSelectOptions::from_env(vmm_gate, vmm_reason),
        probe: true,
    });
    let runtimes = listing
        .runtimes
        .iter()
        .map(|r| RuntimeView {
            backend: r.backend.to_string(),
            outcome: match &r.outcome {
                Ok(info) => RuntimeOutcome::Loaded(info.to_string()),
                Err(DriverError::LibraryNotFound { .. }) => RuntimeOutcome::NotFound,
                Err(error) => RuntimeOutcome::InitFailed(error.to_string()),
            },
        })
        .collect();
    let gpus = listing
        .devices
        .iter()
        .map(|d| GpuView {
            id: format!("{}:{}", d.backend, d.ordinal),
            name: d.name.clone(),
            arch: d.arch.clone(),
            total_bytes: d.total_memory,
            free_bytes: d.free_memory,
            vmm: match d.pool {
                PoolKind::Vmm => VmmProbe::Passed,
                PoolKind::Caching if !vmm_gate || !d.vmm_supported => {
                    VmmProbe::NotRun(d.pool_reason.clone())
                }
                PoolKind::Caching => VmmProbe::Failed(d.pool_reason.clone()),
            },
            kernels: d.kernels.is_ok(),
        })
        .collect();
    (runtimes, gpus)
}

/// A model's memory needs, per layer, at the context asked for.
fn model_needs(spec: &str, ctx_size: Option<usize>) -> anyhow::Result<ModelNeeds> {
    let path = load::resolve_model(spec)?;
    let gguf = open_gguf(&path)?;
    let arch = architecture_of(&gguf)?;
    let hp = HParams::from_metadata(arch, gguf.metadata())?;
    let n_ctx = ctx_size.unwrap_or_else(|| hp.n_ctx_train.min(DEFAULT_N_CTX));
    let mut layer_bytes = vec![0u64; hp.n_layer];
    let mut other_bytes = 0u64;
    for t in gguf.tensors() {
        let layer = t
            .name
            .strip_prefix("blk.")
            .and_then(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .filter(|&il| il < hp.n_layer);
        match layer {
            Some(il) => layer_bytes[il] += t.n_bytes,
            None => other_bytes += t.n_bytes,
        }
    }
    let n_kv_layers = hp.layers.iter().filter(|l| !l.recurrent).count().max(1);
    let kv_per_layer = (hp.kv_bytes_per_token() * n_ctx / n_kv_layers) as u64;
    let kv_layer_bytes = hp
        .layers
        .iter()
        .map(|l| if l.recurrent { 0 } else { kv_per_layer })
        .collect();
    let n_vocab = gguf
        .tensor("token_embd.weight")
        .and_then(|t| t.dims.get(1).copied())
        .unwrap_or(0) as usize;
    Ok(ModelNeeds {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| spec.to_string()),
        layer_bytes,
        other_bytes,
        kv_layer_bytes,
        n_ctx,
        scratch_bytes: info::scratch_bytes(&hp, n_vocab, 512) as u64,
    })
}

/// Whether the checks passed well enough for GPU use.
pub fn run(args: DoctorArgs) -> anyhow::Result<bool> {
    let kernels_dir = args
        .kernels_dir
        .clone()
        .unwrap_or_else(ember_gpu::kernels::default_kernels_dir);
    let mut system = SystemView::current(kernels_dir.clone());
    match &args.root {
        Some(root) => system.root = root.clone(),
        None => (system.runtimes, system.gpus) = gpus(&args, &kernels_dir),
    }
    let checks = match &args.model {
        Some(spec) => doctor::run_with_model(&system, &model_needs(spec, args.ctx_size)?),
        None => doctor::run(&system),
    };
    print!("{}", doctor::render(&checks));
    let blocked = doctor::blocks_gpu(&checks);
    if blocked {
        eprintln!("doctor: something above blocks GPU use (see the fix lines); ember runs on the CPU until it is fixed");
    }
    Ok(!blocked)
}
