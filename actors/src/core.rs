//! The synchronous engine step: plan with the scheduling core, execute the batch on a backend,
//! apply the sampled tokens back to the core.
//!
//! This is the one loop every front end shares: `switchyard generate` and `bench throughput`
//! drive it directly, and the scheduler actor drives it for the server. The simulator runs the
//! same `policies` calls with a cost model in place of the backend.
//!
//! With asynchronous scheduling ([`EngineCore::with_async_scheduling`], backends that
//! pipeline), each step is planned and submitted while the one before it still runs: the
//! scheduler launches a step with its sampled tokens pending ([`PENDING_TOKEN`]), the next
//! step feeds them from the device, and the outputs are resolved one step late. The host's
//! planning, batch building and launch then overlap the device's work instead of leaving it
//! idle between steps.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use switchyard_gpu::backend::{
    takes_pending_tokens, Backend, Batch, DraftVerifier, KvCopy, PromptLogprob, SamplingParams,
    SeqInput, SeqOutput,
};
use switchyard_gpu::LoraAdapter;
use switchyard_policies::{
    BlockId, BlockPool, FinishReason, IdMap, KvCommit, Policy, QueueTimeout, Request, RequestId,
    SamplingLimits, Scheduler, SchedulerConfig, SchedulerStats, SeqEvent, SloTargets, StepOutput,
    StepPlan, StepShape, Timestamp, TokenId, PENDING_TOKEN, RELEASED_BLOCK,
};

// The scheduler's pending token is the backend's.
const _: () = assert!(PENDING_TOKEN == switchyard_gpu::backend::PENDING_TOKEN);

use crate::EngineError;

/// Whether the engine plans each step while the previous one runs on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AsyncScheduling {
    /// On where the backend runs steps asynchronously to the host (the CUDA backend).
    #[default]
    Auto,
    /// On wherever the backend can pipeline steps (also the CPU backend, for tests).
    On,
    /// Every step planned after the previous one's outputs are applied.
    Off,
}

impl AsyncScheduling {
    /// Whether it takes effect with `backend`.
    pub fn enabled_for(self, backend: &dyn Backend) -> bool {
        match self {
            AsyncScheduling::Auto => backend.pipelines() && backend.overlaps_host(),
            AsyncScheduling::On => backend.pipelines(),
            AsyncScheduling::Off => false,
        }
    }
}

/// Settings of an [`EngineCore`].
#[derive(Debug, Clone)]
pub struct EngineCoreConfig {
    /// Limits and KV geometry for the scheduling core.
    pub scheduler: SchedulerConfig,
    /// Key of the prefix-cache block hash; random per process in the server.
    pub hash_key: [u64; 2],
}

/// A request as submitted to the core: the scheduling view and the sampler settings.
#[derive(Debug, Clone)]
pub struct SubmitOptions {
    /// What the scheduler needs (ids, limits, tier, prompt tokens).
    pub request: Request,
    /// What the sampler needs.
    pub sampling: Arc<SamplingParams>,
    /// The LoRA adapter's weights, when `request.lora_adapter` names one (the id is the
    /// scheduler's and the prefix cache's; the weights go to the backend with each step).
    pub adapter: Option<Arc<LoraAdapter>>,
    /// The request's use of its adapter, held with the weights until it ends: it tells the
    /// LoRA manager which tenants' requests use an adapter (none offline).
    pub adapter_user: Option<crate::actors::AdapterUser>,
    /// When the request reached the engine (before its prompt was encoded): the scheduler
    /// actor dates the request's arrival from it, so that policies age requests and set SLO
    /// deadlines from the moment the client's time to first token runs from. `None`: it
    /// arrives when the scheduler takes it.
    pub received: Option<std::time::Instant>,
    /// When its prompt was encoded: the scheduler actor dates [`SubmitOptions::queued`] from
    /// it (its adapter's lookup and its grammar's compile come after, as in vLLM, where a
    /// request waits for both in the scheduler's queue). `None`: when the scheduler takes it.
    pub encoded: Option<std::time::Instant>,
    /// When the request entered the engine's queue, on the engine clock (the scheduler actor
    /// stamps it from [`SubmitOptions::encoded`]): its queue time, vLLM's time spent waiting
    /// to be scheduled, runs from then, without the encoding. `None`: from its arrival.
    pub queued: Option<Timestamp>,
    /// How many times its queue time counts in `request_queue_time_seconds`: once, or for a
    /// beam search's steps, once per beam for the first and not for the others (the client's
    /// request waited once).
    pub queue_times: u32,
    /// The tier its metrics carry ([`crate::metric_names::LABEL_TIER`]): its tier where that
    /// is one of the server's configured tiers, "" otherwise (no tier label).
    pub metrics_tier: Arc<str>,
    /// The tenant its usage counters carry ([`crate::metric_names::LABEL_TENANT`]): its tenant
    /// where the server's configuration names it, "" otherwise (no tenant label).
    pub metrics_tenant: Arc<str>,
    /// Whether its tier's queue bound applies (`max_queue_ms`): not to a beam search's steps
    /// after the first, work of a client request admitted once.
    pub queue_bound: bool,
}

impl SubmitOptions {
    /// An offline request (generation, benchmarks): no tenant, tier or SLO, arriving at time
    /// zero.
    pub fn offline(
        id: u64,
        prompt: Vec<TokenId>,
        limits: SamplingLimits,
        sampling: Arc<SamplingParams>,
    ) -> Self {
        Self {
            request: Request {
                id: RequestId(id),
                tenant: String::new(),
                tier: String::new(),
                priority: 0,
                lora_adapter: None,
                arrival: Timestamp(0),
                slo: SloTargets::default(),
                prompt: prompt.into(),
                limits,
                cache_salt: None,
            },
            sampling,
            adapter: None,
            adapter_user: None,
            received: None,
            encoded: None,
            queued: None,
            queue_times: 1,
            metrics_tier: Arc::from(""),
            metrics_tenant: Arc::from(""),
            queue_bound: true,
        }
    }

    /// Runs the request with a LoRA adapter, `id` being its prefix-cache key.
    pub fn with_adapter(mut self, id: u32, adapter: Arc<LoraAdapter>) -> Self {
        self.request.lora_adapter = Some(id);
        self.adapter = Some(adapter);
        self
    }
}

/// Something that happened to a request during a step.
#[derive(Debug, Clone, PartialEq)]
pub enum CoreEvent {
    /// A token was generated.
    Token {
        /// The request.
        id: RequestId,
        /// The sampled token.
        token: TokenId,
        /// Its log-probability under the model, when logprobs were requested.
        logprob: Option<f32>,
        /// The most likely alternatives, when logprobs were requested.
        top_logprobs: Vec<(TokenId, f32)>,
        /// The token ended the sequence as a stop token or the end of sequence: as in vLLM,
        /// its text is not part of the output unless the request asks for stop strings in it.
        stops: bool,
    },
    /// Logprobs of prompt positions completed in this step (requests that asked for them).
    PromptLogprobs {
        /// The request.
        id: RequestId,
        /// (position, token, its logprob, top alternatives) per completed prompt position.
        entries: Vec<PromptLogprob>,
    },
    /// The request's first token was sampled (a `Token` follows): how many of its prompt
    /// tokens the prefix cache served when it was first admitted (its `usage`'s
    /// `cached_tokens`; see [`SeqEvent::FirstToken`]).
    PromptCached {
        /// The request.
        id: RequestId,
        /// Prompt tokens whose KV came from the prefix cache.
        tokens: u32,
    },
    /// The final hidden state at the request's last prompt token, for a request whose
    /// sampling asked for it ([`SamplingParams::hidden_state`]: an embedding); comes before
    /// that step's `Token`.
    Hidden {
        /// The request.
        id: RequestId,
        /// `hidden_size` values, after the model's last normalization.
        values: Vec<f32>,
    },
    /// The request ended; its KV blocks are already freed.
    Finished {
        /// The request.
        id: RequestId,
        /// Why it ended.
        reason: FinishReason,
    },
}

/// A sampled token's logprob and the top alternatives, as the backend reported them.
type SampledLogprobs = (Option<f32>, Vec<(TokenId, f32)>);

/// Speculative decoding counters since the core started (vLLM's `spec_decode_*` meanings).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecDecodeStats {
    /// Sequence steps fed drafts.
    pub num_drafts: u64,
    /// Draft tokens fed.
    pub num_draft_tokens: u64,
    /// Draft tokens the backend accepted.
    pub num_accepted_tokens: u64,
}

/// What one step did, for callers that report progress and engine overhead.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    /// Events in the order they happened.
    pub events: Vec<CoreEvent>,
    /// Sequences in the batch.
    pub num_seqs: usize,
    /// Tokens in the batch (prefill chunks plus decodes).
    pub num_batched_tokens: usize,
    /// Microseconds spent planning (policy and allocator).
    pub plan_us: u64,
    /// Microseconds spent in the backend.
    pub execute_us: u64,
    /// Microseconds spent applying outputs.
    pub apply_us: u64,
    /// The work of the batch planned in this call (what the simulator's cost model prices).
    /// Without asynchronous scheduling `execute_us` is this batch's time; with it, the batch
    /// runs while the next call plans, so its time is spread over the next report.
    pub shape: StepShape,
}

/// A planned step: the scheduler's plan and the batch the backend must run for it.
#[derive(Debug)]
pub struct PreparedStep {
    /// The plan, needed again to apply the outputs.
    pub plan: StepPlan,
    /// The KV copies between the cache and the host tier to make, in order, before the batch
    /// runs ([`Backend::copy_kv`]): those of plans that left nothing to run, then this plan's.
    pub kv_copies: Vec<KvCopies>,
    /// The backend's input.
    pub batch: Batch,
    /// Sequences whose backend state (sampler history, RNG) must be dropped before the batch runs.
    pub release: Vec<u64>,
    /// Microseconds spent planning.
    pub plan_us: u64,
    /// Queue times (queued to first scheduled, microseconds) of requests scheduled for the first
    /// time in this step, with each one's tier ("" for none).
    pub queue_times_us: Vec<(Arc<str>, u64)>,
    /// The requests scheduled for the first time in this step (their prefill and inference
    /// times run from this step's planning).
    pub first_scheduled: Vec<RequestId>,
    /// The uses of the batch's adapters by its requests ([`SubmitOptions::adapter_user`]):
    /// the batch holds their weights until it is recycled, a step after a request that ended
    /// meanwhile let go of its own, so it holds their marks too, for the LoRA manager to see
    /// whose requests those weights serve. Drop them once the batch is recycled.
    pub adapter_users: Vec<crate::actors::AdapterUser>,
}

/// The KV copies of one plan in the backend's terms ([`StepPlan::kv_offloads`] and
/// [`StepPlan::kv_loads`], made by one [`Backend::copy_kv`] call, then
/// [`StepPlan::kv_stores`], by one [`Backend::store_kv`] call).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvCopies {
    /// Cache → host tier, made first.
    pub offloads: Vec<KvCopy>,
    /// Host tier → cache, made after the offloads.
    pub loads: Vec<KvCopy>,
    /// Cache → host tier ahead of eviction, made last (alongside the next step).
    pub stores: Vec<KvCopy>,
}

impl KvCopies {
    /// The copies `plan` asks for.
    pub fn of(plan: &StepPlan) -> Self {
        let kv = |c: &switchyard_policies::BlockCopy| KvCopy {
            device: c.device,
            host: c.host,
        };
        Self {
            offloads: plan.kv_offloads.iter().map(kv).collect(),
            loads: plan.kv_loads.iter().map(kv).collect(),
            stores: plan.kv_stores.iter().map(kv).collect(),
        }
    }

    /// Whether there is nothing to copy.
    pub fn is_empty(&self) -> bool {
        self.offloads.is_empty() && self.loads.is_empty() && self.stores.is_empty()
    }

    /// Makes the copies of `all` (plans in order, the last one's step next) on `backend`, in
    /// order.
    pub fn run_all(
        all: &[KvCopies],
        backend: &mut dyn Backend,
    ) -> Result<(), switchyard_gpu::GpuError> {
        let last = all.len().saturating_sub(1);
        all.iter().enumerate().try_for_each(|(i, c)| {
            if !(c.offloads.is_empty() && c.loads.is_empty()) {
                backend.copy_kv(&c.offloads, &c.loads)?;
            }
            if c.stores.is_empty() {
                Ok(())
            } else if i == last {
                backend.store_kv(&c.stores)
            } else {
                // A plan that left nothing to run: the step after its stores is a later
                // plan's, which may evict (and write) their blocks, so they are made at once.
                backend.copy_kv(&c.stores, &[])
            }
        })
    }
}

/// A committed plan that could not be turned into a batch (a core bug, never user input): the
/// plan comes back so its requests can be failed rather than left waiting.
#[derive(Debug)]
pub struct FailedBuild {
    /// The plan that was not built (boxed: a failure is rare, and the `Result` stays small).
    pub plan: Box<StepPlan>,
    /// Why.
    pub error: EngineError,
}

/// A plan whose block changes are on their way to the allocator actor.
#[derive(Debug)]
pub struct PlannedStep {
    /// The plan; its reserved blocks get ids in [`StepCore::assign`].
    pub plan: StepPlan,
    /// The block changes for the allocator.
    pub commit: KvCommit,
    /// The step's time on the engine clock.
    pub now: Timestamp,
    /// When planning began (for the plan-time metric).
    started: Instant,
}

/// What the engine keeps per request in flight.
#[derive(Debug)]
struct LiveRequest {
    /// Prompt tokens.
    prompt: Arc<[TokenId]>,
    /// Sampler settings.
    sampling: Arc<SamplingParams>,
    /// LoRA adapter weights.
    adapter: Option<Arc<LoraAdapter>>,
    /// Its use of the adapter ([`SubmitOptions::adapter_user`]), held as long as the weights
    /// (and by each batch that holds them, [`PreparedStep::adapter_users`]).
    adapter_user: Option<crate::actors::AdapterUser>,
    /// When it entered the queue, on the engine clock ([`SubmitOptions::queued`]).
    queued: Timestamp,
    /// Whether it has been scheduled at least once.
    started: bool,
    /// How many times its queue time is recorded ([`SubmitOptions::queue_times`]).
    queue_times: u32,
    /// Whether it may be fed drafts (speculative decoding).
    speculate: bool,
    /// Its metrics' tier ([`SubmitOptions::metrics_tier`]), for the per-tier queue time.
    tier: Arc<str>,
}

/// The scheduling side of the engine: the policies core plus the prompt and sampler settings of
/// requests in flight. It never touches a backend, so the scheduler actor can run it while the
/// executor actor owns the backend on its own thread.
pub struct StepCore {
    scheduler: Scheduler,
    /// Requests in flight.
    live: IdMap<LiveRequest>,
    /// Sequences that ended since the last prepared step; their backend state is released.
    ended: Vec<u64>,
    /// Entries of batches that ran, refilled by later steps (two while steps are pipelined);
    /// they name no adapter ([`StepCore::keep_spare`]).
    spare: Vec<Vec<SeqInput>>,
    /// Which requests the backend verifies drafts for (speculative decoding).
    verifier: Option<DraftVerifier>,
    /// Speculative decoding counters.
    spec: SpecDecodeStats,
    /// The scheduler's pool errors already logged and counted ([`StepCore::note_pool_errors`]).
    pool_errors_seen: u64,
    /// Requests the scheduler ended for waiting past their queue bound, not yet reported
    /// ([`StepCore::take_timed_out`]).
    timed_out: Vec<QueueTimeout>,
    /// The KV copies of plans that left nothing to run (every sequence ended between the
    /// plan and the batch): made before the next batch, which the host tier's contents
    /// (and the blocks those plans took) are planned after.
    stray_copies: Vec<KvCopies>,
}

impl StepCore {
    /// A planned step's work as the cost models price it, the model's sliding window
    /// included ([`StepPlan::shape_within`]).
    pub fn shape(&self, plan: &StepPlan) -> StepShape {
        plan.shape_within(self.scheduler.config().sliding_window)
    }

    /// Builds the core; fails when the scheduler configuration is inconsistent.
    pub fn new(config: EngineCoreConfig, policy: Box<dyn Policy>) -> Result<Self, EngineError> {
        let scheduler = Scheduler::new(config.scheduler, policy, config.hash_key)?;
        Ok(Self {
            scheduler,
            live: IdMap::default(),
            ended: Vec::new(),
            spare: Vec::new(),
            verifier: None,
            spec: SpecDecodeStats::default(),
            pool_errors_seen: 0,
            timed_out: Vec::new(),
            stray_copies: Vec::new(),
        })
    }

    /// Tells the core which requests the backend verifies drafts for (its
    /// [`Backend::draft_verifier`]); fails when speculative decoding is configured and the
    /// backend takes no drafts. Without it, no request is fed drafts.
    pub fn set_draft_verifier(
        &mut self,
        verifier: Option<DraftVerifier>,
        backend: &str,
    ) -> Result<(), EngineError> {
        if self.scheduler.config().speculative.is_some() && verifier.is_none() {
            return Err(EngineError::Backend(switchyard_gpu::GpuError::InvalidConfig(
                format!("speculative decoding is configured but the {backend} backend does not verify draft tokens"),
            )));
        }
        self.verifier = verifier;
        Ok(())
    }

    /// Turns speculative decoding on, changes it or turns it off between two steps; refused
    /// (nothing changes) for bad settings or a backend that verifies no drafts.
    pub fn set_speculative(
        &mut self,
        speculative: Option<switchyard_policies::SpeculativeConfig>,
    ) -> Result<(), EngineError> {
        if speculative.is_some() && self.verifier.is_none() {
            return Err(EngineError::Backend(
                switchyard_gpu::GpuError::InvalidConfig(
                    "the backend does not verify draft tokens".into(),
                ),
            ));
        }
        Ok(self.scheduler.set_speculative(speculative)?)
    }

    /// The speculative decoding settings in force.
    pub fn speculative(&self) -> Option<&switchyard_policies::SpeculativeConfig> {
        self.scheduler.config().speculative.as_ref()
    }

    /// Speculative decoding counters.
    pub fn spec_decode_stats(&self) -> SpecDecodeStats {
        self.spec
    }

    /// Queues a request; rejected requests (too long, duplicate id) leave no trace.
    pub fn add_request(&mut self, mut submit: SubmitOptions) -> Result<(), EngineError> {
        let id = submit.request.id;
        submit.request.limits.speculate &= self.verifier.is_some_and(|v| v(&submit.sampling));
        if self.live.contains_key(&id) {
            return Err(EngineError::DuplicateRequest(id.0));
        }
        if submit.request.lora_adapter.is_some() != submit.adapter.is_some() {
            return Err(EngineError::AdapterMismatch(id.0));
        }
        let live = LiveRequest {
            prompt: submit.request.prompt.clone(),
            sampling: submit.sampling,
            adapter: submit.adapter,
            adapter_user: submit.adapter_user,
            queued: submit.queued.unwrap_or(submit.request.arrival),
            started: false,
            queue_times: submit.queue_times,
            speculate: submit.request.limits.speculate,
            tier: submit.metrics_tier.clone(),
        };
        if submit.queue_bound {
            self.scheduler.add_request(submit.request)?;
        } else {
            self.scheduler.add_unbounded_request(submit.request)?;
        }
        self.live.insert(id, live);
        Ok(())
    }

    /// Ends a request in any state (client gone); frees its blocks. Returns false if unknown.
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.finish(id, FinishReason::Abort)
    }

    /// Ends a request for a reason found outside the core (a stop string matched, an abort).
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let known = self.scheduler.finish(id, reason);
        self.scheduler.forget(id);
        if self.live.remove(&id).is_some() {
            self.ended.push(id.0);
        }
        known
    }

    /// Forgets the requests `plan` timed out in the queue (the scheduler already ended them)
    /// and keeps them for [`StepCore::take_timed_out`].
    fn end_timed_out(&mut self, plan: &mut StepPlan) {
        for t in plan.timed_out.drain(..) {
            self.scheduler.forget(t.id);
            if self.live.remove(&t.id).is_some() {
                self.ended.push(t.id.0);
            }
            self.timed_out.push(t);
        }
    }

    /// The requests ended since the last call because they waited past their queue bound
    /// (`tiers.<name>.max_queue_ms`, `scheduler.max_queue_ms`) without being admitted: the
    /// caller fails their clients' requests.
    pub fn take_timed_out(&mut self) -> Vec<QueueTimeout> {
        std::mem::take(&mut self.timed_out)
    }

    /// When the earliest queue bound of a waiting request runs out, if any bounds one (see
    /// [`Scheduler::next_queue_deadline`]).
    pub fn next_queue_deadline(&self) -> Option<Timestamp> {
        self.scheduler.next_queue_deadline()
    }

    /// Whether block changes wait for a commit to the allocator.
    pub fn has_uncommitted(&self) -> bool {
        self.scheduler.ledger().has_uncommitted()
    }

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// Queue lengths, KV usage, prefix-cache and preemption counters.
    pub fn stats(&self) -> SchedulerStats {
        self.scheduler.stats()
    }

    /// Blocks of the host KV tier (0: none).
    pub fn num_host_blocks(&self) -> usize {
        self.scheduler.config().num_host_blocks
    }

    /// KV blocks held by each configured tier's running requests, with the tier's name (see
    /// [`Scheduler::tier_kv_blocks`]).
    pub fn tier_kv_blocks(&self) -> impl Iterator<Item = (&str, usize)> {
        self.scheduler
            .config()
            .tiers
            .iter()
            .map(|t| t.name.as_str())
            .zip(self.scheduler.tier_kv_blocks().iter().copied())
    }

    /// Makes the scheduler's pool errors seen since the last call visible to operators: an
    /// ERROR naming the total, and their number added to `engine_pool_errors_total`. The core
    /// counts them ([`SchedulerStats::pool_errors`]) and goes on, being IO-free; each one is a
    /// bug in the core or its caller, never user input. Returns how many were new. Called
    /// after each step is planned and after its outputs are applied; the scheduler actor also
    /// calls it when it publishes its gauges, for errors between steps (a finish, an abort).
    pub fn note_pool_errors(&mut self) -> u64 {
        let total = self.scheduler.pool_errors();
        let new = total.saturating_sub(self.pool_errors_seen);
        if new > 0 {
            self.pool_errors_seen = total;
            tracing::error!(
                pool_errors = total,
                new,
                "the scheduling core's block accounting failed (a bug: please report it); \
                 it went on, and the KV cache may serve fewer requests than it should"
            );
            metrics::counter!(crate::metric_names::ENGINE_POOL_ERRORS).increment(new);
        }
        new
    }

    /// Replaces the tiers' settings between two steps (see
    /// [`switchyard_policies::Scheduler::set_tiers`]).
    pub fn set_tiers(
        &mut self,
        tiers: Vec<switchyard_policies::TierSpec>,
    ) -> Result<Vec<switchyard_policies::QuotaChange>, EngineError> {
        Ok(self.scheduler.set_tiers(tiers)?)
    }

    /// Replaces the policy between two steps; returns the old one.
    pub fn swap_policy(&mut self, policy: Box<dyn Policy>) -> Box<dyn Policy> {
        self.scheduler.swap_policy(policy)
    }

    /// Tokens generated so far for a request in flight.
    pub fn output_tokens(&self, id: RequestId) -> Option<&[TokenId]> {
        self.scheduler.output_tokens(id)
    }

    /// Plans a step at time `now` and commits its block changes to the core's own allocator;
    /// `None` when there is nothing to run.
    pub fn prepare(&mut self, now: Timestamp) -> Result<Option<PreparedStep>, EngineError> {
        let t0 = Instant::now();
        let mut plan = self.scheduler.schedule(now);
        self.end_timed_out(&mut plan);
        self.build(plan, now, t0).map_err(|f| f.error)
    }

    /// Plans a step while the previous one is in flight ([`StepCore::launch`]ed, not yet
    /// resolved); see [`Scheduler::schedule_ahead`]. `Ok(None)`: no step can be planned
    /// ahead now (it would preempt); resolve first, then [`StepCore::prepare`].
    pub fn prepare_ahead(
        &mut self,
        now: Timestamp,
    ) -> Result<Option<Option<PreparedStep>>, EngineError> {
        let t0 = Instant::now();
        match self.scheduler.schedule_ahead(now) {
            Some(mut plan) => {
                self.end_timed_out(&mut plan);
                Ok(Some(self.build(plan, now, t0).map_err(|f| f.error)?))
            }
            None => Ok(None),
        }
    }

    /// Whether a plan made ahead held back a preemption (cleared by the call); see
    /// [`Scheduler::take_preemption_wanted`].
    pub fn take_preemption_wanted(&mut self) -> bool {
        self.scheduler.take_preemption_wanted()
    }

    /// Marks a prepared step as submitted before its outputs are known (see
    /// [`Scheduler::launch`]); its outputs go to [`StepCore::resolve`]. Returns whether the
    /// next step may be planned ahead of this one's outputs: every sequence that samples
    /// here can be fed its token from the device (no penalties) and none is speculating
    /// (speculative decoding plans in order while [`Scheduler::drafts_enabled`]).
    pub fn launch(&mut self, plan: &StepPlan) -> bool {
        self.scheduler.launch(plan);
        // A sequence fed drafts yields an unknown number of tokens, and one that may be fed
        // drafts next gets them only in a step planned in order: the next step waits.
        let drafts = self.scheduler.drafts_enabled();
        plan.seqs.iter().filter(|s| s.samples).all(|s| {
            s.draft_tokens.is_empty()
                && self
                    .live
                    .get(&s.id)
                    .is_none_or(|l| takes_pending_tokens(&l.sampling) && !(drafts && l.speculate))
        })
    }

    /// Drops every prefix-cache registration; see [`Scheduler::clear_prefix_cache`].
    pub fn clear_prefix_cache(&mut self) {
        self.scheduler.clear_prefix_cache();
    }

    /// Forgets every launched step without applying it (their requests were aborted); see
    /// [`Scheduler::forget_launched`].
    pub fn forget_launched(&mut self) {
        self.scheduler.forget_launched();
    }

    /// Applies the outputs of the oldest launched step; see [`StepCore::complete`].
    pub fn resolve(
        &mut self,
        plan: &StepPlan,
        outputs: Vec<SeqOutput>,
        now: Timestamp,
    ) -> Vec<CoreEvent> {
        self.apply(plan, outputs, now, true)
    }

    /// Hands the KV block pool to an allocator actor; from then on steps go through
    /// [`StepCore::plan`], the allocator, [`StepCore::assign`] and [`StepCore::build`].
    pub fn detach_allocator(&mut self) -> Option<BlockPool> {
        self.scheduler.detach_allocator()
    }

    /// Plans a step at time `now` against the core's view of the KV blocks. The commit must
    /// reach the allocator, and its block ids come back through [`StepCore::assign`], before
    /// anything else changes the core.
    pub fn plan(&mut self, now: Timestamp) -> PlannedStep {
        let started = Instant::now();
        let mut plan = StepPlan::default();
        let commit = self.scheduler.plan_into(now, &mut plan);
        self.end_timed_out(&mut plan);
        PlannedStep {
            plan,
            commit,
            now,
            started,
        }
    }

    /// [`StepCore::plan`] while the previous step is in flight; `None` when no step can be
    /// planned ahead now (see [`Scheduler::plan_ahead_into`]).
    pub fn plan_ahead(&mut self, now: Timestamp) -> Option<PlannedStep> {
        let started = Instant::now();
        let mut plan = StepPlan::default();
        let commit = self.scheduler.plan_ahead_into(now, &mut plan)?;
        self.end_timed_out(&mut plan);
        Some(PlannedStep {
            plan,
            commit,
            now,
            started,
        })
    }

    /// Writes the allocator's block ids into the planned step.
    pub fn assign(&mut self, step: &mut PlannedStep, ids: &[BlockId]) -> Result<(), EngineError> {
        Ok(self.scheduler.assign_blocks(&mut step.plan, ids)?)
    }

    /// Turns a committed plan into the backend's batch; `None` when the plan is empty or every
    /// sequence in it ended since it was made (a client that hung up while the step's blocks
    /// were being committed). Sequences that ended are left out (their plan entries are
    /// skipped when outputs are applied). On failure the plan comes back with the error.
    pub fn build_step(&mut self, step: PlannedStep) -> Result<Option<PreparedStep>, FailedBuild> {
        self.build(step.plan, step.now, step.started)
    }

    /// The sequences that ended since the last batch was built, for the backend to release
    /// their state now (the engine is idle: no batch will carry them).
    pub fn take_ended(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.ended)
    }

    fn build(
        &mut self,
        plan: StepPlan,
        now: Timestamp,
        t0: Instant,
    ) -> Result<Option<PreparedStep>, FailedBuild> {
        self.note_pool_errors();
        let copies = KvCopies::of(&plan);
        let own_copies = !copies.is_empty();
        if own_copies {
            self.stray_copies.push(copies);
        }
        if plan.seqs.is_empty() {
            return Ok(None);
        }
        // Entries of the last batch are refilled in place: no allocation per sequence in the
        // steady state.
        let mut seqs = self.spare.pop().unwrap_or_default();
        let mut n = 0;
        let mut queue_times_us = Vec::new();
        let mut first_scheduled = Vec::new();
        let mut adapter_users = Vec::new();
        for s in &plan.seqs {
            let Some(live) = self.live.get_mut(&s.id) else {
                continue;
            };
            let first_step = !live.started;
            if first_step {
                live.started = true;
                first_scheduled.push(s.id);
                let waited = now.saturating_sub(live.queued);
                for _ in 0..live.queue_times {
                    queue_times_us.push((live.tier.clone(), waited));
                }
            }
            if n == seqs.len() {
                seqs.push(SeqInput {
                    seq_id: 0,
                    num_computed_tokens: 0,
                    tokens: Vec::new(),
                    block_table: Vec::new(),
                    sample: false,
                    num_drafts: 0,
                    sampling: live.sampling.clone(),
                    adapter: None,
                    cached_prompt: None,
                });
            }
            let entry = &mut seqs[n];
            n += 1;
            entry.seq_id = s.id.0;
            entry.num_computed_tokens = s.num_computed_tokens;
            entry.sample = s.samples;
            entry.num_drafts = s.draft_tokens.len();
            entry.adapter.clone_from(&live.adapter);
            adapter_users.extend(live.adapter_user.clone());
            // Prompt tokens served from the prefix cache still count for the repetition
            // penalty: the backend's sampler hears of them on the first step.
            entry.cached_prompt = (first_step
                && s.num_computed_tokens > 0
                && live.sampling.repetition_penalty != 1.0)
                .then(|| live.prompt.clone());
            if !Arc::ptr_eq(&entry.sampling, &live.sampling) {
                entry.sampling = live.sampling.clone();
            }
            let prompt = &live.prompt;
            let end = s.num_computed_tokens + s.num_new_tokens - s.draft_tokens.len();
            // Outputs end with pending tokens while steps are in flight; the backend feeds
            // them from the device. Drafts follow the known tokens.
            let outputs = self.scheduler.output_tokens(s.id).unwrap_or(&[]);
            entry.tokens.clear();
            for i in s.num_computed_tokens..end {
                let t = if i < prompt.len() {
                    prompt.get(i)
                } else {
                    outputs.get(i - prompt.len())
                };
                let Some(&t) = t else {
                    // The plan asks for tokens the request does not have.
                    let error = EngineError::UnknownSequence(s.id.0);
                    seqs.truncate(n);
                    self.keep_spare(seqs);
                    return Err(FailedBuild {
                        plan: Box::new(plan),
                        error,
                    });
                };
                entry.tokens.push(t);
            }
            entry.tokens.extend_from_slice(&s.draft_tokens);
            entry.block_table.clear();
            let table = self.scheduler.block_table(s.id).unwrap_or_default();
            match table.iter().position(|&b| b != RELEASED_BLOCK) {
                Some(0) | None => entry.block_table.extend_from_slice(table),
                // Blocks given back behind a sliding window: the backend reads no key there
                // (`Backend::window_read_slack`), so they name the first block the sequence
                // still holds and every entry stays an id of the cache.
                Some(held) => {
                    let fill = table[held];
                    entry.block_table.resize(held, fill);
                    entry.block_table.extend_from_slice(&table[held..]);
                }
            }
        }
        seqs.truncate(n);
        if n == 0 {
            // Nothing left to run; the ended sequences are released with the next batch.
            self.keep_spare(seqs);
            return Ok(None);
        }
        let release = std::mem::take(&mut self.ended);
        if !own_copies && !self.stray_copies.is_empty() {
            // The last entry must be this plan's (empty here): `KvCopies::run_all` makes the
            // last entry's stores alongside this batch, and an earlier plan's stores may read
            // blocks this batch writes (its evictions copy nothing once they are stored).
            self.stray_copies.push(KvCopies::default());
        }
        Ok(Some(PreparedStep {
            kv_copies: std::mem::take(&mut self.stray_copies),
            queue_times_us,
            first_scheduled,
            plan,
            batch: Batch { seqs },
            adapter_users,
            release,
            plan_us: t0.elapsed().as_micros() as u64,
        }))
    }

    /// Gives back a batch that ran, so the next step reuses its buffers.
    pub fn recycle(&mut self, batch: Batch) {
        self.keep_spare(batch.seqs);
    }

    /// Keeps a batch's entries for reuse (two batches at most), without their adapters: an
    /// entry kept with its `Arc<LoraAdapter>` would hold the weights of a request that ended,
    /// so the LoRA manager could not evict them, and an unloaded adapter's weights would stay
    /// in memory until later steps overwrote the entry.
    fn keep_spare(&mut self, mut seqs: Vec<SeqInput>) {
        if self.spare.len() >= 2 {
            return;
        }
        for s in &mut seqs {
            s.adapter = None;
        }
        self.spare.push(seqs);
    }

    /// Applies the backend's outputs for a prepared step and returns what happened.
    pub fn complete(
        &mut self,
        plan: &StepPlan,
        outputs: Vec<SeqOutput>,
        now: Timestamp,
    ) -> Vec<CoreEvent> {
        self.apply(plan, outputs, now, false)
    }

    fn apply(
        &mut self,
        plan: &StepPlan,
        outputs: Vec<SeqOutput>,
        now: Timestamp,
        launched: bool,
    ) -> Vec<CoreEvent> {
        // Per sequence, the logprobs of its tokens in order (accepted drafts, then the last).
        let mut logprobs: HashMap<u64, std::collections::VecDeque<SampledLogprobs>> =
            HashMap::new();
        let mut sampled = Vec::with_capacity(outputs.len());
        let mut events = Vec::with_capacity(outputs.len());
        // Drafts verified this step, counted as vLLM counts them: per sequence whose step
        // ran, the drafts fed and those the backend accepted (stops after them included).
        let drafted: HashMap<u64, usize> = if plan.seqs.iter().any(|s| !s.draft_tokens.is_empty()) {
            plan.seqs
                .iter()
                .filter(|s| !s.draft_tokens.is_empty())
                .map(|s| (s.id.0, s.draft_tokens.len()))
                .collect()
        } else {
            HashMap::new()
        };
        for o in outputs {
            self.follow_constraint_on_drafts(RequestId(o.seq_id));
            // Neither prompt logprobs nor a hidden state for a request that ended (aborted)
            // while the step ran: the scheduler drops that step's token, and nothing more is
            // reported of the request.
            let live = self.live.contains_key(&RequestId(o.seq_id));
            // Prompt logprobs come before the step's tokens: a request's first token follows
            // its last prompt position.
            if live && !o.prompt_logprobs.is_empty() {
                events.push(CoreEvent::PromptLogprobs {
                    id: RequestId(o.seq_id),
                    entries: o.prompt_logprobs,
                });
            }
            if let Some(values) = o.hidden.filter(|_| live) {
                events.push(CoreEvent::Hidden {
                    id: RequestId(o.seq_id),
                    values,
                });
            }
            if let Some(token) = o.token {
                if let Some(&fed) = drafted.get(&o.seq_id) {
                    self.spec.num_drafts += 1;
                    self.spec.num_draft_tokens += fed as u64;
                    self.spec.num_accepted_tokens += o.accepted.len().min(fed) as u64;
                }
                sampled.push(StepOutput {
                    id: RequestId(o.seq_id),
                    token,
                    accepted: o.accepted.len() as u32,
                });

                let wants = o.logprob.is_some() || !o.top_logprobs.is_empty();
                if wants || o.accepted.iter().any(|a| a.logprob.is_some()) {
                    let list = logprobs.entry(o.seq_id).or_default();
                    list.extend(o.accepted.into_iter().map(|a| (a.logprob, a.top_logprobs)));
                    list.push_back((o.logprob, o.top_logprobs));
                }
            }
        }
        let seq_events = if launched {
            self.scheduler.resolve(plan, &sampled, now)
        } else {
            self.scheduler.apply_outputs(plan, &sampled, now)
        };
        let stop_tokens = stopping_tokens(&seq_events);
        for (i, event) in seq_events.into_iter().enumerate() {
            match event {
                SeqEvent::Token { id, token, .. } => {
                    let (logprob, top_logprobs) = logprobs
                        .get_mut(&id.0)
                        .and_then(|l| l.pop_front())
                        .unwrap_or_default();
                    events.push(CoreEvent::Token {
                        id,
                        token,
                        logprob,
                        top_logprobs,
                        stops: stop_tokens.get(i).copied().unwrap_or(false),
                    });
                }
                SeqEvent::Finished { id, reason, .. } => {
                    self.scheduler.forget(id);
                    if self.live.remove(&id).is_some() {
                        self.ended.push(id.0);
                    }
                    events.push(CoreEvent::Finished { id, reason });
                }
                SeqEvent::FirstToken {
                    id,
                    cached_prompt_tokens,
                    ..
                } => events.push(CoreEvent::PromptCached {
                    id,
                    tokens: cached_prompt_tokens,
                }),
            }
        }
        self.note_pool_errors();
        events
    }
}

impl StepCore {
    /// Feeds no more drafts to a request whose constraint stopped wanting them
    /// ([`Constraint::wants_drafts`]: a grammar that must copy its matcher for every draft
    /// round, which would slow every sequence's step). Read as a step's outputs are applied,
    /// after the backend's calls on the constraint for that step; the backend still verifies
    /// the drafts of steps already planned, so what it samples is unchanged (one token per
    /// step's), and the request's steps may be planned ahead from then on.
    ///
    /// [`Constraint::wants_drafts`]: switchyard_gpu::Constraint::wants_drafts
    fn follow_constraint_on_drafts(&mut self, id: RequestId) {
        let Some(l) = self.live.get_mut(&id) else {
            return;
        };
        if l.speculate
            && l.sampling
                .constraint
                .as_ref()
                .is_some_and(|c| !c.wants_drafts())
        {
            l.speculate = false;
            self.scheduler.stop_drafts(id);
            tracing::debug!(id = id.0, "no more drafts: its constraint wants none");
        }
    }
}

/// Per event, whether it is the token that ended its sequence as a stop token or the end of
/// sequence (the last `Token` of a sequence before its `Finished` with `Stop` or `Eos`); empty
/// when no sequence ended so. A sequence a stop string ended has its last token marked too,
/// which changes nothing: the detokenizer has stopped reading it.
fn stopping_tokens(events: &[SeqEvent]) -> Vec<bool> {
    let by_token = |e: &SeqEvent| {
        matches!(
            e,
            SeqEvent::Finished {
                reason: FinishReason::Stop | FinishReason::Eos,
                ..
            }
        )
    };
    if !events.iter().any(by_token) {
        return Vec::new();
    }
    let mut marks = vec![false; events.len()];
    let mut ending: Vec<RequestId> = Vec::new();
    for (i, e) in events.iter().enumerate().rev() {
        match e {
            SeqEvent::Finished { id, .. } if by_token(e) => ending.push(*id),
            SeqEvent::Token { id, .. } => {
                if let Some(k) = ending.iter().rposition(|x| x == id) {
                    ending.swap_remove(k);
                    marks[i] = true;
                }
            }
            _ => {}
        }
    }
    marks
}

/// The scheduling core and a backend stepped together on the caller's thread: offline
/// generation and the throughput benchmark use it.
pub struct EngineCore {
    core: StepCore,
    backend: Box<dyn Backend>,
    /// Plan and submit each step while the previous one runs.
    async_scheduling: bool,
    /// The step submitted last, its outputs not applied yet (asynchronous scheduling).
    in_flight: Option<PreparedStep>,
    /// Whether the next step may be planned before `in_flight`'s outputs are in.
    ahead_ok: bool,
}

impl EngineCore {
    /// Builds the core around a backend.
    pub fn new(
        config: EngineCoreConfig,
        policy: Box<dyn Policy>,
        backend: Box<dyn Backend>,
    ) -> Result<Self, EngineError> {
        let mut core = StepCore::new(config, policy)?;
        core.set_draft_verifier(backend.draft_verifier(), backend.name())?;
        Ok(Self {
            core,
            backend,
            async_scheduling: false,
            in_flight: None,
            ahead_ok: false,
        })
    }

    /// Sets asynchronous scheduling (before the first step; off by default). Check
    /// [`EngineCore::async_scheduling`] for the outcome with this backend.
    pub fn with_async_scheduling(mut self, mode: AsyncScheduling) -> Self {
        self.async_scheduling = mode.enabled_for(self.backend.as_ref());
        self
    }

    /// Whether steps are planned and submitted while the previous one runs.
    pub fn async_scheduling(&self) -> bool {
        self.async_scheduling
    }

    /// The scheduling side, for queries and request control.
    pub fn core(&mut self) -> &mut StepCore {
        &mut self.core
    }

    /// Runs one step at time `now`: plan, execute, apply. A step with nothing to do returns an
    /// empty report without calling the backend.
    ///
    /// With asynchronous scheduling: plans and submits the next step, then applies the
    /// outputs of the one before it, so the events are one step late (the first step reports
    /// none; once nothing is left, the last one is applied in the same call).
    pub fn step(&mut self, now: Timestamp) -> Result<StepReport, EngineError> {
        if self.async_scheduling {
            return self.step_async(now);
        }
        let prepared = self.core.prepare(now)?;
        let timed_out = self.timed_out_events();
        let Some(prepared) = prepared else {
            return Ok(StepReport {
                events: timed_out,
                ..StepReport::default()
            });
        };
        for id in &prepared.release {
            self.backend.release(*id);
        }
        let t1 = Instant::now();
        KvCopies::run_all(&prepared.kv_copies, self.backend.as_mut())?;
        let outputs = self.backend.execute(&prepared.batch)?;
        let t2 = Instant::now();
        let mut events = timed_out;
        events.extend(self.core.complete(&prepared.plan, outputs, now));
        self.core.recycle(prepared.batch);
        Ok(StepReport {
            events,
            num_seqs: prepared.plan.seqs.len(),
            num_batched_tokens: prepared.plan.num_batched_tokens,
            plan_us: prepared.plan_us,
            execute_us: (t2 - t1).as_micros() as u64,
            apply_us: t2.elapsed().as_micros() as u64,
            shape: self.core.shape(&prepared.plan),
        })
    }

    /// The requests the last plan timed out in the queue, as their `Finished` events.
    fn timed_out_events(&mut self) -> Vec<CoreEvent> {
        self.core
            .take_timed_out()
            .into_iter()
            .map(|t| CoreEvent::Finished {
                id: t.id,
                reason: FinishReason::QueueTimeout,
            })
            .collect()
    }

    fn step_async(&mut self, now: Timestamp) -> Result<StepReport, EngineError> {
        let mut events = Vec::new();
        // Time in the backend (submit, and waiting for outputs) against applying them.
        let (mut execute_us, mut apply_us) = (0u64, 0u64);
        // Plan ahead of the step in flight when it allows; otherwise apply it first.
        let ahead = if self.in_flight.is_some() && self.ahead_ok {
            self.core.prepare_ahead(now)?
        } else {
            None
        };
        let next = match ahead {
            Some(next) => next,
            None => {
                events.extend(self.drain(now, &mut execute_us, &mut apply_us)?);
                self.core.prepare(now)?
            }
        };
        events.extend(self.timed_out_events());
        // A held-back preemption: the step after this one is planned in order.
        let wants_order = self.core.take_preemption_wanted();
        let t1 = Instant::now();
        let (num_seqs, num_batched_tokens, plan_us, shape) = match &next {
            Some(p) => {
                for id in &p.release {
                    self.backend.release(*id);
                }
                self.ahead_ok = self.core.launch(&p.plan) && !wants_order;
                KvCopies::run_all(&p.kv_copies, self.backend.as_mut())?;
                self.backend.submit(&p.batch)?;
                (
                    p.plan.seqs.len(),
                    p.plan.num_batched_tokens,
                    p.plan_us,
                    self.core.shape(&p.plan),
                )
            }
            None => (0, 0, 0, StepShape::default()),
        };
        execute_us += t1.elapsed().as_micros() as u64;
        // The previous step's outputs (it ran while this one was planned), then this one's
        // too when nothing is left to plan after it.
        events.extend(self.drain(now, &mut execute_us, &mut apply_us)?);
        self.in_flight = next;
        if !self.core.has_unfinished() {
            events.extend(self.drain(now, &mut execute_us, &mut apply_us)?);
        }
        Ok(StepReport {
            events,
            num_seqs,
            num_batched_tokens,
            plan_us,
            execute_us,
            apply_us,
            shape,
        })
    }

    /// Applies the step in flight, if any, at time `now` and returns its events; adds the
    /// wait for its outputs to `execute_us` and applying them to `apply_us`.
    fn drain(
        &mut self,
        now: Timestamp,
        execute_us: &mut u64,
        apply_us: &mut u64,
    ) -> Result<Vec<CoreEvent>, EngineError> {
        let Some(p) = self.in_flight.take() else {
            return Ok(Vec::new());
        };
        let t0 = Instant::now();
        let outputs = self.backend.collect()?;
        let t1 = Instant::now();
        let events = self.core.resolve(&p.plan, outputs, now);
        self.core.recycle(p.batch);
        *execute_us += (t1 - t0).as_micros() as u64;
        *apply_us += t1.elapsed().as_micros() as u64;
        Ok(events)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use switchyard_gpu::GpuError;
    use switchyard_policies::{PolicyRegistry, SamplingLimits};

    #[test]
    fn the_token_before_a_stop_or_eos_finish_is_marked() {
        let at = Timestamp(0);
        let token = |id: u64, token: u32| SeqEvent::Token {
            id: RequestId(id),
            token,
            at,
        };
        let finished = |id: u64, reason: FinishReason| SeqEvent::Finished {
            id: RequestId(id),
            reason,
            at,
        };
        // No stop: nothing to mark, nothing allocated.
        assert!(stopping_tokens(&[token(1, 5), finished(1, FinishReason::Length)]).is_empty());
        let events = [
            token(1, 5),
            token(2, 6),
            token(1, 7),
            finished(1, FinishReason::Eos),
            token(3, 8),
            finished(3, FinishReason::Length),
            token(2, 9),
            finished(2, FinishReason::Stop),
            finished(4, FinishReason::Abort),
        ];
        assert_eq!(
            stopping_tokens(&events),
            [false, false, true, false, false, false, true, false, false]
        );
    }

    /// (sequence, first position, tokens) of every sequence fed to the backend, in order.
    type FedLog = std::sync::Arc<std::sync::Mutex<Vec<(u64, usize, Vec<u32>)>>>;

    /// A backend double that "samples" the next integer after the last fed token, and records
    /// what it was asked to do.
    #[derive(Default)]
    struct NextTokenBackend {
        released: std::sync::Arc<std::sync::Mutex<Vec<u64>>>,
        fed: FedLog,
        /// Take steps one ahead (`submit` / `collect`), resolving pending tokens from the
        /// last sampled token of each sequence.
        pipelines: bool,
        last: HashMap<u64, u32>,
        submitted: std::collections::VecDeque<Vec<SeqOutput>>,
        /// Steps submitted while another was outstanding.
        ahead: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        /// Verify draft tokens (speculative decoding).
        verifies: bool,
    }

    impl Backend for NextTokenBackend {
        fn name(&self) -> &str {
            "next-token"
        }
        fn num_kv_blocks(&self) -> usize {
            64
        }
        fn block_size(&self) -> usize {
            4
        }
        fn max_batch_tokens(&self) -> usize {
            1024
        }
        fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
            let mut out = Vec::new();
            for s in &batch.seqs {
                assert!(
                    s.block_table.len() * 4 >= s.num_computed_tokens + s.tokens.len(),
                    "block table too short"
                );
                self.fed
                    .lock()
                    .unwrap()
                    .push((s.seq_id, s.num_computed_tokens, s.tokens.clone()));
                // Drafts are kept while each is the successor of the token before it.
                let known = s.tokens.len() - s.num_drafts;
                let mut last = s.tokens[known - 1];
                let mut accepted = Vec::new();
                for &d in &s.tokens[known..] {
                    if d != last + 1 {
                        break;
                    }
                    accepted.push(switchyard_gpu::backend::AcceptedDraft {
                        token: d,
                        logprob: None,
                        top_logprobs: Vec::new(),
                    });
                    last = d;
                }
                // A constraint is told the tokens kept, as a backend does after the draw (it
                // allows every token here).
                if let Some(c) = s.sampling.constraint.as_ref().filter(|_| s.sample) {
                    c.commit_all(&s.tokens[known..known + accepted.len()]);
                    c.commit(last + 1);
                }
                out.push(SeqOutput {
                    seq_id: s.seq_id,
                    accepted,
                    token: s.sample.then_some(last + 1),
                    logprob: None,
                    top_logprobs: Vec::new(),
                    // For prompt-logprob requests, every fed known position past the first
                    // (the tests' such requests end before they decode): the token, logprob 0.
                    prompt_logprobs: if s.sampling.prompt_logprobs.is_some() {
                        (s.num_computed_tokens.max(1)..s.num_computed_tokens + known)
                            .map(|position| switchyard_gpu::backend::PromptLogprob {
                                position,
                                token: s.tokens[position - s.num_computed_tokens],
                                logprob: 0.0,
                                rank: 1,
                                top_logprobs: Vec::new(),
                            })
                            .collect()
                    } else {
                        Vec::new()
                    },
                    // A stand-in for the hidden state at the sampled row: its token and the
                    // number of positions it attends over (computed before it, and its own).
                    hidden: (s.sample && s.sampling.hidden_state).then(|| {
                        vec![
                            s.tokens[known - 1] as f32,
                            (s.num_computed_tokens + known) as f32,
                        ]
                    }),
                });
            }
            Ok(out)
        }
        fn release(&mut self, seq_id: u64) {
            self.released.lock().unwrap().push(seq_id);
        }
        fn pipelines(&self) -> bool {
            self.pipelines
        }
        fn draft_verifier(&self) -> Option<DraftVerifier> {
            self.verifies.then_some(|_| true)
        }
        fn submit(&mut self, batch: &Batch) -> Result<(), GpuError> {
            assert!(self.submitted.len() <= 1, "more than one step ahead");
            if !self.submitted.is_empty() {
                self.ahead
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            let mut b = batch.clone();
            for s in &mut b.seqs {
                if s.tokens.contains(&PENDING_TOKEN) {
                    assert_eq!(s.tokens.len(), 1, "a pending token outside a decode");
                    s.tokens[0] = self.last[&s.seq_id];
                }
            }
            let out = self.execute(&b)?;
            for o in &out {
                if let Some(t) = o.token {
                    self.last.insert(o.seq_id, t);
                }
            }
            self.submitted.push_back(out);
            Ok(())
        }
        fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
            Ok(self.submitted.pop_front().expect("nothing submitted"))
        }
    }

    fn request(id: u64, prompt: Vec<u32>, max_tokens: u32, eos: Option<u32>) -> SubmitOptions {
        let limits = SamplingLimits {
            max_tokens,
            eos_token_id: eos,
            ..SamplingLimits::default()
        };
        SubmitOptions::offline(id, prompt, limits, Arc::new(SamplingParams::default()))
    }

    fn engine(backend: NextTokenBackend) -> EngineCore {
        engine_with(backend, None)
    }

    fn engine_with(
        backend: NextTokenBackend,
        speculative: Option<switchyard_policies::SpeculativeConfig>,
    ) -> EngineCore {
        engine_with_blocks(backend, speculative, 64)
    }

    /// [`engine_with`] over `num_gpu_blocks` blocks of 4 tokens.
    fn engine_with_blocks(
        backend: NextTokenBackend,
        speculative: Option<switchyard_policies::SpeculativeConfig>,
        num_gpu_blocks: usize,
    ) -> EngineCore {
        let scheduler = SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 6,
            block_size: 4,
            num_gpu_blocks,
            enable_prefix_caching: true,
            max_model_len: 128,
            tiers: Vec::new(),
            max_logit_rows: usize::MAX,
            max_loras: 4,
            speculative,
            sliding_window: None,
            max_queue_ms: None,
            num_host_blocks: 0,
            kv_offload_ahead: true,
        };
        let policy = PolicyRegistry::with_builtins()
            .create("fcfs", &serde_yaml::Value::Null, &[])
            .unwrap();
        EngineCore::new(
            EngineCoreConfig {
                scheduler,
                hash_key: [1, 2],
            },
            policy,
            Box::new(backend),
        )
        .unwrap()
    }

    /// Tokens and endings per request, in event order.
    fn per_request(events: &[CoreEvent]) -> BTreeMap<u64, (Vec<u32>, Option<FinishReason>)> {
        let mut m: BTreeMap<u64, (Vec<u32>, Option<FinishReason>)> = BTreeMap::new();
        for ev in events {
            match ev {
                CoreEvent::Token { id, token, .. } => m.entry(id.0).or_default().0.push(*token),
                CoreEvent::Finished { id, reason } => {
                    let e = m.entry(id.0).or_default();
                    assert!(e.1.is_none(), "{id:?} finished twice");
                    e.1 = Some(*reason);
                }
                CoreEvent::PromptLogprobs { .. }
                | CoreEvent::PromptCached { .. }
                | CoreEvent::Hidden { .. } => {}
            }
        }
        m
    }

    /// An embedding request as `Engine::admit` makes it: one greedy token, EOS ignored,
    /// [`SamplingParams::hidden_state`].
    fn embedding(id: u64, prompt: Vec<u32>) -> SubmitOptions {
        let limits = SamplingLimits {
            max_tokens: 1,
            ignore_eos: true,
            ..SamplingLimits::default()
        };
        let sampling = SamplingParams {
            temperature: 0.0,
            hidden_state: true,
            ..SamplingParams::default()
        };
        SubmitOptions::offline(id, prompt, limits, Arc::new(sampling))
    }

    /// An embedding aborted while the step that computes its last prompt position is in
    /// flight (asynchronous scheduling) gets no event once that step's outputs come in: no
    /// hidden state, no token, no end; its blocks are all given back.
    #[test]
    fn an_embedding_aborted_while_its_last_step_runs_reports_nothing_more() {
        let backend = NextTokenBackend {
            pipelines: true,
            ..NextTokenBackend::default()
        };
        let fed = backend.fed.clone();
        let mut e = engine(backend).with_async_scheduling(AsyncScheduling::On);
        assert!(e.async_scheduling());
        // 13 tokens in chunks of 6: the third step feeds the last position.
        e.core()
            .add_request(embedding(1, (0..13).collect()))
            .unwrap();
        let (before, now) = step_until_fed(&mut e, &fed, 12);
        assert!(before.is_empty(), "{before:?}");
        abort_and_expect_silence(&mut e, now);
    }

    /// Steps `e` until a step feeds request 1's prompt position `position` (submitted, its
    /// outputs not yet collected); the events until then, and the next step's time.
    fn step_until_fed(e: &mut EngineCore, fed: &FedLog, position: usize) -> (Vec<CoreEvent>, u64) {
        let mut events = Vec::new();
        let mut now = 0;
        while !fed
            .lock()
            .unwrap()
            .iter()
            .any(|f| f.0 == 1 && f.1 == position)
        {
            events.extend(e.step(Timestamp(now)).unwrap().events);
            now += 1;
            assert!(now < 10, "position {position} was never fed");
        }
        (events, now)
    }

    /// Aborts request 1 and runs three more steps from `now`: no event comes, and the engine
    /// is idle with every block back.
    fn abort_and_expect_silence(e: &mut EngineCore, mut now: u64) {
        assert!(e.core().abort(RequestId(1)));
        let mut after = Vec::new();
        for _ in 0..3 {
            after.extend(e.step(Timestamp(now)).unwrap().events);
            now += 1;
        }
        assert!(after.is_empty(), "events after the abort: {after:?}");
        let stats = e.core().stats();
        assert_eq!((stats.num_running, stats.kv_usage), (0, 0.0));
    }

    /// A prompt-logprob request aborted while a step computing part of its prompt is in
    /// flight (asynchronous scheduling) gets no event once that step's outputs come in: its
    /// earlier chunk's prompt logprobs came, that chunk's do not (they used to, as
    /// `CoreEvent::PromptLogprobs` for a request that had ended).
    #[test]
    fn prompt_logprobs_of_a_request_aborted_while_its_step_runs_are_not_reported() {
        let backend = NextTokenBackend {
            pipelines: true,
            ..NextTokenBackend::default()
        };
        let fed = backend.fed.clone();
        let mut e = engine(backend).with_async_scheduling(AsyncScheduling::On);
        let mut req = request(1, (0..13).collect(), 1, None);
        req.request.limits.prompt_logits = true;
        req.sampling = Arc::new(SamplingParams {
            prompt_logprobs: Some(1),
            ..SamplingParams::default()
        });
        e.core().add_request(req).unwrap();
        // 13 tokens in chunks of 6: the second step feeds positions 6 to 11.
        let (before, now) = step_until_fed(&mut e, &fed, 6);
        let positions = |events: &[CoreEvent]| -> Vec<usize> {
            events
                .iter()
                .flat_map(|ev| match ev {
                    CoreEvent::PromptLogprobs { entries, .. } => {
                        entries.iter().map(|p| p.position).collect()
                    }
                    _ => Vec::new(),
                })
                .collect()
        };
        assert_eq!(positions(&before), [1, 2, 3, 4, 5], "{before:?}");
        abort_and_expect_silence(&mut e, now);
    }

    /// Embedding requests (one greedy token, [`SamplingParams::hidden_state`]) among
    /// generations that repeat themselves (drafts), in a pool small enough that prefills are
    /// preempted, with and without asynchronous scheduling and speculative decoding: each
    /// reports one hidden state, that of its complete prompt's last position (never one of a
    /// chunk, of a step it was preempted after, or of a step planned past its one token), before
    /// its token and its end, and is never fed drafts nor a position past its prompt; one whose
    /// prompt an earlier one computed is served from the prefix cache and reports the same.
    #[test]
    fn embeddings_report_the_hidden_state_of_their_complete_prompt_once() {
        let spec = switchyard_policies::SpeculativeConfig {
            num_speculative_tokens: 3,
            prompt_lookup_min: 1,
            prompt_lookup_max: 2,
            max_running: 0,
        };
        // In 40 blocks of 4: generations 1 to 3 from the start, embeddings 10 to 13 arriving
        // at steps 2 to 5 (13 tokens, 19, 9, 14), 14 repeating 10's prompt as soon as 10 ended
        // (its blocks still cached). In 8 blocks: generation 1 (14 tokens, 4 blocks, growing
        // to 8) and embedding 10 at step 3, once 1 decodes (admitted into the 4 free blocks);
        // as 1 grows past its 4th block, 10 is preempted mid-prefill (10 of its 13 tokens
        // computed) and comes back once 1 ended; 14 then finds 10's blocks cached.
        let all: BTreeMap<u64, (u64, Vec<u32>)> = [
            (10, 2, 1000..1013),
            (11, 3, 1100..1119),
            (12, 4, 1200..1209),
            (13, 5, 1300..1314),
            (14, u64::MAX, 1000..1013),
        ]
        .into_iter()
        .map(|(id, at, p)| (id, (at, p.collect())))
        .collect();
        let mut preempted_somewhere = false;
        let mut cached_somewhere = false;
        let mut recomputed_somewhere = false;
        let configs = [false, true]
            .into_iter()
            .flat_map(|p| [(p, false), (p, true)])
            .flat_map(|(p, s)| [(p, s, 8), (p, s, 40)]);
        for (pipelined, speculative, blocks) in configs {
            let small = blocks == 8;
            let mut arrivals = all.clone();
            if small {
                arrivals.retain(|&id, _| id == 10 || id == 14);
                arrivals.entry(10).and_modify(|a| a.0 = 3);
            }
            let backend = NextTokenBackend {
                verifies: true,
                pipelines: pipelined,
                ..NextTokenBackend::default()
            };
            let fed = backend.fed.clone();
            let mut e = engine_with_blocks(backend, speculative.then(|| spec.clone()), blocks)
                .with_async_scheduling(AsyncScheduling::On);
            if small {
                e.core()
                    .add_request(request(1, (500..514).collect(), 18, None))
                    .unwrap();
            } else {
                for id in 1..=3u64 {
                    e.core()
                        .add_request(request(id, vec![1, 2, 3, 1, 2, 3], 24, None))
                        .unwrap();
                }
            }
            let mut events = Vec::new();
            let mut step = 0u64;
            let mut repeated = false;
            while e.core().has_unfinished() || step <= 5 || !repeated {
                for (&id, (at, prompt)) in &arrivals {
                    let ten_ended = || {
                        events
                            .iter()
                            .any(|ev| matches!(ev, CoreEvent::Finished { id, .. } if id.0 == 10))
                    };
                    if *at == step || (id == 14 && !repeated && ten_ended()) {
                        repeated |= id == 14;
                        e.core().add_request(embedding(id, prompt.clone())).unwrap();
                    }
                }
                events.extend(e.step(Timestamp(step * 1000)).unwrap().events);
                step += 1;
                assert!(step < 2000);
            }
            preempted_somewhere |= e.core().stats().num_preemptions > 0;
            let label =
                format!("pipelined {pipelined}, speculative {speculative}, {blocks} blocks");
            let fed = fed.lock().unwrap().clone();
            for (&id, (_, prompt)) in &arrivals {
                let mine: Vec<&CoreEvent> = events
                    .iter()
                    .filter(|ev| match ev {
                        CoreEvent::Token { id: i, .. }
                        | CoreEvent::Finished { id: i, .. }
                        | CoreEvent::PromptCached { id: i, .. }
                        | CoreEvent::Hidden { id: i, .. }
                        | CoreEvent::PromptLogprobs { id: i, .. } => i.0 == id,
                    })
                    .collect();
                let hidden: Vec<&Vec<f32>> = mine
                    .iter()
                    .filter_map(|ev| match ev {
                        CoreEvent::Hidden { values, .. } => Some(values),
                        _ => None,
                    })
                    .collect();
                let want = vec![*prompt.last().unwrap() as f32, prompt.len() as f32];
                assert_eq!(hidden, vec![&want], "request {id} ({label}): {mine:?}");
                assert!(
                    matches!(mine.first(), Some(CoreEvent::Hidden { .. })),
                    "request {id} ({label}): {mine:?}"
                );
                assert!(
                    matches!(
                        mine.last(),
                        Some(CoreEvent::Finished {
                            reason: FinishReason::Length,
                            ..
                        })
                    ),
                    "request {id} ({label}): {mine:?}"
                );
                let tokens = mine
                    .iter()
                    .filter(|ev| matches!(ev, CoreEvent::Token { .. }))
                    .count();
                assert_eq!(tokens, 1, "request {id} ({label})");
                let mut end = 0;
                for (seq, start, toks) in &fed {
                    if *seq == id {
                        assert!(
                            start + toks.len() <= prompt.len(),
                            "request {id} ({label}) fed {toks:?} from {start}"
                        );
                        // Fed again from an earlier position: preempted mid-prefill.
                        recomputed_somewhere |= *start < end;
                        end = end.max(start + toks.len());
                    }
                }
            }
            let cached: BTreeMap<u64, u32> = events
                .iter()
                .filter_map(|ev| match ev {
                    CoreEvent::PromptCached { id, tokens } => Some((id.0, *tokens)),
                    _ => None,
                })
                .collect();
            assert_eq!(cached.get(&10), Some(&0), "{label}: {cached:?}");
            // 14's prompt is 10's: at most its 3 whole blocks before the last token.
            let again = cached.get(&14).copied();
            assert!(again.is_some_and(|c| c <= 12), "{label}: {cached:?}");
            cached_somewhere |= again.is_some_and(|c| c > 0);
        }
        assert!(preempted_somewhere, "no configuration preempted anything");
        assert!(
            recomputed_somewhere,
            "no embedding was preempted mid-prefill"
        );
        assert!(
            cached_somewhere,
            "request 14 never found 10's blocks cached"
        );
    }

    #[test]
    fn async_scheduling_gives_the_same_tokens_and_overlaps_steps() {
        let run = |pipelined: bool| {
            let backend = NextTokenBackend {
                pipelines: pipelined,
                ..NextTokenBackend::default()
            };
            let fed = backend.fed.clone();
            let ahead = backend.ahead.clone();
            let mut e = engine(backend).with_async_scheduling(AsyncScheduling::On);
            assert_eq!(e.async_scheduling(), pipelined);
            // Chunked prompts, EOS in the middle (5 after 1, 2, 3, 4), length limits, and
            // more requests than seats (8), arriving over time.
            for i in 0..12u64 {
                let prompt: Vec<u32> = (0..(1 + i as u32 % 9)).map(|t| 10 * i as u32 + t).collect();
                let eos = (i % 3 == 0).then_some(10 * i as u32 + 12);
                e.core()
                    .add_request(request(i, prompt, 2 + (i as u32 % 5), eos))
                    .unwrap();
            }
            let mut events = Vec::new();
            let mut steps = 0;
            for step in 0..1000u64 {
                if step == 3 {
                    e.core()
                        .add_request(request(99, vec![7, 8, 9], 4, None))
                        .unwrap();
                }
                if !e.core().has_unfinished() {
                    break;
                }
                events.extend(e.step(Timestamp(step * 1000)).unwrap().events);
                steps += 1;
            }
            assert!(!e.core().has_unfinished());
            let fed = fed.lock().unwrap().clone();
            let ahead = ahead.load(std::sync::atomic::Ordering::Relaxed);
            (per_request(&events), steps, fed, ahead)
        };
        let (in_order, steps_in_order, _, _) = run(false);
        let (pipelined, steps, fed, ahead) = run(true);
        // Most steps were submitted while the one before was outstanding.
        assert!(ahead * 2 > steps, "{ahead} of {steps} steps ahead");
        assert!(
            steps <= steps_in_order + 2,
            "{steps} steps against {steps_in_order}"
        );
        assert_eq!(in_order.len(), 13);
        assert_eq!(in_order, pipelined);
        for (tokens, reason) in in_order.values() {
            assert!(reason.is_some());
            assert!(!tokens.contains(&PENDING_TOKEN));
        }
        // Every position of a request is fed once, except the extra step fed after a stop
        // that was still pending (its output is dropped).
        let mut next: HashMap<u64, usize> = HashMap::new();
        for (id, start, toks) in &fed {
            let n = next.entry(*id).or_default();
            assert!(*start == *n, "request {id}: fed from {start}, expected {n}");
            *n += toks.len();
        }
    }

    /// Speculative decoding through the engine: drafts proposed by prompt lookup reach the
    /// backend after the known tokens, accepted ones come out as tokens in order, the outputs
    /// equal decoding one token per step (with asynchronous scheduling too), in fewer steps,
    /// and a backend that verifies no drafts is refused.
    #[test]
    fn drafts_reach_the_backend_and_accepted_ones_come_out_in_order() {
        let spec = switchyard_policies::SpeculativeConfig {
            num_speculative_tokens: 3,
            prompt_lookup_min: 1,
            prompt_lookup_max: 2,
            max_running: 0,
        };
        let run = |speculative: bool, pipelined: bool| {
            let backend = NextTokenBackend {
                verifies: true,
                pipelines: pipelined,
                ..NextTokenBackend::default()
            };
            let fed = backend.fed.clone();
            let mut e = engine_with(backend, speculative.then(|| spec.clone()))
                .with_async_scheduling(AsyncScheduling::On);
            // The model counts up; the prompts hold runs it will repeat (fully or in part).
            e.core()
                .add_request(request(1, vec![1, 2, 3, 4, 5, 6, 1, 2], 9, None))
                .unwrap();
            e.core()
                .add_request(request(2, vec![20, 21, 40, 41, 20], 6, Some(25)))
                .unwrap();
            let mut steps = 0;
            let mut events = Vec::new();
            while e.core().has_unfinished() {
                events.extend(e.step(Timestamp(steps * 1000)).unwrap().events);
                steps += 1;
                assert!(steps < 1000);
            }
            let drafts = e.core().spec_decode_stats();
            let fed = fed.lock().unwrap().clone();
            (per_request(&events), steps, drafts, fed)
        };
        let (plain, plain_steps, none, _) = run(false, false);
        assert_eq!(none, SpecDecodeStats::default());
        assert_eq!(plain[&1].0, vec![3, 4, 5, 6, 7, 8, 9, 10, 11]);
        assert_eq!(
            plain[&2],
            (vec![21, 22, 23, 24, 25], Some(FinishReason::Eos))
        );
        for pipelined in [false, true] {
            let (spec_out, steps, stats, fed) = run(true, pipelined);
            assert_eq!(spec_out, plain, "pipelined {pipelined}");
            assert!(
                steps < plain_steps,
                "{steps} steps, {plain_steps} without drafts (pipelined {pipelined})"
            );
            assert!(
                stats.num_drafts > 0 && stats.num_accepted_tokens > 0,
                "{stats:?}"
            );
            assert!(stats.num_accepted_tokens <= stats.num_draft_tokens);
            // Request 1 after "... 1 2 3": the lookup finds "3" at position 2 and proposes
            // "4 5 6", all accepted.
            assert!(
                fed.iter()
                    .any(|(id, start, t)| *id == 1 && *start == 8 && t == &vec![3, 4, 5, 6]),
                "{fed:?}"
            );
        }
        // A backend that verifies nothing cannot run a speculative configuration.
        let scheduler = SchedulerConfig {
            num_gpu_blocks: 64,
            block_size: 4,
            speculative: Some(spec),
            ..SchedulerConfig::default()
        };
        let policy = PolicyRegistry::with_builtins()
            .create("fcfs", &serde_yaml::Value::Null, &[])
            .unwrap();
        let err = EngineCore::new(
            EngineCoreConfig {
                scheduler,
                hash_key: [1, 2],
            },
            policy,
            Box::new(NextTokenBackend::default()),
        )
        .err()
        .expect("refused");
        assert!(err.to_string().contains("draft"), "{err}");
    }

    /// Allows every token and wants drafts until it has been told `drafts_until` tokens.
    struct CostlyDrafts {
        drafts_until: usize,
        told: usize,
    }

    impl switchyard_gpu::TokenConstraint for CostlyDrafts {
        fn fill_allowed(&mut self, allowed: &mut [u32]) {
            allowed.fill(u32::MAX);
        }
        fn commit(&mut self, _: u32) {
            self.told += 1;
        }
        fn can_roll_back(&self) -> bool {
            true
        }
        fn rollback(&mut self, n: usize) -> bool {
            self.told -= n.min(self.told);
            true
        }
        fn wants_drafts(&self) -> bool {
            self.told < self.drafts_until
        }
    }

    /// A request whose constraint stops wanting drafts (a grammar whose drafts went costly)
    /// is fed none from the next step on, with asynchronous scheduling or without; the other
    /// requests keep theirs, and the outputs are those of one token per step.
    #[test]
    fn a_constraint_that_wants_no_more_drafts_gets_none() {
        let spec = switchyard_policies::SpeculativeConfig {
            num_speculative_tokens: 3,
            prompt_lookup_min: 1,
            prompt_lookup_max: 2,
            max_running: 0,
        };
        // The model counts up; the prompt holds runs it repeats, apart: drafts at several
        // steps.
        let prompt = vec![1, 2, 3, 4, 50, 6, 7, 8, 50, 10, 11, 12, 50, 1, 2];
        let run = |drafts_until: Option<usize>, pipelined: bool| {
            let backend = NextTokenBackend {
                verifies: true,
                pipelines: pipelined,
                ..NextTokenBackend::default()
            };
            let fed = backend.fed.clone();
            let mut e =
                engine_with(backend, Some(spec.clone())).with_async_scheduling(AsyncScheduling::On);
            let mut r = request(1, prompt.clone(), 14, None);
            if let Some(n) = drafts_until {
                let sampling = SamplingParams {
                    constraint: Some(switchyard_gpu::Constraint::new(CostlyDrafts {
                        drafts_until: n,
                        told: 0,
                    })),
                    ..SamplingParams::default()
                };
                r.sampling = Arc::new(sampling);
            }
            e.core().add_request(r).unwrap();
            e.core()
                .add_request(request(2, vec![20, 21, 22, 40, 20, 21, 20], 8, None))
                .unwrap();
            let events = run_to_end(&mut e);
            // The positions each request was fed drafts after (its last known token's).
            let mut drafted: BTreeMap<u64, Vec<usize>> = BTreeMap::new();
            for (id, start, tokens) in fed.lock().unwrap().iter() {
                let prompt_len = if *id == 1 { prompt.len() } else { 7 };
                if *start >= prompt_len && tokens.len() > 1 {
                    drafted.entry(*id).or_default().push(*start);
                }
            }
            (per_request(&events), drafted)
        };
        let (always, drafted_always) = run(None, false);
        assert!(drafted_always[&1].len() >= 3, "{drafted_always:?}");
        assert!(drafted_always.contains_key(&2), "{drafted_always:?}");
        for pipelined in [false, true] {
            for until in [1, 3] {
                let (out, drafted) = run(Some(until), pipelined);
                assert_eq!(out, always, "until {until}, pipelined {pipelined}");
                // Fed drafts only while it had been told fewer than `until` tokens: the
                // outputs before the fed position's, and that one.
                let told = |start: usize| start - prompt.len() + 1;
                let ones = drafted.get(&1).cloned().unwrap_or_default();
                assert!(
                    ones.iter().all(|&p| told(p) < until),
                    "until {until}, pipelined {pipelined}: {drafted:?}"
                );
                assert_eq!(
                    ones.len(),
                    drafted_always[&1]
                        .iter()
                        .filter(|&&p| told(p) < until)
                        .count(),
                    "until {until}, pipelined {pipelined}: {drafted:?}"
                );
                // (The drafts it no longer takes are left to the other request.)
                assert!(drafted.contains_key(&2), "{drafted:?}");
            }
        }
    }

    /// Draft counters read as vLLM's: drafts the backend accepted count even past a stop
    /// inside the accepted run.
    #[test]
    fn accepted_drafts_count_up_to_the_backend_not_to_the_stop() {
        let spec = switchyard_policies::SpeculativeConfig {
            num_speculative_tokens: 3,
            prompt_lookup_min: 2,
            prompt_lookup_max: 2,
            max_running: 0,
        };
        let backend = NextTokenBackend {
            verifies: true,
            ..NextTokenBackend::default()
        };
        let fed = backend.fed.clone();
        let mut e = engine_with(backend, Some(spec));
        // The model counts up. After the first output (3), "2 3" recurs at the prompt's
        // start and proposes "4 5 1": 4 and 5 are accepted, 1 is not (the model says 6).
        // The end of sequence is 4: the choice ends at the first accepted draft.
        e.core()
            .add_request(request(1, vec![1, 2, 3, 4, 5, 1, 2], 9, Some(4)))
            .unwrap();
        let events = run_to_end(&mut e);
        let out = per_request(&events);
        assert_eq!(out[&1], (vec![3, 4], Some(FinishReason::Eos)));
        let fed = fed.lock().unwrap().clone();
        assert!(
            fed.iter()
                .any(|(_, start, t)| *start == 7 && t == &vec![3, 4, 5, 1]),
            "{fed:?}"
        );
        assert_eq!(
            e.core().spec_decode_stats(),
            SpecDecodeStats {
                num_drafts: 1,
                num_draft_tokens: 3,
                num_accepted_tokens: 2,
            }
        );
    }

    fn run_to_end(e: &mut EngineCore) -> Vec<CoreEvent> {
        let mut events = Vec::new();
        for step in 0..1000u64 {
            if !e.core().has_unfinished() {
                return events;
            }
            events.extend(e.step(Timestamp(step * 1000)).unwrap().events);
        }
        panic!("did not finish in 1000 steps");
    }

    #[test]
    fn chunked_prompts_are_fed_in_order_and_outputs_follow() {
        let backend = NextTokenBackend::default();
        let fed = backend.fed.clone();
        let mut e = engine(backend);
        // A 10-token prompt with a 6-token budget is prefilled in two chunks.
        e.core()
            .add_request(request(1, (100..110).collect(), 3, None))
            .unwrap();
        let events = run_to_end(&mut e);
        let tokens: Vec<u32> = events
            .iter()
            .filter_map(|ev| {
                if let CoreEvent::Token { token, .. } = ev {
                    Some(*token)
                } else {
                    None
                }
            })
            .collect();
        assert_eq!(tokens, vec![110, 111, 112]);
        assert!(matches!(
            events.last(),
            Some(CoreEvent::Finished {
                reason: FinishReason::Length,
                ..
            })
        ));
        // Every position is fed exactly once, in order: the prompt, then each output but the last.
        let fed = fed.lock().unwrap();
        let mut next = 0usize;
        let mut all = Vec::new();
        for (_, start, toks) in fed.iter() {
            assert_eq!(*start, next, "gap or overlap in fed positions");
            next += toks.len();
            all.extend_from_slice(toks);
        }
        assert_eq!(all, (100..112).collect::<Vec<u32>>());
    }

    #[test]
    fn eos_finishes_and_releases_backend_state() {
        let backend = NextTokenBackend::default();
        let released = backend.released.clone();
        let mut e = engine(backend);
        e.core()
            .add_request(request(7, vec![1, 2, 3], 50, Some(5)))
            .unwrap();
        let events = run_to_end(&mut e);
        assert!(
            events.contains(&CoreEvent::Finished {
                id: RequestId(7),
                reason: FinishReason::Eos
            }),
            "{events:?}"
        );
        // Release reaches the backend with the next step's batch.
        e.core().add_request(request(8, vec![9], 1, None)).unwrap();
        run_to_end(&mut e);
        assert!(released.lock().unwrap().contains(&7));
    }

    /// The actor's order for one step: plan, commit the block changes to `pool` (the detached
    /// allocator), write the block ids into the plan.
    fn plan_committed(e: &mut EngineCore, pool: &mut BlockPool, now: Timestamp) -> PlannedStep {
        let mut planned = e.core().plan(now);
        let mut ids = Vec::new();
        pool.commit(&std::mem::take(&mut planned.commit), &mut ids)
            .unwrap();
        e.core().assign(&mut planned, &ids).unwrap();
        planned
    }

    #[test]
    fn a_step_whose_every_sequence_ended_after_planning_is_not_built() {
        // The actor's order: plan, commit the block changes (here to the detached pool), and
        // meanwhile the only request's client hangs up; its finish is applied before the batch
        // is built. An empty batch must not reach the backend.
        let mut e = engine(NextTokenBackend::default());
        let mut pool = e.core().detach_allocator().expect("the core's pool");
        e.core()
            .add_request(request(1, (0..5).collect(), 100, None))
            .unwrap();
        let planned = plan_committed(&mut e, &mut pool, Timestamp(0));
        assert_eq!(planned.plan.seqs.len(), 1);
        assert!(e.core().finish(RequestId(1), FinishReason::Abort));
        assert!(e.core().build_step(planned).unwrap().is_none());
        assert!(!e.core().has_unfinished());
        // The next request's batch carries the release of the first.
        e.core().add_request(request(2, vec![7], 1, None)).unwrap();
        let planned = plan_committed(&mut e, &mut pool, Timestamp(1));
        let prepared = e.core().build_step(planned).unwrap().expect("a batch");
        assert_eq!(prepared.batch.seqs.len(), 1);
        assert_eq!(prepared.release, vec![1]);
    }

    /// The host-tier copies of a plan that builds to no batch (its only request ended
    /// between plan and build) are not lost: the next batch carries them, before its own.
    #[test]
    fn stores_of_a_plan_left_without_a_batch_are_made_at_once_and_the_last_ones_alongside() {
        /// Records the copy calls (`store_kv` is the backend's own, not the default).
        #[derive(Default)]
        struct Calls(Vec<(&'static str, Vec<KvCopy>, Vec<KvCopy>)>);
        impl Backend for Calls {
            fn name(&self) -> &str {
                "calls"
            }
            fn num_kv_blocks(&self) -> usize {
                8
            }
            fn block_size(&self) -> usize {
                4
            }
            fn max_batch_tokens(&self) -> usize {
                8
            }
            fn execute(&mut self, _: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
                Ok(Vec::new())
            }
            fn release(&mut self, _: u64) {}
            fn copy_kv(&mut self, o: &[KvCopy], l: &[KvCopy]) -> Result<(), GpuError> {
                self.0.push(("copy", o.to_vec(), l.to_vec()));
                Ok(())
            }
            fn store_kv(&mut self, s: &[KvCopy]) -> Result<(), GpuError> {
                self.0.push(("store", s.to_vec(), Vec::new()));
                Ok(())
            }
        }
        let copy = |device, host| KvCopy { device, host };
        let all = [
            KvCopies {
                offloads: vec![copy(3, 1)],
                loads: Vec::new(),
                stores: vec![copy(4, 2)],
            },
            KvCopies::default(),
            KvCopies {
                offloads: Vec::new(),
                loads: vec![copy(2, 1)],
                stores: vec![copy(5, 3)],
            },
        ];
        let mut b = Calls::default();
        KvCopies::run_all(&all, &mut b).unwrap();
        assert_eq!(
            b.0,
            [
                ("copy", vec![copy(3, 1)], vec![]),
                // The next step is a later plan's, which may write block 4: made at once.
                ("copy", vec![copy(4, 2)], vec![]),
                ("copy", vec![], vec![copy(2, 1)]),
                ("store", vec![copy(5, 3)], vec![]),
            ]
        );
    }

    #[test]
    fn the_kv_copies_of_a_plan_left_without_a_batch_go_with_the_next_one() {
        use switchyard_policies::BlockCopy;
        let mut e = engine(NextTokenBackend::default());
        let mut pool = e.core().detach_allocator().expect("the core's pool");
        e.core()
            .add_request(request(1, (0..5).collect(), 100, None))
            .unwrap();
        let mut planned = plan_committed(&mut e, &mut pool, Timestamp(0));
        planned.plan.kv_offloads = vec![BlockCopy { device: 3, host: 1 }];
        planned.plan.kv_stores = vec![BlockCopy { device: 4, host: 2 }];
        assert!(e.core().finish(RequestId(1), FinishReason::Abort));
        assert!(e.core().build_step(planned).unwrap().is_none());
        e.core().add_request(request(2, vec![7], 1, None)).unwrap();
        let mut planned = plan_committed(&mut e, &mut pool, Timestamp(1));
        planned.plan.kv_loads = vec![BlockCopy { device: 2, host: 1 }];
        let prepared = e.core().build_step(planned).unwrap().expect("a batch");
        let copy = |device, host| KvCopy { device, host };
        assert_eq!(
            prepared.kv_copies,
            [
                KvCopies {
                    offloads: vec![copy(3, 1)],
                    loads: Vec::new(),
                    stores: vec![copy(4, 2)],
                },
                KvCopies {
                    offloads: Vec::new(),
                    loads: vec![copy(2, 1)],
                    stores: Vec::new(),
                },
            ]
        );
        // Carried once.
        e.core().add_request(request(3, vec![8], 1, None)).unwrap();
        let planned = plan_committed(&mut e, &mut pool, Timestamp(2));
        let prepared = e.core().build_step(planned).unwrap().expect("a batch");
        assert!(prepared.kv_copies.is_empty());
        // A stray plan's stores followed by a plan that copies nothing (its evictions found
        // those blocks stored): the batch's own empty entry comes last, so the stray stores
        // are made at once rather than alongside a step that may write their blocks.
        assert!(e.core().finish(RequestId(2), FinishReason::Abort));
        assert!(e.core().finish(RequestId(3), FinishReason::Abort));
        e.core()
            .add_request(request(4, (0..5).collect(), 100, None))
            .unwrap();
        let mut planned = plan_committed(&mut e, &mut pool, Timestamp(3));
        planned.plan.kv_stores = vec![BlockCopy { device: 4, host: 2 }];
        assert!(e.core().finish(RequestId(4), FinishReason::Abort));
        assert!(e.core().build_step(planned).unwrap().is_none());
        e.core().add_request(request(5, vec![9], 1, None)).unwrap();
        let planned = plan_committed(&mut e, &mut pool, Timestamp(4));
        let prepared = e.core().build_step(planned).unwrap().expect("a batch");
        assert_eq!(
            prepared.kv_copies,
            [
                KvCopies {
                    offloads: Vec::new(),
                    loads: Vec::new(),
                    stores: vec![copy(4, 2)],
                },
                KvCopies::default(),
            ]
        );
    }

    /// A request's queue time runs from when it was queued (its prompt encoded), as vLLM's
    /// time spent waiting to be scheduled, not from its arrival; without a queueing time, from
    /// its arrival.
    #[test]
    fn queue_time_runs_from_the_queueing_not_the_arrival() {
        let mut e = engine(NextTokenBackend::default());
        let mut encoded = request(1, vec![1, 2], 2, None);
        encoded.request.arrival = Timestamp(1_000);
        encoded.queued = Some(Timestamp(4_000));
        e.core().add_request(encoded).unwrap();
        let mut offline = request(2, vec![3, 4], 2, None);
        offline.request.arrival = Timestamp(500);
        e.core().add_request(offline).unwrap();
        let prepared = e.core().prepare(Timestamp(6_500)).unwrap().expect("a step");
        let mut queued: Vec<u64> = prepared.queue_times_us.iter().map(|q| q.1).collect();
        queued.sort_unstable();
        assert_eq!(queued, [2_500, 6_000]);
    }

    #[test]
    fn a_plan_that_cannot_be_built_comes_back_with_the_error() {
        // A plan asking for tokens its request does not have (a core bug) is returned, so the
        // scheduler actor can fail its requests instead of leaving them waiting.
        let mut e = engine(NextTokenBackend::default());
        let mut pool = e.core().detach_allocator().expect("the core's pool");
        e.core()
            .add_request(request(1, (0..5).collect(), 100, None))
            .unwrap();
        let mut planned = plan_committed(&mut e, &mut pool, Timestamp(0));
        planned.plan.seqs[0].num_new_tokens += 3;
        let failed = e
            .core()
            .build_step(planned)
            .expect_err("tokens beyond the prompt");
        assert!(matches!(failed.error, EngineError::UnknownSequence(1)));
        let ids: Vec<_> = failed.plan.seqs.iter().map(|s| s.id).collect();
        assert_eq!(ids, vec![RequestId(1)]);
        // The request is still the engine's to end.
        assert!(e.core().abort(RequestId(1)));
        assert!(!e.core().has_unfinished());
    }

    #[test]
    fn recycled_batches_keep_no_adapter_weights_alive() {
        // Batches kept for reuse once kept their entries' adapters: the weights of a request
        // that ended stayed alive, so the LoRA manager could neither evict nor free them.
        let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../gpu/tests/fixtures/lora/smollm2-r4");
        let model = switchyard_gpu::model::LlamaConfig::smollm2_135m();
        let limits = switchyard_gpu::LoraLimits::default();
        let adapter = Arc::new(LoraAdapter::load(&dir, &model, &limits).expect("adapter"));
        for pipelines in [false, true] {
            let backend = NextTokenBackend {
                pipelines,
                ..NextTokenBackend::default()
            };
            let mut e = engine(backend).with_async_scheduling(AsyncScheduling::On);
            let with_adapter =
                |id| request(id, vec![1, 2, 3], 3, None).with_adapter(7, adapter.clone());
            e.core().add_request(with_adapter(1)).unwrap();
            e.core().add_request(with_adapter(2)).unwrap();
            e.step(Timestamp(0)).unwrap();
            assert!(Arc::strong_count(&adapter) > 1, "the requests hold it");
            run_to_end(&mut e);
            assert!(!e.core().spare.is_empty(), "batches were kept for reuse");
            assert_eq!(
                Arc::strong_count(&adapter),
                1,
                "a kept batch holds the adapter (pipelined: {pipelines})"
            );
        }
    }

    #[test]
    fn abort_frees_every_block_and_duplicates_are_rejected() {
        let mut e = engine(NextTokenBackend::default());
        e.core()
            .add_request(request(1, (0..20).collect(), 100, None))
            .unwrap();
        assert!(matches!(
            e.core().add_request(request(1, vec![1], 1, None)),
            Err(EngineError::DuplicateRequest(1))
        ));
        e.step(Timestamp(0)).unwrap();
        assert!(e.core().stats().kv_usage > 0.0);
        assert!(e.core().abort(RequestId(1)));
        assert!(!e.core().has_unfinished());
        assert_eq!(e.core().stats().num_running, 0);
        assert_eq!(e.step(Timestamp(1)).unwrap().num_seqs, 0);
    }

    /// The planner's pool errors (core or caller bugs it absorbs) reach the engine's metric,
    /// each once, at the step that made them: here outputs resolved for a step never launched
    /// (after applying them) and a step planned with the pool detached (after planning).
    /// Before, they were visible to `check_invariants` only.
    #[test]
    fn pool_errors_are_counted_once_by_the_step_that_made_them() {
        let recorder = crate::testing::OneSeries::new(crate::metric_names::ENGINE_POOL_ERRORS);
        let count = || recorder.count();
        metrics::with_local_recorder(&recorder, || {
            let mut e = engine(NextTokenBackend::default());
            let events = e
                .core()
                .resolve(&StepPlan::default(), Vec::new(), Timestamp(0));
            assert!(events.is_empty(), "{events:?}");
            assert_eq!(e.core().stats().pool_errors, 1);
            assert_eq!(count(), 1);
            // A run without errors counts none more.
            e.core()
                .add_request(request(1, (0..10).collect(), 3, None))
                .unwrap();
            assert_eq!(per_request(&run_to_end(&mut e))[&1].0.len(), 3);
            assert_eq!((e.core().stats().pool_errors, count()), (1, 1));
            assert_eq!(e.core().note_pool_errors(), 0);
            // Planning without the pool (a caller bug) plans nothing and counts at once.
            assert!(e.core().detach_allocator().is_some());
            e.core()
                .add_request(request(2, (0..10).collect(), 3, None))
                .unwrap();
            let report = e.step(Timestamp(1)).unwrap();
            assert_eq!(report.num_seqs, 0);
            assert_eq!((e.core().stats().pool_errors, count()), (2, 2));
        });
    }
}
