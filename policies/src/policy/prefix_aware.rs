//! Longest-prefix-match admission with a starvation bound, after SGLang's `lpm` schedule
//! policy (Zheng et al., "SGLang: Efficient Execution of Structured Language Model
//! Programs", NeurIPS 2024, §3: cache-aware scheduling; `python/sglang/srt/managers/
//! schedule_policy.py`).
//!
//! Waiting requests are admitted longest cached prefix first, so a request whose prefix is
//! in the cache runs while that prefix is still resident instead of after requests that
//! would evict it: under load the cache hit rate rises and the prefill work falls. SGLang
//! orders its whole waiting queue this way up to 128 waiting requests and falls back to
//! FCFS above; here the planner looks up the `lookup_limit` earliest arrivals (see
//! [`Policy::prefix_lookups`]), they are ranked by their cached prefix, and the rest follow
//! by arrival. Pure longest-prefix-first starves a request whose prefix nobody shares
//! behind a stream of requests that share theirs; so a request that has waited
//! `max_wait_ms` since it arrived ranks before every one that has not, in arrival order.
//! Its wait is thereby bounded as under FCFS from `max_wait_ms` on: only requests that
//! arrived before it can still go first.
//!
//! With `hold_back_shared` (on by default), SGLang's in-batch prefix check
//! (`_compute_prefix_matches`, `IN_BATCH_PREFIX_CACHING_*_THRESHOLD`): when waiting requests
//! share a prefix that is not cached yet, admitting them together computes it once for each
//! (and holds a copy of its blocks for each). So a looked-up request whose first block to
//! compute a request ahead of it is to compute ([`SeqView::shares_pending_prefix`]: an earlier
//! looked-up arrival, or a running prefill in chunks that has not reached it) ranks after
//! every other waiting request; once the other has computed the block it is in the cache,
//! and the request ranks by its longer cached prefix again. It is ranked last, not refused:
//! a step with room left admits it anyway. A request past `max_wait_ms` is never held back.
//!
//! Ranks, lower first (ties by arrival, then id, as always):
//!
//! | class | who | key |
//! |---|---|---|
//! | 0 | running; waiting for at least `max_wait_ms` since arrival | 0 |
//! | 1 | waiting, looked up | minus the cached prefix tokens |
//! | 2 | waiting, not looked up (beyond `lookup_limit`, or prefix caching off) | 0 |
//! | 3 | waiting, looked up, held back (`hold_back_shared`) | minus the cached prefix tokens |
//!
//! The cached prefix counts the blocks held in the host KV tier (`cache.kv_offloading_size`)
//! after the device cache's hit ends: admission copies those back instead of computing them,
//! and a copy costs far less than the prefill it saves, so they rank as cached.
//!
//! Running requests rank by arrival, as under FCFS: the newest is the preemption victim,
//! and nothing waiting may preempt. With `token_budget` set, steps are chunked as under
//! `chunked-prefill` (Sarathi-Serve's stall-free batching): each step holds at most that many
//! tokens, running decodes rank first (class -2), then running prefills (class -1), so a long
//! admitted prompt is cut into chunks beside the decodes instead of stalling them; the waiting
//! queue is still ordered by cached prefix. Without prefix caching nothing is looked up and the
//! order is FCFS exactly (requests aged since arrival all arrived before those that are not).
//!
//! Cost per step: the planner's O(waiting) selection of the earliest arrivals plus, for each
//! of at most `lookup_limit`, a walk down its block-hash chain of at most hit length + 1
//! probes (+ 2 with a host tier), its device part resumed where its previous walk stopped while nothing was evicted
//! from the cache, its host-tier part walked afresh (each block of a request is hashed once
//! over its life); for the hold-back, sorting those
//! by arrival, one probe each in a set of blocks to compute, and O(running) to fill it.
//!
//! When to use it: prompts that share long prefixes (system prompts, documents, multi-turn
//! histories) with a prefix cache too small to keep every prefix, under enough load that
//! requests queue, best with `token_budget` (512 in the simulator's runs: the hit rate of
//! longest-prefix-first and the short steps of chunked prefill). `max_wait_ms` must exceed
//! the usual queueing delay: a request past it is served in arrival order, so when every
//! waiting request has waited that long the order is FCFS's (on the Mooncake trace, 5000 was
//! within 1 % of FCFS at full load; hence the default of 60000). Without queueing, or when
//! the cache holds every prefix, it changes little. The hold-back pays where several
//! requests of a cold prefix wait at once and steps are long enough to admit more than one
//! (no `token_budget`, or a large one): in the simulator, with bursts of questions about a
//! few 4,096-token documents, 4-6 % less prefill work and 1-2 % more output throughput
//! without a budget or with 2048; with 512 it changes nothing measurable (a short step
//! admits one such prefill at a time anyway), and without sharing it changes nothing.

use crate::error::PolicyError;
use crate::policy::params::Params;
use crate::policy::{Policy, Rank, StepContext, MAX_PREFIX_LOOKUPS};
use crate::sequence::SeqView;
use crate::types::{TierSpec, Timestamp};

/// Registered name.
pub(crate) const NAME: &str = "prefix-aware";

/// Rank class of running requests and of waiting ones past `max_wait_ms` (arrival order).
const AGED: i64 = 0;
/// Rank class of waiting requests whose cached prefix was looked up.
const LOOKED_UP: i64 = 1;
/// Rank class of waiting requests not looked up this step (arrival order).
const NOT_LOOKED_UP: i64 = 2;
/// Rank class of looked-up waiting requests held back: a request ahead of them is to compute
/// the first block they would (see [`SeqView::shares_pending_prefix`]).
const HELD_BACK: i64 = 3;

/// Default `max_wait_ms`.
const DEFAULT_MAX_WAIT_MS: f64 = 60_000.0;
/// Largest `max_wait_ms` accepted (one hour): the starvation bound stays a bound.
const MAX_WAIT_MS_LIMIT: f64 = 3_600_000.0;
/// Default `lookup_limit` (SGLang's FCFS fallback threshold).
const DEFAULT_LOOKUP_LIMIT: u64 = 128;
/// Default `hold_back_shared`.
const DEFAULT_HOLD_BACK_SHARED: bool = true;
/// Rank class of running decodes under a `token_budget`.
const RUNNING_DECODE: i64 = -2;
/// Rank class of running prefills under a `token_budget`.
const RUNNING_PREFILL: i64 = -1;
/// Largest `token_budget` accepted (as `chunked-prefill`'s).
const MAX_TOKEN_BUDGET: u64 = 1 << 24;

/// Longest cached prefix first, with aging.
#[derive(Clone, Debug)]
pub struct PrefixAware {
    /// Microseconds since arrival after which a waiting request ranks before every
    /// non-aged one.
    max_wait_us: u64,
    /// Waiting requests (earliest arrivals first) looked up in the prefix cache per step.
    lookup_limit: usize,
    /// Tokens per step with chunked prefills (`None`: the configured step limit, and running
    /// requests in arrival order).
    token_budget: Option<usize>,
    /// Whether a non-aged request whose first block to compute a request ahead of it is to
    /// compute ranks after every other waiting request (SGLang's in-batch prefix check).
    hold_back_shared: bool,
}

impl PrefixAware {
    /// A policy aging requests after `max_wait_ms` (rounded to whole microseconds, at least
    /// one) that asks for `lookup_limit` lookups per step (clamped to
    /// `1..=`[`MAX_PREFIX_LOOKUPS`]).
    pub fn new(max_wait_ms: f64, lookup_limit: usize) -> Self {
        Self {
            max_wait_us: ((max_wait_ms * 1e3).round() as u64).max(1),
            lookup_limit: lookup_limit.clamp(1, MAX_PREFIX_LOOKUPS),
            token_budget: None,
            hold_back_shared: DEFAULT_HOLD_BACK_SHARED,
        }
    }

    /// The same policy holding back requests that share a block still to compute with a
    /// request ahead of them (`true`), or ranking them by cached prefix as any other
    /// (`false`).
    pub fn with_hold_back_shared(mut self, on: bool) -> Self {
        self.hold_back_shared = on;
        self
    }

    /// The same policy with chunked prefills under a per-step budget of `tokens` (at least 1).
    pub fn with_token_budget(mut self, tokens: usize) -> Self {
        self.token_budget = Some(tokens.max(1));
        self
    }

    /// Builds the policy from `{max_wait_ms, lookup_limit, token_budget, hold_back_shared}`
    /// (defaults 60000, 128, none and true; `max_wait_ms` in 1..=3600000, `lookup_limit` in
    /// 1..=4096, `token_budget` in 1..=2^24, `hold_back_shared` a boolean).
    pub fn create(
        params: &serde_yaml::Value,
        _tiers: &[TierSpec],
    ) -> Result<Box<dyn Policy>, PolicyError> {
        let p = Params::new(
            NAME,
            params,
            &[
                "max_wait_ms",
                "lookup_limit",
                "token_budget",
                "hold_back_shared",
            ],
        )?;
        let max_wait = p.f64_in("max_wait_ms", DEFAULT_MAX_WAIT_MS, 1.0, MAX_WAIT_MS_LIMIT)?;
        let limit = p.u64_in(
            "lookup_limit",
            DEFAULT_LOOKUP_LIMIT,
            1,
            MAX_PREFIX_LOOKUPS as u64,
        )?;
        let hold_back = p.bool("hold_back_shared", DEFAULT_HOLD_BACK_SHARED)?;
        let mut policy = Self::new(max_wait, limit as usize).with_hold_back_shared(hold_back);
        if let Some(budget) = p.opt_u64_in("token_budget", 1, MAX_TOKEN_BUDGET)? {
            policy = policy.with_token_budget(budget as usize);
        }
        Ok(Box::new(policy))
    }

    /// Whether `seq` has waited `max_wait_ms` since it arrived.
    fn aged(&self, seq: SeqView<'_>, now: Timestamp) -> bool {
        now.saturating_sub(seq.arrival()) >= self.max_wait_us
    }
}

impl Policy for PrefixAware {
    fn name(&self) -> &str {
        NAME
    }

    fn rank(&self, seq: SeqView<'_>, now: Timestamp) -> Rank {
        if seq.is_running() && self.token_budget.is_some() {
            let class = if seq.is_prefill() {
                RUNNING_PREFILL
            } else {
                RUNNING_DECODE
            };
            return Rank { class, key: 0 };
        }
        if seq.is_running() || self.aged(seq, now) {
            return Rank {
                class: AGED,
                key: 0,
            };
        }
        match seq.cached_prefix_tokens() {
            Some(tokens) => Rank {
                class: if self.hold_back_shared && seq.shares_pending_prefix() {
                    HELD_BACK
                } else {
                    LOOKED_UP
                },
                key: -i64::try_from(tokens).unwrap_or(i64::MAX),
            },
            None => Rank {
                class: NOT_LOOKED_UP,
                key: 0,
            },
        }
    }

    fn prefix_lookups(&self) -> usize {
        self.lookup_limit
    }

    fn token_budget(&self, ctx: &StepContext<'_>) -> usize {
        self.token_budget.map_or(ctx.max_num_batched_tokens, |b| {
            b.min(ctx.max_num_batched_tokens)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::testutil::{decoding, prefilling, seq};
    use crate::sequence::{PrefixLookup, Sequence};

    /// A waiting sequence arriving at `arrival_us` whose lookup found `cached` tokens.
    fn looked_up(id: u64, arrival_us: u64, cached: Option<u32>) -> Sequence {
        let mut s = seq(id, arrival_us, 100);
        s.cached_prefix = cached.map(|tokens| PrefixLookup {
            tokens,
            pending_ahead: false,
        });
        s
    }

    /// As [`looked_up`], its first block to compute also one a request ahead of it computes.
    fn sharing(id: u64, arrival_us: u64, cached: u32) -> Sequence {
        let mut s = looked_up(id, arrival_us, Some(cached));
        s.cached_prefix = Some(PrefixLookup {
            tokens: cached,
            pending_ahead: true,
        });
        s
    }

    /// Ids of `seqs` in the order the core serves them at `now`: rank, arrival, id.
    fn order(p: &PrefixAware, seqs: &[Sequence], now: u64) -> Vec<u64> {
        let mut keyed: Vec<_> = seqs
            .iter()
            .map(|s| {
                let v = SeqView::new(s);
                (p.rank(v, Timestamp(now)), v.arrival(), v.id().0)
            })
            .collect();
        keyed.sort_unstable();
        keyed.into_iter().map(|k| k.2).collect()
    }

    #[test]
    fn longest_cached_prefix_first_then_arrival() {
        let p = PrefixAware::new(5_000.0, 128);
        // 1 and 4 both hit 64 tokens: arrival breaks the tie (1 first); 3 was not looked up.
        let seqs = [
            looked_up(1, 10, Some(64)),
            looked_up(2, 20, Some(0)),
            looked_up(3, 0, None),
            looked_up(4, 30, Some(64)),
            looked_up(5, 40, Some(96)),
        ];
        assert_eq!(order(&p, &seqs, 1_000), [5, 1, 4, 2, 3]);
    }

    #[test]
    fn aged_requests_go_first_in_arrival_order() {
        // max_wait 1 ms. At t = 1.5 ms, 2 (arrived at 0.2 ms) and 3 (at 0.5 ms) have waited
        // 1 ms or more; 1 (at 0.6 ms) has not, although its prefix is the longest. Exactly
        // 1 ms counts as aged (3 at t = 1.5 ms).
        let p = PrefixAware::new(1.0, 128);
        let seqs = [
            looked_up(1, 600, Some(512)),
            looked_up(3, 500, Some(0)),
            looked_up(2, 200, None),
        ];
        assert_eq!(order(&p, &seqs, 1_500), [2, 3, 1]);
        // A microsecond earlier, 3 is not aged yet: 1 overtakes it by prefix.
        assert_eq!(order(&p, &seqs, 1_499), [2, 1, 3]);
    }

    #[test]
    fn running_requests_rank_by_arrival() {
        let p = PrefixAware::new(5_000.0, 128);
        let a = decoding(seq(1, 50, 10), 2, 60);
        let mut b = decoding(seq(2, 10, 10), 2, 60);
        b.cached_prefix = Some(PrefixLookup {
            tokens: 1_000,
            pending_ahead: true,
        }); // a stale value must not matter
        assert_eq!(order(&p, &[a, b], 100), [2, 1]);
    }

    #[test]
    fn a_token_budget_chunks_steps_and_serves_decodes_before_prefills() {
        let seqs = vec![Some(seq(9, 0, 10))];
        let ctx = |max| StepContext {
            now: Timestamp(0),
            max_num_batched_tokens: max,
            max_num_seqs: 8,
            seqs: &seqs,
            running: &[],
            waiting: &[],
        };
        let plain = PrefixAware::new(5_000.0, 128);
        assert_eq!(plain.token_budget(&ctx(8192)), 8192);
        let chunked = PrefixAware::new(5_000.0, 128).with_token_budget(512);
        assert_eq!(chunked.token_budget(&ctx(8192)), 512);
        assert_eq!(chunked.token_budget(&ctx(256)), 256);
        // Running: decodes, then prefills (2 arrived first but is still prefilling), then the
        // waiting queue by cached prefix, aged ones first.
        let dec = decoding(seq(1, 50, 10), 2, 60);
        let pre = prefilling(seq(2, 10, 100), 40);
        let seqs = [
            dec,
            pre,
            looked_up(3, 20, Some(16)),
            looked_up(4, 30, Some(64)),
            looked_up(5, 0, None),
        ];
        // At t = 5.00001 s with max_wait 5 s, 5 (arrived at 0) is aged; 3 and 4 are not.
        assert_eq!(order(&chunked, &seqs, 5_000_010), [1, 2, 5, 4, 3]);
        // Without the budget, running requests rank by arrival with the aged ones.
        assert_eq!(order(&plain, &seqs, 5_000_010), [5, 2, 1, 4, 3]);
        let p = PrefixAware::create(&serde_yaml::from_str("{token_budget: 512}").unwrap(), &[]);
        assert_eq!(p.unwrap().token_budget(&ctx(8192)), 512);
        let p = PrefixAware::create(&serde_yaml::from_str("{token_budget: null}").unwrap(), &[]);
        assert_eq!(p.unwrap().token_budget(&ctx(8192)), 8192);
    }

    #[test]
    fn without_lookups_the_order_is_fcfs() {
        let p = PrefixAware::new(1.0, 128);
        let seqs = [
            looked_up(4, 3_000, None),
            looked_up(1, 0, None),
            looked_up(3, 2_000, None),
            looked_up(2, 2_000, None),
        ];
        // At t = 3 ms, 1, 2 and 3 are aged and 4 is not: arrival order either way.
        assert_eq!(order(&p, &seqs, 3_000), [1, 2, 3, 4]);
    }

    #[test]
    fn requests_sharing_a_block_still_to_compute_rank_after_every_other() {
        let p = PrefixAware::new(5_000.0, 128);
        // 2 and 4 share their first block to compute with a request ahead: after the others
        // (3 was not looked up), longest cached prefix first among them (4's 64 before 2's 0).
        let seqs = [
            looked_up(1, 10, Some(0)),
            sharing(2, 0, 0),
            looked_up(3, 5, None),
            sharing(4, 30, 64),
            looked_up(5, 40, Some(16)),
        ];
        assert_eq!(order(&p, &seqs, 1_000), [5, 1, 3, 4, 2]);
        // Switched off, the fact is ignored: longest cached prefix first, as before.
        let off = PrefixAware::new(5_000.0, 128).with_hold_back_shared(false);
        assert_eq!(order(&off, &seqs, 1_000), [4, 5, 2, 1, 3]);
        // Under a token budget, only the waiting classes change.
        let chunked = PrefixAware::new(5_000.0, 128).with_token_budget(512);
        let pre = prefilling(seq(6, 50, 100), 40);
        let mut with_running = seqs.to_vec();
        with_running.push(pre);
        assert_eq!(order(&chunked, &with_running, 1_000), [6, 5, 1, 3, 4, 2]);
    }

    #[test]
    fn an_aged_request_is_never_held_back() {
        // max_wait 1 ms: at t = 1.2 ms, 2 (arrived at 0.1 ms) is aged and goes first although
        // it shares a block still to compute; 4 (at 0.5 ms) is not aged and is held back.
        let p = PrefixAware::new(1.0, 128);
        let seqs = [
            looked_up(1, 300, Some(0)),
            sharing(2, 100, 0),
            sharing(4, 500, 32),
        ];
        assert_eq!(order(&p, &seqs, 1_200), [2, 1, 4]);
        // Once 4 is aged too, arrival order alone.
        assert_eq!(order(&p, &seqs, 1_500), [2, 1, 4]);
        let later = [looked_up(1, 600, Some(0)), sharing(4, 500, 32)];
        assert_eq!(order(&p, &later, 1_400), [1, 4]);
        assert_eq!(order(&p, &later, 1_500), [4, 1]);
    }

    #[test]
    fn params_are_validated_and_name_the_field() {
        let create = |v: &str| {
            let v: serde_yaml::Value = serde_yaml::from_str(v).unwrap();
            PrefixAware::create(&v, &[])
        };
        for (params, field) in [
            ("{max_wait_ms: 0}", "max_wait_ms"),
            ("{max_wait_ms: -5}", "max_wait_ms"),
            ("{max_wait_ms: 3600001}", "max_wait_ms"),
            ("{max_wait_ms: soon}", "max_wait_ms"),
            ("{lookup_limit: 0}", "lookup_limit"),
            ("{lookup_limit: 4097}", "lookup_limit"),
            ("{lookup_limit: 1.5}", "lookup_limit"),
            ("{max_wait: 10}", "max_wait"),
            ("{hold_back_shared: 1}", "hold_back_shared"),
            ("{hold_back_shared: yes please}", "hold_back_shared"),
        ] {
            let e = create(params)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                e.contains(&format!("`{field}`")) && e.contains("prefix-aware"),
                "{params}: {e}"
            );
        }
        for params in [
            "{token_budget: 0}",
            "{token_budget: 16777217}",
            "{token_budget: -1}",
        ] {
            let e = create(params)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(e.contains("`token_budget`"), "{params}: {e}");
        }
        let p = create("{max_wait_ms: 1, lookup_limit: 4096}").unwrap();
        assert_eq!(p.prefix_lookups(), 4096);
        assert_eq!(create("{}").unwrap().prefix_lookups(), 128);
        // `hold_back_shared` reaches the ranking: a held-back request after a looked-up one.
        let held = [sharing(1, 0, 0), looked_up(2, 10, Some(0))];
        let rank = |p: &dyn Policy| {
            let mut ids: Vec<_> = held
                .iter()
                .map(|s| (p.rank(SeqView::new(s), Timestamp(100)), s.id.0))
                .collect();
            ids.sort_unstable();
            ids.into_iter().map(|k| k.1).collect::<Vec<_>>()
        };
        assert_eq!(rank(create("{}").unwrap().as_ref()), [2, 1]);
        assert_eq!(
            rank(create("{hold_back_shared: true}").unwrap().as_ref()),
            [2, 1]
        );
        assert_eq!(
            rank(create("{hold_back_shared: false}").unwrap().as_ref()),
            [1, 2]
        );
        // Rounded, not truncated: 4.35 ms is 4350 us (4349.999... in binary).
        assert_eq!(PrefixAware::new(4.35, 1).max_wait_us, 4350);
    }
}
