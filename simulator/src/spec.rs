//! The simulation spec: one YAML file (or a set of CLI flags) describing the
//! model, hardware, KV capacity, scheduler limits, policies with parameters,
//! tiers and the workload. Unknown fields are errors, and every error names
//! the file with the line and column serde_yaml reports.
//!
//! ```yaml
//! seed: 1
//! model: llama-3-8b            # a preset name, or the fields of `ModelSpec`
//!                              # (presets: llama-3-8b, llama-3.1-8b, smollm2-135m,
//!                              # qwen2.5-0.5b, qwen3-0.6b, phi-3-mini, mistral-7b-v0.1)
//! hardware: h200               # a preset name, or the fields of `HardwareSpec`
//! calibration: cal.yaml        # optional, from `switchyard calibrate`: replaces the roofline
//! cache: { block_size: 16, gpu_memory_utilization: 0.9, prefix_caching: true, prefix_sharing: tenant }
//!   # kv_offloading_size: 64   # GiB of host KV tier (or num_host_blocks: N); 0: none
//!   # host_bandwidth_gb_s: 50  # device -> host copy rate, GB/s (assumed default), and
//!   # host_load_bandwidth_gb_s: 50  # host -> device (default: host_bandwidth_gb_s)
//!   # kv_offloading_ahead: true  # store cached blocks once computed, beside a step (the
//!   #                            # server's default); false: copy each at its eviction
//! scheduler: { max_num_seqs: 256, max_num_batched_tokens: 8192, max_model_len: 8192 }
//!   # lora: { rank: 16, targets: all }  # the adapters trace records name, for the roofline
//!   # lora_memory: { max_cpu_loras: 8, pinned: [1, 2], load_ms: 40 }  # adapters in host memory
//!   #   (and max_adapters: 64, the registry's size, as the server's lora.max_adapters;
//!   #   registered: [3, 4], lora.adapters entries that are not pinned)
//! policies: [ { name: fcfs }, { name: slo-aware, params: {} } ]
//! tiers:
//!   premium: { ttft_ms: 500, tpot_ms: 50, weight: 4, priority: 0 }
//!   batch: { preemptible: true, priority: 2 }
//! workload:
//!   trace: ../../shared/traces/AzureLLMInferenceTrace_code.csv   # relative to this file
//!   format: azure
//!   time_scale: 2              # optional: divides arrival times (2 = twice as fast)
//!   arrival: { load: 0.9 }     # or { rate: 20 }; sharegpt: { process: gamma, cv: 2, rate: 5 }
//!   mix: { tiers: { premium: 0.2, standard: 0.5, batch: 0.3 } }
//!   # adapters: { count: 200, popularity: zipf, s: 1.1, fraction: 1.0 }  # LoRA adapters drawn
//! ```

use crate::cost::{HardwareSpec, LoraSpec, ModelSpec};

use crate::error::SimError;
use crate::trace::{LabelMix, TraceFormat};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Most policies compared in one run.
pub const MAX_POLICIES: usize = 32;
/// Largest spec or calibration file read, in bytes.
pub const MAX_SPEC_BYTES: u64 = 1 << 20;

/// Reads the UTF-8 text of the regular file `path` (a spec, tiers or calibration file), of at
/// most `max` bytes, as `config check` reads a configuration: its kind is checked before it is
/// opened, so a FIFO (whose opening waits for a writer: `simulate --config` hung on one,
/// silently) or a device is refused at once, as is a directory, named as one.
pub(crate) fn read_text(path: &Path, max: u64) -> Result<String, SimError> {
    use switchyard_config::ReadError;
    let refused = |why: String| {
        SimError::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, why),
        )
    };
    let bytes = switchyard_config::read_bytes(path, max).map_err(|e| match e {
        ReadError::Io(e) => SimError::io(path, e),
        ReadError::Invalid(_) if path.is_dir() => refused("is a directory, not a file".into()),
        ReadError::Invalid(why) => refused(why),
    })?;
    String::from_utf8(bytes).map_err(|e| {
        refused(format!(
            "not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// Largest host time per step accepted, in microseconds (10 s: far above any real step, and
/// small enough that the virtual clock cannot overflow).
pub const MAX_HOST_OVERHEAD_US: f64 = 1e7;

/// Most tiers (or tenants) in a spec.
pub const MAX_LABELS: usize = 256;

pub use crate::short_number::short_number;

/// Accepted `workload.time_scale` (and `simulate --time-scale`): a million times slower to a
/// million times faster. Further out, arrivals leave the clock's year or collapse to one
/// instant.
pub const TIME_SCALE_RANGE: std::ops::RangeInclusive<f64> = 1e-6..=1e6;
/// Accepted `workload.arrival.rate` (and `simulate --rate`), in requests per second.
pub const RATE_RANGE: std::ops::RangeInclusive<f64> = 1e-6..=1e6;
/// Accepted `workload.arrival.load` (and `simulate --load`), a fraction of the estimated
/// capacity.
pub const LOAD_RANGE: std::ops::RangeInclusive<f64> = 1e-3..=100.0;
/// Accepted `workload.arrival.cv`: the gamma gaps' coefficient of variation (1 is Poisson's).
pub const CV_RANGE: std::ops::RangeInclusive<f64> = 1e-3..=100.0;
/// Accepted `workload.clients.think_s`, in seconds (a trace record's own `think_s` too).
pub const THINK_RANGE: std::ops::RangeInclusive<f64> = 0.0..=crate::trace::MAX_THINK_S;
/// Accepted `workload.clients.start_jitter_s`, in seconds (one day).
pub const START_JITTER_RANGE: std::ops::RangeInclusive<f64> = 0.0..=86_400.0;

/// A complete simulation description.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimulationSpec {
    /// Seed for mixes, arrivals and the prefix-hash key.
    #[serde(default)]
    pub seed: u64,
    /// The model: a preset name or a full shape.
    #[serde(default = "default_model")]
    pub model: ModelChoice,
    /// The accelerator: a preset name or full figures.
    #[serde(default = "default_hardware")]
    pub hardware: HardwareChoice,
    /// Optional calibration file (relative to the spec file) replacing the roofline.
    #[serde(default)]
    pub calibration: Option<PathBuf>,
    /// KV cache layout and capacity.
    #[serde(default)]
    pub cache: CacheSection,
    /// Batch limits.
    #[serde(default)]
    pub scheduler: SchedulerLimits,
    /// Policies to compare, each run on the same workload.
    pub policies: Vec<PolicySpec>,
    /// Service tiers by name.
    #[serde(default)]
    pub tiers: BTreeMap<String, TierConf>,
    /// The request workload.
    pub workload: WorkloadSpec,
    /// What an operator changes while the server runs, at simulated times: a policy swap
    /// (`PUT /admin/policy`) or what a SIGHUP applies, tiers included ([`crate::changes`]).
    /// Each policy of `policies` starts the run and the changes follow it; the report has
    /// figures per phase.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub changes: Vec<crate::changes::ChangeSpec>,
    /// The file the spec was read from ("<cli>" for flags): named by errors found once the
    /// spec is parsed (building the simulation, shaping the workload). Not a field of the file.
    #[serde(skip)]
    pub source: PathBuf,
    /// The line of the file each entry of `changes` starts on, where the YAML's layout shows
    /// it: named by the errors about a change found once the workload is loaded. Not a field
    /// of the file.
    #[serde(skip)]
    pub change_lines: Vec<Option<usize>>,
}

fn default_model() -> ModelChoice {
    ModelChoice::Preset("llama-3-8b".into())
}

fn default_hardware() -> HardwareChoice {
    HardwareChoice::Preset("h200".into())
}

/// A model preset name or an inline shape.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ModelChoice {
    /// A preset (see [`ModelSpec::PRESETS`]).
    Preset(String),
    /// A full model shape.
    Custom(ModelSpec),
}

/// A hardware preset name or inline figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum HardwareChoice {
    /// `h200`.
    Preset(String),
    /// Full figures.
    Custom(HardwareSpec),
}

/// A preset's name (a string) or a full description (a mapping, read as `T`), as `model` and
/// `hardware` are written; anything else is refused saying so (an untagged enum's error would
/// name neither form).
fn preset_or_custom<'de, D, T>(
    d: D,
    field: &str,
    presets: &str,
) -> Result<Result<String, T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: serde::de::DeserializeOwned,
{
    use serde::de::Error;
    match serde_yaml::Value::deserialize(d)? {
        serde_yaml::Value::String(name) => Ok(Ok(name)),
        v @ serde_yaml::Value::Mapping(_) => serde_yaml::from_value(v)
            .map(Err)
            .map_err(|e| D::Error::custom(format!("`{field}` as a mapping: {e}"))),
        _ => Err(D::Error::custom(format!(
            "`{field}` is a preset name ({presets}) or a mapping of its figures"
        ))),
    }
}

impl<'de> Deserialize<'de> for ModelChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match preset_or_custom(d, "model", ModelSpec::PRESETS)? {
            Ok(name) => ModelChoice::Preset(name),
            Err(spec) => ModelChoice::Custom(spec),
        })
    }
}

impl<'de> Deserialize<'de> for HardwareChoice {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match preset_or_custom(d, "hardware", "h200")? {
            Ok(name) => HardwareChoice::Preset(name),
            Err(spec) => HardwareChoice::Custom(spec),
        })
    }
}

/// KV cache settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheSection {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks; computed from the hardware's memory when absent, which needs the roofline:
    /// with a calibration file it must be given (the server logs its number of blocks).
    pub num_gpu_blocks: Option<usize>,
    /// Fraction of device memory for weights plus KV.
    pub gpu_memory_utilization: f64,
    /// Automatic prefix caching.
    pub prefix_caching: bool,
    /// Whose requests share cached prefixes, as the server's `cache.prefix_sharing`:
    /// `tenant` (the server's default) or `global`.
    pub prefix_sharing: switchyard_config::PrefixSharing,
    /// GiB of host memory for the host KV tier, as the server's `cache.kv_offloading_size`:
    /// full cached blocks evicted from the device are copied there and a prefix found there
    /// is copied back instead of recomputed. 0 (the default): none. Converted to blocks with
    /// the model's KV bytes per block.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_offloading_size: f64,
    /// The host KV tier in blocks, instead of `kv_offloading_size` (both set: an error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_host_blocks: Option<usize>,
    /// The rate of a copy from the device to the host tier (an offload), in GB/s (10^9
    /// bytes), and of a copy back too unless `host_load_bandwidth_gb_s` is set. Default 50:
    /// an assumption (PCIe Gen5 x16 from pinned host memory, about 64 GB/s raw per
    /// direction, less protocol overhead), not a measurement. A step's offloads at eviction
    /// and loads cost `blocks * block_bytes / bandwidth` on top of its compute, each
    /// direction at its rate; stores ahead of eviction (`kv_offloading_ahead`) take as long
    /// alongside it.
    #[serde(skip_serializing_if = "is_default_host_bandwidth")]
    pub host_bandwidth_gb_s: f64,
    /// The rate of a copy from the host tier back to the device (a load), in GB/s; absent:
    /// `host_bandwidth_gb_s`. The CUDA backend's copy kernel is asymmetric: on an H100 it
    /// moved 48.8 GiB/s (52.4 GB/s) to the host and 32.2 GiB/s (34.6 GB/s) back.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_load_bandwidth_gb_s: Option<f64>,
    /// With a host tier, as the server's `cache.kv_offloading_ahead` (default on): cached
    /// blocks are copied to the tier ahead of their eviction once computed (registered in the
    /// prefix cache), on a copy engine of their own alongside the next step, so that evicting
    /// them copies nothing. A step's stores take `blocks * block_bytes / host_bandwidth_gb_s`
    /// from its start (after its own copies); the step after it waits for them, so stores
    /// that outlast a step delay the next one (a stall). Off: each block is copied when it is
    /// evicted, in the time of the step that evicts it.
    #[serde(skip_serializing_if = "is_true")]
    pub kv_offloading_ahead: bool,
}

impl CacheSection {
    /// The host tier's load (host to device) rate in GB/s: `host_load_bandwidth_gb_s`, else
    /// `host_bandwidth_gb_s`.
    pub fn host_load_bandwidth(&self) -> f64 {
        self.host_load_bandwidth_gb_s
            .unwrap_or(self.host_bandwidth_gb_s)
    }
}

/// The assumed host <-> device copy rate, GB/s per direction (see
/// [`CacheSection::host_bandwidth_gb_s`]).
pub const DEFAULT_HOST_BANDWIDTH_GB_S: f64 = 50.0;

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

fn is_true(v: &bool) -> bool {
    *v
}

fn is_default_host_bandwidth(v: &f64) -> bool {
    *v == DEFAULT_HOST_BANDWIDTH_GB_S
}

impl Default for CacheSection {
    fn default() -> Self {
        CacheSection {
            block_size: 16,
            num_gpu_blocks: None,
            gpu_memory_utilization: 0.9,
            prefix_caching: true,
            prefix_sharing: switchyard_config::PrefixSharing::Tenant,
            kv_offloading_size: 0.0,
            num_host_blocks: None,
            host_bandwidth_gb_s: DEFAULT_HOST_BANDWIDTH_GB_S,
            host_load_bandwidth_gb_s: None,
            kv_offloading_ahead: true,
        }
    }
}

/// Scheduler batch limits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerLimits {
    /// Most sequences per step.
    pub max_num_seqs: usize,
    /// Most tokens per step.
    pub max_num_batched_tokens: usize,
    /// Longest prompt + output, as the server's `model.max_model_len`: longer requests are
    /// rejected (the server answers them 400 `context_length_exceeded`) and counted as such.
    /// Defaults to the model's context (`max_position_embeddings`), lowered to what the KV
    /// cache holds; a value above the model's context, or above the KV cache, is an error.
    pub max_model_len: Option<usize>,
    /// Plan each step while the previous one runs, as the server does on a GPU
    /// (`scheduler.async_scheduling`): a request that arrives during a step is admitted a step
    /// later, and the host's time per step (`host_overhead_us`) hides behind the device's.
    pub async_scheduling: bool,
    /// The host's time per step in microseconds (planning, building the batch, launching,
    /// applying outputs; `SWITCHYARD_CUDA_STEP_TIMING` shows the GPU idle this long between
    /// steps): added to every step in order, overlapped with the step before when
    /// `async_scheduling` is on. Unset: the calibration file's `host_overhead_us` when it has
    /// one (the engine's own work, without the server's actor hand-offs that its
    /// `switchyard:engine_step_overhead_seconds` also counts: README), else 0.
    pub host_overhead_us: Option<f64>,
    /// The front end's fixed time per request in microseconds (HTTP, JSON, chat template,
    /// tokenization, the hops to the scheduler): a request is queued this long after its
    /// arrival, without occupying the engine ([`crate::front_end`]). The server's
    /// `switchyard:request_front_end_seconds` measures it. Unset: the calibration file's
    /// `front_end_us` when it has one, else 0.
    pub front_end_us: Option<f64>,
    /// The front end's time per prompt token in microseconds (tokenization), added to
    /// `front_end_us`. Unset: the calibration file's `front_end_per_token_us`, else 0.
    pub front_end_per_token_us: Option<f64>,
    /// The server's bound on requests in flight in all (`server.max_pending_requests`: the
    /// server's default is 4,096), 1 to 1,000,000: a request arriving while that many are in
    /// flight (queued or running) is refused (`overloaded`), as the server's 503. Unset: no
    /// bound (the tiers' own bounds still apply).
    pub max_pending_requests: Option<usize>,
    /// Most distinct LoRA adapters among the running requests (trace records may name an
    /// `adapter`), as the server's `lora.max_loras`.
    pub max_loras: usize,
    /// The adapters' rank and adapted projections, as the roofline prices a step's adapted
    /// tokens (default rank 16 on all seven projections; a calibration file's LoRA terms
    /// price them instead).
    pub lora: LoraSpec,
    /// Speculative decoding, modelled: the simulator has no real tokens to look up, so each
    /// draft is accepted with a fixed probability instead.
    pub speculative: Option<SimSpeculative>,
    /// The queue bound of requests whose tier sets none, as the server's
    /// `scheduler.max_queue_ms` (1 to 3,600,000 ms; unset: none): see
    /// [`TierConf::max_queue_ms`].
    pub max_queue_ms: Option<u64>,
    /// The LoRA adapters kept in host memory, as the server's `lora.max_cpu_loras` and pinned
    /// adapters keep them ([`crate::lora_memory`]): a request whose adapter is not in memory
    /// waits for it to be read from its files. Unset: every adapter is always in memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora_memory: Option<LoraMemorySpec>,
}

/// `scheduler.lora_memory`: the server's host memory for LoRA adapters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraMemorySpec {
    /// Most adapters kept in memory, those in use included (the server's
    /// `lora.max_cpu_loras`, default 8, 0 to 4,096).
    #[serde(default = "default_max_cpu_loras")]
    pub max_cpu_loras: usize,
    /// Adapter ids (as trace records and `workload.adapters` name them) never evicted, in
    /// memory from the start (the server's `lora.adapters[].pinned`): at most `max_cpu_loras`.
    #[serde(default)]
    pub pinned: Vec<u32>,
    /// Adapter ids registered from the start but not pinned (the server's `lora.adapters`
    /// entries without `pinned: true`), in the file's order: each holds a place in the
    /// registry (`max_adapters`) for the whole run, never unregistered to make room, and is
    /// evicted from memory as any other and read again on its next request, never refused
    /// for the registry; the last `max_cpu_loras` less the pinned ones are in memory from the
    /// start ([`crate::lora_registry`]). At most `max_adapters` with the pinned ones, each
    /// once, none of them pinned too.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub registered: Vec<u32>,
    /// Time to read one adapter from its files, in milliseconds (0 to 600,000): the server
    /// logs it per load ("LoRA adapter loaded", `ms`). Unset: the calibration file's
    /// `lora_load_ms` (`switchyard calibrate --lora` measures it); one of them is needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_ms: Option<f64>,
    /// Most adapters registered at once (the server's `lora.max_adapters`, default 64, 1 to
    /// 4,096): the pinned and `registered` ones from the start, and every other adapter from
    /// its first request (as one found in `lora.adapter_dirs`) until it is unregistered to
    /// make room for another ([`crate::lora_registry`]). Only registered adapters are in memory, so below
    /// `max_cpu_loras` it bounds memory; a request for an adapter not registered while the
    /// registry is full of adapters in use (or pinned) is refused (`unavailable`, the server's
    /// 503).
    #[serde(default = "default_max_adapters")]
    pub max_adapters: usize,
}

fn default_max_cpu_loras() -> usize {
    8
}

fn default_max_adapters() -> usize {
    crate::lora_registry::default_max_adapters()
}

/// Speculative decoding as the simulator models it: decode steps carry up to
/// `num_speculative_tokens` drafts (from what the step leaves over, as in the engine), and a
/// step yields one token plus the run of drafts accepted from the first: each draft is accepted
/// with a fixed probability once the ones before it were (the usual i.i.d. model of speculative
/// decoding analyses). `acceptance_rate` is the figure the server and `bench serve` report,
/// accepted draft tokens / draft tokens over a run
/// (`switchyard:spec_decode_num_accepted_tokens_total / ..._num_draft_tokens_total`), so a
/// measured figure can be pasted in: for a step of `d` drafts the simulator draws with the
/// per-draft probability `p` that gives `(p + p² + ... + p^d) / d = acceptance_rate`, so the
/// run's accepted / draft tokens comes out at `acceptance_rate` whatever the number of drafts
/// per step. The cost model prices the drafts as the tokens they are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimSpeculative {
    /// Most drafts per sequence and step (1..=16).
    pub num_speculative_tokens: usize,
    /// Accepted draft tokens / draft tokens over the run (0..=1), as the server's metrics and
    /// `bench serve` report it.
    pub acceptance_rate: f64,
    /// No drafts while more sequences than this run (0: no limit), as the engine's
    /// `speculative.max_running`.
    #[serde(default)]
    pub max_running: usize,
}

impl LoraMemorySpec {
    /// Checks the bounds, naming the field.
    fn validate(&self) -> Result<(), String> {
        let max = crate::lora_memory::MAX_CPU_LORAS;
        if self.max_cpu_loras > max {
            return Err(format!(
                "scheduler.lora_memory.max_cpu_loras {} outside 0..={max} (the server's bound)",
                self.max_cpu_loras
            ));
        }
        let max_adapters = crate::lora_registry::MAX_ADAPTERS;
        if !(1..=max_adapters).contains(&self.max_adapters) {
            return Err(format!(
                "scheduler.lora_memory.max_adapters {} outside 1..={max_adapters} (the server's \
                 bound)",
                self.max_adapters
            ));
        }
        if self.pinned.len() > self.max_cpu_loras {
            return Err(format!(
                "scheduler.lora_memory.pinned: {} adapters, but at most max_cpu_loras ({}) \
                 may be pinned in memory (the server refuses more)",
                self.pinned.len(),
                self.max_cpu_loras
            ));
        }
        if self.pinned.len() > self.max_adapters {
            return Err(format!(
                "scheduler.lora_memory.pinned: {} adapters, but at most max_adapters ({}) \
                 may be registered (the server refuses more)",
                self.pinned.len(),
                self.max_adapters
            ));
        }
        for (i, a) in self.pinned.iter().enumerate() {
            if self.pinned[..i].contains(a) {
                return Err(format!(
                    "scheduler.lora_memory.pinned[{i}]: adapter {a} is listed twice"
                ));
            }
        }
        let configured = self.pinned.len().saturating_add(self.registered.len());
        if configured > self.max_adapters {
            return Err(format!(
                "scheduler.lora_memory.registered: {} adapters and {} pinned, {configured} \
                 in all, but at most max_adapters ({}) may be registered (the server refuses \
                 more lora.adapters)",
                self.registered.len(),
                self.pinned.len(),
                self.max_adapters
            ));
        }
        for (i, a) in self.registered.iter().enumerate() {
            if self.registered[..i].contains(a) {
                return Err(format!(
                    "scheduler.lora_memory.registered[{i}]: adapter {a} is listed twice"
                ));
            }
            if self.pinned.contains(a) {
                return Err(format!(
                    "scheduler.lora_memory.registered[{i}]: adapter {a} is pinned too (the \
                     server's lora.adapters lists an adapter once, pinned or not)"
                ));
            }
        }
        if let Some(ms) = self.load_ms {
            crate::lora_memory::check_load_ms("scheduler.lora_memory.load_ms", ms)?;
        }
        Ok(())
    }
}

impl Default for SchedulerLimits {
    fn default() -> Self {
        SchedulerLimits {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            max_model_len: None,
            async_scheduling: false,
            host_overhead_us: None,
            front_end_us: None,
            max_pending_requests: None,
            front_end_per_token_us: None,
            max_loras: 4,
            lora: LoraSpec::default(),
            speculative: None,
            max_queue_ms: None,
            lora_memory: None,
        }
    }
}

/// One policy to run, with its YAML parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a policy as a mapping, `{name: fcfs}` or `{name: priority, params: {...}, label: ...}`"
)]
pub struct PolicySpec {
    /// Registered policy name.
    pub name: String,
    /// Label in reports and file names; defaults to `name`.
    #[serde(default)]
    pub label: Option<String>,
    /// Policy parameters, passed to the registry as is.
    #[serde(default)]
    pub params: serde_yaml::Value,
}

impl PolicySpec {
    /// A policy by name with default parameters.
    pub fn named(name: &str) -> Self {
        PolicySpec {
            name: name.to_string(),
            label: None,
            params: serde_yaml::Value::Null,
        }
    }

    /// The label used in reports.
    pub fn label(&self) -> &str {
        self.label.as_deref().unwrap_or(&self.name)
    }
}

/// A service tier.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TierConf {
    /// Time-to-first-token target in ms.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// Time-per-output-token target in ms.
    #[serde(default)]
    pub tpot_ms: Option<f64>,
    /// Share weight.
    #[serde(default = "one")]
    pub weight: f64,
    /// Whether its requests may be preempted first.
    #[serde(default)]
    pub preemptible: bool,
    /// Priority of its requests (default 0; lower is more urgent, as vLLM's): the most urgent
    /// they may be. A request's own `priority` (JSONL traces) counts where it is later, as in
    /// the server (`switchyard_policies::request_priority`).
    #[serde(default)]
    pub priority: i32,
    /// The server's bound on the tier's requests in flight (`tiers.<name>.max_pending_requests`
    /// of a server configuration, 1 to 1,000,000): a request arriving while the tier has that
    /// many in flight (arrived, not ended) is refused, as the server answers it 503
    /// `overloaded`, and reported `overloaded`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_requests: Option<usize>,
    /// The server's bound on each tenant's requests in flight in the tier
    /// (`tiers.<name>.max_pending_per_tenant`, 1 to 1,000,000): a request arriving while its
    /// tenant has that many in flight is refused, as the server answers it 429, and reported
    /// `tenant_busy`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending_per_tenant: Option<usize>,
    /// The server's rate limits of the tier's tenants (`tiers.<name>.requests_per_minute`,
    /// `tokens_per_minute`): a request its tenant may not send at its arrival is refused, as
    /// the server answers it 429, and reported `rate_limited`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requests_per_minute: Option<u64>,
    /// See [`TierConf::requests_per_minute`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_minute: Option<u64>,
    /// The server's queue bound of the tier's requests (`tiers.<name>.max_queue_ms`, 1 to
    /// 3,600,000): a request not admitted within it of its arrival is ended by the scheduling
    /// core and reported `queue_timeout`. Unset: `scheduler.max_queue_ms`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queue_ms: Option<u64>,
    /// The server's KV quota of the tier (`tiers.<name>.max_kv_fraction`, in (0, 1]): the
    /// most of the simulated KV cache its running requests hold at once, enforced by the
    /// scheduling core; a request it could never hold is refused (`rejected`). Unset: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_kv_fraction: Option<f64>,
    /// The server's share of LoRA adapter memory per tenant
    /// (`tiers.<name>.max_cpu_loras_per_tenant`, 1 to 4,096): with `scheduler.lora_memory`,
    /// each load is charged to its request's tenant within it ([`crate::lora_memory`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cpu_loras_per_tenant: Option<usize>,
}

impl TierConf {
    /// The tier's rate limits.
    pub fn rate_limits(&self) -> switchyard_policies::rate_limit::TierLimits {
        switchyard_policies::rate_limit::TierLimits {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
        }
    }
}

fn one() -> f64 {
    1.0
}

/// The workload: a trace and how to shape it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    /// Trace file, relative to the spec file.
    pub trace: PathBuf,
    /// Its format.
    pub format: TraceFormat,
    /// Keep at most this many requests (1 or more), the first ones by arrival.
    #[serde(default)]
    pub limit: Option<usize>,
    /// Drop requests before this time (s, trace clock).
    #[serde(default)]
    pub start_s: Option<f64>,
    /// Drop requests at or after this time (s, trace clock).
    #[serde(default)]
    pub end_s: Option<f64>,
    /// Divide arrival times by this factor after loading (2 = twice as fast), as
    /// `simulate --time-scale` and `bench serve --time-scale` do.
    #[serde(default)]
    pub time_scale: Option<f64>,
    /// Arrival rate or load; required for sharegpt (it has no timestamps).
    #[serde(default)]
    pub arrival: Option<ArrivalSpec>,
    /// Tier and tenant mixes for requests without labels.
    #[serde(default)]
    pub mix: MixSpec,
    /// LoRA adapters drawn for the requests that name none (every trace but a JSONL one
    /// naming `adapter`s): see [`AdapterMix`]. Unset: requests keep the trace's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<AdapterMix>,
    /// How the trace's closed-loop clients (its records' `client`) pause between requests
    /// and start: see [`ClientsSpec`]. Unset: no pause but a record's own `think_s`, and
    /// each client starts at its first request's `arrival_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clients: Option<ClientsSpec>,
}

/// `workload.clients`: what the simulator draws, from the spec's seed (the same draws in every
/// policy's run), for the closed-loop clients a JSONL trace names.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientsSpec {
    /// The mean pause, in seconds, between the end of a client's request and the sending of
    /// its next one (0 to 3,600), for each request whose record gives no `think_s` of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub think_s: Option<f64>,
    /// How the pauses are drawn around `think_s`: `exponential` (default; memoryless, as a
    /// user's) or `constant` (every pause `think_s`).
    #[serde(default)]
    pub think: ThinkKind,
    /// Each client's requests are all sent later by one draw, uniform in `[0,
    /// start_jitter_s)` seconds (0 to 86,400), so that clients starting together do not send
    /// in step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_jitter_s: Option<f64>,
}

/// How `workload.clients` draws think times.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ThinkKind {
    /// Exponentially distributed with mean `think_s`.
    #[default]
    Exponential,
    /// Always `think_s`.
    Constant,
}

impl ClientsSpec {
    /// Checks the bounds, naming the field; `format` is the trace's.
    fn validate(&self, format: TraceFormat) -> Result<(), String> {
        if format != TraceFormat::Jsonl {
            return Err(format!(
                "workload.clients: only a jsonl trace names clients (a record's `client`); \
                 the {} trace has none",
                format.name()
            ));
        }
        if let Some(t) = self.think_s.filter(|t| !THINK_RANGE.contains(t)) {
            return Err(format!(
                "workload.clients.think_s {} outside {} (seconds)",
                short_number(t),
                show_range(&THINK_RANGE)
            ));
        }
        if self.think == ThinkKind::Constant && self.think_s.is_none() {
            return Err("workload.clients.think: `constant` needs `think_s`".into());
        }
        if let Some(j) = self
            .start_jitter_s
            .filter(|j| !START_JITTER_RANGE.contains(j))
        {
            return Err(format!(
                "workload.clients.start_jitter_s {} outside {} (seconds)",
                short_number(j),
                show_range(&START_JITTER_RANGE)
            ));
        }
        Ok(())
    }
}

/// Most adapters `workload.adapters.count` draws from.
pub const MAX_WORKLOAD_ADAPTERS: u32 = 4096;
/// Largest zipf exponent `workload.adapters.s`.
pub const MAX_ZIPF_S: f64 = 10.0;

/// `workload.adapters`: each request without an adapter is given one, drawn from the spec's
/// seed (the same requests get the same adapters in every run and policy): with probability
/// `fraction` one of the adapters `1..=count`, by `popularity`; else none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterMix {
    /// Adapters drawn from, ids `1..=count` (1 to 4,096).
    pub count: u32,
    /// `zipf` (default: adapter `k` drawn in proportion to `1 / k^s`, so 1 is the most
    /// popular) or `uniform`.
    #[serde(default)]
    pub popularity: Popularity,
    /// The zipf exponent (0 to 10, default 1; 0 is uniform); `zipf` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub s: Option<f64>,
    /// Share of the requests given an adapter (0 to 1, default 1).
    #[serde(default = "one")]
    pub fraction: f64,
}

/// How `workload.adapters` picks among its adapters.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Popularity {
    /// Adapter `k` in proportion to `1 / k^s`.
    #[default]
    Zipf,
    /// Each alike.
    Uniform,
}

impl AdapterMix {
    /// Each adapter's weight, adapter `k` (from 1) at index `k - 1`.
    pub fn weights(&self) -> Vec<f64> {
        let s = match self.popularity {
            Popularity::Zipf => self.s.unwrap_or(1.0),
            Popularity::Uniform => 0.0,
        };
        (1..=self.count).map(|k| f64::from(k).powf(-s)).collect()
    }

    /// Checks the bounds, naming the field.
    fn validate(&self) -> Result<(), String> {
        if !(1..=MAX_WORKLOAD_ADAPTERS).contains(&self.count) {
            return Err(format!(
                "workload.adapters.count {} outside 1..={MAX_WORKLOAD_ADAPTERS}",
                self.count
            ));
        }
        if let Some(s) = self.s {
            if self.popularity == Popularity::Uniform {
                return Err("workload.adapters.s is the zipf exponent: remove it for \
                            `popularity: uniform`"
                    .into());
            }
            if !(0.0..=MAX_ZIPF_S).contains(&s) {
                return Err(format!(
                    "workload.adapters.s {} outside 0..={MAX_ZIPF_S} (the zipf exponent)",
                    short_number(s)
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.fraction) {
            return Err(format!(
                "workload.adapters.fraction {} outside 0..=1 (the share of requests given an \
                 adapter)",
                short_number(self.fraction)
            ));
        }
        Ok(())
    }
}

/// Arrival shaping: a rate or a load fraction of the estimated capacity.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArrivalSpec {
    /// `poisson` (default) or `gamma`; used for traces without timestamps.
    #[serde(default)]
    pub process: Option<ProcessKind>,
    /// Mean requests per second.
    #[serde(default)]
    pub rate: Option<f64>,
    /// Fraction of the estimated capacity (saturation throughput under fcfs).
    #[serde(default)]
    pub load: Option<f64>,
    /// Coefficient of variation of gamma gaps.
    #[serde(default)]
    pub cv: Option<f64>,
}

/// Arrival process kinds.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessKind {
    /// Exponential gaps.
    Poisson,
    /// Gamma gaps with a given cv.
    Gamma,
}

/// Weighted label mixes.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MixSpec {
    /// Tier name → weight.
    #[serde(default)]
    pub tiers: BTreeMap<String, f64>,
    /// Tenant name → weight.
    #[serde(default)]
    pub tenants: BTreeMap<String, f64>,
}

impl MixSpec {
    /// The tier mix in name order.
    pub fn tier_mix(&self) -> LabelMix {
        to_mix(&self.tiers)
    }

    /// The tenant mix in name order.
    pub fn tenant_mix(&self) -> LabelMix {
        to_mix(&self.tenants)
    }
}

fn to_mix(m: &BTreeMap<String, f64>) -> LabelMix {
    LabelMix {
        entries: m.iter().map(|(k, v)| (k.clone(), *v)).collect(),
    }
}

/// A YAML file's parse error at `path`, located, with a "did you mean" hint for a misspelt
/// field or choice (`polices:`, `format: azur`), as a server configuration's.
fn yaml_error(path: &Path, e: &serde_yaml::Error) -> SimError {
    SimError::Spec {
        path: path.to_path_buf(),
        line: e.location().map(|l| l.line()),
        column: e.location().map(|l| l.column()),
        message: switchyard_config::with_did_you_mean(&e.to_string()),
    }
}

impl SimulationSpec {
    /// Parses and validates a YAML spec; relative paths become relative to the file's directory.
    pub fn from_yaml_file(path: &Path) -> Result<Self, SimError> {
        let text = read_text(path, MAX_SPEC_BYTES)?;
        let mut spec = Self::from_yaml_str(&text, path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        if spec.workload.trace.is_relative() {
            spec.workload.trace = base.join(&spec.workload.trace);
        }
        if let Some(c) = spec.calibration.as_mut().filter(|c| c.is_relative()) {
            *c = base.join(&*c);
        }
        Ok(spec)
    }

    /// Parses and validates YAML text; `path` is only used in messages.
    pub fn from_yaml_str(text: &str, path: &Path) -> Result<Self, SimError> {
        // serde's answer, "1:1: missing field `policies`", reads as if the file had begun
        // one and not finished it.
        if text
            .lines()
            .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'))
        {
            return Err(SimError::spec(
                path,
                "empty: a simulation spec gives at least `policies` and `workload` (see \
                 config/examples/sim-*.yaml)",
            ));
        }
        let mut spec: SimulationSpec =
            serde_yaml::from_str(text).map_err(|e| yaml_error(path, &e))?;
        spec.validate_sections()
            .map_err(|m| SimError::spec(path, m))?;
        spec.validate_workload()
            .map_err(|m| SimError::spec(path, m))?;
        spec.check_policies(text, path)?;
        // After the policies: a change's tiers are checked by building them.
        spec.check_changes()
            .map_err(|r| change_error(path, r.line(text), &r))?;
        spec.source = path.to_path_buf();
        spec.change_lines = (0..spec.changes.len())
            .map(|i| switchyard_config::locate(text, &format!("changes[{i}]")))
            .collect();
        Ok(spec)
    }

    /// Checks `changes` ([`crate::changes::validate`]) against the spec's tiers and policies.
    fn check_changes(&self) -> Result<(), crate::changes::Refusal> {
        crate::changes::validate(&self.changes, &self.tiers, &self.policies)
    }

    /// The error of a change refused once the workload is loaded, with the line its entry
    /// starts on.
    pub(crate) fn change_refused(&self, r: &crate::changes::Refusal) -> SimError {
        let line = r
            .index
            .and_then(|i| self.change_lines.get(i).copied().flatten());
        change_error(self.source(), line, r)
    }

    /// Builds each policy from the spec's own parameters, as the registry that runs it does,
    /// so that an unknown name or a misspelt or out-of-range parameter is refused with the
    /// line of `text` it is written on (serde's location ends at `params`, which the policies
    /// read themselves). The simulation builds them again, a calibration's figures filled in
    /// ([`crate::slo_params`]): those are kept within the policy's bounds.
    fn check_policies(&self, text: &str, path: &Path) -> Result<(), SimError> {
        let registry = switchyard_policies::PolicyRegistry::with_builtins();
        let tiers = tier_specs(&self.tiers);
        for (i, p) in self.policies.iter().enumerate() {
            if let Err(e) = registry.create(&p.name, &p.params, &tiers) {
                return Err(SimError::Spec {
                    path: path.to_path_buf(),
                    line: policy_error_line(text, i, &e),
                    column: None,
                    message: format!("policies: {e}"),
                });
            }
        }
        Ok(())
    }

    /// The file errors name: the spec file, "<cli>" for flags, "<spec>" for a spec built in
    /// code.
    pub fn source(&self) -> &Path {
        if self.source.as_os_str().is_empty() {
            Path::new("<spec>")
        } else {
            &self.source
        }
    }

    /// The `tiers` section of a YAML file, for `simulate --trace ... --tiers FILE`: a server
    /// configuration (its `tiers` are those the server serves), a simulation spec, or a file
    /// holding only that section. The file's other sections are not read. Each tier is checked
    /// as a spec's are; a file without tiers is an error.
    pub fn tiers_from_file(path: &Path) -> Result<BTreeMap<String, TierConf>, SimError> {
        #[derive(Deserialize)]
        struct TiersOnly {
            #[serde(default)]
            tiers: BTreeMap<String, TierConf>,
        }
        let text = read_text(path, MAX_SPEC_BYTES)?;
        let file: TiersOnly = serde_yaml::from_str(&text).map_err(|e| yaml_error(path, &e))?;
        if file.tiers.is_empty() {
            return Err(SimError::spec(
                path,
                "defines no `tiers` (give a server configuration or a simulation spec with a \
                 `tiers` section)",
            ));
        }
        validate_tiers(&file.tiers).map_err(|m| SimError::spec(path, m))?;
        Ok(file.tiers)
    }

    /// The model shape (preset resolved).
    pub fn model_spec(&self) -> Result<ModelSpec, String> {
        let m = match &self.model {
            ModelChoice::Preset(name) => ModelSpec::preset(name).ok_or_else(|| {
                format!(
                    "model: unknown preset `{name}` (known: {})",
                    ModelSpec::PRESETS
                )
            })?,
            ModelChoice::Custom(m) => m.clone(),
        };
        m.validate()?;
        Ok(m)
    }

    /// The hardware figures (preset resolved).
    pub fn hardware_spec(&self) -> Result<HardwareSpec, String> {
        let h = match &self.hardware {
            HardwareChoice::Preset(name) => HardwareSpec::preset(name)
                .ok_or_else(|| format!("hardware: unknown preset `{name}` (known: h200)"))?,
            HardwareChoice::Custom(h) => h.clone(),
        };
        h.validate()?;
        Ok(h)
    }

    /// Checks ranges and cross-field rules that serde cannot: the sections, the changes and
    /// the workload.
    pub fn validate(&self) -> Result<(), String> {
        self.validate_sections()?;
        self.check_changes().map_err(|r| r.to_string())?;
        self.validate_workload()
    }

    /// [`SimulationSpec::validate`]'s checks of every section but `changes` and `workload`.
    fn validate_sections(&self) -> Result<(), String> {
        self.model_spec()?;
        self.hardware_spec()?;
        let c = &self.cache;
        if !(1..=1024).contains(&c.block_size) {
            return Err(format!(
                "cache.block_size {} outside 1..=1024",
                c.block_size
            ));
        }
        if c.num_gpu_blocks.is_some_and(|n| n == 0 || n > 1 << 26) {
            return Err("cache.num_gpu_blocks outside 1..=67108864".into());
        }
        if !(c.gpu_memory_utilization > 0.0 && c.gpu_memory_utilization <= 1.0) {
            return Err("cache.gpu_memory_utilization must be in (0, 1]".into());
        }
        // The server's bound, so that a spec describes a tier the server would accept.
        let max_gib = switchyard_config::MAX_KV_OFFLOADING_GIB;
        if !(c.kv_offloading_size.is_finite() && (0.0..=max_gib).contains(&c.kv_offloading_size)) {
            return Err(format!(
                "cache.kv_offloading_size must be a number of GiB in 0..={max_gib}, got {}",
                c.kv_offloading_size
            ));
        }
        if c.num_host_blocks.is_some() && c.kv_offloading_size > 0.0 {
            return Err(
                "cache.num_host_blocks and cache.kv_offloading_size both size the host KV tier: \
                 set one"
                    .into(),
            );
        }
        let max_host = switchyard_policies::scheduler::MAX_HOST_BLOCKS;
        if c.num_host_blocks.is_some_and(|n| n > max_host) {
            return Err(format!("cache.num_host_blocks outside 0..={max_host}"));
        }
        let rates = [
            ("host_bandwidth_gb_s", Some(c.host_bandwidth_gb_s)),
            ("host_load_bandwidth_gb_s", c.host_load_bandwidth_gb_s),
        ];
        for (field, rate) in rates {
            if let Some(r) = rate.filter(|r| !(r.is_finite() && *r > 0.0 && *r <= 1e6)) {
                return Err(format!(
                    "cache.{field} must be a number of GB/s in (0, 1000000], got {r}"
                ));
            }
        }
        let s = &self.scheduler;
        // The server's bounds: a spec outside them describes a server that cannot be deployed.
        let (max_seqs, max_tokens) = (
            switchyard_config::MAX_NUM_SEQS,
            switchyard_config::MAX_NUM_BATCHED_TOKENS,
        );
        if !(1..=max_seqs).contains(&s.max_num_seqs) {
            return Err(format!(
                "scheduler.max_num_seqs {} outside 1..={max_seqs} (the server's bound)",
                s.max_num_seqs
            ));
        }
        if !(1..=max_tokens).contains(&s.max_num_batched_tokens) {
            return Err(format!(
                "scheduler.max_num_batched_tokens {} outside 1..={max_tokens} (the server's bound)",
                s.max_num_batched_tokens
            ));
        }
        if s.max_model_len.is_some_and(|n| n == 0 || n > 1 << 24) {
            return Err("scheduler.max_model_len outside 1..=16777216".into());
        }
        let context = self
            .model_spec()?
            .max_position_embeddings
            .unwrap_or(u64::MAX);
        if let Some(n) = s.max_model_len.filter(|&n| n as u64 > context) {
            return Err(format!(
                "scheduler.max_model_len is {n}, more than the {context} tokens of context of \
                 model {}: lower it to at most {context} or leave it out (the server refuses \
                 it too)",
                self.model_spec()?.name
            ));
        }
        if let Some(us) = s
            .host_overhead_us
            .filter(|us| !(0.0..=MAX_HOST_OVERHEAD_US).contains(us))
        {
            return Err(format!(
                "scheduler.host_overhead_us {us} outside 0..={MAX_HOST_OVERHEAD_US} (microseconds per step)"
            ));
        }
        if let Some(n) = s
            .max_pending_requests
            .filter(|n| !(1..=1_000_000).contains(n))
        {
            return Err(format!(
                "scheduler.max_pending_requests {n} outside 1..=1000000"
            ));
        }
        if let Some(us) = s.front_end_us {
            crate::front_end::check_fixed_us("scheduler.front_end_us", us)?;
        }
        if let Some(us) = s.front_end_per_token_us {
            crate::front_end::check_per_token_us("scheduler.front_end_per_token_us", us)?;
        }
        if let Some(ms) = s.max_queue_ms.filter(|ms| !(1..=MAX_QUEUE_MS).contains(ms)) {
            return Err(format!(
                "scheduler.max_queue_ms {ms} outside 1..={MAX_QUEUE_MS} (milliseconds)"
            ));
        }
        if !(1..=1024).contains(&s.max_loras) {
            return Err("scheduler.max_loras outside 1..=1024".into());
        }
        s.lora.validate(&self.model_spec()?)?;
        if let Some(m) = &s.lora_memory {
            m.validate()?;
        }
        if let Some(sp) = &s.speculative {
            if !(1..=16).contains(&sp.num_speculative_tokens) {
                return Err("scheduler.speculative.num_speculative_tokens outside 1..=16".into());
            }
            if !(0.0..=1.0).contains(&sp.acceptance_rate) {
                return Err("scheduler.speculative.acceptance_rate outside 0..=1".into());
            }
            if sp.max_running > 1 << 16 {
                return Err("scheduler.speculative.max_running outside 0..=65536".into());
            }
        }
        if self.policies.is_empty() || self.policies.len() > MAX_POLICIES {
            return Err(format!("policies: give 1..={MAX_POLICIES} policies"));
        }
        let mut labels: Vec<&str> = self.policies.iter().map(PolicySpec::label).collect();
        if labels.iter().any(|l| !valid_label(l)) {
            return Err("policies: labels must be 1-64 characters of [A-Za-z0-9_.-]".into());
        }
        labels.sort_unstable();
        if let Some(w) = labels.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "policies: label `{}` appears twice; set `label` to tell them apart",
                w[0]
            ));
        }
        validate_tiers(&self.tiers)
    }

    fn validate_workload(&self) -> Result<(), String> {
        let w = &self.workload;
        if let Some(a) = &w.adapters {
            a.validate()?;
        }
        if let Some(c) = &w.clients {
            c.validate(w.format)?;
        }
        if w.format == TraceFormat::Sharegpt && (w.start_s.is_some() || w.end_s.is_some()) {
            return Err("workload: start_s/end_s need timestamps; use `limit` for sharegpt".into());
        }
        if w.limit == Some(0) {
            return Err(
                "workload.limit must be at least 1 (leave it out to keep every request)".into(),
            );
        }
        for (name, v) in [("start_s", w.start_s), ("end_s", w.end_s)] {
            if v.is_some_and(|v| !v.is_finite()) {
                return Err(format!(
                    "workload.{name} must be a finite number of seconds (trace clock)"
                ));
            }
        }
        if let Some(f) = w.time_scale.filter(|f| !TIME_SCALE_RANGE.contains(f)) {
            return Err(format!(
                "workload.time_scale {} outside {} (it divides arrival times: 2 = twice as fast)",
                short_number(f),
                show_range(&TIME_SCALE_RANGE)
            ));
        }
        for (kind, mix) in [("tiers", &w.mix.tiers), ("tenants", &w.mix.tenants)] {
            if mix.len() > MAX_LABELS {
                return Err(format!("workload.mix.{kind}: at most {MAX_LABELS} entries"));
            }
            if mix.keys().any(|k| k.len() > crate::trace::MAX_LABEL_BYTES) {
                return Err(format!("workload.mix.{kind}: names are at most 64 bytes"));
            }
            if !mix.is_empty() && !mix.values().all(|v| v.is_finite() && *v >= 0.0) {
                return Err(format!("workload.mix.{kind}: weights must be non-negative"));
            }
            // Each finite, the sum may still not be (1e308 twice): the draw needs a finite one.
            let total: f64 = mix.values().sum();
            let sum_ok = total.is_finite() && total > 0.0;
            if !mix.is_empty() && !sum_ok {
                return Err(format!(
                    "workload.mix.{kind}: weights must add up to a finite number > 0"
                ));
            }
        }
        if let Some(unknown) = w.mix.tiers.keys().find(|t| !self.tiers.contains_key(*t)) {
            return Err(format!(
                "workload.mix.tiers: tier `{unknown}` is not defined under `tiers`"
            ));
        }
        match &w.arrival {
            Some(a) => {
                if a.rate.is_some() == a.load.is_some() {
                    return Err("workload.arrival: give exactly one of `rate` and `load`".into());
                }
                if let Some(r) = a.rate.filter(|r| !RATE_RANGE.contains(r)) {
                    return Err(format!(
                        "workload.arrival.rate {} outside {} (requests/s)",
                        short_number(r),
                        show_range(&RATE_RANGE)
                    ));
                }
                if let Some(l) = a.load.filter(|l| !LOAD_RANGE.contains(l)) {
                    return Err(format!(
                        "workload.arrival.load {} outside {} (a fraction of the estimated \
                         capacity)",
                        short_number(l),
                        show_range(&LOAD_RANGE)
                    ));
                }
                // A timestamped trace keeps its own gaps (rescaled to the rate or load): an
                // arrival process there would be silently ignored.
                if w.format != TraceFormat::Sharegpt && (a.process.is_some() || a.cv.is_some()) {
                    return Err(format!(
                        "workload.arrival: `process` and `cv` generate arrivals for traces \
                         without timestamps (sharegpt); the {} trace keeps its own arrival gaps, \
                         rescaled to the `rate` or `load`: remove them",
                        w.format.name()
                    ));
                }
                match (a.process, a.cv) {
                    (Some(ProcessKind::Gamma), None) => {
                        Err("workload.arrival: the gamma process needs `cv`".into())
                    }
                    (Some(ProcessKind::Gamma), Some(cv)) if !CV_RANGE.contains(&cv) => {
                        Err(format!(
                            "workload.arrival.cv {} outside {} (the gamma gaps' coefficient of \
                             variation: 1 is Poisson's)",
                            short_number(cv),
                            show_range(&CV_RANGE)
                        ))
                    }
                    (Some(ProcessKind::Poisson) | None, Some(_)) => {
                        Err("workload.arrival.cv applies to `process: gamma` only".into())
                    }
                    _ => Ok(()),
                }
            }
            None if w.format == TraceFormat::Sharegpt => {
                Err("workload.arrival: the sharegpt format needs a `rate` or a `load`".into())
            }
            None => Ok(()),
        }
    }
}

/// `[a, b]` with [`short_number`]s.
pub fn show_range(r: &std::ops::RangeInclusive<f64>) -> String {
    format!("[{}, {}]", short_number(*r.start()), short_number(*r.end()))
}

/// Checks tier definitions (a spec's `tiers`, or those of `--tiers FILE`).
use switchyard_policies::MAX_QUEUE_MS;

pub(crate) fn validate_tiers(tiers: &BTreeMap<String, TierConf>) -> Result<(), String> {
    if tiers.len() > MAX_LABELS {
        return Err(format!("tiers: at most {MAX_LABELS}"));
    }
    for (name, t) in tiers {
        if name.is_empty() || name.len() > crate::trace::MAX_LABEL_BYTES {
            return Err(format!("tiers: `{name}`: names are 1 to 64 bytes"));
        }
        // At most an hour, as in the server's configuration: a deadline in microseconds
        // then stays far inside the policies' i64 arithmetic.
        let ok = |v: Option<f64>| v.is_none_or(|v| v.is_finite() && v > 0.0 && v <= 3.6e6);
        let weight_ok = t.weight.is_finite() && t.weight > 0.0;
        if !(ok(t.ttft_ms) && ok(t.tpot_ms) && weight_ok) {
            return Err(format!(
                "tiers.{name}: targets must be positive and at most an hour (3600000 ms), \
                 the weight positive"
            ));
        }
        if let Some(ms) = t.max_queue_ms.filter(|ms| !(1..=MAX_QUEUE_MS).contains(ms)) {
            return Err(format!(
                "tiers.{name}.max_queue_ms {ms} outside 1..={MAX_QUEUE_MS} (milliseconds)"
            ));
        }
        if let Some(f) = t.max_kv_fraction.filter(|f| !(*f > 0.0 && *f <= 1.0)) {
            return Err(format!("tiers.{name}.max_kv_fraction {f} outside (0, 1]"));
        }
        let max_share = crate::lora_memory::MAX_CPU_LORAS;
        if let Some(n) = (t.max_cpu_loras_per_tenant).filter(|n| !(1..=max_share).contains(n)) {
            return Err(format!(
                "tiers.{name}.max_cpu_loras_per_tenant {n} outside 1..={max_share}"
            ));
        }
        // The server's bounds (`switchyard_config`: 1 to 1,000,000).
        for (field, bound) in [
            ("max_pending_requests", t.max_pending_requests),
            ("max_pending_per_tenant", t.max_pending_per_tenant),
        ] {
            if let Some(n) = bound.filter(|n| !(1..=1_000_000).contains(n)) {
                return Err(format!("tiers.{name}.{field} {n} outside 1..=1000000"));
            }
        }
        if let (Some(per_tenant), Some(tier)) = (t.max_pending_per_tenant, t.max_pending_requests) {
            if per_tenant > tier {
                return Err(format!(
                    "tiers.{name}.max_pending_per_tenant {per_tenant} exceeds \
                     tiers.{name}.max_pending_requests {tier}: no tenant could ever reach it"
                ));
            }
        }
    }
    Ok(())
}

/// The error of a refused change, at `line` of the spec `path` when known.
fn change_error(path: &Path, line: Option<usize>, r: &crate::changes::Refusal) -> SimError {
    SimError::Spec {
        path: path.to_path_buf(),
        line,
        column: None,
        message: r.to_string(),
    }
}

/// The tiers as the policies take them.
pub(crate) fn tier_specs(tiers: &BTreeMap<String, TierConf>) -> Vec<switchyard_policies::TierSpec> {
    tiers
        .iter()
        .map(|(name, t)| switchyard_policies::TierSpec {
            name: name.clone(),
            ttft_ms: t.ttft_ms,
            tpot_ms: t.tpot_ms,
            weight: t.weight,
            preemptible: t.preemptible,
            max_queue_ms: t.max_queue_ms,
            max_kv_fraction: t.max_kv_fraction,
        })
        .collect()
}

/// The line of `text` where the error `e` of the spec's `index`-th policy is written: the
/// parameter it names (a tier's weight: the spec's `tiers`), else the policy's `params`, its
/// `name` for an unknown policy, else the entry or the `policies` key (`None` where the YAML's
/// layout hides it, e.g. a flow list over several lines).
fn policy_error_line(
    text: &str,
    index: usize,
    e: &switchyard_policies::PolicyError,
) -> Option<usize> {
    use switchyard_policies::PolicyError;
    let entry = format!("policies[{index}]");
    let field = match e {
        PolicyError::UnknownPolicy { .. } => Some(format!("{entry}.name")),
        PolicyError::InvalidParam { field, .. } if field == "params" => None,
        PolicyError::InvalidParam { field, .. }
            if !field.is_empty()
                && field
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') =>
        {
            Some(format!("{entry}.params.{field}"))
        }
        _ => None,
    };
    let params = format!("{entry}.params");
    // `fair-share` refuses a tier's weight as its parameter `tiers`: written under the spec's
    // `tiers`, not under the policy (unless its params do hold a `tiers`, unknown to it).
    let tiers =
        matches!(e, PolicyError::InvalidParam { field, .. } if field == "tiers").then_some("tiers");
    let line = field
        .iter()
        .map(String::as_str)
        .chain(tiers)
        .chain([params.as_str(), entry.as_str(), "policies"])
        .find_map(|f| switchyard_config::locate(text, f));
    line
}

/// Whether `l` is a valid policy label (it names the policy's per-request file).
pub(crate) fn valid_label(l: &str) -> bool {
    !l.is_empty()
        && l.len() <= 64
        && l.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
}

/// Flags of `switchyard simulate --trace ...`, turned into a spec by [`SimulationSpec::from_cli`].
#[derive(Clone, Debug, PartialEq)]
pub struct CliOptions {
    /// Trace file.
    pub trace: PathBuf,
    /// Its format.
    pub format: TraceFormat,
    /// Policy names (each with default parameters); `["all"]` means every registered policy.
    pub policies: Vec<String>,
    /// Seed.
    pub seed: u64,
    /// Model preset name.
    pub model: String,
    /// Hardware preset name.
    pub hardware: String,
    /// Keep at most this many requests.
    pub limit: Option<usize>,
    /// Arrival rate in requests/s (exclusive with `load`).
    pub rate: Option<f64>,
    /// Load fraction of capacity (exclusive with `rate`); sharegpt needs one of the two.
    pub load: Option<f64>,
    /// Divide arrival times by this factor (2 = twice as fast), as `workload.time_scale`.
    pub time_scale: Option<f64>,
    /// Service tiers (`--tiers FILE`, read with [`SimulationSpec::tiers_from_file`]): a trace
    /// naming a tier outside them is an error, as the server refuses one.
    pub tiers: BTreeMap<String, TierConf>,
}

impl SimulationSpec {
    /// Builds a spec from CLI flags with default cache and scheduler, and the tiers given.
    pub fn from_cli(o: &CliOptions) -> Result<Self, SimError> {
        let cli = Path::new("<cli>");
        for (flag, value, range, what) in [
            ("--rate", o.rate, &RATE_RANGE, "requests/s"),
            (
                "--load",
                o.load,
                &LOAD_RANGE,
                "a fraction of the estimated capacity",
            ),
            (
                "--time-scale",
                o.time_scale,
                &TIME_SCALE_RANGE,
                "it divides arrival times: 2 = twice as fast",
            ),
        ] {
            if let Some(v) = value.filter(|v| !range.contains(v)) {
                return Err(SimError::spec(
                    cli,
                    format!(
                        "{flag} {} outside {} ({what})",
                        short_number(v),
                        show_range(range)
                    ),
                ));
            }
        }
        // Named as the flags were given, not as the spec fields they fill.
        if o.limit == Some(0) {
            return Err(SimError::spec(
                cli,
                "--limit 0: replay at least 1 request (leave it out to replay every one)",
            ));
        }
        if o.policies.iter().any(|p| p.trim().is_empty()) {
            return Err(SimError::spec(
                cli,
                format!(
                    "--policies `{}` has an empty name: give registered names separated by \
                     commas (fcfs,priority), or `all`",
                    o.policies.join(",")
                ),
            ));
        }
        if o.format == TraceFormat::Sharegpt && o.rate.is_none() && o.load.is_none() {
            return Err(SimError::spec(
                cli,
                "--format sharegpt has no timestamps: give --rate R (requests/s) or --load F \
                 (a fraction of the estimated capacity)",
            ));
        }
        let arrival = (o.rate.is_some() || o.load.is_some()).then_some(ArrivalSpec {
            process: None,
            rate: o.rate,
            load: o.load,
            cv: None,
        });
        let spec = SimulationSpec {
            seed: o.seed,
            model: ModelChoice::Preset(o.model.clone()),
            hardware: HardwareChoice::Preset(o.hardware.clone()),
            calibration: None,
            cache: CacheSection::default(),
            scheduler: SchedulerLimits::default(),
            policies: if o.policies.len() == 1 && o.policies[0] == "all" {
                switchyard_policies::PolicyRegistry::with_builtins()
                    .names()
                    .into_iter()
                    .map(PolicySpec::named)
                    .collect()
            } else {
                o.policies.iter().map(|n| PolicySpec::named(n)).collect()
            },
            tiers: o.tiers.clone(),
            workload: WorkloadSpec {
                trace: o.trace.clone(),
                format: o.format,
                limit: o.limit,
                start_s: None,
                end_s: None,
                time_scale: o.time_scale,
                arrival,
                mix: MixSpec::default(),
                adapters: None,
                clients: None,
            },
            changes: Vec::new(),
            source: cli.to_path_buf(),
            change_lines: Vec::new(),
        };
        // The command line cannot set labels, so the spec's advice for a repeated one does
        // not apply to it.
        let mut names: Vec<&str> = spec.policies.iter().map(|p| p.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(SimError::spec(
                cli,
                format!(
                    "--policies names `{}` twice; to compare settings of one policy, list them \
                     with a `label` each in a spec file (`simulate --config`)",
                    w[0]
                ),
            ));
        }
        spec.validate().map_err(|m| SimError::spec(cli, m))?;
        Ok(spec)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "
seed: 3
model: smollm2-135m
policies: [{name: fcfs}, {name: fcfs, label: fcfs-2, params: {}}]
tiers:
  premium: {ttft_ms: 200, tpot_ms: 40, weight: 4}
  batch: {preemptible: true, priority: 2}
workload:
  trace: t.csv
  format: azure
  arrival: {load: 0.9}
  mix: {tiers: {premium: 1, batch: 3}}
";

    fn parse(text: &str) -> Result<SimulationSpec, SimError> {
        SimulationSpec::from_yaml_str(text, Path::new("sim.yaml"))
    }

    #[test]
    fn a_misspelt_field_or_choice_is_named_with_the_nearest() {
        let cases = [
            (
                GOOD.replace("policies:", "polices:"),
                4,
                "unknown field `polices`",
                "policies",
            ),
            (
                GOOD.replace("format: azure", "format: azrue"),
                10,
                "unknown variant `azrue`",
                "azure",
            ),
        ];
        for (text, line, want, nearest) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.starts_with(&format!("sim.yaml:{line}:")), "{err}");
            assert!(err.contains(want), "{err}");
            assert!(
                err.contains(&format!("(did you mean `{nearest}`?)")),
                "{err}"
            );
        }
        // Nothing near: serde's message as it is.
        let err = parse(&GOOD.replace("seed: 3", "colour: 3"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("unknown field `colour`") && !err.contains("did you mean"),
            "{err}"
        );
    }

    #[test]
    fn parses_a_full_spec_with_defaults() {
        let s = parse(GOOD).unwrap();
        assert_eq!(s.seed, 3);
        assert_eq!(s.model_spec().unwrap().name, "smollm2-135m");
        assert_eq!(s.hardware_spec().unwrap().name, "h200");
        assert_eq!(s.cache.block_size, 16);
        assert_eq!(s.scheduler.max_num_seqs, 256);
        assert_eq!(s.policies[1].label(), "fcfs-2");
        assert_eq!(s.tiers["batch"].weight, 1.0);
        assert_eq!(s.workload.mix.tier_mix().entries[0].0, "batch");
    }

    /// A policy's parameters are read by the policy, past where serde locates errors: an
    /// unknown policy, a misspelt or out-of-range parameter is named with the line it is
    /// written on, in each layout a spec writes its policies in.
    #[test]
    fn policy_errors_name_the_line_they_are_written_on() {
        let with = |policies: &str| {
            let text = GOOD.replace(
                "policies: [{name: fcfs}, {name: fcfs, label: fcfs-2, params: {}}]\n",
                policies,
            );
            assert_ne!(text, GOOD);
            parse(&text).unwrap_err().to_string()
        };
        let cases = [
            (
                "policies: [{name: fcfs}, {name: slo-aware, params: {step_overhed_ms: 5}}]\n",
                "sim.yaml:4: policies: policy `slo-aware`: parameter `step_overhed_ms`: \
                 unknown parameter",
            ),
            (
                "policies:\n  - name: fcfs\n  - name: slo-aware\n    params:\n      \
                 pace_fraction: 0.5\n      step_overhed_ms: 5\n",
                "sim.yaml:9: policies: policy `slo-aware`: parameter `step_overhed_ms`",
            ),
            (
                "policies:\n  - name: fcfs\n  - name: slo-aware\n    params: {step_overhead_ms: -1}\n",
                "sim.yaml:7: policies: policy `slo-aware`: parameter `step_overhead_ms`: must be in",
            ),
            (
                "policies:\n  - name: fcfs\n  - {name: slo-awre}\n",
                "sim.yaml:6: policies: unknown scheduling policy `slo-awre`",
            ),
            (
                "policies:\n  - name: fcfs\n  - name: priority\n    params: [1]\n",
                "sim.yaml:7: policies: policy `priority`: parameter `params`: expected a mapping",
            ),
        ];
        for (policies, want) in cases {
            let err = with(policies);
            assert!(err.starts_with(want), "{policies}: {err}");
        }
        // A flow list over several lines hides the entry: the line of `policies` is named.
        let err = with("policies: [\n  {name: fcfs, params: {x: 1}}]\n");
        assert!(
            err.starts_with("sim.yaml:4: policies: policy `fcfs`"),
            "{err}"
        );
    }

    /// A tier whose weight `fair-share` refuses (the spec's own check takes any positive one)
    /// is named at the spec's `tiers`, where it is written, not at the policy's entry.
    #[test]
    fn a_tier_a_policy_refuses_is_named_at_the_tiers() {
        let policies = "policies:\n  - name: fcfs\n  - name: fair-share\n    params:\n      \
                        input_weight: 1\n";
        let tiers = "tiers:\n  gold: {weight: 0.0001}\n";
        let workload = "workload: {trace: t.jsonl, format: jsonl}\n";
        let want = "policies: policy `fair-share`: parameter `tiers`: tier `gold`: weight must be";
        for (text, line) in [
            (format!("seed: 3\n{tiers}{policies}{workload}"), 2),
            (format!("seed: 3\n{policies}{tiers}{workload}"), 7),
        ] {
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("sim.yaml:{line}: {want}")),
                "{err}"
            );
        }
    }

    /// A spec, tiers or calibration file is a regular file of UTF-8 text within its bound;
    /// anything else is refused naming it, without waiting on it or reading past the bound.
    #[test]
    fn spec_files_are_regular_files_of_text_within_their_bound() {
        let dir = crate::scratch::ScratchDir::new("spec-read");
        let file = dir.join("s.yaml");
        std::fs::write(&file, "seed: 1\n").unwrap();
        assert_eq!(read_text(&file, 8).unwrap(), "seed: 1\n");
        let refused = |path: &Path, max: u64| read_text(path, max).unwrap_err().to_string();
        let f = file.display();
        assert_eq!(
            refused(&file, 7),
            format!("{f}: too large: more than 7 bytes")
        );
        assert_eq!(
            refused(&dir, 8),
            format!("{}: is a directory, not a file", dir.display())
        );
        assert_eq!(
            refused(Path::new("/dev/zero"), 8),
            "/dev/zero: not a regular file"
        );
        std::fs::write(&file, b"seed: \xff\n").unwrap();
        assert_eq!(
            refused(&file, 8),
            format!("{f}: not UTF-8 text (invalid byte at offset 6)")
        );
        for empty in ["", "\n  \n", "# policies: [{name: fcfs}]\n"] {
            assert_eq!(
                SimulationSpec::from_yaml_str(empty, Path::new("s.yaml"))
                    .unwrap_err()
                    .to_string(),
                "s.yaml: empty: a simulation spec gives at least `policies` and `workload` \
                 (see config/examples/sim-*.yaml)"
            );
        }
        let missing = dir.join("missing.yaml");
        assert!(
            refused(&missing, 8).starts_with(&format!("{}: ", missing.display())),
            "{}",
            refused(&missing, 8)
        );
    }

    #[test]
    fn errors_name_file_line_and_field() {
        let typo = GOOD.replace("weight: 4", "wieght: 4");
        let err = parse(&typo).unwrap_err().to_string();
        assert!(
            err.starts_with("sim.yaml:6:") && err.contains("wieght"),
            "{err}"
        );
        let cases = [
            (
                GOOD.replace("smollm2-135m", "gpt-9"),
                "unknown preset `gpt-9`",
            ),
            (GOOD.replace("label: fcfs-2, ", ""), "appears twice"),
            (
                GOOD.replace("{load: 0.9}", "{load: 0.9, rate: 2}"),
                "exactly one of",
            ),
            (GOOD.replace("premium: 1,", "gold: 1,"), "tier `gold`"),
            (GOOD.replace("format: azure", "format: csv"), "sim.yaml:10:"),
            (GOOD.replace("ttft_ms: 200", "ttft_ms: -1"), "tiers.premium"),
            // Past an hour: the deadline in microseconds would leave the policies' i64 range.
            (
                GOOD.replace("ttft_ms: 200", "ttft_ms: 1e16"),
                "tiers.premium",
            ),
            // Each weight finite, their sum not.
            (
                GOOD.replace("premium: 1, batch: 3", "premium: 1e308, batch: 1e308"),
                "add up to a finite number",
            ),
            (
                format!("{}\nscheduler: {{ max_loras: 0 }}\n", GOOD.trim_end()),
                "scheduler.max_loras",
            ),
            (
                format!(
                    "{}\nscheduler: {{ lora: {{ rank: 0 }} }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.lora.rank = 0",
            ),
            (
                format!(
                    "{}\nscheduler: {{ lora: {{ targets: [] }} }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.lora.targets is empty",
            ),
            (
                format!(
                    "{}\nscheduler: {{ lora: {{ targets: qv }} }}\n",
                    GOOD.trim_end()
                ),
                "lora.targets is `all` or a list",
            ),
            (
                format!(
                    "{}\nscheduler: {{ host_overhead_us: .inf }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.host_overhead_us",
            ),
            (
                format!(
                    "{}\nscheduler: {{ host_overhead_us: 1e20 }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.host_overhead_us",
            ),
            (
                format!(
                    "{}\nscheduler: {{ host_overhead_us: -1 }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.host_overhead_us",
            ),
            (
                format!(
                    "{}\nscheduler: {{ host_overhead_us: .nan }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.host_overhead_us",
            ),
            (
                format!(
                    "{}\nscheduler: {{ max_pending_requests: 0 }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.max_pending_requests 0 outside 1..=1000000",
            ),
            (
                format!("{}\nscheduler: {{ front_end_us: -1 }}\n", GOOD.trim_end()),
                "scheduler.front_end_us",
            ),
            (
                format!("{}\nscheduler: {{ front_end_us: 1e20 }}\n", GOOD.trim_end()),
                "scheduler.front_end_us",
            ),
            (
                format!(
                    "{}\nscheduler: {{ front_end_per_token_us: .nan }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.front_end_per_token_us",
            ),
            (
                format!(
                    "{}\nscheduler: {{ front_end_per_token_us: 1e5 }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.front_end_per_token_us",
            ),
            (
                GOOD.replace("format: azure", "format: azure\n  limit: 0"),
                "workload.limit",
            ),
            (
                GOOD.replace("format: azure", "format: azure\n  time_scale: .inf"),
                "workload.time_scale",
            ),
            (
                GOOD.replace("format: azure", "format: azure\n  time_scale: 1e-320"),
                "workload.time_scale",
            ),
            (
                format!(
                    "{}\nscheduler: {{ max_model_len: 8193 }}\n",
                    GOOD.trim_end()
                ),
                "more than the 8192 tokens of context of model smollm2-135m",
            ),
            (
                format!("{}\nscheduler: {{ max_queue_ms: 0 }}\n", GOOD.trim_end()),
                "scheduler.max_queue_ms 0 outside 1..=3600000",
            ),
            (
                GOOD.replace("priority: 2}", "priority: 2, max_queue_ms: 3600001}"),
                "tiers.batch.max_queue_ms 3600001 outside 1..=3600000",
            ),
            (
                GOOD.replace("priority: 2}", "priority: 2, max_kv_fraction: 0}"),
                "tiers.batch.max_kv_fraction 0 outside (0, 1]",
            ),
            (
                GOOD.replace("priority: 2}", "priority: 2, max_kv_fraction: 1.01}"),
                "tiers.batch.max_kv_fraction 1.01 outside (0, 1]",
            ),
            (
                GOOD.replace("priority: 2}", "priority: 2, max_pending_per_tenant: 0}"),
                "tiers.batch.max_pending_per_tenant 0 outside 1..=1000000",
            ),
            (
                GOOD.replace(
                    "priority: 2}",
                    "priority: 2, max_pending_requests: 4, max_pending_per_tenant: 5}",
                ),
                "tiers.batch.max_pending_per_tenant 5 exceeds tiers.batch.max_pending_requests 4",
            ),
            (
                GOOD.replace(
                    "priority: 2}",
                    "priority: 2, max_pending_requests: 1000001}",
                ),
                "tiers.batch.max_pending_requests 1000001 outside 1..=1000000",
            ),
            // The server's bound (switchyard_config::MAX_NUM_SEQS), not a wider one.
            (
                format!("{}\nscheduler: {{ max_num_seqs: 2049 }}\n", GOOD.trim_end()),
                "scheduler.max_num_seqs 2049 outside 1..=2048",
            ),
            (
                format!(
                    "{}\nscheduler: {{ max_num_batched_tokens: 2000000 }}\n",
                    GOOD.trim_end()
                ),
                "scheduler.max_num_batched_tokens 2000000 outside 1..=1048576",
            ),
            // Finite but absurd: "inf req/s" in the report.
            (
                GOOD.replace("format: azure", "format: azure\n  time_scale: 1e308"),
                "workload.time_scale 1e308 outside",
            ),
            (
                GOOD.replace("{load: 0.9}", "{load: 1e-300}"),
                "workload.arrival.load",
            ),
            (
                GOOD.replace("{load: 0.9}", "{rate: 1e-300}"),
                "workload.arrival.rate",
            ),
            (
                GOOD.replace("{load: 0.9}", "{rate: 1e300}"),
                "workload.arrival.rate",
            ),
            (
                GOOD.replace("format: azure", "format: azure\n  start_s: .nan"),
                "workload.start_s must be a finite number",
            ),
            (
                GOOD.replace("format: azure", "format: azure\n  end_s: .inf"),
                "workload.end_s must be a finite number",
            ),
            // A timestamped trace keeps its gaps: a process there would be ignored.
            (
                GOOD.replace("{load: 0.9}", "{process: gamma, cv: .nan, rate: 5}"),
                "`process` and `cv` generate arrivals for traces without timestamps",
            ),
            (
                GOOD.replace("{load: 0.9}", "{process: poisson, load: 0.9}"),
                "the azure trace keeps its own arrival gaps",
            ),
        ];
        for (text, want) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(
                err.starts_with("sim.yaml") && err.contains(want),
                "want {want}: {err}"
            );
        }
    }

    /// Gamma arrivals of a sharegpt trace: `cv` is checked where it is written, in the spec,
    /// not when the trace is loaded (which named the trace file).
    #[test]
    fn arrival_cv_is_checked_in_the_spec() {
        let sharegpt = GOOD
            .replace("format: azure", "format: sharegpt")
            .replace("{load: 0.9}", "{process: gamma, cv: 2, rate: 5}");
        assert_eq!(
            parse(&sharegpt).unwrap().workload.arrival.unwrap().cv,
            Some(2.0)
        );
        for (cv, want) in [
            ("0", "workload.arrival.cv 0 outside"),
            (".nan", "workload.arrival.cv NaN outside"),
            ("-1", "workload.arrival.cv -1 outside"),
            ("1e9", "workload.arrival.cv 1e9 outside [0.001, 100]"),
        ] {
            let text = sharegpt.replace("cv: 2", &format!("cv: {cv}"));
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.starts_with("sim.yaml: ") && err.contains(want), "{err}");
        }
        let poisson = sharegpt.replace("process: gamma", "process: poisson");
        let err = parse(&poisson).unwrap_err().to_string();
        assert!(err.contains("applies to `process: gamma` only"), "{err}");
        let no_cv = sharegpt.replace("cv: 2, ", "");
        let err = parse(&no_cv).unwrap_err().to_string();
        assert!(err.contains("the gamma process needs `cv`"), "{err}");
    }

    #[test]
    fn tiers_come_from_the_tiers_section_of_any_yaml_file() {
        let dir = crate::scratch::ScratchDir::new("spec-tiers");
        // The server's example configuration: its other sections are not read.
        let server =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/examples/multi-tenant.yaml");
        let tiers = SimulationSpec::tiers_from_file(&server).unwrap();
        let names: Vec<&str> = tiers.keys().map(String::as_str).collect();
        assert_eq!(names, ["batch", "premium", "standard"]);
        assert_eq!(tiers["premium"].ttft_ms, Some(200.0));
        // The server's admission bounds are read.
        assert_eq!(tiers["batch"].max_pending_requests, Some(1024));
        assert_eq!(tiers["standard"].max_pending_per_tenant, Some(256));
        // So are its rate limits, and its share of adapter memory per tenant.
        assert_eq!(tiers["standard"].tokens_per_minute, Some(200_000));
        assert_eq!(tiers["standard"].max_cpu_loras_per_tenant, Some(2));
        let file = dir.join("t.yaml");
        std::fs::write(&file, "server: {port: 1}\n").unwrap();
        let err = SimulationSpec::tiers_from_file(&file)
            .unwrap_err()
            .to_string();
        assert!(err.contains("t.yaml: defines no `tiers`"), "{err}");
        std::fs::write(&file, "tiers:\n  gold: {ttft_ms: -5}\n").unwrap();
        let err = SimulationSpec::tiers_from_file(&file)
            .unwrap_err()
            .to_string();
        assert!(err.contains("t.yaml: tiers.gold: targets"), "{err}");
        std::fs::write(&file, "tiers:\n  gold: {ttft: 5}\n").unwrap();
        let err = SimulationSpec::tiers_from_file(&file)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("t.yaml:2:") || err.contains("t.yaml:2:"),
            "{err}"
        );
    }

    #[test]
    fn bounds_accept_their_edges() {
        let edge = format!(
            "{}\nscheduler: {{ host_overhead_us: 1e7 }}\n",
            GOOD.trim_end()
        )
        .replace("format: azure", "format: azure\n  limit: 1");
        let s = parse(&edge).unwrap();
        assert_eq!(
            (s.scheduler.host_overhead_us, s.workload.limit),
            (Some(1e7), Some(1))
        );
    }

    #[test]
    fn the_host_load_rate_defaults_to_the_offload_rate_and_is_checked_by_field() {
        let with = |cache: &str| format!("{}\ncache: {{ {cache} }}\n", GOOD.trim_end());
        let s = parse(GOOD).unwrap();
        assert_eq!(s.cache.host_load_bandwidth_gb_s, None);
        assert_eq!(s.cache.host_load_bandwidth(), DEFAULT_HOST_BANDWIDTH_GB_S);
        let s = parse(&with("host_bandwidth_gb_s: 52.4")).unwrap();
        assert_eq!(s.cache.host_load_bandwidth(), 52.4);
        let s = parse(&with(
            "host_bandwidth_gb_s: 52.4, host_load_bandwidth_gb_s: 34.6",
        ))
        .unwrap();
        assert_eq!(
            (s.cache.host_bandwidth_gb_s, s.cache.host_load_bandwidth()),
            (52.4, 34.6)
        );
        // Unset, it is not written back (a spec echoed stays as it was).
        let echo = serde_yaml::to_string(&parse(GOOD).unwrap().cache).unwrap();
        assert!(!echo.contains("host_load"), "{echo}");
        assert!(parse(&with("host_load_bandwidth_gb_s: 1e6")).is_ok());
        for field in ["host_bandwidth_gb_s", "host_load_bandwidth_gb_s"] {
            for bad in ["0", "-1", ".nan", ".inf", "1.5e6"] {
                let err = parse(&with(&format!("{field}: {bad}")))
                    .unwrap_err()
                    .to_string();
                assert!(
                    err.starts_with("sim.yaml")
                        && err.contains(&format!("cache.{field} must be a number of GB/s")),
                    "{field}: {bad}: {err}"
                );
            }
        }
    }

    #[test]
    fn stores_ahead_of_eviction_are_on_by_default_as_the_servers() {
        let with = |cache: &str| format!("{}\ncache: {{ {cache} }}\n", GOOD.trim_end());
        let s = parse(GOOD).unwrap();
        assert!(s.cache.kv_offloading_ahead);
        assert_eq!(
            switchyard_config::CacheSection::default().kv_offloading_ahead,
            s.cache.kv_offloading_ahead
        );
        let echo = serde_yaml::to_string(&s.cache).unwrap();
        assert!(!echo.contains("kv_offloading_ahead"), "{echo}");
        let off = parse(&with("kv_offloading_ahead: false")).unwrap();
        assert!(!off.cache.kv_offloading_ahead);
        let echo = serde_yaml::to_string(&off.cache).unwrap();
        assert!(echo.contains("kv_offloading_ahead: false"), "{echo}");
        let err = parse(&with("kv_offloading_ahead: 1"))
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("sim.yaml") && err.contains("kv_offloading_ahead"),
            "{err}"
        );
    }

    #[test]
    fn max_model_len_may_reach_the_model_context() {
        let s = parse(&format!(
            "{}\nscheduler: {{ max_model_len: 8192 }}\n",
            GOOD.trim_end()
        ))
        .unwrap();
        assert_eq!(s.scheduler.max_model_len, Some(8192));
    }

    #[test]
    fn cli_specs_need_a_sharegpt_rate_and_check_policies() {
        let mut o = CliOptions {
            trace: "x.csv".into(),
            format: TraceFormat::Sharegpt,
            policies: vec!["fcfs".into()],
            seed: 0,
            model: "llama-3-8b".into(),
            hardware: "h200".into(),
            limit: None,
            rate: None,
            load: None,
            time_scale: None,
            tiers: BTreeMap::new(),
        };
        // No timestamps and no rate: an error naming the flags, not a silent default.
        let err = SimulationSpec::from_cli(&o).unwrap_err().to_string();
        assert!(
            err.starts_with("<cli>") && err.contains("--rate") && err.contains("--load"),
            "{err}"
        );
        o.load = Some(0.8);
        let s = SimulationSpec::from_cli(&o).unwrap();
        assert_eq!(s.workload.arrival.as_ref().and_then(|a| a.load), Some(0.8));
        o.policies = vec!["all".into()];
        let all = SimulationSpec::from_cli(&o).unwrap();
        let names: Vec<&str> = all.policies.iter().map(|p| p.name.as_str()).collect();
        assert!(names.contains(&"fcfs") && names.contains(&"slo-aware") && names.len() >= 5);
        o.policies.clear();
        assert!(SimulationSpec::from_cli(&o)
            .unwrap_err()
            .to_string()
            .starts_with("<cli>"));
    }

    #[test]
    fn cli_flags_out_of_range_are_named() {
        let o = CliOptions {
            trace: "x.csv".into(),
            format: TraceFormat::Azure,
            policies: vec!["fcfs".into()],
            seed: 0,
            model: "llama-3-8b".into(),
            hardware: "h200".into(),
            limit: None,
            rate: None,
            load: None,
            time_scale: None,
            tiers: BTreeMap::new(),
        };
        let cases = [
            (
                CliOptions {
                    time_scale: Some(1e308),
                    ..o.clone()
                },
                "<cli>: --time-scale 1e308 outside [1e-6, 1e6]",
            ),
            (
                CliOptions {
                    rate: Some(f64::NAN),
                    ..o.clone()
                },
                "<cli>: --rate NaN outside",
            ),
            (
                CliOptions {
                    load: Some(0.0),
                    ..o.clone()
                },
                "<cli>: --load 0 outside",
            ),
            (
                CliOptions {
                    limit: Some(0),
                    ..o.clone()
                },
                "<cli>: --limit 0: replay at least 1 request",
            ),
            (
                CliOptions {
                    policies: vec!["fcfs".into(), "".into()],
                    ..o.clone()
                },
                "<cli>: --policies `fcfs,` has an empty name",
            ),
        ];
        for (opts, want) in cases {
            let err = SimulationSpec::from_cli(&opts).unwrap_err().to_string();
            assert!(err.starts_with(want), "want {want}: {err}");
        }
        assert_eq!(
            SimulationSpec::from_cli(&o).unwrap().source(),
            Path::new("<cli>")
        );
    }

    /// `scheduler.lora_memory` and `workload.adapters`: the defaults, and each bound refused
    /// naming its field.
    #[test]
    fn lora_memory_and_drawn_adapters_are_checked_by_field() {
        let with = |scheduler: &str, adapters: &str| {
            GOOD.replace(
                "workload:\n",
                &format!("scheduler: {{{scheduler}}}\nworkload:\n  {adapters}\n"),
            )
        };
        let s = parse(&with(
            "lora_memory: {load_ms: 40}",
            "adapters: {count: 200}",
        ))
        .unwrap();
        let m = s.scheduler.lora_memory.unwrap();
        assert_eq!(
            (m.max_cpu_loras, m.pinned.len(), m.load_ms, m.max_adapters),
            (8, 0, Some(40.0), 64)
        );
        assert!(m.registered.is_empty());
        // The file's order is kept: it says which are in memory at the start.
        let listed = parse(&with(
            "lora_memory: {pinned: [1], registered: [7, 3, 5], load_ms: 40}",
            "",
        ))
        .unwrap();
        assert_eq!(listed.scheduler.lora_memory.unwrap().registered, [7, 3, 5]);
        let a = s.workload.adapters.unwrap();
        assert_eq!(
            (a.popularity, a.s, a.fraction),
            (Popularity::Zipf, None, 1.0)
        );
        // Zipf with s = 1 by default: 1, 1/2, 1/3, ...
        assert_eq!(&a.weights()[..3], &[1.0, 0.5, 1.0 / 3.0]);
        assert!(parse(GOOD).unwrap().scheduler.lora_memory.is_none());
        let cases = [
            (
                with("lora_memory: {max_cpu_loras: 4097, load_ms: 1}", ""),
                "scheduler.lora_memory.max_cpu_loras 4097 outside 0..=4096",
            ),
            (
                with(
                    "lora_memory: {max_cpu_loras: 2, pinned: [1, 2, 3], load_ms: 1}",
                    "",
                ),
                "scheduler.lora_memory.pinned: 3 adapters, but at most max_cpu_loras (2)",
            ),
            (
                with("lora_memory: {max_adapters: 0, load_ms: 1}", ""),
                "scheduler.lora_memory.max_adapters 0 outside 1..=4096",
            ),
            (
                with("lora_memory: {max_adapters: 4097, load_ms: 1}", ""),
                "scheduler.lora_memory.max_adapters 4097 outside 1..=4096",
            ),
            (
                with(
                    "lora_memory: {max_adapters: 1, pinned: [1, 2], load_ms: 1}",
                    "",
                ),
                "scheduler.lora_memory.pinned: 2 adapters, but at most max_adapters (1)",
            ),
            (
                with("lora_memory: {pinned: [4, 5, 4], load_ms: 1}", ""),
                "scheduler.lora_memory.pinned[2]: adapter 4 is listed twice",
            ),
            (
                with(
                    "lora_memory: {max_adapters: 3, pinned: [1, 2], registered: [3, 4], \
                     load_ms: 1}",
                    "",
                ),
                "scheduler.lora_memory.registered: 2 adapters and 2 pinned, 4 in all, but at \
                 most max_adapters (3) may be registered",
            ),
            (
                with("lora_memory: {registered: [4, 5, 4], load_ms: 1}", ""),
                "scheduler.lora_memory.registered[2]: adapter 4 is listed twice",
            ),
            (
                with(
                    "lora_memory: {pinned: [5], registered: [4, 5], load_ms: 1}",
                    "",
                ),
                "scheduler.lora_memory.registered[1]: adapter 5 is pinned too",
            ),
            (
                with("lora_memory: {registered: [-1], load_ms: 1}", ""),
                "scheduler.lora_memory.registered[0]: invalid type: integer `-1`, expected u32",
            ),
            (
                with("lora_memory: {registred: [4], load_ms: 1}", ""),
                "unknown field `registred`, expected one of `max_cpu_loras`, `pinned`, \
                 `registered`, `load_ms`, `max_adapters` (did you mean `registered`?)",
            ),
            (
                with("lora_memory: {load_ms: -1}", ""),
                "scheduler.lora_memory.load_ms -1 outside 0..=600000",
            ),
            (
                with("lora_memory: {load_ms: .nan}", ""),
                "scheduler.lora_memory.load_ms NaN outside",
            ),
            (
                with("max_loras: 4", "adapters: {count: 0}"),
                "workload.adapters.count 0 outside 1..=4096",
            ),
            (
                with("max_loras: 4", "adapters: {count: 5000}"),
                "workload.adapters.count 5000 outside 1..=4096",
            ),
            (
                with("max_loras: 4", "adapters: {count: 5, s: 11}"),
                "workload.adapters.s 11 outside 0..=10",
            ),
            (
                with(
                    "max_loras: 4",
                    "adapters: {count: 5, popularity: uniform, s: 1}",
                ),
                "workload.adapters.s is the zipf exponent",
            ),
            (
                with("max_loras: 4", "adapters: {count: 5, fraction: 1.5}"),
                "workload.adapters.fraction 1.5 outside 0..=1",
            ),
            (
                with("max_loras: 4", "adapters: {count: 5, popularity: pareto}"),
                "unknown variant `pareto`",
            ),
        ];
        for (text, want) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains(want), "want {want}: {err}");
        }
    }

    /// `workload.clients` is bounded by field (NaN, negative, huge refused) and needs a
    /// trace that names clients.
    #[test]
    fn clients_think_times_and_start_jitter_are_checked_by_field() {
        let with = |format: &str, clients: &str| {
            GOOD.replace("format: azure", &format!("format: {format}"))
                .replace("workload:\n", &format!("workload:\n  clients: {clients}\n"))
        };
        let s = parse(&with("jsonl", "{think_s: 1.5, start_jitter_s: 10}")).unwrap();
        assert_eq!(
            s.workload.clients,
            Some(ClientsSpec {
                think_s: Some(1.5),
                think: ThinkKind::Exponential,
                start_jitter_s: Some(10.0),
            })
        );
        let s = parse(&with("jsonl", "{think_s: 0, think: constant}")).unwrap();
        assert_eq!(s.workload.clients.unwrap().think, ThinkKind::Constant);
        assert!(parse(GOOD).unwrap().workload.clients.is_none());
        let cases = [
            (
                with("azure", "{think_s: 1}"),
                "workload.clients: only a jsonl trace names clients",
            ),
            (
                with("jsonl", "{think_s: -1}"),
                "workload.clients.think_s -1 outside [0, 3600]",
            ),
            (
                with("jsonl", "{think_s: .nan}"),
                "workload.clients.think_s NaN outside",
            ),
            (
                with("jsonl", "{think_s: 1e300}"),
                "workload.clients.think_s 1e300 outside",
            ),
            (
                with("jsonl", "{think: constant}"),
                "workload.clients.think: `constant` needs `think_s`",
            ),
            (
                with("jsonl", "{start_jitter_s: .inf}"),
                "workload.clients.start_jitter_s inf outside [0, 86400]",
            ),
            (
                with("jsonl", "{start_jitter_s: -0.5}"),
                "workload.clients.start_jitter_s -0.5 outside",
            ),
            (with("jsonl", "{think: gamma}"), "unknown variant `gamma`"),
            (with("jsonl", "{thinks: 1}"), "unknown field `thinks`"),
        ];
        for (text, want) in cases {
            let err = parse(&text).unwrap_err().to_string();
            assert!(err.contains(want), "want {want}: {err}");
        }
    }
}
