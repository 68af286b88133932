"""The RMSNorm + QKV brick's CUDA twin (``cuda_src/rms_norm_qkv.cu`` on the GEMM pipeline of
``cuda_src/gemm.cuh``; tiles and launch helpers: ``mlx_bricks.bricks.gemm.cuda``)."""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.bricks.gemm.cuda import (
    TILES,
    check_dtype,
    geometry,
    pick_tile,
    smem_of,
    weight_triple,
)
from mlx_bricks.bricks.norm_qkv.msl import QKV_SPEC
from mlx_bricks.kernels import launch


def rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *, n_heads,
                 n_kv_heads, head_dim, tile=None):
    """The RMSNorm + QKV twin: ``h = mx.fast.rms_norm(x)`` (stock's own kernel, the same
    rounding), then ``rms_norm_qkv.cu``: the three projections in one launch, each weight float
    or affine in its own format, written in head layout. Validated arguments; x (B, L, K) with
    B * L >= 1.

    Returns:
        (q, k, v): (B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim) twice.
    """
    check_dtype(x.dtype)
    B, L, K = x.shape
    M = B * L
    h = mx.contiguous(mx.fast.rms_norm(x, norm_weight, eps))
    nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
    triples = [weight_triple(w, x.dtype, n) for w, n in ((wq, "wq"), (wk, "wk"), (wv, "wv"))]
    t = pick_tile(TILES, tile, M, nq, 1, max(tr[1] for tr in triples))
    tiles_n = math.ceil(nq / t.bn) + 2 * math.ceil(nkv / t.bn)
    blocks = math.ceil(M / t.bm) * tiles_n
    ph = triples[0][0][1]
    has_bias = bq is not None
    biases = [mx.contiguous(b) for b in (bq, bk, bv)] if has_bias else [ph, ph, ph]
    fmt = []
    for (_, bits, gs), p in zip(triples, "QKV"):
        fmt += [(f"BITS_{p}", bits), (f"GS_{p}", gs)]
    q, k, v = launch(
        QKV_SPEC.name, "cuda",
        inputs=[h, *triples[0][0], *triples[1][0], *triples[2][0], *biases],
        template=geometry(t, x.dtype) + fmt + [
            ("HAS_BIAS", has_bias), ("N_HEADS", n_heads), ("N_KV_HEADS", n_kv_heads),
            ("HEAD_DIM", head_dim)],
        grid=(blocks * t.threads, 1, 1), threadgroup=(t.threads, 1, 1),
        output_shapes=[(B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim),
                       (B, n_kv_heads, L, head_dim)],
        output_dtypes=[x.dtype] * 3,
        shared_memory=smem_of(t, [tr[1] for tr in triples]),
    )
    return q, k, v
