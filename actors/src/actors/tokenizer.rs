//! The tokenizer pool: sync actors on their own threads apply the chat template and encode, so
//! neither HTTP workers nor the scheduler spend time on it.

use std::sync::Arc;

use actix::{Actor, Handler, Message, SyncContext};
use switchyard_gpu::model::{ChatMessage, ChatTemplate, Tokenizer};
use switchyard_gpu::Constraint;

use super::engine::{PromptSource, SubmitError, SubmitErrorKind};
use crate::structured::{LazyGrammarCompiler, StructuredOutput};

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
    prompt.trim_end().ends_with("<think>")
}

/// Turns a prompt into token ids.
#[derive(Message)]
#[rtype(result = "Result<Encoded, SubmitError>")]
pub struct Encode {
    /// What to encode.
    pub source: PromptSource,
    /// For chat: append the assistant generation prompt.
    pub add_generation_prompt: bool,
    /// Add the tokenizer's special tokens (BOS) to a text prompt; chat prompts get theirs
    /// from the template.
    pub add_special_tokens: bool,
}

/// Turns token ids back into text, special tokens included.
#[derive(Message)]
#[rtype(result = "Result<String, SubmitError>")]
pub struct Decode(pub Vec<u32>);

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
}

impl TokenizerActor {
    /// Shares the model's tokenizer, chat template and grammar compiler.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        template: Option<Arc<ChatTemplate>>,
        grammars: LazyGrammarCompiler,
    ) -> Self {
        Self {
            tokenizer,
            template,
            grammars,
        }
    }
}

impl Actor for TokenizerActor {
    type Context = SyncContext<Self>;
}

fn invalid(message: String) -> SubmitError {
    SubmitError {
        kind: SubmitErrorKind::InvalidRequest,
        message,
    }
}

impl Handler<Encode> for TokenizerActor {
    type Result = Result<Encoded, SubmitError>;

    fn handle(&mut self, msg: Encode, _: &mut SyncContext<Self>) -> Self::Result {
        match msg.source {
            PromptSource::Tokens(ids) => {
                let vocab = self.tokenizer.vocab_size();
                if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
                    return Err(invalid(format!(
                        "token id {bad} is outside the vocabulary (size {vocab})"
                    )));
                }
                Ok(Encoded {
                    ids,
                    opens_thinking: false,
                })
            }
            PromptSource::Text(text) => self
                .tokenizer
                .encode(&text, msg.add_special_tokens)
                .map(|ids| Encoded {
                    ids,
                    opens_thinking: false,
                })
                .map_err(|e| invalid(e.to_string())),
            PromptSource::Chat {
                messages,
                template_kwargs,
            } => {
                let template = self.template.as_ref().ok_or_else(|| {
                    invalid("this model has no chat template; use /v1/completions".into())
                })?;
                let messages: Vec<ChatMessage> = messages
                    .into_iter()
                    .map(|(role, content)| ChatMessage { role, content })
                    .collect();
                let text = template
                    .render_with(&messages, msg.add_generation_prompt, &template_kwargs)
                    .map_err(|e| invalid(e.to_string()))?;
                // The template already wrote the special tokens it wants.
                self.tokenizer
                    .encode(&text, false)
                    .map(|ids| Encoded {
                        ids,
                        opens_thinking: ends_inside_think(&text),
                    })
                    .map_err(|e| invalid(e.to_string()))
            }
        }
    }
}

impl Handler<Decode> for TokenizerActor {
    type Result = Result<String, SubmitError>;

    fn handle(&mut self, msg: Decode, _: &mut SyncContext<Self>) -> Self::Result {
        let vocab = self.tokenizer.vocab_size();
        if let Some(bad) = msg.0.iter().find(|&&t| t as usize >= vocab) {
            return Err(invalid(format!(
                "token id {bad} is outside the vocabulary (size {vocab})"
            )));
        }
        self.tokenizer
            .decode(&msg.0, false)
            .map_err(|e| invalid(e.to_string()))
    }
}

impl Handler<Constrain> for TokenizerActor {
    type Result = Result<Vec<Constraint>, SubmitError>;

    fn handle(&mut self, msg: Constrain, _: &mut SyncContext<Self>) -> Self::Result {
        let compiler = self
            .grammars
            .get(&self.tokenizer)
            .map_err(|e| SubmitError {
                kind: SubmitErrorKind::Internal,
                message: format!("structured output is unavailable for this model: {e}"),
            })?;
        compiler
            .compile(&msg.spec, &msg.end_ids, msg.n)
            .map_err(invalid)
    }
}

#[cfg(test)]
mod tests {
    use super::ends_inside_think;

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
