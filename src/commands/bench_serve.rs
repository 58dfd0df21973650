//! `switchyard bench serve`: a load generator for any OpenAI-compatible server (ours,
//! llama-server, vLLM). Streams completions, timestamps every chunk, and prints the labels
//! `vllm bench serve` prints; `--result-file` writes the same figures as JSON. With
//! `--endpoint embeddings` it sends the same prompts' token ids to `/v1/embeddings` instead
//! (`embeddings`), one prompt or `--embedding-batch` of them a request.
//!
//! A fixed pool of threads, one per request in flight, sends the requests through the
//! HTTP/1.1 client in `http` (plain, or TLS verified against `--cacert`): the generator must
//! not be the bottleneck at the concurrencies a single server sees.

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
use self::http::{first_model, one_request, parse_url, Target, MAX_SMALL_RESPONSE_BYTES};
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

/// The time over which the run's requests are expected to arrive, in seconds: the trace's
/// last arrival over `--time-scale`, or for Poisson arrivals at `--request-rate` the mean span
/// `(n - 1) / rate` for its `n` requests (the first goes at once, the gaps average
/// `1 / rate`); 0 when every request goes at once. The run lasts at least this long.
fn arrival_span_s(args: &ServeBenchArgs, work: &[Planned]) -> f64 {
    let trace_last = work.iter().filter_map(|w| w.at).reduce(f64::max);
    match (trace_last, args.request_rate) {
        (Some(t), _) => t / args.time_scale,
        (None, Some(rate)) if rate.is_finite() => work.len().saturating_sub(1) as f64 / rate,
        _ => 0.0,
    }
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
    let file = std::fs::File::open(path).with_context(|| format!("reading {}", path.display()))?;
    let mut text = String::new();
    file.take(max.saturating_add(1))
        .read_to_string(&mut text)
        .with_context(|| format!("reading {}", path.display()))?;
    anyhow::ensure!(
        text.len() as u64 <= max,
        "{} is larger than {} MiB",
        path.display(),
        max >> 20
    );
    Ok(text)
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
            let text = read_bounded(&path, MAX_DATASET_BYTES)?;
            let rows =
                mooncake::read_rows(&path, &text, row_shape(args), args.mooncake.skip_rows, n)?;
            Ok(rows.into_iter().map(Row::from).collect())
        }
        ServeDataset::Sharegpt | ServeDataset::Trace => {
            let path = args
                .dataset_path
                .clone()
                .context("--dataset-path is required for sharegpt and trace datasets")?;
            let text = read_bounded(&path, MAX_DATASET_BYTES)?;
            let (text, prompt_col, output_col, ts_col) = if args.dataset == ServeDataset::Sharegpt {
                let names = ["num_prefill_tokens", "num_decode_tokens"];
                let (text, c) = csv_columns(&path, &text, &names)?;
                (text, c[0], c[1], None)
            } else {
                let names = ["ContextTokens", "GeneratedTokens", "TIMESTAMP"];
                let (text, c) = csv_columns(&path, &text, &names)?;
                (text, c[0], c[1], Some(c[2]))
            };
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
    for w in 0..n {
        let target = target.clone();
        let (path, key) = (path.clone(), key.map(str::to_string));
        let (job_rx, tx) = (job_rx.clone(), tx.clone());
        std::thread::Builder::new()
            .name(format!("bench-{w}"))
            .spawn(move || {
                while let Ok(job) = job_rx.recv() {
                    let key = key.as_deref();
                    let sample = match endpoint {
                        ServeEndpoint::Completions => {
                            one_request(&target, &path, key, &job.body, job.input)
                        }
                        ServeEndpoint::Embeddings => {
                            embeddings::one_request(&target, &path, key, &job)
                        }
                    };
                    let sample = sample.unwrap_or_else(|e| Sample {
                        error: format!("{e:#}"),
                        inputs: job.inputs,
                        ..Sample::default()
                    });
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
    let progress =
        super::progress("bench serve", work.len() as u64, "requests").counting_failures();
    let start = Instant::now();
    let mut done = Finished {
        samples: Vec::with_capacity(work.len()),
        in_flight: 0,
        progress,
    };
    let mut next_arrival = 0.0f64;
    for planned in &work {
        // Arrival time: the trace's own, Poisson at --request-rate, or all at once (no rate,
        // or an infinite one, as vLLM's default).
        let due = match (planned.at, args.request_rate) {
            (Some(t), _) => t / args.time_scale,
            (None, Some(rate)) if rate.is_finite() => {
                let t = next_arrival;
                next_arrival += -(1.0 - rng.random::<f64>()).ln() / rate;
                t
            }
            _ => 0.0,
        };
        let wait = due - start.elapsed().as_secs_f64();
        let wait = Duration::try_from_secs_f64(wait.max(0.0))
            .with_context(|| format!("an arrival {due} s after the start is out of range"))?;
        // Requests that finish while the next one waits for its arrival are counted now, so
        // that the progress moves during a long run at a --request-rate.
        done.collect_until(&rx, Instant::now() + wait)?;
        while done.in_flight >= concurrency {
            done.push(rx.recv().context("benchmark threads vanished")?);
        }
        jobs.send(job(&args, &model_for(), planned, &mut rng, dimension))
            .context("benchmark threads vanished")?;
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
        return embeddings::report(&args, &samples, duration, trace_reuse);
    }
    let spec = match (spec_before, spec_counters(&target)) {
        (Some(a), Some(b)) => Some(SpecCounters {
            drafts: b.drafts - a.drafts,
            draft_tokens: b.draft_tokens - a.draft_tokens,
            accepted: b.accepted - a.accepted,
        }),
        (None, Some(b)) => Some(b),
        _ => None,
    };
    report(
        &args,
        &samples,
        duration,
        spec.filter(|s| s.draft_tokens > 0.0),
        trace_reuse,
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

fn stats(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let mean = if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    };
    (
        mean * 1e3,
        percentile(&v, 50.0) * 1e3,
        percentile(&v, 99.0) * 1e3,
    )
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
            input: ok.iter().map(|s| s.prompt_tokens).sum(),
            ok,
        }
    }

    /// Prints the banner and the labels both endpoints' reports open with, in vLLM's order:
    /// successful and failed requests, the run's duration and the input tokens.
    fn print_head(&self, duration: f64) {
        println!("{:=^50}", " Serving Benchmark Result ");
        println!("{:<40}{}", "Successful requests:", self.ok.len());
        println!("{:<40}{}", "Failed requests:", self.failed);
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

fn report(
    args: &ServeBenchArgs,
    samples: &[Sample],
    duration: f64,
    spec: Option<SpecCounters>,
    trace_reuse: Option<TraceReuse>,
) -> anyhow::Result<()> {
    let counted = Counted::of(samples);
    let ok = &counted.ok;
    if let Some(warning) = usage_warning(ok) {
        eprintln!("{warning}");
    }
    let (failed, input) = (counted.failed, counted.input);
    let output: usize = ok.iter().map(|s| s.output_tokens).sum();
    let ttft = stats(ok.iter().map(|s| s.ttft).collect());
    let tpot = stats(
        ok.iter()
            .filter(|s| s.output_tokens > 1)
            .map(|s| (s.latency - s.ttft) / (s.output_tokens - 1) as f64)
            .collect(),
    );
    let itl = stats(ok.iter().flat_map(|s| s.itl.iter().copied()).collect());
    let e2el = stats(ok.iter().map(|s| s.latency).collect());
    let d = duration.max(1e-9);
    counted.print_head(duration);
    println!("{:<40}{}", "Total generated tokens:", output);
    println!(
        "{:<40}{:.2}",
        "Request throughput (req/s):",
        ok.len() as f64 / d
    );
    println!(
        "{:<40}{:.2}",
        "Output token throughput (tok/s):",
        output as f64 / d
    );
    println!(
        "{:<40}{:.2}",
        "Total Token throughput (tok/s):",
        (input + output) as f64 / d
    );
    for (title, name, s) in [
        ("Time to First Token", "TTFT", ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", tpot),
        ("Inter-token Latency", "ITL", itl),
        ("End-to-end Latency", "E2EL", e2el),
    ] {
        println!("{:-^50}", title);
        println!("{:<40}{:.2}", format!("Mean {name} (ms):"), s.0);
        println!("{:<40}{:.2}", format!("Median {name} (ms):"), s.1);
        println!("{:<40}{:.2}", format!("P99 {name} (ms):"), s.2);
    }
    if let Some(sp) = spec {
        println!("{:-^50}", "Speculative Decoding");
        println!(
            "{:<40}{:.2}",
            "Acceptance rate (%):",
            100.0 * sp.accepted / sp.draft_tokens
        );
        println!(
            "{:<40}{:.2}",
            "Mean acceptance length:",
            1.0 + sp.accepted / sp.drafts.max(1.0)
        );
        println!("{:<40}{}", "Drafts:", sp.drafts);
        println!("{:<40}{}", "Draft tokens:", sp.draft_tokens);
        println!("{:<40}{}", "Accepted tokens:", sp.accepted);
    }
    let reuse = PrefixReuse::of(&counted, trace_reuse);
    reuse.print();
    close_report(args, samples, &counted, || {
        let mut result = json!({
            "completed": ok.len(), "failed": failed, "duration": duration,
            "total_input_tokens": input, "total_output_tokens": output,
            "request_throughput": ok.len() as f64 / d, "output_throughput": output as f64 / d,
            "total_token_throughput": (input + output) as f64 / d,
            "mean_ttft_ms": ttft.0, "median_ttft_ms": ttft.1, "p99_ttft_ms": ttft.2,
            "mean_tpot_ms": tpot.0, "median_tpot_ms": tpot.1, "p99_tpot_ms": tpot.2,
            "mean_itl_ms": itl.0, "median_itl_ms": itl.1, "p99_itl_ms": itl.2,
            "mean_e2el_ms": e2el.0, "median_e2el_ms": e2el.1, "p99_e2el_ms": e2el.2,
            "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
        });
        if let Some(sp) = spec {
            result["spec_decode_acceptance_rate"] = json!(sp.accepted / sp.draft_tokens);
            result["spec_decode_num_drafts"] = json!(sp.drafts);
            result["spec_decode_num_draft_tokens"] = json!(sp.draft_tokens);
            result["spec_decode_num_accepted_tokens"] = json!(sp.accepted);
        }
        reuse.add_to(&mut result);
        result
    })
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
        let (mean, p50, p99) = stats(vec![0.004, 0.001, 0.003, 0.002]);
        assert!((mean - 2.5).abs() < 1e-9 && (p50 - 2.5).abs() < 1e-9);
        assert!((p99 - 3.97).abs() < 1e-9);
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
        ] {
            assert!(validate(&serve_args(bad)).is_err(), "{bad:?} was accepted");
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
        assert_eq!(span_check(args).unwrap(), 1.0);
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
        assert_eq!(
            span_check("--num-prompts 11 --request-rate 2").unwrap(),
            5.0
        );
        // 86,400 s exactly is allowed; one request more is not.
        let day = "--request-rate 0.5 --num-prompts 43201";
        assert_eq!(span_check(day).unwrap(), 86_400.0);
        assert!(span_check("--request-rate 0.5 --num-prompts 43202").is_err());
        let e = span_check("--request-rate 0.001 --num-prompts 1000").unwrap_err();
        assert_eq!(
            e.to_string(),
            "--num-prompts 1000 at --request-rate 0.001 requests/s spaces the arrivals over \
             about 11 d 13 h, and the run lasts at least that long: raise --request-rate or \
             lower --num-prompts, or pass --allow-long-run to start a run of more than 24 hours \
             anyway"
        );
        let allowed = "--request-rate 0.001 --num-prompts 1000 --allow-long-run";
        assert!((span_check(allowed).unwrap() - 999_000.0).abs() < 1e-6);
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
