"""ctypes binding of the fiber runtime: one launch of a compiled kernel over numpy buffers."""
from __future__ import annotations

import ctypes

import numpy as np

from .compile import CompiledKernel, EmulatorFault, runtime_library


class EmuBuf(ctypes.Structure):
    """One kernel buffer as the C++ runtime sees it (mirrors ``EmuBuf`` in shim/emu_abi.h)."""

    _fields_ = [
        ("host", ctypes.c_void_p),
        ("nbytes", ctypes.c_uint64),
        ("elem_bytes", ctypes.c_uint32),
        ("is_output", ctypes.c_uint32),
        ("name", ctypes.c_char_p),
    ]


class EmuLaunchDesc(ctypes.Structure):
    """A launch: entry point, buffers, grid and threadgroup (mirrors shim/emu_abi.h)."""

    _fields_ = [
        ("entry", ctypes.c_void_p),
        ("nbufs", ctypes.c_uint32),
        ("bufs", ctypes.POINTER(EmuBuf)),
        ("grid", ctypes.c_uint32 * 3),
        ("threadgroup", ctypes.c_uint32 * 3),
        ("schedule", ctypes.c_uint32),
        ("nthreads", ctypes.c_uint32),
        ("checks", ctypes.c_uint32),
        ("tg_poison", ctypes.c_uint32),
        ("perturb", ctypes.c_uint32),
        ("kernel_name", ctypes.c_char_p),
        ("ntg_names", ctypes.c_uint32),
        ("tg_names", ctypes.POINTER(ctypes.c_char_p)),
    ]


def launch(
    kernel: CompiledKernel,
    kernel_name: str,
    buffers: list[tuple[str, np.ndarray, bool, int]],
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    schedule: int,
    nthreads: int,
    checks: bool,
    tg_poison: int,
    perturb: int = 0,
) -> None:
    """Run the kernel once. ``buffers``: (name, contiguous array, is_output, element size) in
    buffer order; outputs are written in place. ``perturb``: the perturbed mode's seed (0: off).

    Raises:
        EmulatorFault: bounds violation, divergent barrier, division by zero, ...
    """
    lib = runtime_library()
    n = len(buffers)
    bufs = (EmuBuf * max(n, 1))()
    keep = []
    for i, (name, arr, is_out, item) in enumerate(buffers):
        assert arr.flags.c_contiguous
        nm = name.encode()
        keep.append(nm)
        bufs[i].host = arr.ctypes.data if arr.nbytes else None
        bufs[i].nbytes = arr.nbytes
        bufs[i].elem_bytes = item
        bufs[i].is_output = 1 if is_out else 0
        bufs[i].name = nm
    names = [d.describe().encode() for d in kernel.tg_decls]
    tg_names = (ctypes.c_char_p * max(len(names), 1))(*names)
    d = EmuLaunchDesc()
    d.entry = kernel.entry
    d.nbufs = n
    d.bufs = bufs
    d.grid[:] = list(grid)
    d.threadgroup[:] = list(threadgroup)
    d.schedule = schedule
    d.nthreads = nthreads
    d.checks = 1 if checks else 0
    d.tg_poison = tg_poison
    d.perturb = perturb
    kname = kernel_name.encode()
    d.kernel_name = kname
    d.ntg_names = len(names)
    d.tg_names = tg_names
    err = ctypes.create_string_buffer(8192)
    lib.emu_launch.argtypes = [ctypes.POINTER(EmuLaunchDesc), ctypes.c_char_p, ctypes.c_uint32]
    lib.emu_launch.restype = ctypes.c_int
    rc = lib.emu_launch(ctypes.byref(d), err, len(err))
    if rc != 0:
        raise EmulatorFault(f"kernel {kernel_name!r}: {err.value.decode(errors='replace')}")
