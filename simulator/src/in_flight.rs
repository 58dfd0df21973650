//! The server's admission bounds on requests in flight, as the simulator applies them: a
//! tier's `max_pending_requests` (the server's 503 `overloaded`) and its
//! `max_pending_per_tenant` (the server's 429, reason `tenant_busy`). A trace request takes
//! one seat (a trace request is one choice) from its arrival until it ends; the tenant's seat
//! is checked first, as the server takes it first.

use std::collections::HashMap;

/// Why an arrival was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// Its tier had `max_pending_requests` requests in flight.
    TierFull,
    /// Its tenant had its tier's `max_pending_per_tenant` requests in flight.
    TenantBusy,
}

/// Requests in flight per tier and per (tier, tenant); entries go with their last request, so
/// they never outnumber the requests in flight.
#[derive(Default)]
pub(crate) struct InFlight {
    tiers: HashMap<String, usize>,
    tenants: HashMap<(String, String), usize>,
}

impl InFlight {
    /// Takes a seat for a request of `tenant` in `tier` under the bounds given (`None`: no
    /// bound), or refuses it, taking nothing.
    pub(crate) fn take(
        &mut self,
        tier: &str,
        tenant: &str,
        tier_limit: Option<usize>,
        tenant_limit: Option<usize>,
    ) -> Result<(), Refusal> {
        let key = (tier.to_owned(), tenant.to_owned());
        let held = self.tenants.get(&key).copied().unwrap_or(0);
        if tenant_limit.is_some_and(|l| held >= l) {
            return Err(Refusal::TenantBusy);
        }
        let tier_held = self.tiers.get(tier).copied().unwrap_or(0);
        if tier_limit.is_some_and(|l| tier_held >= l) {
            return Err(Refusal::TierFull);
        }
        *self.tiers.entry(key.0.clone()).or_default() += 1;
        *self.tenants.entry(key).or_default() += 1;
        Ok(())
    }

    /// Gives back the seat of a request of `tenant` in `tier` that ended.
    pub(crate) fn give_back(&mut self, tier: &str, tenant: &str) {
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
        let (tier, tenant) = (Some(3), Some(2));
        assert_eq!(f.take("free", "a", tier, tenant), Ok(()));
        assert_eq!(f.take("free", "a", tier, tenant), Ok(()));
        assert_eq!(f.take("free", "a", tier, tenant), Err(Refusal::TenantBusy));
        assert_eq!(f.take("free", "b", tier, tenant), Ok(()));
        // The tier is full: b, with room of its own, is refused by the tier.
        assert_eq!(f.take("free", "b", tier, tenant), Err(Refusal::TierFull));
        // Unbounded tiers take seats without limit.
        for _ in 0..10 {
            assert_eq!(f.take("paid", "a", None, None), Ok(()));
        }
        f.give_back("free", "a");
        assert_eq!(f.take("free", "b", tier, tenant), Ok(()));
        for (tier, tenant, n) in [("free", "a", 1), ("free", "b", 2), ("paid", "a", 10)] {
            for _ in 0..n {
                f.give_back(tier, tenant);
            }
        }
        assert_eq!(f.total(), 0);
        assert!(f.tiers.is_empty() && f.tenants.is_empty());
    }
}
