//! Reading policy parameters from YAML with errors that name the field.

use crate::short_number::short_number;
use std::collections::BTreeMap;

use serde_yaml::{Mapping, Value};

use crate::error::PolicyError;

/// Most entries accepted in a map-valued parameter (e.g. per-tenant weights).
pub(crate) const MAX_MAP_ENTRIES: usize = 4096;
/// Longest key accepted in a map-valued parameter.
pub(crate) const MAX_KEY_LEN: usize = 256;

/// A validated parameter mapping of one policy.
pub(crate) struct Params<'v> {
    /// The policy name, for error messages.
    policy: &'static str,
    /// The mapping (empty when the parameters were null).
    map: Option<&'v Mapping>,
}

/// An aging interval of `ms` milliseconds in whole microseconds: 0 for none, at least one
/// when it is positive (so aging never switches off by rounding).
pub(crate) fn aging_interval_us(ms: f64) -> u64 {
    if ms > 0.0 {
        ((ms * 1e3).round() as u64).max(1)
    } else {
        0
    }
}

/// The levels a request arrived at `arrival` has risen by `now` under an aging interval of
/// `interval_us` microseconds ([`aging_interval_us`]; 0: none): one per whole interval.
pub(crate) fn aged_levels(
    interval_us: u64,
    arrival: crate::types::Timestamp,
    now: crate::types::Timestamp,
) -> i64 {
    match interval_us {
        0 => 0,
        i => (now.saturating_sub(arrival) / i) as i64,
    }
}

impl<'v> Params<'v> {
    /// Accepts null or a mapping whose keys are all in `known`.
    pub(crate) fn new(
        policy: &'static str,
        value: &'v Value,
        known: &[&str],
    ) -> Result<Self, PolicyError> {
        let map = match value {
            Value::Null => None,
            Value::Mapping(m) => Some(m),
            other => {
                return Err(PolicyError::InvalidParam {
                    policy,
                    field: "params".into(),
                    reason: format!("expected a mapping, got {}", kind(other)),
                })
            }
        };
        if let Some(m) = map {
            for k in m.keys() {
                let Some(name) = k.as_str() else {
                    return Err(PolicyError::InvalidParam {
                        policy,
                        field: format!("{k:?}"),
                        reason: "parameter names must be strings".into(),
                    });
                };
                if !known.contains(&name) {
                    let reason = if known.is_empty() {
                        format!("unknown parameter: `{policy}` takes no parameters")
                    } else {
                        format!(
                            "unknown parameter{}; known: {}",
                            crate::nearest_name::did_you_mean(name, known),
                            known.join(", ")
                        )
                    };
                    return Err(PolicyError::InvalidParam {
                        policy,
                        field: name.chars().take(MAX_KEY_LEN).collect(),
                        reason,
                    });
                }
            }
        }
        Ok(Self { policy, map })
    }

    fn get(&self, field: &str) -> Option<&'v Value> {
        self.map.and_then(|m| m.get(field))
    }

    fn err(&self, field: &str, reason: String) -> PolicyError {
        PolicyError::InvalidParam {
            policy: self.policy,
            field: field.to_string(),
            reason,
        }
    }

    /// A finite number in `min..=max`, or `default` when absent.
    pub(crate) fn f64_in(
        &self,
        field: &str,
        default: f64,
        min: f64,
        max: f64,
    ) -> Result<f64, PolicyError> {
        let Some(v) = self.get(field) else {
            return Ok(default);
        };
        let x = v
            .as_f64()
            .ok_or_else(|| self.err(field, format!("expected a number, got {}", kind(v))))?;
        if !x.is_finite() || x < min || x > max {
            return Err(self.err(
                field,
                format!("must be in {min}..={max}, got {}", short_number(x)),
            ));
        }
        Ok(x)
    }

    /// An aging interval in milliseconds (`default` when absent): 0 (no aging) or at least
    /// 0.001 (one microsecond, the clock's resolution), at most 1e9.
    pub(crate) fn aging_interval_ms(&self, field: &str, default: f64) -> Result<f64, PolicyError> {
        let ms = self.f64_in(field, default, 0.0, 1e9)?;
        if ms > 0.0 && ms < 1e-3 {
            return Err(self.err(
                field,
                format!(
                    "must be 0 (no aging) or at least 0.001 (one microsecond), got {}",
                    short_number(ms)
                ),
            ));
        }
        Ok(ms)
    }

    /// An integer in `min..=max`, or `default` when absent.
    pub(crate) fn u64_in(
        &self,
        field: &str,
        default: u64,
        min: u64,
        max: u64,
    ) -> Result<u64, PolicyError> {
        let Some(v) = self.get(field) else {
            return Ok(default);
        };
        let x = v.as_u64().ok_or_else(|| {
            self.err(
                field,
                format!("expected a non-negative integer, got {}", kind(v)),
            )
        })?;
        if x < min || x > max {
            return Err(self.err(field, format!("must be in {min}..={max}, got {x}")));
        }
        Ok(x)
    }

    /// An integer in `min..=max`, or `None` when absent or null.
    pub(crate) fn opt_u64_in(
        &self,
        field: &str,
        min: u64,
        max: u64,
    ) -> Result<Option<u64>, PolicyError> {
        match self.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(_) => self.u64_in(field, 0, min, max).map(Some),
        }
    }

    /// A boolean, or `default` when absent.
    pub(crate) fn bool(&self, field: &str, default: bool) -> Result<bool, PolicyError> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("expected true or false, got {}", kind(v)))),
        }
    }

    /// A map from short strings (`what`s, e.g. tenants) to finite numbers in `min..=max`
    /// (empty when absent); an error names the entry.
    pub(crate) fn map_in(
        &self,
        field: &str,
        what: &str,
        min: f64,
        max: f64,
    ) -> Result<BTreeMap<String, f64>, PolicyError> {
        let Some(v) = self.get(field) else {
            return Ok(BTreeMap::new());
        };
        let m = v
            .as_mapping()
            .ok_or_else(|| self.err(field, format!("expected a mapping, got {}", kind(v))))?;
        if m.len() > MAX_MAP_ENTRIES {
            return Err(self.err(field, format!("at most {MAX_MAP_ENTRIES} entries")));
        }
        let mut out = BTreeMap::new();
        for (k, val) in m {
            let key = k
                .as_str()
                .filter(|s| s.len() <= MAX_KEY_LEN)
                .ok_or_else(|| {
                    self.err(
                        field,
                        format!("keys must be strings of at most {MAX_KEY_LEN} bytes"),
                    )
                })?;
            let x = val.as_f64().ok_or_else(|| {
                self.err(
                    field,
                    format!(
                        "value for {what} `{key}`: expected a number, got {}",
                        kind(val)
                    ),
                )
            })?;
            if !x.is_finite() || x < min || x > max {
                return Err(self.err(
                    field,
                    format!(
                        "value for {what} `{key}` must be in {min}..={max}, got {}",
                        short_number(x)
                    ),
                ));
            }
            out.insert(key.to_string(), x);
        }
        Ok(out)
    }
}

/// What a value is, for an error: a number or a boolean as written (`-1`, `2.5`), the rest
/// by kind.
fn kind(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => b.to_string(),
        Value::Number(n) => n.to_string(),
        Value::String(_) => "a string".into(),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(_) => "a tagged value".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn yaml(s: &str) -> Value {
        serde_yaml::from_str(s).unwrap()
    }

    #[test]
    fn unknown_field_is_named() {
        let v = yaml("{budget: 3}");
        let e = Params::new("x", &v, &["token_budget"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("`budget`") && e.contains("token_budget"), "{e}");
        assert!(!e.contains("did you mean"), "{e}");
        // A near miss is given the parameter it most likely misspells.
        let v = yaml("{step_overhed_ms: 5}");
        let e = Params::new("x", &v, &["step_overhead_ms", "prefill_us_per_token"])
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            e,
            "policy `x`: parameter `step_overhed_ms`: unknown parameter (did you mean \
             `step_overhead_ms`?); known: step_overhead_ms, prefill_us_per_token"
        );
    }

    #[test]
    fn bad_type_and_range_name_the_field() {
        let v = yaml("{a: hello, b: -1, c: 2.5}");
        let p = Params::new("x", &v, &["a", "b", "c"]).unwrap();
        let e = p.f64_in("a", 1.0, 0.0, 10.0).err().unwrap().to_string();
        assert!(e.contains("`a`") && e.contains("a string"), "{e}");
        let e = p.u64_in("b", 1, 0, 10).err().unwrap().to_string();
        assert!(e.contains("`b`"), "{e}");
        let e = p.u64_in("c", 1, 0, 10).err().unwrap().to_string();
        assert!(e.contains("`c`"), "{e}");
        assert_eq!(p.f64_in("c", 1.0, 0.0, 10.0), Ok(2.5));
        assert_eq!(p.f64_in("missing", 1.5, 0.0, 10.0), Ok(1.5));
    }

    /// Numbers past the range are echoed short: `{}` wrote 1e300 as 301 digits and 1e-300
    /// as 302 characters.
    #[test]
    fn numbers_out_of_range_are_echoed_short() {
        let v = yaml("{big: 1e300, tiny: 1e-300, w: {a: -1e300}}");
        let p = Params::new("x", &v, &["big", "tiny", "w"]).unwrap();
        let e = p.f64_in("big", 1.0, 0.0, 10.0).err().unwrap().to_string();
        assert!(e.ends_with("must be in 0..=10, got 1e300"), "{e}");
        let e = p.aging_interval_ms("tiny", 1.0).err().unwrap().to_string();
        assert!(e.ends_with("(one microsecond), got 1e-300"), "{e}");
        let e = p
            .map_in("w", "tenant", 1e-3, 1e6)
            .err()
            .unwrap()
            .to_string();
        assert!(e.ends_with("must be in 0.001..=1000000, got -1e300"), "{e}");
    }

    #[test]
    fn non_mapping_params_are_refused() {
        let v = yaml("[1, 2]");
        assert!(Params::new("x", &v, &[]).is_err());
    }

    #[test]
    fn map_in_validates_values_and_names_the_entry() {
        let v = yaml("{w: {a: 2, b: 0}, tiny: {c: 1e-300}, huge: {d: 1e7}, s: {e: x}}");
        let p = Params::new("x", &v, &["w", "tiny", "huge", "s"]).unwrap();
        for (field, key) in [("w", "`b`"), ("tiny", "`c`"), ("huge", "`d`"), ("s", "`e`")] {
            let e = p
                .map_in(field, "tenant", 1e-3, 1e6)
                .err()
                .unwrap()
                .to_string();
            assert!(
                e.contains(&format!("`{field}`")) && e.contains(&format!("tenant {key}")),
                "{e}"
            );
        }
        let ok = yaml("{w: {a: 0.001, b: 1000000}}");
        let p = Params::new("x", &ok, &["w"]).unwrap();
        assert_eq!(p.map_in("w", "tenant", 1e-3, 1e6).unwrap().len(), 2);
    }
}
