//! Background responses created with `stream: true` and their resumable streams
//! (`GET /v1/responses/{id}?stream=true&starting_after=N`), in process with the echo engine.

mod common;

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::test;
use common::*;
use serde_json::{json, Value};
use switchyard_api::engine::{Delta, EngineEvent, Finish, FinishReason};
use switchyard_api::response_store::ResponseStore;
use switchyard_api::{ApiConfig, ApiKeyEntry, ApiState, StoreLimits};

const OTHER_KEY: &str = "sk-test-other";

fn config() -> ApiConfig {
    let mut config = api_config();
    config.api_keys.push(ApiKeyEntry {
        key: OTHER_KEY.into(),
        tenant: "other".into(),
        tier: "premium".into(),
        adapters: switchyard_api::AdapterAccess::all(),
    });
    config
}

fn get(path: &str) -> test::TestRequest {
    get_as(path, KEY)
}

fn get_as(path: &str, key: &str) -> test::TestRequest {
    test::TestRequest::get()
        .uri(path)
        .insert_header(("authorization", format!("Bearer {key}")))
}

/// One parsed event: its `event:` name checked against its `type`.
fn parse_events(body: &str) -> Vec<Value> {
    assert!(body.is_empty() || body.ends_with("\n\n"), "{body:?}");
    body.split_terminator("\n\n")
        .filter(|frame| !frame.starts_with(':'))
        .map(|frame| {
            let (name, data) = frame
                .strip_prefix("event: ")
                .and_then(|f| f.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("bad frame {frame:?}"));
            let v: Value = serde_json::from_str(data).expect("event json");
            assert_eq!(v["type"], name, "{frame}");
            v
        })
        .collect()
}

fn sequence_numbers(events: &[Value]) -> Vec<u64> {
    events
        .iter()
        .map(|e| e["sequence_number"].as_u64().expect("sequence_number"))
        .collect()
}

/// The whole event stream of a 200 SSE answer, as text.
async fn read_stream<S, B>(service: &S, request: test::TestRequest) -> String
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let reply = send(service, request).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(
        reply
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok()),
        Some("text/event-stream")
    );
    reply.text().to_owned()
}

/// The next chunk of a streamed body (keep-alive comments skipped), waiting at most 10 s.
async fn next_events<B: MessageBody + Unpin>(body: &mut B) -> Option<Vec<Value>> {
    loop {
        let chunk = tokio::time::timeout(
            Duration::from_secs(10),
            futures_util::future::poll_fn(|cx| Pin::new(&mut *body).poll_next(cx)),
        )
        .await
        .expect("a chunk within 10 s")?
        .map_err(Into::<Box<dyn std::error::Error>>::into)
        .expect("chunk");
        let text = std::str::from_utf8(&chunk).expect("utf-8").to_owned();
        let events = parse_events(&text);
        if !events.is_empty() {
            return Some(events);
        }
    }
}

fn background_stream(input: &str, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "input": input, "background": true, "stream": true});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    body
}

/// A delta of one character; `finish` ends the output.
fn delta(text: &str, finish: Option<u32>) -> EngineEvent {
    EngineEvent::Delta(Delta {
        index: 0,
        text: text.into(),
        token_ids: text.bytes().map(u32::from).collect(),
        logprobs: Vec::new(),
        finish: finish.map(|n| Finish {
            reason: FinishReason::Stop,
            completion_tokens: n,
        }),
        cached_prompt_tokens: 0,
        embedding: None,
    })
}

/// Waits until the engine holds `n` requests (their channels).
async fn held(engine: &EchoEngine, n: usize) -> tokio::sync::mpsc::Sender<EngineEvent> {
    for _ in 0..1000 {
        if let Some(tx) = engine.held.lock().unwrap().get(n - 1) {
            return tx.clone();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("the engine never got request {n}");
}

/// The stored response, polled until it is no longer `queued` or `in_progress`.
async fn ended<S, B>(service: &S, id: &str) -> Value
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    for _ in 0..1000 {
        let v = send(service, get(&format!("/v1/responses/{id}")))
            .await
            .json();
        if !matches!(v["status"].as_str(), Some("queued" | "in_progress")) {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("{id} never ended");
}

/// A background stream's events: numbered from 0 without a gap, opened `queued` and ended
/// `completed` with the stored object; its retrieval replays them byte for byte, from any
/// `starting_after` on exactly the events after it, and nothing past the last.
#[actix_web::test]
async fn a_background_stream_replays_exactly_from_any_point() {
    let (_, app) = app(EchoEngine::new(), config()).await;
    let first = read_stream(
        &app,
        post("/v1/responses", &background_stream("Hi!", json!({}))),
    )
    .await;
    let events = parse_events(&first);
    let n = events.len() as u64;
    assert_eq!(sequence_numbers(&events), (0..n).collect::<Vec<_>>());
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds[..4],
        [
            "response.created",
            "response.queued",
            "response.in_progress",
            "response.output_item.added"
        ]
    );
    // The echo engine stops at the length limit.
    assert_eq!(kinds.last(), Some(&"response.incomplete"));
    assert_eq!(events[0]["response"]["status"], "queued");
    assert_eq!(events[0]["response"]["background"], true);
    assert_eq!(events[2]["response"]["status"], "in_progress");
    let id = events[0]["response"]["id"].as_str().unwrap().to_owned();
    let completed = &events[events.len() - 1]["response"];
    let text: String = events
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(completed["output"][0]["content"][0]["text"], text);
    let stored = ended(&app, &id).await;
    assert_eq!(&stored, completed);

    let path = format!("/v1/responses/{id}?stream=true");
    assert_eq!(read_stream(&app, get(&path)).await, first, "a full replay");
    for after in [0, 1, 2, n / 2, n - 2, n - 1, n, 1000, u64::MAX] {
        let replay = read_stream(&app, get(&format!("{path}&starting_after={after}"))).await;
        let expected: Vec<Value> = events
            .iter()
            .skip(after.saturating_add(1) as usize)
            .cloned()
            .collect();
        assert_eq!(parse_events(&replay), expected, "starting_after={after}");
    }
}

/// The client hanging up does not stop a background stream: the response runs to its end,
/// and a resume from the last event received gets the rest, which joined with what came
/// before is what one whole stream gives. A reader that resumes while it runs follows the
/// live events as they are written.
#[actix_web::test]
async fn a_dropped_stream_runs_on_and_resumes_live() {
    let engine = EchoEngine::new();
    engine.hang.store(true, Ordering::SeqCst);
    let (_, app) = app(Arc::clone(&engine), config()).await;
    let response = app
        .call(post("/v1/responses", &background_stream("Hi", json!({}))).to_request())
        .await
        .expect("answer");
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    let mut received = next_events(&mut body).await.expect("the opening");
    assert_eq!(received[0]["type"], "response.created");
    let id = received[0]["response"]["id"].as_str().unwrap().to_owned();
    let tx = held(&engine, 1).await;
    tx.send(delta("a", None)).await.unwrap();
    while received.last().unwrap()["type"] != "response.output_text.delta" {
        received.extend(next_events(&mut body).await.expect("more"));
    }
    // The client hangs up.
    drop(body);
    tx.send(delta("b", None)).await.unwrap();
    let last = received.last().unwrap()["sequence_number"]
        .as_u64()
        .unwrap();

    // A resume follows: it gets what was written meanwhile, then the live events.
    let resumed = app
        .call(
            get(&format!(
                "/v1/responses/{id}?stream=true&starting_after={last}"
            ))
            .to_request(),
        )
        .await
        .expect("resume");
    assert_eq!(resumed.status(), 200);
    let mut body = resumed.into_body();
    let mut rest = next_events(&mut body).await.expect("the missed delta");
    assert_eq!(rest[0]["sequence_number"].as_u64(), Some(last + 1));
    assert_eq!(rest[0]["delta"], "b");
    assert_eq!(
        send(&app, get(&format!("/v1/responses/{id}"))).await.json()["status"],
        "queued",
        "still running"
    );
    tx.send(delta("c", Some(3))).await.unwrap();
    drop(tx);
    while let Some(events) = next_events(&mut body).await {
        rest.extend(events);
    }
    assert_eq!(rest.last().unwrap()["type"], "response.completed");
    received.extend(rest);
    let n = received.len() as u64;
    assert_eq!(sequence_numbers(&received), (0..n).collect::<Vec<_>>());
    let whole = read_stream(&app, get(&format!("/v1/responses/{id}?stream=true"))).await;
    assert_eq!(parse_events(&whole), received);
    let stored = ended(&app, &id).await;
    assert_eq!(stored["status"], "completed");
    assert_eq!(stored["output"][0]["content"][0]["text"], "abc");
}

/// A cancel while someone streams ends the stream with an `error` event numbered next
/// (`response_cancelled`), which a later replay ends with too; the stored response is
/// `cancelled`. A DELETE of a running one ends its streams with `response_deleted`, numbered
/// next too, and it stays deleted.
#[actix_web::test]
async fn a_cancel_ends_the_streams_that_follow() {
    let engine = EchoEngine::new();
    engine.hang.store(true, Ordering::SeqCst);
    let (_, app) = app(Arc::clone(&engine), config()).await;
    for (n, how) in [(1, "cancel"), (2, "delete")] {
        let response = app
            .call(post("/v1/responses", &background_stream("Hi", json!({}))).to_request())
            .await
            .expect("answer");
        let mut body = response.into_body();
        let mut events = next_events(&mut body).await.expect("the opening");
        let id = events[0]["response"]["id"].as_str().unwrap().to_owned();
        let tx = held(&engine, n).await;
        tx.send(delta("a", None)).await.unwrap();
        while events.last().unwrap()["type"] != "response.output_text.delta" {
            events.extend(next_events(&mut body).await.expect("more"));
        }
        let reply = if how == "cancel" {
            send(
                &app,
                post(&format!("/v1/responses/{id}/cancel"), &json!({})),
            )
            .await
        } else {
            send(
                &app,
                test::TestRequest::delete()
                    .uri(&format!("/v1/responses/{id}"))
                    .insert_header(("authorization", format!("Bearer {KEY}"))),
            )
            .await
        };
        assert_eq!(reply.status, 200, "{how}: {}", reply.text());
        while let Some(more) = next_events(&mut body).await {
            events.extend(more);
        }
        let last = events.last().unwrap();
        let code = if how == "cancel" {
            "response_cancelled"
        } else {
            "response_deleted"
        };
        assert_eq!(
            (&last["type"], &last["code"]),
            (&json!("error"), &json!(code)),
            "{how}: {last}"
        );
        let n_events = events.len() as u64;
        assert_eq!(sequence_numbers(&events), (0..n_events).collect::<Vec<_>>());
        // The engine's late output goes nowhere.
        let _ = tx.send(delta("b", Some(2))).await;
        let path = format!("/v1/responses/{id}?stream=true");
        if how == "cancel" {
            assert_eq!(reply.json()["status"], "cancelled");
            assert_eq!(ended(&app, &id).await["status"], "cancelled");
            assert_eq!(parse_events(&read_stream(&app, get(&path)).await), events);
        } else {
            send(&app, get(&path))
                .await
                .assert_error(404, "invalid_request_error", None);
        }
    }
}

/// What cannot be streamed is a 400 naming the parameter: a foreground response (stored, but
/// not background), a background one created without `stream`, a resume before the events
/// kept; `starting_after` must be a non-negative integer and comes with `stream=true`;
/// another tenant's response, or an unknown one, is a 404 as for GET.
#[actix_web::test]
async fn refused_forms_are_400s_and_other_tenants_404s() {
    let (_, app) = app(EchoEngine::new(), config()).await;
    let foreground = send(
        &app,
        post("/v1/responses", &json!({"model": MODEL, "input": "Hi"})),
    )
    .await
    .json();
    let fg = foreground["id"].as_str().unwrap();
    send(&app, get(&format!("/v1/responses/{fg}?stream=true")))
        .await
        .assert_error(400, "invalid_request_error", Some("stream"));
    let queued = send(
        &app,
        post(
            "/v1/responses",
            &json!({"model": MODEL, "input": "Hi", "background": true}),
        ),
    )
    .await
    .json();
    let bg = queued["id"].as_str().unwrap();
    ended(&app, bg).await;
    send(&app, get(&format!("/v1/responses/{bg}?stream=true")))
        .await
        .assert_error(400, "invalid_request_error", Some("stream"));

    let first = read_stream(
        &app,
        post("/v1/responses", &background_stream("Hi", json!({}))),
    )
    .await;
    let id = parse_events(&first)[0]["response"]["id"]
        .as_str()
        .unwrap()
        .to_owned();
    for (query, param) in [
        ("starting_after=2", "starting_after"),
        ("stream=false&starting_after=2", "starting_after"),
        ("stream=true&starting_after=-1", "starting_after"),
        ("stream=true&starting_after=x", "starting_after"),
        ("stream=yes", "stream"),
        (
            "stream=true&include_obfuscation=false",
            "include_obfuscation",
        ),
    ] {
        send(&app, get(&format!("/v1/responses/{id}?{query}")))
            .await
            .assert_error(400, "invalid_request_error", Some(param));
    }
    let path = format!("/v1/responses/{id}?stream=true");
    send(&app, get_as(&path, OTHER_KEY))
        .await
        .assert_error(404, "invalid_request_error", None);
    send(&app, get("/v1/responses/resp_unknown?stream=true"))
        .await
        .assert_error(404, "invalid_request_error", None);
    assert_eq!(read_stream(&app, get(&path)).await, first);
}

/// One response keeps its last eighth of the store's bytes of events: a reader that falls
/// behind the oldest kept one is cut off with an `error` event numbered as the event it
/// missed; a whole replay, or a resume before the oldest kept event, is a 400 saying where the
/// kept ones start, and a resume from there gets them, ending as the response ended.
#[actix_web::test]
async fn a_reader_behind_the_events_kept_is_cut_off_and_told_where_to_resume() {
    let mut engine = EchoEngine::new();
    Arc::get_mut(&mut engine).expect("unshared").max_model_len = 600;
    let store = Arc::new(ResponseStore::new(StoreLimits {
        max_bytes: 128 << 10,
        ..StoreLimits::default()
    }));
    let state = ApiState::new(engine, config(), Some(metrics_handle()))
        .with_response_store(Arc::clone(&store));
    let app = test::init_service(
        actix_web::App::new().configure(move |cfg| switchyard_api::configure(cfg, state)),
    )
    .await;
    let max_event_bytes = store.limits().max_event_bytes();
    assert_eq!(max_event_bytes, 16 << 10);
    let input = "A long enough prompt to echo back many times over. ".repeat(4);
    // The echo engine writes the whole answer at once, far faster than this reader reads.
    let first = read_stream(
        &app,
        post(
            "/v1/responses",
            &background_stream(&input, json!({"max_output_tokens": 300})),
        )
        .insert_header(("x-request-id", "long-one")),
    )
    .await;
    let events = parse_events(&first);
    let cut = events.last().expect("an event");
    assert_eq!(cut["code"], "stream_cut_off", "{first}");
    let n = events.len() as u64;
    assert_eq!(sequence_numbers(&events), (0..n).collect::<Vec<_>>());
    let id = "resp_long-one";
    let stored = ended(&app, id).await;
    assert_eq!(stored["status"], "incomplete");

    let path = format!("/v1/responses/{id}?stream=true");
    let refused = send(&app, get(&path)).await;
    let body = refused.assert_error(400, "invalid_request_error", Some("starting_after"));
    let message = body["error"]["message"].as_str().unwrap();
    // The message names the oldest kept event; a resume right before it is served.
    let oldest: u64 = message
        .split("before sequence number ")
        .nth(1)
        .and_then(|m| m.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{message}"));
    assert!(oldest >= n, "{oldest} {n}");
    send(&app, get(&format!("{path}&starting_after={}", oldest - 2)))
        .await
        .assert_error(400, "invalid_request_error", Some("starting_after"));
    let kept = read_stream(&app, get(&format!("{path}&starting_after={}", oldest - 1))).await;
    assert!(kept.len() <= max_event_bytes, "{} bytes kept", kept.len());
    let kept = parse_events(&kept);
    let last = oldest + kept.len() as u64;
    assert_eq!(sequence_numbers(&kept), (oldest..last).collect::<Vec<_>>());
    assert_eq!(kept.last().unwrap()["response"], stored);
    // The deltas kept are the end of the stored text.
    let tail: String = kept
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    let text = stored["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(!tail.is_empty() && text.ends_with(&tail), "{tail:?}");
    assert!(store.bytes() <= 128 << 10);
    assert_eq!(
        store.live_event_bytes(),
        0,
        "the ended log moved into its entry"
    );
}

/// `background` with `stream` still needs the store: with storing off it is refused at once.
#[actix_web::test]
async fn a_background_stream_needs_the_store() {
    let mut config = config();
    config.responses_store.max_responses = 0;
    let (_, app) = app(EchoEngine::new(), config).await;
    send(
        &app,
        post("/v1/responses", &background_stream("Hi", json!({}))),
    )
    .await
    .assert_error(400, "invalid_request_error", Some("background"));
}

/// A background stream whose `queued` response is too large for the store (its conversation
/// alone passes the byte bound) still streams its events to its end: the refusal to keep it
/// does not end its running events. It is not kept (a GET is a 404), and its events stop
/// counting once it has ended.
#[actix_web::test]
async fn a_background_stream_too_large_to_keep_still_streams() {
    let mut engine = EchoEngine::new();
    Arc::get_mut(&mut engine).expect("unshared").max_model_len = 1 << 20;
    let store = Arc::new(ResponseStore::new(StoreLimits {
        max_bytes: 64 << 10,
        ..StoreLimits::default()
    }));
    let mut config = config();
    config.max_body_bytes = 1 << 20;
    let state = ApiState::new(engine, config, Some(metrics_handle()))
        .with_response_store(Arc::clone(&store));
    let app = test::init_service(
        actix_web::App::new().configure(move |cfg| switchyard_api::configure(cfg, state)),
    )
    .await;
    let input = "Too long to keep. ".repeat(5000);
    assert!(input.len() > 64 << 10);
    let body = read_stream(
        &app,
        post(
            "/v1/responses",
            &background_stream(&input, json!({"max_output_tokens": 4})),
        )
        .insert_header(("x-request-id", "too-large")),
    )
    .await;
    let events = parse_events(&body);
    let types: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(
        types.first().copied(),
        Some("response.created"),
        "{types:?}"
    );
    assert!(
        matches!(
            types.last().copied(),
            Some("response.completed" | "response.incomplete")
        ),
        "{types:?}"
    );
    let n = events.len() as u64;
    assert_eq!(sequence_numbers(&events), (0..n).collect::<Vec<_>>());
    send(&app, get("/v1/responses/resp_too-large"))
        .await
        .assert_error(404, "invalid_request_error", None);
    for _ in 0..1000 {
        if store.live_event_bytes() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!(
        "the ended events still count: {} bytes",
        store.live_event_bytes()
    );
}
