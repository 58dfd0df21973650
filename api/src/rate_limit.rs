//! Rate limits: requests and tokens per minute for each tenant, set per tier
//! (`tiers.<name>.requests_per_minute`, `tiers.<name>.tokens_per_minute`).
//!
//! They apply to the generation routes (completions, chat completions, responses,
//! embeddings), to each tenant of the tier on its own: two tenants of one tier have a budget
//! each (an open API is one tenant). Each limit is a bucket that holds a minute's worth and
//! refills continuously (a tenant idle for a minute may send a minute's requests at once, and
//! in the long run no more than the limit per minute).
//!
//! - **Requests**: a request takes one from its tenant's bucket when it is admitted; with none
//!   left it is refused. It keeps it whatever becomes of it, unless the server refuses it for
//!   want of room before queueing it (`overloaded`, `tenant_busy`, `unavailable`): then it used
//!   nothing and its one is given back, so that retries during an overload, as `Retry-After`
//!   asks, do not leave the tenant rate-limited once it ends.
//! - **Tokens** are taken as they are used, as `usage` counts them: each prompt's tokens (once
//!   per prompt, whatever its `n`; prefix-cache hits included) and each token generated (an
//!   embedding's prompt only). A request is admitted while its tenant's token budget is not
//!   spent (at least one token left); the tokens it goes on to use may take the budget below
//!   zero, and the tenant then waits until it has refilled above zero. So no estimate of the
//!   output is charged up front (OpenAI counts `max_tokens`; here a large `max_tokens` costs
//!   nothing it does not generate), and the tokens a tenant uses beyond its minute's budget are
//!   at most what its requests in flight use after the budget ran out, which the tier's
//!   `max_pending_requests` bounds. Between admission and tokenization a prompt holds an
//!   estimate of its tokens (its bytes / 4), settled to the exact count once it is tokenized,
//!   so that a burst of requests arriving together sees the budget drain. A prompt whose
//!   request timed out in the queue (503 `queue_timeout`, never admitted) is given back: the
//!   tenant pays for no prompt that was not computed (its request still took its one from the
//!   requests bucket).
//!
//! A refusal is a 429 with OpenAI's `rate_limit_exceeded` body and `Retry-After`; every
//! response of a limited tenant on those routes carries OpenAI's `x-ratelimit-*` headers
//! ([`Snapshot::headers`]). State is kept per (tier, tenant) the API keys name, so it is
//! bounded by the configuration. The buckets' arithmetic is `switchyard_policies::rate_limit`,
//! which the simulator runs too.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
pub use switchyard_policies::rate_limit::{LimitKind, TierLimits};
use switchyard_policies::rate_limit::{TenantBudget, TokenBucket};

use crate::auth::Principal;
use crate::engine::PromptInput;

/// OpenAI's name of a limit in its 429 message.
fn unit(kind: LimitKind) -> &'static str {
    match kind {
        LimitKind::Requests => "requests per min (RPM)",
        LimitKind::Tokens => "tokens per min (TPM)",
    }
}

fn seconds(s: f64) -> Duration {
    Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
}

fn state(bucket: &TokenBucket) -> LimitState {
    LimitState {
        limit: bucket.limit(),
        remaining: bucket.remaining(),
        reset: seconds(bucket.until_full()),
    }
}

fn snapshot(budget: &TenantBudget) -> Snapshot {
    Snapshot {
        requests: budget.requests().map(state),
        tokens: budget.tokens().map(state),
    }
}

/// One limit as a response reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitState {
    /// The limit per minute.
    pub limit: u64,
    /// What is left now (0 when spent or below zero).
    pub remaining: u64,
    /// Time until the bucket is full again.
    pub reset: Duration,
}

/// A tenant's limits as they stood when a request was admitted or refused (or, for one the
/// server refused for want of room before queueing it, after its request and estimates were
/// given back); the route's response carries them as headers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Snapshot {
    /// The requests limit, if the tier sets one.
    pub requests: Option<LimitState>,
    /// The tokens limit, if the tier sets one.
    pub tokens: Option<LimitState>,
}

impl Snapshot {
    /// OpenAI's headers: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for each
    /// limit set (reset as OpenAI writes durations: `1s`, `6m0s`, `20ms`).
    pub fn headers(&self) -> Vec<(String, String)> {
        let mut headers = Vec::new();
        for (kind, state) in [
            (LimitKind::Requests, self.requests),
            (LimitKind::Tokens, self.tokens),
        ] {
            let Some(s) = state else { continue };
            let k = kind.as_str();
            headers.push((format!("x-ratelimit-limit-{k}"), s.limit.to_string()));
            headers.push((
                format!("x-ratelimit-remaining-{k}"),
                s.remaining.to_string(),
            ));
            headers.push((format!("x-ratelimit-reset-{k}"), openai_duration(s.reset)));
        }
        headers
    }
}

/// An admitted request's [`Snapshot`], shared by its [`Meter`] and its response (the route
/// leaves it in the request's extensions for the headers): a refusal for want of room before
/// queueing updates it after the give-back ([`Meter::refused_before_queueing`]).
#[derive(Debug, Clone)]
pub struct SharedSnapshot(Arc<Mutex<Snapshot>>);

impl SharedSnapshot {
    /// The limits as they stand for the request now.
    pub fn get(&self) -> Snapshot {
        *self.0.lock()
    }
}

/// A duration as OpenAI's rate-limit headers write it: `20ms` under a second, else hours,
/// minutes and seconds with the leading zero units left out (`1s`, `6m0s`, `1h2m3.5s`;
/// seconds to at most three decimals, trailing zeros dropped).
pub fn openai_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = (ms / 60_000) % 60;
    let millis = ms % 60_000;
    let seconds = if millis.is_multiple_of(1000) {
        format!("{}s", millis / 1000)
    } else {
        let s = format!("{}.{:03}", millis / 1000, millis % 1000);
        format!("{}s", s.trim_end_matches('0'))
    };
    match (hours, minutes) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

/// A request refused by a limit.
#[derive(Debug, Clone, PartialEq)]
pub struct RateLimited {
    /// The limit that refused it.
    pub kind: LimitKind,
    /// The refusing limit per minute.
    pub limit: u64,
    /// When the request would be admitted, were nothing else to happen meanwhile.
    pub retry_after: Duration,
    /// The tenant's limits at the refusal, for the headers.
    pub snapshot: Snapshot,
    /// The caller's tier.
    pub tier: String,
    /// The caller's tenant.
    pub tenant: String,
}

impl RateLimited {
    /// The 429's message, in OpenAI's words.
    pub fn message(&self) -> String {
        let used = match self.kind {
            LimitKind::Requests => self.snapshot.requests,
            LimitKind::Tokens => self.snapshot.tokens,
        }
        .map_or(0, |s| self.limit - s.remaining.min(self.limit));
        format!(
            "Rate limit reached for tenant {} (tier {}) on {}: Limit {}, Used {}. Please try \
             again in {}.",
            self.tenant,
            self.tier,
            unit(self.kind),
            self.limit,
            used,
            openai_duration(self.retry_after.max(Duration::from_millis(1)))
        )
    }
}

/// The limits of every tier and the state of every tenant limited so far.
#[derive(Debug)]
pub struct RateLimiter {
    /// The limited tiers' limits; replaced whole by [`RateLimiter::set_limits`].
    tiers: parking_lot::RwLock<HashMap<String, TierLimits>>,
    tenants: Mutex<HashMap<TenantKey, Arc<Mutex<TenantBudget>>>>,
    /// Time zero of the budgets' clock.
    origin: Instant,
}

/// A tenant's budget is kept per (tier, tenant).
type TenantKey = (String, String);

impl RateLimiter {
    /// Limits per tier (tiers without limits may be left out).
    pub fn new(tiers: HashMap<String, TierLimits>) -> Self {
        Self {
            tiers: parking_lot::RwLock::new(Self::limited(tiers)),
            tenants: Mutex::new(HashMap::new()),
            origin: Instant::now(),
        }
    }

    fn limited(tiers: HashMap<String, TierLimits>) -> HashMap<String, TierLimits> {
        tiers.into_iter().filter(|(_, l)| l.any()).collect()
    }

    /// Whether any tier is limited.
    pub fn enabled(&self) -> bool {
        !self.tiers.read().is_empty()
    }

    /// Replaces every tier's limits with `tiers`' (a reload of the configuration) at `now`:
    /// each tenant's budget of a tier still limited keeps what it used of each limit kept
    /// (`TenantBudget::set_limits`: a raise frees room at once, a cut below what was used
    /// refuses until the excess has refilled), a limit new to a tier starts full, and the
    /// budgets of a tier no longer limited are dropped. Requests admitted before keep charging
    /// the budget they were admitted under. Returns the tiers whose limits changed.
    pub fn set_limits(&self, tiers: HashMap<String, TierLimits>, now: Instant) -> Vec<String> {
        let tiers = Self::limited(tiers);
        let now_s = now.saturating_duration_since(self.origin).as_secs_f64();
        let mut in_force = self.tiers.write();
        let mut changed: Vec<String> = in_force
            .keys()
            .chain(tiers.keys())
            .filter(|t| in_force.get(*t) != tiers.get(*t))
            .cloned()
            .collect();
        changed.sort();
        changed.dedup();
        self.tenants.lock().retain(|(tier, _), budget| {
            let Some(&limits) = tiers.get(tier) else {
                return false;
            };
            if in_force.get(tier) != Some(&limits) {
                budget.lock().set_limits(limits, now_s);
            }
            true
        });
        *in_force = tiers;
        changed
    }

    /// Admits a request of `principal` whose prompts are estimated at `estimates` tokens each
    /// (see the module docs), taking its request and its estimates; or refuses it, taking
    /// nothing.
    pub fn admit(
        &self,
        principal: &Principal,
        estimates: Vec<u64>,
        now: Instant,
    ) -> Result<Meter, Box<RateLimited>> {
        let now_s = now.saturating_duration_since(self.origin).as_secs_f64();
        // The tiers' lock is held until the budget is in the map, so that a reload
        // (`set_limits`, which takes the same locks in the same order) sees it.
        let (limits, budget) = {
            let tiers = self.tiers.read();
            let Some(limits) = tiers.get(&principal.tier).copied() else {
                return Ok(Meter::unlimited());
            };
            let mut tenants = self.tenants.lock();
            let key = (principal.tier.clone(), principal.tenant.clone());
            let budget = Arc::clone(
                tenants
                    .entry(key)
                    .or_insert_with(|| Arc::new(Mutex::new(TenantBudget::new(limits, now_s)))),
            );
            (limits, budget)
        };
        let held: u64 = estimates.iter().sum();
        let snapshot = {
            let mut b = budget.lock();
            if let Err(refusal) = b.admit(now_s, held as f64) {
                return Err(Box::new(RateLimited {
                    kind: refusal.kind,
                    limit: refusal.limit,
                    retry_after: seconds(refusal.retry_after_s),
                    snapshot: snapshot(&b),
                    tier: principal.tier.clone(),
                    tenant: principal.tenant.clone(),
                }));
            }
            snapshot(&b)
        };
        Ok(Meter {
            tokens_limited: limits.tokens_per_minute.is_some(),
            budget: Some(budget),
            origin: self.origin,
            estimates,
            snapshot: Some(SharedSnapshot(Arc::new(Mutex::new(snapshot)))),
            generated: true,
            request_given_back: false,
        })
    }
}

impl RateLimiter {
    /// What `GET /admin/rate_limits` shows: each limited tier's limits and each tenant's
    /// budgets as of `now` (by tier, then tenant).
    pub fn report(&self, now: Instant) -> serde_json::Value {
        let now_s = now.saturating_duration_since(self.origin).as_secs_f64();
        let limit = |b: Option<&TokenBucket>| {
            b.map(|b| {
                serde_json::json!({
                    "limit": b.limit(),
                    "remaining": b.remaining(),
                    // Until a request would be admitted, and until the budget is full.
                    "wait_s": b.wait_for(1.0),
                    "reset_s": b.until_full(),
                })
            })
        };
        let in_force = self.tiers.read();
        let mut tiers: Vec<_> = in_force.iter().collect();
        tiers.sort_by(|a, b| a.0.cmp(b.0));
        let tiers: serde_json::Map<String, serde_json::Value> = tiers
            .into_iter()
            .map(|(name, l)| {
                let limits = serde_json::json!({
                    "requests_per_minute": l.requests_per_minute,
                    "tokens_per_minute": l.tokens_per_minute,
                });
                (name.clone(), limits)
            })
            .collect();
        let mut tenants: Vec<(TenantKey, Arc<Mutex<TenantBudget>>)> = self
            .tenants
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), Arc::clone(v)))
            .collect();
        tenants.sort_by(|a, b| a.0.cmp(&b.0));
        let tenants: Vec<serde_json::Value> = tenants
            .into_iter()
            .map(|((tier, tenant), budget)| {
                let mut b = budget.lock();
                b.refill(now_s);
                serde_json::json!({
                    "tier": tier,
                    "tenant": tenant,
                    "requests": limit(b.requests()),
                    "tokens": limit(b.tokens()),
                })
            })
            .collect();
        serde_json::json!({ "tiers": tiers, "tenants": tenants })
    }

    /// Gives `tenant` of `tier` a full budget again (its next request starts afresh; tokens
    /// its requests in flight still use are not counted). `None` when the tier has no limits;
    /// `Some(false)` when the tenant had no budget yet (it was full).
    pub fn reset(&self, tier: &str, tenant: &str) -> Option<bool> {
        if !self.tiers.read().contains_key(tier) {
            return None;
        }
        let key = (tier.to_owned(), tenant.to_owned());
        Some(self.tenants.lock().remove(&key).is_some())
    }
}

/// The estimate of a prompt's tokens held between admission and tokenization: its bytes / 4
/// (rounded up), its length for token ids, the JSON of its messages / 4 for chat.
pub fn estimate_prompt_tokens(prompt: &PromptInput) -> u64 {
    let bytes = match prompt {
        PromptInput::Text(text) => text.len(),
        PromptInput::Tokens(ids) => return ids.len() as u64,
        PromptInput::Chat { messages, .. } => serde_json::to_vec(messages).map_or(0, |v| v.len()),
    };
    (bytes as u64).div_ceil(4)
}

/// Charges one admitted request's tokens to its tenant as they are used; gives back the
/// estimates of prompts never tokenized when dropped.
#[derive(Debug)]
pub struct Meter {
    /// The tenant's budget; `None` when no limit applies.
    budget: Option<Arc<Mutex<TenantBudget>>>,
    /// Whether the budget has a token limit (else there are no tokens to charge).
    tokens_limited: bool,
    /// Whether the request's one was given back ([`Meter::refused_before_queueing`]).
    request_given_back: bool,
    /// Time zero of the budget's clock.
    origin: Instant,
    /// Per prompt, the estimate still held (0 once settled).
    estimates: Vec<u64>,
    /// The limits at admission (after a give-back, [`Meter::refused_before_queueing`]), for
    /// the response's headers; `None` when none applies.
    snapshot: Option<SharedSnapshot>,
    /// Whether generated tokens count (not for embeddings).
    generated: bool,
}

impl Meter {
    /// A meter that charges nothing.
    pub fn unlimited() -> Self {
        Self {
            budget: None,
            tokens_limited: false,
            request_given_back: false,
            origin: Instant::now(),
            estimates: Vec::new(),
            snapshot: None,
            generated: false,
        }
    }

    /// Counts prompts only (embeddings: `usage` has no generated tokens).
    pub fn prompts_only(mut self) -> Self {
        self.generated = false;
        self
    }

    /// The limits at admission (after a give-back, [`Meter::refused_before_queueing`]), if
    /// any applies.
    pub fn snapshot(&self) -> Option<Snapshot> {
        self.snapshot.as_ref().map(SharedSnapshot::get)
    }

    /// [`Meter::snapshot`] as the response's headers read it, once the request's fate is
    /// known.
    pub fn shared_snapshot(&self) -> Option<SharedSnapshot> {
        self.snapshot.clone()
    }

    fn charge(&self, tokens: f64) {
        if let Some(b) = self.budget.as_ref().filter(|_| self.tokens_limited) {
            let now_s = self.origin.elapsed().as_secs_f64();
            b.lock().charge(tokens, now_s);
        }
    }

    /// The server refused the request for want of room before queueing it: its one from the
    /// requests budget is given back (once), and so are its prompts' estimates (no prompt was
    /// tokenized); the response's snapshot then reports the budget as it stands after that.
    pub fn refused_before_queueing(&mut self) {
        if std::mem::replace(&mut self.request_given_back, true) {
            return;
        }
        let held: u64 = self.estimates.iter_mut().map(std::mem::take).sum();
        if let Some(b) = &self.budget {
            let now_s = self.origin.elapsed().as_secs_f64();
            let mut b = b.lock();
            b.give_back_request(now_s);
            if self.tokens_limited && held > 0 {
                b.charge(-(held as f64), now_s);
            }
            if let Some(shared) = &self.snapshot {
                *shared.0.lock() = snapshot(&b);
            }
        }
    }

    /// Prompt `prompt` was tokenized into `tokens`: its estimate is settled to them.
    pub fn prompt(&mut self, prompt: usize, tokens: u32) {
        let held = self.estimates.get_mut(prompt).map_or(0, std::mem::take);
        self.charge(f64::from(tokens) - held as f64);
    }

    /// Gives back `tokens` charged for a prompt that was never computed: its request timed
    /// out in the queue before its first admission.
    pub fn refund(&self, tokens: u32) {
        self.charge(-f64::from(tokens));
    }

    /// `tokens` more were generated.
    pub fn generated(&self, tokens: u32) {
        if self.generated {
            self.charge(f64::from(tokens));
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        let held: u64 = self.estimates.iter().sum();
        if held > 0 {
            self.charge(-(held as f64));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn principal(tenant: &str, tier: &str) -> Principal {
        Principal {
            tenant: tenant.into(),
            tier: tier.into(),
            adapters: crate::auth::AdapterAccess::all(),
        }
    }

    fn limiter(rpm: Option<u64>, tpm: Option<u64>) -> RateLimiter {
        RateLimiter::new(HashMap::from([(
            "gold".to_owned(),
            TierLimits {
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
            },
        )]))
    }

    #[test]
    fn new_limits_apply_to_tenants_budgets_and_an_unlimited_tier_forgets_them() {
        let l = limiter(Some(10), None);
        let (acme, bob) = (principal("acme", "gold"), principal("bob", "silver"));
        let t0 = Instant::now();
        for _ in 0..10 {
            l.admit(&acme, vec![1], t0).unwrap();
        }
        assert!(l.admit(&acme, vec![1], t0).is_err());
        assert!(l.admit(&bob, vec![1], t0).unwrap().snapshot().is_none());
        let limits = |rpm| TierLimits {
            requests_per_minute: Some(rpm),
            tokens_per_minute: None,
        };
        let changed = l.set_limits(
            HashMap::from([
                ("gold".to_owned(), limits(20)),
                ("silver".to_owned(), limits(1)),
            ]),
            t0,
        );
        assert_eq!(changed, ["gold", "silver"]);
        // acme used 10 of gold's 20: 10 more now; bob's silver tier is limited from now on.
        for _ in 0..10 {
            l.admit(&acme, vec![1], t0).unwrap();
        }
        assert_eq!(l.admit(&acme, vec![1], t0).unwrap_err().limit, 20);
        l.admit(&bob, vec![1], t0).unwrap();
        assert!(l.admit(&bob, vec![1], t0).is_err());
        // The same limits again change nothing; a tier left out is no longer limited.
        let same = HashMap::from([
            ("gold".to_owned(), limits(20)),
            ("silver".to_owned(), limits(1)),
        ]);
        assert!(l.set_limits(same, t0).is_empty());
        assert!(l.admit(&acme, vec![1], t0).is_err());
        assert_eq!(
            l.set_limits(HashMap::from([("silver".to_owned(), limits(1))]), t0),
            ["gold"]
        );
        assert!(l.admit(&acme, vec![1], t0).unwrap().snapshot().is_none());
        assert!(l.reset("gold", "acme").is_none());
        // Limited again later: acme starts with a full budget.
        l.set_limits(HashMap::from([("gold".to_owned(), limits(2))]), t0);
        let m = l.admit(&acme, vec![1], t0).unwrap();
        assert_eq!(m.snapshot().unwrap().requests.unwrap().remaining, 1);
        assert!(!l.enabled() || l.set_limits(HashMap::new(), t0) == ["gold"]);
        assert!(!l.enabled());
    }

    #[test]
    fn a_minutes_requests_pass_then_one_per_refill() {
        let l = limiter(Some(60), None);
        let p = principal("acme", "gold");
        let t0 = Instant::now();
        for i in 0..60 {
            let m = l.admit(&p, vec![10], t0).unwrap();
            let s = m.snapshot().unwrap().requests.unwrap();
            assert_eq!((s.limit, s.remaining), (60, 59 - i));
        }
        let e = l.admit(&p, vec![10], t0).unwrap_err();
        assert_eq!(e.kind, LimitKind::Requests);
        // One request refills each second (60 per minute).
        assert_eq!(e.retry_after, Duration::from_secs(1));
        assert!(l
            .admit(&p, vec![10], t0 + Duration::from_millis(900))
            .is_err());
        assert!(l
            .admit(&p, vec![10], t0 + Duration::from_millis(1000))
            .is_ok());
        assert!(l
            .admit(&p, vec![10], t0 + Duration::from_millis(1500))
            .is_err());
        // Another tenant of the tier has its own budget; another tier none.
        assert!(l.admit(&principal("bob", "gold"), vec![1], t0).is_ok());
        let free = l.admit(&principal("acme", "free"), vec![1], t0).unwrap();
        assert_eq!(free.snapshot(), None);
    }

    #[test]
    fn tokens_are_charged_as_used_and_the_budget_may_go_below_zero() {
        let l = limiter(None, Some(600)); // 10 tokens a second
        let p = principal("acme", "gold");
        let t0 = Instant::now();
        let mut m = l.admit(&p, vec![100], t0).unwrap();
        assert_eq!(m.snapshot().unwrap().tokens.unwrap().remaining, 500);
        // Tokenized to 300 tokens, then 400 generated: 100 below zero.
        m.prompt(0, 300);
        m.generated(400);
        let e = l.admit(&p, vec![1], Instant::now()).unwrap_err();
        // The charges refill the bucket with the wall clock (10 tokens a second since t0).
        let elapsed = t0.elapsed().as_secs_f64();
        assert_eq!(e.kind, LimitKind::Tokens);
        // Back above zero after 10.1 s (101 tokens at 10 a second), less what refilled since
        // t0: a thread descheduled for a tenth of a second between the two took 0.1 s off.
        let wait = e.retry_after.as_secs_f64();
        assert!(
            (10.0 - elapsed..10.2).contains(&wait),
            "{wait} after {elapsed} s"
        );
        assert!(
            e.message().contains("Limit 600, Used 600"),
            "{}",
            e.message()
        );
        drop(m);
        assert!(l
            .admit(&p, vec![1], Instant::now() + Duration::from_secs(11))
            .is_ok());
    }

    #[test]
    fn estimates_of_prompts_never_tokenized_are_given_back() {
        let l = limiter(None, Some(600));
        let p = principal("acme", "gold");
        let t0 = Instant::now();
        let m = l.admit(&p, vec![250, 250], t0).unwrap();
        assert_eq!(m.snapshot().unwrap().tokens.unwrap().remaining, 100);
        // A second request sees the estimates held.
        let m2 = l.admit(&p, vec![200], t0).unwrap();
        assert!(l.admit(&p, vec![1], t0).is_err());
        drop(m);
        drop(m2);
        let s = l.admit(&p, vec![0], t0).unwrap().snapshot().unwrap();
        assert!(s.tokens.unwrap().remaining >= 599, "{s:?}");
    }

    #[test]
    fn embeddings_count_their_prompts_only() {
        let l = limiter(None, Some(600));
        let p = principal("acme", "gold");
        let mut m = l
            .admit(&p, vec![10], Instant::now())
            .unwrap()
            .prompts_only();
        m.prompt(0, 10);
        m.generated(1000);
        let s = l.admit(&p, vec![0], Instant::now()).unwrap().snapshot();
        assert!(s.unwrap().tokens.unwrap().remaining >= 589);
    }

    #[test]
    fn a_refusal_takes_nothing() {
        let l = limiter(Some(1), Some(600));
        let p = principal("acme", "gold");
        let t0 = Instant::now();
        let m = l.admit(&p, vec![50], t0).unwrap();
        let e = l.admit(&p, vec![50], t0).unwrap_err();
        assert_eq!(e.kind, LimitKind::Requests);
        assert_eq!(e.snapshot.tokens.unwrap().remaining, 550);
        drop(m);
    }

    #[test]
    fn headers_as_openai_writes_them() {
        let s = Snapshot {
            requests: Some(LimitState {
                limit: 60,
                remaining: 59,
                reset: Duration::from_secs(1),
            }),
            tokens: Some(LimitState {
                limit: 150_000,
                remaining: 149_984,
                reset: Duration::from_millis(6),
            }),
        };
        assert_eq!(
            s.headers(),
            [
                ("x-ratelimit-limit-requests", "60"),
                ("x-ratelimit-remaining-requests", "59"),
                ("x-ratelimit-reset-requests", "1s"),
                ("x-ratelimit-limit-tokens", "150000"),
                ("x-ratelimit-remaining-tokens", "149984"),
                ("x-ratelimit-reset-tokens", "6ms"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
        assert_eq!(openai_duration(Duration::from_secs(360)), "6m0s");
        assert_eq!(
            openai_duration(Duration::from_millis(3_723_500)),
            "1h2m3.5s"
        );
        assert_eq!(openai_duration(Duration::from_millis(1250)), "1.25s");
        assert_eq!(openai_duration(Duration::ZERO), "0ms");
    }

    #[test]
    fn estimates() {
        assert_eq!(
            estimate_prompt_tokens(&PromptInput::Text("abcde".into())),
            2
        );
        assert_eq!(
            estimate_prompt_tokens(&PromptInput::Tokens(vec![1, 2, 3])),
            3
        );
    }
}
