"""RMSNorm fused with the Q/K/V projections, written straight in head layout.

Two kernels: ``metal_src/rms_norm_inv.metal`` computes each row's inverse RMS once (B * L
floats), then ``metal_src/rms_norm_qkv.metal`` (on the GEMM pipeline of ``metal_src/gemm.h``)
normalises x as each A tile is loaded, multiplies by the one weight (wq, wk or wv) its column
tile belongs to, and writes its output tile in (B, heads, L, head_dim) layout, so no normalised
copy of x, no concatenated weight and no transpose ever exist in memory. Each of wq, wk, wv may
be a float array or MLX affine-quantized, each in its own format (mlx-lm's mixed-bits recipes).
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
from mlx_bricks.ops.quant import check_weight, matmul_t

register(KernelSpec(
    name="rms_norm_inv",
    body="rms_norm_inv.metal",
    input_names=("x", "eps"),
    output_names=("inv_rms",),
    headers=("gemm.h",),
    # x is read through x_strides, so views of x are not copied.
    ensure_row_contiguous=False,
))
register(KernelSpec(
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
    cuda_headers=("mma.cuh", "gemm.cuh", "wgmma.cuh"),
    cuda_input_names=("h", "wq", "sq", "zq", "wk", "sk", "zk", "wv", "sv", "zv", "bq", "bk",
                      "bv"),
))


def tile_names(backend: str, dtype=None, bits: int | None = None) -> tuple[str, ...]:
    """The names :func:`rms_norm_qkv` accepts as ``tile=`` on ``backend`` for activations of
    ``dtype`` (None: any) and the widest weight format ``bits`` (None: float): the GEMM tiles of
    the backend (``gemm.tile_names``), the variants the tuner times against stock; none on
    ``reference`` or without a twin.

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    return kernel_variants(backend, "rms_norm_qkv", gemm.msl_tile_names(gemm.TILES, dtype),
                           cuda_names=lambda: gemm.gemm_cuda_tiles(gemm_cuda.TILES, dtype,
                                                                   bits=bits))


def rms_norm_qkv_reference(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *,
                           n_heads, n_kv_heads, head_dim):
    """Reference of :func:`rms_norm_qkv` in MLX ops (``mx.fast.rms_norm``, then ``h @ w.T``
    or ``mx.quantized_matmul`` per weight)."""
    B, L, _ = x.shape
    h = mx.fast.rms_norm(x, norm_weight, eps)

    def proj(w, b, n):
        y = matmul_t(h, w)
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
    """Validate the arguments; returns (wq, wk, wv) as the kernels take them (``as_weight``)."""
    check_array("x", x, ndim=3)
    check_float_dtype("x", x)
    check_array("norm_weight", norm_weight, ndim=1)
    for name, b in (("bq", bq), ("bk", bk), ("bv", bv)):
        if b is not None:
            check_array(name, b, ndim=1)
    check_same_dtype("x", x, norm_weight=norm_weight, bq=bq, bk=bk, bv=bv)
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
    weights = []
    for name, w, heads, b_name, b in (("wq", wq, n_heads, "bq", bq),
                                      ("wk", wk, n_kv_heads, "bk", bk),
                                      ("wv", wv, n_kv_heads, "bv", bv)):
        n = heads * head_dim
        w = check_weight(name, w, x, None)
        if tuple(w.shape) != (n, K):
            raise ValueError(f"{name} must have shape ({n}, {K}) (heads * head_dim, K), "
                             f"got {tuple(w.shape)}")
        if b is not None and tuple(b.shape) != (n,):
            raise ValueError(f"{b_name} must have shape ({n},), got {tuple(b.shape)}")
        weights.append(w)
    if len({bq is None, bk is None, bv is None}) != 1:
        raise ValueError("bq, bk and bv must be given together or not at all")
    return tuple(weights)


def plan_rms_norm_qkv(M, n_heads, n_kv_heads, head_dim, K, dtype, *, tile=None,
                      group_sizes=()):
    """Tile plan of the fused kernel: the GEMM plan of (M, n_heads * head_dim, K) (tile rule of
    :func:`mlx_bricks.ops.gemm.select_tile` on the q projection), with the grid and the M/N
    alignment of the three projections. Threadgroup memory is the GEMM's (the inverse RMS is
    read from device memory, computed once per row by ``rms_norm_inv``).

    Args:
        group_sizes: the affine group sizes of the quantized weights among wq, wk, wv (BK
            must divide each; see :func:`mlx_bricks.ops.gemm.plan_gemm`).

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


def rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *, n_heads,
                 n_kv_heads, head_dim, tile=None, backend=None):
    """``q, k, v = proj(rms_norm(x))`` with each output in head layout (B, H, L, head_dim).

    Algorithm: the GEMM brick (``linear``) with an RMSNorm prologue applied to the activation
    tile as it is loaded (``w * T(x * inv_rms)``, the rounding of ``mx.fast.rms_norm``), where
    ``inv_rms = rsqrt(mean(x^2) + eps)`` is computed in float32 once per row by a small kernel
    before the GEMM; the weight is selected per column tile and the epilogue writes the head
    layout directly.

    Args:
        x: (B, L, K) float16, bfloat16 or float32; read through its strides (views not copied).
        norm_weight: (K,), x's dtype.
        eps: RMSNorm epsilon (a Python number, >= 0).
        wq: (n_heads * head_dim, K); wk, wv: (n_kv_heads * head_dim, K) (nn.Linear layout); each
            an ``mx.array`` of x's dtype or MLX affine-quantized (``QuantizedWeight`` or
            ``nn.QuantizedLinear``, scales of x's dtype), each in its own format (bits and
            group_size may differ between q, k and v, as mlx-lm's mixed recipes make them).
        bq, bk, bv: optional biases of shapes (n_heads * head_dim,), (n_kv_heads * head_dim,)
            twice (qwen2); all three or none.
        n_heads, n_kv_heads, head_dim: positive ints (GQA: n_kv_heads may differ from n_heads).
        tile: ``None`` (rule of :func:`mlx_bricks.ops.gemm.select_tile`) or a key of
            ``mlx_bricks.ops.gemm.TILES`` (``"64x64"``, ``"32x32"`` and their pipeline
            variants ``"_bk16"``, ``"_sb"``, ``"_sh"``).
        backend: ``None`` (auto), ``"metal"``, ``"emulator"``, ``"reference"``.

    Returns:
        (q, k, v): (B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim) twice, x's dtype,
        row-contiguous in that layout. Products are summed in float32, bias added in float32.

    Copies: weights, biases and norm_weight are copied only if not row-contiguous.

    Raises:
        TypeError: non-array arguments, non-float or mixed dtypes (quantized weights' scales
            included), non-int head counts.
        ValueError: shapes that do not match the head counts, a quantized weight MLX's affine
            format does not describe, a bad eps or tile, biases given partially,
            min(n_heads, n_kv_heads) * head_dim < 8 on a kernel backend (MLX would pass such
            tiny weights in the constant address space, which the kernel does not select
            between), or a bad backend.
    """
    wq, wk, wv = _check_rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq, bk, bv, n_heads,
                                     n_kv_heads, head_dim)
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
    shapes = [(B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim),
              (B, n_kv_heads, L, head_dim)]
    if B * L == 0:
        return tuple(mx.zeros(s, dtype=x.dtype) for s in shapes)
    if name == "cuda":
        return gemm_cuda.rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq, bk, bv,
                                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                      tile=tile)
    return launch_rms_norm_qkv(x, norm_weight, eps, (wq, wk, wv), (bq, bk, bv), shapes,
                               tile=tile, backend=name)


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
        arrays, w_flags = gemm.weight_inputs(w)
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
        "rms_norm_qkv", backend,
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
