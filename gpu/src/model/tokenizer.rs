//! Tokenizers: a Hugging Face `tokenizer.json` through the `tokenizers` crate, or a tokenizer
//! rebuilt from a GGUF file's embedded vocabulary (`tokenizer.ggml.*`): byte-level BPE
//! (`gpt2`) with the pre-tokenizer named by `tokenizer.ggml.pre` (the regexes of llama.cpp's
//! pre-tokenizer table for "gpt2", "llama-bpe"/"llama3", "smollm", "qwen2" and "gpt-4o"), or
//! SentencePiece
//! (`llama`, see `tokenizer_spm`).
//!
//! Byte-level BPE (GPT-2, Radford et al. 2019) maps every byte to a printable unicode character
//! before merging; [`Tokenizer::token_bytes`] undoes that mapping so the detokenizer can work
//! on raw bytes and never split a UTF-8 character.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::gguf::{GgufHeader, GgufValue};
use super::tokenizer_spm::build_spm;
use crate::error::GpuError;

/// Largest vocabulary accepted.
pub const MAX_VOCAB: usize = 1 << 22;
/// Longest token text accepted from a GGUF vocabulary, in bytes.
pub const MAX_TOKEN_LEN: usize = 4096;
/// Longest text `encode` accepts, in bytes.
pub const MAX_ENCODE_LEN: usize = 64 << 20;
/// Largest `tokenizer.json` accepted, in bytes.
pub const MAX_TOKENIZER_JSON: u64 = 256 << 20;
/// Bytes allowed past `tokens x longest token` by [`Tokenizer::max_text_len`] (template and
/// special text; never needed by the arithmetic, kept as slack).
pub const TEXT_LEN_MARGIN: usize = 4096;

/// Control tokens llama.cpp ends generation on by name (`llama_vocab::impl::load`), besides
/// the EOS/EOT/EOM ids the file names.
const END_OF_GENERATION_TOKENS: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "<end_of_utterance>",
    "<|return|>",
    "<|call|>",
    "</s>",
];

/// Llama 3's pre-tokenizer regex (OpenAI's cl100k pattern).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's split (`tokenizer.ggml.pre` "qwen2"): Llama 3's with every digit alone.
const QWEN2_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// OpenAI's o200k split (`tokenizer.ggml.pre` "gpt-4o", llama.cpp's name for it; Phi-4-mini):
/// words by case runs with their contractions, digits in threes, punctuation with trailing
/// newlines and slashes.
const GPT4O_PATTERN: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
);

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The byte → printable character table of byte-level BPE: bytes that are printable
/// (`!`..=`~`, `¡`..=`¬`, `®`..=`ÿ`) stand for themselves, the others take the code points
/// from 256 upwards in byte order.
fn byte_to_char_table() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
        let cp = if printable {
            u32::from(b)
        } else {
            next += 1;
            next - 1
        };
        table[usize::from(b)] = char::from_u32(cp).unwrap_or('\0');
    }
    table
}

/// The inverse of [`byte_to_char_table`].
fn char_to_byte_map() -> HashMap<char, u8> {
    byte_to_char_table()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// How token strings map back to bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
enum TokenEncoding {
    /// GPT-2 byte-level: each char is one byte.
    ByteLevel,
    /// SentencePiece style: `▁` is a space, `<0xNN>` is a raw byte, the rest is UTF-8.
    Metaspace,
}

/// A tokenizer with what the engine needs around it: special-token handling, BOS/EOS ids and
/// raw token bytes for incremental detokenization.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    token_bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    bos_token_id: Option<u32>,
    eos_token_ids: Vec<u32>,
    add_bos: bool,
    /// The EOS id `encode(.., true)` appends (GGUF `tokenizer.ggml.add_eos_token`).
    add_eos: Option<u32>,
    encoding: TokenEncoding,
    /// Most bytes of (un-normalized) text one token can stand for, or `None` when the
    /// pipeline can fold unbounded text into one token (see [`bytes_per_token`]).
    bytes_per_token: Option<usize>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

fn tok_err(e: impl std::fmt::Display) -> GpuError {
    GpuError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// Builds the tokenizer embedded in a GGUF file (`tokenizer.ggml.model` "gpt2" or "llama").
    pub fn from_gguf(h: &GgufHeader) -> Result<Self, GpuError> {
        let model = h.get_str("tokenizer.ggml.model").unwrap_or("(missing)");
        let spm = match model {
            "gpt2" => false,
            "llama" => true,
            other => {
                return Err(tok_err(format!(
                    "GGUF tokenizer model '{other}' is not supported ('gpt2' byte-level BPE \
                     and 'llama' SentencePiece are)"
                )))
            }
        };
        let tokens = h
            .get_array("tokenizer.ggml.tokens")
            .ok_or_else(|| tok_err("GGUF lacks tokenizer.ggml.tokens"))?;
        if tokens.is_empty() || tokens.len() > MAX_VOCAB {
            return Err(tok_err(format!("vocabulary of {} tokens", tokens.len())));
        }
        let tokens: Vec<&str> = tokens
            .iter()
            .map(|t| match t.as_str() {
                Some(s) if s.len() <= MAX_TOKEN_LEN => Ok(s),
                _ => Err(tok_err("a token is not a string or is too long")),
            })
            .collect::<Result<_, _>>()?;
        let types: Vec<i64> = match h.get_array("tokenizer.ggml.token_type") {
            Some(a) if a.len() == tokens.len() => a
                .iter()
                .map(|v| {
                    v.as_i64()
                        .ok_or_else(|| tok_err("token_type is not an integer"))
                })
                .collect::<Result<_, _>>()?,
            Some(_) => return Err(tok_err("token_type and tokens differ in length")),
            None => vec![1; tokens.len()],
        };
        let (mut inner, encoding, default_add_bos) = if spm {
            let scores: Vec<f32> = h
                .get_array("tokenizer.ggml.scores")
                .ok_or_else(|| tok_err("GGUF lacks tokenizer.ggml.scores"))?
                .iter()
                .map(|v| {
                    v.as_f64()
                        .map(|x| x as f32)
                        .ok_or_else(|| tok_err("a token score is not a number"))
                })
                .collect::<Result<_, _>>()?;
            let add_space_prefix = h
                .get("tokenizer.ggml.add_space_prefix")
                .and_then(GgufValue::as_bool)
                .unwrap_or(true);
            let inner = build_spm(&tokens, &scores, &types, add_space_prefix)?;
            (inner, TokenEncoding::Metaspace, true)
        } else {
            let (inner, add_bos) = build_byte_level_bpe(h, &tokens)?;
            (inner, TokenEncoding::ByteLevel, add_bos)
        };
        // Control tokens (and SentencePiece's unknown token) are special; user-defined tokens
        // are matched in text but decoded like ordinary text.
        let is_special = |ty: i64| ty == TOKEN_TYPE_CONTROL || (spm && ty == TOKEN_TYPE_UNKNOWN);
        let added: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, &ty)| is_special(ty) || ty == TOKEN_TYPE_USER_DEFINED)
            .map(|(t, &ty)| AddedToken::from(*t, is_special(ty)).normalized(false))
            .collect();
        inner.add_special_tokens(&added);

        let id = |k: &str| -> Result<Option<u32>, GpuError> {
            match h.get(k).map(GgufValue::as_u64) {
                None => Ok(None),
                Some(Some(v)) if (v as usize) < tokens.len() => Ok(Some(v as u32)),
                Some(_) => Err(tok_err(format!("{k} is not a valid token id"))),
            }
        };
        let bos_token_id = id("tokenizer.ggml.bos_token_id")?;
        let eos_token_id = id("tokenizer.ggml.eos_token_id")?;
        let mut eos_token_ids = Vec::new();
        let mut push = |e: u32| {
            if !eos_token_ids.contains(&e) {
                eos_token_ids.push(e);
            }
        };
        for k in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(e) = id(k)? {
                push(e);
            }
        }
        if let Some(e) = eos_token_id {
            push(e);
        }
        // As llama.cpp: control tokens with these names end generation too; gpt-oss ends a
        // message (not the generation) with `<|end|>` when it has `<|return|>`.
        let has_return = tokens.contains(&"<|return|>");
        for (i, (t, &ty)) in tokens.iter().zip(&types).enumerate() {
            if ty == TOKEN_TYPE_CONTROL
                && END_OF_GENERATION_TOKENS.contains(t)
                && !(has_return && *t == "<|end|>")
            {
                push(i as u32);
            }
        }
        // EOS first: what callers take as "the" end token.
        if let Some(e) = eos_token_id {
            eos_token_ids.retain(|&x| x != e);
            eos_token_ids.insert(0, e);
        }
        let add_bos = h
            .get("tokenizer.ggml.add_bos_token")
            .and_then(GgufValue::as_bool)
            .unwrap_or(default_add_bos)
            && bos_token_id.is_some();
        let add_eos = eos_token_id.filter(|_| {
            h.get("tokenizer.ggml.add_eos_token")
                .and_then(GgufValue::as_bool)
                .unwrap_or(false)
        });
        let special: Vec<bool> = types.iter().map(|&t| is_special(t)).collect();
        let token_bytes = build_token_bytes(&inner, tokens.len(), encoding);
        let bytes_per_token = bytes_per_token(&inner, &token_bytes);
        Ok(Tokenizer {
            inner,
            token_bytes,
            special,
            bos_token_id,
            eos_token_ids,
            add_bos,
            add_eos,
            encoding,
            bytes_per_token,
        })
    }

    /// Loads a Hugging Face `tokenizer.json`. BOS/EOS ids are not in that file: set them with
    /// [`Tokenizer::set_special_ids`] from the model's configuration.
    ///
    /// The file must be a regular file (links are followed) of at most [`MAX_TOKENIZER_JSON`]
    /// bytes. At most one byte more is read, so a file that grows while it is read is refused
    /// too.
    pub fn from_file(path: &Path) -> Result<Self, GpuError> {
        let text = super::read_bounded(path, MAX_TOKENIZER_JSON)?;
        Self::from_json_bytes(text.as_bytes())
    }

    /// Parses the contents of a Hugging Face `tokenizer.json`.
    pub fn from_json_bytes(bytes: &[u8]) -> Result<Self, GpuError> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(tok_err)?;
        // Ids may have gaps (added tokens past the model's vocabulary): cover the largest.
        let n = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        if n == 0 || n > MAX_VOCAB {
            return Err(tok_err(format!("vocabulary of {n} tokens")));
        }
        // The decoder as parsed (no second pass over the file): byte-level if a ByteLevel
        // decoder is in it, alone or in a sequence.
        let byte_level = inner.get_decoder().is_some_and(has_byte_level_decoder);
        let encoding = if byte_level {
            TokenEncoding::ByteLevel
        } else {
            TokenEncoding::Metaspace
        };
        // A post-processor's special tokens carry their own ids (`TemplateProcessing`'s `ids`,
        // `BertProcessing`'s `cls` and `sep`), which need not be in the vocabulary: every
        // prompt encoded with special tokens would hand the model an id past its embedding.
        if let Some(post) = inner.get_post_processor() {
            use tokenizers::PostProcessor;
            let empty = tokenizers::Encoding::default();
            let added = post
                .process(empty, None, true)
                .map_err(|e| tok_err(format!("post_processor: {e}")))?;
            if let Some(bad) = added.get_ids().iter().find(|&&id| id as usize >= n) {
                return Err(tok_err(format!(
                    "post_processor adds token id {bad}, outside the vocabulary of {n} tokens"
                )));
            }
        }
        let mut special = vec![false; n];
        for (id, tok) in inner.get_added_tokens_decoder() {
            if let Some(s) = special.get_mut(id as usize) {
                *s = tok.special;
            }
        }
        let token_bytes = build_token_bytes(&inner, n, encoding);
        let bytes_per_token = bytes_per_token(&inner, &token_bytes);
        Ok(Tokenizer {
            inner,
            token_bytes,
            special,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            add_bos: false,
            add_eos: None,
            encoding,
            bytes_per_token,
        })
    }

    /// Sets the BOS and EOS ids (for `tokenizer.json`, whose post-processor adds BOS itself).
    pub fn set_special_ids(&mut self, bos_token_id: Option<u32>, eos_token_ids: Vec<u32>) {
        self.bos_token_id = bos_token_id;
        self.eos_token_ids = eos_token_ids;
    }

    /// The longest text (in bytes) that could encode to at most `max_tokens` tokens: a longer
    /// one cannot fit, and can be refused before spending time on encoding it. It is
    /// `max_tokens` times the most bytes one token stands for, plus [`TEXT_LEN_MARGIN`];
    /// [`MAX_ENCODE_LEN`] when the pipeline can fold unbounded text into one token (an unknown
    /// word, stripped whitespace: see [`bytes_per_token`]).
    pub fn max_text_len(&self, max_tokens: usize) -> usize {
        self.bytes_per_token
            .map_or(MAX_ENCODE_LEN, |b| {
                max_tokens.saturating_mul(b).saturating_add(TEXT_LEN_MARGIN)
            })
            .min(MAX_ENCODE_LEN)
    }

    /// Encodes `text`. Special tokens written in the text (e.g. `<|im_start|>`) are always
    /// recognised; `add_special` adds what the model's tokenizer adds around a sequence (BOS,
    /// and EOS where a GGUF file asks for it).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>, GpuError> {
        if text.len() > MAX_ENCODE_LEN {
            return Err(tok_err(format!("text of {} bytes is too long", text.len())));
        }
        let enc = self.inner.encode_fast(text, add_special).map_err(tok_err)?;
        let mut ids = Vec::with_capacity(enc.get_ids().len() + 1);
        if add_special && self.add_bos {
            if let Some(bos) = self.bos_token_id {
                ids.push(bos);
            }
        }
        ids.extend_from_slice(enc.get_ids());
        if add_special {
            ids.extend(self.add_eos);
        }
        Ok(ids)
    }

    /// The added tokens (special or not, matched in text before the model's own split): each
    /// one's id, text and whether it is special (a control token).
    pub fn added_tokens(&self) -> Vec<(u32, String, bool)> {
        let mut added: Vec<(u32, String, bool)> = self
            .inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (id, t.content, t.special))
            .collect();
        added.sort_unstable_by_key(|a| a.0);
        added
    }

    /// Encodes `text` as [`Tokenizer::encode`] does without `add_special`, except that no
    /// added token is matched where it overlaps one of the byte ranges `as_text` (sorted, not
    /// overlapping): that text is encoded as ordinary text, as Hugging Face's
    /// `split_special_tokens` encodes the whole of a text. The rest is encoded exactly as
    /// `encode` encodes it: the added tokens outside the ranges are the ones `encode` finds,
    /// and what lies between them is normalized, pre-tokenized and split by the model as one
    /// piece of the whole text (its offsets kept, so a SentencePiece prefix space goes only
    /// where the text starts).
    pub fn encode_with_text_spans(
        &self,
        text: &str,
        as_text: &[std::ops::Range<usize>],
    ) -> Result<Vec<u32>, GpuError> {
        use tokenizers::tokenizer::normalizer::Range as Span;
        use tokenizers::{
            Model, Normalizer, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer,
            Token,
        };
        if as_text.is_empty() {
            return self.encode(text, false);
        }
        if text.len() > MAX_ENCODE_LEN {
            return Err(tok_err(format!("text of {} bytes is too long", text.len())));
        }
        // The added tokens `encode` matches (their byte offsets in `text`), less those over
        // `as_text`: `encode`'s first pass, without the model's.
        let found = self
            .inner
            .get_added_vocabulary()
            .extract_and_normalize(self.inner.get_normalizer(), text);
        let overlaps = |(a, b): (usize, usize)| as_text.iter().any(|r| a < r.end && r.start < b);
        let kept: Vec<(usize, usize, u32)> = found
            .get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .filter_map(|(_, span, tokens)| match tokens.as_deref() {
                Some([token]) if !overlaps(span) => Some((span.0, span.1, token.id)),
                _ => None,
            })
            .collect();
        let mut pre = PreTokenizedString::from(text);
        pre.split(|_, whole| {
            let mut pieces = Vec::with_capacity(2 * kept.len() + 1);
            let mut at = 0;
            for &(a, b, id) in &kept {
                if a < at || b > text.len() {
                    return Err("added tokens out of order".into());
                }
                if a > at {
                    let piece = whole.slice(Span::Original(at..a)).ok_or("bad piece")?;
                    pieces.push((piece, None));
                }
                let token = whole.slice(Span::Original(a..b)).ok_or("bad token span")?;
                let value = token.get().to_owned();
                let len = value.len();
                pieces.push((token, Some(vec![Token::new(id, value, (0, len))])));
                at = b;
            }
            if at < text.len() {
                let rest = whole
                    .slice(Span::Original(at..text.len()))
                    .ok_or("bad piece")?;
                pieces.push((rest, None));
            }
            Ok(pieces)
        })
        .map_err(tok_err)?;
        if let Some(n) = self.inner.get_normalizer() {
            pre.normalize(|s| n.normalize(s)).map_err(tok_err)?;
        }
        if let Some(p) = self.inner.get_pre_tokenizer() {
            p.pre_tokenize(&mut pre).map_err(tok_err)?;
        }
        let model = self.inner.get_model();
        pre.tokenize(|s| model.tokenize(s.get())).map_err(tok_err)?;
        let encoding = pre
            .into_encoding(None, 0, OffsetType::None)
            .map_err(tok_err)?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Decodes `ids` to text; `skip_special` drops special (control) tokens. Invalid UTF-8 is
    /// replaced by U+FFFD. Unknown ids are an error.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, GpuError> {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= self.token_bytes.len()) {
            return Err(tok_err(format!("token id {bad} is out of range")));
        }
        if self.encoding == TokenEncoding::Metaspace {
            // SentencePiece decoders also strip the leading space: let the tokenizer do it.
            return self.inner.decode(ids, skip_special).map_err(tok_err);
        }
        let mut bytes = Vec::new();
        for &id in ids {
            if skip_special && self.is_special(id) {
                continue;
            }
            bytes.extend_from_slice(&self.token_bytes[id as usize]);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The raw bytes a token stands for (byte-level mapping undone), for incremental
    /// detokenization; `None` for an id outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.token_bytes.get(id as usize).map(Vec::as_slice)
    }

    /// Whether `id` is a special (control) token such as `<|im_end|>`.
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// The tokenizer as Hugging Face `tokenizer.json` text.
    pub fn to_json(&self) -> Result<String, GpuError> {
        self.inner.to_string(false).map_err(tok_err)
    }

    /// The id of a token string (including special tokens).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string form of a token as stored in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of token ids (including added tokens).
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    /// The beginning-of-sequence token, if the model has one.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// Tokens that end generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }
}

/// The byte-level BPE pipeline of a `gpt2` GGUF vocabulary, and whether its pre-tokenizer
/// family adds BOS by default.
fn build_byte_level_bpe(
    h: &GgufHeader,
    tokens: &[&str],
) -> Result<(tokenizers::Tokenizer, bool), GpuError> {
    let merges = h
        .get_array("tokenizer.ggml.merges")
        .ok_or_else(|| tok_err("GGUF lacks tokenizer.ggml.merges"))?
        .iter()
        .map(parse_merge)
        .collect::<Result<Vec<_>, _>>()?;
    let pre = h.get_str("tokenizer.ggml.pre").unwrap_or_else(|| {
        // Files converted before llama.cpp recorded the pre-tokenizer: GPT-2's is the default.
        tracing::warn!("GGUF has no tokenizer.ggml.pre; using GPT-2's pre-tokenizer");
        "gpt2"
    });
    let (pre_tokenizer, ignore_merges, default_add_bos) = pre_tokenizer_for(pre)?;
    let mut vocab = Vocab::default();
    for (id, t) in tokens.iter().enumerate() {
        // Keep the first id of a duplicated token string, as llama.cpp does.
        vocab.entry((*t).to_string()).or_insert(id as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tok_err)?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    // Qwen2's tokenizer.json composes text to NFC first (llama.cpp does not; transformers
    // does, and it is the reference).
    if pre == "qwen2" {
        inner.with_normalizer(Some(NFC));
    }
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(ByteLevelDecoder::default()));
    Ok((inner, default_add_bos))
}

/// Splits a GGUF merge rule `"a b"` into its pair.
fn parse_merge(v: &GgufValue) -> Result<(String, String), GpuError> {
    let s = v
        .as_str()
        .filter(|s| s.len() <= 2 * MAX_TOKEN_LEN)
        .ok_or_else(|| tok_err("a merge is not a string or is too long"))?;
    // Search from the second byte so that a left part starting with a space stays whole.
    let first_len = s.chars().next().map_or(0, char::len_utf8);
    match s.get(first_len..).and_then(|rest| rest.find(' ')) {
        Some(i) => Ok((
            s[..first_len + i].to_string(),
            s[first_len + i + 1..].to_string(),
        )),
        None => Err(tok_err(format!("malformed merge '{s}'"))),
    }
}

/// The pre-tokenizer, `ignore_merges` flag and default `add_bos` for a `tokenizer.ggml.pre`.
fn pre_tokenizer_for(pre: &str) -> Result<(PreTokenizerWrapper, bool, bool), GpuError> {
    let split = |pattern: &str| -> Result<PreTokenizerWrapper, GpuError> {
        Ok(Split::new(
            SplitPattern::Regex(pattern.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tok_err)?
        .into())
    };
    // With `use_regex`, the byte-level pre-tokenizer first splits with GPT-2's regex
    // ('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)).
    let byte_level =
        |use_regex: bool| -> PreTokenizerWrapper { ByteLevel::new(false, false, use_regex).into() };
    Ok(match pre {
        // llama.cpp writes "gpt-2"; older files "gpt2".
        "gpt2" | "gpt-2" => (byte_level(true), false, false),
        // llama.cpp gives these the same split: each numeral alone, then GPT-2's regex.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" => (
            Sequence::new(vec![Digits::new(true).into(), byte_level(true)]).into(),
            false,
            false,
        ),
        "llama-bpe" | "llama3" => (
            Sequence::new(vec![split(LLAMA3_PATTERN)?, byte_level(false)]).into(),
            true,
            true,
        ),
        // Phi-4-mini: no BOS, merges as listed (llama.cpp ignores them only for Llama 3).
        "gpt-4o" => (
            Sequence::new(vec![split(GPT4O_PATTERN)?, byte_level(false)]).into(),
            false,
            false,
        ),
        // Qwen2 and Qwen2.5: no BOS.
        "qwen2" => (
            Sequence::new(vec![split(QWEN2_PATTERN)?, byte_level(false)]).into(),
            false,
            false,
        ),
        other => {
            return Err(tok_err(format!(
                "pre-tokenizer '{other}' is not supported (gpt2, smollm, llama-bpe, qwen2, gpt-4o)"
            )))
        }
    })
}

/// Most bytes of input text one token can stand for: the longest token (at least 4, a
/// character an unknown token replaces) times how much the normalizer can shrink text.
/// `None` where one token can stand for unbounded text: an unknown token that fuses runs
/// (BPE without byte fallback, Unigram) or covers a word (WordLevel, WordPiece), a
/// normalizer or pre-tokenizer that deletes text, an added token that strips whitespace.
fn bytes_per_token(inner: &tokenizers::Tokenizer, token_bytes: &[Vec<u8>]) -> Option<usize> {
    use tokenizers::models::ModelWrapper;
    let unk_ok = match inner.get_model() {
        ModelWrapper::BPE(b) => b.unk_token.is_none() || !b.fuse_unk || b.byte_fallback,
        ModelWrapper::Unigram(u) => u.byte_fallback(),
        ModelWrapper::WordLevel(_) | ModelWrapper::WordPiece(_) => false,
    };
    let strips = inner
        .get_added_tokens_decoder()
        .values()
        .any(|t| t.lstrip || t.rstrip);
    if !unk_ok || strips {
        return None;
    }
    let shrink = match inner.get_normalizer() {
        None => 1,
        Some(n) => normalizer_shrink(&serde_json::to_value(n).ok()?)?,
    };
    if let Some(p) = inner.get_pre_tokenizer() {
        if !pre_tokenizer_keeps_text(&serde_json::to_value(p).ok()?) {
            return None;
        }
    }
    let longest = token_bytes.iter().map(Vec::len).max().unwrap_or(0).max(4);
    longest.checked_mul(shrink)
}

/// How many times shorter (at most) a normalizer, as serialized by `tokenizers`, can make
/// text; `None` if unbounded. Unicode normalization and lowercasing map one character to
/// at least one byte (U+1D400 is 4 bytes, NFKC makes it `A`).
fn normalizer_shrink(v: &serde_json::Value) -> Option<usize> {
    match v.get("type")?.as_str()? {
        "NFC" | "NFD" | "NFKC" | "NFKD" | "Lowercase" => Some(4),
        "Prepend" | "ByteLevel" => Some(1),
        "Replace" => {
            let pattern = v.get("pattern")?.get("String")?.as_str()?;
            let content = v.get("content")?.as_str()?;
            (!pattern.is_empty() && content.len() >= pattern.len()).then_some(1)
        }
        "Sequence" => v
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |acc, n| acc.checked_mul(normalizer_shrink(n)?)),
        _ => None,
    }
}

/// Whether a pre-tokenizer, as serialized by `tokenizers`, keeps every byte of its input.
fn pre_tokenizer_keeps_text(v: &serde_json::Value) -> bool {
    let removes = v.get("behavior").and_then(|b| b.as_str()) == Some("Removed");
    match v.get("type").and_then(|t| t.as_str()) {
        Some("ByteLevel" | "Metaspace" | "Digits" | "UnicodeScripts" | "FixedLength") => true,
        Some("Split" | "Punctuation") => !removes,
        Some("Sequence") => v
            .get("pretokenizers")
            .and_then(|p| p.as_array())
            .is_some_and(|ps| ps.iter().all(pre_tokenizer_keeps_text)),
        _ => false,
    }
}

/// Whether `d` is, or holds in a (nested) sequence, a ByteLevel decoder. The nesting is as
/// deep as the JSON it was parsed from, which `serde_json` limits to 128 levels.
fn has_byte_level_decoder(d: &DecoderWrapper) -> bool {
    match d {
        DecoderWrapper::ByteLevel(_) => true,
        DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(has_byte_level_decoder),
        _ => false,
    }
}

/// Raw bytes of every token id.
fn build_token_bytes(
    inner: &tokenizers::Tokenizer,
    n: usize,
    encoding: TokenEncoding,
) -> Vec<Vec<u8>> {
    let char_to_byte = char_to_byte_map();
    let added = inner.get_added_tokens_decoder();
    (0..n as u32)
        .map(|id| {
            if let Some(t) = added.get(&id) {
                return t.content.as_bytes().to_vec();
            }
            let Some(tok) = inner.id_to_token(id) else {
                return Vec::new();
            };
            match encoding {
                TokenEncoding::ByteLevel => tok
                    .chars()
                    .flat_map(|c| match char_to_byte.get(&c) {
                        Some(&b) => vec![b],
                        None => c.to_string().into_bytes(),
                    })
                    .collect(),
                TokenEncoding::Metaspace => metaspace_bytes(&tok),
            }
        })
        .collect()
}

/// Bytes of a SentencePiece-style token: `<0xNN>` is one byte, `▁` a space.
fn metaspace_bytes(tok: &str) -> Vec<u8> {
    if tok.len() == 6 && tok.starts_with("<0x") && tok.ends_with('>') {
        if let Ok(b) = u8::from_str_radix(&tok[3..5], 16) {
            return vec![b];
        }
    }
    tok.replace('\u{2581}', " ").into_bytes()
}

#[cfg(test)]
#[path = "tokenizer_tests.rs"]
mod tests;
