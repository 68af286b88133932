"""GEMM-family CUDA twins vs stock MLX on the GPU machine: one run, a table, JSON.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu/gemm_cuda_check.py --out $OUT/gemm.json

Times linear (bf16, 4-bit gs64, 8-bit gs64 at the llama-3-8B shapes, each CUDA tile), the
SwiGLU twins (fused, split) and RMSNorm + QKV against stock MLX in the same process
(mlx_bricks.bench.gpu), and records each output's difference from stock.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--only", default="", help="comma-separated name prefixes")
    p.add_argument("--tiles", default="wg128x256,wg128x128,128x128",
                   help="comma-separated CUDA tiles for the linear cases")
    args = p.parse_args()
    import mlx.core as mx

    from mlx_bricks.bench import gpu
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    tiles = tuple(t for t in args.tiles.split(",") if t in gemm_cuda.TILES)
    cases = [*gpu.linear_cases("cuda", tiles=tiles),
             *gpu.swiglu_cases("cuda"), *gpu.rms_norm_qkv_cases("cuda")]
    if args.only:
        keep = tuple(args.only.split(","))
        cases = [c for c in cases if c.name.startswith(keep)]
    results = []
    t0 = time.time()
    for c in cases:
        r = gpu.run_case(c)
        results.append(r)
        if "error" in r:
            print(f"{r['name']:<40} ERROR {r['error'][:300]}", flush=True)
        else:
            print(f"{r['name']:<40} brick {r['brick_tflops']:7.1f} TF/s stock "
                  f"{r['stock_tflops']:7.1f} TF/s ratio {r['ratio']:5.2f} "
                  f"diff {r['rel_diff']:.2e}", flush=True)
    doc = {"date": time.strftime("%Y-%m-%d"), "device": mx.device_info(),
           "mlx": mx.__version__, "python": platform.python_version(),
           "seconds": time.time() - t0, "results": results}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
