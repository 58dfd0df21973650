//! The executor interface: one [`Backend::execute`] call runs one scheduler step (a batch that
//! mixes prefill chunks and decodes, each sequence with its block table) and returns the
//! sampled tokens and requested logprobs. [`CpuBackend`] implements it on the CPU; a CUDA
//! backend implements the same trait.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::cpu::attention::QueryPos;
use crate::cpu::kv_cache::{HostKvTier, KvCache};
use crate::cpu::llama::{ActivationPrecision, LlamaModel, StepInput};
use crate::error::GpuError;
use crate::lora::LoraAdapter;
use crate::model::{LlamaConfig, LoadedModel, ModelWeights};
pub use crate::sampler::SamplingParams;
use crate::sampler::{log_softmax, top_n, SeqSampler};

/// One sequence's part of a step.
#[derive(Clone, Debug)]
pub struct SeqInput {
    /// The scheduler's id of the sequence (keys the sampler state).
    pub seq_id: u64,
    /// Tokens already in the KV cache (earlier steps and prefix-cache hits); the first token
    /// of `tokens` sits at this position.
    pub num_computed_tokens: usize,
    /// This step's tokens: a prefill chunk, or the one token of a decode.
    pub tokens: Vec<u32>,
    /// KV block ids covering positions `0..num_computed_tokens + tokens.len()`.
    pub block_table: Vec<u32>,
    /// Whether to sample a token after the last of `tokens`.
    pub sample: bool,
    /// Trailing entries of `tokens` that are draft tokens (speculative decoding; only on a
    /// sampling decode, for a backend with a [`Backend::draft_verifier`]): the backend samples
    /// at the last known token and at each draft, keeps the drafts that equal what it sampled
    /// before them, and returns them in [`SeqOutput::accepted`] followed by the first token
    /// that differs (or the one after the last draft). Outputs are then exactly those of
    /// feeding one token per step: same sampler state, same random draws.
    pub num_drafts: usize,
    /// Sampling parameters of the request.
    pub sampling: Arc<SamplingParams>,
    /// The request's LoRA adapter, if any (loaded for this backend's model; only for backends
    /// whose [`Backend::lora_slots`] is not 0).
    pub adapter: Option<Arc<LoraAdapter>>,
    /// On the sequence's first step, when it starts past prompt tokens this backend never
    /// saw (prefix-cache hits) and its sampler needs the whole prompt (a repetition
    /// penalty): the prompt, whose first `num_computed_tokens` the sampler records as if fed.
    pub cached_prompt: Option<Arc<[u32]>>,
}

/// One scheduler step.
#[derive(Clone, Debug, Default)]
pub struct Batch {
    /// The sequences of the step, each at most once.
    pub seqs: Vec<SeqInput>,
}

/// The logprob of one prompt token given the tokens before it.
#[derive(Clone, Debug, PartialEq)]
pub struct PromptLogprob {
    /// Position of the token in the prompt (at least 1).
    pub position: usize,
    /// The prompt token.
    pub token: u32,
    /// Its logprob.
    pub logprob: f32,
    /// Its rank among the vocabulary at this position, as vLLM counts it: the number of
    /// tokens whose logprob is at least its own (1 = the most likely; ties share the worse
    /// rank).
    pub rank: u32,
    /// The most likely tokens at this position with their logprobs, best first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The rank of a token whose logprob is `logprob` in the log-softmax row `row`: how many
/// tokens have a logprob at least as high (vLLM's `batched_count_greater_than`, which counts
/// the token itself). At least 1, also for a NaN logprob that nothing compares with.
pub fn rank_in_row(row: &[f32], logprob: f32) -> u32 {
    let at_least = row.iter().filter(|&&v| v >= logprob).count().max(1);
    u32::try_from(at_least).unwrap_or(u32::MAX)
}

/// A draft token the backend accepted, with its logprobs (as for [`SeqOutput::token`]).
#[derive(Clone, Debug, PartialEq)]
pub struct AcceptedDraft {
    /// The draft token.
    pub token: u32,
    /// Its logprob under the raw model distribution, when logprobs were requested.
    pub logprob: Option<f32>,
    /// The most likely tokens at its position with their logprobs, best first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// What a step produced for one sequence (one per [`SeqInput`], in batch order).
#[derive(Clone, Debug, PartialEq)]
pub struct SeqOutput {
    /// The sequence.
    pub seq_id: u64,
    /// The accepted drafts, in order, before `token` (empty without drafts).
    pub accepted: Vec<AcceptedDraft>,
    /// The sampled token, when `sample` was set: the last of the step's outputs.
    pub token: Option<u32>,
    /// Its logprob under the raw model distribution, when logprobs were requested.
    pub logprob: Option<f32>,
    /// The requested number of most likely tokens with their logprobs, best first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Prompt logprobs of the positions this step completed, when requested.
    pub prompt_logprobs: Vec<PromptLogprob>,
    /// The final hidden state (after the model's last normalization, `hidden_size` values)
    /// of the row `token` was sampled from, when [`SamplingParams::hidden_state`] is set.
    pub hidden: Option<Vec<f32>>,
}

/// Keys before a sliding window's first key that the CUDA backend's attention may read for a
/// query ([`Backend::window_read_slack`]): a split's keys are read in chunks from the one
/// holding the window's first key, and a chunk is at most 128 keys (`MMA_KEYS`, at most 64,
/// and `ATT_F8_KEYS`, at most 128, in gpu/kernels/llama.cu). Outside the `cuda` feature so
/// that the simulator's model of that backend can be checked against it.
pub const CUDA_WINDOW_READ_SLACK: usize = 128;

/// A model executor.
/// Stands in a batch for the token a sequence sampled in the step submitted just before,
/// whose value is still on the device ([`Backend::submit`]): only as the one token of a
/// sampling decode entry. Never a real token id.
pub const PENDING_TOKEN: u32 = u32::MAX;

/// One KV block copied between the device cache and the backend's host tier
/// ([`Backend::copy_kv`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvCopy {
    /// The block of the KV cache (`0..num_kv_blocks`).
    pub device: u32,
    /// The block of the host tier (`0..num_host_kv_blocks`).
    pub host: u32,
}

pub trait Backend: Send {
    /// A short description ("cpu (avx512-vnni, 2 threads)").
    fn name(&self) -> &str;
    /// Number of KV cache blocks (block ids run `0..num_kv_blocks`).
    fn num_kv_blocks(&self) -> usize;
    /// Token slots per KV block.
    fn block_size(&self) -> usize;
    /// Most tokens one batch may hold.
    fn max_batch_tokens(&self) -> usize;
    /// Runs one step.
    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError>;
    /// Drops the sampler state of a finished, aborted or preempted sequence.
    fn release(&mut self, seq_id: u64);
    /// How many distinct LoRA adapters one batch may name ([`SeqInput::adapter`]); 0 when the
    /// backend runs none.
    fn lora_slots(&self) -> usize {
        0
    }
    /// Whether the backend stays right for other sequences after a panic inside one of its
    /// calls (a bug): the engine then fails that step's requests and goes on with it; a
    /// backend that says no is retired, and every later step fails with an error saying so.
    /// No by default: a device backend may have work queued that the panic left behind.
    fn recovers_from_panics(&self) -> bool {
        false
    }
    /// Under a sliding window ([`crate::LlamaConfig::sliding_window`]), how many keys before a
    /// query's window the backend may still read for it (it reads keys in blocks or chunks
    /// and masks those outside the window): the scheduler gives a running sequence's blocks
    /// back only this far behind its window, and their slots may then hold anything. A
    /// block's length by default: a backend whose reads start at the block holding the
    /// window's first key.
    fn window_read_slack(&self) -> usize {
        self.block_size()
    }
    /// Whether [`Backend::submit`] and [`Backend::collect`] work: steps may be submitted one
    /// ahead of their outputs, fed [`PENDING_TOKEN`]s.
    fn pipelines(&self) -> bool {
        false
    }
    /// Which requests' draft tokens the backend verifies ([`SeqInput::num_drafts`]); `None`
    /// when it takes no drafts (speculative decoding is then unavailable).
    fn draft_verifier(&self) -> Option<DraftVerifier> {
        None
    }
    /// Whether a submitted step runs while the caller goes on (a device with its own queue),
    /// so planning the next step during it pays off; a backend that works in `submit` on the
    /// caller's thread gains nothing from it.
    fn overlaps_host(&self) -> bool {
        false
    }
    /// Blocks of the host KV tier this backend holds (0: none), each the size of a KV block.
    fn num_host_kv_blocks(&self) -> usize {
        0
    }
    /// Copies KV blocks between the cache and the host tier: first every `offloads` entry
    /// (cache → host), then every `loads` entry (host → cache); after every step submitted or
    /// executed before the call, before every one after it. A block id out of range is an
    /// error, and so is any copy on a backend without a host tier.
    fn copy_kv(&mut self, offloads: &[KvCopy], loads: &[KvCopy]) -> Result<(), GpuError> {
        if offloads.is_empty() && loads.is_empty() {
            return Ok(());
        }
        Err(GpuError::BadBatch(format!(
            "the {} backend has no host KV tier",
            self.name()
        )))
    }
    /// Copies cache blocks to the host tier ahead of their eviction (cache → host, as
    /// offloads). The caller promises that the step submitted or executed next writes none of
    /// their cache blocks and that no [`Backend::copy_kv`] before that step names their cache
    /// or host blocks; the backend may then make them alongside that step, but after every
    /// step submitted or executed before the call and before every copy and step after the
    /// next one. By default they are made at once, as offloads.
    fn store_kv(&mut self, stores: &[KvCopy]) -> Result<(), GpuError> {
        self.copy_kv(stores, &[])
    }
    /// Starts a step; the next [`Backend::collect`] returns its outputs (steps are collected
    /// in submission order, at most one submitted ahead of the oldest uncollected one). A
    /// sampling decode entry may feed [`PENDING_TOKEN`]: the token the previous submitted
    /// step samples for it. Requests with repetition, presence or frequency penalties cannot
    /// (their logit edits need the token). A backend that runs on the caller's thread does
    /// the work here and keeps the outputs.
    fn submit(&mut self, _batch: &Batch) -> Result<(), GpuError> {
        Err(GpuError::Internal(format!(
            "the {} backend does not pipeline steps",
            self.name()
        )))
    }
    /// The outputs of the oldest submitted step; an output for a sequence released in
    /// between is still returned (the caller drops it).
    fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
        Err(GpuError::Internal(format!(
            "the {} backend does not pipeline steps",
            self.name()
        )))
    }
}

/// Whether a backend verifies drafts for a request with these sampling parameters.
pub type DraftVerifier = fn(&SamplingParams) -> bool;

/// Whether a request's sampling can take a [`PENDING_TOKEN`]: no penalties (they read the
/// token values of the sequence so far, which the host learns a step late). A constraint
/// (structured output) can: a backend that pipelines steps commits each token to it before it
/// asks for the next step's allowed set (the CUDA backend holds such a step's sampling until
/// the step before is collected).
pub fn takes_pending_tokens(p: &SamplingParams) -> bool {
    p.repetition_penalty == 1.0 && p.presence_penalty == 0.0 && p.frequency_penalty == 0.0
}

/// Settings of a [`CpuBackend`].
#[derive(Clone, Debug)]
pub struct CpuBackendConfig {
    /// Number of KV cache blocks.
    pub num_kv_blocks: usize,
    /// Token slots per block.
    pub block_size: usize,
    /// Worker threads (0: one per core).
    pub threads: usize,
    /// Most tokens per batch.
    pub max_batch_tokens: usize,
    /// Seed of the streams of requests that bring none.
    pub seed: u64,
    /// Precision of the activations entering the quantized matrix multiplies.
    pub precision: ActivationPrecision,
    /// Bytes of the host KV tier (`cache.kv_offloading_size`; 0: none), whole blocks of the
    /// cache's layout ([`Backend::num_host_kv_blocks`]). On this backend it is ordinary memory
    /// like the cache itself: worth it where a larger cache cannot be had, and it makes the
    /// feature testable without a GPU.
    pub host_kv_bytes: usize,
}

impl Default for CpuBackendConfig {
    fn default() -> Self {
        CpuBackendConfig {
            num_kv_blocks: 1024,
            block_size: 16,
            threads: 0,
            max_batch_tokens: 8192,
            seed: 0,
            precision: ActivationPrecision::default(),
            host_kv_bytes: 0,
        }
    }
}

/// Most tokens in one step on the CUDA backend (its `max_batch_tokens`; the CPU backend takes
/// up to 1,048,576). The server's `switchyard_config::CUDA_MAX_NUM_BATCHED_TOKENS` is the same
/// bound, checked where the user's setting is known so that the refusal names it.
pub const CUDA_MAX_BATCH_TOKENS: usize = 1 << 16;

/// Most rows of logits one step may compute (prompt logprobs need a row per prompt token;
/// the scheduler sends such prompts in chunks of at most this many tokens).
pub const MAX_LOGIT_ROWS: usize = 2048;

/// A batch flattened for the forward pass: tokens, their positions, the rows needing logits.
type FlatBatch = (Vec<u32>, Vec<QueryPos>, Vec<usize>);

/// Sampler state of a sequence across steps.
struct SeqState {
    sampler: SeqSampler,
    /// No token sampled yet: fed tokens are prompt tokens.
    in_prompt: bool,
    /// Log-softmax of the last row of the previous prompt chunk (for prompt logprobs).
    pending: Option<HeldRow>,
    /// The last sampled token (what a [`PENDING_TOKEN`] stands for).
    last: Option<u32>,
}

/// The CPU backend: the Llama forward pass of [`crate::cpu::llama`] with a paged KV cache,
/// running in its own thread pool.
pub struct CpuBackend {
    model: LlamaModel,
    cache: KvCache,
    /// The host tier of the prefix cache, if configured.
    host: Option<HostKvTier>,
    pool: rayon::ThreadPool,
    states: HashMap<u64, SeqState>,
    seeds: ChaCha8Rng,
    max_batch_tokens: usize,
    /// Outputs of submitted steps not collected yet (the work runs in `submit`).
    submitted: std::collections::VecDeque<Vec<SeqOutput>>,
    name: String,
}

impl CpuBackend {
    /// A backend running `model` with a KV cache of `cfg.num_kv_blocks` blocks.
    pub fn new(mut model: LlamaModel, cfg: &CpuBackendConfig) -> Result<Self, GpuError> {
        model.set_precision(cfg.precision);
        let c = &model.config;
        let cache = KvCache::new(
            c.num_layers,
            cfg.num_kv_blocks,
            cfg.block_size,
            c.num_kv_heads,
            c.head_dim,
        )?;
        let host = cache.host_tier(cfg.host_kv_bytes)?;
        if cfg.max_batch_tokens == 0 || cfg.max_batch_tokens > 1 << 20 {
            return Err(GpuError::InvalidConfig(
                "max_batch_tokens must be in 1..=1048576".into(),
            ));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(cfg.threads)
            .thread_name(|i| format!("cpu-backend-{i}"))
            .build()
            .map_err(|e| {
                GpuError::InvalidConfig(format!("cannot start the CPU thread pool: {e}"))
            })?;
        let name = format!(
            "cpu ({:?}, {} threads)",
            model.isa(),
            pool.current_num_threads()
        );
        Ok(CpuBackend {
            model,
            cache,
            host,
            pool,
            states: HashMap::new(),
            seeds: ChaCha8Rng::seed_from_u64(cfg.seed),
            max_batch_tokens: cfg.max_batch_tokens,
            submitted: std::collections::VecDeque::new(),
            name,
        })
    }

    /// Builds the model from tensors and config, then the backend.
    pub fn from_weights(
        config: &LlamaConfig,
        weights: &ModelWeights,
        cfg: &CpuBackendConfig,
    ) -> Result<Self, GpuError> {
        Self::new(LlamaModel::from_weights(config, weights)?, cfg)
    }

    /// Builds the backend for a model returned by [`crate::model::load_model`].
    pub fn from_loaded(model: &LoadedModel, cfg: &CpuBackendConfig) -> Result<Self, GpuError> {
        Self::from_weights(&model.config, &model.weights, cfg)
    }

    /// The model.
    pub fn model(&self) -> &LlamaModel {
        &self.model
    }

    /// Mutable access to the model (to pin an instruction set in tests).
    pub fn model_mut(&mut self) -> &mut LlamaModel {
        &mut self.model
    }

    /// Runs the forward pass only and returns the logits of the last token of every sequence
    /// (`seqs.len() * vocab_size`), touching no sampler state; for tests and benchmarks.
    pub fn logits(&mut self, batch: &Batch) -> Result<Vec<f32>, GpuError> {
        let (tokens, queries, rows) = self.flatten(batch, |_, s| vec![s.tokens.len() - 1])?;
        let tables: Vec<&[u32]> = batch
            .seqs
            .iter()
            .map(|s| s.block_table.as_slice())
            .collect();
        let adapters = adapters_of(batch);
        let step = StepInput {
            tokens: &tokens,
            queries: &queries,
            tables: &tables,
            adapters: &adapters,
        };
        let (model, cache) = (&self.model, &mut self.cache);
        self.pool.install(|| model.forward(cache, &step, &rows))
    }

    /// Checks the batch and flattens it; `rows` names the chunk rows whose logits each
    /// sequence needs.
    fn flatten(
        &self,
        batch: &Batch,
        rows: impl Fn(usize, &SeqInput) -> Vec<usize>,
    ) -> Result<FlatBatch, GpuError> {
        validate_batch(
            batch,
            &self.model.config,
            self.cache.num_blocks,
            self.cache.block_size,
            self.max_batch_tokens,
            false,
        )?;
        let bad = |m: String| Err(GpuError::BadBatch(m));
        let total: usize = batch.seqs.iter().map(|s| s.tokens.len()).sum();
        let mut tokens = Vec::with_capacity(total);
        let mut queries = Vec::with_capacity(total);
        let mut logit_rows = Vec::new();
        for (i, s) in batch.seqs.iter().enumerate() {
            let base = tokens.len();
            logit_rows.extend(rows(i, s).into_iter().map(|r| base + r));
            tokens.extend_from_slice(&s.tokens);
            queries.extend((0..s.tokens.len()).map(|j| QueryPos {
                pos: s.num_computed_tokens + j,
                seq: i,
            }));
        }
        if logit_rows.len() > MAX_LOGIT_ROWS {
            return bad(format!(
                "{} rows of logits (prompt logprobs) exceed {MAX_LOGIT_ROWS} per step",
                logit_rows.len()
            ));
        }
        Ok((tokens, queries, logit_rows))
    }

    /// Whether `s` needs the logits of every chunk row (prompt logprobs still being produced).
    fn wants_prompt_logprobs(&self, s: &SeqInput) -> bool {
        s.sampling.prompt_logprobs.is_some()
            && self.states.get(&s.seq_id).is_none_or(|st| st.in_prompt)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        &self.name
    }

    /// Steps run to their end within the call, and a step writes only its own sequences'
    /// KV blocks and sampler states, which the engine drops with its failed requests.
    fn recovers_from_panics(&self) -> bool {
        true
    }

    fn num_kv_blocks(&self) -> usize {
        self.cache.num_blocks
    }

    fn block_size(&self) -> usize {
        self.cache.block_size
    }

    fn max_batch_tokens(&self) -> usize {
        self.max_batch_tokens
    }

    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        let prompt_lp: Vec<bool> = batch
            .seqs
            .iter()
            .map(|s| self.wants_prompt_logprobs(s))
            .collect();
        let (tokens, queries, rows) = self.flatten(batch, |i, s| logit_rows_of(s, prompt_lp[i]))?;
        let tables: Vec<&[u32]> = batch
            .seqs
            .iter()
            .map(|s| s.block_table.as_slice())
            .collect();
        let adapters = adapters_of(batch);
        let step = StepInput {
            tokens: &tokens,
            queries: &queries,
            tables: &tables,
            adapters: &adapters,
        };
        let (model, cache) = (&self.model, &mut self.cache);
        let (logits, hidden) = self
            .pool
            .install(|| model.forward_rows(cache, &step, &rows))?;
        let vocab = self.model.config.vocab_size;
        let h = self.model.config.hidden_size;
        // Hand each sequence its state and its rows of logits, then sample in parallel.
        let mut work = Vec::with_capacity(batch.seqs.len());
        let mut offset = 0;
        for (i, s) in batch.seqs.iter().enumerate() {
            let n = if prompt_lp[i] {
                s.tokens.len()
            } else if s.sample {
                1 + s.num_drafts
            } else {
                0
            };
            let state = match self.states.remove(&s.seq_id) {
                Some(st) => st,
                None => {
                    let seed = s.sampling.seed.unwrap_or_else(|| self.seeds.next_u64());
                    SeqState {
                        sampler: SeqSampler::new(seed),
                        in_prompt: true,
                        pending: None,
                        last: None,
                    }
                }
            };
            // The hidden state of the row sampled at the last known token (before any drafts).
            let hidden = (s.sample && s.sampling.hidden_state).then(|| {
                let r = offset + n - 1 - s.num_drafts;
                hidden[r * h..(r + 1) * h].to_vec()
            });
            work.push((
                s,
                state,
                &logits[offset * vocab..(offset + n) * vocab],
                prompt_lp[i],
                hidden,
            ));
            offset += n;
        }
        let outputs: Vec<SeqOutput> = self.pool.install(|| {
            work.par_iter_mut()
                .map(|(s, st, l, plp, hidden)| {
                    let mut out = step_sequence(s, st, l, *plp, vocab);
                    out.hidden = hidden.take();
                    out
                })
                .collect()
        });
        for ((s, mut st, _, _, _), out) in work.into_iter().zip(&outputs) {
            st.last = out.token.or(st.last);
            self.states.insert(s.seq_id, st);
        }
        Ok(outputs)
    }

    fn release(&mut self, seq_id: u64) {
        self.states.remove(&seq_id);
    }

    fn lora_slots(&self) -> usize {
        usize::MAX
    }

    fn draft_verifier(&self) -> Option<DraftVerifier> {
        // Rows are sampled one after another with the sequence's own sampler: penalties,
        // constraints and seeds all see the tokens as if fed one per step.
        Some(|_| true)
    }

    fn pipelines(&self) -> bool {
        true
    }

    fn num_host_kv_blocks(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.num_blocks)
    }

    /// Steps run to their end inside `submit`, so copies made now come after every step
    /// submitted before and before every one after.
    fn copy_kv(&mut self, offloads: &[KvCopy], loads: &[KvCopy]) -> Result<(), GpuError> {
        if offloads.is_empty() && loads.is_empty() {
            return Ok(());
        }
        let Some(host) = self.host.as_mut() else {
            return Err(GpuError::BadBatch(format!(
                "the {} backend has no host KV tier",
                self.name
            )));
        };
        let pairs = |c: &[KvCopy]| -> Vec<(usize, usize)> {
            c.iter()
                .map(|c| (c.device as usize, c.host as usize))
                .collect()
        };
        self.cache
            .copy_blocks(host, &pairs(offloads), &pairs(loads))
    }

    fn submit(&mut self, batch: &Batch) -> Result<(), GpuError> {
        if self.submitted.len() > 1 {
            return Err(GpuError::Internal(
                "a step submitted more than one ahead of its outputs".into(),
            ));
        }
        // The work runs now, so a pending token is already known: the sequence's last sample.
        let outputs = if batch.seqs.iter().any(|s| s.tokens.contains(&PENDING_TOKEN)) {
            let mut b = batch.clone();
            for s in &mut b.seqs {
                if !s.tokens.contains(&PENDING_TOKEN) {
                    continue;
                }
                check_pending(s)?;
                s.tokens[0] = self
                    .states
                    .get(&s.seq_id)
                    .and_then(|st| st.last)
                    .ok_or_else(|| {
                        GpuError::BadBatch(format!(
                            "sequence {} feeds a pending token but sampled none",
                            s.seq_id
                        ))
                    })?;
            }
            self.execute(&b)?
        } else {
            self.execute(batch)?
        };
        self.submitted.push_back(outputs);
        Ok(())
    }

    fn collect(&mut self) -> Result<Vec<SeqOutput>, GpuError> {
        self.submitted
            .pop_front()
            .ok_or_else(|| GpuError::Internal("no submitted step to collect".into()))
    }
}

/// Each sequence's adapter, or an empty list when no sequence has one.
fn adapters_of(batch: &Batch) -> Vec<Option<&LoraAdapter>> {
    if batch.seqs.iter().all(|s| s.adapter.is_none()) {
        return Vec::new();
    }
    batch.seqs.iter().map(|s| s.adapter.as_deref()).collect()
}

/// Checks that an entry feeding a [`PENDING_TOKEN`] may: it is the one token of a sampling
/// decode of a request without penalties.
pub(crate) fn check_pending(s: &SeqInput) -> Result<(), GpuError> {
    if s.tokens.len() != 1 || !s.sample {
        return Err(GpuError::BadBatch(format!(
            "sequence {}: a pending token is only the one token of a sampling decode",
            s.seq_id
        )));
    }
    if !takes_pending_tokens(&s.sampling) {
        return Err(GpuError::BadBatch(format!(
            "sequence {}: a request with penalties cannot feed a pending token",
            s.seq_id
        )));
    }
    Ok(())
}

/// Checks a batch against the model and the KV cache (both backends): token count, unique
/// sequences, tokens inside the vocabulary, positions inside the context window, block tables
/// long enough and inside the cache, LoRA adapters loaded for this model, sampling parameters.
pub(crate) fn validate_batch(
    batch: &Batch,
    c: &LlamaConfig,
    num_blocks: usize,
    block_size: usize,
    max_tokens: usize,
    pending_ok: bool,
) -> Result<(), GpuError> {
    let bad = |m: String| Err(GpuError::BadBatch(m));
    if batch.seqs.is_empty() {
        return bad("an empty batch (the engine builds none)".into());
    }
    let total: usize = batch.seqs.iter().map(|s| s.tokens.len()).sum();
    if total > max_tokens {
        return bad(format!(
            "{total} tokens exceed the batch limit of {max_tokens}"
        ));
    }
    let mut ids = HashSet::new();
    for s in &batch.seqs {
        if !ids.insert(s.seq_id) {
            return bad(format!("sequence {} appears twice", s.seq_id));
        }
        if s.tokens.is_empty() {
            return bad(format!("sequence {} has no tokens", s.seq_id));
        }
        if s.num_drafts > 0 && (!s.sample || s.num_drafts >= s.tokens.len()) {
            return bad(format!(
                "sequence {}: {} drafts need a sampling entry with a token before them",
                s.seq_id, s.num_drafts
            ));
        }
        if s.adapter.as_ref().is_some_and(|a| !a.fits(c)) {
            return bad(format!(
                "sequence {}: its LoRA adapter was loaded for a model of another shape",
                s.seq_id
            ));
        }
        if pending_ok && s.tokens.contains(&PENDING_TOKEN) {
            check_pending(s)?;
        } else if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return bad(format!(
                "token {t} is outside the vocabulary ({})",
                c.vocab_size
            ));
        }
        let end = s.num_computed_tokens + s.tokens.len();
        if end > c.max_position_embeddings {
            return bad(format!(
                "sequence {} reaches position {} past the context window ({})",
                s.seq_id,
                end - 1,
                c.max_position_embeddings
            ));
        }
        let need = (end - 1) / block_size + 1;
        if s.block_table.len() < need {
            return bad(format!(
                "block table of {} blocks cannot hold position {}",
                s.block_table.len(),
                end - 1
            ));
        }
        if let Some(&b) = s.block_table[..need]
            .iter()
            .find(|&&b| b as usize >= num_blocks)
        {
            return bad(format!(
                "block id {b} out of range (cache has {num_blocks})"
            ));
        }
        s.sampling.validate(c.vocab_size)?;
    }
    Ok(())
}

/// The rows of a sequence's chunk whose logits a step needs: every row while prompt logprobs
/// are produced, else the last known token's and the drafts' when the step samples, else
/// none.
pub(crate) fn logit_rows_of(s: &SeqInput, prompt_logprobs: bool) -> Vec<usize> {
    if prompt_logprobs {
        (0..s.tokens.len()).collect()
    } else if s.sample {
        (s.tokens.len() - 1 - s.num_drafts..s.tokens.len()).collect()
    } else {
        Vec::new()
    }
}

/// The log-softmax row of a prompt chunk's last token, held for the next chunk's first.
pub(crate) struct HeldRow {
    /// The position whose token the row scores.
    position: usize,
    row: Vec<f32>,
}

/// The prompt logprobs a step completed for one sequence, from the log-softmax `rows` of its
/// tokens (one per token of `s.tokens`). The row held back from the sequence's previous chunk
/// (`pending`) scores this chunk's first token, each row but the last scores the next token,
/// and the last row is held back for the next chunk unless the step samples (then the prompt
/// is complete). A held row scores only the position it was held for: a sequence preempted
/// between chunks starts again earlier (at a block boundary, or at 0), where the row does not
/// belong (that position's logprob went out before). Both backends report prompt logprobs
/// through this one function.
pub(crate) fn prompt_logprobs(
    s: &SeqInput,
    pending: &mut Option<HeldRow>,
    rows: impl IntoIterator<Item = Vec<f32>>,
) -> Vec<PromptLogprob> {
    let n = s.sampling.prompt_logprobs.unwrap_or(0) as usize;
    let entry = |lp: &[f32], position: usize, token: u32| {
        let logprob = lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY);
        PromptLogprob {
            position,
            token,
            logprob,
            rank: rank_in_row(lp, logprob),
            top_logprobs: top_n(lp, n),
        }
    };
    let mut out = Vec::with_capacity(s.tokens.len());
    if let Some(prev) = pending.take() {
        if prev.position == s.num_computed_tokens {
            out.push(entry(&prev.row, s.num_computed_tokens, s.tokens[0]));
        }
    }
    let mut last = None;
    for (j, lp) in rows.into_iter().enumerate().take(s.tokens.len()) {
        if let Some(&next) = s.tokens.get(j + 1) {
            out.push(entry(&lp, s.num_computed_tokens + j + 1, next));
        }
        last = Some(lp);
    }
    if !s.sample {
        *pending = last.map(|row| HeldRow {
            position: s.num_computed_tokens + s.tokens.len(),
            row,
        });
    }
    out
}

/// Updates one sequence's state with this step's tokens and logits rows; samples if asked.
fn step_sequence(
    s: &SeqInput,
    st: &mut SeqState,
    logits: &[f32],
    prompt_lp: bool,
    vocab: usize,
) -> SeqOutput {
    let mut out = SeqOutput {
        seq_id: s.seq_id,
        accepted: Vec::new(),
        token: None,
        logprob: None,
        top_logprobs: Vec::new(),
        prompt_logprobs: Vec::new(),
        hidden: None,
    };
    if st.in_prompt {
        if let Some(prompt) = &s.cached_prompt {
            st.sampler
                .observe_prompt(&prompt[..s.num_computed_tokens.min(prompt.len())]);
        }
        st.sampler
            .observe_prompt(&s.tokens[..s.tokens.len() - s.num_drafts]);
    }
    if prompt_lp {
        out.prompt_logprobs = prompt_logprobs(
            s,
            &mut st.pending,
            logits.chunks_exact(vocab).map(log_softmax),
        );
    }
    if s.sample {
        // The last known token's row, then one per draft: each draft is kept while it is
        // what the sampler draws before it, exactly as if the tokens came one per step.
        let rows = logits.len() / vocab;
        let first = rows - 1 - s.num_drafts;
        let drafts = &s.tokens[s.tokens.len() - s.num_drafts..];
        st.in_prompt = false;
        st.pending = None;
        for (i, row) in logits.chunks_exact(vocab).skip(first).enumerate() {
            let sampled = st.sampler.sample(row, &s.sampling);
            if drafts.get(i) == Some(&sampled.token) {
                out.accepted.push(AcceptedDraft {
                    token: sampled.token,
                    logprob: sampled.logprob,
                    top_logprobs: sampled.top_logprobs,
                });
                continue;
            }
            out.token = Some(sampled.token);
            out.logprob = sampled.logprob;
            out.top_logprobs = sampled.top_logprobs;
            break;
        }
    }
    out
}

#[cfg(test)]
#[path = "backend_host_tier_tests.rs"]
mod host_tier_tests;

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(num_computed_tokens: usize, tokens: Vec<u32>, sample: bool) -> SeqInput {
        SeqInput {
            seq_id: 1,
            num_computed_tokens,
            tokens,
            block_table: Vec::new(),
            sample,
            num_drafts: 0,
            sampling: Arc::new(SamplingParams {
                prompt_logprobs: Some(0),
                ..SamplingParams::default()
            }),
            adapter: None,
            cached_prompt: None,
        }
    }

    /// A row over 4 tokens that gives token `t` the logprob `-t - 10 p` (`p` tells the rows
    /// apart).
    fn row(p: usize) -> Vec<f32> {
        (0..4).map(|t| -(t as f32) - 10.0 * p as f32).collect()
    }

    #[test]
    fn a_held_row_scores_only_the_position_it_was_held_for() {
        let mut pending = None;
        // Chunk 0..3 (tokens 0, 1, 2): rows 0 and 1 score positions 1 and 2; row 2 is held.
        let out = prompt_logprobs(
            &chunk(0, vec![0, 1, 2], false),
            &mut pending,
            (0..3).map(row),
        );
        let got: Vec<(usize, u32, f32)> = out
            .iter()
            .map(|e| (e.position, e.token, e.logprob))
            .collect();
        assert_eq!(got, [(1, 1, -1.0), (2, 2, -12.0)]);
        // The next chunk from position 3: the held row scores its first token.
        let out = prompt_logprobs(&chunk(3, vec![3, 0], true), &mut pending, (3..5).map(row));
        let got: Vec<(usize, u32, f32)> = out
            .iter()
            .map(|e| (e.position, e.token, e.logprob))
            .collect();
        assert_eq!(got, [(3, 3, -23.0), (4, 0, -30.0)]);
        assert!(pending.is_none(), "a sampling step holds nothing");
        // Row 4 gives token 0 the best logprob: rank 1; the others' ranks follow their ids.
        assert_eq!(out.iter().map(|e| e.rank).collect::<Vec<_>>(), [4, 1]);
        // Preempted after the first chunk, the sequence starts again at 0 (or a block
        // boundary before 3): the held row does not belong there.
        let mut pending = None;
        prompt_logprobs(
            &chunk(0, vec![0, 1, 2], false),
            &mut pending,
            (0..3).map(row),
        );
        let out = prompt_logprobs(
            &chunk(0, vec![0, 1, 2, 3], false),
            &mut pending,
            (0..4).map(row),
        );
        assert_eq!(
            out.iter().map(|e| e.position).collect::<Vec<_>>(),
            [1, 2, 3],
            "position 0 has no logprob, whatever was held"
        );
    }

    #[test]
    fn a_rank_counts_the_tokens_at_least_as_likely_as_vllm_does() {
        let row = [-1.0, -3.0, -2.0, -2.0, f32::NAN];
        assert_eq!(rank_in_row(&row, -1.0), 1);
        assert_eq!(rank_in_row(&row, -3.0), 4);
        // Ties share the worse rank (vLLM counts `logprob >= token's`).
        assert_eq!(rank_in_row(&row, -2.0), 3);
        assert_eq!(rank_in_row(&row, f32::NAN), 1);
    }
}
