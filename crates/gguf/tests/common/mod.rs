//! Helpers shared by the integration tests: a small valid sample file, and a raw header builder
//! for files the writer will not produce (unknown type ids, nested arrays, forged counts).

#![allow(dead_code)] // Each test binary uses a different subset.

use ember_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};

/// A small valid file touching every value type, a string array and three tensor types.
pub fn sample_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String("llama".into()))
        .metadata("llama.block_count", Value::U32(2))
        .metadata("small.u8", Value::U8(7))
        .metadata("small.i64", Value::I64(-3))
        .metadata("small.f32", Value::F32(1e-5))
        .metadata("small.bool", Value::Bool(true))
        .metadata(
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(vec!["<s>".into(), "a".into(), "é".into()])),
        )
        .metadata(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.0, -1.0, -2.5])),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(Array::I32(vec![3, 1, 1])),
        )
        .metadata("heads", Value::Array(Array::U16(vec![4, 8])))
        .tensor("norm", &[4], GgmlType::F32, bytes(16, 1))
        .tensor("w", &[32, 2], GgmlType::Q8_0, bytes(68, 2))
        .tensor("h", &[8, 1, 1], GgmlType::F16, bytes(16, 3));
    w
}

pub fn sample_bytes() -> Vec<u8> {
    sample_writer().to_bytes()
}

/// `n` deterministic pseudo-random bytes.
pub fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Calls every accessor of a parsed file, so a fuzzer or mutation test reaches the getters too.
/// Returns the total tensor bytes seen.
pub fn exercise(gguf: &Gguf) -> u64 {
    let md = gguf.metadata();
    let mut total = 0;
    for (key, value) in md.iter() {
        assert!(std::ptr::eq(md.get(key).unwrap(), value));
        let _ = value.to_string();
        let _ = (
            md.get_u32(key),
            md.get_u64(key),
            md.get_i32(key),
            md.get_bool(key),
        );
        let _ = (md.get_str(key), md.get_f32(key), md.get_str_array(key));
        let _ = (md.get_f32_array(key), md.get_i32_array(key));
        let _ = (md.get_u32_array_lossless(key), md.get_u32_per_layer(key, 3));
    }
    let _ = md.check_same_len(&["tokenizer.ggml.tokens", "tokenizer.ggml.scores"]);
    for t in gguf.tensors() {
        let data = gguf.tensor_data(t);
        assert_eq!(data.len() as u64, t.n_bytes, "tensor {}", t.name);
        assert_eq!(gguf.tensor(&t.name), Some(t));
        assert_eq!(t.n_elements(), t.row_len() * t.n_rows());
        total += t.n_bytes;
    }
    total
}

/// Builds a header byte by byte.
pub struct Raw(pub Vec<u8>);

impl Raw {
    /// Magic, version 3 and the two counts.
    pub fn new(n_tensors: u64, n_kv: u64) -> Raw {
        Raw(Vec::new())
            .bytes(b"GGUF")
            .u32(3)
            .u64(n_tensors)
            .u64(n_kv)
    }
    pub fn bytes(mut self, b: &[u8]) -> Raw {
        self.0.extend_from_slice(b);
        self
    }
    pub fn u32(self, x: u32) -> Raw {
        self.bytes(&x.to_le_bytes())
    }
    pub fn u64(self, x: u64) -> Raw {
        self.bytes(&x.to_le_bytes())
    }
    pub fn str(self, s: &str) -> Raw {
        self.u64(s.len() as u64).bytes(s.as_bytes())
    }
    /// A metadata entry with the given type id and raw payload.
    pub fn kv(self, key: &str, type_id: u32, payload: &[u8]) -> Raw {
        self.str(key).u32(type_id).bytes(payload)
    }
    /// A tensor info.
    pub fn tensor(self, name: &str, dims: &[u64], type_id: u32, offset: u64) -> Raw {
        let mut raw = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            raw = raw.u64(d);
        }
        raw.u32(type_id).u64(offset)
    }
    /// Zero padding to a multiple of `alignment`, then `data_len` zero bytes of data.
    pub fn data(mut self, alignment: usize, data_len: usize) -> Vec<u8> {
        let padded = self.0.len().div_ceil(alignment) * alignment;
        self.0.resize(padded + data_len, 0);
        self.0
    }
}
