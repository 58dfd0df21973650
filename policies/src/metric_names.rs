//! Names of the metrics the engine records through the `metrics` crate, and their labels:
//! the one vocabulary of the engine (`switchyard_actors::metric_names`, which records under
//! these names and creates the series) and the HTTP layer (`switchyard_api::metrics`, which
//! describes them and serves `/metrics`), the crate both depend on holding it. Only names:
//! this crate records nothing. The request-level ones mirror vLLM's production metrics under the
//! `switchyard:` prefix with the same meaning and units; the `engine_*` ones are Switchyard's
//! own. Labels are bounded: `finished_reason` is `stop` or `length` (the end-of-sequence token
//! is a `stop`), `reason` is the kind of error (a fixed set), `tier` and `tenant` are names the
//! server's configuration gives (any other value collapses to no label; see [`LABEL_TENANT`]).
//!
//! The request-level ones count each choice of a request with `n > 1` as a request of its own,
//! as vLLM counts its child requests: one TTFT, E2E latency, TPOT and queue time per choice, and
//! each choice ends once, as a success, an abort or a failure.

/// Gauge: requests currently in a running batch.
pub const NUM_REQUESTS_RUNNING: &str = "switchyard:num_requests_running";
/// Gauge: requests waiting to be scheduled (including preempted ones).
pub const NUM_REQUESTS_WAITING: &str = "switchyard:num_requests_waiting";
/// Gauge: fraction of KV-cache blocks in use, in [0, 1].
pub const KV_CACHE_USAGE_PERC: &str = "switchyard:kv_cache_usage_perc";
/// Gauge, label `tier`: KV-cache blocks held by the running requests of each configured tier
/// (a block shared through the prefix cache counts for each request holding it): what
/// `tiers.<name>.max_kv_fraction` bounds.
pub const KV_CACHE_BLOCKS_USED: &str = "switchyard:kv_cache_blocks_used";
/// Gauge: KV-cache blocks held by the prefix cache only (reusable, evictable).
pub const KV_CACHE_CACHED_BLOCKS: &str = "switchyard:kv_cache_cached_blocks";
/// Counter: prompt tokens looked up in the prefix cache.
pub const PREFIX_CACHE_QUERIES: &str = "switchyard:prefix_cache_queries_total";
/// Counter: prompt tokens found in the prefix cache.
pub const PREFIX_CACHE_HITS: &str = "switchyard:prefix_cache_hits_total";
/// Gauge: fraction of the host KV tier's blocks holding a cached block, in [0, 1]
/// (`cache.kv_offloading_size`; 0 without a tier).
pub const KV_OFFLOAD_USAGE_PERC: &str = "switchyard:kv_offload_usage_perc";
/// Counter: KV blocks copied from the KV cache to the host tier (full cached blocks, ahead of
/// their eviction or when the cache evicted them).
pub const KV_OFFLOAD_STORED_BLOCKS: &str = "switchyard:kv_offload_stored_blocks_total";
/// Counter: of [`KV_OFFLOAD_STORED_BLOCKS`], those copied ahead of their eviction
/// (`cache.kv_offloading_ahead`).
pub const KV_OFFLOAD_STORED_AHEAD_BLOCKS: &str = "switchyard:kv_offload_stored_ahead_blocks_total";
/// Counter: KV blocks copied from the host tier back to the KV cache (prefix hits there).
pub const KV_OFFLOAD_LOADED_BLOCKS: &str = "switchyard:kv_offload_loaded_blocks_total";
/// Counter: prompt tokens found in the host tier at admission (counted in
/// [`PREFIX_CACHE_HITS`] too).
pub const KV_OFFLOAD_PREFIX_HITS: &str = "switchyard:kv_offload_prefix_hits_total";
/// Counter: preemptions (a running request sent back to waiting).
pub const NUM_PREEMPTIONS: &str = "switchyard:num_preemptions_total";
/// Counter, label `tenant`: prompt tokens of the requests the engine computed, counted at a
/// prompt's first token, as vLLM's `prompt_tokens_total` counts them (prefix-cache hits
/// count; a request that timed out in the queue, or whose client left before its prefill,
/// does not): once per prompt, whatever its `n`, as a response's `usage.prompt_tokens`
/// counts it.
pub const PROMPT_TOKENS: &str = "switchyard:prompt_tokens_total";
/// Counter, label `tenant`: prompt tokens whose KV came from the prefix cache at a request's
/// first admission, counted at its first token, once per prompt whatever its `n` (its first
/// choice's), as a response's `usage.prompt_tokens_details.cached_tokens` counts them. Unlike
/// [`PREFIX_CACHE_HITS`], a re-admission after a preemption adds nothing.
pub const PROMPT_TOKENS_CACHED: &str = "switchyard:prompt_tokens_cached_total";
/// Counter, label `tenant`: tokens generated, every choice's (after a stop string matched, none
/// more): a finished response's `usage.completion_tokens` sums the same tokens.
pub const GENERATION_TOKENS: &str = "switchyard:generation_tokens_total";
/// Counter, labels `finished_reason` (`stop`, `length`), `tier`, `tenant`: requests that
/// finished.
pub const REQUEST_SUCCESS: &str = "switchyard:request_success_total";
/// Counter, labels `tier`, `tenant`: requests aborted because their client went away.
pub const REQUEST_ABORTED: &str = "switchyard:request_aborted_total";
/// Counter, labels `reason`, `tier`, `tenant`: requests that ended with an error after they were queued, by kind:
/// `invalid_request`, `context_length`, `unknown_model`, `overloaded`, `unavailable` (refused,
/// or cut off: at the drain timeout, or a stream its client read too slowly; `invalid_request`
/// also a grammar that went past llguidance's parser limits while generating),
/// `structured_output` (the grammar failed otherwise while generating: the server's error)
/// or `error` (the server's own failure, such as a failed step); and requests refused before
/// they were queued as `overloaded` (the server's or their tier's bound on requests in flight,
/// or a full grammar compile queue) or `unavailable` (inside the engine once a drain ended, the
/// tokenizer pool gone as the engine stops, or an adapter broken on the server). Other refusals before queueing (a 400) are not counted;
/// the HTTP layer's own 503s while draining count only in `http_requests_total`.
pub const REQUEST_FAILED: &str = "switchyard:request_failed_total";
/// Counter: engine steps that failed (a backend error or panic, or a lost executor or
/// allocator); their requests ended with an error, the server went on.
pub const ENGINE_FAILED_STEPS: &str = "switchyard:engine_failed_steps_total";
/// Gauge: 1 while a backend call (a step, or a KV copy or a release) has run past
/// `scheduler.step_timeout_s` and not returned (the engine is stalled: `/health` and `/ready`
/// answer 503 `engine_stalled`), else 0; NaN if the thread that reports it ended by a fault (the
/// probes read the watch itself and still answer).
pub const ENGINE_STALLED: &str = "switchyard:engine_stalled";
/// Counter: block-accounting calls the scheduling core absorbed because they failed
/// (`SchedulerStats::pool_errors`: a core or caller bug, never user input; each growth is also
/// logged at ERROR). Anything but 0 is a bug to report.
pub const ENGINE_POOL_ERRORS: &str = "switchyard:engine_pool_errors_total";
/// Histogram, seconds: arrival to first generated token, per choice.
pub const TIME_TO_FIRST_TOKEN: &str = "switchyard:time_to_first_token_seconds";
/// Histogram, seconds: between the engine steps that bring a choice tokens, one per step after
/// its first (vLLM's definition: the tokens of a speculative step come together).
pub const INTER_TOKEN_LATENCY: &str = "switchyard:inter_token_latency_seconds";
/// Histogram, seconds: mean time per output token after the first, per finished choice (TPOT;
/// a choice of `n > 1` counts as its own sequence, as in vLLM).
pub const TIME_PER_OUTPUT_TOKEN: &str = "switchyard:time_per_output_token_seconds";
/// Histogram, seconds: arrival to finish, per finished choice.
pub const E2E_REQUEST_LATENCY: &str = "switchyard:e2e_request_latency_seconds";
/// Histogram, seconds: time spent waiting before first being scheduled, per choice.
pub const REQUEST_QUEUE_TIME: &str = "switchyard:request_queue_time_seconds";
/// Histogram, seconds: per request, from the engine receiving it (its HTTP body parsed) to
/// the scheduler queueing it: the chat template and tokenization in the tokenizer pool, its
/// adapter and grammar, the hops to the detokenizer and the scheduler. The simulator's
/// `scheduler.front_end_us` is its median.
pub const REQUEST_FRONT_END: &str = "switchyard:request_front_end_seconds";
/// Histogram, tokens: the prompt's length, per finished choice (vLLM's
/// `request_prompt_tokens`: each child request of `n > 1` counts, each with the whole prompt).
pub const REQUEST_PROMPT_TOKENS: &str = "switchyard:request_prompt_tokens";
/// Histogram, tokens: tokens generated, per finished choice (vLLM's
/// `request_generation_tokens`; 0 for an embedding).
pub const REQUEST_GENERATION_TOKENS: &str = "switchyard:request_generation_tokens";
/// Histogram, tokens: the most tokens any choice of a request generated, once per request when
/// its last choice finishes (vLLM's `request_max_num_generation_tokens`: the parent request of
/// `n > 1`).
pub const REQUEST_MAX_NUM_GENERATION_TOKENS: &str = "switchyard:request_max_num_generation_tokens";
/// Histogram: the request's `n` (its beam width for a beam search), once per request when its
/// last choice finishes (vLLM's `request_params_n`).
pub const REQUEST_PARAMS_N: &str = "switchyard:request_params_n";
/// Histogram, tokens: the `max_tokens` the request ran under (the client's, else the server's
/// default: what is left of the context), per finished choice (vLLM's
/// `request_params_max_tokens`); not for an embedding, which has none.
pub const REQUEST_PARAMS_MAX_TOKENS: &str = "switchyard:request_params_max_tokens";
/// Histogram, seconds: from a choice's first scheduling to its last token, preemptions
/// included, per finished choice (vLLM's `request_inference_time_seconds`: first SCHEDULED to
/// last NEW_TOKEN). Queue time plus this is the engine's share of the E2E latency.
pub const REQUEST_INFERENCE_TIME: &str = "switchyard:request_inference_time_seconds";
/// Histogram, seconds: from a choice's first scheduling to its first token (its prefill, the
/// chunks of a chunked prefill and any preemption meanwhile included), per finished choice
/// (vLLM's `request_prefill_time_seconds`).
pub const REQUEST_PREFILL_TIME: &str = "switchyard:request_prefill_time_seconds";
/// Histogram, seconds: from a choice's first token to its last, per finished choice (vLLM's
/// `request_decode_time_seconds`; 0 for a choice of one token).
pub const REQUEST_DECODE_TIME: &str = "switchyard:request_decode_time_seconds";
/// Histogram, tokens: the tokens each engine step ran (prefill chunks, decodes and draft
/// tokens: the batch's `num_batched_tokens`). vLLM's `iteration_tokens_total` counts a prompt
/// whole in the step its prefill completes rather than chunk by chunk; the two agree without
/// chunked prefill, prefix-cache hits or drafts.
pub const ITERATION_TOKENS: &str = "switchyard:iteration_tokens_total";
/// Histogram, seconds: the scheduler's planning time per step.
pub const ENGINE_PLAN: &str = "switchyard:engine_plan_seconds";
/// Histogram, seconds: the KV-allocator round trip per step (commit sent to block ids back).
pub const ENGINE_KV_COMMIT: &str = "switchyard:engine_kv_commit_seconds";
/// Histogram, seconds: engine time per step outside the model (planning, the allocator commit,
/// messages to the executor and detokenizer, applying outputs).
pub const ENGINE_STEP_OVERHEAD: &str = "switchyard:engine_step_overhead_seconds";
/// Gauge: sequences in the last step's batch.
pub const ENGINE_BATCH_SIZE: &str = "switchyard:engine_batch_size";

/// Gauge: LoRA adapters registered (servable by name).
pub const LORA_ADAPTERS: &str = "switchyard:lora_adapters";
/// Counter: LoRA adapters loaded from disk (registrations and reloads after eviction).
pub const LORA_LOADS: &str = "switchyard:lora_adapter_loads_total";
/// Counter, label `tier`: adapters of a tenant dropped from memory to make room in its share
/// (`tiers.<name>.max_cpu_loras_per_tenant`) for another of its adapters.
pub const LORA_SHARE_EVICTIONS: &str = "switchyard:lora_tenant_share_evictions_total";
/// Counter, label `tier`: requests refused (429) because their tenant's share of adapter
/// memory (`tiers.<name>.max_cpu_loras_per_tenant`) was full of adapters in use.
pub const LORA_SHARE_REFUSALS: &str = "switchyard:lora_tenant_share_refusals_total";
/// Counter, label `tier`: adapters whose charge moved from a tenant whose requests did not
/// use them to one whose requests did, to make room in the first tenant's share
/// (`tiers.<name>.max_cpu_loras_per_tenant`; the tier is the first tenant's request's).
pub const LORA_SHARE_TRANSFERS: &str = "switchyard:lora_tenant_share_transfers_total";
/// Gauge: distinct LoRA adapters among the running requests.
pub const LORA_RUNNING_ADAPTERS: &str = "switchyard:lora_running_adapters";
/// Gauge: waiting requests that name a LoRA adapter.
pub const LORA_WAITING_REQUESTS: &str = "switchyard:lora_waiting_requests";
/// Counter, label `kind`: requests with structured output, by kind of specification.
pub const STRUCTURED_REQUESTS: &str = "switchyard:structured_output_requests_total";
/// Counter: constrained sequences whose grammar failed while generating (ended early).
pub const STRUCTURED_FAILURES: &str = "switchyard:structured_output_failures_total";
/// Histogram, seconds: compiling a request's structured-output specification.
pub const STRUCTURED_COMPILE: &str = "switchyard:structured_output_compile_seconds";

/// Counter: sequence steps fed draft tokens (speculative decoding).
pub const SPEC_DECODE_DRAFTS: &str = "switchyard:spec_decode_num_drafts_total";
/// Counter: draft tokens fed (speculative decoding).
pub const SPEC_DECODE_DRAFT_TOKENS: &str = "switchyard:spec_decode_num_draft_tokens_total";
/// Counter: draft tokens accepted (speculative decoding).
pub const SPEC_DECODE_ACCEPTED_TOKENS: &str = "switchyard:spec_decode_num_accepted_tokens_total";

/// Counter, labels `tier`, `target` (`ttft`, `tpot`) and `outcome` (`met`, `missed`): choices
/// of the requests of a tier with that SLO target, by whether they met it: the TTFT target when
/// the first token arrives, the TPOT target (the mean time per output token after the first)
/// when a choice of at least two tokens finishes; as the simulator's `met_ttft` / `met_tpot`.
/// A tier's attainment is `met / (met + missed)`.
pub const SLO_ATTAINMENT: &str = "switchyard:slo_attainment_total";

/// Label key of [`REQUEST_SUCCESS`].
pub const LABEL_FINISHED_REASON: &str = "finished_reason";
/// Label key of the request's SLO tier (`tiers.<name>` of the server's configuration, through
/// its API key), on [`TIERED`] metrics and [`SLO_ATTAINMENT`]. Requests without a tier carry
/// no tier label (not an empty one: Prometheus reads `tier=""` as no label, so the two would
/// be the same series). Bounded: tier names come from the configuration only.
pub const LABEL_TIER: &str = "tier";
/// Label key of the request's tenant (the tenant of its API key), on the [`PER_TENANT`]
/// counters: usage accounting per tenant. Bounded like [`LABEL_TIER`]: only tenants the
/// server's configuration names (the `tenant` of its API keys) carry it; a request of any other
/// tenant (the open API's anonymous one, an offline request's none) carries no tenant label
/// (PromQL's `tenant=""`), never a value a client could choose. Latency histograms and
/// [`SLO_ATTAINMENT`] do not carry it: each tenant would multiply their series (a histogram's
/// is a series per bucket) for what the tier already shows.
pub const LABEL_TENANT: &str = "tenant";
/// Label keys of [`SLO_ATTAINMENT`].
pub const LABEL_TARGET: &str = "target";
pub const LABEL_OUTCOME: &str = "outcome";

/// The metrics recorded per tier: each request's carry its tier's [`LABEL_TIER`], if any.
pub const TIERED: &[&str] = &[
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    TIME_PER_OUTPUT_TOKEN,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    REQUEST_FRONT_END,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_MAX_NUM_GENERATION_TOKENS,
    REQUEST_PARAMS_N,
    REQUEST_PARAMS_MAX_TOKENS,
    REQUEST_INFERENCE_TIME,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    REQUEST_SUCCESS,
    REQUEST_ABORTED,
    REQUEST_FAILED,
];

/// The metrics counted per tenant ([`LABEL_TENANT`]): the token counters carry the tenant
/// only, the request outcomes the tier too (`switchyard_actors::metric_names::outcome_labels`).
pub const PER_TENANT: &[&str] = &[
    PROMPT_TOKENS,
    PROMPT_TOKENS_CACHED,
    GENERATION_TOKENS,
    REQUEST_SUCCESS,
    REQUEST_ABORTED,
    REQUEST_FAILED,
];

/// Label key of [`REQUEST_FAILED`].
pub const LABEL_REASON: &str = "reason";

/// The values of [`REQUEST_SUCCESS`]'s [`LABEL_FINISHED_REASON`].
pub const FINISHED_REASONS: &[&str] = &["stop", "length"];
/// The values of [`REQUEST_FAILED`]'s [`LABEL_REASON`].
pub const FAILURE_REASONS: &[&str] = &[
    "invalid_request",
    "unknown_model",
    "context_length",
    "overloaded",
    "tenant_busy",
    "queue_timeout",
    "unavailable",
    "structured_output",
    "error",
];

/// Every name above, by kind (for describing them and for tests).
pub const GAUGES: &[&str] = &[
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE_PERC,
    KV_CACHE_BLOCKS_USED,
    KV_CACHE_CACHED_BLOCKS,
    KV_OFFLOAD_USAGE_PERC,
    ENGINE_BATCH_SIZE,
    LORA_ADAPTERS,
    LORA_RUNNING_ADAPTERS,
    LORA_WAITING_REQUESTS,
    ENGINE_STALLED,
];
/// Counters among the names above.
pub const COUNTERS: &[&str] = &[
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    KV_OFFLOAD_STORED_BLOCKS,
    KV_OFFLOAD_STORED_AHEAD_BLOCKS,
    KV_OFFLOAD_LOADED_BLOCKS,
    KV_OFFLOAD_PREFIX_HITS,
    NUM_PREEMPTIONS,
    PROMPT_TOKENS,
    PROMPT_TOKENS_CACHED,
    GENERATION_TOKENS,
    REQUEST_SUCCESS,
    REQUEST_ABORTED,
    REQUEST_FAILED,
    ENGINE_FAILED_STEPS,
    ENGINE_POOL_ERRORS,
    LORA_LOADS,
    LORA_SHARE_EVICTIONS,
    LORA_SHARE_REFUSALS,
    LORA_SHARE_TRANSFERS,
    STRUCTURED_REQUESTS,
    STRUCTURED_FAILURES,
    SPEC_DECODE_DRAFTS,
    SPEC_DECODE_DRAFT_TOKENS,
    SPEC_DECODE_ACCEPTED_TOKENS,
    SLO_ATTAINMENT,
];
/// Histograms among the names above.
pub const HISTOGRAMS: &[&str] = &[
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    TIME_PER_OUTPUT_TOKEN,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    REQUEST_FRONT_END,
    REQUEST_PROMPT_TOKENS,
    REQUEST_GENERATION_TOKENS,
    REQUEST_MAX_NUM_GENERATION_TOKENS,
    REQUEST_PARAMS_N,
    REQUEST_PARAMS_MAX_TOKENS,
    REQUEST_INFERENCE_TIME,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    ITERATION_TOKENS,
    ENGINE_PLAN,
    ENGINE_KV_COMMIT,
    ENGINE_STEP_OVERHEAD,
    STRUCTURED_COMPILE,
];
