//! KV-cache quotas per SLO tier (`tiers.<name>.max_kv_fraction`): the most KV blocks a tier's
//! running sequences may hold at once, so that one tier's long requests cannot fill the cache
//! and starve the others (noisy-neighbour isolation).
//!
//! A sequence's charge is the blocks it holds: its block table less the entries given back
//! behind a sliding window. A block shared through the prefix cache counts once for each
//! sequence holding it: conservative (a tier may be charged more than the blocks it alone
//! keeps), and O(1) per change, with no walk over the sharers. The counts are kept up to date
//! as the planner adds blocks to a table and as a sequence gives them back (a finish, an
//! abort, a preemption, a trim, the window), so a check is O(1); they live in the scheduler,
//! not in a policy, so every policy obeys them and a policy swap changes nothing. See the
//! planner's header for how admission and growth use them.

use crate::types::TierSpec;

/// [`crate::sequence::Sequence::tier`] of a request of no configured tier: never counted, never
/// bounded.
pub(crate) const NO_TIER: u8 = u8::MAX;

/// The blocks a tier with `fraction` of a `num_blocks` cache may hold: rounded down, at least
/// one.
pub fn tier_kv_blocks(fraction: f64, num_blocks: usize) -> usize {
    // `fraction` is validated in (0, 1], so the product is at most `num_blocks`. A product
    // within rounding error below a whole number (0.29 * 100 = 28.999999999999996) is it.
    let blocks = fraction * num_blocks as f64;
    let whole = blocks.round();
    let blocks = if (blocks - whole).abs() <= whole * 1e-12 {
        whole
    } else {
        blocks.floor()
    };
    (blocks as usize).clamp(1, num_blocks.max(1))
}

/// Blocks held per configured tier and each tier's bound.
#[derive(Debug, Default)]
pub(crate) struct TierQuotas {
    /// Blocks held by the running sequences of each tier (same order as the tiers).
    held: Vec<usize>,
    /// Each tier's bound in blocks (`usize::MAX`: none).
    cap: Vec<usize>,
}

impl TierQuotas {
    /// Zero counts for `tiers`, with bounds out of a cache of `num_blocks` blocks.
    pub(crate) fn new(tiers: &[TierSpec], num_blocks: usize) -> Self {
        Self {
            held: vec![0; tiers.len()],
            cap: tiers
                .iter()
                .map(|t| {
                    t.max_kv_fraction
                        .map_or(usize::MAX, |f| tier_kv_blocks(f, num_blocks))
                })
                .collect(),
        }
    }

    /// `tier`'s bound in blocks, if it has one.
    pub(crate) fn cap(&self, tier: u8) -> Option<usize> {
        self.cap
            .get(usize::from(tier))
            .copied()
            .filter(|&c| c != usize::MAX)
    }

    /// Blocks `tier`'s sequences may still take (`usize::MAX` without a bound).
    #[inline]
    pub(crate) fn room(&self, tier: u8) -> usize {
        match (
            self.cap.get(usize::from(tier)),
            self.held.get(usize::from(tier)),
        ) {
            (Some(&cap), Some(&held)) if cap != usize::MAX => cap.saturating_sub(held),
            _ => usize::MAX,
        }
    }

    /// Blocks `tier`'s sequences hold (0 for [`NO_TIER`]).
    #[inline]
    pub(crate) fn held(&self, tier: u8) -> usize {
        self.held.get(usize::from(tier)).copied().unwrap_or(0)
    }

    /// A sequence of `tier` took `n` blocks.
    #[inline]
    pub(crate) fn add(&mut self, tier: u8, n: usize) {
        if let Some(h) = self.held.get_mut(usize::from(tier)) {
            *h += n;
        }
    }

    /// A sequence of `tier` gave back `n` blocks. (Never more than it took; a count that would
    /// go below zero stays at zero, and `check` reports the mismatch.)
    #[inline]
    pub(crate) fn sub(&mut self, tier: u8, n: usize) {
        if let Some(h) = self.held.get_mut(usize::from(tier)) {
            *h = h.saturating_sub(n);
        }
    }

    /// Blocks held per tier, in the tiers' order.
    pub(crate) fn all_held(&self) -> &[usize] {
        &self.held
    }

    /// Checks the counts against `actual` (the blocks the running sequences of each tier hold,
    /// recounted) and against the bounds.
    pub(crate) fn check(&self, actual: &[usize], names: &[TierSpec]) -> Result<(), String> {
        for (i, ((&held, &cap), &real)) in self.held.iter().zip(&self.cap).zip(actual).enumerate() {
            let name = names.get(i).map_or("?", |t| t.name.as_str());
            if held != real {
                return Err(format!(
                    "tier `{name}`: counted {held} KV blocks, its sequences hold {real}"
                ));
            }
            if held > cap {
                return Err(format!(
                    "tier `{name}` holds {held} KV blocks, over its bound of {cap}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[path = "tier_quota_tests.rs"]
mod planner_tests;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_rounds_down_to_at_least_one_block() {
        assert_eq!(tier_kv_blocks(0.5, 101), 50);
        assert_eq!(tier_kv_blocks(1.0, 101), 101);
        assert_eq!(tier_kv_blocks(0.001, 100), 1);
        assert_eq!(tier_kv_blocks(0.3, 10), 3);
        // Products that f64 leaves a hair below a whole number (0.29 * 100 is
        // 28.999999999999996) are that number.
        assert_eq!(tier_kv_blocks(0.29, 100), 29);
        assert_eq!(tier_kv_blocks(0.57, 200), 114);
        assert_eq!(tier_kv_blocks(0.58, 50), 29);
        assert_eq!(tier_kv_blocks(0.999, 100), 99);
    }

    #[test]
    fn room_counts_down_and_unbounded_tiers_have_all() {
        let t = |f| TierSpec {
            max_kv_fraction: f,
            ..TierSpec::named("t")
        };
        let mut q = TierQuotas::new(&[t(Some(0.5)), t(None)], 10);
        assert_eq!(q.cap(0), Some(5));
        assert_eq!(q.cap(1), None);
        q.add(0, 3);
        q.add(1, 7);
        q.add(NO_TIER, 9);
        assert_eq!(q.room(0), 2);
        assert_eq!(q.room(1), usize::MAX);
        assert_eq!(q.room(NO_TIER), usize::MAX);
        assert_eq!(q.held(NO_TIER), 0);
        assert!(q.check(&[3, 7], &[]).is_ok());
        assert!(q.check(&[2, 7], &[]).is_err());
        q.add(0, 3);
        assert!(q
            .check(&[6, 7], &[])
            .unwrap_err()
            .contains("over its bound"));
        q.sub(0, 6);
        q.sub(1, 7);
        assert_eq!(q.all_held(), &[0, 0]);
    }
}
