"""FlashAttention prefill on the GPU: the bricks' CUDA kernels against MLX's SDPA, one JSON.

Causal prefill, batch 1, 32 query heads over 8 KV heads (GQA 4), bf16, head_dim 128 / 256 / 64,
q_len = kv_len = 2048, 8192, 32768 and a chunked call (q 2048 over kv 8192, bottom-right). Per
case: ``mx.fast.scaled_dot_product_attention`` (cuDNN at head_dim <= 128; MLX's unfused ops
above, skipped where its score matrix would not fit), the first kernel's default tile
(``attention.cu``) and every tile of the fast family this GPU runs (``attention_fa.cu``),
each warm (``mlx_bricks.bench.gpu.time_op``: median of 5, several calls per eval): seconds,
TFLOP/s over the visible (query, key) pairs (causal q_len = kv_len = T: 2 * 2 * H * T^2 * D / 2),
the fraction of the H100's dense bf16 peak (989 TFLOP/s), stock / ours, and the largest error
of the last 64 query rows against a float32 reference (stock's too). A failing variant records
its error and the rest continues; cases stop at the time budget. Then, in fresh processes,
the first calls at a new key length (``--first-call``): stock rebuilds its cuDNN graph per
shape, the bricks' kernels are built once per machine (NVRTC, disk cache).

Usage (GPU machine, MLX's CUDA wheels on PYTHONPATH: scripts/gpu/install.sh):
  python3 scripts/gpu/attn_bench.py OUT.json [--budget SECONDS] [--dims 128,256,64]
      [--shapes 2048x2048,8192x8192,2048x8192,32768x32768]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import mlx.core as mx

from mlx_bricks.bench.gpu import time_op
from mlx_bricks.bricks.attention import cuda as ac
from mlx_bricks.bricks.gemm.cuda import device_capability, max_shared_memory

PEAK = 989e12  # H100 SXM dense bf16 (the H200's is the same)
HQ, HKV, ROWS = 32, 8, 64
SHAPES = ((2048, 2048), (8192, 8192), (2048, 8192), (32768, 32768))
#: Stock above head_dim 128 is MLX's unfused attention: skipped where its bf16 score matrix
#: would take more than this.
UNFUSED_LIMIT = 16 << 30


def pairs(lq: int, lk: int) -> int:
    """Visible (query, key) pairs of a bottom-right causal mask."""
    off = lk - lq
    return lq * off + lq * (lq + 1) // 2


def inputs(lq, lk, d, seed=0):
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, HQ, lq, d), key=k1).astype(mx.bfloat16)
    k = mx.random.normal((1, HKV, lk, d), key=k2).astype(mx.bfloat16)
    v = mx.random.normal((1, HKV, lk, d), key=k3).astype(mx.bfloat16)
    mx.eval(q, k, v)
    return q, k, v


def reference_tail(q, k, v, scale):
    """float32 attention of the last ROWS query rows (bottom-right causal)."""
    lq, lk = q.shape[2], k.shape[2]
    qt = q[:, :, -ROWS:].astype(mx.float32)
    kh = mx.repeat(k.astype(mx.float32), HQ // HKV, axis=1)
    vh = mx.repeat(v.astype(mx.float32), HQ // HKV, axis=1)
    s = (qt @ kh.transpose(0, 1, 3, 2)) * scale
    pos = (lk - ROWS + mx.arange(ROWS))[:, None]
    s = mx.where(mx.arange(lk)[None] <= pos, s, -math.inf)
    return mx.softmax(s, axis=-1) @ vh


def max_err(out, ref):
    return float(mx.max(mx.abs(out[:, :, -ROWS:].astype(mx.float32) - ref)).item())


def candidates(d):
    """(name, fn(q, k, v, scale)) of stock and every kernel variant for head_dim d."""
    cc = device_capability()
    limit = max_shared_memory(cc)
    out = [("stock", lambda q, k, v, s: mx.fast.scaled_dot_product_attention(
        q, k, v, scale=s, mask="causal"))]
    out.append(("first_kernel", lambda q, k, v, s: ac.launch_attention_cuda(
        q, k, v, None, None, scale=s, causal=True)))
    for t in ac.fa_tiles(d):
        if (t.wg and cc[0] != 9) or t.smem_bytes(d, d) > limit:
            continue
        out.append((t.name, lambda q, k, v, s, n=t.name: ac.launch_attention_fa(
            q, k, v, scale=s, causal=True, variant=n)))
    return out


def run_case(d, lq, lk, deadline):
    flops = 4.0 * HQ * d * pairs(lq, lk)
    case = {"head_dim": d, "q_len": lq, "kv_len": lk, "heads": [HQ, HKV], "flops": flops,
            "results": {}}
    q, k, v = inputs(lq, lk, d)
    scale = d ** -0.5
    ref = reference_tail(q, k, v, scale)
    mx.eval(ref)
    stock_t = None
    for name, fn in candidates(d):
        r = {}
        if time.time() > deadline:
            case["results"][name] = {"skipped": "time budget"}
            continue
        if name == "stock" and d > 128 and HQ * lq * lk * 2 > UNFUSED_LIMIT:
            case["results"][name] = {"skipped": f"unfused score matrix {HQ * lq * lk * 2 >> 30} GB"}
            continue
        try:
            t0 = time.perf_counter()
            out = fn(q, k, v, scale)
            mx.eval(out)
            mx.synchronize()
            r["first_call_s"] = time.perf_counter() - t0
            r["max_err_last_rows"] = max_err(out, ref)
            del out
            t = time_op(lambda: fn(q, k, v, scale))
            r.update(seconds=t, tflops=flops / t / 1e12, peak_fraction=flops / t / PEAK)
            if name == "stock":
                stock_t = t
            elif stock_t:
                r["speedup_vs_stock"] = stock_t / t
        except Exception as e:  # a failing variant is recorded; the rest continues
            r["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        case["results"][name] = r
        print(json.dumps({"D": d, "Lq": lq, "Lk": lk, name: r}), file=sys.stderr, flush=True)
    from mlx_bricks import kernels
    case["build_seconds"] = {k: kernels.build_cost(k) for k in ("flash_attention_fa",
                                                                   "flash_attention")}
    return case


def first_call(side, d, lengths=(2048, 4096, 6144)):
    """In this (fresh) process: the first call of ``side`` at each length in turn (stock: a
    cuDNN graph per shape; ours: the kernel built or loaded once), then a warm call at the
    last length."""
    variant = None if side == "stock" else side
    res = {"side": side, "head_dim": d, "calls": []}
    for i, L in enumerate(lengths):
        q, k, v = inputs(L, L, d, seed=i)
        if side == "stock":
            fn = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5,
                                                              mask="causal")
        else:
            fn = lambda: ac.launch_attention_fa(q, k, v, scale=d ** -0.5, causal=True,
                                                variant=variant)
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        first = time.perf_counter() - t0
        res["calls"].append({"len": L, "first_call_s": first})
    res["warm_s"] = time_op(fn)
    return res


def _subprocess(args, timeout, what):
    """Run this script with ``args`` in a fresh process; its last stdout line as JSON, or
    ``what`` with the error."""
    try:
        r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                           timeout=timeout, env=os.environ)
        out = (json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else
               dict(what, error=f"rc {r.returncode}: {r.stderr[-800:]}"))
    except Exception as e:  # a timeout or a crash: recorded, the rest continues
        out = dict(what, error=f"{type(e).__name__}: {str(e)[:400]}")
    print(json.dumps(out)[:3000], flush=True)
    return out


def summary(path):
    """One line per case and variant: TFLOP/s, fraction of peak, speedup, error."""
    rep = json.load(open(path))
    print(rep.get("device"), rep.get("mlx"), f"{rep.get('seconds', 0):.0f} s")
    for c in rep["cases"]:
        head = f"D{c['head_dim']} {c['q_len']}x{c['kv_len']}"
        if "error" in c:
            print(head, "ERROR", c["error"][-300:])
            continue
        for name, r in c["results"].items():
            if "seconds" in r:
                print(f"{head} {name:26s} {r['tflops']:6.1f} TF/s {r['peak_fraction']:.2f} "
                      f"x{r.get('speedup_vs_stock', float('nan')):.2f} "
                      f"err {r['max_err_last_rows']:.2e} first {r['first_call_s']:.2f}s")
            else:
                print(f"{head} {name:26s} {json.dumps(r)[:200]}")
    for f in rep["first_call"]:
        print("first call", json.dumps(f)[:400])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?")
    p.add_argument("--budget", type=float, default=200.0, help="seconds for the timed cases")
    p.add_argument("--dims", default="128,256,64")
    p.add_argument("--shapes", default=",".join(f"{a}x{b}" for a, b in SHAPES),
                   help="q_len x kv_len list")
    p.add_argument("--first-call", nargs=2, metavar=("SIDE", "D"),
                   help="internal: one fresh process's first calls (SIDE stock or a variant)")
    p.add_argument("--case", nargs=4, type=float, metavar=("D", "LQ", "LK", "DEADLINE"),
                   help="internal: one case in this process")
    p.add_argument("--summary", metavar="JSON", help="print a finished report as a table")
    p.add_argument("--profile", nargs=3, metavar=("D", "T", "VARIANT"),
                   help="three calls of one variant at q_len = kv_len = T (for ncu: skip 2)")
    a = p.parse_args()
    if a.profile:
        d, t, name = int(a.profile[0]), int(a.profile[1]), a.profile[2]
        q, k, v = inputs(t, t, d)
        for _ in range(3):
            mx.eval(ac.launch_attention_fa(q, k, v, scale=d ** -0.5, causal=True, variant=name))
        mx.synchronize()
        return
    if a.summary:
        summary(a.summary)
        return
    if a.first_call:
        print(json.dumps(first_call(a.first_call[0], int(a.first_call[1]))))
        return
    if a.case:
        d, lq, lk, deadline = a.case
        print(json.dumps(run_case(int(d), int(lq), int(lk), deadline)))
        return
    t_start = time.time()
    deadline = t_start + a.budget
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "mlx": mx.__version__,
              "device": mx.device_info().get("device_name"), "cc": list(device_capability()),
              "dtype": "bfloat16", "peak_tflops": PEAK / 1e12, "cases": [], "first_call": []}
    # Each case in its own process: a kernel fault ends that process's CUDA context only.
    for d in map(int, a.dims.split(",")):
        for shape in a.shapes.split(","):
            lq, lk = map(int, shape.split("x"))
            report["cases"].append(_subprocess(["--case", str(d), str(lq), str(lk),
                                                str(deadline)], 150,
                                               {"head_dim": d, "q_len": lq, "kv_len": lk}))
            _write(a.out, report, t_start)
    sides = ["stock", ac.FA_WGMMA if device_capability()[0] == 9 else ac.FA_MMA]
    for side in sides:  # fresh processes (the kernels' disk cache is warm from above)
        report["first_call"].append(_subprocess(["--first-call", side, "128"], 60,
                                                {"side": side}))
        _write(a.out, report, t_start)
    print(f"done in {report['seconds']:.0f} s", flush=True)


def _write(path, report, t_start):
    """The report so far (a killed run keeps what it measured)."""
    report["seconds"] = time.time() - t_start
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
