"""The dequantize brick's public op: :func:`dequantize`, MLX affine weights to float with the
values ``mx.dequantize`` gives on the same device, and its reference.

The MSL kernel is ``msl.py`` (``metal_src/dequantize.metal``), the CUDA twin is reached through
``cuda.py``. The composites of the quantized kinds (``bricks/dequantize/composite.py``) use it
where the backend has it, as one candidate beside ``mx.dequantize`` (the tuner decides).
"""
from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np

from mlx_bricks import kernels
from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.dequantize import cuda, msl
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.formats.affine import QuantizedWeight


def dequantize_reference(w, scales, biases, *, group_size: int, bits: int, dtype=None):
    """Reference of :func:`dequantize` in MLX ops: ``mx.dequantize`` (affine mode)."""
    return mx.dequantize(w, scales, biases, group_size=group_size, bits=bits, dtype=dtype)


def check_dequantize(w, scales, biases, group_size, bits, dtype):
    """Validate :func:`dequantize`'s arguments; returns ``(QuantizedWeight, output dtype)``.
    Errors as :func:`dequantize` documents them."""
    weight = QuantizedWeight(w, scales, biases, group_size, bits)
    weight.check("w")
    out = scales.dtype if dtype is None else dtype
    if out not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be None, float16, bfloat16 or float32, got "
                        f"{dtype_name(out) if isinstance(out, mx.Dtype) else repr(out)}")
    return weight, out


def has_kernel(backend: str) -> bool:
    """Whether the brick runs its own kernel on ``backend`` (``metal``, ``emulator``, ``cuda``);
    ``reference`` runs ``mx.dequantize``."""
    return backend in (*kernels.MSL_BACKENDS, "cuda")


def dequantize_backend(backend=None) -> str:
    """The backend :func:`dequantize` runs on, resolved once (``backends.op_backend``)."""
    return op_backend("dequantize", backend)


@functools.lru_cache(maxsize=None)
def _rounds_once(device: str, name: str) -> bool:
    """Measured once per device and scales dtype on a fixed probe (4,096 8-bit codes with
    random scales and biases, where one and two roundings differ on many values)."""
    dtype = getattr(mx, name)
    rng = np.random.default_rng(0)
    N, K, gs = 16, 256, 32
    codes = rng.integers(0, 256, (N, K), dtype=np.uint64)
    words = (codes.reshape(N, K // 4, 4) << (8 * np.arange(4, dtype=np.uint64))).sum(-1)
    s = mx.array(rng.uniform(1e-3, 0.1, (N, K // gs)).astype(np.float32)).astype(dtype)
    b = mx.array(rng.uniform(-1.0, 1.0, (N, K // gs)).astype(np.float32)).astype(dtype)
    stream = mx.gpu if device == "gpu" else mx.cpu
    got = mx.dequantize(mx.array(words.astype(np.uint32)), s, b, group_size=gs, bits=8,
                        stream=stream)
    with mx.stream(mx.cpu):  # the exact value, rounded once (float64: the CPU's)
        exact = (mx.repeat(s.astype(mx.float64), gs, axis=1) * mx.array(codes.astype(np.float64))
                 + mx.repeat(b.astype(mx.float64), gs, axis=1))
        once = exact.astype(dtype)
    return bool(mx.array_equal(got.astype(mx.float32), once.astype(mx.float32)).item())


def stock_rounds_once(dtype) -> bool:
    """Whether ``mx.dequantize`` on the default device rounds ``scale * q + bias`` once (an
    fma: MLX's CUDA kernels on sm_90) or the product and the sum each (its CPU: ``T(T(s q) +
    b)``, measured on MLX 0.32.4), for scales of ``dtype``. Measured once per device and dtype
    on a small fixed probe (one evaluation), since it depends on how MLX's kernel for the
    device was compiled."""
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    return _rounds_once(device, dtype_name(dtype))


def run_dequantize(weight: QuantizedWeight, dtype, backend: str, fused: bool | None = None):
    """:func:`dequantize` after its checks, on the resolved ``backend`` (what the composites
    call): ``weight`` a checked ``QuantizedWeight``, ``dtype`` the output dtype."""
    N, K = weight.shape
    if N == 0 or K == 0:  # mx.dequantize refuses an empty weight
        return mx.zeros((N, K), dtype)
    if backend == "reference":
        return dequantize_reference(weight.w, weight.scales, weight.biases,
                                    group_size=weight.group_size, bits=weight.bits, dtype=dtype)
    if backend == "cuda":
        return cuda.run(weight, dtype, fused)
    if fused is None:
        fused = stock_rounds_once(weight.scales.dtype)
    return msl.launch_dequantize(weight, dtype, fused, backend)


def dequantize(w, scales, biases, *, group_size: int, bits: int, dtype=None, fused=None,
               backend=None):
    """MLX affine-quantized weight to float on the dequantize brick: ``scale * q + bias`` per
    group, the values of ``mx.dequantize`` on the same device, bit for bit.

    Algorithm (``metal_src/dequantize.h``): the packed rows are one flat little-endian bit
    stream; each thread takes a run of whole 128-bit words of it (64, 128, 32, 128, 64, 32
    values at 2, 3, 4, 5, 6, 8 bits). Two codes at a time are placed in the mantissas of the
    half pair 1024 + q (``as_type<half2>(codes | 0x64006400)``) and 1024 is subtracted: q exact,
    no integer-to-float instruction. At 2, 4 and 8 bits one AND with a doubled mask takes both
    codes of a pair from one word (values j and j + 16 / bits), and the results are written back
    in order from registers; at 3, 5 and 6 bits each code is shifted out (with the next word's
    low bits where it straddles, known at compile time) and two are joined into one pair word.
    Then one multiply and one add in the scales' dtype (module ``msl``), converted to ``dtype``,
    written with 16-byte stores.

    Args:
        w: uint32 (N, K * bits / 32), as ``mx.quantize`` packs it.
        scales, biases: (N, K / group_size), float16, bfloat16 or float32 (one dtype).
        group_size: 32, 64 or 128 (divides K).
        bits: 2, 3, 4, 5, 6 or 8.
        dtype: the output dtype (float16, bfloat16, float32); None: the scales' dtype. As
            ``mx.dequantize(..., dtype=)``: computed in the scales' dtype, then converted.
        fused: None (``mx.dequantize``'s rounding on the default device,
            :func:`stock_rounds_once`), True (``T(s q + b)`` rounded once) or False
            (``T(T(s q) + b)``).
        backend: ``None`` (auto), ``"metal"``, ``"cuda"``, ``"emulator"`` or ``"reference"``
            (``mx.dequantize``).

    Returns:
        (N, K) array of ``dtype``, row-contiguous.

    Copies: w, scales and biases are copied only when not row-contiguous.

    Raises:
        TypeError: non-array arguments, w not uint32, scales / biases not of one float dtype,
            bits or group_size not an int, dtype not a float dtype, fused not None or a bool.
        ValueError: bits or group_size MLX's affine format does not have, a packed width or
            scales / biases shapes that do not match, a group_size that does not divide K, or a
            bad backend (messages name the argument).
        NotImplementedError: ``backend="cuda"`` where the CUDA twin is not installed.
    """
    weight, out = check_dequantize(w, scales, biases, group_size, bits, dtype)
    if fused is not None and not isinstance(fused, bool):
        raise TypeError(f"fused must be None or a bool, got {type(fused).__name__}")
    return run_dequantize(weight, out, dequantize_backend(backend), fused)
