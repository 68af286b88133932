"""The benchmark table, the timer and the runner behind ``python -m mlx_bricks.bench``."""
from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Benchmark:
    """One benchmark.

    Attributes:
        name: unique name (``--only`` selects by it).
        backend: the bricks backend it needs (``mlx_bricks.backends.BACKENDS``).
        what: one line: the op, shape and dtype.
        setup: ``() -> (brick, stock)``: two zero-argument callables that each run the op once
            on the same inputs and return the ``mx.array`` result (evaluated by the timer).
    """

    name: str
    backend: str
    what: str
    setup: Callable[[], tuple[Callable, Callable]]


def _check_repeats(repeats) -> None:
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")


def time_call(fn: Callable, repeats: int) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` (each result evaluated), after one warm-up
    call (compilation and caches).

    Raises:
        ValueError: ``repeats`` < 1.
    """
    import mlx.core as mx

    _check_repeats(repeats)
    mx.eval(fn())
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        out.append(time.perf_counter() - t0)
    return out


def _emulator_gemm_256():
    """The emulator speed target of issue 4: 256x256x256 float16 GEMM, 64x64 tiles, 128 threads
    per threadgroup, the emulator's default checks (bounds, unwritten elements, two schedules)."""
    import mlx.core as mx

    from mlx_bricks.ops import linear

    x = mx.random.normal((256, 256), key=mx.random.key(0)).astype(mx.float16)
    w = mx.random.normal((256, 256), key=mx.random.key(1)).astype(mx.float16)
    mx.eval(x, w)
    return (lambda: linear(x, w, tile="64x64", backend="emulator"),
            lambda: x @ w.T)


#: The benchmarks, by name.
BENCHMARKS: dict[str, Benchmark] = {b.name: b for b in (
    Benchmark("emulator_gemm_256", "emulator",
              "GEMM brick, M=N=K=256, float16, 64x64 tile, on the MSL emulator (CPU) vs "
              "stock x @ w.T on the MLX default device", _emulator_gemm_256),
)}


def run_benchmarks(names=None, repeats: int = 3) -> dict:
    """Run the benchmarks ``names`` (default: all) and return the JSON-ready result.

    Returns:
        ``{"machine": ..., "mlx": version, "results": [...]}``; each result has ``name``,
        ``backend``, ``what`` and either ``max_abs_diff`` (brick vs stock output),
        ``brick_s``/``stock_s`` (median seconds),
        ``brick_runs_s``/``stock_runs_s`` (every run) and ``ratio`` (stock_s / brick_s: above 1
        the brick is faster), or ``skipped`` with the reason.

    Raises:
        ValueError: an unknown name (listing the known ones), ``repeats`` < 1.
    """
    import mlx.core as mx

    from mlx_bricks.backends import backend_status

    _check_repeats(repeats)  # before any setup: a kernel build is not free
    names = list(BENCHMARKS) if names is None else list(names)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ValueError(f"unknown benchmark(s) {unknown}; known: {', '.join(BENCHMARKS)}")
    results = []
    for name in names:
        b = BENCHMARKS[name]
        entry = {"name": b.name, "backend": b.backend, "what": b.what}
        ok, why = backend_status(b.backend)
        if not ok:
            entry["skipped"] = f"backend {b.backend} unavailable: {why}"
        else:
            brick, stock = b.setup()
            # a benchmark of a wrong result is meaningless: report how far apart they are
            diff = mx.abs(brick().astype(mx.float32) - stock().astype(mx.float32)).max()
            entry["max_abs_diff"] = diff.item()
            brick_runs, stock_runs = time_call(brick, repeats), time_call(stock, repeats)
            entry.update(brick_s=statistics.median(brick_runs),
                         stock_s=statistics.median(stock_runs),
                         brick_runs_s=brick_runs, stock_runs_s=stock_runs)
            entry["ratio"] = entry["stock_s"] / entry["brick_s"]
        results.append(entry)
    return {"machine": {"platform": platform.platform(), "processor": platform.machine(),
                        "device": str(mx.default_device())},
            "mlx": mx.__version__, "repeats": repeats, "results": results}
