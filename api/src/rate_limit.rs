//! Rate limits: requests and tokens per minute for each tenant, set per tier
//! (`tiers.<name>.requests_per_minute`, `tiers.<name>.tokens_per_minute`).
//!
//! They apply to the generation routes (completions, chat completions, responses,
//! embeddings), to each tenant of the tier on its own: two tenants of one tier have a budget
//! each (an open API is one tenant). Each limit is a bucket that holds a minute's worth and
//! refills continuously (a tenant idle for a minute may send a minute's requests at once, and
//! in the long run no more than the limit per minute).
//!
//! - **Requests**: a request takes one from its tenant's bucket when it is admitted, whatever
//!   becomes of it later; with none left it is refused.
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
//!   so that a burst of requests arriving together sees the budget drain.
//!
//! A refusal is a 429 with OpenAI's `rate_limit_exceeded` body and `Retry-After`; every
//! response of a limited tenant on those routes carries OpenAI's `x-ratelimit-*` headers
//! ([`Snapshot::headers`]). State is kept per (tier, tenant) the API keys name, so it is
//! bounded by the configuration.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::auth::Principal;
use crate::engine::PromptInput;

/// A tier's limits, per tenant.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierLimits {
    /// Requests per minute; `None`: no limit.
    pub requests_per_minute: Option<u64>,
    /// Tokens per minute (prompt and generated); `None`: no limit.
    pub tokens_per_minute: Option<u64>,
}

impl TierLimits {
    fn any(&self) -> bool {
        self.requests_per_minute.is_some() || self.tokens_per_minute.is_some()
    }
}

/// Which limit refused a request (OpenAI's error `type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitKind {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
}

impl LimitKind {
    /// OpenAI's name, the error's `type` and the metric's `limit` label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
        }
    }

    fn unit(self) -> &'static str {
        match self {
            Self::Requests => "requests per min (RPM)",
            Self::Tokens => "tokens per min (TPM)",
        }
    }
}

/// One limit's state: a bucket of `limit` that refills at `limit` per minute. Its level may
/// go below zero (tokens used past the budget).
#[derive(Debug, Clone)]
struct Bucket {
    limit: u64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn full(limit: u64, now: Instant) -> Self {
        Self {
            limit,
            level: limit as f64,
            at: now,
        }
    }

    fn per_second(&self) -> f64 {
        self.limit as f64 / 60.0
    }

    /// Brings the level up to `now` (never above the limit; a `now` before the last one
    /// changes nothing).
    fn refill(&mut self, now: Instant) {
        if now <= self.at {
            return;
        }
        let gained = now.duration_since(self.at).as_secs_f64() * self.per_second();
        self.level = (self.level + gained).min(self.limit as f64);
        self.at = now;
    }

    /// Time until the level reaches `amount` (zero if it has).
    fn wait_for(&self, amount: f64) -> Duration {
        let short = amount - self.level;
        if short <= 0.0 {
            return Duration::ZERO;
        }
        Duration::try_from_secs_f64(short / self.per_second()).unwrap_or(Duration::MAX)
    }

    fn take(&mut self, amount: f64, now: Instant) {
        self.refill(now);
        self.level -= amount;
    }

    fn state(&self) -> LimitState {
        LimitState {
            limit: self.limit,
            remaining: if self.level >= 1.0 {
                self.level.floor() as u64
            } else {
                0
            },
            reset: self.wait_for(self.limit as f64),
        }
    }
}

/// A tenant's buckets.
#[derive(Debug)]
struct Buckets {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
}

impl Buckets {
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            requests: self.requests.as_ref().map(Bucket::state),
            tokens: self.tokens.as_ref().map(Bucket::state),
        }
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

/// A tenant's limits as they stood when a request was admitted or refused; the route's
/// response carries them as headers.
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
            self.kind.unit(),
            self.limit,
            used,
            openai_duration(self.retry_after.max(Duration::from_millis(1)))
        )
    }
}

/// The limits of every tier and the state of every tenant limited so far.
#[derive(Debug, Default)]
pub struct RateLimiter {
    tiers: HashMap<String, TierLimits>,
    tenants: Mutex<HashMap<TenantKey, Arc<Mutex<Buckets>>>>,
}

/// A tenant's buckets are kept per (tier, tenant).
type TenantKey = (String, String);

impl RateLimiter {
    /// Limits per tier (tiers without limits may be left out).
    pub fn new(tiers: HashMap<String, TierLimits>) -> Self {
        Self {
            tiers: tiers.into_iter().filter(|(_, l)| l.any()).collect(),
            tenants: Mutex::new(HashMap::new()),
        }
    }

    /// Whether any tier is limited.
    pub fn enabled(&self) -> bool {
        !self.tiers.is_empty()
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
        let Some(limits) = self.tiers.get(&principal.tier) else {
            return Ok(Meter::unlimited());
        };
        let buckets = {
            let mut tenants = self.tenants.lock();
            let key = (principal.tier.clone(), principal.tenant.clone());
            Arc::clone(tenants.entry(key).or_insert_with(|| {
                Arc::new(Mutex::new(Buckets {
                    requests: limits.requests_per_minute.map(|l| Bucket::full(l, now)),
                    tokens: limits.tokens_per_minute.map(|l| Bucket::full(l, now)),
                }))
            }))
        };
        let snapshot = {
            let mut b = buckets.lock();
            if let Some(r) = b.requests.as_mut() {
                r.refill(now);
            }
            if let Some(t) = b.tokens.as_mut() {
                t.refill(now);
            }
            let refusal = [
                (LimitKind::Requests, b.requests.as_ref()),
                (LimitKind::Tokens, b.tokens.as_ref()),
            ]
            .into_iter()
            .find_map(|(kind, bucket)| {
                let bucket = bucket.filter(|bucket| bucket.level < 1.0)?;
                Some((kind, bucket.limit, bucket.wait_for(1.0)))
            });
            if let Some((kind, limit, retry_after)) = refusal {
                return Err(Box::new(RateLimited {
                    kind,
                    limit,
                    retry_after,
                    snapshot: b.snapshot(),
                    tier: principal.tier.clone(),
                    tenant: principal.tenant.clone(),
                }));
            }
            if let Some(r) = b.requests.as_mut() {
                r.take(1.0, now);
            }
            if let Some(t) = b.tokens.as_mut() {
                t.take(estimates.iter().sum::<u64>() as f64, now);
            }
            b.snapshot()
        };
        let metered = buckets.lock().tokens.is_some();
        Ok(Meter {
            buckets: metered.then_some(buckets),
            estimates,
            snapshot: Some(snapshot),
            generated: true,
        })
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
    /// The tenant's buckets; `None` when no token limit applies.
    buckets: Option<Arc<Mutex<Buckets>>>,
    /// Per prompt, the estimate still held (0 once settled).
    estimates: Vec<u64>,
    /// The limits at admission, for the response's headers; `None` when none applies.
    snapshot: Option<Snapshot>,
    /// Whether generated tokens count (not for embeddings).
    generated: bool,
}

impl Meter {
    /// A meter that charges nothing.
    pub fn unlimited() -> Self {
        Self {
            buckets: None,
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

    /// The limits at admission, if any applies.
    pub fn snapshot(&self) -> Option<Snapshot> {
        self.snapshot
    }

    fn charge(&self, tokens: f64) {
        if tokens == 0.0 {
            return;
        }
        if let Some(b) = &self.buckets {
            if let Some(bucket) = b.lock().tokens.as_mut() {
                bucket.take(tokens, Instant::now());
            }
        }
    }

    /// Prompt `prompt` was tokenized into `tokens`: its estimate is settled to them.
    pub fn prompt(&mut self, prompt: usize, tokens: u32) {
        let held = self.estimates.get_mut(prompt).map_or(0, std::mem::take);
        self.charge(f64::from(tokens) - held as f64);
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
    fn the_bucket_never_holds_more_than_a_minute() {
        let l = limiter(Some(2), None);
        let p = principal("acme", "gold");
        let t0 = Instant::now();
        l.admit(&p, vec![], t0).unwrap();
        let later = t0 + Duration::from_secs(3600);
        l.admit(&p, vec![], later).unwrap();
        l.admit(&p, vec![], later).unwrap();
        assert!(l.admit(&p, vec![], later).is_err());
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
        assert_eq!(e.kind, LimitKind::Tokens);
        // Back above zero after ~10 s (101 tokens at 10 a second).
        let wait = e.retry_after.as_secs_f64();
        assert!((10.0..10.2).contains(&wait), "{wait}");
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
        assert_eq!(openai_duration(Duration::from_millis(3_723_500)), "1h2m3.5s");
        assert_eq!(openai_duration(Duration::from_millis(1250)), "1.25s");
        assert_eq!(openai_duration(Duration::ZERO), "0ms");
    }

    proptest::proptest! {
        /// Over any arrivals, the requests admitted between two admissions are at most a
        /// minute's worth plus what refilled in between; and a refusal's wait is exact: the
        /// request is admitted after it, not before.
        #[test]
        fn admitted_requests_never_exceed_the_bucket(
            limit in 1u64..50,
            gaps_ms in proptest::collection::vec(0u64..3000, 1..200),
        ) {
            let l = limiter(Some(limit), None);
            let p = principal("acme", "gold");
            let t0 = Instant::now();
            let mut now = t0;
            let mut admitted = Vec::new();
            for gap in gaps_ms {
                now += Duration::from_millis(gap);
                match l.admit(&p, vec![], now) {
                    Ok(_) => admitted.push(now),
                    Err(e) => {
                        proptest::prop_assert!(e.retry_after > Duration::ZERO);
                        // Just before the wait it is refused again (probed on a clone).
                        let probe = limiter(Some(limit), None);
                        *probe.tenants.lock() = l.tenants.lock().iter().map(|(k, v)| {
                            (k.clone(), Arc::new(Mutex::new(Buckets {
                                requests: v.lock().requests.clone(),
                                tokens: None,
                            })))
                        }).collect();
                        if e.retry_after > Duration::from_millis(2) {
                            let early = now + e.retry_after - Duration::from_millis(1);
                            proptest::prop_assert!(probe.admit(&p, vec![], early).is_err());
                        }
                        let after = now + e.retry_after + Duration::from_micros(1);
                        proptest::prop_assert!(probe.admit(&p, vec![], after).is_ok());
                    }
                }
            }
            let per_second = limit as f64 / 60.0;
            for (i, a) in admitted.iter().enumerate() {
                for (j, b) in admitted.iter().enumerate().skip(i) {
                    let count = (j - i + 1) as f64;
                    let bound = limit as f64 + per_second * (*b - *a).as_secs_f64() + 1e-6;
                    proptest::prop_assert!(count <= bound, "{count} > {bound}");
                }
            }
        }

        /// Tokens charged at admission (the most a request can have used by then): what the
        /// requests admitted between two admissions charged is at most a minute's worth, what
        /// refilled in between, and the last one's charge (its overshoot below zero).
        #[test]
        fn charged_tokens_never_exceed_the_bucket_by_more_than_one_request(
            limit in 1u64..5000,
            arrivals in proptest::collection::vec((0u64..3000, 0u32..2000), 1..150),
        ) {
            let l = limiter(None, Some(limit));
            let p = principal("acme", "gold");
            let mut now = Instant::now();
            let mut admitted: Vec<(Instant, u32)> = Vec::new();
            let mut meters = Vec::new();
            for (gap, tokens) in arrivals {
                now += Duration::from_millis(gap);
                if let Ok(mut m) = l.admit(&p, vec![0], now) {
                    m.prompt(0, tokens);
                    admitted.push((now, tokens));
                    meters.push(m);
                }
            }
            let per_second = limit as f64 / 60.0;
            let most = admitted.iter().map(|a| a.1).max().unwrap_or(0) as f64;
            for i in 0..admitted.len() {
                let mut sum = 0.0;
                for j in i..admitted.len() {
                    sum += f64::from(admitted[j].1);
                    let span = (admitted[j].0 - admitted[i].0).as_secs_f64();
                    // A second's refill of slack for the float sums.
                    let bound = limit as f64 + per_second * (span + 1.0) + most;
                    proptest::prop_assert!(sum <= bound, "{sum} > {bound}");
                }
            }
        }
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
