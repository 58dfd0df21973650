//! Tensor storage types shared by the model loaders and the compute backends: [`DType`],
//! [`TensorView`] (a borrowed tensor) and [`ModelWeights`] (all tensors of a model, owning the
//! memory maps they live in).

use std::collections::HashMap;

use memmap2::Mmap;

use crate::error::GpuError;

/// Storage type of a tensor. The quantized types are ggml's block formats (see
/// [`crate::model::quant_blocks`]): 32 values per block along the contiguous dimension, 256 for
/// the K-quants.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision.
    F32,
    /// IEEE 754 half precision.
    F16,
    /// bfloat16.
    BF16,
    /// ggml Q8_0: `{d: f16, qs: [i8; 32]}`, 34 bytes per 32 values.
    Q8_0,
    /// ggml Q4_0: `{d: f16, qs: [u8; 16]}`, 18 bytes per 32 values.
    Q4_0,
    /// ggml Q4_1: `{d: f16, m: f16, qs: [u8; 16]}`, 20 bytes per 32 values.
    Q4_1,
    /// ggml Q5_0: `{d: f16, qh: [u8; 4], qs: [u8; 16]}`, 22 bytes per 32 values.
    Q5_0,
    /// ggml Q5_1: `{d: f16, m: f16, qh: [u8; 4], qs: [u8; 16]}`, 24 bytes per 32 values.
    Q5_1,
    /// ggml Q2_K: `{scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16}`, 84 bytes per 256.
    Q2K,
    /// ggml Q3_K: `{hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16}`, 110 bytes per 256.
    Q3K,
    /// ggml Q4_K: `{d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]}`, 144 bytes per 256.
    Q4K,
    /// ggml Q5_K: Q4_K's fields and `qh: [u8; 32]` before `qs`, 176 bytes per 256 values.
    Q5K,
    /// ggml Q6_K: `{ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16}`, 210 bytes per 256.
    Q6K,
}

impl DType {
    /// The 5-bit and K-quant types (the CPU kernels take them as Q8_0), in ggml's type order.
    pub const FIVE_BIT_AND_K: [DType; 7] = [
        DType::Q5_0,
        DType::Q5_1,
        DType::Q2K,
        DType::Q3K,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];

    /// Number of values stored in one block (1 for the float types).
    pub const fn block_len(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes of one block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q2K => 84,
            DType::Q3K => 110,
            DType::Q4K => 144,
            DType::Q5K => 176,
            DType::Q6K => 210,
        }
    }

    /// Whether this is one of the block-quantized types.
    pub const fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Bytes needed for a row of `n` values, or `None` when `n` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// Bytes needed for a tensor of this type and `shape` (PyTorch order, last dimension
    /// contiguous), or `None` on overflow or when the last dimension is not a whole number of
    /// blocks.
    pub fn tensor_bytes(self, shape: &[usize]) -> Option<usize> {
        let (last, rest) = match shape.split_last() {
            Some(x) => x,
            None => return Some(self.block_bytes()).filter(|_| !self.is_quantized()),
        };
        let rows = rest.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
        self.row_bytes(*last)?.checked_mul(rows)
    }

    /// The conventional name of the type (as in ggml).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "F32",
            DType::F16 => "F16",
            DType::BF16 => "BF16",
            DType::Q8_0 => "Q8_0",
            DType::Q4_0 => "Q4_0",
            DType::Q4_1 => "Q4_1",
            DType::Q5_0 => "Q5_0",
            DType::Q5_1 => "Q5_1",
            DType::Q2K => "Q2_K",
            DType::Q3K => "Q3_K",
            DType::Q4K => "Q4_K",
            DType::Q5K => "Q5_K",
            DType::Q6K => "Q6_K",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor as stored in the file, borrowed from the memory map.
#[derive(Clone, Debug)]
pub struct TensorView<'a> {
    /// Storage type.
    pub dtype: DType,
    /// Row-major shape, PyTorch order: a linear layer weight is `[out_features, in_features]`;
    /// the LAST dimension is contiguous (GGUF's `ne[0]`), quantized blocks run along it.
    pub shape: Vec<usize>,
    /// Exactly the bytes of the tensor (little-endian), length validated against shape and
    /// dtype. No alignment is guaranteed: read values with `from_le_bytes`.
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Number of elements.
    pub fn num_elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// Dequantizes or converts the whole tensor to `f32`, row-major.
    pub fn to_f32_vec(&self) -> Vec<f32> {
        crate::model::dequant::to_f32(self.dtype, self.data)
    }
}

/// Where the bytes of a [`ModelWeights`] live.
#[derive(Debug)]
enum Storage {
    /// A read-only memory map of a model file.
    Mapped(Mmap),
    /// Bytes owned in memory (dummy weights, tests).
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

/// Where one tensor lives inside the storages of a [`ModelWeights`].
#[derive(Clone, Debug)]
struct TensorEntry {
    storage: usize,
    offset: usize,
    len: usize,
    dtype: DType,
    shape: Vec<usize>,
}

/// All tensors of a model under their canonical (GGUF) names; owns the memory maps (or
/// buffers) the tensors are borrowed from.
#[derive(Debug, Default)]
pub struct ModelWeights {
    storages: Vec<Storage>,
    tensors: HashMap<String, TensorEntry>,
}

impl ModelWeights {
    /// An empty set of weights.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a memory map and returns its index for [`ModelWeights::insert_tensor`].
    pub(crate) fn add_mmap(&mut self, map: Mmap) -> usize {
        self.storages.push(Storage::Mapped(map));
        self.storages.len() - 1
    }

    /// Registers a tensor at `offset..offset+len` of storage `storage`, checking bounds and
    /// that `len` matches the shape and dtype.
    pub(crate) fn insert_tensor(
        &mut self,
        name: String,
        storage: usize,
        offset: usize,
        dtype: DType,
        shape: Vec<usize>,
    ) -> Result<(), GpuError> {
        let bad = |reason: String| GpuError::BadTensor {
            tensor: name.clone(),
            reason,
        };
        let len = dtype
            .tensor_bytes(&shape)
            .ok_or_else(|| bad(format!("shape {shape:?} is invalid for {dtype}")))?;
        let total = self
            .storages
            .get(storage)
            .map(|s| s.bytes().len())
            .ok_or_else(|| bad("unknown storage".into()))?;
        match offset.checked_add(len) {
            Some(end) if end <= total => {}
            _ => {
                return Err(bad(format!(
                    "data {offset}+{len} lies outside the file ({total} bytes)"
                )))
            }
        }
        if self.tensors.contains_key(&name) {
            return Err(bad("duplicate tensor name".into()));
        }
        self.tensors.insert(
            name,
            TensorEntry {
                storage,
                offset,
                len,
                dtype,
                shape,
            },
        );
        Ok(())
    }

    /// Adds a tensor whose bytes are owned in memory (used for dummy weights and tests).
    pub fn insert_owned(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
        data: Vec<u8>,
    ) -> Result<(), GpuError> {
        let name = name.into();
        if dtype.tensor_bytes(&shape) != Some(data.len()) {
            return Err(GpuError::BadTensor {
                tensor: name,
                reason: format!(
                    "{} bytes do not match shape {shape:?} of {dtype}",
                    data.len()
                ),
            });
        }
        self.storages.push(Storage::Owned(data));
        let idx = self.storages.len() - 1;
        self.insert_tensor(name, idx, 0, dtype, shape)
    }

    /// Replaces the matrix `name` by consecutive bands of its rows, `parts` (name, rows) in
    /// order, each a view of the same bytes (no copy). The rows must add up to the matrix's.
    pub(crate) fn split_rows(
        &mut self,
        name: &str,
        parts: &[(String, usize)],
    ) -> Result<(), GpuError> {
        let bad = |reason: String| GpuError::BadTensor {
            tensor: name.to_string(),
            reason,
        };
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| GpuError::TensorNotFound(name.to_string()))?;
        let [rows, cols] = e.shape[..] else {
            return Err(bad(format!("shape {:?} is not a matrix", e.shape)));
        };
        let total: usize = parts.iter().map(|(_, r)| r).sum();
        if total != rows {
            return Err(bad(format!(
                "{rows} rows, expected {total} (the parts it holds)"
            )));
        }
        let row_bytes = e
            .dtype
            .row_bytes(cols)
            .ok_or_else(|| bad(format!("rows of {cols} {} values", e.dtype)))?;
        let (storage, mut offset, dtype) = (e.storage, e.offset, e.dtype);
        self.tensors.remove(name);
        for (part, r) in parts {
            self.insert_tensor(part.clone(), storage, offset, dtype, vec![*r, cols])?;
            offset += r * row_bytes;
        }
        Ok(())
    }

    /// Replaces the matrix `name` by a copy (owned) whose row `i` is its row `order[i]`;
    /// `order` must be a permutation of its rows. Quantized rows move whole.
    pub(crate) fn permute_rows(&mut self, name: &str, order: &[usize]) -> Result<(), GpuError> {
        let bad = |reason: String| GpuError::BadTensor {
            tensor: name.to_string(),
            reason,
        };
        let t = self.get(name)?;
        let [rows, cols] = t.shape[..] else {
            return Err(bad(format!("shape {:?} is not a matrix", t.shape)));
        };
        let mut seen = vec![false; rows];
        for &o in order {
            if o >= rows || std::mem::replace(&mut seen[o], true) {
                return Err(bad(format!(
                    "row order {o} is not a permutation of {rows} rows"
                )));
            }
        }
        if order.len() != rows {
            return Err(bad(format!(
                "{} rows ordered, the matrix has {rows}",
                order.len()
            )));
        }
        let row_bytes = t
            .dtype
            .row_bytes(cols)
            .ok_or_else(|| bad(format!("rows of {cols} {} values", t.dtype)))?;
        let mut data = Vec::with_capacity(t.data.len());
        for &o in order {
            data.extend_from_slice(&t.data[o * row_bytes..(o + 1) * row_bytes]);
        }
        let (dtype, shape) = (t.dtype, t.shape.clone());
        self.tensors.remove(name);
        self.insert_owned(name, dtype, shape, data)
    }

    /// The tensor called `name`; the error names the tensor when it is missing.
    pub fn get(&self, name: &str) -> Result<TensorView<'_>, GpuError> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| GpuError::TensorNotFound(name.to_string()))?;
        let data = self
            .storages
            .get(e.storage)
            .and_then(|s| s.bytes().get(e.offset..e.offset + e.len))
            .ok_or_else(|| GpuError::BadTensor {
                tensor: name.to_string(),
                reason: "data out of bounds".into(),
            })?;
        Ok(TensorView {
            dtype: e.dtype,
            shape: e.shape.clone(),
            data,
        })
    }

    /// Whether a tensor called `name` exists.
    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Names of all tensors, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|e| e.len).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_bytes_checks_blocks_and_overflow() {
        assert_eq!(DType::Q4_1.tensor_bytes(&[3, 64]), Some(3 * 2 * 20));
        assert_eq!(DType::F16.tensor_bytes(&[5]), Some(10));
        assert_eq!(DType::Q8_0.tensor_bytes(&[2, 33]), None);
        assert_eq!(DType::F32.tensor_bytes(&[usize::MAX, 2]), None);
    }

    /// A fused matrix splits into bands of rows that view its bytes; rows that do not add up
    /// are refused and leave it as it was.
    #[test]
    fn split_rows_views_bands_of_a_matrix() {
        let mut w = ModelWeights::new();
        let data: Vec<u8> = (0..6 * 4 * 2).map(|b| b as u8).collect();
        w.insert_owned("qkv", DType::F16, vec![6, 4], data.clone())
            .unwrap();
        let parts = |r: [usize; 3]| {
            vec![
                ("q".to_string(), r[0]),
                ("k".to_string(), r[1]),
                ("v".to_string(), r[2]),
            ]
        };
        let e = w
            .split_rows("qkv", &parts([2, 2, 1]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("6 rows, expected 5"), "{e}");
        assert!(w.contains("qkv") && !w.contains("q"));
        w.split_rows("qkv", &parts([2, 3, 1])).unwrap();
        assert!(!w.contains("qkv"));
        let k = w.get("k").unwrap();
        assert_eq!((k.shape.as_slice(), k.data), (&[3, 4][..], &data[16..40]));
        assert_eq!(w.get("v").unwrap().data, &data[40..]);
        assert!(w.split_rows("missing", &parts([1, 1, 1])).is_err());
        // Quantized rows split the same way: 32 values of Q8_0 are one 34-byte block.
        let data: Vec<u8> = (0..3 * 34).map(|b| b as u8).collect();
        w.insert_owned("fused", DType::Q8_0, vec![3, 32], data.clone())
            .unwrap();
        w.split_rows("fused", &[("gate".into(), 1), ("up".into(), 2)])
            .unwrap();
        assert_eq!(w.get("gate").unwrap().data, &data[..34]);
        assert_eq!(w.get("up").unwrap().data, &data[34..]);
    }

    #[test]
    fn get_reports_missing_tensor_by_name() {
        let mut w = ModelWeights::new();
        w.insert_owned("a", DType::F32, vec![2], vec![0; 8])
            .unwrap();
        assert!(w.contains("a"));
        assert_eq!(w.get("a").unwrap().data.len(), 8);
        let err = w.get("blk.0.attn_q.weight").unwrap_err().to_string();
        assert!(err.contains("blk.0.attn_q.weight"), "{err}");
        assert!(w
            .insert_owned("b", DType::F32, vec![3], vec![0; 8])
            .is_err());
        assert!(w
            .insert_owned("a", DType::F32, vec![2], vec![0; 8])
            .is_err());
    }
}
