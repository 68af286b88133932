"""The home directory of mlx-bricks: ``$MLX_BRICKS_HOME``, else ``~/.cache/mlx_bricks``.

The one place that reads ``MLX_BRICKS_HOME``; everything mlx-bricks keeps on disk lives below it
(``models/``: the embedded default model, ``gguf/``: converted GGUF files, ``tune/``: the
tuning decisions, ``cuda/``: the compiled CUDA kernels, ``mlx_bricks.cuda.build``). Standard
library and ``mlx_bricks.env`` only, so any layer may import it.
"""
from __future__ import annotations

import os
from pathlib import Path

from mlx_bricks import env

#: Environment variable naming the home directory.
ENV_VAR = "MLX_BRICKS_HOME"
#: The home directory when ``MLX_BRICKS_HOME`` is unset or empty.
DEFAULT_HOME = "~/.cache/mlx_bricks"


def home(override: str | os.PathLike | None = None) -> Path:
    """The home directory: ``override`` if given, else ``$MLX_BRICKS_HOME``, else
    :data:`DEFAULT_HOME`; ``~`` expanded, read at each call (not created).

    Raises:
        env.EnvError: ``MLX_BRICKS_HOME`` names something that is not a directory.
    """
    return Path(override or env.get(ENV_VAR) or DEFAULT_HOME).expanduser()
