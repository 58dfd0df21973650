//! Refusing a JSON schema that only infinite JSON satisfies: an object schema whose required
//! property leads back to itself (`{"type": "object", "properties": {"a": {"$ref": "#"}},
//! "required": ["a"]}`), through `$ref`s, `allOf` and arrays' `minItems`, has no finite
//! instance. llguidance compiles such a schema, and its first tokens pass; then the output it
//! forces never ends and its parser gives up past its item limit, a few tokens in (then a 400
//! that says only that the grammar exceeded the parser's limits). No output can satisfy the
//! schema, so it is a 400 that says so before the request starts, as a schema llguidance finds
//! unsatisfiable is.
//!
//! The check is a least fixed point over the schema's local `$ref` targets (`#`, `#/$defs/…`,
//! any JSON pointer into the schema): a target has a finite instance once its schema does with
//! what is known of the others. It refuses only what certainly has none: a keyword it does not
//! read (`not`, `if`, `patternProperties`, `const`, ...), a `$ref` it cannot resolve and a
//! schema with an `$id` below its root count as satisfiable, and so does every schema with more
//! than [`MAX_REF_TARGETS`] distinct `$ref` targets (the check's time grows with their number).

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use crate::error::ApiError;

/// Most distinct `$ref` targets a checked schema may have; one with more is not checked.
pub const MAX_REF_TARGETS: usize = 32;

/// A 400 naming `param` when `schema` has no finite JSON instance.
pub fn check_finite_schema(param: &str, schema: &Value) -> Result<(), ApiError> {
    let mut targets = BTreeMap::new();
    if !collect_targets(schema, &mut targets, true) || targets.len() > MAX_REF_TARGETS {
        return Ok(());
    }
    // Least fixed point: every target starts without a finite instance and gains one when its
    // schema has one given the others'; each pass turns at least one, or ends.
    loop {
        let mut changed = false;
        for pointer in targets.keys().cloned().collect::<Vec<_>>() {
            if targets[&pointer] {
                continue;
            }
            let finite = schema
                .pointer(&pointer)
                .is_none_or(|node| has_instance(schema, node, &targets));
            if finite {
                targets.insert(pointer, true);
                changed = true;
            }
        }
        if !changed {
            break;
        }
    }
    if has_instance(schema, schema, &targets) {
        return Ok(());
    }
    let place = targets
        .iter()
        .find(|(_, &finite)| !finite)
        .map(|(pointer, _)| format!(": the schema at #{pointer} requires itself without end"))
        .unwrap_or_default();
    Err(ApiError::invalid(
        param,
        format!(
            "the schema has no finite instance, so no output satisfies it{place} (a required \
             property, an array's minItems or an allOf must lead out of a recursion)"
        ),
    ))
}

/// Gathers the JSON pointers of `node`'s local `$ref`s (all `false`: not known finite yet).
/// `false` when the check cannot read the schema's references: an `$id` below the root moves
/// their base.
fn collect_targets(node: &Value, targets: &mut BTreeMap<String, bool>, root: bool) -> bool {
    match node {
        Value::Object(obj) => {
            if !root && obj.contains_key("$id") {
                return false;
            }
            if let Some(Value::String(r)) = obj.get("$ref") {
                if let Some(pointer) = r.strip_prefix('#') {
                    targets.insert(pointer.to_owned(), false);
                }
            }
            obj.values().all(|v| collect_targets(v, targets, false))
        }
        Value::Array(items) => items.iter().all(|v| collect_targets(v, targets, false)),
        _ => true,
    }
}

/// Whether `node` has a finite instance, given which `$ref` targets are known to have one.
fn has_instance(root: &Value, node: &Value, targets: &BTreeMap<String, bool>) -> bool {
    let obj = match node {
        Value::Bool(b) => return *b,
        Value::Object(obj) => obj,
        _ => return true,
    };
    if let Some(Value::String(r)) = obj.get("$ref") {
        let known = r
            .strip_prefix('#')
            .filter(|pointer| root.pointer(pointer).is_some())
            .and_then(|pointer| targets.get(pointer));
        if known == Some(&false) {
            return false;
        }
    }
    if let Some(Value::Array(all)) = obj.get("allOf") {
        if !all.iter().all(|s| has_instance(root, s, targets)) {
            return false;
        }
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(any)) = obj.get(key) {
            if !any.is_empty() && !any.iter().any(|s| has_instance(root, s, targets)) {
                return false;
            }
        }
    }
    match only_type(obj) {
        Some("object") => required_have_instances(root, obj, targets),
        Some("array") => min_items_have_instances(root, obj, targets),
        _ => true,
    }
}

/// The schema's one `type` (`"object"` or `["object"]`), if it allows only one.
fn only_type(obj: &Map<String, Value>) -> Option<&str> {
    match obj.get("type")? {
        Value::String(t) => Some(t),
        Value::Array(types) if types.len() == 1 => types[0].as_str(),
        _ => None,
    }
}

/// Whether every required property that `properties` describes has a finite instance.
fn required_have_instances(
    root: &Value,
    obj: &Map<String, Value>,
    targets: &BTreeMap<String, bool>,
) -> bool {
    let (Some(Value::Array(required)), Some(Value::Object(properties))) =
        (obj.get("required"), obj.get("properties"))
    else {
        return true;
    };
    required
        .iter()
        .filter_map(Value::as_str)
        .filter_map(|name| properties.get(name))
        .all(|s| has_instance(root, s, targets))
}

/// Whether the items an array must hold (`minItems`) have finite instances.
fn min_items_have_instances(
    root: &Value,
    obj: &Map<String, Value>,
    targets: &BTreeMap<String, bool>,
) -> bool {
    let min = obj.get("minItems").and_then(Value::as_u64).unwrap_or(0);
    if min == 0 {
        return true;
    }
    // A tuple's leading items come first, read as llguidance reads them: in a schema of draft
    // 2019-09 or earlier (its root's `$schema`), or with an `items` list or `additionalItems`,
    // an `items` list then `additionalItems` for the rest, or `items` for all (`prefixItems` is
    // not read); else 2020-12's `prefixItems`, then `items`.
    let items = obj.get("items");
    let (prefix, rest) = if before_2020_12(root)
        || obj.contains_key("additionalItems")
        || matches!(items, Some(Value::Array(_)))
    {
        match items {
            Some(Value::Array(prefix)) => (prefix.as_slice(), obj.get("additionalItems")),
            _ => (&[][..], items),
        }
    } else {
        match obj.get("prefixItems") {
            Some(Value::Array(prefix)) => (prefix.as_slice(), items),
            _ => (&[][..], items),
        }
    };
    tuple_has_instances(root, min, prefix, rest, targets)
}

/// Whether the schema's root `$schema` names a draft before 2020-12 (as llguidance detects
/// it: any other value, or none, is 2020-12).
fn before_2020_12(root: &Value) -> bool {
    let Some(Value::String(draft)) = root.get("$schema") else {
        return false;
    };
    matches!(
        draft.trim_end_matches('#'),
        "https://json-schema.org/draft/2019-09/schema"
            | "http://json-schema.org/draft-07/schema"
            | "http://json-schema.org/draft-06/schema"
            | "http://json-schema.org/draft-04/schema"
    )
}

/// Whether `min` items have finite instances, the first ones described by `prefix`, the
/// others by `rest`.
fn tuple_has_instances(
    root: &Value,
    min: u64,
    prefix: &[Value],
    rest: Option<&Value>,
    targets: &BTreeMap<String, bool>,
) -> bool {
    let needed = usize::try_from(min).unwrap_or(usize::MAX);
    if !prefix
        .iter()
        .take(needed)
        .all(|s| has_instance(root, s, targets))
    {
        return false;
    }
    if needed <= prefix.len() {
        return true;
    }
    rest.is_none_or(|s| has_instance(root, s, targets))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(schema: Value) -> bool {
        check_finite_schema("response_format", &schema).is_err()
    }
    /// Schemas that require themselves without end are refused, through the root, `$defs`,
    /// `allOf`, every branch of an `anyOf` and an array's `minItems`.
    #[test]
    fn schemas_that_only_infinite_json_satisfies_are_refused() {
        for schema in [
            json!({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            json!({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                    "required": ["next"]}},
                   "type": "object", "properties": {"head": {"$ref": "#/$defs/n"}},
                   "required": ["head"]}),
            json!({"allOf": [{"$ref": "#/$defs/a"}], "$defs": {"a": {"type": "object",
                    "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                    "b": {"type": "array", "items": {"$ref": "#/$defs/a"}, "minItems": 1}}}),
            json!({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"},
                    {"type": "object", "properties": {"b": {"$ref": "#"}}, "required": ["b"]}]}},
                   "required": ["a"]}),
            json!({"type": "object", "properties": {"a": false}, "required": ["a"]}),
            json!({"type": "array", "minItems": 1, "prefixItems": [{"$ref": "#"}]}),
            json!({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                   "minItems": 2, "items": [{}], "additionalItems": {"$ref": "#"}}),
        ] {
            let e = check_finite_schema("response_format", &schema).unwrap_err();
            let body = e.to_body().error;
            assert_eq!(body.param.as_deref(), Some("response_format"), "{schema}");
            assert!(
                body.message.contains("no finite instance"),
                "{}",
                body.message
            );
        }
    }

    /// Recursive schemas with a way out, and what the check does not read, are accepted.
    #[test]
    fn recursive_schemas_with_a_way_out_are_accepted() {
        for schema in [
            json!({"type": "object", "properties": {"a": {"$ref": "#"}}}),
            // The endless chain is optional: `{}` satisfies the schema.
            json!({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                    "required": ["next"]}},
                   "type": "object", "properties": {"head": {"$ref": "#/$defs/n"}}}),
            json!({"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#"},
                    {"type": "null"}]}}, "required": ["next"]}),
            json!({"type": "object", "properties": {"name": {"type": "string"},
                    "children": {"type": "array", "items": {"$ref": "#"}}},
                   "required": ["name", "children"]}),
            json!({"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#"},
                    "minItems": 1}}}),
            // Without `"type": "object"` a string satisfies `required`.
            json!({"properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
            json!({"type": ["object", "string"], "properties": {"a": {"$ref": "#"}},
                   "required": ["a"]}),
            // Unresolvable, remote or re-based references are left to the compiler.
            json!({"type": "object", "properties": {"a": {"$ref": "#/nope"}}, "required": ["a"]}),
            json!({"type": "object", "properties": {"a": {"$ref": "https://x/s.json"}},
                   "required": ["a"]}),
            json!({"type": "object", "properties": {"a": {"$id": "https://x/a",
                    "type": "object", "properties": {"b": {"$ref": "#"}}, "required": ["b"]}},
                   "required": ["a"]}),
            json!(true),
            json!({}),
            // `prefixItems` is not read beside `additionalItems` or an `items` list (draft
            // 2019-09's tuples, as llguidance reads them), nor where `$schema` names an earlier
            // draft: `[{}]` satisfies these.
            json!({"type": "array", "minItems": 1, "prefixItems": [false], "items": {},
                   "additionalItems": {}}),
            json!({"type": "array", "minItems": 1, "prefixItems": [false], "items": [{}]}),
            json!({"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                   "minItems": 1, "prefixItems": [false]}),
        ] {
            assert!(!refused(schema.clone()), "{schema}");
        }
    }

    /// A schema with more distinct `$ref` targets than the bound is not checked.
    #[test]
    fn schemas_with_many_ref_targets_are_not_checked() {
        let mut defs = Map::new();
        for i in 0..=MAX_REF_TARGETS {
            defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{i}")}));
        }
        let mut schema = json!({"type": "object", "properties": {"a": {"$ref": "#"}},
                                "required": ["a"]});
        schema["$defs"] = Value::Object(defs);
        assert!(!refused(schema));
    }
}
