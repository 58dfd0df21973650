//! The `x-request-id` response header: every response carries one, in one middleware.
//!
//! The id is the client's own `X-Request-Id` when it sent a sane one (1 to
//! [`MAX_CLIENT_REQUEST_ID`] visible ASCII characters; anything else is ignored), else the id
//! a handler recorded for the request ([`record`]: a completion's `cmpl-…` / `chatcmpl-…`
//! id), else a fresh random one. Errors, 404s, refusals by the key check and streams carry it
//! too: the header goes on the response head, before any of a stream's body.
//!
//! The same middleware opens the request's log span, `request{request_id, tenant, tier}`: every
//! line logged while the request is served (its handler, the engine's work started from it, its
//! stream) carries the id the client sees in `x-request-id` (the client's, else the one the
//! handler records) and, once the key check has run, its tenant and tier.

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

/// The id a handler gave its request (a completion's id), kept in the request's extensions.
#[derive(Debug, Clone)]
struct RecordedId(String);

/// Records `id` as the request's id: the response's `x-request-id` unless the client sent
/// its own.
pub(crate) fn record(req: &HttpRequest, id: &str) {
    req.extensions_mut().insert(RecordedId(id.to_owned()));
    // The log span names the id the response carries: the client's, set on arrival, or this.
    if client_request_id(req).is_none() {
        tracing::Span::current().record("request_id", tracing::field::display(id));
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
    // Taken before the call: the request cannot be cloned while it is being routed.
    let client = client_request_id(req.request()).map(str::to_owned);
    // At ERROR level so that it is enabled whatever level logging is at: a warning or error of
    // the request carries its fields too. Fields are filled as they are known.
    let span = tracing::error_span!(
        "request",
        request_id = tracing::field::Empty,
        tenant = tracing::field::Empty,
        tier = tracing::field::Empty,
    );
    if let Some(id) = &client {
        span.record("request_id", tracing::field::display(id));
    }
    match next.call(req).instrument(span).await {
        Ok(mut res) => {
            let id =
                client.unwrap_or_else(|| match res.request().extensions().get::<RecordedId>() {
                    Some(RecordedId(id)) => id.clone(),
                    None => request_id("", None),
                });
            if let Ok(value) = HeaderValue::from_str(&id) {
                res.headers_mut().insert(REQUEST_ID_HEADER, value);
            }
            Ok(res)
        }
        // A middleware's refusal has no response yet: the error renders its own.
        Err(error) => Err(WithRequestId {
            error,
            id: client.unwrap_or_else(|| request_id("", None)),
        }
        .into()),
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
