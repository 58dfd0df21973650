//! CPU forward-pass throughput on SmolLM2-135M (the Q4_1 GGUF when it is in the model cache,
//! else random weights of the same shapes and types): batch-1 decode, a 512-token prefill, and
//! one decode step of 32 concurrent sequences. Criterion reports tokens per second.
//! `SWITCHYARD_THREADS` sets the thread count (default: all cores), `SWITCHYARD_PRECISION`
//! the activation precision (`int8`, `mixed`, `precise`; default: this machine's
//! `ActivationPrecision::default()`).

use std::path::PathBuf;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use switchyard_gpu::backend::{
    Backend, Batch, CpuBackend, CpuBackendConfig, SamplingParams, SeqInput,
};
use switchyard_gpu::cpu::llama::{ActivationPrecision, LlamaModel};
use switchyard_gpu::model::gguf::GgufFile;
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::{LoraAdapter, LoraLimits};

const CONTEXT: usize = 128;

fn model() -> LlamaModel {
    let dir = std::env::var("SWITCHYARD_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/switchyard/models/smollm2-135m")
        });
    let path = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let loaded = GgufFile::open(&path)
        .and_then(|f| f.into_weights())
        .and_then(|(h, w)| {
            let c = LlamaConfig::from_gguf(&h)?;
            LlamaModel::from_weights(&c, &w)
        });
    match loaded {
        Ok(m) => m,
        Err(e) => {
            eprintln!(
                "{}: {e}; benchmarking random weights of the same shapes",
                path.display()
            );
            LlamaModel::dummy(&LlamaConfig::smollm2_135m(), 1).expect("dummy SmolLM2 weights")
        }
    }
}

fn seq(id: u64, start: usize, tokens: Vec<u32>, blocks_per_seq: usize) -> SeqInput {
    let first = id as u32 * blocks_per_seq as u32;
    SeqInput {
        seq_id: id,
        num_computed_tokens: start,
        tokens,
        block_table: (first..first + blocks_per_seq as u32).collect(),
        sample: true,
        num_drafts: 0,
        sampling: Arc::new(SamplingParams::greedy()),
        adapter: None,
        cached_prompt: None,
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7919 + salt * 104_729) % 49_000 + 100)
        .collect()
}

fn bench(c: &mut Criterion) {
    let threads = std::env::var("SWITCHYARD_THREADS")
        .ok()
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    let precision = match std::env::var("SWITCHYARD_PRECISION").as_deref() {
        Ok("int8") => ActivationPrecision::Int8,
        Ok("mixed") => ActivationPrecision::Mixed,
        Ok("precise") => ActivationPrecision::Precise,
        _ => ActivationPrecision::default(),
    };
    let cfg = CpuBackendConfig {
        num_kv_blocks: 33 * 40,
        block_size: 16,
        threads,
        precision,
        ..Default::default()
    };
    let mut be = CpuBackend::new(model(), &cfg).expect("backend");
    let blocks = 40;
    let mut g = c.benchmark_group("smollm2_q4_1");
    g.sample_size(20);

    // Prefill 512 tokens.
    g.throughput(Throughput::Elements(512));
    let batch = Batch {
        seqs: vec![seq(32, 0, prompt(512, 0), blocks)],
    };
    g.bench_function("prefill_512", |b| {
        b.iter(|| be.execute(&batch).expect("prefill"))
    });

    // Contexts of CONTEXT tokens for 32 sequences, then single decode steps.
    for id in 0..32 {
        let batch = Batch {
            seqs: vec![seq(id, 0, prompt(CONTEXT, id as u32), blocks)],
        };
        be.execute(&batch).expect("context");
    }
    g.throughput(Throughput::Elements(1));
    let one = Batch {
        seqs: vec![seq(0, CONTEXT, vec![1234], blocks)],
    };
    g.bench_function("decode_batch_1", |b| {
        b.iter(|| be.execute(&one).expect("decode"))
    });

    g.throughput(Throughput::Elements(32));
    let many = Batch {
        seqs: (0..32)
            .map(|id| seq(id, CONTEXT, vec![1234 + id as u32], blocks))
            .collect(),
    };
    g.bench_function("decode_32_seqs", |b| {
        b.iter(|| be.execute(&many).expect("decode"))
    });

    // The same decode steps with a LoRA adapter (the test adapter: rank 4 on every projection).
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/lora/smollm2-r4");
    let adapter = Arc::new(
        LoraAdapter::load(&dir, &be.model().config, &LoraLimits::default()).expect("adapter"),
    );
    let with_adapter = |b: &Batch| Batch {
        seqs: b
            .seqs
            .iter()
            .map(|s| SeqInput {
                adapter: Some(adapter.clone()),
                cached_prompt: None,
                ..s.clone()
            })
            .collect(),
    };
    let (one, many) = (with_adapter(&one), with_adapter(&many));
    g.throughput(Throughput::Elements(1));
    g.bench_function("decode_batch_1_lora", |b| {
        b.iter(|| be.execute(&one).expect("decode"))
    });
    g.throughput(Throughput::Elements(32));
    g.bench_function("decode_32_seqs_lora", |b| {
        b.iter(|| be.execute(&many).expect("decode"))
    });
    g.finish();
}

/// The FFN up-projection shape of SmolLM2 (3072 x 576, Q4_1) at several batch sizes.
fn kernels(c: &mut Criterion) {
    use switchyard_gpu::cpu::matmul::{linear, Isa};
    use switchyard_gpu::cpu::quant::{QActs, Weight};
    use switchyard_gpu::model::{DType, TensorView};
    let (rows, cols) = (3072, 576);
    let mut data = vec![0u8; rows * cols / 32 * 20];
    for (i, b) in data.iter_mut().enumerate() {
        *b = (i * 7 % 251) as u8 & 0x3b;
    }
    let view = TensorView {
        dtype: DType::Q4_1,
        shape: vec![rows, cols],
        data: &data,
    };
    let w = Weight::from_view("w", &view).expect("weight");
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    let mut g = c.benchmark_group("matmul_q4_1_3072x576_1thread");
    for tokens in [1usize, 32, 128] {
        let x: Vec<f32> = (0..tokens * cols)
            .map(|i| (i as f32 * 0.01).sin())
            .collect();
        let xq = QActs::quantize(&x, tokens, cols);
        let mut out = vec![0f32; tokens * rows];
        g.throughput(Throughput::Elements((rows * cols * tokens) as u64));
        g.bench_function(format!("tokens_{tokens}"), |b| {
            b.iter(|| pool.install(|| linear(&[&w], &x, &xq, tokens, &mut out, Isa::detect())))
        });
    }
    g.finish();
}

criterion_group!(benches, kernels, bench);
criterion_main!(benches);
