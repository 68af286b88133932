"""Brick 3: SwiGLU MLP, ``down(act(gate(x)) * up(x))`` as in llama-family models (act = SiLU)
and gemma (act = GELU, tanh approximation: GeGLU).

Two MSL variants compute ``act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)``; the down
projection (with the residual in its epilogue) is the GEMM brick's :func:`linear`. The gate's
activation (``activation="silu"`` or ``"gelu_tanh"``, :data:`ACTIVATIONS`) is the kernels'
``ACT`` template parameter: one kernel per variant, not a copy per activation.

* ``fused`` (``metal_src/swiglu_fused.metal``): one kernel. Per K step the x tile is loaded into
  threadgroup memory once, beside BN rows of w_gate and BN rows of w_up; every simdgroup
  multiplies its x fragments by both, so gate and up of one element live in the same lane and
  ``SiLU(gate) * up`` is formed in float registers and written once. The two (M, N_mlp)
  intermediates never touch memory.
* ``split`` (``metal_src/swiglu_split.metal``): ``up`` through the GEMM brick, then the gate GEMM
  (same tiling) whose epilogue reads ``up`` and writes ``SiLU(gate) * up``.

Every weight may be a float array or MLX affine-quantized (``QuantizedWeight``,
``nn.QuantizedLinear``): the weight loader of the shared pipeline dequantizes each staged tile.

The variant rule, the tiles and their threadgroup memory are in ``docs/bricks.md`` (Brick 3).
SwiGLU and GeGLU: Shazeer, "GLU Variants Improve Transformer" (2020); the llama MLP as in
``mlx_lm.models.llama.MLP``, the gemma MLP as in ``mlx_lm.models.gemma3_text.MLP``
(``nn.gelu_approx``).
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.backends import resolve_backend
from mlx_bricks.kernels import KernelSpec, launch, register
from mlx_bricks.ops import gemm_cuda
from mlx_bricks.ops.gemm_cuda import cuda_or
from mlx_bricks.ops._checks import check_array, check_float_dtype, check_k, check_same_dtype
from mlx_bricks.ops._variants import kernel_variants
from mlx_bricks.ops.gemm import (
    MIN_THREADGROUPS_64,
    TILES as GEMM_TILES,
    GemmPlan,
    GemmTile,
    linear,
    linear_reference,
    msl_tile_names,
    plan_gemm,
    weight_inputs,
    with_variants,
)
from mlx_bricks.ops.quant import check_weight, is_quantized
from mlx_bricks.ops.swiglu_variants import (  # noqa: F401  (re-exported)
    ACTIVATIONS,
    DEFAULT_VARIANT,
    VARIANT_ENV_VAR,
    VARIANTS,
    activation_code,
    resolve_variant,
)

register(KernelSpec(
    name="swiglu_fused",
    body="swiglu_fused.metal",
    # gate_/up_ scales and biases: the affine weights' (placeholders for float weights).
    input_names=("x", "w_gate", "gate_scales", "gate_biases", "w_up", "up_scales", "up_biases",
                 "b_gate", "b_up"),
    output_names=("act",),
    headers=("gemm.h", "swiglu.h"),
    # x is read through x_strides, so views of x are not copied.
    ensure_row_contiguous=False,
    cuda_body="swiglu.cu",
    cuda_headers=("mma.cuh", "gemm.cuh", "wgmma.cuh"),
    cuda_input_names=("x", "w_gate", "scales_gate", "biases_gate", "w_up", "scales_up",
                      "biases_up", "b_gate", "b_up"),
))
register(KernelSpec(
    name="swiglu_split",
    body="swiglu_split.metal",
    input_names=("x", "w_gate", "gate_scales", "gate_biases", "b_gate", "up"),
    output_names=("act",),
    headers=("gemm.h", "swiglu.h"),
    ensure_row_contiguous=False,
))

#: Fused tiles, named by the act tile (BM x BN); each threadgroup also loads 2 * BN weight rows.
#: "64x32" and "32x16" give every simdgroup as many accumulators as the GEMM brick's 64x64 and
#: 32x32 tiles (32x16 gate + 32x16 up, 16x8 + 16x8); "64x64" doubles them (opt-in only). Each
#: also in the GEMM brick's pipeline variants (``"_bk16"``, ``"_sb"``, ``"_sh"``: for the
#: tuner to measure; never chosen by the rule).
FUSED_TILES = with_variants(
    {"64x32": GemmTile(64, 32), "32x16": GemmTile(32, 16), "64x64": GemmTile(64, 64)})


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
    :data:`FUSED_TILES` for ``fused``, the GEMM tiles for ``split``; on ``cuda`` the twins'
    tiles this GPU runs (``gemm_cuda.SWIGLU_TILES`` / ``TILES``); ``()`` where the variant does
    not run (see :func:`variant_names`).

    Raises:
        ValueError: an unknown ``variant``.
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    from mlx_bricks.ops.gemm import gemm_cuda_tiles

    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}, "
                         f"got {variant!r}")
    if variant == "fused":  # gate and up: two weight tiles per stage
        msl, cuda = FUSED_TILES, lambda: gemm_cuda_tiles(gemm_cuda.SWIGLU_TILES, dtype, 2)
    else:
        msl, cuda = GEMM_TILES, lambda: gemm_cuda_tiles(gemm_cuda.TILES, dtype)
    return kernel_variants(backend, _kernels(backend, variant), msl_tile_names(msl, dtype),
                           cuda_names=cuda)


def select_fused_tile(M: int, N: int) -> str:
    """The fused tile rule (the GEMM brick's, for an act tile half as wide): ``"64x32"`` when
    M > 32, N > 16 and its grid has at least ``MIN_THREADGROUPS_64`` threadgroups; ``"32x16"``
    otherwise. ``"64x64"`` is never chosen (it doubles the accumulators; opt in with ``tile=``)."""
    if M > 32 and N > 16 and math.ceil(M / 64) * math.ceil(N / 32) >= MIN_THREADGROUPS_64:
        return "64x32"
    return "32x16"


def plan_fused(M: int, N: int, K: int, dtype, *, tile: str | None = None,
               group_size: int | None = None) -> GemmPlan:
    """Plan of the fused kernel for x (M, K) and weights (N, K) (N = N_mlp).

    Args:
        M, N, K: problem size (each >= 1).
        dtype: float16, bfloat16 or float32.
        tile: ``None`` (:func:`select_fused_tile`) or a key of :data:`FUSED_TILES`.
        group_size: the weights' affine group size (None: float weights).

    Raises:
        ValueError: unknown ``tile``.
        RuntimeError: the tile would need more than ``THREADGROUP_MEMORY_LIMIT`` bytes of
            threadgroup memory (checked at every launch; the kernel also static_asserts it).
    """
    if tile is None:
        tile = select_fused_tile(M, N)
    if tile not in FUSED_TILES:
        raise ValueError(f"tile must be None or one of {sorted(FUSED_TILES)}, got {tile!r}")
    # The GEMM plan with 2 * BN weight rows (gate then up) staged per K step.
    return plan_gemm(M, N, K, dtype, tile=tile, tiles=FUSED_TILES, weight_tiles=2,
                     group_size=group_size)


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
    quantized weight, through :func:`~mlx_bricks.ops.gemm.linear_reference`).

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


def _format(weight) -> tuple:
    """What a loader type depends on: ``(bits, group_size)``, ``(0, 0)`` for a float weight."""
    return (weight.bits, weight.group_size) if is_quantized(weight) else (0, 0)


def same_format(w_gate, w_up) -> bool:
    """Whether the fused kernel can stage gate and up with one loader: both float, or both
    affine with the same bits and group_size (the scales' dtype is x's for both)."""
    return _format(w_gate) == _format(w_up)


def _check_tile(variant: str, tile) -> None:
    valid = FUSED_TILES if variant == "fused" else GEMM_TILES
    if tile is not None and tile not in valid:
        raise ValueError(
            f"tile must be None or, for variant {variant!r}, one of {sorted(valid)}, got {tile!r}"
        )


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------


def _swiglu_fused(x, w_gate, w_up, b_gate, b_up, M, N, K, tile, backend, act):
    gate_in, flags = weight_inputs(w_gate)
    up_in, _ = weight_inputs(w_up)  # same format (same_format): the same flags
    plan = plan_fused(M, N, K, x.dtype, tile=tile, group_size=flags["GROUP_SIZE"] or None)
    # Absent biases: the kernel is compiled without them; gate's scales input stands in.
    (act,) = launch(
        "swiglu_fused", backend,
        inputs=[x, *gate_in, *up_in,
                gate_in[1] if b_gate is None else mx.contiguous(b_gate),
                gate_in[1] if b_up is None else mx.contiguous(b_up)],
        template=plan.template(x.dtype, HAS_BIAS_GATE=b_gate is not None,
                               HAS_BIAS_UP=b_up is not None, **flags, ACT=act),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
    return act


def _swiglu_split(x, w_gate, w_up, b_gate, b_up, M, N, K, tile, backend, act):
    up = linear(x, w_up, b_up, tile=tile, backend=backend).reshape(M, N)
    gate_in, flags = weight_inputs(w_gate)
    plan = plan_gemm(M, N, K, x.dtype, tile=tile, group_size=flags["GROUP_SIZE"] or None)
    (act,) = launch(
        "swiglu_split", backend,
        inputs=[x, *gate_in, gate_in[1] if b_gate is None else mx.contiguous(b_gate),
                mx.contiguous(up)],
        template=plan.template(x.dtype, HAS_BIAS=b_gate is not None, HAS_RESIDUAL=False,
                               **flags, ACT=act),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
    return act


def _resolve_variant(variant, w_gate, w_up) -> str:
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
            f"variant 'fused' needs w_gate and w_up in one format, got (bits, group_size) "
            f"{_format(w_gate)} and {_format(w_up)} ((0, 0): float); use variant='split' or None"
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
            x's dtype; see :func:`~mlx_bricks.ops.gemm.linear`). ``fused`` needs both in one
            format (both float, or the same bits and group_size).
        b_gate, b_up: optional (N_mlp,) biases, x's dtype (``mlp_bias`` models).
        activation: the gate's activation, ``"silu"`` (default) or ``"gelu_tanh"``
            (:data:`ACTIVATIONS`): the kernels' ``ACT`` template parameter.
        variant: ``None`` (``MLX_BRICKS_SWIGLU_VARIANT`` if set, else :data:`DEFAULT_VARIANT`;
            ``split`` when w_gate and w_up differ in format; the rule is in docs/bricks.md),
            ``"fused"`` or ``"split"``.
        tile: ``None`` (the variant's tile rule) or, for ``fused``, a key of
            :data:`FUSED_TILES`; for ``split``, a GEMM tile (``mlx_bricks.ops.gemm.TILES``).
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
    act = activation_code(activation)
    variant = _resolve_variant(variant, w_gate, w_up)
    name = cuda_or(backend, x.dtype)
    if name != "cuda":
        _check_tile(variant, tile)
    if name == "reference":
        return swiglu_reference(x, w_gate, w_up, b_gate, b_up, activation)
    out_shape = (*x.shape[:-1], N)
    M = math.prod(x.shape[:-1])
    if M == 0 or N == 0:
        return mx.zeros(out_shape, dtype=x.dtype)
    if name == "cuda":
        return gemm_cuda.swiglu(x, w_gate, w_up, b_gate, b_up, variant=variant,
                                tile=tile, act=act).reshape(out_shape)
    run = _swiglu_fused if variant == "fused" else _swiglu_split
    return run(x, w_gate, w_up, b_gate, b_up, M, N, K, tile, name, act).reshape(out_shape)


def swiglu_mlp(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None,
               activation="silu", variant=None, backend=None):
    """The llama MLP ``down(SiLU(gate(x)) * up(x)) (+ residual)`` on the bricks (gemma's
    ``down(gelu_approx(gate(x)) * up(x))`` with ``activation="gelu_tanh"``).

    ``act`` by :func:`swiglu`, then ``act @ w_down.T + b_down + residual`` by the GEMM brick's
    :func:`~mlx_bricks.ops.gemm.linear` (bias and residual added in its epilogue). Same
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
    name = cuda_or(backend, x.dtype)
    act = swiglu(x, w_gate, w_up, b_gate=b_gate, b_up=b_up, activation=activation,
                 variant=variant, backend=name)
    return linear(act, w_down, b_down, residual, backend=name)
