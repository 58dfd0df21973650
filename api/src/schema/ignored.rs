//! Fields a request carries that no endpoint reads: accepted, as OpenAI's and vLLM's servers
//! accept them, and named in one warning per request, as vLLM logs "fields were present in the
//! request but ignored", so that a misspelt field (`max_token`) is found in the log. A field
//! sent as `null` is a field not set, and is not named.
//!
//! [`IgnoredFields`] is a request body's `#[serde(flatten)]` catch-all, declared after every
//! other flattened struct (each takes its own keys first): it is filled during the one parse of
//! the body and keeps at most [`MAX_IGNORED_NAMES`] names of at most
//! [`MAX_IGNORED_NAME_CHARS`] characters each, skipping the values unread.

use std::fmt;

use serde::de::{IgnoredAny, MapAccess, Visitor};
use serde::{Deserialize, Deserializer};

/// Most ignored field names kept (and logged) per request.
pub const MAX_IGNORED_NAMES: usize = 16;

/// Longest ignored field name kept, in characters; longer ones are cut and end with `…`.
pub const MAX_IGNORED_NAME_CHARS: usize = 64;

/// The top-level fields of a request body that no endpoint reads.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IgnoredFields {
    /// The first [`MAX_IGNORED_NAMES`] names, each cut to [`MAX_IGNORED_NAME_CHARS`].
    names: Vec<String>,
    /// How many fields there were in all.
    count: usize,
}

impl IgnoredFields {
    /// The names kept, in the body's order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The warning's list (`"a", "b" and 3 more`), or `None` when nothing was ignored.
    pub fn summary(&self) -> Option<String> {
        if self.count == 0 {
            return None;
        }
        let mut text = self
            .names
            .iter()
            .map(|n| format!("{n:?}"))
            .collect::<Vec<_>>()
            .join(", ");
        let more = self.count.saturating_sub(self.names.len());
        if more > 0 {
            text.push_str(&format!(" and {more} more"));
        }
        Some(text)
    }

    /// Logs the one warning of a request to `route`, if it carried fields no one reads (inside
    /// the request's log span, which names the request and its tier).
    pub fn warn(&self, route: &str) {
        if let Some(fields) = self.summary() {
            tracing::warn!(
                route,
                %fields,
                "fields were present in the request but ignored"
            );
        }
    }
}

impl<'de> Deserialize<'de> for IgnoredFields {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(IgnoredVisitor)
    }
}

struct IgnoredVisitor;

impl<'de> Visitor<'de> for IgnoredVisitor {
    type Value = IgnoredFields;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of fields")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut fields = IgnoredFields::default();
        while let Some(name) = map.next_key::<String>()? {
            // A null is a field not set (as OpenAI's SDKs send unset fields, `"store": null`):
            // nothing was ignored.
            if map.next_value::<Option<IgnoredAny>>()?.is_none() {
                continue;
            }
            fields.count = fields.count.saturating_add(1);
            if fields.names.len() < MAX_IGNORED_NAMES {
                let mut kept: String = name.chars().take(MAX_IGNORED_NAME_CHARS).collect();
                if kept.len() < name.len() {
                    kept.push('…');
                }
                fields.names.push(kept);
            }
        }
        Ok(fields)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::{ChatRequest, CompletionRequest};
    use serde_json::json;

    /// Fields no endpoint reads are collected during the one parse; known fields, flattened
    /// ones (`response_format`, `guided_regex`) included, are not.
    #[test]
    fn unknown_fields_are_collected_and_known_ones_are_not() {
        let body = json!({"prompt": "x", "max_token": 3, "temperature": 0.5,
            "guided_regex": "a", "tempreature": 1, "stream": false});
        let request: CompletionRequest = serde_json::from_value(body).unwrap();
        assert_eq!(request.ignored.names(), ["max_token", "tempreature"]);
        assert_eq!(request.temperature, Some(0.5));
        assert_eq!(request.structured.guided_regex.as_deref(), Some("a"));
        assert_eq!(
            request.ignored.summary().as_deref(),
            Some("\"max_token\", \"tempreature\"")
        );
        let body = json!({"messages": [], "response_format": {"type": "text"},
            "reasoning_effort": "low", "service_tier": "auto", "store": true});
        let request: ChatRequest = serde_json::from_value(body).unwrap();
        assert_eq!(request.ignored.names(), ["store"]);
        // vLLM's sampling extras are read, not ignored.
        let body = json!({"prompt": "x", "allowed_token_ids": [1], "bad_words": ["a"],
            "return_tokens_as_token_ids": true});
        let request: CompletionRequest = serde_json::from_value(body).unwrap();
        assert_eq!(request.ignored.summary(), None);
        assert_eq!(request.return_tokens_as_token_ids, Some(true));
        let body = json!({"messages": [], "allowed_token_ids": [1], "bad_words": ["a"],
            "return_tokens_as_token_ids": false});
        let request: ChatRequest = serde_json::from_value(body).unwrap();
        assert_eq!(request.ignored.summary(), None);
        let body = json!({"messages": [], "max_tokens": 1});
        let request: ChatRequest = serde_json::from_value(body).unwrap();
        assert_eq!(request.ignored.summary(), None);
    }

    /// A field sent as null is not set: no warning names it, on any route's body (all take
    /// this catch-all: completions, chat, `/tokenize`, `/detokenize`).
    #[test]
    fn null_fields_are_not_reported() {
        let body = json!({"prompt": "x", "store": null, "metadata": null, "max_token": 3});
        let request: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(request.ignored.names(), ["max_token"]);
        assert_eq!(request.ignored.summary().as_deref(), Some("\"max_token\""));
        let request: CompletionRequest =
            crate::body::parse_json(body.to_string().as_bytes()).unwrap();
        assert_eq!(request.ignored.names(), ["max_token"]);
        let body = json!({"messages": [], "store": null, "service_tier": null});
        let request: ChatRequest = serde_json::from_value(body.clone()).unwrap();
        assert_eq!(request.ignored.summary(), None);
        let request: ChatRequest = crate::body::parse_json(body.to_string().as_bytes()).unwrap();
        assert_eq!(request.ignored.summary(), None);
        // The catch-all alone, as `/tokenize` and `/detokenize` flatten it.
        let alone: IgnoredFields =
            serde_json::from_value(json!({"a": null, "b": 0, "c": false, "d": {}})).unwrap();
        assert_eq!(alone.names(), ["b", "c", "d"]);
    }

    #[test]
    fn the_names_kept_are_bounded() {
        let mut body = serde_json::Map::new();
        body.insert("prompt".into(), json!("x"));
        for i in 0..40 {
            body.insert(format!("extra{i:02}"), json!({"deep": [1, 2, 3]}));
        }
        body.insert("y".repeat(1000), json!(1));
        let request: CompletionRequest =
            serde_json::from_value(serde_json::Value::Object(body)).unwrap();
        assert_eq!(request.ignored.names().len(), MAX_IGNORED_NAMES);
        assert_eq!(request.ignored.names()[0], "extra00");
        assert!(request
            .ignored
            .summary()
            .unwrap()
            .ends_with("\"extra15\" and 25 more"));
        let mut long = serde_json::Map::new();
        long.insert("prompt".into(), json!("x"));
        long.insert("é".repeat(100), json!(1));
        let request: CompletionRequest =
            serde_json::from_value(serde_json::Value::Object(long)).unwrap();
        assert_eq!(
            request.ignored.names()[0].chars().count(),
            MAX_IGNORED_NAME_CHARS + 1
        );
    }
}
