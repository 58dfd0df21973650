//! Loading a model and building a backend and an engine core, shared by `generate`,
//! `bench throughput` and `serve`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use switchyard_actors::{AsyncScheduling, EngineCore, EngineCoreConfig};
use switchyard_config::{BackendKind, CpuPrecision, KvCacheDtype, Quantization};
use switchyard_gpu::backend::{Backend, CpuBackend, CpuBackendConfig};
use switchyard_gpu::cpu::llama::{ActivationPrecision, LlamaModel};
use switchyard_gpu::model::{fetch, LlamaConfig, LoadedModel, ModelWeights};
use switchyard_gpu::{KvGeometry, KvSettingNames, KvStorage};
use switchyard_policies::{PolicyRegistry, SchedulerConfig};

/// The embedded default model.
pub const DEFAULT_MODEL: &str = "smollm2-135m";

/// Resolves `--model`: an explicit path (with `~` expanded), or the fetched default.
pub fn resolve_model_path(path: Option<&Path>) -> anyhow::Result<PathBuf> {
    match path {
        Some(p) => Ok(expand_home(p)),
        None => {
            let p = fetch::default_model_path(DEFAULT_MODEL);
            anyhow::ensure!(
                p.exists(),
                "the default model is not in the cache ({}); run `switchyard model fetch {DEFAULT_MODEL}` first",
                p.display()
            );
            Ok(p)
        }
    }
}

/// Loads the LoRA adapter in `dir` for a model of `config`, of rank at most `max_rank` (never
/// more than [`switchyard_gpu::lora::MAX_LORA_RANK`], the largest any configuration allows).
pub fn load_lora(
    dir: &Path,
    config: &switchyard_gpu::model::LlamaConfig,
    max_rank: usize,
) -> anyhow::Result<std::sync::Arc<switchyard_gpu::LoraAdapter>> {
    let limits = switchyard_gpu::LoraLimits {
        max_rank: max_rank.min(switchyard_gpu::lora::MAX_LORA_RANK),
        ..Default::default()
    };
    let adapter = switchyard_gpu::LoraAdapter::load(&expand_home(dir), config, &limits)?;
    tracing::info!(dir = %dir.display(), rank = adapter.rank(), "LoRA adapter loaded");
    Ok(std::sync::Arc::new(adapter))
}

/// Expands a leading `~/`.
pub fn expand_home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => p.to_path_buf(),
    }
}

/// Loads a model file, its progress shown as every long command's ([`super::progress`]).
pub fn load(path: &Path) -> anyhow::Result<LoadedModel> {
    switchyard_gpu::model::load_model(path, &super::StderrProgress)
        .with_context(|| format!("loading model {}", path.display()))
}

/// KV blocks that fit in `kv_mb` MiB for this model on the CPU backend (keys and values of
/// every layer, stored as f16).
pub fn cpu_kv_blocks(config: &LlamaConfig, block_size: usize, kv_mb: usize) -> usize {
    KvGeometry::of(config, block_size, KvStorage::Half)
        .blocks_in(kv_mb << 20)
        .max(1)
}

/// KV cache blocks of the CPU backend for `s`: `num_blocks`, else what `kv_cache_mb` holds.
fn cpu_num_blocks(config: &LlamaConfig, s: &BackendSettings) -> usize {
    s.num_blocks
        .unwrap_or_else(|| cpu_kv_blocks(config, s.block_size, s.kv_cache_mb))
}

/// The blocks of the host KV tier that `s.host_kv_bytes` makes for the model `config` on the
/// backend `chosen` (0: none), worked out before the backend is built, with the arithmetic the
/// backends size their tier with ([`KvGeometry`]). Refused, naming the tier's setting
/// (`s.kv_setting_names`: `cache.kv_offloading_size`, or the flag that set it), when the size
/// holds no whole block, makes more blocks than the scheduler tracks
/// ([`switchyard_policies::scheduler::MAX_HOST_BLOCKS`]), or (given the memory `available`)
/// is more than the memory there is: on the CPU backend with the KV cache beside it, which
/// lives in the same memory.
pub fn host_kv_blocks(
    chosen: BackendKind,
    config: &LlamaConfig,
    s: &BackendSettings,
    available: Option<usize>,
) -> anyhow::Result<usize> {
    if s.host_kv_bytes == 0 {
        return Ok(0);
    }
    let gib = s.host_kv_bytes as f64 / f64::from(1u32 << 30);
    let setting = s.kv_setting_names.tier;
    let cpu = chosen != BackendKind::Cuda;
    let storage = if cpu {
        KvStorage::Half
    } else {
        KvStorage::from_fp8(s.kv_cache_dtype == KvCacheDtype::Fp8)
    };
    let geometry = KvGeometry::of(config, s.block_size, storage);
    let blocks = geometry.blocks_in(s.host_kv_bytes);
    let block_bytes = geometry.block_bytes();
    anyhow::ensure!(
        blocks > 0,
        "{setting}: {} bytes ({gib:.2} GiB) hold no whole KV block of this model \
         ({block_bytes} bytes a block)",
        s.host_kv_bytes
    );
    let max = switchyard_policies::scheduler::MAX_HOST_BLOCKS;
    anyhow::ensure!(
        blocks <= max,
        "{setting}: {gib:.2} GiB makes {blocks} host KV blocks of \
         {block_bytes} bytes for this model, more than the {max} the scheduler tracks: at most \
         {:.2} GiB for this model",
        (max as f64 * block_bytes as f64) / f64::from(1u32 << 30)
    );
    let cache_bytes = if cpu {
        cpu_num_blocks(config, s).saturating_mul(block_bytes)
    } else {
        0
    };
    switchyard_gpu::kv_size::check_host_memory_named(
        blocks * block_bytes,
        cache_bytes,
        available,
        s.kv_setting_names,
    )
    .map_err(|e| {
        let e = match e {
            switchyard_gpu::GpuError::InvalidConfig(why) => why,
            e => e.to_string(),
        };
        anyhow::anyhow!(
            "{e} ({gib:.2} GiB makes {blocks} host KV blocks of {block_bytes} bytes for \
                 this model)"
        )
    })?;
    Ok(blocks)
}

/// Refuses a CPU backend's KV cache (`cpu_num_blocks`) larger than the memory `available`
/// (`None`: unknown, allowed), naming where the user set its size (`s.kv_setting_names`): the
/// backend's own check would name `cache.kv_cache_mb` whatever set it.
pub fn check_cpu_cache_memory(
    config: &LlamaConfig,
    s: &BackendSettings,
    available: Option<usize>,
) -> anyhow::Result<()> {
    let Some(available) = available else {
        return Ok(());
    };
    let blocks = cpu_num_blocks(config, s);
    let bytes = KvGeometry::of(config, s.block_size, KvStorage::Half)
        .block_bytes()
        .saturating_mul(blocks);
    anyhow::ensure!(
        bytes <= available,
        "{}: the KV cache of {blocks} blocks needs {} MiB but only {} MiB of memory is available",
        s.kv_setting_names.cache,
        bytes >> 20,
        available >> 20
    );
    Ok(())
}

/// Settings of a CPU backend.
pub struct CpuSettings {
    /// KV cache blocks.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Worker threads (0 = all cores).
    pub threads: usize,
    /// Most tokens per step.
    pub max_batch_tokens: usize,
    /// Activation precision of the quantized products.
    pub precision: CpuPrecision,
    /// Bytes of the host KV tier (`cache.kv_offloading_size`; 0: none).
    pub host_kv_bytes: usize,
}

/// Refuses a `cpu_precision` other than `auto` on a CUDA backend asked for by name, and warns
/// of one the `auto` backend will not use, naming it as the config and the flag spell it.
fn check_cpu_precision_on_cuda(p: CpuPrecision, kind: BackendKind) -> anyhow::Result<()> {
    let name = match p {
        CpuPrecision::Auto => return Ok(()),
        CpuPrecision::Int8 => "int8",
        CpuPrecision::Mixed => "mixed",
        CpuPrecision::Precise => "precise",
    };
    anyhow::ensure!(
        kind == BackendKind::Auto,
        "cpu_precision {name} applies to the CPU backend only (the CUDA backend computes in \
         bf16): leave it at auto, or run on the CPU backend"
    );
    tracing::warn!(
        cpu_precision = name,
        "backend auto chose the GPU: cpu_precision, for the CPU backend, is not used"
    );
    Ok(())
}

/// The CPU backend's precision for a setting (`auto`: the default for this machine's kernels).
fn activation_precision(p: CpuPrecision) -> ActivationPrecision {
    match p {
        CpuPrecision::Auto => ActivationPrecision::default(),
        CpuPrecision::Int8 => ActivationPrecision::Int8,
        CpuPrecision::Mixed => ActivationPrecision::Mixed,
        CpuPrecision::Precise => ActivationPrecision::Precise,
    }
}

/// Builds the CPU backend over a model.
pub fn cpu_backend_for(model: LlamaModel, s: &CpuSettings) -> anyhow::Result<Box<dyn Backend>> {
    let cfg = CpuBackendConfig {
        num_kv_blocks: s.num_blocks,
        block_size: s.block_size,
        threads: s.threads,
        max_batch_tokens: s.max_batch_tokens,
        precision: activation_precision(s.precision),
        host_kv_bytes: s.host_kv_bytes,
        ..CpuBackendConfig::default()
    };
    if let Some(w) = oversubscribed(s.threads, std::thread::available_parallelism().ok()) {
        // `serve` logs; the other commands have no subscriber and write to stderr.
        if tracing::dispatcher::has_been_set() {
            tracing::warn!("{w}");
        } else {
            eprintln!("warning: {w}");
        }
    }
    let backend = CpuBackend::new(model, &cfg)?;
    tracing::info!(
        backend = backend.name(),
        blocks = s.num_blocks,
        precision = ?cfg.precision,
        "backend ready"
    );
    Ok(Box::new(backend))
}

/// A warning when `threads` CPU threads (0: one per core) exceed the machine's `cores`: the
/// step's work is split among more threads than can run, each waiting for the slowest, so
/// every step slows (1000 threads on 2 cores made a token ~150x slower).
fn oversubscribed(threads: usize, cores: Option<std::num::NonZeroUsize>) -> Option<String> {
    let cores = cores?.get();
    (threads > cores).then(|| {
        format!(
            "{threads} CPU threads asked for (model.threads / --threads) on {cores} cores: \
             threads beyond the cores slow every step; 0 uses one per core"
        )
    })
}

/// Where a backend's weights come from.
pub enum ModelSource<'a> {
    /// Loaded weights.
    Loaded(&'a LlamaConfig, &'a ModelWeights),
    /// Random weights of an architecture, from a seed.
    Dummy(LlamaConfig, u64),
}

impl ModelSource<'_> {
    /// The architecture.
    pub fn config(&self) -> &LlamaConfig {
        match self {
            ModelSource::Loaded(c, _) => c,
            ModelSource::Dummy(c, _) => c,
        }
    }
}

/// Settings of whichever backend is built.
pub struct BackendSettings {
    /// KV cache blocks; `None` sizes the cache from `kv_cache_mb` (CPU) or
    /// `gpu_memory_utilization` (CUDA).
    pub num_blocks: Option<usize>,
    /// CPU KV cache budget, MiB.
    pub kv_cache_mb: usize,
    /// Fraction of GPU memory the CUDA backend may hold.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub gpu_memory_utilization: f64,
    /// Tokens per block.
    pub block_size: usize,
    /// CPU worker threads (0 = all cores).
    pub threads: usize,
    /// Most tokens per step.
    pub max_batch_tokens: usize,
    /// Where the user set `max_batch_tokens` (`scheduler.max_num_batched_tokens`,
    /// `--max-num-batched-tokens`), named when a backend cannot run that many.
    pub max_batch_tokens_setting: &'static str,
    /// Most sequences per step (CUDA graphs are captured up to this batch size).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub max_num_seqs: usize,
    /// Weight quantization at load (fp8: the CUDA backend only).
    pub quantization: Quantization,
    /// KV cache storage (fp8: the CUDA backend only).
    pub kv_cache_dtype: KvCacheDtype,
    /// The CPU backend's activation precision (anything but `auto`: the CPU backend only).
    pub cpu_precision: CpuPrecision,
    /// Bytes of the host KV tier (`cache.kv_offloading_size`; 0: none).
    pub host_kv_bytes: usize,
    /// Where the user set the host tier's size and the KV cache's, named when the memory
    /// cannot hold them.
    pub kv_setting_names: KvSettingNames,
}

impl BackendSettings {
    /// The settings a server configuration names (`serve` and `calibrate` build its backend).
    pub fn from_config(config: &switchyard_config::Config) -> Self {
        BackendSettings {
            num_blocks: config.cache.num_blocks,
            kv_cache_mb: config.cache.kv_cache_mb,
            gpu_memory_utilization: config.cache.gpu_memory_utilization,
            block_size: config.cache.block_size,
            threads: config.model.threads,
            max_batch_tokens: config.scheduler.max_num_batched_tokens,
            max_batch_tokens_setting: "scheduler.max_num_batched_tokens",
            max_num_seqs: config.scheduler.max_num_seqs,
            quantization: config.model.quantization,
            kv_cache_dtype: config.cache.kv_cache_dtype,
            cpu_precision: config.model.cpu_precision,
            host_kv_bytes: config.cache.kv_offloading_bytes(),
            kv_setting_names: KvSettingNames::CONFIG,
        }
    }
}

/// The model file a server configuration names: `model.path`, or the embedded default when
/// it is empty.
pub fn config_model_path(config: &switchyard_config::Config) -> anyhow::Result<PathBuf> {
    if config.model.path.is_empty() {
        resolve_model_path(None)
    } else {
        resolve_model_path(Some(Path::new(&config.model.path)))
    }
}

/// Parses a `--backend` flag.
pub fn parse_backend(s: &str) -> anyhow::Result<BackendKind> {
    match s {
        "auto" => Ok(BackendKind::Auto),
        "cpu" => Ok(BackendKind::Cpu),
        "cuda" => Ok(BackendKind::Cuda),
        other => anyhow::bail!("unknown backend `{other}` (auto, cpu or cuda)"),
    }
}

/// Whether this binary can run the CUDA backend here: built with the `cuda` feature, and a GPU
/// with the driver, NVRTC and cuBLAS present (checked without panicking). `Err` says why not.
pub fn cuda_usable() -> Result<String, String> {
    #[cfg(feature = "cuda")]
    {
        switchyard_gpu::cuda::probe()
            .map(|i| {
                format!(
                    "{} (sm_{}{}, {} MiB)",
                    i.name,
                    i.compute_capability.0,
                    i.compute_capability.1,
                    i.total_memory >> 20
                )
            })
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("this binary was built without the `cuda` feature".into())
    }
}

/// The CUDA backend's bound on the tokens of one step
/// ([`switchyard_config::CUDA_MAX_NUM_BATCHED_TOKENS`]), checked before it loads anything and
/// naming the user's setting (the backend's own check can only name its internal field).
/// `kind` is what the user asked for, so that an `auto` that picked the GPU says so.
pub fn check_cuda_batch_tokens(
    max_batch_tokens: usize,
    setting: &str,
    kind: BackendKind,
) -> anyhow::Result<()> {
    let max = switchyard_config::CUDA_MAX_NUM_BATCHED_TOKENS;
    let chosen = if kind == BackendKind::Auto {
        " (backend auto chose it, a GPU being present)"
    } else {
        ""
    };
    anyhow::ensure!(
        max_batch_tokens <= max,
        "{setting} {max_batch_tokens} is more than the CUDA backend{chosen} runs in one step, \
         at most {max}: lower it, or run on the CPU backend"
    );
    Ok(())
}

/// Builds the backend `kind` asks for: `auto` picks CUDA when [`cuda_usable`], else the CPU.
/// Logs the choice and sets `switchyard:backend_info{backend}`. Returns the kind chosen.
pub fn build_backend(
    kind: BackendKind,
    source: ModelSource<'_>,
    s: &BackendSettings,
) -> anyhow::Result<(Box<dyn Backend>, BackendKind)> {
    let chosen = match kind {
        BackendKind::Cpu => BackendKind::Cpu,
        BackendKind::Cuda => match cuda_usable() {
            Ok(_) => BackendKind::Cuda,
            Err(why) => anyhow::bail!("backend cuda is not available: {why}"),
        },
        BackendKind::Auto => match cuda_usable() {
            Ok(gpu) => {
                tracing::info!(%gpu, "backend auto: a GPU is present");
                BackendKind::Cuda
            }
            Err(why) => {
                tracing::info!(reason = %why, "backend auto: using the CPU");
                BackendKind::Cpu
            }
        },
    };
    let label = if chosen == BackendKind::Cuda {
        "cuda"
    } else {
        "cpu"
    };
    metrics::gauge!(
        switchyard_api::metrics::BACKEND_INFO,
        switchyard_api::metrics::LABEL_BACKEND => label
    )
    .set(1.0);
    // The host tier is refused here, before anything is allocated, rather than by the
    // scheduler once the backend holds it.
    let host_blocks = host_kv_blocks(
        chosen,
        source.config(),
        s,
        switchyard_gpu::cpu::kv_cache::available_memory(),
    )?;
    let backend = match chosen {
        BackendKind::Cuda => {
            check_cuda_batch_tokens(s.max_batch_tokens, s.max_batch_tokens_setting, kind)?;
            check_cpu_precision_on_cuda(s.cpu_precision, kind)?;
            cuda_backend(source, s)?
        }
        _ => {
            anyhow::ensure!(
                s.quantization == Quantization::None,
                "quantization fp8 runs on the CUDA backend only (the CPU backend runs a GGUF's own quantized types)"
            );
            anyhow::ensure!(
                s.kv_cache_dtype == KvCacheDtype::Auto,
                "kv_cache_dtype fp8 runs on the CUDA backend only (the CPU backend keeps its cache in f16)"
            );
            let config = source.config().clone();
            check_cpu_cache_memory(
                &config,
                s,
                switchyard_gpu::cpu::kv_cache::available_memory(),
            )?;
            let model = match source {
                ModelSource::Loaded(c, w) => LlamaModel::from_weights(c, w)?,
                ModelSource::Dummy(c, seed) => LlamaModel::dummy(&c, seed)?,
            };
            let settings = CpuSettings {
                num_blocks: cpu_num_blocks(&config, s),
                block_size: s.block_size,
                threads: s.threads,
                max_batch_tokens: s.max_batch_tokens,
                precision: s.cpu_precision,
                host_kv_bytes: s.host_kv_bytes,
            };
            cpu_backend_for(model, &settings)?
        }
    };
    anyhow::ensure!(
        backend.num_host_kv_blocks() == host_blocks,
        "{}: the backend holds {} host KV blocks, {host_blocks} were worked out for it",
        s.kv_setting_names.tier,
        backend.num_host_kv_blocks()
    );
    Ok((backend, chosen))
}

#[cfg(feature = "cuda")]
fn cuda_backend(source: ModelSource<'_>, s: &BackendSettings) -> anyhow::Result<Box<dyn Backend>> {
    use switchyard_gpu::cuda::{CudaBackend, CudaBackendConfig, WeightSource};
    let cfg = CudaBackendConfig {
        num_kv_blocks: s.num_blocks,
        gpu_memory_utilization: s.gpu_memory_utilization,
        block_size: s.block_size,
        max_batch_tokens: s.max_batch_tokens,
        max_num_seqs: s.max_num_seqs,
        cuda_graphs: std::env::var_os("SWITCHYARD_NO_CUDA_GRAPHS").is_none(),
        fp8: s.quantization == Quantization::Fp8,
        kv_fp8: s.kv_cache_dtype == KvCacheDtype::Fp8,
        host_kv_bytes: s.host_kv_bytes,
        setting_names: s.kv_setting_names,
        ..CudaBackendConfig::default()
    };
    let started = std::time::Instant::now();
    let backend = match source {
        ModelSource::Loaded(c, w) => CudaBackend::new(c, WeightSource::Loaded(w), &cfg)?,
        ModelSource::Dummy(c, seed) => CudaBackend::new(&c, WeightSource::Dummy(seed), &cfg)?,
    };
    tracing::info!(
        backend = backend.name(),
        blocks = backend.num_kv_blocks(),
        secs = started.elapsed().as_secs_f64(),
        "backend ready"
    );
    Ok(Box::new(backend))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_: ModelSource<'_>, _: &BackendSettings) -> anyhow::Result<Box<dyn Backend>> {
    anyhow::bail!("this binary was built without the `cuda` feature")
}

/// The scheduler's view of a model's sliding window served by `backend`: the window, and the
/// keys before it the backend may read ([`Backend::window_read_slack`]).
pub fn sliding_window(
    config: &LlamaConfig,
    backend: &dyn Backend,
) -> Option<switchyard_policies::SlidingWindow> {
    config
        .sliding_window
        .map(|tokens| switchyard_policies::SlidingWindow {
            tokens,
            read_slack: backend.window_read_slack(),
        })
}

/// A named architecture preset for random (dummy) weights.
pub fn preset(name: &str) -> anyhow::Result<LlamaConfig> {
    match name {
        "smollm2-135m" => Ok(LlamaConfig::smollm2_135m()),
        "llama-3-8b" => Ok(LlamaConfig::llama3_8b()),
        "qwen2.5-0.5b" => Ok(LlamaConfig::qwen25_05b()),
        "qwen3-0.6b" => Ok(LlamaConfig::qwen3_06b()),
        "phi-3-mini" => Ok(LlamaConfig::phi3_mini()),
        "mistral-7b-v0.1" => Ok(LlamaConfig::mistral_7b_v0_1()),
        other => anyhow::bail!(
            "unknown architecture `{other}` (known: {})",
            switchyard_config::DUMMY_ARCHITECTURES.join(", ")
        ),
    }
}

/// The scheduler's speculative decoding settings from the command line (`None` when off).
pub fn speculative_from_args(
    a: &crate::cli::SpeculativeArgs,
) -> anyhow::Result<Option<switchyard_policies::SpeculativeConfig>> {
    if a.num_speculative_tokens == 0 {
        return Ok(None);
    }
    let c = switchyard_policies::SpeculativeConfig {
        num_speculative_tokens: a.num_speculative_tokens,
        prompt_lookup_min: a.prompt_lookup_min,
        prompt_lookup_max: a.prompt_lookup_max,
        max_running: 0,
    };
    c.validate()?;
    Ok(Some(c))
}

/// The scheduler's speculative decoding settings from the YAML `speculative:` section.
pub fn speculative_from_config(
    s: Option<&switchyard_config::SpeculativeSection>,
) -> anyhow::Result<Option<switchyard_policies::SpeculativeConfig>> {
    let Some(s) = s else { return Ok(None) };
    let switchyard_config::SpeculativeMethod::Ngram = s.method;
    let c = switchyard_policies::SpeculativeConfig {
        num_speculative_tokens: s.num_speculative_tokens,
        prompt_lookup_min: s.prompt_lookup_min,
        prompt_lookup_max: s.prompt_lookup_max,
        max_running: s.max_running,
    };
    c.validate()?;
    Ok(Some(c))
}

/// The engine's asynchronous-scheduling setting for a configured mode.
pub fn async_mode(mode: switchyard_config::AsyncSchedulingMode) -> AsyncScheduling {
    match mode {
        switchyard_config::AsyncSchedulingMode::Auto => AsyncScheduling::Auto,
        switchyard_config::AsyncSchedulingMode::On => AsyncScheduling::On,
        switchyard_config::AsyncSchedulingMode::Off => AsyncScheduling::Off,
    }
}

/// An engine core with the FCFS policy, for offline work; `async_scheduling` plans each step
/// while the previous one runs (see [`AsyncScheduling`]).
pub fn offline_core(
    backend: Box<dyn Backend>,
    scheduler: SchedulerConfig,
    async_scheduling: switchyard_config::AsyncSchedulingMode,
) -> anyhow::Result<EngineCore> {
    let policy = PolicyRegistry::with_builtins().create("fcfs", &serde_yaml::Value::Null, &[])?;
    Ok(EngineCore::new(
        EngineCoreConfig {
            scheduler,
            hash_key: random_hash_key(),
        },
        policy,
        backend,
    )?
    .with_async_scheduling(async_mode(async_scheduling)))
}

/// A per-process random key for the prefix-cache hash, so outsiders cannot forge collisions.
pub fn random_hash_key() -> [u64; 2] {
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // No OS randomness: fall back to time and address entropy (still per-process).
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let a = &bytes as *const _ as usize as u128;
        bytes = (t ^ (a << 64) ^ u128::from(std::process::id())).to_le_bytes();
    }
    let (lo, hi) = bytes.split_at(8);
    [
        u64::from_le_bytes(lo.try_into().unwrap_or([0; 8])),
        u64::from_le_bytes(hi.try_into().unwrap_or([0; 8])),
    ]
}

#[cfg(test)]
mod tests {
    use switchyard_config::{BackendKind, KvCacheDtype};
    use switchyard_gpu::model::LlamaConfig;

    /// The default server settings with a host tier of `bytes` and a cache of `num_blocks`.
    fn settings(bytes: usize, num_blocks: usize) -> super::BackendSettings {
        let mut s = super::BackendSettings::from_config(&switchyard_config::Config::default());
        s.host_kv_bytes = bytes;
        s.num_blocks = Some(num_blocks);
        s
    }

    /// The tier's blocks are worked out before any backend is built; one too large for the
    /// scheduler is refused then, naming the setting, the blocks and the bound.
    #[test]
    fn the_host_tier_is_sized_and_bounded_before_the_backend_is_built() {
        let smol = LlamaConfig::smollm2_135m();
        let gib = 1usize << 30;
        let blocks = |kind, s: &super::BackendSettings| super::host_kv_blocks(kind, &smol, s, None);
        // No tier: nothing to check.
        assert_eq!(blocks(BackendKind::Cpu, &settings(0, 24)).unwrap(), 0);
        // 368,640 bytes a block (2 x 30 x 3 x 64 x 16 x 2): 1 GiB holds 2,912.
        assert_eq!(blocks(BackendKind::Cpu, &settings(gib, 24)).unwrap(), 2_912);
        assert_eq!(
            blocks(BackendKind::Cuda, &settings(gib, 24)).unwrap(),
            2_912
        );
        // fp8 on the GPU: 195,840 bytes a block (2 x 30 x 16 x 3 x (64 + 4)), 5,482 a GiB.
        let mut fp8 = settings(gib, 24);
        fp8.kv_cache_dtype = KvCacheDtype::Fp8;
        assert_eq!(blocks(BackendKind::Cuda, &fp8).unwrap(), 5_482);
        let e = blocks(BackendKind::Cpu, &settings(368_639, 24))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cache.kv_offloading_size") && e.contains("no whole KV block"),
            "{e}"
        );
        // The tiny model's blocks are 4,096 bytes (2 x 2 layers x 2 heads x 16 x 16 x 2):
        // 1024 GiB makes 2^28 of them, four times the scheduler's 2^26.
        let e = super::host_kv_blocks(
            BackendKind::Cpu,
            &LlamaConfig::tiny(),
            &settings(1024 * gib, 24),
            None,
        )
        .unwrap_err()
        .to_string();
        for part in [
            "cache.kv_offloading_size: 1024.00 GiB",
            "268435456 host KV blocks",
            "more than the 67108864",
            "at most 256.00 GiB",
        ] {
            assert!(e.contains(part), "{part}: {e}");
        }
    }

    /// On the CPU backend the tier and the KV cache share the memory: both are counted.
    #[test]
    fn the_cpu_tier_is_refused_when_it_and_the_cache_exceed_the_memory() {
        let smol = LlamaConfig::smollm2_135m();
        // 100 blocks of tier (36,864,000 bytes) and 200 of cache (73,728,000): 105 MiB in all.
        let s = settings(100 * 368_640, 200);
        let fits = Some(110 << 20);
        assert_eq!(
            super::host_kv_blocks(BackendKind::Cpu, &smol, &s, fits).unwrap(),
            100
        );
        let e = super::host_kv_blocks(BackendKind::Cpu, &smol, &s, Some(100 << 20))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cache.kv_offloading_size")
                && e.contains("KV cache beside it")
                && e.contains("100 host KV blocks"),
            "{e}"
        );
        // The GPU's cache is not in host memory: the tier alone fits in 100 MiB.
        assert!(super::host_kv_blocks(BackendKind::Cuda, &smol, &s, Some(100 << 20)).is_ok());
    }

    /// `bench throughput` sets the tier and the cache by its flags: a refusal names the flag
    /// the user typed, not the configuration's field.
    #[test]
    fn refusals_name_the_flags_that_set_the_tier_and_the_cache() {
        let smol = LlamaConfig::smollm2_135m();
        let flags = switchyard_gpu::KvSettingNames {
            tier: "--kv-offloading-size",
            cache: "--num-kv-blocks",
            blocks: "--num-kv-blocks",
        };
        let mut s = settings(100 * 368_640, 200);
        s.kv_setting_names = flags;
        let e = super::host_kv_blocks(BackendKind::Cpu, &smol, &s, Some(100 << 20))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("--kv-offloading-size: the host KV tier needs 35 MiB and the KV cache beside it (--num-kv-blocks) 70 MiB")
                && !e.contains("cache."),
            "{e}"
        );
        s.host_kv_bytes = 368_639;
        let e = super::host_kv_blocks(BackendKind::Cpu, &smol, &s, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(
                "--kv-offloading-size: 368639 bytes (0.00 GiB) hold no whole KV block of this \
                 model (368640 bytes a block)"
            ),
            "{e}"
        );
        // The cache alone: 200 blocks of 368,640 bytes are 70 MiB.
        super::check_cpu_cache_memory(&smol, &s, Some(71 << 20)).unwrap();
        super::check_cpu_cache_memory(&smol, &s, None).unwrap();
        let e = super::check_cpu_cache_memory(&smol, &s, Some(64 << 20))
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "--num-kv-blocks: the KV cache of 200 blocks needs 70 MiB but only 64 MiB of memory \
             is available"
        );
        // The server's configuration names its fields.
        let e = super::check_cpu_cache_memory(&smol, &settings(0, 200), Some(1 << 20))
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cache.kv_cache_mb or cache.num_blocks: "),
            "{e}"
        );
    }

    /// More threads than cores is warned about; up to the cores, or all of them (0), is not.
    #[test]
    fn threads_beyond_the_cores_are_warned_about() {
        let cores = std::num::NonZeroUsize::new(2);
        let w = super::oversubscribed(1000, cores).expect("a warning");
        assert!(
            w.contains("1000 CPU threads") && w.contains("2 cores"),
            "{w}"
        );
        for ok in [0, 1, 2] {
            assert_eq!(super::oversubscribed(ok, cores), None, "{ok}");
        }
        assert_eq!(super::oversubscribed(1000, None), None);
    }

    /// A CPU precision on the CUDA backend asked for by name is refused, named as the config
    /// and the flag spell it; with backend auto, or at auto, it is no error.
    #[test]
    fn a_cpu_precision_on_the_cuda_backend_is_named_as_written() {
        use switchyard_config::{BackendKind, CpuPrecision};
        let e = super::check_cpu_precision_on_cuda(CpuPrecision::Int8, BackendKind::Cuda)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("cpu_precision int8 applies to the CPU backend only"),
            "{e}"
        );
        assert!(
            super::check_cpu_precision_on_cuda(CpuPrecision::Precise, BackendKind::Auto).is_ok()
        );
        assert!(super::check_cpu_precision_on_cuda(CpuPrecision::Auto, BackendKind::Cuda).is_ok());
    }

    /// Every architecture the configuration names for dummy weights has a preset, and an
    /// unknown one is refused with the list.
    #[test]
    fn every_named_dummy_architecture_has_a_preset() {
        for name in switchyard_config::DUMMY_ARCHITECTURES {
            assert!(super::preset(name).is_ok(), "{name}");
        }
        let e = super::preset("gpt-5").unwrap_err().to_string();
        assert!(e.contains("qwen3-0.6b"), "{e}");
    }

    /// The simulator prices sliding windows with the CUDA backend's read slack.
    #[test]
    fn the_simulator_models_the_cuda_backends_window_reads() {
        assert_eq!(
            switchyard_simulator::WINDOW_READ_SLACK,
            switchyard_gpu::CUDA_WINDOW_READ_SLACK
        );
    }

    /// The server's bound on a CUDA step is the backend's own, and a refusal names the
    /// user's setting, not the backend's internal field.
    #[test]
    fn the_cuda_step_bound_is_the_backends_and_names_the_users_setting() {
        use switchyard_config::BackendKind;
        assert_eq!(
            switchyard_config::CUDA_MAX_NUM_BATCHED_TOKENS,
            switchyard_gpu::CUDA_MAX_BATCH_TOKENS
        );
        let setting = "scheduler.max_num_batched_tokens";
        super::check_cuda_batch_tokens(65_536, setting, BackendKind::Auto).unwrap();
        let e = super::check_cuda_batch_tokens(100_000, setting, BackendKind::Auto).unwrap_err();
        assert_eq!(
            e.to_string(),
            "scheduler.max_num_batched_tokens 100000 is more than the CUDA backend (backend auto \
             chose it, a GPU being present) runs in one step, at most 65536: lower it, or run on \
             the CPU backend"
        );
    }
}
