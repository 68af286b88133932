#!/usr/bin/env bash
# Downloads the openai client and what it needs, as wheels for the lent GPU machine (Python
# 3.12, x86-64 Linux; its image has no openai), into .whl/ (git-ignored): the server bench
# (scripts/gpu/server_bench.sh) installs them there. The version is the one installed here.
# Usage, from the project root: bash scripts/gpu/client_wheels.sh [PYTHON]
set -euo pipefail
py=${1:-.venv/bin/python}
version=$("$py" -c "import openai; print(openai.__version__)")
"$py" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "openai==$version"
du -sh .whl
