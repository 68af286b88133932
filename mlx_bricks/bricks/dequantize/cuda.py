"""The CUDA twin of the dequantize brick: MLX affine weights to float, bit-exact.

``cuda_src/dequantize.cu`` on ``cuda_src/dequant.cuh`` (the spec is the brick's, ``msl.py``): one thread per run of 128 values of a
row (32 when K % 128 != 0), 16-byte loads of the packed words, the values built with integer
and paired-half instructions (LOP3 with the exponent magic, PRMT, one HFMA2 per pair; float32:
the 2^23 magic and one FFMA per value), 16-byte stores. The public op (``op.dequantize``) and
the composites call :func:`run`.

Rounding: the values are those of ``mx.dequantize`` on the same device. MLX's CUDA kernel
computes ``scale * T(q) + bias`` in the scales' dtype T, which ptxas contracts into one fma on
sm_90 (HFMA2 / HFMA2.BF16 / FFMA: the exact value rounded once) and, for bfloat16 on sm_80-89,
does not (the bf16 header writes explicit ``.rn`` multiply and add: two roundings); float16 and
float32 are fused everywhere. ``fused=None`` picks that for the device (``FUSED`` template).
MLX's CPU ``mx.dequantize`` rounds twice (``fused=False``).
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.bricks.dequantize import msl as _msl  # noqa: F401  (registers the spec)
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats.affine import FLOAT_DTYPES, QuantizedWeight
from mlx_bricks.kernels import launch

#: Threads per block of the launch (any size works: the grid is a flat list of runs).
THREADS = 256


def fused_rounding(dtype, cc: tuple[int, int] | None = None) -> bool:
    """Whether ``mx.dequantize`` on a GPU of capability ``cc`` (default: this one; sm_90
    without a GPU) rounds ``scale * q + bias`` once (True) or the product and the sum each
    (False, bfloat16 below sm_90)."""
    if cc is None:
        from mlx_bricks.bricks.gemm.cuda import device_capability

        cc = device_capability()
        cc = cc if cc != (0, 0) else (9, 0)
    return not (dtype == mx.bfloat16 and cc[0] < 9)


def run_values(K: int) -> int:
    """Values per thread: 128 (16-byte loads for every bit width) when K allows, else 32."""
    return 128 if K % 128 == 0 else 32


def dequantize_cuda(w, scales, biases, *, bits: int, group_size: int, dtype=None,
                    fused: bool | None = None) -> mx.array:
    """Dequantize an MLX affine weight on the CUDA twin.

    Args:
        w: uint32 ``(N, K * bits / 32)``, as ``mx.quantize`` packs it (value k of a row at bits
            ``[k bits, (k + 1) bits)`` of the row's little-endian bit stream).
        scales, biases: ``(N, K / group_size)`` float16, bfloat16 or float32 (one dtype).
        bits: 2, 3, 4, 5, 6 or 8. group_size: 32, 64 or 128 (it divides K).
        dtype: the output dtype (float16, bfloat16, float32); None: the scales' dtype. As
            ``mx.dequantize(..., dtype=)``: computed in the scales' dtype, then converted.
        fused: None (``mx.dequantize``'s rounding on this device, :func:`fused_rounding`),
            True (``T(s q + b)`` rounded once) or False (``T(T(s q) + b)``).

    Returns:
        ``(N, K)`` array of ``dtype``: ``scale * q + bias`` per group, bit-exact against
        ``mx.dequantize`` on the same device.

    Raises:
        TypeError: w not uint32, scales / biases not a float dtype or not of one dtype,
            dtype not a float dtype.
        ValueError: unsupported bits or group_size, wrong shapes, a group_size that does not
            divide K (messages name the argument).
    """
    QuantizedWeight(w, scales, biases, group_size, bits).check("w")
    out_dtype = scales.dtype if dtype is None else dtype
    if out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype_name(out_dtype)}")
    N, K = w.shape[0], w.shape[1] * 32 // bits
    if N == 0 or K == 0:
        return mx.zeros((N, K), out_dtype)
    unit = run_values(K)
    runs = N * (K // unit)
    fused = fused_rounding(scales.dtype) if fused is None else bool(fused)
    (out,) = launch(
        "dequantize", "cuda",
        inputs=[mx.contiguous(w), mx.contiguous(scales), mx.contiguous(biases)],
        template=[("T", scales.dtype), ("O", out_dtype), ("BITS", bits), ("GS", group_size),
                  ("FUSED", fused), ("UNIT", unit)],
        grid=(math.ceil(runs / THREADS) * THREADS, 1, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(N, K)], output_dtypes=[out_dtype],
    )
    return out


def run(weight, dtype, fused: bool | None):
    """The twin's ``(N, K)`` values of ``weight`` (a checked ``QuantizedWeight``) in ``dtype``;
    ``fused`` None: ``mx.dequantize``'s rounding on this GPU (:func:`fused_rounding`)."""
    return dequantize_cuda(weight.w, weight.scales, weight.biases, bits=weight.bits,
                           group_size=weight.group_size, dtype=dtype, fused=fused)
