"""mlx-bricks: fused prefill kernels ("bricks") for MLX and mlx-lm.

Importing this package is cheap: it does not import ``mlx`` or compile any kernel. Public names
are resolved lazily on first attribute access (PEP 562).
"""
from __future__ import annotations

from mlx_bricks._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "active_backend": "mlx_bricks.backends",
    "resolve_backend": "mlx_bricks.backends",
    "available_backends": "mlx_bricks.backends",
    "BACKENDS": "mlx_bricks.backends",
    "BackendError": "mlx_bricks.backends",
    "ops": "mlx_bricks.ops",
    "default_model": "mlx_bricks.models",
    "convert_gguf": "mlx_bricks.gguf",
    "patch_model": "mlx_bricks.patch",
    "unpatch_model": "mlx_bricks.patch",
    "PatchReport": "mlx_bricks.patch",
    "make_prompt_cache": "mlx_bricks.cache",
    "Q8KVCache": "mlx_bricks.cache",
}

__all__ = sorted(_LAZY) + ["__version__"]


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
