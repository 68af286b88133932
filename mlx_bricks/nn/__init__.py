"""Drop-in prefill modules for mlx-lm blocks (used by ``mlx_bricks.patch``).

``BricksAttention``, ``BricksMLP`` and ``BricksBlock`` are mixins switched in per instance with
:func:`attach` and removed with :func:`detach`; see ``modules.py``.
"""
from __future__ import annotations

from mlx_bricks.nn.modules import (
    DECODE,
    BlockLayout,
    BricksAttention,
    BricksBlock,
    BricksMLP,
    BricksState,
    attach,
    bricks_class,
    detach,
    is_patched,
)

__all__ = [
    "DECODE",
    "BlockLayout",
    "BricksAttention",
    "BricksBlock",
    "BricksMLP",
    "BricksState",
    "attach",
    "bricks_class",
    "detach",
    "is_patched",
]
