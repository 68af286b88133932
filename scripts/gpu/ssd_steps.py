"""Time the SSD brick's three CUDA steps apart, and the op against mlx-lm's ssm_update, on one
Nemotron-3-Nano-shaped Mamba-2 layer (64 heads of 64, 8 groups, N 128, bf16). Usage on the GPU
machine: python3 scripts/gpu/ssd_steps.py [T ...]; prints one JSON line per T (seconds,
medians of 20 calls in one eval each)."""
import json
import sys

import mlx.core as mx

from mlx_bricks.bricks.ssd import msl
from mlx_bricks.bricks.ssd.op import run_kernel, ssd_gates, ssd_stock
from mlx_bricks.tune.timing import time_interleaved


def timed(fn, reps=20):
    """Median seconds per call over 5 evaluations of ``reps`` calls (the tuner's timing)."""
    return time_interleaved({"fn": fn}, repeats=5, min_calls=reps, max_calls=reps).median("fn")


#: One Nemotron-3-Nano Mamba-2 layer: batch, heads, head dim, groups, state size.
SHAPE = (1, 64, 64, 8, 128)


def layer_inputs(T):
    """Model-like bf16 inputs of one layer at T tokens, evaluated: ``(x, dt, A_log, dt_bias, B,
    C, D)`` (time steps raw; softplus values of 0.001-0.1 around the bias, A in [1, 16])."""
    b, H, P, G, N = SHAPE
    k = mx.random.split(mx.random.key(T), 6)
    x = mx.random.normal((b, T, H, P), key=k[0]).astype(mx.bfloat16)
    B = mx.random.normal((b, T, G, N), key=k[1]).astype(mx.bfloat16)
    C = mx.random.normal((b, T, G, N), key=k[2]).astype(mx.bfloat16)
    dt = mx.random.normal((b, T, H), key=k[3]).astype(mx.bfloat16)
    A_log = mx.log(mx.random.uniform(1.0, 16.0, (H,), key=k[4]))
    bias = mx.log(mx.expm1(mx.random.uniform(0.001, 0.1, (H,), key=k[5])))
    D = mx.ones((H,), mx.bfloat16)
    mx.eval(x, B, C, dt, A_log, bias)
    return x, dt, A_log, bias, B, C, D


def main(T):
    b, H, P, G, N = SHAPE
    x, dt, A_log, bias, B, C, D = layer_inputs(T)
    dtp, A = ssd_gates(dt, A_log, bias, None, (0.0, float("inf")))
    mx.eval(dtp, A)
    S = mx.zeros((b, H, P, N), mx.float32)
    out = {"T": T, "tiles": msl.tiles(P, N, "cuda")}
    out["op_s"] = timed(lambda: run_kernel(x, dtp, A, B, C, D, None, backend="cuda"))
    out["stock_s"] = timed(lambda: ssd_stock(x, dt, A_log, B, C, D, bias, None,
                                             time_step_limit=(0.0, float("inf"))))
    # the steps apart, one segment's launches with the real intermediates
    seg = min(T, msl.SEGMENT)
    xs, dts, Bs, Cs = x[:, :seg], dtp[:, :seg], B[:, :seg], C[:, :seg]
    names = []

    def rec(name, backend, **kw):
        names.append((name, kw))
        from mlx_bricks.kernels import launch
        return launch(name, backend, **kw)

    mx.eval(msl.run_steps(xs, dts, A, Bs, Cs, D.astype(mx.float32), S, mx.bfloat16,
                          backend="cuda", launch=rec))
    from mlx_bricks.kernels import launch
    for name, kw in names:
        out[f"{name}_s_per_segment"] = timed(lambda kw=kw, name=name: launch(name, "cuda", **kw))
    y, _ = run_kernel(x, dtp, A, B, C, D, None, backend="cuda")
    ny, _ = ssd_stock(x, dt, A_log, B, C, D, bias, None, time_step_limit=(0.0, float("inf")))
    out["max_abs_diff_vs_stock"] = mx.abs(y.astype(mx.float32) - ny.astype(mx.float32)).max().item()
    out["ratio"] = out["stock_s"] / out["op_s"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    for t in (sys.argv[1:] or ["2048", "8192"]):
        main(int(t))
