//! Reading the operator's files (the configuration, the API keys file, the TLS files): regular
//! files only, to a bound, as bytes or UTF-8 text.

use std::io::Read;
use std::path::{Path, PathBuf};

/// Why a file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The operating system refused (missing file, permissions...).
    #[error("cannot read it: {0}")]
    Io(std::io::Error),
    /// Not a regular file, too large, or not UTF-8.
    #[error("{0}")]
    Invalid(String),
}

/// Expands a leading `~` (the home directory) in an operator-given path.
pub fn expand_home(path: &str) -> PathBuf {
    let p = Path::new(path);
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => p.to_path_buf(),
    }
}

/// What an error about the operator-given `path` adds after it: nothing for an absolute path,
/// and for a relative one the directory it was read against, ` (relative to the working
/// directory /srv)`. A relative path in the configuration (`model.path`,
/// `server.api_keys_file`, an adapter, a TLS file) is read against the directory the process
/// runs in, not the configuration file's; the error says so, since a path that reads well
/// beside the file is missing from elsewhere.
pub fn relative_note(path: &Path) -> String {
    if !path.is_relative() {
        return String::new();
    }
    match std::env::current_dir() {
        Ok(dir) => format!(" (relative to the working directory {})", dir.display()),
        Err(e) => format!(" (relative to the working directory, which cannot be named: {e})"),
    }
}

/// The text of the regular file at `path` (links followed), at most `max` bytes: see
/// [`read_bytes`]; the bytes must be UTF-8.
pub(crate) fn read_text(path: &Path, max: u64) -> Result<String, ReadError> {
    String::from_utf8(read_bytes(path, max)?).map_err(|e| {
        ReadError::Invalid(format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// The bytes of the regular file at `path` (links followed), at most `max`. The kind of file
/// is checked before it is opened (opening a FIFO blocks; a device such as `/dev/zero` never
/// ends) and again once open; at most `max + 1` bytes are read, so a file that grows
/// meanwhile is refused too.
pub fn read_bytes(path: &Path, max: u64) -> Result<Vec<u8>, ReadError> {
    let regular = |m: std::fs::Metadata| {
        if m.is_file() {
            Ok(())
        } else {
            Err(ReadError::Invalid("not a regular file".into()))
        }
    };
    regular(std::fs::metadata(path).map_err(ReadError::Io)?)?;
    let file = std::fs::File::open(path).map_err(ReadError::Io)?;
    regular(file.metadata().map_err(ReadError::Io)?)?;
    let mut bytes = Vec::new();
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(ReadError::Io)?;
    if bytes.len() as u64 > max {
        return Err(ReadError::Invalid(format!(
            "too large: more than {max} bytes"
        )));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_up_to_the_bound_and_refuses_devices_directories_and_binary() {
        let dir = crate::scratch::ScratchDir::new("config-read");
        let p = dir.join("a.yaml");
        std::fs::write(&p, "0123456789").unwrap();
        assert_eq!(read_text(&p, 10).unwrap(), "0123456789");
        let invalid = |r: Result<String, ReadError>| match r {
            Err(ReadError::Invalid(m)) => m,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(invalid(read_text(&p, 9)).contains("too large"));
        std::fs::write(&p, [b'a', b':', 0xff]).unwrap();
        assert!(invalid(read_text(&p, 10)).contains("not UTF-8"));
        // `config check /dev/zero` once read until memory ran out.
        assert!(invalid(read_text(Path::new("/dev/zero"), 10)).contains("not a regular file"));
        assert!(invalid(read_text(&dir, 10)).contains("not a regular file"));
        assert!(matches!(
            read_text(&dir.join("missing"), 10),
            Err(ReadError::Io(_))
        ));
    }

    #[test]
    fn only_a_relative_path_is_said_to_be_relative_to_the_working_directory() {
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            relative_note(Path::new("models/m.gguf")),
            format!(" (relative to the working directory {})", cwd.display())
        );
        assert_eq!(relative_note(Path::new("/srv/models/m.gguf")), "");
    }

    #[test]
    fn a_leading_tilde_is_the_home_directory() {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        if let Some(home) = home {
            assert_eq!(expand_home("~/k.yaml"), home.join("k.yaml"));
        }
        assert_eq!(expand_home("/k~/x"), PathBuf::from("/k~/x"));
    }
}
