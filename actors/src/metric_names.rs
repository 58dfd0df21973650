//! The metrics the engine records through the `metrics` crate: their names (those of
//! `switchyard_policies::metric_names`, re-exported here, which `switchyard-api` describes for
//! `/metrics`), the labels a request's series carry, and the series created at zero before
//! serving.

pub use switchyard_policies::metric_names::*;

/// The tenant that labels a request's metrics: `tenant` where `configured` names it, ""
/// (no tenant label) otherwise, so that the label's values are the configuration's.
pub fn metrics_tenant(
    configured: &std::collections::BTreeSet<String>,
    tenant: &str,
) -> std::sync::Arc<str> {
    std::sync::Arc::from(if configured.contains(tenant) {
        tenant
    } else {
        ""
    })
}

/// The labels the token counters ([`PROMPT_TOKENS`], [`GENERATION_TOKENS`]) of a request of
/// metrics tenant `tenant` ([`metrics_tenant`]; "" for none) carry.
pub fn tenant_labels(tenant: &std::sync::Arc<str>) -> Vec<metrics::Label> {
    if tenant.is_empty() {
        Vec::new()
    } else {
        vec![metrics::Label::new(LABEL_TENANT, tenant.clone())]
    }
}

/// The labels the outcome counters ([`REQUEST_SUCCESS`], [`REQUEST_ABORTED`],
/// [`REQUEST_FAILED`]) of a request of tier `tier` and tenant `tenant` (each "" for none)
/// carry, before their own `finished_reason` or `reason`.
pub fn outcome_labels(
    tier: &std::sync::Arc<str>,
    tenant: &std::sync::Arc<str>,
) -> Vec<metrics::Label> {
    let mut labels = tier_labels(tier);
    labels.extend(tenant_labels(tenant));
    labels
}

/// Creates the per-tenant series at zero: for each configured tenant (its name and the
/// metrics tier of one of its keys, "" for none; a tenant of keys of several tiers comes once
/// per tier), the token counters with its label and the outcome counters with its and the
/// tier's, each value of their own label included.
pub fn register_tenants(tenants: &[(String, String)]) {
    let mut tokens_done: Vec<&str> = Vec::new();
    for (name, tier) in tenants {
        if name.is_empty() {
            continue;
        }
        let tenant: std::sync::Arc<str> = name.as_str().into();
        if !tokens_done.contains(&name.as_str()) {
            tokens_done.push(name);
            for c in [PROMPT_TOKENS, PROMPT_TOKENS_CACHED, GENERATION_TOKENS] {
                metrics::counter!(c, tenant_labels(&tenant)).increment(0);
            }
        }
        let tier: std::sync::Arc<str> = tier.as_str().into();
        let labels = outcome_labels(&tier, &tenant);
        let by = |name: &'static str, key: &'static str, values: &[&'static str]| {
            for &v in values {
                let mut l = labels.clone();
                l.push(metrics::Label::new(key, v));
                metrics::counter!(name, l).increment(0);
            }
        };
        by(REQUEST_SUCCESS, LABEL_FINISHED_REASON, FINISHED_REASONS);
        by(REQUEST_FAILED, LABEL_REASON, FAILURE_REASONS);
        metrics::counter!(REQUEST_ABORTED, labels.clone()).increment(0);
    }
}

/// The labels a request of tier `tier` ("" for none) adds to [`TIERED`] metrics.
pub fn tier_labels(tier: &std::sync::Arc<str>) -> Vec<metrics::Label> {
    if tier.is_empty() {
        Vec::new()
    } else {
        vec![metrics::Label::new(LABEL_TIER, tier.clone())]
    }
}

/// Counts one choice of tier `tier` against an SLO target (`ttft` or `tpot`).
pub fn record_slo(tier: &std::sync::Arc<str>, target: &'static str, met: bool) {
    let outcome = if met { "met" } else { "missed" };
    let mut labels = tier_labels(tier);
    labels.push(metrics::Label::new(LABEL_TARGET, target));
    labels.push(metrics::Label::new(LABEL_OUTCOME, outcome));
    metrics::counter!(SLO_ATTAINMENT, labels).increment(1);
}

/// Creates the per-tier series at zero, leaving those already there as they are (so a reload
/// may call it again with every tier in force; [`register_at_zero`] creates the untiered
/// ones): for
/// each tier (name, whether it has a TTFT target, whether it has a TPOT target), the
/// [`TIERED`] metrics with its label and [`SLO_ATTAINMENT`] for each target it has.
pub fn register_tiers(tiers: &[(String, bool, bool)]) {
    for (name, ttft, tpot) in tiers {
        let tier: std::sync::Arc<str> = name.as_str().into();
        let labels = tier_labels(&tier);
        for &h in TIERED {
            let by = |key: &'static str, values: &[&'static str]| {
                for &v in values {
                    let mut l = labels.clone();
                    l.push(metrics::Label::new(key, v));
                    metrics::counter!(h, l).increment(0);
                }
            };
            match h {
                REQUEST_SUCCESS => by(LABEL_FINISHED_REASON, FINISHED_REASONS),
                REQUEST_FAILED => by(LABEL_REASON, FAILURE_REASONS),
                REQUEST_ABORTED => metrics::counter!(h, labels.clone()).increment(0),
                _ => drop(metrics::histogram!(h, labels.clone())),
            }
        }
        // Made, not set: a reload registers the tiers in force again.
        metrics::gauge!(KV_CACHE_BLOCKS_USED, labels.clone()).increment(0.0);
        for c in [
            LORA_SHARE_EVICTIONS,
            LORA_SHARE_REFUSALS,
            LORA_SHARE_TRANSFERS,
        ] {
            metrics::counter!(c, labels.clone()).increment(0);
        }
        for (target, has) in [("ttft", *ttft), ("tpot", *tpot)] {
            if has {
                for outcome in ["met", "missed"] {
                    let mut l = labels.clone();
                    l.push(metrics::Label::new(LABEL_TARGET, target));
                    l.push(metrics::Label::new(LABEL_OUTCOME, outcome));
                    metrics::counter!(SLO_ATTAINMENT, l).increment(0);
                }
            }
        }
    }
}

/// Creates every engine metric at zero, [`REQUEST_SUCCESS`] and [`REQUEST_FAILED`] with each
/// value of their label (not [`STRUCTURED_REQUESTS`], by kind of specification), so that
/// `/metrics` lists them from the start as vLLM's does: a dashboard shows 0 rather than no
/// data, and `rate()` sees the first increment. Call it once the recorder is installed.
pub fn register_at_zero() {
    for &g in GAUGES {
        // Per tier only (`register_tiers`).
        if g != KV_CACHE_BLOCKS_USED {
            metrics::gauge!(g).set(0.0);
        }
    }
    for &c in COUNTERS {
        match c {
            REQUEST_SUCCESS => {
                for &r in FINISHED_REASONS {
                    metrics::counter!(c, LABEL_FINISHED_REASON => r).increment(0);
                }
            }
            REQUEST_FAILED => {
                for &r in FAILURE_REASONS {
                    metrics::counter!(c, LABEL_REASON => r).increment(0);
                }
            }
            // By kind of specification, and per tier (`register_tiers`).
            STRUCTURED_REQUESTS | SLO_ATTAINMENT | LORA_SHARE_EVICTIONS | LORA_SHARE_REFUSALS
            | LORA_SHARE_TRANSFERS => {}
            _ => metrics::counter!(c).increment(0),
        }
    }
    for &h in HISTOGRAMS {
        drop(metrics::histogram!(h));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn text(labels: &[metrics::Label]) -> Vec<String> {
        labels
            .iter()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect()
    }

    /// Only a configured tenant labels the usage counters; any other name (one a client made
    /// up, the open API's `anonymous`, an offline request's none) counts without the label.
    #[test]
    fn only_configured_tenants_become_label_values() {
        let configured: std::collections::BTreeSet<String> =
            ["acme".to_owned(), "globex".to_owned()].into();
        assert_eq!(&*metrics_tenant(&configured, "acme"), "acme");
        for other in ["mallory", "anonymous", "", "ACME", "acme "] {
            assert_eq!(&*metrics_tenant(&configured, other), "", "{other:?}");
        }
        assert_eq!(&*metrics_tenant(&Default::default(), "acme"), "");
    }

    #[test]
    fn outcome_labels_hold_the_tier_and_the_tenant_each_when_set() {
        let (gold, acme, none): (Arc<str>, Arc<str>, Arc<str>) =
            ("gold".into(), "acme".into(), "".into());
        assert_eq!(
            text(&outcome_labels(&gold, &acme)),
            ["tier=gold", "tenant=acme"]
        );
        assert_eq!(text(&outcome_labels(&none, &acme)), ["tenant=acme"]);
        assert_eq!(text(&outcome_labels(&gold, &none)), ["tier=gold"]);
        assert!(outcome_labels(&none, &none).is_empty());
        assert_eq!(text(&tenant_labels(&acme)), ["tenant=acme"]);
        assert!(tenant_labels(&none).is_empty());
    }
}
