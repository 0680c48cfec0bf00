//! A sequence's logits do not depend on what else is in its batch (the real SmolLM2 model on
//! the CPU backend). A continuous-batching server puts many sequences' tokens in one forward
//! pass, and a request served among others must get what it gets alone: every op of the CPU
//! backend computes a token's row the same way whatever the batch holds, and attention picks its
//! path (GGML's one-query f16 path, its tiled f32 path for 64+ queries, its split-KV path for one
//! token over 512+ cells) by the tokens of that sequence in the batch, not the batch's size.

mod common;

use ember::backend::cpu::CpuBackend;
use ember::batch::Batch;
use ember::model::{Context, ContextParams, Model};

fn context(model: &Model<CpuBackend>) -> Context<CpuBackend> {
    model.new_context(ContextParams {
        n_ctx: 1024,
        kv_block_size: 32,
        kv_capacity_tokens: 1024 * 17,
    })
}

/// The logits of `prompt`'s last token, alone, and of the same prompt in `n_seqs` sequences of
/// one batch; then of one more token (`next`) alone and in one batch of all the sequences.
fn compare(model: &Model<CpuBackend>, prompt: &[u32], n_seqs: usize, next: u32) {
    let n_vocab = model.n_vocab();
    let mut alone = context(model);
    let solo = model
        .forward(&mut alone, &Batch::for_sequence(0, 0, prompt, false))
        .expect("forward")
        .to_vec();
    let solo_next = model
        .forward(
            &mut alone,
            &Batch::for_sequence(0, prompt.len() as u32, &[next], false),
        )
        .expect("forward")
        .to_vec();

    let mut together = context(model);
    let mut batch = Batch::new();
    for seq in 0..n_seqs {
        for (pos, &token) in prompt.iter().enumerate() {
            batch.push(token, pos as u32, seq as u32, pos + 1 == prompt.len());
        }
    }
    let logits = model
        .forward(&mut together, &batch)
        .expect("forward")
        .to_vec();
    for seq in 0..n_seqs {
        assert_eq!(
            &logits[seq * n_vocab..(seq + 1) * n_vocab],
            &solo[..],
            "prompt of {} tokens, sequence {seq} of {n_seqs}",
            prompt.len()
        );
    }
    let mut batch = Batch::new();
    for seq in 0..n_seqs {
        batch.push(next, prompt.len() as u32, seq as u32, true);
    }
    let logits = model
        .forward(&mut together, &batch)
        .expect("forward")
        .to_vec();
    for seq in 0..n_seqs {
        assert_eq!(
            &logits[seq * n_vocab..(seq + 1) * n_vocab],
            &solo_next[..],
            "next token after {} tokens, sequence {seq} of {n_seqs}",
            prompt.len()
        );
    }
}

#[test]
fn short_prompts_in_a_batch_of_64_or_more_tokens_keep_their_logits() {
    let (model, tokenizer) = common::load("smollm2-135m-instruct-q4_1");
    let prompt = tokenizer.encode("The capital of France is", true, true);
    assert!(prompt.len() * 16 >= 64 && prompt.len() < 64);
    compare(&model, &prompt, 16, 42);
}

#[test]
fn long_prompts_and_decoding_over_a_long_cache_keep_their_logits() {
    let (model, tokenizer) = common::load("smollm2-135m-instruct-q4_1");
    let text = "The capital of France is Paris and the capital of Spain is Madrid. ".repeat(40);
    let prompt = tokenizer.encode(&text, true, true);
    // Over 512 cells: one decoding token alone takes the split-KV path.
    assert!(prompt.len() > 520, "{}", prompt.len());
    compare(&model, &prompt, 2, 42);
}
