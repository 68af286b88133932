"""The SwiGLU brick's public ops (brick 3): ``swiglu`` and the whole MLP ``swiglu_mlp``,
``down(act(gate(x)) * up(x))`` as in llama-family models (act = SiLU) and gemma (act = GELU,
tanh approximation: GeGLU), with their checks, MLX references and the listing of variants.

Two variants compute ``act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)`` (MSL kernels in
``msl.py``, the CUDA twins on the GEMM pipeline in ``mlx_bricks.bricks.gemm.cuda``):

* ``fused``: one kernel. Per K step the x tile is loaded into threadgroup memory once, beside
  BN rows of w_gate and BN rows of w_up; every simdgroup multiplies its x fragments by both, so
  gate and up of one element live in the same lane and ``act(gate) * up`` is formed in float
  registers and written once. The two (M, N_mlp) intermediates never touch memory.
* ``split``: ``up`` through the GEMM brick, then the gate GEMM (same tiling) whose epilogue
  reads ``up`` and writes ``act(gate) * up``.

The down projection (with the residual in its epilogue) is the GEMM brick's ``linear``. Every
weight may be float or MLX affine-quantized (``mlx_bricks.formats``). The variant rule, the
tiles and their threadgroup memory are in ``docs/bricks.md`` (Brick 3). SwiGLU and GeGLU:
Shazeer, "GLU Variants Improve Transformer" (2020); the llama MLP as in
``mlx_lm.models.llama.MLP``, the gemma MLP as in ``mlx_lm.models.gemma3_text.MLP``.
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.gemm import msl as gemm_msl
from mlx_bricks.bricks.gemm.op import gemm_backend, linear_reference, run_linear
from mlx_bricks.bricks.swiglu import cuda, msl
from mlx_bricks.bricks.swiglu.variants import (  # noqa: F401  (re-exported)
    ACTIVATIONS,
    DEFAULT_VARIANT,
    VARIANT_ENV_VAR,
    VARIANTS,
    activation_code,
    resolve_variant,
)
from mlx_bricks.checks import check_array, check_float_dtype, check_k, check_same_dtype
from mlx_bricks.formats import check_weight, format_of, same_format
from mlx_bricks.runtime.variants import kernel_variants

#: The kernels each SwiGLU variant launches (the down projection is the GEMM brick); on cuda the
#: split variant is the GEMM twin with a SwiGLU epilogue.
_VARIANT_KERNELS = {"fused": ("swiglu_fused", "gemm"), "split": ("swiglu_split", "gemm")}
_CUDA_VARIANT_KERNELS = {"fused": ("swiglu_fused", "gemm"), "split": ("gemm",)}


def _kernels(backend: str, variant: str) -> tuple[str, ...]:
    return (_CUDA_VARIANT_KERNELS if backend == "cuda" else _VARIANT_KERNELS)[variant]


def variant_names(backend: str, dtype=None) -> tuple[str, ...]:
    """The names :func:`swiglu` / :func:`swiglu_mlp` accept as ``variant=`` on ``backend`` for
    activations of ``dtype`` (None: any): the variants the tuner times against stock; none on
    ``reference`` (MLX ops) nor where a variant's kernels have no twin (``cuda``, float32 on
    ``cuda``).

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    return tuple(v for v in VARIANTS if tile_names(backend, v, dtype))


def tile_names(backend: str, variant: str, dtype=None) -> tuple[str, ...]:
    """The names :func:`swiglu` accepts as ``tile=`` for ``variant`` on ``backend``: MSL
    ``msl.FUSED_TILES`` for ``fused``, the GEMM tiles for ``split``; on ``cuda`` the twins'
    tiles this GPU runs (``cuda.SWIGLU_TILES`` / ``gemm.cuda.TILES``); ``()`` where the variant does
    not run (see :func:`variant_names`).

    Raises:
        ValueError: an unknown ``variant``.
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}, "
                         f"got {variant!r}")
    if variant == "fused":  # gate and up: two weight tiles per stage
        names = msl.FUSED_TILES
        on_cuda = lambda: gemm_cuda.dtype_tile_names(cuda.SWIGLU_TILES, dtype, 2)  # noqa: E731
    else:
        names = gemm_msl.TILES
        on_cuda = lambda: gemm_cuda.dtype_tile_names(gemm_cuda.TILES, dtype)  # noqa: E731
    return kernel_variants(backend, _kernels(backend, variant),
                           gemm_msl.msl_tile_names(names, dtype), cuda_names=on_cuda)


# ---------------------------------------------------------------------------------------------
# References (MLX ops)
# ---------------------------------------------------------------------------------------------


def silu_reference(g):
    """SiLU in float32: ``g * sigmoid(g)`` (sigmoid is stable for any magnitude)."""
    g32 = g.astype(mx.float32)
    return g32 * mx.sigmoid(g32)


def gelu_tanh_reference(g):
    """GELU's tanh approximation in float32, ``mlx.nn.gelu_approx``:
    ``0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))``."""
    import mlx.nn as nn

    return nn.gelu_approx(g.astype(mx.float32))


#: activation name -> its MLX-ops reference (float32 in, float32 out).
_ACTIVATION_REFERENCES = {"silu": silu_reference, "gelu_tanh": gelu_tanh_reference}


def swiglu_reference(x, w_gate, w_up, b_gate=None, b_up=None, activation="silu"):
    """Reference of :func:`swiglu` in MLX ops:
    ``act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)`` (``mx.quantized_matmul`` for a
    quantized weight, through :func:`~mlx_bricks.bricks.gemm.op.linear_reference`).

    Raises:
        TypeError, ValueError: an unknown ``activation`` (see :data:`ACTIVATIONS`).
    """
    act = _ACTIVATION_REFERENCES[_check_activation(activation)]
    gate = linear_reference(x, w_gate, b_gate)
    up = linear_reference(x, w_up, b_up)
    return (act(gate) * up.astype(mx.float32)).astype(x.dtype)


def swiglu_mlp_reference(x, w_gate, w_up, w_down, residual=None, b_gate=None, b_up=None,
                         b_down=None, activation="silu"):
    """Reference of :func:`swiglu_mlp` in MLX ops."""
    act = swiglu_reference(x, w_gate, w_up, b_gate, b_up, activation)
    return linear_reference(act, w_down, b_down, residual)


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------


def _check_activation(activation) -> str:
    activation_code(activation)  # raises TypeError / ValueError naming the argument
    return activation


def _check_vector(name: str, value, length: int, what: str) -> None:
    if value is None:
        return
    check_array(name, value)
    if tuple(value.shape) != (length,):
        raise ValueError(f"{name} must have shape ({what}={length},), got {tuple(value.shape)}")


def _check_swiglu(x, w_gate, w_up, b_gate, b_up):
    """Validate the gate/up operands; returns (w_gate, w_up, N_mlp, K), the weights as the
    kernels take them (``as_weight``)."""
    check_array("x", x, min_ndim=1)
    check_float_dtype("x", x)
    K = check_k(x)
    w_gate = check_weight("w_gate", w_gate, x, K, rows="N_mlp")
    w_up = check_weight("w_up", w_up, x, K, rows="N_mlp")
    check_same_dtype("x", x, b_gate=b_gate, b_up=b_up)
    if tuple(w_up.shape) != tuple(w_gate.shape):
        raise ValueError(
            f"w_up must have the shape of w_gate {tuple(w_gate.shape)}, got {tuple(w_up.shape)}"
        )
    N = w_gate.shape[0]
    _check_vector("b_gate", b_gate, N, "N_mlp")
    _check_vector("b_up", b_up, N, "N_mlp")
    return w_gate, w_up, N, K


def _check_tile(variant: str, tile) -> None:
    valid = msl.FUSED_TILES if variant == "fused" else gemm_msl.TILES
    if tile is not None and tile not in valid:
        raise ValueError(
            f"tile must be None or, for variant {variant!r}, one of {sorted(valid)}, got {tile!r}"
        )


def variant_for(variant, w_gate, w_up) -> str:
    """The variant that runs: :func:`resolve_variant`, except that gate and up of different
    formats (``same_format``) run ``split`` unless ``fused`` is asked for by argument (then
    ValueError): the fused kernel stages both weights with one loader."""
    if same_format(w_gate, w_up):
        return resolve_variant(variant)
    if variant is None:
        return "split"
    variant = resolve_variant(variant)
    if variant == "fused":
        raise ValueError(
            f"variant 'fused' needs w_gate and w_up in one format, got "
            f"{format_of(w_gate)} and {format_of(w_up)}; use variant='split' or None"
        )
    return variant


def swiglu(x, w_gate, w_up, *, b_gate=None, b_up=None, activation="silu", variant=None,
           tile=None, backend=None):
    """``act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)`` on the SwiGLU brick, act SiLU
    (SwiGLU) or GELU's tanh approximation (GeGLU, gemma).

    Algorithm: SwiGLU (Shazeer 2020) on the GEMM brick's tiling (8x8 ``simdgroup_matrix`` with
    float accumulators, 128-bit loads into ping-pong threadgroup buffers). ``fused``: one
    kernel, gate and up accumulated side by side from one x tile, ``SiLU(gate) * up`` in float
    registers, one write. ``split``: ``up`` by the GEMM brick, then the gate GEMM with an
    epilogue that reads ``up``. SiLU is ``g / (1 + exp(-g))`` in float32, computed from
    ``exp(-|g|)`` so no intermediate overflows (finite for any finite gate); GELU-tanh is
    ``0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))`` in float32 (``nn.gelu_approx``), the
    tanh argument clamped to [-10, 10] (where tanh is 1 in float32) so it stays finite too.

    Args:
        x: (..., K) float16, bfloat16 or float32, K >= 1; M is the product of the leading dims
            (M = 0 or N_mlp = 0 give an empty result without a launch). Read through its
            strides: views are not copied.
        w_gate, w_up: the (N_mlp, K) weights (nn.Linear layout): ``mx.array`` of x's dtype,
            or MLX affine-quantized (``QuantizedWeight`` or ``nn.QuantizedLinear``, scales of
            x's dtype; see :func:`~mlx_bricks.bricks.gemm.op.linear`). ``fused`` needs both in one
            format (both float, or the same bits and group_size).
        b_gate, b_up: optional (N_mlp,) biases, x's dtype (``mlp_bias`` models).
        activation: the gate's activation, ``"silu"`` (default) or ``"gelu_tanh"``
            (:data:`ACTIVATIONS`): the kernels' ``ACT`` template parameter.
        variant: ``None`` (``MLX_BRICKS_SWIGLU_VARIANT`` if set, else :data:`DEFAULT_VARIANT`;
            ``split`` when w_gate and w_up differ in format; the rule is in docs/bricks.md),
            ``"fused"`` or ``"split"``.
        tile: ``None`` (the variant's tile rule) or, for ``fused``, a key of
            ``msl.FUSED_TILES``; for ``split``, a GEMM tile (``mlx_bricks.bricks.gemm.msl.TILES``).
        backend: ``None`` (auto), ``"metal"``, ``"emulator"``, ``"reference"``
            (see ``mlx_bricks.backends``); ``variant`` and ``tile`` do not apply to
            ``reference`` (``mx.quantized_matmul`` for quantized weights).

    Returns:
        (..., N_mlp) of x's dtype: gate and up summed in float32 (biases added in float32),
        SiLU and product in float32, one rounding (``split`` rounds ``up`` to x's dtype first,
        as the stock MLP does).

    Raises:
        TypeError: non-array arguments, non-float dtypes, or mixed dtypes (quantized weights'
            scales included), a non-str ``activation``.
        ValueError: shapes that do not match, a quantized weight MLX's affine format does not
            describe, ``variant="fused"`` with gate and up in different formats, an unknown
            ``activation``, ``variant`` or ``tile``, a bad backend.
        NotImplementedError: backend ``cuda`` with float32 activations (no CUDA twin).
    """
    w_gate, w_up, N, K = _check_swiglu(x, w_gate, w_up, b_gate, b_up)
    _check_activation(activation)
    variant = variant_for(variant, w_gate, w_up)
    return run_swiglu(x, w_gate, w_up, b_gate, b_up, activation=activation, variant=variant,
                      tile=tile, backend=gemm_backend(backend, x.dtype))


def run_swiglu(x, w_gate, w_up, b_gate=None, b_up=None, *, activation="silu", variant: str,
               tile=None, backend: str):
    """:func:`swiglu` after its checks, with the resolved ``variant`` and ``backend`` (what
    :func:`run_swiglu_mlp` and the tuner call)."""
    if backend != "cuda":
        _check_tile(variant, tile)
    if backend == "reference":
        return swiglu_reference(x, w_gate, w_up, b_gate, b_up, activation)
    N, K = w_gate.shape
    out_shape = (*x.shape[:-1], N)
    M = math.prod(x.shape[:-1])
    if M == 0 or N == 0:
        return mx.zeros(out_shape, dtype=x.dtype)
    act = activation_code(activation)
    if backend == "cuda":
        return cuda.swiglu(x, w_gate, w_up, b_gate, b_up, variant=variant,
                           tile=tile, act=act).reshape(out_shape)
    if variant == "fused":
        y = msl.launch_fused(x, w_gate, w_up, b_gate, b_up, M, N, K, tile, backend, act)
    else:
        up = run_linear(x, w_up, b_up, tile=tile, backend=backend).reshape(M, N)
        y = msl.launch_split(x, w_gate, up, b_gate, M, N, K, tile, backend, act)
    return y.reshape(out_shape)


def swiglu_mlp(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None,
               activation="silu", variant=None, backend=None):
    """The llama MLP ``down(SiLU(gate(x)) * up(x)) (+ residual)`` on the bricks (gemma's
    ``down(gelu_approx(gate(x)) * up(x))`` with ``activation="gelu_tanh"``).

    ``act`` by :func:`swiglu`, then ``act @ w_down.T + b_down + residual`` by the GEMM brick's
    :func:`~mlx_bricks.bricks.gemm.op.linear` (bias and residual added in its epilogue). Same
    computation as ``mlx_lm.models.llama.MLP`` (plus the residual add of the block), or with
    ``activation="gelu_tanh"`` as ``mlx_lm.models.gemma3_text.MLP``.

    Args:
        x: (..., K) float16, bfloat16 or float32 (K = hidden size).
        w_gate, w_up: (N_mlp, K); w_down: (K, N_mlp) (nn.Linear layout); each an
            ``mx.array`` of x's dtype or MLX affine-quantized (``QuantizedWeight`` or
            ``nn.QuantizedLinear``, scales of x's dtype), independently of the others.
        residual: optional (..., K), x's dtype, added to the output.
        b_gate, b_up: optional (N_mlp,); b_down: optional (K,).
        activation, variant, backend: as in :func:`swiglu`.

    Returns:
        (..., K) of x's dtype.

    Raises:
        TypeError: non-array arguments, non-float dtypes, or mixed dtypes; a non-str
            ``activation``.
        ValueError: shapes that do not match, a quantized weight MLX's affine format does not
            describe, an unknown ``activation`` or ``variant``, a bad backend.
        NotImplementedError: backend ``cuda`` with float32 activations (no CUDA twin).
    """
    w_gate, w_up, N, K = _check_swiglu(x, w_gate, w_up, b_gate, b_up)
    _check_activation(activation)
    w_down = check_weight("w_down", w_down, x, None)
    check_same_dtype("x", x, b_down=b_down, residual=residual)
    if tuple(w_down.shape) != (K, N):
        raise ValueError(
            f"w_down must have shape (K={K}, N_mlp={N}) as nn.Linear stores it, "
            f"got {tuple(w_down.shape)}"
        )
    _check_vector("b_down", b_down, K, "K")
    if residual is not None:
        check_array("residual", residual)
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(
                f"residual must have the output shape {tuple(x.shape)}, "
                f"got {tuple(residual.shape)}"
            )
    variant = variant_for(variant, w_gate, w_up)
    return run_swiglu_mlp(x, w_gate, w_up, w_down, residual, b_gate, b_up, b_down,
                          activation=activation, variant=variant,
                          backend=gemm_backend(backend, x.dtype))


def run_swiglu_mlp(x, w_gate, w_up, w_down, residual=None, b_gate=None, b_up=None, b_down=None,
                   *, activation="silu", variant: str, backend: str):
    """:func:`swiglu_mlp` after its checks, with the resolved ``variant`` and ``backend``."""
    act = run_swiglu(x, w_gate, w_up, b_gate, b_up, activation=activation, variant=variant,
                     backend=backend)
    return run_linear(act, w_down, b_down, residual, backend=backend)
