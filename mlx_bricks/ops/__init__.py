"""Public functional API of the bricks: ``mx.array`` in, ``mx.array`` out.

Each op validates its arguments, resolves the backend (``mlx_bricks.backends``) and runs either
the MSL brick (``metal``/``emulator``) or its reference in MLX ops (``reference``). Every op has
a ``*_reference`` beside it. Names are resolved lazily so ``import mlx_bricks.ops`` stays cheap.
"""
from __future__ import annotations

from mlx_bricks._lazy import lazy_exports

_LAZY = {
    "linear": ".gemm",
    "linear_reference": ".gemm",
    "swiglu": ".mlp",
    "swiglu_reference": ".mlp",
    "swiglu_mlp": ".mlp",
    "swiglu_mlp_reference": ".mlp",
    "flash_attention": ".attention",
    "flash_attention_reference": ".attention",
    "decode_attention": ".decode",
    "decode_attention_reference": ".decode",
    "quantize_q8_0": ".q8_0",
    "quantize_q8_0_reference": ".q8_0",
    "dequantize_q8_0": ".q8_0",
    "dequantize_q8_0_reference": ".q8_0",
    "rms_norm_qkv": ".norm_qkv",
    "rms_norm_qkv_reference": ".norm_qkv",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
