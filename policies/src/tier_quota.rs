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
    /// Each tier's bound in blocks (`usize::MAX`: none): its `max_kv_fraction`'s or, after
    /// a reload lowered it, at least what the tier's largest request in flight needs alone
    /// (see [`TierQuotas::replace`]).
    cap: Vec<usize>,
    /// Each tier's bound as its `max_kv_fraction` sets it (`usize::MAX`: none).
    configured: Vec<usize>,
    /// What a tier may hold above its bound: what it held when a reload lowered the bound
    /// below that, coming down with what it gives back (the planner gives an over-bound tier
    /// no block, so it only comes down); `0` when not over.
    over: Vec<usize>,
}

/// How a reload's new bounds took (what the scheduler's quota reload reports).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QuotaChange {
    /// The tier holds more than its new bound: it gets no block (no admission, no growth
    /// but by preempting its own) until its requests have given back the excess.
    Over {
        /// The tier.
        tier: String,
        /// Blocks it holds.
        held: usize,
        /// Its new bound.
        bound: usize,
    },
    /// A request of the tier in flight needs more than the new bound alone: the bound is
    /// held at what the tier's largest such request needs until they end (a request the
    /// bound could never hold would preempt itself forever).
    Held {
        /// The tier.
        tier: String,
        /// The bound in force.
        bound: usize,
        /// The new bound, in force once they end.
        configured: usize,
    },
}

impl std::fmt::Display for QuotaChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Over { tier, held, bound } => write!(
                f,
                "tier `{tier}` holds {held} KV blocks, over its new bound of {bound}: its \
                 requests get no block until they have given back the excess"
            ),
            Self::Held {
                tier,
                bound,
                configured,
            } => write!(
                f,
                "tier `{tier}`'s KV bound is held at {bound} blocks, not its new {configured}, \
                 while requests queued before need that many alone"
            ),
        }
    }
}

impl TierQuotas {
    /// Zero counts for `tiers`, with bounds out of a cache of `num_blocks` blocks.
    pub(crate) fn new(tiers: &[TierSpec], num_blocks: usize) -> Self {
        let configured: Vec<usize> = tiers
            .iter()
            .map(|t| {
                t.max_kv_fraction
                    .map_or(usize::MAX, |f| tier_kv_blocks(f, num_blocks))
            })
            .collect();
        Self {
            held: vec![0; tiers.len()],
            cap: configured.clone(),
            over: vec![0; tiers.len()],
            configured,
        }
    }

    /// New tiers' bounds (a reload): `held` is what each new tier's running sequences hold
    /// and `needs` the most blocks one of its live requests needs alone (0 for none). A
    /// bound below a tier's `needs` is held at its `needs` ([`QuotaChange::Held`], lowered
    /// by [`TierQuotas::relax`] as those requests end); a tier holding more than its bound
    /// may keep it ([`QuotaChange::Over`]). Returns what did not take as asked.
    pub(crate) fn replace(
        tiers: &[TierSpec],
        num_blocks: usize,
        held: Vec<usize>,
        needs: &[usize],
    ) -> (Self, Vec<QuotaChange>) {
        let mut q = Self::new(tiers, num_blocks);
        q.held = held;
        let mut changes = Vec::new();
        for (i, t) in tiers.iter().enumerate() {
            let need = needs.get(i).copied().unwrap_or(0);
            if q.configured[i] != usize::MAX && need > q.configured[i] {
                q.cap[i] = need;
                changes.push(QuotaChange::Held {
                    tier: t.name.clone(),
                    bound: need,
                    configured: q.configured[i],
                });
            }
            if q.held[i] > q.cap[i] {
                q.over[i] = q.held[i];
                changes.push(QuotaChange::Over {
                    tier: t.name.clone(),
                    held: q.held[i],
                    bound: q.cap[i],
                });
            }
        }
        (q, changes)
    }

    /// `tier`'s bound as its `max_kv_fraction` sets it, if it has one (what a new request of
    /// it must fit; [`TierQuotas::cap`] may be held above it for requests queued before).
    pub(crate) fn configured(&self, tier: u8) -> Option<usize> {
        self.configured
            .get(usize::from(tier))
            .copied()
            .filter(|&c| c != usize::MAX)
    }

    /// Whether `tier`'s bound is held above its configured one ([`QuotaChange::Held`]).
    pub(crate) fn is_held_up(&self, tier: u8) -> bool {
        let i = usize::from(tier);
        matches!((self.cap.get(i), self.configured.get(i)), (Some(c), Some(k)) if c > k)
    }

    /// Lowers `tier`'s held-up bound to what its largest live request now needs (`need`),
    /// not below its configured one; returns the bound in force when it changed.
    pub(crate) fn relax(&mut self, tier: u8, need: usize) -> Option<usize> {
        let i = usize::from(tier);
        let (cap, configured) = (self.cap.get_mut(i)?, *self.configured.get(i)?);
        let to = need.max(configured);
        if to >= *cap {
            return None;
        }
        *cap = to;
        if let (Some(over), Some(&held)) = (self.over.get_mut(i), self.held.get(i)) {
            if held > to {
                *over = (*over).max(held);
            }
        }
        Some(to)
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
        let i = usize::from(tier);
        if let Some(h) = self.held.get_mut(i) {
            *h = h.saturating_sub(n);
            if let Some(over) = self.over.get_mut(i) {
                // Over its bound after a reload: what it may hold comes down by what it gives
                // back (not to what it holds: a block taken while over, then one given back,
                // would leave it at what it held, and `check` blind to the growth).
                *over = if *h > self.cap[i] {
                    over.saturating_sub(n)
                } else {
                    0
                };
            }
        }
    }

    /// Blocks held per tier, in the tiers' order.
    pub(crate) fn all_held(&self) -> &[usize] {
        &self.held
    }

    /// Checks the counts against `actual` (the blocks the running sequences of each tier hold,
    /// recounted) and against the bounds (above which a tier may hold only what it held when a
    /// reload lowered its bound, coming down).
    pub(crate) fn check(&self, actual: &[usize], names: &[TierSpec]) -> Result<(), String> {
        for (i, ((&held, &cap), &real)) in self.held.iter().zip(&self.cap).zip(actual).enumerate() {
            let cap = cap.max(self.over.get(i).copied().unwrap_or(0));
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

    #[test]
    fn a_tier_over_its_bound_that_takes_a_block_fails_the_check_though_it_gives_some_back() {
        // A reload bounds the tier to 8 of 20 blocks while it holds 12: it may keep them, and
        // what it may hold above the bound comes down with what it gives back.
        let t = TierSpec {
            max_kv_fraction: Some(0.4),
            ..TierSpec::named("t")
        };
        let (mut q, _) = TierQuotas::replace(std::slice::from_ref(&t), 20, vec![12], &[0]);
        assert!(q.check(&[12], &[]).is_ok());
        q.sub(0, 2);
        assert!(q.check(&[10], &[]).is_ok());
        // A planner that gives the over-bound tier a block and then preempts one of its
        // sequences holding two in the same step: 9 held, above its 8 blocks of
        // bound and above the 8 it may hold after giving back 4 in all.
        q.add(0, 1);
        q.sub(0, 2);
        let e = q.check(&[9], &[]).unwrap_err();
        assert!(e.contains("over its bound of 8"), "{e}");
        // Within its bound again: the bound alone applies from then on.
        let (mut q, _) = TierQuotas::replace(&[t], 20, vec![12], &[0]);
        q.sub(0, 5);
        assert!(q.check(&[7], &[]).is_ok());
        q.add(0, 1);
        assert!(q.check(&[8], &[]).is_ok());
        q.add(0, 1);
        assert!(q.check(&[9], &[]).is_err());
    }
}
