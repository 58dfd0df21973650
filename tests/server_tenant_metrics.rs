//! Usage per tenant in `/metrics`, through the real binary on loopback: the `tenant` label of
//! the token and request-outcome counters reconciles with the `usage` of the responses, and
//! only the tenants the configuration's API keys name ever become its values.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{sse_events, Server};
use serde_json::{json, Value};

const ACME: &str = "Bearer acme-tenant-key-0001";
const GLOBEX: &str = "Bearer globex-tenant-key-01";

/// The samples of `/metrics`: (name, labels as `key="value"`, value).
fn samples(s: &Server) -> Vec<(String, BTreeSet<String>, f64)> {
    let r = s
        .request("GET", "/metrics", None, &[])
        .expect("GET /metrics");
    assert_eq!(r.status, 200);
    r.body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (lhs, value) = l.rsplit_once(' ')?;
            let (name, rest) = lhs.split_once('{').unwrap_or((lhs, ""));
            let labels = rest
                .trim_end_matches('}')
                .split(',')
                .filter(|f| !f.is_empty())
                .map(str::to_owned)
                .collect();
            Some((name.to_owned(), labels, value.parse().ok()?))
        })
        .collect()
}

/// The sum of `name`'s samples whose `tenant` label is `tenant` (`None`: no tenant label),
/// over its other labels; `None` when it has no such sample.
fn per_tenant(
    samples: &[(String, BTreeSet<String>, f64)],
    name: &str,
    tenant: Option<&str>,
) -> Option<f64> {
    let want = tenant.map(|t| format!("tenant=\"{t}\""));
    let values: Vec<f64> = samples
        .iter()
        .filter(|(n, labels, _)| {
            n == name
                && match &want {
                    Some(w) => labels.contains(w),
                    None => !labels.iter().any(|l| l.starts_with("tenant=")),
                }
        })
        .map(|(_, _, v)| *v)
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// Every value the `tenant` label takes in `/metrics`.
fn tenant_values(samples: &[(String, BTreeSet<String>, f64)]) -> BTreeSet<String> {
    samples
        .iter()
        .flat_map(|(_, labels, _)| labels.iter())
        .filter_map(|l| l.strip_prefix("tenant=\"")?.strip_suffix('"'))
        .map(str::to_owned)
        .collect()
}

/// What one tenant's responses reported: prompt and completion tokens, and choices.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Usage {
    prompt: u64,
    completion: u64,
    choices: u64,
}

impl Usage {
    fn add(&mut self, usage: &Value, choices: u64) {
        self.prompt += usage["prompt_tokens"].as_u64().expect("prompt_tokens");
        self.completion += usage["completion_tokens"]
            .as_u64()
            .expect("completion_tokens");
        assert_eq!(
            usage["total_tokens"].as_u64(),
            Some(
                usage["prompt_tokens"].as_u64().unwrap()
                    + usage["completion_tokens"].as_u64().unwrap()
            ),
            "{usage}"
        );
        self.choices += choices;
    }
}

/// A Responses API `usage` in chat's names.
fn chat_usage(usage: &Value) -> Value {
    json!({"prompt_tokens": usage["input_tokens"], "completion_tokens": usage["output_tokens"],
           "total_tokens": usage["total_tokens"]})
}

/// POSTs `body` to `path` with `headers`; a 200's JSON.
fn post(s: &Server, path: &str, body: &Value, headers: &[(&str, &str)]) -> Value {
    let r = s
        .request("POST", path, Some(&body.to_string()), headers)
        .expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
    serde_json::from_str(&r.body).expect("json")
}

/// POSTs a streamed `body` with usage asked for; the final chunk's usage and the number of
/// choices that finished.
fn post_stream(s: &Server, path: &str, body: &Value, headers: &[(&str, &str)]) -> (Value, u64) {
    let mut body = body.clone();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = s
        .request("POST", path, Some(&body.to_string()), headers)
        .expect("request");
    assert_eq!(r.status, 200, "{}", r.body);
    let mut events = sse_events(&r.body);
    assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{}", r.body);
    let chunks: Vec<Value> = events
        .iter()
        .map(|e| serde_json::from_str(e).expect("chunk"))
        .collect();
    let finished = chunks
        .iter()
        .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
        .filter(|c| !c["finish_reason"].is_null())
        .count() as u64;
    let usage = chunks.last().expect("a usage chunk")["usage"].clone();
    assert!(usage.is_object(), "{}", r.body);
    (usage, finished)
}

/// Two keys of two tenants (one of tier `gold`, one of no configured tier): every kind of
/// request under each (completions with `n > 1` and several prompts, chat, streamed and not,
/// a stop string), then `/metrics`: each tenant's prompt and generation tokens are the sums
/// of its responses' `usage`, its successes its choices, and nothing counts without a tenant.
/// A wrong key, a tenant header and a `user` field create no series: the `tenant` label's
/// values are the two configured tenants, from the start (at zero) to the end.
#[test]
fn per_tenant_counters_reconcile_with_usage_and_stay_bounded() {
    let keys = format!(
        "  api_keys:\n    - {{ key: {}, tenant: acme, tier: gold }}\n    \
         - {{ key: {}, tenant: globex }}\n",
        &ACME[7..],
        &GLOBEX[7..]
    );
    let s = Server::start_with("tenant-metrics", &keys, "tiers:\n  gold: {}\n");
    let configured: BTreeSet<String> = ["acme".to_owned(), "globex".to_owned()].into();

    let start = samples(&s);
    assert_eq!(tenant_values(&start), configured);
    for tenant in ["acme", "globex"] {
        for name in [
            "switchyard:prompt_tokens_total",
            "switchyard:generation_tokens_total",
            "switchyard:request_success_total",
            "switchyard:request_failed_total",
            "switchyard:request_aborted_total",
        ] {
            assert_eq!(per_tenant(&start, name, Some(tenant)), Some(0.0), "{name}");
        }
    }
    assert!(start
        .iter()
        .any(|(n, l, v)| n == "switchyard:request_success_total"
            && l.contains("tier=\"gold\"")
            && l.contains("tenant=\"acme\"")
            && l.contains("finished_reason=\"length\"")
            && *v == 0.0));

    let mut used: BTreeMap<&str, Usage> = BTreeMap::new();
    let completion = json!({"prompt": "Count: one, two,", "max_tokens": 5, "ignore_eos": true});
    let chat = json!({
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 6,
        "temperature": 0
    });
    let tenants = [("acme", ACME, 1u64), ("globex", GLOBEX, 2u64)];
    for (tenant, key, k) in tenants {
        let headers = [("authorization", key)];
        let u = used.entry(tenant).or_default();
        // n > 1: the prompt counts once, every choice's tokens.
        let mut body = completion.clone();
        body["n"] = json!(k + 1);
        let v = post(&s, "/v1/completions", &body, &headers);
        u.add(&v["usage"], k + 1);
        // Several prompts in one request: each prompt counts.
        let mut body = completion.clone();
        body["prompt"] = json!(["Hello there", "The sky is"]);
        body["max_tokens"] = json!(2 + k);
        let v = post(&s, "/v1/completions", &body, &headers);
        u.add(&v["usage"], 2);
        // A stop string ends the choice early: usage and the counter stop there alike.
        let mut body = completion.clone();
        body["stop"] = json!([" three"]);
        body["max_tokens"] = json!(12);
        let v = post(&s, "/v1/completions", &body, &headers);
        u.add(&v["usage"], 1);
        let v = post(&s, "/v1/chat/completions", &chat, &headers);
        u.add(&v["usage"], 1);
        let (usage, finished) = post_stream(&s, "/v1/chat/completions", &chat, &headers);
        u.add(&usage, finished);
        let (usage, finished) = post_stream(&s, "/v1/completions", &completion, &headers);
        u.add(&usage, finished);
        // A Responses API request is a chat request: it counts as one, streamed or not.
        let response = json!({"input": "Name three colours.", "max_output_tokens": 6,
                              "temperature": 0});
        let v = post(&s, "/v1/responses", &response, &headers);
        u.add(&chat_usage(&v["usage"]), 1);
        let mut streamed = response.clone();
        streamed["stream"] = json!(true);
        let r = s
            .request(
                "POST",
                "/v1/responses",
                Some(&streamed.to_string()),
                &headers,
            )
            .expect("request");
        assert_eq!(r.status, 200, "{}", r.body);
        let last = r
            .body
            .split_terminator("\n\n")
            .filter(|f| !f.starts_with(':'))
            .last()
            .and_then(|f| f.split_once("\ndata: "))
            .map(|(_, data)| data)
            .expect("an event");
        let end: Value = serde_json::from_str(last).expect("json");
        u.add(&chat_usage(&end["response"]["usage"]), 1);
    }
    // Neither a client's tenant header nor its `user` field picks the tenant, and a wrong
    // key is refused before anything counts.
    let v = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Hi", "max_tokens": 3, "ignore_eos": true, "user": "mallory"}),
        &[("authorization", GLOBEX), ("x-tenant", "mallory")],
    );
    used.get_mut("globex").unwrap().add(&v["usage"], 1);
    let r = s
        .request(
            "POST",
            "/v1/completions",
            Some(&completion.to_string()),
            &[("authorization", "Bearer mallory-key-000001")],
        )
        .expect("request");
    assert_eq!(r.status, 401, "{}", r.body);
    let r = s
        .request(
            "POST",
            "/v1/responses",
            Some(&json!({"input": "Hi"}).to_string()),
            &[("authorization", "Bearer mallory-key-000001")],
        )
        .expect("request");
    assert_eq!(r.status, 401, "{}", r.body);

    let end = samples(&s);
    for (tenant, u) in &used {
        let t = Some(*tenant);
        assert!(u.prompt > 0 && u.completion > 0, "{tenant}: {u:?}");
        let counted = Usage {
            prompt: per_tenant(&end, "switchyard:prompt_tokens_total", t).unwrap() as u64,
            completion: per_tenant(&end, "switchyard:generation_tokens_total", t).unwrap() as u64,
            choices: per_tenant(&end, "switchyard:request_success_total", t).unwrap() as u64,
        };
        assert_eq!(counted, *u, "{tenant}");
        for name in [
            "switchyard:request_failed_total",
            "switchyard:request_aborted_total",
        ] {
            assert_eq!(per_tenant(&end, name, t), Some(0.0), "{tenant}: {name}");
        }
    }
    // The two tenants' requests differ, so a swap of their counts would show.
    assert_ne!(used["acme"], used["globex"]);
    // acme's successes carry its key's tier; globex's key has none configured.
    let acme_gold = end
        .iter()
        .filter(|(n, l, _)| {
            n == "switchyard:request_success_total"
                && l.contains("tenant=\"acme\"")
                && l.contains("tier=\"gold\"")
        })
        .map(|(_, _, v)| v)
        .sum::<f64>();
    assert_eq!(acme_gold as u64, used["acme"].choices);
    assert!(!end.iter().any(
        |(_, l, _)| l.contains("tenant=\"globex\"") && l.iter().any(|x| x.starts_with("tier="))
    ));
    // Nothing counted without a tenant: every request here was a configured tenant's.
    for name in [
        "switchyard:prompt_tokens_total",
        "switchyard:generation_tokens_total",
        "switchyard:request_success_total",
    ] {
        assert_eq!(per_tenant(&end, name, None), Some(0.0), "{name}");
    }
    assert_eq!(tenant_values(&end), configured);
    assert!(!end
        .iter()
        .any(|(_, l, _)| l.iter().any(|x| x.contains("mallory"))));
}

/// An open API (no keys): every request is the anonymous tenant's, which the configuration
/// does not name, so the counters carry no tenant label and `/metrics` has no tenant series;
/// the unlabelled counters still reconcile with the responses' usage.
#[test]
fn an_open_api_counts_without_a_tenant_label() {
    let s = Server::start("tenant-open", "");
    let v = post(
        &s,
        "/v1/completions",
        &json!({"prompt": "Count: one, two,", "max_tokens": 4, "ignore_eos": true, "n": 2}),
        &[("x-tenant", "mallory")],
    );
    let mut u = Usage::default();
    u.add(&v["usage"], 2);
    let end = samples(&s);
    assert!(tenant_values(&end).is_empty(), "{:?}", tenant_values(&end));
    let counted = Usage {
        prompt: per_tenant(&end, "switchyard:prompt_tokens_total", None).unwrap() as u64,
        completion: per_tenant(&end, "switchyard:generation_tokens_total", None).unwrap() as u64,
        choices: per_tenant(&end, "switchyard:request_success_total", None).unwrap() as u64,
    };
    assert_eq!(counted, u);
}
