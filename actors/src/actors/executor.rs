//! The executor actor: owns the backend on a dedicated thread (a one-thread `SyncArbiter`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use actix::{Actor, Handler, Message, SyncContext};
use switchyard_gpu::backend::{Backend, Batch, SeqOutput};
use switchyard_gpu::GpuError;

use super::step_watch::{BackendCall, RunningCall, StepWatch, WatchView};
use crate::core::KvCopies;

/// A batch's outputs and the time the backend took, so the scheduler can tell its own
/// overhead from model time.
pub struct Executed {
    /// One output per sequence of the batch.
    pub outputs: Vec<SeqOutput>,
    /// Microseconds inside `Backend::execute`.
    pub execute_us: u64,
    /// The batch, returned so the scheduler can reuse its buffers for the next step.
    pub batch: Batch,
}

/// Runs one batch after dropping the state of sequences that ended.
#[derive(Message)]
#[rtype(result = "Result<Executed, GpuError>")]
pub struct Execute {
    /// The batch.
    pub batch: Batch,
    /// Sequences whose per-sequence backend state must be released first.
    pub release: Vec<u64>,
    /// KV copies between the cache and the host tier, made in order before the batch; a
    /// failed copy fails the step.
    pub kv_copies: Vec<KvCopies>,
}

/// Starts a batch without waiting for its outputs (asynchronous scheduling, backends that
/// pipeline), after dropping the state of sequences that ended; [`CollectStep`] brings them.
#[derive(Message)]
#[rtype(result = "Result<Submitted, GpuError>")]
pub struct SubmitStep {
    /// The batch; it may feed pending tokens of the step submitted before.
    pub batch: Batch,
    /// Sequences whose per-sequence backend state must be released first.
    pub release: Vec<u64>,
    /// KV copies between the cache and the host tier, made in order before the batch is
    /// submitted (after the steps submitted before it); a failed copy fails the step.
    pub kv_copies: Vec<KvCopies>,
}

/// A submitted batch, returned for reuse.
pub struct Submitted {
    /// The batch.
    pub batch: Batch,
    /// Microseconds inside `Backend::submit`.
    pub submit_us: u64,
}

/// The outputs of the oldest submitted batch.
#[derive(Message)]
#[rtype(result = "Result<Collected, GpuError>")]
pub struct CollectStep;

/// Outputs of a submitted batch.
pub struct Collected {
    /// One output per sequence of the batch.
    pub outputs: Vec<SeqOutput>,
    /// Microseconds waiting inside `Backend::collect`.
    pub wait_us: u64,
}

/// Collects and drops the outputs of every submitted batch (after a failure, so the next
/// [`CollectStep`] answers for the next submitted batch).
#[derive(Message)]
#[rtype(result = "()")]
pub struct DiscardSteps;

/// Releases the state of sequences that ended, outside a step (the engine went idle).
#[derive(Message)]
#[rtype(result = "()")]
pub struct ReleaseSequences(pub Vec<u64>);

/// Set once the executor has dropped its backend (the weights, the KV cache and, on CUDA, the
/// streams and the context): from then on the process may end. The executor's thread drops it
/// when the engine's actors are gone (their actix system dropped), on its own time, so a
/// command waits for this before it returns: a CUDA backend still alive on that thread while
/// the process's exit handlers tear the CUDA libraries down ended `run-batch` on an H100 with
/// a SIGSEGV after its last line was written.
#[derive(Clone, Default)]
pub struct BackendReleased {
    /// Whether the backend is dropped, and the waiters' wake-up.
    state: Arc<(parking_lot::Mutex<bool>, parking_lot::Condvar)>,
    /// The executor's stall watch, seen without keeping it alive: what holds the backend
    /// ([`Self::holder`]).
    watch: WatchView,
}

impl BackendReleased {
    /// Says which backend call of the executor's holds the backend ([`Self::holder`]), as
    /// `watch` marks them.
    pub(super) fn watching(watch: &StepWatch) -> Self {
        Self {
            state: Arc::default(),
            watch: watch.view(),
        }
    }

    /// The backend call under way on the executor's thread while the backend is not yet
    /// released: a step that has not returned, or the backend's own drop
    /// ([`BackendCall::Drop`]). `None` once it is released, when no call runs, and when the
    /// engine has no watch. What a command that waits for the release names when it waits
    /// long.
    pub fn holder(&self) -> Option<RunningCall> {
        self.watch.running()
    }

    /// Waits until the backend is dropped, at most `timeout`; whether it was.
    pub fn wait(&self, timeout: Duration) -> bool {
        let (released, dropped) = &*self.state;
        let mut released = released.lock();
        if !*released {
            // A spurious wake-up ends the wait early; the flag, not the wake-up, answers.
            let _ = dropped.wait_while_for(&mut released, |r| !*r, timeout);
        }
        *released
    }

    /// Whether the backend is dropped.
    pub fn is_released(&self) -> bool {
        *self.state.0.lock()
    }

    fn notify(&self) {
        let (released, dropped) = &*self.state;
        *released.lock() = true;
        dropped.notify_all();
    }
}

impl std::fmt::Debug for BackendReleased {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendReleased")
            .field("released", &self.is_released())
            .field("holder", &self.holder())
            .finish()
    }
}

/// Notifies its [`BackendReleased`] when dropped, unwinding included.
struct NotifyOnDrop(Option<BackendReleased>);

impl Drop for NotifyOnDrop {
    fn drop(&mut self) {
        if let Some(r) = &self.0 {
            r.notify();
        }
    }
}

/// Holds the backend; lives on its own OS thread.
pub struct ExecutorActor {
    /// The backend; `None` once retired after a panic it does not recover from
    /// ([`Backend::recovers_from_panics`]).
    backend: Option<Box<dyn Backend>>,
    /// Batches submitted and not collected.
    submitted: usize,
    /// Set false when the backend is retired (the engine's liveness).
    alive: Option<Arc<AtomicBool>>,
    /// Set once the backend is dropped (with the actor).
    released: Option<BackendReleased>,
    /// Where each backend call's start and end are marked (the engine's stall watch).
    watch: Option<StepWatch>,
}

impl Drop for ExecutorActor {
    /// Drops the backend, marked in the stall watch as [`BackendCall::Drop`] (a drop stuck on
    /// the device is named by whoever waits for it), then says it is released.
    fn drop(&mut self) {
        let _notify = NotifyOnDrop(self.released.take());
        if let Some(backend) = self.backend.take() {
            let _timing = self.watch.as_ref().map(|w| w.begin(BackendCall::Drop));
            drop(backend);
        }
    }
}

impl ExecutorActor {
    /// Wraps a backend.
    pub fn new(backend: Option<Box<dyn Backend>>) -> Self {
        Self {
            backend,
            submitted: 0,
            alive: None,
            released: None,
            watch: None,
        }
    }

    /// Marks the start and end of every backend call in `watch`, so that a call that does not
    /// return is seen from other threads ([`StepWatch::stall`]).
    pub fn watched_by(mut self, watch: StepWatch) -> Self {
        self.watch = Some(watch);
        self
    }

    /// Sets `released` once the backend is dropped, with the actor.
    pub fn releasing(mut self, released: BackendReleased) -> Self {
        self.released = Some(released);
        self
    }

    /// Clears `alive` if the backend is ever retired.
    pub fn reporting_to(mut self, alive: Arc<AtomicBool>) -> Self {
        alive.store(self.backend.is_some(), Ordering::Release);
        self.alive = Some(alive);
        self
    }

    /// Runs `f` on the backend, marked in the stall watch as `call`; see [`contained`].
    fn call<T>(
        &mut self,
        call: BackendCall,
        f: impl FnOnce(&mut dyn Backend) -> Result<T, GpuError>,
    ) -> Result<T, GpuError> {
        let timing = self.watch.as_ref().map(|w| w.begin(call));
        let result = contained(&mut self.backend, call.as_str(), f);
        drop(timing);
        if self.backend.is_none() {
            if let Some(alive) = &self.alive {
                alive.store(false, Ordering::Release);
            }
        }
        result
    }

    /// Makes a step's KV copies (cache ↔ host tier), in order.
    fn copy_kv(&mut self, copies: &[KvCopies]) -> Result<(), GpuError> {
        if copies.iter().all(KvCopies::is_empty) {
            return Ok(());
        }
        self.call(BackendCall::CopyKv, |b| KvCopies::run_all(copies, b))
    }

    /// Frees the state of the finished sequences in `release` (every batch message carries
    /// them, to be released before the batch runs). A failure here is logged, not the step's.
    fn release(&mut self, release: Vec<u64>) {
        for id in release {
            if let Err(e) = self.call(BackendCall::Release, |b| {
                b.release(id);
                Ok(())
            }) {
                tracing::warn!(seq = id, error = %e, "releasing a sequence's state failed");
            }
        }
    }
}

/// The error of every call once the backend is retired.
fn retired() -> GpuError {
    GpuError::Internal(
        "the backend was retired after a panic (see the log); restart the server".into(),
    )
}

/// A caught panic's message (a `&str` or `String` payload, as `panic!` makes them).
pub(super) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Runs a backend call, turning a panic inside it into an error for the step. A backend must
/// return errors, so a panic is a bug; containing it fails that step's requests (they get an
/// error) instead of ending the executor thread, which would leave every later step waiting.
/// The panic hook has already printed the message and, with `RUST_BACKTRACE`, where it
/// happened. A backend that does not [`Backend::recovers_from_panics`] is retired: every later
/// call fails with [`retired`]'s error.
fn contained<T>(
    slot: &mut Option<Box<dyn Backend>>,
    call: &str,
    f: impl FnOnce(&mut dyn Backend) -> Result<T, GpuError>,
) -> Result<T, GpuError> {
    let backend = slot.as_deref_mut().ok_or_else(retired)?;
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(backend))) {
        Ok(result) => result,
        Err(payload) => {
            let message = panic_message(payload.as_ref());
            let retire = !slot.as_deref().is_some_and(|b| b.recovers_from_panics());
            tracing::error!(call, panic = %message, retire, "the backend panicked; failing the step");
            if retire {
                *slot = None;
            }
            Err(GpuError::Internal(format!(
                "the backend panicked in {call}: {message}"
            )))
        }
    }
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl Handler<Execute> for ExecutorActor {
    type Result = Result<Executed, GpuError>;

    fn handle(&mut self, msg: Execute, _: &mut SyncContext<Self>) -> Self::Result {
        self.release(msg.release);
        let start = std::time::Instant::now();
        self.copy_kv(&msg.kv_copies)?;
        let outputs = self.call(BackendCall::Execute, |b| b.execute(&msg.batch))?;
        Ok(Executed {
            outputs,
            execute_us: start.elapsed().as_micros() as u64,
            batch: msg.batch,
        })
    }
}

impl Handler<SubmitStep> for ExecutorActor {
    type Result = Result<Submitted, GpuError>;

    fn handle(&mut self, msg: SubmitStep, _: &mut SyncContext<Self>) -> Self::Result {
        self.release(msg.release);
        let start = std::time::Instant::now();
        self.copy_kv(&msg.kv_copies)?;
        self.call(BackendCall::Submit, |b| b.submit(&msg.batch))?;
        self.submitted += 1;
        Ok(Submitted {
            batch: msg.batch,
            submit_us: start.elapsed().as_micros() as u64,
        })
    }
}

impl Handler<CollectStep> for ExecutorActor {
    type Result = Result<Collected, GpuError>;

    fn handle(&mut self, _: CollectStep, _: &mut SyncContext<Self>) -> Self::Result {
        let start = std::time::Instant::now();
        let outputs = self.call(BackendCall::Collect, |b| b.collect());
        self.submitted = self.submitted.saturating_sub(1);
        Ok(Collected {
            outputs: outputs?,
            wait_us: start.elapsed().as_micros() as u64,
        })
    }
}

impl Handler<ReleaseSequences> for ExecutorActor {
    type Result = ();

    fn handle(&mut self, msg: ReleaseSequences, _: &mut SyncContext<Self>) {
        self.release(msg.0);
    }
}

impl Handler<DiscardSteps> for ExecutorActor {
    type Result = ();

    fn handle(&mut self, _: DiscardSteps, _: &mut SyncContext<Self>) {
        while self.submitted > 0 {
            self.submitted -= 1;
            if self.backend.is_none() {
                continue;
            }
            if let Err(e) = self.call(BackendCall::Collect, |b| b.collect()) {
                tracing::warn!(error = %e, "dropping a submitted step failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use actix::SyncArbiter;
    use switchyard_gpu::backend::SeqInput;

    use super::*;

    /// Panics on its first batch, then echoes one token per sequence; `recovers` is its
    /// answer to `recovers_from_panics`.
    struct PanicsOnce {
        panicked: bool,
        recovers: bool,
    }

    impl Backend for PanicsOnce {
        fn name(&self) -> &str {
            "panics-once"
        }
        fn recovers_from_panics(&self) -> bool {
            self.recovers
        }
        fn num_kv_blocks(&self) -> usize {
            8
        }
        fn block_size(&self) -> usize {
            4
        }
        fn max_batch_tokens(&self) -> usize {
            64
        }
        fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
            if !std::mem::replace(&mut self.panicked, true) {
                panic!("chunk size must be non-zero");
            }
            Ok(batch
                .seqs
                .iter()
                .map(|s| SeqOutput {
                    seq_id: s.seq_id,
                    accepted: Vec::new(),
                    token: Some(1),
                    logprob: None,
                    top_logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    hidden: None,
                })
                .collect())
        }
        fn release(&mut self, _: u64) {}
    }

    fn batch() -> Batch {
        Batch {
            seqs: vec![SeqInput {
                seq_id: 3,
                num_computed_tokens: 0,
                tokens: vec![5],
                block_table: vec![0],
                sample: true,
                num_drafts: 0,
                sampling: Default::default(),
                adapter: None,
                cached_prompt: None,
            }],
        }
    }

    /// A backend whose drop takes `delay` (a CUDA backend's frees memory and destroys streams
    /// and the context: not instant), then sets `dropped`, or panics when `panics`.
    struct DropProbe {
        inner: PanicsOnce,
        delay: std::time::Duration,
        dropped: Arc<AtomicBool>,
        panics: bool,
    }

    impl DropProbe {
        fn new(delay_ms: u64, panics: bool) -> (Self, Arc<AtomicBool>) {
            let dropped = Arc::new(AtomicBool::new(false));
            let probe = Self {
                inner: PanicsOnce {
                    panicked: true,
                    recovers: true,
                },
                delay: std::time::Duration::from_millis(delay_ms),
                dropped: dropped.clone(),
                panics,
            };
            (probe, dropped)
        }
    }

    impl Drop for DropProbe {
        fn drop(&mut self) {
            std::thread::sleep(self.delay);
            assert!(!self.panics, "the backend's drop failed");
            self.dropped.store(true, Ordering::SeqCst);
        }
    }

    impl Backend for DropProbe {
        fn name(&self) -> &str {
            "drop-probe"
        }
        crate::testing::inner_backend_shape!();
        fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
            self.inner.execute(batch)
        }
        fn release(&mut self, _: u64) {}
    }

    /// The executor's thread drops the backend once the actix system that holds its address
    /// is gone, on its own time: `BackendReleased` is set only after the backend's drop
    /// ended, and waiting on it is what lets a command outlive that drop.
    #[test]
    fn backend_released_is_set_after_the_backend_is_dropped() {
        let (probe, dropped) = DropProbe::new(300, false);
        let probe = parking_lot::Mutex::new(Some(probe));
        let released = BackendReleased::default();
        let system = actix::System::new();
        let notice = released.clone();
        system.block_on(async move {
            let executor = SyncArbiter::start(1, move || {
                let backend = probe.lock().take().expect("one executor thread");
                ExecutorActor::new(Some(Box::new(backend))).releasing(notice.clone())
            });
            let r = executor
                .send(Execute {
                    batch: batch(),
                    release: Vec::new(),
                    kv_copies: Vec::new(),
                })
                .await
                .expect("the executor answers");
            assert!(r.is_ok(), "the step runs");
        });
        assert!(
            !released.is_released(),
            "the system still runs the executor"
        );
        drop(system);
        // The drop takes 300 ms on the executor's thread: not over yet when the system goes.
        assert!(released.wait(std::time::Duration::from_secs(60)));
        assert!(
            dropped.load(Ordering::SeqCst),
            "released only after the drop ended"
        );
        assert!(released.wait(std::time::Duration::ZERO), "and it stays set");
    }

    /// A backend that panics in its drop still sets `BackendReleased` (the process may end:
    /// nothing is left to wait for).
    #[test]
    fn backend_released_is_set_when_the_drop_panics() {
        let (probe, dropped) = DropProbe::new(0, true);
        let released = BackendReleased::default();
        let actor = ExecutorActor::new(Some(Box::new(probe))).releasing(released.clone());
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(actor)));
        assert!(outcome.is_err(), "the drop's panic comes through");
        assert!(!dropped.load(Ordering::SeqCst));
        assert!(released.is_released());
    }

    /// A step's KV copies run before its batch, and a failed copy fails the step (the batch
    /// does not run): here a backend without a host tier is asked for one.
    #[actix::test]
    async fn a_failed_kv_copy_fails_its_step_before_the_batch_runs() {
        let executor = SyncArbiter::start(1, || {
            ExecutorActor::new(Some(Box::new(PanicsOnce {
                panicked: true,
                recovers: true,
            })))
        });
        let copies = |n: u32| KvCopies {
            offloads: vec![switchyard_gpu::KvCopy { device: n, host: 0 }],
            loads: Vec::new(),
            stores: Vec::new(),
        };
        for kv_copies in [vec![copies(1)], vec![KvCopies::default(), copies(2)]] {
            let r = executor
                .send(Execute {
                    batch: batch(),
                    release: Vec::new(),
                    kv_copies: kv_copies.clone(),
                })
                .await
                .expect("the executor answers");
            match r {
                Err(e) => assert!(e.to_string().contains("no host KV tier"), "{e}"),
                Ok(_) => panic!("a step whose copy failed ran"),
            }
            let r = executor
                .send(SubmitStep {
                    batch: batch(),
                    release: Vec::new(),
                    kv_copies,
                })
                .await
                .expect("the executor answers");
            assert!(r.is_err(), "a submit whose copy failed went ahead");
        }
        // No copies: the step runs.
        let ok = executor
            .send(Execute {
                batch: batch(),
                release: Vec::new(),
                kv_copies: vec![KvCopies::default()],
            })
            .await
            .expect("the executor answers");
        assert!(ok.is_ok());
    }

    #[actix::test]
    async fn a_backend_panic_fails_its_step_and_the_executor_goes_on() {
        let executor = SyncArbiter::start(1, || {
            ExecutorActor::new(Some(Box::new(PanicsOnce {
                panicked: false,
                recovers: true,
            })))
        });
        let first = executor
            .send(Execute {
                batch: batch(),
                release: Vec::new(),
                kv_copies: Vec::new(),
            })
            .await
            .expect("the executor answers");
        match first {
            Err(GpuError::Internal(m)) => assert!(m.contains("chunk size must be non-zero"), "{m}"),
            Err(e) => panic!("unexpected error {e}"),
            Ok(_) => panic!("the panicking step succeeded"),
        }
        let second = executor
            .send(Execute {
                batch: batch(),
                release: Vec::new(),
                kv_copies: Vec::new(),
            })
            .await
            .expect("the executor still answers")
            .expect("the next step runs on the same backend");
        assert_eq!(second.outputs.len(), 1);
        assert_eq!(second.outputs[0].token, Some(1));
    }

    #[actix::test]
    async fn a_backend_that_does_not_recover_is_retired_after_a_panic() {
        let alive = Arc::new(AtomicBool::new(false));
        let flag = alive.clone();
        let executor = SyncArbiter::start(1, move || {
            ExecutorActor::new(Some(Box::new(PanicsOnce {
                panicked: false,
                recovers: false,
            })))
            .reporting_to(flag.clone())
        });
        assert!(
            executor.send(DiscardSteps).await.is_ok() && alive.load(Ordering::Acquire),
            "alive while the backend is held"
        );
        for expected in ["chunk size must be non-zero", "retired after a panic"] {
            let r = executor
                .send(Execute {
                    batch: batch(),
                    release: vec![1],
                    kv_copies: Vec::new(),
                })
                .await
                .expect("the executor answers");
            match r {
                Err(GpuError::Internal(m)) => assert!(m.contains(expected), "{m}"),
                Err(e) => panic!("unexpected error {e}"),
                Ok(_) => panic!("a step ran on a retired backend"),
            }
        }
        assert!(
            !alive.load(Ordering::Acquire),
            "the engine reports the retirement"
        );
    }

    /// A backend whose drop says it began on `entered`, then waits for a message on `gate`
    /// or for its sender to be dropped: a release stuck on the device, for as long as a test
    /// wants. It runs no step.
    struct GatedDrop {
        entered: std::sync::mpsc::Sender<()>,
        gate: std::sync::mpsc::Receiver<()>,
    }

    impl Drop for GatedDrop {
        fn drop(&mut self) {
            let _ = self.entered.send(());
            let _ = self.gate.recv();
        }
    }

    impl Backend for GatedDrop {
        fn name(&self) -> &str {
            "gated-drop"
        }
        fn num_kv_blocks(&self) -> usize {
            8
        }
        fn block_size(&self) -> usize {
            4
        }
        fn max_batch_tokens(&self) -> usize {
            64
        }
        fn execute(&mut self, _: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
            Err(GpuError::Internal("no step runs here".into()))
        }
        fn release(&mut self, _: u64) {}
    }

    /// The backend's drop at the engine's end is a watched call: while it runs, what waits
    /// for the release sees that the drop holds it (and the watch would flag it past the
    /// limit); once it is over the backend is released and no call runs.
    #[test]
    fn the_backends_drop_is_watched_and_named_as_the_releases_holder() {
        let (entered_tx, entered) = std::sync::mpsc::channel();
        let (gate, gate_rx) = std::sync::mpsc::channel::<()>();
        let watch = StepWatch::new(Some(Duration::from_secs(60)));
        let released = BackendReleased::watching(&watch);
        let executor = ExecutorActor::new(Some(Box::new(GatedDrop {
            entered: entered_tx,
            gate: gate_rx,
        })))
        .releasing(released.clone())
        .watched_by(watch.clone());
        drop(watch);
        assert_eq!(released.holder(), None, "no call runs yet");
        let dropping = std::thread::spawn(move || drop(executor));
        entered
            .recv_timeout(Duration::from_secs(30))
            .expect("the backend's drop began");
        let holder = released.holder().expect("the drop holds the backend");
        assert_eq!(holder.call, BackendCall::Drop);
        assert!(!released.is_released());
        drop(gate);
        dropping.join().expect("the drop ended");
        assert!(released.is_released());
        assert_eq!(released.holder(), None, "released: nothing holds it");
    }
}
