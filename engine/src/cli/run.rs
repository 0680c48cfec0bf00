//! `ember run`: generate from a prompt, streaming text (or one JSON object at the end).

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use anyhow::bail;
use clap::{Args, ValueEnum};
use ember::chat::{self, ChatError};
use ember::engine::{Engine, EngineConfig, Event, FinishReason, GenerateRequest};
use ember::model::DEFAULT_N_CTX;
use ember::sample::SamplerParams;
use ember::with_loaded;
use ember_gguf::Gguf;
use ember_tokenizer::{ChatMessage, Tokenizer};

use super::device::DeviceArgs;
use super::load;

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
    /// A multimodal projector (llama.cpp's `--mmproj`): refused, as ember runs text models only.
    #[arg(long, value_name = "FILE")]
    pub mmproj: Option<std::path::PathBuf>,
    /// The prompt; `-` reads it from standard input.
    #[arg(
        short = 'p',
        long,
        required_unless_present_any = ["prompt_ids", "file"],
        conflicts_with_all = ["prompt_ids", "file"]
    )]
    pub prompt: Option<String>,
    /// Read the prompt from this file.
    #[arg(short = 'f', long, value_name = "FILE", conflicts_with = "prompt_ids")]
    pub file: Option<std::path::PathBuf>,
    /// A system message before the prompt (implies --chat).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Stop when the output contains this text (repeatable); the text itself is not printed.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// The prompt as token ids (comma-separated), evaluated as given: no chat template, no BOS
    /// added. For re-evaluating a generation step exactly (scripts/gpu/golden_rule.py).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Tokens to generate at most; -1 generates until the end of generation or a full context,
    /// as llama.cpp does.
    #[arg(short = 'n', long = "n-predict", default_value_t = 256, allow_negative_numbers = true, value_parser = parse_n_predict)]
    pub n_predict: i64,
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
    /// Worker threads (0, the default: one per physical core).
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

/// `-n`: a token count, or -1 for no limit. Counts past `i64::MAX` (up to `u64::MAX`) are taken as
/// `i64::MAX`: generation ends at the context's end long before either.
pub(super) fn parse_n_predict(text: &str) -> Result<i64, String> {
    match (text.parse::<i64>(), text.parse::<u64>()) {
        (Ok(n), _) if n >= -1 => Ok(n),
        (Err(_), Ok(_)) => Ok(i64::MAX),
        _ => Err(format!(
            "expected a token count, or -1 for no limit, found {text:?}"
        )),
    }
}

/// The prompt text `-p TEXT`, `-p -` (standard input) or `-f FILE` gives, read with the same cap
/// as other texts ([`ember::limits::MAX_TEXT_FILE_BYTES`]).
fn prompt_text(args: &RunArgs) -> anyhow::Result<Option<String>> {
    use std::io::Read;
    let max = ember::limits::MAX_TEXT_FILE_BYTES;
    if let Some(path) = &args.file {
        let text = ember::limits::read_text_file(path, max)
            .map_err(|e| anyhow::anyhow!("-f {}: {e}", path.display()))?;
        return Ok(Some(text));
    }
    match args.prompt.as_deref() {
        Some("-") => {
            let mut bytes = Vec::new();
            std::io::stdin()
                .lock()
                .take(max + 1)
                .read_to_end(&mut bytes)
                .map_err(|e| anyhow::anyhow!("-p -: cannot read standard input: {e}"))?;
            if bytes.len() as u64 > max {
                bail!("-p -: expected at most {max} bytes on standard input, found more");
            }
            let text = String::from_utf8(bytes)
                .map_err(|e| anyhow::anyhow!("-p -: standard input is not UTF-8 text: {e}"))?;
            Ok(Some(text))
        }
        other => Ok(other.map(str::to_string)),
    }
}

/// The prompt's token ids as `run` evaluates them: as one user message through the chat
/// template when asked (`--chat` or `--chat-template-file`), else as plain text; tokenized with
/// special tokens added and parsed (as llama.cpp does).
fn prompt_ids(
    tokenizer: &Tokenizer,
    gguf: &Gguf,
    prompt: &str,
    chat: bool,
    system: Option<&str>,
    template_file: Option<&Path>,
) -> Result<Vec<u32>, ChatError> {
    if !chat && system.is_none() && template_file.is_none() {
        return Ok(chat::plain_prompt_ids(tokenizer, prompt));
    }
    if template_file.is_none() {
        if let Some(warning) = chat::chat_warning(gguf) {
            eprintln!("warning: {warning}");
        }
    }
    let template = chat::resolve_template(gguf, tokenizer, template_file)?;
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(ChatMessage::new("system", system));
    }
    messages.push(ChatMessage::new("user", prompt));
    chat::prompt_ids(tokenizer, template.as_ref(), &messages)
}

/// The sampling flags as engine parameters, checked ([`SamplerParams::validate`]).
fn sampling(args: &RunArgs) -> anyhow::Result<SamplerParams> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let params = SamplerParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        frequency_penalty: args.frequency_penalty,
        presence_penalty: args.presence_penalty,
        penalty_last_n: args.repeat_last_n,
        seed,
    };
    params
        .validate()
        .map_err(|e| anyhow::anyhow!("{}", e.for_flag()))?;
    Ok(params)
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    // Every flag is checked before the model is loaded.
    let sampling = sampling(&args)?;
    if let Some(n_ctx) = args.ctx_size {
        ember::limits::check_context(n_ctx, 1, 0, None).map_err(|e| anyhow::anyhow!("-c: {e}"))?;
    }
    if let Some(path) = &args.mmproj {
        bail!(
            "--mmproj {}: {}",
            path.display(),
            ember::model::MULTIMODAL_UNSUPPORTED
        );
    }
    let text = prompt_text(&args)?;
    let loaded = load::load_on(&args.model, args.threads, &args.device)?;
    // The prompt is read with the model's tokenizer and template before the model moves to the
    // engine thread.
    let (prompt, n_ctx_train, kv_bytes_per_token, load_time, memory_reporter, kv_memory) = with_loaded!(
        &loaded,
        |l| {
            let model = &l.model;
            let prompt = match (&args.prompt_ids, &args.prompt) {
                (Some(ids), _) => {
                    let n_vocab = model.n_vocab();
                    if let Some(bad) = ids.iter().find(|&&id| id as usize >= n_vocab) {
                        bail!("--prompt-ids: token id {bad} is out of range: the vocabulary has {n_vocab} tokens");
                    }
                    ids.clone()
                }
                (None, _) if text.is_some() => prompt_ids(
                    &l.tokenizer,
                    model.gguf(),
                    text.as_deref().unwrap_or(""),
                    args.chat,
                    args.system.as_deref(),
                    args.chat_template_file.as_deref(),
                )?,
                (None, _) => bail!("expected a prompt: pass -p TEXT, -p - (standard input), -f FILE or --prompt-ids IDS"),
            };
            let memory_reporter = l.memory_reporter();
            (
                prompt,
                model.hparams().n_ctx_train,
                model.hparams().kv_bytes_per_token(),
                l.load_time,
                memory_reporter,
                // The KV cache goes where the model is: this process's memory, or the device's.
                ember::limits::KvMemory::of(l.pool.as_deref()),
            )
        }
    );
    if prompt.is_empty() {
        bail!("the prompt is empty after tokenization: expected at least one token");
    }
    let n_ctx = args
        .ctx_size
        .unwrap_or_else(|| n_ctx_train.min(DEFAULT_N_CTX));
    if n_ctx > n_ctx_train {
        eprintln!("warning: -c {n_ctx} is above the {n_ctx_train} tokens the model was trained on: output past that may degrade");
    }
    ember::limits::check_context(n_ctx, 1, kv_bytes_per_token, kv_memory.as_ref())
        .map_err(|e| anyhow::anyhow!("-c {n_ctx}: {e}"))?;
    if prompt.len() >= n_ctx {
        bail!("the prompt has {} tokens: expected fewer than the context of {n_ctx} (use -c to enlarge it)", prompt.len());
    }
    // One sequence, read in batches of -b tokens: the same forward passes as before the engine
    // existed, so greedy output is unchanged.
    let engine = Engine::start(
        loaded,
        EngineConfig {
            parallel: 1,
            max_queue: 0,
            n_ctx,
            kv_capacity_tokens: n_ctx,
            ubatch: args.batch_size.max(1),
            prefix_cache: false,
            ..EngineConfig::default()
        },
    )?;
    let result = generate_on(&engine, &args, sampling, prompt, load_time);
    engine.shutdown();
    if let Some(reporter) = memory_reporter {
        load::print_memory_report_after_idle(&reporter);
    }
    result
}

fn generate_on(
    engine: &Engine,
    args: &RunArgs,
    sampling: SamplerParams,
    prompt: Vec<u32>,
    load_time: std::time::Duration,
) -> anyhow::Result<()> {
    let streaming = args.format == Format::Text;
    let request = GenerateRequest {
        prompt: prompt.clone(),
        // -1: until the end of generation or a full context.
        max_tokens: usize::try_from(args.n_predict).ok(),
        sampling,
        stop: args.stop.clone(),
        // The JSON output records the two most likely tokens of every step.
        logprobs: (!streaming).then_some(2),
        ignore_eos: false,
        report_eog: true,
    };
    let start = Instant::now();
    let mut stream = engine.submit(request)?;
    // Ctrl-C stops generation and still prints the stats line.
    super::interrupt::install();
    let _interrupt = super::interrupt::cancel_on_interrupt(stream.canceller());
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut text = String::new();
    let mut tokens: Vec<u32> = Vec::new();
    let mut tops: Vec<Vec<(u32, f64)>> = Vec::new();
    let mut first_token_at = None;
    let mut closed = false;
    let finish = loop {
        let Some(event) = stream.blocking_recv() else {
            bail!("the engine stopped before the request ended");
        };
        match event {
            Event::Tokens {
                text: piece,
                tokens: generated,
            } => {
                first_token_at.get_or_insert_with(Instant::now);
                for token in &generated {
                    tokens.push(token.id);
                    tops.push(token.top.iter().map(|t| (t.id, t.logprob)).collect());
                }
                text.push_str(&piece);
                // A closed pipe (`ember run ... | head`) ends generation quietly.
                if streaming
                    && !closed
                    && out
                        .write_all(piece.as_bytes())
                        .and_then(|_| out.flush())
                        .is_err()
                {
                    closed = true;
                    stream.cancel();
                }
            }
            Event::Done { finish_reason, .. } => break finish_reason,
            Event::Failed { message } => bail!("generation failed: {message}"),
        }
    };
    let end = Instant::now();
    match args.format {
        Format::Text => {
            let _ = writeln!(out);
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
    // Speeds are shown only where something was timed: no token means the prompt's time is
    // unknown, one token means no generation interval.
    let rate = |n: usize, seconds: f64| {
        if n == 0 || seconds <= 0.0 {
            "-".to_string()
        } else {
            format!("{:.1} t/s", n as f64 / seconds)
        }
    };
    let (prompt_s, prompt_rate, gen_rate) = match first_token_at {
        Some(first) => (
            format!("{:.2} s", (first - start).as_secs_f64()),
            rate(prompt.len(), (first - start).as_secs_f64()),
            rate(tokens.len().saturating_sub(1), (end - first).as_secs_f64()),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    };
    eprintln!(
        "\n[{} prompt tokens in {prompt_s} ({prompt_rate}), {} generated ({gen_rate}), stop: {}, load {:.2} s]",
        prompt.len(),
        tokens.len(),
        match finish {
            _ if closed => "output closed",
            FinishReason::Stop => "end of generation",
            FinishReason::Length => "length",
            FinishReason::ContextFull => "context full",
            FinishReason::Cancelled => "cancelled",
        },
        load_time.as_secs_f64(),
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_n_predict;

    #[test]
    fn n_predict_takes_counts_of_any_size_and_minus_one() {
        assert_eq!(parse_n_predict("-1"), Ok(-1));
        assert_eq!(parse_n_predict("0"), Ok(0));
        assert_eq!(parse_n_predict("128"), Ok(128));
        // Past i64: generation ends at the context long before.
        assert_eq!(parse_n_predict(&u64::MAX.to_string()), Ok(i64::MAX));
        for bad in [
            "-2",
            "-18446744073709551615",
            "18446744073709551616",
            "ten",
            "",
        ] {
            let error = parse_n_predict(bad).unwrap_err();
            assert!(error.contains("-1 for no limit"), "{bad}: {error}");
        }
    }
}
