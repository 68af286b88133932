"""Memory of a long prefill with three KV caches: mlx-lm's float16 ``KVCache``, mlx-lm's affine
``QuantizedKVCache(group_size=64, bits=8)`` and :class:`mlx_bricks.cache.Q8KVCache`.

    python -m mlx_bricks.tools.kv_memory [--model DIR] [--tokens 16384] [--chunk 2048]
                                         [--layers N] [--backend reference] [--out FILE]
                                         [--kinds fp16 affine8 q8_0]

Each cache runs in its own process (a clean allocator): the model is loaded, ``--tokens``
random token ids are prefilled in chunks of ``--chunk`` as mlx-lm's ``generate_step`` does
(model call, ``mx.eval`` of every cache's state, ``mx.clear_cache()``; the last chunk's final
logits evaluated), and it reports ``mx.get_peak_memory()`` over the prefill, the memory held
before it (weights), the cache's bytes as its arrays say (``nbytes``, allocated capacity) and
the bytes per token and layer. ``--layers N`` keeps the first N decoder layers (a cheaper run
with the same per-layer shapes, for CPUs too slow for the whole model); ``--kinds`` picks the
caches (affine8 takes over 30 minutes at 8k tokens on a 2-core CPU). Q8_0 layers attend
through :mod:`mlx_bricks.tools.kv_driver` (the same route as ``patch_model(kv_cache="q8_0")``,
without patching the rest of the model); the other two caches take mlx-lm's stock attention.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

KINDS = ("fp16", "affine8", "q8_0")


def _cache(model, kind: str, backend):
    from mlx_lm.models.cache import QuantizedKVCache
    from mlx_lm.models.cache import make_prompt_cache as stock

    from mlx_bricks.cache import make_prompt_cache

    if kind == "fp16":
        return stock(model)
    if kind == "affine8":
        return [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers]
    return make_prompt_cache(model, "q8_0", backend=backend)


def _truncate(model, n_layers: int | None) -> None:
    if n_layers is None:
        return
    inner = getattr(model, "model", model)
    if not 1 <= n_layers <= len(inner.layers):
        raise ValueError(f"--layers must be in 1..{len(inner.layers)}, got {n_layers}")
    inner.layers = inner.layers[:n_layers]


def measure_one(kind: str, model_dir: str, n_tokens: int, chunk: int, backend,
                n_layers: int | None = None) -> dict:
    """Prefill ``n_tokens`` random tokens with cache ``kind`` in this process; the numbers."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm import load

    from mlx_bricks.tools.kv_driver import q8_0_attention

    model, _ = load(model_dir)
    _truncate(model, n_layers)
    mx.eval(model.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    vocab = model.args.vocab_size
    tokens = mx.array(np.random.default_rng(0).integers(0, vocab, n_tokens), mx.uint32)
    cache = _cache(model, kind, backend)
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    t0 = time.perf_counter()
    with q8_0_attention(model):
        for lo in range(0, n_tokens, chunk):
            logits = model(tokens[None, lo:lo + chunk], cache=cache)
            if lo + chunk < n_tokens:
                mx.eval([c.state for c in cache])
                mx.clear_cache()
        mx.eval(logits[:, -1], [c.state for c in cache])
    seconds = time.perf_counter() - t0
    peak = mx.get_peak_memory()
    cache_bytes = sum(c.nbytes for c in cache)
    capacity = cache[0].keys[0].shape[2] if kind != "fp16" else cache[0].keys.shape[2]
    return {
        "cache": kind, "cache_class": type(cache[0]).__name__,
        "tokens": n_tokens, "prefill_chunk": chunk, "layers": len(cache),
        "held_before_bytes": before, "weights_bytes": weights,
        "peak_bytes": peak, "peak_above_held_bytes": peak - before,
        "cache_bytes": cache_bytes, "cache_capacity_tokens": capacity,
        "cache_bytes_per_token_per_layer": cache_bytes / capacity / len(cache),
        "prefill_seconds": round(seconds, 2),
    }


def measure(model_dir: str | None = None, n_tokens: int = 16384, chunk: int = 2048,
            backend: str | None = "reference", n_layers: int | None = None,
            kinds: tuple[str, ...] = KINDS) -> dict:
    """Run :func:`measure_one` for each of ``kinds`` (fp16 among them: the ratios' base), each
    in a fresh process.

    Raises:
        ValueError: ``kinds`` lacks fp16 or names an unknown kind.
    """
    if "fp16" not in kinds or set(kinds) - set(KINDS):
        raise ValueError(f"kinds must include 'fp16' and be among {KINDS}, got {kinds}")
    import mlx_bricks
    from mlx_bricks.tools.kv_accuracy import _versions

    versions = _versions()  # before the runs: the commit that runs
    model_dir = str(model_dir or mlx_bricks.default_model())
    runs = []
    for kind in kinds:
        cmd = [sys.executable, "-m", "mlx_bricks.tools.kv_memory", "--one", kind,
               "--model", model_dir, "--tokens", str(n_tokens), "--chunk", str(chunk),
               "--backend", str(backend)]
        if n_layers is not None:
            cmd += ["--layers", str(n_layers)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    fp16 = next(r for r in runs if r["cache"] == "fp16")
    for r in runs:
        r["cache_bytes_vs_fp16"] = r["cache_bytes"] / fp16["cache_bytes"]
        r["peak_vs_fp16"] = r["peak_bytes"] / fp16["peak_bytes"]
    import datetime

    return {"what": "peak memory of a long prefill per KV cache kind (mx.get_peak_memory)",
            "date": datetime.date.today().isoformat(), "versions": versions,
            "model": model_dir, "layers_kept": n_layers, "backend": backend, "runs": runs}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlx_bricks.tools.kv_memory",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="mlx-lm model directory (default: the "
                   "embedded default model)")
    p.add_argument("--tokens", type=int, default=16384, help="prefill length (default 16384)")
    p.add_argument("--chunk", type=int, default=2048,
                   help="prefill chunk (default 2048, mlx-lm's prefill_step_size)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep only the first N decoder layers (default: all)")
    p.add_argument("--backend", default="reference",
                   help="bricks backend of the Q8_0 attention (default reference)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                   help="caches to measure (default: all three; fp16 is required)")
    p.add_argument("--one", choices=KINDS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="write the JSON here too")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    backend = None if args.backend == "None" else args.backend
    if args.one:
        print(json.dumps(measure_one(args.one, args.model, args.tokens, args.chunk, backend,
                                     args.layers)))
        return 0
    if "fp16" not in args.kinds:
        build_parser().error("--kinds must include fp16 (the base of the ratios)")
    text = json.dumps(measure(args.model, args.tokens, args.chunk, backend, args.layers,
                              tuple(args.kinds)), indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
