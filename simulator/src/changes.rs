//! A spec's `changes:`: what an operator changes on a running server, at simulated times,
//! so that a simulation shows the change itself (the queue carried into a new policy, the
//! latencies and SLOs before and after it) and not only each policy on its own.
//!
//! ```yaml
//! changes:
//!   - at_s: 600                 # PUT /admin/policy's body (the server's `scheduler.policy`)
//!     policy: { name: slo-aware, params: { step_overhead_ms: 12 } }
//!   - at_s: 900                 # a SIGHUP: the fields of the server's file it applies
//!     scheduler: { policy: { name: fcfs } }
//!     server: { max_pending_requests: 64 }
//!   - at_s: 1200                # a SIGHUP of a file whose `tiers` section was edited
//!     tiers:
//!       premium: { ttft_ms: 150, tpot_ms: 40, weight: 8, priority: 0 }
//!       standard: { ttft_ms: 1000, tpot_ms: 100, weight: 1, priority: 1 }
//! ```
//!
//! A change is written in the server's own shapes and read by the server's own types
//! (`switchyard_config::PolicySpec`, `SchedulerSection`, `ServerSection`: their field names,
//! ranges and messages; a change's `tiers` as the spec's own `tiers`), and only what the
//! server changes while it runs is accepted: the policy (`PUT /admin/policy`, or
//! `scheduler.policy` on a SIGHUP), `server.max_pending_requests` and `tiers` (a SIGHUP).
//! The other fields are refused, named with the change's time: those that take a restart
//! (`scheduler.max_num_seqs`, `cache.*`, ...), and those the server applies live that a
//! simulation does not model yet (`scheduler.step_timeout_s`, `speculative`,
//! `lora.adapters`).
//!
//! The policy is swapped by `switchyard_policies::Scheduler::swap_policy`, the function the
//! server's scheduler actor calls: no queued request is lost or duplicated, and the new
//! policy is told of every live request in arrival order. A policy equal to the one in force
//! (name and parameters) is left running, as the server leaves it.
//!
//! An entry with `scheduler`, `server` or `tiers` is a SIGHUP, and does what the server's
//! reload does (`src/commands/serve/reload.rs`): it puts the file's policy in force (its
//! `scheduler.policy`, else the file's as the last reload or the start left it), which
//! replaces one set through `PUT /admin/policy` since, as the server's file wins. Its `tiers`
//! are the whole section as the file now has it: a tier left out is removed, one new is
//! added, and the others take their new settings. As the server applies them
//! (`Scheduler::set_tiers`, then the policy in force rebuilt with the new tiers and swapped
//! in, as `Engine::set_tiers` does): requests queued before keep the SLO targets,
//! preemptibility and queue bound they were queued with; the KV bounds
//! (`max_kv_fraction`) count what each tier holds then (a tier over its new bound gets no
//! block until it has given back the excess: the report names it); the bounds on requests
//! in flight (`max_pending_requests`, `max_pending_per_tenant`), the rate limits (a
//! tenant's budget keeps what it used, `TenantBudget::set_limits`), the priorities, the SLO
//! targets and the shares of adapter memory hold for the arrivals from the change's own time
//! on, those arriving during the step it falls in included (the server's HTTP layer takes a
//! SIGHUP at once, its scheduler at the next step boundary). An entry's `policy` (PUT
//! /admin/policy) is made after its SIGHUP. Tiers equal to those in force change nothing,
//! as the server leaves them; tiers that differ only in what the scheduler is not given
//! (priority, bounds on requests in flight, rate limits, shares of adapter memory: not in
//! `TierSpec`, which the server's reload compares) go to the HTTP layer's model alone and
//! leave the policy running, as the server leaves it.
//!
//! A request is judged by the SLO targets of its tier when it arrived (those the scheduler
//! queued it with), wherever it finished: each phase's per-tier attainment is against the
//! targets in force in that phase ([`crate::phases`]).

use crate::spec::{PolicySpec, TierConf};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most changes in one spec.
pub const MAX_CHANGES: usize = 64;

/// One entry of `changes:`, as written.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChangeSpec {
    /// When the change is made, in the simulation's seconds (the requests' `arrival_s`, once
    /// the workload is shaped): it takes effect at the first step boundary from then on, as
    /// the server's scheduler takes a swap between two steps.
    pub at_s: f64,
    /// A policy swap through the admin API: `PUT /admin/policy`'s body, `{name, params}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<switchyard_config::PolicySpec>,
    /// A reload's `scheduler:` section (SIGHUP): only `policy` is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduler: Option<serde_yaml::Value>,
    /// A reload's `server:` section (SIGHUP): only `max_pending_requests` is applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<serde_yaml::Value>,
    /// A reload's `tiers:` section (SIGHUP): the whole section as the file now has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiers: Option<BTreeMap<String, TierConf>>,
    /// Any other field, refused by [`validate`] with the change's time.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_yaml::Value>,
}

/// A change resolved for the loop.
#[derive(Clone, Debug, PartialEq)]
pub struct TimedChange {
    /// When, in microseconds of the simulation's clock.
    pub at_us: u64,
    /// The policy it names, if any: `policy` (PUT /admin/policy) or `scheduler.policy` (a
    /// SIGHUP's, then the file's).
    pub policy: Option<PolicySpec>,
    /// Whether `policy` is `scheduler.policy`, the file's.
    pub policy_in_file: bool,
    /// Whether the change is a SIGHUP (it sets `scheduler`, `server` or `tiers`): the file's
    /// policy is put in force.
    pub reload: bool,
    /// The server's bound on requests in flight (`server.max_pending_requests`), if the
    /// change sets one.
    pub max_pending_requests: Option<usize>,
    /// The tiers the change puts in force (the whole section), if it sets them.
    pub tiers: Option<BTreeMap<String, TierConf>>,
    /// What the change does, for reports: `policy slo-aware`,
    /// `server.max_pending_requests 64`, `tiers premium.ttft_ms 200 -> 150`.
    pub what: String,
}

/// What a phase's change found and did, recorded by the loop when it applied it.
#[derive(Clone, Debug, PartialEq)]
pub struct AppliedChange {
    /// The change's time, in seconds.
    pub at_s: f64,
    /// When it took effect: the first step boundary from `at_s` on, in seconds.
    pub applied_s: f64,
    /// What it does ([`TimedChange::what`]).
    pub what: String,
    /// Whether it swapped the policy: for another one, or the one in force rebuilt with new
    /// tiers (`false`: it set none, or the one in force with the tiers unchanged).
    pub swapped: bool,
    /// The policy in force from then on (its name).
    pub policy: String,
    /// Requests in the scheduler's queue then.
    pub waiting: u64,
    /// Requests running then.
    pub running: u64,
    /// The tiers in force from then on, when the change set new ones.
    pub tiers: Option<BTreeMap<String, TierConf>>,
    /// How the tiers' new KV bounds took where not as asked
    /// (`switchyard_policies::tier_quota::QuotaChange`, the server's warnings).
    pub notes: Vec<String>,
}

/// A change refused: its index, the field of the entry it names (`tiers.gold.weight`,
/// `server`; empty for the entry), and why, without the `changes[i] (at_s T): ` that
/// [`Refusal`]'s `Display` puts before it.
#[derive(Clone, Debug, PartialEq)]
pub struct Refusal {
    /// The entry of `changes` (`None`: the list as a whole).
    pub index: Option<usize>,
    /// Its `at_s`.
    pub at_s: f64,
    /// The field of the entry the refusal is about, dotted (empty: the entry).
    pub field: String,
    /// Why.
    pub message: String,
}

impl Refusal {
    fn of(i: usize, c: &ChangeSpec, field: &str, message: impl Into<String>) -> Self {
        Self {
            index: Some(i),
            at_s: c.at_s,
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// The line of `text` (the spec) where the refused field is written, or its entry, or
    /// `changes` (`None` where the YAML's layout hides it, e.g. a flow list over several
    /// lines).
    pub fn line(&self, text: &str) -> Option<usize> {
        let Some(i) = self.index else {
            return switchyard_config::locate(text, "changes");
        };
        let entry = format!("changes[{i}]");
        let mut paths = Vec::new();
        // The field, then each enclosing one (`tiers.gold.weight`, `tiers.gold`, `tiers`).
        let mut field = self.field.as_str();
        while !field.is_empty() {
            paths.push(format!("{entry}.{field}"));
            field = field.rsplit_once('.').map_or("", |(head, _)| head);
        }
        paths.push(entry);
        paths.push("changes".into());
        paths
            .iter()
            .find_map(|p| switchyard_config::locate(text, p))
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.index {
            Some(i) => write!(f, "changes[{i}] (at_s {}): {}", self.at_s, self.message),
            None => write!(f, "{}", self.message),
        }
    }
}

/// The server's configuration sections a change may not set, with why.
fn refused_section(key: &str) -> Option<&'static str> {
    Some(match key {
        "speculative" => {
            "the server changes speculative decoding through PUT /admin/speculative, but a \
             simulation does not change it during a run (yet)"
        }
        "lora" => {
            "a SIGHUP applies lora.adapters and nothing else of `lora`, and a simulation's \
             adapters (scheduler.lora_memory) do not change during a run"
        }
        "model" | "cache" | "logging" => {
            "takes a restart of the server (a SIGHUP leaves it and names it in a warning)"
        }
        _ => return None,
    })
}

/// Checks the changes as written: at most [`MAX_CHANGES`], times finite, non-negative and
/// increasing, each setting something the server changes while it runs (read by the
/// server's own types) and nothing else, a change's `tiers` as the spec's `tiers` are
/// checked. Every policy that may be in force from a change on (those of `policies`, the
/// spec's, and those the changes name up to it) is built with the tiers in force then, as the
/// server builds its policy with a reload's tiers and refuses the reload where it cannot.
/// Whether the times lie within the workload, and its requests name tiers in force at their
/// arrival, is checked once it is loaded ([`check_workload`]).
pub fn validate(
    changes: &[ChangeSpec],
    tiers: &BTreeMap<String, TierConf>,
    policies: &[PolicySpec],
) -> Result<(), Refusal> {
    if changes.len() > MAX_CHANGES {
        return Err(Refusal {
            index: None,
            at_s: 0.0,
            field: String::new(),
            message: format!("changes: {} changes, at most {MAX_CHANGES}", changes.len()),
        });
    }
    let registry = switchyard_policies::PolicyRegistry::with_builtins();
    let mut in_force = crate::spec::tier_specs(tiers);
    let mut candidates: Vec<PolicySpec> = policies.to_vec();
    for (i, c) in changes.iter().enumerate() {
        let refuse = |field: &str, m: String| Refusal::of(i, c, field, m);
        if !c.at_s.is_finite() || c.at_s < 0.0 || c.at_s > crate::trace::MAX_ARRIVAL_S {
            return Err(refuse(
                "at_s",
                format!(
                    "at_s must be a time in 0..={} seconds",
                    crate::trace::MAX_ARRIVAL_S
                ),
            ));
        }
        if let Some(before) = i.checked_sub(1).map(|j| &changes[j]) {
            if c.at_s <= before.at_s {
                return Err(refuse(
                    "at_s",
                    format!(
                        "at_s must be later than changes[{}]'s ({}): give the changes in \
                         increasing order of time, one entry per time",
                        i - 1,
                        before.at_s
                    ),
                ));
            }
        }
        if let Some(key) = c.other.keys().next() {
            return Err(refuse(
                key,
                match refused_section(key) {
                    Some(why) => format!("{key}: {why}"),
                    None => format!(
                        "unknown field `{key}`: a change sets `policy` (PUT /admin/policy's \
                         body), or the parts of the server's file a SIGHUP applies that a \
                         simulation models: `scheduler: {{policy: ...}}`, `server: \
                         {{max_pending_requests: N}}`, `tiers: {{...}}`"
                    ),
                },
            ));
        }
        let policy = resolve(c).map_err(|(field, m)| refuse(&field, m))?.policy;
        if let Some(new) = &c.tiers {
            crate::spec::validate_tiers(new).map_err(|m| {
                // The messages start with the field they are about (`tiers.gold.weight`).
                let field = m
                    .split([' ', ':'])
                    .next()
                    .filter(|f| f.starts_with("tiers"))
                    .unwrap_or("tiers")
                    .to_string();
                refuse(&field, m)
            })?;
            in_force = crate::spec::tier_specs(new);
        }
        if let Some(p) = policy {
            registry
                .create(&p.name, &p.params, &in_force)
                .map_err(|e| refuse("policy", format!("policy: {e}")))?;
            candidates.push(p);
        }
        if c.tiers.is_some() {
            for p in &candidates {
                registry
                    .create(&p.name, &p.params, &in_force)
                    .map_err(|e| refuse("tiers", policy_refuses_tiers(&p.name, &e)))?;
            }
        }
    }
    Ok(())
}

/// The refusal of a change's tiers by a policy that may be in force when it comes (`name`,
/// refusing with `e`), at the spec's check and at the run's.
pub(crate) fn policy_refuses_tiers(name: &str, e: &dyn std::fmt::Display) -> String {
    format!(
        "tiers: policy `{name}`, which may be in force then, is rebuilt with the new tiers (as a \
         SIGHUP rebuilds the server's) and refuses them: {e}"
    )
}

/// The fields of the mapping `section` (read as the server's section `T`, named `name`) that
/// are not in `live`: the first is refused with `why`. Errors name their field.
fn read_section<T: serde::de::DeserializeOwned>(
    section: &serde_yaml::Value,
    name: &str,
    live: &[&str],
    why: impl Fn(&str) -> String,
) -> Result<T, (String, String)> {
    let serde_yaml::Value::Mapping(m) = section else {
        return Err((
            name.into(),
            format!("{name}: a mapping of the server's `{name}` fields"),
        ));
    };
    let value: T = serde_yaml::from_value(section.clone()).map_err(|e| {
        (
            name.to_string(),
            format!(
                "{name}: {}",
                switchyard_config::with_did_you_mean(&e.to_string())
            ),
        )
    })?;
    for key in m.keys() {
        let key = key.as_str().unwrap_or_default();
        if !live.contains(&key) {
            return Err((
                format!("{name}.{key}"),
                format!("{name}.{key}: {}", why(key)),
            ));
        }
    }
    Ok(value)
}

/// Reads change `c` with the server's types: its policy (`policy`, or a reload's
/// `scheduler.policy`), bound on requests in flight and tiers (`what` says nothing of the
/// tiers yet: [`timed`] compares them with those in force). Errors name their field.
fn resolve(c: &ChangeSpec) -> Result<TimedChange, (String, String)> {
    let restart = |_: &str| {
        "takes a restart of the server: a SIGHUP does not apply it (it names it in a warning) \
         and PUT /admin/policy changes only the policy"
            .to_string()
    };
    let scheduler = match &c.scheduler {
        Some(s) => Some(read_section::<switchyard_config::SchedulerSection>(
            s,
            "scheduler",
            &["policy"],
            |key| match key {
                "step_timeout_s" => "a SIGHUP applies it, but simulated steps never stall, so \
                                     it would change nothing here"
                    .to_string(),
                key => restart(key),
            },
        )?),
        None => None,
    };
    let server = match &c.server {
        Some(s) => Some(read_section::<switchyard_config::ServerSection>(
            s,
            "server",
            &["max_pending_requests"],
            |key| match key {
                "api_keys" | "api_keys_file" | "tls" => "a SIGHUP applies it, but a \
                                                         simulation has no HTTP layer to \
                                                         change"
                    .to_string(),
                key => restart(key),
            },
        )?),
        None => None,
    };
    let policy_in_file = scheduler.is_some();
    let policy = match (&c.policy, scheduler) {
        (Some(_), Some(_)) => {
            return Err((
                String::new(),
                "set the policy once: `policy` (PUT /admin/policy) or `scheduler.policy` (a \
                 SIGHUP), not both"
                    .into(),
            ))
        }
        (Some(p), None) => Some(p.clone()),
        (None, Some(s)) => Some(s.policy),
        (None, None) => None,
    };
    let max_pending_requests = server.map(|s| s.max_pending_requests);
    let mut what = Vec::new();
    if let Some(p) = &policy {
        what.push(format!("policy {}", describe_policy(p)));
    }
    if let Some(n) = max_pending_requests {
        what.push(format!("server.max_pending_requests {n}"));
    }
    if what.is_empty() && c.tiers.is_none() {
        return Err((
            String::new(),
            "changes nothing: set `policy`, `scheduler.policy`, `server.max_pending_requests` \
             or `tiers`"
                .into(),
        ));
    }
    Ok(TimedChange {
        // Checked within the clock's range by `validate`.
        at_us: switchyard_policies::Timestamp::from_secs_f64(c.at_s).0,
        policy: policy.map(|p| PolicySpec {
            name: p.name,
            label: None,
            params: p.params,
        }),
        policy_in_file,
        reload: c.scheduler.is_some() || c.server.is_some() || c.tiers.is_some(),
        max_pending_requests,
        tiers: c.tiers.clone(),
        what: what.join(", "),
    })
}

/// `slo-aware`, or `priority {"aging_interval_ms":60000}` with parameters.
fn describe_policy(p: &switchyard_config::PolicySpec) -> String {
    match &p.params {
        serde_yaml::Value::Null => p.name.clone(),
        serde_yaml::Value::Mapping(m) if m.is_empty() => p.name.clone(),
        params => match serde_json::to_string(params) {
            Ok(json) => format!("{} {json}", p.name),
            Err(_) => p.name.clone(),
        },
    }
}

/// The differences of the tiers `after` from `before`, as the server's reload logs them:
/// `+gold` (added), `-free` (removed), `premium.ttft_ms 200 -> 150` (`none` for a setting
/// left out); empty when they are equal.
pub fn tier_differences(
    before: &BTreeMap<String, TierConf>,
    after: &BTreeMap<String, TierConf>,
) -> Vec<String> {
    let changed = switchyard_config::tier_field_changes(before, after);
    let mut out = Vec::new();
    for name in after.keys() {
        if !before.contains_key(name) {
            out.push(format!("+{name}"));
            continue;
        }
        out.extend(
            changed
                .iter()
                .filter(|c| &c.tier == name)
                .map(|c| format!("{name}.{} {} -> {}", c.field, c.from, c.to)),
        );
    }
    out.extend(
        before
            .keys()
            .filter(|k| !after.contains_key(*k))
            .map(|k| format!("-{k}")),
    );
    out
}

/// The changes resolved for the loop (validated by [`validate`] first), from the spec's
/// `tiers`.
pub fn timed(
    changes: &[ChangeSpec],
    tiers: &BTreeMap<String, TierConf>,
) -> Result<Vec<TimedChange>, Refusal> {
    let mut in_force = tiers;
    let mut out = Vec::with_capacity(changes.len());
    for (i, c) in changes.iter().enumerate() {
        let mut t = resolve(c).map_err(|(field, m)| Refusal::of(i, c, &field, m))?;
        if let Some(new) = &c.tiers {
            let diff = tier_differences(in_force, new);
            let tiers = if diff.is_empty() {
                "tiers unchanged".to_string()
            } else {
                format!("tiers {}", diff.join(", "))
            };
            t.what = [t.what.as_str(), tiers.as_str()]
                .into_iter()
                .filter(|w| !w.is_empty())
                .collect::<Vec<_>>()
                .join(", ");
            in_force = new;
        }
        out.push(t);
    }
    Ok(out)
}

/// Refuses a change after the workload's last arrival, and a request naming a tier not in
/// force at its arrival (one a change removed, or added only later: the server serves no
/// key of a tier its file does not define). `arrivals` are the workload's requests as
/// shaped, (arrival in seconds, tier; "" for none), in any order; `tiers` the spec's. A
/// change after the last arrival would change only how the queue drains, and its phase would
/// have no request of its own.
pub fn check_workload<'r>(
    changes: &[ChangeSpec],
    tiers: &BTreeMap<String, TierConf>,
    arrivals: impl Iterator<Item = (f64, &'r str)> + Clone,
) -> Result<(), Refusal> {
    let last_arrival_s = arrivals.clone().map(|a| a.0).fold(0.0, f64::max);
    check_times(changes, last_arrival_s)?;
    if changes.iter().all(|c| c.tiers.is_none()) {
        return Ok(());
    }
    let bounds: Vec<f64> = changes.iter().map(|c| c.at_s).collect();
    for (arrival_s, tier) in arrivals.filter(|a| !a.1.is_empty()) {
        // The changes made by the arrival (as a phase counts them), and the last of them
        // that set the tiers.
        let made = bounds.partition_point(|&t| t <= arrival_s);
        let set = changes[..made].iter().rposition(|c| c.tiers.is_some());
        let in_force = set.and_then(|j| changes[j].tiers.as_ref()).unwrap_or(tiers);
        if in_force.contains_key(tier) {
            continue;
        }
        let since = match set {
            Some(j) => format!("changes[{j}] (at_s {})'s", changes[j].at_s),
            None => "the spec's".into(),
        };
        // The change that puts it back, or the one that removed it, to be named.
        let (j, field) = match changes[made..]
            .iter()
            .position(|c| c.tiers.as_ref().is_some_and(|t| t.contains_key(tier)))
        {
            Some(k) => (made + k, format!("tiers.{tier}")),
            None => (set.unwrap_or(0), "tiers".to_string()),
        };
        return Err(Refusal::of(
            j,
            &changes[j],
            &field,
            format!(
                "tiers: a request arriving at {arrival_s:.3} s names tier `{tier}`, which {since} \
                 tiers in force then do not define (the server serves no key of a tier its file \
                 does not define): keep the tier in every change's `tiers` while the workload \
                 names it"
            ),
        ));
    }
    Ok(())
}

/// Refuses a change after the workload's last arrival (`last_arrival_s`): it would change
/// only how the queue drains, and its phase would have no request of its own.
pub fn check_times(changes: &[ChangeSpec], last_arrival_s: f64) -> Result<(), Refusal> {
    match changes
        .iter()
        .enumerate()
        .find(|(_, c)| c.at_s > last_arrival_s)
    {
        Some((i, c)) => Err(Refusal::of(
            i,
            c,
            "at_s",
            format!(
                "after the workload's last arrival ({last_arrival_s:.3} s): a change's time \
                 lies within the trace's arrivals as shaped (time_scale, rate or load, limit)"
            ),
        )),
        None => Ok(()),
    }
}

/// Whether `a` and `b` are the same policy with the same parameters, as the server compares
/// a new policy with the one in force ([`switchyard_config::PolicySpec::same_policy`]).
pub fn same_policy(a: &PolicySpec, b: &PolicySpec) -> bool {
    let config = |p: &PolicySpec| switchyard_config::PolicySpec {
        name: p.name.clone(),
        params: p.params.clone(),
    };
    config(a).same_policy(&config(b))
}

#[cfg(test)]
#[path = "changes_tests.rs"]
mod tests;
