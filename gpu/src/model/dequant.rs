//! Conversion of stored tensors (float or ggml block-quantized) to `f32`.

use half::{bf16, f16};

use super::quant_blocks::{
    dequantize_q2_k, dequantize_q3_k, dequantize_q4_k, dequantize_q5_0, dequantize_q5_1,
    dequantize_q5_k, dequantize_q6_k, BlockQ4_0, BlockQ4_1, BlockQ8_0,
};
use rayon::prelude::*;

use super::tensor::DType;

/// Converts `data` of type `dtype` to `f32` values. Trailing bytes that do not form a whole
/// element or block are ignored (views are length-checked when they are created). Large
/// tensors are converted in parallel.
pub fn to_f32(dtype: DType, data: &[u8]) -> Vec<f32> {
    let (bb, bl) = (dtype.block_bytes(), dtype.block_len());
    let n_blocks = data.len() / bb;
    let mut out = vec![0f32; n_blocks * bl];
    // 64 Ki values per task: large enough to amortise the task, small enough to spread one
    // matrix over every core.
    let per_task = (1 << 16) / bl;
    out.par_chunks_mut(per_task * bl)
        .zip(data[..n_blocks * bb].par_chunks(per_task * bb))
        .for_each(|(out, data)| convert(dtype, data, out));
    out
}

/// [`to_f32`] of whole elements or blocks `data` into `out` (exactly their values' length).
fn convert(dtype: DType, data: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        DType::Q8_0 => blocks(data, out, |b, o| BlockQ8_0::from_bytes(b).dequantize(o)),
        DType::Q4_0 => blocks(data, out, |b, o| BlockQ4_0::from_bytes(b).dequantize(o)),
        DType::Q4_1 => blocks(data, out, |b, o| BlockQ4_1::from_bytes(b).dequantize(o)),
        DType::Q5_0 => blocks(data, out, dequantize_q5_0),
        DType::Q5_1 => blocks(data, out, dequantize_q5_1),
        DType::Q2K => blocks(data, out, dequantize_q2_k),
        DType::Q3K => blocks(data, out, dequantize_q3_k),
        DType::Q4K => blocks(data, out, dequantize_q4_k),
        DType::Q5K => blocks(data, out, dequantize_q5_k),
        DType::Q6K => blocks(data, out, dequantize_q6_k),
    }
}

/// Writes the values of each whole `B`-byte block of `data` (`N` values each) into `out`.
fn blocks<const B: usize, const N: usize>(
    data: &[u8],
    out: &mut [f32],
    dequantize: fn(&[u8; B], &mut [f32; N]),
) {
    for (c, o) in data.chunks_exact(B).zip(out.chunks_exact_mut(N)) {
        if let (Ok(b), Ok(o)) = (<&[u8; B]>::try_from(c), <&mut [f32; N]>::try_from(o)) {
            dequantize(b, o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tensors longer than one task (64 Ki values) convert as their blocks one by one do,
    /// trailing bytes ignored.
    #[test]
    fn parallel_conversion_matches_block_by_block() {
        let mut s = 7u32;
        let mut data: Vec<u8> = (0..(3 << 16) / 32 * 34 + 5)
            .map(|_| {
                s = s.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                (s >> 16) as u8
            })
            .collect();
        // Finite Q8_0 scales: the f16 at the start of every 34-byte block.
        for b in data.chunks_exact_mut(34) {
            b[..2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        }
        let got = to_f32(DType::Q8_0, &data);
        assert_eq!(got.len(), 3 << 16);
        let mut want = Vec::with_capacity(got.len());
        for c in data.chunks_exact(34) {
            let mut out = [0f32; 32];
            BlockQ8_0::from_bytes(c.try_into().unwrap()).dequantize(&mut out);
            want.extend_from_slice(&out);
        }
        assert_eq!(got, want);
        let bf: Vec<u8> = (0..(3 << 17) + 1).map(|i| (i * 7 % 251) as u8).collect();
        let got = to_f32(DType::BF16, &bf);
        assert_eq!(got.len(), 3 << 16);
        assert!(got
            .iter()
            .zip(bf.chunks_exact(2))
            .all(|(&v, c)| v.to_bits() == bf16::from_le_bytes([c[0], c[1]]).to_f32().to_bits()));
    }

    /// The 5-bit and K-quant blocks against gguf-py's dequantization (llama.cpp's Python
    /// package, an independent implementation): random blocks in
    /// `gpu/tests/fixtures/kquant_golden.json`, made by `gpu/reference/make_kquant_golden.py`.
    #[test]
    fn k_quants_and_5_bit_types_match_gguf_py() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/kquant_golden.json"
        );
        let text = std::fs::read_to_string(path).expect("fixture");
        let golden: serde_json::Value = serde_json::from_str(&text).expect("json");
        for dtype in DType::FIVE_BIT_AND_K {
            let name = dtype.name();
            let g = &golden[name];
            let hex = g["hex"].as_str().expect("hex");
            let bytes: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex digit"))
                .collect();
            let want: Vec<f32> = g["values"]
                .as_array()
                .expect("values")
                .iter()
                .map(|v| v.as_f64().expect("number") as f32)
                .collect();
            let got = to_f32(dtype, &bytes);
            assert_eq!(got.len(), want.len(), "{name}");
            assert_eq!(
                bytes.len() / dtype.block_bytes() * dtype.block_len(),
                want.len()
            );
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // gguf-py multiplies in another order (d * sc first, or not): a few ulps.
                assert!(
                    (g - w).abs() <= 1e-6 * w.abs().max(1e-3),
                    "{name} value {i}: {g} against {w}"
                );
            }
        }
    }

    #[test]
    fn float_types_convert() {
        let mut d = Vec::new();
        d.extend_from_slice(&bf16::from_f32(1.5).to_le_bytes());
        d.extend_from_slice(&bf16::from_f32(-2.0).to_le_bytes());
        assert_eq!(to_f32(DType::BF16, &d), vec![1.5, -2.0]);
        let d: Vec<u8> = [0.25f32, 3.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        assert_eq!(to_f32(DType::F32, &d), vec![0.25, 3.0]);
    }
}
