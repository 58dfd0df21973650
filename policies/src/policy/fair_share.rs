//! Fair share across tenants with the Virtual Token Counter (VTC) of Sheng et al.,
//! "Fairness in Serving Large Language Models", OSDI 2024.
//!
//! Each tenant has a counter of the service it received: `input_weight` per prompt token
//! computed plus `output_weight` per generated token (the paper's w_p = 1, w_q = 2),
//! divided by the tenant's weight (`tenant_weights`, default 1). Waiting requests are
//! admitted from the tenant with the smallest counter. When a tenant with no live request
//! sends one, its counter is lifted to at least the smallest counter among tenants with
//! live requests, so idle time cannot be banked into a later burst (the paper's counter
//! lift). As in the paper, VTC decides admission order: running requests keep arrival
//! order, so preemption victims are the newest running requests and counters cannot make
//! two requests evict each other in turn. Recomputation after preemption is not charged.
//!
//! Counters are updated once per step, so within one step several requests of the same
//! tenant may be admitted before the next counter comparison.

use std::collections::BTreeMap;

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, PolicyEvent, Rank};
use crate::sequence::SeqView;
use crate::types::{TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "fair-share";

/// Counter units per token of service (ranks are integers).
const SCALE: f64 = 1000.0;

/// A tenant's accounting.
#[derive(Clone, Debug, Default)]
struct Tenant {
    /// Virtual tokens of service received.
    counter: f64,
    /// Live (waiting or running) requests.
    live: usize,
    /// The tenant's weight (resolved from `tenant_weights` when first seen).
    weight: f64,
}

/// VTC fair share.
#[derive(Clone, Debug)]
pub struct FairShare {
    /// Cost of one computed prompt token.
    input_weight: f64,
    /// Cost of one generated token.
    output_weight: f64,
    /// Per-tenant weights (default 1).
    weights: BTreeMap<String, f64>,
    /// Counters indexed by [`SeqView::tenant_id`] (`None` until the tenant is first seen).
    tenants: Vec<Option<Tenant>>,
}

impl FairShare {
    /// A VTC policy with the given token costs and tenant weights.
    pub fn new(input_weight: f64, output_weight: f64, weights: BTreeMap<String, f64>) -> Self {
        Self {
            input_weight,
            output_weight,
            weights,
            tenants: Vec::new(),
        }
    }

    /// Builds the policy from `{input_weight, output_weight, tenant_weights: {name: w}}`
    /// (defaults 1, 2, all 1).
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(
            NAME,
            params,
            &["input_weight", "output_weight", "tenant_weights"],
        )?;
        let wi = p.f64_in("input_weight", 1.0, 0.0, 1e6)?;
        let wo = p.f64_in("output_weight", 2.0, 0.0, 1e6)?;
        let weights = p.positive_map("tenant_weights")?;
        Ok(Box::new(Self::new(wi, wo, weights)))
    }

    /// The virtual token counter of the tenant with this id (0 for an unknown tenant).
    pub fn counter(&self, tenant_id: u32) -> f64 {
        self.tenant(tenant_id).map_or(0.0, |t| t.counter)
    }

    fn tenant(&self, id: u32) -> Option<&Tenant> {
        self.tenants.get(id as usize).and_then(|t| t.as_ref())
    }

    fn tenant_mut(&mut self, id: u32) -> Option<&mut Tenant> {
        self.tenants.get_mut(id as usize).and_then(|t| t.as_mut())
    }
}

impl Policy for FairShare {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, _now: Timestamp) -> Rank {
        if seq.is_running() {
            return Rank::default();
        }
        let c = (self.counter(seq.tenant_id()) * SCALE).min(i64::MAX as f64) as i64;
        Rank { class: 1, key: c }
    }

    fn observe(&mut self, event: PolicyEvent<'_>) {
        match event {
            PolicyEvent::Arrived(seq) => {
                let id = seq.tenant_id();
                let floor = match self.tenant(id) {
                    Some(t) if t.live > 0 => None,
                    _ => self
                        .tenants
                        .iter()
                        .flatten()
                        .filter(|t| t.live > 0)
                        .map(|t| t.counter)
                        .reduce(f64::min),
                };
                if self.tenants.len() <= id as usize {
                    self.tenants.resize(id as usize + 1, None);
                }
                let weight = self.weights.get(seq.tenant()).copied().unwrap_or(1.0);
                let t = self.tenants[id as usize].get_or_insert(Tenant {
                    counter: 0.0,
                    live: 0,
                    weight,
                });
                if let Some(f) = floor {
                    t.counter = t.counter.max(f);
                }
                t.live += 1;
            }
            PolicyEvent::Served {
                seq,
                prompt_tokens,
                output_tokens,
            } => {
                let cost = prompt_tokens as f64 * self.input_weight
                    + output_tokens as f64 * self.output_weight;
                if let Some(t) = self.tenant_mut(seq.tenant_id()) {
                    t.counter += cost / t.weight;
                }
            }
            PolicyEvent::Departed(seq) => {
                if let Some(t) = self.tenant_mut(seq.tenant_id()) {
                    t.live = t.live.saturating_sub(1);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testutil::seq;
    use crate::sequence::Sequence;

    fn of(tenant: &str, id: u64) -> Sequence {
        let mut s = seq(id, id, 10);
        s.req.tenant = tenant.into();
        s.tenant_id = u32::from(tenant.as_bytes()[0] - b'a');
        s
    }

    fn serve(p: &mut FairShare, s: &Sequence, prompt: usize, out: usize) {
        p.observe(PolicyEvent::Served {
            seq: SeqView::new(s),
            prompt_tokens: prompt,
            output_tokens: out,
        });
    }

    #[test]
    fn counters_charge_input_and_output_with_tenant_weight() {
        let mut w = BTreeMap::new();
        w.insert("b".to_string(), 2.0);
        let mut p = FairShare::new(1.0, 2.0, w);
        let (a, b) = (of("a", 1), of("b", 2));
        p.observe(PolicyEvent::Arrived(SeqView::new(&a)));
        p.observe(PolicyEvent::Arrived(SeqView::new(&b)));
        serve(&mut p, &a, 100, 1); // 100 + 2 = 102
        serve(&mut p, &b, 100, 1); // 102 / 2 = 51
        assert_eq!(p.counter(0), 102.0);
        assert_eq!(p.counter(1), 51.0);
        // b has received less weighted service, so b's waiting requests come first.
        let (a2, b2) = (of("a", 3), of("b", 4));
        assert!(p.rank(SeqView::new(&b2), Timestamp(0)) < p.rank(SeqView::new(&a2), Timestamp(0)));
    }

    #[test]
    fn idle_tenant_is_lifted_to_the_smallest_live_counter() {
        let mut p = FairShare::new(1.0, 2.0, BTreeMap::new());
        let (a, b) = (of("a", 1), of("b", 2));
        p.observe(PolicyEvent::Arrived(SeqView::new(&a)));
        p.observe(PolicyEvent::Arrived(SeqView::new(&b)));
        serve(&mut p, &a, 500, 0);
        serve(&mut p, &b, 300, 0);
        // c arrives while a (500) and b (300) are live: lifted to 300.
        let c = of("c", 3);
        p.observe(PolicyEvent::Arrived(SeqView::new(&c)));
        assert_eq!(p.counter(2), 300.0);
        // b departs and returns: it is lifted to min(a = 500, c = 700) = 500.
        p.observe(PolicyEvent::Departed(SeqView::new(&b)));
        serve(&mut p, &c, 400, 0); // c = 700
        p.observe(PolicyEvent::Arrived(SeqView::new(&of("b", 4))));
        assert_eq!(p.counter(1), 500.0);
    }

    #[test]
    fn running_requests_keep_arrival_order() {
        let p = FairShare::new(1.0, 2.0, BTreeMap::new());
        let mut r = of("a", 1);
        r.state = crate::types::RequestState::Running;
        assert_eq!(p.rank(SeqView::new(&r), Timestamp(0)), Rank::default());
    }
}
