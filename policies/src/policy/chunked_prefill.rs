//! Chunked prefill with stall-free batching, after Sarathi-Serve (Agrawal et al., "Taming
//! Throughput-Latency Tradeoff in LLM Inference with Sarathi-Serve", OSDI 2024).
//!
//! Each step has a fixed token budget (`token_budget`, Sarathi's τ). Ongoing decodes are
//! scheduled first, one token each, so a long prompt never stalls them; then ongoing
//! (partially computed) prefills; then new requests in arrival order. Prefills are cut into
//! chunks that fill what is left of the budget, which bounds every step's duration and so
//! the time between two tokens of a running request.

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, Rank, StepContext};
use crate::sequence::SeqView;
use crate::types::{TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "chunked-prefill";

/// Sarathi-Serve's stall-free batching under a per-step token budget.
#[derive(Clone, Debug)]
pub struct ChunkedPrefill {
    /// Tokens per step (decodes plus prefill chunks).
    token_budget: usize,
}

impl ChunkedPrefill {
    /// A policy with a per-step budget of `token_budget` tokens (at least 1).
    pub fn new(token_budget: usize) -> Self {
        Self {
            token_budget: token_budget.max(1),
        }
    }

    /// Builds the policy from `{token_budget: N}` (default 512, Sarathi-Serve's strict-TBT
    /// setting).
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(NAME, params, &["token_budget"])?;
        let budget = p.u64_in("token_budget", 512, 1, 1 << 24)?;
        Ok(Box::new(Self::new(budget as usize)))
    }
}

impl Policy for ChunkedPrefill {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, _now: Timestamp) -> Rank {
        let class = match (seq.is_running(), seq.is_prefill()) {
            (true, false) => 0,
            (true, true) => 1,
            (false, _) => 2,
        };
        Rank { class, key: 0 }
    }

    fn token_budget(&self, ctx: &StepContext<'_>) -> usize {
        self.token_budget.min(ctx.max_num_batched_tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testutil::{decoding, prefilling, seq};

    #[test]
    fn decodes_rank_before_ongoing_prefills_before_new_requests() {
        let p = ChunkedPrefill::new(512);
        let dec = decoding(seq(1, 30, 100), 3, 40);
        let pre = prefilling(seq(2, 10, 100), 50);
        let new = seq(3, 0, 10);
        let now = Timestamp(50);
        let r: Vec<Rank> = [&dec, &pre, &new]
            .iter()
            .map(|s| p.rank(SeqView::new(s), now))
            .collect();
        assert!(r[0] < r[1] && r[1] < r[2], "{r:?}");
    }

    #[test]
    fn budget_param_is_validated() {
        let v: serde_yaml::Value = serde_yaml::from_str("{token_budget: 0}").unwrap();
        let e = ChunkedPrefill::create(&v, &[]).err().unwrap().to_string();
        assert!(e.contains("token_budget"), "{e}");
    }
}
