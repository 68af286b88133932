"""The selective-scan brick's CUDA twin (``cuda_src/selective_scan.cu``): the MSL kernel's
algorithm and geometry (``msl.py``), its SIMD shuffles as warp shuffles."""
from __future__ import annotations

from mlx_bricks.kernels import launch


def launch_cuda(kwargs: dict):
    """Run the twin with ``msl.launch_kwargs``. Returns ``(y, state)``."""
    y, s = launch("selective_scan", "cuda", **kwargs)
    return y, s
