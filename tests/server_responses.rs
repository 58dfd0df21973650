//! End-to-end tests of the Responses API (`POST /v1/responses`): the real binary, SmolLM2 on
//! the CPU, HTTP on loopback. Bodies and events are read into async-openai's Responses types
//! (an independent reading of OpenAI's API reference) as well as checked field by field; the
//! event order is OpenAI's documented one.

mod common;

use async_openai::types::responses::{Response, ResponseStreamEvent};
use common::Server;
use serde_json::{json, Value};

fn server() -> Server {
    Server::start(
        "responses",
        "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n",
    )
}

fn ok(server: &Server, body: &Value) -> Value {
    created(server.post_json("/v1/responses", body))
}

/// A 200's response object, also read into async-openai's type.
fn created((status, v): (u16, Value)) -> Value {
    assert_eq!(status, 200, "{v}");
    let typed: Result<Response, _> = serde_json::from_value(v.clone());
    assert!(
        typed.is_ok(),
        "not an OpenAI response ({:?}): {v}",
        typed.err()
    );
    v
}

/// The 400's `param`.
fn refused(server: &Server, body: &Value) -> String {
    let (status, v) = server.post_json("/v1/responses", body);
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    v["error"]["param"].as_str().unwrap_or("").to_string()
}

/// The text of a response's message items (what the SDKs' `output_text` joins).
fn output_text(v: &Value) -> String {
    let mut text = String::new();
    for item in v["output"].as_array().expect("output") {
        if item["type"] == "message" {
            for part in item["content"].as_array().expect("content") {
                if part["type"] == "output_text" {
                    text.push_str(part["text"].as_str().expect("text"));
                }
            }
        }
    }
    text
}

/// A stream's events: each frame an `event:` line naming its type, then one `data:` line;
/// no `[DONE]`. Each is read into async-openai's event type too.
fn events(server: &Server, body: &Value) -> Vec<Value> {
    events_as(server, body, &[])
}

/// [`events`] of a request sent with `headers` (an API key).
fn events_as(server: &Server, body: &Value, headers: &[(&str, &str)]) -> Vec<Value> {
    let r = server
        .request("POST", "/v1/responses", Some(&body.to_string()), headers)
        .expect("a streamed response");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert!(r.body.ends_with("\n\n"), "{:?}", r.body);
    let mut out = Vec::new();
    for frame in r.body.split_terminator("\n\n") {
        if frame.starts_with(':') {
            continue;
        }
        let (event, data) = frame
            .strip_prefix("event: ")
            .and_then(|f| f.split_once("\ndata: "))
            .unwrap_or_else(|| panic!("not an event frame: {frame:?}"));
        assert!(!data.contains('\n'), "{frame:?}");
        let v: Value = serde_json::from_str(data).unwrap_or_else(|e| panic!("{data}: {e}"));
        assert_eq!(v["type"], event, "{frame}");
        let typed: Result<ResponseStreamEvent, _> = serde_json::from_value(v.clone());
        assert!(
            typed.is_ok(),
            "not an OpenAI event ({:?}): {v}",
            typed.err()
        );
        out.push(v);
    }
    // Sequence numbers count from 0, one per event.
    for (i, e) in out.iter().enumerate() {
        assert_eq!(e["sequence_number"], json!(i), "{e}");
    }
    out
}

fn types(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| e["type"].as_str().unwrap_or("").to_string())
        .collect()
}

/// OpenAI's order for a response of one message: created, in_progress, the item and its part
/// added, text deltas, the text, part and item done, then the end (`last`).
fn assert_message_order(events: &[Value], last: &str) {
    let t = types(events);
    let deltas = t
        .iter()
        .filter(|t| *t == "response.output_text.delta")
        .count();
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    expected.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    expected.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]);
    assert_eq!(t, expected);
}

#[test]
fn a_response_plain_and_streamed() {
    let s = server();
    let model = s.model_id();
    let body = json!({
        "model": model,
        "instructions": "You are a geography teacher. Answer in one sentence.",
        "input": "What is the capital of France?",
        "max_output_tokens": 48,
        "temperature": 0,
        "metadata": {"case": "plain"},
        "user": "u-1",
    });
    let v = ok(&s, &body);
    assert!(
        v["id"].as_str().is_some_and(|id| id.starts_with("resp_")),
        "{v}"
    );
    assert_eq!(v["object"], "response");
    assert_eq!(v["model"], model.as_str());
    // The SDKs compute output_text; the server does not send it (nor does OpenAI).
    assert!(v.get("output_text").is_none(), "{v}");
    let output = v["output"].as_array().expect("output");
    assert_eq!(output.len(), 1, "{v}");
    let item = &output[0];
    assert_eq!(item["type"], "message");
    assert_eq!(item["role"], "assistant");
    assert!(
        item["id"].as_str().is_some_and(|id| id.starts_with("msg_")),
        "{v}"
    );
    assert_eq!(item["content"][0]["type"], "output_text");
    assert_eq!(item["content"][0]["annotations"], json!([]));
    let text = output_text(&v);
    assert!(!text.is_empty(), "{v}");
    let usage = &v["usage"];
    let out_tokens = usage["output_tokens"].as_u64().expect("output_tokens");
    assert_eq!(
        usage["total_tokens"].as_u64(),
        Some(usage["input_tokens"].as_u64().unwrap() + out_tokens)
    );
    // The server's first request: nothing was cached yet.
    assert_eq!(usage["input_tokens_details"]["cached_tokens"], 0);
    assert_eq!(usage["output_tokens_details"]["reasoning_tokens"], 0);
    // Complete, or cut at the limit.
    if out_tokens < 48 {
        assert_eq!(v["status"], "completed", "{v}");
        assert_eq!(item["status"], "completed", "{v}");
        assert!(v["incomplete_details"].is_null());
    } else {
        assert_eq!(v["status"], "incomplete", "{v}");
    }
    // The request's settings, echoed.
    assert_eq!(v["instructions"], body["instructions"]);
    assert_eq!(v["max_output_tokens"], 48);
    assert_eq!(v["temperature"], 0.0);
    assert_eq!(v["top_p"], 1.0);
    assert_eq!(v["metadata"], json!({"case": "plain"}));
    assert_eq!(v["user"], "u-1");
    assert_eq!(v["tools"], json!([]));
    assert_eq!(v["tool_choice"], "auto");
    assert_eq!(v["parallel_tool_calls"], true);
    assert_eq!(v["text"], json!({"format": {"type": "text"}}));
    assert_eq!(v["store"], true);
    assert!(v["previous_response_id"].is_null());

    // It is the chat answer to the same conversation: instructions as the system message
    // first (OpenAI's and vLLM's reading), greedy.
    let (status, chat) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "system", "content": body["instructions"]},
                             {"role": "user", "content": body["input"]}],
                "max_tokens": 48, "temperature": 0}),
    );
    assert_eq!(status, 200, "{chat}");
    assert_eq!(chat["choices"][0]["message"]["content"], text.as_str());
    assert_eq!(
        chat["usage"]["prompt_tokens"], usage["input_tokens"],
        "{chat}"
    );

    // Streamed: OpenAI's events in order, the deltas making the text.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let e = events(&s, &streamed);
    let last = if v["status"] == "completed" {
        "response.completed"
    } else {
        "response.incomplete"
    };
    assert_message_order(&e, last);
    assert_eq!(e[0]["response"]["status"], "in_progress");
    assert_eq!(e[0]["response"]["output"], json!([]));
    let item_id = e[2]["item"]["id"].as_str().expect("item id").to_string();
    let deltas: String = e
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| {
            assert_eq!(e["item_id"], item_id.as_str());
            assert_eq!(e["output_index"], 0);
            assert_eq!(e["content_index"], 0);
            e["delta"].as_str().expect("delta").to_string()
        })
        .collect();
    assert_eq!(deltas, text);
    let n = e.len();
    assert_eq!(e[n - 4]["text"], text.as_str());
    assert_eq!(e[n - 3]["part"]["text"], text.as_str());
    assert_eq!(e[n - 2]["item"]["content"][0]["text"], text.as_str());
    let end = &e[n - 1]["response"];
    assert_eq!(output_text(end), text);
    assert_eq!(end["status"], v["status"]);
    // The same prompt a second time: the prefix cache (blocks of 16 by default) serves its
    // whole blocks but the one holding its last token, which is always computed.
    let mut usage = v["usage"].clone();
    let input = usage["input_tokens"].as_u64().expect("input_tokens");
    usage["input_tokens_details"]["cached_tokens"] = json!((input - 1) / 16 * 16);
    assert_eq!(end["usage"], usage);
    assert_eq!(end["output"][0]["id"], item_id.as_str());

    // The route is counted under its template.
    let r = s.request("GET", "/metrics", None, &[]).expect("metrics");
    assert!(
        r.body.lines().any(|l| l.starts_with(
            "switchyard:http_requests_total{route=\"/v1/responses\",status=\"200\"} "
        )),
        "{}",
        r.body
    );
}

#[test]
fn max_output_tokens_makes_an_incomplete_response() {
    let s = server();
    let body = json!({
        "input": [{"role": "user", "content": [{"type": "input_text",
                   "text": "Write a long story about a dragon who learns to bake bread."}]}],
        "max_output_tokens": 6,
        "temperature": 0,
    });
    let v = ok(&s, &body);
    assert_eq!(v["status"], "incomplete", "{v}");
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["usage"]["output_tokens"], 6);
    assert_eq!(v["output"][0]["status"], "incomplete");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let e = events(&s, &streamed);
    assert_message_order(&e, "response.incomplete");
    let end = &e.last().expect("events")["response"];
    assert_eq!(end["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(output_text(end), output_text(&v));
}

#[test]
fn a_json_schema_format_is_followed() {
    let s = server();
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population_millions": {"type": "number"}
        },
        "required": ["city", "country", "population_millions"],
        "additionalProperties": false
    });
    let v = ok(
        &s,
        &json!({
            "input": "Describe Paris.",
            "max_output_tokens": 100,
            "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "city", "schema": schema,
                                "strict": true}},
        }),
    );
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["text"]["format"]["type"], "json_schema");
    let text = output_text(&v);
    let answer: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = answer.as_object().expect("an object");
    assert_eq!(o.len(), 3, "{text}");
    assert!(o["city"].is_string() && o["country"].is_string(), "{text}");
    assert!(o["population_millions"].is_number(), "{text}");
    // A schema that is not one is named by its Responses field.
    let bad = json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "s",
                     "schema": 3}}});
    assert!(refused(&s, &bad).starts_with("text.format"));
}

fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather",
           "description": "The current weather in a city",
           "parameters": {"type": "object",
               "properties": {"city": {"type": "string", "maxLength": 40},
                              "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": false},
           "strict": true})
}

/// A call's arguments against the tool's schema.
fn check_arguments(arguments: &str) {
    let args: Value =
        serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments:?}: {e}"));
    let o = args.as_object().expect("an object");
    assert_eq!(o.len(), 2, "{arguments}");
    assert!(o["city"].is_string(), "{arguments}");
    assert!(["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap_or("")));
}

#[test]
fn a_function_call_round_trip() {
    let s = server();
    let question = json!({"role": "user", "content": "What is the weather like in Paris today?"});
    let body = json!({
        "input": [question],
        "tools": [weather_tool()],
        "tool_choice": "required",
        "parallel_tool_calls": false,
        "max_output_tokens": 80,
        "temperature": 0,
    });
    let v = ok(&s, &body);
    assert_eq!(v["status"], "completed", "{v}");
    assert_eq!(v["tools"], json!([weather_tool()]));
    assert_eq!(v["tool_choice"], "required");
    assert_eq!(v["parallel_tool_calls"], false);
    let output = v["output"].as_array().expect("output");
    assert_eq!(output.len(), 1, "{v}");
    let call = &output[0];
    assert_eq!(call["type"], "function_call");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    assert!(
        call["id"].as_str().is_some_and(|id| id.starts_with("fc_")),
        "{v}"
    );
    assert!(
        call["call_id"].as_str().is_some_and(|id| !id.is_empty()),
        "{v}"
    );
    let arguments = call["arguments"].as_str().expect("arguments");
    check_arguments(arguments);

    // Streamed: the call's item, its argument deltas making its arguments, in OpenAI's order.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let e = events(&s, &streamed);
    let t = types(&e);
    let deltas = t
        .iter()
        .filter(|t| *t == "response.function_call_arguments.delta")
        .count();
    assert!(deltas >= 1, "{t:?}");
    let mut expected = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
    ];
    expected.extend(std::iter::repeat_n(
        "response.function_call_arguments.delta",
        deltas,
    ));
    expected.extend([
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(t, expected);
    assert_eq!(e[2]["item"]["type"], "function_call");
    assert_eq!(e[2]["item"]["arguments"], "");
    let joined: String = e
        .iter()
        .filter(|e| e["type"] == "response.function_call_arguments.delta")
        .map(|e| e["delta"].as_str().unwrap_or("").to_string())
        .collect();
    let done = &e[e.len() - 3];
    assert_eq!(done["arguments"], joined.as_str());
    assert_eq!(done["name"], "get_weather");
    check_arguments(&joined);

    // The result goes back: the call item as returned, its output answering its call_id.
    let round = json!({
        "input": [question, call, {"type": "function_call_output", "call_id": call["call_id"],
                                   "output": "{\"temperature\": 21, \"sky\": \"sunny\"}"}],
        "tools": [weather_tool()],
        "max_output_tokens": 40,
        "temperature": 0,
    });
    let v = ok(&s, &round);
    assert!(
        v["output"]
            .as_array()
            .expect("output")
            .iter()
            .any(|i| i["type"] == "message"),
        "{v}"
    );
    // An output answering no call is refused by its item's field.
    let mut orphan = round.clone();
    orphan["input"][2]["call_id"] = json!("call_unknown");
    assert_eq!(refused(&s, &orphan), "input[2].call_id");
}

#[test]
fn what_cannot_be_honoured_is_refused_by_name() {
    let s = server();
    for (body, param) in [
        (
            json!({"input": "x", "previous_response_id": "resp_123"}),
            "previous_response_id",
        ),
        (
            json!({"input": "x", "tools": [{"type": "web_search"}]}),
            "tools[0].type",
        ),
        (
            json!({"input": "x", "reasoning": {"summary": "detailed"}}),
            "reasoning.summary",
        ),
        (
            json!({"input": "x", "include": ["reasoning.encrypted_content"]}),
            "include[0]",
        ),
        (json!({"input": "x", "top_logprobs": 2}), "top_logprobs"),
        (
            json!({"input": "x", "include": ["message.output_text.logprobs"],
                   "top_logprobs": 21}),
            "top_logprobs",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "msg_1"}]}),
            "input[0].type",
        ),
        (
            json!({"input": "x", "max_output_tokens": 0}),
            "max_output_tokens",
        ),
        (json!({"input": "x", "temperature": 3}), "temperature"),
        (
            json!({"input": "x", "tools": [weather_tool()],
                   "tool_choice": {"type": "function", "name": "nope"}}),
            "tool_choice",
        ),
        (
            json!({"input": "x", "metadata": {"a": "b".repeat(513)}}),
            "metadata.a",
        ),
        (json!({"temperature": 0}), "input"),
    ] {
        assert_eq!(refused(&s, &body), param, "{body}");
    }
    // Too many metadata pairs.
    let many: serde_json::Map<String, Value> =
        (0..17).map(|i| (format!("k{i}"), json!("v"))).collect();
    assert_eq!(
        refused(&s, &json!({"input": "x", "metadata": many})),
        "metadata"
    );
    // An id never made is a 404 in OpenAI's words, also for the routes under it.
    let r = s
        .request("GET", "/v1/responses/resp_123", None, &[])
        .expect("GET");
    assert_eq!(r.status, 404, "{}", r.body);
    let v: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(
        v["error"]["message"],
        "Response with id 'resp_123' not found."
    );
    for (method, path) in [
        ("DELETE", "/v1/responses/resp_123"),
        ("GET", "/v1/responses/resp_123/input_items"),
        ("POST", "/v1/responses/resp_123/cancel"),
    ] {
        let r = s.request(method, path, None, &[]).expect(path);
        assert_eq!(r.status, 404, "{method} {path}: {}", r.body);
    }
    // store = false and true are both accepted.
    for store in [false, true] {
        let v = ok(
            &s,
            &json!({"input": "Hi", "max_output_tokens": 2, "store": store}),
        );
        assert_eq!(v["store"], store);
    }
    // Another model is not found, as on chat.
    let (status, v) = s.post_json("/v1/responses", &json!({"model": "other", "input": "x"}));
    assert_eq!(status, 404, "{v}");
}

/// A client that leaves aborts its request, as on chat: streamed or not, the engine request
/// ends (`request_aborted_total`), and the one that had no answer yet counts as a 499 on the
/// route's template.
#[test]
fn a_client_that_leaves_aborts_the_response() {
    let s = server();
    let series = |labels: &str| -> f64 {
        let r = s.request("GET", "/metrics", None, &[]).expect("metrics");
        let prefix = format!("switchyard:http_requests_total{{{labels}}} ");
        r.body
            .lines()
            .find_map(|l| l.strip_prefix(&prefix).and_then(|v| v.parse().ok()))
            .unwrap_or(0.0)
    };
    let wait = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !done() {
            assert!(std::time::Instant::now() < deadline, "{what}");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    };
    for stream in [false, true] {
        let body = json!({"input": "Tell me a very long story about dragons and castles.",
                          "max_output_tokens": 4000, "stream": stream})
        .to_string();
        let client = s.open("POST", "/v1/responses", Some(&body));
        wait("never ran", &|| {
            s.metric("switchyard:num_requests_running").unwrap_or(0.0) >= 1.0
        });
        drop(client);
        wait("never aborted", &|| {
            s.metric("switchyard:num_requests_running") == Some(0.0)
        });
    }
    wait("not counted as aborted", &|| {
        s.metric("switchyard:request_aborted_total") == Some(2.0)
    });
    assert_eq!(series("route=\"/v1/responses\",status=\"499\""), 1.0);
    assert_eq!(series("route=\"/v1/responses\",status=\"200\""), 1.0);
}

/// A reasoning model's thinking is a `reasoning` item before the answer, read as chat reads it
/// into `reasoning_content` (a template whose generation prompt opens `<think>`, as QwQ's and
/// DeepSeek-R1's do: what SmolLM2 writes is thinking until it closes the block). Streamed,
/// the reasoning deltas join to the item's text; a reasoning item sent back in `input` (as
/// OpenAI asks of clients managing the conversation) is accepted.
#[test]
fn reasoning_is_its_own_item_as_chat_reads_it() {
    let template = format!(
        "{}/tests/fixtures/think-open.jinja",
        env!("CARGO_MANIFEST_DIR")
    );
    let s = Server::start_full(
        "responses-reasoning",
        &format!("  chat_template: {template}\n"),
        "",
        "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n",
    );
    let question = "What is the capital of France?";
    let (status, chat) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": question}],
                "max_tokens": 24, "temperature": 0}),
    );
    assert_eq!(status, 200, "{chat}");
    let expected_reasoning = chat["choices"][0]["message"]["reasoning_content"]
        .as_str()
        .expect("chat reads reasoning")
        .to_string();
    let expected_content = chat["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(!expected_reasoning.is_empty(), "{chat}");

    let body = json!({"input": question, "max_output_tokens": 24, "temperature": 0});
    let v = ok(&s, &body);
    let output = v["output"].as_array().expect("output");
    assert_eq!(output[0]["type"], "reasoning", "{v}");
    assert!(output[0]["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("rs_")));
    assert_eq!(output[0]["summary"], json!([]));
    assert_eq!(
        output[0]["content"],
        json!([{"type": "reasoning_text", "text": expected_reasoning}])
    );
    assert_eq!(output_text(&v), expected_content);
    // 24 tokens, thinking or not: the answer was cut by the limit as chat's was.
    let cut = chat["choices"][0]["finish_reason"] == "length";
    assert_eq!(v["status"], if cut { "incomplete" } else { "completed" });

    let streamed = events(
        &s,
        &json!({"input": question, "max_output_tokens": 24,
                                      "temperature": 0, "stream": true}),
    );
    let t = types(&streamed);
    assert_eq!(t[2], "response.output_item.added");
    assert_eq!(streamed[2]["item"]["type"], "reasoning");
    assert_eq!(streamed[3]["part"]["type"], "reasoning_text");
    let deltas: String = streamed
        .iter()
        .filter(|e| e["type"] == "response.reasoning_text.delta")
        .map(|e| e["delta"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(deltas, expected_reasoning);
    let done = streamed
        .iter()
        .find(|e| e["type"] == "response.reasoning_text.done")
        .expect("reasoning_text.done");
    assert_eq!(done["text"], json!(expected_reasoning));
    // The streamed response's items are the plain one's (their ids apart).
    let last = &streamed.last().expect("events")["response"];
    assert_eq!(last["output"][0]["content"], output[0]["content"]);
    assert_eq!(output_text(last), expected_content);
    assert_eq!(last["status"], v["status"]);

    // The output sent back as the next turn's input, reasoning item and all.
    let mut input = vec![json!({"role": "user", "content": question})];
    input.extend(output.iter().cloned());
    input.push(json!({"role": "user", "content": "And of Spain?"}));
    ok(&s, &json!({"input": input, "max_output_tokens": 4}));
}

const ALICE: &str = "Bearer alice-key-00000001";
const BOB: &str = "Bearer bob-key-000000001";

/// One request as `key`'s tenant: the status and the JSON body.
fn call(s: &Server, method: &str, path: &str, body: Option<&Value>, key: &str) -> (u16, Value) {
    s.call_json(method, path, body, &[("authorization", key)])
}

/// A response created as `key`'s tenant, read into async-openai's type too.
fn create(s: &Server, body: &Value, key: &str) -> Value {
    created(call(s, "POST", "/v1/responses", Some(body), key))
}

fn tokens(v: &Value, field: &str) -> u64 {
    v["usage"][field]
        .as_u64()
        .unwrap_or_else(|| panic!("usage.{field}: {v}"))
}

/// Stored responses: a conversation continued by `previous_response_id` (its history really is
/// in the prompt: more input tokens than the first turn's input and output, and the prefix
/// cache serves the first turn's prompt), retrieval equal to what was sent (streamed too),
/// `input_items` and its paging, deletion, `store: false`, and tenants kept apart (another
/// tenant's id reads as unknown, for every route).
#[test]
fn stored_responses_continue_are_retrieved_and_stay_with_their_tenant() {
    let s = Server::start_with(
        "responses-store",
        "  api_keys:\n    - { key: alice-key-00000001, tenant: alice }\n    \
         - { key: bob-key-000000001, tenant: bob }\n",
        "scheduler:\n  max_num_seqs: 16\n",
    );
    let first = create(
        &s,
        &json!({"input": "My name is Ada. Say hello to me.", "max_output_tokens": 8,
                "temperature": 0}),
        ALICE,
    );
    let id1 = first["id"].as_str().expect("id").to_owned();
    assert_eq!(first["store"], true);
    assert_eq!(first["previous_response_id"], Value::Null);
    // Retrieved as it was sent; another tenant gets the unknown id's 404.
    let path1 = format!("/v1/responses/{id1}");
    assert_eq!(call(&s, "GET", &path1, None, ALICE), (200, first.clone()));
    // `stream=false` is the object; `stream=true` (the openai SDK's `retrieve(id, stream=True)`)
    // is refused for a response not created in the background, as OpenAI refuses it, and the
    // other parameters OpenAI takes are refused naming themselves.
    let query = |q: &str| call(&s, "GET", &format!("{path1}?{q}"), None, ALICE);
    assert_eq!(query("stream=false"), (200, first.clone()));
    for (q, param) in [
        ("stream=true", "stream"),
        ("stream=true&starting_after=2", "stream"),
        ("include[]=message.output_text.logprobs", "include[]"),
    ] {
        let (status, v) = query(q);
        assert_eq!(status, 400, "{q}: {v}");
        assert_eq!(v["error"]["param"], param, "{q}: {v}");
    }
    let (status, theirs) = call(&s, "GET", &path1, None, BOB);
    let (_, unknown) = call(&s, "GET", "/v1/responses/resp_unknown", None, BOB);
    assert_eq!(status, 404, "{theirs}");
    assert_eq!(
        theirs["error"]["message"]
            .as_str()
            .unwrap()
            .replace(&id1, "X"),
        unknown["error"]["message"]
            .as_str()
            .unwrap()
            .replace("resp_unknown", "X")
    );
    for (method, path) in [
        ("DELETE", path1.clone()),
        ("GET", format!("{path1}/input_items")),
    ] {
        assert_eq!(call(&s, method, &path, None, BOB).0, 404, "{method} {path}");
    }
    let (status, v) = call(
        &s,
        "POST",
        "/v1/responses",
        Some(&json!({"input": "And my name?", "previous_response_id": id1})),
        BOB,
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["code"], "previous_response_not_found");
    assert_eq!(v["error"]["param"], "previous_response_id");

    // The second turn continues the first.
    let second = create(
        &s,
        &json!({"input": "What is my name?", "previous_response_id": id1,
                "max_output_tokens": 8, "temperature": 0}),
        ALICE,
    );
    let id2 = second["id"].as_str().expect("id").to_owned();
    assert_eq!(second["previous_response_id"], id1.as_str());
    assert!(
        tokens(&second, "input_tokens")
            > tokens(&first, "input_tokens") + tokens(&first, "output_tokens"),
        "first {first}\nsecond {second}"
    );
    let cached = second["usage"]["input_tokens_details"]["cached_tokens"]
        .as_u64()
        .expect("cached_tokens");
    assert!(cached > 0, "{second}");
    // Its own input items: one user message.
    let (status, items) = call(
        &s,
        "GET",
        &format!("/v1/responses/{id2}/input_items"),
        None,
        ALICE,
    );
    assert_eq!(status, 200, "{items}");
    assert_eq!(items["object"], "list");
    let data = items["data"].as_array().expect("data");
    assert_eq!(data.len(), 1, "{items}");
    assert_eq!(data[0]["type"], "message");
    assert_eq!(data[0]["role"], "user");
    assert_eq!(
        data[0]["content"],
        json!([{"type": "input_text", "text": "What is my name?"}])
    );
    assert_eq!(items["first_id"], data[0]["id"]);
    assert_eq!(items["has_more"], false);

    // A streamed third turn is stored as its last event's response.
    let body = json!({"input": "Thanks.", "previous_response_id": id2, "stream": true,
                      "max_output_tokens": 4});
    let last = events_as(&s, &body, &[("authorization", ALICE)])
        .pop()
        .expect("events");
    assert!(
        last["type"] == "response.completed" || last["type"] == "response.incomplete",
        "{last}"
    );
    let id3 = last["response"]["id"].as_str().expect("id");
    assert_eq!(
        call(&s, "GET", &format!("/v1/responses/{id3}"), None, ALICE),
        (200, last["response"].clone())
    );

    // input_items' paging over three items.
    let many = create(
        &s,
        &json!({"input": [
            {"role": "user", "content": "one"},
            {"role": "assistant", "content": "two"},
            {"role": "user", "content": "three"}],
            "max_output_tokens": 2}),
        ALICE,
    );
    let items_path = format!("/v1/responses/{}/input_items", many["id"].as_str().unwrap());
    let text = |v: &Value| v["content"][0]["text"].as_str().unwrap_or("").to_owned();
    let (_, page) = call(&s, "GET", &format!("{items_path}?limit=2"), None, ALICE);
    let data = page["data"].as_array().expect("data");
    assert_eq!(
        data.iter().map(text).collect::<Vec<_>>(),
        ["three", "two"],
        "{page}"
    );
    assert_eq!(page["has_more"], true);
    let after = page["last_id"].as_str().expect("last_id");
    let (_, rest) = call(
        &s,
        "GET",
        &format!("{items_path}?limit=2&after={after}"),
        None,
        ALICE,
    );
    let data = rest["data"].as_array().expect("data");
    assert_eq!(data.iter().map(text).collect::<Vec<_>>(), ["one"], "{rest}");
    assert_eq!(rest["has_more"], false);
    let (_, asc) = call(&s, "GET", &format!("{items_path}?order=asc"), None, ALICE);
    assert_eq!(text(&asc["data"][0]), "one", "{asc}");
    for (query, param) in [
        ("limit=0", "limit"),
        ("limit=101", "limit"),
        ("order=up", "order"),
        ("after=nope", "after"),
        ("page=2", "page"),
    ] {
        let (status, v) = call(&s, "GET", &format!("{items_path}?{query}"), None, ALICE);
        assert_eq!(
            (status, v["error"]["param"].as_str()),
            (400, Some(param)),
            "{query}: {v}"
        );
    }

    // Deleting: OpenAI's answer, then gone; a response continuing it keeps its conversation.
    let (status, v) = call(&s, "DELETE", &path1, None, ALICE);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v, json!({"id": id1, "object": "response", "deleted": true}));
    assert_eq!(call(&s, "GET", &path1, None, ALICE).0, 404);
    assert_eq!(call(&s, "DELETE", &path1, None, ALICE).0, 404);
    let fourth = create(
        &s,
        &json!({"input": "Bye.", "previous_response_id": id2, "max_output_tokens": 2}),
        ALICE,
    );
    assert!(
        tokens(&fourth, "input_tokens") > tokens(&second, "input_tokens"),
        "{fourth}"
    );
    let (status, v) = call(
        &s,
        "POST",
        "/v1/responses",
        Some(&json!({"input": "x", "previous_response_id": id1})),
        ALICE,
    );
    assert_eq!(
        (status, &v["error"]["code"]),
        (400, &json!("previous_response_not_found"))
    );

    // A client's X-Request-Id names its response; another tenant choosing the same one gets a
    // response of its own and leaves the first alone.
    let named = |key: &str, text: &str| -> Value {
        let body = json!({"input": text, "max_output_tokens": 2}).to_string();
        let r = s
            .request(
                "POST",
                "/v1/responses",
                Some(&body),
                &[("authorization", key), ("x-request-id", "shared-name-1")],
            )
            .expect("POST");
        assert_eq!(r.status, 200, "{}", r.body);
        serde_json::from_str(&r.body).expect("json")
    };
    let mine = named(ALICE, "Hello from Alice.");
    let theirs = named(BOB, "Hello from Bob.");
    assert_eq!(mine["id"], theirs["id"]);
    let shared = format!("/v1/responses/{}", mine["id"].as_str().unwrap());
    assert_eq!(call(&s, "GET", &shared, None, ALICE), (200, mine));
    assert_eq!(call(&s, "DELETE", &shared, None, BOB).0, 200);
    assert_eq!(call(&s, "GET", &shared, None, ALICE).0, 200);
    assert_eq!(call(&s, "DELETE", &shared, None, ALICE).0, 200);

    // store: false is not kept; the gauge counts what is.
    let unstored = create(
        &s,
        &json!({"input": "Hi", "max_output_tokens": 2, "store": false}),
        ALICE,
    );
    assert_eq!(unstored["store"], false);
    let path = format!("/v1/responses/{}", unstored["id"].as_str().unwrap());
    assert_eq!(call(&s, "GET", &path, None, ALICE).0, 404);
    // Kept: the second, third, the paging one and the fourth.
    assert_eq!(s.metric("switchyard:responses_stored"), Some(4.0));
}

/// With storing off (`server.responses.max_stored: 0`) nothing is kept, the answer says so
/// (`store: false`), and `previous_response_id` is refused naming the setting.
#[test]
fn storing_off_keeps_nothing_and_refuses_continuations() {
    let s = Server::start_with("responses-nostore", "  responses:\n    max_stored: 0\n", "");
    let v = ok(&s, &json!({"input": "Hi", "max_output_tokens": 2}));
    assert_eq!(v["store"], false);
    let r = s
        .request(
            "GET",
            &format!("/v1/responses/{}", v["id"].as_str().unwrap()),
            None,
            &[],
        )
        .expect("GET");
    assert_eq!(r.status, 404);
    let (status, e) = s.post_json(
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": v["id"]}),
    );
    assert_eq!(status, 400, "{e}");
    assert_eq!(e["error"]["param"], "previous_response_id");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("server.responses.max_stored"),
        "{e}"
    );
    let (status, e) = s.post_json("/v1/responses", &json!({"input": "x", "background": true}));
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("background")),
        "{e}"
    );
}

/// `include: ["message.output_text.logprobs"]` with `top_logprobs`: one entry per generated
/// token in the message's part, their tokens joining to its text, each with its alternatives,
/// the values chat completions report for the same greedy answer; streamed, the deltas carry
/// the same tokens and values.
#[test]
fn output_logprobs_are_included_when_asked() {
    let s = server();
    let body = json!({"input": "Name three colors.", "max_output_tokens": 12, "temperature": 0,
                      "include": ["message.output_text.logprobs"], "top_logprobs": 2});
    let v = ok(&s, &body);
    let part = &v["output"][0]["content"][0];
    let logprobs = part["logprobs"].as_array().expect("logprobs");
    // One per token, the end-of-sequence token of a completed answer aside (it writes no text).
    let eos = u64::from(v["status"] == "completed");
    assert_eq!(
        logprobs.len() as u64 + eos,
        v["usage"]["output_tokens"].as_u64().unwrap(),
        "{v}"
    );
    let joined: String = logprobs
        .iter()
        .map(|l| l["token"].as_str().unwrap())
        .collect();
    assert_eq!(joined, part["text"].as_str().unwrap());
    for l in logprobs {
        let top = l["top_logprobs"].as_array().expect("top_logprobs");
        assert_eq!(top.len(), 2, "{l}");
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], l["token"], "{l}");
        assert!(l["bytes"].is_array() && top[0]["bytes"].is_array(), "{l}");
    }
    let (status, chat) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Name three colors."}],
                "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 2}),
    );
    assert_eq!(status, 200, "{chat}");
    // Chat lists the end-of-sequence token too (as vLLM does); the text's logprobs do not.
    let from_chat: Vec<(Value, Value)> = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("chat logprobs")
        .iter()
        .map(|l| (l["token"].clone(), l["logprob"].clone()))
        .take(logprobs.len())
        .collect();
    assert_eq!(
        chat["choices"][0]["logprobs"]["content"]
            .as_array()
            .map(Vec::len),
        Some(logprobs.len() + eos as usize)
    );
    let ours: Vec<(Value, Value)> = logprobs
        .iter()
        .map(|l| (l["token"].clone(), l["logprob"].clone()))
        .collect();
    assert_eq!(ours, from_chat);
    // Streamed: the deltas' logprobs are the same tokens and values.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let e = events(&s, &streamed);
    let from_deltas: Vec<(Value, Value)> = e
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .flat_map(|e| e["logprobs"].as_array().cloned().unwrap_or_default())
        .map(|l| (l["token"].clone(), l["logprob"].clone()))
        .collect();
    assert_eq!(from_deltas, ours);
    // Not asked: the part's list is empty, as OpenAI sends it.
    let plain = ok(&s, &json!({"input": "Hi", "max_output_tokens": 3}));
    assert_eq!(plain["output"][0]["content"][0]["logprobs"], json!([]));
}

/// `GET` a stored response until it is no longer `queued`.
fn poll(s: &Server, id: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let r = s
            .request("GET", &format!("/v1/responses/{id}"), None, &[])
            .expect("GET");
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_str(&r.body).expect("json");
        if v["status"] != "queued" {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "still queued: {v}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// `background: true`: answered at once as `queued`, then read back by polling until it ends,
/// with its output and usage; a running one cancelled (`cancelled`, its engine request
/// aborted), and only once; a foreground response cannot be cancelled.
#[test]
fn a_background_response_is_polled_and_can_be_cancelled() {
    let s = server();
    let v = ok(
        &s,
        &json!({"input": "Say hello.", "background": true, "max_output_tokens": 8}),
    );
    assert_eq!(
        (&v["status"], &v["background"]),
        (&json!("queued"), &json!(true)),
        "{v}"
    );
    assert_eq!(v["output"], json!([]));
    let id = v["id"].as_str().expect("id");
    let done = poll(&s, id);
    assert!(
        done["status"] == "completed" || done["status"] == "incomplete",
        "{done}"
    );
    assert!(!output_text(&done).is_empty(), "{done}");
    assert!(
        done["usage"]["output_tokens"].as_u64().unwrap() > 0,
        "{done}"
    );
    let typed: Result<Response, _> = serde_json::from_value(done.clone());
    assert!(typed.is_ok(), "{:?}", typed.err());

    let aborted = s.metric("switchyard:request_aborted_total").unwrap_or(0.0);
    let long = ok(
        &s,
        &json!({"input": "Count from 1 to 1000, one number per line.", "background": true,
                "max_output_tokens": 2000}),
    );
    // A running one cannot be continued yet.
    let (status, e) = s.post_json(
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": long["id"]}),
    );
    assert_eq!(
        (status, e["error"]["param"].as_str()),
        (400, Some("previous_response_id")),
        "{e}"
    );
    let path = format!("/v1/responses/{}/cancel", long["id"].as_str().unwrap());
    let r = s.request("POST", &path, None, &[]).expect("cancel");
    assert_eq!(r.status, 200, "{}", r.body);
    let cancelled: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(cancelled["status"], "cancelled");
    assert_eq!(
        poll(&s, long["id"].as_str().unwrap())["status"],
        "cancelled"
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while s.metric("switchyard:request_aborted_total").unwrap_or(0.0) < aborted + 1.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the engine request was not aborted"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Not twice; not a foreground response.
    let r = s.request("POST", &path, None, &[]).expect("cancel");
    assert_eq!(r.status, 400, "{}", r.body);
    let fg = ok(&s, &json!({"input": "Hi", "max_output_tokens": 2}));
    let r = s
        .request(
            "POST",
            &format!("/v1/responses/{}/cancel", fg["id"].as_str().unwrap()),
            None,
            &[],
        )
        .expect("cancel");
    assert_eq!(r.status, 400, "{}", r.body);
}

/// A foreground response named (X-Request-Id) like a background response of its tenant still
/// running is refused: it overwrote the stored `queued` one (GET read the foreground answer, a
/// cancel stored the foreground object as `cancelled`), and the background run's end then
/// overwrote the foreground response in turn. Unstored (`store: false`) it keeps nothing and
/// is served; once the background one has ended, the name may be reused.
#[test]
fn a_foreground_response_cannot_take_the_name_of_a_running_background_one() {
    let s = server();
    let named = |body: Value| {
        s.request(
            "POST",
            "/v1/responses",
            Some(&body.to_string()),
            &[("x-request-id", "reused-name-1")],
        )
        .expect("POST")
    };
    let r = named(
        json!({"input": "Count from 1 to 1000, one number per line.",
                         "background": true, "max_output_tokens": 2000}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let background: Value = serde_json::from_str(&r.body).expect("json");
    let id = background["id"].as_str().expect("id").to_owned();

    let r = named(json!({"input": "Hi", "max_output_tokens": 2}));
    assert_eq!(r.status, 400, "{}", r.body);
    let e: Value = serde_json::from_str(&r.body).expect("json");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("still running"),
        "{e}"
    );
    let r = named(json!({"input": "Hi", "max_output_tokens": 2, "store": false}));
    assert_eq!(r.status, 200, "{}", r.body);

    // The stored one is still the background response, and cancelling it stores it so.
    let path = format!("/v1/responses/{id}");
    let r = s.request("GET", &path, None, &[]).expect("GET");
    let stored: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(stored["background"], true, "{stored}");
    let r = s
        .request("POST", &format!("{path}/cancel"), None, &[])
        .expect("cancel");
    assert_eq!(r.status, 200, "{}", r.body);
    let cancelled: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(
        (&cancelled["status"], &cancelled["background"]),
        (&json!("cancelled"), &json!(true)),
        "{cancelled}"
    );
    // Ended: the name is free again, and the new response replaces the cancelled one.
    let r = named(json!({"input": "Hi", "max_output_tokens": 2}));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = s.request("GET", &path, None, &[]).expect("GET");
    let stored: Value = serde_json::from_str(&r.body).expect("json");
    assert_eq!(stored["background"], false, "{stored}");

    // The other way round: while a stored foreground response of a name streams, a background
    // one of that name is refused (it would be replaced by the foreground's end, then replace
    // it); once the foreground one has ended, it is served.
    let body = json!({"input": "Count from 1 to 1000, one number per line.",
                      "max_output_tokens": 300, "stream": true})
    .to_string();
    let mut streaming = s.open_with(
        "POST",
        "/v1/responses",
        Some(&body),
        &[("x-request-id", "reused-name-2")],
    );
    assert_eq!(common::read_status(&mut streaming), 200);
    let background = |s: &common::Server| {
        s.request(
            "POST",
            "/v1/responses",
            Some(&json!({"input": "Hi", "background": true, "max_output_tokens": 2}).to_string()),
            &[("x-request-id", "reused-name-2")],
        )
        .expect("POST")
    };
    let r = background(&s);
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("still running"), "{}", r.body);
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut streaming, &mut rest);
    assert!(rest.contains("response.completed") || rest.contains("response.incomplete"));
    let r = background(&s);
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(poll(&s, "resp_reused-name-2")["background"], true);
}

/// A streamed answer read event by event from its connection.
struct EventReader {
    reader: std::io::BufReader<std::net::TcpStream>,
    /// Text read past the last whole frame.
    text: String,
}

impl EventReader {
    /// Sends the request, checks its 200 and reads its headers.
    fn open(s: &Server, method: &str, path: &str, body: Option<&str>) -> Self {
        use std::io::{BufRead, Read};
        let mut reader = std::io::BufReader::new(s.open(method, path, body));
        let mut line = String::new();
        reader.read_line(&mut line).expect("status line");
        if !line.starts_with("HTTP/1.1 200") {
            let mut rest = String::new();
            let _ = reader.read_to_string(&mut rest);
            panic!("{line}{rest}");
        }
        loop {
            line.clear();
            reader.read_line(&mut line).expect("header");
            if line.trim_end().is_empty() {
                break;
            }
        }
        Self {
            reader,
            text: String::new(),
        }
    }

    /// The events read, frame by frame from the chunked body, until `enough` holds of them
    /// (or the body ends).
    fn until(&mut self, enough: impl Fn(&[Value]) -> bool) -> Vec<Value> {
        use std::io::{BufRead, Read};
        let mut line = String::new();
        let mut events = Vec::new();
        while !enough(&events) {
            line.clear();
            if self.reader.read_line(&mut line).expect("chunk size") == 0 {
                // The connection closed without the body's last chunk.
                break;
            }
            let size = usize::from_str_radix(line.trim(), 16).expect("chunk size");
            if size == 0 {
                break;
            }
            let mut chunk = vec![0; size + 2];
            self.reader.read_exact(&mut chunk).expect("chunk");
            self.text
                .push_str(std::str::from_utf8(&chunk[..size]).expect("utf-8"));
            while let Some(end) = self.text.find("\n\n") {
                let frame: String = self.text.drain(..end + 2).collect();
                if frame.starts_with(':') {
                    continue;
                }
                let data = frame
                    .trim_end()
                    .split_once("\ndata: ")
                    .map(|(_, d)| d.to_owned())
                    .unwrap_or_else(|| panic!("{frame:?}"));
                events.push(serde_json::from_str(&data).expect("event json"));
            }
        }
        events
    }
}

/// `GET /v1/responses/{id}?stream=true` with `query`: its events, each read into async-openai's
/// event type.
fn replay(s: &Server, id: &str, query: &str) -> Vec<Value> {
    let r = s
        .request(
            "GET",
            &format!("/v1/responses/{id}?stream=true{query}"),
            None,
            &[],
        )
        .expect("GET stream");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    r.body
        .split_terminator("\n\n")
        .filter(|frame| !frame.starts_with(':'))
        .map(|frame| {
            let (event, data) = frame
                .strip_prefix("event: ")
                .and_then(|f| f.split_once("\ndata: "))
                .unwrap_or_else(|| panic!("not an event frame: {frame:?}"));
            let v: Value = serde_json::from_str(data).expect("json");
            assert_eq!(v["type"], event);
            let typed: Result<ResponseStreamEvent, _> = serde_json::from_value(v.clone());
            assert!(
                typed.is_ok(),
                "not an OpenAI event ({:?}): {v}",
                typed.err()
            );
            v
        })
        .collect()
}

/// `background` with `stream` (the openai SDKs' `responses.stream(background=True)`): the
/// events stream as the response runs; the client hanging up leaves it running (no engine
/// request aborted), and a resume after the last event read (`retrieve(id, stream=True,
/// starting_after=N)`) gets the rest: joined, the events are numbered 0, 1, 2, ... without a
/// gap and are what one uninterrupted stream gives (a replay from the start), ending with the
/// response stored.
#[test]
fn a_background_stream_resumes_after_a_dropped_connection() {
    let s = server();
    let aborted = s.metric("switchyard:request_aborted_total").unwrap_or(0.0);
    let body = json!({"input": "Count from 1 to 200, one number per line.", "background": true,
                      "stream": true, "max_output_tokens": 200, "temperature": 0})
    .to_string();
    let mut reader = EventReader::open(&s, "POST", "/v1/responses", Some(&body));
    let deltas = |events: &[Value]| {
        events
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .count()
    };
    let before = reader.until(|events| deltas(events) >= 3);
    assert_eq!(
        types(&before[..3]),
        [
            "response.created",
            "response.queued",
            "response.in_progress"
        ]
    );
    assert_eq!(before[0]["response"]["status"], "queued");
    let id = before[0]["response"]["id"].as_str().expect("id").to_owned();
    // The client hangs up mid-stream.
    drop(reader);
    let last = before.last().unwrap()["sequence_number"].as_u64().unwrap();
    let after = replay(&s, &id, &format!("&starting_after={last}"));
    let stored = poll(&s, &id);
    let status = stored["status"].as_str().unwrap_or("").to_owned();
    assert!(status == "completed" || status == "incomplete", "{stored}");
    let mut joined = before.clone();
    joined.extend(after);
    for (i, e) in joined.iter().enumerate() {
        assert_eq!(e["sequence_number"], json!(i), "{e}");
    }
    assert_eq!(joined, replay(&s, &id, ""), "one stream from the start");
    let end = joined.last().unwrap();
    assert_eq!(end["type"], format!("response.{status}"));
    assert_eq!(end["response"], stored);
    let text: String = joined
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(text, output_text(&stored));
    let read_before: usize = before
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap().len())
        .sum();
    assert!(text.len() > read_before, "it ran on after the client left");
    assert_eq!(
        s.metric("switchyard:request_aborted_total").unwrap_or(0.0),
        aborted,
        "no engine request was aborted"
    );
    // A resume past the last event ends at once; a foreground response cannot be streamed.
    assert!(replay(&s, &id, "&starting_after=100000").is_empty());
    let fg = ok(&s, &json!({"input": "Hi", "max_output_tokens": 2}));
    let (status, v) = s.call_json(
        "GET",
        &format!("/v1/responses/{}?stream=true", fg["id"].as_str().unwrap()),
        None,
        &[],
    );
    assert_eq!(
        (status, v["error"]["param"].as_str()),
        (400, Some("stream")),
        "{v}"
    );
}

/// A drain ends a background stream as it ends our other streams: past the drain timeout the
/// response fails with the drain's `unavailable` error, which ends its stream and every
/// resumed one as an `error` event numbered next, and the server exits 0.
#[test]
fn a_drain_ends_background_streams_with_the_drains_error() {
    let mut s = Server::start_with("responses-drain", "  drain_timeout_s: 2\n", "");
    // An answer of 2000 digits at least (a token each): it runs far past the drain timeout.
    let schema = json!({"type": "object", "additionalProperties": false, "required": ["d"],
                        "properties": {"d": {"type": "string", "pattern": "^[0-9]{2000}$"}}});
    let body = json!({"input": "Write many digits.", "background": true, "stream": true,
                      "max_output_tokens": 6000,
                      "text": {"format": {"type": "json_schema", "name": "digits",
                                          "schema": schema}}})
    .to_string();
    let mut reader = EventReader::open(&s, "POST", "/v1/responses", Some(&body));
    let before = reader.until(|events| {
        events
            .iter()
            .any(|e| e["type"] == "response.output_text.delta")
    });
    let id = before[0]["response"]["id"].as_str().expect("id").to_owned();
    // A second reader follows from the last event read.
    let last = before.last().unwrap()["sequence_number"].as_u64().unwrap();
    let path = format!("/v1/responses/{id}?stream=true&starting_after={last}");
    let mut resumed = EventReader::open(&s, "GET", &path, None);
    let status = std::process::Command::new("kill")
        .args(["-TERM", &s.child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let rest = reader.until(|_| false);
    let followed = resumed.until(|_| false);
    let end = rest
        .last()
        .unwrap_or_else(|| panic!("no events after the drain began; resumed: {followed:?}"));
    assert_eq!(
        (&end["type"], &end["code"]),
        (&json!("error"), &json!("unavailable")),
        "{end}"
    );
    assert_eq!(followed.last(), Some(end), "the resumed stream ends alike");
    let mut joined = before;
    joined.extend(rest);
    for (i, e) in joined.iter().enumerate() {
        assert_eq!(e["sequence_number"], json!(i), "{e}");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let code = loop {
        if let Some(code) = s.child.try_wait().expect("wait") {
            break code;
        }
        assert!(std::time::Instant::now() < deadline, "server did not exit");
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    assert!(code.success(), "exit status {code:?}\n{}", s.log());
}

/// A running background response lies outside the store's bounds (`max_stored`,
/// `max_stored_mb`) but holds an engine request, so `server.max_pending_requests` bounds the
/// running ones as it bounds every request: with the seats taken, a background request (and a
/// background stream) is refused with a foreground request's own 503 `overloaded` and its
/// `Retry-After`, and the refusal stores nothing (its id is a 404, the store stays empty); a
/// running background response takes a seat in turn, given back once it is cancelled.
#[test]
fn max_pending_requests_bounds_background_responses() {
    const KEY: &str = "Bearer seats-key-0000000001";
    let lines = "  max_pending_requests: 2\n  api_keys:\n    \
                 - { key: seats-key-0000000001, tenant: acme }\n";
    let s = Server::start_with("responses-seats", lines, "");
    let post = |body: Value, id: &str| {
        s.request(
            "POST",
            "/v1/responses",
            Some(&body.to_string()),
            &[("authorization", KEY), ("x-request-id", id)],
        )
        .expect("POST")
    };
    let get = |path: &str| {
        s.request("GET", path, None, &[("authorization", KEY)])
            .expect("GET")
    };
    let refusal = |r: &common::Response| {
        let v: Value = serde_json::from_str(&r.body).expect("json");
        (
            r.status,
            v["error"]["type"].clone(),
            v["error"]["code"].clone(),
            r.header("retry-after").map(str::to_owned),
        )
    };
    let seats: Vec<_> = (0..2).map(|_| s.hold_stream(KEY, 400)).collect();
    let foreground = post(json!({"input": "Hi", "max_output_tokens": 2}), "seat-fg");
    let expected = refusal(&foreground);
    assert_eq!(
        (expected.0, &expected.2),
        (503, &json!("overloaded")),
        "{}",
        foreground.body
    );
    for (id, stream) in [("seat-bg", false), ("seat-bg-stream", true)] {
        let body = json!({"input": "Hi", "max_output_tokens": 2, "background": true,
                          "stream": stream});
        let r = post(body, id);
        assert_eq!(refusal(&r), expected, "{id}: {}", r.body);
    }
    for id in ["seat-fg", "seat-bg", "seat-bg-stream"] {
        let r = get(&format!("/v1/responses/resp_{id}"));
        assert_eq!(r.status, 404, "{id}: {}", r.body);
    }
    assert_eq!(s.metric("switchyard:responses_stored"), Some(0.0));
    for seat in seats {
        seat.join().expect("held stream");
    }

    // A running background response holds a seat of its own.
    let seat = s.hold_stream(KEY, 400);
    let running = post(
        json!({"input": "Count from 1 to 1000, one number per line.", "background": true,
               "max_output_tokens": 2000}),
        "seat-running",
    );
    assert_eq!(running.status, 200, "{}", running.body);
    let r = post(json!({"input": "Hi", "max_output_tokens": 2}), "seat-fg2");
    assert_eq!(refusal(&r), expected, "{}", r.body);
    let r = s
        .request(
            "POST",
            "/v1/responses/resp_seat-running/cancel",
            None,
            &[("authorization", KEY)],
        )
        .expect("cancel");
    assert_eq!(r.status, 200, "{}", r.body);
    // Its seat comes back once the engine has let its request go.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let r = post(json!({"input": "Hi", "max_output_tokens": 2}), "seat-fg3");
        if r.status == 200 {
            break;
        }
        assert_eq!(refusal(&r), expected, "{}", r.body);
        assert!(
            std::time::Instant::now() < deadline,
            "the cancelled response kept its seat"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    seat.join().expect("held stream");
}
