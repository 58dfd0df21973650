#!/bin/bash
# Builds gemv_sweep.cu with nvcc on a GPU host and runs it, once per VARIANTS entry (default
# base): base = gpu/kernels/gemv.cu as is; s2 / s8 = 2 / 8 k-steps per batch of loads (4 in the
# source; 8 was the source before v5); mb2 = two resident blocks per SM asked of the plain
# kernels; def-NAME=VALUE[,NAME=VALUE] = the source as is, built with those definitions (e.g.
# def-GEMV_PF_STEPS=16). SWEEP_ONLY (shape names) and SWEEP_HOST=1 (the host's launch shape only)
# narrow the sweep; SWEEP_PROBES_ONLY=1 runs the memory probes alone, SWEEP_NO_PROBES=1 leaves
# them out; SWEEP_MODEL picks the model whose shapes are swept (see gemv_sweep.cu).
set -u
cd "$(dirname "$0")"
export PATH=/usr/local/cuda/bin:$PATH
for v in ${VARIANTS:-base}; do
  src=/tmp/gemv_$v.cu
  cp ../kernels/gemv.cu $src
  defs=""
  case $v in
    def-*) defs=$(echo "${v#def-}" | tr ',' '\n' | sed 's/^/-D/' | tr '\n' ' ') ;;
    s2) sed -i 's/constexpr int STEPS = F8 ? GEMV_F8_STEPS : 4;/constexpr int STEPS = F8 ? GEMV_F8_STEPS : 2;/' $src ;;
    s8) sed -i 's/constexpr int STEPS = F8 ? GEMV_F8_STEPS : 4;/constexpr int STEPS = F8 ? GEMV_F8_STEPS : (NORM || NG > 1) ? 4 : 8;/' $src ;;
    mb2) sed -i 's/GEMV_KERNEL(gemv, false, false, false, false, NG, 1)/GEMV_KERNEL(gemv, false, false, false, false, NG, 2)/; s/GEMV_KERNEL(gemv_glu, false, true, false, false, NG, 1)/GEMV_KERNEL(gemv_glu, false, true, false, false, NG, 2)/' $src ;;
  esac
  cmp -s ../kernels/gemv.cu $src && [ "$v" != base ] && [ -z "$defs" ] && { echo "variant $v: the edit did not apply"; continue; }
  nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Xptxas -v $defs -DGEMV_SRC="\"$src\"" gemv_sweep.cu -o /tmp/sweep_$v -lcublas 2>/tmp/ptxas_$v.txt || { cat /tmp/ptxas_$v.txt; continue; }
  grep -A2 "entry function '\(gemv_1\|gemv_glu_1\|gemv_norm_glu_1\|gemv_norm_1\)'" /tmp/ptxas_$v.txt | grep -E "entry|Used"
  echo "=== variant $v"; /tmp/sweep_$v
done
