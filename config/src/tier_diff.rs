//! What changed in the settings of the tiers that two versions of a `tiers` section both
//! have: the server's reload logs it and the simulator's report names it under a change, in
//! the same terms.

use std::collections::BTreeMap;

use serde::Serialize;

/// One setting of a tier kept whose value changed, each value as JSON text (`none` for a
/// setting left out).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierFieldChange {
    pub tier: String,
    pub field: String,
    pub from: String,
    pub to: String,
}

/// The settings that changed of the tiers in both `before` and `after`, by tier then field
/// (tiers added or removed are not listed: the caller names those as it words them).
pub fn tier_field_changes<T: Serialize>(
    before: &BTreeMap<String, T>,
    after: &BTreeMap<String, T>,
) -> Vec<TierFieldChange> {
    let fields = |t: &T| match serde_json::to_value(t) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => serde_json::Map::new(),
    };
    let shown = |v: Option<&serde_json::Value>| match v {
        None | Some(serde_json::Value::Null) => "none".to_string(),
        Some(v) => v.to_string(),
    };
    let mut changed = Vec::new();
    for (name, old) in before {
        let Some(new) = after.get(name) else {
            continue;
        };
        let (old, new) = (fields(old), fields(new));
        let mut keys: Vec<&String> = old.keys().chain(new.keys()).collect();
        keys.sort_unstable();
        keys.dedup();
        for key in keys {
            let (from, to) = (shown(old.get(key)), shown(new.get(key)));
            if from != to {
                changed.push(TierFieldChange {
                    tier: name.clone(),
                    field: key.clone(),
                    from,
                    to,
                });
            }
        }
    }
    changed
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TierConfig;

    #[test]
    fn only_the_settings_that_changed_of_the_tiers_kept_are_listed() {
        let tier = |yaml: &str| serde_yaml::from_str::<TierConfig>(yaml).unwrap();
        let before = BTreeMap::from([
            ("gold".to_string(), tier("{ttft_ms: 200, priority: 0}")),
            ("free".to_string(), tier("{}")),
            ("gone".to_string(), tier("{}")),
        ]);
        let after = BTreeMap::from([
            (
                "gold".to_string(),
                tier("{ttft_ms: 150, weight: 2.0, priority: 0}"),
            ),
            ("free".to_string(), tier("{tpot_ms: 30}")),
            ("new".to_string(), tier("{ttft_ms: 1}")),
        ]);
        let got: Vec<String> = tier_field_changes(&before, &after)
            .into_iter()
            .map(|c| format!("{}.{} {} -> {}", c.tier, c.field, c.from, c.to))
            .collect();
        // A setting left out is `none` and the default weight 1.0; the tiers added or
        // removed are not listed.
        assert_eq!(
            got,
            [
                "free.tpot_ms none -> 30.0",
                "gold.ttft_ms 200.0 -> 150.0",
                "gold.weight 1.0 -> 2.0"
            ]
        );
        assert!(tier_field_changes(&after, &after).is_empty());
    }
}
