//! Model files: formats, configuration, tokenizer, chat template.

use std::io::Read;
use std::path::Path;

use crate::error::GpuError;

/// The text of the file at `path`, refused when it is over `max` bytes: at most `max + 1`
/// bytes are read, so a file that grows while it is read is refused too. Only a regular file
/// (links followed) is read: a FIFO would block the open, a device could be endless.
pub(crate) fn read_bounded(path: &Path, max: u64) -> Result<String, GpuError> {
    let regular = |m: std::fs::Metadata| {
        if m.is_file() {
            Ok(())
        } else {
            Err(GpuError::invalid_file(path, "not a regular file"))
        }
    };
    regular(std::fs::metadata(path).map_err(|e| GpuError::io(path, e))?)?;
    let file = std::fs::File::open(path).map_err(|e| GpuError::io(path, e))?;
    regular(file.metadata().map_err(|e| GpuError::io(path, e))?)?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| GpuError::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(GpuError::invalid_file(
            path,
            format!("too large: more than {max} bytes"),
        ));
    }
    String::from_utf8(bytes).map_err(|e| GpuError::invalid_file(path, format!("not UTF-8: {e}")))
}

pub mod chat_template;
pub mod config;
pub mod dequant;
pub mod fetch;
pub mod gguf;
pub mod loader;
pub mod quant_blocks;
pub mod rope;
pub mod safetensors_dir;
pub mod tensor;
pub mod tokenizer;
mod tokenizer_spm;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use config::{LlamaConfig, RopeStyle};
pub use fetch::{default_model_path, fetch_model};
pub use loader::{load_model, LoadedModel};
pub use rope::{Llama3Scaling, RopeScaling, YarnScaling};
pub use tensor::{DType, ModelWeights, TensorView};
pub use tokenizer::Tokenizer;

#[cfg(test)]
mod tests {
    #[test]
    fn read_bounded_takes_up_to_the_bound_and_refuses_more() {
        let p = std::env::temp_dir().join(format!("sy-bounded-{}", std::process::id()));
        std::fs::write(&p, "0123456789").unwrap();
        assert_eq!(super::read_bounded(&p, 10).unwrap(), "0123456789");
        let e = super::read_bounded(&p, 9).unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
        // A character cut by the bound is still "too large"; invalid text is refused as such.
        std::fs::write(&p, "ab\u{e9}").unwrap();
        let e = super::read_bounded(&p, 3).unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
        std::fs::write(&p, [b'a', 0xff]).unwrap();
        let e = super::read_bounded(&p, 10).unwrap_err().to_string();
        assert!(e.contains("UTF-8"), "{e}");
        let e = super::read_bounded(&std::env::temp_dir(), 10)
            .unwrap_err()
            .to_string();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(&p).unwrap();
        assert!(super::read_bounded(&p, 10).is_err());
    }
}
