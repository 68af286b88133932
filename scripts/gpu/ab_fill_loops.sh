#!/usr/bin/env bash
# A/B of the SSD twin's fill loops on one machine (after scripts/gpu/install.sh): the SSD steps
# as committed, then with bricks::fill (cuda_src/ssd_mma.cuh: the slice fills of steps 1 and 3)
# not unrolled (the header edited in place and restored; MLX compiles the changed kernels
# anew). Prints ssd_steps.py's JSON lines. (Until 2026-12-07 each fill was its own loop:
# bench/results/2026-12-07-h100-ssd-mma/ab_fill_loops.log came from that version.)
set -uo pipefail
echo "== as committed"; python3 scripts/gpu/ssd_steps.py 2048
cp cuda_src/ssd_mma.cuh /tmp/ssd_mma.cuh.orig
sed -i 's|^#pragma unroll  // loads issued together|// no unroll|' cuda_src/ssd_mma.cuh
grep -q "^// no unroll" cuda_src/ssd_mma.cuh || { echo "the fill's pragma was not found"; exit 2; }
echo "== fill loops not unrolled"; python3 scripts/gpu/ssd_steps.py 2048
cp /tmp/ssd_mma.cuh.orig cuda_src/ssd_mma.cuh
