#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: generation through the bricks on the embedded
# default model (SmolLM2-135M-Instruct, converted from its GGUF on first use). Extra arguments go
# to mlx_lm.generate, e.g. --prompt "..." --max-tokens 64 --bricks-report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- --prompt "What is the capital of France?" --max-tokens 48
fi
exec .venv/bin/mlx_lm.generate --use-bricks --verbose True "$@"
