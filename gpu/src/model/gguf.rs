//! Reader for GGUF v2/v3 files (the llama.cpp model format, specified in ggml's
//! `docs/gguf.md`): header, metadata key/values, tensor infos and the aligned data section.
//!
//! The file is memory-mapped and never copied. Every count, length, dimension and offset read
//! from the file is bounded before it is used, and every allocation is sized by a value that
//! has been checked against the bytes that remain in the file (and, for metadata arrays, whose
//! values take more memory than file bytes, against a cap on their elements in all), so a
//! crafted file yields an error, never a panic or an unbounded allocation.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use super::tensor::{DType, ModelWeights};
use crate::error::GpuError;

/// `"GGUF"` read as a little-endian u32.
pub(crate) const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Longest accepted string (metadata key or value, tensor name).
pub const MAX_STRING_LEN: u64 = 1 << 20;
/// Longest accepted metadata array.
pub const MAX_ARRAY_LEN: u64 = 1 << 24;
/// Deepest accepted nesting of metadata arrays.
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Most metadata array elements accepted in one file, the elements of nested arrays included.
/// Each becomes a [`GgufValue`] of 32 bytes however few it takes in the file (a `u8` or
/// `bool` takes one), so this bounds their memory to about 1 GiB; the largest real arrays, the
/// tokens, scores, token types and merges of a 256K-token vocabulary, hold about 1M in all.
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 25;
// An array of the longest accepted length fits in the file's total.
const _: () = assert!(MAX_ARRAY_ELEMENTS >= MAX_ARRAY_LEN);
/// Most tensors accepted in one file.
pub const MAX_TENSORS: u64 = 1 << 16;
/// Most metadata key/values accepted in one file.
pub const MAX_METADATA: u64 = 1 << 16;
/// Most dimensions of one tensor (as in ggml).
pub const MAX_DIMS: u32 = 4;
/// Default alignment of the data section and of tensor offsets.
pub const DEFAULT_ALIGNMENT: usize = 32;

/// A GGUF metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// `UINT8`.
    U8(u8),
    /// `INT8`.
    I8(i8),
    /// `UINT16`.
    U16(u16),
    /// `INT16`.
    I16(i16),
    /// `UINT32`.
    U32(u32),
    /// `INT32`.
    I32(i32),
    /// `FLOAT32`.
    F32(f32),
    /// `BOOL`.
    Bool(bool),
    /// `STRING`.
    String(String),
    /// `ARRAY` (elements all of one type; nested arrays allowed).
    Array(Vec<GgufValue>),
    /// `UINT64`.
    U64(u64),
    /// `INT64`.
    I64(i64),
    /// `FLOAT64`.
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a string, if it is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a boolean, if it is one.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// One tensor's entry in the GGUF tensor-info table, validated against the file.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Storage type.
    pub dtype: DType,
    /// Shape in PyTorch order (GGUF's `ne` reversed): the last dimension is contiguous.
    pub shape: Vec<usize>,
    /// Absolute byte offset of the data in the file.
    pub offset: usize,
    /// Size of the data in bytes.
    pub n_bytes: usize,
}

/// The parsed header of a GGUF file (everything but the tensor data).
#[derive(Clone, Debug, PartialEq)]
pub struct GgufHeader {
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key/values, sorted by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// Tensor infos in file order.
    pub tensors: Vec<GgufTensorInfo>,
    /// Alignment of the data section (`general.alignment`, default 32).
    pub alignment: usize,
    /// Absolute offset of the data section.
    pub data_offset: usize,
}

/// A memory-mapped GGUF file.
#[derive(Debug)]
pub struct GgufFile {
    /// Where the file was opened from.
    pub path: PathBuf,
    /// Its parsed header.
    pub header: GgufHeader,
    mmap: Mmap,
}

impl GgufFile {
    /// Maps and parses `path`, which must be a regular file (links are followed): checked by
    /// path before it is opened (opening a FIFO blocks) and again once open.
    pub fn open(path: &Path) -> Result<Self, GpuError> {
        let file = super::open_regular(path)?;
        // SAFETY: the map is read-only and private to this process; the model file is treated
        // as immutable while it is loaded (as every mmap-based model loader does). A concurrent
        // truncation by another process would be a user error outside our control.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| GpuError::io(path, e))?;
        let header = parse_header(&mmap, path)?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            header,
            mmap,
        })
    }

    /// Moves the mapping into a [`ModelWeights`] holding every tensor under its GGUF name.
    pub fn into_weights(self) -> Result<(GgufHeader, ModelWeights), GpuError> {
        let mut w = ModelWeights::new();
        let idx = w.add_mmap(self.mmap);
        for t in &self.header.tensors {
            w.insert_tensor(t.name.clone(), idx, t.offset, t.dtype, t.shape.clone())?;
        }
        Ok((self.header, w))
    }
}

impl GgufHeader {
    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// The string under `key`, if present and a string.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    /// The non-negative integer under `key` as `usize`, if present and an integer.
    pub fn get_usize(&self, key: &str) -> Option<usize> {
        self.get(key)
            .and_then(GgufValue::as_u64)
            .and_then(|v| usize::try_from(v).ok())
    }

    /// The number under `key` as `f32`, if present and numeric.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(GgufValue::as_f64).map(|v| v as f32)
    }

    /// The array under `key`, if present and an array.
    pub fn get_array(&self, key: &str) -> Option<&[GgufValue]> {
        self.get(key).and_then(GgufValue::as_array)
    }
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    /// The whole file.
    bytes: &'a [u8],
    /// Offset of the next byte to read.
    pos: usize,
    /// The file's path, for errors.
    path: &'a Path,
    /// Metadata array elements read so far (nested arrays' elements included).
    array_elements: u64,
    /// Most metadata array elements accepted ([`MAX_ARRAY_ELEMENTS`] outside tests).
    max_array_elements: u64,
}

impl<'a> Cursor<'a> {
    fn err(&self, reason: impl Into<String>) -> GpuError {
        GpuError::invalid_file(self.path, reason)
    }

    fn remaining(&self) -> usize {
        self.bytes.len().saturating_sub(self.pos)
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], GpuError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                self.err(format!(
                    "truncated: {what} needs {n} bytes at offset {}, file has {}",
                    self.pos,
                    self.bytes.len()
                ))
            })?;
        let s = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GpuError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GpuError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GpuError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Reads a length-prefixed UTF-8 string of at most `max` bytes.
    fn string(&mut self, what: &str, max: u64) -> Result<String, GpuError> {
        let len = self.u64(what)?;
        if len > max {
            return Err(self.err(format!("{what}: string length {len} exceeds {max}")));
        }
        let bytes = self.take(len as usize, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.err(format!("{what}: string is not valid UTF-8")))
    }

    /// Reads a metadata value of type `ty`.
    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<GgufValue, GpuError> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(key)?[0]),
            1 => GgufValue::I8(i8::from_le_bytes(self.array(key)?)),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(key)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(key)?)),
            4 => GgufValue::U32(self.u32(key)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(key)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match self.array::<1>(key)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(self.err(format!("{key}: invalid bool byte {b}"))),
            },
            8 => GgufValue::String(self.string(key, MAX_STRING_LEN)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(self.err(format!(
                        "{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}"
                    )));
                }
                let elem_ty = self.u32(key)?;
                let len = self.u64(key)?;
                if len > MAX_ARRAY_LEN {
                    return Err(
                        self.err(format!("{key}: array length {len} exceeds {MAX_ARRAY_LEN}"))
                    );
                }
                let min_size = min_value_size(elem_ty)
                    .ok_or_else(|| self.err(format!("{key}: unknown value type {elem_ty}")))?;
                // Bound the allocation by what the file can actually hold.
                if len.saturating_mul(min_size) > self.remaining() as u64 {
                    return Err(
                        self.err(format!("{key}: array of {len} elements overruns the file"))
                    );
                }
                // And the file's arrays together by what their values cost in memory.
                let total = self.array_elements.saturating_add(len);
                if total > self.max_array_elements {
                    return Err(self.err(format!(
                        "{key}: the metadata arrays hold more than {} elements in all",
                        self.max_array_elements
                    )));
                }
                self.array_elements = total;
                let mut v = Vec::with_capacity(len as usize);
                for _ in 0..len {
                    v.push(self.value(elem_ty, key, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64(key)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(key)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(self.err(format!("{key}: unknown value type {t}"))),
        })
    }
}

/// The fewest bytes a value of GGUF type `ty` occupies, or `None` for an unknown type.
fn min_value_size(ty: u32) -> Option<u64> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => return None,
    })
}

/// Maps a ggml type number to a [`DType`], naming the tensor when it is unsupported.
fn dtype_from_ggml(ty: u32, tensor: &str) -> Result<DType, GpuError> {
    Ok(match ty {
        0 => DType::F32,
        1 => DType::F16,
        2 => DType::Q4_0,
        3 => DType::Q4_1,
        6 => DType::Q5_0,
        7 => DType::Q5_1,
        8 => DType::Q8_0,
        10 => DType::Q2K,
        11 => DType::Q3K,
        12 => DType::Q4K,
        13 => DType::Q5K,
        14 => DType::Q6K,
        30 => DType::BF16,
        other => {
            let type_name = match other {
                9 => "Q8_1".to_string(),
                15 => "Q8_K".to_string(),
                n => format!("ggml type {n}"),
            };
            return Err(GpuError::UnsupportedTensorType {
                tensor: tensor.to_string(),
                type_name,
            });
        }
    })
}

/// Parses the header, metadata and tensor infos of a GGUF file held in `bytes`, and checks
/// that every tensor's data lies inside `bytes`.
pub fn parse_header(bytes: &[u8], path: &Path) -> Result<GgufHeader, GpuError> {
    parse_header_limited(bytes, path, MAX_ARRAY_ELEMENTS)
}

/// [`parse_header`] with at most `max_array_elements` metadata array elements (tests use
/// small bounds).
fn parse_header_limited(
    bytes: &[u8],
    path: &Path,
    max_array_elements: u64,
) -> Result<GgufHeader, GpuError> {
    let mut c = Cursor {
        bytes,
        pos: 0,
        path,
        array_elements: 0,
        max_array_elements,
    };
    if c.array::<4>("magic")? != GGUF_MAGIC {
        return Err(c.err("not a GGUF file (bad magic)"));
    }
    let version = c.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(c.err(format!("unsupported GGUF version {version} (need 2 or 3)")));
    }
    let n_tensors = c.u64("tensor count")?;
    if n_tensors > MAX_TENSORS {
        return Err(c.err(format!("tensor count {n_tensors} exceeds {MAX_TENSORS}")));
    }
    let n_kv = c.u64("metadata count")?;
    if n_kv > MAX_METADATA {
        return Err(c.err(format!("metadata count {n_kv} exceeds {MAX_METADATA}")));
    }
    let mut metadata = BTreeMap::new();
    for _ in 0..n_kv {
        let key = c.string("metadata key", MAX_STRING_LEN)?;
        let ty = c.u32(&key)?;
        let value = c.value(ty, &key, 0)?;
        if metadata.insert(key.clone(), value).is_some() {
            return Err(c.err(format!("duplicate metadata key {key}")));
        }
    }
    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => v
            .as_u64()
            .and_then(|a| usize::try_from(a).ok())
            .filter(|a| a.is_power_of_two() && *a <= 1 << 16)
            .ok_or_else(|| c.err(format!("general.alignment {v:?} is not a power of two")))?,
    };
    // Each tensor info takes at least 8 (name) + 4 + 8 + 4 + 8 bytes.
    if n_tensors.saturating_mul(32) > c.remaining() as u64 {
        return Err(c.err(format!("{n_tensors} tensor infos overrun the file")));
    }
    let mut raw = Vec::with_capacity(n_tensors as usize);
    for _ in 0..n_tensors {
        let name = c.string("tensor name", MAX_STRING_LEN)?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(c.err(format!(
                "tensor '{name}': {n_dims} dimensions (1..=4 allowed)"
            )));
        }
        let mut ne = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            let d = c.u64(&name)?;
            let d = usize::try_from(d)
                .ok()
                .filter(|&d| d > 0 && d <= i64::MAX as usize)
                .ok_or_else(|| c.err(format!("tensor '{name}': bad dimension {d}")))?;
            ne.push(d);
        }
        let ty = c.u32(&name)?;
        let offset = c.u64(&name)?;
        raw.push((name, ne, ty, offset));
    }
    let data_offset = c
        .pos
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| c.err("data offset overflows"))?;
    let mut tensors = Vec::with_capacity(raw.len());
    let mut names = std::collections::HashSet::with_capacity(raw.len());
    for (name, ne, ty, rel) in raw {
        let dtype = dtype_from_ggml(ty, &name)?;
        let shape: Vec<usize> = ne.iter().rev().copied().collect();
        let n_bytes = dtype.tensor_bytes(&shape).ok_or_else(|| {
            c.err(format!(
                "tensor '{name}': shape {shape:?} overflows or is not a whole number of {dtype} blocks"
            ))
        })?;
        let offset = usize::try_from(rel)
            .ok()
            .filter(|r| r.is_multiple_of(alignment))
            .and_then(|r| r.checked_add(data_offset))
            .ok_or_else(|| c.err(format!("tensor '{name}': misaligned offset {rel}")))?;
        match offset.checked_add(n_bytes) {
            Some(end) if end <= bytes.len() => {}
            _ => {
                return Err(c.err(format!(
                    "tensor '{name}': data at {offset}+{n_bytes} lies outside the file ({} bytes)",
                    bytes.len()
                )))
            }
        }
        if !names.insert(name.clone()) {
            return Err(c.err(format!("duplicate tensor name '{name}'")));
        }
        tensors.push(GgufTensorInfo {
            name,
            dtype,
            shape,
            offset,
            n_bytes,
        });
    }
    Ok(GgufHeader {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

#[cfg(test)]
#[path = "gguf_tests.rs"]
pub(crate) mod tests;
