"""The Gated DeltaNet brick's kernel (``metal_src/gated_delta.metal``) and its CUDA twin
(``cuda_src/gated_delta.cu``): spec, tiles and the one launch of both. The twin runs the MSL
kernel's algorithm and geometry with its threadgroup arrays in dynamic shared memory. What it
computes: ``op.py`` (the chunked form); the kernel files document their layout.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.kernels import launch

#: Tokens per chunk of the kernel, value columns per threadgroup, threads per threadgroup.
CHUNK = 16
THREADS = 128
#: Largest key head dim: the chunk's keys and queries and the state slice live in threadgroup
#: memory (30.4 KB of Apple GPUs' 32 KB at DK = 128, C = 16, 16 value columns).
MAX_DK = 128

kernels.register(kernels.KernelSpec(
    name="gated_delta",
    body="gated_delta.metal",
    input_names=("q", "k", "v", "g", "beta", "state_in", "iparams"),
    output_names=("y", "state_out"),
    cuda_body="gated_delta.cu",
    cuda_headers=("mma.cuh",),
))


def shared_bytes(Dk: int, dvb: int, chunk: int = CHUNK) -> int:
    """Threadgroup (shared) memory of the kernel, bytes: the chunk's keys and queries (rows
    padded by one float against bank conflicts), the
    state slice, four (C, DVB) and two (C, C) float tiles, the chunk's log decays, betas and
    decays from its start and to its end."""
    return 4 * (2 * chunk * (Dk + 1) + Dk * dvb + 4 * chunk * dvb + 2 * chunk * chunk + 4 * chunk)


def value_block(Dv: int) -> int | None:
    """Value columns per threadgroup for head dim ``Dv`` (16 or 8), or None."""
    for dvb in (16, 8):
        if Dv % dvb == 0:
            return dvb
    return None


def kernel_reason(q, v, g) -> str | None:
    """Why the kernel does not compute these arguments (None: it does): per-key-dim gates,
    a key head dim above :data:`MAX_DK` or not a multiple of 8 (8x8 tiles), a value head dim
    not a multiple of 8."""
    if g.ndim == 4:
        return "per-key-dim gates (g of shape (B, T, Hv, Dk)): the kernel takes a gate per head"
    if q.shape[-1] == 0 or v.shape[-1] == 0:  # kernel review: no tile to compute
        return f"empty head dim (Dk {q.shape[-1]}, Dv {v.shape[-1]})"
    if q.shape[-1] > MAX_DK:
        return f"Dk {q.shape[-1]} > {MAX_DK}: the kernel's chunk does not fit threadgroup memory"
    if q.shape[-1] % 8:
        return f"Dk {q.shape[-1]} is not a multiple of 8 (the kernel's 8x8 tiles)"
    if value_block(v.shape[-1]) is None:
        return f"Dv {v.shape[-1]} is not a multiple of 8"
    return None


def launch_gated_delta(q, k, v, g, beta, state, *, backend: str):
    """Run the kernel on ``backend`` (``metal``, ``emulator``, or the twin on ``cuda``);
    arguments checked by the op (scalar gates, Dk <= MAX_DK, Dv a multiple of 8, a float32
    state). Returns ``(y, state)``."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    dvb = value_block(Dv)
    smem = {"shared_memory": shared_bytes(Dk, dvb)} if backend == "cuda" else {}
    y, s = launch(
        "gated_delta", backend, **smem,
        inputs=[q, k, v, g.astype(mx.float32), beta.astype(mx.float32),
                state.astype(mx.float32), mx.array([T], mx.int32)],
        grid=(THREADS * (Dv // dvb), Hv, B), threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
        template=[("InT", q.dtype), ("DK", Dk), ("DV", Dv), ("HK", Hk), ("HV", Hv),
                  ("C", CHUNK), ("DVB", dvb), ("NT", THREADS)],
    )
    return y, s
