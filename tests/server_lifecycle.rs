//! End-to-end tests of server state: auth, policy hot swap under load, client disconnects and
//! SIGTERM draining. Each test starts its own server.

mod common;

use common::{sse_events, Server};
use serde_json::{json, Value};
use std::io::Write;
use std::time::{Duration, Instant};

const KEYS: &str =
    "  admin_key: admin-secret-key\n  api_keys:\n    - { key: tenant-a-key-0001, tenant: a }\n";

fn models(server: &Server, key: &str) -> (u16, Value) {
    let auth = format!("Bearer {key}");
    let r = server
        .request("GET", "/v1/models", None, &[("Authorization", &auth)])
        .expect("request");
    (
        r.status,
        serde_json::from_str(&r.body).unwrap_or(Value::Null),
    )
}

#[test]
fn api_keys_and_admin_policy_swap_under_load() {
    let s = Server::start_with("swap", KEYS, "scheduler:\n  max_num_seqs: 8\n");
    let (status, v) = models(&s, "wrong-key-000000");
    assert_eq!(status, 401, "{v}");
    assert!(v["error"]["type"].is_string(), "{v}");
    let (status, v) = models(&s, "tenant-a-key-0001");
    assert_eq!(status, 200, "{v}");
    let model = v["data"][0]["id"].as_str().unwrap().to_string();

    // Load: 6 concurrent completions while the policy is swapped twice.
    let port = s.port;
    let workers: Vec<_> = (0..6)
        .map(|i| {
            let model = model.clone();
            std::thread::spawn(move || {
                let body = json!({"model": model, "prompt": format!("Count to ten: {i}"), "max_tokens": 16, "temperature": 0, "ignore_eos": true}).to_string();
                let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
                let req = format!(
                    "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: Bearer tenant-a-key-0001\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                stream.write_all(req.as_bytes()).unwrap();
                common::read_response(&mut stream).unwrap()
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    let admin = [("Authorization", "Bearer admin-secret-key")];
    for name in ["priority", "prefix-aware", "mlfq", "fcfs"] {
        let body = json!({"name": name, "params": {}}).to_string();
        let r = s
            .request("PUT", "/admin/policy", Some(&body), &admin)
            .expect("swap");
        assert_eq!(r.status, 200, "{}", r.body);
        let r = s
            .request("GET", "/admin/policy", None, &admin)
            .expect("get policy");
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(v["name"], name);
    }
    let r = s
        .request(
            "PUT",
            "/admin/policy",
            Some(r#"{"name":"no-such-policy"}"#),
            &admin,
        )
        .expect("bad swap");
    assert_eq!(r.status, 400, "{}", r.body);
    let r = s
        .request(
            "GET",
            "/admin/policy",
            None,
            &[("Authorization", "Bearer tenant-a-key-0001")],
        )
        .expect("non-admin");
    assert_eq!(r.status, 401);
    for w in workers {
        let r = w.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).unwrap();
        assert_eq!(
            v["usage"]["completion_tokens"], 16,
            "request lost tokens across the swap: {v}"
        );
    }
    assert!(s.metric("switchyard:policy_swaps_total").unwrap_or(0.0) >= 2.0);
    // The log names both ends of a swap (it once named only the policy swapped out).
    s.wait_logged("scheduling policy swapped", 1);
    s.assert_logged(&["scheduling policy swapped", "from=", "to="]);
}

#[test]
fn client_disconnect_aborts_and_frees_blocks() {
    let s = Server::start("disconnect", "cache:\n  prefix_caching: false\n");
    let model = s.model_id();
    // Long enough that it cannot finish by itself within the deadline below.
    let body = |stream: bool| {
        json!({"model": model, "prompt": "Tell me a very long story", "max_tokens": 6000, "ignore_eos": true, "stream": stream}).to_string()
    };
    // Hang up many times: where the hang-up falls in the engine's step varies from one to the
    // next (one in a handful once fell between a step's planning and its batch, and the empty
    // batch that was left killed the executor). Every other request is not streamed: nothing
    // is written to its connection before the end, so only the closed connection itself can
    // tell the server.
    for round in 0..20 {
        let stream = s.open("POST", "/v1/completions", Some(&body(round % 2 == 0)));
        // Wait until it is running, then hang up.
        let deadline = Instant::now() + Duration::from_secs(60);
        while s.metric("switchyard:num_requests_running").unwrap_or(0.0) < 1.0 {
            assert!(
                Instant::now() < deadline,
                "round {round}: request never ran"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(s.metric("switchyard:kv_cache_usage_perc").unwrap_or(0.0) > 0.0);
        drop(stream);
        // Generous for a loaded 2-core machine (it takes well under a second).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let running = s.metric("switchyard:num_requests_running");
            let usage = s.metric("switchyard:kv_cache_usage_perc");
            if running == Some(0.0) && usage == Some(0.0) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: blocks not freed after disconnect: running={running:?} \
                 usage={usage:?} aborted={:?} http_in_flight={:?}\nserver log:\n{}",
                s.metric("switchyard:request_aborted_total"),
                s.metric("switchyard:http_requests_in_flight"),
                s.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    assert_eq!(s.metric("switchyard:request_aborted_total"), Some(20.0));
    // And the engine still serves.
    s.assert_serves();
}

/// A client that stays connected but stops reading its stream is cut off once the events
/// waiting for it fill the request's buffer (4096 events in the server): it gets an
/// `unavailable` error and `[DONE]`, its request ends (KV blocks and seats back), and each of
/// its choices counts in `request_failed_total{reason="unavailable"}`: not in
/// `request_aborted_total` (the client did not leave), nor in `request_success_total` (none of
/// its choices reached the client's end). Before, they counted as aborted (8 here), and choices
/// cut off at their last delta as successes.
#[test]
fn a_stream_its_client_stops_reading_is_cut_off_and_counted_as_failed() {
    let s = Server::start("slow-reader", "cache:\n  kv_cache_mb: 1024\n");
    let model = s.model_id();
    // 8 choices of up to 4000 tokens, each event carrying logprobs: the cut-off comes long
    // before any choice could finish (after roughly 1200 steps here, once the socket buffers
    // and the 4096 events of the channel are full).
    let body = json!({"model": model, "prompt": "Tell me a story", "max_tokens": 4000, "n": 8,
                      "ignore_eos": true, "temperature": 1.0, "logprobs": 5, "stream": true})
    .to_string();
    // A small receive buffer: the kernel holds little of what the client does not read.
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_recv_buffer_size(2048).expect("SO_RCVBUF");
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], s.port));
    socket.connect(&addr.into()).expect("connect");
    let mut stream: std::net::TcpStream = socket.into();
    write!(
        stream,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("send");
    wait_running(&s, 8);
    // Not read until the request ended: cut off (or, should the cut-off never come, run to
    // its end, which fails below).
    let deadline = Instant::now() + Duration::from_secs(300);
    while s.metric("switchyard:num_requests_running").unwrap_or(0.0) > 0.0 {
        assert!(
            Instant::now() < deadline,
            "the unread stream was never cut off; log:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let failed = |reason: &str| {
        s.labelled_metric(
            "switchyard:request_failed_total",
            &[&format!("reason=\"{reason}\"")],
        )
    };
    // The detokenizer counts before it lets the request go: wait for the seats too.
    let deadline = Instant::now() + Duration::from_secs(30);
    while failed("unavailable") < 8.0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        (
            failed("unavailable"),
            s.metric("switchyard:request_aborted_total"),
            s.metric("switchyard:request_success_total"),
        ),
        (8.0, Some(0.0), Some(0.0)),
        "(failed unavailable, aborted, success) after the cut-off"
    );
    assert_eq!(s.metric("switchyard:kv_cache_usage_perc"), Some(0.0));
    // The client, reading at last, finds the reason and the end of the stream.
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let r = common::read_response(&mut stream).expect("the stream's end");
    assert_eq!(r.status, 200);
    let mut events = sse_events(&r.body);
    assert_eq!(events.pop().as_deref(), Some("[DONE]"));
    let last: Value = serde_json::from_str(events.last().expect("an event")).expect("JSON");
    assert_eq!(last["error"]["code"], "unavailable", "{last}");
    let message = last["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("cut off"), "{message}");
    assert!(
        events
            .iter()
            .all(|e| !e.contains("\"finish_reason\":\"length\"")),
        "a choice finished before the cut-off: the test needs longer choices"
    );
    s.assert_serves();
}

#[test]
fn hang_ups_of_every_request_kind_leave_the_engine_idle_and_serving() {
    // A bound on requests in flight that the hang-ups below may reach (it refuses some then):
    // every seat they took must come back, which only a request taking them all can tell.
    const SEATS: usize = 32;
    let s = Server::start_with("hangups", &format!("  max_pending_requests: {SEATS}\n"), "");
    let model = s.model_id();
    let kinds: Vec<(&str, Value)> = vec![
        (
            "/v1/completions",
            json!({"prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": true, "stream": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Tell me a story", "max_tokens": 300, "ignore_eos": true, "n": 3, "temperature": 1.0, "stream": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": ["one two", "three four"], "max_tokens": 200, "ignore_eos": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Count: 1 2 3", "max_tokens": 100, "echo": true, "logprobs": 3, "ignore_eos": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 200, "logprobs": true, "top_logprobs": 2, "stream": true}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Give JSON"}], "max_tokens": 200, "response_format": {"type": "json_object"}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 200, "stream": true,
                   "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
                   "tool_choice": "required"}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "x ".repeat(300), "max_tokens": 50, "stream": true}),
        ),
        (
            "/v1/completions",
            json!({"prompt": "Say hello", "max_tokens": 200, "stop": ["\n\n", "zz"], "ignore_eos": true, "stream": true}),
        ),
    ];
    // xorshift64: the same choices every run (the timing of the hang-ups still varies).
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let waits_ms = [0u64, 2, 10, 30, 100, 300];
    for _ in 0..25 {
        let clients: Vec<_> = (0..1 + next() % 5)
            .map(|_| {
                let (path, mut body) = kinds[(next() % kinds.len() as u64) as usize].clone();
                body["model"] = json!(model);
                let mut stream = s.open("POST", path, Some(&body.to_string()));
                let wait = Duration::from_millis(waits_ms[(next() % 6) as usize]);
                let read_some = next() % 3 == 0;
                std::thread::spawn(move || {
                    std::thread::sleep(wait);
                    if read_some {
                        use std::io::Read;
                        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
                        let _ = stream.read(&mut [0u8; 256]);
                    }
                    drop(stream);
                })
            })
            .collect();
        for c in clients {
            c.join().unwrap();
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = |name: &str| s.metric(name);
        let state = [
            m("switchyard:num_requests_running"),
            m("switchyard:num_requests_waiting"),
            m("switchyard:kv_cache_usage_perc"),
            m("switchyard:http_requests_in_flight"),
        ];
        if state.iter().all(|v| *v == Some(0.0)) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not idle after the hang-ups: running, waiting, KV usage, HTTP in flight = \
             {state:?}\nserver log:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // No panic, and no step failed (other libraries' error lines about reset connections
    // are expected here).
    let log = s.log();
    for bad in [
        "panicked",
        "a step failed",
        "executor is gone",
        "allocator is gone",
    ] {
        assert!(!log.contains(bad), "`{bad}` in the server log:\n{log}");
    }
    s.assert_serves();
    // Every admission seat is back: one request of two prompts × 16 choices takes them all.
    let (code, v) = s.post_json(
        "/v1/completions",
        &json!({"model": model, "prompt": ["Hi", "Ho"], "n": SEATS / 2, "max_tokens": 1}),
    );
    assert_eq!(
        code, 200,
        "seats not all given back after the hang-ups: {v}"
    );
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(SEATS), "{v}");
}

#[test]
fn sigterm_drains_in_flight_requests_then_exits_zero() {
    // A drain long enough for the stream below to end on its own, however loaded the machine.
    let mut s = Server::start_with("drain", "  drain_timeout_s: 600\n", "");
    let model = s.model_id();
    // Long enough to be still in flight while the checks below run: once nothing is in flight
    // the server stops at once, and a request then finds no one to answer it. 1000 tokens are
    // seconds of decoding (200 ended within a second, as close to the checks' own time as a
    // loaded machine's scheduling hiccup).
    let body = json!({"model": model, "prompt": "Write a list of fruits", "max_tokens": 1000, "ignore_eos": true, "stream": true}).to_string();
    let mut stream = s.open("POST", "/v1/completions", Some(&body));
    wait_running(&s, 1);
    sigterm(&s);
    // The signal is handled asynchronously: wait for readiness to turn off.
    wait_not_ready(&s);
    // New work is refused while draining.
    let (code, v) = s.post_json(
        "/v1/completions",
        &json!({"model": model, "prompt": "Hi", "max_tokens": 4}),
    );
    assert_eq!(code, 503, "{v}");
    assert_streamed_to_its_end(&mut stream);
    wait_exit_zero(&mut s);
}

/// A stop asked for as the model loads exits 0, as one after a drain does: a signal is how a
/// server is meant to stop. It is sent at the load's log line (the handlers are installed by
/// then); the small model's load may end before it arrives, and then the server drains.
#[test]
fn a_stop_as_the_model_loads_exits_zero() {
    let mut s = Server::spawn("stop-loading", |_| {});
    let deadline = Instant::now() + Duration::from_secs(120);
    while !s.log().contains("loading model") {
        if let Some(status) = s.child.try_wait().expect("wait") {
            panic!("serve ended ({status}) before the load:\n{}", s.log());
        }
        assert!(Instant::now() < deadline, "no load:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(5));
    }
    sigterm(&s);
    wait_exit_zero(&mut s);
    let log = s.log();
    assert!(
        log.contains("stopped while the model loaded: the server did not start signal=\"SIGTERM\"")
            || log.contains("draining"),
        "{log}"
    );
}

/// As PID 1 of a PID namespace (a container's entry point), which a signal from outside
/// reaches only through a handler, `serve` drains on SIGTERM (the stream in flight runs to its
/// end) and exits 0, as it does elsewhere. Where this machine makes no user and PID namespace
/// (`unshare -Urpf true` fails: unprivileged user namespaces off), the test says so on stderr
/// and checks nothing.
#[test]
fn sigterm_drains_a_server_running_as_pid_1_then_it_exits_zero() {
    if !common::pid1::pid_namespaces_work() {
        return;
    }
    // A drain long enough for the stream below to end on its own (as in the test above).
    let mut s = Server::spawn_as_pid1("pid1", "  drain_timeout_s: 600\n");
    s.wait_ready();
    let init = common::pid1::namespace_init(&s.child);
    assert!(common::signal_listed(init, "SigCgt", libc::SIGTERM));
    let model = s.model_id();
    // Long enough to be in flight when the signal comes (see the drain test above).
    let body = json!({"model": model, "prompt": "Write a list of fruits", "max_tokens": 1000,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let mut stream = s.open("POST", "/v1/completions", Some(&body));
    wait_running(&s, 1);
    common::send_signal(init, libc::SIGTERM);
    wait_not_ready(&s);
    assert_streamed_to_its_end(&mut stream);
    // `unshare`'s status is the server's exit code.
    wait_exit_zero(&mut s);
    let log = s.log();
    assert_eq!(log.matches("draining").count(), 1, "{log}");
}

/// Regression: a server started with SIGINT ignored (`switchyard serve ... &` in a script)
/// took SIGINT over and drained on it. It is left ignored, and SIGTERM drains and exits 0.
#[test]
fn a_sigint_inherited_ignored_stays_ignored_and_sigterm_still_drains() {
    let mut s = Server::spawn("sigint-ignored", |cmd| {
        common::ignoring_sigint(cmd);
    });
    s.wait_ready();
    let pid = s.child.id();
    assert!(common::signal_listed(pid, "SigIgn", libc::SIGINT));
    assert!(!common::signal_listed(pid, "SigCgt", libc::SIGINT));
    assert!(common::signal_listed(pid, "SigCgt", libc::SIGTERM));
    // Discarded as it is sent: the server goes on serving.
    signal(&s, "-INT");
    s.assert_serves();
    sigterm(&s);
    wait_exit_zero(&mut s);
    let log = s.log();
    assert_eq!(log.matches("draining").count(), 1, "{log}");
    assert!(!log.contains("second signal"), "{log}");
}

/// Past the drain timeout, every request still in flight gets a final answer: a stream its
/// error event and `[DONE]`, a plain request a 503; then the server exits 0.
#[test]
fn requests_left_at_the_drain_timeout_end_with_an_error() {
    let mut s = Server::start_with("drain-timeout", "  drain_timeout_s: 3\n", "");
    let model = s.model_id();
    // Far longer than the drain timeout.
    let body = |stream: bool| {
        json!({"model": model, "prompt": "Tell me a very long story", "max_tokens": 6000,
               "ignore_eos": true, "stream": stream})
        .to_string()
    };
    let mut streamed = s.open("POST", "/v1/completions", Some(&body(true)));
    let mut whole = s.open("POST", "/v1/completions", Some(&body(false)));
    wait_running(&s, 2);
    sigterm(&s);
    for stream in [&mut streamed, &mut whole] {
        stream
            .set_read_timeout(Some(Duration::from_secs(120)))
            .unwrap();
    }
    let r = common::read_response(&mut streamed).expect("the stream's end");
    assert_eq!(r.status, 200, "{}", r.body);
    let mut events = sse_events(&r.body);
    assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{}", r.body);
    let last: Value = serde_json::from_str(events.last().expect("an event")).expect("JSON");
    assert_eq!(last["error"]["code"], "unavailable", "{}", r.body);
    let r = common::read_response(&mut whole).expect("an answer");
    assert_eq!(r.status, 503, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("JSON");
    assert_eq!(v["error"]["code"], "unavailable", "{v}");
    wait_exit_zero(&mut s);
}

/// A second SIGINT during the drain ends it at once (the drain timeout is an hour here, so
/// nothing else ends it while the test runs): the stream still in flight gets its error event
/// and `[DONE]`, and the server exits 0. Were the second signal ignored, the stream would run
/// on to its 6000th token and end without the error event, or past the read timeout.
#[test]
fn a_second_sigint_ends_the_drain_at_once() {
    let mut s = Server::start_with("second-signal", "  drain_timeout_s: 3600\n", "");
    let model = s.model_id();
    let body = json!({"model": model, "prompt": "Tell me a very long story", "max_tokens": 6000,
                      "ignore_eos": true, "stream": true})
    .to_string();
    let mut streamed = s.open("POST", "/v1/completions", Some(&body));
    wait_running(&s, 1);
    signal(&s, "-INT");
    // Two signals sent at once may arrive as one: the second is sent once the drain began.
    wait_not_ready(&s);
    signal(&s, "-INT");
    streamed
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    let r = common::read_response(&mut streamed).expect("the stream's end");
    let mut events = sse_events(&r.body);
    assert_eq!(events.pop().as_deref(), Some("[DONE]"), "{}", r.body);
    let last: Value = serde_json::from_str(events.last().expect("an event")).expect("JSON");
    assert_eq!(last["error"]["code"], "unavailable", "{}", r.body);
    wait_exit_zero(&mut s);
    s.assert_logged(&[
        "WARN",
        "second signal: ending the drain now, 1 requests cut off",
    ]);
}

/// Reads the stream in flight on `stream` to its end: `[DONE]` after a choice that ran to its
/// length, drained rather than cut off.
fn assert_streamed_to_its_end(stream: &mut std::net::TcpStream) {
    stream
        .set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    let r = common::read_response(stream).expect("in-flight stream completes");
    let events = sse_events(&r.body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert!(
        events
            .iter()
            .any(|e| e.contains(r#""finish_reason":"length""#)),
        "{}",
        r.body
    );
}

/// Waits (at most a minute) until `/ready` answers 503, checking it answers 200 until then.
fn wait_not_ready(s: &Server) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let r = s
            .request("GET", "/ready", None, &[])
            .expect("/ready while draining");
        if r.status == 503 {
            return;
        }
        assert_eq!(r.status, 200, "{r:?}");
        assert!(Instant::now() < deadline, "/ready never turned 503");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits (at most a minute) until `n` requests run.
fn wait_running(s: &Server, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while s.metric("switchyard:num_requests_running").unwrap_or(0.0) < n as f64 {
        assert!(
            Instant::now() < deadline,
            "fewer than {n} requests ever ran"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Sends the server SIGTERM.
fn sigterm(s: &Server) {
    signal(s, "-TERM");
}

/// Sends the server the signal `kill` names by `flag` (`-TERM`, `-INT`).
fn signal(s: &Server, flag: &str) {
    let pid = s.child.id().to_string();
    let status = std::process::Command::new("kill")
        .args([flag, &pid])
        .status()
        .expect("kill");
    assert!(status.success());
}

/// Waits (at most a minute) for the server to exit, and checks that it exited 0.
fn wait_exit_zero(s: &mut Server) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let code = loop {
        if let Some(code) = s.child.try_wait().expect("wait") {
            break code;
        }
        assert!(Instant::now() < deadline, "server did not exit");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(code.success(), "exit status {code:?}\n{}", s.log());
}

/// A client that sends its head and part of its body, then nothing, gets a 408 once
/// `server.request_timeout_s` passes, its connection closed and its count released: with a
/// `Content-Length` body, and with a chunked one stalled after a whole chunk or inside one
/// (which actix would otherwise keep reading, to drain it, for as long as the client likes).
#[test]
fn a_body_that_stops_arriving_is_answered_408_and_its_connection_closed() {
    let s = Server::start_with("body-timeout", "  request_timeout_s: 2\n", "");
    let head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n";
    for body in [
        "Content-Length: 100\r\n\r\n{\"prompt\":",
        "Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n",
        "Transfer-Encoding: chunked\r\n\r\n100\r\n{\"prompt\":",
    ] {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
        stream
            .write_all(format!("{head}{body}").as_bytes())
            .expect("send");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let r = common::read_response(&mut stream).expect("an answer");
        assert_eq!(r.status, 408, "{body}: {r:?}");
        let v: Value = serde_json::from_str(&r.body).expect("JSON");
        assert_eq!(v["error"]["code"], "request_timeout", "{body}: {v}");
        assert_eq!(r.header("connection"), Some("close"), "{body}: {r:?}");
        assert_closed(&mut stream, body);
        assert_eq!(s.metric("switchyard:http_requests_in_flight"), Some(0.0));
    }
    s.assert_serves();
}

/// A chunked body answered before it ended (a 413 for going past `server.max_body_bytes`, a
/// 401 for want of a key, a 415 for a content coding) closes its connection even though the
/// client goes on sending nothing (or more); a chunked body read to its end leaves the
/// connection open for the next request, pipelined ones included.
#[test]
fn a_chunked_body_answered_early_closes_its_connection() {
    let s = Server::start_with(
        "chunked-early",
        &format!("  max_body_bytes: 1024\n{KEYS}"),
        "",
    );
    let chunk = format!("400\r\n{}\r\n", "x".repeat(1024));
    let requests = [
        (
            format!(
                "POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tenant-a-key-0001\r\n\
                 Transfer-Encoding: chunked\r\n\r\n{chunk}{chunk}"
            ),
            413,
        ),
        (
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n\
             5\r\n{\"pro\r\n"
                .to_owned(),
            401,
        ),
        (
            "POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tenant-a-key-0001\r\n\
             Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\n"
                .to_owned(),
            415,
        ),
    ];
    for (request, status) in requests {
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
        stream.write_all(request.as_bytes()).expect("send");
        stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .unwrap();
        let r = common::read_response(&mut stream).expect("an answer");
        assert_eq!(r.status, status, "{r:?}");
        assert_closed(&mut stream, &request);
    }

    // Two requests written at once, the first with a whole chunked body: both are answered on
    // the one connection, which stays open.
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", s.port)).expect("connect");
    stream
        .write_all(
            b"POST /tokenize HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tenant-a-key-0001\r\n\
              Transfer-Encoding: chunked\r\n\r\n5\r\n{\"pro\r\na\r\nmpt\":\"hi\"}\r\n0\r\n\r\n\
              GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        )
        .expect("send");
    stream
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    for status in [200, 200] {
        let r = common::read_response_from(&mut reader).expect("an answer");
        assert_eq!(r.status, status, "{r:?}");
        assert_ne!(r.header("connection"), Some("close"), "{r:?}");
    }
    stream
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .expect("the connection stays open");
    let r = common::read_response_from(&mut reader).expect("an answer");
    assert_eq!(r.status, 200, "{r:?}");
}

/// Checks that the server closes `stream` (a read gives end of file or a reset) within 20 s
/// (it lingers `client_disconnect_timeout`, 1 s, first), discarding anything else it sends.
fn assert_closed(stream: &mut std::net::TcpStream, what: &str) {
    use std::io::Read;
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let mut buf = [0u8; 1024];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("{what:?}: the connection is still open ({e})"),
        }
    }
}

#[test]
fn sighup_rereads_the_policy_section() {
    let s = Server::start_with("sighup", KEYS, "scheduler:\n  policy: { name: fcfs }\n");
    let admin = [("Authorization", "Bearer admin-secret-key")];
    let policy = |s: &Server| -> Value {
        let r = s
            .request("GET", "/admin/policy", None, &admin)
            .expect("get policy");
        serde_json::from_str(&r.body).expect("json")
    };
    assert_eq!(policy(&s)["name"], "fcfs");
    let config = s.dir.join("config.yaml");
    let text = std::fs::read_to_string(&config).unwrap().replace(
        "name: fcfs",
        "name: chunked-prefill, params: { token_budget: 256 }",
    );
    std::fs::write(&config, text).unwrap();
    let pid = s.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(60);
    while policy(&s)["name"] != "chunked-prefill" {
        assert!(
            Instant::now() < deadline,
            "policy not reloaded: {}\n{}",
            policy(&s),
            s.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(policy(&s)["params"]["token_budget"], 256);
    // A policy an admin set since is replaced by the file's on the next SIGHUP, with a
    // warning naming both.
    let body = json!({"name": "priority", "params": {}}).to_string();
    let r = s
        .request("PUT", "/admin/policy", Some(&body), &admin)
        .expect("swap");
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let deadline = Instant::now() + Duration::from_secs(60);
    while policy(&s)["name"] != "chunked-prefill" {
        assert!(
            Instant::now() < deadline,
            "policy not reloaded:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    s.assert_logged(&[
        "WARN",
        "the policy set through PUT /admin/policy (priority) is replaced by the file's \
         (chunked-prefill {\"token_budget\":256})",
    ]);
    // Still serving.
    let r = s
        .request(
            "GET",
            "/v1/models",
            None,
            &[("Authorization", "Bearer tenant-a-key-0001")],
        )
        .unwrap();
    assert_eq!(r.status, 200);
}

/// Cached prefixes are shared within a tenant, not across tenants (`cache.prefix_sharing:
/// tenant`, the default), nor across `cache_salt`s; with `global`, tenants share.
#[test]
fn tenants_and_cache_salts_share_cached_prefixes_only_among_themselves() {
    let keys = "  api_keys:\n    - { key: tenant-a-key-0001, tenant: a }\n    - { key: tenant-b-key-0001, tenant: b }\n";
    // Three blocks of 16 tokens and more: a repeat finds at least 48 cached tokens.
    let prompt = "Trains crossed the valley every morning, carrying coal, timber and letters \
                  to the towns along the river, and the stationmaster wrote each one down in \
                  a ledger bound in green leather, with the hour, the weight of the load and \
                  the name of the driver, so that nothing was ever lost between the towns.";
    for (sharing, tenants_share) in [("tenant", false), ("global", true)] {
        let s = Server::start_with(
            &format!("salt-{sharing}"),
            keys,
            &format!("cache:\n  prefix_sharing: {sharing}\n"),
        );
        let hits = || {
            s.metric("switchyard:prefix_cache_hits_total")
                .unwrap_or(0.0)
        };
        let post = |key: &str, salt: Option<&str>| {
            let mut body = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0});
            if let Some(salt) = salt {
                body["cache_salt"] = json!(salt);
            }
            let auth = format!("Bearer {key}");
            let before = hits();
            let r = s
                .request(
                    "POST",
                    "/v1/completions",
                    Some(&body.to_string()),
                    &[("Authorization", &auth)],
                )
                .expect("request");
            assert_eq!(r.status, 200, "{}", r.body);
            hits() - before
        };
        let (a, b) = ("tenant-a-key-0001", "tenant-b-key-0001");
        assert_eq!(post(a, None), 0.0, "{sharing}: nothing cached yet");
        assert!(
            post(a, None) >= 48.0,
            "{sharing}: a tenant reuses its own prefix"
        );
        let across = post(b, None);
        if tenants_share {
            assert!(across >= 48.0, "{sharing}: tenants share ({across})");
        } else {
            assert_eq!(
                across, 0.0,
                "{sharing}: another tenant's prefix is not reused"
            );
            assert!(post(b, None) >= 48.0, "{sharing}: b reuses its own");
        }
        assert_eq!(
            post(a, Some("s1")),
            0.0,
            "{sharing}: a new salt shares nothing"
        );
        assert!(
            post(a, Some("s1")) >= 48.0,
            "{sharing}: the same salt shares"
        );
        let r = s
            .request(
                "POST",
                "/v1/completions",
                Some(&json!({"prompt": "x", "cache_salt": ""}).to_string()),
                &[("Authorization", "Bearer tenant-a-key-0001")],
            )
            .expect("request");
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains("cache_salt"), "{}", r.body);
    }
}
