//! `key.path=value` overrides from CLI flags (`--set`) and the environment
//! (`SWITCHYARD__SERVER__PORT=9000` becomes `server.port=9000`).

use crate::ConfigError;
use serde_yaml::Value;

/// Most path segments an override may have.
const MAX_DEPTH: usize = 8;

/// Sets `path=value` in a YAML value tree; the value is parsed as a YAML scalar or flow
/// collection, so `port=9000` is a number and `name=fcfs` a string.
pub fn apply_override(root: &mut Value, text: &str) -> Result<(), ConfigError> {
    let err = |message: &str| ConfigError::Override {
        text: text.to_string(),
        message: message.to_string(),
    };
    let (path, raw) = text
        .split_once('=')
        .ok_or_else(|| err("expected key.path=value"))?;
    let segments: Vec<&str> = path.trim().split('.').collect();
    if segments.is_empty() || segments.len() > MAX_DEPTH || segments.iter().any(|s| s.is_empty()) {
        return Err(err("the key must be a dotted path such as server.port"));
    }
    let value: Value =
        serde_yaml::from_str(raw).map_err(|e| err(&format!("value is not valid YAML: {e}")))?;
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

/// Collects overrides from environment variables named `SWITCHYARD__A__B=value`.
pub fn env_overrides<I: IntoIterator<Item = (String, String)>>(vars: I) -> Vec<String> {
    let mut out: Vec<String> = vars
        .into_iter()
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix("SWITCHYARD__")?;
            let path = rest
                .split("__")
                .map(|s| s.to_ascii_lowercase())
                .collect::<Vec<_>>()
                .join(".");
            Some(format!("{path}={v}"))
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sets_nested_values_with_yaml_types() {
        let mut v: Value = serde_yaml::from_str("server: { port: 80 }").unwrap();
        apply_override(&mut v, "server.port=9000").unwrap();
        apply_override(&mut v, "scheduler.policy.name=priority").unwrap();
        assert_eq!(v["server"]["port"], Value::from(9000));
        assert_eq!(v["scheduler"]["policy"]["name"], Value::from("priority"));
    }

    #[test]
    fn rejects_malformed_overrides() {
        let mut v = Value::Null;
        assert!(apply_override(&mut v, "noequals").is_err());
        assert!(apply_override(&mut v, "a..b=1").is_err());
    }

    #[test]
    fn environment_names_become_paths() {
        let vars = vec![
            ("SWITCHYARD__SERVER__PORT".to_string(), "1".to_string()),
            ("PATH".into(), "x".into()),
        ];
        assert_eq!(env_overrides(vars), vec!["server.port=1".to_string()]);
    }
}
