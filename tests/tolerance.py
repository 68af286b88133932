"""The dtype-scaled tolerance rule of the design note, as a test assertion.

A kernel may be at most ``factor`` (2) times as far from the float64 result as the same-dtype
naive MLX computation, plus a floor of a few units in the last place of the output dtype (so a
naive result that happens to be exact does not demand bit-exactness). The rule itself lives in
``mlx_bricks.tune.check`` (the tuner and the first-call guard apply it too).
"""
from __future__ import annotations

from mlx_bricks.tune.check import EPS, dtype_close, to_f64

__all__ = ["EPS", "assert_dtype_close", "to_f64"]


def assert_dtype_close(out, ref64, naive, *, dtype, factor: float = 2.0, ulps: float = 4.0,
                       what: str = "") -> None:
    """Assert ``max|out - ref64| <= factor * max|naive - ref64| + ulps * eps(dtype) * scale``.

    ``scale`` is ``max(1, max|ref64|)``. Also asserts ``out`` is finite where ``ref64`` is.
    """
    r = dtype_close(out, ref64, naive, dtype=dtype, factor=factor, ulps=ulps)
    assert r.shape_ok, f"{what}: shape {to_f64(out).shape} != reference {to_f64(ref64).shape}"
    assert r.finite, f"{what}: non-finite output where reference is finite"
    assert r.ok, (
        f"{what}: kernel error {r.error:.3g} exceeds budget {r.budget:.3g} "
        f"(naive same-dtype error {r.naive_error:.3g}, dtype {dtype})"
    )
