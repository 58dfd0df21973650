//! The host KV tier in the loop (`cache.kv_offloading_size` / `num_host_blocks`): copies made
//! at eviction and loads in the steps' time, stores ahead of eviction on a copy engine of
//! their own (`cache.kv_offloading_ahead`), and what the run reports. Steps cost 1 ms and a
//! 2 MiB block (Llama-3-8B's 16 tokens) 41.94304 us at 50 GB/s, so the figures below are
//! counted by hand.

use super::*;
use crate::cost::Calibration;
use std::path::Path;
use std::sync::Arc;

fn spec(yaml: &str) -> SimulationSpec {
    SimulationSpec::from_yaml_str(yaml, Path::new("t.yaml")).unwrap()
}

/// A request at `arrival_s` with `prompt`, asking for `output` tokens.
fn request(arrival_s: f64, prompt: std::ops::Range<u32>, output: u32) -> TraceRequest {
    TraceRequest {
        arrival_s,
        prompt: Arc::from(prompt.collect::<Vec<_>>()),
        output_len: output,
        tenant: String::new(),
        tier: String::new(),
        priority: None,
        adapter: None,
        client: String::new(),
        think_s: None,
    }
}

/// Runs `rs` one at a time on a 40-block cache of 16-token blocks with `cache`'s settings
/// added (1 ms steps, no copy cost unless asked), in order or planned ahead.
fn run(cache: &str, rs: &[TraceRequest], async_scheduling: bool) -> PolicyRun {
    let yaml = format!(
        "policies: [{{name: fcfs}}]\n\
         scheduler: {{max_num_seqs: 1, max_model_len: 640, async_scheduling: {async_scheduling}}}\n\
         cache: {{num_gpu_blocks: 40, block_size: 16{cache}}}\n\
         workload: {{trace: unused.csv, format: azure}}\n"
    );
    let mut sim = Simulation::new(&spec(&yaml)).unwrap();
    sim.cost = CostModel::Calibrated(Calibration {
        intercept_s: 1e-3,
        ..Default::default()
    });
    sim.run_policy(&PolicySpec::named("fcfs"), rs, false)
        .unwrap()
}

/// A (320 tokens), then B (600 other tokens: the 40-block cache's room evicts A's
/// prefix), then A again, one at a time.
fn a_b_a(cache: &str) -> PolicyRun {
    let rs = [
        request(0.0, 1..321, 1),
        request(1.0, 1000..1600, 1),
        request(2.0, 1..321, 1),
    ];
    run(cache, &rs, false)
}

/// As [`a_b_a`], with a short request decoding between A and B and another between B and
/// A's second run: steps during which the blocks A and B computed can be stored ahead.
fn a_c_b_c_a(cache: &str, async_scheduling: bool) -> PolicyRun {
    let rs = [
        request(0.0, 1..321, 1),
        request(0.5, 2000..2016, 4),
        request(1.0, 1000..1600, 1),
        request(1.5, 3000..3016, 4),
        request(2.0, 1..321, 1),
    ];
    run(cache, &rs, async_scheduling)
}

/// Copies made at eviction only (`kv_offloading_ahead: false`): the figures the simulator
/// gave before it priced stores ahead of eviction, unchanged.
const AT_EVICTION: &str = ", kv_offloading_ahead: false";

/// 2 MiB blocks at `gb_s`, in seconds.
fn blocks_s(n: u32, gb_s: f64) -> f64 {
    f64::from(n) * 2_097_152.0 / (gb_s * 1e9)
}

#[test]
fn a_prefix_evicted_to_the_host_tier_is_loaded_back_and_its_copies_cost_time() {
    // Without the tier A's second run finds 2 blocks (32 tokens): B's 38 blocks evicted
    // the rest of A's prefix (see below).
    let off = a_b_a("");
    assert_eq!(off.host_kv, None);
    assert_eq!(off.records[2].cached_prompt_tokens, 32);
    // With 64 host blocks. A holds 20 full blocks (its one output needs no block). B's
    // 38 (600 tokens): the 20 never used and 18 of A's 20 cached ones, evicted last freed
    // first (A frees its table back to front): A's blocks 19..2 are copied out, 0 and 1
    // stay. A's second run (320 tokens, the last recomputed: 19 blocks to find) matches 2
    // blocks on the device and the next 17 in the host tier (272 tokens), loaded back;
    // its 18 fresh blocks are B's partial one and 17 of B's 37 cached full blocks, copied
    // out too.
    let on = a_b_a(&format!(", num_host_blocks: 64{AT_EVICTION}"));
    assert_eq!(on.records[2].cached_prompt_tokens, 304);
    let h = on.host_kv.clone().unwrap();
    assert_eq!(
        (
            h.host_blocks,
            h.offloaded_blocks,
            h.loaded_blocks,
            h.host_hit_tokens
        ),
        (64, 18 + 17, 17, 272)
    );
    // Llama-3-8B's KV: 2 (K, V) * 32 layers * 8 KV heads * 128 dims * 2 bytes = 131,072
    // bytes a token, 2 MiB a 16-token block; 52 copies at 50 GB/s.
    let expect = 52.0 * 2_097_152.0 / 50e9;
    assert!((h.copy_s - expect).abs() < 1e-9, "{} vs {expect}", h.copy_s);
    assert_eq!(on.counters.prefix_hits, 304);
    // One rate, both ways (no `host_load_bandwidth_gb_s`): 35 blocks out, 17 back.
    assert_eq!((h.bandwidth_gb_s, h.load_bandwidth_gb_s), (50.0, 50.0));
    let (out, back) = (35.0 * 2_097_152.0 / 50e9, 17.0 * 2_097_152.0 / 50e9);
    assert!((h.offload_copy_s - out).abs() < 1e-12, "{h:?}");
    assert!((h.load_copy_s - back).abs() < 1e-12, "{h:?}");
    assert_eq!(
        (h.stored_ahead_blocks, h.store_copy_s, h.store_stall_s),
        (0, 0.0, 0.0)
    );
    // One step each; B's and A's second hold up their 18 and 17 + 17 copies.
    let finish: Vec<_> = on.records.iter().map(|r| r.finish_s).collect();
    assert_eq!(finish, [Some(0.001), Some(1.001755), Some(2.002426)]);
}

#[test]
fn in_a_b_a_stores_ahead_copy_only_the_blocks_no_step_evicts() {
    // With stores ahead (the default) the same run copies the same blocks at eviction, in
    // the same time, and stores the rest beside the steps. A block is queued once it is
    // registered in the prefix cache (in order, when its step's outputs are applied) and
    // stored by the next plan. A's 20 blocks are registered after its step; B's plan evicts
    // 18 of them (blocks 19..2, offloaded as before), then stores the 2 left (blocks 0 and
    // 1, which A's second run then matches on the device). B's 37 full blocks (its partial
    // one is never registered) are registered after its step; A's second plan evicts 17 of
    // them with the partial one for its 18 fresh blocks (17 offloads, 17 loads, as before),
    // then stores the 20 left. 35 + 2 + 20 blocks copied, 22 of them ahead, on the copy
    // engine: 2 and 20 * 41.94 = 838.9 us, each within its 1 ms step, so nothing waits.
    let ahead = a_b_a(", num_host_blocks: 64");
    let at_eviction = a_b_a(&format!(", num_host_blocks: 64{AT_EVICTION}"));
    let (h, e) = (ahead.host_kv.clone().unwrap(), at_eviction.host_kv.unwrap());
    assert_eq!(
        (h.offloaded_blocks, h.stored_ahead_blocks),
        (35 + 2 + 20, 2 + 20)
    );
    assert_eq!(e.offloaded_blocks, 35);
    assert_eq!((h.loaded_blocks, h.host_hit_tokens), (17, 272));
    assert_eq!((h.copy_s, h.offload_copy_s), (e.copy_s, e.offload_copy_s));
    assert!((h.store_copy_s - blocks_s(22, 50.0)).abs() < 1e-12, "{h:?}");
    assert_eq!(h.store_stall_s, 0.0);
    assert_eq!(ahead.records, at_eviction.records);
}

#[test]
fn blocks_stored_ahead_are_not_copied_at_their_eviction() {
    for async_scheduling in [false, true] {
        let ahead = a_c_b_c_a(", num_host_blocks: 64", async_scheduling);
        let at_eviction = a_c_b_c_a(
            &format!(", num_host_blocks: 64{AT_EVICTION}"),
            async_scheduling,
        );
        let (h, e) = (ahead.host_kv.clone().unwrap(), at_eviction.host_kv.unwrap());
        // At eviction: B's step, the second short request's and A's second evict 39 cached
        // blocks between them, each copied in the time of the step that evicts it.
        assert_eq!((e.offloaded_blocks, e.loaded_blocks), (39, 19));
        assert!(
            (e.offload_copy_s - blocks_s(39, 50.0)).abs() < 1e-12,
            "{e:?}"
        );
        // Ahead: every block is stored once computed, before any step evicts it: A's 20,
        // each short prompt's 1 and B's 37 full ones, 59 in all, so no eviction copies
        // anything; the same prefixes are found and loaded back.
        assert_eq!((h.offloaded_blocks, h.stored_ahead_blocks), (59, 59));
        assert_eq!((h.loaded_blocks, h.host_hit_tokens), (19, 304));
        for (a, b) in ahead.records.iter().zip(&at_eviction.records) {
            assert!(
                a.cached_prompt_tokens >= b.cached_prompt_tokens,
                "{a:?} {b:?}"
            );
        }
        // B's step copies nothing: it ends 1 ms after it starts (1.797 ms at eviction).
        assert_eq!(
            ahead.records[2].e2e_ms,
            Some(1.0),
            "async {async_scheduling}"
        );
        assert_eq!(at_eviction.records[2].e2e_ms, Some(1.797));
    }
    // By hand, in order: blocks are registered when their step's outputs are applied, and
    // the next plan that runs a step stores them. The first short request's prefill plan
    // stores A's 20 and its first decode plan its own block; B's step stores nothing (its
    // plan came before its blocks were computed); the second short request's prefill plan
    // stores 32 + 2 * 1 (the block it allocates) of B's 37: 34 blocks, 1,426.06 us beside
    // its 1 ms step, so its next step waits 426 us; that one stores B's last 3 and its own
    // block. All 59 on the copy engine, none in a step: the second short request takes
    // 4.426 ms (4.042 at eviction: its prefill evicted a block). Planned ahead, a step's
    // blocks are registered at its launch, and the plan made while it is in flight stores
    // them unless it runs no step (A's last step, B's): those stay queued for the next plan
    // that runs one, the same short requests' plans as in order, so the same figures.
    for async_scheduling in [false, true] {
        let ahead = a_c_b_c_a(", num_host_blocks: 64", async_scheduling);
        let h = ahead.host_kv.clone().unwrap();
        assert_eq!((h.offload_copy_s, h.copy_s), (0.0, h.load_copy_s), "{h:?}");
        assert!((h.store_copy_s - blocks_s(59, 50.0)).abs() < 1e-12, "{h:?}");
        assert!((h.store_stall_s - 426e-6).abs() < 1e-12, "{h:?}");
        let e2e: Vec<_> = ahead.records.iter().map(|r| r.e2e_ms).collect();
        assert_eq!(
            ahead.records[3].e2e_ms,
            Some(4.426),
            "{async_scheduling} {e2e:?}"
        );
        assert_eq!(
            ahead.records[1].e2e_ms,
            Some(4.0),
            "{async_scheduling} {e2e:?}"
        );
    }
}

#[test]
fn stores_that_outlast_a_step_delay_the_next_one() {
    // A, then a short request decoding 4 tokens, at 0.1 GB/s: a block takes 20,971.52 us.
    // At eviction nothing is evicted or copied: the short request takes its 4 1 ms steps.
    let rs = [request(0.0, 1..321, 1), request(0.5, 2000..2016, 4)];
    let slow = ", num_host_blocks: 64, host_bandwidth_gb_s: 0.1";
    for async_scheduling in [false, true] {
        let at_eviction = run(&format!("{slow}{AT_EVICTION}"), &rs, async_scheduling);
        let e = at_eviction.host_kv.unwrap();
        assert_eq!(
            (e.offloaded_blocks, e.store_stall_s, e.copy_s),
            (0, 0.0, 0.0)
        );
        assert_eq!(at_eviction.records[1].e2e_ms, Some(4.0));
    }
    // In order: A's 20 blocks, registered after its step, are stored by the short request's
    // prefill plan: 419,430 us from its step's start (500,000), so its next step, ready at
    // 501,000, starts at 919,430 (a 418,430 us stall). That plan stores the short prompt's
    // block, registered after the prefill: 20,972 us, to 940,402, so the step after it,
    // ready at 920,430, waits 19,972 us more. 438,402 us of stalls; the request ends at
    // 942,402 us, 442.402 ms after its arrival. Planned ahead: A's blocks are registered at
    // its step's launch, but the plan made while it is in flight runs no step (A ends with
    // it) and leaves them queued: the short request's prefill plan stores them, as in order.
    for async_scheduling in [false, true] {
        let ahead = run(slow, &rs, async_scheduling);
        let h = ahead.host_kv.clone().unwrap();
        assert_eq!((h.offloaded_blocks, h.stored_ahead_blocks), (21, 21));
        assert!((h.store_copy_s - blocks_s(21, 0.1)).abs() < 1e-12, "{h:?}");
        assert!((h.store_stall_s - 0.438402).abs() < 1e-12, "{h:?}");
        assert_eq!(h.copy_s, 0.0);
        let c = &ahead.records[1];
        assert_eq!(
            (c.first_token_s, c.generated),
            (Some(0.501), 4),
            "{async_scheduling}"
        );
        assert_eq!(
            (c.e2e_ms, c.finish_s),
            (Some(4.0 + 418.43 + 19.972), Some(0.942402)),
            "{async_scheduling}"
        );
    }
}

#[test]
fn host_tier_copies_are_timed_at_each_directions_rate() {
    // The same run with loads at 20 GB/s and offloads at 40: 35 blocks of 2 MiB out,
    // 73,400,320 bytes / 40e9 = 1.835008 ms; 17 back, 35,651,584 / 20e9 = 1.7825792 ms.
    let on = a_b_a(&format!(
        ", num_host_blocks: 64, host_bandwidth_gb_s: 40, host_load_bandwidth_gb_s: 20{AT_EVICTION}"
    ));
    let h = on.host_kv.clone().unwrap();
    assert_eq!((h.offloaded_blocks, h.loaded_blocks), (35, 17));
    assert_eq!((h.bandwidth_gb_s, h.load_bandwidth_gb_s), (40.0, 20.0));
    assert!((h.offload_copy_s - 1.835008e-3).abs() < 1e-12, "{h:?}");
    assert!((h.load_copy_s - 1.7825792e-3).abs() < 1e-12, "{h:?}");
    assert!((h.copy_s - 3.6175872e-3).abs() < 1e-12, "{h:?}");
    // A step's cost: 2 MiB at 40 GB/s is 52.4288 us a block out, at 20 GB/s 104.8576 us
    // back; 3 out and 2 back, 157.2864 + 209.7152 = 367.0016 us.
    let yaml = "policies: [{name: fcfs}]\n\
                cache: {num_gpu_blocks: 40, num_host_blocks: 8, host_bandwidth_gb_s: 40, \
                host_load_bandwidth_gb_s: 20}\nworkload: {trace: t.csv, format: azure}\n";
    let sim = Simulation::new(&spec(yaml)).unwrap();
    let c = sim.host_copies_us(3, 2);
    assert!((c.offload - 157.2864).abs() < 1e-9, "{c:?}");
    assert!((c.load - 209.7152).abs() < 1e-9, "{c:?}");
    assert!((c.total - 367.0016).abs() < 1e-9, "{c:?}");
    // Without a load rate both directions take the offload rate: 5 blocks at 40 GB/s,
    // computed as one product, bit for bit as before the rates were split.
    let yaml = yaml.replace(", host_load_bandwidth_gb_s: 20", "");
    let sim = Simulation::new(&spec(&yaml)).unwrap();
    assert_eq!(sim.host_load_us_per_block, sim.host_offload_us_per_block);
    let c = sim.host_copies_us(3, 2);
    assert_eq!(c.total, 5.0 * sim.host_offload_us_per_block);
    assert!((c.total - 262.144).abs() < 1e-9, "{c:?}");
    assert!((c.load - 104.8576).abs() < 1e-9, "{c:?}");
}

#[test]
fn kv_offloading_size_is_converted_with_the_models_kv_bytes_per_block() {
    // 1 GiB of 2 MiB blocks (see above): 512.
    let s = spec(
        "policies: [{name: fcfs}]\ncache: {kv_offloading_size: 1}\n\
         workload: {trace: t.csv, format: azure}\n",
    );
    let sim = Simulation::new(&s).unwrap();
    assert_eq!(sim.scheduler.num_host_blocks, 512);
    let both = "policies: [{name: fcfs}]\ncache: {kv_offloading_size: 1, num_host_blocks: 4}\n\
                workload: {trace: t.csv, format: azure}\n";
    let err = SimulationSpec::from_yaml_str(both, Path::new("t.yaml")).unwrap_err();
    assert!(
        err.to_string().contains("both size the host KV tier"),
        "{err}"
    );
}
