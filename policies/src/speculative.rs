//! Speculative decoding by prompt lookup (n-gram matching): a decoding sequence's last tokens
//! are looked up earlier in its own prompt and output, and the tokens that followed the match
//! are proposed as drafts. The backend scores the last token and the drafts in one pass and
//! keeps the drafts its own sampling agrees with, so every output is what decoding one token
//! at a time would have produced (see `Backend` in the `gpu` crate) while a step may yield
//! several tokens.
//!
//! The proposer needs no second model and no GPU: it suits inputs that outputs repeat
//! (editing, summarising, retrieval answers, code). Each sequence keeps an index of its
//! `prompt_lookup_min`-grams, built on its first proposal and extended by the tokens added
//! since, so a proposal costs O(`prompt_lookup_max` · [`CANDIDATES`]) whatever the length.

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use serde::{Deserialize, Serialize};

use crate::error::SchedulerError;
use crate::prefix_hash::{PromptAndOutput, TokenSource};
use crate::scheduler::IdHasher;
use crate::sequence::SeqView;
use crate::types::TokenId;

/// Most draft tokens per step accepted in a configuration.
pub const MAX_SPECULATIVE_TOKENS: usize = 16;
/// Longest n-gram accepted for `prompt_lookup_max`.
pub const MAX_LOOKUP: usize = 32;
/// Earlier occurrences of an n-gram remembered per key (the most recent ones).
pub const CANDIDATES: usize = 4;

/// Speculative decoding settings (vLLM's `speculative_config` with `method: ngram`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeConfig {
    /// Most draft tokens proposed per sequence and step (1..=16).
    pub num_speculative_tokens: usize,
    /// Shortest suffix that must match an earlier position (1..=`prompt_lookup_max`).
    #[serde(default = "default_lookup_min")]
    pub prompt_lookup_min: usize,
    /// Longest suffix matched (`prompt_lookup_min..=32`): among the [`CANDIDATES`] most recent
    /// earlier occurrences of the last `prompt_lookup_min` tokens, the longest match wins,
    /// then the one followed by more tokens (up to `num_speculative_tokens`; a recent match
    /// in a repeating pattern has few), then the most recent.
    #[serde(default = "default_lookup_max")]
    pub prompt_lookup_max: usize,
    /// No drafts in a step while more sequences than this run (0: no limit). A large batch
    /// keeps the device busy already, and drafts the model rejects cost compute there.
    #[serde(default)]
    pub max_running: usize,
}

fn default_lookup_min() -> usize {
    2
}

fn default_lookup_max() -> usize {
    4
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            num_speculative_tokens: 4,
            prompt_lookup_min: default_lookup_min(),
            prompt_lookup_max: default_lookup_max(),
            max_running: 0,
        }
    }
}

impl SpeculativeConfig {
    /// Checks the bounds.
    pub fn validate(&self) -> Result<(), SchedulerError> {
        let err =
            |field: &'static str, reason: String| SchedulerError::InvalidConfig { field, reason };
        if self.num_speculative_tokens == 0 || self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS
        {
            return Err(err(
                "speculative.num_speculative_tokens",
                format!(
                    "must be in 1..={MAX_SPECULATIVE_TOKENS}, got {}",
                    self.num_speculative_tokens
                ),
            ));
        }
        if self.prompt_lookup_max == 0 || self.prompt_lookup_max > MAX_LOOKUP {
            return Err(err(
                "speculative.prompt_lookup_max",
                format!(
                    "must be in 1..={MAX_LOOKUP}, got {}",
                    self.prompt_lookup_max
                ),
            ));
        }
        if self.prompt_lookup_min == 0 || self.prompt_lookup_min > self.prompt_lookup_max {
            return Err(err(
                "speculative.prompt_lookup_min",
                format!(
                    "must be in 1..=prompt_lookup_max ({}), got {}",
                    self.prompt_lookup_max, self.prompt_lookup_min
                ),
            ));
        }
        Ok(())
    }
}

/// Where a sequence's drafts come from, in place of prompt lookup
/// ([`crate::Scheduler::set_draft_source`]).
pub trait DraftSource: Send {
    /// Appends up to `k` drafts for `seq`, to follow its known tokens (the first at position
    /// `seq.prompt_len() + seq.num_output_tokens()`).
    fn propose(&mut self, seq: SeqView<'_>, k: usize, out: &mut Vec<TokenId>);
}

/// A sequence's index of its `min`-grams: for each, the end positions (exclusive) of its
/// most recent occurrences, newest first.
#[derive(Clone, Debug, Default)]
pub(crate) struct NgramIndex {
    /// Keyed by the n-gram's mixed key ([`key_of`]; a collision only costs a comparison).
    map: HashMap<u64, [u32; CANDIDATES], BuildHasherDefault<IdHasher>>,
    /// n-grams ending at positions below this are indexed.
    indexed_to: usize,
}

/// Mixes `n` tokens into a key.
fn key_of(tokens: impl Iterator<Item = TokenId>) -> u64 {
    let mut h = 0x243F_6A88_85A3_08D3u64;
    for t in tokens {
        h = (h ^ u64::from(t)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^= h >> 29;
    }
    h
}

impl NgramIndex {
    /// Proposes up to `k` drafts to follow `tokens` (all known), appending them to `out`.
    pub(crate) fn propose(
        &mut self,
        tokens: PromptAndOutput<'_>,
        cfg: &SpeculativeConfig,
        k: usize,
        out: &mut Vec<TokenId>,
    ) {
        let len = tokens.len();
        let n = cfg.prompt_lookup_min;
        if k == 0 || len <= n {
            return;
        }
        // Index every n-gram with a token after it: those ending at positions below `len`.
        let start = self.indexed_to.max(n);
        for end in start..len {
            let key = key_of((end - n..end).map(|i| tokens.get(i)));
            let slot = self.map.entry(key).or_insert([u32::MAX; CANDIDATES]);
            slot.copy_within(0..CANDIDATES - 1, 1);
            slot[0] = end as u32;
        }
        self.indexed_to = self.indexed_to.max(len);
        // The suffix of `len` itself is not indexed yet (nothing follows it).
        let key = key_of((len - n..len).map(|i| tokens.get(i)));
        let Some(cands) = self.map.get(&key) else {
            return;
        };
        // (match length, tokens it proposes, end): the largest wins.
        let mut best: Option<(usize, usize, usize)> = None;
        for &end in cands.iter().filter(|&&e| e != u32::MAX) {
            let end = end as usize;
            let mut m = 0;
            while m < cfg.prompt_lookup_max
                && m < end
                && tokens.get(end - 1 - m) == tokens.get(len - 1 - m)
            {
                m += 1;
            }
            let cand = (m, k.min(len - end), end);
            if m >= n && best.is_none_or(|b| cand > b) {
                best = Some(cand);
            }
        }
        if let Some((_, _, end)) = best {
            out.extend((end..len.min(end + k)).map(|i| tokens.get(i)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn propose(prompt: &[u32], output: &[u32], cfg: &SpeculativeConfig, k: usize) -> Vec<u32> {
        let mut idx = NgramIndex::default();
        let mut out = Vec::new();
        idx.propose(PromptAndOutput { prompt, output }, cfg, k, &mut out);
        out
    }

    /// The drafts a brute-force search finds: among the [`CANDIDATES`] most recent earlier
    /// occurrences of the last `prompt_lookup_min` tokens, the longest suffix match (capped),
    /// then the one with more tokens after it (up to `k`), then the most recent; up to `k`
    /// tokens that followed it.
    fn brute(tokens: &[u32], cfg: &SpeculativeConfig, k: usize) -> Vec<u32> {
        let len = tokens.len();
        let n = cfg.prompt_lookup_min;
        if len <= n {
            return Vec::new();
        }
        let mut best: Option<(usize, usize, usize)> = None;
        let ends = (n..len)
            .rev()
            .filter(|&e| tokens[e - n..e] == tokens[len - n..])
            .take(CANDIDATES);
        for end in ends {
            let mut m = 0;
            while m < cfg.prompt_lookup_max && m < end && tokens[end - 1 - m] == tokens[len - 1 - m]
            {
                m += 1;
            }
            let cand = (m, k.min(len - end), end);
            if m >= n && best.is_none_or(|b| cand > b) {
                best = Some(cand);
            }
        }
        match best {
            Some((_, _, end)) => tokens[end..len.min(end + k)].to_vec(),
            None => Vec::new(),
        }
    }

    #[test]
    fn proposes_what_followed_the_longest_recent_match() {
        let cfg = SpeculativeConfig::default();
        // "1 2 3 4 5 ... 1 2 3" -> "4 5 ..."
        let prompt = [9, 1, 2, 3, 4, 5, 6, 7, 8];
        assert_eq!(propose(&prompt, &[1, 2, 3], &cfg, 4), vec![4, 5, 6, 7]);
        // Fewer tokens after the match than k.
        assert_eq!(propose(&[1, 2, 3, 1, 2], &[], &cfg, 4), vec![3, 1, 2]);
        // No match of at least prompt_lookup_min tokens.
        assert!(propose(&[1, 2, 3, 4], &[5, 4], &cfg, 4).is_empty());
        // The longer match wins over the more recent one: "7 1 2" matches at the first
        // occurrence (3 tokens), only "1 2" at the second.
        let p = [7, 1, 2, 30, 8, 1, 2, 40, 7, 1, 2];
        assert_eq!(propose(&p, &[], &cfg, 2), vec![30, 8]);
    }

    #[test]
    fn incremental_index_matches_a_fresh_one_and_brute_force() {
        // A small xorshift stream: `range(lo, hi)` is in lo..hi.
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut range = |lo: u32, hi: u32| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            lo + (state % u64::from(hi - lo)) as u32
        };
        for case in 0..200 {
            let cfg = SpeculativeConfig {
                num_speculative_tokens: range(1, 7) as usize,
                prompt_lookup_min: range(1, 4) as usize,
                prompt_lookup_max: range(3, 7) as usize,
                max_running: 0,
            };
            let vocab = range(2, 8);
            let prompt: Vec<u32> = (0..range(1, 40)).map(|_| range(0, vocab)).collect();
            let mut output = Vec::new();
            let mut idx = NgramIndex::default();
            for _ in 0..30 {
                let k = cfg.num_speculative_tokens;
                let mut got = Vec::new();
                let tokens = PromptAndOutput {
                    prompt: &prompt,
                    output: &output,
                };
                idx.propose(tokens, &cfg, k, &mut got);
                let all: Vec<u32> = prompt.iter().chain(&output).copied().collect();
                assert_eq!(got, brute(&all, &cfg, k), "case {case} at {}", all.len());
                assert_eq!(got, propose(&prompt, &output, &cfg, k));
                output.push(range(0, vocab));
            }
        }
    }

    #[test]
    fn bounds_are_checked() {
        let ok = SpeculativeConfig::default();
        assert!(ok.validate().is_ok());
        for bad in [
            SpeculativeConfig {
                num_speculative_tokens: 0,
                ..ok.clone()
            },
            SpeculativeConfig {
                num_speculative_tokens: 17,
                ..ok.clone()
            },
            SpeculativeConfig {
                prompt_lookup_min: 5,
                ..ok.clone()
            },
            SpeculativeConfig {
                prompt_lookup_max: 33,
                ..ok.clone()
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }
}
