//! The CPU backend: quantized matrix kernels, the Llama forward pass over a paged KV cache.

pub mod attention;
pub mod kv_cache;
pub mod llama;
pub mod matmul;
pub mod ops;
pub mod quant;
