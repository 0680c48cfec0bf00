//! Fuzz target: parse arbitrary bytes as a GGUF file. Parsing must return `Ok` or `Err` and never
//! panic, hang or allocate without bound; an accepted file must be safe to use, so every accessor
//! and every typed getter runs on it and the invariants consumers rely on are asserted.

#![no_main]

use ember_gguf::{Gguf, Value};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(gguf) = Gguf::from_bytes(data.to_vec()) else {
        return;
    };
    assert!(gguf.version() == 2 || gguf.version() == 3);
    assert!(gguf.alignment().is_power_of_two());
    assert_eq!(gguf.data_offset() % gguf.alignment(), 0);
    assert_eq!(gguf.file_size(), data.len() as u64);
    let _ = format!("{gguf:?}");

    let md = gguf.metadata();
    for (key, value) in md.iter() {
        assert!(md.get(key).is_some_and(|v| std::ptr::eq(v, value)));
        let _ = (value.to_string(), value.type_name(), value.as_integer());
        let _ = (
            md.get_u32(key),
            md.get_u32_opt(key),
            md.get_u64(key),
            md.get_u64_opt(key),
        );
        let _ = (
            md.get_i32(key),
            md.get_i32_opt(key),
            md.get_usize(key),
            md.get_usize_opt(key),
        );
        let _ = (
            md.get_bool(key),
            md.get_bool_opt(key),
            md.get_f32(key),
            md.get_f32_opt(key),
        );
        let _ = (md.get_str(key), md.get_str_opt(key));
        let _ = (md.get_str_array(key), md.get_str_array_opt(key));
        let _ = (md.get_f32_array(key), md.get_f32_array_opt(key));
        let _ = (md.get_i32_array(key), md.get_i32_array_opt(key));
        let _ = (
            md.get_u32_array_lossless(key),
            md.get_u32_array_lossless_opt(key),
        );
        let _ = md.get_u32_per_layer(key, 4);
        if let Value::Array(a) = value {
            let _ = (a.len(), a.is_empty(), a.integers().map(|i| i.sum::<i128>()));
        }
    }
    let keys: Vec<&str> = md.iter().map(|(k, _)| k).collect();
    let _ = md.check_same_len(&keys);
    let _ = gguf.architecture();

    for t in gguf.tensors() {
        let bytes = gguf.tensor_data(t);
        assert_eq!(bytes.len() as u64, t.n_bytes);
        assert_eq!(t.offset % gguf.alignment(), 0);
        assert!(gguf.tensor(&t.name).is_some_and(|found| found == t));
        assert_eq!(
            t.ty.row_bytes(t.row_len()).map(|r| r * t.n_rows()),
            Some(t.n_bytes)
        );
        assert_eq!(t.n_elements(), t.row_len() * t.n_rows());
    }
});
