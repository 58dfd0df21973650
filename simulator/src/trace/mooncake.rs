//! Mooncake trace JSONL (Qin et al., "Mooncake: A KVCache-centric
//! Architecture for Serving LLM Chatbot", FAST'25): one object per line with
//! `timestamp` (ms from trace start), `input_length`, `output_length` and
//! `hash_ids`, one id per 512-token prompt block; equal ids mean equal blocks.
//!
//! Block `k` of a prompt holds tokens derived from `(hash_ids[k], position)`,
//! so equal ids give equal token blocks and the prefix cache sees the trace's
//! real reuse (512 is a multiple of every usual KV block size). The last block
//! may be partial. A line with `hash_ids` must carry exactly one per block,
//! `ceil(input_length / 512)`, as the format defines them and the published
//! traces have them: with fewer, the prompt's tail would have no identity, so
//! such a line is refused rather than guessed at. A line without `hash_ids`
//! (absent or null) declares no reuse: its prompt is unique to the request.

use super::{
    add_total, check_output_len, check_prompt_len, for_each_line, json_object_line, mix64,
    LoadOptions, Row, TraceRequest,
};
use crate::error::SimError;
use serde_json::Value;
use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

/// Tokens covered by one Mooncake hash id.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;
/// Largest hash id accepted (ids are shifted left by 9 bits when deriving tokens).
const MAX_HASH_ID: u64 = 1 << 54;
const BLOCK_DOMAIN: u64 = 0x6d6f_6f6e_6361_6b65;
const UNIQUE_DOMAIN: u64 = 0x756e_6971_7565_0000;

/// Loads a Mooncake JSONL trace. Rows must be sorted by timestamp.
pub fn load_mooncake(
    reader: impl BufRead,
    path: &Path,
    options: &LoadOptions,
) -> Result<Vec<TraceRequest>, SimError> {
    let mut out = Vec::new();
    let mut prev = f64::NEG_INFINITY;
    let mut total = 0usize;
    for_each_line(reader, path, |line, text| {
        let obj = &json_object_line(path, line, text, "mooncake")?;
        let ms = obj
            .get("timestamp")
            .and_then(Value::as_f64)
            .filter(|t| t.is_finite() && *t >= 0.0)
            .ok_or_else(|| {
                SimError::trace(
                    path,
                    line,
                    "timestamp",
                    "expected a non-negative number of milliseconds",
                )
            })?;
        let arrival_s = ms / 1000.0;
        if arrival_s > super::MAX_ARRIVAL_S {
            return Err(SimError::trace(
                path,
                line,
                "timestamp",
                "later than one year",
            ));
        }
        if arrival_s < prev {
            return Err(SimError::trace(
                path,
                line,
                "timestamp",
                "timestamps are not sorted",
            ));
        }
        prev = arrival_s;
        let input = uint_field(obj, "input_length", path, line)?;
        let input = check_prompt_len(path, line, "input_length", input)?;
        let output = uint_field(obj, "output_length", path, line)?;
        let output = check_output_len(path, line, "output_length", output)?;
        let has_ids = !matches!(obj.get("hash_ids"), None | Some(Value::Null));
        let ids = match obj.get("hash_ids") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().filter(|h| *h < MAX_HASH_ID))
                .collect::<Option<Vec<u64>>>()
                .ok_or_else(|| {
                    SimError::trace(
                        path,
                        line,
                        "hash_ids",
                        format!("expected integers below {MAX_HASH_ID}"),
                    )
                })?,
            Some(_) => return Err(SimError::trace(path, line, "hash_ids", "expected an array")),
        };
        let blocks = input.div_ceil(MOONCAKE_BLOCK_TOKENS);
        if has_ids && ids.len() != blocks {
            return Err(SimError::trace(
                path,
                line,
                "hash_ids",
                format!(
                    "{} ids for {input} tokens: the format has one per \
                     {MOONCAKE_BLOCK_TOKENS}-token block, {blocks} here (leave `hash_ids` out \
                     for a prompt that shares nothing)",
                    ids.len()
                ),
            ));
        }
        match options.row(arrival_s, out.len()) {
            Row::Keep => {}
            Row::Skip => return Ok(true),
            Row::Stop => return Ok(false),
        }
        add_total(&mut total, input, path, line)?;
        out.push(TraceRequest::untagged(
            arrival_s,
            block_prompt(&ids, input, out.len() as u64),
            output,
        ));
        Ok(!options.full(out.len()))
    })?;
    Ok(out)
}

fn uint_field(
    obj: &serde_json::Map<String, Value>,
    name: &str,
    path: &Path,
    line: usize,
) -> Result<u64, SimError> {
    match obj.get(name) {
        None => Err(SimError::trace(path, line, name, "missing")),
        Some(v) => v.as_u64().ok_or_else(|| {
            SimError::trace(
                path,
                line,
                name,
                format!("expected a non-negative integer, got {v}"),
            )
        }),
    }
}

/// The prompt of request `index`: `len` tokens, block `k` derived from `ids[k]`.
pub(crate) fn block_prompt(ids: &[u64], len: usize, index: u64) -> Arc<[u32]> {
    (0..len)
        .map(|pos| {
            let block = pos / MOONCAKE_BLOCK_TOKENS;
            let offset = (pos % MOONCAKE_BLOCK_TOKENS) as u64;
            let key = match ids.get(block) {
                Some(h) => (h << 9 | offset) ^ BLOCK_DOMAIN,
                None => (index << 21 | pos as u64) ^ UNIQUE_DOMAIN,
            };
            mix64(key) as u32
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Vec<TraceRequest>, SimError> {
        load_mooncake(
            text.as_bytes(),
            Path::new("mc.jsonl"),
            &LoadOptions::default(),
        )
    }

    #[test]
    fn equal_hash_ids_give_equal_blocks() {
        let text = r#"{"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [1, 2, 3]}
{"timestamp": 1500, "input_length": 600, "output_length": 1, "hash_ids": [1, 9]}
{"timestamp": 1500, "input_length": 1030, "output_length": 1, "hash_ids": [1, 7, 8]}
{"timestamp": 1600, "input_length": 600, "output_length": 1}"#;
        let rs = load(text).unwrap();
        assert_eq!(rs.len(), 4);
        assert_eq!(rs[1].arrival_s, 1.5);
        let (a, b, c) = (&rs[0].prompt, &rs[1].prompt, &rs[2].prompt);
        assert_eq!((a.len(), b.len(), c.len()), (1100, 600, 1030));
        assert_eq!(a[..512], b[..512], "shared first block");
        assert_ne!(a[512..600], b[512..600], "different second block");
        assert_eq!(a[..512], c[..512]);
        // c's later ids are not a's: its blocks 2 and 3 differ.
        assert_ne!(a[512..1030], c[512..1030]);
        // Without hash_ids, nothing is shared.
        assert_ne!(rs[3].prompt[..512], a[..512]);
        // A partial last block equals the start of the full block with the same id.
        let d = load(
            r#"{"timestamp": 0, "input_length": 700, "output_length": 1, "hash_ids": [5, 2]}"#,
        )
        .unwrap();
        assert_eq!(d[0].prompt[512..700], a[512..700]);
    }

    #[test]
    fn malformed_lines_name_line_and_field() {
        let ok = r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}"#;
        let cases = [
            (
                r#"{"timestamp": 0, "input_length": 10}"#,
                "mc.jsonl:2: field `output_length`",
            ),
            (
                r#"{"timestamp": -1, "input_length": 10, "output_length": 1}"#,
                "mc.jsonl:2: field `timestamp`",
            ),
            (
                r#"{"timestamp": 0, "input_length": "10", "output_length": 1}"#,
                "mc.jsonl:2: field `input_length`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}"#,
                "mc.jsonl:2: field `hash_ids`",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}"#,
                "mc.jsonl:2: field `hash_ids`",
            ),
            // Fewer ids than the prompt's 512-token blocks (10 needed): the tail has none.
            (
                r#"{"timestamp": 0, "input_length": 5000, "output_length": 1, "hash_ids": [1]}"#,
                "mc.jsonl:2: field `hash_ids`: 1 ids for 5000 tokens: the format has one per \
                 512-token block, 10 here",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": []}"#,
                "mc.jsonl:2: field `hash_ids`: 0 ids",
            ),
            (
                r#"{"timestamp": 0, "input_length": 10, "output_length": 1"#,
                "mc.jsonl:2: field `<json>`",
            ),
            ("[1, 2]", "mc.jsonl:2: field `<json>`"),
        ];
        for (bad, want) in cases {
            let err = load(&format!("{ok}\n{bad}\n")).unwrap_err().to_string();
            assert!(err.starts_with(want), "{bad}: got {err}");
        }
    }
}
