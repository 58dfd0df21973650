//! The one place where failures become HTTP statuses and OpenAI error bodies.
//!
//! Every route returns `Result<_, ApiError>`; [`ApiError`]'s `ResponseError` implementation is
//! the only code that picks a status code. The body is OpenAI's:
//! `{"error": {"message": …, "type": …, "param": …, "code": …}}`. Streams that fail after their
//! first byte send the same body as an SSE chunk ([`ApiError::to_body`]).

use actix_web::http::{header, StatusCode};
use actix_web::{HttpResponse, ResponseError};
use serde::Serialize;

use crate::cors::CorsRefusal;
use crate::engine::{EngineError, EngineErrorKind, EngineStall};
use crate::rate_limit::RateLimited;

/// Everything a request can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApiError {
    /// A parameter is missing, malformed or out of range (400).
    #[error("{message}")]
    InvalidRequest {
        /// What is wrong, for the client.
        message: String,
        /// The offending field, if one is at fault.
        param: Option<String>,
    },
    /// The request names a model this server does not serve (404).
    #[error("The model `{0}` does not exist.")]
    ModelNotFound(String),
    /// No route matches the path (404).
    #[error("No route for {method} {path}.")]
    RouteNotFound {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
    },
    /// The path exists but not for this method (405).
    #[error("Method {method} is not allowed on {path}.")]
    MethodNotAllowed {
        /// The request's method.
        method: String,
        /// The request's path.
        path: String,
        /// The methods the path takes, for the `Allow` header (RFC 9110, 15.5.6).
        allow: &'static str,
    },
    /// The API key is missing or wrong (401).
    #[error("{0}")]
    Unauthorized(&'static str),
    /// The admin routes are off: no `server.admin_key` is configured (403; no credential
    /// would help).
    #[error("The admin API is disabled on this server: set `server.admin_key` to enable it.")]
    AdminDisabled,
    /// The body exceeds the configured limit (413).
    #[error("Request body exceeds the limit of {limit} bytes.")]
    PayloadTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The body was sent in a content coding (`Content-Encoding`) other than `identity`,
    /// which the server does not decode (415; the coding's name is bounded).
    #[error(
        "Content-Encoding `{0}` is not supported: send the body uncompressed \
         (Content-Encoding identity or none)."
    )]
    UnsupportedContentEncoding(String),
    /// The body did not arrive within the configured time (408).
    #[error("The request body did not arrive within {} seconds.", .0.as_secs_f64())]
    BodyTimeout(std::time::Duration),
    /// The server is shutting down and accepts no new work (503).
    #[error("The server is shutting down.")]
    Draining,
    /// No stored response of the caller's tenant has this id (404; the id is bounded).
    #[error("Response with id '{0}' not found.")]
    ResponseNotFound(String),
    /// `previous_response_id` names no stored response of the caller's tenant (400, as
    /// OpenAI answers it; the id is bounded).
    #[error("Previous response with id '{0}' not found.")]
    PreviousResponseNotFound(String),
    /// `DELETE /admin/rate_limits/{tier}/{tenant}` names a tier without rate limits (404; the
    /// name is bounded).
    #[error("Tier '{0}' has no rate limits.")]
    TierNotLimited(String),
    /// `DELETE /admin/rate_limits/{tier}/{tenant}` names no configured tier (404; the name is
    /// bounded).
    #[error("No tier '{0}' is configured.")]
    UnknownTier(String),
    /// The metrics recorder was not handed to the API (404 on `/metrics`).
    #[error("Metrics are not enabled on this server.")]
    MetricsDisabled,
    /// `/v1/embeddings` on an engine that computes no embeddings
    /// ([`crate::engine::Engine::embedding_size`] is `None`): 404, as vLLM answers for a
    /// model without the embedding task (it does not register the route).
    #[error("The model does not support the Embeddings API: this server computes no embeddings.")]
    EmbeddingsNotServed,
    /// The caller's tenant used its tier's requests or tokens per minute (429, OpenAI's
    /// `rate_limit_exceeded`, typed `requests` or `tokens` as OpenAI types it).
    #[error("{}", .0.message())]
    RateLimited(Box<RateLimited>),
    /// A CORS preflight (or cross-origin request) `server.cors` refuses (400, a code per
    /// reason: `cors_origin_not_allowed`, ...).
    #[error(transparent)]
    CorsRefused(#[from] CorsRefusal),
    /// A backend call has run past the engine's limit (`scheduler.step_timeout_s`): the
    /// engine is stalled (503 `engine_stalled` on `/health`, `/ready` and new requests).
    #[error("{0}")]
    EngineStalled(EngineStall),
    /// The engine refused or failed the request; its kind picks the status.
    #[error(transparent)]
    Engine(#[from] EngineError),
}

/// OpenAI's error envelope.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorBody {
    /// The error itself.
    pub error: ErrorDetail,
}

/// OpenAI's error object.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorDetail {
    /// Human-readable explanation.
    pub message: String,
    /// Error class, e.g. `invalid_request_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, or null.
    pub param: Option<String>,
    /// Machine-readable code, e.g. `model_not_found`, or null.
    pub code: Option<&'static str>,
}

/// Longest `message` an error body carries, in characters. Messages quote what the client
/// sent (serde's "invalid type: string \"…\"", an unknown role or `logit_bias` key, ...): past
/// this bound the middle is cut, so that an error never echoes megabytes of a request back, as
/// a request's every size is bounded. The head (what is wrong) and the tail (serde's line and
/// column) are kept.
pub const MAX_MESSAGE_CHARS: usize = 1024;

/// Longest `param` an error body carries, in characters: a field's path names the keys of
/// maps the client wrote (`logit_bias.{key}`, `metadata.{key}`), cut as messages are.
pub const MAX_PARAM_CHARS: usize = 256;

const INVALID_REQUEST: &str = "invalid_request_error";
const SERVER_ERROR: &str = "server_error";

impl ApiError {
    /// A 400 naming the field at fault.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::InvalidRequest {
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// Status, error type and code: the single mapping table.
    fn classify(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        match self {
            Self::InvalidRequest { .. } => (StatusCode::BAD_REQUEST, INVALID_REQUEST, None),
            Self::ModelNotFound(_) => (
                StatusCode::NOT_FOUND,
                INVALID_REQUEST,
                Some("model_not_found"),
            ),
            Self::RouteNotFound { .. } => (StatusCode::NOT_FOUND, INVALID_REQUEST, None),
            Self::MetricsDisabled => (StatusCode::NOT_FOUND, INVALID_REQUEST, None),
            Self::TierNotLimited(_) | Self::UnknownTier(_) => {
                (StatusCode::NOT_FOUND, INVALID_REQUEST, None)
            }
            Self::EmbeddingsNotServed => (
                StatusCode::NOT_FOUND,
                INVALID_REQUEST,
                Some("embeddings_not_served"),
            ),
            Self::ResponseNotFound(_) => (StatusCode::NOT_FOUND, INVALID_REQUEST, None),
            Self::PreviousResponseNotFound(_) => (
                StatusCode::BAD_REQUEST,
                INVALID_REQUEST,
                Some("previous_response_not_found"),
            ),
            Self::MethodNotAllowed { .. } => {
                (StatusCode::METHOD_NOT_ALLOWED, INVALID_REQUEST, None)
            }
            Self::Unauthorized(_) => (
                StatusCode::UNAUTHORIZED,
                INVALID_REQUEST,
                Some("invalid_api_key"),
            ),
            Self::AdminDisabled => (
                StatusCode::FORBIDDEN,
                INVALID_REQUEST,
                Some("admin_disabled"),
            ),
            Self::PayloadTooLarge { .. } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                INVALID_REQUEST,
                Some("request_too_large"),
            ),
            Self::UnsupportedContentEncoding(_) => (
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                INVALID_REQUEST,
                Some("unsupported_content_encoding"),
            ),
            Self::BodyTimeout(_) => (
                StatusCode::REQUEST_TIMEOUT,
                INVALID_REQUEST,
                Some("request_timeout"),
            ),
            Self::CorsRefused(refusal) => (
                StatusCode::BAD_REQUEST,
                INVALID_REQUEST,
                Some(refusal.code()),
            ),
            Self::Draining => (
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER_ERROR,
                Some("shutting_down"),
            ),
            Self::EngineStalled(_) => (
                StatusCode::SERVICE_UNAVAILABLE,
                SERVER_ERROR,
                Some("engine_stalled"),
            ),
            Self::RateLimited(r) => (
                StatusCode::TOO_MANY_REQUESTS,
                r.kind.as_str(),
                Some("rate_limit_exceeded"),
            ),
            Self::Engine(e) => match e.kind {
                EngineErrorKind::InvalidRequest => (StatusCode::BAD_REQUEST, INVALID_REQUEST, None),
                EngineErrorKind::ContextLengthExceeded => (
                    StatusCode::BAD_REQUEST,
                    INVALID_REQUEST,
                    Some("context_length_exceeded"),
                ),
                EngineErrorKind::Overloaded { .. } => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    SERVER_ERROR,
                    Some("overloaded"),
                ),
                EngineErrorKind::TooManyChoices => (
                    StatusCode::BAD_REQUEST,
                    INVALID_REQUEST,
                    Some("too_many_choices"),
                ),
                EngineErrorKind::Unavailable => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    SERVER_ERROR,
                    Some("unavailable"),
                ),
                EngineErrorKind::QueueTimeout => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    SERVER_ERROR,
                    Some("queue_timeout"),
                ),
                // The tenant's own bound, as its rate limits are: OpenAI's 429, which clients
                // retry after `Retry-After`.
                EngineErrorKind::TenantBusy => (
                    StatusCode::TOO_MANY_REQUESTS,
                    "requests",
                    Some("rate_limit_exceeded"),
                ),
                EngineErrorKind::NotFound => (
                    StatusCode::NOT_FOUND,
                    INVALID_REQUEST,
                    Some("model_not_found"),
                ),
                EngineErrorKind::Internal | EngineErrorKind::StructuredOutput => {
                    (StatusCode::INTERNAL_SERVER_ERROR, SERVER_ERROR, None)
                }
            },
        }
    }

    /// Seconds a client should wait before retrying, for the `Retry-After` header.
    fn retry_after_secs(&self) -> Option<u32> {
        match self {
            Self::Draining | Self::EngineStalled(_) => Some(5),
            Self::RateLimited(r) => Some(
                u32::try_from(r.retry_after.as_secs_f64().ceil() as u64)
                    .unwrap_or(u32::MAX)
                    .max(1),
            ),
            Self::Engine(e) => match e.kind {
                EngineErrorKind::Overloaded { retry_after_secs } => Some(retry_after_secs.max(1)),
                EngineErrorKind::Unavailable => Some(5),
                // As an overload refusal: the queue was long a moment ago.
                EngineErrorKind::QueueTimeout => Some(1),
                EngineErrorKind::TenantBusy => Some(1),
                _ => None,
            },
            _ => None,
        }
    }

    /// The OpenAI error body for this error.
    pub fn to_body(&self) -> ErrorBody {
        let (_, kind, code) = self.classify();
        let (message, param) = match self {
            Self::InvalidRequest { message, param } => (message.clone(), param.clone()),
            Self::ModelNotFound(_) => (self.to_string(), Some("model".to_owned())),
            Self::PreviousResponseNotFound(_) => {
                (self.to_string(), Some("previous_response_id".to_owned()))
            }
            Self::Engine(e) if hides_detail(e.kind) => {
                // The detail goes to the log, not to the client.
                ("The server had an internal error.".to_owned(), None)
            }
            Self::Engine(e) => (e.message.clone(), e.param.clone()),
            _ => (self.to_string(), None),
        };
        ErrorBody {
            error: ErrorDetail {
                message: cut_middle(message, MAX_MESSAGE_CHARS),
                kind,
                param: param.map(|p| cut_middle(p, MAX_PARAM_CHARS)),
                code,
            },
        }
    }
}

/// `text` if it has at most `max` characters, else its first three quarters of `max` and its
/// last characters around a `…`, `max` characters in all.
fn cut_middle(text: String, max: usize) -> String {
    let count = text.chars().count();
    if count <= max || max == 0 {
        return text;
    }
    let head = max * 3 / 4;
    let tail = max - head - 1;
    let mut cut: String = text.chars().take(head).collect();
    cut.push('…');
    cut.extend(text.chars().skip(count - tail));
    cut
}

/// The server's own failures: 500, the detail logged rather than shown. A grammar that failed
/// while generating (other than past llguidance's parser limits: the request's own error, a
/// 400) is a 500 too, but its message is about the request's own grammar and the
/// output so far (what llguidance gave up on, after how many tokens), so the client sees it.
fn hides_detail(kind: EngineErrorKind) -> bool {
    matches!(kind, EngineErrorKind::Internal)
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        self.classify().0
    }

    fn error_response(&self) -> HttpResponse {
        if let Self::Engine(e) = self {
            if hides_detail(e.kind) {
                tracing::error!(error = %e.message, "engine failure");
            }
        }
        let mut response = HttpResponse::build(self.status_code());
        if let Some(secs) = self.retry_after_secs() {
            response.insert_header((header::RETRY_AFTER, secs.to_string()));
        }
        if let Self::MethodNotAllowed { allow, .. } = self {
            response.insert_header((header::ALLOW, *allow));
        }
        if let Self::RateLimited(r) = self {
            for header in r.snapshot.headers() {
                response.insert_header(header);
            }
        }
        if let Self::Unauthorized(_) = self {
            // RFC 9110, 15.5.2: a 401 carries the challenge of the scheme the key goes in.
            response.insert_header((header::WWW_AUTHENTICATE, "Bearer"));
        }
        if let Self::UnsupportedContentEncoding(_) = self {
            response.insert_header((header::ACCEPT_ENCODING, "identity"));
        }
        if matches!(self, Self::BodyTimeout(_)) {
            // The rest of the body may still come: the connection cannot be reused.
            response.force_close();
        }
        response.json(self.to_body())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::body::MessageBody;

    fn body_json(e: &ApiError) -> serde_json::Value {
        let bytes = e.error_response().into_body().try_into_bytes().unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn invalid_request_names_its_param() {
        let e = ApiError::invalid("temperature", "temperature must be in [0, 2]");
        assert_eq!(e.status_code(), StatusCode::BAD_REQUEST);
        assert_eq!(
            body_json(&e),
            serde_json::json!({"error": {"message": "temperature must be in [0, 2]",
                "type": "invalid_request_error", "param": "temperature", "code": null}})
        );
    }

    #[test]
    fn overload_is_503_with_retry_after() {
        let e = ApiError::from(EngineError::new(
            EngineErrorKind::Overloaded {
                retry_after_secs: 3,
            },
            "queue full",
        ));
        let response = e.error_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers().get(header::RETRY_AFTER).unwrap(), "3");
        assert_eq!(body_json(&e)["error"]["code"], "overloaded");
    }

    /// A missing or wrong key is OpenAI's 401 `invalid_api_key` with the `Bearer` challenge
    /// RFC 9110 requires of a 401 (it had none).
    #[test]
    fn unauthorized_is_401_with_a_bearer_challenge() {
        let e = ApiError::Unauthorized("Incorrect API key provided.");
        let response = e.error_response();
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(
            response.headers().get(header::WWW_AUTHENTICATE).unwrap(),
            "Bearer"
        );
        assert_eq!(body_json(&e)["error"]["code"], "invalid_api_key");
    }

    /// A request timed out in the queue: 503 `queue_timeout` with `Retry-After` and the
    /// engine's message (its wait and its bound).
    #[test]
    fn a_queue_timeout_is_503_with_retry_after_and_the_bound() {
        let message = "The request waited 2.01 s in the queue without being admitted, longer \
                       than tiers.free.max_queue_ms = 2000: the server is overloaded; retry later.";
        let e = ApiError::from(EngineError::new(EngineErrorKind::QueueTimeout, message));
        let response = e.error_response();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers().get(header::RETRY_AFTER).unwrap(), "1");
        let body = body_json(&e);
        assert_eq!(body["error"]["code"], "queue_timeout");
        assert_eq!(body["error"]["type"], "server_error");
        assert_eq!(body["error"]["message"], message);
    }

    /// A tenant at its tier's per-tenant bound: OpenAI's 429 `rate_limit_exceeded` with
    /// `Retry-After` and the engine's message.
    #[test]
    fn a_busy_tenant_is_429_with_retry_after() {
        let message = "tenant `acme` has too many requests in flight for this one's 1 choice \
                       (n = 1) (tiers.free.max_pending_per_tenant is 2); retry when one ends";
        let e = ApiError::from(EngineError::new(EngineErrorKind::TenantBusy, message));
        let response = e.error_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers().get(header::RETRY_AFTER).unwrap(), "1");
        let body = body_json(&e);
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert_eq!(body["error"]["type"], "requests");
        assert_eq!(body["error"]["message"], message);
    }

    /// A request larger than a bound on requests in flight can never be admitted: a 400 with
    /// the engine's message, and no `Retry-After` (retrying cannot help).
    #[test]
    fn too_many_choices_is_a_400_without_retry_after() {
        let e = ApiError::from(EngineError::new(
            EngineErrorKind::TooManyChoices,
            "this request has 2 choices but server.max_pending_requests is 1",
        ));
        let response = e.error_response();
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        assert!(response.headers().get(header::RETRY_AFTER).is_none());
        let body = body_json(&e);
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert_eq!(body["error"]["code"], "too_many_choices");
        assert_eq!(
            body["error"]["message"],
            "this request has 2 choices but server.max_pending_requests is 1"
        );
    }

    #[test]
    fn internal_errors_hide_their_detail() {
        let e = ApiError::from(EngineError::new(
            EngineErrorKind::Internal,
            "cuda oom at 0x1",
        ));
        assert_eq!(e.status_code(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = body_json(&e);
        assert!(!body["error"]["message"].as_str().unwrap().contains("cuda"));
    }

    /// A grammar that failed while generating is a server error as an internal one is, but the
    /// client learns why: the message is about its own grammar.
    #[test]
    fn a_grammar_failed_while_generating_is_a_server_error_that_says_why() {
        let e = ApiError::from(EngineError::new(
            EngineErrorKind::StructuredOutput,
            "structured output: the lexer failed after 3 generated tokens",
        ));
        assert_eq!(e.status_code(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = body_json(&e);
        assert_eq!(body["error"]["type"], "server_error");
        assert_eq!(
            body["error"]["message"],
            "structured output: the lexer failed after 3 generated tokens"
        );
    }

    #[test]
    fn context_length_keeps_engine_param_and_code() {
        let e = ApiError::from(
            EngineError::new(EngineErrorKind::ContextLengthExceeded, "too long")
                .with_param("prompt"),
        );
        let body = body_json(&e);
        assert_eq!(body["error"]["code"], "context_length_exceeded");
        assert_eq!(body["error"]["param"], "prompt");
        assert_eq!(e.status_code(), StatusCode::BAD_REQUEST);
    }

    #[test]
    fn a_body_timeout_is_408_and_closes_the_connection() {
        let e = ApiError::BodyTimeout(std::time::Duration::from_secs(2));
        let response = e.error_response();
        assert_eq!(response.status(), StatusCode::REQUEST_TIMEOUT);
        assert!(!response.head().keep_alive(), "the connection is kept");
        let body = body_json(&e);
        assert_eq!(body["error"]["code"], "request_timeout");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("2 seconds"),
            "{body}"
        );
    }

    /// A server without an admin key refuses the admin routes with a 403, not a 401: no
    /// credential would help, and the message says which setting would.
    #[test]
    fn a_disabled_admin_api_is_403_admin_disabled_naming_the_setting() {
        let e = ApiError::AdminDisabled;
        assert_eq!(e.status_code(), StatusCode::FORBIDDEN);
        let body = body_json(&e);
        assert_eq!(body["error"]["code"], "admin_disabled");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("server.admin_key"),
            "{body}"
        );
    }

    /// An engine without embeddings answers `/v1/embeddings` with a 404 that says so.
    #[test]
    fn embeddings_not_served_is_404_with_code() {
        let e = ApiError::EmbeddingsNotServed;
        assert_eq!(e.status_code(), StatusCode::NOT_FOUND);
        let body = body_json(&e);
        assert_eq!(body["error"]["code"], "embeddings_not_served");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("does not support the Embeddings API"),
            "{body}"
        );
    }

    /// A rate-limited request: 429 typed as OpenAI types it, `Retry-After` rounded up, and the
    /// tenant's limits in OpenAI's headers.
    #[test]
    fn rate_limited_is_429_with_retry_after_and_the_limits() {
        use crate::rate_limit::{LimitKind, LimitState, Snapshot};
        let state = LimitState {
            limit: 1000,
            remaining: 0,
            reset: std::time::Duration::from_secs(90),
        };
        let e = ApiError::RateLimited(Box::new(RateLimited {
            kind: LimitKind::Tokens,
            limit: 1000,
            retry_after: std::time::Duration::from_millis(2100),
            snapshot: Snapshot {
                requests: None,
                tokens: Some(state),
            },
            tier: "free".into(),
            tenant: "acme".into(),
        }));
        let response = e.error_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        let h = response.headers();
        assert_eq!(h.get(header::RETRY_AFTER).unwrap(), "3");
        assert_eq!(h.get("x-ratelimit-limit-tokens").unwrap(), "1000");
        assert_eq!(h.get("x-ratelimit-remaining-tokens").unwrap(), "0");
        assert_eq!(h.get("x-ratelimit-reset-tokens").unwrap(), "1m30s");
        assert!(h.get("x-ratelimit-limit-requests").is_none());
        let body = body_json(&e);
        assert_eq!(body["error"]["type"], "tokens");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert_eq!(
            body["error"]["message"],
            "Rate limit reached for tenant acme (tier free) on tokens per min (TPM): Limit \
             1000, Used 1000. Please try again in 2.1s."
        );
    }

    /// A message or param quoting a long value the client sent is cut in the middle to the
    /// bounds, keeping its head and its tail; shorter ones are whole.
    #[test]
    fn long_messages_and_params_are_cut_in_the_middle() {
        let value = "é".repeat(1_000_000);
        let e = ApiError::invalid(
            format!("logit_bias.{value}"),
            format!("invalid type: string \"{value}\", expected u32 at line 1 column 9"),
        );
        let body = e.to_body().error;
        assert_eq!(body.message.chars().count(), MAX_MESSAGE_CHARS);
        assert!(
            body.message.starts_with("invalid type: string \"éé"),
            "{}",
            body.message
        );
        assert!(body
            .message
            .ends_with("éé\", expected u32 at line 1 column 9"));
        assert_eq!(body.message.matches('…').count(), 1);
        let param = body.param.unwrap();
        assert_eq!(param.chars().count(), MAX_PARAM_CHARS);
        assert!(
            param.starts_with("logit_bias.éé") && param.contains('…'),
            "{param}"
        );

        let exact = "x".repeat(MAX_MESSAGE_CHARS);
        let e = ApiError::invalid("n", exact.clone());
        assert_eq!(e.to_body().error.message, exact);
        assert_eq!(e.to_body().error.param.as_deref(), Some("n"));
    }

    #[test]
    fn model_not_found_is_404_with_code() {
        let e = ApiError::ModelNotFound("gpt-9".into());
        assert_eq!(e.status_code(), StatusCode::NOT_FOUND);
        let body = body_json(&e);
        assert_eq!(body["error"]["code"], "model_not_found");
        assert_eq!(body["error"]["param"], "model");
    }
}
