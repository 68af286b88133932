"""mlx-bricks: fused prefill kernels ("bricks") for MLX and mlx-lm.

Importing this package is cheap: it does not import ``mlx`` or compile any kernel. Public names
are resolved lazily on first attribute access (PEP 562).
"""
from __future__ import annotations

import importlib

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
}

__all__ = sorted(_LAZY) + ["__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mlx_bricks' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if module.endswith("." + name) else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
