//! Hiding the series of tenants and tiers a reload removed from `/metrics`, and those of a
//! tenant under a tier it no longer has.
//!
//! The exporter (metrics-exporter-prometheus 0.18) keeps every series it was ever handed: its
//! registry is private to its recorder, its handle can only render, and its one way of letting
//! series go (`PrometheusBuilder::idle_timeout`) drops whatever was not updated for a while,
//! by kind of metric, not by label: the series made at zero for a configured tenant that has
//! sent nothing yet would go too. So the one place `/metrics` is rendered passes the text
//! through [`ConfiguredLabels::retain_configured`], which drops each sample line whose
//! `tenant` label is not one of the API keys' tenants, whose `tier` label is not one of the
//! configured tiers, or that carries both and whose pair is not one of an API key's (tenant,
//! tier): the request outcome counters (`request_success_total`, `request_aborted_total`,
//! `request_failure_total`) and `rate_limited_total` carry both, so a tenant whose keys moved
//! from `gold` to `silver` shows its `silver` series only. All as
//! [`crate::ApiState::reload_access`] last put them in force. For Prometheus a series that
//! leaves the scrape is stale: a removed tenant, or a tenant's former tier, no longer looks
//! present, and dashboards' cardinality follows the configuration. The exporter keeps the
//! hidden series' values: a tenant that comes back (or moves back) shows its counters where
//! they were, still monotonic.
//!
//! Matching is exact: a label value is compared, as the exposition spells it (escaped by the
//! exporter's own [`sanitize_label_value`]), with the configured names escaped the same way, so
//! `a` never matches `ab` and a name with `"` or `\` is found as written. The cost is linear
//! in the exposition's length (one pass, one hash lookup per `tenant` or `tier` label and one
//! per line that has both).
//! `# HELP` and `# TYPE` lines stay whole, even for a metric whose every series is hidden.

use std::collections::{HashMap, HashSet};

use metrics_exporter_prometheus::formatting::sanitize_label_value;

use super::{LABEL_TENANT, LABEL_TIER};

/// The `tenant` and `tier` label values `/metrics` shows: the configuration's, escaped as the
/// exposition writes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct ConfiguredLabels {
    /// The API keys' tenants, escaped.
    tenants: HashSet<String>,
    /// The configured tiers' names, escaped.
    tiers: HashSet<String>,
    /// Each tenant's tiers (those of its API keys), all escaped.
    tenant_tiers: HashMap<String, HashSet<String>>,
}

impl ConfiguredLabels {
    /// The label values of the API keys' `(tenant, tier)` pairs and of the configured `tiers`
    /// (each name as configured, unescaped).
    pub(crate) fn new<'a>(
        keys: impl IntoIterator<Item = (&'a str, &'a str)>,
        tiers: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let mut tenant_tiers: HashMap<String, HashSet<String>> = HashMap::new();
        for (tenant, tier) in keys {
            tenant_tiers
                .entry(sanitize_label_value(tenant))
                .or_default()
                .insert(sanitize_label_value(tier));
        }
        Self {
            tenants: tenant_tiers.keys().cloned().collect(),
            tiers: tiers.into_iter().map(sanitize_label_value).collect(),
            tenant_tiers,
        }
    }

    /// The labels of `config`: its API keys' tenants, with their tiers, and its tiers (on an
    /// open API no series carries a tenant, so none is needed).
    pub(crate) fn of(config: &crate::ApiConfig) -> Self {
        Self::new(
            config
                .api_keys
                .iter()
                .map(|k| (k.tenant.as_str(), k.tier.as_str())),
            config.tiers.iter().map(String::as_str),
        )
    }

    /// `exposition` (Prometheus text format, as the exporter renders it) without the sample
    /// lines of a tenant or tier not configured; every other line as it was.
    pub(crate) fn retain_configured(&self, exposition: &str) -> String {
        let mut kept = String::with_capacity(exposition.len());
        for line in exposition.split_inclusive('\n') {
            if self.shows(line) {
                kept.push_str(line);
            }
        }
        kept
    }

    /// Whether `line` stays: a comment, a blank line, a sample without labels, one whose
    /// `tenant` and `tier` (where it has them) are configured, as a pair of an API key's where
    /// it has both, and, so that nothing is hidden by mistake, any line this parser does not
    /// read as a sample (the exporter writes none).
    fn shows(&self, line: &str) -> bool {
        let bytes = line.as_bytes();
        // A metric name holds neither `{` nor a space; the first of the two ends it.
        let Some(open) = bytes.iter().position(|&b| b == b'{' || b == b' ') else {
            return true;
        };
        if line.starts_with('#') || bytes[open] != b'{' {
            return true;
        }
        let (mut tenant, mut tier) = (None, None);
        // The labels' end: the pair, where the line has both, must be a key's.
        let pair_configured = |tenant: Option<&str>, tier: Option<&str>| match (tenant, tier) {
            (Some(tenant), Some(tier)) => self
                .tenant_tiers
                .get(tenant)
                .is_some_and(|tiers| tiers.contains(tier)),
            _ => true,
        };
        let mut i = open + 1;
        loop {
            let key_start = i;
            while i < bytes.len() && bytes[i] != b'=' {
                if bytes[i] == b'}' {
                    return pair_configured(tenant, tier);
                }
                i += 1;
            }
            let key = &line[key_start..i];
            i += 1;
            if bytes.get(i) != Some(&b'"') {
                return true;
            }
            i += 1;
            let value_start = i;
            // Escapes are `\\`, `\"` and `\n`: the byte after a backslash never ends the value.
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            if i >= bytes.len() {
                return true;
            }
            // Both ends are ASCII quotes, so the slice is on character boundaries.
            let value = &line[value_start..i];
            let configured = match key {
                LABEL_TENANT => Some(&self.tenants),
                LABEL_TIER => Some(&self.tiers),
                _ => None,
            };
            if configured.is_some_and(|names| !names.contains(value)) {
                return false;
            }
            match key {
                LABEL_TENANT => tenant = Some(value),
                LABEL_TIER => tier = Some(value),
                _ => {}
            }
            i += 1;
            match bytes.get(i) {
                Some(&b',') => {}
                Some(&b'}') => return pair_configured(tenant, tier),
                // Not a sample as the exporter writes one: kept.
                _ => return true,
            }
            i += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::{
        prometheus_builder, LABEL_LIMIT, RATE_LIMITED, REQUEST_SUCCESS, TIME_TO_FIRST_TOKEN,
    };

    /// Renders, through the exporter, `tenants`' success counters (tier `gold`) and `tiers`'
    /// TTFT histograms, one sample each, with help text.
    fn exposition(tenants: &[&str], tiers: &[&str]) -> String {
        let recorder = prometheus_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            crate::metrics::describe_metrics();
            for &t in tenants {
                let labels = vec![
                    metrics::Label::new(LABEL_TIER, "gold"),
                    metrics::Label::new(LABEL_TENANT, t.to_owned()),
                ];
                metrics::counter!(REQUEST_SUCCESS, labels).increment(3);
            }
            for &t in tiers {
                metrics::histogram!(TIME_TO_FIRST_TOKEN, LABEL_TIER => t.to_owned()).record(0.03);
            }
            metrics::counter!(REQUEST_SUCCESS).increment(1);
        });
        handle.render()
    }

    /// The sample lines of `metric` (its name and the rest up to `{` or a space) in `text`.
    fn samples<'a>(text: &'a str, metric: &str) -> Vec<&'a str> {
        text.lines()
            .filter(|l| {
                l.strip_prefix(metric)
                    .is_some_and(|rest| rest.starts_with(['{', ' ']))
            })
            .collect()
    }

    /// Filters the exposition of `tenants` (tier `gold`, configured) against `configured`,
    /// and returns the success counters' sample lines left.
    fn check_tenants(tenants: &[&str], configured: &[&str]) -> Vec<String> {
        let text = exposition(tenants, &[]);
        let labels = ConfiguredLabels::new(configured.iter().map(|&t| (t, "gold")), ["gold"]);
        let kept = labels.retain_configured(&text);
        samples(&kept, REQUEST_SUCCESS)
            .into_iter()
            .map(str::to_owned)
            .collect()
    }

    #[test]
    fn a_name_that_is_a_prefix_of_another_matches_only_itself() {
        let mut kept = check_tenants(&["a", "ab"], &["a"]);
        kept.sort();
        assert_eq!(
            kept,
            [
                format!("{REQUEST_SUCCESS} 1"),
                format!("{REQUEST_SUCCESS}{{tier=\"gold\",tenant=\"a\"}} 3"),
            ]
        );
        let kept = check_tenants(&["a", "ab"], &["ab"]);
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(kept.iter().any(|l| l.contains("tenant=\"ab\"")), "{kept:?}");
        assert!(!kept.iter().any(|l| l.contains("tenant=\"a\"")), "{kept:?}");
    }

    #[test]
    fn names_with_quotes_and_backslashes_match_as_escaped() {
        let quoted = "acme \"east\"";
        let slashed = r"acme\west";
        let both = ["a\"b", r"c\d", "tenant=\"x\",y"];
        // The exporter writes `"` as `\"` and `\` as `\\`.
        let text = exposition(&[quoted, slashed], &[]);
        assert!(
            text.contains(r#"tenant="acme \"east\"""#),
            "the exporter's escaping changed: {text}"
        );
        assert!(
            text.contains(r#"tenant="acme\\west""#),
            "the exporter's escaping changed: {text}"
        );
        let kept = check_tenants(&[quoted, slashed], &[quoted]);
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(kept.iter().any(|l| l.contains("east")), "{kept:?}");
        let kept = check_tenants(&[quoted, slashed], &[slashed]);
        assert_eq!(kept.len(), 2, "{kept:?}");
        assert!(kept.iter().any(|l| l.contains("west")), "{kept:?}");
        // A value that looks like more labels is one value: the one configured is kept, the
        // unconfigured `x` it spells is not made up from it.
        let kept = check_tenants(&both, &["tenant=\"x\",y"]);
        assert_eq!(kept.len(), 2, "{kept:?}");
        let kept = check_tenants(&both, &["x"]);
        assert_eq!(kept, [format!("{REQUEST_SUCCESS} 1")]);
        let kept = check_tenants(&both, &both);
        assert_eq!(kept.len(), 4, "{kept:?}");
    }

    #[test]
    fn a_removed_tiers_histogram_goes_whole_and_help_lines_stay() {
        let text = exposition(&["acme"], &["gold", "silver"]);
        let ttft = |text: &str, tier: &str| {
            text.lines()
                .filter(|l| {
                    l.starts_with(TIME_TO_FIRST_TOKEN) && l.contains(&format!("tier=\"{tier}\""))
                })
                .count()
        };
        // 22 buckets, +Inf, _sum and _count.
        assert_eq!(ttft(&text, "silver"), 25, "{text}");
        let kept = ConfiguredLabels::new([("acme", "gold")], ["gold"]).retain_configured(&text);
        assert_eq!(ttft(&kept, "silver"), 0, "{kept}");
        assert_eq!(ttft(&kept, "gold"), 25, "{kept}");
        // Only silver's lines went.
        assert_eq!(
            text.lines().count() - kept.lines().count(),
            25,
            "{text}\n---\n{kept}"
        );
        // Gold removed too: the metric's help and type stay, with no sample.
        let kept = ConfiguredLabels::new([("acme", "gold")], []).retain_configured(&text);
        assert_eq!(samples(&kept, TIME_TO_FIRST_TOKEN).len(), 0);
        assert!(kept.contains(&format!("# HELP {TIME_TO_FIRST_TOKEN} ")));
        assert!(kept.contains(&format!("# TYPE {TIME_TO_FIRST_TOKEN} histogram")));
        // The success counter's tier is gold, gone too; the unlabelled one stays.
        assert_eq!(
            samples(&kept, REQUEST_SUCCESS),
            [format!("{REQUEST_SUCCESS} 1")]
        );
    }

    #[test]
    fn a_tenant_that_moved_tiers_shows_its_new_tiers_series_only() {
        let recorder = prometheus_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            // Before the reload: `a` and `b` in gold, `c` in both; after it, `a` in silver.
            for (tenant, tier) in [
                ("a", "gold"),
                ("a", "silver"),
                ("b", "gold"),
                ("c", "gold"),
                ("c", "silver"),
            ] {
                metrics::counter!(REQUEST_SUCCESS, LABEL_TIER => tier, LABEL_TENANT => tenant)
                    .increment(2);
                // Labels in the other order, and one more label after them.
                metrics::counter!(
                    RATE_LIMITED,
                    LABEL_TENANT => tenant,
                    LABEL_TIER => tier,
                    LABEL_LIMIT => "requests"
                )
                .increment(1);
            }
            metrics::histogram!(TIME_TO_FIRST_TOKEN, LABEL_TIER => "gold").record(0.03);
        });
        let text = handle.render();
        let labels = ConfiguredLabels::new(
            [
                ("a", "silver"),
                ("b", "gold"),
                ("c", "gold"),
                ("c", "silver"),
            ],
            ["gold", "silver"],
        );
        let kept = labels.retain_configured(&text);
        for metric in [REQUEST_SUCCESS, RATE_LIMITED] {
            let lines = samples(&kept, metric);
            assert_eq!(lines.len(), 4, "{metric}: {lines:?}");
            assert!(
                !lines
                    .iter()
                    .any(|l| l.contains("tenant=\"a\"") && l.contains("tier=\"gold\"")),
                "{lines:?}"
            );
            assert!(
                lines
                    .iter()
                    .any(|l| l.contains("tenant=\"a\"") && l.contains("tier=\"silver\"")),
                "{lines:?}"
            );
        }
        // Gold is still a tier: its histogram, which carries no tenant, stays whole.
        let gold_ttft = kept
            .lines()
            .filter(|l| l.starts_with(TIME_TO_FIRST_TOKEN) && l.contains("tier=\"gold\""))
            .count();
        assert_eq!(gold_ttft, 25, "{kept}");
        // Only the two series of (a, gold) went.
        assert_eq!(text.lines().count() - kept.lines().count(), 2);
    }

    #[test]
    fn an_exposition_of_configured_names_is_left_as_it_is() {
        let text = exposition(&["acme", "a\"b"], &["gold"]);
        let labels = ConfiguredLabels::new([("acme", "gold"), ("a\"b", "gold")], ["gold"]);
        assert_eq!(labels.retain_configured(&text), text);
    }

    #[test]
    fn lines_it_cannot_read_as_samples_are_kept() {
        let labels = ConfiguredLabels::default();
        for line in [
            "# HELP m tenant=\"x\"\n",
            "m{tenant=\"unterminated\n",
            "m{tenant=x} 1\n",
            "m{} 1\n",
            "m 1\n",
            "\n",
        ] {
            assert_eq!(labels.retain_configured(line), line);
        }
        assert_eq!(labels.retain_configured("m{tenant=\"x\"} 1\n"), "");
        // The pair is checked at the labels' end, however they end.
        let labels = ConfiguredLabels::new([("x", "gold")], ["gold", "silver"]);
        for (line, shown) in [
            ("m{tenant=\"x\",tier=\"gold\"} 1\n", true),
            ("m{tenant=\"x\",tier=\"silver\"} 1\n", false),
            ("m{tier=\"silver\",tenant=\"x\",}  1\n", false),
            ("m{tier=\"silver\"} 1\n", true),
            ("m{tenant=\"x\"} 1\n", true),
        ] {
            assert_eq!(labels.retain_configured(line).is_empty(), !shown, "{line}");
        }
        assert_eq!(labels.retain_configured("m{a=\"\\\"\",tier=\"x\"} 1\n"), "");
    }
}
