//! API configuration, API keys, tenants and the bearer-token middleware.
//!
//! Keys are compared in constant time (`subtle`), and every configured key is compared on every
//! request, so neither the position of a key in the list nor the length of a matching prefix
//! shows in the response time.

use std::sync::Arc;

use actix_web::body::MessageBody;
use actix_web::dev::{ServiceRequest, ServiceResponse};
use actix_web::http::header;
use actix_web::middleware::Next;
use actix_web::{web, HttpMessage};
use subtle::ConstantTimeEq;

use crate::error::ApiError;
use crate::schema::reasoning::ThinkTags;
use crate::schema::tools::ToolSetup;
use crate::state::ApiState;
use crate::throttle::Throttle;

/// HTTP-layer settings, filled from the YAML config by the binary.
#[derive(Clone, PartialEq)]
pub struct ApiConfig {
    /// Accepted API keys. Empty means the API is open and every request belongs to
    /// [`ApiConfig::anonymous_tenant`] at [`ApiConfig::default_tier`]; the binary says so at
    /// start, and refuses a configured keys file that holds no key rather than open the API.
    pub api_keys: Vec<ApiKeyEntry>,
    /// Key for `/admin/*`; `None` disables the admin routes (always 403 `admin_disabled`).
    pub admin_key: Option<String>,
    /// Largest accepted request body in bytes (larger → 413).
    pub max_body_bytes: usize,
    /// Time a client may take to send a request body once its head is read (longer → 408).
    pub body_timeout: std::time::Duration,
    /// Tier of requests on an open API.
    pub default_tier: String,
    /// The configured tiers' names: a request's log span names its tier only where it is one
    /// of these, as its metrics carry a `tier` label only then (the open API's default tier,
    /// or a key's, when no tier of that name is configured, is named by neither).
    pub tiers: Vec<String>,
    /// Tenant of requests on an open API.
    pub anonymous_tenant: String,
    /// How the model writes tool calls, and who writes tools into its prompts (chat
    /// completions and `/tokenize` with tools).
    pub tools: ToolSetup,
    /// The tags of the reasoning read apart from chat answers (`reasoning_content`), if it is;
    /// who opens the block is found per request (the engine says whether the rendered prompt
    /// opened it).
    pub reasoning: Option<ThinkTags>,
    /// The tags' ids where they are special tokens of the tokenizer (Mistral's `[THINK]` and
    /// `[/THINK]`): the answer's text keeps them for the splitter.
    pub reasoning_tokens: [Option<u32>; 2],
    /// Bounds of the Responses API's store (`store`, `previous_response_id`).
    pub responses_store: crate::StoreLimits,
    /// Which browser origins may call (CORS); `None` sends no CORS headers.
    pub cors: Option<crate::cors::CorsSettings>,
    /// Rate limits per tier, applied to each tenant ([`crate::rate_limit`]); tiers not
    /// listed are not limited.
    pub rate_limits: std::collections::HashMap<String, crate::rate_limit::TierLimits>,
}

impl Default for ApiConfig {
    fn default() -> Self {
        Self {
            api_keys: Vec::new(),
            admin_key: None,
            max_body_bytes: 4 * 1024 * 1024,
            body_timeout: std::time::Duration::from_secs(10),
            default_tier: "standard".to_owned(),
            tiers: Vec::new(),
            anonymous_tenant: "anonymous".to_owned(),
            tools: ToolSetup::default(),
            reasoning: None,
            reasoning_tokens: [None; 2],
            responses_store: crate::StoreLimits::default(),
            cors: None,
            rate_limits: std::collections::HashMap::new(),
        }
    }
}

/// One API key and whom it stands for.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKeyEntry {
    /// The secret bearer token.
    pub key: String,
    /// Tenant the key belongs to (fair share, cache isolation); a bounded, configured name.
    pub tenant: String,
    /// Service tier of the key's requests.
    pub tier: String,
    /// The LoRA adapters the key's requests may name.
    pub adapters: AdapterAccess,
}

/// The LoRA adapters an API key's requests may name as `model` (its `adapters` patterns:
/// names, or prefixes ending in `*`); every adapter by default. An adapter a key may not name
/// is `model_not_found` to it, listed nowhere it can see, as if it did not exist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdapterAccess(Option<Arc<[String]>>);

impl AdapterAccess {
    /// Every adapter.
    pub fn all() -> Self {
        Self(None)
    }

    /// Only the adapters `patterns` match (checked by the configuration:
    /// `switchyard_config::check_adapter_pattern`); none for an empty list.
    pub fn only(patterns: Vec<String>) -> Self {
        Self(Some(patterns.into()))
    }

    /// Whether the adapter `name` may be named: O(patterns), at most 256 of them.
    pub fn allows(&self, name: &str) -> bool {
        let Some(patterns) = &self.0 else {
            return true;
        };
        patterns.iter().any(|p| match p.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => p == name,
        })
    }
}

impl std::fmt::Debug for ApiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiConfig")
            .field("api_keys", &self.api_keys)
            .field("admin_key", &self.admin_key.as_ref().map(|_| "<redacted>"))
            .field("max_body_bytes", &self.max_body_bytes)
            .field("body_timeout", &self.body_timeout)
            .field("default_tier", &self.default_tier)
            .field("tiers", &self.tiers)
            .field("anonymous_tenant", &self.anonymous_tenant)
            .field("tools", &self.tools)
            .field("reasoning", &self.reasoning)
            .field("reasoning_tokens", &self.reasoning_tokens)
            .field("responses_store", &self.responses_store)
            .field("cors", &self.cors)
            .field("rate_limits", &self.rate_limits)
            .finish()
    }
}

impl std::fmt::Debug for ApiKeyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeyEntry")
            .field("key", &"<redacted>")
            .field("tenant", &self.tenant)
            .field("tier", &self.tier)
            .field("adapters", &self.adapters)
            .finish()
    }
}

/// Who sent a request, attached to it by the middleware; handlers extract it with
/// `web::ReqData<Principal>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Principal {
    /// The caller's tenant.
    pub tenant: String,
    /// The caller's tier.
    pub tier: String,
    /// The LoRA adapters the caller may name.
    pub adapters: AdapterAccess,
}

/// What a request's `Authorization` header presents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presented<'a> {
    /// No header, or the Bearer scheme with no token.
    Nothing,
    /// A header that does not use the Bearer scheme (a bare key, `Basic ...`): the key is not
    /// read, and never echoed.
    OtherScheme,
    /// A Bearer token.
    Bearer(&'a [u8]),
}

/// What a request's `Authorization` header presents (the scheme's name in any case, as
/// RFC 9110 has it).
fn bearer_token(req: &ServiceRequest) -> Presented<'_> {
    let Some(value) = req.headers().get(header::AUTHORIZATION) else {
        return Presented::Nothing;
    };
    let value = value.as_bytes().trim_ascii();
    if value.is_empty() || value.eq_ignore_ascii_case(b"bearer") {
        return Presented::Nothing;
    }
    match value.get(..7) {
        Some(scheme) if scheme.eq_ignore_ascii_case(b"bearer ") => {
            Presented::Bearer(value[7..].trim_ascii())
        }
        _ => Presented::OtherScheme,
    }
}

/// Constant-time equality of a presented token and a configured secret.
fn secret_matches(presented: &[u8], secret: &str) -> bool {
    // `ct_eq` on slices of different length returns false early, which leaks only the length.
    bool::from(presented.ct_eq(secret.as_bytes()))
}

impl ApiConfig {
    /// Finds the principal for a presented token, comparing against every key.
    pub fn authenticate(&self, presented: Presented<'_>) -> Result<Principal, ApiError> {
        if self.api_keys.is_empty() {
            return Ok(Principal {
                tenant: self.anonymous_tenant.clone(),
                tier: self.default_tier.clone(),
                adapters: AdapterAccess::all(),
            });
        }
        let presented = match presented {
            Presented::Bearer(token) => token,
            Presented::Nothing => {
                return Err(ApiError::Unauthorized(
                    "Missing API key: send it as `Authorization: Bearer <key>`.",
                ))
            }
            Presented::OtherScheme => {
                return Err(ApiError::Unauthorized(
                    "The Authorization header must use the Bearer scheme: send the API key as \
                     `Authorization: Bearer <key>`.",
                ))
            }
        };
        let mut found: Option<&ApiKeyEntry> = None;
        for entry in &self.api_keys {
            if secret_matches(presented, &entry.key) && found.is_none() {
                found = Some(entry);
            }
        }
        found
            .map(|e| Principal {
                tenant: e.tenant.clone(),
                tier: e.tier.clone(),
                adapters: e.adapters.clone(),
            })
            .ok_or(ApiError::Unauthorized("Incorrect API key provided."))
    }

    /// Checks a presented token against the admin key.
    pub fn authenticate_admin(&self, presented: Presented<'_>) -> Result<(), ApiError> {
        match (&self.admin_key, presented) {
            (Some(secret), Presented::Bearer(token)) if secret_matches(token, secret) => Ok(()),
            (None, _) => Err(ApiError::AdminDisabled),
            (Some(_), Presented::Nothing) => Err(ApiError::Unauthorized(
                "Missing admin key: send it as `Authorization: Bearer <key>`.",
            )),
            (Some(_), Presented::OtherScheme) => Err(ApiError::Unauthorized(
                "The Authorization header must use the Bearer scheme: send the admin key as \
                 `Authorization: Bearer <key>`.",
            )),
            (Some(_), Presented::Bearer(_)) => {
                Err(ApiError::Unauthorized("Incorrect admin key provided."))
            }
        }
    }
}

/// Refused API keys and admin keys (missing or wrong), each logged at WARN at most once a
/// second with how many were refused since the previous line: a client guessing keys writes a
/// line a second, not a line a guess.
static API_KEY_REFUSALS: Throttle = Throttle::new(std::time::Duration::from_secs(1));
static ADMIN_KEY_REFUSALS: Throttle = Throttle::new(std::time::Duration::from_secs(1));

/// Logs a refused key (`what`), rate-limited by `throttle`: the route and the peer address of
/// the latest refusal and the count since the last line; never the key. An admin scope that
/// is off (403) is no failed authentication and is not logged.
fn log_refusal(req: &ServiceRequest, e: &ApiError, throttle: &Throttle, what: &'static str) {
    if !matches!(e, ApiError::Unauthorized(_)) {
        return;
    }
    if let Some(refused) = throttle.hit(std::time::Instant::now()) {
        let route = req
            .match_pattern()
            .unwrap_or_else(|| "unmatched".to_owned());
        let peer = req
            .peer_addr()
            .map_or_else(|| "unknown".to_owned(), |a| a.to_string());
        let missing = !matches!(bearer_token(req), Presented::Bearer(_));
        tracing::warn!(
            %route,
            %peer,
            key = what,
            missing,
            refused,
            "authentication failed (refused counts the refusals since the previous such line)"
        );
    }
}

fn config_of(req: &ServiceRequest) -> Result<Arc<ApiConfig>, ApiError> {
    req.app_data::<web::Data<ApiState>>()
        .map(|state| state.config())
        .ok_or_else(|| {
            ApiError::Engine(crate::engine::EngineError::new(
                crate::engine::EngineErrorKind::Internal,
                "ApiState missing from app data",
            ))
        })
}

/// Middleware for the model routes: authenticates the API key and attaches a [`Principal`].
pub async fn require_api_key(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let config = config_of(&req)?;
    let principal = match config.authenticate(bearer_token(&req)) {
        Ok(p) => p,
        Err(e) => {
            log_refusal(&req, &e, &API_KEY_REFUSALS, "API key");
            return Err(e.into());
        }
    };
    let span = tracing::Span::current();
    span.record("tenant", tracing::field::display(&principal.tenant));
    if config.tiers.contains(&principal.tier) {
        span.record("tier", tracing::field::display(&principal.tier));
    }
    req.extensions_mut().insert(principal);
    let mut response = next.call(req).await?;
    // A route that applied the tenant's rate limits left them for the headers (a refusal's
    // error response carries them itself).
    let snapshot = response
        .request()
        .extensions()
        .get::<crate::rate_limit::SharedSnapshot>()
        .map(crate::rate_limit::SharedSnapshot::get);
    if let Some(snapshot) = snapshot {
        let headers = response.headers_mut();
        for (name, value) in snapshot.headers() {
            if let (Ok(name), Ok(value)) = (
                actix_web::http::header::HeaderName::try_from(name),
                actix_web::http::header::HeaderValue::try_from(value),
            ) {
                headers.insert(name, value);
            }
        }
    }
    Ok(response)
}

/// Middleware for `/admin/*`: requires the admin key.
pub async fn require_admin_key(
    req: ServiceRequest,
    next: Next<impl MessageBody + 'static>,
) -> Result<ServiceResponse<impl MessageBody>, actix_web::Error> {
    let config = config_of(&req)?;
    if let Err(e) = config.authenticate_admin(bearer_token(&req)) {
        log_refusal(&req, &e, &ADMIN_KEY_REFUSALS, "admin key");
        return Err(e.into());
    }
    next.call(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> ApiConfig {
        ApiConfig {
            api_keys: vec![
                ApiKeyEntry {
                    key: "sk-a".into(),
                    tenant: "acme".into(),
                    tier: "premium".into(),
                    adapters: AdapterAccess::only(vec!["acme-*".into(), "shared".into()]),
                },
                ApiKeyEntry {
                    key: "sk-b".into(),
                    tenant: "bob".into(),
                    tier: "batch".into(),
                    adapters: AdapterAccess::all(),
                },
            ],
            admin_key: Some("adm".into()),
            ..ApiConfig::default()
        }
    }

    #[test]
    fn each_key_maps_to_its_tenant_and_tier() {
        let p = config().authenticate(Presented::Bearer(b"sk-b")).unwrap();
        assert_eq!((p.tenant.as_str(), p.tier.as_str()), ("bob", "batch"));
    }

    /// A key's adapter patterns: exact names and prefixes; every adapter without patterns,
    /// none with an empty list.
    #[test]
    fn each_key_may_name_the_adapters_its_patterns_match() {
        let c = config();
        let acme = c.authenticate(Presented::Bearer(b"sk-a")).unwrap().adapters;
        for (name, allowed) in [
            ("acme-sql", true),
            ("acme-", true),
            ("shared", true),
            ("shared-v2", false),
            ("bob-sql", false),
            ("acm", false),
        ] {
            assert_eq!(acme.allows(name), allowed, "{name}");
        }
        let bob = c.authenticate(Presented::Bearer(b"sk-b")).unwrap().adapters;
        assert!(bob.allows("acme-sql") && bob.allows("anything"));
        assert!(!AdapterAccess::only(Vec::new()).allows("acme-sql"));
        assert!(AdapterAccess::only(vec!["*".into()]).allows("acme-sql"));
        // An open API serves every adapter.
        let open = ApiConfig::default()
            .authenticate(Presented::Nothing)
            .unwrap();
        assert_eq!(open.adapters, AdapterAccess::all());
    }

    #[test]
    fn wrong_missing_and_prefix_keys_are_refused() {
        let c = config();
        for presented in [
            Presented::Bearer(b"sk-"),
            Presented::Bearer(b"sk-ab"),
            Presented::Bearer(b""),
            Presented::Nothing,
            Presented::OtherScheme,
        ] {
            assert!(matches!(
                c.authenticate(presented),
                Err(ApiError::Unauthorized(_))
            ));
        }
    }

    /// A key sent without the Bearer scheme is told so (not "missing"), without the key.
    #[test]
    fn a_key_without_the_bearer_scheme_is_told_to_use_it() {
        let request = |value: &str| {
            actix_web::test::TestRequest::default()
                .insert_header((header::AUTHORIZATION, value))
                .to_srv_request()
        };
        let presented = |value: &str| match bearer_token(&request(value)) {
            Presented::Bearer(token) => Some(String::from_utf8(token.to_vec()).unwrap()),
            Presented::Nothing => Some("nothing".into()),
            Presented::OtherScheme => None,
        };
        assert_eq!(presented("Bearer sk-a").as_deref(), Some("sk-a"));
        assert_eq!(presented("bearer  sk-a ").as_deref(), Some("sk-a"));
        assert_eq!(presented("Bearer").as_deref(), Some("nothing"));
        assert_eq!(presented("premium-key-0001"), None);
        assert_eq!(presented("Basic c2stYQ=="), None);
        assert_eq!(
            bearer_token(&actix_web::test::TestRequest::default().to_srv_request()),
            Presented::Nothing
        );
        for (result, key) in [
            (
                config().authenticate(Presented::OtherScheme).err(),
                "API key",
            ),
            (
                config().authenticate_admin(Presented::OtherScheme).err(),
                "admin key",
            ),
        ] {
            let message = result.expect("refused").to_string();
            assert_eq!(
                message,
                format!(
                    "The Authorization header must use the Bearer scheme: send the {key} as \
                     `Authorization: Bearer <key>`."
                )
            );
        }
        assert!(config()
            .authenticate(Presented::Nothing)
            .unwrap_err()
            .to_string()
            .starts_with("Missing API key"));
    }

    #[test]
    fn open_api_uses_anonymous_tenant() {
        let p = ApiConfig::default()
            .authenticate(Presented::OtherScheme)
            .unwrap();
        assert_eq!(p.tenant, "anonymous");
        assert_eq!(p.tier, "standard");
    }

    #[test]
    fn admin_key_is_separate_from_api_keys() {
        let c = config();
        assert!(c.authenticate_admin(Presented::Bearer(b"adm")).is_ok());
        assert!(c.authenticate_admin(Presented::Bearer(b"sk-a")).is_err());
        assert_eq!(
            ApiConfig::default().authenticate_admin(Presented::Bearer(b"adm")),
            Err(ApiError::AdminDisabled)
        );
    }

    #[test]
    fn debug_output_redacts_keys() {
        let text = format!("{:?}", config());
        assert!(!text.contains("sk-a") && !text.contains("sk-b") && !text.contains("adm\""));
    }
}
