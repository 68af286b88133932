"""Forwards of the 4-layer Nemotron-3-Nano-shaped model (bench.ssm.NEMOTRON3_4LAYER), stock or
patched, warm, between cuProfilerStart and cuProfilerStop (the driver API, so ``nsys profile
--capture-range=cudaProfilerApi`` records only them). Usage on the GPU machine:
nsys profile --capture-range=cudaProfilerApi -o OUT python3 scripts/gpu/profile_forward.py
stock|patched [T] [forwards]."""
import ctypes
import sys

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from mlx_bricks.bench.e2e import _models
from mlx_bricks.bench.ssm import NEMOTRON3_4LAYER
from mlx_bricks.patch import patch_model


def main(which, T, n):
    shape = NEMOTRON3_4LAYER
    stock, patched = _models(shape, "bf16", None)
    model = stock
    if which == "patched":
        patch_model(patched, tune="auto")
        model = patched
    tokens = mx.random.randint(0, shape.vocab, (1, T), key=mx.random.key(T))

    def fwd():  # mlx-lm's prefill step (bench.e2e.MEASURES): cache states, no logits
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        return [c.state for c in cache]

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
