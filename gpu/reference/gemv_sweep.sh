#!/bin/bash
# Builds gemv_sweep.cu with nvcc on a GPU host and runs it, once per VARIANTS entry (default
# base): base = gpu/kernels/gemv.cu as is; s4 / s12 = 4 / 12 k-steps per batch of loads in the
# plain kernels (8 in the source); mb2 = two resident blocks per SM asked of the plain kernels;
# pipe = two register buffers of 4 k-steps (2 for the norm and multi-group kernels), the next
# batch's loads in flight during this batch's products (GEMV_PIPELINE).
set -u
cd "$(dirname "$0")"
export PATH=/usr/local/cuda/bin:$PATH
for v in ${VARIANTS:-base}; do
  src=/tmp/gemv_$v.cu
  cp ../kernels/gemv.cu $src
  extra=""
  case $v in
    s4) sed -i 's/? 4 : 8;/? 4 : 4;/' $src ;;
    s12) sed -i 's/? 4 : 8;/? 4 : 12;/' $src ;;
    pipe) sed -i 's/? 4 : 8;/? 2 : 4;/' $src; extra="-DGEMV_PIPELINE=1" ;;
    mb2) sed -i 's/GEMV_KERNEL(gemv, false, false, NG, 1)/GEMV_KERNEL(gemv, false, false, NG, 2)/; s/GEMV_KERNEL(gemv_glu, true, false, NG, 1)/GEMV_KERNEL(gemv_glu, true, false, NG, 2)/' $src ;;
  esac
  nvcc -O3 -std=c++17 -arch=sm_90a -lineinfo -Xptxas -v -DGEMV_SRC="\"$src\"" $extra gemv_sweep.cu -o /tmp/sweep_$v -lcublas 2>/tmp/ptxas_$v.txt || { cat /tmp/ptxas_$v.txt; continue; }
  grep -A2 "entry function '\(gemv_1\|gemv_glu_1\|gemv_norm_glu_1\|gemv_norm_1\)'" /tmp/ptxas_$v.txt | grep -E "entry|Used"
  echo "=== variant $v"; /tmp/sweep_$v
done
