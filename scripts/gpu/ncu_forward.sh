#!/usr/bin/env bash
# Kernel time per forward of the 4-layer Nemotron-3-Nano-shaped model (profile_forward.py),
# stock and patched, by ncu (gpu__time_duration of every kernel between cuProfilerStart and
# cuProfilerStop), summed per kernel (ncu_sum.py). After scripts/gpu/install.sh.
# Usage: OUT=DIR bash scripts/gpu/ncu_forward.sh [T] [forwards]
set -uo pipefail
T=${1:-8192}
F=${2:-1}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")"
# the patched model's tuning decisions measured first, outside ncu (its instrumentation makes
# the tuner's first measurements take minutes); the profiled run reads them from the cache
timeout 240 python3 profile_forward.py patched "$T" 0 > "$OUT/tune_$T.log" 2>&1
echo "tuning rc=$?"
for w in stock patched; do
  echo "=== $w T=$T ($(date +%T))"
  ncu --profile-from-start off --metrics gpu__time_duration.sum --csv \
    python3 profile_forward.py "$w" "$T" "$F" > "$OUT/ncu_${w}_$T.csv" 2> "$OUT/ncu_${w}_$T.err"
  echo "rc=$?"
  python3 ncu_sum.py "$OUT/ncu_${w}_$T.csv" "$F" | head -n 30 || tail -n 5 "$OUT/ncu_${w}_$T.err"
done
