//! Cross-Origin Resource Sharing, by `actix-cors`, from [`CorsSettings`].
//!
//! The middleware wraps every route, inside the request-id middleware and outside the key
//! checks: a preflight (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) is
//! answered by it, without an API key (browsers send preflights without credentials), while
//! the request that follows still needs its key. A request from an origin not allowed is
//! served as it would be without CORS, with no `Access-Control-Allow-Origin`, so the browser
//! keeps the answer from the page; its preflight is refused (400). Without settings no CORS
//! header is sent at all.

use actix_cors::Cors;
use actix_web::http::header::HeaderName;
use actix_web::http::{Method, Uri};

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
}
