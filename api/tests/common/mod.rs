//! A deterministic test double of the engine port, and helpers to drive the app in process.
//!
//! `EchoEngine` tokenizes bytes (token id = byte value), so a prompt of k ASCII characters has k
//! tokens. Choice `i` of a request repeats the prompt's text rotated left by `i` characters,
//! one character (= one token) per delta, until `max_tokens` (default: the rest of the context
//! window). A stop string truncates the output before it (finish reason `stop`). With logprobs,
//! every sampled token has logprob -0.5 and its alternatives are the token itself (-0.5) then
//! `"~"` (-2.0), cut to the requested count; prompt logprobs are null for the first token, -1.0
//! after. Chat messages render as `role: content\n` lines followed by `assistant:`. A
//! structured output whose text holds `(unclosed` or `no-such-type` does not compile: it is
//! refused naming `STRUCTURED_OUTPUT_PARAM`, as the engine refuses it. A token-id prompt with
//! an id from `VOCAB_SIZE` on is refused naming `prompt`, as the engine's tokenizer refuses it.
//!
//! An embedding request (`GenerateRequest::embed`) gets its prompt event and then one finishing
//! delta without text or tokens whose vector has `EMBEDDING_SIZE` values: value `i` counts the
//! prompt's token ids below 256 (bytes) that are `i` modulo `EMBEDDING_SIZE`, so `"ab"` is
//! `[0, 1, 1, 0, ...]` and a prompt of ids from 256 on only is the zero vector.

#![allow(dead_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceResponse};
use actix_web::http::StatusCode;
use actix_web::{test, App};
use switchyard_api::engine::{
    ChatEnding, ChatMessage, Delta, Engine, EngineError, EngineErrorKind, EngineEvent,
    EngineFuture, EngineStall, Finish, FinishReason, GenerateRequest, LoraAdapterInfo, PolicyInfo,
    PolicySpec, PolicySwap, PromptInput, SpeculativeSettings, StructuredOutputSpec, TokenLogprob,
    TokenizeInput, TopLogprob, STRUCTURED_OUTPUT_PARAM,
};
use switchyard_api::{ApiConfig, ApiKeyEntry, ApiState};
use tokio::sync::mpsc;

pub const MODEL: &str = "echo-1";
pub const KEY: &str = "sk-test-acme";
pub const ADMIN_KEY: &str = "admin-secret";
/// The echo engine's vocabulary: token ids below it.
pub const VOCAB_SIZE: u32 = 1000;
/// The length of the echo engine's embeddings.
pub const EMBEDDING_SIZE: usize = 8;

/// The echo engine's embedding of `prompt` (see the module's documentation), not normalized.
pub fn echo_embedding(prompt: &[u32]) -> Vec<f32> {
    let mut v = vec![0.0f32; EMBEDDING_SIZE];
    for &id in prompt.iter().filter(|&&id| id < 256) {
        v[id as usize % EMBEDDING_SIZE] += 1.0;
    }
    v
}

pub struct EchoEngine {
    pub max_model_len: usize,
    pub ready: AtomicBool,
    /// `Engine::is_alive`.
    pub alive: AtomicBool,
    /// `Engine::stall`.
    pub stall: Mutex<Option<EngineStall>>,
    pub overloaded: AtomicBool,
    /// Accept requests but never finish them; the senders are kept here.
    pub hang: AtomicBool,
    /// End every request with an `Unavailable` error right after its first delta.
    pub fail_mid_stream: AtomicBool,
    pub held: Mutex<Vec<mpsc::Sender<EngineEvent>>>,
    pub submitted: Mutex<Vec<GenerateRequest>>,
    pub policy: Mutex<PolicyInfo>,
    /// The LoRA adapters served (`Engine::lora_adapters`).
    pub lora: Mutex<Vec<LoraAdapterInfo>>,
    /// The names `Engine::lora_adapters_in_directories` answers, in this order.
    pub lora_in_directories: Mutex<Vec<String>>,
    /// Swaps that changed the policy.
    pub policy_swaps: AtomicUsize,
    /// The speculative decoding settings in force (`Engine::speculative`).
    pub speculative: Mutex<Option<SpeculativeSettings>>,
    /// `Engine::embedding_size`: `Some(EMBEDDING_SIZE)` unless a test turns embeddings off.
    pub embedding_size: Mutex<Option<usize>>,
    /// When set, what every embedding request's delta carries instead of its vector (`None`:
    /// no vector), to test how the HTTP layer takes a faulty engine.
    pub embedding_override: Mutex<Option<Option<Vec<f32>>>>,
}

impl EchoEngine {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            max_model_len: 64,
            ready: AtomicBool::new(true),
            alive: AtomicBool::new(true),
            stall: Mutex::new(None),
            overloaded: AtomicBool::new(false),
            hang: AtomicBool::new(false),
            fail_mid_stream: AtomicBool::new(false),
            held: Mutex::new(Vec::new()),
            submitted: Mutex::new(Vec::new()),
            policy: Mutex::new(PolicyInfo {
                name: "fcfs".into(),
                params: serde_json::json!({}),
                available: vec!["fcfs".into(), "priority".into()],
            }),
            lora: Mutex::new(Vec::new()),
            lora_in_directories: Mutex::new(Vec::new()),
            policy_swaps: AtomicUsize::new(0),
            speculative: Mutex::new(None),
            embedding_size: Mutex::new(Some(EMBEDDING_SIZE)),
            embedding_override: Mutex::new(None),
        })
    }

    pub fn last_request(&self) -> GenerateRequest {
        self.submitted.lock().unwrap().last().cloned().unwrap()
    }
}

pub fn render_chat(messages: &[ChatMessage], ending: ChatEnding) -> String {
    let mut text = String::new();
    for m in messages {
        text.push_str(m.role.as_str());
        text.push_str(": ");
        text.push_str(&m.content);
        text.push('\n');
    }
    match ending {
        ChatEnding::GenerationPrompt => text.push_str("assistant:"),
        ChatEnding::Closed => {}
        ChatEnding::ContinueFinal => {
            text.pop();
        }
    }
    text
}

/// Whether the echo engine's "compiler" refuses `spec` (see the module's documentation).
fn does_not_compile(spec: &StructuredOutputSpec) -> bool {
    let text = match spec {
        StructuredOutputSpec::Regex(t)
        | StructuredOutputSpec::Grammar(t)
        | StructuredOutputSpec::ToolCalls(t) => t.clone(),
        StructuredOutputSpec::JsonSchema(v) => v.to_string(),
        StructuredOutputSpec::Choice(c) => c.join("|"),
        StructuredOutputSpec::JsonObject => String::new(),
    };
    text.contains("(unclosed") || text.contains("no-such-type")
}

fn token_text(id: u32) -> String {
    u8::try_from(id).map_or_else(|_| "?".into(), |b| char::from(b).to_string())
}

fn sampled_logprob(id: u32, top: u32) -> TokenLogprob {
    let alternatives = [
        TopLogprob {
            token_id: id,
            token: token_text(id),
            bytes: token_text(id).into_bytes(),
            logprob: -0.5,
        },
        TopLogprob {
            token_id: u32::from(b'~'),
            token: "~".into(),
            bytes: b"~".to_vec(),
            logprob: -2.0,
        },
    ];
    TokenLogprob {
        token_id: id,
        token: token_text(id),
        bytes: token_text(id).into_bytes(),
        logprob: Some(-0.5),
        rank: None,
        top: alternatives.into_iter().take(top as usize).collect(),
    }
}

impl EchoEngine {
    /// One prompt's channel, its events already in it.
    fn submit_one(
        &self,
        request: GenerateRequest,
    ) -> Result<mpsc::Receiver<EngineEvent>, EngineError> {
        if self.overloaded.load(Ordering::SeqCst) {
            return Err(EngineError::new(
                EngineErrorKind::Overloaded {
                    retry_after_secs: 2,
                },
                "The waiting queue is full.",
            ));
        }
        self.submitted.lock().unwrap().push(request.clone());
        let prompt: Vec<u32> = match &request.prompt {
            PromptInput::Text(text) => text.bytes().map(u32::from).collect(),
            PromptInput::Tokens(ids) => ids.clone(),
            PromptInput::Chat {
                messages, ending, ..
            } => render_chat(messages, *ending)
                .bytes()
                .map(u32::from)
                .collect(),
        };
        let mut events = Vec::new();
        let budget = self.max_model_len.saturating_sub(prompt.len());
        let max_tokens = request.max_tokens.map_or(budget, |m| m as usize);
        if request.structured.as_ref().is_some_and(does_not_compile) {
            events.push(EngineEvent::Error(
                EngineError::new(
                    EngineErrorKind::InvalidRequest,
                    "invalid structured output specification",
                )
                .with_param(STRUCTURED_OUTPUT_PARAM),
            ));
        } else if let Some(bad) = prompt.iter().find(|&&id| id >= VOCAB_SIZE) {
            events.push(EngineEvent::Error(
                EngineError::new(
                    EngineErrorKind::InvalidRequest,
                    format!("token id {bad} is outside the vocabulary (size {VOCAB_SIZE})"),
                )
                .with_param("prompt"),
            ));
        } else if prompt.len() + max_tokens > self.max_model_len {
            events.push(EngineEvent::Error(EngineError::new(
                EngineErrorKind::ContextLengthExceeded,
                format!(
                    "This model's maximum context length is {} tokens; the request has {} prompt tokens and asks for {max_tokens}.",
                    self.max_model_len,
                    prompt.len()
                ),
            )));
        } else if let Some(&(bad, _)) = request.sampling.logit_bias.iter().find(|(t, _)| *t > 255) {
            events.push(EngineEvent::Error(
                EngineError::new(
                    EngineErrorKind::InvalidRequest,
                    format!("token id {bad} is out of vocabulary"),
                )
                .with_param("logit_bias"),
            ));
        } else {
            events.push(EngineEvent::Prompt {
                prompt_tokens: prompt.len() as u32,
                opens_thinking: false,
                prompt_logprobs: request.prompt_logprobs.map(|k| {
                    prompt
                        .iter()
                        .enumerate()
                        .map(|(i, &id)| TokenLogprob {
                            token_id: id,
                            token: token_text(id),
                            bytes: token_text(id).into_bytes(),
                            logprob: (i > 0).then_some(-1.0),
                            // A stand-in rank: this engine has no vocabulary.
                            rank: (i > 0).then_some(2),
                            top: if i > 0 {
                                sampled_logprob(id, k).top
                            } else {
                                Vec::new()
                            },
                        })
                        .collect()
                }),
            });
            if self.hang.load(Ordering::SeqCst) {
                // Nothing after the prompt event: the request waits.
            } else if request.embed {
                let embedding = self
                    .embedding_override
                    .lock()
                    .unwrap()
                    .clone()
                    .unwrap_or_else(|| Some(echo_embedding(&prompt)));
                events.push(EngineEvent::Delta(Delta {
                    index: 0,
                    text: String::new(),
                    token_ids: Vec::new(),
                    logprobs: Vec::new(),
                    finish: Some(Finish {
                        reason: FinishReason::Stop,
                        completion_tokens: 0,
                    }),
                    cached_prompt_tokens: 0,
                    embedding,
                }));
            } else {
                push_outputs(&mut events, &request, &prompt, max_tokens);
            }
            if self.fail_mid_stream.load(Ordering::SeqCst) {
                events.truncate(2);
                events.push(EngineEvent::Error(EngineError::new(
                    EngineErrorKind::Unavailable,
                    "The engine is shutting down.",
                )));
            }
        }
        let (tx, rx) = mpsc::channel(events.len() + 1);
        for event in events {
            tx.try_send(event)
                .map_err(|_| EngineError::new(EngineErrorKind::Internal, "channel full"))?;
        }
        if self.hang.load(Ordering::SeqCst) {
            self.held.lock().unwrap().push(tx);
        }
        Ok(rx)
    }
}

impl Engine for EchoEngine {
    fn model_name(&self) -> &str {
        MODEL
    }

    fn max_model_len(&self) -> usize {
        self.max_model_len
    }

    fn is_ready(&self) -> bool {
        self.ready.load(Ordering::SeqCst)
    }

    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }

    fn stall(&self) -> Option<EngineStall> {
        self.stall.lock().unwrap().clone()
    }

    fn submit(
        &self,
        requests: Vec<GenerateRequest>,
    ) -> Result<Vec<mpsc::Receiver<EngineEvent>>, EngineError> {
        requests.into_iter().map(|r| self.submit_one(r)).collect()
    }

    fn tokenize(&self, input: TokenizeInput) -> EngineFuture<Vec<u32>> {
        let text = match input {
            TokenizeInput::Text { text, .. } => text,
            TokenizeInput::Chat {
                messages, ending, ..
            } => render_chat(&messages, ending),
        };
        Box::pin(async move { Ok(text.bytes().map(u32::from).collect()) })
    }

    fn detokenize(&self, token_ids: Vec<u32>) -> EngineFuture<String> {
        Box::pin(async move {
            let bytes = token_ids
                .iter()
                .map(|&t| u8::try_from(t))
                .collect::<Result<Vec<u8>, _>>()
                .map_err(|_| {
                    EngineError::new(
                        EngineErrorKind::InvalidRequest,
                        "token id out of vocabulary",
                    )
                    .with_param("tokens")
                })?;
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        })
    }

    fn lora_adapters(&self) -> Vec<LoraAdapterInfo> {
        self.lora.lock().unwrap().clone()
    }

    fn lora_adapters_in_directories(&self) -> EngineFuture<Vec<String>> {
        let found = self.lora_in_directories.lock().unwrap().clone();
        Box::pin(async move { Ok(found) })
    }

    fn embedding_size(&self) -> Option<usize> {
        *self.embedding_size.lock().unwrap()
    }

    fn policy(&self) -> EngineFuture<PolicyInfo> {
        let info = self.policy.lock().unwrap().clone();
        Box::pin(async move { Ok(info) })
    }

    fn swap_policy(&self, spec: PolicySpec) -> EngineFuture<PolicySwap> {
        let mut policy = self.policy.lock().unwrap();
        let result = if !policy.available.contains(&spec.name) {
            Err(EngineError::new(
                EngineErrorKind::InvalidRequest,
                format!("unknown policy {:?}", spec.name),
            )
            .with_param("name"))
        } else if policy.name == spec.name && policy.params == spec.params {
            Ok(PolicySwap {
                policy: policy.clone(),
                changed: false,
            })
        } else {
            policy.name = spec.name;
            policy.params = spec.params;
            self.policy_swaps.fetch_add(1, Ordering::SeqCst);
            Ok(PolicySwap {
                policy: policy.clone(),
                changed: true,
            })
        };
        Box::pin(async move { result })
    }

    fn speculative(&self) -> EngineFuture<Option<SpeculativeSettings>> {
        let settings = self.speculative.lock().unwrap().clone();
        Box::pin(async move { Ok(settings) })
    }

    fn set_speculative(
        &self,
        settings: Option<SpeculativeSettings>,
    ) -> EngineFuture<Option<SpeculativeSettings>> {
        // Takes what the HTTP layer passes on: the route alone checks the settings.
        self.speculative.lock().unwrap().clone_from(&settings);
        Box::pin(async move { Ok(settings) })
    }
}

/// Each choice's full output, then one delta per character, round-robin over choices.
fn push_outputs(
    events: &mut Vec<EngineEvent>,
    request: &GenerateRequest,
    prompt: &[u32],
    max_tokens: usize,
) {
    let n = request.n as usize;
    let outputs: Vec<(Vec<u32>, FinishReason)> = (0..n)
        .map(|i| {
            let mut ids: Vec<u32> = prompt
                .iter()
                .cycle()
                .skip(i)
                .take(max_tokens)
                .copied()
                .collect();
            let text: String = ids.iter().map(|&t| token_text(t)).collect();
            let cut = request
                .stop
                .iter()
                .filter_map(|s| text.find(s.as_str()))
                .min();
            match cut {
                Some(at) => {
                    ids.truncate(at);
                    (ids, FinishReason::Stop)
                }
                None => (ids, FinishReason::Length),
            }
        })
        .collect();
    let longest = outputs
        .iter()
        .map(|(ids, _)| ids.len())
        .max()
        .unwrap_or(0)
        .max(1);
    for step in 0..longest {
        for (i, (ids, reason)) in outputs.iter().enumerate() {
            let last = step + 1 == ids.len().max(1);
            if step >= ids.len().max(1) {
                continue;
            }
            let token_ids: Vec<u32> = ids.get(step).copied().into_iter().collect();
            events.push(EngineEvent::Delta(Delta {
                index: i as u32,
                text: token_ids.iter().map(|&t| token_text(t)).collect(),
                logprobs: match request.logprobs {
                    Some(k) => token_ids.iter().map(|&t| sampled_logprob(t, k)).collect(),
                    None => Vec::new(),
                },
                token_ids,
                finish: last.then_some(Finish {
                    reason: *reason,
                    completion_tokens: ids.len() as u32,
                }),
                cached_prompt_tokens: 0,
                embedding: None,
            }));
        }
    }
}

pub fn api_config() -> ApiConfig {
    ApiConfig {
        api_keys: vec![ApiKeyEntry {
            key: KEY.into(),
            tenant: "acme".into(),
            tier: "premium".into(),
            adapters: switchyard_api::AdapterAccess::all(),
        }],
        admin_key: Some(ADMIN_KEY.into()),
        max_body_bytes: 4096,
        ..ApiConfig::default()
    }
}

/// The process-wide recorder (installed once per test binary).
pub fn metrics_handle() -> metrics_exporter_prometheus::PrometheusHandle {
    static HANDLE: OnceLock<metrics_exporter_prometheus::PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| switchyard_api::metrics::install_prometheus_recorder().unwrap())
        .clone()
}

pub async fn app(
    engine: Arc<EchoEngine>,
    config: ApiConfig,
) -> (
    ApiState,
    impl Service<
        actix_http::Request,
        Response = ServiceResponse<impl MessageBody>,
        Error = actix_web::Error,
    >,
) {
    let state = ApiState::new(engine, config, Some(metrics_handle()));
    let app_state = state.clone();
    let service = test::init_service(
        App::new().configure(move |cfg| switchyard_api::configure(cfg, app_state)),
    )
    .await;
    (state, service)
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: actix_web::http::header::HeaderMap,
    pub body: bytes::Bytes,
}

impl Reply {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {:?}", self.body))
    }

    pub fn text(&self) -> &str {
        std::str::from_utf8(&self.body).unwrap()
    }

    /// Asserts an OpenAI error body with this status, type and param; returns the body.
    pub fn assert_error(&self, status: u16, kind: &str, param: Option<&str>) -> serde_json::Value {
        assert_eq!(self.status.as_u16(), status, "{}", self.text());
        let body = self.json();
        let error = &body["error"];
        assert!(
            error["message"].as_str().is_some_and(|m| !m.is_empty()),
            "{body}"
        );
        assert_eq!(error["type"], kind, "{body}");
        assert_eq!(error["param"].as_str(), param, "{body}");
        assert!(error.get("code").is_some(), "{body}");
        body
    }
}

pub async fn send<S, B>(service: &S, request: test::TestRequest) -> Reply
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    match service.call(request.to_request()).await {
        Ok(response) => {
            let status = response.status();
            let headers = response.headers().clone();
            let body = test::read_body(response).await;
            Reply {
                status,
                headers,
                body,
            }
        }
        // Errors from middleware reach the server as `Err`; render them as it would.
        Err(error) => {
            let response = error.error_response();
            let status = response.status();
            let headers = response.headers().clone();
            let body = actix_web::body::to_bytes(response.into_body())
                .await
                .unwrap();
            Reply {
                status,
                headers,
                body,
            }
        }
    }
}

pub fn post(path: &str, body: &serde_json::Value) -> test::TestRequest {
    test::TestRequest::post()
        .uri(path)
        .insert_header(("authorization", format!("Bearer {KEY}")))
        .set_payload(body.to_string())
}

/// Splits an SSE body into its `data:` payloads, asserting the framing is exact (comment
/// frames, the server's keep-alives, are skipped).
pub fn sse_payloads(body: &str) -> Vec<&str> {
    assert!(body.ends_with("data: [DONE]\n\n"), "{body:?}");
    let frames: Vec<&str> = body
        .split_terminator("\n\n")
        .filter(|f| !f.starts_with(':'))
        .collect();
    frames
        .iter()
        .map(|f| {
            f.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad frame {f:?}"))
        })
        .collect()
}
