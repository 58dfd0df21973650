#!/usr/bin/env bash
# Correctness checks and benchmarks of the CUDA backend on a GPU host, in one go.
#
# The GPU host has no cargo: build here, carry the binaries there.
#   cargo build --release --features cuda
#   cargo test --release --features cuda -p switchyard-gpu --no-run   # prints the test binary
# or scripts/devbench-pack.sh NAME, which builds both into .devbench/NAME gzip-compressed (this
# script unpacks *.gz in BIN) and, with MODEL_SPLIT=1, splits the SmolLM2 GGUF for two calls.
# Then on the GPU host:
#   BIN=dir-with-switchyard-and-cuda_backend MODEL=path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
#     OUT=results-dir scripts/gpu-check.sh
# SECTIONS picks parts (default: all but kvbench, ab and signals): tests gemv ref dummy variants profile model serve specstruct
# kvoffload kvbench kvcopy hf ab signals.
#   tests     the cuda_backend test binary (GGUF-dependent tests skip without MODEL; TEST_FILTER:
#             test-name filters; bounded by TEST_TIMEOUT, default 480 s here: the whole suite
#             with the GGUF takes ~310 s on an H100, so leave room for nothing else in a call)
#   gemv      GEMV kernels against cuBLAS, time per product at every projection shape
#   ref       gpu/reference/ref_logits.py (for each of REF_LAYERS, default "4 8": that many
#             layers at full width) and the test comparing the CUDA backend's logits with
#             transformers' float32 ones
#   dummy     batch-1 / batch-256 decode and offline benchmarks on random weights, Llama-3-8B
#             also with fp8 layers and with an fp8 KV cache (at full memory and at 0.32 of it,
#             beside a bf16 cache) (OFFLINE=0 leaves out the 2000-prompt offline runs)
#   variants  batch-1 decode with each SWITCHYARD_CUDA_GEMV mode, with PDL off (`:nopdl`),
#             with GemmEx instead of cuBLASLt (`:nolt`), with RoPE in its own kernel
#             (`:norope`), without attention's early key copies (`:noearly`), with at most N
#             attention splits (`:splits-N`), with the KV heads fastest in the attention grid
#             (`:hinner`) and with kernel source variants
#             (`:def-MMA_KEYS=32`, see SWITCHYARD_CUDA_DEFINES) (VARIANTS), Llama decode at
#             VARIANT_BATCHES with and without the GEMV kernels
#   offline   Llama-3-8B offline 2000 x 128/128 at each OFFLINE_CONFIGS entry
#             (max_num_seqs:max_num_batched_tokens)
#   profile   batch-1 decode with SWITCHYARD_CUDA_PROFILE=1 (per-kernel breakdown) of each
#             PROFILE_MODELS preset (default Llama-3-8B and SmolLM2), then (PROFILE_OFFLINE=0
#             leaves it out) a 512-prompt Llama-3-8B offline run
#   ncu       Nsight Compute (--set full) on NCU_KERNELS in the offline profile workload
#   model     SmolLM2 from the GGUF at MODEL: batch-1 / batch-256 decode, offline, `generate`
#   serve     `switchyard serve` on MODEL (backend SERVE_BACKEND, default cuda): a completion
#             with logprobs, a chat completion, the backend metric, the golden fixture's
#             embeddings against transformers', then `bench serve` (SERVE_BENCH_ARGS; default
#             1000 prompts of 128/128 at concurrency 256) and, with SERVE_EMBED_BENCH_ARGS,
#             `bench serve` with those arguments (`--endpoint embeddings ...`);
#             SERVE_SETS: config overrides, e.g. "scheduler.async_scheduling=off"
#   hf        gpu/reference/hf_bench.py (HF_ARGS): transformers on the same shapes
#   specstruct `serve` on MODEL (backend SERVE_BACKEND) with prompt-lookup drafts: 48 concurrent
#             completions, a third under a JSON schema, a third under a regex, a third free
#             (scripts/spec-structured-check.py: every constrained answer valid, the drafts'
#             acceptance from /metrics)
#   kvoffload `serve` on MODEL (backend SERVE_BACKEND) with a KV cache of KV_BLOCKS blocks:
#             prompt A, three prompts that evict it, A again, with a host KV tier
#             (`cache.kv_offloading_size`) and without (cached tokens, same answer, the
#             kv_offload metrics); then `bench serve --dataset mooncake` (KV_BENCH_ARGS) on
#             the trace at TRACE (default ../shared/traces/synthetic_trace.jsonl, else
#             shared/traces/...) against a cache of KV_BENCH_BLOCKS blocks, with a tier of
#             KV_BENCH_GIB GiB and without
#   kvbench   the host tier offline on random Llama-3-8B weights: `bench throughput --dataset
#             mooncake` (TRACE, else BIN/synthetic_trace.jsonl) with a cache of KVB_BLOCKS (2048)
#             blocks and a tier of each of KVB_GIB (default "0 32 32:evict") GiB, `:evict` with
#             --kv-offloading-on-eviction (no stores ahead), `:dmastore` with stores by DMA
#             (SWITCHYARD_CUDA_KV_STORE=dma), `:sbN` with store launches of at most N thread
#             blocks (SWITCHYARD_CUDA_KV_STORE_BLOCKS=N) (KVB_ARGS: the rows)
#   kvcopy    the cuda_kv_copy benchmark (its binary in BIN): offloads and loads of 16 and 256
#             blocks, in one run, in runs of 8 and scattered, Llama-3-8B and SmolLM2 shapes, by
#             DMA, by the kernel and by the default mix (auto)
#   signals   SIGINT and SIGTERM during the CUDA model load of `serve` and `run-batch`: the
#             load's length on SIGNAL_MODEL (default: a random Llama-3-8B-shaped checkpoint of
#             SIGNAL_LAYERS (8) layers written by gpu/reference/ref_logits.py), then a signal at
#             each fraction of it in SIGNAL_AT: exit status, seconds from the signal to the
#             exit, files left, panics or crashes in the log, processes left on the GPU; and
#             SIGNAL_RUNS (5) whole run-batch runs without a signal (each must exit 0)
#   ab        builds against each other, interleaved: AB_BINS="DIR DIR ..." (each a folder with a
#             switchyard build, or DIR@VAR=VALUE,VAR=VALUE: that build with those environment
#             variables, e.g. "b b@SWITCHYARD_CUDA_PDL=0"), AB_SPECS (name=arguments, commas for spaces; default Llama and
#             SmolLM2 at batch 1 / 64 / 256 and the Llama offline run), AB_ROUNDS (2)
# Results: $OUT/summary.txt (the table printed last), $OUT/*.json and logs; with ARCHIVE=file,
# all of them in one .tar.gz as well (the device tool returns at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release}
OUT=${OUT:-gpu-check-out}
MODEL=${MODEL:-}
SECTIONS=${SECTIONS:-"tests gemv ref dummy variants offline profile model serve specstruct kvoffload kvcopy hf"}
mkdir -p "$OUT"
# Binaries packed by scripts/devbench-pack.sh arrive gzip-compressed.
for f in "$BIN"/*.gz; do
  [ -e "$f" ] || continue
  gunzip -c "$f" >"${f%.gz}" && chmod +x "${f%.gz}"
done
SY="$BIN/switchyard"
TESTBIN=$(ls "$BIN"/cuda_backend* 2>/dev/null | grep -v '\.d$' | grep -v '\.gz$' | head -1)
export RUST_LOG=${RUST_LOG:-info}
export SWITCHYARD_KERNEL_CACHE=${SWITCHYARD_KERNEL_CACHE:-$OUT/kernel-cache}
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
done
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
summary="$OUT/summary.txt"
: >"$summary"
note() { echo "$*" | tee -a "$summary"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
field() { python3 -c "import json,sys; d=json.load(open('$1')); print(d.get('$2', 'n/a'))" 2>/dev/null || echo n/a; }

note "== gpu-check $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null || echo nogit)"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader 2>&1 | tee -a "$summary"

bench() { # name, then bench throughput arguments
  local name=$1; shift
  local t0=$SECONDS
  timeout "${BENCH_TIMEOUT:-240}" "$SY" bench throughput --backend cuda --json "$@" >"$OUT/$name.json" 2>"$OUT/$name.log"
  local rc=$?
  local j="$OUT/$name.json"
  note "$(printf '%-28s rc=%s %4ss out_tok/s=%s decode_ms/step=%s decode_tok/s=%s' "$name" "$rc" $((SECONDS - t0)) \
    "$(field "$j" output_tokens_per_second)" "$(field "$j" decode_ms_per_step_median)" "$(field "$j" decode_tokens_per_second)")"
  # With SWITCHYARD_CUDA_STEP_TIMING=1: the GPU's idle time between steps.
  grep -h "CUDA step timing" "$OUT/$name.log" 2>/dev/null | sed 's/^/  /' | tee -a "$summary"
  [ $rc -ne 0 ] && tail -5 "$OUT/$name.log" | tee -a "$summary"
}

serve_up() { # name, config file, port, then extra serve arguments: starts `serve` (log
  # $OUT/NAME.log, pid in $server_pid) and waits up to a minute for /health
  local name=$1 config=$2 port=$3; shift 3
  "$SY" serve --config "$config" "$@" >"$OUT/$name.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 1 120); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  note "serve ($name) did not come up"; tail -5 "$OUT/$name.log" | tee -a "$summary"
  serve_down
  return 1
}
serve_down() { kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null; }

if has tests && [ -n "$TESTBIN" ]; then
  if [ -n "$MODEL" ] && [ "$(basename "$MODEL")" != SmolLM2-135M-Instruct.Q4_1.gguf ]; then
    note "warning: the GGUF tests look for SmolLM2-135M-Instruct.Q4_1.gguf beside MODEL; they will skip"
  fi
  SWITCHYARD_MODEL_DIR=$( [ -n "$MODEL" ] && dirname "$MODEL" || echo /nonexistent ) \
    timeout "${TEST_TIMEOUT:-480}" "$TESTBIN" ${TEST_FILTER:-} --test-threads=1 --nocapture >"$OUT/tests.log" 2>&1
  note "cuda tests rc=$?"
  grep -E "^test |test result|top-1|relative logit|max \|error\|" "$OUT/tests.log" | sed 's/^/  /' | tail -40 | tee -a "$summary" >/dev/null
fi

if has gemv && [ -n "$TESTBIN" ]; then
  timeout "${TEST_TIMEOUT:-300}" "$TESTBIN" gemv_bandwidth --ignored --nocapture >"$OUT/gemv_bandwidth.log" 2>&1
  note "gemv_bandwidth rc=$?"
  grep -E "^(shape|llama|smollm2)" "$OUT/gemv_bandwidth.log" | sed 's/^/  /' | tee -a "$summary" >/dev/null
fi

if has ref && [ -n "$TESTBIN" ] && [ -f gpu/reference/ref_logits.py ]; then
  for layers in ${REF_LAYERS:-4 8}; do
    dir=/tmp/switchyard-ref-llama3-8b-L$layers
    t0=$SECONDS
    PYTHONUNBUFFERED=1 timeout "${REF_TIMEOUT:-400}" python3 gpu/reference/ref_logits.py \
      --layers "$layers" --out-dir "$dir" --reuse-weights --copy-to "$OUT/ref-L$layers" >"$OUT/ref_logits-L$layers.log" 2>&1
    note "ref_logits.py rc=$? ($layers layers, $((SECONDS - t0)) s): $(grep -E 'bf16 vs float32' "$OUT/ref_logits-L$layers.log" | tail -1)"
    SWITCHYARD_REF_LOGITS_DIR="$dir" timeout "${TEST_TIMEOUT:-300}" "$TESTBIN" \
      llama3_8b_shape_matches_transformers_float32 --nocapture >"$OUT/ref_test-L$layers.log" 2>&1
    note "ref logits test ($layers layers) rc=$?"
    grep -E "reference checkpoint|position|worst|test result" "$OUT/ref_test-L$layers.log" | sed 's/^/  /' | tee -a "$summary" >/dev/null
    rm -rf "$dir" "$OUT/ref-L$layers/ref_logits.f32"
  done
fi

if has dummy; then
  bench llama8b-decode-b1 --dummy llama-3-8b --decode-batch 1 --input-len 128 --output-len 256
  [ "${OFFLINE:-1}" = 1 ] && bench llama8b-offline-2000 --dummy llama-3-8b --num-prompts 2000 --input-len 128 --output-len 128
  bench llama8b-fp8-decode-b1 --dummy llama-3-8b --decode-batch 1 --input-len 128 --output-len 256 --quantization fp8
  [ "${OFFLINE:-1}" = 1 ] && bench llama8b-fp8-offline-2000 --dummy llama-3-8b --num-prompts 2000 --input-len 128 --output-len 128 \
    --max-num-seqs 2048 --max-num-batched-tokens 32768 --quantization fp8
  bench llama8b-kv8-decode-b1 --dummy llama-3-8b --decode-batch 1 --input-len 128 --output-len 256 --kv-cache-dtype fp8
  if [ "${OFFLINE:-1}" = 1 ]; then
    bench llama8b-kv8-offline-2000 --dummy llama-3-8b --num-prompts 2000 --input-len 128 --output-len 128 \
      --max-num-seqs 2048 --max-num-batched-tokens 32768 --kv-cache-dtype fp8
    # A run the cache's size limits: 0.32 of the GPU's memory, bf16 against fp8 keys and values.
    for kv in auto fp8; do
      bench llama8b-offline-2000-mem032-kv-$kv --dummy llama-3-8b --num-prompts 2000 --input-len 128 --output-len 128 \
        --max-num-seqs 2048 --max-num-batched-tokens 32768 --gpu-memory-utilization 0.32 --kv-cache-dtype $kv
    done
  fi
  bench smollm2-dummy-decode-b1 --dummy smollm2-135m --decode-batch 1 --input-len 128 --output-len 256
  bench smollm2-dummy-decode-b256 --dummy smollm2-135m --decode-batch 256 --input-len 128 --output-len 128
fi

if has variants; then
  # MODE[:nopdl][:nolt][:norope][:noearly][:splits-N][:hinner][:def-NAME=VALUE] for
  # SWITCHYARD_CUDA_GEMV (SWITCHYARD_CUDA_PDL=0, SWITCHYARD_CUDA_BLASLT=0,
  # SWITCHYARD_CUDA_ROPE_EPILOGUE=0, SWITCHYARD_CUDA_EARLY_KV=0, SWITCHYARD_CUDA_ATT_SPLITS=N,
  # SWITCHYARD_CUDA_ATT_HEADS_INNER=1,
  # SWITCHYARD_CUDA_DEFINES=NAME=VALUE), batch 1, the models in VARIANT_MODELS.
  for spec in ${VARIANTS:-off hybrid norm auto off:nopdl auto:nopdl off:nolt}; do
    mode=${spec%%:*}
    pdl=1
    lt=1
    [[ $spec == *:nopdl* ]] && pdl=0
    [[ $spec == *:nolt* ]] && lt=0
    rope=1
    [[ $spec == *:norope* ]] && rope=0
    early=1
    [[ $spec == *:noearly* ]] && early=0
    hinner=0
    [[ $spec == *:hinner* ]] && hinner=1
    splits=${SWITCHYARD_CUDA_ATT_SPLITS:-32}
    [[ $spec == *:splits-* ]] && { splits=${spec##*:splits-}; splits=${splits%%:*}; }
    defs=${SWITCHYARD_CUDA_DEFINES-}
    [[ $spec == *:def-* ]] && { defs=${spec##*:def-}; defs=${defs%%:*}; }
    for m in ${VARIANT_MODELS:-llama-3-8b smollm2-135m}; do
      SWITCHYARD_CUDA_PDL=$pdl SWITCHYARD_CUDA_BLASLT=$lt SWITCHYARD_CUDA_GEMV=$mode \
        SWITCHYARD_CUDA_ROPE_EPILOGUE=$rope SWITCHYARD_CUDA_DEFINES=$defs \
        SWITCHYARD_CUDA_EARLY_KV=$early SWITCHYARD_CUDA_ATT_SPLITS=$splits \
        SWITCHYARD_CUDA_ATT_HEADS_INNER=$hinner \
        bench "$m-b1-${spec//:/-}" --dummy "$m" --decode-batch 1 --input-len 128 --output-len 256
    done
  done
  # Larger decode batches (the GEMV kernels take up to 64 tokens) against cuBLAS.
  for b in ${VARIANT_BATCHES-8 16 64}; do
    for mode in off auto; do
      SWITCHYARD_CUDA_GEMV=$mode bench "llama-3-8b-b$b-$mode" --dummy llama-3-8b --decode-batch "$b" \
        --input-len 128 --output-len 128
    done
  done
fi

if has offline; then
  # SEQS:TOKENS[:ENV=VALUE] (one environment setting for that run).
  for spec in ${OFFLINE_CONFIGS:-256:8192 1024:16384}; do
    IFS=: read -r seqs toks envset <<<"$spec"
    ( [ -n "$envset" ] && export "${envset?}"
    bench "llama8b-offline-2000-${spec//[:=]/-}" --dummy llama-3-8b \
      --num-prompts 2000 --input-len 128 --output-len 128 --max-num-seqs "$seqs" \
      --max-num-batched-tokens "$toks" )
  done
fi

if has profile; then
  for m in ${PROFILE_MODELS:-llama-3-8b smollm2-135m}; do
    SWITCHYARD_CUDA_PROFILE=1 bench "profile-$m-b1" --dummy "$m" --decode-batch 1 --input-len 128 --output-len 64
    grep -A30 "kernel time by class" "$OUT/profile-$m-b1.log" | sed 's/^/  /' | tee -a "$summary" >/dev/null
  done
  if [ "${PROFILE_OFFLINE:-1}" = 1 ]; then
    SWITCHYARD_CUDA_PROFILE=1 bench profile-llama8b-offline-512 --dummy llama-3-8b --num-prompts 512 \
      --input-len 128 --output-len 128 --max-num-seqs "${PROFILE_SEQS:-256}" --max-num-batched-tokens 16384
    grep -A30 "kernel time by class" "$OUT/profile-llama8b-offline-512.log" | sed 's/^/  /' | tee -a "$summary" >/dev/null
  fi
fi

if has ncu; then
  # Nsight Compute on NCU_KERNELS (a regex) in the offline workload of the profile section,
  # after NCU_SKIP matching launches (default: a decode step at a context of about 190).
  ncu_bin=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
  if [ -n "$ncu_bin" ]; then
    t0=$SECONDS
    timeout "${NCU_TIMEOUT:-300}" "$ncu_bin" --clock-control none --set full -f -o "$OUT/ncu" \
      -k "regex:${NCU_KERNELS:-attention_w}" --launch-skip "${NCU_SKIP:-2000}" \
      --launch-count "${NCU_COUNT:-2}" --kill yes \
      "$SY" bench throughput --backend cuda --dummy llama-3-8b --num-prompts 512 --input-len 128 \
      --output-len 128 --max-num-seqs "${PROFILE_SEQS:-256}" --max-num-batched-tokens 16384 \
      >"$OUT/ncu.log" 2>&1
    note "ncu rc=$? ($((SECONDS - t0)) s)"
    "$ncu_bin" --import "$OUT/ncu.ncu-rep" --page details >"$OUT/ncu.txt" 2>&1
    grep -E "^  [a-z_]+.*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Block Limit|Issued Warp|No Eligible|Warp Cycles Per Issued" \
      "$OUT/ncu.txt" | sed 's/^/  /' | tee -a "$summary" >/dev/null
  else
    note "ncu: not found"
  fi
fi

if has model && [ -n "$MODEL" ] && [ -f "$MODEL" ]; then
  bench smollm2-decode-b1 --model "$MODEL" --decode-batch 1 --input-len 128 --output-len 256
  bench smollm2-decode-b256 --model "$MODEL" --decode-batch 256 --input-len 128 --output-len 128
  bench smollm2-offline-2000 --model "$MODEL" --num-prompts 2000 --input-len 128 --output-len 128
  "$SY" generate --backend cuda --model "$MODEL" --chat --max-tokens 32 --prompt "What is the capital of France?" \
    >"$OUT/generate.txt" 2>"$OUT/generate.log"
  note "generate rc=$?: $(head -c 300 "$OUT/generate.txt" | tr '\n' ' ')"
fi

if has serve && [ -n "$MODEL" ] && [ -f "$MODEL" ]; then
  cat >"$OUT/serve.yaml" <<EOF
model: { path: $MODEL, backend: ${SERVE_BACKEND:-cuda} }
server: { host: 127.0.0.1, port: 18431 }
cache: { gpu_memory_utilization: 0.5 }
EOF
  sets=(); for kv in ${SERVE_SETS:-}; do sets+=(--set "$kv"); done
  if serve_up serve "$OUT/serve.yaml" 18431 "${sets[@]}"; then
    # The served model's id is the GGUF's file stem: ask for it rather than assume it.
    id=$(curl -s http://127.0.0.1:18431/v1/models | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
    curl -s http://127.0.0.1:18431/v1/completions -H 'content-type: application/json' \
      -d "{\"model\":\"$id\",\"prompt\":\"The capital of France is\",\"max_tokens\":16,\"temperature\":0,\"logprobs\":2}" \
      >"$OUT/serve-completion.json"
    note "serve completion: $(head -c 400 "$OUT/serve-completion.json")"
    curl -s http://127.0.0.1:18431/v1/chat/completions -H 'content-type: application/json' \
      -d "{\"model\":\"$id\",\"messages\":[{\"role\":\"user\",\"content\":\"What is the capital of France?\"}],\"max_tokens\":24,\"temperature\":0}" \
      >"$OUT/serve-chat.json"
    note "serve chat: $(head -c 400 "$OUT/serve-chat.json")"
    curl -s http://127.0.0.1:18431/metrics | grep -E "backend_info" | head -3 | tee -a "$summary"
    # Embeddings of the golden fixture's ids (one request) against transformers' vectors.
    note "serve embeddings: $(python3 - "$id" <<'PY' 2>&1 | tail -3
import json, math, sys, urllib.request
fx = json.load(open("gpu/tests/fixtures/smollm2_embeddings.json"))
body = json.dumps({"model": sys.argv[1], "input": [c["ids"] for c in fx["cases"]]}).encode()
req = urllib.request.Request("http://127.0.0.1:18431/v1/embeddings", body, {"content-type": "application/json"})
got = json.load(urllib.request.urlopen(req))
cos = []
for c, d in zip(fx["cases"], got["data"]):
    ref, v = c["hidden"], d["embedding"]
    n = math.sqrt(sum(x * x for x in ref))
    cos.append(sum(a * b / n for a, b in zip(v, ref)))
print(f"{len(cos)} inputs, dims {len(got['data'][0]['embedding'])}, cosine vs transformers "
      f"min {min(cos):.6f} max {max(cos):.6f}, usage {got['usage']}")
PY
)"
    # Beam search on the golden fixture's prompts against vLLM's algorithm over transformers'
    # logprobs: how many answers agree beam for beam (the end-to-end cases must; elsewhere the
    # backend's numbers may reorder near-equal beams), and each answer ranked best first.
    note "serve beam search: $(python3 - "$id" <<'PY' 2>&1 | tail -3
import json, sys, urllib.request
def post(path, body):
    req = urllib.request.Request("http://127.0.0.1:18431" + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req))
fx = json.load(open("gpu/tests/fixtures/smollm2_beam_search.json"))
same, e2e, e2e_same, ranked = 0, 0, 0, True
for c in fx["cases"]:
    got = post("/v1/completions", {"model": sys.argv[1], "prompt": c["prompt_ids"], "n": c["width"],
               "max_tokens": c["max_tokens"], "use_beam_search": True, "logprobs": 0,
               "length_penalty": c["length_penalty"], "ignore_eos": c["ignore_eos"]})
    texts = [ch["text"] for ch in got["choices"]]
    # The end token that ended a beam, for its logprob (it counts in the score, not its place).
    kept = post("/v1/completions", {"model": sys.argv[1], "prompt": c["prompt_ids"], "n": c["width"],
                "max_tokens": c["max_tokens"], "use_beam_search": True, "logprobs": 0,
                "length_penalty": c["length_penalty"], "ignore_eos": c["ignore_eos"],
                "include_stop_str_in_output": True})
    refs = [post("/detokenize", {"tokens": b["tokens"]})["prompt"] for b in c["beams"]]
    ok = texts == refs
    same += ok
    e2e += c["end_to_end"]
    e2e_same += ok and c["end_to_end"]
    n, lp = got["usage"]["prompt_tokens"], c["length_penalty"]
    scores = [sum(ch["logprobs"]["token_logprobs"])
              / (n + len(ch["logprobs"]["token_logprobs"]) - (ch["finish_reason"] == "stop")) ** lp
              for ch in kept["choices"]]
    ranked &= all(a >= b - 1e-6 for a, b in zip(scores, scores[1:]))
print(f"{same}/{len(fx['cases'])} cases beam for beam as transformers, end-to-end cases "
      f"{e2e_same}/{e2e}, every answer best first: {ranked}")
PY
)"
    # vLLM's prompt_logprobs over each golden generation (prompt + its 32 tokens, teacher
    # forced) against transformers' per-step logprobs and top-1, and equal to echo's numbers.
    note "serve prompt_logprobs: $(python3 - "$id" <<'PY' 2>&1 | tail -3
import json, sys, urllib.request
def post(path, body):
    req = urllib.request.Request("http://127.0.0.1:18431" + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req))
fx = json.load(open("gpu/tests/fixtures/smollm2_golden.json"))
worst, top1, positions, echo_same = 0.0, 0, 0, True
for g in fx["generations"]:
    ids = g["prompt_ids"] + g["tokens"]
    got = post("/v1/completions", {"model": sys.argv[1], "prompt": ids, "max_tokens": 1,
               "temperature": 0, "prompt_logprobs": 1})["choices"][0]["prompt_logprobs"]
    echo = post("/v1/completions", {"model": sys.argv[1], "prompt": ids, "max_tokens": 1,
                "temperature": 0, "echo": True, "logprobs": 1})["choices"][0]["logprobs"]
    echo_same &= [None] + [e[str(t)]["logprob"] for e, t in zip(got[1:], ids[1:])] \
        == echo["token_logprobs"][:len(ids)]
    for i, step in enumerate(g["steps"]):
        p = len(g["prompt_ids"]) + i
        entry = got[p][str(ids[p])]
        worst = max(worst, abs(entry["logprob"] - step["logprob"]))
        best = min(got[p].items(), key=lambda kv: kv[1]["rank"])[0]
        top1 += int(best) == step["top5"][0][0]
        positions += 1
print(f"{positions} generated positions of {len(fx['generations'])} golden generations: top-1 as "
      f"transformers {top1}/{positions}, max |logprob - transformers| {worst:.4f}, "
      f"equal to echo's: {echo_same}")
PY
)"
    # Load through HTTP (`bench serve`, SERVE_BENCH_ARGS): output tok/s, TTFT, TPOT.
    timeout "${BENCH_TIMEOUT:-240}" "$SY" bench serve --base-url http://127.0.0.1:18431 \
      ${SERVE_BENCH_ARGS:---max-concurrency 256 --num-prompts 1000 --input-len 128 --output-len 128} \
      --result-file "$OUT/serve-bench.json" >"$OUT/serve-bench.txt" 2>&1
    note "bench serve rc=$?: $(python3 -c "import json; d=json.load(open('$OUT/serve-bench.json')); print({k: round(v, 3) for k, v in d.items() if isinstance(v, (int, float)) and not k.startswith('std_')})" 2>/dev/null | head -c 1000)"
    # Embeddings under load (SERVE_EMBED_BENCH_ARGS, e.g. "--endpoint embeddings --num-prompts
    # 4096 --input-len 128 --max-concurrency 64"; unset: not run).
    if [ -n "${SERVE_EMBED_BENCH_ARGS:-}" ]; then
      # shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT:-240}" "$SY" bench serve --base-url http://127.0.0.1:18431 \
        $SERVE_EMBED_BENCH_ARGS --result-file "$OUT/serve-embed-bench.json" >"$OUT/serve-embed-bench.txt" 2>&1
      note "bench serve (embeddings) rc=$?: $(python3 -c "import json; d=json.load(open('$OUT/serve-embed-bench.json')); print({k: v for k, v in d.items() if isinstance(v, (int, float, str))})" 2>/dev/null | head -c 700)"
    fi
    serve_down
  fi
fi

if has specstruct && [ -n "$MODEL" ] && [ -f "$MODEL" ]; then
  cat >"$OUT/specstruct.yaml" <<EOF
model: { path: $MODEL, backend: ${SERVE_BACKEND:-cuda} }
server: { host: 127.0.0.1, port: 18433 }
cache: { gpu_memory_utilization: 0.5 }
speculative: { num_speculative_tokens: 4, max_running: 64 }
EOF
  if serve_up specstruct "$OUT/specstruct.yaml" 18433; then
    python3 scripts/spec-structured-check.py http://127.0.0.1:18433 >"$OUT/specstruct.txt" 2>&1
    note "structured output under speculative decoding rc=$?: $(tr '\n' ' ' <"$OUT/specstruct.txt" | head -c 900)"
    serve_down
  fi
fi

if has kvoffload && [ -n "$MODEL" ] && [ -f "$MODEL" ]; then
  kv_serve() { # name, host GiB, blocks, extra YAML line
    cat >"$OUT/kv-$1.yaml" <<YAML
model: { path: $MODEL, backend: ${SERVE_BACKEND:-cuda} }
server: { host: 127.0.0.1, port: 18432 }
cache: { block_size: 16, num_blocks: $3, kv_offloading_size: $2 }
$4
YAML
    serve_up "kv-$1" "$OUT/kv-$1.yaml" 18432
  }
  # Prompt A, three prompts that evict its blocks from a cache of KV_BLOCKS, A again. A tier
  # of 0.02 GiB (58 SmolLM2 blocks) holds every block they compute: stored ahead of eviction
  # once computed (the default), 36 blocks overflow 0.01 GiB's 29 and A's last ones leave it.
  for gib in 0.02 0; do
    if kv_serve "a-$gib" "$gib" "${KV_BLOCKS:-24}" "scheduler: { max_num_seqs: 4, max_num_batched_tokens: 512 }"; then
      note "kvoffload (tier $gib GiB, ${KV_BLOCKS:-24} blocks): $(python3 - <<'PY' 2>&1 | tail -2
import json, urllib.request
base = "http://127.0.0.1:18432"
mid = json.load(urllib.request.urlopen(base + "/v1/models"))["data"][0]["id"]
def complete(ids):
    body = json.dumps({"model": mid, "prompt": ids, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
    r = json.load(urllib.request.urlopen(req))
    return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]
a = list(range(2000, 2096))
first, _ = complete(a)
for k in range(3):
    complete([5000 + 1000 * k + i for i in range(160)])
again, cached = complete(a)
m = [l for l in urllib.request.urlopen(base + "/metrics").read().decode().splitlines()
     if l.startswith("switchyard:kv_offload")]
print(f"A again: cached_tokens {cached} (80 = every whole block but the last), same answer "
      f"{first == again} ({first!r}); {'; '.join(m)}")
PY
)"
      serve_down
    fi
  done
  # The Mooncake trace's prefix reuse through HTTP, with a host tier and without.
  trace=${TRACE:-../shared/traces/synthetic_trace.jsonl}
  [ -f "$trace" ] || trace=shared/traces/synthetic_trace.jsonl
  if [ -f "$trace" ]; then
    for gib in "${KV_BENCH_GIB:-4}" 0; do
      if kv_serve "bench-$gib" "$gib" "${KV_BENCH_BLOCKS:-2048}" ""; then
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-240}" "$SY" bench serve --base-url http://127.0.0.1:18432 \
          --dataset mooncake --dataset-path "$trace" \
          ${KV_BENCH_ARGS:---mooncake-block-tokens 64 --num-prompts 1000 --max-output-len 32 --max-concurrency 32} \
          --result-file "$OUT/kv-bench-$gib.json" >"$OUT/kv-bench-$gib.txt" 2>&1
        rc=$?
        note "kvoffload bench (tier $gib GiB, ${KV_BENCH_BLOCKS:-2048} blocks) rc=$rc: $(python3 -c "
import json; d = json.load(open('$OUT/kv-bench-$gib.json'))
keys = ['completed', 'failed', 'duration', 'request_throughput', 'output_throughput',
        'total_token_throughput', 'median_ttft_ms', 'p99_ttft_ms', 'median_tpot_ms',
        'total_input_tokens', 'total_cached_prompt_tokens', 'cached_prompt_token_fraction',
        'trace_reusable_fraction']
print({k: d.get(k) for k in keys})" 2>&1 | head -c 900); $(curl -s http://127.0.0.1:18432/metrics | grep -E '^switchyard:kv_offload|^switchyard:prefix_cache_(hits|queries)_total' | tr '\n' ' ')"
        serve_down
      fi
    done
  else
    note "kvoffload bench: no trace at $trace"
  fi
fi

if has kvbench; then
  # The host tier offline on a large model: `bench throughput --dataset mooncake` on random
  # Llama-3-8B weights (KVB_MODEL) with a cache of KVB_BLOCKS blocks, a tier of each KVB_GIB
  # (0: none; GIB:evict copies at eviction only), KVB_ARGS rows.
  trace=${TRACE:-../shared/traces/synthetic_trace.jsonl}
  [ -f "$trace" ] || trace=shared/traces/synthetic_trace.jsonl
  [ -f "$trace" ] || trace="$BIN/synthetic_trace.jsonl"
  for spec in ${KVB_GIB:-0 32 32:evict}; do
    gib=${spec%%:*}
    mode=()
    store=auto
    sb=()
    name="kvbench-${gib}gib"
    case "$spec" in
      *:evict) mode=(--kv-offloading-on-eviction); name="$name-evict" ;;
      *:dmastore) store=dma; name="$name-dmastore" ;;
      *:sb*) sb=("SWITCHYARD_CUDA_KV_STORE_BLOCKS=${spec##*:sb}"); name="$name-sb${spec##*:sb}" ;;
    esac
    t0=$SECONDS
    # shellcheck disable=SC2086
    env SWITCHYARD_CUDA_KV_STORE=$store "${sb[@]}" timeout "${KVB_TIMEOUT:-280}" "$SY" bench throughput --backend cuda --json --dummy "${KVB_MODEL:-llama-3-8b}" \
      --dataset mooncake --dataset-path "$trace" --num-kv-blocks "${KVB_BLOCKS:-2048}" \
      --kv-offloading-size "$gib" "${mode[@]}" ${KVB_ARGS:---num-prompts 2000 --mooncake-block-tokens 64 --max-input-len 1536 --max-output-len 16} \
      >"$OUT/$name.json" 2>"$OUT/$name.log"
    rc=$?
    j="$OUT/$name.json"
    note "$(printf '%-24s rc=%s %4ss elapsed_s=%s total_tok/s=%s cached=%s of reusable=%s loaded=%s stored=%s ahead=%s' "$name" "$rc" \
      $((SECONDS - t0)) "$(field "$j" elapsed_time)" "$(field "$j" tokens_per_second)" "$(field "$j" cached_prompt_fraction)" \
      "$(field "$j" trace_reusable_fraction)" "$(field "$j" kv_offload_loaded_blocks)" "$(field "$j" kv_offload_stored_blocks)" \
      "$(field "$j" kv_offload_stored_ahead_blocks)")"
    [ $rc -ne 0 ] && tail -5 "$OUT/$name.log" | tee -a "$summary"
  done
fi

if has kvcopy; then
  # Copies between the KV cache and the host tier (gpu/benches/cuda_kv_copy.rs: cargo bench
  # --features cuda -p switchyard-gpu --bench cuda_kv_copy --no-run, its binary in BIN).
  kvb=$(ls "$BIN"/cuda_kv_copy* 2>/dev/null | grep -v '\.d$' | grep -v '\.gz$' | head -1)
  if [ -n "$kvb" ]; then
    timeout "${KVCOPY_TIMEOUT:-300}" "$kvb" --bench >"$OUT/kvcopy.log" 2>&1
    note "kvcopy rc=$?: $(grep -E '^kv_copy|thrpt' "$OUT/kvcopy.log" | paste - - | sed -E 's/ +/ /g' | tr '\n' ';')"
  else
    note "kvcopy: no cuda_kv_copy binary in $BIN"
  fi
fi

if has ab; then
  # Interleaved A/B of builds in one lease (machines of one type differ by a few percent, so
  # compare within a call): AB_BINS (folders holding a switchyard build, packed or not) take
  # turns on each AB_SPECS entry (name=bench-throughput-arguments with commas for spaces),
  # AB_ROUNDS times; one line per run.
  for d in ${AB_BINS:-}; do
    d=${d%%@*}
    for f in "$d"/*.gz; do
      [ -e "$f" ] || continue
      gunzip -c "$f" >"${f%.gz}" && chmod +x "${f%.gz}"
    done
  done
  specs=${AB_SPECS:-"llama-b1=--dummy,llama-3-8b,--decode-batch,1,--input-len,128,--output-len,256 llama-b64=--dummy,llama-3-8b,--decode-batch,64,--input-len,128,--output-len,128 llama-b256=--dummy,llama-3-8b,--decode-batch,256,--input-len,128,--output-len,128 smol-b1=--dummy,smollm2-135m,--decode-batch,1,--input-len,128,--output-len,256 smol-b256=--dummy,smollm2-135m,--decode-batch,256,--input-len,128,--output-len,128 llama-offline=--dummy,llama-3-8b,--num-prompts,2000,--input-len,128,--output-len,128,--max-num-seqs,2048,--max-num-batched-tokens,32768"}
  for r in $(seq 1 "${AB_ROUNDS:-2}"); do
    for spec in $specs; do
      args=${spec#*=}
      for d in ${AB_BINS:-}; do
        envs=""
        [[ $d == *@* ]] && envs=${d#*@}
        label=$(basename "${d%%@*}")${envs:+-${envs//[=,]/_}}
        # shellcheck disable=SC2086
        (SY="${d%%@*}/switchyard"; [ -n "$envs" ] && export ${envs//,/ }
         bench "ab-${spec%%=*}-$label-$r" ${args//,/ })
      done
    done
  done
fi

if has signals; then
  # A checkpoint whose CUDA load lasts seconds, so signals land in its phases (device set-up,
  # weights read and uploaded, kernels, graphs, the KV cache).
  smodel=${SIGNAL_MODEL:-/tmp/switchyard-ref-llama3-8b-L${SIGNAL_LAYERS:-8}}
  if [ -z "${SIGNAL_MODEL:-}" ] && [ ! -f "$smodel/config.json" ]; then
    PYTHONUNBUFFERED=1 timeout "${REF_TIMEOUT:-400}" python3 gpu/reference/ref_logits.py \
      --layers "${SIGNAL_LAYERS:-8}" --out-dir "$smodel" --reuse-weights --no-bf16-check \
      >"$OUT/signals-model.log" 2>&1 || note "signals: ref_logits.py rc=$?"
  fi
  cat >"$OUT/signals.yaml" <<EOF2
model: { path: $smodel, backend: ${SERVE_BACKEND:-cuda}, served_name: m }
server: { host: 127.0.0.1, port: 18434 }
cache: { gpu_memory_utilization: 0.5 }
EOF2
  echo '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}}' \
    >"$OUT/signals-in.jsonl"
  now() { date +%s.%N; }
  # Commands started with `&` from a script inherit SIGINT ignored, which the commands keep
  # (as a user's `cmd &` in a script would): start them with its default disposition.
  dflt=(env --default-signal=INT)
  "${dflt[@]}" true 2>/dev/null || { note "signals: env --default-signal unsupported; SIGINT rows may read as ignored"; dflt=(); }
  # The load's length: serve until its `serving url=` line (the kernel cache warm after the
  # first), then a whole run-batch of one line.
  load_s=
  for i in 1 2; do
    "${dflt[@]}" "$SY" serve --config "$OUT/signals.yaml" >"$OUT/signals-load-$i.log" 2>&1 &
    pid=$!; t0=$(now)
    for _ in $(seq 1 1200); do
      grep -q "serving url=" "$OUT/signals-load-$i.log" && break
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.05
    done
    load_s=$(python3 -c "print(f'{$(now) - $t0:.2f}')")
    kill -INT "$pid"; wait "$pid"
    note "signals: serve load $i ${load_s} s, then SIGINT when serving: rc=$? ($(tail -1 "$OUT/signals-load-$i.log" | cut -c1-160))"
  done
  # Whole runs without a signal (SIGNAL_RUNS of them): each must exit 0 with its line written.
  for i in $(seq 1 "${SIGNAL_RUNS:-5}"); do
    t0=$(now)
    "$SY" run-batch --config "$OUT/signals.yaml" -i "$OUT/signals-in.jsonl" -o "$OUT/signals-full-$i.jsonl" \
      >"$OUT/signals-full-$i.log" 2>&1
    note "signals: run-batch $i without a signal rc=$? in $(python3 -c "print(f'{$(now) - $t0:.2f}')") s, $(wc -l <"$OUT/signals-full-$i.jsonl" 2>/dev/null || echo no) output line(s)"
  done
  # A signal at each fraction of the load: exit status, seconds from the signal to the exit,
  # files left, and whether the log shows a panic or a crash.
  for frac in ${SIGNAL_AT:-0.05 0.2 0.4 0.6 0.8 0.95}; do
    for cmd in serve run-batch; do
      for sig in INT TERM; do
        name="signals-$cmd-$sig-$frac"
        rm -f "$OUT/$name.jsonl" "$OUT/$name.jsonl.partial"
        delay=$(python3 -c "print($frac * $load_s)")
        if [ $cmd = serve ]; then
          "${dflt[@]}" "$SY" serve --config "$OUT/signals.yaml" >"$OUT/$name.log" 2>&1 &
        else
          "${dflt[@]}" "$SY" run-batch --config "$OUT/signals.yaml" -i "$OUT/signals-in.jsonl" \
            -o "$OUT/$name.jsonl" >"$OUT/$name.log" 2>&1 &
        fi
        pid=$!
        sleep "$delay"
        t0=$(now)
        kill -s "$sig" "$pid"
        (sleep 60; kill -KILL "$pid" 2>/dev/null) &
        dog=$!
        wait "$pid"; rc=$?
        dt=$(python3 -c "print(f'{$(now) - $t0:.2f}')")
        kill "$dog" 2>/dev/null; wait "$dog" 2>/dev/null
        left=$(ls "$OUT/$name.jsonl" "$OUT/$name.jsonl.partial" 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')
        bad=$(grep -c -i -E "panicked|segmentation|core dumped|double free|abort|CUDA_ERROR" "$OUT/$name.log")
        note "$(printf 'signals: %-9s SIG%-4s at %4.2f of the load: rc=%-3s exit %5ss after, files left: %s, panics/crashes: %s; %s' \
          "$cmd" "$sig" "$frac" "$rc" "$dt" "${left:-none}" "$bad" "$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-150)")"
      done
    done
  done
  note "signals: processes on the GPU after: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
fi

if has hf && [ -f gpu/reference/hf_bench.py ]; then
  timeout "${HF_TIMEOUT:-300}" python3 gpu/reference/hf_bench.py ${HF_ARGS:-} >"$OUT/hf_bench.log" 2>&1
  note "hf_bench rc=$?: $(tail -c 600 "$OUT/hf_bench.log" | tr '\n' ' ')"
fi

echo
cat "$summary"
# The device tool brings back at most 8 files: ARCHIVE=path (outside OUT) packs every log and
# JSON into one.
if [ -n "${ARCHIVE:-}" ]; then
  tar -czf "$ARCHIVE" -C "$OUT" --exclude=kernel-cache . && echo "archive: $ARCHIVE"
fi
