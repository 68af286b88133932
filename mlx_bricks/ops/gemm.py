"""Bricks 1 and 2: tiled GEMM for nn.Linear layout, ``y = x @ weight.T (+ bias) (+ residual)``.

The kernel (``metal_src/gemm.metal`` on the shared pipeline in ``metal_src/gemm.h``) computes one
BM x BN output tile per threadgroup of 4 simdgroups with 8x8 ``simdgroup_matrix<float>``
accumulators, loading K in steps of BK through two ping-pong threadgroup buffers. The tiling,
the tile rule and the threadgroup memory of each variant are in ``docs/bricks.md``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks.backends import resolve_backend
from mlx_bricks.kernels import KernelSpec, launch, register
from mlx_bricks.ops import gemm_cuda
from mlx_bricks.ops.gemm_cuda import cuda_or
from mlx_bricks.ops._checks import (
    check_array,
    check_float_dtype,
    check_k,
    check_linear_weight,
    check_same_dtype,
)
from mlx_bricks.ops._variants import kernel_variants

register(KernelSpec(
    name="gemm",
    body="gemm.metal",
    input_names=("x", "weight", "bias", "residual"),
    output_names=("y",),
    headers=("gemm.h",),
    # x is read through x_strides, so views of x are not copied.
    ensure_row_contiguous=False,
    # The twin takes the weight as a (w, scales, biases) triple: float or MLX affine.
    cuda_body="gemm.cu",
    cuda_headers=("mma.cuh", "gemm.cuh", "wgmma.cuh"),
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
    """A tile variant: a BM x BN output tile per threadgroup of WM x WN simdgroups."""

    bm: int
    bn: int
    wm: int = 2
    wn: int = 2

    @property
    def threads(self) -> int:
        return self.wm * self.wn * 32

    @property
    def name(self) -> str:
        return f"bm{self.bm}_bn{self.bn}_wm{self.wm}_wn{self.wn}"


#: The two variants: the main 64x64 tile (32x32 per simdgroup) and the small 32x32 tile
#: (16x16 per simdgroup) for small M or N.
TILES = {"64x64": GemmTile(64, 64), "32x32": GemmTile(32, 32)}


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
        PAD, VEC, ALIGN_MN), then the kernel's own ``flags`` in order (``HAS_BIAS=True``...)."""
        t = self.tile
        return [("T", dtype), ("BM", t.bm), ("BN", t.bn), ("BK", self.bk), ("WM", t.wm),
                ("WN", t.wn), ("PAD", self.pad), ("VEC", self.vec),
                ("ALIGN_MN", self.align_mn), *flags.items()]


def tile_names(backend: str, dtype=None) -> tuple[str, ...]:
    """The names :func:`linear` accepts as ``tile=`` on ``backend`` for activations of
    ``dtype`` (None: any): the variants the tuner (``mlx_bricks.tune``) times against stock.
    MSL backends: :data:`TILES`; ``cuda``: the twin's tiles this GPU can run
    (``gemm_cuda.tile_names``), none for a dtype without a twin (float32); ``reference``: none
    (it runs MLX ops).

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    return kernel_variants(backend, "gemm", tuple(TILES),
                           cuda_names=lambda: gemm_cuda_tiles(gemm_cuda.TILES, dtype))


def gemm_cuda_tiles(tiles: dict, dtype, weight_operands: int = 1) -> tuple[str, ...]:
    """The CUDA tiles of ``tiles`` this GPU runs for ``dtype`` (None: any supported dtype)."""
    if dtype is not None and gemm_cuda.unsupported_reason(dtype) is not None:
        return ()
    return gemm_cuda.tile_names(tiles, weight_operands=weight_operands)


def select_tile(M: int, N: int) -> str:
    """The tile rule: ``"64x64"`` when M > 32, N > 32 and the 64x64 grid has at least
    ``MIN_THREADGROUPS_64`` threadgroups; ``"32x32"`` otherwise (a 64-wide tile would be mostly
    padding, or too few threadgroups would leave GPU cores idle)."""
    if M > 32 and N > 32 and math.ceil(M / 64) * math.ceil(N / 64) >= MIN_THREADGROUPS_64:
        return "64x64"
    return "32x32"


def threadgroup_memory_bytes(tile: GemmTile, bk: int, pad: int, itemsize: int,
                             weight_tiles: int = 1) -> int:
    """Bytes of the ping-pong A and B buffers:
    ``2 * (BM + weight_tiles * BN) * (BK + PAD) * itemsize`` (``weight_tiles`` is 2 when a
    kernel stages two weights per K step, as the fused SwiGLU does with gate and up)."""
    return 2 * (tile.bm + weight_tiles * tile.bn) * (bk + pad) * itemsize


def plan_gemm(M: int, N: int, K: int, dtype, *, tile: str | None = None,
              pad_chunks: int | None = None, tiles: dict | None = None,
              weight_tiles: int = 1) -> GemmPlan:
    """Tile variant, template values and launch geometry of an (M, N, K) GEMM.

    Args:
        M, N, K: problem size (each >= 1).
        dtype: float16, bfloat16 or float32.
        tile: ``None`` (:func:`select_tile`), ``"64x64"`` or ``"32x32"``.
        pad_chunks: row pitch padding in 128-bit chunks (``None``: ``PAD_CHUNKS``); whole
            chunks keep every threadgroup row 16-byte aligned.
        tiles: the tile table ``tile`` names (default :data:`TILES`; kernels built on
            ``gemm.h`` with other tiles pass theirs, and then must name ``tile``).
        weight_tiles: BN-row weight tiles staged per K step (see
            :func:`threadgroup_memory_bytes`).

    Raises:
        ValueError: unknown ``tile`` or a negative ``pad_chunks``.
        RuntimeError: the variant would need more than ``THREADGROUP_MEMORY_LIMIT`` bytes of
            threadgroup memory (a bug in the tile table, checked at every launch).
    """
    tiles = TILES if tiles is None else tiles
    if tile is None and tiles is TILES:
        tile = select_tile(M, N)
    if tile not in tiles:
        raise ValueError(f"tile must be None or one of {sorted(tiles)}, got {tile!r}")
    t = tiles[tile]
    itemsize = dtype.size
    vw = VECTOR_BYTES // itemsize
    bk = K_TILE_BYTES // itemsize
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
    tiles_m, tiles_n = math.ceil(M / t.bm), math.ceil(N / t.bn)
    return GemmPlan(
        tile=t, bk=bk, pad=pad, vec=K % vw == 0,
        align_mn=M % t.bm == 0 and N % t.bn == 0,
        grid=(tiles_n * t.threads, tiles_m, 1), threadgroup=(t.threads, 1, 1),
        threadgroup_bytes=tg_bytes,
    )


def linear_reference(x, weight, bias=None, residual=None):
    """Reference of :func:`linear` in MLX ops (what the ``reference`` backend runs)."""
    y = x @ weight.T
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    return y


def _check_linear(x, weight, bias, residual):
    check_array("x", x, min_ndim=1)
    check_array("weight", weight, ndim=2)
    check_float_dtype("x", x)
    check_same_dtype("x", x, weight=weight, bias=bias, residual=residual)
    K = check_k(x)
    check_linear_weight("weight", weight, K)
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


def linear(x, weight, bias=None, residual=None, *, tile=None, backend=None):
    """``y = x @ weight.T (+ bias) (+ residual)`` on the GEMM brick.

    Algorithm: tiled GEMM on 8x8 ``simdgroup_matrix`` fragments with float accumulators, 128-bit
    global loads into ping-pong threadgroup buffers, bias and residual added in the epilogue
    (the structure of MLX's steel GEMM; see ``docs/bricks.md``).

    Args:
        x: (..., K) float16, bfloat16 or float32, K >= 1; M is the product of the leading dims
            (M = 0 or N = 0 give an empty result without a launch). Read through its strides:
            views (slices, transposes, broadcasts) are not copied.
        weight: (N, K), same dtype, as ``nn.Linear`` stores it.
        bias: optional (N,), same dtype.
        residual: optional (..., N) (the output shape), same dtype; added in the epilogue.
        tile: ``None`` (the rule of :func:`select_tile`), ``"64x64"`` or ``"32x32"``.
        backend: ``None`` (auto), ``"metal"``, ``"emulator"``, ``"reference"``
            (see ``mlx_bricks.backends``).

    Returns:
        (..., N) array of x's dtype; products summed in float32, bias and residual added in
        float32, one rounding to the output dtype.

    Copies: weight, bias and residual are copied only when they are not row-contiguous
    (``mx.contiguous``); nn.Linear weights never are.

    Raises:
        TypeError: non-array arguments, non-float dtypes, or mixed dtypes.
        ValueError: shapes that do not match, an unknown ``tile``, or a bad backend.
        NotImplementedError: backend ``cuda`` (no CUDA twin yet).
    """
    _check_linear(x, weight, bias, residual)
    name = cuda_or(backend, x.dtype)
    if name != "cuda" and tile is not None and tile not in TILES:
        raise ValueError(f"tile must be None or one of {sorted(TILES)}, got {tile!r}")
    if name == "reference":
        return linear_reference(x, weight, bias, residual)
    N, K = weight.shape
    out_shape = (*x.shape[:-1], N)
    M = math.prod(x.shape[:-1])
    if M == 0 or N == 0:
        return mx.zeros(out_shape, dtype=x.dtype)
    if name == "cuda":
        return gemm_cuda.linear(x, weight, bias, residual, tile=tile)
    plan = plan_gemm(M, N, K, x.dtype, tile=tile)
    return launch_gemm(x, weight, bias, residual, plan, name)


def launch_gemm(x, weight, bias, residual, plan: GemmPlan, backend: str):
    """Launch the GEMM kernel with an explicit ``plan`` (what :func:`linear` does after its
    checks; benchmarks use it to try other pitches). Arguments as in :func:`linear`, already
    validated; ``backend`` is ``"metal"`` or ``"emulator"``; M = prod(x.shape[:-1]) >= 1."""
    N = weight.shape[0]
    M = math.prod(x.shape[:-1])
    weight = mx.contiguous(weight)
    # Absent bias/residual: the kernel is compiled without them; weight is a placeholder buffer.
    bias_in = weight if bias is None else mx.contiguous(bias)
    residual_in = weight if residual is None else mx.contiguous(residual)
    (y,) = launch(
        "gemm", backend,
        inputs=[x, weight, bias_in, residual_in],
        template=plan.template(x.dtype, HAS_BIAS=bias is not None,
                               HAS_RESIDUAL=residual is not None),
        grid=plan.grid,
        threadgroup=plan.threadgroup,
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
    )
    return y.reshape(*x.shape[:-1], N)
