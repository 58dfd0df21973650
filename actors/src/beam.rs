//! Beam search over one-token steps: the bookkeeping, without the engine.
//!
//! vLLM's algorithm (its `EngineClient.beam_search`): every step each live beam is extended by
//! one token, its `2 × width` most likely next tokens are the candidates, a candidate that is an
//! end token (end of sequence, a stop token id) completes its beam, the others extend it, and
//! the `width` best extensions by score live on. A beam's score is its cumulative logprob over
//! `seq_len ^ length_penalty`, `seq_len` counting the prompt and the generated tokens before an
//! end token, as vLLM counts it. At the end the `width` best of the completed and the live
//! beams are the answer, best first.
//!
//! One thing vLLM does not do: the search stops as soon as its answer is decided. Once
//! `width` beams have completed, a live beam's score can only ever reach
//! [`BeamSearch::bound`] (its logprob only falls, its length only grows up to the limit); when
//! no live beam can reach the `width`-th best completed score, no later step can change the
//! answer, so it ends there instead of running every step up to `max_tokens`.

use std::cmp::Ordering;

use switchyard_policies::FinishReason;

use crate::actors::TokenLogprobs;

/// The widest beam search a request may ask for: each step asks the sampler for `2 × width`
/// alternatives per beam, which it bounds at [`switchyard_gpu::sampler::MAX_LOGPROBS`].
pub const MAX_BEAM_WIDTH: u32 = switchyard_gpu::sampler::MAX_LOGPROBS / 2;

/// One hypothesis: the tokens generated so far.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Beam {
    /// Generated tokens (an end token that completed the beam only when it is kept).
    pub tokens: Vec<u32>,
    /// One entry per token of `tokens`: its logprob and the step's alternatives.
    pub logprobs: Vec<TokenLogprobs>,
    /// Generated tokens, an end token that completed the beam included (what usage counts).
    pub generated: u32,
    /// Sum of the logprobs of the generated tokens, an end token included.
    pub cum_logprob: f64,
    /// Set once the beam completed with an end token: `Stop`; `Length` when it ran to the limit.
    pub finish: Option<FinishReason>,
    /// Its score, fixed when it is created.
    score: f64,
}

/// The settings of one search.
#[derive(Debug, Clone)]
pub(crate) struct BeamConfig {
    /// Beams kept (1 ..= [`MAX_BEAM_WIDTH`]); also the number of answers.
    pub width: usize,
    /// Tokens in the prompt (part of a beam's length in its score, as vLLM counts it).
    pub prompt_len: usize,
    /// Most tokens a beam generates.
    pub max_tokens: u32,
    /// An end token may complete a beam only once it generated this many tokens before it.
    pub min_tokens: u32,
    /// Exponent of the length in the score.
    pub length_penalty: f64,
    /// Tokens that complete a beam (end of sequence unless `ignore_eos`, and stop token ids).
    pub end_ids: Vec<u32>,
    /// Keep the end token that completed a beam in its tokens (`include_stop_str_in_output`).
    pub keep_end: bool,
}

/// The state of one search.
#[derive(Debug)]
pub(crate) struct BeamSearch {
    config: BeamConfig,
    live: Vec<Beam>,
    /// The best completed beams, best first (at most `width`).
    completed: Vec<Beam>,
    done: bool,
}

impl BeamSearch {
    /// A search from the prompt alone: one live beam with no tokens.
    pub fn new(config: BeamConfig) -> Self {
        assert!(config.width >= 1, "a beam search keeps one beam at least");
        let done = config.max_tokens == 0;
        Self {
            live: vec![Beam {
                tokens: Vec::new(),
                logprobs: Vec::new(),
                generated: 0,
                cum_logprob: 0.0,
                finish: None,
                score: 0.0,
            }],
            completed: Vec::new(),
            config,
            done,
        }
    }

    /// The live beams the next step extends (in this order); empty once the search is done.
    pub fn live(&self) -> &[Beam] {
        if self.done {
            &[]
        } else {
            &self.live
        }
    }

    /// Alternatives to ask the sampler for at each step: vLLM's `2 × width`, or, where there
    /// are more than `width` end tokens (stop token ids), `width` more than there are end
    /// tokens, so that `width` beams live on even when every end token is among the best (they
    /// complete beams instead); at most the sampler's bound.
    pub fn candidates_per_beam(&self) -> u32 {
        let width = self.config.width;
        let wanted = (2 * width).max(width + self.config.end_ids.len());
        wanted.min(switchyard_gpu::sampler::MAX_LOGPROBS as usize) as u32
    }

    /// Whether the answer is decided.
    #[cfg(test)]
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// `seq_len ^ length_penalty` as vLLM computes it: the prompt and the generated tokens
    /// before an end token.
    fn score(&self, cum_logprob: f64, len: usize) -> f64 {
        cum_logprob / (len.max(1) as f64).powf(self.config.length_penalty)
    }

    /// Applies one step: `steps[i]` is what the step computed for live beam `i` (its top
    /// alternatives, best first; the sampled token's own entry is one of them).
    pub fn advance(&mut self, steps: &[TokenLogprobs]) {
        assert_eq!(
            steps.len(),
            self.live().len(),
            "one step output per live beam"
        );
        // Every alternative as a candidate first; only the `width` kept of each kind become
        // beams (a beam's history is copied for those alone, not for all `2 × width²`).
        let mut extended: Vec<Candidate> = Vec::with_capacity(steps.len() * 2 * self.config.width);
        let mut ended: Vec<Candidate> = Vec::new();
        let mut seen: Vec<u32> = Vec::new();
        for (parent, (beam, step)) in self.live.iter().zip(steps).enumerate() {
            // The alternatives, and the sampled token where they leave it out; each token once.
            seen.clear();
            let own = step.logprob.map(|lp| (step.token, lp));
            for (token, logprob) in step.top.iter().copied().chain(own) {
                if seen.contains(&token) || !logprob.is_finite() {
                    continue;
                }
                seen.push(token);
                let cum_logprob = beam.cum_logprob + f64::from(logprob);
                let prefix = self.config.prompt_len + beam.tokens.len();
                let candidate = |score| Candidate {
                    parent,
                    token,
                    logprob,
                    cum_logprob,
                    score,
                };
                if self.config.end_ids.contains(&token) {
                    if beam.generated >= self.config.min_tokens {
                        ended.push(candidate(self.score(cum_logprob, prefix)));
                    }
                } else {
                    extended.push(candidate(self.score(cum_logprob, prefix + 1)));
                }
            }
        }
        let width = self.config.width;
        sort_best_first(&mut ended, |c| c.score);
        ended.truncate(width);
        let completed: Vec<Beam> = ended.iter().map(|c| self.extend(c, steps, true)).collect();
        self.completed.extend(completed);
        sort_best_first(&mut self.completed, |b| b.score);
        self.completed.truncate(width);
        sort_best_first(&mut extended, |c| c.score);
        extended.truncate(width);
        self.live = extended
            .iter()
            .map(|c| self.extend(c, steps, false))
            .collect();
        let at_limit = self
            .live
            .first()
            .is_none_or(|b| b.generated >= self.config.max_tokens);
        self.done = at_limit || self.decided();
    }

    /// The beam a candidate makes: its parent's history and its token (an end token only when
    /// kept), completed when `end`.
    fn extend(&self, c: &Candidate, steps: &[TokenLogprobs], end: bool) -> Beam {
        let mut beam = self.live[c.parent].clone();
        if !end || self.config.keep_end {
            beam.tokens.push(c.token);
            beam.logprobs.push(TokenLogprobs {
                token: c.token,
                logprob: Some(c.logprob),
                rank: None,
                top: steps[c.parent].top.clone(),
            });
        }
        beam.generated += 1;
        beam.cum_logprob = c.cum_logprob;
        beam.score = c.score;
        if end {
            beam.finish = Some(FinishReason::Stop);
        }
        beam
    }

    /// The highest score a live beam's descendants can reach: their logprob is at most its
    /// own (logprobs are not positive) and their length lies between its own and the limit.
    fn bound(&self, beam: &Beam) -> f64 {
        let now = self.config.prompt_len + beam.tokens.len();
        let longest = self.config.prompt_len + self.config.max_tokens as usize;
        self.score(beam.cum_logprob, now)
            .max(self.score(beam.cum_logprob, longest))
    }

    /// Whether `width` beams completed that no live beam can overtake.
    fn decided(&self) -> bool {
        let Some(worst) = self.completed.get(self.config.width - 1).map(|b| b.score) else {
            return false;
        };
        self.live.iter().all(|b| self.bound(b) <= worst)
    }

    /// The answer, best first: the `width` best of the completed beams and, where the search
    /// ran to the limit, the live ones (finished by length). Before the search is done, the
    /// best so far.
    pub fn finish(mut self) -> Vec<Beam> {
        let mut all = std::mem::take(&mut self.completed);
        // A search decided early leaves live beams that cannot make the answer (and did not
        // reach the limit).
        let ran_out = self
            .live
            .first()
            .is_none_or(|b| b.generated >= self.config.max_tokens);
        if ran_out || !self.done {
            all.extend(self.live.into_iter().map(|mut b| {
                b.finish = Some(FinishReason::Length);
                b
            }));
        }
        sort_best_first(&mut all, |b| b.score);
        all.truncate(self.config.width);
        all
    }
}

/// One alternative of one live beam: `parent` (its index among the live beams) extended by
/// `token`.
struct Candidate {
    parent: usize,
    token: u32,
    logprob: f32,
    cum_logprob: f64,
    score: f64,
}

/// Best score first; equal scores keep their order (a stable sort, as vLLM's).
fn sort_best_first<T>(items: &mut [T], score: impl Fn(&T) -> f64) {
    items.sort_by(|a, b| score(b).partial_cmp(&score(a)).unwrap_or(Ordering::Equal));
}

#[cfg(test)]
mod tests {
    use super::*;

    const EOS: u32 = 0;

    fn config(width: usize, max_tokens: u32) -> BeamConfig {
        BeamConfig {
            width,
            prompt_len: 4,
            max_tokens,
            min_tokens: 0,
            length_penalty: 1.0,
            end_ids: vec![EOS],
            keep_end: false,
        }
    }

    /// A step whose alternatives are `top` (token, probability), best first.
    fn step(top: &[(u32, f64)]) -> TokenLogprobs {
        let top: Vec<(u32, f32)> = top.iter().map(|&(t, p)| (t, p.ln() as f32)).collect();
        TokenLogprobs {
            token: top[0].0,
            logprob: Some(top[0].1),
            rank: None,
            top,
        }
    }

    fn tokens(beams: &[Beam]) -> Vec<Vec<u32>> {
        beams.iter().map(|b| b.tokens.clone()).collect()
    }

    #[test]
    fn width_one_without_end_tokens_is_greedy() {
        let mut search = BeamSearch::new(config(1, 3));
        search.advance(&[step(&[(5, 0.6), (6, 0.3)])]);
        search.advance(&[step(&[(7, 0.5), (8, 0.4)])]);
        assert!(!search.is_done());
        search.advance(&[step(&[(9, 0.9), (5, 0.1)])]);
        assert!(search.is_done());
        let answer = search.finish();
        assert_eq!(tokens(&answer), vec![vec![5, 7, 9]]);
        assert_eq!(answer[0].finish, Some(FinishReason::Length));
        assert_eq!(answer[0].generated, 3);
        let expected = 0.6f64.ln() + 0.5f64.ln() + 0.9f64.ln();
        assert!((answer[0].cum_logprob - expected).abs() < 1e-5);
    }

    #[test]
    fn a_less_likely_first_token_wins_when_its_continuation_is_better() {
        // Greedy takes 5 (0.5) then at best 0.4: 0.20. Token 6 (0.4) then 0.9: 0.36.
        let mut search = BeamSearch::new(config(2, 2));
        search.advance(&[step(&[(5, 0.5), (6, 0.4), (7, 0.05), (8, 0.05)])]);
        assert_eq!(tokens(search.live()), vec![vec![5], vec![6]]);
        search.advance(&[
            step(&[(9, 0.4), (10, 0.3), (11, 0.2), (12, 0.1)]),
            step(&[(13, 0.9), (14, 0.05), (15, 0.03), (16, 0.02)]),
        ]);
        let answer = search.finish();
        assert_eq!(tokens(&answer), vec![vec![6, 13], vec![5, 9]]);
    }

    #[test]
    fn an_end_token_completes_a_beam_and_the_search_stops_once_decided() {
        // The end token is the most likely first token: that beam completes with score
        // ln(0.9) / 4 (the prompt's 4 tokens). The live beams' logprobs are already below
        // ln(0.05) over at most 4 + 10 tokens: nothing can overtake it at width 1.
        let mut search = BeamSearch::new(config(1, 10));
        search.advance(&[step(&[(EOS, 0.9), (5, 0.05)])]);
        assert!(search.is_done(), "decided after one step, not after ten");
        assert!(search.live().is_empty());
        let answer = search.finish();
        assert_eq!(answer.len(), 1);
        assert_eq!(
            answer[0].tokens,
            Vec::<u32>::new(),
            "the end token is not kept"
        );
        assert_eq!(answer[0].generated, 1, "but it counts as generated");
        assert_eq!(answer[0].finish, Some(FinishReason::Stop));
    }

    #[test]
    fn a_kept_end_token_is_in_the_tokens_with_its_logprob() {
        let mut search = BeamSearch::new(BeamConfig {
            keep_end: true,
            ..config(1, 10)
        });
        search.advance(&[step(&[(EOS, 0.9), (5, 0.05)])]);
        let answer = search.finish();
        assert_eq!(answer[0].tokens, vec![EOS]);
        assert_eq!(answer[0].logprobs.len(), 1);
        assert_eq!(answer[0].logprobs[0].token, EOS);
    }

    #[test]
    fn the_search_goes_on_while_a_live_beam_could_still_win() {
        // The completed beam scores ln(0.5) / 4 = -0.173; the live beam, ln(0.45) = -0.799
        // over 5 tokens now, could reach -0.799 / 14 = -0.057 at the limit with penalty 1
        // (longer beams are favoured): not decided.
        let mut search = BeamSearch::new(config(1, 10));
        search.advance(&[step(&[(EOS, 0.5), (5, 0.45)])]);
        assert!(!search.is_done());
        // With no length penalty the score only falls: decided at once.
        let mut search = BeamSearch::new(BeamConfig {
            length_penalty: 0.0,
            ..config(1, 10)
        });
        search.advance(&[step(&[(EOS, 0.5), (5, 0.45)])]);
        assert!(search.is_done());
        assert_eq!(search.finish()[0].finish, Some(FinishReason::Stop));
    }

    #[test]
    fn stopping_early_gives_the_answer_running_to_the_limit_gives() {
        // A deterministic pseudo-model: the next-token distribution depends on the prefix.
        fn model(prefix: &[u32]) -> TokenLogprobs {
            let h = prefix.iter().fold(7u64, |h, &t| {
                h.wrapping_mul(31).wrapping_add(u64::from(t) + 1)
            });
            let mut weights: Vec<(u32, f64)> = (0..6u32)
                .map(|t| (t, 1.0 + ((h >> (t * 5)) % 17) as f64))
                .collect();
            let total: f64 = weights.iter().map(|w| w.1).sum();
            for w in &mut weights {
                w.1 /= total;
            }
            weights.sort_by(|a, b| b.1.total_cmp(&a.1));
            step(&weights)
        }
        let mut stopped_early = 0;
        for width in 1..=3 {
            for penalty in [0.0, 0.5, 1.0, 2.0, -1.0] {
                let config = BeamConfig {
                    length_penalty: penalty,
                    ..config(width, 8)
                };
                let run = |stop_early: bool| {
                    let mut search = BeamSearch::new(config.clone());
                    let mut steps = 0;
                    while !search.live().is_empty() {
                        let outputs: Vec<TokenLogprobs> =
                            search.live().iter().map(|b| model(&b.tokens)).collect();
                        search.advance(&outputs);
                        steps += 1;
                        if !stop_early && search.is_done() && steps < 8 && !search.live.is_empty() {
                            // Run on as vLLM does: keep extending until the limit.
                            search.done = false;
                        }
                    }
                    (tokens(&search.finish()), steps)
                };
                let (early, early_steps) = run(true);
                let (full, _) = run(false);
                assert_eq!(early, full, "width {width}, length penalty {penalty}");
                assert!(early_steps <= 8);
                stopped_early += usize::from(early_steps < 8);
            }
        }
        assert!(
            stopped_early > 0,
            "the cases must include searches decided early"
        );
    }

    #[test]
    fn end_tokens_wait_for_min_tokens() {
        let mut search = BeamSearch::new(BeamConfig {
            min_tokens: 1,
            ..config(1, 3)
        });
        search.advance(&[step(&[(EOS, 0.9), (5, 0.05)])]);
        assert_eq!(tokens(search.live()), vec![vec![5]]);
        search.advance(&[step(&[(EOS, 0.9), (6, 0.05)])]);
        let answer = search.finish();
        assert_eq!(answer[0].tokens, vec![5]);
        assert_eq!(answer[0].finish, Some(FinishReason::Stop));
    }

    #[test]
    fn each_alternative_counts_once_with_the_sampled_token_among_them() {
        let mut search = BeamSearch::new(config(2, 1));
        // The sampled token repeats the first alternative; 6 is offered twice.
        let mut s = step(&[(5, 0.5), (6, 0.3), (6, 0.3)]);
        s.token = 5;
        search.advance(&[s]);
        assert_eq!(tokens(&search.finish()), vec![vec![5], vec![6]]);
    }

    /// The searches of `gpu/reference/make_beam_golden.py` (vLLM's algorithm in Python over
    /// Hugging Face transformers' float32 logprobs of the SmolLM2 GGUF, itself checked there
    /// against transformers' `generate(num_beams=...)`), replayed on the very logprobs it
    /// recorded for every prefix it evaluated: the same answers, end tokens, length penalties
    /// from -1 to 2 and `ignore_eos` included. A prefix the reference never evaluated means
    /// this search went another way.
    /// A prefix the reference evaluated and the alternatives it found there.
    type Lattice = (Vec<u32>, Vec<(u32, f32)>);

    #[test]
    fn replays_of_the_reference_searches_give_its_answers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../gpu/tests/fixtures/smollm2_beam_search.json"
        );
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let ends: Vec<u32> =
            serde_json::from_value(fixture["reference"]["end_token_ids"].clone()).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert!(cases.len() >= 10);
        let mut ended_by_end_token = 0;
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let ids =
                |v: &serde_json::Value| -> Vec<u32> { serde_json::from_value(v.clone()).unwrap() };
            let steps: Vec<Lattice> = case["steps"]
                .as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    let top = s["top"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32))
                        .collect();
                    (ids(&s["prefix"]), top)
                })
                .collect();
            let ignore_eos = case["ignore_eos"].as_bool().unwrap();
            let mut search = BeamSearch::new(BeamConfig {
                width: case["width"].as_u64().unwrap() as usize,
                prompt_len: case["prompt_ids"].as_array().unwrap().len(),
                max_tokens: case["max_tokens"].as_u64().unwrap() as u32,
                min_tokens: 0,
                length_penalty: case["length_penalty"].as_f64().unwrap(),
                end_ids: if ignore_eos { Vec::new() } else { ends.clone() },
                keep_end: false,
            });
            while !search.live().is_empty() {
                let outputs: Vec<TokenLogprobs> = search
                    .live()
                    .iter()
                    .map(|b| {
                        let (_, top) = steps
                            .iter()
                            .find(|(prefix, _)| *prefix == b.tokens)
                            .unwrap_or_else(|| {
                                panic!("{name}: the reference never evaluated {:?}", b.tokens)
                            });
                        TokenLogprobs {
                            token: top[0].0,
                            logprob: Some(top[0].1),
                            rank: None,
                            top: top.clone(),
                        }
                    })
                    .collect();
                search.advance(&outputs);
            }
            let answer = search.finish();
            let expected = case["beams"].as_array().unwrap();
            assert_eq!(answer.len(), expected.len(), "{name}");
            for (ours, theirs) in answer.iter().zip(expected) {
                assert_eq!(ours.tokens, ids(&theirs["tokens"]), "{name}");
                let finish = match ours.finish {
                    Some(FinishReason::Stop) => "stop",
                    _ => "length",
                };
                assert_eq!(finish, theirs["finish"].as_str().unwrap(), "{name}");
                ended_by_end_token += usize::from(finish == "stop");
                let cum = theirs["cum_logprob"].as_f64().unwrap();
                assert!(
                    (ours.cum_logprob - cum).abs() < 1e-4,
                    "{name}: {} vs {cum}",
                    ours.cum_logprob
                );
            }
        }
        assert!(
            ended_by_end_token > 0,
            "the cases must include an answer an end token ended"
        );
    }

    #[test]
    fn max_tokens_zero_is_done_before_any_step() {
        let search = BeamSearch::new(config(2, 0));
        assert!(search.live().is_empty());
        assert!(search.finish().iter().all(|b| b.tokens.is_empty()));
    }
}
