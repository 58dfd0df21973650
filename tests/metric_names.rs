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
