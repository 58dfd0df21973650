//! A spec's `changes` applied in the loop ([`crate::changes`]): at the first step boundary
//! from a change's time, what the server does with it. A policy goes in through
//! `Scheduler::swap_policy`; a SIGHUP puts the file's policy in force and its tiers through
//! `Scheduler::set_tiers` (the scheduler actor's `SetTiers`), with the policy rebuilt for
//! them. The tiers' bounds, rate limits, priorities and targets, and the server's bound on
//! requests in flight, hold for the arrivals from the change's own time on (the server's
//! HTTP layer takes a SIGHUP at once), those arriving during the step it falls in included.

use super::{policy_params, Loop, PolicyRegistry, SchedulerConfig};
use crate::changes::{AppliedChange, Refusal, TimedChange};
use crate::error::SimError;
use crate::slo_params::SloAwareParams;
use crate::spec::{tier_specs, PolicySpec, SimulationSpec, TierConf};
use std::collections::BTreeMap;

/// Checks the resolved `changes` against the simulation as it will run them (the policies'
/// parameters with a calibration's filled in): each policy a change names is built with the
/// tiers in force then, and each change's tiers are taken by the scheduling core
/// (`validate_config`, which `Scheduler::set_tiers` runs, as the server's reload does) and
/// by every policy that may be in force then (those of the spec and the changes so far).
pub(super) fn check_changes(
    spec: &SimulationSpec,
    changes: &[TimedChange],
    scheduler: &SchedulerConfig,
    registry: &PolicyRegistry,
    slo_aware: Option<&(String, SloAwareParams)>,
) -> Result<(), SimError> {
    let mut tiers = scheduler.tiers.clone();
    let mut candidates: Vec<&PolicySpec> = spec.policies.iter().collect();
    for (i, c) in changes.iter().enumerate() {
        let refuse = |field: &str, message: String| {
            spec.change_refused(&Refusal {
                index: Some(i),
                at_s: spec.changes.get(i).map_or(0.0, |c| c.at_s),
                field: field.into(),
                message,
            })
        };
        if let Some(new) = &c.tiers {
            tiers = tier_specs(new);
            let mut config = scheduler.clone();
            config.tiers = tiers.clone();
            switchyard_policies::validate_config(&config).map_err(|e| {
                refuse(
                    "tiers",
                    format!("tiers: the scheduling core refuses them (as the server's): {e}"),
                )
            })?;
        }
        let build = |p: &PolicySpec| {
            let (params, _) = policy_params(p, slo_aware);
            registry.create(&p.name, &params, &tiers).map(drop)
        };
        if let Some(p) = &c.policy {
            build(p).map_err(|e| refuse("policy", format!("policy: {e}")))?;
            candidates.push(p);
        }
        if c.tiers.is_some() {
            for p in &candidates {
                build(p).map_err(|e| {
                    refuse("tiers", crate::changes::policy_refuses_tiers(&p.name, &e))
                })?;
            }
        }
    }
    Ok(())
}

impl Loop<'_> {
    /// Applies the changes made by `now`, at this step boundary (as the server's scheduler
    /// takes a swap before it plans its next step), their front end's part first
    /// ([`Loop::apply_front_changes`]). A SIGHUP puts the file's policy in force (its
    /// `scheduler.policy`, else the file's as it was) and its tiers, if they differ from
    /// those the scheduler runs with as it takes them (`TierSpec`, as the server's reload
    /// compares them): the scheduling core takes them first
    /// (`Scheduler::set_tiers`), then the policy, rebuilt with them, is swapped in, as the
    /// server's `Engine::set_tiers` does. An entry's `policy` (PUT /admin/policy) is made
    /// after its SIGHUP. A policy equal to the one in force, with the tiers unchanged, is
    /// left running (as the server leaves it).
    pub(super) fn apply_changes(&mut self, now: u64) -> Result<(), SimError> {
        self.apply_front_changes(now);
        let (sim, changes) = (self.sim, self.changes);
        while let Some(change) = changes.get(self.next_change).filter(|c| c.at_us <= now) {
            self.next_change += 1;
            let stats = self.sched.stats();
            let mut target = None;
            if change.reload {
                if let Some(p) = change.policy.as_ref().filter(|_| change.policy_in_file) {
                    self.file_policy = p.clone();
                }
                target = Some(&self.file_policy);
            }
            if let Some(p) = change.policy.as_ref().filter(|_| !change.policy_in_file) {
                target = Some(p);
            }
            let target = target.cloned();
            let new_tiers = change.tiers.as_ref().filter(|t| *t != self.sched_tiers);
            // As the server's reload, which compares the tiers as the scheduler takes them
            // (`TierSpec`): settings only the HTTP layer reads (priority, bounds on requests
            // in flight, rate limits, shares of adapter memory) call no `set_tiers` and swap
            // no policy.
            let new_specs = new_tiers
                .map(tier_specs)
                .filter(|s| *s != tier_specs(self.sched_tiers));
            if let Some(tiers) = new_tiers {
                self.sched_tiers = tiers;
            }
            let mut notes = Vec::new();
            let mut swapped = false;
            if let Some(specs) = new_specs {
                let taken = self
                    .sched
                    .set_tiers(specs.clone())
                    .map_err(|e| SimError::Scheduler(e.to_string()))?;
                notes = taken.iter().map(ToString::to_string).collect();
                let p = target.unwrap_or_else(|| self.policy_in_force.clone());
                let (policy, _) = sim.build_policy_with(&p, &specs)?;
                self.sched.swap_policy(policy);
                self.policy_in_force = p;
                swapped = true;
            } else if let Some(p) =
                target.filter(|p| !crate::changes::same_policy(p, &self.policy_in_force))
            {
                let (policy, _) = sim.build_policy_with(&p, &tier_specs(self.sched_tiers))?;
                self.sched.swap_policy(policy);
                self.policy_in_force = p;
                swapped = true;
            }
            self.applied.push(AppliedChange {
                at_s: change.at_us as f64 / 1e6,
                applied_s: now as f64 / 1e6,
                what: change.what.clone(),
                swapped,
                policy: self.policy_in_force.name.clone(),
                waiting: stats.num_waiting as u64,
                running: stats.num_running as u64,
                tiers: new_tiers.cloned(),
                notes,
            });
        }
        Ok(())
    }

    /// Makes the front end's part of the changes made by `t` (an arrival's time, or a step
    /// boundary), each at its own time, as the server's HTTP layer and engine handle take a
    /// SIGHUP at once, before its scheduler takes it at its next step boundary: the tiers'
    /// SLO targets, priorities, rate limits and bounds on requests in flight, and the
    /// server's bound (`server.max_pending_requests`), hold for the requests arriving from
    /// the change's time on, those arriving during the step it falls in included.
    pub(super) fn apply_front_changes(&mut self, t: u64) {
        let changes = self.changes;
        while let Some(change) = changes.get(self.next_front_change).filter(|c| c.at_us <= t) {
            self.next_front_change += 1;
            if let Some(tiers) = change.tiers.as_ref().filter(|t| *t != self.tiers) {
                self.set_rate_limits(tiers, change.at_us);
                self.tiers = tiers;
            }
            if let Some(n) = change.max_pending_requests {
                self.max_pending = Some(n);
            }
        }
    }

    /// Puts the rate limits of `tiers` in force at `now`, as the server's rate limiter takes
    /// a reload's (`RateLimiter::set_limits` in the API crate): each tenant's budget of a tier
    /// still limited keeps what it used (`TenantBudget::set_limits`: a raise frees room at
    /// once, a cut below what was used refuses until the excess has refilled), a tier newly
    /// limited starts its tenants full, and the budgets of a tier no longer limited are
    /// dropped; requests admitted before keep charging the budget they were admitted under.
    fn set_rate_limits(&mut self, tiers: &BTreeMap<String, TierConf>, now: u64) {
        let now_s = now as f64 / 1e6;
        let (old, budgets) = (self.tiers, &mut self.budgets);
        self.budget_index.retain(|(tier, _), b| {
            let Some(limits) = tiers
                .get(tier)
                .map(TierConf::rate_limits)
                .filter(|l| l.any())
            else {
                return false;
            };
            if old.get(tier).map(TierConf::rate_limits) != Some(limits) {
                budgets[*b].set_limits(limits, now_s);
            }
            true
        });
    }
}
