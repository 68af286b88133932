"""The RMSNorm + QKV brick's public op: RMSNorm fused with the Q/K/V projections, written
straight in head layout (checks, MLX reference, listing of variants).

Two kernels: ``metal_src/rms_norm_inv.metal`` computes each row's inverse RMS once (B * L
floats), then ``metal_src/rms_norm_qkv.metal`` (on the GEMM pipeline of ``metal_src/gemm.h``)
normalises x as each A tile is loaded, multiplies by the one weight (wq, wk or wv) its column
tile belongs to, and writes its output tile in (B, heads, L, head_dim) layout, so no normalised
copy of x, no concatenated weight and no transpose ever exist in memory. Each of wq, wk, wv may
be a float array or MLX affine-quantized, each in its own format (mlx-lm's mixed-bits recipes).
"""
from __future__ import annotations

import math
import numbers

import mlx.core as mx

from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.gemm import msl as gemm_msl
from mlx_bricks.bricks.gemm.op import gemm_backend
from mlx_bricks.bricks.norm_qkv import cuda, msl
from mlx_bricks.checks import check_array, check_float_dtype, check_k, check_same_dtype
from mlx_bricks.formats import check_weight, format_of
from mlx_bricks.runtime.variants import kernel_variants


def tile_names(backend: str, dtype=None, bits: int | None = None) -> tuple[str, ...]:
    """The names :func:`rms_norm_qkv` accepts as ``tile=`` on ``backend`` for activations of
    ``dtype`` (None: any) and the widest weight format ``bits`` (None: float): the GEMM tiles of
    the backend (``gemm.tile_names``), the variants the tuner times against stock; none on
    ``reference`` or without a twin.

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    return kernel_variants(backend, msl.QKV_SPEC.name, gemm_msl.msl_tile_names(gemm_msl.TILES, dtype),
                           cuda_names=lambda: gemm_cuda.dtype_tile_names(gemm_cuda.TILES, dtype,
                                                                        bits=bits))


def rms_norm_qkv_reference(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *,
                           n_heads, n_kv_heads, head_dim):
    """Reference of :func:`rms_norm_qkv` in MLX ops (``mx.fast.rms_norm``, then ``h @ w.T``
    or ``mx.quantized_matmul`` per weight)."""
    B, L, _ = x.shape
    h = mx.fast.rms_norm(x, norm_weight, eps)

    def proj(w, b, n):
        y = format_of(w).matmul_t(h, w)
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
        tile: ``None`` (rule of :func:`mlx_bricks.bricks.gemm.msl.select_tile`) or a key of
            ``mlx_bricks.bricks.gemm.msl.TILES`` (``"64x64"``, ``"32x32"`` and their pipeline
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
    return run_rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq, bk, bv, n_heads=n_heads,
                            n_kv_heads=n_kv_heads, head_dim=head_dim, tile=tile,
                            backend=gemm_backend(backend, x.dtype))


def run_rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *, n_heads,
                     n_kv_heads, head_dim, tile=None, backend: str):
    """:func:`rms_norm_qkv` after its checks, on the resolved ``backend`` (what the tuner
    calls)."""
    name = backend
    if name != "cuda" and tile is not None and tile not in gemm_msl.TILES:
        raise ValueError(f"tile must be None or one of {sorted(gemm_msl.TILES)}, got {tile!r}")
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
        return cuda.rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq, bk, bv,
                                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                                      tile=tile)
    return msl.launch_rms_norm_qkv(x, norm_weight, eps, (wq, wk, wv), (bq, bk, bv), shapes,
                                   tile=tile, backend=name)
