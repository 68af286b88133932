"""Same-process timing of several implementations of one computation (brick variants, stock).

Rules (``../shared/docs/device.md``): warm up first (kernel builds, caches); put several calls
in one ``mx.eval`` so MLX's fixed cost per evaluation (about 58 us measured on the H200) does
not dominate a small op; ``mx.synchronize`` before reading the clock; interleave the candidates
(the order rotates every round) so drift of clocks and temperature hits all of them alike; take
the median of the rounds.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

#: Wall time one evaluation of a candidate should last (so the per-eval cost is a few %).
TARGET_EVAL_S = 2e-3
#: Most calls of one candidate per evaluation.
MAX_CALLS = 64
#: Most bytes of outputs alive in one evaluation (n calls keep n outputs until the eval).
MAX_BYTES = 256 << 20


def _nbytes(out) -> int:
    if isinstance(out, mx.array):
        return out.nbytes
    if isinstance(out, (tuple, list)):
        return sum(_nbytes(o) for o in out)
    raise TypeError(f"a timed callable must return mx.array or a tuple of them, got "
                    f"{type(out).__name__}")


def _eval_sync(out) -> None:
    mx.eval(out)
    mx.synchronize()


@dataclass(frozen=True)
class Timing:
    """Result of :func:`time_interleaved`.

    Attributes:
        runs: name -> seconds per call, one entry per round.
        calls: name -> calls per evaluation used for that candidate.
    """

    runs: dict[str, list[float]]
    calls: dict[str, int]

    def median(self, name: str) -> float:
        """Median seconds per call of candidate ``name``."""
        return statistics.median(self.runs[name])


def time_interleaved(fns: dict[str, Callable[[], object]], *, repeats: int = 5,
                     target_s: float = TARGET_EVAL_S, min_calls: int = 1,
                     max_calls: int = MAX_CALLS, max_bytes: int = MAX_BYTES,
                     warm=(), budget_s: float | None = None) -> Timing:
    """Seconds per call of each zero-argument callable in ``fns`` (each returns the lazy
    ``mx.array`` result, or a tuple of them).

    Each candidate is warmed up (one evaluated call; skipped for the names in ``warm``, which
    the caller has just evaluated once already), then timed once to choose its calls per
    evaluation, ``n = ceil(target_s / t)`` clamped to ``[min_calls, max_calls]`` and to what
    ``max_bytes`` of outputs allow; then ``repeats`` rounds, each evaluating ``n`` calls of every
    candidate (rotating order) and recording wall time / n after ``mx.synchronize``.

    ``budget_s`` bounds a slow candidate's timing: where its ``repeats`` rounds would take
    longer than ``budget_s`` seconds it gets only the rounds that fit (at least one), and when
    one call is a whole round (``n = 1``) its timed calibration call, a warm call like any
    other, counts as its first round. Every candidate's median is still over its own rounds.

    Raises:
        ValueError: ``repeats`` or ``min_calls`` < 1, or no candidates.
        TypeError: a callable returns something other than arrays.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    if isinstance(min_calls, bool) or not isinstance(min_calls, int) or min_calls < 1:
        raise ValueError(f"min_calls must be a positive int, got {min_calls!r}")
    if not fns:
        raise ValueError("fns must name at least one callable")
    calls: dict[str, int] = {}
    rounds: dict[str, int] = {}
    names = list(fns)
    runs: dict[str, list[float]] = {n: [] for n in names}
    for name, fn in fns.items():
        if name not in warm:
            _eval_sync(fn())  # warm-up: builds, caches
        t0 = time.perf_counter()
        out = fn()
        _eval_sync(out)
        one = time.perf_counter() - t0
        n = math.ceil(target_s / max(one, 1e-9))
        n = min(n, max_calls, max(1, max_bytes // max(_nbytes(out), 1)))
        calls[name] = max(min_calls, n)
        rounds[name] = repeats
        if budget_s is not None and one * calls[name] * repeats > budget_s:
            rounds[name] = max(1, min(repeats, int(budget_s // (one * calls[name]))))
            if calls[name] == 1:
                runs[name].append(one)
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            if len(runs[name]) >= rounds[name]:
                continue
            fn, n = fns[name], calls[name]
            t0 = time.perf_counter()
            _eval_sync([fn() for _ in range(n)])
            runs[name].append((time.perf_counter() - t0) / n)
    return Timing(runs, calls)
