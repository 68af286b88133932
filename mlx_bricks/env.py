"""The environment variables of mlx-bricks, in one table: what each sets, the values it takes and
its default (docs/cli.md lists them from here).

Each module reads its variable through :func:`get`, which checks the value at every read (a
variable may change between calls, as the tests change it): a bad value is an
:class:`EnvError` that names the variable and what it takes. The command-line tools check
every variable that is set before any work (``_cli.run_cli`` calls :func:`check`), so a typo
is one line and exit 2, not a traceback after the model has loaded. An empty value counts as
unset. Standard library only: any floor may import it.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlx_bricks.options import BACKENDS, SWIGLU_VARIANTS, parse_cap

#: Values that turn a switch off / on (any case).
OFF = ("0", "off", "false", "no")
ON = ("1", "on", "true", "yes")


class EnvError(ValueError):
    """A bad value of an mlx-bricks environment variable; the message names the variable, its
    value and what it takes."""


@dataclass(frozen=True)
class Variable:
    """One environment variable.

    Attributes:
        name: ``MLX_BRICKS_...``.
        what: what it sets, one line.
        takes: the values it takes, in words (the error says "expected" this).
        parse: ``parse(value) -> object`` for a non-empty, stripped value; ``ValueError`` or
            ``TypeError`` for a bad one.
        default: what :func:`get` returns when the variable is unset or empty.
    """

    name: str
    what: str
    takes: str
    parse: Callable[[str], object]
    default: object = None


def _choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(text)
        return text
    return parse


def _switch(text: str) -> bool:
    if text.lower() in OFF:
        return False
    if text.lower() in ON:
        return True
    raise ValueError(text)


def _cuda_cache(text: str) -> str:
    low = text.lower()
    if low in OFF:
        return "off"
    if low in ("precompiled", "mlx") or low in ON:
        return "precompiled" if low == "precompiled" else "mlx"
    raise ValueError(text)


def _perturb(text: str) -> int:
    low = text.lower()
    if low in OFF:
        return 0
    if low in ON:
        return 1
    seed = int(low)
    if not 0 <= seed < 2**32:
        raise ValueError(text)
    return seed


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise ValueError(text)
    return n


def _directory(text: str) -> Path:
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(text)
    return path


def _file(text: str) -> str:
    if not Path(text).expanduser().is_file():
        raise ValueError(text)
    return text


def _program(text: str) -> str:
    if not (Path(text).expanduser().is_file() or shutil.which(text)):
        raise ValueError(text)
    return text


def _cap(text: str) -> int:
    return parse_cap(text, "MLX_BRICKS_DEQUANT_CAP")


#: Every variable mlx-bricks reads, by name.
VARIABLES: dict[str, Variable] = {v.name: v for v in (
    Variable("MLX_BRICKS_BACKEND", "the bricks' backend when no argument or flag names one",
             f"one of {', '.join(BACKENDS)}", _choice(*BACKENDS)),
    Variable("MLX_BRICKS_HOME", "where the default model, converted GGUF files, tuning "
             "decisions and compiled CUDA kernels are kept (unset: ~/.cache/mlx_bricks)",
             "a directory (created when needed)", _directory),
    Variable("MLX_BRICKS_DEQUANT_CAP", "the dequantize composites' cap on transient float "
             "weights, MiB (unset: the smaller of 256 MiB and 1/32 of the model's weights)",
             "a number of MiB above 0", _cap),
    Variable("MLX_BRICKS_SWIGLU_VARIANT", "the SwiGLU brick's variant (unset: the brick's rule)",
             f"one of {', '.join(SWIGLU_VARIANTS)}", _choice(*SWIGLU_VARIANTS)),
    Variable("MLX_BRICKS_CUDA_CACHE", "the CUDA build cache: off, mlx (MLX's JIT disk cache) or "
             "precompiled (mx.fast.precompiled_cuda_kernel)",
             f"one of {', '.join(OFF)} (off), mlx, {', '.join(ON)} (mlx) or precompiled",
             _cuda_cache, "mlx"),
    Variable("MLX_BRICKS_NVRTC", "the libnvrtc the CUDA build cache compiles with",
             "the path of a file", _file),
    Variable("MLX_BRICKS_CLANG", "the clang++ (>= 15) of the MSL emulator",
             "a file or a command on PATH", _program),
    Variable("MLX_BRICKS_EMULATOR_CHECKS", "the emulator's bounds, unwritten-output and "
             "schedule checks", f"one of {', '.join(ON)} (on) or {', '.join(OFF)} (off)",
             _switch, True),
    Variable("MLX_BRICKS_EMULATOR_OPT", "the optimisation level of emulated kernels",
             "one of 0, 1, 2, 3", _choice("0", "1", "2", "3"), "1"),
    Variable("MLX_BRICKS_EMULATOR_PERTURB", "the emulator's perturbed runs (a seed)",
             f"{', '.join(OFF)} (off), {', '.join(ON[1:])} (seed 1) or a seed 1..2**32-1",
             _perturb, 0),
    Variable("MLX_BRICKS_EMULATOR_THREADS", "threads running emulated threadgroups (unset: "
             "up to 4)", "a positive integer", _positive_int),
    Variable("MLX_BRICKS_BENCH_WORK", "where the user-path benchmark writes its model "
             "directories (unset: a temporary directory)", "a directory (created when needed)",
             _directory),
)}


def _variable(name: str) -> Variable:
    try:
        return VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name!r} is not an mlx-bricks environment variable; known: "
                       f"{', '.join(VARIABLES)}") from None


def get(name: str, environ=None):
    """The value of variable ``name`` (a key of :data:`VARIABLES`), parsed; its default when
    it is unset or empty. Read at each call from ``environ`` (default ``os.environ``).

    Raises:
        EnvError: a bad value (the message names the variable and what it takes).
        KeyError: ``name`` is not in :data:`VARIABLES`.
    """
    var = _variable(name)
    raw = (os.environ if environ is None else environ).get(name, "")
    text = raw.strip()
    if not text:
        return var.default
    try:
        return var.parse(text)
    except (ValueError, TypeError):
        raise EnvError(f"{name}={raw!r}: expected {var.takes}") from None


def check(environ=None) -> None:
    """Check every variable of :data:`VARIABLES` that is set (what a command does before any
    work).

    Raises:
        EnvError: one or more bad values, all named in one line.
    """
    bad = []
    for name in VARIABLES:
        try:
            get(name, environ)
        except EnvError as e:
            bad.append(str(e))
    if bad:
        raise EnvError("; ".join(bad))
