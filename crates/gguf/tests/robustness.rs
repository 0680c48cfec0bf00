//! Hostile input: every truncation of a valid file, random mutations, and the inputs the fuzzer
//! once crashed on. Parsing must return `Ok` or `Err`, never panic, and whatever it accepts must
//! be safe to use. Also random valid files, which must read back exactly as written.

mod common;

use std::path::Path;

use common::{exercise, sample_bytes};
use ember_gguf::{Array, GgmlType, Gguf, GgufWriter, Value};
use proptest::prelude::*;

/// Parses `bytes`; when accepted, calls every accessor (which asserts the invariants a consumer
/// relies on). A panic anywhere fails the test.
fn parse_and_use(bytes: Vec<u8>) -> Result<u64, String> {
    Gguf::from_bytes(bytes)
        .map(|g| exercise(&g))
        .map_err(|e| e.to_string())
}

#[test]
fn every_prefix_that_cuts_into_the_tensor_data_is_an_error() {
    let file = sample_bytes();
    let gguf = Gguf::from_bytes(file.clone()).unwrap();
    // The padding after the last tensor is not needed: a file may end where the data ends.
    let data_end = gguf.data_offset()
        + gguf
            .tensors()
            .iter()
            .map(|t| t.offset + t.n_bytes)
            .max()
            .unwrap();
    assert!(
        data_end < file.len() as u64,
        "the sample should end with padding"
    );
    for len in 0..file.len() {
        let result = parse_and_use(file[..len].to_vec());
        if (len as u64) < data_end {
            assert!(
                result.is_err(),
                "prefix of {len} of {} bytes was accepted",
                file.len()
            );
        } else {
            assert!(
                result.is_ok(),
                "prefix of {len} bytes, past the data, was rejected"
            );
        }
    }
}

#[test]
fn every_single_byte_change_is_handled() {
    let file = sample_bytes();
    let header_len = Gguf::from_bytes(file.clone()).unwrap().data_offset() as usize;
    for pos in 0..header_len {
        for byte in [0x00, 0x01, 0x7f, 0x80, 0xff, file[pos] ^ 0x01] {
            let mut mutated = file.clone();
            mutated[pos] = byte;
            let _ = parse_and_use(mutated);
        }
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    Set(usize, u8),
    /// Overwrites 8 bytes with a little-endian u64: forged counts, lengths and offsets.
    SetU64(usize, u64),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let interesting_u64 = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(1 << 63),
        Just(u64::from(u32::MAX)),
        Just((1 << 28) + 1),
        0u64..4096,
        any::<u64>(),
    ];
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Set(p, b)),
        (any::<usize>(), interesting_u64).prop_map(|(p, x)| Mutation::SetU64(p, x)),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(p, b)| Mutation::Insert(p, b)),
        (any::<usize>(), 1usize..32).prop_map(|(p, n)| Mutation::Remove(p, n)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(file: &mut Vec<u8>, m: &Mutation) {
    let len = file.len().max(1);
    match *m {
        Mutation::Set(p, b) => {
            if let Some(slot) = file.get_mut(p % len) {
                *slot = b;
            }
        }
        Mutation::SetU64(p, x) => {
            let p = p % len;
            let end = (p + 8).min(file.len());
            if p < end {
                file[p..end].copy_from_slice(&x.to_le_bytes()[..end - p]);
            }
        }
        Mutation::Insert(p, ref b) => {
            let p = p % (file.len() + 1);
            file.splice(p..p, b.iter().copied());
        }
        Mutation::Remove(p, n) => {
            let p = p % len;
            let end = (p + n).min(file.len());
            if p < end {
                file.drain(p..end);
            }
        }
        Mutation::Truncate(n) => file.truncate(n % len),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn random_mutations_never_panic(mutations in prop::collection::vec(mutation(), 1..6)) {
        let mut file = sample_bytes();
        for m in &mutations {
            apply(&mut file, m);
        }
        let _ = parse_and_use(file);
    }

    #[test]
    fn random_bytes_after_a_valid_prefix_never_panic(
        cut in 0usize..200,
        tail in prop::collection::vec(any::<u8>(), 0..256),
    ) {
        let mut file = sample_bytes();
        file.truncate(cut);
        file.extend_from_slice(&tail);
        let _ = parse_and_use(file);
    }
}

/// Crash inputs found by `fuzz/` are checked in under `tests/fuzz-failures/` and replayed here.
#[test]
fn fuzz_failures_are_handled() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz-failures");
    let mut n_files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            continue;
        }
        let _ = parse_and_use(std::fs::read(&path).unwrap());
        n_files += 1;
    }
    println!(
        "replayed {n_files} fuzz failure inputs from {}",
        dir.display()
    );
}

fn finite_f32() -> impl Strategy<Value = f32> {
    any::<f32>().prop_filter("NaN never equals itself", |x| !x.is_nan())
}

fn finite_f64() -> impl Strategy<Value = f64> {
    any::<f64>().prop_filter("NaN never equals itself", |x| !x.is_nan())
}

fn array() -> impl Strategy<Value = Array> {
    use prop::collection::vec;
    let n = 0..6usize;
    prop_oneof![
        vec(any::<u8>(), n.clone()).prop_map(Array::U8),
        vec(any::<i8>(), n.clone()).prop_map(Array::I8),
        vec(any::<u16>(), n.clone()).prop_map(Array::U16),
        vec(any::<i16>(), n.clone()).prop_map(Array::I16),
        vec(any::<u32>(), n.clone()).prop_map(Array::U32),
        vec(any::<i32>(), n.clone()).prop_map(Array::I32),
        vec(any::<u64>(), n.clone()).prop_map(Array::U64),
        vec(any::<i64>(), n.clone()).prop_map(Array::I64),
        vec(finite_f32(), n.clone()).prop_map(Array::F32),
        vec(finite_f64(), n.clone()).prop_map(Array::F64),
        vec(any::<bool>(), n.clone()).prop_map(Array::Bool),
        vec(any::<String>(), n).prop_map(Array::String),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        finite_f32().prop_map(Value::F32),
        finite_f64().prop_map(Value::F64),
        any::<bool>().prop_map(Value::Bool),
        any::<String>().prop_map(Value::String),
        array().prop_map(Value::Array),
    ]
}

/// A tensor: type, dims (row length in whole blocks) and a data seed.
fn tensor() -> impl Strategy<Value = (GgmlType, Vec<u64>, u64)> {
    (
        prop::sample::select(GgmlType::ALL.to_vec()),
        1u64..3,
        prop::collection::vec(1u64..4, 0..4),
        any::<u64>(),
    )
        .prop_map(|(ty, blocks, rest, seed)| {
            let mut dims = vec![blocks * ty.block_size() as u64];
            dims.extend(rest);
            (ty, dims, seed)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

    #[test]
    fn random_files_round_trip(
        values in prop::collection::vec(value(), 0..12),
        tensors in prop::collection::vec(tensor(), 0..5),
        alignment_log2 in 0u32..8,
        version in 2u32..4,
    ) {
        let mut w = GgufWriter::new();
        w.version(version).alignment(1 << alignment_log2);
        for (i, value) in values.iter().enumerate() {
            w.metadata(&format!("key.{i}"), value.clone());
        }
        let mut expected_data = Vec::new();
        for (i, (ty, dims, seed)) in tensors.iter().enumerate() {
            let n_rows: u64 = dims[1..].iter().product();
            let n_bytes = ty.row_bytes(dims[0]).unwrap() * n_rows;
            let data = common::bytes(n_bytes as usize, *seed);
            w.tensor(&format!("tensor.{i}"), dims, *ty, data.clone());
            expected_data.push(data);
        }
        let g = Gguf::from_bytes(w.to_bytes()).map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!((g.version(), g.alignment()), (version, 1 << alignment_log2));
        let parsed: Vec<&Value> = g
            .metadata()
            .iter()
            .filter(|(k, _)| *k != "general.alignment")
            .map(|(_, v)| v)
            .collect();
        prop_assert_eq!(parsed, values.iter().collect::<Vec<_>>());
        prop_assert_eq!(g.tensors().len(), tensors.len());
        for ((t, (ty, dims, _)), data) in g.tensors().iter().zip(&tensors).zip(&expected_data) {
            prop_assert_eq!((t.ty, &t.dims), (*ty, dims));
            prop_assert_eq!(g.tensor_data(t), data.as_slice());
        }
        exercise(&g);
    }
}
