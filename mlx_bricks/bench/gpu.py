"""GPU benchmarks of the bricks against stock MLX in the same process (``--backend cuda``).

Every entry times the brick and the stock MLX computation of the same op on the same inputs,
several calls per ``mx.eval`` (MLX's per-eval overhead, about 58 us on the H200, would otherwise
dominate small ops), after a warm-up, with ``mx.synchronize``, and reports the median of the
repeats, TFLOP/s and the same-process ratio stock_time / brick_time (> 1: the brick is faster),
plus the largest difference between the two outputs relative to the stock output's magnitude.

Shapes are a llama-3-8B layer's (hidden 4096, intermediate 14336, 32 query / 8 KV heads,
head_dim 128) at prefill chunk sizes M = 512, 2048, 8192; weights bf16, MLX affine 4-bit gs64
and 8-bit gs64 (``mx.quantize``, what ``nn.quantize`` makes). Used by ``python -m
mlx_bricks.bench`` and by ``scripts/gpu/`` on the GPU machine.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
M_SIZES = (512, 2048, 8192)
#: Weight formats: None (the activation dtype) or (bits, group_size).
FORMATS = (None, (4, 64), (8, 64))


def fmt_name(fmt) -> str:
    return "bf16" if fmt is None else f"q{fmt[0]}g{fmt[1]}"


def time_op(fn: Callable, *, target_s: float = 0.02, repeats: int = 5) -> float:
    """Median seconds of one call of ``fn`` (returns mx.array(s)), timing ``n`` calls per
    ``mx.eval`` with ``n`` chosen so one eval takes about ``target_s``."""
    import mlx.core as mx

    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    one = max(time.perf_counter() - t0, 1e-6)
    n = max(1, min(200, int(target_s / one)))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def rel_diff(a, b) -> float:
    """max |a - b| / max(1, max |b|), in float32."""
    import mlx.core as mx

    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.max(mx.abs(a32 - b32)).item()) / max(1.0, float(mx.max(mx.abs(b32)).item()))


@dataclass
class Case:
    """One op at one shape: ``build() -> (brick, stock, flops)``."""

    name: str
    build: Callable


def _randn(shape, dtype, seed, scale=1.0):
    import mlx.core as mx

    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def _weight(N, K, fmt, dtype, seed):
    """(weight for the brick, stock callable factory) for a float or affine weight."""
    import mlx.core as mx

    from mlx_bricks.formats.affine import QuantizedWeight

    w = _randn((N, K), dtype, seed, K ** -0.5)
    if fmt is None:
        return w, (lambda x: x @ w.T)
    bits, gs = fmt
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    qw = QuantizedWeight(q, s, b, gs, bits)
    return qw, (lambda x: mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs,
                                              bits=bits))


def linear_cases(backend: str, dtype_name: str = "bfloat16", tiles=(None,)):
    import mlx.core as mx

    from mlx_bricks import ops

    dtype = getattr(mx, dtype_name)
    shapes = {"qo": (HIDDEN, HIDDEN), "kv": (KV_HEADS * HEAD_DIM, HIDDEN),
              "gate_up": (INTERMEDIATE, HIDDEN), "down": (HIDDEN, INTERMEDIATE)}
    for fmt in FORMATS:
        for sname, (N, K) in shapes.items():
            for M in M_SIZES:
                for tile in tiles:
                    def build(M=M, N=N, K=K, fmt=fmt, tile=tile):
                        x = _randn((M, K), dtype, 1)
                        w, stock = _weight(N, K, fmt, dtype, 2)
                        mx.eval(x, w if not hasattr(w, "w") else w.w)
                        return (lambda: ops.linear(x, w, tile=tile, backend=backend),
                                lambda: stock(x), 2.0 * M * N * K)
                    yield Case(f"linear_{fmt_name(fmt)}_{sname}_M{M}_{tile or 'rule'}", build)


def swiglu_cases(backend: str, dtype_name: str = "bfloat16", variants=("fused", "split")):
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_bricks import ops

    dtype = getattr(mx, dtype_name)
    N, K = INTERMEDIATE, HIDDEN
    for fmt in FORMATS:
        for M in M_SIZES:
            for variant in variants:
                def build(M=M, fmt=fmt, variant=variant):
                    x = _randn((M, K), dtype, 1)
                    wg, gate = _weight(N, K, fmt, dtype, 2)
                    wu, up = _weight(N, K, fmt, dtype, 3)
                    mx.eval(x)
                    return (lambda: ops.swiglu(x, wg, wu, variant=variant, backend=backend),
                            lambda: nn.silu(gate(x)) * up(x), 4.0 * M * N * K)
                yield Case(f"swiglu_{variant}_{fmt_name(fmt)}_M{M}", build)


def rms_norm_qkv_cases(backend: str, dtype_name: str = "bfloat16"):
    import mlx.core as mx

    from mlx_bricks import ops

    dtype = getattr(mx, dtype_name)
    K, D = HIDDEN, HEAD_DIM
    for fmt in FORMATS:
        for M in M_SIZES:
            def build(M=M, fmt=fmt):
                x = _randn((1, M, K), dtype, 1)
                nw = _randn((K,), dtype, 4) + 1
                wq, sq = _weight(HEADS * D, K, fmt, dtype, 2)
                wk, sk = _weight(KV_HEADS * D, K, fmt, dtype, 3)
                wv, sv = _weight(KV_HEADS * D, K, fmt, dtype, 5)
                mx.eval(x, nw)

                def stock():
                    h = mx.fast.rms_norm(x, nw, 1e-5)
                    return [p(h).reshape(1, M, n, D).transpose(0, 2, 1, 3)
                            for p, n in ((sq, HEADS), (sk, KV_HEADS), (sv, KV_HEADS))]

                def brick():
                    return list(ops.rms_norm_qkv(x, nw, 1e-5, wq, wk, wv, n_heads=HEADS,
                                                 n_kv_heads=KV_HEADS, head_dim=D,
                                                 backend=backend))
                return brick, stock, 2.0 * M * (HEADS + 2 * KV_HEADS) * D * K
            yield Case(f"rms_norm_qkv_{fmt_name(fmt)}_M{M}", build)


def run_case(case: Case) -> dict:
    """Time one case; failures (compile errors, wrong shapes) are recorded, not raised."""
    import mlx.core as mx

    out = {"name": case.name}
    try:
        brick, stock, flops = case.build()
        b_out, s_out = brick(), stock()
        b_list = b_out if isinstance(b_out, list) else [b_out]
        s_list = s_out if isinstance(s_out, list) else [s_out]
        mx.eval(b_list, s_list)
        out["rel_diff"] = max(rel_diff(b, s) for b, s in zip(b_list, s_list))
        tb, ts = time_op(brick), time_op(stock)
        out.update(brick_ms=tb * 1e3, stock_ms=ts * 1e3, ratio=ts / tb,
                   brick_tflops=flops / tb / 1e12, stock_tflops=flops / ts / 1e12)
    except Exception as e:  # noqa: BLE001  (a benchmark run reports every case's outcome)
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    return out
