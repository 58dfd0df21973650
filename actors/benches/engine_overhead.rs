//! The engine's own cost per step with the model taken out: the real actors (scheduler, KV
//! allocator, executor, detokenizer) around a backend that answers at once, with a fixed
//! number of sequences decoding. A step's time here is planning, the allocator commit, the
//! executor hand-off, applying outputs and the detokenizer message — what the server's
//! `switchyard:engine_step_overhead_seconds` histogram measures beside real model time.
//!
//! `cargo bench -p switchyard-actors --bench engine_overhead`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use switchyard_actors::actors::{
    Engine, EngineConfig, EngineOutput, OutputSink, PromptSource, RequestOptions,
};
use switchyard_gpu::backend::{Backend, Batch, SamplingParams, SeqOutput};
use switchyard_gpu::model::Tokenizer;
use switchyard_gpu::GpuError;
use switchyard_policies::{PolicyRegistry, SchedulerConfig};

const VOCAB: u32 = 512;

/// Samples `last fed token + 1` without any model work, and counts steps.
struct InstantBackend {
    steps: Arc<AtomicU64>,
    blocks: usize,
}

impl Backend for InstantBackend {
    fn name(&self) -> &str {
        "instant"
    }
    fn num_kv_blocks(&self) -> usize {
        self.blocks
    }
    fn block_size(&self) -> usize {
        16
    }
    fn max_batch_tokens(&self) -> usize {
        1 << 16
    }
    fn execute(&mut self, batch: &Batch) -> Result<Vec<SeqOutput>, GpuError> {
        self.steps.fetch_add(1, Ordering::Relaxed);
        Ok(batch
            .seqs
            .iter()
            .map(|s| SeqOutput {
                seq_id: s.seq_id,
                accepted: Vec::new(),
                token: s
                    .sample
                    .then(|| (s.tokens.last().copied().unwrap_or(0) + 1) % VOCAB),
                logprob: None,
                top_logprobs: Vec::new(),
                prompt_logprobs: Vec::new(),
                hidden: None,
            })
            .collect())
    }
    fn release(&mut self, _: u64) {}
}

/// A word-level tokenizer of `VOCAB` tokens `t0 … t511`.
fn tokenizer() -> Arc<Tokenizer> {
    let vocab: serde_json::Map<String, serde_json::Value> = (0..VOCAB)
        .map(|i| (format!("t{i}"), serde_json::Value::from(i)))
        .collect();
    let json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}
    });
    Arc::new(Tokenizer::from_json_bytes(json.to_string().as_bytes()).expect("tokenizer"))
}

/// Discards outputs; when its request ends, submits a fresh one so the batch stays full.
struct Resubmit {
    engine: Engine,
}

fn request() -> RequestOptions {
    RequestOptions {
        prompt: PromptSource::Tokens((0..16).collect()),
        sampling: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::default()
        },
        stop: Vec::new(),
        include_stop_str_in_output: false,
        skip_special_tokens: true,
        keep_special_tokens: Default::default(),
        n: 1,
        max_tokens: Some(256),
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
        filters: switchyard_actors::token_filters::TokenFilters::default(),
    }
}

impl OutputSink for Resubmit {
    fn send(&mut self, output: EngineOutput) -> bool {
        if let EngineOutput::Delta(d) = &output {
            if d.finish.is_some() {
                let engine = self.engine.clone();
                engine.submit(
                    request(),
                    Box::new(Resubmit {
                        engine: engine.clone(),
                    }),
                );
            }
        }
        true
    }
    fn is_closed(&self) -> bool {
        false
    }
}

/// Starts an engine with `running` sequences decoding; returns its step counter and system.
fn start_engine(running: usize) -> (Arc<AtomicU64>, actix::System) {
    let steps = Arc::new(AtomicU64::new(0));
    let counter = steps.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let system = actix::System::new();
        system.block_on(async move {
            let blocks = running * 20;
            let scheduler = SchedulerConfig {
                max_num_seqs: running,
                max_num_batched_tokens: 8192,
                num_gpu_blocks: blocks,
                max_model_len: 512,
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
                    max_pending_requests: running * 4,
                    tier_max_pending: Vec::new(),
                    tier_max_pending_per_tenant: Vec::new(),
                    metrics_tenants: Default::default(),
                    async_scheduling: Default::default(),
                    lora: None,
                    prefix_sharing_by_tenant: false,
                    message_tokens_as_text: true,
                    step_timeout: None,
                    vocab_size: 0,
                },
                Box::new(InstantBackend {
                    steps: counter,
                    blocks,
                }),
                tokenizer(),
                None,
                policy,
            )
            .expect("engine");
            for _ in 0..running {
                engine.submit(
                    request(),
                    Box::new(Resubmit {
                        engine: engine.clone(),
                    }),
                );
            }
            tx.send(actix::System::current()).ok();
        });
        system.run().ok();
    });
    let system = rx.recv().expect("engine started");
    (steps, system)
}

/// Waits until the engine has run `n` more steps; returns the time they took.
fn time_steps(steps: &AtomicU64, n: u64) -> Duration {
    let start_count = steps.load(Ordering::Relaxed);
    let start = Instant::now();
    while steps.load(Ordering::Relaxed) < start_count + n {
        std::thread::sleep(Duration::from_micros(200));
    }
    start.elapsed()
}

fn engine_overhead(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine_step");
    group.sample_size(20);
    for running in [32usize, 256] {
        let (steps, system) = start_engine(running);
        // Let every sequence get through its prefill.
        time_steps(&steps, 50);
        group.bench_with_input(BenchmarkId::new("decode", running), &running, |b, _| {
            b.iter_custom(|iters| time_steps(&steps, iters))
        });
        system.stop();
    }
    group.finish();
}

criterion_group!(benches, engine_overhead);
criterion_main!(benches);
