"""The GEMM brick's MSL kernel (bricks 1 and 2: the tiled GEMM and its ingestion pipeline) for
nn.Linear layout, ``y = x @ weight.T (+ bias) (+ residual)``: spec, tiles, plan and launch.

The kernel (``metal_src/gemm.metal`` on the shared pipeline in ``metal_src/gemm.h``) computes one
BM x BN output tile per threadgroup of 4 simdgroups with 8x8 ``simdgroup_matrix<float>``
accumulators, loading K in steps of BK through two ping-pong threadgroup buffers (or one: the
``*_sb`` tiles; ``*_bk16``: BK = 16; ``*_sh``: scheduling hints between fragment loads and
MMAs). The weight is a float array or an MLX affine-quantized
:class:`~mlx_bricks.formats.affine.QuantizedWeight`, dequantized tile by tile into threadgroup memory
by the pipeline's affine loader. The tiling, the tile rule and the threadgroup memory of each
variant are in ``docs/bricks.md``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.formats import format_of
from mlx_bricks.kernels import KernelSpec, launch, register

register(KernelSpec(
    name="gemm",
    body="gemm.metal",
    # scales/biases: the affine weight's (placeholders for a float weight, never read).
    input_names=("x", "weight", "scales", "biases", "bias", "residual"),
    output_names=("y",),
    headers=("gemm.h",),
    # x is read through x_strides, so views of x are not copied.
    ensure_row_contiguous=False,
    # The twin takes the weight as a (w, scales, biases) triple: float or MLX affine.
    cuda_body="gemm.cu",
    cuda_headers=("mma.cuh", "dequant.cuh", "gemm.cuh", "wgmma.cuh"),
    cuda_input_names=("x", "w", "scales", "biases", "bias", "residual"),
))

#: Threadgroup memory every GEMM variant must fit in (bytes).
THREADGROUP_MEMORY_LIMIT = 32 * 1024
#: Below this many 64x64 threadgroups, the 32x32 tile is used so more GPU cores get work
#: (an M4 Max has 40 cores; a heuristic, not a measurement).
MIN_THREADGROUPS_64 = 32
#: Bytes of one global load / threadgroup chunk.
VECTOR_BYTES = 16
#: Bytes of K per threadgroup tile row: BK = K_TILE_BYTES / itemsize (32 fp16/bf16, 16 fp32).
K_TILE_BYTES = 64
#: Row pitch padding of the threadgroup tiles, in 128-bit chunks (PAD = this * 16 / itemsize).
PAD_CHUNKS = 1


@dataclass(frozen=True)
class GemmTile:
    """A tile variant: a BM x BN output tile per threadgroup of WM x WN simdgroups, with
    ``stages`` threadgroup buffers per operand (2: ping-pong, the loads of the next K step
    overlap the MMAs with one barrier per step; 1: single buffer, half the threadgroup memory,
    two barriers per step), ``bk`` elements of K per step (None: ``K_TILE_BYTES`` of the
    dtype, 32 for float16/bfloat16 and 16 for float32), and ``sched``: ``simdgroup_barrier(
    mem_none)`` scheduling hints between the fragment loads and the MMAs of each 8-wide K slice
    (as MLX's steel GEMM places them)."""

    bm: int
    bn: int
    wm: int = 2
    wn: int = 2
    stages: int = 2
    bk: int | None = None
    sched: bool = False

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32

    @property
    def name(self) -> str:
        bk = f"_bk{self.bk}" if self.bk else ""
        sb = "_sb" if self.stages == 1 else ""
        sh = "_sh" if self.sched else ""
        return f"bm{self.bm}_bn{self.bn}_wm{self.wm}_wn{self.wn}{bk}{sb}{sh}"

    def k_step(self, itemsize: int) -> int:
        """BK for elements of ``itemsize`` bytes."""
        return self.bk or K_TILE_BYTES // itemsize


#: Suffix of the single-buffered form of a tile name ("64x64" -> "64x64_sb").
SINGLE_BUFFER_SUFFIX = "_sb"
#: Suffix of a tile with BK = 16 ("64x64_bk16": a quarter of the 16-bit tile's 20 KB of
#: threadgroup memory single-buffered, as MLX's 64x64x16 steel tile; the float32 default).
BK16_SUFFIX = "_bk16"
#: Suffix of a tile with scheduling hints ("64x64_sh").
SCHED_SUFFIX = "_sh"


def with_single_buffer(tiles: dict) -> dict:
    """``tiles`` plus the single-buffered form of each (``name + "_sb"``, ``stages=1``)."""
    out = dict(tiles)
    for key, t in tiles.items():
        out[key + SINGLE_BUFFER_SUFFIX] = dataclasses.replace(t, stages=1)
    return out


def with_variants(tiles: dict) -> dict:
    """``tiles`` with every pipeline variant of each: BK = 16 (``"_bk16"``), single-buffered
    (``"_sb"``) and scheduling hints (``"_sh"``), in that order in the names
    (``"64x64_bk16_sb_sh"``)."""
    out = {}
    for key, t in tiles.items():
        for bk in (None, 16):
            base = dataclasses.replace(t, bk=bk)
            name = key + (BK16_SUFFIX if bk else "")
            for k2, t2 in with_single_buffer({name: base}).items():
                out[k2] = t2
                out[k2 + SCHED_SUFFIX] = dataclasses.replace(t2, sched=True)
    return out


def msl_tile_names(tiles: dict, dtype=None) -> tuple[str, ...]:
    """The names of ``tiles`` that are distinct kernels for ``dtype`` (None: all): a BK = 16
    tile is the float32 default (16) already, so float32 lists it once, without ``"_bk16"``."""
    if dtype is None or K_TILE_BYTES // dtype.size != 16:
        return tuple(tiles)
    return tuple(n for n, t in tiles.items() if t.bk != 16)


#: The variants: the main 64x64 tile (32x32 per simdgroup) and the small 32x32 tile (16x16 per
#: simdgroup) for small M or N; the rule picks the double-buffered BK = 64 bytes form of one
#: (docs/bricks.md), the tuner measures all of them: double- or single-buffered (``_sb``), BK
#: = 16 (``_bk16``), with or without scheduling hints (``_sh``).
TILES = with_variants({"64x64": GemmTile(64, 64), "32x32": GemmTile(32, 32)})


@dataclass(frozen=True)
class GemmPlan:
    """Everything a GEMM launch needs, computed from the shape (see :func:`plan_gemm`)."""

    tile: GemmTile
    bk: int
    pad: int
    vec: bool
    align_mn: bool
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    threadgroup_bytes: int

    def template(self, dtype, **flags) -> list:
        """Template arguments shared by the kernels built on ``gemm.h`` (T, BM, BN, BK, WM, WN,
        PAD, VEC, ALIGN_MN, STAGES, SCHED), then the kernel's own ``flags`` in order
        (``HAS_BIAS=True``...)."""
        t = self.tile
        return [("T", dtype), ("BM", t.bm), ("BN", t.bn), ("BK", self.bk), ("WM", t.wm),
                ("WN", t.wn), ("PAD", self.pad), ("VEC", self.vec),
                ("ALIGN_MN", self.align_mn), ("STAGES", t.stages), ("SCHED", t.sched),
                *flags.items()]


def select_tile(M: int, N: int) -> str:
    """The tile rule: ``"64x64"`` when M > 32, N > 32 and the 64x64 grid has at least
    ``MIN_THREADGROUPS_64`` threadgroups; ``"32x32"`` otherwise (a 64-wide tile would be mostly
    padding, or too few threadgroups would leave GPU cores idle)."""
    if M > 32 and N > 32 and math.ceil(M / 64) * math.ceil(N / 64) >= MIN_THREADGROUPS_64:
        return "64x64"
    return "32x32"


def threadgroup_memory_bytes(tile: GemmTile, bk: int, pad: int, itemsize: int,
                             weight_tiles: int = 1) -> int:
    """Bytes of the A and B buffers:
    ``stages * (BM + weight_tiles * BN) * (BK + PAD) * itemsize`` (``weight_tiles`` is 2 when a
    kernel stages two weights per K step, as the fused SwiGLU does with gate and up). A
    quantized weight is dequantized into the same B tiles (in the activations' dtype), so the
    figure does not depend on the weight format."""
    return tile.stages * (tile.bm + weight_tiles * tile.bn) * (bk + pad) * itemsize


def plan_gemm(M: int, N: int, K: int, dtype, *, tile: str | None = None,
              pad_chunks: int | None = None, tiles: dict | None = None,
              weight_tiles: int = 1, group_size: int | None = None) -> GemmPlan:
    """Tile variant, template values and launch geometry of an (M, N, K) GEMM.

    Args:
        M, N, K: problem size (each >= 1).
        dtype: float16, bfloat16 or float32 (the activations', and the tiles', dtype).
        tile: ``None`` (:func:`select_tile`) or a key of ``tiles``.
        pad_chunks: row pitch padding in 128-bit chunks (``None``: ``PAD_CHUNKS``); whole
            chunks keep every threadgroup row 16-byte aligned.
        tiles: the tile table ``tile`` names (default :data:`TILES`; kernels built on
            ``gemm.h`` with other tiles pass theirs, and then must name ``tile``).
        weight_tiles: BN-row weight tiles staged per K step (see
            :func:`threadgroup_memory_bytes`).
        group_size: the affine group size of a quantized weight (None for a float weight):
            the affine loader needs BK to divide it, so that no K step crosses a group.

    Raises:
        ValueError: unknown ``tile`` or a negative ``pad_chunks``.
        RuntimeError: the variant would need more than ``THREADGROUP_MEMORY_LIMIT`` bytes of
            threadgroup memory, or BK does not divide ``group_size`` (bugs in the tile table,
            checked at every launch).
    """
    tiles = TILES if tiles is None else tiles
    if tile is None and tiles is TILES:
        tile = select_tile(M, N)
    if tile not in tiles:
        raise ValueError(f"tile must be None or one of {sorted(tiles)}, got {tile!r}")
    t = tiles[tile]
    itemsize = dtype.size
    vw = VECTOR_BYTES // itemsize
    bk = t.k_step(itemsize)
    pad_chunks = PAD_CHUNKS if pad_chunks is None else pad_chunks
    if isinstance(pad_chunks, bool) or not isinstance(pad_chunks, int) or pad_chunks < 0:
        raise ValueError(f"pad_chunks must be an int >= 0, got {pad_chunks!r}")
    pad = pad_chunks * vw
    tg_bytes = threadgroup_memory_bytes(t, bk, pad, itemsize, weight_tiles)
    if tg_bytes > THREADGROUP_MEMORY_LIMIT:
        raise RuntimeError(
            f"tile variant {t.name}_bk{bk} needs {tg_bytes} bytes of threadgroup memory, "
            f"over the {THREADGROUP_MEMORY_LIMIT}-byte limit"
        )
    if group_size is not None and group_size % bk:
        raise RuntimeError(f"tile variant {t.name}_bk{bk}: BK={bk} does not divide the affine "
                           f"group_size {group_size}")
    tiles_m, tiles_n = math.ceil(M / t.bm), math.ceil(N / t.bn)
    return GemmPlan(
        tile=t, bk=bk, pad=pad, vec=K % vw == 0,
        align_mn=M % t.bm == 0 and N % t.bn == 0,
        grid=(tiles_n * t.threads, tiles_m, 1), threadgroup=(t.threads, 1, 1),
        threadgroup_bytes=tg_bytes,
    )


def launch_gemm(x, weight, bias, residual, plan: GemmPlan, backend: str):
    """Launch the GEMM kernel with an explicit ``plan`` (what ``op.linear`` does after its
    checks; benchmarks use it to try other pitches). Arguments as in ``op.linear``, already
    validated (``weight`` an ``mx.array`` or a ``QuantizedWeight``); ``backend`` is
    ``"metal"`` or ``"emulator"``; M = prod(x.shape[:-1]) >= 1."""
    N = weight.shape[0]
    M = math.prod(x.shape[:-1])
    w_inputs, w_flags = format_of(weight).msl_inputs(weight)
    # Absent bias/residual: the kernel is compiled without them; the second weight input
    # (scales, or the float weight itself: x's dtype either way) stands in.
    placeholder = w_inputs[1]
    bias_in = placeholder if bias is None else mx.contiguous(bias)
    residual_in = placeholder if residual is None else mx.contiguous(residual)
    (y,) = launch(
        "gemm", backend,
        inputs=[x, *w_inputs, bias_in, residual_in],
        template=plan.template(x.dtype, HAS_BIAS=bias is not None,
                               HAS_RESIDUAL=residual is not None, **w_flags),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], N)
