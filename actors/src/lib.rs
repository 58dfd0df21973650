//! The serving engine. [`EngineCore`] is the synchronous step loop (plan, execute, apply) shared
//! by offline generation, the throughput benchmark and the scheduler actor; the actix actors that
//! wrap it for the server live beside it.

pub mod actors;
mod beam;
mod core;
mod detokenizer;
mod error;
pub mod metric_names;
mod productive;
pub mod structured;
#[cfg(test)]
mod testing;
pub mod token_filters;

pub use crate::beam::MAX_BEAM_WIDTH;
pub use crate::core::{
    AsyncScheduling, CoreEvent, EngineCore, EngineCoreConfig, KvCopies, PreparedStep, StepCore,
    StepReport, SubmitOptions,
};
pub use crate::detokenizer::{Detokenized, IncrementalDetokenizer};
pub use crate::error::EngineError;
