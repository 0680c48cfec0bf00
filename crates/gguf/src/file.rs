//! An opened GGUF file: the validated header plus the bytes it describes, so tensor data is a
//! borrowed slice of the mapping rather than a copy.

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

use crate::reader::{self, Header};
use crate::{GgmlType, GgufError, Metadata};

/// One tensor as the header describes it. Every field was validated against the file when it was
/// parsed: the type is known, the shape is whole blocks, and the data lies inside the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the contiguous row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data, relative to the start of the data section.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements: the product of the dimensions.
    pub fn n_elements(&self) -> u64 {
        // Parsing checked that this product fits; saturation only matters for hand-built infos.
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Number of rows: the product of `dims[1..]`.
    pub fn n_rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Elements per row: `dims[0]`.
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(0)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> u64 {
        self.ty.row_bytes(self.row_len()).unwrap_or(0)
    }
}

/// Where the bytes of a file live.
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// A parsed and validated GGUF file that owns its bytes.
pub struct Gguf {
    storage: Storage,
    version: u32,
    alignment: u64,
    data_offset: u64,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
}

impl Gguf {
    /// Maps `path` read-only and parses it. Tensor data is not read until it is touched.
    ///
    /// The file must not be truncated or rewritten while the returned value lives: the tensor
    /// slices are views of the file's pages.
    pub fn open(path: &Path) -> Result<Gguf, GgufError> {
        let io_error = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::open(path).map_err(io_error)?;
        // SAFETY: the mapping is read-only and private to this value. Its soundness rests on no
        // one truncating or rewriting the model file while it is open, which is the documented
        // contract of `Gguf::open`: model files are read, never edited in place.
        let mmap = unsafe { Mmap::map(&file) }.map_err(io_error)?;
        Gguf::from_storage(Storage::Mapped(mmap))
    }

    /// Parses a file held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        Gguf::from_storage(Storage::Owned(bytes))
    }

    fn from_storage(storage: Storage) -> Result<Gguf, GgufError> {
        let Header {
            version,
            alignment,
            data_offset,
            metadata,
            tensors,
            tensor_index,
        } = reader::parse(storage.bytes())?;
        Ok(Gguf {
            storage,
            version,
            alignment,
            data_offset,
            metadata,
            tensors,
            tensor_index,
        })
    }

    /// The format version: 2 or 3.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the data section and of every tensor offset.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// The absolute file offset where the tensor data section starts: the end of the header,
    /// rounded up to the alignment. A file without tensors may end before it.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// The metadata, in file order.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// `general.architecture`, which selects the model code.
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.metadata.get_str("general.architecture")
    }

    /// The tensors, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor called `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The data of `t`, exactly `t.n_bytes` long, borrowed from the file's bytes.
    ///
    /// # Panics
    ///
    /// When `t` did not come from this file and its range lies outside it; infos from
    /// [`Gguf::tensors`] are always in range.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let range = self.data_range(t);
        match range.and_then(|r| self.bytes().get(r)) {
            Some(data) => data,
            None => panic!(
                "tensor {:?} (offset {}, {} bytes) lies outside this {}-byte GGUF file: it comes \
                 from another file",
                t.name,
                t.offset,
                t.n_bytes,
                self.file_size()
            ),
        }
    }

    /// The data of the tensor called `name`.
    pub fn tensor_bytes(&self, name: &str) -> Option<&[u8]> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    fn data_range(&self, t: &TensorInfo) -> Option<std::ops::Range<usize>> {
        let start = self.data_offset.checked_add(t.offset)?;
        let end = start.checked_add(t.n_bytes)?;
        Some(usize::try_from(start).ok()?..usize::try_from(end).ok()?)
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// The file's size in bytes.
    pub fn file_size(&self) -> u64 {
        self.bytes().len() as u64
    }
}

impl fmt::Debug for Gguf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The bytes are left out: they are the whole model.
        f.debug_struct("Gguf")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("file_size", &self.file_size())
            .field("mapped", &matches!(self.storage, Storage::Mapped(_)))
            .field("n_metadata", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}
