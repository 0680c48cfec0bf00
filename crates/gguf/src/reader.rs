//! The GGUF header parser. It reads magic, version, metadata and tensor infos from a byte slice
//! and validates everything a consumer would otherwise trust: every count and length is checked
//! against a cap and against the bytes that remain before anything is allocated from it, and
//! every tensor's shape, type, offset and extent is checked against the file.

use std::collections::HashMap;

use crate::value::ValueType;
use crate::{
    Array, GgmlType, GgufError, Metadata, TensorInfo, Value, MAX_ALIGNMENT, MAX_ARRAY_LEN,
    MAX_METADATA_MEMORY, MAX_NAME_LEN, MAX_STRING_LEN,
};

/// The default alignment of the data section and of tensor offsets when `general.alignment` is
/// absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Fewest bytes one metadata entry can take: key length (8), a one-byte key, value type (4) and
/// a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// Fewest bytes one tensor info can take: name length (8), a one-byte name, dimension count (4),
/// one dimension (8), type (4) and offset (8).
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 1 + 4 + 8 + 4 + 8;
/// Initial capacity limit for vectors sized by a count from the file. Counts are already bounded
/// by the bytes left, but an entry in memory can be larger than its smallest encoding (a `String`
/// is 24 bytes, its encoding 8), so vectors start small and grow with what is really parsed.
const MAX_INITIAL_CAPACITY: usize = 1 << 16;

/// Everything the header says, validated.
pub(crate) struct Header {
    pub version: u32,
    pub alignment: u64,
    pub data_offset: u64,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub tensor_index: HashMap<String, usize>,
}

/// A read position over the file's bytes. Reads fail with the offset and the shortfall; callers
/// add the context (which key, which tensor).
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

/// A read that ran past the end of the file.
struct Short {
    offset: u64,
    needed: u64,
    available: u64,
}

impl Short {
    fn context(self, context: impl Into<String>) -> GgufError {
        GgufError::Truncated {
            context: context.into(),
            offset: self.offset,
            needed: self.needed,
            available: self.available,
        }
    }
}

impl<'a> Cursor<'a> {
    fn offset(&self) -> u64 {
        self.pos as u64
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], Short> {
        let available = self.remaining();
        if n > available {
            return Err(Short {
                offset: self.offset(),
                needed: n,
                available,
            });
        }
        // `n <= remaining`, which is a usize, so the cast and the slice are in range.
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.bytes[start..self.pos])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Short> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N as u64)?);
        Ok(out)
    }

    fn u8(&mut self) -> Result<u8, Short> {
        Ok(self.array::<1>()?[0])
    }
    fn u32(&mut self) -> Result<u32, Short> {
        self.array().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Result<u64, Short> {
        self.array().map(u64::from_le_bytes)
    }
}

/// Parses and validates the header of `bytes`, a whole GGUF file.
pub(crate) fn parse(bytes: &[u8]) -> Result<Header, GgufError> {
    let mut cur = Cursor { bytes, pos: 0 };

    let magic: [u8; 4] = cur.array().map_err(|s| s.context("magic"))?;
    if &magic != b"GGUF" {
        // A byte-swapped magic means a big-endian writer from before the magic was fixed to bytes.
        if &magic == b"FUGG" {
            let version = cur.u32().map_err(|s| s.context("version"))?.swap_bytes();
            return Err(GgufError::BigEndian { version });
        }
        return Err(GgufError::BadMagic { found: magic });
    }

    let version = cur.u32().map_err(|s| s.context("version"))?;
    if version != 2 && version != 3 {
        let swapped = version.swap_bytes();
        if (1..=3).contains(&swapped) {
            return Err(GgufError::BigEndian { version: swapped });
        }
        return Err(GgufError::UnsupportedVersion { version });
    }

    let n_tensors = cur.u64().map_err(|s| s.context("tensor count"))?;
    let n_kv = cur.u64().map_err(|s| s.context("metadata entry count"))?;
    // Both counts are checked against what the rest of the file could hold before either is
    // used: the tensor infos need their bytes too, so the metadata count is checked with them.
    let needed_kv = n_kv.checked_mul(MIN_KV_BYTES);
    if needed_kv.is_none_or(|n| n > cur.remaining()) {
        return Err(GgufError::CountTooLarge {
            what: "metadata entry",
            count: n_kv,
            offset: 16,
            min_entry_bytes: MIN_KV_BYTES,
            available: cur.remaining(),
        });
    }
    let needed_tensors = n_tensors.checked_mul(MIN_TENSOR_INFO_BYTES);
    let left_for_tensors = cur.remaining() - needed_kv.unwrap_or(0);
    if needed_tensors.is_none_or(|n| n > left_for_tensors) {
        return Err(GgufError::CountTooLarge {
            what: "tensor",
            count: n_tensors,
            offset: 8,
            min_entry_bytes: MIN_TENSOR_INFO_BYTES,
            available: left_for_tensors,
        });
    }

    let metadata = read_metadata(&mut cur, n_kv)?;
    let alignment = alignment_of(&metadata)?;
    let (tensors, tensor_index) = read_tensor_infos(&mut cur, n_tensors)?;

    let header_end = cur.offset();
    // header_end <= file size and alignment <= 1 MiB, so this cannot overflow.
    let data_offset = header_end.div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).saturating_sub(data_offset);
    check_tensor_extents(&tensors, alignment, data_len)?;

    Ok(Header {
        version,
        alignment,
        data_offset,
        metadata,
        tensors,
        tensor_index,
    })
}

/// Reads a GGUF string: a u64 length and that many UTF-8 bytes. `cap` bounds the length and
/// `context` names the item in errors.
fn read_string(
    cur: &mut Cursor<'_>,
    cap: u64,
    context: &dyn Fn() -> String,
) -> Result<String, GgufError> {
    let offset = cur.offset();
    let len = cur.u64().map_err(|s| s.context(context()))?;
    if len > cap {
        return Err(GgufError::LengthOverCap {
            context: context(),
            what: "string",
            len,
            cap,
            offset,
        });
    }
    let data_offset = cur.offset();
    let raw = cur.take(len).map_err(|s| s.context(context()))?;
    match std::str::from_utf8(raw) {
        Ok(s) => Ok(s.to_owned()),
        Err(e) => Err(GgufError::InvalidUtf8 {
            context: context(),
            offset: data_offset + e.valid_up_to() as u64,
        }),
    }
}

/// Reads a key or tensor name: a non-empty string of at most [`MAX_NAME_LEN`] bytes.
fn read_name(cur: &mut Cursor<'_>, context: &dyn Fn() -> String) -> Result<String, GgufError> {
    let offset = cur.offset();
    let name = read_string(cur, MAX_NAME_LEN, context)?;
    if name.is_empty() {
        return Err(GgufError::EmptyName {
            context: context(),
            offset,
        });
    }
    Ok(name)
}

/// The memory the parsed metadata takes so far, charged before each value is allocated and
/// checked against [`MAX_METADATA_MEMORY`].
struct MemoryBudget {
    used: u64,
}

impl MemoryBudget {
    /// One `String` in memory besides its bytes.
    const STRING_BYTES: u64 = std::mem::size_of::<String>() as u64;

    fn charge(&mut self, bytes: u64, context: &dyn Fn() -> String) -> Result<(), GgufError> {
        let needed = self.used.saturating_add(bytes);
        if needed > MAX_METADATA_MEMORY {
            return Err(GgufError::MetadataOverCap {
                context: context(),
                needed,
                cap: MAX_METADATA_MEMORY,
            });
        }
        self.used = needed;
        Ok(())
    }
}

fn read_metadata(cur: &mut Cursor<'_>, n_kv: u64) -> Result<Metadata, GgufError> {
    let mut metadata = Metadata::new();
    let mut budget = MemoryBudget { used: 0 };
    for i in 0..n_kv {
        let key = read_name(cur, &|| format!("key of metadata entry {i}"))?;
        let context = || format!("metadata key {key:?}");
        let type_offset = cur.offset();
        let type_id = cur.u32().map_err(|s| s.context(context()))?;
        let value_type =
            ValueType::from_u32(type_id).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                type_id,
                offset: type_offset,
            })?;
        let value = read_value(cur, &key, value_type, &mut budget)?;
        metadata.insert(key, value)?;
    }
    Ok(metadata)
}

fn read_value(
    cur: &mut Cursor<'_>,
    key: &str,
    value_type: ValueType,
    budget: &mut MemoryBudget,
) -> Result<Value, GgufError> {
    let context = || format!("metadata key {key:?}");
    let short = |s: Short| s.context(context());
    Ok(match value_type {
        ValueType::U8 => Value::U8(cur.u8().map_err(short)?),
        ValueType::I8 => Value::I8(cur.array().map(i8::from_le_bytes).map_err(short)?),
        ValueType::U16 => Value::U16(cur.array().map(u16::from_le_bytes).map_err(short)?),
        ValueType::I16 => Value::I16(cur.array().map(i16::from_le_bytes).map_err(short)?),
        ValueType::U32 => Value::U32(cur.u32().map_err(short)?),
        ValueType::I32 => Value::I32(cur.array().map(i32::from_le_bytes).map_err(short)?),
        ValueType::U64 => Value::U64(cur.u64().map_err(short)?),
        ValueType::I64 => Value::I64(cur.array().map(i64::from_le_bytes).map_err(short)?),
        ValueType::F32 => Value::F32(cur.array().map(f32::from_le_bytes).map_err(short)?),
        ValueType::F64 => Value::F64(cur.array().map(f64::from_le_bytes).map_err(short)?),
        ValueType::Bool => {
            let offset = cur.offset();
            Value::Bool(bool_of(cur.u8().map_err(short)?, key, offset)?)
        }
        ValueType::String => {
            let value = read_string(cur, MAX_STRING_LEN, &context)?;
            budget.charge(value.len() as u64, &context)?;
            Value::String(value)
        }
        ValueType::Array => Value::Array(read_array(cur, key, budget)?),
    })
}

fn bool_of(byte: u8, key: &str, offset: u64) -> Result<bool, GgufError> {
    match byte {
        0 => Ok(false),
        1 => Ok(true),
        _ => Err(GgufError::InvalidBool {
            key: key.to_owned(),
            byte,
            offset,
        }),
    }
}

fn read_array(
    cur: &mut Cursor<'_>,
    key: &str,
    budget: &mut MemoryBudget,
) -> Result<Array, GgufError> {
    let context = || format!("metadata key {key:?}");
    let type_offset = cur.offset();
    let type_id = cur.u32().map_err(|s| s.context(context()))?;
    let element_type = ValueType::from_u32(type_id).ok_or_else(|| GgufError::UnknownValueType {
        key: key.to_owned(),
        type_id,
        offset: type_offset,
    })?;
    if element_type == ValueType::Array {
        return Err(GgufError::NestedArray {
            key: key.to_owned(),
            offset: type_offset,
        });
    }
    let len_offset = cur.offset();
    let len = cur.u64().map_err(|s| s.context(context()))?;
    if len > MAX_ARRAY_LEN {
        return Err(GgufError::LengthOverCap {
            context: context(),
            what: "array",
            len,
            cap: MAX_ARRAY_LEN,
            offset: len_offset,
        });
    }
    // Strings take at least their 8-byte length each.
    let min_element_bytes = element_type.fixed_size().unwrap_or(8);
    let min_bytes = len * min_element_bytes; // len <= 2^28, so no overflow.
    if min_bytes > cur.remaining() {
        return Err(GgufError::Truncated {
            context: format!("{} (array of {len} elements)", context()),
            offset: cur.offset(),
            needed: min_bytes,
            available: cur.remaining(),
        });
    }
    // len fits in memory from here on: the file holds at least `len` bytes.
    let n = len as usize;
    // What the elements take in memory, before any is allocated: a string's `String`, or a
    // fixed-size value as decoded (a bool is one byte, as in the file).
    let element_memory = match element_type {
        ValueType::String => MemoryBudget::STRING_BYTES,
        _ => min_element_bytes,
    };
    let array_context = || format!("{} (array of {len} elements)", context());
    budget.charge(len * element_memory, &array_context)?; // len <= 2^28: no overflow.

    if element_type == ValueType::String {
        let mut strings = Vec::with_capacity(n.min(MAX_INITIAL_CAPACITY));
        for i in 0..n {
            let item = || format!("metadata key {key:?}, element {i}");
            let string = read_string(cur, MAX_STRING_LEN, &item)?;
            budget.charge(string.len() as u64, &item)?;
            strings.push(string);
        }
        return Ok(Array::String(strings));
    }

    let data_offset = cur.offset();
    let raw = cur.take(min_bytes).map_err(|s| s.context(context()))?;
    fn decode<const N: usize, T>(raw: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
        raw.chunks_exact(N)
            .map(|c| {
                let mut b = [0u8; N];
                b.copy_from_slice(c);
                f(b)
            })
            .collect()
    }
    Ok(match element_type {
        ValueType::U8 => Array::U8(raw.to_vec()),
        ValueType::I8 => Array::I8(decode(raw, i8::from_le_bytes)),
        ValueType::U16 => Array::U16(decode(raw, u16::from_le_bytes)),
        ValueType::I16 => Array::I16(decode(raw, i16::from_le_bytes)),
        ValueType::U32 => Array::U32(decode(raw, u32::from_le_bytes)),
        ValueType::I32 => Array::I32(decode(raw, i32::from_le_bytes)),
        ValueType::U64 => Array::U64(decode(raw, u64::from_le_bytes)),
        ValueType::I64 => Array::I64(decode(raw, i64::from_le_bytes)),
        ValueType::F32 => Array::F32(decode(raw, f32::from_le_bytes)),
        ValueType::F64 => Array::F64(decode(raw, f64::from_le_bytes)),
        ValueType::Bool => Array::Bool(
            raw.iter()
                .enumerate()
                .map(|(i, &b)| bool_of(b, key, data_offset + i as u64))
                .collect::<Result<_, _>>()?,
        ),
        ValueType::String | ValueType::Array => unreachable!("handled above"),
    })
}

/// The alignment from `general.alignment`, or [`DEFAULT_ALIGNMENT`].
fn alignment_of(metadata: &Metadata) -> Result<u64, GgufError> {
    let Some(value) = metadata.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let bad = |found: String| GgufError::BadAlignment {
        found,
        max: MAX_ALIGNMENT,
    };
    let wide = value
        .as_integer()
        .ok_or_else(|| bad(format!("a value of type {}", value.type_name())))?;
    match u32::try_from(wide) {
        Ok(a) if a != 0 && a.is_power_of_two() && u64::from(a) <= MAX_ALIGNMENT => Ok(a.into()),
        _ => Err(bad(wide.to_string())),
    }
}

type TensorInfos = (Vec<TensorInfo>, HashMap<String, usize>);

fn read_tensor_infos(cur: &mut Cursor<'_>, n_tensors: u64) -> Result<TensorInfos, GgufError> {
    // n_tensors * MIN_TENSOR_INFO_BYTES fits in the file, so the count fits a usize.
    let capacity = (n_tensors as usize).min(MAX_INITIAL_CAPACITY);
    let mut tensors = Vec::with_capacity(capacity);
    let mut index = HashMap::with_capacity(capacity);
    for i in 0..n_tensors {
        let name = read_name(cur, &|| format!("name of tensor {i}"))?;
        let context = || format!("tensor {name:?}");
        let n_dims = cur.u32().map_err(|s| s.context(context()))?;
        if !(1..=4).contains(&n_dims) {
            return Err(GgufError::BadDimCount { name, n_dims });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(cur.u64().map_err(|s| s.context(context()))?);
        }
        let type_id = cur.u32().map_err(|s| s.context(context()))?;
        let offset = cur.u64().map_err(|s| s.context(context()))?;

        let Some(ty) = GgmlType::from_u32(type_id) else {
            return Err(GgufError::UnknownTensorType { name, type_id });
        };
        if dims.contains(&0) {
            return Err(GgufError::ZeroDim { name, dims });
        }
        let row_len = dims[0];
        let block_size = ty.block_size() as u64;
        if row_len % block_size != 0 {
            return Err(GgufError::RowNotBlockMultiple {
                name,
                row_len,
                ty,
                block_size,
            });
        }
        let Some(n_bytes) = tensor_bytes(&dims, ty) else {
            return Err(GgufError::TensorTooLarge { name, dims, ty });
        };
        if index.contains_key(&name) {
            return Err(GgufError::DuplicateTensor { name });
        }
        index.insert(name.clone(), tensors.len());
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_bytes,
        });
    }
    Ok((tensors, index))
}

/// The byte size of a tensor whose row length is a whole number of blocks, or `None` when the
/// element count or the byte size overflows u64.
fn tensor_bytes(dims: &[u64], ty: GgmlType) -> Option<u64> {
    let (&row_len, rest) = dims.split_first()?;
    let n_rows = rest.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d))?;
    // The element count must fit too: consumers compute it without checks.
    row_len.checked_mul(n_rows)?;
    ty.row_bytes(row_len)?.checked_mul(n_rows)
}

/// Checks that every tensor is aligned, inside the data section and disjoint from the others.
fn check_tensor_extents(
    tensors: &[TensorInfo],
    alignment: u64,
    data_len: u64,
) -> Result<(), GgufError> {
    for t in tensors {
        if t.offset % alignment != 0 {
            return Err(GgufError::MisalignedTensor {
                name: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        if t.offset
            .checked_add(t.n_bytes)
            .is_none_or(|end| end > data_len)
        {
            return Err(GgufError::TensorOutOfBounds {
                name: t.name.clone(),
                offset: t.offset,
                n_bytes: t.n_bytes,
                data_len,
            });
        }
    }
    let mut by_offset: Vec<&TensorInfo> = tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    for pair in by_offset.windows(2) {
        let (first, second) = (pair[0], pair[1]);
        // Both ends were checked against data_len above, so the sum cannot overflow.
        let first_end = first.offset + first.n_bytes;
        if second.offset < first_end {
            return Err(GgufError::TensorOverlap {
                first: first.name.clone(),
                first_end,
                second: second.name.clone(),
                second_offset: second.offset,
            });
        }
    }
    Ok(())
}
