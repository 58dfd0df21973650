//! Progress of a long task on stderr: a bar on a terminal, else one plain line per interval.
//!
//! A run whose stderr goes to a file, a pipe or a CI log cannot draw a bar; it gets a line
//! every [`LINE_INTERVAL`] instead, and one when the task finishes, e.g.
//! `bench serve: 412/1000 requests (0 failed), 37 s elapsed, about 52 s left`: plain text,
//! no escape codes, at most one line per interval however fast the work goes (a thread of its
//! own writes them, so a line also comes while nothing finishes). `switchyard simulate` reports
//! each policy's run this way, and the binary's other long commands (`bench serve`,
//! `bench throughput`, `calibrate`, and through the GPU crate's `ProgressSink` `model fetch`
//! and a model's load) use the same [`Progress`]; where a log subscriber is installed the
//! binary writes the lines through it ([`Progress::lines`] with a writer of its own).
//!
//! ```
//! use switchyard_simulator::progress::Progress;
//!
//! let progress = Progress::on_stderr("example", "items", indicatif::ProgressBar::new(3));
//! for _ in 0..3 {
//!     progress.inc(1);
//! }
//! assert_eq!(progress.position(), 3);
//! progress.finish();
//! ```

use std::io::{IsTerminal, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a plain progress line is written when stderr is not a terminal.
pub const LINE_INTERVAL: Duration = Duration::from_secs(10);

/// The progress of one task: a count of finished items of a total, shown on stderr.
pub struct Progress {
    /// The counts, shared with the thread that writes the plain lines.
    counts: Arc<Counts>,
    /// How the counts are shown.
    show: Show,
}

/// How a [`Progress`] is shown.
enum Show {
    /// Not at all.
    Hidden,
    /// As a bar on a terminal.
    Bar(indicatif::ProgressBar),
    /// As plain lines, written by a thread of their own.
    Lines(Ticker),
}

/// The counts of a task, updated by its owner and read by the line writer.
#[derive(Default)]
struct Counts {
    /// Items finished, failed ones included.
    done: AtomicU64,
    /// Items that failed, of those finished.
    failed: AtomicU64,
    /// Whether the lines say how many failed.
    show_failed: AtomicBool,
}

impl Counts {
    fn snapshot(&self, len: u64) -> Snapshot {
        Snapshot {
            done: self.done.load(Ordering::Relaxed),
            len,
            failed: self
                .show_failed
                .load(Ordering::Relaxed)
                .then(|| self.failed.load(Ordering::Relaxed)),
        }
    }
}

impl Progress {
    /// Progress shown on stderr: `bar` (styled as the caller likes) on a terminal, else a
    /// plain line every [`LINE_INTERVAL`] and one at [`Progress::finish`], each starting with
    /// `label` and counting the bar's length in `unit`.
    pub fn on_stderr(label: &str, unit: &str, bar: indicatif::ProgressBar) -> Self {
        if std::io::stderr().is_terminal() {
            return Progress {
                counts: Arc::default(),
                show: Show::Bar(bar),
            };
        }
        let len = bar.length().unwrap_or(0);
        Self::lines(label, unit, len, LINE_INTERVAL, Box::new(std::io::stderr()))
    }

    /// Progress written as plain lines to `out`: one every `every` (at least a millisecond)
    /// while the task runs, and one at [`Progress::finish`].
    pub fn lines(
        label: &str,
        unit: &str,
        len: u64,
        every: Duration,
        out: Box<dyn Write + Send>,
    ) -> Self {
        let counts = Arc::<Counts>::default();
        let report = LineReport::new(label, unit, len, every.max(Duration::from_millis(1)));
        let (stop, wake) = mpsc::channel();
        let shared = Arc::clone(&counts);
        let thread = std::thread::Builder::new()
            .name("progress".into())
            .spawn(move || write_lines(report, &shared, &wake, out))
            .ok();
        Progress {
            counts,
            show: Show::Lines(Ticker {
                stop: Some(stop),
                thread,
            }),
        }
    }

    /// Progress that shows nothing (its counts still move).
    pub fn hidden() -> Self {
        Progress {
            counts: Arc::default(),
            show: Show::Hidden,
        }
    }

    /// Makes the plain lines say how many items failed (`412/1000 requests (3 failed)`), and
    /// the bar too, through its message (`{msg}` in the caller's style), so that failures
    /// show while the task runs on a terminal as they do in a log.
    pub fn counting_failures(self) -> Self {
        self.counts.show_failed.store(true, Ordering::Relaxed);
        if let Show::Bar(bar) = &self.show {
            bar.set_message(failed_message(0));
        }
        self
    }

    /// Counts `n` more items finished.
    pub fn inc(&self, n: u64) {
        self.counts.done.fetch_add(n, Ordering::Relaxed);
        if let Show::Bar(bar) = &self.show {
            bar.inc(n);
        }
    }

    /// Counts one more item finished, and failed.
    pub fn inc_failed(&self) {
        let failed = self.counts.failed.fetch_add(1, Ordering::Relaxed) + 1;
        self.inc(1);
        if let Show::Bar(bar) = &self.show {
            if self.counts.show_failed.load(Ordering::Relaxed) {
                bar.set_message(failed_message(failed));
            }
        }
    }

    /// Sets the number of items finished.
    pub fn set_position(&self, done: u64) {
        self.counts.done.store(done, Ordering::Relaxed);
        if let Show::Bar(bar) = &self.show {
            bar.set_position(done);
        }
    }

    /// The number of items finished.
    pub fn position(&self) -> u64 {
        self.counts.done.load(Ordering::Relaxed)
    }

    /// Ends the task: clears the bar, or writes the final line (before returning). Dropping a
    /// [`Progress`] without finishing it writes no final line.
    pub fn finish(mut self) {
        match &mut self.show {
            Show::Hidden => {}
            Show::Bar(bar) => bar.finish_and_clear(),
            Show::Lines(ticker) => ticker.stop(true),
        }
    }
}

/// The bar's message once it counts failures, as the plain lines say it: ` (3 failed)`.
fn failed_message(failed: u64) -> String {
    format!(" ({failed} failed)")
}

/// The thread writing plain lines, and how to stop it.
struct Ticker {
    /// A message asks for the final line; hanging up stops the thread without one.
    stop: Option<mpsc::Sender<()>>,
    /// The thread (none if it could not be started: then no lines).
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    /// Stops the thread, with the final line or without, and waits for it.
    fn stop(&mut self, final_line: bool) {
        if let Some(stop) = self.stop.take() {
            if final_line {
                // The thread only ends once this sender is gone: the send cannot fail but
                // for a thread that panicked, and then there is nothing to write with.
                let _ = stop.send(());
            }
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop(false);
    }
}

/// The line writer's loop: a line whenever one is due, until told to stop.
fn write_lines(
    mut report: LineReport,
    counts: &Counts,
    wake: &mpsc::Receiver<()>,
    mut out: Box<dyn Write + Send>,
) {
    let start = Instant::now();
    let mut write = |line: String| {
        // One write per line, so that lines from elsewhere do not split it; a closed stderr
        // is no reason to stop the task.
        let _ = out.write_all(format!("{line}\n").as_bytes());
        let _ = out.flush();
    };
    loop {
        match wake.recv_timeout(report.until_next(start.elapsed())) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let elapsed = start.elapsed();
                if let Some(line) = report.tick(elapsed, counts.snapshot(report.len)) {
                    write(line);
                }
            }
            Ok(()) => {
                write(report.final_line(start.elapsed(), counts.snapshot(report.len)));
                return;
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// The counts a line reports.
#[derive(Debug, Clone, Copy)]
struct Snapshot {
    /// Items finished.
    done: u64,
    /// Items in all.
    len: u64,
    /// Items failed, where the lines say so.
    failed: Option<u64>,
}

/// What the plain lines of a task say, and when the next is due.
#[derive(Debug)]
struct LineReport {
    /// What the task is, first on each line (`bench serve`).
    label: String,
    /// What it counts (`requests`).
    unit: String,
    /// The items in all.
    len: u64,
    /// The interval between lines.
    every: Duration,
    /// When, since the start, the next line is due.
    next: Duration,
}

impl LineReport {
    fn new(label: &str, unit: &str, len: u64, every: Duration) -> Self {
        LineReport {
            label: label.to_string(),
            unit: unit.to_string(),
            len,
            every,
            next: every,
        }
    }

    /// How long from `elapsed` until the next line is due.
    fn until_next(&self, elapsed: Duration) -> Duration {
        self.next.saturating_sub(elapsed)
    }

    /// The line due at `elapsed`, if one is, and the next one scheduled at the first multiple
    /// of the interval after `elapsed`: at most one line per interval however often it is
    /// asked, and a late wake-up skips the lines it missed rather than writing them at once.
    fn tick(&mut self, elapsed: Duration, counts: Snapshot) -> Option<String> {
        if elapsed < self.next {
            return None;
        }
        let intervals = elapsed.as_nanos() / self.every.as_nanos() + 1;
        self.next = self
            .every
            .saturating_mul(u32::try_from(intervals).unwrap_or(u32::MAX));
        let left = match counts.done {
            0 => String::new(),
            done if done >= counts.len => String::new(),
            done => {
                let per_item = elapsed.as_secs_f64() / done as f64;
                let left = Duration::from_secs_f64(per_item * (counts.len - done) as f64);
                format!(", about {} left", format_duration(left))
            }
        };
        Some(format!(
            "{}, {} elapsed{left}",
            self.counted(counts),
            format_duration(elapsed)
        ))
    }

    /// The line written when the task finishes.
    fn final_line(&self, elapsed: Duration, counts: Snapshot) -> String {
        format!(
            "{}, done in {}",
            self.counted(counts),
            format_duration(elapsed)
        )
    }

    /// `label: done/len unit (failed failed)`.
    fn counted(&self, counts: Snapshot) -> String {
        let failed = counts
            .failed
            .map(|f| format!(" ({f} failed)"))
            .unwrap_or_default();
        format!(
            "{}: {}/{} {}{failed}",
            self.label, counts.done, counts.len, self.unit
        )
    }
}

/// A duration as an operator reads it, in its two largest units: `37 s`, `12 min 05 s`,
/// `3 h 07 min`, `11 d 13 h`. Rounded to the second, then the smaller units are dropped (not
/// rounded): `3 h 07 min 59 s` reads `3 h 07 min`. Every duration the binary shows people
/// (progress lines, `bench serve`'s warnings) is written by this one function.
pub fn format_duration(d: Duration) -> String {
    let s = d.as_secs_f64().round() as u64;
    match s {
        0..60 => format!("{s} s"),
        60..3600 => format!("{} min {:02} s", s / 60, s % 60),
        3600..86_400 => format!("{} h {:02} min", s / 3600, s % 3600 / 60),
        _ => format!("{} d {:02} h", s / 86_400, s % 86_400 / 3600),
    }
}

/// A duration given in seconds, as [`format_duration`] writes it; a negative or NaN count
/// reads as zero and one too large for a [`Duration`] as the largest.
pub fn format_seconds(s: f64) -> String {
    let d = if s.is_nan() || s <= 0.0 {
        Duration::ZERO
    } else {
        Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX)
    };
    format_duration(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    const SEC: Duration = Duration::from_secs(1);

    fn counts(done: u64, len: u64, failed: Option<u64>) -> Snapshot {
        Snapshot { done, len, failed }
    }

    /// On a terminal the bar says how many failed as the lines do (it used to say nothing of
    /// failures until the run's report).
    #[test]
    fn a_bar_counting_failures_says_how_many_failed() {
        let bar = indicatif::ProgressBar::hidden();
        let progress = Progress {
            counts: Arc::default(),
            show: Show::Bar(bar.clone()),
        }
        .counting_failures();
        assert_eq!(bar.message(), " (0 failed)");
        progress.inc(1);
        progress.inc_failed();
        progress.inc_failed();
        assert_eq!(bar.message(), " (2 failed)");
        assert_eq!(bar.position(), 3);
        // A bar that keeps no failure count says none.
        let bar = indicatif::ProgressBar::hidden();
        let progress = Progress {
            counts: Arc::default(),
            show: Show::Bar(bar.clone()),
        };
        progress.inc_failed();
        assert_eq!(bar.message(), "");
    }

    #[test]
    fn a_line_says_done_of_total_elapsed_and_the_time_left() {
        let mut r = LineReport::new("bench serve", "requests", 1000, 10 * SEC);
        assert_eq!(
            r.tick(37 * SEC, counts(412, 1000, Some(0))).as_deref(),
            Some("bench serve: 412/1000 requests (0 failed), 37 s elapsed, about 53 s left")
        );
        // Nothing finished yet: no estimate; no failure count where none is kept.
        let mut r = LineReport::new("simulate fcfs", "requests", 50, 10 * SEC);
        assert_eq!(
            r.tick(10 * SEC, counts(0, 50, None)).as_deref(),
            Some("simulate fcfs: 0/50 requests, 10 s elapsed")
        );
        assert_eq!(
            r.final_line(Duration::from_secs(754), counts(50, 50, None)),
            "simulate fcfs: 50/50 requests, done in 12 min 34 s"
        );
    }

    /// Hand-computed: 754 s = 12 x 60 + 34; 11,220 s = 3 x 3600 + 7 x 60; 999,000 s =
    /// 11 x 86,400 + 13 x 3600 + 1800 (the half hour dropped); 3h 07 min 59.6 s rounds to
    /// 3 h 08 min 00 s.
    #[test]
    fn durations_read_in_their_two_largest_units() {
        for (secs, text) in [
            (0.4, "0 s"),
            (0.5, "1 s"),
            (59.4, "59 s"),
            (59.6, "1 min 00 s"),
            (60.0, "1 min 00 s"),
            (754.0, "12 min 34 s"),
            (3599.0, "59 min 59 s"),
            (3600.0, "1 h 00 min"),
            (11_220.0, "3 h 07 min"),
            (11_279.0, "3 h 07 min"),
            (11_279.6, "3 h 08 min"),
            (86_399.0, "23 h 59 min"),
            (86_400.0, "1 d 00 h"),
            (999_000.0, "11 d 13 h"),
        ] {
            assert_eq!(
                format_duration(Duration::from_secs_f64(secs)),
                text,
                "{secs} s"
            );
            assert_eq!(format_seconds(secs), text, "{secs} s");
        }
        assert_eq!(format_seconds(-3.0), "0 s");
        assert_eq!(format_seconds(f64::NAN), "0 s");
        // u64::MAX seconds: 213,503,982,334,601 days and 7 hours.
        assert_eq!(format_seconds(f64::INFINITY), "213503982334601 d 07 h");
    }

    /// However often it is asked (work finishing fast), a line comes at most once per
    /// interval; a late wake-up writes one line, not the ones it missed.
    #[test]
    fn at_most_one_line_per_interval() {
        let mut r = LineReport::new("t", "items", 100, 10 * SEC);
        let mut lines = Vec::new();
        // Asked every 100 ms for 35 s.
        for ms in (0..35_000).step_by(100) {
            let at = Duration::from_millis(ms);
            if r.tick(at, counts(ms / 350, 100, None)).is_some() {
                lines.push(ms);
            }
        }
        assert_eq!(lines, [10_000, 20_000, 30_000]);
        assert_eq!(
            r.until_next(Duration::from_millis(34_900)),
            5100 * SEC / 1000
        );
        // Asleep from 35 s to 72 s: one line at 72 s, the next at 80 s.
        assert!(r.tick(72 * SEC, counts(50, 100, None)).is_some());
        assert!(r.tick(72 * SEC, counts(51, 100, None)).is_none());
        assert!(r.tick(79 * SEC, counts(52, 100, None)).is_none());
        assert_eq!(r.until_next(79 * SEC), SEC);
        assert!(r.tick(80 * SEC, counts(53, 100, None)).is_some());
    }

    /// A writer whose bytes the test reads back.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    #[test]
    fn finishing_writes_the_final_line_and_dropping_writes_none() {
        // An interval far longer than the test: only the final line can come.
        let out = Captured::default();
        let p = Progress::lines(
            "bench serve",
            "requests",
            3,
            3600 * SEC,
            Box::new(out.clone()),
        )
        .counting_failures();
        p.inc(1);
        p.inc_failed();
        p.set_position(3);
        assert_eq!(p.position(), 3);
        p.finish();
        let text = out.text();
        assert!(
            text.starts_with("bench serve: 3/3 requests (1 failed), done in ")
                && text.ends_with(" s\n")
                && text.lines().count() == 1,
            "{text:?}"
        );

        let out = Captured::default();
        let p = Progress::lines("t", "items", 3, 3600 * SEC, Box::new(out.clone()));
        p.inc(2);
        drop(p);
        assert_eq!(out.text(), "");
    }
}
