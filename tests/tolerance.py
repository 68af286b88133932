"""The dtype-scaled tolerance rule of the design note.

A kernel may be at most ``factor`` (2) times as far from the float64 result as the same-dtype
naive MLX computation, plus a floor of a few units in the last place of the output dtype (so a
naive result that happens to be exact does not demand bit-exactness).
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

EPS = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-23}


def to_f64(a) -> np.ndarray:
    """mx.array (any float dtype) or numpy -> float64 numpy."""
    if isinstance(a, mx.array):
        return np.array(a.astype(mx.float32)).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


def assert_dtype_close(out, ref64, naive, *, dtype, factor: float = 2.0, ulps: float = 4.0,
                       what: str = "") -> None:
    """Assert ``max|out - ref64| <= factor * max|naive - ref64| + ulps * eps(dtype) * scale``.

    ``scale`` is ``max(1, max|ref64|)``. Also asserts ``out`` is finite where ``ref64`` is.
    """
    o, r, n = to_f64(out), to_f64(ref64), to_f64(naive)
    assert o.shape == r.shape, f"{what}: shape {o.shape} != reference {r.shape}"
    finite = np.isfinite(r)
    assert np.isfinite(o[finite]).all(), f"{what}: non-finite output where reference is finite"
    err_k = float(np.max(np.abs(o - r), initial=0.0))
    err_n = float(np.max(np.abs(n - r)[finite], initial=0.0))
    scale = max(1.0, float(np.max(np.abs(r[finite]), initial=0.0)))
    budget = factor * err_n + ulps * EPS[dtype] * scale
    assert err_k <= budget, (
        f"{what}: kernel error {err_k:.3g} exceeds budget {budget:.3g} "
        f"(naive same-dtype error {err_n:.3g}, dtype {dtype})"
    )
