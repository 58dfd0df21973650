//! OpenAI's strict mode for JSON schemas (`response_format.json_schema.strict` and a function
//! tool's `strict`): every object schema in the schema must set `"additionalProperties":
//! false` and list each of its `properties` in `required`, else the request is refused (400),
//! as OpenAI refuses it.
//!
//! The walk follows the places a schema holds schemas (`properties`, `items` and
//! `prefixItems`, `anyOf` / `oneOf` / `allOf`, `not`, `$defs` / `definitions`,
//! `additionalProperties` and `patternProperties`), to at most [`MAX_STRICT_DEPTH`] levels;
//! the offending object is named by its JSON Pointer (`#/properties/address`).

use serde_json::Value;

use crate::error::ApiError;

/// Deepest nesting of schemas a strict schema may have (the walk is recursive).
pub const MAX_STRICT_DEPTH: usize = 64;

/// Refuses `schema` (carried in `param`) unless it keeps OpenAI's strict-mode rules.
pub fn check_strict_schema(param: &str, schema: &Value) -> Result<(), ApiError> {
    let mut path = String::from("#");
    walk(schema, &mut path, 0).map_err(|problem| {
        ApiError::invalid(
            param,
            format!("Invalid schema for strict mode in {param}: {problem}"),
        )
    })
}

/// Whether `schema` describes an object: `"type": "object"` (alone or in a list of types), or
/// `properties` without a type.
fn is_object_schema(schema: &serde_json::Map<String, Value>) -> bool {
    match schema.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(types)) => types.iter().any(|t| t == "object"),
        _ => schema.contains_key("properties"),
    }
}

fn walk(schema: &Value, path: &mut String, depth: usize) -> Result<(), String> {
    let Value::Object(map) = schema else {
        return Ok(());
    };
    if depth > MAX_STRICT_DEPTH {
        return Err(format!(
            "the schema at {path} is nested deeper than {MAX_STRICT_DEPTH} levels"
        ));
    }
    if is_object_schema(map) {
        if map.get("additionalProperties") != Some(&Value::Bool(false)) {
            return Err(format!(
                "the object schema at {path} must set \"additionalProperties\": false"
            ));
        }
        let required: Vec<&str> = match map.get("required") {
            None => Vec::new(),
            Some(Value::Array(names)) => names.iter().filter_map(Value::as_str).collect(),
            Some(_) => {
                return Err(format!(
                    "\"required\" of the object schema at {path} must be a list of names"
                ))
            }
        };
        if let Some(Value::Object(properties)) = map.get("properties") {
            let missing: Vec<&str> = properties
                .keys()
                .map(String::as_str)
                .filter(|name| !required.contains(name))
                .take(8)
                .collect();
            if !missing.is_empty() {
                return Err(format!(
                    "the object schema at {path} must list every property in \"required\"; \
                     missing: {}",
                    shown_names(&missing)
                ));
            }
        }
    }
    for (key, value) in map {
        match key.as_str() {
            // Maps of name to schema.
            "properties" | "patternProperties" | "$defs" | "definitions" => {
                if let Value::Object(children) = value {
                    for (name, child) in children {
                        descend(child, path, depth, &[key, name])?;
                    }
                }
            }
            // Lists of schemas.
            "anyOf" | "oneOf" | "allOf" | "prefixItems" => {
                if let Value::Array(children) = value {
                    for (i, child) in children.iter().enumerate() {
                        descend(child, path, depth, &[key, &i.to_string()])?;
                    }
                }
            }
            // One schema (or, for `items`, a list of them: the older tuple form).
            "items" | "not" | "additionalProperties" | "contains" => match value {
                Value::Array(children) => {
                    for (i, child) in children.iter().enumerate() {
                        descend(child, path, depth, &[key, &i.to_string()])?;
                    }
                }
                child => descend(child, path, depth, &[key])?,
            },
            _ => {}
        }
    }
    Ok(())
}

/// Walks `child`, found under `steps` from `path`, one level deeper.
fn descend(child: &Value, path: &mut String, depth: usize, steps: &[&str]) -> Result<(), String> {
    let len = path.len();
    for step in steps {
        path.push('/');
        // JSON Pointer escapes (RFC 6901); names are bounded for the message.
        let step: String = step.chars().take(64).collect();
        path.push_str(&step.replace('~', "~0").replace('/', "~1"));
    }
    let result = walk(child, path, depth + 1);
    path.truncate(len);
    result
}

/// Names for a message: quoted, each at most 64 characters.
fn shown_names(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("{:?}", n.chars().take(64).collect::<String>()))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn problem(schema: Value) -> Option<String> {
        match check_strict_schema("p", &schema) {
            Ok(()) => None,
            Err(ApiError::InvalidRequest { message, param }) => {
                assert_eq!(param.as_deref(), Some("p"));
                Some(message)
            }
            Err(e) => panic!("{e:?}"),
        }
    }

    fn closed(properties: Value) -> Value {
        let required: Vec<String> = properties.as_object().unwrap().keys().cloned().collect();
        json!({"type": "object", "properties": properties, "required": required,
            "additionalProperties": false})
    }

    #[test]
    fn closed_schemas_with_every_property_required_pass() {
        let address = closed(json!({"city": {"type": "string"}}));
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": ["string", "null"]},
                "address": address,
                "tags": {"type": "array", "items": {"type": "string"}},
                "pet": {"anyOf": [{"$ref": "#/$defs/cat"}, {"type": "null"}]},
            },
            "required": ["name", "address", "tags", "pet"],
            "additionalProperties": false,
            "$defs": {"cat": closed(json!({"lives": {"type": "integer"}}))},
        });
        assert_eq!(problem(schema), None);
        assert_eq!(problem(json!({"type": "string"})), None);
        assert_eq!(
            problem(json!({"type": "object", "additionalProperties": false})),
            None
        );
    }

    #[test]
    fn open_objects_and_optional_properties_are_named_by_their_path() {
        let cases = [
            (json!({"type": "object", "properties": {}}), "at # must set"),
            (
                json!({"type": "object", "properties": {"a": {"type": "string"}},
                    "additionalProperties": false}),
                "at # must list every property in \"required\"; missing: \"a\"",
            ),
            (
                closed(
                    json!({"address": {"type": "object", "properties": {"city": {}},
                    "required": ["city"]}}),
                ),
                "at #/properties/address must set",
            ),
            (
                closed(
                    json!({"list": {"type": "array", "items": {"properties": {"x": {}},
                    "additionalProperties": false}}}),
                ),
                "at #/properties/list/items must list every property",
            ),
            (
                closed(json!({"pet": {"anyOf": [{"type": "null"},
                    {"type": ["object", "null"], "properties": {}}]}})),
                "at #/properties/pet/anyOf/1 must set",
            ),
            (
                json!({"$ref": "#/$defs/a~b/c", "$defs": {"a~b/c": {"type": "object"}}}),
                "at #/$defs/a~0b~1c must set",
            ),
            (
                closed(json!({"a": {"type": "string"}}))
                    .as_object()
                    .map(|o| {
                        let mut o = o.clone();
                        o.insert("required".into(), json!("a"));
                        Value::Object(o)
                    })
                    .unwrap(),
                "\"required\" of the object schema at # must be a list",
            ),
        ];
        for (schema, expected) in cases {
            let message = problem(schema.clone()).unwrap_or_else(|| panic!("{schema} passed"));
            assert!(message.contains(expected), "{schema}: {message}");
        }
    }

    #[test]
    fn the_walk_is_bounded() {
        let mut schema = json!({"type": "string"});
        for _ in 0..(MAX_STRICT_DEPTH + 1) {
            schema = json!({"type": "array", "items": schema});
        }
        let message = problem(schema).unwrap();
        assert!(message.contains("nested deeper than"), "{message}");
    }
}
