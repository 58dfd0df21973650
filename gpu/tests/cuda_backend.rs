//! The CUDA backend on a GPU (feature `cuda`). Every test prints why and returns when no usable
//! GPU or CUDA library is present, so `cargo test` passes on CPU-only machines; on the GPU host
//! `scripts/gpu-check.sh` runs this binary.
//!
//! - paged attention against a naive attention on the host, for random block tables, lengths
//!   and head counts, prefix-cache hits (shared blocks), chunked prefill and split-K decoding;
//! - sampling kernels against the CPU sampler's semantics (greedy ties, bias, masks, penalties,
//!   top-k, top-p, min-p, temperature, seeds);
//! - SmolLM2 from the GGUF, teacher-forced: CUDA against the CPU backend and against the
//!   Hugging Face float32 golden fixture;
//! - batched equals unbatched (chunked prefill, prefix hits, CUDA graphs on and off), seeded
//!   sampling reproducible whatever else is batched;
//! - a Llama-3-8B-shaped model (2 layers) against the CPU forward pass with near-f32 activations.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::sync::Arc;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use switchyard_gpu::backend::{Backend, Batch, SamplingParams, SeqInput};
use switchyard_gpu::cpu::attention::QueryPos;
use switchyard_gpu::cpu::kv_cache::KvCache;
use switchyard_gpu::cpu::llama::{dummy_weights, ActivationPrecision, LlamaModel, StepInput};
use switchyard_gpu::cuda::testing::{paged_attention, sample, AttentionSeq, AttentionShape};
use switchyard_gpu::cuda::{probe, CudaBackend, CudaBackendConfig, WeightSource};
use switchyard_gpu::model::gguf::GgufFile;
use switchyard_gpu::model::{LlamaConfig, ModelWeights};
use switchyard_gpu::sampler::log_softmax;

fn gpu() -> bool {
    match probe() {
        Ok(i) => {
            eprintln!(
                "GPU: {} sm_{}{}",
                i.name, i.compute_capability.0, i.compute_capability.1
            );
            true
        }
        Err(e) => {
            eprintln!("skipping: no usable CUDA device ({e})");
            false
        }
    }
}

fn model_file() -> Option<PathBuf> {
    let dir = std::env::var("SWITCHYARD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/switchyard/models/smollm2-135m")
        });
    let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    if p.exists() {
        Some(p)
    } else {
        eprintln!("skipping: {} is missing", p.display());
        None
    }
}

fn smollm2() -> Option<(LlamaConfig, ModelWeights)> {
    let (header, weights) = GgufFile::open(&model_file()?)
        .and_then(|f| f.into_weights())
        .expect("read the GGUF file");
    Some((LlamaConfig::from_gguf(&header).expect("config"), weights))
}

fn cfg(blocks: usize, graphs: bool) -> CudaBackendConfig {
    CudaBackendConfig {
        num_kv_blocks: Some(blocks),
        cuda_graphs: graphs,
        max_batch_tokens: 4096,
        ..CudaBackendConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Paged attention.

/// Naive attention over the same bf16-rounded inputs, in f64.
fn naive(s: &AttentionShape, seqs: &[AttentionSeq], q: &[f32], k: &[f32], v: &[f32]) -> Vec<f32> {
    let r = |x: f32| f64::from(half::bf16::from_f32(x).to_f32());
    let (nh, nkv, hd) = (s.num_heads, s.num_kv_heads, s.head_dim);
    let group = nh / nkv;
    let mut out = Vec::new();
    let mut t = 0;
    for a in seqs {
        for j in 0..a.queries {
            let p = a.computed + j;
            for h in 0..nh {
                let g = h / group;
                let qv: Vec<f64> = (0..hd).map(|d| r(q[(t * nh + h) * hd + d])).collect();
                let slot = |key: usize| {
                    a.table[key / s.block_size] as usize * s.block_size + key % s.block_size
                };
                let scores: Vec<f64> = (0..=p)
                    .map(|key| {
                        let base = (slot(key) * nkv + g) * hd;
                        (0..hd).map(|d| qv[d] * r(k[base + d])).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let acc: f64 = (0..=p)
                        .map(|key| w[key] * r(v[(slot(key) * nkv + g) * hd + d]))
                        .sum();
                    out.push((acc / z) as f32);
                }
            }
            t += 1;
        }
    }
    out
}

fn check_attention(rng: &mut ChaCha8Rng, s: AttentionShape, spec: &[(usize, usize)], share: bool) {
    let need: Vec<usize> = spec
        .iter()
        .map(|&(c, n)| (c + n).div_ceil(s.block_size))
        .collect();
    let total: usize = need.iter().sum();
    let s = AttentionShape {
        num_blocks: s.num_blocks.max(total + 8),
        ..s
    };
    let mut ids: Vec<u32> = (0..s.num_blocks as u32).collect();
    for i in (1..ids.len()).rev() {
        ids.swap(i, rng.random_range(0..=i));
    }
    let mut next = 0;
    let mut seqs: Vec<AttentionSeq> = Vec::new();
    for (i, &(c, n)) in spec.iter().enumerate() {
        let mut table: Vec<u32> = ids[next..next + need[i]].to_vec();
        next += need[i];
        // A prefix-cache hit: the second sequence reads the first one's full prefix blocks.
        if share && i == 1 {
            let shared = (c / s.block_size).min(seqs[0].table.len());
            table[..shared].copy_from_slice(&seqs[0].table[..shared]);
        }
        seqs.push(AttentionSeq {
            computed: c,
            queries: n,
            table,
        });
    }
    let t: usize = spec.iter().map(|x| x.1).sum();
    let slots = s.num_blocks * s.block_size;
    let mut fill = |n: usize, scale: f32| -> Vec<f32> {
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0) * scale)
            .collect()
    };
    let q = fill(t * s.num_heads * s.head_dim, 3.0);
    let k = fill(slots * s.num_kv_heads * s.head_dim, 1.0);
    let v = fill(slots * s.num_kv_heads * s.head_dim, 1.0);
    let got = paged_attention(&s, &seqs, &q, &k, &v).expect("attention kernel");
    let want = naive(&s, &seqs, &q, &k, &v);
    let err = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        got.iter().all(|x| x.is_finite()) && err < 1.5e-2,
        "{s:?} {spec:?}: max error {err}"
    );
    eprintln!("attention {s:?} {spec:?}: max |error| {err:.2e}");
}

#[test]
fn paged_attention_matches_naive() {
    if !gpu() {
        return;
    }
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let shapes = [
        (9, 3, 64, 16),
        (32, 8, 128, 16),
        (4, 4, 64, 8),
        (8, 1, 128, 32),
    ];
    for (nh, nkv, hd, bs) in shapes {
        for splits in [Some(1), Some(3), None] {
            let shape = AttentionShape {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                block_size: bs,
                num_blocks: 400,
                splits,
            };
            // Decodes at random context lengths.
            let decodes: Vec<(usize, usize)> =
                (0..5).map(|_| (rng.random_range(0..300), 1)).collect();
            check_attention(&mut rng, shape.clone(), &decodes, false);
            // Chunked prefill over cached prefixes, mixed with a decode, one prefix shared.
            check_attention(
                &mut rng,
                shape.clone(),
                &[(37, 40), (32, 9), (0, 1), (0, 70)],
                true,
            );
            // A long context.
            check_attention(&mut rng, shape, &[(2000, 1), (1500, 3)], false);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Sampling kernels.

fn dist() -> Vec<f32> {
    [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect()
}

fn histogram(p: &SamplingParams, draws: usize) -> [usize; 4] {
    let logits: Vec<f32> = (0..draws).flat_map(|_| dist()).collect();
    let params = vec![p.clone(); draws];
    let mut h = [0; 4];
    for t in sample(&logits, 4, &params, &[], 1000, 0).expect("sample") {
        h[t as usize] += 1;
    }
    h
}

#[test]
fn sampling_follows_the_cpu_semantics() {
    if !gpu() {
        return;
    }
    let greedy = SamplingParams::greedy();
    let one = |l: &[f32], p: &SamplingParams, prompt: &[u32]| {
        sample(l, l.len(), std::slice::from_ref(p), prompt, 0, 0).expect("sample")[0]
    };
    // Ties go to the lowest id; bias moves the argmax.
    assert_eq!(one(&[1.0, 3.0, 3.0, 2.0], &greedy, &[]), 1);
    let bias = SamplingParams {
        logit_bias: vec![(2, 1.5)],
        ..greedy.clone()
    };
    assert_eq!(one(&[0.1, 2.0, 1.0], &bias, &[]), 2);
    // min_tokens masks eos and stop ids (not eos with ignore_eos).
    let mask = SamplingParams {
        min_tokens: 2,
        eos_token_ids: vec![1],
        stop_token_ids: vec![2],
        ..greedy.clone()
    };
    assert_eq!(one(&[0.0, 3.0, 2.0, 1.0], &mask, &[]), 3);
    let ignore = SamplingParams {
        ignore_eos: true,
        ..mask.clone()
    };
    assert_eq!(one(&[0.0, 3.0, 2.0, 1.0], &ignore, &[]), 1);
    // Repetition penalty: 2.0 / 2 = 1.0 < 1.5, so a seen token 0 loses to token 2.
    let rep = SamplingParams {
        repetition_penalty: 2.0,
        ..greedy.clone()
    };
    assert_eq!(one(&[2.0, -1.0, 1.5], &rep, &[0, 1]), 2);
    assert_eq!(one(&[2.0, -1.0, 1.5], &greedy, &[0, 1]), 0);

    let n = 4000;
    let h = histogram(
        &SamplingParams {
            top_p: 0.6,
            ..Default::default()
        },
        n,
    );
    assert_eq!(h[2] + h[3], 0, "{h:?}");
    assert!((h[0] as f64 / n as f64 - 0.625).abs() < 0.03, "{h:?}");
    let h = histogram(
        &SamplingParams {
            top_k: 2,
            ..Default::default()
        },
        n,
    );
    assert!(h[0] > 0 && h[1] > 0 && h[2] + h[3] == 0, "{h:?}");
    let h = histogram(
        &SamplingParams {
            min_p: 0.35,
            ..Default::default()
        },
        n,
    );
    assert!(h[0] > 0 && h[1] > 0 && h[2] + h[3] == 0, "{h:?}");
    let h = histogram(&SamplingParams::default(), n);
    for (i, want) in [0.5, 0.3, 0.15, 0.05].iter().enumerate() {
        assert!((h[i] as f64 / n as f64 - want).abs() < 0.025, "{h:?}");
    }
    let h = histogram(
        &SamplingParams {
            temperature: 0.25,
            ..Default::default()
        },
        n,
    );
    assert!(h[0] > 3280 && h[0] < 3760, "{h:?}");

    // A large vocabulary: top-k keeps the k best; a seed and counter give one token.
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let vocab = 50_000;
    let l: Vec<f32> = (0..vocab).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    let p = SamplingParams {
        top_k: 5,
        temperature: 2.0,
        ..Default::default()
    };
    let rows: Vec<f32> = (0..64).flat_map(|_| l.iter().copied()).collect();
    let got = sample(&rows, vocab, &vec![p.clone(); 64], &[], 7, 3).expect("sample");
    assert!(
        got.iter().all(|t| order[..5].contains(&(*t as usize))),
        "{got:?}"
    );
    let again = sample(&rows, vocab, &vec![p; 64], &[], 7, 3).expect("sample");
    assert_eq!(got, again);
    assert!(got.iter().collect::<std::collections::HashSet<_>>().len() > 1);
}

// ---------------------------------------------------------------------------------------------
// SmolLM2: CUDA against the CPU backend and the Hugging Face golden fixture.

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2_golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("JSON")
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn one_seq(
    id: u64,
    computed: usize,
    tokens: Vec<u32>,
    table: Vec<u32>,
    p: &Arc<SamplingParams>,
) -> SeqInput {
    SeqInput {
        seq_id: id,
        num_computed_tokens: computed,
        tokens,
        block_table: table,
        sample: true,
        sampling: p.clone(),
        adapter: None,
    }
}

/// Logits of `rows` of a prefill of `all` on the CPU, activations near f32.
fn cpu_logits(model: &LlamaModel, all: &[u32], rows: &[usize]) -> Vec<f32> {
    let c = &model.config;
    let blocks = all.len().div_ceil(16);
    let mut cache =
        KvCache::new(c.num_layers, blocks, 16, c.num_kv_heads, c.head_dim).expect("cache");
    let table: Vec<u32> = (0..blocks as u32).collect();
    let queries: Vec<QueryPos> = (0..all.len()).map(|pos| QueryPos { pos, seq: 0 }).collect();
    let step = StepInput {
        tokens: all,
        queries: &queries,
        tables: &[&table],
    };
    model.forward(&mut cache, &step, rows).expect("cpu forward")
}

#[test]
fn smollm2_agrees_with_cpu_and_transformers() {
    if !gpu() {
        return;
    }
    let Some((config, weights)) = smollm2() else {
        return;
    };
    let mut cuda = CudaBackend::new(&config, WeightSource::Loaded(&weights), &cfg(256, true))
        .expect("CUDA backend");
    let mut cpu = LlamaModel::from_weights(&config, &weights).expect("cpu model");
    cpu.set_precision(ActivationPrecision::Precise);
    let fx = fixture();
    let (mut agree_cpu, mut agree_ref, mut n) = (0usize, 0usize, 0usize);
    let (mut d_cpu, mut d_ref, mut max_cpu) = (0f64, 0f64, 0f64);
    let vocab = config.vocab_size;
    for g in fx["generations"].as_array().expect("generations") {
        let prompt = ids(&g["prompt_ids"]);
        let tokens = ids(&g["tokens"]);
        let steps = g["steps"].as_array().expect("steps");
        let all: Vec<u32> = prompt
            .iter()
            .chain(&tokens[..tokens.len() - 1])
            .copied()
            .collect();
        let rows: Vec<usize> = (0..tokens.len()).map(|i| prompt.len() - 1 + i).collect();
        let table: Vec<u32> = (0..all.len().div_ceil(16) as u32).collect();
        let batch = Batch {
            seqs: vec![one_seq(
                0,
                0,
                all.clone(),
                table,
                &Arc::new(SamplingParams::greedy()),
            )],
        };
        let got = cuda
            .logits_rows(&batch, |_| rows.clone())
            .expect("cuda logits");
        let want = cpu_logits(&cpu, &all, &rows);
        for (i, step) in steps.iter().enumerate() {
            let g_lp = log_softmax(&got[i * vocab..(i + 1) * vocab]);
            let c_lp = log_softmax(&want[i * vocab..(i + 1) * vocab]);
            let argmax = |v: &[f32]| {
                v.iter()
                    .enumerate()
                    .fold(
                        (0, f32::NEG_INFINITY),
                        |b, (j, &x)| if x > b.1 { (j, x) } else { b },
                    )
                    .0
            };
            let ga = argmax(&g_lp);
            agree_cpu += usize::from(ga == argmax(&c_lp));
            agree_ref += usize::from(ga == tokens[i] as usize);
            let t = tokens[i] as usize;
            let dc = f64::from((g_lp[t] - c_lp[t]).abs());
            d_cpu += dc;
            max_cpu = max_cpu.max(dc);
            d_ref += (f64::from(g_lp[t]) - step["logprob"].as_f64().expect("logprob")).abs();
            n += 1;
        }
    }
    let (a_cpu, a_ref) = (agree_cpu as f64 / n as f64, agree_ref as f64 / n as f64);
    let (m_cpu, m_ref) = (d_cpu / n as f64, d_ref / n as f64);
    eprintln!(
        "SmolLM2 teacher-forced over {n} positions: top-1 vs CPU {:.2}%, vs transformers {:.2}%; \
         mean |dlogprob| vs CPU {m_cpu:.4} (max {max_cpu:.4}), vs transformers {m_ref:.4}",
        100.0 * a_cpu,
        100.0 * a_ref
    );
    assert!(a_cpu >= 0.99 && a_ref >= 0.99, "top-1 agreement too low");
    assert!(
        m_cpu <= 0.06 && m_ref <= 0.06,
        "logprobs differ beyond bf16 tolerance"
    );
}

// ---------------------------------------------------------------------------------------------
// Batch invariance, prefix hits, graphs, seeds.

/// Greedy (or seeded) generation of `steps` tokens for each prompt, all batched together
/// with the prompts prefilled in chunks of `chunk` tokens, or one prompt at a time.
fn generate(
    b: &mut CudaBackend,
    prompts: &[Vec<u32>],
    params: &[Arc<SamplingParams>],
    steps: usize,
    chunk: usize,
    together: bool,
    first_id: u64,
) -> Vec<Vec<u32>> {
    let per_seq = 40;
    let groups: Vec<Vec<usize>> = if together {
        vec![(0..prompts.len()).collect()]
    } else {
        (0..prompts.len()).map(|i| vec![i]).collect()
    };
    let mut out = vec![Vec::new(); prompts.len()];
    for group in groups {
        let mut done = vec![0usize; prompts.len()];
        loop {
            let mut seqs = Vec::new();
            for &i in &group {
                let table: Vec<u32> = (0..per_seq as u32)
                    .map(|k| i as u32 * per_seq as u32 + k)
                    .collect();
                let p = &prompts[i];
                if done[i] < p.len() {
                    let n = chunk.min(p.len() - done[i]);
                    let mut s = one_seq(
                        first_id + i as u64,
                        done[i],
                        p[done[i]..done[i] + n].to_vec(),
                        table,
                        &params[i],
                    );
                    s.sample = done[i] + n == p.len();
                    seqs.push(s);
                    done[i] += n;
                } else if out[i].len() < steps {
                    let last = *out[i].last().expect("a token");
                    seqs.push(one_seq(
                        first_id + i as u64,
                        p.len() + out[i].len() - 1,
                        vec![last],
                        table,
                        &params[i],
                    ));
                }
            }
            if seqs.is_empty() {
                break;
            }
            let ids: Vec<u64> = seqs.iter().map(|s| s.seq_id).collect();
            let res = b.execute(&Batch { seqs }).expect("execute");
            for (o, id) in res.iter().zip(ids) {
                if let Some(t) = o.token {
                    out[(id - first_id) as usize].push(t);
                }
            }
        }
    }
    for i in 0..prompts.len() {
        b.release(first_id + i as u64);
    }
    out
}

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    [21usize, 40, 7, 64]
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| rng.random_range(300..vocab as u32))
                .collect()
        })
        .collect()
}

#[test]
fn batched_equals_unbatched_with_and_without_graphs() {
    if !gpu() {
        return;
    }
    let (config, weights) = match smollm2() {
        Some(m) => m,
        None => {
            let c = LlamaConfig::smollm2_135m();
            let w = dummy_weights(&c, 1).expect("dummy");
            (c, w)
        }
    };
    let ps = prompts(config.vocab_size);
    let greedy: Vec<_> = (0..ps.len())
        .map(|_| Arc::new(SamplingParams::greedy()))
        .collect();
    let mut with_graphs =
        CudaBackend::new(&config, WeightSource::Loaded(&weights), &cfg(256, true))
            .expect("backend");
    let mut eager = CudaBackend::new(&config, WeightSource::Loaded(&weights), &cfg(256, false))
        .expect("backend");
    let alone = generate(&mut eager, &ps, &greedy, 24, 1 << 20, false, 0);
    let batched = generate(&mut with_graphs, &ps, &greedy, 24, 16, true, 100);
    let batched_eager = generate(&mut eager, &ps, &greedy, 24, 13, true, 200);
    assert!(
        with_graphs.graphs_captured() > 0,
        "decode steps ran without graphs"
    );
    assert_eq!(
        alone, batched,
        "batched (graphs, chunked prefill) differs from one at a time"
    );
    assert_eq!(alone, batched_eager, "batched without graphs differs");

    // A prefix-cache hit: sequence B = A's first 32 tokens + its own; B reads A's two blocks.
    let a = ps[3].clone();
    let mut b_prompt: Vec<u32> = a[..32].to_vec();
    b_prompt.extend_from_slice(&ps[0]);
    let p = Arc::new(SamplingParams::greedy());
    let scratch = generate(
        &mut eager,
        &[b_prompt.clone()],
        std::slice::from_ref(&p),
        8,
        1 << 20,
        false,
        300,
    );
    generate(
        &mut eager,
        std::slice::from_ref(&a),
        std::slice::from_ref(&p),
        1,
        1 << 20,
        false,
        400,
    ); // A fills blocks 0..4
    let table: Vec<u32> = vec![0, 1, 50, 51, 52, 53];
    let mut toks = Vec::new();
    let mut s = one_seq(500, 32, b_prompt[32..].to_vec(), table.clone(), &p);
    for _ in 0..8 {
        let out = eager
            .execute(&Batch {
                seqs: vec![s.clone()],
            })
            .expect("execute");
        let t = out[0].token.expect("token");
        toks.push(t);
        s = one_seq(
            500,
            b_prompt.len() + toks.len() - 1,
            vec![t],
            table.clone(),
            &p,
        );
    }
    assert_eq!(
        toks, scratch[0],
        "a prefix-cache hit changes the continuation"
    );
}

#[test]
fn seeded_sampling_is_reproducible_whatever_is_batched() {
    if !gpu() {
        return;
    }
    // The real model gives a spread-out distribution; random weights need a high temperature.
    let (c, w, temperature) = match smollm2() {
        Some((c, w)) => (c, w, 1.0),
        None => {
            let c = LlamaConfig::smollm2_135m();
            let w = dummy_weights(&c, 9).expect("dummy");
            (c, w, 100.0)
        }
    };
    let mut b = CudaBackend::new(&c, WeightSource::Loaded(&w), &cfg(256, true)).expect("backend");
    let ps = prompts(c.vocab_size);
    let mk = |seed| {
        Arc::new(SamplingParams {
            temperature,
            top_p: 0.95,
            seed: Some(seed),
            ..SamplingParams::default()
        })
    };
    let params: Vec<_> = (0..ps.len() as u64).map(|i| mk(42 + i)).collect();
    let alone = generate(&mut b, &ps[..1], &params[..1], 16, 1 << 20, false, 0);
    let again = generate(&mut b, &ps[..1], &params[..1], 16, 1 << 20, false, 10);
    let batched = generate(&mut b, &ps, &params, 16, 16, true, 20);
    let distinct: std::collections::HashSet<_> = alone[0].iter().collect();
    assert!(
        distinct.len() > 2,
        "the distribution is too peaked to test seeds: {alone:?}"
    );
    assert_eq!(alone[0], again[0]);
    assert_eq!(
        alone[0], batched[0],
        "the seeded stream depends on the batch"
    );
    let other = generate(&mut b, &ps[..1], &[mk(7)], 16, 1 << 20, false, 40);
    assert_ne!(alone[0], other[0], "different seeds gave the same tokens");
}

// ---------------------------------------------------------------------------------------------
// A Llama-3-8B-shaped model against a near-f32 reference.

#[test]
fn llama3_8b_shape_matches_a_float_reference() {
    if !gpu() {
        return;
    }
    let c = LlamaConfig {
        num_layers: 2,
        ..LlamaConfig::llama3_8b()
    };
    let w = dummy_weights(&c, 11).expect("dummy weights");
    let mut cuda =
        CudaBackend::new(&c, WeightSource::Loaded(&w), &cfg(64, false)).expect("backend");
    let mut cpu = LlamaModel::from_weights(&c, &w).expect("cpu model");
    cpu.set_precision(ActivationPrecision::Precise);
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let all: Vec<u32> = (0..40).map(|_| rng.random_range(1000..100_000)).collect();
    let rows = vec![3usize, 17, 39];
    let batch = Batch {
        seqs: vec![one_seq(
            0,
            0,
            all.clone(),
            vec![0, 1, 2],
            &Arc::new(SamplingParams::greedy()),
        )],
    };
    let got = cuda
        .logits_rows(&batch, |_| rows.clone())
        .expect("cuda logits");
    let want = cpu_logits(&cpu, &all, &rows);
    let v = c.vocab_size;
    for (i, r) in rows.iter().enumerate() {
        let (g, w) = (&got[i * v..(i + 1) * v], &want[i * v..(i + 1) * v]);
        let num: f64 = g.iter().zip(w).map(|(a, b)| f64::from(a - b).powi(2)).sum();
        let den: f64 = w.iter().map(|b| f64::from(*b).powi(2)).sum();
        let rel = (num / den).sqrt();
        eprintln!("Llama-3-8B shape, position {r}: relative logit error {rel:.2e}");
        assert!(rel < 2e-2, "position {r}: relative error {rel}");
    }
}

// ---------------------------------------------------------------------------------------------
// NVRTC alone (no GPU needed): the kernels compile for Hopper.

#[test]
fn kernels_compile_with_nvrtc() {
    match switchyard_gpu::cuda::device::compile_ptx((9, 0)) {
        Ok(ptx) => {
            for k in [
                "attention_128",
                "attention_64",
                "sample_rows",
                "rope_store_kv",
            ] {
                assert!(
                    ptx.contains(&format!(".entry {k}")),
                    "{k} missing from the PTX"
                );
            }
        }
        Err(e) => eprintln!("skipping: {e}"),
    }
}
