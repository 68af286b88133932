"""The entry layer: mlx-lm's command-line programs with the bricks (docs/cli.md, docs/serving.md).

* :mod:`.commands`: the table of target commands (``generate``, ``server``, ``chat``,
  ``benchmark``); standard library only.
* :mod:`.hook`: the import hook the ``.pth`` line installs (``mlx_lm.server --use-bricks``);
  standard library only, it reaches the session only when the target module is imported.
* :mod:`.flags`: ``add_bricks_flags(parser)`` and the single flags (``--bricks-backend`` ...),
  one vocabulary from ``mlx_bricks.options`` and ``mlx_bricks.backends``; no MLX.
* :mod:`.resolve`: model arguments (the embedded default model, ``.gguf`` files, local
  directories, Hugging Face repo ids) checked before anything loads.
* :mod:`.session`: one run of a command: its parser gets the flags, its ``load`` patches the
  model, its ``make_prompt_cache`` gives the patched model its KV cache.

Imports go one way: hook -> (lazily) session -> flags, resolve -> commands. Names resolve
lazily (PEP 562), so importing the package imports nothing heavy.
"""
from __future__ import annotations

from mlx_bricks._lazy import lazy_exports

_LAZY = {
    "COMMANDS": ".commands",
    "add_bricks_flags": ".flags",
    "resolve_model": ".resolve",
    "Session": ".session",
    "run_command": ".session",
}

__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
