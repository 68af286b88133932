"""Benchmarks of the bricks against stock MLX in the same run, as JSON.

``python -m mlx_bricks.bench [--only NAME ...] [--repeats R] [--out FILE]``. Each benchmark
times the brick and the stock MLX op it replaces on the same inputs, in the same process, and
reports medians and their ratio; nothing here asserts a speed. Benchmarks that cannot run on
this machine (backend unavailable) are listed with the reason instead of a time. The user's
path (mlx-lm's CLIs in fresh processes) is ``bench.user_path``, also a script of its own.

The names below come from ``bench.core`` on first use: the package itself imports nothing, so
``python -m mlx_bricks.bench.user_path`` runs its module once, not a second copy the table built.
"""
__all__ = ["BENCHMARKS", "Benchmark", "run_benchmarks", "time_call"]


def __getattr__(name):
    if name in __all__:
        from mlx_bricks.bench import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *__all__])
