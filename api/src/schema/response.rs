//! OpenAI response bodies and SSE stream chunks for completions and chat completions, and the
//! conversions of the engine's logprobs into OpenAI's two (different) logprob shapes.

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

use crate::engine::{TokenLogprob, TopLogprob};

/// Token counts of a request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens (counted once per prompt, whatever `n`).
    pub prompt_tokens: u32,
    /// Generated tokens over all choices.
    pub completion_tokens: u32,
    /// Their sum.
    pub total_tokens: u32,
    /// What of the prompt tokens the prefix cache served; always sent, as OpenAI does.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details` (chat, completions) and the Responses API's
/// `usage.input_tokens_details`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV the prefix cache served at the request's first admission (whole
    /// blocks, never a prompt's last token), counted once per prompt as `prompt_tokens` is.
    pub cached_tokens: u32,
}

impl Usage {
    /// Usage of `prompt_tokens` prompt tokens, `cached_tokens` of them served by the prefix
    /// cache, and `completion_tokens` generated ones.
    pub fn new(prompt_tokens: u32, cached_tokens: u32, completion_tokens: u32) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails { cached_tokens },
        }
    }
}

/// A `/v1/completions` response, or one stream chunk of it (same shape, as in OpenAI's API).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionResponse {
    /// Request id (`cmpl-…`).
    pub id: String,
    /// Always `text_completion`.
    pub object: &'static str,
    /// Unix time of the request, in seconds.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// Choices (all of them, or those with news in a chunk).
    pub choices: Vec<CompletionChoice>,
    /// Absent, null (stream chunks with `include_usage`) or the usage.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One completion choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CompletionChoice {
    /// Choice index: prompt index × n + choice within the prompt.
    pub index: u32,
    /// Generated text (with the prompt in front when `echo`).
    pub text: String,
    /// Logprobs when asked, else null.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop` or `length` once finished, else null.
    pub finish_reason: Option<&'static str>,
    /// vLLM's prompt logprobs of the choice's prompt, when asked (absent otherwise, and in
    /// stream chunks).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// vLLM's `prompt_logprobs`: per prompt token, `null` for the first (it has no context), else
/// an object keyed by token id (a JSON key, so a string) whose entries hold `logprob`, `rank`
/// (1 = the most likely) and `decoded_token`: the prompt's own token first, then the most
/// likely tokens best first, the prompt's token among them only once (so `k` or `k + 1`
/// entries), as vLLM's dictionary of them is built. A logprob of minus infinity reads -9999.0,
/// as vLLM writes it.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(transparent)]
pub struct PromptLogprobs(pub Vec<Option<PromptLogprobPosition>>);

/// One prompt position of [`PromptLogprobs`]: (token id, entry) in vLLM's order.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptLogprobPosition(pub Vec<(u32, PromptLogprobEntry)>);

/// One token of a [`PromptLogprobPosition`] (vLLM's `Logprob`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PromptLogprobEntry {
    /// Its log probability (at least -9999.0).
    pub logprob: f32,
    /// Its rank at the position, 1 = the most likely.
    pub rank: u32,
    /// Its text.
    pub decoded_token: String,
}

impl Serialize for PromptLogprobPosition {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (id, entry) in &self.0 {
            map.serialize_entry(&id.to_string(), entry)?;
        }
        map.end()
    }
}

/// vLLM's floor for a logprob of minus infinity, which JSON cannot hold.
const LOGPROB_FLOOR: f32 = -9999.0;

impl PromptLogprobs {
    /// The engine's prompt logprobs (one per prompt token, the first without a logprob) with
    /// at most `k` alternatives per position.
    pub fn from_engine(list: &[TokenLogprob], k: u32) -> Self {
        let k = usize::try_from(k).unwrap_or(usize::MAX);
        Self(
            list.iter()
                .map(|lp| {
                    let logprob = lp.logprob?;
                    let top = &lp.top[..k.min(lp.top.len())];
                    // vLLM inserts the prompt's token, then the top k: a token among them keeps
                    // its first place and takes the later entry (its rank in the top k).
                    let rank = top
                        .iter()
                        .position(|t| t.token_id == lp.token_id)
                        .map_or_else(
                            || {
                                lp.rank.unwrap_or_else(|| {
                                    let better = top.iter().filter(|t| t.logprob > logprob).count();
                                    u32::try_from(better).map_or(u32::MAX, |b| b.saturating_add(1))
                                })
                            },
                            |i| u32::try_from(i).map_or(u32::MAX, |i| i.saturating_add(1)),
                        );
                    let mut entries = Vec::with_capacity(top.len() + 1);
                    entries.push((
                        lp.token_id,
                        PromptLogprobEntry {
                            logprob: logprob.max(LOGPROB_FLOOR),
                            rank,
                            decoded_token: lp.token.clone(),
                        },
                    ));
                    for (i, t) in top.iter().enumerate() {
                        if t.token_id != lp.token_id {
                            entries.push((
                                t.token_id,
                                PromptLogprobEntry {
                                    logprob: t.logprob.max(LOGPROB_FLOOR),
                                    rank: u32::try_from(i)
                                        .map_or(u32::MAX, |i| i.saturating_add(1)),
                                    decoded_token: t.token.clone(),
                                },
                            ));
                        }
                    }
                    Some(PromptLogprobPosition(entries))
                })
                .collect(),
        )
    }
}

/// vLLM's `return_tokens_as_token_ids`: each token string of `logprobs`, the token's and its
/// alternatives', becomes `token_id:{id}`, as vLLM renders them (completions' `tokens` and
/// `top_logprobs` keys, whose `text_offset`s then count these strings, as vLLM's do; chat's
/// `token`s). On chat an alternative's `bytes` become those of its string too, but the
/// sampled token's stay its own: vLLM's `_create_chat_logprobs` encodes the token's decoded
/// text there, and only its `_get_top_logprobs` the rendered string.
pub fn render_token_ids(logprobs: &mut [TokenLogprob]) {
    for lp in logprobs {
        lp.token = format!("token_id:{}", lp.token_id);
        for top in &mut lp.top {
            top.token = format!("token_id:{}", top.token_id);
            top.bytes = top.token.as_bytes().to_vec();
        }
    }
}

/// The legacy completions logprobs object.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    /// Token texts.
    pub tokens: Vec<String>,
    /// Their logprobs (null for the first prompt token).
    pub token_logprobs: Vec<Option<f32>>,
    /// Per position, a map of token text to logprob: the alternatives and the token itself, as
    /// OpenAI's legacy API has it (null for the first prompt token).
    pub top_logprobs: Vec<Option<TopLogprobMap>>,
    /// Per token, its character offset in the choice's text.
    pub text_offset: Vec<u32>,
}

/// Alternatives at one position, serialized as a JSON object in likelihood order.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprobMap(pub Vec<TopLogprob>);

impl Serialize for TopLogprobMap {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for top in &self.0 {
            map.serialize_entry(&top.token, &top.logprob)?;
        }
        map.end()
    }
}

impl CompletionLogprobs {
    /// Appends tokens whose text starts at character `offset` of the choice text; returns the
    /// offset after them (each token's text counted whole, as vLLM counts it).
    pub fn extend(&mut self, logprobs: &[TokenLogprob], mut offset: u32) -> u32 {
        for lp in logprobs {
            self.tokens.push(lp.token.clone());
            self.token_logprobs.push(lp.logprob);
            self.top_logprobs
                .push(lp.logprob.map(|logprob| top_map(lp, logprob)));
            self.text_offset.push(offset);
            let chars = u32::try_from(lp.token.chars().count()).unwrap_or(u32::MAX);
            offset = offset.saturating_add(chars);
        }
        offset
    }
}

/// The alternatives at a position as a JSON object's entries: each text once (byte tokens
/// that are parts of characters all read U+FFFD; the likeliest keeps the key) and the chosen
/// token among them, best first.
fn top_map(lp: &TokenLogprob, logprob: f32) -> TopLogprobMap {
    let mut top: Vec<TopLogprob> = Vec::with_capacity(lp.top.len() + 1);
    let chosen = TopLogprob {
        token_id: lp.token_id,
        token: lp.token.clone(),
        bytes: lp.bytes.clone(),
        logprob,
    };
    for t in lp.top.iter().chain([&chosen]) {
        if !top.iter().any(|kept| kept.token == t.token) {
            top.push(t.clone());
        }
    }
    top.sort_by(|a, b| b.logprob.total_cmp(&a.logprob));
    TopLogprobMap(top)
}

/// A `/v1/chat/completions` response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatResponse {
    /// Request id (`chatcmpl-…`).
    pub id: String,
    /// Always `chat.completion`.
    pub object: &'static str,
    /// Unix time of the request, in seconds.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// The choices.
    pub choices: Vec<ChatChoice>,
    /// Token usage.
    pub usage: Usage,
    /// vLLM's prompt logprobs, when asked: the prompt's, once for all choices, at the top
    /// level as vLLM places them (absent otherwise).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// One chat choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChoice {
    /// Choice index.
    pub index: u32,
    /// The assistant's message.
    pub message: ChatResponseMessage,
    /// Logprobs when asked, else null.
    pub logprobs: Option<ChatLogprobs>,
    /// `stop` or `length`.
    pub finish_reason: Option<&'static str>,
}

/// The assistant's message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatResponseMessage {
    /// Always `assistant`.
    pub role: &'static str,
    /// The generated text; null when the answer is only tool calls.
    pub content: Option<String>,
    /// The model's reasoning (`<think>...</think>`), when it reasoned (vLLM's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The tools the model called (absent when none).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// A call of a tool, in a response.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCall {
    /// The call's id (`call_…`), for the `tool` message that answers it.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The function called.
    pub function: FunctionCall,
}

/// The function of a [`ToolCall`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCall {
    /// Its name.
    pub name: String,
    /// Its arguments, as JSON text.
    pub arguments: String,
}

/// A call of a tool in a stream chunk: the chunk that opens a call has its id, type and
/// name; the arguments' text follows in pieces, to be joined in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ToolCallDelta {
    /// The call's position among the choice's calls.
    pub index: u32,
    /// The call's id, in the chunk that opens it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// `function`, in the chunk that opens the call.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    /// The function's name (in the opening chunk) and the next part of its arguments.
    pub function: FunctionCallDelta,
}

/// The function of a [`ToolCallDelta`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FunctionCallDelta {
    /// The function's name, in the chunk that opens the call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The next part of the arguments' JSON text.
    pub arguments: String,
}

/// Chat logprobs.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    /// One entry per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// One generated token's logprob in the chat shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    /// Token text.
    pub token: String,
    /// Its logprob.
    pub logprob: f32,
    /// UTF-8 bytes of the token text.
    pub bytes: Vec<u8>,
    /// Alternatives, best first.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// One alternative in the chat shape.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    /// Token text.
    pub token: String,
    /// Its logprob.
    pub logprob: f32,
    /// UTF-8 bytes of the token text.
    pub bytes: Vec<u8>,
}

/// OpenAI's stand-in logprob for a token outside the reported alternatives.
const VERY_UNLIKELY: f32 = -9999.0;

impl ChatLogprobs {
    /// Converts engine logprobs of generated tokens.
    pub fn from_engine(logprobs: &[TokenLogprob]) -> Self {
        Self {
            content: logprobs
                .iter()
                .map(|lp| ChatTokenLogprob {
                    token: lp.token.clone(),
                    logprob: lp.logprob.unwrap_or(VERY_UNLIKELY),
                    bytes: lp.bytes.clone(),
                    top_logprobs: lp
                        .top
                        .iter()
                        .map(|t| ChatTopLogprob {
                            token: t.token.clone(),
                            logprob: t.logprob,
                            bytes: t.bytes.clone(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// One chat stream chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunk {
    /// Request id, the same in every chunk.
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix time of the request, the same in every chunk.
    pub created: u64,
    /// The served model.
    pub model: String,
    /// Choices with news (empty in the usage chunk).
    pub choices: Vec<ChatChunkChoice>,
    /// Absent, null (with `include_usage`) or the usage (last chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

/// One choice in a chat stream chunk.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatChunkChoice {
    /// Choice index.
    pub index: u32,
    /// What is new.
    pub delta: ChatDelta,
    /// Logprobs of the new tokens when asked, else null.
    pub logprobs: Option<ChatLogprobs>,
    /// Set on the choice's last chunk.
    pub finish_reason: Option<&'static str>,
}

/// The new part of the assistant's message.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatDelta {
    /// `assistant` in each choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// New reasoning text (vLLM's field).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// Tool calls opened, and more of their arguments.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelList {
    /// Always `list`.
    pub object: &'static str,
    /// The served models.
    pub data: Vec<ModelCard>,
}

/// One served model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelCard {
    /// Model name.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// Unix time the server started.
    pub created: u64,
    /// Always `switchyard`.
    pub owned_by: &'static str,
    /// Context window (vLLM's extension).
    pub max_model_len: usize,
    /// For a LoRA adapter, the base model it runs on (vLLM's extension); absent for the base.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lp(token: &str, logprob: Option<f32>, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            token_id: 0,
            token: token.to_owned(),
            bytes: token.as_bytes().to_vec(),
            logprob,
            rank: None,
            top: top
                .iter()
                .map(|&(t, l)| TopLogprob {
                    token_id: 0,
                    token: t.to_owned(),
                    bytes: t.as_bytes().to_vec(),
                    logprob: l,
                })
                .collect(),
        }
    }

    /// A prompt token with its id, rank and alternatives (id, text, logprob), best first.
    fn prompt_lp(
        (id, token, logprob, rank): (u32, &str, Option<f32>, Option<u32>),
        top: &[(u32, &str, f32)],
    ) -> TokenLogprob {
        TokenLogprob {
            token_id: id,
            token: token.to_owned(),
            bytes: token.as_bytes().to_vec(),
            logprob,
            rank,
            top: top
                .iter()
                .map(|&(id, t, l)| TopLogprob {
                    token_id: id,
                    token: t.to_owned(),
                    bytes: t.as_bytes().to_vec(),
                    logprob: l,
                })
                .collect(),
        }
    }

    /// vLLM's shape: null first, then objects keyed by token id, the prompt's token first and
    /// once, the top `k` after it with ranks 1..=k, minus infinity as -9999.0.
    #[test]
    fn prompt_logprobs_are_written_as_vllm_writes_them() {
        let top = [(5, "a", -0.5), (7, "b", -1.5), (9, "c", -2.0)];
        let list = [
            prompt_lp((1, "<s>", None, None), &[]),
            // Among the top 2: one entry, in the prompt token's place, ranked as in the top.
            prompt_lp((7, "b", Some(-1.5), Some(2)), &top),
            // Outside the top 2: its own rank, then the top 2 (k + 1 entries).
            prompt_lp((9, "c", Some(-2.0), Some(3)), &top),
            prompt_lp((11, "d", Some(f32::NEG_INFINITY), Some(40)), &top),
        ];
        let json = serde_json::to_string(&PromptLogprobs::from_engine(&list, 2)).unwrap();
        let lp = |logprob: f32, rank: u32, token: &str| {
            format!(r#"{{"logprob":{logprob:?},"rank":{rank},"decoded_token":"{token}"}}"#)
        };
        let (a, b) = (lp(-0.5, 1, "a"), lp(-1.5, 2, "b"));
        let want = format!(
            r#"[null,{{"7":{b},"5":{a}}},{{"9":{},"5":{a},"7":{b}}},{{"11":{},"5":{a},"7":{b}}}]"#,
            lp(-2.0, 3, "c"),
            lp(-9999.0, 40, "d"),
        );
        assert_eq!(json, want, "key order is vLLM's dictionary's");
        // k = 0: the prompt's token alone.
        let json = serde_json::to_value(PromptLogprobs::from_engine(&list[..2], 0)).unwrap();
        assert_eq!(
            json,
            serde_json::json!([null, {"7": {"logprob": -1.5, "rank": 2, "decoded_token": "b"}}])
        );
    }

    #[test]
    fn completion_logprobs_track_character_offsets() {
        let mut out = CompletionLogprobs::default();
        let end = out.extend(
            &[
                lp("hé", None, &[]),
                lp(" llo", Some(-0.5), &[(" llo", -0.5)]),
            ],
            3,
        );
        assert_eq!(end, 9);
        let json = serde_json::to_value(&out).unwrap();
        assert_eq!(
            json,
            serde_json::json!({"tokens": ["hé", " llo"], "token_logprobs": [null, -0.5],
                "top_logprobs": [null, {" llo": -0.5}], "text_offset": [3, 5]})
        );
    }

    #[test]
    fn completion_top_logprobs_hold_the_chosen_token_and_each_text_once() {
        let mut out = CompletionLogprobs::default();
        let replacement = "\u{FFFD}";
        out.extend(
            &[
                // Sampled outside the top 1: it joins the map, in likelihood order.
                lp("Max", Some(-14.8), &[(" \"", -2.0)]),
                // logprobs: 0 still names the chosen token.
                lp("a", Some(-0.1), &[]),
                // Two byte tokens that both read U+FFFD: the likelier keeps the key.
                lp(
                    replacement,
                    Some(-3.0),
                    &[(replacement, -0.2), (replacement, -3.0)],
                ),
            ],
            0,
        );
        assert_eq!(
            serde_json::to_string(&out.top_logprobs).unwrap(),
            format!(r#"[{{" \"":-2.0,"Max":-14.8}},{{"a":-0.1}},{{"{replacement}":-0.2}}]"#)
        );
    }

    /// vLLM's `return_tokens_as_token_ids`: every string is `token_id:{id}`, so two byte
    /// tokens that read alike keep a key each, offsets count the rendered strings, and chat's
    /// alternatives' bytes are those of the string while the sampled token's stay its own.
    #[test]
    fn token_ids_replace_every_token_string() {
        let r = "\u{FFFD}";
        let mut first = lp(r, Some(-3.0), &[(r, -0.25), (r, -3.0)]);
        first.token_id = 7;
        first.top[0].token_id = 12;
        first.top[1].token_id = 7;
        let mut second = lp("ab", Some(-0.5), &[]);
        second.token_id = 1234;
        let mut list = vec![first, second];
        render_token_ids(&mut list);
        let mut out = CompletionLogprobs::default();
        assert_eq!(out.extend(&list, 2), 2 + 10 + 13);
        assert_eq!(
            serde_json::to_value(&out).unwrap(),
            serde_json::json!({"tokens": ["token_id:7", "token_id:1234"],
                "token_logprobs": [-3.0, -0.5],
                "top_logprobs": [{"token_id:12": -0.25, "token_id:7": -3.0},
                                 {"token_id:1234": -0.5}],
                "text_offset": [2, 12]})
        );
        let chat = ChatLogprobs::from_engine(&list);
        assert_eq!(chat.content[0].token, "token_id:7");
        assert_eq!(chat.content[0].bytes, r.as_bytes());
        assert_eq!(chat.content[1].bytes, b"ab");
        assert_eq!(chat.content[0].top_logprobs[0].token, "token_id:12");
        assert_eq!(chat.content[0].top_logprobs[0].bytes, b"token_id:12");
    }

    #[test]
    fn chat_logprobs_carry_the_tokens_own_bytes() {
        let mut half = lp("\u{FFFD}", Some(-1.0), &[]);
        half.bytes = vec![0xf0, 0x9f];
        let chat = ChatLogprobs::from_engine(&[half]);
        assert_eq!(chat.content[0].bytes, vec![0xf0, 0x9f]);
        assert_eq!(chat.content[0].token, "\u{FFFD}");
    }

    #[test]
    fn top_logprob_map_keeps_likelihood_order() {
        let map = TopLogprobMap(lp("x", Some(-0.1), &[("b", -0.1), ("a", -2.0)]).top);
        assert_eq!(
            serde_json::to_string(&map).unwrap(),
            r#"{"b":-0.1,"a":-2.0}"#
        );
    }

    #[test]
    fn usage_chunk_field_is_absent_null_or_set() {
        let mut chunk = ChatChunk {
            id: "c".into(),
            object: "chat.completion.chunk",
            created: 1,
            model: "m".into(),
            choices: vec![],
            usage: None,
        };
        assert!(serde_json::to_value(&chunk).unwrap().get("usage").is_none());
        chunk.usage = Some(None);
        assert!(serde_json::to_value(&chunk).unwrap()["usage"].is_null());
        chunk.usage = Some(Some(Usage::new(2, 0, 3)));
        assert_eq!(
            serde_json::to_value(&chunk).unwrap()["usage"]["total_tokens"],
            5
        );
    }

    /// OpenAI's shape: `prompt_tokens_details.cached_tokens` beside the counts, always there
    /// (0 when nothing was cached); cached tokens are part of `prompt_tokens`, not added.
    #[test]
    fn usage_always_carries_the_cached_prompt_tokens() {
        assert_eq!(
            serde_json::to_value(Usage::new(40, 32, 5)).unwrap(),
            serde_json::json!({
                "prompt_tokens": 40,
                "completion_tokens": 5,
                "total_tokens": 45,
                "prompt_tokens_details": {"cached_tokens": 32}
            })
        );
        assert_eq!(
            serde_json::to_value(Usage::new(7, 0, 1)).unwrap()["prompt_tokens_details"],
            serde_json::json!({"cached_tokens": 0})
        );
    }
}
