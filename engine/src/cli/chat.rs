//! `ember chat`: an interactive conversation with a model. The history lives in an
//! [`ember::chat::Conversation`] and is rendered whole through the model's chat template for every
//! answer; the engine's prefix cache reuses what was already read. Lines are edited with
//! rustyline when standard input is a terminal, and read plainly otherwise (scripts, tests).

use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

use anyhow::bail;
use clap::Args;
use ember::chat::{self, ChatInput, Conversation, CHAT_COMMANDS};
use ember::engine::{Engine, EngineConfig, Event, FinishReason, GenerateRequest};
use ember::model::DEFAULT_N_CTX;
use ember::sample::SamplerParams;
use ember::with_loaded;

use super::device::DeviceArgs;
use super::{interrupt, load};

#[derive(Debug, Args)]
pub struct ChatArgs {
    /// Model: a GGUF path, `hf://OWNER/REPO[:QUANT]`, or a pinned model name (fetched on first
    /// use).
    #[arg(short = 'm', long)]
    pub model: String,
    /// A system message at the start of the conversation (kept by /reset).
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Tokens per answer at most; -1 (the default) answers until the end of generation or a
    /// full context.
    #[arg(short = 'n', long = "n-predict", default_value_t = -1, allow_negative_numbers = true, value_parser = super::run::parse_n_predict)]
    pub n_predict: i64,
    /// Temperature; 0 is greedy decoding.
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
    /// Random seed (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Worker threads (0, the default: one per physical core).
    #[arg(short = 't', long, default_value_t = 0)]
    pub threads: usize,
    /// Context length: the whole conversation must fit (default: the model's, at most 4096).
    #[arg(short = 'c', long)]
    pub ctx_size: Option<usize>,
    /// Print each answer's token counts and speed on stderr.
    #[arg(short = 'v', long)]
    pub verbose: bool,
    #[command(flatten)]
    pub device: DeviceArgs,
}

/// Where lines come from: a line editor on a terminal, plain lines otherwise.
enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Plain(std::io::StdinLock<'static>),
}

impl Input {
    fn open() -> Input {
        if std::io::stdin().is_terminal() {
            if let Ok(editor) = rustyline::DefaultEditor::new() {
                return Input::Editor(Box::new(editor));
            }
        }
        Input::Plain(std::io::stdin().lock())
    }

    /// The next line; `None` at the end of input (Ctrl-D).
    fn read(&mut self) -> anyhow::Result<Option<String>> {
        match self {
            Input::Editor(editor) => loop {
                match editor.readline("> ") {
                    Ok(line) => {
                        if !line.trim().is_empty() {
                            let _ = editor.add_history_entry(line.as_str());
                        }
                        return Ok(Some(line));
                    }
                    // Ctrl-C at the prompt clears the line, as shells do.
                    Err(rustyline::error::ReadlineError::Interrupted) => continue,
                    Err(rustyline::error::ReadlineError::Eof) => return Ok(None),
                    Err(e) => bail!("cannot read the terminal: {e}"),
                }
            },
            Input::Plain(stdin) => {
                let mut line = String::new();
                // A line longer than this is not typed; refuse it rather than grow without end.
                let max = ember::limits::MAX_TEXT_FILE_BYTES;
                let n = std::io::Read::take(&mut *stdin, max + 1)
                    .read_line(&mut line)
                    .map_err(|e| anyhow::anyhow!("cannot read standard input: {e}"))?;
                if n as u64 > max {
                    bail!("expected lines of at most {max} bytes on standard input, found more");
                }
                Ok((n > 0).then_some(line))
            }
        }
    }
}

pub fn run(args: ChatArgs) -> anyhow::Result<()> {
    let sampling = SamplerParams {
        temperature: args.temp,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repeat_penalty: args.repeat_penalty,
        seed: args.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        }),
        ..SamplerParams::default()
    };
    sampling
        .validate()
        .map_err(|e| anyhow::anyhow!("{}", e.for_flag()))?;
    if let Some(n_ctx) = args.ctx_size {
        ember::limits::check_context(n_ctx, 1, 0, None).map_err(|e| anyhow::anyhow!("-c: {e}"))?;
    }
    let loaded = load::load_on(&args.model, args.threads, &args.device)?;
    let (warning, n_ctx_train, kv_bytes_per_token, kv_memory) = with_loaded!(&loaded, |l| {
        (
            chat::chat_warning(l.model.gguf()),
            l.model.hparams().n_ctx_train,
            l.model.hparams().kv_bytes_per_token(),
            ember::limits::KvMemory::of(l.pool.as_deref()),
        )
    });
    let n_ctx = args
        .ctx_size
        .unwrap_or_else(|| n_ctx_train.min(DEFAULT_N_CTX));
    if n_ctx > n_ctx_train {
        eprintln!("warning: -c {n_ctx} is above the {n_ctx_train} tokens the model was trained on: output past that may degrade");
    }
    ember::limits::check_context(n_ctx, 1, kv_bytes_per_token, kv_memory.as_ref())
        .map_err(|e| anyhow::anyhow!("-c {n_ctx}: {e}"))?;
    let engine = Engine::start(
        loaded,
        EngineConfig {
            parallel: 1,
            max_queue: 0,
            n_ctx,
            kv_capacity_tokens: n_ctx,
            prefix_cache: true,
            ..EngineConfig::default()
        },
    )?;
    let result = converse(&engine, &args, sampling, n_ctx, warning);
    engine.shutdown();
    result
}

fn converse(
    engine: &Engine,
    args: &ChatArgs,
    sampling: SamplerParams,
    n_ctx: usize,
    warning: Option<String>,
) -> anyhow::Result<()> {
    // A model without any usable template cannot chat: say so before the first question.
    if let Err(e) = engine.chat_prompt(&[ember_tokenizer::ChatMessage::new("user", "hi")]) {
        if matches!(e, chat::ChatError::NoTemplate) {
            bail!("{}: the model has no chat template and none of the shipped ones fits its vocabulary, so it cannot hold a conversation (it may be a base model); `ember run -p TEXT` continues a plain text", args.model);
        }
        return Err(e.into());
    }
    if let Some(warning) = warning {
        eprintln!("warning: {warning}");
    }
    let mut input = Input::open();
    let interactive = matches!(input, Input::Editor(_));
    if interactive {
        eprintln!("{CHAT_COMMANDS}");
    }
    let interrupts = interrupt::install();
    let mut conversation = Conversation::new(args.system.clone());
    let stdout = std::io::stdout();
    while let Some(line) = input.read()? {
        let user = match ChatInput::parse(&line) {
            ChatInput::Exit => break,
            ChatInput::Empty => continue,
            ChatInput::Help => {
                eprintln!("{CHAT_COMMANDS}");
                continue;
            }
            ChatInput::Reset => {
                conversation.reset();
                eprintln!("[conversation reset]");
                continue;
            }
            ChatInput::Unknown(command) => {
                eprintln!("unknown command {command}: {CHAT_COMMANDS}");
                continue;
            }
            ChatInput::Message(text) => text,
        };
        let prompt = engine.chat_prompt(&conversation.with_user(&user))?;
        if prompt.len() >= n_ctx {
            eprintln!(
                "[the conversation needs {} tokens, the context holds {n_ctx}: /reset starts again, -c enlarges it]",
                prompt.len()
            );
            continue;
        }
        let request = GenerateRequest {
            prompt: prompt.clone(),
            max_tokens: usize::try_from(args.n_predict).ok(),
            sampling: SamplerParams {
                // Each answer draws differently, reproducibly from --seed.
                seed: sampling
                    .seed
                    .wrapping_add(conversation.n_exchanges() as u64),
                ..sampling.clone()
            },
            stop: Vec::new(),
            logprobs: None,
            ignore_eos: false,
            report_eog: false,
        };
        let start = Instant::now();
        let mut stream = engine.submit(request)?;
        let _guard = interrupts.then(|| interrupt::cancel_on_interrupt(stream.canceller()));
        let mut answer = String::new();
        let mut n_tokens = 0usize;
        let mut out = stdout.lock();
        let finish = loop {
            match stream.blocking_recv() {
                Some(Event::Tokens { text, tokens }) => {
                    n_tokens += tokens.len();
                    answer.push_str(&text);
                    let _ = out.write_all(text.as_bytes()).and_then(|_| out.flush());
                }
                Some(Event::Done { finish_reason, .. }) => break finish_reason,
                Some(Event::Failed { message }) => bail!("generation failed: {message}"),
                None => bail!("the engine stopped before the answer ended"),
            }
        };
        let _ = writeln!(out);
        drop(out);
        match finish {
            FinishReason::Cancelled => eprintln!("[stopped]"),
            FinishReason::ContextFull => {
                eprintln!("[the context is full: /reset starts again, -c enlarges it]")
            }
            FinishReason::Length | FinishReason::Stop => {}
        }
        if args.verbose {
            let seconds = start.elapsed().as_secs_f64();
            eprintln!(
                "[{} prompt tokens, {n_tokens} generated in {seconds:.2} s, stop: {}]",
                prompt.len(),
                match finish {
                    FinishReason::Stop => "end of generation",
                    FinishReason::Length => "length",
                    FinishReason::ContextFull => "context full",
                    FinishReason::Cancelled => "cancelled",
                }
            );
        }
        // A stopped answer stays in the history as far as it went, as llama.cpp keeps it.
        conversation.push(&user, &answer);
    }
    Ok(())
}
