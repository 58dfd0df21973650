//! Switchyard's scheduling core: request state, the KV block allocator with automatic
//! prefix caching, the continuous-batching step planner and the policy plugins.
//!
//! Synchronous, deterministic and IO-free: time is passed in, randomness only enters
//! through the prefix-hash key. The simulator and the engine run this very code.
//!
//! ```
//! use std::sync::Arc;
//! use switchyard_policies::*;
//!
//! let policy = PolicyRegistry::with_builtins()
//!     .create("fcfs", &serde_yaml::Value::Null, &[])
//!     .unwrap();
//! let config = SchedulerConfig { num_gpu_blocks: 64, ..SchedulerConfig::default() };
//! let mut sched = Scheduler::new(config, policy, [1, 2]).unwrap();
//! sched
//!     .add_request(Request {
//!         id: RequestId(1),
//!         tenant: "acme".into(),
//!         tier: String::new(),
//!         priority: 0,
//!         lora_adapter: None,
//!         arrival: Timestamp(0),
//!         slo: SloTargets::default(),
//!         prompt: Arc::from(vec![7u32; 40]),
//!         limits: SamplingLimits { max_tokens: 2, ..SamplingLimits::default() },
//!         cache_salt: None,
//!     })
//!     .unwrap();
//! let mut now = Timestamp(0);
//! while sched.has_unfinished() {
//!     let plan = sched.schedule(now);
//!     let outputs: Vec<StepOutput> = plan
//!         .seqs
//!         .iter()
//!         .filter(|s| s.samples)
//!         .map(|s| StepOutput::new(s.id, 42))
//!         .collect();
//!     now = now.saturating_add(1_000);
//!     sched.apply_outputs(&plan, &outputs, now);
//! }
//! assert_eq!(sched.output_tokens(RequestId(1)), Some(&[42, 42][..]));
//! ```

mod adapter_slots;
pub mod block_ledger;
pub mod block_pool;
pub mod error;
pub mod host_tier;
pub mod metric_names;
#[path = "../../support/nearest_name.rs"]
mod nearest_name;
mod planner;
pub mod policy;
pub mod prefix_hash;
mod prefix_lookup;
mod queue_deadline;
pub mod rate_limit;
pub mod scheduler;
pub mod sequence;
#[path = "../../support/short_number.rs"]
mod short_number;
pub mod speculative;
mod tier_quota;
pub mod types;

pub use block_ledger::{BlockLedger, KvCommit, PENDING_BLOCK, RELEASED_BLOCK};
pub use block_pool::BlockPool;
pub use error::{PolicyError, SchedulerError};
pub use host_tier::HostTier;
pub use policy::{
    ChunkedPrefill, FairShare, Fcfs, Mlfq, Policy, PolicyEvent, PolicyFactory, PolicyRegistry,
    PrefixAware, PriorityPolicy, Rank, SloAware, StepContext, MAX_PREFIX_LOOKUPS,
};
pub use prefix_hash::{BlockHasher, HashExtras, PrefixHash};
pub use scheduler::{validate_config, IdHasher, IdMap, Scheduler};
pub use sequence::SeqView;
pub use speculative::DraftSource;
pub use tier_quota::{tier_kv_blocks, QuotaChange};
pub use types::*;
