//! How this crate's long steps (a model's download, the checks of its weights) report their
//! progress. The crate only counts; the caller shows it: the binary draws a bar on a terminal
//! and writes plain lines (or log events) elsewhere, with the same progress module as its
//! other long commands, and tests, benchmarks and library users pass [`NoProgress`]. So this
//! crate needs no terminal code of its own, and nothing here decides where output goes.

/// Where a long step reports what it does and how far it has got.
pub trait ProgressSink: Send + Sync {
    /// A one-line status: what is being done now (`verifying sha256`).
    fn note(&self, message: &str);
    /// Begins a step of `len` items counted in `unit` (`tensors`, `MB`), named `label` (the
    /// first words of each progress line).
    fn step(&self, label: &str, len: u64, unit: &str) -> Box<dyn ProgressStep>;
}

/// One counted step begun by [`ProgressSink::step`]. Dropped without [`ProgressStep::finish`]
/// (the step failed), it reports no end.
pub trait ProgressStep: Send + Sync {
    /// Sets the number of items done.
    fn set_position(&self, done: u64);
    /// Ends the step, reporting it done.
    fn finish(self: Box<Self>);
}

/// A [`ProgressSink`] that shows nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl ProgressSink for NoProgress {
    fn note(&self, _message: &str) {}

    fn step(&self, _label: &str, _len: u64, _unit: &str) -> Box<dyn ProgressStep> {
        Box::new(NoProgress)
    }
}

impl ProgressStep for NoProgress {
    fn set_position(&self, _done: u64) {}

    fn finish(self: Box<Self>) {}
}

/// A sink that keeps what it is told, for tests: `note …`, `step LABEL LEN UNIT`, `at N`,
/// `done`.
#[cfg(test)]
#[derive(Default)]
pub(crate) struct Recorded(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

#[cfg(test)]
impl Recorded {
    /// What it was told, in order.
    pub(crate) fn told(&self) -> Vec<String> {
        self.0.lock().map(|t| t.clone()).unwrap_or_default()
    }

    fn push(list: &std::sync::Mutex<Vec<String>>, line: String) {
        if let Ok(mut list) = list.lock() {
            list.push(line);
        }
    }
}

#[cfg(test)]
impl ProgressSink for Recorded {
    fn note(&self, message: &str) {
        Self::push(&self.0, format!("note {message}"));
    }

    fn step(&self, label: &str, len: u64, unit: &str) -> Box<dyn ProgressStep> {
        Self::push(&self.0, format!("step {label} {len} {unit}"));
        Box::new(Recorded(self.0.clone()))
    }
}

#[cfg(test)]
impl ProgressStep for Recorded {
    fn set_position(&self, done: u64) {
        Self::push(&self.0, format!("at {done}"));
    }

    fn finish(self: Box<Self>) {
        Self::push(&self.0, "done".into());
    }
}
