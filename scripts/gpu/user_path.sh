#!/usr/bin/env bash
# The user's-path GPU group (mlx_bricks.bench.user_path) on the lent GPU machine, in one call:
# installs MLX's CUDA wheels (scripts/gpu/install.sh), then writes the models (random weights,
# GPU_LAYERS layers each) and runs them;
# JSON, Markdown table, plot and one log per process land in $OUT. docs/bench.md, "The user's path".
# Usage (the run tool, right after the call that carried .whlA, carry .whlB and .bench-tok):
#   bash scripts/gpu/user_path.sh [extra args of python -m mlx_bricks.bench.user_path]
# Env: BUDGET (seconds after which no further run starts; default 420: the call's 600 s limit
# holds the install, the run still going and the plot).
set -euo pipefail
BUDGET=${BUDGET:-420}
source scripts/gpu/install.sh
exec python3 -m mlx_bricks.bench.user_path --group gpu --tokenizer .bench-tok --budget-s "$BUDGET" \
  --out-dir "${OUT:?}" "$@"
