"""The short-conv brick's CUDA twin (``cuda_src/short_conv.cu``): the MSL kernel's algorithm
and geometry (``msl.py``)."""
from __future__ import annotations

from mlx_bricks.bricks.short_conv.msl import launch_kwargs
from mlx_bricks.kernels import launch


def launch_short_conv_cuda(*args):
    """Run the twin (arguments as ``msl.launch_short_conv``, checked by the op). Returns
    ``(y, state)``."""
    y, s = launch("short_conv", "cuda", **launch_kwargs(*args))
    return y, s
