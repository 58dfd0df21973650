//! The server's admission bounds on requests in flight, as the simulator applies them: a
//! tier's `max_pending_requests` (the server's 503 `overloaded`), its `max_pending_per_tenant`
//! (the server's 429, reason `tenant_busy`) and the server's own `max_pending_requests`
//! (`scheduler.max_pending_requests` in a spec; 503 `overloaded`). A trace request takes one
//! seat (a trace request is one choice) from its arrival until it ends; the tenant's seat is
//! checked first, then the tier's, then the server's, as the server takes them.

use std::collections::HashMap;

/// Why an arrival was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its tier had `max_pending_requests` requests in flight, or the server had its own
    /// bound's.
    TierFull,
    /// Its tenant had its tier's `max_pending_per_tenant` requests in flight.
    TenantBusy,
}

/// Requests in flight per tier and per (tier, tenant); entries go with their last request, so
/// they never outnumber the requests in flight.
#[derive(Default)]
pub(crate) struct InFlight {
    all: usize,
    tiers: HashMap<String, usize>,
    tenants: HashMap<(String, String), usize>,
}

/// The bounds a request is admitted under (`None`: no bound).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Limits {
    /// The server's, over every tier.
    pub server: Option<usize>,
    /// Its tier's.
    pub tier: Option<usize>,
    /// Its tenant's in its tier.
    pub tenant: Option<usize>,
}

impl InFlight {
    /// Takes a seat for a request of `tenant` in `tier` under `limits`, or refuses it,
    /// taking nothing.
    pub(crate) fn take(&mut self, tier: &str, tenant: &str, limits: Limits) -> Result<(), Refusal> {
        let key = (tier.to_owned(), tenant.to_owned());
        let held = self.tenants.get(&key).copied().unwrap_or(0);
        if limits.tenant.is_some_and(|l| held >= l) {
            return Err(Refusal::TenantBusy);
        }
        let tier_held = self.tiers.get(tier).copied().unwrap_or(0);
        if limits.tier.is_some_and(|l| tier_held >= l)
            || limits.server.is_some_and(|l| self.all >= l)
        {
            return Err(Refusal::TierFull);
        }
        self.all += 1;
        *self.tiers.entry(key.0.clone()).or_default() += 1;
        *self.tenants.entry(key).or_default() += 1;
        Ok(())
    }

    /// Gives back the seat of a request of `tenant` in `tier` that ended.
    pub(crate) fn give_back(&mut self, tier: &str, tenant: &str) {
        self.all = self.all.saturating_sub(1);
        if let Some(n) = self.tiers.get_mut(tier) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.tiers.remove(tier);
            }
        }
        let key = (tier.to_owned(), tenant.to_owned());
        if let Some(n) = self.tenants.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.tenants.remove(&key);
            }
        }
    }

    /// Requests in flight in all.
    #[cfg(test)]
    fn total(&self) -> usize {
        self.tiers.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_bound_is_checked_first_and_seats_come_back() {
        let mut f = InFlight::default();
        let bounded = Limits {
            server: None,
            tier: Some(3),
            tenant: Some(2),
        };
        assert_eq!(f.take("free", "a", bounded), Ok(()));
        assert_eq!(f.take("free", "a", bounded), Ok(()));
        assert_eq!(f.take("free", "a", bounded), Err(Refusal::TenantBusy));
        assert_eq!(f.take("free", "b", bounded), Ok(()));
        // The tier is full: b, with room of its own, is refused by the tier.
        assert_eq!(f.take("free", "b", bounded), Err(Refusal::TierFull));
        // Unbounded tiers take seats without limit.
        for _ in 0..10 {
            assert_eq!(f.take("paid", "a", Limits::default()), Ok(()));
        }
        // The server's bound counts every tier's seats: 13 in flight.
        let server = |n| Limits {
            server: Some(n),
            ..Limits::default()
        };
        assert_eq!(f.take("paid", "a", server(13)), Err(Refusal::TierFull));
        assert_eq!(f.take("paid", "a", server(14)), Ok(()));
        f.give_back("paid", "a");
        f.give_back("free", "a");
        assert_eq!(f.take("free", "b", bounded), Ok(()));
        for (tier, tenant, n) in [("free", "a", 1), ("free", "b", 2), ("paid", "a", 10)] {
            for _ in 0..n {
                f.give_back(tier, tenant);
            }
        }
        assert_eq!(f.total(), 0);
        assert!(f.all == 0 && f.tiers.is_empty() && f.tenants.is_empty());
    }
}
