//! GGUF: the file format of GGML models. Parsing treats every file as hostile; tensors are
//! zero-copy views over a read-only memory map.

mod types;

pub use types::GgmlType;
