"""Where MLX computes on the CPU: the condition of the composites that run NumPy's BLAS, and the
thread count of NumPy's bundled OpenBLAS while they do."""
from __future__ import annotations

import contextlib
import functools

import mlx.core as mx
import numpy as np


def on_cpu(args=None, backend=None) -> bool:
    """Whether MLX computes on the CPU here (the condition of the composites that run NumPy's
    BLAS: elsewhere they would copy their arguments off the GPU and back). The arguments are
    a composite's ``applies(args, backend)`` signature; neither is read."""
    return mx.default_device() == mx.cpu


@functools.lru_cache(maxsize=1)
def _openblas_threads():
    """``(get, set)`` of the thread count of NumPy's bundled OpenBLAS (the Linux wheels'
    ``numpy.libs/libscipy_openblas*``), or None where NumPy has another BLAS."""
    import ctypes
    import glob
    import os

    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas*.so*"))):
        lib = ctypes.CDLL(path)  # the library NumPy loaded: same file, same handle
        get = getattr(lib, "scipy_openblas_get_num_threads64_", None)
        put = getattr(lib, "scipy_openblas_set_num_threads64_", None)
        if get is not None and put is not None:
            return get, put
    return None


@contextlib.contextmanager
def one_blas_thread():
    """Within the block NumPy's OpenBLAS runs one thread (restored after; no effect where NumPy
    has another BLAS). For the CPU composites: the Gated DeltaNet chunks' products are small (a
    (C, Dk) by (Dk, Dv) product per head and chunk), where more threads only add their
    synchronisation (on a loaded 2-core x86 machine two OpenBLAS threads made it 3x slower in
    wall time: Qwen3.5-shaped layer, 512 tokens, bf16: 1.34 s vs 0.45 s, 2026-12-06); a GEMM
    tile's product is as fast on one thread here, and the idle workers then do not compete
    with the generation that follows (a 4-layer float16 model's generation 0.95x stock with
    two threads, 0.96-1.02x with one, 2026-12-06)."""
    fns = _openblas_threads()
    if fns is None:
        yield
        return
    get, put = fns
    n = get()
    put(1)
    try:
        yield
    finally:
        put(n)
