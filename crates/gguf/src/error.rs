//! The one error type of this crate: every way a GGUF file can be unreadable or malformed, and
//! every way a metadata lookup can fail. Each variant names the key, tensor or byte offset at
//! fault so a user can find the problem in the file.

use std::path::PathBuf;

use crate::GgmlType;

/// Why a GGUF file could not be opened or parsed, or why a metadata lookup failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, sized or mapped.
    #[error("cannot read GGUF file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    // ---- Header ----
    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: expected magic \"GGUF\" (47 47 55 46), found {found:02x?}")]
    BadMagic { found: [u8; 4] },
    /// The file was written big-endian; only little-endian files are read.
    #[error(
        "big-endian GGUF file (version {version} stored byte-swapped): expected a little-endian \
         file, convert it with gguf-py's endian conversion"
    )]
    BigEndian { version: u32 },
    /// A version other than 2 or 3.
    #[error("unsupported GGUF version {version}: expected 2 or 3{}", version_hint(*version))]
    UnsupportedVersion { version: u32 },

    // ---- Structure ----
    /// The file ends before an item is complete.
    #[error(
        "{context}: file truncated at offset {offset}: expected {needed} more bytes, found {available}"
    )]
    Truncated {
        context: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    /// A count of entries that cannot fit in the bytes that remain.
    #[error(
        "{what} count {count} at offset {offset} is impossible: each entry needs at least \
         {min_entry_bytes} bytes and only {available} bytes are left"
    )]
    CountTooLarge {
        what: &'static str,
        count: u64,
        offset: u64,
        min_entry_bytes: u64,
        available: u64,
    },
    /// A string or array length over this crate's cap (see [`crate::MAX_STRING_LEN`] and friends).
    #[error("{context}: {what} length {len} at offset {offset} exceeds the cap of {cap}")]
    LengthOverCap {
        context: String,
        what: &'static str,
        len: u64,
        cap: u64,
        offset: u64,
    },
    /// Metadata that would take more than [`crate::MAX_METADATA_MEMORY`] once parsed.
    #[error("{context}: the metadata would take {needed} bytes of memory once parsed, over the cap of {cap}")]
    MetadataOverCap {
        context: String,
        needed: u64,
        cap: u64,
    },
    /// A key, tensor name or string value that is not UTF-8.
    #[error("{context}: expected a UTF-8 string at offset {offset}, found invalid UTF-8")]
    InvalidUtf8 { context: String, offset: u64 },
    /// A metadata key or tensor name of length zero.
    #[error("{context}: expected a non-empty name at offset {offset}, found an empty string")]
    EmptyName { context: String, offset: u64 },
    /// A metadata value type id outside the GGUF value types.
    #[error("metadata key {key:?}: unknown value type id {type_id} at offset {offset}: expected 0 to 12")]
    UnknownValueType {
        key: String,
        type_id: u32,
        offset: u64,
    },
    /// An array whose elements are arrays.
    #[error("metadata key {key:?}: nested array at offset {offset}: expected an array of scalars or strings")]
    NestedArray { key: String, offset: u64 },
    /// A bool stored as something other than 0 or 1.
    #[error(
        "metadata key {key:?}: expected a bool (0 or 1) at offset {offset}, found byte {byte}"
    )]
    InvalidBool { key: String, byte: u8, offset: u64 },
    /// The same metadata key twice.
    #[error("metadata key {key:?} appears twice: expected unique keys")]
    DuplicateKey { key: String },
    /// `general.alignment` is not a usable alignment.
    #[error(
        "general.alignment: expected a non-zero power of two at most {max} as an integer fitting \
         u32, found {found}"
    )]
    BadAlignment { found: String, max: u64 },

    // ---- Tensors ----
    /// The same tensor name twice.
    #[error("tensor {name:?} appears twice: expected unique tensor names")]
    DuplicateTensor { name: String },
    /// A dimension count outside 1..=4.
    #[error("tensor {name:?}: expected 1 to 4 dimensions, found {n_dims}")]
    BadDimCount { name: String, n_dims: u32 },
    /// A dimension of zero.
    #[error("tensor {name:?}: expected every dimension to be at least 1, found dims {dims:?}")]
    ZeroDim { name: String, dims: Vec<u64> },
    /// The element count or byte size overflows 64 bits.
    #[error(
        "tensor {name:?}: element count or byte size of dims {dims:?} ({ty}) overflows 64 bits"
    )]
    TensorTooLarge {
        name: String,
        dims: Vec<u64>,
        ty: GgmlType,
    },
    /// A tensor type id that GGML does not (or no longer) define.
    #[error("tensor {name:?}: unknown tensor type id {type_id}")]
    UnknownTensorType { name: String, type_id: u32 },
    /// A row length that is not a whole number of quantization blocks.
    #[error(
        "tensor {name:?}: row length {row_len} is not a multiple of the {ty} block size {block_size}"
    )]
    RowNotBlockMultiple {
        name: String,
        row_len: u64,
        ty: GgmlType,
        block_size: u64,
    },
    /// A data offset that is not a multiple of the file's alignment.
    #[error(
        "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    /// Tensor data that would run past the end of the file.
    #[error(
        "tensor {name:?}: data at offset {offset} of {n_bytes} bytes ends past the data section, \
         which holds {data_len} bytes"
    )]
    TensorOutOfBounds {
        name: String,
        offset: u64,
        n_bytes: u64,
        data_len: u64,
    },
    /// Two tensors whose data ranges share bytes.
    #[error(
        "tensor {second:?} at offset {second_offset} overlaps tensor {first:?}, whose data ends at \
         offset {first_end}"
    )]
    TensorOverlap {
        first: String,
        first_end: u64,
        second: String,
        second_offset: u64,
    },

    // ---- Metadata lookups ----
    /// A required metadata key is absent.
    #[error("metadata key {key:?} is missing")]
    MissingKey { key: String },
    /// A metadata value of another type than the caller needs.
    #[error("metadata key {key:?}: expected {expected}, found {found}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    /// An integer value that does not fit the requested type.
    #[error("metadata key {key:?}: expected a value that fits {expected}, found {value}")]
    OutOfRange {
        key: String,
        expected: &'static str,
        value: i128,
    },
    /// Arrays that must have one entry each per item have different lengths.
    #[error(
        "metadata arrays must have equal lengths, found {}",
        format_lengths(lengths)
    )]
    LengthMismatch { lengths: Vec<(String, usize)> },
    /// A per-layer array whose length is not the layer count.
    #[error("metadata key {key:?}: expected {expected} per-layer values, found {found}")]
    PerLayerLength {
        key: String,
        expected: usize,
        found: usize,
    },
}

fn version_hint(version: u32) -> &'static str {
    if version == 1 {
        " (version 1 used 32-bit counts and lengths and is obsolete; re-convert the model)"
    } else {
        ""
    }
}

fn format_lengths(lengths: &[(String, usize)]) -> String {
    lengths
        .iter()
        .map(|(key, len)| format!("{key:?} has {len}"))
        .collect::<Vec<_>>()
        .join(", ")
}
