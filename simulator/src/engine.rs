//! The discrete-event loop: a virtual clock in microseconds drives the real
//! scheduling core (`switchyard_policies::Scheduler`) step by step.
//!
//! Events are request arrivals, requests leaving the front end (the server's time per request
//! outside its steps, [`crate::front_end`]: 0 unless a spec or calibration sets it), step
//! completions and a spec's `changes` ([`crate::changes`]: a policy swap, or what a reload
//! applies, made at the first step boundary from its time). The requests that arrive during a step are checked against their rate limits
//! and bounds before the step's outputs are applied (the seats its finished requests hold are
//! theirs until it ends, as on the server); at each step boundary the loop checks every
//! request that has arrived since, queues every one whose front-end time has passed, asks the
//! scheduler for a plan at `now`, costs the plan with the [`CostModel`], advances the clock by
//! that cost and applies one invented (deterministic) token per sampling sequence at the step's
//! end time. When nothing can run the clock jumps to the next arrival or queueing. This is
//! the iteration-level structure of Vidur (Agrawal et al., MLSys'24) with the scheduler
//! itself, not a model of it, in the loop.
//!
//! Same inputs and seed give byte-identical outputs: no wall clock, no hash
//! map iteration, requests identified by their trace index.

use crate::changes::{AppliedChange, TimedChange};
use crate::cost::{kv_capacity_blocks, Calibration, CostModel, HardwareSpec, ModelSpec};
use crate::error::SimError;
use crate::front_end::FrontEnd;
use crate::lora_memory::{LoraMemory, MemoryConfig};
use crate::progress::Progress;
use crate::report::{RequestRecord, RunCounters};
use crate::slo_params::{ParamsFromCalibration, SloAwareParams};
use crate::spec::{PolicySpec, ProcessKind, SimulationSpec, TierConf};
use crate::trace::{self, ArrivalProcess, LoadOptions, TraceFormat, TraceRequest};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use switchyard_policies::rate_limit::TenantBudget;
use switchyard_policies::{
    DraftSource, PolicyRegistry, Request, RequestId, SamplingLimits, Scheduler, SchedulerConfig,
    SeqEvent, SeqView, SloTargets, SpeculativeConfig, StepOutput, StepPlan, Timestamp, TokenId,
};

/// Requests sampled (evenly over the trace) to estimate capacity.
const CAPACITY_SAMPLE: usize = 2000;
/// Consecutive empty plans with nothing left to arrive before the run is declared stalled.
const MAX_IDLE_TICKS: u32 = 100_000;
/// Virtual time that passes on an empty plan with nothing left to arrive.
const IDLE_TICK_US: u64 = 1_000;
/// Most scheduler-time samples kept per run (older ones are merged two by two).
const MAX_SAMPLES: usize = 1 << 16;
/// The latest virtual time a run may reach, in microseconds (2^53: ~285 years, every time
/// still exact as an f64). Only step costs far outside any real device's (a calibration or
/// cost model near its bounds) get there; the run stops with an error rather than saturate
/// its clock and report wrong latencies.
const MAX_CLOCK_US: u64 = 1 << 53;

/// One snapshot of the scheduler after a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepSample {
    /// Virtual time in seconds.
    pub t_s: f64,
    /// Waiting requests.
    pub waiting: u32,
    /// Running requests.
    pub running: u32,
    /// KV usage (0..1).
    pub kv_usage: f64,
}

/// The raw result of simulating one policy.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyRun {
    /// Policy label.
    pub label: String,
    /// The registered name of the policy the run started with.
    pub policy_name: String,
    /// One record per trace request, in trace order.
    pub records: Vec<RequestRecord>,
    /// Every inter-token gap, in ms: one per step that brings a request tokens (after its
    /// first), so the tokens of a speculative step count once.
    pub itls_ms: Vec<f64>,
    /// Scheduler snapshots over time (thinned to at most 65,536).
    pub samples: Vec<StepSample>,
    /// Scheduler counters.
    pub counters: RunCounters,
    /// The `slo-aware` parameters the run took from the calibration, where its spec left
    /// them unset ([`crate::slo_params`]).
    pub params_from_calibration: Option<ParamsFromCalibration>,
    /// What the LoRA adapters' host memory did (`scheduler.lora_memory`; `None` without it).
    pub lora_memory: Option<crate::report::LoraMemorySummary>,
    /// What the host KV tier did (`cache.kv_offloading_size`; `None` without one).
    pub host_kv: Option<crate::report::HostKvSummary>,
    /// The spec's `changes`, as the run applied them, in time order (empty without any).
    pub changes: Vec<AppliedChange>,
}

/// A spec resolved into the pieces the loop needs.
#[derive(Clone, Debug)]
pub struct Simulation {
    /// The spec it came from.
    pub spec: SimulationSpec,
    /// The step-cost model.
    pub cost: CostModel,
    /// The model shape.
    pub model: ModelSpec,
    /// The hardware.
    pub hardware: HardwareSpec,
    /// The scheduler configuration used for every policy.
    pub scheduler: SchedulerConfig,
    /// The host's time per step in microseconds: the spec's, else the calibration's, else 0.
    pub host_overhead_us: f64,
    /// Each request's time in the front end before it is queued: the spec's parts, else the
    /// calibration's, else 0.
    pub front_end: FrontEnd,
    /// What the spec allows but an operator should know (a calibration fitted on another
    /// model); the command prints them on stderr and the summary keeps them.
    pub warnings: Vec<String>,
    /// With a calibration: its file, as the spec names it, and the `slo-aware` parameters
    /// its fit implies, for a `slo-aware` policy whose spec leaves them unset.
    pub slo_aware: Option<(String, SloAwareParams)>,
    /// The LoRA adapters' host memory (`scheduler.lora_memory`) and where its load time
    /// came from ("the spec", or "calibration FILE"); `None`: every adapter is always in
    /// memory.
    pub lora_memory: Option<(MemoryConfig, String)>,
    /// Device time of one block's copy from the device to the host KV tier, in
    /// microseconds (`block_bytes / cache.host_bandwidth_gb_s`).
    pub host_offload_us_per_block: f64,
    /// Device time of one block's copy from the host KV tier back to the device, in
    /// microseconds (`block_bytes / cache.host_load_bandwidth_gb_s`, which defaults to
    /// `host_bandwidth_gb_s`).
    pub host_load_us_per_block: f64,
    /// The spec's `changes`, resolved, in time order ([`crate::changes`]).
    pub changes: Vec<TimedChange>,
}

/// Bytes in a GiB (`cache.kv_offloading_size`).
const GIB: f64 = (1u64 << 30) as f64;

/// A step's copies to and from the host KV tier, in microseconds of device time.
#[derive(Clone, Copy, Debug, PartialEq)]
struct HostCopyUs {
    /// To the host tier.
    offload: f64,
    /// Back to the device.
    load: f64,
    /// Both: the time added to the step.
    total: f64,
}

/// The copy engine of the stores ahead of eviction ([`StepPlan::kv_stores`],
/// `cache.kv_offloading_ahead`), as the CUDA backend's stream of its own: a step's stores
/// start once its own copies are done and run alongside its compute; the next step (its
/// copies and compute) starts once they are done. Times are whole microseconds on the
/// loop's clock.
#[derive(Clone, Debug, Default)]
struct StoreEngine {
    /// When the last step's stores are done (0: none yet).
    busy_until: u64,
    /// Device time of all stores, in microseconds.
    busy_us: f64,
    /// Time steps waited for the stores of the step before, in microseconds.
    stall_us: u64,
    /// Stores of plans that ran no step, made before the next step's copies and priced with
    /// them (the server's engine makes them at once: a later plan may evict their blocks).
    carried: usize,
}

impl StoreEngine {
    /// When a step ready at `ready` starts: once the stores of the step before are done;
    /// the wait past `ready` is a stall.
    fn wait(&mut self, ready: u64) -> u64 {
        let start = ready.max(self.busy_until);
        self.stall_us += start - ready;
        start
    }

    /// Starts the stores of a step starting at `start` whose own copies take `copy_us`:
    /// `store_us` of them.
    fn start(&mut self, start: u64, copy_us: f64, store_us: f64) {
        if store_us > 0.0 {
            self.busy_until = start.saturating_add((copy_us + store_us).round() as u64);
            self.busy_us += store_us;
        }
    }

    /// Keeps the stores of a plan that runs no step for the next step.
    fn carry(&mut self, plan: &StepPlan) {
        self.carried += plan.kv_stores.len();
    }
}

/// A loaded workload.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// Requests sorted by arrival.
    pub requests: Vec<TraceRequest>,
    /// Capacity estimate (requests/s) when a load fraction was asked for.
    pub estimated_capacity_rps: Option<f64>,
}

impl Simulation {
    /// The device time of a step's `offloads` and `loads` (blocks) to and from the host tier.
    fn host_copies_us(&self, offloads: usize, loads: usize) -> HostCopyUs {
        let (off, load) = (self.host_offload_us_per_block, self.host_load_us_per_block);
        let split = HostCopyUs {
            offload: offloads as f64 * off,
            load: loads as f64 * load,
            total: 0.0,
        };
        // One rate for both directions (the default): the sum of the blocks times the rate,
        // which is how it was computed before the rates were split, so that a spec without
        // `host_load_bandwidth_gb_s` times its steps to the same microsecond as then
        // (`a * x + b * x` may differ from `(a + b) * x` in the last bit).
        let total = if off == load {
            (offloads + loads) as f64 * off
        } else {
            split.offload + split.load
        };
        HostCopyUs { total, ..split }
    }

    /// Resolves presets, the calibration file and the KV capacity.
    pub fn new(spec: &SimulationSpec) -> Result<Self, SimError> {
        // Errors below name the spec's file ("<cli>" for flags).
        let cli = spec.source();
        let model = spec.model_spec().map_err(|m| SimError::spec(cli, m))?;
        let hardware = spec.hardware_spec().map_err(|m| SimError::spec(cli, m))?;
        let calibration = spec
            .calibration
            .as_ref()
            .map(|path| Calibration::load(path).map(|c| (path, c)))
            .transpose()?;
        let cost = match &calibration {
            Some((_, c)) => CostModel::Calibrated(c.clone()),
            None => CostModel::Roofline {
                model: model.clone(),
                hardware: hardware.clone(),
                lora: spec.scheduler.lora.clone(),
            },
        };
        let mut warnings = Vec::new();
        if let Some((path, cal)) = &calibration {
            if let Some(other) = cal
                .model
                .as_deref()
                .filter(|_| !cal.is_for_model(&model.name))
            {
                let on = cal
                    .hardware
                    .as_deref()
                    .map(|h| format!(" on {h}"))
                    .unwrap_or_default();
                warnings.push(format!(
                    "calibration {} was fitted on model `{other}`{on}, not on the spec's `{}`: \
                     the simulated step times are that model's",
                    path.display(),
                    model.name
                ));
            }
        }
        let c = &spec.cache;
        if let Some((path, n)) = calibration
            .as_ref()
            .and_then(|(path, cal)| Some((path, cal.block_size?)))
            .filter(|&(_, n)| n != c.block_size)
        {
            return Err(SimError::spec(
                cli,
                format!(
                    "calibration {} was measured on an engine with blocks of {n} tokens: set \
                     cache.block_size to {n} (it is {}), or the cache would hold another \
                     number of tokens",
                    path.display(),
                    c.block_size
                ),
            ));
        }
        let host_overhead_us = spec
            .scheduler
            .host_overhead_us
            .or_else(|| calibration.as_ref().and_then(|(_, c)| c.host_overhead_us))
            .unwrap_or(0.0);
        let cal = calibration.as_ref().map(|(_, c)| c);
        let front_end = FrontEnd {
            fixed_us: (spec.scheduler.front_end_us)
                .or_else(|| cal.and_then(|c| c.front_end_us))
                .unwrap_or(0.0),
            per_token_us: (spec.scheduler.front_end_per_token_us)
                .or_else(|| cal.and_then(|c| c.front_end_per_token_us))
                .unwrap_or(0.0),
        };
        let num_gpu_blocks = match (
            c.num_gpu_blocks,
            calibration.as_ref().map(|(p, c)| (p, c.num_gpu_blocks)),
        ) {
            (Some(n), _) | (None, Some((_, Some(n)))) => n,
            // The calibrated engine's memory is not the hardware preset's (a CPU fit would get
            // an H200's 141 GB of cache): its capacity must be given.
            (None, Some((path, None))) => {
                return Err(SimError::spec(
                    cli,
                    format!(
                        "calibration {}: step times come from the calibration file, so the KV \
                         capacity cannot come from the `{}` hardware preset: set \
                         cache.num_gpu_blocks to the KV blocks of the engine that was calibrated \
                         (a file `switchyard calibrate` writes carries them)",
                        path.display(),
                        hardware.name
                    ),
                ))
            }
            (None, None) => {
                kv_capacity_blocks(&model, &hardware, c.gpu_memory_utilization, c.block_size)
                    .filter(|n| *n > 0)
                    .ok_or_else(|| {
                        SimError::spec(
                            cli,
                            format!("{} does not fit in {} memory", model.name, hardware.name),
                        )
                    })?
                    .min(1 << 26)
            }
        };
        // The host KV tier: the model's KV bytes per block give its blocks and a copy's time.
        let block_bytes = model.kv_bytes_per_token() * c.block_size as f64;
        let num_host_blocks = match c.num_host_blocks {
            Some(n) => n,
            None if c.kv_offloading_size > 0.0 => {
                if block_bytes.is_nan() || block_bytes <= 0.0 {
                    return Err(SimError::spec(
                        cli,
                        format!(
                            "cache.kv_offloading_size: the model `{}` has no KV bytes per \
                             block to size the host tier with; set cache.num_host_blocks",
                            model.name
                        ),
                    ));
                }
                ((c.kv_offloading_size * GIB / block_bytes).floor() as usize)
                    .min(switchyard_policies::scheduler::MAX_HOST_BLOCKS)
            }
            None => 0,
        };
        if num_host_blocks > 0 && !c.prefix_caching {
            warnings.push(
                "cache.kv_offloading_size / num_host_blocks: prefix caching is off, so no \
                 block is ever cached, offloaded or found in the host tier"
                    .into(),
            );
        }
        let host_offload_us_per_block = block_bytes / (c.host_bandwidth_gb_s * 1e9) * 1e6;
        let host_load_us_per_block = block_bytes / (c.host_load_bandwidth() * 1e9) * 1e6;
        let max_model_len = fit_max_model_len(
            spec.scheduler.max_model_len,
            &model,
            num_gpu_blocks,
            c.block_size,
            spec.scheduler.max_num_batched_tokens,
        )
        .map_err(|m| SimError::spec(cli, m))?;
        let tiers = crate::spec::tier_specs(&spec.tiers);
        let scheduler = SchedulerConfig {
            max_num_seqs: spec.scheduler.max_num_seqs,
            max_num_batched_tokens: spec.scheduler.max_num_batched_tokens,
            block_size: c.block_size,
            num_gpu_blocks,
            enable_prefix_caching: c.prefix_caching,
            max_model_len,
            tiers,
            // Traces carry no prompt-logprob requests.
            max_logit_rows: usize::MAX,
            max_loras: spec.scheduler.max_loras,
            // The simulator invents its output tokens, so drafts by prompt lookup would say
            // nothing about a real workload: drafts are its invented tokens, accepted at the
            // configured rate (`InventedDrafts`).
            speculative: spec
                .scheduler
                .speculative
                .as_ref()
                .map(|s| SpeculativeConfig {
                    num_speculative_tokens: s.num_speculative_tokens,
                    max_running: s.max_running,
                    ..SpeculativeConfig::default()
                }),
            sliding_window: model.window(),
            max_queue_ms: spec.scheduler.max_queue_ms,
            // Priced on a copy engine of their own (`Loop::start_step`).
            kv_offload_ahead: c.kv_offloading_ahead,
            num_host_blocks,
        };
        switchyard_policies::validate_config(&scheduler)
            .map_err(|e| SimError::Scheduler(e.to_string()))?;
        let slo_aware = calibration.as_ref().map(|(path, c)| {
            (
                path.display().to_string(),
                SloAwareParams::from_calibration(c, spec.scheduler.max_num_seqs),
            )
        });
        // Fail on an unknown policy or bad parameters before any trace is read.
        let registry = PolicyRegistry::with_builtins();
        for p in &spec.policies {
            let (params, _) = policy_params(p, slo_aware.as_ref());
            registry
                .create(&p.name, &params, &scheduler.tiers)
                .map_err(|e| SimError::Policy {
                    path: spec.source().to_path_buf(),
                    name: p.name.clone(),
                    message: e.to_string(),
                })?;
        }
        let changes = crate::changes::timed(&spec.changes, &spec.tiers)
            .map_err(|r| spec.change_refused(&r))?;
        check_changes(spec, &changes, &scheduler, &registry, slo_aware.as_ref())?;
        let lora_memory = match &spec.scheduler.lora_memory {
            None => None,
            Some(m) => {
                let (load_ms, from) = match (m.load_ms, &calibration) {
                    (Some(ms), _) => (ms, "the spec".to_string()),
                    (None, Some((path, c))) if c.lora_load_ms.is_some() => (
                        c.lora_load_ms.unwrap_or(0.0),
                        format!("calibration {}", path.display()),
                    ),
                    _ => {
                        return Err(SimError::spec(
                            cli,
                            "scheduler.lora_memory.load_ms: set the time to read one adapter \
                             from its files, or give a calibration with lora_load_ms \
                             (`switchyard calibrate --lora DIR` measures it)",
                        ))
                    }
                };
                let config = MemoryConfig {
                    max_cpu_loras: m.max_cpu_loras,
                    pinned: m.pinned.iter().copied().collect(),
                    registered: m.registered.clone(),
                    // Validated within 0..=600,000 ms.
                    load_us: (load_ms * 1e3).round() as u64,
                    max_adapters: m.max_adapters,
                };
                Some((config, from))
            }
        };
        Ok(Simulation {
            changes,
            lora_memory,
            spec: spec.clone(),
            cost,
            model,
            hardware,
            scheduler,
            host_overhead_us,
            front_end,
            warnings,
            slo_aware,
            host_offload_us_per_block,
            host_load_us_per_block,
        })
    }

    /// Loads the trace and shapes it: tier/tenant mix, time scale, rate or load.
    pub fn load_workload(&self) -> Result<Workload, SimError> {
        let w = &self.spec.workload;
        let options = LoadOptions {
            limit: w.limit,
            start_s: w.start_s,
            end_s: w.end_s,
            // As the server refuses a tier its configuration does not define: with no tiers
            // defined, every tier a trace names is an error (the README's rule), not a label
            // that silently gets no targets and no priority. A tier a change defines is
            // known; whether it is in force at the request's arrival is checked below.
            known_tiers: Some(
                self.spec
                    .tiers
                    .keys()
                    .chain(
                        self.changes
                            .iter()
                            .flat_map(|c| c.tiers.iter().flatten().map(|t| t.0)),
                    )
                    .cloned()
                    .collect(),
            ),
        };
        let arrival = w.arrival.clone().unwrap_or_default();
        let mut requests = if w.format == TraceFormat::Sharegpt {
            // The spec requires a rate or a load for sharegpt: with a load, arrivals are
            // generated at one request per second and rescaled below.
            let rate = arrival.rate.unwrap_or(1.0);
            let process = match arrival.process.unwrap_or(ProcessKind::Poisson) {
                ProcessKind::Poisson => ArrivalProcess::Poisson { rate },
                ProcessKind::Gamma => ArrivalProcess::Gamma {
                    rate,
                    cv: arrival.cv.unwrap_or(1.0),
                },
            };
            trace::load_sharegpt(
                trace::open_trace(&w.trace)?,
                &w.trace,
                &options,
                &process,
                self.spec.seed,
            )?
        } else {
            trace::load_trace(&w.trace, w.format, &options)?
        };
        if requests.is_empty() {
            let why = if w.start_s.is_some() || w.end_s.is_some() {
                "no request of the trace lies in the window given by workload.start_s/end_s"
            } else {
                "the trace has no requests"
            };
            return Err(SimError::spec(&w.trace, why));
        }
        let outputs: u64 = requests.iter().map(|r| u64::from(r.output_len)).sum();
        if outputs > trace::MAX_TOTAL_OUTPUT_TOKENS {
            return Err(SimError::spec(
                &w.trace,
                format!(
                    "the trace asks for {outputs} output tokens, more than {} (each is \
                     simulated and its latency kept); use workload.limit or a shorter window",
                    trace::MAX_TOTAL_OUTPUT_TOKENS
                ),
            ));
        }
        trace::assign_mix(
            &mut requests,
            &w.mix.tier_mix(),
            &w.mix.tenant_mix(),
            self.spec.seed,
        )
        .map_err(|m| SimError::spec(self.spec.source(), format!("workload.mix.{m}")))?;
        if let Some(a) = &w.adapters {
            trace::assign_adapters(&mut requests, &a.weights(), a.fraction, self.spec.seed)
                .map_err(|m| SimError::spec(self.spec.source(), format!("workload.{m}")))?;
        }
        if let Some(f) = w.time_scale {
            // Divides, as `simulate --time-scale` and `bench serve --time-scale`: 2 replays
            // the trace twice as fast.
            trace::scale_time(&mut requests, 1.0 / f);
        }
        let mut estimated_capacity_rps = None;
        let shape_err = |m: String| SimError::spec(&w.trace, m);
        if w.format != TraceFormat::Sharegpt {
            if let Some(rate) = arrival.rate {
                trace::rescale_to_rate(&mut requests, rate).map_err(shape_err)?;
            }
        }
        if let Some(load) = arrival.load {
            let capacity = self.estimate_capacity(&requests)?;
            estimated_capacity_rps = Some(capacity);
            if w.format == TraceFormat::Sharegpt {
                // Generated at one request per second: gaps scale linearly with 1/rate.
                trace::scale_time(&mut requests, 1.0 / (load * capacity));
            } else {
                trace::rescale_to_rate(&mut requests, load * capacity).map_err(shape_err)?;
            }
        }
        // A tiny rate or load, or a huge time scale, can push arrivals past what the clock
        // holds.
        trace::check_arrivals(&requests).map_err(shape_err)?;
        // In the simulation's seconds, after the shaping: the spec's think times and start
        // jitter are no part of the trace's timeline.
        if let Some(c) = &w.clients {
            let draws = trace::ClientDraws {
                think_s: c.think_s,
                constant: c.think == crate::spec::ThinkKind::Constant,
                start_jitter_s: c.start_jitter_s,
            };
            trace::assign_clients(&mut requests, &draws, self.spec.seed);
        }
        self.check_workload(&requests)?;
        Ok(Workload {
            requests,
            estimated_capacity_rps,
        })
    }

    /// Capacity in requests/s: the throughput of `fcfs` when an even sample of
    /// up to 2,000 requests all arrive at once (saturation throughput).
    pub fn estimate_capacity(&self, requests: &[TraceRequest]) -> Result<f64, SimError> {
        let stride = requests.len().div_ceil(CAPACITY_SAMPLE).max(1);
        let sample: Vec<TraceRequest> = requests
            .iter()
            .step_by(stride)
            .map(|r| TraceRequest {
                arrival_s: 0.0,
                // All at once: no client waits for its requests before.
                client: String::new(),
                ..r.clone()
            })
            .collect();
        // The engine's capacity: adapters all in memory (loads are no step's work).
        let run = self.run_policy_with(
            &PolicySpec::named("fcfs"),
            &sample,
            false,
            RunKind::CapacityEstimate,
        )?;
        if sample.is_empty() {
            return Err(SimError::Scheduler(
                "capacity estimate: the trace has no requests".into(),
            ));
        }
        let finished = run.records.iter().filter(|r| r.finish_s.is_some()).count();
        let makespan = run
            .records
            .iter()
            .filter_map(|r| r.finish_s)
            .fold(0.0, f64::max);
        if finished == 0 || makespan <= 0.0 {
            return Err(SimError::Scheduler(format!(
                "capacity estimate: none of the {} sampled requests finished (each longer \
                 than max_model_len {}?)",
                sample.len(),
                self.scheduler.max_model_len
            )));
        }
        Ok(finished as f64 / makespan)
    }

    /// Simulates `requests` (sorted by arrival) under one policy.
    pub fn run_policy(
        &self,
        policy: &PolicySpec,
        requests: &[TraceRequest],
        progress: bool,
    ) -> Result<PolicyRun, SimError> {
        self.run_policy_with(policy, requests, progress, RunKind::Full)
    }

    /// [`Simulation::run_policy`] as `kind` says: the spec's whole model, or the capacity
    /// estimate's (every adapter in memory, no changes).
    fn run_policy_with(
        &self,
        policy: &PolicySpec,
        requests: &[TraceRequest],
        progress: bool,
        kind: RunKind,
    ) -> Result<PolicyRun, SimError> {
        let full = kind == RunKind::Full;
        let changes: &[TimedChange] = if full { &self.changes } else { &[] };
        if full {
            self.check_workload(requests)?;
        }
        let (boxed, params_from_calibration) = self.build_policy(policy)?;
        let key = [
            trace::mix64(self.spec.seed ^ 0x5357_4954_4348),
            trace::mix64(self.spec.seed.wrapping_add(1)),
        ];
        let mut sched = Scheduler::new(self.scheduler.clone(), boxed, key)
            .map_err(|e| SimError::Scheduler(e.to_string()))?;
        sched.set_draft_source(Some(Box::new(InventedDrafts)));
        let progress = policy_progress(progress, requests.len(), policy.label());
        let mut lp = Loop::new(self, sched, requests, policy, changes);
        if full {
            lp.memory = self
                .lora_memory
                .as_ref()
                .map(|m| LoraMemory::new(m.0.clone()));
        }
        let result = if self.spec.scheduler.async_scheduling {
            lp.run_async(&progress)
        } else {
            lp.run(&progress)
        };
        result?;
        progress.finish();
        Ok(PolicyRun {
            params_from_calibration,
            ..lp.into_run()
        })
    }

    /// Refuses `requests` (as shaped) where the spec's changes do not fit them: a change
    /// after the last arrival, a request naming a tier not in force at its arrival
    /// ([`crate::changes::check_workload`]); the error names the change's line.
    fn check_workload(&self, requests: &[TraceRequest]) -> Result<(), SimError> {
        let arrivals = requests.iter().map(|r| (r.arrival_s, r.tier.as_str()));
        crate::changes::check_workload(&self.spec.changes, &self.spec.tiers, arrivals)
            .map_err(|r| self.spec.change_refused(&r))
    }

    /// Builds `policy` with the parameters it runs with ([`policy_params`]) and the spec's
    /// tiers, as the server's registry builds it; returns the calibration's figures taken.
    fn build_policy(&self, policy: &PolicySpec) -> Result<BuiltPolicy, SimError> {
        self.build_policy_with(policy, &self.scheduler.tiers)
    }

    /// [`Simulation::build_policy`] with `tiers` (those a change put in force).
    fn build_policy_with(
        &self,
        policy: &PolicySpec,
        tiers: &[switchyard_policies::TierSpec],
    ) -> Result<BuiltPolicy, SimError> {
        let (params, taken) = policy_params(policy, self.slo_aware.as_ref());
        let boxed = PolicyRegistry::with_builtins()
            .create(&policy.name, &params, tiers)
            .map_err(|e| SimError::Policy {
                path: self.spec.source().to_path_buf(),
                name: policy.name.clone(),
                message: e.to_string(),
            })?;
        Ok((boxed, taken))
    }
}

/// What a run models.
#[derive(Clone, Copy, PartialEq, Eq)]
enum RunKind {
    /// The spec's whole model: the LoRA adapters' host memory (`scheduler.lora_memory`, when
    /// the spec sets it) and its `changes`.
    Full,
    /// The capacity estimate's: every adapter in memory, and the server as it starts (no
    /// changes).
    CapacityEstimate,
}

/// A policy built for a run, and the calibration's figures its parameters took.
type BuiltPolicy = (
    Box<dyn switchyard_policies::Policy>,
    Option<ParamsFromCalibration>,
);

/// The parameters `policy` runs with: its spec's, with the `slo-aware` parameters it leaves
/// unset taken from the calibration's `slo_aware` (its file and the parameters its fit
/// implies), and what was taken.
fn policy_params(
    policy: &PolicySpec,
    slo_aware: Option<&(String, SloAwareParams)>,
) -> (serde_yaml::Value, Option<ParamsFromCalibration>) {
    match slo_aware.and_then(|(path, p)| crate::slo_params::fill_in(policy, p, path)) {
        Some((params, taken)) => (params, Some(taken)),
        None => (policy.params.clone(), None),
    }
}

/// The longest sequence served, as the server's `serve` decides it: `scheduler.max_model_len`
/// when set, which may exceed neither the model's context nor what the KV cache holds; else the
/// model's context, lowered to what the KV cache holds.
fn fit_max_model_len(
    configured: Option<usize>,
    model: &ModelSpec,
    num_gpu_blocks: usize,
    block_size: usize,
    max_num_batched_tokens: usize,
) -> Result<usize, String> {
    let context = model
        .max_position_embeddings
        .map_or(usize::MAX, |c| usize::try_from(c).unwrap_or(usize::MAX))
        .min(1 << 24);
    let capacity = switchyard_policies::kv_capacity_tokens(
        num_gpu_blocks,
        block_size,
        max_num_batched_tokens,
        model.window(),
    );
    match configured {
        Some(n) if n > context => Err(format!(
            "scheduler.max_model_len is {n}, more than the {context} tokens of context of model \
             {}: lower it to at most {context} or leave it out",
            model.name
        )),
        Some(n) if n > capacity => Err(format!(
            "scheduler.max_model_len is {n} tokens, more than the {capacity} tokens the KV cache \
             holds ({num_gpu_blocks} blocks of {block_size}): raise cache.num_gpu_blocks or \
             cache.gpu_memory_utilization, or lower scheduler.max_model_len"
        )),
        Some(n) => Ok(n),
        None => Ok(context.min(capacity)),
    }
}

/// Per-draft acceptance probabilities, indexed by the number of drafts `d` in a step (0..=16):
/// the `p` for which a run of drafts accepted from the first, each with probability `p` once
/// the ones before it were, accepts `rate * d` drafts on average, i.e.
/// `(p + p² + ... + p^d) / d = rate`. The run's accepted / draft tokens is then `rate` in
/// expectation however many drafts its steps carry, as the server reports it.
fn per_draft_probabilities(rate: f64) -> Vec<f64> {
    let rate = rate.clamp(0.0, 1.0);
    (0..=16usize)
        .map(|d| {
            if d <= 1 || rate == 0.0 || rate == 1.0 {
                return rate;
            }
            let mean = |p: f64| {
                let (mut sum, mut pow) = (0.0, 1.0);
                for _ in 0..d {
                    pow *= p;
                    sum += pow;
                }
                sum / d as f64
            };
            // `mean` increases from 0 to 1 on [0, 1]: bisect.
            let (mut lo, mut hi) = (0.0f64, 1.0f64);
            for _ in 0..64 {
                let mid = 0.5 * (lo + hi);
                if mean(mid) < rate {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            (0.5 * (lo + hi)).clamp(0.0, 1.0)
        })
        .collect()
}

/// A policy's run on stderr, with `progress`: a bar on a terminal, else plain lines.
fn policy_progress(progress: bool, len: usize, label: &str) -> Progress {
    if !progress {
        return Progress::hidden();
    }
    let bar = indicatif::ProgressBar::new(len as u64);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{prefix:>16} [{bar:40}] {pos}/{len} requests {elapsed}",
    ) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(label.to_string());
    Progress::on_stderr(&format!("simulate {label}"), "requests", bar)
}

/// Per-request progress, indexed by trace position.
#[derive(Clone, Copy, Default)]
struct Track {
    first_scheduled: Option<u64>,
    first_token: Option<u64>,
    last_token: Option<u64>,
    finish: Option<u64>,
    generated: u64,
    preemptions: u64,
    /// Prompt tokens the prefix cache served at its first admission.
    cached_prompt_tokens: u64,
    outcome: Outcome,
    /// Its tier's SLO targets and priority when it arrived ([`Loop::note_arrival`]): those
    /// it is queued with and judged by, whatever a change sets later.
    ttft_target_ms: Option<f64>,
    tpot_target_ms: Option<f64>,
    tier_priority: Option<i32>,
}

#[derive(Clone, Copy, Default, PartialEq)]
enum Outcome {
    #[default]
    Unfinished,
    Rejected,
    /// Refused by its tenant's rate limits (the server's 429).
    RateLimited,
    /// Refused at arrival by its tier's `max_pending_requests` (the server's 503
    /// `overloaded`).
    Overloaded,
    /// Refused at arrival by its tier's `max_pending_per_tenant`, or as it asked for its
    /// adapter by its tenant's share of adapter memory full of adapters in use
    /// (`max_cpu_loras_per_tenant`): the server's 429, reason `tenant_busy`.
    TenantBusy,
    /// Refused as it asked for its adapter, not registered, by a registry full of adapters
    /// in use or configured (pinned or `registered`, `lora_memory.max_adapters`): the
    /// server's 503, reason `unavailable`.
    Unavailable,
    Finished(switchyard_policies::FinishReason),
}

struct Loop<'a> {
    sim: &'a Simulation,
    sched: Scheduler,
    requests: &'a [TraceRequest],
    /// Per request, its arrival: the trace's, or for a client's request after its first, the
    /// later of that and the end of the client's request before it (set then).
    arrivals_us: Vec<u64>,
    /// Per request, the next request of its client (a trace's `client`), released when this
    /// one ends (after the next one's think time), and whether it waits so for one before it.
    successor: Vec<Option<usize>>,
    /// Per request, its think time in microseconds (0 where it has none).
    think_us: Vec<u64>,
    chained: Vec<bool>,
    /// The requests released by the end of their client's request before them and not arrived
    /// yet: (arrival, index). The others arrive in trace order (the cursor `next` of the
    /// loops, which skips the chained ones).
    released: BTreeSet<(u64, usize)>,
    /// The tiers in force at the front end (targets, priorities, rate limits and bounds of
    /// the requests arriving): the spec's, then those of the last change made by then
    /// ([`Loop::apply_front_changes`]; the server's HTTP layer and engine handle take a
    /// SIGHUP's tiers at once).
    tiers: &'a BTreeMap<String, TierConf>,
    /// The tiers the scheduler runs with: the spec's, then those of the last change applied
    /// at a step boundary ([`Loop::apply_changes`], as the server's scheduler actor takes
    /// its `SetTiers` between steps).
    sched_tiers: &'a BTreeMap<String, TierConf>,
    label: String,
    tracks: Vec<Track>,
    itls_ms: Vec<f64>,
    samples: Vec<StepSample>,
    sample_stride: usize,
    steps_since_sample: usize,
    steps: u64,
    kv_weighted: f64,
    kv_max: f64,
    last_sample: (u64, f64),
    /// Draws the acceptance of drafts (seeded: runs are reproducible).
    drafts_rng: ChaCha8Rng,
    /// Per-draft acceptance probability by drafts in the step ([`per_draft_probabilities`]).
    accept_p: Vec<f64>,
    draft_tokens: u64,
    accepted_tokens: u64,
    /// Device time of the steps' copies to and from the host KV tier, in microseconds.
    host_copy_us: f64,
    /// The part of `host_copy_us` spent copying to the host tier (offloads) and back
    /// (loads).
    host_offload_us: f64,
    host_load_us: f64,
    /// The copy engine that makes the stores ahead of eviction ([`StepPlan::kv_stores`]).
    stores: StoreEngine,
    /// The tenants' rate-limit budgets, as the server keeps them per (tier, tenant).
    budgets: Vec<TenantBudget>,
    budget_index: HashMap<(String, String), usize>,
    /// Per request, the budget its generated tokens are charged to (a limited tier's).
    budget_of: Vec<Option<usize>>,
    /// Requests in flight under the tiers' admission bounds, and whether each request holds
    /// a seat there (until it ends).
    in_flight: crate::in_flight::InFlight,
    holds_seat: Vec<bool>,
    /// Requests past their arrival's checks and still in the front end, by the time they
    /// reach the scheduler's queue (then by trace index): (ready time, index).
    front_end: BTreeSet<(u64, usize)>,
    /// As `front_end`, the requests the scheduler refuses (too long for the context, the
    /// cache or their tier's KV bound): refused as they leave the front end, during a step
    /// too, as the server's engine refuses them once their prompt is encoded, giving their
    /// seats back then.
    refused_at_queue: BTreeSet<(u64, usize)>,
    /// The LoRA adapters' host memory and its loader (`scheduler.lora_memory`; `None`: every
    /// adapter is always in memory).
    memory: Option<LoraMemory>,
    /// As `front_end`, the requests that leave the front end then and ask for their adapter
    /// (with `memory` only); once they hold it they go on to `front_end`, or to
    /// `refused_at_queue` where `to_refuse` says so (the server resolves the adapter of a
    /// request it then refuses too).
    resolving: BTreeSet<(u64, usize)>,
    to_refuse: Vec<bool>,
    /// Per request: when it asked for its adapter, and whether it holds it (until it ends).
    asked_at: Vec<Option<u64>>,
    holds_adapter: Vec<bool>,
    /// Per request, its wait for its adapter in microseconds, once it holds it.
    adapter_wait: Vec<Option<u64>>,
    /// The requests the memory serves or refuses, reused.
    answers: crate::lora_memory::Answers,
    /// The changes to make ([`Simulation::changes`]; none for the capacity estimate).
    changes: &'a [TimedChange],
    /// The next of `changes` to make at a step boundary (the scheduler's part).
    next_change: usize,
    /// The next of `changes` to make at the front end (the HTTP layer's part).
    next_front_change: usize,
    /// The policy in force, as written (the run's, then the changes').
    policy_in_force: PolicySpec,
    /// The policy of the server's file, which a SIGHUP puts in force: the run's, then the
    /// changes' `scheduler.policy`.
    file_policy: PolicySpec,
    /// The server's bound on requests in flight in force (`scheduler.max_pending_requests`,
    /// then the changes' `server.max_pending_requests`).
    max_pending: Option<usize>,
    /// The changes applied so far.
    applied: Vec<AppliedChange>,
    /// The registered name of the policy the run started with.
    policy_name: String,
}

/// The token the simulator invents at position `pos` of request `id`: deterministic in both,
/// never checked against a stop condition.
fn invented_token(id: RequestId, pos: usize) -> TokenId {
    trace::mix64(id.0 << 24 ^ pos as u64) as TokenId
}

/// Drafts for the simulator: the tokens it will invent at those positions (their acceptance
/// is drawn when the step runs).
struct InventedDrafts;

impl DraftSource for InventedDrafts {
    fn propose(&mut self, seq: SeqView<'_>, k: usize, out: &mut Vec<TokenId>) {
        let next = seq.prompt_len() + seq.num_output_tokens();
        out.extend((next..next + k).map(|p| invented_token(seq.id(), p)));
    }
}

impl<'a> Loop<'a> {
    fn new(
        sim: &'a Simulation,
        sched: Scheduler,
        requests: &'a [TraceRequest],
        policy: &PolicySpec,
        changes: &'a [TimedChange],
    ) -> Self {
        // A client's requests in arrival order: each after the one before it.
        let mut successor = vec![None; requests.len()];
        let mut chained = vec![false; requests.len()];
        let mut last: HashMap<&str, usize> = HashMap::new();
        for (i, r) in requests.iter().enumerate() {
            if r.client.is_empty() {
                continue;
            }
            if let Some(before) = last.insert(r.client.as_str(), i) {
                successor[before] = Some(i);
                chained[i] = true;
            }
        }
        Loop {
            sim,
            sched,
            requests,
            arrivals_us: requests
                .iter()
                .map(|r| Timestamp::from_secs_f64(r.arrival_s).0)
                .collect(),
            successor,
            think_us: requests
                .iter()
                .map(|r| Timestamp::from_secs_f64(r.think_s.unwrap_or(0.0)).0)
                .collect(),
            chained,
            released: BTreeSet::new(),
            tiers: &sim.spec.tiers,
            sched_tiers: &sim.spec.tiers,
            label: policy.label().to_string(),
            tracks: vec![Track::default(); requests.len()],
            itls_ms: Vec::new(),
            samples: Vec::new(),
            sample_stride: 1,
            steps_since_sample: 0,
            steps: 0,
            kv_weighted: 0.0,
            kv_max: 0.0,
            last_sample: (0, 0.0),
            drafts_rng: ChaCha8Rng::seed_from_u64(trace::mix64(sim.spec.seed ^ 0x0044_5241_4654)),
            accept_p: per_draft_probabilities(
                sim.spec
                    .scheduler
                    .speculative
                    .as_ref()
                    .map_or(0.0, |sp| sp.acceptance_rate),
            ),
            draft_tokens: 0,
            accepted_tokens: 0,
            host_copy_us: 0.0,
            host_offload_us: 0.0,
            host_load_us: 0.0,
            stores: StoreEngine::default(),
            budgets: Vec::new(),
            budget_index: HashMap::new(),
            budget_of: vec![None; requests.len()],
            in_flight: crate::in_flight::InFlight::default(),
            holds_seat: vec![false; requests.len()],
            front_end: BTreeSet::new(),
            refused_at_queue: BTreeSet::new(),
            memory: None,
            resolving: BTreeSet::new(),
            to_refuse: vec![false; requests.len()],
            asked_at: vec![None; requests.len()],
            holds_adapter: vec![false; requests.len()],
            adapter_wait: vec![None; requests.len()],
            answers: Default::default(),
            changes,
            next_change: 0,
            next_front_change: 0,
            policy_in_force: policy.clone(),
            file_policy: policy.clone(),
            max_pending: sim.spec.scheduler.max_pending_requests,
            applied: Vec::new(),
            policy_name: policy.name.clone(),
        }
    }

    /// Request `i` arrived: its tier's targets and priority then are those it is queued
    /// with and judged by.
    fn note_arrival(&mut self, i: usize) {
        let tier = self.tiers.get(&self.requests[i].tier);
        let t = &mut self.tracks[i];
        t.ttft_target_ms = tier.and_then(|c| c.ttft_ms);
        t.tpot_target_ms = tier.and_then(|c| c.tpot_ms);
        t.tier_priority = tier.map(|c| c.priority);
    }

    fn request(&self, i: usize) -> Request {
        let r = &self.requests[i];
        let t = &self.tracks[i];
        Request {
            id: RequestId(i as u64),
            tenant: r.tenant.clone(),
            tier: r.tier.clone(),
            priority: switchyard_policies::request_priority(r.priority, t.tier_priority),
            lora_adapter: r.adapter,
            arrival: Timestamp(self.arrivals_us[i]),
            slo: SloTargets {
                ttft_ms: t.ttft_target_ms,
                tpot_ms: t.tpot_target_ms,
            },
            prompt: r.prompt.clone(),
            limits: SamplingLimits {
                max_tokens: r.output_len,
                min_tokens: 0,
                stop_token_ids: Vec::new(),
                eos_token_id: None,
                ignore_eos: true,
                prompt_logits: false,
                speculate: true,
            },
            // As the server salts them: by tenant unless prefixes are shared globally (a
            // fixed hash: runs repeat exactly).
            cache_salt: (self.sim.spec.cache.prefix_sharing
                == switchyard_config::PrefixSharing::Tenant)
                .then(|| {
                    use std::hash::{Hash, Hasher};
                    let mut h = std::hash::DefaultHasher::new();
                    r.tenant.hash(&mut h);
                    h.finish() & !1
                }),
        }
    }

    fn run(&mut self, progress: &Progress) -> Result<(), SimError> {
        let mut now = 0u64;
        let mut next = 0usize;
        let mut idle_ticks = 0u32;
        let mut finished = 0usize;
        let mut plan = StepPlan::default();
        let mut outputs: Vec<StepOutput> = Vec::new();
        loop {
            self.apply_changes(now)?;
            finished += self.admit_arrivals(now, &mut next);
            if !self.sched.has_unfinished() {
                match self.next_event(next) {
                    Some(t) => {
                        now = now.max(t);
                        continue;
                    }
                    None => break,
                }
            }
            self.sched.schedule_into(Timestamp(now), &mut plan);
            finished += self.note_plan(&plan, now);
            if plan.seqs.is_empty() {
                self.stores.carry(&plan);
                now = self.wait(now, next, &mut idle_ticks)?;
                continue;
            }
            idle_ticks = 0;
            // The device starts once the stores of the step before are done.
            let start = self.stores.wait(now);
            let dt = self.start_step(&plan, start, &mut outputs);
            now = self.check_clock(start.saturating_add(dt).saturating_add(self.host_us()))?;
            // Requests arriving during the step find the seats as it holds them: those of
            // the requests it ends are given back at its end, as the server gives them back.
            // They are queued once its outputs are applied, as before.
            finished += self.check_arrivals(now.saturating_sub(1), &mut next);
            self.steps += 1;
            for ev in self.sched.apply_outputs(&plan, &outputs, Timestamp(now)) {
                finished += usize::from(self.on_event(ev));
            }
            self.sample(now);
            if self.steps & 0xff == 0 {
                progress.set_position(finished as u64);
            }
        }
        progress.set_position(finished as u64);
        Ok(())
    }

    /// The loop with asynchronous scheduling: the next step is planned when the step before it
    /// starts on the device (the host's planning costs nothing here), so it sees the arrivals
    /// up to then and the outputs of the steps that have ended; a step's outputs are applied
    /// when it ends. Steps that would preempt are planned in order, after the step in flight.
    fn run_async(&mut self, progress: &Progress) -> Result<(), SimError> {
        // When the next step is planned: the start of the step in flight, or later.
        let mut now = 0u64;
        let mut next = 0usize;
        let mut idle_ticks = 0u32;
        let mut finished = 0usize;
        // The step on the device: its plan, its outputs and when it ends.
        let mut in_flight: Option<(StepPlan, Vec<StepOutput>, u64)> = None;
        let mut in_order = false;
        loop {
            self.apply_changes(now)?;
            finished += self.admit_arrivals(now, &mut next);
            if !self.sched.has_unfinished() && in_flight.is_none() {
                match self.next_event(next) {
                    Some(t) => {
                        now = now.max(t);
                        continue;
                    }
                    None => break,
                }
            }
            let ahead = match in_flight {
                Some(_) if !in_order => self.sched.schedule_ahead(Timestamp(now)),
                _ => None,
            };
            let plan = match ahead {
                Some(plan) => plan,
                None => match in_flight.take() {
                    // Plan in order: once the step in flight has ended.
                    Some((prev, outs, end)) => {
                        now = now.max(end);
                        finished += self.resolve(&prev, &outs, end, &mut next);
                        continue;
                    }
                    None => self.sched.schedule(Timestamp(now)),
                },
            };
            in_order = self.sched.take_preemption_wanted();
            finished += self.note_plan(&plan, now);
            if plan.seqs.is_empty() {
                self.stores.carry(&plan);
                if let Some((prev, outs, end)) = in_flight.take() {
                    now = now.max(end);
                    finished += self.resolve(&prev, &outs, end, &mut next);
                } else {
                    now = self.wait(now, next, &mut idle_ticks)?;
                }
                continue;
            }
            idle_ticks = 0;
            self.sched.launch(&plan);
            // As the engine: a step with drafts, or one after which drafts may come, is
            // followed by a step planned in order (drafts follow the known tokens).
            in_order |=
                self.sched.drafts_enabled() || plan.seqs.iter().any(|s| !s.draft_tokens.is_empty());
            // The host plans from `now`; the device starts once it is done and free, and the
            // stores of the step before are done.
            let ready = now.saturating_add(self.host_us());
            let start = self
                .stores
                .wait(in_flight.as_ref().map_or(ready, |f| ready.max(f.2)));
            let mut outputs = Vec::with_capacity(plan.seqs.len());
            let end = start.saturating_add(self.start_step(&plan, start, &mut outputs));
            let end = self.check_clock(end)?;
            self.steps += 1;
            // The step before this one ends as this one starts.
            if let Some((prev, outs, prev_end)) = in_flight.replace((plan, outputs, end)) {
                finished += self.resolve(&prev, &outs, prev_end, &mut next);
            }
            now = start;
            if self.steps & 0xff == 0 {
                progress.set_position(finished as u64);
            }
        }
        progress.set_position(finished as u64);
        Ok(())
    }

    /// Checks the requests that have arrived by `now` (from `next` on) against their tenant's
    /// rate limits and their tier's bounds at their arrival, as the server's HTTP layer does,
    /// and queues those whose front-end time has passed by `now` with the scheduler, in time
    /// order (a request leaving the front end before one arriving at the same time, so that
    /// without a front-end time each request is queued before the next is checked); returns
    /// how many were rejected or rate-limited.
    fn admit_arrivals(&mut self, now: u64, next: &mut usize) -> usize {
        self.arrivals(now, next, true)
    }

    /// As [`Loop::admit_arrivals`] for the requests arriving during a step, before its outputs
    /// are applied: checks them against their rate limits and bounds, and queues none (they
    /// are queued after the step's outputs, so that the scheduler and its policy see the
    /// step's end first, as without bounds before the check moved into the step).
    fn check_arrivals(&mut self, now: u64, next: &mut usize) -> usize {
        self.arrivals(now, next, false)
    }

    fn arrivals(&mut self, now: u64, next: &mut usize, queue: bool) -> usize {
        let mut rejected = 0;
        loop {
            let arriving = self.next_arrival(*next).filter(|a| a.0 <= now);
            // A request asking for its adapter, or the loader ending a load, goes first at
            // its time (a request leaving the front end then goes before one arriving).
            if let Some(t) = self.lora_event().filter(|&t| t <= now) {
                let before_ready = [
                    self.front_end.first().filter(|_| queue),
                    self.refused_at_queue.first(),
                ]
                .into_iter()
                .flatten()
                .all(|r| t <= r.0);
                if arriving.is_none_or(|a| t <= a.0) && before_ready {
                    self.apply_front_changes(t);
                    rejected += self.on_lora_event(t);
                    continue;
                }
            }
            // During a step only a refusal leaves the front end; the others are queued after
            // the step's outputs.
            let refused = self.refused_at_queue.first().copied();
            let ready = match self.front_end.first().copied().filter(|_| queue) {
                Some(q) if refused.is_none_or(|r| q < r) => Some(q),
                _ => refused,
            }
            .filter(|r| r.0 <= now);
            match (arriving, ready) {
                (Some((t, i)), r) if r.is_none_or(|r| t < r.0) => {
                    self.apply_front_changes(t);
                    self.take_arrival(next, (t, i));
                    self.note_arrival(i);
                    if !self.within_rate_limits(i) {
                        self.tracks[i].outcome = Outcome::RateLimited;
                        self.ended(i, t);
                        rejected += 1;
                    } else if let Err(refusal) = self.take_seat(i) {
                        self.give_back_request(i);
                        self.tracks[i].outcome = match refusal {
                            crate::in_flight::Refusal::TierFull => Outcome::Overloaded,
                            crate::in_flight::Refusal::TenantBusy => Outcome::TenantBusy,
                        };
                        self.ended(i, t);
                        rejected += 1;
                    } else {
                        let delay = self.sim.front_end.delay_us(self.requests[i].prompt.len());
                        let leaves = (t.saturating_add(delay), i);
                        let refused = self.sched.check_request(&self.request(i)).is_err();
                        if self.memory.is_some() && self.requests[i].adapter.is_some() {
                            self.to_refuse[i] = refused;
                            self.resolving.insert(leaves);
                        } else if !refused {
                            self.front_end.insert(leaves);
                        } else {
                            self.refused_at_queue.insert(leaves);
                        }
                    }
                }
                (_, Some(r)) => {
                    if !self.front_end.remove(&r) {
                        self.refused_at_queue.remove(&r);
                    }
                    let i = r.1;
                    if self.sched.add_request(self.request(i)).is_err() {
                        self.tracks[i].outcome = Outcome::Rejected;
                        self.give_back_seat(i);
                        self.ended(i, r.0);
                        rejected += 1;
                    } else {
                        self.charge_prompt(i, 1.0);
                    }
                }
                (_, None) => break,
            }
        }
        rejected
    }

    /// When the next request asks for its adapter or the loader ends a load, if either is
    /// left to.
    fn lora_event(&self) -> Option<u64> {
        let load = self.memory.as_ref().and_then(LoraMemory::next_event);
        let ask = self.resolving.first().map(|r| r.0);
        match (load, ask) {
            (Some(l), Some(a)) => Some(l.min(a)),
            (l, a) => l.or(a),
        }
    }

    /// Handles the LoRA event at `t`: the loader's load ending (first), else a request asking
    /// for its adapter; the requests that get their adapter go on to the scheduler's queue
    /// (or their refusal) at the time they got it, and those their tenant's full share of
    /// adapter memory refuses end then (`tenant_busy`), as do those a full registry refuses
    /// (`unavailable`). Returns how many were refused.
    fn on_lora_event(&mut self, t: u64) -> usize {
        let Some(memory) = self.memory.as_mut() else {
            return 0;
        };
        let mut answers = std::mem::take(&mut self.answers);
        answers.clear();
        if memory.next_event() == Some(t) {
            while memory.advance(t, &mut answers) {}
        } else if let Some((at, i)) = self.resolving.pop_first() {
            self.asked_at[i] = Some(at);
            let r = &self.requests[i];
            if let Some(adapter) = r.adapter {
                let share = self
                    .tiers
                    .get(&r.tier)
                    .and_then(|t| t.max_cpu_loras_per_tenant);
                if memory.request(at, adapter, i, (&r.tenant, share), &mut answers) {
                    answers.served.push((at, i));
                }
            }
        }
        let refusals = answers.refused.iter().map(|r| (r, Outcome::TenantBusy));
        let refusals = refusals.chain(
            answers
                .unavailable
                .iter()
                .map(|r| (r, Outcome::Unavailable)),
        );
        for (&(at, i), outcome) in refusals {
            // Refused for want of room before queueing: the server gives back its one from
            // the requests budget, as for a refusal at arrival.
            self.give_back_request(i);
            self.tracks[i].outcome = outcome;
            self.give_back_seat(i);
            self.ended(i, at);
        }
        for &(at, i) in &answers.served {
            self.holds_adapter[i] = true;
            let asked = self.asked_at[i].unwrap_or(at);
            self.adapter_wait[i] = Some(at.saturating_sub(asked));
            if self.to_refuse[i] {
                self.refused_at_queue.insert((at, i));
            } else {
                self.front_end.insert((at, i));
            }
        }
        let refused = answers.refused.len() + answers.unavailable.len();
        self.answers = answers;
        refused
    }

    /// When the next request arrives or leaves the front end, the next LoRA event comes or
    /// the next change is made, if any is left to.
    fn next_event(&self, next: usize) -> Option<u64> {
        let arrival = self.next_arrival(next).map(|a| a.0);
        let ready = [
            self.front_end.first().map(|q| q.0),
            self.refused_at_queue.first().map(|r| r.0),
            self.lora_event(),
            self.changes.get(self.next_change).map(|c| c.at_us),
        ]
        .into_iter()
        .flatten()
        .min();
        match (arrival, ready) {
            (Some(a), Some(r)) => Some(a.min(r)),
            (a, r) => a.or(r),
        }
    }

    /// The next request to arrive, (arrival, index): the cursor `next`'s (the trace's requests
    /// in arrival order) or the earliest released by its client's request before it,
    /// whichever comes first (the lower index at the same time).
    fn next_arrival(&self, next: usize) -> Option<(u64, usize)> {
        let cursor = self.arrivals_us.get(next).map(|&t| (t, next));
        match (cursor, self.released.first().copied()) {
            (Some(c), Some(r)) => Some(c.min(r)),
            (c, r) => c.or(r),
        }
    }

    /// Takes `arrival` ([`Loop::next_arrival`]'s): out of the released requests, or past it
    /// with the cursor, which then skips the requests that wait for their client's request
    /// before them.
    fn take_arrival(&mut self, next: &mut usize, arrival: (u64, usize)) {
        if self.released.remove(&arrival) {
            return;
        }
        *next += 1;
        while self.chained.get(*next) == Some(&true) {
            *next += 1;
        }
    }

    /// Request `i` ended at `at` (finished, refused or timed out): its client's next request
    /// arrives once its think time has passed, or at its own arrival in the trace if that is
    /// later.
    fn ended(&mut self, i: usize, at: u64) {
        if let Some(j) = self.successor.get(i).copied().flatten() {
            let t = self.arrivals_us[j].max(at.saturating_add(self.think_us[j]));
            self.arrivals_us[j] = t;
            self.released.insert((t, j));
        }
    }

    /// Takes request `i`'s seat under its tier's bounds on requests in flight and the
    /// server's, as the server's admission does after its rate limits.
    fn take_seat(&mut self, i: usize) -> Result<(), crate::in_flight::Refusal> {
        let r = &self.requests[i];
        let tier = self.tiers.get(&r.tier);
        self.in_flight.take(
            &r.tier,
            &r.tenant,
            crate::in_flight::Limits {
                server: self.max_pending,
                tier: tier.and_then(|t| t.max_pending_requests),
                tenant: tier.and_then(|t| t.max_pending_per_tenant),
            },
        )?;
        self.holds_seat[i] = true;
        Ok(())
    }

    /// Gives back request `i`'s seat (once) when it ends, and its adapter if it holds one.
    fn give_back_seat(&mut self, i: usize) {
        if let Some(held) = self.holds_adapter.get_mut(i).filter(|h| **h) {
            *held = false;
            if let (Some(m), Some(a)) = (self.memory.as_mut(), self.requests[i].adapter) {
                m.release(a, &self.requests[i].tenant);
            }
        }
        if let Some(held) = self.holds_seat.get_mut(i).filter(|h| **h) {
            *held = false;
            let r = &self.requests[i];
            self.in_flight.give_back(&r.tier, &r.tenant);
        }
    }

    /// Whether request `i`'s tenant may send it at its arrival, as the server decides
    /// (`switchyard_policies::rate_limit`), taking one from its requests budget. Its prompt's
    /// tokens are charged once it is queued ([`Loop::charge_prompt`]; the server charges them
    /// once tokenized, a moment later, and gives back the estimate of a request its
    /// admission refuses or its checks reject), its generated tokens as they come.
    fn within_rate_limits(&mut self, i: usize) -> bool {
        let r = &self.requests[i];
        let Some(limits) = self.tiers.get(&r.tier).map(TierConf::rate_limits) else {
            return true;
        };
        if !limits.any() {
            return true;
        }
        let at_s = self.arrivals_us[i] as f64 / 1e6;
        let key = (r.tier.clone(), r.tenant.clone());
        let budgets = &mut self.budgets;
        let b = *self.budget_index.entry(key).or_insert_with(|| {
            budgets.push(TenantBudget::new(limits, at_s));
            budgets.len() - 1
        });
        if budgets[b].admit(at_s, 0.0).is_err() {
            return false;
        }
        if limits.tokens_per_minute.is_some() {
            self.budget_of[i] = Some(b);
        }
        true
    }

    /// Gives request `i`'s one back to its tenant's requests budget (if it has one) at its
    /// arrival: its tier's bounds on requests in flight refused it before it was queued, and
    /// the server gives back a request it refuses for want of room.
    fn give_back_request(&mut self, i: usize) {
        let r = &self.requests[i];
        if let Some(&b) = self.budget_index.get(&(r.tier.clone(), r.tenant.clone())) {
            let at_s = self.arrivals_us[i] as f64 / 1e6;
            self.budgets[b].give_back_request(at_s);
        }
    }

    /// Charges request `i`'s prompt tokens, times `sign`, to its tenant's tokens budget (if
    /// it has one) at its arrival: 1 once it is queued, -1 when it timed out in the queue
    /// (never computed: the server gives its prompt back).
    fn charge_prompt(&mut self, i: usize, sign: f64) {
        if let Some(&Some(b)) = self.budget_of.get(i) {
            let at_s = self.arrivals_us[i] as f64 / 1e6;
            self.budgets[b].charge(sign * self.requests[i].prompt.len() as f64, at_s);
        }
    }

    /// Counts the plan's preemptions, and records the requests it timed out in the queue
    /// (no finish time: they miss their targets); returns how many timed out.
    fn note_plan(&mut self, plan: &StepPlan, now: u64) -> usize {
        for id in &plan.preempted {
            if let Some(t) = self.tracks.get_mut(id.0 as usize) {
                t.preemptions += 1;
            }
        }
        for q in &plan.timed_out {
            if let Some(t) = self.tracks.get_mut(q.id.0 as usize) {
                t.outcome = Outcome::Finished(switchyard_policies::FinishReason::QueueTimeout);
            }
            self.give_back_seat(q.id.0 as usize);
            self.charge_prompt(q.id.0 as usize, -1.0);
            self.sched.forget(q.id);
            self.ended(q.id.0 as usize, now);
        }
        plan.timed_out.len()
    }

    /// Nothing to run at `now`: the time of the next arrival or queueing, or one idle tick later (an
    /// error once the scheduler has idled too long with work left).
    fn wait(&mut self, now: u64, next: usize, idle_ticks: &mut u32) -> Result<u64, SimError> {
        if let Some(t) = self.next_event(next) {
            return Ok(now.max(t));
        }
        *idle_ticks += 1;
        if *idle_ticks > MAX_IDLE_TICKS {
            let stats = self.sched.stats();
            return Err(SimError::Stalled {
                policy: self.label.clone(),
                at_s: now as f64 / 1e6,
                waiting: stats.num_waiting,
                running: stats.num_running,
            });
        }
        Ok(now.saturating_add(IDLE_TICK_US))
    }

    /// Records a step starting at `start`, fills `outputs` with its sampled tokens and returns
    /// its device time in microseconds.
    fn start_step(&mut self, plan: &StepPlan, start: u64, outputs: &mut Vec<StepOutput>) -> u64 {
        let shape = plan.shape_within(self.sim.model.window());
        outputs.clear();
        for s in &plan.seqs {
            if let Some(t) = self.tracks.get_mut(s.id.0 as usize) {
                t.first_scheduled.get_or_insert(start);
            }
            if s.samples {
                // Invented output: deterministic in (request, position), never EOS-checked;
                // drafts accepted in a run, at the configured accepted / draft tokens.
                let drafts = s.draft_tokens.len();
                let first = s.num_computed_tokens + s.num_new_tokens - drafts;
                let p = self.accept_p.get(drafts).copied().unwrap_or(0.0);
                let mut accepted = 0;
                while accepted < drafts && self.drafts_rng.random_bool(p) {
                    accepted += 1;
                }
                self.draft_tokens += drafts as u64;
                self.accepted_tokens += accepted as u64;
                outputs.push(StepOutput {
                    id: s.id,
                    token: invented_token(s.id, first + accepted),
                    accepted: accepted as u32,
                });
            }
        }
        // The host tier's copies come before the step's compute (offloads, then loads),
        // one block after another at each direction's rate, not overlapped with it. The
        // stores of plans that ran no step come first, with the offloads: the server makes
        // them at once, before the next step's copies.
        let carried = std::mem::take(&mut self.stores.carried);
        let copy_us = self
            .sim
            .host_copies_us(plan.kv_offloads.len() + carried, plan.kv_loads.len());
        self.host_copy_us += copy_us.total;
        self.host_offload_us += copy_us.offload;
        self.host_load_us += copy_us.load;
        let copy_us = copy_us.total;
        // Then the plan's stores start on their copy engine, alongside the compute.
        let store_us = plan.kv_stores.len() as f64 * self.sim.host_offload_us_per_block;
        self.stores.start(start, copy_us, store_us);
        ((self.sim.cost.step_time(&shape) * 1e6 + copy_us).round() as u64).max(1)
    }

    /// The host's time per step, in whole microseconds (at most 1e7: the spec bounds it).
    /// `t` where it is within [`MAX_CLOCK_US`], else the error that ends the run.
    fn check_clock(&self, t: u64) -> Result<u64, SimError> {
        if t <= MAX_CLOCK_US {
            return Ok(t);
        }
        // Called before the step is counted: it is the next one.
        Err(SimError::ClockLimit {
            policy: self.label.clone(),
            step: self.steps + 1,
        })
    }

    fn host_us(&self) -> u64 {
        self.sim.host_overhead_us.max(0.0).round() as u64
    }

    /// Applies a launched step's outputs at time `at`, after checking the requests that
    /// arrived before it (from `next` on); returns how many requests finished or were refused.
    fn resolve(
        &mut self,
        plan: &StepPlan,
        outputs: &[StepOutput],
        at: u64,
        next: &mut usize,
    ) -> usize {
        // Requests arriving during the step find the seats as it holds them (see `run`).
        let mut finished = self.check_arrivals(at.saturating_sub(1), next);
        for ev in self.sched.resolve(plan, outputs, Timestamp(at)) {
            finished += usize::from(self.on_event(ev));
        }
        self.sample(at);
        finished
    }

    /// Records one event; returns whether a request finished.
    fn on_event(&mut self, ev: SeqEvent) -> bool {
        match ev {
            SeqEvent::FirstToken {
                id,
                at,
                cached_prompt_tokens,
            } => {
                if let Some(t) = self.tracks.get_mut(id.0 as usize) {
                    t.first_token.get_or_insert(at.0);
                    t.cached_prompt_tokens = u64::from(cached_prompt_tokens);
                }
                false
            }
            SeqEvent::Token { id, at, .. } => {
                if let Some(t) = self.tracks.get_mut(id.0 as usize) {
                    // One ITL per step that brings a request tokens, as vLLM's server records
                    // it: the tokens of one step (a speculative step's accepted run) share
                    // its time, and their zero gaps are no latency.
                    match t.last_token {
                        Some(last) if last != at.0 => {
                            self.itls_ms.push(at.0.saturating_sub(last) as f64 / 1e3);
                        }
                        _ => {}
                    }
                    t.last_token = Some(at.0);
                    t.generated += 1;
                }
                if let Some(&Some(b)) = self.budget_of.get(id.0 as usize) {
                    self.budgets[b].charge(1.0, at.0 as f64 / 1e6);
                }
                false
            }
            SeqEvent::Finished { id, reason, at } => {
                if let Some(t) = self.tracks.get_mut(id.0 as usize) {
                    t.finish = Some(at.0);
                    t.outcome = Outcome::Finished(reason);
                }
                self.give_back_seat(id.0 as usize);
                self.sched.forget(id);
                self.ended(id.0 as usize, at.0);
                true
            }
        }
    }

    fn sample(&mut self, now: u64) {
        let stats = self.sched.stats();
        let (t_prev, kv_prev) = self.last_sample;
        self.kv_weighted += kv_prev * now.saturating_sub(t_prev) as f64;
        self.last_sample = (now, stats.kv_usage);
        self.kv_max = self.kv_max.max(stats.kv_usage);
        self.steps_since_sample += 1;
        if self.steps_since_sample < self.sample_stride {
            return;
        }
        self.steps_since_sample = 0;
        if self.samples.len() >= MAX_SAMPLES {
            // Keep every other sample and halve the rate from now on.
            let mut i = 0;
            self.samples.retain(|_| {
                i += 1;
                i % 2 == 1
            });
            self.sample_stride *= 2;
        }
        self.samples.push(StepSample {
            t_s: now as f64 / 1e6,
            waiting: stats.num_waiting as u32,
            running: stats.num_running as u32,
            kv_usage: stats.kv_usage,
        });
    }

    fn into_run(self) -> PolicyRun {
        let stats = self.sched.stats();
        let end = self.last_sample.0;
        let start = self.arrivals_us.first().copied().unwrap_or(0);
        let span = end.saturating_sub(start) as f64;
        let counters = RunCounters {
            steps: self.steps,
            preemptions: stats.num_preemptions,
            prefix_queries: stats.prefix_queries,
            prefix_hits: stats.prefix_hits,
            kv_usage_mean: if span > 0.0 {
                self.kv_weighted / span
            } else {
                0.0
            },
            kv_usage_max: self.kv_max,
            draft_tokens: self.draft_tokens,
            accepted_tokens: self.accepted_tokens,
        };
        let mut records: Vec<_> = self
            .tracks
            .iter()
            .zip(self.requests)
            .zip(&self.arrivals_us)
            .enumerate()
            .map(|(i, ((t, r), &a))| record(i, t, a, r))
            .collect();
        let lora_memory = self.memory.as_ref().map(|m| {
            for (rec, (wait, r)) in records
                .iter_mut()
                .zip(self.adapter_wait.iter().zip(self.requests))
            {
                rec.adapter = r.adapter;
                rec.adapter_wait_ms = wait.map(|us| us as f64 / 1e3);
            }
            let from = self.sim.lora_memory.as_ref().map_or("", |m| m.1.as_str());
            crate::report::LoraMemorySummary::new(&records, m.config(), m.counters(), from)
        });
        let host_blocks = self.sim.scheduler.num_host_blocks;
        let host_kv = (host_blocks > 0).then(|| crate::report::HostKvSummary {
            host_blocks: host_blocks as u64,
            bandwidth_gb_s: self.sim.spec.cache.host_bandwidth_gb_s,
            load_bandwidth_gb_s: self.sim.spec.cache.host_load_bandwidth(),
            offloaded_blocks: stats.num_kv_offloaded_blocks,
            loaded_blocks: stats.num_kv_loaded_blocks,
            host_hit_tokens: stats.num_host_hit_tokens,
            copy_s: self.host_copy_us / 1e6,
            offload_copy_s: self.host_offload_us / 1e6,
            load_copy_s: self.host_load_us / 1e6,
            stored_ahead_blocks: stats.num_kv_stored_ahead_blocks,
            store_copy_s: self.stores.busy_us / 1e6,
            store_stall_s: self.stores.stall_us as f64 / 1e6,
        });
        PolicyRun {
            label: self.label,
            policy_name: self.policy_name,
            records,
            itls_ms: self.itls_ms,
            samples: self.samples,
            counters,
            params_from_calibration: None,
            lora_memory,
            host_kv,
            changes: self.applied,
        }
    }
}

/// Request `i`'s record, judged by its tier's targets at its arrival.
fn record(i: usize, t: &Track, arrival_us: u64, r: &TraceRequest) -> RequestRecord {
    // Integer microseconds divided once, so values print exactly (0.116444, not 0.11644399999999999).
    let secs = |us: Option<u64>| us.map(|v| v as f64 / 1e6);
    let since_arrival_ms = |us: Option<u64>| us.map(|v| v.saturating_sub(arrival_us) as f64 / 1e3);
    let ttft_ms = since_arrival_ms(t.first_token);
    let e2e_ms = since_arrival_ms(t.finish);
    let tpot_ms = match (t.first_token, t.finish) {
        (Some(a), Some(b)) if t.generated > 1 => {
            Some(b.saturating_sub(a) as f64 / 1e3 / (t.generated - 1) as f64)
        }
        _ => None,
    };
    let done = t.finish.is_some();
    let met = |target: Option<f64>, value: Option<f64>| {
        target.map(|limit| done && value.is_none_or(|v| v <= limit))
    };
    RequestRecord {
        id: i as u64,
        tenant: r.tenant.clone(),
        tier: r.tier.clone(),
        prompt_len: r.prompt.len() as u64,
        output_len: u64::from(r.output_len),
        generated: t.generated,
        arrival_s: arrival_us as f64 / 1e6,
        first_scheduled_s: secs(t.first_scheduled),
        first_token_s: secs(t.first_token),
        finish_s: secs(t.finish),
        outcome: match t.outcome {
            Outcome::Unfinished => "unfinished".into(),
            Outcome::Rejected => "rejected".into(),
            Outcome::RateLimited => "rate_limited".into(),
            Outcome::Overloaded => crate::report::OVERLOADED.into(),
            Outcome::TenantBusy => crate::report::TENANT_BUSY.into(),
            Outcome::Unavailable => crate::report::UNAVAILABLE.into(),
            Outcome::Finished(reason) => reason.as_str().into(),
        },
        preemptions: t.preemptions,
        cached_prompt_tokens: t.cached_prompt_tokens,
        ttft_ms,
        tpot_ms,
        e2e_ms,
        met_ttft: met(t.ttft_target_ms, ttft_ms),
        met_tpot: met(t.tpot_target_ms, tpot_ms),
        adapter: None,
        adapter_wait_ms: None,
    }
}

#[path = "engine_changes.rs"]
mod engine_changes;
use engine_changes::check_changes;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::Calibration;
    use crate::spec::ArrivalSpec;
    use std::path::Path;
    use std::sync::Arc;

    const SPEC: &str = "
policies: [{name: fcfs}]
tiers: {gold: {ttft_ms: 1.5, tpot_ms: 0.9}}
scheduler: {max_num_seqs: 4, max_model_len: 100}
cache: {num_gpu_blocks: 64}
workload: {trace: unused.csv, format: azure}
";

    /// A simulation whose every step costs exactly 1 ms.
    fn one_ms_steps() -> Simulation {
        let spec = SimulationSpec::from_yaml_str(SPEC, Path::new("t.yaml")).unwrap();
        let mut sim = Simulation::new(&spec).unwrap();
        sim.cost = CostModel::Calibrated(Calibration {
            intercept_s: 1e-3,
            ..Default::default()
        });
        sim
    }

    pub(super) fn req(arrival_s: f64, prompt: usize, output: u32, tier: &str) -> TraceRequest {
        TraceRequest {
            arrival_s,
            prompt: Arc::from(vec![1u32; prompt]),
            output_len: output,
            tenant: String::new(),
            tier: tier.into(),
            priority: None,
            adapter: None,
            client: String::new(),
            think_s: None,
        }
    }

    /// [`req`] sent by `tenant`.
    fn req_of(
        tenant: &str,
        arrival_s: f64,
        prompt: usize,
        output: u32,
        tier: &str,
    ) -> TraceRequest {
        TraceRequest {
            tenant: tenant.into(),
            ..req(arrival_s, prompt, output, tier)
        }
    }

    /// The same trace with every request naming one of two adapters takes longer than without,
    /// under the roofline (its launches, flops and bytes) and under a calibration with LoRA
    /// terms; a calibration without them prices both alike.
    #[test]
    fn a_trace_with_adapters_takes_longer_than_the_same_without() {
        let base: Vec<TraceRequest> = (0..6).map(|i| req(i as f64 * 0.002, 40, 8, "")).collect();
        let adapted: Vec<TraceRequest> = base
            .iter()
            .enumerate()
            .map(|(i, r)| TraceRequest {
                adapter: Some(1 + i as u32 % 2),
                ..r.clone()
            })
            .collect();
        let last_finish = |sim: &mut Simulation, rs: &[TraceRequest]| {
            let run = sim
                .run_policy(&PolicySpec::named("fcfs"), rs, false)
                .unwrap();
            assert!(run.records.iter().all(|r| r.outcome == "length"));
            let tpot: f64 = run.records.iter().filter_map(|r| r.tpot_ms).sum();
            let end = run
                .records
                .iter()
                .filter_map(|r| r.finish_s)
                .fold(0.0, f64::max);
            (end, tpot)
        };
        let spec = SimulationSpec::from_yaml_str(SPEC, Path::new("t.yaml")).unwrap();
        let mut roofline = Simulation::new(&spec).unwrap();
        assert!(matches!(roofline.cost, CostModel::Roofline { .. }));
        let (b, b_tpot) = last_finish(&mut roofline, &base);
        let (a, a_tpot) = last_finish(&mut roofline, &adapted);
        // Llama-3-8B on an H200, rank 16 on all seven projections: 32 * 7 launches of 2.6 us
        // (0.58 ms) on top of a ~4.6 ms decode step.
        assert!(a > b * 1.08 && a_tpot > b_tpot * 1.08, "{a} vs {b}");
        let mut sim = one_ms_steps();
        let (b, _) = last_finish(&mut sim, &base);
        let (a, _) = last_finish(&mut sim, &adapted);
        assert_eq!(a, b);
        sim.cost = CostModel::Calibrated(Calibration {
            intercept_s: 1e-3,
            per_lora_token_s: 1e-4,
            per_adapter_s: 2e-4,
            ..Default::default()
        });
        let (a, a_tpot) = last_finish(&mut sim, &adapted);
        let (b2, b_tpot) = last_finish(&mut sim, &base);
        assert_eq!(b2, b);
        assert!(a > b * 1.3 && a_tpot > b_tpot * 1.3, "{a} vs {b}");
    }

    #[test]
    fn tenants_share_cached_prefixes_as_the_server_lets_them() {
        // The same 48-token prompt from tenants a, b, a, b, one after another: with prefixes
        // shared by tenant (the server's default) only the second a and the second b find it
        // cached; shared globally, every request after the first does.
        let mut sim = one_ms_steps();
        let rs: Vec<TraceRequest> = ["a", "b", "a", "b"]
            .iter()
            .enumerate()
            .map(|(i, t)| TraceRequest {
                tenant: (*t).into(),
                ..req(i as f64, 48, 1, "")
            })
            .collect();
        let mut hits = |sharing| {
            sim.spec.cache.prefix_sharing = sharing;
            let run = sim
                .run_policy(&PolicySpec::named("fcfs"), &rs, false)
                .unwrap();
            let per_request: Vec<u64> =
                run.records.iter().map(|r| r.cached_prompt_tokens).collect();
            (run.counters.prefix_hits, per_request)
        };
        let by_tenant = hits(switchyard_config::PrefixSharing::Tenant);
        let global = hits(switchyard_config::PrefixSharing::Global);
        // The last token is always recomputed, so its block is too: 32 tokens per hit.
        assert_eq!((by_tenant.0, global.0), (2 * 32, 3 * 32));
        // Each request's record says what it was served, as the server's usage would.
        assert_eq!(by_tenant.1, [0, 0, 32, 32]);
        assert_eq!(global.1, [0, 32, 32, 32]);
    }

    #[test]
    fn timestamps_follow_the_step_costs() {
        // By hand: request 0 prefills in step [0, 1] ms (first token at 1 ms) and
        // decodes at 2 and 3 ms; request 1 arrives at 10 s to an idle engine.
        let sim = one_ms_steps();
        let rs = vec![req(0.0, 32, 3, "gold"), req(10.0, 8, 1, "")];
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let a = &run.records[0];
        assert_eq!(
            (a.first_scheduled_s, a.first_token_s, a.finish_s),
            (Some(0.0), Some(0.001), Some(0.003))
        );
        assert_eq!(
            (a.ttft_ms, a.tpot_ms, a.e2e_ms),
            (Some(1.0), Some(1.0), Some(3.0))
        );
        assert_eq!((a.generated, a.outcome.as_str()), (3, "length"));
        assert_eq!((a.met_ttft, a.met_tpot), (Some(true), Some(false)));
        let b = &run.records[1];
        assert_eq!(
            (b.first_scheduled_s, b.finish_s, b.tpot_ms),
            (Some(10.0), Some(10.001), None)
        );
        assert_eq!((b.met_ttft, b.met_tpot), (None, None));
        assert_eq!(run.itls_ms, vec![1.0, 1.0]);
        assert_eq!(run.counters.steps, 4);
    }

    #[test]
    fn a_clients_requests_are_sent_one_at_a_time() {
        // Client c's requests a (at 0, 3 tokens out), b (at 0) and e (at 10 ms), and d (at
        // 0, no client). By hand, in order: step [0, 1] ms prefills a and d (d ends at 1 ms,
        // b waits for a), a decodes at 2 and 3 ms and ends, b arrives then (3 ms) and ends
        // after its step at 4 ms; e arrives at its own 10 ms, which is later.
        let sim = one_ms_steps();
        let client = |r: TraceRequest| TraceRequest {
            client: "c".into(),
            ..r
        };
        let rs = vec![
            client(req(0.0, 32, 3, "")),
            client(req(0.0, 8, 1, "")),
            req(0.0, 8, 1, ""),
            client(req(0.010, 8, 1, "")),
        ];
        let times = |r: &RequestRecord| (r.arrival_s, r.first_scheduled_s, r.finish_s);
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let got: Vec<_> = run.records.iter().map(times).collect();
        assert_eq!(
            got,
            vec![
                (0.0, Some(0.0), Some(0.003)),
                (0.003, Some(0.003), Some(0.004)),
                (0.0, Some(0.0), Some(0.001)),
                (0.010, Some(0.010), Some(0.011)),
            ]
        );
        assert_eq!(
            run.records[1].ttft_ms,
            Some(1.0),
            "from its arrival at 3 ms"
        );
        // Without clients b is in the first step with a and d.
        let open: Vec<_> = rs
            .iter()
            .map(|r| TraceRequest {
                client: String::new(),
                ..r.clone()
            })
            .collect();
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &open, false)
            .unwrap();
        assert_eq!(times(&run.records[1]), (0.0, Some(0.0), Some(0.001)));
        // Planned ahead: each of c's requests still arrives when the one before it ends (or
        // at its own time if later), and is scheduled no sooner.
        let mut sim = sim;
        sim.spec.scheduler.async_scheduling = true;
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let r = &run.records;
        assert_eq!(r[1].arrival_s, r[0].finish_s.unwrap());
        assert_eq!(r[3].arrival_s, r[1].finish_s.unwrap().max(0.010));
        assert!(r[1].first_scheduled_s.unwrap() >= r[0].finish_s.unwrap());
        assert!(r.iter().all(|r| r.outcome == "length"), "{r:?}");
    }

    #[test]
    fn a_clients_next_request_waits_its_think_time() {
        // Client c's a (0 s, 3 tokens out: ends at 3 ms), b (0 s, think 5 ms: sent at 8 ms,
        // ends at 9), e (0 s, think 0.5 ms: sent at 9.5 ms, ends at 10.5). A think time on
        // a client's first request (a's) is not read: nothing came before it.
        let sim = one_ms_steps();
        let with = |r: TraceRequest, think_s: Option<f64>| TraceRequest {
            client: "c".into(),
            think_s,
            ..r
        };
        let rs = vec![
            with(req(0.0, 32, 3, ""), Some(1.0)),
            with(req(0.0, 8, 1, ""), Some(0.005)),
            with(req(0.0, 8, 1, ""), Some(0.0005)),
        ];
        let times = |r: &RequestRecord| (r.arrival_s, r.finish_s);
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let got: Vec<_> = run.records.iter().map(times).collect();
        assert_eq!(
            got,
            vec![
                (0.0, Some(0.003)),
                (0.008, Some(0.009)),
                (0.0095, Some(0.0105)),
            ]
        );
        // The trace's own arrival still wins where it is later.
        let mut late = rs.clone();
        late[1].arrival_s = 0.020;
        late[2].arrival_s = 0.020;
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &late, false)
            .unwrap();
        let got: Vec<_> = run.records.iter().map(times).collect();
        assert_eq!(got[1], (0.020, Some(0.021)));
        assert_eq!(got[2], (0.0215, Some(0.0225)));
    }

    /// `workload.clients` draws think times for the requests without one and delays each
    /// client's requests by a start jitter, from the seed: clients that start together no
    /// longer send in step.
    #[test]
    fn the_specs_think_times_and_start_jitter_spread_the_clients() {
        let dir = crate::scratch::ScratchDir::new("engine-clients");
        let jsonl = dir.path().join("t.jsonl");
        // 4 clients of 5 requests each, all at 0 s; client c0's third request has its own
        // think time.
        let mut text = String::new();
        for i in 0..5 {
            for c in 0..4 {
                let think = if (c, i) == (0, 2) {
                    ", \"think_s\": 0.25"
                } else {
                    ""
                };
                text.push_str(&format!(
                    "{{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 2, \
                     \"client\": \"c{c}\"{think}}}\n"
                ));
            }
        }
        std::fs::write(&jsonl, text).unwrap();
        let mut sim = one_ms_steps();
        sim.spec.workload.trace = jsonl;
        sim.spec.workload.format = TraceFormat::Jsonl;
        let lockstep = sim.load_workload().unwrap().requests;
        assert!(lockstep.iter().all(|r| r.arrival_s == 0.0));
        let sent = |sim: &Simulation, requests: &[TraceRequest]| -> Vec<f64> {
            let run = sim
                .run_policy(&PolicySpec::named("fcfs"), requests, false)
                .unwrap();
            run.records.iter().map(|r| r.arrival_s).collect()
        };
        // Without: the clients' i-th requests are all sent at the same time (c0's after its
        // own think time, from its third on).
        let base = sent(&sim, &lockstep);
        for i in 0..5 {
            let same = if i < 2 { 0 } else { 1 };
            assert!(
                base[4 * i + same..4 * i + 4]
                    .iter()
                    .all(|&t| t == base[4 * i + 3]),
                "{base:?}"
            );
        }
        sim.spec.workload.clients = Some(crate::spec::ClientsSpec {
            think_s: Some(0.010),
            think: crate::spec::ThinkKind::Exponential,
            start_jitter_s: Some(0.050),
        });
        let drawn = sim.load_workload().unwrap().requests;
        // The record's own think time is kept; the others are drawn, with about the mean.
        let own: Vec<_> = drawn
            .iter()
            .filter(|r| r.think_s == Some(0.25))
            .map(|r| r.client.as_str())
            .collect();
        assert_eq!(own, vec!["c0"]);
        let thinks: Vec<f64> = drawn.iter().filter_map(|r| r.think_s).collect();
        assert_eq!(thinks.len(), 20);
        assert!(thinks.iter().all(|t| (0.0..0.5).contains(t)), "{thinks:?}");
        // Each client starts at its own draw in [0, 50 ms), its requests all moved alike.
        let mut starts: Vec<f64> = (0..4)
            .map(|c| {
                let name = format!("c{c}");
                let mine: Vec<f64> = drawn
                    .iter()
                    .filter(|r| r.client == name)
                    .map(|r| r.arrival_s)
                    .collect();
                assert!(mine.iter().all(|&t| t == mine[0]), "{mine:?}");
                mine[0]
            })
            .collect();
        assert!(
            starts.iter().all(|t| (0.0..0.050).contains(t)),
            "{starts:?}"
        );
        starts.sort_by(f64::total_cmp);
        starts.dedup();
        assert_eq!(starts.len(), 4, "one draw per client");
        // Sorted by arrival still.
        assert!(drawn.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        // The same seed draws the same; the clients are sent out of step.
        assert_eq!(sim.load_workload().unwrap().requests, drawn);
        let spread = sent(&sim, &drawn);
        let mut distinct = spread.clone();
        distinct.sort_by(f64::total_cmp);
        distinct.dedup();
        assert_eq!(distinct.len(), 20, "{spread:?}");
        // Constant: every drawn pause is the mean; a record's own stays its own.
        sim.spec.workload.clients = Some(crate::spec::ClientsSpec {
            think_s: Some(0.010),
            think: crate::spec::ThinkKind::Constant,
            start_jitter_s: None,
        });
        let constant = sim.load_workload().unwrap().requests;
        assert!(constant
            .iter()
            .all(|r| r.think_s == Some(0.010) || r.think_s == Some(0.25)));
        assert!(constant.iter().all(|r| r.arrival_s == 0.0));
    }

    #[test]
    fn step_costs_that_run_the_clock_past_its_limit_are_an_error() {
        // Two 3,000-token prompts make ~9 x 10^6 attention pairs at 3,000 s each (a
        // calibration within its bounds): ~2.7 x 10^16 us of prefill, past 2^53 us. The run
        // stops there instead of saturating its clock.
        let spec = SimulationSpec::from_yaml_str(
            "policies: [{name: fcfs}]\nscheduler: {max_model_len: 4096}\n\
             cache: {num_gpu_blocks: 1024}\nworkload: {trace: unused.csv, format: azure}\n",
            Path::new("t.yaml"),
        )
        .unwrap();
        let mut sim = Simulation::new(&spec).unwrap();
        sim.cost = CostModel::Calibrated(Calibration {
            per_attention_pair_s: 3000.0,
            ..Default::default()
        });
        let rs = vec![req(0.0, 3000, 4, ""), req(0.0, 3000, 4, "")];
        for async_scheduling in [false, true] {
            sim.spec.scheduler.async_scheduling = async_scheduling;
            let err = sim
                .run_policy(&PolicySpec::named("fcfs"), &rs, false)
                .unwrap_err();
            assert!(matches!(err, SimError::ClockLimit { .. }), "{err}");
            let msg = err.to_string();
            // Both prompts prefill in the first step, which is the one that runs past it.
            assert!(
                msg.contains("285 years in step 1 ") && msg.contains("`fcfs`"),
                "{msg}"
            );
        }
        // Costs near a real device's run as before.
        sim.cost = CostModel::Calibrated(Calibration {
            per_attention_pair_s: 1e-9,
            ..Default::default()
        });
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        assert!(run.records.iter().all(|r| r.generated == 4), "{run:?}");
    }

    #[test]
    fn speculative_steps_record_one_itl_per_step() {
        // Every draft accepted: a decode step brings a request up to 3 tokens at one time,
        // which is one inter-token latency (1 ms here), never a 0 ms gap per extra token.
        let yaml = SPEC.replace(
            "max_model_len: 100}",
            "max_model_len: 100, speculative: {num_speculative_tokens: 2, acceptance_rate: 1.0}}",
        );
        let spec = SimulationSpec::from_yaml_str(&yaml, Path::new("t.yaml")).unwrap();
        let mut sim = Simulation::new(&spec).unwrap();
        sim.cost = CostModel::Calibrated(Calibration {
            intercept_s: 1e-3,
            ..Default::default()
        });
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &[req(0.0, 8, 10, "")], false)
            .unwrap();
        let r = &run.records[0];
        assert_eq!(r.generated, 10);
        assert!(run.counters.accepted_tokens > 0, "{:?}", run.counters);
        assert!(
            run.itls_ms.iter().all(|&itl| itl == 1.0),
            "{:?}",
            run.itls_ms
        );
        // One per step after the first token's: the finish is that many steps later.
        let steps = (r.finish_s.unwrap() - r.first_token_s.unwrap()) * 1e3;
        assert_eq!(run.itls_ms.len() as f64, steps.round());
        assert!(run.itls_ms.len() < 9);
    }

    #[test]
    fn the_front_end_delays_queueing_without_occupying_the_engine() {
        // By hand, 1 ms steps, a front end of 0.5 ms plus 0.05 ms per prompt token. Request 0
        // (10 tokens, at 0) is queued at 1 ms: its first token at 2 ms, its second at 3 ms.
        // Request 1 (30 tokens, at 1.2 ms) is queued at 1.2 + 2 = 3.2 ms, while request 0's
        // steps go on; planned at 3.2 ms, its one token comes at 4.2 ms. TTFT and E2E run from
        // the arrivals.
        let mut sim = one_ms_steps();
        sim.front_end = FrontEnd {
            fixed_us: 500.0,
            per_token_us: 50.0,
        };
        let rs = vec![req(0.0, 10, 2, ""), req(0.0012, 30, 1, "")];
        for async_scheduling in [false, true] {
            sim.spec.scheduler.async_scheduling = async_scheduling;
            let run = sim
                .run_policy(&PolicySpec::named("fcfs"), &rs, false)
                .unwrap();
            let (a, b) = (&run.records[0], &run.records[1]);
            assert_eq!(
                (a.first_scheduled_s, a.first_token_s, a.finish_s),
                (Some(0.001), Some(0.002), Some(0.003)),
                "async {async_scheduling}"
            );
            assert_eq!((a.ttft_ms, a.e2e_ms), (Some(2.0), Some(3.0)));
            assert_eq!(
                (b.first_scheduled_s, b.first_token_s),
                (Some(0.0032), Some(0.0042)),
                "async {async_scheduling}"
            );
            assert_eq!(b.ttft_ms, Some(3.0));
        }
        // Without a front end the same trace runs as before: request 0 at once.
        sim.front_end = FrontEnd::default();
        sim.spec.scheduler.async_scheduling = false;
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        assert_eq!(run.records[0].first_token_s, Some(0.001));
    }

    #[test]
    fn a_front_end_time_comes_from_the_spec_else_the_calibration() {
        let dir = temp("front-end");
        let cal = dir.join("cal.yaml");
        std::fs::write(
            &cal,
            "intercept_s: 0.001\nnum_gpu_blocks: 500\nblock_size: 16\nfront_end_us: 800\n\
             front_end_per_token_us: 1.5\n",
        )
        .unwrap();
        let mut s = spec(SPEC);
        s.calibration = Some(cal.clone());
        let plain = s.clone();
        let got = |s: &SimulationSpec| Simulation::new(s).unwrap().front_end;
        assert_eq!(
            got(&s),
            FrontEnd {
                fixed_us: 800.0,
                per_token_us: 1.5
            }
        );
        s.scheduler.front_end_us = Some(120.0);
        assert_eq!(
            got(&s),
            FrontEnd {
                fixed_us: 120.0,
                per_token_us: 1.5
            }
        );
        s.scheduler.front_end_per_token_us = Some(0.0);
        assert_eq!(got(&s).per_token_us, 0.0);
        // A file from before the front end had none: 0.
        std::fs::write(
            &cal,
            "intercept_s: 0.001\nnum_gpu_blocks: 500\nblock_size: 16\n",
        )
        .unwrap();
        assert!(got(&plain).is_zero());
        // Out of bounds in the file: refused by name.
        std::fs::write(
            &cal,
            "intercept_s: 0.001\nnum_gpu_blocks: 500\nblock_size: 16\nfront_end_us: -3\n",
        )
        .unwrap();
        let err = Simulation::new(&plain).unwrap_err().to_string();
        assert!(err.contains("front_end_us -3 outside"), "{err}");
    }

    #[test]
    fn async_scheduling_admits_arrivals_a_step_later() {
        // By hand, 1 ms steps. In order: request 0 prefills in [0, 1], decodes in [1, 2] and
        // [2, 3]; request 1 arrives at 1.5 ms, is planned at 2 ms (after step [1, 2]) and its
        // one token comes at 3 ms. Asynchronously the step [2, 3] was planned at 1 ms, before
        // request 1 arrived: it is planned at 2 ms for [3, 4] and its token comes at 4 ms.
        // Request 0's timestamps are the same either way.
        let mut sim = one_ms_steps();
        let rs = vec![req(0.0, 32, 3, ""), req(0.0015, 8, 1, "")];
        let in_order = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        sim.spec.scheduler.async_scheduling = true;
        let ahead = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        for run in [&in_order, &ahead] {
            let a = &run.records[0];
            assert_eq!((a.first_token_s, a.finish_s), (Some(0.001), Some(0.003)));
            assert_eq!((a.generated, a.outcome.as_str()), (3, "length"));
        }
        assert_eq!(in_order.records[1].finish_s, Some(0.003));
        assert_eq!(ahead.records[1].first_scheduled_s, Some(0.003));
        assert_eq!(ahead.records[1].finish_s, Some(0.004));
        assert_eq!(ahead.records[1].generated, 1);
    }

    #[test]
    fn host_time_adds_to_steps_in_order_and_hides_when_planned_ahead() {
        // By hand, 1 ms device steps and 0.4 ms of host time per step, one request of three
        // tokens. In order each step costs 1.4 ms: tokens at 1.4, 2.8, 4.2 ms. Asynchronously
        // only the first plan is exposed: steps run [0.4, 1.4], [1.4, 2.4], [2.4, 3.4].
        let mut sim = one_ms_steps();
        sim.host_overhead_us = 400.0;
        let rs = vec![req(0.0, 32, 3, "")];
        let in_order = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let a = &in_order.records[0];
        assert_eq!((a.first_token_s, a.finish_s), (Some(0.0014), Some(0.0042)));
        sim.spec.scheduler.async_scheduling = true;
        let ahead = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let b = &ahead.records[0];
        assert_eq!((b.first_token_s, b.finish_s), (Some(0.0014), Some(0.0034)));
    }

    #[test]
    fn shaping_that_pushes_arrivals_past_the_clock_or_has_no_span_is_an_error() {
        let dir = temp("shape");
        let jsonl = dir.join("t.jsonl");
        let rows = |times: &[f64]| -> String {
            times
                .iter()
                .map(|t| format!("{{\"arrival_s\": {t}, \"prompt_len\": 8, \"output_len\": 1}}\n"))
                .collect()
        };
        let mut sim = one_ms_steps();
        sim.spec.workload.trace = jsonl.clone();
        sim.spec.workload.format = TraceFormat::Jsonl;
        std::fs::write(&jsonl, rows(&[0.0, 1.0, 2.0])).unwrap();
        assert_eq!(sim.load_workload().unwrap().requests.len(), 3);
        let past = |sim: &Simulation| {
            let err = sim.load_workload().unwrap_err().to_string();
            assert!(err.contains("past the bound"), "{err}");
        };
        sim.spec.workload.time_scale = Some(1e-300);
        past(&sim);
        sim.spec.workload.time_scale = None;
        sim.spec.workload.arrival = Some(ArrivalSpec {
            rate: Some(1e-10),
            ..Default::default()
        });
        past(&sim);
        // Generated arrivals at one request per 1e9 s on average.
        let csv = dir.join("s.csv");
        std::fs::write(
            &csv,
            "num_prefill_tokens,num_decode_tokens\n8,1\n8,1\n8,1\n8,1\n8,1\n",
        )
        .unwrap();
        sim.spec.workload.trace = csv;
        sim.spec.workload.format = TraceFormat::Sharegpt;
        sim.spec.workload.arrival = Some(ArrivalSpec {
            rate: Some(1e-9),
            ..Default::default()
        });
        past(&sim);
        // Every request at one time: no rate can be reached by rescaling.
        sim.spec.workload.trace = jsonl.clone();
        sim.spec.workload.format = TraceFormat::Jsonl;
        std::fs::write(&jsonl, rows(&[4.0, 4.0, 4.0])).unwrap();
        sim.spec.workload.arrival = Some(ArrivalSpec {
            rate: Some(2.0),
            ..Default::default()
        });
        let err = sim.load_workload().unwrap_err().to_string();
        assert!(err.contains("no time span"), "{err}");
    }

    /// Every output token is simulated and its latency kept: a trace asking for more than
    /// `MAX_TOTAL_OUTPUT_TOKENS` of them (5 MB of JSONL could ask for 10^11) is refused.
    #[test]
    fn a_trace_asking_for_too_many_output_tokens_is_refused() {
        let dir = temp("outputs");
        let jsonl = dir.join("t.jsonl");
        let per = u64::from(crate::trace::MAX_OUTPUT_TOKENS);
        let rows = |n: u64| -> String {
            (0..n)
                .map(|_| {
                    format!("{{\"arrival_s\": 0, \"prompt_len\": 1, \"output_len\": {per}}}\n")
                })
                .collect()
        };
        let mut sim = one_ms_steps();
        sim.spec.workload.trace = jsonl.clone();
        sim.spec.workload.format = TraceFormat::Jsonl;
        let most = crate::trace::MAX_TOTAL_OUTPUT_TOKENS / per;
        std::fs::write(&jsonl, rows(most)).unwrap();
        assert_eq!(sim.load_workload().unwrap().requests.len() as u64, most);
        std::fs::write(&jsonl, rows(most + 1)).unwrap();
        let err = sim.load_workload().unwrap_err().to_string();
        assert!(err.contains("output tokens"), "{err}");
    }

    pub(super) fn temp(tag: &str) -> crate::scratch::ScratchDir {
        crate::scratch::ScratchDir::new(&format!("engine-{tag}"))
    }

    fn spec(yaml: &str) -> SimulationSpec {
        SimulationSpec::from_yaml_str(yaml, Path::new("t.yaml")).unwrap()
    }

    #[test]
    fn max_model_len_defaults_to_the_model_context_not_the_kv_cache() {
        // Llama-3-8B on the H200: 52,852 blocks (845,632 tokens) but 8,192 tokens of context.
        let s = spec("policies: [{name: fcfs}]\nworkload: {trace: t.csv, format: azure}\n");
        let sim = Simulation::new(&s).unwrap();
        assert_eq!(sim.scheduler.num_gpu_blocks, 52_852);
        assert_eq!(sim.scheduler.max_model_len, 8192);
        let rs = vec![req(0.0, 8000, 192, ""), req(0.0, 8000, 193, "")];
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let outcomes: Vec<&str> = run.records.iter().map(|r| r.outcome.as_str()).collect();
        assert_eq!(outcomes, ["length", "rejected"]);
        // A long-context preset serves it; the KV cache bounds the default.
        let long = spec(
            "model: llama-3.1-8b\ncache: {num_gpu_blocks: 1000}\npolicies: [{name: fcfs}]\n\
             workload: {trace: t.csv, format: azure}\n",
        );
        assert_eq!(
            Simulation::new(&long).unwrap().scheduler.max_model_len,
            16_000
        );
        // A custom model without a context (a spec written before presets had one): the KV
        // cache bounds it.
        let custom = spec(
            "model: {name: mine, num_layers: 2, hidden_size: 64, num_heads: 4, num_kv_heads: 2, \
             ffn_size: 128, vocab_size: 1000, bytes_per_weight: 2, bytes_per_kv: 2}\n\
             cache: {num_gpu_blocks: 100}\npolicies: [{name: fcfs}]\n\
             workload: {trace: t.csv, format: azure}\n",
        );
        assert_eq!(
            Simulation::new(&custom).unwrap().scheduler.max_model_len,
            1600
        );
        // Set above what the KV cache holds: refused, as `serve` refuses it.
        let over = spec(
            "cache: {num_gpu_blocks: 100}\nscheduler: {max_model_len: 2000}\n\
             policies: [{name: fcfs}]\nworkload: {trace: t.csv, format: azure}\n",
        );
        let err = Simulation::new(&over).unwrap_err().to_string();
        assert!(
            err.contains("more than the 1600 tokens the KV cache holds"),
            "{err}"
        );
    }

    /// Mistral-7B-v0.1 attends over a window of 4,096 positions: its sequences give back the
    /// blocks behind it, so a cache of 2,000 blocks (32,000 tokens) runs eight requests of
    /// 16,000 tokens together, where the same model without the window holds two at a time
    /// and serves none longer than the cache; and its decode steps read the window's keys only.
    #[test]
    fn a_sliding_window_frees_the_blocks_behind_it() {
        let yaml = |model: &str| {
            spec(&format!(
                "model: {model}
cache: {{num_gpu_blocks: 2000}}
policies: [{{name: fcfs}}]
\
                 workload: {{trace: t.csv, format: azure}}
"
            ))
        };
        let windowed = Simulation::new(&yaml("mistral-7b-v0.1")).unwrap();
        assert_eq!(windowed.scheduler.max_model_len, 32_768);
        let mut full = yaml("mistral-7b-v0.1");
        if let crate::spec::ModelChoice::Preset(_) = &full.model {
            let mut m = ModelSpec::mistral_7b_v0_1();
            m.sliding_window = None;
            full.model = crate::spec::ModelChoice::Custom(m);
        }
        let full = Simulation::new(&full).unwrap();
        assert_eq!(full.scheduler.max_model_len, 32_000);
        let rs: Vec<TraceRequest> = (0..8).map(|_| req(0.0, 15_000, 1000, "")).collect();
        let w = windowed
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        let f = full
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        for run in [&w, &f] {
            assert!(run.records.iter().all(|r| r.outcome == "length"));
        }
        let last = |run: &PolicyRun| {
            run.records
                .iter()
                .filter_map(|r| r.finish_s)
                .fold(0.0, f64::max)
        };
        // All eight decode together under the window; without it the cache holds two.
        let first_tokens = |run: &PolicyRun| {
            let mut t: Vec<f64> = run.records.iter().filter_map(|r| r.first_token_s).collect();
            t.sort_by(f64::total_cmp);
            t
        };
        let (fw, ff) = (first_tokens(&w), first_tokens(&f));
        assert!(fw[7] < ff[2], "{fw:?} against {ff:?}");
        assert!(last(&w) < last(&f), "{} against {}", last(&w), last(&f));
        assert!(w.counters.kv_usage_max < f.counters.kv_usage_max);
    }

    #[test]
    fn a_calibration_needs_the_kv_capacity() {
        let dir = temp("cal");
        std::fs::write(dir.join("cal.yaml"), "intercept_s: 0.001\n").unwrap();
        let mut s = spec(
            "model: smollm2-135m\ncalibration: cal.yaml\npolicies: [{name: fcfs}]\n\
             workload: {trace: t.csv, format: azure}\n",
        );
        s.calibration = Some(dir.join("cal.yaml"));
        let err = Simulation::new(&s).unwrap_err().to_string();
        assert!(
            err.starts_with("t.yaml: calibration ")
                && err.contains("cal.yaml")
                && err.contains("set cache.num_gpu_blocks"),
            "{err}"
        );
        s.cache.num_gpu_blocks = Some(728);
        assert_eq!(Simulation::new(&s).unwrap().scheduler.num_gpu_blocks, 728);
        assert_eq!(Simulation::new(&s).unwrap().host_overhead_us, 0.0);
        // A file `switchyard calibrate` wrote carries the engine's blocks, block size and host
        // time; the spec's own values win.
        std::fs::write(
            dir.join("cal.yaml"),
            "intercept_s: 0.001\nnum_gpu_blocks: 500\nblock_size: 16\nhost_overhead_us: 80\n",
        )
        .unwrap();
        s.cache.num_gpu_blocks = None;
        let sim = Simulation::new(&s).unwrap();
        assert_eq!(
            (sim.scheduler.num_gpu_blocks, sim.host_overhead_us),
            (500, 80.0)
        );
        s.cache.num_gpu_blocks = Some(728);
        s.scheduler.host_overhead_us = Some(5.0);
        let sim = Simulation::new(&s).unwrap();
        assert_eq!(
            (sim.scheduler.num_gpu_blocks, sim.host_overhead_us),
            (728, 5.0)
        );
        // Blocks of another size would hold another number of tokens.
        s.cache.block_size = 32;
        let err = Simulation::new(&s).unwrap_err().to_string();
        assert!(err.contains("set cache.block_size to 16"), "{err}");
    }

    /// Errors found after parsing name the spec's file (not "<spec>"), and a policy's error
    /// says "policy `x`" once.
    #[test]
    fn errors_after_parsing_name_the_spec_file_once() {
        let s = spec(
            "model: smollm2-135m\ncache: {gpu_memory_utilization: 0.0001}\n\
             policies: [{name: fcfs}]\nworkload: {trace: t.csv, format: azure}\n",
        );
        let err = Simulation::new(&s).unwrap_err().to_string();
        assert!(
            err.starts_with("t.yaml: smollm2-135m does not fit"),
            "{err}"
        );
        // Parameters a program set after parsing (a file's are refused as it is parsed).
        let mut s =
            spec("policies: [{name: chunked-prefill}]\nworkload: {trace: t.csv, format: azure}\n");
        s.policies[0].params = serde_yaml::from_str("{bogus: 1}").unwrap();
        let err = Simulation::new(&s).unwrap_err().to_string();
        assert!(err.starts_with("t.yaml: policies: "), "{err}");
        assert_eq!(err.matches("policy `chunked-prefill`").count(), 1, "{err}");
        // A mix that a program set after parsing: told in the spec's terms, not rand's.
        let dir = temp("mix");
        let jsonl = dir.join("t.jsonl");
        std::fs::write(
            &jsonl,
            "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 1}\n",
        )
        .unwrap();
        let mut sim = one_ms_steps();
        sim.spec.workload.trace = jsonl;
        sim.spec.workload.format = TraceFormat::Jsonl;
        sim.spec.workload.mix.tiers = [("gold".to_string(), 0.0)].into();
        let err = sim.load_workload().unwrap_err().to_string();
        assert!(
            err.starts_with("t.yaml: workload.mix.tiers: weights must be non-negative"),
            "{err}"
        );
    }

    #[test]
    fn traces_may_only_name_defined_tiers_and_may_not_be_empty() {
        let dir = temp("tiers");
        let jsonl = dir.join("t.jsonl");
        let mut sim = one_ms_steps();
        sim.spec.workload.trace = jsonl.clone();
        sim.spec.workload.format = TraceFormat::Jsonl;
        std::fs::write(
            &jsonl,
            "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 1, \"tier\": \"gold\"}\n\
             {\"arrival_s\": 1, \"prompt_len\": 8, \"output_len\": 1}\n\
             {\"arrival_s\": 2, \"prompt_len\": 8, \"output_len\": 1, \"tier\": \"gld\"}\n",
        )
        .unwrap();
        let err = sim.load_workload().unwrap_err().to_string();
        assert!(
            err.contains("t.jsonl:3: field `tier`") && err.contains("tier `gld` is not defined"),
            "{err}"
        );
        // A spec without tiers (the command line's without --tiers) refuses them too, as the
        // README says: the first tier named, with how to define tiers.
        let tiers = std::mem::take(&mut sim.spec.tiers);
        let err = sim.load_workload().unwrap_err().to_string();
        assert!(
            err.contains("t.jsonl:1: field `tier`")
                && err.contains("tier `gold` is not defined (no tier is defined)")
                && err.contains("--tiers FILE"),
            "{err}"
        );
        sim.spec.tiers = tiers;
        // Unlabelled requests need no tiers.
        std::fs::write(
            &jsonl,
            "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 1}\n",
        )
        .unwrap();
        let untiered = std::mem::take(&mut sim.spec.tiers);
        assert_eq!(sim.load_workload().unwrap().requests.len(), 1);
        sim.spec.tiers = untiered;
        std::fs::write(&jsonl, "").unwrap();
        let err = sim.load_workload().unwrap_err().to_string();
        assert!(err.contains("the trace has no requests"), "{err}");
        // A header-only CSV asked for a load: the same, not a failed capacity estimate.
        let csv = dir.join("h.csv");
        std::fs::write(&csv, "TIMESTAMP,ContextTokens,GeneratedTokens\n").unwrap();
        sim.spec.workload.trace = csv;
        sim.spec.workload.format = TraceFormat::Azure;
        sim.spec.workload.arrival = Some(ArrivalSpec {
            load: Some(0.5),
            ..Default::default()
        });
        let err = sim.load_workload().unwrap_err().to_string();
        assert!(err.contains("the trace has no requests"), "{err}");
    }

    #[test]
    fn time_scale_divides_arrival_times() {
        let dir = temp("scale");
        let jsonl = dir.join("t.jsonl");
        std::fs::write(
            &jsonl,
            "{\"arrival_s\": 0, \"prompt_len\": 8, \"output_len\": 1}\n\
             {\"arrival_s\": 3, \"prompt_len\": 8, \"output_len\": 1}\n",
        )
        .unwrap();
        let mut sim = one_ms_steps();
        sim.spec.workload.trace = jsonl;
        sim.spec.workload.format = TraceFormat::Jsonl;
        sim.spec.workload.time_scale = Some(2.0);
        let times: Vec<f64> = sim
            .load_workload()
            .unwrap()
            .requests
            .iter()
            .map(|r| r.arrival_s)
            .collect();
        assert_eq!(times, vec![0.0, 1.5], "2 = twice as fast");
    }

    #[test]
    fn acceptance_rate_is_accepted_over_draft_tokens() {
        // The figure the server and `bench serve` report: 4 drafts per step at 0.6 accept
        // 60% of the draft tokens over the run (a per-draft probability of 0.6 would give
        // (0.6 + 0.36 + 0.216 + 0.1296) / 4 = 32.6%).
        for rate in [0.3, 0.6, 0.9] {
            let yaml = SPEC.replace(
                "max_model_len: 100}",
                &format!(
                    "max_model_len: 1000, speculative: {{num_speculative_tokens: 4, \
                     acceptance_rate: {rate}}}}}"
                ),
            );
            let mut sim = Simulation::new(&spec(&yaml)).unwrap();
            sim.cost = CostModel::Calibrated(Calibration {
                intercept_s: 1e-3,
                ..Default::default()
            });
            let rs: Vec<TraceRequest> = (0..8).map(|i| req(f64::from(i), 8, 600, "")).collect();
            let run = sim
                .run_policy(&PolicySpec::named("fcfs"), &rs, false)
                .unwrap();
            let c = &run.counters;
            let measured = c.accepted_tokens as f64 / c.draft_tokens as f64;
            assert!(
                (measured - rate).abs() < 0.02 && c.draft_tokens > 1000,
                "{rate}: {c:?}"
            );
        }
        let p = per_draft_probabilities(0.6);
        assert_eq!((p[0], p[1]), (0.6, 0.6));
        let mean4 = (p[4] + p[4].powi(2) + p[4].powi(3) + p[4].powi(4)) / 4.0;
        assert!((mean4 - 0.6).abs() < 1e-12 && p[4] > 0.6, "{}", p[4]);
        assert_eq!(per_draft_probabilities(1.0)[16], 1.0);
        assert_eq!(per_draft_probabilities(0.0)[16], 0.0);
    }

    #[test]
    fn a_request_without_a_priority_takes_its_tiers() {
        // One sequence at a time under `priority`, all arriving at 0: lower value first.
        // a: tier lo (priority 2); b: tier hi (priority 0); c: tier lo asking for -1 (held at
        // its tier's 2, after a by arrival: as the server, a tier bounds how urgent its
        // requests may be); d: no tier, no priority (0, after b by arrival); e: no tier, its
        // own -1 (first).
        let yaml = "policies: [{name: priority}]\ntiers: {hi: {priority: 0}, lo: {priority: 2}}\n\
                    scheduler: {max_num_seqs: 1, max_model_len: 100}\ncache: {num_gpu_blocks: 64}\n\
                    workload: {trace: unused.csv, format: azure}\n";
        let mut sim = Simulation::new(&spec(yaml)).unwrap();
        sim.cost = CostModel::Calibrated(Calibration {
            intercept_s: 1e-3,
            ..Default::default()
        });
        let c = TraceRequest {
            priority: Some(-1),
            ..req(0.0, 8, 2, "lo")
        };
        let rs = vec![
            req(0.0, 8, 2, "lo"),
            req(0.0, 8, 2, "hi"),
            c,
            req(0.0, 8, 2, ""),
            TraceRequest {
                priority: Some(-1),
                ..req(0.0, 8, 2, "")
            },
        ];
        let run = sim
            .run_policy(&PolicySpec::named("priority"), &rs, false)
            .unwrap();
        let mut order: Vec<(f64, usize)> = run
            .records
            .iter()
            .map(|r| (r.first_scheduled_s.unwrap(), r.id as usize))
            .collect();
        order.sort_by(|x, y| x.0.total_cmp(&y.0));
        let ids: Vec<usize> = order.iter().map(|o| o.1).collect();
        assert_eq!(ids, [4, 1, 3, 0, 2]);
    }

    #[test]
    fn a_tenant_past_its_rate_limits_is_refused_as_the_server_refuses_it() {
        // Tier lim: 2 requests and 60 tokens a minute per tenant (one token a second), 1 ms
        // steps. Tenant a: 10 + 50 tokens at 0 s (admitted; its tokens are out by 0.05 s), 10 +
        // 1 at 1.2 s (admitted: ~1.15 tokens refilled), 10 + 1 at 2 s (refused: the
        // requests budget is spent, one refills every 30 s), 10 + 1 at 40 s (requests: one
        // refilled; tokens: 60 - 60 - 11 + 40 = 29 left: admitted). Tenant b's requests at
        // 0 s and 2 s have their own budget; tier free's are not limited.
        let yaml = &fcfs_yaml(
            "{lim: {requests_per_minute: 2, tokens_per_minute: 60}, free: {}}",
            "{max_num_seqs: 8, max_model_len: 100}",
            "{num_gpu_blocks: 64}",
        );
        // Each request's record after a run of 1 ms steps.
        let rs = vec![
            req_of("a", 0.0, 10, 50, "lim"),
            req_of("b", 0.0, 10, 1, "lim"),
            req_of("a", 1.2, 10, 1, "lim"),
            req_of("a", 2.0, 10, 1, "lim"),
            req_of("b", 2.0, 10, 1, "lim"),
            req_of("a", 2.0, 10, 1, "free"),
            req_of("a", 40.0, 10, 1, "lim"),
        ];
        let records = fcfs_records(yaml, &rs);
        let got = outcomes(&records);
        assert_eq!(
            got,
            [
                "length",
                "length",
                "length",
                "rate_limited",
                "length",
                "length",
                "length"
            ]
        );
        // The tokens limit alone: generated tokens are charged as they come.
        let yaml = yaml.replace("requests_per_minute: 2, ", "");
        // a: 10 + 50 at 0 s, its 50 tokens out by 0.05 s (1 ms steps): at 0.5 s ~0.45 back,
        // refused (it would pass were they not charged); at 1.5 s ~1.45 back: admitted.
        let rs = vec![
            req_of("a", 0.0, 10, 50, "lim"),
            req_of("a", 0.5, 10, 1, "lim"),
            req_of("a", 1.5, 10, 1, "lim"),
        ];
        let records = fcfs_records(&yaml, &rs);
        let got = outcomes(&records);
        assert_eq!(got, ["length", "rate_limited", "length"]);
        let summary =
            crate::report::PolicySummary::new("fcfs", &records, &mut [], Default::default());
        assert_eq!(summary.rate_limited, 1);
        assert_eq!(summary.tiers[0].rate_limited, 1);
    }

    #[test]
    fn requests_past_their_tiers_bounds_on_requests_in_flight_are_refused_as_the_server_refuses_them(
    ) {
        // Tier free: 2 requests in flight, 1 per tenant; 1 ms steps. At 0 s: a (10 + 50 tokens,
        // in flight until ~50 ms), a again (refused: tenant_busy), b (admitted: the tier's
        // second), c (refused: overloaded, the tier full), and d of tier paid (no bounds). At
        // 0.2 s, their requests ended, a and b are served again and c is refused again (the
        // tier holds two).
        let yaml = &fcfs_yaml(
            "{free: {max_pending_requests: 2, max_pending_per_tenant: 1}, paid: {}}",
            "{max_num_seqs: 8, max_model_len: 100}",
            "{num_gpu_blocks: 64}",
        );
        let rs = vec![
            req_of("a", 0.0, 10, 50, "free"),
            req_of("a", 0.0, 10, 1, "free"),
            req_of("b", 0.0, 10, 1, "free"),
            req_of("c", 0.0, 10, 1, "free"),
            req_of("d", 0.0, 10, 1, "paid"),
            req_of("a", 0.2, 10, 1, "free"),
            req_of("b", 0.2, 10, 1, "free"),
            req_of("c", 0.2, 10, 1, "free"),
        ];
        let records = fcfs_records(yaml, &rs);
        let got = outcomes(&records);
        assert_eq!(
            got,
            [
                "length",
                "tenant_busy",
                "length",
                "overloaded",
                "length",
                "length",
                "length",
                "overloaded"
            ]
        );
        let summary =
            crate::report::PolicySummary::new("fcfs", &records, &mut [], Default::default());
        assert_eq!((summary.overloaded, summary.tenant_busy), (2, 1));
        let free = summary.tiers.iter().find(|t| t.tier == "free").unwrap();
        assert_eq!(
            (free.overloaded, free.tenant_busy, free.finished),
            (2, 1, 4)
        );
    }

    #[test]
    fn the_servers_bound_on_requests_in_flight_counts_every_tier() {
        // The server holds 2 in flight in all (scheduler.max_pending_requests), tiers none of
        // their own: at 0 s a (long) and b of different tiers are admitted, c is refused; at
        // 0.2 s b's request has ended and c is admitted.
        let yaml = &fcfs_yaml(
            "{free: {}, paid: {}}",
            "{max_num_seqs: 8, max_model_len: 400, max_pending_requests: 2}",
            "{num_gpu_blocks: 64}",
        );
        let rs = vec![
            req_of("a", 0.0, 10, 300, "free"),
            req_of("b", 0.0, 10, 1, "paid"),
            req_of("c", 0.0, 10, 1, "paid"),
            req_of("c", 0.2, 10, 1, "paid"),
        ];
        let records = fcfs_records(yaml, &rs);
        let got = outcomes(&records);
        assert_eq!(got, ["length", "length", "overloaded", "length"]);
    }

    #[test]
    fn a_request_arriving_during_a_step_sees_the_seats_held_until_that_step_ends() {
        // Tier free: one request in flight; 1 ms steps. a (10 + 5 tokens) runs from 0 s to the
        // end of its fifth step at 5 ms, holding the seat until then. b arrives at 4.5 ms,
        // during that step: the server refuses it (overloaded), a's seat still held; it was
        // checked at the step's end, after a gave its seat back, and admitted. c at 5.5 ms
        // finds the seat free. With async scheduling too.
        let rs = vec![
            req_of("a", 0.0, 10, 5, "free"),
            req_of("b", 0.0045, 10, 1, "free"),
            req_of("c", 0.0055, 10, 1, "free"),
        ];
        for asynchronous in [false, true] {
            let yaml = &fcfs_yaml(
                "{free: {max_pending_requests: 1}}",
                &format!(
                    "{{max_num_seqs: 8, max_model_len: 100, async_scheduling: {asynchronous}}}"
                ),
                "{num_gpu_blocks: 64}",
            );
            let records = fcfs_records(yaml, &rs);
            let finish = records[0].finish_s.unwrap();
            assert!((0.0046..0.0055).contains(&finish), "{finish}");
            assert_eq!(
                outcomes(&records),
                ["length", "overloaded", "length"],
                "async {asynchronous}"
            );
        }
    }

    #[test]
    fn a_request_refused_as_too_long_during_a_step_gives_its_seat_back_then() {
        // Tier free: two requests in flight; 1 ms steps. a runs from 0 s to past 20 ms. r
        // arrives at 4.2 ms with a prompt the context cannot hold: the server refuses it
        // once its prompt is encoded (here at once), its seat free again, so s at 4.6 ms, in
        // the same step, is admitted. r held its seat to the step's end, and s was refused
        // (overloaded). With async scheduling too.
        let rs = vec![
            req_of("a", 0.0, 10, 20, "free"),
            req_of("r", 0.0042, 200, 1, "free"),
            req_of("s", 0.0046, 10, 1, "free"),
        ];
        for asynchronous in [false, true] {
            let yaml = &fcfs_yaml(
                "{free: {max_pending_requests: 2}}",
                &format!(
                    "{{max_num_seqs: 8, max_model_len: 100, async_scheduling: {asynchronous}}}"
                ),
                "{num_gpu_blocks: 64}",
            );
            let records = fcfs_records(yaml, &rs);
            assert_eq!(
                outcomes(&records),
                ["length", "rejected", "length"],
                "async {asynchronous}"
            );
        }
    }

    #[test]
    fn without_bounds_a_request_arriving_during_a_step_is_queued_at_its_end() {
        // Without bounds or rate limits, the check of arrivals during a step changes nothing:
        // a request arriving during a step is queued once its outputs are applied, as one
        // arriving at its end is. 1 ms steps, kept busy from 0 s by `bg`'s long request; the
        // others (three tenants, fair-share, which the step's tokens and ends move) arrive
        // 0.4 ms into a step, or at its end: every request is scheduled and ends alike.
        // Queued before the step's outputs were applied, fair-share's counters differed.
        let yaml = &fcfs_yaml(
            "{}",
            "{max_num_seqs: 3, max_model_len: 1000}",
            "{num_gpu_blocks: 512}",
        );
        let trace = |offset_ms: f64| {
            let mut rs = vec![req_of("bg", 0.0, 10, 400, "")];
            let mut x = 7u64;
            for k in 1..120u64 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let tenant = ["x", "y", "z"][(x >> 33) as usize % 3];
                let prompt = 4 + (x >> 40) as usize % 60;
                let output = 1 + (x >> 50) as u32 % 6;
                let at = (2 * k) as f64 + offset_ms;
                rs.push(req_of(tenant, at / 1e3, prompt, output, ""));
            }
            rs
        };
        for asynchronous in [false, true] {
            let yaml = yaml.replace(
                "max_model_len: 1000",
                &format!("max_model_len: 1000, async_scheduling: {asynchronous}"),
            );
            // Per request: first scheduled and finish (us), outcome.
            type Row = (Option<f64>, Option<f64>, String);
            let runs: Vec<Vec<Row>> = [0.4, 1.0]
                .into_iter()
                .map(|offset| {
                    let mut sim = Simulation::new(&spec(&yaml)).unwrap();
                    sim.cost = CostModel::Calibrated(Calibration {
                        intercept_s: 1e-3,
                        ..Default::default()
                    });
                    let records = sim
                        .run_policy(&PolicySpec::named("fair-share"), &trace(offset), false)
                        .unwrap()
                        .records;
                    let us = |s: Option<f64>| s.map(|s| (s * 1e6).round());
                    records
                        .iter()
                        .map(|r| (us(r.first_scheduled_s), us(r.finish_s), r.outcome.clone()))
                        .collect()
                })
                .collect();
            assert_eq!(runs[0], runs[1], "async {asynchronous}");
        }
    }

    #[test]
    fn a_request_refused_for_room_takes_no_request_from_its_tenants_budget() {
        // Tier lim: 2 requests a minute per tenant, one in flight per tenant; 1 ms steps.
        // a: 10 + 50 at 0 s (in flight until ~50 ms), three more at 1 ms (tenant_busy: refused
        // for want of room, their requests given back, as the server gives them back), then
        // one at 0.1 s: admitted with the budget's second request. Were the refused ones
        // charged, it would be rate-limited; one more at 0.2 s is (both requests used).
        let yaml = &fcfs_yaml(
            "{lim: {requests_per_minute: 2, max_pending_per_tenant: 1}}",
            "{max_num_seqs: 8, max_model_len: 1000}",
            "{num_gpu_blocks: 128}",
        );
        let mut rs = vec![req_of("a", 0.0, 10, 50, "lim")];
        rs.extend((0..3).map(|_| req_of("a", 0.001, 10, 1, "lim")));
        rs.push(req_of("a", 0.1, 10, 1, "lim"));
        rs.push(req_of("a", 0.2, 10, 1, "lim"));
        let records = fcfs_records(yaml, &rs);
        let got = outcomes(&records);
        assert_eq!(
            got,
            [
                "length",
                "tenant_busy",
                "tenant_busy",
                "tenant_busy",
                "length",
                "rate_limited"
            ]
        );
    }

    #[test]
    fn a_request_refused_or_timed_out_leaves_no_prompt_tokens_charged() {
        // Tier lim: 600 tokens a minute per tenant (10 a second), one request in flight per
        // tenant; 1 ms steps. a: 10 + 50 tokens at 0 s (in flight until ~50 ms: 60 charged),
        // then at 1 ms three of 200 + 1 (tenant_busy) and at 0.1 s one of 1500 + 1, longer
        // than the context (rejected). The server gives back the estimate of a prompt its
        // admission refused or its checks rejected: none of them costs a token, and at 1 s a
        // (540 left) is admitted. Were they charged (2100 more), a would be rate-limited.
        let yaml = &fcfs_yaml(
            "{lim: {tokens_per_minute: 600, max_pending_per_tenant: 1}}",
            "{max_num_seqs: 8, max_model_len: 1000}",
            "{num_gpu_blocks: 128}",
        );
        let mut rs = vec![req_of("a", 0.0, 10, 50, "lim")];
        rs.extend((0..3).map(|_| req_of("a", 0.001, 200, 1, "lim")));
        rs.push(req_of("a", 0.1, 1500, 1, "lim"));
        rs.push(req_of("a", 1.0, 10, 1, "lim"));
        let records = fcfs_records(yaml, &rs);
        let got = outcomes(&records);
        assert_eq!(
            got,
            [
                "length",
                "tenant_busy",
                "tenant_busy",
                "tenant_busy",
                "rejected",
                "length"
            ]
        );
        // A request that timed out in the queue was never computed: the server gives its
        // prompt back. One seat: a's 10 + 50 holds it until ~50 ms; its 600 + 1 waits past
        // its tier's 20 ms. At 1 s a has 540 left and is admitted (charged: -50).
        let yaml = &fcfs_yaml(
            "{lim: {tokens_per_minute: 600, max_queue_ms: 20}}",
            "{max_num_seqs: 1, max_model_len: 1000}",
            "{num_gpu_blocks: 128}",
        );
        let rs = vec![
            req_of("a", 0.0, 10, 50, "lim"),
            req_of("a", 0.0, 600, 1, "lim"),
            req_of("a", 1.0, 10, 1, "lim"),
        ];
        let records = fcfs_records(yaml, &rs);
        let got = outcomes(&records);
        assert_eq!(got, ["length", "queue_timeout", "length"]);
    }

    /// The records of `rs` run under FCFS by the spec `yaml`, every step taking 1 ms.
    /// A spec of FCFS alone over `tiers`, with `scheduler` limits and `cache` (YAML flow
    /// mappings), for a trace the test passes in.
    fn fcfs_yaml(tiers: &str, scheduler: &str, cache: &str) -> String {
        format!(
            "policies: [{{name: fcfs}}]\ntiers: {tiers}\nscheduler: {scheduler}\n\
             cache: {cache}\nworkload: {{trace: unused.csv, format: azure}}\n"
        )
    }

    /// Each record's outcome (`length`, `overloaded`, ...), in the trace's order.
    fn outcomes(records: &[RequestRecord]) -> Vec<&str> {
        records.iter().map(|r| r.outcome.as_str()).collect()
    }

    fn fcfs_records(yaml: &str, rs: &[TraceRequest]) -> Vec<RequestRecord> {
        let mut sim = Simulation::new(&spec(yaml)).unwrap();
        sim.cost = CostModel::Calibrated(Calibration {
            intercept_s: 1e-3,
            ..Default::default()
        });
        sim.run_policy(&PolicySpec::named("fcfs"), rs, false)
            .unwrap()
            .records
    }

    #[test]
    fn requests_past_their_queue_bound_time_out_and_miss_their_targets() {
        // One seat, 1 ms steps: request 0 (10 + 50 tokens) holds it for 50 ms. Requests 1 and
        // 2 (tier `short`, bound 20 ms) and 3 (tier `long`, no bound of its own: the
        // scheduler's 100 ms) arrive at 0 s behind it; 1 and 2 wait past 20 ms and time out,
        // 3 is admitted at ~50 ms. With async scheduling too.
        let yaml = &fcfs_yaml(
            "{short: {ttft_ms: 1000, max_queue_ms: 20}, long: {ttft_ms: 1000}}",
            "{max_num_seqs: 1, max_model_len: 100, max_queue_ms: 100}",
            "{num_gpu_blocks: 64}",
        );
        let rs = vec![
            req(0.0, 10, 50, "long"),
            req(0.0, 10, 1, "short"),
            req(0.0, 10, 1, "short"),
            req(0.0, 10, 1, "long"),
        ];
        for asynchronous in [false, true] {
            let yaml = yaml.replace(
                "max_queue_ms: 100}",
                &format!("max_queue_ms: 100, async_scheduling: {asynchronous}}}"),
            );
            let records = fcfs_records(&yaml, &rs);
            let got = outcomes(&records);
            assert_eq!(
                got,
                ["length", "queue_timeout", "queue_timeout", "length"],
                "async {asynchronous}"
            );
            assert_eq!(records[1].finish_s, None);
            assert_eq!(records[1].met_ttft, Some(false));
            let summary =
                crate::report::PolicySummary::new("fcfs", &records, &mut [], Default::default());
            assert_eq!(summary.queue_timeout, 2);
            let short = summary.tiers.iter().find(|t| t.tier == "short").unwrap();
            assert_eq!((short.queue_timeout, short.slo_attainment), (2, Some(0.0)));
            let long = summary.tiers.iter().find(|t| t.tier == "long").unwrap();
            assert_eq!((long.queue_timeout, long.slo_attainment), (0, Some(1.0)));
        }
        // Without the bounds, every request is served.
        let yaml = yaml
            .replace(", max_queue_ms: 20", "")
            .replace(", max_queue_ms: 100", "");
        assert!(fcfs_records(&yaml, &rs)
            .iter()
            .all(|r| r.outcome == "length"));
    }

    #[test]
    fn a_kv_quota_keeps_the_batch_tier_from_starving_the_interactive_one() {
        // 32 blocks of 16 tokens, no prefix sharing, 1 ms steps. Four batch requests (120 +
        // 50 tokens: 8 blocks of prompt, 11 at the end) arrive at 0 s and take the whole
        // cache; an interactive one (10 + 5 tokens) arrives 1 ms later and, under FCFS, waits
        // until batch work ends (the preempted batch requests are ahead of it). With the batch
        // tier held to half the cache, two batch requests run, the others wait, and the
        // interactive request is admitted at once. The batch tier's own work ends in both.
        let yaml = &fcfs_yaml(
            "{inter: {ttft_ms: 10}, batch: {max_kv_fraction: 0.5}}",
            "{max_model_len: 256}",
            "{num_gpu_blocks: 32, prefix_caching: false}",
        );
        let mut rs: Vec<TraceRequest> = (0..4).map(|_| req(0.0, 120, 50, "batch")).collect();
        rs.push(req(0.001, 10, 5, "inter"));
        let ttft = |records: &[RequestRecord]| {
            assert!(records.iter().all(|r| r.outcome == "length"), "{records:?}");
            records[4].ttft_ms.unwrap()
        };
        let bounded = fcfs_records(yaml, &rs);
        let unbounded = fcfs_records(&yaml.replace("max_kv_fraction: 0.5", ""), &rs);
        assert!(ttft(&bounded) < 5.0, "{}", ttft(&bounded));
        assert!(ttft(&unbounded) > 40.0, "{}", ttft(&unbounded));
        assert_eq!(bounded[4].met_ttft, Some(true));
        // The batch tier's requests beyond its quota waited (not admitted at 0 s).
        assert_eq!(
            bounded[..4]
                .iter()
                .filter(|r| r.first_scheduled_s.is_some_and(|t| t > 0.0))
                .count(),
            2
        );
    }

    #[test]
    fn too_long_requests_are_rejected_not_fatal() {
        let sim = one_ms_steps();
        let rs = vec![req(0.0, 99, 5, ""), req(0.0, 10, 1, "")];
        let run = sim
            .run_policy(&PolicySpec::named("fcfs"), &rs, false)
            .unwrap();
        assert_eq!(run.records[0].outcome, "rejected");
        assert_eq!(run.records[0].finish_s, None);
        assert_eq!(run.records[1].outcome, "length");
    }

    #[test]
    fn capacity_is_saturation_throughput() {
        // Eight 1-token requests, four sequences per 1 ms step: 8 / 2 ms = 4000 req/s.
        let sim = one_ms_steps();
        let rs: Vec<TraceRequest> = (0..8).map(|i| req(f64::from(i), 16, 1, "")).collect();
        assert_eq!(sim.estimate_capacity(&rs).unwrap(), 4000.0);
    }

    #[test]
    fn unknown_policy_lists_the_known_ones() {
        let sim = one_ms_steps();
        let err = sim
            .run_policy(&PolicySpec::named("lifo"), &[], false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("lifo") && err.contains("fcfs") && err.contains("slo-aware"),
            "{err}"
        );
    }

    #[test]
    fn every_policy_finishes_a_mixed_workload() {
        for async_scheduling in [false, true] {
            let mut sim = one_ms_steps();
            sim.spec.scheduler.async_scheduling = async_scheduling;
            finishes_a_mixed_workload(&sim);
        }
    }

    fn finishes_a_mixed_workload(sim: &Simulation) {
        let rs: Vec<TraceRequest> = (0..40)
            .map(|i| {
                req(
                    f64::from(i) * 0.002,
                    10 + (i as usize * 7) % 60,
                    1 + (i % 9),
                    if i % 3 == 0 { "gold" } else { "" },
                )
            })
            .collect();
        for name in PolicyRegistry::with_builtins().names() {
            let run = sim
                .run_policy(&PolicySpec::named(name), &rs, false)
                .unwrap();
            assert!(run.records.iter().all(|r| r.outcome == "length"), "{name}");
            let generated: u64 = run.records.iter().map(|r| r.generated).sum();
            let wanted: u64 = rs.iter().map(|r| u64::from(r.output_len)).sum();
            assert_eq!(generated, wanted, "{name}");
        }
    }
}

#[cfg(test)]
#[path = "engine_lora_tests.rs"]
mod lora_tests;

#[cfg(test)]
#[path = "engine_host_kv_tests.rs"]
mod host_kv_tests;

#[cfg(test)]
#[path = "engine_swap_tests.rs"]
mod swap_tests;

#[cfg(test)]
#[path = "engine_tier_change_tests.rs"]
mod tier_change_tests;
