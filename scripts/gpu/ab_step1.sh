#!/usr/bin/env bash
# A/B of the SSD twin's fill loops on one machine (after scripts/gpu/install.sh): the SSD steps
# as committed, then with step 1's (then step 3's) fill loops not unrolled (the source edited in
# place and restored; MLX compiles the changed kernel anew). Prints ssd_steps.py's JSON lines.
set -uo pipefail
echo "== as committed"; python3 scripts/gpu/ssd_steps.py 2048
cp cuda_src/ssd_chunk_state.cu /tmp/ssd_chunk_state.cu.orig
sed -i 's|^#pragma unroll  // loads issued together|// no unroll|' cuda_src/ssd_chunk_state.cu
echo "== step 1 fill loops not unrolled"; python3 scripts/gpu/ssd_steps.py 2048
cp /tmp/ssd_chunk_state.cu.orig cuda_src/ssd_chunk_state.cu
cp cuda_src/ssd_chunk_out.cu /tmp/ssd_chunk_out.cu.orig
sed -i 's|^#pragma unroll  // loads issued together|// no unroll|' cuda_src/ssd_chunk_out.cu
echo "== step 3 fill loops not unrolled"; python3 scripts/gpu/ssd_steps.py 2048
cp /tmp/ssd_chunk_out.cu.orig cuda_src/ssd_chunk_out.cu
