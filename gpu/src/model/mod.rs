//! Model files: formats, configuration, tokenizer, chat template.

use std::io::Read;
use std::path::Path;

use crate::error::GpuError;

/// Opens `path` for reading if it is a regular file (links are followed): checked by path
/// before it is opened (opening a FIFO blocks; a device can be endless) and again on the open
/// file. Every model, tokenizer, template and adapter file is opened this way.
pub(crate) fn open_regular(path: &Path) -> Result<std::fs::File, GpuError> {
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
    Ok(file)
}

/// The bytes of the regular file at `path` ([`open_regular`]), refused when it is over `max`
/// bytes: at most `max + 1` bytes are read, so a file that grows while it is read is refused
/// too.
pub(crate) fn read_bounded_bytes(path: &Path, max: u64) -> Result<Vec<u8>, GpuError> {
    let file = open_regular(path)?;
    let len = file.metadata().map_err(|e| GpuError::io(path, e))?.len();
    let too_large = || GpuError::invalid_file(path, format!("too large: more than {max} bytes"));
    if len > max {
        return Err(too_large());
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(usize::try_from(len).unwrap_or(usize::MAX))
        .map_err(|e| GpuError::invalid_file(path, format!("cannot hold its {len} bytes: {e}")))?;
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| GpuError::io(path, e))?;
    if bytes.len() as u64 > max {
        return Err(too_large());
    }
    Ok(bytes)
}

/// The text of the regular file at `path`, at most `max` bytes ([`read_bounded_bytes`]).
pub(crate) fn read_bounded(path: &Path, max: u64) -> Result<String, GpuError> {
    String::from_utf8(read_bounded_bytes(path, max)?)
        .map_err(|e| GpuError::invalid_file(path, format!("not UTF-8: {e}")))
}

pub mod chat_template;
pub mod config;
pub mod content_escape;
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

pub use chat_template::{ChatEnding, ChatMessage, ChatTemplate, ToolSupport};
pub use config::{LlamaConfig, RopeStyle};
pub use fetch::{default_model_path, fetch_model};
pub use loader::{check_model_path, is_hf_checkpoint, load_model, LoadedModel};
pub use rope::{Llama3Scaling, LongRopeScaling, RopeScaling, YarnScaling};
pub use tensor::{DType, ModelWeights, TensorView};
pub use tokenizer::Tokenizer;

/// Test helpers shared by the loaders' tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::path::PathBuf;

    use crate::scratch::ScratchDir;

    /// A fresh scratch directory holding paths that are not regular files: a directory, a link
    /// to `/dev/zero` and, where mkfifo(1) exists (no libc in this crate), a FIFO. Returns the
    /// directory (removed when dropped) and the paths.
    pub(crate) fn irregular_paths(tag: &str) -> (ScratchDir, Vec<PathBuf>) {
        let d = ScratchDir::new(&format!("irregular-{tag}"));
        std::fs::create_dir_all(d.join("dir")).unwrap();
        std::os::unix::fs::symlink("/dev/zero", d.join("zero")).unwrap();
        let mut paths = vec![d.join("dir"), d.join("zero")];
        let fifo = d.join("fifo");
        if std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success())
        {
            paths.push(fifo);
        }
        (d, paths)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn read_bounded_takes_up_to_the_bound_and_refuses_more() {
        let dir = crate::scratch::ScratchDir::new("bounded");
        let p = dir.join("f");
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
        // A directory, a link to /dev/zero, a FIFO: refused before they are read (or opened).
        let (_d, irregular) = super::testing::irregular_paths("bounded");
        for q in irregular {
            let e = super::read_bounded(&q, 10).unwrap_err().to_string();
            assert!(e.contains("not a regular file"), "{}: {e}", q.display());
        }
        std::fs::remove_file(&p).unwrap();
        assert!(super::read_bounded(&p, 10).is_err());
    }
}
