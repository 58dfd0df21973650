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

mod cors;
mod file;
mod keys;
mod locate;
mod log_filter;
#[path = "../../support/nearest_name.rs"]
mod nearest_name;
mod overrides;
mod schema;
#[cfg(test)]
#[path = "../../testsupport/scratch.rs"]
mod scratch;
#[path = "../../support/short_number.rs"]
mod short_number;
mod tier_diff;
mod tier_name;
mod tls;

pub use cors::{CorsSection, MAX_CORS_ENTRIES, MAX_CORS_ENTRY_BYTES};
pub use file::{expand_home, read_bytes, relative_note, ReadError};
pub use locate::locate;
pub use log_filter::check_log_filter;
pub use nearest_name::with_did_you_mean;
pub use overrides::{apply_override, env_overrides, Override, OverrideSource, ENV_PREFIX};
pub use schema::*;
pub use tier_diff::{tier_field_changes, TierFieldChange};
pub use tier_name::{check_tier_name, deserialize_tiers, MAX_TIER_NAME_BYTES};
pub use tls::{TlsFiles, TlsSection, MAX_TLS_FILE_BYTES};

use std::path::Path;

/// Everything that can go wrong while reading or validating a configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    // The cause is in the message and deliberately not a `source`: a `{:#}` (anyhow) printed
    // it twice.
    #[error("cannot read {path}: {error}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        error: std::io::Error,
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
        Self::from_file_checked(path, overrides, |_| Ok(()))
    }

    /// [`Config::from_file_with_overrides`] with a further check of the caller's (one that
    /// needs another crate, such as the policy registry's): it runs after
    /// [`Config::validate`] and returns the dotted field at fault and why, which is blamed as
    /// `validate`'s are: on the override that set the field, else on the file's line.
    pub fn from_file_checked(
        path: &Path,
        overrides: &[Override],
        check: impl FnOnce(&Config) -> Result<(), (String, String)>,
    ) -> Result<Self, ConfigError> {
        let name = path.display().to_string();
        let text = file::read_text(path, MAX_CONFIG_BYTES).map_err(|e| match e {
            file::ReadError::Io(error) => ConfigError::Io {
                path: name.clone(),
                error,
            },
            file::ReadError::Invalid(message) => ConfigError::Parse {
                file: name.clone(),
                line: None,
                message,
            },
        })?;
        Self::from_yaml_checked(&text, &name, overrides, check)
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
        Self::from_yaml_checked(text, file, overrides, |_| Ok(()))
    }

    /// [`Config::from_yaml_with_overrides`] with the caller's `check` after
    /// [`Config::validate`] (see [`Config::from_file_checked`]).
    pub fn from_yaml_checked(
        text: &str,
        file: &str,
        overrides: &[Override],
        check: impl FnOnce(&Config) -> Result<(), (String, String)>,
    ) -> Result<Self, ConfigError> {
        // The parser's message names the field by its path and the value's position (range
        // checks run while the parser is at the value); a misspelt key or variant gets the
        // known name nearest it.
        let parse_err = |file: &str, e: serde_yaml::Error| ConfigError::Parse {
            file: file.to_string(),
            line: e.location().map(|l| l.line()),
            message: with_did_you_mean(&crate::short_number::short_float_echoes(&e.to_string())),
        };
        // An empty file is the all-defaults configuration.
        let mut config: Config = if text.trim().is_empty() {
            Config::default()
        } else {
            serde_yaml::from_str(text).map_err(|e| parse_err(file, e))?
        };
        if let Some(last) = overrides.last() {
            let base = serde_yaml::to_value(&config).map_err(|e| parse_err(file, e))?;
            // All of them, then one check, so that a later override can correct an earlier
            // one (`--set` over the environment); a value out of range or of the wrong type
            // is blamed on the last override of its field.
            //
            // An override's value is parsed as YAML, so `123` is a number; a string field
            // given one (`model.served_name=123`) takes the text as written, as the file's
            // plain scalar would be read. Which fields are strings is the deserializer's to
            // say: an override whose number or boolean is refused at its own field is
            // applied again as its text (once each), and if that is refused too the first
            // error stands.
            let mut as_text = vec![false; overrides.len()];
            let mut first_error: Vec<Option<serde_path_to_error::Error<serde_yaml::Error>>> =
                overrides.iter().map(|_| None).collect();
            config = loop {
                let mut value = base.clone();
                for (o, &text) in overrides.iter().zip(&as_text) {
                    apply_override(&mut value, o, text)?;
                }
                let e = match serde_path_to_error::deserialize(value) {
                    Ok(config) => break config,
                    Err(e) => e,
                };
                let field = e.path().to_string();
                let own = overrides.iter().rposition(|o| o.path() == field);
                if let Some(i) = own {
                    if !as_text[i] && overrides[i].reads_as_number_or_bool() {
                        as_text[i] = true;
                        first_error[i] = Some(e);
                        continue;
                    }
                }
                let e = own.and_then(|i| first_error[i].take()).unwrap_or(e);
                let by = overrides
                    .iter()
                    .rev()
                    .find(|o| o.covers(&field))
                    .unwrap_or(last);
                // serde's type errors quote the value (`invalid type: integer `123``):
                // never a secret's.
                let message = if overrides::is_secret_path(&field) {
                    format!("field `{field}`: must be a string (the value is not shown)")
                } else {
                    format!(
                        "field `{field}`: {}",
                        with_did_you_mean(&e.inner().to_string())
                    )
                };
                return Err(ConfigError::Override {
                    text: by.to_string(),
                    message,
                });
            };
        }
        let checked = config.validate().and_then(|()| check(&config));
        checked.map_err(|(field, message)| {
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

    /// A misspelt key or choice, through the loader: serde's message, located, with the
    /// known name nearest it; none when no name is near, or the key is far longer than any.
    #[test]
    fn a_misspelt_key_or_variant_gets_the_nearest_known_name() {
        let e = error("server:\n  prot: 8000\n", &[]);
        assert!(
            e.starts_with(
                "t.yaml:2: server: unknown field `prot`, expected one of `host`, `port`,"
            ),
            "{e}"
        );
        assert!(
            e.ends_with(" (did you mean `port`?) at line 2 column 3"),
            "{e}"
        );
        let e = error("scheduler: {max_num_seq: 8}\n", &[]);
        assert!(e.contains("unknown field `max_num_seq`"), "{e}");
        assert!(e.contains("(did you mean `max_num_seqs`?)"), "{e}");
        let e = error("model:\n  backend: cdua\n", &[]);
        assert!(
            e.starts_with("t.yaml:2: model.backend: unknown variant `cdua`, expected one of `auto`, `cpu`, `cuda` (did you mean `cuda`?)"),
            "{e}"
        );
        let e = error("model: {load_format: dumy}\n", &[]);
        assert!(e.contains("(did you mean `dummy`?)"), "{e}");
        let e = error("cahce: {}\n", &[]);
        assert!(e.contains("(did you mean `cache`?)"), "{e}");
        // In an override: the field as the override names it.
        let e = error("", &["server.prot=80".into()]);
        assert!(
            e.starts_with(
                "override `--set server.prot=80`: field `server.prot`: unknown field `prot`"
            ),
            "{e}"
        );
        assert!(e.contains("(did you mean `port`?)"), "{e}");
        // Nothing near, or a key far longer than any (YAML's longest plain key is 1024
        // characters): serde's message alone.
        for yaml in [
            "server:\n  colour: 1\n".to_string(),
            format!("server:\n  {}: 1\n", "p".repeat(1000)),
        ] {
            let e = error(&yaml, &[]);
            assert!(
                e.contains("expected one of `host`, `port`"),
                "{}",
                &e[..200]
            );
            assert!(!e.contains("did you mean"), "{}", &e[..200]);
        }
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

    /// `model.threads` takes what the `--threads` flags take (`MAX_CPU_THREADS`), one bound
    /// for both.
    #[test]
    fn model_threads_are_bounded_by_max_cpu_threads() {
        let threads = |n: usize| Config::from_yaml_str(&format!("model: {{ threads: {n} }}"), "t");
        assert_eq!(
            threads(MAX_CPU_THREADS).unwrap().model.threads,
            MAX_CPU_THREADS
        );
        let e = threads(MAX_CPU_THREADS + 1).unwrap_err().to_string();
        assert!(
            e.contains(&format!("out of range 0..={MAX_CPU_THREADS}")),
            "{e}"
        );
    }

    #[test]
    fn the_cpu_precision_is_one_of_four_and_auto_by_default() {
        let c = Config::from_yaml_str("model: {}", "t").unwrap();
        assert_eq!(c.model.cpu_precision, CpuPrecision::Auto);
        for (text, p) in [
            ("auto", CpuPrecision::Auto),
            ("int8", CpuPrecision::Int8),
            ("mixed", CpuPrecision::Mixed),
            ("precise", CpuPrecision::Precise),
        ] {
            let c = Config::from_yaml_str(&format!("model: {{ cpu_precision: {text} }}"), "t");
            assert_eq!(c.unwrap().model.cpu_precision, p);
            assert_eq!(text.parse::<CpuPrecision>(), Ok(p));
        }
        let e = error("model:\n  cpu_precision: f32\n", &[]);
        assert!(e.starts_with("t.yaml:2: model.cpu_precision"), "{e}");
        assert!(e.contains("precise"), "{e}");
        assert!("fp32"
            .parse::<CpuPrecision>()
            .unwrap_err()
            .contains("auto, int8, mixed, precise"));
    }

    #[test]
    fn at_most_max_cpu_loras_adapters_are_pinned() {
        let adapters = |pins: [bool; 3]| {
            let mut y = String::from("lora:\n  enabled: true\n  max_cpu_loras: 2\n  adapters:\n");
            for (i, pinned) in pins.into_iter().enumerate() {
                y.push_str(&format!(
                    "    - {{ name: a{i}, path: /x/{i}, pinned: {pinned} }}\n"
                ));
            }
            y
        };
        let c = Config::from_yaml_str(&adapters([true, false, true]), "t").unwrap();
        let pins: Vec<bool> = c.lora.adapters.iter().map(|a| a.pinned).collect();
        assert_eq!(pins, [true, false, true]);
        let e = error(&adapters([true, true, true]), &[]);
        assert!(e.starts_with("t.yaml:7: lora.adapters[2].pinned"), "{e}");
        assert!(e.contains("at most lora.max_cpu_loras (2)"), "{e}");
        // Unset: not pinned, and not written out.
        let c = Config::from_yaml_str(
            "lora:\n  enabled: true\n  adapters: [{ name: a, path: /x }]\n",
            "t",
        );
        let c = c.unwrap();
        assert!(!c.lora.adapters[0].pinned);
        assert!(!serde_yaml::to_string(&c.lora).unwrap().contains("pinned"));
    }

    #[test]
    fn message_special_tokens_are_text_by_default_or_tokens() {
        let c = Config::from_yaml_str("model: {}", "t").unwrap();
        assert_eq!(c.model.message_special_tokens, MessageSpecialTokens::Text);
        let c = Config::from_yaml_str("model: { message_special_tokens: tokens }", "t").unwrap();
        assert_eq!(c.model.message_special_tokens, MessageSpecialTokens::Tokens);
        let e = error("model:\n  message_special_tokens: escape\n", &[]);
        assert!(
            e.starts_with("t.yaml:2: model.message_special_tokens"),
            "{e}"
        );
        assert!(e.contains("text") && e.contains("tokens"), "{e}");
    }

    #[test]
    fn an_architecture_without_dummy_weights_and_a_host_name_are_refused() {
        let e = error("model:\n  architecture: llama-3-8b\n", &[]);
        assert!(e.starts_with("t.yaml:2: model.architecture"), "{e}");
        assert!(e.contains("load_format: dummy"), "{e}");
        let e = error("server:\n  host: localhost\n", &[]);
        assert!(e.starts_with("t.yaml:2: server.host"), "{e}");
        let c = Config::from_yaml_str("server: { host: '[::1]' }", "t").unwrap();
        assert_eq!(c.server.bind_ip(), Ok("::1".parse().unwrap()));
    }

    /// `serve` refuses random weights; the configuration does, so `config check` does too.
    #[test]
    fn dummy_weights_are_refused_as_serve_refuses_them() {
        for yaml in [
            "model:\n  load_format: dummy\n  architecture: llama-3-8b\n",
            "model:\n  load_format: dummy\n  architecture: foo\n",
            "model:\n  load_format: dummy\n",
        ] {
            let e = error(yaml, &[]);
            assert!(
                e.starts_with("t.yaml:2: model.load_format: dummy is for benchmarks"),
                "{e}"
            );
            assert!(e.contains("serve needs real weights"), "{e}");
            for arch in DUMMY_ARCHITECTURES {
                assert!(e.contains(arch), "{e}");
            }
        }
        let e = error("", &["model.load_format=dummy".into()]);
        assert!(
            e.starts_with("override `--set model.load_format=dummy`: model.load_format: dummy"),
            "{e}"
        );
        assert!(
            DUMMY_ARCHITECTURES.contains(&"qwen2.5-0.5b")
                && DUMMY_ARCHITECTURES.contains(&"qwen3-0.6b")
        );
    }

    /// A value out of range is blamed on its own field and line (it once was on the first key
    /// of its section, and that key's line): one case per section kind, in the example file.
    #[test]
    fn a_value_out_of_range_names_its_own_field_and_line() {
        const EXAMPLE: &str = include_str!("../examples/default.yaml");
        let cases = [
            ("cache", "kv_cache_mb", "0", "0 is out of range 1..=1048576"),
            (
                "cache",
                "block_size",
                "2048",
                "2048 is out of range 1..=1024",
            ),
            (
                "cache",
                "block_size",
                "7",
                "7 is not a block size: it takes a power of two, one of 1, 2, 4, 8, 16, 32, 64, \
                 128, 256, 512, 1024",
            ),
            ("server", "port", "99999", "99999 is out of range 0..=65535"),
            ("server", "port", "-1", "-1 is out of range 0..=65535"),
            (
                "server",
                "request_timeout_s",
                "0",
                "0 is out of range 1..=3600",
            ),
            ("lora", "max_loras", "0", "0 is out of range 1..=1024"),
            (
                "lora",
                "max_cpu_loras",
                "5000",
                "5000 is out of range 0..=4096",
            ),
            (
                "scheduler",
                "max_num_batched_tokens",
                "0",
                "0 is out of range 1..=1048576",
            ),
            ("model", "threads", "2000", "2000 is out of range 0..=1024"),
        ];
        for (section, key, value, why) in cases {
            let field = format!("{section}.{key}");
            let line = locate(EXAMPLE, &field).expect("the example sets the field");
            let text: String = EXAMPLE
                .lines()
                .enumerate()
                .map(|(i, l)| {
                    if i + 1 == line {
                        format!("{}{key}: {value}\n", &l[..l.find(key).unwrap()])
                    } else {
                        format!("{l}\n")
                    }
                })
                .collect();
            let e = error(&text, &[]);
            assert!(
                e.starts_with(&format!("t.yaml:{line}: {field}: {why} at line {line} ")),
                "{field}={value}: {e}"
            );
        }
        // A section the example leaves out, a map of sections, a flow mapping and a float.
        let e = error(
            "speculative:\n  method: ngram\n  num_speculative_tokens: 17\n",
            &[],
        );
        assert!(
            e.starts_with("t.yaml:3: speculative.num_speculative_tokens: 17 is out of range"),
            "{e}"
        );
        let e = error("tiers:\n  gold:\n    ttft_ms: 100\n    weight: 0\n", &[]);
        assert!(
            e.starts_with("t.yaml:4: tiers.gold.weight: 0 must be a weight"),
            "{e}"
        );
        let e = error(
            "tiers:\n  gold:\n    preemptible: true\n    tpot_ms: -1\n",
            &[],
        );
        assert!(
            e.starts_with("t.yaml:4: tiers.gold.tpot_ms: -1 must be"),
            "{e}"
        );
        let e = error("\ncache: { block_size: 16, kv_cache_mb: 0 }\n", &[]);
        assert!(
            e.starts_with("t.yaml:2: cache.kv_cache_mb: 0 is out of range")
                && e.ends_with("at line 2 column 39"),
            "{e}"
        );
        let e = error(
            "cache:\n  block_size: 16\n  gpu_memory_utilization: 1.5\n",
            &[],
        );
        assert!(
            e.starts_with("t.yaml:3: cache.gpu_memory_utilization: 1.5 must be in (0, 1]"),
            "{e}"
        );
        // Echoed short: `{}` wrote 1e300 as 301 digits, and serde too where a whole
        // number is expected.
        let e = error("cache:\n  block_size: 1e300\n", &[]);
        assert!(
            e.contains("cache.block_size: invalid type: floating point `1e300`, expected"),
            "{e}"
        );
        let e = error(
            "cache:\n  block_size: 16\n  gpu_memory_utilization: 1e300\n",
            &[],
        );
        assert!(
            e.starts_with("t.yaml:3: cache.gpu_memory_utilization: 1e300 must be in (0, 1]"),
            "{e}"
        );
        // The host KV tier's size: finite, not negative, bounded; named by its path.
        for bad in ["-1", ".inf", ".nan", "1024.5"] {
            let e = error(&format!("cache:\n  kv_offloading_size: {bad}\n"), &[]);
            assert!(
                e.starts_with("t.yaml:2: cache.kv_offloading_size: ")
                    && e.contains("must be a size in GiB in 0..=1024"),
                "{bad}: {e}"
            );
        }
        let c = Config::from_yaml_str("cache: { kv_offloading_size: 1.5 }\n", "t").unwrap();
        assert_eq!(c.cache.kv_offloading_bytes(), 3 << 29);
        assert_eq!(Config::default().cache.kv_offloading_bytes(), 0);
        let mut off = Config::default();
        off.cache.kv_offloading_size = 1.0;
        off.cache.prefix_caching = false;
        let (field, why) = off.validate().expect_err("needs prefix caching");
        assert_eq!(field, "cache.kv_offloading_size");
        assert!(why.contains("cache.prefix_caching: true"), "{why}");
        // Values in range, integers for floats and nulls are still read.
        let c = Config::from_yaml_str(
            "cache: { gpu_memory_utilization: 1 }\ntiers:\n  a: { ttft_ms: ~, tpot_ms: 50, weight: 2 }\nserver: { port: 0x1F90 }\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.cache.gpu_memory_utilization, 1.0);
        assert_eq!(c.tiers["a"].ttft_ms, None);
        assert_eq!(c.tiers["a"].tpot_ms, Some(50.0));
        assert_eq!(c.server.port, 8080);
        // The type is still checked, and said in words.
        let e = error("server:\n  port: eighty\n", &[]);
        assert!(
            e.contains(
                "server.port: invalid type: string \"eighty\", expected an integer in 0..=65535"
            ),
            "{e}"
        );
    }

    /// `tiers.<name>.max_pending_requests` is optional, 1 to 1,000,000 at the value's line,
    /// and at most `server.max_pending_requests` (also when an override lowers the latter).
    #[test]
    fn a_tier_pending_bound_is_bounded_and_within_the_server_one() {
        let c = Config::from_yaml_str(
            "tiers:\n  a: { max_pending_requests: 4 }\n  b: { max_pending_requests: ~ }\n  c: {}\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.tiers["a"].max_pending_requests, Some(4));
        assert_eq!(c.tiers["b"].max_pending_requests, None);
        assert_eq!(c.tiers["c"].max_pending_requests, None);
        let e = error("tiers:\n  a:\n    max_pending_requests: 0\n", &[]);
        assert!(
            e.starts_with("t.yaml:3: tiers.a.max_pending_requests: 0 is out of range"),
            "{e}"
        );
        let e = error("tiers:\n  a: { max_pending_requests: many }\n", &[]);
        assert!(e.contains("tiers.a.max_pending_requests"), "{e}");
        let e = error(
            "server:\n  max_pending_requests: 8\ntiers:\n  a:\n    max_pending_requests: 9\n",
            &[],
        );
        assert!(
            e.contains("tiers.a.max_pending_requests")
                && e.contains("9 exceeds server.max_pending_requests (8)"),
            "{e}"
        );
        let e = error(
            "tiers:\n  a: { max_pending_requests: 100 }\n",
            &["server.max_pending_requests=50".into()],
        );
        assert!(
            e.contains("exceeds server.max_pending_requests (50)"),
            "{e}"
        );
    }

    /// `tiers.<name>.max_pending_per_tenant` has the same bounds as the tier's own bound.
    #[test]
    fn a_per_tenant_pending_bound_is_bounded_and_within_the_server_one() {
        let c = Config::from_yaml_str("tiers:\n  a: { max_pending_per_tenant: 2 }\n  b: {}\n", "t")
            .unwrap();
        assert_eq!(c.tiers["a"].max_pending_per_tenant, Some(2));
        assert_eq!(c.tiers["b"].max_pending_per_tenant, None);
        let e = error("tiers:\n  a:\n    max_pending_per_tenant: 0\n", &[]);
        assert!(
            e.starts_with("t.yaml:3: tiers.a.max_pending_per_tenant: 0 is out of range"),
            "{e}"
        );
        let e = error(
            "server:\n  max_pending_requests: 8\ntiers:\n  a:\n    max_pending_per_tenant: 9\n",
            &[],
        );
        assert!(
            e.contains("tiers.a.max_pending_per_tenant")
                && e.contains("9 exceeds server.max_pending_requests (8)"),
            "{e}"
        );
        // Above the tier's own bound, it could never apply; equal to it, it may.
        let e = error(
            "tiers:\n  a: { max_pending_requests: 4, max_pending_per_tenant: 5 }\n",
            &[],
        );
        assert!(
            e.contains("tiers.a.max_pending_per_tenant")
                && e.contains("5 exceeds tiers.a.max_pending_requests (4)"),
            "{e}"
        );
        Config::from_yaml_str(
            "tiers:\n  a: { max_pending_requests: 4, max_pending_per_tenant: 4 }\n",
            "t",
        )
        .unwrap();
    }

    /// A tier name outside `[A-Za-z0-9_-]{1,64}` (it becomes a metric label) is refused at its
    /// own line however it is written (a space, a dot, not ASCII, quoted, in a flow mapping,
    /// empty), the name shown escaped; it was located only when the dotted path `tiers.<name>`
    /// could be found again in the text.
    #[test]
    fn a_bad_tier_name_is_refused_at_its_line() {
        let why = "tier names are 1-64 characters of [A-Za-z0-9_-]";
        for (yaml, line, name) in [
            (
                "model: {}\ntiers:\n  gold tier: { weight: 1 }\n",
                3,
                "gold tier",
            ),
            ("model: {}\ntiers:\n  gold.x: { weight: 1 }\n", 3, "gold.x"),
            ("model: {}\ntiers:\n  \"\u{fc}ber\": {}\n", 3, "\u{fc}ber"),
            ("tiers: { gold: {}, \"bad one\": {} }\n", 1, "bad one"),
            ("tiers:\n  gold: {}\n  \"\": {}\n", 3, ""),
            ("tiers:\n  \"a\\nb\": {}\n", 2, "a\\nb"),
            (
                &format!("tiers:\n  {}: {{}}\n", "t".repeat(65)),
                2,
                &"t".repeat(65),
            ),
        ] {
            let e = error(yaml, &[]);
            assert!(
                e.starts_with(&format!("t.yaml:{line}: tiers: tier name `{name}`: {why}")),
                "{yaml:?}: {e}"
            );
        }
        let c = Config::from_yaml_str(
            &format!("tiers:\n  gold-1_B: {{}}\n  {}: {{}}\n", "t".repeat(64)),
            "t",
        )
        .unwrap();
        assert!(c.tiers.contains_key("gold-1_B"));
        // Through an override, the override is named.
        let e = error("model: {}\n", &["tiers={a b: {}}".into()]);
        assert!(e.contains("tier name `a b`"), "{e}");
    }

    /// `tiers.<name>.max_cpu_loras_per_tenant` is 1 to 4,096 and at most `lora.max_cpu_loras`
    /// (a share larger than the whole could never bind).
    #[test]
    fn a_tenant_s_share_of_adapter_memory_is_bounded_by_the_whole() {
        let c = Config::from_yaml_str(
            "lora:\n  max_cpu_loras: 8\ntiers:\n  a: { max_cpu_loras_per_tenant: 8 }\n  b: {}\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.tiers["a"].max_cpu_loras_per_tenant, Some(8));
        assert_eq!(c.tiers["b"].max_cpu_loras_per_tenant, None);
        let e = error("tiers:\n  a:\n    max_cpu_loras_per_tenant: 0\n", &[]);
        assert!(
            e.starts_with("t.yaml:3: tiers.a.max_cpu_loras_per_tenant: 0 is out of range"),
            "{e}"
        );
        let e = error("tiers:\n  a: { max_cpu_loras_per_tenant: 4097 }\n", &[]);
        assert!(e.contains("tiers.a.max_cpu_loras_per_tenant"), "{e}");
        let e = error(
            "lora:\n  max_cpu_loras: 2\ntiers:\n  a: { max_cpu_loras_per_tenant: 3 }\n",
            &[],
        );
        // The whole sentence, as one line of words (its source once held a run of spaces).
        assert_eq!(
            e,
            "t.yaml:4: tiers.a.max_cpu_loras_per_tenant: 3 exceeds lora.max_cpu_loras (2), the \
             adapters kept in memory for every tenant together"
        );
        let e = error(
            "tiers:\n  a: { max_cpu_loras_per_tenant: 2 }\n",
            &["lora.max_cpu_loras=1".into()],
        );
        assert!(e.contains("2 exceeds lora.max_cpu_loras (1)"), "{e}");
    }

    /// Queue bounds are optional, 1 ms to an hour, the tier's and the scheduler's default,
    /// refused at the value's line or naming the override.
    #[test]
    fn queue_bounds_are_bounded() {
        let c = Config::from_yaml_str(
            "scheduler:\n  max_queue_ms: 30000\ntiers:\n  a: { max_queue_ms: 3600000 }\n  b: {}\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.scheduler.max_queue_ms, Some(30_000));
        assert_eq!(c.tiers["a"].max_queue_ms, Some(3_600_000));
        assert_eq!(c.tiers["b"].max_queue_ms, None);
        assert_eq!(Config::default().scheduler.max_queue_ms, None);
        let e = error("tiers:\n  a:\n    max_queue_ms: 0\n", &[]);
        assert!(
            e.starts_with("t.yaml:3: tiers.a.max_queue_ms: 0 is out of range"),
            "{e}"
        );
        let e = error("scheduler:\n  max_queue_ms: 3600001\n", &[]);
        assert!(e.contains("scheduler.max_queue_ms"), "{e}");
        let e = error("tiers:\n  a: {}\n", &["tiers.a.max_queue_ms=-5".into()]);
        assert!(e.contains("tiers.a.max_queue_ms"), "{e}");
        let e = error("", &["scheduler.max_queue_ms=0".into()]);
        assert!(e.contains("scheduler.max_queue_ms"), "{e}");
    }

    /// The limit on one backend call: unset, 300 s on a device backend and none on the
    /// host's; set, the value on either (0: none); past a day (or below 0) refused at the
    /// value's line or naming the override.
    #[test]
    fn the_step_timeout_is_bounded_zero_is_off_and_unset_is_the_backends() {
        let secs = |s: u64| Some(std::time::Duration::from_secs(s));
        let default = Config::default().scheduler;
        assert_eq!(default.step_timeout_s, None);
        assert_eq!(default.step_timeout(true), secs(300));
        assert_eq!(default.step_timeout(false), None);
        for (yaml, device, host) in [
            ("scheduler:\n  step_timeout_s: 0\n", None, None),
            ("scheduler:\n  step_timeout_s: 60\n", secs(60), secs(60)),
            (
                "scheduler:\n  step_timeout_s: 86400\n",
                secs(86_400),
                secs(86_400),
            ),
            ("scheduler:\n  step_timeout_s: null\n", secs(300), None),
        ] {
            let c = Config::from_yaml_str(yaml, "t").unwrap().scheduler;
            assert_eq!(
                (c.step_timeout(true), c.step_timeout(false)),
                (device, host),
                "{yaml}"
            );
        }
        let e = error(
            "scheduler:\n  max_num_seqs: 8\n  step_timeout_s: 86401\n",
            &[],
        );
        assert!(
            e.starts_with("t.yaml:3: scheduler.step_timeout_s: 86401 is out of range 0..=86400"),
            "{e}"
        );
        let e = error("", &["scheduler.step_timeout_s=-1".into()]);
        assert!(e.contains("scheduler.step_timeout_s"), "{e}");
        assert!(e.contains("-1 is out of range 0..=86400"), "{e}");
    }

    /// A tier's KV quota is optional, a fraction in (0, 1], refused at the value's line or
    /// naming the override.
    #[test]
    fn kv_fractions_are_in_zero_to_one() {
        let c = Config::from_yaml_str(
            "tiers:\n  a: { max_kv_fraction: 0.5 }\n  b: { max_kv_fraction: 1 }\n  c: {}\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.tiers["a"].max_kv_fraction, Some(0.5));
        assert_eq!(c.tiers["b"].max_kv_fraction, Some(1.0));
        assert_eq!(c.tiers["c"].max_kv_fraction, None);
        let e = error("tiers:\n  a:\n    max_kv_fraction: 0\n", &[]);
        assert!(
            e.starts_with("t.yaml:3: tiers.a.max_kv_fraction: 0 must be in (0, 1]"),
            "{e}"
        );
        let e = error("tiers:\n  a: { max_kv_fraction: 1.5 }\n", &[]);
        assert!(
            e.contains("tiers.a.max_kv_fraction: 1.5 must be in (0, 1]"),
            "{e}"
        );
        let e = error("tiers:\n  a: { max_kv_fraction: .nan }\n", &[]);
        assert!(e.contains("tiers.a.max_kv_fraction"), "{e}");
        let e = error(
            "tiers:\n  a: {}\n",
            &["tiers.a.max_kv_fraction=-0.1".into()],
        );
        assert!(e.contains("tiers.a.max_kv_fraction"), "{e}");
    }

    /// A tier's rate limits are optional, requests 1 to 1e9 and tokens 1 to 1e12 per
    /// minute, refused at the value's line or naming the override.
    #[test]
    fn a_tier_rate_limit_is_bounded() {
        let c = Config::from_yaml_str(
            "tiers:\n  a: { requests_per_minute: 60, tokens_per_minute: 1000000000000 }\n  b: {}\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.tiers["a"].requests_per_minute, Some(60));
        assert_eq!(c.tiers["a"].tokens_per_minute, Some(1_000_000_000_000));
        assert_eq!(c.tiers["b"].requests_per_minute, None);
        assert_eq!(c.tiers["b"].tokens_per_minute, None);
        let e = error("tiers:\n  a:\n    tokens_per_minute: 0\n", &[]);
        assert!(
            e.starts_with("t.yaml:3: tiers.a.tokens_per_minute: 0 is out of range"),
            "{e}"
        );
        let e = error("tiers:\n  a:\n    requests_per_minute: 1000000001\n", &[]);
        assert!(e.contains("tiers.a.requests_per_minute"), "{e}");
        let e = error(
            "tiers:\n  a: {}\n",
            &["tiers.a.tokens_per_minute=-5".into()],
        );
        assert!(e.contains("tiers.a.tokens_per_minute"), "{e}");
        let e = error("tiers:\n  a: { requests_per_min: 5 }\n", &[]);
        assert!(e.contains("requests_per_minute"), "{e}");
    }

    /// With `--set`, the field is named likewise, and a section given a scalar is said to
    /// need a mapping, without the Rust type's name.
    #[test]
    fn an_override_out_of_range_or_not_a_mapping_names_the_field() {
        let e = error("", &["lora.max_loras=0".into()]);
        assert_eq!(
            e,
            "override `--set lora.max_loras=0`: field `lora.max_loras`: 0 is out of range 1..=1024"
        );
        let e = error("", &["server=3".into()]);
        assert_eq!(
            e,
            "override `--set server=3`: field `server`: invalid type: integer `3`, expected a \
             mapping (the server section)"
        );
        let e = error("server: 3\n", &[]);
        assert!(
            !e.contains("ServerSection") && e.contains("expected a mapping"),
            "{e}"
        );
        let e = error("", &["scheduler.policy=fcfs".into()]);
        assert!(
            !e.contains("PolicySpec")
                && e.contains("expected a mapping of name and params")
                && e.contains("`--set scheduler.policy.name=fcfs` sets the name alone"),
            "{e}"
        );
    }

    /// A caller's check (the policy registry's) is blamed as `validate`'s rules are: on the
    /// override that set the field, else on the file's line, flow mappings included.
    #[test]
    fn a_callers_check_names_the_override_or_the_files_line() {
        let nope = |c: &Config| {
            if c.scheduler.policy.name == "nope" {
                Err(("scheduler.policy.name".to_string(), "unknown".to_string()))
            } else {
                Ok(())
            }
        };
        let file = "scheduler:\n  max_num_seqs: 8\n  policy: { name: fcfs }   # comment\n";
        let e =
            Config::from_yaml_checked(file, "t.yaml", &["scheduler.policy.name=nope".into()], nope)
                .unwrap_err()
                .to_string();
        assert_eq!(
            e,
            "override `--set scheduler.policy.name=nope`: scheduler.policy.name: unknown"
        );
        let e = Config::from_yaml_checked(
            file,
            "t.yaml",
            &[env("SWITCHYARD__SCHEDULER__POLICY__NAME", "nope")],
            nope,
        )
        .unwrap_err()
        .to_string();
        assert_eq!(
            e,
            "override `SWITCHYARD__SCHEDULER__POLICY__NAME=nope`: scheduler.policy.name: unknown"
        );
        let e = Config::from_yaml_checked(&file.replace("fcfs", "nope"), "t.yaml", &[], nope)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "t.yaml:3: scheduler.policy.name: unknown");
        let block = "scheduler:\n  policy:\n    name: nope\n";
        let e = Config::from_yaml_checked(block, "t.yaml", &[], nope)
            .unwrap_err()
            .to_string();
        assert_eq!(e, "t.yaml:3: scheduler.policy.name: unknown");
    }

    #[test]
    fn a_missing_file_names_its_cause_once() {
        let e = Config::from_file(Path::new("/nonexistent/switchyard.yaml")).unwrap_err();
        assert!(std::error::Error::source(&e).is_none());
        assert_eq!(
            e.to_string(),
            format!(
                "cannot read /nonexistent/switchyard.yaml: {}",
                std::io::Error::from_raw_os_error(2)
            )
        );
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
    fn a_secret_override_is_read_as_written_and_never_shown() {
        // Digits or 0x… are the key itself, as they would be in the file.
        for key in ["123456789012", "0x1f2e3d4c5b6a"] {
            let c = Config::from_yaml_with_overrides(
                "",
                "t.yaml",
                &[env("SWITCHYARD__SERVER__ADMIN_KEY", key)],
            )
            .expect("a key of digits is a key");
            assert_eq!(c.server.admin_key.as_deref(), Some(key));
        }
        // A key of the wrong type in a list of keys (YAML reads it as a number) is refused
        // without showing it.
        let e = error(
            "",
            &["server.api_keys=[{key: 99999999999, tenant: t}]".into()],
        );
        assert!(!e.contains("99999999999"), "{e}");
    }

    #[test]
    fn a_string_field_takes_an_overrides_number_or_boolean_as_written() {
        let ok = |o: Override| {
            Config::from_yaml_with_overrides("", "t.yaml", &[o])
                .expect("a string field takes the text")
                .model
                .served_name
        };
        for text in ["123", "0x10", "1e3", "007", "true", "1.50"] {
            assert_eq!(
                ok(format!("model.served_name={text}").into()),
                Some(text.to_string())
            );
            assert_eq!(
                ok(env("SWITCHYARD__MODEL__SERVED_NAME", text)),
                Some(text.to_string())
            );
        }
        // A string value is YAML's reading, as before (quotes removed).
        assert_eq!(
            ok("model.served_name='0x10'".into()),
            Some("0x10".to_string())
        );
        // Later overrides still win, whichever of them is a number.
        let c = Config::from_yaml_with_overrides(
            "",
            "t.yaml",
            &[
                "model.served_name=abc".into(),
                "model.served_name=42".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.model.served_name.as_deref(), Some("42"));
        // Number fields are unchanged: a number is a number, and errors say what they said.
        let c =
            Config::from_yaml_with_overrides("", "t.yaml", &["server.port=9000".into()]).unwrap();
        assert_eq!(c.server.port, 9000);
        assert_eq!(
            error("", &["server.port=99999".into()]),
            "override `--set server.port=99999`: field `server.port`: 99999 is out of range \
             0..=65535"
        );
        assert_eq!(
            error("", &["server.port=abc".into()]),
            "override `--set server.port=abc`: field `server.port`: invalid type: \
             string \"abc\", expected an integer in 0..=65535"
        );
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

    /// The CUDA backend runs at most 65,536 tokens a step: a config that names it is refused
    /// at the user's field, on any machine; `auto` and `cpu` take up to 1,048,576.
    #[test]
    fn a_cuda_config_with_more_batched_tokens_than_the_cuda_backend_runs_is_refused() {
        let yaml = |backend: &str, tokens: usize| {
            format!(
                "model:\n  backend: {backend}\nscheduler:\n  max_num_batched_tokens: {tokens}\n"
            )
        };
        assert_eq!(
            error(&yaml("cuda", 65_537), &[]),
            "t.yaml:4: scheduler.max_num_batched_tokens: 65537 is more than the CUDA backend \
             (model.backend: cuda) runs in one step, at most 65536"
        );
        Config::from_yaml_str(&yaml("cuda", 65_536), "t").unwrap();
        Config::from_yaml_str(&yaml("auto", 1 << 20), "t").unwrap();
        Config::from_yaml_str(&yaml("cpu", 1 << 20), "t").unwrap();
        // Set by an override, the override is named.
        let e = error(
            &yaml("cuda", 8192),
            &["scheduler.max_num_batched_tokens=100000".into()],
        );
        assert!(
            e.contains("--set scheduler.max_num_batched_tokens=100000")
                && e.contains("at most 65536"),
            "{e}"
        );
    }

    /// A setting of one backend with the other named in `model.backend` is refused at its
    /// field before the model loads, as the backend would refuse it after; `auto` is not.
    #[test]
    fn a_backend_only_setting_with_the_other_backend_named_is_refused() {
        let yaml = |backend: &str, field: &str| format!("model:\n  backend: {backend}\n{field}\n");
        assert_eq!(
            error(&yaml("cuda", "  cpu_precision: int8"), &[]),
            "t.yaml:3: model.cpu_precision: int8 applies to the CPU backend only \
             (model.backend: cuda computes in bf16): leave it at auto"
        );
        assert_eq!(
            error(&yaml("cpu", "  quantization: fp8"), &[]),
            "t.yaml:3: model.quantization: fp8 runs on the CUDA backend only (model.backend: \
             cpu runs a GGUF's own quantized types)"
        );
        assert_eq!(
            error(&yaml("cpu", "cache:\n  kv_cache_dtype: fp8"), &[]),
            "t.yaml:4: cache.kv_cache_dtype: fp8 runs on the CUDA backend only \
             (model.backend: cpu keeps its cache in f16)"
        );
        // The backend's own settings, and `auto`, which picks one at start, pass.
        Config::from_yaml_str(&yaml("cpu", "  cpu_precision: int8"), "t").unwrap();
        Config::from_yaml_str(&yaml("auto", "  cpu_precision: precise"), "t").unwrap();
        Config::from_yaml_str(&yaml("cuda", "  quantization: fp8"), "t").unwrap();
        Config::from_yaml_str(&yaml("auto", "cache:\n  kv_cache_dtype: fp8"), "t").unwrap();
        // Set by an override, the override is named.
        let e = error(&yaml("cuda", ""), &["model.cpu_precision=mixed".into()]);
        assert!(
            e.contains("--set model.cpu_precision=mixed") && e.contains("mixed applies"),
            "{e}"
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
