//! ggml's quantized block layouts (as written by llama.cpp's `ggml-quants`), as plain `#[repr(C)]`
//! types whose sizes are checked at compile time. Each block covers [`QK`] consecutive values
//! along a tensor's contiguous (last) dimension.

use half::f16;

/// Number of values in one quantized block (ggml's `QK4_0`, `QK4_1`, `QK8_0`).
pub const QK: usize = 32;

/// Q8_0: `x[i] = d * qs[i]`.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Signed 8-bit quants.
    pub qs: [i8; QK],
}

/// Q4_0: `x[i] = d * (q[i] - 8)`; byte `j` holds value `j` in its low nibble and value `j + 16`
/// in its high nibble.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct BlockQ4_0 {
    /// Scale.
    pub d: f16,
    /// Packed 4-bit quants.
    pub qs: [u8; QK / 2],
}

/// Q4_1: `x[i] = d * q[i] + m`; nibble packing as in [`BlockQ4_0`].
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Minimum (offset).
    pub m: f16,
    /// Packed 4-bit quants.
    pub qs: [u8; QK / 2],
}

const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() == 2);
const _: () = assert!(std::mem::align_of::<BlockQ4_1>() == 2);

impl BlockQ8_0 {
    /// Reads a block from its 34 little-endian bytes.
    pub fn from_bytes(b: &[u8; 34]) -> Self {
        let mut qs = [0i8; QK];
        for (q, &x) in qs.iter_mut().zip(&b[2..]) {
            *q = x as i8;
        }
        BlockQ8_0 {
            d: f16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }

    /// Writes the 32 dequantized values into `out`.
    pub fn dequantize(&self, out: &mut [f32; QK]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = d * f32::from(q);
        }
    }
}

impl BlockQ4_0 {
    /// Reads a block from its 18 little-endian bytes.
    pub fn from_bytes(b: &[u8; 18]) -> Self {
        let mut qs = [0u8; QK / 2];
        qs.copy_from_slice(&b[2..]);
        BlockQ4_0 {
            d: f16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }

    /// Writes the 32 dequantized values into `out`.
    pub fn dequantize(&self, out: &mut [f32; QK]) {
        let d = self.d.to_f32();
        for (j, &byte) in self.qs.iter().enumerate() {
            out[j] = d * (f32::from(byte & 0x0f) - 8.0);
            out[j + QK / 2] = d * (f32::from(byte >> 4) - 8.0);
        }
    }
}

impl BlockQ4_1 {
    /// Reads a block from its 20 little-endian bytes.
    pub fn from_bytes(b: &[u8; 20]) -> Self {
        let mut qs = [0u8; QK / 2];
        qs.copy_from_slice(&b[4..]);
        BlockQ4_1 {
            d: f16::from_le_bytes([b[0], b[1]]),
            m: f16::from_le_bytes([b[2], b[3]]),
            qs,
        }
    }

    /// Writes the 32 dequantized values into `out`.
    pub fn dequantize(&self, out: &mut [f32; QK]) {
        let d = self.d.to_f32();
        let m = self.m.to_f32();
        for (j, &byte) in self.qs.iter().enumerate() {
            out[j] = d * f32::from(byte & 0x0f) + m;
            out[j + QK / 2] = d * f32::from(byte >> 4) + m;
        }
    }
}

/// Values in one K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;

fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q5_0 (22 bytes): `x[i] = d * (q[i] - 16)` with 5-bit `q`: the low four bits packed as in
/// [`BlockQ4_0`] (bytes 6..22), the fifth bit of value `i` bit `i` of the little-endian `u32`
/// at bytes 2..6.
pub fn dequantize_q5_0(b: &[u8; 22], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    // d * q - 16 d: both products are exact (an f16 times a 5-bit integer), so the difference
    // is d * (q - 16) exactly.
    five_bit(d, -16.0 * d, &b[2..6], &b[6..], out);
}

/// Q5_1 (24 bytes): `x[i] = d * q[i] + m`, the 5-bit `q` as in [`dequantize_q5_0`] after the
/// two f16 `d` and `m`.
pub fn dequantize_q5_1(b: &[u8; 24], out: &mut [f32; QK]) {
    five_bit(f16_at(b, 0), f16_at(b, 2), &b[4..8], &b[8..], out);
}

/// `x[i] = d * q[i] + m` for the 5-bit `q` of Q5_0 / Q5_1: fifth bits `qh` (4 bytes), low
/// nibbles `qs` (16 bytes).
fn five_bit(d: f32, m: f32, qh: &[u8], qs: &[u8], out: &mut [f32; QK]) {
    for (o, q) in out.iter_mut().zip(five_bit_quants(qh, qs)) {
        *o = d * f32::from(q) + m;
    }
}

/// The 32 unsigned 5-bit quants (0..32) of a Q5_0 / Q5_1 block in value order: fifth bits `qh`
/// (4 bytes), low nibbles `qs` (16 bytes).
pub fn five_bit_quants(qh: &[u8], qs: &[u8]) -> [u8; QK] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0u8; QK];
    for (j, &byte) in qs.iter().enumerate() {
        q[j] = (byte & 0x0f) | ((((qh >> j) & 1) as u8) << 4);
        q[j + QK / 2] = (byte >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    q
}

/// Q2_K (84 bytes, 16 sub-blocks of 16 values): `x = d * sc * q - dmin * m` with 4-bit `sc`
/// (low nibble) and `m` (high nibble) per sub-block in bytes 0..16 and 2-bit `q` in bytes
/// 16..80: per half of 128 values, 32 bytes whose bit pairs 0-1, 2-3, 4-5, 6-7 hold four runs
/// of 32 values (each two sub-blocks); `d` and `dmin` are the f16 at bytes 80 and 82.
pub fn dequantize_q2_k(b: &[u8; 84], out: &mut [f32; QK_K]) {
    q2_k_sub_blocks(b, |sub, dl, ml, q| {
        for (y, &q) in out[16 * sub..16 * sub + 16].iter_mut().zip(q) {
            *y = dl * f32::from(q) - ml;
        }
    });
}

/// Calls `f(j, d * sc, dmin * m, q)` for sub-block `j` (0..16) of a Q2_K super-block: its
/// values are `d * sc * q - dmin * m` for its 16 quants `q` (0..4).
pub fn q2_k_sub_blocks(b: &[u8; 84], mut f: impl FnMut(usize, f32, f32, &[u8; 16])) {
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut q = [0u8; 16];
    for sub in 0..16 {
        let (half, run, second) = (sub / 8, (sub % 8) / 2, sub % 2);
        let sc = b[sub];
        let (dl, ml) = (d * f32::from(sc & 0x0f), dmin * f32::from(sc >> 4));
        let src = &b[16 + 32 * half + 16 * second..][..16];
        for (o, &qb) in q.iter_mut().zip(src) {
            *o = (qb >> (2 * run)) & 3;
        }
        f(sub, dl, ml, &q);
    }
}

/// Q3_K (110 bytes, 16 sub-blocks of 16): `x = d * (sc - 32) * (q - 4 h')` where `q` is 2 bits
/// laid out as Q2_K's (bytes 32..96), `h'` is 1 unless the value's bit in `hmask` (bytes 0..32:
/// bit `k` of byte `l` for value `l` (mod 32) of run `k`) is set, and the 6-bit `sc` of
/// sub-block `k` has its low four bits in the low (`k` < 8) or high nibble of byte `k mod 8`
/// of bytes 96..104 and its top two in bits `2 (k / 4)` of byte `104 + k mod 4`; `d` is the
/// f16 at bytes 108..110.
pub fn dequantize_q3_k(b: &[u8; 110], out: &mut [f32; QK_K]) {
    q3_k_sub_blocks(b, |sub, dl, v| {
        for (y, &v) in out[16 * sub..16 * sub + 16].iter_mut().zip(v) {
            *y = dl * f32::from(v);
        }
    });
}

/// Calls `f(j, d * (sc - 32), v)` for sub-block `j` (0..16) of a Q3_K super-block: its values
/// are `d * (sc - 32) * v` for its 16 signed quants `v = q - 4 h'` (-4..4).
pub fn q3_k_sub_blocks(b: &[u8; 110], mut f: impl FnMut(usize, f32, &[i8; 16])) {
    let d = f16_at(b, 108);
    let (hmask, qs, sc) = (&b[..32], &b[32..96], &b[96..108]);
    let mut v = [0i8; 16];
    for sub in 0..16 {
        let (half, run, second) = (sub / 8, (sub % 8) / 2, sub % 2);
        let lo = if sub < 8 {
            sc[sub] & 0x0f
        } else {
            sc[sub - 8] >> 4
        };
        let hi = (sc[8 + sub % 4] >> (2 * (sub / 4))) & 3;
        let dl = d * f32::from((lo | (hi << 4)) as i8 - 32);
        let q = &qs[32 * half + 16 * second..][..16];
        let h = &hmask[16 * second..][..16];
        let bit = 4 * half + run;
        for ((o, &qb), &hb) in v.iter_mut().zip(q).zip(h) {
            let minus = if hb & (1 << bit) != 0 { 0 } else { 4 };
            *o = ((qb >> (2 * run)) & 3) as i8 - minus;
        }
        f(sub, dl, &v);
    }
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K / Q5_K super-block from its
/// 12 packed bytes: sub-blocks 0..4 in the low six bits of bytes `j` and `j + 4`; 4..8 in the
/// nibbles of byte `j + 4` with their top two bits in the top bits of bytes `j - 4` and `j`.
fn k4_scale_min(s: &[u8], j: usize) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (f32::from(sc), f32::from(m))
}

/// Q4_K (144 bytes, 256 values in 8 sub-blocks of 32): `x = d * sc * q - dmin * m`, each
/// sub-block's 6-bit `sc` and `m` packed in bytes 4..16 ([`k4_scale_min`]); 4-bit `q` in bytes
/// 16..144, each 32 bytes holding two sub-blocks (low nibbles, then high nibbles).
pub fn dequantize_q4_k(b: &[u8; 144], out: &mut [f32; QK_K]) {
    k_affine(b, None, &b[16..], out);
}

/// Q5_K (176 bytes): Q4_K with a fifth bit per value: byte `l` of `qh` (bytes 16..48) holds
/// value `l`'s of sub-blocks 0..8 in bits 0..8; the 4-bit parts in bytes 48..176.
pub fn dequantize_q5_k(b: &[u8; 176], out: &mut [f32; QK_K]) {
    k_affine(b, Some(&b[16..48]), &b[48..], out);
}

/// Q4_K and (with the fifth bits `qh`) Q5_K from the super-block's `d`, `dmin` and packed
/// scales (bytes 0..16 of `b`) and the 4-bit parts `qs`.
fn k_affine(b: &[u8], qh: Option<&[u8]>, qs: &[u8], out: &mut [f32; QK_K]) {
    k_sub_blocks(b, qh, qs, |j, d, m, q| {
        for (o, &q) in out[QK * j..QK * (j + 1)].iter_mut().zip(q) {
            *o = d * f32::from(q) - m;
        }
    });
}

/// Calls `f(j, d * sc, dmin * m, q)` for sub-block `j` (0..8) of a Q4_K super-block (`b` its
/// 144 bytes): its values are `d * sc * q - dmin * m` for its 32 unsigned 4-bit quants `q`.
pub fn q4_k_sub_blocks(b: &[u8; 144], f: impl FnMut(usize, f32, f32, &[u8; QK])) {
    k_sub_blocks(b, None, &b[16..], f);
}

/// [`q4_k_sub_blocks`] for Q5_K (176 bytes): the quants `q` have five bits (0..32).
pub fn q5_k_sub_blocks(b: &[u8; 176], f: impl FnMut(usize, f32, f32, &[u8; QK])) {
    k_sub_blocks(b, Some(&b[16..48]), &b[48..], f);
}

/// [`q4_k_sub_blocks`] for Q4_K and (with the fifth bits `qh`) Q5_K: `b` starts with the
/// super-block's `d`, `dmin` and packed scales, `qs` holds the 4-bit parts.
fn k_sub_blocks(
    b: &[u8],
    qh: Option<&[u8]>,
    qs: &[u8],
    mut f: impl FnMut(usize, f32, f32, &[u8; QK]),
) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let mut q = [0u8; QK];
    for j in 0..QK_K / QK {
        let (sc, m) = k4_scale_min(scales, j);
        // Sub-blocks 2p and 2p + 1 share the 32 bytes of pair p: low nibbles, then high.
        let (pair, high) = (j / 2, j % 2 == 1);
        for (l, (o, &byte)) in q.iter_mut().zip(&qs[32 * pair..32 * pair + 32]).enumerate() {
            let low4 = if high { byte >> 4 } else { byte & 0x0f };
            let fifth = qh.map_or(0, |h| ((h[l] >> j) & 1) << 4);
            *o = low4 | fifth;
        }
        f(j, d * sc, dmin * m, &q);
    }
}

/// Q6_K (210 bytes, 16 sub-blocks of 16 values): `x = d * sc * (q - 32)` with signed 8-bit
/// `sc` (bytes 192..208) and 6-bit `q`: per half of 128 values, the low four bits in 64 bytes
/// of `ql` (bytes 0..128; values 0..32 and 64..96 of the half in the low and high nibbles of
/// its first 32 bytes, 32..64 and 96..128 in those of the next 32) and the top two in 32 bytes
/// of `qh` (bytes 128..192; value `l`, `l + 32`, `l + 64`, `l + 96` in bits 0-1, 2-3, 4-5, 6-7
/// of byte `l`); `d` is the f16 at bytes 208..210.
pub fn dequantize_q6_k(b: &[u8; 210], out: &mut [f32; QK_K]) {
    q6_k_sub_blocks(b, |sub, dl, v| {
        for (y, &v) in out[16 * sub..16 * sub + 16].iter_mut().zip(v) {
            *y = dl * f32::from(v);
        }
    });
}

/// Calls `f(j, d * sc, v)` for sub-block `j` (0..16) of a Q6_K super-block: its values are
/// `d * sc * v` for its 16 signed quants `v = q - 32` (-32..32); `sc` is byte `192 + j`.
pub fn q6_k_sub_blocks(b: &[u8; 210], mut f: impl FnMut(usize, f32, &[i8; 16])) {
    let d = f16_at(b, 208);
    let mut v = [0i8; QK_K];
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let o = &mut v[128 * half..128 * half + 128];
        for l in 0..32 {
            let q = [
                (ql[l] & 0x0f) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &qk) in q.iter().enumerate() {
                o[l + 32 * k] = qk as i8 - 32;
            }
        }
    }
    for (sub, chunk) in v.chunks_exact(16).enumerate() {
        let mut c = [0i8; 16];
        c.copy_from_slice(chunk);
        f(sub, d * f32::from(b[192 + sub] as i8), &c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_1_dequantizes_low_nibbles_first() {
        let mut b = [0u8; 20];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b[4] = 0x3a; // value 0 = 0xa, value 16 = 0x3
        let mut out = [0f32; QK];
        BlockQ4_1::from_bytes(&b).dequantize(&mut out);
        assert_eq!(out[0], 0.5 * 10.0 - 1.0);
        assert_eq!(out[16], 0.5 * 3.0 - 1.0);
        assert_eq!(out[1], -1.0);
    }

    #[test]
    fn q4_0_is_offset_by_eight() {
        let mut b = [0u8; 18];
        b[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b[2] = 0xf0;
        let mut out = [0f32; QK];
        BlockQ4_0::from_bytes(&b).dequantize(&mut out);
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
    }

    #[test]
    fn q8_0_is_signed() {
        let mut b = [0u8; 34];
        b[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        b[2] = 0xff;
        b[3] = 4;
        let mut out = [0f32; QK];
        BlockQ8_0::from_bytes(&b).dequantize(&mut out);
        assert_eq!(out[0], -0.25);
        assert_eq!(out[1], 1.0);
    }
}
