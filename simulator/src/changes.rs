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
//! ```
//!
//! A change is written in the server's own shapes and read by the server's own types
//! (`switchyard_config::PolicySpec`, `SchedulerSection`, `ServerSection`: their field names,
//! ranges and messages), and only what the server changes while it runs is accepted: the
//! policy (`PUT /admin/policy`, or `scheduler.policy` on a SIGHUP) and
//! `server.max_pending_requests` (a SIGHUP). The other fields are refused, named with the
//! change's time: those that take a restart (`scheduler.max_num_seqs`, `cache.*`, ...), and
//! those the server applies live that a simulation does not model yet (`tiers`,
//! `scheduler.step_timeout_s`, `speculative`, `lora.adapters`).
//!
//! The policy is swapped by `switchyard_policies::Scheduler::swap_policy`, the function the
//! server's scheduler actor calls: no queued request is lost or duplicated, and the new
//! policy is told of every live request in arrival order. A policy equal to the one in force
//! (name and parameters) is left running, as the server leaves it.

use crate::spec::PolicySpec;
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
    /// Any other field, refused by [`validate`] with the change's time.
    #[serde(flatten)]
    pub other: BTreeMap<String, serde_yaml::Value>,
}

/// A change resolved for the loop.
#[derive(Clone, Debug, PartialEq)]
pub struct TimedChange {
    /// When, in microseconds of the simulation's clock.
    pub at_us: u64,
    /// The policy to put in force, if the change sets one.
    pub policy: Option<PolicySpec>,
    /// The server's bound on requests in flight (`server.max_pending_requests`), if the
    /// change sets one.
    pub max_pending_requests: Option<usize>,
    /// What the change does, for reports: `policy slo-aware`,
    /// `server.max_pending_requests 64`.
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
    /// Whether it swapped the policy (`false`: it set none, or the one in force).
    pub swapped: bool,
    /// The policy in force from then on (its name).
    pub policy: String,
    /// Requests in the scheduler's queue then.
    pub waiting: u64,
    /// Requests running then.
    pub running: u64,
}

/// `changes[i] (at_s T): ` before a message.
fn at(i: usize, c: &ChangeSpec) -> String {
    format!("changes[{i}] (at_s {}): ", c.at_s)
}

/// The server's configuration sections a change may not set, with why.
fn refused_section(key: &str) -> Option<&'static str> {
    Some(match key {
        "tiers" => {
            "the server applies new tiers on a SIGHUP, but a simulation does not change its \
             tiers during a run (yet): run one simulation per tiers section"
        }
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
/// server's own types) and nothing else; `tiers` are the spec's, which a policy is built
/// with. Whether the times lie within the workload is checked once it is loaded
/// ([`check_times`]).
pub fn validate(
    changes: &[ChangeSpec],
    tiers: &[switchyard_policies::TierSpec],
) -> Result<(), String> {
    if changes.len() > MAX_CHANGES {
        return Err(format!(
            "changes: {} changes, at most {MAX_CHANGES}",
            changes.len()
        ));
    }
    let registry = switchyard_policies::PolicyRegistry::with_builtins();
    for (i, c) in changes.iter().enumerate() {
        let at = at(i, c);
        if !c.at_s.is_finite() || c.at_s < 0.0 || c.at_s > crate::trace::MAX_ARRIVAL_S {
            return Err(format!(
                "{at}at_s must be a time in 0..={} seconds",
                crate::trace::MAX_ARRIVAL_S
            ));
        }
        if let Some(before) = i.checked_sub(1).map(|j| &changes[j]) {
            if c.at_s <= before.at_s {
                return Err(format!(
                    "{at}at_s must be later than changes[{}]'s ({}): give the changes in \
                     increasing order of time, one entry per time",
                    i - 1,
                    before.at_s
                ));
            }
        }
        if let Some(key) = c.other.keys().next() {
            return Err(match refused_section(key) {
                Some(why) => format!("{at}{key}: {why}"),
                None => format!(
                    "{at}unknown field `{key}`: a change sets `policy` (PUT /admin/policy's \
                     body), or the parts of the server's file a SIGHUP applies that a \
                     simulation models: `scheduler: {{policy: ...}}`, `server: \
                     {{max_pending_requests: N}}`"
                ),
            });
        }
        let policy = resolve(c).map_err(|m| format!("{at}{m}"))?.policy;
        if let Some(p) = policy {
            registry
                .create(&p.name, &p.params, tiers)
                .map_err(|e| format!("{at}policy: {e}"))?;
        }
    }
    Ok(())
}

/// The fields of the mapping `section` (read as the server's section `T`, named `name`) that
/// are not in `live`: the first is refused with `why`.
fn read_section<T: serde::de::DeserializeOwned>(
    section: &serde_yaml::Value,
    name: &str,
    live: &[&str],
    why: impl Fn(&str) -> String,
) -> Result<T, String> {
    let serde_yaml::Value::Mapping(m) = section else {
        return Err(format!("{name}: a mapping of the server's `{name}` fields"));
    };
    let value: T = serde_yaml::from_value(section.clone()).map_err(|e| {
        format!(
            "{name}: {}",
            switchyard_config::with_did_you_mean(&e.to_string())
        )
    })?;
    for key in m.keys() {
        let key = key.as_str().unwrap_or_default();
        if !live.contains(&key) {
            return Err(format!("{name}.{key}: {}", why(key)));
        }
    }
    Ok(value)
}

/// Reads change `c` with the server's types: its policy (`policy`, or a reload's
/// `scheduler.policy`) and bound on requests in flight.
fn resolve(c: &ChangeSpec) -> Result<TimedChange, String> {
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
    let policy = match (&c.policy, scheduler) {
        (Some(_), Some(_)) => {
            return Err("set the policy once: `policy` (PUT /admin/policy) or \
                        `scheduler.policy` (a SIGHUP), not both"
                .into())
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
    if what.is_empty() {
        return Err("changes nothing: set `policy`, `scheduler.policy` or \
                    `server.max_pending_requests`"
            .into());
    }
    Ok(TimedChange {
        // Checked within the clock's range by `validate`.
        at_us: (c.at_s * 1e6).round() as u64,
        policy: policy.map(|p| PolicySpec {
            name: p.name,
            label: None,
            params: p.params,
        }),
        max_pending_requests,
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

/// The changes resolved for the loop (validated by [`validate`] first).
pub fn timed(changes: &[ChangeSpec]) -> Result<Vec<TimedChange>, String> {
    changes
        .iter()
        .enumerate()
        .map(|(i, c)| resolve(c).map_err(|m| format!("{}{m}", at(i, c))))
        .collect()
}

/// Refuses a change after the workload's last arrival (`last_arrival_s`): it would change
/// only how the queue drains, and its phase would have no request of its own.
pub fn check_times(changes: &[ChangeSpec], last_arrival_s: f64) -> Result<(), String> {
    match changes
        .iter()
        .enumerate()
        .find(|(_, c)| c.at_s > last_arrival_s)
    {
        Some((i, c)) => Err(format!(
            "{}after the workload's last arrival ({last_arrival_s:.3} s): a change's time \
             lies within the trace's arrivals as shaped (time_scale, rate or load, limit)",
            at(i, c)
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
