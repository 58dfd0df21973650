//! The body of `POST /v1/embeddings` (OpenAI's embeddings API, with vLLM's extra fields) and its
//! validation, and the response with the two things the HTTP layer does to a vector: it scales
//! it to unit length ([`l2_normalize`]: OpenAI's embeddings are unit vectors and vLLM
//! normalizes by default) and writes it as JSON floats or as base64 of its little-endian `f32`
//! bytes ([`EncodingFormat::Base64`], what the OpenAI Python SDK asks for by default and
//! decodes with numpy).
//!
//! Each input is one engine request; the engine gives the final hidden state at the input's
//! last token, not normalized ([`crate::engine::Delta::embedding`]). Fields follow OpenAI's API
//! reference and vLLM's `EmbeddingCompletionRequest`: `normalize` (default true) and `priority`
//! and `truncate_prompt_tokens` ([`super::truncation`]) are honoured; vLLM's fields this
//! server cannot honour (`add_special_tokens: false`, an `embed_dtype` other than `float32`, a big-endian
//! `endianness`) are refused with a 400 naming them rather than silently ignored. Other unknown
//! fields are accepted and named in a warning, as on the other routes ([`IgnoredFields`]).

use base64::Engine as _;
use serde::{Deserialize, Serialize};

use super::ignored::IgnoredFields;
use super::limits::MAX_EMBEDDING_INPUTS;
use super::request::context_length_exceeded;
use super::response::PromptTokensDetails;
use super::truncation::{keep_last, parse_truncate_prompt_tokens};
use crate::engine::PromptInput;
use crate::error::ApiError;

/// `input`: a string, a list of strings, a list of token ids or a list of token-id lists.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(
    untagged,
    expecting = "`input` must be a string, an array of strings, an array of token ids \
                 (integers from 0) or an array of arrays of token ids"
)]
pub enum EmbeddingInput {
    /// One text.
    Text(String),
    /// One token-id input.
    Tokens(Vec<u32>),
    /// Several texts.
    Texts(Vec<String>),
    /// Several token-id inputs.
    TokenLists(Vec<Vec<u32>>),
}

/// `encoding_format`: how the vectors are written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum EncodingFormat {
    /// A JSON array of numbers (the default).
    #[default]
    Float,
    /// A string: the standard base64 (with padding) of the vector's little-endian `f32` bytes.
    Base64,
}

/// Body of `POST /v1/embeddings`.
#[derive(Debug, Clone, Deserialize)]
pub struct EmbeddingRequest {
    /// Model name; optional (defaults to the served model), 404 if it names another (a LoRA
    /// adapter the server serves is a model too).
    pub model: Option<String>,
    /// The input(s) to embed.
    pub input: EmbeddingInput,
    /// `float` (default) or `base64` ([`EncodingFormat`]).
    pub encoding_format: Option<String>,
    /// The vectors' length: only the model's own is accepted (it is not a Matryoshka model).
    pub dimensions: Option<i64>,
    /// End-user id; accepted and ignored (never a metric label).
    pub user: Option<String>,
    /// Scheduling priority (vLLM: lower first).
    pub priority: Option<i32>,
    /// vLLM's `normalize`: scale each vector to unit length (default true).
    pub normalize: Option<bool>,
    /// vLLM's `truncate_prompt_tokens`: keep only the last this many tokens of each input (-1:
    /// as many as the context takes; see [`super::truncation`]).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's `add_special_tokens` (default true); only `true` is accepted.
    pub add_special_tokens: Option<bool>,
    /// vLLM's element type of base64 vectors; only `float32` is accepted.
    pub embed_dtype: Option<String>,
    /// vLLM's byte order of base64 vectors; only `native` and `little` are accepted (the
    /// server writes little-endian).
    pub endianness: Option<String>,
    /// Fields no endpoint reads (logged, see [`IgnoredFields`]); last of the fields.
    #[serde(flatten)]
    pub ignored: IgnoredFields,
}

/// An embeddings request reduced to what the route needs.
#[derive(Debug, Clone, PartialEq)]
pub struct EmbeddingJob {
    /// One engine input per `input` element, in order.
    pub inputs: Vec<PromptInput>,
    /// How the vectors are written.
    pub encoding: EncodingFormat,
    /// Scale each vector to unit length.
    pub normalize: bool,
    /// Scheduling priority; `None` when the request set none (its tier's applies).
    pub priority: Option<i32>,
    /// Input tokens kept, the last ones (`truncate_prompt_tokens`); `None`: all. Token inputs
    /// are already cut, text ones are cut once tokenized.
    pub truncate_prompt_tokens: Option<usize>,
}

/// Refuses a vLLM field set to what this server cannot do.
fn refuse(param: &str, refused: bool, what: &str) -> Result<(), ApiError> {
    if refused {
        return Err(ApiError::invalid(
            param,
            format!("{param} {what} is not supported on /v1/embeddings"),
        ));
    }
    Ok(())
}

/// The error of an empty input: `index` is its place in a list.
fn empty_input(index: Option<usize>) -> ApiError {
    let message = match index {
        Some(i) => format!("input[{i}] must not be empty"),
        None => "input must not be empty".to_owned(),
    };
    ApiError::invalid("input", message)
}

/// A list of `count` inputs: 1 to [`MAX_EMBEDDING_INPUTS`].
fn check_input_count(count: usize) -> Result<(), ApiError> {
    if count == 0 {
        return Err(empty_input(None));
    }
    if count > MAX_EMBEDDING_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!("a request may have at most {MAX_EMBEDDING_INPUTS} inputs, got {count}"),
        ));
    }
    Ok(())
}

fn text_input(text: String, index: Option<usize>) -> Result<PromptInput, ApiError> {
    if text.is_empty() {
        return Err(empty_input(index));
    }
    Ok(PromptInput::Text(text))
}

/// Token ids as completions' token prompts are bounded: not empty, and leaving room in the
/// context for the one token the engine runs the input as (the engine checks ids against the
/// vocabulary).
fn token_input(
    tokens: Vec<u32>,
    index: Option<usize>,
    max_model_len: usize,
) -> Result<PromptInput, ApiError> {
    if tokens.is_empty() {
        return Err(empty_input(index));
    }
    if tokens.len() >= max_model_len {
        // The engine's words for the same refusal of a text input.
        return Err(context_length_exceeded(
            "input",
            format!(
                "This model's maximum context length is {max_model_len} tokens. However, your \
                 request has an input of {} tokens (an input to embed may have at most {} \
                 tokens). Please reduce the length of the input.",
                tokens.len(),
                max_model_len - 1
            ),
        ));
    }
    Ok(PromptInput::Tokens(tokens))
}

impl EncodingFormat {
    /// The format named `name` on the wire.
    fn parse(name: &str) -> Result<Self, ApiError> {
        match name {
            "float" => Ok(Self::Float),
            "base64" => Ok(Self::Base64),
            other => Err(ApiError::invalid(
                "encoding_format",
                format!(
                    "encoding_format must be \"float\" or \"base64\", got {:?}",
                    other.chars().take(64).collect::<String>()
                ),
            )),
        }
    }
}

impl EmbeddingRequest {
    /// Validates the request for a model of `max_model_len` tokens of context whose vectors
    /// have `embedding_size` values.
    pub fn validate(
        self,
        max_model_len: usize,
        embedding_size: usize,
    ) -> Result<EmbeddingJob, ApiError> {
        if let Some(d) = self
            .dimensions
            .filter(|&d| usize::try_from(d) != Ok(embedding_size))
        {
            return Err(ApiError::invalid(
                "dimensions",
                format!(
                    "This model does not support Matryoshka representation: its embeddings \
                     have {embedding_size} dimensions and cannot be shortened, so dimensions \
                     must be {embedding_size} or left out, got {d}."
                ),
            ));
        }
        let truncate = parse_truncate_prompt_tokens(self.truncate_prompt_tokens, max_model_len)?;
        // Token inputs are cut before their length is checked; text ones once tokenized.
        let cut = |tokens: Vec<u32>| match truncate {
            Some(keep) => keep_last(tokens, keep),
            None => tokens,
        };
        refuse(
            "add_special_tokens",
            self.add_special_tokens == Some(false),
            "= false",
        )?;
        refuse(
            "embed_dtype",
            self.embed_dtype.as_deref().is_some_and(|t| t != "float32"),
            "other than \"float32\"",
        )?;
        refuse(
            "endianness",
            self.endianness
                .as_deref()
                .is_some_and(|e| e != "native" && e != "little"),
            "other than \"native\" or \"little\"",
        )?;
        let inputs = match self.input {
            EmbeddingInput::Text(text) => vec![text_input(text, None)?],
            EmbeddingInput::Tokens(tokens) => vec![token_input(cut(tokens), None, max_model_len)?],
            EmbeddingInput::Texts(texts) => {
                check_input_count(texts.len())?;
                texts
                    .into_iter()
                    .enumerate()
                    .map(|(i, text)| text_input(text, Some(i)))
                    .collect::<Result<_, _>>()?
            }
            EmbeddingInput::TokenLists(lists) => {
                check_input_count(lists.len())?;
                lists
                    .into_iter()
                    .enumerate()
                    .map(|(i, tokens)| token_input(cut(tokens), Some(i), max_model_len))
                    .collect::<Result<_, _>>()?
            }
        };
        let encoding = match self.encoding_format.as_deref() {
            Some(name) => EncodingFormat::parse(name)?,
            None => EncodingFormat::default(),
        };
        Ok(EmbeddingJob {
            inputs,
            encoding,
            normalize: self.normalize.unwrap_or(true),
            priority: self.priority,
            truncate_prompt_tokens: truncate,
        })
    }
}

/// Scales `v` to unit L2 length, the norm summed in `f64`; a zero vector stays zero (no NaN).
/// The values must be finite.
pub fn l2_normalize(v: &mut [f32]) {
    let norm = v
        .iter()
        .map(|&x| f64::from(x) * f64::from(x))
        .sum::<f64>()
        .sqrt();
    if norm > 0.0 && norm.is_finite() {
        for x in v.iter_mut() {
            *x = (f64::from(*x) / norm) as f32;
        }
    }
}

/// The standard base64 (with padding) of `v`'s little-endian `f32` bytes: what OpenAI's
/// `encoding_format: base64` carries (its Python SDK decodes it with
/// `numpy.frombuffer(base64.b64decode(s), dtype="float32")`).
pub fn base64_f32_le(v: &[f32]) -> String {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

/// A `/v1/embeddings` response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmbeddingResponse {
    /// Request id (`embd-…`, as vLLM's).
    pub id: String,
    /// Always `list`.
    pub object: &'static str,
    /// Unix time of the request, in seconds.
    pub created: u64,
    /// The model (or LoRA adapter) the request named, else the served model.
    pub model: String,
    /// One vector per input, in input order.
    pub data: Vec<EmbeddingData>,
    /// Token counts.
    pub usage: EmbeddingUsage,
}

/// One input's vector.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EmbeddingData {
    /// Always `embedding`.
    pub object: &'static str,
    /// The input's place in the request's `input`.
    pub index: u32,
    /// The vector.
    pub embedding: EmbeddingVector,
}

/// A vector as `encoding_format` asked.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum EmbeddingVector {
    /// JSON numbers: serde_json writes each `f32` as the shortest decimal that reads back as
    /// the same `f32`.
    Float(Vec<f32>),
    /// [`base64_f32_le`] of the vector.
    Base64(String),
}

impl EmbeddingVector {
    /// `v` written as `format` asks.
    pub fn encode(v: Vec<f32>, format: EncodingFormat) -> Self {
        match format {
            EncodingFormat::Float => Self::Float(v),
            EncodingFormat::Base64 => Self::Base64(base64_f32_le(&v)),
        }
    }
}

/// `usage` of an embeddings response: no completion tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct EmbeddingUsage {
    /// The inputs' tokens, summed.
    pub prompt_tokens: u32,
    /// The same.
    pub total_tokens: u32,
    /// What of the inputs' tokens the prefix cache served (an embedding request runs its
    /// input's prefill as a generation's, so it reuses cached blocks), summed over the inputs,
    /// as completions' `usage` has it.
    pub prompt_tokens_details: PromptTokensDetails,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const CONTEXT: usize = 16;
    const SIZE: usize = 8;

    fn validate(body: serde_json::Value) -> Result<EmbeddingJob, ApiError> {
        crate::body::parse_json::<EmbeddingRequest>(body.to_string().as_bytes())?
            .validate(CONTEXT, SIZE)
    }

    /// The 400 a body gets: its `param` and message.
    fn refused(body: serde_json::Value) -> (String, String) {
        match validate(body.clone()) {
            Err(ApiError::InvalidRequest { message, param }) => {
                (param.unwrap_or_default(), message)
            }
            Err(ApiError::Engine(e)) => (e.param.unwrap_or_default(), e.message),
            Ok(job) => panic!("{body} was accepted: {job:?}"),
            Err(e) => panic!("{body}: {e:?}"),
        }
    }

    #[test]
    fn every_input_shape_becomes_engine_inputs_in_order() {
        let text = |s: &str| PromptInput::Text(s.to_owned());
        let cases = [
            (json!("hello"), vec![text("hello")]),
            (
                json!(["a", "b", "c"]),
                vec![text("a"), text("b"), text("c")],
            ),
            (json!([1, 2, 3]), vec![PromptInput::Tokens(vec![1, 2, 3])]),
            (
                json!([[5], [6, 7]]),
                vec![
                    PromptInput::Tokens(vec![5]),
                    PromptInput::Tokens(vec![6, 7]),
                ],
            ),
        ];
        for (input, expected) in cases {
            let job = validate(json!({"input": input})).unwrap();
            assert_eq!(job.inputs, expected, "{input}");
        }
    }

    #[test]
    fn defaults_are_float_normalized_and_no_priority() {
        let job = validate(json!({"input": "x", "model": "m", "user": "u-1"})).unwrap();
        assert_eq!(job.encoding, EncodingFormat::Float);
        assert!(job.normalize);
        assert_eq!(job.priority, None);
        let job = validate(
            json!({"input": "x", "encoding_format": "base64", "normalize": false,
            "priority": -3, "dimensions": SIZE, "embed_dtype": "float32",
            "endianness": "little", "add_special_tokens": true,
            "truncate_prompt_tokens": null}),
        )
        .unwrap();
        assert_eq!(job.encoding, EncodingFormat::Base64);
        assert!(!job.normalize);
        assert_eq!(job.priority, Some(-3));
        // Nulls are fields not set, as OpenAI's SDKs send them.
        let job = validate(json!({"input": "x", "encoding_format": null, "dimensions": null}));
        assert_eq!(job.unwrap().encoding, EncodingFormat::Float);
    }

    #[test]
    fn bad_inputs_name_input() {
        let list = |n: usize| vec!["x"; n];
        let cases = [
            (json!(""), "input must not be empty"),
            (json!([]), "input must not be empty"),
            (json!(["a", ""]), "input[1] must not be empty"),
            (json!([[1], []]), "input[1] must not be empty"),
            (
                json!(list(MAX_EMBEDDING_INPUTS + 1)),
                "a request may have at most 2048 inputs, got 2049",
            ),
            (
                json!(vec![vec![1u32]; MAX_EMBEDDING_INPUTS + 1]),
                "a request may have at most 2048 inputs, got 2049",
            ),
            // A token input must leave room in the context, as completions' token prompts.
            (
                json!(vec![1u32; CONTEXT]),
                "maximum context length is 16 tokens",
            ),
            (
                json!([[1], vec![1u32; CONTEXT]]),
                "However, your request has an input of 16 tokens (an input to embed may have at \
                 most 15 tokens)",
            ),
            // Shapes that are none of the four.
            (json!(5), "`input` must be a string, an array of strings"),
            (
                json!([1, "a"]),
                "`input` must be a string, an array of strings",
            ),
            (json!([-1]), "`input` must be a string, an array of strings"),
            (
                json!([["a"]]),
                "`input` must be a string, an array of strings",
            ),
        ];
        for (input, expected) in cases {
            let (param, message) = refused(json!({"input": input}));
            assert_eq!(param, "input", "{input}: {message}");
            assert!(message.contains(expected), "{input}: {message}");
        }
        assert!(validate(json!({"input": list(MAX_EMBEDDING_INPUTS)})).is_ok());
        assert!(validate(json!({"input": vec![1u32; CONTEXT - 1]})).is_ok());
        let (param, _) = refused(json!({"model": "m"}));
        assert_eq!(param, "input");
    }

    #[test]
    fn a_too_long_token_input_is_a_context_length_error() {
        match validate(json!({"input": [vec![1u32; CONTEXT]]})) {
            Err(ApiError::Engine(e)) => {
                assert_eq!(
                    e.kind,
                    crate::engine::EngineErrorKind::ContextLengthExceeded
                );
                assert_eq!(e.param.as_deref(), Some("input"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn other_fields_name_themselves() {
        let cases = [
            (
                json!({"encoding_format": "int8"}),
                "encoding_format",
                "must be \"float\" or \"base64\", got \"int8\"",
            ),
            (json!({"encoding_format": 1}), "encoding_format", ""),
            (
                json!({"dimensions": SIZE - 1}),
                "dimensions",
                "does not support Matryoshka",
            ),
            (
                json!({"dimensions": 0}),
                "dimensions",
                "must be 8 or left out, got 0",
            ),
            (json!({"dimensions": -8}), "dimensions", "got -8"),
            (json!({"dimensions": "8"}), "dimensions", ""),
            (
                json!({"truncate_prompt_tokens": 0}),
                "truncate_prompt_tokens",
                "must be -1",
            ),
            (
                json!({"add_special_tokens": false}),
                "add_special_tokens",
                "not supported",
            ),
            (
                json!({"embed_dtype": "float16"}),
                "embed_dtype",
                "not supported",
            ),
            (json!({"endianness": "big"}), "endianness", "not supported"),
            (json!({"normalize": "yes"}), "normalize", ""),
            (json!({"user": 5}), "user", ""),
        ];
        for (extra, field, expected) in cases {
            let mut body = json!({"input": "x"});
            body.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            let (param, message) = refused(body);
            assert_eq!(param, field, "{extra}: {message}");
            assert!(message.contains(expected), "{extra}: {message}");
        }
    }

    /// A token input past the context (16 tokens) is refused, unless `truncate_prompt_tokens`
    /// keeps its end: the last k, or with -1 the 15 the context takes.
    #[test]
    fn truncate_prompt_tokens_keeps_the_end_of_a_token_input() {
        let long: Vec<u32> = (0..20).collect();
        assert_eq!(refused(json!({"input": long})).0, "input");
        let job = validate(json!({"input": long, "truncate_prompt_tokens": 3})).unwrap();
        assert_eq!(job.inputs, vec![PromptInput::Tokens(vec![17, 18, 19])]);
        let job = validate(json!({"input": [long, [4]], "truncate_prompt_tokens": -1})).unwrap();
        assert_eq!(
            job.inputs,
            vec![
                PromptInput::Tokens((5..20).collect()),
                PromptInput::Tokens(vec![4])
            ]
        );
        let job = validate(json!({"input": "text", "truncate_prompt_tokens": 2})).unwrap();
        assert_eq!(job.truncate_prompt_tokens, Some(2));
        assert_eq!(
            refused(json!({"input": "x", "truncate_prompt_tokens": 17})).0,
            "truncate_prompt_tokens"
        );
    }

    #[test]
    fn unknown_fields_are_accepted_and_named() {
        let request: EmbeddingRequest =
            serde_json::from_value(json!({"input": "x", "inputs": "y", "store": null})).unwrap();
        assert_eq!(request.ignored.names(), ["inputs"]);
    }

    #[test]
    fn normalized_vectors_have_unit_length_and_zero_stays_zero() {
        let mut v = vec![3.0f32, -4.0];
        l2_normalize(&mut v);
        assert_eq!(v, [0.6, -0.8]);
        let mut v: Vec<f32> = (1..=576).map(|i| (i as f32).sin() * 40.0).collect();
        let direction = v[7] / v[3];
        l2_normalize(&mut v);
        let norm: f64 = v.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
        assert!((norm - 1.0).abs() < 1e-6, "{norm}");
        assert!((v[7] / v[3] - direction).abs() < 1e-5);
        let mut zero = vec![0.0f32; 4];
        l2_normalize(&mut zero);
        assert_eq!(zero, [0.0; 4]);
        // Tiny values do not underflow: the norm is summed in f64.
        let mut tiny = vec![1e-30f32, 0.0];
        l2_normalize(&mut tiny);
        assert_eq!(tiny, [1.0, 0.0]);
    }

    /// Against Python's encoder: the literals are what
    /// `python3 -c "import base64, struct; print(base64.b64encode(struct.pack('<2f', 1.0, -2.5)).decode())"`
    /// prints, and likewise for `'<3f', 0.1, -0.0, 3.4028234663852886e38` (f32::MAX) and
    /// `'<1f', 1.5` (every padding length).
    #[test]
    fn base64_is_the_little_endian_f32_bytes() {
        assert_eq!(base64_f32_le(&[1.0, -2.5]), "AACAPwAAIMA=");
        assert_eq!(base64_f32_le(&[0.1, -0.0, f32::MAX]), "zczMPQAAAID//39/");
        assert_eq!(base64_f32_le(&[1.5]), "AADAPw==");
        assert_eq!(base64_f32_le(&[]), "");
    }

    /// Floats are written so that they read back as the same `f32`, bit for bit.
    #[test]
    fn float_vectors_round_trip_f32() {
        let v: Vec<f32> = (0..2000u32)
            .map(|i| f32::from_bits(0x3000_0000 + i.wrapping_mul(2_654_435_761) % 0x1800_0000))
            .chain([f32::MIN_POSITIVE, -f32::MAX, 1.0 / 3.0, -0.0])
            .collect();
        let json =
            serde_json::to_string(&EmbeddingVector::encode(v.clone(), EncodingFormat::Float))
                .unwrap();
        let back: Vec<f32> = serde_json::from_str(&json).unwrap();
        assert_eq!(
            back.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let json = serde_json::to_value(EmbeddingVector::encode(
            vec![1.0, -2.5],
            EncodingFormat::Base64,
        ))
        .unwrap();
        assert_eq!(json, json!("AACAPwAAIMA="));
    }
}
