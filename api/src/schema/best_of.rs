//! OpenAI's `best_of` on `/v1/completions`: generate `best_of` candidates per prompt on the
//! server and return the `n` best.
//!
//! "Best" is what OpenAI's API reference says: "the one with the highest log probability per
//! token", the mean of the logprobs of the candidate's generated tokens (the ones its
//! `logprobs.token_logprobs` lists). vLLM V0 ranked by the cumulative logprob instead, the sum,
//! which favours short candidates (every token adds a negative logprob); the mean does not, and
//! a client can check it from the response. Candidates of equal score keep their generation
//! order, and the returned choices come best first.

use super::limits::MAX_N;
use crate::error::ApiError;

/// The request field.
pub const BEST_OF: &str = "best_of";

/// The candidates per prompt a request's `best_of` asks for: `n` when absent, else from `n` to
/// [`MAX_N`] (bounded as `n` is). More candidates than choices (`best_of > n`) cannot be
/// streamed (OpenAI: "results cannot be streamed") and are not beam search's, which ranks its
/// own beams: both are refused naming `best_of`.
pub fn parse_best_of(
    best_of: Option<u32>,
    n: u32,
    stream: bool,
    beam_search: bool,
) -> Result<u32, ApiError> {
    let Some(best_of) = best_of else {
        return Ok(n);
    };
    if best_of < n || best_of > MAX_N {
        return Err(ApiError::invalid(
            BEST_OF,
            format!("best_of must be from n ({n}) to {MAX_N}, got {best_of}"),
        ));
    }
    if best_of > n && stream {
        return Err(ApiError::invalid(
            BEST_OF,
            "best_of above n cannot be streamed: the best candidates are known only once all \
             are done. Set stream to false, or best_of to n",
        ));
    }
    if best_of > n && beam_search {
        return Err(ApiError::invalid(
            BEST_OF,
            "best_of above n does not apply to beam search, whose n beams are already the best \
             it found. Leave best_of out or turn use_beam_search off",
        ));
    }
    Ok(best_of)
}

/// A candidate's logprobs so far: their sum and count.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CandidateScore {
    sum: f64,
    tokens: u32,
}

impl CandidateScore {
    /// Adds the logprob of one generated token (`None`, which the engine never sends for a
    /// generated token, counts as the least likely).
    pub fn add(&mut self, logprob: Option<f32>) {
        self.sum += logprob.map_or(f64::NEG_INFINITY, f64::from);
        self.tokens = self.tokens.saturating_add(1);
    }

    /// The mean logprob per token; a candidate without tokens ranks last.
    pub fn per_token(&self) -> f64 {
        if self.tokens == 0 {
            return f64::NEG_INFINITY;
        }
        let mean = self.sum / f64::from(self.tokens);
        if mean.is_nan() {
            f64::NEG_INFINITY
        } else {
            mean
        }
    }
}

/// The positions of the `n` best of `scores`, best first; equal scores keep their order.
pub fn best(scores: &[CandidateScore], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..scores.len()).collect();
    // A stable sort: equal scores stay in generation order.
    order.sort_by(|&a, &b| scores[b].per_token().total_cmp(&scores[a].per_token()));
    order.truncate(n);
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(logprobs: &[f32]) -> CandidateScore {
        let mut s = CandidateScore::default();
        for &lp in logprobs {
            s.add(Some(lp));
        }
        s
    }

    fn param_of(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            _ => None,
        }
    }

    #[test]
    fn best_of_is_n_when_absent_and_bounded_like_n() {
        assert_eq!(parse_best_of(None, 3, true, true).unwrap(), 3);
        assert_eq!(parse_best_of(Some(3), 3, true, true).unwrap(), 3);
        assert_eq!(parse_best_of(Some(5), 2, false, false).unwrap(), 5);
        assert_eq!(parse_best_of(Some(MAX_N), 1, false, false).unwrap(), MAX_N);
        for (best_of, n, stream, beam) in [
            (1, 2, false, false),
            (MAX_N + 1, 1, false, false),
            (0, 1, false, false),
            (4, 2, true, false),
            (4, 2, false, true),
        ] {
            let e = parse_best_of(Some(best_of), n, stream, beam).unwrap_err();
            assert_eq!(param_of(e).as_deref(), Some(BEST_OF), "{best_of} {n}");
        }
    }

    /// The request's `best_of` reaches the validated request, and the logprobs its ranking
    /// computes count against the bound on logprob entries even when the client asked for none.
    #[test]
    fn best_of_is_validated_with_the_request() {
        let completion = |json: serde_json::Value| {
            let req: crate::schema::CompletionRequest = serde_json::from_value(json).unwrap();
            req.validate(1 << 20)
        };
        let v = completion(serde_json::json!({"prompt": "x", "n": 2, "best_of": 4})).unwrap();
        assert_eq!((v.n, v.best_of, v.logprobs), (2, 4, None));
        let v = completion(serde_json::json!({"prompt": "x", "n": 3})).unwrap();
        assert_eq!((v.n, v.best_of), (3, 3));
        // 16 candidates × 20,000 tokens × 1 entry is past the bound of 2^18 entries.
        let big = serde_json::json!({"prompt": "x", "best_of": 16, "max_tokens": 20_000});
        let e = completion(big).unwrap_err();
        assert_eq!(param_of(e.clone()).as_deref(), Some(BEST_OF));
        // The way out is fewer candidates, never streaming (refused with best_of above n).
        let ApiError::InvalidRequest { message, .. } = e else {
            panic!("{e:?}")
        };
        assert!(message.contains("lower best_of"), "{message}");
        assert!(!message.contains("stream to true"), "{message}");
        // Asked for, the logprobs name the field, with the same advice.
        let asked = serde_json::json!(
            {"prompt": "x", "best_of": 16, "max_tokens": 4000, "logprobs": 20}
        );
        let e = completion(asked).unwrap_err();
        assert_eq!(param_of(e.clone()).as_deref(), Some("logprobs"));
        let ApiError::InvalidRequest { message, .. } = e else {
            panic!("{e:?}")
        };
        assert!(message.contains("lower best_of"), "{message}");
        let small = serde_json::json!({"prompt": "x", "best_of": 16, "max_tokens": 16_000});
        assert!(completion(small).is_ok());
    }

    /// OpenAI's "highest log probability per token": a short candidate of low logprobs loses
    /// to a longer one of higher logprobs per token, though its sum (vLLM V0's score) is
    /// higher.
    #[test]
    fn candidates_rank_by_mean_logprob_per_token() {
        let short = score(&[-2.0]); // sum -2.0, mean -2.0
        let long = score(&[-0.5, -0.5, -0.5, -0.5, -0.5]); // sum -2.5, mean -0.5
        let middle = score(&[-1.0, -1.0]); // sum -2.0, mean -1.0
        assert_eq!(best(&[short, long, middle], 2), vec![1, 2]);
        assert_eq!(best(&[short, long, middle], 3), vec![1, 2, 0]);
        assert_eq!(best(&[short, long, middle], 1), vec![1]);
    }

    #[test]
    fn ties_keep_generation_order_and_empty_candidates_rank_last() {
        let a = score(&[-1.0]);
        let b = score(&[-0.5, -1.5]);
        let empty = CandidateScore::default();
        assert_eq!(best(&[empty, a, b], 3), vec![1, 2, 0]);
        let mut unknown = CandidateScore::default();
        unknown.add(None);
        assert_eq!(best(&[unknown, a], 2), vec![1, 0]);
        let mut infinite = score(&[f32::NEG_INFINITY]);
        infinite.add(Some(f32::INFINITY)); // NaN mean
        assert_eq!(best(&[infinite, a], 2), vec![1, 0]);
    }
}
