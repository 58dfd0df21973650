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

/// Every series name `/metrics` exports, by kind: the engine's and the server's own.
fn exported() -> [(Vec<&'static str>, &'static str); 3] {
    use switchyard_actors::metric_names as engine;
    use switchyard_api::metrics as api;
    let all = |a: &[&'static str], b: &[&'static str]| a.iter().chain(b).copied().collect();
    [
        (all(engine::GAUGES, api::SERVER_GAUGES), "gauge"),
        (all(engine::COUNTERS, api::SERVER_COUNTERS), "counter"),
        (all(engine::HISTOGRAMS, api::SERVER_HISTOGRAMS), "histogram"),
    ]
}

/// Whether `series` (as a PromQL expression names it) is one `/metrics` exports: a gauge or
/// counter by its name, a histogram's (or summary's) by its name or its `_bucket`, `_sum`
/// or `_count` series.
fn is_exported(series: &str) -> bool {
    let [(gauges, _), (counters, _), (histograms, _)] = exported();
    if gauges.contains(&series) || counters.contains(&series) || histograms.contains(&series) {
        return true;
    }
    ["_bucket", "_sum", "_count"].iter().any(|suffix| {
        series
            .strip_suffix(suffix)
            .is_some_and(|base| histograms.contains(&base))
    })
}

/// The `switchyard:` series names in a PromQL expression (or any text).
fn series_in(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(at) = rest.find("switchyard:") {
        let tail = &rest[at..];
        let end = tail["switchyard:".len()..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
            .map_or(tail.len(), |i| i + "switchyard:".len());
        out.push(&tail[..end]);
        rest = &tail[end..];
    }
    out
}

fn exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr" | "definition", serde_json::Value::String(e)) => out.push(e.clone()),
                    ("query", serde_json::Value::Object(q)) => {
                        if let Some(serde_json::Value::String(e)) = q.get("query") {
                            out.push(e.clone());
                        }
                    }
                    _ => exprs(v, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

/// Every PromQL expression of the Grafana dashboard (panels and template variables) names
/// only series `/metrics` exports, so the dashboard cannot drift from the code.
#[test]
fn the_grafana_dashboard_names_only_exported_series() {
    // The checker itself: a made-up name and a gauge's `_bucket` are not series.
    assert!(is_exported("switchyard:request_prompt_tokens_bucket"));
    assert!(is_exported("switchyard:cache_config_info"));
    assert!(!is_exported("switchyard:request_prompt_tokens_total"));
    assert!(!is_exported("switchyard:kv_cache_usage_perc_bucket"));
    assert_eq!(
        series_in("rate(switchyard:a_total{x=\"1\"}[1m]) / switchyard:b"),
        ["switchyard:a_total", "switchyard:b"]
    );
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/config/grafana/switchyard.json"
    );
    let text = std::fs::read_to_string(path).expect("the dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut all = Vec::new();
    exprs(&dashboard, &mut all);
    assert!(all.len() > 20, "{} expressions", all.len());
    let mut named = 0;
    for e in &all {
        for series in series_in(e) {
            named += 1;
            assert!(is_exported(series), "{series} (in {e}) is not exported");
            // An info gauge is 1 whatever its labels say: drawn, it is a line at 1 (the
            // cache's size is `cache_config_info`'s num_gpu_blocks label, not its value).
            assert!(
                !series.ends_with("_info"),
                "{series} (in {e}) is always 1: its labels are not a quantity to plot"
            );
        }
    }
    assert!(
        named >= all.len(),
        "{named} series in {} expressions",
        all.len()
    );
}

/// README's Metrics section lists every series `/metrics` exports, each once with its type,
/// and nothing else.
#[test]
fn the_readme_lists_every_exported_series_with_its_type() {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("README.md");
    let section = readme
        .split("\n## Metrics\n")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("a Metrics section in README.md");
    let mut listed: Vec<(String, String)> = Vec::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if let [_, name, kind, ..] = cells.as_slice() {
            if let Some(name) = name.strip_prefix("`switchyard:") {
                let name = format!("switchyard:{}", name.trim_end_matches('`'));
                listed.push((name, kind.to_string()));
            }
        }
    }
    // The type as `/metrics` renders it: the histograms without vLLM's buckets are summaries.
    render();
    let [(gauges, _), (counters, _), (histograms, _)] = exported();
    gauges.iter().for_each(|&g| metrics::gauge!(g).set(1.0));
    counters
        .iter()
        .for_each(|&c| metrics::counter!(c).increment(1));
    histograms
        .iter()
        .for_each(|&h| metrics::histogram!(h).record(0.25));
    let text = render();
    let mut want: Vec<(String, String)> = Vec::new();
    for (names, _) in exported() {
        for n in names {
            let kind = ["gauge", "counter", "histogram", "summary"]
                .into_iter()
                .find(|k| text.contains(&format!("# TYPE {n} {k}\n")))
                .unwrap_or_else(|| panic!("{n} has no type on /metrics"));
            want.push((n.to_owned(), kind.to_owned()));
        }
    }
    let mut sorted = listed.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), listed.len(), "a series listed twice");
    want.sort();
    assert_eq!(
        sorted, want,
        "README's Metrics table against the code's lists"
    );
}
