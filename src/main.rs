//! The `switchyard` binary: command-line entry point for the server, the simulator, offline
//! generation, benchmarks, model fetching and configuration checks.

mod cli;
mod commands;
#[cfg(test)]
#[path = "../testsupport/pid_namespaces.rs"]
mod pid_namespaces;
#[cfg(test)]
#[path = "../testsupport/scratch.rs"]
mod scratch;

use clap::Parser;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = cli::Cli::parse();
    match commands::run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            commands::report_fatal(&err);
            // 1, or the end by the signal that interrupted the command (130, 143).
            commands::exit_status(&err)
        }
    }
}
