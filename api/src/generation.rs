//! Driving the engine for one HTTP request: submit one engine request per prompt, wait until
//! every prompt is accepted, then hand out the choices' deltas in arrival order.
//!
//! A [`Generation`] owns the engine receivers; dropping it (client gone, handler future dropped,
//! stream body dropped) drops them and so aborts every engine request it holds.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_util::stream::{SelectAll, Stream, StreamExt};
use tokio::sync::mpsc;

use crate::engine::{
    Delta, Engine, EngineError, EngineErrorKind, EngineEvent, SiblingFailure, TokenLogprob,
    STRUCTURED_OUTPUT_PARAM,
};
use crate::error::ApiError;
use crate::rate_limit::Meter;

/// One prompt's event channel, tagged with the prompt's position.
struct Tagged {
    prompt: usize,
    rx: mpsc::Receiver<EngineEvent>,
}

impl Stream for Tagged {
    type Item = (usize, EngineEvent);

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let prompt = self.prompt;
        self.rx.poll_recv(cx).map(|e| e.map(|e| (prompt, e)))
    }
}

/// A delta with its OpenAI choice index (prompt × n + choice).
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ChoiceDelta {
    /// OpenAI choice index.
    pub choice: u32,
    /// The prompt the choice belongs to.
    pub prompt: usize,
    /// The engine's delta.
    pub delta: Delta,
}

/// The request's fields an engine error names where the engine cannot (see the port's
/// documentation).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RequestFields {
    /// The prompt's field (`prompt` or `messages`), named by a context-length error.
    pub prompt: &'static str,
    /// The field that carried the structured output, if any, named by the engine's refusal
    /// of the specification.
    pub structured: Option<&'static str>,
    /// The field that set the completion's length limit (`max_tokens`, or chat's
    /// `max_completion_tokens`), named where the engine names `max_tokens`.
    pub max_tokens: &'static str,
}

/// The running generation of one HTTP request.
pub(crate) struct Generation {
    events: SelectAll<Tagged>,
    early: VecDeque<(usize, Delta)>,
    n: u32,
    /// Prompt tokens per prompt.
    pub prompt_tokens: Vec<u32>,
    /// Prompt tokens the prefix cache served, per prompt: its first choice's (choice 0's
    /// deltas carry it), so that a prompt counts once whatever its `n`, as in `prompt_tokens`.
    pub cached_prompt_tokens: Vec<u32>,
    /// Prompt logprobs per prompt, when asked.
    pub prompt_logprobs: Vec<Option<Vec<TokenLogprob>>>,
    /// Per prompt, whether it ends inside a `<think>` block its chat template opened.
    pub opens_thinking: Vec<bool>,
    finished: Vec<bool>,
    remaining: usize,
    /// The fields errors name where the engine cannot.
    fields: RequestFields,
    /// Shared with the engine requests: set when the generation fails, before its receivers
    /// drop.
    failure: SiblingFailure,
    /// Charges the tokens used to the tenant's rate limits.
    meter: Meter,
    /// Tokens charged per choice so far.
    charged: Vec<u32>,
}

/// Whether an error before a request's prompt event is the server refusing it for want of
/// room (its bounds on requests in flight, a full compile queue, a drain): the request used
/// nothing, and its rate limit's request is given back ([`crate::rate_limit`]).
fn refused_for_room(kind: EngineErrorKind) -> bool {
    matches!(
        kind,
        EngineErrorKind::Overloaded { .. }
            | EngineErrorKind::TenantBusy
            | EngineErrorKind::Unavailable
    )
}

/// A breach of the port's request protocol by the engine: a 500 whose detail is logged.
pub(crate) fn protocol_error(message: &str) -> ApiError {
    ApiError::Engine(EngineError::new(
        EngineErrorKind::Internal,
        format!("engine protocol violation: {message}"),
    ))
}

impl Generation {
    /// Submits the requests (one per prompt, each with `n` choices) together and waits until
    /// the engine accepted all of them, so that validation errors become an HTTP error status
    /// rather than an error inside a stream. `meter` is charged the prompts' and the
    /// generated tokens as they come ([`crate::rate_limit`]).
    pub(crate) async fn start(
        engine: &dyn Engine,
        requests: Vec<crate::engine::GenerateRequest>,
        n: u32,
        fields: RequestFields,
        meter: Meter,
    ) -> Result<Self, ApiError> {
        let failure = SiblingFailure::default();
        let requests = requests
            .into_iter()
            .map(|mut request| {
                request.sibling_failure = failure.clone();
                request
            })
            .collect();
        // All prompts at once: the engine admits them together or refuses them all.
        let mut meter = meter;
        let receivers = engine.submit(requests).map_err(|e| {
            failure.set(e.kind);
            if refused_for_room(e.kind) {
                meter.refused_before_queueing();
            }
            name_fields(e, fields)
        })?;
        Self::accept(receivers, n, fields, failure, meter).await
    }

    /// Waits for every prompt's [`EngineEvent::Prompt`], buffering deltas that arrive early.
    async fn accept(
        receivers: Vec<mpsc::Receiver<EngineEvent>>,
        n: u32,
        fields: RequestFields,
        failure: SiblingFailure,
        meter: Meter,
    ) -> Result<Self, ApiError> {
        let prompts = receivers.len();
        let mut events = SelectAll::new();
        for (prompt, rx) in receivers.into_iter().enumerate() {
            events.push(Tagged { prompt, rx });
        }
        let choices = prompts.saturating_mul(usize::try_from(n).unwrap_or(usize::MAX));
        let mut generation = Self {
            events,
            early: VecDeque::new(),
            n,
            prompt_tokens: vec![0; prompts],
            cached_prompt_tokens: vec![0; prompts],
            prompt_logprobs: vec![None; prompts],
            opens_thinking: vec![false; prompts],
            finished: vec![false; choices],
            remaining: choices,
            fields,
            failure,
            meter,
            charged: vec![0; choices],
        };
        let mut accepted = vec![false; prompts];
        let mut waiting = prompts;
        while waiting > 0 {
            let Some((prompt, event)) = generation.events.next().await else {
                generation.failure.set(EngineErrorKind::Internal);
                return Err(protocol_error("channel closed before the prompt event"));
            };
            match event {
                EngineEvent::Prompt {
                    prompt_tokens,
                    opens_thinking,
                    prompt_logprobs,
                } if !accepted[prompt] => {
                    accepted[prompt] = true;
                    waiting -= 1;
                    generation.prompt_tokens[prompt] = prompt_tokens;
                    generation.meter.prompt(prompt, prompt_tokens);
                    generation.opens_thinking[prompt] = opens_thinking;
                    generation.prompt_logprobs[prompt] = prompt_logprobs;
                }
                EngineEvent::Prompt { .. } => {
                    generation.failure.set(EngineErrorKind::Internal);
                    return Err(protocol_error("second prompt event"));
                }
                EngineEvent::Delta(_) if !accepted[prompt] => {
                    generation.failure.set(EngineErrorKind::Internal);
                    return Err(protocol_error("delta before the prompt event"));
                }
                EngineEvent::Delta(delta) => generation.early.push_back((prompt, delta)),
                EngineEvent::Error(e) => {
                    // Recorded before the receivers drop with `generation`.
                    generation.failure.set(e.kind);
                    if accepted[prompt] {
                        generation.refund_timed_out(prompt, e.kind);
                    } else if refused_for_room(e.kind)
                        && !accepted.contains(&true)
                        && !generation.prompt_event_waiting()
                    {
                        // No prompt was queued: the engine admits a request's prompts
                        // together or refuses them all, and a prompt refused after admission
                        // (a full compile queue) may end before a sibling's prompt event was
                        // read, which the sibling's channel then holds.
                        generation.meter.refused_before_queueing();
                    }
                    return Err(name_fields(e, fields));
                }
            }
        }
        Ok(generation)
    }

    /// Whether a prompt's channel holds its prompt event, unread (the prompt was queued):
    /// reads what the channels hold now, for a generation about to fail.
    fn prompt_event_waiting(&mut self) -> bool {
        self.events.iter_mut().any(|t| {
            std::iter::from_fn(|| t.rx.try_recv().ok())
                .any(|e| matches!(e, EngineEvent::Prompt { .. }))
        })
    }

    /// Records that the request failed with `kind` for a reason of the route's own (an
    /// engine's delta it cannot use), before the generation drops: the prompts still running
    /// end because of it, and the engine counts them so.
    pub(crate) fn fail(&self, kind: EngineErrorKind) {
        self.failure.set(kind);
    }

    /// Choices per prompt.
    pub(crate) fn n(&self) -> u32 {
        self.n
    }

    /// Number of choices over all prompts.
    pub(crate) fn choices(&self) -> usize {
        self.finished.len()
    }

    /// Sum of the prompts' token counts.
    pub(crate) fn total_prompt_tokens(&self) -> u32 {
        self.prompt_tokens
            .iter()
            .fold(0u32, |acc, &t| acc.saturating_add(t))
    }

    /// Sum of the prompts' cached prompt tokens (complete once every choice finished).
    pub(crate) fn total_cached_prompt_tokens(&self) -> u32 {
        self.cached_prompt_tokens
            .iter()
            .fold(0u32, |acc, &t| acc.saturating_add(t))
    }

    /// The next delta, `None` once every choice finished, or the error that ended the request.
    /// Cancel-safe (the SSE body drops it on its heartbeat timeout): its only await is the
    /// channels' receive, before any state changes.
    pub(crate) async fn next(&mut self) -> Option<Result<ChoiceDelta, ApiError>> {
        loop {
            if self.remaining == 0 {
                return None;
            }
            let (prompt, delta) = match self.early.pop_front() {
                Some(early) => early,
                None => match self.events.next().await {
                    None => {
                        self.remaining = 0;
                        return Some(Err(protocol_error(
                            "channel closed before every choice finished",
                        )));
                    }
                    Some((_, EngineEvent::Prompt { .. })) => {
                        self.remaining = 0;
                        return Some(Err(protocol_error("second prompt event")));
                    }
                    Some((prompt, EngineEvent::Error(e))) => {
                        self.remaining = 0;
                        self.failure.set(e.kind);
                        self.refund_timed_out(prompt, e.kind);
                        return Some(Err(name_fields(e, self.fields)));
                    }
                    Some((prompt, EngineEvent::Delta(delta))) => (prompt, delta),
                },
            };
            if delta.index >= self.n {
                self.remaining = 0;
                return Some(Err(protocol_error("delta index out of range")));
            }
            let choice = u32::try_from(prompt)
                .unwrap_or(u32::MAX)
                .saturating_mul(self.n)
                .saturating_add(delta.index);
            let Some(done) = usize::try_from(choice)
                .ok()
                .and_then(|c| self.finished.get_mut(c))
            else {
                self.remaining = 0;
                return Some(Err(protocol_error("choice out of range")));
            };
            if *done {
                // Output after a choice's last delta breaks the protocol; drop it.
                continue;
            }
            if delta.finish.is_some() {
                *done = true;
                self.remaining -= 1;
            }
            self.charge(choice, &delta);
            if delta.index == 0 {
                if let Some(cached) = self.cached_prompt_tokens.get_mut(prompt) {
                    // Never more than the prompt: the usage stays consistent whatever the
                    // engine says.
                    let len = self.prompt_tokens.get(prompt).copied().unwrap_or(0);
                    *cached = delta.cached_prompt_tokens.min(len);
                }
            }
            return Some(Ok(ChoiceDelta {
                choice,
                prompt,
                delta,
            }));
        }
    }

    /// Gives the rate limits back the tokens charged for prompt `prompt` when its request
    /// timed out in the queue: it was never computed (see [`crate::rate_limit`]).
    fn refund_timed_out(&mut self, prompt: usize, kind: EngineErrorKind) {
        if kind == EngineErrorKind::QueueTimeout {
            let tokens = self.prompt_tokens.get(prompt).copied().unwrap_or(0);
            self.meter.refund(tokens);
        }
    }

    /// Charges a choice's generated tokens to the rate limits as its deltas come: the delta's
    /// tokens, and at its last delta whatever its count of completion tokens says beyond
    /// them, so that the charge is what `usage.completion_tokens` reports.
    fn charge(&mut self, choice: u32, delta: &Delta) {
        let Some(charged) = self.charged.get_mut(choice as usize) else {
            return;
        };
        let mut now = u32::try_from(delta.token_ids.len()).unwrap_or(u32::MAX);
        if let Some(finish) = delta.finish {
            now = now.max(finish.completion_tokens.saturating_sub(*charged));
        }
        *charged = charged.saturating_add(now);
        self.meter.generated(now);
    }
}

/// `e` naming the request's own field where the engine could not: the prompt's for a
/// context-length error without one and where the engine names `prompt` (a token id outside
/// the vocabulary: `/v1/embeddings` calls its prompt `input`), the one that carried the
/// structured output for a refusal of it, the one that set the length limit for the engine's
/// `max_tokens`.
fn name_fields(mut e: EngineError, fields: RequestFields) -> ApiError {
    if (e.kind == EngineErrorKind::ContextLengthExceeded && e.param.is_none())
        || e.param.as_deref() == Some("prompt")
    {
        e.param = Some(fields.prompt.to_owned());
    }
    if e.param.as_deref() == Some("max_tokens") {
        e.param = Some(fields.max_tokens.to_owned());
    }
    if let Some(field) = fields.structured {
        if e.param.as_deref() == Some(STRUCTURED_OUTPUT_PARAM) {
            e.param = Some(field.to_owned());
        }
    }
    ApiError::Engine(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::{Finish, FinishReason};

    fn delta(index: u32, text: &str, finish: bool) -> EngineEvent {
        EngineEvent::Delta(Delta {
            index,
            text: text.to_owned(),
            token_ids: vec![1],
            logprobs: Vec::new(),
            finish: finish.then_some(Finish {
                reason: FinishReason::Stop,
                completion_tokens: 1,
            }),
            cached_prompt_tokens: 0,
            embedding: None,
        })
    }

    fn prompt(tokens: u32) -> EngineEvent {
        EngineEvent::Prompt {
            prompt_tokens: tokens,
            opens_thinking: false,
            prompt_logprobs: None,
        }
    }

    fn channel(events: Vec<EngineEvent>) -> mpsc::Receiver<EngineEvent> {
        let (tx, rx) = mpsc::channel(events.len() + 1);
        for e in events {
            tx.try_send(e).unwrap();
        }
        rx
    }

    fn fields(prompt: &'static str) -> RequestFields {
        RequestFields {
            prompt,
            structured: None,
            max_tokens: "max_tokens",
        }
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        futures_util::FutureExt::now_or_never(f).expect("all events are buffered")
    }

    #[test]
    fn choices_are_numbered_prompt_major_and_early_deltas_kept() {
        let a = channel(vec![prompt(2), delta(1, "a1", true), delta(0, "a0", true)]);
        let b = channel(vec![
            prompt(3),
            delta(0, "b0", false),
            delta(0, "", true),
            delta(1, "b1", true),
        ]);
        let mut g = block_on(Generation::accept(
            vec![a, b],
            2,
            fields("prompt"),
            SiblingFailure::default(),
            Meter::unlimited(),
        ))
        .unwrap();
        assert_eq!(g.total_prompt_tokens(), 5);
        let mut seen = Vec::new();
        while let Some(d) = block_on(g.next()) {
            let d = d.unwrap();
            seen.push((d.choice, d.delta.text));
        }
        seen.sort();
        let expected = [(0, "a0"), (1, "a1"), (2, ""), (2, "b0"), (3, "b1")];
        assert_eq!(seen, expected.map(|(c, t)| (c, t.to_owned())));
    }

    /// A rate limiter whose tier `free` has these limits, and tenant acme of that tier.
    fn limited(
        rpm: Option<u64>,
        tpm: Option<u64>,
    ) -> (crate::rate_limit::RateLimiter, crate::auth::Principal) {
        use crate::rate_limit::{RateLimiter, TierLimits};
        let limiter = RateLimiter::new(std::collections::HashMap::from([(
            "free".to_owned(),
            TierLimits {
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
            },
        )]));
        let who = crate::auth::Principal {
            tenant: "acme".into(),
            tier: "free".into(),
            adapters: crate::auth::AdapterAccess::all(),
        };
        (limiter, who)
    }

    /// A prompt whose request timed out in the queue was never computed: its tokens, charged
    /// when it was accepted, are given back to the tenant's budget (other failures keep them).
    #[test]
    fn a_prompt_timed_out_in_the_queue_is_not_charged() {
        let (limiter, who) = limited(None, Some(600));
        let remaining = || {
            let m = limiter
                .admit(&who, vec![1], std::time::Instant::now())
                .unwrap();
            m.snapshot().unwrap().tokens.unwrap().remaining
        };
        for (kind, left) in [
            (EngineErrorKind::QueueTimeout, 599),
            (EngineErrorKind::Internal, 299),
        ] {
            limiter.reset("free", "acme");
            let meter = limiter
                .admit(&who, vec![100], std::time::Instant::now())
                .unwrap();
            let rx = channel(vec![
                prompt(300),
                EngineEvent::Error(EngineError::new(kind, "x")),
            ]);
            let mut g = block_on(Generation::accept(
                vec![rx],
                1,
                fields("prompt"),
                SiblingFailure::default(),
                meter,
            ))
            .unwrap();
            assert!(matches!(block_on(g.next()), Some(Err(_))));
            drop(g);
            assert_eq!(remaining(), left, "{kind}");
        }
    }

    /// A request the server refused for want of room before queueing it (overloaded,
    /// tenant_busy, unavailable: an error before any prompt event) gives its tenant's
    /// request back; one refused for its own fault, or failing once queued, keeps it.
    #[test]
    fn a_request_refused_for_room_before_queueing_takes_no_request() {
        let (limiter, who) = limited(Some(10), None);
        let error = |kind| EngineEvent::Error(EngineError::new(kind, "x"));
        let overloaded = EngineErrorKind::Overloaded {
            retry_after_secs: 1,
        };
        for (events, left) in [
            (vec![error(overloaded)], 10),
            (vec![error(EngineErrorKind::TenantBusy)], 10),
            (vec![error(EngineErrorKind::Unavailable)], 10),
            (vec![error(EngineErrorKind::InvalidRequest)], 9),
            (vec![error(EngineErrorKind::ContextLengthExceeded)], 9),
            (vec![prompt(3), error(EngineErrorKind::Unavailable)], 9),
        ] {
            limiter.reset("free", "acme");
            let meter = limiter
                .admit(&who, vec![1], std::time::Instant::now())
                .unwrap();
            let kind = format!("{events:?}");
            let result = block_on(Generation::accept(
                vec![channel(events)],
                1,
                fields("prompt"),
                SiblingFailure::default(),
                meter,
            ));
            match result {
                Err(_) => {}
                Ok(mut g) => assert!(matches!(block_on(g.next()), Some(Err(_)))),
            }
            let report = limiter.report(std::time::Instant::now());
            let remaining = report["tenants"][0]["requests"]["remaining"].as_u64();
            assert_eq!(remaining, Some(left), "{kind}");
        }
    }

    /// A request of two prompts, one refused for want of room (a full compile queue, after
    /// admission) while the other was queued (its prompt event sent, whichever the generation
    /// reads first): the request keeps its rate limit's request. Refused both, it gives it back.
    #[test]
    fn a_request_with_a_prompt_queued_keeps_its_request_whatever_is_read_first() {
        let (limiter, who) = limited(Some(10), None);
        let busy = || {
            EngineEvent::Error(EngineError::new(
                EngineErrorKind::Overloaded {
                    retry_after_secs: 1,
                },
                "compile queue full",
            ))
        };
        for (prompts, left) in [
            (vec![vec![busy()], vec![prompt(3)]], 9),
            (vec![vec![prompt(3)], vec![busy()]], 9),
            (vec![vec![busy()], vec![busy()]], 10),
        ] {
            limiter.reset("free", "acme");
            let meter = limiter
                .admit(&who, vec![1, 1], std::time::Instant::now())
                .unwrap();
            let result = block_on(Generation::accept(
                prompts.into_iter().map(channel).collect(),
                1,
                fields("prompt"),
                SiblingFailure::default(),
                meter,
            ));
            assert!(result.is_err());
            let report = limiter.report(std::time::Instant::now());
            let remaining = report["tenants"][0]["requests"]["remaining"].as_u64();
            assert_eq!(remaining, Some(left));
        }
    }

    fn cached(index: u32, tokens: u32, finish: bool) -> EngineEvent {
        let mut d = delta(index, "x", finish);
        if let EngineEvent::Delta(d) = &mut d {
            d.cached_prompt_tokens = tokens;
        }
        d
    }

    /// Cached prompt tokens count once per prompt (its first choice's, whatever its other
    /// choices were served) and add up over prompts, as `prompt_tokens` does; a value past the
    /// prompt is cut to it.
    #[test]
    fn cached_prompt_tokens_count_once_per_prompt_and_sum_over_prompts() {
        // Prompt a (40 tokens, n = 2): choice 0 was served 32 from the cache, choice 1 16.
        let a = channel(vec![
            prompt(40),
            cached(1, 16, false),
            cached(0, 32, false),
            cached(1, 16, true),
            cached(0, 32, true),
        ]);
        // Prompt b (20 tokens): its engine says 99, more than the prompt.
        let b = channel(vec![prompt(20), cached(0, 99, true), cached(1, 0, true)]);
        let mut g = block_on(Generation::accept(
            vec![a, b],
            2,
            fields("prompt"),
            SiblingFailure::default(),
            Meter::unlimited(),
        ))
        .unwrap();
        while let Some(d) = block_on(g.next()) {
            d.unwrap();
        }
        assert_eq!(g.cached_prompt_tokens, vec![32, 20]);
        assert_eq!(g.total_cached_prompt_tokens(), 52);
        assert_eq!(g.total_prompt_tokens(), 60);
    }

    #[test]
    fn an_error_before_the_prompt_event_fails_the_start() {
        let e = EngineError::new(EngineErrorKind::ContextLengthExceeded, "too long");
        let rx = channel(vec![EngineEvent::Error(e)]);
        let failure = SiblingFailure::default();
        let result = block_on(Generation::accept(
            vec![rx],
            1,
            fields("messages"),
            failure.clone(),
            Meter::unlimited(),
        ));
        // The other prompts' requests learn why their receivers dropped.
        assert_eq!(failure.get(), Some(EngineErrorKind::ContextLengthExceeded));
        match result {
            Err(ApiError::Engine(e)) => assert_eq!(e.param.as_deref(), Some("messages")),
            _ => panic!("expected the engine error"),
        }
    }

    /// The engine's refusal of the structured-output specification names the field the
    /// request carried it in; a param the engine knows stays.
    #[test]
    fn a_refused_specification_names_the_field_that_carried_it() {
        let refusal = |param: &str| {
            EngineEvent::Error(
                EngineError::new(EngineErrorKind::InvalidRequest, "bad regex").with_param(param),
            )
        };
        let guided = RequestFields {
            prompt: "prompt",
            structured: Some("guided_regex"),
            max_tokens: "max_tokens",
        };
        for (param, named) in [
            (STRUCTURED_OUTPUT_PARAM, "guided_regex"),
            ("logit_bias", "logit_bias"),
        ] {
            let rx = channel(vec![refusal(param)]);
            let result = block_on(Generation::accept(
                vec![rx],
                1,
                guided,
                SiblingFailure::default(),
                Meter::unlimited(),
            ));
            match result {
                Err(ApiError::Engine(e)) => assert_eq!(e.param.as_deref(), Some(named)),
                _ => panic!("expected the engine error"),
            }
        }
    }

    /// The engine names `max_tokens` when a limit does not fit; a chat request that set it as
    /// `max_completion_tokens` hears that name.
    #[test]
    fn a_refused_limit_names_the_field_that_set_it() {
        for field in ["max_tokens", "max_completion_tokens"] {
            let refusal = EngineEvent::Error(
                EngineError::new(EngineErrorKind::ContextLengthExceeded, "too long")
                    .with_param("max_tokens"),
            );
            let chat = RequestFields {
                prompt: "messages",
                structured: None,
                max_tokens: field,
            };
            let result = block_on(Generation::accept(
                vec![channel(vec![refusal])],
                1,
                chat,
                SiblingFailure::default(),
                Meter::unlimited(),
            ));
            match result {
                Err(ApiError::Engine(e)) => assert_eq!(e.param.as_deref(), Some(field)),
                _ => panic!("expected the engine error"),
            }
        }
    }

    /// The engine names a token id outside the vocabulary `prompt`: a route whose prompt field
    /// is called otherwise (`/v1/embeddings`' `input`) hears its own name.
    #[test]
    fn the_engine_s_prompt_is_the_route_s_prompt_field() {
        for (route_field, named) in [("prompt", "prompt"), ("input", "input")] {
            let refusal = EngineEvent::Error(
                EngineError::new(EngineErrorKind::InvalidRequest, "token id 99999")
                    .with_param("prompt"),
            );
            let result = block_on(Generation::accept(
                vec![channel(vec![refusal])],
                1,
                fields(route_field),
                SiblingFailure::default(),
                Meter::unlimited(),
            ));
            match result {
                Err(ApiError::Engine(e)) => assert_eq!(e.param.as_deref(), Some(named)),
                _ => panic!("expected the engine error"),
            }
        }
    }

    /// A prompt whose grammar failed while generating ends the request, and the other
    /// prompts learn it was that: they count under its reason, not as internal errors.
    #[test]
    fn the_other_prompts_learn_that_a_grammar_failed() {
        let failed = EngineEvent::Error(EngineError::new(
            EngineErrorKind::StructuredOutput,
            "structured output: the lexer failed",
        ));
        let a = channel(vec![prompt(1), delta(0, "a", false), failed]);
        let b = channel(vec![prompt(1)]);
        let failure = SiblingFailure::default();
        let mut g = block_on(Generation::accept(
            vec![a, b],
            1,
            fields("prompt"),
            failure.clone(),
            Meter::unlimited(),
        ))
        .unwrap();
        let mut last = None;
        while let Some(d) = futures_util::FutureExt::now_or_never(g.next()).flatten() {
            last = Some(d);
        }
        match last {
            Some(Err(ApiError::Engine(e))) => {
                assert_eq!(e.kind, EngineErrorKind::StructuredOutput)
            }
            other => panic!("expected the grammar's error, got {other:?}"),
        }
        assert_eq!(failure.get(), Some(EngineErrorKind::StructuredOutput));
    }

    #[test]
    fn protocol_violations_are_internal_errors() {
        let cases = [
            vec![prompt(1), delta(3, "x", true)],
            vec![prompt(1), delta(0, "x", false)],
            vec![prompt(1), prompt(1)],
        ];
        for events in cases {
            let mut g = block_on(Generation::accept(
                vec![channel(events)],
                1,
                fields("prompt"),
                SiblingFailure::default(),
                Meter::unlimited(),
            ))
            .unwrap();
            let mut last = None;
            while let Some(d) = block_on(g.next()) {
                last = Some(d);
            }
            match last {
                Some(Err(ApiError::Engine(e))) => assert_eq!(e.kind, EngineErrorKind::Internal),
                other => panic!("expected a protocol error, got {other:?}"),
            }
        }
    }

    #[test]
    fn output_after_a_choice_finished_is_dropped() {
        let rx = channel(vec![prompt(1), delta(0, "x", true), delta(0, "late", true)]);
        let mut g = block_on(Generation::accept(
            vec![rx],
            1,
            fields("prompt"),
            SiblingFailure::default(),
            Meter::unlimited(),
        ))
        .unwrap();
        assert_eq!(block_on(g.next()).unwrap().unwrap().delta.text, "x");
        assert!(block_on(g.next()).is_none());
    }
}
