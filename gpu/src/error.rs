//! The error type of the `switchyard-gpu` crate.

use std::path::PathBuf;

/// Everything that can go wrong while loading a model or running it.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// Reading a file or directory failed.
    // The reason is in the message (HTTP answers show only the message), so it is not also
    // a `source`, which error chains would print a second time.
    #[error("I/O error on {path}: {reason}")]
    Io {
        /// The file or directory being accessed.
        path: PathBuf,
        /// The underlying error.
        reason: std::io::Error,
    },
    /// A model file is malformed, truncated or exceeds a safety limit.
    #[error("invalid model file {path}: {reason}")]
    InvalidModelFile {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A LoRA adapter directory or file is malformed, unsupported or exceeds a limit.
    #[error("invalid LoRA adapter {path}: {reason}")]
    InvalidAdapter {
        /// The offending directory or file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A tensor uses a storage type this crate cannot compute with.
    #[error("unsupported tensor type {type_name} for tensor '{tensor}'")]
    UnsupportedTensorType {
        /// The tensor's name.
        tensor: String,
        /// The file's name (or number) for the type.
        type_name: String,
    },
    /// A tensor the model needs is not in the weights.
    #[error("tensor '{0}' not found in the model weights")]
    TensorNotFound(String),
    /// A tensor has a shape or type the model does not expect.
    #[error("tensor '{tensor}': {reason}")]
    BadTensor {
        /// The tensor's name.
        tensor: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The model configuration is missing a key or holds an impossible value.
    #[error("invalid model configuration: {0}")]
    InvalidConfig(String),
    /// The model's architecture is not one this crate runs.
    #[error("unsupported model architecture '{0}'")]
    UnsupportedArchitecture(String),
    /// Building or running the tokenizer failed.
    #[error("tokenizer error: {0}")]
    Tokenizer(String),
    /// Parsing or rendering the chat template failed.
    #[error("chat template error: {0}")]
    ChatTemplate(String),
    /// A chat template's rendering passed the bound its caller set (the longest prompt text
    /// the model could take): the prompt cannot fit.
    #[error("chat template error: the rendering exceeds {limit} bytes")]
    ChatTemplateTooLong {
        /// The bound, in bytes.
        limit: usize,
    },
    /// Fetching a model into the local cache failed.
    #[error("model fetch failed: {0}")]
    Fetch(String),
    /// The name passed to `model fetch` is not a known model.
    #[error("unknown model '{0}' (known models: {1})")]
    UnknownModel(String, String),
    /// A batch handed to a backend is malformed (unknown block, token outside the vocabulary,
    /// too many tokens, inconsistent lengths).
    #[error("invalid batch: {0}")]
    BadBatch(String),
    /// Sampling parameters are out of range.
    #[error("invalid sampling parameters: {0}")]
    BadSampling(String),
    /// The CUDA driver, NVRTC or cuBLAS failed, or is missing.
    #[error("CUDA error: {0}")]
    Cuda(String),
    /// An internal invariant of the compute code was violated (a bug, never user input).
    #[error("internal error: {0}")]
    Internal(String),
}

impl GpuError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        GpuError::Io {
            path: path.into(),
            reason: source,
        }
    }

    /// Builds an [`GpuError::InvalidModelFile`] error.
    pub fn invalid_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        GpuError::InvalidModelFile {
            path: path.into(),
            reason: reason.into(),
        }
    }
}
