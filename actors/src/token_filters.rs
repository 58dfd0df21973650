//! vLLM's `allowed_token_ids` and `bad_words` on the engine's side: a request's filters, the
//! tokenization of its bad words as vLLM does it, and the one constraint per choice that the
//! backends sample under (`switchyard_gpu::token_filter`), together with the choice's
//! structured-output grammar when it has one.
//!
//! These are not structured output: they are compiled by no grammar engine, counted in no
//! `structured_output_*` metric, and never fail (a choice whose grammar and filters allow no
//! token in common may only end, through its end ids).

use std::sync::Arc;

use switchyard_gpu::{AllowedTokens, BadWords, Constraint, Intersection, TokenConstraint};

/// vLLM's token filters of a request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenFilters {
    /// Only these tokens may be sampled; end-of-sequence tokens are not added. The engine
    /// refuses an empty list and ids outside the vocabulary (the HTTP layer bounds the count).
    pub allowed_token_ids: Option<Arc<[u32]>>,
    /// Words the output may not contain as tokens, tokenized by [`bad_word_sequences`] (the
    /// HTTP layer bounds their count and length).
    pub bad_words: Vec<String>,
}

impl TokenFilters {
    /// Whether the request has no filter.
    pub fn is_empty(&self) -> bool {
        self.allowed_token_ids.is_none() && self.bad_words.is_empty()
    }
}

/// The banned token sequences of `words`, as vLLM's `SamplingParams.update_from_tokenizer`
/// makes them: each word without its leading whitespace is encoded without special tokens;
/// then, with one space before it, encoded again and kept too when that encoding is as long
/// as the first and starts with another token (a byte-level BPE's ` word`, so the word is
/// banned inside the text as well as at its start). A tokenizer that adds a prefix space
/// itself (SentencePiece's `▁`) gives the same first token, or a longer encoding, for the
/// spaced form, which is then not kept. Empty encodings are left out (vLLM fails on them).
pub fn bad_word_sequences<E>(
    words: &[String],
    mut encode: impl FnMut(&str) -> Result<Vec<u32>, E>,
) -> Result<Vec<Vec<u32>>, E> {
    let mut out: Vec<Vec<u32>> = Vec::with_capacity(words.len() * 2);
    for word in words {
        let word = word.trim_start();
        let plain = encode(word)?;
        let spaced = encode(&format!(" {word}"))?;
        let keep_spaced = match (plain.first(), spaced.first()) {
            (Some(p), Some(s)) => p != s && plain.len() == spaced.len(),
            (None, Some(_)) => true,
            (_, None) => false,
        };
        if !plain.is_empty() {
            out.push(plain);
        }
        if keep_spaced {
            out.push(spaced);
        }
    }
    Ok(out)
}

/// One constraint per choice (`n`) for a request with filters: the intersection of the
/// choice's grammar (`grammar[i]`, when the request has structured output), its
/// `allowed_token_ids` and a fresh [`BadWords`] state over `bad_words`; when they allow no
/// token in common, only `end_ids`. Without filters, the grammar's constraints as they are.
pub fn choice_constraints(
    filters: &TokenFilters,
    grammar: Vec<Constraint>,
    bad_words: Option<Arc<[Vec<u32>]>>,
    n: usize,
    vocab: usize,
    end_ids: Arc<[u32]>,
) -> Vec<Constraint> {
    if filters.is_empty() {
        return grammar;
    }
    let allowed = filters
        .allowed_token_ids
        .as_ref()
        .map(|ids| AllowedTokens::new(ids, vocab));
    (0..n)
        .map(|i| {
            let mut parts: Vec<Box<dyn TokenConstraint>> = Vec::with_capacity(3);
            if let Some(g) = grammar.get(i) {
                parts.push(Box::new(g.clone()));
            }
            if let Some(a) = &allowed {
                parts.push(Box::new(a.clone()));
            }
            if let Some(w) = &bad_words {
                parts.push(Box::new(BadWords::new(w.clone())));
            }
            Constraint::new(Intersection::new(parts, end_ids.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use switchyard_gpu::constraint::is_allowed;

    fn words(list: &[&str]) -> Vec<String> {
        list.iter().map(|w| (*w).to_owned()).collect()
    }

    /// An encoder over a fixed table (texts it does not know fail).
    fn table(entries: &[(&str, &[u32])]) -> impl FnMut(&str) -> Result<Vec<u32>, String> {
        let map: HashMap<String, Vec<u32>> = entries
            .iter()
            .map(|(t, ids)| ((*t).to_owned(), ids.to_vec()))
            .collect();
        move |t: &str| map.get(t).cloned().ok_or_else(|| format!("unknown {t:?}"))
    }

    /// A byte-level BPE (no prefix space of its own): ` word` is a token of its own, kept.
    #[test]
    fn a_spaced_word_of_another_token_is_banned_too() {
        let enc = table(&[
            ("Paris", &[10]),
            (" Paris", &[11]),
            ("New York", &[20, 21]),
            (" New York", &[22, 21]),
        ]);
        let got = bad_word_sequences(&words(&["Paris", "  New York"]), enc).unwrap();
        assert_eq!(got, vec![vec![10], vec![11], vec![20, 21], vec![22, 21]]);
    }

    /// A SentencePiece tokenizer adds `▁` itself: the spaced form starts with the same token,
    /// or splits into more tokens; either way it is not kept.
    #[test]
    fn a_prefix_space_tokenizer_keeps_the_plain_form_only() {
        let enc = table(&[
            ("hello", &[5]),
            (" hello", &[5]),
            ("world", &[7]),
            (" world", &[3, 7]),
        ]);
        let got = bad_word_sequences(&words(&["hello", "world"]), enc).unwrap();
        assert_eq!(got, vec![vec![5], vec![7]]);
    }

    #[test]
    fn empty_encodings_are_left_out_and_errors_pass_through() {
        let enc = table(&[("", &[]), (" ", &[4])]);
        assert_eq!(
            bad_word_sequences(&words(&[" "]), enc).unwrap(),
            vec![vec![4]]
        );
        let enc = table(&[]);
        assert!(bad_word_sequences(&words(&["x"]), enc).is_err());
    }

    /// Each choice gets its own bad-words state; the grammar, the allowed ids and the bad words
    /// meet in one set.
    #[test]
    fn each_choice_has_its_own_state() {
        let filters = TokenFilters {
            allowed_token_ids: Some(Arc::from([1u32, 2, 3])),
            bad_words: words(&["x"]),
        };
        let sequences: Arc<[Vec<u32>]> = Arc::from(vec![vec![1, 2]]);
        let cs = choice_constraints(
            &filters,
            Vec::new(),
            Some(sequences),
            2,
            40,
            Arc::from([0u32]),
        );
        assert_eq!(cs.len(), 2);
        cs[0].commit(1);
        let first = cs[0].allowed(40);
        let second = cs[1].allowed(40);
        assert!(!is_allowed(&first, 2) && is_allowed(&first, 3));
        assert!(is_allowed(&second, 2) && !is_allowed(&second, 0));
        // No filters: the grammar's constraints unchanged (none here).
        let none = choice_constraints(
            &TokenFilters::default(),
            Vec::new(),
            None,
            2,
            40,
            Arc::from([0u32]),
        );
        assert!(none.is_empty());
    }
}
