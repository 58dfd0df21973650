//! `key.path=value` overrides from CLI flags (`--set`) and the environment
//! (`SWITCHYARD__SERVER__PORT=9000` becomes `server.port=9000`).

use std::ffi::OsString;
use std::fmt;

use crate::ConfigError;
use serde_yaml::Value;

/// Most path segments an override may have.
const MAX_DEPTH: usize = 8;

/// The prefix of the environment variables read as overrides.
pub const ENV_PREFIX: &str = "SWITCHYARD__";

/// Where an override came from, so that an error can name it as the operator wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum OverrideSource {
    /// A `--set key.path=value` flag.
    Flag,
    /// An environment variable, by name (`SWITCHYARD__SERVER__PORT`).
    Env(String),
}

/// One `key.path=value` override of a configuration field.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Override {
    /// `key.path=value` as it is applied (an environment variable's name already turned into
    /// the dotted path).
    pub text: String,
    /// Where it came from.
    pub source: OverrideSource,
}

impl Override {
    /// A `--set` flag's override.
    pub fn flag(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            source: OverrideSource::Flag,
        }
    }

    /// The dotted field path it sets (`server.port`), trimmed; the whole text when it has
    /// no `=`.
    pub fn path(&self) -> &str {
        self.text
            .split_once('=')
            .map_or(self.text.as_str(), |(p, _)| p)
            .trim()
    }

    /// The value as written.
    fn value(&self) -> &str {
        self.text.split_once('=').map_or("", |(_, v)| v)
    }

    /// Whether the value parses as a YAML number or boolean (`123`, `0x1f`, `1e3`, `true`),
    /// which a string field takes as the text written.
    pub(crate) fn reads_as_number_or_bool(&self) -> bool {
        matches!(
            serde_yaml::from_str::<Value>(self.value()),
            Ok(Value::Number(_) | Value::Bool(_))
        )
    }

    /// Whether the field at `field` (a dotted path with list indices, as
    /// [`Config::validate`](crate::Config::validate) names fields) is this override's field,
    /// lies inside it, or holds it.
    pub fn covers(&self, field: &str) -> bool {
        let path = self.path();
        let inside = |outer: &str, inner: &str| {
            inner
                .strip_prefix(outer)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', '[']))
        };
        !path.is_empty() && (inside(path, field) || inside(field, path))
    }
}

/// Whether a field holds a secret (an API key or the admin key), whose value errors and
/// printed configurations leave out.
pub(crate) fn is_secret_path(path: &str) -> bool {
    let mut segments = path.split('.').map(|s| s.split('[').next().unwrap_or(s));
    segments.any(|s| s == "admin_key" || s == "api_keys" || s == "key")
}

impl fmt::Display for Override {
    /// `--set server.port=9000`, or `SWITCHYARD__SERVER__PORT=9000` for an environment
    /// variable; the value of a secret is shown as `<redacted>`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = if is_secret_path(self.path()) {
            "<redacted>"
        } else {
            self.value()
        };
        match &self.source {
            OverrideSource::Flag if !self.text.contains('=') => write!(f, "--set {}", self.text),
            OverrideSource::Flag => write!(f, "--set {}={value}", self.path()),
            OverrideSource::Env(name) => write!(f, "{name}={value}"),
        }
    }
}

impl From<&str> for Override {
    fn from(text: &str) -> Self {
        Self::flag(text)
    }
}

impl From<String> for Override {
    fn from(text: String) -> Self {
        Self::flag(text)
    }
}

/// Whether a field holds one secret string (the admin key, an API key's `key`), which an
/// override sets as written: parsed as YAML, a key of digits (`123456789`) or `0x…` would be a
/// number, refused (and shown by the type error) or turned into another string.
fn is_secret_scalar_path(path: &str) -> bool {
    path.rsplit('.')
        .next()
        .is_some_and(|last| last == "admin_key" || last == "key")
}

/// Sets `path=value` in a YAML value tree; the value is parsed as a YAML scalar or flow
/// collection, so `port=9000` is a number and `name=fcfs` a string, except a secret's
/// (`server.admin_key`), which is the string as written, and any value when `as_text` (a
/// string field given what YAML reads as a number: see
/// [`Config::from_yaml_with_overrides`](crate::Config::from_yaml_with_overrides)).
pub fn apply_override(root: &mut Value, o: &Override, as_text: bool) -> Result<(), ConfigError> {
    let err = |message: &str| ConfigError::Override {
        text: o.to_string(),
        message: message.to_string(),
    };
    let (path, raw) = o
        .text
        .split_once('=')
        .ok_or_else(|| err("expected key.path=value"))?;
    let segments: Vec<&str> = path.trim().split('.').collect();
    if segments.is_empty() || segments.len() > MAX_DEPTH || segments.iter().any(|s| s.is_empty()) {
        return Err(err("the key must be a dotted path such as server.port"));
    }
    let value: Value = if as_text || is_secret_scalar_path(path.trim()) {
        Value::String(raw.to_string())
    } else {
        serde_yaml::from_str(raw).map_err(|e| err(&format!("value is not valid YAML: {e}")))?
    };
    let mut node = root;
    for seg in &segments[..segments.len() - 1] {
        if !node.is_mapping() {
            *node = Value::Mapping(Default::default());
        }
        let map = node.as_mapping_mut().ok_or_else(|| err("not a mapping"))?;
        node = map
            .entry(Value::String((*seg).to_string()))
            .or_insert(Value::Null);
    }
    if !node.is_mapping() {
        *node = Value::Mapping(Default::default());
    }
    let map = node.as_mapping_mut().ok_or_else(|| err("not a mapping"))?;
    map.insert(
        Value::String(segments[segments.len() - 1].to_string()),
        value,
    );
    Ok(())
}

/// Collects overrides from environment variables named `SWITCHYARD__A__B=value`, sorted by
/// name. Variables without the prefix are not looked at (whatever their encoding); one with
/// the prefix whose name or value is not UTF-8 is an error naming it.
pub fn env_overrides<I>(vars: I) -> Result<Vec<Override>, ConfigError>
where
    I: IntoIterator<Item = (OsString, OsString)>,
{
    let mut out = Vec::new();
    for (key, value) in vars {
        if !key.as_encoded_bytes().starts_with(ENV_PREFIX.as_bytes()) {
            continue;
        }
        let name = key.into_string().map_err(|k| ConfigError::Env {
            var: k.to_string_lossy().into_owned(),
            message: "the variable's name is not valid UTF-8".into(),
        })?;
        let value = value.into_string().map_err(|_| ConfigError::Env {
            var: name.clone(),
            message: "the value is not valid UTF-8".into(),
        })?;
        let path = name[ENV_PREFIX.len()..]
            .split("__")
            .map(|s| s.to_ascii_lowercase())
            .collect::<Vec<_>>()
            .join(".");
        out.push(Override {
            text: format!("{path}={value}"),
            source: OverrideSource::Env(name),
        });
    }
    out.sort_by(|a, b| a.text.cmp(&b.text));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStringExt;

    fn apply(v: &mut Value, text: &str) -> Result<(), ConfigError> {
        apply_override(v, &text.into(), false)
    }

    #[test]
    fn sets_nested_values_with_yaml_types() {
        let mut v: Value = serde_yaml::from_str("server: { port: 80 }").unwrap();
        apply(&mut v, "server.port=9000").unwrap();
        apply(&mut v, "scheduler.policy.name=priority").unwrap();
        assert_eq!(v["server"]["port"], Value::from(9000));
        assert_eq!(v["scheduler"]["policy"]["name"], Value::from("priority"));
    }

    #[test]
    fn a_secret_is_the_string_as_written() {
        let mut v = Value::Null;
        for key in ["123456789", "0x1f2e3d4c5b6a", "true", "'quoted'", "[a]"] {
            apply(&mut v, &format!("server.admin_key={key}")).unwrap();
            assert_eq!(v["server"]["admin_key"], Value::from(key));
        }
        // Other fields keep YAML's types.
        apply(&mut v, "server.port=0x10").unwrap();
        assert_eq!(v["server"]["port"], Value::from(16));
    }

    #[test]
    fn rejects_malformed_overrides() {
        let mut v = Value::Null;
        assert!(apply(&mut v, "noequals").is_err());
        let e = apply(&mut v, "a..b=1").unwrap_err().to_string();
        assert!(e.contains("--set a..b=1"), "{e}");
    }

    #[test]
    fn environment_names_become_paths() {
        let vars = vec![
            ("SWITCHYARD__SERVER__PORT".into(), "1".into()),
            ("PATH".into(), "x".into()),
        ];
        let o = env_overrides(vars).unwrap();
        assert_eq!(o.len(), 1);
        assert_eq!(o[0].text, "server.port=1");
        assert_eq!(o[0].to_string(), "SWITCHYARD__SERVER__PORT=1");
    }

    #[test]
    fn variables_that_are_not_utf8_are_ignored_unless_they_are_overrides() {
        let bad = || OsString::from_vec(vec![b'a', 0xff, b'b']);
        // An unrelated variable may hold anything (this once panicked at start).
        let vars = vec![
            (OsString::from("LC_WEIRD"), bad()),
            (OsString::from_vec(vec![b'X', 0xfe]), "v".into()),
        ];
        assert_eq!(env_overrides(vars).unwrap(), vec![]);
        let e = env_overrides(vec![("SWITCHYARD__SERVER__HOST".into(), bad())]).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("SWITCHYARD__SERVER__HOST") && text.contains("UTF-8"),
            "{text}"
        );
        let mut name = b"SWITCHYARD__SERVER__".to_vec();
        name.push(0xff);
        let e = env_overrides(vec![(OsString::from_vec(name), "1".into())]).unwrap_err();
        assert!(e.to_string().contains("SWITCHYARD__SERVER__"), "{e}");
    }

    #[test]
    fn secrets_are_redacted_when_an_override_is_named() {
        assert_eq!(
            Override::flag("server.admin_key=hunter2-hunter2").to_string(),
            "--set server.admin_key=<redacted>"
        );
        let o = Override {
            text: "server.api_keys=[{key: k, tenant: t}]".into(),
            source: OverrideSource::Env("SWITCHYARD__SERVER__API_KEYS".into()),
        };
        assert_eq!(o.to_string(), "SWITCHYARD__SERVER__API_KEYS=<redacted>");
        assert_eq!(
            Override::flag("server.api_keys_file=/k.yaml").to_string(),
            "--set server.api_keys_file=/k.yaml"
        );
    }

    #[test]
    fn an_override_covers_its_field_and_what_lies_inside_or_around_it() {
        let o = Override::flag("server.api_keys=[]");
        assert!(o.covers("server.api_keys"));
        assert!(o.covers("server.api_keys[1].key"));
        assert!(o.covers("server"));
        assert!(!o.covers("server.api_keys_file"));
        assert!(!o.covers("server.admin_key"));
        assert!(Override::flag("tiers.Bad!.weight=2").covers("tiers.Bad!"));
    }
}
