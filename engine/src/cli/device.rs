//! The device flags shared by every model-running subcommand (`run`, `bench`, `perplexity`,
//! `stress`), so they parse the same way: `--device`, `-ngl/--gpu-layers`, `--vram-budget`,
//! `--memory-report`, `--allow-host-weights`, `--rocm-path`, `--kernels-dir`, `--numerics`.
//! What the values mean, and the placement rule, live in the library's [`ember::device`].
//!
//! clap has no multi-letter short flags, so llama.cpp's `-ngl N` is rewritten to
//! `--gpu-layers N` before parsing ([`rewrite_ngl`]).

use std::path::PathBuf;

use clap::Args;
use ember::backend::gpu::Numerics;
use ember::device::{parse_size, DeviceOptions, DeviceSpec, GpuLayers};
use ember::load_plan::{SplitMode, TensorSplit};

/// The device flags (flattened into each model-running subcommand).
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Where to run: auto (the first GPU whose architecture has kernels in this build, else the
    /// CPU), cpu, cuda:N or hip:N, a list of GPUs of one kind such as cuda:0,cuda:1 or
    /// hip:0,hip:1 (a layer split over them, by free memory or --tensor-split; copies between
    /// them by peer copy where the start-up self-test passes, else through host memory; a GPU
    /// named twice is refused unless EMBER_ALLOW_REPEATED_DEVICE=1, a testing aid that runs the
    /// split over one GPU), or sim:0,sim:1,... (simulated GPUs on the host, for trying
    /// layer splits without GPUs: each has its own memory pool, --vram-budget, idle trim and
    /// placement check, and runs the CPU's ops; EMBER_SIM_CORRUPT_PEER=0,1 makes copies from
    /// sim:0 to sim:1 corrupt, which the start-up peer-copy self-test catches;
    /// EMBER_SIM_HOST_WEIGHTS=1 makes sim:1's weights show as host memory, which the placement
    /// check refuses, or warns about with --allow-host-weights).
    #[arg(long, default_value = "auto")]
    pub device: DeviceSpec,
    /// Layers on the GPU (also -ngl): 0 keeps the model on the CPU; `all`, or at least the
    /// model's layer count, puts the whole model on the GPU. Default: all when a GPU is used.
    /// Between the two is partial offload: the last N layers on the GPU (and the output layer
    /// when all fit), the rest on the CPU, as llama.cpp does.
    #[arg(long = "gpu-layers", alias = "n-gpu-layers", value_name = "N|all")]
    pub gpu_layers: Option<GpuLayers>,
    /// Most device memory the engine may use at once (weights, KV cache and scratch), e.g. 8GiB;
    /// over several devices, each device's own budget.
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub vram_budget: Option<u64>,
    /// Print device memory by purpose at load, at peak and after idle.
    #[arg(long)]
    pub memory_report: bool,
    /// Run even when the weights are found not to be in VRAM (warn instead of refusing).
    #[arg(long)]
    pub allow_host_weights: bool,
    /// ROCm installation to load the HIP runtime from (default: ROCM_PATH, then /opt/rocm, then
    /// the system loader).
    #[arg(long, env = "ROCM_PATH")]
    pub rocm_path: Option<PathBuf>,
    /// Folder holding the per-architecture kernel code objects (default: `kernels/` beside the
    /// binary, or EMBER_KERNELS_DIR).
    #[arg(long, env = "EMBER_KERNELS_DIR")]
    pub kernels_dir: Option<PathBuf>,
    /// How the GPU rounds: fast (the tuned kernels) or reference (every op bit-identical to the
    /// CPU backend, so greedy output matches `--device cpu -t 2` and llama.cpp's reference
    /// outputs; slower, no fused kernels or decode graphs). Default: EMBER_GPU_NUMERICS, else
    /// fast. The reference mode reproduces the split attention of EMBER_REFERENCE_THREADS CPU
    /// threads (default 2).
    #[arg(long, value_name = "fast|reference")]
    pub numerics: Option<Numerics>,
    /// How the GPU layers spread over several GPUs: layer (contiguous ranges, one per GPU) or
    /// none (all on --main-gpu).
    #[arg(long, default_value = "layer", value_name = "layer|none")]
    pub split_mode: SplitMode,
    /// Proportions of the GPU layers per GPU, e.g. 3,1. Default: proportional to each GPU's
    /// free memory after its KV cache and scratch.
    #[arg(long, value_name = "A,B,...")]
    pub tensor_split: Option<TensorSplit>,
    /// The GPU of --split-mode none (an index into the GPUs in use).
    #[arg(long, default_value_t = 0, value_name = "I")]
    pub main_gpu: usize,
}

impl Default for DeviceArgs {
    fn default() -> Self {
        DeviceArgs {
            device: DeviceSpec::Auto,
            gpu_layers: None,
            vram_budget: None,
            memory_report: false,
            allow_host_weights: false,
            rocm_path: None,
            kernels_dir: None,
            numerics: None,
            split_mode: SplitMode::Layer,
            tensor_split: None,
            main_gpu: 0,
        }
    }
}

impl DeviceArgs {
    /// The flags as the library's plain device options.
    pub fn options(&self) -> DeviceOptions {
        DeviceOptions {
            device: self.device,
            gpu_layers: self.gpu_layers,
            vram_budget: self.vram_budget,
            memory_report: self.memory_report,
            allow_host_weights: self.allow_host_weights,
            rocm_path: self.rocm_path.clone(),
            kernels_dir: self.kernels_dir.clone(),
            numerics: self.numerics,
            split_mode: self.split_mode,
            tensor_split: self.tensor_split.as_ref().map(|split| split.0.clone()),
            main_gpu: self.main_gpu,
        }
    }
}

/// Rewrites llama.cpp's `-ngl N` / `-ngl=N` into `--gpu-layers N` / `--gpu-layers=N`, and
/// llama-server's `-np N` into `--parallel N` (clap has no multi-letter short flags), and
/// llama.cpp's `-hf OWNER/REPO[:QUANT]` (`--hf-repo`) into `-m hf://OWNER/REPO[:QUANT]`.
/// Arguments after `--` are left alone.
pub fn rewrite_ngl(args: impl IntoIterator<Item = std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let hub = |repo: &str| format!("{}{repo}", ember::hub::SPEC_PREFIX).into();
    let mut out = Vec::new();
    let mut passthrough = false;
    let mut hub_value_next = false;
    for arg in args {
        if passthrough {
            out.push(arg);
            continue;
        }
        if hub_value_next {
            hub_value_next = false;
            if let Some(repo) = arg.to_str().filter(|r| !r.starts_with('-')) {
                out.push(hub(repo));
                continue;
            }
        }
        match arg.to_str() {
            Some("-hf" | "--hf-repo") => {
                out.push("-m".into());
                hub_value_next = true;
            }
            Some(text) if text.starts_with("-hf=") || text.starts_with("--hf-repo=") => {
                out.push("-m".into());
                out.push(hub(text.split_once('=').map_or("", |(_, v)| v)));
            }
            Some("--") => {
                passthrough = true;
                out.push(arg);
            }
            Some("-ngl") => out.push("--gpu-layers".into()),
            Some(text) if text.starts_with("-ngl=") => {
                out.push(format!("--gpu-layers={}", &text["-ngl=".len()..]).into())
            }
            // llama-server's `-np N` (parallel sequences) for `ember serve`.
            Some("-np") => out.push("--parallel".into()),
            Some(text) if text.starts_with("-np=") => {
                out.push(format!("--parallel={}", &text["-np=".len()..]).into())
            }
            _ => out.push(arg),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hf_flags_become_hub_models() {
        let rewrite = |args: &[&str]| -> Vec<String> {
            rewrite_ngl(args.iter().map(std::ffi::OsString::from))
                .into_iter()
                .map(|a| a.into_string().unwrap())
                .collect()
        };
        assert_eq!(
            rewrite(&["ember", "run", "-hf", "o/r:Q8_0", "-p", "x"]),
            ["ember", "run", "-m", "hf://o/r:Q8_0", "-p", "x"]
        );
        assert_eq!(
            rewrite(&["ember", "--hf-repo=o/r"]),
            ["ember", "-m", "hf://o/r"]
        );
        // A missing value is left for clap to report.
        assert_eq!(rewrite(&["ember", "run", "-hf"]), ["ember", "run", "-m"]);
    }

    #[test]
    fn numerics_flag_is_on_every_model_running_command() {
        use clap::{CommandFactory, Parser};
        let cli = crate::cli::Cli::command();
        for name in ["run", "bench", "perplexity", "stress"] {
            let sub = cli.find_subcommand(name).expect(name);
            assert!(
                sub.get_arguments()
                    .any(|a| a.get_long() == Some("numerics")),
                "{name} has no --numerics"
            );
        }
        #[derive(Debug, Parser)]
        struct Flags {
            #[command(flatten)]
            device: DeviceArgs,
        }
        let parse = |args: &[&str]| {
            Flags::try_parse_from(std::iter::once("ember").chain(args.iter().copied()))
                .map(|f| f.device.numerics)
                .map_err(|e| e.to_string())
        };
        assert_eq!(parse(&[]), Ok(None), "absent: the environment decides");
        assert_eq!(
            parse(&["--numerics", "reference"]),
            Ok(Some(Numerics::Reference))
        );
        assert_eq!(parse(&["--numerics=fast"]), Ok(Some(Numerics::Fast)));
        let error = parse(&["--numerics", "exact"]).unwrap_err();
        assert!(
            error.contains("expected fast or reference, found \"exact\""),
            "{error}"
        );
        let args = DeviceArgs {
            numerics: Some(Numerics::Reference),
            ..DeviceArgs::default()
        };
        assert_eq!(
            args.options().numerics(),
            Ok(Numerics::Reference),
            "the flag wins"
        );
    }

    #[test]
    fn every_flag_reaches_the_device_options() {
        use clap::Parser;
        use ember::backend::gpu::GpuKind;
        #[derive(Debug, Parser)]
        struct Flags {
            #[command(flatten)]
            device: DeviceArgs,
        }
        let flags = Flags::try_parse_from([
            "ember",
            "--device",
            "hip:1",
            "--gpu-layers",
            "all",
            "--vram-budget",
            "2GiB",
            "--memory-report",
            "--allow-host-weights",
            "--rocm-path",
            "rocm",
            "--kernels-dir",
            "kernels",
            "--numerics",
            "reference",
        ])
        .unwrap();
        assert_eq!(
            flags.device.options(),
            DeviceOptions {
                device: DeviceSpec::Gpu(GpuKind::Hip, 1),
                gpu_layers: Some(GpuLayers::All),
                vram_budget: Some(2 << 30),
                memory_report: true,
                allow_host_weights: true,
                rocm_path: Some(PathBuf::from("rocm")),
                kernels_dir: Some(PathBuf::from("kernels")),
                numerics: Some(Numerics::Reference),
                split_mode: SplitMode::Layer,
                tensor_split: None,
                main_gpu: 0,
            }
        );
    }

    #[test]
    fn ngl_is_rewritten_before_parsing() {
        let rewritten = rewrite_ngl(
            [
                "ember", "bench", "-ngl", "99", "-ngl=all", "-m", "x", "--", "-ngl",
            ]
            .map(std::ffi::OsString::from),
        );
        let rewritten: Vec<&str> = rewritten.iter().map(|a| a.to_str().unwrap()).collect();
        assert_eq!(
            rewritten,
            [
                "ember",
                "bench",
                "--gpu-layers",
                "99",
                "--gpu-layers=all",
                "-m",
                "x",
                "--",
                "-ngl"
            ]
        );
    }
}
