"""Where a patched model's generation differs from stock's (issue 44): one process, one model at
a time, mlx-lm's own ``generate_step`` (its generation stream, async evaluation, 2,048-token
prefill chunks) on the same weights, stock and patched in turn:

* ``stock``: the model before patching (run twice: the first pays MLX's JIT);
* ``cached``: ``patch_model(model)`` (tune ``cached``: the prior / decision cache), bricks prefill;
* ``guard``: the same patched model with its prompt announced to the gate as too short (the
  first-token guard's stock prefill), so only the decode side of the patch remains;
* ``auto``: ``patch_model(model, tune="auto")`` (measured decisions), run twice;
* ``stock_after``: unpatched again (drift control).

Per run: time to first token, generation tok/s (from the first to the last token), the median
and 90th percentile of the time between tokens, peak memory, and the dtypes / shapes of the
cache after the prompt. ``auto`` also records the tuning decisions (per piece, with ratios).

Usage (GPU machine): ``python3 scripts/gpu/decode_probe.py OUT.json [MODEL ...]`` with MODEL in
``qwen35_moe_q4``, ``gpt_oss_mxfp4``, ``llama8b_q4`` (default: all); env PROMPT (tokens,
default 2048), TOKENS (generated, default 128), LAYERS (default 4).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time


def build(name: str, layers: int):
    """A random mlx-lm model of ``name``'s real layer shapes with ``layers`` layers, quantized as
    ``mlx_lm.convert`` would (``mlx_lm.utils.quantize_model``)."""
    import dataclasses

    import mlx.core as mx
    from mlx_lm.utils import quantize_model

    from mlx_bricks.bench.e2e import GPT_OSS_20B_4LAYER, LLAMA_8B_4LAYER
    from mlx_bricks.bench.gated_delta import QWEN35_35B_4LAYER

    shape, mode, gs = {"qwen35_moe_q4": (QWEN35_35B_4LAYER, "affine", 64),
                       "gpt_oss_mxfp4": (GPT_OSS_20B_4LAYER, "mxfp4", 32),
                       "llama8b_q4": (LLAMA_8B_4LAYER, "affine", 64)}[name]
    shape = dataclasses.replace(shape, layers=layers)
    mx.random.seed(0)
    model = shape.model_class()(shape.model_args())
    model.set_dtype(mx.bfloat16)
    model, _ = quantize_model(model, {}, gs, 4, mode=mode)
    mx.eval(model.parameters())
    return model, shape.vocab


def cache_summary(cache) -> list:
    from mlx.utils import tree_flatten

    out = []
    for c in cache:
        arrays = [(str(a.dtype), list(a.shape)) for _, a in tree_flatten(c.state)
                  if hasattr(a, "dtype")]
        out.append([type(c).__name__, arrays])
    return out


def run(model, prompt, tokens: int, *, guard: bool = False) -> dict:
    """One ``generate_step`` over ``prompt``: TTFT, generation tok/s, token gaps, peak."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_bricks.nn.gate import model_gate

    gate = model_gate(model)
    if gate is not None:
        gate.min_prompt = float("inf") if guard else 0
        gate.expect_prompt(prompt.size)
    cache = make_prompt_cache(model)
    mx.synchronize()
    mx.reset_peak_memory()
    stamps = []
    t0 = time.perf_counter()
    for (tok, _), _n in zip(generate_step(prompt, model, max_tokens=tokens,
                                          prompt_cache=cache), range(tokens)):
        tok.item() if hasattr(tok, "item") else tok
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    gaps.sort()
    out = {"ttft_s": stamps[0] - t0,
           "gen_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
           "gap_median_ms": 1e3 * statistics.median(gaps),
           "gap_p90_ms": 1e3 * gaps[int(0.9 * (len(gaps) - 1))],
           "peak_gb": mx.get_peak_memory() / 1e9, "cache": cache_summary(cache)}
    if gate is not None:
        gate.min_prompt = 0
        gate.stock_prompt = False
    return out


def probe(name: str, P: int, N: int, layers: int) -> dict:
    import mlx.core as mx

    from mlx_bricks.patch import patch_model, unpatch_model

    model, vocab = build(name, layers)
    prompt = mx.random.randint(0, vocab, (P,), key=mx.random.key(1))
    res = {"model": name, "prompt": P, "tokens": N, "layers": layers, "runs": {}}
    runs = res["runs"]

    def step(tag, fn):
        try:
            runs[tag] = fn()
        except Exception as e:  # a probe: record and go on
            runs[tag] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(name, tag, {k: v for k, v in runs[tag].items() if k != "cache"}, flush=True)

    step("stock_warmup", lambda: run(model, prompt, N))
    step("stock", lambda: run(model, prompt, N))
    report = patch_model(model)
    res["cached_report"] = {"n_patched": report.n_patched, "backend": report.backend.name}
    step("cached", lambda: run(model, prompt, N))
    step("cached_2", lambda: run(model, prompt, N))
    step("guard", lambda: run(model, prompt, N, guard=True))
    unpatch_model(model)
    report = patch_model(model, tune="auto")
    step("auto", lambda: run(model, prompt, N))
    step("auto_2", lambda: run(model, prompt, N))
    res["auto_tuning"] = report.tuning()
    res["auto_calls"] = {"calls": dict(report.calls()),
                         "stock_calls": dict(report.stock_calls()),
                         "tuned_stock_calls": dict(report.tuned_stock_calls())}
    unpatch_model(model)
    step("stock_after", lambda: run(model, prompt, N))
    mx.clear_cache()  # the model goes with this frame
    return res


def main(argv) -> int:
    import mlx.core as mx
    import mlx_lm

    out = argv[0]
    names = argv[1:] or ["qwen35_moe_q4", "gpt_oss_mxfp4", "llama8b_q4"]
    P = int(os.environ.get("PROMPT", 2048))
    N = int(os.environ.get("TOKENS", 128))
    layers = int(os.environ.get("LAYERS", 4))
    doc = {"date": time.strftime("%Y-%m-%d"), "mlx": mx.__version__,
           "mlx_lm": mlx_lm.__version__, "device": mx.device_info().get("device_name"),
           "models": []}
    for name in names:
        doc["models"].append(probe(name, P, N, layers))
        with open(out, "w") as f:
            json.dump(doc, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
