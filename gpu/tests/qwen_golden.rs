//! The Qwen2 and Qwen3 architectures against Hugging Face transformers: a tiny random model of
//! each (`gpu/reference/make_qwen_golden.py --arch qwen2|qwen3` made it and the reference),
//! loaded from its Hugging Face checkpoint directory and from the GGUF file llama.cpp's converter
//! would write, must give transformers' float32 logits at every position (one prefill, or a
//! prefill then one token at a time), and its tokenizers transformers' tokenizer's ids (NFC,
//! then Qwen2's split, which Qwen3 shares). A third model, Qwen2 with YaRN RoPE scaling
//! (`--rope yarn`: factor 4 over an original context of 16, the sequence running past it), checks
//! the scaled frequencies and YaRN's attention factor the same way; a fourth, Phi-3 (`--arch
//! phi3`: fused projections, LongRoPE over an original context of 16 stretched to 64), its
//! loader's splitting of the fused matrices and both of LongRoPE's factor lists; a fifth, that
//! Phi-3 with a sliding window of 7 (`--window 7`), sliding-window attention; a sixth, Phi-3
//! rotating half of each head (`--partial 0.5`), partial rotary embeddings.

use std::path::PathBuf;

use serde_json::Value;
use switchyard_gpu::cpu::attention::QueryPos;
use switchyard_gpu::cpu::kv_cache::KvCache;
use switchyard_gpu::cpu::llama::{ActivationPrecision, LlamaModel, StepInput};
use switchyard_gpu::model::{
    load_model, LlamaConfig, LoadedModel, LongRopeScaling, ModelWeights, RopeScaling, RopeStyle,
};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The reference of the model `tag` (`qwen2`, `qwen3`, `qwen2-yarn`).
fn golden(tag: &str) -> Value {
    let path = fixtures().join(format!("{tag}_golden.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (made by gpu/reference/make_qwen_golden.py)",
            path.display()
        )
    });
    serde_json::from_str(&text).expect("the fixture is JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id array")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

fn load(name: &str) -> LoadedModel {
    load_model(
        &fixtures().join(name),
        &switchyard_gpu::progress::NoProgress,
    )
    .expect("the model loads")
}

/// Logits of `tokens` fed in chunks of `chunks` tokens (one step each), every position's row.
fn logits(model: &LlamaModel, tokens: &[u32], chunks: &[usize]) -> Vec<Vec<f32>> {
    let c = &model.config;
    let block = 4;
    let blocks = tokens.len().div_ceil(block);
    let mut cache =
        KvCache::new(c.num_layers, blocks, block, c.num_kv_heads, c.head_dim).expect("cache");
    // Blocks in reverse order: the table, not the layout, says where each token is.
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let mut out = Vec::new();
    let mut start = 0;
    for &n in chunks {
        let queries: Vec<QueryPos> = (start..start + n)
            .map(|pos| QueryPos { pos, seq: 0 })
            .collect();
        let rows: Vec<usize> = (0..n).collect();
        let step = StepInput {
            tokens: &tokens[start..start + n],
            queries: &queries,
            tables: &[&table],
            adapters: &[None],
        };
        let l = model.forward(&mut cache, &step, &rows).expect("forward");
        out.extend(l.chunks_exact(c.vocab_size).map(<[f32]>::to_vec));
        start += n;
    }
    assert_eq!(start, tokens.len());
    out
}

/// The largest |ours - reference| over every position and vocabulary entry, and the number of
/// positions whose argmax differs.
fn compare(ours: &[Vec<f32>], reference: &Value) -> (f32, usize) {
    let reference = reference.as_array().expect("logit rows");
    assert_eq!(ours.len(), reference.len());
    let (mut worst, mut argmax_differs) = (0f32, 0);
    for (row, r) in ours.iter().zip(reference) {
        let r: Vec<f32> = r
            .as_array()
            .expect("a row")
            .iter()
            .map(|x| x.as_f64().expect("a logit") as f32)
            .collect();
        assert_eq!(row.len(), r.len());
        for (a, b) in row.iter().zip(&r) {
            worst = worst.max((a - b).abs());
        }
        let best = |v: &[f32]| (0..v.len()).fold(0, |b, j| if v[j] > v[b] { j } else { b });
        argmax_differs += usize::from(best(row) != best(&r));
    }
    (worst, argmax_differs)
}

/// `model`'s logits for `tokens` (in one step, and in chunks of 7, 5, then one token at a time)
/// against `reference`, at both of the CPU path's precisions.
fn assert_logits(model: &mut LlamaModel, tokens: &[u32], reference: &Value, name: &str) {
    let n = tokens.len();
    // The weights are exact in both files; the CPU path keeps keys and values in f16 and
    // rounds the products' inputs to about 15 bits (`Precise`, two-level int8) or partly to
    // int8 (this machine's default): the logits, whose spread is about 4, sit within 1e-2 and
    // 3e-2 of float32's (measured either way: Qwen2 2.2e-3, Qwen3 4.8e-3).
    for (precision, tolerance) in [
        (ActivationPrecision::Precise, 1e-2),
        (ActivationPrecision::default(), 3e-2),
    ] {
        model.set_precision(precision);
        for chunks in [vec![n], {
            let mut v = vec![7, 5];
            v.extend(std::iter::repeat_n(1, n - 12));
            v
        }] {
            let (worst, differs) = compare(&logits(model, tokens, &chunks), reference);
            eprintln!(
                "{name}, {precision:?}, chunks {chunks:?}: max |Δ logit| {worst:e}, argmax differs at {differs}"
            );
            assert!(worst < tolerance, "{name}: max |Δ logit| {worst}");
            assert_eq!(differs, 0, "{name}");
        }
    }
}

/// `config`'s logits for `tokens` (one step) are far (more than 0.1) from `reference`: the
/// reference tells `what` from the model it was made with.
fn assert_far(
    config: &LlamaConfig,
    weights: &ModelWeights,
    tokens: &[u32],
    reference: &Value,
    what: &str,
) {
    let wrong = LlamaModel::from_weights(config, weights).expect("the model builds");
    let (worst, _) = compare(&logits(&wrong, tokens, &[tokens.len()]), reference);
    assert!(worst > 0.1, "{what}: max |Δ logit| only {worst}");
}

fn check(tag: &str, name: &str) {
    let g = golden(tag);
    let loaded = load(name);
    let c = &loaded.config;
    let qwen3 = tag.starts_with("qwen3");
    let yarn = tag.ends_with("-yarn");
    match &c.rope_scaling {
        Some(RopeScaling::Yarn(y)) if yarn => {
            assert_eq!(
                (y.factor, y.original_max_position_embeddings),
                (4.0, 16),
                "{name}"
            );
        }
        None if !yarn => {}
        other => panic!("{name}: rope scaling {other:?}"),
    }
    assert_eq!(c.qkv_bias, !qwen3, "{name}: Qwen2's Q, K and V have biases");
    assert_eq!(
        c.qk_norm, qwen3,
        "{name}: Qwen3's query and key heads are normalised"
    );
    // Qwen3's heads are wider than the residual stream's share (4 x 32 over 64).
    assert_eq!(c.head_dim, if qwen3 { 32 } else { 16 }, "{name}");
    assert_eq!(c.rope_style, RopeStyle::Halves, "{name}");
    assert_eq!(c.rope_theta, 1e6, "{name}");
    assert!(!c.tie_word_embeddings, "{name}");
    let mut model = LlamaModel::from_weights(c, &loaded.weights).expect("the model builds");
    let tokens = ids(&g["tokens"]);
    let n = tokens.len();
    assert_logits(&mut model, &tokens, &g["logits"], name);
    // The reference tells the architecture apart: without the biases (the head norms), or
    // with Llama's GGUF rotation of adjacent pairs (without YaRN, or without its attention
    // factor), the logits are far off.
    let mut wrong_ones = Vec::new();
    if let Some(RopeScaling::Yarn(y)) = c.rope_scaling.clone() {
        wrong_ones.push((
            "no YaRN",
            LlamaConfig {
                rope_scaling: None,
                ..c.clone()
            },
        ));
        wrong_ones.push((
            "YaRN without its attention factor",
            LlamaConfig {
                rope_scaling: Some(RopeScaling::Yarn(switchyard_gpu::model::YarnScaling {
                    attention_factor: 1.0,
                    ..y
                })),
                ..c.clone()
            },
        ));
    }
    for (what, changed) in wrong_ones.into_iter().chain([
        (
            "no biases or head norms",
            LlamaConfig {
                qkv_bias: false,
                qk_norm: false,
                ..c.clone()
            },
        ),
        (
            "adjacent pairs",
            LlamaConfig {
                rope_style: RopeStyle::Interleaved,
                ..c.clone()
            },
        ),
    ]) {
        let wrong = LlamaModel::from_weights(&changed, &loaded.weights).expect("the model builds");
        let (worst, _) = compare(&logits(&wrong, &tokens, &[n]), &g["logits"]);
        assert!(
            worst > 0.5,
            "{name} with {what}: max |Δ logit| only {worst}"
        );
    }
}

#[test]
fn qwen2_checkpoints_give_transformers_logits() {
    check("qwen2", "qwen2");
}

#[test]
fn qwen2_gguf_files_give_transformers_logits() {
    check("qwen2", "tiny-qwen2.gguf");
}

#[test]
fn qwen3_checkpoints_give_transformers_logits() {
    check("qwen3", "qwen3");
}

#[test]
fn qwen3_gguf_files_give_transformers_logits() {
    check("qwen3", "tiny-qwen3.gguf");
}

#[test]
fn yarn_checkpoints_give_transformers_logits() {
    check("qwen2-yarn", "qwen2-yarn");
}

#[test]
fn yarn_gguf_files_give_transformers_logits() {
    check("qwen2-yarn", "tiny-qwen2-yarn.gguf");
}

/// Phi-3 (fused Q, K and V, fused gate and up, LongRoPE): served past its pre-training context
/// (the model's 64 tokens over 16) with the long factors, transformers' logits for the 24-token
/// sequence; served within it (`model.max_model_len` 16), with the short factors, its logits
/// for the first 12 tokens on their own.
fn check_phi3(name: &str) {
    let g = golden("phi3");
    let loaded = load(name);
    let c = &loaded.config;
    let Some(RopeScaling::LongRope(l)) = c.rope_scaling.clone() else {
        panic!("{name}: rope scaling {:?}", c.rope_scaling)
    };
    assert_eq!(
        (l.original_max_position_embeddings, l.pairs, l.use_long),
        (16, 8, true),
        "{name}"
    );
    let sqrt_factor = (1.0f32 + 4f32.ln() / 16f32.ln()).sqrt();
    assert!(
        (l.attention_factor - sqrt_factor).abs() < 1e-6,
        "{name}: {l:?}"
    );
    assert_eq!(
        l.factors(),
        [1.0, 1.3, 1.9, 2.8, 4.1, 6.0, 8.5, 12.0],
        "{name}"
    );
    assert_eq!(
        (c.head_dim, c.max_position_embeddings, c.rope_style),
        (16, 64, RopeStyle::Halves),
        "{name}"
    );
    assert!(
        !c.qkv_bias && !c.qk_norm && !c.tie_word_embeddings,
        "{name}"
    );
    // The fused matrices were split into the projections the backends use.
    for t in ["attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"] {
        let shape = loaded
            .weights
            .get(&format!("blk.1.{t}.weight"))
            .unwrap()
            .shape;
        let rows = match t {
            "attn_q" => 64,
            "attn_k" | "attn_v" => 32,
            _ => 128,
        };
        assert_eq!(shape, [rows, 64], "{name}: {t}");
    }
    assert!(!loaded.weights.contains("blk.0.attn_qkv.weight"), "{name}");
    let tokens = ids(&g["tokens"]);
    let mut model = LlamaModel::from_weights(c, &loaded.weights).expect("the model builds");
    assert_logits(&mut model, &tokens, &g["logits"], name);
    let mut within = c.clone();
    within.serve_context(16);
    let mut short = LlamaModel::from_weights(&within, &loaded.weights).expect("the model builds");
    assert_logits(
        &mut short,
        &tokens[..12],
        &g["logits_short"],
        &format!("{name}, short"),
    );
    // The reference tells the factors apart: the long ones on the short sequence, the short
    // ones on the long one, no LongRoPE, or no attention factor, are far off.
    let far = |config: &LlamaConfig, tokens: &[u32], reference: &Value, what: &str| {
        assert_far(
            config,
            &loaded.weights,
            tokens,
            reference,
            &format!("{name} with {what}"),
        );
    };
    far(
        c,
        &tokens[..12],
        &g["logits_short"],
        "the long factors within",
    );
    far(&within, &tokens, &g["logits"], "the short factors past");
    far(
        &LlamaConfig {
            rope_scaling: None,
            ..c.clone()
        },
        &tokens,
        &g["logits"],
        "no LongRoPE",
    );
    far(
        &LlamaConfig {
            rope_scaling: Some(RopeScaling::LongRope(LongRopeScaling {
                attention_factor: 1.0,
                ..l
            })),
            ..c.clone()
        },
        &tokens,
        &g["logits"],
        "no attention factor",
    );
}

#[test]
fn phi3_checkpoints_give_transformers_logits() {
    check_phi3("phi3");
}

#[test]
fn phi3_gguf_files_give_transformers_logits() {
    check_phi3("tiny-phi3.gguf");
}

/// Phi-3 with a sliding window of 7 (`--arch phi3 --window 7`: every layer's query attends to
/// its last 7 positions): transformers' logits for the 24-token sequence, in one step and in
/// chunks (windows starting inside a chunk and inside a block of the cache), and far off with
/// full causal attention.
fn check_phi3_window(name: &str) {
    let g = golden("phi3-swa");
    let loaded = load(name);
    let c = &loaded.config;
    assert_eq!(
        (c.sliding_window, c.max_position_embeddings),
        (Some(7), 64),
        "{name}"
    );
    let full = LlamaConfig {
        sliding_window: None,
        ..c.clone()
    };
    matches_and_tells_apart(&loaded, &g, name, &full, "without its window");
}

/// `loaded` gives the reference `g`'s logits ([`assert_logits`]), and the same weights read as
/// `wrong` says (`what`) are far from them ([`assert_far`]).
fn matches_and_tells_apart(
    loaded: &LoadedModel,
    g: &Value,
    name: &str,
    wrong: &LlamaConfig,
    what: &str,
) {
    let tokens = ids(&g["tokens"]);
    let mut model =
        LlamaModel::from_weights(&loaded.config, &loaded.weights).expect("the model builds");
    assert_logits(&mut model, &tokens, &g["logits"], name);
    let what = format!("{name} {what}");
    assert_far(wrong, &loaded.weights, &tokens, &g["logits"], &what);
}

#[test]
fn phi3_checkpoints_with_a_sliding_window_give_transformers_logits() {
    check_phi3_window("phi3-swa");
}

#[test]
fn phi3_gguf_files_with_a_sliding_window_give_transformers_logits() {
    check_phi3_window("tiny-phi3-swa.gguf");
}

/// Phi-3 rotating half of each head (`--arch phi3 --partial 0.5`: 8 of 16 dimensions, as
/// Phi-4-mini rotates 96 of 128, LongRoPE's lists of 4 pairs): transformers' logits for the
/// 24-token sequence (the loader moves the unrotated dimensions of Q and K to the pairs the
/// backends leave at frequency 0), and far off rotating every dimension.
fn check_phi3_partial(name: &str) {
    let g = golden("phi3-partial");
    let loaded = load(name);
    let c = &loaded.config;
    assert_eq!((c.head_dim, c.rotary_dim), (16, 8), "{name}");
    let Some(RopeScaling::LongRope(l)) = c.rope_scaling.clone() else {
        panic!("{name}: rope scaling {:?}", c.rope_scaling)
    };
    assert_eq!(l.pairs, 4, "{name}");
    // Rotating every dimension (the frequencies of a head of 16, LongRoPE's lists padded).
    let pad = |v: &[f32]| -> std::sync::Arc<[f32]> {
        v.iter()
            .copied()
            .chain(std::iter::repeat_n(1.0, 4))
            .collect()
    };
    let full = LlamaConfig {
        rotary_dim: 16,
        rope_scaling: Some(RopeScaling::LongRope(LongRopeScaling {
            pairs: 8,
            short: pad(&l.short),
            long: pad(&l.long),
            ..l
        })),
        ..c.clone()
    };
    matches_and_tells_apart(&loaded, &g, name, &full, "rotating every dimension");
}

#[test]
fn phi3_checkpoints_with_a_partial_rotary_embedding_give_transformers_logits() {
    check_phi3_partial("phi3-partial");
}

#[test]
fn phi3_gguf_files_with_a_partial_rotary_embedding_give_transformers_logits() {
    check_phi3_partial("tiny-phi3-partial.gguf");
}

#[test]
fn every_tokenizer_splits_as_qwen2_does() {
    for (arch, name) in [
        ("qwen2", "qwen2"),
        ("qwen2", "tiny-qwen2.gguf"),
        ("qwen3", "qwen3"),
        ("qwen3", "tiny-qwen3.gguf"),
    ] {
        let g = golden(arch);
        let loaded = load(name);
        for case in g["tokenization"].as_array().expect("cases") {
            let text = case["text"].as_str().expect("text");
            let ours = loaded.tokenizer.encode(text, false).expect("encode");
            assert_eq!(ours, ids(&case["ids"]), "{name}: {text:?}");
            // Decoding gives the text back, composed (the fixture's one decomposed text).
            let composed = text.replace("e\u{301}", "é").replace("n\u{303}", "ñ");
            assert_eq!(
                loaded.tokenizer.decode(&ours, false).expect("decode"),
                composed
            );
        }
        // No BOS: Qwen2 and Qwen3 have none.
        assert_eq!(
            loaded.tokenizer.encode("12", true).expect("encode"),
            [u32::from(b'1'), u32::from(b'2')],
            "{name}"
        );
    }
}
