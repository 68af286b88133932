"""The Gated DeltaNet brick's CUDA twin (``cuda_src/gated_delta.cu``): the MSL kernel's algorithm
and geometry (``msl.py``) with its threadgroup arrays in dynamic shared memory."""
from __future__ import annotations

from mlx_bricks.bricks.gated_delta.msl import launch_kwargs, shared_bytes, value_block
from mlx_bricks.kernels import launch


def launch_gated_delta_cuda(q, k, v, g, beta, state):
    """Run the twin (arguments as ``msl.launch_gated_delta``, checked by the op). Returns
    ``(y, state)``."""
    y, s = launch("gated_delta", "cuda",
                  shared_memory=shared_bytes(q.shape[-1], value_block(v.shape[-1]),
                                             g.ndim == 4),
                  **launch_kwargs(q, k, v, g, beta, state))
    return y, s
