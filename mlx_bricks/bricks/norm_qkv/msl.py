"""The RMSNorm + QKV brick's MSL kernels (``metal_src/rms_norm_inv.metal``, then
``rms_norm_qkv.metal`` on the GEMM pipeline of ``metal_src/gemm.h``): specs, plan and launch.
What they compute: ``op.py``.
"""
from __future__ import annotations

import dataclasses
import math

import mlx.core as mx

from mlx_bricks.bricks.gemm import msl as gemm
from mlx_bricks.formats import format_of
from mlx_bricks.kernels import KernelSpec, launch, register

register(KernelSpec(
    name="rms_norm_inv",
    body="rms_norm_inv.metal",
    input_names=("x", "eps"),
    output_names=("inv_rms",),
    headers=("gemm.h",),
    # x is read through x_strides, so views of x are not copied.
    ensure_row_contiguous=False,
))
#: The fused kernel; its name is the brick's (kernel registry, tuner kind, reports).
QKV_SPEC = register(KernelSpec(
    name="rms_norm_qkv",
    body="rms_norm_qkv.metal",
    # <w>_scales, <w>_biases: each weight's affine scales and biases (placeholders for a float
    # weight, never read).
    input_names=("x", "norm_weight", "inv_rms", "wq", "wq_scales", "wq_biases", "wk",
                 "wk_scales", "wk_biases", "wv", "wv_scales", "wv_biases", "bq", "bk", "bv"),
    output_names=("q", "k", "v"),
    headers=("gemm.h", "rms_norm_qkv.h"),
    # x is read through x_strides, so views of x are not copied.
    ensure_row_contiguous=False,
    # The twin takes h = mx.fast.rms_norm(x) (see cuda_src/rms_norm_qkv.cu for why) and each
    # weight as a (w, scales, biases) triple, float or MLX affine, each in its own format.
    cuda_body="rms_norm_qkv.cu",
    cuda_headers=("mma.cuh", "dequant.cuh", "gemm.cuh", "wgmma.cuh"),
    cuda_input_names=("h", "wq", "sq", "zq", "wk", "sk", "zk", "wv", "sv", "zv", "bq", "bk",
                      "bv"),
))


def plan_rms_norm_qkv(M, n_heads, n_kv_heads, head_dim, K, dtype, *, tile=None,
                      group_sizes=()):
    """Tile plan of the fused kernel: the GEMM plan of (M, n_heads * head_dim, K) (tile rule of
    :func:`mlx_bricks.bricks.gemm.msl.select_tile` on the q projection), with the grid and the M/N
    alignment of the three projections. Threadgroup memory is the GEMM's (the inverse RMS is
    read from device memory, computed once per row by ``rms_norm_inv``).

    Args:
        group_sizes: the affine group sizes of the quantized weights among wq, wk, wv (BK
            must divide each; see :func:`mlx_bricks.bricks.gemm.msl.plan_gemm`).

    Returns:
        (plan, grid, align_mn, threadgroup_bytes).

    Raises:
        ValueError: unknown ``tile``.
        RuntimeError: threadgroup memory over ``gemm.THREADGROUP_MEMORY_LIMIT``.
    """
    nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
    plan = gemm.plan_gemm(M, nq, K, dtype, tile=tile,
                          group_size=min(group_sizes) if group_sizes else None)
    t = plan.tile
    tiles_x = math.ceil(nq / t.bn) + 2 * math.ceil(nkv / t.bn)
    grid = (tiles_x * t.threads, math.ceil(M / t.bm), 1)
    align_mn = M % t.bm == 0 and nq % t.bn == 0 and nkv % t.bn == 0
    return plan, grid, align_mn, plan.threadgroup_bytes


def inv_rms_rows(x, eps, backend):
    """``(M,)`` float32 inverse RMS of the rows of ``x`` (..., K) on the ``rms_norm_inv`` kernel:
    ``rsqrt(mean(x^2) + eps)`` in float32 as ``mx.fast.rms_norm`` computes it. ``backend`` is
    ``"metal"`` or ``"emulator"``; M = prod(x.shape[:-1]) >= 1."""
    M = math.prod(x.shape[:-1])
    vw = gemm.VECTOR_BYTES // x.dtype.size
    (inv,) = launch(
        "rms_norm_inv", backend,
        inputs=[x, mx.array(eps, dtype=mx.float32)],
        template=[("T", x.dtype), ("VEC", x.shape[-1] % vw == 0)],
        grid=(32 * M, 1, 1),
        threadgroup=(min(128, 32 * M), 1, 1),
        output_shapes=[(M,)],
        output_dtypes=[mx.float32],
    )
    return inv


def launch_rms_norm_qkv(x, norm_weight, eps, weights, biases, shapes, *, tile, backend):
    """The two launches of :func:`rms_norm_qkv` (arguments already validated, B * L >= 1):
    ``rms_norm_inv``, then the fused kernel. ``weights``: (wq, wk, wv) as ``as_weight`` returns
    them; ``biases``: (bq, bk, bv), all None or all arrays; ``shapes``: the outputs'."""
    B, L, K = x.shape
    dtype = x.dtype
    M = B * L
    n_heads, n_kv_heads, head_dim = shapes[0][1], shapes[1][1], shapes[0][3]
    w_inputs, flags = [], {}
    for suffix, w in zip("QKV", weights):
        arrays, w_flags = format_of(w).msl_inputs(w)
        w_inputs += arrays
        flags[f"BITS_{suffix}"] = w_flags["BITS"]
        flags[f"GROUP_SIZE_{suffix}"] = w_flags["GROUP_SIZE"]
    group_sizes = tuple(g for key, g in flags.items() if key.startswith("GROUP_SIZE") and g)
    plan, grid, align_mn, _ = plan_rms_norm_qkv(M, n_heads, n_kv_heads, head_dim, K, dtype,
                                                tile=tile, group_sizes=group_sizes)
    inv_rms = inv_rms_rows(x, eps, backend)
    has_bias = biases[0] is not None
    # Without biases the kernel never reads them; norm_weight stands in (x's dtype).
    b_inputs = [mx.contiguous(b) for b in biases] if has_bias else [norm_weight] * 3
    q, k, v = launch(
        QKV_SPEC.name, backend,
        inputs=[x, mx.contiguous(norm_weight), inv_rms, *w_inputs, *b_inputs],
        template=dataclasses.replace(plan, align_mn=align_mn).template(
            dtype, HAS_BIAS=has_bias, N_HEADS=n_heads, N_KV_HEADS=n_kv_heads,
            HEAD_DIM=head_dim, **flags),
        grid=grid,
        threadgroup=plan.threadgroup,
        output_shapes=shapes,
        output_dtypes=[dtype] * 3,
    )
    return q, k, v
