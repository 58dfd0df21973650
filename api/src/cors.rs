//! Cross-Origin Resource Sharing, by `actix-cors`, from [`CorsSettings`].
//!
//! The middleware wraps every route, inside the request-id middleware and outside the key
//! checks: a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is
//! answered by it, without an API key (browsers send preflights without credentials), while
//! the request that follows still needs its key. A request from an origin not allowed is
//! served as it would be without CORS, with no `Access-Control-Allow-Origin`, so the browser
//! keeps the answer from the page; its preflight is refused (400, in OpenAI's error body:
//! [`json_refusals`] maps actix-cors's plain-text refusals to [`CorsRefusal`]s, which
//! `crate::error` turns into HTTP as every other error). Without settings no CORS header is
//! sent at all.

use actix_cors::{Cors, CorsError};
use actix_web::body::{EitherBody, MessageBody};
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header::{self, HeaderName, HeaderValue};
use actix_web::http::{Method, Uri};
use actix_web::middleware::Next;
use actix_web::{HttpRequest, ResponseError};

use crate::error::ApiError;

/// Most bytes of a request header quoted in a refusal's message.
const MAX_QUOTED_BYTES: usize = 256;

/// A list of allowed values, or any.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AllowList {
    /// Any value (`*` in the configuration).
    Any,
    /// Only these.
    Only(Vec<String>),
}

impl AllowList {
    /// `["*"]` is [`AllowList::Any`], anything else the list as it is.
    pub fn from_config(list: &[String]) -> Self {
        match list {
            [only] if only == "*" => Self::Any,
            other => Self::Only(other.to_vec()),
        }
    }
}

/// Which browser origins may call, and how (`server.cors`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorsSettings {
    /// Origins allowed to call (compared byte for byte with `Origin`).
    pub allowed_origins: AllowList,
    /// Methods a cross-origin request may use.
    pub allowed_methods: AllowList,
    /// Request headers a cross-origin request may send.
    pub allowed_headers: AllowList,
    /// Send `Access-Control-Allow-Credentials: true` (never with any origin).
    pub allow_credentials: bool,
    /// Seconds a browser may cache a preflight's answer.
    pub max_age_s: u64,
}

/// Response headers a page may read besides the safelisted ones: the id to quote in a report.
const EXPOSED_HEADERS: [&str; 1] = ["x-request-id"];

impl CorsSettings {
    /// Why actix-cors would refuse to build these settings (it fails the server's start, so the
    /// binary checks before then): an origin that is not a URI, a method or header name that is
    /// not one, credentials with any origin. Names the list and the entry's index
    /// (`allowed_origins[1]`).
    pub fn check(&self) -> Result<(), (String, String)> {
        let each = |field: &str, list: &AllowList, ok: &dyn Fn(&str) -> bool| {
            let AllowList::Only(list) = list else {
                return Ok(());
            };
            match list.iter().position(|v| !ok(v)) {
                Some(i) => Err((
                    format!("{field}[{i}]"),
                    format!("`{}` cannot be used in a CORS header", list[i]),
                )),
                None => Ok(()),
            }
        };
        each("allowed_origins", &self.allowed_origins, &|v| {
            v != "*" && Uri::try_from(v).is_ok()
        })?;
        each("allowed_methods", &self.allowed_methods, &|v| {
            Method::from_bytes(v.as_bytes()).is_ok()
        })?;
        each("allowed_headers", &self.allowed_headers, &|v| {
            HeaderName::try_from(v).is_ok()
        })?;
        if self.allow_credentials && self.allowed_origins == AllowList::Any {
            return Err((
                "allow_credentials".into(),
                "credentials cannot be allowed for any origin".into(),
            ));
        }
        Ok(())
    }

    /// The middleware. Settings that [`CorsSettings::check`] refuses make actix-web's worker
    /// fail to start (actix-cors reports them then).
    pub(crate) fn middleware(&self) -> Cors {
        let mut cors = Cors::default();
        cors = match &self.allowed_origins {
            // `*` itself: no origin echoed into responses a cache might share.
            AllowList::Any => cors.allow_any_origin().send_wildcard(),
            AllowList::Only(origins) => origins.iter().fold(cors, |c, o| c.allowed_origin(o)),
        };
        cors = match &self.allowed_methods {
            AllowList::Any => cors.allow_any_method(),
            AllowList::Only(methods) => cors.allowed_methods(methods.iter().map(String::as_str)),
        };
        cors = match &self.allowed_headers {
            AllowList::Any => cors.allow_any_header(),
            AllowList::Only(headers) => cors.allowed_headers(headers.iter().map(String::as_str)),
        };
        if self.allow_credentials {
            cors = cors.supports_credentials();
        }
        cors.expose_headers(EXPOSED_HEADERS)
            .max_age(usize::try_from(self.max_age_s).unwrap_or(usize::MAX))
    }
}

/// Why a CORS request was refused (400): what `server.cors` does not allow, or a preflight
/// that is malformed. The quoted request values are cut to [`MAX_QUOTED_BYTES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CorsRefusal {
    /// The `Origin` is not in `server.cors.allowed_origins`.
    #[error(
        "The origin {0} is not allowed to make cross-origin requests to this server \
         (server.cors.allowed_origins)."
    )]
    OriginNotAllowed(String),
    /// The preflight's `Access-Control-Request-Method` is not in `allowed_methods`.
    #[error(
        "The method {0} is not allowed in cross-origin requests to this server \
         (server.cors.allowed_methods)."
    )]
    MethodNotAllowed(String),
    /// One of the preflight's `Access-Control-Request-Headers` is not in `allowed_headers`.
    #[error(
        "The request headers {0} are not all allowed in cross-origin requests to this \
         server (server.cors.allowed_headers)."
    )]
    HeadersNotAllowed(String),
    /// A header the preflight needs is missing or malformed.
    #[error("Malformed CORS preflight: {0}.")]
    Malformed(&'static str),
}

impl CorsRefusal {
    /// The error body's `code`.
    pub fn code(&self) -> &'static str {
        match self {
            Self::OriginNotAllowed(_) => "cors_origin_not_allowed",
            Self::MethodNotAllowed(_) => "cors_method_not_allowed",
            Self::HeadersNotAllowed(_) => "cors_headers_not_allowed",
            Self::Malformed(_) => "cors_invalid_preflight",
        }
    }

    /// The refusal of actix-cors's `error` for `req`, quoting the request's header at fault.
    fn of(error: &CorsError, req: &HttpRequest) -> Self {
        let quote = |name: HeaderName| quoted(req.headers().get(name));
        match error {
            CorsError::OriginNotAllowed => Self::OriginNotAllowed(quote(header::ORIGIN)),
            CorsError::MethodNotAllowed => {
                Self::MethodNotAllowed(quote(header::ACCESS_CONTROL_REQUEST_METHOD))
            }
            CorsError::HeadersNotAllowed => {
                Self::HeadersNotAllowed(quote(header::ACCESS_CONTROL_REQUEST_HEADERS))
            }
            CorsError::MissingOrigin => Self::Malformed("the Origin header is missing"),
            CorsError::MissingRequestMethod => {
                Self::Malformed("the Access-Control-Request-Method header is missing")
            }
            CorsError::BadRequestMethod => {
                Self::Malformed("the Access-Control-Request-Method header is not a method")
            }
            CorsError::BadRequestHeaders => Self::Malformed(
                "the Access-Control-Request-Headers header is not a list of header names",
            ),
            _ => Self::Malformed("refused by the CORS settings"),
        }
    }
}

/// A request header's value in backquotes for a message: at most [`MAX_QUOTED_BYTES`] (cut at
/// a character boundary, marked `...`); one that is not visible text is not quoted.
fn quoted(value: Option<&HeaderValue>) -> String {
    let Some(text) = value.and_then(|v| v.to_str().ok()) else {
        return "(not text)".into();
    };
    if text.len() <= MAX_QUOTED_BYTES {
        return format!("`{text}`");
    }
    let mut end = MAX_QUOTED_BYTES;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("`{}...`", &text[..end])
}

/// Answers actix-cors's refusals (its plain-text 400s) with [`ApiError::CorsRefused`], OpenAI's
/// JSON error body; every other response passes as it is. Wraps the CORS middleware, so a
/// refusal carries no CORS header but the `Vary` actix-cors set.
pub(crate) async fn json_refusals(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<EitherBody<impl MessageBody>>, actix_web::Error> {
    let res = next.call(req).await?;
    let refusal = res
        .response()
        .error()
        .and_then(|e| e.as_error::<CorsError>())
        .map(|e| CorsRefusal::of(e, res.request()));
    let Some(refusal) = refusal else {
        return Ok(res.map_into_left_body());
    };
    let (req, refused) = res.into_parts();
    let mut answer = ApiError::CorsRefused(refusal).error_response();
    for vary in refused.headers().get_all(header::VARY) {
        answer.headers_mut().append(header::VARY, vary.clone());
    }
    Ok(ServiceResponse::new(req, answer).map_into_right_body())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(origins: &[&str]) -> CorsSettings {
        CorsSettings {
            allowed_origins: AllowList::from_config(
                &origins.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
            ),
            allowed_methods: AllowList::Only(vec!["GET".into(), "POST".into()]),
            allowed_headers: AllowList::Any,
            allow_credentials: false,
            max_age_s: 600,
        }
    }

    #[test]
    fn what_actix_cors_would_refuse_is_named() {
        assert_eq!(settings(&["*"]).allowed_origins, AllowList::Any);
        assert_eq!(settings(&["https://a.example"]).check(), Ok(()));
        let (field, _) = settings(&["https://a.example", "http://[bad"])
            .check()
            .unwrap_err();
        assert_eq!(field, "allowed_origins[1]");
        let mut s = settings(&["https://a.example"]);
        s.allowed_headers = AllowList::Only(vec!["x y".into()]);
        assert_eq!(s.check().unwrap_err().0, "allowed_headers[0]");
        let mut s = settings(&["*"]);
        s.allow_credentials = true;
        assert_eq!(s.check().unwrap_err().0, "allow_credentials");
    }

    #[test]
    fn quoted_header_values_are_bounded_and_text_only() {
        assert_eq!(quoted(None), "(not text)");
        let v = HeaderValue::from_static("https://x.example");
        assert_eq!(quoted(Some(&v)), "`https://x.example`");
        let bytes = HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap();
        assert_eq!(quoted(Some(&bytes)), "(not text)");
        let long = HeaderValue::from_str(&"a".repeat(1000)).unwrap();
        let q = quoted(Some(&long));
        assert_eq!(q.len(), MAX_QUOTED_BYTES + 5, "{q}");
        assert!(q.ends_with("...`"));
    }
}
