//! Tokenization and chat-template goldens for SmolLM2-135M-Instruct: every case of
//! `tests/fixtures/smollm2_golden.json`, made by Hugging Face transformers from the same GGUF
//! file (see `gpu/reference/make_golden.py`), must be reproduced exactly.

use std::path::PathBuf;

use serde::Deserialize;
use switchyard_gpu::model::{default_model_path, load_model, ChatMessage, LoadedModel};

#[derive(Deserialize)]
struct Golden {
    model_sha256: String,
    tokenization: Vec<TokenizationCase>,
    chat: Vec<ChatCase>,
}

#[derive(Deserialize)]
struct TokenizationCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    rendered: String,
    ids: Vec<u32>,
}

fn golden() -> Golden {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_golden.json");
    let text = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("cannot read golden fixture {}: {e}", p.display()));
    serde_json::from_str(&text).expect("golden fixture is valid JSON")
}

fn model_path() -> PathBuf {
    let p = default_model_path("smollm2-135m");
    assert!(
        p.is_file(),
        "model file {} is missing: run `switchyard model fetch smollm2-135m`",
        p.display()
    );
    p
}

fn model() -> LoadedModel {
    load_model(&model_path(), &switchyard_gpu::progress::NoProgress).expect("SmolLM2 loads")
}

#[test]
fn fixture_is_for_the_fetched_model() {
    assert_eq!(
        golden().model_sha256,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    );
}

#[test]
fn tokenization_matches_reference() {
    let (g, m) = (golden(), model());
    assert!(!g.tokenization.is_empty());
    let mut failures = Vec::new();
    for case in &g.tokenization {
        let ids = m.tokenizer.encode(&case.text, false).expect("encode");
        if ids != case.ids {
            failures.push(format!("{:?}: got {ids:?}, want {:?}", case.text, case.ids));
        }
        if m.tokenizer.decode(&ids, false).expect("decode") != case.text {
            failures.push(format!("{:?}: does not round-trip", case.text));
        }
        // Byte-level BPE is lossless: the raw token bytes give the text back.
        let bytes: Vec<u8> = case
            .ids
            .iter()
            .flat_map(|&i| m.tokenizer.token_bytes(i).expect("id in vocab").to_vec())
            .collect();
        if bytes != case.text.as_bytes() {
            failures.push(format!("{:?}: token bytes do not round-trip", case.text));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn chat_template_matches_reference() {
    let (g, m) = (golden(), model());
    let tmpl = m
        .chat_template
        .as_ref()
        .expect("SmolLM2 ships a chat template");
    assert!(!g.chat.is_empty());
    for case in &g.chat {
        let rendered = tmpl
            .render(&case.messages, case.add_generation_prompt)
            .expect("render");
        assert_eq!(rendered, case.rendered, "messages {:?}", case.messages);
        let ids = m.tokenizer.encode(&rendered, false).expect("encode");
        assert_eq!(ids, case.ids, "ids of {rendered:?}");
    }
}
