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
