"""GGUF import: turn a llama.cpp ``.gguf`` file into a directory ``mlx_lm.load`` opens as is.

    python -m mlx_bricks.gguf PATH.gguf OUT_DIR [--dtype float16|bfloat16|float32]
                              [--keep-quantized] [--force]

    from mlx_bricks.gguf import convert_gguf
    convert_gguf("model.gguf", "model-mlx", keep_quantized=True)

See :func:`convert_gguf` for what is supported and ``docs/models.md`` for the bigger picture.
"""
from .convert import SUPPORTED_ARCHITECTURES, convert_gguf

__all__ = ["convert_gguf", "SUPPORTED_ARCHITECTURES"]
