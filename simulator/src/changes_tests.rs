//! `changes:` as a spec writes it: what is accepted, and what is refused with the field and
//! the time named.

use super::*;
use crate::spec::SimulationSpec;
use std::path::Path;

/// A spec with tier `gold` and `changes` (YAML flow).
fn parse(changes: &str) -> Result<SimulationSpec, String> {
    let yaml = format!(
        "policies: [{{name: fcfs}}]\ntiers: {{gold: {{ttft_ms: 100}}}}\n\
         workload: {{trace: t.csv, format: azure}}\nchanges: {changes}\n"
    );
    SimulationSpec::from_yaml_str(&yaml, Path::new("s.yaml")).map_err(|e| e.to_string())
}

/// `changes` is refused with a message containing `want`.
fn refused(changes: &str, want: &str) {
    match parse(changes) {
        Ok(_) => panic!("{changes}: accepted"),
        Err(e) => assert!(e.contains(want), "{changes}: {e}\nwanted: {want}"),
    }
}

/// `changes` is accepted and resolves to `(at_us, policy name, max_pending, what)` each.
fn accepted(changes: &str, want: &[(u64, Option<&str>, Option<usize>, &str)]) {
    let spec = parse(changes).unwrap_or_else(|e| panic!("{changes}: {e}"));
    let got = timed(&spec.changes, &spec.tiers).unwrap();
    let got: Vec<(u64, Option<&str>, Option<usize>, &str)> = got
        .iter()
        .map(|c| {
            (
                c.at_us,
                c.policy.as_ref().map(|p| p.name.as_str()),
                c.max_pending_requests,
                c.what.as_str(),
            )
        })
        .collect();
    assert_eq!(got, want, "{changes}");
}

#[test]
fn the_servers_live_changes_are_accepted() {
    accepted("[]", &[]);
    accepted(
        "[{at_s: 600, policy: {name: slo-aware}}, {at_s: 900.5, scheduler: {policy: {name: \
         priority, params: {aging_interval_ms: 60000}}}}, {at_s: 1000, server: \
         {max_pending_requests: 64}}]",
        &[
            (600_000_000, Some("slo-aware"), None, "policy slo-aware"),
            (
                900_500_000,
                Some("priority"),
                None,
                "policy priority {\"aging_interval_ms\":60000}",
            ),
            (
                1_000_000_000,
                None,
                Some(64),
                "server.max_pending_requests 64",
            ),
        ],
    );
    accepted(
        "[{at_s: 0, policy: {name: fcfs, params: {}}, server: {max_pending_requests: 1}}]",
        &[(
            0,
            Some("fcfs"),
            Some(1),
            "policy fcfs, server.max_pending_requests 1",
        )],
    );
}

#[test]
fn times_are_bounded_and_increasing() {
    refused(
        "[{at_s: 10, policy: {name: fcfs}}, {at_s: 5, policy: {name: priority}}]",
        "changes[1] (at_s 5): at_s must be later than changes[0]'s (10)",
    );
    refused(
        "[{at_s: 10, policy: {name: fcfs}}, {at_s: 10, policy: {name: priority}}]",
        "changes[1] (at_s 10): at_s must be later",
    );
    refused(
        "[{at_s: -1, policy: {name: fcfs}}]",
        "changes[0] (at_s -1): at_s must be a time in 0..=",
    );
    refused(
        "[{at_s: .nan, policy: {name: fcfs}}]",
        "at_s must be a time",
    );
    refused(
        "[{at_s: 1e12, policy: {name: fcfs}}]",
        "at_s must be a time",
    );
    refused("[{policy: {name: fcfs}}]", "at_s");
    let many: Vec<String> = (0..=MAX_CHANGES)
        .map(|i| format!("{{at_s: {i}, policy: {{name: fcfs}}}}"))
        .collect();
    refused(
        &format!("[{}]", many.join(", ")),
        "changes: 65 changes, at most 64",
    );
}

#[test]
fn what_takes_a_restart_is_refused_with_its_field_and_time() {
    refused(
        "[{at_s: 900, scheduler: {max_num_seqs: 64}}]",
        "changes[0] (at_s 900): scheduler.max_num_seqs: takes a restart of the server",
    );
    refused(
        "[{at_s: 900, scheduler: {policy: {name: fcfs}, max_num_batched_tokens: 512}}]",
        "changes[0] (at_s 900): scheduler.max_num_batched_tokens: takes a restart",
    );
    refused(
        "[{at_s: 3, cache: {block_size: 32}}]",
        "changes[0] (at_s 3): cache: takes a restart of the server",
    );
    refused(
        "[{at_s: 3, server: {port: 9000}}]",
        "changes[0] (at_s 3): server.port: takes a restart",
    );
}

#[test]
fn live_changes_a_simulation_does_not_model_are_refused_saying_so() {
    refused(
        "[{at_s: 3, scheduler: {step_timeout_s: 10}}]",
        "changes[0] (at_s 3): scheduler.step_timeout_s: a SIGHUP applies it, but simulated \
         steps never stall",
    );
    refused(
        "[{at_s: 3, speculative: {num_speculative_tokens: 2}}]",
        "changes[0] (at_s 3): speculative: the server changes speculative decoding through \
         PUT /admin/speculative",
    );
    refused(
        "[{at_s: 3, server: {api_keys_file: k.yaml}}]",
        "server.api_keys_file: a SIGHUP applies it, but a simulation has no HTTP layer",
    );
}

#[test]
fn the_servers_types_check_the_values() {
    // The server's own ranges and messages.
    refused(
        "[{at_s: 3, server: {max_pending_requests: 0}}]",
        "changes[0] (at_s 3): server: ",
    );
    refused(
        "[{at_s: 3, scheduler: {polcy: {name: fcfs}}}]",
        "changes[0] (at_s 3): scheduler: unknown field `polcy`",
    );
    refused(
        "[{at_s: 3, policy: {name: fcfs, parms: {}}}]",
        "unknown field `parms`",
    );
    refused("[{at_s: 3, scheduler: 4}]", "scheduler: a mapping");
    // The registry's, as PUT /admin/policy answers them.
    refused(
        "[{at_s: 3, policy: {name: lifo}}]",
        "changes[0] (at_s 3): policy: ",
    );
    refused(
        "[{at_s: 3, policy: {name: priority, params: {aging_interval_ms: -5}}}]",
        "changes[0] (at_s 3): policy: ",
    );
}

#[test]
fn a_change_sets_one_policy_and_something() {
    refused(
        "[{at_s: 3, policy: {name: fcfs}, scheduler: {policy: {name: priority}}}]",
        "changes[0] (at_s 3): set the policy once",
    );
    refused("[{at_s: 3}]", "changes[0] (at_s 3): changes nothing");
    refused(
        "[{at_s: 3, polcy: {name: fcfs}}]",
        "changes[0] (at_s 3): unknown field `polcy`: a change sets `policy`",
    );
}

#[test]
fn times_past_the_last_arrival_are_refused() {
    let spec =
        parse("[{at_s: 5, policy: {name: priority}}, {at_s: 12, policy: {name: fcfs}}]").unwrap();
    assert_eq!(check_times(&spec.changes, 12.0), Ok(()));
    let e = check_times(&spec.changes, 11.5).unwrap_err().to_string();
    assert!(
        e.starts_with("changes[1] (at_s 12): after the workload's last arrival (11.500 s)"),
        "{e}"
    );
}

#[test]
fn a_spec_with_changes_round_trips() {
    let spec = parse(
        "[{at_s: 5, policy: {name: priority}}, {at_s: 6, server: {max_pending_requests: 3}}]",
    )
    .unwrap();
    let text = serde_yaml::to_string(&spec).unwrap();
    let again = SimulationSpec::from_yaml_str(&text, Path::new("s.yaml")).unwrap();
    assert_eq!(again.changes, spec.changes);
    // Without changes, the key is not written.
    let none = parse("[]").unwrap();
    assert!(!serde_yaml::to_string(&none).unwrap().contains("changes"));
}

/// `changes` of a spec running `policies` (YAML flow) is refused with a message containing
/// `want`.
fn refused_with(policies: &str, changes: &str, want: &str) {
    let yaml = format!(
        "policies: {policies}\ntiers: {{gold: {{ttft_ms: 100}}}}\n\
         workload: {{trace: t.csv, format: azure}}\nchanges: {changes}\n"
    );
    match SimulationSpec::from_yaml_str(&yaml, Path::new("s.yaml")) {
        Ok(_) => panic!("{changes}: accepted"),
        Err(e) => assert!(
            e.to_string().contains(want),
            "{changes}: {e}\nwanted: {want}"
        ),
    }
}

/// The `what` of each change of `changes`.
fn whats(changes: &str) -> Vec<String> {
    let spec = parse(changes).unwrap_or_else(|e| panic!("{changes}: {e}"));
    timed(&spec.changes, &spec.tiers)
        .unwrap()
        .into_iter()
        .map(|c| c.what)
        .collect()
}

#[test]
fn tiers_are_a_sighups_whole_section_named_by_what_changed() {
    assert_eq!(
        whats(
            "[{at_s: 1, tiers: {gold: {ttft_ms: 50, weight: 2}}}, {at_s: 2, tiers: {gold: \
             {ttft_ms: 50, weight: 2}, free: {max_pending_requests: 4}}}, {at_s: 3, tiers: \
             {free: {max_pending_requests: 4}}}, {at_s: 4, tiers: {free: \
             {max_pending_requests: 4}}}, {at_s: 5, policy: {name: priority}, tiers: {free: \
             {}}}]"
        ),
        [
            "tiers gold.ttft_ms 100.0 -> 50.0, gold.weight 1.0 -> 2.0",
            "tiers +free",
            "tiers -gold",
            "tiers unchanged",
            "policy priority, tiers free.max_pending_requests 4 -> none",
        ]
    );
    let spec =
        parse("[{at_s: 1, tiers: {gold: {}}}, {at_s: 2, server: {max_pending_requests: 3}}]")
            .unwrap();
    let t = timed(&spec.changes, &spec.tiers).unwrap();
    // Both are SIGHUPs (the file's policy is put in force); neither names a policy.
    assert_eq!(
        t.iter()
            .map(|c| (c.reload, c.policy.is_some(), c.tiers.is_some()))
            .collect::<Vec<_>>(),
        [(true, false, true), (true, false, false)]
    );
    let admin = parse("[{at_s: 1, policy: {name: fcfs}}]").unwrap();
    let t = timed(&admin.changes, &admin.tiers).unwrap();
    assert!(!t[0].reload && !t[0].policy_in_file);
}

#[test]
fn a_changes_tiers_are_checked_as_the_specs_are() {
    refused(
        "[{at_s: 3, tiers: {gold: {max_kv_fraction: 0}}}]",
        "changes[0] (at_s 3): tiers.gold.max_kv_fraction 0 outside (0, 1]",
    );
    refused(
        "[{at_s: 3, tiers: {gold: {max_pending_requests: 2, max_pending_per_tenant: 3}}}]",
        "changes[0] (at_s 3): tiers.gold.max_pending_per_tenant 3 exceeds",
    );
    refused(
        "[{at_s: 3, tiers: {gold: {ttft_ms: -1}}}]",
        "changes[0] (at_s 3): tiers.gold: targets must be positive",
    );
    // The fields are the spec's (and the server's): a misspelt one is named.
    refused("[{at_s: 3, tiers: {gold: {tfft_ms: 5}}}]", "tfft_ms");
    refused("[{at_s: 3, tiers: 4}]", "tiers");
}

#[test]
fn a_policy_that_may_be_in_force_must_take_the_new_tiers() {
    // fair-share weighs the tiers: a weight it refuses (the server's range is 0.001..=1e6)
    // refuses the change, whether the policy is the run's or a change's before it.
    let tiny = "tiers: {gold: {weight: 0.00001}}";
    refused_with(
        "[{name: fair-share}]",
        &format!("[{{at_s: 3, {tiny}}}]"),
        "changes[0] (at_s 3): tiers: policy `fair-share`, which may be in force then, is \
         rebuilt with the new tiers",
    );
    refused_with(
        "[{name: fcfs}]",
        &format!("[{{at_s: 2, policy: {{name: fair-share}}}}, {{at_s: 3, {tiny}}}]"),
        "changes[1] (at_s 3): tiers: policy `fair-share`",
    );
    // A policy named after the tiers changed is built with them.
    refused_with(
        "[{name: fcfs}]",
        &format!("[{{at_s: 2, {tiny}}}, {{at_s: 3, policy: {{name: fair-share}}}}]"),
        "changes[1] (at_s 3): policy: ",
    );
}

#[test]
fn a_refused_change_is_named_at_its_line() {
    let yaml = "policies: [{name: fcfs}]\ntiers: {gold: {ttft_ms: 100}}\n\
                workload: {trace: t.csv, format: azure}\nchanges:\n  - at_s: 1\n    \
                policy: {name: priority}\n  - at_s: 2\n    tiers:\n      gold:\n        \
                ttft_ms: 50\n        max_kv_fraction: 2\n  - at_s: 3\n    \
                scheduler: {max_num_seqs: 4}\n";
    let err = |yaml: &str| {
        SimulationSpec::from_yaml_str(yaml, Path::new("s.yaml"))
            .unwrap_err()
            .to_string()
    };
    assert!(
        err(yaml).starts_with("s.yaml:11: changes[1] (at_s 2): tiers.gold.max_kv_fraction 2"),
        "{}",
        err(yaml)
    );
    let fixed = yaml.replace("max_kv_fraction: 2", "max_kv_fraction: 0.5");
    assert!(
        err(&fixed)
            .starts_with("s.yaml:13: changes[2] (at_s 3): scheduler.max_num_seqs: takes a restart"),
        "{}",
        err(&fixed)
    );
    let unordered = fixed.replace("at_s: 3", "at_s: 0.5");
    assert!(
        err(&unordered).starts_with("s.yaml:12: changes[2] (at_s 0.5): at_s must be later"),
        "{}",
        err(&unordered)
    );
    // A flow list over one line: the line of `changes`.
    let flow = "policies: [{name: fcfs}]\nworkload: {trace: t.csv, format: azure}\n\
                changes: [{at_s: 1, cache: {block_size: 32}}]\n";
    assert!(err(flow).starts_with("s.yaml:3: changes[0] (at_s 1): cache: takes a restart"));
}

#[test]
fn requests_must_name_a_tier_in_force_at_their_arrival() {
    let spec = parse(
        "[{at_s: 2, tiers: {gold: {}, free: {}}}, {at_s: 4, tiers: {free: {}}}, {at_s: 6, \
         policy: {name: priority}}]",
    )
    .unwrap();
    let check = |arrivals: &[(f64, &str)]| {
        check_workload(&spec.changes, &spec.tiers, arrivals.iter().copied())
            .map_err(|r| r.to_string())
    };
    assert_eq!(
        check(&[
            (0.0, "gold"),
            (2.0, "free"),
            (3.9, "gold"),
            (4.0, ""),
            (6.0, "free")
        ]),
        Ok(())
    );
    let e = check(&[(1.9, "free"), (6.0, "free")]).unwrap_err();
    assert!(
        e.starts_with(
            "changes[0] (at_s 2): tiers: a request arriving at 1.900 s names tier `free`, \
             which the spec's tiers in force then do not define"
        ),
        "{e}"
    );
    let e = check(&[(4.0, "gold"), (6.0, "free")]).unwrap_err();
    assert!(
        e.starts_with(
            "changes[1] (at_s 4): tiers: a request arriving at 4.000 s names tier `gold`, \
             which changes[1] (at_s 4)'s tiers"
        ),
        "{e}"
    );
    // The time check comes first, in its own words.
    let e = check(&[(0.0, "gold"), (5.0, "free")]).unwrap_err();
    assert!(
        e.starts_with("changes[2] (at_s 6): after the workload's last arrival"),
        "{e}"
    );
}
