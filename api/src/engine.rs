//! The port between the HTTP layer and the serving engine.
//!
//! `api` knows HTTP and nothing of actors, schedulers or models; the engine (the `actors` crate)
//! knows no HTTP. They meet here: the engine implements [`Engine`], the routes call it. Every type
//! in this module is plain owned data, so the engine can move it across actor boundaries.
//!
//! # The request protocol
//!
//! [`Engine::submit`] hands over the [`GenerateRequest`]s of one client request (one per
//! prompt) and returns, for each, the receiving half of a bounded channel of [`EngineEvent`]s.
//! The engine admits them together or not at all (a request refused at admission leaves no
//! part of it queued). On each channel the engine must send, in order:
//!
//! 1. exactly one [`EngineEvent::Prompt`] once the request is tokenized, validated against the
//!    context window and queued — or a single [`EngineEvent::Error`] instead, and nothing after it.
//!    The HTTP layer holds the response head (status and, for streams, the SSE headers) until
//!    this event, so validation errors get a proper status: send it on admission to the waiting
//!    queue, not on the first token;
//! 2. any number of [`EngineEvent::Delta`]s, each for one choice (`index < n`), with the text and
//!    tokens produced since that choice's previous delta (one delta per step and choice);
//! 3. for every choice, exactly one delta with `finish` set; it is that choice's last delta, and
//!    its `text` may be empty (a stop string matched, or the request ended on a token that
//!    produced no text).
//!
//! The engine closes the channel (drops its sender) after the last choice finished. A
//! [`EngineEvent::Error`] after the prompt event ends the whole request: the HTTP layer stops
//! reading and reports the error (as an error chunk then `[DONE]` when streaming).
//!
//! An error names the request field at fault in [`EngineError::param`] when the engine knows
//! it. Two it cannot know, the HTTP layer fills in: a context-length error without one names
//! the prompt's field (`prompt` or `messages`), and a refusal of the structured-output
//! specification names [`STRUCTURED_OUTPUT_PARAM`], which becomes the field the request
//! carried it in (`response_format`, `guided_regex`, `tools`, ...).
//!
//! # Cancellation
//!
//! **Dropping the receiver is the abort signal.** The HTTP layer owns the receiver inside the
//! response: a streaming response's body owns it, so a client that disconnects makes actix-web
//! drop the body and with it the receiver; a non-streaming request's handler future owns it, and
//! actix-web drops that future when its connection closes. The engine must therefore treat a
//! failed `send` as "abort this request now and free its KV blocks", and should also watch
//! `Sender::is_closed()` (or await `Sender::closed()`) for requests that are still waiting or
//! prefilling, so an abandoned request does not wait for its first token to be noticed.
//!
//! The channel is bounded: the engine must never block its scheduling loop on a full channel.
//! Use `try_send` and, when the client reads too slowly to keep up, either buffer per request in
//! the detokenizer (merging deltas) or abort the request; that choice belongs to the engine.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

/// A boxed future returned by the engine's asynchronous queries.
///
/// It is not required to be `Send`: actix-web runs each worker's handlers on a single-threaded
/// runtime, so the engine may return futures that hold `Rc`s or actix `Request`s.
pub type EngineFuture<T> = Pin<Box<dyn Future<Output = Result<T, EngineError>> + 'static>>;

/// The serving engine as the HTTP layer sees it.
///
/// Implementations are shared by every HTTP worker thread behind an `Arc<dyn Engine>`; methods
/// must return quickly (send a message, never run model code on the caller's thread).
pub trait Engine: Send + Sync + 'static {
    /// The served model's name: the only value `model` may take in a request, and the id listed
    /// by `GET /v1/models`.
    fn model_name(&self) -> &str;

    /// The context window in tokens: prompt plus completion may not exceed it.
    fn max_model_len(&self) -> usize;

    /// Whether the model is loaded and requests will be served; `GET /ready` answers 503 until
    /// this returns true.
    fn is_ready(&self) -> bool;

    /// Whether the engine can still serve at all. False once it cannot (its backend was
    /// retired after a failure): `GET /health` and `GET /ready` then answer 503, so that an
    /// orchestrator restarts the process. True by default.
    fn is_alive(&self) -> bool {
        true
    }

    /// The backend call that has run past the engine's limit on one call
    /// (`scheduler.step_timeout_s`), if one has: the engine is stalled (a device or driver
    /// hang, or a deadlock in its backend). `GET /health` and `GET /ready` then answer 503
    /// `engine_stalled` and no request is admitted, until the call returns. `None` by default.
    fn stall(&self) -> Option<EngineStall> {
        None
    }

    /// Queues the generation requests of one client request, one per prompt (at least one;
    /// all of one tier), and returns their receivers in the same order. See the module docs
    /// for the events the engine must send and for the abort-on-drop contract. They are
    /// admitted all or none: an error here (for instance [`EngineErrorKind::Overloaded`] when
    /// the waiting queue is full), or an [`EngineEvent::Error`] first on every channel, rejects
    /// them before any is queued.
    fn submit(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<mpsc::Receiver<EngineEvent>>, EngineError>;

    /// Tokenizes text, or chat messages through the model's chat template.
    fn tokenize(&self, input: TokenizeInput) -> EngineFuture<Vec<u32>>;

    /// Turns token ids back into text, special tokens included (as vLLM's `/detokenize` and
    /// `echo` do). Unknown ids are an [`EngineErrorKind::InvalidRequest`].
    fn detokenize(&self, token_ids: Vec<u32>) -> EngineFuture<String>;

    /// The scheduling policy in force.
    fn policy(&self) -> EngineFuture<PolicyInfo>;

    /// Replaces the scheduling policy. It takes effect at the next scheduler step; requests in
    /// flight continue. The engine logs and counts the swap ([`crate::metrics::POLICY_SWAPS`]).
    /// A spec equal to the policy in force (its name and parameters) swaps nothing, as a
    /// configuration reload keeps an unchanged policy (a swap resets a policy's state):
    /// [`PolicySwap::changed`] is false. An unknown name or bad parameters are an
    /// [`EngineErrorKind::InvalidRequest`] naming the parameter, whether or not they changed.
    fn swap_policy(&self, spec: PolicySpec) -> EngineFuture<PolicySwap>;

    /// The speculative decoding settings in force (`None`: off).
    fn speculative(&self) -> EngineFuture<Option<SpeculativeSettings>> {
        Box::pin(async { Ok(None) })
    }

    /// Turns speculative decoding on, changes it, or turns it off (`None`) from the next step
    /// on; returns the settings in force. Settings out of range, or drafts on a backend that
    /// cannot verify them, are an [`EngineErrorKind::InvalidRequest`].
    fn set_speculative(
        &self,
        settings: Option<SpeculativeSettings>,
    ) -> EngineFuture<Option<SpeculativeSettings>> {
        let _ = settings;
        Box::pin(async {
            Err(EngineError::new(
                EngineErrorKind::InvalidRequest,
                "this engine has no speculative decoding",
            ))
        })
    }

    /// The length of the vectors of embedding requests ([`GenerateRequest::embed`]): the
    /// model's hidden size; `None` when the engine computes no embeddings (`/v1/embeddings`
    /// then answers that it is not served).
    fn embedding_size(&self) -> Option<usize> {
        None
    }

    /// The LoRA adapters requests may name as `model`, in registration order. An engine
    /// without LoRA support has none.
    fn lora_adapters(&self) -> Vec<LoraAdapterInfo> {
        Vec::new()
    }

    /// The names of the LoRA adapters an engine that serves adapters from directories on
    /// demand (`lora.adapter_dirs`) would find there now, registered or not, without loading
    /// any; the model list shows them beside [`Self::lora_adapters`]. None by default.
    fn lora_adapters_in_directories(&self) -> EngineFuture<Vec<String>> {
        Box::pin(async { Ok(Vec::new()) })
    }

    /// Whether requests may name the LoRA adapter `name` (checked per request: an engine
    /// should answer without copying its registry).
    fn has_lora_adapter(&self, name: &str) -> bool {
        self.lora_adapters().iter().any(|a| a.name == name)
    }

    /// Whether requests may name the LoRA adapter `name`: registered, or, for an engine that
    /// serves adapters from directories on demand (`lora.adapter_dirs`), held by one of them
    /// now (the request that follows loads it). `false`: there is no such adapter.
    fn find_lora_adapter(&self, name: String) -> EngineFuture<bool> {
        let found = self.has_lora_adapter(&name);
        Box::pin(async move { Ok(found) })
    }

    /// Loads a LoRA adapter from a directory on the server and serves it under `name`. A bad
    /// name or file is an [`EngineErrorKind::InvalidRequest`]. A name already served is refused
    /// unless `in_place` (vLLM's `load_inplace`): then the new adapter is loaded first and takes
    /// the name's place at once (a bad file leaves the old one served; requests running keep
    /// the old weights).
    fn load_lora(
        &self,
        name: String,
        path: String,
        in_place: bool,
        pinned: bool,
    ) -> EngineFuture<LoraAdapterInfo> {
        let _ = (name, path, in_place, pinned);
        Box::pin(async { Err(lora_disabled()) })
    }

    /// Stops serving a LoRA adapter (requests already using it finish with it); an unknown
    /// name is an [`EngineErrorKind::NotFound`].
    fn unload_lora(&self, name: String) -> EngineFuture<()> {
        let _ = name;
        Box::pin(async { Err(lora_disabled()) })
    }
}

/// The error of the LoRA methods of an engine without LoRA support.
fn lora_disabled() -> EngineError {
    EngineError::new(
        EngineErrorKind::InvalidRequest,
        "LoRA adapters are not enabled on this server",
    )
}

/// A LoRA adapter the engine serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LoraAdapterInfo {
    /// The name requests use as `model`.
    pub name: String,
    /// Its directory on the server (shown to admins only).
    pub path: String,
    /// Its rank.
    pub rank: usize,
    /// Found in one of `lora.adapter_dirs` on a request (rather than registered by the
    /// configuration or an admin).
    pub discovered: bool,
    /// Kept in memory while served, never evicted.
    pub pinned: bool,
    /// The model it was trained on, as its `adapter_config.json` names it
    /// (`base_model_name_or_path`; `null` when it names none).
    pub base_model: Option<String>,
    /// `base_model` names another model than the one served (by none of its names): served
    /// all the same, its shapes fitting, with a warning in the log.
    pub base_model_differs: bool,
}

/// Shared by the prompts of one HTTP request. When one of them fails, the HTTP layer records
/// the failure's kind here before it drops the others' receivers: they end because of that
/// failure, not because the client left, and an engine counts them as failed, not aborted.
#[derive(Debug, Clone, Default)]
pub struct SiblingFailure(Arc<OnceLock<EngineErrorKind>>);

impl SiblingFailure {
    /// Records why the request failed (the first failure stays).
    pub fn set(&self, kind: EngineErrorKind) {
        let _ = self.0.set(kind);
    }

    /// The failure recorded, if any.
    pub fn get(&self) -> Option<EngineErrorKind> {
        self.0.get().copied()
    }
}

/// Requests compare equal whatever their cells hold (the cell is shared state, not content).
impl PartialEq for SiblingFailure {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// One generation request, validated and bounded by the HTTP layer.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    /// The OpenAI response id (`cmpl-…`, `chatcmpl-…`, plus `-<prompt>` for multi-prompt
    /// requests), for logs. Random unless the client sent `X-Request-Id`, so it is not
    /// guaranteed unique: the engine keys requests by ids of its own.
    pub request_id: String,
    /// What to continue: text, token ids or chat messages.
    pub prompt: PromptInput,
    /// Sampler settings.
    pub sampling: SamplingOptions,
    /// Stop strings (at most [`crate::schema::MAX_STOP_STRINGS`]); matched text is not returned
    /// unless `include_stop_str_in_output`.
    pub stop: Vec<String>,
    /// Keep a matched stop string, or the text of the stop token or end-of-sequence token that
    /// ended a choice, in its text (vLLM's `include_stop_str_in_output`).
    pub include_stop_str_in_output: bool,
    /// Leave special tokens' text out (vLLM's `skip_special_tokens`, default true).
    pub skip_special_tokens: bool,
    /// Special tokens whose text is kept all the same: the tool-call markers, where the
    /// tokenizer has them as special tokens (Mistral's `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`).
    pub keep_special_tokens: crate::schema::tools::KeptTokens,
    /// Number of choices to generate from the one prompt (1 ..= [`crate::schema::MAX_N`]).
    pub n: u32,
    /// Completion length limit; `None` means up to the context window.
    pub max_tokens: Option<u32>,
    /// `max_tokens` is the endpoint's default (completions' 16), not the client's: the engine
    /// cuts it to the room the prompt leaves rather than refusing the request.
    pub max_tokens_defaulted: bool,
    /// Number of top alternatives to report per sampled token; `None` means no logprobs.
    pub logprobs: Option<u32>,
    /// Whether [`EngineEvent::Prompt`] must carry the prompt's logprobs, with this many
    /// alternatives per token (completions' `echo` together with `logprobs`, vLLM's
    /// `prompt_logprobs`: the larger of the two).
    pub prompt_logprobs: Option<u32>,
    /// Scheduling priority as vLLM defines it: lower values are served first; `None`: the
    /// request set none (its tier's applies, else 0).
    pub priority: Option<i32>,
    /// Service tier (from the API key), for SLO-aware and fair-share policies.
    pub tier: String,
    /// Tenant (from the API key), for fair share and prefix-cache isolation.
    pub tenant: String,
    /// The LoRA adapter to run with (a name from [`Engine::lora_adapters`]); `None` for the
    /// base model.
    pub lora: Option<String>,
    /// What the generated text must follow; `None` for free text.
    pub structured: Option<StructuredOutputSpec>,
    /// vLLM's `cache_salt`: cached prefixes are shared only among requests with the same
    /// salt (and, as the server is configured, the same tenant).
    pub cache_salt: Option<String>,
    /// Shared by the prompts of one HTTP request (set by the HTTP layer): see
    /// [`SiblingFailure`].
    pub sibling_failure: SiblingFailure,
    /// Compute the prompt's embedding instead of generating (`/v1/embeddings`): the engine
    /// runs the prompt, sends [`EngineEvent::Prompt`] and then one [`Delta`] for choice 0 with
    /// `finish` set, no text, no tokens, `completion_tokens` 0 and [`Delta::embedding`] holding
    /// the vector. The HTTP layer sends such a request with `n` 1, greedy sampling, no
    /// logprobs, stop conditions or structured output.
    pub embed: bool,
    /// vLLM's beam search instead of sampling: `n` is the number of beams (at most
    /// [`crate::schema::MAX_BEAM_WIDTH`]), the engine sends [`EngineEvent::Prompt`] when the
    /// search starts and each choice's one delta, a whole answer with `finish` set, when it
    /// ends, best answer first. The HTTP layer sends it without stop strings, structured
    /// output or prompt logprobs, and with no sampling settings but `temperature`, `seed`
    /// and the end tokens' (`ignore_eos`, `stop_token_ids`, `min_tokens`).
    pub beam_search: Option<BeamSearch>,
}

/// vLLM's beam search settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BeamSearch {
    /// A beam ranks by its cumulative logprob over `(prompt + generated) ^ length_penalty`
    /// (vLLM's score; default 1.0, finite, at most [`crate::schema::MAX_LENGTH_PENALTY`] in
    /// magnitude).
    pub length_penalty: f32,
}

/// The `param` an engine names when it refuses a request's [`StructuredOutputSpec`] (it does
/// not compile, or no output satisfies it): vLLM's field for structured output. The engine
/// cannot tell which of the request's fields carried the specification; the HTTP layer
/// replaces it with that field.
pub const STRUCTURED_OUTPUT_PARAM: &str = "structured_outputs";

/// A structure the output must follow (structured output).
#[derive(Debug, Clone, PartialEq)]
pub enum StructuredOutputSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this JSON Schema.
    JsonSchema(serde_json::Value),
    /// Text matching this regular expression.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Grammar(String),
    /// Tool calls (or text, with `tool_choice: auto`): a grammar in llguidance's Lark dialect
    /// built by [`crate::schema::tools::ToolUse::grammar`].
    ToolCalls(String),
}

/// The input a generation continues from.
#[derive(Debug, Clone, PartialEq)]
pub enum PromptInput {
    /// Raw text, tokenized with the model's special tokens added.
    Text(String),
    /// Pre-tokenized input, used as is.
    Tokens(Vec<u32>),
    /// Chat messages, rendered through the model's chat template.
    Chat {
        /// The conversation.
        messages: Vec<ChatMessage>,
        /// More variables for the template (`chat_template_kwargs`, such as Qwen3's
        /// `enable_thinking`).
        template_kwargs: TemplateKwargs,
        /// The names of `template_kwargs` the client set (`chat_template_kwargs`; the server
        /// sets `tools`): a template error they cause names that field.
        client_kwargs: Vec<String>,
        /// How the rendering ends (vLLM's `add_generation_prompt` and
        /// `continue_final_message`).
        ending: ChatEnding,
    },
}

/// How a rendered conversation ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ChatEnding {
    /// The template's generation prompt opens the model's answer (the default).
    #[default]
    GenerationPrompt,
    /// The last message ends as the template ends a message; no generation prompt
    /// (`add_generation_prompt: false`).
    Closed,
    /// The last message is left open and the model continues it
    /// (`continue_final_message: true`).
    ContinueFinal,
}

/// Variables a request adds to the chat template's context (checked: bounded, and none of the
/// names the server sets itself).
pub type TemplateKwargs = serde_json::Map<String, serde_json::Value>;

/// One chat message: its text and, where the chat template writes tool calls and results
/// itself, those fields as the template reads them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// Who wrote the message.
    pub role: ChatRole,
    /// The message text (text parts of a multi-part message are joined with newlines).
    pub content: String,
    /// An assistant message's calls, in OpenAI's shape with each call's `arguments` an object
    /// (as vLLM and Hugging Face hand them to a template), or a string where the client's
    /// text is no JSON object (a call cut short): the template writes that as it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The author's name, as the client gave it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Byte ranges of `content` the server wrote itself, in order: the markers of the tool
    /// prompt and tool results it writes where the chat template does not (Mistral's
    /// `[AVAILABLE_TOOLS]`, `[TOOL_RESULTS]`), whose added tokens stay tokens where the
    /// client's are text (`model.message_special_tokens: text`).
    #[serde(skip)]
    pub server_text: Vec<std::ops::Range<usize>>,
}

impl ChatMessage {
    /// A message of text only.
    pub fn text(role: ChatRole, content: impl Into<String>) -> Self {
        ChatMessage {
            role,
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
            server_text: Vec::new(),
        }
    }

    /// Appends `text`, of which the byte ranges `server` are the server's own
    /// ([`ChatMessage::server_text`]).
    pub fn push_marked(&mut self, text: &str, server: &[std::ops::Range<usize>]) {
        let at = self.content.len();
        self.content.push_str(text);
        self.server_text
            .extend(server.iter().map(|r| r.start + at..r.end + at));
    }

    /// Puts `text` at the head of the content, of which the byte ranges `server` are the
    /// server's own ([`ChatMessage::server_text`]).
    pub fn prepend_marked(&mut self, text: &str, server: &[std::ops::Range<usize>]) {
        self.content.insert_str(0, text);
        let by = text.len();
        let shifted = self.server_text.iter().map(|r| r.start + by..r.end + by);
        self.server_text = server.iter().cloned().chain(shifted).collect();
    }
}

/// The author of a chat message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ChatRole {
    /// Instructions (OpenAI's `system`).
    System,
    /// Instructions (OpenAI's newer `developer`); templates usually treat it as `system`.
    Developer,
    /// The end user.
    User,
    /// The model.
    Assistant,
    /// A tool's result (Llama 3's templates render it as the `ipython` turn).
    Tool,
}

impl ChatRole {
    /// The role's name as chat templates expect it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::Developer => "developer",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

/// Sampler settings, all validated against OpenAI's and vLLM's ranges.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingOptions {
    /// Softmax temperature in [0, 2]; 0 means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: u32,
    /// Drop tokens whose probability is below `min_p` times the top token's; 0 disables.
    pub min_p: f32,
    /// OpenAI presence penalty in [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty in [-2, 2].
    pub frequency_penalty: f32,
    /// Multiplicative repetition penalty (> 0); 1 disables.
    pub repetition_penalty: f32,
    /// Seed for reproducible sampling; `None` draws one.
    pub seed: Option<u64>,
    /// Additive biases in [-100, 100] per token id (at most [`crate::schema::MAX_LOGIT_BIAS`]).
    pub logit_bias: Vec<(u32, f32)>,
    /// Token ids that end a choice (besides EOS), at most [`crate::schema::MAX_STOP_TOKEN_IDS`].
    pub stop_token_ids: Vec<u32>,
    /// EOS and stop tokens are not allowed before this many tokens were generated.
    pub min_tokens: u32,
    /// Keep generating past EOS (benchmarking).
    pub ignore_eos: bool,
    /// vLLM's `allowed_token_ids`: only these tokens may be sampled (non-empty, at most
    /// [`crate::schema::MAX_ALLOWED_TOKEN_IDS`]; the engine refuses ids outside the vocabulary
    /// with a 400 naming the field). End-of-sequence tokens are not added, as in vLLM.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's `bad_words` (at most [`crate::schema::MAX_BAD_WORDS`] of 1 to
    /// [`crate::schema::MAX_BAD_WORD_BYTES`] bytes, each with a non-space character): the
    /// engine tokenizes each as vLLM does and bans, at each step, the last token of a word
    /// whose other tokens end the output so far.
    pub bad_words: Vec<String>,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            logit_bias: Vec::new(),
            stop_token_ids: Vec::new(),
            min_tokens: 0,
            ignore_eos: false,
            allowed_token_ids: None,
            bad_words: Vec::new(),
        }
    }
}

/// What the engine reports about a request, in the order the module docs describe.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// The request was accepted: its prompt length and, if asked, the prompt's logprobs.
    Prompt {
        /// Number of prompt tokens (after the chat template).
        prompt_tokens: u32,
        /// The chat prompt ends inside a `<think>` block its template opened (QwQ and
        /// DeepSeek-R1 always; hybrid templates as their variables say): the output starts as
        /// reasoning.
        opens_thinking: bool,
        /// One entry per prompt token when `prompt_logprobs` was asked (the first has no
        /// logprob).
        prompt_logprobs: Option<Vec<TokenLogprob>>,
    },
    /// New output for one choice.
    Delta(Delta),
    /// The request failed; nothing follows.
    Error(EngineError),
}

/// New output for one choice since its previous delta.
#[derive(Debug, Clone, PartialEq)]
pub struct Delta {
    /// The choice, `0 .. n`.
    pub index: u32,
    /// Newly released text (never splits a UTF-8 character, never contains a stop string).
    pub text: String,
    /// The tokens sampled since the previous delta.
    pub token_ids: Vec<u32>,
    /// One entry per token in `token_ids` when logprobs were asked, else empty.
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the choice's last delta.
    pub finish: Option<Finish>,
    /// Prompt tokens whose KV the prefix cache served when the choice was first admitted
    /// (whole blocks, never the prompt's last token; 0 without prefix caching; a recompute
    /// after a preemption does not change it). Every delta carries it.
    pub cached_prompt_tokens: u32,
    /// An embedding request's vector ([`GenerateRequest::embed`]), on its one delta: the
    /// final hidden state (after the model's last normalization) at the prompt's last token,
    /// [`Engine::embedding_size`] values, not normalized. `None` on every other delta.
    pub embedding: Option<Vec<f32>>,
}

/// How and when a choice ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Finish {
    /// Why it ended.
    pub reason: FinishReason,
    /// Total tokens generated for this choice.
    pub completion_tokens: u32,
}

/// Why a choice ended; also the bounded `finished_reason` metric label. A request the engine
/// gives up on (shutdown, relegation) ends with an [`EngineEvent::Error`] instead, since OpenAI
/// clients know no other finish reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// EOS, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context window was reached.
    Length,
}

impl FinishReason {
    /// The name used on the wire and as metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// The log probability of one token and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token's id.
    pub token_id: u32,
    /// The token's text (lossy for byte-fallback tokens).
    pub token: String,
    /// The token's bytes (part of a character for some byte-level tokens).
    pub bytes: Vec<u8>,
    /// Its log probability; `None` for the first prompt token, which has no context.
    pub logprob: Option<f32>,
    /// Its rank among the vocabulary at its position, as vLLM counts it (the tokens whose
    /// logprob is at least its own; 1 = the most likely): prompt tokens past the first only.
    pub rank: Option<u32>,
    /// The most likely alternatives, best first (at most the requested number).
    pub top: Vec<TopLogprob>,
}

/// One alternative token at a position.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    /// The token's id.
    pub token_id: u32,
    /// The token's text (lossy for byte-fallback tokens).
    pub token: String,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Its log probability.
    pub logprob: f32,
}

/// Input for [`Engine::tokenize`].
#[derive(Debug, Clone, PartialEq)]
pub enum TokenizeInput {
    /// Plain text.
    Text {
        /// The text.
        text: String,
        /// Whether to add the tokenizer's special tokens (BOS).
        add_special_tokens: bool,
    },
    /// Chat messages through the chat template.
    Chat {
        /// The messages.
        messages: Vec<ChatMessage>,
        /// How the rendering ends.
        ending: ChatEnding,
        /// More variables for the template.
        template_kwargs: TemplateKwargs,
        /// The names of `template_kwargs` the client set (`chat_template_kwargs`).
        client_kwargs: Vec<String>,
    },
}

/// A policy to switch to: a registered name and its YAML/JSON parameters (`PUT
/// /admin/policy`). Unknown fields are refused: a misspelt `params` would otherwise swap in
/// the policy's defaults without a word. `GET /admin/policy`'s `available` is accepted and
/// ignored, so that a body read, edited and sent back works.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "PolicySpecFields")]
pub struct PolicySpec {
    /// Registered policy name, e.g. `fcfs`, `priority`, `slo-aware`.
    pub name: String,
    /// Policy parameters; `{}` means the policy's defaults.
    pub params: serde_json::Value,
}

/// The fields a [`PolicySpec`] is read from.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PolicySpecFields {
    name: String,
    #[serde(default = "empty_params")]
    params: serde_json::Value,
    /// `GET /admin/policy`'s list of policies, sent back as it was read.
    #[serde(default, rename = "available")]
    _available: Option<serde::de::IgnoredAny>,
}

impl From<PolicySpecFields> for PolicySpec {
    fn from(f: PolicySpecFields) -> Self {
        Self {
            name: f.name,
            params: f.params,
        }
    }
}

fn empty_params() -> serde_json::Value {
    serde_json::Value::Object(serde_json::Map::new())
}

/// The scheduling policy in force.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicyInfo {
    /// Registered policy name.
    pub name: String,
    /// Its effective parameters (defaults filled in).
    pub params: serde_json::Value,
    /// Policies the engine can swap to.
    pub available: Vec<String>,
}

/// The answer to a policy swap: the policy in force and whether the swap changed it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PolicySwap {
    /// The policy in force after the request.
    #[serde(flatten)]
    pub policy: PolicyInfo,
    /// False when the request named the policy already in force, with the same parameters:
    /// nothing was swapped (nor counted, nor its state reset).
    pub changed: bool,
}

/// Most running sequences `max_running` may name, as in the `speculative:` section of the
/// configuration.
pub const MAX_SPECULATIVE_RUNNING: usize = 65536;

/// Most draft tokens `num_speculative_tokens` may name, as in the configuration.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;

/// Longest suffix `prompt_lookup_min` and `prompt_lookup_max` may name, as in the
/// configuration.
pub const MAX_PROMPT_LOOKUP: usize = 32;

/// How draft tokens are proposed (the `speculative.method` values the configuration accepts).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SpeculativeMethod {
    /// Prompt lookup: the tokens that followed an earlier occurrence of the sequence's last
    /// few tokens.
    #[default]
    Ngram,
}

/// Speculative decoding settings (`PUT /admin/speculative`; the `speculative:` section of the
/// configuration, whose fields and bounds they share).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeSettings {
    /// How drafts are proposed.
    #[serde(default)]
    pub method: SpeculativeMethod,
    /// Most draft tokens per sequence and step (1 to [`MAX_SPECULATIVE_TOKENS`]).
    pub num_speculative_tokens: usize,
    /// Shortest suffix that must match an earlier position (1 to `prompt_lookup_max`).
    #[serde(default = "lookup_min")]
    pub prompt_lookup_min: usize,
    /// Longest suffix matched (1 to [`MAX_PROMPT_LOOKUP`]).
    #[serde(default = "lookup_max")]
    pub prompt_lookup_max: usize,
    /// No drafts while more sequences than this run (0: no limit; at most
    /// [`MAX_SPECULATIVE_RUNNING`]).
    #[serde(default)]
    pub max_running: usize,
}

/// `prompt_lookup_min` when it is not given.
pub const DEFAULT_PROMPT_LOOKUP_MIN: usize = 2;

/// `prompt_lookup_max` when it is not given.
pub const DEFAULT_PROMPT_LOOKUP_MAX: usize = 4;

fn lookup_min() -> usize {
    DEFAULT_PROMPT_LOOKUP_MIN
}

fn lookup_max() -> usize {
    DEFAULT_PROMPT_LOOKUP_MAX
}

/// Why the engine refused or failed a request. The HTTP layer maps [`EngineErrorKind`] to a
/// status in one place (`crate::error`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct EngineError {
    /// The class of failure.
    pub kind: EngineErrorKind,
    /// Human-readable explanation, shown to the client.
    pub message: String,
    /// The request field at fault, if any (OpenAI's `param`).
    pub param: Option<String>,
}

impl EngineError {
    /// An error without a `param`.
    pub fn new(kind: EngineErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
        }
    }

    /// Names the request field at fault.
    #[must_use]
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }
}

/// A backend call that has run past the engine's limit on one call ([`Engine::stall`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineStall {
    /// The backend call under way (`execute`, `collect`, ...).
    pub call: &'static str,
    /// How long it has run.
    pub running: std::time::Duration,
    /// The limit it is past (`scheduler.step_timeout_s`).
    pub limit: std::time::Duration,
}

impl fmt::Display for EngineStall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "The engine is stalled: its backend's `{}` call has run for {} s, past \
             scheduler.step_timeout_s = {} (a GPU or driver hang?). Requests in flight wait for \
             it; the server serves again if it returns, else restart the server.",
            self.call,
            self.running.as_secs(),
            self.limit.as_secs()
        )
    }
}

/// Classes of engine failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineErrorKind {
    /// The request is invalid for this model (token id out of vocabulary, bad policy params…).
    InvalidRequest,
    /// Prompt plus `max_tokens` exceed the context window.
    ContextLengthExceeded,
    /// The queue is full; the client should retry after the given number of seconds.
    Overloaded {
        /// Suggested wait before retrying, in seconds.
        retry_after_secs: u32,
    },
    /// The request has more choices (prompts × `n`) than a bound on requests in flight
    /// (`server.max_pending_requests`, `tiers.<name>.max_pending_requests`) ever admits:
    /// retrying cannot help, so it is a client error, not [`Self::Overloaded`].
    TooManyChoices,
    /// The request waited in the queue past its bound (`tiers.<name>.max_queue_ms`,
    /// `scheduler.max_queue_ms`) without being admitted (a 503 to retry later).
    QueueTimeout,
    /// Its tenant has as many requests in flight as its tier lets one tenant have
    /// (`tiers.<name>.max_pending_per_tenant`): a 429 to retry when one of them ends.
    TenantBusy,
    /// The engine is not ready or is shutting down.
    Unavailable,
    /// The request names a model (LoRA adapter) the server does not serve.
    NotFound,
    /// The structured-output grammar of a choice failed while generating, other than past
    /// llguidance's parser limits (the request's own error, [`Self::InvalidRequest`] naming
    /// its field): the output cannot complete it. A server error as [`Self::Internal`] is, but
    /// a kind of its own, so that the request's other prompts, ended because of it, are
    /// counted with its reason.
    StructuredOutput,
    /// A bug or a backend failure; the message is logged, the client gets a generic one.
    Internal,
}

impl fmt::Display for EngineErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self {
            Self::InvalidRequest => "invalid_request",
            Self::ContextLengthExceeded => "context_length_exceeded",
            Self::Overloaded { .. } => "overloaded",
            Self::TooManyChoices => "too_many_choices",
            Self::QueueTimeout => "queue_timeout",
            Self::TenantBusy => "tenant_busy",
            Self::Unavailable => "unavailable",
            Self::NotFound => "not_found",
            Self::StructuredOutput => "structured_output",
            Self::Internal => "internal",
        };
        f.write_str(name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_spec_defaults_params_to_empty_object() {
        let spec: PolicySpec = serde_json::from_str(r#"{"name":"fcfs"}"#).unwrap();
        assert_eq!(spec.params, serde_json::json!({}));
    }

    #[test]
    fn policy_spec_refuses_unknown_fields() {
        // `param` for `params` once swapped in the policy's defaults without a word.
        let e = serde_json::from_str::<PolicySpec>(r#"{"name":"fcfs","param":{"x":1}}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field `param`"), "{e}");
        // What GET /admin/policy answers can be sent back.
        let spec: PolicySpec = serde_json::from_str(
            r#"{"name":"priority","params":{"aging_interval_ms":50},"available":["fcfs"]}"#,
        )
        .expect("a GET body");
        assert_eq!(
            (spec.name.as_str(), &spec.params),
            ("priority", &serde_json::json!({"aging_interval_ms": 50}))
        );
    }

    #[test]
    fn engine_error_displays_its_message_and_keeps_param() {
        let e = EngineError::new(EngineErrorKind::InvalidRequest, "token 99 out of range")
            .with_param("logit_bias");
        assert_eq!(e.to_string(), "token 99 out of range");
        assert_eq!(e.param.as_deref(), Some("logit_bias"));
    }

    #[test]
    fn finish_reasons_match_the_wire_names() {
        for r in [FinishReason::Stop, FinishReason::Length] {
            let wire = serde_json::to_value(r).unwrap();
            assert_eq!(wire, serde_json::Value::String(r.as_str().to_owned()));
        }
    }
}
