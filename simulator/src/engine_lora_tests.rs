//! The LoRA adapters' host memory in the loop (`scheduler.lora_memory`): where a request's
//! wait for its adapter falls, and what the run reports. Step costs are 1 ms each and the
//! front end 0.5 ms, so every expected time below is counted by hand.

use super::*;
use crate::cost::Calibration;
use crate::lora_memory::MemoryConfig;
use std::path::Path;
use std::sync::Arc;

const SPEC: &str = "
policies: [{name: fcfs}]
scheduler: {max_num_seqs: 4, max_model_len: 100}
cache: {num_gpu_blocks: 64}
workload: {trace: unused.csv, format: azure}
";

/// Steps of 1 ms, a front end of 0.5 ms, adapters in memory as `memory` says.
fn sim(memory: Option<MemoryConfig>) -> Simulation {
    sim_of(SPEC, memory)
}

/// [`sim`] of the spec `yaml`.
fn sim_of(yaml: &str, memory: Option<MemoryConfig>) -> Simulation {
    let spec = SimulationSpec::from_yaml_str(yaml, Path::new("t.yaml")).unwrap();
    let mut sim = Simulation::new(&spec).unwrap();
    sim.cost = CostModel::Calibrated(Calibration {
        intercept_s: 1e-3,
        ..Default::default()
    });
    sim.front_end = FrontEnd {
        fixed_us: 500.0,
        per_token_us: 0.0,
    };
    sim.lora_memory = memory.map(|m| (m, "the spec".to_string()));
    sim
}

/// Memory of `max` adapters, `pinned` pinned, `load_ms` a load, in a registry of the
/// server's default size.
fn memory(max: usize, pinned: &[u32], load_ms: u64) -> Option<MemoryConfig> {
    registry(
        max,
        pinned,
        load_ms,
        crate::lora_registry::default_max_adapters(),
    )
}

/// [`memory`] in a registry of `max_adapters`.
fn registry(max: usize, pinned: &[u32], load_ms: u64, max_adapters: usize) -> Option<MemoryConfig> {
    Some(MemoryConfig {
        max_cpu_loras: max,
        pinned: pinned.iter().copied().collect(),
        registered: Vec::new(),
        load_us: load_ms * 1000,
        max_adapters,
    })
}

/// A one-token request of `adapter` arriving at `at_ms`.
fn req(at_ms: f64, adapter: Option<u32>) -> TraceRequest {
    TraceRequest {
        arrival_s: at_ms / 1e3,
        prompt: Arc::from(vec![1u32; 8]),
        output_len: 1,
        tenant: String::new(),
        tier: String::new(),
        priority: None,
        adapter,
        client: String::new(),
        think_s: None,
    }
}

fn run(sim: &Simulation, rs: &[TraceRequest]) -> PolicyRun {
    sim.run_policy(&PolicySpec::named("fcfs"), rs, false)
        .unwrap()
}

fn ttfts(run: &PolicyRun) -> Vec<f64> {
    run.records.iter().map(|r| r.ttft_ms.unwrap()).collect()
}

#[test]
fn a_request_waits_for_its_adapters_load_after_the_front_end() {
    // Off: 0.5 ms front end + one 1 ms step.
    assert_eq!(ttfts(&run(&sim(None), &[req(0.0, Some(1))])), vec![1.5]);
    // Not in memory: the load (10 ms) starts as the request leaves the front end.
    let r = run(&sim(memory(1, &[], 10)), &[req(0.0, Some(1))]);
    assert_eq!(ttfts(&r), vec![11.5]);
    assert_eq!(r.records[0].adapter_wait_ms, Some(10.0));
    assert_eq!(r.records[0].adapter, Some(1));
    let m = r.lora_memory.unwrap();
    assert_eq!(
        (m.loads, m.evictions, m.waited, m.adapter_requests),
        (1, 0, 1, 1)
    );
    // Pinned: in memory from the start, no wait.
    let r = run(&sim(memory(1, &[1], 10)), &[req(0.0, Some(1))]);
    assert_eq!(ttfts(&r), vec![1.5]);
    assert_eq!(r.records[0].adapter_wait_ms, Some(0.0));
    assert_eq!(r.lora_memory.unwrap().loads, 0);
    // A request without an adapter never waits.
    let r = run(&sim(memory(1, &[], 10)), &[req(0.0, None)]);
    assert_eq!(ttfts(&r), vec![1.5]);
    assert_eq!(r.records[0].adapter_wait_ms, None);
}

#[test]
fn a_second_request_for_an_adapter_being_loaded_waits_for_the_same_load() {
    let r = run(
        &sim(memory(4, &[], 10)),
        &[req(0.0, Some(1)), req(2.0, Some(1))],
    );
    // Both get the adapter at 10.5 ms and run in the step 10.5..11.5.
    assert_eq!(ttfts(&r), vec![11.5, 9.5]);
    let waits: Vec<_> = r.records.iter().map(|x| x.adapter_wait_ms).collect();
    assert_eq!(waits, vec![Some(10.0), Some(8.0)]);
    assert_eq!(r.lora_memory.unwrap().loads, 1);
}

#[test]
fn loads_of_different_adapters_are_serialized() {
    let r = run(
        &sim(memory(4, &[], 10)),
        &[req(0.0, Some(1)), req(0.0, Some(2)), req(0.0, Some(3))],
    );
    // Loads end at 10.5, 20.5 and 30.5 ms; each request runs in the step that follows.
    assert_eq!(ttfts(&r), vec![11.5, 21.5, 31.5]);
    assert_eq!(r.lora_memory.unwrap().loads, 3);
}

#[test]
fn an_adapter_evicted_for_another_is_loaded_again() {
    let rs = [req(0.0, Some(1)), req(20.0, Some(2)), req(40.0, Some(1))];
    let r = run(&sim(memory(1, &[], 10)), &rs);
    assert_eq!(ttfts(&r), vec![11.5, 11.5, 11.5]);
    let m = r.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions, m.waited), (3, 2, 3));
    // Room for both: the third finds adapter 1 in memory.
    let r = run(&sim(memory(2, &[], 10)), &rs);
    assert_eq!(ttfts(&r), vec![11.5, 11.5, 1.5]);
    let m = r.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions, m.waited), (2, 0, 2));
    assert_eq!(m.unpinned_ttft_ms.p50, Some(11.5));
    // Adapter 1 pinned: it stays while 2 comes and goes.
    let r = run(&sim(memory(1, &[1], 10)), &rs);
    assert_eq!(ttfts(&r), vec![1.5, 11.5, 1.5]);
    let m = r.lora_memory.unwrap();
    // Adapter 2 stays while its request holds it, and goes when the third request finds
    // memory over its limit (the server's next eviction).
    assert_eq!((m.loads, m.evictions), (1, 1));
    assert_eq!(m.pinned_ttft_ms.count, 2);
}

#[test]
fn an_adapter_in_use_stays_in_memory_beyond_the_limit() {
    // Two long requests hold adapters 1 and 2 at once, with room for one: neither is
    // evicted while they run, so the third (adapter 1, during them) finds it in memory.
    let long = |at_ms: f64, a: u32| TraceRequest {
        output_len: 40,
        ..req(at_ms, Some(a))
    };
    let rs = [long(0.0, 1), long(11.0, 2), req(25.0, Some(1))];
    let r = run(&sim(memory(1, &[], 10)), &rs);
    assert_eq!(r.records[2].adapter_wait_ms, Some(0.0));
    let m = r.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions), (2, 0));
}

#[test]
fn without_lora_memory_a_run_is_as_before_and_an_ample_one_changes_no_time() {
    let rs: Vec<TraceRequest> = (0..40)
        .map(|i| TraceRequest {
            output_len: 1 + i % 7,
            ..req(f64::from(i) * 0.7, (i % 3 != 0).then_some(i % 5))
        })
        .collect();
    let off = run(&sim(None), &rs);
    assert!(off.lora_memory.is_none());
    assert!(off
        .records
        .iter()
        .all(|r| r.adapter.is_none() && r.adapter_wait_ms.is_none()));
    // Every adapter pinned and loads free: the same times, request by request.
    let on = run(&sim(memory(8, &[0, 1, 2, 3, 4], 0)), &rs);
    let strip = |run: &PolicyRun| -> Vec<RequestRecord> {
        run.records
            .iter()
            .map(|r| RequestRecord {
                adapter: None,
                adapter_wait_ms: None,
                ..r.clone()
            })
            .collect()
    };
    assert_eq!(strip(&on), strip(&off));
    assert_eq!(on.lora_memory.unwrap().loads, 0);
}

#[test]
fn a_spec_with_lora_memory_and_drawn_adapters_runs_them() {
    let dir = crate::scratch::ScratchDir::new("simlora");
    let trace = dir.join("t.csv");
    let mut csv = String::from("TIMESTAMP,ContextTokens,GeneratedTokens\n");
    for i in 0..50 {
        csv.push_str(&format!("2023-11-16 18:15:{:02}.000000,32,4\n", i));
    }
    std::fs::write(&trace, csv).unwrap();
    let yaml = format!(
        "policies: [{{name: fcfs}}]
scheduler: {{lora_memory: {{max_cpu_loras: 2, pinned: [1], load_ms: 50}}}}
workload: {{trace: {}, format: azure, adapters: {{count: 20, s: 1.1}}}}
",
        trace.display()
    );
    let spec = SimulationSpec::from_yaml_str(&yaml, Path::new("t.yaml")).unwrap();
    let (cmp, runs) = crate::simulate(&spec, false).unwrap();
    let m = cmp.policies[0]
        .lora_memory
        .as_ref()
        .expect("a lora_memory summary");
    assert_eq!((m.max_cpu_loras, m.pinned, m.load_ms), (2, 1, 50.0));
    assert_eq!(m.adapter_requests, 50);
    assert!(m.loads > 0 && m.waited > 0, "{m:?}");
    assert!(runs[0].records.iter().all(|r| r.adapter.is_some()));
    assert!(cmp
        .to_text()
        .contains("fcfs: LoRA memory (max_cpu_loras 2, 1 pinned, 50 ms a load from the spec)"));
    assert_eq!(m.load_ms_from, "the spec");
}

#[test]
fn the_load_time_comes_from_the_spec_else_the_calibration() {
    let dir = crate::scratch::ScratchDir::new("simlora-cal");
    let cal = dir.join("cal.yaml");
    let base = "intercept_s: 0.001\nnum_gpu_blocks: 500\nblock_size: 16\n";
    std::fs::write(&cal, format!("{base}lora_load_ms: 37.5\n")).unwrap();
    let yaml = |memory: &str| {
        format!(
            "policies: [{{name: fcfs}}]
calibration: {}
scheduler: {{lora_memory: {memory}}}
workload: {{trace: unused.csv, format: azure}}
",
            cal.display()
        )
    };
    let got = |memory: &str| {
        let spec = SimulationSpec::from_yaml_str(&yaml(memory), Path::new("t.yaml")).unwrap();
        Simulation::new(&spec).map(|s| s.lora_memory.unwrap())
    };
    let (m, from) = got("{max_cpu_loras: 2}").unwrap();
    assert_eq!(
        (m.load_us, from),
        (37_500, format!("calibration {}", cal.display()))
    );
    let (m, from) = got("{load_ms: 5}").unwrap();
    assert_eq!((m.load_us, from.as_str()), (5_000, "the spec"));
    // Neither: refused by name.
    std::fs::write(&cal, base).unwrap();
    let err = got("{max_cpu_loras: 2}").unwrap_err().to_string();
    assert!(
        err.contains("scheduler.lora_memory.load_ms: set the time"),
        "{err}"
    );
    // Out of bounds in the file: refused by name.
    std::fs::write(&cal, format!("{base}lora_load_ms: -1\n")).unwrap();
    let err = got("{load_ms: 5}").unwrap_err().to_string();
    assert!(err.contains("lora_load_ms -1 outside"), "{err}");
}

#[test]
fn a_request_refused_as_too_long_resolves_its_adapter_first_and_gives_it_back() {
    // The server resolves the adapter before its engine refuses the prompt: the load happens,
    // the refusal comes once it is done, and the adapter is free to be evicted after.
    let too_long = TraceRequest {
        prompt: Arc::from(vec![1u32; 200]),
        ..req(0.0, Some(1))
    };
    let r = run(&sim(memory(1, &[], 10)), &[too_long, req(20.0, Some(2))]);
    assert_eq!(r.records[0].outcome, "rejected");
    assert_eq!(r.records[0].adapter_wait_ms, Some(10.0));
    assert_eq!(r.records[1].ttft_ms, Some(11.5));
    let m = r.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions), (2, 1));
}

#[test]
fn a_tenant_s_share_refuses_its_loads_while_full_of_adapters_in_use_and_drops_its_own() {
    // Tenant a of gold (a share of `share`, two requests in flight at most): a long request
    // holds adapter 1 (loaded 0.5..10.5 ms, running until ~50 ms); at 20 ms a asks for
    // adapter 2 and b for 2 too, and a again for 1 at 21 ms; at 60 ms, 1 released, a asks
    // for 3.
    let spec =
        |share: &str| format!("{SPEC}tiers: {{gold: {{max_pending_per_tenant: 2{share}}}}}\n");
    let of = |tenant: &str, r: TraceRequest| TraceRequest {
        tenant: tenant.into(),
        tier: "gold".into(),
        ..r
    };
    let rs = [
        of(
            "a",
            TraceRequest {
                output_len: 40,
                ..req(0.0, Some(1))
            },
        ),
        of("a", req(20.0, Some(2))),
        of("b", req(20.0, Some(2))),
        of("a", req(21.0, Some(1))),
        of("a", req(60.0, Some(3))),
    ];
    let outcomes =
        |r: &PolicyRun| -> Vec<String> { r.records.iter().map(|x| x.outcome.clone()).collect() };
    let waits = |r: &PolicyRun| -> Vec<Option<f64>> {
        r.records.iter().map(|x| x.adapter_wait_ms).collect()
    };
    // A share of 1: a's request for 2 is refused as it asks (20.5 ms), reading nothing, and
    // gives back its seat (a's request at 21 ms is admitted, served from memory); b loads
    // 2 itself; a's load of 3 drops its own 1 (unused by then), not b's 2.
    let r = run(
        &sim_of(&spec(", max_cpu_loras_per_tenant: 1"), memory(8, &[], 10)),
        &rs,
    );
    assert_eq!(
        outcomes(&r),
        ["length", "tenant_busy", "length", "length", "length"]
    );
    assert_eq!(
        waits(&r),
        [Some(10.0), None, Some(10.0), Some(0.0), Some(10.0)]
    );
    assert_eq!(r.records[1].ttft_ms, None);
    let m = r.lora_memory.clone().unwrap();
    assert_eq!(
        (m.loads, m.evictions, m.share_evictions, m.share_refusals),
        (3, 1, 1, 1)
    );
    assert_eq!(m.adapter_requests, 4);
    // Without a share: a loads 2, which b's request, queued behind, finds in memory; a's
    // request at 21 ms finds both of a's seats held (by the long one and the one waiting
    // for 2) and is refused at arrival.
    let r = run(&sim_of(&spec(""), memory(8, &[], 10)), &rs);
    assert_eq!(
        outcomes(&r),
        ["length", "length", "length", "tenant_busy", "length"]
    );
    assert_eq!(
        waits(&r),
        [Some(10.0), Some(10.0), Some(10.0), None, Some(10.0)]
    );
    let m = r.lora_memory.unwrap();
    assert_eq!(
        (m.loads, m.evictions, m.share_evictions, m.share_refusals),
        (3, 0, 0, 0)
    );
}

#[test]
fn a_spec_s_tier_shares_are_modelled_and_summarized() {
    // The requests of the test above (the last one later), as a JSONL trace under a spec
    // whose gold tier gives each tenant a share of 1: one refusal (tenant_busy, counted with the tier's), one
    // eviction in a's share, and no warning that shares are not modelled.
    let dir = crate::scratch::ScratchDir::new("simlora-share");
    let trace = dir.join("t.jsonl");
    let line = |at_s: f64, out: u32, tenant: &str, adapter: u32| {
        format!(
            "{{\"arrival_s\": {at_s}, \"prompt_len\": 8, \"output_len\": {out}, \
             \"tenant\": \"{tenant}\", \"tier\": \"gold\", \"adapter\": {adapter}}}\n"
        )
    };
    let lines = [
        line(0.0, 40, "a", 1),
        line(0.02, 1, "a", 2),
        line(0.02, 1, "b", 2),
        line(0.021, 1, "a", 1),
        // Long after the first ended, whatever the steps' cost.
        line(30.0, 1, "a", 3),
    ];
    std::fs::write(&trace, lines.concat()).unwrap();
    let yaml = format!(
        "policies: [{{name: fcfs}}]
tiers: {{gold: {{max_cpu_loras_per_tenant: 1}}}}
scheduler: {{lora_memory: {{max_cpu_loras: 8, load_ms: 10}}}}
workload: {{trace: {}, format: jsonl}}
",
        trace.display()
    );
    let spec = SimulationSpec::from_yaml_str(&yaml, Path::new("t.yaml")).unwrap();
    let (cmp, runs) = crate::simulate(&spec, false).unwrap();
    assert!(
        cmp.warnings
            .iter()
            .all(|w| !w.contains("max_cpu_loras_per_tenant")),
        "{:?}",
        cmp.warnings
    );
    let p = &cmp.policies[0];
    let m = p.lora_memory.as_ref().expect("a lora_memory summary");
    assert_eq!((m.loads, m.share_evictions, m.share_refusals), (3, 1, 1));
    assert_eq!(p.tenant_busy, 1);
    let gold = p.tiers.iter().find(|t| t.tier == "gold").unwrap();
    assert_eq!(gold.tenant_busy, 1);
    assert_eq!(runs[0].records[1].outcome, "tenant_busy");
    assert!(
        cmp.to_text().contains(
            "3 loads, 1 evictions (1 to make room in a tenant's share), 1 requests refused \
             by a tenant's full share"
        ),
        "{}",
        cmp.to_text()
    );
}

fn outcomes(r: &PolicyRun) -> Vec<&str> {
    r.records.iter().map(|x| x.outcome.as_str()).collect()
}

/// A request of `adapter` arriving at `at_ms` that generates 40 tokens (holding its adapter
/// some 40 ms).
fn long(at_ms: f64, adapter: u32) -> TraceRequest {
    TraceRequest {
        output_len: 40,
        ..req(at_ms, Some(adapter))
    }
}

#[test]
fn a_registry_smaller_than_memory_caps_memory_as_on_the_server() {
    // Adapters 1, 2, 3, then 1 again, 20 ms apart, each request done before the next.
    let rs = [
        req(0.0, Some(1)),
        req(20.0, Some(2)),
        req(40.0, Some(3)),
        req(60.0, Some(1)),
    ];
    // Room for 4 in memory and 64 in the registry: 1 is still in memory at 60.5 ms.
    let ample = run(&sim(registry(4, &[], 10, 64)), &rs);
    assert_eq!(ttfts(&ample), vec![11.5, 11.5, 11.5, 1.5]);
    let m = ample.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions, m.unregistrations), (3, 0, 0));
    // A registry of 2: 3's registration (load 40.5..50.5 ms) unregisters 1, the least
    // recently used, and drops it from memory; 1 is found and read again at 60.5 ms,
    // unregistering 2 (used at 30.5 ms, before 3 at 50.5).
    let capped = run(&sim(registry(4, &[], 10, 2)), &rs);
    assert_eq!(ttfts(&capped), vec![11.5, 11.5, 11.5, 11.5]);
    assert_eq!(outcomes(&capped), ["length"; 4]);
    let m = capped.lora_memory.clone().unwrap();
    assert_eq!(
        (m.loads, m.evictions, m.unregistrations, m.registry_refusals),
        (4, 2, 2, 0)
    );
    assert_eq!((m.max_cpu_loras, m.max_adapters), (4, 2));
    // As memory of 2 would have it (there 1 and 2 are evicted before 3's and 1's reads).
    let small = run(&sim(registry(2, &[], 10, 64)), &rs);
    assert_eq!(small.records, capped.records);
    let m = small.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions, m.unregistrations), (4, 2, 0));
}

#[test]
fn a_full_registry_of_adapters_in_use_refuses_their_requests_503() {
    // 1 (read 0.5..10.5 ms) and 2 (11.5..21.5 ms) held by long requests until about 50.5
    // and 61.5 ms; 3 asked for at 25.5 ms; 3 again at 200.5 ms, and 1 at 300.5 ms.
    let rs = [
        long(0.0, 1),
        long(11.0, 2),
        req(25.0, Some(3)),
        req(200.0, Some(3)),
        req(300.0, Some(1)),
    ];
    let r = run(&sim(registry(4, &[], 10, 2)), &rs);
    // Refused as its message is handled, nothing read; then 3 unregisters 1 (used at
    // 10.5 ms, before 2 at 21.5), and 1, found again, unregisters 2.
    assert_eq!(
        outcomes(&r),
        ["length", "length", "unavailable", "length", "length"]
    );
    let waits: Vec<_> = r.records.iter().map(|x| x.adapter_wait_ms).collect();
    assert_eq!(
        waits,
        [Some(10.0), Some(10.0), None, Some(10.0), Some(10.0)]
    );
    assert_eq!((r.records[2].ttft_ms, r.records[2].finish_s), (None, None));
    assert_eq!(r.records[3].ttft_ms, Some(11.5));
    assert_eq!(r.records[4].ttft_ms, Some(11.5));
    let m = r.lora_memory.clone().unwrap();
    assert_eq!(
        (
            m.loads,
            m.evictions,
            m.unregistrations,
            m.registry_refusals,
            m.adapter_requests
        ),
        (4, 2, 2, 1, 4)
    );
    let summary = crate::report::PolicySummary::new(
        "fcfs",
        &r.records,
        &mut r.itls_ms.clone(),
        r.counters.clone(),
    );
    assert_eq!(
        (summary.unavailable, summary.tenant_busy, summary.finished),
        (1, 0, 4)
    );
    // Pinned adapters take places in the registry and never go: with 1 pinned, 2 held
    // fills it; a request for the pinned 1 is served from memory all along.
    let rs = [long(0.0, 2), req(25.0, Some(3)), req(30.0, Some(1))];
    let r = run(&sim(registry(4, &[1], 10, 2)), &rs);
    assert_eq!(outcomes(&r), ["length", "unavailable", "length"]);
    assert_eq!(r.records[2].ttft_ms, Some(1.5));
    // Without the bound both are served.
    let r = run(&sim(registry(4, &[1], 10, 64)), &rs);
    assert_eq!(outcomes(&r), ["length"; 3]);
}

#[test]
fn a_registry_at_least_memory_s_size_changes_no_result() {
    // Adapters 1, 2, 3 in turn, twice, 20 ms apart, in memory of 2: every request reads its
    // adapter (the one read two requests before was evicted), whatever the registry.
    let rs: Vec<TraceRequest> = (0..6)
        .map(|i| req(20.0 * f64::from(i), Some(1 + i % 3)))
        .collect();
    let ample = run(&sim(registry(2, &[], 10, 4096)), &rs);
    assert_eq!(ttfts(&ample), vec![11.5; 6]);
    let m = ample.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions, m.unregistrations), (6, 4, 0));
    // A registry of 2 unregisters the adapter memory evicts, read again alike.
    let tight = run(&sim(registry(2, &[], 10, 2)), &rs);
    assert_eq!(tight.records, ample.records);
    let m = tight.lora_memory.unwrap();
    assert_eq!((m.loads, m.evictions, m.unregistrations), (6, 4, 4));
    // Overlapping requests of five adapters, two pinned: the same run, request by request,
    // with a registry of the five or more.
    let rs: Vec<TraceRequest> = (0..40)
        .map(|i| TraceRequest {
            output_len: 1 + i % 7,
            ..req(f64::from(i) * 0.7, (i % 3 != 0).then_some(i % 5))
        })
        .collect();
    let of = |max_adapters: usize| run(&sim(registry(3, &[0, 1], 10, max_adapters)), &rs);
    let ample = of(4096);
    let figures = |r: &PolicyRun| {
        let m = r.lora_memory.clone().unwrap();
        (m.loads, m.evictions, m.unregistrations, m.registry_refusals)
    };
    assert!(figures(&ample).0 > 0);
    for max_adapters in [5, 64] {
        let r = of(max_adapters);
        assert_eq!(r.records, ample.records, "max_adapters {max_adapters}");
        assert_eq!(figures(&r), figures(&ample), "max_adapters {max_adapters}");
    }
}

#[test]
fn a_spec_s_registry_is_modelled_summarized_and_warned_of() {
    // Two long requests hold adapters 1 and 2 (read 0..10 and 10..20 ms) for thousands of
    // steps, whatever their cost; a third, of tier gold, asks for 3 at 30 ms.
    let dir = crate::scratch::ScratchDir::new("simlora-registry");
    let trace = dir.join("t.jsonl");
    let line = |at_s: f64, out: u32, adapter: u32| {
        format!(
            "{{\"arrival_s\": {at_s}, \"prompt_len\": 8, \"output_len\": {out}, \
             \"tenant\": \"a\", \"tier\": \"gold\", \"adapter\": {adapter}}}\n"
        )
    };
    let lines = [line(0.0, 4000, 1), line(0.0, 4000, 2), line(0.03, 1, 3)];
    std::fs::write(&trace, lines.concat()).unwrap();
    let yaml = |registry: &str| {
        format!(
            "policies: [{{name: fcfs}}]
tiers: {{gold: {{}}}}
scheduler: {{lora_memory: {{max_cpu_loras: 4, load_ms: 10{registry}}}}}
workload: {{trace: {}, format: jsonl}}
",
            trace.display()
        )
    };
    let simulate = |registry: &str| {
        let spec = SimulationSpec::from_yaml_str(&yaml(registry), Path::new("t.yaml")).unwrap();
        crate::simulate(&spec, false).unwrap()
    };
    let (cmp, runs) = simulate(", max_adapters: 2");
    assert_eq!(
        outcomes(&runs[0]),
        ["length", "length", "unavailable"],
        "{}",
        cmp.to_text()
    );
    let p = &cmp.policies[0];
    assert_eq!(p.unavailable, 1);
    let gold = p.tiers.iter().find(|t| t.tier == "gold").unwrap();
    assert_eq!(gold.unavailable, 1);
    let m = p.lora_memory.as_ref().expect("a lora_memory summary");
    assert_eq!((m.max_adapters, m.registry_refusals, m.loads), (2, 1, 2));
    let text = cmp.to_text();
    for want in [
        "fcfs: 1 of 3 requests refused as they asked for their LoRA adapter, not registered, \
         the registry full (lora_memory.max_adapters) of adapters in use or configured (the server \
         answers them 503 unavailable): gold 1",
        "registry (max_adapters 2): 0 adapters unregistered to make room, 1 requests refused \
         by a full registry",
    ] {
        assert!(text.contains(want), "want {want}: {text}");
    }
    assert!(
        cmp.warnings
            .iter()
            .any(|w| w.starts_with("scheduler.lora_memory.max_adapters 2 is below max_cpu_loras 4")),
        "{:?}",
        cmp.warnings
    );
    // Left out: the server's default, 64; as with a larger one, all three are served, and
    // nothing but the figure itself differs.
    let (default, default_runs) = simulate("");
    let (large, large_runs) = simulate(", max_adapters: 4096");
    assert_eq!(outcomes(&default_runs[0]), ["length"; 3]);
    assert_eq!(default_runs[0].records, large_runs[0].records);
    let memory = |c: &crate::Comparison| c.policies[0].lora_memory.clone().unwrap();
    assert_eq!(
        (memory(&default).max_adapters, memory(&large).max_adapters),
        (64, 4096)
    );
    let mut large = large;
    large.policies[0].lora_memory.as_mut().unwrap().max_adapters = 64;
    assert_eq!(large, default);
    assert!(default.warnings.iter().all(|w| !w.contains("max_adapters")));
}

/// `lora_memory.registered`, the server's `lora.adapters` entries that are not pinned: from
/// the spec to the run and its summary. Two long requests ask for adapters 1 and 2, a third
/// for 3 at 30 ms, in a registry of 2 with memory for 4; 3 declared not at all, registered
/// or pinned.
#[test]
fn a_spec_s_registered_adapters_hold_places_from_the_start() {
    let dir = crate::scratch::ScratchDir::new("simlora-configured");
    let trace = dir.join("t.jsonl");
    let line = |at_s: f64, out: u32, adapter: u32| {
        format!(
            "{{\"arrival_s\": {at_s}, \"prompt_len\": 8, \"output_len\": {out}, \
             \"adapter\": {adapter}}}\n"
        )
    };
    let lines = [line(0.0, 4000, 1), line(0.0, 4000, 2), line(0.03, 1, 3)];
    std::fs::write(&trace, lines.concat()).unwrap();
    let simulate = |configured: &str| {
        let yaml = format!(
            "policies: [{{name: fcfs}}]
scheduler: {{lora_memory: {{max_cpu_loras: 4, load_ms: 10, max_adapters: 2{configured}}}}}
workload: {{trace: {}, format: jsonl}}
",
            trace.display()
        );
        let spec = SimulationSpec::from_yaml_str(&yaml, Path::new("t.yaml")).unwrap();
        crate::simulate(&spec, false).unwrap()
    };
    let figures = |cmp: &crate::Comparison| {
        let m = cmp.policies[0].lora_memory.clone().unwrap();
        (m.pinned, m.registered, m.loads, m.registry_refusals)
    };
    let wait_of_3 = |runs: &[PolicyRun]| runs[0].records[2].adapter_wait_ms;
    // Not declared: 1 and 2 are found and fill the registry, held; 3 is refused.
    let (cmp, runs) = simulate("");
    assert_eq!(outcomes(&runs[0]), ["length", "length", "unavailable"]);
    assert_eq!(figures(&cmp), (0, 0, 2, 1));
    // Registered: 3 holds a place from the start, in memory, so 2 finds the registry full of
    // it and 1, held, and is refused; 3 is served at once.
    let (cmp, runs) = simulate(", registered: [3]");
    assert_eq!(outcomes(&runs[0]), ["length", "unavailable", "length"]);
    assert_eq!(figures(&cmp), (0, 1, 1, 1));
    assert_eq!(wait_of_3(&runs), Some(0.0));
    assert!(cmp.to_text().contains(
        "fcfs: LoRA memory (max_cpu_loras 4, 0 pinned, 1 registered, 10 ms a load from the spec)"
    ));
    assert!(cmp
        .warnings
        .iter()
        .all(|w| !w.starts_with("scheduler.lora_memory.registered")));
    // Pinned: the same run here (memory has room), counted as pinned.
    let (pinned, pinned_runs) = simulate(", pinned: [3]");
    assert_eq!(pinned_runs[0].records, runs[0].records);
    assert_eq!(figures(&pinned), (1, 0, 1, 1));
    // An id no request names is warned of: it holds a place in the registry for nothing.
    let (cmp, runs) = simulate(", registered: [9]");
    assert_eq!(outcomes(&runs[0]), ["length", "unavailable", "unavailable"]);
    assert!(
        cmp.warnings.iter().any(|w| w.starts_with(
            "scheduler.lora_memory.registered: no request names adapter 9 "
        )),
        "{:?}",
        cmp.warnings
    );
}
