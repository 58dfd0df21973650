//! End-to-end tests of the Responses API's journaled store (`server.responses.path`) and of
//! `truncation: "auto"`: the real binary, SmolLM2 on the CPU, HTTP on loopback.
//!
//! A stored response, its conversation, its tenant and a delete survive a SIGTERM and a new
//! server on the same directory; a second server on a directory in use is refused.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::{model_path, temp_dir, wait_exit, Server};
use serde_json::{json, Value};

const ALICE: (&str, &str) = ("Authorization", "Bearer alice-key-00000001");
const BOB: (&str, &str) = ("Authorization", "Bearer bob-key-000000001");

/// `server:` lines: two tenants' keys and the store's directory.
fn server_lines(dir: &std::path::Path) -> String {
    format!(
        "  api_keys:\n    - {{ key: alice-key-00000001, tenant: alice }}\n    \
         - {{ key: bob-key-000000001, tenant: bob }}\n  responses:\n    path: {}\n",
        dir.display()
    )
}

fn start(name: &str, dir: &std::path::Path) -> Server {
    Server::start_with(name, &server_lines(dir), "")
}

fn create(s: &Server, body: &Value, who: (&str, &str)) -> Value {
    let (status, v) = s.call_json("POST", "/v1/responses", Some(body), &[who]);
    assert_eq!(status, 200, "{v}");
    v
}

fn tokens(v: &Value, which: &str) -> u64 {
    v["usage"][which].as_u64().expect("usage")
}

/// Sends SIGTERM and waits for a clean exit.
fn stop(mut s: Server) {
    let status = Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let exit = wait_exit(&mut s.child, Duration::from_secs(60), "SIGTERM");
    assert!(exit.success(), "{exit}; log:\n{}", s.log());
}

#[test]
fn stored_responses_survive_a_restart_and_a_second_server_is_refused() {
    let scratch = temp_dir("responses-store", "restart");
    let store = scratch.join("store");
    let s = start("store-a", &store);
    let first = create(
        &s,
        &json!({"input": "My name is Ada. Say hello to me.", "max_output_tokens": 8,
                "temperature": 0}),
        ALICE,
    );
    let id1 = first["id"].as_str().expect("id").to_owned();
    let second = create(
        &s,
        &json!({"input": "What is my name?", "previous_response_id": id1,
                "max_output_tokens": 8, "temperature": 0}),
        ALICE,
    );
    let id2 = second["id"].as_str().expect("id").to_owned();
    let deleted = create(
        &s,
        &json!({"input": "Forget me.", "max_output_tokens": 2}),
        ALICE,
    );
    let deleted_path = format!("/v1/responses/{}", deleted["id"].as_str().expect("id"));
    assert_eq!(s.call_json("DELETE", &deleted_path, None, &[ALICE]).0, 200);
    let bobs = create(&s, &json!({"input": "Hi.", "max_output_tokens": 2}), BOB);
    let (_, items_before) = s.call_json(
        "GET",
        &format!("/v1/responses/{id2}/input_items"),
        None,
        &[ALICE],
    );

    // A second server on the directory in use is refused before it loads its model.
    let dir = temp_dir("responses-store", "second");
    let config = dir.join("config.yaml");
    std::fs::write(
        &config,
        format!(
            "model:\n  path: {}\nserver:\n  host: 127.0.0.1\n  port: 0\n{}",
            model_path().display(),
            server_lines(&store)
        ),
    )
    .expect("config");
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["serve", "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let out = out.wait_with_output().expect("second server");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the second server started:\n{err}");
    assert!(
        err.contains("server.responses.path")
            && err.contains(&store.display().to_string())
            && err.contains("in use by another server"),
        "{err}"
    );
    // `config check` accepts the directory; a file there is refused, naming the field.
    let check = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["config", "check"])
        .arg(&config)
        .output()
        .expect("config check");
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    let file = dir.join("a-file");
    std::fs::write(&file, "").expect("file");
    let check = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["config", "check"])
        .arg(&config)
        .args([
            "--set",
            &format!("server.responses.path={}", file.display()),
        ])
        .output()
        .expect("config check");
    let err = String::from_utf8_lossy(&check.stderr);
    assert!(!check.status.success());
    assert!(
        err.contains("server.responses.path") && err.contains("not a directory"),
        "{err}"
    );

    // A background stream's response: its events are kept in memory only.
    let body = json!({"input": "Hi.", "max_output_tokens": 4, "background": true,
                      "stream": true})
    .to_string();
    let streamed = s
        .request("POST", "/v1/responses", Some(&body), &[ALICE])
        .expect("stream");
    assert_eq!(streamed.status, 200, "{}", streamed.body);
    let last_event = streamed
        .body
        .trim_end()
        .rsplit("\ndata: ")
        .next()
        .expect("an event");
    let ended: Value = serde_json::from_str(last_event).expect("json");
    let bg_path = format!(
        "/v1/responses/{}",
        ended["response"]["id"].as_str().expect("id")
    );
    let replay = s
        .request("GET", &format!("{bg_path}?stream=true"), None, &[ALICE])
        .expect("replay");
    assert_eq!((replay.status, &replay.body), (200, &streamed.body));

    stop(s);
    let s = start("store-b", &store);
    // The background stream's response is back, its events are not: streaming it is a 400.
    let (status, back) = s.call_json("GET", &bg_path, None, &[ALICE]);
    assert_eq!((status, &back), (200, &ended["response"]));
    let (status, refused) = s.call_json("GET", &format!("{bg_path}?stream=true"), None, &[ALICE]);
    assert_eq!(
        (status, refused["error"]["param"].as_str()),
        (400, Some("stream")),
        "{refused}"
    );
    // Every response is back as it was sent, with its tenant; the deleted one stays deleted.
    for (id, sent, who) in [(&id1, &first, ALICE), (&id2, &second, ALICE)] {
        assert_eq!(
            s.call_json("GET", &format!("/v1/responses/{id}"), None, &[who]),
            (200, sent.clone())
        );
    }
    let bobs_path = format!("/v1/responses/{}", bobs["id"].as_str().expect("id"));
    assert_eq!(
        s.call_json("GET", &bobs_path, None, &[BOB]),
        (200, bobs.clone())
    );
    assert_eq!(s.call_json("GET", &bobs_path, None, &[ALICE]).0, 404);
    assert_eq!(
        s.call_json("GET", &format!("/v1/responses/{id1}"), None, &[BOB])
            .0,
        404
    );
    assert_eq!(s.call_json("GET", &deleted_path, None, &[ALICE]).0, 404);
    assert_eq!(
        s.call_json(
            "GET",
            &format!("/v1/responses/{id2}/input_items"),
            None,
            &[ALICE]
        ),
        (200, items_before)
    );
    // The conversation continues: the third turn's prompt holds the first two turns.
    let third = create(
        &s,
        &json!({"input": "Say it again.", "previous_response_id": id2,
                "max_output_tokens": 4, "temperature": 0}),
        ALICE,
    );
    assert_eq!(third["previous_response_id"], id2.as_str());
    assert!(
        tokens(&third, "input_tokens")
            > tokens(&second, "input_tokens") + tokens(&second, "output_tokens"),
        "{third}"
    );
    stop(s);
}

/// With a 64-token context, a conversation of about twice that is refused with truncation
/// disabled and served with `auto`: its oldest messages go, the answer fits the context with
/// `max_output_tokens`; one message longer than the context alone is served too (cut).
#[test]
fn truncation_auto_serves_an_input_longer_than_the_context() {
    let s = Server::start_full("truncation-auto", "  max_model_len: 64\n", "", "");
    let mut input = Vec::new();
    for i in 0..6 {
        input.push(json!({"role": "user", "content": format!(
            "Message {i}: the quick brown fox jumps over the lazy dog once more."
        )}));
        input.push(json!({"role": "assistant", "content": format!("Noted, message {i}.")}));
    }
    input.push(json!({"role": "user", "content": "What was the last message number?"}));
    let body = json!({"input": input, "max_output_tokens": 8, "temperature": 0,
                      "instructions": "Answer briefly."});
    let (status, v) = s.post_json("/v1/responses", &body);
    assert_eq!(status, 400, "{v}");
    let mut auto = body.clone();
    auto["truncation"] = json!("auto");
    let (status, v) = s.post_json("/v1/responses", &auto);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["truncation"], "auto");
    let input_tokens = tokens(&v, "input_tokens");
    assert!(input_tokens > 0 && input_tokens <= 64 - 8, "{v}");
    assert!(tokens(&v, "output_tokens") <= 8);
    // The stored conversation keeps every item.
    let id = v["id"].as_str().expect("id");
    let r = s
        .request(
            "GET",
            &format!("/v1/responses/{id}/input_items?limit=100"),
            None,
            &[],
        )
        .expect("input_items");
    let items: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(items["data"].as_array().map(Vec::len), Some(13), "{items}");

    let long = json!({"input": "word ".repeat(200), "max_output_tokens": 4,
                      "truncation": "auto"});
    let (status, v) = s.post_json("/v1/responses", &long);
    assert_eq!(status, 200, "{v}");
    assert!(tokens(&v, "input_tokens") <= 60, "{v}");
}
