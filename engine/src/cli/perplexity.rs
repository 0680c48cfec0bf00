//! `ember perplexity`: perplexity of a model on a text file, by llama-perplexity's protocol
//! (see [`ember::generate::perplexity`]), printed the way it prints it.

use std::io::Write;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;

use ember::backend::Backend;
use ember::generate;
use ember::load::Loaded;
use ember::model::ContextParams;
use ember::with_loaded;

use super::device::DeviceArgs;
use super::load;

#[derive(Debug, Args)]
pub struct PerplexityArgs {
    /// Model: a GGUF path, or a pinned model name (fetched on first use).
    #[arg(short = 'm', long)]
    pub model: String,
    /// The text file.
    #[arg(short = 'f', long)]
    pub file: std::path::PathBuf,
    /// Tokens per chunk.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx_size: usize,
    /// Most tokens evaluated in one batch.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Worker threads (default: physical cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Evaluate at most this many chunks (default: all).
    #[arg(long)]
    pub chunks: Option<usize>,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    let text = ember::limits::read_text_file(&args.file, ember::limits::MAX_TEXT_FILE_BYTES)
        .context("-f")?;
    ember::limits::check_context(args.ctx_size, 1, 0, None)
        .map_err(|e| anyhow::anyhow!("-c {}: {e}", args.ctx_size))?;
    let loaded = load::load_on(&args.model, args.threads, &args.device)?;
    with_loaded!(loaded, |loaded| perplexity_on(&loaded, &args, &text))
}

fn perplexity_on<B: Backend>(
    loaded: &Loaded<B>,
    args: &PerplexityArgs,
    text: &str,
) -> anyhow::Result<()> {
    let model = &loaded.model;
    let tokenizer = &loaded.tokenizer;
    // The KV cache of a model on the CPU is in this process's memory.
    let memory = loaded
        .pool
        .is_none()
        .then(ember::limits::available_memory)
        .flatten();
    ember::limits::check_context(
        args.ctx_size,
        1,
        model.hparams().kv_bytes_per_token(),
        memory,
    )
    .map_err(|e| anyhow::anyhow!("-c {}: {e}", args.ctx_size))?;
    let mut tokens = tokenizer.encode(text, true, false);
    if let Some(max) = args.chunks {
        tokens.truncate(max.saturating_mul(args.ctx_size));
    }
    let bos = if tokenizer.add_bos() {
        tokenizer.bos()
    } else {
        None
    };
    eprintln!(
        "tokenized {} tokens; {} chunks of {}",
        tokens.len(),
        tokens.len() / args.ctx_size.max(1),
        args.ctx_size
    );
    let mut ctx = model.new_context(ContextParams::with_ctx(args.ctx_size));
    let start = Instant::now();
    let stdout = std::io::stdout();
    let result = generate::perplexity(
        model,
        &mut ctx,
        &tokens,
        args.ctx_size,
        args.batch_size,
        bos,
        |chunk| {
            let mut out = stdout.lock();
            let _ = write!(out, "[{}]{:.4},", chunk.index + 1, chunk.running_ppl);
            let _ = out.flush();
        },
    )?;
    println!();
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        result.ppl, result.ppl_stderr
    );
    eprintln!(
        "[{} chunks, {} tokens scored, {:.2} s]",
        result.n_chunks,
        result.n_scored,
        start.elapsed().as_secs_f64()
    );
    drop(ctx);
    load::finish(loaded);
    Ok(())
}
