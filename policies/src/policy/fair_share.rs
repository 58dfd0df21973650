//! Fair share across tenants with the Virtual Token Counter (VTC) of Sheng et al.,
//! "Fairness in Serving Large Language Models", OSDI 2024 (the paper's Algorithm 2 and its
//! artifact, S-LoRA's `slora/server/router/vtc_req_queue.py`).
//!
//! **Counters.** Each tenant has a counter of the service it received, in virtual tokens:
//! `input_weight` per prompt token plus `output_weight` per generated token (the paper's
//! w_p = 1, w_q = 2), each divided by the request's weight, which is its tenant's weight
//! (`tenant_weights`, default 1) times its tier's `weight` (the `tiers` section; 1 for a
//! request whose tier is not configured). So under backlog a tenant of weight 4 gets about
//! four times the service of a tenant of weight 1, and so do one tenant's requests in a
//! tier of weight 4 against another's in a tier of weight 1. Recomputation after
//! preemption is not charged.
//!
//! **Admission.** Waiting requests are admitted from the tenant with the smallest counter.
//! Like the artifact, which charges a request's prompt when it admits it, the order is
//! decided per request, not per step: the core ranks the waiting queue once per step, so
//! each never-admitted waiting request ranks at its tenant's counter plus the prompt cost
//! of the tenant's requests that are admitted but not yet charged (a prompt is charged as
//! its chunks are computed) and of the tenant's waiting requests ahead of it (in arrival
//! order). That is the counter the tenant would have when VTC picks that request, so the
//! seats freed in one step are shared between tenants (A, B, A, B, ...) instead of going
//! to one tenant in a block. A preempted request ranks at its tenant's counter (its prompt
//! was charged when first computed).
//!
//! **Counter lift.** A tenant is backlogged while it has requests in the waiting queue: never
//! admitted, or preempted and waiting to run again. When a request arrives for a tenant that
//! is not backlogged, the
//! tenant's counter is lifted to at least the smallest counter among backlogged tenants or,
//! when no tenant is backlogged, to the system's virtual time: the counter of the last
//! tenant to leave the backlog (the rule of the paper's Algorithm 2 for an empty queue; the
//! artifact's `append` lifts only when another client waits, which lets a tenant bank idle
//! time whenever the queue drains). The virtual time only moves forward: it is at least
//! every counter a tenant had when it left the backlog. So idle time cannot be banked into a later burst, whether other tenants
//! wait, run or are gone, and a tenant that only has running requests is lifted too when
//! it sends one more. (Counters include the prompt cost not yet charged, as above.)
//!
//! **Scope.** As in the paper, VTC decides admission order: running requests keep arrival
//! order, so preemption victims are the newest running requests and counters cannot make
//! two requests evict each other in turn. The policy hears of an admission and of a
//! preemption as the step is planned (`PolicyEvent::Admitted`, `PolicyEvent::Preempted`), so
//! a request arriving while that step runs sees the backlog the plan left; computed tokens are
//! charged after each step.
//!
//! Cost: O(1) per served sequence; O(tenants) per arrival of a request whose tenant is not
//! backlogged; a rank is O(1) plus the requests of the same tenant admitted out of order
//! ahead of it (requests passed over for a LoRA slot), usually none.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasherDefault;

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, PolicyEvent, Rank};
use crate::scheduler::IdHasher;
use crate::sequence::SeqView;
use crate::types::{RequestId, RequestState, TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "fair-share";

/// Smallest tenant or tier weight accepted (their product divides every cost).
pub(crate) const MIN_WEIGHT: f64 = 1e-3;
/// Largest tenant or tier weight accepted.
pub(crate) const MAX_WEIGHT: f64 = 1e6;

/// A tenant's accounting.
#[derive(Clone, Debug, Default)]
struct Tenant {
    /// Virtual tokens of service received (charged as computed).
    counter: f64,
    /// Prompt cost of the tenant's admitted live requests not yet charged.
    uncharged: f64,
    /// The tenant's weight (resolved from `tenant_weights` when first seen).
    weight: f64,
    /// Live (waiting or running) requests.
    live: usize,
    /// Ordinals of the tenant's never-admitted waiting requests.
    queue: BTreeSet<u64>,
    /// The tenant's preempted requests waiting to run again. With `queue`, its backlog.
    preempted: usize,
    /// Admission cost of the requests that entered the queue since it was last empty.
    enqueued: f64,
    /// Admission cost of those that left it.
    dequeued: f64,
    /// Requests that left the queue behind a request still in it (ordinal → cost).
    holes: BTreeMap<u64, f64>,
}

impl Tenant {
    /// The counter VTC would have: service received plus admitted prompts not yet charged.
    fn projected(&self) -> f64 {
        self.counter + self.uncharged
    }

    /// Whether the tenant has requests waiting: never admitted, or preempted.
    fn backlogged(&self) -> bool {
        !self.queue.is_empty() || self.preempted > 0
    }

    /// Admission cost of the queued requests ahead of the one with `ord` and `start`.
    fn ahead(&self, ord: u64, start: f64) -> f64 {
        let behind: f64 = self.holes.range(ord + 1..).map(|(_, c)| c).sum();
        (start - self.dequeued + behind).max(0.0)
    }
}

/// A live request's accounting.
#[derive(Copy, Clone, Debug)]
struct Entry {
    /// The tenant's id.
    tenant: u32,
    /// Tenant weight × tier weight.
    weight: f64,
    /// Prompt cost not yet charged.
    uncharged: f64,
    /// The place in its tenant's queue while never admitted.
    queued: Option<Queued>,
    /// Preempted, waiting to run again.
    preempted: bool,
}

/// A never-admitted request's place in its tenant's queue.
#[derive(Copy, Clone, Debug)]
struct Queued {
    /// Arrival ordinal.
    ord: u64,
    /// The tenant's `enqueued` when the request entered the queue.
    start: f64,
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
    /// Per-tier weights (default 1).
    tier_weights: BTreeMap<String, f64>,
    /// Counters indexed by [`SeqView::tenant_id`] (`None` until the tenant is first seen).
    tenants: Vec<Option<Tenant>>,
    /// Live requests.
    requests: HashMap<RequestId, Entry, BuildHasherDefault<IdHasher>>,
    /// The next arrival ordinal.
    next_ord: u64,
    /// The last tenant to leave the backlog.
    last_left: Option<u32>,
    /// System virtual time: the lift when no tenant is backlogged (never decreases).
    vtime: f64,
}

impl FairShare {
    /// A VTC policy with the given token costs and tenant weights (every tier weighs 1).
    pub fn new(input_weight: f64, output_weight: f64, weights: BTreeMap<String, f64>) -> Self {
        Self {
            input_weight,
            output_weight,
            weights,
            tier_weights: BTreeMap::new(),
            tenants: Vec::new(),
            requests: HashMap::default(),
            next_ord: 0,
            last_left: None,
            vtime: 0.0,
        }
    }

    /// Weighs requests by their tier too (tier name → weight).
    pub fn with_tier_weights(mut self, tier_weights: BTreeMap<String, f64>) -> Self {
        self.tier_weights = tier_weights;
        self
    }

    /// Builds the policy from `{input_weight, output_weight, tenant_weights: {name: w}}`
    /// (defaults 1, 2, all 1) and the tiers' weights. Tenant and tier weights must lie in
    /// `MIN_WEIGHT..=MAX_WEIGHT`.
    pub fn create(
        params: &serde_yaml::Value,
        tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(
            NAME,
            params,
            &["input_weight", "output_weight", "tenant_weights"],
        )?;
        let wi = p.f64_in("input_weight", 1.0, 0.0, 1e6)?;
        let wo = p.f64_in("output_weight", 2.0, 0.0, 1e6)?;
        let weights = p.map_in("tenant_weights", "tenant", MIN_WEIGHT, MAX_WEIGHT)?;
        let mut tier_weights = BTreeMap::new();
        for t in tiers {
            if !(MIN_WEIGHT..=MAX_WEIGHT).contains(&t.weight) {
                return Err(PolicyError::InvalidParam {
                    policy: NAME,
                    field: "tiers".into(),
                    reason: format!(
                        "tier `{}`: weight must be in {MIN_WEIGHT}..={MAX_WEIGHT}, got {}",
                        t.name,
                        crate::short_number::short_number(t.weight)
                    ),
                });
            }
            tier_weights.insert(t.name.clone(), t.weight);
        }
        Ok(Box::new(
            Self::new(wi, wo, weights).with_tier_weights(tier_weights),
        ))
    }

    /// The virtual token counter of the tenant with this id (0 for an unknown tenant): the
    /// service charged so far, lifts included.
    pub fn counter(&self, tenant_id: u32) -> f64 {
        self.tenant(tenant_id).map_or(0.0, |t| t.counter)
    }

    fn tenant(&self, id: u32) -> Option<&Tenant> {
        self.tenants.get(id as usize).and_then(|t| t.as_ref())
    }

    fn tenant_mut(&mut self, id: u32) -> Option<&mut Tenant> {
        self.tenants.get_mut(id as usize).and_then(|t| t.as_mut())
    }

    /// The lift for a tenant entering the backlog: the smallest projected counter among the
    /// other backlogged tenants, else the system virtual time (`None` before any tenant left
    /// the backlog).
    fn lift_target(&mut self, id: u32) -> Option<f64> {
        let backlogged = self
            .tenants
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != id as usize)
            .filter_map(|(_, t)| t.as_ref())
            .filter(|t| t.backlogged())
            .map(Tenant::projected)
            .reduce(f64::min);
        if backlogged.is_some() {
            return backlogged;
        }
        let last = self.tenant(self.last_left?)?.projected();
        self.vtime = self.vtime.max(last);
        Some(self.vtime)
    }

    /// Takes a request out of its tenant's queue (admitted or departed); the tenant leaves
    /// the backlog with its last one, unless it has preempted requests waiting.
    fn dequeue(&mut self, id: u32, q: Queued, cost: f64) {
        let Some(t) = self.tenant_mut(id) else { return };
        t.queue.remove(&q.ord);
        t.dequeued += cost;
        match t.queue.first().copied() {
            None => {
                t.enqueued = 0.0;
                t.dequeued = 0.0;
                t.holes.clear();
                self.left_if_idle(id);
            }
            Some(head) => {
                if q.ord > head {
                    t.holes.insert(q.ord, cost);
                }
                while t.holes.first_key_value().is_some_and(|(&o, _)| o < head) {
                    t.holes.pop_first();
                }
            }
        }
    }

    /// A preempted request of the tenant runs again or departs; the tenant leaves the backlog
    /// with its last waiting request.
    fn unpreempt(&mut self, id: u32) {
        let Some(t) = self.tenant_mut(id) else { return };
        t.preempted = t.preempted.saturating_sub(1);
        self.left_if_idle(id);
    }

    /// Records the tenant's leaving the backlog when it has nothing waiting any more: the
    /// system virtual time moves up to its counter.
    fn left_if_idle(&mut self, id: u32) {
        let Some(t) = self.tenant(id) else { return };
        if t.backlogged() {
            return;
        }
        self.vtime = self.vtime.max(t.projected());
        self.last_left = Some(id);
    }

    fn arrived(&mut self, seq: SeqView<'_>) {
        let (rid, id) = (seq.id(), seq.tenant_id());
        if self.requests.contains_key(&rid) {
            return;
        }
        if self.tenants.len() <= id as usize {
            self.tenants.resize(id as usize + 1, None);
        }
        let tenant_weight = self.weights.get(seq.tenant()).copied().unwrap_or(1.0);
        let t = self.tenants[id as usize].get_or_insert_with(|| Tenant {
            weight: tenant_weight,
            ..Tenant::default()
        });
        t.live += 1;
        let weight = t.weight * self.tier_weights.get(seq.tier()).copied().unwrap_or(1.0);
        let prompt = seq.prompt_len() as f64 * self.input_weight / weight;
        let mut entry = Entry {
            tenant: id,
            weight,
            uncharged: prompt,
            queued: None,
            preempted: false,
        };
        match seq.state() {
            RequestState::Waiting => {
                if !t.backlogged() {
                    if let Some(lift) = self.lift_target(id) {
                        if let Some(t) = self.tenant_mut(id) {
                            t.counter = t.counter.max(lift - t.uncharged);
                        }
                    }
                }
                let ord = self.next_ord;
                self.next_ord += 1;
                if let Some(t) = self.tenant_mut(id) {
                    entry.queued = Some(Queued {
                        ord,
                        start: t.enqueued,
                    });
                    t.enqueued += prompt;
                    t.queue.insert(ord);
                }
            }
            // Replayed after a swap: already admitted; what is computed of the prompt
            // counts as charged (a preempted request's prompt was computed before), and a
            // preempted request waits again.
            state => {
                let left = match state {
                    RequestState::Running => {
                        seq.prompt_len().saturating_sub(seq.num_computed_tokens())
                    }
                    _ => 0,
                };
                entry.uncharged = left as f64 * self.input_weight / weight;
                t.uncharged += entry.uncharged;
                if state == RequestState::Preempted {
                    entry.preempted = true;
                    t.preempted += 1;
                }
            }
        }
        self.requests.insert(rid, entry);
    }

    /// Admitted: a never-admitted request leaves its tenant's queue and its prompt counts from
    /// now on (VTC charges it at admission); a preempted one no longer waits.
    fn admitted(&mut self, seq: SeqView<'_>) {
        let Some(e) = self.requests.get_mut(&seq.id()) else {
            return;
        };
        let (tenant, cost) = (e.tenant, e.uncharged);
        if let Some(q) = e.queued.take() {
            if let Some(t) = self.tenant_mut(tenant) {
                t.uncharged += cost;
            }
            self.dequeue(tenant, q, cost);
        } else if std::mem::take(&mut e.preempted) {
            self.unpreempt(tenant);
        }
    }

    /// Preempted: the request waits again, so its tenant is backlogged (not lifted when it
    /// sends more); its prompt, charged as computed, is not charged again.
    fn preempted(&mut self, seq: SeqView<'_>) {
        let Some(e) = self.requests.get_mut(&seq.id()) else {
            return;
        };
        if e.queued.is_some() || e.preempted {
            return;
        }
        e.preempted = true;
        let tenant = e.tenant;
        if let Some(t) = self.tenant_mut(tenant) {
            t.preempted += 1;
        }
    }

    fn served(&mut self, seq: SeqView<'_>, prompt_tokens: usize, output_tokens: usize) {
        let Some(e) = self.requests.get_mut(&seq.id()) else {
            return;
        };
        let (tenant, weight, admitted) = (e.tenant, e.weight, e.queued.take());
        let prompt = prompt_tokens as f64 * self.input_weight / weight;
        let output = output_tokens as f64 * self.output_weight / weight;
        let was_uncharged = prompt.min(e.uncharged);
        let cost = e.uncharged;
        e.uncharged -= was_uncharged;
        if let Some(q) = admitted {
            // Admitted without a word (a plan outside the planner): its prompt counts from
            // now on (so also when its tenant leaves the backlog with it, as VTC charges it at
            // admission).
            if let Some(t) = self.tenant_mut(tenant) {
                t.uncharged += cost;
            }
            self.dequeue(tenant, q, cost);
        }
        if let Some(t) = self.tenant_mut(tenant) {
            t.counter += prompt + output;
            t.uncharged = (t.uncharged - was_uncharged).max(0.0);
        }
    }

    fn departed(&mut self, seq: SeqView<'_>) {
        let Some(e) = self.requests.remove(&seq.id()) else {
            return;
        };
        match e.queued {
            Some(q) => self.dequeue(e.tenant, q, e.uncharged),
            None => {
                if let Some(t) = self.tenant_mut(e.tenant) {
                    t.uncharged = (t.uncharged - e.uncharged).max(0.0);
                }
                if e.preempted {
                    self.unpreempt(e.tenant);
                }
            }
        }
        if let Some(t) = self.tenant_mut(e.tenant) {
            t.live = t.live.saturating_sub(1);
            if t.live == 0 {
                t.uncharged = 0.0; // rounding left over
            }
        }
    }
}

/// A rank key ordered like `x` for every `x >= 0` (its IEEE bits), with no loss of precision
/// and no saturation.
fn key(x: f64) -> i64 {
    x.max(0.0).to_bits() as i64
}

impl Policy for FairShare {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, _now: Timestamp) -> Rank {
        if seq.is_running() {
            return Rank::default();
        }
        let Some(t) = self.tenant(seq.tenant_id()) else {
            return Rank { class: 1, key: 0 };
        };
        let ahead = match self.requests.get(&seq.id()).and_then(|e| e.queued) {
            Some(q) => t.ahead(q.ord, q.start),
            None => 0.0,
        };
        Rank {
            class: 1,
            key: key(t.projected() + ahead),
        }
    }

    fn observe(&mut self, event: PolicyEvent<'_>) {
        match event {
            PolicyEvent::Arrived(seq) => self.arrived(seq),
            PolicyEvent::Admitted(seq) => self.admitted(seq),
            PolicyEvent::Preempted(seq) => self.preempted(seq),
            PolicyEvent::Served {
                seq,
                prompt_tokens,
                output_tokens,
            } => self.served(seq, prompt_tokens, output_tokens),
            PolicyEvent::Departed(seq) => self.departed(seq),
        }
    }
}

#[cfg(test)]
#[path = "fair_share_tests.rs"]
mod tests;
