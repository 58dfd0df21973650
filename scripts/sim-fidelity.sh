#!/usr/bin/env bash
# How close the simulator comes to the real server on this machine: calibrates the engine a
# server configuration describes (`switchyard calibrate`), serves that configuration, replays
# one trace against the server (`bench serve --dataset trace`) and through the simulator with
# the calibration, at two time scales, and prints the figures side by side.
#
# The trace: N requests (40) with ShareGPT lengths from ../shared/traces (prompt / 4, at most
# 512 tokens; output / 2, at most 128), Poisson arrivals at 1 request/s (seed 11); time
# scale 1 is a light load for SmolLM2 on 2 CPU cores, 3 is close to saturation.
# The simulator's spec is written for the default configuration: smollm2-135m, 256 sequences
# and 8,192 tokens a step, blocks of 16 (the simulator's defaults); another configuration
# needs its model and limits in the spec below.
# With RATE_LIMITS (say 'requests_per_minute: 20, tokens_per_minute: 4000') the open API's
# tier (standard) gets those limits on the server and in the simulator, and the table adds the
# requests each refused (the server's 429s; its initial test request counts against the
# budget too, the simulator does not see it).
# usage: scripts/sim-fidelity.sh [CONFIG]   (default config/examples/default.yaml; needs
#        target/release/switchyard and python3; OUT, PORT, N and RATE_LIMITS override the
#        defaults, and KEEP_CALIBRATION=1 reuses OUT's calibration)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-config/examples/default.yaml}
bin=target/release/switchyard
out=${OUT:-out/sim-fidelity}
port=${PORT:-8123}
n=${N:-40}
mkdir -p "$out"
python3 - "$n" "$out/trace.csv" <<'PY'
import csv, datetime, random, sys
n, path = int(sys.argv[1]), sys.argv[2]
random.seed(11)
src = '../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv'
rows = list(csv.DictReader(open(src, encoding='utf-8-sig')))
base, t = datetime.datetime(2023, 11, 16, 18, 0, 0), 0.0
with open(path, 'w') as f:
    f.write('TIMESTAMP,ContextTokens,GeneratedTokens\n')
    for _ in range(n):
        r = random.choice(rows)
        p = max(1, min(int(r['num_prefill_tokens']) // 4, 512))
        o = max(1, min(int(r['num_decode_tokens']) // 2, 128))
        ts = base + datetime.timedelta(seconds=t)
        f.write(ts.strftime('%Y-%m-%d %H:%M:%S.%f') + '0,%d,%d\n' % (p, o))
        t += random.expovariate(1.0)
PY
if [ -z "${KEEP_CALIBRATION:-}" ] || [ ! -f "$out/cal.yaml" ]; then
  "$bin" calibrate --config "$config" --output "$out/cal.yaml" --samples "$out/steps.json"
fi
limits=${RATE_LIMITS:-}
serve_limits=()
spec_limits=""
if [ -n "$limits" ]; then
  serve_limits=(--set "tiers={standard: {$limits}}")
  spec_limits="tiers: {standard: {$limits}}"
fi
"$bin" serve --config "$config" --set server.port="$port" "${serve_limits[@]}" >"$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
  sleep 1
done
for ts in 1 3; do
  # The server's budgets carry over from the run before: a minute idle fills them again, as
  # the simulator starts.
  if [ -n "$limits" ] && [ "$ts" != 1 ]; then sleep 61; fi
  "$bin" bench serve --base-url "http://127.0.0.1:$port" --dataset trace \
    --dataset-path "$out/trace.csv" --num-prompts "$n" --max-input-len 4096 \
    --max-output-len 4096 --time-scale "$ts" --result-file "$out/serve-$ts.json" >/dev/null
  cat >"$out/spec-$ts.yaml" <<YAML
model: smollm2-135m
calibration: cal.yaml
policies: [{name: fcfs}]
$spec_limits
workload: {trace: trace.csv, format: azure, time_scale: $ts, mix: {tiers: {standard: 1}}}
YAML
  "$bin" simulate --config "$out/spec-$ts.yaml" --out "$out/sim-$ts" --json >"$out/sim-$ts.json"
done
[ -n "$limits" ] && curl -s "http://127.0.0.1:$port/metrics" | grep '^switchyard:rate_limited_total'
python3 - "$out" "$limits" <<'PY'
import json, sys
out, limits = sys.argv[1], sys.argv[2]
print('time scale  figure           server   simulator   sim / server')
for ts in (1, 3):
    real = json.load(open(f'{out}/serve-{ts}.json'))
    sim = json.load(open(f'{out}/sim-{ts}.json'))['policies'][0]
    pairs = [('req/s', real['request_throughput'], sim['request_throughput']),
             ('TTFT p50 ms', real['median_ttft_ms'], sim['ttft_ms']['p50']),
             ('TTFT p99 ms', real['p99_ttft_ms'], sim['ttft_ms']['p99']),
             ('TPOT p50 ms', real['median_tpot_ms'], sim['tpot_ms']['p50']),
             ('TPOT p99 ms', real['p99_tpot_ms'], sim['tpot_ms']['p99'])]
    if limits:
        pairs.append(('refused (429)', real['failed'], sim['rate_limited']))
    for name, r, s in pairs:
        ratio = f'{s / r:>14.2f}' if r else f'{"n/a":>14}'
        print(f'{ts:>10}  {name:<14} {r:>8.2f} {s:>11.2f} {ratio}')
PY
