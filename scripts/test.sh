#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the default test suite (slow tests excluded; add
# `-m slow` or `-m ""` through PYTEST_ARGS to run them). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -m "not slow" -n "${PYTEST_WORKERS:-2}" ${PYTEST_ARGS:-} "$@"
