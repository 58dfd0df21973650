//! Test support shared by the actors' unit tests: a three-word tokenizer and a backend that
//! counts what it is fed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use switchyard_gpu::backend::{Backend, Batch, PromptLogprob, SeqOutput};
use switchyard_gpu::model::Tokenizer;
use switchyard_gpu::GpuError;

/// A word-level tokenizer of the words "a" (0, also the unknown word), "b" (1) and "c" (2),
/// split on whitespace.
pub(crate) fn abc_tokenizer() -> Arc<Tokenizer> {
    let json = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
        "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"b":1,"c":2},"unk_token":"a"}}"#;
    Arc::new(Tokenizer::from_json_bytes(json.as_bytes()).expect("tokenizer"))
}

/// Samples token 1 at once and counts the tokens each sequence was fed, in 64 blocks of 4
/// tokens (the KV cache holds 256 tokens of one sequence); an empty batch (which the engine
/// must never build) is counted under [`EMPTY_BATCHES`].
pub(crate) struct CountingBackend(pub(crate) Arc<Mutex<HashMap<u64, usize>>>);

/// The key under which [`CountingBackend`] counts empty batches.
pub(crate) const EMPTY_BATCHES: u64 = u64::MAX;

/// The key under which [`CountingBackend`] counts the logit rows it computed for sequences
/// asking for prompt logprobs (one per token fed; it reports each prompt position past the
/// first with logprob 0, rank 1).
pub(crate) const PROMPT_LOGPROB_ROWS: u64 = u64::MAX - 1;

impl Backend for CountingBackend {
    fn name(&self) -> &str {
        "counting"
    }
    fn num_kv_blocks(&self) -> usize {
        64
    }
    fn block_size(&self) -> usize {
        4
    }
    fn max_batch_tokens(&self) -> usize {
        1024
    }
    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        let mut fed = self.0.lock().unwrap();
        if batch.seqs.is_empty() {
            *fed.entry(EMPTY_BATCHES).or_default() += 1;
        }
        Ok(batch
            .seqs
            .iter()
            .map(|s| {
                *fed.entry(s.seq_id).or_default() += s.tokens.len();
                let prompt_logprobs: Vec<_> = match s.sampling.prompt_logprobs {
                    Some(_) => (s.num_computed_tokens.max(1)
                        ..s.num_computed_tokens + s.tokens.len())
                        .map(|position| PromptLogprob {
                            position,
                            token: s.tokens[position - s.num_computed_tokens],
                            logprob: 0.0,
                            rank: 1,
                            top_logprobs: Vec::new(),
                        })
                        .collect(),
                    None => Vec::new(),
                };
                if s.sampling.prompt_logprobs.is_some() {
                    // A backend computes a logit row for every token of such a sequence.
                    *fed.entry(PROMPT_LOGPROB_ROWS).or_default() += s.tokens.len();
                }
                SeqOutput {
                    seq_id: s.seq_id,
                    accepted: Vec::new(),
                    token: s.sample.then_some(1),
                    logprob: None,
                    top_logprobs: Vec::new(),
                    prompt_logprobs,
                    hidden: None,
                }
            })
            .collect())
    }
    fn release(&mut self, _: u64) {}
}

/// The three shape methods of a test [`Backend`] that wraps another in its `inner` field:
/// the wrapped backend's KV blocks, block size and step budget.
macro_rules! inner_backend_shape {
    () => {
        fn num_kv_blocks(&self) -> usize {
            self.inner.num_kv_blocks()
        }
        fn block_size(&self) -> usize {
            self.inner.block_size()
        }
        fn max_batch_tokens(&self) -> usize {
            self.inner.max_batch_tokens()
        }
    };
}
pub(crate) use inner_backend_shape;

/// A [`CountingBackend`] whose every step, once begun (said on `entered`), waits for a
/// message on `gate` or for its sender to be dropped, which releases every step from then on:
/// a step stuck on the device, for as long as a test wants.
pub(crate) struct GatedBackend {
    pub(crate) inner: CountingBackend,
    pub(crate) entered: std::sync::mpsc::Sender<()>,
    pub(crate) gate: std::sync::mpsc::Receiver<()>,
}

impl Backend for GatedBackend {
    fn name(&self) -> &str {
        "gated"
    }
    inner_backend_shape!();
    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        // The test may have stopped listening; the step goes on.
        let _ = self.entered.send(());
        // A message or a dropped sender: either releases the step.
        let _ = self.gate.recv();
        self.inner.execute(batch)
    }
    fn release(&mut self, _: u64) {}
}

/// A metrics recorder that keeps one series, the counter or gauge named `name` (a counter's
/// count, a gauge's `f64` bits, in [`Self::cell`]), and drops every other; for a test that
/// installs it on its thread (`metrics::with_local_recorder`), so tests running at once do not
/// mix.
pub(crate) struct OneSeries {
    name: &'static str,
    /// What was recorded into the series.
    pub(crate) cell: Arc<std::sync::atomic::AtomicU64>,
    /// How many of the gauge's next writes panic instead ([`Self::panicking`]).
    panics: Arc<std::sync::atomic::AtomicU32>,
}

impl OneSeries {
    pub(crate) fn new(name: &'static str) -> Self {
        Self {
            name,
            cell: Arc::default(),
            panics: Arc::default(),
        }
    }

    /// The same, whose gauge panics on its next `writes` writes (a broken recorder), leaving
    /// its value as it was.
    pub(crate) fn panicking(name: &'static str, writes: u32) -> Self {
        let series = Self::new(name);
        series
            .panics
            .store(writes, std::sync::atomic::Ordering::Release);
        series
    }

    /// The counter's count.
    pub(crate) fn count(&self) -> u64 {
        self.cell.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The gauge's value.
    pub(crate) fn gauge(&self) -> f64 {
        f64::from_bits(self.count())
    }
}

impl metrics::Recorder for OneSeries {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        if key.name() == self.name {
            metrics::Counter::from_arc(self.cell.clone())
        } else {
            metrics::Counter::noop()
        }
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        if key.name() == self.name {
            metrics::Gauge::from_arc(Arc::new(PanickingGauge {
                cell: self.cell.clone(),
                panics: self.panics.clone(),
            }))
        } else {
            metrics::Gauge::noop()
        }
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

/// [`OneSeries`]'s gauge: its value's bits in `cell`, a write panicking while `panics` counts
/// down.
struct PanickingGauge {
    cell: Arc<std::sync::atomic::AtomicU64>,
    panics: Arc<std::sync::atomic::AtomicU32>,
}

impl PanickingGauge {
    fn write(&self, value: impl FnOnce(f64) -> f64) {
        use std::sync::atomic::Ordering;
        let panicking = self
            .panics
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .is_ok();
        assert!(!panicking, "a broken recorder");
        let old = f64::from_bits(self.cell.load(Ordering::Acquire));
        self.cell.store(value(old).to_bits(), Ordering::Release);
    }
}

impl metrics::GaugeFn for PanickingGauge {
    fn increment(&self, value: f64) {
        self.write(|old| old + value);
    }
    fn decrement(&self, value: f64) {
        self.write(|old| old - value);
    }
    fn set(&self, value: f64) {
        self.write(|_| value);
    }
}
