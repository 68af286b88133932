"""The dequantize brick's CUDA twin, as the CUDA backend calls it.

The twin (``cuda_src/dequantize.cu`` and its launch ``dequantize_cuda(w, scales, biases, *,
bits, group_size, dtype, fused=None)`` in ``mlx_bricks/ops/dequantize_cuda.py``) is written
on the CUDA engineers' branch; this module is where the op meets it: :func:`launch` calls that
function where it is installed. Where it is not, the op has no CUDA twin: an explicit
``backend="cuda"`` raises ``NotImplementedError`` ("has no CUDA twin"), an automatic choice
runs ``reference`` (``mx.dequantize``, the same values).
"""
from __future__ import annotations

import importlib
import importlib.util

#: The module of the twin's launch.
LAUNCH_MODULE = "mlx_bricks.ops.dequantize_cuda"


def available() -> bool:
    """Whether the twin's launch is installed."""
    return importlib.util.find_spec(LAUNCH_MODULE) is not None


def unsupported_reason() -> str | None:
    """Why the op has no CUDA twin here (None: it has)."""
    if available():
        return None
    return (f"the 'dequantize' brick has no CUDA twin in this build ({LAUNCH_MODULE} is not "
            "installed); use backend='reference'")


def launch(weight, dtype, fused: bool | None):
    """The twin's ``(N, K)`` values of ``weight`` (a checked ``QuantizedWeight``) in ``dtype``;
    ``fused`` None: ``mx.dequantize``'s rounding on this GPU (the twin's own rule).

    Raises:
        NotImplementedError: the twin is not installed ("has no CUDA twin").
    """
    reason = unsupported_reason()
    if reason is not None:
        raise NotImplementedError(reason)
    twin = importlib.import_module(LAUNCH_MODULE)
    return twin.dequantize_cuda(weight.w, weight.scales, weight.biases, bits=weight.bits,
                                group_size=weight.group_size, dtype=dtype, fused=fused)
