//! Copies between the CUDA KV cache and its host tier (`cache.kv_offloading_size`): the rate
//! of [`Backend::copy_kv`] for offloads (device to host) and loads (host to device), and of
//! [`Backend::store_kv`] for stores (device to host on the tier's copy stream; the time until
//! both streams are done, as nothing runs beside them here), for runs
//! of consecutive blocks (one DMA per layer, part and run), for runs of 8 blocks apart, and for
//! scattered blocks (every other device block: one DMA per layer, part and block), on random
//! weights of Llama-3-8B (2 MiB blocks of 16 tokens in bf16, 32 KiB a layer part) and
//! SmolLM2-135M (360 KiB blocks, 6 KiB a layer part), each by DMA, by the `kv_tier_copy`
//! kernel and by the default mix of both ([`KvCopyEngine::AUTO`]: a load run of 8 Llama-3-8B
//! blocks goes by DMA, one of 8 SmolLM2 blocks by the kernel). Criterion reports bytes per
//! second. Needs a GPU (`cargo bench --features cuda -p switchyard-gpu --bench cuda_kv_copy`);
//! without one it says so and measures nothing.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use switchyard_gpu::backend::{Backend, KvCopy};
use switchyard_gpu::cuda::{probe, CudaBackend, CudaBackendConfig, KvCopyEngine, WeightSource};
use switchyard_gpu::model::LlamaConfig;
use switchyard_gpu::{KvGeometry, KvStorage};

const BLOCK_SIZE: usize = 16;

fn block_bytes(c: &LlamaConfig) -> usize {
    KvGeometry::of(c, BLOCK_SIZE, KvStorage::Half).block_bytes()
}

fn bench_model(
    cr: &mut Criterion,
    name: &str,
    c: &LlamaConfig,
    copies: &[usize],
    engine: KvCopyEngine,
) {
    let per_block = block_bytes(c);
    let most = copies.iter().copied().max().unwrap_or(1);
    let mut cuda = CudaBackend::new(
        c,
        WeightSource::Dummy(7),
        &CudaBackendConfig {
            num_kv_blocks: Some(2 * most + most / 8 + 2),
            host_kv_bytes: most * per_block,
            host_kv_copy: Some(engine),
            cuda_graphs: false,
            max_batch_tokens: 256,
            ..CudaBackendConfig::default()
        },
    )
    .expect("backend");
    assert_eq!(cuda.num_host_kv_blocks(), most);
    let engine_name = match engine {
        KvCopyEngine::Dma => "dma",
        KvCopyEngine::Kernel => "kernel",
        _ => "auto",
    };
    let mut g = cr.benchmark_group(format!("kv_copy/{name}/{engine_name}"));
    g.sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2));
    for &n in copies {
        g.throughput(Throughput::Bytes((n * per_block) as u64));
        let runs: Vec<KvCopy> = (0..n as u32)
            .map(|i| KvCopy { device: i, host: i })
            .collect();
        let scattered: Vec<KvCopy> = (0..n as u32)
            .map(|i| KvCopy {
                device: 2 * i,
                host: i,
            })
            .collect();
        // Runs of 8 with a gap of one cache block between them.
        let run8: Vec<KvCopy> = (0..n as u32)
            .map(|i| KvCopy {
                device: i + i / 8,
                host: i,
            })
            .collect();
        for (layout, list) in [("run", &runs), ("run8", &run8), ("scattered", &scattered)] {
            for dir in ["offload", "load", "store"] {
                g.bench_function(format!("{dir}/{layout}/{n}"), |b| {
                    b.iter_custom(|iters| {
                        cuda.synchronize().expect("sync");
                        let t = Instant::now();
                        for _ in 0..iters {
                            match dir {
                                "offload" => cuda.copy_kv(list, &[]),
                                "load" => cuda.copy_kv(&[], list),
                                _ => cuda.store_kv(list),
                            }
                            .expect("copy");
                        }
                        // Both streams: the compute stream's copies and the copy stream's
                        // stores.
                        cuda.synchronize().expect("sync");
                        t.elapsed()
                    })
                });
            }
        }
    }
    g.finish();
}

fn kv_copy(cr: &mut Criterion) {
    if let Err(e) = probe() {
        eprintln!("no usable CUDA device ({e}): nothing measured");
        return;
    }
    for engine in [KvCopyEngine::Dma, KvCopyEngine::Kernel, KvCopyEngine::AUTO] {
        bench_model(
            cr,
            "llama-3-8b",
            &LlamaConfig::llama3_8b(),
            &[16, 256],
            engine,
        );
        bench_model(
            cr,
            "smollm2-135m",
            &LlamaConfig::smollm2_135m(),
            &[16, 256],
            engine,
        );
    }
}

criterion_group!(benches, kv_copy);
criterion_main!(benches);
