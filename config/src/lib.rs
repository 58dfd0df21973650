//! Switchyard's configuration: one YAML file configures the server, the engine and the
//! simulator's shared sections.
//!
//! ```
//! let cfg = switchyard_config::Config::from_yaml_str("scheduler: { max_num_seqs: 64 }", "inline").unwrap();
//! assert_eq!(cfg.scheduler.max_num_seqs, 64);
//! assert_eq!(cfg.cache.block_size, 16);
//! ```
//!
//! Errors name the file, the line and the field: numeric bounds are checked while
//! deserializing (so the YAML parser reports the location), and cross-field rules are checked
//! afterwards and located by [`locate`].

mod locate;
mod overrides;
mod schema;

pub use locate::locate;
pub use overrides::{apply_override, env_overrides};
pub use schema::*;

use std::path::Path;

/// Everything that can go wrong while reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read config file {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The YAML is malformed or a field has a wrong type, an unknown name or an out-of-range value.
    #[error("{file}{}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Parse {
        /// The file (or "inline", "--set").
        file: String,
        /// 1-based line, when known.
        line: Option<usize>,
        /// The parser's message, which names the field.
        message: String,
    },
    /// A rule that spans several fields is broken.
    #[error("{file}{}: {field}: {message}", line.map(|l| format!(":{l}")).unwrap_or_default())]
    Invalid {
        /// The file.
        file: String,
        /// 1-based line of the field, when it could be found.
        line: Option<usize>,
        /// Dotted path of the offending field, e.g. `scheduler.max_num_batched_tokens`.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// A `--set key=value` or environment override could not be applied.
    #[error("override `{text}`: {message}")]
    Override {
        /// The override as given.
        text: String,
        /// What is wrong.
        message: String,
    },
}

/// The key written on 1-based `line` of block-style YAML (`  block_size: 0` gives `block_size`).
fn key_on_line(text: &str, line: usize) -> Option<&str> {
    let l = text.lines().nth(line.checked_sub(1)?)?;
    let (key, _) = l.trim_start().trim_start_matches("- ").split_once(':')?;
    let key = key.trim();
    (!key.is_empty() && key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')).then_some(key)
}

/// Upper bound on the size of a configuration file we are willing to parse.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

impl Config {
    /// Reads and validates a configuration file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::from_file_with_overrides(path, &[])
    }

    /// Reads a configuration file, applies `key.path=value` overrides (CLI flags, environment),
    /// then validates the result.
    pub fn from_file_with_overrides(
        path: &Path,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let io = |source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(io)?;
        if meta.len() > MAX_CONFIG_BYTES {
            return Err(ConfigError::Parse {
                file: path.display().to_string(),
                line: None,
                message: format!(
                    "file is {} bytes, more than the {MAX_CONFIG_BYTES} allowed",
                    meta.len()
                ),
            });
        }
        let text = std::fs::read_to_string(path).map_err(io)?;
        Self::from_yaml_with_overrides(&text, &path.display().to_string(), overrides)
    }

    /// Parses and validates YAML text; `file` names it in errors.
    pub fn from_yaml_str(text: &str, file: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_with_overrides(text, file, &[])
    }

    /// Parses YAML text, applies overrides and validates.
    pub fn from_yaml_with_overrides(
        text: &str,
        file: &str,
        overrides: &[String],
    ) -> Result<Self, ConfigError> {
        let parse_err = |file: &str, e: serde_yaml::Error| {
            let line = e.location().map(|l| l.line());
            let mut message = e.to_string();
            // Range checks run inside a field's deserializer, where the parser's message names
            // only the enclosing section: name the key written on the error's line too.
            if let Some(key) = line.and_then(|l| key_on_line(text, l)) {
                if !message.contains(key) {
                    message = format!("field `{key}`: {message}");
                }
            }
            ConfigError::Parse {
                file: file.to_string(),
                line,
                message,
            }
        };
        // An empty file is the all-defaults configuration.
        let mut config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_yaml::from_str(text).map_err(|e| parse_err(file, e))?
        };
        if !overrides.is_empty() {
            let mut value = serde_yaml::to_value(&config).map_err(|e| parse_err(file, e))?;
            for o in overrides {
                apply_override(&mut value, o)?;
            }
            config =
                serde_yaml::from_value(value).map_err(|e| parse_err("--set/env overrides", e))?;
        }
        config
            .validate()
            .map_err(|(field, message)| ConfigError::Invalid {
                file: file.to_string(),
                line: locate(text, &field),
                field,
                message,
            })?;
        Ok(config)
    }

    /// The effective configuration as YAML (what `switchyard config check` prints).
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }
}
