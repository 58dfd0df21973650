//! The tokenizer pool: sync actors on their own threads apply the chat template and encode, so
//! neither HTTP workers nor the scheduler spend time on it. Structured-output grammars are
//! handed on to the compile pool (`structured::CompilePool`), so that no compile holds up
//! prompt encoding.

use std::sync::Arc;

use actix::dev::{MessageResponse, OneshotSender};
use actix::{Actor, Handler, Message, SyncContext};
use switchyard_gpu::model::content_escape::ContentEscaper;
use switchyard_gpu::model::{ChatEnding, ChatMessage, ChatTemplate, Tokenizer};
use switchyard_gpu::{Constraint, GpuError};

use super::engine::{PromptSource, SubmitError, SubmitErrorKind};
use crate::structured::{
    CompileError, CompileReply, CompileResult, LazyGrammarCompiler, StructuredOutput,
    STRUCTURED_OUTPUT_PARAM,
};

/// A prompt as token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// The ids.
    pub ids: Vec<u32>,
    /// A chat prompt that ends inside a `<think>` block its template opened (QwQ and
    /// DeepSeek-R1 always, hybrid templates as their variables say): the answer starts as
    /// reasoning.
    pub opens_thinking: bool,
}

/// Whether a rendered chat prompt ends with `<think>` (after whitespace).
fn ends_inside_think(prompt: &str) -> bool {
    let prompt = prompt.trim_end();
    // `<think>`, or Mistral's `[THINK]` (the HTTP layer reads it for the tags it uses).
    prompt.ends_with("<think>") || prompt.ends_with("[THINK]")
}

/// Turns a prompt into token ids.
#[derive(Message)]
#[rtype(result = "Result<Encoded, SubmitError>")]
pub struct Encode {
    /// What to encode.
    pub source: PromptSource,
    /// Add the tokenizer's special tokens (BOS) to a text prompt; chat prompts get theirs
    /// from the template.
    pub add_special_tokens: bool,
}

/// Turns token ids back into text, special tokens included.
#[derive(Message)]
#[rtype(result = "Result<String, SubmitError>")]
pub struct Decode(pub Vec<u32>);

/// Tokenizes a request's `bad_words` as vLLM does
/// ([`crate::token_filters::bad_word_sequences`]).
#[derive(Message)]
#[rtype(result = "Result<Vec<Vec<u32>>, SubmitError>")]
pub struct EncodeBadWords(pub Vec<String>);

/// Compiles a structured-output specification into one constraint per choice.
#[derive(Message)]
#[rtype(result = "Result<Vec<Constraint>, SubmitError>")]
pub struct Constrain {
    /// What the output must follow.
    pub spec: StructuredOutput,
    /// The tokens that end the request.
    pub end_ids: Vec<u32>,
    /// Number of choices.
    pub n: usize,
}

/// One tokenizer thread.
pub struct TokenizerActor {
    tokenizer: Arc<Tokenizer>,
    template: Option<Arc<ChatTemplate>>,
    grammars: LazyGrammarCompiler,
    /// The model's context in tokens.
    max_model_len: usize,
    /// Longest prompt text that could fit `max_model_len` tokens: longer is refused unencoded.
    max_text_len: usize,
    /// Encodes the added tokens' text written in chat messages as text
    /// (`model.message_special_tokens: text`); `None`: as tokens.
    escaper: Option<Arc<ContentEscaper>>,
}

impl TokenizerActor {
    /// Shares the model's tokenizer, chat template and grammar compiler; prompts whose text
    /// could not fit in `max_model_len` tokens are refused before they are encoded.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        template: Option<Arc<ChatTemplate>>,
        grammars: LazyGrammarCompiler,
        max_model_len: usize,
    ) -> Self {
        let max_text_len = tokenizer.max_text_len(max_model_len);
        Self {
            tokenizer,
            template,
            grammars,
            max_model_len,
            max_text_len,
            escaper: None,
        }
    }

    /// Encodes the added tokens' text that chat messages write as text, as `escaper` finds it.
    #[must_use]
    pub fn escaping(mut self, escaper: Option<Arc<ContentEscaper>>) -> Self {
        self.escaper = escaper;
        self
    }

    /// Encodes prompt text, refusing as `ContextLengthExceeded`, without encoding it, a text
    /// too long to fit in the context whatever its tokens.
    fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, SubmitError> {
        self.check_text_len(text)?;
        self.tokenizer
            .encode(text, add_special)
            .map_err(|e| invalid(e.to_string()))
    }

    /// Refuses as `ContextLengthExceeded` a text too long to fit in the context whatever its
    /// tokens.
    fn check_text_len(&self, text: &str) -> Result<(), SubmitError> {
        if text.len() > self.max_text_len {
            return Err(SubmitError::new(
                SubmitErrorKind::ContextLengthExceeded,
                format!(
                    "the prompt of {} bytes cannot fit in this model's context of {} tokens \
                     (at most {} bytes of text)",
                    text.len(),
                    self.max_model_len,
                    self.max_text_len
                ),
            ));
        }
        Ok(())
    }

    /// Renders a chat and encodes it; with an escaper, the added tokens' text the messages
    /// (and the template's variables) write is encoded as text.
    fn encode_chat(
        &self,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        ending: ChatEnding,
        template_kwargs: &serde_json::Map<String, serde_json::Value>,
        client_kwargs: &[String],
    ) -> Result<Encoded, SubmitError> {
        let escaped = self.escaper.as_ref().and_then(|e| {
            let messages = e.escape_messages(messages);
            let kwargs = e.escape_variables(template_kwargs);
            (messages.is_some() || kwargs.is_some()).then_some((e, messages, kwargs))
        });
        let (render_messages, render_kwargs) = match &escaped {
            Some((_, m, k)) => (
                m.as_deref().unwrap_or(messages),
                k.as_ref().unwrap_or(template_kwargs),
            ),
            None => (messages, template_kwargs),
        };
        // The rendering stops as it passes the longest text that could fit.
        let text = template
            .render_within(render_messages, ending, render_kwargs, self.max_text_len)
            .map_err(|e| match e {
                GpuError::ChatTemplateTooLong { limit } => SubmitError::new(
                    SubmitErrorKind::ContextLengthExceeded,
                    format!(
                        "the chat prompt renders to more than {limit} bytes: it cannot \
                         fit in this model's context of {} tokens",
                        self.max_model_len
                    ),
                ),
                e => {
                    let error = invalid(e.to_string());
                    if self.fails_for_client_kwargs(
                        template,
                        render_messages,
                        ending,
                        render_kwargs,
                        client_kwargs,
                    ) {
                        error.with_param(CHAT_TEMPLATE_KWARGS)
                    } else {
                        error
                    }
                }
            })?;
        // Read before the escaped text is put back: a message's `<think>` opens nothing.
        let opens_thinking = ends_inside_think(&text);
        // The template already wrote the special tokens it wants.
        let ids = match escaped {
            None => self.encode(&text, false)?,
            Some((e, ..)) => {
                let restored = e.restore(&text);
                self.check_text_len(&restored.text)?;
                self.tokenizer
                    .encode_with_text_spans(&restored.text, &restored.as_text)
                    .map_err(|e| invalid(e.to_string()))?
            }
        };
        Ok(Encoded {
            ids,
            opens_thinking,
        })
    }
}

/// The HTTP API's field for a request's own chat template variables.
const CHAT_TEMPLATE_KWARGS: &str = "chat_template_kwargs";

impl TokenizerActor {
    /// Whether a chat rendering that failed with `template_kwargs` renders without the
    /// client's own of them (`client_kwargs`, not empty), or stops only at the length bound:
    /// then they are at fault, not the conversation. Run only for a failed rendering, and
    /// bounded as it is.
    fn fails_for_client_kwargs(
        &self,
        template: &ChatTemplate,
        messages: &[switchyard_gpu::model::ChatMessage],
        ending: switchyard_gpu::model::ChatEnding,
        template_kwargs: &serde_json::Map<String, serde_json::Value>,
        client_kwargs: &[String],
    ) -> bool {
        if client_kwargs.is_empty() {
            return false;
        }
        let mut without = template_kwargs.clone();
        without.retain(|name, _| !client_kwargs.contains(name));
        matches!(
            template.render_within(messages, ending, &without, self.max_text_len),
            Ok(_) | Err(GpuError::ChatTemplateTooLong { .. })
        )
    }
}

impl Actor for TokenizerActor {
    type Context = SyncContext<Self>;
}

fn invalid(message: String) -> SubmitError {
    SubmitError::new(SubmitErrorKind::InvalidRequest, message)
}

impl Handler<Encode> for TokenizerActor {
    type Result = Result<Encoded, SubmitError>;

    fn handle(&mut self, msg: Encode, _: &mut SyncContext<Self>) -> Self::Result {
        match msg.source {
            PromptSource::Tokens(ids) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    // Token ids come only from a completion's `prompt`.
                    return Err(invalid(format!(
                        "token id {bad} is outside the vocabulary (size {vocab})"
                    ))
                    .with_param("prompt"));
                }
                Ok(Encoded {
                    ids,
                    opens_thinking: false,
                })
            }
            PromptSource::Text(text) => {
                self.encode(&text, msg.add_special_tokens)
                    .map(|ids| Encoded {
                        ids,
                        opens_thinking: false,
                    })
            }
            PromptSource::Chat {
                messages,
                template_kwargs,
                client_kwargs,
                ending,
            } => {
                let template = self.template.as_ref().ok_or_else(|| {
                    invalid("this model has no chat template; use /v1/completions".into())
                })?;
                self.encode_chat(
                    template,
                    &messages,
                    ending,
                    &template_kwargs,
                    &client_kwargs,
                )
            }
        }
    }
}

impl Handler<EncodeBadWords> for TokenizerActor {
    type Result = Result<Vec<Vec<u32>>, SubmitError>;

    fn handle(&mut self, msg: EncodeBadWords, _: &mut SyncContext<Self>) -> Self::Result {
        crate::token_filters::bad_word_sequences(&msg.0, |text| self.tokenizer.encode(text, false))
            .map_err(|e| invalid(e.to_string()).with_param("bad_words"))
    }
}

impl Handler<Decode> for TokenizerActor {
    type Result = Result<String, SubmitError>;

    fn handle(&mut self, msg: Decode, _: &mut SyncContext<Self>) -> Self::Result {
        let vocab = self.tokenizer.vocab_size();
        if let Some(bad) = msg.0.iter().find(|&&t| t as usize >= vocab) {
            // Ids to decode come only from `/detokenize`'s `tokens`.
            return Err(invalid(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            ))
            .with_param("tokens"));
        }
        self.tokenizer
            .decode(&msg.0, false)
            .map_err(|e| invalid(e.to_string()))
    }
}

/// A [`Constrain`] handed to the compile pool: the tokenizer thread returns at once, the
/// pool answers the request when the grammar is compiled (or refused).
pub struct Compiling {
    grammars: LazyGrammarCompiler,
    tokenizer: Arc<Tokenizer>,
    msg: Constrain,
}

/// The answer of a [`Constrain`] request, sent from the compile pool.
struct ConstrainReply(OneshotSender<Result<Vec<Constraint>, SubmitError>>);

/// How a compile's failure is answered: a specification that does not compile is the
/// request's error, named by [`STRUCTURED_OUTPUT_PARAM`].
fn compile_refusal(e: CompileError) -> SubmitError {
    match e {
        CompileError::Invalid(m) => invalid(m).with_param(STRUCTURED_OUTPUT_PARAM),
        CompileError::Unavailable(_) => SubmitError::new(SubmitErrorKind::Internal, e.to_string()),
        CompileError::Busy(message) => SubmitError::new(SubmitErrorKind::Overloaded, message),
    }
}

impl CompileReply for ConstrainReply {
    fn send(self: Box<Self>, result: CompileResult) {
        let result = result.map_err(compile_refusal);
        // The requester may have gone meanwhile.
        let _ = self.0.send(result);
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

impl MessageResponse<TokenizerActor, Constrain> for Compiling {
    fn handle(
        self,
        _: &mut SyncContext<TokenizerActor>,
        tx: Option<OneshotSender<Result<Vec<Constraint>, SubmitError>>>,
    ) {
        // Sent without waiting for the answer: nobody would use the constraints.
        let Some(tx) = tx else { return };
        let Constrain { spec, end_ids, n } = self.msg;
        self.grammars.compile_then(
            &self.tokenizer,
            spec,
            end_ids,
            n,
            Box::new(ConstrainReply(tx)),
        );
    }
}

impl Handler<Constrain> for TokenizerActor {
    type Result = Compiling;

    /// Grammars compile on the compile pool, never on the threads that encode prompts: a
    /// slow compile cannot hold up other requests' prompts.
    fn handle(&mut self, msg: Constrain, _: &mut SyncContext<Self>) -> Compiling {
        Compiling {
            grammars: self.grammars.clone(),
            tokenizer: self.tokenizer.clone(),
            msg,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::time::Duration;

    use actix::SyncArbiter;

    use super::*;
    use crate::structured::CompilePool;

    /// Drops a compile's result.
    struct Discard;

    impl CompileReply for Discard {
        fn send(self: Box<Self>, _: CompileResult) {}
    }

    fn tokenizer() -> Arc<Tokenizer> {
        crate::testing::abc_tokenizer()
    }

    /// A tokenizer actor on the test tokenizer, and its vocabulary's size.
    fn tokenizer_actor() -> (actix::Addr<TokenizerActor>, u32) {
        let grammars =
            LazyGrammarCompiler::with_pool(CompilePool::new(1, 8, Duration::from_secs(3600)));
        let tok = tokenizer();
        let vocab = u32::try_from(tok.vocab_size()).unwrap();
        let actors = SyncArbiter::start(1, move || {
            TokenizerActor::new(tok.clone(), None, grammars.clone(), 1024)
        });
        (actors, vocab)
    }

    /// A token-id prompt with an id outside the vocabulary is refused naming `prompt`.
    #[actix::test]
    async fn a_token_prompt_outside_the_vocabulary_names_the_prompt() {
        let (actors, vocab) = tokenizer_actor();
        let refused = actors
            .send(Encode {
                source: PromptSource::Tokens(vec![0, vocab]),
                add_special_tokens: false,
            })
            .await
            .expect("mailbox")
            .expect_err("an id outside the vocabulary");
        assert_eq!(refused.kind, SubmitErrorKind::InvalidRequest);
        assert_eq!(refused.param, Some("prompt"), "{refused}");
    }

    /// An id outside the vocabulary sent to `/detokenize` is refused naming `tokens` (it was
    /// a 400 with `param: null`).
    #[actix::test]
    async fn a_detokenize_id_outside_the_vocabulary_names_the_tokens() {
        let (actors, vocab) = tokenizer_actor();
        let refused = actors
            .send(Decode(vec![0, vocab]))
            .await
            .expect("mailbox")
            .expect_err("an id outside the vocabulary");
        assert_eq!(refused.kind, SubmitErrorKind::InvalidRequest);
        assert_eq!(refused.param, Some("tokens"), "{refused}");
    }

    /// A grammar compiling (here: a compile that waits) holds up no prompt: grammars go to
    /// the compile pool, and the one tokenizer thread goes on encoding.
    #[actix::test]
    async fn prompts_are_encoded_while_a_grammar_compiles() {
        let grammars =
            LazyGrammarCompiler::with_pool(CompilePool::new(1, 8, Duration::from_secs(3600)));
        let (started_tx, started) = std::sync::mpsc::channel();
        let (release, wait) = std::sync::mpsc::channel::<()>();
        grammars.submit(
            Box::new(move || {
                let _ = started_tx.send(());
                let _ = wait.recv();
                Ok(Vec::new())
            }),
            Box::new(Discard),
        );
        started.recv().expect("the compile started");
        let (tok, g) = (tokenizer(), grammars.clone());
        let actors = SyncArbiter::start(1, move || {
            TokenizerActor::new(tok.clone(), None, g.clone(), 1024)
        });
        let mut constrain = Box::pin(actors.send(Constrain {
            spec: StructuredOutput::Regex("a b".into()),
            end_ids: vec![2],
            n: 1,
        }));
        // The one tokenizer thread took the Constrain first, then this.
        let encoded = actors
            .send(Encode {
                source: PromptSource::Text("a b".into()),
                add_special_tokens: false,
            })
            .await
            .expect("mailbox")
            .expect("encoded");
        assert_eq!(encoded.ids, vec![0, 1]);
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            constrain.as_mut().poll(&mut cx).is_pending(),
            "the grammar was compiled on the tokenizer thread"
        );
        drop(release);
        // Its turn on the compile thread: this vocabulary has no end-of-sequence token.
        let answer = constrain.await.expect("mailbox");
        match answer {
            Err(e) => {
                assert_eq!(e.kind, SubmitErrorKind::Internal, "{e}");
                assert!(e.message.contains("end-of-sequence"), "{e}");
            }
            Ok(_) => panic!("compiled without an end-of-sequence token"),
        }
    }

    /// A text longer than the context could hold whatever its tokens is refused as too
    /// long for the context, unencoded (encoding it would succeed); one at the bound is
    /// encoded.
    #[actix::test]
    async fn a_prompt_text_too_long_for_the_context_is_refused_unencoded() {
        // Tokens of at most 2 bytes (4 counted: an unknown character's), no normalizer.
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":[["a","b"]]}}"#;
        let tok = Arc::new(Tokenizer::from_json_bytes(json.as_bytes()).expect("tokenizer"));
        let bound = tok.max_text_len(10);
        assert_eq!(
            bound,
            10 * 4 + switchyard_gpu::model::tokenizer::TEXT_LEN_MARGIN
        );
        let template =
            Arc::new(ChatTemplate::new("{{ messages[0].content }}b", "", "").expect("template"));
        let actors = SyncArbiter::start(1, move || {
            TokenizerActor::new(
                tok.clone(),
                Some(template.clone()),
                LazyGrammarCompiler::default(),
                10,
            )
        });
        let text = |source: PromptSource| {
            actors.send(Encode {
                source,
                add_special_tokens: false,
            })
        };
        let at_bound = "ab".repeat(bound / 2);
        let ids = text(PromptSource::Text(at_bound.clone()))
            .await
            .expect("mailbox")
            .expect("a text at the bound is encoded")
            .ids;
        assert_eq!(ids, vec![2; bound / 2]);
        let e = text(PromptSource::Text(at_bound.clone() + "a"))
            .await
            .expect("mailbox")
            .expect_err("refused");
        assert_eq!(e.kind, SubmitErrorKind::ContextLengthExceeded, "{e}");
        assert!(e.message.contains("10 tokens"), "{e}");
        // A rendered chat prompt is bounded too: the template's "b" takes it past.
        let chat = |content: String| PromptSource::Chat {
            messages: vec![switchyard_gpu::model::ChatMessage::new("user", content)],
            template_kwargs: Default::default(),
            client_kwargs: Vec::new(),
            ending: switchyard_gpu::model::ChatEnding::Closed,
        };
        let e = text(chat(at_bound.clone()))
            .await
            .expect("mailbox")
            .expect_err("refused");
        assert_eq!(e.kind, SubmitErrorKind::ContextLengthExceeded, "{e}");
        // The rendering stopped at the bound, before it was encoded.
        assert!(e.message.contains("renders to more than"), "{e}");
        let ids = text(chat(at_bound[1..].to_string()))
            .await
            .expect("mailbox")
            .expect("encoded")
            .ids;
        // "b", "ab" ..., "b".
        assert_eq!(ids.len(), bound / 2 + 1);
    }

    /// A chat template error that the client's own variables cause (the rendering succeeds
    /// without them) names `chat_template_kwargs`; one the conversation causes, or the
    /// server's variables (`tools`), names none, whatever variables the client sent.
    #[actix::test]
    async fn a_template_error_the_clients_variables_cause_names_them() {
        let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
            "normalizer":null,"pre_tokenizer":null,"post_processor":null,"decoder":null,
            "model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2},"merges":[["a","b"]]}}"#;
        let tok = Arc::new(Tokenizer::from_json_bytes(json.as_bytes()).expect("tokenizer"));
        let source =
            "{% if strict is defined and strict %}{{ raise_exception('strict') }}{% endif %}\
            {% if tools %}{{ raise_exception('tools') }}{% endif %}\
            {% if messages[0].content == 'bb' %}{{ raise_exception('bb') }}{% endif %}\
            {{ messages[0].content }}";
        let template = Arc::new(ChatTemplate::new(source, "", "").expect("template"));
        let actors = SyncArbiter::start(1, move || {
            TokenizerActor::new(
                tok.clone(),
                Some(template.clone()),
                LazyGrammarCompiler::default(),
                100,
            )
        });
        let render = |content: &str, kwargs: serde_json::Value, client: &[&str]| {
            let serde_json::Value::Object(template_kwargs) = kwargs else {
                panic!("{kwargs}")
            };
            actors.send(Encode {
                source: PromptSource::Chat {
                    messages: vec![switchyard_gpu::model::ChatMessage::new("user", content)],
                    template_kwargs,
                    client_kwargs: client.iter().map(|s| (*s).to_owned()).collect(),
                    ending: switchyard_gpu::model::ChatEnding::Closed,
                },
                add_special_tokens: false,
            })
        };
        let tools = serde_json::json!([{"type": "function"}]);
        for (content, kwargs, client, param) in [
            // The client's variable: named.
            (
                "ab",
                serde_json::json!({"strict": true}),
                &["strict"][..],
                Some("chat_template_kwargs"),
            ),
            (
                "ab",
                serde_json::json!({"tools": tools, "x": 1}),
                &["tools", "x"],
                Some("chat_template_kwargs"),
            ),
            // The conversation: not named, though the client sent variables.
            (
                "bb",
                serde_json::json!({"strict": false}),
                &["strict"],
                None,
            ),
            ("bb", serde_json::json!({}), &[], None),
            // The server's `tools`: not named.
            (
                "ab",
                serde_json::json!({"tools": tools, "x": 1}),
                &["x"],
                None,
            ),
        ] {
            let e = render(content, kwargs.clone(), client)
                .await
                .expect("mailbox")
                .expect_err("refused");
            assert_eq!(e.kind, SubmitErrorKind::InvalidRequest, "{e}");
            assert_eq!(e.param, param, "{content} {kwargs}: {e}");
        }
        let ok = render("ab", serde_json::json!({"strict": false}), &["strict"]);
        assert_eq!(ok.await.expect("mailbox").expect("rendered").ids, vec![2]);
    }

    /// A specification that does not compile is the request's error, naming the field that
    /// carries structured output (the HTTP layer names the spelling the request used); the
    /// engine's own failures name none.
    #[test]
    fn a_specification_that_does_not_compile_names_its_field() {
        let e = compile_refusal(CompileError::Invalid("bad regex".into()));
        assert_eq!(e.kind, SubmitErrorKind::InvalidRequest);
        assert_eq!(e.param, Some(STRUCTURED_OUTPUT_PARAM));
        assert_eq!(e.message, "bad regex");
        let e = compile_refusal(CompileError::Busy("busy".into()));
        assert_eq!((e.kind, e.param), (SubmitErrorKind::Overloaded, None));
        let e = compile_refusal(CompileError::Unavailable("no end".into()));
        assert_eq!((e.kind, e.param), (SubmitErrorKind::Internal, None));
    }

    #[test]
    fn a_prompt_that_opens_the_block_is_told_apart() {
        // QwQ's and DeepSeek-R1's generation prompts open it.
        assert!(ends_inside_think("<|im_start|>assistant\n<think>\n"));
        // Qwen3 with enable_thinking false writes an empty block: the model answers.
        assert!(!ends_inside_think(
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        ));
        assert!(!ends_inside_think("<|im_start|>assistant\n"));
        assert!(!ends_inside_think(""));
    }
}
