#!/usr/bin/env bash
# Compiles the CUDA kernels with NVRTC and assembles them with ptxas for the architectures
# given (default sm_90 sm_80), on any x86-64 Linux machine, GPU or not: CI runs it so that a
# kernel that does not compile is caught before a GPU host sees it. NVRTC, the CUDA headers and
# ptxas come from NVIDIA's PyPI wheels (pinned below), fetched once into
# ~/.cache/switchyard/cuda-tools.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${SWITCHYARD_CUDA_TOOLS:-$HOME/.cache/switchyard/cuda-tools}
wheels=(nvidia-cuda-nvrtc-cu12==12.9.86 nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86)
if [ ! -x "$dir/nvidia/cuda_nvcc/bin/ptxas" ] || [ ! -f "$dir/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ] \
  || [ ! -f "$dir/nvidia/cuda_runtime/include/cuda_bf16.h" ]; then
  mkdir -p "$dir/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_12_x86_64 -d "$dir/wheels" "${wheels[@]}"
  for w in "$dir"/wheels/*.whl; do
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$w" "$dir"
  done
  chmod +x "$dir/nvidia/cuda_nvcc/bin/ptxas"
  rm -rf "$dir/wheels"
fi
if [ $# -eq 0 ]; then set -- sm_90 sm_80; fi
python3 scripts/check-kernels.py "$dir" "$@"
