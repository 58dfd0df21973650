//! One module per subcommand; each turns parsed arguments into calls on the library crates.

mod bench;
mod bench_serve;
mod calibrate;
mod config;
mod generate;
mod model;
mod runtime;
mod serve;
mod simulate;

use crate::cli::{Cli, Command};
use std::io::IsTerminal;
use switchyard_simulator::progress::Progress;

/// Dispatches a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Config(cmd) => config::run(cmd),
        Command::Model(cmd) => model::run(cmd),
        Command::Calibrate(args) => calibrate::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Serve(args) => serve::run(args),
        Command::Simulate(args) => simulate::run(args),
    }
}

/// Whether to draw the model loader's progress bars: only on a terminal.
pub fn progress_enabled() -> bool {
    std::io::stderr().is_terminal()
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
/// `bench serve: 412/1000 requests (0 failed), 37 s elapsed, about 52 s left`.
pub fn progress(label: &str, len: u64, unit: &str) -> Progress {
    let bar = indicatif::ProgressBar::new(len);
    let style = indicatif::ProgressStyle::with_template(&format!(
        "{{bar:40}} {{pos}}/{{len}} {unit} ({{elapsed}} elapsed, eta {{eta}})"
    ))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    bar.set_style(style);
    Progress::on_stderr(label, unit, bar)
}
