"""The CUDA twin of the attention brick: tile variants, shared memory and the launch.

The kernel (``cuda_src/attention.cu`` + ``cuda_src/attention.cuh``) is FlashAttention-2 (Dao,
2023) on ``mma.sync`` m16n8k16 tensor-core instructions (fp16/bf16) or float32 FFMA (float32):
a block of 4 warps (8 for head_dim 512) takes ``BQ = 64 * MT`` query rows of one (batch, head),
K/V tiles of ``BK`` keys stream through shared memory by ``cp.async``, the softmax is rescaled
online in float32 registers. :func:`smem_bytes` mirrors the kernel's shared-memory layout
(``Config`` in attention.cuh; the kernel traps if launched with less).

The fast family (``cuda_src/attention_fa.cu``, bottom half of this module): 16-bit q/k/v,
head_dim 64 / 128 / 192 / 256 (Dv may differ from Dq), FlashAttention-2 on ``mma.sync`` warps
(sm_80+) or on ``wgmma`` warpgroups (sm_90a) with an NS-stage cp.async ring into
128-byte-swizzled tiles; :data:`_FA_TILES` is its tile table (docs/bricks.md, with the H100
measurements), :func:`launch_attention_fa` its launch.

This module has no argument checks: ``mlx_bricks.bricks.attention.msl.flash_attention`` validates and
dispatches here for the ``cuda`` backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_bricks import kernels
from mlx_bricks.bricks.gemm import cuda as gemm_cuda
from mlx_bricks.checks import dtype_name
from mlx_bricks.bricks.gemm.cuda import max_shared_memory
from mlx_bricks.bricks.attention.msl import sinks_input

#: Head dims the CUDA twin supports.
CUDA_HEAD_DIMS = (64, 80, 96, 128, 192, 256, 512)
#: Shared memory per block on Hopper (sm_90), bytes: what the variants are sized for.
HOPPER_SMEM_LIMIT = max_shared_memory((9, 0))


@dataclass(frozen=True)
class CudaTile:
    """One tile variant of the CUDA attention kernel.

    Attributes:
        bk: keys per K/V tile (multiple of 16).
        mt: m16 tiles per warp (1 or 2): a block takes ``64 * mt`` query rows.
        qreg: Q's mma fragments stay in registers for the whole key loop (fp16/bf16, D <= 128);
            otherwise they are re-read from shared memory by ldmatrix per k-chunk.
    """

    bk: int
    mt: int
    qreg: bool

    @property
    def name(self) -> str:
        """Variant name for the tuner, e.g. ``bk64_mt1_qreg``."""
        return f"bk{self.bk}_mt{self.mt}{'_qreg' if self.qreg else ''}"


# Variants per head_dim, default first. Registers (ptxas, sm_90a, all flags on) are in
# docs/bricks.md; every one listed here compiles without spills (tests/test_attention_cuda.py).
_VARIANTS_16 = {
    64: (CudaTile(32, 2, True), CudaTile(64, 1, True)),
    80: (CudaTile(64, 1, True), CudaTile(32, 2, True)),
    96: (CudaTile(64, 1, True), CudaTile(32, 2, False)),
    128: (CudaTile(64, 1, True), CudaTile(64, 1, False)),
    192: (CudaTile(64, 1, False), CudaTile(32, 1, False)),
    256: (CudaTile(32, 1, False), CudaTile(64, 1, False)),
    512: (CudaTile(32, 1, False), CudaTile(16, 1, False)),
}
_VARIANTS_32 = {D: (CudaTile(16 if D == 512 else 32, 1, False),) for D in CUDA_HEAD_DIMS}


def variants(head_dim: int, dtype) -> list[CudaTile]:
    """Tile variants of the kernel for ``head_dim`` and q's dtype, the default first.

    Raises:
        ValueError: head_dim not in ``CUDA_HEAD_DIMS``.
    """
    if head_dim not in CUDA_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} has no CUDA attention variant; "
                         f"supported: {', '.join(map(str, CUDA_HEAD_DIMS))}")
    table = _VARIANTS_32 if dtype == mx.float32 else _VARIANTS_16
    return list(table[head_dim])


def threads(head_dim: int) -> int:
    """Threads per block: 4 warps, 8 for head_dim 512 (two warps per row group)."""
    return 256 if head_dim > 256 else 128


def smem_bytes(head_dim: int, dtype, tile: CudaTile, kv_q8: bool) -> int:
    """Dynamic shared memory of one variant, bytes (``Config::SMEM`` in attention.cuh).

    Q tile ``64 MT x (D + pad)``, K and V tiles ``BK x (D + pad)`` (pad = 16 bytes a row), the
    Q8_0 code tiles ``BK x D`` int8 each, for D = 512 one partial-S tile per warp
    (``16 MT x BK`` float) and for float32 one P tile per warp (``16 x (BK + 2)`` float).
    """
    D, bk, mt = head_dim, tile.bk, tile.mt
    e = dtype.size
    lds = D + 16 // e
    nsplit = 2 if D > 256 else 1
    nw = 4 * nsplit
    n = 64 * mt * lds * e + 2 * bk * lds * e
    if kv_q8:
        n += 2 * bk * D
    if nsplit > 1:
        n += nw * mt * bk * 16 * 4
    if e == 4:
        n += nw * 16 * (bk + 2) * 4
    return n


def device_smem_limit() -> int:
    """Shared memory per block of the default CUDA device (``gemm_cuda.max_shared_memory``);
    Hopper's without a GPU (compile checks drive the launcher as if on an H200)."""
    cc = gemm_cuda.device_capability()
    return max_shared_memory(cc if cc != (0, 0) else (9, 0))


def pick_tile(head_dim: int, dtype, kv_q8: bool, variant: str | None = None,
              smem_limit: int | None = None) -> CudaTile:
    """The variant to launch: ``variant`` by name, else the first (default-first order) whose
    shared memory fits ``smem_limit`` (default: the device's).

    Raises:
        ValueError: unknown variant name, or no variant fits.
    """
    limit = device_smem_limit() if smem_limit is None else smem_limit
    options = variants(head_dim, dtype)
    if variant is not None:
        named = [t for t in options if t.name == variant]
        if not named:
            raise ValueError(f"variant {variant!r} is not one of "
                             f"{', '.join(t.name for t in options)} for head_dim {head_dim}")
        options = named
    for t in options:
        if smem_bytes(head_dim, dtype, t, kv_q8) <= limit:
            return t
    need = min(smem_bytes(head_dim, dtype, t, kv_q8) for t in options)
    raise ValueError(f"CUDA attention with head_dim {head_dim} and {dtype_name(dtype)} needs {need} bytes of "
                     f"shared memory per block; this device allows {limit}")


def attention_params(scale: float, softcap: float | None,
                     window: int | None) -> tuple[mx.array, mx.array]:
    """The kernel's parameter inputs, as the MSL brick takes them: ``fparams`` float32
    ``(scale, softcap, 1 / softcap)`` (zeros without soft-capping) and ``iparams`` int32
    ``(window,)`` (0: no window)."""
    cap = 0.0 if softcap is None else float(softcap)
    fparams = mx.array([float(scale), cap, 1.0 / cap if cap else 0.0], mx.float32)
    return fparams, mx.array([0 if window is None else int(window)], mx.int32)


def launch_attention_cuda(q, k, v, k_scale, v_scale, *, scale, causal, window=None,
                          softcap=None, variant=None, kv_start=None, sinks=None):
    """Run the CUDA attention kernel; returns (B, Hq, Lq, D) as a transposed view of a
    row-contiguous (B, Lq, Hq, D) buffer (as MLX's SDPA and the MSL brick return it).

    Args:
        q: (B, Hq, Lq, D) float16, bfloat16 or float32, any strides.
        k, v: (B, Hkv, Lk, D) of q's dtype, or int8 Q8_0 codes when ``k_scale`` is given; any
            strides; ``Hq % Hkv == 0`` (query head h reads KV head ``h // (Hq // Hkv)``).
        k_scale, v_scale: None, or (B, Hkv, Lk, D // 32) float16 Q8_0 scales (then the kernel
            attends over ``T(qs * d)``, the values ``dequantize_q8_0_reference`` gives).
        scale: multiplier of ``q . k``.
        causal: mask aligned bottom-right: query i (position ``p = Lk - Lq + i``) sees keys
            ``j <= p``.
        window: None or an int >= 1: query at position p sees keys ``p - window < j <= p``
            (implies causal).
        softcap: None or a float > 0: scores become ``softcap * tanh(scale * q.k / softcap)``.
        variant: a :func:`variants` name, or None for the default that fits the device.
        kv_start: None, or an int32 (B,) array: batch row b's first valid key (the kernel's
            ``KV_START`` instantiation; clamped to 0 .. Lk in the kernel). Tiles below it are
            never loaded; the partial tile's padding keys are staged as zeros (never read).
        sinks: None, or (Hq,) float: head h's sink logit, one more softmax column of value 0
            (the kernel's ``SINKS`` instantiation, read in float32).

    Shapes and dtypes are the caller's to check (``flash_attention`` validates them); rows that
    see no key (only reachable with Lq > Lk) come out 0.

    Raises:
        ValueError: window < 1, softcap <= 0, an unknown variant, or no variant fits the
            device's shared memory.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap!r}")
    B, Hq, Lq, D = q.shape
    kv_q8 = k_scale is not None
    tile = pick_tile(D, q.dtype, kv_q8, variant)
    if B == 0 or Hq == 0 or Lq == 0:
        return mx.zeros(q.shape, q.dtype)  # MLX cannot launch an empty grid
    if not kv_q8:
        k_scale = v_scale = mx.zeros((1, 1, 1, 1), mx.float16)  # never read; 4-D strides
    # Query position p = Lk - Lq + i <= Lk - 1, so a window of Lk or more excludes no key.
    has_window = window is not None and window < k.shape[2]
    fparams, iparams = attention_params(scale, softcap, window if has_window else None)
    nt = threads(D)
    has_start = kv_start is not None
    if not has_start:
        kv_start = mx.zeros((1,), mx.int32)  # never read
    (out,) = kernels.launch(
        "flash_attention", "cuda",
        inputs=[q, k, v, k_scale, v_scale, fparams, iparams, kv_start, sinks_input(sinks)],
        grid=(nt * -(-Lq // (64 * tile.mt)), Hq, B),
        threadgroup=(nt, 1, 1),
        output_shapes=[(B, Lq, Hq, D)],
        output_dtypes=[q.dtype],
        template=[("T", q.dtype), ("D", D), ("BK", tile.bk), ("MT", tile.mt),
                  ("QREG", tile.qreg), ("CAUSAL", bool(causal) or window is not None),
                  ("WINDOW", has_window), ("SOFTCAP", softcap is not None),
                  ("KV_Q8", kv_q8), ("KV_START", has_start), ("SINKS", sinks is not None)],
        shared_memory=smem_bytes(D, q.dtype, tile, kv_q8),
    )
    return out.transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------------
# The fast family (cuda_src/attention_fa.cu): 16-bit q/k/v, head_dim multiple of 64, Dv may
# differ from Dq; mma.sync warps (sm_80+) or wgmma warpgroups (sm_90a).

kernels.register(kernels.KernelSpec(
    name="flash_attention_fa",
    body=None,
    input_names=("q", "k", "v", "fparams", "iparams", "kv_start", "sinks"),
    output_names=("out",),
    ensure_row_contiguous=False,
    cuda_body="attention_fa.cu",
    cuda_headers=("mma.cuh", "attention_common.cuh", "attention_wgmma.cuh", "attention_fa.cuh"),
))

#: Head dims (of q/k, and of v) the fast family takes.
FA_HEAD_DIMS = (64, 128, 192, 256)
#: Tuner names of the fast family: the first fitting tile of each engine (``fa_tiles``).
FA_WGMMA, FA_MMA = "fa_wg", "fa_mma"


@dataclass(frozen=True)
class FaTile:
    """One variant of the fast kernel family (``attention_fa.cuh``).

    Attributes:
        wg: wgmma warpgroups of 64 rows (sm_90a only), else mma.sync warps (sm_80+).
        bk: keys per K/V tile (multiple of 16).
        nw: warps per block (a multiple of 4 with ``wg``).
        mt: m16 tiles per warp (1 with ``wg``): a block takes ``16 * mt * nw`` query rows.
        ns: K/V stages of the cp.async ring (>= 2).
        lag: two warpgroups, the second one P V behind (FlashAttention-3's ping-pong order
            with the one block barrier; one V stage more).
        iwo: each tile's softmax runs while the previous tile's P V is on the tensor cores
            (FlashAttention-3's intra-warpgroup overlap; wgmma; one V stage more).
        ffma: tiles without mask or soft-cap (and a positive scale) take the one-FFMA softmax
            (max over the raw scores, p = 2^(s scale log2 e - m)); a second copy of the
            softmax in the code, chosen once per tile.
    """

    wg: bool
    bk: int
    nw: int
    mt: int
    ns: int
    lag: bool = False
    iwo: bool = False
    ffma: bool = False

    @property
    def bq(self) -> int:
        """Query rows per block."""
        return 16 * self.mt * self.nw

    @property
    def threads(self) -> int:
        return 32 * self.nw

    @property
    def name(self) -> str:
        """e.g. ``fa_wg_bk128_w8_s2_lag``, ``fa_mma_bk64_w4_mt2_s2``."""
        return (f"fa_{'wg' if self.wg else 'mma'}_bk{self.bk}_w{self.nw}"
                f"{'_mt2' if self.mt == 2 else ''}_s{self.ns}{'_lag' if self.lag else ''}"
                f"{'_iwo' if self.iwo else ''}{'_ffma' if self.ffma else ''}")

    def smem_bytes(self, dqk: int, dv: int) -> int:
        """``FaConfig::SMEM``: Q (bq rows), ns K stages, ns (+1 with lag or iwo) V stages of
        16-bit elements, plus 1024 bytes to align the tiles at run time."""
        nsv = self.ns + (1 if self.lag or self.iwo else 0)
        return 2 * (self.bq * dqk + self.ns * self.bk * dqk + nsv * self.bk * dv) + 1024


# Per q/k head_dim, best first per engine (what the tuner gets as fa_wg / fa_mma: the first
# that fits). Registers: ptxas -v (nvcc 13.0), docs/bricks.md. Order from the H100 runs of
# 2026-12-06 (bench/results/2026-12-06-h100-attention-fa-session*.json, causal bf16, 32 / 8
# heads): TFLOP/s at T = 8192 beside each tile, session 1 (stock cuDNN 658 at head_dim 128).
# The _iwo tiles ran in session 2 only, slowed with every fast tile by that build's per-score
# softmax choice; the _ffma tiles have not run on a GPU yet. Shared memory: 227 KB on sm_90,
# 163 KB sm_80, 99 KB sm_86/89/120.
_FA_TILES = {
    64: (FaTile(True, 128, 8, 1, 2, True),       # 97 KB; 228 (FA3's 192 x 128 needs 384 threads)
         FaTile(True, 128, 8, 1, 2, iwo=True),   # 97 KB
         FaTile(False, 64, 4, 2, 2),             # 49 KB; 253: FA2's 128-row block of 4 warps
         FaTile(False, 128, 8, 1, 2)),           # 81 KB; 190
    128: (FaTile(True, 128, 8, 1, 2, True),      # 193 KB; 369 (stock cuDNN 658)
          FaTile(True, 128, 8, 1, 2, True, ffma=True),
          FaTile(True, 128, 8, 1, 2, iwo=True),  # 193 KB; FA3 128 x 128 causal, 2 warpgroups
          FaTile(True, 128, 8, 1, 2, iwo=True, ffma=True),
          FaTile(True, 128, 8, 1, 2),            # 161 KB; 342: both warpgroups in lockstep
          FaTile(False, 128, 8, 1, 2),           # 161 KB; 309
          FaTile(False, 64, 8, 1, 2)),           # 97 KB; 252: FA2 sm86/89, 8 warps (FA2
    #                                              sm80's 128 x 64 of 4 warps spills here)
    192: (FaTile(True, 64, 8, 1, 2, True),       # 169 KB (Dv 128: 145 KB)
          FaTile(True, 64, 8, 1, 2, iwo=True),   # 169 KB
          FaTile(False, 64, 8, 1, 2)),           # 145 KB: FA2 sm80 128 x 64, 8 warps
    256: (FaTile(True, 64, 8, 1, 2, True),       # 225 KB; 445 (stock unfused 66); FA3's 128 x 80
          FaTile(True, 64, 8, 1, 2, True, ffma=True),  # hits the smem limit
          FaTile(True, 64, 8, 1, 2, iwo=True),   # 225 KB
          FaTile(False, 64, 8, 1, 2),            # 193 KB; 305: FA2 sm80 128 x 64, 8 warps
          FaTile(False, 32, 8, 1, 2)),           # 129 KB; 262
}


#: Every tile of the table by its name.
FA_TILES_BY_NAME = {t.name: t for tiles in _FA_TILES.values() for t in tiles}


def fa_tiles(dqk: int, dv: int | None = None) -> list[FaTile]:
    """Every tile of the fast family for q/k head_dim ``dqk`` and v head_dim ``dv`` (default
    ``dqk``), best first per engine; [] where the family does not apply."""
    dv = dqk if dv is None else dv
    if dqk not in _FA_TILES or dv not in FA_HEAD_DIMS:
        return []
    return [t for t in _FA_TILES[dqk] if not (t.wg and dv > 256)]


def fa_applies(q, k, v, kv_quant=None) -> bool:
    """Whether the fast family takes these arguments: 16-bit q/k/v of one dtype, no Q8_0 K/V,
    head_dims in ``FA_HEAD_DIMS``."""
    return (kv_quant is None and q.dtype in (mx.float16, mx.bfloat16) and k.dtype == q.dtype
            and v.dtype == q.dtype and bool(fa_tiles(q.shape[-1], v.shape[-1])))


def pick_fa_tile(dqk: int, dv: int, name: str, cc: tuple[int, int] | None = None,
                 smem_limit: int | None = None) -> FaTile:
    """The tile of variant ``name``: ``fa_wg`` / ``fa_mma`` (the first tile of that engine
    that this GPU runs), or a tile's own name (:attr:`FaTile.name`).

    Raises:
        ValueError: no such tile for the head dims, a wgmma tile off sm_90, or none fits the
            shared memory.
    """
    cc = gemm_cuda.device_capability() if cc is None else cc
    cc = cc if cc != (0, 0) else (9, 0)  # compile checks without a GPU: as on an H100/H200
    limit = max_shared_memory(cc) if smem_limit is None else smem_limit
    options = fa_tiles(dqk, dv)
    if name in (FA_WGMMA, FA_MMA):
        options = [t for t in options if t.wg == (name == FA_WGMMA)]
    else:
        options = [t for t in options if t.name == name]
    fits = [t for t in options if (not t.wg or cc[0] == 9) and t.smem_bytes(dqk, dv) <= limit]
    if not fits:
        raise ValueError(f"no fast attention tile {name!r} for head_dim {dqk}/{dv} on a GPU of "
                         f"capability {cc} ({limit} bytes of shared memory); tiles: "
                         f"{', '.join(t.name for t in fa_tiles(dqk, dv)) or 'none'}")
    return fits[0]


def fa_variant_names(dqk: int, dv: int, cc: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The fast family's tuner names this GPU runs for the head dims: ``fa_wg`` (sm_90) and
    ``fa_mma``, where a tile of that engine fits."""
    names = []
    for n in (FA_WGMMA, FA_MMA):
        try:
            pick_fa_tile(dqk, dv, n, cc)
        except ValueError:
            continue
        names.append(n)
    return tuple(names)


def launch_attention_fa(q, k, v, *, scale, causal, window=None, softcap=None, variant=FA_MMA,
                        kv_start=None, sinks=None):
    """Run the fast kernel family; returns (B, Hq, Lq, Dv) as a transposed view of a
    row-contiguous (B, Lq, Hq, Dv) buffer.

    Args:
        q: (B, Hq, Lq, Dq) float16 or bfloat16, any strides.
        k: (B, Hkv, Lk, Dq), v: (B, Hkv, Lk, Dv) of q's dtype, any strides; ``Hq % Hkv == 0``
            (query head h reads KV head ``h // (Hq // Hkv)``); Dq, Dv in ``FA_HEAD_DIMS``.
        scale, causal, window, softcap, kv_start, sinks: as :func:`launch_attention_cuda`
            (causal aligned bottom-right: query i at position ``Lk - Lq + i`` sees keys up to
            it; every length, the window and kv_start are run-time values: one build per
            head_dim, dtype and feature set).
        variant: ``fa_wg``, ``fa_mma`` or a tile name (:func:`pick_fa_tile`).

    Raises:
        ValueError: window < 1, softcap <= 0, or no tile of ``variant`` for this GPU.
    """
    if window is not None and window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0, got {softcap!r}")
    B, Hq, Lq, D = q.shape
    Dv = v.shape[3]
    tile = pick_fa_tile(D, Dv, variant)
    if B == 0 or Hq == 0 or Lq == 0:
        return mx.zeros((B, Hq, Lq, Dv), q.dtype)
    has_window = window is not None and window < k.shape[2]
    fparams, iparams = attention_params(scale, softcap, window if has_window else None)
    has_start = kv_start is not None
    if not has_start:
        kv_start = mx.zeros((1,), mx.int32)  # never read
    (out,) = kernels.launch(
        "flash_attention_fa", "cuda",
        inputs=[q, k, v, fparams, iparams, kv_start, sinks_input(sinks)],
        grid=(tile.threads * -(-Lq // tile.bq), Hq, B),
        threadgroup=(tile.threads, 1, 1),
        output_shapes=[(B, Lq, Hq, Dv)],
        output_dtypes=[q.dtype],
        template=fa_template(q.dtype, D, Dv, tile, bool(causal) or window is not None,
                             has_window, softcap is not None, has_start, sinks is not None),
        shared_memory=tile.smem_bytes(D, Dv),
    )
    return out.transpose(0, 2, 1, 3)


def fa_template(dtype, dqk: int, dv: int, tile: FaTile, causal: bool, window: bool,
                softcap: bool, kv_start: bool, sinks: bool) -> list:
    """The fast family's template arguments, in ``attention_fa.cu``'s order."""
    return [("T", dtype), ("DQK", dqk), ("DV", dv), ("BK", tile.bk), ("NW", tile.nw),
            ("MT", tile.mt), ("NS", tile.ns), ("WG", tile.wg), ("LAG", tile.lag), ("IWO", tile.iwo),
            ("FFMA", tile.ffma),
            ("CAUSAL", causal), ("WINDOW", window), ("SOFTCAP", softcap),
            ("KV_START", kv_start), ("SINKS", sinks)]
