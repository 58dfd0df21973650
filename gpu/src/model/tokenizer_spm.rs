//! SentencePiece vocabularies stored in GGUF (`tokenizer.ggml.model == "llama"`: Llama 2,
//! Mistral), rebuilt as a byte-fallback BPE for the `tokenizers` crate. The merges are ranked
//! by the score of the merged piece, which reproduces SentencePiece BPE's greedy merging of the
//! highest-scoring adjacent pair (Kudo & Richardson 2018); this is also how Hugging Face
//! converts such vocabularies. Spaces become `▁`, a `▁` is prepended when
//! `tokenizer.ggml.add_space_prefix` is set, and characters outside the vocabulary fall back to
//! `<0xNN>` byte tokens.
//!
//! Every split of a piece into two pieces is a merge, so a crafted vocabulary ("a", "aa", ...,
//! 4096 "a"s) could ask for millions of merges holding gigabytes of strings. Only pieces of up
//! to [`MAX_MERGED_PIECE_CHARS`] characters are split (the SentencePiece trainer makes none
//! longer than 16 by default), and the merges of a vocabulary are capped in number and bytes
//! (`MergeCaps`); a vocabulary over a cap is refused.

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

/// Longest piece, in characters, that is split into merges; longer pieces get none, so the
/// tokenizer never produces them. The SentencePiece trainer makes no piece longer than its
/// `max_sentencepiece_length` (16 by default; Llama 2's longest normal pieces have 16).
pub const MAX_MERGED_PIECE_CHARS: usize = 64;
/// Most merges per vocabulary token (Llama 2's vocabulary makes 61,249 for 32,000 tokens,
/// under 2 per token).
pub const MAX_MERGES_PER_TOKEN: usize = 32;
/// Most merges of any vocabulary, whatever its size.
pub const MAX_MERGES: usize = 1 << 22;
/// Most bytes of merge strings (both halves of every merge) of any vocabulary (Llama 2's
/// make 422 KB).
pub const MAX_MERGE_BYTES: usize = 1 << 27;

/// Bounds on the merges derived from a vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct MergeCaps {
    /// Longest piece, in characters, that is split into merges.
    max_piece_chars: usize,
    /// Most merges.
    max_merges: usize,
    /// Most bytes of merge strings.
    max_bytes: usize,
}

impl MergeCaps {
    /// The caps for a vocabulary of `n_tokens` tokens.
    fn for_vocab(n_tokens: usize) -> Self {
        MergeCaps {
            max_piece_chars: MAX_MERGED_PIECE_CHARS,
            max_merges: n_tokens
                .saturating_mul(MAX_MERGES_PER_TOKEN)
                .min(MAX_MERGES),
            max_bytes: MAX_MERGE_BYTES,
        }
    }
}

fn tok_err(e: impl std::fmt::Display) -> GpuError {
    GpuError::Tokenizer(e.to_string())
}

/// Merge rules for a SentencePiece vocabulary: every split of a normal piece of at most
/// `caps.max_piece_chars` characters into two normal pieces, ordered by the merged piece's
/// score (highest first), ties by the parts' ids. A vocabulary that makes more merges or more
/// bytes of merge strings than `caps` allows is refused.
fn merges_from_scores(
    tokens: &[&str],
    scores: &[f32],
    types: &[i64],
    caps: MergeCaps,
) -> Result<Vec<(String, String)>, GpuError> {
    let normal: HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| types[*i] == TOKEN_TYPE_NORMAL)
        .map(|(i, t)| (*t, i))
        .collect();
    let mut merges: Vec<(f32, usize, usize)> = Vec::new();
    let mut bytes = 0usize;
    for (id, piece) in tokens.iter().enumerate() {
        if types[id] != TOKEN_TYPE_NORMAL || piece.chars().nth(caps.max_piece_chars).is_some() {
            continue;
        }
        for (at, _) in piece.char_indices().skip(1) {
            let (l, r) = piece.split_at(at);
            if let (Some(&li), Some(&ri)) = (normal.get(l), normal.get(r)) {
                if merges.len() >= caps.max_merges {
                    return Err(tok_err(format!(
                        "the SentencePiece vocabulary makes more than {} merges, the cap \
                         ({MAX_MERGES_PER_TOKEN} per token, at most {MAX_MERGES})",
                        caps.max_merges
                    )));
                }
                bytes = bytes.saturating_add(piece.len());
                if bytes > caps.max_bytes {
                    return Err(tok_err(format!(
                        "the SentencePiece vocabulary's merges hold more than {} bytes of \
                         strings, the cap",
                        caps.max_bytes
                    )));
                }
                merges.push((scores[id], li, ri));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    Ok(merges
        .into_iter()
        .map(|(_, l, r)| (tokens[l].to_string(), tokens[r].to_string()))
        .collect())
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
    let merges = merges_from_scores(tokens, scores, types, MergeCaps::for_vocab(tokens.len()))?;
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
        let m = merges_from_scores(&tokens, &scores, &types, MergeCaps::for_vocab(6))
            .expect("within the caps");
        let pairs: Vec<(&str, &str)> = m.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        // "bc" scores highest, then "ab", then the two ways to make "abc".
        assert_eq!(
            pairs,
            vec![("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]
        );
    }

    /// The reviewer's bomb ("a", "aa", ..., 4096 "a"s asked for 8.4M merges): pieces over
    /// the length cap get no merges, the shorter ones keep theirs.
    #[test]
    fn long_pieces_are_not_split_into_merges() {
        let pieces: Vec<String> = (1..=200).map(|n| "a".repeat(n)).collect();
        let tokens: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let scores = vec![0f32; tokens.len()];
        let types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
        let m = merges_from_scores(&tokens, &scores, &types, MergeCaps::for_vocab(tokens.len()))
            .expect("within the caps");
        // A piece of n <= 64 characters makes n - 1 merges.
        assert_eq!(
            m.len(),
            (1..=MAX_MERGED_PIECE_CHARS).map(|n| n - 1).sum::<usize>()
        );
        assert!(m
            .iter()
            .all(|(l, r)| l.len() + r.len() <= MAX_MERGED_PIECE_CHARS));
    }

    /// A vocabulary whose pieces are all within the length cap but that makes more than
    /// `MAX_MERGES_PER_TOKEN` merges per token ("a"-runs with one "b" anywhere: 2,144 tokens,
    /// 89,376 merges) is refused, and so is one over a byte cap.
    #[test]
    fn too_many_merges_are_refused() {
        let mut pieces: Vec<String> = (1..=64).map(|n| "a".repeat(n)).collect();
        for i in 0..64 {
            for j in 0..64 - i {
                pieces.push(format!("{}b{}", "a".repeat(i), "a".repeat(j)));
            }
        }
        let tokens: Vec<&str> = pieces.iter().map(String::as_str).collect();
        let scores = vec![0f32; tokens.len()];
        let types = vec![TOKEN_TYPE_NORMAL; tokens.len()];
        let e = merges_from_scores(&tokens, &scores, &types, MergeCaps::for_vocab(tokens.len()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 68608 merges"), "{e}");
        let Err(e) = build_spm(&tokens, &scores, &types, true) else {
            panic!("build_spm accepted a vocabulary over the merge cap");
        };
        assert!(e.to_string().contains("merges"), "{e}");

        let tokens = ["a", "b", "ab", "abab"];
        let caps = MergeCaps {
            max_bytes: 5,
            ..MergeCaps::for_vocab(tokens.len())
        };
        // "ab" costs 2 bytes, "abab" 4: 6 bytes in all.
        let e = merges_from_scores(&tokens, &[0.0; 4], &[TOKEN_TYPE_NORMAL; 4], caps)
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than 5 bytes"), "{e}");
    }
}
