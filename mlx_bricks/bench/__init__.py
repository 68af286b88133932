"""Benchmarks of the bricks against stock MLX in the same run, as JSON.

``python -m mlx_bricks.bench [--only NAME ...] [--repeats R] [--out FILE]``. Each benchmark
times the brick and the stock MLX op it replaces on the same inputs, in the same process, and
reports medians and their ratio; nothing here asserts a speed. Benchmarks that cannot run on
this machine (backend unavailable) are listed with the reason instead of a time.
"""
from mlx_bricks.bench.core import BENCHMARKS, Benchmark, run_benchmarks, time_call

__all__ = ["BENCHMARKS", "Benchmark", "run_benchmarks", "time_call"]
