#!/usr/bin/env bash
# A/B of CUDA twin sources on one machine (after scripts/gpu/install.sh): runs COMMAND with the
# working tree's cuda_src, then with the files of OLD_DIR copied over (restored after), ROUNDS
# times alternating (MLX compiles the changed kernels anew: the source is part of the name).
# Usage: bash scripts/gpu/ab_sources.sh OLD_DIR ROUNDS COMMAND...
set -uo pipefail
old=$1 rounds=$2; shift 2
keep=$(mktemp -d)
for f in "$old"/*; do cp "cuda_src/$(basename "$f")" "$keep/"; done
for r in $(seq "$rounds"); do
  echo "== new (round $r)"; "$@"
  cp "$old"/* cuda_src/
  echo "== old (round $r)"; "$@"
  cp "$keep"/* cuda_src/
done
