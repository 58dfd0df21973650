//! Loading a model and building a backend and an engine core, shared by `generate`,
//! `bench throughput` and `serve`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use switchyard_actors::{EngineCore, EngineCoreConfig};
use switchyard_gpu::backend::{Backend, CpuBackend, CpuBackendConfig};
use switchyard_gpu::cpu::llama::LlamaModel;
use switchyard_gpu::model::{fetch, LlamaConfig, LoadedModel};
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

/// Expands a leading `~/`.
pub fn expand_home(p: &Path) -> PathBuf {
    match (p.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => p.to_path_buf(),
    }
}

/// Loads a model file with a progress bar on terminals.
pub fn load(path: &Path) -> anyhow::Result<LoadedModel> {
    switchyard_gpu::model::load_model(path, super::progress_enabled())
        .with_context(|| format!("loading model {}", path.display()))
}

/// KV blocks that fit in `kv_mb` MiB for this model on the CPU backend (keys and values of
/// every layer, stored as f16).
pub fn cpu_kv_blocks(config: &LlamaConfig, block_size: usize, kv_mb: usize) -> usize {
    let per_block =
        (2 * config.num_layers * config.num_kv_heads * config.head_dim * block_size * 2).max(1);
    ((kv_mb << 20) / per_block).max(1)
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
}

/// Builds the CPU backend over loaded weights.
pub fn cpu_backend(
    config: &LlamaConfig,
    weights: &switchyard_gpu::model::ModelWeights,
    s: &CpuSettings,
) -> anyhow::Result<Box<dyn Backend>> {
    cpu_backend_for(LlamaModel::from_weights(config, weights)?, s)
}

/// Builds the CPU backend over a model.
pub fn cpu_backend_for(model: LlamaModel, s: &CpuSettings) -> anyhow::Result<Box<dyn Backend>> {
    let cfg = CpuBackendConfig {
        num_kv_blocks: s.num_blocks,
        block_size: s.block_size,
        threads: s.threads,
        max_batch_tokens: s.max_batch_tokens,
        ..CpuBackendConfig::default()
    };
    let backend = CpuBackend::new(model, &cfg)?;
    tracing::info!(
        backend = backend.name(),
        blocks = s.num_blocks,
        "backend ready"
    );
    Ok(Box::new(backend))
}

/// A named architecture preset for random (dummy) weights.
pub fn preset(name: &str) -> anyhow::Result<LlamaConfig> {
    match name {
        "smollm2-135m" => Ok(LlamaConfig::smollm2_135m()),
        "llama-3-8b" => Ok(LlamaConfig::llama3_8b()),
        other => anyhow::bail!("unknown architecture `{other}` (known: smollm2-135m, llama-3-8b)"),
    }
}

/// An engine core with the FCFS policy, for offline work.
pub fn offline_core(
    backend: Box<dyn Backend>,
    scheduler: SchedulerConfig,
) -> anyhow::Result<EngineCore> {
    let policy = PolicyRegistry::with_builtins().create("fcfs", &serde_yaml::Value::Null, &[])?;
    Ok(EngineCore::new(
        EngineCoreConfig {
            scheduler,
            hash_key: random_hash_key(),
        },
        policy,
        backend,
    )?)
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
