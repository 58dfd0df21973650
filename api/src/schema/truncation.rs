//! vLLM's `truncate_prompt_tokens` (its `SamplingParams` and pooling requests' field): keep
//! only the last `k` tokens of a prompt, so that a prompt longer than the context is served
//! on its end rather than refused.
//!
//! The value is read as vLLM reads it: an integer `k` from 1 to the context length keeps the
//! last `k` tokens (vLLM truncates on the left), `null` (or absent) keeps them all, and `-1`
//! keeps as many as the context takes. vLLM's `-1` is the context length itself; every request
//! of this server needs room for one more token (a generated one, or the one an embedding
//! input runs as), so a prompt of the whole context would always be refused and `-1` keeps the
//! context length less one. Anything else, 0 included, is a 400 naming the field.
//!
//! A chat prompt is cut after its chat template is applied (vLLM's order): the kept tokens are
//! the end of the rendered conversation.

use crate::engine::{Engine, EngineError, PromptInput, TokenizeInput};
use crate::error::ApiError;

/// The request field.
pub const TRUNCATE_PROMPT_TOKENS: &str = "truncate_prompt_tokens";

/// The number of prompt tokens a request's `truncate_prompt_tokens` keeps (the last ones),
/// for a model of `max_model_len` tokens of context; `None` keeps them all.
pub fn parse_truncate_prompt_tokens(
    value: Option<i64>,
    max_model_len: usize,
) -> Result<Option<usize>, ApiError> {
    match value {
        None => Ok(None),
        Some(-1) => Ok(Some(max_model_len.saturating_sub(1).max(1))),
        Some(k) => usize::try_from(k)
            .ok()
            .filter(|&k| (1..=max_model_len).contains(&k))
            .map(Some)
            .ok_or_else(|| {
                ApiError::invalid(
                    TRUNCATE_PROMPT_TOKENS,
                    format!(
                        "truncate_prompt_tokens must be -1 (as many as the context takes) or \
                         from 1 to the context length {max_model_len}, got {k}"
                    ),
                )
            }),
    }
}

/// The last `keep` of `tokens` (all of them when there are no more).
pub fn keep_last(mut tokens: Vec<u32>, keep: usize) -> Vec<u32> {
    let cut = tokens.len().saturating_sub(keep);
    tokens.drain(..cut);
    tokens
}

/// Cuts every prompt of `prompts` to its last `keep` tokens. Token prompts are cut as they
/// are; a text or chat prompt is tokenized by the engine (a chat one through its template) and
/// replaced by its last `keep` tokens when it has more, else left as it is (so `echo` shows a
/// text prompt as sent, and a chat prompt keeps what the engine learns from its rendering,
/// such as an open reasoning block). `field`
/// is the request's prompt field, named by an error of the engine's tokenizer that names none.
pub(crate) async fn truncate_prompts(
    engine: &dyn Engine,
    prompts: &mut [PromptInput],
    keep: usize,
    field: &'static str,
) -> Result<(), ApiError> {
    for prompt in prompts.iter_mut() {
        let input = match prompt {
            PromptInput::Tokens(tokens) => {
                let taken = std::mem::take(tokens);
                *tokens = keep_last(taken, keep);
                continue;
            }
            PromptInput::Text(text) => TokenizeInput::Text {
                text: text.clone(),
                add_special_tokens: true,
            },
            PromptInput::Chat {
                messages,
                template_kwargs,
                client_kwargs,
                ending,
            } => TokenizeInput::Chat {
                messages: messages.clone(),
                ending: *ending,
                template_kwargs: template_kwargs.clone(),
                client_kwargs: client_kwargs.clone(),
            },
        };
        let tokens = engine
            .tokenize(input)
            .await
            .map_err(|e| name_prompt(e, field))?;
        if tokens.len() > keep {
            *prompt = PromptInput::Tokens(keep_last(tokens, keep));
        }
    }
    Ok(())
}

/// A tokenizer error naming the request's prompt field where it names none.
fn name_prompt(mut e: EngineError, field: &str) -> ApiError {
    if e.param.is_none() || e.param.as_deref() == Some("prompt") {
        e.param = Some(field.to_owned());
    }
    ApiError::Engine(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            _ => None,
        }
    }

    #[test]
    fn values_read_as_vllm_reads_them() {
        // Context of 100 tokens: -1 keeps what the context takes with room for one more.
        for (value, kept) in [
            (None, None),
            (Some(-1), Some(99)),
            (Some(1), Some(1)),
            (Some(42), Some(42)),
            (Some(100), Some(100)),
        ] {
            assert_eq!(
                parse_truncate_prompt_tokens(value, 100).unwrap(),
                kept,
                "{value:?}"
            );
        }
        for value in [0, -2, 101, i64::MIN, i64::MAX] {
            let e = parse_truncate_prompt_tokens(Some(value), 100).unwrap_err();
            assert_eq!(
                param_of(e).as_deref(),
                Some(TRUNCATE_PROMPT_TOKENS),
                "{value}"
            );
        }
    }

    fn completion(max_model_len: usize, json: serde_json::Value) -> crate::schema::Validated {
        let req: crate::schema::CompletionRequest = serde_json::from_value(json).unwrap();
        req.validate(max_model_len).unwrap()
    }

    /// A token prompt longer than the context is cut before its length is checked (without the
    /// field it is refused); a text prompt waits for the engine's tokenizer.
    #[test]
    fn a_token_prompt_is_cut_before_the_context_check() {
        let long: Vec<u32> = (1..=40).collect();
        let req: crate::schema::CompletionRequest =
            serde_json::from_value(serde_json::json!({"prompt": long})).unwrap();
        assert!(req.validate(32).is_err());
        let kept = completion(
            32,
            serde_json::json!({"prompt": long, "truncate_prompt_tokens": 5}),
        );
        assert_eq!(
            kept.prompts,
            vec![PromptInput::Tokens(vec![36, 37, 38, 39, 40])]
        );
        assert_eq!(kept.truncate_prompt_tokens, Some(5));
        let lists = completion(
            32,
            serde_json::json!({"prompt": [long, [7, 8]], "truncate_prompt_tokens": -1}),
        );
        assert_eq!(
            lists.prompts,
            vec![
                PromptInput::Tokens((10..=40).collect()),
                PromptInput::Tokens(vec![7, 8])
            ]
        );
        let text = completion(
            32,
            serde_json::json!({"prompt": "hello", "truncate_prompt_tokens": 3}),
        );
        assert_eq!(text.prompts, vec![PromptInput::Text("hello".into())]);
        assert_eq!(text.truncate_prompt_tokens, Some(3));
    }

    #[test]
    fn the_last_tokens_are_kept() {
        assert_eq!(keep_last(vec![1, 2, 3, 4, 5], 2), vec![4, 5]);
        assert_eq!(keep_last(vec![1, 2, 3], 3), vec![1, 2, 3]);
        assert_eq!(keep_last(vec![1, 2], 5), vec![1, 2]);
        assert_eq!(keep_last(vec![7], 1), vec![7]);
    }
}
