"""One rank of the tensor-parallel patch test (``tests/test_shard.py``).

Started as ``python -m tests.shard_worker OUT_DIR`` by ``tests.launch.launch_local``
(ring backend over loopback, 2 ranks). For each case every rank builds the same tiny random
model (seeded), keeps a float64 copy of the whole (unsharded) model as the reference, shards
the model with mlx-lm's own ``Model.shard(group)``, runs it stock (logits of a prompt, greedy
tokens through ``generate_step``), patches it on the reference backend (named) and runs it
again. It writes ``OUT_DIR/rank<r>.json`` with the numbers; the test asserts on them, so a
failure shows in pytest with the values. A rank that cannot join the group writes
``{"init_error": ...}`` and exits with 3 (the test then skips with that reason).
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.generate import generate_step, generation_stream

from mlx_bricks.bench.shard import run_rank
from mlx_bricks.patch import patch_model
from mlx_bricks.tune.check import EPS, CloseResult, dtype_close, to_f64
from tests.models import build_model, clone, tokens

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16}
#: (name, model_type, ModelArgs overrides, fuse_block, dtype)
CASES = (
    ("llama-block", "llama", {}, True, "float32"),
    ("llama-bias-unfused", "llama", {"attention_bias": True, "mlp_bias": True}, False,
     "float32"),
    ("llama-bias-block-bf16", "llama", {"attention_bias": True, "mlp_bias": True}, True,
     "bfloat16"),
    ("qwen3-block", "qwen3", {}, True, "float32"),
    ("qwen3-unfused", "qwen3", {}, False, "float32"),
    # nn.quantize (4-bit, group 32) then shard: the quantized tensor-parallel linears
    ("llama-q4-block", "llama", {"quantize": 4}, True, "float32"),
)
PROMPT = 33
N_GREEDY = 8


def _run(model, toks, cache=None):
    out = model(toks, cache=cache)
    mx.eval(out)
    return out


def _greedy(model, prompt) -> list[int]:
    out = [int(t) for t, _ in generate_step(prompt, model, max_tokens=N_GREEDY)]
    # generate_step runs on its own stream and leaves the step after the last token in flight
    # (async_eval): wait for it, or its all_sums would run beside the next forward's on the
    # default stream, and the two ranks could pair different collectives.
    mx.synchronize(generation_stream)
    return out


def _tie(full, dt, prompt: list[int], stock: list[int], patched: list[int]) -> dict:
    """Where the greedy tokens first differ: is it a rounding tie (float64 of the unsharded
    model prefers neither token by more than stock's own error, x2 + 4 ulps)?"""
    t = next((i for i, (a, b) in enumerate(zip(stock, patched)) if a != b), None)
    if t is None:
        return {"first_diff": None, "tie": True}
    ctx = mx.array(prompt + stock[:t])[None]
    with mx.stream(mx.cpu):
        ref = to_f64(_run(clone(full, mx.float64), ctx)[0, -1])
    naive = to_f64(_run(clone(full, dt), ctx)[0, -1])
    margin = abs(ref[stock[t]] - ref[patched[t]])
    budget = 2 * np.abs(naive - ref).max() + 4 * EPS[dt] * max(1.0, np.abs(ref).max())
    return {"first_diff": t, "tie": bool(margin <= budget), "margin": float(margin),
            "budget": float(budget)}


def run_case(group, name, arch, overrides, fuse_block, dtype) -> dict:
    dt = DTYPES[dtype]
    overrides = dict(overrides)
    bits = overrides.pop("quantize", None)
    model = build_model(arch, dt, **overrides)
    toks = tokens(PROMPT)
    if bits is None:
        full = clone(model, dt)  # the unsharded model (same values), for the tie check
        with mx.stream(mx.cpu):
            ref = _run(clone(model, mx.float64), toks)
    else:  # quantized: no float64 twin; patched is compared with stock on the same weights
        nn.quantize(model, group_size=32, bits=bits)  # 32: the local K of down is 160
        full = ref = None
    shapes = {"q_proj_full": list(model.layers[0].self_attn.q_proj.weight.shape),
              "gate_proj_full": list(model.layers[0].mlp.gate_proj.weight.shape),
              "o_proj_full": list(model.layers[0].self_attn.o_proj.weight.shape)}
    model.shard(group)
    attn = model.layers[0].self_attn
    shapes.update(q_proj=list(attn.q_proj.weight.shape), o_proj=list(attn.o_proj.weight.shape),
                  gate_proj=list(model.layers[0].mlp.gate_proj.weight.shape),
                  n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads,
                  classes=sorted({type(m).__name__ for m in model.modules()
                                  if "Sharded" in type(m).__name__}))
    stock = _run(model, toks)
    stock_tokens = _greedy(model, toks[0])
    report = patch_model(model, backend="reference", fuse_block=fuse_block)
    patched = _run(model, toks)
    patched_tokens = _greedy(model, toks[0])
    if ref is None:  # the reference backend computes the quantized products as stock does
        err = float(mx.abs(patched - stock).max())
        close = CloseResult(ok=err <= 1e-4 * max(1.0, float(mx.abs(stock).max())), error=err,
                            budget=1e-4 * max(1.0, float(mx.abs(stock).max())), naive_error=0.0)
    else:
        close = dtype_close(patched, ref, stock, dtype=dt)
    modules = [{"layer": m.layer, "module": m.module, "status": m.status,
                "bricks": list(m.bricks), "calls": dict(m.calls), "reason": m.reason,
                "stock_calls": dict(m.state.stock) if m.state is not None else {}}
               for m in report.modules]
    keys = sorted({str(c.key) for m in report.modules if m.state is not None
                   for _, choices in m.state.memo.values() for c in choices.values()})
    return {
        "name": name, "arch": arch, "dtype": dtype, "fuse_block": fuse_block,
        "shapes": shapes,
        "logits_ok": bool(close.ok), "error": float(close.error), "budget": float(close.budget),
        "naive_error": float(close.naive_error),
        "max_abs_patched_vs_stock": float(mx.abs(patched.astype(mx.float32)
                                                 - stock.astype(mx.float32)).max()),
        "patched_sha": hashlib.sha256(np.array(patched.astype(mx.float32)).tobytes())
        .hexdigest(),
        "stock_tokens": stock_tokens, "patched_tokens": patched_tokens,
        "tie": (_tie(full, dt, toks[0].tolist(), stock_tokens, patched_tokens)
                if full is not None else {"first_diff": None, "tie": False}),
        "modules": modules, "keys": keys,
    }


def main(out_dir: str) -> int:
    rank = "?"
    try:
        group = mx.distributed.init(strict=True, backend="ring")
        rank = group.rank()
        check = mx.distributed.all_sum(mx.array([1.0]), group=group)
        mx.eval(check)
    except RuntimeError as e:  # MLX raises RuntimeError when the ring cannot be formed
        path = Path(out_dir) / f"rank{rank}-init.json"
        path.write_text(json.dumps({"init_error": f"{type(e).__name__}: {e}"}))
        return 3  # the launcher then stops the other rank (waiting to accept it)
    out = {"rank": rank, "size": group.size(), "all_sum_check": float(check[0]),
           "cases": [run_case(group, *case) for case in CASES],
           # tests/test_shard_gpu.py's rank side, tiny, on this group
           "bench": run_rank(shape_name="tiny", dtype="bf16", M=32, backend="reference",
                             tune="off", repeats=1, group=group)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
