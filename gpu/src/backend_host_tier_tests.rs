//! The CPU backend's host KV tier ([`Backend::copy_kv`]) on a small random model.

use std::sync::Arc;

use super::*;
use crate::cpu::llama::LlamaModel;
use crate::model::LlamaConfig;

const BLOCK: usize = 4;

/// Bytes of one KV block of [`tiny`]: keys and values (f16) of every layer.
fn block_bytes() -> usize {
    2 * 2 * 2 * 16 * BLOCK * 2
}

fn backend(host_kv_bytes: usize) -> CpuBackend {
    let cfg = CpuBackendConfig {
        num_kv_blocks: 8,
        block_size: BLOCK,
        threads: 1,
        host_kv_bytes,
        ..CpuBackendConfig::default()
    };
    CpuBackend::new(
        LlamaModel::dummy(&LlamaConfig::tiny(), 7).expect("model"),
        &cfg,
    )
    .expect("backend")
}

/// The logits of the last of `tokens`, fed from position `at` with block table `table`.
fn logits(be: &mut CpuBackend, tokens: &[u32], at: usize, table: &[u32]) -> Vec<f32> {
    let batch = Batch {
        seqs: vec![SeqInput {
            seq_id: 1,
            num_computed_tokens: at,
            tokens: tokens.to_vec(),
            block_table: table.to_vec(),
            sample: true,
            num_drafts: 0,
            sampling: Arc::new(SamplingParams::greedy()),
            adapter: None,
            cached_prompt: None,
        }],
    };
    be.logits(&batch).expect("forward")
}

fn copies(pairs: &[(u32, u32)]) -> Vec<KvCopy> {
    pairs
        .iter()
        .map(|&(device, host)| KvCopy { device, host })
        .collect()
}

/// Prefill a prompt, offload its blocks, overwrite them with another sequence, load them back
/// into other blocks and decode: the logits are bitwise those of the uninterrupted run.
#[test]
fn a_prefix_offloaded_overwritten_and_loaded_elsewhere_decodes_as_before() {
    let prompt: Vec<u32> = (0..10).map(|i| (i * 37 + 11) % 256).collect();
    let other: Vec<u32> = (0..12).map(|i| (i * 53 + 5) % 256).collect();
    let next = [42u32];
    let mut be = backend(3 * block_bytes() + block_bytes() / 2);
    assert_eq!(be.num_host_kv_blocks(), 3);

    logits(&mut be, &prompt, 0, &[0, 1, 2]);
    let uninterrupted = logits(&mut be, &next, prompt.len(), &[0, 1, 2]);

    logits(&mut be, &prompt, 0, &[0, 1, 2]);
    be.copy_kv(&copies(&[(0, 2), (1, 0), (2, 1)]), &[])
        .expect("offload");
    logits(&mut be, &other, 0, &[0, 1, 2]);
    // Without the load, block 5.. hold nothing of the prompt: the decode differs.
    let unloaded = logits(&mut be, &next, prompt.len(), &[5, 6, 7]);
    assert_ne!(unloaded, uninterrupted);
    be.copy_kv(&[], &copies(&[(5, 2), (6, 0), (7, 1)]))
        .expect("load");
    let reloaded = logits(&mut be, &next, prompt.len(), &[5, 6, 7]);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&reloaded), bits(&uninterrupted));
}

/// Offloads are made before loads within one call: a block offloaded and loaded into another
/// in the same call arrives there.
#[test]
fn offloads_come_before_loads_in_one_call() {
    let prompt: Vec<u32> = (0..4).map(|i| i * 3 + 1).collect();
    let mut be = backend(block_bytes());
    logits(&mut be, &prompt, 0, &[0]);
    let expected = logits(&mut be, &[9], 4, &[0, 1]);
    logits(&mut be, &prompt, 0, &[0]);
    be.copy_kv(&copies(&[(0, 0)]), &copies(&[(3, 0)]))
        .expect("copy");
    assert_eq!(logits(&mut be, &[9], 4, &[3, 1]), expected);
}

#[test]
fn copies_out_of_range_or_without_a_tier_are_errors() {
    let mut be = backend(2 * block_bytes());
    for (off, load) in [
        (copies(&[(8, 0)]), vec![]),
        (copies(&[(0, 2)]), vec![]),
        (vec![], copies(&[(0, u32::MAX)])),
    ] {
        let e = be.copy_kv(&off, &load).expect_err("out of range");
        assert!(e.to_string().contains("out of range"), "{e}");
    }
    let mut none = backend(block_bytes() - 1);
    assert_eq!(none.num_host_kv_blocks(), 0);
    none.copy_kv(&[], &[]).expect("nothing to copy");
    let e = none.copy_kv(&copies(&[(0, 0)]), &[]).expect_err("no tier");
    assert!(e.to_string().contains("no host KV tier"), "{e}");
}
