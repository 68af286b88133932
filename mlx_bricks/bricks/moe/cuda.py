"""The MoE brick's CUDA twins (``cuda_src/moe*.cu`` on ``gemm.cuh``'s mainloop): tiles, plan and
launch on ``cuda``. Same inputs, outputs and semantics as the MSL kernels (``msl``, which
registers the specs for both); what differs is the geometry: mma.sync m16n8k16 (sm_80+) or wgmma
(sm_90a) tensor cores, 64 k per stage, a cp.async ring, affine weights dequantized once per stage
(gemm.cuh), dynamic shared memory sized with ``gemm_cuda.shared_memory_bytes``.

Gate and up in one format run fused (MODE 0: one kernel, both from one x tile); in different
formats the pair runs split: up (MODE 1, rounded to x's dtype as stock rounds it), then gate
with the activation in its epilogue (MODE 2). float16 / bfloat16 only (tensor cores); float32
has no twin.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.bricks.moe.msl import route_size, route_threads, tiles_max
from mlx_bricks.kernels import KernelSpec, launch, register
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.bricks.gemm.cuda import (
    QGEMM_HEADERS,
    WS_BITS,
    CudaTile,
    check_dtype,
    shared_memory_bytes,
    ws_geometry,
    ws_tile,
)

#: The grouped GEMMs with the expert weights dequantized in registers (``ws`` tiles: qgemm.cuh).
_QMOE_HEADERS = (*QGEMM_HEADERS, "moe.cuh", "qmoe.cuh")
register(KernelSpec(
    name="qmoe_gate_up",
    body=None,
    input_names=("x", "order", "route", "w_gate", "scales_gate", "biases_gate", "w_up",
                 "scales_up", "biases_up", "b_gate", "b_up", "act_params"),
    output_names=("act",),
    cuda_body="qmoe_gate_up.cu",
    cuda_headers=_QMOE_HEADERS,
))
register(KernelSpec(
    name="qmoe_down",
    body=None,
    input_names=("act", "order", "route", "w_down", "down_scales", "down_biases", "b_down"),
    output_names=("y",),
    cuda_body="qmoe_down.cu",
    cuda_headers=_QMOE_HEADERS,
))


@dataclass(frozen=True)
class MoeCudaTile:
    """The gate/up block tile (BM x BN act columns, 2 * BN weight rows when fused) and the down
    block tile, sharing BM (one route for both)."""

    gate_up: CudaTile
    down: CudaTile

    @property
    def bm(self) -> int:
        return self.gate_up.bm

    @property
    def wgmma(self) -> bool:
        return self.gate_up.wgmma

    @property
    def ws(self) -> bool:
        return self.gate_up.ws


def _wg(bm: int, bn: int) -> CudaTile:
    return CudaTile(bm, bn, bm // 16, 1, 4, wgmma=True)


#: The CUDA tiles: ``wg128`` / ``wg64`` on sm_90a (wgmma; 64 rows per warpgroup, so 2 or 1
#: warpgroups), ``bm64`` / ``bm32`` mma.sync (sm_80+; 2 x 2 warps). Registers and spills:
#: tests/test_moe.py compiles each (ptxas -v).
TILES = {
    "wg128": MoeCudaTile(_wg(128, 64), _wg(128, 128)),
    "wg64": MoeCudaTile(_wg(64, 64), _wg(64, 128)),
    # 8-bit gate and up fused: 64 bytes of spills on sm_90a (ptxas -v), so at most 6 bits.
    "bm64": MoeCudaTile(CudaTile(64, 64, 2, 2, 4, max_bits=6), CudaTile(64, 64, 2, 2, 4)),
    "bm32": MoeCudaTile(CudaTile(32, 64, 2, 2, 4), CudaTile(32, 64, 2, 2, 4)),
    # Expert weights dequantized in registers (qmoe_gate_up.cu / qmoe_down.cu on qgemm.cuh:
    # gate and up affine 4 / 8-bit of one format, down 4 / 8-bit): BM sorted rows, gate/up act
    # tile of 64 columns (128 weight rows), down tile of 128 columns. Tuner-only.
    "qwg256": MoeCudaTile(ws_tile(256, 64, wgmma=True, mi=1), ws_tile(256, 128, wgmma=True, mi=1)),
    "qwg128": MoeCudaTile(ws_tile(128, 64, wgmma=True, mi=1), ws_tile(128, 128, wgmma=True, mi=1)),
    "qwg64": MoeCudaTile(ws_tile(64, 64, wgmma=True, mi=1), ws_tile(64, 128, wgmma=True, mi=1)),
    "qmma128": MoeCudaTile(ws_tile(128, 64, wgmma=False, mi=2, wr=4),
                           ws_tile(128, 128, wgmma=False, mi=2, wr=4)),
}


def _fits(t: MoeCudaTile, bits, gated: bool = True) -> bool:
    """Whether tile ``t`` takes weights of ``bits`` = (gate, up, down) (0: float) without
    spilling: gate and up of one width run fused (``gate_up.max_bits``), of two widths split
    (one operand per launch, fewer registers); down within ``down.max_bits``. ``ws`` tiles:
    gate and up of one width, all three 4- or 8-bit affine (the formats' group sizes are the
    caller's: ``moe_rows`` refuses different ones). Gate-less experts (``gated`` False) load
    one operand, as the split pair."""
    g, u, d = bits
    if t.ws:
        return gated and g == u and g in WS_BITS and d in WS_BITS
    return (g != u or not gated or g <= t.gate_up.max_bits) and d <= t.down.max_bits


def tile_names(cc: tuple[int, int] | None = None, bits=(0, 0, 0),
               gated: bool = True) -> tuple[str, ...]:
    """The tiles a GPU of capability ``cc`` (default: this one) runs for weights of ``bits``
    = (gate, up, down) (0: float): wgmma tiles need sm_90, every kernel's shared memory must
    fit and no kernel may spill (:func:`_fits`); gate-less experts (``gated`` False) have no
    ws tile (``qmoe_*`` computes gate and up)."""
    cc = gemm_cuda.device_capability() if cc is None else cc
    limit = gemm_cuda.max_shared_memory(cc)

    def fits_smem(t):
        if t.ws:
            return (gemm_cuda.ws_plan(t.gate_up, bits[0], 2, cc) is not None
                    and gemm_cuda.ws_plan(t.down, bits[2], 1, cc) is not None)
        return max(_smem(t, b) for b in bits) <= limit

    return tuple(n for n, t in TILES.items()
                 if (not t.wgmma or cc[0] == 9) and _fits(t, bits, gated) and fits_smem(t))


def select_tile(R: int, E: int, cc: tuple[int, int] | None = None, bits=(0, 0, 0),
                gated: bool = True) -> str:
    """The tile rule (until the tuner decides): by the mean rows per expert m = R / min(E, R),
    ``wg128`` above 96, ``wg64`` above 32, else ``bm32`` on sm_90; ``bm64`` above 32, else
    ``bm32`` elsewhere. A heuristic, not a measurement."""
    names = tile_names(cc, bits, gated)
    mean = R / max(1, min(E, R))
    order = ("wg128", "wg64", "bm32") if mean > 96 else \
        ("wg64", "bm64", "bm32") if mean > 32 else ("bm32", "bm64")
    for name in order:
        if name in names:
            return name
    if not names:
        raise NotImplementedError("no MoE CUDA tile fits this GPU's shared memory: has no CUDA "
                                  "twin")
    return names[0]


def _smem(t: MoeCudaTile, bits: int) -> int:
    """Shared memory of the larger kernel of ``t`` for weights of ``bits`` (gate/up fused: an
    upper bound of the split pair's)."""
    return max(shared_memory_bytes(t.gate_up, 2, bits or None),
               shared_memory_bytes(t.down, 1, bits or None))


def _geom(t: CudaTile, dtype) -> list:
    return [("T", dtype), ("BM", t.bm), ("BN", t.bn), ("WM", t.wm), ("WN", t.wn),
            ("STAGES", t.stages), ("WGMMA", t.wgmma), ("DEPTH", t.depth)]


def route_shared_memory(E: int, threads: int) -> int:
    """Bytes of the route twin's shared memory: offsets and tile starts (E + 2 each) and one
    scan slot per thread, int32."""
    return (2 * (E + 2) + threads) * 4


def route(idx, order, E: int, bm: int):
    """The route array (``moe_route`` twin), int32 (route_size(R, E, bm),)."""
    R = idx.shape[0]
    threads = route_threads(R, E)
    (out,) = launch(
        "moe_route", "cuda", inputs=[idx, order],
        template=[("E", E), ("BM", bm), ("NT", threads)],
        grid=(threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(route_size(R, E, bm),)], output_dtypes=[mx.int32],
        shared_memory=route_shared_memory(E, threads),
    )
    return out


def moe_rows(x2, idx, order, gate, up, down, biases, E: int, act: int, act_params, *,
             tile=None, backend: str = "cuda"):
    """The grouped GEMMs of ``op.moe_mlp`` on ``cuda``; arguments as ``msl.moe_rows`` (tile: a
    key of :data:`TILES`). Returns y (R, D) of x's dtype in (token, slot) order.

    Raises:
        NotImplementedError: float32 (no CUDA twin).
        ValueError: an unknown ``tile`` or one this GPU cannot run.
    """
    check_dtype(x2.dtype)
    D = x2.shape[1]
    R = idx.shape[0]
    N = up[0][0].shape[1]
    dtype = x2.dtype
    gateless = gate is None  # a SwitchMLP's experts: MODE 3 (up and its activation), then down
    if gateless:
        gate = up  # the kernel's gate triple: a placeholder, never read in MODE 3
    fused = gate[1:] == up[1:]
    bits = (gate[1], up[1], down[1])
    if tile is None:
        tile = select_tile(R, E, bits=bits, gated=not gateless)
    elif tile not in tile_names(bits=bits, gated=not gateless):
        raise ValueError(f"tile must be None or, on this GPU, one of "
                         f"{list(tile_names(bits=bits, gated=not gateless))}, got {tile!r}")
    t = TILES[tile]
    rt = route(idx, order, E, t.bm)
    tiles = tiles_max(R, E, t.bm)
    b_gate, b_up, b_down = (None if b is None else mx.contiguous(b) for b in biases)
    ph = gate[0][1]
    params = mx.array(act_params, dtype=mx.float32)
    if t.ws:
        if not fused or gateless:
            raise ValueError(f"tile {tile!r} takes gate and up in one format")
        return _qmoe(x2, order, rt, tiles, gate, up, down, (b_gate, b_up, b_down), params,
                     act, t, R, N, D)
    gu = t.gate_up

    def gate_up(mode, fmt, up_rows):
        (out,) = launch(
            "moe_gate_up", "cuda",
            inputs=[x2, order, rt, *gate[0], *up[0], ph if b_gate is None else b_gate,
                    ph if b_up is None else b_up, params, ph if up_rows is None else up_rows],
            template=_geom(gu, dtype) + [
                ("BITS", fmt[1]), ("GS", fmt[2] or 32), ("MODE", mode),
                ("HAS_BIAS_GATE", b_gate is not None), ("HAS_BIAS_UP", b_up is not None),
                ("ACT", act)],
            grid=(tiles * math.ceil(N / gu.bn) * gu.threads, 1, 1),
            threadgroup=(gu.threads, 1, 1),
            output_shapes=[(R, N)], output_dtypes=[dtype],
            shared_memory=shared_memory_bytes(gu, 2 if mode == 0 else 1, fmt[1] or None),
        )
        return out

    if gateless:
        act_rows = gate_up(3, up, None)
    elif fused:
        act_rows = gate_up(0, gate, None)
    else:
        act_rows = gate_up(2, gate, gate_up(1, up, None))
    dn = t.down
    (y,) = launch(
        "moe_down", "cuda",
        inputs=[act_rows, order, rt, *down[0], ph if b_down is None else b_down],
        template=_geom(dn, dtype) + [("BITS", down[1]), ("GS", down[2] or 32),
                                     ("HAS_BIAS", b_down is not None)],
        grid=(tiles * math.ceil(D / dn.bn) * dn.threads, 1, 1),
        threadgroup=(dn.threads, 1, 1),
        output_shapes=[(R, D)], output_dtypes=[dtype],
        shared_memory=shared_memory_bytes(dn, 1, down[1] or None),
    )
    return y


def _qmoe(x2, order, rt, tiles, gate, up, down, biases, params, act, t, R, N, D):
    """The grouped GEMMs of a ``ws`` tile: ``qmoe_gate_up`` (gate and up fused), then
    ``qmoe_down``; arguments as :func:`moe_rows` has them."""
    b_gate, b_up, b_down = biases
    dtype = x2.dtype
    ph = gate[0][1]
    gu, dn = t.gate_up, t.down
    template, smem = ws_geometry(gu, dtype, gate[1], gate[2], weight_operands=2)
    (act_rows,) = launch(
        "qmoe_gate_up", "cuda",
        inputs=[x2, order, rt, *gate[0], *up[0], ph if b_gate is None else b_gate,
                ph if b_up is None else b_up, params],
        template=template + [("HAS_BIAS_GATE", b_gate is not None),
                             ("HAS_BIAS_UP", b_up is not None), ("ACT", act)],
        grid=(tiles * math.ceil(N / gu.bn) * gu.threads, 1, 1), threadgroup=(gu.threads, 1, 1),
        output_shapes=[(R, N)], output_dtypes=[dtype], shared_memory=smem,
    )
    template, smem = ws_geometry(dn, dtype, down[1], down[2])
    (y,) = launch(
        "qmoe_down", "cuda",
        inputs=[act_rows, order, rt, *down[0], ph if b_down is None else b_down],
        template=template + [("HAS_BIAS", b_down is not None)],
        grid=(tiles * math.ceil(D / dn.bn) * dn.threads, 1, 1), threadgroup=(dn.threads, 1, 1),
        output_shapes=[(R, D)], output_dtypes=[dtype], shared_memory=smem,
    )
    return y


#: Threads per block of the combine twin.
COMBINE_THREADS = 256


def combine(y, scores, backend: str = "cuda"):
    """The ``moe_combine`` twin: (tokens, D) of y's dtype (see ``msl.combine``)."""
    tokens = scores.shape[0]
    D = y.shape[1]
    blocks = math.ceil(tokens * D / COMBINE_THREADS)
    (out,) = launch(
        "moe_combine", "cuda", inputs=[y, scores],
        template=[("T", y.dtype), ("NT", COMBINE_THREADS)],
        grid=(blocks * COMBINE_THREADS, 1, 1), threadgroup=(COMBINE_THREADS, 1, 1),
        output_shapes=[(tokens, D)], output_dtypes=[y.dtype],
    )
    return out
