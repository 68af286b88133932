"""The Gated DeltaNet brick's CUDA twin (``cuda_src/gated_delta.cu``): the MSL kernel's algorithm
and geometry (``msl.py``) with its threadgroup arrays in dynamic shared memory."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.gated_delta.msl import CHUNK, THREADS, shared_bytes, value_block
from mlx_bricks.kernels import launch


def launch_gated_delta_cuda(q, k, v, g, beta, state):
    """Run the twin (arguments as ``msl.launch_gated_delta``, checked by the op). Returns
    ``(y, state)``."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    dvb = value_block(Dv)
    y, s = launch(
        "gated_delta", "cuda", shared_memory=shared_bytes(Dk, dvb),
        inputs=[q, k, v, g.astype(mx.float32), beta.astype(mx.float32),
                state.astype(mx.float32), mx.array([T], mx.int32)],
        grid=(THREADS * (Dv // dvb), Hv, B), threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
        template=[("InT", q.dtype), ("DK", Dk), ("DV", Dv), ("HK", Hk), ("HV", Hv),
                  ("C", CHUNK), ("DVB", dvb), ("NT", THREADS)],
    )
    return y, s
