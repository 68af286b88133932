"""Where the patched quantized prefill's extra peak memory comes from (GPU machine).

The composites dequantize each weight in row tiles of at most the cap (256 MiB), one tile after
the other (``mx.depends``), and on the CPU the peak stays within it. On the H200 a warm patched
8B-shaped 4-layer prefill still peaked 1.5-2.9 GB above stock (bench/results/
2026-12-03-h200-e2e-quant.json). Hypothesis: a GPU backend keeps every buffer a queued command
uses alive until that command has run, and the host enqueues a whole forward ahead of the GPU,
so all layers' dequantized tiles are alive at once. This measures, per M, the warm peak
(``mx.get_peak_memory`` minus the active memory before) and the time of: stock; patched; patched
with a host barrier (``mx.eval``) after each composite call; patched with one each time the bytes
dequantized since the last pass 1 or 4 times the cap; patched with one after each layer.

Usage: python scripts/gpu/peak_probe.py OUT.json [M ...]
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import os

import mlx.core as mx
import mlx_lm

from mlx_bricks.bench import e2e
from mlx_bricks.bricks.dequantize import composite


def peak(fn):
    mx.eval(fn())
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return (mx.get_peak_memory() - before) / 2**20


def timed(fn, rounds=5, calls=4):
    runs = []
    for _ in range(rounds):
        mx.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            mx.eval(fn())
        mx.synchronize()
        runs.append((time.perf_counter() - t) / calls)
    return statistics.median(runs) * 1e3


def main():
    out_path = sys.argv[1]
    ms = [int(a) for a in sys.argv[2:]] or [512, 2048, 8192]
    orig_linear = composite.DenseTiles.linear

    def barrier_linear(self, *a, **k):
        y = orig_linear(self, *a, **k)
        try:
            mx.eval(y)
        except RuntimeError:  # under a transformation (mx.compile): no barrier
            pass
        return y

    def budget_barrier(linear, caps):
        """``DenseTiles.linear`` with a barrier once the float bytes dequantized since the
        last barrier pass ``caps`` times the cap: the candidate default (docs/bench.md)."""
        since = [0]

        def run(self, x, weights, *a, **k):
            y = linear(self, x, weights, *a, **k)
            since[0] += sum(w.shape[0] * w.shape[1] for w in weights) * x.dtype.size
            if since[0] >= caps * self.cap:
                try:
                    mx.eval(y)
                    since[0] = 0
                except RuntimeError:  # under a transformation (mx.compile): no barrier
                    pass
            return y
        return run

    shape = e2e.SMALL_LLAMA if os.environ.get("PROBE_SMALL") else e2e.LLAMA_8B_4LAYER
    results = []
    for M in ms:
        brick, stock, info = e2e.setup(shape, "bf16", M, fmt=(4, 64))
        mx.eval(brick())  # tunes
        row = {"M": M, "tuning": info().get("tuning")}
        row["stock"] = {"peak_mib": peak(stock), "ms": timed(stock)}
        row["patched"] = {"peak_mib": peak(brick), "ms": timed(brick)}
        composite.DenseTiles.linear = barrier_linear
        row["patched_barrier_per_call"] = {"peak_mib": peak(brick), "ms": timed(brick)}
        for budget in (1, 4):  # a barrier once the bytes dequantized since the last pass
            composite.DenseTiles.linear = budget_barrier(orig_linear, budget)
            row[f"patched_barrier_per_{budget}_cap"] = {"peak_mib": peak(brick),
                                                         "ms": timed(brick)}
        composite.DenseTiles.linear = orig_linear
        model = e2e._models(shape, "bf16", (4, 64))[1]
        layers = model.model.layers
        calls = [type(layer).__call__ for layer in layers]
        cls = type(layers[0])
        orig_call = cls.__call__

        def layer_barrier(self, *a, **k):
            h = orig_call(self, *a, **k)
            mx.eval(h)
            return h
        cls.__call__ = layer_barrier
        row["patched_barrier_per_layer"] = {"peak_mib": peak(brick), "ms": timed(brick)}
        row["stock_barrier_per_layer"] = {"peak_mib": peak(stock), "ms": timed(stock)}
        cls.__call__ = orig_call
        del calls
        print(json.dumps({k: v for k, v in row.items() if k != "tuning"}), flush=True)
        results.append(row)
    json.dump({"date": time.strftime("%Y-%m-%d"), "mlx": mx.__version__,
               "mlx_lm": mlx_lm.__version__, "device": str(mx.device_info()),
               "model": "8B-shaped llama, 4 layers, bf16, 4-bit gs64", "results": results},
              open(out_path, "w"), indent=1)


if __name__ == "__main__":
    main()
