//! The arithmetic of rate limits (`tiers.<name>.requests_per_minute`, `tokens_per_minute`),
//! shared by the server's HTTP layer and the simulator so that both refuse the same requests.
//!
//! Each limit is a [`TokenBucket`] holding a minute's worth that refills continuously; a
//! tenant's limits are its [`TenantBudget`]. A request takes one request when it is admitted;
//! tokens are charged as they are used, and a request is admitted while the tenant has at
//! least one token left, so the token level may go below zero (the tenant then waits until it
//! has refilled). Time is passed in, as seconds from an origin of the caller's choosing (a
//! time before the last one seen refills nothing).
//!
//! [`LogThrottle`] limits log lines rather than requests: the server's refusal lines, one per
//! interval carrying the count of the events it stands for.

/// How far below one unit a bucket may be and still admit: times are differences of floats,
/// so a client that waits exactly the time it was told must not miss by a rounding error.
const SLACK: f64 = 1e-9;

/// A tier's limits, each applied to every tenant of the tier on its own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierLimits {
    /// Requests per minute; `None`: no limit.
    pub requests_per_minute: Option<u64>,
    /// Tokens per minute (prompt and generated); `None`: no limit.
    pub tokens_per_minute: Option<u64>,
}

impl TierLimits {
    /// Whether either limit is set.
    pub fn any(&self) -> bool {
        self.requests_per_minute.is_some() || self.tokens_per_minute.is_some()
    }
}

/// Which limit refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LimitKind {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
}

impl LimitKind {
    /// `requests` or `tokens` (OpenAI's error type, metric labels).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
        }
    }
}

/// A bucket of `limit` that refills at `limit` per minute, never above `limit`. Its level may
/// go below zero (tokens used past the budget).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenBucket {
    limit: u64,
    level: f64,
    at_s: f64,
}

impl TokenBucket {
    /// A full bucket at `now_s`.
    pub fn full(limit: u64, now_s: f64) -> Self {
        Self {
            limit,
            level: limit as f64,
            at_s: now_s,
        }
    }

    /// The limit per minute.
    pub fn limit(&self) -> u64 {
        self.limit
    }

    fn per_second(&self) -> f64 {
        self.limit as f64 / 60.0
    }

    /// Brings the level up to `now_s`.
    pub fn refill(&mut self, now_s: f64) {
        if now_s <= self.at_s {
            return;
        }
        let gained = (now_s - self.at_s) * self.per_second();
        self.level = (self.level + gained).min(self.limit as f64);
        self.at_s = now_s;
    }

    /// Seconds until the level reaches `amount` (0 if it has), as of the last refill.
    pub fn wait_for(&self, amount: f64) -> f64 {
        ((amount - self.level) / self.per_second()).max(0.0)
    }

    /// Takes `amount` (a negative one gives back) at `now_s`.
    pub fn take(&mut self, amount: f64, now_s: f64) {
        self.refill(now_s);
        self.level -= amount;
    }

    /// Gives back `amount` at `now_s`, never above the limit (what was taken for something
    /// that then used nothing).
    pub fn give_back(&mut self, amount: f64, now_s: f64) {
        self.refill(now_s);
        self.level = (self.level + amount).min(self.limit as f64);
    }

    /// Whole units left (0 when spent or below zero), as of the last refill.
    pub fn remaining(&self) -> u64 {
        if self.level >= 1.0 {
            self.level.floor() as u64
        } else {
            0
        }
    }

    /// Seconds until the bucket is full again, as of the last refill.
    pub fn until_full(&self) -> f64 {
        self.wait_for(self.limit as f64)
    }

    /// Changes the limit to `limit` at `now_s`, keeping what was used of it: a bucket that
    /// had 10 of 100 left has 910 of 1000 after a raise, and -40 (so it waits) after a cut to
    /// 50. It refills at the new rate from `now_s`.
    pub fn set_limit(&mut self, limit: u64, now_s: f64) {
        self.refill(now_s);
        let used = self.limit as f64 - self.level;
        self.limit = limit;
        self.level = limit as f64 - used;
    }
}

/// A request refused by a limit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Refusal {
    /// The limit that refused it.
    pub kind: LimitKind,
    /// That limit per minute.
    pub limit: u64,
    /// Seconds until it would be admitted, were nothing else to happen meanwhile.
    pub retry_after_s: f64,
}

/// One tenant's limits.
#[derive(Debug, Clone, PartialEq)]
pub struct TenantBudget {
    requests: Option<TokenBucket>,
    tokens: Option<TokenBucket>,
}

impl TenantBudget {
    /// Full buckets of `limits` at `now_s`.
    pub fn new(limits: TierLimits, now_s: f64) -> Self {
        Self {
            requests: limits
                .requests_per_minute
                .map(|l| TokenBucket::full(l, now_s)),
            tokens: limits
                .tokens_per_minute
                .map(|l| TokenBucket::full(l, now_s)),
        }
    }

    /// The requests limit's bucket, if set.
    pub fn requests(&self) -> Option<&TokenBucket> {
        self.requests.as_ref()
    }

    /// The tokens limit's bucket, if set.
    pub fn tokens(&self) -> Option<&TokenBucket> {
        self.tokens.as_ref()
    }

    /// Changes the limits to `limits` at `now_s` (a reload of the tier's configuration): a
    /// limit kept keeps what was used of it ([`TokenBucket::set_limit`]), a new one starts
    /// full, one removed is gone.
    pub fn set_limits(&mut self, limits: TierLimits, now_s: f64) {
        let change = |bucket: &mut Option<TokenBucket>, limit: Option<u64>| {
            *bucket = match (bucket.take(), limit) {
                (Some(mut b), Some(l)) => {
                    b.set_limit(l, now_s);
                    Some(b)
                }
                (None, Some(l)) => Some(TokenBucket::full(l, now_s)),
                (_, None) => None,
            };
        };
        change(&mut self.requests, limits.requests_per_minute);
        change(&mut self.tokens, limits.tokens_per_minute);
    }

    /// Brings both buckets up to `now_s`.
    pub fn refill(&mut self, now_s: f64) {
        for bucket in [self.requests.as_mut(), self.tokens.as_mut()]
            .into_iter()
            .flatten()
        {
            bucket.refill(now_s);
        }
    }

    /// Admits a request at `now_s` while a request and a token are left, taking one request
    /// and `tokens` (what it is charged at once: an estimate or its prompt); or refuses it,
    /// taking nothing (the requests limit is checked first).
    pub fn admit(&mut self, now_s: f64, tokens: f64) -> Result<(), Refusal> {
        self.refill(now_s);
        let short = [
            (LimitKind::Requests, self.requests.as_ref()),
            (LimitKind::Tokens, self.tokens.as_ref()),
        ]
        .into_iter()
        .find_map(|(kind, bucket)| {
            let bucket = bucket.filter(|b| b.level < 1.0 - SLACK)?;
            Some(Refusal {
                kind,
                limit: bucket.limit,
                retry_after_s: bucket.wait_for(1.0),
            })
        });
        if let Some(refusal) = short {
            return Err(refusal);
        }
        if let Some(r) = self.requests.as_mut() {
            r.take(1.0, now_s);
        }
        self.charge(tokens, now_s);
        Ok(())
    }

    /// Gives back at `now_s` the request [`Self::admit`] took: the server refused it for want
    /// of room before queueing it (`overloaded`, `tenant_busy`, `unavailable`), so it used
    /// nothing. The server's own state is no client's doing: a tenant whose retries of
    /// refused requests took its budget would be rate-limited after an overload ended for
    /// requests never served.
    pub fn give_back_request(&mut self, now_s: f64) {
        if let Some(r) = self.requests.as_mut() {
            r.give_back(1.0, now_s);
        }
    }

    /// Charges `tokens` used at `now_s` (a negative amount gives back).
    pub fn charge(&mut self, tokens: f64, now_s: f64) {
        if let Some(t) = self.tokens.as_mut() {
            if tokens != 0.0 {
                t.take(tokens, now_s);
            }
        }
    }
}

/// Lets one event of many through per interval, with the count of those held back: the first
/// event passes at once, later ones once `every` has passed since the last one that passed.
/// For log lines of events a client can repeat at will (refusals, failed authentication), so
/// that a flood of them writes a line an interval carrying their count. Time is passed in;
/// callers that share one across threads hold it behind their own lock.
#[derive(Debug, Clone)]
pub struct LogThrottle {
    every: std::time::Duration,
    /// When an event last passed.
    last: Option<std::time::Instant>,
    /// Events counted since then.
    count: u64,
}

impl LogThrottle {
    /// A throttle letting one event through per `every`.
    pub const fn new(every: std::time::Duration) -> Self {
        Self {
            every,
            last: None,
            count: 0,
        }
    }

    /// Counts one event at `now`; `Some(n)` when it passes, `n` the events counted since the
    /// last one that passed, this one included.
    pub fn hit(&mut self, now: std::time::Instant) -> Option<u64> {
        self.count += 1;
        let due = self
            .last
            .is_none_or(|last| now.saturating_duration_since(last) >= self.every);
        if !due {
            return None;
        }
        let n = self.count;
        (self.last, self.count) = (Some(now), 0);
        Some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(rpm: Option<u64>, tpm: Option<u64>) -> TenantBudget {
        TenantBudget::new(
            TierLimits {
                requests_per_minute: rpm,
                tokens_per_minute: tpm,
            },
            0.0,
        )
    }

    #[test]
    fn a_minutes_requests_pass_then_one_per_refill() {
        let mut b = budget(Some(60), None);
        for i in 0..60 {
            b.admit(0.0, 10.0).unwrap();
            assert_eq!(b.requests().unwrap().remaining(), 59 - i);
        }
        let e = b.admit(0.0, 10.0).unwrap_err();
        assert_eq!((e.kind, e.limit), (LimitKind::Requests, 60));
        assert!((e.retry_after_s - 1.0).abs() < 1e-9);
        assert!(b.admit(0.9, 0.0).is_err());
        assert!(b.admit(1.0, 0.0).is_ok());
        assert!(b.admit(1.5, 0.0).is_err());
    }

    #[test]
    fn a_request_given_back_is_admitted_again_and_never_above_the_limit() {
        let mut b = budget(Some(2), Some(100));
        b.admit(0.0, 40.0).unwrap();
        b.admit(0.0, 40.0).unwrap();
        assert!(b.admit(0.0, 0.0).is_err());
        // The second was refused by the server before it was queued: its request comes
        // back (its tokens are the caller's to give back), and one more is admitted.
        b.give_back_request(0.0);
        assert_eq!(b.requests().unwrap().remaining(), 1);
        assert_eq!(b.tokens().unwrap().remaining(), 20);
        b.admit(0.0, 0.0).unwrap();
        assert!(b.admit(0.0, 0.0).is_err());
        // Given back once refilled, the bucket stays at its limit.
        b.give_back_request(120.0);
        assert_eq!(b.requests().unwrap().remaining(), 2);
        b.admit(120.0, 0.0).unwrap();
        b.admit(120.0, 0.0).unwrap();
        assert!(b.admit(120.0, 0.0).is_err());
        // A budget without a requests limit has nothing to give back.
        let mut t = budget(None, Some(10));
        t.give_back_request(0.0);
        assert!(t.requests().is_none());
    }

    #[test]
    fn the_wait_it_was_told_is_enough_whatever_the_clock_offset() {
        // Times off the origin: (0.9 + 1.0) - 0.9 is 0.9999999999999999 in floats.
        for start in [0.9, 0.0007, 12345.678901] {
            let mut b = TenantBudget::new(
                TierLimits {
                    requests_per_minute: Some(60),
                    tokens_per_minute: None,
                },
                start,
            );
            for _ in 0..60 {
                b.admit(start, 0.0).unwrap();
            }
            let e = b.admit(start, 0.0).unwrap_err();
            assert!(b.admit(start + e.retry_after_s, 0.0).is_ok(), "{start}");
        }
    }

    #[test]
    fn a_changed_limit_keeps_what_was_used_a_new_one_starts_full() {
        let mut b = budget(Some(100), None);
        for _ in 0..90 {
            b.admit(0.0, 0.0).unwrap();
        }
        // Raised: 90 used of 1000.
        b.set_limits(
            TierLimits {
                requests_per_minute: Some(1000),
                tokens_per_minute: Some(500),
            },
            0.0,
        );
        assert_eq!(b.requests().unwrap().remaining(), 910);
        assert_eq!(b.requests().unwrap().limit(), 1000);
        assert_eq!(b.tokens().unwrap().remaining(), 500);
        // Cut below what was used: refused until the excess has refilled at the new rate.
        b.set_limits(
            TierLimits {
                requests_per_minute: Some(60),
                tokens_per_minute: None,
            },
            0.0,
        );
        assert!(b.tokens().is_none());
        let e = b.admit(0.0, 0.0).unwrap_err();
        assert_eq!((e.kind, e.limit), (LimitKind::Requests, 60));
        // 90 used of 60: level -30, one request needs 31 more at one a second.
        assert!((e.retry_after_s - 31.0).abs() < 1e-9, "{}", e.retry_after_s);
        assert!(b.admit(31.0, 0.0).is_ok());
        // Removed: no limit left.
        b.set_limits(TierLimits::default(), 31.0);
        assert!(b.requests().is_none() && b.admit(31.0, 1e9).is_ok());
    }

    #[test]
    fn the_bucket_never_holds_more_than_a_minute() {
        let mut b = budget(Some(2), None);
        b.admit(0.0, 0.0).unwrap();
        b.admit(3600.0, 0.0).unwrap();
        b.admit(3600.0, 0.0).unwrap();
        assert!(b.admit(3600.0, 0.0).is_err());
        assert!((b.requests().unwrap().until_full() - 60.0).abs() < 1e-9);
    }

    #[test]
    fn tokens_may_go_below_zero_and_then_the_tenant_waits() {
        let mut b = budget(None, Some(600)); // 10 a second
        b.admit(0.0, 100.0).unwrap();
        assert_eq!(b.tokens().unwrap().remaining(), 500);
        b.charge(600.0, 0.0);
        let e = b.admit(0.0, 1.0).unwrap_err();
        assert_eq!(e.kind, LimitKind::Tokens);
        // 101 tokens short of one at 10 a second.
        assert!((e.retry_after_s - 10.1).abs() < 1e-9, "{}", e.retry_after_s);
        assert!(b.admit(10.0, 1.0).is_err());
        assert!(b.admit(10.2, 1.0).is_ok());
    }

    #[test]
    fn a_refusal_takes_nothing_and_the_requests_limit_speaks_first() {
        let mut b = budget(Some(1), Some(600));
        b.admit(0.0, 700.0).unwrap();
        let e = b.admit(0.0, 50.0).unwrap_err();
        assert_eq!(e.kind, LimitKind::Requests);
        assert_eq!(b.tokens().unwrap().remaining(), 0);
        assert_eq!(b.requests().unwrap().remaining(), 0);
        // A time before the last refills nothing.
        b.tokens.as_mut().unwrap().refill(-5.0);
        assert_eq!(b.tokens().unwrap().level, -100.0);
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
            let mut b = budget(Some(limit), None);
            let mut now = 0.0;
            let mut admitted = Vec::new();
            for gap in gaps_ms {
                now += gap as f64 / 1e3;
                match b.admit(now, 0.0) {
                    Ok(()) => admitted.push(now),
                    Err(e) => {
                        proptest::prop_assert!(e.retry_after_s > 0.0);
                        if e.retry_after_s > 2e-3 {
                            let mut early = b.clone();
                            proptest::prop_assert!(
                                early.admit(now + e.retry_after_s - 1e-3, 0.0).is_err()
                            );
                        }
                        let mut after = b.clone();
                        proptest::prop_assert!(after.admit(now + e.retry_after_s + 1e-9, 0.0).is_ok());
                    }
                }
            }
            let per_second = limit as f64 / 60.0;
            for (i, a) in admitted.iter().enumerate() {
                for (j, b) in admitted.iter().enumerate().skip(i) {
                    let count = (j - i + 1) as f64;
                    let bound = limit as f64 + per_second * (b - a) + 1e-6;
                    proptest::prop_assert!(count <= bound, "{count} > {bound}");
                }
            }
        }

        /// Tokens charged at admission (the most a request can have used by then): what the
        /// requests admitted between two admissions charged is at most a minute's worth, what
        /// refilled in between, and the largest charge (the last one's overshoot below zero).
        #[test]
        fn charged_tokens_never_exceed_the_bucket_by_more_than_one_request(
            limit in 1u64..5000,
            arrivals in proptest::collection::vec((0u64..3000, 0u32..2000), 1..150),
        ) {
            let mut b = budget(None, Some(limit));
            let mut now = 0.0;
            let mut admitted: Vec<(f64, u32)> = Vec::new();
            for (gap, tokens) in arrivals {
                now += gap as f64 / 1e3;
                if b.admit(now, f64::from(tokens)).is_ok() {
                    admitted.push((now, tokens));
                }
            }
            let per_second = limit as f64 / 60.0;
            let most = admitted.iter().map(|a| a.1).max().unwrap_or(0) as f64;
            for i in 0..admitted.len() {
                let mut sum = 0.0;
                for j in i..admitted.len() {
                    sum += f64::from(admitted[j].1);
                    let span = admitted[j].0 - admitted[i].0;
                    let bound = limit as f64 + per_second * span + most + 1e-6;
                    proptest::prop_assert!(sum <= bound, "{sum} > {bound}");
                }
            }
        }
    }

    #[test]
    fn the_log_throttle_lets_one_event_through_per_interval_with_the_count() {
        use std::time::{Duration, Instant};
        let mut t = LogThrottle::new(Duration::from_secs(1));
        let t0 = Instant::now();
        assert_eq!(t.hit(t0), Some(1));
        for i in 0..9 {
            assert_eq!(t.hit(t0 + Duration::from_millis(100 * i)), None);
        }
        assert_eq!(t.hit(t0 + Duration::from_secs(1)), Some(10));
        assert_eq!(t.hit(t0 + Duration::from_millis(1500)), None);
        assert_eq!(t.hit(t0 + Duration::from_secs(3)), Some(2));
    }
}
