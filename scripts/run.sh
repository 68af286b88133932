#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default model
# (SmolLM2-135M-Instruct, converted from its GGUF on first use):
#  1. mlx_lm.generate --use-bricks with the per-layer report. On a kernel backend (metal, cuda)
#     the prefill runs the bricks where they measured faster than stock on this device; without
#     one the model stays stock and the report says why.
#  2. Only without a kernel backend, when the MSL emulator is available: the real Metal kernels
#     of the whole prefill on the CPU, checked against stock (python -m mlx_bricks.patch
#     --backend emulator; a few minutes on 2 cores).
# Extra arguments go to mlx_lm.generate (step 1 only), e.g. --prompt "..." --max-tokens 64.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
    exec .venv/bin/mlx_lm.generate --use-bricks --verbose True "$@"
fi
.venv/bin/mlx_lm.generate --use-bricks --verbose True --bricks-report \
    --prompt "What is the capital of France?" --max-tokens 48
# Exit 0 when there is no kernel backend but the emulator runs here.
if .venv/bin/python -c '
import sys
from mlx_bricks.backends import backend_status as s
sys.exit(0 if not (s("metal")[0] or s("cuda")[0]) and s("emulator")[0] else 1)'; then
    echo >&2
    echo "run.sh: no kernel backend here, so the bricks were left stock above. Next: the real" \
        "Metal kernels of the default model's prefill, run on the CPU by the MSL emulator and" \
        "compared with stock (slow: an emulator, not a GPU; its speed figures mean nothing)." >&2
    exec .venv/bin/python -m mlx_bricks.patch --backend emulator \
        --prompt "The capital of France is" --ignore-chat-template --max-tokens 8 --repeats 1
fi
