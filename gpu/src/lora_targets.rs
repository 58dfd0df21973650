//! Which modules of the base model an adapter's `adapter_config.json` says it adapts, read as
//! Hugging Face PEFT reads it (`peft.tuners.tuners_utils.check_target_module_exists`).
//!
//! PEFT builds LoRA layers only on the modules its configuration selects and then loads the
//! weights file into them: tensors of modules it did not build are unexpected keys and are not
//! applied. An adapter file whose tensors and configuration disagree is therefore served, by
//! PEFT, as its configuration says; [`ModuleSelection`] reproduces that selection so that this
//! server computes what PEFT computes (the tensors outside it are skipped, and the loader says
//! how many in the log).
//!
//! The rules, on a module's key (`model.layers.3.self_attn.q_proj`, the tensor's name without
//! PEFT's `base_model.model.` prefix and its `lora_A.weight` suffix):
//! - `exclude_modules`: a string is a regular expression the whole key must match; a list
//!   excludes a key equal to an entry or ending in `.` and the entry.
//! - `target_modules`: a string is a regular expression the whole key must match, except
//!   `"all-linear"` (every linear layer but the output head: all seven projections here); a
//!   list selects a key equal to an entry or ending in `.` and the entry; absent (`null`),
//!   every module whose tensors the file holds.
//! - `layers_to_transform` (an index or a list of them) keeps, of the modules a list selected
//!   by suffix (or `"all-linear"`, which PEFT expands to such a list), those of the listed
//!   layers; a key listed in full is kept whatever its layer. PEFT refuses it together with a
//!   regular expression, and so does this module.
//!
//! Regular expressions are Rust's `regex` syntax, which agrees with Python's `re` on the
//! patterns adapters use (alternation, classes, repetition); one that uses what Rust's lacks
//! (look-around, back-references) is refused rather than guessed at.

use regex::Regex;

/// The modules an adapter's configuration selects.
#[derive(Debug, Clone)]
pub(crate) struct ModuleSelection {
    /// `target_modules`.
    targets: Targets,
    /// `layers_to_transform`; `None`: every layer.
    layers: Option<Vec<u64>>,
    /// `exclude_modules`.
    exclude: Option<Targets>,
}

/// A set of module keys as PEFT's configuration writes one.
#[derive(Debug, Clone)]
enum Targets {
    /// Every module (`"all-linear"`, or no `target_modules`).
    All,
    /// Keys equal to an entry or ending in `.` and an entry.
    Names(Vec<String>),
    /// Keys the whole of which the expression matches.
    Pattern(Regex),
}

impl Targets {
    /// Reads a `target_modules` or `exclude_modules` value; `field` names it in errors.
    fn parse(field: &str, v: &serde_json::Value) -> Result<Option<Self>, String> {
        match v {
            serde_json::Value::Null => Ok(None),
            serde_json::Value::String(s) if field == "target_modules" && s == "all-linear" => {
                Ok(Some(Targets::All))
            }
            serde_json::Value::String(s) => Regex::new(&format!("^(?:{s})$"))
                .map(|r| Some(Targets::Pattern(r)))
                .map_err(|e| {
                    format!("{field} \"{s}\" is not a regular expression this server reads: {e}")
                }),
            serde_json::Value::Array(items) => items
                .iter()
                .map(|i| {
                    i.as_str()
                        .map(str::to_owned)
                        .ok_or_else(|| format!("{field} lists {i}, which is not a module name"))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(|names| Some(Targets::Names(names))),
            other => Err(format!(
                "{field} is {other}: a list of module names or a regular expression"
            )),
        }
    }

    /// Whether the key is in the set, and whether it was named in full (a full name is kept
    /// whatever `layers_to_transform` says).
    fn matches(&self, key: &str) -> (bool, bool) {
        match self {
            Targets::All => (true, false),
            Targets::Pattern(r) => (r.is_match(key), false),
            Targets::Names(names) => {
                if names.iter().any(|n| n == key) {
                    (true, true)
                } else {
                    let suffix = names.iter().any(|n| {
                        key.strip_suffix(n.as_str())
                            .is_some_and(|rest| rest.ends_with('.'))
                    });
                    (suffix, false)
                }
            }
        }
    }
}

impl ModuleSelection {
    /// Reads the selection from `adapter_config.json`'s object.
    pub(crate) fn parse(obj: &serde_json::Map<String, serde_json::Value>) -> Result<Self, String> {
        let null = serde_json::Value::Null;
        let targets = Targets::parse("target_modules", obj.get("target_modules").unwrap_or(&null))?
            .unwrap_or(Targets::All);
        let exclude = Targets::parse(
            "exclude_modules",
            obj.get("exclude_modules").unwrap_or(&null),
        )?;
        let layers = match obj.get("layers_to_transform").unwrap_or(&null) {
            serde_json::Value::Null => None,
            serde_json::Value::Number(n) => Some(vec![n
                .as_u64()
                .ok_or_else(|| format!("layers_to_transform {n} is not a layer index"))?]),
            serde_json::Value::Array(items) if items.is_empty() => None,
            serde_json::Value::Array(items) => Some(
                items
                    .iter()
                    .map(|i| {
                        i.as_u64().ok_or_else(|| {
                            format!("layers_to_transform lists {i}, not a layer index")
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            other => {
                return Err(format!(
                    "layers_to_transform is {other}: a layer index or a list"
                ))
            }
        };
        if layers.is_some() && matches!(targets, Targets::Pattern(_)) {
            return Err(
                "layers_to_transform cannot be used with a regular expression in target_modules \
                 (PEFT refuses it too)"
                    .into(),
            );
        }
        // PEFT finds the layer index after `layers_pattern`; Llama's decoder layers are
        // `layers`, so any other pattern would select no layer at all.
        if layers.is_some() {
            let pattern_ok = match obj.get("layers_pattern").unwrap_or(&null) {
                serde_json::Value::Null => true,
                serde_json::Value::String(p) => p.is_empty() || p == "layers",
                serde_json::Value::Array(ps) => ps.is_empty() || ps.iter().any(|p| p == "layers"),
                _ => false,
            };
            if !pattern_ok {
                return Err(
                    "layers_pattern names no layers of this model (they are `layers`)".into(),
                );
            }
        }
        Ok(ModuleSelection {
            targets,
            layers,
            exclude,
        })
    }

    /// Whether PEFT would build a LoRA layer on the module `key` of decoder layer `layer`.
    pub(crate) fn selects(&self, key: &str, layer: usize) -> bool {
        if self.exclude.as_ref().is_some_and(|e| e.matches(key).0) {
            return false;
        }
        let (found, named_in_full) = self.targets.matches(key);
        if !found || named_in_full || matches!(self.targets, Targets::Pattern(_)) {
            return found;
        }
        self.layers
            .as_ref()
            .is_none_or(|layers| layers.contains(&(layer as u64)))
    }
}

/// The module key of a PEFT tensor name: without the `base_model.model.` prefix and the
/// `lora_A`/`lora_B` suffix.
pub(crate) fn module_key(tensor: &str) -> &str {
    let name = tensor.strip_prefix("base_model.model.").unwrap_or(tensor);
    [
        ".lora_A.weight",
        ".lora_B.weight",
        ".lora_A.default.weight",
        ".lora_B.default.weight",
    ]
    .iter()
    .find_map(|s| name.strip_suffix(s))
    .unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn selection(config: serde_json::Value) -> Result<ModuleSelection, String> {
        ModuleSelection::parse(config.as_object().unwrap())
    }

    const Q3: &str = "model.layers.3.self_attn.q_proj";

    #[test]
    fn selects_as_peft_does() {
        let check = |config: serde_json::Value, key: &str, layer: usize, expect: bool| {
            let s = selection(config.clone()).unwrap();
            assert_eq!(s.selects(key, layer), expect, "{config} on {key}");
        };
        check(serde_json::json!({}), Q3, 3, true);
        check(
            serde_json::json!({"target_modules": ["q_proj"]}),
            Q3,
            3,
            true,
        );
        check(
            serde_json::json!({"target_modules": ["v_proj"]}),
            Q3,
            3,
            false,
        );
        check(
            serde_json::json!({"target_modules": ["proj"]}),
            Q3,
            3,
            false,
        );
        check(
            serde_json::json!({"target_modules": ["self_attn.q_proj"]}),
            Q3,
            3,
            true,
        );
        check(
            serde_json::json!({"target_modules": "all-linear"}),
            Q3,
            3,
            true,
        );
        check(
            serde_json::json!({"target_modules": ".*\\.(q|v)_proj"}),
            Q3,
            3,
            true,
        );
        check(
            serde_json::json!({"target_modules": "q_proj"}),
            Q3,
            3,
            false,
        );
        check(
            serde_json::json!({"target_modules": ["q_proj"], "layers_to_transform": [0, 1]}),
            Q3,
            3,
            false,
        );
        check(
            serde_json::json!({"target_modules": ["q_proj"], "layers_to_transform": 3}),
            Q3,
            3,
            true,
        );
        check(
            serde_json::json!({"target_modules": "all-linear", "layers_to_transform": [1]}),
            Q3,
            3,
            false,
        );
        check(
            serde_json::json!({"target_modules": [Q3], "layers_to_transform": [1]}),
            Q3,
            3,
            true,
        );
        check(
            serde_json::json!({"target_modules": "all-linear", "exclude_modules": ["q_proj"]}),
            Q3,
            3,
            false,
        );
        assert_eq!(
            module_key("base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"),
            Q3
        );
    }

    #[test]
    fn refuses_what_peft_refuses_or_this_server_cannot_read() {
        for config in [
            serde_json::json!({"target_modules": ".*q_proj", "layers_to_transform": [1]}),
            serde_json::json!({"target_modules": "(?<=x)q"}),
            serde_json::json!({"target_modules": [1]}),
            serde_json::json!({"target_modules": ["q_proj"], "layers_to_transform": [-1]}),
            serde_json::json!({"target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "h"}),
        ] {
            assert!(selection(config.clone()).is_err(), "{config}");
        }
    }
}
