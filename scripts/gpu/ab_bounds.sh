#!/usr/bin/env bash
# A/B of register bounds for the SSD twin's tensor-core steps on one machine (after
# scripts/gpu/install.sh): the steps as committed, then with __launch_bounds__(256, MINB) on
# steps 1 and 3 (a __global__ macro appended to ssd_mma.cuh in place, restored after; MLX builds
# the changed kernels anew). Usage: bash scripts/gpu/ab_bounds.sh "T ..." MINB...; prints
# ssd_steps.py's JSON lines.
set -uo pipefail
TS=${1:-2048}; shift
echo "== as committed"; python3 scripts/gpu/ssd_steps.py $TS
cp cuda_src/ssd_mma.cuh /tmp/ssd_mma.cuh.orig
for m in "$@"; do
  cp /tmp/ssd_mma.cuh.orig cuda_src/ssd_mma.cuh
  printf '#undef __global__\n#define __global__ __location__(global) __launch_bounds__(256, %s)\n' "$m" >> cuda_src/ssd_mma.cuh
  echo "== __launch_bounds__(256, $m)"; python3 scripts/gpu/ssd_steps.py $TS
done
cp /tmp/ssd_mma.cuh.orig cuda_src/ssd_mma.cuh
