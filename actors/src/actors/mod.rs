//! The actix actors of the server and the [`Engine`] handle that fronts them.
//!
//! ```text
//! Engine::submit ──► Tokenizer pool ──► Detokenizer (register) ──► Scheduler ◄──► KV allocator
//!                                            ▲                         │  ▲
//!                                            └──── step events ────────┘  │ outputs
//!                                                                      Executor
//! ```
//!
//! Per step the scheduler makes one round trip to the KV allocator (commit the plan's block
//! changes, get the new block ids), one to the executor, and sends one message to the
//! detokenizer. The executor owns the backend on its own thread, so neither the HTTP workers nor
//! the scheduler ever wait on model code.

mod admission;
mod allocator;
mod context_length;
mod detokenizer;
mod engine;
mod executor;
mod lora;
mod lora_dirs;
mod scheduler;
mod step_watch;
mod tokenizer;

pub(crate) use detokenizer::rejection as detokenizer_rejection;

pub use engine::{
    BeamOptions, ChoiceDelta, Engine, EngineConfig, EngineOutput, OutputSink, PromptSource,
    RequestOptions, SubmitError, SubmitErrorKind, TokenLogprobs,
};
pub use executor::BackendReleased;
pub use lora::{AdapterInfo, AdapterUser, LoraError, LoraManagerConfig};
pub use lora_dirs::{FOUND_TTL, MAX_DIR_ENTRIES};
pub use step_watch::{BackendCall, RunningCall, StepStall};
