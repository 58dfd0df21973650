#!/usr/bin/env bash
# Open-loop traces with rare premium requests under `slo-aware` with its reserve (the default)
# and without (`reserve_window_ms: 0`), on the CPU cost model of scripts/bench/slo-closed-loop
# (SmolLM2-135M, cal.yaml) and on Llama-3-8B on one H200 (roofline), several seeds each; prints
# medians over the seeds (PERFORMANCE.md v0.49.0). A third run, `reserve_window_ms: 1`
# ("live-only"), keeps the bound while a targeted request is present and drops the window after.
#
#   scripts/bench/slo-open-loop/run.sh BIN OUT [SEEDS] [SCENARIOS]
#
# BIN: a switchyard binary; OUT: a new directory; SEEDS: "1 2 3 4 5" unless given; SCENARIOS:
# names from the list below (all unless given).
set -euo pipefail
bin=$(realpath "$1"); out=$2; seeds=${3:-1 2 3 4 5}; only=${4:-}
here=$(cd "$(dirname "$0")" && pwd)
cal=$(realpath "$here/../slo-closed-loop/cal.yaml")
azure=$(realpath "$here/../../../../shared/traces/AzureLLMInferenceTrace_code.csv" 2>/dev/null || true)
mkdir -p "$out"
out=$(realpath "$out")

# name | model | premium TTFT target (ms) | gen-trace.py args after the seed (DURATION BATCH_RATE
# BATCH_IN BATCH_OUT PREMIUM_RATE PREMIUM_IN PREMIUM_OUT [--burst N --burst-span S]), or
# "azure LOAD PREMIUM_FRACTION" for the Azure code trace with tiers drawn from the seed.
# Capacity: about 1.25 batch requests/s on the CPU model, 20 on the H200.
scenarios=(
  "cpu-poisson-1|cpu|1000|1800 1.1 256 32 0.011 128 16"
  "cpu-poisson-5|cpu|1000|1800 1.1 256 32 0.055 128 16"
  "cpu-bursts|cpu|1000|1800 1.1 256 32 0.011 128 16 --burst 5 --burst-span 2"
  "cpu-over-1|cpu|1000|1800 1.5 256 32 0.015 128 16"
  "h200-poisson-1|h200|100|600 18 2048 128 0.18 256 32"
  "h200-poisson-5|h200|100|600 18 2048 128 0.9 256 32"
  "h200-bursts|h200|100|600 18 2048 128 0.18 256 32 --burst 10 --burst-span 2"
  "h200-rare|h200|100|600 18 2048 128 0.02 256 32"
  "h200-over-1|h200|100|600 24 2048 128 0.24 256 32"
  "h200-over-bursts|h200|100|600 24 2048 128 0.24 256 32 --burst 10 --burst-span 2"
  "h200-over-rare|h200|100|600 24 2048 128 0.02 256 32"
  "h200-t50-over-1|h200|50|600 24 2048 128 0.24 256 32"
  "h200-t50-over-rare|h200|50|600 24 2048 128 0.02 256 32"
  "h200-t50-over-long|h200|50|600 24 2048 128 0.24 3000 32"
  "h200-azure-2|h200|200|azure 0.9 0.02"
)

head_of() {  # the spec's model, scheduler, policies and tiers for a cost model
  case $1 in
    cpu) cat <<YAML
model: smollm2-135m
calibration: $cal
scheduler: { max_num_seqs: 8, max_num_batched_tokens: 2048 }
policies:
  - { name: slo-aware, params: { step_overhead_ms: 67.4, prefill_us_per_token: 1738 } }
  - { name: slo-aware, label: live-only, params: { step_overhead_ms: 67.4, prefill_us_per_token: 1738, reserve_window_ms: 1 } }
  - { name: slo-aware, label: no-reserve, params: { step_overhead_ms: 67.4, prefill_us_per_token: 1738, reserve_window_ms: 0 } }
tiers:
  premium: { ttft_ms: $2, tpot_ms: 200, weight: 4, priority: 0 }
  batch: { weight: 1, preemptible: true, priority: 2 }
YAML
    ;;
    h200) cat <<YAML
model: llama-3-8b
hardware: h200
scheduler: { max_num_seqs: 256, max_num_batched_tokens: 8192 }
policies:
  - { name: slo-aware }
  - { name: slo-aware, label: live-only, params: { reserve_window_ms: 1 } }
  - { name: slo-aware, label: no-reserve, params: { reserve_window_ms: 0 } }
tiers:
  premium: { ttft_ms: $2, tpot_ms: 40, weight: 4, priority: 0 }
  batch: { weight: 1, preemptible: true, priority: 2 }
YAML
    ;;
  esac
}

for entry in "${scenarios[@]}"; do
  IFS='|' read -r name model ttft args <<<"$entry"
  if [[ -n $only && " $only " != *" $name "* ]]; then continue; fi
  for seed in $seeds; do
    run=$out/$name-s$seed
    read -r -a a <<<"$args"
    if [[ ${a[0]} == azure ]]; then
      [[ -n $azure ]] || { echo "no ../shared/traces/AzureLLMInferenceTrace_code.csv" >&2; exit 1; }
      { echo "seed: $seed"; head_of "$model" "$ttft"
        echo "workload: { trace: $azure, format: azure, arrival: { load: ${a[1]} }, mix: { tiers: { premium: ${a[2]}, batch: $(python3 -c "print(1 - ${a[2]})") } } }"
      } > "$run.yaml"
    else
      python3 "$here/gen-trace.py" "$seed" "${a[@]}" > "$run.jsonl"
      { echo "seed: $seed"; head_of "$model" "$ttft"
        echo "workload: { trace: $run.jsonl, format: jsonl }"; } > "$run.yaml"
    fi
    "$bin" simulate --config "$run.yaml" --out "$run" --json > "$run.json" 2> "$run.err"
  done
done
python3 "$here/summarize.py" "$out"
