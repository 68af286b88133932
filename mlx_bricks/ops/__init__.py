"""Public functional API of the bricks: ``mx.array`` in, ``mx.array`` out.

Each op validates its arguments, resolves the backend (``mlx_bricks.backends``) and runs either
its brick's kernel (``metal``/``emulator``/``cuda``) or its reference in MLX ops
(``reference``). Every op has a ``*_reference`` beside it. The ops live in their brick's
package (``mlx_bricks.bricks.<brick>``); this front resolves the names lazily, so
``import mlx_bricks.ops`` stays cheap.
"""
from __future__ import annotations

from mlx_bricks._lazy import lazy_exports

_LAZY = {
    "linear": "mlx_bricks.bricks.gemm.op",
    "linear_reference": "mlx_bricks.bricks.gemm.op",
    "swiglu": "mlx_bricks.bricks.swiglu.op",
    "swiglu_reference": "mlx_bricks.bricks.swiglu.op",
    "swiglu_mlp": "mlx_bricks.bricks.swiglu.op",
    "swiglu_mlp_reference": "mlx_bricks.bricks.swiglu.op",
    "flash_attention": "mlx_bricks.bricks.attention.op",
    "flash_attention_reference": "mlx_bricks.bricks.attention.op",
    "decode_attention": "mlx_bricks.bricks.decode.op",
    "decode_attention_reference": "mlx_bricks.bricks.decode.op",
    "quantize_q8_0": "mlx_bricks.bricks.q8_0.op",
    "quantize_q8_0_reference": "mlx_bricks.bricks.q8_0.op",
    "dequantize_q8_0": "mlx_bricks.bricks.q8_0.op",
    "dequantize_q8_0_reference": "mlx_bricks.bricks.q8_0.op",
    "dequantize": "mlx_bricks.bricks.dequantize.op",
    "dequantize_reference": "mlx_bricks.bricks.dequantize.op",
    "rms_norm_qkv": "mlx_bricks.bricks.norm_qkv.op",
    "rms_norm_qkv_reference": "mlx_bricks.bricks.norm_qkv.op",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
