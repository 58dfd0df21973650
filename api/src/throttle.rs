//! A log line per interval, not per event, for events a client can repeat at will (failed
//! authentication, rate-limit refusals): [`switchyard_policies::rate_limit::LogThrottle`]
//! shared between the HTTP workers.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use switchyard_policies::rate_limit::LogThrottle;

/// A [`LogThrottle`] behind a lock, usable in a `static`.
pub(crate) struct Throttle(Mutex<LogThrottle>);

impl Throttle {
    pub(crate) const fn new(every: Duration) -> Self {
        Self(Mutex::new(LogThrottle::new(every)))
    }

    /// [`LogThrottle::hit`].
    pub(crate) fn hit(&self, now: Instant) -> Option<u64> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).hit(now)
    }
}
