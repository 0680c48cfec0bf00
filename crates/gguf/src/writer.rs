//! A GGUF writer for tests, fuzz seeds and synthetic models.
//!
//! It writes what it is told: duplicate keys, duplicate tensor names, an odd `general.alignment`
//! or version 1 go into the file as given, so tests can build the malformed files the parser must
//! reject. Only what would make the writer itself produce garbage (data of the wrong length, an
//! unusable alignment for padding) is refused.

use std::io::{self, Read, Write};
use std::path::Path;

use crate::{Array, GgmlType, Value, MAX_ALIGNMENT};

/// Produces a tensor's data at write time into a zeroed buffer of the tensor's size.
type Generator = Box<dyn Fn(&mut [u8])>;

enum TensorData {
    Bytes(Vec<u8>),
    Generated(Generator),
}

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    n_bytes: u64,
    data: TensorData,
}

/// Builds a GGUF file in memory and writes it out.
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new()
    }
}

impl GgufWriter {
    /// Version 3, alignment 32, no metadata, no tensors.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: crate::reader::DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// The version number written in the header. The layout written is always version 3's.
    pub fn version(&mut self, v: u32) -> &mut Self {
        self.version = v;
        self
    }

    /// The alignment used to pad the data section and tensor offsets. A value other than 32 is
    /// also written as `general.alignment` (u32) ahead of the other metadata.
    ///
    /// # Panics
    ///
    /// When `a` is not a power of two of at most [`MAX_ALIGNMENT`]: the writer could not pad to
    /// it. To write a file whose `general.alignment` is invalid, set the key with
    /// [`GgufWriter::metadata`] instead.
    pub fn alignment(&mut self, a: u64) -> &mut Self {
        assert!(
            a.is_power_of_two() && a <= MAX_ALIGNMENT,
            "GgufWriter::alignment: expected a power of two at most {MAX_ALIGNMENT}, found {a}"
        );
        self.alignment = a;
        self
    }

    /// Appends a metadata entry.
    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_owned(), value));
        self
    }

    /// Appends a tensor. Its data is placed after the previous tensor's, padded to the alignment.
    ///
    /// # Panics
    ///
    /// When `data` is not exactly the size of `dims` elements of `ty`: the tensor could not be
    /// read back.
    pub fn tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType, data: Vec<u8>) -> &mut Self {
        let expected = tensor_bytes(dims, ty);
        assert!(
            expected == Some(data.len() as u64),
            "GgufWriter::tensor {name:?}: expected {} bytes of data for dims {dims:?} of {ty}, \
             found {}",
            expected.map_or("an impossible number of".to_owned(), |n| n.to_string()),
            data.len()
        );
        self.push_tensor(name, dims, ty, data.len() as u64, TensorData::Bytes(data))
    }

    /// Appends a tensor whose data `fill` writes at write time into a zeroed buffer of the
    /// tensor's size. For synthetic models larger than memory: only one tensor's data exists at a
    /// time, however many tensors the file holds.
    ///
    /// # Panics
    ///
    /// When `dims` is empty, a row of `ty` is not whole blocks, or the size overflows.
    pub fn tensor_generated(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        fill: impl Fn(&mut [u8]) + 'static,
    ) -> &mut Self {
        let Some(n_bytes) = tensor_bytes(dims, ty) else {
            panic!(
                "GgufWriter::tensor_generated {name:?}: dims {dims:?} of {ty} have no valid size"
            );
        };
        self.push_tensor(
            name,
            dims,
            ty,
            n_bytes,
            TensorData::Generated(Box::new(fill)),
        )
    }

    fn push_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        n_bytes: u64,
        data: TensorData,
    ) -> &mut Self {
        self.tensors.push(PendingTensor {
            name: name.to_owned(),
            dims: dims.to_vec(),
            ty,
            n_bytes,
            data,
        });
        self
    }

    /// Writes the file.
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let mut header = Vec::new();
        header.extend_from_slice(b"GGUF");
        header.extend_from_slice(&self.version.to_le_bytes());
        let explicit_alignment = self.alignment != crate::reader::DEFAULT_ALIGNMENT;
        let n_kv = self.metadata.len() + usize::from(explicit_alignment);
        put_u64(&mut header, self.tensors.len() as u64);
        put_u64(&mut header, n_kv as u64);
        if explicit_alignment {
            // alignment() checked that it fits u32.
            put_kv(
                &mut header,
                "general.alignment",
                &Value::U32(self.alignment as u32),
            );
        }
        for (key, value) in &self.metadata {
            put_kv(&mut header, key, value);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_string(&mut header, &t.name);
            header.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for &d in &t.dims {
                put_u64(&mut header, d);
            }
            header.extend_from_slice(&(t.ty as u32).to_le_bytes());
            put_u64(&mut header, offset);
            offsets.push(offset);
            offset = align_up(offset + t.n_bytes, self.alignment);
        }
        let header_len = header.len() as u64;
        header.resize(align_up(header_len, self.alignment) as usize, 0);
        w.write_all(&header)?;

        let mut written = 0u64;
        for (t, &offset) in self.tensors.iter().zip(&offsets) {
            write_zeros(w, offset - written)?;
            match &t.data {
                TensorData::Bytes(bytes) => w.write_all(bytes)?,
                TensorData::Generated(fill) => {
                    let len = usize::try_from(t.n_bytes).map_err(|_| {
                        io::Error::new(
                            io::ErrorKind::OutOfMemory,
                            format!(
                                "tensor {:?} of {} bytes does not fit memory",
                                t.name, t.n_bytes
                            ),
                        )
                    })?;
                    let mut buffer = vec![0u8; len];
                    fill(&mut buffer);
                    w.write_all(&buffer)?;
                }
            }
            written = offset + t.n_bytes;
        }
        // Pad the last tensor too, as GGML's writer does, so the file is a whole number of
        // alignment units past the data section start.
        write_zeros(w, align_up(written, self.alignment) - written)?;
        Ok(())
    }

    /// The file as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out)
            .expect("writing to a Vec<u8> cannot fail");
        out
    }

    /// Writes the file to `path`, replacing it.
    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        let mut w = io::BufWriter::new(std::fs::File::create(path)?);
        self.write_to(&mut w)?;
        w.flush()
    }
}

fn tensor_bytes(dims: &[u64], ty: GgmlType) -> Option<u64> {
    let n = dims.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
    let row_len = *dims.first()?;
    let n_rows = n.checked_div(row_len)?;
    ty.row_bytes(row_len)?.checked_mul(n_rows)
}

fn align_up(x: u64, alignment: u64) -> u64 {
    x.div_ceil(alignment) * alignment
}

fn write_zeros(w: &mut impl Write, n: u64) -> io::Result<()> {
    io::copy(&mut io::repeat(0).take(n), w).map(|_| ())
}

fn put_u64(out: &mut Vec<u8>, x: u64) {
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn put_kv(out: &mut Vec<u8>, key: &str, value: &Value) {
    put_string(out, key);
    out.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
    put_value(out, value);
}

fn put_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::U8(v) => out.push(*v),
        Value::I8(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I16(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::U64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::I64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F32(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::F64(v) => out.extend_from_slice(&v.to_le_bytes()),
        Value::Bool(v) => out.push(u8::from(*v)),
        Value::String(s) => put_string(out, s),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, array: &Array) {
    out.extend_from_slice(&(array.element_type() as u32).to_le_bytes());
    put_u64(out, array.len() as u64);
    macro_rules! le {
        ($v:expr) => {
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match array {
        Array::U8(v) => out.extend_from_slice(v),
        Array::I8(v) => le!(v),
        Array::U16(v) => le!(v),
        Array::I16(v) => le!(v),
        Array::U32(v) => le!(v),
        Array::I32(v) => le!(v),
        Array::U64(v) => le!(v),
        Array::I64(v) => le!(v),
        Array::F32(v) => le!(v),
        Array::F64(v) => le!(v),
        Array::Bool(v) => out.extend(v.iter().map(|&b| u8::from(b))),
        Array::String(v) => v.iter().for_each(|s| put_string(out, s)),
    }
}
