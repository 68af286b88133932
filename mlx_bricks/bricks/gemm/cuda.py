"""Launch geometry of the CUDA GEMM twins (``cuda_src/gemm.cu``, ``gemm_splitk.cu`` with
``gemm_splitk_reduce.cu``, ``swiglu_fused.cu``, ``rms_norm_qkv.cu``, all on the pipeline of
``cuda_src/gemm.cuh``; affine weights converted by ``cuda_src/dequant.cuh``).

The ops (``linear``, ``swiglu``, ``rms_norm_qkv``) call these after their own argument checks when
the backend is ``cuda``; the semantics are the MSL bricks' (same inputs, outputs and rounding:
products summed in float32, epilogue in float32, one rounding). What differs is the geometry:
mma.sync m16n8k16 tensor cores, block tiles of BM x BN with a STAGES-deep cp.async ring and 64 k
per stage, dynamic shared memory sized here with the formula of ``GemmSmem`` in gemm.cuh.

float16 and bfloat16 run on the tensor cores; float32 has no twin (the ops keep the reference
path for it when the backend was chosen automatically, and raise when ``cuda`` was asked for).

The ``ws`` tiles (:data:`WS_TILES`) launch ``qgemm.cu`` instead: MLX affine 4 / 8-bit weights
dequantized in registers on a warp-specialized pipeline (``cuda_src/qgemm.cuh``, docs/bricks.md
"Weights dequantized in registers"); the tuner times them, no rule picks them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.formats import format_of
from mlx_bricks.kernels import KernelSpec, launch, register

#: The split-K passes (CUDA only; the MSL GEMM has no split-K): partial sums, then the reduce.
register(KernelSpec(
    name="gemm_splitk",
    body=None,
    input_names=("x", "w", "scales", "biases"),
    output_names=("partial",),
    cuda_body="gemm_splitk.cu",
    cuda_headers=("mma.cuh", "dequant.cuh", "gemm.cuh", "wgmma.cuh"),
))
register(KernelSpec(
    name="gemm_splitk_reduce",
    body=None,
    input_names=("partial", "bias", "residual"),
    output_names=("y",),
    cuda_body="gemm_splitk_reduce.cu",
    cuda_headers=("mma.cuh",),
))

#: Headers of the register-dequantizing kernels (``qgemm*.cu``; the last one is sm_90a's).
QGEMM_HEADERS = ("mma.cuh", "dequant.cuh", "gemm.cuh", "wgmma.cuh", "qgemm.cuh", "qgemm_ops.cuh",
                 "qgemm_wgmma.cuh")
#: The quantized linear with the weights dequantized in registers (``ws`` tiles).
register(KernelSpec(
    name="qgemm",
    body=None,
    input_names=("x", "w", "scales", "biases", "bias", "residual"),
    output_names=("y",),
    cuda_body="qgemm.cu",
    cuda_headers=QGEMM_HEADERS,
))

#: K per pipeline stage (gemm.cuh GEMM_BK).
BK = 64
#: Dtypes the CUDA twins take (16-bit tensor-core operands).
CUDA_DTYPES = (mx.float16, mx.bfloat16)
#: Dynamic shared memory one block may use, by compute capability (CUDA programming guide,
#: "Compute capabilities": 227 KB on sm_90, 163 KB on sm_80 / sm_87, 99 KB on sm_86 / sm_89 /
#: sm_12x).
SHARED_MEMORY_BY_CAPABILITY = {(9, 0): 227 * 1024, (8, 0): 163 * 1024, (8, 7): 163 * 1024}
DEFAULT_SHARED_MEMORY = 99 * 1024


@dataclass(frozen=True)
class CudaTile:
    """A block tile: BM x BN outputs (per weight operand), WM x WN warps, a STAGES-deep ring;
    ``wgmma``: the sm_90a warpgroup-MMA policy (then WM = BM / 16, WN = 1); ``max_bits``: the
    widest affine format it takes without spilling registers (ptxas -v, tests/test_cuda_compile);
    ``depth``: wgmma groups kept in flight across K steps (1: the tensor cores always have the
    next stage queued, at one stage less of prefetch and a third dequantized tile);
    ``split_k``: K splits (> 1: partial sums of each split in float32, added by a second
    launch; for grids with fewer blocks than SMs); ``ws``: the warp-specialized kernel of
    ``qgemm.cuh`` (affine 4 / 8-bit weights dequantized in registers, :data:`WS_BITS`; 384
    threads; ``stages`` is then the most it takes where shared memory allows, ``wm`` the
    mma.sync warps along the weight rows, ``mi`` the m16 (mma.sync) or m64 (wgmma) blocks per
    warp)."""

    bm: int
    bn: int
    wm: int
    wn: int
    stages: int
    wgmma: bool = False
    max_bits: int = 8
    depth: int = 0
    split_k: int = 1
    ws: bool = False
    mi: int = 1

    @property
    def threads(self) -> int:
        return WS_THREADS if self.ws else self.wm * self.wn * 32


def wgmma_tile(bm: int, bn: int, stages: int = 4, max_bits: int = 8, depth: int = 0,
        split_k: int = 1) -> CudaTile:
    return CudaTile(bm, bn, bm // 16, 1, stages, wgmma=True, max_bits=max_bits, depth=depth,
                    split_k=split_k)


#: Threads of a ``ws`` block (qgemm.cuh kQThreads: 2 consumer warpgroups, 1 producer).
WS_THREADS = 384
#: Affine widths the ``ws`` kernels take.
WS_BITS = (4, 8)


def ws_tile(bm: int, bn: int, *, wgmma: bool, mi: int, wr: int = 1, depth: int = 2,
            stages: int = 8) -> CudaTile:
    """A ``qgemm.cuh`` tile: BM tokens x BN output columns per block (per weight operand)."""
    return CudaTile(bm, bn, wr, 1, stages, wgmma=wgmma, depth=depth if wgmma else 0, ws=True,
                    mi=mi)


def ws_plan(t: CudaTile, bits: int, weight_operands: int = 1,
            cc: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """``(stages, shared memory bytes)`` of ``ws`` tile ``t`` for ``bits``-bit weights on a GPU
    of capability ``cc``: the deepest ring up to ``t.stages`` that fits (``QConfig::SMEM`` of
    qgemm.cuh: the X and packed-W slots or the float output tile reusing them, then the
    mbarriers and the row table, 1024 bytes of alignment), or None below 3 stages."""
    limit = max_shared_memory(device_capability() if cc is None else cc)
    rows = weight_operands * t.bn
    slot = t.bm * 128 + rows * (BK * bits // 8)
    out = weight_operands * t.bm * (t.bn + 4) * 4
    for stages in range(t.stages, 2, -1):
        smem = max(stages * slot, out) + stages * 16 + t.bm * 8 + 1024
        if smem <= limit:
            return stages, smem
    return None


#: Tile variants of the GEMM twin (and of the QKV twin), by name (the ``tile=`` argument).
#: "wg..." tiles use wgmma (sm_90a only); the others mma.sync (sm_80+).
TILES = {
    "128x128": CudaTile(128, 128, 2, 4, 4),
    "128x64": CudaTile(128, 64, 2, 2, 4),
    "64x64": CudaTile(64, 64, 2, 2, 4),
    # 128 accumulators per thread; 8-bit fits since the conversion of dequant.cuh (ptxas:
    # 255 registers, no spills; the float32-built values of before spilled 16 bytes).
    "wg128x256": wgmma_tile(128, 256),
    "wg128x128": wgmma_tile(128, 128),
    # One wgmma group in flight ("d"): the ring prefetches one stage less, so the affine
    # path (dequantized a stage ahead) gets 5 stages where 227 KB allow it ("d5": 4 bits at
    # most; 6-bit needs 237 KB). ptxas: d spills at 6 and 8 bits (136 / 184 bytes).
    "wg128x256d": wgmma_tile(128, 256, max_bits=4, depth=1),
    "wg128x256d5": wgmma_tile(128, 256, stages=5, max_bits=4, depth=1),
    "wg128x128d": wgmma_tile(128, 128, stages=5, depth=1),
}
#: Split-K variants of the linear twin (``k<S>``: S contiguous K splits, partial sums in
#: float32 added in order by ``gemm_splitk_reduce``): for grids with fewer blocks than SMs, e.g.
#: N = 1024 at M = 2048 is 64 tiles of 128 x 256 (128 with k2) on an H200's 132 SMs. Never
#: chosen by the tile rule; the tuner times them (``LINEAR_TILES``).
SPLITK_TILES = {
    # ptxas: 8-bit spills 8 bytes here (the split's range is live next to 128 accumulators).
    "wg128x256k2": wgmma_tile(128, 256, max_bits=6, split_k=2),
    "wg128x128k2": wgmma_tile(128, 128, split_k=2),
    "wg128x128k4": wgmma_tile(128, 128, split_k=4),
    "128x128k2": CudaTile(128, 128, 2, 4, 4, split_k=2),
}
#: The register-dequantizing linear tiles (``qgemm.cu``; affine 4 / 8-bit only), BM tokens x
#: BN weight rows. Never chosen by the tile rule; the tuner times them (``LINEAR_TILES``).
#: ptxas -v (nvcc 13.0, bf16; tests/test_qgemm_compile.py fails on any spill):
#: see docs/bricks.md, "Weights dequantized in registers".
WS_TILES = {
    "qwg256x128": ws_tile(256, 128, wgmma=True, mi=1),
    "qwg128x256": ws_tile(128, 256, wgmma=True, mi=2),
    "qwg128x128": ws_tile(128, 128, wgmma=True, mi=1),
    "qwg64x128": ws_tile(64, 128, wgmma=True, mi=1),
    "qmma128x128": ws_tile(128, 128, wgmma=False, mi=2, wr=4),
}
#: Every tile the linear twin takes (``tile=``; the tuner's listing).
LINEAR_TILES = {**TILES, **SPLITK_TILES, **WS_TILES}
#: Threads per block of every tile. mx.fast.cuda_kernel generates the __global__ signature, so a
#: twin cannot carry __launch_bounds__ and ptxas may use up to 255 registers per thread: 256
#: threads x 255 registers still fit an SM's 64 K registers, 512 would fail to launch. The ``ws``
#: kernels (384 threads) get the bound through their header's __global__ macro (qgemm.cuh).
MAX_THREADS = 256
assert all(t.threads <= MAX_THREADS or t.ws for t in LINEAR_TILES.values())
#: Blocks below which the large tiles leave SMs idle (an H100/H200 has 132 SMs).
MIN_BLOCKS = 132


def device_capability() -> tuple[int, int]:
    """Compute capability of the default GPU ((0, 0) without one)."""
    from mlx_bricks.backends import cuda_capability

    return cuda_capability() or (0, 0)


def max_shared_memory(cc: tuple[int, int]) -> int:
    """Dynamic shared memory a block may use on a GPU of capability ``cc``, bytes."""
    return SHARED_MEMORY_BY_CAPABILITY.get(cc, DEFAULT_SHARED_MEMORY)


def tile_names(tiles: dict = TILES, cc: tuple[int, int] | None = None, weight_operands: int = 1,
               bits: int | None = None) -> tuple[str, ...]:
    """Tiles a GPU of capability ``cc`` (default: this one) can run for a weight format:
    wgmma tiles need sm_90, every tile's shared memory must fit."""
    cc = device_capability() if cc is None else cc
    limit = max_shared_memory(cc)
    # asked on every call of a brick: the answer is kept per table, its tiles (the entry
    # holds both, so no id in the key is reused while it lives) and the limit
    key = (id(tiles), cc, limit, weight_operands, bits)
    hit = _TILE_NAMES.get(key)
    if hit is not None and hit[0] is tiles and len(hit[1]) == len(tiles) and all(
            k == n and t is v for (k, t), (n, v) in zip(hit[1], tiles.items())):
        return hit[2]
    names = tuple(n for n, t in tiles.items()
                  if (not t.wgmma or cc[0] == 9) and (bits or 0) <= t.max_bits
                  and (bits in WS_BITS and ws_plan(t, bits, weight_operands, cc) is not None
                       if t.ws else
                       shared_memory_bytes(t, weight_operands, bits) <= limit))
    if len(_TILE_NAMES) < 256:
        _TILE_NAMES[key] = (tiles, tuple(tiles.items()), names)
    return names


#: :func:`tile_names`' answers: key -> (the tile table, its items, the names).
_TILE_NAMES: dict = {}


def unsupported_reason(dtype) -> str | None:
    """Why the CUDA twins cannot take activations of ``dtype`` (None when they can)."""
    if dtype in CUDA_DTYPES:
        return None
    return (f"the CUDA twins take float16/bfloat16 (tensor cores); {str(dtype).split('.')[-1]} "
            "has no CUDA twin")


def check_dtype(dtype) -> None:
    """Raise NotImplementedError (with "has no CUDA twin") for a dtype without a twin."""
    reason = unsupported_reason(dtype)
    if reason is not None:
        raise NotImplementedError(reason)


def dtype_tile_names(tiles: dict, dtype, weight_operands: int = 1,
                     bits: int | None = None) -> tuple[str, ...]:
    """The tiles of ``tiles`` this GPU runs for activations of ``dtype`` (None: any supported
    dtype) and weights of ``bits`` (None: float): none for a dtype without a twin."""
    if dtype is not None and unsupported_reason(dtype) is not None:
        return ()
    return tile_names(tiles, weight_operands=weight_operands, bits=bits)


def select_tile(M: int, N: int, tiles: dict = TILES, weight_operands: int = 1,
                bits: int | None = None, cc: tuple[int, int] | None = None) -> str:
    """Tile rule (until the tuner decides): among the tiles this GPU can run, wgmma first on
    sm_90, the largest whose grid still fills the SMs, else the smallest."""
    names = tuple(n for n in tile_names(tiles, cc, weight_operands, bits) if not tiles[n].ws)
    if not names:
        raise NotImplementedError("no CUDA tile fits this GPU's shared memory: has no CUDA twin")
    names = sorted(names, key=lambda n: (not tiles[n].wgmma, -tiles[n].bm * tiles[n].bn))
    for name in names:
        t = tiles[name]
        if math.ceil(M / t.bm) * math.ceil(N / t.bn) >= MIN_BLOCKS:
            return name
    return min(names, key=lambda n: (not tiles[n].wgmma, tiles[n].bm * tiles[n].bn))


def shared_memory_bytes(tile: CudaTile, weight_operands: int = 1, bits: int | None = None) -> int:
    """Dynamic shared memory of a block (``GemmSmem`` in gemm.cuh): the A ring and the weight
    ring (16-bit tiles, or packed words plus two dequantized 16-bit tiles for affine weights),
    each rounded up to 1024 bytes, plus 1024 bytes to align the start (``ws`` tiles:
    :func:`ws_plan`)."""
    if tile.ws:
        plan = ws_plan(tile, bits or 0, weight_operands) if bits in WS_BITS else None
        return plan[1] if plan else 1 << 30

    def up(n):
        return -(-n // 1024) * 1024
    rows = weight_operands * tile.bn
    a = up(tile.stages * tile.bm * BK * 2)
    if not bits:
        return a + up(tile.stages * rows * BK * 2) + 1024
    dq_tiles = 2 + tile.depth
    return a + up(tile.stages * rows * (BK * bits // 32) * 4) + dq_tiles * rows * BK * 2 + 1024


def pick_tile(tiles: dict, tile: str | None, M: int, N: int, weight_operands: int = 1,
              bits: int | None = None) -> CudaTile:
    """Tile ``tile`` of ``tiles`` (None: :func:`select_tile`) for an (M, N) output with
    ``weight_operands`` weights per stage of width ``bits``.

    Raises:
        ValueError: an unknown tile, or one that takes narrower affine weights.
    """
    if tile is None:
        tile = select_tile(M, N, tiles, weight_operands, bits)
    if tile not in tiles:
        raise ValueError(f"tile must be None or, on cuda, one of {sorted(tiles)}, got {tile!r}")
    if (bits or 0) > tiles[tile].max_bits:
        raise ValueError(f"tile {tile!r} takes affine weights of at most {tiles[tile].max_bits} "
                         f"bits, got {bits}")
    if tiles[tile].ws and bits not in WS_BITS:
        raise ValueError(f"tile {tile!r} takes {'/'.join(map(str, WS_BITS))}-bit affine weights, "
                         f"got {bits or 'a float weight'}")
    return tiles[tile]


def grid_of(tile: CudaTile, M: int, N: int):
    """``(grid, threadgroup)`` of a one-block-per-output-tile launch."""
    blocks = math.ceil(M / tile.bm) * math.ceil(N / tile.bn)
    return (blocks * tile.threads, 1, 1), (tile.threads, 1, 1)


def as_rows(x, K):
    """x as a row-contiguous (M, K) matrix (a free reshape for contiguous inputs)."""
    return mx.contiguous(x.reshape(-1, K))


def weight_triple(weight, dtype, name: str = "weight"):
    """``((w, scales, biases), bits, group_size)`` as the GEMM twins take a weight: a float
    weight is ``(weight, weight, weight)`` with bits 0 (scales / biases are placeholders never
    read, of the activation dtype as the generated signature needs), an affine one its arrays.

    Raises:
        TypeError: a float weight or affine scales of another dtype than the activations.
    """
    return format_of(weight).cuda_inputs(weight, dtype, name)


def smem_of(tile: CudaTile, bits_list, weight_operands: int = 1) -> int:
    """Dynamic shared memory of ``tile`` for the widest of the weights' ``bits_list``."""
    return max(shared_memory_bytes(tile, weight_operands, b or None) for b in bits_list)


def geometry(t: CudaTile, dtype) -> list:
    """The template arguments every kernel on gemm.cuh takes for tile ``t``."""
    return [("T", dtype), ("BM", t.bm), ("BN", t.bn), ("WM", t.wm), ("WN", t.wn),
            ("STAGES", t.stages), ("WGMMA", t.wgmma), ("DEPTH", t.depth)]


def gemm_launch(x2, triple, bits, gs, bias, residual, t: CudaTile, swiglu_up: bool = False,
                act: int = 0):
    """One launch of ``gemm.cu`` on (M, K) rows ``x2`` and a weight ``triple``
    (:func:`weight_triple`); ``swiglu_up``: ``residual`` is the split SwiGLU's up, the epilogue
    writes ``act(gate) * up``."""
    M, K = x2.shape
    N = triple[0].shape[0]
    grid, tg = grid_of(t, M, N)
    ph = triple[1]  # a placeholder of the activation dtype
    (y,) = launch(
        "gemm", "cuda",
        inputs=[x2, *triple, ph if bias is None else mx.contiguous(bias),
                ph if residual is None else residual],
        template=geometry(t, x2.dtype) + [
            ("BITS", bits), ("GS", gs), ("HAS_BIAS", bias is not None),
            ("HAS_RESIDUAL", residual is not None and not swiglu_up),
            ("SWIGLU_UP", swiglu_up), ("ACT", act)],
        grid=grid, threadgroup=tg, output_shapes=[(M, N)], output_dtypes=[x2.dtype],
        shared_memory=smem_of(t, [bits]),
    )
    return y


def ws_geometry(t: CudaTile, dtype, bits: int, gs: int, weight_operands: int = 1):
    """``(template, shared memory)`` every ``qgemm*.cu`` launch of tile ``t`` takes."""
    plan = ws_plan(t, bits, weight_operands)
    if plan is None:
        raise NotImplementedError(f"tile needs more shared memory than this GPU has: has no "
                                  f"CUDA twin for {bits}-bit weights")
    stages, smem = plan
    return [("T", dtype), ("BM", t.bm), ("BN", t.bn * weight_operands), ("STAGES", stages),
            ("WGMMA", t.wgmma), ("MI", t.mi), ("WR", t.wm), ("DEPTH", t.depth),
            ("BITS", bits), ("GS", gs)], smem


def ws_grid(t: CudaTile, M: int, N: int):
    """``(grid, threadgroup)`` of a ``qgemm*.cu`` launch: one 384-thread block per output
    tile."""
    blocks = math.ceil(M / t.bm) * math.ceil(N / t.bn)
    return (blocks * WS_THREADS, 1, 1), (WS_THREADS, 1, 1)


def qgemm_launch(x2, triple, bits, gs, bias, residual, t: CudaTile):
    """One launch of ``qgemm.cu`` (affine weight dequantized in registers)."""
    M, K = x2.shape
    N = triple[0].shape[0]
    template, smem = ws_geometry(t, x2.dtype, bits, gs)
    grid, tg = ws_grid(t, M, N)
    ph = triple[1]
    (y,) = launch(
        "qgemm", "cuda",
        inputs=[x2, *triple, ph if bias is None else mx.contiguous(bias),
                ph if residual is None else residual],
        template=template + [("HAS_BIAS", bias is not None),
                             ("HAS_RESIDUAL", residual is not None)],
        grid=grid, threadgroup=tg, output_shapes=[(M, N)], output_dtypes=[x2.dtype],
        shared_memory=smem,
    )
    return y


def gemm_splitk_launch(x2, triple, bits, gs, bias, residual, t: CudaTile):
    """The split-K linear: ``gemm_splitk`` (t.split_k float32 partial products), then
    ``gemm_splitk_reduce`` (their sum in order, bias, residual, one rounding)."""
    M, K = x2.shape
    N = triple[0].shape[0]
    S = t.split_k
    grid, tg = grid_of(t, M, N)
    (partial,) = launch(
        "gemm_splitk", "cuda", inputs=[x2, *triple],
        template=geometry(t, x2.dtype) + [("BITS", bits), ("GS", gs), ("SPLIT", S)],
        grid=(grid[0] * S, 1, 1), threadgroup=tg, output_shapes=[(S, M, N)],
        output_dtypes=[mx.float32], shared_memory=smem_of(t, [bits]),
    )
    ph = triple[1]
    threads = 256
    (y,) = launch(
        "gemm_splitk_reduce", "cuda",
        inputs=[partial, ph if bias is None else mx.contiguous(bias),
                ph if residual is None else residual],
        template=[("T", x2.dtype), ("SPLIT", S), ("HAS_BIAS", bias is not None),
                  ("HAS_RESIDUAL", residual is not None)],
        grid=(math.ceil(M * N / threads) * threads, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(M, N)], output_dtypes=[x2.dtype],
    )
    return y


def linear(x, weight, bias=None, residual=None, *, tile=None):
    """The GEMM twin: ``x @ weight.T (+ bias) (+ residual)``, weight float or
    :class:`~mlx_bricks.formats.affine.QuantizedWeight`. Arguments already validated by
    ``ops.linear``; M = prod(x.shape[:-1]) >= 1, N >= 1.

    Raises:
        NotImplementedError: float32 activations (no CUDA twin).
        ValueError: an unknown ``tile``.
        TypeError: affine scales of another dtype than x.
    """
    check_dtype(x.dtype)
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = as_rows(x, K)
    M = x2.shape[0]
    triple, bits, gs = weight_triple(weight, x.dtype)
    t = pick_tile(TILES if tile is None else LINEAR_TILES, tile, M, N, 1, bits)
    res = None if residual is None else mx.contiguous(residual.reshape(M, N))
    if t.ws:
        y = qgemm_launch(x2, triple, bits, gs, bias, res, t)
    elif t.split_k > 1:
        y = gemm_splitk_launch(x2, triple, bits, gs, bias, res, t)
    else:
        y = gemm_launch(x2, triple, bits, gs, bias, res, t)
    return y.reshape(*x.shape[:-1], N)
