"""The SSD brick's CUDA twin (``cuda_src/ssd.cu``): the MSL kernel's algorithm and geometry
(``msl.py``) with its threadgroup arrays in dynamic shared memory."""
from __future__ import annotations

from mlx_bricks.bricks.ssd.msl import head_block, launch_kwargs, shared_bytes
from mlx_bricks.kernels import launch


def launch_ssd_cuda(x, dtp, A, B, C, D, state, out_dtype):
    """Run the twin (arguments as ``msl.launch_ssd``, checked by the op). Returns
    ``(y, state)``."""
    y, s = launch("ssd", "cuda",
                  shared_memory=shared_bytes(B.shape[-1], head_block(x.shape[-1])),
                  **launch_kwargs(x, dtp, A, B, C, D, state, out_dtype))
    return y, s
