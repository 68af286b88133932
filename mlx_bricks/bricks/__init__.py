"""The bricks, one package each: the public op with its checks and MLX reference (``op``), the
MSL spec, tiles and launch (``msl``), the CUDA tiles and launch (``cuda``), the tuner kind
(``kind``) and the piece (``piece``: what a patched mlx-lm module hands the brick).
``mlx_bricks.ops`` is the public front over them."""
from __future__ import annotations

import importlib
import importlib.util
import pkgutil


def kinds() -> dict:
    """Every brick's op kind by name (``runtime.kind.KINDS``), each brick's ``kind`` module
    imported (they register their kinds)."""
    from mlx_bricks.runtime.kind import KINDS

    for info in pkgutil.iter_modules(__path__):
        name = f"{__name__}.{info.name}.kind"
        if info.ispkg and importlib.util.find_spec(name) is not None:
            importlib.import_module(name)
    return KINDS
