"""MSL emulator: run the exact ``mx.fast.metal_kernel`` source on the CPU, with Metal semantics.

``metal_kernel(...)`` takes the arguments of ``mx.fast.metal_kernel`` and returns an object
called like MLX's kernels (``inputs=, grid=, threadgroup=, output_shapes=, output_dtypes=,
template=, init_value=, verbose=``); the outputs are ``mx.array``s computed eagerly on the CPU.

The kernel text is the one MLX 0.32 generates (``generate_source``); clang compiles it against
a shim of the Metal standard library; every GPU thread is a fiber, 32 to a SIMD-group, so
barriers, SIMD-group functions and ``simdgroup_matrix`` operations synchronise for real.

Fault finding (on by default; ``set_checks`` / ``checks`` / ``MLX_BRICKS_EMULATOR_CHECKS``)
raises ``EmulatorFault`` for: out-of-bounds device or threadgroup accesses, output elements left
unwritten, results that differ between two fiber schedules (a missing barrier), and barriers
reached by only part of a threadgroup. The perturbed mode (``checks(perturb=seed)``,
``MLX_BRICKS_EMULATOR_PERTURB``) varies what Metal may vary: subnormals, ``fast::`` errors,
accumulation orders. ``lint_kernel`` reports slow patterns. See ``docs/emulator.md``.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import sys
from dataclasses import dataclass, replace

import numpy as np

from mlx_bricks import env

from . import source as _source
from .compile import (
    COMPILE_SECONDS,
    EmulatorCompileError,
    EmulatorFault,
    compile_kernel,
    find_clang,
)

__all__ = [
    "metal_kernel",
    "generate_source",
    "lint_kernel",
    "is_available",
    "set_checks",
    "checks",
    "get_checks",
    "EmulatorFault",
    "EmulatorCompileError",
    "COMPILE_SECONDS",
]


# ---------------------------------------------------------------------------------------------
# Checks


@dataclass(frozen=True)
class Checks:
    """Which faults the emulator looks for.

    Attributes:
        bounds: device buffers and threadgroup arrays in guarded memory (out-of-bounds faults).
        unwritten: outputs poisoned before the run; elements still poisoned are reported.
        schedules: 2 runs every launch twice, threads (and threadgroups) in forward then in
            reverse order, and reports outputs that differ (a race); 1 runs it once.
        address_spaces: compile device/constant/threadgroup as distinct address spaces, so
            mismatches are compile errors as on Metal (False compiles the keywords away:
            mismatches pass, and overloads or specialisations on the address space collide).
        perturb: 0 (off), or the seed of the perturbed mode: float32 subnormals flushed to
            zero, ``fast::`` results anywhere within Metal's documented error bounds, and
            ``simd_sum``/``simd_product`` and ``simdgroup_multiply_accumulate`` accumulating in
            shuffled orders; each a freedom the MSL specification gives a GPU, so a kernel and
            its test tolerance should hold under it (``MLX_BRICKS_EMULATOR_PERTURB=<seed>``).
    """

    bounds: bool = True
    unwritten: bool = True
    schedules: int = 2
    address_spaces: bool = True
    perturb: int = 0


def _checks_from_env() -> Checks:
    perturb = env.get("MLX_BRICKS_EMULATOR_PERTURB")
    if not env.get("MLX_BRICKS_EMULATOR_CHECKS"):
        return Checks(bounds=False, unwritten=False, schedules=1, perturb=perturb)
    return Checks(perturb=perturb)


_checks = _checks_from_env()


def get_checks() -> Checks:
    """The checks in force."""
    return _checks


def set_checks(
    bounds: bool | None = None,
    unwritten: bool | None = None,
    schedules: int | None = None,
    address_spaces: bool | None = None,
    perturb: int | None = None,
) -> Checks:
    """Change the checks (arguments left None keep their value); returns the previous ones.

    Raises:
        ValueError: ``schedules`` not 1 or 2, ``perturb`` not a seed in [0, 2**32).
    """
    global _checks
    old = _checks
    new = old
    if bounds is not None:
        new = replace(new, bounds=bool(bounds))
    if unwritten is not None:
        new = replace(new, unwritten=bool(unwritten))
    if schedules is not None:
        if int(schedules) not in (1, 2):
            raise ValueError(f"schedules must be 1 or 2, got {schedules}")
        new = replace(new, schedules=int(schedules))
    if address_spaces is not None:
        new = replace(new, address_spaces=bool(address_spaces))
    if perturb is not None:
        if isinstance(perturb, bool) or not isinstance(perturb, int) or not 0 <= perturb < 2**32:
            raise ValueError(f"perturb must be 0 (off) or a seed in [1, 2**32), got {perturb!r}")
        new = replace(new, perturb=perturb)
    _checks = new
    return old


@contextlib.contextmanager
def checks(**kwargs):
    """``with checks(schedules=1): ...`` changes the checks for the block (same arguments as
    ``set_checks``)."""
    global _checks
    old = set_checks(**kwargs)
    try:
        yield _checks
    finally:
        _checks = old


def is_available():
    """Whether the emulator can run here: an ``Availability`` (``mlx_bricks._availability``) that is
    truthy only when a usable clang++ (>= 15) is installed on x86-64 Linux, and unpacks as
    ``ok, reason`` (the compiler found, or why not)."""
    from mlx_bricks._availability import Availability

    if not sys.platform.startswith("linux") or os.uname().machine not in ("x86_64", "AMD64"):
        return Availability(False, "the emulator runtime supports x86-64 Linux only")
    path, what = find_clang()
    if path is None:
        return Availability(False, what)
    return Availability(True, f"{path}: {what}")


def _threads() -> int:
    return env.get("MLX_BRICKS_EMULATOR_THREADS") or max(1, min(4, os.cpu_count() or 1))


# ---------------------------------------------------------------------------------------------
# Arrays

_NP_DTYPES = {
    "bool": np.bool_,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "float16": np.float16,
    "bfloat16": np.uint16,  # raw bits
    "float32": np.float32,
}
_FLOATS = ("float16", "bfloat16", "float32")


def _mx():
    import mlx.core as mx

    return mx


@dataclass
class _Input:
    """An input as the kernel sees it: the bytes from its first element on, plus the shape and
    strides (in elements) that ``<name>_shape`` / ``<name>_strides`` report."""

    data: np.ndarray  # C-contiguous; for strided views the raw span of the view, as uint8
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def _to_input(x, row_contiguous: bool) -> _Input:
    """An input (mx.array or Python scalar, converted as MLX does) laid out as MLX passes it:
    a row-contiguous copy when ``row_contiguous`` (``ensure_row_contiguous=True``), otherwise
    the view's own strides over the memory it spans (negative strides: a contiguous copy)."""
    mx = _mx()
    if isinstance(x, bool):
        x = mx.array(x, dtype=mx.bool_)
    elif isinstance(x, int):
        x = mx.array(x, dtype=mx.int32)
    elif isinstance(x, float):
        x = mx.array(x, dtype=mx.float32)
    elif not isinstance(x, mx.array):
        raise TypeError(f"kernel inputs must be mx.array or Python scalars, got {type(x).__name__}")
    name = _source.dtype_name(x.dtype)
    if name not in _NP_DTYPES:
        raise TypeError(f"the emulator does not support inputs of dtype {x.dtype}")
    view = np.asarray(x.view(mx.uint16) if name == "bfloat16" else x)
    item = view.itemsize
    if (row_contiguous or view.flags.c_contiguous or view.size == 0
            or any(st < 0 for st in view.strides)):
        arr = np.ascontiguousarray(view)
        strides = tuple(st // item for st in arr.strides) if arr.ndim else ()
        return _Input(arr, item, arr.shape, strides)
    span = sum((n - 1) * st for n, st in zip(view.shape, view.strides)) + item
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(view.ctypes.data)).copy()
    return _Input(raw, item, view.shape, tuple(st // item for st in view.strides))


def _from_numpy(arr: np.ndarray, dtype):
    mx = _mx()
    if _source.dtype_name(dtype) == "bfloat16":
        return mx.array(arr).view(mx.bfloat16)
    return mx.array(arr)


# Threadgroup memory is filled with these bytes before each threadgroup (not the output
# poison, so a copy of uninitialised threadgroup memory shows up as a race, not "unwritten").
_TG_POISON = (0xFD, 0x3F)


def _poison(name: str, schedule: int) -> int:
    if schedule == 0:
        return 0xFF if name in _FLOATS else 0xAB
    return 0x41


def _fill(shape, dtype, init_value, poison: int) -> np.ndarray:
    name = _source.dtype_name(dtype)
    npdt = _NP_DTYPES[name]
    if init_value is None:
        out = np.empty(shape, dtype=npdt)
        out.view(np.uint8).reshape(-1)[:] = poison
        return out
    if name == "bfloat16":
        mx = _mx()
        bits = np.array(mx.array(init_value, dtype=mx.bfloat16).view(mx.uint16))
        return np.full(shape, bits, dtype=np.uint16)
    return np.full(shape, init_value, dtype=npdt)


def _is_poison(arr: np.ndarray, poison: int) -> np.ndarray:
    b = arr.view(np.uint8).reshape(arr.size, arr.itemsize)
    return np.all(b == poison, axis=1)


def _indices(mask: np.ndarray, shape, limit: int = 5) -> str:
    flat = np.flatnonzero(mask)
    shown = []
    for i in flat[:limit]:
        idx = np.unravel_index(int(i), shape) if len(shape) > 1 else (int(i),)
        shown.append(f"{int(i)} {tuple(int(j) for j in idx)}")
    more = f" and {flat.size - limit} more" if flat.size > limit else ""
    return ", ".join(shown) + more


def _value(arr: np.ndarray, dtype, i: int):
    v = arr.reshape(-1)[i]
    if _source.dtype_name(dtype) == "bfloat16":
        return float(np.array([int(v) << 16], dtype=np.uint32).view(np.float32)[0])
    return v.item()


# ---------------------------------------------------------------------------------------------
# The kernel object


def generate_source(
    name: str,
    input_names,
    output_names,
    source: str,
    header: str = "",
    *,
    inputs,
    output_dtypes,
    template=None,
    atomic_outputs: bool = False,
) -> str:
    """The full kernel source MLX 0.32 generates (and prints with ``verbose=True``) for a
    ``metal_kernel(name, input_names, output_names, source, header, atomic_outputs=...)`` called
    with these ``inputs`` (mx.arrays or Python scalars), ``output_dtypes`` and ``template``."""
    infos = [_input_info(x) for x in inputs]
    return _source.generate(
        name, list(input_names), list(output_names), source, header, infos,
        list(output_dtypes), template, atomic_outputs,
    ).source


def lint_kernel(
    name: str,
    input_names,
    output_names,
    source: str,
    header: str = "",
    *,
    inputs,
    output_dtypes,
    template=None,
    atomic_outputs: bool = False,
    rules=None,
):
    """Performance lint of the kernel ``metal_kernel(name, input_names, output_names, source,
    header)`` as launched with these ``inputs`` (mx.arrays, Python scalars, or
    ``source.InputInfo``), ``output_dtypes`` and ``template``: a list of
    ``lint.Finding`` (64-bit division in loops, scalar loads along runtime strides in loops;
    ``rules`` picks among ``lint.RULES``, default all). See ``mlx_bricks.emulator.lint``.

    Raises:
        EmulatorCompileError: the kernel does not compile (the division rule builds it).
    """
    from . import lint as _lint

    infos = [x if isinstance(x, _source.InputInfo) else _input_info(x) for x in inputs]
    gen = _source.generate(
        name, list(input_names), list(output_names), source, header, infos,
        list(output_dtypes), template, atomic_outputs,
    )
    return _lint.lint(gen, _lint.RULES if rules is None else tuple(rules))


def _input_info(x) -> _source.InputInfo:
    mx = _mx()
    if isinstance(x, bool):
        return _source.InputInfo(mx.bool_, 0, 1)
    if isinstance(x, int):
        return _source.InputInfo(mx.int32, 0, 1)
    if isinstance(x, float):
        return _source.InputInfo(mx.float32, 0, 1)
    return _source.InputInfo(x.dtype, x.ndim, x.size)


class EmulatedKernel:
    """What ``metal_kernel`` returns; call it like an ``mx.fast.metal_kernel`` kernel."""

    def __init__(self, name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None):
        for got, want, what in (
            (len(inputs), len(self.input_names), "inputs"),
            (len(output_shapes), len(self.output_names), "output_shapes"),
            (len(output_dtypes), len(self.output_names), "output_dtypes"),
        ):
            if got != want:
                raise ValueError(
                    f"[metal_kernel] Expected `{what}` to have size {want} but got size {got}."
                )
        grid = tuple(int(g) for g in grid)
        threadgroup = tuple(int(t) for t in threadgroup)
        if len(grid) != 3 or len(threadgroup) != 3:
            raise ValueError("grid and threadgroup must have 3 entries each")
        if min(threadgroup) < 1:
            raise ValueError(f"threadgroup {threadgroup} must be positive in every dimension")
        if threadgroup[0] * threadgroup[1] * threadgroup[2] > 1024:
            raise ValueError(
                f"Thread group size ({threadgroup[0] * threadgroup[1] * threadgroup[2]}) is "
                "greater than  the maximum allowed threads per threadgroup (1024)."
            )
        infos = [_input_info(x) for x in inputs]
        gen = _source.generate(
            self.name, self.input_names, self.output_names, self.source, self.header, infos,
            list(output_dtypes), template, self.atomic_outputs,
        )
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{gen.source}\n```")
        cfg = _checks
        kernel = compile_kernel(gen, check_address_spaces=cfg.address_spaces)

        # buffers in signature order: (name, bytes, is_output, element size)
        ins = [_to_input(x, self.ensure_row_contiguous) for x in inputs]
        in_bufs: list[tuple[str, np.ndarray, bool, int]] = []
        for p in gen.params:
            if p.kind not in ("input", "shape", "strides", "ndim"):
                continue
            inp = ins[p.input_index]
            if p.kind == "input":
                in_bufs.append((p.name, inp.data, False, inp.itemsize))
                continue
            if p.kind == "shape":
                val = np.array(inp.shape, dtype=np.int32)
            elif p.kind == "strides":
                val = np.array(inp.strides, dtype=np.int64)
            else:
                val = np.array(len(inp.shape), dtype=np.int32)
            in_bufs.append((p.name, val, False, val.itemsize))
        shapes = [tuple(int(s) for s in shp) for shp in output_shapes]
        group = tuple(min(t, g) for t, g in zip(threadgroup, grid))

        runs = []
        for schedule in range(cfg.schedules):
            outs = [
                _fill(shp, dt, init_value, _poison(_source.dtype_name(dt), schedule))
                for shp, dt in zip(shapes, output_dtypes)
            ]
            bufs = in_bufs + [
                (n, o, True, o.itemsize) for n, o in zip(self.output_names, outs)
            ]
            if min(grid) > 0:
                from .runtime import launch

                launch(kernel, gen.kernel_name, bufs, grid, group, schedule % 2, _threads(),
                       cfg.bounds, _TG_POISON[schedule % 2], cfg.perturb)
            runs.append(outs)
        self._check_outputs(gen.kernel_name, runs, output_dtypes, init_value, cfg)
        return [_from_numpy(o, dt) for o, dt in zip(runs[0], output_dtypes)]

    def _check_outputs(self, kname, runs, output_dtypes, init_value, cfg):
        for k, (oname, dt) in enumerate(zip(self.output_names, output_dtypes)):
            dname = _source.dtype_name(dt)
            first = runs[0][k]
            if first.size == 0:
                continue
            unwritten = None
            if cfg.unwritten and init_value is None:
                unwritten = np.ones(first.size, dtype=bool)
                for s, outs in enumerate(runs):
                    unwritten &= _is_poison(outs[k], _poison(dname, s % 2))
                if unwritten.any():
                    raise EmulatorFault(
                        f"kernel {kname!r}: {int(unwritten.sum())} of {first.size} elements of "
                        f"output '{oname}' {first.shape} were never written (flat index "
                        f"(multi-index)): {_indices(unwritten, first.shape)}"
                    )
            for s in range(1, len(runs)):
                other = runs[s][k]
                a = first.view(np.uint8).reshape(first.size, first.itemsize)
                b = other.view(np.uint8).reshape(other.size, other.itemsize)
                differ = np.any(a != b, axis=1)
                if self.atomic_outputs and dname in _FLOATS:
                    # float atomics in another order round differently: a GPU does that too
                    fa = _from_numpy(first, dt).astype(_mx().float32)
                    fb = _from_numpy(other, dt).astype(_mx().float32)
                    differ = ~np.isclose(np.array(fa), np.array(fb), rtol=1e-3, atol=1e-5,
                                         equal_nan=True).reshape(-1)
                if differ.any():
                    i = int(np.flatnonzero(differ)[0])
                    raise EmulatorFault(
                        f"kernel {kname!r}: output '{oname}' {first.shape} depends on the order "
                        f"threads run in (a race: missing threadgroup_barrier, or a read of "
                        f"uninitialised threadgroup memory); {int(differ.sum())} elements differ "
                        f"between schedule 0 and {s}, e.g. flat index (multi-index) "
                        f"{_indices(differ, first.shape)}; element {i}: "
                        f"{_value(first, dt, i)!r} vs {_value(other, dt, i)!r}"
                    )


def metal_kernel(name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False) -> EmulatedKernel:
    """Same arguments as ``mx.fast.metal_kernel``; the kernel runs on the CPU (see module doc).

    With ``ensure_row_contiguous=False`` a strided view (a transpose, a slice) reaches the kernel
    as on Metal: the memory it spans, with its own ``<name>_shape``/``<name>_strides``.
    """
    return EmulatedKernel(name, input_names, output_names, source, header,
                          ensure_row_contiguous, atomic_outputs)
