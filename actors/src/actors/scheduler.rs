//! The scheduler actor: owns the scheduling core ([`StepCore`]) and drives steps: one round trip
//! to the KV allocator, one to the executor and one message to the detokenizer per step.
//!
//! With asynchronous scheduling the executor round trip splits in two: the step is submitted
//! (the backend returns once it is queued on the device), then the outputs of the step
//! submitted before it are collected and applied, and the next step is planned, committed and
//! submitted while this one runs.

use std::collections::HashMap;
use std::time::Instant;

use actix::{Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, WrapFuture};
use switchyard_policies::{FinishReason, Policy, RequestId, SchedulerStats, StepPlan, Timestamp};

use super::admission::REFUSAL_LOG_INTERVAL;
use super::allocator::{Commit, KvAllocatorActor};
use super::detokenizer::{DetokenizerActor, Scheduled, StepEvents};
use super::engine::{SubmitError, SubmitErrorKind};
use super::executor::{
    CollectStep, DiscardSteps, Execute, ExecutorActor, ReleaseSequences, SubmitStep,
};
use crate::core::{PreparedStep, StepCore, SubmitOptions};
use crate::metric_names as names;
use crate::EngineError;
use switchyard_policies::rate_limit::LogThrottle;

/// Queues requests (all choices of one client request together).
#[derive(Message)]
#[rtype(result = "Result<(), EngineError>")]
pub struct Submit(pub Vec<SubmitOptions>);

/// Ends requests for a reason found outside the core (stop string, client gone).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Finish(pub Vec<(RequestId, FinishReason)>);

/// Replaces the policy at the next step boundary.
#[derive(Message)]
#[rtype(result = "()")]
pub struct SwapPolicy(pub Box<dyn Policy>);

/// Replaces the tiers' settings, and with them the policy (built with them), between two
/// steps; a refusal is logged (nothing changes then).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetTiers(pub Vec<switchyard_policies::TierSpec>, pub Box<dyn Policy>);

/// Asks for queue and cache statistics.
#[derive(Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetStats;

/// Sets speculative decoding (`None`: off) from the next step on; answers the reason when
/// refused.
#[derive(Message)]
#[rtype(result = "Result<(), String>")]
pub struct SetSpeculative(pub Option<switchyard_policies::SpeculativeConfig>);

/// Owns the core and the step loop.
pub struct SchedulerActor {
    core: StepCore,
    allocator: Addr<KvAllocatorActor>,
    executor: Addr<ExecutorActor>,
    detokenizer: Addr<DetokenizerActor>,
    /// Finishes that arrived while a commit was in flight.
    deferred: Vec<(RequestId, FinishReason)>,
    /// A commit is in flight on the allocator.
    committing: bool,
    /// A step is in flight (on the allocator or the executor).
    stepping: bool,
    /// Origin of the engine clock passed to the core.
    origin: Instant,
    /// A policy swap waiting for the step in flight to end.
    pending_swap: Option<Box<dyn Policy>>,
    /// Plan and submit each step while the previous one runs (the executor's backend
    /// pipelines).
    async_scheduling: bool,
    /// The submitted step whose outputs are not applied yet (asynchronous scheduling).
    in_flight: Option<StepPlan>,
    /// Whether the next step may be planned before `in_flight`'s outputs are in.
    ahead_ok: bool,
    /// When a wake-up is set to plan a step at a queue deadline while idle.
    wake_at: Option<Timestamp>,
    /// Per queue bound (`tiers.<name>.max_queue_ms` or `scheduler.max_queue_ms`: bounded by
    /// the configured tiers), the throttle of its WARN lines.
    timeout_logs: HashMap<String, LogThrottle>,
    /// Per configured tier, its label and the KV blocks last published for it
    /// ([`names::KV_CACHE_BLOCKS_USED`], set again only when it changes).
    tier_blocks: Vec<(std::sync::Arc<str>, Option<usize>)>,
}

impl SchedulerActor {
    /// Builds the actor around a core.
    pub fn new(
        core: StepCore,
        allocator: Addr<KvAllocatorActor>,
        executor: Addr<ExecutorActor>,
        detokenizer: Addr<DetokenizerActor>,
    ) -> Self {
        let tier_blocks = core
            .tier_kv_blocks()
            .map(|(name, _)| (name.into(), None))
            .collect();
        Self {
            core,
            allocator,
            executor,
            detokenizer,
            deferred: Vec::new(),
            committing: false,
            stepping: false,
            origin: Instant::now(),
            pending_swap: None,
            async_scheduling: false,
            in_flight: None,
            ahead_ok: false,
            wake_at: None,
            tier_blocks,
            timeout_logs: HashMap::new(),
        }
    }

    /// Turns asynchronous scheduling on; only for an executor whose backend pipelines
    /// (`AsyncScheduling::enabled_for`).
    pub fn with_async_scheduling(mut self, on: bool) -> Self {
        self.async_scheduling = on;
        self
    }

    fn now(&self) -> Timestamp {
        Timestamp(self.origin.elapsed().as_micros() as u64)
    }

    fn publish_stats(&mut self) {
        self.core.note_pool_errors();
        let s = self.core.stats();
        metrics::gauge!(names::NUM_REQUESTS_RUNNING).set(s.num_running as f64);
        metrics::gauge!(names::NUM_REQUESTS_WAITING).set(s.num_waiting as f64);
        metrics::gauge!(names::KV_CACHE_USAGE_PERC).set(s.kv_usage);
        for ((tier, last), (_, held)) in self.tier_blocks.iter_mut().zip(self.core.tier_kv_blocks())
        {
            if *last != Some(held) {
                *last = Some(held);
                metrics::gauge!(names::KV_CACHE_BLOCKS_USED, names::tier_labels(tier))
                    .set(held as f64);
            }
        }
        metrics::counter!(names::PREFIX_CACHE_QUERIES).absolute(s.prefix_queries);
        metrics::counter!(names::PREFIX_CACHE_HITS).absolute(s.prefix_hits);
        let host_blocks = self.core.num_host_blocks();
        if host_blocks > 0 {
            metrics::gauge!(names::KV_OFFLOAD_USAGE_PERC)
                .set(s.num_host_blocks_used as f64 / host_blocks as f64);
            metrics::counter!(names::KV_OFFLOAD_STORED_BLOCKS).absolute(s.num_kv_offloaded_blocks);
            metrics::counter!(names::KV_OFFLOAD_STORED_AHEAD_BLOCKS)
                .absolute(s.num_kv_stored_ahead_blocks);
            metrics::counter!(names::KV_OFFLOAD_LOADED_BLOCKS).absolute(s.num_kv_loaded_blocks);
            metrics::counter!(names::KV_OFFLOAD_PREFIX_HITS).absolute(s.num_host_hit_tokens);
        }
        metrics::counter!(names::NUM_PREEMPTIONS).absolute(s.num_preemptions);
        metrics::gauge!(names::LORA_RUNNING_ADAPTERS).set(s.num_running_adapters as f64);
        metrics::gauge!(names::LORA_WAITING_REQUESTS).set(s.num_waiting_adapter_requests as f64);
        let spec = self.core.spec_decode_stats();
        if spec.num_drafts > 0 {
            metrics::counter!(names::SPEC_DECODE_DRAFTS).absolute(spec.num_drafts);
            metrics::counter!(names::SPEC_DECODE_DRAFT_TOKENS).absolute(spec.num_draft_tokens);
            metrics::counter!(names::SPEC_DECODE_ACCEPTED_TOKENS)
                .absolute(spec.num_accepted_tokens);
        }
    }

    /// Starts a step unless one is in flight or there is nothing to do: plan, commit the
    /// block changes with the allocator, then run the batch on the executor.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.stepping {
            return;
        }
        if let Some(policy) = self.pending_swap.take() {
            let to = policy.name().to_string();
            let old = self.core.swap_policy(policy);
            tracing::info!(from = old.name(), to, "scheduling policy swapped");
        }
        if !self.core.has_unfinished() && !self.core.has_uncommitted() && self.in_flight.is_none() {
            self.release_ended();
            self.publish_stats();
            return;
        }
        let step_start = Instant::now();
        let mut planned = if self.in_flight.is_none() {
            self.core.plan(self.now())
        } else {
            // Plan ahead of the step in flight when it allows; otherwise apply it first.
            match self
                .ahead_ok
                .then(|| self.core.plan_ahead(self.now()))
                .flatten()
            {
                Some(p) => p,
                None => return self.collect(step_start, ctx),
            }
        };
        self.fail_timed_out();
        if planned.plan.seqs.is_empty() && planned.commit.is_empty() {
            if self.in_flight.is_some() {
                // Collecting now resolves the step in flight, as a held-back preemption
                // wants: the next plan is made in order, so the flag has done its work.
                self.core.take_preemption_wanted();
                return self.collect(step_start, ctx);
            }
            self.release_ended();
            self.publish_stats();
            self.wake_at_queue_deadline(ctx);
            return;
        }
        // Until the ids are back, requests may not end (their blocks are in the commit):
        // finishes arriving meanwhile wait in `deferred`.
        self.stepping = true;
        self.committing = true;
        let commit = std::mem::take(&mut planned.commit);
        let fut = self.allocator.send(Commit(commit));
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            act.committing = false;
            let ids = match result {
                Ok(Ok(ids)) => ids,
                Ok(Err(e)) => return act.fail_step(planned.plan, &e.to_string(), ctx),
                Err(e) => {
                    tracing::error!(error = %e, "the KV allocator is gone");
                    let error = format!("the KV allocator is gone: {e}");
                    return act.fail_step(planned.plan, &error, ctx);
                }
            };
            if let Err(e) = act.core.assign(&mut planned, &ids) {
                return act.fail_step(planned.plan, &e.to_string(), ctx);
            }
            metrics::histogram!(names::ENGINE_KV_COMMIT).record(step_start.elapsed().as_secs_f64());
            act.apply_deferred();
            match act.core.build_step(planned) {
                Ok(Some(prepared)) if act.async_scheduling => act.submit(prepared, step_start, ctx),
                Ok(Some(prepared)) => act.execute(prepared, step_start, ctx),
                Ok(None) if act.in_flight.is_some() => {
                    // Nothing of the plan made ahead is left to run; the next plan is made in
                    // order (after the step in flight), so a preemption it held back is moot.
                    act.core.take_preemption_wanted();
                    act.collect(step_start, ctx)
                }
                Ok(None) => {
                    act.stepping = false;
                    act.publish_stats();
                    ctx.notify(Kick);
                }
                Err(failed) => {
                    let error = format!("building a batch failed: {}", failed.error);
                    act.fail_step(*failed.plan, &error, ctx);
                }
            }
        }));
    }

    /// Fails the client requests of the requests the core timed out in the queue: each gets
    /// the 503 `queue_timeout` naming its wait and its bound (the detokenizer counts it in
    /// `request_failed_total{reason="queue_timeout"}` and ends its request's other choices),
    /// and each bound logs a WARN line at most every [`REFUSAL_LOG_INTERVAL`] with the count
    /// since its last one.
    fn fail_timed_out(&mut self) {
        let timed_out = self.core.take_timed_out();
        if timed_out.is_empty() {
            return;
        }
        let now = Instant::now();
        for t in timed_out {
            let bound = if t.tier_bound {
                format!("tiers.{}.max_queue_ms", t.tier)
            } else {
                "scheduler.max_queue_ms".to_owned()
            };
            let message = format!(
                "The request waited {:.2} s in the queue without being admitted, longer than \
                 {bound} = {}: the server is overloaded; retry later.",
                t.waited as f64 / 1e6,
                t.max_queue_ms
            );
            let throttle = self
                .timeout_logs
                .entry(bound.clone())
                .or_insert_with(|| LogThrottle::new(REFUSAL_LOG_INTERVAL));
            if let Some(n) = throttle.hit(now) {
                tracing::warn!(
                    bound = %bound,
                    max_queue_ms = t.max_queue_ms,
                    timed_out = n,
                    "requests timed out in the queue: not admitted within their bound"
                );
            }
            let error = SubmitError::new(SubmitErrorKind::QueueTimeout, message);
            self.detokenizer
                .do_send(StepEvents::failed_with(vec![t.id], error));
        }
    }

    /// With nothing to run, sets a wake-up at the earliest queue deadline, so that a request
    /// waiting while no step runs is still timed out (a step is planned then).
    fn wake_at_queue_deadline(&mut self, ctx: &mut Context<Self>) {
        let Some(at) = self.core.next_queue_deadline() else {
            return;
        };
        if self.wake_at.is_some_and(|w| w <= at) {
            return;
        }
        self.wake_at = Some(at);
        // Timed out once past the deadline: 1 µs after it.
        let delay = std::time::Duration::from_micros(at.saturating_sub(self.now()) + 1);
        ctx.run_later(delay, |act, ctx| {
            act.wake_at = None;
            act.kick(ctx);
        });
    }

    /// Ends the requests of a step that cannot run, and carries on with the rest. A step in
    /// flight fails with it (the backend's queue is emptied).
    fn fail_step(&mut self, plan: StepPlan, error: &str, ctx: &mut Context<Self>) {
        tracing::error!(error, "a step failed; aborting its requests");
        metrics::counter!(names::ENGINE_FAILED_STEPS).increment(1);
        self.stepping = false;
        let mut ids: Vec<RequestId> = plan.seqs.iter().map(|s| s.id).collect();
        if let Some(other) = self.in_flight.take() {
            for s in &other.seqs {
                if !ids.contains(&s.id) {
                    ids.push(s.id);
                }
            }
            self.executor.do_send(DiscardSteps);
        }
        for id in &ids {
            self.core.abort(*id);
        }
        // Launched steps (asynchronous scheduling) are not applied: every request in them
        // just ended. They registered the blocks they were computing in the prefix cache when
        // they were launched; those may not hold their KV, so no registration is kept.
        self.core.forget_launched();
        self.core.clear_prefix_cache();
        self.apply_deferred();
        self.detokenizer
            .do_send(StepEvents::failed(ids, error.to_string()));
        ctx.notify(Kick);
    }

    /// With no step in flight and none to run, hands the backend the sequences that ended
    /// since the last batch: their state is released now rather than with the next batch,
    /// which on an idle server may be long in coming.
    fn release_ended(&mut self) {
        debug_assert!(self.in_flight.is_none() && !self.stepping);
        let ended = self.core.take_ended();
        if !ended.is_empty() {
            self.executor.do_send(ReleaseSequences(ended));
        }
    }

    /// Applies the finishes that arrived while a commit was in flight.
    fn apply_deferred(&mut self) {
        for (id, reason) in std::mem::take(&mut self.deferred) {
            self.core.finish(id, reason);
        }
    }

    /// Submits a committed batch (asynchronous scheduling), then collects the outputs of the
    /// step submitted before it, if any; the next step is planned once those are applied.
    fn submit(&mut self, mut prepared: PreparedStep, step_start: Instant, ctx: &mut Context<Self>) {
        record_plan(&prepared);
        self.note_scheduled(&mut prepared, step_start);
        let wants_order = self.core.take_preemption_wanted();
        self.ahead_ok = self.core.launch(&prepared.plan) && !wants_order;
        let plan = prepared.plan;
        // The batch's adapters serve their requests' tenants until it comes back, requests
        // that end meanwhile included.
        let adapter_users = prepared.adapter_users;
        let fut = self.executor.send(SubmitStep {
            batch: prepared.batch,
            release: prepared.release,
            kv_copies: prepared.kv_copies,
        });
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            let submitted = match reply(result) {
                Ok(s) => s,
                Err(e) => return act.fail_step(plan, &e, ctx),
            };
            act.core.recycle(submitted.batch);
            drop(adapter_users);
            metrics::gauge!(names::ENGINE_BATCH_SIZE).set(plan.seqs.len() as f64);
            match act.in_flight.replace(plan) {
                // The step before this one ran while this one was planned: apply it now.
                Some(prev) => act.collect_plan(prev, step_start, submitted.submit_us, ctx),
                None => {
                    act.stepping = false;
                    act.kick(ctx);
                }
            }
        }));
    }

    /// Tells the detokenizer which requests this step schedules for the first time, and when
    /// the step began (their prefill and inference times run from then): before the step's
    /// events, which the same mailbox carries after it.
    fn note_scheduled(&mut self, prepared: &mut PreparedStep, step_start: Instant) {
        if !prepared.first_scheduled.is_empty() {
            self.detokenizer.do_send(Scheduled {
                ids: std::mem::take(&mut prepared.first_scheduled),
                at: step_start,
            });
        }
    }

    /// Collects and applies the step in flight, then carries on.
    fn collect(&mut self, step_start: Instant, ctx: &mut Context<Self>) {
        match self.in_flight.take() {
            Some(prev) => {
                self.stepping = true;
                self.collect_plan(prev, step_start, 0, ctx);
            }
            None => {
                self.stepping = false;
                ctx.notify(Kick);
            }
        }
    }

    fn collect_plan(
        &mut self,
        plan: StepPlan,
        step_start: Instant,
        submit_us: u64,
        ctx: &mut Context<Self>,
    ) {
        let fut = self.executor.send(CollectStep);
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            let collected = match reply(result) {
                Ok(c) => c,
                Err(e) => return act.fail_step(plan, &e, ctx),
            };
            act.stepping = false;
            let now = act.now();
            let events = act.core.resolve(&plan, collected.outputs, now);
            act.publish_stats();
            act.detokenizer.do_send(StepEvents::new(events));
            // The engine's own cost: everything but the backend's submit and the wait for
            // the outputs.
            let total_us = step_start.elapsed().as_micros() as u64;
            metrics::histogram!(names::ENGINE_STEP_OVERHEAD)
                .record(total_us.saturating_sub(submit_us + collected.wait_us) as f64 / 1e6);
            act.kick(ctx);
        }));
    }

    /// Sends a committed batch to the executor and applies its outputs.
    fn execute(
        &mut self,
        mut prepared: PreparedStep,
        step_start: Instant,
        ctx: &mut Context<Self>,
    ) {
        record_plan(&prepared);
        self.note_scheduled(&mut prepared, step_start);
        let plan = prepared.plan;
        let adapter_users = prepared.adapter_users;
        let fut = self.executor.send(Execute {
            batch: prepared.batch,
            release: prepared.release,
            kv_copies: prepared.kv_copies,
        });
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            let executed = match reply(result) {
                Ok(executed) => executed,
                // A backend failure fails the requests of this step rather than the server.
                Err(e) => return act.fail_step(plan, &e, ctx),
            };
            act.stepping = false;
            let now = act.now();
            let events = act.core.complete(&plan, executed.outputs, now);
            act.core.recycle(executed.batch);
            drop(adapter_users);
            act.publish_stats();
            act.detokenizer.do_send(StepEvents::new(events));
            // The engine's own cost of this step: planning, the allocator and executor round
            // trips, applying outputs and handing them to the detokenizer, without model time.
            let total_us = step_start.elapsed().as_micros() as u64;
            metrics::histogram!(names::ENGINE_STEP_OVERHEAD)
                .record(total_us.saturating_sub(executed.execute_us) as f64 / 1e6);
            metrics::gauge!(names::ENGINE_BATCH_SIZE).set(plan.seqs.len() as f64);
            act.kick(ctx);
        }));
    }
}

/// Records a prepared step's queue times, planning time and tokens.
fn record_plan(prepared: &PreparedStep) {
    metrics::histogram!(names::ITERATION_TOKENS).record(prepared.plan.num_batched_tokens as f64);
    for (tier, q) in &prepared.queue_times_us {
        metrics::histogram!(names::REQUEST_QUEUE_TIME, names::tier_labels(tier))
            .record(*q as f64 / 1e6);
    }
    metrics::histogram!(names::ENGINE_PLAN).record(prepared.plan_us as f64 / 1e6);
}

/// An executor's reply: its value, or the message its step's requests fail with (the backend
/// failed, or the executor thread is gone; either way the server goes on, and clients hear of
/// it rather than wait).
fn reply<T>(
    result: Result<Result<T, switchyard_gpu::GpuError>, actix::MailboxError>,
) -> Result<T, String> {
    match result {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(e.to_string()),
        Err(e) => {
            tracing::error!(error = %e, "the executor is gone");
            Err(format!("the executor is gone: {e}"))
        }
    }
}

/// Internal: try to start a step.
#[derive(Message)]
#[rtype(result = "()")]
struct Kick;

impl Actor for SchedulerActor {
    type Context = Context<Self>;
}

impl Handler<Kick> for SchedulerActor {
    type Result = ();
    fn handle(&mut self, _: Kick, ctx: &mut Context<Self>) {
        self.kick(ctx);
    }
}

/// The engine-clock time (microseconds since `origin`) of a request the engine received at
/// `received`, taken at `now`: never later than `now`, never before the clock's origin.
fn arrival_stamp(origin: Instant, received: Option<Instant>, now: Timestamp) -> Timestamp {
    received.map_or(now, |at| {
        let since = at.saturating_duration_since(origin).as_micros();
        Timestamp(u64::try_from(since).unwrap_or(u64::MAX).min(now.0))
    })
}

impl Handler<Submit> for SchedulerActor {
    type Result = Result<(), EngineError>;

    /// Queues the choices, or refuses them all; a refusal is also reported to the detokenizer
    /// (which submits requests without waiting for the answer).
    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) -> Self::Result {
        let mut added = Vec::with_capacity(msg.0.len());
        let ids: Vec<RequestId> = msg.0.iter().map(|s| s.request.id).collect();
        let now = self.now();
        // The request's time from the engine's receipt to this queue, once per request (its
        // choices come together; a beam search's later steps count not: `queue_times` 0).
        if let Some((received, submit)) = msg
            .0
            .iter()
            .find_map(|s| s.received.filter(|_| s.queue_times > 0).map(|r| (r, s)))
        {
            metrics::histogram!(
                names::REQUEST_FRONT_END,
                names::tier_labels(&submit.metrics_tier)
            )
            .record(received.elapsed().as_secs_f64());
        }
        for mut submit in msg.0 {
            // Arrival on the engine clock: policies order, age and set deadlines by it. A
            // request arrived when the engine received it, before its prompt was encoded.
            submit.request.arrival = arrival_stamp(self.origin, submit.received, now);
            // Its queue time runs from when its prompt was encoded (vLLM's: time spent waiting,
            // the grammar's compile included).
            submit.queued = Some(arrival_stamp(self.origin, submit.encoded, now));
            let id = submit.request.id;
            if let Err(e) = self.core.add_request(submit) {
                // All choices of a request go in together or not at all.
                for id in added {
                    self.core.abort(id);
                }
                self.detokenizer.do_send(StepEvents::rejected(ids, &e));
                return Err(e);
            }
            added.push(id);
        }
        self.kick(ctx);
        Ok(())
    }
}

impl Handler<Finish> for SchedulerActor {
    type Result = ();
    fn handle(&mut self, msg: Finish, ctx: &mut Context<Self>) {
        if self.committing {
            // A commit is in flight; ending a request now would change its blocks under it.
            // The step's continuation applies these as soon as the ids are back.
            self.deferred.extend(msg.0);
        } else {
            for (id, reason) in msg.0 {
                self.core.finish(id, reason);
            }
        }
        self.publish_stats();
        self.kick(ctx);
    }
}

impl Handler<SwapPolicy> for SchedulerActor {
    type Result = ();
    fn handle(&mut self, msg: SwapPolicy, ctx: &mut Context<Self>) {
        self.pending_swap = Some(msg.0);
        self.kick(ctx);
    }
}

impl Handler<SetTiers> for SchedulerActor {
    type Result = ();
    fn handle(&mut self, msg: SetTiers, ctx: &mut Context<Self>) {
        match self.core.set_tiers(msg.0) {
            Ok(changes) => {
                for change in changes {
                    tracing::warn!(%change, "a tier's new KV bound");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "the tiers' new settings were refused; the old ones stay");
                return;
            }
        }
        // A removed tier holds nothing counted any more: its gauge says so; a new one's is
        // published with the next statistics.
        let mut last: HashMap<std::sync::Arc<str>, Option<usize>> =
            std::mem::take(&mut self.tier_blocks).into_iter().collect();
        self.tier_blocks = self
            .core
            .tier_kv_blocks()
            .map(|(name, _)| {
                let name: std::sync::Arc<str> = name.into();
                let held = last.remove(&name).flatten();
                (name, held)
            })
            .collect();
        for (tier, _) in last {
            metrics::gauge!(names::KV_CACHE_BLOCKS_USED, names::tier_labels(&tier)).set(0.0);
        }
        self.pending_swap = Some(msg.1);
        self.kick(ctx);
    }
}

impl Handler<SetSpeculative> for SchedulerActor {
    type Result = Result<(), String>;
    fn handle(&mut self, msg: SetSpeculative, _: &mut Context<Self>) -> Self::Result {
        self.core.set_speculative(msg.0).map_err(|e| e.to_string())
    }
}

impl Handler<GetStats> for SchedulerActor {
    type Result = actix::MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.core.stats())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use actix::SyncArbiter;
    use switchyard_gpu::backend::{Backend, Batch, SamplingParams, SeqOutput};
    use switchyard_gpu::GpuError;
    use switchyard_policies::{PolicyRegistry, SamplingLimits, SchedulerConfig};

    use super::*;
    use crate::actors::allocator::KvAllocatorActor;
    use crate::actors::detokenizer::SetScheduler;
    use crate::core::EngineCoreConfig;
    use crate::testing::{abc_tokenizer, CountingBackend, EMPTY_BATCHES};

    /// `CountingBackend` taking steps one ahead: pending tokens are token 1 (what it
    /// samples); counts steps submitted while another was outstanding. With a gate, each
    /// submit waits for the test's go-ahead.
    struct PipelinedCounting {
        /// Counts the tokens each sequence was fed.
        inner: CountingBackend,
        /// The outputs of the steps submitted and not collected yet, oldest first.
        submitted: std::collections::VecDeque<Vec<SeqOutput>>,
        /// How many steps were submitted while another was outstanding.
        ahead: Arc<Mutex<usize>>,
        /// Held by each submit until the test lets it go on.
        gate: Option<Gate>,
    }

    /// A submit says it started (`started`), then waits for the test's go-ahead (`go`).
    struct Gate {
        /// Told once per submit, before it waits.
        started: std::sync::mpsc::Sender<()>,
        /// One message lets one submit go on.
        go: Arc<Mutex<std::sync::mpsc::Receiver<()>>>,
    }

    impl PipelinedCounting {
        /// Counting into `fed`, ungated, its count of steps ahead its own.
        fn new(fed: &Arc<Mutex<HashMap<u64, usize>>>) -> Self {
            Self {
                inner: CountingBackend(fed.clone()),
                submitted: Default::default(),
                ahead: Arc::new(Mutex::new(0)),
                gate: None,
            }
        }
    }

    impl Backend for PipelinedCounting {
        fn name(&self) -> &str {
            "pipelined-counting"
        }
        crate::testing::inner_backend_shape!();
        fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
            self.inner.execute(batch)
        }
        fn release(&mut self, _: u64) {}
        fn pipelines(&self) -> bool {
            true
        }
        fn overlaps_host(&self) -> bool {
            true
        }
        fn submit(&mut self, batch: &Batch) -> Result<(), GpuError> {
            if let Some(gate) = &self.gate {
                let _ = gate.started.send(());
                let _ = gate.go.lock().unwrap().recv();
            }
            assert!(self.submitted.len() <= 1, "more than one step ahead");
            *self.ahead.lock().unwrap() += self.submitted.len();
            for s in &batch.seqs {
                if s.tokens.contains(&switchyard_gpu::backend::PENDING_TOKEN) {
                    assert_eq!(s.tokens.len(), 1);
                }
            }
            let out = self.inner.execute(batch)?;
            self.submitted.push_back(out);
            Ok(())
        }
        fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
            Ok(self.submitted.pop_front().expect("a submitted step"))
        }
    }

    #[actix::test]
    async fn async_scheduling_runs_every_request_to_its_end_and_overlaps_steps() {
        let fed = Arc::new(Mutex::new(HashMap::new()));
        let ahead = Arc::new(Mutex::new(0usize));
        let (backend, count) = (fed.clone(), ahead.clone());
        let scheduler = start_scheduler(
            move || {
                Box::new(PipelinedCounting {
                    ahead: count.clone(),
                    ..PipelinedCounting::new(&backend)
                })
            },
            16,
            true,
        );
        // Chunked prompts (16 tokens per step), more requests than the blocks hold at once
        // (each needs 4 blocks of 64), and one request ended while in flight. Distinct prompts
        // (no prefix-cache hits): the first block spells the id in base 3.
        let distinct = |id: u64| {
            let mut r = request(id);
            let digits = [id % 3, id / 3 % 3, id / 9 % 3].map(|d| d as u32);
            let mut prompt = r.request.prompt.to_vec();
            prompt[..3].copy_from_slice(&digits);
            r.request.prompt = prompt.into();
            r
        };
        scheduler.do_send(Submit((1..=20).map(distinct).collect()));
        scheduler.do_send(Finish(vec![(RequestId(3), FinishReason::Abort)]));
        wait_until_idle(&scheduler, &fed, 19).await;
        let fed = fed.lock().unwrap();
        for id in (1..=20u64).filter(|&i| i != 3) {
            // 10 prompt tokens, then one token per step for the 5 further outputs: a request
            // that ends by length is never fed past its last token.
            assert_eq!(fed.get(&id), Some(&15), "request {id}: {fed:?}");
        }
        assert!(*ahead.lock().unwrap() > 0, "no step was submitted ahead");
    }

    /// Regression: a request that ended (its client gone) while its step was with the
    /// executor let go of its mark as its adapter's user, while the batch still held the
    /// adapter's weights until it came back: for that step the adapter was in use by no
    /// tenant, so the tenant charged for it, whose own requests used nothing, was refused
    /// (429, "all are in use by your requests") rather than its charge moving to the tenant
    /// whose request the batch ran. The batch holds its requests' marks as long as their
    /// weights.
    #[actix::test]
    async fn a_batch_in_flight_holds_its_adapter_for_the_tenant_of_the_request_that_ended() {
        use crate::actors::lora::{Charge, LoraManager, LoraManagerConfig, LoraRegistry};
        // Adapters x and y, found in a directory; shares of one adapter per tenant.
        // Removed on drop, whatever the outcome.
        let root = crate::actors::lora::tests::AdapterCopy::holding("sched", &["x", "y"]);
        let config = LoraManagerConfig {
            model: switchyard_gpu::model::LlamaConfig::smollm2_135m(),
            base_name: "base".into(),
            limits: switchyard_gpu::LoraLimits::default(),
            max_adapters: 8,
            max_loaded: 8,
            adapter_dirs: vec![root.0.clone()],
            model_names: Vec::new(),
            tenant_shares: vec![("gold".into(), 1)],
        };
        let mut lora = LoraManager::new(config, LoraRegistry::default());
        let gold = |tenant: &str| Charge {
            tenant: tenant.into(),
            tier: "gold".into(),
        };
        let (acme, bob) = (gold("acme"), gold("bob"));
        // acme reads x (charged to it) and lets go; bob's request takes x from memory.
        drop(lora.resolve_for("x", Some(&acme)).expect("x"));
        let bob_x = lora.resolve_for("x", Some(&bob)).expect("x for bob");
        let mut req = request(1).with_adapter(bob_x.id, bob_x.adapter.clone());
        req.adapter_user = bob_x.user.clone();
        drop(bob_x);
        let fed = Arc::new(Mutex::new(HashMap::new()));
        let (started_tx, started) = std::sync::mpsc::channel();
        let (go, go_rx) = std::sync::mpsc::channel();
        let go_rx = Arc::new(Mutex::new(go_rx));
        let backend = fed.clone();
        let scheduler = start_scheduler(
            move || {
                Box::new(PipelinedCounting {
                    gate: Some(Gate {
                        started: started_tx.clone(),
                        go: go_rx.clone(),
                    }),
                    ..PipelinedCounting::new(&backend)
                })
            },
            16,
            true,
        );
        scheduler.do_send(Submit(vec![req]));
        // Its first step is with the executor when the client hangs up.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while started.try_recv().is_err() {
            assert!(std::time::Instant::now() < deadline, "no step submitted");
            actix::clock::sleep(Duration::from_millis(1)).await;
        }
        scheduler
            .send(Finish(vec![(RequestId(1), FinishReason::Abort)]))
            .await
            .unwrap();
        // x serves bob's request in that batch: acme's own requests use nothing, so its load
        // of y is served, x's charge moving to bob.
        let y = lora.resolve_for("y", Some(&acme));
        for _ in 0..16 {
            let _ = go.send(());
        }
        wait_until_idle(&scheduler, &fed, 1).await;
        let e = y.err();
        assert!(e.is_none(), "acme refused: {e:?}");
    }

    /// A scheduler actor with FCFS over a 64-block pool of 4-token blocks, its executor
    /// holding `backend()`.
    fn start_scheduler(
        backend: impl Fn() -> Box<dyn Backend> + Send + Sync + 'static,
        max_num_batched_tokens: usize,
        async_scheduling: bool,
    ) -> Addr<SchedulerActor> {
        let executor = SyncArbiter::start(1, move || ExecutorActor::new(Some(backend())));
        let detokenizer = DetokenizerActor::new(abc_tokenizer()).start();
        let config = SchedulerConfig {
            num_gpu_blocks: 64,
            block_size: 4,
            max_model_len: 64,
            max_num_batched_tokens,
            ..SchedulerConfig::default()
        };
        let policy = PolicyRegistry::with_builtins()
            .create("fcfs", &serde_yaml::Value::Null, &[])
            .unwrap();
        let mut core = StepCore::new(
            EngineCoreConfig {
                scheduler: config,
                hash_key: [1, 2],
            },
            policy,
        )
        .unwrap();
        let allocator = KvAllocatorActor::new(core.detach_allocator().unwrap()).start();
        let scheduler = SchedulerActor::new(core, allocator, executor, detokenizer.clone())
            .with_async_scheduling(async_scheduling)
            .start();
        detokenizer.do_send(SetScheduler(scheduler.clone()));
        scheduler
    }

    /// Waits (at most 30 seconds, generous for a loaded machine) until nothing runs or waits
    /// and `min_fed` requests were fed; then checks that every block is back.
    async fn wait_until_idle(
        scheduler: &Addr<SchedulerActor>,
        fed: &Mutex<HashMap<u64, usize>>,
        min_fed: usize,
    ) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            let s = scheduler.send(GetStats).await.unwrap();
            if s.num_running == 0 && s.num_waiting == 0 && fed.lock().unwrap().len() >= min_fed {
                break;
            }
            actix::clock::sleep(Duration::from_millis(2)).await;
        }
        let stats = scheduler.send(GetStats).await.unwrap();
        assert_eq!((stats.num_running, stats.num_waiting), (0, 0));
        assert_eq!(stats.kv_usage, 0.0, "every block is back");
    }

    /// A scheduler actor over a `CountingBackend`, steps in order, and the backend's counts.
    fn counting_scheduler() -> (Addr<SchedulerActor>, Arc<Mutex<HashMap<u64, usize>>>) {
        let fed = Arc::new(Mutex::new(HashMap::new()));
        let backend = fed.clone();
        let scheduler = start_scheduler(
            move || Box::new(CountingBackend(backend.clone())),
            SchedulerConfig::default().max_num_batched_tokens,
            false,
        );
        (scheduler, fed)
    }

    fn request(id: u64) -> SubmitOptions {
        let limits = SamplingLimits {
            max_tokens: 6,
            ignore_eos: true,
            ..SamplingLimits::default()
        };
        SubmitOptions::offline(id, vec![2; 10], limits, Arc::new(SamplingParams::default()))
    }

    /// A request is dated from when the engine received it (before its prompt was encoded),
    /// as its time to first token is, within the engine clock.
    #[test]
    fn arrival_is_when_the_engine_received_the_request() {
        let origin = Instant::now();
        let now = Timestamp(10_000_000);
        let at = |us: u64| Some(origin + Duration::from_micros(us));
        assert_eq!(
            arrival_stamp(origin, at(2_500_000), now),
            Timestamp(2_500_000)
        );
        assert_eq!(arrival_stamp(origin, None, now), now);
        // Never after now, never before the origin.
        assert_eq!(arrival_stamp(origin, at(20_000_000), now), now);
        let before = origin.checked_sub(Duration::from_secs(1));
        assert_eq!(arrival_stamp(origin, before, now), Timestamp(0));
    }

    #[actix::test]
    async fn a_finish_during_the_allocator_commit_waits_for_the_block_ids() {
        let (scheduler, fed) = counting_scheduler();
        // Request 2 ends while the first step's commit (which reserved its blocks) is with
        // the allocator; request 1, in the same step, must run to its end regardless.
        scheduler.do_send(Submit(vec![request(1), request(2)]));
        scheduler.do_send(Finish(vec![(RequestId(2), FinishReason::Abort)]));
        wait_until_idle(&scheduler, &fed, 1).await;
        let fed = fed.lock().unwrap();
        // 10 prompt tokens, then one token per step for the 5 further outputs.
        assert_eq!(fed.get(&1), Some(&15), "request 1 ran to its end: {fed:?}");
        assert_eq!(fed.get(&2), None, "the aborted request never ran");
    }

    #[actix::test]
    async fn a_step_left_empty_by_a_finish_during_the_commit_is_not_run() {
        // The only request of the first step ends while its commit is with the allocator (a
        // client hanging up just then): no batch may be left to run, and the next request runs
        // to its end (an empty batch once killed the CPU backend's executor here).
        let (scheduler, fed) = counting_scheduler();
        scheduler.do_send(Submit(vec![request(1)]));
        scheduler.do_send(Finish(vec![(RequestId(1), FinishReason::Abort)]));
        scheduler.do_send(Submit(vec![request(2)]));
        wait_until_idle(&scheduler, &fed, 1).await;
        let fed = fed.lock().unwrap();
        assert_eq!(fed.get(&EMPTY_BATCHES), None, "an empty batch ran: {fed:?}");
        assert_eq!(fed.get(&1), None, "the aborted request never ran");
        assert_eq!(fed.get(&2), Some(&15), "request 2 ran to its end: {fed:?}");
    }

    /// `PipelinedCounting` whose first submitted step fails.
    struct FailsFirstSubmit(PipelinedCounting, bool);

    impl Backend for FailsFirstSubmit {
        fn name(&self) -> &str {
            "fails-first-submit"
        }
        fn num_kv_blocks(&self) -> usize {
            self.0.num_kv_blocks()
        }
        fn block_size(&self) -> usize {
            self.0.block_size()
        }
        fn max_batch_tokens(&self) -> usize {
            self.0.max_batch_tokens()
        }
        fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
            self.0.execute(batch)
        }
        fn release(&mut self, _: u64) {}
        fn pipelines(&self) -> bool {
            true
        }
        fn submit(&mut self, batch: &Batch) -> Result<(), GpuError> {
            if !std::mem::replace(&mut self.1, true) {
                return Err(GpuError::Internal("the device fell over".into()));
            }
            self.0.submit(batch)
        }
        fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
            self.0.collect()
        }
    }

    #[actix::test]
    async fn a_failed_step_leaves_no_prefix_for_later_requests_to_reuse() {
        // Steps one ahead register the blocks they compute in the prefix cache when they are
        // launched. The first step fails, so its blocks never got their KV: a later request
        // with the same prompt must compute the whole prompt, not match them.
        let fed = Arc::new(Mutex::new(HashMap::new()));
        let backend = fed.clone();
        let scheduler = start_scheduler(
            move || Box::new(FailsFirstSubmit(PipelinedCounting::new(&backend), false)),
            SchedulerConfig::default().max_num_batched_tokens,
            true,
        );
        scheduler.do_send(Submit(vec![request(1)]));
        wait_until_idle(&scheduler, &fed, 0).await;
        assert_eq!(
            fed.lock().unwrap().get(&1),
            None,
            "request 1 failed in its first step"
        );
        scheduler.do_send(Submit(vec![request(2)]));
        wait_until_idle(&scheduler, &fed, 1).await;
        // All 10 prompt tokens, then one token per step for the 5 further outputs; a prefix
        // hit on request 1's two full blocks would have fed 2 + 5.
        assert_eq!(fed.lock().unwrap().get(&2), Some(&15));
    }

    /// Records every sequence whose state the engine releases, around another backend.
    struct RecordsReleases<B>(B, Arc<Mutex<Vec<u64>>>);

    impl<B: Backend> Backend for RecordsReleases<B> {
        fn name(&self) -> &str {
            self.0.name()
        }
        fn num_kv_blocks(&self) -> usize {
            self.0.num_kv_blocks()
        }
        fn block_size(&self) -> usize {
            self.0.block_size()
        }
        fn max_batch_tokens(&self) -> usize {
            self.0.max_batch_tokens()
        }
        fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
            self.0.execute(batch)
        }
        fn release(&mut self, seq_id: u64) {
            self.1.lock().unwrap().push(seq_id);
            self.0.release(seq_id);
        }
        fn pipelines(&self) -> bool {
            self.0.pipelines()
        }
        fn overlaps_host(&self) -> bool {
            self.0.overlaps_host()
        }
        fn submit(&mut self, batch: &Batch) -> Result<(), GpuError> {
            self.0.submit(batch)
        }
        fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
            self.0.collect()
        }
    }

    #[actix::test]
    async fn an_idle_engine_releases_the_state_of_sequences_that_ended() {
        // With no next batch to carry them, the sequences that ended (run to their end, or
        // aborted before they ever ran) are released as soon as the engine is idle.
        for async_scheduling in [false, true] {
            let fed = Arc::new(Mutex::new(HashMap::new()));
            let released = Arc::new(Mutex::new(Vec::new()));
            let (backend, record) = (fed.clone(), released.clone());
            let scheduler = start_scheduler(
                move || {
                    Box::new(RecordsReleases(
                        PipelinedCounting::new(&backend),
                        record.clone(),
                    ))
                },
                SchedulerConfig::default().max_num_batched_tokens,
                async_scheduling,
            );
            scheduler.do_send(Submit(vec![request(1), request(2)]));
            scheduler.do_send(Finish(vec![(RequestId(2), FinishReason::Abort)]));
            wait_until_idle(&scheduler, &fed, 1).await;
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            loop {
                let mut got = released.lock().unwrap().clone();
                got.sort_unstable();
                if got == [1, 2] {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "async {async_scheduling}: released {got:?}, not [1, 2]"
                );
                actix::clock::sleep(Duration::from_millis(2)).await;
            }
            assert_eq!(fed.lock().unwrap().get(&1), Some(&15));
        }
    }

    #[actix::test]
    async fn aborts_at_any_moment_leave_no_request_or_block_behind() {
        // Hang-ups land anywhere in the step cycle (planning, the allocator commit, the
        // executor, applying outputs), with steps run in order and one ahead, and with more
        // requests than the blocks hold (so some wait and some are preempted).
        for async_scheduling in [false, true] {
            let fed = Arc::new(Mutex::new(HashMap::new()));
            let backend = fed.clone();
            let scheduler = start_scheduler(
                move || Box::new(PipelinedCounting::new(&backend)),
                16,
                async_scheduling,
            );
            // xorshift64: the same sequence of choices every run.
            let mut state = 0x9e37_79b9_7f4a_7c15u64;
            let mut next = move || {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state
            };
            let mut aborted = Vec::new();
            // Distinct prompts (no prefix-cache hits): the first 8 tokens spell the id in
            // base 3.
            let distinct = |id: u64| {
                let mut r = request(id);
                let mut prompt = r.request.prompt.to_vec();
                for (i, t) in prompt.iter_mut().take(8).enumerate() {
                    *t = (id / 3u64.pow(i as u32) % 3) as u32;
                }
                r.request.prompt = prompt.into();
                r
            };
            for id in 1..=300u64 {
                scheduler.do_send(Submit(vec![distinct(id)]));
                if next() % 3 != 0 {
                    // Abort this one or an earlier one after a few scheduler turns.
                    let target = id - next() % id.min(4);
                    for _ in 0..next() % 4 {
                        scheduler.send(GetStats).await.unwrap();
                    }
                    scheduler.do_send(Finish(vec![(RequestId(target), FinishReason::Abort)]));
                    aborted.push(target);
                }
            }
            wait_until_idle(&scheduler, &fed, 0).await;
            let fed = fed.lock().unwrap();
            assert_eq!(fed.get(&EMPTY_BATCHES), None, "an empty batch ran");
            for id in (1..=300u64).filter(|i| !aborted.contains(i)) {
                // 10 prompt tokens and 5 decode steps at least (more if it was preempted and
                // recomputed).
                let n = fed.get(&id).copied().unwrap_or(0);
                assert!(
                    n >= 15,
                    "request {id} (async {async_scheduling}) was fed {n} tokens, not run to its end"
                );
            }
        }
    }
}
