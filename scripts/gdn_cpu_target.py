"""Issue 36's CPU target: a 4-layer Qwen3.5-shaped model (hidden 512, 16/32 Gated DeltaNet heads
of 128, 3 Gated DeltaNet layers + 1 attention layer), 512-token prefill in bf16, stock mlx-lm vs
``patch_model`` (auto backend: no kernel backend here, so the tuned composites), and the logits'
distance to a float32 truth (the same weights, stock, float32).

    PYTHONPATH=$PWD python scripts/gdn_cpu_target.py [--tokens 512] [--repeats 3]

Prints wall and process-CPU seconds per prefill (median of the repeats, stock and patched
interleaved) and the max |logits - truth| of each side. The CPU time is the steadier figure on a
shared machine.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.bench.gated_delta import QWEN35_SMALL_4LAYER as shape
    from mlx_bricks.patch import patch_model

    mx.random.seed(0)
    Model = shape.model_class()
    truth_model = Model(shape.model_args())
    mx.eval(truth_model.parameters())
    stock = Model(shape.model_args())
    stock.update(truth_model.parameters())
    stock.set_dtype(mx.bfloat16)
    patched = Model(shape.model_args())
    patched.update(stock.parameters())
    mx.eval(stock.parameters())
    tokens = mx.random.randint(0, shape.vocab, (1, a.tokens), key=mx.random.key(1))

    def forward(model):
        out = model(tokens, cache=make_prompt_cache(model))
        mx.eval(out)
        return out

    truth = forward(truth_model)
    t0 = time.time()
    report = patch_model(patched)
    ref = forward(stock)
    out = forward(patched)  # first call: tuning (decision cache) happens here
    print(f"patch + first patched call + one stock call: {time.time() - t0:.1f} s")
    print(report)
    times = {"stock": [], "patched": []}
    for _ in range(a.repeats):
        for name, model in (("stock", stock), ("patched", patched)):
            w, c = time.time(), time.process_time()
            forward(model)
            times[name].append((time.time() - w, time.process_time() - c))
    for name, ts in times.items():
        print(f"{name}: wall {statistics.median(t[0] for t in ts):.3f} s, "
              f"cpu {statistics.median(t[1] for t in ts):.3f} s")
    ws, cs = (statistics.median(t[i] for t in times["stock"]) for i in (0, 1))
    wp, cp = (statistics.median(t[i] for t in times["patched"]) for i in (0, 1))
    print(f"speedup: wall x{ws / wp:.2f}, cpu x{cs / cp:.2f}")
    t = np.array(truth.astype(mx.float32))
    for name, o in (("stock", ref), ("patched", out)):
        print(f"{name}: max |logits - float32 truth| = "
              f"{np.abs(np.array(o.astype(mx.float32)) - t).max():.4f}")
    top = np.argmax(t, -1)
    for name, o in (("stock", ref), ("patched", out)):
        agree = float((np.array(mx.argmax(o, -1)) == top).mean())
        print(f"{name}: greedy token == float32 truth's at {agree:.1%} of positions")
    same = float((np.array(mx.argmax(out, -1)) == np.array(mx.argmax(ref, -1))).mean())
    print(f"patched == stock greedy token at {same:.1%} of positions")


if __name__ == "__main__":
    main()
