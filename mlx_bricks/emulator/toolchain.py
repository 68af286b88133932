"""The bottom of the emulator: its error types, finding clang, and running it.

``source.py`` (MLX's generator and the MSL -> C++ translator) and ``compile.py`` (the compile,
the checks and the cache) both sit on this module; nothing here imports either of them, so the
translator never reaches back into the compiler driver.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from functools import lru_cache

from mlx_bricks import env

MIN_CLANG = 15


class EmulatorFault(RuntimeError):
    """A kernel did something a GPU would hide or punish: out-of-bounds access, an output
    element left unwritten, a result that depends on thread order (a race), a barrier reached
    by part of a threadgroup. The message names the kernel and the threads or elements."""


class EmulatorCompileError(EmulatorFault):
    """The kernel does not compile: an MSL error, an address-space mismatch, a rule of Apple's
    compiler the shim enforces (bfloat conversions, SIMD-group function types, 31 buffers), or
    an MSL feature the emulator does not provide (the message names it)."""


def _clang_version(path: str) -> tuple[int, str] | None:
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except OSError:
        return None
    m = re.search(r"clang version (\d+)", out)
    return (int(m.group(1)), out.splitlines()[0]) if m else None


@lru_cache(maxsize=None)
def find_clang() -> tuple[str | None, str]:
    """(path, version line) of a usable clang++ (>= 15), or (None, reason)."""
    try:
        env_clang = env.get("MLX_BRICKS_CLANG")
    except env.EnvError as e:
        return None, str(e)
    if env_clang:
        v = _clang_version(env_clang)
        if v is None:
            return None, f"MLX_BRICKS_CLANG={env_clang!r} is not a working clang++"
        if v[0] < MIN_CLANG:
            return None, f"MLX_BRICKS_CLANG={env_clang!r} is clang {v[0]}; need >= {MIN_CLANG}"
        return env_clang, v[1]
    candidates = ["clang++-19"] + [f"clang++-{n}" for n in range(25, MIN_CLANG - 1, -1) if n != 19]
    candidates.append("clang++")
    for name in candidates:
        path = shutil.which(name)
        if not path:
            continue
        v = _clang_version(path)
        if v and v[0] >= MIN_CLANG:
            return path, v[1]
    return None, (
        "clang++-19 not found (need clang >= 15 for _Float16); install Debian package clang-19 "
        "or set MLX_BRICKS_CLANG"
    )


def clang_or_raise() -> tuple[str, str]:
    """``find_clang()``, raising EmulatorCompileError with the reason when there is none."""
    clang, version = find_clang()
    if clang is None:
        raise EmulatorCompileError(version)
    return clang, version


def run(cmd: list[str], cwd=None, input: str | None = None) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured as text (never raises for a non-zero status)."""
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, input=input,
                          check=False)


_preprocessed: dict[tuple[str, str], tuple[str, str]] = {}


def preprocess(header: str, body: str) -> tuple[str, str]:
    """``header`` and ``body`` through clang's preprocessor, each keeping its line numbers
    (for kernels whose macros cast to a parameter: only the expansion shows the type).

    Raises:
        EmulatorCompileError: no clang, or the macros do not preprocess.
    """
    key = (header, body)
    if key in _preprocessed:
        return _preprocessed[key]
    clang, _ = clang_or_raise()
    text = f'#line 1 "header"\n{header}\n#line 1 "source"\n{body}\n'
    r = run([clang, "-std=c++17", "-E", "-x", "c++", "-"], input=text)
    if r.returncode != 0:
        raise EmulatorCompileError(f"the kernel's macros do not preprocess:\n{r.stderr}")
    out = r.stdout
    m = re.search(r'^# 1 "header".*$', out, re.M)
    n = re.search(r'^# 1 "source".*$', out, re.M)
    if not m or not n:
        raise EmulatorCompileError(f"unexpected preprocessor output:\n{out[:2000]}")
    result = (out[m.end() + 1 : n.start()], out[n.end() + 1 :])
    _preprocessed[key] = result
    return result
