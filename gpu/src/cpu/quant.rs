//! Weight and activation formats of the CPU backend's integer matrix multiply.
//!
//! The arithmetic follows llama.cpp's `vec_dot_q4_1_q8_1` idea: weights stay 4- or 8-bit, the
//! activations are quantized per 32-value block to int8 with a scale (and a block sum), and the
//! products are integer dot products. The memory layout is our own, chosen for the AVX-512
//! VNNI instruction `vpdpbusd` (unsigned bytes times signed bytes, four products summed into
//! each 32-bit lane):
//!
//! * Every quantized weight format is rewritten at load time into one affine form,
//!   `w = d * q + m` with `q` an **unsigned** byte: Q4_1 as is, Q4_0 with `m = -8 d`, Q4_K's
//!   32-value sub-blocks with `d * sc` and `-dmin * m` rounded to `f16`, Q8_0 with
//!   `q = w + 128` (whose `128 * sum(x)` is subtracted in integers, so Q8_0 stays exact) and
//!   Q5_0 likewise (`q = w / d + 128`). The types whose scales cover 16 values (Q2_K, Q3_K,
//!   Q6_K) or whose quants have five bits and an offset (Q5_1, Q5_K) keep bytes `v + 128` with
//!   a scale and an offset per 16 values ([`QPacking::Byte16`]; the activations carry the sum
//!   of each block's first 16 quants for them), so no type is requantized.
//! * Rows are **interleaved by 16**: for a group of 16 rows and one 32-value block, 32-bit lane
//!   `i` of a vector holds four consecutive quants of row `i`. One `vpdpbusd` against four
//!   activation bytes broadcast to all lanes advances 16 rows at once, eight of them finish a
//!   block, and the 16 per-row block sums come out in 16 lanes: they are scaled by the 16 row
//!   scales (one vector load, scales and offsets are stored interleaved the same way) and
//!   accumulated in `f32` lanes that end up as 16 consecutive outputs, with no horizontal
//!   reduction anywhere. Unpacking the 4-bit quants (one mask, one shift per 64 bytes) is paid
//!   once per block and shared by all tokens of a batch tile.
//! * Floating-point weights (F32, F16, BF16: safetensors checkpoints) are kept as `f32` and
//!   multiplied in `f32`.
//!
//! Why this is the fastest of the representations we considered: dequantizing to `f32` costs
//! 4-8x the memory traffic (decode is bandwidth-bound) and 4x the multiply instructions;
//! keeping ggml's blocks per row needs a horizontal reduction per row and block, which costs
//! more than the dot product itself at 32 values per block.

use half::f16;
use rayon::prelude::*;

use super::matmul::Isa;
use crate::error::GpuError;
use crate::model::quant_blocks::{
    five_bit_quants, q2_k_sub_blocks, q3_k_sub_blocks, q4_k_sub_blocks, q5_k_sub_blocks,
    q6_k_sub_blocks, BlockQ4_0, BlockQ4_1, BlockQ8_0, QK,
};
use crate::model::tensor::{DType, TensorView};

/// Rows interleaved together (the lanes of a 512-bit vector of `i32`).
pub const ROW_GROUP: usize = 16;

/// How the unsigned quants of a [`QMatrix`] are packed.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum QPacking {
    /// 4-bit quants (from Q4_0, Q4_1 and Q4_K): in each 64-byte vector, byte `j` of lane `i` holds
    /// value `4k + j` of row `i` in its low nibble and value `16 + 4k + j` in its high nibble,
    /// for vectors `k = 0..4`.
    Nibble,
    /// 8-bit quants `w / d + 128` (from Q8_0 and Q5_0): byte `j` of lane `i` of vector
    /// `k = 0..8` is value `4k + j` of row `i`.
    Byte,
    /// 8-bit quants `v + 128` laid out as [`QPacking::Byte`]'s, with a scale and an offset per
    /// 16 values, `w = d * v + m` (from the K-quants other than Q4_K, whose scales are per 16
    /// values or whose quants have five bits, and Q5_1).
    Byte16,
}

impl QPacking {
    /// Bytes of packed quants per block of 16 interleaved rows.
    pub const fn group_block_bytes(self) -> usize {
        match self {
            QPacking::Nibble => 256,
            QPacking::Byte | QPacking::Byte16 => 512,
        }
    }

    /// Scales (and offsets) per row and 32-value block.
    pub const fn scales_per_block(self) -> usize {
        match self {
            QPacking::Byte16 => 2,
            QPacking::Nibble | QPacking::Byte => 1,
        }
    }
}

/// A block-quantized weight matrix `[rows, cols]` in the interleaved affine layout described
/// in the module documentation.
#[derive(Clone, Debug)]
pub struct QMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features (a multiple of 32).
    pub cols: usize,
    /// Blocks per row (`cols / 32`).
    pub blocks: usize,
    /// Packing of the quants.
    pub packing: QPacking,
    /// Packed unsigned quants, `[row group][block][packing.group_block_bytes()]`; rows are
    /// padded to a whole group with zeros.
    pub qs: Vec<u8>,
    /// Scales, `[row group][block][packing.scales_per_block()][16 rows]`, in half precision
    /// as in the file (they are a fifth of the bytes that decode streams; one conversion
    /// instruction loads 16).
    pub d: Vec<f16>,
    /// Offsets, laid out as `d` (zero for Q8_0, whose offset is applied in integers).
    pub m: Vec<f16>,
}

/// A floating-point weight matrix `[rows, cols]`, row-major `f32`.
#[derive(Clone, Debug)]
pub struct FMatrix {
    /// Output features.
    pub rows: usize,
    /// Input features.
    pub cols: usize,
    /// Row-major values.
    pub w: Vec<f32>,
}

/// A weight matrix in whichever representation the kernels use for its file type.
#[derive(Clone, Debug)]
pub enum Weight {
    /// Integer-dot-product weights (every quantized type in the file).
    Quant(QMatrix),
    /// `f32` weights (F32, F16, BF16 in the file).
    Float(FMatrix),
}

impl Weight {
    /// Converts a stored 2-D tensor `[rows, cols]` into the kernel representation.
    pub fn from_view(name: &str, view: &TensorView<'_>) -> Result<Self, GpuError> {
        let (rows, cols) = match view.shape.as_slice() {
            [r, c] => (*r, *c),
            other => {
                return Err(GpuError::BadTensor {
                    tensor: name.to_string(),
                    reason: format!("expected a matrix, got shape {other:?}"),
                })
            }
        };
        if view.dtype.tensor_bytes(&view.shape) != Some(view.data.len()) || rows == 0 || cols == 0 {
            return Err(GpuError::BadTensor {
                tensor: name.to_string(),
                reason: format!(
                    "{} bytes do not hold {:?} {}",
                    view.data.len(),
                    view.shape,
                    view.dtype
                ),
            });
        }
        Ok(match view.dtype {
            DType::F32 | DType::F16 | DType::BF16 => Weight::Float(FMatrix {
                rows,
                cols,
                w: crate::model::dequant::to_f32(view.dtype, view.data),
            }),
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K => Weight::Quant(QMatrix::from_blocks(view.dtype, rows, cols, view.data)),
        })
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        match self {
            Weight::Quant(q) => q.rows,
            Weight::Float(f) => f.rows,
        }
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        match self {
            Weight::Quant(q) => q.cols,
            Weight::Float(f) => f.cols,
        }
    }

    /// Dequantizes row `r` into `out` (`cols` values); used for embedding lookups.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self {
            Weight::Float(f) => {
                let cols = f.cols.min(out.len());
                out[..cols].copy_from_slice(&f.w[r * f.cols..r * f.cols + cols]);
            }
            Weight::Quant(q) => q.row_f32(r, out),
        }
    }
}

/// Calls `f(b, q, dm)` for each 32-value block `b` of one row of `dtype` blocks (`row`, whole
/// blocks) in the form of `dtype`'s [`QPacking`]: unsigned quants `q`, and scale and offset
/// `dm[h] = (d, m)` of values `16 h..16 h + 16` (the same for both halves unless the packing is
/// [`QPacking::Byte16`]), the value being `d * q + m` (Nibble), `d * (q - 128)` (Byte, `m`
/// zero) or `d * (q - 128) + m` (Byte16). Exact for Q4_0 (`m = -8 d`), Q4_1, Q8_0, Q5_0
/// (`q + 112`) and Q5_1; the K-quants' sub-block scales (`d * sc`) and offsets (`-dmin * m`)
/// are rounded to `f16` (relative error at most 2^-11, or 2^-25 absolute below f16's normal
/// range: Q6_K's `d` is often subnormal).
fn affine_blocks(dtype: DType, row: &[u8], mut f: impl FnMut(usize, &[u8; QK], [(f16, f16); 2])) {
    let bb = dtype.block_bytes();
    let mut q = [0u8; QK];
    let h = f16::from_f32;
    for (i, bytes) in row.chunks_exact(bb).enumerate() {
        match dtype {
            DType::Q4_1 => {
                let mut b = [0u8; 20];
                b.copy_from_slice(bytes);
                let blk = BlockQ4_1::from_bytes(&b);
                unpack_nibbles(&blk.qs, &mut q);
                f(i, &q, [(blk.d, blk.m); 2]);
            }
            DType::Q4_0 => {
                let mut b = [0u8; 18];
                b.copy_from_slice(bytes);
                let blk = BlockQ4_0::from_bytes(&b);
                unpack_nibbles(&blk.qs, &mut q);
                f(i, &q, [(blk.d, -(blk.d * f16::from_f32(8.0))); 2]);
            }
            DType::Q5_0 => {
                // d * (q - 16) = d * ((q + 112) - 128): Q8_0's form, exactly.
                for (o, v) in q.iter_mut().zip(five_bit_quants(&bytes[2..6], &bytes[6..])) {
                    *o = v + 112;
                }
                f(
                    i,
                    &q,
                    [(f16::from_le_bytes([bytes[0], bytes[1]]), f16::ZERO); 2],
                );
            }
            DType::Q5_1 => {
                for (o, v) in q.iter_mut().zip(five_bit_quants(&bytes[4..8], &bytes[8..])) {
                    *o = v + 128;
                }
                let d = f16::from_le_bytes([bytes[0], bytes[1]]);
                let m = f16::from_le_bytes([bytes[2], bytes[3]]);
                f(i, &q, [(d, m); 2]);
            }
            DType::Q4K => {
                let mut b = [0u8; 144];
                b.copy_from_slice(bytes);
                q4_k_sub_blocks(&b, |j, d, m, q| f(8 * i + j, q, [(h(d), h(-m)); 2]));
            }
            DType::Q5K => {
                let mut b = [0u8; 176];
                b.copy_from_slice(bytes);
                q5_k_sub_blocks(&b, |j, d, m, src| {
                    for (o, &v) in q.iter_mut().zip(src) {
                        *o = v + 128;
                    }
                    f(8 * i + j, &q, [(h(d), h(-m)); 2]);
                });
            }
            DType::Q6K | DType::Q3K | DType::Q2K => {
                // Sixteen sub-blocks of 16 values: two to a 32-value block.
                let mut dm = [(f16::ZERO, f16::ZERO); 2];
                let mut put = |j: usize, q16: [u8; 16], d: f32, m: f32| {
                    q[16 * (j % 2)..16 * (j % 2) + 16].copy_from_slice(&q16);
                    dm[j % 2] = (h(d), h(m));
                    if j % 2 == 1 {
                        f(8 * i + j / 2, &q, dm);
                    }
                };
                let signed = |v: &[i8; 16]| v.map(|v| (i16::from(v) + 128) as u8);
                match dtype {
                    DType::Q6K => {
                        let mut b = [0u8; 210];
                        b.copy_from_slice(bytes);
                        q6_k_sub_blocks(&b, |j, d, v| put(j, signed(v), d, 0.0));
                    }
                    DType::Q3K => {
                        let mut b = [0u8; 110];
                        b.copy_from_slice(bytes);
                        q3_k_sub_blocks(&b, |j, d, v| put(j, signed(v), d, 0.0));
                    }
                    _ => {
                        let mut b = [0u8; 84];
                        b.copy_from_slice(bytes);
                        q2_k_sub_blocks(&b, |j, d, m, v| put(j, v.map(|v| v + 128), d, -m));
                    }
                }
            }
            _ => {
                let mut b = [0u8; 34];
                b.copy_from_slice(bytes);
                let blk = BlockQ8_0::from_bytes(&b);
                for (o, &v) in q.iter_mut().zip(&blk.qs) {
                    *o = (i16::from(v) + 128) as u8;
                }
                f(i, &q, [(blk.d, f16::ZERO); 2]);
            }
        }
    }
}

fn unpack_nibbles(qs: &[u8; QK / 2], q: &mut [u8; QK]) {
    for (j, &b) in qs.iter().enumerate() {
        q[j] = b & 0x0f;
        q[j + QK / 2] = b >> 4;
    }
}

impl QMatrix {
    /// Whether the buffers hold the layout `rows`, `cols`, `blocks` and `packing` describe
    /// (the kernels read them through raw pointers on that promise; the fields are public).
    pub fn is_consistent(&self) -> bool {
        let groups = self.rows.div_ceil(ROW_GROUP);
        let scales = groups * self.blocks * self.packing.scales_per_block() * ROW_GROUP;
        self.blocks * QK == self.cols
            && self.qs.len() == groups * self.blocks * self.packing.group_block_bytes()
            && self.d.len() == scales
            && self.m.len() == scales
    }

    /// Repacks `rows * cols` values of ggml blocks (`data` validated by the caller against
    /// shape and type) into the interleaved layout.
    fn from_blocks(dtype: DType, rows: usize, cols: usize, data: &[u8]) -> Self {
        let packing = match dtype {
            DType::Q8_0 | DType::Q5_0 => QPacking::Byte,
            DType::Q4_0 | DType::Q4_1 | DType::Q4K => QPacking::Nibble,
            _ => QPacking::Byte16,
        };
        let blocks = cols / QK;
        let groups = rows.div_ceil(ROW_GROUP);
        let gbb = packing.group_block_bytes();
        let halves = packing.scales_per_block();
        let mut qs = vec![0u8; groups * blocks * gbb];
        let mut d = vec![f16::ZERO; groups * blocks * halves * ROW_GROUP];
        let mut m = vec![f16::ZERO; groups * blocks * halves * ROW_GROUP];
        let row_bytes = data.len() / rows.max(1);
        // One task per group of 16 rows: each writes only its group's quants and scales.
        let per_group = blocks * halves * ROW_GROUP;
        qs.par_chunks_mut(blocks * gbb)
            .zip(d.par_chunks_mut(per_group))
            .zip(m.par_chunks_mut(per_group))
            .zip(data.par_chunks(ROW_GROUP * row_bytes))
            .for_each(|(((qs, d), m), group)| {
                for (lane, row) in group.chunks_exact(row_bytes).enumerate() {
                    affine_blocks(dtype, row, |b, q, dm| {
                        for (h, &(bd, bm)) in dm.iter().take(halves).enumerate() {
                            d[(b * halves + h) * ROW_GROUP + lane] = bd;
                            m[(b * halves + h) * ROW_GROUP + lane] = bm;
                        }
                        Self::pack(packing, lane, q, &mut qs[b * gbb..(b + 1) * gbb]);
                    });
                }
            });
        QMatrix {
            rows,
            cols,
            blocks,
            packing,
            qs,
            d,
            m,
        }
    }

    /// Writes the 32 quants `q` of `lane` into its bytes of a group block `dst` (at
    /// [`QMatrix::position`], four bytes per vector at a time).
    #[inline]
    fn pack(packing: QPacking, lane: usize, q: &[u8; QK], dst: &mut [u8]) {
        let vectors = match packing {
            QPacking::Nibble => 4,
            QPacking::Byte | QPacking::Byte16 => 8,
        };
        for (k, out) in dst.chunks_exact_mut(64).take(vectors).enumerate() {
            let out = &mut out[4 * lane..4 * lane + 4];
            for (j, o) in out.iter_mut().enumerate() {
                *o = match packing {
                    QPacking::Nibble => q[4 * k + j] | (q[16 + 4 * k + j] << 4),
                    QPacking::Byte | QPacking::Byte16 => q[4 * k + j],
                };
            }
        }
    }

    /// Byte offset inside a group block, and bit shift, of value `v` (0..32) of `lane`.
    #[inline]
    fn position(packing: QPacking, lane: usize, v: usize) -> (usize, u32) {
        match packing {
            QPacking::Nibble => {
                let (k, j) = ((v % 16) / 4, v % 4);
                (k * 64 + lane * 4 + j, if v < 16 { 0 } else { 4 })
            }
            QPacking::Byte | QPacking::Byte16 => ((v / 4) * 64 + lane * 4 + v % 4, 0),
        }
    }

    /// Unsigned quant of column `i` of row `r`.
    #[inline]
    pub fn quant(&self, r: usize, i: usize) -> u8 {
        let gb = (r / ROW_GROUP) * self.blocks + i / QK;
        let (byte, shift) = Self::position(self.packing, r % ROW_GROUP, i % QK);
        let v = self.qs[gb * self.packing.group_block_bytes() + byte] >> shift;
        match self.packing {
            QPacking::Nibble => v & 0x0f,
            QPacking::Byte | QPacking::Byte16 => v,
        }
    }

    /// Scale and offset of column `i` of row `r` (those of its block, or with
    /// [`QPacking::Byte16`] of its half-block).
    #[inline]
    pub fn scale(&self, r: usize, i: usize) -> (f32, f32) {
        let halves = self.packing.scales_per_block();
        let gb = (r / ROW_GROUP) * self.blocks + i / QK;
        let h = if halves == 2 { (i % QK) / 16 } else { 0 };
        let at = (gb * halves + h) * ROW_GROUP + r % ROW_GROUP;
        (self.d[at].to_f32(), self.m[at].to_f32())
    }

    /// Dequantizes row `r` into `out` (up to `cols` values).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        for (i, o) in out.iter_mut().enumerate().take(self.cols) {
            let (d, m) = self.scale(r, i);
            let q = f32::from(self.quant(r, i));
            *o = match self.packing {
                QPacking::Nibble => d * q + m,
                QPacking::Byte => d * (q - 128.0),
                QPacking::Byte16 => d * (q - 128.0) + m,
            };
        }
    }

    /// Bytes of memory held.
    pub fn bytes(&self) -> usize {
        self.qs.len() + 2 * (self.d.len() + self.m.len())
    }
}

/// A batch of activation rows quantized to int8 per 32-value block (Q8 with block sums).
#[derive(Clone, Debug, Default)]
pub struct QActs {
    /// Number of rows (tokens).
    pub tokens: usize,
    /// Blocks per row (`cols` rounded up to 32, zero-padded).
    pub blocks: usize,
    /// Quants, `tokens * blocks * 32`.
    pub qs: Vec<i8>,
    /// Scale per block, `tokens * blocks`.
    pub d: Vec<f32>,
    /// `d * sum(quants)` per block, `tokens * blocks`.
    pub s: Vec<f32>,
    /// `sum(quants)` per block, `tokens * blocks`.
    pub qsum: Vec<i32>,
    /// `sum(quants)` of the first 16 values of each block, `tokens * blocks` (for
    /// [`QPacking::Byte16`] weights, whose halves have their own scales and offsets).
    pub qsum_lo: Vec<i32>,
}

impl QActs {
    /// Whether the buffers hold `tokens` rows of `blocks` blocks (the kernels read them
    /// through raw pointers on that promise; the fields are public).
    pub fn is_consistent(&self) -> bool {
        let n = self.tokens * self.blocks;
        self.qs.len() == n * QK
            && [
                self.d.len(),
                self.s.len(),
                self.qsum.len(),
                self.qsum_lo.len(),
            ]
            .iter()
            .all(|&l| l == n)
    }

    /// Quantizes `tokens` rows of `cols` values (`x.len() == tokens * cols`).
    pub fn quantize(x: &[f32], tokens: usize, cols: usize) -> Self {
        let mut a = QActs::default();
        a.quantize_into(x, tokens, cols);
        a
    }

    /// Like [`QActs::quantize`], reusing this value's buffers.
    pub fn quantize_into(&mut self, x: &[f32], tokens: usize, cols: usize) {
        let nb = self.reset(tokens, cols);
        if cols == 0 {
            return;
        }
        let rows = x
            .par_chunks(cols)
            .zip(self.qs.par_chunks_mut(nb * QK))
            .zip(self.d.par_chunks_mut(nb))
            .zip(self.s.par_chunks_mut(nb))
            .zip(self.qsum.par_chunks_mut(nb))
            .zip(self.qsum_lo.par_chunks_mut(nb));
        let isa = Isa::detect();
        // Small batches are not worth waking the other workers for.
        rows.with_min_len(16)
            .for_each(|(((((x, q), d), s), n), lo)| {
                quantize_row_isa(isa, x, q, d, s, n);
                low_half_sums(q, lo);
            });
    }

    /// Sizes the buffers for `tokens` rows of `cols` values (every quant and scale is then
    /// written by the quantizer; the padding of a partial last block stays zero) and returns
    /// the blocks per row.
    fn reset(&mut self, tokens: usize, cols: usize) -> usize {
        let nb = cols.div_ceil(QK);
        self.tokens = tokens;
        self.blocks = nb;
        self.qs.clear();
        self.qs.resize(tokens * nb * QK, 0);
        self.d.resize(tokens * nb, 0.0);
        self.s.resize(tokens * nb, 0.0);
        self.qsum.resize(tokens * nb, 0);
        self.qsum_lo.resize(tokens * nb, 0);
        nb
    }
}

impl QActs {
    /// Quantizes `tokens` rows of `cols` values to `2 * tokens` rows: row `2t` is the int8
    /// quantization of row `t` of `x`, row `2t + 1` the int8 quantization of what row `2t`
    /// missed. The sum of a matrix's products with the two rows is its product with `x` to
    /// about 15 bits, at the cost of one more token per token (the weights, loaded once per
    /// tile, are shared). `scratch` receives the two rows in `f32` (`2 * tokens * cols`: the
    /// dequantized first level, then the residual), for weights that take `f32` inputs.
    pub fn quantize_residual_into(
        &mut self,
        x: &[f32],
        tokens: usize,
        cols: usize,
        scratch: &mut Vec<f32>,
    ) {
        scratch.clear();
        scratch.resize(2 * tokens * cols, 0.0);
        let nb = self.reset(2 * tokens, cols);
        if cols == 0 {
            return;
        }
        let rows = x
            .par_chunks(cols)
            .zip(scratch.par_chunks_mut(2 * cols))
            .zip(self.qs.par_chunks_mut(2 * nb * QK))
            .zip(self.d.par_chunks_mut(2 * nb))
            .zip(self.s.par_chunks_mut(2 * nb))
            .zip(self.qsum.par_chunks_mut(2 * nb))
            .zip(self.qsum_lo.par_chunks_mut(2 * nb));
        let isa = Isa::detect();
        // Small batches are not worth waking the other workers for (as `quantize_into`).
        rows.with_min_len(8)
            .for_each(|((((((x, f), q), d), s), n), sums_lo)| {
                let (q0, q1) = q.split_at_mut(nb * QK);
                let (d0, d1) = d.split_at_mut(nb);
                let (s0, s1) = s.split_at_mut(nb);
                let (n0, n1) = n.split_at_mut(nb);
                quantize_row_isa(isa, x, q0, d0, s0, n0);
                let (hi, lo) = f.split_at_mut(cols);
                let blocks = hi.chunks_mut(QK).zip(lo.chunks_mut(QK)).zip(x.chunks(QK));
                for (((hb, lb), xb), (qb, &db)) in blocks.zip(q0.chunks_exact(QK).zip(&*d0)) {
                    for (((h, l), &v), &qv) in hb.iter_mut().zip(lb.iter_mut()).zip(xb).zip(qb) {
                        *h = db * f32::from(qv);
                        *l = v - *h;
                    }
                }
                quantize_row_isa(isa, lo, q1, d1, s1, n1);
                low_half_sums(q, sums_lo);
            });
    }
}

/// `sum(quants)` of the first 16 values of each 32-value block of `q`, into `lo`.
fn low_half_sums(q: &[i8], lo: &mut [i32]) {
    for (b, o) in q.chunks_exact(QK).zip(lo) {
        *o = b[..16].iter().map(|&v| i32::from(v)).sum();
    }
}

/// Quantizes one row (see [`QActs`]) with the kernel of `isa` (one that [`Isa::detect`]
/// returned).
#[inline(always)]
fn quantize_row_isa(
    isa: Isa,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    n: &mut [i32],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `Isa::detect` found the features.
        Isa::Avx512Vnni => unsafe { quantize_row_avx512(x, q, d, s, n) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Isa::Avx2 => unsafe { quantize_row_avx2(x, q, d, s, n) },
        _ => quantize_row(x, q, d, s, n),
    }
}

/// `v` rounded to the nearest integer (ties to even) for |v| <= 2^22: adding 1.5 * 2^23
/// leaves the integer in the low mantissa bits, read back with integer arithmetic. Unlike
/// `f32::round` (a libm call) and `as i32` (saturating, scalar), this vectorises.
#[inline(always)]
fn round_to_i32(v: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC).to_bits() as i32 - MAGIC.to_bits() as i32
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn quantize_row_avx512(
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    n: &mut [i32],
) {
    quantize_row(x, q, d, s, n)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_row_avx2(x: &[f32], q: &mut [i8], d: &mut [f32], s: &mut [f32], n: &mut [i32]) {
    quantize_row(x, q, d, s, n)
}

/// Quantizes one row (see [`QActs`]).
#[inline(always)]
fn quantize_row(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], qsum: &mut [i32]) {
    for (b, (xb, qb)) in x.chunks(QK).zip(qs.chunks_exact_mut(QK)).enumerate() {
        // Lane-wise maxima first (vectorised), then across the lanes.
        let mut lanes = [0f32; 16];
        if let Ok(full) = <&[f32; QK]>::try_from(xb) {
            for k in 0..16 {
                lanes[k] = full[k].abs().max(full[k + 16].abs());
            }
        } else {
            for (i, v) in xb.iter().enumerate() {
                lanes[i % 16] = lanes[i % 16].max(v.abs());
            }
        }
        for w in [8, 4, 2, 1] {
            for k in 0..w {
                lanes[k] = lanes[k].max(lanes[k + w]);
            }
        }
        let amax = lanes[0];
        let scale = amax / 127.0;
        let id = if scale > 0.0 { 1.0 / scale } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            // The second clamp only matters for a NaN input.
            let r = round_to_i32((v * id).clamp(-127.0, 127.0)).clamp(-127, 127);
            *q = r as i8;
            sum += r;
        }
        d[b] = scale;
        s[b] = scale * sum as f32;
        qsum[b] = sum;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// `n` blocks of `dtype` (a 5-bit or K-quant type) of random bytes with finite, small
    /// positive super-block scales of a realistic size.
    pub(crate) fn random_blocks(dtype: DType, n: usize, seed: u64) -> Vec<u8> {
        let mut s = seed;
        let mut next = || {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 33) as u32
        };
        let bb = dtype.block_bytes();
        let mut out = Vec::with_capacity(n * bb);
        for _ in 0..n {
            let mut b: Vec<u8> = (0..bb).map(|_| next() as u8).collect();
            let mut scale = |at: usize| {
                // One block in eight with a subnormal f16 super-block scale (common for Q6_K
                // in real files), the rest between 5e-4 and 0.02.
                let r = next();
                let v = if r % 8 == 0 {
                    f16::from_f32(3e-6 * (r % 16 + 1) as f32)
                } else {
                    f16::from_f32(0.0005 * (r / 8 % 40 + 1) as f32)
                };
                b[at..at + 2].copy_from_slice(&v.to_le_bytes());
            };
            match dtype {
                DType::Q5_0 => scale(0),
                DType::Q5_1 | DType::Q4K | DType::Q5K => {
                    scale(0);
                    scale(2);
                }
                DType::Q6K | DType::Q3K => scale(bb - 2),
                DType::Q2K => {
                    scale(bb - 4);
                    scale(bb - 2);
                }
                _ => unreachable!("not a 5-bit or K-quant type"),
            }
            out.extend_from_slice(&b);
        }
        out
    }

    /// Model files are hostile input: blocks of any bytes (NaN and infinite scales included)
    /// decode and load without a panic.
    #[test]
    fn five_bit_and_k_quant_blocks_of_any_bytes_load() {
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for dtype in DType::FIVE_BIT_AND_K {
            for round in 0..50 {
                let n = 2 * 512 / dtype.block_len() * dtype.block_bytes();
                let data: Vec<u8> = (0..n)
                    .map(|_| {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        // Every fourth round all 0xff: NaN scales everywhere.
                        if round % 4 == 3 {
                            0xff
                        } else {
                            s as u8
                        }
                    })
                    .collect();
                let view = TensorView {
                    dtype,
                    shape: vec![2, 512],
                    data: &data,
                };
                assert_eq!(view.to_f32_vec().len(), 1024);
                let w = Weight::from_view("w", &view).unwrap();
                assert_eq!((w.rows(), w.cols()), (2, 512));
            }
        }
    }

    /// The 5-bit and K-quant types load in their own bits, without a detour through Q8_0:
    /// Q5_0 and Q5_1 exactly, the K-quants with each sub-block's scale and offset rounded to
    /// f16 (2^-11 relative).
    #[test]
    fn five_bit_and_k_quant_weights_load_in_their_own_bits() {
        let (rows, cols) = (19, 512);
        for dtype in DType::FIVE_BIT_AND_K {
            let packing = match dtype {
                DType::Q5_0 => QPacking::Byte,
                DType::Q4K => QPacking::Nibble,
                _ => QPacking::Byte16,
            };
            let n = rows * cols / dtype.block_len();
            let data = random_blocks(dtype, n, dtype.block_bytes() as u64);
            let view = TensorView {
                dtype,
                shape: vec![rows, cols],
                data: &data,
            };
            let Weight::Quant(q) = Weight::from_view("w", &view).unwrap() else {
                panic!("{dtype} did not load as a quantized matrix");
            };
            assert_eq!((q.rows, q.cols, q.packing), (rows, cols, packing));
            let want = view.to_f32_vec();
            let mut got = vec![0f32; cols];
            for r in 0..rows {
                q.row_f32(r, &mut got);
                let want = &want[r * cols..(r + 1) * cols];
                if matches!(dtype, DType::Q5_0 | DType::Q5_1) {
                    assert_eq!(got, want, "{dtype} row {r}");
                    continue;
                }
                for (i, (a, b)) in got.iter().zip(want).enumerate() {
                    // The rounded scale and offset move a value by at most 2^-11 of
                    // |d q| + |m| (q as the kernels take it: centred for the 8-bit packings).
                    let (d, m) = q.scale(r, i);
                    let qv = f32::from(q.quant(r, i));
                    let qv = if packing == QPacking::Nibble {
                        qv
                    } else {
                        qv - 128.0
                    };
                    // Below f16's normal range the roundings are 2^-25 absolute.
                    let bound = ((d * qv).abs() + m.abs()) / 2048.0 * 1.01
                        + (qv.abs() + 1.0) * 2f32.powi(-25);
                    assert!(
                        (a - b).abs() <= bound,
                        "{dtype} row {r} [{i}]: {a} against {b}"
                    );
                }
            }
            // The products use the same numbers as the rows.
            let x: Vec<f32> = (0..cols)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1)
                .collect();
            let a = QActs::quantize(&x, 1, cols);
            for r in 0..rows {
                let mut row = vec![0f32; cols];
                q.row_f32(r, &mut row);
                let xq: Vec<f32> = (0..cols)
                    .map(|i| a.d[i / QK] * f32::from(a.qs[i]))
                    .collect();
                let want: f32 = row.iter().zip(&xq).map(|(w, x)| w * x).sum();
                let got = crate::cpu::matmul::dot_scalar(&q, r, &a, 0);
                assert!(
                    (got - want).abs() <= 1e-3 * (1.0 + want.abs()),
                    "{dtype} row {r}"
                );
            }
        }
    }

    fn q4_1_tensor(rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let mut out = Vec::new();
        let mut s = seed;
        for _ in 0..rows * cols / QK {
            out.extend_from_slice(&f16::from_f32(0.01 * (s % 7 + 1) as f32).to_le_bytes());
            out.extend_from_slice(&f16::from_f32(-0.05).to_le_bytes());
            for _ in 0..16 {
                s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                out.push((s >> 16) as u8);
            }
        }
        out
    }

    #[test]
    fn repacked_rows_dequantize_like_ggml() {
        for (dtype, cols) in [(DType::Q4_1, 96), (DType::Q4_0, 64), (DType::Q8_0, 96)] {
            let rows = 19;
            let data = match dtype {
                DType::Q4_1 => q4_1_tensor(rows, cols, 7),
                DType::Q4_0 => q4_1_tensor(rows, cols, 9)
                    .chunks(20)
                    .flat_map(|c| [&c[..2], &c[4..]].concat())
                    .collect(),
                _ => (0..rows * cols / QK)
                    .flat_map(|i| {
                        let mut v = f16::from_f32(0.02).to_le_bytes().to_vec();
                        v.extend((0..32).map(|j| (j * 9 - 140 + i as i32) as i8 as u8));
                        v
                    })
                    .collect(),
            };
            let view = TensorView {
                dtype,
                shape: vec![rows, cols],
                data: &data,
            };
            let reference = view.to_f32_vec();
            let w = Weight::from_view("t", &view).unwrap();
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                w.row_f32(r, &mut row);
                assert_eq!(row, reference[r * cols..(r + 1) * cols], "{dtype} row {r}");
            }
        }
    }

    #[test]
    fn activation_quantization_round_trips_within_half_a_step() {
        let x: Vec<f32> = (0..80)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3)
            .collect();
        let a = QActs::quantize(&x, 1, 80);
        assert_eq!(a.blocks, 3);
        for (i, &v) in x.iter().enumerate() {
            let d = a.d[i / QK];
            let back = d * f32::from(a.qs[i]);
            assert!((back - v).abs() <= d * 0.5 + 1e-6, "{i}: {back} vs {v}");
        }
        // Padding is zero and has zero sums.
        assert!(a.qs[80..].iter().all(|&q| q == 0));
        assert_eq!(a.s[2] * 0.0, 0.0);
        assert_eq!(
            a.qsum[0],
            a.qs[..32].iter().map(|&q| i32::from(q)).sum::<i32>()
        );
        let sum0: i32 = a.qs[..32].iter().map(|&q| i32::from(q)).sum();
        assert!((a.s[0] - a.d[0] * sum0 as f32).abs() < 1e-6);
    }

    #[test]
    fn residual_rows_add_up_to_fifteen_bits() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.3 + (i as f32).sin())
            .collect();
        let mut a = QActs::default();
        let mut scratch = Vec::new();
        a.quantize_residual_into(&x, 2, 64, &mut scratch);
        assert_eq!(a.tokens, 4);
        for t in 0..2 {
            for i in 0..64 {
                let (hi, lo) = (2 * t, 2 * t + 1);
                let back = a.d[hi * 2 + i / 32] * f32::from(a.qs[hi * 64 + i])
                    + a.d[lo * 2 + i / 32] * f32::from(a.qs[lo * 64 + i]);
                // The first level's step is amax / 127; the second splits it 254 ways.
                let step = a.d[hi * 2 + i / 32];
                assert!(
                    (back - x[t * 64 + i]).abs() <= step / 254.0 + 1e-6,
                    "{t} {i}"
                );
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let data = vec![0u8; 40];
        let view = TensorView {
            dtype: DType::Q4_1,
            shape: vec![64],
            data: &data,
        };
        assert!(Weight::from_view("v", &view).is_err());
        let view = TensorView {
            dtype: DType::Q4_1,
            shape: vec![1, 96],
            data: &data,
        };
        assert!(Weight::from_view("v", &view).is_err());
    }
}
