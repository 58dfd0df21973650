//! The Mooncake trace as a dataset of `bench serve` and `bench throughput` (Qin et al.,
//! "Mooncake: A KVCache-centric Architecture for Serving LLM Chatbot", FAST'25): one JSON
//! object a line with `timestamp` (ms), `input_length`, `output_length` and `hash_ids`, one id
//! per 512-token prompt block, equal ids meaning the same prefix block.
//!
//! A row's prompt is made of its blocks: the block of hash id `h` is
//! `--mooncake-block-tokens` token ids drawn from a ChaCha8 stream seeded by (`--seed`, `h`)
//! within the random dataset's token range, so equal ids give identical blocks across the
//! requests of a run and across runs, and a server's prefix cache sees exactly the reuse the
//! trace encodes. A block size below 512 keeps every row's blocks (and so the sharing pattern)
//! at that fraction of the length: the row's `input_length` is scaled by
//! `block_tokens / 512` (rounded up, so the block count stays the same), its last block cut to
//! it. `--max-input-len` then cuts a prompt's tail. A row without `hash_ids` shares nothing:
//! its prompt is random, as the random dataset's.
//!
//! Both benchmarks read rows and build prompts here (one reader, one prompt builder), so a
//! row's prompt is the same token ids in `bench serve` and `bench throughput` given the same
//! seed and token range; `bench throughput` ignores the timestamps (all rows are submitted at
//! once).
//!
//! The simulator reads the same files (`simulator::trace::load_mooncake`) but keeps only the
//! prompts it synthesises from the ids (at the trace's 512 tokens a block, token ids outside
//! any vocabulary); this reader keeps the ids, so a prompt can be drawn in a model's range at
//! any block size. It follows the simulator's rules for a row: one id per block exactly, sorted
//! timestamps, bounded lengths.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Deserialize;

use switchyard_simulator::spec::short_number;
use switchyard_simulator::trace::{MAX_ARRIVAL_S, MAX_LINE_BYTES, MAX_REQUESTS as MAX_ROWS};

mod first_row;
pub(super) use first_row::FirstRowCheck;

/// Tokens a hash id covers in the published trace.
pub(super) const TRACE_BLOCK_TOKENS: usize = 512;
/// Largest `--mooncake-block-tokens`.
pub(super) const MAX_BLOCK_TOKENS: usize = 8 * TRACE_BLOCK_TOKENS;
/// Most hash ids held for one run, over all its rows (128 MiB of ids; the shipped trace has
/// 121,877): a file of 1 GiB could otherwise hold half a billion.
pub(super) const MAX_TOTAL_HASH_IDS: usize = 1 << 24;
/// Largest `--skip-rows`: a file holds at most this many rows.
pub(super) const MAX_SKIP_ROWS: usize = MAX_ROWS;
/// Mixed into every block's seed, so a block's stream is no other stream of the run.
const BLOCK_DOMAIN: u128 = 0x6d6f_6f6e_6361_6b65_2d62_6c6f_636b_0001;

/// The trace's block size, unless `--mooncake-block-tokens` names another.
pub(super) const DEFAULT_BLOCK_TOKENS: usize = TRACE_BLOCK_TOKENS;

/// Refuses the mooncake flags out of range, or given without `--dataset mooncake`
/// (`mooncake`: whether it is the dataset), before anything is read: `--mooncake-block-tokens`
/// (`None`: not given), `--skip-rows`, and the flags of `only_mooncake` (name, given), which
/// mean something for this dataset only. The same refusals in `bench serve` and `bench
/// throughput`.
pub(super) fn check_flags(
    mooncake: bool,
    block_tokens: Option<usize>,
    skip_rows: usize,
    only_mooncake: &[(&str, bool)],
) -> anyhow::Result<()> {
    anyhow::ensure!(
        skip_rows <= MAX_SKIP_ROWS,
        "--skip-rows must be 0..={MAX_SKIP_ROWS}, not {skip_rows}"
    );
    anyhow::ensure!(
        skip_rows == 0 || mooncake,
        "--skip-rows needs --dataset mooncake (the rows of the trace skipped before the first \
         one sent)"
    );
    let n = block_tokens.unwrap_or(DEFAULT_BLOCK_TOKENS);
    anyhow::ensure!(
        (1..=MAX_BLOCK_TOKENS).contains(&n),
        "--mooncake-block-tokens must be 1..={MAX_BLOCK_TOKENS}, not {n}"
    );
    anyhow::ensure!(
        block_tokens.is_none() || mooncake,
        "--mooncake-block-tokens needs --dataset mooncake (the tokens of one of its prompt blocks)"
    );
    if let Some((name, _)) = only_mooncake.iter().find(|&&(_, given)| given && !mooncake) {
        anyhow::bail!("{name} needs --dataset mooncake (it bounds that dataset's rows)");
    }
    Ok(())
}

/// One row of a Mooncake trace as the benchmark sends it.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct MooncakeRow {
    /// Prompt tokens sent: `input_length` scaled to the block size, cut at `--max-input-len`.
    pub(super) input: usize,
    /// Output tokens asked for: `output_length` clamped to `1..=--max-output-len`.
    pub(super) output: usize,
    /// Seconds after the first row's timestamp.
    pub(super) at: f64,
    /// The row's hash ids, one per block (`None`: the row has none and shares nothing).
    pub(super) hash_ids: Option<Arc<[u64]>>,
}

/// How rows become requests: the limits and the scale applied while reading.
#[derive(Debug, Clone, Copy)]
pub(super) struct RowShape {
    /// Tokens of one block of the prompt (`--mooncake-block-tokens`).
    pub(super) block_tokens: usize,
    /// Longest prompt sent (`--max-input-len`).
    pub(super) max_input: usize,
    /// Longest output asked for (`--max-output-len`).
    pub(super) max_output: usize,
    /// Longest `input_length` or `output_length` a row may state.
    pub(super) max_row_tokens: usize,
    /// Most hash ids of all the rows read.
    pub(super) max_total_ids: usize,
}

/// Where a block's token ids are drawn: `[offset, offset + range)`, from the stream of
/// (`seed`, hash id).
#[derive(Debug, Clone, Copy)]
pub(super) struct TokenSpace {
    /// `--seed`.
    pub(super) seed: u64,
    /// `--token-offset`.
    pub(super) offset: u32,
    /// `--token-range` (at least 1 from the command line; 0 is taken as 1).
    pub(super) range: u32,
}

/// One line of the file, as the format defines it (other fields are ignored).
#[derive(Deserialize)]
struct Line {
    timestamp: f64,
    input_length: u64,
    output_length: u64,
    #[serde(default)]
    hash_ids: Option<Vec<u64>>,
}

/// Reads `limit` rows of the Mooncake trace `text` (the contents of `path`) after its first
/// `skip` rows (`--skip-rows`: a slice of the trace; the rows skipped are counted, not read,
/// and times count from the first row read).
pub(super) fn read_rows(
    path: &Path,
    text: &str,
    shape: RowShape,
    skip: usize,
    limit: usize,
) -> anyhow::Result<Vec<MooncakeRow>> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let mut rows = Vec::new();
    let mut first_ms: Option<f64> = None;
    let mut prev_ms = f64::NEG_INFINITY;
    let mut total_ids = 0usize;
    let mut skipped = 0usize;
    for (i, raw) in text.lines().enumerate() {
        if rows.len() >= limit {
            break;
        }
        let at = |field: &str| format!("{}:{}: field {field}", path.display(), i + 1);
        if raw.trim().is_empty() {
            continue;
        }
        if skipped < skip {
            skipped += 1;
            continue;
        }
        anyhow::ensure!(
            raw.len() <= MAX_LINE_BYTES,
            "{}: longer than {MAX_LINE_BYTES} bytes",
            at("<line>")
        );
        anyhow::ensure!(
            rows.len() < MAX_ROWS,
            "{}: more than {MAX_ROWS} rows",
            path.display()
        );
        // A row is a JSON object: serde would also take an array of the fields in order,
        // which the format is not (and which the start check, [`FirstRowCheck`], refuses).
        let parsed = match raw.trim_start().chars().next() {
            Some('{') => serde_json::from_str(raw).map_err(anyhow::Error::from),
            first => Err(anyhow::anyhow!(
                "it begins with {}, not `{{`",
                first.map_or_else(|| "nothing".into(), shown_char)
            )),
        };
        let line: Line = parsed.with_context(|| {
            // A line that is no JSON object at all (a CSV trace given as the mooncake
            // dataset) is the wrong file, not a bad row: say so, as `simulate` does.
            match serde_json::from_str::<serde_json::Value>(raw) {
                Ok(serde_json::Value::Object(_)) => at("<json>"),
                _ => format!(
                    "{}: not a JSON object: a Mooncake trace has one JSON object per line \
                     (is --dataset-path a Mooncake trace?)",
                    at("<json>")
                ),
            }
        })?;
        let ms = line.timestamp;
        anyhow::ensure!(
            ms.is_finite() && ms >= 0.0,
            "{}: {} is not a non-negative number of milliseconds",
            at("timestamp"),
            short_number(ms)
        );
        anyhow::ensure!(
            ms >= prev_ms,
            "{}: {} is earlier than the row before ({}): timestamps must be sorted",
            at("timestamp"),
            short_number(ms),
            short_number(prev_ms)
        );
        prev_ms = ms;
        let since = (ms - *first_ms.get_or_insert(ms)) / 1000.0;
        anyhow::ensure!(
            since <= MAX_ARRIVAL_S,
            "{}: {} s after the first row's; at most a year ({MAX_ARRIVAL_S:.0} s) is \
             replayed",
            at("timestamp"),
            short_number(since.round())
        );
        let max = shape.max_row_tokens as u64;
        for (name, v) in [
            ("input_length", line.input_length),
            ("output_length", line.output_length),
        ] {
            anyhow::ensure!(
                (1..=max).contains(&v),
                "{}: {v} is outside 1..={max}",
                at(name)
            );
        }
        // Bounded above, so these fit in a usize.
        let (input, output) = (line.input_length as usize, line.output_length as usize);
        let blocks = input.div_ceil(TRACE_BLOCK_TOKENS);
        if let Some(ids) = &line.hash_ids {
            anyhow::ensure!(
                ids.len() == blocks,
                "{}: {} ids for {input} tokens: the format has one per \
                 {TRACE_BLOCK_TOKENS}-token block, {blocks} here (leave `hash_ids` out for a \
                 prompt that shares nothing)",
                at("hash_ids"),
                ids.len()
            );
            total_ids += ids.len();
            anyhow::ensure!(
                total_ids <= shape.max_total_ids,
                "{}: more than {} hash ids in the rows up to here: read fewer rows \
                 (--num-prompts)",
                at("hash_ids"),
                shape.max_total_ids
            );
        }
        rows.push(MooncakeRow {
            input: scaled_len(input, shape.block_tokens).min(shape.max_input),
            output: output.min(shape.max_output),
            at: since,
            hash_ids: line.hash_ids.map(Arc::from),
        });
    }
    anyhow::ensure!(!rows.is_empty(), "{}", no_rows(path, skipped, skip));
    Ok(rows)
}

/// Why a file of which `skipped` rows were counted and skipped (of the `skip` that
/// `--skip-rows` asks) gives no row to read.
fn no_rows(path: &Path, skipped: usize, skip: usize) -> String {
    format!(
        "{} has no rows{}",
        path.display(),
        if skipped < skip {
            format!(": it ends after {skipped}, before the {skip} that --skip-rows skips")
        } else if skip > 0 {
            format!(" after the {skipped} that --skip-rows {skip} skips")
        } else {
            String::new()
        }
    )
}

/// A character as an error shows it: printable ASCII as itself, other ASCII as its byte, the
/// rest as its code point.
fn shown_char(c: char) -> String {
    if c.is_ascii_graphic() {
        format!("`{c}`")
    } else if c.is_ascii() {
        format!("byte 0x{:02x}", c as u32)
    } else {
        format!("U+{:04X}", c as u32)
    }
}

/// A row of `input` trace tokens at `block_tokens` tokens a block rather than 512: scaled and
/// rounded up, so it spans as many blocks as the row has ids (the last one partial as in the
/// trace). Both are bounded (`input` by the row limit, `block_tokens` by
/// [`MAX_BLOCK_TOKENS`]), so the product cannot overflow.
pub(super) fn scaled_len(input: usize, block_tokens: usize) -> usize {
    (input * block_tokens).div_ceil(TRACE_BLOCK_TOKENS)
}

/// The prompt of `len` tokens made of the blocks of `ids`, `block_tokens` each (the last one
/// cut to the length); tokens past the ids' blocks (none for a row read by [`read_rows`]) come
/// from `rest`.
pub(super) fn block_prompt(
    ids: &[u64],
    len: usize,
    block_tokens: usize,
    tokens: TokenSpace,
    rest: &mut ChaCha8Rng,
) -> Vec<u32> {
    let block_tokens = block_tokens.max(1);
    let range = tokens.range.max(1);
    let mut prompt = Vec::with_capacity(len);
    let mut ids = ids.iter();
    while prompt.len() < len {
        let n = block_tokens.min(len - prompt.len());
        match ids.next() {
            Some(&h) => {
                let mut block = block_stream(tokens.seed, h);
                prompt.extend((0..n).map(|_| tokens.offset + block.random_range(0..range)));
            }
            None => prompt.extend((0..n).map(|_| tokens.offset + rest.random_range(0..range))),
        }
    }
    prompt
}

/// The stream the block of hash id `h` is drawn from, in a run seeded with `seed`: the whole
/// 256-bit ChaCha key holds both, so no two (seed, id) pairs share a stream.
fn block_stream(seed: u64, h: u64) -> ChaCha8Rng {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&h.to_le_bytes());
    key[16..].copy_from_slice(&BLOCK_DOMAIN.to_le_bytes());
    ChaCha8Rng::from_seed(key)
}

/// The prompt tokens of `prompts` (each its length and its blocks' hash ids, in the order
/// sent) that lie in blocks whose hash id an earlier prompt sent, up to the tokens of that
/// block it sent: what a prefix cache that never evicts could serve (an upper bound; a server
/// also recomputes a prompt's last token and reuses whole KV blocks only).
pub(super) fn reusable_tokens<'a>(
    prompts: impl IntoIterator<Item = (usize, &'a [u64])>,
    block_tokens: usize,
) -> usize {
    let block_tokens = block_tokens.max(1);
    // The most tokens of each id's block an earlier prompt sent.
    let mut sent: HashMap<u64, usize> = HashMap::new();
    let mut reusable = 0;
    for (len, ids) in prompts {
        let blocks = ids.iter().enumerate().map(|(k, &h)| {
            let start = k.saturating_mul(block_tokens);
            (h, block_tokens.min(len.saturating_sub(start)))
        });
        let blocks: Vec<(u64, usize)> = blocks.filter(|&(_, n)| n > 0).collect();
        for &(h, n) in &blocks {
            reusable += n.min(sent.get(&h).copied().unwrap_or(0));
        }
        for (h, n) in blocks {
            let most = sent.entry(h).or_insert(0);
            *most = (*most).max(n);
        }
    }
    reusable
}

/// The prefix reuse a trace itself holds (the mooncake dataset): what the run's report sets
/// beside the cached tokens the server reported.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct TraceReuse {
    /// Prompt tokens in blocks an earlier prompt of the run sent (see
    /// [`reusable_tokens`]).
    pub(super) reusable: usize,
    /// Prompt tokens of all the run's prompts.
    pub(super) input: usize,
}

impl TraceReuse {
    /// The reuse of the run's prompts, each its length and its blocks' hash ids (`None`:
    /// random tokens), in the order they are sent, at `block_tokens` tokens a block.
    pub(super) fn of<'a>(
        prompts: impl IntoIterator<Item = (usize, Option<&'a [u64]>)>,
        block_tokens: usize,
    ) -> TraceReuse {
        let prompts: Vec<(usize, Option<&[u64]>)> = prompts.into_iter().collect();
        let shared = prompts.iter().filter_map(|&(n, ids)| Some((n, ids?)));
        TraceReuse {
            reusable: reusable_tokens(shared, block_tokens),
            input: prompts.iter().map(|&(n, _)| n).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bounds wide enough for every test's rows (also the start check's tests').
    pub(super) const SHAPE: RowShape = RowShape {
        block_tokens: 512,
        max_input: 1 << 20,
        max_output: 1 << 20,
        max_row_tokens: 1 << 20,
        max_total_ids: 1 << 24,
    };
    const TOKENS: TokenSpace = TokenSpace {
        seed: 7,
        offset: 1000,
        range: 20_000,
    };

    fn read(text: &str, shape: RowShape) -> anyhow::Result<Vec<MooncakeRow>> {
        read_rows(Path::new("mc.jsonl"), text, shape, 0, usize::MAX)
    }

    fn prompt(ids: &[u64], len: usize, block: usize, tokens: TokenSpace) -> Vec<u32> {
        block_prompt(ids, len, block, tokens, &mut ChaCha8Rng::seed_from_u64(99))
    }

    #[test]
    fn equal_hash_ids_give_equal_blocks_and_different_ids_differ() {
        let a = prompt(&[1, 2, 3], 1100, 512, TOKENS);
        let b = prompt(&[1, 9], 600, 512, TOKENS);
        assert_eq!((a.len(), b.len()), (1100, 600));
        assert_eq!(a[..512], b[..512], "the shared first block");
        assert_ne!(a[512..600], b[512..600], "a different second block");
        // A cut last block is the start of the whole block of that id.
        let c = prompt(&[5, 2], 700, 512, TOKENS);
        assert_eq!(c[512..700], a[512..700]);
        // The same in another request and another run (a fresh generator for the rest).
        assert_eq!(prompt(&[1, 2, 3], 1100, 512, TOKENS), a);
        // Another --seed draws other blocks; every id in [offset, offset + range).
        let other = TokenSpace { seed: 8, ..TOKENS };
        assert_ne!(prompt(&[1], 512, 512, other)[..], a[..512]);
        assert!(a.iter().all(|t| (1000..21_000).contains(t)));
        // Smaller blocks: block k is the first `block` ids of the full block of that id.
        let small = prompt(&[1, 2, 3], 130, 64, TOKENS);
        assert_eq!(small[..64], a[..64]);
        assert_eq!(small[64..128], a[512..576]);
        assert_eq!(small[128..130], a[1024..1026]);
    }

    #[test]
    fn rows_scale_cut_and_keep_their_times() {
        let text = r#"{"timestamp": 1000, "input_length": 1100, "output_length": 30, "hash_ids": [1, 2, 3]}
{"timestamp": 2500, "input_length": 600, "output_length": 1, "hash_ids": [1, 9], "x": 0}

{"timestamp": 2500, "input_length": 10, "output_length": 4}"#;
        let rows = read(text, SHAPE).unwrap();
        let view: Vec<_> = rows
            .iter()
            .map(|r| {
                (
                    r.input,
                    r.output,
                    r.at,
                    r.hash_ids.as_ref().map(|h| h.len()),
                )
            })
            .collect();
        assert_eq!(
            view,
            vec![
                (1100, 30, 0.0, Some(3)),
                (600, 1, 1.5, Some(2)),
                (10, 4, 1.5, None)
            ]
        );
        // 64 tokens a block: 1/8 the length, rounded up, as many blocks as ids; then the cuts.
        let small = RowShape {
            block_tokens: 64,
            max_input: 100,
            max_output: 8,
            ..SHAPE
        };
        let rows = read(text, small).unwrap();
        let view: Vec<_> = rows.iter().map(|r| (r.input, r.output)).collect();
        assert_eq!(view, vec![(100, 8), (75, 1), (2, 4)]);
        assert_eq!(scaled_len(1100, 64), 138);
        assert_eq!(scaled_len(1024, 64).div_ceil(64), 2);
        assert_eq!(scaled_len(1025, 64).div_ceil(64), 3);
        // Only the first rows are read: a bad row after them is never seen.
        let rows = read_rows(
            Path::new("mc.jsonl"),
            &format!("{text}\nnot json"),
            SHAPE,
            0,
            2,
        );
        assert_eq!(rows.unwrap().len(), 2);
    }

    /// `--skip-rows`: a slice of the trace, its times counted from its own first row; rows
    /// skipped are not read (a bad one there is never seen); a skip past the end is refused.
    #[test]
    fn skipped_rows_start_the_slice_later() {
        let text = r#"not json, skipped unread

{"timestamp": 1000, "input_length": 1100, "output_length": 30, "hash_ids": [1, 2, 3]}
{"timestamp": 2500, "input_length": 600, "output_length": 1, "hash_ids": [1, 9]}
{"timestamp": 4000, "input_length": 10, "output_length": 4}"#;
        let slice = |skip, limit| read_rows(Path::new("mc.jsonl"), text, SHAPE, skip, limit);
        let all = slice(1, usize::MAX).unwrap();
        assert_eq!(all.len(), 3);
        let rows = slice(2, 1).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].input, 600);
        assert_eq!(rows[0].hash_ids.as_deref(), Some(&[1u64, 9][..]));
        assert_eq!(rows[0].at, 0.0, "times count from the slice's first row");
        let rows = slice(3, 5).unwrap();
        assert_eq!((rows.len(), rows[0].input), (1, 10));
        let e = slice(4, 5).unwrap_err().to_string();
        assert_eq!(
            e,
            "mc.jsonl has no rows after the 4 that --skip-rows 4 skips"
        );
        // A skip past the end says how many rows there were, not that it skipped them all.
        let e = slice(9, 5).unwrap_err().to_string();
        assert_eq!(
            e,
            "mc.jsonl has no rows: it ends after 4, before the 9 that --skip-rows skips"
        );
        assert!(slice(0, 5).is_err(), "the first line is not a row");
    }

    #[test]
    fn bad_rows_name_the_file_line_and_field() {
        let ok = r#"{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [1]}"#;
        let long = format!(
            r#"{{"timestamp": 5, "input_length": 10, "output_length": 1, "pad": "{}"}}"#,
            "x".repeat(MAX_LINE_BYTES)
        );
        let cases = [
            (
                r#"{"timestamp": 5, "input_length": 10}"#,
                "mc.jsonl:2: field <json>",
            ),
            (
                r#"{"timestamp": -1, "input_length": 10, "output_length": 1}"#,
                "mc.jsonl:2: field timestamp",
            ),
            (
                r#"{"timestamp": 4, "input_length": 10, "output_length": 1}"#,
                "mc.jsonl:2: field timestamp: 4 is earlier than the row before (5)",
            ),
            (
                r#"{"timestamp": 1e14, "input_length": 10, "output_length": 1}"#,
                "mc.jsonl:2: field timestamp",
            ),
            // Numbers echoed short (`{}` wrote 1e300 as 301 digits).
            (
                r#"{"timestamp": 1e300, "input_length": 10, "output_length": 1}"#,
                "mc.jsonl:2: field timestamp: 1e297 s after the first row's; at most a year \
                 (31622400 s) is replayed",
            ),
            (
                r#"{"timestamp": -1e300, "input_length": 10, "output_length": 1}"#,
                "mc.jsonl:2: field timestamp: -1e300 is not a non-negative number of \
                 milliseconds",
            ),
            (
                r#"{"timestamp": 5, "input_length": 0, "output_length": 1}"#,
                "mc.jsonl:2: field input_length: 0 is outside 1..=1048576",
            ),
            (
                r#"{"timestamp": 5, "input_length": 1048577, "output_length": 1}"#,
                "mc.jsonl:2: field input_length",
            ),
            (
                r#"{"timestamp": 5, "input_length": 10, "output_length": 99999999999}"#,
                "mc.jsonl:2: field output_length",
            ),
            (
                r#"{"timestamp": 5, "input_length": "10", "output_length": 1}"#,
                "mc.jsonl:2: field <json>",
            ),
            (
                r#"{"timestamp": 5, "input_length": 5000, "output_length": 1, "hash_ids": [1]}"#,
                "mc.jsonl:2: field hash_ids: 1 ids for 5000 tokens: the format has one per \
                 512-token block, 10 here",
            ),
            (
                r#"{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": []}"#,
                "mc.jsonl:2: field hash_ids: 0 ids",
            ),
            (
                r#"{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": [-1]}"#,
                "mc.jsonl:2: field <json>",
            ),
            ("[1, 2]", "mc.jsonl:2: field <json>"),
            (&long, "mc.jsonl:2: field <line>: longer than 1048576 bytes"),
        ];
        for (bad, want) in cases {
            let e = read(&format!("{ok}\n{bad}\n"), SHAPE).unwrap_err();
            let e = format!("{e:#}");
            assert!(
                e.starts_with(want),
                "{}: got {e}",
                &bad[..bad.len().min(80)]
            );
        }
        // The ids of all the rows are bounded: 3 + 2 of at most 4 ids fail on line 2.
        let few = RowShape {
            max_total_ids: 4,
            ..SHAPE
        };
        let text = r#"{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1, 2, 3]}
{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 9]}"#;
        let e = format!("{:#}", read(text, few).unwrap_err());
        assert!(
            e.starts_with("mc.jsonl:2: field hash_ids: more than 4 hash ids"),
            "{e}"
        );
        let e = read("\n\n", SHAPE).unwrap_err();
        assert_eq!(e.to_string(), "mc.jsonl has no rows");
    }

    /// A file that is not JSON Lines at all (the Azure CSV given as the mooncake dataset) is
    /// named as the wrong file; a JSON object with a bad field keeps serde's own message.
    #[test]
    fn a_file_of_another_format_is_named_as_not_a_mooncake_trace() {
        let hint = "not a JSON object: a Mooncake trace has one JSON object per line \
                    (is --dataset-path a Mooncake trace?)";
        // An array of the fields in order is refused too (serde would take it).
        for bad in [
            "TIMESTAMP,ContextTokens,GeneratedTokens\n1,2,3\n",
            "[1, 2]\n",
            "[5, 10, 1]\n",
            " [5, 10, 1, [1]]\n",
        ] {
            let e = format!("{:#}", read(bad, SHAPE).unwrap_err());
            assert!(e.starts_with("mc.jsonl:1: field <json>: "), "{e}");
            assert!(e.contains(hint), "{e}");
        }
        let e = format!(
            "{:#}",
            read(r#"{"timestamp": 5, "input_length": 10}"#, SHAPE).unwrap_err()
        );
        assert!(
            e.contains("missing field `output_length`") && !e.contains(hint),
            "{e}"
        );
    }

    #[test]
    fn reusable_tokens_count_blocks_an_earlier_row_sent() {
        let rows: [(usize, &[u64]); 3] = [
            // 2 blocks of 4 and 2 tokens: nothing earlier.
            (6, &[1, 2]),
            // Block 1 again (4 tokens), block 2 whole now (but only 2 of its tokens were sent
            // before), block 3 new.
            (10, &[1, 2, 3]),
            // Block 1 cut to 3 tokens by the prompt's length; block 9 past the length is not
            // sent.
            (3, &[1, 9]),
        ];
        assert_eq!(reusable_tokens(rows, 4), 4 + 2 + 3);
        assert_eq!(reusable_tokens(rows.into_iter().take(1), 4), 0);
        // The same id twice in one prompt counts from the next prompt on.
        assert_eq!(reusable_tokens([(8, &[5u64, 5][..])], 4), 0);
        // A run's reuse: its rows with ids, over all its prompt tokens (random ones too).
        let run = [
            (6, Some(&[1u64, 2][..])),
            (5, None),
            (10, Some(&[1, 2, 3][..])),
        ];
        assert_eq!(
            TraceReuse::of(run, 4),
            TraceReuse {
                reusable: 4 + 2,
                input: 21
            }
        );
    }
}
