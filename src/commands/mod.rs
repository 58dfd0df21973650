//! One module per subcommand; each turns parsed arguments into calls on the library crates.

mod bench;
mod bench_serve;
mod calibrate;
mod calibrate_front_end;
mod config;
mod generate;
mod model;
mod mooncake;
mod run_batch;
mod runtime;
mod serve;
mod simulate;
mod stop_signals;

pub use stop_signals::exit_status;

use crate::cli::{Cli, Command};
use std::io::IsTerminal;
use switchyard_gpu::progress::{ProgressSink, ProgressStep};
use switchyard_simulator::progress::{Progress, LINE_INTERVAL};

/// Dispatches a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Config(cmd) => config::run(cmd),
        Command::Model(cmd) => model::run(cmd),
        Command::Calibrate(args) => calibrate::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Serve(args) => serve::run(args),
        Command::RunBatch(args) => run_batch::run(args),
        Command::Simulate(args) => simulate::run(args),
    }
}

/// Fails unless `path` names a file in an existing directory (it may exist): what a command
/// checks of a file it writes at its end (`calibrate --output`, `bench serve --result-file`)
/// before minutes of work, rather than failing to write it after them.
pub fn writable(path: &std::path::Path) -> anyhow::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => std::path::Path::new("."),
    };
    // A directory that is not there is said to be missing, not "not a directory".
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => anyhow::bail!(
            "cannot write {}: {} is not a directory",
            path.display(),
            dir.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => anyhow::bail!(
            "cannot write {}: the directory {} does not exist",
            path.display(),
            dir.display()
        ),
        Err(e) => anyhow::bail!("cannot write {}: {}: {e}", path.display(), dir.display()),
    }
    anyhow::ensure!(
        !path.is_dir(),
        "cannot write {}: it is a directory",
        path.display()
    );
    Ok(())
}

/// Refuses a `--threads` beyond what `model.threads` takes ([`switchyard_config::MAX_CPU_THREADS`]):
/// each is an OS thread, and 100,000 of them ran the machine out of memory (a panic in the
/// thread spawner, then a process killed) instead of an error.
pub fn check_threads(threads: usize) -> anyhow::Result<()> {
    let max = switchyard_config::MAX_CPU_THREADS;
    anyhow::ensure!(
        threads <= max,
        "--threads must be 0..={max} (0: one per core, as model.threads), not {threads}"
    );
    Ok(())
}

/// Installs the tracing subscriber once, honouring `RUST_LOG` over the configured level.
/// `level` comes from a validated configuration (`logging.level`, see
/// [`switchyard_config::check_log_filter`]): tracing reads a bare word it does not know as a
/// target, so an unchecked misspelt level would turn logging off.
pub fn init_logging(level: &str, json: bool) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(level));
    // Colours only on a terminal: a log file or a pipe gets plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr);
    let installed = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    if installed.is_ok() && json {
        JSON_LOGS.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Whether [`init_logging`] installed JSON logs: then every line on stderr must be JSON, the
/// error that ends the command included (a log pipeline drops or chokes on a plain line, and
/// that line says why a pod restarts).
static JSON_LOGS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Writes the error that ends the command: an ERROR event when the logs are JSON (and ERROR
/// is enabled), else `error: …` on stderr.
pub fn report_fatal(err: &anyhow::Error) {
    if JSON_LOGS.load(std::sync::atomic::Ordering::Relaxed)
        && tracing::enabled!(tracing::Level::ERROR)
    {
        tracing::error!(error = %format!("{err:#}"), "exiting on an error");
    } else {
        eprintln!("error: {err:#}");
    }
}

/// The progress of a long command on stderr: a bar on a terminal, else a plain line every
/// [`switchyard_simulator::progress::LINE_INTERVAL`] and one at the end, such as
/// `bench serve: 412/1000 requests (0 failed), 37 s elapsed, about 52 s left`. Where a log
/// subscriber is installed (`serve`) and the logs are JSON or stderr is not a terminal, each
/// such line is an INFO event instead (target `switchyard::progress`), so that a JSON log
/// stream stays JSON and a text log keeps its line format.
pub fn progress(label: &str, len: u64, unit: &str) -> Progress {
    if through_logs() {
        return Progress::lines(
            label,
            unit,
            len,
            LINE_INTERVAL,
            Box::new(LogLines::default()),
        );
    }
    let bar = indicatif::ProgressBar::new(len);
    let style = indicatif::ProgressStyle::with_template(&format!(
        "{{wide_bar}} {{pos}}/{{len}} {unit}{{msg}} ({{elapsed}} elapsed, eta {{eta}})"
    ))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    Progress::on_stderr(label, unit, bar)
}

/// Whether progress and status lines go through the log subscriber rather than straight to
/// stderr: where one is installed, and the logs are JSON (every line on stderr must be JSON,
/// a bar included) or stderr is not a terminal (no bar is drawn).
fn through_logs() -> bool {
    tracing::dispatcher::has_been_set()
        && (JSON_LOGS.load(std::sync::atomic::Ordering::Relaxed)
            || !std::io::stderr().is_terminal())
}

/// Progress lines written as INFO events: each line written to it is one event.
#[derive(Default)]
struct LogLines {
    /// A line not yet ended.
    pending: Vec<u8>,
}

impl std::io::Write for LogLines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.pending.extend_from_slice(buf);
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line[..end]);
            tracing::info!(target: "switchyard::progress", "{line}");
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The binary's [`ProgressSink`] for the GPU crate's long steps (`model fetch`'s download, the
/// checks of a model's weights as it loads): its steps are shown by [`progress`], as every
/// long command's, and its notes are written to stderr, or logged at INFO where [`progress`]
/// logs its lines.
pub struct StderrProgress;

impl ProgressSink for StderrProgress {
    fn note(&self, message: &str) {
        if through_logs() {
            tracing::info!(target: "switchyard::progress", "{message}");
        } else {
            eprintln!("{message}");
        }
    }

    fn step(&self, label: &str, len: u64, unit: &str) -> Box<dyn ProgressStep> {
        Box::new(Step(progress(label, len, unit)))
    }
}

/// A step of [`StderrProgress`].
struct Step(Progress);

impl ProgressStep for Step {
    fn set_position(&self, done: u64) {
        self.0.set_position(done);
    }

    fn finish(self: Box<Self>) {
        self.0.finish();
    }
}
