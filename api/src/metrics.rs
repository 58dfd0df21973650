//! Metric names, descriptions and the Prometheus recorder.
//!
//! The engine metrics mirror vLLM's production metrics (`vllm:num_requests_running`,
//! `vllm:time_to_first_token_seconds`, …; see vLLM's "Production Metrics" documentation) under
//! the `switchyard:` prefix, with the same meaning and units, so existing dashboards need only a
//! prefix change. The engine records them through the `metrics` crate with these constants; the
//! HTTP layer records the `HTTP_*` ones itself. Labels are bounded: `finished_reason`
//! (`stop`/`length`; the end-of-sequence token is a `stop`), `reason` (a kind of error),
//! `tier`, `tenant` and `policy` (configured names; a request of a tier or tenant the
//! configuration does not name carries no such label), `route` (route templates) and `status`
//! (HTTP status codes) — never a user-supplied string. As in vLLM, each choice of a request with `n > 1`
//! counts as a request of its own in the request-level metrics.
//!
//! `/metrics` shows the series of the tenants and tiers the configuration names now: those of
//! one a reload removed leave it (`ConfiguredLabels`, in `metrics/configured_labels.rs`),
//! though the exporter, which cannot forget a series, still holds them.

use metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

mod configured_labels;
pub(crate) use configured_labels::ConfiguredLabels;

// The engine's metrics (recorded by switchyard-actors) and their label keys, named once in
// `switchyard_policies::metric_names`, the one crate the engine and this one both depend on.
pub use switchyard_policies::metric_names::{
    E2E_REQUEST_LATENCY, ENGINE_BATCH_SIZE, ENGINE_FAILED_STEPS, ENGINE_KV_COMMIT, ENGINE_PLAN,
    ENGINE_POOL_ERRORS, ENGINE_STALLED, ENGINE_STEP_OVERHEAD, GENERATION_TOKENS,
    INTER_TOKEN_LATENCY, ITERATION_TOKENS, KV_CACHE_BLOCKS_USED, KV_CACHE_CACHED_BLOCKS,
    KV_CACHE_USAGE_PERC, KV_OFFLOAD_LOADED_BLOCKS, KV_OFFLOAD_PREFIX_HITS,
    KV_OFFLOAD_STORED_AHEAD_BLOCKS, KV_OFFLOAD_STORED_BLOCKS, KV_OFFLOAD_USAGE_PERC,
    LABEL_FINISHED_REASON, LABEL_REASON, LABEL_TENANT, LABEL_TIER, LORA_ADAPTERS, LORA_LOADS,
    LORA_RUNNING_ADAPTERS, LORA_SHARE_EVICTIONS, LORA_SHARE_REFUSALS, LORA_SHARE_TRANSFERS,
    LORA_WAITING_REQUESTS, NUM_PREEMPTIONS, NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING,
    PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES, PROMPT_TOKENS, PROMPT_TOKENS_CACHED, REQUEST_ABORTED,
    REQUEST_DECODE_TIME, REQUEST_FAILED, REQUEST_FRONT_END, REQUEST_GENERATION_TOKENS,
    REQUEST_INFERENCE_TIME, REQUEST_MAX_NUM_GENERATION_TOKENS, REQUEST_PARAMS_MAX_TOKENS,
    REQUEST_PARAMS_N, REQUEST_PREFILL_TIME, REQUEST_PROMPT_TOKENS, REQUEST_QUEUE_TIME,
    REQUEST_SUCCESS, SLO_ATTAINMENT, SPEC_DECODE_ACCEPTED_TOKENS, SPEC_DECODE_DRAFTS,
    SPEC_DECODE_DRAFT_TOKENS, STRUCTURED_COMPILE, STRUCTURED_FAILURES, STRUCTURED_REQUESTS,
    TIME_PER_OUTPUT_TOKEN, TIME_TO_FIRST_TOKEN,
};

/// Gauge, set to 1, labels [`CACHE_CONFIG_LABELS`]: the KV cache's configuration (vLLM's
/// `cache_config_info`), set once the model is loaded and the cache sized.
pub const CACHE_CONFIG_INFO: &str = "switchyard:cache_config_info";
/// The label keys of [`CACHE_CONFIG_INFO`]: `block_size` (tokens per KV block,
/// `cache.block_size`), `num_gpu_blocks` (blocks the backend holds, on the GPU or, for the CPU
/// backend, in memory), `cache_dtype` (`cache.kv_cache_dtype`: `auto` or `fp8`),
/// `enable_prefix_caching` (`cache.prefix_caching`: `true` or `false`) and `prefix_sharing`
/// (`cache.prefix_sharing`: `global` or `tenant`). Bounded: the configuration's values.
pub const CACHE_CONFIG_LABELS: &[&str] = &[
    "block_size",
    "num_gpu_blocks",
    "cache_dtype",
    "enable_prefix_caching",
    "prefix_sharing",
];

/// Gauge, label `policy`: 1 for the scheduling policy in force, 0 for the others seen.
pub const POLICY_INFO: &str = "switchyard:policy_info";
/// Counter: scheduling-policy hot swaps.
pub const POLICY_SWAPS: &str = "switchyard:policy_swaps_total";
/// Counter, labels `route` and `status`: HTTP responses.
pub const HTTP_REQUESTS: &str = "switchyard:http_requests_total";
/// Histogram, seconds, label `route`: time until the response head is ready.
pub const HTTP_REQUEST_DURATION: &str = "switchyard:http_request_duration_seconds";
/// Gauge: generation requests the HTTP layer is serving (streams included).
pub const HTTP_IN_FLIGHT: &str = "switchyard:http_requests_in_flight";
/// Gauge: responses of the Responses API kept for `GET /v1/responses/{id}` and
/// `previous_response_id`.
pub const RESPONSES_STORED: &str = "switchyard:responses_stored";
/// Gauge, bytes: what the stored responses (and the kept events of background streams, running
/// ones included) count against `server.responses.max_stored_mb`.
pub const RESPONSES_STORED_BYTES: &str = "switchyard:responses_stored_bytes";
/// Counter, label `reason` (`count`, `bytes`, `age`): stored responses let go to keep the
/// store within its bounds.
pub const RESPONSES_EVICTED: &str = "switchyard:responses_evicted_total";
/// Counter: changes to the stored responses that could not be written to their journal
/// (`server.responses.path`; a full disk): they may be lost at a restart.
pub const RESPONSES_JOURNAL_ERRORS: &str = "switchyard:responses_journal_errors_total";
/// Counter, labels `limit` (`requests`, `tokens`), `tier`, `tenant`: requests refused with a
/// 429 by their tenant's rate limits ([`crate::rate_limit`]).
pub const RATE_LIMITED: &str = "switchyard:rate_limited_total";
/// Gauge, label `backend` (`cpu` or `cuda`): 1 for the backend the model runs on.
pub const BACKEND_INFO: &str = "switchyard:backend_info";
/// Gauge, seconds since the Unix epoch: the `notAfter` of the TLS certificate in force (set
/// when it is loaded, at start and on SIGHUP; absent without `server.tls`).
pub const TLS_CERTIFICATE_EXPIRY: &str = "switchyard:tls_certificate_expiry_timestamp_seconds";

/// The metrics the server records itself, outside the engine (whose names
/// `switchyard_actors::metric_names` lists), by kind: with the engine's, every series
/// `/metrics` exports (README's Metrics section and the Grafana dashboard are checked against
/// the two).
pub const SERVER_GAUGES: &[&str] = &[
    POLICY_INFO,
    BACKEND_INFO,
    CACHE_CONFIG_INFO,
    HTTP_IN_FLIGHT,
    RESPONSES_STORED,
    RESPONSES_STORED_BYTES,
    TLS_CERTIFICATE_EXPIRY,
];
/// Counters among [`SERVER_GAUGES`]' kin.
pub const SERVER_COUNTERS: &[&str] = &[
    POLICY_SWAPS,
    HTTP_REQUESTS,
    RESPONSES_EVICTED,
    RESPONSES_JOURNAL_ERRORS,
    RATE_LIMITED,
];
/// Histograms among [`SERVER_GAUGES`]' kin.
pub const SERVER_HISTOGRAMS: &[&str] = &[HTTP_REQUEST_DURATION];

/// The status [`HTTP_REQUESTS`] counts for a request whose client went away before its
/// response was ready (actix dropped the handler, as it does when the connection closes):
/// nginx's "client closed request".
pub const CLIENT_CLOSED_REQUEST: u16 = 499;

/// One request's entry in [`HTTP_REQUESTS`] and [`HTTP_REQUEST_DURATION`]: made when it
/// arrives, recorded once, with the response's status or, if dropped before it has one (the
/// client left), [`CLIENT_CLOSED_REQUEST`].
pub(crate) struct HttpRecord {
    start: std::time::Instant,
    /// The route template matched on arrival.
    route: Option<String>,
    done: bool,
}

impl HttpRecord {
    /// A request to `route` (a template; `None`: unmatched) arriving now.
    pub(crate) fn new(route: Option<String>) -> Self {
        Self {
            start: std::time::Instant::now(),
            route,
            done: false,
        }
    }

    /// The route matched on arrival.
    pub(crate) fn take_route(&mut self) -> Option<String> {
        self.route.take()
    }

    /// Records the response: `status` on `route` (`None`: `unmatched`).
    pub(crate) fn record(&mut self, route: Option<String>, status: u16) {
        self.done = true;
        let route = route.unwrap_or_else(|| "unmatched".to_owned());
        metrics::counter!(HTTP_REQUESTS, "route" => route.clone(), "status" => status.to_string())
            .increment(1);
        metrics::histogram!(HTTP_REQUEST_DURATION, "route" => route)
            .record(self.start.elapsed().as_secs_f64());
    }
}

impl Drop for HttpRecord {
    fn drop(&mut self) {
        if !self.done {
            let route = self.route.take();
            self.record(route, CLIENT_CLOSED_REQUEST);
        }
    }
}

/// Label key of [`BACKEND_INFO`].
pub const LABEL_BACKEND: &str = "backend";
/// Label key of [`POLICY_INFO`].
pub const LABEL_POLICY: &str = "policy";
/// Label key of [`RATE_LIMITED`]: the limit that refused (`requests`, `tokens`).
pub const LABEL_LIMIT: &str = "limit";

/// vLLM's TTFT buckets, in seconds.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets, in seconds.
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
/// vLLM's request-latency buckets (E2E, queue time), in seconds.
const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
/// vLLM's token-count buckets (`request_prompt_tokens`, `request_generation_tokens`,
/// `request_max_num_generation_tokens`, `request_params_max_tokens`): 1, 2, 5 times the powers
/// of ten. vLLM's stop at the model's `max_model_len`; these go to 1,000,000 whatever the
/// model (the recorder is installed before the model's context is known).
const TOKEN_COUNT_BUCKETS: &[f64] = &[
    1.0,
    2.0,
    5.0,
    10.0,
    20.0,
    50.0,
    100.0,
    200.0,
    500.0,
    1_000.0,
    2_000.0,
    5_000.0,
    10_000.0,
    20_000.0,
    50_000.0,
    100_000.0,
    200_000.0,
    500_000.0,
    1_000_000.0,
];
/// vLLM's `request_params_n` buckets.
const PARAMS_N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];
/// vLLM's `iteration_tokens_total` buckets.
const ITERATION_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];
/// Buckets for the HTTP layer's own latency, in seconds.
const HTTP_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// Why the recorder could not be installed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// Another recorder is installed already, or a bucket list is invalid.
    #[error("cannot install the Prometheus recorder: {0}")]
    Install(#[from] metrics_exporter_prometheus::BuildError),
}

/// Builds the Prometheus recorder with vLLM's histogram buckets, installs it as the process's
/// global `metrics` recorder and describes every metric. Call it once, at start-up, before the
/// engine records anything; hand the returned handle to [`crate::ApiState::new`] so `/metrics`
/// can render it.
pub fn install_prometheus_recorder() -> Result<PrometheusHandle, MetricsError> {
    let handle = prometheus_builder()?.install_recorder()?;
    describe_metrics();
    Ok(handle)
}

pub(crate) fn prometheus_builder() -> Result<PrometheusBuilder, MetricsError> {
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in [
        (TIME_TO_FIRST_TOKEN, TTFT_BUCKETS),
        (INTER_TOKEN_LATENCY, ITL_BUCKETS),
        (TIME_PER_OUTPUT_TOKEN, ITL_BUCKETS),
        (E2E_REQUEST_LATENCY, REQUEST_LATENCY_BUCKETS),
        (REQUEST_QUEUE_TIME, REQUEST_LATENCY_BUCKETS),
        (REQUEST_INFERENCE_TIME, REQUEST_LATENCY_BUCKETS),
        (REQUEST_PREFILL_TIME, REQUEST_LATENCY_BUCKETS),
        (REQUEST_DECODE_TIME, REQUEST_LATENCY_BUCKETS),
        (REQUEST_PROMPT_TOKENS, TOKEN_COUNT_BUCKETS),
        (REQUEST_GENERATION_TOKENS, TOKEN_COUNT_BUCKETS),
        (REQUEST_MAX_NUM_GENERATION_TOKENS, TOKEN_COUNT_BUCKETS),
        (REQUEST_PARAMS_MAX_TOKENS, TOKEN_COUNT_BUCKETS),
        (REQUEST_PARAMS_N, PARAMS_N_BUCKETS),
        (ITERATION_TOKENS, ITERATION_TOKEN_BUCKETS),
        (HTTP_REQUEST_DURATION, HTTP_BUCKETS),
    ] {
        builder = builder.set_buckets_for_metric(Matcher::Full(name.to_owned()), buckets)?;
    }
    Ok(builder)
}

/// Registers help text and units for every metric (idempotent).
pub fn describe_metrics() {
    describe_gauge!(NUM_REQUESTS_RUNNING, "Requests in the running batch.");
    describe_gauge!(
        NUM_REQUESTS_WAITING,
        "Requests waiting to be scheduled, preempted ones included."
    );
    describe_gauge!(
        KV_CACHE_USAGE_PERC,
        Unit::Percent,
        "KV-cache usage: 1 means every block is in use."
    );
    describe_counter!(
        PREFIX_CACHE_QUERIES,
        Unit::Count,
        "Prompt tokens looked up in the prefix cache."
    );
    describe_counter!(
        PREFIX_CACHE_HITS,
        Unit::Count,
        "Prompt tokens found in the prefix cache."
    );
    describe_gauge!(
        KV_OFFLOAD_USAGE_PERC,
        Unit::Percent,
        "Host KV tier usage (cache.kv_offloading_size): 1 means every host block holds a cached block; 0 without a tier."
    );
    describe_counter!(
        KV_OFFLOAD_STORED_BLOCKS,
        Unit::Count,
        "KV blocks copied from the KV cache to the host tier (full cached blocks, ahead of or at their eviction)."
    );
    describe_counter!(
        KV_OFFLOAD_STORED_AHEAD_BLOCKS,
        Unit::Count,
        "Of the KV blocks stored in the host tier, those copied ahead of their eviction (cache.kv_offloading_ahead)."
    );
    describe_counter!(
        KV_OFFLOAD_LOADED_BLOCKS,
        Unit::Count,
        "KV blocks copied from the host tier back to the KV cache instead of recomputed."
    );
    describe_counter!(
        KV_OFFLOAD_PREFIX_HITS,
        Unit::Count,
        "Prompt tokens found in the host KV tier at admission (counted in prefix_cache_hits_total too)."
    );
    describe_counter!(NUM_PREEMPTIONS, Unit::Count, "Preemptions.");
    describe_counter!(
        PROMPT_TOKENS,
        Unit::Count,
        "Prompt tokens the engine computed (counted at the prompt's first token, as vLLM counts them: not a request that timed out in the queue or whose client left before its prefill; once per prompt whatever its n, as usage.prompt_tokens; prefix-cache hits included), by tenant (one the API keys name; others have no tenant label)."
    );
    describe_counter!(
        PROMPT_TOKENS_CACHED,
        Unit::Count,
        "Prompt tokens whose KV came from the prefix cache at the request's first admission (counted at its first token, once per prompt whatever its n, as usage.prompt_tokens_details.cached_tokens; a re-admission after a preemption adds nothing), by tenant (one the API keys name; others have no tenant label)."
    );
    describe_counter!(
        GENERATION_TOKENS,
        Unit::Count,
        "Tokens generated, every choice's (as usage.completion_tokens), by tenant (one the API keys name; others have no tenant label)."
    );
    describe_counter!(
        REQUEST_SUCCESS,
        Unit::Count,
        "Finished requests (each choice of n > 1 counts), by finish reason: stop (a stop string, stop token or end of sequence) or length. Labelled with the request's tier and tenant where the configuration names them."
    );
    describe_counter!(
        REQUEST_ABORTED,
        Unit::Count,
        "Requests (each choice of n > 1 counts) aborted because their client went away. Labelled with the request's tier and tenant where the configuration names them."
    );
    describe_counter!(
        REQUEST_FAILED,
        Unit::Count,
        "Requests (each choice of n > 1 counts) that ended with an error after they were queued, by reason: invalid_request, context_length, unknown_model, overloaded, queue_timeout (waited in the queue past its bound, never admitted), unavailable (refused, or cut off: at the drain timeout, or a stream its client read too slowly), structured_output (the grammar failed while generating: the output could not complete it), or error (the server's own failure, such as a failed step); and requests refused before they were queued as overloaded (the server's or their tier's bound on requests in flight, or a full grammar compile queue), tenant_busy (their tenant at its tier's max_pending_per_tenant) or unavailable (inside the engine once a drain ended or as it stops, or an adapter broken on the server). Labelled with the request's tier and tenant where the configuration names them."
    );
    describe_counter!(
        ENGINE_FAILED_STEPS,
        Unit::Count,
        "Engine steps that failed (a backend error or panic, or a lost executor or allocator); their requests ended with an error and the server went on."
    );
    describe_gauge!(
        ENGINE_STALLED,
        Unit::Count,
        "1 while a backend call has run past scheduler.step_timeout_s without returning (the engine is stalled: /health and /ready answer 503 engine_stalled), else 0; NaN if the thread that reports it ended by a fault (the probes still answer)."
    );
    describe_counter!(
        ENGINE_POOL_ERRORS,
        Unit::Count,
        "Block-accounting calls the scheduling core absorbed because they failed (a plan or commit that did not match its ledger): a bug in Switchyard, never a client's doing; each is also logged at ERROR. Anything but 0 is worth a bug report."
    );
    describe_counter!(
        SLO_ATTAINMENT,
        Unit::Count,
        "Requests (each choice of n > 1 counts) of a tier with an SLO target, by target (ttft: at the first token; tpot: the mean time per output token after the first, when a choice of two or more tokens finishes) and outcome (met, missed)."
    );
    describe_histogram!(
        TIME_TO_FIRST_TOKEN,
        Unit::Seconds,
        "Time from arrival to the first generated token, per request (each choice of n > 1 counts)."
    );
    describe_histogram!(
        INTER_TOKEN_LATENCY,
        Unit::Seconds,
        "Time between the engine steps that bring a request tokens: one per step after its first (the tokens of a speculative step come together)."
    );
    describe_histogram!(
        TIME_PER_OUTPUT_TOKEN,
        Unit::Seconds,
        "Mean time per output token after the first, per request (each choice of n > 1 counts)."
    );
    describe_histogram!(
        E2E_REQUEST_LATENCY,
        Unit::Seconds,
        "Time from arrival to finish, per request (each choice of n > 1 counts)."
    );
    describe_histogram!(
        REQUEST_QUEUE_TIME,
        Unit::Seconds,
        "From when the request's prompt was encoded (its grammar's compile included) to first being scheduled, per request (each choice of n > 1 counts); TTFT runs from its arrival, before the encoding."
    );
    describe_histogram!(
        REQUEST_FRONT_END,
        Unit::Seconds,
        "From when the engine received the request (its HTTP body parsed) to the scheduler queueing it: the chat template and tokenization in the tokenizer pool, its adapter and grammar, the hops to the detokenizer and the scheduler; once per request. Its median is the simulator's scheduler.front_end_us (in microseconds)."
    );
    describe_histogram!(
        REQUEST_PROMPT_TOKENS,
        Unit::Count,
        "Prompt tokens per finished request (each choice of n > 1 counts, with the whole prompt; a beam search's answers each count)."
    );
    describe_histogram!(
        REQUEST_GENERATION_TOKENS,
        Unit::Count,
        "Tokens generated per finished request (each choice of n > 1 counts; 0 for an embedding)."
    );
    describe_histogram!(
        REQUEST_MAX_NUM_GENERATION_TOKENS,
        Unit::Count,
        "The most tokens any choice of a request generated, once per request when its last choice finishes."
    );
    describe_histogram!(
        REQUEST_PARAMS_N,
        Unit::Count,
        "The n request parameter (a beam search's width), once per request when its last choice finishes."
    );
    describe_histogram!(
        REQUEST_PARAMS_MAX_TOKENS,
        Unit::Count,
        "The max_tokens a finished request ran under (the client's, else the server's default), per request (each choice of n > 1 counts); embeddings have none."
    );
    describe_histogram!(
        REQUEST_INFERENCE_TIME,
        Unit::Seconds,
        "Time from a request's first scheduling to its last token (prefill and decode, preemptions included), per finished request (each choice of n > 1 counts)."
    );
    describe_histogram!(
        REQUEST_PREFILL_TIME,
        Unit::Seconds,
        "Time from a request's first scheduling to its first token (every prefill chunk, preemptions included), per finished request (each choice of n > 1 counts)."
    );
    describe_histogram!(
        REQUEST_DECODE_TIME,
        Unit::Seconds,
        "Time from a request's first token to its last, per finished request (each choice of n > 1 counts)."
    );
    describe_histogram!(
        ITERATION_TOKENS,
        Unit::Count,
        "Tokens per engine step: prefill chunks, decodes and draft tokens of the batch."
    );
    describe_gauge!(
        CACHE_CONFIG_INFO,
        "The KV cache's configuration, in its labels (block_size, num_gpu_blocks, cache_dtype, enable_prefix_caching, prefix_sharing); always 1."
    );
    describe_gauge!(POLICY_INFO, "1 for the scheduling policy in force.");
    describe_gauge!(
        TLS_CERTIFICATE_EXPIRY,
        Unit::Seconds,
        "When the TLS certificate in force expires (its notAfter), in seconds since the Unix epoch; set when it is loaded (at start and on SIGHUP), NaN if it cannot be read."
    );
    describe_counter!(POLICY_SWAPS, Unit::Count, "Scheduling-policy hot swaps.");
    describe_counter!(
        HTTP_REQUESTS,
        Unit::Count,
        "HTTP responses by route and status; status 499 (nginx's client closed request) counts requests whose client went away before the response was ready."
    );
    describe_histogram!(
        HTTP_REQUEST_DURATION,
        Unit::Seconds,
        "Time until the HTTP response head is ready, by route."
    );
    describe_gauge!(
        HTTP_IN_FLIGHT,
        "Generation requests being served, streams included."
    );
    describe_gauge!(
        KV_CACHE_BLOCKS_USED,
        Unit::Count,
        "KV-cache blocks held by the running requests of each tier (label tier; a block shared through the prefix cache counts for each request holding it): what tiers.<name>.max_kv_fraction bounds."
    );
    describe_gauge!(
        KV_CACHE_CACHED_BLOCKS,
        Unit::Count,
        "KV-cache blocks registered in the prefix cache, in use or not (those no request holds are reusable and evicted last-used first)."
    );
    describe_gauge!(
        ENGINE_BATCH_SIZE,
        Unit::Count,
        "Sequences in the last engine step."
    );
    describe_histogram!(
        ENGINE_PLAN,
        Unit::Seconds,
        "Scheduler planning time per engine step."
    );
    describe_histogram!(
        ENGINE_KV_COMMIT,
        Unit::Seconds,
        "KV-allocator round trip per engine step."
    );
    describe_histogram!(
        ENGINE_STEP_OVERHEAD,
        Unit::Seconds,
        "Engine time per step outside the model: planning, the allocator commit, messages, applying outputs."
    );
    describe_gauge!(
        LORA_ADAPTERS,
        Unit::Count,
        "LoRA adapters registered (servable by name)."
    );
    describe_counter!(
        LORA_LOADS,
        Unit::Count,
        "LoRA adapters loaded from disk (registrations and reloads after eviction)."
    );
    describe_counter!(
        LORA_SHARE_EVICTIONS,
        Unit::Count,
        "LoRA adapters of a tenant dropped from memory to make room in its tier's share \
         (tiers.<name>.max_cpu_loras_per_tenant) for another of its adapters, by tier."
    );
    describe_counter!(
        LORA_SHARE_REFUSALS,
        Unit::Count,
        "Requests refused (429) because their tenant's share of LoRA adapter memory \
         (tiers.<name>.max_cpu_loras_per_tenant) was full of adapters in use, by tier."
    );
    describe_counter!(
        LORA_SHARE_TRANSFERS,
        Unit::Count,
        "LoRA adapters whose charge moved from a tenant whose requests did not use them to one \
         whose requests did, to make room in the first tenant's share \
         (tiers.<name>.max_cpu_loras_per_tenant), by the first tenant's tier."
    );
    describe_gauge!(
        LORA_RUNNING_ADAPTERS,
        Unit::Count,
        "Distinct LoRA adapters among the running requests."
    );
    describe_gauge!(
        LORA_WAITING_REQUESTS,
        Unit::Count,
        "Waiting requests that name a LoRA adapter."
    );
    describe_counter!(
        STRUCTURED_REQUESTS,
        Unit::Count,
        "Requests with structured output, by kind of specification (json_schema, json_object, regex, choice, grammar, tool_calls)."
    );
    describe_counter!(
        STRUCTURED_FAILURES,
        Unit::Count,
        "Constrained sequences whose grammar failed while generating (they end early)."
    );
    describe_histogram!(
        STRUCTURED_COMPILE,
        Unit::Seconds,
        "Time to compile a request's structured-output specification."
    );
    describe_counter!(
        SPEC_DECODE_DRAFTS,
        Unit::Count,
        "Sequence steps fed draft tokens (speculative decoding by prompt lookup)."
    );
    describe_counter!(
        SPEC_DECODE_DRAFT_TOKENS,
        Unit::Count,
        "Draft tokens fed (speculative decoding)."
    );
    describe_counter!(
        SPEC_DECODE_ACCEPTED_TOKENS,
        Unit::Count,
        "Draft tokens the model accepted (speculative decoding)."
    );
    describe_gauge!(
        BACKEND_INFO,
        "1 for the backend the model runs on (label backend)."
    );
    describe_gauge!(
        RESPONSES_STORED,
        "Responses of the Responses API kept for retrieval and previous_response_id."
    );
    describe_gauge!(
        RESPONSES_STORED_BYTES,
        Unit::Bytes,
        "Bytes the stored responses, and the kept events of background streams, count against the store's bound."
    );
    describe_counter!(
        RESPONSES_EVICTED,
        "Stored responses let go to keep the store within its bounds (label reason: count, bytes, age)."
    );
    describe_counter!(
        RESPONSES_JOURNAL_ERRORS,
        "Changes to the stored responses that could not be written to their journal (server.responses.path): they may be lost at a restart."
    );
    describe_counter!(
        RATE_LIMITED,
        "Requests refused with a 429 by their tenant's rate limits (tiers.<name>.requests_per_minute, tokens_per_minute), by limit (requests, tokens), tier and tenant (one the API keys name)."
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    const GAUGES: &[&str] = &[
        NUM_REQUESTS_RUNNING,
        NUM_REQUESTS_WAITING,
        KV_CACHE_USAGE_PERC,
        KV_CACHE_BLOCKS_USED,
        KV_CACHE_CACHED_BLOCKS,
        KV_OFFLOAD_USAGE_PERC,
        ENGINE_BATCH_SIZE,
        ENGINE_STALLED,
        POLICY_INFO,
        HTTP_IN_FLIGHT,
        BACKEND_INFO,
        CACHE_CONFIG_INFO,
        RESPONSES_STORED,
        RESPONSES_STORED_BYTES,
    ];
    const COUNTERS: &[&str] = &[
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
        SLO_ATTAINMENT,
        POLICY_SWAPS,
        HTTP_REQUESTS,
        RESPONSES_EVICTED,
        RESPONSES_JOURNAL_ERRORS,
        RATE_LIMITED,
    ];
    const HISTOGRAMS: &[&str] = &[
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
        HTTP_REQUEST_DURATION,
    ];

    fn all() -> impl Iterator<Item = &'static str> {
        [GAUGES, COUNTERS, HISTOGRAMS]
            .into_iter()
            .flatten()
            .copied()
    }

    #[test]
    fn every_metric_has_help_text() {
        let recorder = prometheus_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_metrics();
            for &g in GAUGES {
                metrics::gauge!(g).set(1.0);
            }
            for &c in COUNTERS {
                metrics::counter!(c).increment(1);
            }
            for &h in HISTOGRAMS {
                metrics::histogram!(h).record(0.5);
            }
        });
        let text = handle.render();
        for name in all() {
            // The exporter writes HELP and TYPE only for described metrics.
            assert!(
                text.contains(&format!("# HELP {name} ")),
                "{name} has no help text"
            );
        }
    }

    #[test]
    fn names_are_prefixed_valid_prometheus_names() {
        for name in all() {
            let rest = name.strip_prefix("switchyard:").unwrap();
            assert!(
                rest.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{name}"
            );
        }
    }

    #[test]
    fn histograms_render_with_vllm_buckets() {
        let recorder = prometheus_builder().unwrap().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe_metrics();
            metrics::histogram!(TIME_TO_FIRST_TOKEN).record(0.03);
            metrics::counter!(REQUEST_SUCCESS, LABEL_FINISHED_REASON => "stop").increment(2);
            metrics::histogram!(REQUEST_PARAMS_N).record(3.0);
            metrics::histogram!(ITERATION_TOKENS).record(100.0);
            metrics::histogram!(REQUEST_PROMPT_TOKENS).record(7.0);
            metrics::histogram!(REQUEST_PREFILL_TIME).record(0.9);
        });
        let text = handle.render();
        // vLLM's buckets (v1/metrics/loggers.py): n in 1, 2, 5, 10, 20; tokens per step in
        // 1, 8, 16, …, 16384; token counts 1-2-5; phase times the request-latency buckets.
        for line in [
            "switchyard:request_params_n_bucket{le=\"2\"} 0",
            "switchyard:request_params_n_bucket{le=\"5\"} 1",
            "switchyard:request_params_n_bucket{le=\"20\"} 1",
            "switchyard:iteration_tokens_total_bucket{le=\"64\"} 0",
            "switchyard:iteration_tokens_total_bucket{le=\"128\"} 1",
            "switchyard:request_prompt_tokens_bucket{le=\"5\"} 0",
            "switchyard:request_prompt_tokens_bucket{le=\"10\"} 1",
            "switchyard:request_prompt_tokens_bucket{le=\"1000000\"} 1",
            "switchyard:request_prefill_time_seconds_bucket{le=\"0.8\"} 0",
            "switchyard:request_prefill_time_seconds_bucket{le=\"1\"} 1",
        ] {
            assert!(text.contains(line), "{line} missing from {text}");
        }
        assert!(text.contains("switchyard:time_to_first_token_seconds_bucket{le=\"0.04\"} 1"));
        assert!(text.contains("switchyard:time_to_first_token_seconds_bucket{le=\"0.02\"} 0"));
        assert!(text.contains("switchyard:request_success_total{finished_reason=\"stop\"} 2"));
    }
}
