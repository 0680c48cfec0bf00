//! The engine core on the real SmolLM2 model (CPU, two threads): what a request served by the
//! scheduler produces against the plain generation loop, under concurrency, with the prefix
//! cache, under preemption and with cancellation.
//!
//! Greedy outputs are compared token for token. The CPU backend's kernels compute a token's row
//! the same way whatever else is in the batch (the quantized dot products and the attention
//! follow one fixed order per row, see `crates/quant/tests/ggml_order.rs`), so a sequence's
//! greedy tokens do not depend on its neighbours, and these comparisons are exact.

mod common;

use std::time::{Duration, Instant};

use ember::device::{DeviceOptions, DeviceSpec};
use ember::engine::{
    Engine, EngineConfig, Event, FinishReason, GenerateRequest, Health, RequestStream, SubmitError,
};
use ember::generate;
use ember::load::{self, AnyLoaded, LoadOptions};
use ember::model::ContextParams;
use ember::sample::{Sampler, SamplerParams};

const MODEL: &str = "smollm2-135m-instruct-q4_1";

fn load_model() -> AnyLoaded {
    common::model_path(MODEL);
    let options = LoadOptions {
        model: MODEL.to_string(),
        threads: common::TEST_THREADS,
        device: DeviceOptions {
            device: DeviceSpec::Cpu,
            ..DeviceOptions::default()
        },
    };
    load::load(&options, &mut |_| {}).expect("the pinned model loads")
}

fn engine(config: EngineConfig) -> Engine {
    Engine::start(load_model(), config).expect("the engine starts")
}

fn prompt_ids(engine: &Engine, text: &str) -> Vec<u32> {
    ember::chat::plain_prompt_ids(engine.tokenizer(), text)
}

/// The generated ids, the text and the finish reason of a request.
fn collect(mut stream: RequestStream) -> (Vec<u32>, String, FinishReason) {
    let mut ids = Vec::new();
    let mut text = String::new();
    while let Some(event) = stream.blocking_recv() {
        match event {
            Event::Tokens { text: t, tokens } => {
                text.push_str(&t);
                ids.extend(tokens.iter().map(|t| t.id));
            }
            Event::Done { finish_reason, .. } => return (ids, text, finish_reason),
            Event::Failed { message } => panic!("the request failed: {message}"),
        }
    }
    panic!("the stream ended without Done");
}

/// Greedy tokens of the plain generation loop (what `ember run --temp 0` computes).
fn reference_greedy(prompt: &[u32], n: usize) -> Vec<u32> {
    reference_greedy_split(prompt, 0, n)
}

const PROMPTS: [&str; 6] = [
    "The capital of France is",
    "Once upon a time, in a small village,",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
    "My favourite book is",
];

#[test]
fn a_request_alone_equals_the_generation_loop() {
    let engine = engine(EngineConfig::default());
    let prompt = prompt_ids(&engine, PROMPTS[0]);
    let stream = engine
        .submit(GenerateRequest::greedy(prompt.clone(), 24))
        .expect("accepted");
    let (ids, text, reason) = collect(stream);
    assert_eq!(ids, reference_greedy(&prompt, 24));
    assert_eq!(text, engine.tokenizer().decode(&ids, false));
    assert!(
        matches!(reason, FinishReason::Length | FinishReason::Stop),
        "{reason:?}"
    );
}

#[test]
fn concurrent_requests_each_get_their_solo_output() {
    let engine = engine(EngineConfig {
        parallel: 4,
        ubatch: 16,
        ..EngineConfig::default()
    });
    let prompts: Vec<Vec<u32>> = PROMPTS.iter().map(|p| prompt_ids(&engine, p)).collect();
    let solo: Vec<Vec<u32>> = prompts.iter().map(|p| reference_greedy(p, 12)).collect();
    let streams: Vec<RequestStream> = prompts
        .iter()
        .map(|p| {
            engine
                .submit(GenerateRequest::greedy(p.clone(), 12))
                .expect("accepted")
        })
        .collect();
    for (stream, want) in streams.into_iter().zip(&solo) {
        assert_eq!(&collect(stream).0, want);
    }
    let snapshot = wait_idle(&engine);
    assert_eq!(snapshot.kv.used_blocks, 0, "every block was freed");
    assert_eq!(engine.in_flight(), 0);
}

#[test]
fn a_shared_prefix_is_computed_once() {
    let engine = engine(EngineConfig::default());
    let system = "You are a helpful assistant who answers in one short sentence. ".repeat(12);
    let first = prompt_ids(&engine, &format!("{system}Question: what is two plus two?"));
    let second = prompt_ids(&engine, &format!("{system}Question: name a colour."));
    assert!(first.len() > 100);
    let (ids_first, _, _) = collect(
        engine
            .submit(GenerateRequest::greedy(first.clone(), 4))
            .unwrap(),
    );
    let computed_before = engine.snapshot().totals.prompt_tokens_computed;
    let (ids_second, _, _) = collect(
        engine
            .submit(GenerateRequest::greedy(second.clone(), 4))
            .unwrap(),
    );
    let totals = engine.snapshot().totals;
    let computed = totals.prompt_tokens_computed - computed_before;
    let shared = first
        .iter()
        .zip(&second)
        .take_while(|(a, b)| a == b)
        .count();
    // Only the part after the last whole shared block is computed again.
    assert!(
        computed as usize <= second.len() - shared + 32,
        "computed {computed} of {} prompt tokens, {shared} shared",
        second.len()
    );
    assert!(totals.prompt_tokens_cached as usize >= shared - 32);
    // Reused blocks hold exactly what computing them gives: the output equals the generation
    // loop's when it reads the prompt in the same two pieces (the cached blocks, then the rest).
    // Against one batch of the whole prompt it may differ in rounding, as any other split of a
    // prompt into batches does (the attention takes another path for long batches); on this
    // repetitive prompt it does.
    let cached = totals.prompt_tokens_cached as usize;
    assert_eq!(ids_first, reference_greedy(&first, 4));
    assert_eq!(ids_second, reference_greedy_split(&second, cached, 4));
}

/// [`reference_greedy`] with the prompt read as two batches, `prompt[..split]` then the rest
/// (one batch when `split` is 0).
fn reference_greedy_split(prompt: &[u32], split: usize, n: usize) -> Vec<u32> {
    let AnyLoaded::Cpu(loaded) = load_model() else {
        panic!("expected the CPU backend");
    };
    let model = &loaded.model;
    let mut ctx = model.new_context(ContextParams::with_ctx(512));
    if split > 0 {
        generate::eval_tokens(model, &mut ctx, 0, &prompt[..split], 512).expect("prefix");
    }
    let mut sampler = Sampler::new(SamplerParams::greedy());
    let tokenizer = &loaded.tokenizer;
    let (tokens, _) = generate::generate(
        model,
        &mut ctx,
        0,
        &prompt[split..],
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

#[test]
fn preempted_sequences_finish_with_the_same_output() {
    // Room for about two sequences at once: the others wait or are preempted and recomputed.
    let engine = engine(EngineConfig {
        parallel: 4,
        kv_capacity_tokens: 96,
        kv_block_size: 16,
        ubatch: 64,
        prefix_cache: false,
        ..EngineConfig::default()
    });
    let prompts: Vec<Vec<u32>> = PROMPTS[..4]
        .iter()
        .map(|p| prompt_ids(&engine, p))
        .collect();
    let solo: Vec<Vec<u32>> = prompts.iter().map(|p| reference_greedy(p, 30)).collect();
    let streams: Vec<RequestStream> = prompts
        .iter()
        .map(|p| {
            let mut request = GenerateRequest::greedy(p.clone(), 30);
            request.ignore_eos = true;
            engine.submit(request).expect("accepted")
        })
        .collect();
    for (stream, want) in streams.into_iter().zip(&solo) {
        let (ids, _, _) = collect(stream);
        assert_eq!(&ids[..want.len()], &want[..]);
    }
    let snapshot = wait_idle(&engine);
    assert!(
        snapshot.totals.preemptions > 0,
        "the cache was small enough to force preemption: {:?}",
        snapshot.totals
    );
    assert_eq!(snapshot.kv.used_blocks, 0);
}

#[test]
fn the_door_refuses_what_cannot_run() {
    let engine = engine(EngineConfig {
        parallel: 1,
        max_queue: 1,
        n_ctx: 64,
        kv_capacity_tokens: 64,
        ..EngineConfig::default()
    });
    assert_eq!(
        engine.submit(GenerateRequest::greedy(Vec::new(), 1)).err(),
        Some(SubmitError::EmptyPrompt)
    );
    assert!(matches!(
        engine.submit(GenerateRequest::greedy(vec![u32::MAX], 1)),
        Err(SubmitError::TokenOutOfRange { .. })
    ));
    assert!(matches!(
        engine.submit(GenerateRequest::greedy(vec![1; 64], 1)),
        Err(SubmitError::PromptTooLong {
            prompt_tokens: 64,
            n_ctx: 64
        })
    ));
    // One running and one waiting fill parallel + max_queue; the third is refused at once.
    let mut long = GenerateRequest::greedy(vec![1; 8], 50);
    long.ignore_eos = true;
    let a = engine.submit(long.clone()).expect("runs");
    let b = engine.submit(long.clone()).expect("waits");
    let started = Instant::now();
    assert!(matches!(
        engine.submit(long),
        Err(SubmitError::QueueFull { .. })
    ));
    assert!(started.elapsed() < Duration::from_millis(100));
    drop(a);
    drop(b);
    let snapshot = wait_idle(&engine);
    assert_eq!(snapshot.totals.requests_cancelled, 2);
    assert_eq!(snapshot.kv.used_blocks, 0);
    engine.begin_drain();
    assert_eq!(
        engine.submit(GenerateRequest::greedy(vec![1], 1)).err(),
        Some(SubmitError::Draining)
    );
}

#[test]
fn a_turn_submitted_as_the_last_one_ends_is_admitted_without_a_queue() {
    // `ember chat` runs one sequence and no queue, and submits the next turn the moment it reads
    // the previous answer's `Done`: the engine must count a request out before that event goes.
    let engine = engine(EngineConfig {
        parallel: 1,
        max_queue: 0,
        n_ctx: 64,
        kv_capacity_tokens: 64,
        ..EngineConfig::default()
    });
    let prompt = prompt_ids(&engine, PROMPTS[0]);
    for turn in 0..20 {
        let stream = engine
            .submit(GenerateRequest::greedy(prompt.clone(), 2))
            .unwrap_or_else(|e| panic!("turn {turn} was refused: {e}"));
        let (ids, _, _) = collect(stream);
        assert!(!ids.is_empty(), "turn {turn} generated nothing");
    }
}

#[test]
fn stop_strings_end_generation_without_their_text() {
    let engine = engine(EngineConfig::default());
    let prompt = prompt_ids(&engine, PROMPTS[2]);
    let (_, full, _) = collect(
        engine
            .submit(GenerateRequest::greedy(prompt.clone(), 24))
            .unwrap(),
    );
    // Stop at a piece of text from the middle of the output.
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[8..11].iter().collect();
    let mut request = GenerateRequest::greedy(prompt, 24);
    request.stop = vec![stop.clone()];
    let (_, text, reason) = collect(engine.submit(request).unwrap());
    assert_eq!(reason, FinishReason::Stop);
    let cut = full.find(&stop).expect("the stop text is in the output");
    assert_eq!(text, full[..cut]);
}

#[test]
fn logprobs_are_reported_for_each_token() {
    let engine = engine(EngineConfig::default());
    let mut request = GenerateRequest::greedy(prompt_ids(&engine, PROMPTS[3]), 6);
    request.logprobs = Some(3);
    let mut stream = engine.submit(request).unwrap();
    let mut seen = 0;
    while let Some(event) = stream.blocking_recv() {
        if let Event::Tokens { tokens, .. } = event {
            for token in tokens {
                seen += 1;
                let logprob = token.logprob.expect("asked for");
                assert!(logprob <= 0.0);
                assert_eq!(token.top.len(), 3);
                // Greedy: the chosen token is the most likely one.
                assert_eq!(token.top[0].id, token.id);
                assert!((token.top[0].logprob - logprob).abs() < 1e-9);
                assert!(token.top.windows(2).all(|w| w[0].logprob >= w[1].logprob));
            }
        }
    }
    assert!(seen > 0);
}

#[test]
fn health_reports_a_stalled_step_and_recovers() {
    let engine = engine(EngineConfig {
        watchdog: Duration::from_millis(300),
        fault_stall: Some((2, Duration::from_millis(1500))),
        ..EngineConfig::default()
    });
    assert_eq!(engine.health(), Health::Ok);
    let stream = engine
        .submit(GenerateRequest::greedy(prompt_ids(&engine, PROMPTS[0]), 4))
        .unwrap();
    let started = Instant::now();
    let mut saw_stall = false;
    while started.elapsed() < Duration::from_secs(5) {
        if let Health::Stalled {
            step_running_for,
            running,
            ..
        } = engine.health()
        {
            assert!(step_running_for.is_some());
            assert_eq!(running.len(), 1);
            saw_stall = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(saw_stall, "the stalled step was reported");
    let (ids, _, _) = collect(stream);
    assert!(!ids.is_empty());
    wait_idle(&engine);
    assert_eq!(engine.health(), Health::Ok);
}

/// Waits until the engine has no work and returns its snapshot then.
fn wait_idle(engine: &Engine) -> std::sync::Arc<ember::engine::Snapshot> {
    let started = Instant::now();
    loop {
        let snapshot = engine.snapshot();
        if snapshot.running.is_empty() && snapshot.waiting == 0 && engine.in_flight() == 0 {
            return snapshot;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the engine did not go idle: {snapshot:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
