//! The engine (switchyard-actors) records its metrics under the names in its `metric_names`;
//! the API (switchyard-api) describes them for `/metrics`. The two crates do not depend on each
//! other, so this test holds them together: every engine metric gets help text and a type.

use switchyard_actors::metric_names::{COUNTERS, GAUGES, HISTOGRAMS};

#[test]
fn every_engine_metric_is_described_by_the_api() {
    let handle = switchyard_api::metrics::install_prometheus_recorder().expect("recorder");
    for &g in GAUGES {
        metrics::gauge!(g).set(1.0);
    }
    for &c in COUNTERS {
        metrics::counter!(c).increment(1);
    }
    for &h in HISTOGRAMS {
        metrics::histogram!(h).record(0.25);
    }
    let text = handle.render();
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
    ] {
        assert_eq!(e, a);
    }
}
