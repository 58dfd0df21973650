//! End-to-end tests of tool calling: the real binary, SmolLM2 on the CPU, HTTP on loopback.
//! The answers are checked with an independent parser (serde_json) against the tools'
//! schemas, and deserialized into async-openai's types for wire compatibility.

mod common;

use async_openai::types::chat::{
    ChatCompletionMessageToolCalls, CreateChatCompletionResponse,
    CreateChatCompletionStreamResponse, FinishReason,
};
use common::Server;
use serde_json::{json, Value};

const SCHEDULER: &str = "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n";

fn server() -> Server {
    Server::start("tools", SCHEDULER)
}

/// A server whose chat template is `tests/fixtures/{fixture}`, with `model_lines` more in
/// `model:`.
fn server_with_template(name: &str, fixture: &str, model_lines: &str) -> Server {
    let template = format!("{}/tests/fixtures/{fixture}", env!("CARGO_MANIFEST_DIR"));
    Server::start_full(
        name,
        &format!("  chat_template: {template}\n{model_lines}"),
        "",
        SCHEDULER,
    )
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather",
            "description": "The current weather in a city",
            "parameters": {"type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40},
                               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "local_time", "description": "The time now"}},
    ])
}

fn ask(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
        "tools": weather_tools(),
        "max_tokens": 80,
        "temperature": 0,
    });
    for (k, v) in extra.as_object().expect("fields") {
        body[k] = v.clone();
    }
    body
}

/// The (name, arguments) of a response's calls, arguments parsed; their ids OpenAI's.
fn calls_of(message: &Value) -> Vec<(String, Value)> {
    calls_in(message, "hermes")
}

/// Whether `id` is a call id of the model's call `format`: OpenAI's `call_` ids, or Mistral's
/// 9 letters and digits.
fn id_of_format(id: &str, format: &str) -> bool {
    match format {
        "mistral" | "mistral_v11" => id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()),
        _ => id.starts_with("call_") && id.len() > 9,
    }
}

/// [`calls_of`] for a model whose call format is `format`.
fn calls_in(message: &Value, format: &str) -> Vec<(String, Value)> {
    message["tool_calls"]
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    assert_eq!(c["type"], "function", "{c}");
                    assert!(id_of_format(c["id"].as_str().unwrap_or(""), format), "{c}");
                    let args = c["function"]["arguments"].as_str().expect("arguments text");
                    let args: Value = serde_json::from_str(args)
                        .unwrap_or_else(|e| panic!("arguments {args:?}: {e}"));
                    (
                        c["function"]["name"].as_str().unwrap_or("").to_string(),
                        args,
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `body` answered with calls only: status 200, `finish_reason` `tool_calls`, no content;
/// the response and its calls (ids of the model's call `format`).
fn calls_only_answer(s: &Server, body: &Value, format: &str) -> (Value, Vec<(String, Value)>) {
    let (status, v) = s.post_json("/v1/chat/completions", body);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert!(
        choice["message"].get("content").is_none_or(Value::is_null),
        "{v}"
    );
    let calls = calls_in(&choice["message"], format);
    (v, calls)
}

/// What a choice's tokens wrote, from its logprobs.
fn written_by_tokens(choice: &Value) -> String {
    choice["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|t| t["token"].as_str().expect("a token"))
        .collect()
}

/// `body` streamed: the calls its chunks open and write, arguments parsed (each chunk a typed
/// OpenAI chunk, none with content), and the finish reasons.
fn streamed_calls(s: &Server, body: &Value) -> (Vec<(String, Value)>, Vec<String>) {
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let mut names: Vec<String> = Vec::new();
    let mut arguments: Vec<String> = Vec::new();
    let mut finish = Vec::new();
    for event in s.post_stream("/v1/chat/completions", &streamed) {
        if event == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&event).expect("a chunk");
        let _: CreateChatCompletionStreamResponse =
            serde_json::from_value(chunk.clone()).expect("typed chunk");
        let delta = &chunk["choices"][0]["delta"];
        assert!(delta.get("content").is_none_or(Value::is_null), "{chunk}");
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            if let Some(name) = call["function"]["name"].as_str() {
                assert_eq!(index, names.len(), "{chunk}");
                names.push(name.to_owned());
                arguments.push(String::new());
            }
            arguments[index].push_str(call["function"]["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = chunk["choices"][0]["finish_reason"].as_str() {
            finish.push(f.to_owned());
        }
    }
    let calls = names
        .into_iter()
        .zip(
            arguments
                .iter()
                .map(|a| serde_json::from_str(a).expect("JSON")),
        )
        .collect();
    (calls, finish)
}

fn assert_weather_arguments(args: &Value) {
    let o = args.as_object().expect("an object");
    assert_eq!(o.len(), 2, "{args}");
    assert!(
        o["city"].as_str().is_some_and(|c| c.chars().count() <= 40),
        "{args}"
    );
    assert!(
        ["celsius", "fahrenheit"].contains(&o["unit"].as_str().unwrap_or("")),
        "{args}"
    );
}

/// Checks a call of one of [`weather_tools`]' tools against its tool (`v`, the response, for
/// the messages).
fn assert_tool_call(name: &str, args: &Value, v: &Value) {
    match name {
        "get_weather" => assert_weather_arguments(args),
        "local_time" => assert_eq!(args, &json!({}), "{v}"),
        other => panic!("called {other:?}: {v}"),
    }
}

#[test]
fn required_and_named_choices_answer_with_calls_that_follow_the_schema() {
    let s = server();
    // Without tools the model answers in prose: the calls below come from the tools.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "What is the weather like in Paris today?"}],
                "max_tokens": 40, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"].get("tool_calls").is_none(),
        "{v}"
    );

    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &ask(json!({"tool_choice": "required", "parallel_tool_calls": false})),
    );
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let calls = calls_of(&choice["message"]);
    assert_eq!(calls.len(), 1, "{v}");
    assert_tool_call(&calls[0].0, &calls[0].1, &v);
    let typed: CreateChatCompletionResponse = serde_json::from_value(v.clone()).expect("typed");
    assert_eq!(
        typed.choices[0].finish_reason,
        Some(FinishReason::ToolCalls)
    );
    let typed_calls = typed.choices[0].message.tool_calls.as_ref().expect("calls");
    assert!(matches!(
        &typed_calls[0],
        ChatCompletionMessageToolCalls::Function(c) if c.function.name == calls[0].0
    ));

    // A named function is the one called, with its (empty) arguments; the choice finishes
    // with stop, as OpenAI's (and vLLM's) do when tool_choice names the function.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &ask(json!({"tool_choice": {"type": "function", "function": {"name": "local_time"}}})),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let typed: CreateChatCompletionResponse = serde_json::from_value(v.clone()).expect("typed");
    assert_eq!(typed.choices[0].finish_reason, Some(FinishReason::Stop));
    let calls = calls_of(&v["choices"][0]["message"]);
    assert!(!calls.is_empty(), "{v}");
    for (name, args) in calls {
        assert_eq!((name.as_str(), args), ("local_time", json!({})), "{v}");
    }
    // Counted as structured output of kind tool_calls (the only kind this server saw).
    let r = s.request("GET", "/metrics", None, &[]).expect("metrics");
    assert!(
        r.body
            .contains("switchyard:structured_output_requests_total{kind=\"tool_calls\"} 2"),
        "{}",
        r.body
    );
}

#[test]
fn a_streamed_call_is_the_call_of_the_whole_answer_its_arguments_in_pieces() {
    let s = server();
    let body = ask(
        json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                          "parallel_tool_calls": false, "seed": 7, "logprobs": true}),
    );
    let (status, whole) = s.post_json("/v1/chat/completions", &body);
    let tokens_of = |logprobs: &Value| -> Vec<String> {
        logprobs["content"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| t["token"].as_str().expect("a token").to_owned())
            .collect()
    };
    let whole_tokens = tokens_of(&whole["choices"][0]["logprobs"]);
    assert_eq!(
        whole_tokens.len() as u64,
        whole["usage"]["completion_tokens"].as_u64().unwrap(),
        "{whole}"
    );
    assert_eq!(status, 200, "{whole}");
    let expected = calls_of(&whole["choices"][0]["message"]);
    assert_eq!(expected.len(), 1, "{whole}");
    assert_eq!(expected[0].0, "get_weather");
    assert_weather_arguments(&expected[0].1);

    let mut stream = body.clone();
    stream["stream"] = json!(true);
    stream["stream_options"] = json!({"include_usage": true});
    let events = s.post_stream("/v1/chat/completions", &stream);
    let body = events.join("\n");
    let chunks: Vec<Value> = events
        .iter()
        .map(|e| serde_json::from_str(e).expect("a JSON chunk"))
        .collect();
    for e in &events {
        let _: CreateChatCompletionStreamResponse =
            serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"));
    }
    // Calls only: not even an empty content in the opening chunk.
    assert_eq!(
        chunks[0]["choices"][0]["delta"]["role"], "assistant",
        "{}",
        body
    );
    assert!(
        chunks[0]["choices"][0]["delta"]["content"].is_null(),
        "{}",
        body
    );
    let mut calls: Vec<Value> = Vec::new();
    let mut content = String::new();
    let mut finish = Vec::new();
    // Chunks that carried a part of the arguments.
    let mut argument_chunks = 0;
    let mut tokens = Vec::new();
    for c in &chunks {
        let choice = &c["choices"][0];
        // Calls only: no content anywhere, not even an empty one.
        assert!(choice["delta"]["content"].is_null(), "{c}");
        let more = tokens_of(&choice["logprobs"]);
        if tokens.is_empty() && !more.is_empty() {
            // The tokens of `<tool_call>` and the call's name are held back with their text:
            // they go out with the chunk that opens the call.
            assert!(choice["delta"]["tool_calls"][0]["id"].is_string(), "{c}");
        }
        tokens.extend(more);
        if let Some(text) = choice["delta"]["content"].as_str() {
            content.push_str(text);
        }
        for call in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            let part = call["function"]["arguments"].as_str().expect("arguments");
            argument_chunks += usize::from(!part.is_empty());
            if call["id"].is_string() {
                // A call opens with its id, type and name.
                assert_eq!(call["index"], calls.len(), "{call}");
                calls.push(call.clone());
            } else {
                // Then its arguments follow in pieces.
                assert_eq!(call["index"], calls.len() - 1, "{call}");
                assert!(call["function"]["name"].is_null(), "{call}");
                let open = calls.last_mut().expect("an open call");
                let joined = open["function"]["arguments"].as_str().unwrap().to_owned() + part;
                open["function"]["arguments"] = json!(joined);
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finish.push(f.to_string());
        }
    }
    assert_eq!(content, "", "{}", body);
    // A named function: stop, as OpenAI's.
    assert_eq!(finish, ["stop"], "{}", body);
    let streamed = calls_of(&json!({"tool_calls": calls}));
    assert_eq!(streamed, expected, "{body}");
    // The arguments were streamed as the model wrote them, not sent whole at the end.
    assert!(argument_chunks > 2, "{body}");
    assert_eq!(tokens, whole_tokens, "{body}");

    // Cut short by max_tokens inside the arguments: still the call, with the arguments
    // written so far, streamed or not, and finish_reason length.
    let at = whole_tokens
        .iter()
        .position(|t| t.contains("city"))
        .expect("the city's key");
    let mut cut = stream.clone();
    cut["max_tokens"] = json!(at + 2);
    let events = s.post_stream("/v1/chat/completions", &cut);
    let mut streamed_args = String::new();
    let mut finish = None;
    for e in &events {
        let c: Value = serde_json::from_str(e).expect("a JSON chunk");
        let choice = &c["choices"][0];
        for call in choice["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            assert_eq!(call["index"], 0, "{c}");
            streamed_args.push_str(call["function"]["arguments"].as_str().unwrap());
        }
        finish = finish.or(choice["finish_reason"].as_str().map(str::to_owned));
    }
    assert_eq!(finish.as_deref(), Some("length"), "{events:?}");
    cut["stream"] = json!(false);
    cut.as_object_mut().unwrap().remove("stream_options");
    let (status, v) = s.post_json("/v1/chat/completions", &cut);
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length", "{v}");
    assert!(choice["message"]["content"].is_null(), "{v}");
    let call = &choice["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather", "{v}");
    let args = call["arguments"].as_str().expect("arguments");
    assert_eq!(args, streamed_args, "{v}");
    let full = whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap();
    assert!(
        full.starts_with(args) && args.starts_with("{\"city") && args.len() < full.len(),
        "{args:?} of {full:?}"
    );
}

/// The reviewer's 20 intersected patterns (45 s of compiling before the bound on them).
fn intersected_patterns() -> Value {
    let letters: Vec<char> = ('a'..='z').collect();
    let mut all = vec![json!({"type": "string", "pattern": ".*a.*b.*"})];
    for i in 1..20 {
        all.push(json!({"pattern": format!(".*{}.*{}.*", letters[i], letters[i + 1])}));
    }
    json!({"allOf": all})
}

#[test]
fn a_call_cut_short_after_a_call_leaves_no_markup_in_the_content() {
    let s = server();
    // Calls only, several allowed: the model calls again after its first call.
    let body = ask(json!({"tool_choice": "required", "logprobs": true, "max_tokens": 120}));
    let (status, whole) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{whole}");
    let all_calls = calls_of(&whole["choices"][0]["message"]);
    assert!(all_calls.len() >= 2, "the model wrote one call: {whole}");
    let tokens: Vec<&str> = whole["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|t| t["token"].as_str().expect("token"))
        .collect();
    // The tokens through the first call's closing tag.
    let mut text = String::new();
    let first_end = tokens
        .iter()
        .position(|t| {
            text.push_str(t);
            text.ends_with("</tool_call>")
        })
        .expect("the first call's end")
        + 1;
    // Every cut between the first call's end and the second call's arguments (the reviewer's
    // max_tokens 54/56/58 gave content "\n<", "\n<tool_", "\n<tool_call>").
    let second_arguments = tokens
        .iter()
        .enumerate()
        .skip(first_end)
        .find(|(_, t)| t.contains("arguments"))
        .map(|(i, _)| i + 1)
        .expect("the second call's arguments");
    for max_tokens in first_end + 1..=second_arguments {
        let mut cut = body.clone();
        cut["max_tokens"] = json!(max_tokens);
        cut.as_object_mut().expect("body").remove("logprobs");
        let (status, v) = s.post_json("/v1/chat/completions", &cut);
        assert_eq!(status, 200, "{v}");
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "length", "{max_tokens}: {v}");
        assert!(choice["message"]["content"].is_null(), "{max_tokens}: {v}");
        assert_eq!(
            calls_of(&choice["message"])[..1],
            all_calls[..1],
            "{max_tokens}: {v}"
        );
        // Streamed: no content in any delta, the last one included.
        cut["stream"] = json!(true);
        let events = s.post_stream("/v1/chat/completions", &cut);
        let mut finish = None;
        let mut opened = 0;
        for e in &events {
            let c: Value = serde_json::from_str(e).expect("a JSON chunk");
            let choice = &c["choices"][0];
            assert!(choice["delta"]["content"].is_null(), "{max_tokens}: {c}");
            opened += choice["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|call| call["id"].is_string())
                .count();
            finish = finish.or(choice["finish_reason"].as_str().map(str::to_owned));
        }
        assert_eq!(
            finish.as_deref(),
            Some("length"),
            "{max_tokens}: {events:?}"
        );
        assert!(opened >= 1, "{max_tokens}: {events:?}");
    }
}

/// A call cut short by `max_tokens` (its arguments `{"city":`, no JSON object) is sent back in
/// the next request's conversation, as agent loops send it, then answered by a `tool`
/// message: the request is served, and the call is written into the prompt as the model
/// wrote it, by the server (Hermes) and by a template that writes arguments with `tojson`
/// (Llama 3.1's).
#[test]
fn a_call_cut_short_is_taken_back_in_the_conversation_as_written() {
    for (s, key) in [
        (server(), "arguments"),
        (
            server_with_template("tools-cut-llama3.1", "llama3.1.jinja", ""),
            "parameters",
        ),
    ] {
        let asked =
            ask(json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}));
        let (message, arguments) = (1..60)
            .find_map(|max_tokens| {
                let mut body = asked.clone();
                body["max_tokens"] = json!(max_tokens);
                let (status, v) = s.post_json("/v1/chat/completions", &body);
                assert_eq!(status, 200, "{v}");
                let choice = &v["choices"][0];
                let arguments = choice["message"]["tool_calls"][0]["function"]["arguments"]
                    .as_str()?
                    .to_owned();
                let cut = arguments.len() > 2 && serde_json::from_str::<Value>(&arguments).is_err();
                cut.then(|| {
                    assert_eq!(choice["finish_reason"], "length", "{v}");
                    (choice["message"].clone(), arguments)
                })
            })
            .expect("a call cut inside its arguments");
        // The message as the openai SDK sends it back (`model_dump(exclude_none=True)`).
        let mut message = message.as_object().expect("message").clone();
        message.retain(|_, v| !v.is_null());
        let id = message["tool_calls"][0]["id"].clone();
        let history = json!([
            asked["messages"][0],
            message,
            {"role": "tool", "tool_call_id": id, "content": "sunny"},
        ]);
        let (status, v) = s.post_json(
            "/v1/chat/completions",
            &ask(json!({"messages": history, "max_tokens": 5})),
        );
        assert_eq!(status, 200, "{v}");
        let prompt = rendered(&s, &json!({"messages": history, "tools": weather_tools()}));
        assert!(
            prompt.contains(&format!("\"{key}\": {arguments}")),
            "{arguments:?} in {prompt:?}"
        );
        s.assert_serves();
    }
}

#[test]
fn conversations_with_tool_results_and_tool_choice_none_are_answered() {
    let s = server();
    let history = json!([
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18, \"sky\": \"cloudy\"}"},
    ]);
    // auto: text that holds no call markup, or calls.
    for choice in [json!("auto"), json!("none")] {
        let (status, v) = s.post_json(
            "/v1/chat/completions",
            &ask(json!({"messages": history, "tool_choice": choice, "max_tokens": 48})),
        );
        assert_eq!(status, 200, "{v}");
        let message = &v["choices"][0]["message"];
        let calls = calls_of(message);
        if choice == "none" {
            assert!(calls.is_empty(), "{v}");
        }
        match message["content"].as_str() {
            Some(text) if calls.is_empty() => {
                assert!(!text.contains("<tool_call>"), "{v}");
            }
            None => assert!(!calls.is_empty(), "{v}"),
            Some(_) => {}
        }
        let _: CreateChatCompletionResponse = serde_json::from_value(v).expect("typed");
    }
    // /tokenize reads tool messages the same way, and offers the tools a chat completion
    // would: the prompt the completion counted.
    let (status, v) = s.post_json("/tokenize", &json!({"messages": history}));
    assert_eq!(status, 200, "{v}");
    assert!(v["count"].as_u64().is_some_and(|n| n > 20), "{v}");
    let body = ask(json!({"messages": history, "max_tokens": 1}));
    let (status, chat) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{chat}");
    let (status, with_tools) = s.post_json(
        "/tokenize",
        &json!({"messages": history, "tools": weather_tools()}),
    );
    assert_eq!(status, 200, "{with_tools}");
    assert_eq!(
        with_tools["count"], chat["usage"]["prompt_tokens"],
        "{with_tools} {chat}"
    );
    assert!(with_tools["count"].as_u64() > v["count"].as_u64());
    let (status, v) = s.post_json(
        "/tokenize",
        &json!({"prompt": "hi", "tools": weather_tools()}),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools", "{v}");
}

#[test]
fn bad_tool_requests_are_refused_with_the_field_and_the_server_serves_on() {
    let s = server();
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            json!({"messages": user, "tools": {"type": "function"}}),
            "tools",
        ),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "no spaces"}}]}),
            "tools[0].function.name",
        ),
        (
            ask(json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}})),
            "tool_choice",
        ),
        (ask(json!({"tool_choice": "sometimes"})), "tool_choice"),
        (
            json!({"messages": user, "tools": [{"type": "function", "function": {"name": "f",
                "parameters": {"type": "string"}}}]}),
            "tools[0].function.parameters",
        ),
        (
            json!({"messages": user, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            ask(json!({"response_format": {"type": "json_object"}})),
            "tools",
        ),
        (ask(json!({"ignore_eos": true})), "ignore_eos"),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}]}),
            "messages[0].tool_calls[0].function.arguments",
        ),
        // A schema llguidance cannot compile is the engine's 400.
        (
            ask(
                json!({"tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": "("}}}}}]}),
            ),
            "",
        ),
    ];
    for (body, param) in cases {
        let (status, v) = s.post_json("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        if !param.is_empty() {
            assert_eq!(v["error"]["param"], param, "{body}: {v}");
        }
    }
    // A tool whose schema would take exponential time to compile: refused before compiling.
    let body = ask(
        json!({"tools": [{"type": "function", "function": {"name": "f",
        "parameters": {"type": "object", "properties": {"x": intersected_patterns()}}}}]}),
    );
    let (status, v) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("at most 8 may meet"), "{message}");
    s.assert_serves();
}

#[test]
fn speculative_decoding_gives_the_same_tool_answers() {
    // Drafts run through the tool grammar (prompt lookup finds `<tool_call>\n{"name": ` in the
    // system message) and are taken back where the model disagrees: every answer must be the
    // one of a token per step, and drafts must have been tried.
    let plain = server();
    let spec = Server::start(
        "tools-spec",
        "scheduler:\n  max_num_seqs: 16\n  max_num_batched_tokens: 1024\n\
         speculative:\n  num_speculative_tokens: 4\n",
    );
    let choices = [
        json!("required"),
        json!("auto"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ];
    let answer = |s: &Server, body: &Value| {
        let (status, v) = s.post_json("/v1/chat/completions", body);
        assert_eq!(status, 200, "{v}");
        let c = &v["choices"][0];
        (
            c["message"]["content"].clone(),
            calls_of(&c["message"]),
            c["finish_reason"].clone(),
        )
    };
    for seed in 0..6 {
        let body = ask(json!({
            "messages": [{"role": "user", "content": "Weather in Paris? Call get_weather for it."}],
            "tool_choice": choices[seed % 3],
            "temperature": 0.8,
            "seed": seed,
        }));
        let want = answer(&plain, &body);
        assert_eq!(answer(&spec, &body), want, "seed {seed}: {body}");
    }
    assert!(
        spec.metric("switchyard:spec_decode_num_draft_tokens_total")
            .is_some_and(|n| n > 0.0),
        "no drafts were tried"
    );
}

#[test]
fn a_llama3_template_gets_llama3_json_calls_and_ipython_results() {
    // The template reads `tools` but writes neither them nor the calls: the server does.
    let s = server_with_template("tools-llama3", "llama3-style.jinja", "");
    // The template names Llama 3's call format, so the server chose it.
    assert!(s.log().contains("llama3_json"), "{}", s.log());
    assert!(s.log().contains("tool_prompt=\"server\""), "{}", s.log());
    let body = ask(json!({"tool_choice": "required", "logprobs": true, "max_tokens": 120}));
    let (v, calls) = calls_only_answer(&s, &body, "llama3_json");
    let choice = &v["choices"][0];
    assert!(!calls.is_empty(), "{v}");
    // What the model wrote, token by token, is Llama 3's format: the calls, as the response
    // gives them, `{"name": ..., "parameters": ...}` separated by "; ".
    let written = written_by_tokens(choice);
    let raw: Vec<String> = choice["message"]["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            format!(
                "{{\"name\": \"{}\", \"parameters\": {}}}",
                c["function"]["name"].as_str().unwrap(),
                c["function"]["arguments"].as_str().unwrap()
            )
        })
        .collect();
    // (The end of sequence has its logprob too.)
    let written = written.strip_suffix("<|im_end|>").unwrap_or(&written);
    assert_eq!(written, raw.join("; "), "{v}");
    let _: CreateChatCompletionResponse = serde_json::from_value(v.clone()).expect("typed");

    // Streamed, the same calls in pieces.
    assert_eq!(streamed_calls(&s, &body).0, calls);

    // A conversation's calls are written in the format, and its results go to the ipython
    // turn.
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temperature\": 18}"},
    ]);
    let (status, v) = s.post_json("/tokenize", &json!({"messages": history}));
    assert_eq!(status, 200, "{v}");
    let (status, text) = s.post_json("/detokenize", &json!({"tokens": v["tokens"]}));
    assert_eq!(status, 200, "{text}");
    let prompt = text["prompt"].as_str().expect("prompt");
    assert!(
        prompt.contains(
            "<|start_header_id|>assistant<|end_header_id|>\n\n{\"name\": \"get_weather\", \
             \"parameters\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}<|eot_id|>\
             <|start_header_id|>ipython<|end_header_id|>\n\n{\"temperature\": 18}<|eot_id|>"
        ),
        "{prompt:?}"
    );
    assert!(!prompt.contains("tool_response"), "{prompt:?}");

    // chat_template_kwargs reach the template, on /tokenize and on chat completions.
    let dated =
        json!({"messages": history, "chat_template_kwargs": {"date_string": "02 Dec 2026"}});
    let (status, v) = s.post_json("/tokenize", &dated);
    assert_eq!(status, 200, "{v}");
    let (_, text) = s.post_json("/detokenize", &json!({"tokens": v["tokens"]}));
    let prompt = text["prompt"].as_str().expect("prompt");
    assert!(
        prompt.contains("Today Date: 02 Dec 2026<|eot_id|>"),
        "{prompt:?}"
    );
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "chat_template_kwargs": {"date_string": "02 Dec 2026"}}),
    );
    assert_eq!(status, 200, "{v}");
    // One token more than without the date: the date's turn is in the prompt.
    let (_, plain) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert!(
        v["usage"]["prompt_tokens"].as_u64() > plain["usage"]["prompt_tokens"].as_u64(),
        "{v} {plain}"
    );
    for bad in [
        json!({"messages": []}),
        json!("date"),
        json!({"bos_token": "x"}),
    ] {
        let (status, v) = s.post_json(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": bad}),
        );
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "chat_template_kwargs", "{v}");
    }
    s.assert_serves();
}

/// The prompt `/tokenize` renders for `request`, as text.
fn rendered(s: &Server, request: &Value) -> String {
    let (status, v) = s.post_json("/tokenize", request);
    assert_eq!(status, 200, "{request}: {v}");
    let (status, text) = s.post_json("/detokenize", &json!({"tokens": v["tokens"]}));
    assert_eq!(status, 200, "{text}");
    text["prompt"].as_str().expect("prompt").to_owned()
}

/// Models' own templates that read `tools` (Qwen3's, Llama 3.1's, Mistral's v3 and v11) get the tools, the
/// conversation's calls (arguments as objects) and its results as Hugging Face's
/// `apply_chat_template` hands them over: the prompts equal Jinja2's renderings
/// (tests/reference/tool_templates.py), and the answers are still held to the format.
#[test]
fn templates_write_tools_calls_and_results_as_transformers_renders_them() {
    let golden: Vec<Value> = serde_json::from_str(
        &std::fs::read_to_string(format!(
            "{}/tests/fixtures/tool_templates_golden.json",
            env!("CARGO_MANIFEST_DIR")
        ))
        .expect("golden file"),
    )
    .expect("golden JSON");
    for (fixture, format) in [
        ("qwen3.jinja", "hermes"),
        ("llama3.1.jinja", "llama3_json"),
        ("mistral-v3.jinja", "mistral"),
        ("mistral-v11.jinja", "mistral_v11"),
    ] {
        let s = server_with_template(&format!("tools-{fixture}"), fixture, "");
        let log = s.log();
        assert!(
            log.contains("tool_prompt=\"template\"") && log.contains(format),
            "{log}"
        );
        let cases: Vec<&Value> = golden.iter().filter(|c| c["template"] == fixture).collect();
        assert!(cases.len() >= 2, "{fixture}");
        for case in cases {
            assert_eq!(
                rendered(&s, &case["request"]),
                case["prompt"].as_str().unwrap(),
                "{}",
                case["name"]
            );
        }
        // Calls asked of the model are held to the format and read back.
        let (status, v) = s.post_json(
            "/v1/chat/completions",
            &ask(json!({"tool_choice": "required", "parallel_tool_calls": false})),
        );
        assert_eq!(status, 200, "{v}");
        let calls = calls_in(&v["choices"][0]["message"], format);
        assert_eq!(calls.len(), 1, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
        // The request's tools are the template's `tools`: not for chat_template_kwargs too.
        let (status, v) = s.post_json(
            "/v1/chat/completions",
            &ask(json!({"chat_template_kwargs": {"tools": []}})),
        );
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], "chat_template_kwargs", "{v}");
        s.assert_serves();
    }
    // What a template refuses is the client's 400, in the template's words: Llama 3.1 takes
    // one call per assistant turn.
    let s = server_with_template("tools-llama3.1-refuses", "llama3.1.jinja", "");
    let two = &golden
        .iter()
        .find(|c| c["name"] == "qwen3 writes a conversation's calls and results")
        .unwrap()["request"];
    let (status, v) = s.post_json("/v1/chat/completions", two);
    assert_eq!(status, 400, "{v}");
    let message = v["error"]["message"].as_str().unwrap_or("");
    assert!(message.contains("only supports single tool-calls"), "{v}");
    // `tool_prompt: server` on the same template: the server's words, not the template's.
    let s = server_with_template(
        "tools-qwen3-server",
        "qwen3.jinja",
        "  tool_prompt: server\n",
    );
    let request = &golden[0]["request"];
    let prompt = rendered(&s, request);
    assert!(
        prompt.contains("<tools>") && !prompt.contains("You may call one or more"),
        "{prompt}"
    );
}

#[test]
fn a_mistral_server_writes_its_calls_in_one_list_after_the_marker() {
    // Mistral's format chosen by configuration (SmolLM2's template is ChatML): the grammar holds
    // the model to it, and calls in the conversation are written as Mistral's templates write
    // them.
    let s = Server::start_full(
        "tools-mistral",
        "  tool_call_format: mistral\n",
        "",
        SCHEDULER,
    );
    assert!(
        s.log()
            .lines()
            .any(|l| l.contains("tool calls") && l.contains("mistral")),
        "{}",
        s.log()
    );
    let body = ask(
        json!({"tool_choice": "required", "parallel_tool_calls": false,
                          "logprobs": true, "max_tokens": 120}),
    );
    let (v, calls) = calls_only_answer(&s, &body, "mistral");
    let choice = &v["choices"][0];
    assert_eq!(calls.len(), 1, "{v}");
    assert_tool_call(&calls[0].0, &calls[0].1, &v);
    let _: CreateChatCompletionResponse = serde_json::from_value(v.clone()).expect("typed");
    // What the model wrote, token by token, is Mistral's format (mistral-common's rendering of a
    // call, without the id the model does not write): the marker, then the list.
    let written = written_by_tokens(choice);
    let call = &choice["message"]["tool_calls"][0]["function"];
    let raw = format!(
        "[TOOL_CALLS] [{{\"name\": \"{}\", \"arguments\": {}}}]",
        call["name"].as_str().unwrap(),
        call["arguments"].as_str().unwrap()
    );
    let written = written.strip_suffix("<|im_end|>").unwrap_or(&written);
    assert_eq!(written, raw, "{v}");

    // Streamed, the same call in pieces, and no content.
    let (whole, finish) = streamed_calls(&s, &body);
    assert_eq!(finish, ["tool_calls"]);
    assert_eq!(whole, calls);

    // Several calls may be made in the one list; each reads back against its tool.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &ask(json!({"tool_choice": "required", "max_tokens": 120})),
    );
    assert_eq!(status, 200, "{v}");
    for (name, args) in calls_in(&v["choices"][0]["message"], "mistral") {
        assert_tool_call(&name, &args, &v);
    }

    // A named function is the one called; the choice finishes with stop.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &ask(json!({"tool_choice": {"type": "function", "function": {"name": "local_time"}}})),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(
        calls_in(&v["choices"][0]["message"], "mistral"),
        [("local_time".to_owned(), json!({}))],
        "{v}"
    );

    // A conversation's calls are written as mistral-common writes them, each with its id (kept
    // when it is one of Mistral's, otherwise made one: the last 9 characters of ours), the
    // turn's text left out.
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "123456789", "type": "function", "function": {"name": "get_weather",
                "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}},
            {"id": "call_0123456789abcdef0123456789abcdef", "type": "function",
                "function": {"name": "local_time", "arguments": "{}"}}]},
    ]);
    let (status, v) = s.post_json("/tokenize", &json!({"messages": history}));
    assert_eq!(status, 200, "{v}");
    let (status, text) = s.post_json("/detokenize", &json!({"tokens": v["tokens"]}));
    assert_eq!(status, 200, "{text}");
    let prompt = text["prompt"].as_str().expect("prompt");
    assert!(
        prompt.contains(
            "<|im_start|>assistant\n[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": \
             {\"city\": \"Paris\", \"unit\": \"celsius\"}, \"id\": \"123456789\"}, {\"name\": \
             \"local_time\", \"arguments\": {}, \"id\": \"789abcdef\"}]<|im_end|>"
        ),
        "{prompt:?}"
    );
    assert!(!prompt.contains("Let me look."), "{prompt:?}");
    s.assert_serves();
}

/// A Mistral v11 template (found by its `[ARGS]`): the model writes each call as
/// `[TOOL_CALLS]name[ARGS]{...}`, held there by the grammar, read back streamed or whole.
#[test]
fn a_mistral_v11_template_gets_each_call_after_the_marker() {
    let s = server_with_template("tools-mistral-v11", "mistral-v11.jinja", "");
    s.assert_logged(&["tool calls", "mistral_v11"]);
    let body = ask(
        json!({"tool_choice": "required", "parallel_tool_calls": false,
                          "logprobs": true, "max_tokens": 120}),
    );
    let (v, calls) = calls_only_answer(&s, &body, "mistral_v11");
    assert_eq!(calls.len(), 1, "{v}");
    assert_tool_call(&calls[0].0, &calls[0].1, &v);
    // What the model wrote, token by token, is the template's form of a call.
    let choice = &v["choices"][0];
    let call = &choice["message"]["tool_calls"][0]["function"];
    let raw = format!(
        "[TOOL_CALLS]{}[ARGS]{}",
        call["name"].as_str().unwrap(),
        call["arguments"].as_str().unwrap()
    );
    let written = written_by_tokens(choice);
    let written = written.strip_suffix("<|im_end|>").unwrap_or(&written);
    assert_eq!(written, raw, "{v}");
    // Streamed, the same call in pieces, and no content.
    let (whole, finish) = streamed_calls(&s, &body);
    assert_eq!(finish, ["tool_calls"]);
    assert_eq!(whole, calls);
    // Several calls, each after its marker; each reads back against its tool.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &ask(json!({"tool_choice": "required", "max_tokens": 160, "logprobs": true})),
    );
    assert_eq!(status, 200, "{v}");
    let calls = calls_in(&v["choices"][0]["message"], "mistral_v11");
    assert!(!calls.is_empty(), "{v}");
    let written = written_by_tokens(&v["choices"][0]);
    assert_eq!(written.matches("[TOOL_CALLS]").count(), calls.len(), "{v}");
    for (name, args) in calls {
        assert_tool_call(&name, &args, &v);
    }
    s.assert_serves();
    drop(s);

    // A template that writes each call's id (as some v11 templates do): the model writes one
    // too, 9 letters and digits after `[CALL_ID]`; the call still gets the server's id.
    let source = std::fs::read_to_string(format!(
        "{}/tests/fixtures/mistral-v11.jinja",
        env!("CARGO_MANIFEST_DIR")
    ))
    .expect("fixture");
    let with_ids = source.replace(
        "tool['function']['name'] + '[ARGS]'",
        "tool['function']['name'] + '[CALL_ID]' + tool['id'] + '[ARGS]'",
    );
    assert_ne!(with_ids, source);
    let dir = common::temp_dir("tools", "mistral-v11-ids");
    let file = dir.join("template.jinja");
    std::fs::write(&file, with_ids).expect("template");
    let s = Server::start_full(
        "tools-mistral-v11-ids",
        &format!("  chat_template: {}\n", file.display()),
        "",
        SCHEDULER,
    );
    assert!(s.log().contains("call_ids=true"), "{}", s.log());
    let (v, calls) = calls_only_answer(&s, &body, "mistral_v11");
    assert_eq!(calls.len(), 1, "{v}");
    let written = written_by_tokens(&v["choices"][0]);
    let id = written
        .split_once("[CALL_ID]")
        .and_then(|(_, rest)| rest.split_once("[ARGS]"))
        .map(|(id, _)| id.to_owned())
        .unwrap_or_default();
    assert!(
        id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()),
        "{written:?}"
    );
    s.assert_serves();
}

/// A template that asks for Mistral's `[THINK]...[/THINK]` (Magistral's): found at start, and
/// the block read apart as `<think>`'s is, streamed or not; `<think>` is then the answer's text.
#[test]
fn mistral_think_tags_are_read_apart_when_the_template_uses_them() {
    let s = server_with_template("reasoning-mistral", "think-mistral.jinja", "");
    s.assert_logged(&["reasoning parser", "[/THINK]"]);
    let body = json!({
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 60, "temperature": 0,
        "structured_outputs": {"regex": "\\[THINK\\][a-z ]{3,30}\\[/THINK\\][A-Z][a-z]{2,12}\\."},
    });
    let (status, v) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().expect("reasoning");
    let content = message["content"].as_str().expect("content");
    assert!(
        reasoning.trim().len() >= 3 && !reasoning.contains('['),
        "{v}"
    );
    assert!(
        content.ends_with('.') && content.starts_with(|c: char| c.is_ascii_uppercase()),
        "{v}"
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (mut r, mut c) = (String::new(), String::new());
    for event in s.post_stream("/v1/chat/completions", &streamed) {
        if event == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&event).expect("a chunk");
        r.push_str(
            chunk["choices"][0]["delta"]["reasoning_content"]
                .as_str()
                .unwrap_or(""),
        );
        c.push_str(
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or(""),
        );
    }
    assert_eq!((r.as_str(), c.as_str()), (reasoning, content));
    // `<think>` is not this model's tag: all content.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 30,
                "temperature": 0,
                "structured_outputs": {"regex": "<think>[a-z ]{3,10}</think>[A-Z][a-z]{2,12}\\."}}),
    );
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{v}");
    assert!(
        message["content"]
            .as_str()
            .is_some_and(|c| c.starts_with("<think>")),
        "{v}"
    );
    s.assert_serves();
}

#[test]
fn reasoning_is_read_apart_when_the_template_thinks() {
    let start = |parser: &str| {
        server_with_template(
            "reasoning",
            "think-style.jinja",
            &format!("  reasoning_parser: {parser}\n"),
        )
    };
    let s = start("auto");
    assert!(s.log().contains("reasoning"), "{}", s.log());
    // A regular expression makes SmolLM2 think first, as Qwen3 does.
    let body = json!({
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 60, "temperature": 0, "logprobs": true,
        "structured_outputs": {"regex": "<think>\n[a-z ]{3,30}\n</think>\n\n[A-Z][a-z]{2,12}\\."},
    });
    let (status, v) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().expect("reasoning");
    let content = message["content"].as_str().expect("content");
    assert!(
        reasoning.starts_with('\n') && reasoning.ends_with('\n') && reasoning.trim().len() >= 3,
        "{v}"
    );
    assert!(
        content.ends_with('.') && content.starts_with(|c: char| c.is_ascii_uppercase()),
        "{v}"
    );
    let tokens = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .len() as u64;
    assert_eq!(
        tokens,
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        "{v}"
    );
    let _: CreateChatCompletionResponse = serde_json::from_value(v.clone()).expect("typed");

    // Streamed: the same reasoning and content in pieces, every token's logprob once.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (mut r, mut c, mut n) = (String::new(), String::new(), 0u64);
    for event in s.post_stream("/v1/chat/completions", &streamed) {
        if event == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(&event).expect("a chunk");
        let choice = &chunk["choices"][0];
        r.push_str(choice["delta"]["reasoning_content"].as_str().unwrap_or(""));
        c.push_str(choice["delta"]["content"].as_str().unwrap_or(""));
        n += choice["logprobs"]["content"]
            .as_array()
            .map_or(0, |a| a.len() as u64);
        let _: CreateChatCompletionStreamResponse =
            serde_json::from_value(chunk.clone()).expect("typed chunk");
    }
    assert_eq!((r.as_str(), c.as_str(), n), (reasoning, content, tokens));

    // An answer that does not open with <think> is all content, and has no reasoning.
    let (_, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "chat_template_kwargs": {"enable_thinking": false}}),
    );
    assert!(
        v["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{v}"
    );
    assert!(v["choices"][0]["message"]["content"].is_string(), "{v}");
    s.assert_serves();

    // Cut short while thinking: reasoning, and no content.
    let mut short = body.clone();
    short["max_tokens"] = json!(3);
    let (_, v) = s.post_json("/v1/chat/completions", &short);
    let message = &v["choices"][0]["message"];
    assert!(message["content"].is_null(), "{v}");
    assert!(message["reasoning_content"].is_string(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    drop(s);

    // A template whose generation prompt opens the block (QwQ, DeepSeek-R1): the output is
    // reasoning up to </think>.
    let s = server_with_template("reasoning-open", "think-open.jinja", "");
    let open = json!({"messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 60, "temperature": 0,
        "structured_outputs": {"regex": "[a-z ]{3,30}\n</think>\n\n[A-Z][a-z]{2,12}\\."}});
    let (status, v) = s.post_json("/v1/chat/completions", &open);
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().expect("reasoning");
    let content = message["content"].as_str().expect("content");
    assert!(
        reasoning.ends_with('\n') && reasoning.trim().len() >= 3,
        "{v}"
    );
    assert!(!content.contains("think") && content.ends_with('.'), "{v}");
    // With vLLM's prompt_logprobs the prompt's event waits for them: it still says that the
    // prompt opened the block, and the answer reads the same.
    let mut scored = open.clone();
    scored["prompt_logprobs"] = json!(0);
    let (status, w) = s.post_json("/v1/chat/completions", &scored);
    assert_eq!(status, 200, "{w}");
    assert_eq!(
        w["choices"][0]["message"], v["choices"][0]["message"],
        "{w}"
    );
    assert!(
        w["prompt_logprobs"]
            .as_array()
            .is_some_and(|l| l[0].is_null() && l.len() > 1),
        "{w}"
    );
    // Per request: with thinking switched off by the template's variable (DeepSeek-V3.1's
    // `thinking`), the prompt closes the block and the output is all content.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8,
                "temperature": 0, "chat_template_kwargs": {"thinking": false}}),
    );
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{v}");
    assert!(message["content"].is_string(), "{v}");
    // A schema holds the answer from its first token: no room to think, all of it content.
    let (status, v) = s.post_json(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Describe a cat."}], "max_tokens": 40,
                "temperature": 0, "response_format": {"type": "json_object"}}),
    );
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{v}");
    assert!(
        message["content"]
            .as_str()
            .is_some_and(|t| t.starts_with('{')),
        "{v}"
    );
    drop(s);

    // With the parser off, the block stays in the content.
    let s = start("none");
    let (status, v) = s.post_json("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(message.get("reasoning_content").is_none(), "{v}");
    assert!(
        message["content"]
            .as_str()
            .is_some_and(|t| t.starts_with("<think>\n")),
        "{v}"
    );
}
