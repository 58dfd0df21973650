//! The `x-request-id` response header: every response carries one, in one middleware.
//!
//! The id is decided when the request arrives: the client's own `X-Request-Id` when it sent a
//! sane one (1 to [`MAX_CLIENT_REQUEST_ID`] visible ASCII characters; anything else is
//! ignored), else a fresh random one, prefixed as the route's completion ids are (`cmpl-…` on
//! `/v1/completions`, `chatcmpl-…` on `/v1/chat/completions`, `resp_…` on `/v1/responses`,
//! `embd-…` on `/v1/embeddings`, none elsewhere): a completion handler takes it as its
//! completion's id ([`completion_id`]). Errors, 404s, refusals by the key check and streams
//! carry it too: the header goes on the response head, before any of a stream's body.
//!
//! The same middleware opens the request's log span, `request{request_id, tenant, tier}`,
//! with the id already in it: every line logged while the request is served (its handler, the
//! engine's work started from it, its stream) carries the id the client sees in
//! `x-request-id` and, once the key check has run, its tenant and, where it is one of the
//! configured tiers (as on the metrics' `tier` label), its tier. The fields come in that order
//! on every line: a formatter writes a span's fields in the order they were given values, and
//! the id is given before the key check records the others.

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{HeaderName, HeaderValue};
use actix_web::http::StatusCode;
use actix_web::middleware::Next;
use actix_web::{HttpMessage, HttpRequest, HttpResponse, ResponseError};
use tracing::Instrument;

use crate::state::request_id;

/// The header's name.
pub(crate) const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client `X-Request-Id` echoed back, in bytes.
pub(crate) const MAX_CLIENT_REQUEST_ID: usize = 128;

/// The id the request was given on arrival, kept in the request's extensions.
#[derive(Debug, Clone)]
struct ArrivalId(String);

/// The prefix of a fresh id for a request to `path`: the one its route's completion ids carry.
fn arrival_prefix(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "cmpl-",
        "/v1/chat/completions" => "chatcmpl-",
        "/v1/responses" => "resp_",
        "/v1/embeddings" => "embd-",
        _ => "",
    }
}

/// The id of a completion answered by a route whose ids start with `prefix`: `prefix` and the
/// client's `X-Request-Id` when that is plain ([`request_id`]'s rule), else the id the request
/// was given on arrival, which is the response's `x-request-id` and is in the log span.
pub(crate) fn completion_id(req: &HttpRequest, prefix: &str) -> String {
    if let Some(client) = client_request_id(req) {
        return request_id(prefix, Some(client));
    }
    match req.extensions().get::<ArrivalId>() {
        Some(ArrivalId(id)) if id.starts_with(prefix) => id.clone(),
        // Not through the middleware (or a route of another prefix): an id of its own.
        _ => request_id(prefix, None),
    }
}

/// The client's `X-Request-Id` if it is sane: 1 to [`MAX_CLIENT_REQUEST_ID`] bytes of visible
/// ASCII (`!` to `~`, so no spaces or control characters).
pub(crate) fn client_request_id(req: &HttpRequest) -> Option<&str> {
    let value = req.headers().get(REQUEST_ID_HEADER)?.to_str().ok()?;
    let sane = (1..=MAX_CLIENT_REQUEST_ID).contains(&value.len())
        && value.bytes().all(|b| b.is_ascii_graphic());
    sane.then_some(value)
}

/// Sets `x-request-id` on every response, errors of inner middleware (the key checks)
/// included.
pub(crate) async fn add_request_id(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let id = client_request_id(req.request()).map_or_else(
        || request_id(arrival_prefix(req.path()), None),
        str::to_owned,
    );
    req.extensions_mut().insert(ArrivalId(id.clone()));
    // At ERROR level so that it is enabled whatever level logging is at: a warning or error of
    // the request carries its fields too. The id is in it from the start, so that it is the
    // first field of every line; the key check fills the others.
    let span = tracing::error_span!(
        "request",
        request_id = %id,
        tenant = tracing::field::Empty,
        tier = tracing::field::Empty,
    );
    match next.call(req).instrument(span).await {
        Ok(mut res) => {
            if let Ok(value) = HeaderValue::from_str(&id) {
                res.headers_mut().insert(REQUEST_ID_HEADER, value);
            }
            Ok(res)
        }
        // A middleware's refusal has no response yet: the error renders its own.
        Err(error) => Err(WithRequestId { error, id }.into()),
    }
}

/// An inner middleware's error, rendered with its `x-request-id`.
#[derive(Debug)]
struct WithRequestId {
    error: actix_web::Error,
    id: String,
}

impl std::fmt::Display for WithRequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.error.fmt(f)
    }
}

impl ResponseError for WithRequestId {
    fn status_code(&self) -> StatusCode {
        self.error.as_response_error().status_code()
    }

    fn error_response(&self) -> HttpResponse {
        let mut response = self.error.error_response();
        if let Ok(value) = HeaderValue::from_str(&self.id) {
            response.headers_mut().insert(REQUEST_ID_HEADER, value);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use actix_web::test::TestRequest;

    fn client_id(value: &str) -> Option<String> {
        let req = TestRequest::default()
            .insert_header(("x-request-id", value))
            .to_http_request();
        client_request_id(&req).map(str::to_owned)
    }

    #[test]
    fn fresh_ids_carry_their_routes_completion_prefix() {
        assert_eq!(arrival_prefix("/v1/completions"), "cmpl-");
        assert_eq!(arrival_prefix("/v1/chat/completions"), "chatcmpl-");
        assert_eq!(arrival_prefix("/v1/responses"), "resp_");
        assert_eq!(arrival_prefix("/v1/embeddings"), "embd-");
        assert_eq!(arrival_prefix("/v1/models"), "");
        assert_eq!(arrival_prefix("/tokenize"), "");
        // The arrival id is the completion's; a client's plain id is prefixed; without the
        // middleware a fresh id of the route's prefix.
        let req = TestRequest::default().to_http_request();
        req.extensions_mut()
            .insert(ArrivalId("chatcmpl-0123".into()));
        assert_eq!(completion_id(&req, "chatcmpl-"), "chatcmpl-0123");
        assert!(completion_id(&req, "cmpl-").starts_with("cmpl-"));
        let req = TestRequest::default()
            .insert_header(("x-request-id", "abc-1"))
            .to_http_request();
        req.extensions_mut().insert(ArrivalId("abc-1".into()));
        assert_eq!(completion_id(&req, "cmpl-"), "cmpl-abc-1");
    }

    #[test]
    fn only_short_visible_ascii_client_ids_are_echoed() {
        assert_eq!(client_id("abc-1").as_deref(), Some("abc-1"));
        assert_eq!(client_id("a:b/c=d").as_deref(), Some("a:b/c=d"));
        let longest = "x".repeat(MAX_CLIENT_REQUEST_ID);
        assert_eq!(client_id(&longest), Some(longest.clone()));
        assert_eq!(client_id(&"x".repeat(MAX_CLIENT_REQUEST_ID + 1)), None);
        assert_eq!(client_id("a b"), None);
        assert_eq!(client_id(""), None);
        assert_eq!(client_id("tab\there"), None);
    }
}
