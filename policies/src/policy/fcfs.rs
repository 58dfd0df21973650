//! First come, first served: every sequence ranks equal, so the core's tie-breakers
//! (arrival time, then id) decide. Running sequences keep their slot in arrival order, the
//! newest running sequence is the preemption victim, and a preempted request keeps its
//! original arrival time so it is re-admitted ahead of later arrivals (vLLM's FCFS queue).

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, Rank};
use crate::sequence::SeqView;
use crate::types::{TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "fcfs";

/// First come, first served.
#[derive(Clone, Debug, Default)]
pub struct Fcfs;

impl Fcfs {
    /// Builds the policy; it takes no parameters.
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        Params::new(NAME, params, &[])?;
        Ok(Box::new(Fcfs))
    }
}

impl Policy for Fcfs {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, _seq: SeqView<'_>, _now: Timestamp) -> Rank {
        Rank::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_any_parameter() {
        let v: serde_yaml::Value = serde_yaml::from_str("{x: 1}").unwrap();
        assert!(Fcfs::create(&v, &[]).is_err());
    }
}
