"""Drop-in prefill modules for mlx-lm blocks (used by ``mlx_bricks.patch``).

``BricksBlock`` (the unified block), ``BricksAttention`` and ``BricksPiece`` (a module whose
prefill is one brick piece: an MLP) are mixins switched in per instance with :func:`attach`
and removed with :func:`detach`. Prefill (L > 1) is split into pieces, each running its brick
(``mlx_bricks.bricks``) or mlx-lm's own computation as the model's dispatcher
(``mlx_bricks.runtime.dispatch``) decides; decode (L == 1) and every case the bricks do not
cover call the original ``__call__`` unchanged, with the reason counted in the module's
:class:`BricksState`. Files: ``layout`` (BlockLayout), ``calls`` (per-call checks),
``structure`` (structure checks), ``runner`` (state, choices, running a piece),
``attention``, ``block``, ``piece``, ``mixer`` (the mixins), ``classes`` (switching classes).
"""
from __future__ import annotations

from mlx_bricks.nn.attention import BricksAttention
from mlx_bricks.nn.block import BricksBlock
from mlx_bricks.nn.calls import DECODE
from mlx_bricks.nn.mixer import BricksMixer
from mlx_bricks.nn.classes import attach, bricks_class, detach, is_patched
from mlx_bricks.nn.layout import BlockLayout
from mlx_bricks.nn.piece import BricksPiece
from mlx_bricks.nn.runner import BricksState

__all__ = [
    "DECODE",
    "BlockLayout",
    "BricksAttention",
    "BricksBlock",
    "BricksMixer",
    "BricksPiece",
    "BricksState",
    "attach",
    "bricks_class",
    "detach",
    "is_patched",
]
