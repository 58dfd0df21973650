//! Beam search in the server ([`RequestOptions::beam`]).
//!
//! The search ([`crate::beam`]) runs in steps, as vLLM's does: each step queues one request per
//! live beam, its prompt the beam's tokens, for one greedy token with the `2 × width` best
//! alternatives, and waits for them all. Those requests are scheduled, batched, cached and
//! preempted as any other (the prompt's and the beams' common blocks come from the prefix
//! cache, so a step computes each beam's last, partial block and its new token); they carry the
//! request's tier, tenant, priority, adapter and cache salt, and its arrival, so that a policy
//! ranks each step as the request it belongs to. They are quiet: the metrics count the client's
//! request once, when its answer goes out (success per beam, its time to first token and
//! end-to-end latency, which are the same here, and its tokens), not each step.
//!
//! The client's seats (one per beam) are held by the search until it ends; the steps' requests
//! take none. A client that leaves ends the search at its current step (its step requests are
//! dropped, which aborts them); a step that fails fails the request with the step's error.

use std::time::Instant;

use switchyard_gpu::backend::SamplingParams;
use tokio::sync::mpsc;

use super::{
    names, unless_gone, BeamOptions, ChoiceDelta, EndedEarly, Engine, EngineOutput, InFlight,
    Metering, OutputSink, PromptSource, RequestOptions, Resolved, SubmitError, SubmitErrorKind,
    TokenLogprobs,
};
use crate::actors::detokenizer::failure_label;
use crate::beam::{BeamConfig, BeamSearch, MAX_BEAM_WIDTH};
use crate::IncrementalDetokenizer;

/// Where one step request's output goes: to the search, which waits on the other end.
struct StepSink(mpsc::UnboundedSender<EngineOutput>);

impl OutputSink for StepSink {
    fn send(&mut self, output: EngineOutput) -> bool {
        self.0.send(output).is_ok()
    }

    fn is_closed(&self) -> bool {
        self.0.is_closed()
    }
}

/// Why a step did not complete: a step request failed (or was refused), and the request
/// fails with it.
struct StepEnd(SubmitError);

/// What one step computed: each live beam's alternatives, and the prompt tokens the prefix
/// cache served the first beam's request.
struct StepOutputs {
    alternatives: Vec<TokenLogprobs>,
    cached_prompt_tokens: u32,
}

impl Engine {
    /// Runs a beam search request to its answer (see the module docs).
    pub(super) async fn beam_search(
        &self,
        options: RequestOptions,
        beam: BeamOptions,
        resolved: Resolved,
        mut sink: Box<dyn OutputSink>,
        mut guard: InFlight,
        arrival: Instant,
    ) {
        let width = options.n.max(1);
        let refusal = if width > MAX_BEAM_WIDTH {
            Some(
                SubmitError::new(
                    SubmitErrorKind::InvalidRequest,
                    format!("beam search keeps at most {MAX_BEAM_WIDTH} beams (n is {width})"),
                )
                .with_param("n"),
            )
        } else if !beam.length_penalty.is_finite() {
            Some(
                SubmitError::new(
                    SubmitErrorKind::InvalidRequest,
                    "length_penalty must be a finite number",
                )
                .with_param("length_penalty"),
            )
        } else if options.embed
            || options.prompt_logprobs.is_some()
            || options.structured.is_some()
            || !options.stop.is_empty()
        {
            Some(SubmitError::new(
                SubmitErrorKind::InvalidRequest,
                "beam search takes no stop strings, structured output or prompt logprobs",
            ))
        } else {
            None
        };
        if let Some(e) = refusal {
            sink.send(EngineOutput::Error(e));
            return;
        }
        let max_tokens = match self.check(&options, &resolved.prompt) {
            Ok(m) => m,
            Err(e) => {
                sink.send(EngineOutput::Error(e));
                return;
            }
        };
        let labels = self.outcome_labels(&options);
        if self.closed.load(std::sync::atomic::Ordering::Acquire) || !self.detokenizer.connected() {
            EndedEarly::Failed("unavailable").count(width as usize, &labels);
            sink.send(EngineOutput::Error(SubmitError::new(
                SubmitErrorKind::Unavailable,
                "the engine is shutting down",
            )));
            return;
        }
        let tenant = self.metrics_tenant(&options.tenant);
        if !sink.send(EngineOutput::Prompt {
            prompt_tokens: resolved.prompt.len() as u32,
            opens_thinking: resolved.opens_thinking,
            prompt_logprobs: None,
        }) {
            self.gone(&options, sink.as_ref());
            return;
        }
        let sampling = &options.sampling;
        let mut end_ids = sampling.stop_token_ids.clone();
        if !sampling.ignore_eos {
            end_ids.extend(&sampling.eos_token_ids);
        }
        let mut search = BeamSearch::new(BeamConfig {
            width: width as usize,
            prompt_len: resolved.prompt.len(),
            max_tokens,
            min_tokens: sampling.min_tokens,
            length_penalty: f64::from(beam.length_penalty),
            end_ids,
            keep_end: options.include_stop_str_in_output,
        });
        // What the client asked to see of each token (the search asks for more).
        let shown = sampling.logprobs;
        let mut cached = None;
        while !search.live().is_empty() {
            let step = self.beam_step(&options, &resolved, &search, &mut guard, arrival);
            match unless_gone(step, sink.as_ref()).await {
                None => {
                    self.gone(&options, sink.as_ref());
                    return;
                }
                Some(Err(StepEnd(e))) => {
                    EndedEarly::Failed(failure_label(e.kind)).count(width as usize, &labels);
                    sink.send(EngineOutput::Error(e));
                    return;
                }
                Some(Ok(step)) => {
                    if cached.is_none() {
                        // The prompt counts once computed, by the first step, as the
                        // detokenizer counts other requests' (not one that timed out in
                        // the queue or whose client left before it).
                        metrics::counter!(names::PROMPT_TOKENS, names::tenant_labels(&tenant))
                            .increment(resolved.prompt.len() as u64);
                    }
                    cached.get_or_insert(step.cached_prompt_tokens);
                    search.advance(&step.alternatives);
                }
            }
        }
        let cached = cached.unwrap_or(0);
        let answer = search.finish();
        let deltas: Vec<ChoiceDelta> = answer
            .into_iter()
            .enumerate()
            .map(|(index, beam)| {
                let mut detok = IncrementalDetokenizer::new(Vec::new());
                let mut text = String::new();
                // An end token a beam kept (`include_stop_str_in_output`) is its last; its
                // text follows every stop token's rules (kept, unless a skipped special token).
                for &token in &beam.tokens {
                    let skipped = options.skip_special_tokens
                        && !options.keep_special_tokens.contains(&Some(token))
                        && self.tokenizer.is_special(token);
                    if !skipped {
                        let bytes = self.tokenizer.token_bytes(token).unwrap_or(&[]);
                        detok.push_into(bytes, &mut text);
                    }
                }
                text.push_str(&detok.finish().text);
                let logprobs = match shown {
                    None => Vec::new(),
                    Some(n) => beam
                        .logprobs
                        .into_iter()
                        .map(|mut l| {
                            l.top.truncate(n as usize);
                            l
                        })
                        .collect(),
                };
                ChoiceDelta {
                    index: index as u32,
                    text,
                    token_ids: beam.tokens,
                    logprobs,
                    finish: Some((
                        beam.finish
                            .unwrap_or(switchyard_policies::FinishReason::Length),
                        beam.generated,
                    )),
                    cached_prompt_tokens: cached,
                    embedding: None,
                }
            })
            .collect();
        if deltas.len() < width as usize {
            // Only where end tokens crowd out every other alternative of every beam.
            let e = SubmitError::new(
                SubmitErrorKind::Internal,
                format!(
                    "beam search ended with {} of the {width} answers asked for",
                    deltas.len()
                ),
            );
            EndedEarly::Failed(failure_label(e.kind)).count(width as usize, &labels);
            sink.send(EngineOutput::Error(e));
            return;
        }
        // Counted before the answer goes out, as the detokenizer counts a request's last delta.
        if sink.will_deliver() {
            let tier = self.metrics_tier(&options.tier);
            let latency = arrival.elapsed().as_secs_f64();
            let slo = self.tier_slo(&options.tier).ttft_ms;
            for delta in &deltas {
                let Some((reason, _)) = delta.finish else {
                    continue;
                };
                metrics::histogram!(names::TIME_TO_FIRST_TOKEN, names::tier_labels(&tier))
                    .record(latency);
                metrics::histogram!(names::E2E_REQUEST_LATENCY, names::tier_labels(&tier))
                    .record(latency);
                if let Some(target) = slo {
                    names::record_slo(&tier, "ttft", latency * 1e3 <= target);
                }
                let mut outcome = labels.clone();
                outcome.push(metrics::Label::new(
                    names::LABEL_FINISHED_REASON,
                    reason.metric_label(),
                ));
                metrics::counter!(names::REQUEST_SUCCESS, outcome).increment(1);
            }
            // Its per-request histograms: each answer a finished request, as its TTFT and E2E
            // latency count, the request's width and longest answer once. No prefill, decode
            // or inference time: its steps are engine requests of their own, one per token.
            let tier_labels = names::tier_labels(&tier);
            let mut longest = 0;
            for delta in &deltas {
                let Some((_, n)) = delta.finish else {
                    continue;
                };
                longest = longest.max(n);
                metrics::histogram!(names::REQUEST_PROMPT_TOKENS, tier_labels.clone())
                    .record(resolved.prompt.len() as f64);
                metrics::histogram!(names::REQUEST_GENERATION_TOKENS, tier_labels.clone())
                    .record(f64::from(n));
                metrics::histogram!(names::REQUEST_PARAMS_MAX_TOKENS, tier_labels.clone())
                    .record(max_tokens as f64);
            }
            metrics::histogram!(
                names::REQUEST_MAX_NUM_GENERATION_TOKENS,
                tier_labels.clone()
            )
            .record(f64::from(longest));
            metrics::histogram!(names::REQUEST_PARAMS_N, tier_labels).record(f64::from(width));
            let generated: u64 = deltas
                .iter()
                .map(|d| u64::from(d.finish.map_or(0, |(_, n)| n)))
                .sum();
            metrics::counter!(names::GENERATION_TOKENS, names::tenant_labels(&tenant))
                .increment(generated);
            metrics::counter!(names::PROMPT_TOKENS_CACHED, names::tenant_labels(&tenant))
                .increment(u64::from(cached));
        }
        for delta in deltas {
            if !sink.send(EngineOutput::Delta(delta)) {
                // Gone as its answer went out: counted as a success, as the detokenizer
                // counts a choice whose last delta failed to go out.
                return;
            }
        }
    }

    /// Queues one step request per live beam and waits for their tokens' alternatives.
    async fn beam_step(
        &self,
        options: &RequestOptions,
        resolved: &Resolved,
        search: &BeamSearch,
        guard: &mut InFlight,
        arrival: Instant,
    ) -> Result<StepOutputs, StepEnd> {
        let alternatives = search.candidates_per_beam();
        let mut receivers = Vec::with_capacity(search.live().len());
        for beam in search.live() {
            let (tx, rx) = mpsc::unbounded_channel();
            let step = RequestOptions {
                prompt: PromptSource::Tokens(Vec::new()),
                sampling: SamplingParams {
                    temperature: 0.0,
                    ignore_eos: true,
                    logprobs: Some(alternatives),
                    eos_token_ids: options.sampling.eos_token_ids.clone(),
                    ..SamplingParams::default()
                },
                stop: Vec::new(),
                include_stop_str_in_output: false,
                skip_special_tokens: true,
                keep_special_tokens: options.keep_special_tokens,
                n: 1,
                max_tokens: Some(1),
                default_max_tokens: None,
                priority: options.priority,
                tier: options.tier.clone(),
                tenant: options.tenant.clone(),
                prompt_logprobs: None,
                lora: options.lora.clone(),
                structured: None,
                filters: crate::token_filters::TokenFilters::default(),
                cache_salt: options.cache_salt.clone(),
                embed: false,
                beam: None,
            };
            let mut prompt = Vec::with_capacity(resolved.prompt.len() + beam.tokens.len());
            prompt.extend_from_slice(&resolved.prompt);
            prompt.extend_from_slice(&beam.tokens);
            let step_resolved = Resolved {
                prompt,
                opens_thinking: false,
                adapter: resolved.adapter.clone(),
                constraints: Vec::new(),
                encoded: Instant::now(),
            };
            let sink = Box::new(StepSink(tx));
            // The first step's queue time is the request's own (once per beam, as each beam
            // counts as a choice); later steps' are not counted.
            let metering = Metering::BeamStep {
                queue_times: if beam.tokens.is_empty() {
                    options.n.max(1)
                } else {
                    0
                },
            };
            if let Err((e, _)) = self.admit(
                step,
                step_resolved,
                sink,
                guard.split_off(0),
                arrival,
                metering,
            ) {
                return Err(StepEnd(e));
            }
            receivers.push(rx);
        }
        let mut outputs = StepOutputs {
            alternatives: Vec::with_capacity(receivers.len()),
            cached_prompt_tokens: 0,
        };
        for (i, rx) in receivers.iter_mut().enumerate() {
            loop {
                match rx.recv().await {
                    Some(EngineOutput::Prompt { .. }) => {}
                    Some(EngineOutput::Delta(d)) if d.finish.is_some() => {
                        let Some(entry) = d.logprobs.into_iter().next() else {
                            return Err(StepEnd(SubmitError::new(
                                SubmitErrorKind::Internal,
                                "a beam search step came back without its token's logprobs",
                            )));
                        };
                        if i == 0 {
                            outputs.cached_prompt_tokens = d.cached_prompt_tokens;
                        }
                        outputs.alternatives.push(entry);
                        break;
                    }
                    Some(EngineOutput::Delta(_)) => {}
                    Some(EngineOutput::Error(e)) => return Err(StepEnd(e)),
                    None => {
                        return Err(StepEnd(SubmitError::new(
                            SubmitErrorKind::Unavailable,
                            "the engine is shutting down",
                        )))
                    }
                }
            }
        }
        Ok(outputs)
    }
}
