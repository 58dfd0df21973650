//! Admission: the bounds on requests in flight, the server's (`server.max_pending_requests`)
//! and each tier's (`tiers.<name>.max_pending_requests`), checked when a request is submitted.
//!
//! The rule is simple on purpose: a request is admitted only while its tier is under its own
//! bound (when it has one) and the server is under its bound. A tier at its bound is refused
//! even while the server has room; the server's bound is the absolute one and keeps no seats
//! aside. So one tenant's flood can take at most its tier's bound: an operator who gives the
//! tiers that may flood bounds that add up to less than the server's leaves the rest to the
//! other tiers. A request counts from its submission until its last choice ends (tokenizing,
//! waiting, running), through the [`InFlight`] guard.
//!
//! Refusals are logged at WARN, at most one line per bound per [`REFUSAL_LOG_INTERVAL`],
//! carrying how many requests that bound refused since its previous line (a flood writes a
//! line a second, not a line a request); the engine counts them in
//! `request_failed_total{reason="overloaded"}`.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::engine::{SubmitError, SubmitErrorKind};

/// Least time between two WARN lines about the refusals of one bound.
pub(crate) const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Counts requests in flight, in the server's count and its tier's; the counts drop when the
/// guard does.
pub(crate) struct InFlight {
    all: Arc<AtomicUsize>,
    tier: Option<Arc<AtomicUsize>>,
}

impl InFlight {
    /// A seat in `all` (already counted there), for tests that admit past [`Admission`].
    #[cfg(test)]
    pub(crate) fn new(all: Arc<AtomicUsize>) -> Self {
        Self { all, tier: None }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.all.fetch_sub(1, Ordering::AcqRel);
        if let Some(tier) = &self.tier {
            tier.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// Lets one event of many through per interval, with the count of those held back: the first
/// event passes at once, later ones once `every` has passed since the last one that passed.
pub(crate) struct Throttle {
    every: Duration,
    /// When an event last passed, and the events counted since then.
    state: parking_lot::Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            state: parking_lot::Mutex::new((None, 0)),
        }
    }

    /// Counts one event at `now`; `Some(n)` when it passes, `n` the events counted since the
    /// last one that passed, this one included.
    pub(crate) fn hit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock();
        state.1 += 1;
        let due = state
            .0
            .is_none_or(|last| now.saturating_duration_since(last) >= self.every);
        if !due {
            return None;
        }
        let n = state.1;
        *state = (Some(now), 0);
        Some(n)
    }
}

/// One tier's bound.
struct TierBound {
    name: String,
    limit: usize,
    in_flight: Arc<AtomicUsize>,
    refusals: Throttle,
}

/// The server's and the tiers' bounds on requests in flight.
pub(crate) struct Admission {
    limit: usize,
    in_flight: Arc<AtomicUsize>,
    tiers: Vec<TierBound>,
    refusals: Throttle,
}

impl Admission {
    /// Bounds of `limit` requests in all and, for each tier listed, its own.
    pub(crate) fn new(limit: usize, tiers: &[(String, usize)]) -> Self {
        Self {
            limit,
            in_flight: Arc::new(AtomicUsize::new(0)),
            tiers: tiers
                .iter()
                .map(|(name, limit)| TierBound {
                    name: name.clone(),
                    limit: *limit,
                    in_flight: Arc::new(AtomicUsize::new(0)),
                    refusals: Throttle::new(REFUSAL_LOG_INTERVAL),
                })
                .collect(),
            refusals: Throttle::new(REFUSAL_LOG_INTERVAL),
        }
    }

    /// Requests in flight in all.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Acquire)
    }

    /// The server's count, for guards made outside [`Admission::admit`] (tests).
    #[cfg(test)]
    pub(crate) fn counter(&self) -> Arc<AtomicUsize> {
        self.in_flight.clone()
    }

    /// Takes a seat for a request of `tier`, or refuses it as overloaded: its tier is at its
    /// bound, or the server at its own.
    pub(crate) fn admit(&self, tier: &str) -> Result<InFlight, SubmitError> {
        let bound = self.tiers.iter().find(|t| t.name == tier);
        let mut seat_in_tier = None;
        if let Some(t) = bound {
            let previous = t.in_flight.fetch_add(1, Ordering::AcqRel);
            // Released on return unless the request is admitted.
            let seat = TierSeat(&t.in_flight);
            if previous >= t.limit {
                if let Some(refused) = t.refusals.hit(Instant::now()) {
                    tracing::warn!(
                        tier = %t.name,
                        limit = t.limit,
                        refused,
                        "requests refused as overloaded: their tier is at its \
                         tiers.<name>.max_pending_requests"
                    );
                }
                return Err(SubmitError::new(
                    SubmitErrorKind::Overloaded,
                    format!(
                        "tier `{}` has its limit of {} requests in flight \
                         (tiers.{}.max_pending_requests); retry shortly",
                        t.name, t.limit, t.name
                    ),
                ));
            }
            std::mem::forget(seat);
            seat_in_tier = Some(t.in_flight.clone());
        }
        let previous = self.in_flight.fetch_add(1, Ordering::AcqRel);
        let guard = InFlight {
            all: self.in_flight.clone(),
            tier: seat_in_tier,
        };
        if previous >= self.limit {
            if let Some(refused) = self.refusals.hit(Instant::now()) {
                tracing::warn!(
                    limit = self.limit,
                    refused,
                    "requests refused as overloaded: the server is at its \
                     server.max_pending_requests"
                );
            }
            return Err(SubmitError::new(
                SubmitErrorKind::Overloaded,
                format!(
                    "the server has its limit of {} requests in flight \
                     (server.max_pending_requests); retry shortly",
                    self.limit
                ),
            ));
        }
        Ok(guard)
    }
}

/// A seat taken in a tier's count, given back when dropped.
struct TierSeat<'a>(&'a AtomicUsize);

impl Drop for TierSeat<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission() -> Admission {
        Admission::new(4, &[("batch".into(), 2)])
    }

    /// A tier at its bound is refused while the server has room, other tiers are not; the
    /// server's bound holds over every tier; seats come back with the guards.
    #[test]
    fn a_tier_at_its_bound_is_refused_while_others_are_admitted() {
        let a = admission();
        let b1 = a.admit("batch").unwrap();
        let _b2 = a.admit("batch").unwrap();
        let e = a.admit("batch").err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::Overloaded);
        assert!(
            e.message.contains("tiers.batch.max_pending_requests"),
            "{e}"
        );
        assert!(e.message.contains("limit of 2"), "{e}");
        assert_eq!(a.in_flight(), 2);
        let p1 = a.admit("premium").unwrap();
        let _p2 = a.admit("premium").unwrap();
        let e = a.admit("premium").err().unwrap();
        assert!(e.message.contains("server.max_pending_requests"), "{e}");
        // Refused by the server's bound, the tier's seat is given back too.
        drop(p1);
        drop(b1);
        assert_eq!(a.in_flight(), 2);
        let _b3 = a.admit("batch").unwrap();
        let _p3 = a.admit("premium").unwrap();
        assert!(a.admit("batch").is_err());
        assert_eq!(a.in_flight(), 4);
    }

    /// A request of a bounded tier that the server's bound refuses gives its tier's seat back.
    #[test]
    fn a_refusal_by_the_server_gives_the_tier_seat_back() {
        let a = Admission::new(3, &[("batch".into(), 2)]);
        let p1 = a.admit("premium").unwrap();
        let p2 = a.admit("premium").unwrap();
        let _b1 = a.admit("batch").unwrap();
        let e = a.admit("batch").err().unwrap();
        assert!(e.message.contains("server.max_pending_requests"), "{e}");
        drop((p1, p2));
        let _b2 = a.admit("batch").unwrap();
        let e = a.admit("batch").err().unwrap();
        assert!(e.message.contains("tiers.batch"), "{e}");
    }

    #[test]
    fn the_throttle_lets_one_event_through_per_interval_with_the_count() {
        let t = Throttle::new(Duration::from_secs(1));
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
