//! The host KV tier through the engine on the CPU backend, with steps in order and pipelined:
//! a prompt's cached blocks evicted from a small cache by other prompts are copied to the host
//! tier, and when the prompt comes again they are copied back into other blocks; its greedy
//! tokens are those it got when computed, and those a server without a tier gets.

use std::sync::Arc;

use switchyard_actors::{AsyncScheduling, CoreEvent, EngineCore, EngineCoreConfig, SubmitOptions};
use switchyard_gpu::cpu::llama::LlamaModel;
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::{Backend, CpuBackend, CpuBackendConfig, SamplingParams};
use switchyard_policies::{PolicyRegistry, SamplingLimits, SchedulerConfig, Timestamp};

const BLOCK: usize = 4;
const BLOCKS: usize = 12;

/// An engine over a cache of 12 blocks of 4 tokens and a host tier of `host_blocks`.
fn engine(host_blocks: usize, mode: AsyncScheduling) -> EngineCore {
    let block_bytes = 2 * 2 * 2 * 16 * BLOCK * 2;
    let backend = CpuBackend::new(
        LlamaModel::dummy(&LlamaConfig::tiny(), 5).expect("model"),
        &CpuBackendConfig {
            num_kv_blocks: BLOCKS,
            block_size: BLOCK,
            threads: 1,
            max_batch_tokens: 64,
            host_kv_bytes: host_blocks * block_bytes,
            ..CpuBackendConfig::default()
        },
    )
    .expect("backend");
    assert_eq!(backend.num_host_kv_blocks(), host_blocks);
    let scheduler = SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 64,
        block_size: BLOCK,
        num_gpu_blocks: BLOCKS,
        enable_prefix_caching: true,
        max_model_len: BLOCKS * BLOCK,
        num_host_blocks: backend.num_host_kv_blocks(),
        ..SchedulerConfig::default()
    };
    let policy = PolicyRegistry::with_builtins()
        .create("fcfs", &serde_yaml::Value::Null, &[])
        .expect("fcfs");
    EngineCore::new(
        EngineCoreConfig {
            scheduler,
            hash_key: [1, 2],
        },
        policy,
        Box::new(backend),
    )
    .expect("engine")
    .with_async_scheduling(mode)
}

/// The greedy tokens of request `id` (`prompt`, 4 tokens), run alone.
fn run(e: &mut EngineCore, id: u64, prompt: Vec<u32>) -> Vec<u32> {
    let limits = SamplingLimits {
        max_tokens: 4,
        ignore_eos: true,
        ..SamplingLimits::default()
    };
    let greedy = Arc::new(SamplingParams {
        temperature: 0.0,
        ..SamplingParams::default()
    });
    e.core()
        .add_request(SubmitOptions::offline(id, prompt, limits, greedy))
        .expect("admitted");
    let mut out = Vec::new();
    let mut step = 0;
    while e.core().has_unfinished() {
        for ev in e.step(Timestamp(step)).expect("a step").events {
            if let CoreEvent::Token { token, .. } = ev {
                out.push(token);
            }
        }
        step += 1;
        assert!(step < 1000, "no progress");
    }
    out
}

/// Prompt A (20 tokens: 5 blocks), two prompts of 28 tokens (8 blocks each with their
/// answers, so each evicts what the cache held before), A again: its tokens both times.
fn a_twice(e: &mut EngineCore) -> (Vec<u32>, Vec<u32>) {
    let a: Vec<u32> = (0..20).map(|i| (i * 7 + 3) % 250 + 1).collect();
    let first = run(e, 1, a.clone());
    for k in 0..2u32 {
        run(
            e,
            2 + u64::from(k),
            (0..28).map(|i| (i * 11 + 40 * k) % 250 + 1).collect(),
        );
    }
    (first, run(e, 9, a))
}

#[test]
fn a_prefix_reloaded_from_the_host_tier_decodes_as_computed() {
    for mode in [AsyncScheduling::Off, AsyncScheduling::On] {
        let mut off = engine(0, mode);
        let (first_off, again_off) = a_twice(&mut off);
        assert_eq!(again_off, first_off, "{mode:?}");
        let s = off.core().stats();
        assert_eq!((s.num_kv_loaded_blocks, s.num_host_hit_tokens), (0, 0));

        let mut on = engine(16, mode);
        let (first, again) = a_twice(&mut on);
        assert_eq!(first, first_off, "{mode:?}: the same model");
        assert_eq!(again, first, "{mode:?}: the answer over reloaded blocks");
        let s = on.core().stats();
        // A's 5 blocks: the 4 before its last token are served, all from the host tier.
        assert_eq!(s.num_host_hit_tokens, 16, "{mode:?}: {s:?}");
        assert_eq!(s.num_kv_loaded_blocks, 4, "{mode:?}: {s:?}");
        assert!(s.num_kv_offloaded_blocks >= 4, "{mode:?}: {s:?}");
    }
}
