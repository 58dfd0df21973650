//! Plain data shared by the scheduler, the policies, the simulator and the engine:
//! identifiers, time, requests, configuration, step plans and events.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use crate::speculative::SpeculativeConfig;

/// Microseconds, the unit of every duration in this crate.
pub type Micros = u64;

/// A token id of the model's vocabulary.
pub type TokenId = u32;

/// Stands for a sampled token that is still on the device: [`crate::Scheduler::launch`]
/// appends one per sampling entry of a step whose outputs are not known yet (so the next
/// step can be planned while the device runs this one), and
/// [`crate::Scheduler::resolve`] replaces it with the real token. Never a real token id
/// (vocabularies are far smaller).
pub const PENDING_TOKEN: TokenId = TokenId::MAX;

/// Index of a KV block in the [`crate::BlockPool`].
pub type BlockId = u32;

/// Microseconds on the caller's clock (virtual in the simulator, monotonic in the engine).
#[derive(
    Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Timestamp(pub u64);

impl Timestamp {
    /// Converts seconds to a timestamp, rounded to the nearest microsecond (so that a time
    /// written 4.1 s, whose `f64` is a hair below, is 4,100,000 µs wherever it is read: a
    /// trace's arrival and a simulated change at the same time fall on the same microsecond);
    /// negative or NaN inputs give zero, huge ones saturate.
    pub fn from_secs_f64(secs: f64) -> Self {
        let us = (secs * 1e6).round();
        if us.is_nan() || us <= 0.0 {
            Timestamp(0)
        } else if us >= u64::MAX as f64 {
            Timestamp(u64::MAX)
        } else {
            Timestamp(us as u64)
        }
    }

    /// Converts milliseconds to a timestamp (same clamping as [`Timestamp::from_secs_f64`]).
    pub fn from_millis_f64(ms: f64) -> Self {
        Self::from_secs_f64(ms / 1e3)
    }

    /// The timestamp in seconds.
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 / 1e6
    }

    /// Microseconds elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_sub(self, earlier: Timestamp) -> Micros {
        self.0.saturating_sub(earlier.0)
    }

    /// `self` moved `us` microseconds later, saturating at the end of time.
    pub fn saturating_add(self, us: Micros) -> Timestamp {
        Timestamp(self.0.saturating_add(us))
    }
}

/// Identifier of a request, unique among the requests a scheduler knows.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct RequestId(pub u64);

/// SLO targets of a request (from its tier); `None` means no target.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SloTargets {
    /// Time-to-first-token target in milliseconds.
    pub ttft_ms: Option<f64>,
    /// Time-per-output-token target in milliseconds (after the first token).
    pub tpot_ms: Option<f64>,
}

/// Limits that decide when a sequence finishes (the sampler's values live in `gpu`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplingLimits {
    /// Maximum number of output tokens (at least 1).
    pub max_tokens: u32,
    /// Stop and EOS tokens are ignored until this many tokens were generated.
    pub min_tokens: u32,
    /// Token ids that end the sequence with [`FinishReason::Stop`].
    pub stop_token_ids: Vec<TokenId>,
    /// The model's end-of-sequence token, if any.
    pub eos_token_id: Option<TokenId>,
    /// Whether to keep generating past the EOS token.
    pub ignore_eos: bool,
    /// Every prompt position needs a row of logits (prompt logprobs): beyond the row its
    /// seat keeps, each chunk of the request takes a row per further token from the step's
    /// shared logit rows ([`SchedulerConfig::max_logit_rows`]); its decodes take none.
    pub prompt_logits: bool,
    /// Whether the request may be fed draft tokens when speculative decoding is on
    /// ([`SchedulerConfig::speculative`]); false where the backend cannot verify drafts for
    /// its sampling settings.
    #[serde(default = "yes")]
    pub speculate: bool,
}

fn yes() -> bool {
    true
}

impl Default for SamplingLimits {
    fn default() -> Self {
        Self {
            max_tokens: 16,
            min_tokens: 0,
            stop_token_ids: Vec::new(),
            eos_token_id: None,
            ignore_eos: false,
            prompt_logits: false,
            speculate: true,
        }
    }
}

/// A generation request as the scheduler sees it: tokens, limits and scheduling metadata.
#[derive(Clone, Debug)]
pub struct Request {
    /// Unique id chosen by the caller.
    pub id: RequestId,
    /// Bounded tenant label, used by fair share.
    pub tenant: String,
    /// Tier name (e.g. "premium"); "" is the default tier.
    pub tier: String,
    /// Lower value = more urgent (vLLM convention).
    pub priority: i32,
    /// LoRA adapter id, part of the prefix-cache key.
    pub lora_adapter: Option<u32>,
    /// Arrival time on the caller's clock.
    pub arrival: Timestamp,
    /// SLO targets; a `None` target is taken from the request's tier.
    pub slo: SloTargets,
    /// Prompt token ids (shared, so traces can reuse big prompts cheaply).
    pub prompt: Arc<[TokenId]>,
    /// Stop conditions.
    pub limits: SamplingLimits,
    /// Prefix-cache salt; `None` or `Some(0)` share the cache with every tenant.
    pub cache_salt: Option<u64>,
}

/// Why a sequence finished.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` reached.
    Length,
    /// A stop token id or a stop string.
    Stop,
    /// The end-of-sequence token.
    Eos,
    /// Aborted by the caller.
    Abort,
    /// Never admitted within its queue bound ([`TierSpec::max_queue_ms`],
    /// [`SchedulerConfig::max_queue_ms`]): ended by the core while still waiting for its
    /// first prefill chunk (see [`StepPlan::timed_out`]).
    QueueTimeout,
}

impl FinishReason {
    /// A short lowercase label (bounded, usable as a metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Eos => "eos",
            FinishReason::Abort => "abort",
            FinishReason::QueueTimeout => "queue_timeout",
        }
    }

    /// The `finished_reason` label of a finished request's metrics, as vLLM's
    /// `request_success_total` has it: `stop`, `length` or `abort`. The end-of-sequence token
    /// is a `stop`, as the API reports it (vLLM has no separate reason for it).
    pub fn metric_label(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop | FinishReason::Eos => "stop",
            FinishReason::Abort => "abort",
            FinishReason::QueueTimeout => "queue_timeout",
        }
    }
}

/// Life-cycle state: waiting → running → finished | aborted; running → preempted → running.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RequestState {
    /// Queued, never admitted.
    Waiting,
    /// Admitted: holds KV blocks and is scheduled in steps.
    Running,
    /// Preempted by recompute: back in the waiting queue, blocks freed, outputs kept.
    Preempted,
    /// Ended normally (or by [`crate::Scheduler::finish`]).
    Finished(FinishReason),
    /// Ended by [`crate::Scheduler::abort`].
    Aborted,
}

impl RequestState {
    /// Whether the request has ended (finished or aborted).
    pub fn is_terminal(self) -> bool {
        matches!(self, RequestState::Finished(_) | RequestState::Aborted)
    }
}

/// A service tier: SLO targets, fair-share weight and whether its work may be preempted.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TierSpec {
    /// Tier name as used in [`Request::tier`].
    pub name: String,
    /// Time-to-first-token target in milliseconds.
    pub ttft_ms: Option<f64>,
    /// Time-per-output-token target in milliseconds.
    pub tpot_ms: Option<f64>,
    /// Relative weight (> 0) for fair-share accounting.
    pub weight: f64,
    /// Whether running work of this tier may be preempted for other tiers.
    pub preemptible: bool,
    /// Longest a request of this tier may wait for its first admission, in milliseconds
    /// (1 to [`MAX_QUEUE_MS`]); `None`: [`SchedulerConfig::max_queue_ms`] applies.
    #[serde(default)]
    pub max_queue_ms: Option<u64>,
    /// Most of the KV cache the tier's running sequences may hold at once, as a fraction of
    /// [`SchedulerConfig::num_gpu_blocks`] in (0, 1] (rounded down to whole blocks, at least
    /// one); `None`: no bound. See `tier_quota.rs`.
    #[serde(default)]
    pub max_kv_fraction: Option<f64>,
}

impl TierSpec {
    /// A tier named `name` with no SLO targets, weight 1, not preemptible and no bounds.
    pub fn named(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            ttft_ms: None,
            tpot_ms: None,
            weight: 1.0,
            preemptible: false,
            max_queue_ms: None,
            max_kv_fraction: None,
        }
    }
}

/// Largest queue bound accepted (`max_queue_ms`): an hour.
pub const MAX_QUEUE_MS: u64 = 3_600_000;

/// Limits and sizes of one scheduler instance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulerConfig {
    /// Maximum number of running sequences (default 256).
    pub max_num_seqs: usize,
    /// Maximum tokens fed to the model in one step (default 8192).
    pub max_num_batched_tokens: usize,
    /// Tokens per KV block (default 16).
    pub block_size: usize,
    /// KV capacity in blocks.
    pub num_gpu_blocks: usize,
    /// Whether full blocks are shared through the prefix cache (default true).
    pub enable_prefix_caching: bool,
    /// Bound on prompt + output tokens; longer requests are rejected.
    pub max_model_len: usize,
    /// Service tiers known to this scheduler.
    pub tiers: Vec<TierSpec>,
    /// Most rows of logits the backend computes in one step, at least `max_num_seqs`. One row
    /// is kept for every sequence that may sample; the rest bounds the prefill chunks of
    /// requests that need logits for every prompt position ([`SamplingLimits::prompt_logits`])
    /// and the drafts.
    #[serde(default = "unbounded")]
    pub max_logit_rows: usize,
    /// Most distinct LoRA adapters among the running sequences at any time (default 4), so
    /// also in any step's batch; requests without an adapter never count. A waiting request
    /// whose adapter would exceed it is passed over until a slot frees up.
    #[serde(default = "default_max_loras")]
    pub max_loras: usize,
    /// Speculative decoding by prompt lookup; `None` (the default) feeds one token per
    /// decode. Drafts only take what a step leaves over: budget, logit rows and free blocks
    /// after every running sequence's next token and the admissions.
    #[serde(default)]
    pub speculative: Option<SpeculativeConfig>,
    /// The model's sliding window, when every layer attends over one: the blocks that left
    /// every window the next steps can read are freed while their sequence runs (`None`, the
    /// default: a sequence keeps every block until it ends).
    #[serde(default)]
    pub sliding_window: Option<SlidingWindow>,
    /// Longest a request may wait for its first admission, in milliseconds (1 to
    /// [`MAX_QUEUE_MS`]), for requests whose tier sets no [`TierSpec::max_queue_ms`] (and
    /// those of no known tier); `None` (the default): no bound. A request still waiting for
    /// its first prefill chunk past `arrival + bound` is ended with
    /// [`FinishReason::QueueTimeout`] when the next step is planned; one admitted once
    /// (preempted ones included) never is.
    #[serde(default)]
    pub max_queue_ms: Option<u64>,
    /// Blocks of the host KV tier (the server's `cache.kv_offloading_size`): full cached
    /// blocks evicted from the device cache are copied there ([`StepPlan::kv_offloads`]), and
    /// a prefix found there is copied back ([`StepPlan::kv_loads`]) instead of recomputed.
    /// 0 (the default): no host tier.
    #[serde(default)]
    pub num_host_blocks: usize,
    /// With a host tier: copy cached blocks there ahead of their eviction
    /// ([`StepPlan::kv_stores`]), once computed, in the order they are registered, so that the
    /// step that evicts one finds it in the tier and copies nothing. A backend makes these
    /// copies alongside the next step (the CUDA backend on a stream of its own) where
    /// eviction-time copies hold up the step that evicts. The server's
    /// `cache.kv_offloading_ahead` (default on).
    #[serde(default = "default_true")]
    pub kv_offload_ahead: bool,
}

fn default_true() -> bool {
    true
}

/// A sliding window over the KV cache: each query attends to its last `tokens` positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlidingWindow {
    /// Positions each query attends to: its own and the `tokens - 1` before it (at least 1).
    pub tokens: usize,
    /// Keys before a window's first position the backend may still read (it reads in
    /// chunks), so they are freed only this far behind the window: the backend's
    /// `window_read_slack`.
    pub read_slack: usize,
}

/// Positions a sequence may move back after its blocks behind the window were given back: a
/// failed step rolls its last position back, and up to two steps are in flight.
pub(crate) const WINDOW_MARGIN: usize = 4;

impl SlidingWindow {
    /// Tokens behind a sequence's next position whose blocks it keeps: its window, the keys
    /// the backend reads before it, and a margin of 4 (a failed step moves a sequence back a
    /// position, and steps run ahead of their outputs).
    pub fn tokens_kept(self) -> usize {
        self.tokens
            .saturating_add(self.read_slack)
            .saturating_add(WINDOW_MARGIN)
    }

    /// The most blocks of `block_size` tokens a running sequence holds at once when its steps
    /// feed at most `max_chunk` tokens: those of [`SlidingWindow::tokens_kept`] and of a
    /// chunk, a partial block at either end, and one not yet given back while its prefix
    /// hash waits for a token in flight.
    pub fn blocks_held(self, block_size: usize, max_chunk: usize) -> usize {
        self.tokens_kept()
            .saturating_add(max_chunk)
            .div_ceil(block_size.max(1))
            .saturating_add(3)
    }
}

fn unbounded() -> usize {
    usize::MAX
}

fn default_max_loras() -> usize {
    4
}

impl SchedulerConfig {
    /// Tokens of the longest sequence the KV cache holds alone ([`kv_capacity_tokens`]).
    pub fn kv_capacity_tokens(&self) -> usize {
        kv_capacity_tokens(
            self.num_gpu_blocks,
            self.block_size,
            self.max_num_batched_tokens,
            self.sliding_window,
        )
    }
}

/// Tokens of the longest sequence a KV cache of `num_blocks` blocks of `block_size` tokens
/// holds alone: its every block's or, under a sliding window whose sequences (fed chunks of at
/// most `max_chunk` tokens) hold at most as many blocks as the cache has
/// ([`SlidingWindow::blocks_held`]), any length (`usize::MAX`). The scheduler, `serve` and the
/// simulator bound requests and `max_model_len` by it.
pub fn kv_capacity_tokens(
    num_blocks: usize,
    block_size: usize,
    max_chunk: usize,
    window: Option<SlidingWindow>,
) -> usize {
    if window.is_some_and(|w| w.blocks_held(block_size, max_chunk) <= num_blocks) {
        return usize::MAX;
    }
    num_blocks.saturating_mul(block_size)
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            block_size: 16,
            num_gpu_blocks: 8192,
            enable_prefix_caching: true,
            max_model_len: 8192,
            tiers: Vec::new(),
            max_logit_rows: usize::MAX,
            max_loras: default_max_loras(),
            speculative: None,
            sliding_window: None,
            max_queue_ms: None,
            num_host_blocks: 0,
            kv_offload_ahead: true,
        }
    }
}

/// One sequence's work in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    /// The request.
    pub id: RequestId,
    /// Tokens already in KV before this step (including prefix-cache hits).
    pub num_computed_tokens: usize,
    /// Tokens fed this step (a prefill chunk, or 1 for a decode).
    pub num_new_tokens: usize,
    /// Index in the sequence's block table where `new_blocks` start; 0 when the whole
    /// table is sent (new admission or resumption after preemption).
    pub first_new_block: usize,
    /// Blocks appended to the sequence's block table since it was last scheduled (vLLM V1
    /// sends new block ids only). Keep a mirror per request: `table.truncate(first_new_block);
    /// table.extend(new_blocks)`; the result covers `num_computed_tokens + num_new_tokens`
    /// and equals [`crate::Scheduler::block_table`] but for its leading
    /// [`crate::RELEASED_BLOCK`] entries (a sliding window's blocks given back, whose old ids
    /// the mirror keeps: nothing reads them).
    pub new_blocks: Vec<BlockId>,
    /// Whether more than one uncomputed token remained before this step (prefill or recompute).
    pub is_prefill: bool,
    /// Whether this step's last position yields a sampled token.
    pub samples: bool,
    /// Draft tokens fed after the sequence's last token (counted in `num_new_tokens`): the
    /// backend checks them against its own samples and reports how many it kept
    /// ([`StepOutput::accepted`]). Empty unless speculative decoding proposed some.
    pub draft_tokens: Vec<TokenId>,
    /// The request's LoRA adapter ([`Request::lora_adapter`]), priced by the cost models.
    pub lora_adapter: Option<u32>,
}

/// A request ended by its queue bound (see [`StepPlan::timed_out`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueTimeout {
    /// The request.
    pub id: RequestId,
    /// How long it waited, from its arrival to the step that ended it.
    pub waited: Micros,
    /// The bound it waited past, in milliseconds.
    pub max_queue_ms: u64,
    /// Whether the bound was its tier's ([`TierSpec::max_queue_ms`]) rather than the
    /// scheduler's default ([`SchedulerConfig::max_queue_ms`]).
    pub tier_bound: bool,
    /// Its tier ([`Request::tier`]).
    pub tier: String,
}

/// One KV block copied between the device cache and the host tier
/// ([`SchedulerConfig::num_host_blocks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockCopy {
    /// The block of the device cache (`0..num_gpu_blocks`).
    pub device: BlockId,
    /// The block of the host tier (`0..num_host_blocks`).
    pub host: BlockId,
}

/// The work of one step, produced by [`crate::Scheduler::schedule`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Scheduled sequences: running ones first (in rank order when the step is constrained,
    /// queue order when everything fits), then admissions in rank order.
    pub seqs: Vec<ScheduledSeq>,
    /// Requests sent back to waiting this step (preemption by recompute).
    pub preempted: Vec<RequestId>,
    /// Requests ended before this step's planning because they waited past their queue bound
    /// without being admitted ([`FinishReason::QueueTimeout`]; their state is already freed).
    /// The caller tells their clients: no `SeqEvent` reports them.
    pub timed_out: Vec<QueueTimeout>,
    /// Sum of `num_new_tokens` over `seqs`.
    pub num_batched_tokens: usize,
    /// Device → host copies made before anything else of this step: full cached blocks this
    /// plan evicts from the device cache, kept in the host tier. Empty without a host tier.
    pub kv_offloads: Vec<BlockCopy>,
    /// Host → device copies made after the offloads and before this step's compute: cached
    /// blocks of a prefix found in the host tier, copied into the device blocks this plan
    /// gives them. Empty without a host tier.
    pub kv_loads: Vec<BlockCopy>,
    /// Device → host copies of cached blocks ahead of their eviction
    /// ([`SchedulerConfig::kv_offload_ahead`]): blocks registered in the prefix cache since
    /// earlier plans (requests may still hold them), computed by steps launched before this
    /// one, registered in the host tier now. No other copy of this plan names their device or host blocks, and this
    /// step writes none of them, so a backend may make them alongside this step; it must have
    /// made them before the next step's copies and compute. Empty without a host tier.
    pub kv_stores: Vec<BlockCopy>,
}

impl StepPlan {
    /// The step's work, aggregated over its sequences, as the simulator's cost models price
    /// it and `switchyard calibrate` fits them: every draft token is a row of logits beside
    /// the sampled position.
    pub fn shape(&self) -> StepShape {
        self.shape_within(None)
    }

    /// [`StepPlan::shape`] for a model attending over a sliding window: each new token's
    /// keys and the keys read are those of its window.
    pub fn shape_within(&self, window: Option<SlidingWindow>) -> StepShape {
        let mut shape = StepShape::default();
        // The distinct adapters seen, in order (at most `max_loras` of them, a handful).
        let mut adapters: Vec<u32> = Vec::new();
        for s in &self.seqs {
            shape.add_seq_within(
                s.num_computed_tokens as u64,
                s.num_new_tokens as u64,
                s.is_prefill,
                s.samples,
                window,
            );
            if s.samples {
                shape.num_sampled += s.draft_tokens.len() as u64;
            }
            if let Some(a) = s.lora_adapter {
                shape.lora_tokens += s.num_new_tokens as u64;
                if !adapters.contains(&a) {
                    adapters.push(a);
                }
            }
        }
        shape.lora_adapters = adapters.len() as u64;
        shape
    }
}

/// The work of one step, aggregated over its sequences: what a step's time depends on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepShape {
    /// Sequences in the step.
    pub num_seqs: u64,
    /// Tokens fed through the model (`T`).
    pub num_tokens: u64,
    /// Of which prompt (prefill) tokens.
    pub num_prefill_tokens: u64,
    /// Sequences decoding (one token, plus any drafts).
    pub num_decode_seqs: u64,
    /// Rows of logits sampled (`S`): a sampled position per sequence that samples, plus its
    /// drafts.
    pub num_sampled: u64,
    /// Σ over sequences of context + new tokens: KV read and written (`K`).
    pub kv_tokens: u64,
    /// Σ over new tokens of the keys each attends to, causal (`A`).
    pub attention_pairs: u64,
    /// Of the tokens fed, those of sequences with a LoRA adapter: each goes through the
    /// adapter's low-rank products too (0 in files written before adapters were priced).
    #[serde(default)]
    pub lora_tokens: u64,
    /// Distinct LoRA adapters in the step (their weights are read once each).
    #[serde(default)]
    pub lora_adapters: u64,
}

impl StepShape {
    /// Adds one sequence with `computed` tokens already in KV and `new` tokens this step.
    pub fn add_seq(&mut self, computed: u64, new: u64, is_prefill: bool, samples: bool) {
        self.add_seq_within(computed, new, is_prefill, samples, None);
    }

    /// [`StepShape::add_seq`] under a sliding window: new token `j` (1-based) attends to
    /// `min(computed + j, window)` keys, and the step reads the keys from its first token's
    /// window on.
    pub fn add_seq_within(
        &mut self,
        computed: u64,
        new: u64,
        is_prefill: bool,
        samples: bool,
        window: Option<SlidingWindow>,
    ) {
        self.num_seqs += 1;
        self.num_tokens += new;
        if is_prefill {
            self.num_prefill_tokens += new;
        } else {
            self.num_decode_seqs += 1;
        }
        self.num_sampled += u64::from(samples);
        let Some(w) = window else {
            self.kv_tokens += computed + new;
            // New token j (1-based) attends to computed + j keys.
            self.attention_pairs += new * computed + new * (new + 1) / 2;
            return;
        };
        let w = w.tokens.max(1) as u64;
        // Keys before the first new token's window are not read.
        self.kv_tokens += computed + new - (computed + 1).saturating_sub(w);
        // Tokens j = 1..=new attend to computed + j keys until that reaches w: the first
        // `ramp` of them (computed + j < w), then w each.
        let ramp = w.saturating_sub(computed + 1).min(new);
        self.attention_pairs += ramp * computed + ramp * (ramp + 1) / 2 + (new - ramp) * w;
    }
}

/// A sampled token for one scheduled sequence with `samples == true`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct StepOutput {
    /// The request.
    pub id: RequestId,
    /// The sampled token: the last of the step's outputs for the sequence.
    pub token: TokenId,
    /// How many of the entry's draft tokens were accepted: the outputs are
    /// `draft_tokens[..accepted]` followed by `token` (0 without drafts).
    pub accepted: u32,
}

impl StepOutput {
    /// One sampled token, no drafts.
    pub fn new(id: RequestId, token: TokenId) -> Self {
        Self {
            id,
            token,
            accepted: 0,
        }
    }
}

/// What happened to a sequence while applying a step's outputs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SeqEvent {
    /// The first output token was produced (TTFT); a `Token` event follows.
    FirstToken {
        /// The request.
        id: RequestId,
        /// When.
        at: Timestamp,
        /// Prompt tokens whose KV came from the prefix cache when the request was first
        /// admitted (whole blocks, never the last prompt token, which is always computed so
        /// that a token can be sampled; 0 without prefix caching). As vLLM's
        /// `num_cached_tokens`, a recompute after a preemption does not change it.
        cached_prompt_tokens: u32,
    },
    /// An output token was produced.
    Token {
        /// The request.
        id: RequestId,
        /// The token.
        token: TokenId,
        /// When.
        at: Timestamp,
    },
    /// The sequence ended; its blocks are already freed.
    Finished {
        /// The request.
        id: RequestId,
        /// Why.
        reason: FinishReason,
        /// When.
        at: Timestamp,
    },
}

/// A snapshot of the scheduler's counters (vLLM's metric meanings).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SchedulerStats {
    /// Sequences holding KV blocks.
    pub num_running: usize,
    /// Sequences waiting for admission (new and preempted).
    pub num_waiting: usize,
    /// Fraction of blocks not free (0..=1); cached free blocks count as free.
    pub kv_usage: f64,
    /// Free blocks (including evictable cached ones).
    pub num_free_blocks: usize,
    /// Tokens looked up in the prefix cache at admission.
    pub prefix_queries: u64,
    /// Tokens found in the prefix cache at admission.
    pub prefix_hits: u64,
    /// Preemptions since start.
    pub num_preemptions: u64,
    /// Distinct LoRA adapters among the running sequences (at most
    /// [`SchedulerConfig::max_loras`]).
    pub num_running_adapters: usize,
    /// Waiting requests (new and preempted) that name a LoRA adapter.
    pub num_waiting_adapter_requests: usize,
    /// Block-accounting calls that failed since start: a core or caller bug, never user
    /// input (a plan or commit that does not match the ledger, a launched step resolved out
    /// of order). The core absorbs each and goes on; [`crate::Scheduler::check_invariants`]
    /// fails while it is not 0, and the engine logs and counts its growth.
    #[serde(default)]
    pub pool_errors: u64,
    /// Blocks of the host KV tier holding a cached block (0 without a host tier,
    /// [`SchedulerConfig::num_host_blocks`]).
    #[serde(default)]
    pub num_host_blocks_used: usize,
    /// Blocks copied from the device cache to the host tier since start
    /// ([`StepPlan::kv_offloads`]).
    #[serde(default)]
    pub num_kv_offloaded_blocks: u64,
    /// Blocks copied from the host tier back to the device since start
    /// ([`StepPlan::kv_loads`]).
    #[serde(default)]
    pub num_kv_loaded_blocks: u64,
    /// Prompt tokens served from the host tier at admission since start (counted in
    /// `prefix_hits` too). A block loaded once for several requests of one plan counts once,
    /// for the request whose admission loads it; the others' are device hits.
    #[serde(default)]
    pub num_host_hit_tokens: u64,
    /// Of `num_kv_offloaded_blocks`, those copied ahead of their eviction
    /// ([`StepPlan::kv_stores`]).
    #[serde(default)]
    pub num_kv_stored_ahead_blocks: u64,
}

/// The scheduling priority of a request (lower = more urgent) from its own `priority` field and
/// its tier's priority (`tiers.<name>.priority`, `None` when the request has no configured
/// tier). A tier's priority is the most urgent its requests may be: a request may ask to be
/// served later than its tier (a larger value) but not sooner, so a client of a lower tier
/// cannot jump ahead of a higher tier's traffic by sending `"priority": -100`. Without a tier
/// (an open server, or a key without one) the request's own value stands, as in vLLM.
pub fn request_priority(own: Option<i32>, tier: Option<i32>) -> i32 {
    match (own, tier) {
        (Some(p), Some(t)) => p.max(t),
        (Some(p), None) => p,
        (None, Some(t)) => t,
        (None, None) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tier_bounds_how_urgent_its_requests_may_ask_to_be() {
        assert_eq!(request_priority(None, None), 0);
        assert_eq!(request_priority(Some(-100), None), -100);
        assert_eq!(request_priority(None, Some(2)), 2);
        // Sooner than the tier: held at the tier's; later: as asked.
        assert_eq!(request_priority(Some(-100), Some(2)), 2);
        assert_eq!(request_priority(Some(5), Some(2)), 5);
        assert_eq!(request_priority(Some(i32::MIN), Some(i32::MAX)), i32::MAX);
    }

    fn entry(id: u64, computed: usize, new: usize, adapter: Option<u32>) -> ScheduledSeq {
        ScheduledSeq {
            id: RequestId(id),
            num_computed_tokens: computed,
            num_new_tokens: new,
            first_new_block: 0,
            new_blocks: Vec::new(),
            is_prefill: new > 1,
            samples: true,
            draft_tokens: Vec::new(),
            lora_adapter: adapter,
        }
    }

    #[test]
    fn a_steps_shape_counts_the_tokens_and_distinct_adapters_of_adapted_sequences() {
        let plan = StepPlan {
            seqs: vec![
                entry(1, 0, 64, Some(3)),
                entry(2, 100, 1, None),
                entry(3, 40, 1, Some(7)),
                entry(4, 0, 16, Some(3)),
                entry(5, 0, 32, None),
            ],
            num_batched_tokens: 114,
            ..StepPlan::default()
        };
        let s = plan.shape();
        assert_eq!((s.num_seqs, s.num_tokens), (5, 114));
        // 64 + 1 + 16 tokens of adapted sequences, two distinct adapters (3 and 7).
        assert_eq!((s.lora_tokens, s.lora_adapters), (81, 2));
        // The rest of the shape is what it is without adapters.
        let mut base = plan.clone();
        base.seqs.iter_mut().for_each(|e| e.lora_adapter = None);
        let b = base.shape();
        assert_eq!((b.lora_tokens, b.lora_adapters), (0, 0));
        assert_eq!(
            StepShape {
                lora_tokens: 0,
                lora_adapters: 0,
                ..s
            },
            b
        );
        assert_eq!(StepPlan::default().shape(), StepShape::default());
    }

    #[test]
    fn step_shapes_written_before_adapters_were_counted_still_load() {
        let old = "{num_seqs: 1, num_tokens: 16, num_prefill_tokens: 16, num_decode_seqs: 0, \
                   num_sampled: 1, kv_tokens: 16, attention_pairs: 136}";
        let s: StepShape = serde_yaml::from_str(old).unwrap();
        assert_eq!((s.num_tokens, s.lora_tokens, s.lora_adapters), (16, 0, 0));
        let new: StepShape = serde_yaml::from_str(&serde_yaml::to_string(&s).unwrap()).unwrap();
        assert_eq!(new, s);
    }
}
