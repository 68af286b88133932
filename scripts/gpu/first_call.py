"""Where a process's first patched prefill loses time against stock's (GPU machine).

Issue 33: in one fresh process with cached decisions, the first 2,048-token prefill of a
32-layer 8B-shaped 4-bit model took 0.62 s against stock's 0.48 s, later ones 0.08 vs 0.24 s.
This splits that one-off cost: call times of four prefills (three prompts of
FIRST_CALL_CHUNKS calls when it is above 1), per-layer times of the first two (``mx.eval`` after
each layer), stock and patched (``tune="cached"``, empty decision cache: the prior), each in its
own fresh process; and, in another fresh process, the first and second call of each op the
composites and stock run (``mx.dequantize``, the bfloat16 GEMM, ``mx.quantized_matmul``) at the
model's weight shapes.

Usage (PYTHONPATH with MLX's CUDA build, as scripts/gpu/user_path.sh sets it):
  python scripts/gpu/first_call.py write DIR [LAYERS]   # the model directory (default 32)
  python scripts/gpu/first_call.py run DIR stock|bricks  # one JSON line
  python scripts/gpu/first_call.py ops                   # one JSON line
Env: FIRST_CALL_M (tokens per call, default 2048), FIRST_CALL_CHUNKS (calls per prompt into one
cache, default 1).
"""
from __future__ import annotations

import json
import os
import sys
import time

import mlx.core as mx

M = int(os.environ.get("FIRST_CALL_M", "2048"))
#: Chunks of M tokens per prompt, one cache (mlx_lm.generate's prefill of CHUNKS x M tokens).
CHUNKS = int(os.environ.get("FIRST_CALL_CHUNKS", "1"))
SHAPES = {"q_o": (4096, 4096), "k_v": (1024, 4096), "gate_up": (14336, 4096),
          "down": (4096, 14336)}


def _sync_time(fn):
    t = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t


def write(path, layers=None):
    from mlx_bricks.bench.user_models import GPU_MODELS, write_model

    spec = GPU_MODELS["llama3_8b_q4"].with_layers(layers)
    print(json.dumps(write_model(spec, path, ".bench-tok")))


class _Timed:
    """Stands in for a decoder layer: runs it, then waits for its output."""

    def __init__(self, inner, times):
        self.inner, self.times = inner, times

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.inner(*args, **kwargs)
        mx.eval(out)
        mx.synchronize()
        self.times.append(time.perf_counter() - t)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(path, mode):
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    model, _ = mlx_lm.load(path)
    doc = {"mode": mode, "load_s": time.perf_counter() - t0}
    if mode == "bricks":
        from mlx_bricks import patch_model

        t = time.perf_counter()
        report = patch_model(model, tune="cached")
        doc["patch_s"] = time.perf_counter() - t
    x = mx.random.randint(0, 32000, (1, M))
    mx.eval(x)
    doc["chunks"], doc["calls_s"], doc["layers_s"] = CHUNKS, [], []
    for i in range(3 if CHUNKS > 1 else 4):  # prompts of CHUNKS x M tokens, one fresh cache each
        cache = make_prompt_cache(model)
        timed = i in (0, 1)
        layers = model.layers
        saved = list(layers)
        chunk_s = []
        for _ in range(CHUNKS):
            times = []
            if timed:
                for j, layer in enumerate(saved):
                    layers[j] = _Timed(layer, times)
            try:
                # what mlx_lm.generate's prefill waits for: the caches, not the logits
                chunk_s.append(round(_sync_time(
                    lambda: (model(x, cache=cache), [c.state for c in cache])[1]), 4))
            finally:
                layers[:] = saved
            if timed:
                doc["layers_s"].append([round(s, 4) for s in times])
        doc["calls_s"].append(chunk_s if CHUNKS > 1 else chunk_s[0])
    doc["peak_gb"] = mx.get_peak_memory() / 1e9
    if mode == "bricks":
        doc["calls"], doc["stock_calls"] = dict(report.calls()), dict(report.stock_calls())
    print(json.dumps(doc))


def ops():
    doc = {}
    x = mx.random.normal((M, 4096)).astype(mx.bfloat16)
    xd = mx.random.normal((M, 14336)).astype(mx.bfloat16)
    for name, (N, K) in SHAPES.items():
        w = mx.random.normal((N, K)).astype(mx.bfloat16)
        wq, s, b = mx.quantize(w, group_size=64, bits=4)
        mx.eval(w, wq, s, b)
        xi = xd if K == 14336 else x
        for op, fn in (("dequantize", lambda: mx.dequantize(wq, s, b, 64, 4)),
                       ("matmul_bf16", lambda: xi @ w.T),
                       ("quantized_matmul", lambda: mx.quantized_matmul(xi, wq, s, b, True,
                                                                        64, 4))):
            doc[f"{name}/{op}"] = [round(_sync_time(fn), 4) for _ in range(3)]
    print(json.dumps(doc))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "write":
        write(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else None)
    elif cmd == "run":
        run(sys.argv[2], sys.argv[3])
    elif cmd == "ops":
        ops()
    else:
        raise SystemExit(f"command must be write, run or ops, got {cmd!r}")
