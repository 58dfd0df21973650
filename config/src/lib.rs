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

mod file;
mod keys;
mod locate;
mod log_filter;
mod overrides;
mod schema;

pub use file::expand_home;
pub use locate::locate;
pub use log_filter::check_log_filter;
pub use overrides::{apply_override, env_overrides, Override, OverrideSource, ENV_PREFIX};
pub use schema::*;

use std::path::Path;

/// Everything that can go wrong while reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
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
    /// A `--set key=value` or environment override could not be applied, or gave a field a
    /// value it may not have.
    #[error("override `{text}`: {message}")]
    Override {
        /// The override as the operator wrote it (`--set cache.block_size=0`,
        /// `SWITCHYARD__CACHE__BLOCK_SIZE=0`), secrets redacted.
        text: String,
        /// The field and what is wrong.
        message: String,
    },
    /// A `SWITCHYARD__*` environment variable cannot be read as an override.
    #[error("environment variable {var}: {message}")]
    Env {
        /// The variable's name (lossily decoded when it is not UTF-8).
        var: String,
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

/// Upper bound on the size of a configuration file (or API keys file) we are willing to parse.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

impl Config {
    /// Reads and validates a configuration file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        Self::from_file_with_overrides(path, &[])
    }

    /// Reads a configuration file (a regular file of at most [`MAX_CONFIG_BYTES`]), applies
    /// `key.path=value` overrides (CLI flags, environment), then validates the result.
    pub fn from_file_with_overrides(
        path: &Path,
        overrides: &[Override],
    ) -> Result<Self, ConfigError> {
        let name = path.display().to_string();
        let text = file::read_text(path, MAX_CONFIG_BYTES).map_err(|e| match e {
            file::ReadError::Io(source) => ConfigError::Io {
                path: name.clone(),
                source,
            },
            file::ReadError::Invalid(message) => ConfigError::Parse {
                file: name.clone(),
                line: None,
                message,
            },
        })?;
        Self::from_yaml_with_overrides(&text, &name, overrides)
    }

    /// Parses and validates YAML text; `file` names it in errors.
    pub fn from_yaml_str(text: &str, file: &str) -> Result<Self, ConfigError> {
        Self::from_yaml_with_overrides(text, file, &[])
    }

    /// Parses YAML text, applies overrides in order and validates. An error an override
    /// causes names the override (as the operator wrote it) and the field, never a line of
    /// the file.
    pub fn from_yaml_with_overrides(
        text: &str,
        file: &str,
        overrides: &[Override],
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
        if let Some(last) = overrides.last() {
            let mut value = serde_yaml::to_value(&config).map_err(|e| parse_err(file, e))?;
            for o in overrides {
                apply_override(&mut value, o)?;
            }
            // All of them, then one check, so that a later override can correct an earlier
            // one (`--set` over the environment); a value out of range or of the wrong type
            // is blamed on the last override of its field.
            config = serde_path_to_error::deserialize(value).map_err(|e| {
                let field = e.path().to_string();
                let by = overrides
                    .iter()
                    .rev()
                    .find(|o| o.covers(&field))
                    .unwrap_or(last);
                ConfigError::Override {
                    text: by.to_string(),
                    message: format!("field `{field}`: {}", e.inner()),
                }
            })?;
        }
        config.validate().map_err(|(field, message)| {
            // A rule broken by an overridden field is the override's, not the file's (the
            // file's line, if any, holds a value that is no longer in force).
            if let Some(o) = overrides.iter().rev().find(|o| o.covers(&field)) {
                return ConfigError::Override {
                    text: o.to_string(),
                    message: format!("{field}: {message}"),
                };
            }
            let message = if overrides.is_empty() {
                message
            } else {
                let list: Vec<String> = overrides.iter().map(|o| format!("`{o}`")).collect();
                format!("{message} (with the overrides {})", list.join(", "))
            };
            ConfigError::Invalid {
                file: file.to_string(),
                line: locate(text, &field),
                field,
                message,
            }
        })?;
        Ok(config)
    }

    /// The effective configuration as YAML. It holds the API keys and the admin key: print
    /// [`Config::redacted`]'s instead where others may read it.
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).unwrap_or_else(|e| format!("# cannot render config: {e}\n"))
    }

    /// A copy to show (what `switchyard config check` prints): every API key and the admin
    /// key replaced by `<redacted>`.
    pub fn redacted(&self) -> Config {
        let mut c = self.clone();
        for k in &mut c.server.api_keys {
            k.key = REDACTED.into();
        }
        if let Some(k) = &mut c.server.admin_key {
            *k = REDACTED.into();
        }
        c
    }
}

/// What a secret is shown as.
pub const REDACTED: &str = "<redacted>";

#[cfg(test)]
mod tests {
    use super::*;

    /// The error `yaml` with `overrides` gives, as text.
    fn error(yaml: &str, overrides: &[Override]) -> String {
        Config::from_yaml_with_overrides(yaml, "t.yaml", overrides)
            .expect_err("should be refused")
            .to_string()
    }

    fn env(name: &str, value: &str) -> Override {
        let vars = [(name.into(), value.into())];
        env_overrides(vars).unwrap().remove(0)
    }

    #[test]
    fn a_misspelt_log_level_is_refused_naming_the_field() {
        let e = error("logging:\n  level: warning\n", &[]);
        assert!(e.starts_with("t.yaml:2: logging.level"), "{e}");
        assert!(e.contains("`warning`"), "{e}");
        for bad in ["", " , ", "switchyard=loud", "info,swtichyard", "=debug"] {
            assert!(check_log_filter(bad).is_err(), "`{bad}` accepted");
        }
        for good in [
            "info",
            "WARN",
            "off",
            "switchyard=debug,info",
            "actix_web::middleware=warn, error",
            "switchyard_actors[step]=trace",
        ] {
            assert_eq!(check_log_filter(good), Ok(()), "`{good}` refused");
        }
    }

    #[test]
    fn an_architecture_without_dummy_weights_and_a_host_name_are_refused() {
        let e = error("model:\n  architecture: llama-3-8b\n", &[]);
        assert!(e.starts_with("t.yaml:2: model.architecture"), "{e}");
        assert!(e.contains("load_format: dummy"), "{e}");
        assert!(Config::from_yaml_str(
            "model: { load_format: dummy, architecture: llama-3-8b }",
            "t"
        )
        .is_ok());
        let e = error("server:\n  host: localhost\n", &[]);
        assert!(e.starts_with("t.yaml:2: server.host"), "{e}");
        let c = Config::from_yaml_str("server: { host: '[::1]' }", "t").unwrap();
        assert_eq!(c.server.bind_ip(), Ok("::1".parse().unwrap()));
    }

    #[test]
    fn an_out_of_range_override_names_the_variable_and_the_field() {
        let e = error(
            "cache:\n  block_size: 16\n",
            &[env("SWITCHYARD__CACHE__BLOCK_SIZE", "0")],
        );
        assert!(
            e.starts_with("override `SWITCHYARD__CACHE__BLOCK_SIZE=0`: field `cache.block_size`"),
            "{e}"
        );
        assert!(e.contains("out of range"), "{e}");
        let e = error("", &["server.prot=80".into()]);
        assert!(
            e.starts_with("override `--set server.prot=80`") && e.contains("prot"),
            "{e}"
        );
        // The override that broke it, not a later good one.
        let e = error(
            "",
            &["cache.block_size=0".into(), "server.port=9000".into()],
        );
        assert!(e.contains("--set cache.block_size=0"), "{e}");
        // A later override corrects an earlier one (`--set` over the environment).
        let c = Config::from_yaml_with_overrides(
            "",
            "t.yaml",
            &[
                env("SWITCHYARD__CACHE__BLOCK_SIZE", "0"),
                "cache.block_size=32".into(),
            ],
        )
        .expect("the later override wins");
        assert_eq!(c.cache.block_size, 32);
    }

    #[test]
    fn a_rule_broken_by_an_override_is_not_blamed_on_the_files_line() {
        // The file's line 2 holds a valid admin key; the override replaced it.
        let e = error(
            "server:\n  admin_key: a-good-admin-key\n",
            &[env("SWITCHYARD__SERVER__ADMIN_KEY", "short")],
        );
        assert!(
            e.starts_with("override `SWITCHYARD__SERVER__ADMIN_KEY=<redacted>`: server.admin_key:"),
            "{e}"
        );
        assert!(!e.contains("short") && !e.contains("t.yaml"), "{e}");
        // A rule between a field of the file and an overridden one: the file's line is the
        // field's, and the override is named beside it.
        let e = error(
            "scheduler:\n  max_num_batched_tokens: 512\n",
            &["scheduler.max_num_seqs=1024".into()],
        );
        assert_eq!(
            e,
            "t.yaml:2: scheduler.max_num_batched_tokens: 512 must be at least max_num_seqs \
             (1024) (with the overrides `--set scheduler.max_num_seqs=1024`)"
        );
    }

    #[test]
    fn redacted_configs_hold_no_keys() {
        let c = Config::from_yaml_str(
            "server:\n  admin_key: admin-key-0001\n  api_keys:\n    - { key: api-key-00001, tenant: a }\n",
            "t",
        )
        .unwrap();
        let text = c.redacted().to_yaml();
        assert!(
            !text.contains("admin-key-0001") && !text.contains("api-key-00001"),
            "{text}"
        );
        assert!(
            text.contains(REDACTED) && text.contains("tenant: a"),
            "{text}"
        );
    }

    #[test]
    fn a_config_file_that_is_not_a_regular_file_is_refused() {
        let e = Config::from_file(Path::new("/dev/zero"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/dev/zero") && e.contains("not a regular file"),
            "{e}"
        );
    }
}
