//! Admission: the bounds on requests in flight, the server's (`server.max_pending_requests`)
//! and each tier's (`tiers.<name>.max_pending_requests`), checked when a request is submitted.
//!
//! **What the bounds count: choices.** A client request takes one seat per choice it asks for,
//! prompts × `n`: a completion with the prompts `["a", "b"]` takes two, as does one prompt
//! with `n: 2`. That is what vLLM's OpenAI server submits (one engine request per prompt of a
//! list, and a choice of `n > 1` is a child request of its own), what the request-level
//! metrics count (`num_requests_running` / `num_requests_waiting`, `request_*_total`: each
//! choice a request, [`crate::metric_names`]) and the work the scheduler carries (a sequence
//! per choice), so a bound sized from those gauges means what it says, and a tier's bound
//! holds however its tenant packs the work (one request of 32 prompts cannot take 32
//! sequences under a bound of 2).
//!
//! The rule is simple on purpose: a request is admitted only while its tier has room for all
//! of its choices under its own bound (when it has one) and the server has room under its
//! bound. A tier at its bound is refused even while the server has room; the server's bound is
//! the absolute one and keeps no seats aside. So one tenant's flood can take at most its
//! tier's bound: an operator who gives the tiers that may flood bounds that add up to less
//! than the server's leaves the rest to the other tiers. A prompt's seats count from the
//! submission until its last choice ends (tokenizing, waiting, running), through the
//! [`InFlight`] guard (each prompt of a request holds its own, split from the request's).
//!
//! Admission of a request is all-or-nothing: its seats are taken together, or none is. A
//! request with more choices than a bound ever admits is refused as
//! [`SubmitErrorKind::TooManyChoices`] (a 400 naming the bound: retrying cannot help); one
//! that fits the bounds but not what is free now as [`SubmitErrorKind::Overloaded`] (a 503
//! with `Retry-After`).
//!
//! A tier may also bound each of its tenants (`tiers.<name>.max_pending_per_tenant`): a
//! tenant at its bound is refused as [`SubmitErrorKind::TenantBusy`] (a 429 with
//! `Retry-After`) while the tier's other tenants are admitted, so that one tenant's flood
//! cannot take its tier's seats; the tenant's seats are taken first, then the tier's, then
//! the server's, and all are given back together. Tenants holding no seat have no entry, so
//! the per-tenant counts never outnumber the requests in flight.
//!
//! Refusals are logged at WARN, at most one line per bound and kind per
//! [`REFUSAL_LOG_INTERVAL`], carrying how many requests that bound refused since its previous
//! line (a flood writes a line a second, not a line a request); the engine counts the
//! overloaded ones in `request_failed_total{reason="overloaded"}` (each choice), and not the
//! others (a 400 before queueing, as every such 400).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_policies::rate_limit::LogThrottle;

use super::engine::{SubmitError, SubmitErrorKind};

/// Least time between two WARN lines about the refusals of one bound.
pub(crate) const REFUSAL_LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Seats held in the server's count, its tier's and its tenant's; they are given back when
/// the guard drops.
pub(crate) struct InFlight {
    all: Arc<AtomicUsize>,
    tier: Option<Arc<AtomicUsize>>,
    tenant: Option<(Arc<TenantBound>, Arc<str>)>,
    seats: usize,
}

impl InFlight {
    /// A seat in `all` (already counted there), for tests that admit past [`Admission`].
    #[cfg(test)]
    pub(crate) fn new(all: Arc<AtomicUsize>) -> Self {
        Self {
            all,
            tier: None,
            tenant: None,
            seats: 1,
        }
    }

    /// Moves `seats` of this guard's seats (at most all it holds) to a guard of their own.
    pub(crate) fn split_off(&mut self, seats: usize) -> Self {
        let seats = seats.min(self.seats);
        self.seats -= seats;
        Self {
            all: self.all.clone(),
            tier: self.tier.clone(),
            tenant: self.tenant.clone(),
            seats,
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.seats == 0 {
            return;
        }
        self.all.fetch_sub(self.seats, Ordering::AcqRel);
        if let Some(tier) = &self.tier {
            tier.fetch_sub(self.seats, Ordering::AcqRel);
        }
        if let Some((bound, tenant)) = &self.tenant {
            bound.give_back(tenant, self.seats);
        }
    }
}

/// A [`LogThrottle`] behind a lock, for the refusal lines of admission's bounds, which HTTP
/// workers hit concurrently.
pub(crate) struct Throttle(parking_lot::Mutex<LogThrottle>);

impl Throttle {
    pub(crate) fn new(every: Duration) -> Self {
        Self(parking_lot::Mutex::new(LogThrottle::new(every)))
    }

    /// [`LogThrottle::hit`].
    pub(crate) fn hit(&self, now: Instant) -> Option<u64> {
        self.0.lock().hit(now)
    }
}

/// What a client request asks of admission: its prompts and its choices in all (prompts ×
/// `n`), one seat each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Demand {
    /// Prompts (1 for chat).
    pub prompts: usize,
    /// Choices over all prompts: the seats it takes.
    pub choices: usize,
}

impl Demand {
    /// The request's size as its refusal states it: "2 choices (2 prompts × n = 1)".
    fn describe(&self) -> String {
        let Self { prompts, choices } = *self;
        let plural = if choices == 1 { "" } else { "s" };
        if prompts <= 1 {
            format!("{choices} choice{plural} (n = {choices})")
        } else if choices % prompts == 0 {
            format!(
                "{choices} choices ({prompts} prompts × n = {})",
                choices / prompts
            )
        } else {
            format!("{choices} choices over {prompts} prompts")
        }
    }
}

/// Most tier names counted: the configured tiers (at most 32) and the names of tiers not
/// configured that requests carry (their API keys' tier, or the open API's default), which the
/// configuration bounds too; a name beyond is not counted (nothing bounds it anyway).
const MAX_COUNTED_TIERS: usize = 256;

/// The limit of a bound that does not bound: a configured tier without one still counts its
/// seats, so that a reload that gives it one ([`Admission::set_limits`]) counts the requests
/// already in flight.
const UNBOUNDED: usize = usize::MAX;

/// One bound's count and its refusal logs.
struct Bound {
    /// Changed by a reload ([`Admission::set_limits`]); [`UNBOUNDED`] for none.
    limit: AtomicUsize,
    in_flight: Arc<AtomicUsize>,
    /// Refusals of requests that fit under the bound, not now.
    full: Throttle,
    /// Refusals of requests larger than the bound.
    too_large: Throttle,
}

impl Bound {
    fn new(limit: usize) -> Self {
        Self {
            limit: AtomicUsize::new(limit),
            in_flight: Arc::new(AtomicUsize::new(0)),
            full: Throttle::new(REFUSAL_LOG_INTERVAL),
            too_large: Throttle::new(REFUSAL_LOG_INTERVAL),
        }
    }

    fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Takes `seats` if they all fit under the limit now; none otherwise (never counting
    /// past the limit, even for a moment).
    fn take(&self, seats: usize) -> bool {
        let limit = self.limit();
        self.in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                n.checked_add(seats).filter(|&after| after <= limit)
            })
            .is_ok()
    }

    fn give_back(&self, seats: usize) {
        self.in_flight.fetch_sub(seats, Ordering::AcqRel);
    }
}

/// The bound on each tenant's seats in one tier.
pub(crate) struct TenantBound {
    /// Changed by a reload ([`Admission::set_limits`]); [`UNBOUNDED`] for none.
    limit: AtomicUsize,
    /// Seats per tenant holding any (an entry goes when its tenant's last seat is given back).
    held: parking_lot::Mutex<HashMap<Arc<str>, usize>>,
    full: Throttle,
    too_large: Throttle,
}

impl TenantBound {
    fn new(limit: usize) -> Self {
        Self {
            limit: AtomicUsize::new(limit),
            held: parking_lot::Mutex::new(HashMap::new()),
            full: Throttle::new(REFUSAL_LOG_INTERVAL),
            too_large: Throttle::new(REFUSAL_LOG_INTERVAL),
        }
    }

    fn limit(&self) -> usize {
        self.limit.load(Ordering::Acquire)
    }

    /// Takes `seats` for `tenant` if they all fit under the limit now; none otherwise.
    fn take(&self, tenant: &Arc<str>, seats: usize) -> bool {
        let limit = self.limit();
        let mut held = self.held.lock();
        let now = held.get(tenant).copied().unwrap_or(0);
        match now.checked_add(seats).filter(|&after| after <= limit) {
            Some(after) => {
                held.insert(tenant.clone(), after);
                true
            }
            None => false,
        }
    }

    fn give_back(&self, tenant: &str, seats: usize) {
        let mut held = self.held.lock();
        if let Some(n) = held.get_mut(tenant) {
            *n = n.saturating_sub(seats);
            if *n == 0 {
                held.remove(tenant);
            }
        }
    }

    /// The seats `tenant` holds.
    #[cfg(test)]
    fn held(&self, tenant: &str) -> usize {
        self.held.lock().get(tenant).copied().unwrap_or(0)
    }

    /// Tenants holding seats.
    #[cfg(test)]
    fn tenants(&self) -> usize {
        self.held.lock().len()
    }
}

/// One tier's bounds: on its seats (`max_pending_requests`) and on each of its tenants'
/// (`max_pending_per_tenant`).
struct TierBound {
    name: String,
    bound: Option<Bound>,
    per_tenant: Option<Arc<TenantBound>>,
}

/// The server's, the tiers' and their tenants' bounds on choices in flight.
pub(crate) struct Admission {
    server: Bound,
    /// Written only by a reload ([`Admission::set_tiers`]); the seats a guard holds are its
    /// own `Arc`s, so a tier's entry may go while requests of it are in flight.
    tiers: parking_lot::RwLock<Vec<TierBound>>,
}

impl Admission {
    /// Bounds of `limit` choices in all and, for each tier listed in `tiers`, its own and, for
    /// each listed in `per_tenant`, each of its tenants'.
    pub(crate) fn new(
        limit: usize,
        tiers: &[(String, usize)],
        per_tenant: &[(String, usize)],
    ) -> Self {
        let mut bounds: Vec<TierBound> = Vec::new();
        for (name, limit) in tiers {
            bounds.push(TierBound {
                name: name.clone(),
                bound: Some(Bound::new(*limit)),
                per_tenant: None,
            });
        }
        for (name, limit) in per_tenant {
            let tenant = Some(Arc::new(TenantBound::new(*limit)));
            match bounds.iter_mut().find(|t| &t.name == name) {
                Some(t) => t.per_tenant = tenant,
                None => bounds.push(TierBound {
                    name: name.clone(),
                    bound: None,
                    per_tenant: tenant,
                }),
            }
        }
        Self {
            server: Bound::new(limit),
            tiers: parking_lot::RwLock::new(bounds),
        }
    }

    /// Counts the seats of each of the tiers `names` (the configured tiers) and of its
    /// tenants, bounded or not, so that a reload may bound any of them
    /// ([`Admission::set_limits`]) counting what is already in flight.
    pub(crate) fn counting(mut self, names: impl IntoIterator<Item = String>) -> Self {
        let tiers = self.tiers.get_mut();
        for name in names {
            count(tiers, name);
        }
        self
    }

    /// The configured tiers are now `names` (a reload): a new tier is counted from now on, and
    /// requests of its name already in flight (keys without a tier, an open API's default)
    /// count in it too, since [`Admission::admit`] counts every tier name it admits; a
    /// removed one's bounds no longer apply, its entry kept while requests of it hold seats
    /// (so a tier removed and added back by later reloads counts them) and dropped once idle,
    /// as is an idle name no tier has.
    pub(crate) fn set_tiers(&self, names: &[String]) {
        let mut tiers = self.tiers.write();
        tiers.retain(|t| {
            if names.contains(&t.name) {
                return true;
            }
            let mut busy = false;
            if let Some(b) = &t.bound {
                b.limit.store(UNBOUNDED, Ordering::Release);
                busy |= b.in_flight.load(Ordering::Acquire) > 0;
            }
            if let Some(b) = &t.per_tenant {
                b.limit.store(UNBOUNDED, Ordering::Release);
                busy |= !b.held.lock().is_empty();
            }
            busy
        });
        for name in names {
            count(&mut tiers, name.clone());
        }
    }

    /// Puts new bounds in force (a reload of the configuration): `limit` for the server and,
    /// for each tier this admission counts, its bound in `tiers` and its tenants' in
    /// `per_tenant` (none where a tier is not listed). A tier counted only where it had a
    /// bound at the start ([`Admission::counting`] counts every configured one, and
    /// [`Admission::set_tiers`] a reload's new ones) keeps its count; a tier this admission
    /// does not count is refused, changing nothing, and named in the `Err`. Requests in flight
    /// keep their seats: a bound cut below what is in flight refuses until enough of them
    /// end. Returns the bounds that changed, as `server.max_pending_requests: 64 -> 32`
    /// (`none` for no bound).
    pub(crate) fn set_limits(
        &self,
        limit: usize,
        tiers: &[(String, usize)],
        per_tenant: &[(String, usize)],
    ) -> Result<Vec<String>, Vec<String>> {
        let tier_bounds = self.tiers.read();
        let counted = |name: &str, per_tenant: bool| {
            tier_bounds.iter().any(|t| {
                t.name == name
                    && if per_tenant {
                        t.per_tenant.is_some()
                    } else {
                        t.bound.is_some()
                    }
            })
        };
        let unknown: Vec<String> = (tiers.iter().map(|(n, _)| (n, false)))
            .chain(per_tenant.iter().map(|(n, _)| (n, true)))
            .filter(|&(name, per_tenant)| !counted(name, per_tenant))
            .map(|(name, _)| name.clone())
            .collect();
        if !unknown.is_empty() {
            return Err(unknown);
        }
        let shown = |n: usize| {
            if n == UNBOUNDED {
                "none".to_owned()
            } else {
                n.to_string()
            }
        };
        let mut changed = Vec::new();
        let mut set = |field: String, slot: &AtomicUsize, to: usize| {
            let from = slot.swap(to, Ordering::AcqRel);
            if from != to {
                changed.push(format!("{field}: {} -> {}", shown(from), shown(to)));
            }
        };
        set(
            "server.max_pending_requests".into(),
            &self.server.limit,
            limit,
        );
        let find = |list: &[(String, usize)], name: &str| {
            list.iter()
                .find(|(n, _)| n == name)
                .map_or(UNBOUNDED, |&(_, l)| l)
        };
        for t in tier_bounds.iter() {
            if let Some(b) = &t.bound {
                let field = format!("tiers.{}.max_pending_requests", t.name);
                set(field, &b.limit, find(tiers, &t.name));
            }
            if let Some(b) = &t.per_tenant {
                let field = format!("tiers.{}.max_pending_per_tenant", t.name);
                set(field, &b.limit, find(per_tenant, &t.name));
            }
        }
        Ok(changed)
    }

    /// Choices in flight in all.
    pub(crate) fn in_flight(&self) -> usize {
        self.server.in_flight.load(Ordering::Acquire)
    }

    /// The server's count, for guards made outside [`Admission::admit`] (tests).
    #[cfg(test)]
    pub(crate) fn counter(&self) -> Arc<AtomicUsize> {
        self.server.in_flight.clone()
    }

    /// Takes the seats of a request of `tier` (one per choice), all or none. Refused as
    /// [`SubmitErrorKind::TooManyChoices`] when it has more choices than its tier's bound or
    /// the server's ever admits, as [`SubmitErrorKind::Overloaded`] when its tier, or the
    /// server, has not that many seats free now.
    pub(crate) fn admit(
        &self,
        tier: &str,
        tenant: &str,
        demand: Demand,
    ) -> Result<InFlight, SubmitError> {
        let seats = demand.choices;
        if !self.tiers.read().iter().any(|t| t.name == tier) {
            // A tier not configured (keys without a tier, an open API's default) is counted
            // too, unbounded, so that a reload configuring it counts what is in flight.
            let mut tiers = self.tiers.write();
            if tiers.len() < MAX_COUNTED_TIERS && !tiers.iter().any(|t| t.name == tier) {
                count(&mut tiers, tier.to_owned());
            }
        }
        let tiers = self.tiers.read();
        let tier_entry = tiers.iter().find(|t| t.name == tier);
        let per_tenant = tier_entry.and_then(|t| t.per_tenant.as_ref().map(|b| (t, b)));
        let tier_bound = tier_entry.and_then(|t| t.bound.as_ref().map(|b| (t, b)));
        // Larger than a bound: refused whatever is in flight, before any seat is taken.
        let tier_bounds = [
            per_tenant.map(|(t, b)| (t, "max_pending_per_tenant", b.limit(), &b.too_large)),
            tier_bound.map(|(t, b)| (t, "max_pending_requests", b.limit(), &b.too_large)),
        ];
        for (t, field, limit, too_large) in tier_bounds.into_iter().flatten() {
            if seats <= limit {
                continue;
            }
            if let Some(refused) = too_large.hit(Instant::now()) {
                tracing::warn!(
                    tier = %t.name,
                    limit,
                    refused,
                    "requests refused (400): more choices than their tier's tiers.<name>.{field} \
                     ever admits"
                );
            }
            return Err(too_many_choices(
                demand,
                &format!("tiers.{}.{field}", t.name),
                limit,
            ));
        }
        if seats > self.server.limit() {
            if let Some(refused) = self.server.too_large.hit(Instant::now()) {
                tracing::warn!(
                    limit = self.server.limit(),
                    refused,
                    "requests refused (400): more choices than server.max_pending_requests \
                     ever admits"
                );
            }
            return Err(too_many_choices(
                demand,
                "server.max_pending_requests",
                self.server.limit(),
            ));
        }
        // The tenant's seat, where its tier bounds tenants (its name is copied only then).
        let per_tenant = per_tenant.map(|(t, b)| (t, b, Arc::<str>::from(tenant)));
        if let Some((t, b, tenant)) = &per_tenant {
            if !b.take(tenant, seats) {
                if let Some(refused) = b.full.hit(Instant::now()) {
                    tracing::warn!(
                        tier = %t.name,
                        latest_tenant = %tenant,
                        limit = b.limit(),
                        refused,
                        "requests refused (429): their tenant is at its tier's \
                         tiers.<name>.max_pending_per_tenant (refused counts the tier's \
                         tenants' refusals since the previous such line; latest_tenant is \
                         the one refused now)"
                    );
                }
                return Err(SubmitError::new(
                    SubmitErrorKind::TenantBusy,
                    format!(
                        "tenant `{tenant}` has too many requests in flight for this one's {} \
                         (tiers.{}.max_pending_per_tenant is {}); retry when one ends",
                        demand.describe(),
                        t.name,
                        b.limit()
                    ),
                ));
            }
        }
        let give_back_tenant = || {
            if let Some((_, b, tenant)) = &per_tenant {
                b.give_back(tenant, seats);
            }
        };
        if let Some((t, b)) = tier_bound {
            if !b.take(seats) {
                give_back_tenant();
                if let Some(refused) = b.full.hit(Instant::now()) {
                    tracing::warn!(
                        tier = %t.name,
                        limit = b.limit(),
                        refused,
                        "requests refused as overloaded: their tier is at its \
                         tiers.<name>.max_pending_requests"
                    );
                }
                return Err(SubmitError::new(
                    SubmitErrorKind::Overloaded,
                    format!(
                        "tier `{}` has too many requests in flight for this one's {} \
                         (tiers.{}.max_pending_requests is {}); retry shortly",
                        t.name,
                        demand.describe(),
                        t.name,
                        b.limit()
                    ),
                ));
            }
        }
        if !self.server.take(seats) {
            if let Some((_, b)) = tier_bound {
                b.give_back(seats);
            }
            give_back_tenant();
            if let Some(refused) = self.server.full.hit(Instant::now()) {
                tracing::warn!(
                    limit = self.server.limit(),
                    refused,
                    "requests refused as overloaded: the server is at its \
                     server.max_pending_requests"
                );
            }
            return Err(SubmitError::new(
                SubmitErrorKind::Overloaded,
                format!(
                    "the server has too many requests in flight for this one's {} \
                     (server.max_pending_requests is {}); retry shortly",
                    demand.describe(),
                    self.server.limit()
                ),
            ));
        }
        Ok(InFlight {
            all: self.server.in_flight.clone(),
            tier: tier_bound.map(|(_, b)| b.in_flight.clone()),
            tenant: per_tenant.map(|(_, b, tenant)| (b.clone(), tenant)),
            seats,
        })
    }
}

/// Counts the seats of the tier `name` and of its tenants in `tiers`, bounded or not.
fn count(tiers: &mut Vec<TierBound>, name: String) {
    let i = match tiers.iter().position(|t| t.name == name) {
        Some(i) => i,
        None => {
            tiers.push(TierBound {
                name,
                bound: None,
                per_tenant: None,
            });
            tiers.len() - 1
        }
    };
    let t = &mut tiers[i];
    t.bound.get_or_insert_with(|| Bound::new(UNBOUNDED));
    t.per_tenant
        .get_or_insert_with(|| Arc::new(TenantBound::new(UNBOUNDED)));
}

/// The refusal of a request larger than the bound `name` (of `limit` choices).
/// The field at fault is `n` for a request of one prompt, `prompt` for one of several.
fn too_many_choices(demand: Demand, name: &str, limit: usize) -> SubmitError {
    SubmitError::new(
        SubmitErrorKind::TooManyChoices,
        format!(
            "this request has {} but {name} is {limit}: each choice (prompts × n) counts as a \
             request in flight, so it can never be admitted; send fewer prompts or a smaller n",
            demand.describe()
        ),
    )
    .with_param(if demand.prompts > 1 { "prompt" } else { "n" })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission() -> Admission {
        Admission::new(4, &[("batch".into(), 2)], &[])
    }

    /// A request of one prompt and one choice.
    const ONE: Demand = Demand {
        prompts: 1,
        choices: 1,
    };

    fn prompts(prompts: usize) -> Demand {
        Demand {
            prompts,
            choices: prompts,
        }
    }

    /// A tier at its bound is refused while the server has room, other tiers are not; the
    /// server's bound holds over every tier; seats come back with the guards.
    #[test]
    fn a_tier_at_its_bound_is_refused_while_others_are_admitted() {
        let a = admission();
        let b1 = a.admit("batch", "t", ONE).unwrap();
        let _b2 = a.admit("batch", "t", ONE).unwrap();
        let e = a.admit("batch", "t", ONE).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::Overloaded);
        assert!(
            e.message
                .contains("(tiers.batch.max_pending_requests is 2); retry shortly"),
            "{e}"
        );
        assert_eq!(a.in_flight(), 2);
        let p1 = a.admit("premium", "t", ONE).unwrap();
        let _p2 = a.admit("premium", "t", ONE).unwrap();
        let e = a.admit("premium", "t", ONE).err().unwrap();
        assert!(e.message.contains("server.max_pending_requests"), "{e}");
        // Refused by the server's bound, the tier's seat is given back too.
        drop(p1);
        drop(b1);
        assert_eq!(a.in_flight(), 2);
        let _b3 = a.admit("batch", "t", ONE).unwrap();
        let _p3 = a.admit("premium", "t", ONE).unwrap();
        assert!(a.admit("batch", "t", ONE).is_err());
        assert_eq!(a.in_flight(), 4);
    }

    /// A request of a bounded tier that the server's bound refuses gives its tier's seat back.
    #[test]
    fn a_refusal_by_the_server_gives_the_tier_seat_back() {
        let a = Admission::new(3, &[("batch".into(), 2)], &[]);
        let p1 = a.admit("premium", "t", ONE).unwrap();
        let p2 = a.admit("premium", "t", ONE).unwrap();
        let _b1 = a.admit("batch", "t", ONE).unwrap();
        let e = a.admit("batch", "t", ONE).err().unwrap();
        assert!(e.message.contains("server.max_pending_requests"), "{e}");
        drop((p1, p2));
        let _b2 = a.admit("batch", "t", ONE).unwrap();
        let e = a.admit("batch", "t", ONE).err().unwrap();
        assert!(e.message.contains("tiers.batch"), "{e}");
    }

    /// A request takes a seat per choice, prompts × n alike: two prompts fill a bound of two
    /// as one prompt with `n = 2` does.
    #[test]
    fn each_choice_takes_a_seat_whether_from_prompts_or_n() {
        let a = Admission::new(2, &[], &[]);
        let two_prompts = a.admit("", "t", prompts(2)).unwrap();
        assert_eq!(a.in_flight(), 2);
        assert_eq!(
            a.admit("", "t", ONE).err().unwrap().kind,
            SubmitErrorKind::Overloaded
        );
        drop(two_prompts);
        let n2 = Demand {
            prompts: 1,
            choices: 2,
        };
        let _n2 = a.admit("", "t", n2).unwrap();
        assert_eq!(a.in_flight(), 2);
        assert_eq!(
            a.admit("", "t", ONE).err().unwrap().kind,
            SubmitErrorKind::Overloaded
        );
    }

    /// A request larger than a bound is refused as never admissible (a 400), naming the bound
    /// and its value, even on an idle server; one that fits but not now is overloaded (a 503).
    #[test]
    fn a_request_larger_than_a_bound_is_refused_as_too_many_choices() {
        let a = Admission::new(1, &[], &[]);
        let e = a.admit("", "t", prompts(2)).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::TooManyChoices);
        assert_eq!(e.param, Some("prompt"));
        assert_eq!(
            e.message,
            "this request has 2 choices (2 prompts × n = 1) but server.max_pending_requests \
             is 1: each choice (prompts × n) counts as a request in flight, so it can never be \
             admitted; send fewer prompts or a smaller n"
        );
        let n2 = Demand {
            prompts: 1,
            choices: 2,
        };
        let e = a.admit("", "t", n2).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::TooManyChoices);
        assert!(e.message.contains("2 choices (n = 2)"), "{e}");
        assert_eq!(e.param, Some("n"));
        assert_eq!(a.in_flight(), 0);

        // A tier's bound, smaller than the server's: its own name and value.
        let a = Admission::new(8, &[("batch".into(), 3)], &[]);
        let e = a.admit("batch", "t", prompts(4)).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::TooManyChoices);
        assert!(
            e.message.contains(
                "4 choices (4 prompts × n = 1) but tiers.batch.max_pending_requests is 3"
            ),
            "{e}"
        );
        // Other tiers take it (the server's bound is 8); larger than the server's: refused.
        let held = a.admit("premium", "t", prompts(4)).unwrap();
        let e = a.admit("premium", "t", prompts(9)).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::TooManyChoices);
        assert!(
            e.message.contains("server.max_pending_requests is 8"),
            "{e}"
        );
        // Fits the bounds, not what is free now: overloaded.
        let e = a.admit("premium", "t", prompts(5)).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::Overloaded);
        assert!(e.message.contains("retry shortly"), "{e}");
        drop(held);
        assert_eq!(a.in_flight(), 0);
    }

    /// Admission is all-or-nothing: a request refused takes no seat (neither the server's nor
    /// its tier's), and one admitted holds all of its seats until every part is dropped.
    #[test]
    fn a_refused_request_holds_no_seat() {
        let a = Admission::new(4, &[("batch".into(), 3)], &[]);
        let _b = a.admit("batch", "t", prompts(2)).unwrap();
        // Two more would take the tier past 3: none of them is taken.
        let e = a.admit("batch", "t", prompts(2)).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::Overloaded);
        assert_eq!(a.in_flight(), 2);
        let _b1 = a.admit("batch", "t", ONE).unwrap();
        drop(_b1);
        // The server has 2 free: a request of 3 takes none of them, nor of its tier's.
        let e = a
            .admit(
                "batch",
                "t",
                Demand {
                    prompts: 1,
                    choices: 3,
                },
            )
            .err()
            .unwrap();
        assert_eq!(e.kind, SubmitErrorKind::Overloaded);
        let p = a.admit("premium", "t", prompts(2)).unwrap();
        assert_eq!(a.in_flight(), 4);
        let e = a.admit("batch", "t", ONE).err().unwrap();
        assert!(e.message.contains("server.max_pending_requests"), "{e}");
        // The tier's seat taken before the server refused is back: one batch request fits
        // once the server has room.
        drop(p);
        let _b2 = a.admit("batch", "t", ONE).unwrap();
        assert_eq!(a.in_flight(), 3);
    }

    /// The guard splits into one per prompt; each gives its own seats back.
    #[test]
    fn split_guards_give_their_seats_back_one_by_one() {
        let a = Admission::new(4, &[("batch".into(), 4)], &[]);
        let mut all = a.admit("batch", "t", prompts(3)).unwrap();
        let first = all.split_off(1);
        let second = all.split_off(1);
        assert_eq!(a.in_flight(), 3);
        drop(second);
        assert_eq!(a.in_flight(), 2);
        drop(all);
        assert_eq!(a.in_flight(), 1);
        // The tier's count too: 3 more fit in it with `first` held, not 4.
        assert!(a.admit("batch", "t", prompts(4)).is_err());
        let _three = a.admit("batch", "t", prompts(3)).unwrap();
        drop(first);
        assert_eq!(a.in_flight(), 3);
    }

    /// A reload's bounds apply to the requests already in flight, on tiers that had none at
    /// the start as on those that had: a cut refuses until enough end, a raise admits at
    /// once; a tier not counted is refused, changing nothing.
    #[test]
    fn new_bounds_count_what_is_in_flight_and_unknown_tiers_change_nothing() {
        let a = Admission::new(8, &[("batch".into(), 4)], &[])
            .counting(["batch".to_owned(), "free".to_owned()]);
        let batch = (0..3)
            .map(|_| a.admit("batch", "acme", ONE).unwrap())
            .collect::<Vec<_>>();
        let free = (0..3)
            .map(|_| a.admit("free", "acme", ONE).unwrap())
            .collect::<Vec<_>>();
        let changed = a
            .set_limits(
                6,
                &[("batch".into(), 2), ("free".into(), 5)],
                &[("free".into(), 3)],
            )
            .unwrap();
        assert_eq!(
            changed,
            [
                "server.max_pending_requests: 8 -> 6",
                "tiers.batch.max_pending_requests: 4 -> 2",
                "tiers.free.max_pending_requests: none -> 5",
                "tiers.free.max_pending_per_tenant: none -> 3",
            ]
        );
        // batch holds 3 of its new 2, acme 3 of free's 3 per tenant, the server 6 of 6.
        let e = a.admit("batch", "acme", ONE).err().unwrap();
        assert!(
            e.message.contains("tiers.batch.max_pending_requests is 2"),
            "{e}"
        );
        let e = a.admit("free", "acme", ONE).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::TenantBusy);
        let e = a.admit("free", "beta", ONE).err().unwrap();
        assert!(
            e.message.contains("server.max_pending_requests is 6"),
            "{e}"
        );
        drop(batch);
        let _b = [(); 2].map(|_| a.admit("free", "beta", ONE).unwrap());
        let e = a.admit("free", "beta", ONE).err().unwrap();
        assert!(
            e.message.contains("tiers.free.max_pending_requests is 5"),
            "{e}"
        );
        // Bounds removed: only the server's holds.
        let changed = a.set_limits(7, &[], &[]).unwrap();
        assert_eq!(changed.len(), 4, "{changed:?}");
        let _f = a.admit("free", "acme", ONE).unwrap();
        let _g = a.admit("batch", "acme", ONE).unwrap();
        assert_eq!(a.in_flight(), 7);
        // A tier this admission does not count: refused, nothing changed.
        let e = a.set_limits(100, &[("gold".into(), 1)], &[]).unwrap_err();
        assert_eq!(e, ["gold"]);
        assert!(a.admit("premium", "x", ONE).is_err());
        drop(free);
        assert_eq!(a.in_flight(), 4);
    }

    /// A reload's new tier is counted from then on and may be bounded; a removed tier is no
    /// longer bounded, its entry kept while its requests hold seats (so a tier added back
    /// counts them) and dropped once idle.
    #[test]
    fn tiers_added_are_counted_and_removed_ones_unbounded_until_idle() {
        let a = Admission::new(8, &[("batch".into(), 1)], &[("batch".into(), 1)])
            .counting(["batch".to_owned()]);
        let held = a.admit("batch", "acme", ONE).unwrap();
        assert!(a.set_limits(8, &[("gold".into(), 1)], &[]).is_err());
        a.set_tiers(&["gold".to_owned()]);
        let changed = a.set_limits(8, &[("gold".into(), 1)], &[]).unwrap();
        assert_eq!(changed, ["tiers.gold.max_pending_requests: none -> 1"]);
        let _g = a.admit("gold", "acme", ONE).unwrap();
        let e = a.admit("gold", "beta", ONE).err().unwrap();
        assert!(e.message.contains("tiers.gold"), "{e}");
        // batch, removed, bounds nothing: acme's second and third are admitted.
        let more = [(); 2].map(|_| a.admit("batch", "acme", ONE).unwrap());
        assert_eq!(a.tiers.read().len(), 2, "batch kept while it holds seats");
        // Added back while its requests are in flight: they count against its new bound.
        a.set_tiers(&["gold".to_owned(), "batch".to_owned()]);
        a.set_limits(8, &[("batch".into(), 3)], &[]).unwrap();
        let e = a.admit("batch", "beta", ONE).err().unwrap();
        assert!(
            e.message.contains("tiers.batch.max_pending_requests is 3"),
            "{e}"
        );
        a.set_tiers(&["gold".to_owned()]);
        drop((held, more));
        a.set_tiers(&["gold".to_owned()]);
        assert_eq!(a.tiers.read().len(), 1, "batch dropped once idle");
        assert_eq!(a.in_flight(), 1);
    }

    /// A tier name no tier has is counted from its first request, so that a reload that
    /// configures it (a tier named as keys without one send) bounds what is in flight.
    #[test]
    fn a_tier_configured_by_a_reload_counts_its_requests_already_in_flight() {
        let a = Admission::new(8, &[], &[]).counting(["gold".to_owned()]);
        let held = [(); 2].map(|_| a.admit("standard", "acme", ONE).unwrap());
        a.set_tiers(&["gold".to_owned(), "standard".to_owned()]);
        a.set_limits(8, &[("standard".into(), 2)], &[]).unwrap();
        let e = a.admit("standard", "beta", ONE).err().unwrap();
        assert!(
            e.message
                .contains("tiers.standard.max_pending_requests is 2"),
            "{e}"
        );
        drop(held);
        let _again = a.admit("standard", "beta", ONE).unwrap();
    }

    /// A tenant at its tier's per-tenant bound is refused (429) while the tier's other
    /// tenants are admitted; its seats come back with its guards (and its entry goes); a
    /// refusal by the tier or the server afterwards gives the tenant's seats back too.
    #[test]
    fn a_tenant_at_its_bound_is_refused_while_other_tenants_are_admitted() {
        let a = Admission::new(5, &[("free".into(), 4)], &[("free".into(), 2)]);
        let bound = a.tiers.read()[0].per_tenant.clone().unwrap();
        let a1 = a.admit("free", "acme", ONE).unwrap();
        let _a2 = a.admit("free", "acme", ONE).unwrap();
        let e = a.admit("free", "acme", ONE).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::TenantBusy);
        assert!(
            e.message.contains("tenant `acme`")
                && e.message
                    .contains("(tiers.free.max_pending_per_tenant is 2)"),
            "{e}"
        );
        let _b1 = a.admit("free", "beta", ONE).unwrap();
        // Other tiers have no such bound.
        let _p = a.admit("premium", "acme", ONE).unwrap();
        assert_eq!((bound.held("acme"), bound.held("beta")), (2, 1));
        drop(a1);
        assert_eq!(bound.held("acme"), 1);
        let a3 = a.admit("free", "acme", ONE).unwrap();
        // The tier is now full (4): a tenant with room is refused by the tier (503), and
        // keeps no seat it took on the way.
        let _b2 = a.admit("free", "beta", ONE).unwrap();
        let e = a.admit("free", "gamma", ONE).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::Overloaded);
        assert_eq!(bound.held("gamma"), 0);
        assert_eq!(bound.tenants(), 2);
        // The server full (5 seats) refuses with the tier's and the tenant's seats given back.
        drop(a3);
        let _q = a.admit("premium", "x", ONE).unwrap();
        let e = a.admit("free", "gamma", ONE).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::Overloaded);
        assert!(e.message.contains("server.max_pending_requests"), "{e}");
        assert_eq!(bound.held("gamma"), 0);
        assert_eq!(
            a.tiers.read()[0]
                .bound
                .as_ref()
                .unwrap()
                .in_flight
                .load(Ordering::Acquire),
            3
        );
    }

    /// A request with more choices than the per-tenant bound is a 400 naming it; seats split
    /// off a guard come back one prompt at a time, and every entry goes with the last.
    #[test]
    fn per_tenant_seats_count_choices_and_split_with_the_guard() {
        let a = Admission::new(8, &[], &[("free".into(), 3)]);
        let bound = a.tiers.read()[0].per_tenant.clone().unwrap();
        let e = a.admit("free", "acme", prompts(4)).err().unwrap();
        assert_eq!(e.kind, SubmitErrorKind::TooManyChoices);
        assert!(
            e.message.contains("tiers.free.max_pending_per_tenant is 3"),
            "{e}"
        );
        let mut seats = a.admit("free", "acme", prompts(3)).unwrap();
        assert_eq!(bound.held("acme"), 3);
        let first = seats.split_off(1);
        let second = seats.split_off(1);
        drop(first);
        assert_eq!(bound.held("acme"), 2);
        drop(seats);
        assert_eq!(bound.held("acme"), 1);
        drop(second);
        assert_eq!((bound.held("acme"), bound.tenants()), (0, 0));
        assert_eq!(a.in_flight(), 0);
    }
}
