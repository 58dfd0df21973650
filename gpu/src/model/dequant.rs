//! Conversion of stored tensors (float or ggml block-quantized) to `f32`.

use half::{bf16, f16};

use super::quant_blocks::{BlockQ4_0, BlockQ4_1, BlockQ8_0, QK};
use super::tensor::DType;

/// Converts `data` of type `dtype` to `f32` values. Trailing bytes that do not form a whole
/// element or block are ignored (views are length-checked when they are created).
pub fn to_f32(dtype: DType, data: &[u8]) -> Vec<f32> {
    let n_blocks = data.len() / dtype.block_bytes();
    let mut out = Vec::with_capacity(n_blocks * dtype.block_len());
    let mut buf = [0f32; QK];
    match dtype {
        DType::F32 => out.extend(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
        DType::F16 => out.extend(
            data.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        DType::BF16 => out.extend(
            data.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()),
        ),
        DType::Q8_0 => {
            for c in data.chunks_exact(34) {
                if let Ok(b) = <&[u8; 34]>::try_from(c) {
                    BlockQ8_0::from_bytes(b).dequantize(&mut buf);
                    out.extend_from_slice(&buf);
                }
            }
        }
        DType::Q4_0 => {
            for c in data.chunks_exact(18) {
                if let Ok(b) = <&[u8; 18]>::try_from(c) {
                    BlockQ4_0::from_bytes(b).dequantize(&mut buf);
                    out.extend_from_slice(&buf);
                }
            }
        }
        DType::Q4_1 => {
            for c in data.chunks_exact(20) {
                if let Ok(b) = <&[u8; 20]>::try_from(c) {
                    BlockQ4_1::from_bytes(b).dequantize(&mut buf);
                    out.extend_from_slice(&buf);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

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
