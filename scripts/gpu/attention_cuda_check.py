#!/usr/bin/env python
"""One-run GPU check and benchmark of the CUDA attention twin (issue 16).

    python scripts/gpu/attention_cuda_check.py --out $OUT/attn.json

1. Correctness sweep (parallel worker processes, one kernel variant per process, so a compile
   error or a crash in one variant is reported and loses nothing else): head_dim 64 .. 512,
   fp16 / bf16 / fp32, GQA 1/4/8, Lq and Lk in {1, 7, 33, 129, 300, 1000} (Lk > Lq: bottom-right),
   no mask / causal / sliding window, soft-capping, Q8_0 K/V, any scale, scores in the hundreds,
   and the memory layouts mlx-lm passes (transposed q, KV-cache slices, a non-unit head_dim
   stride). Rule: error vs the reference <= 2 x the same-dtype naive MLX error + 4 ulps
   (tests/tolerance.py); the reference is float64 numpy for fp32 inputs and float32 MLX (TF32
   off) for fp16/bf16. The output buffer is poisoned with NaN first, so an unwritten element fails.
2. Timings vs stock ``mx.fast.scaled_dot_product_attention`` (bf16, batch 1, causal): the issue's
   table, Q8_0 K/V at L = 8192, a Gemma-3-shaped window-512 layer, and the other tile variants.
   Several calls per ``mx.eval``, a warm-up, medians; TFLOP/s counts causal work as half (window:
   the visible pairs); peak memory per case.

Prints a compact table and writes JSON (--out). Finishes in about 3 minutes on an H200.
"""
from __future__ import annotations

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # float32 matmuls of the references stay float32

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
import traceback
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_bricks.bricks.attention import msl as _attention  # noqa: E402,F401  (registers the kernel)
from mlx_bricks.bricks.attention.cuda import (  # noqa: E402
    CUDA_HEAD_DIMS,
    launch_attention_cuda,
    pick_tile,
    variants,
)
from mlx_bricks.bricks.q8_0.op import dequantize_q8_0_reference, quantize_q8_0_reference  # noqa: E402

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
EPS = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
LENGTHS = (1, 7, 33, 129, 300, 1000)
HEADS = ((4, 4), (8, 2), (8, 1))  # GQA 1, 4, 8


# ---------------------------------------------------------------------------------------------
# correctness


def correctness_cases() -> list[dict]:
    """The sweep: for every (head_dim, dtype) three flag sets (plain; causal + Q8_0; window +
    softcap), each over four (Lq, Lk, heads, layout) shapes chosen by rotation so that every
    length, GQA factor and layout appears for every head_dim."""
    shapes = []
    for i, (lq, lk) in enumerate([(1, 1), (7, 7), (33, 300), (129, 129), (300, 1000), (1000, 1000),
                                  (1, 1000), (7, 33), (129, 300), (33, 33), (300, 300)]):
        shapes.append((lq, lk, HEADS[i % 3]))
    layouts = ("contiguous", "mlx_lm", "contiguous", "strided_d")
    cases = []
    n = 0
    for D in CUDA_HEAD_DIMS:
        for dname in DTYPES:
            flag_sets = [
                dict(causal=False, window=None, softcap=None, q8=False),
                dict(causal=True, window=None, softcap=None, q8=D % 32 == 0),
                dict(causal=True, window=(8, 33, 100)[n % 3], softcap=(30.0, 5.0)[n % 2],
                     q8=False),
            ]
            for flags in flag_sets:
                for j in range(4):
                    lq, lk, heads = shapes[(n * 4 + j) % len(shapes)]
                    if dname == "float32" and D >= 256 and lk >= 1000:
                        lq, lk = min(lq, 129), 300  # keep the float64 reference cheap
                    big = j == 3 and D in (64, 128) and flags["window"] is None
                    cases.append(dict(
                        D=D, dtype=dname, Lq=lq, Lk=lk, Hq=heads[0], Hkv=heads[1], B=1 + (j == 1),
                        scale=(D**-0.5 if j != 2 else 0.0625), layout=layouts[j],
                        big_logits=big, **flags))
                n += 1
    return cases


def variant_key(c: dict) -> str:
    return (f"{c['dtype']}-D{c['D']}-{'causal' if c['causal'] else 'full'}"
            f"{'-window' if c['window'] else ''}{'-softcap' if c['softcap'] else ''}"
            f"{'-q8' if c['q8'] else ''}")


def case_id(c: dict) -> str:
    return (f"{variant_key(c)} B{c['B']} h{c['Hq']}x{c['Hkv']} L{c['Lq']}x{c['Lk']} "
            f"{c['layout']}{' w' + str(c['window']) if c['window'] else ''}"
            f"{' cap' + str(c['softcap']) if c['softcap'] else ''} scale{c['scale']:.4g}"
            f"{' big' if c['big_logits'] else ''}")


def _layout(x, layout, extra=9):
    """x (B, H, L, D) as a view laid out like ``layout`` (values unchanged)."""
    if layout == "mlx_lm":  # a KV-cache slice at a non-zero start of a longer buffer
        B, H, L, D = x.shape
        buf = mx.zeros((B, H, L + extra, D), x.dtype)
        buf[:, :, 3:3 + L] = x
        return buf[:, :, 3:3 + L]
    if layout == "strided_d":  # every other element: the element-wise load path
        B, H, L, D = x.shape
        buf = mx.zeros((B, H, L, 2 * D), x.dtype)
        buf[..., ::2] = x
        return buf[..., ::2]
    return x


def _attention_masks(Lq, Lk, causal, window):
    pos = mx.arange(Lq)[:, None] + (Lk - Lq)
    j = mx.arange(Lk)[None, :]
    vis = mx.ones((Lq, Lk), mx.bool_)
    if causal or window is not None:
        vis = vis & (j <= pos)
    if window is not None:
        vis = vis & (j > pos - window)
    return vis


def naive(q, k, v, scale, causal, window, softcap):
    """softmax((q k^T) scale [softcap] + mask) v in MLX ops in q's dtype (GPU)."""
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    s = (q @ k.swapaxes(-1, -2)) * scale
    if softcap is not None:
        s = mx.tanh(s / softcap) * softcap
    vis = _attention_masks(q.shape[2], k.shape[2], causal, window)
    s = mx.where(vis, s, mx.array(-float("inf"), s.dtype))
    p = mx.softmax(s, axis=-1)
    return mx.where(mx.any(vis, axis=-1, keepdims=True), p @ v, mx.zeros((), q.dtype))


def reference(q, k, v, scale, causal, window, softcap):
    """float64 numpy for fp32 inputs, float32 MLX on the GPU (TF32 off) otherwise."""
    if q.dtype == mx.float32:
        qf, kf, vf = (np.array(a).astype(np.float64) for a in (q, k, v))
        rep = qf.shape[1] // kf.shape[1]
        kf, vf = np.repeat(kf, rep, axis=1), np.repeat(vf, rep, axis=1)
        s = np.matmul(qf, np.swapaxes(kf, -1, -2)) * scale
        if softcap is not None:
            s = softcap * np.tanh(s / softcap)
        vis = np.array(_attention_masks(q.shape[2], k.shape[2], causal, window))
        s = np.where(vis, s, -np.inf)
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        return np.matmul(p, vf) / np.where(l > 0, l, 1.0)
    q32, k32, v32 = (a.astype(mx.float32) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k32, v32 = mx.repeat(k32, rep, axis=1), mx.repeat(v32, rep, axis=1)
    s = (q32 @ k32.swapaxes(-1, -2)) * scale
    if softcap is not None:
        s = mx.tanh(s / softcap) * softcap
    vis = _attention_masks(q.shape[2], k.shape[2], causal, window)
    s = mx.where(vis, s, -float("inf"))
    m = mx.max(s, axis=-1, keepdims=True)
    m = mx.where(mx.isinf(m), 0.0, m)
    p = mx.exp(s - m)
    l = mx.sum(p, axis=-1, keepdims=True)
    out = (p @ v32) / mx.where(l > 0, l, 1.0)
    return np.array(out).astype(np.float64)


def run_case(c: dict) -> dict:
    dtype = DTYPES[c["dtype"]]
    rng = np.random.default_rng(zlib.crc32(case_id(c).encode()))
    B, Hq, Hkv, Lq, Lk, D = c["B"], c["Hq"], c["Hkv"], c["Lq"], c["Lk"], c["D"]

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    qn, kn, vn = rand(B, Hq, Lq, D), rand(B, Hkv, Lk, D), rand(B, Hkv, Lk, D)
    if c["big_logits"]:  # one key channel at 40 and q at 8 there: scores of several hundred
        qn[..., 0] = 8.0
        kn[..., 0] = 40.0 * np.sign(rand(B, Hkv, Lk))
    q = mx.array(qn).astype(dtype)
    if c["layout"] == "mlx_lm":  # (B, L, H, D) projection transposed, as mlx-lm passes q
        q = mx.array(np.ascontiguousarray(qn.transpose(0, 2, 1, 3))).astype(dtype)
        q = q.transpose(0, 2, 1, 3)
    k, v = mx.array(kn).astype(dtype), mx.array(vn).astype(dtype)
    k_scale = v_scale = None
    if c["q8"]:
        (kq, ks), (vq, vs) = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
        k, v = dequantize_q8_0_reference(kq, ks, dtype), dequantize_q8_0_reference(vq, vs, dtype)
        kin, vin = _layout(kq, c["layout"]), _layout(vq, c["layout"])
        k_scale, v_scale = _layout(ks, c["layout"]), _layout(vs, c["layout"])
    else:
        kin, vin = _layout(k, c["layout"]), _layout(v, c["layout"])
    scale, causal, window, softcap = c["scale"], c["causal"], c["window"], c["softcap"]

    poison = mx.full((B * Lq * Hq * D,), float("nan"), dtype)  # freed, then reused by the output
    mx.eval(poison, q, kin, vin, *(x for x in (k_scale, v_scale) if x is not None))
    del poison
    out = launch_attention_cuda(q, kin, vin, k_scale, v_scale, scale=scale, causal=causal,
                                window=window, softcap=softcap)
    mx.eval(out)
    o = np.array(out.astype(mx.float32)).astype(np.float64)
    ref = reference(q, k, v, scale, causal, window, softcap)
    nv = np.array(naive(q, k, v, scale, causal, window, softcap).astype(mx.float32))
    err = float(np.max(np.abs(o - ref), initial=0.0))
    err_naive = float(np.max(np.abs(nv.astype(np.float64) - ref), initial=0.0))
    scale_ref = max(1.0, float(np.max(np.abs(ref), initial=0.0)))
    budget = 2.0 * err_naive + 4.0 * EPS[c["dtype"]] * scale_ref
    nonfinite = int((~np.isfinite(o)).sum())
    ok = nonfinite == 0 and err <= budget
    return dict(id=case_id(c), status="PASS" if ok else "FAIL", err=err, naive_err=err_naive,
                budget=budget, nonfinite=nonfinite, tile=pick_tile(D, dtype, c["q8"]).name)


def worker(cases: list[dict]) -> None:
    """Run cases in this process, one JSON line each (flushed, so a crash loses only the rest)."""
    for c in cases:
        try:
            res = run_case(c)
        except Exception as e:  # noqa: BLE001 -- a report harness: every error is recorded
            res = dict(id=case_id(c), status="ERROR", error=f"{type(e).__name__}: {e}"[-2000:],
                       trace=traceback.format_exc()[-1500:])
        print("RESULT " + json.dumps(res), flush=True)


def run_group(cases: list[dict], timeout: float) -> list[dict]:
    """Run one variant's cases in a fresh process; a crash or timeout marks the rest."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cases)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        stdout, stderr, rc = res.stdout, res.stderr, res.returncode
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, rc = "timeout", -1
    done = [json.loads(line[7:]) for line in stdout.splitlines() if line.startswith("RESULT ")]
    for c in cases[len(done):]:
        done.append(dict(id=case_id(c), status="CRASH",
                         error=f"worker exited with {rc} before this case: {stderr[-1500:]}"))
    return done


def correctness(jobs: int, quick: bool, timeout: float) -> dict:
    groups: dict[str, list] = {}
    for c in correctness_cases():
        groups.setdefault(variant_key(c), []).append(c)
    if quick:  # every variant still compiles and runs once
        groups = {k: g[:1] for k, g in groups.items()}
    t0 = time.time()
    with ThreadPoolExecutor(jobs) as ex:
        results = [r for rs in ex.map(lambda g: run_group(g, timeout), groups.values()) for r in rs]
    counts = {s: sum(r["status"] == s for r in results) for s in ("PASS", "FAIL", "ERROR", "CRASH")}
    print(f"\n== correctness: {len(results)} cases, {len(groups)} variants, "
          f"{time.time() - t0:.0f} s: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    bad = [r for r in results if r["status"] != "PASS"]
    for r in bad[:15]:
        detail = (f"err {r['err']:.3g} budget {r['budget']:.3g} naive {r['naive_err']:.3g} "
                  f"nonfinite {r['nonfinite']}" if r["status"] == "FAIL" else r["error"][:300])
        print(f"  {r['status']}: {r['id']}: {detail}")
    worst = sorted((r for r in results if r["status"] in ("PASS", "FAIL")),
                   key=lambda r: -r["err"] / max(r["budget"], 1e-30))[:3]
    for r in worst:
        print(f"  closest to budget: {r['id']}: err/budget {r['err'] / r['budget']:.2f}")
    return dict(counts=counts, seconds=time.time() - t0, results=results)


# ---------------------------------------------------------------------------------------------
# benchmark


def bench_cases() -> list[dict]:
    cases = []
    for D, hq, hkv in ((64, 32, 8), (128, 32, 8), (256, 8, 4), (512, 8, 4)):
        for L in (2048, 8192):
            cases.append(dict(name=f"D{D} {hq}/{hkv} L{L}", D=D, Hq=hq, Hkv=hkv, L=L))
    cases.append(dict(name="D128 32/8 L8192 q8_0", D=128, Hq=32, Hkv=8, L=8192, q8=True))
    cases.append(dict(name="D256 8/4 L8192 q8_0", D=256, Hq=8, Hkv=4, L=8192, q8=True))
    for L in (2048, 8192):  # Gemma 3 (e.g. 4B): 8 query heads, 4 KV heads, head_dim 256
        cases.append(dict(name=f"gemma3 D256 8/4 L{L} window512", D=256, Hq=8, Hkv=4, L=L,
                          window=512))
    for D, hq, hkv in ((64, 32, 8), (256, 8, 4), (512, 8, 4)):  # the tuner's alternatives
        for t in variants(D, mx.bfloat16)[1:]:
            cases.append(dict(name=f"D{D} {hq}/{hkv} L8192 {t.name}", D=D, Hq=hq, Hkv=hkv,
                              L=8192, variant=t.name, stock=False))
    return cases


def _time(fn, reps: int, rounds: int) -> float:
    """Median seconds per call: ``reps`` calls per mx.eval, after one warm-up eval."""
    mx.eval(fn())
    mx.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(reps)])
        mx.synchronize()
        per.append((time.perf_counter() - t0) / reps)
    return statistics.median(per)


def _peak(fn) -> int:
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory() - base


def run_bench_case(c: dict) -> dict:
    D, Hq, Hkv, L = c["D"], c["Hq"], c["Hkv"], c["L"]
    window, q8 = c.get("window"), c.get("q8", False)
    dt = mx.bfloat16
    key = mx.random.key(D + L)
    kq_, kk_, kv_ = mx.random.split(key, 3)
    q = mx.random.normal((1, Hq, L, D), key=kq_).astype(dt)
    k = mx.random.normal((1, Hkv, L, D), key=kk_).astype(dt)
    v = mx.random.normal((1, Hkv, L, D), key=kv_).astype(dt)
    scale = D**-0.5
    ks = vs = None
    kin, vin = k, v
    if q8:
        (kin, ks), (vin, vs) = quantize_q8_0_reference(k), quantize_q8_0_reference(v)
    mx.eval(q, k, v, kin, vin, *(x for x in (ks, vs) if x is not None))
    pairs = L * (L + 1) / 2 if window is None else sum(min(i + 1, window) for i in range(L))
    flops = 4.0 * Hq * pairs * D
    reps = max(2, min(20, int(2e12 / flops)))
    rounds = 5

    def brick():
        return launch_attention_cuda(q, kin, vin, ks, vs, scale=scale, causal=True,
                                     window=window, softcap=None, variant=c.get("variant"))

    res = dict(name=c["name"], tile=pick_tile(D, dt, q8, c.get("variant")).name)
    t = _time(brick, reps, rounds)
    res.update(brick_ms=t * 1e3, brick_tflops=flops / t / 1e12, brick_peak_mib=_peak(brick) / 2**20)
    if c.get("stock", True):
        if window is None:
            kd, vd = k, v  # stock on the bf16 K/V (for q8 cases: the twin's own bf16 run is the
            # comparison that matters; stock is shown for scale)
            mask = "causal"
        else:
            kd, vd = k, v
            mask = _attention_masks(L, L, True, window)
            mx.eval(mask)

        def stock():
            return mx.fast.scaled_dot_product_attention(q, kd, vd, scale=scale, mask=mask)

        try:
            ts = _time(stock, reps, rounds)
            res.update(stock_ms=ts * 1e3, stock_tflops=flops / ts / 1e12,
                       stock_peak_mib=_peak(stock) / 2**20, speedup=ts / t)
            o1 = brick().astype(mx.float32)
            o2 = stock().astype(mx.float32)
            if q8:
                o2 = mx.fast.scaled_dot_product_attention(
                    q, dequantize_q8_0_reference(kin, ks, dt), dequantize_q8_0_reference(vin, vs, dt),
                    scale=scale, mask=mask).astype(mx.float32)
            res["max_abs_diff_vs_stock"] = float(mx.max(mx.abs(o1 - o2)).item())
        except Exception as e:  # noqa: BLE001 -- stock may fail at head_dim 512: record it
            res["stock_error"] = f"{type(e).__name__}: {e}"[:500]
    return res


def bench_worker(cases: list[dict]) -> None:
    for c in cases:
        try:
            res = run_bench_case(c)
        except Exception as e:  # noqa: BLE001 -- a report harness: every error is recorded
            res = dict(name=c["name"], error=f"{type(e).__name__}: {e}"[-1500:])
        print("RESULT " + json.dumps(res), flush=True)


def bench(timeout: float) -> list[dict]:
    """Bench cases in a child process, alone on the GPU; after a crash the next case resumes
    in a fresh process."""
    cases = bench_cases()
    results: list[dict] = []
    t_end = time.time() + timeout
    while len(results) < len(cases) and time.time() < t_end:
        rest = cases[len(results):]
        cmd = [sys.executable, str(Path(__file__).resolve()), "--bench-worker", json.dumps(rest)]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=t_end - time.time())
            stdout, stderr, rc = r.stdout, r.stderr, r.returncode
        except subprocess.TimeoutExpired as e:
            stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            stderr, rc = "timeout", -1
        got = [json.loads(x[7:]) for x in stdout.splitlines() if x.startswith("RESULT ")]
        results += got
        if len(results) < len(cases):
            results.append(dict(name=cases[len(results)]["name"],
                                error=f"bench process exited with {rc}: {stderr[-800:]}"))
    print("\n== benchmark (bf16, batch 1, causal; TFLOP/s counts visible pairs)")
    print(f"{'case':40s} {'tile':14s} {'brick ms':>9s} {'TFLOP/s':>8s} {'stock ms':>9s} "
          f"{'TFLOP/s':>8s} {'ratio':>6s} {'peak MiB b/s':>14s}")
    for r in results:
        if "brick_ms" not in r:
            print(f"{r['name']:40s} ERROR {r.get('error', '')[:200]}")
            continue
        s = (f"{r['stock_ms']:9.3f} {r['stock_tflops']:8.1f} {r['speedup']:6.2f}"
             if "stock_ms" in r else f"{'-':>9s} {'-':>8s} {'-':>6s}")
        peaks = f"{r['brick_peak_mib']:.0f}/{r.get('stock_peak_mib', float('nan')):.0f}"
        print(f"{r['name']:40s} {r['tile']:14s} {r['brick_ms']:9.3f} {r['brick_tflops']:8.1f} "
              f"{s} {peaks:>14s}")
        if "stock_error" in r:
            print(f"{'':40s} stock failed: {r['stock_error'][:150]}")
    by_name = {r["name"]: r for r in results if "brick_ms" in r}
    for name, r in by_name.items():  # issue target: Q8_0 K/V within 1.2x of bf16 K/V
        base = by_name.get(name.removesuffix(" q8_0"))
        if name.endswith(" q8_0") and base is not None:
            r["vs_bf16_twin"] = r["brick_ms"] / base["brick_ms"]
            print(f"{name}: {r['vs_bf16_twin']:.2f}x the time of the twin on bf16 K/V")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the JSON report here")
    ap.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                    help="parallel worker processes of the correctness sweep")
    ap.add_argument("--quick", action="store_true",
                    help="one correctness case per variant (63 instead of 252)")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--bench-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if args.bench_worker:
        bench_worker(json.loads(args.bench_worker))
        return 0
    if args.out is not None and not args.out.parent.is_dir():
        ap.error(f"--out directory {args.out.parent} does not exist")
    t0 = time.time()
    report = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  mlx=mx.__version__, device=str(mx.device_info()),
                  commit=subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"],
                                        capture_output=True, text=True).stdout.strip())
    print(f"mlx {report['mlx']} on {report['device']}")
    if not args.skip_check:
        report["correctness"] = correctness(args.jobs, args.quick, timeout=150)
    if not args.skip_bench:
        report["bench"] = bench(timeout=210)
    report["seconds"] = time.time() - t0
    print(f"\ntotal {report['seconds']:.0f} s")
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
