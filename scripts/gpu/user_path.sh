#!/usr/bin/env bash
# The user's-path GPU group (mlx_bricks.bench.user_path) on the lent GPU machine, in one call:
# installs MLX's CUDA wheels from /root/stash + .whlB unless `import mlx.core` already works
# there, makes /tmp/site a site directory (so `--use-bricks` works in mlx-lm's own CLIs as after
# `pip install`), then writes the models (random weights, GPU_LAYERS layers each) and runs them;
# JSON, Markdown table, plot and one log per process land in $OUT. docs/bench.md, "The user's path".
# Usage (the run tool, right after the call that carried .whlA, carry .whlB and .bench-tok):
#   bash scripts/gpu/user_path.sh [extra args of python -m mlx_bricks.bench.user_path]
# Env: BUDGET (seconds after which no further run starts; default 420: the call's 600 s limit
# holds the install, the run still going and the plot).
set -euo pipefail
BUDGET=${BUDGET:-420}
if ! PYTHONPATH=/tmp/site python3 -c "import mlx.core" 2>/dev/null; then
  cp .whlB/* /root/stash/
  (cd /root/stash && cat part_* > "$(cat NAME)" && python3 -m pip install -q --no-index --no-deps \
     --no-compile --target /tmp/site ./mlx_cuda_13-*.whl ./mlx-*.whl ./mlx_lm-*.whl)
fi
export PYTHONPATH=/tmp/site:$PWD
python3 -c "from mlx_bricks.entry.hook import PTH_LINE, PTH_NAME
open('/tmp/site/' + PTH_NAME, 'w').write(PTH_LINE)"
echo "import site; site.addsitedir('/tmp/site')" > /tmp/site/sitecustomize.py
python3 -c "import mlx.core as mx
print('cuda:', mx.cuda.is_available(), mx.device_info().get('device_name'))"
exec python3 -m mlx_bricks.bench.user_path --group gpu --tokenizer .bench-tok --budget-s "$BUDGET" \
  --out-dir "${OUT:?}" "$@"
