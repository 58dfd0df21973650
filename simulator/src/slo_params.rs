//! The `slo-aware` policy's step-cost parameters implied by a calibration.
//!
//! The policy (`switchyard_policies::SloAware`, after Niyama) estimates a request's time to
//! its next milestone with a linear model of its own: `step_overhead_ms` per step plus
//! `prefill_us_per_token` per prompt token still to feed (and, sizing a step's chunks, per
//! token of the step). Its defaults (8 ms and 25 us) are rough Llama-3-8B-on-H200 figures;
//! a calibration fitted on the machine at hand ([`Calibration`]) implies better ones.
//!
//! The calibrated model prices a whole step from ten features of its shape, so the two
//! numbers are read off it at a reference point, with the very `step_time` the simulator
//! prices steps with (so the token knee, the KV and attention terms count as they do there):
//!
//! * `step_overhead_ms` is the time of a typical decode step: [`DECODE_BATCH`] sequences, or
//!   the engine's `max_num_seqs` where that is fewer (a step it cannot run is no estimate of
//!   its steps: a CPU engine of 8 sequences was priced at a 32-sequence step, 8 times its
//!   own), each with [`DECODE_CONTEXT`] tokens of context, one new token each, every one
//!   sampled. This is the time until a running request's next token, which is what the
//!   policy adds to every request's work.
//! * `prefill_us_per_token` is the fit's marginal cost of a prefill token: the time that
//!   step takes more when a prompt chunk of [`PREFILL_CHUNK`] tokens (from the start of its
//!   prompt, no logits sampled) joins it, divided by the chunk's tokens. It includes the
//!   per-token, per-prefill-token, KV and attention terms at that chunk; a longer prompt's
//!   attention costs more per token than this.
//!
//! Both reference steps stay within the contexts the calibration measured (its
//! `max_context`, where the file records one, rounded up to a multiple of [`BOUND_ROUNDING`]
//! tokens: the sweep's longest step stops a token short of `--max-context`, and a default
//! calibration, to 1,023 tokens, keeps the 1,024 of its reference step): a decode context and
//! a chunk of at most that many tokens ([`reference`]). Beyond it the fit extrapolates, and its KV and attention terms,
//! fitted on short contexts where they are nearly proportional to the batch, are not
//! determined there: a calibration at `--max-context 64` of SmolLM2 on a 2-core CPU priced
//! a 32-sequence decode at 1,024 tokens of context at 1,095 ms, where the same fit gives
//! 110 ms at the 62 tokens within what it measured (its measured 16- and 64-sequence decodes
//! at about 60 tokens took 66 and 215 ms at the median).
//!
//! Both are rounded to the nanosecond and kept within the bounds the policy accepts
//! (`step_overhead_ms` 0 to 1,000,000; `prefill_us_per_token` at least 0.001, so a fit with
//! no per-token cost at all still builds a policy, whose chunks are then the step's budget).
//! A spec's own parameters always win: only the ones it leaves unset are filled in.

use crate::cost::{Calibration, StepShape};
use crate::spec::PolicySpec;
use serde::{Deserialize, Serialize};

/// The policy these parameters are for, as the registry names it.
pub const SLO_AWARE: &str = "slo-aware";
/// Sequences of the reference decode step.
pub const DECODE_BATCH: u64 = 32;
/// Tokens of context of each sequence of the reference decode step.
pub const DECODE_CONTEXT: u64 = 1024;
/// Tokens of the prompt chunk whose marginal cost gives `prefill_us_per_token`.
pub const PREFILL_CHUNK: u64 = 512;

/// The policy's bound on `step_overhead_ms`.
const MAX_STEP_OVERHEAD_MS: f64 = 1e6;
/// The smallest `prefill_us_per_token` derived (the policy accepts down to 1e-6).
const MIN_PREFILL_US_PER_TOKEN: f64 = 1e-3;
/// The policy's bound on `prefill_us_per_token`.
const MAX_PREFILL_US_PER_TOKEN: f64 = 1e9;

/// `slo-aware`'s step-cost parameters, as its `params` spell them.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SloAwareParams {
    /// Estimated time of one step, in ms.
    pub step_overhead_ms: f64,
    /// Estimated cost of one prefill token, in microseconds.
    pub prefill_us_per_token: f64,
}

/// The reference steps of a calibration: the decode step's context per sequence and the
/// prompt chunk that joins it, in tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reference {
    /// Tokens of context of each sequence of the decode step.
    pub decode_context: u64,
    /// Tokens of the prompt chunk.
    pub prefill_chunk: u64,
}

/// Tokens the longest context a calibration measured is rounded up to, bounding its
/// reference steps (a KV block of the default size).
pub const BOUND_ROUNDING: u64 = 16;

/// The reference steps for calibration `c`: [`DECODE_CONTEXT`] and [`PREFILL_CHUNK`], at most
/// the longest context it measured (`max_context`) rounded up to [`BOUND_ROUNDING`] tokens; a
/// file without one (or with 0) is taken at the constants.
pub fn reference(c: &Calibration) -> Reference {
    match c.max_context.filter(|&m| m > 0) {
        None => Reference {
            decode_context: DECODE_CONTEXT,
            prefill_chunk: PREFILL_CHUNK,
        },
        Some(m) => {
            let bound = m.saturating_add(BOUND_ROUNDING - 1) / BOUND_ROUNDING * BOUND_ROUNDING;
            Reference {
                decode_context: DECODE_CONTEXT.min(bound),
                prefill_chunk: PREFILL_CHUNK.min(bound),
            }
        }
    }
}

impl SloAwareParams {
    /// The parameters `c` implies for an engine that runs at most `max_num_seqs` sequences a
    /// step (see the module's documentation for the derivation).
    pub fn from_calibration(c: &Calibration, max_num_seqs: usize) -> Self {
        let r = reference(c);
        let decode = reference_decode(max_num_seqs, r.decode_context);
        let mut with_chunk = decode;
        with_chunk.add_seq(0, r.prefill_chunk, true, false);
        let decode_s = c.step_time(&decode);
        let marginal_s = (c.step_time(&with_chunk) - decode_s).max(0.0) / r.prefill_chunk as f64;
        let round = |x: f64, decimals: i32| {
            let scale = 10f64.powi(decimals);
            (x * scale).round() / scale
        };
        SloAwareParams {
            step_overhead_ms: round(decode_s * 1e3, 6).clamp(0.0, MAX_STEP_OVERHEAD_MS),
            prefill_us_per_token: round(marginal_s * 1e6, 3)
                .clamp(MIN_PREFILL_US_PER_TOKEN, MAX_PREFILL_US_PER_TOKEN),
        }
    }
}

/// The sequences of the reference decode step for an engine of `max_num_seqs`:
/// [`DECODE_BATCH`], at most `max_num_seqs` and at least one.
pub fn decode_batch(max_num_seqs: usize) -> u64 {
    DECODE_BATCH.min(max_num_seqs as u64).max(1)
}

/// The reference decode step: [`decode_batch`] sequences at `context` tokens each.
fn reference_decode(max_num_seqs: usize, context: u64) -> StepShape {
    let mut s = StepShape::default();
    for _ in 0..decode_batch(max_num_seqs) {
        s.add_seq(context, 1, false, true);
    }
    s
}

/// What a policy's run took from a calibration: the parameters its spec left unset.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamsFromCalibration {
    /// The calibration file, as the spec names it.
    pub calibration: String,
    /// `step_overhead_ms` taken from it (`None`: the spec sets it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_overhead_ms: Option<f64>,
    /// `prefill_us_per_token` taken from it (`None`: the spec sets it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefill_us_per_token: Option<f64>,
}

/// The parameters `policy` runs with: for a `slo-aware` policy whose `params` leave
/// `step_overhead_ms` or `prefill_us_per_token` unset, its params with those of `derived`
/// (from the calibration `calibration`) filled in, and what was taken; `None` when nothing
/// is (another policy, a spec that sets both, or params that are not a mapping, which the
/// registry refuses as it would have).
pub fn fill_in(
    policy: &PolicySpec,
    derived: &SloAwareParams,
    calibration: &str,
) -> Option<(serde_yaml::Value, ParamsFromCalibration)> {
    if policy.name != SLO_AWARE {
        return None;
    }
    let mut map = match &policy.params {
        serde_yaml::Value::Null => serde_yaml::Mapping::new(),
        serde_yaml::Value::Mapping(m) => m.clone(),
        _ => return None,
    };
    let mut taken = ParamsFromCalibration {
        calibration: calibration.to_string(),
        ..Default::default()
    };
    for (key, value, slot) in [
        (
            "step_overhead_ms",
            derived.step_overhead_ms,
            &mut taken.step_overhead_ms,
        ),
        (
            "prefill_us_per_token",
            derived.prefill_us_per_token,
            &mut taken.prefill_us_per_token,
        ),
    ] {
        let key = serde_yaml::Value::from(key);
        if !map.contains_key(&key) {
            map.insert(key, serde_yaml::Value::from(value));
            *slot = Some(value);
        }
    }
    if taken.step_overhead_ms.is_none() && taken.prefill_us_per_token.is_none() {
        return None;
    }
    Some((serde_yaml::Value::Mapping(map), taken))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fit of 2 ms per step, 10 us per token fed, 5 us more per prompt token, 1 ns per KV
    /// token and 0.1 ns per attention pair, no knee.
    fn known_fit() -> Calibration {
        Calibration {
            intercept_s: 2e-3,
            per_token_s: 10e-6,
            per_prefill_token_s: 5e-6,
            per_decode_seq_s: 20e-6,
            per_sampled_seq_s: 3e-6,
            per_kv_token_s: 1e-9,
            per_attention_pair_s: 1e-10,
            ..Default::default()
        }
    }

    #[test]
    fn a_known_fit_gives_the_expected_parameters() {
        // The decode step: 2 ms + 32 x (10 + 20 + 3) us + 32 x 1025 KV tokens x 1 ns
        // + 32 x 1025 pairs x 0.1 ns = 2 + 1.056 + 0.0328 + 0.00328 ms = 3.09208 ms.
        // The chunk of 512 adds 512 x (10 + 5) us + 512 KV tokens x 1 ns
        // + 512 x 513 / 2 pairs x 0.1 ns, per token 15 + 0.001 + 0.02565 us = 15.02665 us,
        // rounded to the nanosecond.
        let p = SloAwareParams::from_calibration(&known_fit(), 256);
        assert_eq!(p.step_overhead_ms, 3.09208);
        assert_eq!(p.prefill_us_per_token, 15.027);
    }

    #[test]
    fn the_decode_step_has_no_more_sequences_than_the_engine_runs() {
        // An engine of 8 sequences: 2 ms + 8 x (10 + 20 + 3) us + 8 x 1025 KV tokens x 1 ns
        // + 8 x 1025 pairs x 0.1 ns = 2 + 0.264 + 0.0082 + 0.00082 ms = 2.27302 ms (32
        // sequences, which it never runs, gave 3.09208). The chunk's marginal cost is the
        // same: no term of the fit couples it with the decodes.
        let p = SloAwareParams::from_calibration(&known_fit(), 8);
        assert_eq!(p.step_overhead_ms, 2.27302);
        assert_eq!(p.prefill_us_per_token, 15.027);
        // 32 and more: the reference step of 32.
        for seqs in [32, 33, 2048] {
            let p = SloAwareParams::from_calibration(&known_fit(), seqs);
            assert_eq!(p.step_overhead_ms, 3.09208, "{seqs}");
        }
        // 2: 2 ms + 2 x 33 us + 2 x 1.025 us + 2 x 0.1025 us = 2.068255 ms.
        assert_eq!(
            SloAwareParams::from_calibration(&known_fit(), 2).step_overhead_ms,
            2.068255
        );
        // 0 (which the scheduler's validation refuses) is taken as one sequence.
        assert_eq!(
            SloAwareParams::from_calibration(&known_fit(), 0),
            SloAwareParams::from_calibration(&known_fit(), 1)
        );
    }

    #[test]
    fn the_token_knee_counts_as_the_simulator_prices_it() {
        // With a knee of 1024 tokens the decode step pays per_token_s on 1024 tokens, and the
        // chunk's 512 tokens (544 in all) are still under it: only its per-prefill cost is
        // marginal.
        let c = Calibration {
            intercept_s: 1e-3,
            per_token_s: 1e-6,
            per_prefill_token_s: 2e-6,
            token_knee: Some(1024),
            ..Default::default()
        };
        let p = SloAwareParams::from_calibration(&c, 256);
        assert_eq!(p.step_overhead_ms, 2.024);
        assert_eq!(p.prefill_us_per_token, 2.0);
    }

    #[test]
    fn the_reference_steps_stay_within_the_contexts_measured() {
        // Measured up to 63 tokens (a sweep at --max-context 64), rounded up to 64: a decode
        // step of 8 sequences at 64 tokens of context and a 64-token chunk. Decode: 2 ms +
        // 8 x 33 us + 8 x 65 KV tokens x 1 ns + 8 x 65 pairs x 0.1 ns = 2 + 0.264 + 0.00052
        // + 0.000052 ms = 2.264572 ms. The chunk: 15 us + 1 ns per token, and 64 x 65 / 2 =
        // 2080 pairs x 0.1 ns = 208 ns over 64 tokens, 3.25 ns: 15.00425 us, 15.004 rounded
        // to the nanosecond.
        for m in [63, 64] {
            let short = Calibration {
                max_context: Some(m),
                ..known_fit()
            };
            assert_eq!(
                reference(&short),
                Reference {
                    decode_context: 64,
                    prefill_chunk: 64
                }
            );
            let p = SloAwareParams::from_calibration(&short, 8);
            assert_eq!(p.step_overhead_ms, 2.264572);
            assert_eq!(p.prefill_us_per_token, 15.004);
        }
        // A default sweep's 1,023 tokens, more, or no record of it: the constants.
        for m in [
            None,
            Some(0),
            Some(1023),
            Some(1025),
            Some(1 << 20),
            Some(u64::MAX),
        ] {
            let c = Calibration {
                max_context: m,
                ..known_fit()
            };
            assert_eq!(
                reference(&c),
                Reference {
                    decode_context: DECODE_CONTEXT,
                    prefill_chunk: PREFILL_CHUNK
                },
                "{m:?}"
            );
            assert_eq!(
                SloAwareParams::from_calibration(&c, 8).step_overhead_ms,
                2.27302
            );
        }
        // Between the two: the chunk is whole, the decode context 600 rounded up to 608.
        // One token: 16 of each.
        for (m, context, chunk) in [(600, 608, 512), (1, 16, 16)] {
            let c = Calibration {
                max_context: Some(m),
                ..known_fit()
            };
            assert_eq!(
                reference(&c),
                Reference {
                    decode_context: context,
                    prefill_chunk: chunk
                }
            );
        }
    }

    #[test]
    fn a_fit_without_per_token_cost_still_builds_a_policy() {
        let c = Calibration {
            intercept_s: 5e-3,
            ..Default::default()
        };
        let p = SloAwareParams::from_calibration(&c, 256);
        assert_eq!((p.step_overhead_ms, p.prefill_us_per_token), (5.0, 0.001));
        let (params, _) = fill_in(&PolicySpec::named(SLO_AWARE), &p, "cal.yaml").unwrap();
        switchyard_policies::PolicyRegistry::with_builtins()
            .create(SLO_AWARE, &params, &[])
            .expect("within the policy's bounds");
        // The largest costs a calibration accepts stay within them too.
        let huge = Calibration {
            intercept_s: 3599.0,
            per_token_s: 3599.0,
            per_prefill_token_s: 3599.0,
            per_attention_pair_s: 3599.0,
            ..Default::default()
        };
        let p = SloAwareParams::from_calibration(&huge, 256);
        let (params, _) = fill_in(&PolicySpec::named(SLO_AWARE), &p, "cal.yaml").unwrap();
        switchyard_policies::PolicyRegistry::with_builtins()
            .create(SLO_AWARE, &params, &[])
            .expect("within the policy's bounds");
    }

    fn spec(yaml: &str) -> PolicySpec {
        serde_yaml::from_str(yaml).unwrap()
    }

    #[test]
    fn only_the_parameters_a_spec_leaves_unset_are_filled_in() {
        let d = SloAwareParams {
            step_overhead_ms: 3.5,
            prefill_us_per_token: 12.25,
        };
        let (params, taken) = fill_in(&spec("{name: slo-aware}"), &d, "cal.yaml").unwrap();
        assert_eq!(
            params,
            serde_yaml::from_str::<serde_yaml::Value>(
                "{step_overhead_ms: 3.5, prefill_us_per_token: 12.25}"
            )
            .unwrap()
        );
        assert_eq!(
            (taken.step_overhead_ms, taken.prefill_us_per_token),
            (Some(3.5), Some(12.25))
        );
        let one = spec("{name: slo-aware, params: {step_overhead_ms: 8, min_chunk_tokens: 64}}");
        let (params, taken) = fill_in(&one, &d, "cal.yaml").unwrap();
        assert_eq!(
            params,
            serde_yaml::from_str::<serde_yaml::Value>(
                "{step_overhead_ms: 8, min_chunk_tokens: 64, prefill_us_per_token: 12.25}"
            )
            .unwrap()
        );
        assert_eq!(
            (taken.step_overhead_ms, taken.prefill_us_per_token),
            (None, Some(12.25))
        );
        let both =
            spec("{name: slo-aware, params: {step_overhead_ms: 8, prefill_us_per_token: 25}}");
        assert_eq!(fill_in(&both, &d, "cal.yaml"), None);
        assert_eq!(fill_in(&spec("{name: fcfs}"), &d, "cal.yaml"), None);
        // Not a mapping: left for the registry to refuse.
        assert_eq!(
            fill_in(&spec("{name: slo-aware, params: [1]}"), &d, "cal.yaml"),
            None
        );
    }
}
