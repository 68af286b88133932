"""Tensor-parallel prefill on two GPUs (marker ``gpu``; needs 2 CUDA GPUs and MLX's NCCL
backend, skipped otherwise): what scripts/gpu/shard_check.py checked, as a test.

The 8B-shaped 4-layer llama sharded with mlx-lm's ``Model.shard()`` over 2 NCCL ranks (one
process per GPU, ``tests.shard_gpu_worker``), stock vs ``patch_model(backend="cuda",
tune="auto")`` on the same sharded weights, M = 2048: on every rank the patched logits meet the
dtype-scaled rule against a float32 copy (``mlx_bricks.bench.shard.run_rank``). The timing ratio
it measures is written to ``$MLX_BRICKS_GPU_OUT/shard.json`` when that variable is set (the GPU
session sets it to ``$OUT``). Machine kind ``nvidia-h200-x2``; NVLink multicast stays off.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from tests.launch import launch_local
from tests.gpu_support import gpu

ROOT = Path(__file__).resolve().parents[1]


def _gpu_count() -> int:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    out = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout
    return sum(line.startswith("GPU ") for line in out.splitlines())


@gpu
def test_two_gpu_sharded_prefill_matches_float32(tmp_path):
    if not mx.distributed.is_available("nccl"):
        pytest.skip("MLX's NCCL distributed backend is not available in this build")
    if _gpu_count() < 2:
        pytest.skip("needs 2 GPUs (machine kind nvidia-h200-x2)")
    results = launch_local([sys.executable, "-m", "tests.shard_gpu_worker", str(tmp_path)], 2,
                           "nccl", timeout=540, cwd=ROOT)
    for r in results:
        assert r.returncode == 0, f"rank {r.rank} exited with {r.returncode}:\n{r.stderr[-4000:]}"
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    out = os.environ.get("MLX_BRICKS_GPU_OUT")
    if out:
        Path(out, "shard.json").write_text(json.dumps(ranks, indent=1))
    for res in ranks:
        c = res["correct"]
        assert c["ok"], (f"rank {res['rank']}: error {c['error_vs_fp32']:.3g} > budget "
                         f"{c['budget']:.3g}")
