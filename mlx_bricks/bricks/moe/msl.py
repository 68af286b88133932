"""The MoE brick's MSL kernels (``metal_src/moe*.metal`` on ``gemm.h`` / ``swiglu.h`` /
``moe.h``): their registration, tile table, plan and launch on ``metal`` and ``emulator``.

The kernel specs registered here carry the CUDA twins' sources too (``cuda_src/moe*.cu``, one
spec per kernel for both backends); the CUDA geometry is ``mlx_bricks.bricks.moe.cuda``'s.
Tiles, threadgroup memory and the route layout are in docs/moe.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.kernels import KernelSpec, launch, register
from mlx_bricks.bricks.gemm.msl import (
    K_TILE_BYTES,
    PAD_CHUNKS,
    THREADGROUP_MEMORY_LIMIT,
    VECTOR_BYTES,
    GemmTile,
    threadgroup_memory_bytes,
)

_CUDA_HEADERS = ("mma.cuh", "dequant.cuh", "gemm.cuh", "wgmma.cuh", "moe.cuh")

register(KernelSpec(
    name="moe_route",
    body="moe_route.metal",
    input_names=("indices", "order"),
    output_names=("route",),
    cuda_body="moe_route.cu",
))
GATE_UP_SPEC = register(KernelSpec(
    name="moe_gate_up",
    body="moe_gate_up.metal",
    # *_scales / *_biases: the affine weights' (placeholders for float weights, never read).
    input_names=("x", "order", "route", "w_gate", "gate_scales", "gate_biases", "w_up",
                 "up_scales", "up_biases", "b_gate", "b_up", "act_params"),
    output_names=("act",),
    headers=("gemm.h", "swiglu.h", "moe.h"),
    cuda_body="moe_gate_up.cu",
    cuda_headers=_CUDA_HEADERS,
    # The twin names the weight triples as the GEMM twins do, and takes up (R, N) for the split
    # pair of gate and up in different formats (a placeholder otherwise).
    cuda_input_names=("x", "order", "route", "w_gate", "scales_gate", "biases_gate", "w_up",
                      "scales_up", "biases_up", "b_gate", "b_up", "act_params", "up"),
))
UP_SPEC = register(KernelSpec(
    name="moe_up",
    body="moe_up.metal",
    # a gate-less expert's up projection and activation (SwitchMLP); up_scales / up_biases:
    # the affine weight's (placeholders for a float weight, never read)
    input_names=("x", "order", "route", "w_up", "up_scales", "up_biases", "b_up"),
    output_names=("act",),
    headers=("gemm.h", "swiglu.h", "moe.h"),
))
register(KernelSpec(
    name="moe_down",
    body="moe_down.metal",
    input_names=("act", "order", "route", "w_down", "down_scales", "down_biases", "b_down"),
    output_names=("y",),
    headers=("gemm.h", "swiglu.h", "moe.h"),
    cuda_body="moe_down.cu",
    cuda_headers=_CUDA_HEADERS,
))
register(KernelSpec(
    name="moe_combine",
    body="moe_combine.metal",
    input_names=("y", "scores"),
    output_names=("out",),
    cuda_body="moe_combine.cu",
    cuda_headers=("mma.cuh",),
))


@dataclass(frozen=True)
class MoeTile:
    """A tile pair sharing BM rows per tile (one route serves both GEMMs): the gate/up kernel's
    act tile (BM x BN act columns, 2 * BN weight rows per K step: the fused SwiGLU's tiles) and
    the down kernel's GEMM tile."""

    gate_up: GemmTile
    down: GemmTile

    @property
    def bm(self) -> int:
        return self.gate_up.bm


def _with_single_buffer(tiles: dict) -> dict:
    out = dict(tiles)
    for name, t in tiles.items():
        out[name + "_sb"] = MoeTile(GemmTile(t.gate_up.bm, t.gate_up.bn, stages=1),
                                    GemmTile(t.down.bm, t.down.bn, stages=1))
    return out


#: The MSL tiles: ``bm64`` (gate/up 64x32 as the fused SwiGLU's main tile, down 64x64 as the
#: GEMM's) and ``bm32`` (32x16, 32x32) for experts of few rows, each also single-buffered
#: (``_sb``: half the threadgroup memory; for the tuner, never chosen by the rule).
TILES = _with_single_buffer({
    "bm64": MoeTile(GemmTile(64, 32), GemmTile(64, 64)),
    "bm32": MoeTile(GemmTile(32, 16), GemmTile(32, 32)),
})
#: Mean rows per expert above which the 64-row tiles are used (a 64-row tile of an expert with
#: 32 rows or fewer is at least half padding). A heuristic, not a measurement.
ROWS_PER_EXPERT_64 = 32
#: Most threads of the route kernel (one threadgroup).
ROUTE_MAX_THREADS = 1024


def select_tile(R: int, E: int) -> str:
    """The tile rule: ``bm64`` when the R rows average more than :data:`ROWS_PER_EXPERT_64`
    per expert they can reach (min(E, R)), else ``bm32``."""
    return "bm64" if R / max(1, min(E, R)) > ROWS_PER_EXPERT_64 else "bm32"


def tiles_max(R: int, E: int, bm: int) -> int:
    """Upper bound of the row tiles of R rows over E experts plus the out-of-range tail:
    ``sum_g ceil(rows_g / BM) <= (R + G * (BM - 1)) // BM`` over the G <= min(E + 1, R)
    non-empty groups. The route kernel computes the same (moe_route.metal / .cu)."""
    return (R + min(E + 1, R) * (bm - 1)) // bm


def route_size(R: int, E: int, bm: int) -> int:
    """Elements of the route array: E + 2 offsets, then two entries per row tile."""
    return E + 2 + 2 * tiles_max(R, E, bm)


def route_threads(R: int, E: int, max_threads: int = ROUTE_MAX_THREADS) -> int:
    """Threads of the route kernel: the power of two >= max(R + 1, E + 1) (one row boundary
    and one expert per thread), between 32 and ``max_threads`` (few template values)."""
    n = max(32, R + 1, E + 1)
    return min(max_threads, 1 << (n - 1).bit_length())


def route_threadgroup_bytes(E: int, threads: int) -> int:
    """Threadgroup memory of the route kernel: offsets and tile starts (E + 2 ints each) and one
    int per simdgroup."""
    return (2 * (E + 2) + threads // 32) * 4


@dataclass(frozen=True)
class MoePlan:
    """Launch values of one MoE call (see :func:`plan_moe`)."""

    tile: MoeTile
    bk: int
    pad: int
    vec_k: bool     # D % vector width == 0 (gate/up: x rows and weight rows)
    vec_n: bool     # N % vector width == 0 (down: act rows and w_down rows)
    tiles: int      # row tiles in the grid (tiles_max)
    route_threads: int
    threadgroup_bytes: tuple[int, int]  # gate/up, down


def plan_moe(R: int, E: int, N: int, D: int, dtype, *, tile: str | None = None,
             group_sizes=()) -> MoePlan:
    """Tile pair, template values and geometry for R rows over E experts, each (N, D).

    Args:
        R, E, N, D: rows (tokens * k), experts, expert intermediate size, hidden size.
        dtype: float16, bfloat16 or float32 (the activations').
        tile: None (:func:`select_tile`) or a key of :data:`TILES`.
        group_sizes: the affine weights' group sizes (BK must divide each).

    Raises:
        ValueError: an unknown ``tile``; more experts than the route kernel's threadgroup memory
            holds (about 4000).
        RuntimeError: a tile over the threadgroup-memory limit or a BK that does not divide a
            group size (bugs in the table, checked at every launch).
    """
    if tile is None:
        tile = select_tile(R, E)
    if tile not in TILES:
        raise ValueError(f"tile must be None or one of {sorted(TILES)}, got {tile!r}")
    t = TILES[tile]
    itemsize = dtype.size
    vw = VECTOR_BYTES // itemsize
    bk = K_TILE_BYTES // itemsize
    pad = PAD_CHUNKS * vw
    tg = (threadgroup_memory_bytes(t.gate_up, bk, pad, itemsize, weight_tiles=2),
          threadgroup_memory_bytes(t.down, bk, pad, itemsize))
    if max(tg) > THREADGROUP_MEMORY_LIMIT:
        raise RuntimeError(f"MoE tile {tile} needs {max(tg)} bytes of threadgroup memory, over "
                           f"the {THREADGROUP_MEMORY_LIMIT}-byte limit")
    for gs in group_sizes:
        if gs % bk:
            raise RuntimeError(f"MoE tile {tile}: BK={bk} does not divide group_size {gs}")
    threads = route_threads(R, E)
    if route_threadgroup_bytes(E, threads) > THREADGROUP_MEMORY_LIMIT:
        raise ValueError(f"E={E} experts: the route kernel would need "
                         f"{route_threadgroup_bytes(E, threads)} bytes of threadgroup memory, "
                         f"over the {THREADGROUP_MEMORY_LIMIT}-byte limit (about 4000 experts)")
    return MoePlan(tile=t, bk=bk, pad=pad, vec_k=D % vw == 0, vec_n=N % vw == 0,
                   tiles=tiles_max(R, E, t.bm), route_threads=threads,
                   threadgroup_bytes=tg)


def route(idx, order, E: int, bm: int, backend: str, threads: int):
    """The route array (``moe_route``) of the sorted rows: int32 (route_size(R, E, bm),)."""
    R = idx.shape[0]
    (out,) = launch(
        "moe_route", backend,
        inputs=[idx, order],
        template=[("E", E), ("BM", bm), ("NT", threads)],
        grid=(threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(route_size(R, E, bm),)], output_dtypes=[mx.int32],
    )
    return out


def _geometry(dtype, t: GemmTile, bk: int, pad: int, vec: bool) -> list:
    return [("T", dtype), ("BM", t.bm), ("BN", t.bn), ("BK", bk), ("WM", t.wm), ("WN", t.wn),
            ("PAD", pad), ("VEC", vec), ("STAGES", t.stages)]


def moe_rows(x2, idx, order, gate, up, down, biases, E: int, act: int, act_params, *,
             tile=None, backend: str):
    """The grouped GEMMs of :func:`~mlx_bricks.bricks.moe.op.moe_mlp` on ``metal`` or
    ``emulator``, for validated arguments.

    Args:
        x2: (tokens, D) row-contiguous; idx, order: (R,) uint32 from ``op.sort_rows``.
        gate, up, down: ``([w, scales, biases], bits, group_size)`` (``op.expert_inputs``);
            gate None for a gate-less expert (``moe_up``, then ``moe_down``).
        biases: (b_gate, b_up, b_down), each None or (E, N) / (E, N) / (E, D).
        E: experts; act: the ACT value; act_params: the activation's two parameters
            (``op.ACTIVATION_PARAMS``).
        tile: None or a key of :data:`TILES`.

    Returns:
        y (R, D) of x's dtype, row r = (token r // k, slot r % k).
    """
    D = x2.shape[1]
    R = idx.shape[0]
    dtype = x2.dtype
    N = up[0][0].shape[1]
    plan = plan_moe(R, E, N, D, dtype, tile=tile,
                    group_sizes=[w[2] for w in (gate, up, down) if w is not None and w[1]])
    t = plan.tile
    rt = route(idx, order, E, t.bm, backend, plan.route_threads)
    b_gate, b_up, b_down = (None if b is None else mx.contiguous(b) for b in biases)
    ph = up[0][1]  # a placeholder of x's dtype for absent biases
    gu, dn = t.gate_up, t.down
    if gate is None:  # a gate-less expert (SwitchMLP): up and its activation, then down
        (act_rows,) = launch(
            "moe_up", backend,
            inputs=[x2, order, rt, *up[0], ph if b_up is None else b_up],
            template=_geometry(dtype, dn, plan.bk, plan.pad, plan.vec_k) + [
                ("BITS", up[1]), ("GROUP_SIZE", up[2]), ("HAS_BIAS", b_up is not None),
                ("ACT", act)],
            grid=(math.ceil(N / dn.bn) * dn.threads, plan.tiles, 1),
            threadgroup=(dn.threads, 1, 1),
            output_shapes=[(R, N)], output_dtypes=[dtype],
        )
        return _down(act_rows, order, rt, down, b_down, ph, plan, R, D, backend)
    (act_rows,) = launch(
        "moe_gate_up", backend,
        inputs=[x2, order, rt, *gate[0], *up[0], ph if b_gate is None else b_gate,
                ph if b_up is None else b_up, mx.array(act_params, dtype=mx.float32)],
        template=_geometry(dtype, gu, plan.bk, plan.pad, plan.vec_k) + [
            ("BITS_G", gate[1]), ("GS_G", gate[2]), ("BITS_U", up[1]), ("GS_U", up[2]),
            ("HAS_BIAS_GATE", b_gate is not None), ("HAS_BIAS_UP", b_up is not None),
            ("ACT", act)],
        grid=(math.ceil(N / gu.bn) * gu.threads, plan.tiles, 1),
        threadgroup=(gu.threads, 1, 1),
        output_shapes=[(R, N)], output_dtypes=[dtype],
    )
    return _down(act_rows, order, rt, down, b_down, ph, plan, R, D, backend)


def _down(act_rows, order, rt, down, b_down, ph, plan: MoePlan, R: int, D: int, backend: str):
    """The down projection (``moe_down``): y (R, D) in (token, slot) order."""
    dn = plan.tile.down
    (y,) = launch(
        "moe_down", backend,
        inputs=[act_rows, order, rt, *down[0], ph if b_down is None else b_down],
        template=_geometry(act_rows.dtype, dn, plan.bk, plan.pad, plan.vec_n) + [
            ("BITS", down[1]), ("GROUP_SIZE", down[2]), ("HAS_BIAS", b_down is not None)],
        grid=(math.ceil(D / dn.bn) * dn.threads, plan.tiles, 1),
        threadgroup=(dn.threads, 1, 1),
        output_shapes=[(R, D)], output_dtypes=[act_rows.dtype],
    )
    return y


def combine(y, scores, backend: str):
    """``out[t] = sum_s scores[t, s] * y[t * k + s]`` (``moe_combine``): y (R, D), scores
    (tokens, k) row-contiguous; returns (tokens, D) of y's dtype."""
    tokens, _ = scores.shape
    D = y.shape[1]
    (out,) = launch(
        "moe_combine", backend,
        inputs=[y, scores], template=[("T", y.dtype)],
        grid=(D, tokens, 1), threadgroup=(min(D, 256), 1, 1),
        output_shapes=[(tokens, D)], output_dtypes=[y.dtype],
    )
    return out
