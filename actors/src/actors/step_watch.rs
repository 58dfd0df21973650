//! The step watch: how long the backend's current call has run, and whether that is past the
//! limit an operator set (`scheduler.step_timeout_s`), past which the engine counts as stalled.
//!
//! A backend call that never returns (a CUDA kernel or a driver call hung on the GPU, a
//! deadlock inside a backend) blocks the executor's thread for good: every request waits, yet
//! the process runs and its backend was never retired, so nothing else would tell an
//! orchestrator to restart it. Production engines bound the call: vLLM declares its engine
//! dead once a model step runs past `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS` (V1, 300 s; V0's
//! `VLLM_ENGINE_ITERATION_TIMEOUT_S`, 60 s) and `/health` fails from then on; SGLang's watchdog
//! thread kills the process once a forward batch runs past `--watchdog-timeout` (300 s). Here
//! the stall is reported, not acted on: `/health` and `/ready` answer 503 while it lasts (a
//! liveness probe then restarts the process), and a call that does return ends it, because a
//! step past the limit may just be slow (a long prefill on a CPU, a first kernel compile).
//!
//! The executor marks each backend call's start and end in one atomic cell ([`StepWatch::begin`]:
//! two stores per call, no lock), so readers on any thread (the HTTP workers' probes, the
//! reporter thread that logs the stall and keeps [`names::ENGINE_STALLED`]) never wait on the
//! executor, which is the thread that is stuck.

use std::io::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use crate::metric_names as names;

/// How often the reporter thread looks at the watch.
const REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// The backend calls the executor makes, each of which can block on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendCall {
    /// `Backend::execute`: one whole step.
    Execute,
    /// `Backend::submit`: the first half of an asynchronous step.
    Submit,
    /// `Backend::collect`: the second half, which waits for the device.
    Collect,
    /// `Backend::copy_kv` or `Backend::store_kv`: KV blocks between the cache and host memory.
    CopyKv,
    /// `Backend::release`: a finished sequence's state.
    Release,
    /// The backend's drop at the engine's end (its weights, KV cache and, on CUDA, streams
    /// and context freed), which a command waits for before the process ends.
    Drop,
}

impl BackendCall {
    const ALL: [Self; 6] = [
        Self::Execute,
        Self::Submit,
        Self::Collect,
        Self::CopyKv,
        Self::Release,
        Self::Drop,
    ];

    /// The call's name, as the log and the error messages write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Execute => "execute",
            Self::Submit => "submit",
            Self::Collect => "collect",
            Self::CopyKv => "copy_kv",
            Self::Release => "release",
            Self::Drop => "drop",
        }
    }

    fn code(self) -> u64 {
        Self::ALL.iter().position(|&c| c == self).unwrap_or(0) as u64
    }

    fn from_code(code: u64) -> Self {
        Self::ALL
            .get(code as usize)
            .copied()
            .unwrap_or(Self::Execute)
    }
}

impl std::fmt::Display for BackendCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The bits of the cell that hold the call's start; the call's code sits above them.
const START_BITS: u32 = 56;
const START_MASK: u64 = (1 << START_BITS) - 1;

/// The backend call under way and how long it has run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunningCall {
    /// Which call.
    pub call: BackendCall,
    /// How long it has run, to the millisecond.
    pub running: Duration,
    /// When it began, in milliseconds since the watch was made, plus one (tells two calls of
    /// the same kind apart).
    began: u64,
}

impl std::fmt::Display for RunningCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the backend's {} call, under way for {} s",
            self.call,
            self.running.as_secs()
        )
    }
}

/// A backend call that has run past the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepStall {
    /// The call, and how long it has run.
    pub running: RunningCall,
    /// The limit (`scheduler.step_timeout_s`) it is past.
    pub limit: Duration,
}

impl std::fmt::Display for StepStall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the backend's {} call has run for {} s, past scheduler.step_timeout_s = {}",
            self.running.call,
            self.running.running.as_secs(),
            self.limit.as_secs()
        )
    }
}

/// What the executor and the readers share.
#[derive(Debug)]
struct Shared {
    /// The instant the cell's times count from.
    origin: Instant,
    /// The call under way: its code in the top 8 bits, its start (milliseconds since
    /// `origin`, plus one) below; 0 while no call runs.
    current: AtomicU64,
    /// The limit in milliseconds; 0: none.
    limit_ms: AtomicU64,
}

/// The watch over the backend's calls; clones share it.
#[derive(Debug, Clone)]
pub struct StepWatch(Arc<Shared>);

/// Marks the end of the call it was made for when dropped (unwinding included).
#[must_use = "the call ends when the guard is dropped"]
pub struct CallTiming<'a>(&'a StepWatch);

impl Drop for CallTiming<'_> {
    fn drop(&mut self) {
        self.0 .0.current.store(0, Ordering::Release);
    }
}

impl StepWatch {
    /// A watch with the limit `limit` (`None`: calls may run for any time).
    pub fn new(limit: Option<Duration>) -> Self {
        let watch = Self(Arc::new(Shared {
            origin: Instant::now(),
            current: AtomicU64::new(0),
            limit_ms: AtomicU64::new(0),
        }));
        watch.set_limit(limit);
        watch
    }

    /// Puts a new limit in force (`None` or zero: none), for the call under way too.
    pub fn set_limit(&self, limit: Option<Duration>) {
        let ms = limit.map_or(0, |l| u64::try_from(l.as_millis()).unwrap_or(u64::MAX));
        self.0.limit_ms.store(ms, Ordering::Release);
    }

    /// The limit in force.
    pub fn limit(&self) -> Option<Duration> {
        match self.0.limit_ms.load(Ordering::Acquire) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    /// Marks the start of a backend call; it ends when the returned guard is dropped. Calls do
    /// not nest (the executor makes one at a time).
    pub fn begin(&self, call: BackendCall) -> CallTiming<'_> {
        let ms = u64::try_from(self.0.origin.elapsed().as_millis()).unwrap_or(START_MASK - 1);
        let start = ms.saturating_add(1).min(START_MASK);
        self.0
            .current
            .store(call.code() << START_BITS | start, Ordering::Release);
        CallTiming(self)
    }

    /// The backend call under way at `now`, if any.
    pub fn running_at(&self, now: Instant) -> Option<RunningCall> {
        let cell = self.0.current.load(Ordering::Acquire);
        let began = cell & START_MASK;
        if began == 0 {
            return None;
        }
        let mut call = RunningCall {
            call: BackendCall::from_code(cell >> START_BITS),
            running: Duration::ZERO,
            began,
        };
        call.running = now.saturating_duration_since(self.started(&call));
        Some(call)
    }

    /// When `call` began.
    fn started(&self, call: &RunningCall) -> Instant {
        self.0.origin + Duration::from_millis(call.began.saturating_sub(1))
    }

    /// The backend call under way now, if any.
    pub fn running(&self) -> Option<RunningCall> {
        self.running_at(Instant::now())
    }

    /// The call under way at `now` if it has run past the limit.
    pub fn stall_at(&self, now: Instant) -> Option<StepStall> {
        let limit = self.limit()?;
        let running = self.running_at(now)?;
        (running.running > limit).then_some(StepStall { running, limit })
    }

    /// The call under way now if it has run past the limit.
    pub fn stall(&self) -> Option<StepStall> {
        self.stall_at(Instant::now())
    }

    /// A view of the watch that does not keep it (nor its reporter thread) alive: for a
    /// waiter that outlives the engine ([`super::BackendReleased`]).
    pub(crate) fn view(&self) -> WatchView {
        WatchView(Arc::downgrade(&self.0))
    }

    /// Starts the thread that logs a stall once when it begins and once when it ends, and
    /// keeps [`names::ENGINE_STALLED`], looking every second, so that neither depends on
    /// someone asking `/health` (see [`report_until_gone`]). It ends once every clone of the
    /// watch is gone. A thread that cannot be started is logged (the probes still see a
    /// stall; only the log line and the gauge are missing).
    pub fn start_reporter(&self) {
        let watch: Weak<Shared> = Arc::downgrade(&self.0);
        let started = std::thread::Builder::new()
            .name("step-watch".into())
            .spawn(move || {
                report_until_gone(&watch, || {
                    std::thread::sleep(REPORT_INTERVAL);
                    Instant::now()
                });
            });
        if let Err(e) = started {
            tracing::warn!(
                error = %e,
                "the step watch's thread did not start: a stalled backend call is still \
                 answered on /health, but not logged nor counted in switchyard:engine_stalled"
            );
        }
    }
}

/// A [`StepWatch`] seen without keeping it: what runs while the watch lives.
#[derive(Debug, Clone, Default)]
pub(crate) struct WatchView(Weak<Shared>);

impl WatchView {
    /// The backend call under way now, if the watch still lives and a call runs.
    pub(crate) fn running(&self) -> Option<RunningCall> {
        StepWatch(self.0.upgrade()?).running()
    }
}

/// How many looks in a row that panicked are logged one by one; past that, one in
/// [`PANICS_LOGGED_EVERY`].
const PANICS_LOGGED_IN_FULL: u64 = 3;

/// One panicking look in this many is logged, once [`PANICS_LOGGED_IN_FULL`] were.
const PANICS_LOGGED_EVERY: u64 = 60;

/// The reporter thread's life: a look at `watch` at each instant `next_look` gives (a second
/// apart in [`StepWatch::start_reporter`]; a test gives its own), until every clone of the
/// watch is gone.
///
/// A look that panics (a bug in a tracing subscriber or a metrics recorder; nothing of the
/// watch's own can) is contained: logged at ERROR, and the next look writes the gauge anew
/// whatever it finds, so the thread goes on as if restarted and the gauge follows the engine
/// again. The probes never depend on this thread (`Engine::stall` reads the watch itself).
/// The thread's end leaves a true state ([`ReporterEnd`]): the watch gone (the engine ended),
/// no call runs, so a gauge it raised goes back to 0; the thread ended by a panic outside a
/// look (logging a look's panic), the gauge is set to NaN, unknown, and the end is written on
/// standard error, since nothing updates the gauge from then on.
fn report_until_gone(watch: &Weak<Shared>, mut next_look: impl FnMut() -> Instant) {
    let mut end = ReporterEnd(StallReporter::default());
    let mut panics_in_a_row = 0u64;
    loop {
        let now = next_look();
        let Some(shared) = watch.upgrade() else {
            return;
        };
        let watch = StepWatch(shared);
        let reporter = &mut end.0;
        let looked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            reporter.check(&watch, now);
        }));
        match looked {
            Ok(()) => panics_in_a_row = 0,
            Err(payload) => {
                reporter.unsure = true;
                panics_in_a_row += 1;
                if panics_in_a_row <= PANICS_LOGGED_IN_FULL
                    || panics_in_a_row.is_multiple_of(PANICS_LOGGED_EVERY)
                {
                    tracing::error!(
                        panic = %super::executor::panic_message(payload.as_ref()),
                        in_a_row = panics_in_a_row,
                        "a look of the step watch panicked; it looks again in a second and \
                         writes switchyard:engine_stalled anew (the probes do not depend on it)"
                    );
                }
            }
        }
    }
}

/// The reporter thread's state, which leaves a true gauge when the thread ends, however it
/// ends (see [`report_until_gone`]).
struct ReporterEnd(StallReporter);

impl Drop for ReporterEnd {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // A panic in a drop that runs for one would abort the process: nothing escapes.
            let _ = std::panic::catch_unwind(|| {
                metrics::gauge!(names::ENGINE_STALLED).set(f64::NAN);
            });
            let message = "switchyard: the step watch's thread ended by a panic: a stalled \
                           backend call is still answered 503 engine_stalled on /health and \
                           /ready, but no longer logged, and switchyard:engine_stalled reads \
                           NaN (unknown) until the process restarts";
            let _ = std::panic::catch_unwind(|| tracing::error!("{message}"));
            let _ = writeln!(std::io::stderr(), "{message}");
        } else {
            self.0.watch_ended();
        }
    }
}

/// Logs a stall's start and end and keeps the gauge; [`StepWatch::start_reporter`]'s state.
#[derive(Debug, Default)]
struct StallReporter {
    /// The stall reported and not yet over.
    reported: Option<StepStall>,
    /// Whether the gauge may not say what `reported` does (a look panicked before writing
    /// it): the next look writes it, whatever it finds.
    unsure: bool,
}

impl StallReporter {
    /// Looks at `watch` at `now`: logs a stall that began (at ERROR) or ended since the last
    /// look, and sets the gauge.
    fn check(&mut self, watch: &StepWatch, now: Instant) {
        let stall = watch.stall_at(now);
        let same = match (&self.reported, &stall) {
            (Some(old), Some(new)) => old.running.began == new.running.began,
            (None, None) => true,
            _ => false,
        };
        if same && !self.unsure {
            return;
        }
        if !same {
            self.log_change(watch, now, stall.as_ref());
        }
        self.reported = stall;
        // Until the gauge is written: a panic in the recorder leaves the next look to.
        self.unsure = true;
        metrics::gauge!(names::ENGINE_STALLED).set(if stall.is_some() { 1.0 } else { 0.0 });
        self.unsure = false;
    }

    /// Logs the end of the stall reported (if any) and the start of `stall` (if any).
    fn log_change(&self, watch: &StepWatch, now: Instant, stall: Option<&StepStall>) {
        if let Some(old) = &self.reported {
            let still_running = watch
                .running_at(now)
                .is_some_and(|r| r.began == old.running.began);
            if still_running {
                tracing::warn!(
                    call = old.running.call.as_str(),
                    limit_s = watch.limit().map_or(0, |l| l.as_secs()),
                    "the stalled backend call is no longer past scheduler.step_timeout_s (the \
                     limit changed); /health answers 200 again"
                );
            } else {
                // It returned since the last look, a second ago at most.
                let ran = now.saturating_duration_since(watch.started(&old.running));
                tracing::warn!(
                    call = old.running.call.as_str(),
                    ran_s = ran.as_secs(),
                    "the stalled backend call returned after about {} s; the engine steps \
                     again and /health answers 200",
                    ran.as_secs()
                );
            }
        }
        if let Some(new) = stall {
            tracing::error!(
                call = new.running.call.as_str(),
                running_s = new.running.running.as_secs(),
                limit_s = new.limit.as_secs(),
                "the engine is stalled: {new} (a GPU or driver hang, or a deadlock in the \
                 backend?); /health and /ready answer 503 engine_stalled until it returns, and \
                 requests in flight wait for it"
            );
        }
    }

    /// The watch is gone (every clone dropped: the engine ended), so no call runs: a stall
    /// reported is over, and a gauge this reporter raised (or may have) goes back to 0.
    fn watch_ended(&mut self) {
        if let Some(old) = self.reported.take() {
            tracing::warn!(
                call = old.running.call.as_str(),
                "the stalled backend call returned and the engine ended"
            );
        } else if !self.unsure {
            return;
        }
        metrics::gauge!(names::ENGINE_STALLED).set(0.0);
        self.unsure = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: Duration = Duration::from_secs(60);

    /// A call is a stall only while it runs and only once it has run past the limit; an idle
    /// executor, however long idle, is none.
    #[test]
    fn a_call_is_a_stall_only_past_the_limit_while_it_runs() {
        let watch = StepWatch::new(Some(MINUTE));
        let hour_later = Instant::now() + 60 * MINUTE;
        assert_eq!(watch.running_at(hour_later), None, "idle");
        assert_eq!(watch.stall_at(hour_later), None, "idle is no stall");
        let call = watch.begin(BackendCall::Collect);
        let now = Instant::now();
        let running = watch.running_at(now).expect("a call runs");
        assert_eq!(running.call, BackendCall::Collect);
        assert!(running.running < MINUTE, "{running:?}");
        assert_eq!(watch.stall_at(now), None, "not before the limit");
        let later = now + MINUTE + Duration::from_secs(1);
        let stall = watch.stall_at(later).expect("past the limit");
        assert_eq!(stall.running.call, BackendCall::Collect);
        assert_eq!(stall.limit, MINUTE);
        assert!(stall.running.running > MINUTE, "{stall:?}");
        assert!(
            stall.to_string().starts_with(
                "the backend's collect call has run for 61 s, past scheduler.step_timeout_s = 60"
            ),
            "{stall}"
        );
        drop(call);
        assert_eq!(watch.running_at(later), None, "the call returned");
        assert_eq!(watch.stall_at(later), None, "and the stall is over");
    }

    /// No limit (or a zero one) is never a stall; a limit put in force applies to the call
    /// under way.
    #[test]
    fn the_limit_can_be_changed_under_a_running_call() {
        let watch = StepWatch::new(None);
        let _call = watch.begin(BackendCall::Execute);
        let hour_later = Instant::now() + 60 * MINUTE;
        assert_eq!(watch.stall_at(hour_later), None);
        watch.set_limit(Some(MINUTE));
        assert_eq!(watch.limit(), Some(MINUTE));
        assert!(watch.stall_at(hour_later).is_some());
        watch.set_limit(Some(Duration::ZERO));
        assert_eq!(watch.limit(), None, "zero is off");
        assert_eq!(watch.stall_at(hour_later), None);
    }

    /// Every call's kind comes back from the cell, with its own start.
    #[test]
    fn each_call_kind_comes_back_from_the_cell() {
        let watch = StepWatch::new(Some(MINUTE));
        for call in BackendCall::ALL {
            let timing = watch.begin(call);
            let running = watch.running().expect("a call runs");
            assert_eq!(running.call, call);
            drop(timing);
            assert_eq!(watch.running(), None);
        }
    }

    /// The reporter raises the gauge when a stall begins, keeps it while the same call runs,
    /// and lowers it when the call returns, and when a raised limit ends the stall; a new
    /// call past the limit is a new stall.
    #[test]
    fn the_reporter_keeps_the_gauge_with_the_stall() {
        let recorder = crate::testing::OneSeries::new(names::ENGINE_STALLED);
        metrics::with_local_recorder(&recorder, || {
            let watch = StepWatch::new(Some(MINUTE));
            let mut reporter = StallReporter::default();
            let call = watch.begin(BackendCall::Execute);
            let now = Instant::now();
            reporter.check(&watch, now);
            assert_eq!(reporter.reported, None, "not past the limit yet");
            assert_eq!(recorder.gauge(), 0.0);
            let past = now + 2 * MINUTE;
            reporter.check(&watch, past);
            assert!(reporter.reported.is_some());
            assert_eq!(recorder.gauge(), 1.0, "stalled");
            reporter.check(&watch, past + Duration::from_secs(1));
            assert_eq!(recorder.gauge(), 1.0, "still stalled");
            drop(call);
            reporter.check(&watch, past + Duration::from_secs(2));
            assert_eq!(reporter.reported, None);
            assert_eq!(recorder.gauge(), 0.0, "the call returned");

            let _call = watch.begin(BackendCall::Submit);
            let past = Instant::now() + 2 * MINUTE;
            reporter.check(&watch, past);
            assert_eq!(
                reporter.reported.map(|s| s.running.call),
                Some(BackendCall::Submit)
            );
            assert_eq!(recorder.gauge(), 1.0, "a new stall");
            watch.set_limit(Some(10 * MINUTE));
            reporter.check(&watch, past);
            assert_eq!(reporter.reported, None);
            assert_eq!(recorder.gauge(), 0.0, "the limit was raised past the call");
        });
    }

    /// A running call reads as its kind and its time, as a command waiting for the backend's
    /// release names it.
    #[test]
    fn a_running_call_names_its_kind_and_time() {
        let watch = StepWatch::new(None);
        let _drop = watch.begin(BackendCall::Drop);
        let running = watch
            .running_at(Instant::now() + MINUTE + Duration::from_secs(1))
            .expect("a call runs");
        assert_eq!(
            running.to_string(),
            "the backend's drop call, under way for 61 s"
        );
    }

    /// A view of the watch sees the call under way while the watch lives, and keeps nothing
    /// alive.
    #[test]
    fn a_view_sees_the_running_call_while_the_watch_lives() {
        let watch = StepWatch::new(None);
        let view = watch.view();
        assert_eq!(view.running(), None, "idle");
        let call = watch.begin(BackendCall::Drop);
        assert_eq!(view.running().map(|r| r.call), Some(BackendCall::Drop));
        drop(call);
        drop(watch);
        assert_eq!(view.running(), None, "the watch is gone");
        assert_eq!(WatchView::default().running(), None, "no watch");
    }

    /// The watch of a stalled call under way, past its one-minute limit at the instant
    /// returned, and the weak reference the reporter thread holds. The call is marked for
    /// good (its guard forgotten); [`end_call`] ends it.
    fn stalled_watch() -> (StepWatch, Weak<Shared>, Instant) {
        let watch = StepWatch::new(Some(MINUTE));
        std::mem::forget(watch.begin(BackendCall::Collect));
        let weak = Arc::downgrade(&watch.0);
        (watch, weak, Instant::now() + 2 * MINUTE)
    }

    /// Ends the call under way, as its guard's drop does.
    fn end_call(watch: &StepWatch) {
        watch.0.current.store(0, Ordering::Release);
    }

    /// Runs the reporter over a stalled watch, one second a look, whose call returns and
    /// whose watch is dropped at look `end_at`: the gauge `recorder` held at each look.
    fn gauges_until_the_call_ends(recorder: &crate::testing::OneSeries, end_at: u64) -> Vec<f64> {
        let (watch, weak, past) = stalled_watch();
        let mut watch = Some(watch);
        let mut seen = Vec::new();
        let mut looks = 0;
        report_until_gone(&weak, || {
            seen.push(recorder.gauge());
            looks += 1;
            if looks == end_at {
                let watch = watch.take().expect("the watch");
                end_call(&watch);
            }
            past + Duration::from_secs(looks)
        });
        seen
    }

    /// Regression: the reporter thread ended (the engine gone) while a stall was flagged, and
    /// `switchyard:engine_stalled` stayed at 1 for good. Here the stalled call returns and the
    /// engine ends within one look: the end lowers the gauge.
    #[test]
    fn the_watchs_end_lowers_the_gauge_of_a_stall_it_flagged() {
        let recorder = crate::testing::OneSeries::new(names::ENGINE_STALLED);
        metrics::with_local_recorder(&recorder, || {
            let seen = gauges_until_the_call_ends(&recorder, 3);
            assert_eq!(
                seen,
                [0.0, 1.0, 1.0],
                "stalled at the first look, then kept"
            );
            assert_eq!(recorder.gauge(), 0.0, "lowered at the watch's end");
        });
    }

    /// A watch that ends with no stall flagged leaves the gauge alone (another engine's, in
    /// a process that has one).
    #[test]
    fn the_watchs_end_without_a_stall_writes_nothing() {
        let recorder = crate::testing::OneSeries::new(names::ENGINE_STALLED);
        metrics::with_local_recorder(&recorder, || {
            metrics::gauge!(names::ENGINE_STALLED).set(1.0);
            let watch = StepWatch::new(Some(MINUTE));
            let weak = Arc::downgrade(&watch.0);
            let mut watch = Some(watch);
            report_until_gone(&weak, || {
                drop(watch.take());
                Instant::now()
            });
            assert_eq!(recorder.gauge(), 1.0, "not this watch's to lower");
        });
    }

    /// A look that panics (here the recorder, on the stall's gauge write) does not end the
    /// reporter: the next look writes the gauge it could not, though the stall is the same
    /// one, and the end lowers it.
    #[test]
    fn a_panicking_look_is_contained_and_the_next_writes_the_gauge() {
        let recorder = crate::testing::OneSeries::panicking(names::ENGINE_STALLED, 1);
        metrics::with_local_recorder(&recorder, || {
            let seen = gauges_until_the_call_ends(&recorder, 4);
            assert_eq!(
                seen,
                [0.0, 0.0, 1.0, 1.0],
                "the first look's write panicked, the second's was made"
            );
            assert_eq!(recorder.gauge(), 0.0, "lowered at the watch's end");
        });
    }

    /// A panic that ends the reporter thread itself (outside a look: here the clock it is
    /// given) leaves the gauge unknown, NaN, rather than the 1 or 0 it held, which nothing
    /// would update any more; the probes still see the stall, from the watch itself.
    #[test]
    fn a_reporter_ended_by_a_panic_leaves_the_gauge_unknown() {
        let recorder = crate::testing::OneSeries::new(names::ENGINE_STALLED);
        metrics::with_local_recorder(&recorder, || {
            let (watch, weak, past) = stalled_watch();
            let mut looks = 0;
            let ended = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                report_until_gone(&weak, || {
                    looks += 1;
                    assert!(looks < 3, "the reporter's clock broke");
                    past
                });
            }));
            assert!(ended.is_err(), "the panic came through");
            assert!(recorder.gauge().is_nan(), "{}", recorder.gauge());
            assert!(watch.stall_at(past).is_some(), "the probes' answer");
        });
    }
}
