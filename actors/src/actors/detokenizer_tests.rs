//! The request-level metrics the detokenizer records, through a real engine (scheduler,
//! executor, detokenizer) around a backend that answers at once: counts only, no timings.
//!
//! The metrics crate has one global recorder per process and the tests of this crate run at
//! once, so the recorder here keeps what each actix system's arbiter threads record apart
//! (the detokenizer runs on an arbiter of its own, named after its system), and each test
//! reads its own system's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use switchyard_gpu::backend::SamplingParams;
use switchyard_gpu::backend::{AcceptedDraft, Backend, Batch, DraftVerifier, SeqOutput};
use switchyard_gpu::model::Tokenizer;
use switchyard_gpu::GpuError;
use switchyard_policies::{PolicyRegistry, SchedulerConfig, SpeculativeConfig};

use crate::actors::{
    Engine, EngineConfig, EngineOutput, OutputSink, PromptSource, RequestOptions, SubmitErrorKind,
};
use crate::metric_names as names;

/// The backend's tokens: each one is followed by the next, `CYCLE - 1` by 0.
const CYCLE: u32 = 4;

/// What the arbiter threads of each actix system recorded: counters and histograms by
/// `name{label=value,…}`.
#[derive(Default)]
struct Recorded {
    counters: HashMap<String, Arc<AtomicU64>>,
    histograms: HashMap<String, Arc<Values>>,
}

#[derive(Default)]
struct Values(Mutex<Vec<f64>>);

impl HistogramFn for Values {
    fn record(&self, value: f64) {
        self.0.lock().unwrap().push(value);
    }
}

fn recorded() -> &'static Mutex<HashMap<usize, Recorded>> {
    static RECORDED: OnceLock<Mutex<HashMap<usize, Recorded>>> = OnceLock::new();
    RECORDED.get_or_init(Default::default)
}

/// The actix system whose arbiter runs on this thread (`actix-rt|system:N|arbiter:M`).
/// On a test's own thread (where `Engine::submit` records), the system running there.
fn system_of_thread() -> Option<usize> {
    let thread = std::thread::current();
    let Some(rest) = thread
        .name()
        .and_then(|n| n.strip_prefix("actix-rt|system:"))
    else {
        return actix::System::try_current().map(|s| s.id());
    };
    rest.split('|').next()?.parse().ok()
}

fn key_text(key: &Key) -> String {
    let labels: Vec<String> = key
        .labels()
        .map(|l| format!("{}={}", l.key(), l.value()))
        .collect();
    if labels.is_empty() {
        key.name().to_string()
    } else {
        format!("{}{{{}}}", key.name(), labels.join(","))
    }
}

struct BySystem;

impl Recorder for BySystem {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let Some(system) = system_of_thread() else {
            return Counter::noop();
        };
        let mut all = recorded().lock().unwrap();
        let c = all
            .entry(system)
            .or_default()
            .counters
            .entry(key_text(key))
            .or_default();
        Counter::from_arc(c.clone())
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let Some(system) = system_of_thread() else {
            return Histogram::noop();
        };
        let mut all = recorded().lock().unwrap();
        let h = all
            .entry(system)
            .or_default()
            .histograms
            .entry(key_text(key))
            .or_default();
        Histogram::from_arc(h.clone())
    }
}

/// What this test's system recorded so far.
struct Snapshot {
    counters: HashMap<String, u64>,
    histograms: HashMap<String, Vec<f64>>,
}

impl Snapshot {
    fn take() -> Self {
        let system = actix::System::current().id();
        let all = recorded().lock().unwrap();
        let empty = Recorded::default();
        let r = all.get(&system).unwrap_or(&empty);
        Snapshot {
            counters: r
                .counters
                .iter()
                .map(|(k, v)| (k.clone(), v.load(Ordering::Relaxed)))
                .collect(),
            histograms: r
                .histograms
                .iter()
                .map(|(k, v)| (k.clone(), v.0.lock().unwrap().clone()))
                .collect(),
        }
    }
    fn counter(&self, key: &str) -> u64 {
        self.counters.get(key).copied().unwrap_or(0)
    }
    fn count(&self, histogram: &str) -> usize {
        self.histograms.get(histogram).map_or(0, Vec::len)
    }
    /// The values `histogram` (no labels) recorded, in ascending order.
    fn values(&self, histogram: &str) -> Vec<f64> {
        let mut v = self.histograms.get(histogram).cloned().unwrap_or_default();
        v.sort_by(f64::total_cmp);
        v
    }
    /// The counters of `name`, with their labels, that are not 0.
    fn counters_of(&self, name: &str) -> Vec<(String, u64)> {
        let mut v: Vec<(String, u64)> = self
            .counters
            .iter()
            .filter(|(k, &n)| n > 0 && (*k == name || k.starts_with(&format!("{name}{{"))))
            .map(|(k, &n)| (k.clone(), n))
            .collect();
        v.sort();
        v
    }
}

fn install_recorder() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        metrics::set_global_recorder(BySystem).expect("no other recorder in these tests");
    });
}

/// Samples the token after the last one fed (`x + 1` modulo `CYCLE`), verifies drafts
/// against that rule, fails every step when `fail` is set, and counts each sequence's
/// sampling steps.
struct CycleBackend {
    fail: bool,
    sampled_steps: Arc<Mutex<HashMap<u64, usize>>>,
}

impl Backend for CycleBackend {
    fn name(&self) -> &str {
        "cycle"
    }
    fn num_kv_blocks(&self) -> usize {
        64
    }
    fn block_size(&self) -> usize {
        16
    }
    fn max_batch_tokens(&self) -> usize {
        1024
    }
    fn draft_verifier(&self) -> Option<DraftVerifier> {
        Some(|_| true)
    }
    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        if self.fail {
            return Err(GpuError::Internal(
                "the test backend fails every step".into(),
            ));
        }
        let mut steps = self.sampled_steps.lock().unwrap();
        Ok(batch
            .seqs
            .iter()
            .map(|s| {
                let known = s.tokens.len() - s.num_drafts;
                let mut prev = s.tokens[known - 1];
                let mut accepted = Vec::new();
                for &d in &s.tokens[known..] {
                    if d != (prev + 1) % CYCLE {
                        break;
                    }
                    accepted.push(AcceptedDraft {
                        token: d,
                        logprob: None,
                        top_logprobs: Vec::new(),
                    });
                    prev = d;
                }
                if s.sample {
                    *steps.entry(s.seq_id).or_default() += 1;
                }
                SeqOutput {
                    seq_id: s.seq_id,
                    accepted,
                    token: s.sample.then_some((prev + 1) % CYCLE),
                    logprob: None,
                    top_logprobs: Vec::new(),
                    prompt_logprobs: Vec::new(),
                    // A stand-in for the hidden state: the last token and the chunk length.
                    hidden: (s.sample && s.sampling.hidden_state)
                        .then(|| vec![s.tokens[known - 1] as f32, s.tokens.len() as f32]),
                }
            })
            .collect())
    }
    fn release(&mut self, _: u64) {}
}

/// A word-level tokenizer of the tokens `t0 … t{CYCLE-1}`.
fn tokenizer() -> Arc<Tokenizer> {
    tokenizer_with_special(&[])
}

/// [`tokenizer`], the tokens `special` special tokens.
fn tokenizer_with_special(special: &[u32]) -> Arc<Tokenizer> {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..CYCLE)
        .map(|i| (format!("t{i}"), serde_json::Value::from(i)))
        .collect();
    let added: Vec<serde_json::Value> = special
        .iter()
        .map(|&i| {
            serde_json::json!({"id": i, "content": format!("t{i}"), "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    Arc::new(Tokenizer::from_json_bytes(json.to_string().as_bytes()).expect("tokenizer"))
}

/// An engine over a `CycleBackend` (with prompt-lookup drafts when `speculative`), and the
/// backend's sampling steps per sequence.
fn start_engine(fail: bool, speculative: bool) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
    start_engine_with(fail, speculative, tokenizer())
}

/// [`start_engine`] with `tokenizer`.
fn start_engine_with(
    fail: bool,
    speculative: bool,
    tokenizer: Arc<Tokenizer>,
) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
    start_engine_full(fail, speculative, tokenizer, &[])
}

/// [`start_engine_with`], `tenants` being the configured tenants (the usage counters' labels).
fn start_engine_full(
    fail: bool,
    speculative: bool,
    tokenizer: Arc<Tokenizer>,
    tenants: &[&str],
) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
    start_engine_bounded(fail, speculative, tokenizer, tenants, 16, &[])
}

/// [`start_engine_full`] with bounds on requests in flight: the server's `max_pending` and
/// the tiers' `tier_max_pending`.
fn start_engine_bounded(
    fail: bool,
    speculative: bool,
    tokenizer: Arc<Tokenizer>,
    tenants: &[&str],
    max_pending: usize,
    tier_max_pending: &[(&str, usize)],
) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
    start_engine_sharing(
        fail,
        speculative,
        tokenizer,
        tenants,
        max_pending,
        tier_max_pending,
        false,
    )
}

/// [`start_engine_bounded`], tenants sharing cached prefix blocks unless `by_tenant`
/// (`cache.prefix_sharing: tenant`).
fn start_engine_sharing(
    fail: bool,
    speculative: bool,
    tokenizer: Arc<Tokenizer>,
    tenants: &[&str],
    max_pending: usize,
    tier_max_pending: &[(&str, usize)],
    by_tenant: bool,
) -> (Engine, Arc<Mutex<HashMap<u64, usize>>>) {
    install_recorder();
    let sampled_steps = Arc::new(Mutex::new(HashMap::new()));
    let scheduler = SchedulerConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 1024,
        num_gpu_blocks: 64,
        max_model_len: 256,
        speculative: speculative.then_some(SpeculativeConfig {
            num_speculative_tokens: 3,
            prompt_lookup_min: 2,
            prompt_lookup_max: 4,
            max_running: 0,
        }),
        ..SchedulerConfig::default()
    };
    let policy = PolicyRegistry::with_builtins()
        .create("fcfs", &serde_yaml::Value::Null, &[])
        .expect("policy");
    let engine = Engine::start(
        EngineConfig {
            scheduler,
            hash_key: [1, 2],
            tokenizer_threads: 1,
            max_pending_requests: max_pending,
            tier_max_pending: tier_max_pending
                .iter()
                .map(|&(name, limit)| (name.to_owned(), limit))
                .collect(),
            tier_max_pending_per_tenant: Vec::new(),
            metrics_tenants: tenants.iter().map(|t| t.to_string()).collect(),
            async_scheduling: crate::AsyncScheduling::Off,
            lora: None,
            prefix_sharing_by_tenant: by_tenant,
            message_tokens_as_text: true,
            step_timeout: None,
            vocab_size: 0,
        },
        Box::new(CycleBackend {
            fail,
            sampled_steps: sampled_steps.clone(),
        }),
        tokenizer,
        None,
        policy,
    )
    .expect("engine");
    (engine, sampled_steps)
}

/// A request for `n` choices of `max_tokens` tokens after the prompt `0 1 2 3 0 1 2 3 0 1`.
fn request(n: u32, max_tokens: u32, sampling: SamplingParams) -> RequestOptions {
    RequestOptions {
        prompt: PromptSource::Tokens((0..10).map(|i| i % CYCLE).collect()),
        sampling,
        stop: Vec::new(),
        include_stop_str_in_output: false,
        skip_special_tokens: true,
        keep_special_tokens: Default::default(),
        n,
        max_tokens: Some(max_tokens),
        default_max_tokens: None,
        priority: 0,
        tier: String::new(),
        tenant: String::new(),
        prompt_logprobs: None,
        cache_salt: None,
        embed: false,
        beam: None,
        lora: None,
        structured: None,
        filters: crate::token_filters::TokenFilters::default(),
    }
}

fn ignoring_eos() -> SamplingParams {
    SamplingParams {
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

/// How a test client behaves.
#[derive(Clone, Copy, PartialEq)]
enum Client {
    /// Reads everything.
    Stays,
    /// Is gone by the time its first delta is sent.
    LeavesAtFirstDelta,
    /// Is gone by the time a choice's last delta is sent (after its success was counted).
    LeavesAtLastDelta,
    /// Is gone before its request is queued (while its prompt is encoded).
    GoneAtSubmit,
    /// Stays connected but reads too slowly: the sink takes this many deltas, then cuts the
    /// client off with an error (as the server's channel sink does when its buffer is full).
    CutOffAfter(usize),
}

struct Sink {
    client: Client,
    gone: bool,
    /// Deltas taken so far.
    deltas: usize,
    /// The sink cut its client off (the client is still connected).
    cut_off: bool,
    errors: Arc<Mutex<Vec<String>>>,
    /// What the client's other prompts failed with, if that is why it left.
    abandoned_for: Option<SubmitErrorKind>,
}

impl OutputSink for Sink {
    fn send(&mut self, output: EngineOutput) -> bool {
        if self.gone || self.cut_off {
            return false;
        }
        match output {
            EngineOutput::Delta(d) => {
                if let Client::CutOffAfter(k) = self.client {
                    if self.deltas == k {
                        self.cut_off = true;
                        self.errors.lock().unwrap().push("cut off".into());
                        return false;
                    }
                }
                self.deltas += 1;
                let leaves = match self.client {
                    Client::Stays | Client::GoneAtSubmit | Client::CutOffAfter(_) => false,
                    Client::LeavesAtFirstDelta => true,
                    Client::LeavesAtLastDelta => d.finish.is_some(),
                };
                self.gone |= leaves;
            }
            EngineOutput::Error(e) => self.errors.lock().unwrap().push(e.message),
            EngineOutput::Prompt { .. } => {}
        }
        !self.gone
    }
    fn is_closed(&self) -> bool {
        self.gone || self.cut_off
    }
    fn will_deliver(&self) -> bool {
        let full = matches!(self.client, Client::CutOffAfter(k) if self.deltas == k);
        !self.is_closed() && !full
    }
    fn abandoned_for(&self) -> Option<SubmitErrorKind> {
        match self.abandoned_for {
            Some(kind) => Some(kind),
            None => self.cut_off.then_some(SubmitErrorKind::Unavailable),
        }
    }
}

/// Submits one request and waits until it has ended (the detokenizer released it, after its
/// metrics); returns the errors its client was sent.
async fn run(engine: &Engine, options: RequestOptions, client: Client) -> Vec<String> {
    run_abandoned(engine, options, client, None).await
}

/// [`run`], the client's other prompts having failed with `abandoned_for` when it leaves.
async fn run_abandoned(
    engine: &Engine,
    options: RequestOptions,
    client: Client,
    abandoned_for: Option<SubmitErrorKind>,
) -> Vec<String> {
    let errors = Arc::new(Mutex::new(Vec::new()));
    engine.submit(
        options,
        Box::new(Sink {
            client,
            gone: client == Client::GoneAtSubmit,
            deltas: 0,
            cut_off: false,
            errors: errors.clone(),
            abandoned_for,
        }),
    );
    // A hang guard only (generous for a loaded machine); nothing here is timed.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while engine.in_flight() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the request never ended"
        );
        actix::clock::sleep(Duration::from_millis(2)).await;
    }
    let errors = errors.lock().unwrap().clone();
    errors
}

/// A client request's prompts submitted together ([`Engine::submit_all`]), each `n` choices
/// of tier `tier`; returns the errors each prompt's client was sent (the request is not
/// waited for).
fn submit_prompts(
    engine: &Engine,
    prompts: usize,
    n: u32,
    tier: &str,
) -> Vec<Arc<Mutex<Vec<String>>>> {
    let mut errors = Vec::new();
    let mut all = Vec::new();
    for _ in 0..prompts {
        let e = Arc::new(Mutex::new(Vec::new()));
        errors.push(e.clone());
        let mut options = request(n, 3, ignoring_eos());
        options.tier = tier.into();
        let sink: Box<dyn OutputSink> = Box::new(Sink {
            client: Client::Stays,
            gone: false,
            deltas: 0,
            cut_off: false,
            errors: e,
            abandoned_for: None,
        });
        all.push((options, sink));
    }
    engine.submit_all(all);
    errors
}

/// Waits until no request is in flight (the detokenizer released them, after their metrics).
async fn until_idle(engine: &Engine) {
    // A hang guard only (generous for a loaded machine); nothing here is timed.
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while engine.in_flight() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "a request never ended"
        );
        actix::clock::sleep(Duration::from_millis(2)).await;
    }
}

/// The errors each prompt was sent.
fn errors_of(errors: &[Arc<Mutex<Vec<String>>>]) -> Vec<Vec<String>> {
    errors.iter().map(|e| e.lock().unwrap().clone()).collect()
}

/// `request_failed_total{reason="overloaded"}`.
fn overloaded(m: &Snapshot) -> u64 {
    m.counter(&failed("overloaded"))
}

/// Requests refused inside the engine once a drain ended (`fail_in_flight`) count each choice
/// in `request_failed_total{reason="unavailable"}`, as the requests it cut off do.
#[actix::test]
async fn refusals_after_a_drain_count_as_unavailable() {
    let (engine, _) = start_engine_bounded(false, false, tokenizer(), &[], 8, &[]);
    engine.fail_in_flight("the server is stopping");
    let refused = submit_prompts(&engine, 2, 2, "");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while errors_of(&refused).iter().any(Vec::is_empty) {
        assert!(std::time::Instant::now() < deadline, "a refusal never came");
        actix::clock::sleep(Duration::from_millis(2)).await;
    }
    for e in errors_of(&refused) {
        assert_eq!(e.len(), 1, "{e:?}");
    }
    until_idle(&engine).await;
    let m = Snapshot::take();
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(failed("unavailable"), 4)]
    );
}

/// Requests refused because the tokenizer pool is gone (the engine shutting down) count each
/// choice in `request_failed_total{reason="unavailable"}`, as other refusals after admission do.
#[actix::test]
async fn a_tokenizer_pool_gone_at_shutdown_counts_as_unavailable() {
    let (engine, _) = start_engine_bounded(false, false, tokenizer(), &[], 8, &[]);
    let engine = engine.with_tokenizers_gone();
    let refused = submit_prompts(&engine, 2, 2, "");
    until_idle(&engine).await;
    for e in errors_of(&refused) {
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(e[0].contains("shutting down"), "{e:?}");
    }
    let m = Snapshot::take();
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(failed("unavailable"), 4)]
    );
}

/// The bounds on requests in flight count choices, prompts × n alike. A request with more
/// than a bound ever admits is refused on every prompt as too many choices, naming the bound
/// (the server's or its tier's) and its value, on an idle server, and is not counted as
/// overloaded; one that fits but not now is refused as overloaded on every prompt, holds no
/// seat, and counts each choice in `request_failed_total{reason="overloaded"}`.
#[actix::test]
async fn admission_counts_choices_all_or_nothing_400_apart_from_503() {
    let (engine, _) = start_engine_bounded(false, false, tokenizer(), &[], 3, &[("batch", 2)]);
    // The audit's request on an idle server: 4 prompts under a bound of 3, never admissible.
    let refused = submit_prompts(&engine, 4, 1, "");
    assert_eq!(engine.in_flight(), 0);
    let expected = "this request has 4 choices (4 prompts × n = 1) but \
                    server.max_pending_requests is 3: each choice (prompts × n) counts as a \
                    request in flight, so it can never be admitted; send fewer prompts or a \
                    smaller n";
    assert_eq!(errors_of(&refused), vec![vec![expected.to_owned()]; 4]);
    // `n` counts as prompts do.
    let refused = submit_prompts(&engine, 1, 4, "");
    assert!(errors_of(&refused)[0][0].contains("4 choices (n = 4) but server"));
    // A tier's bound, below the server's.
    let refused = submit_prompts(&engine, 3, 1, "batch");
    for e in errors_of(&refused) {
        assert_eq!(e.len(), 1);
        assert!(
            e[0].contains(
                "3 choices (3 prompts × n = 1) but tiers.batch.max_pending_requests is 2"
            ),
            "{e:?}"
        );
    }
    assert_eq!(overloaded(&Snapshot::take()), 0);

    // Fits, but a request of 2 choices holds 2 of the server's 3 seats (it cannot end before
    // this test awaits): 2 prompts more are refused together, no seat held.
    let held = submit_prompts(&engine, 1, 2, "");
    assert_eq!(engine.in_flight(), 2);
    let refused = submit_prompts(&engine, 2, 1, "");
    assert_eq!(engine.in_flight(), 2);
    for e in errors_of(&refused) {
        assert_eq!(e.len(), 1);
        assert!(
            e[0].contains("server.max_pending_requests is 3); retry shortly"),
            "{e:?}"
        );
    }
    // The tier's bound: one batch choice fits the server's last seat; two do not fit now.
    let refused = submit_prompts(&engine, 2, 1, "batch");
    assert!(errors_of(&refused)[0][0].contains("retry shortly"));
    let batch = submit_prompts(&engine, 1, 1, "batch");
    assert_eq!(engine.in_flight(), 3);
    until_idle(&engine).await;
    assert_eq!(errors_of(&held), vec![Vec::<String>::new()]);
    assert_eq!(errors_of(&batch), vec![Vec::<String>::new()]);
    // Every choice refused as overloaded counts once: 2 + 2.
    let m = Snapshot::take();
    assert_eq!(overloaded(&m), 4);
    assert_eq!(m.counters_of(names::REQUEST_FAILED).len(), 1);

    // Once the seats are free the same request is admitted whole, and both prompts finish.
    let admitted = submit_prompts(&engine, 2, 1, "");
    assert_eq!(engine.in_flight(), 2);
    until_idle(&engine).await;
    assert_eq!(errors_of(&admitted), vec![Vec::<String>::new(); 2]);
    assert_eq!(
        Snapshot::take().counters_of(names::REQUEST_SUCCESS),
        vec![(success("length"), 2 + 1 + 2)]
    );
}

/// `request_failed_total{reason=...}`'s key.
fn failed(reason: &str) -> String {
    format!(
        "{}{{{}={reason}}}",
        names::REQUEST_FAILED,
        names::LABEL_REASON
    )
}

fn success(reason: &str) -> String {
    format!(
        "{}{{{}={reason}}}",
        names::REQUEST_SUCCESS,
        names::LABEL_FINISHED_REASON
    )
}

#[actix::test]
async fn each_choice_of_n_is_a_request_with_one_itl_per_step() {
    let (engine, _) = start_engine(false, false);
    let errors = run(&engine, request(4, 11, ignoring_eos()), Client::Stays).await;
    assert!(errors.is_empty(), "{errors:?}");
    let m = Snapshot::take();
    // As vLLM's child requests: 11 tokens a choice, one per step, so 10 inter-token
    // latencies each (one per request and step, never a 0 s gap between choices).
    assert_eq!(m.count(names::INTER_TOKEN_LATENCY), 40);
    for histogram in [
        names::TIME_TO_FIRST_TOKEN,
        names::TIME_PER_OUTPUT_TOKEN,
        names::E2E_REQUEST_LATENCY,
    ] {
        assert_eq!(m.count(histogram), 4, "{histogram}");
    }
    assert_eq!(
        m.counters_of(names::REQUEST_SUCCESS),
        vec![(success("length"), 4)]
    );
    assert_eq!(m.counter(names::GENERATION_TOKENS), 44);
}

/// vLLM's per-request histograms: per finished choice its prompt length, tokens generated,
/// max_tokens and its prefill, decode and inference times (first scheduled to first token,
/// first to last token, first scheduled to last token); once per request its n and its
/// longest choice.
#[actix::test]
async fn each_choice_records_its_lengths_and_phases_and_the_request_its_n_once() {
    let (engine, _) = start_engine(false, false);
    let errors = run(&engine, request(3, 6, ignoring_eos()), Client::Stays).await;
    assert!(errors.is_empty(), "{errors:?}");
    let m = Snapshot::take();
    assert_eq!(m.values(names::REQUEST_PROMPT_TOKENS), [10.0; 3]);
    assert_eq!(m.values(names::REQUEST_GENERATION_TOKENS), [6.0; 3]);
    assert_eq!(m.values(names::REQUEST_PARAMS_MAX_TOKENS), [6.0; 3]);
    assert_eq!(m.values(names::REQUEST_PARAMS_N), [3.0]);
    assert_eq!(m.values(names::REQUEST_MAX_NUM_GENERATION_TOKENS), [6.0]);
    let prefill = &m.histograms[names::REQUEST_PREFILL_TIME];
    let decode = &m.histograms[names::REQUEST_DECODE_TIME];
    let inference = &m.histograms[names::REQUEST_INFERENCE_TIME];
    assert_eq!((prefill.len(), decode.len(), inference.len()), (3, 3, 3));
    // Recorded together per choice: inference is prefill plus decode, each at least 0.
    for i in 0..3 {
        assert!(
            prefill[i] >= 0.0 && decode[i] >= 0.0,
            "{prefill:?} {decode:?}"
        );
        assert!(
            (inference[i] - (prefill[i] + decode[i])).abs() < 1e-9,
            "{inference:?} != {prefill:?} + {decode:?}"
        );
    }

    // A choice that stops early: the longest choice is what the request records once.
    let sampling = SamplingParams {
        eos_token_ids: vec![CYCLE - 1],
        ..SamplingParams::default()
    };
    let errors = run(&engine, request(1, 10, sampling), Client::Stays).await;
    assert!(errors.is_empty(), "{errors:?}");
    let m = Snapshot::take();
    assert_eq!(
        m.values(names::REQUEST_GENERATION_TOKENS),
        [2.0, 6.0, 6.0, 6.0]
    );
    assert_eq!(
        m.values(names::REQUEST_MAX_NUM_GENERATION_TOKENS),
        [2.0, 6.0]
    );
    assert_eq!(m.values(names::REQUEST_PARAMS_N), [1.0, 3.0]);
    assert_eq!(
        m.values(names::REQUEST_PARAMS_MAX_TOKENS),
        [6.0, 6.0, 6.0, 10.0]
    );
}

/// Tokens per engine step: the prompt's 10 in the first, then one decode a step.
#[actix::test]
async fn each_step_records_the_tokens_it_ran() {
    let (engine, _) = start_engine(false, false);
    let errors = run(&engine, request(1, 5, ignoring_eos()), Client::Stays).await;
    assert!(errors.is_empty(), "{errors:?}");
    let m = Snapshot::take();
    assert_eq!(
        m.values(names::ITERATION_TOKENS),
        [1.0, 1.0, 1.0, 1.0, 10.0]
    );
}

/// An aborted or failed request records none of the per-request histograms.
#[actix::test]
async fn requests_that_do_not_finish_record_no_lengths() {
    let (engine, _) = start_engine(true, false);
    let errors = run(&engine, request(2, 8, ignoring_eos()), Client::Stays).await;
    assert_eq!(errors.len(), 1, "{errors:?}");
    let m = Snapshot::take();
    for h in [
        names::REQUEST_PROMPT_TOKENS,
        names::REQUEST_GENERATION_TOKENS,
        names::REQUEST_PARAMS_N,
        names::REQUEST_MAX_NUM_GENERATION_TOKENS,
        names::REQUEST_PREFILL_TIME,
    ] {
        assert_eq!(m.count(h), 0, "{h}");
    }
}

#[actix::test]
async fn a_speculative_step_is_one_inter_token_latency() {
    let (engine, sampled_steps) = start_engine(false, true);
    let errors = run(&engine, request(1, 24, ignoring_eos()), Client::Stays).await;
    assert!(errors.is_empty(), "{errors:?}");
    let steps: usize = sampled_steps.lock().unwrap().values().sum();
    // Drafts were accepted: fewer steps than tokens.
    assert!(steps < 24, "{steps} sampling steps for 24 tokens");
    let m = Snapshot::take();
    assert_eq!(m.counter(names::GENERATION_TOKENS), 24);
    // One per step after the first token's, however many tokens each step brought.
    assert_eq!(m.count(names::INTER_TOKEN_LATENCY), steps - 1);
}

#[actix::test]
async fn the_end_of_sequence_token_finishes_as_stop() {
    let (engine, _) = start_engine(false, false);
    // The prompt ends in 1: the answer is 2 3, and 3 is the end-of-sequence token.
    let sampling = SamplingParams {
        eos_token_ids: vec![CYCLE - 1],
        ..SamplingParams::default()
    };
    let errors = run(&engine, request(1, 10, sampling), Client::Stays).await;
    assert!(errors.is_empty(), "{errors:?}");
    let m = Snapshot::take();
    assert_eq!(m.counter(names::GENERATION_TOKENS), 2);
    assert_eq!(
        m.counters_of(names::REQUEST_SUCCESS),
        vec![(success("stop"), 1)]
    );
}

#[actix::test]
async fn failed_steps_count_as_failures_not_aborts() {
    let (engine, _) = start_engine(true, false);
    let errors = run(&engine, request(2, 8, ignoring_eos()), Client::Stays).await;
    assert_eq!(errors.len(), 1, "{errors:?}");
    let m = Snapshot::take();
    assert_eq!(m.counter(names::REQUEST_ABORTED), 0);
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(failed("error"), 2)]
    );
    assert!(m.counters_of(names::REQUEST_SUCCESS).is_empty());
}

#[actix::test]
async fn a_client_gone_counts_each_open_choice_as_aborted() {
    let (engine, _) = start_engine(false, false);
    // Gone at its first delta: both choices are aborted, and counted once each.
    run(
        &engine,
        request(2, 50, ignoring_eos()),
        Client::LeavesAtFirstDelta,
    )
    .await;
    let m = Snapshot::take();
    assert_eq!(m.counter(names::REQUEST_ABORTED), 2);
    assert!(m.counters_of(names::REQUEST_SUCCESS).is_empty());
    assert!(m.counters_of(names::REQUEST_FAILED).is_empty());
}

/// A client gone before its request was queued (the engine finds it after encoding the
/// prompt) counts each choice as aborted, as one that leaves later does; one that dropped it
/// because another prompt of its request failed counts them as failed with that.
#[actix::test]
async fn a_client_gone_before_queueing_counts_each_choice_as_aborted() {
    let (engine, _) = start_engine(false, false);
    run(&engine, request(3, 8, ignoring_eos()), Client::GoneAtSubmit).await;
    let m = Snapshot::take();
    assert_eq!(m.counter(names::REQUEST_ABORTED), 3);
    assert!(m.counters_of(names::REQUEST_FAILED).is_empty());
    assert_eq!(m.counter(names::PROMPT_TOKENS), 0);
    run_abandoned(
        &engine,
        request(2, 8, ignoring_eos()),
        Client::GoneAtSubmit,
        Some(SubmitErrorKind::ContextLengthExceeded),
    )
    .await;
    let m = Snapshot::take();
    assert_eq!(m.counter(names::REQUEST_ABORTED), 3);
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(failed("context_length"), 2)]
    );
}

/// A request dropped because another prompt of its client request failed counts each open
/// choice as failed under that prompt's reason: a grammar that failed while generating is
/// `structured_output` for the other prompts too, not `error`.
#[actix::test]
async fn the_other_prompts_of_a_failed_grammar_count_under_its_reason() {
    let (engine, _) = start_engine(false, false);
    run_abandoned(
        &engine,
        request(2, 50, ignoring_eos()),
        Client::LeavesAtFirstDelta,
        Some(SubmitErrorKind::StructuredOutput),
    )
    .await;
    let m = Snapshot::take();
    assert_eq!(m.counter(names::REQUEST_ABORTED), 0);
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(failed("structured_output"), 2)]
    );
}

#[actix::test]
async fn a_last_delta_lost_after_the_success_counts_once() {
    let (engine, _) = start_engine(false, false);
    // Gone as its last delta is sent, after the choice's success was counted: a success only.
    run(
        &engine,
        request(1, 3, ignoring_eos()),
        Client::LeavesAtLastDelta,
    )
    .await;
    let m = Snapshot::take();
    assert_eq!(
        m.counters_of(names::REQUEST_SUCCESS),
        vec![(success("length"), 1)]
    );
    assert_eq!(m.counter(names::REQUEST_ABORTED), 0);
}

/// A client the sink cuts off for reading too slowly is still connected: its request failed
/// (the server ended it, and told it so), it did not go away. A choice whose last delta is
/// the one cut off is no success either: its client never read its end.
#[actix::test]
async fn a_client_cut_off_for_reading_slowly_counts_as_failed_not_aborted_nor_success() {
    let (engine, _) = start_engine(false, false);
    // Three steps, one delta each: the last one (the choice's end) is cut off.
    let errors = run(
        &engine,
        request(1, 3, ignoring_eos()),
        Client::CutOffAfter(2),
    )
    .await;
    assert_eq!(errors, ["cut off"]);
    let m = Snapshot::take();
    assert!(
        m.counters_of(names::REQUEST_SUCCESS).is_empty(),
        "{:?}",
        m.counters_of(names::REQUEST_SUCCESS)
    );
    assert_eq!(m.counter(names::REQUEST_ABORTED), 0);
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(failed("unavailable"), 1)]
    );
    // Cut off mid-way, both choices of n = 2 count as failed.
    run(
        &engine,
        request(2, 20, ignoring_eos()),
        Client::CutOffAfter(3),
    )
    .await;
    let m = Snapshot::take();
    assert!(m.counters_of(names::REQUEST_SUCCESS).is_empty());
    assert_eq!(m.counter(names::REQUEST_ABORTED), 0);
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(failed("unavailable"), 3)]
    );
}

/// Every `reason` a failed request can count under is created at zero at start.
#[test]
fn every_failure_reason_is_registered_at_zero() {
    use crate::actors::SubmitErrorKind as K;
    let kinds = [
        K::InvalidRequest,
        K::UnknownModel,
        K::ContextLengthExceeded,
        K::Overloaded,
        K::TooManyChoices,
        K::Unavailable,
        K::StructuredOutput,
        K::Internal,
    ];
    for label in kinds.into_iter().map(super::failure_label) {
        assert!(names::FAILURE_REASONS.contains(&label), "{label}");
    }
    for reason in [
        switchyard_policies::FinishReason::Stop,
        switchyard_policies::FinishReason::Eos,
        switchyard_policies::FinishReason::Length,
    ] {
        assert!(names::FINISHED_REASONS.contains(&reason.metric_label()));
    }
}

/// With special tokens skipped, the tokens a request keeps (a tool format's markers) keep
/// their text, and only they; with special tokens not skipped, every token's text is there.
#[actix::test]
async fn kept_special_tokens_keep_their_text_and_only_they() {
    // t1 and t2 are special; the answer to the prompt (which ends in t1) is t2 t3 t0 t1 t2 t3.
    let (engine, _) = start_engine_with(false, false, tokenizer_with_special(&[1, 2]));
    let text = |skip: bool, keep: [Option<u32>; 5]| {
        let engine = &engine;
        async move {
            let mut options = request(1, 6, ignoring_eos());
            options.skip_special_tokens = skip;
            options.keep_special_tokens = keep;
            let text = Arc::new(Mutex::new(String::new()));
            let into = text.clone();
            let sink = FnSink(move |output| {
                if let EngineOutput::Delta(d) = output {
                    into.lock().unwrap().push_str(&d.text);
                }
            });
            engine.submit(options, Box::new(sink));
            // A hang guard only; nothing here is timed.
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while engine.in_flight() > 0 {
                assert!(std::time::Instant::now() < deadline, "never ended");
                actix::clock::sleep(Duration::from_millis(2)).await;
            }
            let text = text.lock().unwrap().clone();
            text
        }
    };
    assert_eq!(text(true, [None; 5]).await, "t3t0t3");
    assert_eq!(
        text(true, [Some(2), None, None, None, None]).await,
        "t2t3t0t2t3"
    );
    assert_eq!(
        text(true, [None, Some(1), None, None, Some(2)]).await,
        "t2t3t0t1t2t3"
    );
    // A kept token that is not special changes nothing.
    assert_eq!(
        text(true, [Some(3), None, None, None, None]).await,
        "t3t0t3"
    );
    assert_eq!(text(false, [None; 5]).await, "t2t3t0t1t2t3");
}

/// The usage counters carry a configured tenant's name: prompt tokens once per prompt (as a
/// response's `usage.prompt_tokens`), generated tokens summed over the choices (as its
/// `usage.completion_tokens`), and each choice's outcome with its tier (none here) beside.
/// A tenant the configuration does not name counts without the label, as before.
#[actix::test]
async fn usage_counters_carry_configured_tenants_only() {
    let (engine, _) = start_engine_full(false, false, tokenizer(), &["acme"]);
    let of = |tenant: &str| RequestOptions {
        tenant: tenant.into(),
        ..request(3, 5, ignoring_eos())
    };
    for tenant in ["acme", "mallory", "acme"] {
        let errors = run(&engine, of(tenant), Client::Stays).await;
        assert!(errors.is_empty(), "{errors:?}");
    }
    let m = Snapshot::take();
    let acme = |name: &str| format!("{name}{{{}=acme}}", names::LABEL_TENANT);
    // Two requests of a 10-token prompt and 3 choices of 5 tokens each.
    assert_eq!(
        m.counters_of(names::PROMPT_TOKENS),
        vec![
            (names::PROMPT_TOKENS.to_string(), 10),
            (acme(names::PROMPT_TOKENS), 20)
        ]
    );
    assert_eq!(
        m.counters_of(names::GENERATION_TOKENS),
        vec![
            (names::GENERATION_TOKENS.to_string(), 15),
            (acme(names::GENERATION_TOKENS), 30)
        ]
    );
    assert_eq!(
        m.counters_of(names::REQUEST_SUCCESS),
        vec![
            (success("length"), 3),
            (
                format!(
                    "{}{{{}=acme,{}=length}}",
                    names::REQUEST_SUCCESS,
                    names::LABEL_TENANT,
                    names::LABEL_FINISHED_REASON
                ),
                6
            ),
        ]
    );
    // No series names the unconfigured tenant.
    assert!(
        m.counters.keys().all(|k| !k.contains("mallory")),
        "{:?}",
        m.counters.keys()
    );
}

/// Aborts and failures count under the request's tenant too: a client gone at its first
/// delta, and a failed step.
#[actix::test]
async fn aborts_and_failures_carry_the_tenant() {
    let (engine, _) = start_engine_full(false, false, tokenizer(), &["acme"]);
    let acme = RequestOptions {
        tenant: "acme".into(),
        ..request(2, 50, ignoring_eos())
    };
    run(&engine, acme.clone(), Client::LeavesAtFirstDelta).await;
    run(&engine, acme.clone(), Client::GoneAtSubmit).await;
    let m = Snapshot::take();
    assert_eq!(
        m.counters_of(names::REQUEST_ABORTED),
        vec![(
            format!("{}{{{}=acme}}", names::REQUEST_ABORTED, names::LABEL_TENANT),
            4
        )]
    );
    let (failing, _) = start_engine_full(true, false, tokenizer(), &["acme"]);
    let errors = run(&failing, acme, Client::Stays).await;
    assert_eq!(errors.len(), 1, "{errors:?}");
    let m = Snapshot::take();
    assert_eq!(
        m.counters_of(names::REQUEST_FAILED),
        vec![(
            format!(
                "{}{{{}=acme,{}=error}}",
                names::REQUEST_FAILED,
                names::LABEL_TENANT,
                names::LABEL_REASON
            ),
            2
        )]
    );
}

/// What the prefix cache served a choice at its first admission rides on every one of its
/// deltas, and `prompt_tokens_cached_total` counts it once per prompt (its first choice's),
/// under the tenant, as `usage.prompt_tokens_details.cached_tokens` does.
#[actix::test]
async fn cached_prompt_tokens_ride_on_the_deltas_and_count_once_per_prompt() {
    let (engine, _) = start_engine_full(false, false, tokenizer(), &["acme"]);
    // 40 prompt tokens, blocks of 16 (the scheduler's default): computed once, the prompt
    // then reuses its 2 full blocks before the one of its last token, 32 tokens.
    let options = || RequestOptions {
        prompt: PromptSource::Tokens((0..40).map(|i| i % CYCLE).collect()),
        tenant: "acme".into(),
        ..request(2, 3, ignoring_eos())
    };
    let mut seen = Vec::new();
    for _ in 0..2 {
        let deltas = Arc::new(Mutex::new(Vec::new()));
        engine.submit(options(), Box::new(cached_sink(&deltas)));
        until_idle(&engine).await;
        let deltas = deltas.lock().unwrap().clone();
        assert_eq!(deltas.iter().filter(|d| d.2).count(), 2, "{deltas:?}");
        seen.push(deltas);
    }
    let of = |deltas: &[(u32, u32, bool)], index: u32| -> Vec<u32> {
        deltas
            .iter()
            .filter(|d| d.0 == index)
            .map(|d| d.1)
            .collect()
    };
    // The first request computed its prompt; every delta of the second's choices says 32.
    assert!(of(&seen[0], 0).iter().all(|&c| c == 0), "{:?}", seen[0]);
    for index in 0..2 {
        let cached = of(&seen[1], index);
        assert!(
            !cached.is_empty() && cached.iter().all(|&c| c == 32),
            "{:?}",
            seen[1]
        );
    }
    let m = Snapshot::take();
    let acme = format!(
        "{}{{{}=acme}}",
        names::PROMPT_TOKENS_CACHED,
        names::LABEL_TENANT
    );
    assert_eq!(m.counters_of(names::PROMPT_TOKENS_CACHED), vec![(acme, 32)]);
}

/// A request is reported only the prompt tokens its own namespace computed: with tenants
/// kept apart, another tenant's blocks, another `cache_salt`'s and none for a request that
/// asks for prompt logprobs (a salt of its own each time: every prompt position computed).
#[actix::test]
async fn cached_prompt_tokens_come_only_from_the_request_s_namespace() {
    let (engine, _) = start_engine_sharing(false, false, tokenizer(), &[], 16, &[], true);
    // 40 prompt tokens, blocks of 16: 32 reusable.
    let options = |tenant: &str, salt: Option<&str>, prompt_logprobs: Option<u32>| RequestOptions {
        prompt: PromptSource::Tokens((0..40).map(|i| i % CYCLE).collect()),
        tenant: tenant.into(),
        cache_salt: salt.map(str::to_owned),
        prompt_logprobs,
        ..request(1, 2, ignoring_eos())
    };
    let cases = [
        ("a", None, None, 0),
        ("a", None, None, 32),
        ("b", None, None, 0),
        ("b", None, None, 32),
        ("a", Some("x"), None, 0),
        ("a", Some("x"), None, 32),
        ("b", Some("x"), None, 0),
        ("a", None, Some(0), 0),
        ("a", None, Some(0), 0),
        ("a", Some("x"), Some(1), 0),
        ("a", None, None, 32),
    ];
    for (tenant, salt, prompt_logprobs, want) in cases {
        let deltas = Arc::new(Mutex::new(Vec::new()));
        engine.submit(
            options(tenant, salt, prompt_logprobs),
            Box::new(cached_sink(&deltas)),
        );
        until_idle(&engine).await;
        let deltas = deltas.lock().unwrap().clone();
        assert!(deltas.iter().any(|d| d.2), "{deltas:?}");
        assert!(
            deltas.iter().all(|d| d.1 == want),
            "tenant {tenant}, salt {salt:?}, prompt logprobs {prompt_logprobs:?}: {deltas:?}"
        );
    }
}

/// `prompt_tokens_cached_total` counts what the prefix cache served a prompt whether or not
/// its client reads the answer, as `prompt_tokens_total` counts the prompt: a client gone at
/// its first delta, at its last (`will_deliver` then says no) or cut off is counted; one gone
/// before its request was queued was served nothing and is not.
#[actix::test]
async fn cached_prompt_tokens_count_whether_or_not_the_client_reads_them() {
    let (engine, _) = start_engine(false, false);
    let options = || RequestOptions {
        prompt: PromptSource::Tokens((0..40).map(|i| i % CYCLE).collect()),
        ..request(1, 3, ignoring_eos())
    };
    let total = || -> u64 {
        Snapshot::take()
            .counters_of(names::PROMPT_TOKENS_CACHED)
            .iter()
            .map(|c| c.1)
            .sum()
    };
    assert!(run(&engine, options(), Client::Stays).await.is_empty());
    assert_eq!(total(), 0);
    let mut want = 0;
    for client in [
        Client::GoneAtSubmit,
        Client::LeavesAtFirstDelta,
        Client::LeavesAtLastDelta,
        Client::CutOffAfter(1),
        Client::Stays,
    ] {
        run(&engine, options(), client).await;
        if client != Client::GoneAtSubmit {
            want += 32;
        }
        assert_eq!(total(), want);
    }
}

/// An embedding request: its one sampled token is not output, its one delta carries the
/// hidden state the backend reported at the prompt's last token and finishes as `stop` with 0
/// tokens, whatever the request's own sampling and length settings; it counts as a success
/// and generates no tokens. One with two choices is refused.
#[actix::test]
async fn an_embedding_is_one_delta_with_the_hidden_state_and_no_tokens() {
    let (engine, _) = start_engine(false, false);
    let out = Arc::new(Mutex::new(Vec::new()));
    let options = RequestOptions {
        embed: true,
        stop: vec!["t2".into()],
        ..request(1, 7, ignoring_eos())
    };
    engine.submit(options, Box::new(delta_sink(&out)));
    until_idle(&engine).await;
    let deltas = out.lock().unwrap().clone();
    assert_eq!(deltas.len(), 1, "{deltas:?}");
    let d = deltas[0].as_ref().expect("a delta");
    assert_eq!(d.text, "");
    assert!(d.token_ids.is_empty(), "{d:?}");
    assert_eq!(d.finish, Some((switchyard_policies::FinishReason::Stop, 0)));
    // The prompt `0 1 2 3 0 1 2 3 0 1`, one chunk of 10 tokens ending in 1.
    assert_eq!(d.embedding, Some(vec![1.0, 10.0]));
    let m = Snapshot::take();
    assert_eq!(m.counter(names::GENERATION_TOKENS), 0);
    assert_eq!(m.count(names::TIME_TO_FIRST_TOKEN), 0);
    assert_eq!(
        m.counters_of(names::REQUEST_SUCCESS),
        vec![(success("stop"), 1)]
    );
    // A finished request of its prompt's length, no tokens and no max_tokens, and no token
    // timeline (it has no first token).
    assert_eq!(m.values(names::REQUEST_PROMPT_TOKENS), [10.0]);
    assert_eq!(m.values(names::REQUEST_GENERATION_TOKENS), [0.0]);
    assert_eq!(m.values(names::REQUEST_MAX_NUM_GENERATION_TOKENS), [0.0]);
    assert_eq!(m.values(names::REQUEST_PARAMS_N), [1.0]);
    for none in [
        names::REQUEST_PARAMS_MAX_TOKENS,
        names::REQUEST_PREFILL_TIME,
        names::REQUEST_DECODE_TIME,
        names::REQUEST_INFERENCE_TIME,
    ] {
        assert_eq!(m.count(none), 0, "{none}");
    }

    let out = Arc::new(Mutex::new(Vec::new()));
    let options = RequestOptions {
        embed: true,
        ..request(2, 1, ignoring_eos())
    };
    engine.submit(options, Box::new(delta_sink(&out)));
    until_idle(&engine).await;
    let got = out.lock().unwrap().clone();
    assert!(
        matches!(got.as_slice(), [Err(m)] if m.contains("one choice")),
        "{got:?}"
    );
}

/// A request's seats are given back before its last choice's last delta goes out: a client
/// that sends its next request as soon as it reads the end of this one (a sequential client
/// at its tenant's bound of 1) finds its seat free; a choice that ends before its sibling
/// leaves the seats held.
#[actix::test]
async fn seats_are_free_when_the_last_delta_goes_out() {
    let (engine, _) = start_engine_bounded(false, false, tokenizer(), &[], 4, &[]);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = in_flight_at_end(&engine, &seen);
    engine.submit(request(1, 3, ignoring_eos()), Box::new(sink));
    until_idle(&engine).await;
    assert_eq!(*seen.lock().unwrap(), [0]);
    // Two choices ending in one step: the first's end still counts both seats (given back
    // together), the second's none.
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = in_flight_at_end(&engine, &seen);
    engine.submit(request(2, 3, ignoring_eos()), Box::new(sink));
    until_idle(&engine).await;
    assert_eq!(*seen.lock().unwrap(), [2, 0]);
}

/// A sink that hands every output to its function and always delivers.
struct FnSink<F>(F);

impl<F: FnMut(EngineOutput) + Send + 'static> OutputSink for FnSink<F> {
    fn send(&mut self, output: EngineOutput) -> bool {
        (self.0)(output);
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// Each delta's (choice index, cached prompt tokens, whether it is the choice's last).
type CachedRows = Arc<Mutex<Vec<(u32, u32, bool)>>>;

/// Records each delta's row of [`CachedRows`].
fn cached_sink(into: &CachedRows) -> impl OutputSink {
    let into = into.clone();
    FnSink(move |output| {
        if let EngineOutput::Delta(d) = output {
            let row = (d.index, d.cached_prompt_tokens, d.finish.is_some());
            into.lock().unwrap().push(row);
        }
    })
}

/// Records each delta, and each error's message.
type Deltas = Arc<Mutex<Vec<Result<crate::actors::ChoiceDelta, String>>>>;
fn delta_sink(into: &Deltas) -> impl OutputSink {
    let into = into.clone();
    FnSink(move |output| match output {
        EngineOutput::Delta(d) => into.lock().unwrap().push(Ok(d)),
        EngineOutput::Error(e) => into.lock().unwrap().push(Err(e.message)),
        EngineOutput::Prompt { .. } => {}
    })
}

/// Records, for each finishing delta, how many choices `engine` still counts in flight.
fn in_flight_at_end(engine: &Engine, seen: &Arc<Mutex<Vec<usize>>>) -> impl OutputSink {
    let (engine, seen) = (engine.clone(), seen.clone());
    FnSink(move |output| {
        if let EngineOutput::Delta(d) = output {
            if d.finish.is_some() {
                seen.lock().unwrap().push(engine.in_flight());
            }
        }
    })
}

/// The detokenizer alone (no scheduler), holding one request of `n` choices, ids `0..n`,
/// of the 10-token prompt of [`request`], its output going to `client`.
fn detokenizer_holding(n: u64, client: Client) -> super::DetokenizerActor {
    use super::{ChoiceState, DetokenizerActor, RequestSink, TextOptions};
    use crate::detokenizer::IncrementalDetokenizer;
    use std::cell::RefCell;
    use std::rc::Rc;
    use switchyard_policies::RequestId;
    let mut actor = DetokenizerActor::new(tokenizer());
    let ids: Vec<RequestId> = (0..n).map(RequestId).collect();
    let tier: Arc<str> = Arc::from("");
    let tenant: Arc<str> = Arc::from("");
    let request = Rc::new(RefCell::new(RequestSink {
        sink: Box::new(Sink {
            client,
            gone: false,
            deltas: 0,
            cut_off: false,
            errors: Arc::default(),
            abandoned_for: None,
        }),
        arrival: std::time::Instant::now(),
        ids: ids.clone(),
        guard: None,
        pending_prompt: None,
        held: Vec::new(),
        labels: names::tier_labels(&tier),
        outcome_labels: names::outcome_labels(&tier, &tenant),
        tier,
        tenant,
        slo: Default::default(),
        span: tracing::Span::none(),
        quiet: false,
        prompt_tokens: 10,
        max_tokens: Some(8),
        n: n as u32,
        max_generated: 0,
        prompt_counted: false,
    }));
    for (index, id) in ids.into_iter().enumerate() {
        actor.choices.insert(
            id,
            ChoiceState {
                index: index as u32,
                detok: IncrementalDetokenizer::new(Vec::new()),
                text: TextOptions::default(),
                tokens: 0,
                cached_prompt_tokens: 0,
                first_at: None,
                last_at: None,
                scheduled_at: None,
                request: request.clone(),
                prompt_logprobs: Vec::new(),
                constraint: None,
                embed: false,
                embedding: None,
            },
        );
    }
    actor
}

/// Choice `id`'s first token (with what the prefix cache served of its prompt, `cached`).
fn first_token(id: u64, cached: u32) -> Vec<crate::core::CoreEvent> {
    use crate::core::CoreEvent;
    use switchyard_policies::RequestId;
    vec![
        CoreEvent::PromptCached {
            id: RequestId(id),
            tokens: cached,
        },
        CoreEvent::Token {
            id: RequestId(id),
            token: 1,
            logprob: None,
            top_logprobs: Vec::new(),
            stops: false,
        },
    ]
}

/// Regression: with `n > 1`, the prompt counted in `prompt_tokens_total` at the first
/// choice's first token only, so a prompt whose other choice got a token first (the first
/// choice preempted, or computing prompt logprobs) and whose client then left was never
/// counted. It counts at whichever choice's first token comes first, once; the cached part
/// stays the first choice's, as `usage.cached_tokens` reports it.
#[actix::test]
async fn a_prompt_counts_at_the_first_token_of_whichever_choice_comes_first() {
    use super::StepEvents;
    use actix::Actor;
    install_recorder();
    // The second choice samples first and the client leaves at its delta: the first choice
    // never gets a token.
    let gone = detokenizer_holding(2, Client::LeavesAtFirstDelta).start();
    gone.send(StepEvents::new(first_token(1, 16)))
        .await
        .unwrap();
    let m = Snapshot::take();
    assert_eq!(m.counter(names::PROMPT_TOKENS), 10);
    assert_eq!(m.counter(names::REQUEST_ABORTED), 2, "both choices, open");
    assert_eq!(m.counter(names::PROMPT_TOKENS_CACHED), 0);
    // Every choice gets its first token, the first one last: the prompt counts once, its
    // cached part as the first choice found it.
    let stays = detokenizer_holding(3, Client::Stays).start();
    for id in [2, 1, 0] {
        stays
            .send(StepEvents::new(first_token(id, 8 * (id as u32 + 1))))
            .await
            .unwrap();
    }
    let m = Snapshot::take();
    assert_eq!(m.counter(names::PROMPT_TOKENS), 20);
    assert_eq!(m.counter(names::PROMPT_TOKENS_CACHED), 8);
}
