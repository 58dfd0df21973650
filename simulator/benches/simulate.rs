//! Whole-trace simulation speed: the Azure code trace (8,819 requests) under one
//! policy, Llama-3-8B on H200, arrivals as recorded. Target: under 1 s
//! (at least 10,000 simulated requests per wall-second). Loading is done once,
//! outside the measurement.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;
use std::path::Path;
use switchyard_simulator::spec::PolicySpec;
use switchyard_simulator::{Simulation, SimulationSpec};

fn azure_whole_trace(c: &mut Criterion) {
    let trace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces/AzureLLMInferenceTrace_code.csv");
    let yaml = format!(
        "policies: [{{name: fcfs}}]\nworkload: {{trace: {}, format: azure}}\n",
        trace.display()
    );
    let spec = match SimulationSpec::from_yaml_str(&yaml, Path::new("<bench>")) {
        Ok(s) => s,
        Err(e) => panic!("bench spec: {e}"),
    };
    let sim = match Simulation::new(&spec) {
        Ok(s) => s,
        Err(e) => panic!("simulation: {e}"),
    };
    let workload = match sim.load_workload() {
        Ok(w) => w,
        Err(e) => panic!("{e}"),
    };
    let mut group = c.benchmark_group("simulate");
    group.sample_size(10);
    group.throughput(Throughput::Elements(workload.requests.len() as u64));
    for policy in ["fcfs", "slo-aware"] {
        let p = PolicySpec::named(policy);
        group.bench_function(format!("azure_code_8819_{policy}"), |b| {
            b.iter(|| sim.run_policy(black_box(&p), black_box(&workload.requests), false))
        });
    }
    group.finish();
}

criterion_group!(benches, azure_whole_trace);
criterion_main!(benches);
