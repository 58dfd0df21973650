//! Switchyard's own trace JSONL: one object per line with `arrival_s`
//! (seconds), `prompt_len` or `prompt_tokens` (explicit ids, so prefix reuse can
//! be written down exactly), `output_len`, and optional `tenant`, `tier`,
//! `priority` (lower is more urgent), `adapter`, `client` (a closed-loop client: its
//! requests are sent one at a time, each once the one before it has ended, and not before
//! its `arrival_s`) and `think_s` (with a `client`: its pause, in seconds, between the end of
//! its request before this one and this one's sending). Unknown fields are errors
//! (they are usually typos). Lines may come in any order; requests are sorted
//! by arrival, ties kept in file order, and a `limit` keeps the first requests
//! by arrival (not by line): the loader holds at most `limit` of them while
//! reading (a max-heap on arrival evicts the latest), so memory stays bounded.

use super::{
    add_total, check_output_len, check_prompt_len, for_each_line, json_object_line, unique_prompt,
    LoadOptions, TraceRequest, MAX_ARRIVAL_S, MAX_LABEL_BYTES, MAX_PROMPT_TOKENS, MAX_THINK_S,
};
use crate::error::SimError;
use serde_json::{Map, Value};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::io::BufRead;
use std::path::Path;
use std::sync::Arc;

const FIELDS: [&str; 10] = [
    "arrival_s",
    "prompt_len",
    "prompt_tokens",
    "output_len",
    "tenant",
    "tier",
    "priority",
    "adapter",
    "client",
    "think_s",
];

/// A request held while reading, ordered by arrival then by position in the file, so the
/// top of a max-heap is the one to evict first.
struct Kept {
    /// Position among the requests in the window, in file order.
    seq: u64,
    /// The request.
    request: TraceRequest,
}

impl Ord for Kept {
    fn cmp(&self, other: &Self) -> Ordering {
        self.request
            .arrival_s
            .total_cmp(&other.request.arrival_s)
            .then(self.seq.cmp(&other.seq))
    }
}

impl PartialOrd for Kept {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Kept {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Kept {}

/// Loads a Switchyard JSONL trace: the first `limit` requests by arrival (at most
/// [`MAX_REQUESTS`](super::MAX_REQUESTS)), sorted by arrival, ties in file order.
pub fn load_jsonl(
    reader: impl BufRead,
    path: &Path,
    options: &LoadOptions,
) -> Result<Vec<TraceRequest>, SimError> {
    let cap = options.cap();
    let mut kept: BinaryHeap<Kept> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut total = 0usize;
    for_each_line(reader, path, |line, text| {
        let obj = &json_object_line(path, line, text, "jsonl")?;
        let r = parse_row(obj, path, line, seq)?;
        options.check_tier(path, line, &r.tier)?;
        if !options.in_window(r.arrival_s) {
            return Ok(true);
        }
        if kept.len() >= cap {
            // Full: the request replaces the latest one held if it arrives strictly earlier
            // (on a tie the earlier line stays).
            let earlier = kept
                .peek()
                .is_some_and(|top| top.request.arrival_s > r.arrival_s);
            if !earlier {
                seq += 1;
                return Ok(true);
            }
            if let Some(evicted) = kept.pop() {
                total -= evicted.request.prompt.len();
            }
        }
        add_total(&mut total, r.prompt.len(), path, line)?;
        kept.push(Kept { seq, request: r });
        seq += 1;
        Ok(true)
    })?;
    Ok(kept
        .into_sorted_vec()
        .into_iter()
        .map(|k| k.request)
        .collect())
}

fn parse_row(
    obj: &Map<String, Value>,
    path: &Path,
    line: usize,
    index: u64,
) -> Result<TraceRequest, SimError> {
    let err = |field: &str, msg: &str| SimError::trace(path, line, field, msg);
    if let Some(unknown) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(err(unknown, "unknown field"));
    }
    let arrival_s = obj
        .get("arrival_s")
        .ok_or_else(|| err("arrival_s", "missing"))?
        .as_f64()
        .filter(|t| t.is_finite() && (0.0..=MAX_ARRIVAL_S).contains(t))
        .ok_or_else(|| err("arrival_s", "expected seconds between 0 and one year"))?;
    let prompt: Arc<[u32]> = match (obj.get("prompt_len"), obj.get("prompt_tokens")) {
        (Some(_), Some(_)) => {
            return Err(err(
                "prompt_tokens",
                "give prompt_len or prompt_tokens, not both",
            ))
        }
        (None, None) => return Err(err("prompt_len", "missing (or give prompt_tokens)")),
        (Some(n), None) => {
            let n = n
                .as_u64()
                .ok_or_else(|| err("prompt_len", "expected a non-negative integer"))?;
            unique_prompt(index, check_prompt_len(path, line, "prompt_len", n)?)
        }
        (None, Some(t)) => {
            let arr = t
                .as_array()
                .ok_or_else(|| err("prompt_tokens", "expected an array of token ids"))?;
            check_prompt_len(
                path,
                line,
                "prompt_tokens",
                arr.len().min(MAX_PROMPT_TOKENS + 1) as u64,
            )?;
            arr.iter()
                .map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect::<Option<Arc<[u32]>>>()
                .ok_or_else(|| err("prompt_tokens", "token ids must be integers in u32 range"))?
        }
    };
    let output = obj
        .get("output_len")
        .ok_or_else(|| err("output_len", "missing"))?
        .as_u64()
        .ok_or_else(|| err("output_len", "expected a non-negative integer"))?;
    let output_len = check_output_len(path, line, "output_len", output)?;
    let label = |name: &str| -> Result<String, SimError> {
        match obj.get(name) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) if s.len() <= MAX_LABEL_BYTES => Ok(s.clone()),
            Some(_) => Err(err(
                name,
                &format!("expected a string of at most {MAX_LABEL_BYTES} bytes"),
            )),
        }
    };
    let priority = match obj.get("priority") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_i64()
                .and_then(|p| i32::try_from(p).ok())
                .ok_or_else(|| err("priority", "expected an i32"))?,
        ),
    };
    let adapter = match obj.get("adapter") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|a| u32::try_from(a).ok())
                .ok_or_else(|| err("adapter", "expected a u32 adapter id"))?,
        ),
    };
    let client = label("client")?;
    let think_s = match obj.get("think_s") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_f64()
                .filter(|t| (0.0..=MAX_THINK_S).contains(t))
                .ok_or_else(|| {
                    err(
                        "think_s",
                        &format!("expected seconds between 0 and {MAX_THINK_S}"),
                    )
                })?,
        ),
    };
    if think_s.is_some() && client.is_empty() {
        return Err(err(
            "think_s",
            "a client's pause between its requests: give the record its `client`",
        ));
    }
    Ok(TraceRequest {
        arrival_s,
        prompt,
        output_len,
        tenant: label("tenant")?,
        tier: label("tier")?,
        priority,
        adapter,
        client,
        think_s,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(text: &str) -> Result<Vec<TraceRequest>, SimError> {
        load_jsonl(
            text.as_bytes(),
            Path::new("own.jsonl"),
            &LoadOptions::default(),
        )
    }

    #[test]
    fn parses_all_fields_and_sorts() {
        let text = r#"{"arrival_s": 2.5, "prompt_tokens": [1, 2, 3], "output_len": 4, "tenant": "acme", "tier": "premium", "priority": -1, "adapter": 7, "client": "p16"}
{"arrival_s": 1.0, "prompt_len": 20, "output_len": 2}"#;
        let rs = load(text).unwrap();
        assert_eq!(rs.len(), 2);
        assert_eq!(rs[0].arrival_s, 1.0);
        assert_eq!(rs[0].prompt.len(), 20);
        assert_eq!(rs[0].priority, None);
        let r = &rs[1];
        assert_eq!(&r.prompt[..], &[1, 2, 3]);
        assert_eq!(
            (r.output_len, r.tenant.as_str(), r.tier.as_str()),
            (4, "acme", "premium")
        );
        assert_eq!((r.priority, r.adapter), (Some(-1), Some(7)));
        assert_eq!((r.client.as_str(), rs[0].client.as_str()), ("p16", ""));
        assert_eq!((r.think_s, rs[0].think_s), (None, None));
        // A client is a label as a tenant is: a string of at most 64 bytes.
        for bad in [
            r#""client": 3"#,
            &format!(r#""client": "{}""#, "c".repeat(65)),
        ] {
            let line = format!(r#"{{"arrival_s": 0, "prompt_len": 1, "output_len": 1, {bad}}}"#);
            let e = load(&line).unwrap_err().to_string();
            assert!(e.contains("client"), "{e}");
        }
    }

    #[test]
    fn a_clients_think_time_is_read() {
        let rs = load(
            r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": 0.25}
{"arrival_s": 1, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": 0}
{"arrival_s": 2, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": 3600}
{"arrival_s": 3, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": null}"#,
        )
        .unwrap();
        let thinks: Vec<Option<f64>> = rs.iter().map(|r| r.think_s).collect();
        assert_eq!(thinks, vec![Some(0.25), Some(0.0), Some(3600.0), None]);
    }

    fn arrivals(text: &str, limit: Option<usize>) -> Vec<f64> {
        let options = LoadOptions {
            limit,
            ..Default::default()
        };
        load_jsonl(text.as_bytes(), Path::new("own.jsonl"), &options)
            .unwrap()
            .iter()
            .map(|r| r.arrival_s)
            .collect()
    }

    #[test]
    fn limit_keeps_the_first_arrivals_of_an_unsorted_file() {
        let row = |t: f64, len: u32| {
            format!("{{\"arrival_s\": {t}, \"prompt_len\": {len}, \"output_len\": 1}}\n")
        };
        let text: String = [(5.0, 1), (1.0, 2), (4.0, 3), (0.5, 4), (3.0, 5), (1.0, 6)]
            .iter()
            .map(|&(t, len)| row(t, len))
            .collect();
        assert_eq!(arrivals(&text, Some(3)), vec![0.5, 1.0, 1.0]);
        assert_eq!(arrivals(&text, Some(1)), vec![0.5]);
        assert_eq!(arrivals(&text, Some(0)), Vec::<f64>::new());
        assert_eq!(
            arrivals(&text, None),
            vec![0.5, 1.0, 1.0, 3.0, 4.0, 5.0],
            "no limit keeps every request"
        );
        // Ties keep file order, also at the cut: of the two requests at 1.0 s only the one
        // on the earlier line (prompt_len 2) is kept.
        let options = LoadOptions {
            limit: Some(2),
            ..Default::default()
        };
        let rs = load_jsonl(text.as_bytes(), Path::new("own.jsonl"), &options).unwrap();
        let lens: Vec<usize> = rs.iter().map(|r| r.prompt.len()).collect();
        assert_eq!(lens, vec![4, 2]);
        let all = load(&text).unwrap();
        let lens: Vec<usize> = all.iter().map(|r| r.prompt.len()).collect();
        assert_eq!(lens, vec![4, 2, 6, 5, 3, 1]);
    }

    #[test]
    fn malformed_lines_name_line_and_field() {
        let cases = [
            (r#"{"prompt_len": 1, "output_len": 1}"#, "field `arrival_s`"),
            (r#"{"arrival_s": 0, "output_len": 1}"#, "field `prompt_len`"),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "prompt_tokens": [1], "output_len": 1}"#,
                "field `prompt_tokens`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_tokens": [1, -2], "output_len": 1}"#,
                "field `prompt_tokens`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 0}"#,
                "field `output_len`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "priority": 1e12}"#,
                "field `priority`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "adapter": -1}"#,
                "field `adapter`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "tier": 3}"#,
                "field `tier`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "teir": "a"}"#,
                "field `teir`",
            ),
            (
                r#"{"arrival_s": "soon", "prompt_len": 1, "output_len": 1}"#,
                "field `arrival_s`",
            ),
            // A think time is bounded (JSON has no NaN or infinity; serde_json refuses 1e999
            // as a number out of range) and needs a client.
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": -0.5}"#,
                "field `think_s`: expected seconds between 0 and 3600",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": 3600.5}"#,
                "field `think_s`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": 1e300}"#,
                "field `think_s`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "client": "c", "think_s": "1"}"#,
                "field `think_s`",
            ),
            (
                r#"{"arrival_s": 0, "prompt_len": 1, "output_len": 1, "think_s": 1}"#,
                "field `think_s`: a client's pause",
            ),
        ];
        for (bad, want) in cases {
            let text = format!("\n{bad}\n");
            let err = load(&text).unwrap_err().to_string();
            assert!(
                err.starts_with(&format!("own.jsonl:2: {want}")),
                "{bad}: got {err}"
            );
        }
    }
}
