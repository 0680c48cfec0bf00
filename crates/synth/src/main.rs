//! `ember-synth`: writes a synthetic GGUF model of a real shape with random weights.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Parser;
use ember_synth::{write_model, Shape, ShapeOverrides, SynthError, SynthOptions, TypeSpec};

/// Write a synthetic GGUF model: a real model's shape, random weights (deterministic from the
/// seed, scaled so activations and logits stay sane), a working byte-level BPE tokenizer.
///
/// Shapes: llama3-8b, llama3.2-1b, smollm2-135m, qwen2-0.5b, qwen3-0.6b, gemma3-270m,
/// qwen3-30b-a3b (a mixture of experts: --experts, --experts-used and --expert-ff shrink it),
/// qwen3.5-27b and qwen3.5-35b-a3b (hybrids: Gated DeltaNet layers with one full-attention layer
/// in four; --linear-k-heads, --linear-v-heads and --linear-head-dim shrink them),
/// gemma4-26b-a4b and gemma4-e2b (also --window, --global-head-dim, --global-kv-heads,
/// --shared-kv-layers, --per-layer-embd).
/// Types: f32, f16, bf16, q4_0, q4_1, q5_0, q5_1, q8_0, q2_k, q3_k, q4_k, q5_k, q6_k, and the
/// mix q4_k_m. Like llama-quantize, quantized types put the output projection in Q6_K (Q8_0 for
/// q8_0) and fall back to another type where rows are not whole blocks; --pure puts every matrix
/// in the given type (still with the fallback).
#[derive(Debug, Parser)]
#[command(name = "ember-synth", version)]
struct Args {
    /// The model shape.
    #[arg(long)]
    shape: String,
    /// The weight type.
    #[arg(long = "type")]
    ty: String,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    #[command(flatten)]
    overrides: ShapeOverrides,
    /// Every matrix in the given type, as `llama-quantize --pure`.
    #[arg(long)]
    pure: bool,
    /// Assemble quantized data from a pool of 4096 properly quantized random blocks instead of
    /// quantizing every row: much faster for 8B models, every block valid and distributed like
    /// the exact ones, but less varied. Fine for speed benchmarks, not for accuracy tests.
    #[arg(long)]
    fast: bool,
    /// Worker threads (default: all cores).
    #[arg(short = 't', long, default_value_t = 0)]
    threads: usize,
    /// The output file.
    #[arg(short = 'o', long)]
    output: PathBuf,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let mut shape = Shape::named(&args.shape).ok_or_else(|| SynthError::UnknownShape {
        found: args.shape.clone(),
    })?;
    args.overrides.apply(&mut shape)?;
    let types = TypeSpec::parse(&args.ty).ok_or_else(|| SynthError::UnknownType {
        found: args.ty.clone(),
    })?;
    if args.threads > 0 {
        rayon::ThreadPoolBuilder::new()
            .num_threads(args.threads)
            .build_global()
            .context("cannot start the thread pool")?;
    }
    let opts = SynthOptions {
        shape,
        types,
        pure: args.pure,
        seed: args.seed,
        fast: args.fast,
    };
    eprintln!(
        "ember-synth: {} {}{} ({:.3} B parameters, {} layers, vocab {}) -> {}",
        opts.shape.name,
        types.name(),
        if args.pure { " pure" } else { "" },
        opts.shape.n_params() as f64 / 1e9,
        opts.shape.n_layer,
        opts.shape.n_vocab,
        args.output.display()
    );
    let interactive = std::io::stderr().is_terminal();
    let summary = write_model(&opts, &args.output, move |p| {
        let mut err = std::io::stderr().lock();
        let Some(t) = p.tensor else {
            if interactive {
                let _ = writeln!(err);
            }
            return;
        };
        let line = format!(
            "[{:>4}/{}] {:5.1}% {:7.1} s  {:<32} {:<5} {:?}",
            p.done + 1,
            p.total,
            100.0 * p.bytes_done as f64 / p.bytes_total.max(1) as f64,
            p.elapsed_s,
            t.name,
            t.ty.name(),
            t.dims
        );
        // On a terminal one line is rewritten; in a log every tensor gets its own line.
        if interactive {
            let _ = write!(err, "\r{line:<100}");
            let _ = err.flush();
        } else {
            let _ = writeln!(err, "{line}");
        }
    })?;
    let types: Vec<String> = summary
        .types
        .iter()
        .map(|(ty, n)| format!("{n} {ty}"))
        .collect();
    eprintln!(
        "ember-synth: wrote {} tensors ({:.2} MiB of tensor data; {}) in {:.1} s",
        summary.n_tensors,
        summary.tensor_bytes as f64 / (1024.0 * 1024.0),
        types.join(", "),
        summary.seconds
    );
    Ok(())
}
