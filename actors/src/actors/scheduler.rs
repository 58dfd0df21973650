//! The scheduler actor: owns the scheduling core ([`StepCore`]) and drives steps, one executor
//! round trip and one detokenizer message per step.

use std::time::Instant;

use actix::{Actor, ActorFutureExt, Addr, AsyncContext, Context, Handler, Message, WrapFuture};
use switchyard_policies::{FinishReason, Policy, RequestId, SchedulerStats, Timestamp};

use super::detokenizer::{DetokenizerActor, StepEvents};
use super::executor::{Execute, ExecutorActor};
use crate::core::{StepCore, SubmitOptions};
use crate::EngineError;

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

/// Asks for queue and cache statistics.
#[derive(Message)]
#[rtype(result = "SchedulerStats")]
pub struct GetStats;

/// Owns the core and the step loop.
pub struct SchedulerActor {
    core: StepCore,
    executor: Addr<ExecutorActor>,
    detokenizer: Addr<DetokenizerActor>,
    /// A step is in flight on the executor.
    stepping: bool,
    /// Origin of the engine clock passed to the core.
    origin: Instant,
    /// A policy swap waiting for the step in flight to end.
    pending_swap: Option<Box<dyn Policy>>,
}

impl SchedulerActor {
    /// Builds the actor around a core.
    pub fn new(
        core: StepCore,
        executor: Addr<ExecutorActor>,
        detokenizer: Addr<DetokenizerActor>,
    ) -> Self {
        Self {
            core,
            executor,
            detokenizer,
            stepping: false,
            origin: Instant::now(),
            pending_swap: None,
        }
    }

    fn now(&self) -> Timestamp {
        Timestamp(self.origin.elapsed().as_micros() as u64)
    }

    fn publish_stats(&self) {
        let s = self.core.stats();
        metrics::gauge!("switchyard:num_requests_running").set(s.num_running as f64);
        metrics::gauge!("switchyard:num_requests_waiting").set(s.num_waiting as f64);
        metrics::gauge!("switchyard:kv_cache_usage_perc").set(s.kv_usage);
        metrics::counter!("switchyard:prefix_cache_queries_total").absolute(s.prefix_queries);
        metrics::counter!("switchyard:prefix_cache_hits_total").absolute(s.prefix_hits);
        metrics::counter!("switchyard:num_preemptions_total").absolute(s.num_preemptions);
    }

    /// Starts a step unless one is in flight or there is nothing to do.
    fn kick(&mut self, ctx: &mut Context<Self>) {
        if self.stepping {
            return;
        }
        if let Some(policy) = self.pending_swap.take() {
            let old = self.core.swap_policy(policy);
            tracing::info!(from = old.name(), "scheduling policy swapped");
        }
        if !self.core.has_unfinished() {
            self.publish_stats();
            return;
        }
        let now = self.now();
        let step_start = Instant::now();
        let prepared = match self.core.prepare(now) {
            Ok(Some(p)) => p,
            Ok(None) => {
                self.publish_stats();
                return;
            }
            Err(e) => {
                tracing::error!(error = %e, "planning a step failed");
                return;
            }
        };
        self.stepping = true;
        for q in &prepared.queue_times_us {
            metrics::histogram!("switchyard:request_queue_time_seconds").record(*q as f64 / 1e6);
        }
        metrics::histogram!("switchyard:engine_plan_seconds").record(prepared.plan_us as f64 / 1e6);
        let plan = prepared.plan;
        let fut = self.executor.send(Execute {
            batch: prepared.batch,
            release: prepared.release,
        });
        ctx.spawn(fut.into_actor(self).map(move |result, act, ctx| {
            act.stepping = false;
            let executed = match result {
                Ok(Ok(executed)) => executed,
                Ok(Err(e)) => {
                    // A backend failure fails the requests of this step rather than the server.
                    tracing::error!(error = %e, "executing a step failed; aborting its requests");
                    let ids: Vec<RequestId> = plan.seqs.iter().map(|s| s.id).collect();
                    for id in &ids {
                        act.core.abort(*id);
                    }
                    act.detokenizer
                        .do_send(StepEvents::failed(ids, e.to_string()));
                    ctx.notify(Kick);
                    return;
                }
                Err(e) => {
                    tracing::error!(error = %e, "the executor is gone");
                    return;
                }
            };
            let now = act.now();
            let events = act.core.complete(&plan, executed.outputs, now);
            act.publish_stats();
            act.detokenizer.do_send(StepEvents::new(events));
            // The engine's own cost of this step: planning, the executor round trip, applying
            // outputs and handing them to the detokenizer, without the model's time.
            let total_us = step_start.elapsed().as_micros() as u64;
            metrics::histogram!("switchyard:engine_step_overhead_seconds")
                .record(total_us.saturating_sub(executed.execute_us) as f64 / 1e6);
            metrics::gauge!("switchyard:engine_batch_size").set(plan.seqs.len() as f64);
            act.kick(ctx);
        }));
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

impl Handler<Submit> for SchedulerActor {
    type Result = Result<(), EngineError>;

    fn handle(&mut self, msg: Submit, ctx: &mut Context<Self>) -> Self::Result {
        let mut added = Vec::with_capacity(msg.0.len());
        let now = self.now();
        for mut submit in msg.0 {
            // Arrival on the engine clock: policies order, age and set deadlines by it.
            submit.request.arrival = now;
            let id = submit.request.id;
            if let Err(e) = self.core.add_request(submit) {
                // All choices of a request go in together or not at all.
                for id in added {
                    self.core.abort(id);
                }
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
        for (id, reason) in msg.0 {
            self.core.finish(id, reason);
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

impl Handler<GetStats> for SchedulerActor {
    type Result = actix::MessageResult<GetStats>;
    fn handle(&mut self, _: GetStats, _: &mut Context<Self>) -> Self::Result {
        actix::MessageResult(self.core.stats())
    }
}
