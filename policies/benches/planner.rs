//! One planner step (schedule + apply_outputs) at 256 running decode sequences, per policy,
//! also with 1,000 requests waiting for a seat, and the per-request cost of admitting and
//! prefilling a 2048-token prompt.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use switchyard_policies::*;

const SEQS: usize = 256;
const PROMPT: usize = 512;
/// Decode steps before the scheduler is rebuilt (keeps contexts realistic).
const STEPS_PER_SETUP: usize = 1000;

fn tiers() -> Vec<TierSpec> {
    vec![
        TierSpec {
            name: "premium".into(),
            ttft_ms: Some(200.0),
            tpot_ms: Some(40.0),
            weight: 4.0,
            preemptible: false,
            max_queue_ms: None,
            max_kv_fraction: None,
        },
        TierSpec {
            name: "standard".into(),
            ttft_ms: Some(1000.0),
            tpot_ms: Some(100.0),
            weight: 1.0,
            preemptible: false,
            max_queue_ms: None,
            max_kv_fraction: None,
        },
        TierSpec {
            name: "batch".into(),
            ttft_ms: None,
            tpot_ms: None,
            weight: 1.0,
            preemptible: true,
            max_queue_ms: None,
            max_kv_fraction: None,
        },
    ]
}

fn request(i: usize, prompt: Arc<[u32]>, max_tokens: u32) -> Request {
    Request {
        id: RequestId(i as u64),
        tenant: format!("tenant{}", i % 8),
        tier: ["premium", "standard", "batch"][i % 3].into(),
        priority: (i % 4) as i32,
        lora_adapter: None,
        arrival: Timestamp(i as u64),
        slo: SloTargets::default(),
        prompt,
        limits: SamplingLimits {
            max_tokens,
            ..SamplingLimits::default()
        },
        cache_salt: None,
    }
}

/// A scheduler whose 256 sequences have finished prefill and are decoding.
fn decoding_scheduler(policy: &str) -> (Scheduler, Timestamp) {
    decoding_scheduler_with(policy, &serde_yaml::Value::Null)
}

fn decoding_scheduler_with(policy: &str, params: &serde_yaml::Value) -> (Scheduler, Timestamp) {
    decoding_scheduler_spec(policy, params, None)
}

fn decoding_scheduler_spec(
    policy: &str,
    params: &serde_yaml::Value,
    speculative: Option<SpeculativeConfig>,
) -> (Scheduler, Timestamp) {
    let config = SchedulerConfig {
        max_num_seqs: SEQS,
        max_num_batched_tokens: 8192,
        block_size: 16,
        num_gpu_blocks: 32_768,
        enable_prefix_caching: true,
        max_model_len: 1 << 16,
        tiers: tiers(),
        max_logit_rows: usize::MAX,
        max_loras: 4,
        speculative,
        sliding_window: None,
        max_queue_ms: None,
        num_host_blocks: 0,
        kv_offload_ahead: true,
    };
    let p = PolicyRegistry::with_builtins()
        .create(policy, &serde_yaml::Value::Null, &tiers())
        .unwrap();
    let mut s = Scheduler::new(config, p, [3, 4]).unwrap();
    let setup_end = decode_all(&mut s);
    let policy = PolicyRegistry::with_builtins()
        .create(policy, params, &tiers())
        .unwrap();
    s.swap_policy(policy);
    (s, setup_end)
}

/// Adds 256 requests and runs until all of them decode.
fn decode_all(s: &mut Scheduler) -> Timestamp {
    for i in 0..SEQS {
        let prompt: Arc<[u32]> = (0..PROMPT).map(|k| (i * PROMPT + k) as u32).collect();
        s.add_request(request(i, prompt, 60_000)).unwrap();
    }
    let mut now = Timestamp(0);
    loop {
        let plan = s.schedule(now);
        let outs: Vec<StepOutput> = plan
            .seqs
            .iter()
            .filter(|q| q.samples)
            .map(|q| StepOutput::new(q.id, 1))
            .collect();
        now = now.saturating_add(10_000);
        s.apply_outputs(&plan, &outs, now);
        if plan.seqs.iter().all(|q| !q.is_prefill) && plan.seqs.len() == SEQS {
            break;
        }
    }
    now
}

/// Waiting requests in [`saturated_scheduler`].
const WAITING: usize = 1000;

/// [`decoding_scheduler`] with `WAITING` more requests queued behind the full seats, request
/// `j` the 512-token prompt of running request `j % 256` (32 cached blocks) and 16 tokens of
/// its own: each step ranks them (prefix-aware looks up 128 first) and admits none.
fn saturated_scheduler(policy: &str, params: &serde_yaml::Value) -> (Scheduler, Timestamp) {
    let (mut s, now) = decoding_scheduler_with(policy, params);
    for j in 0..WAITING {
        let r = j % SEQS;
        let prompt: Arc<[u32]> = (0..PROMPT)
            .map(|k| (r * PROMPT + k) as u32)
            .chain((0..16).map(|k| (1 << 30) + (j * 16 + k) as u32))
            .collect();
        s.add_request(request(SEQS + j, prompt, 16)).unwrap();
    }
    (s, now)
}

/// Times `iters` steps (schedule_into + apply_outputs), rebuilding the scheduler every
/// `STEPS_PER_SETUP` steps outside the timed region.
fn time_steps(iters: u64, policy: &str, params: &serde_yaml::Value, expect: usize) -> Duration {
    time_steps_from(iters, expect, || decoding_scheduler_with(policy, params))
}

/// [`time_steps`] from schedulers that `setup` builds.
fn time_steps_from(
    iters: u64,
    expect: usize,
    setup: impl Fn() -> (Scheduler, Timestamp),
) -> Duration {
    let mut total = Duration::ZERO;
    let (mut s, mut now) = setup();
    let mut plan = StepPlan::default();
    let mut outs = Vec::with_capacity(SEQS);
    let mut k = 0;
    for _ in 0..iters {
        if k == STEPS_PER_SETUP {
            (s, now) = setup();
            k = 0;
        }
        let t = Instant::now();
        s.schedule_into(now, &mut plan);
        outs.clear();
        outs.extend(
            plan.seqs
                .iter()
                .filter(|q| q.samples)
                .map(|q| StepOutput::new(q.id, 1)),
        );
        now = now.saturating_add(10_000);
        black_box(s.apply_outputs(&plan, &outs, now));
        total += t.elapsed();
        assert_eq!(plan.seqs.len(), expect);
        k += 1;
    }
    total
}

fn planner_step(c: &mut Criterion) {
    let mut group = c.benchmark_group("planner_step_256_decodes");
    for policy in PolicyRegistry::with_builtins().names() {
        group.bench_function(policy, |b| {
            b.iter_custom(|iters| time_steps(iters, policy, &serde_yaml::Value::Null, SEQS))
        });
    }
    // A constrained step: a 128-token budget for 256 decodes forces the ranked path.
    let tight: serde_yaml::Value = serde_yaml::from_str("{token_budget: 128}").unwrap_or_default();
    group.bench_function("chunked-prefill, budget 128 (ranked path)", |b| {
        b.iter_custom(|iters| time_steps(iters, "chunked-prefill", &tight, 128))
    });
    group.bench_function("fcfs, allocating schedule()", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let (mut s, mut now) = decoding_scheduler("fcfs");
            let mut k = 0;
            for _ in 0..iters {
                if k == STEPS_PER_SETUP {
                    (s, now) = decoding_scheduler("fcfs");
                    k = 0;
                }
                let t = Instant::now();
                let plan = s.schedule(now);
                let outs: Vec<StepOutput> = plan
                    .seqs
                    .iter()
                    .filter(|q| q.samples)
                    .map(|q| StepOutput::new(q.id, 1))
                    .collect();
                now = now.saturating_add(10_000);
                black_box(s.apply_outputs(&plan, &outs, now));
                total += t.elapsed();
                k += 1;
            }
            total
        })
    });
    group.finish();
    let mut group = c.benchmark_group("planner_step_256_decodes_1000_waiting");
    // prefix-aware with and without its in-batch check (`hold_back_shared`, on by default).
    for (label, policy, params) in [
        ("fcfs", "fcfs", "null"),
        ("prefix-aware", "prefix-aware", "null"),
        (
            "prefix-aware, hold_back_shared off",
            "prefix-aware",
            "{hold_back_shared: false}",
        ),
        ("mlfq", "mlfq", "null"),
    ] {
        let params: serde_yaml::Value = serde_yaml::from_str(params).expect("params");
        group.bench_function(label, |b| {
            b.iter_custom(|iters| {
                time_steps_from(iters, SEQS, || saturated_scheduler(policy, &params))
            })
        });
    }
    group.finish();
}

/// Speculative decoding: 256 decodes whose outputs repeat (token 1), so every step proposes
/// 4 drafts per sequence (n-gram lookup) and the model accepts them all: one step plans,
/// resolves and appends 5 tokens per sequence. Rebuilt every 200 steps (blocks run out sooner).
fn planner_step_with_drafts(c: &mut Criterion) {
    let spec = SpeculativeConfig::default();
    let setup = || {
        let (mut s, mut now) =
            decoding_scheduler_spec("fcfs", &serde_yaml::Value::Null, Some(spec.clone()));
        // Until every sequence gets 4 drafts (the repeated suffix must occur 4 tokens back).
        for _ in 0..32 {
            let plan = s.schedule(now);
            let full = plan.num_batched_tokens == 5 * SEQS;
            let outs: Vec<StepOutput> = plan
                .seqs
                .iter()
                .map(|q| StepOutput {
                    id: q.id,
                    token: 1,
                    accepted: q.draft_tokens.len() as u32,
                })
                .collect();
            now = now.saturating_add(10_000);
            s.apply_outputs(&plan, &outs, now);
            if full {
                break;
            }
        }
        (s, now)
    };
    c.bench_function(
        "planner_step_256_decodes/fcfs, 4 drafts each, all accepted",
        |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let (mut s, mut now) = setup();
                let mut plan = StepPlan::default();
                let mut outs = Vec::with_capacity(SEQS);
                let mut k = 0;
                for _ in 0..iters {
                    if k == 200 {
                        (s, now) = setup();
                        k = 0;
                    }
                    let t = Instant::now();
                    s.schedule_into(now, &mut plan);
                    outs.clear();
                    outs.extend(plan.seqs.iter().map(|q| StepOutput {
                        id: q.id,
                        token: 1,
                        accepted: q.draft_tokens.len() as u32,
                    }));
                    now = now.saturating_add(10_000);
                    black_box(s.apply_outputs(&plan, &outs, now));
                    total += t.elapsed();
                    assert_eq!(plan.num_batched_tokens, 5 * SEQS);
                    k += 1;
                }
                total
            })
        },
    );
}

fn admission(c: &mut Criterion) {
    // Per request: add, prefill 2048 tokens (hashing 127 blocks, allocating 128), sample
    // one token and finish (max_tokens = 1), all full blocks entering the prefix cache.
    let config = SchedulerConfig {
        num_gpu_blocks: 16_384,
        max_model_len: 4096,
        ..SchedulerConfig::default()
    };
    let p = PolicyRegistry::with_builtins()
        .create("fcfs", &serde_yaml::Value::Null, &[])
        .unwrap();
    let mut s = Scheduler::new(config, p, [5, 6]).unwrap();
    let mut next = 0u64;
    let mut plan = StepPlan::default();
    c.bench_function("request_lifecycle/2048-token prompt, 1 output", |b| {
        b.iter(|| {
            next += 1;
            let prompt: Arc<[u32]> = (0..2048u32)
                .map(|k| k.wrapping_mul(2_654_435_761) ^ next as u32)
                .collect();
            s.add_request(request(next as usize, prompt, 1)).unwrap();
            s.schedule_into(Timestamp(next), &mut plan);
            let outs = [StepOutput::new(RequestId(next), 1)];
            black_box(s.apply_outputs(&plan, &outs, Timestamp(next)));
            s.forget(RequestId(next));
        })
    });
}

criterion_group!(benches, planner_step, planner_step_with_drafts, admission);
criterion_main!(benches);
