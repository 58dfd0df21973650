#!/usr/bin/env bash
# Packs what a run on a remote GPU host needs into folders git ignores, small enough for a
# transfer limit of 64 MiB per call (such as this workplace's device tool):
#   .devbench/NAME/  switchyard, the cuda_backend test binary and the cuda_kv_copy benchmark,
#                    gzip-compressed (about 16 MB;
#                    scripts/gpu-check.sh unpacks *.gz found in BIN)
#   .devmodel/part1, .devmodel/part2 (with MODEL_SPLIT=1)
#                    the SmolLM2 GGUF (98 MB) in two pieces (50 + 48 MB, so each fits a call
#                    beside one or two builds), for two calls in quick succession: the first
#                    copies part1 to the host's disk, the second joins it with part2 while the
#                    machine is still warm (`mkdir -p /tmp/m && cat /root/part1 .devmodel/part2
#                    > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf`: the GGUF tests look for that
#                    name; sha256 in gpu/tests/fixtures/smollm2_golden.json).
# usage: scripts/devbench-pack.sh [NAME]   (NAME defaults to the current branch)
set -euo pipefail
cd "$(dirname "$0")/.."
name=${1:-$(git rev-parse --abbrev-ref HEAD)}
for d in .devbench .devmodel; do
  git check-ignore -q "$d/x" || { echo "$d is not ignored by git" >&2; exit 1; }
done
cargo build --release --features cuda --bin switchyard
test_bin=$(cargo test --release --features cuda -p switchyard-gpu --test cuda_backend --no-run \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "cuda_backend" and m.get("executable"):
        print(m["executable"])')
[ -x "$test_bin" ] || { echo "no cuda_backend test binary" >&2; exit 1; }
# The host KV tier's copy benchmark (gpu-check.sh section kvcopy).
kv_bin=$(cargo bench --features cuda -p switchyard-gpu --bench cuda_kv_copy --no-run \
  --message-format=json 2>/dev/null | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "cuda_kv_copy" and m.get("executable"):
        print(m["executable"])')
[ -x "$kv_bin" ] || { echo "no cuda_kv_copy benchmark binary" >&2; exit 1; }
out=.devbench/$name
rm -rf "$out" && mkdir -p "$out"
gzip -c "${CARGO_TARGET_DIR:-target}/release/switchyard" >"$out/switchyard.gz"
gzip -c "$test_bin" >"$out/$(basename "$test_bin").gz"
gzip -c "$kv_bin" >"$out/$(basename "$kv_bin").gz"
echo "$out: $(du -sh "$out" | cut -f1) ($(git rev-parse --short HEAD))"
if [ "${MODEL_SPLIT:-0}" = 1 ]; then
  gguf=${MODEL:-$HOME/.cache/switchyard/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf}
  [ -f "$gguf" ] || { echo "no GGUF at $gguf (cargo run --release -- model fetch smollm2-135m)" >&2; exit 1; }
  mkdir -p .devmodel
  head -c 50000000 "$gguf" >.devmodel/part1
  tail -c +50000001 "$gguf" >.devmodel/part2
  cat .devmodel/part1 .devmodel/part2 | cmp - "$gguf"
  ls -l .devmodel
fi
