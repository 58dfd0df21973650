//! Reports: per-request records, per-policy summaries and a side-by-side
//! comparison, as JSON(L) and a plain-text table.
//!
//! Metric definitions follow vLLM's benchmark conventions: TTFT = first token
//! − arrival; TPOT = (finish − first token) / (output tokens − 1); ITL = gap
//! between consecutive steps that bring a request tokens (one per step, as
//! vLLM's server records it: the tokens of a speculative step arrive together);
//! E2E = finish − arrival.
//! Percentiles interpolate linearly between order statistics (NumPy's
//! default). SLO attainment counts only the requests that have a target (their
//! tier sets `ttft_ms` or `tpot_ms`): the fraction of them meeting every target
//! they have (rejected, rate-limited, queue-timed-out, refused and unfinished ones count as
//! misses),
//! `None` (shown as
//! n/a) when no request has one; goodput is the rate of those requests meeting
//! every target, as defined by DistServe (Zhong et al., OSDI'24), over the run's
//! duration. Requests without targets count in neither.
//!
//! Latencies in milliseconds are written rounded to the nanosecond (6 decimals),
//! so `3.7` rather than `3.6999999999999997`; they are computed unrounded.

use crate::error::SimError;
use crate::spec::TierConf;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::Path;

/// What happened to one request, in seconds of virtual time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Index of the request in the trace.
    pub id: u64,
    /// Tenant label.
    pub tenant: String,
    /// Tier name.
    pub tier: String,
    /// Prompt tokens.
    pub prompt_len: u64,
    /// Output tokens requested.
    pub output_len: u64,
    /// Output tokens generated.
    pub generated: u64,
    /// Arrival time.
    pub arrival_s: f64,
    /// First time the request was in a step.
    pub first_scheduled_s: Option<f64>,
    /// Time of the first output token.
    pub first_token_s: Option<f64>,
    /// Time it finished.
    pub finish_s: Option<f64>,
    /// Finish reason (`length`, `stop`, `queue_timeout`, ...), `rejected`, `rate_limited`,
    /// `overloaded`, `tenant_busy`, `unavailable` or `unfinished`.
    pub outcome: String,
    /// Times it was preempted.
    pub preemptions: u64,
    /// Prompt tokens the prefix cache served when it was first admitted (the server's
    /// `usage.prompt_tokens_details.cached_tokens`).
    pub cached_prompt_tokens: u64,
    /// Time to first token in ms.
    #[serde(serialize_with = "round_opt")]
    pub ttft_ms: Option<f64>,
    /// Time per output token after the first, in ms.
    #[serde(serialize_with = "round_opt")]
    pub tpot_ms: Option<f64>,
    /// End-to-end latency in ms.
    #[serde(serialize_with = "round_opt")]
    pub e2e_ms: Option<f64>,
    /// Whether the tier's TTFT target was met (`None`: no target).
    pub met_ttft: Option<bool>,
    /// Whether the tier's TPOT target was met (`None`: no target).
    pub met_tpot: Option<bool>,
    /// Its LoRA adapter, with `scheduler.lora_memory` (absent otherwise, or without one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapter: Option<u32>,
    /// With `scheduler.lora_memory`, the time it waited for its adapter to be read from its
    /// files, in ms (0: it was in memory); absent without an adapter, or for a request that
    /// never left the front end.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "round_opt"
    )]
    pub adapter_wait_ms: Option<f64>,
}

impl RequestRecord {
    /// Whether the request met every target it has; `None` when its tier sets none (such a
    /// request counts in neither SLO attainment nor goodput).
    pub fn met_slo(&self) -> Option<bool> {
        if self.met_ttft.is_none() && self.met_tpot.is_none() {
            return None;
        }
        Some(
            self.finish_s.is_some() && self.met_ttft != Some(false) && self.met_tpot != Some(false),
        )
    }
}

/// `x` rounded to 6 decimals (nanoseconds of a value in ms) for output.
fn round6(x: f64) -> f64 {
    let r = (x * 1e6).round() / 1e6;
    if r.is_finite() {
        r
    } else {
        x
    }
}

fn round_opt<S: serde::Serializer>(v: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
    match v {
        Some(v) => s.serialize_some(&round6(*v)),
        None => s.serialize_none(),
    }
}

/// Mean and percentiles of a latency sample, in ms. An empty sample (no request of a policy
/// finished) has none: `None`, written `null` and shown as n/a, never a latency of 0.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencyStats {
    /// Number of values.
    pub count: u64,
    /// Mean.
    #[serde(serialize_with = "round_opt")]
    pub mean: Option<f64>,
    /// Median.
    #[serde(serialize_with = "round_opt")]
    pub p50: Option<f64>,
    /// 90th percentile.
    #[serde(serialize_with = "round_opt")]
    pub p90: Option<f64>,
    /// 99th percentile.
    #[serde(serialize_with = "round_opt")]
    pub p99: Option<f64>,
}

impl LatencyStats {
    /// Statistics of `values` (sorted in place); `None` for each of an empty sample's.
    pub fn from_values(values: &mut [f64]) -> Self {
        if values.is_empty() {
            return LatencyStats::default();
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        LatencyStats {
            count: n as u64,
            mean: Some(values.iter().sum::<f64>() / n as f64),
            p50: Some(percentile(values, 50.0)),
            p90: Some(percentile(values, 90.0)),
            p99: Some(percentile(values, 99.0)),
        }
    }
}

/// `x` with `decimals` decimals, or "n/a" for a statistic of an empty sample.
pub(crate) fn fmt_ms(x: Option<f64>, decimals: usize) -> String {
    x.map_or_else(|| "n/a".to_string(), |v| format!("{v:.decimals$}"))
}

/// The `p`-th percentile of sorted, non-empty `sorted`, interpolating linearly.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    let Some(last) = sorted.len().checked_sub(1) else {
        return 0.0;
    };
    let rank = (p / 100.0).clamp(0.0, 1.0) * last as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// SLO results of one tier.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TierSummary {
    /// Tier name ("" = default).
    pub tier: String,
    /// Requests of this tier.
    pub requests: u64,
    /// Of which finished.
    pub finished: u64,
    /// Of which refused by their tenant's rate limits (`rate_limited`).
    #[serde(default)]
    pub rate_limited: u64,
    /// Of which ended by their queue bound before their first admission (`queue_timeout`).
    #[serde(default)]
    pub queue_timeout: u64,
    /// Of which refused at arrival by the tier's `max_pending_requests` (`overloaded`).
    #[serde(default)]
    pub overloaded: u64,
    /// Of which refused by the tier's `max_pending_per_tenant` at arrival or its
    /// `max_cpu_loras_per_tenant` (`tenant_busy`).
    #[serde(default)]
    pub tenant_busy: u64,
    /// Of which refused by a LoRA registry full of adapters in use (`unavailable`).
    #[serde(default)]
    pub unavailable: u64,
    /// The tier's TTFT target in ms (`tiers.<name>.ttft_ms`; `None`: no target).
    #[serde(default)]
    pub ttft_target_ms: Option<f64>,
    /// The tier's TPOT target in ms (`tiers.<name>.tpot_ms`; `None`: no target).
    #[serde(default)]
    pub tpot_target_ms: Option<f64>,
    /// Fraction meeting the TTFT target (`None`: no target).
    pub ttft_attainment: Option<f64>,
    /// Fraction meeting the TPOT target (`None`: no target).
    pub tpot_attainment: Option<f64>,
    /// Fraction meeting every target (`None`: the tier has none).
    pub slo_attainment: Option<f64>,
    /// Requests per second meeting every target (`None`: the tier has none).
    pub goodput_rps: Option<f64>,
    /// TTFT of the tier's finished requests.
    pub ttft_ms: LatencyStats,
    /// TPOT of the tier's finished requests.
    pub tpot_ms: LatencyStats,
}

/// Scheduler-level figures of a run, gathered by the engine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RunCounters {
    /// Steps executed.
    pub steps: u64,
    /// Total preemptions.
    pub preemptions: u64,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: u64,
    /// Of which found.
    pub prefix_hits: u64,
    /// Time-weighted mean KV usage (0..1).
    pub kv_usage_mean: f64,
    /// Peak KV usage (0..1).
    pub kv_usage_max: f64,
    /// Draft tokens fed (speculative decoding).
    #[serde(default)]
    pub draft_tokens: u64,
    /// Of which accepted.
    #[serde(default)]
    pub accepted_tokens: u64,
}

/// Everything reported for one policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicySummary {
    /// Policy label.
    pub policy: String,
    /// Requests in the workload.
    pub requests: u64,
    /// Finished requests.
    pub finished: u64,
    /// Requests rejected as the server would refuse them: prompt plus output longer than
    /// `max_model_len` (the server's 400 `context_length_exceeded`).
    pub rejected: u64,
    /// Requests refused by their tenant's rate limits (`tiers.<name>.requests_per_minute`,
    /// `tokens_per_minute`: the server's 429).
    #[serde(default)]
    pub rate_limited: u64,
    /// Requests ended by their queue bound before their first admission
    /// (`tiers.<name>.max_queue_ms`, `scheduler.max_queue_ms`: the server's 503
    /// `queue_timeout`).
    #[serde(default)]
    pub queue_timeout: u64,
    /// Requests refused at arrival by their tier's bound on requests in flight
    /// (`tiers.<name>.max_pending_requests`: the server's 503 `overloaded`).
    #[serde(default)]
    pub overloaded: u64,
    /// Requests refused at arrival by their tier's bound on each tenant's requests in flight
    /// (`tiers.<name>.max_pending_per_tenant`), or as they asked for their adapter by their
    /// tenant's share of adapter memory full of adapters in use
    /// (`tiers.<name>.max_cpu_loras_per_tenant`): the server's 429, reason `tenant_busy`.
    #[serde(default)]
    pub tenant_busy: u64,
    /// Requests refused as they asked for their adapter, not registered, by a registry full
    /// of adapters in use or configured (pinned or `registered`,
    /// `scheduler.lora_memory.max_adapters`, the server's `lora.max_adapters`): the server's
    /// 503, reason `unavailable`.
    #[serde(default)]
    pub unavailable: u64,
    /// Requests sent per second in this run, over the span from the first sending to the
    /// last: the trace's arrival rate, unless closed-loop clients sent their requests later
    /// (each once the one before it ended).
    #[serde(default)]
    pub offered_rate: f64,
    /// The most requests sent within any 10 s of this run, per second (`None` for sendings
    /// spanning less than 20 s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offered_peak_rate: Option<f64>,
    /// First arrival to last finish, in virtual seconds.
    pub duration_s: f64,
    /// Finished requests per second.
    pub request_throughput: f64,
    /// Generated tokens per second.
    pub output_token_throughput: f64,
    /// Time to first token.
    pub ttft_ms: LatencyStats,
    /// Time per output token.
    pub tpot_ms: LatencyStats,
    /// Inter-token latency: one per step that brings a request tokens, after its first.
    pub itl_ms: LatencyStats,
    /// End-to-end latency.
    pub e2e_ms: LatencyStats,
    /// Arrival to first scheduled.
    pub queue_ms: LatencyStats,
    /// Prefix-cache hit rate (hit tokens / queried tokens).
    pub prefix_cache_hit_rate: f64,
    /// Requests whose tier sets a TTFT or TPOT target: those SLO attainment and goodput count.
    pub slo_requests: u64,
    /// Fraction of the requests with targets meeting every target of their tier (`None`:
    /// no request has a target).
    pub slo_attainment: Option<f64>,
    /// Requests per second meeting every target of their tier, among those with targets
    /// (`None`: no request has a target).
    pub goodput_rps: Option<f64>,
    /// Scheduler counters.
    pub counters: RunCounters,
    /// Per-tier SLO results, by tier name.
    pub tiers: Vec<TierSummary>,
    /// The `slo-aware` step-cost parameters taken from the calibration file, where the spec's
    /// `params` leave them unset (`crate::slo_params`); absent when none was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub params_from_calibration: Option<crate::slo_params::ParamsFromCalibration>,
    /// The LoRA adapters in host memory (`scheduler.lora_memory`); absent without it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_memory: Option<LoraMemorySummary>,
    /// The host KV tier (`cache.kv_offloading_size` or `cache.num_host_blocks`); absent
    /// without one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_kv: Option<HostKvSummary>,
    /// With `changes` in the spec: the figures of each phase, the requests arriving before
    /// the first change, then from each change to the next ([`crate::phases`]); absent
    /// without changes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub phases: Vec<crate::phases::PhaseSummary>,
}

/// What the host KV tier did in a run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct HostKvSummary {
    /// Blocks of the host tier.
    pub host_blocks: u64,
    /// The copy rate assumed to the host tier (offloads), GB/s (`cache.host_bandwidth_gb_s`).
    pub bandwidth_gb_s: f64,
    /// The copy rate assumed back to the device (loads), GB/s
    /// (`cache.host_load_bandwidth_gb_s`, by default `host_bandwidth_gb_s`); 0 in a summary
    /// written before the rates were split.
    #[serde(default)]
    pub load_bandwidth_gb_s: f64,
    /// Blocks copied from the device to the host tier: evicted cached blocks, and those
    /// stored ahead of their eviction (`stored_ahead_blocks`).
    pub offloaded_blocks: u64,
    /// Blocks copied back (prefixes found in the host tier).
    pub loaded_blocks: u64,
    /// Prompt tokens served from the host tier (counted in the prefix-cache hits too).
    pub host_hit_tokens: u64,
    /// Device time of the copies that hold up the steps (made before their compute), in
    /// seconds: `offload_copy_s` plus `load_copy_s`. The stores ahead of eviction, made
    /// alongside the steps, are `store_copy_s`.
    pub copy_s: f64,
    /// The part of `copy_s` spent offloading (to the host tier) the blocks the steps evict,
    /// and the stores of plans that ran no step (made at once, as the server makes them),
    /// in seconds.
    #[serde(default)]
    pub offload_copy_s: f64,
    /// The part of `copy_s` spent loading (back to the device), in seconds.
    #[serde(default)]
    pub load_copy_s: f64,
    /// Of `offloaded_blocks`, those stored ahead of their eviction (`cache.kv_offloading_ahead`,
    /// the scheduler's `num_kv_stored_ahead_blocks`); 0 with it off.
    #[serde(default)]
    pub stored_ahead_blocks: u64,
    /// Device time of the stores ahead of eviction on their copy engine, alongside the steps,
    /// in seconds (at `bandwidth_gb_s`); it adds to the run's time only through
    /// `store_stall_s`.
    #[serde(default)]
    pub store_copy_s: f64,
    /// Time steps waited for the stores of the step before them (stores that outlast a
    /// step delay the next one), in seconds.
    #[serde(default)]
    pub store_stall_s: f64,
}

/// What the LoRA adapters' host memory did in a run (`scheduler.lora_memory`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LoraMemorySummary {
    /// Most adapters kept in memory (`max_cpu_loras`).
    pub max_cpu_loras: u64,
    /// Adapters pinned.
    pub pinned: u64,
    /// Adapters registered from the start and not pinned (`registered`; 0 in a summary
    /// written before they were modelled).
    #[serde(default)]
    pub registered: u64,
    /// Time to read one adapter, in ms.
    pub load_ms: f64,
    /// Where `load_ms` came from: "the spec" or "calibration FILE".
    pub load_ms_from: String,
    /// Adapters read from their files.
    pub loads: u64,
    /// Adapters dropped from memory (`share_evictions` included).
    pub evictions: u64,
    /// Of which dropped to make room in their tenant's share
    /// (`tiers.<name>.max_cpu_loras_per_tenant`; 0 in a summary written before shares were
    /// modelled).
    #[serde(default)]
    pub share_evictions: u64,
    /// Requests refused (`tenant_busy`, counted there too) because their tenant's share was
    /// full of adapters in use.
    #[serde(default)]
    pub share_refusals: u64,
    /// Adapters whose charge moved to a tenant whose requests used them, to make room in the
    /// share of the tenant charged (0 in a summary written before charges moved).
    #[serde(default)]
    pub share_transfers: u64,
    /// Most adapters registered at once (`max_adapters`; 0 in a summary written before the
    /// registry was modelled).
    #[serde(default)]
    pub max_adapters: u64,
    /// Adapters found on a request unregistered to make room for another in the full
    /// registry (each found, and read, again on its next request).
    #[serde(default)]
    pub unregistrations: u64,
    /// Requests refused (`unavailable`, counted there too) because their adapter was not
    /// registered and the registry was full of adapters in use or configured (pinned or
    /// `registered`).
    #[serde(default)]
    pub registry_refusals: u64,
    /// Requests that named an adapter, left the front end and got it (those refused by
    /// their tenant's share aside).
    pub adapter_requests: u64,
    /// Of which waited for a load.
    pub waited: u64,
    /// The wait of those that waited.
    pub wait_ms: LatencyStats,
    /// TTFT of the finished requests of a pinned adapter.
    pub pinned_ttft_ms: LatencyStats,
    /// TTFT of the finished requests of an adapter not pinned.
    pub unpinned_ttft_ms: LatencyStats,
}

impl LoraMemorySummary {
    /// The figures of `records` (a run's, with their adapters and waits) under `config`,
    /// with the memory's `counters`.
    pub fn new(
        records: &[RequestRecord],
        config: &crate::lora_memory::MemoryConfig,
        counters: crate::lora_memory::MemoryCounters,
        load_ms_from: &str,
    ) -> Self {
        let waits: Vec<f64> = records.iter().filter_map(|r| r.adapter_wait_ms).collect();
        let mut waited: Vec<f64> = waits.iter().copied().filter(|w| *w > 0.0).collect();
        let pinned = |r: &&RequestRecord| r.adapter.is_some_and(|a| config.pinned.contains(&a));
        let unpinned = |r: &&RequestRecord| r.adapter.is_some_and(|a| !config.pinned.contains(&a));
        LoraMemorySummary {
            max_cpu_loras: config.max_cpu_loras as u64,
            pinned: config.pinned.len() as u64,
            registered: config.registered.len() as u64,
            load_ms: config.load_us as f64 / 1e3,
            load_ms_from: load_ms_from.to_string(),
            loads: counters.loads,
            evictions: counters.evictions,
            share_evictions: counters.share_evictions,
            share_refusals: counters.share_refusals,
            share_transfers: counters.share_transfers,
            max_adapters: config.max_adapters as u64,
            unregistrations: counters.unregistrations,
            registry_refusals: counters.registry_refusals,
            adapter_requests: waits.len() as u64,
            waited: waited.len() as u64,
            wait_ms: LatencyStats::from_values(&mut waited),
            pinned_ttft_ms: stats_of(records.iter().filter(pinned), |r| r.ttft_ms),
            unpinned_ttft_ms: stats_of(records.iter().filter(unpinned), |r| r.ttft_ms),
        }
    }
}

impl PolicySummary {
    /// Summarises one run.
    pub fn new(
        policy: &str,
        records: &[RequestRecord],
        itls_ms: &mut [f64],
        counters: RunCounters,
    ) -> Self {
        let first = records
            .iter()
            .map(|r| r.arrival_s)
            .fold(f64::INFINITY, f64::min);
        let last = records
            .iter()
            .filter_map(|r| r.finish_s)
            .fold(f64::NEG_INFINITY, f64::max);
        let duration_s = if last > first { last - first } else { 0.0 };
        let per_s = |x: f64| {
            if duration_s > 0.0 {
                x / duration_s
            } else {
                0.0
            }
        };
        let finished = records.iter().filter(|r| r.finish_s.is_some()).count() as u64;
        let generated: u64 = records.iter().map(|r| r.generated).sum();
        let slo_requests = records.iter().filter(|r| r.met_slo().is_some()).count() as u64;
        let met = records.iter().filter(|r| r.met_slo() == Some(true)).count() as f64;
        let mut tiers: BTreeMap<&str, Vec<&RequestRecord>> = BTreeMap::new();
        for r in records {
            tiers.entry(r.tier.as_str()).or_default().push(r);
        }
        let tiers = tiers
            .into_iter()
            .map(|(tier, rs)| tier_summary(tier, &rs, duration_s))
            .collect();
        PolicySummary {
            policy: policy.to_string(),
            requests: records.len() as u64,
            finished,
            rejected: records.iter().filter(|r| r.outcome == "rejected").count() as u64,
            rate_limited: records.iter().filter(|r| r.outcome == RATE_LIMITED).count() as u64,
            queue_timeout: records
                .iter()
                .filter(|r| r.outcome == QUEUE_TIMEOUT)
                .count() as u64,
            overloaded: records.iter().filter(|r| r.outcome == OVERLOADED).count() as u64,
            tenant_busy: records.iter().filter(|r| r.outcome == TENANT_BUSY).count() as u64,
            unavailable: records.iter().filter(|r| r.outcome == UNAVAILABLE).count() as u64,
            // Set by `crate::simulate`, which computes the trace's rates alike.
            offered_rate: 0.0,
            offered_peak_rate: None,
            duration_s,
            request_throughput: per_s(finished as f64),
            output_token_throughput: per_s(generated as f64),
            ttft_ms: stats_of(records.iter(), |r| r.ttft_ms),
            tpot_ms: stats_of(records.iter(), |r| r.tpot_ms),
            itl_ms: LatencyStats::from_values(itls_ms),
            e2e_ms: stats_of(records.iter(), |r| r.e2e_ms),
            queue_ms: stats_of(records.iter(), |r| {
                r.first_scheduled_s.map(|s| (s - r.arrival_s) * 1e3)
            }),
            prefix_cache_hit_rate: ratio(
                counters.prefix_hits as f64,
                counters.prefix_queries as f64,
            ),
            slo_requests,
            slo_attainment: (slo_requests > 0).then(|| ratio(met, slo_requests as f64)),
            goodput_rps: (slo_requests > 0).then(|| per_s(met)),
            counters,
            tiers,
            params_from_calibration: None,
            lora_memory: None,
            host_kv: None,
            phases: Vec::new(),
        }
    }
}

impl PolicySummary {
    /// Records each tier's targets (`tiers.<name>.ttft_ms`, `tpot_ms`) beside its results,
    /// so that a reader of the summary sees what the attainments were measured against.
    pub fn set_tier_targets(&mut self, tiers: &BTreeMap<String, TierConf>) {
        for t in &mut self.tiers {
            let conf = tiers.get(&t.tier);
            t.ttft_target_ms = conf.and_then(|c| c.ttft_ms);
            t.tpot_target_ms = conf.and_then(|c| c.tpot_ms);
        }
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

pub(crate) fn stats_of<'a>(
    records: impl Iterator<Item = &'a RequestRecord>,
    f: impl Fn(&RequestRecord) -> Option<f64>,
) -> LatencyStats {
    let mut v: Vec<f64> = records.filter_map(f).collect();
    LatencyStats::from_values(&mut v)
}

pub(crate) fn tier_summary(tier: &str, rs: &[&RequestRecord], duration_s: f64) -> TierSummary {
    let attainment = |get: fn(&RequestRecord) -> Option<bool>| {
        let targeted = rs.iter().filter(|r| get(r).is_some()).count();
        (targeted > 0)
            .then(|| rs.iter().filter(|r| get(r) == Some(true)).count() as f64 / targeted as f64)
    };
    let targeted = rs.iter().filter(|r| r.met_slo().is_some()).count();
    let met = rs.iter().filter(|r| r.met_slo() == Some(true)).count() as f64;
    TierSummary {
        tier: tier.to_string(),
        requests: rs.len() as u64,
        finished: rs.iter().filter(|r| r.finish_s.is_some()).count() as u64,
        rate_limited: rs.iter().filter(|r| r.outcome == RATE_LIMITED).count() as u64,
        queue_timeout: rs.iter().filter(|r| r.outcome == QUEUE_TIMEOUT).count() as u64,
        overloaded: rs.iter().filter(|r| r.outcome == OVERLOADED).count() as u64,
        tenant_busy: rs.iter().filter(|r| r.outcome == TENANT_BUSY).count() as u64,
        unavailable: rs.iter().filter(|r| r.outcome == UNAVAILABLE).count() as u64,
        // Filled in from the spec's tiers by `PolicySummary::set_tier_targets`.
        ttft_target_ms: None,
        tpot_target_ms: None,
        ttft_attainment: attainment(|r| r.met_ttft),
        tpot_attainment: attainment(|r| r.met_tpot),
        slo_attainment: (targeted > 0).then(|| met / targeted as f64),
        goodput_rps: (targeted > 0).then(|| ratio(met, duration_s)),
        ttft_ms: stats_of(rs.iter().copied(), |r| r.ttft_ms),
        tpot_ms: stats_of(rs.iter().copied(), |r| r.tpot_ms),
    }
}

/// The outcome of a request refused by its tenant's rate limits.
pub const RATE_LIMITED: &str = "rate_limited";
/// The outcome of a request ended by its queue bound before its first admission.
pub const QUEUE_TIMEOUT: &str = "queue_timeout";
/// The outcome of a request refused at arrival by its tier's `max_pending_requests`.
pub const OVERLOADED: &str = "overloaded";
/// The outcome of a request refused at arrival by its tier's `max_pending_per_tenant`.
pub const TENANT_BUSY: &str = "tenant_busy";
/// The outcome of a request refused as it asked for its adapter by a full LoRA registry
/// (`lora_memory.max_adapters`).
pub const UNAVAILABLE: &str = "unavailable";

/// `Comparison::arrival_rate_of` when the rates count when the requests were sent.
pub const RATE_OF_SENT: &str = "sent";
/// `Comparison::arrival_rate_of` when the rates count the trace's `arrival_s`, which
/// closed-loop clients' requests may be sent after.
pub const RATE_OF_TRACE: &str = "trace";

fn rate_of_sent() -> String {
    RATE_OF_SENT.into()
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Several policies run on the same workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// Model name (the spec's).
    pub model: String,
    /// Whether a calibration file priced the steps (else the roofline of `hardware`).
    #[serde(default)]
    pub calibrated: bool,
    /// The hardware preset's name, or with a calibration "calibrated (file's model M on H)":
    /// the model and hardware the file records.
    pub hardware: String,
    /// Warnings about the inputs (a calibration fitted on another model), also printed on
    /// stderr by `switchyard simulate`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// Requests in the workload.
    pub requests: u64,
    /// Closed-loop clients in the workload (its records' `client`s); 0: none, every request
    /// is sent at its trace arrival.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub clients: u64,
    /// What `arrival_rate` and `peak_rate` count: [`RATE_OF_SENT`] (`sent`: no closed-loop
    /// client, the trace's arrivals are when the requests were sent, in every policy's run)
    /// or [`RATE_OF_TRACE`] (`trace`: the trace's `arrival_s`, once shaped and jittered
    /// (`workload.clients.start_jitter_s`), the earliest each client's
    /// request may be sent; when each run sent them is its policy's `offered_rate`).
    #[serde(default = "rate_of_sent")]
    pub arrival_rate_of: String,
    /// Arrival rate of the workload (requests/s over its span): see `arrival_rate_of`.
    pub arrival_rate: f64,
    /// Estimated capacity in requests/s when a load was asked for.
    pub estimated_capacity_rps: Option<f64>,
    /// The most requests arriving within any 10 s, per second (`None` for a trace spanning
    /// less than 20 s): how far a bursty trace's peaks stand above its mean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_rate: Option<f64>,
    /// Longest prompt plus output served; longer requests are rejected.
    #[serde(default)]
    pub max_model_len: u64,
    /// One summary per policy, in spec order.
    pub policies: Vec<PolicySummary>,
    /// The per-tier plots, one entry per tier some request has (none without tiers): which
    /// files show which tier, and the targets marked in them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tier_plots: Vec<TierPlots>,
}

/// The plots of one tier: a CDF per policy of its requests' TTFT and of their TPOT, the
/// tier's target (if it sets one) a vertical line.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TierPlots {
    /// The tier's name, as the spec spells it.
    pub tier: String,
    /// Its TTFT target in ms (`None`: no target, no line).
    pub ttft_target_ms: Option<f64>,
    /// Its TPOT target in ms (`None`: no target, no line).
    pub tpot_target_ms: Option<f64>,
    /// The TTFT plot's file name in the output directory.
    pub ttft_cdf: String,
    /// The TPOT plot's file name in the output directory.
    pub tpot_cdf: String,
}

impl Comparison {
    /// A plain-text table: one row per policy, then per-tier SLO rows.
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let cap = self
            .estimated_capacity_rps
            .map(|c| format!(", estimated capacity {c:.2} req/s"))
            .unwrap_or_default();
        let peak = self
            .peak_rate
            .map(|p| format!(" (peak {p:.2} req/s over 10 s)"))
            .unwrap_or_default();
        // "llama-3-8b on h200", or "smollm2-135m, calibrated (file's model ... on cpu)".
        let on = if self.calibrated { ", " } else { " on " };
        if self.arrival_rate_of == RATE_OF_TRACE {
            let sent: Vec<String> = self
                .policies
                .iter()
                .map(|p| {
                    let peak = p
                        .offered_peak_rate
                        .map(|r| format!(" (peak {r:.2} over 10 s)"))
                        .unwrap_or_default();
                    format!("{} {:.2} req/s{peak}", p.policy, p.offered_rate)
                })
                .collect();
            let _ = writeln!(
                s,
                "{}{on}{}: {} requests of {} closed-loop clients, their trace's arrival_s at \
                 {:.2} req/s{peak}{cap}, max_model_len {}; sent (each after the client's \
                 request before it ended, and its think time): {}",
                self.model,
                self.hardware,
                self.requests,
                self.clients,
                self.arrival_rate,
                self.max_model_len,
                sent.join(", ")
            );
        } else {
            let _ = writeln!(
                s,
                "{}{on}{}: {} requests at {:.2} req/s{peak}{cap}, max_model_len {}",
                self.model, self.hardware, self.requests, self.arrival_rate, self.max_model_len
            );
        }
        let _ = writeln!(
            s,
            "slo% and goodput count the requests whose tier sets a ttft_ms or tpot_ms target \
             (n/a: none has one); rejected, rate-limited, queue-timed-out, refused \
             (overloaded, tenant_busy, unavailable) and unfinished ones miss"
        );
        let _ = writeln!(
            s,
            "latencies in ms; req/s and goodput: requests/s (goodput: those meeting every \
             target of their tier); tok/s: output tokens/s; ttft%, tpot%, slo%: share meeting \
             the tier's ttft_ms, tpot_ms, both (ttft tgt, tpot tgt: those targets, - for none); \
             preempt: preemptions; hit%: prefix-cache hit rate; kv%: mean KV cache use\n"
        );
        let pct = |x: Option<f64>| x.map_or("n/a".to_string(), |v| format!("{:.1}", 100.0 * v));
        let target = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v}"));
        let _ = writeln!(
            s,
            "{:<18} {:>8} {:>8} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>7} {:>6} {:>6} {:>6}",
            "policy",
            "req/s",
            "tok/s",
            "ttft p50",
            "ttft p99",
            "tpot p50",
            "tpot p99",
            "itl p99",
            "e2e p50",
            "e2e p99",
            "preempt",
            "hit%",
            "kv%",
            "slo%"
        );
        for p in &self.policies {
            let _ = writeln!(
                s,
                "{:<18} {:>8.2} {:>8.1} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>7} {:>6.1} {:>6.1} {:>6}",
                p.policy, p.request_throughput, p.output_token_throughput, fmt_ms(p.ttft_ms.p50, 1),
                fmt_ms(p.ttft_ms.p99, 1), fmt_ms(p.tpot_ms.p50, 2), fmt_ms(p.tpot_ms.p99, 2),
                fmt_ms(p.itl_ms.p99, 2), fmt_ms(p.e2e_ms.p50, 1), fmt_ms(p.e2e_ms.p99, 1),
                p.counters.preemptions, 100.0 * p.prefix_cache_hit_rate,
                100.0 * p.counters.kv_usage_mean, pct(p.slo_attainment)
            );
        }
        for p in self.policies.iter().filter(|p| p.rejected > 0) {
            let _ = writeln!(
                s,
                "{}: {} of {} requests rejected, longer than max_model_len {} (the server \
                 answers them 400 context_length_exceeded)",
                p.policy, p.rejected, p.requests, self.max_model_len
            );
        }
        type Count = fn(&PolicySummary) -> u64;
        type TierCount = fn(&TierSummary) -> u64;
        let refusals: [(Count, TierCount, &str); 5] = [
            (
                |p| p.rate_limited,
                |t| t.rate_limited,
                "rate-limited by their tier's requests_per_minute or tokens_per_minute (the \
                 server answers them 429 rate_limit_exceeded)",
            ),
            (
                |p| p.queue_timeout,
                |t| t.queue_timeout,
                "timed out in the queue, not admitted within their max_queue_ms (the server \
                 answers them 503 queue_timeout)",
            ),
            (
                |p| p.overloaded,
                |t| t.overloaded,
                "refused at arrival, their tier at its max_pending_requests (the server \
                 answers them 503 overloaded)",
            ),
            (
                |p| p.tenant_busy,
                |t| t.tenant_busy,
                "refused at arrival, their tenant at its tier's max_pending_per_tenant (the \
                 server answers them 429 rate_limit_exceeded)",
            ),
            (
                |p| p.unavailable,
                |t| t.unavailable,
                "refused as they asked for their LoRA adapter, not registered, the registry \
                 full (lora_memory.max_adapters) of adapters in use or configured (the server \
                 answers them 503 unavailable)",
            ),
        ];
        for (count, tier_count, what) in refusals {
            for p in self.policies.iter().filter(|p| count(p) > 0) {
                // By tier, where the run has named tiers (an untiered run's one tier has
                // no name).
                let by_tier: Vec<String> = p
                    .tiers
                    .iter()
                    .filter(|t| tier_count(t) > 0 && !t.tier.is_empty())
                    .map(|t| format!("{} {}", t.tier, tier_count(t)))
                    .collect();
                let by_tier = if by_tier.is_empty() {
                    String::new()
                } else {
                    format!(": {}", by_tier.join(", "))
                };
                let _ = writeln!(
                    s,
                    "{}: {} of {} requests {what}{by_tier}",
                    p.policy,
                    count(p),
                    p.requests,
                );
            }
        }
        for p in &self.policies {
            let Some(taken) = &p.params_from_calibration else {
                continue;
            };
            let values: Vec<String> = [
                ("step_overhead_ms", taken.step_overhead_ms),
                ("prefill_us_per_token", taken.prefill_us_per_token),
            ]
            .iter()
            .filter_map(|(k, v)| v.map(|v| format!("{k} {v}")))
            .collect();
            let _ = writeln!(
                s,
                "{}: {} from calibration {} (derived from its fit; the spec's params leave \
                 {} unset)",
                p.policy,
                values.join(", "),
                taken.calibration,
                if values.len() > 1 { "them" } else { "it" }
            );
        }
        for p in &self.policies {
            let Some(h) = &p.host_kv else { continue };
            let _ = writeln!(
                s,
                "{}: host KV tier ({} blocks, {} GB/s to the host and {} GB/s back assumed): {} \
                 blocks offloaded ({} of them stored ahead of eviction), {} loaded back, {} \
                 prompt tokens found there ({:.1}% of those looked up), {:.3} s of copies in \
                 the steps ({:.3} s offloading, {:.3} s loading), {:.3} s of stores alongside \
                 them ({:.3} s of steps waiting for them)",
                p.policy,
                h.host_blocks,
                h.bandwidth_gb_s,
                h.load_bandwidth_gb_s,
                h.offloaded_blocks,
                h.stored_ahead_blocks,
                h.loaded_blocks,
                h.host_hit_tokens,
                if p.counters.prefix_queries > 0 {
                    100.0 * h.host_hit_tokens as f64 / p.counters.prefix_queries as f64
                } else {
                    0.0
                },
                h.copy_s,
                h.offload_copy_s,
                h.load_copy_s,
                h.store_copy_s,
                h.store_stall_s
            );
        }
        for p in self.policies.iter().filter(|p| p.counters.draft_tokens > 0) {
            let c = &p.counters;
            let _ = writeln!(
                s,
                "{}: speculative decoding accepted {} of {} draft tokens ({:.1}%)",
                p.policy,
                c.accepted_tokens,
                c.draft_tokens,
                100.0 * c.accepted_tokens as f64 / c.draft_tokens as f64
            );
        }
        for p in &self.policies {
            let Some(m) = &p.lora_memory else { continue };
            // Said only when the spec registers some, so that other runs' lines stay as they were.
            let registered = if m.registered > 0 {
                format!(", {} registered", m.registered)
            } else {
                String::new()
            };
            let _ = writeln!(
                s,
                "{}: LoRA memory (max_cpu_loras {}, {} pinned{}, {} ms a load from {}): {} loads, {} \
                 evictions ({} to make room in a tenant's share), {} requests refused by a \
                 tenant's full share, {} charges moved to a tenant using the adapter; registry \
                 (max_adapters {}): {} adapters unregistered to make room, {} requests refused \
                 by a full registry; {} of {} adapter requests waited for a load (wait p50 {} \
                 p99 {}); ttft p50/p99 pinned {}/{}, not pinned {}/{}",
                p.policy,
                m.max_cpu_loras,
                m.pinned,
                registered,
                m.load_ms,
                m.load_ms_from,
                m.loads,
                m.evictions,
                m.share_evictions,
                m.share_refusals,
                m.share_transfers,
                m.max_adapters,
                m.unregistrations,
                m.registry_refusals,
                m.waited,
                m.adapter_requests,
                fmt_ms(m.wait_ms.p50, 1),
                fmt_ms(m.wait_ms.p99, 1),
                fmt_ms(m.pinned_ttft_ms.p50, 1),
                fmt_ms(m.pinned_ttft_ms.p99, 1),
                fmt_ms(m.unpinned_ttft_ms.p50, 1),
                fmt_ms(m.unpinned_ttft_ms.p99, 1),
            );
        }
        let tiered = self
            .policies
            .iter()
            .any(|p| p.tiers.iter().any(|t| !t.tier.is_empty()));
        if tiered {
            let _ = writeln!(
                s,
                "\n{:<18} {:<10} {:>6} {:>8} {:>8} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9}",
                "policy",
                "tier",
                "reqs",
                "ttft tgt",
                "tpot tgt",
                "ttft%",
                "tpot%",
                "slo%",
                "goodput",
                "ttft p99",
                "tpot p99"
            );
            for p in &self.policies {
                for t in &p.tiers {
                    let _ = writeln!(
                        s,
                        "{:<18} {:<10} {:>6} {:>8} {:>8} {:>7} {:>7} {:>7} {:>9} {:>9} {:>9}",
                        p.policy,
                        t.tier,
                        t.requests,
                        target(t.ttft_target_ms),
                        target(t.tpot_target_ms),
                        pct(t.ttft_attainment),
                        pct(t.tpot_attainment),
                        pct(t.slo_attainment),
                        t.goodput_rps
                            .map_or("n/a".to_string(), |g| format!("{g:.2}")),
                        fmt_ms(t.ttft_ms.p99, 1),
                        fmt_ms(t.tpot_ms.p99, 2)
                    );
                }
            }
        }
        s.push_str(&crate::phases::phases_text(&self.policies));
        s
    }

    /// Writes `summary.json` and `summary.txt` into `dir`, each through a temporary file
    /// ([`crate::outputs::write_replacing`]).
    pub fn write(&self, dir: &Path) -> Result<(), SimError> {
        let text = serde_json::to_string_pretty(self).map_err(|e| {
            SimError::io(
                &dir.join(crate::outputs::SUMMARY_JSON),
                std::io::Error::other(e),
            )
        })?;
        crate::outputs::write_replacing(dir, crate::outputs::SUMMARY_JSON, |p| {
            std::fs::write(p, text + "\n").map_err(|e| SimError::io(p, e))
        })?;
        crate::outputs::write_replacing(dir, crate::outputs::SUMMARY_TXT, |p| {
            std::fs::write(p, self.to_text()).map_err(|e| SimError::io(p, e))
        })
    }
}

/// Writes one JSON object per request to `path`.
pub fn write_requests_jsonl(path: &Path, records: &[RequestRecord]) -> Result<(), SimError> {
    let file = std::fs::File::create(path).map_err(|e| SimError::io(path, e))?;
    let mut w = std::io::BufWriter::new(file);
    for r in records {
        serde_json::to_writer(&mut w, r)
            .map_err(|e| SimError::io(path, std::io::Error::other(e)))?;
        w.write_all(b"\n").map_err(|e| SimError::io(path, e))?;
    }
    w.flush().map_err(|e| SimError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_match_numpy_linear() {
        // numpy.percentile([1, 2, 3, 4], [50, 90, 99]) = [2.5, 3.7, 3.97]
        let mut v = vec![4.0, 1.0, 3.0, 2.0];
        let s = LatencyStats::from_values(&mut v);
        assert_eq!((s.count, s.mean, s.p50), (4, Some(2.5), Some(2.5)));
        let near = |x: Option<f64>, want: f64| x.is_some_and(|x| (x - want).abs() < 1e-12);
        assert!(near(s.p90, 3.7) && near(s.p99, 3.97));
        assert_eq!(LatencyStats::from_values(&mut []), LatencyStats::default());
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    fn rec(tier: &str, arrival: f64, finish: Option<f64>, met_ttft: Option<bool>) -> RequestRecord {
        rec2(tier, arrival, finish, met_ttft, finish.map(|_| true))
    }

    fn rec2(
        tier: &str,
        arrival: f64,
        finish: Option<f64>,
        met_ttft: Option<bool>,
        met_tpot: Option<bool>,
    ) -> RequestRecord {
        RequestRecord {
            tier: tier.into(),
            arrival_s: arrival,
            finish_s: finish,
            generated: if finish.is_some() { 10 } else { 0 },
            ttft_ms: finish.map(|_| 100.0),
            e2e_ms: finish.map(|f| (f - arrival) * 1e3),
            met_ttft,
            met_tpot,
            outcome: if finish.is_some() {
                "length".into()
            } else {
                "rejected".into()
            },
            ..Default::default()
        }
    }

    #[test]
    fn summary_counts_attainment_and_goodput() {
        // Premium has both targets (a rejected request misses both); batch has none.
        let rs = vec![
            rec("premium", 0.0, Some(2.0), Some(true)),
            rec("premium", 1.0, Some(4.0), Some(false)),
            rec2("premium", 2.0, None, Some(false), Some(false)),
            rec2("batch", 3.0, Some(5.0), None, None),
        ];
        let s = PolicySummary::new(
            "fcfs",
            &rs,
            &mut [],
            RunCounters {
                prefix_queries: 10,
                prefix_hits: 4,
                ..Default::default()
            },
        );
        assert_eq!((s.requests, s.finished, s.rejected), (4, 3, 1));
        assert_eq!(s.duration_s, 5.0);
        assert_eq!(s.request_throughput, 0.6);
        assert_eq!(s.output_token_throughput, 6.0);
        assert_eq!(s.prefix_cache_hit_rate, 0.4);
        // Only the three premium requests have targets; request 0 met them. Batch, without
        // targets, counts in neither attainment nor goodput.
        assert_eq!(s.slo_requests, 3);
        assert_eq!(s.slo_attainment, Some(1.0 / 3.0));
        assert_eq!(s.goodput_rps, Some(0.2));
        let premium = s.tiers.iter().find(|t| t.tier == "premium").unwrap();
        assert_eq!(premium.requests, 3);
        assert!((premium.ttft_attainment.unwrap() - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(premium.slo_attainment, Some(1.0 / 3.0));
        let batch = s.tiers.iter().find(|t| t.tier == "batch").unwrap();
        assert_eq!(batch.ttft_attainment, None);
        assert_eq!((batch.slo_attainment, batch.goodput_rps), (None, None));
        let c = Comparison {
            policies: vec![s],
            ..Default::default()
        };
        let text = c.to_text();
        assert!(
            text.contains("fcfs") && text.contains("premium") && text.contains("33.3"),
            "{text}"
        );
        let batch_row = text.lines().find(|l| l.contains("batch")).unwrap();
        // Attainments and goodput, and the TPOT of its one request, which has no second token.
        assert_eq!(batch_row.matches("n/a").count(), 5, "{batch_row}");
        assert!(text.contains("1 of 4 requests rejected"), "{text}");
    }

    /// The table says its units, and each tier's row the targets its attainments were
    /// measured against (it once showed bare numbers, ms or s, against unnamed targets).
    #[test]
    fn tier_rows_show_their_targets_and_the_table_its_units() {
        let rs = vec![
            rec("premium", 0.0, Some(1.0), Some(true)),
            rec2("batch", 0.0, Some(1.0), None, None),
        ];
        let mut s = PolicySummary::new("fcfs", &rs, &mut [], RunCounters::default());
        let tiers: BTreeMap<String, TierConf> =
            serde_yaml::from_str("{premium: {ttft_ms: 200, tpot_ms: 40.5}, batch: {}}").unwrap();
        s.set_tier_targets(&tiers);
        let premium = s.tiers.iter().find(|t| t.tier == "premium").unwrap();
        assert_eq!(
            (premium.ttft_target_ms, premium.tpot_target_ms),
            (Some(200.0), Some(40.5))
        );
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(json["tiers"][1]["ttft_target_ms"], serde_json::json!(200.0));
        let text = Comparison {
            policies: vec![s],
            ..Default::default()
        }
        .to_text();
        assert!(text.contains("latencies in ms;"), "{text}");
        let header = text.lines().find(|l| l.contains("ttft tgt")).unwrap();
        assert!(header.contains("tpot tgt"), "{header}");
        let row = |tier: &str| {
            text.lines()
                .find(|l| l.starts_with("fcfs") && l.contains(tier))
                .unwrap()
                .split_whitespace()
                .skip(3)
                .take(2)
                .collect::<Vec<_>>()
                .join(" ")
        };
        assert_eq!(row("premium"), "200 40.5");
        assert_eq!(row("batch"), "- -");
    }

    #[test]
    fn rate_limited_requests_are_counted_per_tier_and_miss_their_targets() {
        let limited = |tier: &str, arrival: f64| RequestRecord {
            outcome: RATE_LIMITED.into(),
            ..rec2(tier, arrival, None, Some(false), Some(false))
        };
        let rs = vec![
            rec("premium", 0.0, Some(2.0), Some(true)),
            limited("premium", 1.0),
            limited("premium", 1.5),
            limited("batch", 2.0),
        ];
        let s = PolicySummary::new("fcfs", &rs, &mut [], RunCounters::default());
        assert_eq!(
            (s.requests, s.finished, s.rejected, s.rate_limited),
            (4, 1, 0, 3)
        );
        assert_eq!(s.slo_attainment, Some(0.25));
        let premium = s.tiers.iter().find(|t| t.tier == "premium").unwrap();
        assert_eq!(premium.rate_limited, 2);
        let text = Comparison {
            policies: vec![s],
            ..Default::default()
        }
        .to_text();
        assert!(
            text.contains(
                "fcfs: 3 of 4 requests rate-limited by their tier's requests_per_minute or \
                 tokens_per_minute (the server answers them 429 rate_limit_exceeded): batch 1, \
                 premium 2"
            ),
            "{text}"
        );
    }

    #[test]
    fn an_untiered_runs_refusals_have_no_tier_list() {
        let limited = |arrival: f64| RequestRecord {
            outcome: RATE_LIMITED.into(),
            ..rec2("", arrival, None, None, None)
        };
        let rs = vec![rec2("", 0.0, Some(1.0), None, None), limited(1.0)];
        let s = PolicySummary::new("fcfs", &rs, &mut [], RunCounters::default());
        let text = Comparison {
            policies: vec![s],
            ..Default::default()
        }
        .to_text();
        let line = text
            .lines()
            .find(|l| l.starts_with("fcfs: 1 of 2"))
            .unwrap();
        assert!(
            line.ends_with("(the server answers them 429 rate_limit_exceeded)"),
            "{line}"
        );
    }

    #[test]
    fn without_any_target_attainment_is_not_applicable() {
        let rs = vec![
            rec2("", 0.0, Some(1.0), None, None),
            rec2("", 0.5, Some(2.0), None, None),
        ];
        let s = PolicySummary::new("fcfs", &rs, &mut [], RunCounters::default());
        assert_eq!(
            (s.slo_requests, s.slo_attainment, s.goodput_rps),
            (0, None, None)
        );
        let c = Comparison {
            policies: vec![s],
            ..Default::default()
        };
        let row = c.to_text().lines().nth(5).unwrap().to_string();
        assert!(row.starts_with("fcfs") && row.ends_with("n/a"), "{row}");
    }

    /// A policy none of whose requests finished (all rejected) has no latencies: n/a in the
    /// table and `null` in summary.json, not 0.0 (which reads as instant service).
    #[test]
    fn latencies_of_no_finished_request_are_not_applicable_not_zero() {
        let rejected = RequestRecord {
            tier: "premium".into(),
            arrival_s: 0.0,
            outcome: "rejected".into(),
            ..Default::default()
        };
        let s = PolicySummary::new("fcfs", &[rejected], &mut [], RunCounters::default());
        assert_eq!((s.finished, s.ttft_ms.count, s.ttft_ms.p50), (0, 0, None));
        let json = serde_json::to_value(&s).unwrap();
        assert_eq!(
            json["ttft_ms"],
            serde_json::json!({"count": 0, "mean": null, "p50": null, "p90": null, "p99": null})
        );
        assert_eq!(json["e2e_ms"]["p99"], serde_json::Value::Null);
        let c = Comparison {
            policies: vec![s],
            ..Default::default()
        };
        let text = c.to_text();
        let row = text.lines().find(|l| l.starts_with("fcfs ")).unwrap();
        // ttft p50/p99, tpot p50/p99, itl p99, e2e p50/p99, and slo%.
        assert_eq!(row.matches("n/a").count(), 8, "{row}");
        let tier_row = text.lines().find(|l| l.contains("premium")).unwrap();
        assert!(tier_row.trim_end().ends_with("n/a       n/a"), "{tier_row}");
    }

    #[test]
    fn latencies_are_written_rounded_to_the_nanosecond() {
        let r = RequestRecord {
            tpot_ms: Some(3.6999999999999997),
            ttft_ms: Some(0.1 + 0.2),
            ..Default::default()
        };
        let json = serde_json::to_string(&r).unwrap();
        assert!(
            json.contains("\"tpot_ms\":3.7,") && json.contains("\"ttft_ms\":0.3,"),
            "{json}"
        );
        assert_eq!(r.tpot_ms, Some(3.6999999999999997), "computation unchanged");
        let mut v = [0.1, 0.2, 0.3 + 0.4 + 1e-13];
        let stats = serde_json::to_string(&LatencyStats::from_values(&mut v)).unwrap();
        assert!(!stats.contains("0000000"), "{stats}");
    }

    /// The first line gives the rate of requests sent: the trace's without clients; with them
    /// the trace's named as such, then each policy's own; an older summary without
    /// `arrival_rate_of` reads as one without clients.
    #[test]
    fn the_rates_said_are_those_of_the_requests_sent() {
        let policy = |name: &str, rate: f64| PolicySummary {
            policy: name.into(),
            offered_rate: rate,
            offered_peak_rate: Some(rate + 1.0),
            ..Default::default()
        };
        let open = Comparison {
            model: "m".into(),
            hardware: "h".into(),
            requests: 10,
            arrival_rate: 5.0,
            arrival_rate_of: RATE_OF_SENT.into(),
            policies: vec![policy("fcfs", 5.0)],
            ..Default::default()
        };
        let first = open.to_text().lines().next().unwrap().to_string();
        assert_eq!(first, "m on h: 10 requests at 5.00 req/s, max_model_len 0");
        let json = serde_json::to_value(&open).unwrap();
        assert!(json.get("clients").is_none(), "{json}");
        assert_eq!(json["arrival_rate_of"], "sent");
        let closed = Comparison {
            clients: 3,
            arrival_rate_of: RATE_OF_TRACE.into(),
            policies: vec![policy("fcfs", 2.0), policy("priority", 2.5)],
            ..open.clone()
        };
        let first = closed.to_text().lines().next().unwrap().to_string();
        assert_eq!(
            first,
            "m on h: 10 requests of 3 closed-loop clients, their trace's arrival_s at 5.00 \
             req/s, max_model_len 0; sent (each after the client's request before it ended, \
             and its think time): fcfs 2.00 req/s (peak 3.00 over 10 s), priority 2.50 req/s \
             (peak 3.50 over 10 s)"
        );
        let json = serde_json::to_value(&closed).unwrap();
        assert_eq!(
            (&json["clients"], &json["arrival_rate_of"]),
            (&3.into(), &"trace".into())
        );
        assert_eq!(json["policies"][1]["offered_rate"], 2.5);
        let mut old = serde_json::to_value(&open).unwrap();
        old.as_object_mut().unwrap().remove("arrival_rate_of");
        let old: Comparison = serde_json::from_value(old).unwrap();
        assert_eq!(old.arrival_rate_of, RATE_OF_SENT);
    }
}
