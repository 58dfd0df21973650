//! The executor actor: owns the backend on a dedicated thread (a one-thread `SyncArbiter`).

use actix::{Actor, Handler, Message, SyncContext};
use switchyard_gpu::backend::{Backend, Batch, SeqOutput};
use switchyard_gpu::GpuError;

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

/// Holds the backend; lives on its own OS thread.
pub struct ExecutorActor {
    /// The backend; `None` only if the executor thread was restarted after a panic, since the
    /// backend cannot be rebuilt here.
    backend: Option<Box<dyn Backend>>,
    /// Batches submitted and not collected.
    submitted: usize,
}

impl ExecutorActor {
    /// Wraps a backend.
    pub fn new(backend: Option<Box<dyn Backend>>) -> Self {
        Self {
            backend,
            submitted: 0,
        }
    }

    fn backend(&mut self) -> Result<&mut Box<dyn Backend>, GpuError> {
        self.backend.as_mut().ok_or_else(|| {
            GpuError::Internal("the executor thread restarted and lost its backend".into())
        })
    }

    /// The backend, once the state of the finished sequences in `release` is freed (every
    /// batch message carries them, to be released before the batch runs).
    fn backend_releasing(&mut self, release: Vec<u64>) -> Result<&mut Box<dyn Backend>, GpuError> {
        let backend = self.backend()?;
        for id in release {
            backend.release(id);
        }
        Ok(backend)
    }
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl Handler<Execute> for ExecutorActor {
    type Result = Result<Executed, GpuError>;

    fn handle(&mut self, msg: Execute, _: &mut SyncContext<Self>) -> Self::Result {
        let backend = self.backend_releasing(msg.release)?;
        let start = std::time::Instant::now();
        let outputs = backend.execute(&msg.batch)?;
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
        let backend = self.backend_releasing(msg.release)?;
        let start = std::time::Instant::now();
        backend.submit(&msg.batch)?;
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
        let outputs = self.backend()?.collect();
        self.submitted = self.submitted.saturating_sub(1);
        Ok(Collected {
            outputs: outputs?,
            wait_us: start.elapsed().as_micros() as u64,
        })
    }
}

impl Handler<DiscardSteps> for ExecutorActor {
    type Result = ();

    fn handle(&mut self, _: DiscardSteps, _: &mut SyncContext<Self>) {
        while self.submitted > 0 {
            self.submitted -= 1;
            if let Some(Err(e)) = self.backend.as_mut().map(|b| b.collect()) {
                tracing::warn!(error = %e, "dropping a submitted step failed");
            }
        }
    }
}
