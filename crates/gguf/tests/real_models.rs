//! The two real models of `models.toml` parse, and known facts about them hold. The models are
//! fetched once into the cache (`EMBER_MODELS_DIR`, default `~/.cache/ember/models`) by
//! `cargo run --release -p ember -- pull --all`; a test whose model is absent fails and says so.

mod common;

use std::path::PathBuf;
use std::time::Instant;

use ember_gguf::{GgmlType, Gguf};

fn model_path(file_name: &str) -> PathBuf {
    let dir = match std::env::var_os("EMBER_MODELS_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(
            std::env::var_os("HOME").expect("set EMBER_MODELS_DIR or HOME to find the test models"),
        )
        .join(".cache/ember/models"),
    };
    let path = dir.join(file_name);
    assert!(
        path.is_file(),
        "{} is absent: fetch the test models first with `cargo run --release -p ember -- pull --all`",
        path.display()
    );
    path
}

fn open(file_name: &str) -> Gguf {
    let path = model_path(file_name);
    let start = Instant::now();
    let gguf = Gguf::open(&path).unwrap_or_else(|e| panic!("{e}"));
    println!("opened {file_name} in {:?}", start.elapsed());
    gguf
}

#[test]
fn smollm2_135m_q4_1() {
    let g = open("SmolLM2-135M-Instruct.Q4_1.gguf");
    let md = g.metadata();
    assert_eq!(
        (g.version(), g.alignment(), g.file_size()),
        (3, 32, 98_362_432)
    );
    assert_eq!(g.data_offset(), 1_785_664);
    assert_eq!(g.architecture().unwrap(), "llama");
    assert_eq!(md.len(), 33);
    assert_eq!(md.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(md.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(
        md.get_u32_per_layer("llama.attention.head_count_kv", 30)
            .unwrap(),
        vec![3; 30]
    );
    assert_eq!(md.get_f32("llama.rope.freq_base").unwrap(), 100_000.0);
    assert_eq!(md.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    let tokens = md.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!((tokens.len(), tokens[1].as_str()), (49_152, "<|im_start|>"));
    assert_eq!(
        md.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48_900
    );
    md.check_same_len(&["tokenizer.ggml.tokens", "tokenizer.ggml.token_type"])
        .unwrap();

    // 30 blocks of 9 tensors, token_embd and output_norm; the output projection is tied.
    assert_eq!(g.tensors().len(), 272);
    assert!(g.tensor("output.weight").is_none());
    let embd = g.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ty, embd.dims.as_slice(), embd.offset),
        (GgmlType::Q8_0, &[576, 49_152][..], 0)
    );
    let down = g.tensor("blk.29.ffn_down.weight").unwrap();
    assert_eq!(
        (down.ty, down.dims.as_slice(), down.n_bytes),
        (GgmlType::Q4_1, &[1536, 576][..], 552_960)
    );
    assert_eq!(
        common::exercise(&g),
        g.tensors().iter().map(|t| t.n_bytes).sum::<u64>()
    );
    assert_zero_copy(&g);
}

#[test]
fn gemma3_270m_q4_k_m() {
    let g = open("gemma-3-270m-q4_k_m.gguf");
    let md = g.metadata();
    assert_eq!(
        (g.version(), g.alignment(), g.file_size()),
        (3, 32, 253_113_024)
    );
    assert_eq!(g.data_offset(), 6_525_120);
    assert_eq!(g.architecture().unwrap(), "gemma3");
    assert_eq!(md.get_u32("gemma3.block_count").unwrap(), 18);
    assert_eq!(md.get_u32("gemma3.attention.sliding_window").unwrap(), 512);
    assert_eq!(md.get_str("tokenizer.ggml.model").unwrap(), "llama");
    let keys = [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
    ];
    md.check_same_len(&keys).unwrap();
    assert_eq!(md.get_str_array(keys[0]).unwrap().len(), 262_144);
    assert_eq!(md.get_f32_array(keys[1]).unwrap()[0], -1000.0);
    assert_eq!(
        &md.get_i32_array(keys[2]).unwrap()[..6],
        &[3, 3, 3, 3, 3, 4]
    );

    // 18 blocks of 13 tensors, token_embd and output_norm.
    assert_eq!(g.tensors().len(), 236);
    let mut types: Vec<GgmlType> = g.tensors().iter().map(|t| t.ty).collect();
    types.sort();
    types.dedup();
    let expected = [
        GgmlType::F32,
        GgmlType::Q5_0,
        GgmlType::Q8_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
    ];
    assert_eq!(types, expected);
    let embd = g.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ty, embd.dims.as_slice(), embd.n_bytes),
        (GgmlType::Q8_0, &[640, 262_144][..], 178_257_920)
    );
    assert_eq!(
        common::exercise(&g),
        g.tensors().iter().map(|t| t.n_bytes).sum::<u64>()
    );
    assert_zero_copy(&g);
}

/// Tensor data is a view of the mapping, never a copy.
fn assert_zero_copy(g: &Gguf) {
    let file = g.bytes().as_ptr_range();
    for t in g.tensors() {
        let data = g.tensor_data(t).as_ptr_range();
        assert!(
            file.start <= data.start && data.end <= file.end,
            "{}",
            t.name
        );
        let offset = data.start as usize - file.start as usize;
        assert_eq!(offset as u64, g.data_offset() + t.offset, "{}", t.name);
    }
}
