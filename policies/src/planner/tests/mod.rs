//! Planner and life-cycle tests on small hand-made cases; expected values derived by hand
//! in the comments.

use std::sync::Arc;

use crate::policy::testutil::{request, run_step};
use crate::policy::{ChunkedPrefill, Fcfs, Policy, PolicyRegistry, PriorityPolicy};
use crate::types::*;
use crate::{Scheduler, SchedulerError, RELEASED_BLOCK};

mod adapters;
mod drafts;
mod lifecycle;
mod preemption;
mod prefix_cache;
mod rank_budget;
mod window;

fn config(blocks: usize, block_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 1024,
        block_size,
        num_gpu_blocks: blocks,
        enable_prefix_caching: true,
        max_model_len: 1024,
        tiers: Vec::new(),
        max_logit_rows: usize::MAX,
        max_loras: 4,
        speculative: None,
        sliding_window: None,
        max_queue_ms: None,
        num_host_blocks: 0,
        kv_offload_ahead: true,
    }
}

/// Speculative decoding with `k` drafts and lookups of `min..=max` tokens, no batch limit.
fn drafts(k: usize, min: usize, max: usize) -> Option<SpeculativeConfig> {
    Some(SpeculativeConfig {
        num_speculative_tokens: k,
        prompt_lookup_min: min,
        prompt_lookup_max: max,
        max_running: 0,
    })
}

fn sched(c: SchedulerConfig, p: Box<dyn Policy>) -> Scheduler {
    Scheduler::new(c, p, [11, 22]).unwrap()
}

fn req(id: u64, arrival: u64, prompt: Vec<u32>, max_tokens: u32) -> Request {
    request(id, "", arrival, prompt, max_tokens)
}

/// Runs one step, sampling `token` for every sampling entry.
fn step(s: &mut Scheduler, now: u64, token: u32) -> (StepPlan, Vec<SeqEvent>) {
    run_step(s, now, token)
}

fn with_adapter(mut r: Request, adapter: Option<u32>, priority: i32) -> Request {
    r.lora_adapter = adapter;
    r.priority = priority;
    r
}

fn ids(p: &StepPlan) -> Vec<u64> {
    p.seqs.iter().map(|q| q.id.0).collect()
}
