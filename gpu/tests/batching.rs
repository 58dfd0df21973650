//! Batch invariance of the CPU backend on the real SmolLM2-135M Q4_1 file: a sequence gives
//! the same logits and greedy tokens whether it runs alone or batched with others (mixing
//! prefill chunks and decodes), whether its prompt is prefilled in one go or in chunks, and
//! whether its prefix is recomputed or read from another sequence's KV blocks.

use std::path::PathBuf;
use std::sync::Arc;

use switchyard_gpu::backend::{
    Backend, Batch, CpuBackend, CpuBackendConfig, SamplingParams, SeqInput,
};
use switchyard_gpu::model::gguf::GgufFile;
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::{GpuError, LoraAdapter, LoraLimits, LoraTarget};

#[path = "common/drafts.rs"]
mod drafts;

const BLOCK: usize = 16;
const BLOCKS_PER_SEQ: usize = 12;

fn model_file() -> PathBuf {
    let dir = std::env::var("SWITCHYARD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/switchyard/models/smollm2-135m")
        });
    dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")
}

fn backend() -> CpuBackend {
    let path = model_file();
    assert!(
        path.exists(),
        "{} is missing: run `switchyard model fetch smollm2-135m` first",
        path.display()
    );
    let (header, weights) = GgufFile::open(&path)
        .and_then(|f| f.into_weights())
        .expect("read the GGUF file");
    let config = LlamaConfig::from_gguf(&header).expect("model config");
    let cfg = CpuBackendConfig {
        num_kv_blocks: 8 * BLOCKS_PER_SEQ,
        block_size: BLOCK,
        threads: 2,
        ..Default::default()
    };
    CpuBackend::from_weights(&config, &weights, &cfg).expect("backend")
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 2654 + salt * 7919 + i * i * 13) % 48_000 + 200)
        .collect()
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A sequence driven by hand: its tokens so far, how many are in the cache, its blocks.
struct Seq {
    id: u64,
    tokens: Vec<u32>,
    computed: usize,
    table: Vec<u32>,
    /// Logits at every point where the next token was decided.
    logits: Vec<Vec<f32>>,
    /// The LoRA adapter of the sequence.
    adapter: Option<Arc<LoraAdapter>>,
}

impl Seq {
    fn new(id: u64, prompt: Vec<u32>, slot: usize) -> Self {
        let first = (slot * BLOCKS_PER_SEQ) as u32;
        Seq {
            id,
            tokens: prompt,
            computed: 0,
            table: (first..first + BLOCKS_PER_SEQ as u32).collect(),
            logits: Vec::new(),
            adapter: None,
        }
    }

    /// The next `chunk` tokens (or fewer, up to the end of what is known).
    fn input(&self, chunk: usize) -> SeqInput {
        let end = self.computed.saturating_add(chunk).min(self.tokens.len());
        SeqInput {
            seq_id: self.id,
            num_computed_tokens: self.computed,
            tokens: self.tokens[self.computed..end].to_vec(),
            block_table: self.table.clone(),
            sample: end == self.tokens.len(),
            num_drafts: 0,
            sampling: Arc::new(SamplingParams::greedy()),
            adapter: self.adapter.clone(),
            cached_prompt: None,
        }
    }
}

/// Runs one step over `(sequence, chunk)` pairs; sequences whose chunk reaches the end of
/// their tokens get their greedy next token appended.
fn step(be: &mut CpuBackend, seqs: &mut [Seq], chunks: &[(usize, usize)]) {
    let batch = Batch {
        seqs: chunks.iter().map(|&(i, c)| seqs[i].input(c)).collect(),
    };
    let logits = be.logits(&batch).expect("forward");
    let vocab = logits.len() / batch.seqs.len();
    for (k, &(i, _)) in chunks.iter().enumerate() {
        let s = &mut seqs[i];
        let input = &batch.seqs[k];
        s.computed += input.tokens.len();
        if input.sample {
            let row = logits[k * vocab..(k + 1) * vocab].to_vec();
            s.tokens.push(argmax(&row));
            s.logits.push(row);
        }
    }
}

/// Each sequence alone: the whole prompt in one step, then `decodes` greedy steps.
fn alone(prompts: &[Vec<u32>], decodes: usize) -> Vec<Seq> {
    alone_with(prompts, &vec![None; prompts.len()], decodes)
}

/// [`alone`] with a LoRA adapter (or none) per sequence.
fn alone_with(
    prompts: &[Vec<u32>],
    adapters: &[Option<Arc<LoraAdapter>>],
    decodes: usize,
) -> Vec<Seq> {
    let mut out = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let mut be = backend();
        let mut seqs = vec![Seq::new(i as u64, p.clone(), 0)];
        seqs[0].adapter = adapters[i].clone();
        step(&mut be, &mut seqs, &[(0, p.len())]);
        for _ in 0..decodes {
            step(&mut be, &mut seqs, &[(0, 1)]);
        }
        out.extend(seqs);
    }
    out
}

/// Both runs agree on every token and every decision point they have in common (at least 3).
fn assert_same(a: &Seq, b: &Seq) {
    let n = a.tokens.len().min(b.tokens.len());
    assert_eq!(a.tokens[..n], b.tokens[..n], "sequence {}", a.id);
    assert!(
        a.logits.len().min(b.logits.len()) >= 3,
        "too few decision points"
    );
    for (x, y) in a.logits.iter().zip(&b.logits) {
        let diff = x
            .iter()
            .zip(y)
            .map(|(p, q)| (p - q).abs())
            .fold(0f32, f32::max);
        assert!(diff <= 1e-4, "sequence {}: logits differ by {diff}", a.id);
    }
}

#[test]
fn batched_sequences_match_each_sequence_alone() {
    let prompts = vec![prompt(37, 1), prompt(5, 2), prompt(70, 3)];
    let reference = alone(&prompts, 6);
    let mut be = backend();
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Seq::new(i as u64, p.clone(), i + 1))
        .collect();
    // A: chunks of 20 + 17; B: whole prompt, then decodes; C: chunks of 32 + 38. Sequences
    // join and leave the batch at different steps.
    step(&mut be, &mut seqs, &[(0, 20), (1, 5)]);
    step(&mut be, &mut seqs, &[(1, 1), (0, 17), (2, 32)]);
    step(&mut be, &mut seqs, &[(2, 38), (0, 1), (1, 1)]);
    for _ in 0..4 {
        step(&mut be, &mut seqs, &[(0, 1), (1, 1), (2, 1)]);
    }
    step(&mut be, &mut seqs, &[(0, 1), (2, 1)]);
    step(&mut be, &mut seqs, &[(0, 1)]);
    step(&mut be, &mut seqs, &[(2, 1), (1, 1)]);
    for (a, b) in seqs.iter().zip(&reference) {
        assert_same(a, b);
    }
}

/// The test adapter of `gpu/tests/fixtures/lora/` (rank 4 on every projection).
fn fixture_adapter(be: &CpuBackend) -> Arc<LoraAdapter> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/smollm2-r4");
    Arc::new(LoraAdapter::load(&dir, &be.model().config, &LoraLimits::default()).expect("adapter"))
}

#[test]
fn lora_sequences_batched_with_others_match_each_alone() {
    let adapter = fixture_adapter(&backend());
    let prompts = vec![prompt(37, 1), prompt(5, 2), prompt(70, 3)];
    let adapters = vec![Some(adapter.clone()), None, Some(adapter)];
    let reference = alone_with(&prompts, &adapters, 4);
    let mut be = backend();
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Seq::new(i as u64, p.clone(), i + 1))
        .collect();
    for (s, a) in seqs.iter_mut().zip(&adapters) {
        s.adapter = a.clone();
    }
    step(&mut be, &mut seqs, &[(0, 20), (1, 5)]);
    step(&mut be, &mut seqs, &[(1, 1), (0, 17), (2, 32)]);
    step(&mut be, &mut seqs, &[(2, 38), (0, 1), (1, 1)]);
    for _ in 0..3 {
        step(&mut be, &mut seqs, &[(0, 1), (1, 1), (2, 1)]);
    }
    for (a, b) in seqs.iter().zip(&reference) {
        assert_same(a, b);
    }
    // The adapter changes the answers (so the comparison above saw it applied).
    let plain = alone(&prompts[..1], 4);
    let diff = plain[0].logits[0]
        .iter()
        .zip(&reference[0].logits[0])
        .map(|(p, q)| (p - q).abs())
        .fold(0f32, f32::max);
    assert!(
        diff > 0.5,
        "the adapter moved the first logits by only {diff}"
    );
}

#[test]
fn chunked_prefill_matches_one_shot_prefill() {
    let p = prompt(45, 9);
    let reference = alone(std::slice::from_ref(&p), 2);
    let mut be = backend();
    let mut seqs = vec![Seq::new(0, p, 3)];
    for chunk in [7, 1, 16, 21, 1, 1] {
        step(&mut be, &mut seqs, &[(0, chunk)]);
    }
    assert_same(&seqs[0], &reference[0]);
}

#[test]
fn prefix_blocks_of_another_sequence_match_recompute() {
    let shared = prompt(2 * BLOCK, 4);
    let with_suffix = |salt| [shared.clone(), prompt(9, salt)].concat();
    let reference = alone(&[with_suffix(6)], 3);
    let mut be = backend();
    let mut seqs = vec![
        Seq::new(0, with_suffix(5), 0),
        Seq::new(1, with_suffix(6), 1),
    ];
    step(&mut be, &mut seqs, &[(0, 41)]);
    // Sequence 1 reuses the two full prefix blocks of sequence 0 and computes only its suffix.
    let prefix = seqs[0].table[..2].to_vec();
    seqs[1].table[..2].copy_from_slice(&prefix);
    seqs[1].computed = 2 * BLOCK;
    step(&mut be, &mut seqs, &[(1, 9), (0, 1)]);
    step(&mut be, &mut seqs, &[(1, 1), (0, 1)]);
    step(&mut be, &mut seqs, &[(1, 1)]);
    seqs[1].id = 0; // compared with the reference's id
    assert_same(&seqs[1], &reference[0]);
}

#[test]
fn greedy_execute_returns_the_argmax_and_seeded_sampling_ignores_batch_mates() {
    let mut be = backend();
    let s = Seq::new(1, prompt(12, 8), 1);
    let logits = be
        .logits(&Batch {
            seqs: vec![s.input(12)],
        })
        .expect("forward");
    let out = be
        .execute(&Batch {
            seqs: vec![s.input(12)],
        })
        .expect("execute");
    assert_eq!(out[0].token, Some(argmax(&logits)));

    let seeded = Arc::new(SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: Some(42),
        ..Default::default()
    });
    let run = |mates: usize| {
        let mut be = backend();
        let mut seqs: Vec<Seq> = (0..=mates)
            .map(|i| Seq::new(i as u64, prompt(10 + 3 * i, i as u32), i))
            .collect();
        for _ in 0..8 {
            let batch = Batch {
                seqs: seqs
                    .iter()
                    .map(|s| SeqInput {
                        sampling: seeded.clone(),
                        ..s.input(usize::MAX)
                    })
                    .map(|mut i| {
                        i.sample = true;
                        i
                    })
                    .collect(),
            };
            let out = be.execute(&batch).expect("execute");
            for (s, o) in seqs.iter_mut().zip(out) {
                s.computed = s.tokens.len();
                s.tokens.push(o.token.expect("sampled"));
            }
        }
        seqs.swap_remove(0).tokens
    };
    assert_eq!(run(0), run(3));
}

fn one_layer_adapter() -> LoraAdapter {
    let mut c = LlamaConfig::smollm2_135m();
    c.num_layers = 1;
    let kv = c.num_kv_heads * c.head_dim;
    let pair = (LoraTarget::V, vec![0.01; c.hidden_size], vec![0.01; kv]);
    LoraAdapter::from_pairs(&c, 1, 1.0, vec![vec![pair]]).expect("adapter")
}

#[test]
fn malformed_batches_are_errors_not_panics() {
    let mut be = backend();
    let good = Seq::new(0, prompt(20, 1), 0).input(20);
    let cases = [
        SeqInput {
            block_table: vec![0],
            ..good.clone()
        },
        SeqInput {
            block_table: vec![0, 10_000],
            ..good.clone()
        },
        SeqInput {
            tokens: vec![1, 2, 60_000],
            ..good.clone()
        },
        SeqInput {
            tokens: vec![],
            ..good.clone()
        },
        SeqInput {
            num_computed_tokens: 1 << 40,
            ..good.clone()
        },
        // An adapter loaded for a model of another shape (one layer).
        SeqInput {
            adapter: Some(Arc::new(one_layer_adapter())),
            ..good.clone()
        },
        SeqInput {
            sampling: Arc::new(SamplingParams {
                top_p: 2.0,
                ..Default::default()
            }),
            ..good.clone()
        },
    ];
    for bad in cases {
        let r = be.execute(&Batch {
            seqs: vec![bad.clone()],
        });
        assert!(
            matches!(r, Err(GpuError::BadBatch(_) | GpuError::BadSampling(_))),
            "{bad:?} gave {r:?}"
        );
    }
    let twice = Batch {
        seqs: vec![good.clone(), good.clone()],
    };
    assert!(matches!(be.execute(&twice), Err(GpuError::BadBatch(_))));
    // An empty batch is an error, not a panic in the forward pass.
    assert!(matches!(
        be.execute(&Batch { seqs: Vec::new() }),
        Err(GpuError::BadBatch(_))
    ));
    let huge = SeqInput {
        tokens: vec![1; 9000],
        ..good.clone()
    };
    assert!(matches!(
        be.execute(&Batch { seqs: vec![huge] }),
        Err(GpuError::BadBatch(_))
    ));
    // The backend still works afterwards.
    assert!(be.execute(&Batch { seqs: vec![good] }).is_ok());
}

#[test]
fn prompt_logprobs_over_chunks_match_prefix_recompute() {
    let p = prompt(18, 11);
    let params = Arc::new(SamplingParams {
        prompt_logprobs: Some(2),
        logprobs: Some(3),
        ..SamplingParams::greedy()
    });
    let mut be = backend();
    let s = Seq::new(7, p.clone(), 2);
    let first = SeqInput {
        sampling: params.clone(),
        sample: false,
        num_drafts: 0,
        ..s.input(10)
    };
    let second = SeqInput {
        sampling: params.clone(),
        num_computed_tokens: 10,
        tokens: p[10..].to_vec(),
        ..s.input(18)
    };
    let mut got = be
        .execute(&Batch { seqs: vec![first] })
        .expect("chunk 1")
        .remove(0)
        .prompt_logprobs;
    let out = be
        .execute(&Batch { seqs: vec![second] })
        .expect("chunk 2")
        .remove(0);
    got.extend(out.prompt_logprobs.clone());
    assert_eq!(
        got.iter().map(|e| e.position).collect::<Vec<_>>(),
        (1..18).collect::<Vec<_>>()
    );
    // Reference: the last row of each prefix, recomputed from scratch.
    let mut fresh = backend();
    for e in &got {
        let prefix = Seq::new(0, p[..e.position].to_vec(), 0);
        let lp = switchyard_gpu::sampler::log_softmax(
            &fresh
                .logits(&Batch {
                    seqs: vec![prefix.input(e.position)],
                })
                .expect("prefix"),
        );
        assert_eq!(e.token, p[e.position]);
        assert!(
            (e.logprob - lp[e.token as usize]).abs() < 1e-4,
            "position {}",
            e.position
        );
        assert_eq!(e.top_logprobs.len(), 2);
        assert_eq!(e.top_logprobs[0].0, argmax(&lp));
    }
    // The sampled token's logprob and top-3 come from the same distribution.
    let token = out.token.expect("sampled");
    let lp = switchyard_gpu::sampler::log_softmax(
        &fresh
            .logits(&Batch {
                seqs: vec![Seq::new(0, p.clone(), 0).input(18)],
            })
            .expect("full"),
    );
    assert_eq!(token, argmax(&lp));
    assert!((out.logprob.unwrap_or(f32::NAN) - lp[token as usize]).abs() < 1e-4);
    assert_eq!(out.top_logprobs.len(), 3);
}

/// Speculative decoding's verification: drafts are kept exactly where decoding one token per
/// step agrees with them, and the outputs (greedy, seeded sampling, penalties, logprobs) are
/// those of one token per step.
#[test]
fn drafts_are_kept_exactly_where_one_token_per_step_agrees() {
    let mut be = backend();
    let vocab = be.model().config.vocab_size as u32;
    let prompts = vec![prompt(20, 1), prompt(35, 2), prompt(9, 3)];
    let params = vec![
        Arc::new(SamplingParams::greedy()),
        Arc::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(7),
            logprobs: Some(2),
            ..SamplingParams::default()
        }),
        Arc::new(SamplingParams {
            temperature: 0.7,
            seed: Some(8),
            repetition_penalty: 1.3,
            frequency_penalty: 0.5,
            ..SamplingParams::default()
        }),
    ];
    let reference = drafts::one_per_step(&mut be, &prompts, &params, 24, 0);
    let (out, accepted) = drafts::with_drafts(&mut be, &prompts, &params, &reference, 4, vocab, 10);
    assert_eq!(out, reference);
    assert!(accepted >= 10, "{accepted} drafts accepted");
}
