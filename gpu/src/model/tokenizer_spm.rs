//! SentencePiece vocabularies stored in GGUF (`tokenizer.ggml.model == "llama"`: Llama 2,
//! Mistral), rebuilt as a byte-fallback BPE for the `tokenizers` crate. The merges are ranked
//! by the score of the merged piece, which reproduces SentencePiece BPE's greedy merging of the
//! highest-scoring adjacent pair (Kudo & Richardson 2018); this is also how Hugging Face
//! converts such vocabularies. Spaces become `▁`, a `▁` is prepended when
//! `tokenizer.ggml.add_space_prefix` is set, and characters outside the vocabulary fall back to
//! `<0xNN>` byte tokens.

use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::{DecoderWrapper, NormalizerWrapper};

use crate::error::GpuError;

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_NORMAL: i64 = 1;
const TOKEN_TYPE_UNKNOWN: i64 = 2;

/// SentencePiece's word-boundary marker.
const SPACE_MARK: &str = "\u{2581}";

fn tok_err(e: impl std::fmt::Display) -> GpuError {
    GpuError::Tokenizer(e.to_string())
}

/// Merge rules for a SentencePiece vocabulary: every split of a normal piece into two normal
/// pieces, ordered by the merged piece's score (highest first), ties by the parts' ids.
fn merges_from_scores(tokens: &[&str], scores: &[f32], types: &[i64]) -> Vec<(String, String)> {
    let normal: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i] == TOKEN_TYPE_NORMAL)
        .map(|(i, t)| (*t, i))
        .collect();
    let mut merges: Vec<(f32, usize, usize)> = Vec::new();
    for (id, piece) in tokens.iter().enumerate() {
        if types[id] != TOKEN_TYPE_NORMAL {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (normal.get(l), normal.get(r)) {
                merges.push((scores[id], li, ri));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    merges
        .into_iter()
        .map(|(_, l, r)| (tokens[l].to_string(), tokens[r].to_string()))
        .collect()
}

/// Builds the `tokenizers` pipeline for a SentencePiece vocabulary (special tokens are added
/// by the caller).
pub(super) fn build_spm(
    tokens: &[&str],
    scores: &[f32],
    types: &[i64],
    add_space_prefix: bool,
) -> Result<tokenizers::Tokenizer, GpuError> {
    if scores.len() != tokens.len() || types.len() != tokens.len() {
        return Err(tok_err("tokens, scores and token types differ in length"));
    }
    let mut vocab = Vocab::default();
    for (id, t) in tokens.iter().enumerate() {
        vocab.entry((*t).to_string()).or_insert(id as u32);
    }
    let merges = merges_from_scores(tokens, scores, types);
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = types.iter().position(|&t| t == TOKEN_TYPE_UNKNOWN) {
        builder = builder.unk_token(tokens[unk].to_string());
    }
    let mut inner = tokenizers::Tokenizer::new(builder.build().map_err(tok_err)?);
    let replace = Replace::new(" ", SPACE_MARK).map_err(tok_err)?;
    let normalizer: NormalizerWrapper = if add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new(SPACE_MARK.into()).into(), replace.into()]).into()
    } else {
        replace.into()
    };
    inner.with_normalizer(Some(normalizer));
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPACE_MARK, " ").map_err(tok_err)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_space_prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    inner.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merges_follow_piece_scores() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc"];
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let types = [1; 6];
        let m = merges_from_scores(&tokens, &scores, &types);
        let pairs: Vec<(&str, &str)> = m.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        // "bc" scores highest, then "ab", then the two ways to make "abc".
        assert_eq!(
            pairs,
            vec![("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
        );
    }
}
