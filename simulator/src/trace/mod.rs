//! Request traces: one in-memory form ([`TraceRequest`]) and loaders for the
//! published formats (Azure LLM inference CSV, Mooncake JSONL, ShareGPT length
//! CSV) and our own JSONL.
//!
//! Prompt token ids are synthesised deterministically so that the prefix cache
//! sees exactly the reuse a trace encodes and nothing more: Azure and ShareGPT
//! prompts are unique per request (a bijective per-request base plus an odd
//! stride, so two requests differ at every position); Mooncake prompts are
//! built from `hash_ids` (one id per 512-token block, a token derived from
//! `(hash_id, position)`), so equal ids give equal blocks. Prompts are shared as
//! `Arc<[u32]>` so the engine loop never copies them.
//!
//! Every count and length read from a file is bounded (see the `MAX_*`
//! constants); a malformed line yields [`SimError::Trace`] naming the file,
//! line and field.

mod azure;
mod jsonl;
mod mooncake;
mod sharegpt;

pub use azure::{load_azure, parse_timestamp};
pub use jsonl::load_jsonl;
pub use mooncake::{load_mooncake, MOONCAKE_BLOCK_TOKENS};
pub use sharegpt::{load_sharegpt, ArrivalProcess};

use crate::error::SimError;
use rand::distr::weighted::WeightedIndex;
use rand::distr::Distribution;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::io::{BufRead, Read};
use std::path::Path;
use std::sync::Arc;

/// Longest prompt accepted from a trace, in tokens.
pub const MAX_PROMPT_TOKENS: usize = 1 << 20;
/// Longest output accepted from a trace, in tokens.
pub const MAX_OUTPUT_TOKENS: u32 = 1 << 20;
/// Most requests read from one trace.
pub const MAX_REQUESTS: usize = 10_000_000;
/// Most prompt tokens held for one trace (bounds memory at 2 GiB of token ids).
pub const MAX_TOTAL_PROMPT_TOKENS: usize = 1 << 29;
/// Most output tokens one trace asks for: each is simulated, and its inter-token latency kept
/// for the report (8 bytes per token and policy: at most 2 GiB).
pub const MAX_TOTAL_OUTPUT_TOKENS: u64 = 1 << 28;
/// Longest line accepted in a trace file, in bytes.
pub const MAX_LINE_BYTES: usize = 1 << 20;
/// Longest tenant or tier label, in bytes.
pub const MAX_LABEL_BYTES: usize = 64;
/// Latest arrival accepted, in seconds (one year): read from a file, and again after the
/// workload is shaped (time scale, rate, load), so the virtual clock in microseconds stays
/// far from overflowing.
pub const MAX_ARRIVAL_S: f64 = 366.0 * 86_400.0;
/// Longest think time accepted, in seconds (one hour), from a trace record's `think_s` or
/// the spec's mean: a client idle longer starts a new session, which its `arrival_s` says.
pub const MAX_THINK_S: f64 = 3_600.0;
/// Most bytes read from a trace that is not a regular file (a pipe, `/dev/stdin`): a stream
/// has no size to check, and a JSON Lines trace is read to its end whatever the limit
/// (its lines may come in any order), so an endless one would never be done.
pub const MAX_STREAM_BYTES: u64 = 1 << 32;

/// One request of a trace, ready to be turned into a scheduler request.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Arrival time in seconds from the start of the trace.
    pub arrival_s: f64,
    /// Prompt token ids (shared, never copied by the simulator).
    pub prompt: Arc<[u32]>,
    /// Number of output tokens the request generates.
    pub output_len: u32,
    /// Tenant label ("" when the trace has none and no mix is assigned).
    pub tenant: String,
    /// Tier name ("" = default tier).
    pub tier: String,
    /// Priority, lower is more urgent; `None` lets the tier decide.
    pub priority: Option<i32>,
    /// LoRA adapter id, if any.
    pub adapter: Option<u32>,
    /// Client label ("" = none): the requests of one client are sent one at a time, as a
    /// closed-loop client sends them, each at its `arrival_s` or once the client's request
    /// before it (by arrival) has ended (plus its think time), whichever is later.
    pub client: String,
    /// A client's pause between the end of its request before this one and this one's
    /// sending, in seconds (0 to [`MAX_THINK_S`]; `None`: none given, the spec's
    /// `workload.clients.think_s` draws one). Read only for a client's request after its first.
    pub think_s: Option<f64>,
}

impl TraceRequest {
    /// A request of no tenant, the default tier and priority, and no adapter: a row of a
    /// trace format that carries none of them.
    pub(crate) fn untagged(arrival_s: f64, prompt: Arc<[u32]>, output_len: u32) -> Self {
        Self {
            arrival_s,
            prompt,
            output_len,
            tenant: String::new(),
            tier: String::new(),
            priority: None,
            adapter: None,
            client: String::new(),
            think_s: None,
        }
    }
}

/// Trace file formats understood by [`load_trace`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TraceFormat {
    /// Azure LLM inference trace CSV (`TIMESTAMP,ContextTokens,GeneratedTokens`).
    Azure,
    /// Mooncake JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).
    Mooncake,
    /// ShareGPT length CSV (`num_prefill_tokens`, `num_decode_tokens`), arrivals generated.
    Sharegpt,
    /// Switchyard's own JSONL.
    Jsonl,
}

impl TraceFormat {
    /// The name a spec and the command line use (`azure`, `mooncake`, `sharegpt`, `jsonl`).
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Azure => "azure",
            TraceFormat::Mooncake => "mooncake",
            TraceFormat::Sharegpt => "sharegpt",
            TraceFormat::Jsonl => "jsonl",
        }
    }
}

impl std::str::FromStr for TraceFormat {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "azure" => Ok(TraceFormat::Azure),
            "mooncake" => Ok(TraceFormat::Mooncake),
            "sharegpt" => Ok(TraceFormat::Sharegpt),
            "jsonl" => Ok(TraceFormat::Jsonl),
            other => Err(format!(
                "unknown trace format `{other}` (known: azure, mooncake, sharegpt, jsonl)"
            )),
        }
    }
}

/// Row selection applied while loading (before any arrival rescaling).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadOptions {
    /// Keep at most this many requests, the first ones by arrival (the JSONL loader sorts;
    /// the other formats are in arrival order).
    pub limit: Option<usize>,
    /// Drop requests arriving before this many seconds (timestamped traces).
    pub start_s: Option<f64>,
    /// Drop requests arriving at or after this many seconds (timestamped traces).
    pub end_s: Option<f64>,
    /// The tiers the spec defines: a trace line naming another tier is an error, as the
    /// server refuses an unknown tier; with none defined, every tier named is (`None`: not
    /// checked, for loading a trace on its own). The empty tier (none given) is always
    /// accepted.
    pub known_tiers: Option<Vec<String>>,
}

impl LoadOptions {
    /// Whether a request at `arrival_s` lies in the window.
    pub(crate) fn in_window(&self, arrival_s: f64) -> bool {
        self.start_s.is_none_or(|s| arrival_s >= s) && self.end_s.is_none_or(|e| arrival_s < e)
    }

    /// Most requests kept: the limit, and never more than [`MAX_REQUESTS`].
    pub(crate) fn cap(&self) -> usize {
        self.limit.unwrap_or(MAX_REQUESTS).min(MAX_REQUESTS)
    }

    /// An error naming `tier` and the line when the spec does not define it, saying how to
    /// define it (a spec defining no tiers at all included).
    pub(crate) fn check_tier(&self, path: &Path, line: usize, tier: &str) -> Result<(), SimError> {
        match &self.known_tiers {
            Some(known) if !tier.is_empty() && !known.iter().any(|k| k == tier) => {
                let defined = if known.is_empty() {
                    "no tier is defined".to_string()
                } else {
                    format!("defined: {}", known.join(", "))
                };
                Err(SimError::trace(
                    path,
                    line,
                    "tier",
                    format!(
                        "tier `{tier}` is not defined ({defined}): define it under `tiers` in \
                         the spec (`simulate --config`), or give `simulate --trace` a file with \
                         a `tiers` section (a server configuration) with `--tiers FILE`; the \
                         server refuses an unknown tier"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// Whether `count` requests already reach the limit.
    pub(crate) fn full(&self, count: usize) -> bool {
        count >= self.cap()
    }

    /// What becomes of a row arriving at `arrival_s` of a file in arrival order, `kept`
    /// requests kept before it.
    pub(crate) fn row(&self, arrival_s: f64, kept: usize) -> Row {
        if self.end_s.is_some_and(|e| arrival_s >= e) {
            return Row::Stop;
        }
        if !self.in_window(arrival_s) {
            return Row::Skip;
        }
        if self.full(kept) {
            // Reached only with a limit of 0: otherwise reading stops right after the push
            // that fills the trace.
            return Row::Stop;
        }
        Row::Keep
    }
}

/// [`LoadOptions::row`]'s verdict on a row of a file in arrival order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Row {
    /// Kept.
    Keep,
    /// Left out (before the window); the rows after it are read.
    Skip,
    /// Left out, and reading stops: the window has ended or the limit is reached.
    Stop,
}

/// A trace being read: a regular file, or a stream bounded to [`MAX_STREAM_BYTES`].
pub type TraceReader = std::io::BufReader<Bounded<std::fs::File>>;

/// Opens the trace at `path`: a regular file is read as it is; anything else that can be
/// read (a pipe, a named pipe, `/dev/stdin`) as a stream of at most [`MAX_STREAM_BYTES`],
/// past which reading fails rather than never ending. A directory, and a terminal (a trace
/// typed by hand is never what was meant: `/dev/stdin` with nothing piped in), are refused
/// at once. Opening a named pipe waits for its writer, as every reader of one does.
pub fn open_trace(path: &Path) -> Result<TraceReader, SimError> {
    // Named as the trace: a file that is not there is most often a mistyped path.
    let not_opened =
        |e: std::io::Error| SimError::spec(path, format!("the trace cannot be opened: {e}"));
    let meta = std::fs::metadata(path).map_err(not_opened)?;
    if meta.is_dir() {
        return Err(SimError::spec(
            path,
            "is a directory, not a trace: give the trace file in it",
        ));
    }
    let file = std::fs::File::open(path).map_err(not_opened)?;
    let limit = if meta.is_file() {
        u64::MAX
    } else {
        if std::io::IsTerminal::is_terminal(&file) {
            return Err(SimError::spec(
                path,
                "is a terminal: pipe a trace into it (`... | switchyard simulate --trace \
                 /dev/stdin`) or give a file",
            ));
        }
        MAX_STREAM_BYTES
    };
    Ok(std::io::BufReader::new(Bounded::new(file, limit)))
}

/// A reader that fails once more than `limit` bytes have come from `inner`: a stream's bound
/// is an error, never a trace silently cut short.
#[derive(Debug)]
pub struct Bounded<R> {
    inner: R,
    left: u64,
    limit: u64,
}

impl<R> Bounded<R> {
    /// `inner`, of which at most `limit` bytes may be read.
    pub fn new(inner: R, limit: u64) -> Self {
        Self {
            inner,
            left: limit,
            limit,
        }
    }
}

impl<R: Read> Read for Bounded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        // One byte past the bound is asked for, so that a stream of exactly `limit` bytes
        // ends cleanly and a longer one is told.
        let max = usize::try_from(self.left.saturating_add(1)).unwrap_or(usize::MAX);
        let max = buf.len().min(max);
        let n = self.inner.read(&mut buf[..max])?;
        if n as u64 > self.left {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "a trace read from a stream (not a regular file) may hold at most {} \
                     bytes: write it to a file, or cut it shorter before the pipe",
                    self.limit
                ),
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

/// Loads a timestamped trace (`azure`, `mooncake`, `jsonl`) from `path` (see [`open_trace`]).
/// ShareGPT needs an arrival process: use [`load_sharegpt`].
pub fn load_trace(
    path: &Path,
    format: TraceFormat,
    options: &LoadOptions,
) -> Result<Vec<TraceRequest>, SimError> {
    let reader = open_trace(path)?;
    match format {
        TraceFormat::Azure => load_azure(reader, path, options),
        TraceFormat::Mooncake => load_mooncake(reader, path, options),
        TraceFormat::Jsonl => load_jsonl(reader, path, options),
        TraceFormat::Sharegpt => Err(SimError::spec(
            path,
            "the sharegpt format has no timestamps: give an arrival process (rate or load)",
        )),
    }
}

/// The error for a CSV trace's header `fields` (of line `line`) lacking the column `name`; a
/// header that is a JSON object (a JSON Lines trace given as `format`, its `--format` name)
/// says that the format may be wrong, as a CSV given as a JSON Lines trace does.
pub(crate) fn missing_column(
    path: &Path,
    line: usize,
    fields: &[&str],
    name: &str,
    format: &str,
) -> SimError {
    let json = fields
        .first()
        .is_some_and(|f| f.trim_start_matches('\u{feff}').starts_with('{'));
    let hint = if json {
        format!(
            " (the line is a JSON object, not the header of a `{format}` CSV: is --format right \
             for this file? JSON Lines traces are `jsonl` or `mooncake`)"
        )
    } else {
        String::new()
    };
    SimError::trace(
        path,
        line,
        name,
        format!("header lacks column `{name}`{hint}"),
    )
}

/// Parses one line of a JSON Lines trace (`format`: its `--format` name) as a JSON object. A
/// line that is not one says which format expected it, so a CSV given as a JSON Lines trace
/// reads as the wrong format, not as a syntax error deep in the file.
pub(crate) fn json_object_line(
    path: &Path,
    line: usize,
    text: &str,
    format: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, SimError> {
    let wrong = |detail: String| {
        SimError::trace(
            path,
            line,
            "<json>",
            format!(
                "not a JSON object ({detail}): a `{format}` trace has one JSON object per line \
                 (is --format right for this file?)"
            ),
        )
    };
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(obj)) => Ok(obj),
        Ok(_) => Err(wrong("another JSON value".to_owned())),
        Err(e) => Err(wrong(e.to_string())),
    }
}

/// Reads `reader` line by line with a bounded line length, calling `f` with
/// the 1-based line number and the line without its terminator. Blank lines
/// are skipped, and a UTF-8 byte order mark at the start of the file is dropped (spreadsheet
/// exports write one). `f` returns `false` to stop early.
pub(crate) fn for_each_line(
    mut reader: impl BufRead,
    path: &Path,
    mut f: impl FnMut(usize, &str) -> Result<bool, SimError>,
) -> Result<(), SimError> {
    let mut buf = Vec::new();
    let mut line_no = 0usize;
    loop {
        buf.clear();
        line_no += 1;
        let n = Read::take(&mut reader, MAX_LINE_BYTES as u64 + 1)
            .read_until(b'\n', &mut buf)
            .map_err(|e| SimError::io(path, e))?;
        if n == 0 {
            return Ok(());
        }
        if n > MAX_LINE_BYTES {
            return Err(SimError::trace(
                path,
                line_no,
                "<line>",
                format!("line longer than {MAX_LINE_BYTES} bytes"),
            ));
        }
        let text = std::str::from_utf8(&buf)
            .map_err(|_| SimError::trace(path, line_no, "<line>", "not valid UTF-8"))?;
        let text = text.trim_end_matches(['\n', '\r']);
        let text = if line_no == 1 {
            text.strip_prefix('\u{feff}').unwrap_or(text)
        } else {
            text
        };
        if text.trim().is_empty() {
            continue;
        }
        if !f(line_no, text)? {
            return Ok(());
        }
    }
}

/// Checks a prompt length read from a file.
pub(crate) fn check_prompt_len(
    path: &Path,
    line: usize,
    field: &str,
    len: u64,
) -> Result<usize, SimError> {
    if len == 0 || len > MAX_PROMPT_TOKENS as u64 {
        return Err(SimError::trace(
            path,
            line,
            field,
            format!("prompt length {len} outside 1..={MAX_PROMPT_TOKENS}"),
        ));
    }
    Ok(len as usize)
}

/// Checks an output length read from a file.
pub(crate) fn check_output_len(
    path: &Path,
    line: usize,
    field: &str,
    len: u64,
) -> Result<u32, SimError> {
    if len == 0 || len > u64::from(MAX_OUTPUT_TOKENS) {
        return Err(SimError::trace(
            path,
            line,
            field,
            format!("output length {len} outside 1..={MAX_OUTPUT_TOKENS}"),
        ));
    }
    Ok(len as u32)
}

/// Keeps a running total of prompt tokens under [`MAX_TOTAL_PROMPT_TOKENS`].
pub(crate) fn add_total(
    total: &mut usize,
    len: usize,
    path: &Path,
    line: usize,
) -> Result<(), SimError> {
    *total += len;
    if *total > MAX_TOTAL_PROMPT_TOKENS {
        return Err(SimError::trace(
            path,
            line,
            "<trace>",
            format!("trace holds more than {MAX_TOTAL_PROMPT_TOKENS} prompt tokens; use a limit"),
        ));
    }
    Ok(())
}

/// SplitMix64's finaliser (Steele, Lea, Flood 2014): a bijection on u64 with
/// good avalanche, used to derive token ids.
pub(crate) fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A bijection on u32 (xorshift-multiply), so distinct inputs give distinct outputs.
fn mix32(mut x: u32) -> u32 {
    x = (x ^ (x >> 16)).wrapping_mul(0x7feb_352d);
    x = (x ^ (x >> 15)).wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// A prompt of `len` tokens unique to request `index`: token `i` is
/// `base(index) + i * stride` with a bijective `base` and an odd stride, so two
/// requests with different indices differ at every position and never share a
/// prefix block. Costs one add per token.
pub fn unique_prompt(index: u64, len: usize) -> Arc<[u32]> {
    // Fold the high half in so indices beyond u32 stay distinct in practice.
    let base = mix32((index as u32) ^ mix32((index >> 32) as u32 ^ 0x5bd1_e995));
    let mut t = base;
    (0..len)
        .map(|_| {
            let cur = t;
            t = t.wrapping_add(0x9e37_79b9);
            cur
        })
        .collect()
}

/// A weighted label mix, e.g. tiers `{premium: 0.2, standard: 0.5, batch: 0.3}`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LabelMix {
    /// Labels and their (non-negative, not all zero) weights, in a fixed order.
    pub entries: Vec<(String, f64)>,
}

/// Assigns tiers and tenants to requests that lack them, drawing from the
/// weighted mixes with a ChaCha8 generator seeded by `seed` (one stream per
/// label kind, so adding a tenant mix does not change the tier draws).
pub fn assign_mix(
    requests: &mut [TraceRequest],
    tiers: &LabelMix,
    tenants: &LabelMix,
    seed: u64,
) -> Result<(), String> {
    for (mix, stream, is_tier) in [(tiers, 1u64, true), (tenants, 2u64, false)] {
        if mix.entries.is_empty() {
            continue;
        }
        let weights: Vec<f64> = mix.entries.iter().map(|(_, w)| *w).collect();
        // rand's WeightedIndex panics on a sum that overflows to infinity (1e308 twice) rather
        // than returning its error, and words its errors for programmers ("Not enough weights
        // > zero"): both are checked here and told in the spec's terms.
        let sum: f64 = weights.iter().sum();
        let dist = (sum.is_finite() && sum > 0.0)
            .then(|| WeightedIndex::new(&weights).ok())
            .flatten()
            .ok_or_else(|| {
                format!(
                    "{}: weights must be non-negative and add up to a finite number > 0",
                    kind(is_tier)
                )
            })?;
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(stream);
        for r in requests.iter_mut() {
            let label = if is_tier { &mut r.tier } else { &mut r.tenant };
            let pick = dist.sample(&mut rng);
            if label.is_empty() {
                label.clone_from(&mix.entries[pick].0);
            }
        }
    }
    Ok(())
}

/// Gives each request of `requests` without an adapter one of the adapters `1..=weights.len()`
/// (adapter `k` in proportion to `weights[k - 1]`) with probability `fraction`, drawn from
/// `seed` (its own stream: the tier and tenant mixes draw the same as without). A request
/// naming its own adapter keeps it; its draws are made all the same, so the other requests'
/// adapters do not depend on it.
pub fn assign_adapters(
    requests: &mut [TraceRequest],
    weights: &[f64],
    fraction: f64,
    seed: u64,
) -> Result<(), String> {
    let dist = WeightedIndex::new(weights)
        .map_err(|_| "adapters: weights must add up to a finite number > 0".to_string())?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(3);
    for r in requests.iter_mut() {
        // A draw whatever the fraction: the adapters drawn do not depend on it.
        let given = rand::Rng::random::<f64>(&mut rng) < fraction;
        let pick = dist.sample(&mut rng) as u32 + 1;
        if given && r.adapter.is_none() {
            r.adapter = Some(pick);
        }
    }
    Ok(())
}

/// What [`assign_clients`] draws for a trace's closed-loop clients.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ClientDraws {
    /// Mean think time in seconds, for the requests whose record gives none; `None`: none
    /// drawn.
    pub think_s: Option<f64>,
    /// Every think time is `think_s` (else exponential with that mean).
    pub constant: bool,
    /// Each client's requests are all delayed by one draw uniform in `[0, start_jitter_s)`.
    pub start_jitter_s: Option<f64>,
}

/// Gives the requests of a client (`client` not empty) without a `think_s` one drawn as
/// `draws` says, and delays each client's requests by its start jitter, from `seed` (streams
/// of their own: the mixes and adapters draw the same as without); the requests are then
/// sorted by arrival again (ties in their order before), a client's in the same order. A
/// draw is made for each client's request whatever its record gives, so the others' draws
/// do not depend on it. A drawn think time is at most about 37 times the mean (an
/// exponential draw from a 53-bit uniform).
pub fn assign_clients(requests: &mut [TraceRequest], draws: &ClientDraws, seed: u64) {
    if let Some(mean) = draws.think_s {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(4);
        for r in requests.iter_mut().filter(|r| !r.client.is_empty()) {
            let u: f64 = rand::Rng::random(&mut rng);
            let drawn = if draws.constant {
                mean
            } else {
                // 1 - u lies in (0, 1]: the logarithm is finite.
                -mean * (1.0 - u).ln()
            };
            r.think_s.get_or_insert(drawn);
        }
    }
    if let Some(jitter) = draws.start_jitter_s.filter(|&j| j > 0.0) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(5);
        // One draw per client, in the order of their first requests.
        let mut offsets: std::collections::HashMap<String, f64> = Default::default();
        for r in requests.iter_mut().filter(|r| !r.client.is_empty()) {
            let offset = *offsets
                .entry(r.client.clone())
                .or_insert_with(|| jitter * rand::Rng::random::<f64>(&mut rng));
            r.arrival_s += offset;
        }
        // Stable: a client's requests, all moved alike, keep their order.
        requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    }
}

fn kind(is_tier: bool) -> &'static str {
    if is_tier {
        "tiers"
    } else {
        "tenants"
    }
}

/// Rescales arrival times (sorted) so the mean arrival rate becomes `rate` requests/s
/// (inter-arrival gaps keep their shape). No-op for fewer than two requests, which have no
/// rate; an error when every arrival shares one timestamp, since no scaling of a zero-length
/// trace gives it a rate, or when `rate` is not a positive number.
pub fn rescale_to_rate(requests: &mut [TraceRequest], rate: f64) -> Result<(), String> {
    if !(rate.is_finite() && rate > 0.0) {
        return Err(format!(
            "arrival rate {rate} must be a positive number of requests/s"
        ));
    }
    let (Some(first), Some(last)) = (requests.first(), requests.last()) else {
        return Ok(());
    };
    if requests.len() < 2 {
        return Ok(());
    }
    let span = last.arrival_s - first.arrival_s;
    if span.is_nan() || span <= 0.0 {
        return Err(format!(
            "all {} requests arrive at {} s: the trace has no time span to rescale to \
             {rate} requests/s (give the requests distinct arrival times)",
            requests.len(),
            first.arrival_s
        ));
    }
    let current = (requests.len() - 1) as f64 / span;
    scale_time(requests, current / rate);
    Ok(())
}

/// Checks that every arrival (after shaping) is a finite time in `0..=MAX_ARRIVAL_S`, and
/// every think time in `0..=MAX_THINK_S`; otherwise names the first request out of bounds.
pub fn check_arrivals(requests: &[TraceRequest]) -> Result<(), String> {
    if let Some(i) = requests
        .iter()
        .position(|r| !(0.0..=MAX_ARRIVAL_S).contains(&r.arrival_s))
    {
        return Err(format!(
            "request {i} arrives at {} s once the workload is shaped (time_scale, rate, load), \
             past the bound of {MAX_ARRIVAL_S} s (one year): raise the rate or the load, or \
             lower time_scale",
            requests[i].arrival_s
        ));
    }
    if let Some((i, t)) = requests.iter().enumerate().find_map(|(i, r)| {
        r.think_s
            .filter(|t| !(0.0..=MAX_THINK_S).contains(t))
            .map(|t| (i, t))
    }) {
        return Err(format!(
            "request {i}'s think time is {t} s once the workload is shaped (time_scale, rate, \
             load scale the trace's think_s with its arrivals), past the bound of {MAX_THINK_S} \
             s: raise the rate or the load, or lower time_scale"
        ));
    }
    Ok(())
}

/// Multiplies every arrival time (relative to the first) and every think time of the trace
/// by `factor`: the trace's timeline is scaled as a whole.
pub fn scale_time(requests: &mut [TraceRequest], factor: f64) {
    let Some(t0) = requests.first().map(|r| r.arrival_s) else {
        return;
    };
    for r in requests.iter_mut() {
        r.arrival_s = (r.arrival_s - t0) * factor;
        if let Some(t) = &mut r.think_s {
            *t *= factor;
        }
    }
}

/// Mean prompt and output length of a trace (0 for an empty trace).
pub fn mean_lengths(requests: &[TraceRequest]) -> (f64, f64) {
    if requests.is_empty() {
        return (0.0, 0.0);
    }
    let n = requests.len() as f64;
    let p: f64 = requests.iter().map(|r| r.prompt.len() as f64).sum();
    let o: f64 = requests.iter().map(|r| f64::from(r.output_len)).sum();
    (p / n, o / n)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line that is not a JSON object names the format that wanted one and asks whether
    /// --format is right (a CSV read as a Mooncake trace said only "expected value").
    #[test]
    fn a_line_that_is_not_a_json_object_names_the_format() {
        let p = Path::new("t.csv");
        let csv = json_object_line(p, 1, "TIMESTAMP,ContextTokens,GeneratedTokens", "mooncake")
            .unwrap_err()
            .to_string();
        assert!(
            csv.starts_with("t.csv:1: field `<json>`: not a JSON object (expected value")
                && csv.contains("a `mooncake` trace has one JSON object per line")
                && csv.contains("--format"),
            "{csv}"
        );
        let array = json_object_line(p, 2, "[1, 2]", "jsonl")
            .unwrap_err()
            .to_string();
        assert!(
            array.contains("not a JSON object (another JSON value)")
                && array.contains("a `jsonl` trace"),
            "{array}"
        );
        let obj = json_object_line(p, 3, r#"{"timestamp": 1}"#, "mooncake").unwrap();
        assert_eq!(obj["timestamp"], 1);
    }

    /// A CSV trace's header lacking a column is named; one that is a JSON object (a JSON
    /// Lines trace given as a CSV format) asks whether --format is right, as the reverse does.
    #[test]
    fn a_json_lines_trace_given_as_a_csv_format_asks_about_the_format() {
        let p = Path::new("t.jsonl");
        let json = ("{\"arrival_s\": 0", " \"prompt_len\": 4}");
        for fields in [vec![json.0, json.1], vec!["\u{feff}{\"a\": 1}"]] {
            assert_eq!(
                missing_column(p, 1, &fields, "TIMESTAMP", "azure").to_string(),
                "t.jsonl:1: field `TIMESTAMP`: header lacks column `TIMESTAMP` (the line is a \
                 JSON object, not the header of a `azure` CSV: is --format right for this \
                 file? JSON Lines traces are `jsonl` or `mooncake`)"
            );
        }
        assert_eq!(
            missing_column(p, 1, &["a", "b"], "num_prefill_tokens", "sharegpt").to_string(),
            "t.jsonl:1: field `num_prefill_tokens`: header lacks column `num_prefill_tokens`"
        );
    }

    fn req(arrival_s: f64) -> TraceRequest {
        TraceRequest::untagged(arrival_s, unique_prompt(0, 4), 1)
    }

    /// Drawn adapters follow their weights (zipf s = 1 over 3 adapters: 6/11, 3/11, 2/11),
    /// are the same for the same seed, leave a request's own adapter as it is, and `fraction`
    /// leaves the rest without one.
    #[test]
    fn adapters_are_drawn_by_weight_from_the_seed() {
        let n = 22_000;
        let mut rs: Vec<TraceRequest> = (0..n).map(|i| req(i as f64)).collect();
        rs[5].adapter = Some(99);
        let weights = [1.0, 0.5, 1.0 / 3.0];
        assign_adapters(&mut rs, &weights, 1.0, 7).unwrap();
        assert_eq!(rs[5].adapter, Some(99));
        let share = |rs: &[TraceRequest], a: u32| {
            rs.iter().filter(|r| r.adapter == Some(a)).count() as f64 / n as f64
        };
        for (a, p) in [(1, 6.0 / 11.0), (2, 3.0 / 11.0), (3, 2.0 / 11.0)] {
            assert!(
                (share(&rs, a) - p).abs() < 0.01,
                "adapter {a}: {}",
                share(&rs, a)
            );
        }
        let mut again: Vec<TraceRequest> = (0..n).map(|i| req(i as f64)).collect();
        again[5].adapter = Some(99);
        assign_adapters(&mut again, &weights, 1.0, 7).unwrap();
        assert_eq!(again, rs);
        let mut other: Vec<TraceRequest> = (0..n).map(|i| req(i as f64)).collect();
        assign_adapters(&mut other, &weights, 1.0, 8).unwrap();
        assert_ne!(other[..50], rs[..50]);
        let mut some: Vec<TraceRequest> = (0..n).map(|i| req(i as f64)).collect();
        assign_adapters(&mut some, &weights, 0.25, 7).unwrap();
        let given = some.iter().filter(|r| r.adapter.is_some()).count() as f64 / n as f64;
        assert!((given - 0.25).abs() < 0.01, "{given}");
        // The same requests, where they get one, get the same adapter as with fraction 1.
        assert!(some
            .iter()
            .zip(&rs)
            .skip(6)
            .all(|(s, r)| s.adapter.is_none() || s.adapter == r.adapter));
        assert!(assign_adapters(&mut some, &[0.0], 1.0, 7).is_err());
    }

    #[test]
    fn unique_prompts_differ_at_every_position() {
        let a = unique_prompt(1, 64);
        let b = unique_prompt(2, 64);
        assert_eq!(a.len(), 64);
        assert!(a.iter().zip(b.iter()).all(|(x, y)| x != y));
        assert_eq!(unique_prompt(1, 64), a, "deterministic");
    }

    #[test]
    fn mix32_is_injective_on_a_range() {
        let mut v: Vec<u32> = (0..100_000u32).map(mix32).collect();
        v.sort_unstable();
        v.dedup();
        assert_eq!(v.len(), 100_000);
    }

    #[test]
    fn mix_assignment_is_seeded_and_weighted() {
        let mut rs: Vec<TraceRequest> = (0..1000).map(|i| req(f64::from(i))).collect();
        rs[0].tier = "fixed".into();
        let tiers = LabelMix {
            entries: vec![("a".into(), 3.0), ("b".into(), 1.0), ("never".into(), 0.0)],
        };
        assign_mix(&mut rs, &tiers, &LabelMix::default(), 7).unwrap();
        assert_eq!(rs[0].tier, "fixed", "existing labels are kept");
        let a = rs.iter().filter(|r| r.tier == "a").count();
        assert!(
            (650..850).contains(&a),
            "a drawn {a} times of 1000 at weight 3/4"
        );
        assert!(rs.iter().all(|r| r.tier != "never"));
        let mut again: Vec<TraceRequest> = (0..1000).map(|i| req(f64::from(i))).collect();
        again[0].tier = "fixed".into();
        assign_mix(&mut again, &tiers, &LabelMix::default(), 7).unwrap();
        assert_eq!(rs, again);
        let bad = LabelMix {
            entries: vec![("a".into(), 0.0)],
        };
        assert!(assign_mix(&mut again, &bad, &LabelMix::default(), 7).is_err());
        // Each finite, the sum not.
        let huge = LabelMix {
            entries: vec![("a".into(), 1e308), ("b".into(), 1e308)],
        };
        assert!(assign_mix(&mut again, &huge, &LabelMix::default(), 7).is_err());
        assert!(assign_mix(&mut again, &LabelMix::default(), &huge, 7).is_err());
    }

    #[test]
    fn rescale_sets_mean_rate() {
        let mut rs: Vec<TraceRequest> = (0..11).map(|i| req(5.0 + 2.0 * f64::from(i))).collect();
        rescale_to_rate(&mut rs, 2.0).unwrap();
        assert_eq!(rs[0].arrival_s, 0.0);
        assert!((rs[10].arrival_s - 5.0).abs() < 1e-12);
        let mut one = vec![req(3.0)];
        rescale_to_rate(&mut one, 2.0).unwrap();
        assert_eq!(one[0].arrival_s, 3.0, "one request has no rate to change");
        assert!(rescale_to_rate(&mut rs, 0.0).is_err());
        assert!(rescale_to_rate(&mut rs, f64::NAN).is_err());
    }

    #[test]
    fn rescaling_a_trace_without_time_span_is_an_error_not_a_no_op() {
        let mut rs: Vec<TraceRequest> = (0..5).map(|_| req(7.0)).collect();
        let err = rescale_to_rate(&mut rs, 2.0).unwrap_err();
        assert!(err.contains("no time span"), "{err}");
        assert!(rs.iter().all(|r| r.arrival_s == 7.0), "left unchanged");
    }

    #[test]
    fn arrivals_past_the_bound_after_shaping_are_refused() {
        let mut rs: Vec<TraceRequest> = (0..3).map(|i| req(f64::from(i))).collect();
        check_arrivals(&rs).unwrap();
        rs[2].arrival_s = MAX_ARRIVAL_S;
        check_arrivals(&rs).unwrap();
        // A tiny rate or a huge time scale pushes arrivals past the bound, to infinity, or
        // (0 * inf) to NaN.
        for bad in [MAX_ARRIVAL_S * 1.01, 1e300, f64::INFINITY, f64::NAN] {
            rs[2].arrival_s = bad;
            let err = check_arrivals(&rs).unwrap_err();
            assert!(err.starts_with("request 2 arrives at"), "{err}");
        }
        let mut far: Vec<TraceRequest> = (0..3).map(|i| req(f64::from(i))).collect();
        scale_time(&mut far, 1e300);
        assert!(check_arrivals(&far).is_err());
        let mut slow: Vec<TraceRequest> = (0..3).map(|i| req(f64::from(i))).collect();
        rescale_to_rate(&mut slow, 1e-10).unwrap();
        assert!(check_arrivals(&slow).is_err());
    }

    /// A stream's bound is an error once passed, never a trace silently cut short; a stream
    /// of exactly the bound reads whole.
    #[test]
    fn a_stream_past_its_bound_fails() {
        let text = b"{\"arrival_s\": 0}\n".repeat(10);
        let mut whole = Vec::new();
        Bounded::new(&text[..], text.len() as u64)
            .read_to_end(&mut whole)
            .unwrap();
        assert_eq!(whole, text);
        let mut cut = Vec::new();
        let err = Bounded::new(&text[..], text.len() as u64 - 1)
            .read_to_end(&mut cut)
            .unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("at most {} bytes", text.len() - 1)),
            "{err}"
        );
        // Through the line reader, as a loader reads: the error names the path.
        let reader = std::io::BufReader::new(Bounded::new(&text[..], 40));
        let mut lines = 0;
        let err = for_each_line(reader, Path::new("/dev/stdin"), |_, _| {
            lines += 1;
            Ok(true)
        })
        .unwrap_err()
        .to_string();
        assert!(err.starts_with("/dev/stdin: "), "{err}");
        assert!(lines <= 2, "{lines}");
        // An endless stream ends at the bound.
        let err = std::io::BufReader::new(Bounded::new(std::io::repeat(b'\n'), 1 << 20))
            .read_to_end(&mut Vec::new())
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_directory_is_refused_as_a_trace_and_a_file_is_read_whole() {
        let dir = crate::scratch::ScratchDir::new("trace-open");
        let err = open_trace(dir.path()).unwrap_err().to_string();
        assert!(err.contains("is a directory, not a trace"), "{err}");
        let file = dir.path().join("t.jsonl");
        std::fs::write(&file, "x\n").unwrap();
        let mut text = String::new();
        open_trace(&file)
            .unwrap()
            .read_to_string(&mut text)
            .unwrap();
        assert_eq!(text, "x\n");
        let missing = dir.path().join("missing");
        let err = open_trace(&missing).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!(
                "{}: the trace cannot be opened: ",
                missing.display()
            )),
            "{err}"
        );
    }

    /// A think time is scaled with the arrivals (time_scale, rate, load) and bounded after.
    #[test]
    fn think_times_scale_with_the_trace_and_are_bounded() {
        let mut rs: Vec<TraceRequest> = (0..3).map(|i| req(f64::from(i))).collect();
        rs[1].think_s = Some(2.0);
        scale_time(&mut rs, 0.5);
        assert_eq!(rs[1].think_s, Some(1.0));
        assert_eq!(rs[2].arrival_s, 1.0);
        check_arrivals(&rs).unwrap();
        scale_time(&mut rs, 1e4);
        let err = check_arrivals(&rs).unwrap_err();
        assert!(
            err.starts_with("request 1's think time is 10000 s"),
            "{err}"
        );
    }

    /// Drawn think times fill only the clients' requests without one, exponential about the
    /// mean; the start jitter moves a client's requests together.
    #[test]
    fn client_draws_fill_what_the_trace_leaves() {
        let mut rs: Vec<TraceRequest> = (0..20_000)
            .map(|i| TraceRequest {
                client: format!("c{}", i % 100),
                ..req(f64::from(i / 100))
            })
            .collect();
        rs[7].think_s = Some(9.0);
        rs[8].client.clear();
        let draws = ClientDraws {
            think_s: Some(2.0),
            constant: false,
            start_jitter_s: None,
        };
        assign_clients(&mut rs, &draws, 3);
        assert_eq!((rs[7].think_s, rs[8].think_s), (Some(9.0), None));
        let drawn: Vec<f64> = rs.iter().filter_map(|r| r.think_s).collect();
        let mean = drawn.iter().sum::<f64>() / drawn.len() as f64;
        assert!((mean - 2.0).abs() < 0.1, "{mean}");
        let above = drawn.iter().filter(|&&t| t > 2.0).count() as f64 / drawn.len() as f64;
        assert!((above - (-1.0f64).exp()).abs() < 0.02, "{above}");
        let before: Vec<(String, f64)> =
            rs.iter().map(|r| (r.client.clone(), r.arrival_s)).collect();
        let jitter = ClientDraws {
            think_s: None,
            constant: false,
            start_jitter_s: Some(5.0),
        };
        assign_clients(&mut rs, &jitter, 3);
        assert!(rs.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
        let shift = |c: &str, rs: &[(String, f64)]| -> Vec<f64> {
            rs.iter().filter(|r| r.0 == c).map(|r| r.1).collect()
        };
        let after: Vec<(String, f64)> =
            rs.iter().map(|r| (r.client.clone(), r.arrival_s)).collect();
        for c in ["c1", "c50"] {
            let (b, a) = (shift(c, &before), shift(c, &after));
            let d = a[0] - b[0];
            assert!((0.0..5.0).contains(&d), "{d}");
            assert!(a.iter().zip(&b).all(|(a, b)| (a - b - d).abs() < 1e-9));
        }
        // The request without a client is not moved.
        assert!(after.contains(&(String::new(), 0.0)));
    }

    #[test]
    fn long_lines_and_bad_utf8_are_errors() {
        let path = Path::new("x");
        let long = vec![b'a'; MAX_LINE_BYTES + 10];
        let err = for_each_line(&long[..], path, |_, _| Ok(true)).unwrap_err();
        assert!(err.to_string().contains("x:1:"), "{err}");
        let bad = b"ok\n\xff\xfe\n";
        let err = for_each_line(&bad[..], path, |_, _| Ok(true)).unwrap_err();
        assert!(err.to_string().starts_with("x:2:"), "{err}");
    }
}
