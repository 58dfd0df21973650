//! Error types of the scheduling core.
//!
//! [`SchedulerError`] covers configuration, request validation and (for tests and debug
//! builds of the engine) invariant violations; [`PolicyError`] covers the policy registry
//! and policy parameters. Both name the offending field so that a config file or an API
//! request can be fixed from the message alone.

use crate::types::RequestId;

/// Errors raised by [`crate::Scheduler`] and [`crate::BlockPool`].
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SchedulerError {
    /// A scheduler configuration field is out of range.
    #[error("invalid scheduler config field `{field}`: {reason}")]
    InvalidConfig {
        /// Name of the offending field.
        field: &'static str,
        /// Why the value was refused.
        reason: String,
    },
    /// A request with this id is already known to the scheduler.
    #[error("request {0:?} already exists")]
    DuplicateRequest(RequestId),
    /// A request field is out of range.
    #[error("invalid request {id:?}: field `{field}`: {reason}")]
    InvalidRequest {
        /// The request.
        id: RequestId,
        /// Name of the offending field.
        field: &'static str,
        /// Why the value was refused.
        reason: String,
    },
    /// Prompt plus `max_tokens` exceeds the model's context window.
    #[error(
        "request {id:?}: prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds \
         max_model_len ({max_model_len})"
    )]
    TooLong {
        /// The request.
        id: RequestId,
        /// Prompt length in tokens.
        prompt_len: usize,
        /// Requested maximum output tokens.
        max_tokens: usize,
        /// Configured context window.
        max_model_len: usize,
    },
    /// The request could never fit in the KV cache, even alone.
    #[error(
        "request {id:?} needs {needed} KV blocks at its maximum length but the pool only has {capacity}"
    )]
    ExceedsKvCapacity {
        /// The request.
        id: RequestId,
        /// Blocks needed for prompt + max_tokens.
        needed: usize,
        /// Blocks in the whole pool.
        capacity: usize,
    },
    /// The request could never fit under its tier's KV quota
    /// ([`crate::TierSpec::max_kv_fraction`]), even alone.
    #[error(
        "request {id:?} needs {needed} KV blocks at its maximum length but tier `{tier}`'s \
         max_kv_fraction allows {quota}"
    )]
    ExceedsTierKvQuota {
        /// The request.
        id: RequestId,
        /// Its tier.
        tier: String,
        /// Blocks needed for prompt + max_tokens.
        needed: usize,
        /// Blocks the tier's running sequences may hold at once.
        quota: usize,
    },
    /// A block id outside the pool was passed to the allocator.
    #[error("block {0} is not part of the pool")]
    UnknownBlock(u32),
    /// A free block was freed again.
    #[error("block {0} freed while not allocated (double free)")]
    DoubleFree(u32),
    /// An internal consistency check failed (reported by `check_invariants`).
    #[error("scheduler invariant violated: {0}")]
    Invariant(String),
}

/// Errors raised by [`crate::PolicyRegistry`] and policy constructors.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// No policy is registered under this name.
    #[error("unknown scheduling policy `{name}`{did_you_mean}; known policies: {known}")]
    UnknownPolicy {
        /// The requested name.
        name: String,
        /// ` (did you mean `x`?)` for the known name `x` that `name` most likely misspells,
        /// else empty.
        did_you_mean: String,
        /// Comma-separated list of registered names.
        known: String,
    },
    /// A policy was registered twice under the same name.
    #[error("scheduling policy `{0}` is already registered")]
    DuplicateName(String),
    /// A policy parameter is missing a valid value.
    #[error("policy `{policy}`: parameter `{field}`: {reason}")]
    InvalidParam {
        /// The policy being configured.
        policy: &'static str,
        /// Name of the offending parameter.
        field: String,
        /// Why the value was refused.
        reason: String,
    },
}
