//! OpenAI chat fields this server reads only to check them: the deprecated `functions` /
//! `function_call` (refused: `tools` / `tool_choice` replace them), audio output (`modalities`
//! other than `"text"`, `audio`: refused, the model writes text), and `service_tier` and
//! `reasoning_effort`, which must be one of OpenAI's values and otherwise change nothing here
//! (one tier of service; no model here reads an effort).

use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// OpenAI's `service_tier` values.
pub const SERVICE_TIERS: [&str; 5] = ["auto", "default", "flex", "priority", "scale"];

/// OpenAI's `reasoning_effort` values.
pub const REASONING_EFFORTS: [&str; 4] = ["minimal", "low", "medium", "high"];

/// The fields, as the client sent them (flattened into the chat request).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatExtras {
    /// Deprecated: functions the model may call (`tools` replaced it).
    pub functions: Option<Value>,
    /// Deprecated: how functions may be called (`tool_choice` replaced it).
    pub function_call: Option<Value>,
    /// Output modalities; only `"text"`.
    pub modalities: Option<Value>,
    /// Audio output settings; not supported.
    pub audio: Option<Value>,
    /// OpenAI's service tier; checked, one tier is served.
    pub service_tier: Option<Value>,
    /// OpenAI's reasoning effort; checked, read by no model here.
    pub reasoning_effort: Option<Value>,
}

impl ChatExtras {
    /// Refuses what cannot be honoured and values outside OpenAI's enums, naming the field.
    pub fn validate(&self) -> Result<(), ApiError> {
        match &self.functions {
            None | Some(Value::Null) => {}
            Some(Value::Array(list)) if list.is_empty() => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    "functions",
                    "functions is deprecated and not supported: use tools",
                ))
            }
        }
        match &self.function_call {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    "function_call",
                    "function_call is deprecated and not supported: use tool_choice",
                ))
            }
        }
        match &self.modalities {
            None | Some(Value::Null) => {}
            Some(Value::Array(list)) if list.iter().all(|m| m == "text") => {}
            Some(_) => {
                return Err(ApiError::invalid(
                    "modalities",
                    "only the \"text\" modality is supported (no audio output)",
                ))
            }
        }
        if self.audio.as_ref().is_some_and(|a| !a.is_null()) {
            return Err(ApiError::invalid("audio", "audio output is not supported"));
        }
        one_of("service_tier", self.service_tier.as_ref(), &SERVICE_TIERS)?;
        one_of(
            "reasoning_effort",
            self.reasoning_effort.as_ref(),
            &REASONING_EFFORTS,
        )
    }
}

/// `value` is absent, null or one of `allowed`.
fn one_of(param: &str, value: Option<&Value>, allowed: &[&str]) -> Result<(), ApiError> {
    match value {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if allowed.contains(&s.as_str()) => Ok(()),
        Some(_) => Err(ApiError::invalid(
            param,
            format!("{param} must be one of {}", quoted(allowed)),
        )),
    }
}

fn quoted(values: &[&str]) -> String {
    values
        .iter()
        .map(|v| format!("\"{v}\""))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn param(body: Value) -> Option<String> {
        match serde_json::from_value::<ChatExtras>(body)
            .unwrap()
            .validate()
        {
            Ok(()) => None,
            Err(ApiError::InvalidRequest { param, .. }) => param,
            Err(e) => panic!("{e:?}"),
        }
    }

    #[test]
    fn defaults_and_openai_values_are_accepted() {
        for body in [
            json!({}),
            json!({"functions": null, "function_call": null, "audio": null}),
            json!({"functions": [], "function_call": "none"}),
            json!({"modalities": ["text"], "service_tier": "flex", "reasoning_effort": "minimal"}),
            json!({"service_tier": "scale", "reasoning_effort": "high"}),
        ] {
            assert_eq!(param(body.clone()), None, "{body}");
        }
    }

    #[test]
    fn what_cannot_be_honoured_and_unknown_values_name_their_field() {
        let function = json!({"name": "f", "parameters": {"type": "object"}});
        for (body, field) in [
            (json!({"functions": [function]}), "functions"),
            (json!({"function_call": "auto"}), "function_call"),
            (json!({"function_call": {"name": "f"}}), "function_call"),
            (json!({"modalities": ["text", "audio"]}), "modalities"),
            (json!({"modalities": "text"}), "modalities"),
            (
                json!({"audio": {"voice": "alloy", "format": "wav"}}),
                "audio",
            ),
            (json!({"service_tier": "gold"}), "service_tier"),
            (json!({"service_tier": 1}), "service_tier"),
            (json!({"reasoning_effort": "extreme"}), "reasoning_effort"),
            (json!({"reasoning_effort": "High"}), "reasoning_effort"),
        ] {
            assert_eq!(param(body.clone()).as_deref(), Some(field), "{body}");
        }
    }
}
