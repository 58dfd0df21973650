//! Fitting the calibrated step-cost model ([`Calibration`]) to step times measured on the real
//! engine (`switchyard calibrate` measures them).
//!
//! The model is linear in ten features of a step's [`StepShape`] (see [`crate::cost`]), and a
//! cost cannot be negative, so the fit is a non-negative least-squares problem, solved with
//! Lawson and Hanson's active-set method ("Solving Least Squares Problems", 1974, ch. 23).
//! Step times span three orders of magnitude (a decode step of one sequence against a prefill
//! of thousands of tokens), so the residuals are relative: every row is divided by its
//! measured time, and a 10% error costs the same on a 2 ms step as on a 2 s one.
//!
//! One term is not linear: a step pays the per-token cost on at least `token_knee` tokens
//! (the roofline's knee: below it a step streams the weights whatever it computes, so a
//! decode of 8 sequences costs what one of 1 does). The knee is chosen by fitting every
//! candidate (none, and the powers of two up to the largest step measured) and keeping the
//! one whose fit has the least squared relative error: no knee is one of the candidates, so
//! the fit is never worse than the linear model's.

use crate::cost::{Calibration, StepShape};
use serde::{Deserialize, Serialize};

/// Number of coefficients of the linear model.
pub const NUM_TERMS: usize = 10;

/// The coefficients' names, in [`features`] order, as the calibration file spells them.
pub const TERM_NAMES: [&str; NUM_TERMS] = [
    "intercept_s",
    "per_token_s",
    "per_prefill_token_s",
    "per_decode_seq_s",
    "per_sampled_seq_s",
    "per_kv_token_s",
    "per_attention_pair_s",
    "per_lora_token_s",
    "per_adapter_s",
    "per_lora_step_s",
];

/// Most samples a fit takes (a sweep of the engine measures a few hundred distinct shapes).
pub const MAX_SAMPLES: usize = 1_000_000;
/// Shortest step time fitted, in seconds (a tenth of a microsecond: below any real step).
pub const MIN_SECONDS: f64 = 1e-7;
/// Longest step time fitted, in seconds.
pub const MAX_SECONDS: f64 = 3600.0;
/// Largest value of a step's feature (2^53: every count exact as a float), so that a row over
/// its time stays far from overflowing.
pub const MAX_FEATURE: f64 = 9_007_199_254_740_992.0;

/// One measured step: its shape and the time the backend took for it.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sample {
    /// The step's work.
    pub shape: StepShape,
    /// The backend's time for the step, in seconds.
    pub seconds: f64,
}

/// Largest knee tried, in tokens.
pub const MAX_TOKEN_KNEE: u64 = 1 << 20;

/// The model's features of one step, in [`TERM_NAMES`] order, with the per-token cost paid
/// on at least `knee` tokens.
pub fn features(s: &StepShape, knee: u64) -> [f64; NUM_TERMS] {
    [
        1.0,
        s.num_tokens.max(knee) as f64,
        s.num_prefill_tokens as f64,
        s.num_decode_seqs as f64,
        s.num_sampled as f64,
        s.kv_tokens as f64,
        s.attention_pairs as f64,
        s.lora_tokens as f64,
        s.lora_adapters as f64,
        f64::from(u8::from(s.lora_adapters > 0)),
    ]
}

/// A fitted model and how well it describes the samples it was fitted to.
#[derive(Clone, Debug, PartialEq)]
pub struct Fit {
    /// The coefficients (the informational and engine fields left empty).
    pub calibration: Calibration,
    /// Samples fitted.
    pub num_samples: usize,
    /// Relative error (predicted / measured - 1) of every sample, in the samples' order.
    pub relative_errors: Vec<f64>,
}

impl Fit {
    /// The `q` quantile (0..=1, nearest rank) of the absolute relative errors.
    pub fn abs_error_quantile(&self, q: f64) -> f64 {
        let mut e: Vec<f64> = self.relative_errors.iter().map(|e| e.abs()).collect();
        e.sort_by(f64::total_cmp);
        if e.is_empty() {
            return 0.0;
        }
        let i = ((q.clamp(0.0, 1.0) * e.len() as f64).ceil() as usize).clamp(1, e.len()) - 1;
        e[i]
    }
}

/// Why a fit could not be made.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum FitError {
    /// Fewer samples than the model has terms.
    #[error("{0} step samples: a fit needs at least {NUM_TERMS} distinct steps")]
    TooFewSamples(usize),
    /// More samples than a fit takes.
    #[error("{0} step samples: at most {MAX_SAMPLES} are fitted")]
    TooManySamples(usize),
    /// A sample's time is not a finite number of seconds in `MIN_SECONDS..MAX_SECONDS`.
    #[error("step sample {index}: time {seconds:e} s is not between 1e-7 s and an hour")]
    BadTime {
        /// The sample's position.
        index: usize,
        /// Its time.
        seconds: f64,
    },
    /// A sample has no work (an empty step costs nothing to fit).
    #[error("step sample {0}: an empty step (no sequence)")]
    EmptyStep(usize),
    /// A sample's counts are beyond any step, or contradict each other.
    #[error("step sample {index}: {reason}")]
    BadShape {
        /// The sample's position.
        index: usize,
        /// Which count is out of bounds or disagrees with which.
        reason: String,
    },
    /// The fit broke down (every coefficient zero, or not finite).
    #[error("the fit broke down: the samples' features and times are not of one engine")]
    Degenerate,
}

/// Most tokens one sequence of a step decodes: its next token and up to 16 drafts (the most
/// `speculative.num_speculative_tokens` allows).
const MAX_DECODE_TOKENS_PER_SEQ: u64 = 17;
/// Longest context of one sequence (the largest `max_model_len` a spec accepts).
const MAX_CONTEXT: u64 = 1 << 24;

/// Checks that a measured step's counts are within what a server runs and agree with each
/// other, as [`StepShape::add_seq`] builds them: every sequence feeds at least one token, a
/// prefilling one prompt tokens, a decoding one its next token and at most 16 drafts; a step
/// samples at most one row per token; every token fed is in the KV and attends to at least
/// one key and at most the step's KV tokens; adapted tokens are tokens fed, and each adapter is
/// some adapted sequence's. A file edited by hand, or from another program,
/// is refused here rather than fitted.
pub fn check_shape(s: &StepShape) -> Result<(), String> {
    let (max_seqs, max_tokens) = (
        switchyard_config::MAX_NUM_SEQS as u64,
        switchyard_config::MAX_NUM_BATCHED_TOKENS as u64,
    );
    if !(1..=max_seqs).contains(&s.num_seqs) {
        return Err(format!(
            "num_seqs {} outside 1..={max_seqs} (the server's max_num_seqs)",
            s.num_seqs
        ));
    }
    if !(s.num_seqs..=max_tokens).contains(&s.num_tokens) {
        return Err(format!(
            "num_tokens {} outside num_seqs..={max_tokens} ({} sequences feed at least one token \
             each; the server's max_num_batched_tokens)",
            s.num_tokens, s.num_seqs
        ));
    }
    if s.num_prefill_tokens > s.num_tokens || s.num_decode_seqs > s.num_seqs {
        return Err(format!(
            "num_prefill_tokens {} and num_decode_seqs {} must be at most num_tokens {} and \
             num_seqs {}",
            s.num_prefill_tokens, s.num_decode_seqs, s.num_tokens, s.num_seqs
        ));
    }
    let prefill_seqs = s.num_seqs - s.num_decode_seqs;
    if s.num_prefill_tokens < prefill_seqs {
        return Err(format!(
            "num_prefill_tokens {} for {prefill_seqs} prefilling sequences (num_seqs - \
             num_decode_seqs): each feeds at least one",
            s.num_prefill_tokens
        ));
    }
    let decode_tokens = s.num_tokens - s.num_prefill_tokens;
    let most = s.num_decode_seqs * MAX_DECODE_TOKENS_PER_SEQ;
    if !(s.num_decode_seqs..=most).contains(&decode_tokens) {
        return Err(format!(
            "num_tokens - num_prefill_tokens = {decode_tokens} decode tokens for {} decoding \
             sequences: each decodes 1 to {MAX_DECODE_TOKENS_PER_SEQ} (its token and up to 16 \
             drafts)",
            s.num_decode_seqs
        ));
    }
    if s.num_sampled > s.num_tokens {
        return Err(format!(
            "num_sampled {} above num_tokens {}: a step samples at most one row per token",
            s.num_sampled, s.num_tokens
        ));
    }
    if !(s.num_tokens..=s.num_seqs * MAX_CONTEXT).contains(&s.kv_tokens) {
        return Err(format!(
            "kv_tokens {} outside num_tokens..=num_seqs * {MAX_CONTEXT} (the tokens fed are in \
             the KV; no sequence is longer than {MAX_CONTEXT})",
            s.kv_tokens
        ));
    }
    if !(s.num_tokens..=s.num_tokens.saturating_mul(s.kv_tokens)).contains(&s.attention_pairs) {
        return Err(format!(
            "attention_pairs {} outside num_tokens..=num_tokens * kv_tokens (every token fed \
             attends to at least one key, and to at most the step's KV tokens)",
            s.attention_pairs
        ));
    }
    if s.lora_tokens > s.num_tokens || s.lora_adapters > s.num_seqs.min(s.lora_tokens) {
        return Err(format!(
            "lora_tokens {} and lora_adapters {} must be at most num_tokens {} and the fewer of \
             num_seqs {} and lora_tokens (each adapter is some adapted sequence's)",
            s.lora_tokens, s.lora_adapters, s.num_tokens, s.num_seqs
        ));
    }
    if s.lora_tokens > 0 && s.lora_adapters == 0 {
        return Err(format!(
            "lora_tokens {} in a step of no adapter",
            s.lora_tokens
        ));
    }
    Ok(())
}

/// The longest context a sequence of `samples`' steps had, at least: each step's KV tokens
/// (context plus new tokens, summed over its sequences) over its sequences, rounded up: exact
/// for a step of one sequence, the mean for a batch.
pub fn longest_context(samples: &[Sample]) -> u64 {
    samples
        .iter()
        .filter(|s| s.shape.num_seqs > 0)
        .map(|s| s.shape.kv_tokens.div_ceil(s.shape.num_seqs))
        .max()
        .unwrap_or(0)
}

/// Fits the calibrated model to `samples`, minimising the squared relative errors with every
/// coefficient at least zero. A term the samples cannot tell apart from the others (a feature
/// that is zero everywhere, or a combination of others) gets what the active-set method gives
/// it, usually zero: the predictions of the samples are what the fit answers for. Without
/// speculative decoding every decode feeds one token, so the tokens of a step are its prompt
/// tokens plus its decodes and the per-token cost is shared out between the other two.
pub fn fit(samples: &[Sample]) -> Result<Fit, FitError> {
    if samples.len() < NUM_TERMS {
        return Err(FitError::TooFewSamples(samples.len()));
    }
    if samples.len() > MAX_SAMPLES {
        return Err(FitError::TooManySamples(samples.len()));
    }
    for (index, s) in samples.iter().enumerate() {
        if !(s.seconds.is_finite() && (MIN_SECONDS..MAX_SECONDS).contains(&s.seconds)) {
            return Err(FitError::BadTime {
                index,
                seconds: s.seconds,
            });
        }
        if s.shape.num_seqs == 0 {
            return Err(FitError::EmptyStep(index));
        }
        check_shape(&s.shape).map_err(|reason| FitError::BadShape { index, reason })?;
        if features(&s.shape, 0).iter().any(|&f| f > MAX_FEATURE) {
            return Err(FitError::BadShape {
                index,
                reason: "a count above 2^53".into(),
            });
        }
    }
    let largest = samples
        .iter()
        .map(|s| s.shape.num_tokens)
        .max()
        .unwrap_or(0)
        .min(MAX_TOKEN_KNEE);
    // No knee, then 2, 4, ... up to the largest step (a knee above it is a constant).
    let knees = std::iter::once(0).chain(
        std::iter::successors(Some(2u64), |k| Some(k * 2)).take_while(move |&k| k <= largest),
    );
    let mut best: Option<(f64, u64, [f64; NUM_TERMS])> = None;
    for knee in knees {
        let c = fit_linear(samples, knee)?;
        let sse: f64 = samples
            .iter()
            .map(|s| (predict(&c, knee, &s.shape) / s.seconds - 1.0).powi(2))
            .sum();
        // A knee is kept only where it fits better by more than rounding.
        if best.is_none_or(|(b, _, _)| sse < b * (1.0 - 1e-9)) {
            best = Some((sse, knee, c));
        }
    }
    let (_, knee, c) = best.ok_or(FitError::Degenerate)?;
    let calibration = Calibration {
        intercept_s: c[0],
        per_token_s: c[1],
        per_prefill_token_s: c[2],
        per_decode_seq_s: c[3],
        per_sampled_seq_s: c[4],
        per_kv_token_s: c[5],
        per_attention_pair_s: c[6],
        per_lora_token_s: c[7],
        per_adapter_s: c[8],
        per_lora_step_s: c[9],
        token_knee: (knee > 0 && c[1] > 0.0).then_some(knee),
        ..Calibration::default()
    };
    let relative_errors = samples
        .iter()
        .map(|s| predict(&c, knee, &s.shape) / s.seconds - 1.0)
        .collect();
    Ok(Fit {
        calibration,
        num_samples: samples.len(),
        relative_errors,
    })
}

/// Groups of samples the jackknife of [`group_refits`] leaves out in turn.
pub const JACKKNIFE_GROUPS: usize = 10;

/// The fits of `samples` with each of [`JACKKNIFE_GROUPS`] groups left out in turn (sample
/// `i` in group `i % JACKKNIFE_GROUPS`: a sweep's samples come measurement by measurement, so
/// each group takes a little of every kind of step), for a delete-a-group jackknife
/// ([`jackknife_error`]) of what is derived from the fit. Fewer than
/// `NUM_TERMS * JACKKNIFE_GROUPS / (JACKKNIFE_GROUPS - 1)` samples leave a refit too few:
/// [`FitError::TooFewSamples`], as the fit itself.
pub fn group_refits(samples: &[Sample]) -> Result<Vec<Fit>, FitError> {
    (0..JACKKNIFE_GROUPS)
        .map(|g| {
            let kept: Vec<Sample> = samples
                .iter()
                .enumerate()
                .filter(|(i, _)| i % JACKKNIFE_GROUPS != g)
                .map(|(_, s)| *s)
                .collect();
            fit(&kept)
        })
        .collect()
}

/// The delete-a-group jackknife's standard error of a value from the values the
/// [`group_refits`] give it: `sqrt((g - 1) / g * sum((v_i - mean)^2))` over the `g` refits
/// (Efron and Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 11). Where it is
/// large against the value, the samples do not determine it: a small change in the steps
/// measured moves it that much. 0 for fewer than two values.
pub fn jackknife_error(values: &[f64]) -> f64 {
    let g = values.len() as f64;
    if values.len() < 2 {
        return 0.0;
    }
    let mean = values.iter().sum::<f64>() / g;
    ((g - 1.0) / g * values.iter().map(|v| (v - mean).powi(2)).sum::<f64>()).sqrt()
}

/// The linear model's coefficients for `samples` with the per-token cost paid on at least
/// `knee` tokens.
fn fit_linear(samples: &[Sample], knee: u64) -> Result<[f64; NUM_TERMS], FitError> {
    // Rows divided by the measured time: the target is 1 everywhere.
    let rows: Vec<[f64; NUM_TERMS]> = samples
        .iter()
        .map(|s| features(&s.shape, knee).map(|f| f / s.seconds))
        .collect();
    let target = vec![1.0; rows.len()];
    // Columns scaled to unit length, so the solver's tolerances mean the same for every term
    // (attention pairs run to 1e9 where the intercept's column is 1 / seconds).
    let mut scale = [0.0f64; NUM_TERMS];
    for r in &rows {
        for (j, v) in r.iter().enumerate() {
            scale[j] += v * v;
        }
    }
    let scale = scale.map(|s| if s > 0.0 { s.sqrt() } else { 1.0 });
    let scaled: Vec<[f64; NUM_TERMS]> = rows
        .iter()
        .map(|r| std::array::from_fn(|j| r[j] / scale[j]))
        .collect();
    let x = nnls(&scaled, &target);
    let c: [f64; NUM_TERMS] = std::array::from_fn(|j| x[j] / scale[j]);
    // With positive times and features the intercept alone beats all zeros, so zeros (or
    // non-finite values) mean the arithmetic broke down.
    if c.iter().all(|&v| v == 0.0) || c.iter().any(|v| !v.is_finite()) {
        return Err(FitError::Degenerate);
    }
    Ok(c)
}

/// The model's time for `shape` with coefficients `c` and `knee` (no floor).
fn predict(c: &[f64; NUM_TERMS], knee: u64, shape: &StepShape) -> f64 {
    features(shape, knee)
        .iter()
        .zip(c)
        .map(|(f, c)| f * c)
        .sum()
}

/// Non-negative least squares: `x >= 0` minimising `|A x - b|²`, by Lawson and Hanson's
/// active-set method. `a` has one row per observation.
pub fn nnls(a: &[[f64; NUM_TERMS]], b: &[f64]) -> [f64; NUM_TERMS] {
    let n = NUM_TERMS;
    let norm_b = b.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-300);
    // A gradient component below this is zero (relative to the data's size).
    let tol = 1e-10 * norm_b * (a.len() as f64).sqrt().max(1.0);
    let mut x = [0.0f64; NUM_TERMS];
    let mut passive = [false; NUM_TERMS];
    // Each outer iteration frees one coefficient; the inner loop only binds them again, so
    // a bound of a few times the terms is never reached on a well-posed problem.
    for _ in 0..3 * n {
        let w = gradient(a, b, &x);
        let Some(j) = (0..n)
            .filter(|&j| !passive[j] && w[j] > tol)
            .max_by(|&i, &k| w[i].total_cmp(&w[k]))
        else {
            break;
        };
        passive[j] = true;
        for _ in 0..=n {
            let Some(s) = least_squares(a, b, &passive) else {
                // The freed column is a combination of the others: bind it again.
                passive[j] = false;
                break;
            };
            if (0..n).all(|i| !passive[i] || s[i] > 0.0) {
                x = s;
                break;
            }
            // Step from x towards s as far as every coefficient stays >= 0, then bind
            // the ones that reached zero.
            let alpha = (0..n)
                .filter(|&i| passive[i] && s[i] <= 0.0)
                .map(|i| x[i] / (x[i] - s[i]))
                .fold(f64::INFINITY, f64::min);
            for i in 0..n {
                x[i] += alpha * (s[i] - x[i]);
                if passive[i] && x[i] <= 1e-15 * x.iter().fold(0.0f64, |m, v| m.max(v.abs())) {
                    passive[i] = false;
                    x[i] = 0.0;
                }
            }
        }
    }
    x
}

/// `Aᵀ (b - A x)`: the negative gradient of half the squared residual.
fn gradient(a: &[[f64; NUM_TERMS]], b: &[f64], x: &[f64; NUM_TERMS]) -> [f64; NUM_TERMS] {
    let mut w = [0.0; NUM_TERMS];
    for (row, &bi) in a.iter().zip(b) {
        let r = bi - row.iter().zip(x).map(|(v, x)| v * x).sum::<f64>();
        for (wj, v) in w.iter_mut().zip(row) {
            *wj += v * r;
        }
    }
    w
}

/// Unconstrained least squares over the `passive` columns (the others zero), by the normal
/// equations and a Cholesky factorisation (the columns are unit length, so they are well
/// scaled). `None` when those columns are (numerically) dependent.
fn least_squares(
    a: &[[f64; NUM_TERMS]],
    b: &[f64],
    passive: &[bool; NUM_TERMS],
) -> Option<[f64; NUM_TERMS]> {
    let cols: Vec<usize> = (0..NUM_TERMS).filter(|&j| passive[j]).collect();
    let k = cols.len();
    let mut g = vec![vec![0.0f64; k]; k];
    let mut rhs = vec![0.0f64; k];
    for (row, &bi) in a.iter().zip(b) {
        for (p, &i) in cols.iter().enumerate() {
            rhs[p] += row[i] * bi;
            for (q, &j) in cols.iter().enumerate().take(p + 1) {
                g[p][q] += row[i] * row[j];
            }
        }
    }
    // Cholesky: g = L Lᵀ, in place in the lower triangle.
    let max_diag = (0..k).map(|p| g[p][p]).fold(0.0f64, f64::max);
    for p in 0..k {
        for q in 0..=p {
            let dot: f64 = g[p][..q].iter().zip(&g[q][..q]).map(|(a, b)| a * b).sum();
            let v = g[p][q] - dot;
            if p == q {
                if v <= 1e-12 * max_diag {
                    return None;
                }
                g[p][p] = v.sqrt();
            } else {
                g[p][q] = v / g[q][q];
            }
        }
    }
    // L y = rhs, then Lᵀ s = y.
    let mut y = rhs;
    for p in 0..k {
        for r in 0..p {
            y[p] -= g[p][r] * y[r];
        }
        y[p] /= g[p][p];
    }
    for p in (0..k).rev() {
        for r in p + 1..k {
            y[p] -= g[r][p] * y[r];
        }
        y[p] /= g[p][p];
    }
    let mut s = [0.0; NUM_TERMS];
    for (p, &j) in cols.iter().enumerate() {
        s[j] = y[p];
    }
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shape(seqs: &[(u64, u64, bool)]) -> StepShape {
        let mut s = StepShape::default();
        for &(computed, new, prefill) in seqs {
            s.add_seq(computed, new, prefill, true);
        }
        s
    }

    /// Shapes like a sweep's: prefills of several lengths (some chunked, past cached tokens),
    /// decodes at several batches and contexts, and mixed steps.
    fn sweep() -> Vec<StepShape> {
        let mut out = Vec::new();
        for p in [16, 64, 256, 1024] {
            out.push(shape(&[(0, p, true)]));
            out.push(shape(&[(p, p, true)]));
            out.push(shape(&[(0, p, true); 4]));
        }
        for b in [1usize, 2, 8, 32] {
            for c in [32, 300, 1000] {
                out.push(shape(&vec![(c, 1, false); b]));
                // Decodes with three drafts each: without them every decode feeds one token,
                // T = T_prefill + D, and the per-token, per-prefill-token and per-decode costs
                // cannot be told apart.
                let mut drafts = shape(&vec![(c, 4, false); b]);
                drafts.num_sampled += 3 * b as u64;
                out.push(drafts);
                let mut mixed = vec![(c, 1, false); b];
                mixed.push((0, 128, true));
                out.push(shape(&mixed));
            }
        }
        out
    }

    /// The longest context is exact for a step of one sequence, the mean (rounded up) for a
    /// batch, the largest over the samples.
    #[test]
    fn the_longest_context_measured() {
        let sample = |shape| Sample {
            shape,
            seconds: 1e-3,
        };
        assert_eq!(longest_context(&[]), 0);
        let one = sample(shape(&[(1000, 24, true)]));
        let batch = sample(shape(&[(2000, 1, false), (10, 1, false)]));
        assert_eq!(longest_context(std::slice::from_ref(&one)), 1024);
        // (2001 + 11) / 2.
        assert_eq!(longest_context(std::slice::from_ref(&batch)), 1006);
        assert_eq!(longest_context(&[batch, one]), 1024);
    }

    /// Steps of `shapes` timed exactly as the model with coefficients `truth` predicts.
    fn exact_samples(truth: &[f64; NUM_TERMS], shapes: Vec<StepShape>) -> Vec<Sample> {
        shapes
            .into_iter()
            .map(|shape| Sample {
                shape,
                seconds: predict(truth, 0, &shape),
            })
            .collect()
    }

    /// Data made by the model itself is fitted exactly, every coefficient recovered.
    #[test]
    fn recovers_the_coefficients_that_made_the_data() {
        let truth = [2e-3, 5e-6, 1e-6, 3e-5, 4e-5, 2e-8, 1e-10, 0.0, 0.0, 0.0];
        let samples = exact_samples(&truth, sweep());
        let f = fit(&samples).unwrap();
        let c = &f.calibration;
        let got = [
            c.intercept_s,
            c.per_token_s,
            c.per_prefill_token_s,
            c.per_decode_seq_s,
            c.per_sampled_seq_s,
            c.per_kv_token_s,
            c.per_attention_pair_s,
            c.per_lora_token_s,
            c.per_adapter_s,
            c.per_lora_step_s,
        ];
        for (j, (g, t)) in got.iter().zip(truth).enumerate() {
            assert!((g - t).abs() <= 1e-6 * t, "{}: {g} vs {t}", TERM_NAMES[j]);
        }
        assert!(f.abs_error_quantile(1.0) < 1e-9);
        assert!(c.validate().is_ok());
    }

    /// `shape` with every sequence adapted, over `adapters` distinct adapters.
    fn adapted(mut s: StepShape, adapters: u64) -> StepShape {
        s.lora_tokens = s.num_tokens;
        s.lora_adapters = adapters.min(s.num_seqs);
        s
    }

    /// A sweep with steps whose every sequence has an adapter, over 1, 2 and 4 distinct ones
    /// (`switchyard calibrate --lora`'s), recovers the LoRA terms beside the others.
    #[test]
    fn recovers_the_lora_coefficients_that_made_the_data() {
        let truth = [2e-3, 5e-6, 1e-6, 3e-5, 4e-5, 2e-8, 1e-10, 2e-6, 7e-5, 4e-4];
        let mut shapes = sweep();
        for p in [16, 256] {
            shapes.push(adapted(shape(&[(0, p, true)]), 1));
        }
        for n in [1, 2, 4] {
            shapes.push(adapted(shape(&[(0, 64, true); 4]), n));
            for b in [4usize, 16] {
                shapes.push(adapted(shape(&vec![(256, 1, false); b]), n));
                let mut mixed = vec![(256, 1, false); b];
                mixed.push((0, 64, true));
                shapes.push(adapted(shape(&mixed), n));
            }
        }
        shapes.push(adapted(shape(&[(32, 1, false)]), 1));
        let samples = exact_samples(&truth, shapes);
        let f = fit(&samples).unwrap();
        let c = &f.calibration;
        assert!(
            (c.per_lora_token_s - truth[7]).abs() <= 1e-6 * truth[7],
            "{}",
            c.per_lora_token_s
        );
        assert!(
            (c.per_adapter_s - truth[8]).abs() <= 1e-6 * truth[8],
            "{}",
            c.per_adapter_s
        );
        assert!(
            (c.per_lora_step_s - truth[9]).abs() <= 1e-6 * truth[9],
            "{}",
            c.per_lora_step_s
        );
        assert!((c.per_token_s - truth[1]).abs() <= 1e-6 * truth[1]);
        assert!(f.abs_error_quantile(1.0) < 1e-9);
        // Without the adapted steps, the LoRA terms stay zero: nothing to fit them on.
        let base: Vec<Sample> = samples
            .iter()
            .filter(|s| s.shape.lora_tokens == 0)
            .copied()
            .collect();
        let b = fit(&base).unwrap().calibration;
        assert_eq!(
            (b.per_lora_token_s, b.per_adapter_s, b.per_lora_step_s),
            (0.0, 0.0, 0.0)
        );
    }

    /// Data made with a knee (a step pays the per-token cost on at least 64 tokens) is fitted
    /// exactly with that knee; the linear model alone could not.
    #[test]
    fn finds_the_knee_that_made_the_data() {
        let truth = [2e-3, 5e-6, 1e-6, 3e-5, 4e-5, 2e-8, 1e-10, 0.0, 0.0, 0.0];
        let samples: Vec<Sample> = sweep()
            .into_iter()
            .map(|shape| Sample {
                shape,
                seconds: predict(&truth, 64, &shape),
            })
            .collect();
        let f = fit(&samples).unwrap();
        assert_eq!(f.calibration.token_knee, Some(64));
        assert!((f.calibration.per_token_s - truth[1]).abs() <= 1e-6 * truth[1]);
        assert!(f.abs_error_quantile(1.0) < 1e-9, "{:?}", f.relative_errors);
        let linear = fit_linear(&samples, 0).unwrap();
        let worst = samples
            .iter()
            .map(|s| (predict(&linear, 0, &s.shape) / s.seconds - 1.0).abs())
            .fold(0.0, f64::max);
        assert!(worst > 1e-3, "{worst}");
        // The simulator prices a step as the fit does.
        let small = shape(&[(40, 1, false); 2]);
        let want = predict(&truth, 64, &small);
        assert!((f.calibration.step_time(&small) - want).abs() <= 1e-9 * want);
    }

    /// A cost that falls with the work (a negative coefficient would fit it best) is fitted
    /// with that coefficient at zero, never below.
    #[test]
    fn never_fits_a_negative_cost() {
        let samples: Vec<Sample> = sweep()
            .into_iter()
            .map(|shape| Sample {
                shape,
                seconds: (1e-2 - 1e-6 * shape.num_tokens as f64).max(1e-4)
                    + 1e-5 * shape.num_decode_seqs as f64,
            })
            .collect();
        let f = fit(&samples).unwrap();
        assert!(f.calibration.validate().is_ok(), "{:?}", f.calibration);
        assert_eq!(f.calibration.per_token_s, 0.0);
    }

    #[test]
    fn refuses_what_it_cannot_fit() {
        let one = Sample {
            shape: shape(&[(0, 8, true)]),
            seconds: 1e-3,
        };
        assert_eq!(fit(&[one; 3]), Err(FitError::TooFewSamples(3)));
        let mut s = vec![one; NUM_TERMS + 1];
        s[2].seconds = f64::NAN;
        assert!(matches!(fit(&s), Err(FitError::BadTime { index: 2, .. })));
        s[2].seconds = -1.0;
        assert!(matches!(fit(&s), Err(FitError::BadTime { index: 2, .. })));
        s[2].seconds = 1e-300;
        assert!(matches!(fit(&s), Err(FitError::BadTime { index: 2, .. })));
        s[2] = Sample {
            shape: StepShape::default(),
            seconds: 1e-3,
        };
        assert_eq!(fit(&s), Err(FitError::EmptyStep(2)));
        s[2].shape = shape(&[(0, 8, true)]);
        s[2].shape.attention_pairs = u64::MAX;
        assert!(matches!(fit(&s), Err(FitError::BadShape { index: 2, .. })));
    }

    /// A sample whose counts contradict each other is refused, naming the count: 10^12 tokens
    /// in a step of one sequence that prefills 16 (the shape of a hand-edited file).
    #[test]
    fn samples_whose_counts_contradict_each_other_are_refused() {
        let good = shape(&[(0, 16, true), (100, 1, true), (40, 3, false)]);
        check_shape(&good).unwrap();
        let mut s: Vec<Sample> = sweep()
            .into_iter()
            .map(|shape| Sample {
                shape,
                seconds: 1e-3,
            })
            .collect();
        let sweep_checks = s.iter().map(|x| check_shape(&x.shape)).collect::<Vec<_>>();
        assert!(sweep_checks.iter().all(Result::is_ok), "{sweep_checks:?}");
        let one = shape(&[(0, 16, true)]);
        type Edit = fn(&mut StepShape);
        let cases: [(Edit, &str); 11] = [
            (|x| x.lora_tokens = 17, "lora_tokens 17 and lora_adapters 0"),
            (
                |x| {
                    x.lora_tokens = 16;
                    x.lora_adapters = 2
                },
                "lora_tokens 16 and lora_adapters 2",
            ),
            (
                |x| x.lora_tokens = 3,
                "lora_tokens 3 in a step of no adapter",
            ),
            (
                |x| x.num_tokens = 1_000_000_000_000,
                "num_tokens 1000000000000 outside",
            ),
            (
                |x| x.num_tokens = 17,
                "1 decode tokens for 0 decoding sequences",
            ),
            (|x| x.num_seqs = 5000, "num_seqs 5000 outside 1..=2048"),
            (|x| x.num_prefill_tokens = 17, "num_prefill_tokens 17 and"),
            (|x| x.num_sampled = 20, "num_sampled 20 above num_tokens 16"),
            (|x| x.kv_tokens = 15, "kv_tokens 15 outside"),
            (|x| x.attention_pairs = 3, "attention_pairs 3 outside"),
            (
                |x| x.num_decode_seqs = 1,
                "0 decode tokens for 1 decoding sequences",
            ),
        ];
        for (edit, want) in cases {
            let mut bad = one;
            edit(&mut bad);
            s[3].shape = bad;
            match fit(&s) {
                Err(FitError::BadShape { index: 3, reason }) => {
                    assert!(reason.contains(want), "want {want}: {reason}")
                }
                other => panic!("want {want}: {other:?}"),
            }
        }
    }

    /// Identical samples leave most terms unidentifiable: the fit still answers the samples.
    #[test]
    fn collinear_samples_are_still_predicted() {
        let s = vec![
            Sample {
                shape: shape(&[(100, 1, false); 4]),
                seconds: 5e-3,
            };
            NUM_TERMS
        ];
        let f = fit(&s).unwrap();
        assert!(f.abs_error_quantile(1.0) < 1e-9, "{:?}", f.relative_errors);
        assert!(f.calibration.validate().is_ok());
    }

    /// The jackknife's standard error, worked out by hand: values 1, 2, 3, 4 have mean 2.5
    /// and squared deviations 2.25 + 0.25 + 0.25 + 2.25 = 5, times 3 / 4: sqrt(3.75).
    #[test]
    fn the_jackknife_error_is_the_textbook_one() {
        assert_eq!(jackknife_error(&[1.0, 2.0, 3.0, 4.0]), 3.75f64.sqrt());
        assert_eq!(jackknife_error(&[7.0; 10]), 0.0);
        assert_eq!(jackknife_error(&[7.0]), 0.0);
        assert_eq!(jackknife_error(&[]), 0.0);
    }

    /// Exact data: every refit leaving a group out recovers the coefficients, so what is
    /// derived from them does not move. Too few samples for the refits: refused as the fit.
    #[test]
    fn refits_of_exact_data_agree() {
        let truth = [2e-3, 5e-6, 1e-6, 3e-5, 4e-5, 2e-8, 1e-10, 0.0, 0.0, 0.0];
        let samples = exact_samples(&truth, sweep());
        let refits = group_refits(&samples).unwrap();
        assert_eq!(refits.len(), JACKKNIFE_GROUPS);
        let decode = shape(&[(1024, 1, false); 32]);
        let want = predict(&truth, 0, &decode);
        // 48 samples: groups 0 to 7 take 5 each, 8 and 9 take 4.
        assert_eq!(samples.len(), 48);
        for (g, r) in refits.iter().enumerate() {
            assert_eq!(r.num_samples, if g < 8 { 43 } else { 44 }, "{g}");
            assert!((r.calibration.step_time(&decode) - want).abs() <= 1e-9 * want);
        }
        let few = &samples[..NUM_TERMS + 1];
        assert!(matches!(group_refits(few), Err(FitError::TooFewSamples(_))));
    }

    /// The sweep of `calibrate --max-context 64` before it kept every kind of step: prefills
    /// of 16 and 63 tokens, 16 past a cached 32, and decodes of 1 to 64 sequences at contexts
    /// 32 to 40 and 52 to 60 only, where a step's context tokens are nearly its sequences
    /// times 45; times off the model by up to 10% (a noisy machine). A 32-sequence decode at
    /// 1,024 tokens of context is far outside what was measured: the fit's KV term, which the
    /// decodes cannot tell from their per-sequence cost, decides it, and the refits leaving a
    /// tenth of the steps out disagree on it far more than on the same step at 60 tokens.
    #[test]
    fn the_jackknife_tells_an_extrapolation_from_an_interpolation() {
        let truth = [2e-3, 1e-3, 4e-4, 5e-5, 0.0, 2e-7, 1e-8, 0.0, 0.0, 0.0];
        let mut shapes = vec![
            shape(&[(0, 16, true)]),
            shape(&[(0, 63, true)]),
            shape(&[(0, 32, true)]),
            shape(&[(32, 16, true)]),
        ];
        for c in [32, 52] {
            for b in [1usize, 4, 16, 64] {
                shapes.push(shape(&vec![(0, c, true); b.min(2048 / c as usize)]));
                for k in 0..8 {
                    shapes.push(shape(&vec![(c + k, 1, false); b]));
                }
            }
        }
        // A deterministic noise of -10% to +10% (a linear congruential generator).
        let mut x = 12345u64;
        let samples: Vec<Sample> = shapes
            .into_iter()
            .map(|shape| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let noise = ((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 0.2;
                Sample {
                    shape,
                    seconds: predict(&truth, 0, &shape) * (1.0 + noise),
                }
            })
            .collect();
        let full = fit(&samples).unwrap();
        let refits = group_refits(&samples).unwrap();
        let relative = |step: &StepShape| {
            let v: Vec<f64> = refits
                .iter()
                .map(|r| r.calibration.step_time(step))
                .collect();
            jackknife_error(&v) / full.calibration.step_time(step)
        };
        let far = relative(&shape(&[(1024, 1, false); 32]));
        let near = relative(&shape(&[(60, 1, false); 32]));
        // Ten percent noise over 70 steps: an interpolated step's error is a few percent.
        assert!(far > 5.0 * near && near < 0.05, "far {far}, near {near}");
    }

    proptest! {
        /// The Karush-Kuhn-Tucker conditions, which characterise the minimum of this convex
        /// problem: x >= 0, the gradient zero along every positive coefficient and pointing
        /// outwards (the residual cannot fall) along every zero one.
        #[test]
        fn nnls_meets_the_optimality_conditions(
            rows in prop::collection::vec(prop::array::uniform10(-1.0f64..1.0), NUM_TERMS..40),
            b in prop::collection::vec(-1.0f64..1.0, 40),
        ) {
            let b = &b[..rows.len()];
            let x = nnls(&rows, b);
            let w = gradient(&rows, b, &x);
            let scale = b.iter().map(|v| v * v).sum::<f64>().sqrt().max(1.0) * 1e-7;
            for j in 0..NUM_TERMS {
                prop_assert!(x[j] >= 0.0, "x[{j}] = {}", x[j]);
                if x[j] > 0.0 {
                    prop_assert!(w[j].abs() <= scale, "x[{j}] = {} with gradient {}", x[j], w[j]);
                } else {
                    prop_assert!(w[j] <= scale, "x[{j}] = 0 with gradient {}", w[j]);
                }
            }
        }
    }
}
