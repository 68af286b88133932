"""The SSD brick's CUDA twin: the three steps of ``msl.py`` from ``cuda_src/ssd_chunk_state.cu``,
``ssd_state_pass.cu`` and ``ssd_chunk_out.cu`` (the MSL files' algorithm, template and
geometry; their threadgroup arrays in dynamic shared memory)."""
from __future__ import annotations

from mlx_bricks.bricks.ssd import msl
from mlx_bricks.kernels import launch


def launch_ssd_cuda(x, dtp, A, B, C, D, state, out_dtype):
    """Run the twin (arguments as ``msl.run_steps``). Returns ``(y, state)``."""
    return msl.run_steps(x, dtp, A, B, C, D, state, out_dtype, backend="cuda", launch=launch)
