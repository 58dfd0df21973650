//! Teacher-forced agreement of the CPU forward pass with Hugging Face transformers (float32,
//! weights dequantized from the same GGUF; `gpu/reference/make_golden.py` made the fixture):
//! feeding each reference prompt plus its 32 reference greedy tokens, our argmax must match the
//! reference's at >= 99% of the generated positions and our logprob of the reference token must
//! be within 0.05 nats of the reference's on average.
//!
//! The same holds with a LoRA adapter (`gpu/reference/make_lora_golden.py`: a random PEFT
//! adapter on every projection, merged into transformers' float32 weights for the reference;
//! here it is applied per request on top of the quantized base model).

use std::path::PathBuf;

use serde_json::Value;
use switchyard_gpu::cpu::attention::QueryPos;
use switchyard_gpu::cpu::kv_cache::KvCache;
use switchyard_gpu::cpu::llama::{ActivationPrecision, LlamaModel, StepInput};
use switchyard_gpu::cpu::matmul::Isa;
use switchyard_gpu::model::fetch::sha256_file;
use switchyard_gpu::model::gguf::GgufFile;
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::sampler::log_softmax;
use switchyard_gpu::{LoraAdapter, LoraLimits};

fn model() -> LlamaModel {
    let dir = std::env::var("SWITCHYARD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/switchyard/models/smollm2-135m")
        });
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `switchyard model fetch smollm2-135m` first",
        path.display()
    );
    model_at(&path)
}

fn model_at(path: &std::path::Path) -> LlamaModel {
    let (header, weights) = GgufFile::open(path)
        .and_then(|f| f.into_weights())
        .expect("read the GGUF file");
    let config = LlamaConfig::from_gguf(&header).expect("model config");
    LlamaModel::from_weights(&config, &weights).expect("model")
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn read_fixture(name: &str, script: &str) -> Value {
    let path = fixtures().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (made by gpu/reference/{script})", path.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn fixture() -> Value {
    read_fixture("smollm2_golden.json", "make_golden.py")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("an id array")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// (positions agreeing on the argmax, positions, sum of |logprob difference|), with `adapter`
/// applied to every token.
fn teacher_forced(
    model: &LlamaModel,
    generation: &Value,
    adapter: Option<&LoraAdapter>,
) -> (usize, usize, f64) {
    let prompt = ids(&generation["prompt_ids"]);
    let tokens = ids(&generation["tokens"]);
    let steps = generation["steps"].as_array().expect("steps");
    assert_eq!(steps.len(), tokens.len());
    let all: Vec<u32> = prompt
        .iter()
        .chain(&tokens[..tokens.len() - 1])
        .copied()
        .collect();
    let c = &model.config;
    let block = 16;
    let blocks = all.len().div_ceil(block);
    let mut cache =
        KvCache::new(c.num_layers, blocks, block, c.num_kv_heads, c.head_dim).expect("cache");
    let table: Vec<u32> = (0..blocks as u32).collect();
    let queries: Vec<QueryPos> = (0..all.len()).map(|pos| QueryPos { pos, seq: 0 }).collect();
    // Row prompt.len() - 1 + i predicts tokens[i].
    let rows: Vec<usize> = (0..tokens.len()).map(|i| prompt.len() - 1 + i).collect();
    let step = StepInput {
        tokens: &all,
        queries: &queries,
        tables: &[&table],
        adapters: &[adapter],
    };
    let logits = model.forward(&mut cache, &step, &rows).expect("forward");
    let vocab = c.vocab_size;
    let (mut agree, mut diff) = (0, 0f64);
    for (i, s) in steps.iter().enumerate() {
        let lp = log_softmax(&logits[i * vocab..(i + 1) * vocab]);
        let best = lp
            .iter()
            .enumerate()
            .fold(0, |b, (j, &v)| if v > lp[b] { j } else { b });
        let ref_best = s["top5"][0][0].as_u64().expect("top5 id") as usize;
        agree += usize::from(best == ref_best);
        if best != ref_best {
            let gap =
                s["top5"][0][1].as_f64().unwrap_or(0.0) - s["top5"][1][1].as_f64().unwrap_or(0.0);
            eprintln!(
                "  position {i}: reference top-1 {ref_best} (gap to its top-2 {gap:.4} nats), ours {best} (ours {:.4} vs {:.4})",
                lp[best],
                lp[ref_best]
            );
        }
        let ref_lp = s["logprob"].as_f64().expect("logprob");
        diff += (f64::from(lp[tokens[i] as usize]) - ref_lp).abs();
    }
    (agree, steps.len(), diff)
}

fn check(isa: Isa, precision: ActivationPrecision) {
    check_model(model(), &fixture(), isa, precision, 0.99);
}

fn check_model(
    mut model: LlamaModel,
    fx: &Value,
    isa: Isa,
    precision: ActivationPrecision,
    min_top1: f64,
) {
    model.set_precision(precision);
    if model.set_isa(isa).is_err() {
        eprintln!("{isa:?} is not supported here; skipped");
        return;
    }
    let gens = fx["generations"].as_array().expect("generations");
    assert!(!gens.is_empty());
    let (mut agree, mut total, mut diff) = (0, 0, 0f64);
    for g in gens {
        let (a, n, d) = teacher_forced(&model, g, None);
        eprintln!(
            "{isa:?} {}: top-1 {a}/{n}, mean |dlogprob| {:.4}",
            g["name"],
            d / n as f64
        );
        agree += a;
        total += n;
        diff += d;
    }
    let agreement = agree as f64 / total as f64;
    let mean = diff / total as f64;
    eprintln!("{isa:?} {precision:?}: top-1 agreement {agreement:.4} over {total} positions, mean |dlogprob| {mean:.4} nats");
    assert!(agreement >= min_top1, "top-1 agreement {agreement}");
    assert!(mean <= 0.05, "mean |logprob difference| {mean}");
}

#[test]
fn teacher_forced_logprobs_match_transformers() {
    check(Isa::detect(), ActivationPrecision::default());
}

/// The AVX2 kernels with two-level activations everywhere (`Mixed` is within rounding noise
/// of the 99% bar with them: 98.6% measured).
#[test]
fn teacher_forced_logprobs_match_transformers_with_avx2_kernels() {
    check(Isa::Avx2, ActivationPrecision::Precise);
}

#[test]
fn teacher_forced_logprobs_match_transformers_with_precise_activations() {
    check(Isa::detect(), ActivationPrecision::Precise);
}

/// The same check on a Q4_K_M file (Q4_K, Q5_0, Q6_K and Q8_0 tensors) made from the embedded
/// model by ggml's own quantizer, against transformers reading that file. The file is 105 MB
/// and not shipped: make it with gpu/reference/make_kquant_model.py (its sha256 is in the
/// fixture) and name it in `SWITCHYARD_KQUANT_GGUF`, then run this test with `--ignored`.
///
/// With two-level activations everywhere the weights are the only difference: 99.65% top-1,
/// mean |dlogprob| 0.0007 (the same file decoded by gguf-py and run in f32: 100%, 0.0003).
/// With int8 activations into the O, gate|up and LM-head products (`Mixed`, the AVX-512
/// default) 98.26%, 0.019: the file came from the Q4_1 one, quantized twice, and its
/// greedy runs pass near-ties (top-2 gaps down to 0.0002 nats), five of which turn; hence
/// 97% for that precision here.
#[test]
#[ignore = "needs a Q4_K_M file made by gpu/reference/make_kquant_model.py"]
fn teacher_forced_logprobs_of_a_q4_k_m_file_match_transformers() {
    let fx = read_fixture("smollm2_q4_k_m_golden.json", "make_golden.py --any-model");
    let path = PathBuf::from(
        std::env::var("SWITCHYARD_KQUANT_GGUF").expect("SWITCHYARD_KQUANT_GGUF names the file"),
    );
    assert_eq!(
        sha256_file(&path).expect("read the Q4_K_M file"),
        fx["model_sha256"].as_str().expect("model_sha256"),
        "{} is not the file the fixture was made from",
        path.display()
    );
    for isa in [Isa::detect(), Isa::Avx2] {
        check_model(
            model_at(&path),
            &fx,
            isa,
            ActivationPrecision::Precise,
            0.99,
        );
    }
    let default = ActivationPrecision::default();
    check_model(model_at(&path), &fx, Isa::detect(), default, 0.97);
}

/// The adapter's positions agree as the base model's do, with precise activations and with
/// this machine's default. (`Mixed` runs a sequence with an adapter at `Precise`: with int8
/// activations in its O, gate|up and LM-head products the AVX-512 VNNI kernels measured 97.5%
/// top-1, three positions where the reference's top two were 0.06-0.21 apart, and mean
/// |dlogprob| 0.043, against 100% and 0.0007.)
#[test]
fn teacher_forced_logprobs_with_a_lora_adapter_match_transformers() {
    for precision in [ActivationPrecision::Precise, ActivationPrecision::default()] {
        lora_teacher_forced(precision, 0.99);
    }
}

fn lora_teacher_forced(precision: ActivationPrecision, min_top1: f64) {
    let mut model = model();
    model.set_precision(precision);
    let fx = read_fixture("lora_golden.json", "make_lora_golden.py");
    let dir = fixtures().join(fx["adapter"]["dir"].as_str().expect("adapter dir"));
    let adapter = LoraAdapter::load(&dir, &model.config, &LoraLimits::default()).expect("adapter");
    assert_eq!(adapter.rank(), 4);
    assert_eq!(adapter.scale(), 2.0);
    let gens = fx["generations"].as_array().expect("generations");
    let (mut agree, mut total, mut diff, mut changed, mut base_agree) = (0, 0, 0f64, 0, 0);
    for g in gens {
        let (a, n, d) = teacher_forced(&model, g, Some(&adapter));
        eprintln!(
            "{}: top-1 {a}/{n}, mean |dlogprob| {:.4}",
            g["name"],
            d / n as f64
        );
        agree += a;
        total += n;
        diff += d;
        // The reference's own base-model answers at the same positions, and ours.
        let tokens = ids(&g["tokens"]);
        changed += ids(&g["base_top1"])
            .iter()
            .zip(&tokens)
            .filter(|(b, t)| b != t)
            .count();
        base_agree += teacher_forced(&model, g, None).0;
    }
    let agreement = agree as f64 / total as f64;
    let mean = diff / total as f64;
    eprintln!(
        "{precision:?} with the adapter: top-1 agreement {agreement:.4} over {total} positions, mean |dlogprob| {mean:.4} nats; \
         the adapter changes the reference's top-1 at {changed} positions; without it ours agrees at {base_agree}"
    );
    // The fixture is only a test of the adapter if the adapter changes the answers.
    assert!(
        changed * 4 >= total,
        "the adapter changes only {changed}/{total} answers"
    );
    assert!(
        agreement >= min_top1,
        "{precision:?}: top-1 agreement {agreement}"
    );
    assert!(
        mean <= 0.05,
        "{precision:?}: mean |logprob difference| {mean}"
    );
    // Ignoring the adapter would not pass.
    assert!(
        base_agree as f64 / (total as f64) < 0.9,
        "base model agrees at {base_agree}/{total}"
    );
}

/// Cosine similarity and the largest difference relative to the reference's norm.
fn compare(ours: &[f32], want: &[f64]) -> (f64, f64) {
    assert_eq!(ours.len(), want.len(), "vector lengths");
    let (mut dot, mut a2, mut b2, mut worst) = (0f64, 0f64, 0f64, 0f64);
    for (&a, &b) in ours.iter().zip(want) {
        let a = f64::from(a);
        dot += a * b;
        a2 += a * a;
        b2 += b * b;
        worst = worst.max((a - b).abs());
    }
    (dot / (a2 * b2).sqrt(), worst / b2.sqrt())
}

/// The final hidden state at a prompt's last token (what `/v1/embeddings` normalizes), from
/// the CPU backend's `execute` as the engine asks for it (a sampling step with
/// `hidden_state`), against transformers' `last_hidden_state` of the same GGUF
/// (`gpu/reference/make_embedding_golden.py`): each case alone, then all in one batch, which
/// must give the same vectors.
#[test]
fn embeddings_match_transformers() {
    use std::sync::Arc;
    use switchyard_gpu::backend::{Backend, Batch, CpuBackend, CpuBackendConfig, SeqInput};
    use switchyard_gpu::SamplingParams;

    let fixture = read_fixture("smollm2_embeddings.json", "make_embedding_golden.py");
    let cases = fixture["cases"].as_array().expect("cases");
    let mut backend = CpuBackend::new(model(), &CpuBackendConfig::default()).expect("backend");
    let sampling = Arc::new(SamplingParams {
        temperature: 0.0,
        hidden_state: true,
        ..SamplingParams::default()
    });
    let block = backend.block_size();
    let mut next_block = 0u32;
    let mut entry = |seq_id: u64, ids: Vec<u32>| {
        let n = ids.len().div_ceil(block) as u32;
        let table = (next_block..next_block + n).collect();
        next_block += n;
        SeqInput {
            seq_id,
            num_computed_tokens: 0,
            tokens: ids,
            block_table: table,
            sample: true,
            num_drafts: 0,
            sampling: sampling.clone(),
            adapter: None,
            cached_prompt: None,
        }
    };
    let alone: Vec<Vec<f32>> = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let batch = Batch {
                seqs: vec![entry(i as u64, ids(&c["ids"]))],
            };
            let out = backend.execute(&batch).expect("step");
            backend.release(i as u64);
            out[0].hidden.clone().expect("a hidden state")
        })
        .collect();
    for (c, ours) in cases.iter().zip(&alone) {
        let want: Vec<f64> = c["hidden"]
            .as_array()
            .expect("hidden")
            .iter()
            .map(|x| x.as_f64().expect("a float"))
            .collect();
        let (cos, rel) = compare(ours, &want);
        eprintln!(
            "{:10} cosine {cos:.6} max |diff| / norm {rel:.5}",
            c["name"]
        );
        assert!(
            cos >= 0.999,
            "{}: cosine {cos} with transformers",
            c["name"]
        );
        assert!(rel <= 0.02, "{}: max |diff| / norm {rel}", c["name"]);
    }
    let batch = Batch {
        seqs: cases
            .iter()
            .enumerate()
            .map(|(i, c)| entry(100 + i as u64, ids(&c["ids"])))
            .collect(),
    };
    let outs = backend.execute(&batch).expect("batched step");
    for ((o, one), c) in outs.iter().zip(&alone).zip(cases) {
        let batched = o.hidden.as_ref().expect("a hidden state");
        let want: Vec<f64> = one.iter().map(|&x| f64::from(x)).collect();
        let (cos, _) = compare(batched, &want);
        assert!(
            cos >= 0.99999,
            "{}: batched cosine {cos} with alone",
            c["name"]
        );
    }
}
