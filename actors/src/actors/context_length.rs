//! The words of a context-length refusal (`SubmitErrorKind::ContextLengthExceeded`), one
//! wording wherever a request is found too long: vLLM's, which users compare with. A prompt
//! must leave room for at least one generated token (as vLLM checks it), so a prompt of the
//! context's length is refused. The API's own checks (a token-id prompt, a `max_tokens` no
//! prompt leaves room for) write the same words (`switchyard-api`, `schema/request.rs`).

/// What bounds one sequence: the model's context, or the KV cache where it holds less.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SequenceLimit {
    /// The model's context length, in tokens.
    max_model_len: usize,
    /// The most tokens the KV cache holds of one sequence.
    kv_tokens: usize,
    /// The most tokens the request's tier's KV quota (`max_kv_fraction`) holds of one
    /// sequence (`usize::MAX`: no quota).
    tier_kv_tokens: usize,
}

impl SequenceLimit {
    /// The limit of a model whose context is `max_model_len` tokens and whose KV cache holds
    /// `kv_tokens` of one sequence.
    pub(crate) fn new(max_model_len: usize, kv_tokens: usize) -> Self {
        SequenceLimit {
            max_model_len,
            kv_tokens,
            tier_kv_tokens: usize::MAX,
        }
    }

    /// This limit, with the request's tier's KV quota holding `tier_kv_tokens` of one sequence.
    pub(crate) fn with_tier_kv(self, tier_kv_tokens: usize) -> Self {
        SequenceLimit {
            tier_kv_tokens,
            ..self
        }
    }

    /// The limit of the context alone.
    pub(crate) fn context(max_model_len: usize) -> Self {
        Self::new(max_model_len, usize::MAX)
    }

    /// The most tokens one sequence (prompt and output) may hold.
    pub(crate) fn tokens(self) -> usize {
        self.max_model_len
            .min(self.kv_tokens)
            .min(self.tier_kv_tokens)
    }

    /// What bounds a sequence, as a sentence's beginning.
    fn bound(self) -> String {
        let context = format!(
            "This model's maximum context length is {} tokens",
            self.max_model_len
        );
        if self.tier_kv_tokens < self.max_model_len.min(self.kv_tokens) {
            format!(
                "{context}, but this request's tier may hold at most {} tokens of one sequence \
                 in the KV cache (its max_kv_fraction)",
                self.tier_kv_tokens
            )
        } else if self.kv_tokens < self.max_model_len {
            format!(
                "{context}, but this server's KV cache holds at most {} tokens of one sequence",
                self.kv_tokens
            )
        } else {
            context
        }
    }

    /// A prompt of `prompt_len` tokens leaves no room for a generated token.
    pub(crate) fn prompt_too_long(self, prompt_len: usize) -> String {
        format!(
            "{}. However, your request has {prompt_len} input tokens, which leaves no room \
             for an output token (a prompt may have at most {} tokens). Please reduce the \
             length of the input.",
            self.bound(),
            self.tokens().saturating_sub(1)
        )
    }

    /// An input to embed of `input_len` tokens is too long (the engine runs it as a sequence
    /// with room for one more token, as a prompt).
    pub(crate) fn input_too_long(self, input_len: usize) -> String {
        format!(
            "{}. However, your request has an input of {input_len} tokens (an input to embed \
             may have at most {} tokens). Please reduce the length of the input.",
            self.bound(),
            self.tokens().saturating_sub(1)
        )
    }

    /// `max_tokens` asks for more than a prompt of `prompt_len` tokens leaves room for.
    pub(crate) fn max_tokens_too_large(self, prompt_len: usize, max_tokens: usize) -> String {
        format!(
            "'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. {} and your \
             request has {prompt_len} input tokens ({max_tokens} > {} - {prompt_len}).",
            self.bound(),
            self.tokens()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words the API writes for the same cases (`switchyard-api`'s request checks and
    /// the end-to-end test that compares both).
    #[test]
    fn refusals_read_as_vllm_words_them() {
        let context = SequenceLimit::new(8192, 100_000);
        assert_eq!(context.tokens(), 8192);
        assert_eq!(
            context.prompt_too_long(8192),
            "This model's maximum context length is 8192 tokens. However, your request has \
             8192 input tokens, which leaves no room for an output token (a prompt may have at \
             most 8191 tokens). Please reduce the length of the input."
        );
        assert_eq!(
            context.max_tokens_too_large(8001, 500),
            "'max_tokens' or 'max_completion_tokens' is too large: 500. This model's maximum \
             context length is 8192 tokens and your request has 8001 input tokens (500 > 8192 \
             - 8001)."
        );
        assert_eq!(
            context.input_too_long(8192),
            "This model's maximum context length is 8192 tokens. However, your request has an \
             input of 8192 tokens (an input to embed may have at most 8191 tokens). Please \
             reduce the length of the input."
        );
        let cache = SequenceLimit::new(8192, 4096);
        assert_eq!(cache.tokens(), 4096);
        assert!(cache.prompt_too_long(5000).starts_with(
            "This model's maximum context length is 8192 tokens, but this server's KV cache \
             holds at most 4096 tokens of one sequence. However, your request has 5000 input \
             tokens"
        ));
        assert!(cache.prompt_too_long(5000).contains("at most 4095 tokens"));
        let tier = cache.with_tier_kv(1024);
        assert_eq!(tier.tokens(), 1024);
        assert!(tier.max_tokens_too_large(1000, 100).contains(
            "but this request's tier may hold at most 1024 tokens of one sequence in the KV \
             cache (its max_kv_fraction) and your request has 1000 input tokens (100 > 1024 - \
             1000)"
        ));
        assert_eq!(cache.with_tier_kv(5000).tokens(), 4096);
        assert_eq!(
            SequenceLimit::context(16),
            SequenceLimit::new(16, usize::MAX)
        );
    }
}
