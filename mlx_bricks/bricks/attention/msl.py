"""The attention brick's MSL kernel (``metal_src/attention.metal``): spec, tile configuration
and launch. What it computes: ``op.py``.
"""
from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from mlx_bricks import kernels

#: Head dims the brick supports (all tested); others raise ValueError.
SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
#: Threadgroup memory limit of Apple GPUs, bytes (``ATTN_TG_LIMIT`` in ``attention.h``).
THREADGROUP_MEMORY_LIMIT = 32768
#: Largest head_dim slice one SIMD-group keeps in registers (Q and O: 2 x slice / 4 floats a lane).
MAX_HEAD_DIM_PER_SIMDGROUP = 128

kernels.register(kernels.KernelSpec(
    name="flash_attention",
    body="attention.metal",
    input_names=("q", "k", "v", "k_scale", "v_scale", "fparams", "iparams", "kv_start",
                 "sinks"),
    output_names=("out",),
    headers=("q8_0.h", "gemm.h", "attention.h"),
    ensure_row_contiguous=False,
    cuda_body="attention.cu",
    cuda_headers=("mma.cuh", "attention_common.cuh", "attention_stage.cuh", "attention.cuh"),
))


class AttentionTiles(NamedTuple):
    """Tile sizes of one attention kernel variant (template arguments and launch geometry).

    Attributes:
        bq: query rows per threadgroup (``8 * wq``).
        bk: keys per K/V tile.
        wq: 8-row query blocks per threadgroup.
        wd: SIMD-groups per row block splitting head_dim (each owns ``head_dim / wd`` columns).
        kv_shared: K and V take turns in one threadgroup buffer (only where two do not fit).
        threadgroup_bytes: threadgroup memory of the kernel, bytes.
    """

    bq: int
    bk: int
    wq: int
    wd: int
    kv_shared: bool
    threadgroup_bytes: int

    @property
    def threads(self) -> int:
        """Threads per threadgroup: 32 per SIMD-group, ``wq * wd`` SIMD-groups."""
        return 32 * self.wq * self.wd


def attention_threadgroup_bytes(head_dim: int, itemsize: int, bk: int, wq: int, wd: int,
                                kv_shared: bool, dv: int | None = None) -> int:
    """Threadgroup memory of the attention kernel, bytes: a K tile of ``bk`` keys with rows of
    ``head_dim`` elements and a V tile with rows of ``dv`` (default ``head_dim``) elements, rows
    padded by 16 bytes (one buffer of the larger when ``kv_shared``), plus ``wq * wd * 8 * bk``
    float32 partial scores when ``wd > 1``."""
    pad = 16 // itemsize
    k_tile = bk * (head_dim + pad) * itemsize
    v_tile = bk * ((head_dim if dv is None else dv) + pad) * itemsize
    partial = wq * wd * 8 * bk * 4 if wd > 1 else 0
    return (max(k_tile, v_tile) if kv_shared else k_tile + v_tile) + partial


def attention_tile_config(head_dim: int, dtype, dv: int | None = None) -> AttentionTiles:
    """Tile sizes of the attention kernel for ``head_dim`` (of q and k), the q dtype and ``dv``
    (head_dim of v, default ``head_dim``; smaller in multi-head latent attention: its V tile is
    narrower, so the same tiles fit).

    Rule (not tuned on hardware): ``wd`` is the fewest SIMD-groups that keep each one's
    head_dim slice at most 128 (1 up to 128, 2 for 192 and 256, 4 for 512), ``wq`` 4 row blocks
    (2 at head_dim 512), so 128 threads up to head_dim 128 and 256 above. ``bk`` starts at 32
    for head_dim <= 96 and 16 above (as MLX's steel attention); where K and V tiles of that
    ``bk`` do not fit in 32 KB side by side, they share one buffer (``kv_shared``: 2 barriers
    per tile more, against halving ``bk``, which doubles every per-tile barrier: head_dim 512 in
    16 bits runs bk 16 shared, 4 barriers per 16 keys, where bk 8 took 3 per 8), and ``bk`` is
    halved, down to 8, only while even one buffer does not fit (float32, head_dim 512: bk 8
    shared).

    Raises:
        ValueError: head_dim not in ``SUPPORTED_HEAD_DIMS``.
    """
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; supported: "
                         f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    itemsize = dtype.size
    wd = 1
    while head_dim // wd > MAX_HEAD_DIM_PER_SIMDGROUP:
        wd *= 2
    wq = 4 if wd <= 2 else 2
    bk = 32 if head_dim <= 96 else 16
    shared = False

    def nbytes():
        return attention_threadgroup_bytes(head_dim, itemsize, bk, wq, wd, shared, dv)

    if nbytes() > THREADGROUP_MEMORY_LIMIT:
        shared = True
    while nbytes() > THREADGROUP_MEMORY_LIMIT and bk > 8:
        bk //= 2
    size = nbytes()
    assert size <= THREADGROUP_MEMORY_LIMIT, (head_dim, dtype, bk, size)
    assert head_dim % (8 * wd) == 0
    return AttentionTiles(8 * wq, bk, wq, wd, shared, size)


def sinks_input(sinks) -> mx.array:
    """The kernels' ``sinks`` input: (Hq,) float32 (exact for every float dtype), or a (1,)
    dummy, never read, without sinks."""
    return mx.zeros((1,), mx.float32) if sinks is None else sinks.astype(mx.float32)


def launch_attention(q, k, v, k_scale, v_scale, *, scale, causal, window, softcap, backend,
                     kv_start=None, sinks=None):
    """Run the MSL attention kernel on ``backend`` (metal or emulator); returns (B, Hq, Lq, Dv)
    as a transposed view of a (B, Lq, Hq, Dv) buffer (Dv: v's head_dim, D or less). k/v are T
    arrays, or int8 quants with
    their float16 scales k_scale/v_scale (else None). ``kv_start``: None, or an int32 (B,)
    array, batch row b's first valid key (the kernel's ``KV_START`` instantiation; the kernel
    clamps it to 0 .. Lk). ``sinks``: None, or (Hq,) float (the ``SINKS`` instantiation, read
    in float32). No argument checks: the caller has done them (tests reach the
    kernel's no-visible-key guard through here with Lq > Lk)."""
    B, Hq, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    tiles = attention_tile_config(D, q.dtype, Dv)
    kv_q8 = k_scale is not None
    if not kv_q8:
        k_scale = v_scale = mx.zeros((1, 1, 1, 1), mx.float16)  # never read; 4-D strides
    # Query position p = Lk - Lq + i <= Lk - 1, so a window of Lk or more excludes no key.
    windowed = window is not None and window < Lk
    cap = 0.0 if softcap is None else float(softcap)
    fparams = mx.array([scale, cap, 1.0 / cap if cap else 0.0], mx.float32)
    iparams = mx.array([window if windowed else 0], mx.int32)
    n_qblocks = -(-Lq // tiles.bq)
    has_start = kv_start is not None
    if not has_start:
        kv_start = mx.zeros((1,), mx.int32)  # never read
    (out,) = kernels.launch(
        "flash_attention", backend,
        inputs=[q, k, v, k_scale, v_scale, fparams, iparams, kv_start, sinks_input(sinks)],
        grid=(tiles.threads * n_qblocks, Hq, B),
        threadgroup=(tiles.threads, 1, 1),
        output_shapes=[(B, Lq, Hq, Dv)],
        output_dtypes=[q.dtype],
        template=[("T", q.dtype), ("D", D), ("DV", Dv), ("BK", tiles.bk), ("WQ", tiles.wq),
                  ("WD", tiles.wd), ("KV_SHARED", tiles.kv_shared), ("CAUSAL", bool(causal)),
                  ("WINDOW", windowed), ("SOFTCAP", softcap is not None), ("KV_Q8", kv_q8),
                  ("KV_START", has_start), ("SINKS", sinks is not None)],
    )
    return out.transpose(0, 2, 1, 3)


