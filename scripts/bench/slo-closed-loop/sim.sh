#!/usr/bin/env bash
# Simulates the closed-loop CPU traces of PERFORMANCE.md's slo-aware sections (v0.47.0 and
# slo-aware's reserve) under `priority` and `slo-aware`, and the "premium stream that stops" case,
# then prints premium TTFT pooled over each group's traces.
#
#   scripts/bench/slo-closed-loop/sim.sh BIN OUT [MAX_NUM_BATCHED_TOKENS] [SLO_EXTRA]
#
# BIN: a switchyard binary; OUT: a new directory; MAX_NUM_BATCHED_TOKENS: 2048 unless given;
# SLO_EXTRA: more slo-aware params, e.g. ', reserve_window_ms: 0'.
set -euo pipefail
bin=$(realpath "$1"); out=$2; mnbt=${3:-2048}; extra=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
# The median front-end time per request each server run measured (us), as its spec used it.
declare -A fe=([t200-r1]=471 [t200-r2]=0 [t200-r3]=518 [t5000-r1]=832 [t5000-r2]=0 [t5000-r3]=0
               [syn1024-t200]=0)
for name in t200-r1 t200-r2 t200-r3 t5000-r1 t5000-r2 t5000-r3 syn1024-t200; do
  case $name in t5000-*) ttft=5000 ;; *) ttft=200 ;; esac
  cat > "$out/$name.yaml" <<YAML
model: smollm2-135m
calibration: $here/cal.yaml
policies:
  - { name: priority }
  - { name: slo-aware, params: { step_overhead_ms: 67.4, prefill_us_per_token: 1738 $extra } }
tiers:
  premium: { ttft_ms: $ttft, tpot_ms: 40, weight: 4, priority: 0 }
  batch: { weight: 1, preemptible: true, priority: 2 }
scheduler: { max_num_seqs: 8, max_num_batched_tokens: $mnbt, front_end_us: ${fe[$name]}, front_end_per_token_us: 0 }
workload: { trace: $here/traces/$name.jsonl, format: jsonl }
YAML
  "$bin" simulate --config "$out/$name.yaml" --out "$out/$name" --json > "$out/$name.json" 2> "$out/$name.err"
done
python3 "$here/stop-trace.py" > "$out/stop.jsonl"
cat > "$out/stop.yaml" <<YAML
# Llama-3-8B on one H200 (roofline), slo-aware's defaults.
seed: 1
model: llama-3-8b
hardware: h200
scheduler: { max_num_seqs: 256, max_num_batched_tokens: 8192 }
policies:
  - name: priority
  - name: slo-aware
  - { name: slo-aware, label: slo-aware-no-reserve, params: { reserve_window_ms: 0 } }
tiers:
  premium: { ttft_ms: 100, tpot_ms: 40, weight: 4, priority: 0 }
  batch: { weight: 1, preemptible: true, priority: 2 }
workload: { trace: $(realpath "$out")/stop.jsonl, format: jsonl }
YAML
"$bin" simulate --config "$out/stop.yaml" --out "$out/stop" --json > "$out/stop.json" 2> "$out/stop.err" || true
python3 "$here/summarize.py" "$out"
