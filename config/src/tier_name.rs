//! Tier names: the keys of `tiers`, checked while the file is parsed so that a bad one is
//! refused at its own line (the parser knows where each key is written; a dotted path such as
//! `tiers.gold.x` could not be found again in the text).

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

/// The longest tier name, in bytes (tier names become metric labels and log fields).
pub const MAX_TIER_NAME_BYTES: usize = 64;

/// Checks a tier name: 1 to 64 ASCII letters, digits, `-` and `_`. The error names the tier
/// as written, escaped (a name may hold a newline or a quote).
pub fn check_tier_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_TIER_NAME_BYTES
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "tier name `{}`: tier names are 1-{MAX_TIER_NAME_BYTES} characters of [A-Za-z0-9_-]",
            name.escape_debug()
        ))
    }
}

/// A map keyed by tier name, each name checked by [`check_tier_name`] as its key is read
/// (`#[serde(deserialize_with = "deserialize_tiers")]`).
pub fn deserialize_tiers<'de, D, T>(deserializer: D) -> Result<BTreeMap<String, T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    deserializer.deserialize_map(TiersVisitor(PhantomData))
}

/// A tier name read from a key.
struct TierName(String);

impl<'de> Deserialize<'de> for TierName {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct NameVisitor;
        impl Visitor<'_> for NameVisitor {
            type Value = TierName;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tier name")
            }
            fn visit_str<E: de::Error>(self, name: &str) -> Result<TierName, E> {
                check_tier_name(name).map_err(E::custom)?;
                Ok(TierName(name.to_string()))
            }
        }
        deserializer.deserialize_str(NameVisitor)
    }
}

struct TiersVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for TiersVisitor<T> {
    type Value = BTreeMap<String, T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a map")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut tiers = BTreeMap::new();
        while let Some((TierName(name), tier)) = map.next_entry::<TierName, T>()? {
            tiers.insert(name, tier);
        }
        Ok(tiers)
    }
}

#[cfg(test)]
mod tests {
    use super::check_tier_name;

    #[test]
    fn tier_names_are_ascii_words_of_1_to_64_bytes() {
        for ok in ["gold", "a", "premium-2", "BATCH_x", &"t".repeat(64)] {
            check_tier_name(ok).unwrap();
        }
        for (bad, shown) in [
            ("", ""),
            ("gold tier", "gold tier"),
            ("a.b", "a.b"),
            ("\u{fc}ber", "\u{fc}ber"),
            ("a\"b\nc", "a\\\"b\\nc"),
        ] {
            assert_eq!(
                check_tier_name(bad).unwrap_err(),
                format!("tier name `{shown}`: tier names are 1-64 characters of [A-Za-z0-9_-]")
            );
        }
        assert!(check_tier_name(&"t".repeat(65)).is_err());
    }
}
