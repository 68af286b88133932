#!/usr/bin/env bash
# The two command-line tools (docs/cli.md), on the embedded default model unless a model is given.
set -euo pipefail

# 1. mlx_lm.generate with the bricks: every mlx_lm.generate flag, plus the --bricks-* ones.
mlx_lm.generate --use-bricks --prompt "What is the capital of France?" --max-tokens 32
mlx_lm.generate --use-bricks --bricks-backend reference --bricks-report \
    --prompt "Write a haiku about the sea." --max-tokens 32
# The same without the import hook (bricks on by default; --no-use-bricks for stock mlx-lm):
mlx_bricks.generate --prompt "What is the capital of France?" --max-tokens 32 --verbose False
mlx_bricks.generate --no-use-bricks --prompt "What is the capital of France?" --max-tokens 32 \
    --verbose False

# 2. Check the patch against stock mlx-lm and time the prefill both ways.
#    Exit status: 0 pass, 1 fail, 2 bad input.
python -m mlx_bricks.patch                                  # default model, text report
python -m mlx_bricks.patch ${MODEL_DIR:+"$MODEL_DIR"} --json --max-tokens 8 --repeats 1 \
    | python -c "import json, sys; f = json.load(sys.stdin); \
print(f['passed'], f['top1_agreement'], f['greedy_match'], round(f['prompt_tps_ratio'], 2))"
