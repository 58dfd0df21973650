//! What structured output costs per token on the host: computing a sequence's allowed set
//! (llguidance's token mask) and committing the sampled token, along a fixed path through a
//! JSON schema, a regex and a JSON object, with SmolLM2's tokenizer (49,152 tokens). Also
//! the one-time compile of a request's schema.
//!
//! `cargo bench -p switchyard-actors --bench structured` (needs `switchyard model fetch
//! smollm2-135m`).

use std::sync::Arc;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use serde_json::json;
use switchyard_actors::structured::{GrammarCompiler, StructuredOutput};
use switchyard_gpu::constraint::is_allowed;
use switchyard_gpu::model::{default_model_path, load_model, Tokenizer};

fn tokenizer() -> Arc<Tokenizer> {
    let path = default_model_path("smollm2-135m");
    Arc::new(
        load_model(&path, &switchyard_gpu::progress::NoProgress)
            .expect("SmolLM2 (switchyard model fetch smollm2-135m)")
            .tokenizer,
    )
}

/// The tokens of `text` as the tokenizer encodes it, checked to be allowed by a fresh
/// constraint of `spec` one after another.
fn path(c: &GrammarCompiler, tok: &Tokenizer, spec: &StructuredOutput, text: &str) -> Vec<u32> {
    let ids = tok.encode(text, false).expect("encode");
    let end = tok.eos_token_ids()[0];
    let k = c.compile(spec, &[end], 1).expect("compiles").remove(0);
    for &t in &ids {
        assert!(
            is_allowed(&k.allowed(tok.vocab_size()), t as usize),
            "{text:?}: {t} not allowed"
        );
        k.commit(t);
    }
    ids
}

fn bench(cr: &mut Criterion) {
    let tok = tokenizer();
    let compiler = GrammarCompiler::new(tok.clone()).expect("compiler");
    let end = tok.eos_token_ids()[0];
    let vocab = tok.vocab_size();
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "population_millions": {"type": "number"},
            "landmarks": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["city", "population_millions", "landmarks"],
        "additionalProperties": false
    });
    let cases = [
        (
            "json_schema",
            StructuredOutput::JsonSchema(schema.clone()),
            r#"{"city": "Paris", "population_millions": 2.1, "landmarks": ["Eiffel Tower", "Louvre", "Notre-Dame"]}"#,
        ),
        (
            "json_object",
            StructuredOutput::JsonObject,
            r#"{"name": "Ada", "tags": ["math", "engines"], "year": 1843, "nested": {"ok": true}}"#,
        ),
        (
            "regex",
            StructuredOutput::Regex(r"[A-Z][a-z]+ [0-9]{3}-[0-9]{4}( ext\. [0-9]+)?".into()),
            "Office 555-0123 ext. 42",
        ),
    ];
    let mut g = cr.benchmark_group("structured");
    for (name, spec, text) in &cases {
        let ids = path(&compiler, &tok, spec, text);
        // Per token: the mask and the commit, averaged over the whole path; then the commits
        // alone (what a backend does for the token it read back).
        for (what, masks) in [("per_token", true), ("commit_only", false)] {
            g.bench_function(format!("{name}_{what}_{}_tokens", ids.len()), |b| {
                b.iter_batched(
                    || {
                        compiler
                            .compile(spec, &[end], 1)
                            .expect("compiles")
                            .remove(0)
                    },
                    |k| {
                        for &t in &ids {
                            if masks {
                                std::hint::black_box(k.allowed(vocab));
                            }
                            k.commit(t);
                        }
                    },
                    BatchSize::SmallInput,
                )
            });
        }
    }
    g.bench_function("compile_json_schema", |b| {
        let spec = StructuredOutput::JsonSchema(schema.clone());
        b.iter(|| compiler.compile(&spec, &[end], 1).expect("compiles"))
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
