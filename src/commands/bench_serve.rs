//! `switchyard bench serve`: a load generator for any OpenAI-compatible server (ours,
//! llama-server, vLLM). Streams completions, timestamps every chunk, and prints the labels
//! `vllm bench serve` prints; `--result-file` writes the same figures as JSON. With
//! `--endpoint embeddings` it sends the same prompts' token ids to `/v1/embeddings` instead
//! (`embeddings`), one prompt or `--embedding-batch` of them a request.
//!
//! A fixed pool of threads, one per request in flight, sends the requests through the
//! HTTP/1.1 client in `http` (plain, or TLS verified against `--cacert`) on kept-alive
//! connections they share, as vLLM's client does: the generator must not be the bottleneck at
//! the concurrencies a single server sees.

mod embeddings;
mod http;

use std::io::Read;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use crossbeam::channel;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::json;
use switchyard_simulator::progress::{format_seconds, Progress};
use switchyard_simulator::report::percentile;
use switchyard_simulator::spec::{short_number, show_range, RATE_RANGE, TIME_SCALE_RANGE};
use switchyard_simulator::trace::{MAX_ARRIVAL_S, MAX_REQUESTS as MAX_ROWS};

use self::embeddings::MAX_EMBEDDING_BATCH;
use self::http::{first_model, one_request, parse_url, Pool, Target, MAX_SMALL_RESPONSE_BYTES};
use super::mooncake::{self, MooncakeRow, RowShape, TokenSpace, TraceReuse};
use crate::cli::{ServeBenchArgs, ServeDataset, ServeEndpoint};

/// Most prompts in one run.
const MAX_PROMPTS: usize = 1_000_000;
/// Most warmup requests.
const MAX_WARMUPS: usize = 10_000;
/// Longest prompt or output of one request, in tokens (`--input-len`, `--max-input-len`, ...).
pub(super) const MAX_REQUEST_TOKENS: usize = 1 << 20;
/// Requests in flight (threads) without `--max-concurrency`.
const DEFAULT_IN_FLIGHT: usize = 1024;
/// Largest `--max-concurrency`.
const MAX_IN_FLIGHT: usize = 16_384;
/// Largest dataset file read, in bytes.
pub(super) const MAX_DATASET_BYTES: u64 = 1 << 30;
/// Longest expected arrival span of a run started without `--allow-long-run`, in seconds (24
/// hours): a benchmark is minutes, a soak test hours; days are a mistyped rate.
const MAX_ARRIVAL_SPAN_S: f64 = 24.0 * 3600.0;
/// Expected arrival spans from this long up are announced before the run, in seconds.
const ANNOUNCED_ARRIVAL_SPAN_S: f64 = 60.0;

/// One request's measurements.
#[derive(Debug, Clone, Default)]
struct Sample {
    ok: bool,
    error: String,
    prompt_tokens: usize,
    output_tokens: usize,
    ttft: f64,
    itl: Vec<f64>,
    latency: f64,
    /// The server sent no `usage`: `output_tokens` counts the streamed chunks with a choice
    /// (an embeddings request: `prompt_tokens` counts the ids sent).
    usage_missing: bool,
    /// Prompts the request carried (1 for a completion).
    inputs: usize,
    /// The length of the vectors of a successful embeddings request.
    dimension: usize,
    /// The prompt tokens the server's prefix cache served, where its `usage` says
    /// (`prompt_tokens_details.cached_tokens`).
    cached_tokens: Option<usize>,
    /// When it was sent (issued, before a connection was taken or opened for it, as vLLM's
    /// clock starts), where it was.
    sent: Option<Instant>,
    /// Seconds from when it was due to when a thread took it: its wait for a free thread at
    /// `--max-concurrency` (vLLM's client queue time; a connection's set-up after it, where no
    /// kept-alive one was idle, counts in its latencies, as in vLLM's).
    queued: f64,
}

/// The results of a run so far, counted on its progress (bar or lines).
struct Finished {
    /// The finished requests' measurements.
    samples: Vec<Sample>,
    /// Requests sent and not yet finished.
    in_flight: usize,
    /// Finished (and failed) requests of the total, on stderr.
    progress: Progress,
}

impl Finished {
    /// Records a finished request.
    fn push(&mut self, sample: Sample) {
        if sample.ok {
            self.progress.inc(1);
        } else {
            self.progress.inc_failed();
        }
        self.samples.push(sample);
        self.in_flight -= 1;
    }

    /// Records the requests that finish until `until` (those already finished if it has
    /// passed); returns then.
    fn collect_until(
        &mut self,
        rx: &channel::Receiver<Sample>,
        until: Instant,
    ) -> anyhow::Result<()> {
        while self.in_flight > 0 {
            match rx.recv_deadline(until) {
                Ok(sample) => self.push(sample),
                Err(channel::RecvTimeoutError::Timeout) => break,
                Err(channel::RecvTimeoutError::Disconnected) => {
                    anyhow::bail!("benchmark threads vanished")
                }
            }
        }
        // Nothing in flight: wait out the arrival all the same.
        let left = until.saturating_duration_since(Instant::now());
        if !left.is_zero() {
            std::thread::sleep(left);
        }
        Ok(())
    }
}

/// Refuses arguments the run cannot honour, before anything is sent.
fn validate(args: &ServeBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (1..=MAX_PROMPTS).contains(&args.num_prompts),
        "--num-prompts must be 1..={MAX_PROMPTS}"
    );
    anyhow::ensure!(
        args.num_warmups <= MAX_WARMUPS,
        "--num-warmups must be 0..={MAX_WARMUPS}"
    );
    for (name, v) in [
        ("--input-len", args.input_len),
        ("--output-len", args.output_len),
        ("--max-input-len", args.max_input_len),
        ("--max-output-len", args.max_output_len),
    ] {
        anyhow::ensure!(
            (1..=MAX_REQUEST_TOKENS).contains(&v),
            "{name} must be 1..={MAX_REQUEST_TOKENS}, not {v}"
        );
    }
    anyhow::ensure!(
        args.lora_modules.len() <= MAX_LORA_MODULES,
        "--lora-modules takes at most {MAX_LORA_MODULES} names, not {}",
        args.lora_modules.len()
    );
    if let Some(bad) = args
        .lora_modules
        .iter()
        .find(|m| m.is_empty() || m.len() > MAX_MODEL_NAME_BYTES)
    {
        anyhow::bail!(
            "--lora-modules: `{}` is not a model name (1 to {MAX_MODEL_NAME_BYTES} bytes)",
            bad.chars().take(64).collect::<String>()
        );
    }
    if let Some(c) = args.max_concurrency {
        anyhow::ensure!(
            (1..=MAX_IN_FLIGHT).contains(&c),
            "--max-concurrency must be 1..={MAX_IN_FLIGHT}, not {c}"
        );
    }
    if let Some(r) = args.request_rate {
        // NaN fails the comparison too; `inf` means every request at once, as in vLLM. Below
        // the range, the arrivals of a run would be years apart (and past what a sleep takes).
        anyhow::ensure!(
            r == f64::INFINITY || RATE_RANGE.contains(&r),
            "--request-rate {} outside {} requests/s (inf sends every request at once)",
            short_number(r),
            show_range(&RATE_RANGE)
        );
    }
    if let Some(b) = args.burstiness {
        anyhow::ensure!(
            b == f64::INFINITY || BURSTINESS_RANGE.contains(&b),
            "--burstiness {} outside {} (or inf: evenly spaced arrivals)",
            short_number(b),
            show_range(&BURSTINESS_RANGE)
        );
        anyhow::ensure!(
            args.request_rate.is_some_and(f64::is_finite) && !replays_times(args.dataset),
            "--burstiness shapes the arrivals of a finite --request-rate (the trace and mooncake \
             datasets keep their own times)"
        );
    }
    Goodput::parse(&args.goodput)?;
    Selection::parse(args)?;
    anyhow::ensure!(
        TIME_SCALE_RANGE.contains(&args.time_scale),
        "--time-scale {} outside {} (it divides the trace's arrival times: 2 = twice as fast)",
        short_number(args.time_scale),
        show_range(&TIME_SCALE_RANGE)
    );
    mooncake::check_flags(
        args.dataset == ServeDataset::Mooncake,
        args.mooncake.mooncake_block_tokens,
        args.mooncake.skip_rows,
        &[],
    )?;
    anyhow::ensure!(
        args.token_offset.checked_add(args.token_range).is_some(),
        "--token-offset + --token-range must not exceed {} (token ids are u32)",
        u32::MAX
    );
    if let Some(b) = args.embedding_batch {
        anyhow::ensure!(
            args.endpoint == ServeEndpoint::Embeddings,
            "--embedding-batch needs --endpoint embeddings (a completion request carries one \
             prompt)"
        );
        anyhow::ensure!(
            (1..=MAX_EMBEDDING_BATCH).contains(&b),
            "--embedding-batch must be 1..={MAX_EMBEDDING_BATCH}, not {b}"
        );
        // The longest prompt times the prompts of a request: the ids one request carries.
        let (name, longest) = match args.dataset {
            ServeDataset::Random => ("--input-len", args.input_len),
            ServeDataset::Sharegpt | ServeDataset::Trace | ServeDataset::Mooncake => {
                ("--max-input-len", args.max_input_len)
            }
        };
        anyhow::ensure!(
            b.saturating_mul(longest) <= MAX_REQUEST_TOKENS,
            "--embedding-batch {b} of prompts of up to {longest} tokens ({name}) is more than \
             {MAX_REQUEST_TOKENS} tokens in one request: lower one of them"
        );
    }
    Ok(())
}

/// One request of a run: its prompts' lengths (one for a completion, up to
/// `--embedding-batch` for embeddings), its output length and, if the dataset has arrival
/// times, its arrival offset in seconds.
#[derive(Debug, Clone, PartialEq)]
struct Planned {
    /// Prompt tokens of each prompt.
    inputs: Vec<usize>,
    /// Output tokens (a completion's; ignored by embeddings).
    output: usize,
    /// Seconds after the first arrival of the dataset, if it has times.
    at: Option<f64>,
    /// Each prompt's hash ids, where its tokens are the trace's blocks (the mooncake
    /// dataset); `None`: random tokens.
    blocks: Vec<Option<Arc<[u64]>>>,
}

impl Planned {
    /// The same request with random prompts of the same lengths: the test request's and the
    /// warmups', which must not put the run's blocks in the server's cache.
    fn unshared(&self) -> Planned {
        Planned {
            blocks: vec![None; self.inputs.len()],
            ..self.clone()
        }
    }
}

/// One prompt of the workload.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    /// Prompt tokens.
    input: usize,
    /// Output tokens.
    output: usize,
    /// Seconds after the first arrival of the dataset, if it has times.
    at: Option<f64>,
    /// The hash ids of its blocks (the mooncake dataset; `None`: random tokens).
    blocks: Option<Arc<[u64]>>,
}

impl Row {
    /// A prompt of random tokens.
    fn random(input: usize, output: usize, at: Option<f64>) -> Row {
        Row {
            input,
            output,
            at,
            blocks: None,
        }
    }
}

impl From<MooncakeRow> for Row {
    fn from(r: MooncakeRow) -> Row {
        Row {
            input: r.input,
            output: r.output,
            at: Some(r.at),
            blocks: r.hash_ids,
        }
    }
}

/// The run's requests: the workload's prompts one a request, or for embeddings in groups
/// of `--embedding-batch` (the last one smaller where it does not divide). A group arrives
/// with its last prompt: a client that batches sends once it holds the whole batch.
fn plan(args: &ServeBenchArgs, work: &[Row]) -> Vec<Planned> {
    // `validate` keeps the batch at 1 or more, so `chunks` cannot panic.
    work.chunks(args.embedding_batch.unwrap_or(1).max(1))
        .map(|group| Planned {
            inputs: group.iter().map(|w| w.input).collect(),
            output: group[0].output,
            at: group.iter().filter_map(|w| w.at).reduce(f64::max),
            blocks: group.iter().map(|w| w.blocks.clone()).collect(),
        })
        .collect()
}

/// Whether the dataset replays its own arrival times.
fn replays_times(dataset: ServeDataset) -> bool {
    matches!(dataset, ServeDataset::Trace | ServeDataset::Mooncake)
}

/// The time over which the run's requests arrive, in seconds: the trace's last arrival over
/// `--time-scale`, or at a `--request-rate` `n / rate` for its `n` requests (the last one's
/// time, see [`arrival_times`]); 0 when every request goes at once. The run lasts at least
/// this long.
fn arrival_span_s(args: &ServeBenchArgs, work: &[Planned]) -> f64 {
    let trace_last = work.iter().filter_map(|w| w.at).reduce(f64::max);
    match (trace_last, args.request_rate) {
        (Some(t), _) => t / args.time_scale,
        (None, Some(rate)) if rate.is_finite() => work.len() as f64 / rate,
        _ => 0.0,
    }
}

/// The `--request-rate` that paces the arrivals: a finite one, with a dataset without times
/// of its own.
fn paced_rate(args: &ServeBenchArgs) -> Option<f64> {
    args.request_rate
        .filter(|r| r.is_finite() && !replays_times(args.dataset))
}

/// Most and least `--burstiness` (besides `inf`): the Gamma shape of the arrival gaps.
const BURSTINESS_RANGE: std::ops::RangeInclusive<f64> = 1e-3..=1e3;

/// The arrival times of `n` requests at `rate` requests/s, in seconds after the start, as
/// vLLM's `get_request` makes them: each request's gap before it (the first one's too) is
/// drawn from a Gamma distribution of shape `burstiness` and mean `1 / rate` (exponential:
/// a Poisson process, at burstiness 1; `1 / rate` each at `inf`), the times are their running
/// sums, and they are scaled so that the last is `n / rate` exactly (vLLM: "to close the
/// gap" of 1-2 % a sum of random gaps leaves, "for stabilizing the throughput data from
/// different random seeds"). All 0 at an infinite rate.
fn arrival_times(n: usize, rate: f64, burstiness: f64, rng: &mut ChaCha8Rng) -> Vec<f64> {
    use rand_distr::{Distribution, Gamma};
    if !rate.is_finite() || n == 0 {
        return vec![0.0; n];
    }
    let gamma = (burstiness.is_finite())
        .then(|| Gamma::new(burstiness, 1.0 / (rate * burstiness)).ok())
        .flatten();
    let mut t = 0.0;
    let mut times: Vec<f64> = (0..n)
        .map(|_| {
            t += match &gamma {
                Some(g) => g.sample(rng),
                None => 1.0 / rate,
            };
            t
        })
        .collect();
    let last = times[n - 1];
    if last > 0.0 && last.is_finite() {
        let scale = n as f64 / rate / last;
        for t in &mut times {
            *t *= scale;
        }
    }
    times
}

/// vLLM's `--goodput` objectives, in seconds: a successful request is good when its TTFT,
/// TPOT and E2E latency are each at most the objective given for it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Goodput {
    ttft: Option<f64>,
    tpot: Option<f64>,
    e2el: Option<f64>,
}

/// Largest `--goodput` objective, in milliseconds (a year).
const MAX_SLO_MS: f64 = 365.0 * 86_400.0 * 1e3;

impl Goodput {
    /// The objectives of `--goodput`'s `KEY:MS` pairs; `None` without any.
    fn parse(pairs: &[String]) -> anyhow::Result<Option<Goodput>> {
        if pairs.is_empty() {
            return Ok(None);
        }
        let mut g = Goodput::default();
        for pair in pairs {
            let shown: String = pair.chars().take(64).collect();
            let (key, ms) = pair.split_once(':').with_context(|| {
                format!("--goodput `{shown}`: expected KEY:MILLISECONDS, KEY ttft, tpot or e2el")
            })?;
            let ms: f64 = ms
                .trim()
                .parse()
                .ok()
                .filter(|ms: &f64| (0.0..=MAX_SLO_MS).contains(ms))
                .with_context(|| {
                    format!("--goodput `{shown}`: the objective must be 0 to {MAX_SLO_MS} ms")
                })?;
            let slot = match key.trim() {
                "ttft" => &mut g.ttft,
                "tpot" => &mut g.tpot,
                "e2el" => &mut g.e2el,
                _ => anyhow::bail!("--goodput `{shown}`: KEY must be ttft, tpot or e2el"),
            };
            anyhow::ensure!(
                slot.is_none(),
                "--goodput `{shown}`: {} given twice",
                key.trim()
            );
            *slot = Some(ms / 1e3);
        }
        Ok(Some(g))
    }

    /// Whether a successful request meets every objective: as vLLM's, a value equal to its
    /// objective meets it, and a request of one output token (no TPOT) has a TPOT of 0.
    fn met(&self, s: &Sample) -> bool {
        let within = |slo: Option<f64>, v: f64| slo.is_none_or(|slo| v <= slo);
        within(self.ttft, s.ttft)
            && within(self.tpot, tpot(s).unwrap_or(0.0))
            && within(self.e2el, s.latency)
    }
}

/// A successful request's time per output token after the first, vLLM's `(latency - ttft) /
/// (output tokens - 1)`; `None` for one of a single output token.
fn tpot(s: &Sample) -> Option<f64> {
    (s.output_tokens > 1).then(|| (s.latency - s.ttft) / (s.output_tokens - 1) as f64)
}

/// Refuses a run whose arrivals would span more than [`MAX_ARRIVAL_SPAN_S`] unless
/// `--allow-long-run`, naming the flags that set the span.
fn check_arrival_span(args: &ServeBenchArgs, span_s: f64) -> anyhow::Result<()> {
    if span_s <= MAX_ARRIVAL_SPAN_S || args.allow_long_run {
        return Ok(());
    }
    let (what, fix) = if replays_times(args.dataset) {
        (
            format!(
                "the trace's first {} arrivals at --time-scale {} span",
                args.num_prompts,
                short_number(args.time_scale)
            ),
            "raise --time-scale or lower --num-prompts",
        )
    } else {
        let batch = match args.embedding_batch {
            Some(b) if b > 1 => format!(" (in requests of --embedding-batch {b})"),
            _ => String::new(),
        };
        (
            format!(
                "--num-prompts {}{batch} at --request-rate {} requests/s spaces the arrivals \
                 over about",
                args.num_prompts,
                short_number(args.request_rate.unwrap_or(f64::INFINITY))
            ),
            "raise --request-rate or lower --num-prompts",
        )
    };
    anyhow::bail!(
        "{what} {}, and the run lasts at least that long: {fix}, or pass --allow-long-run to \
         start a run of more than {} hours anyway",
        format_seconds(span_s),
        MAX_ARRIVAL_SPAN_S / 3600.0
    )
}

/// Reads a text file of at most `max` bytes; a larger one is an error, not a truncation.
pub(super) fn read_bounded(path: &Path, max: u64) -> anyhow::Result<String> {
    read_dataset(path, max, None)
}

/// How a dataset file must begin, checked as soon as enough of it has been read, so that
/// a file that cannot be the dataset (`/dev/zero`, a binary, a file of another kind) is
/// refused at once rather than after up to [`MAX_DATASET_BYTES`] of it.
#[derive(Clone, Copy, Debug)]
pub(super) enum DatasetStart<'a> {
    /// A CSV whose header (the first line, a byte order mark aside) has these columns.
    Csv(&'a [&'a str]),
    /// A Mooncake trace read with `--skip-rows skip_rows`: the first row
    /// [`mooncake::read_rows`] reads begins with `{` ([`mooncake::FirstRowCheck`]).
    Mooncake {
        /// Rows counted, not read, before the first one read.
        skip_rows: usize,
    },
}

/// Longest CSV header read before a file without one (no line end yet) is refused.
const MAX_CSV_HEADER_BYTES: usize = 1 << 20;

/// [`read_bounded`], read in pieces, and for a dataset (`start`) refused as soon as its
/// beginning is not what `start` says (the header line's columns, a JSON object), naming the
/// file and what is wrong. Pipes (`/dev/stdin`) are read as files are.
pub(super) fn read_dataset(
    path: &Path,
    max: u64,
    start: Option<DatasetStart>,
) -> anyhow::Result<String> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut bytes = Vec::new();
    let mut checked = start.is_none();
    // A trace's check keeps its place between pieces: each byte is looked at once.
    let mut first_row = match start {
        Some(DatasetStart::Mooncake { skip_rows }) => Some(mooncake::FirstRowCheck::new(skip_rows)),
        _ => None,
    };
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match file.read(&mut chunk) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
        };
        bytes.extend_from_slice(&chunk[..n]);
        // The size before the text: the bound may fall inside a character of several bytes.
        anyhow::ensure!(
            bytes.len() as u64 <= max,
            "{} is larger than {max} bytes",
            path.display()
        );
        if !checked {
            checked = match (&mut first_row, start) {
                (Some(check), _) => check.check(path, &bytes, n == 0)?,
                (None, Some(DatasetStart::Csv(names))) => {
                    check_csv_header(path, &bytes, names, n == 0)?
                }
                (None, _) => true,
            };
        }
        if n == 0 {
            break;
        }
    }
    String::from_utf8(bytes).with_context(|| format!("reading {}: not UTF-8 text", path.display()))
}

/// Whether the header of the CSV dataset at `path`, of which `bytes` is the beginning, has
/// been checked to hold the columns `names` (false: more must be read to tell; `all` says
/// there is no more); an error if it cannot be the dataset.
fn check_csv_header(path: &Path, bytes: &[u8], names: &[&str], all: bool) -> anyhow::Result<bool> {
    let bytes = bytes.strip_prefix("\u{feff}".as_bytes()).unwrap_or(bytes);
    let header = match bytes.iter().position(|&b| b == b'\n') {
        Some(end) => &bytes[..end],
        None if all => bytes,
        None => {
            anyhow::ensure!(
                bytes.len() <= MAX_CSV_HEADER_BYTES,
                "{}: not a CSV file: no line end in its first {MAX_CSV_HEADER_BYTES} \
                 bytes, so it has no header line",
                path.display()
            );
            return Ok(false);
        }
    };
    let header = std::str::from_utf8(header).map_err(|_| {
        anyhow::anyhow!(
            "{}: not a CSV file: its header line is not UTF-8 text",
            path.display()
        )
    })?;
    csv_columns(path, header, names)?;
    Ok(true)
}

/// The run's prompts: their lengths, outputs, arrival offsets (if the dataset has them) and
/// blocks (mooncake).
fn workload(args: &ServeBenchArgs, rng: &mut ChaCha8Rng) -> anyhow::Result<Vec<Row>> {
    let n = args.num_prompts;
    match args.dataset {
        ServeDataset::Random => Ok(vec![Row::random(args.input_len, args.output_len, None); n]),
        ServeDataset::Mooncake => {
            let path = args
                .dataset_path
                .clone()
                .context("--dataset-path is required for the mooncake dataset")?;
            let skip_rows = args.mooncake.skip_rows;
            let start = DatasetStart::Mooncake { skip_rows };
            let text = read_dataset(&path, MAX_DATASET_BYTES, Some(start))?;
            let rows = mooncake::read_rows(&path, &text, row_shape(args), skip_rows, n)?;
            Ok(rows.into_iter().map(Row::from).collect())
        }
        ServeDataset::Sharegpt | ServeDataset::Trace => {
            let path = args
                .dataset_path
                .clone()
                .context("--dataset-path is required for sharegpt and trace datasets")?;
            let names: &[&str] = if args.dataset == ServeDataset::Sharegpt {
                &["num_prefill_tokens", "num_decode_tokens"]
            } else {
                &["ContextTokens", "GeneratedTokens", "TIMESTAMP"]
            };
            let text = read_dataset(&path, MAX_DATASET_BYTES, Some(DatasetStart::Csv(names)))?;
            let (text, c) = csv_columns(&path, &text, names)?;
            let (prompt_col, output_col, ts_col) = (c[0], c[1], c.get(2).copied());
            let header: Vec<&str> = text
                .lines()
                .next()
                .unwrap_or_default()
                .split(',')
                .map(str::trim)
                .collect();
            let mut rows = Vec::new();
            let mut first_ts: Option<f64> = None;
            for (i, line) in text.lines().enumerate().skip(1) {
                let f: Vec<&str> = line.split(',').collect();
                let num = |k: usize| -> anyhow::Result<usize> {
                    f.get(k)
                        .and_then(|v| v.trim().parse().ok())
                        .with_context(|| {
                            format!("{}:{}: field {}", path.display(), i + 1, header[k])
                        })
                };
                let at = match ts_col {
                    None => None,
                    Some(k) => {
                        let ts = f.get(k).and_then(|t| parse_clock(t)).with_context(|| {
                            format!("{}:{}: field TIMESTAMP", path.display(), i + 1)
                        })?;
                        Some(ts - *first_ts.get_or_insert(ts))
                    }
                };
                // A timestamp years after the first would have the replay sleep that long.
                if let Some(t) = at.filter(|&t| t > MAX_ARRIVAL_S) {
                    anyhow::bail!(
                        "{}:{}: TIMESTAMP {t:.0} s after the first row's; at most a year \
                         ({MAX_ARRIVAL_S:.0} s) is replayed",
                        path.display(),
                        i + 1
                    );
                }
                anyhow::ensure!(
                    rows.len() < MAX_ROWS,
                    "{}: more than {MAX_ROWS} rows",
                    path.display()
                );
                rows.push((num(prompt_col)?, num(output_col)?, at));
                if args.dataset == ServeDataset::Trace && rows.len() >= n {
                    break;
                }
            }
            anyhow::ensure!(!rows.is_empty(), "{} has no rows", path.display());
            // `validate` keeps both maxima at 1 or more, so the clamps cannot panic.
            let rows: Vec<_> = rows
                .into_iter()
                .map(|(p, o, t)| {
                    Row::random(
                        p.clamp(1, args.max_input_len),
                        o.clamp(1, args.max_output_len),
                        t,
                    )
                })
                .collect();
            if args.dataset == ServeDataset::Trace {
                return Ok(rows);
            }
            Ok((0..n)
                .map(|_| rows[rng.random_range(0..rows.len())].clone())
                .collect())
        }
    }
}

/// How the mooncake dataset's rows become requests, from the arguments.
fn row_shape(args: &ServeBenchArgs) -> RowShape {
    RowShape {
        block_tokens: args.mooncake.block_tokens(),
        max_input: args.max_input_len,
        max_output: args.max_output_len,
        max_row_tokens: MAX_REQUEST_TOKENS,
        max_total_ids: mooncake::MAX_TOTAL_HASH_IDS,
    }
}

/// Where the mooncake dataset's block tokens are drawn, from the arguments.
fn token_space(args: &ServeBenchArgs) -> TokenSpace {
    TokenSpace {
        seed: args.seed,
        offset: args.token_offset,
        range: args.token_range,
    }
}

/// `text` without a leading byte-order mark, and the positions of the columns `names` in its
/// header line: a dataset's columns are found by name, in any order (as the simulator reads
/// these files).
pub(super) fn csv_columns<'t>(
    path: &Path,
    text: &'t str,
    names: &[&str],
) -> anyhow::Result<(&'t str, Vec<usize>)> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let header: Vec<&str> = text
        .lines()
        .next()
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .collect();
    let columns = names
        .iter()
        .map(|&name| {
            header
                .iter()
                .position(|h| *h == name)
                .with_context(|| format!("{}: the header has no column {name}", path.display()))
        })
        .collect::<anyhow::Result<_>>()?;
    Ok((text, columns))
}

/// Seconds since 1970-01-01 (UTC assumed) of a `YYYY-MM-DD HH:MM:SS[.fffffff]` wall-clock
/// time: the whole timestamp, so a trace that crosses midnight keeps its arrivals in order
/// (the simulator's Azure reader's parser, on the trimmed field).
fn parse_clock(ts: &str) -> Option<f64> {
    switchyard_simulator::trace::parse_timestamp(ts.trim())
}

/// One request for a worker thread: its JSON body and its prompts' lengths.
struct Job {
    /// The `/v1/completions` or `/v1/embeddings` request body.
    body: String,
    /// Prompt tokens, of all its prompts.
    input: usize,
    /// Prompts (an embeddings request's inputs; 1 for a completion).
    inputs: usize,
    /// The length every vector of an embeddings answer must have: the test request's, once
    /// it is known.
    dimension: Option<usize>,
    /// When it was due: its arrival, from which a request that waits for a free thread (at
    /// `--max-concurrency`) counts its client queue time.
    due: Instant,
}

/// The job of one planned request, its prompts drawn from `rng`: a streamed completion of
/// its one prompt, or the embeddings of all its prompts.
fn job(
    args: &ServeBenchArgs,
    model: &str,
    planned: &Planned,
    rng: &mut ChaCha8Rng,
    dimension: Option<usize>,
) -> Job {
    let prompts: Vec<Vec<u32>> = planned
        .inputs
        .iter()
        .zip(&planned.blocks)
        .map(|(&n, blocks)| match blocks {
            Some(ids) => {
                mooncake::block_prompt(ids, n, args.mooncake.block_tokens(), token_space(args), rng)
            }
            None => random_prompt(args, n, rng),
        })
        .collect();
    let body = match args.endpoint {
        ServeEndpoint::Completions => request_body(model, &prompts[0], planned.output, args),
        ServeEndpoint::Embeddings => embeddings::request_body(model, &prompts),
    };
    Job {
        body,
        input: planned.inputs.iter().sum(),
        inputs: planned.inputs.len(),
        dimension,
        due: Instant::now(),
    }
}

/// Starts `n` threads that send the jobs given to the returned sender, one at a time each, and
/// report every sample on the returned receiver; they end once the sender is dropped. The jobs
/// go through one multi-consumer queue (crossbeam's channel): an idle worker takes the next.
fn spawn_workers(
    n: usize,
    target: &Target,
    endpoint: ServeEndpoint,
    key: Option<&str>,
) -> anyhow::Result<(channel::Sender<Job>, channel::Receiver<Sample>)> {
    let path = match endpoint {
        ServeEndpoint::Completions => format!("{}/v1/completions", target.prefix),
        ServeEndpoint::Embeddings => format!("{}/v1/embeddings", target.prefix),
    };
    let (job_tx, job_rx) = channel::unbounded::<Job>();
    let (tx, rx) = channel::unbounded::<Sample>();
    // One connection a thread at most: never more idle than threads.
    let pool = Arc::new(Pool::new(target.clone(), n));
    for w in 0..n {
        let pool = Arc::clone(&pool);
        let (path, key) = (path.clone(), key.map(str::to_string));
        let (job_rx, tx) = (job_rx.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("bench-{w}"))
            .spawn(move || {
                while let Ok(job) = job_rx.recv() {
                    let picked = Instant::now();
                    let key = key.as_deref();
                    let sample = match endpoint {
                        ServeEndpoint::Completions => {
                            one_request(&pool, &path, key, &job.body, job.input)
                        }
                        ServeEndpoint::Embeddings => {
                            embeddings::one_request(&pool, &path, key, &job)
                        }
                    };
                    let mut sample = sample.unwrap_or_else(|e| Sample {
                        error: format!("{e:#}"),
                        inputs: job.inputs,
                        ..Sample::default()
                    });
                    sample.queued = picked.saturating_duration_since(job.due).as_secs_f64();
                    if tx.send(sample).is_err() {
                        break;
                    }
                }
            })
            .context("starting a benchmark thread")?;
    }
    Ok((job_tx, rx))
}

pub fn run(args: ServeBenchArgs) -> anyhow::Result<()> {
    validate(&args)?;
    // Where the result goes is checked before the run, not after it.
    if let Some(path) = &args.result_file {
        super::writable(path).context("--result-file")?;
    }
    let mut target = parse_url(&args.base_url)?;
    target.trust(args.cacert.as_deref())?;
    // The workload first: a run that would last days is refused before anything is sent.
    let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
    let rows = workload(&args, &mut rng)?;
    let trace_reuse = (args.dataset == ServeDataset::Mooncake).then(|| {
        let prompts = rows.iter().map(|r| (r.input, r.blocks.as_deref()));
        TraceReuse::of(prompts, args.mooncake.block_tokens())
    });
    let work = plan(&args, &rows);
    let span = arrival_span_s(&args, &work);
    check_arrival_span(&args, span)?;
    if span >= ANNOUNCED_ARRIVAL_SPAN_S {
        eprintln!(
            "The requests arrive over about {}, so the run lasts at least that long.",
            format_seconds(span)
        );
    }
    let model = match &args.model {
        Some(m) => m.clone(),
        // Every request names an adapter.
        None if !args.lora_modules.is_empty() => String::new(),
        None => first_model(&target, args.api_key.as_deref())
            .context("asking /v1/models for the model name (or pass --model)")?,
    };
    // Each request's `model`: --model, or one of --lora-modules at random, drawn from a
    // stream of its own so that the prompts are the same either way.
    let mut lora_rng = ChaCha8Rng::seed_from_u64(args.seed ^ LORA_SEED);
    let mut model_for = || match args.lora_modules.len() {
        0 => model.clone(),
        n => args.lora_modules[lora_rng.random_range(0..n)].clone(),
    };
    if !args.lora_modules.is_empty() {
        eprintln!(
            "Each request names one of {} LoRA adapters (--lora-modules), at random.",
            args.lora_modules.len()
        );
    }
    // One thread per request in flight: --max-concurrency of them, else up to
    // DEFAULT_IN_FLIGHT (requests still start when due; one due while all are busy waits).
    let concurrency = args
        .max_concurrency
        .unwrap_or(DEFAULT_IN_FLIGHT)
        .min(work.len().max(args.num_warmups))
        .max(1);
    let (jobs, rx) = spawn_workers(concurrency, &target, args.endpoint, args.api_key.as_deref())?;
    // The test request and the warmups have prompts of their own (another stream of the
    // seed), so the run's prompts are the same with or without them and none is cached.
    let mut warm_rng = ChaCha8Rng::seed_from_u64(args.seed ^ WARMUP_SEED);
    eprintln!("Starting initial single prompt test run...");
    jobs.send(job(
        &args,
        &model_for(),
        &work[0].unshared(),
        &mut warm_rng,
        None,
    ))
    .context("benchmark threads vanished")?;
    let test = rx.recv().context("benchmark threads vanished")?;
    anyhow::ensure!(
        test.ok,
        "the initial test request failed, so the run was not started (check --base-url, \
         --model and the lengths): {}",
        test.error
    );
    // Every embeddings answer of the run must have the test request's vector length.
    let dimension = (args.endpoint == ServeEndpoint::Embeddings).then_some(test.dimension);
    if args.num_warmups > 0 {
        eprintln!("Warming up with {} requests...", args.num_warmups);
        let mut failed = 0;
        for i in 0..args.num_warmups {
            let planned = work[i % work.len()].unshared();
            jobs.send(job(&args, &model_for(), &planned, &mut warm_rng, dimension))
                .context("benchmark threads vanished")?;
        }
        for _ in 0..args.num_warmups {
            failed += usize::from(!rx.recv().context("benchmark threads vanished")?.ok);
        }
        if failed > 0 {
            eprintln!(
                "warning: {failed} of {} warmup requests failed",
                args.num_warmups
            );
        }
    }
    eprintln!("Starting the benchmark run...");
    // Speculative decoding's counters before the run (a server without them reports none;
    // embeddings draft nothing).
    let spec_before = match args.endpoint {
        ServeEndpoint::Completions => spec_counters(&target),
        ServeEndpoint::Embeddings => None,
    };
    // The arrivals at --request-rate, from a stream of their own: the prompts are the same
    // at any rate.
    let arrivals = match args.request_rate {
        Some(rate) if !replays_times(args.dataset) => arrival_times(
            work.len(),
            rate,
            args.burstiness.unwrap_or(1.0),
            &mut ChaCha8Rng::seed_from_u64(args.seed ^ ARRIVAL_SEED),
        ),
        _ => Vec::new(),
    };
    if let Some(rate) = paced_rate(&args) {
        let b = args.burstiness.unwrap_or(1.0);
        let process = if b == 1.0 {
            "Poisson process"
        } else {
            "Gamma distribution"
        };
        eprintln!(
            "Traffic request rate: {} requests/s, burstiness factor {} ({process})",
            short_number(rate),
            short_number(b)
        );
    }
    let progress =
        super::progress("bench serve", work.len() as u64, "requests").counting_failures();
    let start = Instant::now();
    let mut done = Finished {
        samples: Vec::with_capacity(work.len()),
        in_flight: 0,
        progress,
    };
    // Whether a request due found every thread busy (and waited for one).
    let mut capped = false;
    for (i, planned) in work.iter().enumerate() {
        // Arrival time: the trace's own, vLLM's at --request-rate, or all at once (no rate,
        // or an infinite one, as vLLM's default).
        let due = match planned.at {
            Some(t) => t / args.time_scale,
            None => arrivals.get(i).copied().unwrap_or(0.0),
        };
        let wait = due - start.elapsed().as_secs_f64();
        let wait = Duration::try_from_secs_f64(wait.max(0.0))
            .with_context(|| format!("an arrival {due} s after the start is out of range"))?;
        // Requests that finish while the next one waits for its arrival are counted now, so
        // that the progress moves during a long run at a --request-rate.
        done.collect_until(&rx, Instant::now() + wait)?;
        while done.in_flight >= concurrency {
            capped = true;
            done.push(rx.recv().context("benchmark threads vanished")?);
        }
        let mut next = job(&args, &model_for(), planned, &mut rng, dimension);
        next.due = start
            .checked_add(Duration::try_from_secs_f64(due.max(0.0)).unwrap_or_default())
            .unwrap_or(next.due)
            .min(next.due);
        jobs.send(next).context("benchmark threads vanished")?;
        done.in_flight += 1;
    }
    // Dropping the sender lets every worker end once the queue is empty.
    drop(jobs);
    while done.in_flight > 0 {
        done.push(rx.recv().context("benchmark threads vanished")?);
    }
    done.progress.finish();
    let samples = done.samples;
    let duration = start.elapsed().as_secs_f64();
    if args.endpoint == ServeEndpoint::Embeddings {
        return embeddings::report(&args, &samples, duration, trace_reuse, capped);
    }
    let spec = match (spec_before, spec_counters(&target)) {
        (Some(a), Some(b)) => Some(SpecCounters {
            drafts: b.drafts - a.drafts,
            draft_tokens: b.draft_tokens - a.draft_tokens,
            accepted: b.accepted - a.accepted,
        }),
        // Absent before the run: the server had drafted nothing yet (it publishes the
        // counters from its first draft on), so the run's are its totals.
        (None, Some(b)) => Some(b),
        _ => None,
    };
    report(
        &args,
        &samples,
        duration,
        spec.filter(|s| s.draft_tokens > 0.0),
        trace_reuse,
        capped,
    )
}

/// `part` of `whole` in percent (0 of nothing).
fn percent(part: usize, whole: usize) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

/// Mixed into the seed for the test request's and the warmups' prompts.
const WARMUP_SEED: u64 = 0x5741_524d_5550_5321;

/// Mixed into the seed for the arrival times at a --request-rate.
const ARRIVAL_SEED: u64 = 0x4152_5249_5641_4c53;

/// Mixed into the seed for the adapters of --lora-modules.
const LORA_SEED: u64 = 0x4c4f_5241_4d4f_4453;

/// Most names in --lora-modules.
const MAX_LORA_MODULES: usize = 1024;

/// Longest model name --lora-modules takes, in bytes.
const MAX_MODEL_NAME_BYTES: usize = 256;

/// `input` random prompt token ids from [offset, offset + range) (`validate` keeps the sum
/// within u32).
fn random_prompt(args: &ServeBenchArgs, input: usize, rng: &mut ChaCha8Rng) -> Vec<u32> {
    let range = args.token_range.max(1);
    (0..input)
        .map(|_| args.token_offset + rng.random_range(0..range))
        .collect()
}

/// The streamed `/v1/completions` body of one request.
fn request_body(model: &str, prompt: &[u32], output: usize, args: &ServeBenchArgs) -> String {
    json!({
        "model": model, "prompt": prompt, "max_tokens": output, "temperature": 0.0,
        "ignore_eos": args.ignore_eos, "stream": true, "stream_options": {"include_usage": true},
    })
    .to_string()
}

/// Speculative decoding counters of a Switchyard server (`/metrics`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct SpecCounters {
    drafts: f64,
    draft_tokens: f64,
    accepted: f64,
}

impl SpecCounters {
    /// Accepted draft tokens of the draft tokens, in percent (vLLM's "Acceptance rate (%)").
    fn acceptance_rate(&self) -> f64 {
        100.0 * self.accepted / self.draft_tokens.max(1.0)
    }

    /// Tokens a draft step yields on average: its accepted drafts and the token the target
    /// model adds (vLLM's "Acceptance length", 1 + accepted / drafts).
    fn acceptance_length(&self) -> f64 {
        1.0 + self.accepted / self.drafts.max(1.0)
    }
}

/// Reads the speculative decoding counters from `/metrics`; `None` when the endpoint or the
/// counters are missing (another server, or metrics behind a key).
fn spec_counters(t: &Target) -> Option<SpecCounters> {
    let s = http::get(t, "/metrics", None).ok()?;
    let mut text = String::new();
    s.take(MAX_SMALL_RESPONSE_BYTES)
        .read_to_string(&mut text)
        .ok()?;
    parse_spec_counters(&text)
}

fn parse_spec_counters(text: &str) -> Option<SpecCounters> {
    let value = |name: &str| {
        text.lines().find_map(|l| {
            let (lhs, v) = l.rsplit_once(' ')?;
            (lhs.split('{').next()? == name).then(|| v.trim().parse::<f64>().ok())?
        })
    };
    Some(SpecCounters {
        drafts: value("switchyard:spec_decode_num_drafts_total")?,
        draft_tokens: value("switchyard:spec_decode_num_draft_tokens_total")?,
        accepted: value("switchyard:spec_decode_num_accepted_tokens_total")?,
    })
}

/// The metrics of vLLM's `--percentile-metrics`, in the order its report shows them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Metric {
    Ttft,
    Tpot,
    Itl,
    E2el,
    ClientQueueTime,
    E2elIncludingClientQueue,
}

impl Metric {
    const ALL: [Metric; 6] = [
        Metric::Ttft,
        Metric::Tpot,
        Metric::Itl,
        Metric::E2el,
        Metric::ClientQueueTime,
        Metric::E2elIncludingClientQueue,
    ];

    /// Its name in `--percentile-metrics` and in the result file's keys.
    fn key(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
            Metric::Itl => "itl",
            Metric::E2el => "e2el",
            Metric::ClientQueueTime => "client_queue_time",
            Metric::E2elIncludingClientQueue => "e2el_including_client_queue",
        }
    }

    /// Its name in the report's lines.
    fn label(self) -> &'static str {
        match self {
            Metric::Ttft => "TTFT",
            Metric::Tpot => "TPOT",
            Metric::Itl => "ITL",
            Metric::E2el => "E2EL",
            Metric::ClientQueueTime => "Client Queue Time",
            Metric::E2elIncludingClientQueue => "E2EL incl. Client Queue",
        }
    }

    /// The title of its section of the report.
    fn title(self) -> &'static str {
        match self {
            Metric::Ttft => "Time to First Token",
            Metric::Tpot => "Time per Output Token (excl. 1st token)",
            Metric::Itl => "Inter-token Latency",
            Metric::E2el => "End-to-end Latency",
            Metric::ClientQueueTime => "Client-side Queueing",
            Metric::E2elIncludingClientQueue => "Queue-inclusive End-to-end Latency",
        }
    }

    /// Whether an embeddings run measures it (no tokens are streamed there).
    fn of_embeddings(self) -> bool {
        !matches!(self, Metric::Ttft | Metric::Tpot | Metric::Itl)
    }
}

/// Most percentiles in `--metric-percentiles`.
const MAX_PERCENTILES: usize = 100;

/// One percentile of `--metric-percentiles`: its value, and how vLLM writes it in a line and a
/// key (`99`, `99.9`).
#[derive(Debug, Clone, PartialEq)]
struct Percentile {
    p: f64,
    word: String,
}

/// How vLLM writes a percentile `p` in a label or key: `str(int(p)) if int(p) == p else
/// str(p)`, Python's shortest repr of the float (with an exponent of two digits or more below
/// 1e-4, as Python writes `5e-05`).
fn percentile_word(p: f64) -> String {
    if p.fract() == 0.0 {
        // `validate` keeps p within [0, 100].
        return format!("{}", p as i64);
    }
    if p.abs() < 1e-4 {
        let e = format!("{p:e}");
        if let Some((mantissa, exp)) = e.split_once('e') {
            if let Ok(exp) = exp.parse::<i32>() {
                let sign = if exp < 0 { '-' } else { '+' };
                return format!("{mantissa}e{sign}{:02}", exp.unsigned_abs());
            }
        }
        return e;
    }
    format!("{p}")
}

/// What `--percentile-metrics` and `--metric-percentiles` select: the metrics whose sections
/// the report shows, and the percentiles of each.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Selection {
    metrics: Vec<Metric>,
    percentiles: Vec<Percentile>,
}

impl Default for Selection {
    /// vLLM's defaults for a completions run: TTFT, TPOT and ITL, their P99.
    fn default() -> Selection {
        Selection {
            metrics: vec![Metric::Ttft, Metric::Tpot, Metric::Itl],
            percentiles: vec![Percentile {
                p: 99.0,
                word: "99".into(),
            }],
        }
    }
}

impl Selection {
    /// The selection of the arguments (vLLM's defaults: `ttft,tpot,itl`, `e2el` for
    /// embeddings, and `99`); an unknown metric, one an embeddings run does not measure, or a
    /// percentile that is not a number from 0 to 100 is an error.
    pub(super) fn parse(args: &ServeBenchArgs) -> anyhow::Result<Selection> {
        let embeddings = args.endpoint == ServeEndpoint::Embeddings;
        let names = args.percentile_metrics.as_deref().unwrap_or(if embeddings {
            "e2el"
        } else {
            "ttft,tpot,itl"
        });
        let mut metrics = Vec::new();
        for name in names.split(',').map(str::trim) {
            let shown: String = name.chars().take(64).collect();
            let metric = Metric::ALL
                .into_iter()
                .find(|m| m.key() == name)
                .with_context(|| {
                    format!(
                        "--percentile-metrics: unknown metric `{shown}` (the metrics are {})",
                        Metric::ALL.map(Metric::key).join(", ")
                    )
                })?;
            anyhow::ensure!(
                !embeddings || metric.of_embeddings(),
                "--percentile-metrics: an embeddings run measures no {name} (its metrics are e2el, \
                 client_queue_time and e2el_including_client_queue)"
            );
            if !metrics.contains(&metric) {
                metrics.push(metric);
            }
        }
        let mut percentiles = Vec::new();
        for text in args.metric_percentiles.split(',').map(str::trim) {
            let shown: String = text.chars().take(64).collect();
            let p: f64 = text
                .parse()
                .map_err(|_| anyhow::anyhow!("--metric-percentiles: `{shown}` is not a number"))?;
            anyhow::ensure!(
                (0.0..=100.0).contains(&p),
                "--metric-percentiles: {shown} is outside 0 to 100"
            );
            anyhow::ensure!(
                percentiles.len() < MAX_PERCENTILES,
                "--metric-percentiles: more than {MAX_PERCENTILES} percentiles"
            );
            percentiles.push(Percentile {
                p,
                word: percentile_word(p),
            });
        }
        Ok(Selection {
            metrics,
            percentiles,
        })
    }

    /// The percentiles' values.
    fn values(&self) -> Vec<f64> {
        self.percentiles.iter().map(|p| p.p).collect()
    }

    /// Prints the section of each metric selected, of those the run `measured`, in vLLM's
    /// order: its mean, median and percentiles, in ms.
    fn print(&self, measured: &[(Metric, &Stats)]) {
        for (metric, s) in self.shown(measured) {
            let name = metric.label();
            println!("{:-^50}", metric.title());
            println!("{:<40}{:.2}", format!("Mean {name} (ms):"), s.mean);
            println!("{:<40}{:.2}", format!("Median {name} (ms):"), s.median);
            for (p, v) in self.percentiles.iter().zip(&s.percentiles) {
                println!("{:<40}{:.2}", format!("P{} {name} (ms):", p.word), v);
            }
        }
    }

    /// Adds the printed sections' figures to `--result-file`'s object, under vLLM's keys:
    /// `mean_ttft_ms`, `median_ttft_ms`, `std_ttft_ms`, `p99_ttft_ms`, `p99.9_ttft_ms`, ...
    fn add_to(&self, measured: &[(Metric, &Stats)], result: &mut serde_json::Value) {
        for (metric, s) in self.shown(measured) {
            let key = metric.key();
            result[format!("mean_{key}_ms")] = json!(s.mean);
            result[format!("median_{key}_ms")] = json!(s.median);
            result[format!("std_{key}_ms")] = json!(s.std);
            for (p, v) in self.percentiles.iter().zip(&s.percentiles) {
                result[format!("p{}_{key}_ms", p.word)] = json!(v);
            }
        }
    }

    /// The metrics selected and measured, in vLLM's order.
    fn shown<'a>(&self, measured: &[(Metric, &'a Stats)]) -> Vec<(Metric, &'a Stats)> {
        Metric::ALL
            .into_iter()
            .filter(|m| self.metrics.contains(m))
            .filter_map(|m| measured.iter().find(|(n, _)| *n == m).copied())
            .collect()
    }
}

/// The mean, median, standard deviation and selected percentiles of a sample of seconds, in
/// ms, as vLLM computes them with NumPy: percentiles interpolate linearly between the sorted
/// values, the deviation is the population's (`np.std`), and an empty sample gives 0 for each
/// (vLLM's `np.mean(x or 0)`).
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct Stats {
    pub(super) mean: f64,
    pub(super) median: f64,
    pub(super) std: f64,
    /// One per percentile asked for, in their order.
    pub(super) percentiles: Vec<f64>,
}

/// The figures of `v` (seconds) with the percentiles `ps` (0 to 100).
pub(super) fn stats(mut v: Vec<f64>, ps: &[f64]) -> Stats {
    if v.is_empty() {
        return Stats {
            percentiles: vec![0.0; ps.len()],
            ..Stats::default()
        };
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    Stats {
        mean: mean * 1e3,
        median: percentile(&v, 50.0) * 1e3,
        std: var.sqrt() * 1e3,
        percentiles: ps.iter().map(|&p| percentile(&v, p) * 1e3).collect(),
    }
}

/// vLLM's peaks of a run over its successful requests: the most streamed chunks with a
/// choice received within one second (buckets of whole seconds from the earliest sending,
/// "Peak output token throughput"; a chunk a token, as vLLM counts them), and the most
/// requests in flight at one moment (each from its sending to its last chunk, an end before
/// a start at the same instant, "Peak concurrent requests").
fn peaks(ok: &[&Sample]) -> (f64, usize) {
    let Some(first) = ok.iter().filter_map(|s| s.sent).min() else {
        return (0.0, 0);
    };
    let mut buckets: Vec<u64> = Vec::new();
    let mut events: Vec<(f64, i8)> = Vec::with_capacity(2 * ok.len());
    for s in ok {
        let Some(sent) = s.sent else { continue };
        let start = (sent - first).as_secs_f64();
        let mut t = start + s.ttft;
        buckets.push(t as u64);
        for gap in &s.itl {
            t += gap;
            buckets.push(t as u64);
        }
        events.push((start, 1));
        events.push((start + s.latency, -1));
    }
    buckets.sort_unstable();
    let most_in_a_second = buckets
        .chunk_by(|a, b| a == b)
        .map(<[u64]>::len)
        .max()
        .unwrap_or(0);
    events.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, delta) in events {
        now += i64::from(delta);
        peak = peak.max(now);
    }
    (most_in_a_second as f64, usize::try_from(peak).unwrap_or(0))
}

/// The warning, once per run, that the server sent no `usage` for some successful requests,
/// so that their output tokens (and the throughput and TPOT from them) are counted from the
/// stream (vLLM tokenizes the text instead; this client has no tokenizer).
fn usage_warning(ok: &[&Sample]) -> Option<String> {
    let missing = ok.iter().filter(|s| s.usage_missing).count();
    (missing > 0).then(|| {
        format!(
            "warning: the server sent no usage for {missing} of {} successful requests \
             (stream_options.include_usage); their output tokens are the streamed chunks with \
             a choice, fewer than the tokens where a chunk carries several (speculative decoding)",
            ok.len()
        )
    })
}

/// What every report counts: the successful requests, the failed ones and the input tokens
/// of the successful ones.
struct Counted<'a> {
    /// The successful requests.
    ok: Vec<&'a Sample>,
    /// Requests that failed.
    failed: usize,
    /// Prompt tokens of the successful requests.
    input: usize,
}

impl<'a> Counted<'a> {
    fn of(samples: &'a [Sample]) -> Self {
        let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
        Self {
            failed: samples.len() - ok.len(),
            // Counts from the server's usage: a wrong one saturates rather than wraps.
            input: ok
                .iter()
                .map(|s| s.prompt_tokens)
                .fold(0, usize::saturating_add),
            ok,
        }
    }

    /// Prints the banner and the labels both endpoints' reports open with, in vLLM's order:
    /// successful and failed requests, the concurrency and rate asked for (where given), the
    /// run's duration and the input tokens.
    fn print_head(&self, args: &ServeBenchArgs, duration: f64) {
        println!("{:=^50}", " Serving Benchmark Result ");
        println!("{:<40}{}", "Successful requests:", self.ok.len());
        println!("{:<40}{}", "Failed requests:", self.failed);
        if let Some(c) = args.max_concurrency {
            println!("{:<40}{}", "Maximum request concurrency:", c);
        }
        if let Some(rate) = paced_rate(args) {
            println!("{:<40}{:.2}", "Request rate configured (RPS):", rate);
        }
        println!("{:<40}{:.2}", "Benchmark duration (s):", duration);
        println!("{:<40}{}", "Total input tokens:", self.input);
    }
}

/// The `Prefix Reuse` section of a report on either endpoint: the prompt tokens the server's
/// prefix cache served, where its `usage` says (the successful requests that carried
/// `prompt_tokens_details`), of the successful requests' input tokens, and what the trace
/// itself could reuse (the mooncake dataset).
struct PrefixReuse {
    /// Cached prompt tokens summed over the successful requests that reported them; `None`
    /// when none did.
    cached: Option<usize>,
    /// Prompt tokens of the successful requests.
    input: usize,
    /// The trace's own reuse.
    trace: Option<TraceReuse>,
}

impl PrefixReuse {
    fn of(counted: &Counted, trace: Option<TraceReuse>) -> Self {
        let cached = counted
            .ok
            .iter()
            .filter_map(|s| s.cached_tokens)
            .reduce(usize::saturating_add);
        Self {
            cached,
            input: counted.input,
            trace,
        }
    }

    /// Prints the section (nothing when there is nothing to say).
    fn print(&self) {
        if self.cached.is_some() || self.trace.is_some() {
            println!("{:-^50}", "Prefix Reuse");
        }
        if let Some(c) = self.cached {
            println!("{:<40}{}", "Cached prompt tokens:", c);
            println!(
                "{:<40}{:.2}",
                "Cached of input tokens (%):",
                percent(c, self.input)
            );
        }
        if let Some(t) = self.trace {
            println!("{:<40}{}", "Trace's reusable prompt tokens:", t.reusable);
            println!(
                "{:<40}{:.2}",
                "Trace's reusable of its tokens (%):",
                percent(t.reusable, t.input)
            );
        }
    }

    /// Adds the section's figures to `--result-file`'s object.
    fn add_to(&self, result: &mut serde_json::Value) {
        if let Some(c) = self.cached {
            result["total_cached_prompt_tokens"] = json!(c);
            result["cached_prompt_token_fraction"] = json!(percent(c, self.input) / 100.0);
        }
        if let Some(t) = self.trace {
            result["trace_reusable_prompt_tokens"] = json!(t.reusable);
            result["trace_prompt_tokens"] = json!(t.input);
            result["trace_reusable_fraction"] = json!(percent(t.reusable, t.input) / 100.0);
        }
    }
}

/// Ends a report on either endpoint: the closing rule, the first failure on stderr and the
/// result file (`result`, built only when `--result-file` asks for it); fails when no request
/// succeeded.
fn close_report(
    args: &ServeBenchArgs,
    samples: &[Sample],
    counted: &Counted,
    result: impl FnOnce() -> serde_json::Value,
) -> anyhow::Result<()> {
    println!("{}", "=".repeat(50));
    if let Some(first) = samples.iter().find(|s| !s.ok) {
        eprintln!("first failure: {}", first.error);
    }
    if let Some(path) = &args.result_file {
        let mut result = result();
        if !args.lora_modules.is_empty() {
            result["lora_modules"] = json!(args.lora_modules);
        }
        std::fs::write(path, serde_json::to_string_pretty(&result)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    anyhow::ensure!(!counted.ok.is_empty(), "no request succeeded");
    Ok(())
}

/// The warning of a run without `--max-concurrency` in which a request due found every one
/// of the [`DEFAULT_IN_FLIGHT`] threads busy.
fn capped_warning(args: &ServeBenchArgs, ok: &[&Sample], capped: bool) {
    if args.max_concurrency.is_some() || !capped {
        return;
    }
    let held = ok.iter().filter(|s| s.queued >= HELD_S).count();
    eprintln!(
        "warning: every one of the {DEFAULT_IN_FLIGHT} threads was busy when a request was due \
         ({held} of {} successful requests waited 1 ms or more): their latencies count from \
         their sending, as vLLM's, and the wait is the Client Queue Time (shown with \
         --percentile-metrics client_queue_time); --max-concurrency sets the limit",
        ok.len()
    );
}

/// A rate or burstiness as vLLM's `--result-file` holds it: the number, or the string "inf"
/// where it is infinite (vLLM writes `request_rate` so; its `burstiness` it writes as Python's
/// `Infinity`, which is not JSON).
fn finite_or_inf(x: f64) -> serde_json::Value {
    if x.is_finite() {
        json!(x)
    } else {
        json!("inf")
    }
}

/// Adds the traffic asked for to `--result-file`'s object, as vLLM writes it: `request_rate`
/// ("inf" without one: every request at once, vLLM's default), `burstiness` (1 without one)
/// and `max_concurrency` (null without one).
fn add_traffic(args: &ServeBenchArgs, result: &mut serde_json::Value) {
    result["request_rate"] = finite_or_inf(args.request_rate.unwrap_or(f64::INFINITY));
    result["burstiness"] = finite_or_inf(args.burstiness.unwrap_or(1.0));
    result["max_concurrency"] = json!(args.max_concurrency);
}

fn report(
    args: &ServeBenchArgs,
    samples: &[Sample],
    duration: f64,
    spec: Option<SpecCounters>,
    trace_reuse: Option<TraceReuse>,
    capped: bool,
) -> anyhow::Result<()> {
    let counted = Counted::of(samples);
    let ok = &counted.ok;
    if let Some(warning) = usage_warning(ok) {
        eprintln!("{warning}");
    }
    let goodput = Goodput::parse(&args.goodput)?;
    let selection = Selection::parse(args)?;
    let shown = QueueFigures::of(args, capped);
    capped_warning(args, ok, capped);
    let figures = Figures::of(ok, duration, goodput.as_ref(), shown, &selection);
    counted.print_head(args, duration);
    figures.print();
    if let Some(sp) = spec {
        println!("{:-^50}", "Speculative Decoding");
        println!("{:<40}{:.2}", "Acceptance rate (%):", sp.acceptance_rate());
        println!("{:<40}{:.2}", "Acceptance length:", sp.acceptance_length());
        println!("{:<40}{}", "Drafts:", sp.drafts);
        println!("{:<40}{}", "Draft tokens:", sp.draft_tokens);
        println!("{:<40}{}", "Accepted tokens:", sp.accepted);
    }
    let reuse = PrefixReuse::of(&counted, trace_reuse);
    reuse.print();
    close_report(args, samples, &counted, || {
        let mut result = json!({
            "completed": ok.len(), "failed": counted.failed, "duration": duration,
            "total_input_tokens": counted.input,
        });
        add_traffic(args, &mut result);
        figures.add_to(&mut result);
        if let Some(sp) = spec {
            // vLLM's keys: the rate in percent.
            result["spec_decode_acceptance_rate"] = json!(sp.acceptance_rate());
            result["spec_decode_acceptance_length"] = json!(sp.acceptance_length());
            result["spec_decode_num_drafts"] = json!(sp.drafts);
            result["spec_decode_draft_tokens"] = json!(sp.draft_tokens);
            result["spec_decode_accepted_tokens"] = json!(sp.accepted);
        }
        reuse.add_to(&mut result);
        result
    })
}

/// The figures of a completions run, over its successful requests, as vLLM's
/// `calculate_metrics` defines them.
#[derive(Debug, Clone, PartialEq)]
struct Figures {
    /// The run's duration in seconds (at least a nanosecond, to divide by).
    duration: f64,
    /// Successful requests.
    completed: usize,
    /// Their prompt tokens.
    input: usize,
    /// Their output tokens.
    output: usize,
    /// Those meeting every `--goodput` objective (`None` without objectives).
    good: Option<usize>,
    /// TTFT: sending to the first chunk with a choice.
    ttft: Stats,
    /// TPOT of each request of more than one output token.
    tpot: Stats,
    /// Every gap between two chunks with a choice, of every request.
    itl: Stats,
    /// E2E latency: sending to the last chunk with a choice.
    e2el: Stats,
    /// The most chunks with a choice received within a second.
    peak_output: f64,
    /// The most requests in flight at once.
    peak_concurrency: usize,
    /// The client queue time of each request, and its E2E latency with it.
    queue: Stats,
    e2el_with_queue: Stats,
    /// Which of those the run measured, as vLLM's.
    shown: QueueFigures,
    /// The metrics and percentiles the report shows.
    selection: Selection,
}

/// Which client-queue figures a run measures (and a report shows where `--percentile-metrics`
/// selects them): vLLM's client queue time under `--max-concurrency`, and its queue-inclusive
/// E2E latency too where the arrivals are paced (a rate or a trace's times). Without
/// `--max-concurrency` the queue is measured where requests waited for one of the
/// [`DEFAULT_IN_FLIGHT`] threads all the same.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct QueueFigures {
    queue: bool,
    e2el: bool,
}

/// A wait for a thread this long or longer counts in the warning of a run whose requests
/// found every thread busy without `--max-concurrency`.
const HELD_S: f64 = 1e-3;

impl QueueFigures {
    /// The figures a run shows, `capped` if a request due found every thread busy.
    fn of(args: &ServeBenchArgs, capped: bool) -> QueueFigures {
        let queue = args.max_concurrency.is_some() || capped;
        QueueFigures {
            queue,
            e2el: queue && (paced_rate(args).is_some() || replays_times(args.dataset)),
        }
    }

    /// The client-queue metrics measured, with their figures: the client queue time and the
    /// E2E latency with it.
    fn measured<'a>(&self, queue: &'a Stats, e2el: &'a Stats) -> Vec<(Metric, &'a Stats)> {
        let mut measured = Vec::new();
        if self.queue {
            measured.push((Metric::ClientQueueTime, queue));
        }
        if self.e2el {
            measured.push((Metric::E2elIncludingClientQueue, e2el));
        }
        measured
    }
}

impl Figures {
    fn of(
        ok: &[&Sample],
        duration: f64,
        goodput: Option<&Goodput>,
        shown: QueueFigures,
        selection: &Selection,
    ) -> Figures {
        let (peak_output, peak_concurrency) = peaks(ok);
        let ps = selection.values();
        Figures {
            duration: duration.max(1e-9),
            completed: ok.len(),
            input: ok
                .iter()
                .map(|s| s.prompt_tokens)
                .fold(0, usize::saturating_add),
            output: ok
                .iter()
                .map(|s| s.output_tokens)
                .fold(0, usize::saturating_add),
            good: goodput.map(|g| ok.iter().filter(|s| g.met(s)).count()),
            ttft: stats(ok.iter().map(|s| s.ttft).collect(), &ps),
            tpot: stats(ok.iter().filter_map(|s| tpot(s)).collect(), &ps),
            itl: stats(ok.iter().flat_map(|s| s.itl.iter().copied()).collect(), &ps),
            e2el: stats(ok.iter().map(|s| s.latency).collect(), &ps),
            peak_output,
            peak_concurrency,
            queue: stats(ok.iter().map(|s| s.queued).collect(), &ps),
            e2el_with_queue: stats(ok.iter().map(|s| s.queued + s.latency).collect(), &ps),
            shown,
            selection: selection.clone(),
        }
    }

    /// The figures of each metric the run measured.
    fn measured(&self) -> Vec<(Metric, &Stats)> {
        let mut measured = vec![
            (Metric::Ttft, &self.ttft),
            (Metric::Tpot, &self.tpot),
            (Metric::Itl, &self.itl),
            (Metric::E2el, &self.e2el),
        ];
        measured.extend(self.shown.measured(&self.queue, &self.e2el_with_queue));
        measured
    }

    /// Per second of the run.
    fn rate(&self, n: usize) -> f64 {
        n as f64 / self.duration
    }

    /// Prints the figures after the head, in vLLM's order and with its labels.
    fn print(&self) {
        println!("{:<40}{}", "Total generated tokens:", self.output);
        println!(
            "{:<40}{:.2}",
            "Request throughput (req/s):",
            self.rate(self.completed)
        );
        if let Some(good) = self.good {
            println!("{:<40}{:.2}", "Request goodput (req/s):", self.rate(good));
        }
        println!(
            "{:<40}{:.2}",
            "Output token throughput (tok/s):",
            self.rate(self.output)
        );
        println!(
            "{:<40}{:.2}",
            "Peak output token throughput (tok/s):", self.peak_output
        );
        println!(
            "{:<40}{:.2}",
            "Peak concurrent requests:", self.peak_concurrency as f64
        );
        println!(
            "{:<40}{:.2}",
            "Total Token throughput (tok/s):",
            self.rate(self.input.saturating_add(self.output))
        );
        self.selection.print(&self.measured());
    }

    /// Adds the figures to `--result-file`'s object, under vLLM's keys.
    fn add_to(&self, result: &mut serde_json::Value) {
        result["total_output_tokens"] = json!(self.output);
        result["request_throughput"] = json!(self.rate(self.completed));
        result["request_goodput"] = json!(self.good.map(|g| self.rate(g)));
        result["output_throughput"] = json!(self.rate(self.output));
        result["total_token_throughput"] = json!(self.rate(self.input.saturating_add(self.output)));
        result["max_output_tokens_per_s"] = json!(self.peak_output);
        result["max_concurrent_requests"] = json!(self.peak_concurrency);
        self.selection.add_to(&self.measured(), result);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The audit's 20 silent minutes: at a --request-rate, requests that finished while the
    /// next waited for its arrival were counted only once every request was sent.
    #[test]
    fn requests_finished_before_the_next_arrival_are_counted_at_once() {
        let (tx, rx) = channel::unbounded();
        let mut done = Finished {
            samples: Vec::new(),
            in_flight: 3,
            progress: Progress::hidden(),
        };
        tx.send(Sample::default()).unwrap();
        tx.send(Sample::default()).unwrap();
        let start = Instant::now();
        done.collect_until(&rx, start + Duration::from_millis(50))
            .unwrap();
        assert_eq!((done.samples.len(), done.in_flight), (2, 1));
        assert_eq!(done.progress.position(), 2);
        // An arrival already due waits for nothing.
        done.collect_until(&rx, start).unwrap();
        assert_eq!(done.progress.position(), 2);
    }

    #[test]
    fn speculative_counters_parse_from_prometheus_text() {
        let text = "HTTP/1.1 200 OK\r\n\r\n# HELP x\nswitchyard:spec_decode_num_drafts_total 12\n\
                    switchyard:spec_decode_num_draft_tokens_total 48\n\
                    switchyard:spec_decode_num_accepted_tokens_total{a=\"b\"} 30\n";
        assert_eq!(
            parse_spec_counters(text),
            Some(SpecCounters {
                drafts: 12.0,
                draft_tokens: 48.0,
                accepted: 30.0
            })
        );
        assert_eq!(parse_spec_counters("switchyard:other 1\n"), None);
    }

    #[test]
    fn missing_usage_is_warned_once_per_run() {
        let with = Sample {
            ok: true,
            output_tokens: 8,
            ..Sample::default()
        };
        let without = Sample {
            usage_missing: true,
            ..with.clone()
        };
        assert_eq!(usage_warning(&[&with, &with]), None);
        let warning = usage_warning(&[&with, &without, &without]).expect("a warning");
        assert!(warning.contains("no usage for 2 of 3"), "{warning}");
    }

    #[test]
    fn percentiles_interpolate_linearly_as_numpy() {
        // numpy.percentile([1, 2, 3, 4], [50, 99]) = [2.5, 3.97]
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert!((percentile(&v, 99.0) - 3.97).abs() < 1e-12);
        assert_eq!(percentile(&[], 99.0), 0.0);
        // numpy.percentile([1, 2, 3, 4], [99, 25, 0, 100]) = [3.97, 1.75, 1, 4]
        let s = stats(vec![0.004, 0.001, 0.003, 0.002], &[99.0, 25.0, 0.0, 100.0]);
        assert!((s.mean - 2.5).abs() < 1e-9 && (s.median - 2.5).abs() < 1e-9);
        let want = [3.97, 1.75, 1.0, 4.0];
        assert!(
            s.percentiles
                .iter()
                .zip(want)
                .all(|(p, w)| (p - w).abs() < 1e-9),
            "{s:?}"
        );
        // numpy.std([1, 2, 3, 4]) = sqrt(1.25) (the population's, ddof 0).
        assert!((s.std - 1.25f64.sqrt()).abs() < 1e-9, "{s:?}");
        // An empty sample is 0 throughout, as vLLM's `np.mean(x or 0)`; never NaN.
        let empty = stats(Vec::new(), &[99.0, 50.0]);
        assert_eq!((empty.mean, empty.median, empty.std), (0.0, 0.0, 0.0));
        assert_eq!(empty.percentiles, vec![0.0, 0.0]);
    }

    /// vLLM writes a percentile as `str(int(p))` when whole, else Python's `str(p)`: the
    /// words below are what Python 3 prints for them.
    #[test]
    fn percentiles_are_worded_as_python_writes_them() {
        for (p, word) in [
            (99.0, "99"),
            (0.0, "0"),
            (100.0, "100"),
            (99.9, "99.9"),
            (99.99, "99.99"),
            (50.5, "50.5"),
            (0.1, "0.1"),
            (33.333, "33.333"),
            (0.0001, "0.0001"),
            (0.00005, "5e-05"),
            (0.000025, "2.5e-05"),
            (1e-10, "1e-10"),
        ] {
            assert_eq!(percentile_word(p), word, "{p}");
        }
    }

    /// The metrics and percentiles selected, or the refusal, of `extra`'s arguments.
    fn selection(extra: &str) -> anyhow::Result<Selection> {
        let args = serve_args(extra);
        validate(&args)?;
        Selection::parse(&args)
    }

    #[test]
    fn percentile_flags_take_vllms_names_and_defaults() {
        let keys = |s: &Selection| s.metrics.iter().map(|m| m.key()).collect::<Vec<_>>();
        let words = |s: &Selection| {
            s.percentiles
                .iter()
                .map(|p| p.word.clone())
                .collect::<Vec<_>>()
        };
        let default = selection("").unwrap();
        assert_eq!(default, Selection::default());
        assert_eq!(keys(&default), ["ttft", "tpot", "itl"]);
        assert_eq!(words(&default), ["99"]);
        assert_eq!(keys(&selection("--endpoint embeddings").unwrap()), ["e2el"]);
        let all = "--percentile-metrics e2el_including_client_queue,client_queue_time,e2el,itl,\
                   tpot,ttft --metric-percentiles 50,99.9,0,100";
        let s = selection(all).unwrap();
        assert_eq!(keys(&s).len(), 6);
        assert_eq!(words(&s), ["50", "99.9", "0", "100"]);
        let s = selection("--endpoint embeddings --percentile-metrics e2el,client_queue_time");
        assert_eq!(keys(&s.unwrap()), ["e2el", "client_queue_time"]);
        // Refused before anything is sent, with what is wrong.
        for (extra, why) in [
            (
                "--percentile-metrics ttft,latency",
                "--percentile-metrics: unknown metric `latency` (the metrics are ttft, tpot, \
                 itl, e2el, client_queue_time, e2el_including_client_queue)",
            ),
            (
                "--percentile-metrics ttft,",
                "--percentile-metrics: unknown metric ``",
            ),
            (
                "--endpoint embeddings --percentile-metrics e2el,itl",
                "--percentile-metrics: an embeddings run measures no itl",
            ),
            (
                "--metric-percentiles 99,p90",
                "--metric-percentiles: `p90` is not a number",
            ),
            (
                "--metric-percentiles 100.5",
                "--metric-percentiles: 100.5 is outside 0 to 100",
            ),
            (
                "--metric-percentiles=-1",
                "--metric-percentiles: -1 is outside 0 to 100",
            ),
            (
                "--metric-percentiles NaN",
                "--metric-percentiles: NaN is outside 0 to 100",
            ),
            (
                "--metric-percentiles inf",
                "--metric-percentiles: inf is outside 0 to 100",
            ),
        ] {
            let e = selection(extra).unwrap_err().to_string();
            assert!(e.starts_with(why), "{extra}: {e}");
        }
        let many = vec!["50"; MAX_PERCENTILES + 1].join(",");
        let e = selection(&format!("--metric-percentiles {many}")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--metric-percentiles: more than 100 percentiles"
        );
        assert!(selection(&format!("--metric-percentiles {}", &many[3..])).is_ok());
    }

    /// `--result-file`'s traffic keys as vLLM writes them: the string "inf" for an infinite
    /// rate (or none: vLLM's default) or burstiness, null without --max-concurrency.
    #[test]
    fn infinite_rates_are_written_as_the_string_inf() {
        let traffic = |extra: &str| {
            let mut result = json!({});
            add_traffic(&serve_args(extra), &mut result);
            result
        };
        assert_eq!(
            traffic(""),
            json!({"request_rate": "inf", "burstiness": 1.0, "max_concurrency": null})
        );
        assert_eq!(
            traffic("--request-rate inf --max-concurrency 8"),
            json!({"request_rate": "inf", "burstiness": 1.0, "max_concurrency": 8})
        );
        assert_eq!(
            traffic("--request-rate 2.5 --burstiness inf"),
            json!({"request_rate": 2.5, "burstiness": "inf", "max_concurrency": null})
        );
        assert_eq!(
            traffic("--request-rate 2 --burstiness 0.5")["burstiness"],
            json!(0.5)
        );
    }

    /// The figures of `ok` over `secs` with no goodput, no client queue and the default
    /// metrics.
    fn plain_figures(ok: &[&Sample], secs: f64) -> Figures {
        Figures::of(
            ok,
            secs,
            None,
            QueueFigures::default(),
            &Selection::default(),
        )
    }

    /// A successful sample sent `sent_ms` after `base`: its TTFT, gaps and E2E latency in
    /// seconds, its output and prompt tokens.
    fn timed(
        base: Instant,
        sent_ms: u64,
        ttft: f64,
        itl: &[f64],
        latency: f64,
        (output_tokens, prompt_tokens): (usize, usize),
    ) -> Sample {
        Sample {
            ok: true,
            sent: Some(base + Duration::from_millis(sent_ms)),
            ttft,
            itl: itl.to_vec(),
            latency,
            output_tokens,
            prompt_tokens,
            inputs: 1,
            ..Sample::default()
        }
    }

    /// vLLM's `calculate_metrics` on three requests, every expected value worked out by hand
    /// from its formulas (NumPy's linear percentiles: p99 of 3 values is at rank 1.98).
    #[test]
    fn figures_follow_vllm_calculate_metrics() {
        let base = Instant::now();
        // A: chunks at 10, 30 and 60 ms; B (sent as A ends): one chunk at 100 ms; C (sent at
        // 50 ms): chunks at 150 and 1,150 ms.
        let a = timed(base, 0, 0.010, &[0.020, 0.030], 0.060, (3, 5));
        // B and C waited 20 and 10 ms for a thread (client queue time).
        let b = Sample {
            queued: 0.020,
            ..timed(base, 60, 0.040, &[], 0.040, (1, 7))
        };
        let c = Sample {
            queued: 0.010,
            ..timed(base, 50, 0.100, &[1.0], 1.100, (2, 4))
        };
        let failed = Sample {
            sent: Some(base),
            ttft: 9.0,
            latency: 9.0,
            output_tokens: 100,
            ..Sample::default()
        };
        let samples = [a, b, c, failed];
        let counted = Counted::of(&samples);
        assert_eq!(
            (counted.ok.len(), counted.failed, counted.input),
            (3, 1, 16)
        );
        let close = |x: f64, want: f64| (x - want).abs() < 1e-9;
        let f = plain_figures(&counted.ok, 2.0);
        assert_eq!((f.completed, f.input, f.output, f.good), (3, 16, 6, None));
        assert!(close(f.rate(f.completed), 1.5));
        assert!(close(f.rate(f.output), 3.0) && close(f.rate(f.input + f.output), 11.0));
        // TTFT 10, 40, 100 ms.
        assert!(close(f.ttft.mean, 50.0) && close(f.ttft.median, 40.0));
        assert!(
            close(f.ttft.percentiles[0], 40.0 + 0.98 * 60.0),
            "{:?}",
            f.ttft
        );
        // TPOT excludes the first token and B (one token): (60 - 10) / 2 = 25 ms, and
        // (1,100 - 100) / 1 = 1,000 ms.
        assert!(close(f.tpot.mean, 512.5) && close(f.tpot.median, 512.5));
        assert!(
            close(f.tpot.percentiles[0], 25.0 + 0.99 * 975.0),
            "{:?}",
            f.tpot
        );
        // ITL: every gap of every request, 20, 30 and 1,000 ms.
        assert!(close(f.itl.mean, 350.0) && close(f.itl.median, 30.0));
        assert!(
            close(f.itl.percentiles[0], 30.0 + 0.98 * 970.0),
            "{:?}",
            f.itl
        );
        // E2EL 60, 40, 1,100 ms; the failure counts nowhere.
        assert!(close(f.e2el.mean, 400.0) && close(f.e2el.median, 60.0));
        assert!(
            close(f.e2el.percentiles[0], 60.0 + 0.98 * 1040.0),
            "{:?}",
            f.e2el
        );
        // Five chunks within the first second; A and C in flight at once, and B, sent as A
        // ends, not a third (vLLM's half-open intervals).
        assert_eq!((f.peak_output, f.peak_concurrency), (5.0, 2));
        // Goodput: a TTFT of at most 50 ms is A's and B's; a TPOT objective of 25 ms keeps
        // A (equal meets it) and B (one token: a TPOT of 0); 24.9 drops A.
        let good = |pairs: &[&str]| {
            let pairs: Vec<String> = pairs.iter().map(|p| p.to_string()).collect();
            let g = Goodput::parse(&pairs).unwrap().unwrap();
            Figures::of(
                &counted.ok,
                2.0,
                Some(&g),
                QueueFigures::default(),
                &Selection::default(),
            )
            .good
            .unwrap()
        };
        assert_eq!(good(&["ttft:50"]), 2);
        assert_eq!(good(&["ttft:50", "tpot:25"]), 2);
        assert_eq!(good(&["tpot:24.9", "ttft:50"]), 1);
        assert_eq!(good(&["e2el:1100"]), 3);
        assert_eq!(good(&["e2el:1099.9"]), 2);
        let mut result = json!({});
        let g = Goodput::parse(&["ttft:50".into()]).unwrap().unwrap();
        let shown = QueueFigures {
            queue: true,
            e2el: true,
        };
        let every = selection(
            "--percentile-metrics ttft,tpot,itl,e2el,client_queue_time,\
             e2el_including_client_queue",
        )
        .unwrap();
        Figures::of(&counted.ok, 2.0, Some(&g), shown, &every).add_to(&mut result);
        assert_eq!(result["request_goodput"], json!(1.0));
        assert_eq!(result["max_concurrent_requests"], json!(2));
        assert!(close(result["p99_ttft_ms"].as_f64().unwrap(), 98.8));
        assert!(close(result["mean_e2el_ms"].as_f64().unwrap(), 400.0));
        // Client queue times 0, 20 and 10 ms; E2E latencies with them 60, 60 and 1,110 ms.
        let key = |k: &str| {
            result[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{k} in {result}"))
        };
        assert!(close(key("mean_client_queue_time_ms"), 10.0));
        assert!(close(key("p99_client_queue_time_ms"), 10.0 + 0.98 * 10.0));
        assert!(close(key("mean_e2el_including_client_queue_ms"), 410.0));
        assert!(close(key("median_e2el_including_client_queue_ms"), 60.0));
        assert!(close(
            key("p99_e2el_including_client_queue_ms"),
            60.0 + 0.98 * 1050.0
        ));
        // No objectives: null, as vLLM writes it. vLLM's default selection: TTFT, TPOT and
        // ITL, their mean, median, deviation and P99, and no E2EL or client queue (measured
        // or not) unless --percentile-metrics names them.
        let mut result = json!({});
        f.add_to(&mut result);
        assert_eq!(result["request_goodput"], serde_json::Value::Null);
        let mut keys: Vec<&str> = result
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .filter(|k| k.ends_with("_ms"))
            .collect();
        keys.sort_unstable();
        let mut want: Vec<String> = ["ttft", "tpot", "itl"]
            .iter()
            .flat_map(|m| ["mean", "median", "std", "p99"].map(|f| format!("{f}_{m}_ms")))
            .collect();
        want.sort_unstable();
        assert_eq!(keys, want);
        let mut result = json!({});
        Figures::of(&counted.ok, 2.0, None, shown, &Selection::default()).add_to(&mut result);
        assert!(
            result.get("mean_client_queue_time_ms").is_none(),
            "{result}"
        );
        // Other percentiles: named as vLLM names them, worked out by hand (NumPy's linear
        // percentiles: P99.9 of 3 values at rank 1.998), in the order given.
        let picked = selection("--percentile-metrics e2el,ttft --metric-percentiles 50,99.9");
        let mut result = json!({});
        Figures::of(&counted.ok, 2.0, None, shown, &picked.unwrap()).add_to(&mut result);
        for (key, want) in [
            ("p50_ttft_ms", 40.0),
            ("p99.9_ttft_ms", 40.0 + 0.998 * 60.0),
            ("median_ttft_ms", 40.0),
            ("p50_e2el_ms", 60.0),
            ("p99.9_e2el_ms", 60.0 + 0.998 * 1040.0),
            ("mean_e2el_ms", 400.0),
        ] {
            let got = result[key].as_f64();
            assert!(got.is_some_and(|v| close(v, want)), "{key} in {result}");
        }
        for absent in [
            "p99_ttft_ms",
            "mean_tpot_ms",
            "mean_itl_ms",
            "p50_client_queue_time_ms",
        ] {
            assert!(result.get(absent).is_none(), "{absent} in {result}");
        }
        // Nothing succeeded: zeros, no NaN.
        let none = Figures::of(&[], 0.0, None, QueueFigures::default(), &every);
        assert_eq!((none.peak_output, none.peak_concurrency), (0.0, 0));
        assert_eq!(none.rate(0), 0.0);
    }

    /// Regression: the token totals summed the server's `usage` counts (which saturate at
    /// `usize::MAX` when read) with wrapping additions, so a server reporting absurd counts
    /// gave small totals and throughputs (or, with overflow checks, a panic): they saturate,
    /// as the cached tokens' total does.
    #[test]
    fn token_totals_saturate_on_a_servers_absurd_usage() {
        let base = Instant::now();
        let samples = [
            timed(base, 0, 0.010, &[0.010], 0.020, (usize::MAX, usize::MAX)),
            timed(base, 0, 0.010, &[0.010], 0.020, (2, 3)),
        ];
        let counted = Counted::of(&samples);
        assert_eq!(counted.input, usize::MAX);
        let f = plain_figures(&counted.ok, 1.0);
        assert_eq!((f.input, f.output), (usize::MAX, usize::MAX));
        let mut result = json!({});
        f.add_to(&mut result);
        assert_eq!(result["total_token_throughput"], json!(usize::MAX as f64));
        assert_eq!(result["output_throughput"], json!(usize::MAX as f64));
    }

    #[test]
    fn goodput_objectives_parse_as_vllm_names_them() {
        let parse = |pairs: &[&str]| {
            Goodput::parse(&pairs.iter().map(|p| p.to_string()).collect::<Vec<_>>())
        };
        assert_eq!(parse(&[]).unwrap(), None);
        assert_eq!(
            parse(&["ttft:200", "tpot:40", "e2el:0"]).unwrap(),
            Some(Goodput {
                ttft: Some(0.2),
                tpot: Some(0.04),
                e2el: Some(0.0)
            })
        );
        for bad in [
            &["ttft"][..],
            &["ttft:"],
            &["itl:5"],
            &["ttft:-1"],
            &["ttft:NaN"],
            &["ttft:inf"],
            &["ttft:1", "ttft:2"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?} was accepted");
        }
    }

    /// vLLM's arrivals: a gap before every request, the first too, scaled so the last
    /// arrives at n / rate.
    #[test]
    fn arrivals_at_a_rate_are_vllms() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        assert_eq!(arrival_times(3, f64::INFINITY, 1.0, &mut rng), vec![0.0; 3]);
        // Evenly spaced: 1 / rate each, the first one gap after the start.
        assert_eq!(
            arrival_times(4, 2.0, f64::INFINITY, &mut rng),
            vec![0.5, 1.0, 1.5, 2.0]
        );
        // The coefficient of variation of Gamma gaps of shape k is 1 / sqrt(k): 1 for the
        // Poisson process, 2 at burstiness 0.25, 0.5 at 4.
        for (burstiness, cv) in [(1.0, 1.0), (0.25, 2.0), (4.0, 0.5)] {
            let n = 20_000;
            let times = arrival_times(n, 50.0, burstiness, &mut rng);
            assert!((times[n - 1] - n as f64 / 50.0).abs() < 1e-9);
            assert!(times[0] > 0.0 && times.windows(2).all(|w| w[0] <= w[1]));
            let gaps: Vec<f64> = std::iter::once(times[0])
                .chain(times.windows(2).map(|w| w[1] - w[0]))
                .collect();
            let mean = gaps.iter().sum::<f64>() / n as f64;
            assert!((mean - 1.0 / 50.0).abs() < 1e-12, "{mean}");
            let sd = (gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
            assert!(
                (sd / mean - cv).abs() < 0.08 * cv,
                "burstiness {burstiness}: cv {}",
                sd / mean
            );
        }
    }

    #[test]
    fn trace_clock_keeps_order_across_midnight() {
        assert_eq!(parse_clock("1970-01-01 00:00:00"), Some(0.0));
        // 2023-11-16 is 19677 days after the epoch.
        assert_eq!(
            parse_clock("2023-11-16 18:17:03.5"),
            Some(19_677.0 * 86_400.0 + 18.0 * 3600.0 + 17.0 * 60.0 + 3.5)
        );
        let a = parse_clock("2023-11-16 23:59:59.5000000").unwrap();
        let b = parse_clock("2023-11-17 00:00:01.2500000").unwrap();
        assert!((b - a - 1.75).abs() < 1e-6, "{}", b - a);
        assert_eq!(parse_clock("18:17:03"), None);
        assert_eq!(parse_clock("2023-13-01 00:00:00"), None);
    }

    #[test]
    fn dataset_files_are_read_up_to_a_cap() {
        let dir = crate::scratch::ScratchDir::new("bench-cap");
        let path = dir.join("d.csv");
        std::fs::write(&path, "12345").unwrap();
        assert_eq!(read_bounded(&path, 5).unwrap(), "12345");
        assert!(read_bounded(&path, 4).is_err());
        // A file over the bound is refused as such, also where the bound falls inside a
        // character of several bytes (it used to read as "not valid UTF-8").
        std::fs::write(&path, "aaa\u{20ac}").unwrap();
        let e = format!("{:#}", read_bounded(&path, 4).unwrap_err());
        assert!(e.ends_with("d.csv is larger than 4 bytes"), "{e}");
        assert_eq!(read_bounded(&path, 6).unwrap(), "aaa\u{20ac}");
        // Within the bound, text that is not UTF-8 says so.
        std::fs::write(&path, b"a\xffb").unwrap();
        let e = format!("{:#}", read_bounded(&path, 6).unwrap_err());
        assert!(e.contains("UTF-8"), "{e}");
    }

    /// A dataset whose beginning cannot be the dataset is refused there, not after its
    /// bound: `/dev/zero` (it was read to 1 GiB), a text file that is not JSON Lines, a CSV
    /// without the columns or with no line end; what can be the dataset reads whole.
    #[test]
    fn a_dataset_is_refused_as_soon_as_it_cannot_be_one() {
        let dir = crate::scratch::ScratchDir::new("bench-dataset-start");
        let path = dir.join("d");
        let cols = DatasetStart::Csv(&["num_prefill_tokens", "num_decode_tokens"]);
        let read = |start| read_dataset(&path, MAX_DATASET_BYTES, Some(start));
        let zero = Path::new("/dev/zero");
        let trace = DatasetStart::Mooncake { skip_rows: 0 };
        let e = format!(
            "{:#}",
            read_dataset(zero, MAX_DATASET_BYTES, Some(trace)).unwrap_err()
        );
        assert_eq!(
            e,
            "/dev/zero:1: not JSON Lines of objects (its first character is byte 0x00, not `{`)"
        );
        let e = format!(
            "{:#}",
            read_dataset(zero, MAX_DATASET_BYTES, Some(cols)).unwrap_err()
        );
        assert_eq!(
            e,
            format!(
                "/dev/zero: not a CSV file: no line end in its first {MAX_CSV_HEADER_BYTES} \
                 bytes, so it has no header line"
            )
        );
        // JSON Lines: whitespace and a byte order mark may come first; anything else is not.
        let rows = "\u{feff}\n  {\"timestamp\": 0}\nnot json\n";
        std::fs::write(&path, rows).unwrap();
        assert_eq!(read(trace).unwrap(), rows);
        std::fs::write(&path, "\n[{\"timestamp\": 0}]").unwrap();
        let e = format!("{:#}", read(trace).unwrap_err());
        assert!(
            e.ends_with("d:2: not JSON Lines of objects (its first character is `[`, not `{`)"),
            "{e}"
        );
        // A file without a row is refused as the run refuses it.
        std::fs::write(&path, " \n").unwrap();
        let e = format!("{:#}", read(trace).unwrap_err());
        assert!(e.ends_with("d has no rows"), "{e}");
        // A CSV's header is checked once its line ends (or the file does), before the rest.
        let mut csv = "\u{feff}id,num_prefill_tokens,num_decode_tokens\r\n".to_string();
        csv.push_str(&"1,2,3\n".repeat(100_000));
        std::fs::write(&path, &csv).unwrap();
        assert_eq!(read(cols).unwrap(), csv);
        std::fs::write(&path, "num_prefill_tokens,num_decode_tokens").unwrap();
        assert!(read(cols).is_ok());
        let mut other = "ContextTokens,GeneratedTokens\n".to_string();
        other.push_str(&"\0".repeat(1 << 20));
        std::fs::write(&path, other).unwrap();
        let e = format!("{:#}", read(cols).unwrap_err());
        assert!(
            e.ends_with("d: the header has no column num_prefill_tokens"),
            "{e}"
        );
        std::fs::write(&path, b"\xff,num_prefill_tokens,num_decode_tokens\n").unwrap();
        let e = format!("{:#}", read(cols).unwrap_err());
        assert!(
            e.ends_with("d: not a CSV file: its header line is not UTF-8 text"),
            "{e}"
        );
        // The bound still holds for a file whose start is right.
        std::fs::write(&path, "{}\n{}\n").unwrap();
        let e = format!("{:#}", read_dataset(&path, 4, Some(trace)).unwrap_err());
        assert!(e.ends_with("d is larger than 4 bytes"), "{e}");
    }

    /// `bench serve` arguments as clap parses them from `extra`.
    fn serve_args(extra: &str) -> ServeBenchArgs {
        use clap::Parser;
        let argv = ["switchyard", "bench", "serve"]
            .into_iter()
            .chain(extra.split_whitespace());
        match crate::cli::Cli::try_parse_from(argv)
            .expect("parses")
            .command
        {
            crate::cli::Command::Bench(crate::cli::BenchCommand::Serve(a)) => a,
            other => panic!("parsed {other:?}"),
        }
    }

    /// Dataset columns are found by their header's names (a byte-order mark before it is
    /// skipped), so a file with its columns in another order reads the same.
    #[test]
    fn dataset_columns_are_read_by_name() {
        let dir = crate::scratch::ScratchDir::new("bench-cols");
        let path = dir.join("d.csv");
        std::fs::write(
            &path,
            "\u{feff}GeneratedTokens,TIMESTAMP,ContextTokens\n\
             7,2023-11-16 18:15:46.6805900,100\n9,2023-11-16 18:15:48.1805900,200\n",
        )
        .unwrap();
        let args = serve_args(&format!(
            "--dataset trace --num-prompts 2 --dataset-path {}",
            path.display()
        ));
        let work = workload(&args, &mut ChaCha8Rng::seed_from_u64(0)).unwrap();
        assert_eq!(
            work,
            vec![
                Row::random(100, 7, Some(0.0)),
                Row::random(200, 9, Some(1.5))
            ]
        );
        // A timestamp years after the first would have the replay sleep that long: refused.
        std::fs::write(
            &path,
            "GeneratedTokens,TIMESTAMP,ContextTokens\n\
             7,2023-11-16 18:15:46.6805900,100\n9,9999-12-31 23:59:59.0000000,200\n",
        )
        .unwrap();
        let e = workload(&args, &mut ChaCha8Rng::seed_from_u64(0)).unwrap_err();
        assert!(format!("{e:#}").contains(":3: TIMESTAMP"), "{e:#}");
        std::fs::write(&path, "num_decode_tokens,num_prefill_tokens\n5,50\n").unwrap();
        let args = serve_args(&format!(
            "--dataset sharegpt --num-prompts 1 --dataset-path {}",
            path.display()
        ));
        let work = workload(&args, &mut ChaCha8Rng::seed_from_u64(0)).unwrap();
        assert_eq!(work, vec![Row::random(50, 5, None)]);
        std::fs::write(&path, "a,b\n1,2\n").unwrap();
        let e = workload(&args, &mut ChaCha8Rng::seed_from_u64(0)).unwrap_err();
        assert!(
            format!("{e:#}").contains("no column num_prefill_tokens"),
            "{e:#}"
        );
    }

    #[test]
    fn out_of_range_arguments_are_refused_before_any_request() {
        for good in [
            "",
            "--request-rate inf",
            "--request-rate 0.5 --time-scale 2",
            "--input-len 1048576 --max-concurrency 16384",
        ] {
            assert!(validate(&serve_args(good)).is_ok(), "{good:?} was refused");
        }
        for bad in [
            "--max-input-len 0",
            "--max-output-len 0",
            "--input-len 0",
            "--output-len 1048577",
            "--time-scale 0",
            "--time-scale=-1",
            "--time-scale NaN",
            "--time-scale inf",
            "--request-rate 0",
            "--request-rate=-2",
            "--request-rate NaN",
            // Arrivals ~10^300 s apart: refused here, not after the test request.
            "--request-rate 1e-300",
            "--time-scale 1e-300",
            "--time-scale 1e308",
            "--token-offset 4294967295",
            "--max-concurrency 0",
            "--max-concurrency 16385",
            "--num-prompts 0",
            "--dataset mooncake --mooncake-block-tokens 0",
            "--dataset mooncake --mooncake-block-tokens 4097",
            // Only the mooncake dataset has blocks to size.
            "--mooncake-block-tokens 64",
            "--skip-rows 3",
            "--dataset mooncake --skip-rows 10000001",
            "--endpoint embeddings --embedding-batch 0",
            "--endpoint embeddings --embedding-batch 2049",
            // 2048 prompts of 1024 tokens: 2^21 ids in one request.
            "--endpoint embeddings --embedding-batch 2048 --input-len 1024",
            "--endpoint embeddings --embedding-batch 1024 --dataset sharegpt",
            // Burstiness shapes the gaps of a finite rate, and only those.
            "--burstiness 0.5",
            "--request-rate inf --burstiness 0.5",
            "--request-rate 2 --burstiness 0",
            "--request-rate 2 --burstiness=-1",
            "--request-rate 2 --burstiness NaN",
            "--request-rate 2 --burstiness 1e9",
            "--dataset trace --request-rate 2 --burstiness 2",
            "--goodput ttft",
            "--goodput itl:5",
        ] {
            assert!(validate(&serve_args(bad)).is_err(), "{bad:?} was accepted");
        }
        for good in [
            "--request-rate 2 --burstiness 0.25",
            "--request-rate 2 --burstiness inf",
            "--goodput ttft:200 tpot:40",
        ] {
            assert!(validate(&serve_args(good)).is_ok(), "{good:?} was refused");
        }
        for good in [
            "--endpoint embeddings",
            "--endpoint embeddings --embedding-batch 2048 --input-len 512",
            "--endpoint embeddings --embedding-batch 512 --dataset sharegpt",
            "--dataset mooncake --mooncake-block-tokens 64",
        ] {
            assert!(validate(&serve_args(good)).is_ok(), "{good:?} was refused");
        }
        // A batch of completions is no such thing.
        let e = validate(&serve_args("--embedding-batch 4")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--embedding-batch needs --endpoint embeddings (a completion request carries one \
             prompt)"
        );
        let e = validate(&serve_args("--endpoint embeddings --embedding-batch 4096"));
        assert_eq!(
            e.unwrap_err().to_string(),
            "--embedding-batch must be 1..=2048, not 4096"
        );
        // Named, with the number short (not 300 digits of a Duration conversion).
        let e = validate(&serve_args("--request-rate 1e-300")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--request-rate 1e-300 outside [1e-6, 1e6] requests/s (inf sends every request at once)"
        );
        let e = validate(&serve_args("--time-scale 1e-300")).unwrap_err();
        assert!(
            e.to_string()
                .starts_with("--time-scale 1e-300 outside [1e-6, 1e6]"),
            "{e}"
        );
    }

    /// Embeddings requests carry `--embedding-batch` prompts each, the last one the rest; a
    /// trace's batch arrives with its last prompt.
    #[test]
    fn embeddings_batches_group_the_prompts_in_order() {
        let args = serve_args("--endpoint embeddings --embedding-batch 4 --num-prompts 10");
        let work = workload(&args, &mut ChaCha8Rng::seed_from_u64(0)).unwrap();
        let planned = plan(&args, &work);
        let sizes: Vec<usize> = planned.iter().map(|p| p.inputs.len()).collect();
        assert_eq!(sizes, vec![4, 4, 2]);
        assert!(planned.iter().flat_map(|p| &p.inputs).all(|&n| n == 128));
        // One prompt a request without a batch (completions, or embeddings of one).
        for extra in ["--num-prompts 10", "--endpoint embeddings --num-prompts 10"] {
            let args = serve_args(extra);
            assert_eq!(plan(&args, &work).len(), 10, "{extra}");
        }
        let timed = [
            Row::random(5, 1, Some(0.0)),
            Row::random(6, 1, Some(2.0)),
            Row::random(7, 1, Some(3.0)),
        ];
        let args = serve_args("--endpoint embeddings --embedding-batch 2");
        let planned = plan(&args, &timed);
        assert_eq!(
            planned,
            vec![
                Planned {
                    inputs: vec![5, 6],
                    output: 1,
                    at: Some(2.0),
                    blocks: vec![None, None],
                },
                Planned {
                    inputs: vec![7],
                    output: 1,
                    at: Some(3.0),
                    blocks: vec![None],
                }
            ]
        );
        // At a rate, the span counts requests, not prompts: 11 prompts in 3 requests.
        let args = "--endpoint embeddings --embedding-batch 4 --num-prompts 11 --request-rate 2";
        assert_eq!(span_check(args).unwrap(), 1.5);
    }

    /// The span a run's arrivals are expected to take, and the refusal of one longer than a
    /// day unless --allow-long-run.
    fn span_check(extra: &str) -> anyhow::Result<f64> {
        let args = serve_args(extra);
        validate(&args)?;
        let work = plan(&args, &workload(&args, &mut ChaCha8Rng::seed_from_u64(0))?);
        let span = arrival_span_s(&args, &work);
        check_arrival_span(&args, span).map(|()| span)
    }

    #[test]
    fn a_run_whose_arrivals_span_days_is_refused_unless_allowed() {
        assert_eq!(span_check("--num-prompts 1000").unwrap(), 0.0);
        assert_eq!(
            span_check("--num-prompts 1000 --request-rate inf").unwrap(),
            0.0
        );
        // The last of n requests arrives at n / rate, as vLLM's.
        assert_eq!(
            span_check("--num-prompts 11 --request-rate 2").unwrap(),
            5.5
        );
        // 86,400 s exactly is allowed; one request more is not.
        let day = "--request-rate 0.5 --num-prompts 43200";
        assert_eq!(span_check(day).unwrap(), 86_400.0);
        assert!(span_check("--request-rate 0.5 --num-prompts 43201").is_err());
        let e = span_check("--request-rate 0.001 --num-prompts 1000").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--num-prompts 1000 at --request-rate 0.001 requests/s spaces the arrivals over \
             about 11 d 13 h, and the run lasts at least that long: raise --request-rate or \
             lower --num-prompts, or pass --allow-long-run to start a run of more than 24 hours \
             anyway"
        );
        let allowed = "--request-rate 0.001 --num-prompts 1000 --allow-long-run";
        assert!((span_check(allowed).unwrap() - 1_000_000.0).abs() < 1e-6);
        // A trace's own times count, over --time-scale.
        let dir = crate::scratch::ScratchDir::new("bench-span");
        let path = dir.join("d.csv");
        std::fs::write(
            &path,
            "ContextTokens,GeneratedTokens,TIMESTAMP\n\
             100,7,2023-11-16 00:00:00.0000000\n200,9,2023-11-18 00:00:00.0000000\n",
        )
        .unwrap();
        let trace = format!(
            "--dataset trace --num-prompts 2 --dataset-path {}",
            path.display()
        );
        let e = span_check(&trace).unwrap_err();
        assert!(
            e.to_string().starts_with(
                "the trace's first 2 arrivals at --time-scale 1 span 2 d 00 h, and the run lasts"
            ) && e
                .to_string()
                .contains("raise --time-scale or lower --num-prompts"),
            "{e}"
        );
        assert_eq!(
            span_check(&format!("{trace} --time-scale 4")).unwrap(),
            43_200.0
        );
    }
}
