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

/// Holds the backend; lives on its own OS thread.
pub struct ExecutorActor {
    /// The backend; `None` only if the executor thread was restarted after a panic, since the
    /// backend cannot be rebuilt here.
    backend: Option<Box<dyn Backend>>,
}

impl ExecutorActor {
    /// Wraps a backend.
    pub fn new(backend: Option<Box<dyn Backend>>) -> Self {
        Self { backend }
    }
}

impl Actor for ExecutorActor {
    type Context = SyncContext<Self>;
}

impl Handler<Execute> for ExecutorActor {
    type Result = Result<Executed, GpuError>;

    fn handle(&mut self, msg: Execute, _: &mut SyncContext<Self>) -> Self::Result {
        let backend = self.backend.as_mut().ok_or_else(|| {
            GpuError::Internal("the executor thread restarted and lost its backend".into())
        })?;
        for id in msg.release {
            backend.release(id);
        }
        let start = std::time::Instant::now();
        let outputs = backend.execute(&msg.batch)?;
        Ok(Executed {
            outputs,
            execute_us: start.elapsed().as_micros() as u64,
            batch: msg.batch,
        })
    }
}
