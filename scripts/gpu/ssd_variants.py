"""The SSD CUDA twin's launch geometry variants, timed interleaved in one process on one
Nemotron-3-Nano-shaped Mamba-2 layer (64 heads of 64, 8 groups, N 128, bf16): tokens per chunk,
slice, threads per block, the tensor-core steps' slices and step 2's state elements per thread
(``msl.tiles``, ``msl.THREADS``, ``msl.MMA_SLICE_MAX``, ``msl.STATE_VEC`` replaced per call),
each output against the committed geometry's. Usage
on the GPU machine: python3 scripts/gpu/ssd_variants.py [T ...]; prints one JSON line per T
(seconds per call, medians)."""
import json
import sys

import mlx.core as mx

from mlx_bricks.bricks.ssd import msl
from mlx_bricks.bricks.ssd.op import run_kernel, ssd_gates, ssd_stock
from mlx_bricks.tune.timing import time_interleaved
from ssd_steps import layer_inputs  # this folder (sys.path[0] when run as a script)

VARIANTS = {  # (chunk, slice, threads, tensor-core slices of steps 1 and 3, step 2's VEC)
    "c64_k32_t256_m64_64": (64, 32, 256, (64, 64), 1),  # committed (first: the reference)
    "c64_k32_t256_m64_64_v4": (64, 32, 256, (64, 64), 4),
    "c64_k32_t256_m32_32": (64, 32, 256, (32, 32), 1),
    "c128_k32_t512_m64_32": (128, 32, 512, (64, 32), 1)}


def main(T):
    x, dt, A_log, bias, B, C, D = layer_inputs(T)
    dtp, A = ssd_gates(dt, A_log, bias, None, (0.0, float("inf")))
    mx.eval(dtp, A)
    saved = msl.tiles, msl.THREADS, msl.MMA_SLICE_MAX, msl.STATE_VEC

    def variant(chunk, kt, nt, slices, vec):
        def fn():
            msl.tiles, msl.THREADS = (lambda P, N, backend: (chunk, kt)), nt
            msl.MMA_SLICE_MAX = dict(zip(msl.KERNELS[::2], slices))
            msl.STATE_VEC = {"cuda": vec}
            try:
                return run_kernel(x, dtp, A, B, C, D, None, backend="cuda")
            finally:
                msl.tiles, msl.THREADS, msl.MMA_SLICE_MAX, msl.STATE_VEC = saved
        return fn

    fns = {name: variant(*v) for name, v in VARIANTS.items()}
    fns["stock"] = lambda: ssd_stock(x, dt, A_log, B, C, D, bias, None,
                                     time_step_limit=(0.0, float("inf")))
    out = {"T": T}
    want = next(iter(fns.values()))()[0].astype(mx.float32)
    for name, fn in fns.items():
        try:
            got = fn()[0].astype(mx.float32)
            out[f"{name}_max_abs_diff"] = mx.abs(got - want).max().item()
        except Exception as e:  # noqa: BLE001 - a variant may not build here: say so
            out[f"{name}_error"] = str(e)[:200]
    ok = {n: f for n, f in fns.items() if f"{n}_error" not in out}
    timing = time_interleaved(ok, repeats=7, min_calls=10, max_calls=10)
    for name in ok:
        out[f"{name}_s"] = timing.median(name)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    for t in (sys.argv[1:] or ["2048", "8192"]):
        main(int(t))
