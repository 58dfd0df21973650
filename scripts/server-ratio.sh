#!/usr/bin/env bash
# Server output throughput against offline `bench throughput` on the same workload, back to back,
# plus the engine's own step overhead from the server's Prometheus histogram.
#
#   scripts/server-ratio.sh [CONCURRENCY] [NUM_PROMPTS] [INPUT_LEN] [OUTPUT_LEN]
#
# Needs a release build (`cargo build --release --bins`) and the default model
# (`switchyard model fetch smollm2-135m`). Run it on a quiet machine: it measures.
set -euo pipefail
cd "$(dirname "$0")/.."
conc=${1:-32}
n=${2:-64}
inlen=${3:-128}
outlen=${4:-64}
bin=target/release/switchyard
port=${PORT:-18431}
work=$(mktemp -d)
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT

echo "== offline: bench throughput ($n prompts, $inlen in / $outlen out, max_num_seqs $conc)"
"$bin" bench throughput --num-prompts "$n" --input-len "$inlen" --output-len "$outlen" \
  --max-num-seqs "$conc" --max-num-batched-tokens 2048 --json >"$work/offline.json"
cat "$work/offline.json"

cat >"$work/server.yaml" <<YAML
model: { backend: cpu }
server: { host: 127.0.0.1, port: $port }
scheduler: { max_num_seqs: $conc, max_num_batched_tokens: 2048, policy: { name: fcfs } }
logging: { level: warn }
YAML
"$bin" serve --config "$work/server.yaml" >"$work/server.log" 2>&1 &
server=$!
for _ in $(seq 1 300); do
  curl -fs "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
  sleep 0.2
done
echo "== server: bench serve --max-concurrency $conc"
"$bin" bench serve --base-url "http://127.0.0.1:$port" --max-concurrency "$conc" \
  --num-prompts "$n" --input-len "$inlen" --output-len "$outlen" \
  --result-file "$work/serve.json" | tee "$work/serve.txt"
curl -fs "http://127.0.0.1:$port/metrics" >"$work/metrics.txt"

python3 - "$work" <<'PY'
import json, re, sys
w = sys.argv[1]
off = json.load(open(f"{w}/offline.json"))
srv = json.load(open(f"{w}/serve.json"))
def pick(d, *names):
    for k in names:
        if k in d:
            return float(d[k])
    raise SystemExit(f"none of {names} in {sorted(d)}")
o = pick(off, "output_throughput", "output_tokens_per_second")
s = pick(srv, "output_throughput", "output_tokens_per_second")
print(f"offline {o:.1f} output tok/s, server {s:.1f} output tok/s, ratio {100*s/o:.1f} %")
m = open(f"{w}/metrics.txt").read()
for name in ["engine_step_overhead_seconds", "engine_plan_seconds", "engine_kv_commit_seconds"]:
    q = re.findall(rf'switchyard:{name}{{quantile="0\.5"}} (\S+)', m)
    if q:
        print(f"{name} median {float(q[0])*1e6:.0f} us")
PY
