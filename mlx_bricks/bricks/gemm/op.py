"""The GEMM brick's public op: ``linear``, ``y = x @ weight.T (+ bias) (+ residual)``, with its
checks, its MLX reference and the listing of its variants.

The MSL kernel (tiles, plan, launch) is ``msl.py``, the CUDA twin ``cuda.py``; the weight is
read through its format (``mlx_bricks.formats``): float or MLX affine.
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.gemm import cuda, msl
from mlx_bricks.checks import check_array, check_float_dtype, check_k, check_same_dtype
from mlx_bricks.formats import check_weight, format_of
from mlx_bricks.runtime.variants import kernel_variants


def tile_names(backend: str, dtype=None, bits: int | None = None) -> tuple[str, ...]:
    """The names :func:`linear` accepts as ``tile=`` on ``backend`` for activations of
    ``dtype`` (None: any) and weights of ``bits`` (None: float): the variants the tuner
    (``mlx_bricks.tune``) times against stock. MSL backends: ``msl.TILES``; ``cuda``: the
    twin's tiles this GPU can run for that format (``cuda.tile_names``), none for a dtype
    without a twin (float32); ``reference``: none (it runs MLX ops).

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    return kernel_variants(backend, "gemm", msl.msl_tile_names(msl.TILES, dtype),
                           cuda_names=lambda: cuda.dtype_tile_names(cuda.LINEAR_TILES, dtype,
                                                                   bits=bits))


def linear_reference(x, weight, bias=None, residual=None):
    """Reference of :func:`linear` in MLX ops (what the ``reference`` backend runs): ``x @
    weight.T``, or ``mx.quantized_matmul`` for a ``QuantizedWeight`` (what
    ``nn.QuantizedLinear`` runs), then ``+ bias + residual``."""
    y = format_of(weight).matmul_t(x, weight)
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    return y


def check_linear(x, weight, bias, residual):
    """Validate :func:`linear`'s arguments; returns the weight as the kernels take it
    (``formats.as_weight``). Errors as :func:`linear` documents them."""
    check_array("x", x, min_ndim=1)
    check_float_dtype("x", x)
    K = check_k(x)
    weight = check_weight("weight", weight, x, K)
    check_same_dtype("x", x, bias=bias, residual=residual)
    N = weight.shape[0]
    if bias is not None:
        check_array("bias", bias)
        if tuple(bias.shape) != (N,):
            raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if residual is not None:
        check_array("residual", residual)
        out_shape = (*x.shape[:-1], N)
        if tuple(residual.shape) != out_shape:
            raise ValueError(
                f"residual must have the output shape {out_shape}, got {tuple(residual.shape)}"
            )
    return weight


def gemm_backend(backend, dtype) -> str:
    """The backend a GEMM-family op runs on for activations of ``dtype``
    (``backends.op_backend``: float32 has no CUDA twin)."""
    return op_backend("gemm", backend, cuda_unsupported=cuda.unsupported_reason(dtype))


def linear(x, weight, bias=None, residual=None, *, tile=None, backend=None):
    """``y = x @ weight.T (+ bias) (+ residual)`` on the GEMM brick.

    Algorithm: tiled GEMM on 8x8 ``simdgroup_matrix`` fragments with float accumulators, 128-bit
    global loads into ping-pong threadgroup buffers, bias and residual added in the epilogue
    (the structure of MLX's steel GEMM; see ``docs/bricks.md``). A quantized weight is
    dequantized once per staged tile into threadgroup memory (as MLX's ``qmm`` does), so the
    MMA and the epilogue are the float GEMM's. The CUDA twin runs the same computation on
    tensor cores (``mma.sync`` / ``wgmma``).

    Args:
        x: (..., K) float16, bfloat16 or float32, K >= 1; M is the product of the leading dims
            (M = 0 or N = 0 give an empty result without a launch). Read through its strides:
            views (slices, transposes, broadcasts) are not copied.
        weight: the (N, K) weight as ``nn.Linear`` stores it, either an ``mx.array`` of x's
            dtype, or MLX affine-quantized: a :class:`~mlx_bricks.formats.affine.QuantizedWeight`
            ``(w, scales, biases, group_size, bits)`` (``w`` uint32 (N, K * bits / 32),
            ``scales``/``biases`` (N, K / group_size) of x's dtype; bits 2, 3, 4, 5, 6, 8,
            group_size 32, 64, 128) or an ``nn.QuantizedLinear`` (its weight is taken, not its
            bias).
        bias: optional (N,), x's dtype.
        residual: optional (..., N) (the output shape), x's dtype; added in the epilogue.
        tile: ``None`` (the tile rule: ``msl.select_tile``, ``cuda.select_tile``) or one of
            :func:`tile_names` for the backend (MSL: ``"64x64"``, ``"32x32"`` and their pipeline
            variants: ``"_bk16"`` BK = 16, ``"_sb"`` single-buffered, ``"_sh"`` scheduling hints,
            e.g. ``"64x64_bk16_sb"``).
        backend: ``None`` (auto), ``"metal"``, ``"cuda"``, ``"emulator"``, ``"reference"``
            (see ``mlx_bricks.backends``); ``reference`` runs :func:`linear_reference`
            (``mx.quantized_matmul`` for a quantized weight).

    Returns:
        (..., N) array of x's dtype; products summed in float32, bias and residual added in
        float32, one rounding to the output dtype. A quantized weight's values are
        ``T(scale * q + bias)`` (one rounding to x's dtype) before the products.

    Copies: weight (or the quantized triple), bias and residual are copied only when they are
    not row-contiguous (``mx.contiguous``); nn.Linear weights never are.

    Raises:
        TypeError: non-array arguments, non-float dtypes, mixed dtypes (a quantized weight's
            scales must have x's dtype), or a weight that is neither an array nor quantized.
        ValueError: shapes that do not match, a quantized weight MLX's affine format does not
            describe (mode, bits, group_size, packed width vs K, scales/biases shapes), an
            unknown ``tile``, or a bad backend.
        NotImplementedError: backend ``cuda`` with float32 activations (no CUDA twin).
    """
    weight = check_linear(x, weight, bias, residual)
    return run_linear(x, weight, bias, residual, tile=tile,
                      backend=gemm_backend(backend, x.dtype))


def run_linear(x, weight, bias=None, residual=None, *, tile=None, backend: str):
    """:func:`linear` after its checks, on the resolved ``backend`` (what the other bricks and
    the tuner call: arguments are valid, the backend is resolved once per call)."""
    if backend != "cuda" and tile is not None and tile not in msl.TILES:
        raise ValueError(f"tile must be None or one of {sorted(msl.TILES)}, got {tile!r}")
    if backend == "reference":
        return linear_reference(x, weight, bias, residual)
    N, K = weight.shape
    out_shape = (*x.shape[:-1], N)
    M = math.prod(x.shape[:-1])
    if M == 0 or N == 0:
        return mx.zeros(out_shape, dtype=x.dtype)
    if backend == "cuda":
        return cuda.linear(x, weight, bias, residual, tile=tile)
    plan = msl.plan_gemm(M, N, K, x.dtype, tile=tile,
                         group_size=format_of(weight).group_size or None)
    return msl.launch_gemm(x, weight, bias, residual, plan, backend)
