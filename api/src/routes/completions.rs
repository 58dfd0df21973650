//! `POST /v1/completions`.

use actix_web::{web, HttpRequest, HttpResponse};
use bytes::Bytes;

use super::{check_model, engine_requests};
use crate::auth::Principal;
use crate::body::read_json;
use crate::engine::PromptInput;
use crate::error::ApiError;
use crate::generation::{ChoiceDelta, Generation, RequestFields};
use crate::schema::best_of::{best, CandidateScore};
use crate::schema::truncation::truncate_prompts;
use crate::schema::{
    render_token_ids, CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse,
    PromptLogprobs, Usage,
};
use crate::sse::{chunk_usage, frame, sse_response, ChunkWriter, RunningUsage};
use crate::state::{unix_now, ApiState};

/// Handles `POST /v1/completions`.
pub(crate) async fn completions(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let in_flight = state.admit()?;
    let body: CompletionRequest = read_json(&req, payload, &state.config()).await?;
    let id = crate::request_id::completion_id(&req, "cmpl-");
    body.ignored.warn("/v1/completions");
    let lora = check_model(&state, &principal, body.model.as_deref()).await?;
    let mut validated = body.validate(state.engine.max_model_len())?;
    if let Some(keep) = validated.truncate_prompt_tokens {
        truncate_prompts(&*state.engine, &mut validated.prompts, keep, "prompt").await?;
    }

    let echo_texts = if validated.echo {
        let mut texts = Vec::with_capacity(validated.prompts.len());
        for prompt in &validated.prompts {
            texts.push(match prompt {
                PromptInput::Text(text) => text.clone(),
                PromptInput::Tokens(ids) => state.engine.detokenize(ids.clone()).await?,
                PromptInput::Chat { .. } => String::new(),
            });
        }
        Some(texts)
    } else {
        None
    };
    // One computation serves both: echo's logprobs and vLLM's field, each cut to its count.
    let echo_logprobs = validated.logprobs.filter(|_| validated.echo);
    let prompt_logprobs = echo_logprobs.max(validated.prompt_logprobs);
    let requests = engine_requests(
        &id,
        &validated,
        &principal,
        prompt_logprobs,
        lora.as_deref(),
    );
    let fields = RequestFields {
        prompt: "prompt",
        structured: validated.structured_field,
        max_tokens: validated.max_tokens_field,
    };
    let meter = state.rate_limit(&principal, &req, &requests)?;
    let generation =
        Generation::start(&*state.engine, requests, validated.best_of, fields, meter).await?;
    // `best_of` candidates beyond `n` are ranked on their logprobs, asked for or not.
    let ranking = (validated.best_of > validated.n).then_some(Ranking {
        n: validated.n,
        keep_logprobs: validated.logprobs.is_some(),
    });

    let writer = CompletionWriter {
        id,
        created: unix_now(),
        model: lora.unwrap_or_else(|| state.engine.model_name().to_owned()),
        echo: echo_texts,
        logprobs: validated.logprobs.or(ranking.map(|_| 0)),
        prompt_logprobs: validated.prompt_logprobs,
        token_ids: validated.return_tokens_as_token_ids,
        offsets: vec![0; generation.choices()],
        usage_field: validated.include_usage.then_some(None),
        running: validated
            .continuous_usage
            .then(|| RunningUsage::new(&generation)),
    };
    if validated.stream {
        return Ok(sse_response(
            generation,
            writer,
            validated.include_usage,
            in_flight,
        ));
    }
    let response = collect(generation, writer, ranking).await?;
    drop(in_flight);
    Ok(HttpResponse::Ok().json(response))
}

/// Builds completion chunks and tracks each choice's text offset for logprobs.
struct CompletionWriter {
    id: String,
    created: u64,
    model: String,
    /// Per prompt, the text to prepend (when `echo`).
    echo: Option<Vec<String>>,
    /// Alternatives per token in `logprobs`, when asked.
    logprobs: Option<u32>,
    /// Alternatives per prompt token in vLLM's `prompt_logprobs` field, when asked.
    prompt_logprobs: Option<u32>,
    /// vLLM's `return_tokens_as_token_ids`: `logprobs` name tokens `token_id:{id}` (the echoed
    /// prompt's too; vLLM's `prompt_logprobs` field keeps its decoded tokens).
    token_ids: bool,
    /// Per choice, where the next token's text starts (for `text_offset`): the characters of
    /// the tokens reported so far.
    offsets: Vec<u32>,
    /// `Some(None)` when every chunk carries `"usage": null`.
    usage_field: Option<Option<Usage>>,
    /// Every chunk's usage so far, when the client asked for it (`continuous_usage_stats`).
    running: Option<RunningUsage>,
}

impl CompletionWriter {
    /// The `usage` of a chunk of `choice` carrying `tokens` new tokens, `cached` of its
    /// prompt's tokens served by the prefix cache.
    fn usage_for(&mut self, choice: u32, tokens: usize, cached: u32) -> Option<Option<Usage>> {
        chunk_usage(&mut self.running, self.usage_field, choice, tokens, cached)
    }

    fn response(
        &self,
        choices: Vec<CompletionChoice>,
        usage: Option<Option<Usage>>,
    ) -> CompletionResponse {
        CompletionResponse {
            id: self.id.clone(),
            object: "text_completion",
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        }
    }

    /// The echoed prompt of every choice, with its logprobs when asked.
    fn echo_choices(&mut self, generation: &Generation) -> Vec<CompletionChoice> {
        let Some(echo) = &self.echo else {
            return Vec::new();
        };
        let n = generation.n();
        let mut choices = Vec::with_capacity(generation.choices());
        for (prompt, text) in echo.iter().enumerate() {
            let mut prompt_logprobs = generation.prompt_logprobs.get(prompt).cloned().flatten();
            // The engine computed as many alternatives as vLLM's field asked, if more.
            let k = usize::try_from(self.logprobs.unwrap_or(0)).unwrap_or(usize::MAX);
            for lp in prompt_logprobs.iter_mut().flatten() {
                lp.top.truncate(k);
            }
            if self.token_ids {
                if let Some(list) = prompt_logprobs.as_mut() {
                    render_token_ids(list);
                }
            }
            for i in 0..n {
                let index = u32::try_from(prompt)
                    .unwrap_or(u32::MAX)
                    .saturating_mul(n)
                    .saturating_add(i);
                let mut end = 0;
                let logprobs = self.logprobs.map(|_| {
                    let mut lp = CompletionLogprobs::default();
                    end = lp.extend(prompt_logprobs.as_deref().unwrap_or_default(), 0);
                    lp
                });
                if let Some(offset) = usize::try_from(index)
                    .ok()
                    .and_then(|i| self.offsets.get_mut(i))
                {
                    *offset = end;
                }
                choices.push(CompletionChoice {
                    index,
                    text: text.clone(),
                    logprobs,
                    finish_reason: None,
                    prompt_logprobs: None,
                });
            }
        }
        choices
    }

    fn delta_choice(&mut self, delta: &ChoiceDelta) -> CompletionChoice {
        let offset = usize::try_from(delta.choice)
            .ok()
            .and_then(|i| self.offsets.get_mut(i));
        // Offsets count each token's text whole (as vLLM does), not the text released so far:
        // the detokenizer may hold text back (a possible stop string, part of a character).
        let logprobs = match offset {
            Some(offset) if self.logprobs.is_some() => {
                let mut lp = CompletionLogprobs::default();
                if self.token_ids {
                    let mut rendered = delta.delta.logprobs.clone();
                    render_token_ids(&mut rendered);
                    *offset = lp.extend(&rendered, *offset);
                } else {
                    *offset = lp.extend(&delta.delta.logprobs, *offset);
                }
                Some(lp)
            }
            _ => None,
        };
        CompletionChoice {
            index: delta.choice,
            text: delta.delta.text.clone(),
            logprobs,
            finish_reason: delta.delta.finish.map(|f| f.reason.as_str()),
            prompt_logprobs: None,
        }
    }
}

impl ChunkWriter for CompletionWriter {
    fn opening(&mut self, generation: &Generation) -> Vec<Bytes> {
        self.echo_choices(generation)
            .into_iter()
            .map(|choice| {
                let usage = self.usage_for(choice.index, 0, 0);
                frame(&self.response(vec![choice], usage))
            })
            .collect()
    }

    fn delta(&mut self, delta: ChoiceDelta) -> Option<Bytes> {
        let usage = self.usage_for(
            delta.choice,
            delta.delta.token_ids.len(),
            delta.delta.cached_prompt_tokens,
        );
        let choice = self.delta_choice(&delta);
        Some(frame(&self.response(vec![choice], usage)))
    }

    fn usage(&self, usage: Usage) -> Bytes {
        frame(&self.response(Vec::new(), Some(Some(usage))))
    }
}

/// How a request with `best_of` above `n` keeps its best candidates ([`crate::schema::best_of`]).
#[derive(Debug, Clone, Copy)]
struct Ranking {
    /// Choices kept per prompt.
    n: u32,
    /// The client asked for logprobs (else the ones that ranked the candidates are dropped).
    keep_logprobs: bool,
}

/// Waits for every choice and assembles the non-streaming response; with `ranking`, every
/// prompt's candidates are cut to its `n` best, numbered `prompt × n + i`, best first.
async fn collect(
    mut generation: Generation,
    mut writer: CompletionWriter,
    ranking: Option<Ranking>,
) -> Result<CompletionResponse, ApiError> {
    let mut choices: Vec<CompletionChoice> = writer.echo_choices(&generation);
    if choices.is_empty() {
        choices = (0..generation.choices())
            .map(|i| CompletionChoice {
                index: u32::try_from(i).unwrap_or(u32::MAX),
                text: String::new(),
                logprobs: writer.logprobs.map(|_| CompletionLogprobs::default()),
                finish_reason: None,
                prompt_logprobs: None,
            })
            .collect();
    }
    // vLLM's field: every choice its own prompt's list (choices are prompt × n + i).
    if let Some(k) = writer.prompt_logprobs {
        let n = usize::try_from(generation.n()).unwrap_or(usize::MAX).max(1);
        let lists: Vec<Option<PromptLogprobs>> = generation
            .prompt_logprobs
            .iter()
            .map(|list| list.as_deref().map(|l| PromptLogprobs::from_engine(l, k)))
            .collect();
        for (i, choice) in choices.iter_mut().enumerate() {
            choice.prompt_logprobs = lists.get(i / n).cloned().flatten();
        }
    }
    let mut completion_tokens = 0u32;
    // Each choice's generated tokens' logprobs (never the echoed prompt's).
    let mut scores = vec![CandidateScore::default(); choices.len()];
    while let Some(delta) = generation.next().await {
        let delta = delta?;
        if let Some(score) = usize::try_from(delta.choice)
            .ok()
            .and_then(|i| scores.get_mut(i))
        {
            for lp in &delta.delta.logprobs {
                score.add(lp.logprob);
            }
        }
        let part = writer.delta_choice(&delta);
        let Some(choice) = usize::try_from(delta.choice)
            .ok()
            .and_then(|i| choices.get_mut(i))
        else {
            continue;
        };
        choice.text.push_str(&part.text);
        if let (Some(all), Some(new)) = (choice.logprobs.as_mut(), part.logprobs) {
            all.tokens.extend(new.tokens);
            all.token_logprobs.extend(new.token_logprobs);
            all.top_logprobs.extend(new.top_logprobs);
            all.text_offset.extend(new.text_offset);
        }
        if let Some(finish) = delta.delta.finish {
            choice.finish_reason = Some(finish.reason.as_str());
            completion_tokens = completion_tokens.saturating_add(finish.completion_tokens);
        }
    }
    // Usage counts every candidate's tokens, kept or not: all were generated (and charged).
    let usage = Usage::new(
        generation.total_prompt_tokens(),
        generation.total_cached_prompt_tokens(),
        completion_tokens,
    );
    if let Some(ranking) = ranking {
        choices = keep_best(choices, &scores, generation.n(), ranking);
    }
    Ok(writer.response(choices, Some(Some(usage))))
}

/// Every prompt's `ranking.n` best of its `candidates` choices (`choices` holds them prompt
/// after prompt), best first and numbered `prompt × n + i`; their logprobs dropped unless the
/// client asked for them.
fn keep_best(
    choices: Vec<CompletionChoice>,
    scores: &[CandidateScore],
    candidates: u32,
    ranking: Ranking,
) -> Vec<CompletionChoice> {
    let per_prompt = usize::try_from(candidates).unwrap_or(usize::MAX).max(1);
    let n = usize::try_from(ranking.n).unwrap_or(usize::MAX);
    let mut slots: Vec<Option<CompletionChoice>> = choices.into_iter().map(Some).collect();
    let mut kept = Vec::new();
    for (prompt, scores) in scores.chunks(per_prompt).enumerate() {
        for best in best(scores, n) {
            let Some(mut choice) = slots
                .get_mut(prompt * per_prompt + best)
                .and_then(Option::take)
            else {
                continue;
            };
            choice.index = u32::try_from(kept.len()).unwrap_or(u32::MAX);
            if !ranking.keep_logprobs {
                choice.logprobs = None;
            }
            kept.push(choice);
        }
    }
    kept
}
