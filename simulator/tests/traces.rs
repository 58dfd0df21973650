//! The loaders on the published sample traces in ../shared/traces. Expected
//! figures come from that folder's README (computed by its authors from the
//! original files), not from our loaders. CI always has ../shared: a missing
//! file fails the test.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use switchyard_simulator::trace::{
    load_sharegpt, load_trace, mean_lengths, ArrivalProcess, LoadOptions, TraceFormat,
    MOONCAKE_BLOCK_TOKENS,
};

fn shared_trace(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces")
        .join(name);
    assert!(
        path.is_file(),
        "sample trace {} is missing: these tests need the shared/ folder beside the repository",
        path.display()
    );
    path
}

#[test]
fn azure_code_trace_matches_its_readme() {
    let path = shared_trace("AzureLLMInferenceTrace_code.csv");
    let rs = load_trace(&path, TraceFormat::Azure, &LoadOptions::default()).unwrap();
    assert_eq!(rs.len(), 8819);
    let (p, o) = mean_lengths(&rs);
    assert!((p - 2048.0).abs() < 0.5, "mean prompt {p}");
    assert!((o - 28.0).abs() < 0.5, "mean output {o}");
    let mut lens: Vec<usize> = rs.iter().map(|r| r.prompt.len()).collect();
    lens.sort_unstable();
    assert_eq!(lens[lens.len() / 2], 1469, "median prompt");
    // 18:17:03.9799600 to 19:14:19.9280160 is 57 min 15.948056 s.
    assert_eq!(rs[0].arrival_s, 0.0);
    assert!(
        (rs[8818].arrival_s - 3435.948056).abs() < 1e-5,
        "{}",
        rs[8818].arrival_s
    );
    assert!(rs.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s));
    // Unique prompts: no two requests share a first block.
    let firsts: HashSet<&[u32]> = rs
        .iter()
        .map(|r| &r.prompt[..16.min(r.prompt.len())])
        .collect();
    assert_eq!(firsts.len(), rs.len());
}

#[test]
fn mooncake_trace_keeps_its_block_reuse() {
    let path = shared_trace("synthetic_trace.jsonl");
    let rs = load_trace(&path, TraceFormat::Mooncake, &LoadOptions::default()).unwrap();
    assert_eq!(rs.len(), 3993);
    let (p, o) = mean_lengths(&rs);
    assert!(
        (p - 15_325.0).abs() < 1.0 && (o - 149.0).abs() < 0.5,
        "{p} {o}"
    );
    // README: 64% of blocks repeat. Count 512-token blocks whose content was seen before.
    let mut seen: HashSet<&[u32]> = HashSet::new();
    let (mut total, mut repeats) = (0usize, 0usize);
    for r in &rs {
        for block in r.prompt.chunks(MOONCAKE_BLOCK_TOKENS) {
            total += 1;
            repeats += usize::from(!seen.insert(block));
        }
    }
    let share = repeats as f64 / total as f64;
    assert!((share - 0.64).abs() < 0.01, "repeated block share {share}");
    assert!(rs.last().unwrap().arrival_s > 1000.0, "about 17 minutes");
}

#[test]
fn sharegpt_lengths_match_their_readme() {
    let path = shared_trace("sharegpt_8k_filtered_stats_llama2_tokenizer.csv");
    let file = std::io::BufReader::new(std::fs::File::open(&path).unwrap());
    let process = ArrivalProcess::Poisson { rate: 10.0 };
    let rs = load_sharegpt(file, &path, &LoadOptions::default(), &process, 1).unwrap();
    assert_eq!(rs.len(), 30_731);
    let (p, o) = mean_lengths(&rs);
    assert!(
        (p - 2340.0).abs() < 0.5 && (o - 439.0).abs() < 0.5,
        "{p} {o}"
    );
    let rate = (rs.len() - 1) as f64 / rs.last().unwrap().arrival_s;
    assert!((rate - 10.0).abs() < 0.2, "rate {rate}");
}

#[test]
fn limit_option_on_a_real_trace() {
    let path = shared_trace("synthetic_trace.jsonl");
    let options = LoadOptions {
        limit: Some(10),
        ..Default::default()
    };
    assert_eq!(
        load_trace(&path, TraceFormat::Mooncake, &options)
            .unwrap()
            .len(),
        10
    );
}
