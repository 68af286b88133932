"""The dtype-scaled tolerance rule (design note, "Test rules"), as a library function.

A result may be at most ``factor`` (2) times as far from a high-precision reference as the
same-dtype naive computation (stock MLX) is, plus a floor of a few units in the last place of the
dtype at the reference's scale (so a naive result that happens to be exact does not demand
bit-exactness). The rule is FlashAttention's test rule; the tuner and the first-call guard use it
to accept a brick variant, and the test suite (``tests/tolerance.py``) asserts it.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

#: Unit roundoff (one ulp at 1.0) of each float dtype.
EPS = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7, mx.float32: 2.0**-23}


def to_f64(a) -> np.ndarray:
    """``mx.array`` (any float dtype) or array-like -> float64 numpy."""
    if isinstance(a, mx.array):
        if a.dtype == mx.float64:
            return np.array(a)
        return np.array(a.astype(mx.float32)).astype(np.float64)
    return np.asarray(a, dtype=np.float64)


@dataclass(frozen=True)
class CloseResult:
    """Outcome of :func:`dtype_close`.

    Attributes:
        ok: the result is within the budget (and finite wherever the reference is).
        error: max |result - reference|.
        budget: ``factor * naive_error + ulps * eps(dtype) * max(1, max|reference|)``.
        naive_error: max |naive - reference| over the finite reference elements.
        finite: the result is finite wherever the reference is.
        shape_ok: the result has the reference's shape.
    """

    ok: bool
    error: float
    budget: float
    naive_error: float
    finite: bool = True
    shape_ok: bool = True

    def __str__(self) -> str:
        if not self.shape_ok:
            return "output shape differs from the reference"
        if not self.finite:
            return "non-finite output where the reference is finite"
        return (f"error {self.error:.3g} {'<=' if self.ok else '>'} budget {self.budget:.3g}, "
                f"stock's own error {self.naive_error:.3g}")


def dtype_close(out, ref, naive, *, dtype, factor: float = 2.0, ulps: float = 4.0
                ) -> CloseResult:
    """Whether ``out`` is as close to ``ref`` as the dtype allows (module docstring).

    Args:
        out: the result under test (``mx.array`` or numpy).
        ref: a higher-precision reference of the same values (float32 for float16/bfloat16
            results, float64 for float32 results).
        naive: the same computation in ``dtype`` by stock MLX (the error it shows is the budget's
            scale), or None where stock cannot run: then ``ref`` rounded to ``dtype`` (the
            least error a result in ``dtype`` shows; for float32 results this is stricter than
            a float32 GEMM's accumulation error, so a float32 variant may fail it).
        dtype: ``mx.float16``, ``mx.bfloat16`` or ``mx.float32``.
        factor, ulps: the rule's constants (2 and 4 in the design note).

    Raises:
        ValueError: ``dtype`` is not one of :data:`EPS`.
    """
    if dtype not in EPS:
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    o, r = to_f64(out), to_f64(ref)
    n = to_f64(mx.array(r.astype(np.float32)).astype(dtype)) if naive is None else to_f64(naive)
    if o.shape != r.shape:
        return CloseResult(False, float("inf"), 0.0, float("nan"), shape_ok=False)
    finite = np.isfinite(r)
    err_n = float(np.max(np.abs(n - r)[finite], initial=0.0))
    scale = max(1.0, float(np.max(np.abs(r[finite]), initial=0.0)))
    budget = factor * err_n + ulps * EPS[dtype] * scale
    if not np.isfinite(o[finite]).all():
        return CloseResult(False, float("inf"), budget, err_n, finite=False)
    # Over every element, as the test rule: a non-finite reference element makes it NaN (fail).
    err = float(np.max(np.abs(o - r), initial=0.0))
    return CloseResult(bool(err <= budget), err, budget, err_n)


def worst(results: list[CloseResult]) -> CloseResult:
    """The failing (or, if all pass, the tightest) of several results: one verdict for an op
    with several outputs (``rms_norm_qkv``'s q, k, v)."""
    failing = [r for r in results if not r.ok]
    if failing:
        return failing[0]
    return max(results, key=lambda r: r.error / r.budget if r.budget else float("inf"))


#: What a kernel that cannot be built or launched raises: MLX's compile and launch errors
#: (``RuntimeError``; the emulator's faults derive from it), argument errors of the op
#: (``ValueError``), and a brick without a twin on this backend (``NotImplementedError``). The
#: tuner and the first-call guard (``runtime.guard``) catch these, and nothing broader.
KERNEL_ERRORS = (RuntimeError, ValueError, NotImplementedError)


def one_line(e: BaseException) -> str:
    """An exception as one line (its first 300 characters), with its type."""
    text = " ".join(str(e).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(e).__name__}: {text}"
