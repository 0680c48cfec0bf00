//! Helpers shared by the integration tests: finding the pinned real models (by the same cache
//! lookup as `ember pull`), loading them, and reading the golden reference files.

#![allow(dead_code)]

use std::path::PathBuf;

use ember::backend::cpu::CpuBackend;
use ember::model::Model;
use ember_tokenizer::Tokenizer;

/// Threads for tests: the machines running them have two cores.
pub const TEST_THREADS: usize = 2;

/// The cached file of a pinned model; fails the test with what to run when it is missing.
pub fn model_path(name: &str) -> PathBuf {
    let entry = ember::models::find(name).unwrap_or_else(|| panic!("{name} is not in models.toml"));
    let path = ember::models::cached_path(entry).expect("a model cache directory");
    assert!(
        ember::models::is_cached(entry).expect("a model cache directory"),
        "model {name} is not in the cache ({}): run `cargo run -p ember --release -- pull --all` first",
        path.display()
    );
    path
}

/// Loads a pinned model and its tokenizer on the CPU backend.
pub fn load(name: &str) -> (Model<CpuBackend>, Tokenizer) {
    let path = model_path(name);
    let backend = CpuBackend::new(TEST_THREADS).expect("thread pool");
    let model = Model::load(&path, backend, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let tokenizer = Tokenizer::from_gguf(model.gguf()).expect("tokenizer");
    (model, tokenizer)
}

/// The golden data directory of the repository.
pub fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/data/golden")
}

/// The lines of a golden JSONL file.
pub fn golden_jsonl(file: &str) -> Vec<serde_json::Value> {
    let path = golden_dir().join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).expect("valid JSON line"))
        .collect()
}

/// A tiny synthetic Qwen 3.5 hybrid in Q8_0 (three Gated DeltaNet layers with a recurrent state
/// per sequence, one full-attention layer; 128 wide, `vocab` tokens), written as `dir/name`.
pub fn write_hybrid(dir: &std::path::Path, name: &str, vocab: usize, seed: u64) -> PathBuf {
    use ember_synth::{write_model, Shape, ShapeOverrides, SynthOptions, TypeSpec};
    let mut shape = Shape::named("qwen3.5-27b").unwrap();
    ShapeOverrides {
        layers: Some(4),
        vocab: Some(vocab),
        embd: Some(128),
        heads: Some(4),
        kv_heads: Some(1),
        head_dim: Some(64),
        ff: Some(256),
        linear_k_heads: Some(2),
        linear_v_heads: Some(4),
        linear_head_dim: Some(32),
        ..ShapeOverrides::default()
    }
    .apply(&mut shape)
    .unwrap();
    let path = dir.join(name);
    let opts = SynthOptions {
        shape,
        types: TypeSpec::parse("q8_0").unwrap(),
        pure: false,
        seed,
        fast: false,
    };
    write_model(&opts, &path, |_| {}).unwrap();
    path
}
