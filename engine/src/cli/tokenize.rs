//! `ember tokenize`: the token ids of a text, as llama-tokenize prints them.

use std::io::Write;

use anyhow::Context as _;
use clap::Args;
use ember::load::open_gguf;
use ember_tokenizer::Tokenizer;

use super::load;

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// Model: a GGUF path, `hf://OWNER/REPO[:QUANT]`, or a pinned model name (fetched on first
    /// use).
    #[arg(short = 'm', long)]
    pub model: String,
    /// The text to tokenize.
    #[arg(short = 'p', long)]
    pub prompt: String,
    /// Print only the ids, as one list: [1, 2, 3].
    #[arg(long)]
    pub ids: bool,
    /// Do not add the BOS token even when the model asks for it.
    #[arg(long)]
    pub no_bos: bool,
    /// Read special-token text (such as `<|im_start|>`) as plain text instead of as the special
    /// token (llama-tokenize parses it by default too).
    #[arg(long, conflicts_with = "parse_special")]
    pub no_parse_special: bool,
    /// Parse special-token text as the special token: the default, accepted for scripts that
    /// pass it.
    #[arg(long, hide = true)]
    pub parse_special: bool,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    // Only the tokenizer is needed: the weights are not loaded.
    let path = load::resolve_model(&args.model)?;
    let gguf = open_gguf(&path)?;
    let tokenizer = Tokenizer::from_gguf(&gguf)
        .with_context(|| format!("cannot load the tokenizer of {}", path.display()))?;
    let ids = tokenizer.encode(&args.prompt, !args.no_bos, !args.no_parse_special);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    if args.ids {
        let list: Vec<String> = ids.iter().map(u32::to_string).collect();
        writeln!(out, "[{}]", list.join(", "))?;
    } else {
        for &id in &ids {
            let piece = tokenizer.token_to_piece(id, true);
            writeln!(out, "{id:6} -> '{}'", String::from_utf8_lossy(&piece))?;
        }
    }
    Ok(())
}
