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

use crate::engine::{ChatMessage, ChatRole, Engine, EngineError, PromptInput, TokenizeInput};
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

/// How a chat prompt was fitted by [`drop_oldest_messages`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fitted {
    /// It fit as it was.
    Whole,
    /// This many of its oldest messages after the leading system ones were dropped.
    Dropped(usize),
    /// Even its last message did not fit: it was cut to its last tokens (vLLM's way).
    Cut,
}

/// Fits a chat prompt into `keep` tokens, as OpenAI's Responses `truncation: "auto"` does: its
/// oldest whole messages are dropped (never the leading system ones, `instructions` and a tool
/// prompt, and never the last), up to a user message: what is kept after the system ones
/// opens with a user turn where one is left, as templates that require alternating roles
/// (Gemma's, Mistral's) demand, and otherwise with no `tool` result whose call went. Whole
/// turns keep the template's structure valid, which a cut through a turn's tokens does not;
/// only when even the last message with the system ones is
/// longer than `keep` is the rendering cut to its last `keep` tokens, as
/// [`truncate_prompts`] does. The rendered prompt's length is found by the engine's tokenizer,
/// a binary search over the number dropped: O(log n) renderings of an n-message conversation.
/// A prompt that is not a chat is cut as [`truncate_prompts`] cuts it.
pub(crate) async fn drop_oldest_messages(
    engine: &dyn Engine,
    prompt: &mut PromptInput,
    keep: usize,
    field: &'static str,
) -> Result<Fitted, ApiError> {
    let PromptInput::Chat {
        messages,
        template_kwargs,
        client_kwargs,
        ending,
    } = prompt
    else {
        truncate_prompts(engine, std::slice::from_mut(prompt), keep, field).await?;
        return Ok(Fitted::Cut);
    };
    let render = |messages: Vec<ChatMessage>| TokenizeInput::Chat {
        messages,
        ending: *ending,
        template_kwargs: template_kwargs.clone(),
        client_kwargs: client_kwargs.clone(),
    };
    let length = |messages: Vec<ChatMessage>| async {
        engine
            .tokenize(render(messages))
            .await
            .map(|t| t.len())
            .map_err(|e| name_prompt(e, field))
    };
    if length(messages.clone()).await? <= keep {
        return Ok(Fitted::Whole);
    }
    let head = messages
        .iter()
        .take_while(|m| matches!(m.role, ChatRole::System | ChatRole::Developer))
        .count();
    let body = messages.len() - head;
    // The conversation without the first `dropped` messages after the head and up to the
    // next user message: templates that require the roles to alternate from a user turn
    // (Gemma's, Mistral's, Llama 2's) refuse a conversation opening with the assistant. With
    // no user message left, the last message is kept, and only tool results whose call went
    // are dropped before it. Dropping more never keeps more, so the search below can halve.
    let window = |dropped: usize| -> (usize, Vec<ChatMessage>) {
        let mut from = head + dropped;
        match messages
            .get(from..)
            .and_then(|rest| rest.iter().position(|m| m.role == ChatRole::User))
        {
            Some(k) => from += k,
            None => {
                while from + 1 < messages.len() && messages[from].role == ChatRole::Tool {
                    from += 1;
                }
            }
        }
        let kept = messages[..head]
            .iter()
            .chain(&messages[from..])
            .cloned()
            .collect();
        (from - head, kept)
    };
    // The fewest dropped that fit, between 1 and all but the last message.
    let (mut low, mut high) = (1, body.saturating_sub(1));
    let mut best = None;
    while low <= high && body > 1 {
        let mid = low + (high - low) / 2;
        let (dropped, kept) = window(mid);
        if length(kept.clone()).await? <= keep {
            best = Some((dropped, kept));
            high = mid - 1;
        } else {
            low = mid + 1;
        }
    }
    if let Some((dropped, kept)) = best {
        *messages = kept;
        return Ok(Fitted::Dropped(dropped));
    }
    let (_, last) = window(body.saturating_sub(1));
    let tokens = engine
        .tokenize(render(last))
        .await
        .map_err(|e| name_prompt(e, field))?;
    *prompt = PromptInput::Tokens(keep_last(tokens, keep));
    Ok(Fitted::Cut)
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

    /// An engine whose "template" renders each message as one token for its role then one
    /// per word (`u`ser, `a`ssistant, `s`ystem, `t`ool as the role's first letter's code), so
    /// that the tests can count; `strict`, it refuses a conversation whose first message after
    /// the system ones is not the user's, as Gemma's and Mistral's templates do.
    struct WordEngine {
        strict: bool,
    }

    impl Engine for WordEngine {
        fn model_name(&self) -> &str {
            "words"
        }
        fn max_model_len(&self) -> usize {
            100
        }
        fn is_ready(&self) -> bool {
            true
        }
        fn submit(
            &self,
            _: Vec<crate::engine::GenerateRequest>,
        ) -> Result<Vec<tokio::sync::mpsc::Receiver<crate::engine::EngineEvent>>, EngineError>
        {
            unreachable!("only tokenize is called")
        }
        fn tokenize(&self, input: TokenizeInput) -> crate::engine::EngineFuture<Vec<u32>> {
            let words = |text: &str| text.split_whitespace().map(|w| w.len() as u32).collect();
            if let TokenizeInput::Chat { messages, .. } = &input {
                let first = messages.iter().find(|m| m.role != ChatRole::System);
                if self.strict && first.is_some_and(|m| m.role != ChatRole::User) {
                    return Box::pin(async {
                        Err(EngineError::new(
                            crate::engine::EngineErrorKind::InvalidRequest,
                            "Conversation roles must alternate user/assistant/user/assistant/...",
                        ))
                    });
                }
            }
            let tokens = match input {
                TokenizeInput::Text { text, .. } => words(&text),
                TokenizeInput::Chat { messages, .. } => messages
                    .iter()
                    .flat_map(|m| {
                        let role = u32::from(m.role.as_str().as_bytes()[0]);
                        std::iter::once(role).chain(words(&m.content))
                    })
                    .collect::<Vec<u32>>(),
            };
            Box::pin(async move { Ok(tokens) })
        }
        fn detokenize(&self, _: Vec<u32>) -> crate::engine::EngineFuture<String> {
            unreachable!("only tokenize is called")
        }
        fn policy(&self) -> crate::engine::EngineFuture<crate::engine::PolicyInfo> {
            unreachable!("only tokenize is called")
        }
        fn swap_policy(
            &self,
            _: crate::engine::PolicySpec,
        ) -> crate::engine::EngineFuture<crate::engine::PolicySwap> {
            unreachable!("only tokenize is called")
        }
    }

    fn chat(messages: &[(ChatRole, &str)]) -> PromptInput {
        PromptInput::Chat {
            messages: messages
                .iter()
                .map(|(role, text)| ChatMessage::text(*role, *text))
                .collect(),
            template_kwargs: Default::default(),
            client_kwargs: Vec::new(),
            ending: Default::default(),
        }
    }

    /// Fits `messages` into `keep` tokens: how, and the contents kept (or the tokens).
    fn fit(messages: &[(ChatRole, &str)], keep: usize) -> (Fitted, Result<Vec<String>, usize>) {
        fit_on(&WordEngine { strict: false }, messages, keep)
    }

    /// [`fit`] on `engine`.
    fn fit_on(
        engine: &WordEngine,
        messages: &[(ChatRole, &str)],
        keep: usize,
    ) -> (Fitted, Result<Vec<String>, usize>) {
        let mut prompt = chat(messages);
        let fitted = futures_util::FutureExt::now_or_never(drop_oldest_messages(
            engine,
            &mut prompt,
            keep,
            "input",
        ))
        .expect("ready")
        .expect("fits");
        let kept = match prompt {
            PromptInput::Chat { messages, .. } => {
                Ok(messages.into_iter().map(|m| m.content).collect())
            }
            PromptInput::Tokens(t) => Err(t.len()),
            PromptInput::Text(_) => unreachable!(),
        };
        (fitted, kept)
    }

    /// The fewest oldest turns go, the system messages and the last stay; what is kept opens
    /// with a user message (a tool result whose call went goes too); a last message too long
    /// alone is cut to its last tokens.
    #[test]
    fn the_oldest_whole_messages_are_dropped() {
        use ChatRole::{Assistant, System, Tool, User};
        let conversation = [
            (System, "be brief"),     // 3 tokens
            (User, "one two three"),  // 4
            (Assistant, "four five"), // 3
            (User, "six"),            // 2
        ];
        // 12 tokens in all: nothing to drop.
        assert_eq!(fit(&conversation, 12).0, Fitted::Whole);
        // 11 to 5: the first turn goes, the user's message and the assistant's answer (3 + 2):
        // what is left may not open with the assistant.
        for keep in [11, 8, 5] {
            assert_eq!(
                fit(&conversation, keep),
                (
                    Fitted::Dropped(2),
                    Ok(vec!["be brief".into(), "six".into()])
                )
            );
        }
        // Longer: the turns go one at a time, the oldest first.
        let turns = [
            (User, "a"),      // 2
            (Assistant, "b"), // 2
            (User, "c"),      // 2
            (Assistant, "d"), // 2
            (User, "e"),      // 2
        ];
        assert_eq!(
            fit(&turns, 7),
            (
                Fitted::Dropped(2),
                Ok(vec!["c".into(), "d".into(), "e".into()])
            )
        );
        assert_eq!(fit(&turns, 5), (Fitted::Dropped(4), Ok(vec!["e".into()])));
        // Without a user message after the cut (an agent's tool loop) the fewest messages go,
        // and not a tool result first: 14 tokens; 7 keeps the last call and its result.
        let agent = [
            (User, "go"),        // 2
            (Assistant, "call"), // 2
            (Tool, "out one"),   // 3
            (Assistant, "call"), // 2
            (Tool, "out two"),   // 3
            (Assistant, "done"), // 2
        ];
        assert_eq!(
            fit(&agent, 7),
            (
                Fitted::Dropped(3),
                Ok(vec!["call".into(), "out two".into(), "done".into()])
            )
        );
        // 4: the system message and the last do not fit: the rendering's last 4 tokens.
        assert_eq!(fit(&conversation, 4), (Fitted::Cut, Err(4)));
        // A tool result left first by the cut goes too (11 tokens; without the first message,
        // 8).
        let with_tool = [
            (User, "call it"),
            (Assistant, ""),
            (Tool, "result is long text"),
            (User, "thanks"),
        ];
        assert_eq!(
            fit(&with_tool, 7),
            (Fitted::Dropped(3), Ok(vec!["thanks".into()]))
        );
    }

    /// On a template that refuses a conversation opening with the assistant (Gemma's), the
    /// fitted conversation opens with the user's message: dropping only the oldest message
    /// would leave the assistant's answer first, which that template refuses.
    #[test]
    fn a_fitted_conversation_opens_with_a_user_turn() {
        use ChatRole::{Assistant, System, User};
        let strict = WordEngine { strict: true };
        let conversation = [
            (User, "one two three"), // 4 tokens
            (Assistant, "four"),     // 2
            (User, "five six"),      // 3
        ];
        for keep in [7, 5, 3] {
            assert_eq!(
                fit_on(&strict, &conversation, keep),
                (Fitted::Dropped(2), Ok(vec!["five six".into()])),
                "{keep}"
            );
        }
        // The same after instructions (3 tokens).
        let mut with_system = vec![(System, "be brief")];
        with_system.extend(conversation);
        assert_eq!(
            fit_on(&strict, &with_system, 8),
            (
                Fitted::Dropped(2),
                Ok(vec!["be brief".into(), "five six".into()])
            )
        );
    }

    #[test]
    fn the_last_tokens_are_kept() {
        assert_eq!(keep_last(vec![1, 2, 3, 4, 5], 2), vec![4, 5]);
        assert_eq!(keep_last(vec![1, 2, 3], 3), vec![1, 2, 3]);
        assert_eq!(keep_last(vec![1, 2], 5), vec![1, 2]);
        assert_eq!(keep_last(vec![7], 1), vec![7]);
    }
}
