//! The `Policy` trait, its built-in plugins and the registry that builds them by name.
//!
//! A policy never touches blocks or queues. It answers four orthogonal questions and the
//! core enforces every budget and invariant around the answers:
//!
//! * [`Policy::rank`]: the order of service. Running sequences get the step's token budget
//!   and blocks in rank order and are preempted in reverse rank order; waiting sequences are
//!   admitted in rank order. Ties break by arrival, then id, so plans are deterministic.
//! * [`Policy::may_preempt`]: whether a waiting sequence may evict a running one that ranks
//!   after it when admission is blocked by `max_num_seqs` or by KV blocks (vLLM #40004).
//! * [`Policy::token_budget`]: this step's token budget, which sizes prefill chunks.
//! * [`Policy::observe`]: arrivals, served tokens and departures, for stateful policies.
//!
//! A policy that orders by what the prefix cache holds asks for it with
//! [`Policy::prefix_lookups`]: before it ranks the waiting queue, the planner then looks up
//! the longest cached prefix of that many waiting sequences (the earliest arrivals) and hands
//! it over as [`SeqView::cached_prefix_tokens`]. Other policies pay nothing for it.

mod chunked_prefill;
mod fair_share;
mod fcfs;
mod mlfq;
mod params;
mod prefix_aware;
mod priority;
mod slo_aware;

pub use chunked_prefill::ChunkedPrefill;
pub use fair_share::FairShare;
pub use fcfs::Fcfs;
pub use mlfq::Mlfq;
pub use prefix_aware::PrefixAware;
pub use priority::PriorityPolicy;
pub use slo_aware::SloAware;

use crate::error::PolicyError;
use crate::sequence::{SeqView, Sequence};
use crate::types::{TierSpec, Timestamp};

/// Most waiting sequences the planner looks up in the prefix cache per step, whatever
/// [`Policy::prefix_lookups`] asks for: each lookup walks the hash chain (hit length + 1
/// probes), so this bounds a step's extra work when thousands wait.
pub const MAX_PREFIX_LOOKUPS: usize = 4096;

/// A policy's service order for one sequence: lower ranks are served first and preempted
/// last. The core appends (arrival, id) as tie-breakers.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank {
    /// Coarse class (e.g. priority level, or feasible / relegated / best effort).
    pub class: i64,
    /// Order within a class (e.g. slack in microseconds, or a virtual counter).
    pub key: i64,
}

/// What a stateful policy is told about.
#[derive(Copy, Clone, Debug)]
pub enum PolicyEvent<'a> {
    /// A request entered the scheduler (also replayed for every live request after a swap).
    Arrived(SeqView<'a>),
    /// A waiting sequence was admitted while a step was planned (its first chunk is in the
    /// plan; it runs from now on), for the first time or after a preemption.
    Admitted(SeqView<'a>),
    /// A running sequence was preempted by recompute while a step was planned: it waits
    /// again, its computed tokens dropped.
    Preempted(SeqView<'a>),
    /// A step's work on a sequence completed.
    Served {
        /// The sequence after the step.
        seq: SeqView<'a>,
        /// Prompt tokens computed for the first time (recompute is not counted).
        prompt_tokens: usize,
        /// Output tokens generated (0 or 1).
        output_tokens: usize,
    },
    /// A request ended (finished or aborted).
    Departed(SeqView<'a>),
}

/// Read-only facts about the step being planned, for [`Policy::token_budget`].
#[derive(Copy, Clone, Debug)]
pub struct StepContext<'a> {
    /// The planning time.
    pub now: Timestamp,
    /// The configured per-step token limit (the core never exceeds it).
    pub max_num_batched_tokens: usize,
    /// The configured running-sequence limit.
    pub max_num_seqs: usize,
    /// The sequence slab.
    pub(crate) seqs: &'a [Option<Sequence>],
    /// Slots of the running sequences.
    pub(crate) running: &'a [u32],
    /// Slots of the waiting sequences.
    pub(crate) waiting: &'a [u32],
}

impl<'a> StepContext<'a> {
    /// The running sequences, in no particular order.
    pub fn running(&self) -> impl Iterator<Item = SeqView<'a>> + 'a {
        let seqs = self.seqs;
        self.running
            .iter()
            .filter_map(move |&s| seqs.get(s as usize).and_then(|o| o.as_ref()))
            .map(SeqView::new)
    }

    /// The waiting sequences, in no particular order.
    pub fn waiting(&self) -> impl Iterator<Item = SeqView<'a>> + 'a {
        let seqs = self.seqs;
        self.waiting
            .iter()
            .filter_map(move |&s| seqs.get(s as usize).and_then(|o| o.as_ref()))
            .map(SeqView::new)
    }
}

/// A scheduling policy plugin. See the module documentation for the contract.
pub trait Policy: Send {
    /// The registered name.
    fn name(&self) -> &str;

    /// Service order of `seq` at `now` (running and waiting sequences alike).
    fn rank(&self, seq: SeqView<'_>, now: Timestamp) -> Rank;

    /// Whether `waiting` may preempt `running`; the core additionally requires `waiting` to
    /// rank strictly before `running`, so two requests can never evict each other in turn.
    fn may_preempt(&self, _waiting: SeqView<'_>, _running: SeqView<'_>, _now: Timestamp) -> bool {
        false
    }

    /// Tokens to schedule this step; the core clamps it to `1..=max_num_batched_tokens`.
    fn token_budget(&self, ctx: &StepContext<'_>) -> usize {
        ctx.max_num_batched_tokens
    }

    /// Observes arrivals, served work and departures.
    fn observe(&mut self, _event: PolicyEvent<'_>) {}

    /// How many waiting sequences, earliest arrivals first (then lowest id), the planner
    /// looks up in the prefix cache before it ranks the waiting queue, so that [`Policy::rank`]
    /// sees their [`SeqView::cached_prefix_tokens`] and [`SeqView::shares_pending_prefix`];
    /// the rest read `None` and false. The default, 0, looks nothing up. The core clamps it to
    /// [`MAX_PREFIX_LOOKUPS`], and looks nothing up with prefix caching off.
    fn prefix_lookups(&self) -> usize {
        0
    }
}

/// Builds a policy from its YAML parameters and the configured tiers.
pub type PolicyFactory =
    fn(&serde_yaml::Value, &[TierSpec]) -> Result<Box<dyn Policy>, PolicyError>;

/// Policies by name.
#[derive(Clone, Debug, Default)]
pub struct PolicyRegistry {
    /// Registered (name, constructor) pairs, in registration order.
    entries: Vec<(&'static str, PolicyFactory)>,
}

impl PolicyRegistry {
    /// A registry with no policies.
    pub fn empty() -> Self {
        Self::default()
    }

    /// A registry with "fcfs", "priority", "slo-aware", "chunked-prefill", "fair-share",
    /// "prefix-aware" and "mlfq".
    pub fn with_builtins() -> Self {
        let entries: Vec<(&'static str, PolicyFactory)> = vec![
            (fcfs::NAME, fcfs::Fcfs::create),
            (priority::NAME, priority::PriorityPolicy::create),
            (slo_aware::NAME, slo_aware::SloAware::create),
            (
                chunked_prefill::NAME,
                chunked_prefill::ChunkedPrefill::create,
            ),
            (fair_share::NAME, fair_share::FairShare::create),
            (prefix_aware::NAME, prefix_aware::PrefixAware::create),
            (mlfq::NAME, mlfq::Mlfq::create),
        ];
        Self { entries }
    }

    /// Adds a policy; a name can only be registered once.
    pub fn register(
        &mut self,
        name: &'static str,
        factory: PolicyFactory,
    ) -> Result<(), PolicyError> {
        if self.entries.iter().any(|(n, _)| *n == name) {
            return Err(PolicyError::DuplicateName(name.to_string()));
        }
        self.entries.push((name, factory));
        Ok(())
    }

    /// Registered names, in registration order.
    pub fn names(&self) -> Vec<&'static str> {
        self.entries.iter().map(|(n, _)| *n).collect()
    }

    /// Builds the policy `name` with `params` (YAML mapping or null for defaults).
    pub fn create(
        &self,
        name: &str,
        params: &serde_yaml::Value,
        tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        match self.entries.iter().find(|(n, _)| *n == name) {
            Some((_, factory)) => factory(params, tiers),
            None => Err(PolicyError::UnknownPolicy {
                name: name.to_string(),
                did_you_mean: crate::nearest_name::did_you_mean(name, &self.names()),
                known: self.names().join(", "),
            }),
        }
    }
}

#[cfg(test)]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_are_registered_under_their_names() {
        let r = PolicyRegistry::with_builtins();
        assert_eq!(
            r.names(),
            vec![
                "fcfs",
                "priority",
                "slo-aware",
                "chunked-prefill",
                "fair-share",
                "prefix-aware",
                "mlfq"
            ]
        );
        for n in r.names() {
            let p = r.create(n, &serde_yaml::Value::Null, &[]).unwrap();
            assert_eq!(p.name(), n);
        }
    }

    #[test]
    fn every_documented_parameter_is_accepted() {
        // README's "Scheduling policies" table, plus the parameters each `create` documents.
        let cases = [
            ("fcfs", "{}"),
            (
                "priority",
                "{aging_interval_ms: 500, preempt: false, preempted_boost_cap: 2}",
            ),
            ("chunked-prefill", "{token_budget: 64}"),
            (
                "slo-aware",
                "{step_overhead_ms: 2, prefill_us_per_token: 4, min_chunk_tokens: 16, \
                 pace_fraction: 0.5}",
            ),
            (
                "fair-share",
                "{input_weight: 1, output_weight: 3, tenant_weights: {a: 2}}",
            ),
            ("prefix-aware", "{max_wait_ms: 2000, lookup_limit: 64}"),
            (
                "mlfq",
                "{levels: 4, quantum_tokens: 16, prompt_tokens_per_level: 512, \
                 aging_interval_ms: 5000, preempt: false}",
            ),
        ];
        let r = PolicyRegistry::with_builtins();
        assert_eq!(cases.len(), r.names().len(), "a policy has no case");
        for (name, params) in cases {
            let v: serde_yaml::Value = serde_yaml::from_str(params).unwrap();
            match r.create(name, &v, &[]) {
                Ok(p) => assert_eq!(p.name(), name),
                Err(e) => panic!("{name} {params}: {e}"),
            }
        }
    }

    #[test]
    fn unknown_name_lists_known_names() {
        let r = PolicyRegistry::with_builtins();
        let err = r
            .create("lifo", &serde_yaml::Value::Null, &[])
            .err()
            .unwrap();
        let msg = err.to_string();
        assert!(
            msg.contains("lifo") && msg.contains("fcfs") && msg.contains("fair-share"),
            "{msg}"
        );
        assert!(!msg.contains("did you mean"), "{msg}");
        // A near miss is given the name it most likely misspells.
        let msg = r
            .create("slo-awre", &serde_yaml::Value::Null, &[])
            .err()
            .unwrap()
            .to_string();
        assert_eq!(
            msg,
            "unknown scheduling policy `slo-awre` (did you mean `slo-aware`?); known policies: \
             fcfs, priority, slo-aware, chunked-prefill, fair-share, prefix-aware, mlfq"
        );
    }

    #[test]
    fn duplicate_registration_is_refused() {
        let mut r = PolicyRegistry::with_builtins();
        assert_eq!(
            r.register("fcfs", fcfs::Fcfs::create),
            Err(PolicyError::DuplicateName("fcfs".into()))
        );
    }
}
