"""Decode attention brick and Q8_0 KV cache on the GPU machine: one run (< 3 min on an H200),
a table on stdout, JSON.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/decode_cuda_check.py --out $OUT/decode.json

1. correctness (``cuda`` backend): the decode sweep of tests/test_decode_attention.py (Lk 1, 31,
   32, 33, 1000; GQA 1/4/8; head_dim 64/128/256; float16/bfloat16/float32; Q8_0 on/off; splits
   None/3/7; Lq 1/3/8 causal) against a float64 numpy attention with the tests' dtype-scaled
   rule: covering cases first, then the rest in a fixed hash order until ``--budget-s`` (NVRTC
   compiles each template variant once; the whole product needs about 90 variants).
2. timings, same process, median of repeats (``time_op``: 50 calls' graphs built, then one
   ``mx.eval`` between ``mx.synchronize`` calls, after a warm-up round): decode (Lq = 1) at
   head_dim 128, 32 query / 8 KV heads, contexts 4k / 32k / 128k: the brick over Q8_0 K/V, the brick over float16 K/V, and
   stock ``mx.fast.scaled_dot_product_attention`` over float16 K/V; bytes of K/V read and GB/s;
   a split-count sweep at 32k; GQA 8 (64 / 8 heads) and a 4-token draft (Lq = 4, causal).
3. model: an 8B-shaped 4-layer llama (random bf16 weights), 16k-token prefill in chunks of 2048
   with mlx-lm's float16 ``KVCache`` (stock), ``QuantizedKVCache(bits=8, group_size=64)`` (stock)
   and ``Q8KVCache`` (Q8_0 layers through ``mlx_bricks.tools.kv_driver``): peak memory
   (``mx.get_peak_memory``), cache bytes, decode step time, logits vs the float16 cache; errors
   (mlx-lm issue: the affine 8-bit cache has no CUDA quantized_matmul for decode) are recorded.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Backend of the bricks ("cuda" on the GPU machine; --backend for a dry run elsewhere).
BACKEND = "cuda"
#: --dry-run divides contexts and model sizes so the script's logic can be run on a CPU.
SHRINK = 1


# ---------------------------------------------------------------------------------------------
# 1. correctness


def attention64(q, k, v, scale, causal):
    import numpy as np

    Lq, Lk = q.shape[2], k.shape[2]
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if causal:
        visible = np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + (Lk - Lq)
        s = np.where(visible, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    return np.matmul(p, v) / np.where(l > 0, l, 1.0)


def sweep_cases():
    """(covering, rest): the test module's cases, without importing pytest."""
    import itertools

    import mlx.core as mx

    F16, BF16, F32 = mx.float16, mx.bfloat16, mx.float32
    covering = [
        (1, 1, 1, (4, 4), 64, F16, True, 7, True),
        (1, 3, 31, (8, 2), 128, BF16, False, None, True),
        (2, 8, 32, (8, 1), 256, F32, True, 3, True),
        (1, 1, 33, (8, 1), 128, F16, False, 3, True),
        (1, 1, 1000, (8, 2), 64, F32, True, None, True),
        (1, 8, 1000, (4, 4), 256, BF16, True, 7, True),
        (1, 3, 33, (4, 4), 80, F16, False, 7, True),
        (1, 1, 100, (8, 2), 96, BF16, True, 3, True),
        (1, 2, 64, (8, 2), 192, F32, True, 5, True),
        (1, 1, 65, (8, 1), 512, F16, True, 2, True),
        (1, 4, 40, (8, 2), 128, F32, False, 3, False),
        (1, 1, 32768 // SHRINK, (32, 8), 128, F16, True, None, True),
    ]
    rest = []
    for D, dt, q8, Lk, heads, splits, Lq in itertools.product(
            (64, 128, 256), (F16, BF16, F32), (False, True), (1, 31, 32, 33, 1000),
            ((4, 4), (8, 2), (8, 1)), (None, 3, 7), (1, 3, 8)):
        if Lq > Lk and Lq != 1:
            continue
        rest.append((1, min(Lq, Lk), Lk, heads, D, dt, q8, splits, True))
    rest.sort(key=lambda c: zlib.crc32(repr(c).encode()))
    return covering, rest


def check_case(case) -> dict:
    import mlx.core as mx
    import numpy as np

    from mlx_bricks.bricks.decode.op import decode_attention
    from mlx_bricks.bricks.q8_0.op import quantize_q8_0_reference
    from tests.tolerance import assert_dtype_close

    B, Lq, Lk, (Hq, Hkv), D, dtype, q8, splits, causal = case
    rng = np.random.default_rng(zlib.crc32(repr(case).encode()))

    def rand(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)

    q, k, v = rand(B, Hq, Lq, D), rand(B, Hkv, Lk, D), rand(B, Hkv, Lk, D)
    scale, mask = D ** -0.5, ("causal" if causal else None)

    def f64(x):
        return np.array(x.astype(mx.float32)).astype(np.float64)

    if q8:
        kq, vq = quantize_q8_0_reference(k), quantize_q8_0_reference(v)

        def deq(t):
            qs, d = f64(t[0]), f64(t[1])
            return (qs.reshape(*qs.shape[:-1], -1, 32) * d[..., None]).reshape(qs.shape)

        k64, v64 = deq(kq), deq(vq)
        k_in, v_in = kq, vq
    else:
        k64, v64, k_in, v_in = f64(k), f64(v), k, v
    out = decode_attention(q, k_in, v_in, scale=scale, mask=mask,
                           kv_quant="q8_0" if q8 else None, splits=splits, backend=BACKEND)
    ref = attention64(f64(q), k64, v64, scale, causal)
    kn = mx.array(k64.astype(np.float32)).astype(dtype)
    vn = mx.array(v64.astype(np.float32)).astype(dtype)
    rep = Hq // Hkv
    s = (q @ mx.repeat(kn, rep, axis=1).swapaxes(-1, -2)) * scale
    if causal:
        vis = mx.arange(Lk)[None, :] <= mx.arange(Lq)[:, None] + (Lk - Lq)
        s = s + mx.where(vis, 0.0, -float("inf")).astype(dtype)
    naive = mx.softmax(s, axis=-1) @ mx.repeat(vn, rep, axis=1)
    err = float(np.abs(f64(out) - ref).max())
    try:
        assert_dtype_close(out, ref, naive, dtype=dtype, what=repr(case))
        ok, msg = True, ""
    except AssertionError as e:
        ok, msg = False, str(e)
    return {"case": repr(case), "ok": ok, "max_abs_err": err, "message": msg}


def correctness(budget_s: float) -> dict:
    covering, rest = sweep_cases()
    t0 = time.time()
    results, stopped = [], False
    for i, case in enumerate(covering + rest):
        if i >= len(covering) and time.time() - t0 > budget_s:
            stopped = True
            break
        try:
            r = check_case(case)
        except Exception as e:  # noqa: BLE001  (a GPU run must record every failure and go on)
            r = {"case": repr(case), "ok": False, "message": f"{type(e).__name__}: {e}"}
        results.append(r)
        if not r["ok"]:
            print(f"FAIL {r['case']}: {r['message'][:300]}", flush=True)
    n_ok = sum(r["ok"] for r in results)
    print(f"correctness: {n_ok}/{len(results)} ok ({len(covering) + len(rest)} in the sweep, "
          f"{time.time() - t0:.0f} s)", flush=True)
    return {"run": len(results), "ok": n_ok, "total": len(covering) + len(rest),
            "stopped_by_budget": stopped, "seconds": round(time.time() - t0, 1),
            "failures": [r for r in results if not r["ok"]],
            "max_abs_err": max((r.get("max_abs_err", 0.0) for r in results), default=0.0)}


# ---------------------------------------------------------------------------------------------
# 2. timings


def kv_bytes(Hkv, Lk, D, q8, B=1) -> int:
    """Bytes of K and V read by one decode step: Q8_0 D + 2 D / 32 per row, float16 2 D."""
    per_row = D + 2 * (D // 32) if q8 else 2 * D
    return 2 * B * Hkv * Lk * per_row


def time_op(fn, n=50, repeats=7) -> float:
    """Median seconds per call of ``fn`` on the GPU: ``n`` calls' graphs are built first (the
    Python side of the op, not timed), then evaluated in one ``mx.eval`` between
    ``mx.synchronize`` calls; one warm-up round (compilation, allocator)."""
    import mlx.core as mx

    times = []
    for i in range(repeats + 1):
        outs = [fn() for _ in range(n)]
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        if i:
            times.append((time.perf_counter() - t0) / n)
    return statistics.median(times)


def time_decode(Lk, Hq=32, Hkv=8, D=128, Lq=1, dtype=None, splits=None, stock=True) -> dict:
    import mlx.core as mx

    from mlx_bricks.bricks.decode.op import decode_attention
    from mlx_bricks.bricks.q8_0.op import quantize_q8_0_reference

    dtype = dtype or mx.float16
    key = mx.random.key(Lk + Hq)
    q = mx.random.normal((1, Hq, Lq, D), key=key).astype(dtype)
    k = mx.random.normal((1, Hkv, Lk, D), key=mx.random.key(1)).astype(dtype)
    v = mx.random.normal((1, Hkv, Lk, D), key=mx.random.key(2)).astype(dtype)
    kq, vq = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
    mx.eval(q, k, v, kq, vq)
    scale, mask = D ** -0.5, ("causal" if Lq > 1 else None)
    res = {"Lk": Lk, "Hq": Hq, "Hkv": Hkv, "D": D, "Lq": Lq,
           "dtype": str(dtype).replace("mlx.core.", ""), "splits": splits}
    t_q8 = time_op(lambda: decode_attention(q, kq, vq, scale=scale, mask=mask, kv_quant="q8_0",
                                            splits=splits, backend=BACKEND))
    res["q8_0_brick_us"] = t_q8 * 1e6
    res["q8_0_bytes"] = kv_bytes(Hkv, Lk, D, True)
    res["q8_0_GBps"] = res["q8_0_bytes"] / t_q8 / 1e9
    if stock:
        t_fp = time_op(lambda: decode_attention(q, k, v, scale=scale, mask=mask, splits=splits,
                                                backend=BACKEND))
        t_st = time_op(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                    mask=mask))
        res["fp16_brick_us"] = t_fp * 1e6
        res["stock_sdpa_us"] = t_st * 1e6
        res["fp16_bytes"] = kv_bytes(Hkv, Lk, D, False)
        res["fp16_brick_GBps"] = res["fp16_bytes"] / t_fp / 1e9
        res["stock_GBps"] = res["fp16_bytes"] / t_st / 1e9
        res["speedup_q8_0_vs_stock"] = t_st / t_q8
        a = decode_attention(q, kq, vq, scale=scale, mask=mask, kv_quant="q8_0",
                             backend=BACKEND)
        b = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
        res["q8_0_vs_stock_max_abs_diff"] = float(mx.max(mx.abs(a.astype(mx.float32) -
                                                               b.astype(mx.float32))).item())
    return res


def timings(quick: bool = False) -> list:
    import mlx.core as mx

    runs = []
    k32 = 32768 // SHRINK
    cfgs = [dict(Lk=4096 // SHRINK), dict(Lk=k32), dict(Lk=131072 // SHRINK), dict(Lk=k32, Lq=4)]
    if not quick:
        cfgs += [dict(Lk=k32, dtype=mx.bfloat16), dict(Lk=k32, Hq=64, Hkv=8)]
        cfgs += [dict(Lk=k32, splits=s, stock=False) for s in (8, 16, 32, 64, 128, 256, 512)]
    for cfg in cfgs:
        try:
            r = time_decode(**cfg)
        except Exception as e:  # noqa: BLE001
            r = {**{k: str(v) for k, v in cfg.items()}, "error": f"{type(e).__name__}: {e}"}
        runs.append(r)
        if "error" in r:
            print(f"timing {cfg}: ERROR {r['error'][:300]}", flush=True)
        else:
            line = (f"Lk {r['Lk']:>6} h {r['Hq']}/{r['Hkv']} Lq {r['Lq']} {r['dtype']:<8} "
                    f"splits {str(r['splits']):>4}: q8_0 {r['q8_0_brick_us']:8.1f} us "
                    f"({r['q8_0_GBps']:6.0f} GB/s)")
            if "stock_sdpa_us" in r:
                line += (f"  fp16 brick {r['fp16_brick_us']:8.1f} us  stock "
                         f"{r['stock_sdpa_us']:8.1f} us ({r['stock_GBps']:6.0f} GB/s)  "
                         f"stock/q8_0 {r['speedup_q8_0_vs_stock']:.2f}x")
            print(line, flush=True)
    return runs


# ---------------------------------------------------------------------------------------------
# 3. model


def model_runs(n_tokens=16384, chunk=2048, decode_steps=10) -> list:
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from mlx_bricks import kernels
    from mlx_bricks.cache import make_prompt_cache
    from mlx_bricks.tools.kv_driver import q8_0_attention

    n_tokens, chunk = n_tokens // SHRINK, chunk // SHRINK
    hidden, inter, heads, kv_heads = (4096, 14336, 32, 8) if SHRINK == 1 else (512, 1024, 4, 1)
    args = llama.ModelArgs(model_type="llama", hidden_size=hidden, num_hidden_layers=4,
                           intermediate_size=inter, num_attention_heads=heads,
                           num_key_value_heads=kv_heads, rms_norm_eps=1e-5, vocab_size=32000,
                           rope_theta=500000.0, tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    tokens = mx.random.randint(0, 32000, (1, n_tokens), key=mx.random.key(3))
    step_tok = mx.array([[17]])
    kinds = {
        "fp16": lambda: [KVCache() for _ in model.layers],
        "affine8": lambda: [QuantizedKVCache(group_size=64, bits=8) for _ in model.layers],
        "q8_0": lambda: make_prompt_cache(model, "q8_0", backend=BACKEND),
    }
    runs, ref_logits = [], None
    for kind, make in kinds.items():
        r = {"cache": kind}
        cache = None
        try:
            cache = make()
            mx.synchronize()
            mx.clear_cache()
            mx.reset_peak_memory()
            before = mx.get_active_memory()
            t0 = time.perf_counter()
            with q8_0_attention(model):
                for lo in range(0, n_tokens, chunk):
                    logits = model(tokens[:, lo:lo + chunk], cache=cache)
                    mx.eval([c.state for c in cache])
                    mx.clear_cache()
                mx.synchronize()
                r["prefill_s"] = time.perf_counter() - t0
                r["prefill_peak_bytes"] = mx.get_peak_memory()
                r["held_before_bytes"] = before
                r["prefill_peak_above_held_bytes"] = r["prefill_peak_bytes"] - before
                r["cache_bytes"] = sum(c.nbytes for c in cache)
                counts = dict(kernels.LAUNCH_COUNTS)
                times = []
                for i in range(decode_steps + 2):
                    t0 = time.perf_counter()
                    logits = model(step_tok, cache=cache)
                    mx.eval(logits)
                    mx.synchronize()
                    if i >= 2:
                        times.append(time.perf_counter() - t0)
                    for c in cache:
                        c.trim(1)  # decode the same position again: same context each step
                r["decode_step_ms"] = statistics.median(times) * 1e3
                r["decode_launches"] = {f"{k[0]}@{k[1]}": v - counts.get(k, 0)
                                        for k, v in kernels.LAUNCH_COUNTS.items()
                                        if v != counts.get(k, 0)}
                last = logits[0, -1].astype(mx.float32)
                if kind == "fp16":
                    ref_logits = last
                elif ref_logits is not None:
                    r["decode_logits_max_abs_diff_vs_fp16"] = float(
                        mx.max(mx.abs(last - ref_logits)).item())
                    r["decode_top1_same_as_fp16"] = bool(
                        mx.argmax(last).item() == mx.argmax(ref_logits).item())
        except Exception as e:  # noqa: BLE001  (the affine cache is expected to fail here)
            r["error"] = f"{type(e).__name__}: {e}"
            r["traceback"] = traceback.format_exc()[-2000:]
        runs.append(r)
        print(f"model {kind:<8} " + ", ".join(f"{k}={v}" for k, v in r.items()
                                               if k not in ("cache", "traceback")), flush=True)
        del cache
        mx.clear_cache()
    return runs


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=45.0,
                   help="seconds for the correctness sweep after its covering cases")
    p.add_argument("--skip", default="", help="comma-separated sections to skip: "
                   "correctness,timings,model")
    p.add_argument("--quick", action="store_true",
                   help="covering cases only and four decode timings (a short GPU lease)")
    p.add_argument("--backend", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--dry-run", action="store_true",
                   help="contexts and model 1/32 the size: to check the script on a CPU")
    args = p.parse_args()
    global BACKEND, SHRINK
    BACKEND, SHRINK = args.backend, (32 if args.dry_run else 1)
    import mlx.core as mx

    skip = set(filter(None, args.skip.split(",")))
    t0 = time.time()
    doc = {"date": time.strftime("%Y-%m-%d"), "device": mx.device_info(),
           "mlx": mx.__version__, "python": platform.python_version()}
    from importlib.metadata import version

    doc["mlx_lm"] = version("mlx-lm")
    budget = 0.0 if args.quick else args.budget_s
    sections = {"correctness": lambda: correctness(budget), "timings": lambda: timings(args.quick),
                "model": model_runs}
    for name, run in sections.items():
        if name in skip:
            continue
        t1 = time.time()
        doc[name] = run()
        doc[f"{name}_seconds"] = round(time.time() - t1, 1)
        print(f"[{name}: {doc[f'{name}_seconds']} s]", flush=True)
        with open(args.out, "w") as f:  # after each section: a lease that ends early keeps it
            json.dump(doc, f, indent=1, default=str)
    doc["seconds"] = round(time.time() - t0, 1)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"done in {doc['seconds']} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
