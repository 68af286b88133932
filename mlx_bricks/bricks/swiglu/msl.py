"""The SwiGLU brick's MSL kernels (``metal_src/swiglu_fused.metal``, ``swiglu_split.metal`` on
the GEMM pipeline of ``metal_src/gemm.h``): specs, fused tiles, plan and launches. The gate's
activation (``activation="silu"`` or ``"gelu_tanh"``) is the kernels' ``ACT`` template
parameter: one kernel per variant, not a copy per activation. What each variant computes:
``op.py``.
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.bricks.gemm.msl import (
    MIN_THREADGROUPS_64,
    GemmPlan,
    GemmTile,
    plan_gemm,
    with_variants,
)
from mlx_bricks.formats import format_of
from mlx_bricks.kernels import KernelSpec, launch, register

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
    cuda_body="swiglu_fused.cu",
    cuda_headers=("mma.cuh", "dequant.cuh", "gemm.cuh", "wgmma.cuh"),
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


def launch_fused(x, w_gate, w_up, b_gate, b_up, M, N, K, tile, backend, act):
    """The fused kernel on ``backend`` (``metal`` / ``emulator``) for validated arguments, gate
    and up in one format; returns the (M, N) activation. ``act``: the ``ACT`` template value."""
    gate_in, flags = format_of(w_gate).msl_inputs(w_gate)
    up_in, _ = format_of(w_up).msl_inputs(w_up)  # same format: the same flags
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


def launch_split(x, w_gate, up, b_gate, M, N, K, tile, backend, act):
    """The split variant's gate GEMM on ``backend`` (``metal`` / ``emulator``) whose epilogue
    reads ``up`` (M, N) (the GEMM brick's output) and writes ``act(gate) * up``."""
    gate_in, flags = format_of(w_gate).msl_inputs(w_gate)
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
