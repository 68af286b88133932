"""Forwards of the 4-layer Nemotron-3-Nano-shaped model (bench.ssm.NEMOTRON3_4LAYER), stock or
patched, warm, between cuProfilerStart and cuProfilerStop (the driver API, so ``nsys profile
--capture-range=cudaProfilerApi`` records only them). Usage on the GPU machine:
nsys profile --capture-range=cudaProfilerApi -o OUT python3 scripts/gpu/profile_forward.py
stock|patched [T] [forwards]."""
import ctypes
import sys

import mlx.core as mx

from nemotron_models import forward, models  # this folder (sys.path[0] as a script)


def main(which, T, n):
    stock, patched, tokens = models(T)
    fwd = forward(patched if which == "patched" else stock, tokens)

    for _ in range(3):
        mx.eval(fwd())
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for _ in range(n):
        mx.eval(fwd())
    mx.synchronize()
    cuda.cuProfilerStop()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(a[0] if a else "patched", int(a[1]) if len(a) > 1 else 2048,
         int(a[2]) if len(a) > 2 else 3)
