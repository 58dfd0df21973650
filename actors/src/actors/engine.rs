//! The [`Engine`] handle: a `Clone` value holding only actor addresses. Front ends submit
//! requests with a sink for the output; everything else happens in the actors.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use actix::{Actor, Addr, SyncArbiter};
use switchyard_gpu::backend::{Backend, SamplingParams};
use switchyard_gpu::model::content_escape::{ContentEscaper, NoEscaper};
use switchyard_gpu::model::{ChatEnding, ChatMessage, ChatTemplate, Tokenizer};
use switchyard_gpu::{Constraint, GpuError};
use switchyard_policies::{
    FinishReason, Policy, Request, RequestId, SamplingLimits, SchedulerConfig, SchedulerStats,
    SloTargets,
};

use super::admission::{Admission, Demand, InFlight};
use super::allocator::KvAllocatorActor;
use super::context_length::SequenceLimit;
use super::detokenizer::{
    DetokenizerActor, EndedEarly, FailAll, KeptSpecial, PendingPrompt, Register, SetScheduler,
    TextOptions,
};
use super::executor::{BackendReleased, ExecutorActor};
use super::lora::{
    AdapterInfo, Charge, LoraError, LoraHandle, LoraManager, LoraManagerConfig,
    Register as RegisterAdapter, Replace as ReplaceAdapter, Resolved as ResolvedAdapter, SetPinned,
    Unregister,
};
use super::scheduler::{GetStats, SchedulerActor, SetSpeculative, SetTiers, SwapPolicy};
use super::step_watch::{RunningCall, StepStall, StepWatch};
use super::tokenizer::{Constrain, Decode, Encode, EncodeBadWords, TokenizerActor};
use crate::core::{AsyncScheduling, EngineCoreConfig, StepCore, SubmitOptions};
use crate::metric_names as names;
use crate::structured::{LazyGrammarCompiler, StructuredOutput};
use crate::token_filters::{choice_constraints, TokenFilters};
use crate::EngineError;

/// What the engine needs beyond the model.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Limits and KV geometry for the scheduling core.
    pub scheduler: SchedulerConfig,
    /// Key of the prefix-cache block hash (random per process).
    pub hash_key: [u64; 2],
    /// Threads in the tokenizer pool.
    pub tokenizer_threads: usize,
    /// Requests in flight at once, counted per choice (prompts × `n`), before new ones are
    /// refused as overloaded ([`super::admission`]).
    pub max_pending_requests: usize,
    /// Per-tier bounds (`tiers.<name>.max_pending_requests`), counted as the server's: a
    /// request of a tier listed here is refused as overloaded while its tier has not room for
    /// its choices, even if the server has ([`super::admission`]).
    pub tier_max_pending: Vec<(String, usize)>,
    /// Per-tier bounds on each tenant's requests in flight
    /// (`tiers.<name>.max_pending_per_tenant`), counted as the server's: a tenant of a tier
    /// listed here is refused (429) while it holds that many ([`super::admission`]).
    pub tier_max_pending_per_tenant: Vec<(String, usize)>,
    /// The tenants the configuration names (its API keys'): only these label the usage
    /// counters ([`names::LABEL_TENANT`]); a request of any other tenant counts without one.
    pub metrics_tenants: std::collections::BTreeSet<String>,
    /// Plan and submit each step while the previous one runs.
    pub async_scheduling: AsyncScheduling,
    /// LoRA adapters: `None` when disabled.
    pub lora: Option<LoraManagerConfig>,
    /// The model's vocabulary (rows of its output; at least the tokenizer's): token ids a
    /// request names (`logit_bias`, `stop_token_ids`) are below it, as the backend checks.
    pub vocab_size: usize,
    /// Cached prefix blocks are shared only among a tenant's requests (each tenant's
    /// requests hash their blocks with a salt of their own).
    pub prefix_sharing_by_tenant: bool,
    /// The added tokens' text written in chat messages is encoded as text, not as the tokens
    /// (`model.message_special_tokens: text`; see `switchyard_gpu::model::content_escape`).
    pub message_tokens_as_text: bool,
    /// How long one backend call may run before the engine counts as stalled
    /// (`scheduler.step_timeout_s`; `None`: no limit). See [`super::step_watch`].
    pub step_timeout: Option<std::time::Duration>,
}

/// A prompt as the client gave it.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptSource {
    /// Text, tokenized with the model's special tokens.
    Text(String),
    /// Token ids, used as they are.
    Tokens(Vec<u32>),
    /// Chat messages, rendered by the chat template with `template_kwargs` added to its
    /// variables.
    Chat {
        /// The conversation.
        messages: Vec<ChatMessage>,
        /// More variables for the template.
        template_kwargs: serde_json::Map<String, serde_json::Value>,
        /// The names of `template_kwargs` the client set (the HTTP API's
        /// `chat_template_kwargs`; the server sets `tools`): a rendering that fails with them
        /// and not without them names that field.
        client_kwargs: Vec<String>,
        /// How the rendering ends: a generation prompt (the default), the last message
        /// closed, or the last message left open for the model to continue.
        ending: ChatEnding,
    },
}

/// One client request.
#[derive(Debug, Clone)]
pub struct RequestOptions {
    /// The prompt.
    pub prompt: PromptSource,
    /// Sampler settings; with a seed, choice `i` uses `seed + i`.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// vLLM's `include_stop_str_in_output`: a matched stop string, or the text of the stop
    /// token that ended a choice, stays in its text.
    pub include_stop_str_in_output: bool,
    /// vLLM's `skip_special_tokens`: special tokens' text is left out (the usual).
    pub skip_special_tokens: bool,
    /// Special tokens whose text is kept though special tokens are skipped (the tool-call
    /// markers of a request with tools, where they are special tokens).
    pub keep_special_tokens: KeptSpecial,
    /// Number of choices.
    pub n: u32,
    /// Completion limit; `None` means up to the context window (or `default_max_tokens`).
    pub max_tokens: Option<u32>,
    /// Without `max_tokens`: at most this many, or the room the prompt leaves if less.
    pub default_max_tokens: Option<u32>,
    /// Lower is more urgent.
    pub priority: i32,
    /// Tier name.
    pub tier: String,
    /// Tenant name.
    pub tenant: String,
    /// Report this many top alternatives for every prompt position (completions' `echo` with
    /// `logprobs`); the request then skips the prefix cache, whose tokens are never recomputed.
    pub prompt_logprobs: Option<u32>,
    /// The name of the LoRA adapter to run the request with; `None` for the base model.
    pub lora: Option<String>,
    /// Structured output: what the generated text must follow; `None` for free text.
    pub structured: Option<StructuredOutput>,
    /// vLLM's `allowed_token_ids` and `bad_words`, sampled as constraints (with the grammar,
    /// when there is one); refused with beam search.
    pub filters: TokenFilters,
    /// vLLM's `cache_salt`: requests share cached prefix blocks only with requests of the same
    /// salt (and, with [`EngineConfig::prefix_sharing_by_tenant`], the same tenant).
    pub cache_salt: Option<String>,
    /// Compute the prompt's embedding instead of generating: the prompt runs as a one-token
    /// request whose token is not output; the one delta, finished with 0 tokens, carries
    /// [`ChoiceDelta::embedding`]. Needs `n` 1.
    pub embed: bool,
    /// Beam search instead of sampling ([`BeamOptions`]): `n` is the beam width, and each
    /// choice's one delta, sent when the search ends, holds a whole answer, best first.
    pub beam: Option<BeamOptions>,
}

/// vLLM's beam search settings (`use_beam_search`, `length_penalty`). The search keeps `n`
/// beams (at most [`crate::MAX_BEAM_WIDTH`]) and ranks them by their cumulative logprob
/// under the model over `(prompt + generated) ^ length_penalty`; sampling settings other
/// than the end tokens (`ignore_eos`, `stop_token_ids`, `min_tokens`) and `logprobs` do not
/// apply, and stop strings, structured output, prompt logprobs and embeddings are refused.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamOptions {
    /// The exponent of the length a beam's cumulative logprob is divided by (vLLM's default
    /// 1.0; finite).
    pub length_penalty: f32,
}

/// New output for one choice.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChoiceDelta {
    /// The choice.
    pub index: u32,
    /// Text released since the previous delta.
    pub text: String,
    /// Tokens sampled since the previous delta.
    pub token_ids: Vec<u32>,
    /// One entry per token, when logprobs were asked.
    pub logprobs: Vec<TokenLogprobs>,
    /// Set on the last delta: why the choice ended and how many tokens it generated.
    pub finish: Option<(FinishReason, u32)>,
    /// Prompt tokens whose KV came from the prefix cache when the choice was first admitted
    /// (vLLM's `num_cached_tokens`: whole blocks, never the last prompt token; a recompute
    /// after a preemption does not change it). Known from the choice's first token on, so
    /// the last delta always carries it.
    pub cached_prompt_tokens: u32,
    /// An embedding request's vector, on its one (last) delta: the final hidden state at the
    /// prompt's last token, not normalized ([`RequestOptions::embed`]).
    pub embedding: Option<Vec<f32>>,
}

/// A generated token with its logprob and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token.
    pub token: u32,
    /// Its logprob under the model.
    pub logprob: Option<f32>,
    /// Its rank at its position (1 = the most likely, vLLM's count): prompt tokens only.
    pub rank: Option<u32>,
    /// The most likely tokens at its position, best first.
    pub top: Vec<(u32, f32)>,
}

/// What a request's sink receives: one `Prompt`, then deltas, or one `Error`.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineOutput {
    /// The request was accepted.
    Prompt {
        /// Prompt length in tokens.
        prompt_tokens: u32,
        /// The chat prompt ends inside a `<think>` block its template opened.
        opens_thinking: bool,
        /// One entry per prompt token when prompt logprobs were asked (the first token, which
        /// has no context, has no logprob).
        prompt_logprobs: Option<Vec<TokenLogprobs>>,
    },
    /// New output for one choice.
    Delta(ChoiceDelta),
    /// The request failed; nothing follows.
    Error(SubmitError),
}

/// Where a request's output goes. Dropping the sink closes the client's stream.
pub trait OutputSink: Send + 'static {
    /// Delivers an output; `false` means the client is gone and the request must be aborted.
    fn send(&mut self, output: EngineOutput) -> bool;
    /// Whether the client is gone.
    fn is_closed(&self) -> bool;
    /// Whether the next output sent would reach the client: false once it is gone, and also
    /// when the sink would cut it off instead (a client reading too slowly). The detokenizer
    /// counts a choice's success only when its last delta will be delivered.
    fn will_deliver(&self) -> bool {
        !self.is_closed()
    }
    /// Why a closed sink was closed when not because the client left: another part of the
    /// same client request failed with this kind, or the sink cut its client off (its choices
    /// then count as failed with it, not as aborted). `None` by default.
    fn abandoned_for(&self) -> Option<SubmitErrorKind> {
        None
    }
}

/// Classes of request failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitErrorKind {
    /// Bad input for this model.
    InvalidRequest,
    /// The request names a model (LoRA adapter) the server does not have.
    UnknownModel,
    /// Prompt plus completion exceed the context window.
    ContextLengthExceeded,
    /// Too many requests in flight: the request fits under the bounds on requests in flight,
    /// not under what is free now (a 503 to retry).
    Overloaded,
    /// Its tenant has as many requests in flight as its tier lets one tenant have
    /// (`tiers.<name>.max_pending_per_tenant`): a 429 to retry when one of them ends.
    TenantBusy,
    /// More choices (prompts × `n`) than a bound on requests in flight ever admits: the
    /// request can never be admitted under it (a 400 naming the bound, not a retryable 503).
    TooManyChoices,
    /// The request waited in the scheduler's queue past its bound (`tiers.<name>.max_queue_ms`
    /// or `scheduler.max_queue_ms`) without being admitted, and was ended there (a 503 to
    /// retry later: load shedding).
    QueueTimeout,
    /// The engine is shutting down.
    Unavailable,
    /// The structured-output grammar of a choice failed while generating, other than past
    /// llguidance's parser limits (which is the request's error, [`Self::InvalidRequest`]):
    /// its output cannot complete it (a server error, counted under its own `reason`; the
    /// request's other choices, and its other prompts, end with it).
    StructuredOutput,
    /// A backend failure.
    Internal,
}

/// Why a request failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct SubmitError {
    /// The class.
    pub kind: SubmitErrorKind,
    /// For the client.
    pub message: String,
    /// The request field at fault, when one is (OpenAI's `param`).
    pub param: Option<&'static str>,
}

impl SubmitError {
    pub(crate) fn new(kind: SubmitErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
        }
    }

    /// Names the request field at fault.
    #[must_use]
    pub(crate) fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }
}

/// Which per-request metrics a request admitted through [`Engine::admit`] records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Metering {
    /// A client's request: all of them.
    Request,
    /// A step of a beam search: none (the search counts the client's request once, each beam
    /// a choice), but the first step's queue time, which is the client request's own, once per
    /// beam.
    BeamStep {
        /// How many times its queue time counts: the beams for the first step, else 0.
        queue_times: u32,
    },
}

impl Metering {
    /// Whether the detokenizer and the admission record no per-request metrics.
    fn quiet(self) -> bool {
        self != Self::Request
    }

    /// How many times its queue time counts in `request_queue_time_seconds`.
    fn queue_times(self) -> u32 {
        match self {
            Self::Request => 1,
            Self::BeamStep { queue_times } => queue_times,
        }
    }

    /// Whether its tier's queue bound applies: to a client's request and to a beam search's
    /// first step (the client's request waiting: the step whose queue time counts), not to
    /// the later steps, work of a request admitted once.
    fn queue_bound(self) -> bool {
        self.queue_times() > 0
    }
}

/// What a request's submission resolved before admission: its prompt tokens, its adapter
/// (prefix-cache id, weights and the request's use of them) and one structured-output
/// constraint per choice.
struct Resolved {
    prompt: Vec<u32>,
    opens_thinking: bool,
    adapter: Option<ResolvedAdapter>,
    constraints: Vec<Constraint>,
    /// When the prompt was encoded (the request's queue time runs from then).
    encoded: Instant,
}

/// The engine handle.
#[derive(Clone)]
pub struct Engine {
    lora: Option<LoraHandle>,
    scheduler: Addr<SchedulerActor>,
    detokenizer: Addr<DetokenizerActor>,
    tokenizers: Addr<TokenizerActor>,
    next_id: Arc<AtomicU64>,
    /// The server's and the tiers' bounds on requests in flight.
    admission: Arc<Admission>,
    /// The tenants whose names label metrics ([`EngineConfig::metrics_tenants`], replaced by
    /// [`Engine::set_metrics_tenants`]).
    metrics_tenants: Arc<parking_lot::RwLock<std::collections::BTreeSet<String>>>,
    /// The tiers in force: their SLO targets, given to their requests at submission, their
    /// KV bounds and the tiers that label metrics (the scheduler's at the start, replaced by
    /// [`Engine::set_tiers`]).
    tiers: Arc<parking_lot::RwLock<Vec<switchyard_policies::TierSpec>>>,
    config: Arc<EngineConfig>,
    /// Token ids a request may name are below this ([`EngineConfig::vocab_size`], or the
    /// tokenizer's vocabulary when larger).
    vocab: usize,
    /// Hashes tenants and salts into prefix-cache salts (keys random per process).
    salts: std::collections::hash_map::RandomState,
    /// False once the executor retired its backend (a panic it does not recover from).
    backend_alive: Arc<AtomicBool>,
    /// Set once the executor's thread dropped the backend ([`Engine::backend_released`]).
    backend_released: BackendReleased,
    /// The executor's backend call under way and the limit on it ([`Engine::stall`]).
    step_watch: StepWatch,
    /// Set by [`Engine::fail_in_flight`]: no request is admitted any more.
    closed: Arc<AtomicBool>,
    /// The tokenizer, for the text of beam search answers (made once the search ends).
    tokenizer: Arc<Tokenizer>,
}

impl Engine {
    /// Starts the actors; must run inside an actix `System`.
    pub fn start(
        config: EngineConfig,
        backend: Box<dyn Backend>,
        tokenizer: Arc<Tokenizer>,
        template: Option<Arc<ChatTemplate>>,
        policy: Box<dyn Policy>,
    ) -> Result<Self, EngineError> {
        let mut core = StepCore::new(
            EngineCoreConfig {
                scheduler: config.scheduler.clone(),
                hash_key: config.hash_key,
            },
            policy,
        )?;
        core.set_draft_verifier(backend.draft_verifier(), backend.name())?;
        let lora = match &config.lora {
            Some(lc) => {
                let slots = backend.lora_slots();
                if slots == 0 {
                    return Err(EngineError::Backend(GpuError::InvalidConfig(format!(
                        "LoRA adapters are enabled but the {} backend does not run them",
                        backend.name()
                    ))));
                }
                if config.scheduler.max_loras > slots {
                    return Err(EngineError::Backend(GpuError::InvalidConfig(format!(
                        "lora.max_loras is {} but the {} backend holds at most {slots} adapters per step",
                        config.scheduler.max_loras,
                        backend.name()
                    ))));
                }
                Some(LoraHandle::start(lc.clone()))
            }
            None => None,
        };
        let async_scheduling = config.async_scheduling.enabled_for(backend.as_ref());
        tracing::info!(async_scheduling, "engine steps");
        // The last step that can fail: once the executor's thread holds the backend, an error
        // returned here would leave it to drop the backend unwatched (no `BackendReleased`
        // reaches the caller), possibly as the process ends.
        let pool = core.detach_allocator().ok_or_else(|| {
            EngineError::Scheduler(switchyard_policies::SchedulerError::Invariant(
                "the block pool is already detached".into(),
            ))
        })?;
        let slot = parking_slot(backend);
        let backend_alive = Arc::new(AtomicBool::new(true));
        let alive = backend_alive.clone();
        let step_watch = StepWatch::new(config.step_timeout);
        step_watch.start_reporter();
        let backend_released = BackendReleased::watching(&step_watch);
        let released = backend_released.clone();
        let watch = step_watch.clone();
        let executor = SyncArbiter::start(1, move || {
            ExecutorActor::new(slot.lock().unwrap_or_else(|p| p.into_inner()).take())
                .reporting_to(alive.clone())
                .releasing(released.clone())
                .watched_by(watch.clone())
        });
        let vocab = tokenizer.vocab_size().max(config.vocab_size);
        let tok = tokenizer.clone();
        let tokenizer_for_text = tokenizer.clone();
        let grammars = LazyGrammarCompiler::default();
        let max_model_len = config.scheduler.max_model_len;
        let escaper = match &template {
            Some(t) if config.message_tokens_as_text => match ContentEscaper::new(&tok, t.source())
            {
                Ok(e) => {
                    tracing::info!(
                        tokens = e.len(),
                        "added tokens written in chat messages are encoded as text"
                    );
                    Some(Arc::new(e))
                }
                Err(why @ NoEscaper::NothingToEscape) => {
                    tracing::info!(%why, "chat messages have no control tokens to encode as text");
                    None
                }
                Err(why) => {
                    tracing::warn!(
                        %why,
                        "model.message_special_tokens is text, but control tokens written in chat \
                         messages are encoded as the tokens they name"
                    );
                    None
                }
            },
            _ => None,
        };
        let tokenizers = SyncArbiter::start(config.tokenizer_threads.max(1), move || {
            TokenizerActor::new(
                tok.clone(),
                template.clone(),
                grammars.clone(),
                max_model_len,
            )
            .escaping(escaper.clone())
        });
        // The detokenizer gets a thread of its own so that text work and client sends never
        // delay the scheduler's next step.
        let detok_thread = actix::Arbiter::new();
        let detokenizer = DetokenizerActor::start_in_arbiter(&detok_thread.handle(), move |_| {
            DetokenizerActor::new(tokenizer)
        });
        // The allocator shares the scheduler's thread: a commit is a mailbox hop, not a
        // thread hand-off, and only scheduler messages reach it.
        let allocator = KvAllocatorActor::new(pool).start();
        let scheduler = SchedulerActor::new(core, allocator, executor, detokenizer.clone())
            .with_async_scheduling(async_scheduling)
            .start();
        detokenizer.do_send(SetScheduler(scheduler.clone()));
        Ok(Self {
            lora,
            scheduler,
            detokenizer,
            tokenizers,
            next_id: Arc::new(AtomicU64::new(1)),
            admission: Arc::new(
                Admission::new(
                    config.max_pending_requests,
                    &config.tier_max_pending,
                    &config.tier_max_pending_per_tenant,
                )
                .counting(config.scheduler.tiers.iter().map(|t| t.name.clone())),
            ),
            metrics_tenants: Arc::new(parking_lot::RwLock::new(config.metrics_tenants.clone())),
            tiers: Arc::new(parking_lot::RwLock::new(config.scheduler.tiers.clone())),
            config: Arc::new(config),
            vocab,
            salts: std::collections::hash_map::RandomState::new(),
            backend_alive,
            backend_released,
            step_watch,
            closed: Arc::new(AtomicBool::new(false)),
            tokenizer: tokenizer_for_text,
        })
    }

    /// Puts new bounds on requests in flight in force (a reload of the configuration): the
    /// server's `max_pending_requests`, and each configured tier's bound (`tiers`) and its
    /// tenants' (`per_tenant`), none for a tier left out of a list. Requests in flight keep
    /// their seats (every configured tier's are counted from the start, bounded or not), so a
    /// bound cut below what is in flight refuses new requests until enough end. Returns the
    /// bounds that changed, as `tiers.batch.max_pending_requests: 16 -> 32`; a tier not in
    /// force ([`Engine::set_tiers`]) is refused, changing nothing.
    pub fn set_admission_limits(
        &self,
        max_pending_requests: usize,
        tiers: &[(String, usize)],
        per_tenant: &[(String, usize)],
    ) -> Result<Vec<String>, EngineError> {
        self.admission
            .set_limits(max_pending_requests, tiers, per_tenant)
            .map_err(EngineError::UnknownTiers)
    }

    /// Replaces the tenants whose names label the request metrics (a reload of the API keys):
    /// requests submitted from now on are labelled by the new set (any other tenant by none).
    pub fn set_metrics_tenants(&self, tenants: std::collections::BTreeSet<String>) {
        *self.metrics_tenants.write() = tenants;
    }

    /// Ends every request in flight with an `Unavailable` error carrying `message` (streams
    /// get it as their last event, other requests as their answer) and admits no request from
    /// now on: the end of a drain that timed out.
    pub fn fail_in_flight(&self, message: impl Into<String>) {
        self.closed.store(true, Ordering::Release);
        self.detokenizer.do_send(FailAll(SubmitError::new(
            SubmitErrorKind::Unavailable,
            message,
        )));
    }

    /// Whether the engine can still serve: false once its backend was retired after a panic
    /// it does not recover from (every step then fails; the process should be restarted).
    pub fn is_alive(&self) -> bool {
        self.backend_alive.load(Ordering::Acquire)
    }

    /// The backend call under way, if one has run past the limit (`scheduler.step_timeout_s`):
    /// the engine is stalled (a device or driver hang, or a deadlock in the backend, or a
    /// step that is just very slow). It stops being one when the call returns (or the limit
    /// is raised); nothing is cancelled meanwhile.
    pub fn stall(&self) -> Option<StepStall> {
        self.step_watch.stall()
    }

    /// The backend call under way and how long it has run; `None` while the executor waits
    /// for work.
    pub fn backend_call(&self) -> Option<RunningCall> {
        self.step_watch.running()
    }

    /// The limit on one backend call in force (`None`: none).
    pub fn step_timeout(&self) -> Option<std::time::Duration> {
        self.step_watch.limit()
    }

    /// Puts a new limit on one backend call in force (a reload of `scheduler.step_timeout_s`;
    /// `None`: none); it applies to the call under way too.
    pub fn set_step_timeout(&self, limit: Option<std::time::Duration>) {
        self.step_watch.set_limit(limit);
    }

    /// Set once the executor's thread has dropped the backend, which it does once the
    /// engine's actors are gone (the actix system that runs them dropped). A command that
    /// started the engine waits for it before the process ends (see [`BackendReleased`]).
    pub fn backend_released(&self) -> BackendReleased {
        self.backend_released.clone()
    }

    /// The context window in tokens.
    pub fn max_model_len(&self) -> usize {
        self.config.scheduler.max_model_len
    }

    /// The longest sequence the KV cache holds ([`SchedulerConfig::kv_capacity_tokens`]).
    pub fn kv_capacity_tokens(&self) -> usize {
        self.config.scheduler.kv_capacity_tokens()
    }

    /// The longest sequence the KV quota of `tier` holds (`tiers.<name>.max_kv_fraction`, as
    /// the scheduler bounds it); `usize::MAX` for a tier without one.
    fn tier_kv_capacity_tokens(&self, tier: &str) -> usize {
        let c = &self.config.scheduler;
        self.tiers
            .read()
            .iter()
            .find(|t| t.name == tier)
            .and_then(|t| t.max_kv_fraction)
            .map_or(usize::MAX, |f| {
                switchyard_policies::kv_capacity_tokens(
                    switchyard_policies::tier_kv_blocks(f, c.num_gpu_blocks),
                    c.block_size,
                    c.max_num_batched_tokens,
                    c.sliding_window,
                )
            })
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> usize {
        self.admission.in_flight()
    }

    /// Queues a request. Its outputs, or an error, arrive at `sink`; dropping the receiving
    /// side of the sink aborts the request.
    pub fn submit(&self, options: RequestOptions, sink: Box<dyn OutputSink>) {
        self.submit_all(vec![(options, sink)]);
    }

    /// Queues the prompts of one client request (one tier), each with its sink, as
    /// [`Engine::submit`] does one. They are admitted together or not at all
    /// ([`super::admission`]): each choice of each prompt takes a seat under the server's
    /// and the tier's bounds on requests in flight, and when the seats of all of them are not
    /// free every sink gets the refusal and none is queued.
    pub fn submit_all(&self, prompts: Vec<(RequestOptions, Box<dyn OutputSink>)>) {
        let Some((first, _)) = prompts.first() else {
            return;
        };
        debug_assert!(prompts.iter().all(|(o, _)| o.tier == first.tier));
        let demand = Demand {
            prompts: prompts.len(),
            choices: prompts.iter().map(|(o, _)| o.n.max(1) as usize).sum(),
        };
        debug_assert!(prompts.iter().all(|(o, _)| o.tenant == first.tenant));
        let mut seats = match self.admission.admit(&first.tier, &first.tenant, demand) {
            Ok(seats) => seats,
            Err(e) => {
                // An embeddings request's prompts are its `input` (its `n` is always 1).
                let e = match e.kind {
                    SubmitErrorKind::TooManyChoices if first.embed => e.with_param("input"),
                    _ => e,
                };
                self.refuse_all(prompts, e);
                return;
            }
        };
        for (options, sink) in prompts {
            let guard = seats.split_off(options.n.max(1) as usize);
            self.submit_admitted(options, sink, guard);
        }
    }

    /// Answers every prompt of a request refused at admission with `error`; one refused as
    /// overloaded counts in `request_failed_total{reason="overloaded"}` once per choice of
    /// all its prompts (as after queueing).
    fn refuse_all(&self, prompts: Vec<(RequestOptions, Box<dyn OutputSink>)>, error: SubmitError) {
        for (options, mut sink) in prompts {
            self.refuse(&options, sink.as_mut(), error.clone());
        }
    }

    /// Tokenizes, resolves and queues a request admitted with `guard`'s seats.
    fn submit_admitted(
        &self,
        options: RequestOptions,
        mut sink: Box<dyn OutputSink>,
        guard: InFlight,
    ) {
        let this = self.clone();
        let arrival = Instant::now();
        // The caller's span (the HTTP layer's, naming the request) goes with the request: the
        // lines logged about it, here and in the detokenizer, carry it.
        let span = tracing::Span::current();
        actix::spawn(tracing::Instrument::instrument(
            async move {
                let encoded = this
                    .ask_tokenizers(Encode {
                        source: options.prompt.clone(),
                        add_special_tokens: true,
                    })
                    .await;
                let encoded = match encoded {
                    Ok(e) => e,
                    Err(e) => {
                        // The pool gone (shutting down) counts as `unavailable`, as every
                        // refusal after admission does; a prompt it refuses (400) does not.
                        this.refuse(&options, sink.as_mut(), e);
                        return;
                    }
                };
                let encoded_at = Instant::now();
                // A client gone while its prompt was encoded needs no adapter and no grammar (the
                // compile pool also skips a compile nobody waits for, which this makes true).
                if sink.is_closed() {
                    this.gone(&options, sink.as_ref());
                    return;
                }
                let adapter = match &options.lora {
                    None => None,
                    Some(name) => match this.resolve_adapter(name, &options).await {
                        Ok(a) => Some(a),
                        Err(e) => {
                            // A broken or busy adapter (503) counts as `unavailable`; an
                            // unknown one (404) or a bad name (400) only in the HTTP counts.
                            this.refuse(&options, sink.as_mut(), e);
                            return;
                        }
                    },
                };
                let constraints = match &options.structured {
                    None => Vec::new(),
                    Some(spec) => {
                        let compile = this.ask_tokenizers(Constrain {
                            spec: spec.clone(),
                            end_ids: end_ids(&options.sampling),
                            n: options.n.max(1) as usize,
                        });
                        // A client that leaves while its grammar waits for the compile pool drops
                        // the wait, so the pool skips (or stops waiting for) a compile nobody needs.
                        match unless_gone(compile, sink.as_ref()).await {
                            None => {
                                this.gone(&options, sink.as_ref());
                                return;
                            }
                            Some(Ok(c)) => c,
                            Some(Err(e)) => {
                                this.refuse(&options, sink.as_mut(), e);
                                return;
                            }
                        }
                    }
                };
                let constraints = match this.filtered(&options, constraints).await {
                    Ok(c) => c,
                    Err(e) => {
                        this.refuse(&options, sink.as_mut(), e);
                        return;
                    }
                };
                let resolved = Resolved {
                    prompt: encoded.ids,
                    opens_thinking: encoded.opens_thinking,
                    adapter,
                    constraints,
                    encoded: encoded_at,
                };
                if let Some(beam) = options.beam {
                    this.beam_search(options, beam, resolved, sink, guard, arrival)
                        .await;
                    return;
                }
                match this.admit(options, resolved, sink, guard, arrival, Metering::Request) {
                    Ok(()) => {}
                    Err((e, mut sink)) => {
                        sink.send(EngineOutput::Error(e));
                    }
                }
            },
            span,
        ));
    }

    /// The constraints of a request's choices with its token filters ([`TokenFilters`]):
    /// its bad words tokenized on the tokenizer pool, then each choice's grammar (`grammar`,
    /// one per choice or none), allowed ids and bad words intersected.
    async fn filtered(
        &self,
        options: &RequestOptions,
        grammar: Vec<Constraint>,
    ) -> Result<Vec<Constraint>, SubmitError> {
        let filters = &options.filters;
        if filters.is_empty() {
            return Ok(grammar);
        }
        if options.beam.is_some() {
            let param = if filters.allowed_token_ids.is_some() {
                "allowed_token_ids"
            } else {
                "bad_words"
            };
            return Err(SubmitError::new(
                SubmitErrorKind::InvalidRequest,
                format!("{param} cannot be combined with beam search"),
            )
            .with_param(param));
        }
        let bad_words = if filters.bad_words.is_empty() {
            None
        } else {
            let words = self
                .ask_tokenizers(EncodeBadWords(filters.bad_words.clone()))
                .await?;
            Some(Arc::from(words))
        };
        Ok(choice_constraints(
            filters,
            grammar,
            bad_words,
            options.n.max(1) as usize,
            self.vocab,
            end_ids(&options.sampling).into(),
        ))
    }

    /// Answers a request with `error` before it is queued; one refused as overloaded or
    /// unavailable (the engine shutting down, a broken adapter) counts in
    /// `request_failed_total` under that reason (each of its choices, as after queueing).
    fn refuse(&self, options: &RequestOptions, sink: &mut dyn OutputSink, error: SubmitError) {
        let reason = match error.kind {
            SubmitErrorKind::Overloaded => Some("overloaded"),
            SubmitErrorKind::TenantBusy => Some("tenant_busy"),
            SubmitErrorKind::Unavailable => Some("unavailable"),
            _ => None,
        };
        if let Some(reason) = reason {
            EndedEarly::Failed(reason)
                .count(options.n.max(1) as usize, &self.outcome_labels(options));
        }
        sink.send(EngineOutput::Error(error));
    }

    /// Counts a request whose client left before it was queued as the detokenizer counts one
    /// that leaves later: each choice in `request_aborted_total`, or, when the client dropped
    /// it because another prompt of its request failed, in `request_failed_total` with that
    /// failure's reason.
    fn gone(&self, options: &RequestOptions, sink: &dyn OutputSink) {
        let labels = self.outcome_labels(options);
        EndedEarly::of_closed(sink).count(options.n.max(1) as usize, &labels);
        tracing::info!("request aborted before it was queued: its client went away");
    }

    /// The tier that labels a request's metrics: a configured tier's name; any other name
    /// (the open API's default tier when no tier of that name is configured) none ("").
    fn metrics_tier(&self, tier: &str) -> Arc<str> {
        let configured = self.tiers.read().iter().any(|t| t.name == tier);
        Arc::from(if configured { tier } else { "" })
    }

    /// The SLO targets of `tier` in force (none for a tier not configured).
    pub(crate) fn tier_slo(&self, tier: &str) -> SloTargets {
        self.tiers
            .read()
            .iter()
            .find(|t| t.name == tier)
            .map_or_else(SloTargets::default, |t| SloTargets {
                ttft_ms: t.ttft_ms,
                tpot_ms: t.tpot_ms,
            })
    }

    /// The tenant that labels a request's usage counters: a configured tenant's name, any
    /// other none ("").
    fn metrics_tenant(&self, tenant: &str) -> Arc<str> {
        names::metrics_tenant(&self.metrics_tenants.read(), tenant)
    }

    /// The labels of a request's outcome counters (its tier and tenant, as configured).
    fn outcome_labels(&self, options: &RequestOptions) -> Vec<metrics::Label> {
        names::outcome_labels(
            &self.metrics_tier(&options.tier),
            &self.metrics_tenant(&options.tenant),
        )
    }

    /// The prefix-cache salt of a request's blocks: its tenant's (when tenants do not share)
    /// and its own `cache_salt`, hashed with this process's keys; `None` (shared with every
    /// request) when neither applies.
    fn cache_salt(&self, options: &RequestOptions) -> Option<u64> {
        use std::hash::BuildHasher;
        let tenant = self
            .config
            .prefix_sharing_by_tenant
            .then_some(options.tenant.as_str());
        if tenant.is_none() && options.cache_salt.is_none() {
            return None;
        }
        let h = self.salts.hash_one((tenant, options.cache_salt.as_deref()));
        // Even: never one of the odd salts of prompt-logprob requests.
        Some(h & !1)
    }

    /// Validates lengths, registers the choices with the detokenizer and submits them, its
    /// per-request metrics recorded as `metering` says.
    #[allow(clippy::result_large_err)]
    fn admit(
        &self,
        mut options: RequestOptions,
        resolved: Resolved,
        mut sink: Box<dyn OutputSink>,
        guard: InFlight,
        arrival: Instant,
        metering: Metering,
    ) -> Result<(), (SubmitError, Box<dyn OutputSink>)> {
        let quiet = metering.quiet();
        let Resolved {
            prompt,
            opens_thinking,
            adapter,
            constraints,
            encoded,
        } = resolved;
        if options.embed {
            if options.n > 1 || options.prompt_logprobs.is_some() || options.structured.is_some() {
                return Err((
                    SubmitError::new(
                        SubmitErrorKind::InvalidRequest,
                        "an embedding request has one choice, no prompt logprobs and no \
                         structured output",
                    ),
                    sink,
                ));
            }
            // One greedy token, never output: the step that samples it at the prompt's last
            // token reports the hidden state there.
            options.sampling = SamplingParams {
                temperature: 0.0,
                ignore_eos: true,
                hidden_state: true,
                eos_token_ids: options.sampling.eos_token_ids,
                ..SamplingParams::default()
            };
            options.max_tokens = Some(1);
            options.stop.clear();
        }
        let max_tokens = match self.check(&options, &prompt) {
            Ok(m) => m,
            Err(e) => return Err((e, sink)),
        };
        if self.closed.load(Ordering::Acquire) || !self.detokenizer.connected() {
            // Refused inside the engine at the end of a drain: counted as the requests cut off
            // by it are, under `unavailable`, each choice.
            if !quiet {
                EndedEarly::Failed("unavailable")
                    .count(options.n.max(1) as usize, &self.outcome_labels(&options));
            }
            return Err((
                SubmitError::new(SubmitErrorKind::Unavailable, "the engine is shutting down"),
                sink,
            ));
        }
        // A client already gone (a prompt-logprob request sends no prompt event to find out).
        if sink.is_closed() {
            if !quiet {
                self.gone(&options, sink.as_ref());
            }
            return Ok(());
        }
        // The prompt's tokens count in `prompt_tokens_total` once it is computed (the
        // detokenizer, at its first token), as vLLM counts them: one that times out in the
        // queue, or whose client leaves before its prefill, was never computed.
        // With prompt logprobs the detokenizer sends the prompt event once they are computed.
        if options.prompt_logprobs.is_none()
            && !sink.send(EngineOutput::Prompt {
                prompt_tokens: prompt.len() as u32,
                opens_thinking,
                prompt_logprobs: None,
            })
        {
            if !quiet {
                self.gone(&options, sink.as_ref());
            }
            return Ok(());
        }
        self.register(
            options,
            (prompt.into(), opens_thinking),
            adapter,
            constraints,
            (sink, guard),
            (arrival, encoded),
            max_tokens,
            metering,
        );
        Ok(())
    }

    /// What the backend checks of each step, the prompt's length and the completion limit,
    /// checked before a request is queued; the request's `max_tokens` once the prompt's
    /// length is known.
    fn check(&self, options: &RequestOptions, prompt: &[u32]) -> Result<u32, SubmitError> {
        // What the backend checks of each step is checked here first: a bad value would fail
        // the whole step, every request in it with this one.
        let outside = |param: &'static str, ids: &[u32]| {
            ids.iter().find(|&&t| t as usize >= self.vocab).map(|t| {
                SubmitError::new(
                    SubmitErrorKind::InvalidRequest,
                    format!(
                        "token id {t} in {param} is outside the vocabulary (size {})",
                        self.vocab
                    ),
                )
                .with_param(param)
            })
        };
        let bias: Vec<u32> = options.sampling.logit_bias.iter().map(|b| b.0).collect();
        let check = match options.sampling.validate(usize::MAX) {
            Err(e) => Some(SubmitError::new(
                SubmitErrorKind::InvalidRequest,
                e.to_string(),
            )),
            Ok(()) => outside("logit_bias", &bias)
                .or_else(|| outside("stop_token_ids", &options.sampling.stop_token_ids))
                .or_else(|| {
                    let allowed = options.filters.allowed_token_ids.as_deref()?;
                    if allowed.is_empty() {
                        return Some(
                            SubmitError::new(
                                SubmitErrorKind::InvalidRequest,
                                "allowed_token_ids is empty",
                            )
                            .with_param("allowed_token_ids"),
                        );
                    }
                    outside("allowed_token_ids", allowed)
                }),
        };
        if let Some(error) = check {
            return Err(error);
        }
        if prompt.is_empty() {
            return Err(SubmitError::new(
                SubmitErrorKind::InvalidRequest,
                "the prompt is empty",
            ));
        }
        // A sequence must fit in the context and, alone, in the KV cache: the scheduler
        // refuses one that cannot, which must be found here, before the prompt event opens
        // the response (serve keeps max_model_len within the cache; other callers may not).
        let sequence = SequenceLimit::new(self.max_model_len(), self.kv_capacity_tokens())
            .with_tier_kv(self.tier_kv_capacity_tokens(&options.tier));
        let limit = sequence.tokens();
        // The prompt must leave room for one generated token at least (as vLLM checks).
        if prompt.len() >= limit {
            let message = if options.embed {
                sequence.input_too_long(prompt.len())
            } else {
                sequence.prompt_too_long(prompt.len())
            };
            return Err(SubmitError::new(
                SubmitErrorKind::ContextLengthExceeded,
                message,
            ));
        }
        let room = (limit - prompt.len()) as u32;
        // A default is cut to the room; a limit the client asked for is not.
        let max_tokens = options
            .max_tokens
            .unwrap_or_else(|| options.default_max_tokens.map_or(room, |d| d.min(room)));
        if max_tokens > room {
            return Err(SubmitError::new(
                SubmitErrorKind::ContextLengthExceeded,
                sequence.max_tokens_too_large(prompt.len(), max_tokens as usize),
            )
            .with_param("max_tokens"));
        }
        // Without max_tokens the limit is the room the prompt leaves, known only now.
        if options.sampling.min_tokens > max_tokens {
            return Err(
                SubmitError::new(
                    SubmitErrorKind::InvalidRequest,
                    format!(
                        "min_tokens ({}) is more than the {max_tokens} tokens this request may generate (the prompt has {} of the {limit} a sequence may hold)",
                        options.sampling.min_tokens,
                        prompt.len()
                    ),
                )
                .with_param("min_tokens"),
            );
        }
        Ok(max_tokens)
    }

    /// Registers a checked request's choices with the detokenizer, which queues them.
    #[allow(clippy::too_many_arguments)]
    fn register(
        &self,
        options: RequestOptions,
        (prompt, opens_thinking): (Arc<[u32]>, bool),
        adapter: Option<ResolvedAdapter>,
        constraints: Vec<Constraint>,
        (sink, guard): (Box<dyn OutputSink>, InFlight),
        (arrival, encoded): (Instant, Instant),
        max_tokens: u32,
        metering: Metering,
    ) {
        let metrics_tenant = self.metrics_tenant(&options.tenant);
        let slo = self.tier_slo(&options.tier);
        let metrics_tier = self.metrics_tier(&options.tier);
        let shared_salt = self.cache_salt(&options);
        let eos = options.sampling.eos_token_ids.first().copied();
        let mut stop_ids = options.sampling.stop_token_ids.clone();
        stop_ids.extend(options.sampling.eos_token_ids.iter().skip(1).copied());
        let mut submits = Vec::with_capacity(options.n as usize);
        let mut ids = Vec::with_capacity(options.n as usize);
        for i in 0..options.n.max(1) {
            let id = RequestId(self.next_id.fetch_add(1, Ordering::Relaxed));
            let mut sampling = options.sampling.clone();
            sampling.seed = options.sampling.seed.map(|s| s.wrapping_add(u64::from(i)));
            // The prompt's logprobs are the same for every choice: the first computes them
            // (and the detokenizer hands them to the request), the others share the prefix
            // cache as choices without them do.
            let prompt_logprobs = options.prompt_logprobs.filter(|_| i == 0);
            sampling.prompt_logprobs = prompt_logprobs;
            sampling.constraint = constraints.get(i as usize).cloned();
            ids.push(id);
            submits.push(SubmitOptions {
                request: Request {
                    id,
                    tenant: options.tenant.clone(),
                    tier: options.tier.clone(),
                    priority: options.priority,
                    lora_adapter: adapter.as_ref().map(|a| a.id),
                    arrival: switchyard_policies::Timestamp(0),
                    slo: slo.clone(),
                    prompt: prompt.clone(),
                    limits: SamplingLimits {
                        max_tokens,
                        min_tokens: options.sampling.min_tokens,
                        stop_token_ids: if options.sampling.ignore_eos {
                            options.sampling.stop_token_ids.clone()
                        } else {
                            stop_ids.clone()
                        },
                        eos_token_id: eos,
                        ignore_eos: options.sampling.ignore_eos,
                        prompt_logits: prompt_logprobs.is_some(),
                        // The core narrows it to what the backend verifies.
                        speculate: true,
                    },
                    // Prompt logprobs need every prompt position computed: a salt of its own
                    // keeps the request off shared prefix blocks.
                    cache_salt: match prompt_logprobs {
                        Some(_) => Some(prompt_logprob_salt(id)),
                        None => shared_salt,
                    },
                },
                sampling: Arc::new(sampling),
                adapter: adapter.as_ref().map(|a| a.adapter.clone()),
                adapter_user: adapter.as_ref().and_then(|a| a.user.clone()),
                received: Some(arrival),
                encoded: Some(encoded),
                // Stamped by the scheduler when it queues the request.
                queued: None,
                queue_times: metering.queue_times(),
                metrics_tier: metrics_tier.clone(),
                metrics_tenant: metrics_tenant.clone(),
                queue_bound: metering.queue_bound(),
            });
        }
        // The detokenizer queues the request with the scheduler as it registers it, so that
        // nothing it sends the scheduler about the request (an abort when the client leaves)
        // can arrive before it; the scheduler reports a refusal back to the detokenizer.
        self.detokenizer.do_send(Register {
            ids,
            submits,
            pending_prompt: options.prompt_logprobs.map(|_| PendingPrompt {
                tokens: prompt.clone(),
                opens_thinking,
            }),
            sink,
            stop: options.stop,
            text: TextOptions {
                min_tokens: options.sampling.min_tokens,
                include_stop: options.include_stop_str_in_output,
                skip_special: options.skip_special_tokens,
                keep_special: options.keep_special_tokens,
            },
            arrival,
            guard,
            span: tracing::Span::current(),
            quiet: metering.quiet(),
        });
    }

    /// Tokenizes a prompt (chat messages through the template).
    pub async fn tokenize(
        &self,
        source: PromptSource,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, SubmitError> {
        self.ask_tokenizers(Encode {
            source,
            add_special_tokens,
        })
        .await
        .map(|e| e.ids)
    }

    /// Turns token ids into text, special tokens included.
    pub async fn detokenize(&self, ids: Vec<u32>) -> Result<String, SubmitError> {
        self.ask_tokenizers(Decode(ids)).await
    }

    /// The id and weights of a registered adapter for the request `options`: read from the
    /// registry when they are in memory, loaded by the LoRA manager if they are not (charged
    /// to the request's tenant, within its tier's share, `tiers.<name>.max_cpu_loras_per_tenant`).
    async fn resolve_adapter(
        &self,
        name: &str,
        options: &RequestOptions,
    ) -> Result<ResolvedAdapter, SubmitError> {
        let lora = self.lora.as_ref().ok_or(LoraError::Disabled);
        let lora = lora.map_err(lora_submit_error)?;
        let charge = Charge {
            tenant: options.tenant.as_str().into(),
            tier: options.tier.as_str().into(),
        };
        lora.resolve(name, Some(&charge))
            .await
            .map_err(lora_submit_error)
    }

    /// Puts the tiers' shares of LoRA adapter memory per tenant in force
    /// (`tiers.<name>.max_cpu_loras_per_tenant`, a reload); nothing without LoRA.
    pub fn set_lora_tenant_shares(&self, shares: &[(String, usize)]) {
        if let Some(lora) = &self.lora {
            lora.set_tenant_shares(shares);
        }
    }

    /// Registers a LoRA adapter under `name` (loads it to check it), pinned in memory or not.
    pub async fn register_adapter(
        &self,
        name: String,
        path: PathBuf,
        pinned: bool,
    ) -> Result<AdapterInfo, SubmitError> {
        self.ask_lora(RegisterAdapter { name, path, pinned }).await
    }

    /// Pins a registered adapter in memory (loading it if it was evicted) or unpins it.
    pub async fn pin_adapter(
        &self,
        name: String,
        pinned: bool,
    ) -> Result<AdapterInfo, SubmitError> {
        self.ask_lora(SetPinned { name, pinned }).await
    }

    /// Serves the adapter at `path` under `name` in place of the one registered under it (a
    /// new name is registered): loaded first, so a bad file leaves the old one served, and the
    /// name is never missing (vLLM's `load_inplace`).
    pub async fn replace_adapter(
        &self,
        name: String,
        path: PathBuf,
        pinned: bool,
    ) -> Result<AdapterInfo, SubmitError> {
        self.ask_lora(ReplaceAdapter { name, path, pinned }).await
    }

    /// Unregisters a LoRA adapter; requests using it finish with it.
    pub async fn unregister_adapter(&self, name: String) -> Result<(), SubmitError> {
        self.ask_lora(Unregister(name)).await
    }

    /// This engine with its tokenizer pool gone, as at shutdown: its mailbox is closed.
    #[cfg(test)]
    pub(crate) fn with_tokenizers_gone(mut self) -> Self {
        let (tx, rx) = actix::dev::channel::channel::<TokenizerActor>(1);
        drop(rx);
        self.tokenizers = Addr::new(tx);
        self
    }

    /// Sends `msg` to the tokenizer pool; a pool that is gone means the engine is stopping.
    async fn ask_tokenizers<M, T>(&self, msg: M) -> Result<T, SubmitError>
    where
        M: actix::Message<Result = Result<T, SubmitError>> + Send + 'static,
        T: Send + 'static,
        TokenizerActor: actix::Handler<M>,
    {
        self.tokenizers.send(msg).await.unwrap_or_else(|_| {
            Err(SubmitError::new(
                SubmitErrorKind::Unavailable,
                "the engine is shutting down",
            ))
        })
    }

    /// Sends `msg` to the LoRA manager and maps its error for the client.
    async fn ask_lora<M, T>(&self, msg: M) -> Result<T, SubmitError>
    where
        M: actix::Message<Result = Result<T, LoraError>> + Send + 'static,
        T: Send + 'static,
        LoraManager: actix::Handler<M>,
    {
        let lora = self.lora.as_ref().ok_or(LoraError::Disabled);
        let lora = lora.map_err(lora_submit_error)?;
        lora.ask(msg).await.map_err(lora_submit_error)
    }

    /// The registered LoRA adapters (none when LoRA is disabled).
    pub fn adapters(&self) -> Vec<AdapterInfo> {
        self.lora
            .as_ref()
            .map(|l| l.registry().list())
            .unwrap_or_default()
    }

    /// Whether a LoRA adapter is registered under `name` (a name check that copies nothing).
    pub fn has_adapter(&self, name: &str) -> bool {
        self.lora
            .as_ref()
            .is_some_and(|l| l.registry().contains(name))
    }

    /// The names of the LoRA adapters `lora.adapter_dirs` hold now, registered or not (sorted;
    /// nothing is loaded): scanned on a thread of their own, bounded per directory, and reused
    /// for a second. Empty without directories.
    pub async fn adapters_in_directories(&self) -> Arc<Vec<String>> {
        match &self.lora {
            Some(lora) => lora.in_directories().await,
            None => Arc::default(),
        }
    }

    /// Whether requests may name the LoRA adapter `name`: registered, or held now by one of
    /// `lora.adapter_dirs`. Nothing is loaded: the request that follows loads a directory's
    /// adapter when it resolves the name (a broken one, or a full registry of adapters in use,
    /// is then its `Unavailable` error).
    pub async fn find_adapter(&self, name: &str) -> Result<bool, SubmitError> {
        let Some(lora) = &self.lora else {
            return Ok(false);
        };
        lora.find(name).await.map_err(lora_submit_error)
    }

    /// Replaces the tiers (a reload of the configuration: tiers added, removed or with new
    /// settings) and the policy, built with them: requests submitted from now on get the new
    /// SLO targets, KV bounds and metrics labels, and the scheduler gets the tiers with the
    /// policy (it checks them again and logs a refusal, changing nothing there then; the
    /// caller checks them first). Admission counts the new tiers' requests in flight from now
    /// on, and no longer bounds a removed tier's (see [`Engine::set_admission_limits`]).
    pub fn set_tiers(&self, tiers: Vec<switchyard_policies::TierSpec>, policy: Box<dyn Policy>) {
        let names: Vec<String> = tiers.iter().map(|t| t.name.clone()).collect();
        self.admission.set_tiers(&names);
        *self.tiers.write() = tiers.clone();
        self.scheduler.do_send(SetTiers(tiers, policy));
    }

    /// Replaces the policy at the next step boundary.
    pub fn swap_policy(&self, policy: Box<dyn Policy>) {
        self.scheduler.do_send(SwapPolicy(policy));
    }

    /// Sets speculative decoding (`None`: off) from the next step on; an invalid setting, or
    /// drafts on a backend that verifies none, is refused with the reason.
    pub async fn set_speculative(
        &self,
        speculative: Option<switchyard_policies::SpeculativeConfig>,
    ) -> Result<(), SubmitError> {
        self.scheduler
            .send(SetSpeculative(speculative))
            .await
            .map_err(|_| {
                SubmitError::new(SubmitErrorKind::Unavailable, "the engine is shutting down")
            })?
            .map_err(|e| SubmitError::new(SubmitErrorKind::InvalidRequest, e))
    }

    /// Queue and cache statistics.
    pub async fn stats(&self) -> Result<SchedulerStats, SubmitError> {
        self.scheduler.send(GetStats).await.map_err(|_| {
            SubmitError::new(SubmitErrorKind::Unavailable, "the engine is shutting down")
        })
    }
}

/// The client-facing form of a LoRA manager error. What the client asked wrongly (a bad name,
/// or a path an admin gave that holds no usable adapter) is its 400; a registered adapter
/// whose files broke on the server is the server's 503, without the detail (the manager logs
/// it).
fn lora_submit_error(e: LoraError) -> SubmitError {
    let kind = match e {
        LoraError::Unknown(_) => SubmitErrorKind::UnknownModel,
        LoraError::Disabled
        | LoraError::Exists(_)
        | LoraError::BadName(_)
        | LoraError::Full(_)
        | LoraError::PinLimit(_)
        | LoraError::Load(_) => SubmitErrorKind::InvalidRequest,
        LoraError::Reload(_) | LoraError::Busy(..) | LoraError::Stopped => {
            SubmitErrorKind::Unavailable
        }
        // The tenant's own share, full of its adapters in use: retry once one of its requests
        // ends, as for its bound on requests in flight.
        LoraError::TenantShare { .. } => SubmitErrorKind::TenantBusy,
    };
    // Names and paths come only from a registration (`POST /admin/lora`'s fields).
    let param = match e {
        LoraError::BadName(_) | LoraError::Exists(_) => Some("lora_name"),
        LoraError::Load(_) => Some("lora_path"),
        LoraError::PinLimit(_) => Some("pinned"),
        _ => None,
    };
    let error = SubmitError::new(kind, e.to_string());
    match param {
        Some(param) => error.with_param(param),
        None => error,
    }
}

/// Moves the backend into the executor thread exactly once.
fn parking_slot(backend: Box<dyn Backend>) -> Arc<std::sync::Mutex<Option<Box<dyn Backend>>>> {
    Arc::new(std::sync::Mutex::new(Some(backend)))
}

/// How often a wait on a client's behalf checks that the client is still there.
const CLIENT_CHECK: std::time::Duration = std::time::Duration::from_millis(100);

/// Awaits `fut` unless the client behind `sink` leaves first (checked every
/// [`CLIENT_CHECK`]): then `fut` is dropped, so whatever answers it learns that nobody waits.
async fn unless_gone<F: std::future::Future>(fut: F, sink: &dyn OutputSink) -> Option<F::Output> {
    use std::future::Future;
    use std::task::Poll;
    let mut fut = std::pin::pin!(fut);
    loop {
        let mut tick = std::pin::pin!(actix::clock::sleep(CLIENT_CHECK));
        let done = std::future::poll_fn(|cx| {
            if let Poll::Ready(v) = fut.as_mut().poll(cx) {
                return Poll::Ready(Some(v));
            }
            tick.as_mut().poll(cx).map(|()| None)
        })
        .await;
        match done {
            Some(v) => return Some(v),
            None if sink.is_closed() => return None,
            None => {}
        }
    }
}

/// The tokens that end a request: its end-of-sequence tokens, then its `stop_token_ids` (what
/// a grammar, or token filters with nothing left to allow, end through).
fn end_ids(sampling: &SamplingParams) -> Vec<u32> {
    sampling
        .eos_token_ids
        .iter()
        .chain(&sampling.stop_token_ids)
        .copied()
        .collect()
}

/// The prefix-cache salt of a request that asks for prompt logprobs: its own, so that no
/// other request's blocks stand in for prompt positions it must compute (nor tell it that
/// someone sent the same prompt). Odd, unlike every shared salt, and one per request id
/// (ids stay below 2^63).
fn prompt_logprob_salt(id: RequestId) -> u64 {
    (id.0 << 1) | 1
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc::{channel, Receiver, Sender};
    use std::sync::Mutex;
    use std::time::Duration;

    use switchyard_policies::{PolicyRegistry, SchedulerError, TierSpec};

    use super::*;
    use crate::actors::detokenizer::rejection;
    use crate::actors::step_watch::BackendCall;
    use crate::structured::STRUCTURED_OUTPUT_PARAM;
    use crate::testing::{abc_tokenizer, CountingBackend, GatedBackend, PROMPT_LOGPROB_ROWS};

    /// A client's request and a beam search's first step are bounded by their tier's
    /// `max_queue_ms`; the search's later steps, work of a request admitted once, are not.
    #[test]
    fn only_a_beam_searchs_first_step_is_queue_bounded() {
        assert!(Metering::Request.queue_bound());
        assert!(Metering::BeamStep { queue_times: 2 }.queue_bound());
        assert!(!Metering::BeamStep { queue_times: 0 }.queue_bound());
    }

    /// A request of a tier whose KV quota (16 of 64 blocks of 4 tokens: 64 tokens) is below
    /// the context (1024) and the cache (256): a limit the client asked for that only the
    /// context allows is refused before anything is sent, like one over the cache, and a
    /// defaulted limit is cut to what the tier's quota holds, not refused.
    #[actix::test]
    async fn a_tiers_kv_quota_bounds_max_tokens_before_the_prompt_event() {
        let tier = |name: &str, max_kv_fraction| TierSpec {
            max_kv_fraction,
            ..TierSpec::named(name)
        };
        let (engine, _) = engine_with_tiers(1024, vec![tier("batch", Some(0.25))]);
        let batch = |max_tokens| RequestOptions {
            tier: "batch".into(),
            ..options(max_tokens)
        };
        let (sink, rx) = recorder();
        let Err((e, _)) = admit_with(&engine, batch(Some(100)), 10, sink) else {
            panic!("a request over its tier's KV quota was admitted");
        };
        assert_eq!(e.kind, SubmitErrorKind::ContextLengthExceeded, "{e}");
        assert_eq!(e.param, Some("max_tokens"));
        assert!(e.message.contains("64 tokens"), "{e}");
        assert!(
            rx.try_recv().is_err(),
            "something was sent before the refusal"
        );
        let (sink, rx) = recorder();
        assert!(admit_with(&engine, batch(None), 10, sink).is_ok());
        prompt_then_length(&rx, 10, 54).await;
    }

    /// Records what a request receives.
    struct Recorder {
        tx: Sender<EngineOutput>,
        closed: Arc<AtomicBool>,
    }

    impl OutputSink for Recorder {
        fn send(&mut self, output: EngineOutput) -> bool {
            self.tx.send(output).is_ok()
        }
        fn is_closed(&self) -> bool {
            self.closed.load(Ordering::Acquire)
        }
    }

    fn recorder() -> (Box<dyn OutputSink>, Receiver<EngineOutput>) {
        let (tx, rx) = channel();
        let closed = Arc::new(AtomicBool::new(false));
        (Box::new(Recorder { tx, closed }), rx)
    }

    /// An engine over a [`CountingBackend`] (whose counts come back too) with a context of
    /// `max_model_len` tokens.
    fn engine(max_model_len: usize) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
        engine_with_tiers(max_model_len, Vec::new())
    }

    /// [`engine`] with the scheduler's `tiers`.
    fn engine_with_tiers(
        max_model_len: usize,
        tiers: Vec<TierSpec>,
    ) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
        engine_with_scheduler(SchedulerConfig {
            num_gpu_blocks: 64,
            block_size: 4,
            max_model_len,
            tiers,
            ..SchedulerConfig::default()
        })
    }

    /// [`engine`] with the scheduler's whole configuration.
    fn engine_with_scheduler(
        scheduler: SchedulerConfig,
    ) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
        let fed = Arc::new(Mutex::new(HashMap::new()));
        let backend = Box::new(CountingBackend(fed.clone()));
        (engine_on(scheduler, backend, None), fed)
    }

    /// An engine on `backend` with the scheduler's configuration and a limit on one backend
    /// call.
    fn engine_on(
        scheduler: SchedulerConfig,
        backend: Box<dyn Backend>,
        step_timeout: Option<Duration>,
    ) -> Engine {
        let tokenizer = abc_tokenizer();
        let config = EngineConfig {
            scheduler,
            hash_key: [1, 2],
            tokenizer_threads: 1,
            max_pending_requests: 16,
            tier_max_pending: Vec::new(),
            tier_max_pending_per_tenant: Vec::new(),
            metrics_tenants: Default::default(),
            async_scheduling: AsyncScheduling::Off,
            lora: None,
            vocab_size: 3,
            prefix_sharing_by_tenant: true,
            message_tokens_as_text: true,
            step_timeout,
        };
        let policy = PolicyRegistry::with_builtins()
            .create("fcfs", &serde_yaml::Value::Null, &[])
            .unwrap();
        Engine::start(config, backend, tokenizer, None, policy).unwrap()
    }

    /// Yields to the actors until `check` answers, at most 30 s (a guard against a hang,
    /// generous for a loaded machine).
    async fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(answer) = check() {
                return answer;
            }
            assert!(Instant::now() < deadline, "{what}: not within 30 s");
            actix::clock::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A step that does not return stalls the engine once it has run past the limit (an
    /// engine idle for longer is not stalled: no call runs), the request in flight is left
    /// alone, and the stall ends when the step returns.
    #[actix::test]
    async fn a_step_past_the_limit_stalls_the_engine_until_it_returns() {
        let limit = Duration::from_secs(1);
        let (entered_tx, entered) = channel();
        let (gate, gate_rx) = channel();
        let backend = GatedBackend {
            inner: CountingBackend(Arc::default()),
            entered: entered_tx,
            gate: gate_rx,
        };
        let engine = engine_on(
            SchedulerConfig {
                num_gpu_blocks: 64,
                block_size: 4,
                max_model_len: 64,
                ..SchedulerConfig::default()
            },
            Box::new(backend),
            Some(limit),
        );
        assert_eq!(engine.step_timeout(), Some(limit));
        actix::clock::sleep(limit + Duration::from_millis(100)).await;
        assert_eq!(engine.backend_call(), None, "idle");
        assert_eq!(engine.stall(), None, "an idle engine is not stalled");

        let (sink, rx) = recorder();
        assert!(admit(&engine, 4, Some(1), sink).is_ok());
        wait_for("the step begins", || entered.try_recv().ok()).await;
        let running = engine.backend_call().expect("the step runs");
        assert_eq!(running.call, BackendCall::Execute);
        let stall = wait_for("the stall", || engine.stall()).await;
        assert_eq!(stall.running.call, BackendCall::Execute);
        assert_eq!(stall.limit, limit);
        assert!(stall.running.running > limit, "{stall:?}");

        // Released, the step's request completes: the stall failed nothing.
        drop(gate);
        prompt_then_length(&rx, 4, 1).await;
        wait_for("the end of the stall", || {
            engine.stall().is_none().then_some(())
        })
        .await;
    }

    fn options(max_tokens: Option<u32>) -> RequestOptions {
        RequestOptions {
            prompt: PromptSource::Tokens(Vec::new()),
            sampling: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::default()
            },
            stop: Vec::new(),
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            keep_special_tokens: KeptSpecial::default(),
            n: 1,
            max_tokens,
            default_max_tokens: None,
            priority: 0,
            tier: String::new(),
            tenant: String::new(),
            prompt_logprobs: None,
            lora: None,
            structured: None,
            filters: TokenFilters::default(),
            cache_salt: None,
            embed: false,
            beam: None,
        }
    }

    /// Admits a request with a prompt of `prompt_len` tokens, as `submit` does once it is
    /// tokenized.
    #[allow(clippy::result_large_err)]
    fn admit(
        engine: &Engine,
        prompt_len: usize,
        max_tokens: Option<u32>,
        sink: Box<dyn OutputSink>,
    ) -> Result<(), (SubmitError, Box<dyn OutputSink>)> {
        admit_with(engine, options(max_tokens), prompt_len, sink)
    }

    /// [`admit`] with the request's options.
    #[allow(clippy::result_large_err)]
    fn admit_with(
        engine: &Engine,
        options: RequestOptions,
        prompt_len: usize,
        sink: Box<dyn OutputSink>,
    ) -> Result<(), (SubmitError, Box<dyn OutputSink>)> {
        engine.admission.counter().fetch_add(1, Ordering::AcqRel);
        let resolved = Resolved {
            prompt: vec![2; prompt_len],
            opens_thinking: false,
            adapter: None,
            constraints: Vec::new(),
            encoded: Instant::now(),
        };
        let guard = InFlight::new(engine.admission.counter());
        engine.admit(
            options,
            resolved,
            sink,
            guard,
            Instant::now(),
            Metering::Request,
        )
    }

    /// The next output, yielding to the actors while there is none.
    async fn next_output(rx: &Receiver<EngineOutput>) -> EngineOutput {
        // A guard against a hang, generous for a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(output) = rx.try_recv() {
                return output;
            }
            assert!(Instant::now() < deadline, "no output came");
            actix::clock::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Waits until nothing runs or waits in the scheduler.
    async fn wait_idle(engine: &Engine) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = engine.stats().await.unwrap();
            if s.num_running == 0 && s.num_waiting == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "the scheduler never went idle");
            actix::clock::sleep(Duration::from_millis(2)).await;
        }
    }

    #[actix::test]
    async fn a_wait_ends_when_its_client_leaves_and_not_before() {
        let (sink, _rx) = recorder();
        // Answered: the answer comes back.
        assert_eq!(unless_gone(async { 7 }, sink.as_ref()).await, Some(7));
        // Never answered, client present: still waiting after a few checks.
        let pending = unless_gone(std::future::pending::<()>(), sink.as_ref());
        let waited = actix::clock::timeout(CLIENT_CHECK * 3, pending).await;
        assert!(waited.is_err(), "gave up on a client that is still there");
        // Never answered, client gone: the wait ends (and drops what it waited for).
        let closed = Arc::new(AtomicBool::new(true));
        let (tx, _rx) = channel();
        let gone = Recorder { tx, closed };
        let dropped = Arc::new(AtomicBool::new(false));
        struct Flag(Arc<AtomicBool>);
        impl Drop for Flag {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let flag = Flag(dropped.clone());
        let never = async move {
            let _flag = flag;
            std::future::pending::<()>().await
        };
        assert_eq!(unless_gone(never, &gone).await, None);
        assert!(dropped.load(Ordering::Acquire));
    }

    /// A token id outside the vocabulary in `logit_bias` or `stop_token_ids` is refused naming
    /// the field it came in.
    #[actix::test]
    async fn token_ids_outside_the_vocabulary_name_their_field() {
        let (engine, _) = engine(64);
        for (bias, stop, param) in [
            (vec![(3, 1.0)], Vec::new(), "logit_bias"),
            (vec![(0, 1.0)], vec![2, 3], "stop_token_ids"),
        ] {
            let mut options = options(Some(1));
            options.sampling.logit_bias = bias;
            options.sampling.stop_token_ids = stop;
            engine.admission.counter().fetch_add(1, Ordering::AcqRel);
            let resolved = Resolved {
                prompt: vec![2; 4],
                opens_thinking: false,
                adapter: None,
                constraints: Vec::new(),
                encoded: Instant::now(),
            };
            let guard = InFlight::new(engine.admission.counter());
            let (sink, _rx) = recorder();
            let Err((e, _)) = engine.admit(
                options,
                resolved,
                sink,
                guard,
                Instant::now(),
                Metering::Request,
            ) else {
                panic!("{param}: an id outside the vocabulary was admitted");
            };
            assert_eq!(e.kind, SubmitErrorKind::InvalidRequest, "{e}");
            assert_eq!(e.param, Some(param), "{e}");
            assert!(e.message.contains("token id 3"), "{e}");
        }
    }

    #[actix::test]
    async fn a_request_the_kv_cache_cannot_hold_is_refused_before_its_prompt_event() {
        // A context of 1024 tokens over a cache of 256: a limit the client asked for that only
        // the context allows is a 400 naming max_tokens, sent before anything else.
        let (engine, _) = engine(1024);
        let (sink, rx) = recorder();
        let Err((e, _)) = admit(&engine, 10, Some(500), sink) else {
            panic!("a request the KV cache cannot hold was admitted");
        };
        assert_eq!(e.kind, SubmitErrorKind::ContextLengthExceeded, "{e}");
        assert_eq!(e.param, Some("max_tokens"));
        assert!(e.message.contains("256 tokens"), "{e}");
        assert!(
            rx.try_recv().is_err(),
            "something was sent before the refusal"
        );
        // The longest prompt the cache holds (with room for one token) is admitted.
        let (sink, _rx) = recorder();
        assert!(admit(&engine, 256, None, sink).is_err());
        let (sink, _rx) = recorder();
        assert!(admit(&engine, 255, Some(1), sink).is_ok());
    }

    /// Expects the prompt event of `prompt_tokens` tokens, then deltas until a finish by
    /// length after `generated` tokens.
    async fn prompt_then_length(rx: &Receiver<EngineOutput>, prompt_tokens: u32, generated: u32) {
        match next_output(rx).await {
            EngineOutput::Prompt {
                prompt_tokens: got, ..
            } => assert_eq!(got, prompt_tokens),
            other => panic!("expected the prompt event, got {other:?}"),
        }
        loop {
            match next_output(rx).await {
                EngineOutput::Delta(d) => match d.finish {
                    Some(finish) => {
                        assert_eq!(finish, (FinishReason::Length, generated));
                        break;
                    }
                    None => continue,
                },
                other => panic!("expected deltas to a finish by length, got {other:?}"),
            }
        }
    }

    #[actix::test]
    async fn a_defaulted_max_tokens_is_cut_to_what_the_kv_cache_holds() {
        let (engine, _) = engine(1024);
        let (sink, rx) = recorder();
        assert!(admit(&engine, 10, None, sink).is_ok());
        prompt_then_length(&rx, 10, 246).await;
    }

    /// The prompt's logprobs are the same for every choice: with `n` = 3 only one choice
    /// computes them (the backend's logit rows for prompt-logprob sequences are one prompt's,
    /// not three), and the request still gets every position's entry.
    #[actix::test]
    async fn prompt_logprobs_of_several_choices_are_computed_once() {
        several_choices_get_the_prompt_logprobs_once(engine(1024)).await;
    }

    /// The other choices may sample before the first has computed the prompt's logprobs: here
    /// the first's prompt goes in chunks of 2 logit rows (5 steps for 10 tokens) while the
    /// others prefill at once and end in the first step. Their deltas wait for the prompt
    /// event, which still carries every position's logprob.
    #[actix::test]
    async fn prompt_logprobs_reach_a_request_whose_other_choices_end_first() {
        let bounded = engine_with_two_logit_rows_a_chunk();
        several_choices_get_the_prompt_logprobs_once(bounded).await;
    }

    /// An engine whose prompt-logprob prefill goes in chunks of 2 logit rows (at most 6 rows a
    /// step, 4 sequences), so that a 10-token prompt takes 5 steps.
    fn engine_with_two_logit_rows_a_chunk() -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
        engine_with_scheduler(SchedulerConfig {
            num_gpu_blocks: 64,
            block_size: 4,
            max_model_len: 1024,
            max_num_seqs: 4,
            max_logit_rows: 6,
            ..SchedulerConfig::default()
        })
    }

    /// A grammar that allows every token and reports `failure` (the detokenizer reads it when
    /// the choice ends).
    struct Grammar(Option<&'static str>);

    impl switchyard_gpu::TokenConstraint for Grammar {
        fn fill_allowed(&mut self, allowed: &mut [u32]) {
            allowed.fill(u32::MAX);
        }
        fn commit(&mut self, _: u32) {}
        fn failure(&self) -> Option<String> {
            self.0.map(str::to_owned)
        }
    }

    /// The second choice's grammar fails at its end, in the first step, while the first
    /// choice still computes the prompt's logprobs (in chunks of 2 logit rows): the request
    /// ends with the structured-output error before any delta, not with a delta before the
    /// prompt event (which the HTTP layer takes for an internal error).
    #[actix::test]
    async fn a_later_choice_failing_before_the_prompt_event_refuses_the_request() {
        let (engine, _) = engine_with_two_logit_rows_a_chunk();
        let (sink, rx) = recorder();
        let options = RequestOptions {
            n: 2,
            prompt_logprobs: Some(1),
            ..options(Some(1))
        };
        engine.admission.counter().fetch_add(1, Ordering::AcqRel);
        let resolved = Resolved {
            prompt: vec![2; 10],
            opens_thinking: false,
            adapter: None,
            constraints: vec![
                Constraint::new(Grammar(None)),
                Constraint::new(Grammar(Some("the test grammar"))),
            ],
            encoded: Instant::now(),
        };
        let guard = InFlight::new(engine.admission.counter());
        let admitted = engine.admit(
            options,
            resolved,
            sink,
            guard,
            Instant::now(),
            Metering::Request,
        );
        assert!(admitted.is_ok());
        match next_output(&rx).await {
            EngineOutput::Error(e) => {
                assert_eq!(e.kind, SubmitErrorKind::StructuredOutput, "{e:?}");
                assert!(e.message.contains("the test grammar"), "{e:?}");
            }
            other => panic!("expected the grammar's error first, got {other:?}"),
        }
        wait_idle(&engine).await;
        assert!(rx.try_recv().is_err(), "nothing after the error");
    }

    /// A request of 3 choices asking for prompt logprobs gets the prompt event first, with
    /// every position's logprob, then each choice's end; the backend computed one prompt's
    /// logit rows.
    async fn several_choices_get_the_prompt_logprobs_once(
        (engine, fed): (Engine, Arc<Mutex<HashMap<u64, usize>>>),
    ) {
        let (sink, rx) = recorder();
        let options = RequestOptions {
            n: 3,
            prompt_logprobs: Some(1),
            ..options(Some(1))
        };
        assert!(admit_with(&engine, options, 10, sink).is_ok());
        match next_output(&rx).await {
            EngineOutput::Prompt {
                prompt_tokens: 10,
                prompt_logprobs: Some(list),
                ..
            } => {
                assert_eq!(list.len(), 10);
                assert!(list[0].logprob.is_none(), "{:?}", list[0]);
                assert!(
                    list[1..]
                        .iter()
                        .all(|e| e.token == 2 && e.logprob == Some(0.0)),
                    "{list:?}"
                );
            }
            other => panic!("expected the prompt event with its logprobs, got {other:?}"),
        }
        let mut finished = Vec::new();
        while finished.len() < 3 {
            match next_output(&rx).await {
                EngineOutput::Delta(d) => {
                    if let Some(finish) = d.finish {
                        finished.push((d.index, finish));
                    }
                }
                other => panic!("expected deltas, got {other:?}"),
            }
        }
        finished.sort_by_key(|(index, _)| *index);
        let length = (FinishReason::Length, 1);
        assert_eq!(finished, [(0, length), (1, length), (2, length)]);
        wait_idle(&engine).await;
        let rows = fed.lock().unwrap().get(&PROMPT_LOGPROB_ROWS).copied();
        assert_eq!(rows, Some(10), "logit rows of prompt-logprob sequences");
    }

    #[actix::test]
    async fn an_abort_never_reaches_the_scheduler_before_its_request() {
        let (engine, fed) = engine(64);
        let (sink, rx) = recorder();
        assert!(admit(&engine, 10, Some(40), sink).is_ok());
        assert!(matches!(rx.try_recv(), Ok(EngineOutput::Prompt { .. })));
        // The detokenizer ends the request (as it ends one whose client left) right after it
        // registered it. This thread, which runs the scheduler, blocks until then: whatever the
        // request's submission left for it to do later would reach the scheduler after the
        // abort, which would then find no request to end.
        engine.fail_in_flight("stopping");
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(EngineOutput::Error(e)) => {
                assert_eq!(e.kind, SubmitErrorKind::Unavailable, "{e}");
                assert_eq!(e.message, "stopping");
            }
            other => panic!("expected the error, got {other:?}"),
        }
        // Tasks spawned on this thread run in order: once this one has, whatever the
        // submission left to run here has run too, and the scheduler sees what it sent before
        // the next question.
        actix::spawn(async {}).await.unwrap();
        wait_idle(&engine).await;
        // Run to its end, it would have been fed its 10 prompt tokens and 39 sampled ones.
        let fed = fed.lock().unwrap().get(&1).copied().unwrap_or(0);
        assert!(fed < 49, "the aborted request ran to its end");
        // Nothing is admitted any more.
        let (sink, rx) = recorder();
        let Err((e, _)) = admit(&engine, 10, Some(4), sink) else {
            panic!("a request was admitted after fail_in_flight");
        };
        assert_eq!(e.kind, SubmitErrorKind::Unavailable);
        assert!(rx.try_recv().is_err());
    }

    #[actix::test]
    async fn the_scheduler_refusal_of_a_registered_request_is_a_context_length_error() {
        // A request that skipped admission's checks, as a scheduler-side refusal comes back.
        let (engine, _) = engine(64);
        let (sink, rx) = recorder();
        let limits = SamplingLimits {
            max_tokens: 100,
            ..SamplingLimits::default()
        };
        let submit = SubmitOptions::offline(7, vec![2; 10], limits, Arc::default());
        engine.detokenizer.do_send(Register {
            ids: vec![RequestId(7)],
            submits: vec![submit],
            pending_prompt: None,
            sink,
            stop: Vec::new(),
            text: TextOptions::default(),
            arrival: Instant::now(),
            guard: InFlight::new(Arc::new(AtomicUsize::new(1))),
            span: tracing::Span::none(),
            quiet: false,
        });
        match next_output(&rx).await {
            EngineOutput::Error(e) => {
                assert_eq!(e.kind, SubmitErrorKind::ContextLengthExceeded, "{e}");
                assert!(!e.message.contains("RequestId"), "{e}");
                assert!(e.message.contains("64 tokens"), "{e}");
            }
            other => panic!("expected the refusal, got {other:?}"),
        }
    }

    #[test]
    fn scheduler_refusals_keep_their_kind_and_name_no_internal_id() {
        let too_long = EngineError::Scheduler(SchedulerError::TooLong {
            id: RequestId(2),
            prompt_len: 10,
            max_tokens: 100,
            max_model_len: 64,
        });
        let too_big = EngineError::Scheduler(SchedulerError::ExceedsKvCapacity {
            id: RequestId(2),
            needed: 30,
            capacity: 22,
        });
        let over_quota = EngineError::Scheduler(SchedulerError::ExceedsTierKvQuota {
            id: RequestId(2),
            tier: "batch".into(),
            needed: 30,
            quota: 11,
        });
        let r = rejection(&over_quota);
        assert!(r.message.contains("tier `batch` may hold 11"), "{r}");
        for e in [too_long, too_big, over_quota] {
            let r = rejection(&e);
            assert_eq!(r.kind, SubmitErrorKind::ContextLengthExceeded, "{r}");
            assert!(!r.message.contains("RequestId"), "{r}");
        }
        let field = EngineError::Scheduler(SchedulerError::InvalidRequest {
            id: RequestId(2),
            field: "tenant",
            reason: "longer than 256 bytes".into(),
        });
        let r = rejection(&field);
        assert_eq!(r.kind, SubmitErrorKind::InvalidRequest);
        assert_eq!(r.message, "tenant: longer than 256 bytes");
        assert_eq!(
            rejection(&EngineError::DuplicateRequest(2)).kind,
            SubmitErrorKind::Internal
        );
    }

    /// A constraint that failed while generating with this failure (what a grammar that
    /// cannot go on reports).
    struct FailedGrammar(&'static str);

    impl switchyard_gpu::TokenConstraint for FailedGrammar {
        fn fill_allowed(&mut self, allowed: &mut [u32]) {
            allowed[0] = 1;
        }
        fn commit(&mut self, _: u32) {}
        fn failure(&self) -> Option<String> {
            Some(self.0.into())
        }
    }

    /// A choice whose grammar failed ends its request with an error after the text it had,
    /// not with a finish reason: its output does not complete the grammar. Its sibling is
    /// aborted, and both count as failed under `structured_output`.
    #[actix::test]
    async fn a_choice_whose_grammar_failed_ends_its_request_with_an_error() {
        let failure = "the token mask failed after 3 generated tokens: too complex";
        let error = fail_a_grammar(failure).await;
        // A kind of its own, so that the request's other prompts count under its reason.
        assert_eq!(error.kind, SubmitErrorKind::StructuredOutput, "{error}");
        assert_eq!(error.param, None);
        assert_eq!(
            error.message,
            format!("structured output: {failure}; the output does not complete the grammar")
        );
    }

    /// A grammar that went past llguidance's parser limits while generating (what
    /// `GrammarConstraint` reports for them) is the request's own error, as its refusal when
    /// it compiles is: an invalid request naming the structured-output field, not a server
    /// error that clients retry.
    #[actix::test]
    async fn a_grammar_past_the_parser_limits_is_the_requests_error() {
        let failure = "the grammar exceeded the parser's limits after 3 generated tokens \
                       (parser error: Too many items (limit 50000; ff_tokens); try avoiding \
                       single-byte/short lexemes)";
        let error = fail_a_grammar(failure).await;
        assert_eq!(error.kind, SubmitErrorKind::InvalidRequest, "{error}");
        assert_eq!(error.param, Some(STRUCTURED_OUTPUT_PARAM));
        assert_eq!(
            error.message,
            format!("structured output: {failure}; the output does not complete the grammar")
        );
    }

    /// Runs a request of two choices whose grammars fail with `failure` (the first at its
    /// third token) and returns the error it ends with.
    async fn fail_a_grammar(failure: &'static str) -> SubmitError {
        let (engine, _) = engine(64);
        let (sink, rx) = recorder();
        engine.admission.counter().fetch_add(1, Ordering::AcqRel);
        let resolved = Resolved {
            prompt: vec![2; 4],
            opens_thinking: false,
            adapter: None,
            constraints: vec![
                Constraint::new(FailedGrammar(failure)),
                Constraint::new(FailedGrammar(failure)),
            ],
            encoded: Instant::now(),
        };
        let mut request = options(Some(3));
        request.n = 2;
        let guard = InFlight::new(engine.admission.counter());
        if engine
            .admit(
                request,
                resolved,
                sink,
                guard,
                Instant::now(),
                Metering::Request,
            )
            .is_err()
        {
            panic!("refused");
        }
        let mut tokens = 0;
        let error = loop {
            match next_output(&rx).await {
                EngineOutput::Prompt { .. } => {}
                EngineOutput::Delta(d) => {
                    assert!(d.finish.is_none(), "{d:?}");
                    tokens += d.token_ids.len();
                }
                EngineOutput::Error(e) => break e,
            }
        };
        // Both choices' tokens up to the first one's end went out; nothing after the error.
        assert!((3..=6).contains(&tokens), "{tokens}");
        wait_idle(&engine).await;
        assert!(rx.try_recv().is_err());
        error
    }

    /// A scheduler whose mailbox closed (shutting down) refuses a request as it registers,
    /// rather than leaving it registered and never scheduled.
    #[actix::test]
    async fn a_request_registered_as_the_scheduler_stops_is_unavailable() {
        let detokenizer = DetokenizerActor::new(abc_tokenizer()).start();
        let (tx, rx) = actix::dev::channel::channel::<SchedulerActor>(16);
        drop(rx);
        detokenizer.do_send(SetScheduler(Addr::new(tx)));
        let (sink, outputs) = recorder();
        let limits = SamplingLimits {
            max_tokens: 4,
            ..SamplingLimits::default()
        };
        detokenizer.do_send(Register {
            ids: vec![RequestId(1)],
            submits: vec![SubmitOptions::offline(
                1,
                vec![2; 3],
                limits,
                Arc::default(),
            )],
            pending_prompt: None,
            sink,
            stop: Vec::new(),
            text: TextOptions::default(),
            arrival: Instant::now(),
            guard: InFlight::new(Arc::new(AtomicUsize::new(1))),
            span: tracing::Span::none(),
            quiet: false,
        });
        match next_output(&outputs).await {
            EngineOutput::Error(e) => assert_eq!(e.kind, SubmitErrorKind::Unavailable, "{e}"),
            other => panic!("expected the error, got {other:?}"),
        }
    }

    #[actix::test]
    async fn a_request_registered_without_a_scheduler_is_unavailable() {
        let detokenizer = DetokenizerActor::new(abc_tokenizer()).start();
        let (sink, rx) = recorder();
        detokenizer.do_send(Register {
            ids: vec![RequestId(1)],
            submits: Vec::new(),
            pending_prompt: None,
            sink,
            stop: Vec::new(),
            text: TextOptions::default(),
            arrival: Instant::now(),
            guard: InFlight::new(Arc::new(AtomicUsize::new(1))),
            span: tracing::Span::none(),
            quiet: false,
        });
        match next_output(&rx).await {
            EngineOutput::Error(e) => assert_eq!(e.kind, SubmitErrorKind::Unavailable, "{e}"),
            other => panic!("expected the error, got {other:?}"),
        }
    }
}

#[path = "beam_search.rs"]
mod beam_search;
