"""The CUDA twin of the attention brick: tile variants, shared memory and the launch.

The kernel (``cuda_src/attention.cu`` + ``cuda_src/attention.cuh``) is FlashAttention-2 (Dao,
2023) on ``mma.sync`` m16n8k16 tensor-core instructions (fp16/bf16) or float32 FFMA (float32):
a block of 4 warps (8 for head_dim 512) takes ``BQ = 64 * MT`` query rows of one (batch, head),
K/V tiles of ``BK`` keys stream through shared memory by ``cp.async``, the softmax is rescaled
online in float32 registers. :func:`smem_bytes` mirrors the kernel's shared-memory layout
(``Config`` in attention.cuh; the kernel traps if launched with less).

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
