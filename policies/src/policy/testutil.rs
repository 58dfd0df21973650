//! Hand-made sequences for policy unit tests.

use std::sync::Arc;

use crate::sequence::Sequence;
use crate::types::{Request, RequestId, RequestState, SamplingLimits, SloTargets, Timestamp};

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
