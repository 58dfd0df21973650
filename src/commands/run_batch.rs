//! `switchyard run-batch`: an OpenAI Batch input file answered offline, line by line, by the
//! very request path `serve` runs.
//!
//! The engine and the HTTP layer's state are built as `serve` builds them
//! ([`super::serve::load_engine`], [`super::serve::start_engine`]), from the same
//! configuration, and the actix `App` that `serve` runs is built in process with
//! [`switchyard_api::configure`] and called as a service: no socket is opened, and each line's
//! answer is the one `serve` gives for the same body (validation, errors and all). The API is
//! open (no keys; its requests are the anonymous tenant's at the default tier) and the tiers'
//! rate limits are off: an offline job has no other client to share with. A response's
//! `store` is honoured where it outlives the run: in `server.responses.path`'s journal, opened
//! as `serve` opens it; without one, storing is off ([`journaled_store`]).
//!
//! Lines run concurrently, so that the scheduler batches them: at most a window of
//! 2 × `scheduler.max_num_seqs` lines (and no more than `server.max_pending_requests`) is
//! between its start and its output line being written, which bounds both the requests in
//! flight and the answers held for an earlier, slower line. Output lines are written in input
//! order as they complete. A line the engine turns away because the batch itself keeps it
//! full (503 `overloaded`, 503 `queue_timeout`, 429 `rate_limit_exceeded` from a tier's pending
//! bound) while other lines are in flight is run again once one of them ends; with nothing
//! else in flight, its answer is final, as `serve` would give it.
//!
//! The output goes to `OUTPUT.partial`, each line written out as soon as every line before it
//! is, and is renamed to `OUTPUT` at the end, so no half file is ever under the final name.
//! On SIGINT or SIGTERM the requests in flight are aborted, the lines done so far (a prefix
//! of the input, in order) stay in `OUTPUT.partial`, and the command fails saying how many
//! they are; during the model load, before any output exists, the command fails at once.
//! Either way the process then ends by that signal (the shell's status 130 or 143), the
//! batch not being done ([`super::stop_signals`]).

mod lines;

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Instant;

use actix_service::IntoServiceFactory;
use actix_web::body::MessageBody;
use actix_web::dev::{Service, ServiceFactory, ServiceResponse};
use actix_web::http::header::{HeaderValue, CONTENT_LENGTH, CONTENT_TYPE};
use actix_web::http::{Method, Uri};
use actix_web::ResponseError;
use anyhow::Context;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde_json::Value;
use switchyard_api::response_store::ResponseStore;
use switchyard_api::ApiState;
use switchyard_gpu::progress::ProgressSink;

use self::lines::{BatchRequest, InOrder, InputLine, LineError, Outcome};
use super::serve::{self, LoadOptions, RunningEngine};
use super::stop_signals::{Interrupted, StopSignals};
use crate::cli::RunBatchArgs;

pub fn run(args: RunBatchArgs) -> anyhow::Result<()> {
    let output = Output::new(&args.output)?;
    // The files are checked before the configuration, and the model, is read; but for the
    // duplicate `custom_id` check, which needs the bound on a line the configuration sets.
    let input = read_input(&args.input)?;
    let requests = lines::split_lines(&input).with_context(|| args.input.clone())?;
    let super::config::Checked { config, .. } =
        super::config::load_checked(&args.config, &args.overrides)?;
    let max_line_bytes = config
        .server
        .max_body_bytes
        .saturating_add(lines::ENVELOPE_BYTES);
    lines::check_unique_ids(&requests, max_line_bytes).with_context(|| args.input.clone())?;
    super::init_logging(
        &config.logging.level,
        config.logging.format == switchyard_config::LogFormat::Json,
    );
    let path = super::runtime::config_model_path(&config)?;
    serve::check_load_format(&config, &path)?;
    let tiers = super::config::tier_specs(&config);
    let policy = super::config::build_policy(&config.scheduler.policy, &tiers)
        .with_context(|| format!("{}: scheduler.policy", args.config.display()))?;
    // Opened (and locked) before the load, as `serve` opens it: a server on it fails fast.
    let journal = journaled_store(&config)?;
    let system = actix_web::rt::System::new();
    // From here on SIGINT and SIGTERM are watched: during the load, which they end at once
    // (nothing is written yet), then by the lines' loop.
    let mut stops = StopSignals::install(&system)?;
    let loaded = serve::load_engine_interruptible(
        &system,
        &mut stops,
        &config,
        &path,
        &tiers,
        LoadOptions {
            metrics: false,
            metrics_tenants: Default::default(),
        },
    )
    .map_err(|e| {
        if e.is::<Interrupted>() {
            // Kept in the chain: `main` ends the process by the signal.
            e.context(
                "run-batch stopped while the model loaded, before any line ran (no output \
                 was written)",
            )
        } else {
            e
        }
    })?;
    let mut api_config = loaded.api_config(&config, Vec::new());
    api_config.rate_limits.clear();
    api_config.admin_key = None;
    api_config.cors = None;
    if journal.is_none() && api_config.responses_store.enabled() {
        // Nothing a line stores could be read after the run: storing is off, and the
        // answers say `"store": false`. (Where the configuration turned storing off itself,
        // `max_stored` or `max_stored_mb` 0, its refusals name that setting.)
        api_config.responses_store.max_responses = 0;
        api_config.responses_store.off_because =
            "run-batch stores responses only in the journal of server.responses.path, and \
             the configuration names none";
    }
    let window = (2 * config.scheduler.max_num_seqs)
        .min(loaded.max_pending_requests())
        .max(1);
    let limits = Limits {
        window,
        max_line_bytes,
    };
    let (config_file, cli_overrides) = (args.config.clone(), args.overrides.clone());
    serve::run_engine(system, |system, slot| {
        system.block_on(async move {
            let RunningEngine { adapter, .. } =
                serve::start_engine(loaded, policy, &config, tiers, slot, &|field| {
                    super::config::field_origin(&config_file, &cli_overrides, field)
                })
                .await?;
            let mut state = ApiState::new(adapter, api_config, None);
            if let Some(store) = &journal {
                state = state.with_response_store(Arc::clone(store));
            }
            let app = actix_web::App::new()
                .configure(|cfg| switchyard_api::configure(cfg, state.clone()))
                .into_factory();
            let service = app
                .new_service(actix_web::dev::AppConfig::default())
                .await
                .map_err(|()| anyhow::anyhow!("the HTTP layer's routes could not be built"))?;
            let writer = output.open()?;
            let summary = run_lines(Rc::new(service), &requests, limits, writer, stops).await;
            if let Some(store) = &journal {
                // The responses the lines stored are in the journal before the process ends.
                store.sync();
            }
            output.finish(summary)
        })
    })
}

/// The store of responses a batch keeps its stored responses in: the journal of
/// `server.responses.path`, as `serve` opens it, when the configuration names one and storing
/// is on; otherwise none, and storing is off for the batch (an in-memory store would be gone
/// with the process, so a line's `"store": true` could not be honoured).
fn journaled_store(
    config: &switchyard_config::Config,
) -> anyhow::Result<Option<Arc<ResponseStore>>> {
    let limits = serve::store_limits(config);
    let Some(dir) = config.server.responses.path.as_deref() else {
        return Ok(None);
    };
    if !limits.enabled() {
        return Ok(None);
    }
    let dir = switchyard_config::expand_home(dir);
    let store = ResponseStore::open(limits, Some(&dir))
        .with_context(|| format!("server.responses.path `{}`", dir.display()))?;
    Ok(Some(Arc::new(store)))
}

/// How many lines may be under way at once, and how long one may be.
#[derive(Debug, Clone, Copy)]
struct Limits {
    /// Lines started and not yet written (in flight, or done and waiting for an earlier line).
    window: usize,
    /// The longest line read.
    max_line_bytes: usize,
}

/// How a run ended.
struct Summary {
    /// The lines answered (or refused).
    finished: usize,
    /// The lines written, a prefix of the input's.
    written: usize,
    /// The input's lines.
    total: usize,
    /// Lines answered 2xx.
    succeeded: usize,
    /// Tokens the answers generated.
    output_tokens: u64,
    /// From the first line's start to the last line's end.
    seconds: f64,
    /// The signal that stopped the run, if one did.
    interrupted: Option<Interrupted>,
    /// Where it went wrong, when it did (writing the output).
    error: Option<anyhow::Error>,
}

/// One line's end, sent by its task.
struct Done {
    /// The line's index among the requests.
    index: usize,
    /// The request, kept to run it again (see the module's docs).
    request: BatchRequest,
    /// The API's answer.
    outcome: Outcome,
}

/// Runs `requests` through `service` and writes their output lines to `writer` in order.
async fn run_lines<S, B>(
    service: Rc<S>,
    requests: &[InputLine<'_>],
    limits: Limits,
    writer: Box<dyn Write>,
    mut stops: StopSignals,
) -> Summary
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>
        + 'static,
    B: MessageBody + 'static,
{
    let started = Instant::now();
    let mut sink = Sink {
        order: InOrder::default(),
        writer,
        ids: ChaCha8Rng::from_seed(random_seed()),
        progress: super::progress("run-batch", requests.len() as u64, "lines").counting_failures(),
        summary: Summary {
            finished: 0,
            written: 0,
            total: requests.len(),
            succeeded: 0,
            output_tokens: 0,
            seconds: 0.0,
            interrupted: None,
            error: None,
        },
    };
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Done>();
    let spawn = |index: usize, request: BatchRequest| {
        let service = Rc::clone(&service);
        let tx = tx.clone();
        actix_web::rt::spawn(async move {
            let outcome = call(service.as_ref(), &request).await;
            // The receiver goes only when the run stops, aborting this task anyway.
            let _ = tx.send(Done {
                index,
                request,
                outcome,
            });
        })
    };
    let mut in_flight: HashMap<usize, actix_web::rt::task::JoinHandle<()>> = HashMap::new();
    let result: anyhow::Result<()> = async {
        let mut retry: VecDeque<(usize, BatchRequest)> = VecDeque::new();
        let mut may_retry = false;
        let mut next = 0;
        loop {
            if may_retry || in_flight.is_empty() {
                while let Some((index, request)) = retry.pop_front() {
                    in_flight.insert(index, spawn(index, request));
                }
                may_retry = false;
            }
            while next < requests.len() && next - sink.order.written() < limits.window {
                let index = next;
                next += 1;
                match lines::parse_line(requests[index], limits.max_line_bytes) {
                    Err(e) => sink.finish(index, None, Outcome::Error(e))?,
                    Ok(r) => match lines::unbatchable(r.url, &r.body) {
                        Some(field) => {
                            let outcome = refusal(field, &mut sink.ids);
                            sink.finish(index, Some(&r.custom_id), outcome)?
                        }
                        None => {
                            in_flight.insert(index, spawn(index, r));
                        }
                    },
                }
            }
            if in_flight.is_empty() && retry.is_empty() && next == requests.len() {
                return Ok(());
            }
            tokio::select! {
                done = rx.recv() => {
                    // The loop holds a sender: the channel stays open.
                    let Some(done) = done else { anyhow::bail!("the lines' channel closed") };
                    in_flight.remove(&done.index);
                    if crowded_out(&done.outcome) && !in_flight.is_empty() {
                        tracing::debug!(
                            line = done.request.number,
                            in_flight = in_flight.len(),
                            "turned away while the batch fills the engine: run again after \
                             another line ends"
                        );
                        retry.push_back((done.index, done.request));
                    } else {
                        may_retry = true;
                        sink.finish(done.index, Some(&done.request.custom_id), done.outcome)?;
                    }
                }
                stop = stops.recv() => return Err(stop.into()),
            }
        }
    }
    .await;
    // Dropping a task's future aborts its engine request, as a client that leaves does.
    for (_, task) in in_flight.drain() {
        task.abort();
    }
    let Sink {
        mut writer,
        progress,
        mut summary,
        ..
    } = sink;
    let flushed = writer.flush();
    summary.seconds = started.elapsed().as_secs_f64();
    match result {
        Ok(()) => summary.error = flushed.err().map(anyhow::Error::from),
        Err(e) => match e.downcast::<Interrupted>() {
            Ok(stop) => summary.interrupted = Some(stop),
            Err(e) => summary.error = Some(e),
        },
    }
    progress.finish();
    summary
}

/// Where finished lines go: counted, shown, and written in input order.
struct Sink {
    /// The lines done out of order, waiting for an earlier one.
    order: InOrder,
    /// The output.
    writer: Box<dyn Write>,
    /// Draws the output lines' ids.
    ids: ChaCha8Rng,
    /// The progress bar (or lines).
    progress: switchyard_simulator::progress::Progress,
    /// The counts so far.
    summary: Summary,
}

impl Sink {
    /// Counts line `index`'s `outcome` and writes every line now in order.
    fn finish(
        &mut self,
        index: usize,
        custom_id: Option<&str>,
        outcome: Outcome,
    ) -> std::io::Result<()> {
        self.summary.finished += 1;
        if outcome.succeeded() {
            self.summary.succeeded += 1;
            self.progress.inc(1);
        } else {
            self.progress.inc_failed();
        }
        self.summary.output_tokens += outcome.output_tokens();
        let id = format!("batch_req_{:032x}", self.ids.random::<u128>());
        let line = lines::output_line(&id, custom_id, &outcome);
        let mut released = false;
        for line in self.order.push(index, line) {
            self.writer.write_all(line.as_bytes())?;
            self.writer.write_all(b"\n")?;
            released = true;
        }
        if released {
            // Out of the buffer at once: `OUTPUT.partial` shows the progress (`tail -f`) and
            // keeps the lines done even when the process is killed (one write per answer,
            // nothing beside generating it).
            self.writer.flush()?;
        }
        self.summary.written = self.order.written();
        Ok(())
    }
}

/// Whether `outcome` is the engine turning a line away because the batch's own lines fill it:
/// such a line is run again once another ends (see the module's docs).
fn crowded_out(outcome: &Outcome) -> bool {
    let Outcome::Response {
        status_code, body, ..
    } = outcome
    else {
        return false;
    };
    let code = body.pointer("/error/code").and_then(Value::as_str);
    matches!(
        (status_code, code),
        (503, Some("overloaded" | "queue_timeout")) | (429, Some("rate_limit_exceeded"))
    )
}

/// Sends `request` through the HTTP layer's service and reads its whole answer.
async fn call<S, B>(service: &S, request: &BatchRequest) -> Outcome
where
    S: Service<actix_http::Request, Response = ServiceResponse<B>, Error = actix_web::Error>,
    B: MessageBody,
{
    let body = match serde_json::to_vec(&request.body) {
        Ok(body) => actix_web::web::Bytes::from(body),
        Err(e) => return internal(request, format!("cannot write the body: {e}")),
    };
    let length = body.len();
    let mut http = actix_http::Request::with_payload(actix_web::dev::Payload::from(body));
    let head = http.head_mut();
    head.method = Method::POST;
    head.uri = Uri::from_static(request.url);
    head.headers
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    head.headers
        .insert(CONTENT_LENGTH, HeaderValue::from(length));
    let (status, request_id, bytes) = match service.call(http).await {
        Ok(response) => {
            let response = response.into_parts().1;
            let status = response.status();
            let id = request_id(response.headers());
            match actix_web::body::to_bytes(response.into_body()).await {
                Ok(bytes) => (status, id, bytes),
                Err(e) => {
                    let e: Box<dyn std::error::Error> = e.into();
                    return internal(request, format!("cannot read the answer: {e}"));
                }
            }
        }
        Err(e) => {
            let response = e.error_response();
            let status = response.status();
            let id = request_id(response.headers());
            match actix_web::body::to_bytes(response.into_body()).await {
                Ok(bytes) => (status, id, bytes),
                Err(e) => return internal(request, format!("cannot read the answer: {e}")),
            }
        }
    };
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Outcome::Response {
        status_code: status.as_u16(),
        request_id,
        body,
    }
}

/// The `x-request-id` an answer carries ("" if none).
fn request_id(headers: &actix_web::http::header::HeaderMap) -> String {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

/// A line whose answer could not be read or sent: its error.
fn internal(request: &BatchRequest, message: String) -> Outcome {
    Outcome::Error(LineError {
        custom_id: Some(request.custom_id.clone()),
        code: "internal_error",
        message: format!("line {}: {message}", request.number),
    })
}

/// The 400 a line asking for what a batch cannot answer gets (see [`lines::unbatchable`]):
/// the API's error body, naming the field.
fn refusal(field: lines::Unbatchable, ids: &mut ChaCha8Rng) -> Outcome {
    let error = switchyard_api::ApiError::invalid(field.param(), field.message());
    Outcome::Response {
        status_code: error.status_code().as_u16(),
        request_id: format!("req_{:032x}", ids.random::<u128>()),
        body: serde_json::to_value(error.to_body()).unwrap_or(Value::Null),
    }
}

/// A seed for the output lines' ids.
fn random_seed() -> [u8; 32] {
    let [a, b] = super::runtime::random_hash_key();
    let [c, d] = super::runtime::random_hash_key();
    let mut seed = [0u8; 32];
    for (chunk, word) in seed.chunks_exact_mut(8).zip([a, b, c, d]) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    seed
}

/// Reads the input file (`-`: standard input), refusing a URL and anything larger than
/// [`lines::MAX_FILE_BYTES`].
fn read_input(input: &str) -> anyhow::Result<Vec<u8>> {
    let lower = input.to_ascii_lowercase();
    anyhow::ensure!(
        !(lower.starts_with("http://") || lower.starts_with("https://")),
        "-i {input}: run-batch reads a local file (or `-` for standard input) and fetches \
         nothing from the network; download the file first"
    );
    let too_large = || anyhow::anyhow!("{input}: {}", lines::FileError::TooLarge);
    let mut bytes = Vec::new();
    let limit = lines::MAX_FILE_BYTES + 1;
    if input == "-" {
        std::io::stdin()
            .lock()
            .take(limit)
            .read_to_end(&mut bytes)
            .context("cannot read standard input")?;
    } else {
        let file = std::fs::File::open(input).with_context(|| format!("cannot open {input}"))?;
        let meta = file
            .metadata()
            .with_context(|| format!("cannot read {input}"))?;
        anyhow::ensure!(!meta.is_dir(), "{input} is a directory");
        if meta.len() > lines::MAX_FILE_BYTES {
            return Err(too_large());
        }
        file.take(limit)
            .read_to_end(&mut bytes)
            .with_context(|| format!("cannot read {input}"))?;
    }
    if bytes.len() as u64 > lines::MAX_FILE_BYTES {
        return Err(too_large());
    }
    Ok(bytes)
}

/// Where the output lines go: standard output, or a file written as `FILE.partial` and
/// renamed to `FILE` at the end.
enum Output {
    /// Standard output (`-o -`), written as lines complete.
    Stdout,
    /// A file.
    File {
        /// The final name.
        target: PathBuf,
        /// The name while it is written, and of what an interrupted run leaves.
        partial: PathBuf,
    },
}

impl Output {
    /// Checks that `output` can be written (its directory exists) before any work.
    fn new(output: &str) -> anyhow::Result<Self> {
        if output == "-" {
            return Ok(Self::Stdout);
        }
        let target = PathBuf::from(output);
        super::writable(&target)?;
        let mut partial = target.clone().into_os_string();
        partial.push(".partial");
        Ok(Self::File {
            target,
            partial: PathBuf::from(partial),
        })
    }

    /// Opens the writer the lines go to.
    fn open(&self) -> anyhow::Result<Box<dyn Write>> {
        Ok(match self {
            Self::Stdout => Box::new(std::io::LineWriter::new(std::io::stdout())),
            Self::File { partial, .. } => Box::new(std::io::BufWriter::new(
                std::fs::File::create(partial)
                    .with_context(|| format!("cannot create {}", partial.display()))?,
            )),
        })
    }

    /// Ends the run: renames the file into place after a complete run, keeps the partial
    /// file after an interruption, removes it after a failure, and writes the summary.
    fn finish(&self, summary: Summary) -> anyhow::Result<()> {
        let failed = summary.finished - summary.succeeded;
        let line = format!(
            "run-batch: {} lines, {} succeeded, {failed} failed, {} output tokens, {:.1} s, \
             {:.1} tok/s",
            summary.finished,
            summary.succeeded,
            summary.output_tokens,
            summary.seconds,
            summary.output_tokens as f64 / summary.seconds.max(1e-9),
        );
        if let Some(e) = summary.error {
            if let Self::File { partial, .. } = self {
                let _ = std::fs::remove_file(partial);
            }
            return Err(e.context(format!(
                "run-batch stopped after {} of {} lines",
                summary.written, summary.total
            )));
        }
        if let Some(stop) = summary.interrupted {
            super::StderrProgress.note(&line);
            let kept = match self {
                Self::File { partial, .. } => format!(
                    "; the lines done, in input order, are in {}",
                    partial.display()
                ),
                Self::Stdout => String::new(),
            };
            // Answers behind a line still running are not kept: the file stays a prefix.
            let dropped = match summary.finished - summary.written {
                0 => String::new(),
                n => format!(" ({n} more answered after a line still running were dropped)"),
            };
            // The signal stays in the chain: `main` ends the process by it.
            return Err(anyhow::Error::new(stop).context(format!(
                "run-batch stopped: {} of {} lines were done{dropped}{kept}",
                summary.written, summary.total
            )));
        }
        if let Self::File { target, partial } = self {
            rename(partial, target)?;
        }
        super::StderrProgress.note(&line);
        Ok(())
    }
}

/// Moves the finished output into place (replacing an older file of that name).
fn rename(partial: &Path, target: &Path) -> anyhow::Result<()> {
    std::fs::rename(partial, target).with_context(|| {
        format!(
            "cannot rename {} to {}",
            partial.display(),
            target.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer(status_code: u16, code: &str) -> Outcome {
        Outcome::Response {
            status_code,
            request_id: "r".into(),
            body: json!({"error": {"message": "m", "type": "t", "param": null, "code": code}}),
        }
    }

    #[test]
    fn only_a_line_the_batch_itself_crowds_out_is_run_again() {
        assert!(crowded_out(&answer(503, "overloaded")));
        assert!(crowded_out(&answer(503, "queue_timeout")));
        assert!(crowded_out(&answer(429, "rate_limit_exceeded")));
        // The server going away, a bad request, a missing model: final answers.
        assert!(!crowded_out(&answer(503, "unavailable")));
        assert!(!crowded_out(&answer(503, "shutting_down")));
        assert!(!crowded_out(&answer(400, "overloaded")));
        assert!(!crowded_out(&answer(404, "model_not_found")));
        assert!(!crowded_out(&Outcome::Error(LineError {
            custom_id: None,
            code: "invalid_json_line",
            message: "line 1: not valid JSON".into(),
        })));
    }

    #[test]
    fn an_unbatchable_line_is_refused_with_the_api_error_body() {
        let mut ids = ChaCha8Rng::seed_from_u64(1);
        for field in [lines::Unbatchable::Stream, lines::Unbatchable::Background] {
            let Outcome::Response {
                status_code, body, ..
            } = refusal(field, &mut ids)
            else {
                panic!("a response");
            };
            assert_eq!(status_code, 400);
            assert_eq!(body["error"]["param"], field.param());
            assert_eq!(body["error"]["type"], "invalid_request_error");
        }
    }

    #[test]
    fn a_url_is_refused_as_input() {
        for url in ["http://example.com/a.jsonl", "HTTPS://example.com/a.jsonl"] {
            let e = read_input(url).unwrap_err().to_string();
            assert!(e.contains("fetches nothing from the network"), "{e}");
        }
    }
}
