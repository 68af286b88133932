"""What the SSD kind's CUDA prior chooses between, timed interleaved on one
Nemotron-3-Nano-shaped Mamba-2 layer (64 heads of 64, 8 groups, N 128, bf16): mlx-lm's
ssm_update (stock), the chunked composite (MLX ops, no build) and the kernel. Usage on the GPU
machine: python3 scripts/gpu/ssd_prior.py [T ...]; prints one JSON line per T (seconds)."""
import json
import sys

import mlx.core as mx

from mlx_bricks.bricks.ssd.op import run_kernel, ssd_chunked, ssd_gates, ssd_stock
from mlx_bricks.tune.timing import time_interleaved
from ssd_steps import layer_inputs  # this folder (sys.path[0] when run as a script)


def main(T):
    x, dt, A_log, bias, B, C, D = layer_inputs(T)
    lim = (0.0, float("inf"))

    def composite():
        dtp, A = ssd_gates(dt, A_log, bias, None, lim)
        return ssd_chunked(x, dtp, A, B, C, D, None)

    def kernel():
        dtp, A = ssd_gates(dt, A_log, bias, None, lim)
        return run_kernel(x, dtp, A, B, C, D, None, backend="cuda")

    fns = {"stock": lambda: ssd_stock(x, dt, A_log, B, C, D, bias, None, time_step_limit=lim),
           "composite": composite, "kernel": kernel}
    ref = fns["stock"]()[0].astype(mx.float32)
    out = {"T": T}
    for n in ("composite", "kernel"):
        got = fns[n]()[0].astype(mx.float32)
        out[f"{n}_max_abs_diff_vs_stock"] = mx.abs(got - ref).max().item()
    t = time_interleaved(fns, repeats=5, min_calls=3, max_calls=10)
    out.update({f"{n}_s": t.median(n) for n in fns})
    out.update({f"{n}_ratio": out["stock_s"] / out[f"{n}_s"] for n in ("composite", "kernel")})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    for t in (sys.argv[1:] or ["512", "2048", "8192"]):
        main(int(t))
