//! Shared state of the HTTP layer: the engine port, the configuration, the metrics handle and
//! the drain switch used for graceful shutdown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::{HttpMessage, HttpRequest};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::watch;

use crate::auth::ApiConfig;
use crate::auth::Principal;
use crate::engine::GenerateRequest;
use crate::engine::{Engine, EngineError, EngineErrorKind};
use crate::error::ApiError;
use crate::metrics::{
    ConfiguredLabels, HTTP_IN_FLIGHT, LABEL_LIMIT, LABEL_TENANT, LABEL_TIER, RATE_LIMITED,
};
use crate::rate_limit::{estimate_prompt_tokens, Meter, RateLimiter};
use crate::response_store::ResponseStore;
use crate::throttle::Throttle;

/// Everything the routes share. Cheap to clone; one clone per HTTP worker.
#[derive(Clone)]
pub struct ApiState {
    /// The engine behind the API.
    pub(crate) engine: Arc<dyn Engine>,
    /// HTTP settings; replaced whole by [`ApiState::reload_access`] (a request reads them
    /// through [`ApiState::config`], each read seeing one version whole).
    config: Arc<parking_lot::RwLock<Arc<ApiConfig>>>,
    /// Renders `/metrics`; `None` answers 404 there.
    pub(crate) metrics: Option<PrometheusHandle>,
    /// The tenants and tiers whose series `/metrics` shows: `config`'s, replaced with it.
    metric_labels: Arc<parking_lot::RwLock<Arc<ConfiguredLabels>>>,
    /// Drain switch and in-flight count.
    lifecycle: Arc<Lifecycle>,
    /// Unix time the state was created, for `/v1/models`.
    pub(crate) started: u64,
    /// The Responses API's stored responses.
    pub(crate) responses: Arc<ResponseStore>,
    /// The tenants' rate limits.
    pub(crate) rate_limiter: Arc<RateLimiter>,
}

struct Lifecycle {
    draining: AtomicBool,
    in_flight: watch::Sender<usize>,
}

impl ApiState {
    /// State for [`crate::configure`]. `metrics` comes from
    /// [`crate::metrics::install_prometheus_recorder`].
    pub fn new(
        engine: Arc<dyn Engine>,
        config: ApiConfig,
        metrics: Option<PrometheusHandle>,
    ) -> Self {
        let (in_flight, _) = watch::channel(0);
        let responses = Arc::new(ResponseStore::new(config.responses_store));
        let rate_limiter = Arc::new(RateLimiter::new(config.rate_limits.clone()));
        register_rate_limited(&config);
        let metric_labels = Arc::new(ConfiguredLabels::of(&config));
        Self {
            engine,
            config: Arc::new(parking_lot::RwLock::new(Arc::new(config))),
            metrics,
            metric_labels: Arc::new(parking_lot::RwLock::new(metric_labels)),
            lifecycle: Arc::new(Lifecycle {
                draining: AtomicBool::new(false),
                in_flight,
            }),
            started: unix_now(),
            responses,
            rate_limiter,
        }
    }

    /// This state with `store` as its store of responses (one opened on a journal,
    /// [`ResponseStore::open`]) instead of the empty in-memory one [`ApiState::new`] made;
    /// before the state is cloned.
    pub fn with_response_store(mut self, store: Arc<ResponseStore>) -> Self {
        self.responses = store;
        self
    }

    /// The HTTP settings in force.
    pub(crate) fn config(&self) -> Arc<ApiConfig> {
        Arc::clone(&self.config.read())
    }

    /// The tenants and tiers whose series `/metrics` shows: the API keys' tenants and the
    /// tiers in force.
    pub(crate) fn metric_labels(&self) -> Arc<ConfiguredLabels> {
        Arc::clone(&self.metric_labels.read())
    }

    /// Puts `api_keys`, `rate_limits` and the configured `tiers` (their names) in force (a
    /// reload of the configuration, SIGHUP): requests authenticate against the new keys from
    /// now on (a request already past authentication goes on as its key's tenant), and each
    /// tenant's budget follows its tier's new limits ([`RateLimiter::set_limits`]: a removed
    /// tier's budgets go, a new tier's start full). Authentication is never turned on or off
    /// here: keys on an open API, or none on one with keys, are refused, changing nothing.
    /// The new principals' `rate_limited_total` series are created at zero, and the series
    /// of a tenant or tier no longer configured leave `/metrics` (`ConfiguredLabels`).
    pub fn reload_access(
        &self,
        api_keys: Vec<crate::auth::ApiKeyEntry>,
        rate_limits: std::collections::HashMap<String, crate::rate_limit::TierLimits>,
        tiers: Vec<String>,
    ) -> Result<AccessChange, AccessRefusal> {
        let mut config = self.config.write();
        match (config.api_keys.is_empty(), api_keys.is_empty()) {
            (true, false) => return Err(AccessRefusal::WouldCloseOpenApi),
            (false, true) => return Err(AccessRefusal::WouldOpenApi),
            _ => {}
        }
        // By key, so that a reload of many keys is linear, not a comparison of every pair
        // (the write lock is held, and requests wait for it to authenticate).
        let before: std::collections::HashMap<&str, &crate::auth::ApiKeyEntry> = config
            .api_keys
            .iter()
            .map(|k| (k.key.as_str(), k))
            .collect();
        let (mut kept, mut changed) = (0, 0);
        for k in &api_keys {
            if let Some(old) = before.get(k.key.as_str()) {
                kept += 1;
                changed += usize::from(*old != k);
            }
        }
        let change = AccessChange {
            keys_added: api_keys.len() - kept,
            keys_removed: before.len() - kept,
            keys_changed: changed,
            limits_changed: self
                .rate_limiter
                .set_limits(rate_limits.clone(), std::time::Instant::now()),
        };
        let mut next = ApiConfig::clone(&config);
        next.api_keys = api_keys;
        next.rate_limits = rate_limits;
        next.tiers = tiers;
        register_rate_limited(&next);
        *self.metric_labels.write() = Arc::new(ConfiguredLabels::of(&next));
        *config = Arc::new(next);
        Ok(change)
    }

    /// Stops accepting generation requests: from now on they, and `/ready`, answer 503 with
    /// `Retry-After`, while requests already in flight (streams included) run to completion.
    pub fn begin_drain(&self) {
        self.lifecycle.draining.store(true, Ordering::SeqCst);
    }

    /// Whether [`ApiState::begin_drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.lifecycle.draining.load(Ordering::SeqCst)
    }

    /// Generation requests being served now (a stream counts until its last byte or its client
    /// leaves).
    pub fn in_flight(&self) -> usize {
        *self.lifecycle.in_flight.borrow()
    }

    /// Resolves once no generation request is in flight. Wrap it in a timeout for a bounded
    /// drain.
    pub async fn wait_idle(&self) {
        let mut rx = self.lifecycle.in_flight.subscribe();
        // `wait_for` only fails if the sender is gone, and `self` holds it.
        let _ = rx.wait_for(|&n| n == 0).await;
    }

    /// Admits one generation request, or refuses it while draining, before the engine is
    /// ready, once it cannot serve (its backend retired: every request would fail) and while
    /// it is stalled (a backend call past `scheduler.step_timeout_s`: it would wait behind it).
    pub(crate) fn admit(&self) -> Result<InFlight, ApiError> {
        if self.is_draining() {
            return Err(ApiError::Draining);
        }
        if !self.engine.is_ready() {
            return Err(ApiError::Engine(EngineError::new(
                EngineErrorKind::Unavailable,
                "The model is still loading.",
            )));
        }
        if !self.engine.is_alive() {
            return Err(engine_dead());
        }
        if let Some(stall) = self.engine.stall() {
            return Err(ApiError::EngineStalled(stall));
        }
        self.lifecycle.in_flight.send_modify(|n| *n += 1);
        metrics::gauge!(HTTP_IN_FLIGHT).increment(1.0);
        Ok(InFlight {
            lifecycle: Arc::clone(&self.lifecycle),
        })
    }
}

/// What [`ApiState::reload_access`] changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessChange {
    /// Keys that were not accepted before.
    pub keys_added: usize,
    /// Keys no longer accepted.
    pub keys_removed: usize,
    /// Keys kept whose tenant, tier or adapters changed.
    pub keys_changed: usize,
    /// The tiers whose rate limits changed ([`RateLimiter::set_limits`]).
    pub limits_changed: Vec<String>,
}

/// Why [`ApiState::reload_access`] changed nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AccessRefusal {
    /// No key left on an API that has keys.
    #[error("no API key is left: a reload never opens the API to everyone (that takes a restart)")]
    WouldOpenApi,
    /// Keys on an API started open.
    #[error("the API was started open (no API keys): turning keys on takes a restart")]
    WouldCloseOpenApi,
}

/// Creates `switchyard:rate_limited_total` at zero for every limit of a limited tier and the
/// tenants its keys name (on an open API, the default tier's without a tenant label), as every
/// series exists from the start.
fn register_rate_limited(config: &ApiConfig) {
    let mut seen = std::collections::HashSet::new();
    let principals: Vec<(Option<&str>, &str)> = if config.api_keys.is_empty() {
        vec![(None, config.default_tier.as_str())]
    } else {
        config
            .api_keys
            .iter()
            .map(|k| (Some(k.tenant.as_str()), k.tier.as_str()))
            .collect()
    };
    for (tenant, tier) in principals {
        let Some(limits) = config.rate_limits.get(tier) else {
            continue;
        };
        for (kind, set) in [
            ("requests", limits.requests_per_minute.is_some()),
            ("tokens", limits.tokens_per_minute.is_some()),
        ] {
            if !set || !seen.insert((tenant, tier, kind)) {
                continue;
            }
            let mut labels = vec![metrics::Label::new(LABEL_LIMIT, kind)];
            if config.tiers.iter().any(|t| t == tier) {
                labels.push(metrics::Label::new(LABEL_TIER, tier.to_owned()));
            }
            if let Some(tenant) = tenant {
                labels.push(metrics::Label::new(LABEL_TENANT, tenant.to_owned()));
            }
            metrics::counter!(RATE_LIMITED, labels).increment(0);
        }
    }
}

/// Refusals by rate limits, logged at most once a second with their count.
static RATE_LIMIT_REFUSALS: Throttle = Throttle::new(std::time::Duration::from_secs(1));

impl ApiState {
    /// Applies `principal`'s rate limits ([`crate::rate_limit`]) to a request of `requests`
    /// (its prompts): the meter that charges its tokens, the limits left for the response's
    /// headers in `req`'s extensions; or the 429, counted and logged (a line a second).
    pub(crate) fn rate_limit(
        &self,
        principal: &Principal,
        req: &HttpRequest,
        requests: &[GenerateRequest],
    ) -> Result<Meter, ApiError> {
        if !self.rate_limiter.enabled() {
            return Ok(Meter::unlimited());
        }
        let estimates = requests
            .iter()
            .map(|r| estimate_prompt_tokens(&r.prompt))
            .collect();
        match self
            .rate_limiter
            .admit(principal, estimates, std::time::Instant::now())
        {
            Ok(meter) => {
                if let Some(snapshot) = meter.shared_snapshot() {
                    req.extensions_mut().insert(snapshot);
                }
                Ok(meter)
            }
            Err(refusal) => {
                let mut labels = vec![metrics::Label::new(LABEL_LIMIT, refusal.kind.as_str())];
                if self.config().tiers.contains(&principal.tier) {
                    labels.push(metrics::Label::new(LABEL_TIER, principal.tier.clone()));
                }
                if !self.config().api_keys.is_empty() {
                    labels.push(metrics::Label::new(LABEL_TENANT, principal.tenant.clone()));
                }
                metrics::counter!(RATE_LIMITED, labels).increment(1);
                if let Some(refused) = RATE_LIMIT_REFUSALS.hit(std::time::Instant::now()) {
                    tracing::warn!(
                        limit = refusal.kind.as_str(),
                        retry_after_ms = refusal.retry_after.as_millis() as u64,
                        refused,
                        "rate limit reached (refused counts the refusals since the previous \
                         such line)"
                    );
                }
                Err(ApiError::RateLimited(refusal))
            }
        }
    }
}

/// The error of requests, `/health` and `/ready` once the engine cannot serve.
pub(crate) fn engine_dead() -> ApiError {
    ApiError::Engine(EngineError::new(
        EngineErrorKind::Unavailable,
        "The engine cannot serve any more: its backend was retired after a failure (see the \
         server log). Restart the server.",
    ))
}

/// Marks one generation request as in flight until dropped.
pub(crate) struct InFlight {
    lifecycle: Arc<Lifecycle>,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.lifecycle
            .in_flight
            .send_modify(|n| *n = n.saturating_sub(1));
        metrics::gauge!(HTTP_IN_FLIGHT).decrement(1.0);
    }
}

/// Seconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A fresh request id: `prefix` and 32 random hex digits, or the client's `X-Request-Id` if it
/// is short and plain (`[A-Za-z0-9._-]{1,64}`).
pub(crate) fn request_id(prefix: &str, client_id: Option<&str>) -> String {
    if let Some(id) = client_id.filter(|id| {
        (1..=64).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    }) {
        return format!("{prefix}{id}");
    }
    let mut bytes = [0u8; 16];
    if getrandom::fill(&mut bytes).is_err() {
        // Without OS randomness fall back to time and a counter: unique, merely guessable.
        static COUNTER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        bytes[..8].copy_from_slice(&n.to_le_bytes());
        bytes[8..].copy_from_slice(&(nanos as u64).to_le_bytes());
    }
    let mut id = String::with_capacity(prefix.len() + 32);
    id.push_str(prefix);
    for b in bytes {
        id.push(char::from(b"0123456789abcdef"[usize::from(b >> 4)]));
        id.push(char::from(b"0123456789abcdef"[usize::from(b & 15)]));
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_unique_hex() {
        let a = request_id("cmpl-", None);
        let b = request_id("cmpl-", None);
        assert_ne!(a, b);
        assert_eq!(a.len(), 5 + 32);
        assert!(a[5..].bytes().all(|c| c.is_ascii_hexdigit()));
    }

    #[test]
    fn client_request_ids_are_used_only_when_plain() {
        assert_eq!(request_id("cmpl-", Some("abc-1")), "cmpl-abc-1");
        assert_ne!(request_id("cmpl-", Some("a b")), "cmpl-a b");
        assert_ne!(request_id("cmpl-", Some(&"x".repeat(65))).len(), 70);
    }
}
