"""The quantized GEMM family on the GPU, one call (issue 41): the register-dequantizing kernels
(``ws`` tiles, ``cuda_src/qgemm*.cu``) against cuBLAS bf16, stock ``mx.quantized_matmul``, the
tuner's ``dequant`` composite and the previous CUDA twin, in one process.

Per case and variant: median seconds per call (``mlx_bricks.bench.gpu.time_op``), TFLOP/s, the
fraction of the device's dense bf16 peak (H100 SXM / H200: 989 TFLOP/s), the largest error
against a float32 reference of the same dequantized weights (relative to the reference's
largest magnitude; cuBLAS bf16's own error is the yardstick), and the peak memory one call
allocates beyond its inputs. Cases, most important first:

* ``linear``: the Llama-3-8B projections (N x K: 4096x4096 q/o, 1024x4096 k/v, 14336x4096
  gate/up, 4096x14336 down) at M = 2048, 8192, 512, MLX affine 4-bit then 8-bit gs64;
* ``swiglu``: gate and up (14336 x 4096 each) fused, SiLU, same M and formats;
* ``moe``: Qwen3-30B-A3B's expert layer (affine 4-bit gs64) and gpt-oss-20b's (mxfp4), M =
  2048 / 8192: stock ``SwitchGLU`` vs every MoE brick tile and the dequant composite;
* ``layer``: the 8B layer's GEMM time (q, k, v, o, gate/up, down) per variant family at each M,
  from the cases above.

Every variant runs in its own try: a failure (compile error, launch error, wrong shape) is
recorded as ``error`` and the run goes on; the JSON is rewritten after every case, and cases
past ``--budget`` seconds are recorded as skipped, so a killed run still leaves its results.

On the lent GPU (after the two calls that carry .whlA and .whlB, ../shared/docs/device.md)::

    source scripts/gpu/install.sh && MLX_ENABLE_TF32=0 python3 scripts/gpu/gemm_bench.py \\
        --out $OUT/gemm_bench.json

(``MLX_ENABLE_TF32=0``: float32 references in full float32, not TF32.) About 3 minutes on an
H100, most of it first-call compiles (NVRTC for the bricks, MLX's own JIT for stock).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback

#: Dense bf16 tensor-core peak, TFLOP/s, by device-name substring (H100 SXM, H200).
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0}
#: The 8B layer's projections, (N, K).
SHAPES = {"qo": (4096, 4096), "kv": (1024, 4096), "gate_up": (14336, 4096),
          "down": (4096, 14336)}
M_SIZES = (2048, 8192, 512)
#: ``--model lfm2``: LFM2-1.2B's projections (conv in / out, q / o, k / v, MLP) at M = 2,048,
#: and the dequant composite also at the cap the 4-layer benchmark model gets (1/32 of its
#: weights, 12.4 MiB).
LFM2_SHAPES = {"conv_in": (6144, 2048), "qo": (2048, 2048), "kv": (512, 2048),
               "gate_up": (8192, 2048), "down": (2048, 8192)}
SMALL_CAP = None
FORMATS = ((4, 64), (8, 64))
#: The previous CUDA twin's best tile on the H200 (docs/bench.md), for reference.
OLD_TILE = "wg128x256"


def _peak(device: str) -> float | None:
    return next((v for k, v in PEAK_TFLOPS.items() if k in device), None)


class Bench:
    """Runs cases under a time budget and keeps the JSON up to date."""

    def __init__(self, out: str, budget: float, only: list[str], repeats: int):
        import mlx.core as mx

        self.mx = mx
        self.out, self.budget, self.only, self.repeats = out, budget, only, repeats
        self.t0 = time.time()
        info = mx.device_info()
        device = str(info.get("device_name", "?"))
        self.peak = _peak(device)
        self.doc = {"script": "scripts/gpu/gemm_bench.py", "date": time.strftime("%Y-%m-%d"),
                    "device": device, "peak_bf16_tflops": self.peak, "mlx": mx.__version__,
                    "python": platform.python_version(), "tf32_env":
                    os.environ.get("MLX_ENABLE_TF32"), "cases": []}

    def wanted(self, name: str) -> bool:
        return not self.only or any(o in name for o in self.only)

    def save(self):
        self.doc["elapsed_s"] = round(time.time() - self.t0, 1)
        with open(self.out, "w") as f:
            json.dump(self.doc, f, indent=1)

    def case(self, name: str, flop: float, build):
        """``build() -> (variants: {name: fn}, ref: array or None, facts)``; each variant is
        checked against ``ref``, timed and measured for peak memory."""
        if not self.wanted(name):
            return None
        rec = {"name": name, "flop": flop, "variants": {}}
        self.doc["cases"].append(rec)
        if time.time() - self.t0 > self.budget:
            rec["skipped"] = "time budget"
            self.save()
            return rec
        try:
            variants, ref, facts = build()
            rec.update(facts)
        except Exception as e:  # noqa: BLE001  (a benchmark records every case's outcome)
            rec["error"] = f"{type(e).__name__}: {e}"[:1500]
            self.save()
            return rec
        for vname, fn in variants.items():
            rec["variants"][vname] = self.variant(fn, ref, flop)
            print(f"{name:40s} {vname:22s} {_fmt(rec['variants'][vname])}", flush=True)
        self.save()
        return rec

    def variant(self, fn, ref, flop):
        from mlx_bricks.bench.gpu import time_op

        mx = self.mx
        v = {}
        try:
            t = time.time()
            out = fn()
            mx.eval(out)
            mx.synchronize()
            v["first_call_s"] = round(time.time() - t, 3)
            if ref is not None:
                o32, r32 = out.astype(mx.float32), ref.astype(mx.float32)
                scale = max(float(mx.max(mx.abs(r32)).item()), 1e-30)
                v["max_abs_err"] = float(mx.max(mx.abs(o32 - r32)).item())
                v["rel_err"] = v["max_abs_err"] / scale
            del out
            mx.synchronize()
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            mx.eval(fn())
            mx.synchronize()
            v["peak_extra_bytes"] = int(mx.get_peak_memory() - base)
            s = time_op(fn, repeats=self.repeats)
            v["ms"] = s * 1e3
            if flop:
                v["tflops"] = flop / s / 1e12
                if self.peak:
                    v["frac_peak"] = v["tflops"] / self.peak
        except Exception as e:  # noqa: BLE001
            v["error"] = f"{type(e).__name__}: {e}"[:1500]
            traceback.print_exc(limit=2)
        return v


def _fmt(v: dict) -> str:
    if "error" in v:
        return "ERROR " + v["error"][:100].replace("\n", " ")
    return (f"{v.get('ms', 0):8.3f} ms {v.get('tflops', 0):7.1f} TF/s "
            f"err {v.get('rel_err', float('nan')):.2e} peak+ {v.get('peak_extra_bytes', 0) >> 20} MiB")


def _randn(mx, shape, dtype, seed, scale=1.0):
    return (mx.random.normal(shape, key=mx.random.key(seed)) * scale).astype(dtype)


def _qweight(mx, N, K, bits, gs, dtype, seed):
    from mlx_bricks.formats.affine import QuantizedWeight

    w = _randn(mx, (N, K), dtype, seed, K ** -0.5)
    q, s, b = mx.quantize(w, group_size=gs, bits=bits)
    qw = QuantizedWeight(q, s, b, gs, bits)
    dq = mx.dequantize(q, s, b, group_size=gs, bits=bits)
    mx.eval(q, s, b, dq)
    return qw, dq


def linear_cases(bench: Bench):
    import mlx.core as mx

    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    from mlx_bricks.bricks.gemm.kind import LINEAR
    from mlx_bricks.options import CAP_SETTING

    dtype = mx.bfloat16
    composite = next(c for c in LINEAR.composites if c.name == "dequant")
    dequant = composite.bind({})
    small = None if SMALL_CAP is None else composite.bind({CAP_SETTING: SMALL_CAP})
    for bits, gs in FORMATS:
        for M in M_SIZES:
            for sname, (N, K) in SHAPES.items():
                def build(M=M, N=N, K=K, bits=bits, gs=gs):
                    x = _randn(mx, (M, K), dtype, 1)
                    qw, dq = _qweight(mx, N, K, bits, gs, dtype, 2)
                    ref = x.astype(mx.float32) @ dq.astype(mx.float32).T
                    mx.eval(x, ref)
                    variants = {
                        "cublas_bf16": lambda: x @ dq.T,
                        "stock_qmm": lambda: mx.quantized_matmul(
                            x, qw.w, qw.scales, qw.biases, transpose=True, group_size=gs,
                            bits=bits),
                        "composite_dequant": lambda: dequant.run({"x": x, "weight": qw}, "cuda"),
                        f"twin_{OLD_TILE}": lambda: gemm_cuda.linear(x, qw, tile=OLD_TILE),
                    }
                    if small is not None:
                        variants["composite_dequant_small_cap"] = lambda: small.run(
                            {"x": x, "weight": qw}, "cuda")
                    for t in gemm_cuda.tile_names(gemm_cuda.WS_TILES, bits=bits):
                        variants[f"ws_{t}"] = lambda t=t: gemm_cuda.linear(x, qw, tile=t)
                    return variants, ref, {"M": M, "N": N, "K": K, "weights": f"q{bits}g{gs}"}
                bench.case(f"linear_{sname}_q{bits}g{gs}_M{M}", 2.0 * M * N * K, build)


def swiglu_cases(bench: Bench):
    import mlx.core as mx
    import mlx.nn as nn

    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    from mlx_bricks.bricks.swiglu import cuda as swiglu_cuda

    dtype = mx.bfloat16
    N, K = SHAPES["gate_up"]
    ws = [n for n, t in swiglu_cuda.SWIGLU_TILES.items() if t.ws]
    for bits, gs in FORMATS:
        for M in M_SIZES:
            def build(M=M, bits=bits, gs=gs):
                x = _randn(mx, (M, K), dtype, 1)
                (wg, dg), (wu, du) = (_qweight(mx, N, K, bits, gs, dtype, s) for s in (2, 3))
                g32 = x.astype(mx.float32) @ dg.astype(mx.float32).T
                ref = nn.silu(g32) * (x.astype(mx.float32) @ du.astype(mx.float32).T)
                mx.eval(x, ref)

                def qmm(w):
                    return mx.quantized_matmul(x, w.w, w.scales, w.biases, transpose=True,
                                               group_size=gs, bits=bits)

                def composite():
                    g = x @ mx.dequantize(wg.w, wg.scales, wg.biases, group_size=gs, bits=bits).T
                    u = x @ mx.dequantize(wu.w, wu.scales, wu.biases, group_size=gs, bits=bits).T
                    return nn.silu(g) * u

                variants = {"cublas_bf16": lambda: nn.silu(x @ dg.T) * (x @ du.T),
                            "stock_qmm": lambda: nn.silu(qmm(wg)) * qmm(wu),
                            "composite_dequant": composite}
                names = gemm_cuda.dtype_tile_names(swiglu_cuda.SWIGLU_TILES, dtype, 2, bits)
                for t in (n for n in ws if n in names):
                    variants[f"ws_{t}"] = lambda t=t: swiglu_cuda.swiglu(x, wg, wu, tile=t)
                return variants, ref, {"M": M, "N": N, "K": K, "weights": f"q{bits}g{gs}"}
            bench.case(f"swiglu_gate_up_q{bits}g{gs}_M{M}", 4.0 * M * N * K, build)


def moe_cases(bench: Bench):
    import mlx.core as mx

    from mlx_bricks.bench import moe as moe_bench
    from mlx_bricks.bricks.moe.kind import MOE_MLP
    from mlx_bricks.bricks.moe.piece import moe_args

    for shape, fmt, fname in ((moe_bench.QWEN3_30B_A3B, (4, 64), "q4g64"),
                              (moe_bench.GPT_OSS_20B, "mxfp4", "mxfp4")):
        for M in (2048, 8192):
            def build(shape=shape, fmt=fmt, M=M):
                glu = _moe_module(shape, fmt, mx.bfloat16)
                x = _randn(mx, (M, shape.hidden), mx.bfloat16, 100)
                router = mx.random.normal((M, shape.experts), key=mx.random.key(101))
                idx = mx.argpartition(-router, kth=shape.top_k - 1, axis=-1)[..., :shape.top_k]
                mx.eval(x, idx)
                args = moe_args(glu, x, idx)
                variants = {"stock_switchglu": lambda: glu(x, idx)}
                for c in MOE_MLP.composites:
                    variants[f"composite_{c.name}"] = lambda c=c: c.bind({}).run(args, "cuda")
                for t in MOE_MLP.listing("cuda", mx.bfloat16, args):
                    variants[f"brick_{t}"] = lambda t=t: MOE_MLP.brick(
                        args, "cuda", **MOE_MLP.variant_kwargs(t))
                return variants, None, {"M": M, "weights": fname,
                                        "rows_per_expert": M * shape.top_k / shape.experts}
            bench.case(f"moe_{shape.name}_{fname}_M{M}", shape.flops(M), build)


def _moe_module(shape, fmt, dtype):
    """mlx-lm's SwitchGLU of ``shape``, random weights; ``fmt`` (bits, gs) or a mode name."""
    import mlx.core as mx

    from mlx_bricks.bench import moe as moe_bench

    if not isinstance(fmt, str):
        return moe_bench._stock_module(shape, fmt, dtype)
    glu = moe_bench._stock_module(shape, None, dtype)
    for name in ("gate_proj", "up_proj", "down_proj"):
        setattr(glu, name, getattr(glu, name).to_quantized(group_size=32, bits=4, mode=fmt))
    mx.eval(glu.parameters())
    return glu


def layer_summary(bench: Bench):
    """Per M: the 8B layer's GEMM milliseconds (q + o on qo, k + v on kv, gate/up fused, down)
    for cuBLAS bf16, stock and the best ws tile of each case."""
    cases = {c["name"]: c for c in bench.doc["cases"]}
    out = {}
    for bits, gs in FORMATS:
        for M in M_SIZES:
            parts = [(f"linear_qo_q{bits}g{gs}_M{M}", 2), (f"linear_kv_q{bits}g{gs}_M{M}", 2),
                     (f"swiglu_gate_up_q{bits}g{gs}_M{M}", 1),
                     (f"linear_down_q{bits}g{gs}_M{M}", 1)]
            fam = {}
            for family in ("cublas_bf16", "stock_qmm", "composite_dequant", "ws"):
                total = 0.0
                for name, times in parts:
                    vs = cases.get(name, {}).get("variants", {})
                    ms = [v["ms"] for k, v in vs.items()
                          if (k.startswith("ws_") if family == "ws" else k == family) and "ms" in v]
                    if not ms:
                        total = None
                        break
                    total += times * min(ms)
                fam[family] = total
            out[f"q{bits}g{gs}_M{M}"] = fam
    bench.doc["layer_gemm_ms"] = out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gemm_bench.json")
    p.add_argument("--budget", type=float, default=200.0,
                   help="seconds after which the remaining cases are skipped")
    p.add_argument("--only", nargs="*", default=[], help="substrings of case names to run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", choices=("llama8b", "lfm2"), default="llama8b",
                   help="whose projections: Llama-3-8B's (default) or LFM2-1.2B's at M 2,048")
    a = p.parse_args(argv)
    global SHAPES, M_SIZES, SMALL_CAP, FORMATS
    groups = (linear_cases, swiglu_cases, moe_cases)
    if a.model == "lfm2":  # 4-bit gs64, no MoE
        SHAPES, M_SIZES, SMALL_CAP, FORMATS = LFM2_SHAPES, (2048,), 12998920, ((4, 64),)
        groups = groups[:2]
    import mlx.core as mx

    if not mx.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    bench = Bench(a.out, a.budget, a.only, a.repeats)
    print(f"device {bench.doc['device']}, peak {bench.peak} TFLOP/s, mlx {mx.__version__}")
    for group in groups:
        try:
            group(bench)
        except Exception as e:  # noqa: BLE001
            bench.doc.setdefault("errors", []).append(f"{group.__name__}: {e}"[:1500])
    layer_summary(bench)
    bench.save()
    print(json.dumps(bench.doc["layer_gemm_ms"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
