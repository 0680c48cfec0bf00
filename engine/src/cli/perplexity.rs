//! `ember perplexity`: perplexity of a model on a text file, by llama-perplexity's protocol
//! (see [`ember::generate::perplexity`]), printed the way it prints it; with
//! `--kl-divergence-base`, the KL divergence against a base run (see [`ember::kl_divergence`]).

use std::io::Write;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;

use ember::backend::Backend;
use ember::generate;
use ember::kl_divergence::{BaseLogits, BaseWriter, KldError, KldStats};
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
    #[arg(short = 'f', long, required_unless_present = "kl_divergence")]
    pub file: Option<std::path::PathBuf>,
    /// A base-logits file in llama-perplexity's format: written by this run (with --file), or
    /// with --kl-divergence read as the base to compare with.
    #[arg(long, value_name = "FILE")]
    pub kl_divergence_base: Option<std::path::PathBuf>,
    /// Compare with the --kl-divergence-base run (ember's or llama-perplexity's) on its tokens
    /// and chunk size, and print the KL divergence and top-token agreement as
    /// llama-perplexity's `--kl-divergence` does.
    #[arg(long, requires = "kl_divergence_base")]
    pub kl_divergence: bool,
    /// Tokens per chunk.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 512)]
    pub ctx_size: usize,
    /// Most tokens evaluated in one batch.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512)]
    pub batch_size: usize,
    /// Worker threads (0, the default: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Evaluate at most this many chunks (default: all).
    #[arg(long)]
    pub chunks: Option<usize>,
    #[command(flatten)]
    pub device: DeviceArgs,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    if let (true, Some(base)) = (args.kl_divergence, &args.kl_divergence_base) {
        let base = BaseLogits::open(base)?;
        let loaded = load::load_on(&args.model, args.threads, &args.device)?;
        return with_loaded!(loaded, |loaded| kl_divergence_on(&loaded, &args, base));
    }
    let file = args
        .file
        .as_ref()
        .expect("clap requires --file without a base");
    let text =
        ember::limits::read_text_file(file, ember::limits::MAX_TEXT_FILE_BYTES).context("-f")?;
    ember::limits::check_context(args.ctx_size, 1, 0, None)
        .map_err(|e| anyhow::anyhow!("-c {}: {e}", args.ctx_size))?;
    let loaded = load::load_on(&args.model, args.threads, &args.device)?;
    with_loaded!(loaded, |loaded| perplexity_on(&loaded, &args, &text))
}

fn kl_divergence_on<B: Backend>(
    loaded: &Loaded<B>,
    args: &PerplexityArgs,
    mut base: BaseLogits,
) -> anyhow::Result<()> {
    let model = &loaded.model;
    if base.n_vocab != model.n_vocab() {
        return Err(KldError::VocabMismatch {
            file: base.n_vocab,
            model: model.n_vocab(),
        }
        .into());
    }
    let n_ctx = base.n_ctx;
    ember::limits::check_context(n_ctx, 1, 0, None)
        .map_err(|e| anyhow::anyhow!("the base logits' chunks of {n_ctx} tokens: {e}"))?;
    let n_chunk = args.chunks.unwrap_or(base.n_chunk).min(base.n_chunk);
    let tokens = base.tokens[..n_chunk * n_ctx].to_vec();
    let bos = if loaded.tokenizer.add_bos() {
        loaded.tokenizer.bos()
    } else {
        None
    };
    eprintln!(
        "base logits: {n_chunk} of {} chunks of {n_ctx} tokens, vocabulary {}",
        base.n_chunk, base.n_vocab
    );
    let mut ctx = model.new_context(ContextParams::with_ctx(n_ctx));
    let start = Instant::now();
    let mut stats = KldStats::default();
    let mut failure = None;
    let stdout = std::io::stdout();
    let result = generate::perplexity_rows(
        model,
        &mut ctx,
        &tokens,
        n_ctx,
        args.batch_size,
        bos,
        |row| {
            if failure.is_some() {
                return;
            }
            match base.next_row() {
                Ok(base_row) => stats.add(row.logits, &base_row, row.next as usize),
                Err(e) => failure = Some(e),
            }
        },
        |chunk| {
            let mut out = stdout.lock();
            let _ = write!(out, "[{}]{:.4},", chunk.index + 1, chunk.running_ppl);
            let _ = out.flush();
        },
    )?;
    println!();
    if let Some(e) = failure {
        return Err(e.into());
    }
    let s = stats.summary();
    println!(
        "Final estimate: PPL = {:.4} +/- {:.5}",
        result.ppl, result.ppl_stderr
    );
    println!(
        "PPL(base) = {:.4}; PPL ratio {:.6}",
        s.ppl_base,
        s.ppl / s.ppl_base
    );
    println!(
        "KLD: mean {:.6} +/- {:.6}, median {:.6}, 99% {:.6}, max {:.6} ({} positions)",
        s.mean_kld, s.mean_kld_stderr, s.median_kld, s.p99_kld, s.max_kld, s.count
    );
    println!("same top token: {:.3} %", 100.0 * s.same_top);
    println!(
        "p(next) - p_base(next): RMS {:.4} %, max {:.4} %",
        100.0 * s.rms_p_diff,
        100.0 * s.max_p_diff
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

fn perplexity_on<B: Backend>(
    loaded: &Loaded<B>,
    args: &PerplexityArgs,
    text: &str,
) -> anyhow::Result<()> {
    let model = &loaded.model;
    let tokenizer = &loaded.tokenizer;
    // The KV cache goes where the model is: this process's memory, or the device's.
    let memory = ember::limits::KvMemory::of(loaded.pool.as_deref());
    ember::limits::check_context(
        args.ctx_size,
        1,
        model.hparams().kv_bytes_per_token(),
        memory.as_ref(),
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
    let n_chunks = tokens.len() / args.ctx_size.max(1);
    let mut writer = match &args.kl_divergence_base {
        Some(path) => Some(
            BaseWriter::create(
                path,
                args.ctx_size,
                model.n_vocab(),
                &tokens[..n_chunks * args.ctx_size],
            )
            .with_context(|| format!("cannot write {}", path.display()))?,
        ),
        None => None,
    };
    let mut write_failure = None;
    let result = generate::perplexity_rows(
        model,
        &mut ctx,
        &tokens,
        args.ctx_size,
        args.batch_size,
        bos,
        |row| {
            if let (Some(w), None) = (writer.as_mut(), write_failure.as_ref()) {
                if let Err(e) = w.push(row.logits) {
                    write_failure = Some(e);
                }
            }
        },
        |chunk| {
            let mut out = stdout.lock();
            let _ = write!(out, "[{}]{:.4},", chunk.index + 1, chunk.running_ppl);
            let _ = out.flush();
        },
    )?;
    println!();
    if let Some(path) = &args.kl_divergence_base {
        let written = match (write_failure, writer.map(BaseWriter::finish)) {
            (Some(e), _) | (None, Some(Err(e))) => Err(e),
            _ => Ok(()),
        };
        written.with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("base logits written to {}", path.display());
    }
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
