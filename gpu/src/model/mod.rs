//! Model files: formats, configuration, tokenizer, chat template.

pub mod chat_template;
pub mod config;
pub mod dequant;
pub mod fetch;
pub mod gguf;
pub mod loader;
pub mod quant_blocks;
pub mod safetensors_dir;
pub mod tensor;
pub mod tokenizer;
mod tokenizer_spm;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use config::{LlamaConfig, RopeScaling, RopeStyle};
pub use fetch::{default_model_path, fetch_model};
pub use loader::{load_model, LoadedModel};
pub use tensor::{DType, ModelWeights, TensorView};
pub use tokenizer::Tokenizer;
