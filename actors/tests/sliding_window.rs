//! A sliding-window model through the engine on the CPU backend: the scheduler gives back the
//! blocks behind each sequence's window while it runs, other sequences take them over and
//! write their own keys and values there, and the tokens are those of each request run alone
//! in a cache that never reuses a block. The model is the tiny random Phi-3 with a window of 7
//! positions of gpu/tests/fixtures/phi3-swa (its logits match transformers':
//! gpu/tests/qwen_golden.rs).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use switchyard_actors::{CoreEvent, EngineCore, EngineCoreConfig, SubmitOptions};
use switchyard_gpu::model::load_model;
use switchyard_gpu::{Backend, CpuBackend, CpuBackendConfig, SamplingParams};
use switchyard_policies::{
    PolicyRegistry, SamplingLimits, SchedulerConfig, SlidingWindow, Timestamp,
};

const BLOCK: usize = 4;
const CHUNK: usize = 16;

fn engine(num_blocks: usize, window: bool) -> EngineCore {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../gpu/tests/fixtures/phi3-swa");
    let loaded =
        load_model(&dir, &switchyard_gpu::progress::NoProgress).expect("the fixture loads");
    assert_eq!(loaded.config.sliding_window, Some(7));
    let model =
        switchyard_gpu::cpu::llama::LlamaModel::from_weights(&loaded.config, &loaded.weights)
            .expect("the model builds");
    let backend = CpuBackend::new(
        model,
        &CpuBackendConfig {
            num_kv_blocks: num_blocks,
            block_size: BLOCK,
            threads: 1,
            max_batch_tokens: CHUNK,
            ..CpuBackendConfig::default()
        },
    )
    .expect("the backend starts");
    let sliding_window = window.then(|| SlidingWindow {
        tokens: 7,
        read_slack: backend.window_read_slack(),
    });
    let scheduler = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: CHUNK,
        block_size: BLOCK,
        num_gpu_blocks: num_blocks,
        enable_prefix_caching: true,
        max_model_len: loaded.config.max_position_embeddings,
        sliding_window,
        ..SchedulerConfig::default()
    };
    let policy = PolicyRegistry::with_builtins()
        .create("fcfs", &serde_yaml::Value::Null, &[])
        .expect("fcfs");
    EngineCore::new(
        EngineCoreConfig {
            scheduler,
            hash_key: [3, 4],
        },
        policy,
        Box::new(backend),
    )
    .expect("the engine starts")
}

/// Greedy tokens of each request (`max_tokens[i]` for `prompts[i]`), all submitted at once.
fn run(e: &mut EngineCore, prompts: &[Vec<u32>], max_tokens: &[u32]) -> BTreeMap<u64, Vec<u32>> {
    for (i, (p, &n)) in prompts.iter().zip(max_tokens).enumerate() {
        e.core()
            .add_request(offline(i as u64, p.clone(), n))
            .expect("admitted");
    }
    let mut out: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    let mut step = 0;
    while e.core().has_unfinished() {
        for ev in e.step(Timestamp(step)).expect("a step").events {
            if let CoreEvent::Token { id, token, .. } = ev {
                out.entry(id.0).or_default().push(token);
            }
        }
        step += 1;
        assert!(step < 10_000, "no progress");
    }
    out
}

fn offline(id: u64, prompt: Vec<u32>, max_tokens: u32) -> SubmitOptions {
    let limits = SamplingLimits {
        max_tokens,
        ignore_eos: true,
        ..SamplingLimits::default()
    };
    let greedy = SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    };
    SubmitOptions::offline(id, prompt, limits, Arc::new(greedy))
}

#[test]
fn blocks_given_back_behind_the_window_change_no_token() {
    // Four greedy requests of 64 positions (the model's context), 16 blocks each.
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|i| {
            (0..6 + 3 * i)
                .map(|t| (37 * i + 11 * t) % 300 + 10)
                .collect()
        })
        .collect();
    let lens: Vec<u32> = prompts.iter().map(|p| 64 - p.len() as u32).collect();
    // Alone, in a cache of 64 blocks without giving any back.
    let alone: BTreeMap<u64, Vec<u32>> = (0..4)
        .map(|i| {
            let out = run(&mut engine(64, false), &prompts[i..=i], &lens[i..=i]);
            (i as u64, out[&0].clone())
        })
        .collect();
    assert!(alone
        .values()
        .zip(&lens)
        .all(|(t, &n)| t.len() == n as usize));
    // Together in 24 blocks (one and a half requests without the window): each gives back
    // the blocks behind its window, which the others take over.
    let together = run(&mut engine(24, true), &prompts, &lens);
    assert_eq!(together, alone);
    // A request holds at most 11 blocks at once: the 15 positions behind its next one (the
    // window of 7, the backend's slack of a block, a margin of 4) and a chunk of 16 in 8
    // blocks, and 3 for partial blocks. So a cache of 11 serves the whole context (16
    // blocks), which without the window it refuses.
    let w = SlidingWindow {
        tokens: 7,
        read_slack: BLOCK,
    };
    assert_eq!(w.blocks_held(BLOCK, CHUNK), 11);
    let mut e = engine(11, true);
    assert_eq!(run(&mut e, &prompts[3..], &lens[3..])[&0], alone[&3]);
    assert_eq!(e.core().stats().num_free_blocks, 11);
    let mut e = engine(11, false);
    assert!(e
        .core()
        .add_request(offline(0, prompts[3].clone(), lens[3]))
        .is_err());
}
