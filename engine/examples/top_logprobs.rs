//! Prints the most likely next tokens of a prompt with their log-probabilities, for comparing
//! numerics with another implementation: `cargo run --release -p ember --example top_logprobs --
//! MODEL PROMPT [K]`; the environment variable `NB` sets the batch size (1 evaluates the
//! prompt one token at a time), `THREADS` the worker threads (default 2) and `LAST_ALONE=1`
//! evaluates the last prompt token on its own.

use ember::backend::cpu::CpuBackend;
use ember::generate::{eval_tokens, log_prob};
use ember::model::{ContextParams, Model};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(args.len() >= 3, "usage: top_logprobs MODEL PROMPT [K]");
    let k: usize = args.get(3).map_or(Ok(5), |s| s.parse())?;
    let path = ember::models::resolve(&args[1], &mut ember::models::NoProgress)?;
    // Two threads by default, as llama.cpp's reference runs: its attention over 512 or more
    // cached tokens splits the cache between threads, so the thread count shows in the digits.
    let threads: usize = std::env::var("THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    let model = Model::load(&path, CpuBackend::new(threads)?, &mut |_, _| {})?;
    let tokenizer = ember_tokenizer::Tokenizer::from_gguf(model.gguf())?;
    let ids = tokenizer.encode(&args[2], true, true);
    let mut ctx = model.new_context(ContextParams::with_ctx(ids.len() + 1));
    let n_batch: usize = std::env::var("NB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(512);
    // LAST_ALONE=1 evaluates the prompt but its last token in batches, then that token alone,
    // as llama.cpp's golden re-evaluation of a step does.
    let last_alone = std::env::var("LAST_ALONE").is_ok_and(|v| v == "1");
    let logits = if last_alone && ids.len() > 1 {
        let (head, last) = ids.split_at(ids.len() - 1);
        eval_tokens(&model, &mut ctx, 0, head, n_batch)?;
        eval_tokens(&model, &mut ctx, 0, last, n_batch)?.to_vec()
    } else {
        eval_tokens(&model, &mut ctx, 0, &ids, n_batch)?.to_vec()
    };
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    println!("prompt ids: {ids:?}");
    for &t in order.iter().take(k) {
        let piece = String::from_utf8_lossy(&tokenizer.token_to_piece(t as u32, true)).into_owned();
        println!("{t:8} {:>10.6} {piece:?}", log_prob(&logits, t));
    }
    Ok(())
}
