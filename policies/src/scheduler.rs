//! The scheduler: owns the request table, the queues, the block ledger (and, unless handed to
//! an allocator actor, the [`BlockPool`]) and the policy.
//!
//! This file holds construction, validation, the public queries and the life-cycle
//! operations that can happen at any time (finish, abort, policy swap); the per-step planner
//! (`schedule`, `apply_outputs`) lives in `planner/`.
//!
//! Every operation checks its own budgets and invariants, so a policy can only reorder work:
//! it cannot leak a block, exceed a limit or lose a request. [`Scheduler::check_invariants`]
//! verifies the whole state and is what the property tests call after every step.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use crate::adapter_slots::AdapterSlots;
use crate::block_ledger::{BlockLedger, RELEASED_BLOCK};
use crate::block_pool::{BlockPool, MAX_BLOCKS};
use crate::error::SchedulerError;
use crate::policy::{Policy, PolicyEvent, Rank};
use crate::prefix_hash::BlockHasher;
use crate::sequence::{SeqView, Sequence};
use crate::tier_quota::{QuotaChange, TierQuotas, NO_TIER};
use crate::types::{
    BlockId, FinishReason, Request, RequestId, RequestState, SchedulerConfig, SchedulerStats,
    SloTargets, Timestamp, TokenId, MAX_QUEUE_MS, PENDING_TOKEN,
};

/// Longest tenant or tier label accepted.
pub const MAX_LABEL_LEN: usize = 256;
/// Most stop token ids per request.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;
/// Most tiers per scheduler.
pub const MAX_TIERS: usize = 64;
/// Largest block size accepted.
pub const MAX_BLOCK_SIZE: usize = 4096;
/// Most distinct tenant labels per scheduler.
pub const MAX_TENANTS: usize = 1 << 16;
/// Largest `max_num_seqs`, `max_num_batched_tokens` and `max_model_len` accepted.
pub const MAX_LIMIT: usize = 1 << 24;
/// Largest host KV tier ([`SchedulerConfig::num_host_blocks`]), in blocks.
pub const MAX_HOST_BLOCKS: usize = 1 << 26;
/// Largest `max_loras` accepted.
pub const MAX_LORAS: usize = 1024;

/// Fibonacci hashing for request ids (ids are chosen by the engine, not by clients, so there
/// is no hash-flooding vector).
#[derive(Default)]
pub struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// A map keyed by engine-assigned request ids.
pub type IdMap<V> = HashMap<RequestId, V, BuildHasherDefault<IdHasher>>;

/// A sequence slot with its sort key for one step.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Ranked {
    /// The policy's rank.
    pub(crate) rank: Rank,
    /// Tie-breaker: arrival.
    pub(crate) arrival: Timestamp,
    /// Tie-breaker: id.
    pub(crate) id: RequestId,
    /// Slab slot.
    pub(crate) slot: u32,
}

/// Continuous-batching scheduler with prefix caching and pluggable policies.
pub struct Scheduler {
    /// Limits (validated).
    pub(crate) config: SchedulerConfig,
    /// The active policy.
    pub(crate) policy: Box<dyn Policy>,
    /// The planner's exact view of the KV blocks and the prefix cache.
    pub(crate) ledger: BlockLedger,
    /// The allocator itself when the scheduler commits its own plans (the simulator, offline
    /// engines); `None` once handed to an allocator actor with [`Scheduler::detach_allocator`].
    pub(crate) allocator: Option<BlockPool>,
    /// Scratch: block ids of the last commit.
    pub(crate) assigned: Vec<BlockId>,
    /// Keyed block hasher.
    pub(crate) hasher: BlockHasher,
    /// Sequences by slot; `None` for forgotten slots.
    pub(crate) seqs: Vec<Option<Sequence>>,
    /// Slots available for reuse.
    pub(crate) free_slots: Vec<u32>,
    /// Slot of every known request.
    pub(crate) index: IdMap<u32>,
    /// Interned tenant labels.
    pub(crate) tenants: HashMap<String, u32>,
    /// Slots of running sequences.
    pub(crate) running: Vec<u32>,
    /// Slots of waiting (new or preempted) sequences.
    pub(crate) waiting: Vec<u32>,
    /// Running sequences per LoRA adapter (at most `config.max_loras` adapters).
    pub(crate) adapters: AdapterSlots,
    /// Scratch: running sequences ranked for the current step.
    pub(crate) order: Vec<Ranked>,
    /// Scratch: waiting sequences ranked for the current step.
    pub(crate) wait_order: Vec<Ranked>,
    /// Scratch: the planned prefill chunks a waiting request may take budget back from,
    /// lowest-ranked first (`planner/running.rs`, `reclaimable` and `settle`).
    pub(crate) reclaim_order: Vec<Ranked>,
    /// (arrival, id, slot) of the waiting sequences looked up in the prefix cache by the latest
    /// lookup (see `prefix_lookup.rs`); scratch while it picks them.
    pub(crate) lookups: Vec<(Timestamp, RequestId, u32)>,
    /// Scratch of the latest lookup: the first uncomputed block of each running prefill and
    /// of each looked-up sequence not flagged as sharing one (see `prefix_lookup.rs`).
    pub(crate) pending_blocks: crate::prefix_lookup::PendingBlocks,
    /// Scratch: prefix-matched blocks of the candidate being admitted.
    pub(crate) matched: Vec<BlockId>,
    /// Scratch: victims chosen for a policy preemption.
    pub(crate) victims: Vec<u32>,
    /// Slot of each entry of the last plan (same order), to skip id lookups.
    pub(crate) last_slots: Vec<u32>,
    /// Launched steps waiting for their outputs, oldest first.
    pub(crate) in_flight: std::collections::VecDeque<Vec<crate::planner::Launched>>,
    /// Scratch: records of resolved steps, reused.
    pub(crate) spare_launched: Vec<Vec<crate::planner::Launched>>,
    /// A plan made ahead held back an admission that needed a preemption.
    pub(crate) preemption_wanted: bool,
    /// Tokens looked up in the prefix cache.
    pub(crate) prefix_queries: u64,
    /// Tokens found in the prefix cache.
    pub(crate) prefix_hits: u64,
    /// Preemptions since start.
    pub(crate) num_preemptions: u64,
    /// Allocator calls that failed (a core bug; reported by `check_invariants` and in
    /// [`SchedulerStats::pool_errors`]).
    pub(crate) pool_errors: u64,
    /// Where drafts come from instead of prompt lookup (the simulator's model of a draft
    /// source), if set.
    pub(crate) draft_source: Option<Box<dyn crate::speculative::DraftSource>>,
    /// Queue bounds of the requests waiting for their first admission (see
    /// `queue_deadline.rs`).
    pub(crate) deadlines: crate::queue_deadline::QueueDeadlines,
    /// KV blocks held per tier and the tiers' bounds (see `tier_quota.rs`).
    pub(crate) quotas: crate::tier_quota::TierQuotas,
    /// Scratch: blocks the running sequences of each tier still owe their known tokens
    /// (the per-tier part of the planner's `blocks_owed`), valid while the step's total is.
    pub(crate) tier_owed: Vec<usize>,
    /// The host KV tier, with `config.num_host_blocks > 0`.
    pub(crate) host: Option<crate::host_tier::HostTier>,
    /// Scratch: host-tier blocks continuing the candidate's device prefix match.
    pub(crate) host_matched: Vec<BlockId>,
    /// Scratch: blocks continuing the candidate's device prefix match that an earlier
    /// admission of the plan being built loads from the host tier (owner slot, table index).
    pub(crate) shared_matched: Vec<(u32, u32)>,
    /// The host-tier loads decided in the plan being built, by prefix: the admitted sequence
    /// (slot) and table index of the device block each fills. A later admission of the same
    /// plan finds them here, after its device match, and shares the block instead of loading
    /// it again (see `host_tier.rs`). Emptied when each plan starts.
    pub(crate) plan_loads: crate::planner::PlanLoads,
    /// Table entries of the plan being built that share a block another sequence of the
    /// plan loads, resolved when the plan's blocks get their ids.
    pub(crate) plan_shares: Vec<crate::planner::PlanShare>,
    /// Scratch: cached blocks the last commit evicted.
    pub(crate) evicted: Vec<(BlockId, crate::prefix_hash::PrefixHash)>,
    /// Cached blocks to copy to the host tier ahead of their eviction, in the order they were
    /// registered, each checked before its copy (see `planner/kv.rs`).
    pub(crate) store_queue: std::collections::VecDeque<crate::block_ledger::CachedBlock>,
    /// Scratch: this plan's stores.
    pub(crate) store_scratch: Vec<crate::block_ledger::CachedBlock>,
    /// Blocks copied to the host tier since start.
    pub(crate) kv_offloaded: u64,
    /// Of `kv_offloaded`, those copied ahead of eviction.
    pub(crate) kv_stored_ahead: u64,
    /// Blocks copied back from the host tier since start.
    pub(crate) kv_loaded: u64,
    /// Prompt tokens found in the host tier at admission since start.
    pub(crate) host_hit_tokens: u64,
}

/// The fewest KV blocks a tier's bound must allow for `seq` to run to its limit alone (as
/// [`crate::types::kv_capacity_tokens`] counts a bound's capacity).
fn quota_need(config: &SchedulerConfig, seq: &Sequence) -> usize {
    let bs = config.block_size.max(1);
    let max_len = seq
        .req
        .prompt
        .len()
        .saturating_add(seq.req.limits.max_tokens as usize);
    let blocks = max_len.div_ceil(bs);
    match config.sliding_window {
        Some(w) => blocks.min(w.blocks_held(bs, config.max_num_batched_tokens)),
        None => blocks,
    }
}

fn config_err(field: &'static str, reason: String) -> SchedulerError {
    SchedulerError::InvalidConfig { field, reason }
}

fn check_limit(field: &'static str, v: usize, max: usize) -> Result<(), SchedulerError> {
    if v == 0 || v > max {
        return Err(config_err(field, format!("must be in 1..={max}, got {v}")));
    }
    Ok(())
}

fn check_target(v: Option<f64>) -> Result<(), String> {
    match v {
        Some(x) if !(x.is_finite() && x > 0.0) => Err(format!(
            "must be a positive number, got {}",
            crate::short_number::short_number(x)
        )),
        _ => Ok(()),
    }
}

fn check_queue_bound(field: &'static str, v: Option<u64>) -> Result<(), SchedulerError> {
    match v {
        Some(ms) if !(1..=MAX_QUEUE_MS).contains(&ms) => Err(config_err(
            field,
            format!("must be in 1..={MAX_QUEUE_MS} milliseconds, got {ms}"),
        )),
        _ => Ok(()),
    }
}

/// Validates a scheduler configuration.
pub fn validate_config(c: &SchedulerConfig) -> Result<(), SchedulerError> {
    check_limit("max_num_seqs", c.max_num_seqs, MAX_LIMIT)?;
    check_limit(
        "max_num_batched_tokens",
        c.max_num_batched_tokens,
        MAX_LIMIT,
    )?;
    check_limit("block_size", c.block_size, MAX_BLOCK_SIZE)?;
    check_limit("num_gpu_blocks", c.num_gpu_blocks, MAX_BLOCKS)?;
    if c.num_host_blocks > MAX_HOST_BLOCKS {
        return Err(config_err(
            "num_host_blocks",
            format!("at most {MAX_HOST_BLOCKS}, got {}", c.num_host_blocks),
        ));
    }
    check_limit("max_model_len", c.max_model_len, MAX_LIMIT)?;
    check_limit("max_loras", c.max_loras, MAX_LORAS)?;
    // Every seat keeps a row of logits (a step may sample every running sequence).
    if c.max_logit_rows < c.max_num_seqs {
        return Err(config_err(
            "max_num_seqs",
            format!(
                "{} exceeds max_logit_rows ({}), the rows of logits the backend computes per \
                 step: every sequence that samples needs one",
                c.max_num_seqs, c.max_logit_rows
            ),
        ));
    }
    if let Some(spec) = &c.speculative {
        spec.validate()?;
    }
    if let Some(w) = c.sliding_window {
        check_limit("sliding_window.tokens", w.tokens, MAX_LIMIT)?;
        if w.read_slack > MAX_LIMIT {
            return Err(config_err(
                "sliding_window.read_slack",
                format!("at most {MAX_LIMIT}, got {}", w.read_slack),
            ));
        }
    }
    check_queue_bound("max_queue_ms", c.max_queue_ms)?;
    if c.tiers.len() > MAX_TIERS {
        return Err(config_err("tiers", format!("at most {MAX_TIERS} tiers")));
    }
    for (i, t) in c.tiers.iter().enumerate() {
        if t.name.len() > MAX_LABEL_LEN {
            return Err(config_err(
                "tiers.name",
                format!("longer than {MAX_LABEL_LEN} bytes"),
            ));
        }
        if c.tiers[..i].iter().any(|o| o.name == t.name) {
            return Err(config_err(
                "tiers.name",
                format!("tier `{}` defined twice", t.name),
            ));
        }
        check_target(t.ttft_ms)
            .map_err(|r| config_err("tiers.ttft_ms", format!("tier `{}`: {r}", t.name)))?;
        check_target(t.tpot_ms)
            .map_err(|r| config_err("tiers.tpot_ms", format!("tier `{}`: {r}", t.name)))?;
        check_queue_bound("tiers.max_queue_ms", t.max_queue_ms).map_err(|e| match e {
            SchedulerError::InvalidConfig { field, reason } => SchedulerError::InvalidConfig {
                field,
                reason: format!("tier `{}`: {reason}", t.name),
            },
            other => other,
        })?;
        if let Some(f) = t
            .max_kv_fraction
            .filter(|f| !(f.is_finite() && *f > 0.0 && *f <= 1.0))
        {
            return Err(config_err(
                "tiers.max_kv_fraction",
                format!(
                    "tier `{}`: must be a number in (0, 1], got {}",
                    t.name,
                    crate::short_number::short_number(f)
                ),
            ));
        }
        if !(t.weight.is_finite() && t.weight > 0.0) {
            return Err(config_err(
                "tiers.weight",
                format!(
                    "tier `{}`: must be a positive number, got {}",
                    t.name, t.weight
                ),
            ));
        }
    }
    Ok(())
}

impl Scheduler {
    /// A scheduler with an empty pool of `config.num_gpu_blocks` blocks.
    ///
    /// `hash_key` keys the prefix-cache hash; draw it at random once per process.
    pub fn new(
        config: SchedulerConfig,
        policy: Box<dyn Policy>,
        hash_key: [u64; 2],
    ) -> Result<Self, SchedulerError> {
        validate_config(&config)?;
        let pool = BlockPool::new(config.num_gpu_blocks, config.block_size)?;
        let mut ledger = BlockLedger::new(config.num_gpu_blocks, config.block_size)?;
        let host = match config.num_host_blocks {
            0 => None,
            n => Some(crate::host_tier::HostTier::new(n)?),
        };
        ledger.track_evictions(host.is_some());
        ledger.track_registrations(host.is_some() && config.kv_offload_ahead);
        let quotas = TierQuotas::new(&config.tiers, config.num_gpu_blocks);
        let tier_owed = vec![0; config.tiers.len()];
        Ok(Self {
            adapters: AdapterSlots::new(config.max_loras),
            config,
            policy,
            ledger,
            allocator: Some(pool),
            assigned: Vec::new(),
            hasher: BlockHasher::new(hash_key),
            seqs: Vec::new(),
            free_slots: Vec::new(),
            index: IdMap::default(),
            tenants: HashMap::new(),
            running: Vec::new(),
            waiting: Vec::new(),
            order: Vec::new(),
            wait_order: Vec::new(),
            reclaim_order: Vec::new(),
            lookups: Vec::new(),
            pending_blocks: Default::default(),
            matched: Vec::new(),
            victims: Vec::new(),
            last_slots: Vec::new(),
            in_flight: std::collections::VecDeque::new(),
            spare_launched: Vec::new(),
            preemption_wanted: false,
            prefix_queries: 0,
            prefix_hits: 0,
            num_preemptions: 0,
            pool_errors: 0,
            draft_source: None,
            deadlines: Default::default(),
            quotas,
            tier_owed,
            host,
            host_matched: Vec::new(),
            shared_matched: Vec::new(),
            plan_loads: Default::default(),
            plan_shares: Vec::new(),
            evicted: Vec::new(),
            store_queue: Default::default(),
            store_scratch: Vec::new(),
            kv_offloaded: 0,
            kv_stored_ahead: 0,
            kv_loaded: 0,
            host_hit_tokens: 0,
        })
    }

    /// The validated configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The active policy's name.
    pub fn policy_name(&self) -> &str {
        self.policy.name()
    }

    /// The planner's view of the KV blocks (read-only).
    pub fn ledger(&self) -> &BlockLedger {
        &self.ledger
    }

    /// The block pool, while the scheduler commits its own plans (see
    /// [`Scheduler::detach_allocator`]).
    pub fn block_pool(&self) -> Option<&BlockPool> {
        self.allocator.as_ref()
    }

    /// Drops every prefix-cache registration (from the next commit on in the pool; see
    /// [`BlockLedger::clear_cache`]). For a step that failed: blocks it registered when it was
    /// launched may not hold their KV, so no later request may match them.
    pub fn clear_prefix_cache(&mut self) {
        self.ledger.clear_cache();
        // The failed step's copies may not have been made either: the host tier's blocks
        // are not trusted more than the device's.
        if let Some(host) = self.host.as_mut() {
            host.clear();
        }
        self.store_queue.clear();
    }

    /// The host KV tier, with [`SchedulerConfig::num_host_blocks`] > 0 (read-only).
    pub fn host_tier(&self) -> Option<&crate::host_tier::HostTier> {
        self.host.as_ref()
    }

    /// Hands the block pool to an external allocator (the engine's allocator actor). From
    /// then on, plan with [`Scheduler::plan_into`], apply the returned [`crate::KvCommit`] to the
    /// pool, and give the ids back through [`Scheduler::assign_blocks`] before the next plan.
    /// `None` if already detached.
    pub fn detach_allocator(&mut self) -> Option<BlockPool> {
        self.allocator.take()
    }

    /// Queues a request after validating its lengths and labels.
    pub fn add_request(&mut self, req: Request) -> Result<(), SchedulerError> {
        self.add(req, true)
    }

    /// Like [`Scheduler::add_request`], for a request no queue bound applies to: more work of
    /// a client request already admitted once (a beam search's later steps), which, as a
    /// preempted request, is never timed out.
    pub fn add_unbounded_request(&mut self, req: Request) -> Result<(), SchedulerError> {
        self.add(req, false)
    }

    /// Whether [`Scheduler::add_request`] would accept `req` as far as the request alone
    /// says (its fields and lengths, the context, the KV cache and its tier's KV bound); not
    /// the scheduler's state (a duplicate id, one tenant too many).
    pub fn check_request(&self, req: &Request) -> Result<(), SchedulerError> {
        let id = req.id;
        let invalid = |field: &'static str, reason: String| SchedulerError::InvalidRequest {
            id,
            field,
            reason,
        };
        if req.prompt.is_empty() {
            return Err(invalid("prompt", "must contain at least one token".into()));
        }
        if req.tenant.len() > MAX_LABEL_LEN {
            return Err(invalid(
                "tenant",
                format!("longer than {MAX_LABEL_LEN} bytes"),
            ));
        }
        if req.tier.len() > MAX_LABEL_LEN {
            return Err(invalid(
                "tier",
                format!("longer than {MAX_LABEL_LEN} bytes"),
            ));
        }
        let l = &req.limits;
        if l.max_tokens == 0 {
            return Err(invalid("max_tokens", "must be at least 1".into()));
        }
        if l.min_tokens > l.max_tokens {
            return Err(invalid(
                "min_tokens",
                format!("{} exceeds max_tokens {}", l.min_tokens, l.max_tokens),
            ));
        }
        if l.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(invalid(
                "stop_token_ids",
                format!("more than {MAX_STOP_TOKEN_IDS}"),
            ));
        }
        check_target(req.slo.ttft_ms).map_err(|r| invalid("slo.ttft_ms", r))?;
        check_target(req.slo.tpot_ms).map_err(|r| invalid("slo.tpot_ms", r))?;
        let max_len = req.prompt.len().saturating_add(l.max_tokens as usize);
        if max_len > self.config.max_model_len {
            return Err(SchedulerError::TooLong {
                id,
                prompt_len: req.prompt.len(),
                max_tokens: l.max_tokens as usize,
                max_model_len: self.config.max_model_len,
            });
        }
        let needed = self.ledger.blocks_for(max_len);
        if max_len > self.config.kv_capacity_tokens() {
            return Err(SchedulerError::ExceedsKvCapacity {
                id,
                needed,
                capacity: self.ledger.num_blocks(),
            });
        }
        let tier_pos = self.config.tiers.iter().position(|t| t.name == req.tier);
        let tier_pos = tier_pos.map_or(crate::tier_quota::NO_TIER, |i| i as u8);
        if let Some(quota) = self.quotas.configured(tier_pos) {
            // As for the whole cache: a request its tier's bound could never hold, even
            // alone, would wait (or preempt itself) forever.
            let c = &self.config;
            let fits = crate::types::kv_capacity_tokens(
                quota,
                c.block_size,
                c.max_num_batched_tokens,
                c.sliding_window,
            );
            if max_len > fits {
                return Err(SchedulerError::ExceedsTierKvQuota {
                    id,
                    tier: req.tier.clone(),
                    needed,
                    quota,
                });
            }
        }
        Ok(())
    }

    fn add(&mut self, req: Request, bounded: bool) -> Result<(), SchedulerError> {
        let id = req.id;
        if self.index.contains_key(&id) {
            return Err(SchedulerError::DuplicateRequest(id));
        }
        self.check_request(&req)?;
        // Unknown tiers get no defaults (the engine validates tier names at its edge).
        let tier_pos = self.config.tiers.iter().position(|t| t.name == req.tier);
        let tier = tier_pos.and_then(|i| self.config.tiers.get(i));
        let tier_pos = tier_pos.map_or(crate::tier_quota::NO_TIER, |i| i as u8);
        let invalid = |field: &'static str, reason: String| SchedulerError::InvalidRequest {
            id,
            field,
            reason,
        };
        let slo = SloTargets {
            ttft_ms: req.slo.ttft_ms.or(tier.and_then(|t| t.ttft_ms)),
            tpot_ms: req.slo.tpot_ms.or(tier.and_then(|t| t.tpot_ms)),
        };
        let tenant_id = match self.tenants.get(&req.tenant) {
            Some(&t) => t,
            None if self.tenants.len() >= MAX_TENANTS => {
                return Err(invalid(
                    "tenant",
                    format!("more than {MAX_TENANTS} distinct tenants"),
                ));
            }
            None => {
                let t = self.tenants.len() as u32;
                self.tenants.insert(req.tenant.clone(), t);
                t
            }
        };
        let preemptible = tier.is_some_and(|t| t.preemptible);
        let seq = Sequence::new(req, slo, tenant_id, preemptible, tier_pos);
        let slot = match self.free_slots.pop() {
            Some(s) => {
                self.seqs[s as usize] = Some(seq);
                s
            }
            None => {
                self.seqs.push(Some(seq));
                (self.seqs.len() - 1) as u32
            }
        };
        self.index.insert(id, slot);
        self.waiting.push(slot);
        if bounded {
            self.track_deadline(slot);
        }
        if let Some(s) = self.seqs[slot as usize].as_ref() {
            self.adapters.arrived(s.req.lora_adapter);
            self.policy.observe(PolicyEvent::Arrived(SeqView::new(s)));
        }
        Ok(())
    }

    pub(crate) fn seq(&self, slot: u32) -> Option<&Sequence> {
        self.seqs.get(slot as usize).and_then(|s| s.as_ref())
    }

    /// Ends a request in any live state with `reason`, freeing its blocks at once.
    ///
    /// Returns false for unknown or already ended requests. Full computed blocks stay in
    /// the prefix cache.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let state = match reason {
            FinishReason::Abort => RequestState::Aborted,
            r => RequestState::Finished(r),
        };
        self.end(id, state)
    }

    /// Aborts a request in any live state; see [`Scheduler::finish`].
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.end(id, RequestState::Aborted)
    }

    fn end(&mut self, id: RequestId, terminal: RequestState) -> bool {
        let Some(&slot) = self.index.get(&id) else {
            return false;
        };
        let Some(state) = self.seq(slot).map(|s| s.state) else {
            return false;
        };
        let queue = match state {
            RequestState::Running => &mut self.running,
            RequestState::Waiting | RequestState::Preempted => &mut self.waiting,
            RequestState::Finished(_) | RequestState::Aborted => return false,
        };
        if let Some(pos) = queue.iter().position(|&s| s == slot) {
            queue.swap_remove(pos);
        }
        self.release(slot, terminal);
        true
    }

    /// Frees a sequence's blocks (last block first, so the tail of a prefix is evicted
    /// before its head), frees its adapter slot if it was running, marks it ended and tells
    /// the policy. Queues are the caller's job.
    pub(crate) fn release(&mut self, slot: u32, terminal: RequestState) {
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return;
        };
        if seq.state.is_terminal() {
            return;
        }
        if seq.state == RequestState::Running {
            self.adapters.stopped(seq.req.lora_adapter);
        }
        self.adapters.ended(seq.req.lora_adapter);
        self.quotas.sub(seq.tier, seq.held_blocks().len());
        for &b in seq.held_blocks().iter().rev() {
            // Table blocks are referenced by construction; a failure would be a core bug,
            // which check_invariants reports.
            if self.ledger.free(b).is_err() {
                self.pool_errors += 1;
            }
        }
        seq.clear_blocks();
        // Tokens still on the device will not be resolved for an ended request.
        seq.drop_pending();
        seq.cached_prefix = None;
        seq.state = terminal;
        let tier = seq.tier;
        self.policy
            .observe(PolicyEvent::Departed(SeqView::new(seq)));
        self.relax_tier_quota(tier);
    }

    /// Forgets an ended request (its outputs and state), so long-running engines do not
    /// accumulate records. Returns false for unknown or live requests.
    pub fn forget(&mut self, id: RequestId) -> bool {
        let Some(&slot) = self.index.get(&id) else {
            return false;
        };
        if !self.seq(slot).is_some_and(|s| s.state.is_terminal()) {
            return false;
        }
        self.index.remove(&id);
        self.seqs[slot as usize] = None;
        self.free_slots.push(slot);
        true
    }

    /// Feeds a live request no more drafts (speculative decoding), for the rest of its life:
    /// the engine's answer to a request whose drafts cost more than they save (a grammar that
    /// must copy its matcher for each draft round). Its steps already planned keep theirs.
    /// Returns false for unknown or ended requests.
    pub fn stop_drafts(&mut self, id: RequestId) -> bool {
        let Some(&slot) = self.index.get(&id) else {
            return false;
        };
        let Some(seq) = self.seqs.get_mut(slot as usize).and_then(|s| s.as_mut()) else {
            return false;
        };
        if seq.state.is_terminal() {
            return false;
        }
        seq.req.limits.speculate = false;
        // Its prompt-lookup index is never read again.
        seq.ngrams = None;
        true
    }

    /// Turns speculative decoding on, changes its settings or turns it off (`None`) between two
    /// steps. Sequences fed drafts in a step still in flight resolve as usual.
    pub fn set_speculative(
        &mut self,
        speculative: Option<crate::SpeculativeConfig>,
    ) -> Result<(), SchedulerError> {
        if let Some(s) = &speculative {
            s.validate()?;
        }
        // The n-gram indexes are keyed by `prompt_lookup_min`-grams: rebuilt on next use.
        let old_n = self
            .config
            .speculative
            .as_ref()
            .map(|s| s.prompt_lookup_min);
        if speculative.as_ref().map(|s| s.prompt_lookup_min) != old_n {
            for seq in self.seqs.iter_mut().flatten() {
                seq.ngrams = None;
            }
        }
        self.config.speculative = speculative;
        Ok(())
    }

    /// Replaces the tiers (a reload of the configuration): tiers may be added, removed,
    /// reordered or given new settings. Every live request belongs from now on to the tier of
    /// its name (`Request::tier`) if one is configured, and to none otherwise (a removed
    /// tier's requests run on unbounded, a new tier's name counts requests already carrying
    /// it); requests keep the SLO targets, preemptibility and queue bound they were queued
    /// with, those queued from now on get the new ones. The KV bounds
    /// (`max_kv_fraction`) count what each tier's running requests hold now; a bound that
    /// does not take as asked is in the returned list ([`QuotaChange`]): a tier over its new
    /// bound gets no block until it has given back the excess, and a bound too small for a
    /// request queued before is held at what that request needs until it ends. A policy built
    /// with the tiers (fair-share's weights) is rebuilt by the caller. Refused, changing
    /// nothing, when the settings are invalid.
    pub fn set_tiers(
        &mut self,
        tiers: Vec<crate::types::TierSpec>,
    ) -> Result<Vec<QuotaChange>, SchedulerError> {
        let mut config = self.config.clone();
        config.tiers = tiers;
        validate_config(&config)?;
        let position = |name: &str| {
            config
                .tiers
                .iter()
                .position(|t| t.name == name)
                .map_or(NO_TIER, |i| i as u8)
        };
        let mut held = vec![0; config.tiers.len()];
        let mut needs = vec![0; config.tiers.len()];
        for &slot in self.running.iter().chain(&self.waiting) {
            let Some(seq) = self.seqs.get_mut(slot as usize).and_then(Option::as_mut) else {
                continue;
            };
            seq.tier = position(&seq.req.tier);
            let i = usize::from(seq.tier);
            if let Some(h) = held.get_mut(i) {
                *h += seq.held_blocks().len();
            }
            if let Some(n) = needs.get_mut(i) {
                *n = (*n).max(quota_need(&config, seq));
            }
        }
        let (quotas, changes) =
            TierQuotas::replace(&config.tiers, config.num_gpu_blocks, held, &needs);
        self.quotas = quotas;
        self.tier_owed = vec![0; config.tiers.len()];
        self.config = config;
        Ok(changes)
    }

    /// After a request of `tier` ended: lowers the tier's KV bound, held up by a reload for
    /// requests queued before it ([`QuotaChange::Held`]), to what its live requests need.
    fn relax_tier_quota(&mut self, tier: u8) {
        if !self.quotas.is_held_up(tier) {
            return;
        }
        let need = self
            .running
            .iter()
            .chain(&self.waiting)
            .filter_map(|&slot| self.seq(slot))
            .filter(|s| s.tier == tier && !s.state.is_terminal())
            .map(|s| quota_need(&self.config, s))
            .max()
            .unwrap_or(0);
        self.quotas.relax(tier, need);
    }

    /// Sets where drafts come from when speculative decoding is on (`None`: prompt lookup, the
    /// default). The simulator uses it to model a draft source without real tokens.
    pub fn set_draft_source(&mut self, source: Option<Box<dyn crate::speculative::DraftSource>>) {
        self.draft_source = source;
    }

    /// Installs `policy` between two steps and returns the old one.
    ///
    /// The queues are untouched (no request is lost or duplicated); the new policy is told
    /// about every live request, in arrival order, as if they had just arrived. Cached-prefix
    /// lookups made for the old policy are dropped (the new one may not ask for them).
    pub fn swap_policy(&mut self, policy: Box<dyn Policy>) -> Box<dyn Policy> {
        let old = std::mem::replace(&mut self.policy, policy);
        for (_, _, slot) in self.lookups.drain(..) {
            if let Some(s) = self.seqs.get_mut(slot as usize).and_then(Option::as_mut) {
                s.cached_prefix = None;
            }
        }
        let mut live: Vec<u32> = self.running.iter().chain(&self.waiting).copied().collect();
        live.sort_unstable_by_key(|&s| self.seq(s).map(|q| (q.req.arrival, q.req.id)));
        for slot in live {
            if let Some(s) = self.seqs.get(slot as usize).and_then(|s| s.as_ref()) {
                self.policy.observe(PolicyEvent::Arrived(SeqView::new(s)));
            }
        }
        old
    }

    /// Counters and gauges (vLLM's meanings).
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            kv_usage: self.ledger.usage(),
            num_free_blocks: self.ledger.num_free(),
            prefix_queries: self.prefix_queries,
            prefix_hits: self.prefix_hits,
            num_preemptions: self.num_preemptions,
            num_running_adapters: self.adapters.num_running_adapters(),
            num_waiting_adapter_requests: self.adapters.num_waiting_requests(),
            pool_errors: self.pool_errors,
            num_host_blocks_used: self.host.as_ref().map_or(0, |h| h.num_used()),
            num_kv_offloaded_blocks: self.kv_offloaded,
            num_kv_stored_ahead_blocks: self.kv_stored_ahead,
            num_kv_loaded_blocks: self.kv_loaded,
            num_host_hit_tokens: self.host_hit_tokens,
        }
    }

    /// KV blocks held by each configured tier's running sequences, in the order of
    /// [`SchedulerConfig::tiers`] (a block shared through the prefix cache counts for each
    /// sequence holding it; see [`crate::TierSpec::max_kv_fraction`]).
    pub fn tier_kv_blocks(&self) -> &[usize] {
        self.quotas.all_held()
    }

    /// Block-accounting calls that failed since start ([`SchedulerStats::pool_errors`]).
    pub fn pool_errors(&self) -> u64 {
        self.pool_errors
    }

    /// Whether a step planned in order now may feed drafts (speculative decoding is on and
    /// no more sequences run than its `max_running`). Plans made ahead never do: a caller
    /// that pipelines steps should plan in order while this holds for its requests.
    pub fn drafts_enabled(&self) -> bool {
        self.config
            .speculative
            .as_ref()
            .is_some_and(|c| c.max_running == 0 || self.running.len() <= c.max_running)
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// The full KV block table of a running request (empty for waiting ones). Under a sliding
    /// window its leading entries may be [`RELEASED_BLOCK`]: blocks given back behind the
    /// window, which no step reads again.
    pub fn block_table(&self, id: RequestId) -> Option<&[BlockId]> {
        self.index
            .get(&id)
            .and_then(|&s| self.seq(s))
            .map(|s| s.block_table.as_slice())
    }

    /// The state of a known request.
    pub fn request_state(&self, id: RequestId) -> Option<RequestState> {
        self.index
            .get(&id)
            .and_then(|&s| self.seq(s))
            .map(|s| s.state)
    }

    /// The tokens generated so far for a known request (kept after it ends, until forgotten).
    pub fn output_tokens(&self, id: RequestId) -> Option<&[TokenId]> {
        self.index
            .get(&id)
            .and_then(|&s| self.seq(s))
            .map(|s| s.output.as_slice())
    }

    /// Verifies refcounts against block tables, the free list, queue membership and limits.
    pub fn check_invariants(&self) -> Result<(), SchedulerError> {
        let bad = |m: String| Err(SchedulerError::Invariant(m));
        self.ledger.check_invariants()?;
        if let Some(host) = &self.host {
            host.check_invariants()?;
        }
        if let Some(pool) = &self.allocator {
            pool.check_invariants()?;
            if !self.ledger.has_uncommitted() {
                self.ledger.check_against(pool)?;
            }
        }
        if self.pool_errors > 0 {
            return bad(format!("{} failed allocator calls", self.pool_errors));
        }
        if self.running.len() > self.config.max_num_seqs {
            return bad(format!("{} running > max_num_seqs", self.running.len()));
        }
        let adapter_of = |&slot: &u32| self.seq(slot).and_then(|s| s.req.lora_adapter);
        self.adapters
            .check(
                self.running.iter().map(adapter_of),
                self.waiting.iter().map(adapter_of),
            )
            .map_err(SchedulerError::Invariant)?;
        let distinct = self.adapters.num_running_adapters();
        if distinct > self.config.max_loras {
            return bad(format!(
                "{distinct} distinct adapters running > max_loras {}",
                self.config.max_loras
            ));
        }
        let mut refs = vec![0u32; self.ledger.num_blocks()];
        let mut queued = vec![0u8; self.seqs.len()];
        let mut tier_held = vec![0usize; self.config.tiers.len()];
        for &slot in &self.running {
            let Some(s) = self.seq(slot) else {
                return bad(format!("running slot {slot} empty"));
            };
            if s.state != RequestState::Running {
                return bad(format!("{:?} in running queue as {:?}", s.req.id, s.state));
            }
            if s.num_computed > s.num_tokens()
                || s.block_table.len() < self.ledger.blocks_for(s.num_computed)
            {
                return bad(format!("{:?} block table too short", s.req.id));
            }
            let known = s.output.len().checked_sub(s.pending as usize);
            if known.is_none_or(|k| {
                s.output[k..].iter().any(|&t| t != PENDING_TOKEN)
                    || k.checked_sub(1)
                        .is_some_and(|i| s.output[i] == PENDING_TOKEN)
            }) {
                return bad(format!(
                    "{:?}: {} pending tokens do not end its output",
                    s.req.id, s.pending
                ));
            }
            if s.released_blocks > s.block_table.len()
                || s.block_table[..s.released_blocks]
                    .iter()
                    .any(|&b| b != RELEASED_BLOCK)
                || s.held_blocks().contains(&RELEASED_BLOCK)
            {
                return bad(format!(
                    "{:?}: {} released blocks do not lead its table",
                    s.req.id, s.released_blocks
                ));
            }
            if let Some(w) = self.config.sliding_window {
                // Released blocks hold only keys before every window its next steps read.
                let bs = self.ledger.block_size();
                if s.released_blocks * bs > s.num_computed.saturating_sub(w.tokens) {
                    return bad(format!(
                        "{:?}: {} blocks released at {} computed tokens, window {}",
                        s.req.id, s.released_blocks, s.num_computed, w.tokens
                    ));
                }
            } else if s.released_blocks != 0 {
                return bad(format!("{:?} released blocks without a window", s.req.id));
            }
            if let Some(h) = tier_held.get_mut(usize::from(s.tier)) {
                *h += s.held_blocks().len();
            }
            for &b in s.held_blocks() {
                match refs.get_mut(b as usize) {
                    Some(r) => *r += 1,
                    None => return bad(format!("{:?} holds unknown block {b}", s.req.id)),
                }
            }
            queued[slot as usize] += 1;
        }
        for &slot in &self.waiting {
            let Some(s) = self.seq(slot) else {
                return bad(format!("waiting slot {slot} empty"));
            };
            if !matches!(s.state, RequestState::Waiting | RequestState::Preempted)
                || !s.block_table.is_empty()
            {
                return bad(format!("{:?} in waiting queue as {:?}", s.req.id, s.state));
            }
            queued[slot as usize] += 1;
        }
        for (slot, s) in self.seqs.iter().enumerate() {
            let Some(s) = s else { continue };
            let want = u8::from(!s.state.is_terminal());
            if queued[slot] != want {
                return bad(format!(
                    "{:?} ({:?}) queued {} times",
                    s.req.id, s.state, queued[slot]
                ));
            }
            if s.state.is_terminal() && !s.block_table.is_empty() {
                return bad(format!("ended {:?} still holds blocks", s.req.id));
            }
        }
        self.quotas
            .check(&tier_held, &self.config.tiers)
            .map_err(SchedulerError::Invariant)?;
        for (b, &r) in refs.iter().enumerate() {
            let have = self.ledger.ref_count(b as BlockId).unwrap_or(u32::MAX);
            if have != r {
                return bad(format!(
                    "block {b}: refcount {have}, referenced by {r} tables"
                ));
            }
        }
        Ok(())
    }
}
