//! Structured-output fields of a request: OpenAI's `response_format` (`text`, `json_object`,
//! `json_schema`), vLLM's `structured_outputs` object (`json`, `regex`, `choice`, `grammar`,
//! `json_object`) and its older `guided_json` / `guided_regex` / `guided_choice` /
//! `guided_grammar` fields. At most one of them may ask for a structure.
//!
//! vLLM's JSON options in `structured_outputs` apply to the JSON structure asked for (by any of
//! the fields), as vLLM applies them; other structures ignore them, as vLLM's do:
//! - `disable_any_whitespace`: JSON is always written without free whitespace here (as
//!   Python's `json.dumps` writes it, xgrammar's output with the option), so it is accepted,
//!   `true` or `false`;
//! - `disable_additional_properties`: every object schema with `properties` or
//!   `patternProperties` and no `additionalProperties` gets `additionalProperties: false`;
//! - `whitespace_pattern`: the regex of the whitespace allowed between JSON tokens (the
//!   separators become `,` and `:`), llguidance's `whitespace_pattern`;
//! - `disable_fallback`: there is one grammar engine and no fallback, so it is accepted.

use serde::Deserialize;
use serde_json::Value;

use super::finite::check_finite_schema;
use super::limits::{MAX_STRUCTURED_BYTES, MAX_STRUCTURED_CHOICES};
use super::strict::check_strict_schema;
use crate::engine::StructuredOutputSpec;
use crate::error::ApiError;

/// The structured-output fields as the client sent them.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredFields {
    /// OpenAI's `response_format`.
    pub response_format: Option<serde_json::Value>,
    /// vLLM's `structured_outputs`.
    pub structured_outputs: Option<serde_json::Value>,
    /// vLLM's `guided_json` (a schema, or a string holding one).
    pub guided_json: Option<serde_json::Value>,
    /// vLLM's `guided_regex`.
    pub guided_regex: Option<String>,
    /// vLLM's `guided_choice`.
    pub guided_choice: Option<Vec<String>>,
    /// vLLM's `guided_grammar` (llguidance's Lark dialect).
    pub guided_grammar: Option<String>,
}

fn schema_value(param: &str, v: &serde_json::Value) -> Result<serde_json::Value, ApiError> {
    let schema = match v {
        serde_json::Value::String(s) => serde_json::from_str(s)
            .map_err(|e| ApiError::invalid(param, format!("{param} is not valid JSON: {e}")))?,
        other => other.clone(),
    };
    if !(schema.is_object() || schema.is_boolean()) {
        return Err(ApiError::invalid(
            param,
            format!("{param} must be a JSON Schema (an object)"),
        ));
    }
    Ok(schema)
}

fn text(param: &str, v: &serde_json::Value) -> Result<String, ApiError> {
    v.as_str()
        .map(str::to_owned)
        .ok_or_else(|| ApiError::invalid(param, format!("{param} must be a string")))
}

fn choices(param: &str, v: &serde_json::Value) -> Result<Vec<String>, ApiError> {
    serde_json::from_value(v.clone())
        .map_err(|_| ApiError::invalid(param, format!("{param} must be a list of strings")))
}

fn response_format(v: &serde_json::Value) -> Result<Option<StructuredOutputSpec>, ApiError> {
    const P: &str = "response_format";
    if v.is_null() {
        return Ok(None);
    }
    if !v.is_object() {
        return Err(ApiError::invalid(
            P,
            "response_format must be an object with a \"type\" (\"text\", \"json_object\" \
             or \"json_schema\")",
        ));
    }
    match v.get("type").and_then(|t| t.as_str()) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(StructuredOutputSpec::JsonObject)),
        Some("json_schema") => {
            const SCHEMA: &str = "response_format.json_schema.schema";
            let json_schema = v.get("json_schema");
            let schema = json_schema.and_then(|j| j.get("schema")).ok_or_else(|| {
                ApiError::invalid(
                    SCHEMA,
                    "response_format of type json_schema needs json_schema.schema",
                )
            })?;
            let schema = schema_value(SCHEMA, schema)?;
            // OpenAI and vLLM require the name.
            if !json_schema
                .and_then(|j| j.get("name"))
                .is_some_and(Value::is_string)
            {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "response_format of type json_schema needs json_schema.name (a string)",
                ));
            }
            match json_schema.and_then(|j| j.get("strict")) {
                None | Some(Value::Null | Value::Bool(false)) => {}
                Some(Value::Bool(true)) => check_strict_schema(SCHEMA, &schema)?,
                Some(_) => {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.strict",
                        "response_format.json_schema.strict must be a boolean",
                    ))
                }
            }
            Ok(Some(StructuredOutputSpec::JsonSchema(schema)))
        }
        _ => Err(ApiError::invalid(
            P,
            "response_format.type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// vLLM's options for JSON output (see the module's documentation).
#[derive(Debug, Clone, Default, PartialEq)]
struct JsonOptions {
    disable_additional_properties: bool,
    whitespace_pattern: Option<String>,
}

impl JsonOptions {
    /// Reads option `key` of `structured_outputs`; false when `key` is not an option.
    fn read(&mut self, key: &str, value: &serde_json::Value) -> Result<bool, ApiError> {
        let param = || format!("structured_outputs.{key}");
        let flag = || {
            value.as_bool().ok_or_else(|| {
                ApiError::invalid(
                    param(),
                    format!("structured_outputs.{key} must be a boolean"),
                )
            })
        };
        match key {
            "disable_any_whitespace" | "disable_fallback" => {
                flag()?;
            }
            "disable_additional_properties" => self.disable_additional_properties = flag()?,
            "whitespace_pattern" => {
                let pattern = match value {
                    serde_json::Value::Null => None,
                    serde_json::Value::String(p) if !p.is_empty() => Some(p.clone()),
                    _ => {
                        return Err(ApiError::invalid(
                            param(),
                            "structured_outputs.whitespace_pattern must be a non-empty regex",
                        ))
                    }
                };
                self.whitespace_pattern = pattern;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// `spec` with the options applied (to JSON; other structures ignore them).
    fn apply(&self, spec: StructuredOutputSpec) -> StructuredOutputSpec {
        let mut schema = match spec {
            StructuredOutputSpec::JsonSchema(s) => s,
            StructuredOutputSpec::JsonObject if self.whitespace_pattern.is_some() => {
                serde_json::json!({"type": "object"})
            }
            other => return other,
        };
        if self.disable_additional_properties {
            close_objects(&mut schema);
        }
        if let (Some(pattern), Some(obj)) = (&self.whitespace_pattern, schema.as_object_mut()) {
            match obj.get_mut("x-guidance").and_then(|g| g.as_object_mut()) {
                // The schema's own options win, as they do over the engine's defaults.
                Some(own) => {
                    own.entry("whitespace_pattern")
                        .or_insert_with(|| serde_json::Value::String(pattern.clone()));
                }
                None => {
                    obj.insert(
                        "x-guidance".into(),
                        serde_json::json!({
                            "whitespace_flexible": false,
                            "whitespace_pattern": pattern,
                            "item_separator": ",",
                            "key_separator": ":",
                        }),
                    );
                }
            }
        }
        StructuredOutputSpec::JsonSchema(schema)
    }
}

/// vLLM's `disable_additional_properties`: every object (schema) with `properties` or
/// `patternProperties` and no `additionalProperties` gets `additionalProperties: false`.
fn close_objects(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(o) => {
            for child in o.values_mut() {
                close_objects(child);
            }
            if !o.contains_key("additionalProperties")
                && (o.contains_key("properties") || o.contains_key("patternProperties"))
            {
                o.insert(
                    "additionalProperties".into(),
                    serde_json::Value::Bool(false),
                );
            }
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

fn structured_outputs(
    v: &serde_json::Value,
    options: &mut JsonOptions,
) -> Result<Option<StructuredOutputSpec>, ApiError> {
    const P: &str = "structured_outputs";
    let Some(obj) = v.as_object() else {
        return if v.is_null() {
            Ok(None)
        } else {
            Err(ApiError::invalid(P, "structured_outputs must be an object"))
        };
    };
    let mut found = Vec::new();
    for (key, value) in obj {
        if options.read(key, value)? {
            continue;
        }
        if value.is_null() || value == &serde_json::Value::Bool(false) {
            continue;
        }
        let param = format!("{P}.{key}");
        found.push(match key.as_str() {
            "json" => StructuredOutputSpec::JsonSchema(schema_value(&param, value)?),
            "regex" => StructuredOutputSpec::Regex(text(&param, value)?),
            "choice" => StructuredOutputSpec::Choice(choices(&param, value)?),
            "grammar" => StructuredOutputSpec::Grammar(text(&param, value)?),
            "json_object" => StructuredOutputSpec::JsonObject,
            other => {
                return Err(ApiError::invalid(
                    param,
                    format!("structured_outputs.{other} is not supported (json, regex, choice, grammar and json_object are, with the options disable_any_whitespace, disable_additional_properties, whitespace_pattern and disable_fallback)"),
                ))
            }
        });
    }
    if found.len() > 1 {
        return Err(ApiError::invalid(
            P,
            "structured_outputs must ask for one of json, regex, choice, grammar or json_object",
        ));
    }
    Ok(found.pop())
}

fn check_bounds(param: &str, spec: &StructuredOutputSpec) -> Result<(), ApiError> {
    let bytes = match spec {
        StructuredOutputSpec::JsonObject => 0,
        StructuredOutputSpec::JsonSchema(v) => v.to_string().len(),
        StructuredOutputSpec::Regex(r)
        | StructuredOutputSpec::Grammar(r)
        | StructuredOutputSpec::ToolCalls(r) => {
            if r.is_empty() {
                return Err(ApiError::invalid(param, "must not be empty"));
            }
            r.len()
        }
        StructuredOutputSpec::Choice(c) => {
            if c.is_empty() || c.len() > MAX_STRUCTURED_CHOICES {
                return Err(ApiError::invalid(
                    param,
                    format!("a choice needs 1 to {MAX_STRUCTURED_CHOICES} alternatives"),
                ));
            }
            if c.iter().any(String::is_empty) {
                return Err(ApiError::invalid(
                    param,
                    "choice alternatives must not be empty",
                ));
            }
            c.iter().map(String::len).sum()
        }
    };
    if bytes > MAX_STRUCTURED_BYTES {
        return Err(ApiError::invalid(
            param,
            format!(
                "the specification has {bytes} bytes; at most {MAX_STRUCTURED_BYTES} are allowed"
            ),
        ));
    }
    if let StructuredOutputSpec::JsonSchema(schema) = spec {
        check_finite_schema(param, schema)?;
    }
    Ok(())
}

/// The structure a request asks for, and the field that asks for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Structured {
    /// The top-level field that carried it (`response_format`, `structured_outputs`,
    /// `guided_regex`, ...): the `param` of the engine's refusal of it.
    pub field: &'static str,
    /// What the output must follow.
    pub spec: StructuredOutputSpec,
}

impl StructuredFields {
    /// The one structure asked for, if any, with its sizes checked (the grammar itself is
    /// checked by the engine when it compiles it).
    pub fn validate(&self) -> Result<Option<Structured>, ApiError> {
        let mut asked: Vec<(&'static str, StructuredOutputSpec)> = Vec::new();
        let mut options = JsonOptions::default();
        if let Some(v) = &self.response_format {
            if let Some(s) = response_format(v)? {
                asked.push(("response_format", s));
            }
        }
        if let Some(v) = &self.structured_outputs {
            if let Some(s) = structured_outputs(v, &mut options)? {
                asked.push(("structured_outputs", s));
            }
        }
        if let Some(v) = &self.guided_json {
            asked.push((
                "guided_json",
                StructuredOutputSpec::JsonSchema(schema_value("guided_json", v)?),
            ));
        }
        if let Some(r) = &self.guided_regex {
            asked.push(("guided_regex", StructuredOutputSpec::Regex(r.clone())));
        }
        if let Some(c) = &self.guided_choice {
            asked.push(("guided_choice", StructuredOutputSpec::Choice(c.clone())));
        }
        if let Some(g) = &self.guided_grammar {
            asked.push(("guided_grammar", StructuredOutputSpec::Grammar(g.clone())));
        }
        if asked.len() > 1 {
            let names: Vec<&str> = asked.iter().map(|a| a.0).collect();
            return Err(ApiError::invalid(
                names[1],
                format!(
                    "ask for one structured output, not several ({})",
                    names.join(", ")
                ),
            ));
        }
        match asked.pop() {
            Some((field, spec)) => {
                let spec = options.apply(spec);
                check_bounds(field, &spec)?;
                Ok(Some(Structured { field, spec }))
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: serde_json::Value) -> Result<Option<StructuredOutputSpec>, ApiError> {
        parse_field(v).map(|s| s.map(|(_, spec)| spec))
    }

    fn parse_field(
        v: serde_json::Value,
    ) -> Result<Option<(&'static str, StructuredOutputSpec)>, ApiError> {
        serde_json::from_value::<StructuredFields>(v)
            .unwrap()
            .validate()
            .map(|s| s.map(|s| (s.field, s.spec)))
    }

    /// The field that asked for the structure is kept: the engine's refusal of the
    /// structure (a regex that does not compile) names it.
    #[test]
    fn the_field_that_asked_is_kept() {
        let schema = json!({"type": "object"});
        for (body, field) in [
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}),
                "response_format",
            ),
            (
                json!({"structured_outputs": {"regex": "a"}}),
                "structured_outputs",
            ),
            (json!({"guided_json": schema}), "guided_json"),
            (json!({"guided_regex": "a"}), "guided_regex"),
            (json!({"guided_choice": ["a"]}), "guided_choice"),
            (json!({"guided_grammar": "start: \"a\""}), "guided_grammar"),
        ] {
            assert_eq!(
                parse_field(body.clone()).unwrap().unwrap().0,
                field,
                "{body}"
            );
        }
    }

    fn param(r: Result<Option<StructuredOutputSpec>, ApiError>) -> String {
        match r {
            Err(ApiError::InvalidRequest { param, .. }) => param.unwrap_or_default(),
            other => panic!("expected an invalid request, got {other:?}"),
        }
    }

    #[test]
    fn every_spelling_maps_to_its_structure() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(parse(json!({})).unwrap(), None);
        assert_eq!(
            parse(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        assert_eq!(
            parse(json!({"response_format": {"type": "json_object"}})).unwrap(),
            Some(StructuredOutputSpec::JsonObject)
        );
        assert_eq!(
            parse(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": schema}}}))
            .unwrap(),
            Some(StructuredOutputSpec::JsonSchema(schema.clone()))
        );
        let strict = json!({"type": "object", "properties": {"a": {"type": "integer"}},
            "required": ["a"], "additionalProperties": false});
        assert_eq!(
            parse(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": strict, "strict": true}}}))
            .unwrap(),
            Some(StructuredOutputSpec::JsonSchema(strict.clone()))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"json": schema.to_string()}})).unwrap(),
            Some(StructuredOutputSpec::JsonSchema(schema.clone()))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"regex": "[a-z]+"}})).unwrap(),
            Some(StructuredOutputSpec::Regex("[a-z]+".into()))
        );
        assert_eq!(
            parse(json!({"guided_choice": ["yes", "no"]})).unwrap(),
            Some(StructuredOutputSpec::Choice(vec![
                "yes".into(),
                "no".into()
            ]))
        );
        assert_eq!(
            parse(json!({"guided_grammar": "start: \"a\""})).unwrap(),
            Some(StructuredOutputSpec::Grammar("start: \"a\"".into()))
        );
        assert_eq!(
            parse(json!({"guided_json": schema})).unwrap(),
            Some(StructuredOutputSpec::JsonSchema(schema))
        );
    }

    #[test]
    fn vllm_json_options_apply_to_the_json_asked_for() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        // Our JSON has no free whitespace anyway, and there is no fallback engine.
        for flags in [
            json!({"disable_any_whitespace": true}),
            json!({"disable_any_whitespace": false, "disable_fallback": true}),
        ] {
            let mut so = flags.clone();
            so["json"] = schema.clone();
            assert_eq!(
                parse(json!({"structured_outputs": so})).unwrap(),
                Some(StructuredOutputSpec::JsonSchema(schema.clone())),
                "{flags}"
            );
        }
        // disable_additional_properties closes every object that lists properties and does
        // not say, as vLLM's does, whichever field asked for the schema.
        let open = json!({"type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}},
                           "c": {"type": "object", "properties": {}, "additionalProperties": true}},
            "$defs": {"d": {"patternProperties": {"^x": {"type": "string"}}}}});
        let closed = json!({"type": "object",
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                                 "additionalProperties": false},
                           "c": {"type": "object", "properties": {}, "additionalProperties": true}},
            "$defs": {"d": {"patternProperties": {"^x": {"type": "string"}},
                            "additionalProperties": false}},
            "additionalProperties": false});
        let want = Some(StructuredOutputSpec::JsonSchema(closed));
        assert_eq!(
            parse(json!({"structured_outputs": {"json": open.clone(),
                                                "disable_additional_properties": true}}))
            .unwrap(),
            want
        );
        assert_eq!(
            parse(json!({"response_format": {"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": open}},
                         "structured_outputs": {"disable_additional_properties": true}}))
            .unwrap(),
            want
        );
        // whitespace_pattern: llguidance's, between JSON tokens; the schema's own options win.
        let ws = json!({"whitespace_flexible": false, "whitespace_pattern": "[ ]?",
                        "item_separator": ",", "key_separator": ":"});
        let mut with_ws = schema.clone();
        with_ws["x-guidance"] = ws.clone();
        assert_eq!(
            parse(json!({"guided_json": schema,
                         "structured_outputs": {"whitespace_pattern": "[ ]?"}}))
            .unwrap(),
            Some(StructuredOutputSpec::JsonSchema(with_ws))
        );
        assert_eq!(
            parse(json!({"response_format": {"type": "json_object"},
                         "structured_outputs": {"whitespace_pattern": "[ ]?"}}))
            .unwrap(),
            Some(StructuredOutputSpec::JsonSchema(
                json!({"type": "object", "x-guidance": ws})
            ))
        );
        let own = json!({"type": "object", "x-guidance": {"whitespace_pattern": "\\n?"}});
        assert_eq!(
            parse(json!({"structured_outputs": {"json": own.clone(),
                                                "whitespace_pattern": "[ ]?"}}))
            .unwrap(),
            Some(StructuredOutputSpec::JsonSchema(own))
        );
        // Other structures ignore them, as vLLM's do.
        assert_eq!(
            parse(
                json!({"structured_outputs": {"regex": "[a-z]+", "whitespace_pattern": " ",
                                                "disable_additional_properties": true}})
            )
            .unwrap(),
            Some(StructuredOutputSpec::Regex("[a-z]+".into()))
        );
        assert_eq!(
            parse(json!({"structured_outputs": {"disable_any_whitespace": true}})).unwrap(),
            None
        );
        // Wrong types name the option.
        for (bad, p) in [
            (
                json!({"disable_any_whitespace": "yes"}),
                "disable_any_whitespace",
            ),
            (
                json!({"disable_additional_properties": 1}),
                "disable_additional_properties",
            ),
            (json!({"whitespace_pattern": ""}), "whitespace_pattern"),
            (json!({"whitespace_pattern": 3}), "whitespace_pattern"),
            (json!({"structural_tag": "x"}), "structural_tag"),
        ] {
            assert_eq!(
                param(parse(json!({"structured_outputs": bad}))),
                format!("structured_outputs.{p}")
            );
        }
    }

    /// OpenAI refuses a json_schema without a name, and a strict schema with an open object
    /// or an optional property, naming the object's place in the schema.
    #[test]
    fn json_schema_needs_a_name_and_strict_schemas_are_closed() {
        let open = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format = |json_schema: Value| {
            json!({"response_format": {"type": "json_schema",
            "json_schema": json_schema}})
        };
        assert_eq!(
            param(parse(format(json!({"schema": open})))),
            "response_format.json_schema.name"
        );
        assert_eq!(
            param(parse(format(json!({"name": 3, "schema": open})))),
            "response_format.json_schema.name"
        );
        // Not strict: an open schema is the client's to ask for.
        assert!(parse(format(
            json!({"name": "x", "schema": open, "strict": false})
        ))
        .is_ok());
        let nested = json!({"type": "object", "required": ["a"], "additionalProperties": false,
            "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}},
                "additionalProperties": false}}});
        for (schema, place) in [
            (&open, "at # must set"),
            (&nested, "at #/properties/a must list"),
        ] {
            match parse(format(
                json!({"name": "x", "schema": schema, "strict": true}),
            )) {
                Err(ApiError::InvalidRequest { message, param }) => {
                    assert_eq!(param.as_deref(), Some("response_format.json_schema.schema"));
                    assert!(message.contains(place), "{message}");
                }
                other => panic!("{schema}: {other:?}"),
            }
        }
        assert_eq!(
            param(parse(format(
                json!({"name": "x", "schema": open, "strict": "yes"})
            ))),
            "response_format.json_schema.strict"
        );
    }

    #[test]
    fn bad_or_conflicting_fields_name_their_param() {
        assert_eq!(
            param(parse(json!({"response_format": {"type": "xml"}}))),
            "response_format"
        );
        assert_eq!(
            param(parse(json!({"response_format": {"type": "json_schema"}}))),
            "response_format.json_schema.schema"
        );
        assert_eq!(
            param(parse(json!({"guided_json": "{not json"}))),
            "guided_json"
        );
        assert_eq!(param(parse(json!({"guided_json": 3}))), "guided_json");
        assert_eq!(
            param(parse(json!({"guided_regex": "a", "guided_choice": ["a"]}))),
            "guided_choice"
        );
        assert_eq!(
            param(parse(
                json!({"structured_outputs": {"regex": "a", "choice": ["a"]}})
            )),
            "structured_outputs"
        );
        assert_eq!(
            param(parse(json!({"structured_outputs": {"xml": "a"}}))),
            "structured_outputs.xml"
        );
        assert_eq!(param(parse(json!({"guided_choice": []}))), "guided_choice");
        assert_eq!(
            param(parse(json!({"guided_choice": [""]}))),
            "guided_choice"
        );
        let many: Vec<String> = (0..=MAX_STRUCTURED_CHOICES)
            .map(|i| i.to_string())
            .collect();
        assert_eq!(
            param(parse(json!({"guided_choice": many}))),
            "guided_choice"
        );
        let long = "a".repeat(MAX_STRUCTURED_BYTES + 1);
        assert_eq!(param(parse(json!({"guided_regex": long}))), "guided_regex");
    }
}
