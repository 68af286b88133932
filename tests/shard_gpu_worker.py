"""One rank of the two-GPU tensor-parallel check (``tests/test_shard_gpu.py``).

Started as ``python -m tests.shard_gpu_worker OUT_DIR`` by ``tests.launch.launch_local``
(NCCL, one GPU per rank): ``mlx_bricks.bench.shard.run_rank`` on the 8B-shaped 4-layer llama at
M = 2048, bf16, patched on ``cuda`` with the tuner on, written to ``OUT_DIR/rank<r>.json``
(correctness for the test; the same-process timing ratio stays in the JSON).
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from tests.launch import NCCL_SAFE_ENV

os.environ.update(NCCL_SAFE_ENV)  # NVLink multicast off before NCCL starts
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # the float32 reference stays float32


def main(out_dir: str) -> int:
    from mlx_bricks.bench.shard import run_rank

    res = run_rank(shape_name="llama8b_4layer", dtype="bf16", M=2048, backend="cuda",
                   tune="auto", repeats=10, dist_backend="nccl", expect_size=2)
    Path(out_dir, f"rank{res['rank']}.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
