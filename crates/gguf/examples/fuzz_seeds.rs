//! Writes the seed corpus of the `parse` fuzz target: small valid files that between them use
//! every value type, every tensor type, both versions and a custom alignment, so the fuzzer starts
//! from inputs that reach deep into the parser.
//!
//! `cargo run -p ember-gguf --example fuzz_seeds -- fuzz/corpus/parse`
//!
//! The files carry no `.gguf` extension: the repository ignores `*.gguf` so that models are never
//! committed, and these seeds must be.

use std::path::PathBuf;
use std::process::ExitCode;

use ember_gguf::{Array, GgmlType, GgufWriter, Value};

/// Seeds are kept small so libFuzzer mutates headers rather than tensor bytes.
const MAX_SEED_BYTES: usize = 4096;

/// Deterministic filler bytes, so regenerating the corpus gives identical files.
fn filler(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

fn tensor_of(w: &mut GgufWriter, name: &str, dims: &[u64], ty: GgmlType, seed: u8) {
    let n_rows: u64 = dims[1..].iter().product();
    let n_bytes = ty.row_bytes(dims[0]).expect("whole blocks") * n_rows;
    w.tensor(name, dims, ty, filler(n_bytes as usize, seed));
}

fn seeds() -> Vec<(&'static str, GgufWriter)> {
    let mut seeds = Vec::new();

    seeds.push(("empty", GgufWriter::new()));

    let mut scalars = GgufWriter::new();
    scalars
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("s.u8", Value::U8(1))
        .metadata("s.i8", Value::I8(-1))
        .metadata("s.u16", Value::U16(2))
        .metadata("s.i16", Value::I16(-2))
        .metadata("s.u32", Value::U32(3))
        .metadata("s.i32", Value::I32(-3))
        .metadata("s.u64", Value::U64(4))
        .metadata("s.i64", Value::I64(-4))
        .metadata("s.f32", Value::F32(0.5))
        .metadata("s.f64", Value::F64(0.25))
        .metadata("s.bool", Value::Bool(true))
        .metadata("s.string", Value::String("héllo".into()));
    seeds.push(("scalars", scalars));

    let mut arrays = GgufWriter::new();
    arrays
        .metadata("a.u8", Value::Array(Array::U8(vec![1, 2])))
        .metadata("a.i8", Value::Array(Array::I8(vec![-1, 2])))
        .metadata("a.u16", Value::Array(Array::U16(vec![1, 2])))
        .metadata("a.i16", Value::Array(Array::I16(vec![-1, 2])))
        .metadata("a.u32", Value::Array(Array::U32(vec![4, 4, 2])))
        .metadata("a.i32", Value::Array(Array::I32(vec![-1, 2])))
        .metadata("a.u64", Value::Array(Array::U64(vec![1, 2])))
        .metadata("a.i64", Value::Array(Array::I64(vec![-1, 2])))
        .metadata("a.f32", Value::Array(Array::F32(vec![1.0, 2.0])))
        .metadata("a.f64", Value::Array(Array::F64(vec![1.0, 2.0])))
        .metadata("a.bool", Value::Array(Array::Bool(vec![true, false])))
        .metadata(
            "a.string",
            Value::Array(Array::String(vec!["a".into(), "".into()])),
        )
        .metadata("a.empty", Value::Array(Array::U32(vec![])));
    seeds.push(("arrays", arrays));

    let mut tokenizer = GgufWriter::new();
    let tokens: Vec<String> = ["<unk>", "<s>", "</s>", "▁a", "b", "ab"]
        .map(String::from)
        .to_vec();
    tokenizer
        .metadata("tokenizer.ggml.model", Value::String("llama".into()))
        .metadata("tokenizer.ggml.tokens", Value::Array(Array::String(tokens)))
        .metadata(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.0, 0.0, 0.0, -1.0, -2.0, -3.0])),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![2, 3, 3, 1, 1, 1])),
        )
        .metadata(
            "tokenizer.ggml.merges",
            Value::Array(Array::String(vec!["a b".into()])),
        )
        .metadata("tokenizer.ggml.bos_token_id", Value::U32(1));
    seeds.push(("tokenizer", tokenizer));

    let mut llama = GgufWriter::new();
    llama
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("llama.block_count", Value::U32(1))
        .metadata("llama.embedding_length", Value::U32(32))
        .metadata(
            "llama.attention.head_count",
            Value::Array(Array::I32(vec![2])),
        );
    tensor_of(&mut llama, "token_embd.weight", &[32, 4], GgmlType::Q8_0, 1);
    tensor_of(
        &mut llama,
        "blk.0.attn_norm.weight",
        &[32],
        GgmlType::F32,
        2,
    );
    tensor_of(
        &mut llama,
        "blk.0.attn_q.weight",
        &[32, 2],
        GgmlType::Q4_0,
        3,
    );
    tensor_of(&mut llama, "output_norm.weight", &[32], GgmlType::F16, 4);
    seeds.push(("llama-tiny", llama));

    let mut dims = GgufWriter::new();
    dims.version(2).alignment(64);
    tensor_of(&mut dims, "d1", &[3], GgmlType::F32, 5);
    tensor_of(&mut dims, "d2", &[2, 3], GgmlType::BF16, 6);
    tensor_of(&mut dims, "d3", &[2, 1, 2], GgmlType::I8, 7);
    tensor_of(&mut dims, "d4", &[1, 2, 1, 2], GgmlType::I64, 8);
    seeds.push(("v2-align64-dims", dims));

    // One block of every quantized type, split over files to keep each under the size cap.
    let quantized: Vec<GgmlType> = GgmlType::ALL
        .into_iter()
        .filter(|t| t.is_quantized())
        .collect();
    for (i, chunk) in quantized.chunks(6).enumerate() {
        let mut w = GgufWriter::new();
        w.alignment(1);
        for (j, &ty) in chunk.iter().enumerate() {
            tensor_of(
                &mut w,
                ty.name(),
                &[ty.block_size() as u64],
                ty,
                (i * 8 + j) as u8,
            );
        }
        let name: &'static str = ["quant-0", "quant-1", "quant-2", "quant-3", "quant-4"][i];
        seeds.push((name, w));
    }
    seeds
}

fn main() -> ExitCode {
    let Some(dir) = std::env::args_os().nth(1).map(PathBuf::from) else {
        eprintln!("usage: fuzz_seeds OUTPUT_DIR");
        return ExitCode::FAILURE;
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("error: cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    for (name, writer) in seeds() {
        let bytes = writer.to_bytes();
        if bytes.len() > MAX_SEED_BYTES {
            eprintln!(
                "error: seed {name} is {} bytes, over {MAX_SEED_BYTES}",
                bytes.len()
            );
            return ExitCode::FAILURE;
        }
        if let Err(e) = ember_gguf::Gguf::from_bytes(bytes.clone()) {
            eprintln!("error: seed {name} does not parse: {e}");
            return ExitCode::FAILURE;
        }
        let path = dir.join(name);
        if let Err(e) = std::fs::write(&path, &bytes) {
            eprintln!("error: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("{} ({} bytes)", path.display(), bytes.len());
    }
    ExitCode::SUCCESS
}
