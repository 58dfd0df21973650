//! OpenAI wire types: request bodies with their validation, response bodies and stream chunks.

pub mod best_of;
mod chat_extras;
pub mod embeddings;
mod finite;
mod held;
mod ignored;
pub mod reasoning;
mod request;
mod response;
pub mod responses;
mod sampling;
mod strict;
mod structured;
pub mod tools;
pub mod truncation;

pub use chat_extras::ChatExtras;
pub use ignored::IgnoredFields;
pub use request::{
    chat_ending, check_continued, offer_tools, parse_messages, parse_template_kwargs, ChatRequest,
    CompletionRequest, ContentField, ContentPart, MessageField, PromptField, StopField,
    StreamOptions, Validated,
};
pub use response::*;
pub use sampling::SamplerFields;
pub use structured::{Structured, StructuredFields};

pub use limits::*;

/// Bounds on every count a request can carry.
pub mod limits {
    /// Completion length limit of a `/v1/completions` request without `max_tokens` (at most
    /// the context length), as in OpenAI's legacy completions API and vLLM's
    /// `CompletionRequest`. Chat completions without a limit generate up to the context
    /// window, as theirs do.
    pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;
    /// Most choices per prompt (`n`).
    pub const MAX_N: u32 = 16;
    /// Most prompts in one completions request.
    pub const MAX_PROMPTS: usize = 32;
    /// Most inputs in one `/v1/embeddings` request: OpenAI's limit. Each is one engine
    /// request, so the engine's bounds on requests in flight apply too.
    pub const MAX_EMBEDDING_INPUTS: usize = 2048;
    /// Most choices in one request (prompts × n).
    pub const MAX_CHOICES: usize = 64;
    /// Longest `cache_salt`.
    pub const MAX_CACHE_SALT_BYTES: usize = 256;
    /// Most chat messages in one request.
    pub const MAX_MESSAGES: usize = 1024;
    /// Most `chat_template_kwargs` entries.
    pub const MAX_TEMPLATE_KWARGS: usize = 64;
    /// Longest `chat_template_kwargs` name, in bytes.
    pub const MAX_TEMPLATE_KWARG_NAME: usize = 64;
    /// Most stop strings.
    pub const MAX_STOP_STRINGS: usize = 4;
    /// Longest stop string in bytes.
    pub const MAX_STOP_STRING_BYTES: usize = 256;
    /// Most stop token ids.
    pub const MAX_STOP_TOKEN_IDS: usize = 64;
    /// Most `logit_bias` entries.
    pub const MAX_LOGIT_BIAS: usize = 300;
    /// Most `allowed_token_ids` (vLLM sets no bound; this is more than a 64k vocabulary).
    pub const MAX_ALLOWED_TOKEN_IDS: usize = 65_536;
    /// Most `bad_words`.
    pub const MAX_BAD_WORDS: usize = 128;
    /// Longest bad word, in bytes.
    pub const MAX_BAD_WORD_BYTES: usize = 256;
    /// Most alternatives per token (`logprobs`, `top_logprobs`).
    pub const MAX_LOGPROBS: u32 = 20;
    /// Beams of a beam search (`n` with `use_beam_search`): each step asks for `2 × n`
    /// alternatives per beam, which the sampler bounds at [`MAX_LOGPROBS`].
    pub const MAX_BEAM_WIDTH: u32 = MAX_LOGPROBS / 2;
    /// `length_penalty`'s magnitude.
    pub const MAX_LENGTH_PENALTY: f32 = 100.0;
    /// Most prompt-logprob entries per prompt position of a `/v1/completions` request with both
    /// `echo` and `logprobs`: prompts × n × (logprobs + 1) must not exceed it. Each choice
    /// echoes its prompt's logprobs, `logprobs + 1` entries per prompt token, and prompt token
    /// counts are only known after tokenization, but no prompt is longer than the context
    /// length, so a response carries at most this many times the context length of them (and
    /// the engine computes at most this many prompts' worth of logits). It is what one prompt
    /// with one choice and [`MAX_LOGPROBS`] needs, so scoring one prompt always fits; many
    /// prompts or choices must ask for fewer alternatives.
    pub const MAX_ECHO_LOGPROB_ENTRIES: usize = MAX_LOGPROBS as usize + 1;
    /// Most logprob entries of generated tokens in one non-streaming response: choices ×
    /// the completion length limit × (alternatives + 1) must not exceed it. A non-streaming
    /// body is held whole in memory and written at once (about 70 bytes of JSON an entry, so
    /// this is some 18 MB); a streamed one is written as it goes and is not bounded. Without
    /// a limit (chat without `max_tokens`) the answer may take the room the shortest prompt
    /// leaves, the context length less one. It lets one choice with every alternative
    /// ([`MAX_LOGPROBS`]) run to an 8k context, or with one alternative to a 128k context.
    pub const MAX_GENERATED_LOGPROB_ENTRIES: usize = 1 << 18;
    /// Most token ids accepted by `/detokenize`.
    pub const MAX_DETOKENIZE_TOKENS: usize = 1 << 20;
    /// Most bytes of a structured-output schema, regex, grammar or choice list.
    pub const MAX_STRUCTURED_BYTES: usize = 64 * 1024;
    /// Most alternatives of a structured-output choice.
    pub const MAX_STRUCTURED_CHOICES: usize = 1024;
}
