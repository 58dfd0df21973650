//! Models, tokenizer, health, readiness, metrics and admin routes.

use std::collections::HashSet;

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde::{Deserialize, Serialize};

use super::check_model;
use crate::auth::Principal;
use crate::body::{from_value, read_json};
use crate::engine::{
    EngineError, EngineErrorKind, PolicySpec, SpeculativeMethod, SpeculativeSettings,
    TokenizeInput, DEFAULT_PROMPT_LOOKUP_MAX, DEFAULT_PROMPT_LOOKUP_MIN, MAX_PROMPT_LOOKUP,
    MAX_SPECULATIVE_RUNNING, MAX_SPECULATIVE_TOKENS,
};
use crate::error::ApiError;
use crate::schema::tools::ToolUse;
use crate::schema::{
    chat_ending, check_continued, offer_tools, parse_messages, parse_template_kwargs,
    IgnoredFields, MessageField, ModelCard, ModelList, MAX_DETOKENIZE_TOKENS,
};
use crate::state::{engine_dead, ApiState};

/// A model card of the served model (`parent: None`) or of an adapter on it.
fn model_card(state: &ApiState, id: String, parent: Option<String>) -> ModelCard {
    ModelCard {
        id,
        object: "model",
        created: state.started,
        owned_by: "switchyard",
        max_model_len: state.engine.max_model_len(),
        parent,
    }
}

/// `GET /v1/models`: the base model, then every LoRA adapter served on it that the caller's
/// key may name: the registered ones, in registration order, then those `lora.adapter_dirs`
/// hold now and a request would find there (sorted by name; nothing is loaded by listing).
pub(crate) async fn list_models(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
) -> HttpResponse {
    let base = state.engine.model_name().to_owned();
    let registered = state.engine.lora_adapters();
    let found = match state.engine.lora_adapters_in_directories().await {
        Ok(found) => found,
        Err(e) => {
            tracing::warn!(error = %e.message, "adapters in lora.adapter_dirs not listed");
            Vec::new()
        }
    };
    let mut data = vec![model_card(&state, base.clone(), None)];
    // Each name once: a registration wins over a directory's adapter of the same name.
    let mut names: Vec<String> = registered.into_iter().map(|a| a.name).collect();
    let mut seen: HashSet<String> = names.iter().cloned().collect();
    seen.insert(base.clone());
    names.extend(found.into_iter().filter(|name| seen.insert(name.clone())));
    data.extend(
        names
            .into_iter()
            .filter(|name| principal.adapters.allows(name))
            .map(|name| model_card(&state, name, Some(base.clone()))),
    );
    HttpResponse::Ok().json(ModelList {
        object: "list",
        data,
    })
}

/// `GET /v1/models/{id}` (the OpenAI SDK's `models.retrieve`): the model as a request naming
/// it would be served (an adapter of `lora.adapter_dirs` is found as a completion's name check
/// finds it, without loading it), or 404 `model_not_found`.
pub(crate) async fn retrieve_model(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let id = id.into_inner();
    let base = state.engine.model_name().to_owned();
    let card = match check_model(&state, &principal, Some(&id)).await? {
        None => model_card(&state, base, None),
        Some(adapter) => model_card(&state, adapter, Some(base)),
    };
    Ok(HttpResponse::Ok().json(card))
}

/// Body of `POST /tokenize` (vLLM's shape): a `prompt`, or chat `messages` with the `tools`
/// (and `tool_choice`, `parallel_tool_calls`) a chat completion would offer. Other fields
/// (vLLM's `return_token_strs`, a misspelt `add_special_token`) are accepted and named in the
/// warning completions log.
#[derive(Debug, Deserialize)]
pub(crate) struct TokenizeRequest {
    model: Option<String>,
    prompt: Option<String>,
    messages: Option<Vec<MessageField>>,
    tools: Option<serde_json::Value>,
    tool_choice: Option<serde_json::Value>,
    parallel_tool_calls: Option<bool>,
    add_special_tokens: Option<bool>,
    add_generation_prompt: Option<bool>,
    continue_final_message: Option<bool>,
    chat_template_kwargs: Option<serde_json::Value>,
    /// Fields `/tokenize` does not read (logged, see [`IgnoredFields`]).
    #[serde(flatten)]
    ignored: IgnoredFields,
}

/// Response of `POST /tokenize`.
#[derive(Debug, Serialize)]
pub(crate) struct TokenizeResponse {
    count: usize,
    max_model_len: usize,
    tokens: Vec<u32>,
}

/// `POST /tokenize`.
pub(crate) async fn tokenize(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: TokenizeRequest = read_json(&req, payload, &state.config()).await?;
    body.ignored.warn("/tokenize");
    check_model(&state, &principal, body.model.as_deref()).await?;
    let input = match (body.prompt, body.messages) {
        (Some(_), None) if body.tools.is_some() => {
            return Err(ApiError::invalid(
                "tools",
                "tools are offered with chat `messages`, not with a `prompt`",
            ))
        }
        (Some(text), None) => TokenizeInput::Text {
            text,
            add_special_tokens: body.add_special_tokens.unwrap_or(true),
        },
        (None, Some(messages)) => {
            let ending = chat_ending(body.add_generation_prompt, body.continue_final_message)?;
            let setup = state.config().tools;
            let tools = ToolUse::parse(
                body.tools.as_ref(),
                body.tool_choice.as_ref(),
                body.parallel_tool_calls,
                setup,
            )?;
            let mut messages = parse_messages(messages, setup)?;
            check_continued(&messages, ending)?;
            let mut template_kwargs = parse_template_kwargs(body.chat_template_kwargs)?;
            let client_kwargs = template_kwargs.keys().cloned().collect();
            offer_tools(tools.as_ref(), setup, &mut messages, &mut template_kwargs)?;
            TokenizeInput::Chat {
                messages,
                ending,
                template_kwargs,
                client_kwargs,
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "prompt",
                "send exactly one of `prompt` and `messages`",
            ))
        }
    };
    let tokens = state.engine.tokenize(input).await?;
    Ok(HttpResponse::Ok().json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.engine.max_model_len(),
        tokens,
    }))
}

/// Body of `POST /detokenize`; other fields are accepted and named in a warning.
#[derive(Debug, Deserialize)]
pub(crate) struct DetokenizeRequest {
    model: Option<String>,
    tokens: Vec<u32>,
    /// Fields `/detokenize` does not read (logged, see [`IgnoredFields`]).
    #[serde(flatten)]
    ignored: IgnoredFields,
}

/// Response of `POST /detokenize`.
#[derive(Debug, Serialize)]
pub(crate) struct DetokenizeResponse {
    prompt: String,
}

/// `POST /detokenize`.
pub(crate) async fn detokenize(
    state: web::Data<ApiState>,
    principal: web::ReqData<Principal>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: DetokenizeRequest = read_json(&req, payload, &state.config()).await?;
    body.ignored.warn("/detokenize");
    check_model(&state, &principal, body.model.as_deref()).await?;
    if body.tokens.len() > MAX_DETOKENIZE_TOKENS {
        return Err(ApiError::invalid(
            "tokens",
            format!("at most {MAX_DETOKENIZE_TOKENS} tokens"),
        ));
    }
    let prompt = state.engine.detokenize(body.tokens).await?;
    Ok(HttpResponse::Ok().json(DetokenizeResponse { prompt }))
}

/// Whether the engine can serve: an error once its backend was retired, and while a backend
/// call has run past its limit (stalled).
fn check_engine(state: &ApiState) -> Result<(), ApiError> {
    if !state.engine.is_alive() {
        return Err(engine_dead());
    }
    match state.engine.stall() {
        Some(stall) => Err(ApiError::EngineStalled(stall)),
        None => Ok(()),
    }
}

/// `GET /health`: 200 while the process is alive and its engine can serve: 503 once the
/// engine's backend was retired, and 503 `engine_stalled` while a backend call has run past
/// `scheduler.step_timeout_s`, so that an orchestrator restarts the process.
pub(crate) async fn health(state: web::Data<ApiState>) -> Result<HttpResponse, ApiError> {
    check_engine(&state)?;
    Ok(HttpResponse::Ok().finish())
}

/// `GET /version`: the server's version (this crate's, the workspace's), as vLLM's `/version`
/// answers with its own: `{"version": "0.1.0"}`. Open to every caller, as `/health` is
/// (vLLM asks for a key on `/v1` paths only), and answered whatever the engine's state.
pub(crate) async fn version() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({"version": env!("CARGO_PKG_VERSION")}))
}

/// `GET /ready`: 200 once the engine is ready, 503 before, while draining, once the engine
/// cannot serve and while it is stalled.
pub(crate) async fn ready(state: web::Data<ApiState>) -> Result<HttpResponse, ApiError> {
    if state.is_draining() {
        return Err(ApiError::Draining);
    }
    check_engine(&state)?;
    if !state.engine.is_ready() {
        return Err(ApiError::Engine(EngineError::new(
            EngineErrorKind::Unavailable,
            "The model is still loading.",
        )));
    }
    Ok(HttpResponse::Ok().json(serde_json::json!({"status": "ready"})))
}

/// `GET /metrics`: Prometheus text exposition, without the series of a tenant or tier no
/// longer configured (a reload removed it; the exporter still holds them, and they come back
/// if it is configured again: [`crate::metrics::ConfiguredLabels`]).
pub(crate) async fn metrics(state: web::Data<ApiState>) -> Result<HttpResponse, ApiError> {
    let handle = state.metrics.as_ref().ok_or(ApiError::MetricsDisabled)?;
    handle.run_upkeep();
    let exposition = state.metric_labels().retain_configured(&handle.render());
    Ok(HttpResponse::Ok()
        .insert_header((
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        ))
        .body(exposition))
}

/// `GET /admin/policy`.
pub(crate) async fn get_policy(state: web::Data<ApiState>) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(state.engine.policy().await?))
}

/// What a `PUT /admin/policy` body must be, said when it is not an object.
const POLICY_BODY: &str = "the body must be a JSON object with `name` (a registered policy) and \
                           optionally `params`, as GET /admin/policy shows them";

/// `PUT /admin/policy`: hot-swaps the scheduling policy; the policy in force with the same
/// parameters is kept (`"changed": false`), as a configuration reload keeps it.
pub(crate) async fn put_policy(
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: serde_json::Value = read_json(&req, payload, &state.config()).await?;
    // Only an object. `from_value` refuses an array too (serde would read one as the fields
    // in order, `["fcfs"]` a swap), but this says what the body must be.
    let spec: PolicySpec = match body {
        body @ serde_json::Value::Object(_) => from_value(body)?,
        _ => {
            return Err(ApiError::InvalidRequest {
                message: POLICY_BODY.to_owned(),
                param: None,
            })
        }
    };
    if spec.name.is_empty() || spec.name.len() > 64 {
        return Err(ApiError::invalid(
            "name",
            "policy name must be 1 to 64 bytes",
        ));
    }
    let name = spec.name.clone();
    let swap = state.engine.swap_policy(spec).await?;
    if swap.changed {
        tracing::info!(requested = %name, policy = %swap.policy.name, "scheduling policy swapped through the admin API");
    } else {
        tracing::info!(policy = %swap.policy.name, "scheduling policy unchanged: the admin API asked for the policy in force");
    }
    Ok(HttpResponse::Ok().json(swap))
}

/// `GET /admin/speculative`: the speculative decoding settings in force (`null`: off).
pub(crate) async fn get_speculative(state: web::Data<ApiState>) -> Result<HttpResponse, ApiError> {
    Ok(HttpResponse::Ok().json(state.engine.speculative().await?))
}

/// Body of `PUT /admin/speculative`: the fields of the configuration's `speculative:` section,
/// the lookup bounds optional so that a refusal can tell a default from a value sent.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpeculativeBody {
    #[serde(default)]
    method: SpeculativeMethod,
    num_speculative_tokens: usize,
    prompt_lookup_min: Option<usize>,
    prompt_lookup_max: Option<usize>,
    #[serde(default)]
    max_running: usize,
}

/// What a body that is neither an object nor `null` is told.
const SPECULATIVE_BODY: &str = "the body must be a JSON object with `num_speculative_tokens` \
     and optionally `method` (\"ngram\"), `prompt_lookup_min`, `prompt_lookup_max` and \
     `max_running`, or `null` to turn speculative decoding off";

impl SpeculativeBody {
    /// Checks the bounds the configuration's `speculative:` section has, naming the field at
    /// fault and saying where a bound came from a default.
    fn check(self) -> Result<SpeculativeSettings, ApiError> {
        let n = self.num_speculative_tokens;
        if n == 0 || n > MAX_SPECULATIVE_TOKENS {
            return Err(ApiError::invalid(
                "num_speculative_tokens",
                format!("num_speculative_tokens must be 1 to {MAX_SPECULATIVE_TOKENS}, got {n}"),
            ));
        }
        let described = |value: Option<usize>, default: usize| match value {
            Some(v) => (v, v.to_string()),
            None => (
                default,
                format!("{default}, the default, as it was not sent"),
            ),
        };
        let (max, max_text) = described(self.prompt_lookup_max, DEFAULT_PROMPT_LOOKUP_MAX);
        let (min, min_text) = described(self.prompt_lookup_min, DEFAULT_PROMPT_LOOKUP_MIN);
        if max == 0 || max > MAX_PROMPT_LOOKUP {
            return Err(ApiError::invalid(
                "prompt_lookup_max",
                format!("prompt_lookup_max must be 1 to {MAX_PROMPT_LOOKUP}, got {max}"),
            ));
        }
        if min == 0 || min > max {
            // Name the field the client sent: a default it never saw is not its fault.
            let param = if self.prompt_lookup_min.is_none() {
                "prompt_lookup_max"
            } else {
                "prompt_lookup_min"
            };
            return Err(ApiError::invalid(
                param,
                format!(
                    "prompt_lookup_min ({min_text}) must be 1 to prompt_lookup_max ({max_text})"
                ),
            ));
        }
        if self.max_running > MAX_SPECULATIVE_RUNNING {
            return Err(ApiError::invalid(
                "max_running",
                format!(
                    "max_running must be at most {MAX_SPECULATIVE_RUNNING} (0: no limit), got {}",
                    self.max_running
                ),
            ));
        }
        Ok(SpeculativeSettings {
            method: self.method,
            num_speculative_tokens: n,
            prompt_lookup_min: min,
            prompt_lookup_max: max,
            max_running: self.max_running,
        })
    }
}

/// `PUT /admin/speculative`: new settings (`{"num_speculative_tokens": 4, ...}`, the
/// configuration's `speculative:` section as JSON), or `null` to turn speculative decoding off;
/// from the next step on.
pub(crate) async fn put_speculative(
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: serde_json::Value = read_json(&req, payload, &state.config()).await?;
    let settings = match body {
        serde_json::Value::Null => None,
        // Only an object (`from_value` refuses an array too, in serde's words; this says
        // what the body must be).
        body @ serde_json::Value::Object(_) => Some(from_value::<SpeculativeBody>(body)?.check()?),
        _ => {
            return Err(ApiError::InvalidRequest {
                message: SPECULATIVE_BODY.to_owned(),
                param: None,
            })
        }
    };
    let info = state.engine.set_speculative(settings).await?;
    tracing::info!(settings = ?info, "speculative decoding set through the admin API");
    Ok(HttpResponse::Ok().json(info))
}

/// Body of `POST /admin/lora` and vLLM's `POST /v1/load_lora_adapter` (vLLM's fields and
/// `pinned`). Other fields are accepted, as vLLM accepts them, and named in one warning.
#[derive(Debug, Deserialize)]
pub(crate) struct LoadLoraRequest {
    lora_name: String,
    lora_path: String,
    /// Replace the adapter served under `lora_name`, if any, without a moment when the name
    /// is missing (vLLM's field; default false: a name already served is refused).
    #[serde(default)]
    load_inplace: bool,
    /// Keep the adapter in memory while it is served, never evicted to make room for
    /// another (at most `lora.max_cpu_loras` are pinned; default false). With
    /// `load_inplace`, sets the pinning of an adapter already served.
    #[serde(default)]
    pinned: bool,
    /// Fields no one reads (a newer vLLM's, or misspelt), named in the request's warning.
    #[serde(flatten)]
    ignored: IgnoredFields,
}

/// Longest adapter path accepted, in bytes.
const MAX_LORA_PATH: usize = 4096;

/// `GET /admin/lora`: the adapters served, with their directories.
pub(crate) async fn list_lora(state: web::Data<ApiState>) -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({ "adapters": state.engine.lora_adapters() }))
}

/// `POST /admin/lora`: loads an adapter from a directory on the server and serves it.
pub(crate) async fn load_lora(
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: LoadLoraRequest = read_json(&req, payload, &state.config()).await?;
    body.ignored.warn("/admin/lora");
    let info = load_lora_as(&state, body, "the admin API").await?;
    Ok(HttpResponse::Ok().json(info))
}

/// `POST /v1/load_lora_adapter`: vLLM's route for `POST /admin/lora` (the same body, the
/// admin key), answered as vLLM answers it: a 200 whose body is the text `Success: LoRA
/// adapter 'NAME' added successfully.`, errors as every other route's.
pub(crate) async fn vllm_load_lora(
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: LoadLoraRequest = read_json(&req, payload, &state.config()).await?;
    body.ignored.warn("/v1/load_lora_adapter");
    let info = load_lora_as(&state, body, "vLLM's /v1/load_lora_adapter").await?;
    Ok(vllm_success(format!(
        "Success: LoRA adapter '{}' added successfully.",
        info.name
    )))
}

/// Body of `POST /v1/unload_lora_adapter` (vLLM's fields; others are accepted, as vLLM
/// accepts them, and named in one warning).
#[derive(Debug, Deserialize)]
pub(crate) struct UnloadLoraRequest {
    lora_name: Option<String>,
    /// vLLM's alternative to the name: an id its server gave out. This server's ids are its
    /// own, so an adapter is unloaded by name; the field is accepted beside one.
    #[serde(default)]
    #[allow(dead_code)]
    lora_int_id: Option<i64>,
    /// Fields no one reads, named in the request's warning.
    #[serde(flatten)]
    ignored: IgnoredFields,
}

/// `POST /v1/unload_lora_adapter`: vLLM's route for `DELETE /admin/lora/{name}` (the admin
/// key), answered as vLLM answers it: a 200 whose body is the text `Success: LoRA adapter
/// 'NAME' removed successfully.`
pub(crate) async fn vllm_unload_lora(
    state: web::Data<ApiState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let body: UnloadLoraRequest = read_json(&req, payload, &state.config()).await?;
    body.ignored.warn("/v1/unload_lora_adapter");
    let Some(name) = body.lora_name.filter(|n| !n.is_empty()) else {
        return Err(ApiError::invalid(
            "lora_name",
            "lora_name is required: adapters are unloaded by name (this server does not give \
             out vLLM's lora_int_id)",
        ));
    };
    state.engine.unload_lora(name.clone()).await?;
    tracing::info!(%name, "LoRA adapter unloaded through vLLM's /v1/unload_lora_adapter");
    Ok(vllm_success(format!(
        "Success: LoRA adapter '{name}' removed successfully."
    )))
}

/// vLLM's answer to a LoRA route that succeeded: 200, its message as plain text.
fn vllm_success(message: String) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; charset=utf-8")
        .body(message)
}

/// Loads the adapter `body` names (through `route`, for the log) and returns what it serves.
async fn load_lora_as(
    state: &ApiState,
    body: LoadLoraRequest,
    route: &str,
) -> Result<crate::engine::LoraAdapterInfo, ApiError> {
    if body.lora_path.is_empty() || body.lora_path.len() > MAX_LORA_PATH {
        return Err(ApiError::invalid(
            "lora_path",
            format!("lora_path must be 1 to {MAX_LORA_PATH} bytes"),
        ));
    }
    if body.lora_name == state.engine.model_name() {
        return Err(ApiError::invalid(
            "lora_name",
            "that is the base model's name",
        ));
    }
    let info = state
        .engine
        .load_lora(
            body.lora_name,
            body.lora_path,
            body.load_inplace,
            body.pinned,
        )
        .await?;
    tracing::info!(
        name = %info.name,
        path = %info.path,
        in_place = body.load_inplace,
        pinned = body.pinned,
        "LoRA adapter loaded through {route}"
    );
    Ok(info)
}

/// `DELETE /admin/lora/{name}`: stops serving an adapter.
pub(crate) async fn unload_lora(
    state: web::Data<ApiState>,
    name: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    let name = name.into_inner();
    state.engine.unload_lora(name.clone()).await?;
    tracing::info!(%name, "LoRA adapter unloaded through the admin API");
    Ok(HttpResponse::Ok().json(serde_json::json!({ "unloaded": name })))
}

/// `GET /admin/rate_limits`: each limited tier's limits and each tenant's budgets now.
pub(crate) async fn get_rate_limits(state: web::Data<ApiState>) -> HttpResponse {
    HttpResponse::Ok().json(state.rate_limiter.report(std::time::Instant::now()))
}

/// `DELETE /admin/rate_limits/{tier}/{tenant}`: gives the tenant a full budget again.
pub(crate) async fn reset_rate_limit(
    state: web::Data<ApiState>,
    path: web::Path<(String, String)>,
) -> Result<HttpResponse, ApiError> {
    let (tier, tenant) = path.into_inner();
    let Some(had) = state.rate_limiter.reset(&tier, &tenant) else {
        let shown = tier.chars().take(256).collect();
        return Err(if state.config().tiers.contains(&tier) {
            ApiError::TierNotLimited(shown)
        } else {
            ApiError::UnknownTier(shown)
        });
    };
    tracing::info!(%tier, %tenant, "rate-limit budget reset through the admin API");
    Ok(HttpResponse::Ok().json(serde_json::json!({
        "tier": tier,
        "tenant": tenant,
        // Whether it had a budget to reset (one never limited was full already).
        "reset": had,
    })))
}

/// Fallback for unknown paths.
pub(crate) async fn not_found(req: HttpRequest) -> Result<HttpResponse, ApiError> {
    Err(ApiError::RouteNotFound {
        method: req.method().to_string(),
        path: req.path().chars().take(256).collect(),
    })
}

/// Fallback for a known path with the wrong method; `allow` lists the path's methods.
pub(crate) async fn method_not_allowed(
    req: HttpRequest,
    allow: &'static str,
) -> Result<HttpResponse, ApiError> {
    Err(ApiError::MethodNotAllowed {
        method: req.method().to_string(),
        path: req.path().chars().take(256).collect(),
        allow,
    })
}
