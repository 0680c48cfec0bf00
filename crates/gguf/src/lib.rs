//! GGUF: the file format of GGML models. Parsing treats every file as hostile; tensors are
//! zero-copy views over a read-only memory map.
//!
//! [`Gguf::open`] maps a file and validates its whole header before returning: magic and version,
//! every metadata entry, every tensor's shape, type, alignment and extent, and that no two tensors
//! share bytes. A malformed file is a [`GgufError`] naming the key, tensor or offset at fault, never
//! a panic, and no allocation is ever sized by a count the file claims before that count has been
//! checked against a cap and against the bytes that remain.
//!
//! [`GgufWriter`] writes files for tests, fuzz seeds and synthetic models.
//!
//! ```
//! use ember_gguf::{GgmlType, Gguf, GgufWriter, Value};
//!
//! let mut writer = GgufWriter::new();
//! writer
//!     .metadata("general.architecture", Value::String("llama".into()))
//!     .tensor("output_norm.weight", &[4], GgmlType::F32, vec![0; 16]);
//! let gguf = Gguf::from_bytes(writer.to_bytes())?;
//! assert_eq!(gguf.metadata().get_str("general.architecture")?, "llama");
//! let norm = gguf.tensor("output_norm.weight").expect("written above");
//! assert_eq!(gguf.tensor_data(norm).len(), 16);
//! # Ok::<(), ember_gguf::GgufError>(())
//! ```
//!
//! The layout follows the GGUF specification in the ggml repository (`docs/gguf.md`).

mod error;
mod file;
mod metadata;
mod reader;
mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use file::{Gguf, TensorInfo};
pub use metadata::Metadata;
pub use reader::DEFAULT_ALIGNMENT;
pub use types::GgmlType;
pub use value::{Array, Value};
pub use writer::GgufWriter;

/// Longest metadata key or tensor name, in bytes. The GGUF specification caps keys at 65535
/// bytes; tensor names in practice are under 64 (GGML's own limit), so one cap serves both.
pub const MAX_NAME_LEN: u64 = 65_535;

/// Longest string value, in bytes. The largest real strings are chat templates and merged
/// tokenizer configs of a few hundred KiB; 64 MiB leaves room without letting a forged length
/// claim the machine's memory.
pub const MAX_STRING_LEN: u64 = 64 << 20;

/// Most elements in one metadata array. The largest real arrays are vocabularies and merge lists
/// of a few hundred thousand entries; 2^28 is a thousand times that.
pub const MAX_ARRAY_LEN: u64 = 1 << 28;

/// Most memory all metadata values may take once parsed, in bytes. A value can be larger in
/// memory than in the file (an empty string is 8 bytes there and a 24-byte `String` here), so
/// the file's size alone does not bound it. Real models' metadata (a vocabulary of 262,144 tokens
/// with its scores and types, or 151,387 merges) takes a few tens of MiB; 256 MiB leaves room
/// without letting a forged file claim the machine's memory.
pub const MAX_METADATA_MEMORY: u64 = 256 << 20;

/// Largest accepted `general.alignment`. Real files use 32 (the default) or a page size; 1 MiB
/// bounds the padding a file can demand.
pub const MAX_ALIGNMENT: u64 = 1 << 20;

#[cfg(test)]
mod tests {
    #[test]
    fn parsed_files_can_be_shared_between_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<crate::Gguf>();
        assert_send_sync::<crate::GgufError>();
    }
}
