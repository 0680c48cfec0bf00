//! Encodes a text file with a model's tokenizer and reports the token count and the time taken:
//! `cargo run --release -p ember-tokenizer --example encode_file -- MODEL.gguf FILE [REPEATS]`.

use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(model), Some(file)) = (args.get(1), args.get(2)) else {
        return Err("usage: encode_file MODEL.gguf FILE [REPEATS]".into());
    };
    let repeats: usize = args.get(3).map(|r| r.parse()).transpose()?.unwrap_or(5);
    let started = Instant::now();
    let gguf = ember_gguf::Gguf::open(std::path::Path::new(model))?;
    let opened = started.elapsed();
    let tokenizer = ember_tokenizer::Tokenizer::from_gguf(&gguf)?;
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
