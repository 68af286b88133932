"""RMSNorm fused with the Q/K/V projections, written straight in head layout.

One kernel (``metal_src/rms_norm_qkv.metal`` on the GEMM pipeline of ``metal_src/gemm.h``):
each threadgroup computes the inverse RMS of its rows, normalises x as the A tile is loaded,
multiplies by the one weight (wq, wk or wv) its column tile belongs to, and writes its output
tile in (B, heads, L, head_dim) layout, so no normalised copy of x, no concatenated weight and
no transpose ever exist in memory.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

import mlx.core as mx

from mlx_bricks.backends import resolve_backend
from mlx_bricks.kernels import KernelSpec, launch, register
from mlx_bricks.ops import gemm, gemm_cuda
from mlx_bricks.ops._checks import check_array, check_float_dtype, check_k, check_same_dtype
from mlx_bricks.ops._variants import kernel_variants

register(KernelSpec(
    name="rms_norm_qkv",
    body="rms_norm_qkv.metal",
    input_names=("x", "norm_weight", "eps", "wq", "wk", "wv", "bq", "bk", "bv"),
    output_names=("q", "k", "v"),
    headers=("gemm.h",),
    # x is read through x_strides, so views of x are not copied.
    ensure_row_contiguous=False,
    # The twin takes h = mx.fast.rms_norm(x) (see cuda_src/rms_norm_qkv.cu for why) and each
    # weight as a (w, scales, biases) triple, float or MLX affine, each in its own format.
    cuda_body="rms_norm_qkv.cu",
    cuda_headers=("mma.cuh", "gemm.cuh", "wgmma.cuh"),
    cuda_input_names=("h", "wq", "sq", "zq", "wk", "sk", "zk", "wv", "sv", "zv", "bq", "bk",
                      "bv"),
))


def tile_names(backend: str, dtype=None) -> tuple[str, ...]:
    """The names :func:`rms_norm_qkv` accepts as ``tile=`` on ``backend`` for activations of
    ``dtype`` (None: any): the GEMM tiles of the backend (``gemm.tile_names``), the variants
    the tuner times against stock; none on ``reference`` or without a twin.

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    return kernel_variants(backend, "rms_norm_qkv", tuple(gemm.TILES),
                           cuda_names=lambda: gemm.gemm_cuda_tiles(gemm_cuda.TILES, dtype))


def rms_norm_qkv_reference(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *,
                           n_heads, n_kv_heads, head_dim):
    """Reference of :func:`rms_norm_qkv` in MLX ops."""
    B, L, _ = x.shape
    h = mx.fast.rms_norm(x, norm_weight, eps)

    def proj(w, b, n):
        y = h @ w.T
        if b is not None:
            y = y + b
        return y.reshape(B, L, n, head_dim).transpose(0, 2, 1, 3)

    return proj(wq, bq, n_heads), proj(wk, bk, n_kv_heads), proj(wv, bv, n_kv_heads)


def _check_positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq, bk, bv, n_heads, n_kv_heads,
                        head_dim):
    check_array("x", x, ndim=3)
    check_float_dtype("x", x)
    check_array("norm_weight", norm_weight, ndim=1)
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        check_array(name, w, ndim=2)
    for name, b in (("bq", bq), ("bk", bk), ("bv", bv)):
        if b is not None:
            check_array(name, b, ndim=1)
    check_same_dtype("x", x, norm_weight=norm_weight, wq=wq, wk=wk, wv=wv, bq=bq, bk=bk, bv=bv)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps must be a float, got {type(eps).__name__}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    _check_positive_int("n_heads", n_heads)
    _check_positive_int("n_kv_heads", n_kv_heads)
    _check_positive_int("head_dim", head_dim)
    K = check_k(x)
    if tuple(norm_weight.shape) != (K,):
        raise ValueError(f"norm_weight must have shape ({K},), got {tuple(norm_weight.shape)}")
    for name, w, heads, b_name, b in (("wq", wq, n_heads, "bq", bq),
                                      ("wk", wk, n_kv_heads, "bk", bk),
                                      ("wv", wv, n_kv_heads, "bv", bv)):
        n = heads * head_dim
        if tuple(w.shape) != (n, K):
            raise ValueError(f"{name} must have shape ({n}, {K}) (heads * head_dim, K), "
                             f"got {tuple(w.shape)}")
        if b is not None and tuple(b.shape) != (n,):
            raise ValueError(f"{b_name} must have shape ({n},), got {tuple(b.shape)}")
    if len({bq is None, bk is None, bv is None}) != 1:
        raise ValueError("bq, bk and bv must be given together or not at all")


def plan_rms_norm_qkv(M, n_heads, n_kv_heads, head_dim, K, dtype, *, tile=None):
    """Tile plan of the fused kernel: the GEMM plan of (M, n_heads * head_dim, K) (tile rule of
    :func:`mlx_bricks.ops.gemm.select_tile` on the q projection), with the grid and the
    M/N alignment of the three projections, and the per-row inverse-RMS buffer (BM floats)
    added to the threadgroup memory.

    Returns:
        (plan, grid, align_mn, threadgroup_bytes).

    Raises:
        ValueError: unknown ``tile``.
        RuntimeError: threadgroup memory over ``gemm.THREADGROUP_MEMORY_LIMIT``.
    """
    nq, nkv = n_heads * head_dim, n_kv_heads * head_dim
    plan = gemm.plan_gemm(M, nq, K, dtype, tile=tile)
    t = plan.tile
    tg_bytes = plan.threadgroup_bytes + 4 * t.bm
    if tg_bytes > gemm.THREADGROUP_MEMORY_LIMIT:
        raise RuntimeError(
            f"rms_norm_qkv variant {t.name}_bk{plan.bk} needs {tg_bytes} bytes of threadgroup "
            f"memory, over the {gemm.THREADGROUP_MEMORY_LIMIT}-byte limit"
        )
    tiles_x = math.ceil(nq / t.bn) + 2 * math.ceil(nkv / t.bn)
    grid = (tiles_x * t.threads, math.ceil(M / t.bm), 1)
    align_mn = M % t.bm == 0 and nq % t.bn == 0 and nkv % t.bn == 0
    return plan, grid, align_mn, tg_bytes


def rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *, n_heads,
                 n_kv_heads, head_dim, tile=None, backend=None):
    """``q, k, v = proj(rms_norm(x))`` with each output in head layout (B, H, L, head_dim).

    Algorithm: the GEMM brick (``linear``) with an RMSNorm prologue (per-row inverse RMS in
    float32 before the K loop, as ``mx.fast.rms_norm``: ``w * T(x * rsqrt(mean(x^2) + eps))``)
    applied to the activation tile as it is loaded; the weight is selected per column tile and
    the epilogue writes the head layout directly.

    Args:
        x: (B, L, K) float16, bfloat16 or float32; read through its strides (views not copied).
        norm_weight: (K,), x's dtype.
        eps: RMSNorm epsilon (a Python number, >= 0).
        wq: (n_heads * head_dim, K); wk, wv: (n_kv_heads * head_dim, K); x's dtype.
        bq, bk, bv: optional biases of shapes (n_heads * head_dim,), (n_kv_heads * head_dim,)
            twice (qwen2); all three or none.
        n_heads, n_kv_heads, head_dim: positive ints (GQA: n_kv_heads may differ from n_heads).
        tile: ``None`` (rule of :func:`mlx_bricks.ops.gemm.select_tile`), ``"64x64"``, ``"32x32"``.
        backend: ``None`` (auto), ``"metal"``, ``"emulator"``, ``"reference"``.

    Returns:
        (q, k, v): (B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim) twice, x's dtype,
        row-contiguous in that layout. Products are summed in float32, bias added in float32.

    Copies: weights, biases and norm_weight are copied only if not row-contiguous.

    Raises:
        TypeError: non-array arguments, non-float or mixed dtypes, non-int head counts.
        ValueError: shapes that do not match the head counts, a bad eps or tile, biases given
            partially, min(n_heads, n_kv_heads) * head_dim < 8 on a kernel backend (MLX would pass such tiny
            weights in the constant address space, which the kernel does not select between),
            or a bad backend.
    """
    _check_rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq, bk, bv, n_heads, n_kv_heads,
                        head_dim)
    name = gemm_cuda.cuda_or(backend, x.dtype)
    if name != "cuda" and tile is not None and tile not in gemm.TILES:
        raise ValueError(f"tile must be None or one of {sorted(gemm.TILES)}, got {tile!r}")
    if name == "reference":
        return rms_norm_qkv_reference(x, norm_weight, eps, wq, wk, wv, bq, bk, bv,
                                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    if min(n_heads, n_kv_heads) * head_dim < 8:
        raise ValueError(
            f"min(n_heads, n_kv_heads) * head_dim must be >= 8 for the fused kernel, got "
            f"min({n_heads}, {n_kv_heads}) * {head_dim}"
        )
    B, L, K = x.shape
    dtype = x.dtype
    shapes = [(B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim),
              (B, n_kv_heads, L, head_dim)]
    M = B * L
    if M == 0:
        return tuple(mx.zeros(s, dtype=dtype) for s in shapes)
    if name == "cuda":
        return gemm_cuda.rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq, bk, bv,
                                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                      tile=tile)
    plan, grid, align_mn, _ = plan_rms_norm_qkv(M, n_heads, n_kv_heads, head_dim, K, dtype,
                                                tile=tile)
    has_bias = bq is not None
    wq, wk, wv = (mx.contiguous(w) for w in (wq, wk, wv))
    # Without biases the kernel never reads them; wq stands in (same pointer type as the weights).
    bq, bk, bv = (mx.contiguous(b) for b in (bq, bk, bv)) if has_bias else (wq, wq, wq)
    q, k, v = launch(
        "rms_norm_qkv", name,
        inputs=[x, mx.contiguous(norm_weight), mx.array(eps, dtype=mx.float32), wq, wk, wv,
                bq, bk, bv],
        template=dataclasses.replace(plan, align_mn=align_mn).template(
            dtype, HAS_BIAS=has_bias, N_HEADS=n_heads, N_KV_HEADS=n_kv_heads,
            HEAD_DIM=head_dim),
        grid=grid,
        threadgroup=plan.threadgroup,
        output_shapes=shapes,
        output_dtypes=[dtype] * 3,
    )
    return q, k, v
