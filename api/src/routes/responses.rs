//! `POST /v1/responses` (OpenAI's Responses API) on the chat path, and the stored responses'
//! routes: `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.
//!
//! A response created with `store` (the default) that ends `completed` or `incomplete` is kept
//! in the bounded, per-tenant [`ResponseStore`] with its conversation, for those routes and for
//! a later request's `previous_response_id` (whose conversation comes before its input). A
//! streamed response is kept once its last event is written; one whose client left, or that
//! failed, is not kept.
//!
//! `background: true` answers at once with the stored response `queued`; a task holding the
//! request's in-flight mark runs it and stores its end (`completed`, `incomplete`, or `failed`
//! with its error); `POST .../cancel` and `DELETE` abort a running one (`cancelled`). With
//! `stream: true` too, the task keeps the response's events ([`EventLog`]) and the answer
//! streams them; a client that hangs up leaves the response running, and
//! `GET /v1/responses/{id}?stream=true&starting_after=N` replays its events after `N` and follows
//! the live ones ([`replay`]). Its stream opens with `response.created` and `response.queued`
//! (the response `queued`) before `response.in_progress`.
//!
//! The request is read as a chat request ([`crate::schema::responses`]), validated and run as
//! chat runs it (the same template, tool prompt and call reader, structured output, limits,
//! tiers and tenants), and its answer is written as output items: the text a `message` item
//! with one `output_text` part, each call a `function_call` item. A [`Builder`] follows the
//! answer as it is read and writes OpenAI's semantic events (each an SSE `event:` named by its
//! `type`, with a `sequence_number` from 0): `response.created`, `response.in_progress`, per
//! item `response.output_item.added`, for a message `response.content_part.added`,
//! `response.output_text.delta`s, `response.output_text.done`, `response.content_part.done`,
//! for a call `response.function_call_arguments.delta`s and `.done`, then
//! `response.output_item.done`, and last `response.completed` (or `response.incomplete`, the
//! length limit reached). No `[DONE]` follows, as OpenAI sends none. A failure after the
//! stream began is an `error` event. The non-streaming answer is the same builder's response.
//!
//! A reasoning model's thinking (its `<think>` block, where the server reads reasoning: see
//! `model.reasoning_parser`) is read apart as chat's `reasoning_content` is, into a `reasoning`
//! item before the answer's, with one `reasoning_text` part: streamed, its item's
//! `response.output_item.added`, `response.content_part.added`, `response.reasoning_text.delta`s,
//! `response.reasoning_text.done`, `response.content_part.done`, `response.output_item.done`.
//!
//! `truncation: "auto"` fits an input (the conversation after the template) longer than the
//! context less `max_output_tokens` (less one token without it) by dropping its oldest whole
//! messages after the system ones, up to a user message, as OpenAI drops the oldest items;
//! only a last message that
//! alone is too long is cut to its last tokens, as vLLM's `truncate_prompt_tokens` cuts
//! ([`drop_oldest_messages`]). The stored conversation keeps every item.

use std::sync::Arc;

use actix_web::{web, HttpRequest, HttpResponse, ResponseError};
use bytes::Bytes;
use futures_util::future::{AbortHandle, Abortable};
use serde_json::{json, Value};

use super::chat::ChatWriter;
use super::{check_model, engine_requests};
use crate::auth::Principal;
use crate::body::read_json;
use crate::engine::FinishReason;
use crate::error::ApiError;
use crate::generation::{ChoiceDelta, Generation, RequestFields};
use crate::response_store::{
    Cancel, EventLog, ForegroundName, Kept, ResponseStore, StoredResponse, Turn, MAX_CHAIN_DEPTH,
};
use crate::schema::responses::{
    rename_error, IncompleteDetails, OutputItem, OutputLogprob, OutputText, ReasoningText,
    ResponseObject, ResponseUsage, ResponsesChat, ResponsesRequest,
};
use crate::schema::truncation::{drop_oldest_messages, Fitted};
use crate::schema::{ToolCallDelta, Usage};
use crate::sse::{event_frame, sse_response, ChunkWriter};
use crate::state::{request_id, unix_now, ApiState, InFlight};

mod replay;

/// Handles `POST /v1/responses`.
pub(crate) async fn create_response(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let in_flight = state.admit()?;
    let body: ResponsesRequest = read_json(&req, payload, &state.config()).await?;
    let id = crate::request_id::completion_id(&req, "resp_");
    body.ignored.warn("/v1/responses");
    let parent = match body.previous_response_id()? {
        Some(previous) => Some(previous_turn(&state, &principal, &previous)?),
        None => None,
    };
    let history = parent.as_deref().map(Turn::items).unwrap_or_default();
    let ResponsesChat {
        chat,
        sources,
        echo,
        stream,
        input_items,
    } = body.into_chat(&history)?;
    drop(history);
    let storing = echo.store && state.responses.limits().enabled();
    if echo.background && !storing {
        return Err(ApiError::invalid(
            "background",
            format!(
                "background = true cannot be used: storing responses is off on this server \
                 ({}), so a background response could not be read back",
                state.responses.limits().off_because
            ),
        ));
    }
    // A stored foreground response would replace the `queued` one of a background response of
    // its name (X-Request-Id) still running, whose end would then replace it in turn.
    let name = if storing && !echo.background {
        let claim = state.responses.claim_foreground(&principal.tenant, &id);
        if claim.is_none() {
            return Err(ApiError::invalid(
                "store",
                format!(
                    "a background response with the id {} is still running (X-Request-Id names \
                 responses): wait for it or cancel it, send another X-Request-Id, or store = false",
                    shown(&id)
                ),
            ));
        }
        claim
    } else {
        None
    };
    let lora = check_model(&state, &principal, chat.model.as_deref()).await?;
    let mut validated = chat
        .validate(state.engine.max_model_len(), state.config().tools)
        .map_err(|e| rename_error(e, &sources))?;
    if echo.truncation == "auto" {
        // Room for the output asked for (at least one token, as vLLM's -1 leaves).
        let room = echo.max_output_tokens.map_or(1, |m| m as usize);
        let keep = state.engine.max_model_len().saturating_sub(room).max(1);
        for prompt in validated.prompts.iter_mut() {
            let fitted = drop_oldest_messages(&*state.engine, prompt, keep, "input").await?;
            if fitted != Fitted::Whole {
                tracing::debug!(?fitted, keep, "truncation auto: the input was fitted");
            }
        }
    }
    // Reasoning tags that are special tokens stay in the text for the splitter (as on chat).
    if state.config().reasoning.is_some() {
        validated.keep_special_tokens[3..].copy_from_slice(&state.config().reasoning_tokens);
    }
    let requests = engine_requests(&id, &validated, &principal, None, lora.as_deref());
    let fields = RequestFields {
        prompt: "input",
        structured: validated.structured_field.map(|f| match f {
            "response_format" => "text.format",
            other => other,
        }),
        max_tokens: "max_output_tokens",
    };
    let meter = state.rate_limit(&principal, &req, &requests)?;
    let generation =
        Generation::start(&*state.engine, requests, validated.n, fields, meter).await?;
    let model = lora.unwrap_or_else(|| state.engine.model_name().to_owned());
    let keep = storing.then(|| Keep {
        store: Arc::clone(&state.responses),
        tenant: principal.tenant.clone(),
        input: input_items,
        parent,
        _name: name,
    });
    let reader = ChatWriter::new(
        &state,
        &validated,
        &generation,
        id.clone(),
        model.clone(),
        true,
    );
    let template = ResponseObject {
        id,
        object: "response",
        created_at: unix_now(),
        completed_at: None,
        status: "in_progress",
        error: None,
        incomplete_details: None,
        instructions: echo.instructions,
        max_output_tokens: echo.max_output_tokens,
        model,
        output: Vec::new(),
        parallel_tool_calls: echo.parallel_tool_calls,
        previous_response_id: echo.previous_response_id,
        reasoning: echo.reasoning,
        store: keep.is_some(),
        temperature: validated.sampling.temperature,
        text: echo.text,
        tool_choice: echo.tool_choice,
        tools: echo.tools,
        top_p: validated.sampling.top_p,
        truncation: echo.truncation,
        usage: None,
        user: echo.user,
        metadata: echo.metadata,
        background: echo.background,
    };
    if echo.background {
        return Ok(run_in_background(
            &state, generation, reader, template, keep, in_flight, stream,
        ));
    }
    let writer = ResponseWriter {
        reader,
        builder: Builder::new(template, stream),
        keep,
    };
    if stream {
        return Ok(sse_response(generation, writer, false, in_flight));
    }
    let response = collect(generation, writer).await?;
    drop(in_flight);
    Ok(HttpResponse::Ok().json(response))
}

/// Starts a background response: it is stored at once as `queued` (the answer), runs in a task
/// holding its in-flight mark (a drain waits for it), and is stored again when it ends
/// (`completed`, `incomplete` or `failed`, with its error); `POST .../cancel` or `DELETE` end it
/// early (`cancelled`). With `stream`, the task keeps its events in an [`EventLog`] (stored with
/// it) and the answer streams them from the first; the client hanging up ends only its stream.
fn run_in_background(
    state: &ApiState,
    generation: Generation,
    reader: ChatWriter,
    mut template: ResponseObject,
    keep: Option<Keep>,
    in_flight: InFlight,
    stream: bool,
) -> HttpResponse {
    let Some(keep) = keep else {
        // Refused before the generation started; kept total for safety.
        return ApiError::invalid("background", "background = true needs store = true")
            .error_response();
    };
    let (abort, registration) = AbortHandle::new_pair();
    let store = Arc::clone(&state.responses);
    template.status = "queued";
    let events = stream.then(EventLog::new);
    let queued = keep.stored_copy(&template, events.clone());
    let Some((run, kept)) = store.start_background(&keep.tenant, &template.id, abort, queued)
    else {
        // Dropping the generation aborts it.
        drop(generation);
        return ApiError::invalid(
            "background",
            format!(
                "a response with the id {} is still running (X-Request-Id names responses): \
                 wait for it, cancel it (background) or send another X-Request-Id",
                template.id
            ),
        )
        .error_response();
    };
    warn_not_kept(kept, &template.id);
    let queued = template.clone();
    let writer = ResponseWriter {
        reader,
        builder: Builder::new(template.clone(), stream),
        keep: None,
    };
    // The answer's reader holds the log from here, before the task can end it.
    let answer = events.as_ref().map(|log| store.hold_events(log));
    let log = events;
    let id = template.id.clone();
    actix_web::rt::spawn(async move {
        // However the task ends, its events end and stop counting as a running response's.
        let _ending = log.clone().map(|log| EndEvents {
            store: Arc::clone(&store),
            log,
        });
        let record = |frames: Vec<Bytes>| {
            if let Some(log) = &log {
                store.record_events(log, frames, false);
            }
        };
        // Its events end with the cancel's `error` event when it was cancelled (aborted, or
        // ended as the cancel came): written here as well as by the canceller, whichever comes
        // first, since this task may run between the abort and the canceller's write (on
        // another worker), and its guard would end them as an interrupted response's.
        let cancelled = || {
            if let Some(log) = &log {
                store.end_events(log, replay::cancelled_event);
            }
        };
        let ended = Abortable::new(run_response(generation, writer, record), registration).await;
        let Ok((ended, last)) = ended else {
            // Cancelled: the canceller stores it.
            cancelled();
            return;
        };
        let end = match ended {
            Ok(response) => response,
            Err(e) => {
                let body = e.to_body().error;
                template.status = "failed";
                template.error =
                    Some(json!({"code": body.code.unwrap_or(body.kind), "message": body.message}));
                template
            }
        };
        let tenant = keep.tenant.clone();
        let end = keep.stored(&end, log.clone());
        // Its last events (the response's end, or its error) and its end go in at once, and
        // only while it is still registered: a cancel or a DELETE that came first stands.
        match store.finish_background(&tenant, &id, run, last, end) {
            Some(kept) => warn_not_kept(kept, &id),
            None => cancelled(),
        }
        // Until here: a drain waits for the end to be stored and its last events written.
        drop(in_flight);
    });
    match answer {
        Some(hold) => replay::stream_events(hold, 0),
        None => HttpResponse::Ok().json(queued),
    }
}

/// Ends a background response's events however its task ends (a task dropped with the server
/// ends them with an `error` event), and stops counting them as a running response's: kept by
/// the task while it runs.
struct EndEvents {
    store: Arc<ResponseStore>,
    log: Arc<EventLog>,
}

impl Drop for EndEvents {
    fn drop(&mut self) {
        self.store.end_events(&self.log, |sequence| {
            replay::error_event(
                sequence,
                "response_interrupted",
                "The response ended without its last event: the server stopped running it.",
            )
        });
        self.store.release_events(&self.log);
    }
}

/// Logprobs in the stream events' shape (the openai SDK's `ResponseTextDeltaEvent`: no
/// bytes).
fn delta_logprobs(logprobs: &[OutputLogprob]) -> Vec<Value> {
    logprobs
        .iter()
        .map(|lp| {
            let top: Vec<Value> = lp
                .top_logprobs
                .iter()
                .map(|t| json!({"token": t.token, "logprob": t.logprob}))
                .collect();
            json!({"token": lp.token, "logprob": lp.logprob, "top_logprobs": top})
        })
        .collect()
}

/// Most characters of a requested id shown back in an error.
const SHOWN_ID_CHARS: usize = 128;

fn shown(id: &str) -> String {
    id.chars().take(SHOWN_ID_CHARS).collect()
}

/// The conversation `previous_response_id` continues: the stored response's turn.
fn previous_turn(
    state: &ApiState,
    principal: &Principal,
    previous: &str,
) -> Result<Arc<Turn>, ApiError> {
    if !state.responses.limits().enabled() {
        return Err(ApiError::invalid(
            "previous_response_id",
            format!(
                "previous_response_id cannot be used: storing responses is off on this server \
                 ({}); send the conversation's items in input",
                state.responses.limits().off_because
            ),
        ));
    }
    let stored = state
        .responses
        .get(&principal.tenant, previous)
        .ok_or_else(|| ApiError::PreviousResponseNotFound(shown(previous)))?;
    if stored.response["status"] == "queued" {
        return Err(ApiError::invalid(
            "previous_response_id",
            format!(
                "the response {} is still running in the background: continue it once it has \
                 ended (poll GET /v1/responses/{{id}})",
                shown(previous)
            ),
        ));
    }
    if stored.turn.depth() >= MAX_CHAIN_DEPTH {
        return Err(ApiError::invalid(
            "previous_response_id",
            format!(
                "the conversation already has {MAX_CHAIN_DEPTH} turns, the most one chain may \
                 hold; send its items in input instead"
            ),
        ));
    }
    Ok(stored.turn)
}

/// The stored response `id` of the caller's tenant, or the 404 of an unknown id.
fn find(state: &ApiState, principal: &Principal, id: &str) -> Result<StoredResponse, ApiError> {
    state
        .responses
        .get(&principal.tenant, id)
        .ok_or_else(|| ApiError::ResponseNotFound(shown(id)))
}

/// Handles `GET /v1/responses/{id}`: the stored response object, as it was sent (for a
/// stream, its `response.completed` or `response.incomplete` event's); with `stream=true`, the
/// events of a background response created with `stream` after `starting_after`, then the live
/// ones ([`replay`]).
pub(crate) async fn retrieve_response(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    id: web::Path<String>,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let query = replay::RetrieveQuery::parse(req.query_string())?;
    if query.stream {
        // The response and its events are looked at once: a DELETE racing this GET is either
        // before (a 404) or after (the stream ends with `response_deleted`).
        let (stored, events) = state
            .responses
            .get_for_stream(&principal.tenant, &id)
            .ok_or_else(|| ApiError::ResponseNotFound(shown(&id)))?;
        let limits = state.responses.limits();
        return replay::stream_stored(&stored, events, query.starting_after, limits);
    }
    let stored = find(&state, &principal, &id)?;
    Ok(HttpResponse::Ok().json(stored.response))
}

/// The 400 of a query parameter a route does not take, naming it (its first 64 characters)
/// and saying which it takes (`supported`).
fn unsupported_query_parameter(name: &str, supported: &str) -> ApiError {
    let shown: String = name.chars().take(64).collect();
    ApiError::invalid(
        shown.clone(),
        format!("the query parameter {shown:?} is not supported: {supported}"),
    )
}

/// Handles `DELETE /v1/responses/{id}`. Responses that continue it keep their conversation.
pub(crate) async fn delete_response(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    // A background response still running ends with it (aborted, at once: its task stores
    // nothing more), and its streams end with a `response_deleted` event.
    if !state.responses.remove(&principal.tenant, &id) {
        return Err(ApiError::ResponseNotFound(shown(&id)));
    }
    Ok(HttpResponse::Ok().json(json!({"id": *id, "object": "response", "deleted": true})))
}

/// Handles `POST /v1/responses/{id}/cancel`: a background response still running is aborted
/// and stored `cancelled`; any other is a 400.
pub(crate) async fn cancel_response(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    // Aborted, its streams ended with the cancel's `error` event and stored `cancelled`, at
    // once: its task's end, if it comes meanwhile, is not stored.
    let stored =
        match state
            .responses
            .cancel_background(&principal.tenant, &id, replay::cancelled_event)
        {
            Cancel::Cancelled(response) => return Ok(HttpResponse::Ok().json(response)),
            Cancel::NotRunning => find(&state, &principal, &id)?,
        };
    Err(ApiError::invalid(
        "response_id",
        if stored.response["background"] == true {
            "the response is not running any more: it cannot be cancelled"
        } else {
            "only responses created with background = true can be cancelled"
        },
    ))
}

/// Most items in one page of `input_items` (OpenAI's bound), and the default.
const MAX_ITEMS_PAGE: usize = 100;
const DEFAULT_ITEMS_PAGE: usize = 20;

/// Handles `GET /v1/responses/{id}/input_items?limit=&order=&after=`: the response's own input
/// items (not those of the responses it continued), newest first unless `order=asc`, as
/// OpenAI's list object.
pub(crate) async fn list_input_items(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    id: web::Path<String>,
    req: HttpRequest,
) -> Result<HttpResponse, ApiError> {
    let page = ItemsPage::parse(req.query_string())?;
    let stored = find(&state, &principal, &id)?;
    Ok(HttpResponse::Ok().json(page.list(&stored.turn.input)?))
}

/// `input_items`' query.
#[derive(Debug, PartialEq)]
struct ItemsPage {
    limit: usize,
    descending: bool,
    after: Option<String>,
}

impl ItemsPage {
    fn parse(query: &str) -> Result<Self, ApiError> {
        let pairs = web::Query::<Vec<(String, String)>>::from_query(query)
            .map_err(|_| ApiError::invalid("query", "the query string is not valid"))?
            .into_inner();
        let mut page = Self {
            limit: DEFAULT_ITEMS_PAGE,
            descending: true,
            after: None,
        };
        for (name, value) in pairs {
            match name.as_str() {
                "limit" => {
                    page.limit = value
                        .parse()
                        .ok()
                        .filter(|n| (1..=MAX_ITEMS_PAGE).contains(n))
                        .ok_or_else(|| {
                            ApiError::invalid(
                                "limit",
                                format!("limit is an integer from 1 to {MAX_ITEMS_PAGE}"),
                            )
                        })?;
                }
                "order" => {
                    page.descending = match value.as_str() {
                        "desc" => true,
                        "asc" => false,
                        _ => return Err(ApiError::invalid("order", "order is asc or desc")),
                    }
                }
                "after" => page.after = Some(value),
                other => return Err(unsupported_query_parameter(other, "limit, order and after")),
            }
        }
        Ok(page)
    }

    /// One page of `items` (in their given order) as OpenAI's list object.
    fn list(&self, items: &[Value]) -> Result<Value, ApiError> {
        let ordered: Vec<&Value> = if self.descending {
            items.iter().rev().collect()
        } else {
            items.iter().collect()
        };
        let start = match &self.after {
            None => 0,
            Some(after) => {
                ordered
                    .iter()
                    .position(|v| v.get("id").and_then(Value::as_str) == Some(after.as_str()))
                    .ok_or_else(|| {
                        ApiError::invalid(
                            "after",
                            format!(
                                "no input item of this response has the id {:?}",
                                shown(after)
                            ),
                        )
                    })?
                    + 1
            }
        };
        let data: Vec<&Value> = ordered
            .iter()
            .skip(start)
            .take(self.limit)
            .copied()
            .collect();
        let id_of = |v: Option<&&Value>| v.and_then(|v| v.get("id")).cloned();
        Ok(json!({
            "object": "list",
            "data": data,
            "first_id": id_of(data.first()),
            "last_id": id_of(data.last()),
            "has_more": start + data.len() < ordered.len(),
        }))
    }
}

/// What keeps a response once it ended: the store, and the turn it completes.
struct Keep {
    store: Arc<ResponseStore>,
    tenant: String,
    /// The request's own input items.
    input: Vec<Value>,
    /// The conversation it continued.
    parent: Option<Arc<Turn>>,
    /// A stored foreground response's claim on its name until it is kept or dropped.
    _name: Option<ForegroundName>,
}

impl Keep {
    /// `response` as it is now with `events` (a running background response's) as the store
    /// keeps it, keeping what a later [`Keep::stored`] needs.
    fn stored_copy(
        &self,
        response: &ResponseObject,
        events: Option<Arc<EventLog>>,
    ) -> StoredResponse {
        Keep {
            store: Arc::clone(&self.store),
            tenant: self.tenant.clone(),
            input: self.input.clone(),
            parent: self.parent.clone(),
            _name: None,
        }
        .stored(response, events)
    }

    /// `response` with its events, and the turn it completes, as the store keeps them.
    fn stored(self, response: &ResponseObject, events: Option<Arc<EventLog>>) -> StoredResponse {
        let output = response.output.iter().map(|item| json!(item)).collect();
        StoredResponse {
            response: json!(response),
            turn: Arc::new(Turn::new(self.input, output, self.parent)),
            events,
        }
    }

    /// Stores `response`, if kept.
    fn keep(self, response: &ResponseObject) {
        let store = Arc::clone(&self.store);
        let tenant = self.tenant.clone();
        let stored = self.stored(response, None);
        warn_not_kept(
            store.insert(&response.id, &tenant, stored.response, stored.turn),
            &response.id,
        );
    }
}

/// Warns of a response not stored as larger than the store's byte bound.
fn warn_not_kept(kept: Kept, id: &str) {
    match kept {
        Kept::Yes | Kept::Disabled => {}
        Kept::TooLarge => tracing::warn!(
            response_id = %id,
            "response not stored: larger than the store's byte bound (server.responses.max_stored_mb)"
        ),
    }
}

/// The items whose one part takes text as the model writes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TextItem {
    /// A `message` item's `output_text`.
    Message,
    /// A `reasoning` item's `reasoning_text`.
    Reasoning,
}

/// Follows one answer into output items, writing the stream's events when streaming.
struct Builder {
    response: ResponseObject,
    /// The next event's `sequence_number`.
    sequence: u64,
    /// Whether events are written (a stream) or only the items built.
    stream: bool,
    events: Vec<Bytes>,
    /// The item being written: its index in `output`.
    open: Option<usize>,
    /// Per call of the reader (its index), the call's item.
    calls: Vec<usize>,
}

impl Builder {
    fn new(response: ResponseObject, stream: bool) -> Self {
        Self {
            response,
            sequence: 0,
            stream,
            events: Vec::new(),
            open: None,
            calls: Vec::new(),
        }
    }

    /// Writes event `kind` with `fields` and the next sequence number.
    fn emit(&mut self, kind: &str, mut fields: Value) {
        if self.stream {
            if let Value::Object(map) = &mut fields {
                map.insert("type".into(), json!(kind));
                map.insert("sequence_number".into(), json!(self.sequence));
            }
            self.events.push(event_frame(kind, &fields));
        }
        self.sequence = self.sequence.saturating_add(1);
    }

    fn take(&mut self) -> Vec<Bytes> {
        std::mem::take(&mut self.events)
    }

    /// `response.created` and `response.in_progress`; for a response `queued` (a background
    /// one), `response.created` and `response.queued` with it so, then `response.in_progress`
    /// with it running.
    fn opening(&mut self) {
        let mut response = json!(self.response);
        self.emit("response.created", json!({ "response": response }));
        if self.response.status == "queued" {
            self.emit("response.queued", json!({ "response": response }));
            self.response.status = "in_progress";
            response = json!(self.response);
        }
        self.emit("response.in_progress", json!({ "response": response }));
    }

    fn item_id(&self, index: usize) -> String {
        match self.response.output.get(index) {
            Some(
                OutputItem::Message { id, .. }
                | OutputItem::FunctionCall { id, .. }
                | OutputItem::Reasoning { id, .. },
            ) => id.clone(),
            None => String::new(),
        }
    }

    /// Opens item `item` at the end of `output`.
    fn open_item(&mut self, item: OutputItem) -> usize {
        self.close(false);
        let index = self.response.output.len();
        self.emit(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        );
        self.response.output.push(item);
        self.open = Some(index);
        index
    }

    /// More answer text, written by tokens of `logprobs` (empty unless asked for): into the
    /// open message, or a new one.
    fn text(&mut self, text: &str, logprobs: Vec<OutputLogprob>) {
        self.append(TextItem::Message, text, logprobs);
    }

    /// More reasoning text: into the open reasoning item, or a new one.
    fn reasoning(&mut self, text: &str) {
        self.append(TextItem::Reasoning, text, Vec::new());
    }

    /// `text` into the open item of `kind`'s one part, or a new item (its part added empty).
    fn append(&mut self, kind: TextItem, text: &str, logprobs: Vec<OutputLogprob>) {
        let open = self.open.filter(|&i| {
            matches!(
                (kind, self.response.output.get(i)),
                (TextItem::Message, Some(OutputItem::Message { .. }))
                    | (TextItem::Reasoning, Some(OutputItem::Reasoning { .. }))
            )
        });
        let index = match open {
            Some(i) => i,
            None => {
                let (item, part) = match kind {
                    TextItem::Message => (
                        OutputItem::Message {
                            id: request_id("msg_", None),
                            status: "in_progress",
                            role: "assistant",
                            content: Vec::new(),
                        },
                        json!(OutputText::new(String::new())),
                    ),
                    TextItem::Reasoning => (
                        OutputItem::Reasoning {
                            id: request_id("rs_", None),
                            summary: Vec::new(),
                            content: Vec::new(),
                            status: "in_progress",
                        },
                        json!(ReasoningText::new(String::new())),
                    ),
                };
                let index = self.open_item(item);
                let item_id = self.item_id(index);
                self.emit(
                    "response.content_part.added",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0,
                           "part": part}),
                );
                match self.response.output.get_mut(index) {
                    Some(OutputItem::Message { content, .. }) => {
                        content.push(OutputText::new(String::new()));
                    }
                    Some(OutputItem::Reasoning { content, .. }) => {
                        content.push(ReasoningText::new(String::new()));
                    }
                    _ => {}
                }
                index
            }
        };
        if text.is_empty() {
            return;
        }
        let event_logprobs = delta_logprobs(&logprobs);
        match self.response.output.get_mut(index) {
            Some(OutputItem::Message { content, .. }) => {
                if let Some(part) = content.first_mut() {
                    part.text.push_str(text);
                    part.logprobs.extend(logprobs);
                }
            }
            Some(OutputItem::Reasoning { content, .. }) => {
                if let Some(part) = content.first_mut() {
                    part.text.push_str(text);
                }
            }
            _ => {}
        }
        let item_id = self.item_id(index);
        let (event, fields) = match kind {
            TextItem::Message => (
                "response.output_text.delta",
                json!({"item_id": item_id, "output_index": index, "content_index": 0,
                       "delta": text, "logprobs": event_logprobs}),
            ),
            TextItem::Reasoning => (
                "response.reasoning_text.delta",
                json!({"item_id": item_id, "output_index": index, "content_index": 0,
                       "delta": text}),
            ),
        };
        self.emit(event, fields);
    }

    /// A call opened or its arguments written (the reader's delta).
    fn call(&mut self, call: ToolCallDelta) {
        let index = match (call.id, call.function.name) {
            (Some(call_id), name) => {
                let index = self.open_item(OutputItem::FunctionCall {
                    id: request_id("fc_", None),
                    call_id,
                    name: name.unwrap_or_default(),
                    arguments: String::new(),
                    status: "in_progress",
                });
                self.calls.push(index);
                index
            }
            (None, _) => match usize::try_from(call.index)
                .ok()
                .and_then(|i| self.calls.get(i))
            {
                Some(&index) => index,
                None => return,
            },
        };
        let delta = call.function.arguments;
        if delta.is_empty() {
            return;
        }
        if let Some(OutputItem::FunctionCall { arguments, .. }) =
            self.response.output.get_mut(index)
        {
            arguments.push_str(&delta);
        }
        let item_id = self.item_id(index);
        self.emit(
            "response.function_call_arguments.delta",
            json!({"item_id": item_id, "output_index": index, "delta": delta}),
        );
    }

    /// Closes the open item (`incomplete`: the length limit cut it).
    fn close(&mut self, incomplete: bool) {
        let Some(index) = self.open.take() else {
            return;
        };
        let item_id = self.item_id(index);
        let Some(item) = self.response.output.get_mut(index) else {
            return;
        };
        match item {
            OutputItem::Message { status, .. }
            | OutputItem::FunctionCall { status, .. }
            | OutputItem::Reasoning { status, .. } => {
                *status = if incomplete {
                    "incomplete"
                } else {
                    "completed"
                };
            }
        }
        let item = item.clone();
        match &item {
            OutputItem::Message { content, .. } => {
                let part = content
                    .first()
                    .cloned()
                    .unwrap_or_else(|| OutputText::new(String::new()));
                self.emit(
                    "response.output_text.done",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0,
                           "text": part.text, "logprobs": delta_logprobs(&part.logprobs)}),
                );
                self.emit(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0,
                           "part": part}),
                );
            }
            OutputItem::Reasoning { content, .. } => {
                let part = content
                    .first()
                    .cloned()
                    .unwrap_or_else(|| ReasoningText::new(String::new()));
                self.emit(
                    "response.reasoning_text.done",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0,
                           "text": part.text}),
                );
                self.emit(
                    "response.content_part.done",
                    json!({"item_id": item_id, "output_index": index, "content_index": 0,
                           "part": part}),
                );
            }
            OutputItem::FunctionCall {
                arguments, name, ..
            } => {
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": item_id, "output_index": index,
                           "arguments": arguments, "name": name}),
                );
            }
        }
        self.emit(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        );
    }

    /// OpenAI's `error` event: the error body's `code` (its `type` where it has none),
    /// `message` and `param`.
    fn error(&mut self, error: &ApiError) {
        let body = error.to_body().error;
        self.emit(
            "error",
            json!({"code": body.code.unwrap_or(body.kind), "message": body.message,
                   "param": body.param}),
        );
    }

    /// The answer ended: closes the open item (a message with empty text where nothing was
    /// written and text was allowed) and writes the final response.
    fn finish(&mut self, reason: FinishReason, usage: ResponseUsage, text_allowed: bool) {
        if self.response.output.is_empty() && text_allowed {
            self.text("", Vec::new());
        }
        let incomplete = reason == FinishReason::Length;
        self.close(incomplete);
        self.response.usage = Some(usage);
        if incomplete {
            self.response.status = "incomplete";
            self.response.incomplete_details = Some(IncompleteDetails {
                reason: "max_output_tokens",
            });
        } else {
            self.response.status = "completed";
            self.response.completed_at = Some(unix_now());
        }
        let response = json!(self.response);
        let kind = if incomplete {
            "response.incomplete"
        } else {
            "response.completed"
        };
        self.emit(kind, json!({ "response": response }));
    }
}

struct ResponseWriter {
    /// Chat's reader of the model's text into content and calls.
    reader: ChatWriter,
    builder: Builder,
    /// Where the ended response is kept (`None`: not stored).
    keep: Option<Keep>,
}

impl ResponseWriter {
    /// Reads one delta into the builder; the finish reason when it is the last.
    fn push(&mut self, delta: ChoiceDelta) -> Option<FinishReason> {
        let d = delta.delta;
        let finish = d.finish.map(|f| f.reason);
        let read = self
            .reader
            .read(delta.choice, d.text, d.logprobs, finish.is_some());
        if !read.reasoning.is_empty() {
            self.builder.reasoning(&read.reasoning);
        }
        if !read.content.is_empty() {
            // The chunk's tokens' logprobs go with its answer text (with a reasoning model, a
            // chunk that ends the thinking and begins the answer gives them all to the answer).
            self.builder
                .text(&read.content, OutputLogprob::from_engine(&read.logprobs));
        }
        for call in read.calls {
            self.builder.call(call);
        }
        finish
    }
}

impl ChunkWriter for ResponseWriter {
    fn opening(&mut self, _generation: &Generation) -> Vec<Bytes> {
        self.builder.opening();
        self.builder.take()
    }

    fn delta(&mut self, delta: ChoiceDelta) -> Option<Bytes> {
        let finish = self.push(delta);
        if let Some(reason) = finish {
            // The response's own end waits for the usage (`closing`).
            self.builder.response.status = match reason {
                FinishReason::Length => "incomplete",
                FinishReason::Stop => "completed",
            };
        }
        let events = self.builder.take();
        (!events.is_empty()).then(|| Bytes::from(events.concat()))
    }

    fn usage(&self, _usage: Usage) -> Bytes {
        Bytes::new()
    }

    fn closing(&mut self, usage: Usage, _include_usage: bool) -> Vec<Bytes> {
        let reason = if self.builder.response.status == "incomplete" {
            FinishReason::Length
        } else {
            FinishReason::Stop
        };
        let text_allowed = !self.reader.calls_only();
        self.builder.finish(
            reason,
            ResponseUsage::new(
                usage.prompt_tokens,
                usage.prompt_tokens_details.cached_tokens,
                usage.completion_tokens,
            ),
            text_allowed,
        );
        if let Some(keep) = self.keep.take() {
            keep.keep(&self.builder.response);
        }
        self.builder.take()
    }

    fn failed(&mut self, error: &ApiError) -> Vec<Bytes> {
        self.builder.error(error);
        self.builder.take()
    }
}

async fn collect(
    generation: Generation,
    writer: ResponseWriter,
) -> Result<ResponseObject, ApiError> {
    run_response(generation, writer, |_| {}).await.0
}

/// Runs the answer through `writer` to its end: the response (or the error that ended it),
/// and, when the builder writes events, its last ones (the response's end, or the `error`
/// event) held back for the caller; `record` takes the others as they come, the opening first.
async fn run_response(
    mut generation: Generation,
    mut writer: ResponseWriter,
    mut record: impl FnMut(Vec<Bytes>),
) -> (Result<ResponseObject, ApiError>, Vec<Bytes>) {
    if writer.builder.stream {
        writer.builder.opening();
        record(writer.builder.take());
    }
    let mut reason = FinishReason::Stop;
    let mut completion_tokens = 0u32;
    while let Some(delta) = generation.next().await {
        let delta = match delta {
            Ok(delta) => delta,
            Err(e) => {
                writer.builder.error(&e);
                return (Err(e), writer.builder.take());
            }
        };
        if let Some(finish) = &delta.delta.finish {
            completion_tokens = completion_tokens.saturating_add(finish.completion_tokens);
        }
        if let Some(r) = writer.push(delta) {
            reason = r;
        }
        let events = writer.builder.take();
        if !events.is_empty() {
            record(events);
        }
    }
    let usage = ResponseUsage::new(
        generation.total_prompt_tokens(),
        generation.total_cached_prompt_tokens(),
        completion_tokens,
    );
    let text_allowed = !writer.reader.calls_only();
    writer.builder.finish(reason, usage, text_allowed);
    if let Some(keep) = writer.keep.take() {
        keep.keep(&writer.builder.response);
    }
    let last = writer.builder.take();
    (Ok(writer.builder.response), last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::FunctionCallDelta;

    fn template() -> ResponseObject {
        ResponseObject {
            id: "resp_1".into(),
            object: "response",
            created_at: 1,
            completed_at: None,
            status: "in_progress",
            error: None,
            incomplete_details: None,
            instructions: None,
            max_output_tokens: None,
            model: "m".into(),
            output: Vec::new(),
            parallel_tool_calls: true,
            previous_response_id: None,
            reasoning: None,
            store: true,
            temperature: 1.0,
            text: json!({"format": {"type": "text"}}),
            tool_choice: json!("auto"),
            tools: Vec::new(),
            top_p: 1.0,
            truncation: "disabled",
            usage: None,
            user: None,
            metadata: serde_json::Map::new(),
            background: false,
        }
    }

    /// The events' JSON, each checked against its `event:` line.
    fn events(frames: &[Bytes]) -> Vec<Value> {
        let text: String = frames
            .iter()
            .map(|f| String::from_utf8(f.to_vec()).unwrap())
            .collect();
        text.split_terminator("\n\n")
            .map(|frame| {
                let (event, data) = frame
                    .strip_prefix("event: ")
                    .and_then(|f| f.split_once("\ndata: "))
                    .unwrap();
                let v: Value = serde_json::from_str(data).unwrap();
                assert_eq!(v["type"], event);
                v
            })
            .collect()
    }

    fn call(index: u32, id: Option<&str>, name: Option<&str>, arguments: &str) -> ToolCallDelta {
        ToolCallDelta {
            index,
            id: id.map(str::to_owned),
            kind: id.map(|_| "function"),
            function: FunctionCallDelta {
                name: name.map(str::to_owned),
                arguments: arguments.to_owned(),
            },
        }
    }

    /// Text, then two calls: each item closes before the next opens, in OpenAI's order
    /// (the event names are the openai SDK's `ResponseStreamEvent` types).
    #[test]
    fn items_follow_each_other_in_openais_order() {
        let mut b = Builder::new(template(), true);
        b.opening();
        b.text("Let me ", Vec::new());
        b.text("check.", Vec::new());
        b.call(call(0, Some("call_a"), Some("f"), "{\"x\":"));
        b.call(call(0, None, None, "1}"));
        b.call(call(1, Some("call_b"), Some("g"), "{}"));
        b.finish(FinishReason::Stop, ResponseUsage::new(3, 0, 9), true);
        let e = events(&b.take());
        let kinds: Vec<&str> = e.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        for (i, e) in e.iter().enumerate() {
            assert_eq!(e["sequence_number"], json!(i));
        }
        assert_eq!(e[6]["text"], "Let me check.");
        assert_eq!(e[12]["arguments"], "{\"x\":1}");
        assert_eq!(e[12]["output_index"], 1);
        assert_eq!(e[16]["output_index"], 2);
        let end = &e[18]["response"];
        assert_eq!(end["status"], "completed");
        assert_eq!(end["output"][0]["content"][0]["text"], "Let me check.");
        assert_eq!(end["output"][1]["call_id"], "call_a");
        assert_eq!(end["output"][1]["status"], "completed");
        assert_eq!(end["output"][2]["name"], "g");
        assert_eq!(end["usage"]["total_tokens"], 12);
    }

    /// Reasoning, then the answer: a `reasoning` item with one `reasoning_text` part before the
    /// message (event and part names from the openai SDK's `ResponseReasoningTextDeltaEvent`,
    /// `ResponseReasoningTextDoneEvent`, `ResponseContentPartAddedEvent.PartReasoningText`,
    /// `ResponseReasoningItem`); cut short while thinking, the reasoning item is incomplete
    /// and there is no message.
    #[test]
    fn reasoning_comes_as_its_own_item_before_the_answer() {
        let mut b = Builder::new(template(), true);
        b.opening();
        b.reasoning("The user asks ");
        b.reasoning("for a capital.");
        b.text("Paris.", Vec::new());
        b.finish(FinishReason::Stop, ResponseUsage::new(3, 0, 9), true);
        let e = events(&b.take());
        let kinds: Vec<&str> = e.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.reasoning_text.delta",
                "response.reasoning_text.delta",
                "response.reasoning_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(e[2]["item"]["type"], "reasoning");
        assert_eq!(e[2]["item"]["summary"], json!([]));
        assert_eq!(e[3]["part"], json!({"type": "reasoning_text", "text": ""}));
        assert_eq!(e[4]["item_id"], e[2]["item"]["id"]);
        assert!(e[2]["item"]["id"].as_str().unwrap().starts_with("rs_"));
        assert_eq!(e[6]["text"], "The user asks for a capital.");
        assert_eq!(e[8]["item"]["status"], "completed");
        assert_eq!(e[9]["output_index"], 1);
        let end = &e[15]["response"];
        assert_eq!(
            end["output"][0]["content"],
            json!([{"type": "reasoning_text", "text": "The user asks for a capital."}])
        );
        assert_eq!(end["output"][1]["content"][0]["text"], "Paris.");

        let mut b = Builder::new(template(), false);
        b.reasoning("Hmm, let me");
        b.finish(FinishReason::Length, ResponseUsage::new(3, 0, 4), true);
        let r = json!(b.response);
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["output"].as_array().map(Vec::len), Some(1));
        assert_eq!(r["output"][0]["type"], "reasoning");
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert!(b.events.is_empty());
    }

    /// An answer cut at the limit: the open item and the response are incomplete; an answer
    /// with no text at all still has its (empty) message, unless it may only call.
    #[test]
    fn a_cut_answer_is_incomplete_and_an_empty_one_has_an_empty_message() {
        let mut b = Builder::new(template(), false);
        b.text("abc", Vec::new());
        b.finish(FinishReason::Length, ResponseUsage::new(1, 0, 2), true);
        assert!(b.take().is_empty(), "no events unless streaming");
        let r = json!(b.response);
        assert_eq!(r["status"], "incomplete");
        assert_eq!(r["incomplete_details"]["reason"], "max_output_tokens");
        assert_eq!(r["output"][0]["status"], "incomplete");
        assert!(r.get("completed_at").is_none());

        let mut b = Builder::new(template(), false);
        b.finish(FinishReason::Stop, ResponseUsage::new(1, 0, 1), true);
        let r = json!(b.response);
        assert_eq!(r["output"][0]["content"][0]["text"], "");
        assert!(r["completed_at"].is_u64());
        let mut b = Builder::new(template(), false);
        b.finish(FinishReason::Stop, ResponseUsage::new(1, 0, 1), false);
        assert_eq!(json!(b.response)["output"], json!([]));
    }

    /// Logprobs go into the message's part (with bytes, as the SDK's `ResponseOutputText`) and
    /// into each delta event and the done event (without bytes, as its `ResponseTextDeltaEvent`).
    #[test]
    fn logprobs_follow_the_text_into_the_part_and_the_events() {
        let lp = |token: &str, logprob: f32| crate::engine::TokenLogprob {
            token_id: 0,
            token: token.to_owned(),
            bytes: token.as_bytes().to_vec(),
            logprob: Some(logprob),
            rank: None,
            top: vec![crate::engine::TopLogprob {
                token_id: 1,
                token: "x".to_owned(),
                bytes: b"x".to_vec(),
                logprob: -3.0,
            }],
        };
        let mut b = Builder::new(template(), true);
        b.opening();
        b.take();
        b.text("Pa", OutputLogprob::from_engine(&[lp("Pa", -0.5)]));
        b.text("ris", OutputLogprob::from_engine(&[lp("ris", -0.25)]));
        b.finish(FinishReason::Stop, ResponseUsage::new(1, 0, 2), true);
        let e = events(&b.take());
        let deltas: Vec<&Value> = e
            .iter()
            .filter(|e| e["type"] == "response.output_text.delta")
            .collect();
        assert_eq!(
            deltas[1]["logprobs"],
            json!([{"token": "ris", "logprob": -0.25,
                    "top_logprobs": [{"token": "x", "logprob": -3.0}]}])
        );
        let done = e
            .iter()
            .find(|e| e["type"] == "response.output_text.done")
            .expect("done");
        assert_eq!(done["logprobs"].as_array().map(Vec::len), Some(2));
        let part = &json!(b.response)["output"][0]["content"][0];
        assert_eq!(
            part["logprobs"][0],
            json!({"token": "Pa", "bytes": [80, 97], "logprob": -0.5,
                   "top_logprobs": [{"token": "x", "bytes": [120], "logprob": -3.0}]})
        );
    }

    /// A failure mid-stream is OpenAI's `error` event (`code`, `message`, `param`).
    #[test]
    fn a_failure_is_an_error_event() {
        let mut b = Builder::new(template(), true);
        b.opening();
        b.take();
        b.error(&ApiError::invalid("input", "too long"));
        let e = events(&b.take());
        assert_eq!(e.len(), 1);
        assert_eq!(e[0]["type"], "error");
        assert_eq!(e[0]["sequence_number"], 2);
        assert_eq!(e[0]["param"], "input");
        assert_eq!(e[0]["message"], "too long");
        assert_eq!(e[0]["code"], "invalid_request_error");
    }
}
