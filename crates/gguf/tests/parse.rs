//! Writer → parser round trips, one rejection test per kind of malformed file, and the typed
//! metadata getters. Expectations are the full error messages, so a test also pins what the user
//! reads.

mod common;

use common::{bytes, exercise, sample_bytes, Raw};
use ember_gguf::{Array, GgmlType, Gguf, GgufError, GgufWriter, Value};

/// Parses `file` and checks that it is rejected with exactly `expected` as the message.
#[track_caller]
fn check_err(file: Vec<u8>, expected: &str) {
    match Gguf::from_bytes(file) {
        Ok(g) => panic!("expected error {expected:?}, parsed {g:?}"),
        Err(e) => assert_eq!(e.to_string(), expected),
    }
}

/// Parses `file` and checks that it is accepted.
#[track_caller]
fn check_ok(file: Vec<u8>) -> Gguf {
    match Gguf::from_bytes(file) {
        Ok(g) => {
            exercise(&g);
            g
        }
        Err(e) => panic!("expected a valid file, got error: {e}"),
    }
}

fn le64(x: u64) -> [u8; 8] {
    x.to_le_bytes()
}

/// Concatenates byte pieces.
fn cat(pieces: &[&[u8]]) -> Vec<u8> {
    pieces.concat()
}

fn every_value() -> Vec<(&'static str, Value)> {
    vec![
        ("u8", Value::U8(250)),
        ("i8", Value::I8(-120)),
        ("u16", Value::U16(65_000)),
        ("i16", Value::I16(-32_000)),
        ("u32", Value::U32(4_000_000_000)),
        ("i32", Value::I32(-2_000_000_000)),
        ("u64", Value::U64(u64::MAX)),
        ("i64", Value::I64(i64::MIN)),
        ("f32", Value::F32(-1.5e-7)),
        ("f64", Value::F64(std::f64::consts::PI)),
        ("bool.true", Value::Bool(true)),
        ("bool.false", Value::Bool(false)),
        ("string", Value::String("héllo ▁world\n\0".into())),
        ("string.empty", Value::String(String::new())),
        ("a.u8", Value::Array(Array::U8(vec![0, 1, 255]))),
        ("a.i8", Value::Array(Array::I8(vec![-128, 0, 127]))),
        ("a.u16", Value::Array(Array::U16(vec![0, 65_535]))),
        ("a.i16", Value::Array(Array::I16(vec![-32_768, 32_767]))),
        ("a.u32", Value::Array(Array::U32(vec![1, u32::MAX]))),
        ("a.i32", Value::Array(Array::I32(vec![i32::MIN, -1, 3]))),
        ("a.u64", Value::Array(Array::U64(vec![u64::MAX, 0]))),
        ("a.i64", Value::Array(Array::I64(vec![i64::MIN, i64::MAX]))),
        (
            "a.f32",
            Value::Array(Array::F32(vec![0.0, -0.0, f32::INFINITY, 1e-38])),
        ),
        (
            "a.f64",
            Value::Array(Array::F64(vec![f64::MIN_POSITIVE, -2.0])),
        ),
        ("a.bool", Value::Array(Array::Bool(vec![true, false, true]))),
        (
            "a.string",
            Value::Array(Array::String(vec!["".into(), "Ġthe".into(), "日本".into()])),
        ),
        ("a.empty", Value::Array(Array::U32(Vec::new()))),
        ("a.string.empty", Value::Array(Array::String(Vec::new()))),
    ]
}

#[test]
fn every_value_type_round_trips_in_order() {
    let values = every_value();
    let mut w = GgufWriter::new();
    for (key, value) in &values {
        w.metadata(key, value.clone());
    }
    let g = check_ok(w.to_bytes());
    let parsed: Vec<(&str, &Value)> = g.metadata().iter().collect();
    let expected: Vec<(&str, &Value)> = values.iter().map(|(k, v)| (*k, v)).collect();
    assert_eq!(parsed, expected);
    assert_eq!(g.version(), 3);
    assert_eq!(g.alignment(), 32);
    assert!(g.tensors().is_empty());
}

#[test]
fn every_tensor_type_round_trips() {
    let mut w = GgufWriter::new();
    let mut expected = Vec::new();
    for (i, ty) in GgmlType::ALL.into_iter().enumerate() {
        let row_len = 2 * ty.block_size() as u64;
        let dims = [row_len, 3];
        let n_bytes = ty.row_bytes(row_len).unwrap() * 3;
        let data = bytes(n_bytes as usize, i as u64);
        let name = format!("t.{}", ty.name());
        w.tensor(&name, &dims, ty, data.clone());
        expected.push((name, dims, ty, data));
    }
    let g = check_ok(w.to_bytes());
    assert_eq!(g.tensors().len(), expected.len());
    for (t, (name, dims, ty, data)) in g.tensors().iter().zip(&expected) {
        assert_eq!(
            (&t.name, t.dims.as_slice(), t.ty),
            (name, dims.as_slice(), *ty)
        );
        assert_eq!(t.offset % 32, 0, "{name}");
        assert_eq!(g.tensor_data(t), data.as_slice(), "{name}");
        assert_eq!(
            (t.row_len(), t.n_rows(), t.n_elements()),
            (dims[0], 3, dims[0] * 3)
        );
    }
    assert_eq!(g.data_offset() % 32, 0);
    assert_eq!(g.file_size(), g.bytes().len() as u64);
}

#[test]
fn shapes_of_one_to_four_dims_round_trip() {
    let mut w = GgufWriter::new();
    w.tensor("d1", &[5], GgmlType::F32, bytes(20, 1))
        .tensor("d2", &[3, 2], GgmlType::I8, bytes(6, 2))
        .tensor("d3", &[2, 1, 3], GgmlType::I16, bytes(12, 3))
        .tensor("d4", &[1, 2, 1, 2], GgmlType::F64, bytes(32, 4));
    let g = check_ok(w.to_bytes());
    let dims: Vec<&[u64]> = g.tensors().iter().map(|t| t.dims.as_slice()).collect();
    assert_eq!(dims, [&[5][..], &[3, 2], &[2, 1, 3], &[1, 2, 1, 2]]);
    assert_eq!(g.tensor_bytes("d3"), Some(bytes(12, 3).as_slice()));
    assert_eq!(g.tensor("missing"), None);
}

#[test]
fn version_2_and_custom_alignments_round_trip() {
    for (version, alignment) in [(2, 32), (3, 1), (3, 64), (2, 4096)] {
        let mut w = common::sample_writer();
        w.version(version).alignment(alignment);
        let g = check_ok(w.to_bytes());
        assert_eq!((g.version(), g.alignment()), (version, alignment));
        assert_eq!(g.data_offset() % alignment, 0);
        let written = g.metadata().get("general.alignment");
        let expected = (alignment != 32).then_some(Value::U32(alignment as u32));
        assert_eq!(written, expected.as_ref());
        assert_eq!(g.tensor_bytes("w"), Some(bytes(68, 2).as_slice()));
    }
}

#[test]
fn open_maps_the_same_file_that_from_bytes_parses() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sample.gguf");
    common::sample_writer().write_file(&path).unwrap();
    let mapped = Gguf::open(&path).unwrap();
    let owned = Gguf::from_bytes(sample_bytes()).unwrap();
    assert_eq!(mapped.bytes(), owned.bytes());
    assert_eq!(mapped.metadata(), owned.metadata());
    assert_eq!(mapped.tensors(), owned.tensors());
    assert_eq!(exercise(&mapped), exercise(&owned));
    assert_eq!(mapped.architecture().unwrap(), "llama");
}

#[test]
fn open_reports_the_path_of_a_missing_or_empty_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.gguf");
    let err = Gguf::open(&missing).unwrap_err();
    assert!(
        matches!(err, GgufError::Io { ref path, .. } if *path == missing),
        "{err}"
    );
    assert!(err.to_string().contains("missing.gguf"), "{err}");

    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert_eq!(
        Gguf::open(&empty).unwrap_err().to_string(),
        "magic: file truncated at offset 0: expected 4 more bytes, found 0"
    );
}

// ---- Header ----

#[test]
fn rejects_bad_magic() {
    check_err(
        cat(&[b"GGUX", &3u32.to_le_bytes(), &[0; 16]]),
        "not a GGUF file: expected magic \"GGUF\" (47 47 55 46), found [47, 47, 55, 58]",
    );
    check_err(
        b"\x7fELF\x02\x01\x01\0".to_vec(),
        "not a GGUF file: expected magic \"GGUF\" (47 47 55 46), found [7f, 45, 4c, 46]",
    );
}

#[test]
fn rejects_versions_other_than_2_and_3() {
    let version = |v: u32| cat(&[b"GGUF", &v.to_le_bytes(), &[0; 16]]);
    check_err(
        version(1),
        "unsupported GGUF version 1: expected 2 or 3 (version 1 used 32-bit counts and lengths \
         and is obsolete; re-convert the model)",
    );
    check_err(version(99), "unsupported GGUF version 99: expected 2 or 3");
    check_err(version(0), "unsupported GGUF version 0: expected 2 or 3");
}

#[test]
fn rejects_big_endian_files() {
    let big_endian = "big-endian GGUF file (version 3 stored byte-swapped): expected a \
                      little-endian file, convert it with gguf-py's endian conversion";
    check_err(cat(&[b"GGUF", &3u32.to_be_bytes(), &[0; 16]]), big_endian);
    // Early big-endian writers also swapped the magic.
    check_err(cat(&[b"FUGG", &3u32.to_be_bytes(), &[0; 16]]), big_endian);
    check_err(
        b"FUGG\0".to_vec(),
        "version: file truncated at offset 4: expected 4 more bytes, found 1",
    );
}

#[test]
fn rejects_counts_the_file_cannot_hold() {
    check_err(
        Raw::new(1 << 63, 0).data(32, 0),
        "tensor count 9223372036854775808 at offset 8 is impossible: each entry needs at least 33 \
         bytes and only 8 bytes are left",
    );
    check_err(
        Raw::new(0, 1 << 63).data(32, 0),
        "metadata entry count 9223372036854775808 at offset 16 is impossible: each entry needs at \
         least 14 bytes and only 8 bytes are left",
    );
    check_err(
        Raw::new(u64::MAX, u64::MAX).0,
        "metadata entry count 18446744073709551615 at offset 16 is impossible: each entry needs \
         at least 14 bytes and only 0 bytes are left",
    );
    // One entry of metadata fits in 14 bytes, but then nothing is left for the tensor.
    check_err(
        Raw::new(1, 1).kv("k", 0, &[1]).0,
        "tensor count 1 at offset 8 is impossible: each entry needs at least 33 bytes and only 0 \
         bytes are left",
    );
}

// ---- Metadata ----

#[test]
fn rejects_strings_past_the_end_of_the_file() {
    check_err(
        Raw::new(0, 1).u64(100).bytes(&[b'a'; 20]).0,
        "key of metadata entry 0: file truncated at offset 32: expected 100 more bytes, found 20",
    );
    check_err(
        Raw::new(0, 1).kv("k", 8, &le64(1000)).bytes(b"short").0,
        "metadata key \"k\": file truncated at offset 45: expected 1000 more bytes, found 5",
    );
    check_err(
        Raw::new(0, 1).kv("k", 9, &cat(&[&8u32.to_le_bytes(), &le64(2)])).str("a").u64(9).0,
        "metadata key \"k\", element 1: file truncated at offset 66: expected 9 more bytes, found 0",
    );
}

#[test]
fn rejects_lengths_over_the_caps() {
    check_err(
        Raw::new(0, 1).u64(65_536).bytes(&[b'k'; 16]).0,
        "key of metadata entry 0: string length 65536 at offset 24 exceeds the cap of 65535",
    );
    check_err(
        Raw::new(0, 1)
            .kv("k", 8, &le64((64 << 20) + 1))
            .bytes(&[0; 8])
            .0,
        "metadata key \"k\": string length 67108865 at offset 37 exceeds the cap of 67108864",
    );
    check_err(
        Raw::new(0, 1)
            .kv("k", 9, &cat(&[&0u32.to_le_bytes(), &le64((1 << 28) + 1)]))
            .0,
        "metadata key \"k\": array length 268435457 at offset 41 exceeds the cap of 268435456",
    );
}

#[test]
fn rejects_arrays_past_the_end_of_the_file() {
    check_err(
        Raw::new(0, 1)
            .kv("k", 9, &cat(&[&4u32.to_le_bytes(), &le64(1000), &[0; 12]]))
            .0,
        "metadata key \"k\" (array of 1000 elements): file truncated at offset 49: expected 4000 \
         more bytes, found 12",
    );
    // Each string needs at least its 8-byte length, so 2^20 strings need 8 MiB.
    check_err(
        Raw::new(0, 1)
            .kv(
                "k",
                9,
                &cat(&[&8u32.to_le_bytes(), &le64(1 << 20), &[0; 64]]),
            )
            .0,
        "metadata key \"k\" (array of 1048576 elements): file truncated at offset 49: expected \
         8388608 more bytes, found 64",
    );
}

#[test]
fn rejects_nested_arrays() {
    check_err(
        Raw::new(0, 1)
            .kv("k", 9, &cat(&[&9u32.to_le_bytes(), &le64(0)]))
            .0,
        "metadata key \"k\": nested array at offset 37: expected an array of scalars or strings",
    );
}

#[test]
fn rejects_unknown_value_types() {
    check_err(
        Raw::new(0, 1).kv("k", 13, &[0; 8]).0,
        "metadata key \"k\": unknown value type id 13 at offset 33: expected 0 to 12",
    );
    check_err(
        Raw::new(0, 1)
            .kv("k", 9, &cat(&[&u32::MAX.to_le_bytes(), &le64(0)]))
            .0,
        "metadata key \"k\": unknown value type id 4294967295 at offset 37: expected 0 to 12",
    );
}

#[test]
fn rejects_bools_other_than_0_and_1() {
    check_err(
        Raw::new(0, 1).kv("k", 7, &[2]).0,
        "metadata key \"k\": expected a bool (0 or 1) at offset 37, found byte 2",
    );
    check_err(
        Raw::new(0, 1)
            .kv("k", 9, &cat(&[&7u32.to_le_bytes(), &le64(3), &[1, 0, 255]]))
            .0,
        "metadata key \"k\": expected a bool (0 or 1) at offset 51, found byte 255",
    );
}

#[test]
fn rejects_duplicate_keys() {
    let mut w = GgufWriter::new();
    w.metadata("a", Value::U32(1))
        .metadata("b", Value::U32(2))
        .metadata("a", Value::U8(1));
    check_err(
        w.to_bytes(),
        "metadata key \"a\" appears twice: expected unique keys",
    );
}

#[test]
fn rejects_empty_and_non_utf8_names_and_strings() {
    check_err(
        Raw::new(0, 1).kv("", 0, &[1; 8]).0,
        "key of metadata entry 0: expected a non-empty name at offset 24, found an empty string",
    );
    check_err(
        Raw::new(0, 1)
            .u64(2)
            .bytes(&[0xff, 0xfe])
            .u32(0)
            .bytes(&[1; 4])
            .0,
        "key of metadata entry 0: expected a UTF-8 string at offset 32, found invalid UTF-8",
    );
    check_err(
        Raw::new(0, 1)
            .kv("k", 8, &le64(3))
            .bytes(&[b'a', 0xc3, 0x28])
            .0,
        "metadata key \"k\": expected a UTF-8 string at offset 46, found invalid UTF-8",
    );
    check_err(
        Raw::new(1, 0).tensor("", &[1], 0, 0).data(32, 32),
        "name of tensor 0: expected a non-empty name at offset 24, found an empty string",
    );
}

#[test]
fn rejects_bad_alignments() {
    let alignment = |value: Value| {
        let mut w = GgufWriter::new();
        w.metadata("general.alignment", value);
        w.to_bytes()
    };
    let msg = |found: &str| {
        format!(
            "general.alignment: expected a non-zero power of two at most 1048576 as an integer \
             fitting u32, found {found}"
        )
    };
    check_err(alignment(Value::U32(0)), &msg("0"));
    check_err(alignment(Value::U32(3)), &msg("3"));
    check_err(alignment(Value::U32(96)), &msg("96"));
    check_err(alignment(Value::U32(1 << 21)), &msg("2097152"));
    check_err(alignment(Value::U64(1 << 32)), &msg("4294967296"));
    check_err(alignment(Value::I32(-32)), &msg("-32"));
    check_err(alignment(Value::F32(32.0)), &msg("a value of type f32"));
    check_err(
        alignment(Value::String("32".into())),
        &msg("a value of type string"),
    );
    // Any integer type whose value fits u32 is accepted.
    for value in [
        Value::U8(64),
        Value::I64(16),
        Value::U64(1 << 20),
        Value::U32(1),
    ] {
        let expected = value.as_integer().unwrap() as u64;
        assert_eq!(check_ok(alignment(value)).alignment(), expected);
    }
}

// ---- Tensors ----

#[test]
fn rejects_duplicate_tensor_names() {
    let mut w = GgufWriter::new();
    w.tensor("t", &[8], GgmlType::F32, bytes(32, 1))
        .tensor("t", &[8], GgmlType::F32, bytes(32, 2));
    check_err(
        w.to_bytes(),
        "tensor \"t\" appears twice: expected unique tensor names",
    );
}

#[test]
fn rejects_unknown_tensor_types() {
    check_err(
        Raw::new(1, 0).tensor("t", &[32], 4, 0).data(32, 32),
        "tensor \"t\": unknown tensor type id 4",
    );
    check_err(
        Raw::new(1, 0).tensor("t", &[32], 1000, 0).data(32, 32),
        "tensor \"t\": unknown tensor type id 1000",
    );
}

#[test]
fn rejects_bad_dimension_counts() {
    check_err(
        Raw::new(1, 0)
            .tensor("t", &[], 0, 0)
            .bytes(&[0; 32])
            .data(32, 32),
        "tensor \"t\": expected 1 to 4 dimensions, found 0",
    );
    check_err(
        Raw::new(1, 0)
            .tensor("t", &[1, 1, 1, 1, 1], 0, 0)
            .data(32, 32),
        "tensor \"t\": expected 1 to 4 dimensions, found 5",
    );
    check_err(
        Raw::new(1, 0).str("t").u32(u32::MAX).bytes(&[0; 64]).0,
        "tensor \"t\": expected 1 to 4 dimensions, found 4294967295",
    );
}

#[test]
fn rejects_zero_dimensions() {
    check_err(
        Raw::new(1, 0).tensor("t", &[0], 0, 0).data(32, 32),
        "tensor \"t\": expected every dimension to be at least 1, found dims [0]",
    );
    check_err(
        Raw::new(1, 0).tensor("t", &[4, 3, 0], 0, 0).data(32, 32),
        "tensor \"t\": expected every dimension to be at least 1, found dims [4, 3, 0]",
    );
}

#[test]
fn rejects_sizes_that_overflow() {
    check_err(
        Raw::new(1, 0).tensor("t", &[1 << 32, 1 << 32], 0, 0).data(32, 32),
        "tensor \"t\": element count or byte size of dims [4294967296, 4294967296] (F32) overflows \
         64 bits",
    );
    // The element count fits but the byte size (4 bytes each) does not.
    check_err(
        Raw::new(1, 0).tensor("t", &[1 << 31, 1 << 31], 0, 0).data(32, 32),
        "tensor \"t\": element count or byte size of dims [2147483648, 2147483648] (F32) overflows \
         64 bits",
    );
    check_err(
        Raw::new(1, 0).tensor("t", &[u64::MAX], 0, 0).data(32, 32),
        "tensor \"t\": element count or byte size of dims [18446744073709551615] (F32) overflows \
         64 bits",
    );
}

#[test]
fn rejects_rows_that_are_not_whole_blocks() {
    check_err(
        Raw::new(1, 0)
            .tensor("t", &[16, 2], GgmlType::Q4_0 as u32, 0)
            .data(32, 32),
        "tensor \"t\": row length 16 is not a multiple of the Q4_0 block size 32",
    );
    check_err(
        Raw::new(1, 0)
            .tensor("t", &[320], GgmlType::Q4_K as u32, 0)
            .data(32, 1024),
        "tensor \"t\": row length 320 is not a multiple of the Q4_K block size 256",
    );
}

#[test]
fn rejects_misaligned_offsets() {
    check_err(
        Raw::new(1, 0).tensor("t", &[1], 0, 4).data(32, 64),
        "tensor \"t\": data offset 4 is not a multiple of the alignment 32",
    );
    check_err(
        Raw::new(1, 1)
            .kv("general.alignment", 4, &64u32.to_le_bytes())
            .tensor("t", &[1], 0, 32)
            .data(64, 128),
        "tensor \"t\": data offset 32 is not a multiple of the alignment 64",
    );
}

#[test]
fn rejects_tensors_past_the_end_of_the_file() {
    check_err(
        Raw::new(1, 0).tensor("t", &[8], 0, 64).data(32, 32),
        "tensor \"t\": data at offset 64 of 32 bytes ends past the data section, which holds 32 \
         bytes",
    );
    check_err(
        Raw::new(1, 0).tensor("t", &[16], 0, 0).data(32, 32),
        "tensor \"t\": data at offset 0 of 64 bytes ends past the data section, which holds 32 \
         bytes",
    );
    // offset + n_bytes overflows u64.
    check_err(
        Raw::new(1, 0).tensor("t", &[8], 0, u64::MAX - 31).data(32, 32),
        "tensor \"t\": data at offset 18446744073709551584 of 32 bytes ends past the data section, \
         which holds 32 bytes",
    );
    // The header's padding is missing: the data section starts past the end of the file.
    let mut no_padding = Raw::new(1, 0).tensor("t", &[1], 0, 0).0;
    no_padding.extend_from_slice(&[0; 4]);
    check_err(
        no_padding,
        "tensor \"t\": data at offset 0 of 4 bytes ends past the data section, which holds 0 bytes",
    );
}

#[test]
fn rejects_overlapping_tensors() {
    check_err(
        Raw::new(2, 0)
            .tensor("a", &[8], 0, 0)
            .tensor("b", &[8], 0, 0)
            .data(32, 64),
        "tensor \"b\" at offset 0 overlaps tensor \"a\", whose data ends at offset 32",
    );
    // Overlap is found whatever the order of the tensor infos.
    check_err(
        Raw::new(3, 0)
            .tensor("c", &[8], 0, 96)
            .tensor("a", &[16], 0, 0)
            .tensor("b", &[8], 0, 32)
            .data(32, 128),
        "tensor \"b\" at offset 32 overlaps tensor \"a\", whose data ends at offset 64",
    );
    // Adjacent tensors share no bytes.
    check_ok(
        Raw::new(2, 0)
            .tensor("a", &[8], 0, 0)
            .tensor("b", &[8], 0, 32)
            .data(32, 64),
    );
}

#[test]
fn rejects_truncated_tensor_infos() {
    check_err(
        Raw::new(1, 0)
            .tensor("tensor.with.a.long.name", &[8, 8], 0, 0)
            .0[..74]
            .to_vec(),
        "tensor \"tensor.with.a.long.name\": file truncated at offset 67: expected 8 more bytes, \
         found 7",
    );
}

// ---- Metadata getters ----

fn show<T: std::fmt::Debug>(r: Result<T, GgufError>) -> String {
    match r {
        Ok(v) => format!("Ok({v:?})"),
        Err(e) => format!("Err({e})"),
    }
}

#[test]
fn typed_getters() {
    let g = check_ok(common::sample_writer().to_bytes());
    let mut w = GgufWriter::new();
    for (key, value) in every_value() {
        w.metadata(key, value);
    }
    w.metadata("neg", Value::I32(-1))
        .metadata("layers", Value::Array(Array::I32(vec![4, 4, 2])));
    let all = check_ok(w.to_bytes());
    let md = all.metadata();

    let cases: Vec<(String, &str)> = vec![
        (show(g.metadata().get_u32("small.u8")), "Ok(7)"),
        (show(g.metadata().get_u32("llama.block_count")), "Ok(2)"),
        (show(md.get_u32("u16")), "Ok(65000)"),
        (show(md.get_u32("u64")), "Err(metadata key \"u64\": expected a value that fits u32, found 18446744073709551615)"),
        (show(md.get_u32("neg")), "Err(metadata key \"neg\": expected a value that fits u32, found -1)"),
        (show(md.get_u32("f32")), "Err(metadata key \"f32\": expected u32, found f32)"),
        (show(md.get_u32("bool.true")), "Err(metadata key \"bool.true\": expected u32, found bool)"),
        (show(md.get_u32("missing")), "Err(metadata key \"missing\" is missing)"),
        (show(md.get_u32_opt("missing")), "Ok(None)"),
        (show(md.get_u32_opt("u8")), "Ok(Some(250))"),
        (show(md.get_u32_opt("string")), "Err(metadata key \"string\": expected u32, found string)"),
        (show(md.get_u64("u64")), "Ok(18446744073709551615)"),
        (show(md.get_u64("i8")), "Err(metadata key \"i8\": expected a value that fits u64, found -120)"),
        (show(md.get_u64_opt("i16")), "Err(metadata key \"i16\": expected a value that fits u64, found -32000)"),
        (show(md.get_i32("i8")), "Ok(-120)"),
        (show(md.get_i32("u32")), "Err(metadata key \"u32\": expected a value that fits i32, found 4000000000)"),
        (show(md.get_i32_opt("i64")), "Err(metadata key \"i64\": expected a value that fits i32, found -9223372036854775808)"),
        (show(md.get_usize("u16")), "Ok(65000)"),
        (show(md.get_bool("bool.false")), "Ok(false)"),
        (show(md.get_bool("u8")), "Err(metadata key \"u8\": expected bool, found u8)"),
        (show(md.get_bool_opt("missing")), "Ok(None)"),
        (show(md.get_str("string")), "Ok(\"héllo ▁world\\n\\0\")"),
        (show(md.get_str("a.string")), "Err(metadata key \"a.string\": expected string, found array of string)"),
        (show(md.get_str_opt("string.empty")), "Ok(Some(\"\"))"),
        (show(md.get_f32("f32")), "Ok(-1.5e-7)"),
        (show(md.get_f32("f64")), "Ok(3.1415927)"),
        (show(md.get_f32("i32")), "Err(metadata key \"i32\": expected f32 or f64, found i32)"),
        (show(md.get_f32_opt("missing")), "Ok(None)"),
        (show(md.get_str_array("a.string")), "Ok([\"\", \"Ġthe\", \"日本\"])"),
        (show(md.get_str_array("a.u8")), "Err(metadata key \"a.u8\": expected array of string, found array of u8)"),
        (show(md.get_str_array_opt("a.string.empty")), "Ok(Some([]))"),
        (show(md.get_f32_array("a.f32")), "Ok([0.0, -0.0, inf, 1e-38])"),
        (show(md.get_f32_array("a.f64")), "Err(metadata key \"a.f64\": expected array of f32, found array of f64)"),
        (show(md.get_f32_array_opt("missing")), "Ok(None)"),
        (show(md.get_i32_array("a.i32")), "Ok([-2147483648, -1, 3])"),
        (show(md.get_i32_array("a.u32")), "Err(metadata key \"a.u32\": expected array of i32, found array of u32)"),
        (show(md.get_i32_array_opt("i32")), "Err(metadata key \"i32\": expected array of i32, found i32)"),
        (show(md.get_u32_array_lossless("a.u8")), "Ok([0, 1, 255])"),
        (show(md.get_u32_array_lossless("a.u32")), "Ok([1, 4294967295])"),
        (show(md.get_u32_array_lossless("a.empty")), "Ok([])"),
        (show(md.get_u32_array_lossless("a.i8")), "Err(metadata key \"a.i8\": expected a value that fits u32, found -128)"),
        (show(md.get_u32_array_lossless("a.f32")), "Err(metadata key \"a.f32\": expected array of integers that fit u32, found array of f32)"),
        (show(md.get_u32_array_lossless("u32")), "Err(metadata key \"u32\": expected array of integers that fit u32, found u32)"),
        (show(md.get_u32_array_lossless_opt("missing")), "Ok(None)"),
        (show(md.get_u32_per_layer("u8", 3)), "Ok([250, 250, 250])"),
        (show(md.get_u32_per_layer("layers", 3)), "Ok([4, 4, 2])"),
        (show(md.get_u32_per_layer("layers", 4)), "Err(metadata key \"layers\": expected 4 per-layer values, found 3)"),
        (show(md.get_u32_per_layer("neg", 2)), "Err(metadata key \"neg\": expected a value that fits u32, found -1)"),
    ];
    for (i, (found, expected)) in cases.iter().enumerate() {
        assert_eq!(found, expected, "case {i}");
    }
}

#[test]
fn check_same_len_names_every_key_and_length() {
    let g = check_ok(common::sample_writer().to_bytes());
    let md = g.metadata();
    let tokenizer = [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.scores",
        "tokenizer.ggml.token_type",
    ];
    let cases = [
        (show(md.check_same_len(&tokenizer)), "Ok(())"),
        (
            show(md.check_same_len(&["tokenizer.ggml.tokens", "absent"])),
            "Ok(())",
        ),
        (show(md.check_same_len(&[])), "Ok(())"),
        (
            show(md.check_same_len(&["tokenizer.ggml.tokens", "heads", "tokenizer.ggml.scores"])),
            "Err(metadata arrays must have equal lengths, found \"tokenizer.ggml.tokens\" has 3, \
             \"heads\" has 2, \"tokenizer.ggml.scores\" has 3)",
        ),
        (
            show(md.check_same_len(&["tokenizer.ggml.tokens", "small.u8"])),
            "Err(metadata key \"small.u8\": expected array, found u8)",
        ),
    ];
    for (found, expected) in cases {
        assert_eq!(found, expected);
    }
}

#[test]
fn values_display_for_humans() {
    let cases = [
        (Value::String("a\"b".into()), "\"a\\\"b\""),
        (Value::F32(0.5), "0.5"),
        (Value::Array(Array::U8(vec![1, 2])), "[1, 2]"),
        (
            Value::Array(Array::U32((0..10).collect())),
            "[0, 1, 2, 3, 4, 5, 6, 7, ... (10 items)]",
        ),
        (Value::Array(Array::String(vec!["x".into()])), "[\"x\"]"),
    ];
    for (value, expected) in cases {
        assert_eq!(value.to_string(), expected);
    }
    assert_eq!(
        Value::Array(Array::Bool(vec![])).type_name(),
        "array of bool"
    );
}

#[test]
fn generated_tensors_match_tensors_given_as_bytes() {
    let fill = |buffer: &mut [u8]| buffer.copy_from_slice(&bytes(buffer.len(), 9));
    let mut generated = GgufWriter::new();
    generated
        .tensor_generated("a", &[64, 3], GgmlType::Q4_0, fill)
        .tensor("b", &[8], GgmlType::F32, bytes(32, 1))
        .tensor_generated("c", &[256], GgmlType::Q6_K, fill);
    let mut given = GgufWriter::new();
    given
        .tensor("a", &[64, 3], GgmlType::Q4_0, bytes(108, 9))
        .tensor("b", &[8], GgmlType::F32, bytes(32, 1))
        .tensor("c", &[256], GgmlType::Q6_K, bytes(210, 9));
    assert_eq!(generated.to_bytes(), given.to_bytes());
    let g = check_ok(generated.to_bytes());
    assert_eq!(g.tensor_bytes("c"), Some(bytes(210, 9).as_slice()));
}

#[test]
fn metadata_built_in_memory_keeps_order_and_refuses_duplicates() {
    let mut md = ember_gguf::Metadata::new();
    md.insert("b", Value::U32(1)).unwrap();
    md.insert("a".to_owned(), Value::Bool(true)).unwrap();
    assert_eq!(
        md.insert("b", Value::U8(2)).unwrap_err().to_string(),
        "metadata key \"b\" appears twice: expected unique keys"
    );
    let keys: Vec<&str> = md.iter().map(|(k, _)| k).collect();
    assert_eq!(
        (keys, md.len(), md.get_u32("b").unwrap()),
        (vec!["b", "a"], 2, 1)
    );
}

#[test]
fn arrays_are_bounded_by_the_memory_they_grow_to() {
    // Empty strings: 8 bytes each in the file, a 24-byte `String` each in memory. Enough of them
    // to pass the memory cap while the file holds every one.
    let n = ember_gguf::MAX_METADATA_MEMORY / 24 + 1;
    let header = Raw::new(0, 1).kv("tokens", 9, &cat(&[&8u32.to_le_bytes(), &le64(n)]));
    let mut file = header.0;
    file.resize(file.len() + 8 * n as usize, 0);
    check_err(
        file,
        &format!(
            "metadata key \"tokens\" (array of {n} elements): the metadata would take {} bytes of \
             memory once parsed, over the cap of {}",
            n * 24,
            ember_gguf::MAX_METADATA_MEMORY
        ),
    );
    // The cap is shared: two arrays of u64 that fit alone do not fit together.
    let half = ember_gguf::MAX_METADATA_MEMORY / 8 / 2 + 1;
    let mut raw = Raw::new(0, 2);
    for key in ["a", "b"] {
        raw = raw.kv(key, 9, &cat(&[&10u32.to_le_bytes(), &le64(half)]));
        raw.0.resize(raw.0.len() + 8 * half as usize, 0);
    }
    let error = Gguf::from_bytes(raw.0).unwrap_err().to_string();
    assert!(error.starts_with("metadata key \"b\" (array of"), "{error}");
}
