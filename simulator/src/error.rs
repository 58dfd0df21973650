//! The simulator's error type: every failure names the file, and for input
//! errors the line and the field, so an operator can fix a trace or a spec
//! without reading code.

use std::path::{Path, PathBuf};

/// Everything that can go wrong while loading inputs, simulating or writing reports.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A file could not be opened, read or written. The OS error is part of the message and
    /// deliberately not a `source()`: `{:#}` (anyhow's chain) would print it twice.
    #[error("{path}: {error}")]
    Io {
        /// The file concerned.
        path: PathBuf,
        /// The underlying IO error.
        error: std::io::Error,
    },
    /// A trace line is malformed or out of bounds.
    #[error("{path}:{line}: field `{field}`: {message}")]
    Trace {
        /// The trace file ("<inline>" for in-memory input).
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// The column or JSON field at fault.
        field: String,
        /// What is wrong with it.
        message: String,
    },
    /// The simulation spec (YAML or CLI flags) is invalid.
    #[error("{path}{location}: {message}", location = fmt_location(*.line, *.column))]
    Spec {
        /// The spec file ("<cli>" for flags).
        path: PathBuf,
        /// 1-based line, when known.
        line: Option<usize>,
        /// 1-based column, when known.
        column: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// A calibration file is invalid.
    #[error("{path}: calibration: {message}")]
    Calibration {
        /// The calibration file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// The policies crate refused a policy name or parameters.
    #[error("{path}: policies: {message}")]
    Policy {
        /// The spec file ("<cli>" for flags).
        path: PathBuf,
        /// The policy name from the spec.
        name: String,
        /// The registry's message: it names the policy (and lists the known names for an
        /// unknown one).
        message: String,
    },
    /// The scheduler could not be built from the spec.
    #[error("scheduler: {0}")]
    Scheduler(String),
    /// The simulation made no progress although work was pending.
    #[error("simulation stalled at t={at_s:.6}s with {waiting} waiting and {running} running requests under policy `{policy}`")]
    Stalled {
        /// The policy that was running.
        policy: String,
        /// Virtual time of the stall, in seconds.
        at_s: f64,
        /// Waiting requests at the stall.
        waiting: usize,
        /// Running requests at the stall.
        running: usize,
    },
    /// Virtual time ran past the simulator's clock limit (~285 years): step costs far outside
    /// any device's, from a calibration file or cost model near its bounds.
    #[error("simulated time passed 285 years in step {step} under policy `{policy}`: the step costs (calibration file or cost model) are far outside any real device's")]
    ClockLimit {
        /// The policy that was running.
        policy: String,
        /// The step (1-based) whose end ran past the limit.
        step: u64,
    },
    /// A plot could not be drawn.
    #[error("{path}: plot: {message}")]
    Plot {
        /// The SVG file.
        path: PathBuf,
        /// The backend's message.
        message: String,
    },
}

fn fmt_location(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!(":{l}:{c}"),
        (Some(l), None) => format!(":{l}"),
        _ => String::new(),
    }
}

impl SimError {
    /// An IO error on `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        SimError::Io {
            path: path.to_path_buf(),
            error: source,
        }
    }

    /// A trace error at `line` of `path` on `field`.
    pub fn trace(path: &Path, line: usize, field: &str, message: impl Into<String>) -> Self {
        SimError::Trace {
            path: path.to_path_buf(),
            line,
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// A spec error without a location.
    pub fn spec(path: &Path, message: impl Into<String>) -> Self {
        SimError::Spec {
            path: path.to_path_buf(),
            line: None,
            column: None,
            message: message.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_error_names_file_line_and_field() {
        let e = SimError::trace(Path::new("t.csv"), 7, "ContextTokens", "not a number");
        assert_eq!(
            e.to_string(),
            "t.csv:7: field `ContextTokens`: not a number"
        );
    }

    #[test]
    fn spec_error_shows_location_when_known() {
        let e = SimError::Spec {
            path: PathBuf::from("s.yaml"),
            line: Some(3),
            column: Some(5),
            message: "bad".into(),
        };
        assert_eq!(e.to_string(), "s.yaml:3:5: bad");
        assert_eq!(
            SimError::spec(Path::new("s.yaml"), "x").to_string(),
            "s.yaml: x"
        );
    }

    /// The binary prints errors with anyhow's `{:#}`: each error of the `source()` chain,
    /// joined by ": ". The OS message must appear once, not twice.
    #[test]
    fn io_errors_print_the_os_message_once_in_an_error_chain() {
        let e = SimError::io(
            Path::new("/nonexistent.jsonl"),
            std::io::Error::from(std::io::ErrorKind::NotFound),
        );
        let os = std::io::Error::from(std::io::ErrorKind::NotFound).to_string();
        let mut chain = e.to_string();
        let mut cause = std::error::Error::source(&e);
        while let Some(c) = cause {
            chain = format!("{chain}: {c}");
            cause = c.source();
        }
        assert_eq!(chain, format!("/nonexistent.jsonl: {os}"));
    }
}
