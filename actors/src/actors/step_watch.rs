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
}

impl BackendCall {
    const ALL: [Self; 5] = [
        Self::Execute,
        Self::Submit,
        Self::Collect,
        Self::CopyKv,
        Self::Release,
    ];

    /// The call's name, as the log and the error messages write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Execute => "execute",
            Self::Submit => "submit",
            Self::Collect => "collect",
            Self::CopyKv => "copy_kv",
            Self::Release => "release",
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

    /// Starts the thread that logs a stall once when it begins and once when it ends, and
    /// keeps [`names::ENGINE_STALLED`], looking every second, so that neither depends on
    /// someone asking `/health`. It ends once every clone of the watch is gone. A thread that
    /// cannot be started is logged (the probes still see a stall; only the log line and the
    /// gauge are missing).
    pub fn start_reporter(&self) {
        let watch: Weak<Shared> = Arc::downgrade(&self.0);
        let started = std::thread::Builder::new()
            .name("step-watch".into())
            .spawn(move || {
                let mut reporter = StallReporter::default();
                loop {
                    std::thread::sleep(REPORT_INTERVAL);
                    let Some(shared) = watch.upgrade() else {
                        return;
                    };
                    reporter.check(&StepWatch(shared), Instant::now());
                }
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

/// Logs a stall's start and end and keeps the gauge; [`StepWatch::start_reporter`]'s state.
#[derive(Debug, Default)]
struct StallReporter {
    /// The stall reported and not yet over.
    reported: Option<StepStall>,
}

impl StallReporter {
    /// Looks at `watch` at `now`: logs a stall that began (at ERROR) or ended since the last
    /// look, and sets the gauge.
    fn check(&mut self, watch: &StepWatch, now: Instant) {
        let stall = watch.stall_at(now);
        let same = |a: &StepStall, b: &StepStall| a.running.began == b.running.began;
        match (&self.reported, &stall) {
            (Some(old), Some(new)) if same(old, new) => return,
            (None, None) => return,
            _ => {}
        }
        if let Some(old) = self.reported.take() {
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
        self.reported = stall;
        metrics::gauge!(names::ENGINE_STALLED).set(if stall.is_some() { 1.0 } else { 0.0 });
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
}
