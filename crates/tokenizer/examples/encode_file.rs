//! Encodes a text file with a model's tokenizer and reports the token count and the time taken:
//! `cargo run --release -p ember-tokenizer --example encode_file -- MODEL.gguf FILE [REPEATS] [PRE]`.
//!
//! With PRE, a byte-level BPE model's vocabulary is run with that pre-tokenizer instead of its own,
//! to time the pre-tokenizers on real text (the ids are then not the model's).

use std::time::Instant;

use ember_tokenizer::{Tokenizer, TokenizerSpec};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(model), Some(file)) = (args.get(1), args.get(2)) else {
        return Err("usage: encode_file MODEL.gguf FILE [REPEATS] [PRE]".into());
    };
    let repeats: usize = args.get(3).map(|r| r.parse()).transpose()?.unwrap_or(5);
    let started = Instant::now();
    let gguf = ember_gguf::Gguf::open(std::path::Path::new(model))?;
    let opened = started.elapsed();
    let tokenizer = match args.get(4) {
        None => Tokenizer::from_gguf(&gguf)?,
        Some(pre) => {
            let md = gguf.metadata();
            Tokenizer::from_spec(&TokenizerSpec {
                model: "gpt2".into(),
                pre: Some(pre.clone()),
                tokens: md.get_str_array("tokenizer.ggml.tokens")?.to_vec(),
                merges: Some(md.get_str_array("tokenizer.ggml.merges")?.to_vec()),
                token_types: md
                    .get_i32_array_opt("tokenizer.ggml.token_type")?
                    .map(<[i32]>::to_vec),
                add_bos: Some(false),
                ..TokenizerSpec::default()
            })?
        }
    };
    println!(
        "open: {:.1} ms, tokenizer: {:.1} ms",
        opened.as_secs_f64() * 1e3,
        (started.elapsed() - opened).as_secs_f64() * 1e3
    );
    let text = std::fs::read_to_string(file)?;
    let mut best = f64::MAX;
    let mut n_tokens = 0;
    for _ in 0..repeats.max(1) {
        let started = Instant::now();
        let ids = tokenizer.encode(&text, true, false);
        best = best.min(started.elapsed().as_secs_f64());
        n_tokens = ids.len();
    }
    println!(
        "{} bytes -> {n_tokens} tokens in {:.1} ms (best of {repeats})",
        text.len(),
        best * 1e3
    );
    Ok(())
}
