"""The SwiGLU brick's CUDA twins: the fused kernel (``cuda_src/swiglu_fused.cu``) and the split
variant (the GEMM twin with a SwiGLU epilogue), on the GEMM pipeline of ``cuda_src/gemm.cuh``
(tiles and launch helpers: ``mlx_bricks.bricks.gemm.cuda``)."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.gemm.cuda import (
    MAX_THREADS,
    QGEMM_HEADERS,
    TILES,
    CudaTile,
    as_rows,
    check_dtype,
    gemm_launch,
    geometry,
    grid_of,
    pick_tile,
    smem_of,
    weight_triple,
    wgmma_tile,
    ws_geometry,
    ws_grid,
    ws_tile,
)
from mlx_bricks.kernels import KernelSpec, launch, register

#: The fused SwiGLU with gate and up dequantized in registers (``ws`` tiles, qgemm.cuh).
register(KernelSpec(
    name="qgemm_swiglu",
    body=None,
    input_names=("x", "w_gate", "scales_gate", "biases_gate", "w_up", "scales_up", "biases_up",
                 "b_gate", "b_up"),
    output_names=("act",),
    cuda_body="qgemm_swiglu.cu",
    cuda_headers=QGEMM_HEADERS,
))

#: Fused SwiGLU tiles, named by the act tile; each block also stages 2 * BN weight rows.
SWIGLU_TILES = {
    "128x64": CudaTile(128, 64, 4, 2, 4),
    "64x64": CudaTile(64, 64, 2, 2, 4),
    "wg128x64": wgmma_tile(128, 64),
    "wg128x64d": wgmma_tile(128, 64, stages=5, depth=1),
    # 128 x 128 act tile: two m64n128 wgmma per k16 per warpgroup (the 128 x 64 tile's
    # m64n64 saturates shared-memory bandwidth); 128 accumulators per thread, as wg128x256.
    # ptxas: float and 2-4 bits without spills (242-255 registers); 6-bit spills 48 bytes with
    # a gate bias (none without), 8-bit 20 bytes.
    "wg128x128": wgmma_tile(128, 128, max_bits=4),
    # gate and up dequantized in registers (qgemm_swiglu.cu; affine 4 / 8-bit of one format):
    # BM tokens x BN act columns, 2 BN weight rows per block (half the consumers each).
    "qwg256x64": ws_tile(256, 64, wgmma=True, mi=1),
    "qwg128x128": ws_tile(128, 128, wgmma=True, mi=2),
    "qwg128x64": ws_tile(128, 64, wgmma=True, mi=1),
    "qmma128x64": ws_tile(128, 64, wgmma=False, mi=2, wr=4),
}
assert all(t.threads <= MAX_THREADS or t.ws for t in SWIGLU_TILES.values())


def swiglu(x, w_gate, w_up, b_gate=None, b_up=None, *, variant="fused", tile=None, act=0):
    """The SwiGLU twins: ``act(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)``, (M, N_mlp) of
    x's dtype, for validated arguments (weights float or affine; ``act`` the ``ACT`` template
    value, ``ops.swiglu_variants.ACTIVATIONS``: 0 SiLU, 1 GELU-tanh). ``fused``: one kernel
    (swiglu_fused.cu); gate and up in different formats run ``split``. ``split``: the up GEMM, then
    the gate GEMM whose epilogue reads up (gemm.cu with SWIGLU_UP).

    Raises:
        NotImplementedError: float32 activations. ValueError: unknown tile. TypeError: see
        :func:`weight_triple`.
    """
    check_dtype(x.dtype)
    K = x.shape[-1]
    N = w_gate.shape[0]
    x2 = as_rows(x, K)
    M = x2.shape[0]
    g3, g_bits, g_gs = weight_triple(w_gate, x.dtype, "w_gate")
    u3, u_bits, u_gs = weight_triple(w_up, x.dtype, "w_up")
    if variant == "fused" and (g_bits, g_gs) == (u_bits, u_gs):
        t = pick_tile(SWIGLU_TILES, tile, M, N, 2, g_bits)
        if t.ws:  # gate and up dequantized in registers (qgemm_swiglu.cu)
            name, (template, smem), (grid, tg) = (
                "qgemm_swiglu", ws_geometry(t, x.dtype, g_bits, g_gs, weight_operands=2),
                ws_grid(t, M, N))
        else:
            name, template, smem, (grid, tg) = (
                "swiglu_fused", geometry(t, x.dtype) + [("BITS", g_bits), ("GS", g_gs)],
                smem_of(t, [g_bits], weight_operands=2), grid_of(t, M, N))
        ph = g3[1]
        (act,) = launch(
            name, "cuda",
            inputs=[x2, *g3, *u3, ph if b_gate is None else mx.contiguous(b_gate),
                    ph if b_up is None else mx.contiguous(b_up)],
            template=template + [("HAS_BIAS_GATE", b_gate is not None),
                                 ("HAS_BIAS_UP", b_up is not None), ("ACT", act)],
            grid=grid, threadgroup=tg, output_shapes=[(M, N)], output_dtypes=[x.dtype],
            shared_memory=smem,
        )
        return act
    t = pick_tile(TILES, None if variant == "fused" else tile, M, N, 1, max(g_bits, u_bits))
    up = gemm_launch(x2, u3, u_bits, u_gs, b_up, None, t)
    return gemm_launch(x2, g3, g_bits, g_gs, b_gate, up, t, swiglu_up=True, act=act)

