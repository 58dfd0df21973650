//! Validation of the sampler fields shared by completions and chat completions, against
//! OpenAI's documented ranges and vLLM's `SamplingParams` checks.

use std::collections::HashMap;

use super::limits::{
    MAX_ALLOWED_TOKEN_IDS, MAX_BAD_WORDS, MAX_BAD_WORD_BYTES, MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS,
};
use crate::engine::SamplingOptions;
use crate::error::ApiError;

/// Sampler fields shared by both endpoints, before validation.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplerFields {
    /// `temperature`.
    pub temperature: Option<f32>,
    /// `top_p`.
    pub top_p: Option<f32>,
    /// `top_k` (vLLM): -1 or 0 disable.
    pub top_k: Option<i64>,
    /// `min_p` (vLLM).
    pub min_p: Option<f32>,
    /// `presence_penalty`.
    pub presence_penalty: Option<f32>,
    /// `frequency_penalty`.
    pub frequency_penalty: Option<f32>,
    /// `repetition_penalty` (vLLM).
    pub repetition_penalty: Option<f32>,
    /// `seed`.
    pub seed: Option<i64>,
    /// `logit_bias`: token id (as a string) to bias.
    pub logit_bias: Option<HashMap<String, f32>>,
    /// `stop_token_ids` (vLLM).
    pub stop_token_ids: Option<Vec<u32>>,
    /// `min_tokens` (vLLM).
    pub min_tokens: Option<u32>,
    /// `ignore_eos` (vLLM).
    pub ignore_eos: Option<bool>,
    /// `allowed_token_ids` (vLLM).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// `bad_words` (vLLM).
    pub bad_words: Option<Vec<String>>,
}

fn check_range(param: &str, value: Option<f32>, lo: f32, hi: f32) -> Result<(), ApiError> {
    match value {
        Some(v) if !(v.is_finite() && v >= lo && v <= hi) => Err(ApiError::invalid(
            param,
            format!(
                "{param} must be in [{lo}, {hi}], got {}",
                crate::short_number::short_number(v)
            ),
        )),
        _ => Ok(()),
    }
}

impl SamplerFields {
    /// Validates every field against OpenAI's and vLLM's ranges.
    pub fn validate(self) -> Result<SamplingOptions, ApiError> {
        check_range("temperature", self.temperature, 0.0, 2.0)?;
        check_range("min_p", self.min_p, 0.0, 1.0)?;
        check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        check_range("repetition_penalty", self.repetition_penalty, 0.01, 10.0)?;
        if let Some(p) = self.top_p {
            if !(p.is_finite() && p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(
                    "top_p",
                    format!("top_p must be in (0, 1], got {p}"),
                ));
            }
        }
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            // A k past any vocabulary keeps every token, as vLLM reads it: the sampler takes
            // the smaller of k and the vocabulary.
            Some(k) if k >= 1 => u32::try_from(k).unwrap_or(u32::MAX),
            Some(k) => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k must be -1 or 0 (disabled) or at least 1, got {k}"),
                ))
            }
        };
        let logit_bias = parse_logit_bias(self.logit_bias)?;
        let stop_token_ids = self.stop_token_ids.unwrap_or_default();
        if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return Err(ApiError::invalid(
                "stop_token_ids",
                format!("at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed"),
            ));
        }
        let allowed_token_ids = parse_allowed_token_ids(self.allowed_token_ids)?;
        let bad_words = parse_bad_words(self.bad_words)?;
        let defaults = SamplingOptions::default();
        Ok(SamplingOptions {
            temperature: self.temperature.unwrap_or(defaults.temperature),
            top_p: self.top_p.unwrap_or(defaults.top_p),
            top_k,
            min_p: self.min_p.unwrap_or(defaults.min_p),
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self.repetition_penalty.unwrap_or(1.0),
            // OpenAI seeds are signed 64-bit; reinterpreting the bits keeps every seed distinct.
            seed: self.seed.map(|s| u64::from_ne_bytes(s.to_ne_bytes())),
            logit_bias,
            stop_token_ids,
            min_tokens: self.min_tokens.unwrap_or(0),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            allowed_token_ids,
            bad_words,
        })
    }
}

/// vLLM's `allowed_token_ids`: non-empty (vLLM refuses an empty list), at most
/// [`MAX_ALLOWED_TOKEN_IDS`]; the engine checks them against the vocabulary.
fn parse_allowed_token_ids(ids: Option<Vec<u32>>) -> Result<Option<Vec<u32>>, ApiError> {
    match ids {
        Some(ids) if ids.is_empty() => Err(ApiError::invalid(
            "allowed_token_ids",
            "allowed_token_ids must not be empty",
        )),
        Some(ids) if ids.len() > MAX_ALLOWED_TOKEN_IDS => Err(ApiError::invalid(
            "allowed_token_ids",
            format!("at most {MAX_ALLOWED_TOKEN_IDS} allowed_token_ids are allowed"),
        )),
        other => Ok(other),
    }
}

/// vLLM's `bad_words`: at most [`MAX_BAD_WORDS`], each 1 to [`MAX_BAD_WORD_BYTES`] bytes with
/// a character that is not whitespace (vLLM strips the leading whitespace and fails on what
/// is then empty).
fn parse_bad_words(words: Option<Vec<String>>) -> Result<Vec<String>, ApiError> {
    let words = words.unwrap_or_default();
    if words.len() > MAX_BAD_WORDS {
        return Err(ApiError::invalid(
            "bad_words",
            format!("at most {MAX_BAD_WORDS} bad_words are allowed"),
        ));
    }
    for word in &words {
        if word.len() > MAX_BAD_WORD_BYTES || word.trim().is_empty() {
            return Err(ApiError::invalid(
                "bad_words",
                format!(
                    "bad_words must be 1 to {MAX_BAD_WORD_BYTES} bytes long, with a character \
                     that is not whitespace"
                ),
            ));
        }
    }
    Ok(words)
}

fn parse_logit_bias(raw: Option<HashMap<String, f32>>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(raw) = raw else {
        return Ok(Vec::new());
    };
    if raw.len() > MAX_LOGIT_BIAS {
        return Err(ApiError::invalid(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} logit_bias entries are allowed"),
        ));
    }
    let mut bias = Vec::with_capacity(raw.len());
    for (key, value) in raw {
        let token: u32 = key.trim().parse().map_err(|_| {
            let shown: String = key.chars().take(64).collect();
            ApiError::invalid(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {shown:?}"),
            )
        })?;
        if !(value.is_finite() && (-100.0..=100.0).contains(&value)) {
            return Err(ApiError::invalid(
                "logit_bias",
                format!("logit_bias values must be in [-100, 100], got {value}"),
            ));
        }
        bias.push((token, value));
    }
    bias.sort_by_key(|&(token, _)| token);
    // Keys are parsed one by one ("5", "05", "+5" and " 5" all name token 5) and the samplers
    // add entries up, so a repeated id would take its bias past [-100, 100].
    if let Some(pair) = bias.windows(2).find(|pair| pair[0].0 == pair[1].0) {
        let token = pair[0].0;
        return Err(ApiError::invalid(
            "logit_bias",
            format!("logit_bias names token id {token} more than once"),
        ));
    }
    Ok(bias)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param_of(fields: SamplerFields) -> Option<String> {
        match fields.validate() {
            Err(ApiError::InvalidRequest { param, .. }) => param,
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn logit_bias_is_bounded_in_count_and_value() {
        let too_many: HashMap<String, f32> = (0..=MAX_LOGIT_BIAS as u32)
            .map(|t| (t.to_string(), 1.0))
            .collect();
        let fields = SamplerFields {
            logit_bias: Some(too_many),
            ..SamplerFields::default()
        };
        assert_eq!(param_of(fields).as_deref(), Some("logit_bias"));
        let fields = SamplerFields {
            logit_bias: Some(HashMap::from([("3".to_owned(), -100.5)])),
            ..SamplerFields::default()
        };
        assert_eq!(param_of(fields).as_deref(), Some("logit_bias"));
    }

    /// A value past its range is echoed short (`{}` wrote the largest `f32` as 39 digits).
    #[test]
    fn a_value_out_of_range_is_echoed_short() {
        let fields = SamplerFields {
            temperature: Some(f32::MAX),
            ..SamplerFields::default()
        };
        match fields.validate() {
            Err(ApiError::InvalidRequest { message, .. }) => {
                assert_eq!(message, "temperature must be in [0, 2], got 3.4028235e38");
            }
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn logit_bias_naming_a_token_twice_is_refused() {
        let keys = ["5", "05", "+5", " 5"];
        for pair in [&keys[..2], &keys[2..], &keys[..]] {
            let fields = SamplerFields {
                logit_bias: Some(pair.iter().map(|k| ((*k).to_owned(), 100.0)).collect()),
                ..SamplerFields::default()
            };
            match fields.validate() {
                Err(ApiError::InvalidRequest { message, param }) => {
                    assert_eq!(param.as_deref(), Some("logit_bias"));
                    assert!(message.contains("token id 5 "), "{message}");
                }
                other => panic!("expected an error for {pair:?}, got {other:?}"),
            }
        }
        let fields = SamplerFields {
            logit_bias: Some(HashMap::from([
                ("5".to_owned(), 100.0),
                ("6".to_owned(), 1.0),
            ])),
            ..SamplerFields::default()
        };
        assert_eq!(
            fields.validate().unwrap().logit_bias,
            vec![(5, 100.0), (6, 1.0)]
        );
    }

    #[test]
    fn nan_and_infinite_values_are_refused() {
        let fields = SamplerFields {
            repetition_penalty: Some(f32::NAN),
            ..SamplerFields::default()
        };
        assert_eq!(param_of(fields).as_deref(), Some("repetition_penalty"));
        let fields = SamplerFields {
            top_p: Some(f32::INFINITY),
            ..SamplerFields::default()
        };
        assert_eq!(param_of(fields).as_deref(), Some("top_p"));
    }

    #[test]
    fn top_k_minus_one_and_zero_disable() {
        for k in [-1, 0] {
            let fields = SamplerFields {
                top_k: Some(k),
                ..SamplerFields::default()
            };
            assert_eq!(fields.validate().unwrap().top_k, 0);
        }
    }

    /// Every `top_k` of at least 1 is taken, one past `u32`'s range too (it keeps every
    /// token, as any k past the vocabulary does): the refusal says "at least 1" and must
    /// not refuse such a k. Below -1 is refused, naming both values that disable it.
    #[test]
    fn every_top_k_of_at_least_one_is_taken() {
        let top_k = |k: i64| {
            SamplerFields {
                top_k: Some(k),
                ..SamplerFields::default()
            }
            .validate()
        };
        for (k, want) in [
            (1, 1),
            (49_152, 49_152),
            (i64::from(u32::MAX), u32::MAX),
            (i64::from(u32::MAX) + 1, u32::MAX),
            (i64::MAX, u32::MAX),
        ] {
            assert_eq!(top_k(k).unwrap().top_k, want, "{k}");
        }
        for k in [-2, i64::MIN] {
            match top_k(k) {
                Err(ApiError::InvalidRequest { message, param }) => {
                    assert_eq!(param.as_deref(), Some("top_k"));
                    assert_eq!(
                        message,
                        format!("top_k must be -1 or 0 (disabled) or at least 1, got {k}")
                    );
                }
                other => panic!("{k}: {other:?}"),
            }
        }
    }

    #[test]
    fn negative_seeds_keep_their_bits() {
        let fields = SamplerFields {
            seed: Some(-2),
            ..SamplerFields::default()
        };
        assert_eq!(fields.validate().unwrap().seed, Some(u64::MAX - 1));
    }

    /// One case per refusal, each naming its field.
    #[test]
    fn allowed_token_ids_and_bad_words_are_bounded() {
        let allowed = |ids: Vec<u32>| SamplerFields {
            allowed_token_ids: Some(ids),
            ..SamplerFields::default()
        };
        let bad = |words: Vec<String>| SamplerFields {
            bad_words: Some(words),
            ..SamplerFields::default()
        };
        let too_many_ids = vec![1; MAX_ALLOWED_TOKEN_IDS + 1];
        let too_many_words = vec!["x".to_owned(); MAX_BAD_WORDS + 1];
        let cases = [
            (allowed(Vec::new()), "allowed_token_ids"),
            (allowed(too_many_ids), "allowed_token_ids"),
            (bad(too_many_words), "bad_words"),
            (bad(vec!["ok".into(), String::new()]), "bad_words"),
            (bad(vec![" \t\n".into()]), "bad_words"),
            (bad(vec!["y".repeat(MAX_BAD_WORD_BYTES + 1)]), "bad_words"),
        ];
        for (fields, param) in cases {
            let what = format!("{fields:?}");
            assert_eq!(param_of(fields).as_deref(), Some(param), "{what:.80}");
        }
        let fields = SamplerFields {
            allowed_token_ids: Some(vec![3, 1, 3]),
            bad_words: Some(vec![" Paris".into(), "y".repeat(MAX_BAD_WORD_BYTES)]),
            ..SamplerFields::default()
        };
        let options = fields.validate().unwrap();
        assert_eq!(options.allowed_token_ids, Some(vec![3, 1, 3]));
        assert_eq!(options.bad_words.len(), 2);
    }
}
