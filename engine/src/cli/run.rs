//! `ember run`: generate from a prompt, streaming text (or one JSON object at the end).

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context as _};
use clap::{Args, ValueEnum};
use ember_tokenizer::{ChatMessage, ChatTemplate, Tokenizer};

use super::device::DeviceArgs;
use super::load::{self, with_loaded, Loaded};
use crate::backend::Backend;
use crate::generate::{self, StopReason};
use crate::model::{ContextParams, DEFAULT_N_CTX};
use crate::sample::{Sampler, SamplerParams};

/// Output format of `ember run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// The generated text, streamed as it comes.
    Text,
    /// One JSON object: {"prompt_ids": [...], "tokens": [...], "text": "...", "steps": [{"id":
    /// ..., "top": [[id, logprob], [id, logprob]]}, ...]}, where each step's `top` holds the two
    /// most likely tokens (with log-probabilities) of the logits that token was sampled from.
    Json,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Model: a GGUF path, or a pinned model name (fetched on first use).
    #[arg(short = 'm', long)]
    pub model: String,
    /// The prompt.
    #[arg(
        short = 'p',
        long,
        required_unless_present = "prompt_ids",
        conflicts_with = "prompt_ids"
    )]
    pub prompt: Option<String>,
    /// The prompt as token ids (comma-separated), evaluated as given: no chat template, no BOS
    /// added. For re-evaluating a generation step exactly (scripts/gpu/golden_rule.py).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256)]
    pub n_predict: usize,
    /// Temperature; 0 is greedy decoding. The default, 0.8, is llama.cpp's.
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Keep only the K most likely tokens (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the most likely tokens up to this cumulative probability (1: all).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0: none).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalty for repeating recent tokens (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// How many recent tokens the penalties consider.
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Subtracted from the logit of every recent token.
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Subtracted from a recent token's logit once per occurrence.
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Wrap the prompt as one user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Use this Jinja chat template instead of the model's (implies --chat).
    #[arg(long)]
    pub chat_template_file: Option<std::path::PathBuf>,
    /// Worker threads (default: physical cores).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Context length (default: the model's, at most 4096).
    #[arg(short = 'c', long)]
    pub ctx_size: Option<usize>,
    /// Most prompt tokens evaluated in one batch.
    #[arg(short = 'b', long, default_value_t = 512)]
    pub batch_size: usize,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// The prompt's token ids as `run` evaluates them: through the chat template when asked, then
/// tokenized with special tokens added and parsed (as llama.cpp does).
pub fn prompt_ids(
    tokenizer: &Tokenizer,
    gguf: &ember_gguf::Gguf,
    prompt: &str,
    chat: bool,
    template_file: Option<&std::path::Path>,
) -> anyhow::Result<Vec<u32>> {
    let text = if chat || template_file.is_some() {
        let template = match template_file {
            Some(path) => {
                let source = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read chat template {}", path.display()))?;
                ChatTemplate::from_source(&source)
                    .with_context(|| format!("bad chat template {}", path.display()))?
            }
            None => {
                match ChatTemplate::from_gguf(gguf).context("bad chat template in the model")? {
                    Some(t) => t,
                    None => match ChatTemplate::builtin_for(tokenizer) {
                        Some(t) => t,
                        None => bail!(
                            "the model has no chat template: pass one with --chat-template-file"
                        ),
                    },
                }
            }
        };
        let token_text = |id: Option<u32>| {
            id.and_then(|t| tokenizer.token_text(t))
                .unwrap_or("")
                .to_string()
        };
        let bos = token_text(tokenizer.bos());
        let eos = token_text(tokenizer.eos());
        let rendered = template
            .render(&[ChatMessage::new("user", prompt)], true, &bos, &eos)
            .context("cannot render the chat template")?;
        // Templates often write the BOS text themselves; tokenizing with add_special would then
        // give two BOS tokens, so the template's copy is dropped (llama.cpp does the same).
        match rendered.strip_prefix(bos.as_str()) {
            Some(rest) if tokenizer.add_bos() && !bos.is_empty() => rest.to_string(),
            _ => rendered,
        }
    } else {
        prompt.to_string()
    };
    Ok(tokenizer.encode(&text, true, true))
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let loaded = load::load_on(&args.model, args.threads, &args.device)?;
    with_loaded!(loaded, |loaded| run_on(&loaded, &args))
}

fn run_on<B: Backend>(loaded: &Loaded<B>, args: &RunArgs) -> anyhow::Result<()> {
    let model = &loaded.model;
    let tokenizer = &loaded.tokenizer;
    let prompt = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => {
            let n_vocab = model.n_vocab();
            if let Some(bad) = ids.iter().find(|&&id| id as usize >= n_vocab) {
                bail!("--prompt-ids: token id {bad} is out of range: the vocabulary has {n_vocab} tokens");
            }
            ids.clone()
        }
        (None, Some(text)) => prompt_ids(
            tokenizer,
            model.gguf(),
            text,
            args.chat,
            args.chat_template_file.as_deref(),
        )?,
        (None, None) => bail!("expected a prompt: pass -p TEXT or --prompt-ids IDS"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization: expected at least one token");
    }
    let n_ctx = args
        .ctx_size
        .unwrap_or_else(|| model.hparams().n_ctx_train.min(DEFAULT_N_CTX));
    if prompt.len() >= n_ctx {
        bail!("the prompt has {} tokens: expected fewer than the context of {n_ctx} (use -c to enlarge it)", prompt.len());
    }
    let mut ctx = model.new_context(ContextParams::with_ctx(n_ctx));
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let mut sampler = Sampler::new(SamplerParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        penalty_last_n: args.repeat_last_n,
        seed,
    });

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut decoder = ember_tokenizer::StreamDecoder::new(tokenizer);
    let mut text = String::new();
    let start = Instant::now();
    let mut first_token_at = None;
    let streaming = args.format == Format::Text;
    let mut tops: Vec<Vec<(u32, f64)>> = Vec::new();
    let (tokens, stop) = generate::generate_observed(
        model,
        &mut ctx,
        0,
        &prompt,
        args.n_predict,
        args.batch_size,
        &mut sampler,
        |t| tokenizer.is_eog(t),
        |logits| {
            if !streaming {
                tops.push(generate::top_log_probs(logits, 2));
            }
        },
        |t| {
            first_token_at.get_or_insert_with(Instant::now);
            if tokenizer.is_eog(t) {
                return true;
            }
            let piece = decoder.push(t);
            text.push_str(&piece);
            if streaming {
                // A closed pipe (`ember run ... | head`) ends generation quietly.
                return out
                    .write_all(piece.as_bytes())
                    .and_then(|_| out.flush())
                    .is_ok();
            }
            true
        },
    )?;
    let rest = decoder.finish();
    text.push_str(&rest);
    let end = Instant::now();
    match args.format {
        Format::Text => {
            let _ = writeln!(out, "{rest}");
        }
        Format::Json => {
            let steps: Vec<serde_json::Value> = tokens
                .iter()
                .zip(&tops)
                .map(|(&id, top)| {
                    let top: Vec<serde_json::Value> = top
                        .iter()
                        .map(|&(id, lp)| serde_json::json!([id, lp]))
                        .collect();
                    serde_json::json!({ "id": id, "top": top })
                })
                .collect();
            let json = serde_json::json!({
                "prompt_ids": prompt,
                "tokens": tokens,
                "text": text,
                "steps": steps,
            });
            writeln!(out, "{json}")?;
        }
    }
    let first = first_token_at.unwrap_or(end);
    let prompt_s = (first - start).as_secs_f64();
    let gen_s = (end - first).as_secs_f64();
    let n_gen_timed = tokens.len().saturating_sub(1);
    eprintln!(
        "\n[{} prompt tokens in {:.2} s ({:.1} t/s), {} generated ({:.1} t/s), stop: {}, load {:.2} s]",
        prompt.len(),
        prompt_s,
        prompt.len() as f64 / prompt_s.max(1e-9),
        tokens.len(),
        n_gen_timed as f64 / gen_s.max(1e-9),
        match stop {
            StopReason::EndOfGeneration => "end of generation",
            StopReason::Length => "length",
            StopReason::ContextFull => "context full",
            StopReason::Stopped => "output closed",
        },
        loaded.load_time.as_secs_f64(),
    );
    drop(ctx);
    loaded.finish();
    Ok(())
}
