//! Errors of the engine layer.

/// What can go wrong inside the engine.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The scheduler rejected a request or a configuration.
    #[error(transparent)]
    Scheduler(#[from] switchyard_policies::SchedulerError),
    /// The backend failed to execute a step or to load.
    #[error(transparent)]
    Backend(#[from] switchyard_gpu::GpuError),
    /// A request id was submitted twice.
    #[error("request {0} is already in flight")]
    DuplicateRequest(u64),
    /// The scheduler planned a sequence the engine has no record of (an internal invariant broke).
    #[error("sequence {0} is scheduled but unknown to the engine")]
    UnknownSequence(u64),
    /// A request's adapter id and adapter weights disagree (one given without the other).
    #[error("request {0}: a LoRA adapter id needs its weights and weights need an id")]
    AdapterMismatch(u64),
    /// Admission bounds for tiers the engine does not serve (`Engine::set_tiers` puts a new
    /// tier in force first).
    #[error("no tier {0:?} is in force")]
    UnknownTiers(Vec<String>),
    /// The engine stopped before it could answer.
    #[error("the engine has shut down")]
    ShutDown,
}

impl EngineError {
    /// The message a client is given for this error when it refuses a request: the
    /// scheduler's refusals in the client's terms, with no internal request id (as the server
    /// words them); other errors as they display.
    pub fn client_message(&self) -> String {
        crate::actors::detokenizer_rejection(self).message
    }
}
