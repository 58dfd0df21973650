//! The detokenizer actor: turns each step's tokens into text per choice, finds stop strings
//! (asking the scheduler to finish those sequences), and delivers deltas to the clients' sinks.
//! A sink whose client went away makes it abort the request at once.

use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::SendError;
use actix::{Actor, Addr, AsyncContext, Context, Handler, Message};
use switchyard_gpu::model::Tokenizer;
use switchyard_gpu::Constraint;
use switchyard_policies::{FinishReason, IdMap, RequestId, SchedulerError, SloTargets};

use super::admission::InFlight;
use super::context_length::SequenceLimit;
use super::engine::{
    ChoiceDelta, EngineOutput, OutputSink, SubmitError, SubmitErrorKind, TokenLogprobs,
};
use super::scheduler::{Finish, SchedulerActor, Submit};
use crate::core::{CoreEvent, SubmitOptions};
use crate::detokenizer::IncrementalDetokenizer;
use crate::metric_names as names;
use crate::structured::{self, STRUCTURED_OUTPUT_PARAM};
use crate::EngineError;

/// How often sinks of queued requests are checked for departed clients.
const SINK_CHECK_INTERVAL: Duration = Duration::from_millis(100);

/// Registers the choices of one request and submits them to the scheduler. Submitted from
/// here, a request reaches the scheduler before anything this actor says about it (an abort),
/// and the scheduler's refusal reaches this actor after the registration.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Register {
    /// Scheduler ids of the choices, in choice order.
    pub ids: Vec<RequestId>,
    /// The choices as the scheduler takes them (same order as `ids`).
    pub submits: Vec<SubmitOptions>,
    /// Where the request's output goes.
    pub sink: Box<dyn OutputSink>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// How the text is made.
    pub text: TextOptions,
    /// When the request arrived, for latency metrics.
    pub arrival: Instant,
    /// Counts the request as in flight until its last choice ends.
    pub guard: InFlight,
    /// The prompt, when its logprobs were asked: the prompt event then waits for them.
    pub pending_prompt: Option<PendingPrompt>,
    /// The request's log span (the front end's: its public id and tier), for the lines this
    /// actor logs about it.
    pub span: tracing::Span,
    /// A step of a beam search ([`super::beam_search`]), not a client's request: it records no
    /// per-request metrics (the search records its request's once).
    pub quiet: bool,
}

/// A prompt whose logprobs were asked: its prompt event waits for them.
#[derive(Debug, Clone)]
pub struct PendingPrompt {
    /// The prompt's tokens.
    pub tokens: Arc<[u32]>,
    /// The chat prompt ends inside a `<think>` block its template opened (for the event).
    pub opens_thinking: bool,
}

/// Special tokens whose text a choice keeps though special tokens are skipped (at most three:
/// the markers of a tool-call format).
pub type KeptSpecial = [Option<u32>; 5];

/// How a request's tokens become its text (vLLM's output fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TextOptions {
    /// Stop strings are looked for only once a choice has more tokens than this (vLLM).
    pub min_tokens: u32,
    /// A matched stop string, and the text of a stop token or end-of-sequence token that ended
    /// the choice, are part of the text (`include_stop_str_in_output`).
    pub include_stop: bool,
    /// Special tokens' text is left out (`skip_special_tokens`).
    pub skip_special: bool,
    /// Special tokens whose text is kept all the same: the markers of tool calls (Mistral's
    /// `[TOOL_CALLS]`, `[ARGS]`, `[CALL_ID]`), which the tool reader must see.
    pub keep_special: KeptSpecial,
}

impl Default for TextOptions {
    fn default() -> Self {
        Self {
            min_tokens: 0,
            include_stop: false,
            skip_special: true,
            keep_special: KeptSpecial::default(),
        }
    }
}

/// The events of one step, or the failure of its requests.
#[derive(Message)]
#[rtype(result = "()")]
pub struct StepEvents {
    events: Vec<CoreEvent>,
    failed: Option<(Vec<RequestId>, SubmitError)>,
}

impl StepEvents {
    /// A completed step's events.
    pub fn new(events: Vec<CoreEvent>) -> Self {
        Self {
            events,
            failed: None,
        }
    }
    /// Requests that failed with `error` outside a step (a queue timeout).
    pub fn failed_with(ids: Vec<RequestId>, error: SubmitError) -> Self {
        Self {
            events: Vec::new(),
            failed: Some((ids, error)),
        }
    }
    /// A step whose execution failed.
    pub fn failed(ids: Vec<RequestId>, message: String) -> Self {
        Self {
            events: Vec::new(),
            failed: Some((ids, SubmitError::new(SubmitErrorKind::Internal, message))),
        }
    }
    /// Requests the scheduler refused to queue, failed with the client-facing form of
    /// `error` ([`rejection`]).
    pub fn rejected(ids: Vec<RequestId>, error: &EngineError) -> Self {
        Self {
            events: Vec::new(),
            failed: Some((ids, rejection(error))),
        }
    }
}

/// The client-facing form of the scheduler's refusal of a request: too long for the context
/// or the KV cache is `ContextLengthExceeded`, a bad field `InvalidRequest`, anything else the
/// server's own failure. The message names no internal id.
pub(crate) fn rejection(error: &EngineError) -> SubmitError {
    use SubmitErrorKind as K;
    let (kind, message) = match error {
        EngineError::Scheduler(SchedulerError::TooLong {
            prompt_len,
            max_tokens,
            max_model_len,
            ..
        }) => (
            K::ContextLengthExceeded,
            SequenceLimit::context(*max_model_len).max_tokens_too_large(*prompt_len, *max_tokens),
        ),
        EngineError::Scheduler(SchedulerError::ExceedsKvCapacity {
            needed, capacity, ..
        }) => (
            K::ContextLengthExceeded,
            format!(
                "the prompt and max_tokens need {needed} KV cache blocks; the cache holds \
                 {capacity}"
            ),
        ),
        EngineError::Scheduler(SchedulerError::ExceedsTierKvQuota {
            tier,
            needed,
            quota,
            ..
        }) => (
            K::ContextLengthExceeded,
            format!(
                "the prompt and max_tokens need {needed} KV cache blocks; tier `{tier}` may \
                 hold {quota} (its max_kv_fraction)"
            ),
        ),
        EngineError::Scheduler(SchedulerError::InvalidRequest { field, reason, .. }) => {
            (K::InvalidRequest, format!("{field}: {reason}"))
        }
        other => (K::Internal, other.to_string()),
    };
    SubmitError::new(kind, message)
}

/// Ends every request in flight with the error it carries (a drain that timed out): the
/// error goes to each client and the requests are aborted in the scheduler; requests
/// registered later get it at once and are never submitted.
#[derive(Message)]
#[rtype(result = "()")]
pub struct FailAll(pub SubmitError);

/// How the open choices of a request ended early, and the counter each one counts in.
#[derive(Clone, Copy)]
pub(crate) enum EndedEarly {
    /// The client went away ([`names::REQUEST_ABORTED`]).
    Aborted,
    /// An error ([`names::REQUEST_FAILED`], this `reason` label).
    Failed(&'static str),
}

impl EndedEarly {
    /// How the open choices of a request whose sink closed end: aborted, unless the client
    /// dropped them because another part of its request failed.
    pub(crate) fn of_closed(sink: &dyn OutputSink) -> Self {
        match sink.abandoned_for() {
            Some(kind) => EndedEarly::Failed(failure_label(kind)),
            None => EndedEarly::Aborted,
        }
    }

    /// Counts `choices` choices of a request whose outcome labels (tier and tenant,
    /// [`names::outcome_labels`]) are `outcome`.
    pub(crate) fn count(self, choices: usize, outcome: &[metrics::Label]) {
        let mut labels = outcome.to_vec();
        match self {
            EndedEarly::Aborted => metrics::counter!(names::REQUEST_ABORTED, labels),
            EndedEarly::Failed(reason) => {
                labels.push(metrics::Label::new(names::LABEL_REASON, reason));
                metrics::counter!(names::REQUEST_FAILED, labels)
            }
        }
        .increment(choices as u64);
    }
}

/// The `reason` label of a request that ended with an error (a bounded set, by kind): the
/// server's own failures (a failed step) are `error`; a choice whose structured-output
/// grammar failed while generating (other than past llguidance's limits: that is an invalid
/// request), and the other choices and prompts of its request, are `structured_output`.
pub(crate) fn failure_label(kind: SubmitErrorKind) -> &'static str {
    match kind {
        // A refusal at admission, before queueing: a 400 as an invalid request is.
        SubmitErrorKind::InvalidRequest | SubmitErrorKind::TooManyChoices => "invalid_request",
        SubmitErrorKind::UnknownModel => "unknown_model",
        SubmitErrorKind::ContextLengthExceeded => "context_length",
        SubmitErrorKind::Overloaded => "overloaded",
        SubmitErrorKind::TenantBusy => "tenant_busy",
        SubmitErrorKind::QueueTimeout => "queue_timeout",
        SubmitErrorKind::Unavailable => "unavailable",
        SubmitErrorKind::StructuredOutput => "structured_output",
        SubmitErrorKind::Internal => "error",
    }
}

/// One request's sink, shared by its choices.
struct RequestSink {
    sink: Box<dyn OutputSink>,
    arrival: Instant,
    /// Scheduler ids of all choices, to abort them together.
    ids: Vec<RequestId>,
    /// The request's seats under the admission bounds: given back before its last choice's
    /// last delta goes out (so that a client that sends its next request as soon as it reads
    /// the end of this one finds them free), else when the request is dropped.
    guard: Option<InFlight>,
    /// The prompt while its logprobs are still being computed; `None` once the prompt event
    /// went out.
    pending_prompt: Option<PendingPrompt>,
    /// Deltas of the choices past the first that came while the prompt event waited for the
    /// first choice's prompt logprobs (only the first computes them, and the others, on the
    /// prefix cache or outside the logit-row bound of prompt chunks, may sample first): they
    /// go out right after the prompt event, in order.
    held: Vec<ChoiceDelta>,
    /// Its metrics' tier ([`SubmitOptions::metrics_tier`]), the labels that puts on the per-tier metrics
    /// ([`names::TIERED`]) and the tier's SLO targets ([`names::SLO_ATTAINMENT`]).
    tier: Arc<str>,
    labels: Vec<metrics::Label>,
    /// Its metrics' tenant ([`SubmitOptions::metrics_tenant`]; "" for none), which labels the
    /// tokens it generates, and the labels of its outcome counters: its tier's and its tenant's
    /// ([`names::outcome_labels`]).
    tenant: Arc<str>,
    outcome_labels: Vec<metrics::Label>,
    slo: SloTargets,
    /// The request's log span ([`Register::span`]).
    span: tracing::Span,
    /// [`Register::quiet`].
    quiet: bool,
    /// The prompt's length, `max_tokens` (none for an embedding) and `n`, and the most tokens
    /// a finished choice generated so far: its per-request histograms
    /// ([`names::REQUEST_PROMPT_TOKENS`] and the others).
    prompt_tokens: u32,
    max_tokens: Option<u32>,
    n: u32,
    max_generated: u32,
    /// The prompt counted in [`names::PROMPT_TOKENS`] (at the first token of whichever choice
    /// got one first).
    prompt_counted: bool,
}

struct ChoiceState {
    index: u32,
    detok: IncrementalDetokenizer,
    text: TextOptions,
    tokens: u32,
    /// Prompt tokens the prefix cache served at the choice's first admission (known at its
    /// first token; 0 until then).
    cached_prompt_tokens: u32,
    /// When this choice's first and latest tokens arrived (its time to first token, inter-token
    /// latencies and time per output token: a choice is a request of its own in the metrics,
    /// as vLLM counts the child requests of `n > 1`).
    first_at: Option<Instant>,
    last_at: Option<Instant>,
    /// When the scheduler first put the choice in a step ([`Scheduled`]): its prefill and
    /// inference times run from then.
    scheduled_at: Option<Instant>,
    request: Rc<RefCell<RequestSink>>,
    /// Prompt logprobs by position (1..), filled as the prompt is computed; positions may
    /// arrive again after a preemption and are then overwritten.
    prompt_logprobs: Vec<Option<TokenLogprobs>>,
    /// The choice's structured-output constraint: one that failed while generating turns the
    /// choice's end into an error.
    constraint: Option<Constraint>,
    /// An embedding request ([`super::engine::RequestOptions::embed`]): its one sampled token is not output;
    /// its last delta carries `embedding`, the hidden state the step reported.
    embed: bool,
    embedding: Option<Vec<f32>>,
}

/// Owns the per-choice text state and the sinks.
pub struct DetokenizerActor {
    tokenizer: Arc<Tokenizer>,
    scheduler: Option<Addr<SchedulerActor>>,
    choices: IdMap<ChoiceState>,
    /// Set by [`FailAll`]: what every request registered from then on fails with.
    closed: Option<SubmitError>,
}

impl DetokenizerActor {
    /// Builds the actor; the scheduler address is set once it exists.
    pub fn new(tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            tokenizer,
            scheduler: None,
            choices: IdMap::default(),
            closed: None,
        }
    }

    fn finish_in_scheduler(&self, ids: Vec<(RequestId, FinishReason)>) {
        if let (Some(s), false) = (&self.scheduler, ids.is_empty()) {
            s.do_send(Finish(ids));
        }
    }

    /// Sends a request's deferred prompt event with the prompt logprobs known so far (positions
    /// not computed, such as the first, have none).
    fn flush_prompt(request: &mut RequestSink, known: &[Option<TokenLogprobs>]) {
        if let Some(PendingPrompt {
            tokens: prompt,
            opens_thinking,
        }) = request.pending_prompt.take()
        {
            let list = prompt
                .iter()
                .enumerate()
                .map(|(pos, &token)| {
                    known.get(pos).cloned().flatten().unwrap_or(TokenLogprobs {
                        token,
                        logprob: None,
                        rank: None,
                        top: Vec::new(),
                    })
                })
                .collect();
            request.sink.send(EngineOutput::Prompt {
                prompt_tokens: prompt.len() as u32,
                opens_thinking,
                prompt_logprobs: Some(list),
            });
            // A sink that refuses one now is closed: the step's own deltas find it so.
            for delta in std::mem::take(&mut request.held) {
                request.sink.send(EngineOutput::Delta(delta));
            }
        }
    }

    /// Ends the request of choice `id`, whose grammar failed while generating, with an error:
    /// its output cannot complete the structured output asked for, so it is no answer (the
    /// choice ended through its end tokens, which is all a failed grammar allows). A grammar
    /// that went past llguidance's parser limits ([`structured::exceeded_limits`]) is the
    /// request's error, as its refusal when it compiles is (an invalid request naming the
    /// structured-output field, counted as `invalid_request`); any other failure is the
    /// server's ([`SubmitErrorKind::StructuredOutput`], a 500). The text of its last step goes
    /// out first, then the error; its other choices are aborted. A choice
    /// past the first that fails before the prompt event went out (its deltas were held for
    /// the first choice's prompt logprobs) sends only the error: no delta may precede the
    /// prompt event, and the request is refused as a whole.
    fn fail_constrained(
        &mut self,
        id: RequestId,
        mut delta: ChoiceDelta,
        failure: &str,
        request: &Rc<RefCell<RequestSink>>,
    ) {
        delta.finish = None;
        // The failure says after how many generated tokens (the end id that a failed grammar
        // allows, and which ended the choice, is not one of them).
        let message =
            format!("structured output: {failure}; the output does not complete the grammar");
        let error = if structured::exceeded_limits(failure) {
            SubmitError::new(SubmitErrorKind::InvalidRequest, message)
                .with_param(STRUCTURED_OUTPUT_PARAM)
        } else {
            SubmitError::new(SubmitErrorKind::StructuredOutput, message)
        };
        let ended = EndedEarly::Failed(failure_label(error.kind));
        self.choices.remove(&id);
        ended.count(1, &request.borrow().outcome_labels);
        let mut r = request.borrow_mut();
        if !delta.token_ids.is_empty() && r.pending_prompt.is_none() {
            r.sink.send(EngineOutput::Delta(delta));
        }
        r.sink.send(EngineOutput::Error(error));
        drop(r);
        self.abort_request(request, ended);
    }

    /// Drops every open choice of a request whose client is gone, or that failed, and aborts
    /// them in the scheduler. Each choice is counted once, under `ended` (a choice that already
    /// finished was counted then).
    fn abort_request(&mut self, request: &Rc<RefCell<RequestSink>>, ended: EndedEarly) {
        let ids = request.borrow().ids.clone();
        let mut aborted = Vec::new();
        for id in ids {
            if self.choices.remove(&id).is_some() {
                aborted.push((id, FinishReason::Abort));
            }
        }
        if aborted.is_empty() {
            return;
        }
        if !request.borrow().quiet {
            ended.count(aborted.len(), &request.borrow().outcome_labels);
        }
        request.borrow().span.in_scope(|| {
            tracing::info!(
                ids = ?aborted.iter().map(|(id, _)| id.0).collect::<Vec<_>>(),
                choices = aborted.len(),
                "request aborted"
            );
        });
        self.finish_in_scheduler(aborted);
    }
}

/// The deltas of one step, in event order, one per choice.
#[derive(Default)]
struct StepDeltas {
    deltas: Vec<(RequestId, ChoiceDelta)>,
    /// Position of each choice's delta in `deltas`.
    index: IdMap<usize>,
}

impl StepDeltas {
    fn with_capacity(n: usize) -> Self {
        Self {
            deltas: Vec::with_capacity(n),
            index: IdMap::with_capacity_and_hasher(n, Default::default()),
        }
    }

    /// The delta of choice `id`, created on first use.
    fn of(&mut self, id: RequestId, index: u32) -> &mut ChoiceDelta {
        let deltas = &mut self.deltas;
        let pos = *self.index.entry(id).or_insert_with(|| {
            deltas.push((
                id,
                ChoiceDelta {
                    index,
                    ..Default::default()
                },
            ));
            deltas.len() - 1
        });
        &mut deltas[pos].1
    }
}

/// Sets the scheduler address (the two actors know each other).
#[derive(Message)]
#[rtype(result = "()")]
pub struct SetScheduler(pub Addr<SchedulerActor>);

impl Actor for DetokenizerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        ctx.run_interval(SINK_CHECK_INTERVAL, |act, _| {
            let mut gone: Vec<Rc<RefCell<RequestSink>>> = Vec::new();
            for c in act.choices.values() {
                if c.request.borrow().sink.is_closed()
                    && !gone.iter().any(|g| Rc::ptr_eq(g, &c.request))
                {
                    gone.push(c.request.clone());
                }
            }
            for r in gone {
                let ended = EndedEarly::of_closed(&*r.borrow().sink);
                act.abort_request(&r, ended);
            }
        });
    }
}

impl Handler<SetScheduler> for DetokenizerActor {
    type Result = ();
    fn handle(&mut self, msg: SetScheduler, _: &mut Context<Self>) {
        self.scheduler = Some(msg.0);
    }
}

impl Handler<Register> for DetokenizerActor {
    type Result = ();
    fn handle(&mut self, mut msg: Register, _: &mut Context<Self>) {
        let constraints: Vec<Option<Constraint>> = msg
            .submits
            .iter()
            .map(|s| s.sampling.constraint.clone())
            .collect();
        let embed = msg.submits.iter().any(|s| s.sampling.hidden_state);
        // Every choice is the same request's: one tier, one tenant and one set of targets.
        let (tier, tenant, slo): (Arc<str>, Arc<str>, SloTargets) =
            msg.submits.first().map_or_else(
                || ("".into(), "".into(), SloTargets::default()),
                |s| {
                    (
                        s.metrics_tier.clone(),
                        s.metrics_tenant.clone(),
                        s.request.slo.clone(),
                    )
                },
            );
        // What the per-request histograms record of it, taken before the submits go.
        let (prompt_tokens, max_tokens) = msg.submits.first().map_or((0, None), |s| {
            let len = u32::try_from(s.request.prompt.len()).unwrap_or(u32::MAX);
            (len, (!embed).then_some(s.request.limits.max_tokens))
        });
        let shutting_down = || {
            Some(SubmitError::new(
                SubmitErrorKind::Unavailable,
                "the engine is shutting down",
            ))
        };
        let refusal = match (&self.closed, &self.scheduler) {
            (Some(e), _) => Some(e.clone()),
            // A closed mailbox refuses the request (do_send would drop it without a word, and
            // the request would stay registered, never scheduled); a full one still takes it.
            (None, Some(s)) => match s.try_send(Submit(std::mem::take(&mut msg.submits))) {
                Ok(()) => None,
                Err(SendError::Full(submit)) => {
                    s.do_send(submit);
                    None
                }
                Err(SendError::Closed(_)) => shutting_down(),
            },
            (None, None) => shutting_down(),
        };
        if let Some(e) = refusal {
            // Refused at the end of a drain: each choice counts as those it cut off do.
            if !msg.quiet {
                EndedEarly::Failed(failure_label(e.kind))
                    .count(msg.ids.len(), &names::outcome_labels(&tier, &tenant));
            }
            msg.sink.send(EngineOutput::Error(e));
            return;
        }
        let request = Rc::new(RefCell::new(RequestSink {
            sink: msg.sink,
            arrival: msg.arrival,
            ids: msg.ids.clone(),
            guard: Some(msg.guard),
            pending_prompt: msg.pending_prompt.clone(),
            held: Vec::new(),
            labels: names::tier_labels(&tier),
            outcome_labels: names::outcome_labels(&tier, &tenant),
            tier,
            tenant,
            slo,
            span: msg.span,
            quiet: msg.quiet,
            prompt_tokens,
            max_tokens,
            n: u32::try_from(msg.ids.len()).unwrap_or(u32::MAX),
            max_generated: 0,
            prompt_counted: false,
        }));
        let prompt_len = msg.pending_prompt.as_ref().map_or(0, |p| p.tokens.len());
        for (index, id) in msg.ids.into_iter().enumerate() {
            self.choices.insert(
                id,
                ChoiceState {
                    index: index as u32,
                    detok: IncrementalDetokenizer::new(msg.stop.clone())
                        .include_stop(msg.text.include_stop),
                    text: msg.text,
                    tokens: 0,
                    cached_prompt_tokens: 0,
                    first_at: None,
                    last_at: None,
                    scheduled_at: None,
                    request: request.clone(),
                    // Only the first choice computes the prompt's logprobs (Engine::admit).
                    prompt_logprobs: if index == 0 {
                        vec![None; prompt_len]
                    } else {
                        Vec::new()
                    },
                    constraint: constraints.get(index).cloned().flatten(),
                    embed,
                    embedding: None,
                },
            );
        }
    }
}

impl Handler<FailAll> for DetokenizerActor {
    type Result = ();
    fn handle(&mut self, msg: FailAll, _: &mut Context<Self>) {
        let mut requests: Vec<Rc<RefCell<RequestSink>>> = Vec::new();
        for c in self.choices.values() {
            if !requests.iter().any(|r| Rc::ptr_eq(r, &c.request)) {
                requests.push(c.request.clone());
            }
        }
        tracing::warn!(
            requests = requests.len(),
            error = %msg.0,
            "failing every request in flight"
        );
        // Aborted first: once a client hears of it, the scheduler has the abort queued.
        for r in requests {
            self.abort_request(&r, EndedEarly::Failed(failure_label(msg.0.kind)));
            r.borrow_mut().sink.send(EngineOutput::Error(msg.0.clone()));
        }
        self.closed = Some(msg.0);
    }
}

impl Handler<StepEvents> for DetokenizerActor {
    type Result = ();

    fn handle(&mut self, msg: StepEvents, _: &mut Context<Self>) {
        let now = Instant::now();
        if let Some((ids, error)) = msg.failed {
            let ended = EndedEarly::Failed(failure_label(error.kind));
            let mut told: Vec<Rc<RefCell<RequestSink>>> = Vec::new();
            for id in ids {
                if let Some(c) = self.choices.remove(&id) {
                    if !c.request.borrow().quiet {
                        ended.count(1, &c.request.borrow().outcome_labels);
                    }
                    if !told.iter().any(|t| Rc::ptr_eq(t, &c.request)) {
                        c.request
                            .borrow_mut()
                            .sink
                            .send(EngineOutput::Error(error.clone()));
                        told.push(c.request.clone());
                    }
                }
            }
            // Other choices of the same requests cannot complete a response any more.
            for r in told {
                self.abort_request(&r, ended);
            }
            return;
        }
        // Deltas of this step, in event order, one per choice.
        let mut deltas = StepDeltas::with_capacity(msg.events.len());
        let mut stopped: Vec<(RequestId, FinishReason)> = Vec::new();
        // Tokens generated this step, by metrics tenant (a handful at most).
        let mut generated: Vec<(Arc<str>, u64)> = Vec::new();
        for event in msg.events {
            match event {
                CoreEvent::Token {
                    id,
                    token,
                    logprob,
                    top_logprobs,
                    stops,
                } => {
                    let Some(c) = self.choices.get_mut(&id) else {
                        continue;
                    };
                    // The prompt event always precedes a choice's first delta; only the first
                    // choice knows the prompt's logprobs (the others' deltas wait for it).
                    if c.index == 0 {
                        Self::flush_prompt(&mut c.request.borrow_mut(), &c.prompt_logprobs);
                    }
                    // An embedding's token only carried its hidden state: no text, no count.
                    if c.detok.is_stopped() || c.embed {
                        continue;
                    }
                    let quiet = c.request.borrow().quiet;
                    if !quiet {
                        let tenant = &c.request.borrow().tenant;
                        match generated.iter_mut().find(|(t, _)| t == tenant) {
                            Some((_, n)) => *n += 1,
                            None => generated.push((tenant.clone(), 1)),
                        }
                    }
                    c.tokens += 1;
                    // Per choice, as vLLM per (child) request: the first token's TTFT, then one
                    // inter-token latency per step, at the choice's first token in it (the
                    // drafts a speculative step accepted arrive with it, not 0 s later).
                    match c.last_at {
                        _ if quiet => {}
                        None => {
                            let r = c.request.borrow();
                            let ttft = (now - r.arrival).as_secs_f64();
                            metrics::histogram!(names::TIME_TO_FIRST_TOKEN, r.labels.clone())
                                .record(ttft);
                            if let Some(target) = r.slo.ttft_ms {
                                names::record_slo(&r.tier, "ttft", ttft * 1e3 <= target);
                            }
                        }
                        Some(last) if !deltas.index.contains_key(&id) => {
                            metrics::histogram!(
                                names::INTER_TOKEN_LATENCY,
                                c.request.borrow().labels.clone()
                            )
                            .record((now - last).as_secs_f64());
                        }
                        Some(_) => {}
                    }
                    c.first_at.get_or_insert(now);
                    c.last_at = Some(now);
                    let text = c.text;
                    let bytes = if (stops && !text.include_stop)
                        || (text.skip_special
                            && !text.keep_special.contains(&Some(token))
                            && self.tokenizer.is_special(token))
                    {
                        &[][..]
                    } else {
                        self.tokenizer.token_bytes(token).unwrap_or(&[])
                    };
                    let d = deltas.of(id, c.index);
                    c.detok.arm(c.tokens > text.min_tokens);
                    let stopped_now = c.detok.push_into(bytes, &mut d.text);
                    d.token_ids.push(token);
                    if logprob.is_some() || !top_logprobs.is_empty() {
                        d.logprobs.push(TokenLogprobs {
                            token,
                            logprob,
                            rank: None,
                            top: top_logprobs,
                        });
                    }
                    if stopped_now {
                        d.finish = Some((FinishReason::Stop, c.tokens));
                        stopped.push((id, FinishReason::Stop));
                    }
                }
                CoreEvent::PromptLogprobs { id, entries } => {
                    let Some(c) = self.choices.get_mut(&id) else {
                        continue;
                    };
                    for e in entries {
                        if let Some(slot) = c.prompt_logprobs.get_mut(e.position) {
                            *slot = Some(TokenLogprobs {
                                token: e.token,
                                logprob: Some(e.logprob),
                                rank: Some(e.rank),
                                top: e.top_logprobs,
                            });
                        }
                    }
                    // The first choice whose prompt is complete releases the prompt event.
                    if c.index == 0 && c.prompt_logprobs.iter().skip(1).all(Option::is_some) {
                        Self::flush_prompt(&mut c.request.borrow_mut(), &c.prompt_logprobs);
                    }
                }
                CoreEvent::PromptCached { id, tokens } => {
                    let Some(c) = self.choices.get_mut(&id) else {
                        continue;
                    };
                    c.cached_prompt_tokens = tokens;
                    let mut r = c.request.borrow_mut();
                    if r.quiet {
                        continue;
                    }
                    // The prompt counts from here, computed, as vLLM counts it (not when
                    // queued: a request timed out in the queue or left before its prefill
                    // used none of it, as its tenant's token budget is told); once per prompt,
                    // whatever its `n`, at the first token of whichever choice has one first:
                    // the first choice may have been preempted, or still be computing prompt
                    // logprobs, and its client may leave before it gets one.
                    let labels = names::tenant_labels(&r.tenant);
                    if !r.prompt_counted {
                        r.prompt_counted = true;
                        metrics::counter!(names::PROMPT_TOKENS, labels.clone())
                            .increment(u64::from(r.prompt_tokens));
                    }
                    // The cached part as `usage.cached_tokens` counts it: the first choice's
                    // (another choice may have found more of the prompt cached, the first
                    // choice's own blocks).
                    if c.index == 0 {
                        metrics::counter!(names::PROMPT_TOKENS_CACHED, labels)
                            .increment(u64::from(tokens));
                    }
                }
                CoreEvent::Hidden { id, values } => {
                    if let Some(c) = self.choices.get_mut(&id) {
                        c.embedding = Some(values);
                    }
                }
                CoreEvent::Finished { id, reason } => {
                    let Some(c) = self.choices.get_mut(&id) else {
                        continue;
                    };
                    if c.detok.is_stopped() {
                        continue;
                    }
                    // A first choice that ends without a token (such as a queue timeout)
                    // still releases the prompt event, and the deltas held behind it.
                    if c.index == 0 {
                        Self::flush_prompt(&mut c.request.borrow_mut(), &c.prompt_logprobs);
                    }
                    if c.embed {
                        // Done once its prompt ran: it stopped, whatever ended its one token.
                        let d = deltas.of(id, c.index);
                        d.embedding = c.embedding.take();
                        d.finish = Some((FinishReason::Stop, 0));
                        continue;
                    }
                    let rest = c.detok.finish();
                    let d = deltas.of(id, c.index);
                    d.text.push_str(&rest.text);
                    d.finish = Some((reason, c.tokens));
                }
            }
        }
        for (tenant, n) in generated {
            metrics::counter!(names::GENERATION_TOKENS, names::tenant_labels(&tenant)).increment(n);
        }
        self.finish_in_scheduler(stopped);
        let mut gone: Vec<Rc<RefCell<RequestSink>>> = Vec::new();
        for (id, mut delta) in deltas.deltas {
            let finished = delta.finish;
            let Some(c) = self.choices.get(&id) else {
                continue;
            };
            delta.cached_prompt_tokens = c.cached_prompt_tokens;
            let request = c.request.clone();
            let index = c.index;
            let failure = finished
                .and_then(|_| c.constraint.as_ref()?.failure())
                .filter(|_| !request.borrow().sink.is_closed());
            if let Some(failure) = failure {
                self.fail_constrained(id, delta, &failure, &request);
                continue;
            }
            // A finishing choice's metrics are recorded before its last delta goes out, so
            // that a client reading /metrics right after its response sees them (the HTTP
            // layer may answer before this actor runs again). A client already gone, or one
            // the sink would cut off rather than deliver the delta to, gets none (its choices
            // count as aborted, or as failed); one whose last delta then fails to go out (it
            // left meanwhile) stays a success: the choice is gone, and the abort counts only
            // its open siblings.
            if let Some((reason, _)) = finished {
                let removed = request
                    .borrow()
                    .sink
                    .will_deliver()
                    .then(|| self.choices.remove(&id));
                let removed_here = matches!(removed, Some(Some(_)));
                if let Some(removed) = removed.filter(|_| !request.borrow().quiet) {
                    if let Some(c) = &removed {
                        record_finished_choice(&mut request.borrow_mut(), c, now);
                    }
                    if let Some(ChoiceState {
                        tokens,
                        first_at: Some(first),
                        last_at: Some(last),
                        ..
                    }) = removed
                    {
                        let r = request.borrow();
                        if tokens > 1 {
                            let tpot = (last - first).as_secs_f64() / f64::from(tokens - 1);
                            metrics::histogram!(names::TIME_PER_OUTPUT_TOKEN, r.labels.clone())
                                .record(tpot);
                            if let Some(target) = r.slo.tpot_ms {
                                names::record_slo(&r.tier, "tpot", tpot * 1e3 <= target);
                            }
                        }
                    }
                    let r = request.borrow();
                    metrics::histogram!(names::E2E_REQUEST_LATENCY, r.labels.clone())
                        .record((now - r.arrival).as_secs_f64());
                    let mut labels = r.outcome_labels.clone();
                    labels.push(metrics::Label::new(
                        names::LABEL_FINISHED_REASON,
                        reason.metric_label(),
                    ));
                    metrics::counter!(names::REQUEST_SUCCESS, labels).increment(1);
                }
                let mut r = request.borrow_mut();
                if r.ids.iter().all(|i| !self.choices.contains_key(i)) {
                    r.guard = None;
                    // The request's last choice finished (a failed or aborted one would have
                    // taken its siblings with it): once per request, as vLLM's parent request.
                    if !r.quiet && removed_here {
                        metrics::histogram!(
                            names::REQUEST_MAX_NUM_GENERATION_TOKENS,
                            r.labels.clone()
                        )
                        .record(f64::from(r.max_generated));
                        metrics::histogram!(names::REQUEST_PARAMS_N, r.labels.clone())
                            .record(f64::from(r.n));
                    }
                }
            }
            // Held until the first choice's prompt logprobs release the prompt event.
            if index != 0 && request.borrow().pending_prompt.is_some() {
                request.borrow_mut().held.push(delta);
                continue;
            }
            let delivered = request.borrow_mut().sink.send(EngineOutput::Delta(delta));
            if !delivered && !gone.iter().any(|g| Rc::ptr_eq(g, &request)) {
                gone.push(request);
            }
        }
        for r in gone {
            let ended = EndedEarly::of_closed(&*r.borrow().sink);
            self.abort_request(&r, ended);
        }
    }
}

/// Records a finished choice's per-request histograms (vLLM's, per child request): its prompt
/// and generated tokens, its `max_tokens`, and its timeline from its first scheduling: prefill
/// (to its first token), decode (first to last token) and inference (to its last token). An
/// embedding has no `max_tokens` and no token timeline; a choice never scheduled (none such
/// finishes) would have no timeline either. Notes its tokens for the request's
/// [`names::REQUEST_MAX_NUM_GENERATION_TOKENS`].
fn record_finished_choice(r: &mut RequestSink, c: &ChoiceState, now: Instant) {
    r.max_generated = r.max_generated.max(c.tokens);
    let labels = &r.labels;
    metrics::histogram!(names::REQUEST_PROMPT_TOKENS, labels.clone())
        .record(f64::from(r.prompt_tokens));
    metrics::histogram!(names::REQUEST_GENERATION_TOKENS, labels.clone())
        .record(f64::from(c.tokens));
    if let Some(max_tokens) = r.max_tokens {
        metrics::histogram!(names::REQUEST_PARAMS_MAX_TOKENS, labels.clone())
            .record(f64::from(max_tokens));
    }
    if let (Some(scheduled), Some(first), Some(last)) = (c.scheduled_at, c.first_at, c.last_at) {
        let last = last.min(now);
        metrics::histogram!(names::REQUEST_PREFILL_TIME, labels.clone())
            .record(first.saturating_duration_since(scheduled).as_secs_f64());
        metrics::histogram!(names::REQUEST_DECODE_TIME, labels.clone())
            .record(last.saturating_duration_since(first).as_secs_f64());
        metrics::histogram!(names::REQUEST_INFERENCE_TIME, labels.clone())
            .record(last.saturating_duration_since(scheduled).as_secs_f64());
    }
}

/// The choices the scheduler put in a step for the first time, and when that step was planned
/// (vLLM's SCHEDULED event): their prefill and inference times run from then. Sent before that
/// step's [`StepEvents`], so it arrives before their first token.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Scheduled {
    /// The choices first scheduled.
    pub ids: Vec<RequestId>,
    /// When the step's planning began.
    pub at: Instant,
}

impl Handler<Scheduled> for DetokenizerActor {
    type Result = ();
    fn handle(&mut self, msg: Scheduled, _: &mut Context<Self>) {
        for id in msg.ids {
            if let Some(c) = self.choices.get_mut(&id) {
                c.scheduled_at.get_or_insert(msg.at);
            }
        }
    }
}

#[cfg(test)]
#[path = "detokenizer_tests.rs"]
mod tests;
