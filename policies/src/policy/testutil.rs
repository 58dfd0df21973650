//! Hand-made sequences, requests and steps for the policies' and the planner's unit tests.

use std::sync::Arc;

use crate::sequence::Sequence;
use crate::types::{
    Request, RequestId, RequestState, SamplingLimits, SeqEvent, SloTargets, StepOutput, StepPlan,
    Timestamp,
};
use crate::Scheduler;

/// A request of tenant `t` in `tier` (`""`: none) arriving at `arrival`, with `prompt`,
/// generating at most `max_tokens`.
pub(crate) fn request(
    id: u64,
    tier: &str,
    arrival: u64,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Request {
    Request {
        id: RequestId(id),
        tenant: "t".into(),
        tier: tier.into(),
        priority: 0,
        lora_adapter: None,
        arrival: Timestamp(arrival),
        slo: SloTargets::default(),
        prompt: Arc::from(prompt),
        limits: SamplingLimits {
            max_tokens,
            ..SamplingLimits::default()
        },
        cache_salt: None,
    }
}

/// Plans one step at `now`, samples `token` for every entry that samples, applies the outputs
/// and checks the scheduler's invariants.
pub(crate) fn run_step(s: &mut Scheduler, now: u64, token: u32) -> (StepPlan, Vec<SeqEvent>) {
    let plan = s.schedule(Timestamp(now));
    let outs: Vec<StepOutput> = plan
        .seqs
        .iter()
        .filter(|q| q.samples)
        .map(|q| StepOutput::new(q.id, token))
        .collect();
    let events = s.apply_outputs(&plan, &outs, Timestamp(now));
    s.check_invariants().unwrap();
    (plan, events)
}

/// A waiting sequence with `prompt_len` prompt tokens arriving at `arrival_us`.
pub(crate) fn seq(id: u64, arrival_us: u64, prompt_len: usize) -> Sequence {
    let req = Request {
        id: RequestId(id),
        tenant: String::new(),
        tier: String::new(),
        priority: 0,
        lora_adapter: None,
        arrival: Timestamp(arrival_us),
        slo: SloTargets::default(),
        prompt: Arc::from(vec![1u32; prompt_len]),
        limits: SamplingLimits {
            max_tokens: 100,
            ..SamplingLimits::default()
        },
        cache_salt: None,
    };
    Sequence::new(
        req,
        SloTargets::default(),
        id as u32 % 4,
        false,
        crate::tier_quota::NO_TIER,
    )
}

/// Turns `s` into a running decode that produced `outputs` tokens, the first at `first_us`.
pub(crate) fn decoding(mut s: Sequence, outputs: usize, first_us: u64) -> Sequence {
    s.state = RequestState::Running;
    s.output = vec![2; outputs];
    s.num_computed = s.num_tokens() - 1;
    s.first_token_at = Some(Timestamp(first_us));
    s
}

/// Turns `s` into a running prefill with `computed` prompt tokens done.
pub(crate) fn prefilling(mut s: Sequence, computed: usize) -> Sequence {
    s.state = RequestState::Running;
    s.num_computed = computed;
    s
}
