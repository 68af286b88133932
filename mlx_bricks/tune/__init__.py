"""The tuner: measured dispatch between the bricks and stock MLX, per device.

For each op the patched model runs (linear layers, the SwiGLU MLP, RMSNorm + QKV, attention),
at the shapes it runs them (bucketed: ``buckets``), every brick variant the op offers on the
backend (the ops' listing functions) is timed against the stock MLX / mlx-lm computation in the
same process (``timing``), checked against a high-precision reference with the dtype-scaled rule
(``check``; a failing variant never wins), and the winner is recorded with its measured ratio
(``tuner.Decision``) in a JSON cache keyed by device, MLX and mlx-bricks versions and kernel
source hash (``cache``). The patch consults it in one place (``mlx_bricks.runtime.dispatch``);
the build and first-call guard (``guard``) disables a variant that fails to build or disagrees
with stock. ``python -m mlx_bricks.tune`` tunes a model ahead of time, shows or clears the cache.
See docs/tuning.md.
"""
from __future__ import annotations

from mlx_bricks._lazy import lazy_exports

_LAZY = {
    "Decision": ".tuner",
    "DecisionCache": ".cache",
    "MIN_SPEEDUP": ".tuner",
    "STOCK": ".tuner",
    "current_context": ".cache",
    "dtype_close": ".check",
    "m_bucket": ".buckets",
    "attention_bucket": ".buckets",
    "time_interleaved": ".timing",
    "tune_op": ".tuner",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
