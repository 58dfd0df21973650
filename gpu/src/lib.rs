//! The executor side of Switchyard: the `Backend` trait, the CPU backend, model loading
//! (GGUF, safetensors), tokenizer and chat templates, and the sampler.

pub mod error;
#[cfg(test)]
mod fuzz;
pub mod model;
pub mod progress;

pub use error::GpuError;
pub mod backend;
pub mod constraint;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod kv_size;
pub mod lora;
mod lora_targets;
pub mod sampler;
#[cfg(test)]
#[path = "../../testsupport/scratch.rs"]
mod scratch;
#[path = "../../support/short_number.rs"]
mod short_number;
pub mod token_filter;
pub use backend::{
    Backend, Batch, CpuBackend, CpuBackendConfig, KvCopy, SeqInput, SeqOutput,
    CUDA_MAX_BATCH_TOKENS, CUDA_WINDOW_READ_SLACK,
};
pub use constraint::{Constraint, TokenConstraint};
pub use cpu::llama::ActivationPrecision;
pub use kv_size::{KvGeometry, KvSettingNames, KvStorage};
pub use lora::{LoraAdapter, LoraLimits, LoraTarget};
pub use sampler::SamplingParams;
pub use token_filter::{AllowedTokens, BadWords, Intersection};
