#![allow(clippy::all)]
use std::path::PathBuf;
use std::sync::Arc;

use switchyard_gpu::backend::{
    Backend, Batch, CpuBackend, CpuBackendConfig, SamplingParams, SeqInput,
};
use switchyard_gpu::cpu::llama::{ActivationPrecision, LlamaModel};
use switchyard_gpu::model::gguf::GgufFile;
use switchyard_gpu::model::LlamaConfig;

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
        sampling: Arc::new(SamplingParams::greedy()),
        adapter: None,
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 7919 + salt * 104_729) % 49_000 + 100)
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let phase = args[1].clone();
    let n: usize = args[2].parse().unwrap();
    let cfg = CpuBackendConfig {
        num_kv_blocks: 33 * 40,
        block_size: 16,
        threads: 0,
        precision: ActivationPrecision::Mixed,
        ..Default::default()
    };
    let mut be = CpuBackend::new(model(), &cfg).expect("backend");
    let blocks = 40;
    for id in 0..32 {
        let batch = Batch {
            seqs: vec![seq(id, 0, prompt(CONTEXT, id as u32), blocks)],
        };
        be.execute(&batch).expect("context");
    }
    let one = Batch {
        seqs: vec![seq(0, CONTEXT, vec![1234], blocks)],
    };
    let many = Batch {
        seqs: (0..32)
            .map(|id| seq(id, CONTEXT, vec![1234 + id as u32], blocks))
            .collect(),
    };
    let mut ts = vec![];
    for _ in 0..n {
        let t0 = std::time::Instant::now();
        if phase == "d1" {
            be.execute(&one).unwrap();
        } else if phase == "d32" {
            be.execute(&many).unwrap();
        }
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    eprintln!(
        "{phase} {n}: min {:.3} ms p25 {:.3} med {:.3}",
        ts[0],
        ts[n / 4],
        ts[n / 2]
    );
}
