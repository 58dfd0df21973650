//! The engine (switchyard-actors) records its metrics under the names in its `metric_names`;
//! the API (switchyard-api) describes them for `/metrics`. The two crates do not depend on each
//! other, so this test holds them together: every engine metric gets help text and a type.

use switchyard_actors::metric_names::{COUNTERS, GAUGES, HISTOGRAMS};

/// Renders `/metrics` of the process's recorder (installed once, for every test here).
fn render() -> String {
    type Render = Box<dyn Fn() -> String + Send + Sync>;
    static RENDER: std::sync::OnceLock<Render> = std::sync::OnceLock::new();
    RENDER.get_or_init(|| {
        let handle = switchyard_api::metrics::install_prometheus_recorder().expect("recorder");
        Box::new(move || handle.render())
    })()
}

#[test]
fn every_engine_metric_is_described_by_the_api() {
    render();
    for &g in GAUGES {
        metrics::gauge!(g).set(1.0);
    }
    for &c in COUNTERS {
        metrics::counter!(c).increment(1);
    }
    for &h in HISTOGRAMS {
        metrics::histogram!(h).record(0.25);
    }
    let text = render();
    // Histograms with vLLM's buckets render as histograms, the engine's own timings (no
    // buckets configured) as summaries with exact quantiles.
    let kinds: [(&[&str], &[&str]); 3] = [
        (GAUGES, &["gauge"]),
        (COUNTERS, &["counter"]),
        (HISTOGRAMS, &["histogram", "summary"]),
    ];
    for (names, kinds) in kinds {
        for name in names {
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} has no help text in switchyard-api's describe_metrics"
            );
            assert!(
                kinds
                    .iter()
                    .any(|k| text.contains(&format!("# TYPE {name} {k}"))),
                "{name} is not rendered as one of {kinds:?}"
            );
        }
    }
}

#[test]
fn request_outcome_names_and_label_keys_agree_between_the_crates() {
    use switchyard_actors::metric_names as engine;
    use switchyard_api::metrics as api;
    for (e, a) in [
        (engine::REQUEST_SUCCESS, api::REQUEST_SUCCESS),
        (engine::REQUEST_ABORTED, api::REQUEST_ABORTED),
        (engine::REQUEST_FAILED, api::REQUEST_FAILED),
        (engine::SLO_ATTAINMENT, api::SLO_ATTAINMENT),
        (engine::LABEL_FINISHED_REASON, api::LABEL_FINISHED_REASON),
        (engine::LABEL_REASON, api::LABEL_REASON),
        (engine::LABEL_TIER, api::LABEL_TIER),
        (engine::LABEL_TENANT, api::LABEL_TENANT),
        (engine::PROMPT_TOKENS, api::PROMPT_TOKENS),
        (engine::PROMPT_TOKENS_CACHED, api::PROMPT_TOKENS_CACHED),
        (engine::GENERATION_TOKENS, api::GENERATION_TOKENS),
    ] {
        assert_eq!(e, a);
    }
}

/// The series of the configured tenants exist at zero from the start, as `/metrics` renders
/// them: the token counters per tenant, the outcome counters per tenant and tier (none when
/// its keys' tier is not configured), each value of their own label included.
#[test]
fn configured_tenants_series_are_registered_at_zero() {
    use switchyard_actors::metric_names as engine;
    render();
    engine::register_tenants(&[
        ("zeta-tenant".into(), "gold".into()),
        ("zeta-tenant".into(), String::new()),
        ("omega-tenant".into(), String::new()),
    ]);
    let text = render();
    let mine: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("zeta-tenant") || l.contains("omega-tenant"))
        .collect();
    for expected in [
        "switchyard:prompt_tokens_total{tenant=\"zeta-tenant\"} 0",
        "switchyard:generation_tokens_total{tenant=\"omega-tenant\"} 0",
        "switchyard:prompt_tokens_cached_total{tenant=\"omega-tenant\"} 0",
        "switchyard:request_success_total{tier=\"gold\",tenant=\"zeta-tenant\",finished_reason=\"length\"} 0",
        "switchyard:request_success_total{tenant=\"zeta-tenant\",finished_reason=\"stop\"} 0",
        "switchyard:request_failed_total{tenant=\"omega-tenant\",reason=\"overloaded\"} 0",
        "switchyard:request_aborted_total{tier=\"gold\",tenant=\"zeta-tenant\"} 0",
    ] {
        assert!(mine.contains(&expected), "{expected} missing from {mine:#?}");
    }
    // Tokens per tenant (3 series each: prompt, cached prompt, generation), outcomes per tenant and tier: 2 finish reasons, the
    // failure reasons and one abort series, for the three pairs.
    let outcomes = engine::FINISHED_REASONS.len() + engine::FAILURE_REASONS.len() + 1;
    assert_eq!(mine.len(), 2 * 3 + 3 * outcomes, "{mine:#?}");
}
