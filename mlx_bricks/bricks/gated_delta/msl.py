"""The Gated DeltaNet brick's kernel (``metal_src/gated_delta.metal``) and its CUDA twin
(``cuda_src/gated_delta.cu``): spec, tiles and the one launch of both. The twin runs the MSL
kernel's algorithm and geometry with its threadgroup arrays in dynamic shared memory. What it
computes: ``op.py`` (the chunked form); the kernel files document their layout.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.kernels import launch

#: Tokens per chunk of the kernel (a gate per head: the (C x C) products on one 8x8 tile per
#: SIMD-group; a gate per key dim: those products pair by pair, cheaper per token at 8, and the
#: decays per key dim in threadgroup memory), threads per threadgroup.
CHUNK = 16
VEC_CHUNK = 8
THREADS = 128
#: Largest key head dim: the chunk's keys and queries and the state slice live in threadgroup
#: memory (at DK = 128 and 16 value columns: 30.4 KB of Apple GPUs' 32 KB with a gate per head
#: at C = 16, 23.8 KB with a gate per key dim at C = 8).
MAX_DK = 128

kernels.register(kernels.KernelSpec(
    name="gated_delta",
    body="gated_delta.metal",
    input_names=("q", "k", "v", "g", "beta", "state_in", "iparams"),
    output_names=("y", "state_out"),
    cuda_body="gated_delta.cu",
    cuda_headers=("mma.cuh",),
))


def chunk_of(vec: bool) -> int:
    """The kernel's tokens per chunk for a gate per key dim (``vec``) or per head."""
    return VEC_CHUNK if vec else CHUNK


def shared_bytes(Dk: int, dvb: int, vec: bool = False) -> int:
    """Threadgroup (shared) memory of the kernel, bytes: the chunk's keys and queries (rows
    padded by one float against bank conflicts), the state slice, four (C, DVB) and two (C, C)
    float tiles, the chunk's log decays, betas and decays from its start and to its end; with
    a gate per key dim (``vec``) also the (C, Dk) log decays and the last token's."""
    c = chunk_of(vec)
    floats = 2 * c * (Dk + 1) + Dk * dvb + 4 * c * dvb + 2 * c * c + 4 * c
    return 4 * (floats + (c * (Dk + 1) + Dk if vec else 0))


def value_block(Dv: int) -> int | None:
    """Value columns per threadgroup for head dim ``Dv`` (16 or 8), or None."""
    for dvb in (16, 8):
        if Dv % dvb == 0:
            return dvb
    return None


def kernel_reason(q, v, g) -> str | None:
    """Why the kernel does not compute these arguments (None: it does): a key head dim above
    :data:`MAX_DK` or not a multiple of 8 (8x8 tiles), a value head dim not a multiple of 8.
    Gates per head and per key dim both run it."""
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
    """Run the kernel on ``backend`` (``metal``, ``emulator``, or the twin on ``cuda``, its
    threadgroup arrays in dynamic shared memory); arguments checked by the op (a gate per head
    or per key dim, Dk <= MAX_DK, Dv a multiple of 8, a float32 state). Returns
    ``(y, state)``."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    dvb = value_block(Dv)
    vec = g.ndim == 4
    smem = {"shared_memory": shared_bytes(Dk, dvb, vec)} if backend == "cuda" else {}
    y, s = launch(
        "gated_delta", backend, **smem,
        inputs=[q, k, v, g.astype(mx.float32), beta.astype(mx.float32),
                state.astype(mx.float32), mx.array([T], mx.int32)],
        grid=(THREADS * (Dv // dvb), Hv, B), threadgroup=(THREADS, 1, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
        template=[("InT", q.dtype), ("DK", Dk), ("DV", Dv), ("HK", Hk), ("HV", Hv),
                  ("C", chunk_of(vec)), ("DVB", dvb), ("NT", THREADS), ("VEC", int(vec))],
    )
    return y, s
