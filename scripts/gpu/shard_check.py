#!/usr/bin/env python
"""Tensor-parallel prefill on 2 GPUs: the bricks inside mlx-lm's sharded llama (issue 18).

An 8B-shaped 4-layer llama (``mlx_bricks.bench.e2e.LLAMA_8B_4LAYER``, random bf16 weights)
sharded with mlx-lm's ``Model.shard()`` over 2 ranks (NCCL, one H200 each), stock vs
``patch_model(backend="cuda", tune="auto")`` on the same sharded weights, prefill of M = 2048
tokens: correctness (logits vs a float32 copy with the dtype-scaled rule, max |patched - stock|,
greedy token) and the same-process timing ratio (``mlx_bricks.bench.shard``).

On the GPU machine (kind ``nvidia-h200-x2``; MLX in /tmp/site, ../shared/docs/device.md)::

    python3 scripts/gpu/shard_check.py --out $OUT/shard.json          # starts the 2 NCCL ranks

or through MLX's own launcher (the same worker; each rank sees one GPU)::

    PATH=/tmp/site/bin:$PATH mlx.launch --backend nccl -n 2 --env NCCL_NVLS_ENABLE=0 \\
        -- python3 scripts/gpu/shard_check.py --worker --dist nccl --out $OUT/shard.json

(each rank then writes ``shard.rank<r>.json``; a worker started without a launcher fails
instead of running alone in a group of one).

NVLink multicast stays off: the launcher and the worker set ``NCCL_NVLS_ENABLE=0`` (and the
PyTorch / NVSHMEM equivalents) before NCCL starts. The same code runs tiny on the CPU with the
ring backend and the reference bricks::

    python scripts/gpu/shard_check.py --tiny --backend reference --dist ring --out /tmp/s.json

Writes one JSON (``--out``): every rank's results and a summary; exits 1 when a rank fails or
the check is not correct.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mlx_bricks.launch import NCCL_SAFE_ENV, launch_local  # noqa: E402

os.environ.update(NCCL_SAFE_ENV)  # before NCCL starts in this process (worker) or the ranks
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # the float32 reference stays float32


def _rank_path(out: Path, rank: int) -> Path:
    return out.with_name(f"{out.stem}.rank{rank}.json")


def worker(args) -> int:
    from mlx_bricks.bench.shard import run_rank

    res = run_rank(shape_name=args.shape, dtype=args.dtype, M=args.M, backend=args.backend,
                   tune=args.tune, repeats=args.repeats, dist_backend=args.dist,
                   expect_size=args.ranks)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    _rank_path(out, res["rank"]).write_text(json.dumps(res, indent=1))
    c, t = res["correct"], res["timing"]
    print(f"rank {res['rank']}/{res['size']}: correct={c['ok']} (error {c['error_vs_fp32']:.3g}"
          f" <= {c['budget']:.3g}; max|patched-stock| {c['max_abs_patched_vs_stock']:.3g} of "
          f"|logit| {c['max_abs_stock_logit']:.3g}; greedy {c['greedy_patched']} vs "
          f"{c['greedy_stock']}), stock {t['group_stock_s'] * 1e3:.2f} ms, patched "
          f"{t['group_patched_s'] * 1e3:.2f} ms, speedup x{t['speedup']:.3f}", flush=True)
    return 0 if c["ok"] else 1


def launcher(args) -> int:
    out = Path(args.out)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out),
           "--shape", args.shape, "--dtype", args.dtype, "--M", str(args.M),
           "--backend", args.backend, "--tune", args.tune, "--repeats", str(args.repeats),
           "--dist", args.dist, "--ranks", str(args.ranks)]
    results = launch_local(cmd, args.ranks, args.dist, timeout=args.timeout, cwd=ROOT)
    ranks = []
    for r in results:
        print(f"=== rank {r.rank}: exit {r.returncode}\n{r.stdout[-2000:]}{r.stderr[-3000:]}",
              flush=True)
        path = _rank_path(out, r.rank)
        ranks.append(json.loads(path.read_text()) if path.exists() else
                     {"rank": r.rank, "exit": r.returncode, "stderr": r.stderr[-4000:]})
    ok = all(r.returncode == 0 for r in results) and all(
        "correct" in r and r["correct"]["ok"] for r in ranks)
    summary = {"ok": ok, "ranks": args.ranks, "dist": args.dist}
    if "timing" in ranks[0]:
        summary.update(speedup=ranks[0]["timing"]["speedup"],
                       group_stock_s=ranks[0]["timing"]["group_stock_s"],
                       group_patched_s=ranks[0]["timing"]["group_patched_s"],
                       correct=ranks[0]["correct"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "ranks": ranks}, indent=1))
    for r in range(args.ranks):
        _rank_path(out, r).unlink(missing_ok=True)
    print(json.dumps(summary), flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--worker", action="store_true",
                   help="run as one rank (MLX_RANK etc. set by a launcher)")
    p.add_argument("--tiny", action="store_true", help="tiny model, M=64, 3 repeats (CPU)")
    p.add_argument("--shape", default="llama8b_4layer", choices=("llama8b_4layer", "tiny"))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--M", type=int, default=2048, help="prompt tokens (one prefill chunk)")
    p.add_argument("--backend", default="cuda", help="the bricks' backend (patch_model)")
    p.add_argument("--tune", default="auto", choices=("auto", "off", "force"))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--ranks", type=int, default=2,
                   help="ranks to start (launcher) / the group size to expect (worker)")
    p.add_argument("--dist", default="nccl", choices=("nccl", "ring"),
                   help="distributed backend (the launcher sets it up; the worker joins it)")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds for all ranks")
    args = p.parse_args(argv)
    if args.tiny:
        args.shape, args.M, args.repeats = "tiny", min(args.M, 64), min(args.repeats, 3)
    return worker(args) if args.worker else launcher(args)


if __name__ == "__main__":
    sys.exit(main())
