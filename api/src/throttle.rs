//! A log line per interval, not per event: for events a client can repeat at will (failed
//! authentication), so that a flood of them writes a line a second carrying their count.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Lets one event of many through per interval, with the count of those held back: the first
/// event passes at once, later ones once `every` has passed since the last one that passed.
pub(crate) struct Throttle {
    every: Duration,
    /// When an event last passed, and the events counted since then.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    pub(crate) const fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// Counts one event at `now`; `Some(n)` when it passes, `n` the events counted since the
    /// last one that passed, this one included.
    pub(crate) fn hit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_passes_per_interval_with_the_count() {
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
