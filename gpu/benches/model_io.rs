//! Benchmarks of the model-file side: opening the SmolLM2 GGUF (header parse, config,
//! tokenizer build, shape validation), tokenizing and detokenizing text, rendering the chat
//! template. Needs `switchyard model fetch smollm2-135m`.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use switchyard_gpu::model::{default_model_path, load_model, ChatMessage};

fn bench(c: &mut Criterion) {
    let path = default_model_path("smollm2-135m");
    assert!(
        path.is_file(),
        "model file {} is missing: run `switchyard model fetch smollm2-135m`",
        path.display()
    );
    c.bench_function("load_model smollm2 gguf", |b| {
        b.iter(|| {
            load_model(black_box(&path), &switchyard_gpu::progress::NoProgress).expect("loads")
        })
    });
    let m = load_model(&path, &switchyard_gpu::progress::NoProgress).expect("loads");
    let text = "The quick brown fox jumps over the lazy dog. 12345 apples, 678 pears!\n".repeat(64);
    let ids = m.tokenizer.encode(&text, false).expect("encodes");
    let mut g = c.benchmark_group("tokenizer");
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("encode 4.5 KB", |b| {
        b.iter(|| {
            m.tokenizer
                .encode(black_box(&text), false)
                .expect("encodes")
        })
    });
    g.bench_function("decode 4.5 KB", |b| {
        b.iter(|| m.tokenizer.decode(black_box(&ids), true).expect("decodes"))
    });
    g.finish();
    let tmpl = m.chat_template.as_ref().expect("template");
    let msgs = vec![
        ChatMessage::new("user", "Hi! Who are you?"),
        ChatMessage::new("assistant", "I am SmolLM."),
        ChatMessage::new("user", "What is 12 times 7?"),
    ];
    c.bench_function("chat template render 3 messages", |b| {
        b.iter(|| tmpl.render(black_box(&msgs), true).expect("renders"))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
