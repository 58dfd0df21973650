//! Token sampling with the semantics of vLLM's sampler: logit bias and `min_tokens` masking,
//! repetition penalty as in Hugging Face transformers (CTRL, Keskar et al. 2019: over prompt
//! and output, dividing positive logits and multiplying negative ones), presence and frequency
//! penalties as in the OpenAI API (over the output), then greedy or temperature sampling with
//! min-p, top-k and top-p (nucleus, Holtzman et al. 2020), in vLLM's order. Logprobs are the
//! log-softmax of the raw model logits, as vLLM returns them by default.
//!
//! Each sequence owns a ChaCha8 stream seeded from its request's seed, and draws exactly one
//! number per sampled token, so a seed reproduces the same tokens whatever else is batched.

use std::collections::{HashMap, HashSet};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::constraint::{mask_logits, Constraint};
use crate::error::GpuError;

/// Most logprobs a request may ask for per position (vLLM's default limit).
pub const MAX_LOGPROBS: u32 = 20;
/// Most logit-bias entries per request.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most stop or end-of-sequence ids per request.
pub const MAX_STOP_IDS: usize = 1024;
/// Temperatures below this sample greedily (vLLM's `_SAMPLING_EPS`): dividing by them
/// overflows, and their distribution is the argmax's anyway.
pub const GREEDY_BELOW: f32 = 1e-5;

/// How to pick the next token of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 (anything below [`GREEDY_BELOW`]) means greedy.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: u32,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; 0 disables.
    pub min_p: f32,
    /// Seed of the request's random stream; `None` draws one from the backend.
    pub seed: Option<u64>,
    /// Hugging Face repetition penalty over prompt and output tokens; 1 disables.
    pub repetition_penalty: f32,
    /// OpenAI presence penalty over output tokens, in [-2, 2].
    pub presence_penalty: f32,
    /// OpenAI frequency penalty over output tokens, in [-2, 2].
    pub frequency_penalty: f32,
    /// Values added to the logits of the given tokens.
    pub logit_bias: Vec<(u32, f32)>,
    /// End-of-sequence and stop ids cannot be sampled before this many output tokens.
    pub min_tokens: u32,
    /// End-of-sequence ids do not end the request (so `min_tokens` does not mask them).
    pub ignore_eos: bool,
    /// Token ids that end the request.
    pub stop_token_ids: Vec<u32>,
    /// The model's end-of-sequence ids.
    pub eos_token_ids: Vec<u32>,
    /// Return this many top logprobs per sampled token (and the sampled token's logprob).
    pub logprobs: Option<u32>,
    /// Return this many top logprobs per prompt position (and the prompt token's logprob).
    pub prompt_logprobs: Option<u32>,
    /// Structured output: the tokens must follow this constraint (one per sequence: it keeps
    /// the sequence's state).
    pub constraint: Option<Constraint>,
    /// Return the final hidden state (after the model's last normalization) of every row
    /// this request samples, in [`crate::SeqOutput::hidden`]: embeddings, the hidden state at
    /// the prompt's last token.
    pub hidden_state: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            ignore_eos: false,
            stop_token_ids: Vec::new(),
            eos_token_ids: Vec::new(),
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
            hidden_state: false,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding with no penalties.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Self::default()
        }
    }

    /// Whether the request samples greedily (its temperature is below [`GREEDY_BELOW`]).
    pub fn is_greedy(&self) -> bool {
        self.temperature < GREEDY_BELOW
    }

    /// The ids `min_tokens` masks: stop ids, and end-of-sequence ids unless `ignore_eos`.
    pub fn stop_ids(&self) -> impl Iterator<Item = u32> + '_ {
        let eos = self.eos_token_ids.iter().filter(|_| !self.ignore_eos);
        self.stop_token_ids.iter().chain(eos).copied()
    }

    /// Whether a grammar's `allowed` set holds nothing but ids `min_tokens` masks: the
    /// grammar can only end the sequence, and wins over `min_tokens` (the mask is left out).
    pub fn grammar_needs_a_stop(&self, allowed: &[u32]) -> bool {
        let stops: HashSet<u32> = self.stop_ids().collect();
        allowed
            .iter()
            .enumerate()
            .filter(|(_, w)| **w != 0)
            .flat_map(|(i, &w)| {
                (0..32)
                    .filter(move |b| w >> b & 1 == 1)
                    .map(move |b| i * 32 + b)
            })
            .all(|t| u32::try_from(t).is_ok_and(|t| stops.contains(&t)))
    }

    /// Checks ranges and that every token id is inside a vocabulary of `vocab` tokens.
    pub fn validate(&self, vocab: usize) -> Result<(), GpuError> {
        let bad = |m: String| Err(GpuError::BadSampling(m));
        let short = crate::short_number::short_number::<f32>;
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!(
                "temperature {} must be >= 0",
                short(self.temperature)
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", short(self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(format!("min_p {} must be in [0, 1]", short(self.min_p)));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!(
                "repetition_penalty {} must be > 0",
                short(self.repetition_penalty)
            ));
        }
        for (name, v) in [
            ("presence", self.presence_penalty),
            ("frequency", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return bad(format!("{name}_penalty {} must be in [-2, 2]", short(v)));
            }
        }
        for (name, n) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if n.is_some_and(|n| n > MAX_LOGPROBS) {
                return bad(format!("{name} must be at most {MAX_LOGPROBS}"));
            }
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return bad(format!("at most {MAX_LOGIT_BIAS} logit_bias entries"));
        }
        if self.stop_token_ids.len() > MAX_STOP_IDS || self.eos_token_ids.len() > MAX_STOP_IDS {
            return bad(format!("at most {MAX_STOP_IDS} stop token ids"));
        }
        let ids = self.logit_bias.iter().map(|b| b.0);
        let ids = ids
            .chain(self.stop_token_ids.iter().copied())
            .chain(self.eos_token_ids.iter().copied());
        for id in ids {
            if id as usize >= vocab {
                return bad(format!("token id {id} is outside the vocabulary ({vocab})"));
            }
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|b| !b.1.is_finite()) {
            return bad(format!("logit_bias of token {id} is {b}"));
        }
        Ok(())
    }
}

/// A sampled token and its logprobs.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token.
    pub token: u32,
    /// Its logprob under the raw model distribution, when logprobs were requested.
    pub logprob: Option<f32>,
    /// The requested number of most likely tokens with their raw logprobs, best first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The sampling state of one sequence.
#[derive(Clone, Debug)]
pub struct SeqSampler {
    rng: ChaCha8Rng,
    output: Vec<u32>,
    counts: HashMap<u32, u32>,
    seen: HashSet<u32>,
}

/// `log_softmax(logits)`, computed in `f64` sums.
pub fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let z: f64 = logits.iter().map(|&l| f64::from(l - m).exp()).sum();
    let lz = m + z.ln() as f32;
    logits.iter().map(|&l| l - lz).collect()
}

/// The `n` largest entries of `values` as `(index, value)`, largest first (ties: lower index).
pub fn top_n(values: &[f32], n: usize) -> Vec<(u32, f32)> {
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n == 0 {
        return best;
    }
    for (i, &v) in values.iter().enumerate() {
        // NaN never wins (nor ranks among the best).
        if v.is_nan() {
            continue;
        }
        if best.len() == n
            && best
                .last()
                .is_some_and(|l| v.partial_cmp(&l.1) != Some(std::cmp::Ordering::Greater))
        {
            continue;
        }
        let at = best.partition_point(|b| b.1 >= v);
        best.insert(at, (i as u32, v));
        best.truncate(n);
    }
    best
}

impl SeqSampler {
    /// A fresh state with its random stream seeded by `seed`.
    pub fn new(seed: u64) -> Self {
        SeqSampler {
            rng: ChaCha8Rng::seed_from_u64(seed),
            output: Vec::new(),
            counts: HashMap::new(),
            seen: HashSet::new(),
        }
    }

    /// Tokens sampled so far.
    pub fn output(&self) -> &[u32] {
        &self.output
    }

    /// Records prompt tokens (for the repetition penalty).
    pub fn observe_prompt(&mut self, tokens: &[u32]) {
        self.seen.extend(tokens.iter().copied());
    }

    /// Applies bias, `min_tokens` masking and penalties to `logits` in place.
    pub fn process(&self, logits: &mut [f32], p: &SamplingParams) {
        self.process_under(logits, p, None);
    }

    /// [`SeqSampler::process`] for a row a grammar restricts to `allowed`: when that set holds
    /// only ids `min_tokens` would mask, the mask is left out (the grammar wins), as on the
    /// GPU.
    fn process_under(&self, logits: &mut [f32], p: &SamplingParams, allowed: Option<&[u32]>) {
        for &(id, b) in &p.logit_bias {
            if let Some(l) = logits.get_mut(id as usize) {
                *l += b;
            }
        }
        if (self.output.len() as u64) < u64::from(p.min_tokens)
            && !allowed.is_some_and(|a| p.grammar_needs_a_stop(a))
        {
            for id in p.stop_ids() {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
        if p.repetition_penalty != 1.0 {
            // Prompt and output tokens, each distinct id penalised once.
            let output_only = self.counts.keys().filter(|id| !self.seen.contains(id));
            for &id in self.seen.iter().chain(output_only) {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&id, &c) in &self.counts {
                if let Some(l) = logits.get_mut(id as usize) {
                    *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
    }

    /// Samples the next token from `logits` (one row, the model's raw output) and records it.
    pub fn sample(&mut self, logits: &[f32], p: &SamplingParams) -> Sampled {
        let (logprob_of, top_logprobs) = match p.logprobs {
            Some(n) => {
                let lp = log_softmax(logits);
                let top = top_n(&lp, n as usize);
                (Some(lp), top)
            }
            None => (None, Vec::new()),
        };
        let mut l = logits.to_vec();
        let allowed = p.constraint.as_ref().map(|c| c.allowed(l.len()));
        self.process_under(&mut l, p, allowed.as_deref());
        if let Some(allowed) = &allowed {
            mask_logits(&mut l, logits, allowed);
        }
        let token = if p.is_greedy() {
            top_n(&l, 1).first().map_or(0, |b| b.0)
        } else {
            self.draw(&l, p)
        };
        if let Some(c) = &p.constraint {
            c.commit(token);
        }
        self.output.push(token);
        *self.counts.entry(token).or_insert(0) += 1;
        Sampled {
            token,
            logprob: logprob_of.map(|lp| lp[token as usize]),
            top_logprobs,
        }
    }

    /// Temperature, min-p, top-k and top-p (vLLM's order: min-p before top-p changes which
    /// tokens top-p keeps), then one draw from the random stream.
    fn draw(&mut self, logits: &[f32], p: &SamplingParams) -> u32 {
        let inv_t = 1.0 / p.temperature;
        let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let u: f64 = self.rng.random();
        if !m.is_finite() {
            return 0;
        }
        let mut cand: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .map(|(i, &x)| (i as u32, f64::from((x - m) * inv_t).exp()))
            .filter(|c| c.1 > 0.0)
            .collect();
        if p.min_p > 0.0 {
            // The largest probability is exp(0) = 1 before normalisation.
            let floor = f64::from(p.min_p) * cand.iter().fold(0f64, |a, c| a.max(c.1));
            cand.retain(|c| c.1 >= floor);
        }
        let truncate = p.top_k > 0 || p.top_p < 1.0;
        if truncate {
            let by_prob = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
            let k = p.top_k as usize;
            if k > 0 && k < cand.len() {
                // Tokens tied with the k-th stay (vLLM masks only those below it).
                let (_, kth, _) = cand.select_nth_unstable_by(k - 1, by_prob);
                let kth = kth.1;
                cand.retain(|c| c.1 >= kth);
            }
            cand.sort_unstable_by(by_prob);
            if p.top_p < 1.0 {
                let total: f64 = cand.iter().map(|c| c.1).sum();
                let mut acc = 0.0;
                let mut keep = cand.len();
                for (i, c) in cand.iter().enumerate() {
                    acc += c.1 / total;
                    if acc >= f64::from(p.top_p) {
                        keep = i + 1;
                        break;
                    }
                }
                cand.truncate(keep);
            }
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut target = u * total;
        for c in &cand {
            if target < c.1 {
                return c.0;
            }
            target -= c.1;
        }
        cand.last().map_or(0, |c| c.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy_with(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams::greedy();
        f(&mut p);
        p
    }

    #[test]
    fn greedy_takes_the_argmax_after_bias() {
        let mut s = SeqSampler::new(0);
        assert_eq!(
            s.sample(&[0.1, 2.0, 1.0], &SamplingParams::greedy()).token,
            1
        );
        let p = greedy_with(|p| p.logit_bias = vec![(2, 1.5)]);
        assert_eq!(s.sample(&[0.1, 2.0, 1.0], &p).token, 2);
        assert_eq!(s.output(), &[1, 2]);
    }

    #[test]
    fn repetition_penalty_follows_hugging_face() {
        let mut s = SeqSampler::new(0);
        s.observe_prompt(&[0, 1]);
        let p = greedy_with(|p| p.repetition_penalty = 2.0);
        let mut l = [2.0, -1.0, 0.5];
        s.process(&mut l, &p);
        assert_eq!(l, [1.0, -2.0, 0.5]);
        // An output token joins the set; a token in both is penalised once.
        s.sample(&[0.0, 0.0, 9.0], &SamplingParams::greedy());
        s.sample(&[9.0, 0.0, 0.0], &SamplingParams::greedy());
        let mut l = [2.0, -1.0, 0.5];
        s.process(&mut l, &p);
        assert_eq!(l, [1.0, -2.0, 0.25]);
    }

    #[test]
    fn presence_and_frequency_follow_openai() {
        let mut s = SeqSampler::new(0);
        s.observe_prompt(&[1]); // prompt tokens are not penalised by these two
        for t in [0, 0, 2] {
            let mut l = [0.0; 3];
            l[t] = 5.0;
            s.sample(&l, &SamplingParams::greedy());
        }
        let p = greedy_with(|p| {
            p.frequency_penalty = 0.5;
            p.presence_penalty = 0.25;
        });
        let mut l = [1.0, 1.0, 1.0];
        s.process(&mut l, &p);
        assert_eq!(l, [1.0 - 1.25, 1.0, 1.0 - 0.75]);
    }

    #[test]
    fn min_tokens_masks_eos_and_stop_ids_until_reached() {
        let p = greedy_with(|p| {
            p.min_tokens = 2;
            p.eos_token_ids = vec![1];
            p.stop_token_ids = vec![2];
        });
        let mut s = SeqSampler::new(0);
        let l = [0.0, 3.0, 2.0, 1.0];
        assert_eq!(s.sample(&l, &p).token, 3);
        assert_eq!(s.sample(&l, &p).token, 3);
        assert_eq!(s.sample(&l, &p).token, 1);
        let p = SamplingParams {
            ignore_eos: true,
            ..p
        };
        let mut s = SeqSampler::new(0);
        assert_eq!(
            s.sample(&l, &p).token,
            1,
            "with ignore_eos, eos is not a stop to mask"
        );
    }

    /// Probabilities 0.5, 0.3, 0.15, 0.05.
    fn dist() -> Vec<f32> {
        [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect()
    }

    fn histogram(p: &SamplingParams, draws: u64) -> [u32; 4] {
        let mut h = [0; 4];
        for seed in 0..draws {
            let t = SeqSampler::new(seed).sample(&dist(), p).token;
            h[t as usize] += 1;
        }
        h
    }

    #[test]
    fn top_p_keeps_the_nucleus() {
        // Cumulative 0.5, 0.8, 0.95: top_p = 0.6 keeps {0, 1}, renormalised to 0.625 / 0.375.
        let h = histogram(
            &SamplingParams {
                top_p: 0.6,
                ..Default::default()
            },
            4000,
        );
        assert_eq!(h[2] + h[3], 0);
        let f = f64::from(h[0]) / 4000.0;
        assert!((f - 0.625).abs() < 0.03, "{h:?}");
        let h = histogram(
            &SamplingParams {
                top_p: 0.45,
                ..Default::default()
            },
            200,
        );
        assert_eq!(h, [200, 0, 0, 0]);
    }

    #[test]
    fn top_k_and_min_p_truncate() {
        let h = histogram(
            &SamplingParams {
                top_k: 2,
                ..Default::default()
            },
            1000,
        );
        assert!(h[0] > 0 && h[1] > 0 && h[2] + h[3] == 0, "{h:?}");
        // min_p 0.35: floor 0.175 keeps 0.5 and 0.3.
        let h = histogram(
            &SamplingParams {
                min_p: 0.35,
                ..Default::default()
            },
            1000,
        );
        assert!(h[0] > 0 && h[1] > 0 && h[2] + h[3] == 0, "{h:?}");
        // Plain sampling reaches every token, in proportion.
        let h = histogram(&SamplingParams::default(), 4000);
        assert!((f64::from(h[3]) / 4000.0 - 0.05).abs() < 0.015, "{h:?}");
    }

    #[test]
    fn min_p_cuts_before_top_p_measures_the_nucleus() {
        // min_p 0.5 keeps 0.5 and 0.3 (floor 0.25), renormalised to 0.625 / 0.375: top_p 0.6
        // then keeps token 0 alone (vLLM's order). Top-p first would keep {0, 1} (0.5 < 0.6).
        let h = histogram(
            &SamplingParams {
                min_p: 0.5,
                top_p: 0.6,
                ..Default::default()
            },
            300,
        );
        assert_eq!(h, [300, 0, 0, 0]);
    }

    #[test]
    fn top_k_keeps_tokens_tied_with_the_kth() {
        let tied = [1.0f32, 1.0, 1.0, 0.0];
        let p = SamplingParams {
            top_k: 2,
            ..Default::default()
        };
        let mut h = [0u32; 4];
        for seed in 0..600 {
            h[SeqSampler::new(seed).sample(&tied, &p).token as usize] += 1;
        }
        assert!(h[0] > 0 && h[1] > 0 && h[2] > 0 && h[3] == 0, "{h:?}");
    }

    #[test]
    fn temperatures_below_the_epsilon_are_greedy() {
        for t in [1e-39f32, 1e-30, 9e-6] {
            let p = SamplingParams {
                temperature: t,
                ..Default::default()
            };
            // The argmax is not token 0 (what a failed draw falls back to).
            let l = [0.1f32, 0.2, 0.9, 0.3];
            for seed in 0..20 {
                assert_eq!(SeqSampler::new(seed).sample(&l, &p).token, 2, "{t}");
            }
        }
    }

    #[test]
    fn nan_never_wins() {
        assert_eq!(top_n(&[f32::NAN, 1.0, 2.0], 2), vec![(2, 2.0), (1, 1.0)]);
        let l = [f32::NAN, 1.0, 2.0, 0.5];
        assert_eq!(
            SeqSampler::new(0)
                .sample(&l, &SamplingParams::greedy())
                .token,
            2
        );
    }

    #[test]
    fn a_grammar_that_can_only_end_outranks_min_tokens_with_the_sampler_edits_applied() {
        use crate::constraint::tests::Script;
        use std::sync::Arc;
        // The grammar allows only its end (3) and a stop id (2); min_tokens would mask both.
        // The mask is left out and the edits stand: the bias makes 2 the greedy choice,
        // where the raw logits prefer 3 (as on the GPU).
        let constraint = Constraint::new(Script {
            steps: vec![vec![2, 3]],
            eos: 3,
            seen: Arc::new(parking_lot::Mutex::new(Vec::new())),
        });
        let raw = [0.0f32, 0.0, 1.0, 2.0];
        let p = SamplingParams {
            constraint: Some(constraint),
            min_tokens: 5,
            stop_token_ids: vec![2],
            eos_token_ids: vec![3],
            logit_bias: vec![(2, 5.0)],
            ..SamplingParams::greedy()
        };
        assert_eq!(SeqSampler::new(0).sample(&raw, &p).token, 2);
    }

    #[test]
    fn temperature_sharpens() {
        let cold = histogram(
            &SamplingParams {
                temperature: 0.25,
                ..Default::default()
            },
            1000,
        );
        // p^4 normalised: 0.0625 / (0.0625 + 0.0081 + ...) = 0.88
        assert!(cold[0] > 820 && cold[0] < 940, "{cold:?}");
    }

    #[test]
    fn seeds_reproduce_streams() {
        let p = SamplingParams::default();
        let run = |seed| {
            let mut s = SeqSampler::new(seed);
            (0..32)
                .map(|_| s.sample(&dist(), &p).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn logprobs_are_the_raw_log_softmax() {
        let p = SamplingParams {
            logprobs: Some(2),
            ..SamplingParams::greedy()
        };
        let mut s = SeqSampler::new(0);
        let l = [0.0, 3f32.ln(), -50.0];
        let out = s.sample(
            &l,
            &SamplingParams {
                temperature: 0.0,
                repetition_penalty: 3.0,
                ..p
            },
        );
        assert_eq!(out.token, 1);
        assert!((out.logprob.unwrap_or(0.0) - 0.75f32.ln()).abs() < 1e-6);
        assert_eq!(out.top_logprobs.len(), 2);
        assert_eq!(out.top_logprobs[1].0, 0);
        assert!((out.top_logprobs[1].1 - 0.25f32.ln()).abs() < 1e-6);
        assert_eq!(
            top_n(&[1.0, 3.0, 3.0, 2.0], 3),
            vec![(1, 3.0), (2, 3.0), (3, 2.0)]
        );
    }

    #[test]
    fn a_constraint_restricts_every_draw_and_sees_each_token() {
        use crate::constraint::tests::Script;
        use std::sync::Arc;
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let constraint = Constraint::new(Script {
            steps: vec![vec![2, 3], vec![0, 1]],
            eos: 3,
            seen: seen.clone(),
        });
        // Greedy would take 0; tempered sampling over the allowed pair only.
        let p = SamplingParams {
            constraint: Some(constraint),
            logprobs: Some(1),
            ..SamplingParams::default()
        };
        let mut s = SeqSampler::new(5);
        let first = s.sample(&dist(), &p);
        assert!(first.token == 2 || first.token == 3, "{first:?}");
        // Logprobs stay the raw distribution's.
        assert!((first.top_logprobs[0].1 - 0.5f32.ln()).abs() < 1e-6);
        let second = s.sample(&dist(), &p);
        assert!(second.token <= 1);
        assert_eq!(s.sample(&dist(), &p).token, 3);
        assert_eq!(*seen.lock(), s.output().to_vec());
    }

    #[test]
    fn out_of_range_parameters_are_rejected() {
        let ok = SamplingParams::default();
        assert!(ok.validate(10).is_ok());
        for bad in [
            SamplingParams {
                temperature: -1.0,
                ..ok.clone()
            },
            SamplingParams {
                top_p: 0.0,
                ..ok.clone()
            },
            SamplingParams {
                min_p: 1.5,
                ..ok.clone()
            },
            SamplingParams {
                logprobs: Some(21),
                ..ok.clone()
            },
            SamplingParams {
                presence_penalty: 3.0,
                ..ok.clone()
            },
            SamplingParams {
                logit_bias: vec![(10, 1.0)],
                ..ok.clone()
            },
            SamplingParams {
                logit_bias: vec![(1, f32::NAN)],
                ..ok.clone()
            },
            SamplingParams {
                eos_token_ids: vec![99],
                ..ok.clone()
            },
        ] {
            assert!(bad.validate(10).is_err(), "{bad:?}");
        }
    }
}
