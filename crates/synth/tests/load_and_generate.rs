//! Synthetic models load with ember's CPU path, pass ember-gguf's validation, tokenize text with
//! their vocabulary, and generate: every architecture family in every type, at reduced sizes so
//! the test stays quick (the full shapes are the same code with bigger numbers).
//!
//! "Numerically sane" is checked on the logits of a prompt: all finite, their standard deviation
//! near the target of 3 that the output scale aims at (between 1 and 10: a network whose
//! activations blew up or vanished through the layers would be far outside), and a clear top
//! choice (the best logit at least two standard deviations above the mean), and no strong pull
//! towards repeating the input token.

use std::sync::Arc;

use ember::backend::cpu::CpuBackend;
use ember::generate;
use ember::model::{ContextParams, Model};
use ember::sample::{Sampler, SamplerParams};
use ember_gguf::{GgmlType, Gguf};
use ember_synth::{write_model, Shape, SynthOptions, TypeSpec, SHAPE_NAMES, TYPE_NAMES};
use ember_tokenizer::Tokenizer;

/// A shape of the family of `name` small enough for a debug-build test: rows of 256 elements so
/// every K-quant applies (SmolLM2 keeps a 576-like odd width of 320 to exercise the fallback);
/// mixtures of experts keep 8 experts of 256 rows, 2 used per token.
fn small(name: &str) -> Shape {
    let mut s = Shape::named(name).unwrap();
    s.n_layer = if s.sliding_window.is_some() { 6 } else { 2 };
    s.n_vocab = 600;
    s.n_embd = 256;
    s.n_ff = 512;
    s.head_dim = 64;
    // QK-norm families also have heads wider than n_embd / n_head.
    s.n_head = if s.qk_norm { 8 } else { 4 };
    s.n_head_kv = if s.n_head_kv == 1 { 1 } else { 2 };
    if s.sliding_window.is_some() {
        s.sliding_window = Some(4);
    }
    if let Some(moe) = &mut s.moe {
        moe.n_expert = 8;
        moe.n_expert_used = 2;
        moe.n_ff_expert = 256;
        if let Some(shared) = &mut moe.n_ff_shared {
            *shared = 256;
        }
    }
    // Hybrids: three linear-attention layers and one full-attention layer.
    if let Some(linear) = &mut s.linear {
        s.n_layer = 4;
        linear.n_k_heads = 2;
        linear.n_v_heads = 4;
        linear.head_dim = 64;
        s.rope_dims = Some(16);
    }
    // Gemma 4: a global layer after each group of sliding ones; the E2B shape keeps 5 of its 10
    // layers without a cache of their own (they reuse layers 3 and 4).
    if let Some(g) = &mut s.gemma4 {
        s.n_layer = 2 * g.swa_period;
        g.head_dim_global = 128;
        g.n_head_kv_global = 1;
        if g.n_kv_shared_layers > 0 {
            g.n_kv_shared_layers = g.swa_period;
        }
        if g.n_embd_per_layer > 0 {
            g.n_embd_per_layer = 64;
        }
    }
    if name == "smollm2-135m" {
        s.n_embd = 320;
        s.head_dim = 32;
        s.n_head = 10;
        s.n_head_kv = 5;
    }
    s
}

fn write(shape: Shape, types: &str, pure: bool, seed: u64, dir: &std::path::Path) -> Arc<Gguf> {
    let path = dir.join(format!("{}-{types}-{pure}-{seed}.gguf", shape.name));
    let opts = SynthOptions {
        shape,
        types: TypeSpec::parse(types).unwrap(),
        pure,
        seed,
        fast: false,
    };
    write_model(&opts, &path, |_| {}).unwrap();
    Arc::new(Gguf::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

struct Checked {
    tokens: Vec<u32>,
    logits_std: f32,
}

/// Loads the model, checks the prompt's logits and generates 6 greedy tokens.
fn load_and_generate(gguf: Arc<Gguf>, label: &str) -> Checked {
    let tokenizer = Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{label}: {e}"));
    let model = Model::from_gguf(gguf, CpuBackend::new(2).unwrap(), &mut |_, _| {})
        .unwrap_or_else(|e| panic!("{label}: {e}"));
    let prompt = tokenizer.encode("The capital of France is", true, true);
    let mut ctx = model.new_context(ContextParams::with_ctx(64));
    let logits = generate::eval_tokens(&model, &mut ctx, 0, &prompt, 512)
        .unwrap()
        .to_vec();
    assert_eq!(logits.len(), model.n_vocab(), "{label}");
    assert!(
        logits.iter().all(|v| v.is_finite()),
        "{label}: non-finite logits"
    );
    let n = logits.len() as f32;
    let mean = logits.iter().sum::<f32>() / n;
    let std = (logits.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / n).sqrt();
    let max = logits.iter().fold(f32::MIN, |m, &v| m.max(v));
    assert!(
        (1.0..10.0).contains(&std),
        "{label}: logits std {std}, expected between 1 and 10"
    );
    assert!(
        max - mean > 2.0 * std,
        "{label}: flat logits: max {max}, mean {mean}, std {std}"
    );
    // With tied embeddings the input token's own logit is biased up by the share of its
    // embedding in the final hidden state; the layers must outweigh it (see RESIDUAL_RMS).
    let last = *prompt.last().unwrap() as usize;
    let z = (logits[last] - mean) / std;
    assert!(
        z < 4.0,
        "{label}: the last prompt token's logit is {z} standard deviations above the mean"
    );

    let mut ctx = model.new_context(ContextParams::with_ctx(64));
    let mut sampler = Sampler::new(SamplerParams::greedy());
    let (tokens, _) = generate::generate(
        &model,
        &mut ctx,
        0,
        &prompt,
        6,
        512,
        &mut sampler,
        |_| false,
        |_| true,
    )
    .unwrap_or_else(|e| panic!("{label}: {e}"));
    assert_eq!(tokens.len(), 6, "{label}");
    assert!(tokens.iter().all(|&t| (t as usize) < model.n_vocab()));
    Checked {
        tokens,
        logits_std: std,
    }
}

#[test]
fn every_family_in_every_type_loads_and_generates() {
    let dir = tempfile::tempdir().unwrap();
    // llama3-8b and llama3.2-1b differ in tied embeddings and rope scaling, so both are run.
    for shape_name in SHAPE_NAMES {
        for types in TYPE_NAMES {
            for pure in [false, true] {
                if pure && types == "q4_k_m" {
                    continue;
                }
                let label = format!("{shape_name} {types} pure={pure}");
                let gguf = write(small(shape_name), types, pure, 1, dir.path());
                let checked = load_and_generate(gguf, &label);
                assert!(checked.logits_std > 0.0);
            }
        }
    }
}

#[test]
fn pure_types_are_used_for_every_matrix() {
    let dir = tempfile::tempdir().unwrap();
    let gguf = write(small("llama3-8b"), "q3_k", true, 1, dir.path());
    for t in gguf.tensors() {
        let expected = if t.dims.len() >= 2 {
            GgmlType::Q3_K
        } else {
            GgmlType::F32
        };
        assert_eq!(t.ty, expected, "{}", t.name);
    }
    // Mixed: the output projection gets Q6_K, as llama-quantize does.
    let gguf = write(small("llama3-8b"), "q4_0", false, 1, dir.path());
    assert_eq!(gguf.tensor("output.weight").unwrap().ty, GgmlType::Q6_K);
    assert_eq!(gguf.tensor("token_embd.weight").unwrap().ty, GgmlType::Q4_0);
    assert!(gguf.tensor("rope_freqs.weight").is_some());
}

#[test]
fn the_seed_decides_the_weights() {
    let dir = tempfile::tempdir().unwrap();
    let other_dir = tempfile::tempdir().unwrap();
    let a = write(small("qwen2-0.5b"), "q8_0", false, 5, dir.path());
    let b = write(small("qwen2-0.5b"), "q8_0", false, 5, other_dir.path());
    let c = write(small("qwen2-0.5b"), "q8_0", false, 6, dir.path());
    let data = |g: &Gguf| {
        g.tensor_data(g.tensor("blk.1.ffn_up.weight").unwrap())
            .to_vec()
    };
    assert_eq!(data(&a), data(&b));
    assert_ne!(data(&a), data(&c));
    let ta = load_and_generate(a, "seed 5").tokens;
    let tc = load_and_generate(c, "seed 6").tokens;
    assert_ne!(ta, tc, "different weights, same tokens");
}

#[test]
fn deep_models_keep_their_scale() {
    // 32 layers: without the 1/sqrt(2 n_layer) residual scaling the logits would be flattened
    // (the final norm divides by a residual that grew with depth) or blown up.
    let dir = tempfile::tempdir().unwrap();
    let mut shape = small("llama3-8b");
    shape.n_layer = 32;
    let deep = load_and_generate(write(shape, "f32", false, 1, dir.path()), "32 layers");
    let shallow = load_and_generate(
        write(small("llama3-8b"), "f32", false, 1, dir.path()),
        "2 layers",
    );
    let ratio = deep.logits_std / shallow.logits_std;
    assert!(
        (0.5..2.0).contains(&ratio),
        "logits std {} at 32 layers vs {} at 2",
        deep.logits_std,
        shallow.logits_std
    );
}

#[test]
fn the_tokenizer_round_trips_text_with_merges() {
    let dir = tempfile::tempdir().unwrap();
    for name in SHAPE_NAMES {
        let mut shape = small(name);
        shape.n_vocab = 3000;
        let gguf = write(shape, "q8_0", false, 1, dir.path());
        let tokenizer = Tokenizer::from_gguf(&gguf).unwrap();
        let text = "This License applies to any program, 12345 times.";
        let ids = tokenizer.encode(text, false, false);
        assert!(
            ids.len() < text.len() / 2,
            "{name}: {} tokens for {} bytes: merges unused",
            ids.len(),
            text.len()
        );
        assert_eq!(tokenizer.decode(&ids, false), text, "{name}");
        assert!(
            tokenizer.warnings().is_empty(),
            "{name}: {:?}",
            tokenizer.warnings()
        );
        let with_special = tokenizer.encode(text, true, true);
        assert_eq!(
            with_special.first() == tokenizer.bos().as_ref(),
            tokenizer.add_bos(),
            "{name}"
        );
    }
}
