"""The dequantize brick's MSL kernel: spec, run size and launch on ``metal`` / ``emulator``.

``metal_src/dequantize.metal`` on ``metal_src/dequantize.h``: one thread per run of
:data:`RUN_VALUES` consecutive values of the weight's flat bit stream (whole 128-bit words of
``w``, a multiple of 32 values), codes turned into halves with the exponent magic, the affine
step in the scales' dtype with ``mx.dequantize``'s rounding, 16-byte stores.
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.kernels import KernelSpec, launch, register

register(KernelSpec(
    name="dequantize",
    body="dequantize.metal",
    input_names=("w", "scales", "biases"),
    output_names=("out",),
    headers=("dequantize.h",),
    cuda_body="dequantize.cu",
    cuda_headers=("mma.cuh", "dequant.cuh"),
))

#: Values per thread by bits (``bricks_dq::Run`` in dequantize.h): 1, 3, 1, 5, 3 and 2
#: 128-bit words of ``w``.
RUN_VALUES = {2: 64, 3: 128, 4: 32, 5: 128, 6: 64, 8: 32}
#: Threads per threadgroup (the kernel takes any size: the grid is a flat list of runs).
THREADS = 256


def launch_dequantize(weight, dtype, fused: bool, backend: str) -> mx.array:
    """The ``(N, K)`` values of ``weight`` (a checked, non-empty ``QuantizedWeight``) in
    ``dtype``, computed in the scales' dtype with one rounding (``fused``) or two."""
    N, K = weight.shape
    runs = math.ceil(N * K / RUN_VALUES[weight.bits])
    (out,) = launch(
        "dequantize", backend,
        inputs=[weight.w, weight.scales, weight.biases],
        template=[("T", weight.scales.dtype), ("O", dtype), ("BITS", weight.bits),
                  ("GROUP_SIZE", weight.group_size), ("FUSED", bool(fused))],
        grid=(runs, 1, 1), threadgroup=(min(THREADS, runs), 1, 1),
        output_shapes=[(N, K)], output_dtypes=[dtype],
    )
    return out
