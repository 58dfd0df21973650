//! The host KV tier through the engine on the CPU backend, with steps in order and pipelined:
//! a prompt's cached blocks evicted from a small cache by other prompts are copied to the host
//! tier, and when the prompt comes again they are copied back into other blocks; its greedy
//! tokens are those it got when computed, and those a server without a tier gets; two requests
//! for it admitted in one step load its blocks once and share them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use switchyard_actors::{AsyncScheduling, CoreEvent, EngineCore, EngineCoreConfig, SubmitOptions};
use switchyard_gpu::backend::DraftVerifier;
use switchyard_gpu::cpu::llama::LlamaModel;
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::{
    Backend, Batch, CpuBackend, CpuBackendConfig, GpuError, KvCopy, SamplingParams, SeqOutput,
};
use switchyard_policies::{PolicyRegistry, SamplingLimits, SchedulerConfig, Timestamp};

const BLOCK: usize = 4;
const BLOCKS: usize = 12;

/// The loads of each [`Backend::copy_kv`] call that had any, as the backend got them.
type Loads = Arc<Mutex<Vec<Vec<KvCopy>>>>;

/// The CPU backend, recording the loads it is asked for (every other call passed on).
struct Recording {
    inner: CpuBackend,
    loads: Loads,
}

impl Backend for Recording {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn num_kv_blocks(&self) -> usize {
        self.inner.num_kv_blocks()
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn max_batch_tokens(&self) -> usize {
        self.inner.max_batch_tokens()
    }
    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        self.inner.execute(batch)
    }
    fn release(&mut self, seq_id: u64) {
        self.inner.release(seq_id);
    }
    fn lora_slots(&self) -> usize {
        self.inner.lora_slots()
    }
    fn recovers_from_panics(&self) -> bool {
        self.inner.recovers_from_panics()
    }
    fn window_read_slack(&self) -> usize {
        self.inner.window_read_slack()
    }
    fn pipelines(&self) -> bool {
        self.inner.pipelines()
    }
    fn draft_verifier(&self) -> Option<DraftVerifier> {
        self.inner.draft_verifier()
    }
    fn overlaps_host(&self) -> bool {
        self.inner.overlaps_host()
    }
    fn num_host_kv_blocks(&self) -> usize {
        self.inner.num_host_kv_blocks()
    }
    fn copy_kv(&mut self, offloads: &[KvCopy], loads: &[KvCopy]) -> Result<(), GpuError> {
        if !loads.is_empty() {
            self.loads.lock().expect("loads").push(loads.to_vec());
        }
        self.inner.copy_kv(offloads, loads)
    }
    fn submit(&mut self, batch: &Batch) -> Result<(), GpuError> {
        self.inner.submit(batch)
    }
    fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
        self.inner.collect()
    }
}

/// An engine over a cache of 12 blocks of 4 tokens and a host tier of `host_blocks`.
fn engine(host_blocks: usize, mode: AsyncScheduling) -> EngineCore {
    recording_engine(host_blocks, mode).0
}

/// [`engine`], and the loads its backend is asked for.
fn recording_engine(host_blocks: usize, mode: AsyncScheduling) -> (EngineCore, Loads) {
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
    let loads = Loads::default();
    let backend = Recording {
        inner: backend,
        loads: Arc::clone(&loads),
    };
    let e = EngineCore::new(
        EngineCoreConfig {
            scheduler,
            hash_key: [1, 2],
        },
        policy,
        Box::new(backend),
    )
    .expect("engine")
    .with_async_scheduling(mode);
    (e, loads)
}

/// Submits request `id` (`prompt`, 4 greedy tokens).
fn submit(e: &mut EngineCore, id: u64, prompt: Vec<u32>) {
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
}

/// Steps until every request is done: each request's tokens, and the sequences and tokens of
/// the batch the first step planned.
fn drive(e: &mut EngineCore) -> (HashMap<u64, Vec<u32>>, (usize, usize)) {
    let mut out: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut first_batch = None;
    let mut step = 0;
    while e.core().has_unfinished() {
        let report = e.step(Timestamp(step)).expect("a step");
        first_batch.get_or_insert((report.num_seqs, report.num_batched_tokens));
        for ev in report.events {
            if let CoreEvent::Token { id, token, .. } = ev {
                out.entry(id.0).or_default().push(token);
            }
        }
        step += 1;
        assert!(step < 1000, "no progress");
    }
    (out, first_batch.unwrap_or_default())
}

/// The greedy tokens of request `id` (`prompt`, 4 tokens), run alone.
fn run(e: &mut EngineCore, id: u64, prompt: Vec<u32>) -> Vec<u32> {
    submit(e, id, prompt);
    drive(e).0.remove(&id).unwrap_or_default()
}

/// Prompt A: 20 tokens, 5 blocks.
fn prompt_a() -> Vec<u32> {
    (0..20).map(|i| (i * 7 + 3) % 250 + 1).collect()
}

/// A's greedy tokens, computed; then two prompts of 28 tokens (8 blocks each with their
/// answers, so each evicts what the cache held before) push A's blocks into the host tier.
fn a_then_evicted(e: &mut EngineCore) -> Vec<u32> {
    let first = run(e, 1, prompt_a());
    for k in 0..2u32 {
        run(
            e,
            2 + u64::from(k),
            (0..28).map(|i| (i * 11 + 40 * k) % 250 + 1).collect(),
        );
    }
    first
}

/// [`a_then_evicted`], then A again: its tokens both times.
fn a_twice(e: &mut EngineCore) -> (Vec<u32>, Vec<u32>) {
    let first = a_then_evicted(e);
    (first, run(e, 9, prompt_a()))
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

/// A computed, evicted into the host tier, then submitted twice before a step: the step's plan
/// admits both, which find A's first 4 blocks in the tier. The first request loads them and the
/// second shares the loaded blocks (its references reach the pool with the plan's commit), so
/// the backend is asked for each tier block once; both answers are A's computed one. After
/// both finish, a prompt needing all 12 blocks is served (every shared block came back) and
/// the engine ends idle with every block free.
#[test]
fn a_prefix_wanted_twice_in_one_step_is_loaded_from_the_host_tier_once() {
    for mode in [AsyncScheduling::Off, AsyncScheduling::On] {
        let (mut e, loads) = recording_engine(16, mode);
        let first = a_then_evicted(&mut e);
        assert!(loads.lock().expect("loads").is_empty(), "{mode:?}");
        let before = e.core().stats();
        assert!(before.num_kv_offloaded_blocks >= 4, "{mode:?}: {before:?}");

        submit(&mut e, 10, prompt_a());
        submit(&mut e, 11, prompt_a());
        let (mut out, first_batch) = drive(&mut e);
        // One plan: both sequences, each computing only its last block.
        assert_eq!(
            first_batch,
            (2, 8),
            "{mode:?}: both admitted by the first plan"
        );
        assert_eq!(
            out.remove(&10).as_ref(),
            Some(&first),
            "{mode:?}: the loader"
        );
        assert_eq!(
            out.remove(&11).as_ref(),
            Some(&first),
            "{mode:?}: the sharer"
        );

        let calls = std::mem::take(&mut *loads.lock().expect("loads"));
        assert_eq!(calls.len(), 1, "{mode:?}: one plan's loads: {calls:?}");
        let mut hosts: Vec<u32> = calls[0].iter().map(|c| c.host).collect();
        let mut devices: Vec<u32> = calls[0].iter().map(|c| c.device).collect();
        hosts.sort_unstable();
        hosts.dedup();
        devices.sort_unstable();
        devices.dedup();
        assert_eq!(
            (calls[0].len(), hosts.len(), devices.len()),
            (4, 4, 4),
            "{mode:?}: A's 4 tier blocks, each loaded once: {calls:?}"
        );
        let s = e.core().stats();
        assert_eq!(
            s.num_kv_loaded_blocks - before.num_kv_loaded_blocks,
            4,
            "{mode:?}: {s:?}"
        );
        assert_eq!(
            s.num_host_hit_tokens - before.num_host_hit_tokens,
            16,
            "{mode:?}: the tier's tokens counted once: {s:?}"
        );
        assert_eq!(
            s.prefix_hits - before.prefix_hits,
            32,
            "{mode:?}: 16 tokens served to each: {s:?}"
        );

        // 44 tokens and 3 more written: all 12 blocks.
        let whole: Vec<u32> = (0..44).map(|i| (i * 13 + 5) % 250 + 1).collect();
        assert_eq!(run(&mut e, 12, whole).len(), 4, "{mode:?}: the whole cache");
        assert!(!e.core().has_unfinished(), "{mode:?}");
        let s = e.core().stats();
        assert_eq!(
            (
                s.num_running,
                s.num_waiting,
                s.num_free_blocks,
                s.pool_errors
            ),
            (0, 0, BLOCKS, 0),
            "{mode:?}: idle, every block free: {s:?}"
        );
    }
}
