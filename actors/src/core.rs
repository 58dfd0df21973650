//! The synchronous engine step: plan with the scheduling core, execute the batch on a backend,
//! apply the sampled tokens back to the core.
//!
//! This is the one loop every front end shares: `switchyard generate` and `bench throughput`
//! drive it directly, and the scheduler actor drives it for the server. The simulator runs the
//! same `policies` calls with a cost model in place of the backend.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use switchyard_gpu::backend::{Backend, Batch, SamplingParams, SeqInput, SeqOutput};
use switchyard_policies::{
    FinishReason, Policy, Request, RequestId, Scheduler, SchedulerConfig, SchedulerStats, SeqEvent,
    StepOutput, StepPlan, Timestamp, TokenId,
};

use crate::EngineError;

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
    },
    /// The request ended; its KV blocks are already freed.
    Finished {
        /// The request.
        id: RequestId,
        /// Why it ended.
        reason: FinishReason,
    },
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
}

/// A planned step: the scheduler's plan and the batch the backend must run for it.
#[derive(Debug)]
pub struct PreparedStep {
    /// The plan, needed again to apply the outputs.
    pub plan: StepPlan,
    /// The backend's input.
    pub batch: Batch,
    /// Sequences whose backend state (sampler history, RNG) must be dropped before the batch runs.
    pub release: Vec<u64>,
    /// Microseconds spent planning.
    pub plan_us: u64,
}

/// The scheduling side of the engine: the policies core plus the prompt and sampler settings of
/// requests in flight. It never touches a backend, so the scheduler actor can run it while the
/// executor actor owns the backend on its own thread.
pub struct StepCore {
    scheduler: Scheduler,
    /// Prompt tokens and sampler settings of requests in flight.
    live: HashMap<RequestId, (Arc<[TokenId]>, Arc<SamplingParams>)>,
    /// Sequences that ended since the last prepared step; their backend state is released.
    ended: Vec<u64>,
}

impl StepCore {
    /// Builds the core; fails when the scheduler configuration is inconsistent.
    pub fn new(config: EngineCoreConfig, policy: Box<dyn Policy>) -> Result<Self, EngineError> {
        let scheduler = Scheduler::new(config.scheduler, policy, config.hash_key)?;
        Ok(Self {
            scheduler,
            live: HashMap::new(),
            ended: Vec::new(),
        })
    }

    /// Queues a request; rejected requests (too long, duplicate id) leave no trace.
    pub fn add_request(&mut self, submit: SubmitOptions) -> Result<(), EngineError> {
        let id = submit.request.id;
        if self.live.contains_key(&id) {
            return Err(EngineError::DuplicateRequest(id.0));
        }
        let prompt = submit.request.prompt.clone();
        self.scheduler.add_request(submit.request)?;
        self.live.insert(id, (prompt, submit.sampling));
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

    /// Whether any request is waiting or running.
    pub fn has_unfinished(&self) -> bool {
        self.scheduler.has_unfinished()
    }

    /// Queue lengths, KV usage, prefix-cache and preemption counters.
    pub fn stats(&self) -> SchedulerStats {
        self.scheduler.stats()
    }

    /// Replaces the policy between two steps; returns the old one.
    pub fn swap_policy(&mut self, policy: Box<dyn Policy>) -> Box<dyn Policy> {
        self.scheduler.swap_policy(policy)
    }

    /// Tokens generated so far for a request in flight.
    pub fn output_tokens(&self, id: RequestId) -> Option<&[TokenId]> {
        self.scheduler.output_tokens(id)
    }

    /// Plans a step at time `now`; `None` when there is nothing to run.
    pub fn prepare(&mut self, now: Timestamp) -> Result<Option<PreparedStep>, EngineError> {
        let t0 = Instant::now();
        let plan = self.scheduler.schedule(now);
        if plan.seqs.is_empty() {
            return Ok(None);
        }
        let mut seqs = Vec::with_capacity(plan.seqs.len());
        for s in &plan.seqs {
            let (prompt, sampling) = self
                .live
                .get(&s.id)
                .ok_or(EngineError::UnknownSequence(s.id.0))?;
            let end = s.num_computed_tokens + s.num_new_tokens;
            let outputs = self.scheduler.output_tokens(s.id).unwrap_or(&[]);
            let mut tokens = Vec::with_capacity(s.num_new_tokens);
            for i in s.num_computed_tokens..end {
                let t = if i < prompt.len() {
                    prompt.get(i)
                } else {
                    outputs.get(i - prompt.len())
                };
                tokens.push(*t.ok_or(EngineError::UnknownSequence(s.id.0))?);
            }
            seqs.push(SeqInput {
                seq_id: s.id.0,
                num_computed_tokens: s.num_computed_tokens,
                tokens,
                block_table: self
                    .scheduler
                    .block_table(s.id)
                    .map(<[_]>::to_vec)
                    .unwrap_or_default(),
                sample: s.samples,
                sampling: sampling.clone(),
                adapter: None,
            });
        }
        let release = std::mem::take(&mut self.ended);
        Ok(Some(PreparedStep {
            plan,
            batch: Batch { seqs },
            release,
            plan_us: t0.elapsed().as_micros() as u64,
        }))
    }

    /// Applies the backend's outputs for a prepared step and returns what happened.
    pub fn complete(
        &mut self,
        plan: &StepPlan,
        outputs: Vec<SeqOutput>,
        now: Timestamp,
    ) -> Vec<CoreEvent> {
        let mut logprobs: HashMap<u64, (Option<f32>, Vec<(TokenId, f32)>)> = HashMap::new();
        let mut sampled = Vec::with_capacity(outputs.len());
        for o in outputs {
            if let Some(token) = o.token {
                sampled.push(StepOutput {
                    id: RequestId(o.seq_id),
                    token,
                });
                if o.logprob.is_some() || !o.top_logprobs.is_empty() {
                    logprobs.insert(o.seq_id, (o.logprob, o.top_logprobs));
                }
            }
        }
        let mut events = Vec::with_capacity(sampled.len());
        for event in self.scheduler.apply_outputs(plan, &sampled, now) {
            match event {
                SeqEvent::Token { id, token, .. } => {
                    let (logprob, top_logprobs) = logprobs.remove(&id.0).unwrap_or_default();
                    events.push(CoreEvent::Token {
                        id,
                        token,
                        logprob,
                        top_logprobs,
                    });
                }
                SeqEvent::Finished { id, reason, .. } => {
                    self.scheduler.forget(id);
                    if self.live.remove(&id).is_some() {
                        self.ended.push(id.0);
                    }
                    events.push(CoreEvent::Finished { id, reason });
                }
                SeqEvent::FirstToken { .. } => {}
            }
        }
        events
    }
}

/// The scheduling core and a backend stepped together on the caller's thread: offline
/// generation and the throughput benchmark use it.
pub struct EngineCore {
    core: StepCore,
    backend: Box<dyn Backend>,
}

impl EngineCore {
    /// Builds the core around a backend.
    pub fn new(
        config: EngineCoreConfig,
        policy: Box<dyn Policy>,
        backend: Box<dyn Backend>,
    ) -> Result<Self, EngineError> {
        Ok(Self {
            core: StepCore::new(config, policy)?,
            backend,
        })
    }

    /// The scheduling side, for queries and request control.
    pub fn core(&mut self) -> &mut StepCore {
        &mut self.core
    }

    /// Runs one step at time `now`: plan, execute, apply. A step with nothing to do returns an
    /// empty report without calling the backend.
    pub fn step(&mut self, now: Timestamp) -> Result<StepReport, EngineError> {
        let Some(prepared) = self.core.prepare(now)? else {
            return Ok(StepReport::default());
        };
        for id in &prepared.release {
            self.backend.release(*id);
        }
        let t1 = Instant::now();
        let outputs = self.backend.execute(&prepared.batch)?;
        let t2 = Instant::now();
        let events = self.core.complete(&prepared.plan, outputs, now);
        Ok(StepReport {
            events,
            num_seqs: prepared.plan.seqs.len(),
            num_batched_tokens: prepared.plan.num_batched_tokens,
            plan_us: prepared.plan_us,
            execute_us: (t2 - t1).as_micros() as u64,
            apply_us: t2.elapsed().as_micros() as u64,
        })
    }
}
