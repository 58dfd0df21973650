//! End-to-end tests of configuration and operations: what `serve` refuses before it serves,
//! what `config check` checks, SIGHUP reloads and the admin routes' checks. The real binary,
//! SmolLM2 on the CPU, HTTP on loopback; each test starts its own server.

mod common;

use common::{lora_fixture_dir, model_path, serve, switchyard, temp_dir, wait_exit, Server};
use serde_json::{json, Value};
use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::path::Path;
use std::time::{Duration, Instant};

const ADMIN: (&str, &str) = ("Authorization", "Bearer admin-secret-key");

/// A server configuration on the embedded model, as `common::Server::start_full` writes it: on
/// port 0, the free port the server binds itself, which [`Server::wait_ready`] reads back from
/// its log.
fn config_yaml(model_lines: &str, server_lines: &str, extra: &str) -> String {
    format!(
        "model:\n  path: {}\n  threads: 2\n{model_lines}server:\n  host: 127.0.0.1\n  port: 0\n  drain_timeout_s: 20\n{server_lines}{extra}",
        model_path().display()
    )
}

/// Starts `serve` on `config.yaml` in `dir` with extra environment variables, its stderr in
/// `server.log`.
fn spawn(dir: &Path, env: &[(OsString, OsString)]) -> std::process::Child {
    let mut cmd = serve(&dir.join("config.yaml"), dir);
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().expect("start switchyard serve")
}

/// Starts a server (configuration as [`config_yaml`]) with extra environment variables and
/// waits until it is ready.
fn start(name: &str, server_lines: &str, extra: &str, env: &[(OsString, OsString)]) -> Server {
    let dir = temp_dir("config", name);
    std::fs::write(
        dir.join("config.yaml"),
        config_yaml("", server_lines, extra),
    )
    .expect("write config");
    let child = spawn(&dir, env);
    let mut server = Server {
        port: 0,
        child,
        dir: dir.keep(),
    };
    server.wait_ready();
    server
}

/// Runs `serve` on a configuration that must be refused; returns its stderr.
fn serve_refuses(name: &str, model_lines: &str, server_lines: &str, extra: &str) -> String {
    let dir = temp_dir("config", name);
    std::fs::write(
        dir.join("config.yaml"),
        config_yaml(model_lines, server_lines, extra),
    )
    .expect("write config");
    let mut child = spawn(&dir, &[]);
    let status = wait_exit(
        &mut child,
        Duration::from_secs(120),
        "serve did not refuse the configuration",
    );
    let log = std::fs::read_to_string(dir.join("server.log")).unwrap_or_default();
    assert!(
        !status.success(),
        "serve accepted the configuration:\n{log}"
    );
    log
}

fn get(s: &Server, path: &str) -> Value {
    let r = s.request("GET", path, None, &[ADMIN]).expect("GET");
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).expect("json")
}

fn put(s: &Server, path: &str, body: &str) -> (u16, Value) {
    let r = s.request("PUT", path, Some(body), &[ADMIN]).expect("PUT");
    (
        r.status,
        serde_json::from_str(&r.body).unwrap_or(Value::Null),
    )
}

/// A server with the admin key, the FCFS policy and the test adapter as `tuned`.
fn lora_server(name: &str) -> Server {
    start(
        name,
        "  admin_key: admin-secret-key\n",
        &format!(
            "scheduler:\n  policy: {{ name: fcfs }}\nlora:\n  enabled: true\n  adapters:\n    - name: tuned\n      path: {}\n",
            lora_fixture_dir()
        ),
        &[],
    )
}

/// Rewrites the server's configuration file, replacing `from` by `to`.
fn edit_config(s: &Server, from: &str, to: &str) {
    let path = s.dir.join("config.yaml");
    let text = std::fs::read_to_string(&path).expect("config");
    assert!(text.contains(from), "`{from}` not in\n{text}");
    std::fs::write(&path, text.replace(from, to)).expect("write config");
}

#[test]
fn an_api_keys_file_without_keys_is_refused_before_the_model_loads() {
    let dir = temp_dir("config", "emptykeys");
    for (i, body) in ["", "# keys: none yet\n", "[]\n"].iter().enumerate() {
        let keys = dir.join(format!("keys-{i}.yaml"));
        std::fs::write(&keys, body).expect("keys file");
        let log = serve_refuses(
            "emptykeys-serve",
            "",
            &format!("  api_keys_file: {}\n", keys.display()),
            "",
        );
        assert!(
            log.contains("server.api_keys_file") && log.contains("no API keys"),
            "{body:?}: {log}"
        );
        assert!(!log.contains("loading model"), "checked too late: {log}");
    }
    // A keys file that is not UTF-8 is named.
    let keys = dir.join("binary.yaml");
    std::fs::write(
        &keys,
        b"- { key: \xff\xfe\xfd\xfc\xfb\xfa\xf9\xf8, tenant: a }\n",
    )
    .unwrap();
    let log = serve_refuses(
        "binarykeys",
        "",
        &format!("  api_keys_file: {}\n", keys.display()),
        "",
    );
    assert!(
        log.contains("binary.yaml") && log.contains("UTF-8"),
        "{log}"
    );
}

/// A `lora.adapters` entry is refused naming the file and line of its path, as every error
/// about the configuration is: its `adapter_config.json` (a rank above `lora.max_lora_rank`)
/// before the model loads, as `config check` refuses it (it was read only once the model had
/// loaded), and its weights, which only the loaded model can judge, after the load (that
/// error named the adapter alone).
#[test]
fn an_adapter_that_does_not_load_names_its_entry_s_line() {
    let entry = |rank: usize, path: &str| {
        format!(
            "lora:\n  enabled: true\n  max_lora_rank: {rank}\n  adapters:\n    - name: wide\n      path: {path}\n"
        )
    };
    let error_of = |name: &str, extra: &str| {
        // The line after the entry's `- name: wide`, 1-based.
        let line = config_yaml("", "", extra)
            .lines()
            .position(|l| l.trim_start() == "- name: wide")
            .expect("the adapter's entry")
            + 2;
        let log = serve_refuses(name, "", "", extra);
        let error = log
            .lines()
            .find(|l| l.starts_with("error: "))
            .unwrap_or_else(|| panic!("no error line:\n{log}"))
            .to_owned();
        assert!(
            error.contains(&format!("config.yaml:{line}: lora.adapters[0].path: ")),
            "{error}"
        );
        (error, log)
    };
    let (error, log) = error_of("adapter-rank", &entry(2, lora_fixture_dir()));
    assert!(
        error.contains("adapter_config.json: rank 4 is outside 1..=2 (max_lora_rank)")
            && !log.contains("loading model"),
        "not refused before the model loads:\n{log}"
    );
    // Weights the configuration does not announce: a file that is not safetensors.
    let dir = temp_dir("config", "weights-not-safetensors");
    std::fs::copy(
        Path::new(lora_fixture_dir()).join("adapter_config.json"),
        dir.join("adapter_config.json"),
    )
    .expect("copy the adapter's configuration");
    std::fs::write(dir.join("adapter_model.safetensors"), b"not safetensors").expect("write");
    let (error, _) = error_of("adapter-weights", &entry(64, &dir.display().to_string()));
    assert!(error.contains("LoRA adapter `wide`: "), "{error}");
}

#[test]
fn a_variable_that_is_not_utf8_is_ignored_and_an_open_api_is_logged() {
    let s = start(
        "envutf8",
        "",
        "",
        &[(
            "SWITCHYARD_TEST_NOT_UTF8".into(),
            OsString::from_vec(vec![b'a', 0xff, 0xfe]),
        )],
    );
    s.assert_serves();
    let log = s.log();
    assert!(
        log.contains("WARN") && log.contains("no API keys"),
        "the open API was not logged:\n{log}"
    );
    // One that is an override is refused, named.
    let dir = temp_dir("config", "envutf8-check");
    let file = dir.join("c.yaml");
    std::fs::write(&file, "").unwrap();
    let out = switchyard()
        .args(["config", "check"])
        .arg(&file)
        .env("SWITCHYARD__SERVER__HOST", OsString::from_vec(vec![0xff]))
        .output()
        .expect("config check");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("SWITCHYARD__SERVER__HOST") && err.contains("UTF-8"),
        "{err}"
    );
}

#[test]
fn sighup_with_a_bad_policy_changes_nothing() {
    let s = lora_server("badpolicy");
    assert_eq!(s.served_adapters(), ["tuned"]);
    // A bad parameter and a renamed adapter: neither may be applied.
    edit_config(
        &s,
        "name: fcfs }",
        "name: chunked-prefill, params: { token_budget: -1 } }",
    );
    edit_config(&s, "- name: tuned", "- name: renamed");
    s.hang_up();
    s.wait_logged("nothing was reloaded", 1);
    assert_eq!(get(&s, "/admin/policy")["name"], "fcfs");
    assert_eq!(s.served_adapters(), ["tuned"]);
    assert_eq!(
        s.metric("switchyard:policy_swaps_total").unwrap_or(0.0),
        0.0
    );
}

#[test]
fn sighup_keeps_an_unchanged_policy_and_names_fields_that_take_a_restart() {
    let s = lora_server("unchanged");
    edit_config(&s, "threads: 2", "threads: 1");
    s.hang_up();
    s.wait_logged("policy unchanged", 1);
    let log = s.log();
    assert!(
        log.contains("taking a restart, so not applied: model.threads\n"),
        "{log}"
    );
    assert_eq!(
        s.metric("switchyard:policy_swaps_total").unwrap_or(0.0),
        0.0,
        "an unchanged policy was swapped"
    );
    // A changed one is.
    edit_config(&s, "name: fcfs }", "name: priority }");
    s.hang_up();
    s.wait_logged("SIGHUP: policy reloaded", 1);
    assert_eq!(get(&s, "/admin/policy")["name"], "priority");
    assert_eq!(s.metric("switchyard:policy_swaps_total"), Some(1.0));
    // The admin API keeps an unchanged policy too, and says so; a changed one is swapped.
    let (status, v) = put(&s, "/admin/policy", r#"{"name": "priority", "params": {}}"#);
    assert_eq!(
        (status, &v["name"], &v["changed"]),
        (200, &json!("priority"), &json!(false)),
        "{v}"
    );
    assert_eq!(s.metric("switchyard:policy_swaps_total"), Some(1.0));
    let (status, v) = put(&s, "/admin/policy", r#"{"name": "fcfs"}"#);
    assert_eq!(
        (status, &v["name"], &v["changed"]),
        (200, &json!("fcfs"), &json!(true)),
        "{v}"
    );
    assert_eq!(s.metric("switchyard:policy_swaps_total"), Some(2.0));
}

/// A SIGHUP applies a new `scheduler.step_timeout_s` (it is not among the fields that take a
/// restart), said in the log; the stall gauge is exported at 0 from the start.
#[test]
fn sighup_applies_a_new_step_timeout() {
    let s = start(
        "step-timeout",
        "",
        "scheduler:\n  step_timeout_s: 300\n",
        &[],
    );
    assert_eq!(s.metric("switchyard:engine_stalled"), Some(0.0));
    edit_config(&s, "step_timeout_s: 300", "step_timeout_s: 0");
    s.hang_up();
    s.wait_logged("SIGHUP: reload finished", 1);
    let log = s.log();
    assert!(
        log.contains("SIGHUP: scheduler.step_timeout_s: 300 -> 0"),
        "{log}"
    );
    assert!(!log.contains("taking a restart"), "{log}");
    let health = s.request("GET", "/health", None, &[]).expect("health");
    assert_eq!(health.status, 200, "{}", health.body);
}

#[test]
fn sighup_restores_an_adapter_an_admin_deleted_and_hangups_in_a_row_agree() {
    let s = lora_server("reconcile");
    let r = s
        .request("DELETE", "/admin/lora/tuned", None, &[ADMIN])
        .expect("delete");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(s.served_adapters().is_empty());
    s.hang_up();
    s.wait_logged("SIGHUP: reload finished", 1);
    assert_eq!(s.served_adapters(), ["tuned"]);
    // Hang-ups close together: each reload sees what the one before did. (Signals close
    // together may be delivered as one: wait until every reload begun has finished.)
    edit_config(&s, "- name: tuned", "- name: renamed");
    s.hang_up();
    s.hang_up();
    s.hang_up();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = s.log();
        let begun = log.matches("SIGHUP: reloading").count();
        if begun >= 2 && log.matches("SIGHUP: reload finished").count() == begun {
            break;
        }
        assert!(Instant::now() < deadline, "reloads did not finish:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let log = s.log();
    assert_eq!(s.served_adapters(), ["renamed"], "{log}");
    for bad in ["not loaded", "not unloaded", "not replaced"] {
        assert!(!log.contains(bad), "`{bad}` in the log:\n{log}");
    }
}

#[test]
fn sighup_during_the_model_load_does_not_stop_the_server() {
    let dir = temp_dir("config", "early-hup");
    std::fs::write(dir.join("config.yaml"), config_yaml("", "", "")).unwrap();
    let child = spawn(&dir, &[]);
    let mut s = Server {
        port: 0,
        child,
        dir: dir.keep(),
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !s.log().contains("loading model") {
        assert!(Instant::now() < deadline, "no model load:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    s.hang_up();
    s.wait_ready();
    s.assert_serves();
    // The hang-up was kept for the reload once serving.
    s.wait_logged("SIGHUP: policy unchanged", 1);
}

#[test]
fn admin_puts_refuse_unknown_fields_and_name_the_parameter_at_fault() {
    let s = start(
        "adminput",
        "  admin_key: admin-secret-key\n",
        "scheduler:\n  policy: { name: fcfs }\n",
        &[],
    );
    let (status, v) = put(&s, "/admin/policy", r#"{"name":"priority","param":{}}"#);
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("param"),
        "{v}"
    );
    let (status, v) = put(
        &s,
        "/admin/policy",
        r#"{"name":"chunked-prefill","params":{"token_budget":-1}}"#,
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "params.token_budget", "{v}");
    let (status, v) = put(&s, "/admin/policy", r#"{"name":"lottery"}"#);
    assert_eq!((status, v["error"]["param"].clone()), (400, json!("name")));
    assert_eq!(get(&s, "/admin/policy")["name"], "fcfs");
    let (status, v) = put(
        &s,
        "/admin/speculative",
        r#"{"num_speculative_tokens": 2, "max_running": 70000}"#,
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "max_running", "{v}");
    assert_eq!(get(&s, "/admin/speculative"), Value::Null);
}

#[test]
fn serve_refuses_a_max_model_len_beyond_the_context_and_a_wrong_load_format() {
    let log = serve_refuses("maxlen", "  max_model_len: 1000000\n", "", "");
    assert!(
        log.contains("model.max_model_len") && log.contains("1000000") && log.contains("8192"),
        "{log}"
    );
    let log = serve_refuses("format", "  load_format: safetensors\n", "", "");
    assert!(
        log.contains("model.load_format") && log.contains("gguf"),
        "{log}"
    );
    assert!(!log.contains("loading model"), "checked too late: {log}");
}

#[test]
fn max_model_len_is_kept_within_what_the_kv_cache_holds() {
    // 16 MiB hold a few hundred of SmolLM2's tokens, far from its 8192 of context. Configured
    // beyond the cache, max_model_len is refused, with both numbers and what to change.
    let small = "cache:\n  kv_cache_mb: 16\n";
    let log = serve_refuses("kv-fit", "  max_model_len: 8192\n", "", small);
    assert!(
        log.contains("model.max_model_len is 8192")
            && log.contains("the KV cache holds")
            && log.contains("cache.kv_cache_mb"),
        "{log}"
    );
    // Left to the model, it is lowered to what the cache holds, and served as such.
    let s = start("kv-lowered", "", small, &[]);
    let models = get(&s, "/v1/models");
    let len = models["data"][0]["max_model_len"]
        .as_u64()
        .expect("max_model_len");
    assert!((64..8192).contains(&len), "{models}");
    assert!(
        s.log().contains(&format!("serving max_model_len {len}")),
        "{}",
        s.log()
    );
    // A chat request without max_tokens (the room its prompt leaves) is served to its end.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true});
    let events = s.post_stream("/v1/chat/completions", &body);
    assert!(
        events.iter().all(|e| !e.contains("\"error\"")),
        "{events:?}"
    );
    let finished = events.iter().any(|e| {
        serde_json::from_str::<Value>(e).is_ok_and(|v| v["choices"][0]["finish_reason"].is_string())
    });
    assert!(finished, "{events:?}");
    // A max_tokens the cache cannot hold with its prompt is refused before any answer.
    let (status, v) = s.post_json(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": len - 1, "stream": true}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
    assert_eq!(v["error"]["param"], "max_tokens", "{v}");
}

#[test]
fn config_check_refuses_a_misspelt_log_level_and_hides_keys() {
    let dir = temp_dir("config", "check");
    let file = dir.join("c.yaml");
    let check = |file: &Path| {
        switchyard()
            .args(["config", "check"])
            .arg(file)
            .output()
            .expect("config check")
    };
    std::fs::write(&file, "logging:\n  level: warning\n").unwrap();
    let out = check(&file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("c.yaml:2: logging.level") && err.contains("`warning`"),
        "{err}"
    );
    // The keys file is read (and an empty one refused); keys are not printed.
    let keys = dir.join("keys.yaml");
    std::fs::write(&keys, "[]\n").unwrap();
    let yaml = format!(
        "server:\n  admin_key: admin-secret-key\n  api_keys_file: {}\n  api_keys:\n    - {{ key: inline-key-0001, tenant: a }}\n",
        keys.display()
    );
    std::fs::write(&file, &yaml).unwrap();
    let out = check(&file);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("server.api_keys_file"),
        "{err}"
    );
    std::fs::write(&keys, "- { key: file-key-000001, tenant: b }\n").unwrap();
    let out = check(&file);
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for secret in ["admin-secret-key", "inline-key-0001", "file-key-000001"] {
        assert!(!printed.contains(secret), "`{secret}` printed:\n{printed}");
    }
    // Not a regular file: refused, not read.
    let out = check(Path::new("/dev/zero"));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("not a regular file"),
        "{err}"
    );
}

/// `tiers.<name>.priority` is the priority of the tier's requests, and the most urgent they may
/// ask for: a request's own `priority` counts only where it is later. One seat
/// (`max_num_seqs: 1`) held by a long request, no aging: a low tier's request queued first is
/// served after a standard tier's queued later; a low-tier request that asks for -1 (ahead of
/// everyone, were it believed) is held at its tier's 5 and served after the first low one; a
/// standard-tier request that asks for 7 (later than its tier) goes last.
#[test]
fn a_tier_priority_bounds_how_urgent_its_requests_may_ask_to_be() {
    let keys = "  api_keys:\n    - { key: std-tier-key-0001, tenant: a, tier: std }\n    \
                - { key: low-tier-key-0001, tenant: b, tier: low }\n";
    let s = std::sync::Arc::new(Server::start_with(
        "tier-priority",
        keys,
        "scheduler:\n  max_num_seqs: 1\n  policy: { name: priority, params: { preempt: false, aging_interval_ms: 0 } }\n\
         tiers:\n  std: {}\n  low: { priority: 5 }\n",
    ));
    let start = Instant::now();
    let send = |key: &'static str, tokens: u32, priority: Option<i32>| {
        let s = s.clone();
        std::thread::spawn(move || {
            let mut body = json!({"prompt": "Count:", "max_tokens": tokens, "ignore_eos": true});
            if let Some(p) = priority {
                body["priority"] = json!(p);
            }
            let auth = format!("Bearer {key}");
            let r = s
                .request(
                    "POST",
                    "/v1/completions",
                    Some(&body.to_string()),
                    &[("authorization", auth.as_str())],
                )
                .expect("request");
            assert_eq!(r.status, 200, "{}", r.body);
            Instant::now()
        })
    };
    let wait_for = |metric: &str, value: f64| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while s.metric(metric) != Some(value) {
            assert!(Instant::now() < deadline, "{metric} never reached {value}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    let occupant = send("std-tier-key-0001", 96, None);
    wait_for("switchyard:num_requests_running", 1.0);
    // 24 tokens each, one request at a time: finishes ~24 steps apart, far more than a loaded
    // machine's jitter in when the client threads read their answers (with 4 tokens, 2 ms
    // apart, two came out in reverse order once).
    let low = send("low-tier-key-0001", 24, None);
    wait_for("switchyard:num_requests_waiting", 1.0);
    let standard = send("std-tier-key-0001", 24, None);
    wait_for("switchyard:num_requests_waiting", 2.0);
    let jumper = send("low-tier-key-0001", 24, Some(-1));
    wait_for("switchyard:num_requests_waiting", 3.0);
    let later = send("std-tier-key-0001", 24, Some(7));
    wait_for("switchyard:num_requests_waiting", 4.0);
    let occupant = occupant.join().unwrap();
    let (standard, low, jumper, later) = (
        standard.join().unwrap(),
        low.join().unwrap(),
        jumper.join().unwrap(),
        later.join().unwrap(),
    );
    assert!(
        occupant < standard && standard < low && low < jumper && jumper < later,
        "finished at {:?} / {:?} / {:?} / {:?} / {:?}",
        occupant - start,
        standard - start,
        low - start,
        jumper - start,
        later - start
    );
}

/// The request-level metrics carry the request's tier (configured names only; a request without
/// one carries no tier label), and each tier with SLO targets counts its choices that met or
/// missed them. Tier `gold`'s TTFT target is a minute (met) and its TPOT target a microsecond
/// (missed); every tier's series exist from the start, at zero.
#[test]
fn request_metrics_carry_the_tier_and_count_slo_attainment() {
    let keys = "  api_keys:\n    - { key: gold-tier-key-0001, tenant: a, tier: gold }\n    \
                - { key: open-tier-key-0001, tenant: b }\n";
    let s = Server::start_with(
        "tier-metrics",
        keys,
        "tiers:\n  gold: { ttft_ms: 60000, tpot_ms: 0.001 }\n  bronze: { ttft_ms: 5000 }\n",
    );
    let series = |name: &str, labels: &[&str]| -> Option<f64> {
        let r = s.request("GET", "/metrics", None, &[]).ok()?;
        r.body.lines().find_map(|l| {
            let (lhs, value) = l.rsplit_once(' ')?;
            let (metric, rest) = lhs.split_once('{').unwrap_or((lhs, ""));
            let found: Vec<&str> = rest.trim_end_matches('}').split(',').collect();
            let same = metric == name
                && found.iter().filter(|f| !f.is_empty()).count() == labels.len()
                && labels.iter().all(|l| found.contains(l));
            same.then(|| value.parse().ok()).flatten()
        })
    };
    let attainment = "switchyard:slo_attainment_total";
    // At zero before any request: both tiers, only the targets each has.
    for (tier, target) in [("gold", "ttft"), ("gold", "tpot"), ("bronze", "ttft")] {
        for outcome in ["met", "missed"] {
            let labels = [
                format!("tier=\"{tier}\""),
                format!("target=\"{target}\""),
                format!("outcome=\"{outcome}\""),
            ];
            let labels: Vec<&str> = labels.iter().map(String::as_str).collect();
            assert_eq!(series(attainment, &labels), Some(0.0), "{labels:?}");
        }
    }
    let bronze_tpot = ["tier=\"bronze\"", "target=\"tpot\"", "outcome=\"met\""];
    assert_eq!(series(attainment, &bronze_tpot), None);
    let body = json!({"prompt": "Count:", "max_tokens": 4, "ignore_eos": true}).to_string();
    for key in ["gold-tier-key-0001", "open-tier-key-0001"] {
        let auth = format!("Bearer {key}");
        let r = s
            .request(
                "POST",
                "/v1/completions",
                Some(&body),
                &[("authorization", auth.as_str())],
            )
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let gold = ["tier=\"gold\""];
    let ttft_met = ["tier=\"gold\"", "target=\"ttft\"", "outcome=\"met\""];
    let tpot_missed = ["tier=\"gold\"", "target=\"tpot\"", "outcome=\"missed\""];
    assert_eq!(series(attainment, &ttft_met), Some(1.0));
    assert_eq!(series(attainment, &tpot_missed), Some(1.0));
    for h in [
        "switchyard:time_to_first_token_seconds_count",
        "switchyard:time_per_output_token_seconds_count",
        "switchyard:e2e_request_latency_seconds_count",
        "switchyard:request_queue_time_seconds_count",
    ] {
        assert_eq!(series(h, &gold), Some(1.0), "{h}");
        // The open key's request: no tier label at all.
        assert_eq!(series(h, &[]), Some(1.0), "{h}");
    }
    let success = "switchyard:request_success_total";
    // The outcome counters carry the key's tenant too.
    let gold_length = [
        "tier=\"gold\"",
        "tenant=\"a\"",
        "finished_reason=\"length\"",
    ];
    assert_eq!(series(success, &gold_length), Some(1.0));
    let open_length = ["tenant=\"b\"", "finished_reason=\"length\""];
    assert_eq!(series(success, &open_length), Some(1.0));
    assert_eq!(
        series(
            "switchyard:time_to_first_token_seconds_count",
            &["tier=\"bronze\""]
        ),
        Some(0.0)
    );
    // A failure after queueing counts under the tier too: a grammar whose sentences, after a
    // free first letter, are 2^25 bytes long makes llguidance give up while generating, past
    // its item limit, the request's own error (a grammar with no finite sentence at all, or
    // whose forced output from its first token is past the limit, is refused before).
    let failed = "switchyard:request_failed_total";
    let gold_invalid = [
        "tier=\"gold\"",
        "tenant=\"a\"",
        "reason=\"invalid_request\"",
    ];
    assert_eq!(series(failed, &gold_invalid), Some(0.0));
    let gold_a = ["tier=\"gold\"", "tenant=\"a\""];
    assert_eq!(
        series("switchyard:request_aborted_total", &gold_a),
        Some(0.0)
    );
    let mut huge = String::from("start: (\"a\" | \"b\") s24\ns0: \"ab\"\n");
    for i in 1..=24 {
        huge.push_str(&format!("s{i}: s{} s{}\n", i - 1, i - 1));
    }
    let endless = json!({
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": 30,
        "temperature": 0,
        "structured_outputs": {"grammar": huge}
    })
    .to_string();
    let r = s
        .request(
            "POST",
            "/v1/chat/completions",
            Some(&endless),
            &[("authorization", "Bearer gold-tier-key-0001")],
        )
        .expect("request");
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(
        r.body.contains("exceeded the parser's limits"),
        "{}",
        r.body
    );
    assert_eq!(series(failed, &gold_invalid), Some(1.0));
    assert_eq!(series(failed, &["reason=\"structured_output\""]), Some(0.0));
}

/// `tiers.<name>.max_pending_requests` bounds a tier's requests in flight beside the server's
/// bound, so one tenant's flood cannot lock the others out (the operator audit: a batch tenant
/// flooding 30 requests at `max_pending_requests: 8` made a premium request get 503). The
/// flood's refusals are 503 `overloaded` naming the tier's limit, counted in
/// `request_failed_total{tier="batch",tenant="initech",reason="overloaded"}` and logged at WARN a line per
/// second at most, not a line per request. `config check` shows the field and refuses a bound
/// above the server's.
#[test]
fn a_tier_flooding_its_bound_does_not_lock_out_the_other_tiers() {
    let keys = "  max_pending_requests: 8\n  api_keys:\n    \
                - { key: premium-key-0001, tenant: acme, tier: premium }\n    \
                - { key: batch-key-000001, tenant: initech, tier: batch }\n";
    let tiers = "tiers:\n  premium: { ttft_ms: 60000 }\n  \
                 batch: { preemptible: true, max_pending_requests: 4 }\n";
    let s = Server::start_with("tier-admission", keys, tiers);
    // Streams, so an admitted request answers its head at once and stays in flight.
    let long = json!({"prompt": "Count:", "max_tokens": 400, "ignore_eos": true,
                      "stream": true})
    .to_string();
    let batch = [("authorization", "Bearer batch-key-000001")];
    let mut flood: Vec<std::net::TcpStream> = (0..30)
        .map(|_| s.open_with("POST", "/v1/completions", Some(&long), &batch))
        .collect();
    let statuses: Vec<u16> = flood.iter_mut().map(common::read_status).collect();
    let admitted = statuses.iter().filter(|&&c| c == 200).count();
    let refused = statuses.iter().filter(|&&c| c == 503).count();
    assert_eq!((admitted, refused), (4, 26), "{statuses:?}");
    // The batch tier holds 4 of the server's 8 seats: premium is served.
    let short = json!({"prompt": "Hi", "max_tokens": 2}).to_string();
    let r = s
        .request(
            "POST",
            "/v1/completions",
            Some(&short),
            &[("authorization", "Bearer premium-key-0001")],
        )
        .expect("premium request");
    assert_eq!(r.status, 200, "{}", r.body);
    // One more batch request: refused, naming the tier's limit.
    let r = s
        .request("POST", "/v1/completions", Some(&short), &batch)
        .expect("batch request");
    assert_eq!(r.status, 503, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(v["error"]["code"], "overloaded", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("tiers.batch.max_pending_requests") && message.contains("4"),
        "{message}"
    );
    let metrics = s
        .request("GET", "/metrics", None, &[])
        .expect("metrics")
        .body;
    // Counted under the tier and the key's tenant.
    let overloaded = |tier: &str, tenant: &str| {
        let want = [
            format!("tier=\"{tier}\""),
            format!("tenant=\"{tenant}\""),
            "reason=\"overloaded\"".to_owned(),
        ];
        metrics.lines().find_map(|l| {
            let (lhs, value) = l.rsplit_once(' ')?;
            let labels = lhs.strip_prefix("switchyard:request_failed_total{")?;
            let labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
            (labels.len() == want.len() && want.iter().all(|w| labels.contains(&w.as_str())))
                .then(|| value.parse::<f64>().ok())
                .flatten()
        })
    };
    assert_eq!(overloaded("batch", "initech"), Some(27.0), "{metrics}");
    assert_eq!(overloaded("premium", "acme"), Some(0.0), "{metrics}");
    // Rate-limited: the 27 refusals came within a few seconds.
    let lines = s
        .log()
        .lines()
        .filter(|l| l.contains("requests refused as overloaded") && l.contains("batch"))
        .count();
    assert!((1..=10).contains(&lines), "{lines} lines:\n{}", s.log());
    drop(flood);

    // `config check` shows the bound and refuses one above the server's.
    let dir = temp_dir("config", "tier-admission-check");
    let file = dir.join("c.yaml");
    let check = |yaml: &str| {
        std::fs::write(&file, yaml).unwrap();
        switchyard()
            .args(["config", "check"])
            .arg(&file)
            .output()
            .expect("config check")
    };
    let out = check("tiers:\n  batch: { max_pending_requests: 4 }\n");
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(printed.contains("max_pending_requests: 4"), "{printed}");
    let out =
        check("server:\n  max_pending_requests: 8\ntiers:\n  batch: { max_pending_requests: 9 }\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("tiers.batch.max_pending_requests"),
        "{err}"
    );
    let out = check("tiers:\n  batch: { max_pending_requests: 0 }\n");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("max_pending_requests"),
        "{err}"
    );
}

/// `GET /version` answers as vLLM's does, `{"version": ...}` with the server's version, to
/// every caller as `/health` does, while the API asks for a key; it takes no other method.
#[test]
fn version_answers_without_a_key_as_vllm_s_does() {
    let keys = "  api_keys:\n    - { key: good-key-000001, tenant: acme }\n";
    let s = Server::start_with("version", keys, "");
    let r = s
        .request("GET", "/version", None, &[])
        .expect("GET /version");
    assert_eq!(r.status, 200, "{}", r.body);
    let body: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(body, json!({"version": env!("CARGO_PKG_VERSION")}));
    let r = s
        .request("GET", "/v1/models", None, &[])
        .expect("GET /v1/models");
    assert_eq!(r.status, 401, "{}", r.body);
    let r = s
        .request("POST", "/version", Some("{}"), &[])
        .expect("POST /version");
    assert_eq!(r.status, 405, "{}", r.body);
    assert_eq!(r.header("allow"), Some("GET"), "{r:?}");
}

/// A missing or wrong API key or admin key is logged at WARN with the route and the peer
/// address, never the key, and rate-limited: ten wrong keys in a row write a line or two.
#[test]
fn failed_authentication_is_logged_rate_limited_without_the_key() {
    let keys = "  admin_key: admin-secret-key\n  api_keys:\n    \
                - { key: good-key-000001, tenant: acme }\n";
    let s = Server::start_with("auth-log", keys, "");
    let body = json!({"prompt": "Hi", "max_tokens": 1}).to_string();
    for _ in 0..10 {
        let r = s
            .request(
                "POST",
                "/v1/completions",
                Some(&body),
                &[("authorization", "Bearer wrong-guess-123456")],
            )
            .expect("request");
        assert_eq!(r.status, 401, "{}", r.body);
        // RFC 9110, 15.5.2: a 401 names the scheme the key goes in.
        assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{r:?}");
    }
    let r = s
        .request(
            "GET",
            "/admin/policy",
            None,
            &[("authorization", "Bearer not-the-admin-key")],
        )
        .expect("request");
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{r:?}");
    let log = s.log();
    assert!(
        !log.contains("wrong-guess") && !log.contains("not-the-admin"),
        "{log}"
    );
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("authentication failed"))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("route=/v1/completions") && l.contains("peer=127.0.0.1")),
        "{log}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains("route=/admin/policy") && l.contains("key=\"admin key\"")),
        "{log}"
    );
    let api_lines = lines
        .iter()
        .filter(|l| l.contains("/v1/completions"))
        .count();
    assert!((1..=3).contains(&api_lines), "{log}");
}

/// The user audit: `serve --config config/examples/default.yaml --set
/// server.max_pending_requests=1` answered a completion of two prompts with a retryable 503
/// on an idle server, every time, while one prompt with `n: 2` was admitted. The bound counts
/// choices (prompts × n), for prompts and `n` alike: a request with more than the bound ever
/// admits is a 400 naming the bound and its value (no `Retry-After`, not counted as
/// overloaded, a WARN line for the operator), one that fits but not now a 503 with
/// `Retry-After` as before.
#[test]
fn a_request_larger_than_max_pending_requests_is_a_400_not_a_retryable_503() {
    let dir = temp_dir("config", "admission-too-large");
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/examples/default.yaml");
    let child = serve(&example, &dir)
        .args([
            "--set",
            &format!("model.path={}", model_path().display()),
            "--set",
            "model.threads=2",
            "--set",
            "server.port=0",
            "--set",
            "server.max_pending_requests=1",
        ])
        .spawn()
        .expect("start switchyard serve");
    let mut s = Server {
        port: 0,
        child,
        dir: dir.keep(),
    };
    s.wait_ready();
    let post = |body: &Value| {
        s.request("POST", "/v1/completions", Some(&body.to_string()), &[])
            .expect("request")
    };

    // The audit's request, on an idle server: a 400, every time.
    for _ in 0..2 {
        let r = post(&json!({"prompt": ["a", "b"], "max_tokens": 3}));
        assert_eq!(r.status, 400, "{}", r.body);
        assert_eq!(r.header("retry-after"), None);
        let v: Value = serde_json::from_str(&r.body).expect("json");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert_eq!(v["error"]["code"], "too_many_choices", "{v}");
        assert_eq!(v["error"]["param"], "prompt", "{v}");
        assert_eq!(
            v["error"]["message"],
            "this request has 2 choices (2 prompts × n = 1) but server.max_pending_requests is \
             1: each choice (prompts × n) counts as a request in flight, so it can never be \
             admitted; send fewer prompts or a smaller n",
            "{v}"
        );
    }
    // `n` counts as prompts do.
    let r = post(&json!({"prompt": "hi", "n": 2, "max_tokens": 3}));
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("2 choices (n = 2)"), "{}", r.body);
    assert!(r.body.contains(r#""param":"n""#), "{}", r.body);
    // One choice fits.
    let r = post(&json!({"prompt": ["a"], "max_tokens": 3}));
    assert_eq!(r.status, 200, "{}", r.body);

    // Fits, but the one seat is taken by a stream: a 503 to retry.
    let long = json!({"prompt": "Count:", "max_tokens": 400, "ignore_eos": true,
                      "stream": true})
    .to_string();
    let mut stream = s.open("POST", "/v1/completions", Some(&long));
    assert_eq!(common::read_status(&mut stream), 200);
    let r = post(&json!({"prompt": "hi", "max_tokens": 3}));
    assert_eq!(r.status, 503, "{}", r.body);
    assert_eq!(r.header("retry-after"), Some("1"));
    let v: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(v["error"]["code"], "overloaded", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("(server.max_pending_requests is 1); retry shortly"),
        "{v}"
    );
    drop(stream);

    // Only the 503's choice counts as overloaded; the 400s count nowhere.
    let metrics = s
        .request("GET", "/metrics", None, &[])
        .expect("metrics")
        .body;
    let failed = |reason: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| {
                l.starts_with("switchyard:request_failed_total{")
                    && l.contains(&format!("reason=\"{reason}\""))
            })
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    };
    assert_eq!(failed("overloaded"), 1.0, "{metrics}");
    assert_eq!(failed("invalid_request"), 0.0, "{metrics}");
    s.assert_logged(&[
        "WARN",
        "requests refused (400): more choices than server.max_pending_requests ever admits",
    ]);
    s.assert_logged(&["WARN", "requests refused as overloaded"]);

    // The stream's seat comes back once it is aborted: one prompt is served again.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = post(&json!({"prompt": "hi", "max_tokens": 3}));
        if r.status == 200 {
            break;
        }
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(
            Instant::now() < deadline,
            "the stream's seat never came back"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// SIGHUP rotates API keys (the keys file read again: a key removed is refused at once, a key
/// added is served) and applies a tier's new settings: its limits to tenants already counted
/// (a raised requests-per-minute limit frees room at once; a new per-tenant bound counts the
/// request in flight) and its SLO target to the requests that follow, with nothing named as
/// taking a restart; a reload that would open the API changes
/// nothing. The series of a tenant or tier removed leave `/metrics` (those of the tenants and
/// tiers kept stay), and come back, their counts where they were, when it is configured again;
/// a tenant whose key moves to another tier shows under the new tier only.
#[test]
fn sighup_rotates_api_keys_and_applies_a_tiers_new_settings() {
    const ACME: &str = "Bearer gold-tenant-acme-key-0001";
    const BOB: &str = "Bearer gold-tenant-bob-key-00001";
    const CAROL: &str = "Bearer gold-tenant-carol-key-001";
    let keys_dir = temp_dir("config", "rotate-keys-file");
    let keys_file = keys_dir.join("keys.yaml");
    let entry = |bearer: &str, tenant: &str| {
        let key = bearer.strip_prefix("Bearer ").unwrap_or(bearer);
        format!("- {{ key: {key}, tenant: {tenant}, tier: gold }}\n")
    };
    std::fs::write(&keys_file, entry(ACME, "acme") + &entry(BOB, "bob")).expect("keys file");
    let s = start(
        "rotate-keys",
        &format!("  api_keys_file: {}\n", keys_file.display()),
        "tiers:\n  gold: { requests_per_minute: 2, ttft_ms: 0.01 }\n",
        &[],
    );
    // The tier's TTFT target counted per request: `(met, missed)` so far.
    let ttft = || {
        let count = |outcome: &str| {
            let outcome = format!("outcome=\"{outcome}\"");
            s.labelled_metric(
                "switchyard:slo_attainment_total",
                &["tier=\"gold\"", "target=\"ttft\"", &outcome],
            )
        };
        (count("met"), count("missed"))
    };
    let short = json!({"prompt": "Hi", "max_tokens": 2});
    for _ in 0..2 {
        let r = s.complete_as(ACME, &short);
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = s.complete_as(ACME, &short);
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("Limit 2"), "{}", r.body);
    assert_eq!(s.complete_as(BOB, &short).status, 200);
    // No first token comes within 10 µs.
    assert_eq!(ttft(), (0.0, 3.0));
    // The sample lines of `/metrics` that carry `label`.
    let series = |label: &str| {
        let r = s.request("GET", "/metrics", None, &[]).expect("/metrics");
        assert_eq!(r.status, 200, "{}", r.body);
        (r.body.lines())
            .filter(|l| !l.starts_with('#') && l.contains(label))
            .count()
    };
    assert!(series("tenant=\"bob\"") > 0);

    // Bob's key revoked, carol's added; gold allows 4 a minute and one request per tenant.
    std::fs::write(&keys_file, entry(ACME, "acme") + &entry(CAROL, "carol")).expect("keys");
    edit_config(
        &s,
        "gold: { requests_per_minute: 2, ttft_ms: 0.01 }",
        "gold: { requests_per_minute: 4, max_pending_per_tenant: 1, ttft_ms: 600000 }",
    );
    s.hang_up();
    s.wait_logged("SIGHUP: reload finished", 1);
    let log = s.log();
    assert!(!log.contains("taking a restart"), "{log}");
    s.assert_logged(&["SIGHUP: API keys reloaded", "added=1", "removed=1"]);
    s.assert_logged(&["SIGHUP: the tier's rate limits changed", "tier=gold"]);
    s.assert_logged(&["SIGHUP: the tiers changed"]);
    // A changed SLO target is named, as a changed bound is.
    s.assert_logged(&[
        "SIGHUP: the tiers changed",
        "tiers.gold.ttft_ms: 0.01 -> 600000",
        "tiers.gold.requests_per_minute: 2 -> 4",
    ]);
    s.assert_logged(&[
        "SIGHUP: bound on requests in flight changed",
        "tiers.gold.max_pending_per_tenant: none -> 1",
    ]);
    let r = s.complete_as(BOB, &short);
    assert_eq!(r.status, 401, "{}", r.body);
    assert_eq!(
        series("tenant=\"bob\""),
        0,
        "a removed tenant's series leave /metrics"
    );
    assert!(series("tenant=\"acme\"") > 0, "a kept tenant's stay");
    // Acme used 2 of the new 4: two more, then refused at the new limit.
    for _ in 0..2 {
        let r = s.complete_as(ACME, &short);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-ratelimit-limit-requests"), Some("4"));
    }
    let r = s.complete_as(ACME, &short);
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.body.contains("Limit 4"), "{}", r.body);
    // The new TTFT target (10 minutes) is met by the requests since.
    assert_eq!(ttft(), (2.0, 3.0));
    // While one of `key`'s requests streams, another is refused with `status`, naming `bound`.
    let refused_beside_a_stream = |key: &str, status: u16, bound: &str| {
        let reader = s.hold_stream(key, 400);
        let r = s.complete_as(key, &short);
        assert_eq!(r.status, status, "{}", r.body);
        assert!(r.body.contains(bound), "{}", r.body);
        let rest = reader.join().expect("the long stream");
        assert!(rest.contains("data: [DONE]"), "the long stream did not end");
    };
    // Carol's one request in flight is all her tier now allows her.
    refused_beside_a_stream(CAROL, 429, "(tiers.gold.max_pending_per_tenant is 1)");
    // Carol's new tenant label is a metrics series of its own.
    let carol = ["tenant=\"carol\""];
    assert_eq!(
        s.labelled_metric("switchyard:request_success_total", &carol),
        1.0
    );

    // A keys file left empty would open the API: refused, the keys in force kept.
    std::fs::write(&keys_file, "[]\n").expect("keys");
    s.hang_up();
    s.wait_logged("nothing was reloaded", 1);
    let r = s.complete_as(CAROL, &short);
    assert_eq!(r.status, 200, "{}", r.body);
    let r = s.request("POST", "/v1/completions", Some(&short.to_string()), &[]);
    assert_eq!(r.expect("request").status, 401);

    // A tier added: silver, one request in flight and half the KV cache, with dave's key.
    const DAVE: &str = "Bearer silver-tenant-dave-key-001";
    let silver = |bearer: &str, tenant: &str| entry(bearer, tenant).replace("gold", "silver");
    std::fs::write(
        &keys_file,
        entry(ACME, "acme") + &entry(CAROL, "carol") + &silver(DAVE, "dave"),
    )
    .expect("keys");
    edit_config(
        &s,
        "gold: { requests_per_minute: 4, max_pending_per_tenant: 1, ttft_ms: 600000 }",
        "gold: { requests_per_minute: 4, max_pending_per_tenant: 1, ttft_ms: 600000 }\n  \
         silver: { max_pending_requests: 1, max_kv_fraction: 0.5, ttft_ms: 600000 }",
    );
    s.hang_up();
    s.wait_logged("SIGHUP: reload finished", 2);
    assert!(!s.log().contains("taking a restart"), "{}", s.log());
    s.assert_logged(&["SIGHUP: the tiers changed", "added=silver"]);
    let dave = ["tier=\"silver\"", "tenant=\"dave\""];
    assert_eq!(
        s.labelled_metric("switchyard:request_success_total", &dave),
        0.0,
        "the new tier's and tenant's series exist from the reload on"
    );
    let r = s.complete_as(DAVE, &short);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        s.labelled_metric("switchyard:request_success_total", &dave),
        1.0
    );
    let met = ["tier=\"silver\"", "target=\"ttft\"", "outcome=\"met\""];
    assert_eq!(
        s.labelled_metric("switchyard:slo_attainment_total", &met),
        1.0
    );
    // Silver's bound of one request in flight holds.
    refused_beside_a_stream(DAVE, 503, "(tiers.silver.max_pending_requests is 1)");

    // Gold removed with its keys while one of carol's streams runs: acme's key is gone, dave
    // is served, and gold's series (its KV gauge, though carol's request still holds its
    // blocks), acme's and carol's leave /metrics; silver's and dave's stay.
    let success = "switchyard:request_success_total";
    let acme_done = s.labelled_metric(success, &["tenant=\"acme\""]);
    assert_eq!(acme_done, 4.0);
    let gold_blocks = || s.labelled_metric("switchyard:kv_cache_blocks_used", &["tier=\"gold\""]);
    let carol_stream = s.hold_stream(CAROL, 2000);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while gold_blocks() == 0.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "gold's gauge never rose"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::fs::write(&keys_file, silver(DAVE, "dave")).expect("keys");
    edit_config(
        &s,
        "gold: { requests_per_minute: 4, max_pending_per_tenant: 1, ttft_ms: 600000 }\n  ",
        "",
    );
    s.hang_up();
    s.wait_logged("SIGHUP: reload finished", 3);
    assert!(!s.log().contains("taking a restart"), "{}", s.log());
    s.assert_logged(&["SIGHUP: the tiers changed", "removed=gold"]);
    for gone in ["tier=\"gold\"", "tenant=\"acme\"", "tenant=\"carol\""] {
        assert_eq!(
            series(gone),
            0,
            "{gone}: a removed series is still in /metrics"
        );
    }
    assert!(
        !carol_stream.is_finished(),
        "carol's stream ended before the check: make it longer"
    );
    let r = s.complete_as(ACME, &short);
    assert_eq!(r.status, 401, "{}", r.body);
    let r = s.complete_as(DAVE, &short);
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(series("tier=\"silver\"") > 0 && series("tenant=\"dave\"") > 0);

    // Gold and acme's key back: their series are shown again, acme's counts where they were
    // (a counter that goes on), and gold's KV gauge (at what its requests hold: carol's, if
    // still running, count again); carol's stay out of sight. Dave's key moves to gold: his
    // silver series leave (silver's own stay), his gold ones start at zero.
    let dave_in = |tier: &str| {
        let (tier, tenant) = (format!("tier=\"{tier}\""), "tenant=\"dave\"");
        let r = s.request("GET", "/metrics", None, &[]).expect("/metrics");
        (r.body.lines())
            .filter(|l| !l.starts_with('#') && l.contains(&tier) && l.contains(tenant))
            .count()
    };
    assert!(dave_in("silver") > 0);
    std::fs::write(&keys_file, entry(ACME, "acme") + &entry(DAVE, "dave")).expect("keys");
    edit_config(&s, "tiers:\n", "tiers:\n  gold: { ttft_ms: 600000 }\n");
    s.hang_up();
    s.wait_logged("SIGHUP: reload finished", 4);
    s.assert_logged(&["SIGHUP: the tiers changed", "added=gold"]);
    assert_eq!(s.labelled_metric(success, &["tenant=\"acme\""]), acme_done);
    assert!(series("tier=\"gold\"") > 0);
    assert_eq!(series("switchyard:kv_cache_blocks_used{tier=\"gold\"}"), 1);
    assert_eq!(
        series("tenant=\"carol\""),
        0,
        "carol is not configured again"
    );
    assert_eq!(
        dave_in("silver"),
        0,
        "dave's former tier's series are hidden"
    );
    assert!(series("tier=\"silver\"") > 0, "silver is still a tier");
    let dave_gold = ["tier=\"gold\"", "tenant=\"dave\""];
    assert!(dave_in("gold") > 0);
    assert_eq!(s.labelled_metric(success, &dave_gold), 0.0);
    let r = s.complete_as(DAVE, &short);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(s.labelled_metric(success, &dave_gold), 1.0);
    let r = s.complete_as(ACME, &short);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        s.labelled_metric(success, &["tenant=\"acme\""]),
        acme_done + 1.0
    );
}

/// With `server.cors` naming only its origins, a browser's preflight from one of them for the
/// headers the OpenAI SDKs send (the Node SDK 7's `x-stainless-*` set, run in a browser with
/// `dangerouslyAllowBrowser`) is granted: the default `allowed_headers` is any, as vLLM's. A
/// fixed list refused it (400 `cors_headers_not_allowed`), and the SDK could not call at all.
#[test]
fn a_browser_preflight_with_the_sdks_headers_is_granted_by_default() {
    const ORIGIN: &str = "https://app.example.com";
    const HEADERS: &str = "authorization,content-type,x-stainless-arch,x-stainless-lang,\
        x-stainless-os,x-stainless-package-version,x-stainless-retry-count,x-stainless-runtime,\
        x-stainless-runtime-version,x-stainless-timeout";
    let s = start(
        "cors-sdk-headers",
        &format!("  cors: {{ allowed_origins: ['{ORIGIN}'] }}\n"),
        "",
        &[],
    );
    let r = s
        .request(
            "OPTIONS",
            "/v1/chat/completions",
            None,
            &[
                ("Origin", ORIGIN),
                ("Access-Control-Request-Method", "POST"),
                ("Access-Control-Request-Headers", HEADERS),
            ],
        )
        .expect("preflight");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some(ORIGIN));
    let granted = r
        .header("access-control-allow-headers")
        .unwrap_or_default()
        .to_ascii_lowercase();
    for name in HEADERS.split(',') {
        assert!(
            granted.split(',').any(|g| g.trim() == name),
            "{name} not granted: {granted}"
        );
    }
    // The call that follows is answered, readable by the page.
    let r = s
        .request(
            "POST",
            "/v1/chat/completions",
            Some(r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":1}"#),
            &[
                ("Origin", ORIGIN),
                ("Content-Type", "application/json"),
                ("x-stainless-os", "Linux"),
                ("x-stainless-retry-count", "0"),
            ],
        )
        .expect("POST");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("access-control-allow-origin"), Some(ORIGIN));
}
