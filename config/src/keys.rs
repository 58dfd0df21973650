//! API keys: the inline `server.api_keys` and the list in `server.api_keys_file`, checked
//! together (no key twice, none equal to the admin key). Errors name fields and entries, never
//! a key.

use crate::file::{self, expand_home, ReadError};
use crate::{ApiKeyEntry, Config, ConfigError, MAX_CONFIG_BYTES};

/// The field that names the keys file.
const FILE_FIELD: &str = "server.api_keys_file";

/// The key-related rules of the inline keys alone (run by [`Config::validate`]): no key
/// listed twice, and the admin key not among them. Returns the field at fault and why.
pub(crate) fn check_inline(config: &Config) -> Result<(), (String, String)> {
    let keys = &config.server.api_keys;
    for (i, k) in keys.iter().enumerate() {
        if let Some(j) = keys[..i].iter().position(|o| o.key == k.key) {
            return Err((
                format!("server.api_keys[{i}].key"),
                format!("the same key as server.api_keys[{j}]: each key must be unique"),
            ));
        }
        if config.server.admin_key.as_deref() == Some(k.key.as_str()) {
            return Err((
                "server.admin_key".into(),
                format!(
                    "equal to server.api_keys[{i}]: the admin key must differ from every API key"
                ),
            ));
        }
    }
    Ok(())
}

impl Config {
    /// Every API key the server accepts: the inline `server.api_keys`, then the entries of
    /// `server.api_keys_file` (read now, a regular file of at most [`MAX_CONFIG_BYTES`], `~`
    /// expanded). A keys file that is set but holds no key is refused (the API would be open
    /// to anyone while the operator meant to close it), as is a key given twice or equal to
    /// the admin key. An empty list means an open API.
    pub fn load_api_keys(&self) -> Result<Vec<ApiKeyEntry>, ConfigError> {
        let mut keys = self.server.api_keys.clone();
        let Some(name) = &self.server.api_keys_file else {
            return Ok(keys);
        };
        let path = expand_home(name);
        let shown = path.display().to_string();
        let invalid = |field: String, message: String| ConfigError::Invalid {
            file: shown.clone(),
            line: None,
            field,
            message,
        };
        let text = file::read_text(&path, MAX_CONFIG_BYTES).map_err(|e| {
            let why = match e {
                ReadError::Io(e) => format!("cannot read it{}: {e}", file::relative_note(&path)),
                ReadError::Invalid(m) => m,
            };
            invalid(FILE_FIELD.into(), why)
        })?;
        let entries: Option<Vec<ApiKeyEntry>> = if text.trim().is_empty() {
            None
        } else {
            serde_yaml::from_str(&text).map_err(|e| ConfigError::Parse {
                file: shown.clone(),
                line: e.location().map(|l| l.line()),
                message: format!(
                    "{FILE_FIELD}: expected a list of {{key, tenant, tier, adapters}} entries: {}",
                    crate::with_did_you_mean(&e.to_string())
                ),
            })?
        };
        let entries = entries.unwrap_or_default();
        if entries.is_empty() {
            return Err(invalid(
                FILE_FIELD.into(),
                "the file holds no API keys, which would leave the API open to anyone; list \
                 keys in it, or remove server.api_keys_file to serve without keys"
                    .into(),
            ));
        }
        let inline = keys.len();
        for (i, k) in entries.into_iter().enumerate() {
            let at = |field: &str| format!("{FILE_FIELD}[{i}].{field}");
            k.check(&self.tiers)
                .map_err(|(field, why)| invalid(at(field), why))?;
            if let Some(j) = keys.iter().position(|o| o.key == k.key) {
                let other = if j < inline {
                    format!("server.api_keys[{j}]")
                } else {
                    format!("{FILE_FIELD}[{}]", j - inline)
                };
                return Err(invalid(
                    at("key"),
                    format!("the same key as {other}: each key must be unique"),
                ));
            }
            if self.server.admin_key.as_deref() == Some(k.key.as_str()) {
                return Err(invalid(
                    at("key"),
                    "equal to server.admin_key: the admin key must differ from every API key"
                        .into(),
                ));
            }
            keys.push(k);
        }
        Ok(keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The configuration `yaml` with `server.api_keys_file` pointing at a file holding
    /// `keys`; returns what loading the keys gives.
    fn load(tag: &str, yaml: &str, keys: &[u8]) -> Result<Vec<ApiKeyEntry>, ConfigError> {
        let d = crate::scratch::ScratchDir::new(&format!("keys-{tag}"));
        let f = d.join("keys.yaml");
        std::fs::write(&f, keys).unwrap();
        let cfg = Config::from_yaml_str(
            &format!("server:\n  api_keys_file: {}\n{yaml}", f.display()),
            "t.yaml",
        )
        .unwrap();
        cfg.load_api_keys()
    }

    #[test]
    fn a_keys_file_without_keys_is_refused_naming_the_field() {
        for (tag, body) in [
            ("zero", &b""[..]),
            ("comments", b"# keys go here\n\n"),
            ("list", b"[]\n"),
            ("null", b"~\n"),
        ] {
            let e = load(tag, "", body).unwrap_err().to_string();
            assert!(
                e.contains("server.api_keys_file") && e.contains("no API keys"),
                "{tag}: {e}"
            );
        }
        // Inline keys do not excuse an empty file: the operator meant it to hold some.
        let e = load(
            "inline",
            "  api_keys: [{ key: inline-key-0001, tenant: a }]\n",
            b"[]",
        )
        .unwrap_err();
        assert!(e.to_string().contains("no API keys"), "{e}");
    }

    #[test]
    fn keys_file_entries_are_read_after_the_inline_ones() {
        let keys = load(
            "ok",
            "  api_keys: [{ key: inline-key-0001, tenant: a }]\n",
            b"- { key: file-key-00001, tenant: b }\n",
        )
        .unwrap();
        let tenants: Vec<&str> = keys.iter().map(|k| k.tenant.as_str()).collect();
        assert_eq!(tenants, ["a", "b"]);
    }

    #[test]
    fn a_keys_file_that_is_not_utf8_or_not_a_list_is_named() {
        let e = load("utf8", "", b"- { key: \xff\xfe, tenant: b }\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("keys.yaml") && e.contains("UTF-8") && e.contains("server.api_keys_file"),
            "{e}"
        );
        let e = load("shape", "", b"key: abc\n").unwrap_err().to_string();
        assert!(e.contains("keys.yaml") && e.contains("a list"), "{e}");
        let e = load("short", "", b"- { key: short, tenant: b }\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("server.api_keys_file[0].key"), "{e}");
        let cfg =
            Config::from_yaml_str("server:\n  api_keys_file: /nonexistent/k.yaml\n", "t").unwrap();
        let e = cfg.load_api_keys().unwrap_err().to_string();
        assert!(
            e.contains("/nonexistent/k.yaml")
                && e.contains("cannot read")
                && !e.contains("relative"),
            "{e}"
        );
        // A relative path is read against the working directory, not the file's: said so.
        let cfg = Config::from_yaml_str("server:\n  api_keys_file: no-such/k.yaml\n", "t").unwrap();
        let e = cfg.load_api_keys().unwrap_err().to_string();
        let cwd = std::env::current_dir().unwrap();
        assert!(
            e.contains(&format!(
                "cannot read it (relative to the working directory {}): ",
                cwd.display()
            )),
            "{e}"
        );
    }

    #[test]
    fn duplicate_keys_and_an_admin_key_equal_to_an_api_key_are_refused() {
        let e = load(
            "dup",
            "  api_keys: [{ key: same-key-00001, tenant: a }]\n",
            b"- { key: other-key-0001, tenant: b }\n- { key: same-key-00001, tenant: c }\n",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("server.api_keys_file[1].key") && e.contains("server.api_keys[0]"),
            "{e}"
        );
        assert!(!e.contains("same-key-00001"), "the key leaked: {e}");
        let e = load(
            "admin",
            "  admin_key: admin-key-00001\n",
            b"- { key: admin-key-00001, tenant: b }\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("server.admin_key"), "{e}");
        let e = Config::from_yaml_str(
            "server:\n  api_keys:\n    - key: k-00000001\n      tenant: a\n    - key: k-00000001\n      tenant: b\n",
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("t.yaml:5: server.api_keys[1].key"), "{e}");
        let e = Config::from_yaml_str(
            "server:\n  admin_key: k-00000001\n  api_keys:\n    - { key: k-00000001, tenant: a }\n",
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("t.yaml:2: server.admin_key"), "{e}");
    }

    /// A key's `adapters` are names or prefixes ending in `*`, bounded; a bad one is named
    /// with its entry, inline and in the keys file.
    #[test]
    fn key_adapter_patterns_are_checked() {
        let keys = load(
            "patterns",
            "",
            b"- { key: file-key-00001, tenant: b, adapters: [acme-*, shared.v1, '*'] }\n- { key: file-key-00002, tenant: c, adapters: [] }\n",
        )
        .unwrap();
        assert_eq!(
            keys[0].adapters.as_deref(),
            Some(&["acme-*".to_string(), "shared.v1".into(), "*".into()][..])
        );
        assert_eq!(keys[1].adapters.as_deref(), Some(&[][..]));
        for (bad, says) in [
            ("'a*b'", "may only end"),
            ("'**'", "may only end"),
            ("'a/*'", "ASCII letters"),
            ("'..'", "not"),
            ("''", "1 to 128"),
        ] {
            let e = load(
                "bad-pattern",
                "",
                format!("- {{ key: file-key-00001, tenant: b, adapters: [{bad}] }}\n").as_bytes(),
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("server.api_keys_file[0].adapters") && e.contains(says),
                "{bad}: {e}"
            );
        }
        let long = format!(
            "[{}]",
            vec!["a"; crate::MAX_ADAPTER_PATTERNS + 1].join(", ")
        );
        let e = Config::from_yaml_str(
            &format!(
                "server:\n  api_keys:\n    - {{ key: k-00000001, tenant: a, adapters: {long} }}\n"
            ),
            "t.yaml",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("server.api_keys[0].adapters") && e.contains("at most 256"),
            "{e}"
        );
        let prefix = format!("{}*", "p".repeat(crate::MAX_ADAPTER_NAME));
        assert!(
            crate::check_adapter_pattern(&prefix).is_err(),
            "no name fits after it"
        );
        assert!(crate::check_adapter_pattern(&prefix[1..]).is_ok());
    }
}
