//! The engine core on a hybrid model (a tiny synthetic `qwen35`: three Gated DeltaNet layers
//! with a recurrent state per sequence, one full-attention layer): requests served by the
//! scheduler, alone, together and under preemption, give the greedy tokens of the plain
//! generation loop; the prefix cache stays unused (a cached prefix would come without its
//! recurrent state); and every state is freed when its sequence ends.
//!
//! Greedy outputs are compared token for token: each token's row is computed the same way
//! whatever else is in the batch (the linear-attention op runs each sequence's recurrence on its
//! own), as for the other architectures in `engine.rs`.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use ember::device::{DeviceOptions, DeviceSpec};
use ember::engine::{Engine, EngineConfig, Event, GenerateRequest};
use ember::generate;
use ember::load::{self, AnyLoaded, LoadOptions};
use ember::model::ContextParams;
use ember::sample::{Sampler, SamplerParams};

fn write_hybrid(dir: &Path) -> String {
    common::write_hybrid(dir, "qwen35-engine.gguf", 1024, 21)
        .display()
        .to_string()
}

fn load_model(path: &str) -> AnyLoaded {
    let options = LoadOptions {
        model: path.to_string(),
        threads: 2,
        device: DeviceOptions {
            device: DeviceSpec::Cpu,
            ..DeviceOptions::default()
        },
    };
    load::load(&options, &mut |_| {}).expect("the synthetic hybrid loads")
}

fn collect(mut stream: ember::engine::RequestStream) -> Vec<u32> {
    let mut ids = Vec::new();
    while let Some(event) = stream.blocking_recv() {
        match event {
            Event::Tokens { tokens, .. } => ids.extend(tokens.iter().map(|t| t.id)),
            Event::Done { .. } => return ids,
            Event::Failed { message } => panic!("the request failed: {message}"),
        }
    }
    panic!("the stream ended without Done");
}

/// Greedy tokens of the plain generation loop, the prompt read in one batch.
fn reference_greedy(path: &str, prompt: &[u32], n: usize) -> Vec<u32> {
    let AnyLoaded::Cpu(loaded) = load_model(path) else {
        panic!("expected the CPU backend");
    };
    let model = &loaded.model;
    let mut ctx = model.new_context(ContextParams::with_ctx(512));
    let mut sampler = Sampler::new(SamplerParams::greedy());
    let tokenizer = &loaded.tokenizer;
    let (tokens, _) = generate::generate(
        model,
        &mut ctx,
        0,
        prompt,
        n,
        512,
        &mut sampler,
        |t| tokenizer.is_eog(t),
        |_| true,
    )
    .expect("generation runs");
    tokens
        .into_iter()
        .filter(|&t| !tokenizer.is_eog(t))
        .collect()
}

fn wait_idle(engine: &Engine) -> std::sync::Arc<ember::engine::Snapshot> {
    let started = Instant::now();
    loop {
        let snapshot = engine.snapshot();
        if snapshot.running.is_empty() && snapshot.waiting == 0 && engine.in_flight() == 0 {
            return snapshot;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the engine did not go idle: {snapshot:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn hybrid_requests_match_the_generation_loop_without_the_prefix_cache() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_hybrid(dir.path());
    // The prefix cache is asked for (the default) and must stay unused; four sequences in a
    // pool of 96 KV tokens do not all fit, so some are preempted and recomputed from the start.
    let engine = Engine::start(
        load_model(&path),
        EngineConfig {
            parallel: 4,
            kv_capacity_tokens: 96,
            kv_block_size: 16,
            ubatch: 64,
            ..EngineConfig::default()
        },
    )
    .expect("the engine starts");
    assert!(EngineConfig::default().prefix_cache);
    let system: Vec<u32> = (0..40).map(|i| (i * 37 % 1000) as u32 + 10).collect();
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|k| {
            let mut p = system.clone();
            p.extend((0..5).map(|i| 100 + 7 * k + i));
            p
        })
        .collect();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(GenerateRequest::greedy(p.clone(), 12))
                .unwrap()
        })
        .collect();
    let outputs: Vec<Vec<u32>> = streams.into_iter().map(collect).collect();
    let snapshot = wait_idle(&engine);
    for (prompt, output) in prompts.iter().zip(&outputs) {
        assert_eq!(output, &reference_greedy(&path, prompt, 12));
    }
    let totals = snapshot.totals;
    assert_eq!(totals.prompt_tokens_cached, 0, "{totals:?}");
    assert!(
        totals.prompt_tokens_computed >= totals.prompt_tokens,
        "{totals:?}"
    );
    assert!(
        totals.preemptions > 0,
        "the pool was meant to run short: {totals:?}"
    );
    assert_eq!(snapshot.kv.recurrent_state_bytes, 0, "{:?}", snapshot.kv);
}
