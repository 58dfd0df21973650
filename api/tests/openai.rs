//! Completions and chat completions over the in-process app, checked against the echo engine's
//! documented behaviour (tests/common) and deserialized into async-openai's types to show wire
//! compatibility.

mod common;

use async_openai::types::chat::{
    CompletionFinishReason, CreateChatCompletionResponse, CreateChatCompletionStreamResponse,
    FinishReason, Role,
};
use async_openai::types::completions::CreateCompletionResponse;
use async_openai::types::models::ListModelResponse;
use common::*;
use serde_json::{json, Value};
use std::sync::Arc;
use switchyard_api::engine::{ChatEnding, PromptInput};

#[actix_web::test]
async fn completion_repeats_the_prompt_up_to_max_tokens() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "abc", "max_tokens": 5}),
        ),
    )
    .await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let response: CreateCompletionResponse = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(response.object, "text_completion");
    assert_eq!(response.model, MODEL);
    assert!(response.id.starts_with("cmpl-"));
    assert_eq!(response.choices.len(), 1);
    assert_eq!(response.choices[0].text, "abcab");
    assert_eq!(
        response.choices[0].finish_reason,
        Some(CompletionFinishReason::Length)
    );
    assert!(response.choices[0].logprobs.is_none());
    let usage = response.usage.unwrap();
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (3, 5, 8)
    );
}

#[actix_web::test]
async fn completion_without_max_tokens_stops_at_sixteen_tokens() {
    // OpenAI's legacy completions and vLLM default max_tokens to 16 on /v1/completions.
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let reply = send(&app, post("/v1/completions", &json!({"prompt": "abc"}))).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let response: CreateCompletionResponse = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(response.choices[0].text, "abcabcabcabcabca");
    assert_eq!(
        response.choices[0].finish_reason,
        Some(CompletionFinishReason::Length)
    );
    assert_eq!(response.usage.unwrap().completion_tokens, 16);
    assert_eq!(engine.last_request().max_tokens, Some(16));
    // Chat keeps generating up to the context window.
    let body = json!({"messages": [{"role": "user", "content": "hi"}]});
    let reply = send(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert_eq!(engine.last_request().max_tokens, None);
    // "user: hi\nassistant:" is 19 tokens of the 64.
    assert_eq!(reply.json()["usage"]["completion_tokens"], 45);
}

#[actix_web::test]
async fn completion_fields_reach_the_engine() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let body = json!({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.5, "top_p": 0.9,
        "top_k": 40, "min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": -0.5,
        "repetition_penalty": 1.1, "seed": -1, "logit_bias": {"7": -100, "3": 5},
        "stop_token_ids": [9], "min_tokens": 1, "ignore_eos": true, "priority": -3,
        "user": "u-42", "stop": "zz"});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let request = engine.last_request();
    assert_eq!(
        request.prompt,
        switchyard_api::engine::PromptInput::Tokens(vec![1, 2, 3])
    );
    let s = &request.sampling;
    assert_eq!(
        (s.temperature, s.top_p, s.top_k, s.min_p),
        (0.5, 0.9, 40, 0.05)
    );
    assert_eq!(
        (
            s.presence_penalty,
            s.frequency_penalty,
            s.repetition_penalty
        ),
        (0.5, -0.5, 1.1)
    );
    assert_eq!(s.seed, Some(u64::MAX));
    assert_eq!(s.logit_bias, vec![(3, 5.0), (7, -100.0)]);
    assert_eq!(s.stop_token_ids, vec![9]);
    assert_eq!((s.min_tokens, s.ignore_eos), (1, true));
    assert_eq!(request.stop, vec!["zz".to_owned()]);
    assert_eq!((request.priority, request.max_tokens), (Some(-3), Some(2)));
    assert_eq!(
        (request.tenant.as_str(), request.tier.as_str()),
        ("acme", "premium")
    );
}

#[actix_web::test]
async fn several_prompts_and_n_number_choices_prompt_major() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": ["ab", "xyz"], "n": 2, "max_tokens": 3}),
        ),
    )
    .await;
    let response: CreateCompletionResponse = serde_json::from_slice(&reply.body).unwrap();
    let texts: Vec<(u32, &str)> = response
        .choices
        .iter()
        .map(|c| (c.index, c.text.as_str()))
        .collect();
    assert_eq!(texts, vec![(0, "aba"), (1, "bab"), (2, "xyz"), (3, "yzx")]);
    let usage = response.usage.unwrap();
    assert_eq!((usage.prompt_tokens, usage.completion_tokens), (5, 12));
}

#[actix_web::test]
async fn stop_strings_end_a_choice_with_reason_stop() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": "abc", "max_tokens": 5, "stop": ["ca"], "n": 2}),
        ),
    )
    .await;
    let response: CreateCompletionResponse = serde_json::from_slice(&reply.body).unwrap();
    // Choice 0 would be "abcab" and stops before "ca"; choice 1 is "bcabc" and stops at "b".
    assert_eq!(response.choices[0].text, "ab");
    assert_eq!(response.choices[1].text, "b");
    assert!(response
        .choices
        .iter()
        .all(|c| c.finish_reason == Some(CompletionFinishReason::Stop)));
    assert_eq!(response.usage.unwrap().completion_tokens, 3);
}

#[actix_web::test]
async fn echo_with_logprobs_includes_the_prompt() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": "abc", "max_tokens": 2, "echo": true, "logprobs": 1}),
        ),
    )
    .await;
    let response: CreateCompletionResponse = serde_json::from_slice(&reply.body).unwrap();
    let choice = &response.choices[0];
    assert_eq!(choice.text, "abcab");
    let lp = choice.logprobs.as_ref().unwrap();
    assert_eq!(lp.tokens, ["a", "b", "c", "a", "b"]);
    assert_eq!(
        lp.token_logprobs,
        [None, Some(-1.0), Some(-1.0), Some(-0.5), Some(-0.5)]
    );
    assert_eq!(lp.text_offset, [0, 1, 2, 3, 4]);
    assert_eq!(lp.top_logprobs[0], serde_json::Value::Null);
    assert_eq!(lp.top_logprobs[3], json!({"a": -0.5}));
}

#[actix_web::test]
async fn token_prompts_are_echoed_through_detokenize() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": [104, 105], "max_tokens": 1, "echo": true}),
        ),
    )
    .await;
    assert_eq!(reply.json()["choices"][0]["text"], "hih");
}

#[actix_web::test]
async fn completion_stream_is_framed_exactly() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let request = post("/v1/completions", &json!({"prompt": "ab", "max_tokens": 3, "stream": true, "stream_options": {"include_usage": true}}))
        .insert_header(("x-request-id", "t1"));
    let reply = send(&app, request).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.headers.get("content-type").unwrap(),
        "text/event-stream"
    );
    let payloads = sse_payloads(reply.text());
    let created = serde_json::from_str::<serde_json::Value>(payloads[0]).unwrap()["created"]
        .as_u64()
        .unwrap();
    let chunk = |text: &str, finish: &str| {
        format!(
            r#"data: {{"id":"cmpl-t1","object":"text_completion","created":{created},"model":"echo-1","choices":[{{"index":0,"text":"{text}","logprobs":null,"finish_reason":{finish}}}],"usage":null}}"#
        ) + "\n\n"
    };
    let expected = [
        chunk("a", "null"),
        chunk("b", "null"),
        chunk("a", "\"length\""),
        format!(r#"data: {{"id":"cmpl-t1","object":"text_completion","created":{created},"model":"echo-1","choices":[],"usage":{{"prompt_tokens":2,"completion_tokens":3,"total_tokens":5,"prompt_tokens_details":{{"cached_tokens":0}}}}}}"#) + "\n\n",
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    assert_eq!(reply.text(), expected);
    for payload in &payloads[..payloads.len() - 1] {
        let _: CreateCompletionResponse = serde_json::from_str(payload).unwrap();
    }
}

#[actix_web::test]
async fn completion_stream_without_include_usage_has_no_usage_field() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": "ab", "max_tokens": 2, "n": 2, "stream": true}),
        ),
    )
    .await;
    let payloads = sse_payloads(reply.text());
    // Two choices × two tokens, then [DONE].
    assert_eq!(payloads.len(), 5);
    let mut texts = [String::new(), String::new()];
    for payload in &payloads[..4] {
        let chunk: serde_json::Value = serde_json::from_str(payload).unwrap();
        assert!(chunk.get("usage").is_none());
        let index = chunk["choices"][0]["index"].as_u64().unwrap() as usize;
        texts[index].push_str(chunk["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(texts, ["ab", "ba"]);
}

#[actix_web::test]
async fn chat_completion_answers_as_assistant() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let body = json!({"model": MODEL, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 6, "logprobs": true, "top_logprobs": 2});
    let reply = send(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let response: CreateChatCompletionResponse = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(response.object, "chat.completion");
    assert!(response.id.starts_with("chatcmpl-"));
    let choice = &response.choices[0];
    assert_eq!(choice.message.role, Role::Assistant);
    // The rendered prompt is "system: be brief\nuser: hi\nassistant:" (36 tokens).
    assert_eq!(choice.message.content.as_deref(), Some("system"));
    assert_eq!(choice.finish_reason, Some(FinishReason::Length));
    let logprobs = choice.logprobs.as_ref().unwrap().content.as_ref().unwrap();
    assert_eq!(logprobs.len(), 6);
    assert_eq!(logprobs[0].token, "s");
    assert_eq!(logprobs[0].bytes.as_deref(), Some(&b"s"[..]));
    assert_eq!(logprobs[0].top_logprobs.len(), 2);
    assert_eq!(logprobs[0].top_logprobs[1].token, "~");
    let usage = response.usage.unwrap();
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (36, 6, 42)
    );
}

#[actix_web::test]
async fn chat_stream_is_framed_exactly() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let body =
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true});
    let reply = send(
        &app,
        post("/v1/chat/completions", &body).insert_header(("x-request-id", "c7")),
    )
    .await;
    let payloads = sse_payloads(reply.text());
    let created = serde_json::from_str::<serde_json::Value>(payloads[0]).unwrap()["created"]
        .as_u64()
        .unwrap();
    let head = format!(
        r#"data: {{"id":"chatcmpl-c7","object":"chat.completion.chunk","created":{created},"model":"echo-1","choices":[{{"index":0,"delta":"#
    );
    let expected = [
        format!("{head}{{\"role\":\"assistant\",\"content\":\"\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"),
        format!("{head}{{\"content\":\"u\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"),
        format!("{head}{{\"content\":\"s\"}},\"logprobs\":null,\"finish_reason\":\"length\"}}]}}\n\n"),
        "data: [DONE]\n\n".to_owned(),
    ]
    .concat();
    assert_eq!(reply.text(), expected);
    for payload in &payloads[..payloads.len() - 1] {
        let chunk: CreateChatCompletionStreamResponse = serde_json::from_str(payload).unwrap();
        assert_eq!(chunk.object, "chat.completion.chunk");
    }
}

#[actix_web::test]
async fn chat_stream_usage_chunk_comes_last_with_empty_choices() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": 3, "stream": true,
        "stream_options": {"include_usage": true}});
    let reply = send(&app, post("/v1/chat/completions", &body)).await;
    let payloads = sse_payloads(reply.text());
    let chunks: Vec<CreateChatCompletionStreamResponse> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str(p).unwrap())
        .collect();
    let (last, rest) = chunks.split_last().unwrap();
    assert!(last.choices.is_empty());
    let usage = last.usage.as_ref().unwrap();
    // "user: hi\nassistant:" is 19 tokens, counted once; three choices of three tokens.
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (19, 9, 28)
    );
    assert!(rest.iter().all(|c| c.usage.is_none()));
    let mut texts = vec![String::new(); 3];
    let mut finished = 0;
    for chunk in rest {
        let choice = &chunk.choices[0];
        texts[choice.index as usize].push_str(choice.delta.content.as_deref().unwrap_or(""));
        finished += usize::from(choice.finish_reason.is_some());
    }
    assert_eq!(texts, ["use", "ser", "er:"]);
    assert_eq!(finished, 3);
}

#[actix_web::test]
async fn models_lists_the_served_model() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let request = actix_web::test::TestRequest::get()
        .uri("/v1/models")
        .insert_header(("authorization", format!("Bearer {KEY}")));
    let reply = send(&app, request).await;
    let list: ListModelResponse = serde_json::from_slice(&reply.body).unwrap();
    assert_eq!(list.object, "list");
    assert_eq!(list.data.len(), 1);
    assert_eq!(list.data[0].id, MODEL);
    assert_eq!(reply.json()["data"][0]["max_model_len"], 64);
}

#[actix_web::test]
async fn tokenize_and_detokenize_round_trip() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let reply = send(&app, post("/tokenize", &json!({"prompt": "hey"}))).await;
    assert_eq!(
        reply.json(),
        json!({"count": 3, "max_model_len": 64, "tokens": [104, 101, 121]})
    );
    let reply = send(&app, post("/tokenize", &json!({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": false}))).await;
    assert_eq!(reply.json()["count"], 8);
    let reply = send(
        &app,
        post("/detokenize", &json!({"tokens": [104, 101, 121]})),
    )
    .await;
    assert_eq!(reply.json(), json!({"prompt": "hey"}));
}

/// `continue_final_message` and `add_generation_prompt` reach the engine as the prompt's
/// ending, on chat completions and on /tokenize; both true is a 400.
#[actix_web::test]
async fn a_chat_prompt_ends_as_the_request_says() {
    let engine = EchoEngine::new();
    let (_, app) = app(engine.clone(), api_config()).await;
    let messages =
        json!([{"role": "user", "content": "x"}, {"role": "assistant", "content": "ab"}]);
    // "user: x\nassistant: ab" is 21 bytes: open, closed (+ "\n") and with a new turn.
    for (extra, count, ending) in [
        (
            json!({"continue_final_message": true}),
            21,
            ChatEnding::ContinueFinal,
        ),
        (
            json!({"add_generation_prompt": false}),
            22,
            ChatEnding::Closed,
        ),
        (json!({}), 32, ChatEnding::GenerationPrompt),
    ] {
        let mut body = json!({"messages": messages});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        let reply = send(&app, post("/tokenize", &body)).await;
        assert_eq!(reply.json()["count"], count, "{extra}");
        body["max_tokens"] = json!(1);
        let reply = send(&app, post("/v1/chat/completions", &body)).await;
        assert_eq!(reply.status, 200, "{}", reply.text());
        match engine.last_request().prompt {
            PromptInput::Chat { ending: sent, .. } => assert_eq!(sent, ending, "{extra}"),
            other => panic!("{other:?}"),
        }
    }
    let both = json!({"messages": messages, "continue_final_message": true,
        "add_generation_prompt": true});
    for path in ["/tokenize", "/v1/chat/completions"] {
        send(&app, post(path, &both)).await.assert_error(
            400,
            "invalid_request_error",
            Some("continue_final_message"),
        );
    }
}

#[actix_web::test]
async fn completion_stream_with_echo_opens_with_the_prompt() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let body = json!({"prompt": "xy", "max_tokens": 1, "echo": true, "stream": true});
    let reply = send(&app, post("/v1/completions", &body)).await;
    let payloads = sse_payloads(reply.text());
    let texts: Vec<Value> = payloads[..payloads.len() - 1]
        .iter()
        .map(|p| serde_json::from_str::<Value>(p).unwrap()["choices"][0]["text"].clone())
        .collect();
    assert_eq!(texts, [json!("xy"), json!("x")]);
}

#[actix_web::test]
async fn tokenize_needs_exactly_one_input() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let body = json!({"prompt": "a", "messages": [{"role": "user", "content": "b"}]});
    send(&app, post("/tokenize", &body)).await.assert_error(
        400,
        "invalid_request_error",
        Some("prompt"),
    );
    send(&app, post("/detokenize", &json!({"tokens": [300]})))
        .await
        .assert_error(400, "invalid_request_error", Some("tokens"));
}

#[actix_web::test]
async fn logprobs_of_a_large_non_streaming_answer_are_refused_before_the_engine() {
    let mut engine = EchoEngine::new();
    Arc::get_mut(&mut engine).unwrap().max_model_len = 8192;
    let (_, app) = app(engine.clone(), api_config()).await;
    let user = json!([{"role": "user", "content": "x"}]);
    // 16 choices to the context (8191 tokens) × 21 entries.
    let body = json!({"messages": user, "n": 16, "logprobs": true, "top_logprobs": 20});
    let error = send(&app, post("/v1/chat/completions", &body))
        .await
        .assert_error(400, "invalid_request_error", Some("logprobs"));
    assert!(
        error["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("stream")),
        "{error}"
    );
    let body = json!({"prompt": ["a", "b", "c", "d"], "n": 16, "max_tokens": 8191,
        "logprobs": 20});
    send(&app, post("/v1/completions", &body))
        .await
        .assert_error(400, "invalid_request_error", Some("logprobs"));
    assert!(engine.submitted.lock().unwrap().is_empty());
    // One choice with every alternative is served.
    let body = json!({"messages": user, "logprobs": true, "top_logprobs": 20, "max_tokens": 3});
    let reply = send(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
}

#[actix_web::test]
async fn developer_messages_reach_the_template_as_system_messages() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let messages = |role: &str| {
        json!([{"role": role, "content": "Be brief."},
        {"role": "user", "content": "x"}])
    };
    let tokens = |reply: Reply| reply.json()["tokens"].clone();
    let developer = tokens(
        send(
            &app,
            post("/tokenize", &json!({"messages": messages("developer")})),
        )
        .await,
    );
    let system = tokens(
        send(
            &app,
            post("/tokenize", &json!({"messages": messages("system")})),
        )
        .await,
    );
    assert!(developer.as_array().is_some_and(|t| !t.is_empty()));
    assert_eq!(developer, system);
}

/// vLLM's `prompt_logprobs`: on completions each choice carries its own prompt's list (every
/// one of its `n`), on chat the response carries the prompt's once, at its top level; absent
/// when not asked.
#[actix_web::test]
async fn prompt_logprobs_go_where_vllm_puts_them() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    // The echo engine's tokens are the prompt's bytes; its logprobs stand-ins.
    let entry =
        |id: u8| json!({"logprob": -1.0, "rank": 2, "decoded_token": char::from(id).to_string()});
    let body = json!({"prompt": ["ab", "cd"], "n": 2, "max_tokens": 1, "prompt_logprobs": 0});
    let reply = send(&app, post("/v1/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let choices = reply.json()["choices"].clone();
    for (i, want) in [(0, b'b'), (1, b'b'), (2, b'd'), (3, b'd')] {
        assert_eq!(
            choices[i]["prompt_logprobs"],
            json!([null, {want.to_string(): entry(want)}]),
            "choice {i}"
        );
    }
    let reply = send(&app, post("/v1/completions", &json!({"prompt": "ab"}))).await;
    assert!(reply.json()["choices"][0].get("prompt_logprobs").is_none());
    let body = json!({"messages": [{"role": "user", "content": "x"}], "n": 2,
        "max_tokens": 1, "prompt_logprobs": 0});
    let reply = send(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    let json = reply.json();
    let list = json["prompt_logprobs"].as_array().unwrap();
    assert!(list[0].is_null() && list.len() > 1, "{json}");
    for choice in json["choices"].as_array().unwrap() {
        assert!(choice.get("prompt_logprobs").is_none(), "{json}");
    }
}

#[actix_web::test]
async fn fields_the_server_cannot_honour_are_refused_by_name() {
    let (_, app) = app(EchoEngine::new(), api_config()).await;
    let user = json!([{"role": "user", "content": "x"}]);
    // vLLM's -1 (the whole vocabulary) is beyond prompt_logprobs' bound.
    for (field, value) in [("echo", json!(true)), ("prompt_logprobs", json!(-1))] {
        let body = json!({"messages": user, field: value});
        send(&app, post("/v1/chat/completions", &body))
            .await
            .assert_error(400, "invalid_request_error", Some(field));
    }
    send(
        &app,
        post(
            "/v1/completions",
            &json!({"prompt": "x", "prompt_logprobs": -1}),
        ),
    )
    .await
    .assert_error(400, "invalid_request_error", Some("prompt_logprobs"));
    // top_logprobs 0 asks for no alternatives: accepted without logprobs, as vLLM does.
    let body = json!({"messages": user, "top_logprobs": 0, "max_tokens": 2,
        "add_generation_prompt": true, "continue_final_message": false});
    let reply = send(&app, post("/v1/chat/completions", &body)).await;
    assert_eq!(reply.status, 200, "{}", reply.text());
    assert!(
        reply.json()["choices"][0]["logprobs"].is_null(),
        "{}",
        reply.text()
    );
}
