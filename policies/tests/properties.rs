//! Property tests over random workloads for every registered policy: no block leaked or
//! double-freed, refcounts equal block-table references, per-step budgets respected, every
//! admitted request ends, never more distinct LoRA adapters run than `max_loras`, no tier holds
//! more KV blocks than its `max_kv_fraction` allows (and the per-tier counts match the block
//! tables, across reloads of the tiers that change the bounds, reorder the tiers and remove
//! one), and hot
//! swaps to every other policy (with speculative decoding switched off and on) lose or
//! duplicate nothing; planning each step while the
//! previous one is in flight (`launch` / `resolve`) yields the same outputs as stepping in
//! order. With a host KV tier (some workloads), a shadow of every block's contents replayed
//! from the plans' copies and compute shows each scheduled request's blocks hold its own KV
//! over its computed tokens, and the copies respect the rules of `host_tier.rs`.
//!
//! Continuations (some workloads): requests whose prompt is another request's prompt and the
//! tokens it generates (multi-turn chat; beam search, which runs each step as one-token requests
//! over the prefix cache), so prefix hits land on blocks registered while decoding, next to
//! drafts rolled back, behind windows, after host-tier round trips, preemptions and aborts. A
//! block's shadow content is keyed by its namespace and its exact tokens, not by request: a block
//! in two tables of one plan holds the same tokens for both and is computed for both. With a
//! detached pool (the engine's allocator actor), the pool gets the commits as the engine sends
//! them and must equal the ledger after each. With failed steps (the engine's `fail_step`: their
//! requests and those of the step in flight aborted, the prefix cache cleared), nothing the
//! failed steps were to write is read by a request that goes on.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use proptest::prelude::*;
use switchyard_policies::*;

/// Step bound for one run; workloads are small, so a live scheduler ends far earlier.
const MAX_STEPS: u64 = 20_000;
/// Simulated milliseconds per step (deadlines and aging see time move).
const STEP_US: u64 = 5_000;
const EOS: TokenId = 0;

#[derive(Clone, Debug)]
struct Spec {
    arrival_step: u64,
    /// Shared-prefix group (tokens depend only on the group), for prefix-cache hits.
    group: u32,
    prefix_len: usize,
    suffix_len: usize,
    max_tokens: u32,
    priority: i32,
    tenant: u8,
    tier: u8,
    salted: bool,
    eos: bool,
    /// Abort or finish this many steps after arrival (None = run to completion).
    end_after: Option<(u64, bool)>,
    /// Needs logits for every prompt position (prompt logprobs).
    prompt_logits: bool,
    /// LoRA adapter, from a small set so that adapters compete for `max_loras` slots.
    adapter: Option<u32>,
    /// A continuation (see [`with_continuations`]): its parent's index modulo its own, the
    /// tokens its prompt takes past the parent's prompt, the steps after the parent's arrival
    /// it arrives, and whether it keeps the parent's namespace (adapter, tenant, cache salt).
    parent: Option<(usize, usize, u64, bool)>,
}

#[derive(Clone, Debug)]
struct Workload {
    block_size: usize,
    num_gpu_blocks: usize,
    max_num_seqs: usize,
    max_num_batched_tokens: usize,
    caching: bool,
    reqs: Vec<Spec>,
    swap_every: u64,
    /// Logit rows per step beyond one per seat.
    spare_logit_rows: usize,
    /// Most distinct LoRA adapters running at once.
    max_loras: usize,
    /// Speculative decoding (drafts by prompt lookup).
    speculative: Option<SpeculativeConfig>,
    /// Outputs repeat with this period (0: no pattern), so drafts are often right.
    period: u8,
    /// A sliding window: blocks behind it are given back while a request runs.
    window: Option<SlidingWindow>,
    /// Queue bounds in milliseconds: the scheduler's default, and the `batch` tier's own.
    max_queue_ms: (Option<u64>, Option<u64>),
    /// Each tier's KV quota (`max_kv_fraction`), in `tiers` order.
    kv_fractions: [Option<f64>; 3],
    /// A reload of the tiers at this step with these KV quotas (`Scheduler::set_tiers`).
    reload_kv: Option<(u64, [Option<f64>; 3])>,
    /// How that reload changes the set of tiers: the order they are listed in (an index into
    /// [`ORDERS`]) and the tier it removes, if any (`3`: none).
    reload_set: (usize, usize),
    /// Blocks of the host KV tier (0: none).
    host_blocks: usize,
    /// With a tier: cached blocks are stored there ahead of eviction
    /// ([`SchedulerConfig::kv_offload_ahead`]).
    ahead: bool,
    /// Each request's prompt, built from the specs by [`fill_prompts`].
    prompts: Vec<Vec<TokenId>>,
    /// Every this many steps, the step fails on the device (see [`with_failures`]).
    fail_every: Option<u64>,
}

fn spec() -> impl Strategy<Value = Spec> {
    (
        (0u64..40, 0u32..3, 0usize..24, 1usize..20, 1u32..12),
        (-2i32..3, 0u8..3, 0u8..3, any::<bool>(), any::<bool>()),
        (
            prop::option::weighted(0.2, (0u64..30, any::<bool>())),
            prop::bool::weighted(0.2),
            prop::option::weighted(0.6, 0u32..5),
        ),
    )
        .prop_map(
            |(
                (arrival_step, group, prefix_len, suffix_len, max_tokens),
                (priority, tenant, tier, salted, eos),
                (end_after, prompt_logits, adapter),
            )| Spec {
                arrival_step,
                group,
                prefix_len,
                suffix_len,
                max_tokens,
                priority,
                tenant,
                tier,
                salted,
                eos,
                end_after,
                prompt_logits,
                adapter,
                parent: None,
            },
        )
}

fn workload() -> impl Strategy<Value = Workload> {
    (
        prop::sample::select(vec![1usize, 2, 4, 8]),
        4usize..48,
        1usize..8,
        1usize..64,
        any::<bool>(),
        prop::collection::vec(spec(), 1..24),
        (1u64..40, 1usize..16, 1usize..=3),
        (
            prop::option::weighted(
                0.5,
                (
                    1usize..=5,
                    1usize..=2,
                    0usize..=2,
                    prop::sample::select(vec![0usize, 2, 6]),
                ),
            ),
            prop::sample::select(vec![0u8, 2, 3, 5]),
            prop::option::weighted(0.4, (1usize..24, 0usize..10)),
        ),
        (
            prop::option::weighted(0.5, 1u64..200),
            prop::option::weighted(0.5, 1u64..200),
        ),
        (
            prop::array::uniform3(prop::option::weighted(0.4, 0.02f64..=1.0)),
            prop::option::weighted(
                0.3,
                (
                    1u64..40,
                    prop::array::uniform3(prop::option::weighted(0.5, 0.02f64..=1.0)),
                ),
            ),
            (
                0usize..ORDERS.len(),
                prop::sample::select(vec![0usize, 1, 2, 3, 3, 3]),
            ),
        ),
        (
            prop::sample::select(vec![0usize, 0, 1, 3, 16]),
            any::<bool>(),
        ),
    )
        .prop_map(
            |(
                block_size,
                num_gpu_blocks,
                max_num_seqs,
                max_num_batched_tokens,
                caching,
                reqs,
                (swap_every, spare_logit_rows, max_loras),
                (speculative, period, window),
                max_queue_ms,
                (kv_fractions, reload_kv, reload_set),
                (host_blocks, ahead),
            )| Workload {
                block_size,
                num_gpu_blocks,
                max_num_seqs,
                max_num_batched_tokens,
                caching,
                reqs,
                swap_every,
                spare_logit_rows,
                max_loras,
                speculative: speculative.map(|(k, min, extra, max_running)| SpeculativeConfig {
                    num_speculative_tokens: k,
                    prompt_lookup_min: min,
                    prompt_lookup_max: min + extra,
                    max_running,
                }),
                period,
                window: window.map(|(tokens, read_slack)| SlidingWindow { tokens, read_slack }),
                max_queue_ms,
                kv_fractions,
                reload_kv,
                reload_set,
                host_blocks,
                ahead,
                prompts: Vec::new(),
                fail_every: None,
            },
        )
        .prop_map(fill_prompts)
}

/// Longest prompt a continuation takes from its parent's sequence.
const MAX_TAKEN: usize = 40;

/// Builds every request's prompt: its group's shared prefix then its own suffix; for a
/// continuation, its parent's prompt and the tokens the parent generates after it (as
/// [`token`] makes them, at most [`MAX_TAKEN`] tokens in all) then at most two of its own, and
/// it arrives after its parent, mostly in its namespace. Every strategy ends with it.
fn fill_prompts(mut w: Workload) -> Workload {
    w.prompts.clear();
    for i in 0..w.reqs.len() {
        let own = |k: usize| 50_000 + (i * 100 + k) as TokenId;
        let r = &w.reqs[i];
        let (mut prompt, suffix) = match r.parent {
            Some((p, take, delay, same_ns)) if i > 0 => {
                let p = p % i;
                let parent = &w.reqs[p];
                let mut base = w.prompts[p].clone();
                let plen = base.len();
                let taken = take.min(parent.max_tokens as usize);
                base.extend((plen..plen + taken).map(|pos| token(&w, RequestId(p as u64), pos)));
                base.truncate(MAX_TAKEN);
                let (arrival, adapter, tenant, salted) = (
                    parent.arrival_step + delay,
                    parent.adapter,
                    parent.tenant,
                    parent.salted,
                );
                let r = &mut w.reqs[i];
                r.arrival_step = arrival;
                if same_ns {
                    r.adapter = adapter;
                    r.tenant = tenant;
                    r.salted = salted;
                }
                (base, r.suffix_len % 3)
            }
            _ => (
                (0..r.prefix_len)
                    .map(|k| 1 + r.group * 1000 + k as u32)
                    .collect(),
                r.suffix_len,
            ),
        };
        prompt.extend((0..suffix).map(own));
        if prompt.is_empty() {
            prompt.push(own(0));
        }
        w.prompts.push(prompt);
    }
    w
}

/// `workloads` where a step fails on the device now and then, as the engine's `fail_step`
/// handles it: every request of that step and of the step in flight beside it is aborted, the
/// launched steps are forgotten and the prefix cache is cleared; nothing those steps were to
/// write or copy holds anything after (the shadow forgets it), and no request that goes on may
/// read it.
fn with_failures(workloads: impl Strategy<Value = Workload>) -> impl Strategy<Value = Workload> {
    (workloads, 3u64..16).prop_map(|(mut w, k)| {
        w.fail_every = Some(k);
        w
    })
}

/// `workloads` with continuations: more than half the requests continue an earlier one (of
/// the first few, so that several continue one, as a beam search's steps do).
fn with_continuations(
    workloads: impl Strategy<Value = Workload>,
) -> impl Strategy<Value = Workload> {
    (
        workloads,
        prop::collection::vec(
            prop::option::weighted(
                0.6,
                (0usize..4, 0usize..16, 0u64..12, prop::bool::weighted(0.85)),
            ),
            24,
        ),
    )
        .prop_map(|(mut w, parents)| {
            for (r, p) in w.reqs.iter_mut().zip(parents) {
                r.parent = p;
            }
            fill_prompts(w)
        })
}

/// A popular prefix coming back from the host tier: prefix caching and a tier always, every
/// request in bursts (arrivals at 4 steps only) of two shared-prefix groups, in one cache
/// namespace (no adapter, no salt), so requests with a prefix the tier holds are often admitted
/// in one plan.
fn burst_workload() -> impl Strategy<Value = Workload> {
    (workload(), prop::sample::select(vec![2usize, 4, 16])).prop_map(|(mut w, host_blocks)| {
        w.caching = true;
        w.host_blocks = host_blocks;
        for r in &mut w.reqs {
            r.arrival_step = (r.arrival_step % 4) * 12;
            r.group %= 2;
            r.prefix_len += 8;
            r.adapter = None;
            r.salted = false;
        }
        fill_prompts(w)
    })
}

/// [`burst_workload`] under preemption: every other request arrives first, of a less urgent
/// priority, a prefix of its own and a long output, so that it runs while the others, of the
/// two shared prefixes, come (a first few at step 1, whose blocks the tier may get back as
/// they are evicted, the rest at steps 3 and 4); an admission of the later ones then often
/// preempts a running one after others of the same plan shared a block loaded from the tier
/// (the case that once sent the sharer's entry placeholders and another entry its blocks).
fn preempting_burst_workload() -> impl Strategy<Value = Workload> {
    burst_workload().prop_map(|mut w| {
        for (i, r) in w.reqs.iter_mut().enumerate() {
            if i % 2 == 0 {
                r.arrival_step = 0;
                r.priority = 2;
                r.group = 2;
                r.max_tokens += 20;
                r.end_after = None;
            } else {
                // Bursts at steps 2 to 8: before aging (20 ms, 4 steps a level) raises the
                // running ones to their priority.
                r.arrival_step = if i % 4 == 1 {
                    1
                } else {
                    3 + r.arrival_step % 2
                };
                r.priority = -2;
            }
        }
        fill_prompts(w)
    })
}

fn tiers(batch_max_queue_ms: Option<u64>, kv_fractions: [Option<f64>; 3]) -> Vec<TierSpec> {
    let t = |name: &str, ttft, tpot, preemptible| TierSpec {
        name: name.into(),
        ttft_ms: ttft,
        tpot_ms: tpot,
        weight: 1.0,
        preemptible,
        max_queue_ms: if preemptible {
            batch_max_queue_ms
        } else {
            None
        },
        max_kv_fraction: None,
    };
    let mut tiers = vec![
        t("premium", Some(50.0), Some(10.0), false),
        t("standard", Some(500.0), None, false),
        t("batch", None, None, true),
    ];
    for (t, f) in tiers.iter_mut().zip(kv_fractions) {
        t.max_kv_fraction = f;
    }
    tiers
}

/// The KV blocks each tier may hold: `max_kv_fraction` of the cache, rounded down, at least
/// one; `usize::MAX` without a bound.
fn kv_quotas(w: &Workload, fractions: [Option<f64>; 3]) -> [usize; 3] {
    fractions.map(|f| {
        f.map_or(usize::MAX, |f| {
            ((f * w.num_gpu_blocks as f64).floor() as usize).max(1)
        })
    })
}

/// The orders a reload may list the tiers in (positions in [`tiers`]' list).
const ORDERS: [[usize; 3]; 6] = [
    [0, 1, 2],
    [0, 2, 1],
    [1, 0, 2],
    [1, 2, 0],
    [2, 0, 1],
    [2, 1, 0],
];

/// The tiers a reload puts in force: [`tiers`]' with `fractions`, listed in `ORDERS[order]`,
/// less the one at `removed` (none for 3); and, in the same order, their positions in
/// [`tiers`]' list.
fn reloaded_tiers(
    batch_max_queue_ms: Option<u64>,
    fractions: [Option<f64>; 3],
    (order, removed): (usize, usize),
) -> (Vec<TierSpec>, Vec<usize>) {
    let all = tiers(batch_max_queue_ms, fractions);
    let in_force: Vec<usize> = ORDERS[order]
        .iter()
        .copied()
        .filter(|&t| t != removed)
        .collect();
    (in_force.iter().map(|&t| all[t].clone()).collect(), in_force)
}

/// Each tier's KV bound in blocks, by its position in [`tiers`]' list: `usize::MAX` for one
/// without a bound or not in force (its requests count in no tier).
fn bounds_in_force(w: &Workload, check: &TierCheck) -> [usize; 3] {
    let mut bounds = kv_quotas(w, check.fractions);
    for (t, b) in bounds.iter_mut().enumerate() {
        if !check.in_force.contains(&t) {
            *b = usize::MAX;
        }
    }
    bounds
}

/// The fewest blocks a tier's quota must have for `r` to run to its end alone.
fn quota_need(w: &Workload, i: usize) -> usize {
    let r = &w.reqs[i];
    let blocks = (w.prompts[i].len() + r.max_tokens as usize).div_ceil(w.block_size);
    match w.window {
        Some(win) => blocks.min(win.blocks_held(w.block_size, w.max_num_batched_tokens)),
        None => blocks,
    }
}

/// What [`check_tier_blocks`] remembers from one check to the next.
struct TierCheck {
    /// The KV quotas in force (`max_kv_fraction`).
    fractions: [Option<f64>; 3],
    /// The requests admitted before a reload of the quotas, once there was one.
    before_reload: Option<BTreeSet<RequestId>>,
    /// Per tier, the blocks it held and its bound at the previous check.
    previous: [(usize, usize); 3],
    /// The tiers in force, in the scheduler's order, by their positions in [`tiers`]' list
    /// (a reload may reorder them and remove one).
    in_force: Vec<usize>,
}

/// No tier holds more than its quota, and what the scheduler counts per tier is what the
/// running requests' block tables hold (less blocks given back behind a window). After a
/// reload lowered a quota, a tier's bound is at least what its largest live request queued
/// before needs alone, and a tier above its bound never holds more than it held, or than its
/// bound was, at the previous check (it gets no block while over).
fn check_tier_blocks(
    w: &Workload,
    s: &Scheduler,
    admitted: &BTreeMap<RequestId, &Spec>,
    ended: &BTreeMap<RequestId, FinishReason>,
    check: &mut TierCheck,
) -> Result<(), TestCaseError> {
    let mut held = [0usize; 3];
    for (id, r) in admitted {
        if s.request_state(*id) == Some(RequestState::Running) {
            let table = s.block_table(*id).unwrap_or_default();
            held[r.tier as usize] += table.iter().filter(|&&b| b != RELEASED_BLOCK).count();
        }
    }
    let counted: Vec<usize> = check.in_force.iter().map(|&t| held[t]).collect();
    prop_assert_eq!(s.tier_kv_blocks(), &counted[..], "per-tier KV blocks");
    let mut bounds = bounds_in_force(w, check);
    if let Some(before) = &check.before_reload {
        for id in before.iter().filter(|id| !ended.contains_key(id)) {
            let r = admitted[id];
            let b = &mut bounds[r.tier as usize];
            if *b != usize::MAX {
                *b = (*b).max(quota_need(w, id.0 as usize));
            }
        }
    }
    for (t, (&h, q)) in held.iter().zip(bounds).enumerate() {
        let (last_held, last_bound) = check.previous[t];
        prop_assert!(
            h <= q || h <= last_held.max(last_bound),
            "tier {} holds {} blocks, over its quota of {} (held {} of {} before)",
            t,
            h,
            q,
            last_held,
            last_bound
        );
        check.previous[t] = (h, q);
    }
    Ok(())
}

/// The registered policies, and `prefix-aware` with chunked steps and without its hold-back
/// as well.
fn variants() -> Vec<&'static str> {
    let mut names = PolicyRegistry::with_builtins().names();
    names.push(PREFIX_AWARE_CHUNKED);
    names.push(PREFIX_AWARE_NO_HOLD_BACK);
    names.push(MLFQ_PREEMPT);
    names
}

/// `prefix-aware` with a `token_budget` (a variant of [`variants`]).
const PREFIX_AWARE_CHUNKED: &str = "prefix-aware+token_budget";
/// `prefix-aware` with `hold_back_shared: false` (a variant of [`variants`]).
const PREFIX_AWARE_NO_HOLD_BACK: &str = "prefix-aware+hold_back_off";
/// `mlfq` with `preempt: true` (a variant of [`variants`]): a waiting request of a better
/// level evicts running work, and aging alike must keep evictions from alternating for ever.
const MLFQ_PREEMPT: &str = "mlfq+preempt";

fn make_policy(name: &str) -> Box<dyn Policy> {
    let reg = PolicyRegistry::with_builtins();
    if name == PREFIX_AWARE_CHUNKED {
        let params = serde_yaml::from_str("{max_wait_ms: 20, lookup_limit: 3, token_budget: 8}");
        return reg
            .create("prefix-aware", &params.unwrap(), &tiers(None, [None; 3]))
            .unwrap();
    }
    if name == MLFQ_PREEMPT {
        let params = serde_yaml::from_str(
            "{levels: 4, quantum_tokens: 2, prompt_tokens_per_level: 8, aging_interval_ms: 20, \
             preempt: true}",
        );
        return reg
            .create("mlfq", &params.unwrap(), &tiers(None, [None; 3]))
            .unwrap();
    }
    if name == PREFIX_AWARE_NO_HOLD_BACK {
        let params =
            serde_yaml::from_str("{max_wait_ms: 20, lookup_limit: 3, hold_back_shared: false}");
        return reg
            .create("prefix-aware", &params.unwrap(), &tiers(None, [None; 3]))
            .unwrap();
    }
    let params: serde_yaml::Value = match name {
        // Short aging so that aging actually happens within a run.
        "priority" => serde_yaml::from_str("{aging_interval_ms: 20}").unwrap(),
        "chunked-prefill" => serde_yaml::from_str("{token_budget: 8}").unwrap(),
        "slo-aware" => serde_yaml::from_str(
            "{step_overhead_ms: 5, prefill_us_per_token: 100, min_chunk_tokens: 2}",
        )
        .unwrap(),
        "fair-share" => serde_yaml::from_str("{tenant_weights: {t0: 2}}").unwrap(),
        // Aging within a run (4 steps), and fewer lookups than requests wait.
        "prefix-aware" => serde_yaml::from_str("{max_wait_ms: 20, lookup_limit: 3}").unwrap(),
        // Small quanta and aging within a run, so requests move down and back up.
        "mlfq" => serde_yaml::from_str(
            "{levels: 4, quantum_tokens: 2, prompt_tokens_per_level: 8, aging_interval_ms: 20}",
        )
        .unwrap(),
        _ => serde_yaml::Value::Null,
    };
    reg.create(name, &params, &tiers(None, [None; 3])).unwrap()
}

fn request(w: &Workload, i: usize) -> Request {
    let s = &w.reqs[i];
    let prompt = w.prompts[i].clone();
    Request {
        id: RequestId(i as u64),
        tenant: format!("t{}", s.tenant),
        tier: ["premium", "standard", "batch"][s.tier as usize].into(),
        priority: s.priority,
        lora_adapter: s.adapter,
        arrival: Timestamp(s.arrival_step * STEP_US),
        slo: SloTargets::default(),
        prompt: Arc::from(prompt),
        limits: SamplingLimits {
            max_tokens: s.max_tokens,
            min_tokens: 0,
            stop_token_ids: vec![],
            eos_token_id: s.eos.then_some(EOS),
            ignore_eos: false,
            prompt_logits: s.prompt_logits,
            speculate: true,
        },
        cache_salt: s.salted.then_some(s.tenant as u64 + 1),
    }
}

/// Deterministic "sampled" token at position `pos` of a request: EOS now and then,
/// otherwise a small vocabulary. A function of the position (not the step), so runs that
/// schedule differently produce the same tokens; with a period, outputs repeat (and drafts
/// proposed from them are mostly right).
fn token(w: &Workload, id: RequestId, pos: usize) -> TokenId {
    let pos = if w.period > 0 {
        pos % w.period as usize
    } else {
        pos
    };
    let h =
        id.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (pos as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (h >> 59) as TokenId // 0..32, EOS with probability 1/32
}

/// Per admitted request: its outputs and how it ended.
type Ended = BTreeMap<RequestId, (Vec<TokenId>, FinishReason)>;

fn check_plan(
    w: &Workload,
    s: &Scheduler,
    plan: &StepPlan,
    mirrors: &mut HashMap<RequestId, Vec<BlockId>>,
) -> Result<(), TestCaseError> {
    prop_assert!(plan.seqs.len() <= w.max_num_seqs, "max_num_seqs exceeded");
    let sum: usize = plan.seqs.iter().map(|q| q.num_new_tokens).sum();
    prop_assert_eq!(sum, plan.num_batched_tokens);
    prop_assert!(
        sum <= w.max_num_batched_tokens,
        "token budget exceeded: {} > {}",
        sum,
        w.max_num_batched_tokens
    );
    // Rows of logits the backend may compute: every token of a prompt-logprob chunk, else
    // the sampled row and the drafts'. Each entry keeps one row of its seat; the rest share
    // the spare ones.
    let logit_rows: usize = plan
        .seqs
        .iter()
        .map(|q| {
            if w.reqs[q.id.0 as usize].prompt_logits {
                q.num_new_tokens
            } else if q.samples {
                1 + q.draft_tokens.len()
            } else {
                0
            }
        })
        .sum();
    prop_assert!(
        logit_rows <= plan.seqs.len() + w.spare_logit_rows,
        "{} rows of logits for {} entries, {} spare",
        logit_rows,
        plan.seqs.len(),
        w.spare_logit_rows
    );
    for q in &plan.seqs {
        if q.draft_tokens.is_empty() {
            continue;
        }
        let k = w
            .speculative
            .as_ref()
            .map_or(0, |c| c.num_speculative_tokens);
        prop_assert!(q.draft_tokens.len() <= k, "more drafts than configured");
        prop_assert!(q.samples && !q.is_prefill, "drafts on a prefill");
        prop_assert_eq!(q.num_new_tokens, 1 + q.draft_tokens.len());
        let spec = &w.reqs[q.id.0 as usize];
        let out = s.output_tokens(q.id).unwrap_or(&[]);
        prop_assert!(
            out.len() + 1 + q.draft_tokens.len() <= spec.max_tokens as usize,
            "drafts past max_tokens"
        );
    }
    let ids: BTreeSet<RequestId> = plan.seqs.iter().map(|q| q.id).collect();
    prop_assert_eq!(ids.len(), plan.seqs.len(), "a request scheduled twice");
    for p in &plan.preempted {
        prop_assert!(!ids.contains(p), "preempted request still scheduled");
    }
    // The ledger: a detached pool gets the references of blocks shared as they are loaded
    // with the next commit.
    let pool = s.ledger();
    let mut uses: HashMap<BlockId, u32> = HashMap::new();
    for q in &plan.seqs {
        prop_assert!(q.num_new_tokens >= 1);
        // Rebuild the request's table from the plan's deltas, as the engine does.
        let table = mirrors.entry(q.id).or_default();
        prop_assert!(
            q.first_new_block <= table.len(),
            "delta starts past the mirror"
        );
        table.truncate(q.first_new_block);
        table.extend_from_slice(&q.new_blocks);
        prop_assert!(
            !q.new_blocks.contains(&RELEASED_BLOCK),
            "a released entry sent"
        );
        // The scheduler's table, with the blocks given back behind a sliding window as
        // RELEASED_BLOCK: the mirror still holds their old ids, which the backend never reads.
        let sched = s.block_table(q.id).unwrap_or(&[]);
        let released = sched.iter().take_while(|&&b| b == RELEASED_BLOCK).count();
        prop_assert_eq!(table.len(), sched.len(), "mirror differs");
        prop_assert_eq!(&table[released..], &sched[released..], "mirror differs");
        let need = (q.num_computed_tokens + q.num_new_tokens).div_ceil(w.block_size);
        prop_assert!(table.len() >= need, "block table too short");
        let held = &table[released..];
        let distinct: BTreeSet<_> = held.iter().collect();
        prop_assert_eq!(distinct.len(), held.len(), "block twice in one table");
        for &b in held {
            *uses.entry(b).or_default() += 1;
        }
        match w.window {
            // Every key the step's queries attend to, and the `read_slack` keys before the
            // first one's window, are in blocks it holds; once running, it holds at most
            // `blocks_held`.
            Some(win) => {
                prop_assert!(
                    released == 0
                        || released * w.block_size + win.tokens + win.read_slack
                            <= q.num_computed_tokens,
                    "{} blocks released at {} computed, window {:?}",
                    released,
                    q.num_computed_tokens,
                    win
                );
                if q.first_new_block > 0 {
                    let cap = win.blocks_held(w.block_size, w.max_num_batched_tokens);
                    prop_assert!(
                        held.len() <= cap,
                        "{} blocks held, at most {}",
                        held.len(),
                        cap
                    );
                }
            }
            None => prop_assert_eq!(released, 0, "released without a window"),
        }
        prop_assert_eq!(s.request_state(q.id), Some(RequestState::Running));
    }
    check_shared_blocks(w, s, plan, mirrors, &uses)?;
    for (&b, &n) in &uses {
        let rc = pool.ref_count(b).unwrap_or(0);
        prop_assert!(
            rc >= n,
            "block {} used by {} tables but refcount {}",
            b,
            n,
            rc
        );
    }
    prop_assert!(pool.num_free() + uses.len() <= pool.num_blocks());
    Ok(())
}

/// A block in the tables of two requests of the plan (`uses` counts the tables) sits at the
/// same position in both, holds the same tokens under the same namespace for both, and was
/// computed before the step for both (a prefix hit or a load): no step writes a block another
/// request reads.
fn check_shared_blocks(
    w: &Workload,
    s: &Scheduler,
    plan: &StepPlan,
    mirrors: &HashMap<RequestId, Vec<BlockId>>,
    uses: &HashMap<BlockId, u32>,
) -> Result<(), TestCaseError> {
    let mut holder: HashMap<BlockId, (RequestId, usize)> = HashMap::new();
    for q in &plan.seqs {
        let released = s
            .block_table(q.id)
            .unwrap_or(&[])
            .iter()
            .take_while(|&&b| b == RELEASED_BLOCK)
            .count();
        for (k, &b) in mirrors[&q.id].iter().enumerate().skip(released) {
            if uses.get(&b).is_none_or(|&n| n < 2) {
                continue;
            }
            prop_assert!(
                (k + 1) * w.block_size <= q.num_computed_tokens,
                "{:?}: block {} (device {}) is shared, {} tokens computed",
                q.id,
                k,
                b,
                q.num_computed_tokens
            );
            match holder.get(&b) {
                Some(&(other, at)) => {
                    prop_assert_eq!(at, k, "device block {} at two positions", b);
                    prop_assert_eq!(
                        content(w, other, k),
                        content(w, q.id, k),
                        "device block {} shared by {:?} and {:?} over other tokens",
                        b,
                        other,
                        q.id
                    );
                }
                None => {
                    holder.insert(b, (q.id, k));
                }
            }
        }
    }
    Ok(())
}

/// What the device's KV blocks and the host tier's hold, replayed from the plans alone, in
/// the order a backend executes them (each plan's offloads, then its loads, then its stores
/// ahead of eviction, then its compute, which may run alongside them; plans in the order
/// made, a plan made ahead after the step in flight). A block's content is
/// `Some(c)` once it holds a whole block of KV computed from known tokens, `c` a digest of
/// its request's namespace (adapter, cache salt) and every token up to the block's end: the
/// same for any request that may share it.
struct Shadow {
    device: Vec<Option<u64>>,
    host: Vec<Option<u64>>,
}

/// The digest of block `k` of request `id` (see [`Shadow`]), from the workload alone.
fn content(w: &Workload, id: RequestId, k: usize) -> u64 {
    use std::hash::{Hash, Hasher};
    let i = id.0 as usize;
    let r = &w.reqs[i];
    let prompt = &w.prompts[i];
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (r.adapter, r.salted.then_some(r.tenant)).hash(&mut h);
    for p in 0..(k + 1) * w.block_size {
        let t = match prompt.get(p) {
            Some(&t) => t,
            None => token(w, id, p),
        };
        t.hash(&mut h);
    }
    h.finish()
}

/// A failed step's effects on the shadow: every block its copies and its compute were to write
/// holds nothing known (the device may have written part of it, or nothing).
fn forget_writes(
    shadow: &mut Shadow,
    plan: &StepPlan,
    mirrors: &HashMap<RequestId, Vec<BlockId>>,
    block_size: usize,
) {
    for c in plan.kv_offloads.iter().chain(&plan.kv_stores) {
        shadow.host[c.host as usize] = None;
    }
    for c in &plan.kv_loads {
        shadow.device[c.device as usize] = None;
    }
    for q in &plan.seqs {
        let Some(table) = mirrors.get(&q.id) else {
            continue;
        };
        let end = (q.num_computed_tokens + q.num_new_tokens).div_ceil(block_size);
        for &b in table
            .iter()
            .take(end)
            .skip(q.num_computed_tokens / block_size)
        {
            shadow.device[b as usize] = None;
        }
    }
}

/// Applies `plan`'s copies to the shadow and checks them (ids in range, no block written twice,
/// no tier block loaded twice, no load source overwritten by an offload, only whole computed
/// blocks copied), then that every scheduled request's table holds its own KV over its
/// computed tokens (prefix hits from the device cache and from the host tier alike), then
/// applies the plan's compute.
fn check_contents(
    w: &Workload,
    s: &Scheduler,
    plan: &StepPlan,
    mirrors: &HashMap<RequestId, Vec<BlockId>>,
    shadow: &mut Shadow,
) -> Result<(), TestCaseError> {
    if w.host_blocks == 0 {
        prop_assert!(plan.kv_offloads.is_empty() && plan.kv_loads.is_empty());
    }
    if w.host_blocks == 0 || !w.ahead {
        prop_assert!(plan.kv_stores.is_empty());
    }
    let mut written_host = BTreeSet::new();
    let mut written_device = BTreeSet::new();
    let mut loaded_host = BTreeSet::new();
    for c in &plan.kv_offloads {
        prop_assert!((c.device as usize) < w.num_gpu_blocks && (c.host as usize) < w.host_blocks);
        prop_assert!(
            written_host.insert(c.host),
            "host block {} written twice",
            c.host
        );
        let held = shadow.device[c.device as usize];
        prop_assert!(
            held.is_some(),
            "offload of device block {} holding no whole block",
            c.device
        );
        shadow.host[c.host as usize] = held;
    }
    for c in &plan.kv_loads {
        prop_assert!((c.device as usize) < w.num_gpu_blocks && (c.host as usize) < w.host_blocks);
        prop_assert!(
            !written_host.contains(&c.host),
            "host block {} is an offload destination and a load source of one plan",
            c.host
        );
        prop_assert!(
            written_device.insert(c.device),
            "device block {} loaded twice",
            c.device
        );
        // Requests admitted together with the same prefix in the tier share its loads.
        prop_assert!(
            loaded_host.insert(c.host),
            "host block {} loaded twice by one plan",
            c.host
        );
        let held = shadow.host[c.host as usize];
        prop_assert!(
            held.is_some(),
            "load from host block {} holding nothing",
            c.host
        );
        shadow.device[c.device as usize] = held;
    }
    // Stores run alongside the step: they touch no block another copy of the plan touches,
    // read whole blocks (written by steps launched before: this plan's step, which the
    // shadow has not applied yet, must not be the one that fills them), and the step writes
    // none of them (checked after its compute below).
    let offloaded: BTreeSet<_> = plan.kv_offloads.iter().map(|c| c.device).collect();
    let mut stored_device = BTreeSet::new();
    for c in &plan.kv_stores {
        prop_assert!((c.device as usize) < w.num_gpu_blocks && (c.host as usize) < w.host_blocks);
        prop_assert!(
            written_host.insert(c.host) && !loaded_host.contains(&c.host),
            "host block {} stored to and copied otherwise in one plan",
            c.host
        );
        prop_assert!(
            !written_device.contains(&c.device) && !offloaded.contains(&c.device),
            "device block {} stored and copied otherwise in one plan",
            c.device
        );
        prop_assert!(
            stored_device.insert(c.device),
            "device block {} stored twice",
            c.device
        );
        let held = shadow.device[c.device as usize];
        prop_assert!(
            held.is_some(),
            "store of device block {} holding no whole block",
            c.device
        );
        shadow.host[c.host as usize] = held;
    }
    let st = s.stats();
    prop_assert!(
        st.num_host_blocks_used <= w.host_blocks,
        "host blocks over capacity"
    );
    let bs = w.block_size;
    for q in &plan.seqs {
        let table = &mirrors[&q.id];
        let released = s
            .block_table(q.id)
            .unwrap_or(&[])
            .iter()
            .take_while(|&&b| b == RELEASED_BLOCK)
            .count();
        let computed = (q.num_computed_tokens / bs).min(table.len());
        for (k, &blk) in table.iter().enumerate().take(computed).skip(released) {
            prop_assert_eq!(
                shadow.device[blk as usize],
                Some(content(w, q.id, k)),
                "{:?}: block {} (device {}) does not hold its KV at {} computed",
                q.id,
                k,
                blk,
                q.num_computed_tokens
            );
        }
    }
    // The compute: every block the step writes holds its KV once all its positions were fed
    // the request's own tokens (a wrong draft spoils its position and every later one).
    for q in &plan.seqs {
        let table = &mirrors[&q.id];
        let start = q.num_computed_tokens;
        let end = start + q.num_new_tokens;
        let known = end - q.draft_tokens.len();
        let right = q
            .draft_tokens
            .iter()
            .enumerate()
            .take_while(|&(j, &d)| d == token(w, q.id, known + j))
            .count();
        let written = end.div_ceil(bs).min(table.len());
        for (k, &blk) in table.iter().enumerate().take(written).skip(start / bs) {
            prop_assert!(
                !stored_device.contains(&blk),
                "{:?}: the step writes device block {}, which its plan stores",
                q.id,
                blk
            );
            let whole = (k + 1) * bs <= known + right;
            shadow.device[blk as usize] = whole.then(|| content(w, q.id, k));
        }
    }
    Ok(())
}

/// A request's reported cached prompt tokens (`SeqEvent::FirstToken`): what its first
/// admission matched (the computed tokens of its first plan entry), whole blocks, short of its
/// last prompt token, none without prefix caching, and only what another request of its
/// namespace (LoRA adapter and cache salt) could have computed: at most the tokens its prompt
/// shares with the prompt and the possible outputs of another request of that namespace.
fn check_cached(
    w: &Workload,
    id: RequestId,
    reported: u32,
    first_planned: &HashMap<RequestId, usize>,
) -> Result<(), TestCaseError> {
    let i = id.0 as usize;
    let me = &w.reqs[i];
    let prompt = w.prompts[i].len();
    let reported = reported as usize;
    let planned = first_planned.get(&id).copied();
    prop_assert_eq!(
        Some(reported),
        planned.map(|p| p.min(prompt)),
        "{:?}: reported cached tokens are not its first admission's",
        id
    );
    prop_assert!(
        reported.is_multiple_of(w.block_size),
        "{:?}: {}",
        id,
        reported
    );
    prop_assert!(reported < prompt, "{:?}: {} of {}", id, reported, prompt);
    if !w.caching {
        prop_assert_eq!(reported, 0);
    }
    let namespace = |r: &Spec| (r.adapter, r.salted.then_some(r.tenant));
    let mine = &w.prompts[i];
    let shared = w
        .reqs
        .iter()
        .enumerate()
        .filter(|&(j, r)| j != i && namespace(r) == namespace(me))
        .map(|(j, r)| {
            let theirs = &w.prompts[j];
            let end = (theirs.len() + r.max_tokens as usize).min(prompt);
            (0..end)
                .take_while(|&p| {
                    let t = theirs
                        .get(p)
                        .copied()
                        .unwrap_or_else(|| token(w, RequestId(j as u64), p));
                    t == mine[p]
                })
                .count()
        })
        .max()
        .unwrap_or(0);
    prop_assert!(
        reported <= shared,
        "{:?} reported {} cached tokens; at most {} were computed in its namespace",
        id,
        reported,
        shared
    );
    Ok(())
}

/// The running set never holds more than `max_loras` distinct adapters (recounted from the
/// requests' states, not from the scheduler's own counts), and the stats agree.
fn check_adapters(
    w: &Workload,
    s: &Scheduler,
    admitted: &BTreeMap<RequestId, &Spec>,
) -> Result<(), TestCaseError> {
    let mut running = BTreeSet::new();
    let mut waiting = 0;
    for (&id, spec) in admitted {
        let Some(a) = spec.adapter else { continue };
        match s.request_state(id) {
            Some(RequestState::Running) => {
                running.insert(a);
            }
            Some(RequestState::Waiting | RequestState::Preempted) => waiting += 1,
            _ => {}
        }
    }
    prop_assert!(
        running.len() <= w.max_loras,
        "adapters {:?} running, max_loras {}",
        running,
        w.max_loras
    );
    let st = s.stats();
    prop_assert_eq!(st.num_running_adapters, running.len());
    prop_assert_eq!(st.num_waiting_adapter_requests, waiting);
    Ok(())
}

/// Runs the workload under `first`, swapping through `swaps` every `swap_every` steps; with
/// `pipelined`, each step is planned while the previous one is in flight (launched, its
/// outputs resolved after the next launch).
/// Plans a step (ahead of the one in flight with `ahead`: `None` when it cannot be), committed
/// to the scheduler's own pool or, detached, to `pool`, as the engine's allocator actor does,
/// after which the ledger must equal the pool (unless it holds references of blocks shared as
/// they are loaded, which reach the pool with the next commit).
fn plan_step(
    s: &mut Scheduler,
    pool: Option<&mut BlockPool>,
    now: Timestamp,
    ahead: bool,
) -> Result<Option<StepPlan>, TestCaseError> {
    let fail = |e: SchedulerError| TestCaseError::fail(e.to_string());
    let Some(pool) = pool else {
        return Ok(if ahead {
            s.schedule_ahead(now)
        } else {
            Some(s.schedule(now))
        });
    };
    let mut plan = StepPlan::default();
    let commit = if ahead {
        match s.plan_ahead_into(now, &mut plan) {
            Some(c) => c,
            None => return Ok(None),
        }
    } else {
        s.plan_into(now, &mut plan)
    };
    let mut ids = Vec::new();
    pool.commit(&commit, &mut ids).map_err(fail)?;
    s.assign_blocks(&mut plan, &ids).map_err(fail)?;
    pool.check_invariants().map_err(fail)?;
    if !s.ledger().has_uncommitted() {
        s.ledger().check_against(pool).map_err(fail)?;
    }
    Ok(Some(plan))
}

fn run(w: &Workload, first: &str, swaps: &[&str], pipelined: bool) -> Result<Ended, TestCaseError> {
    run_with(w, first, swaps, pipelined, false)
}

/// [`run`], with the block pool detached from the scheduler when `detached` (as the engine's
/// allocator actor holds it).
fn run_with(
    w: &Workload,
    first: &str,
    swaps: &[&str],
    pipelined: bool,
    detached: bool,
) -> Result<Ended, TestCaseError> {
    let config = SchedulerConfig {
        max_num_seqs: w.max_num_seqs,
        max_num_batched_tokens: w.max_num_batched_tokens,
        block_size: w.block_size,
        num_gpu_blocks: w.num_gpu_blocks,
        enable_prefix_caching: w.caching,
        max_model_len: 4096,
        tiers: tiers(w.max_queue_ms.1, w.kv_fractions),
        max_logit_rows: w.max_num_seqs + w.spare_logit_rows,
        max_loras: w.max_loras,
        speculative: w.speculative.clone(),
        sliding_window: w.window,
        max_queue_ms: w.max_queue_ms.0,
        num_host_blocks: w.host_blocks,
        kv_offload_ahead: w.ahead,
    };
    let mut s = Scheduler::new(config, make_policy(first), [7, 9]).unwrap();
    let mut detached_pool = if detached { s.detach_allocator() } else { None };
    let mut shadow = Shadow {
        device: vec![None; w.num_gpu_blocks],
        host: vec![None; w.host_blocks],
    };
    let mut tier_check = TierCheck {
        fractions: w.kv_fractions,
        before_reload: None,
        previous: [(0, usize::MAX); 3],
        in_force: vec![0, 1, 2],
    };
    // The queue bound each request was queued with (its tier's, if in force, else the
    // scheduler's).
    let mut queue_bounds: HashMap<RequestId, Option<u64>> = HashMap::new();
    let mut admitted: BTreeMap<RequestId, &Spec> = BTreeMap::new();
    let mut ended: BTreeMap<RequestId, FinishReason> = BTreeMap::new();
    let mut outputs_seen: HashMap<RequestId, usize> = HashMap::new();
    let mut mirrors: HashMap<RequestId, Vec<BlockId>> = HashMap::new();
    // Per request: the computed tokens of its first plan entry (its first admission) and the
    // cached prompt tokens its `FirstToken` reported.
    let mut first_planned: HashMap<RequestId, usize> = HashMap::new();
    let mut cached: HashMap<RequestId, u32> = HashMap::new();
    let last_arrival = w.reqs.iter().map(|r| r.arrival_step).max().unwrap_or(0);
    let mut swaps = swaps.iter();
    let mut step = 0u64;
    let mut in_flight: Option<StepPlan> = None;
    let mut want_in_order = false;
    while step < MAX_STEPS {
        let now = Timestamp(step * STEP_US);
        for (i, r) in w.reqs.iter().enumerate() {
            if r.arrival_step == step {
                let id = RequestId(i as u64);
                // The longest sequence the cache holds alone: every block's tokens, or any
                // length under a window whose sequences hold at most that many blocks.
                let len = w.prompts[i].len() + r.max_tokens as usize;
                let fits = len
                    <= match w.window {
                        Some(win)
                            if win.blocks_held(w.block_size, w.max_num_batched_tokens)
                                <= w.num_gpu_blocks =>
                        {
                            usize::MAX
                        }
                        _ => w.num_gpu_blocks * w.block_size,
                    }
                    // ... and the longest its tier's KV quota holds alone.
                    && len
                        <= kv_capacity_tokens(
                            bounds_in_force(w, &tier_check)[r.tier as usize]
                                .min(w.num_gpu_blocks),
                            w.block_size,
                            w.max_num_batched_tokens,
                            w.window,
                        );
                match s.add_request(request(w, i)) {
                    Ok(()) => {
                        prop_assert!(fits);
                        admitted.insert(id, r);
                        let bound = if r.tier == 2 && tier_check.in_force.contains(&2) {
                            w.max_queue_ms.1.or(w.max_queue_ms.0)
                        } else {
                            w.max_queue_ms.0
                        };
                        queue_bounds.insert(id, bound);
                    }
                    Err(e) => {
                        prop_assert!(!fits, "unexpected rejection: {}", e);
                        prop_assert_eq!(s.request_state(id), None);
                    }
                }
            }
            if let Some((after, abort)) = r.end_after {
                let id = RequestId(i as u64);
                if r.arrival_step + after == step && admitted.contains_key(&id) {
                    let live = s.request_state(id).is_some_and(|st| !st.is_terminal());
                    let done = if abort {
                        s.abort(id)
                    } else {
                        s.finish(id, FinishReason::Stop)
                    };
                    prop_assert_eq!(done, live);
                    if done {
                        let reason = if abort {
                            FinishReason::Abort
                        } else {
                            FinishReason::Stop
                        };
                        prop_assert!(ended.insert(id, reason).is_none());
                    }
                    s.check_invariants()
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    check_adapters(w, &s, &admitted)?;
                }
            }
        }
        if let Some((_, fractions)) = w.reload_kv.filter(|&(at, _)| at == step) {
            // The quotas change between two steps (a step may be in flight), and the tiers
            // may be reordered and one removed (its requests count in no tier from then on):
            // nothing is lost, and the checks hold from here on with the new ones.
            let (reloaded, in_force) = reloaded_tiers(w.max_queue_ms.1, fractions, w.reload_set);
            s.set_tiers(reloaded).unwrap();
            tier_check.in_force = in_force;
            s.check_invariants()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            tier_check.fractions = fractions;
            tier_check.before_reload = Some(admitted.keys().copied().collect());
        }
        if step > 0 && step.is_multiple_of(w.swap_every) {
            if let Some(next) = swaps.next() {
                let before = s.stats();
                s.swap_policy(make_policy(next));
                // Speculative decoding is switched with the policy: off, then on again.
                if let Some(spec) = &w.speculative {
                    let on = s.config().speculative.is_none();
                    s.set_speculative(on.then(|| spec.clone())).unwrap();
                }
                let after = s.stats();
                prop_assert_eq!(before.num_running, after.num_running);
                prop_assert_eq!(before.num_waiting, after.num_waiting);
            }
        }
        // A failed step drops every prefix-cache registration (the engine's `fail_step`):
        // the ledger and the pool must agree after the next commit, and nothing is lost.
        if w.caching && step % 11 == 5 {
            s.clear_prefix_cache();
            s.check_invariants()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        // A backend that verifies drafts exactly: it keeps the leading drafts equal to the
        // tokens it samples at their positions.
        let outputs = |plan: &StepPlan| -> Vec<StepOutput> {
            plan.seqs
                .iter()
                .filter(|q| q.samples)
                .map(|q| {
                    let first = q.num_computed_tokens + q.num_new_tokens - q.draft_tokens.len();
                    let accepted = q
                        .draft_tokens
                        .iter()
                        .enumerate()
                        .take_while(|&(i, &d)| d == token(w, q.id, first + i))
                        .count();
                    StepOutput {
                        id: q.id,
                        token: token(w, q.id, first + accepted),
                        accepted: accepted as u32,
                    }
                })
                .collect()
        };
        // Pipelined: plan ahead of the step in flight; when that cannot be done (a preemption
        // is needed), resolve first and plan in order.
        let mut events = Vec::new();
        let ahead = match &in_flight {
            Some(_) if !want_in_order => plan_step(&mut s, detached_pool.as_mut(), now, true)?,
            _ => None,
        };
        let plan = match ahead {
            Some(plan) => plan,
            None => {
                if let Some(prev) = in_flight.take() {
                    events.extend(s.resolve(&prev, &outputs(&prev), now));
                }
                match plan_step(&mut s, detached_pool.as_mut(), now, false)? {
                    Some(plan) => plan,
                    None => return Err(TestCaseError::fail("no plan in order")),
                }
            }
        };
        want_in_order = s.take_preemption_wanted();
        // Every request never planned before whose bound ran out before `now` is timed out
        // by this plan (before anything is admitted).
        for (id, r) in &admitted {
            let bound = queue_bounds[id];
            let due = bound.is_some_and(|ms| r.arrival_step * STEP_US + ms * 1000 < now.0);
            if due && !first_planned.contains_key(id) && !ended.contains_key(id) {
                prop_assert!(
                    plan.timed_out.iter().any(|t| t.id == *id),
                    "{:?} waited past its bound of {:?} ms",
                    id,
                    bound
                );
            }
        }
        // Requests timed out in the queue: never planned before, past their bound, ended
        // once, holding nothing (the invariants below check the blocks).
        for t in &plan.timed_out {
            prop_assert!(admitted.contains_key(&t.id), "{:?} timed out unknown", t.id);
            prop_assert!(
                !first_planned.contains_key(&t.id),
                "{:?} timed out after its admission",
                t.id
            );
            prop_assert!(
                t.waited > t.max_queue_ms * 1000,
                "{:?} timed out early",
                t.id
            );
            prop_assert_eq!(Some(t.max_queue_ms), queue_bounds[&t.id]);
            prop_assert_eq!(
                s.request_state(t.id),
                Some(RequestState::Finished(FinishReason::QueueTimeout))
            );
            prop_assert!(
                ended.insert(t.id, FinishReason::QueueTimeout).is_none(),
                "{:?} ended twice",
                t.id
            );
        }
        check_plan(w, &s, &plan, &mut mirrors)?;
        check_contents(w, &s, &plan, &mirrors, &mut shadow)?;
        check_tier_blocks(w, &s, &admitted, &ended, &mut tier_check)?;
        for q in &plan.seqs {
            first_planned.entry(q.id).or_insert(q.num_computed_tokens);
        }
        s.check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_adapters(w, &s, &admitted)?;
        let fails = !plan.seqs.is_empty() && w.fail_every.is_some_and(|k| step % k == k - 1);
        if fails {
            // Launched (so its blocks are registered), then it fails with the one in flight.
            if pipelined {
                s.launch(&plan);
            }
            let failed: Vec<StepPlan> = in_flight.take().into_iter().chain([plan]).collect();
            for p in &failed {
                forget_writes(&mut shadow, p, &mirrors, w.block_size);
                for q in &p.seqs {
                    if s.abort(q.id) {
                        prop_assert!(
                            ended.insert(q.id, FinishReason::Abort).is_none(),
                            "{:?} ended twice",
                            q.id
                        );
                    }
                }
            }
            s.forget_launched();
            s.clear_prefix_cache();
            s.check_invariants()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        } else if pipelined {
            s.launch(&plan);
            s.check_invariants()
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
            check_adapters(w, &s, &admitted)?;
            if let Some(prev) = in_flight.replace(plan) {
                events.extend(s.resolve(&prev, &outputs(&prev), now));
            }
        } else {
            events.extend(s.apply_outputs(&plan, &outputs(&plan), now));
        }
        if pipelined && !s.has_unfinished() {
            // The last step in flight belongs to sequences that ended: resolve it too.
            if let Some(prev) = in_flight.take() {
                events.extend(s.resolve(&prev, &outputs(&prev), now));
            }
        }
        for e in events {
            match e {
                SeqEvent::Token { id, .. } => *outputs_seen.entry(id).or_default() += 1,
                SeqEvent::Finished { id, reason, .. } => {
                    prop_assert!(
                        ended.insert(id, reason).is_none(),
                        "{:?} finished twice",
                        id
                    );
                }
                SeqEvent::FirstToken {
                    id,
                    cached_prompt_tokens,
                    ..
                } => {
                    check_cached(w, id, cached_prompt_tokens, &first_planned)?;
                    prop_assert_eq!(
                        outputs_seen.get(&id).copied().unwrap_or(0),
                        0,
                        "{:?}: its first token event came after a token",
                        id
                    );
                    prop_assert!(
                        cached.insert(id, cached_prompt_tokens).is_none(),
                        "{:?}: cached prompt tokens reported twice",
                        id
                    );
                }
            }
        }
        s.check_invariants()
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        check_adapters(w, &s, &admitted)?;
        step += 1;
        if step > last_arrival && !s.has_unfinished() && in_flight.is_none() {
            break;
        }
    }
    prop_assert!(!s.has_in_flight(), "a launched step was never resolved");
    if let Some(pool) = detached_pool.as_mut() {
        // The frees since the last plan reach the allocator with the next commit.
        let plan = plan_step(&mut s, Some(pool), Timestamp(step * STEP_US), false)?;
        prop_assert!(plan.is_some_and(|p| p.seqs.is_empty()));
        s.ledger()
            .check_against(pool)
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        prop_assert_eq!(
            pool.num_free(),
            w.num_gpu_blocks,
            "blocks leaked in the pool"
        );
    }
    prop_assert!(
        !s.has_unfinished(),
        "requests still live after {} steps",
        MAX_STEPS
    );
    // Every admitted request ended exactly once, with outputs consistent with its limits.
    prop_assert_eq!(ended.len(), admitted.len());
    let mut result = Ended::new();
    for (id, spec) in &admitted {
        let out = s.output_tokens(*id).unwrap_or(&[]);
        prop_assert_eq!(out.len(), outputs_seen.get(id).copied().unwrap_or(0));
        prop_assert!(out.len() <= spec.max_tokens as usize);
        let prompt = w.prompts[id.0 as usize].len();
        for (k, &t) in out.iter().enumerate() {
            prop_assert_eq!(
                t,
                token(w, *id, prompt + k),
                "{:?}: output {} is not its own",
                id,
                k
            );
        }
        // A request that got a token reported its cached prompt tokens (exactly once: above).
        prop_assert_eq!(
            cached.contains_key(id),
            !out.is_empty(),
            "{:?}: {} outputs, cached tokens reported: {}",
            id,
            out.len(),
            cached.contains_key(id)
        );
        result.insert(*id, (out.to_vec(), ended[id]));
        match ended[id] {
            FinishReason::Length => prop_assert_eq!(out.len(), spec.max_tokens as usize),
            FinishReason::Eos => prop_assert_eq!(out.last(), Some(&EOS)),
            _ => {}
        }
    }
    let st = s.stats();
    prop_assert_eq!(
        st.num_free_blocks,
        w.num_gpu_blocks,
        "blocks leaked at the end"
    );
    prop_assert!(
        s.tier_kv_blocks().iter().all(|&b| b == 0),
        "tier KV blocks left at the end: {:?}",
        s.tier_kv_blocks()
    );
    prop_assert!(st.prefix_hits <= st.prefix_queries);
    Ok(result)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn every_policy_keeps_invariants_and_ends_every_request(w in workload()) {
        for name in variants() {
            run(&w, name, &[], false)
                .map_err(|e| TestCaseError::fail(format!("policy {name}: {e}")))?;
        }
    }

    #[test]
    fn a_prefix_back_from_the_host_tier_is_loaded_once_per_plan(w in burst_workload()) {
        for name in variants() {
            run(&w, name, &[], false)
                .map_err(|e| TestCaseError::fail(format!("policy {name}: {e}")))?;
            run(&w, name, &[], true)
                .map_err(|e| TestCaseError::fail(format!("policy {name} pipelined: {e}")))?;
        }
    }

    #[test]
    fn hot_swaps_to_every_other_policy_lose_nothing(w in workload()) {
        let names = variants();
        for first in &names {
            let others: Vec<&str> = names.iter().copied().filter(|n| n != first).collect();
            run(&w, first, &others, false)
                .map_err(|e| TestCaseError::fail(format!("policy {first} with swaps: {e}")))?;
        }
    }

    #[test]
    fn pipelined_steps_match_steps_in_order(w in workload()) {
        // Aborts and outside finishes fire at step counts, which pipelining shifts; without
        // them both runs must produce the same tokens and the same endings.
        let mut w = w;
        for r in &mut w.reqs {
            r.end_after = None;
        }
        // Pipelining also shifts when seats free up, so when requests are admitted: queue
        // bounds and reloads of the KV quotas are left to the other properties.
        w.max_queue_ms = (None, None);
        w.reload_kv = None;
        for name in variants() {
            let in_order = run(&w, name, &[], false)
                .map_err(|e| TestCaseError::fail(format!("policy {name} in order: {e}")))?;
            let pipelined = run(&w, name, &[], true)
                .map_err(|e| TestCaseError::fail(format!("policy {name} pipelined: {e}")))?;
            prop_assert_eq!(in_order, pipelined, "policy {}", name);
        }
    }

    #[test]
    fn pipelined_steps_keep_invariants_with_aborts_and_swaps(w in workload()) {
        let names = variants();
        for first in &names {
            let others: Vec<&str> = names.iter().copied().filter(|n| n != first).collect();
            run(&w, first, &others, true)
                .map_err(|e| TestCaseError::fail(format!("policy {first} pipelined: {e}")))?;
        }
    }
}

proptest! {
    // Cheap cases (short runs), and the case it covers needs several things in one plan.
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn a_plans_shared_tier_loads_survive_preemptions_for_admission(
        w in preempting_burst_workload()
    ) {
        for name in variants() {
            run(&w, name, &[], false)
                .map_err(|e| TestCaseError::fail(format!("policy {name}: {e}")))?;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn continuations_hold_their_own_kv(w in with_continuations(workload())) {
        for name in variants() {
            run(&w, name, &[], false)
                .map_err(|e| TestCaseError::fail(format!("policy {name}: {e}")))?;
        }
    }

    #[test]
    fn continuations_hold_their_own_kv_pipelined_with_swaps(
        w in with_continuations(workload())
    ) {
        let names = variants();
        for first in &names {
            let others: Vec<&str> = names.iter().copied().filter(|n| n != first).collect();
            run(&w, first, &others, true)
                .map_err(|e| TestCaseError::fail(format!("policy {first} pipelined: {e}")))?;
        }
    }

    #[test]
    fn continuations_back_from_the_host_tier_under_preemption(
        w in with_continuations(preempting_burst_workload())
    ) {
        for name in variants() {
            run(&w, name, &[], false)
                .map_err(|e| TestCaseError::fail(format!("policy {name}: {e}")))?;
            run(&w, name, &[], true)
                .map_err(|e| TestCaseError::fail(format!("policy {name} pipelined: {e}")))?;
        }
    }

    /// The engine's way: the pool belongs to an allocator that only gets commits, so the
    /// references of blocks shared as they are loaded reach it a commit late.
    #[test]
    fn a_detached_pool_equals_the_ledger_and_changes_no_output(
        w in with_continuations(burst_workload())
    ) {
        for name in variants() {
            let own = run(&w, name, &[], true)
                .map_err(|e| TestCaseError::fail(format!("policy {name}: {e}")))?;
            let detached = run_with(&w, name, &[], true, true)
                .map_err(|e| TestCaseError::fail(format!("policy {name} detached: {e}")))?;
            prop_assert_eq!(own, detached, "policy {}", name);
            run_with(&w, name, &[], false, true).map_err(|e| {
                TestCaseError::fail(format!("policy {name} detached, in order: {e}"))
            })?;
        }
    }

    #[test]
    fn a_failed_step_leaves_nothing_another_request_reads(
        w in with_failures(with_continuations(workload()))
    ) {
        for name in variants() {
            run(&w, name, &[], false)
                .map_err(|e| TestCaseError::fail(format!("policy {name}: {e}")))?;
            run_with(&w, name, &[], true, true)
                .map_err(|e| TestCaseError::fail(format!("policy {name} pipelined: {e}")))?;
        }
    }

    #[test]
    fn a_failed_step_loses_nothing_from_the_host_tier(
        w in with_failures(with_continuations(burst_workload()))
    ) {
        for name in variants() {
            run(&w, name, &[], true)
                .map_err(|e| TestCaseError::fail(format!("policy {name} pipelined: {e}")))?;
        }
    }

    #[test]
    fn a_detached_pool_equals_the_ledger_with_aborts_and_swaps(w in workload()) {
        let names = variants();
        for first in &names {
            let others: Vec<&str> = names.iter().copied().filter(|n| n != first).collect();
            run_with(&w, first, &others, true, true)
                .map_err(|e| TestCaseError::fail(format!("policy {first} detached: {e}")))?;
        }
    }
}
