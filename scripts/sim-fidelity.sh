#!/usr/bin/env bash
# How close the simulator comes to the real server on this machine: calibrates the engine a
# server configuration describes (`switchyard calibrate`), serves that configuration, replays
# one trace against the server (`bench serve --dataset trace`) and through the simulator with
# the calibration, at two time scales, and prints the figures side by side.
#
# The trace: N requests (40) with ShareGPT lengths from ../shared/traces (prompt / 4, at most
# 512 tokens; output / 2, at most 128), Poisson arrivals at 1 request/s (seed 11); time
# scale 1 is a light load for SmolLM2 on 2 CPU cores, 3 is close to saturation.
# The simulator's spec is written for the default configuration: smollm2-135m, 64 sequences
# and 2,048 tokens a step, blocks of 16; another configuration needs its model and limits in
# the spec below.
# With RATE_LIMITS (say 'requests_per_minute: 20, tokens_per_minute: 4000') the open API's
# tier (standard) gets those limits on the server and in the simulator, and the table adds the
# requests each refused (the server's 429s; its initial test request counts against the
# budget too, the simulator does not see it).
# With LORA=K (1..16) every request names one of K LoRA adapters: copies of the fixture
# adapter (gpu/tests/fixtures/lora/smollm2-r4, rank 4 on all seven projections) under OUT's
# adapters/ that the server finds through lora.adapter_dirs, named by `bench serve
# --lora-modules` at random; the simulator's trace (JSONL) names adapters 1..K at random too,
# the calibration is made with `calibrate --lora`, and the table adds the simulator with the
# calibration refitted without the adapted steps (no LoRA terms: the old calibration).
# After each load the server's median front-end time (switchyard:request_front_end_seconds,
# its receipt of a request to its queue) becomes the simulator's scheduler.front_end_us, as an
# operator would read it off /metrics (no time per prompt token: bench serve sends token ids);
# the table adds the simulator without it, as it was before the front-end term.
# usage: scripts/sim-fidelity.sh [CONFIG]   (default config/examples/default.yaml; needs
#        target/release/switchyard (BIN: another build) and python3; OUT, PORT, N, RATE_LIMITS
#        and LORA override the defaults, TIME_SCALES (default "1 3") the loads, KEEP_CALIBRATION=1
#        reuses OUT's calibration, TRACE_SRC another copy of the ShareGPT statistics file (a GPU
#        host without ../shared), MAX_SEQS and MAX_TOKENS (default 64 and 2048) the simulated
#        scheduler's limits: give CONFIG the same)
set -euo pipefail
cd "$(dirname "$0")/.."
config=${1:-config/examples/default.yaml}
bin=${BIN:-target/release/switchyard}
out=${OUT:-out/sim-fidelity}
port=${PORT:-8123}
n=${N:-40}
lora=${LORA:-}
scales=${TIME_SCALES:-1 3}
mkdir -p "$out"
python3 - "$n" "$out/trace.csv" "$out/trace.jsonl" "${lora:-0}" \
  "${TRACE_SRC:-../shared/traces/sharegpt_8k_filtered_stats_llama2_tokenizer.csv}" <<'PY'
import csv, datetime, json, random, sys
n, path, jsonl, adapters = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
random.seed(11)
pick = random.Random(13)
src = sys.argv[5]
rows = list(csv.DictReader(open(src, encoding='utf-8-sig')))
base, t = datetime.datetime(2023, 11, 16, 18, 0, 0), 0.0
with open(path, 'w') as f, open(jsonl, 'w') as j:
    f.write('TIMESTAMP,ContextTokens,GeneratedTokens\n')
    for _ in range(n):
        r = random.choice(rows)
        p = max(1, min(int(r['num_prefill_tokens']) // 4, 512))
        o = max(1, min(int(r['num_decode_tokens']) // 2, 128))
        ts = base + datetime.timedelta(seconds=t)
        f.write(ts.strftime('%Y-%m-%d %H:%M:%S.%f') + '0,%d,%d\n' % (p, o))
        rec = {'arrival_s': round(t, 6), 'prompt_len': p, 'output_len': o}
        if adapters:
            rec['adapter'] = pick.randrange(adapters) + 1
        j.write(json.dumps(rec) + '\n')
        t += random.expovariate(1.0)
PY
lora_cal=()
lora_serve=()
lora_bench=()
sim_trace="trace: trace.csv, format: azure"
spec_lora=""
if [ -n "$lora" ]; then
  [ "$lora" -ge 1 ] && [ "$lora" -le 16 ] || { echo "LORA must be 1..16" >&2; exit 2; }
  fixture=gpu/tests/fixtures/lora/smollm2-r4
  rm -rf "$out/adapters"
  mkdir -p "$out/adapters"
  for i in $(seq "$lora"); do
    cp -r "$fixture" "$out/adapters/sim-lora-$i"
    lora_bench+=("sim-lora-$i")
  done
  lora_cal=(--lora "$fixture")
  lora_serve=(--set lora.enabled=true --set "lora.max_loras=$(( lora < 4 ? 4 : lora ))"
    --set "lora.adapter_dirs=[$(realpath "$out/adapters")]")
  lora_bench=(--lora-modules "${lora_bench[@]}")
  sim_trace="trace: trace.jsonl, format: jsonl"
  spec_lora=", max_loras: $(( lora < 4 ? 4 : lora ))"
fi
if [ -z "${KEEP_CALIBRATION:-}" ] || [ ! -f "$out/cal.yaml" ]; then
  "$bin" calibrate --config "$config" --output "$out/cal.yaml" --samples "$out/steps.json" \
    "${lora_cal[@]}"
fi
if [ -n "$lora" ]; then
  # The same steps without the adapted ones: the calibration made without --lora.
  python3 - "$out/steps.json" "$out/steps-base.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d['samples'] = [s for s in d['samples'] if not s['shape'].get('lora_tokens')]
d.pop('lora', None)
json.dump(d, open(sys.argv[2], 'w'), indent=1)
PY
  "$bin" calibrate --from-samples "$out/steps-base.json" --output "$out/cal-base.yaml" >/dev/null
fi
limits=${RATE_LIMITS:-}
serve_limits=()
spec_limits="tiers: {standard: {}}"
if [ -n "$limits" ]; then
  serve_limits=(--set "tiers={standard: {$limits}}")
  spec_limits="tiers: {standard: {$limits}}"
fi
"$bin" serve --config "$config" --set server.port="$port" "${serve_limits[@]}" \
  "${lora_serve[@]}" >"$out/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "http://127.0.0.1:$port/ready" >/dev/null 2>&1 && break
  sleep 1
done
first=1
for ts in $scales; do
  # The server's budgets carry over from the run before: a minute idle fills them again, as
  # the simulator starts.
  if [ -n "$limits" ] && [ -z "$first" ]; then sleep 61; fi
  first=
  "$bin" bench serve --base-url "http://127.0.0.1:$port" --dataset trace \
    --dataset-path "$out/trace.csv" --num-prompts "$n" --max-input-len 4096 \
    --max-output-len 4096 --time-scale "$ts" --result-file "$out/serve-$ts.json" \
    --percentile-metrics ttft,tpot,itl,e2el \
    "${lora_bench[@]}" >/dev/null
  # The server's own median time per request from its receipt to its queue, as an operator
  # reads it off /metrics, in microseconds: the simulator's scheduler.front_end_us.
  fe_us=$(curl -s "http://127.0.0.1:$port/metrics" | awk '
    /^switchyard:request_front_end_seconds\{.*quantile="0.5"/ && !done { printf "%.0f", $2 * 1e6; done = 1 }')
  fe_us=${fe_us:-0}
  echo "time scale $ts: the server's median front-end time ${fe_us} us" >&2
  cals=(cal)
  [ -n "$lora" ] && cals+=(cal-base)
  cals+=(cal-nofe)
  for cal in "${cals[@]}"; do
    # bench serve sends token ids: no template, no tokenizer, so no time per prompt token
    # (the calibration's is the tokenizer's on text).
    front_end=", front_end_us: $fe_us, front_end_per_token_us: 0"
    if [ "$cal" = cal-nofe ]; then
      front_end=", front_end_us: 0, front_end_per_token_us: 0"
    fi
    cat >"$out/spec-$cal-$ts.yaml" <<YAML
model: smollm2-135m
calibration: ${cal%-nofe}.yaml
policies: [{name: fcfs}]
$spec_limits
scheduler: {max_num_seqs: ${MAX_SEQS:-64}, max_num_batched_tokens: ${MAX_TOKENS:-2048}$spec_lora$front_end}
workload: {$sim_trace, time_scale: $ts, mix: {tiers: {standard: 1}}}
YAML
    "$bin" simulate --config "$out/spec-$cal-$ts.yaml" --out "$out/sim-$cal-$ts" --json \
      >"$out/sim-$cal-$ts.json"
  done
done
[ -n "$limits" ] && curl -s "http://127.0.0.1:$port/metrics" | grep '^switchyard:rate_limited_total'
python3 - "$out" "$limits" "$lora" $scales <<'PY'
import json, os, sys
out, limits, lora, scales = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
cals = ['cal', 'cal-base'] if lora else ['cal']
if os.path.exists(f'{out}/sim-cal-nofe-{scales[0]}.json'):
    cals.append('cal-nofe')
names = {'cal': 'simulator', 'cal-base': 'sim, no LoRA terms', 'cal-nofe': 'sim, no front end'}
print('time scale  figure           server' + ''.join(f'  {names[c]:>18}  sim / server' for c in cals))
for ts in scales:
    real = json.load(open(f'{out}/serve-{ts}.json'))
    sims = [json.load(open(f'{out}/sim-{c}-{ts}.json'))['policies'][0] for c in cals]
    rows = [('req/s', real['request_throughput'], lambda s: s['request_throughput']),
            ('TTFT p50 ms', real['median_ttft_ms'], lambda s: s['ttft_ms']['p50']),
            ('TTFT p99 ms', real['p99_ttft_ms'], lambda s: s['ttft_ms']['p99']),
            ('TPOT p50 ms', real['median_tpot_ms'], lambda s: s['tpot_ms']['p50']),
            ('TPOT p99 ms', real['p99_tpot_ms'], lambda s: s['tpot_ms']['p99']),
            ('E2E p50 ms', real['median_e2el_ms'], lambda s: s['e2e_ms']['p50']),
            ('E2E p99 ms', real['p99_e2el_ms'], lambda s: s['e2e_ms']['p99'])]
    if limits:
        rows.append(('refused (429)', real['failed'], lambda s: s['rate_limited']))
    for name, r, get in rows:
        line = f'{ts:>10}  {name:<14} {r:>8.2f}'
        for s in sims:
            v = get(s)
            ratio = f'{v / r:>12.2f}' if r else f'{"n/a":>12}'
            line += f'  {v:>18.2f}  {ratio}'
        print(line)
PY
