//! What reading a request body through `ObjectsOnly` costs: a chat body of 100 messages
//! (about 40 kB: text and content-part messages, tools, `stream_options`, `response_format`)
//! parsed as `body::parse_json` parses it, with serde_path_to_error alone (as before the
//! wrapper) and with the wrapper under it (as now). Both read the same `ChatRequest`, whose
//! buffered fields (`ContentField::Parts`, the flattened fields) read through `objects_only`
//! either way.
//!
//! `cargo bench -p switchyard-api --bench body_parse`
//!
//! Measured when the wrapper came (2026-12-07, a 41,158-byte body, two CPU cores shared with
//! other builds, load about 7): callgrind counts 832,237 instructions a parse without the
//! wrapper and 839,756 with it (+0.9%); wall times (120 to 180 µs a parse either way) moved
//! more with the machine's load than between the two.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use serde_json::json;
use switchyard_api::objects_only::ObjectsOnly;
use switchyard_api::schema::ChatRequest;

/// A chat body of `n` messages, every fourth with content parts.
fn chat_body(n: usize) -> Vec<u8> {
    let text = "The quick brown fox jumps over the lazy dog, then asks for the weather. ".repeat(5);
    let messages: Vec<_> = (0..n)
        .map(|i| match i % 4 {
            0 => json!({"role": "user", "content": [
                {"type": "text", "text": text}, {"type": "text", "text": "and?"}]}),
            1 | 3 => json!({"role": "assistant", "content": text}),
            _ => json!({"role": "user", "content": text, "name": "ann"}),
        })
        .collect();
    let body = json!({
        "model": "m",
        "messages": messages,
        "max_tokens": 64,
        "temperature": 0.7,
        "stream": true,
        "stream_options": {"include_usage": true},
        "stop": ["\n\n", "END"],
        "tools": [{"type": "function", "function": {"name": "weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}],
        "response_format": {"type": "json_object"},
    });
    body.to_string().into_bytes()
}

fn parse(c: &mut Criterion) {
    let body = chat_body(100);
    let mut group = c.benchmark_group("parse_chat_body_100_messages");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("serde_path_to_error", |b| {
        b.iter(|| {
            let mut de = serde_json::Deserializer::from_slice(&body);
            let r: ChatRequest = serde_path_to_error::deserialize(&mut de).expect("parses");
            de.end().expect("ends");
            r
        })
    });
    group.bench_function("serde_path_to_error_objects_only", |b| {
        b.iter(|| {
            let mut de = serde_json::Deserializer::from_slice(&body);
            let r: ChatRequest =
                serde_path_to_error::deserialize(ObjectsOnly(&mut de)).expect("parses");
            de.end().expect("ends");
            r
        })
    });
    group.finish();
}

criterion_group!(benches, parse);
criterion_main!(benches);
