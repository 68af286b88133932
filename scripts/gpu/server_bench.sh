#!/usr/bin/env bash
# The server bench's GPU group (mlx_bricks.bench.server --group gpu) on the lent GPU machine, in
# one call: installs MLX's CUDA wheels (scripts/gpu/install.sh) and the openai client (carried
# as wheels: the machine has none), then per model (Llama-3-8B 4-bit, Qwen3.5-35B-A3B 4-bit,
# gpt-oss-20b MXFP4 shapes, GPU_LAYERS layers, random weights) a stock and a --use-bricks
# mlx_lm.server: a chat growing 8k -> 32k tokens with the prompt cache, 4 concurrent requests;
# JSON, Markdown, plot and the servers' logs land in $OUT. docs/serving.md, "The server bench".
# Once, here: ../shared/tools/device-mlx-wheels; the .bench-tok folder (docs/bench.md, "The
# user's path"); bash scripts/gpu/client_wheels.sh (.whl: openai and its needs, about 6 MB).
# Usage (the run tool, right after the call that carried .whlA, carry .whlB .bench-tok .whl):
#   bash scripts/gpu/server_bench.sh [extra args of python -m mlx_bricks.bench.server]
# Env: BUDGET (seconds after which no phase starts; a model starts only with 200 s of it left;
# default 360: the call's 600 s limit holds the install, the phase still going and the report).
set -euo pipefail
BUDGET=${BUDGET:-360}
source scripts/gpu/install.sh
if ! python3 -c "import openai" 2>/dev/null; then
  if ! compgen -G ".whl/openai-*.whl" >/dev/null; then
    echo "server_bench: no openai here and no .whl/openai-*.whl: run scripts/gpu/client_wheels.sh here and carry .whl" >&2
    exit 3
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
fi
export PYTHONUNBUFFERED=1
exec python3 -m mlx_bricks.bench.server --group gpu --tokenizer .bench-tok --budget-s "$BUDGET" \
  --out-dir "${OUT:?}" "$@"
