"""``mlx_lm.generate`` with the bricks: every ``mlx_lm.generate`` flag, plus ``--use-bricks``.

One code path, four ways to run it (docs/cli.md):

    mlx_lm.generate --use-bricks [FLAGS]            through the import hook (mlx_bricks.entry.hook)
    python -m mlx_lm generate --use-bricks [FLAGS]  same
    mlx_bricks.generate [FLAGS]                     console script, no hook; bricks on by default
    python -m mlx_bricks.generate [FLAGS]           same

mlx-lm's own ``main()`` does the work (prompt, chat template, sampling, ``--verbose`` output with
mlx-lm's prompt tokens/s); the session (``mlx_bricks.entry.session``) adds the mlx-bricks flags
to its parser and swaps in a ``load`` that patches the model right after mlx-lm loads it.
Differences from stock ``mlx_lm.generate``:

* without ``--model`` (and without ``--prompt-cache-file``), the embedded default model
  (SmolLM2-135M-Instruct, converted from its GGUF once) instead of mlx-lm's default;
* ``--model`` may also be a ``.gguf`` file (converted once into the cache,
  ``mlx_bricks.entry.resolve``);
* bad input (missing model directory, no config.json, unsupported model_type, unreadable
  weights, empty prompt, bad flag value, unavailable backend) is one line on stderr and exit 2;
  Ctrl-C exits 130 without a traceback;
* mlx-bricks' own lines (backend, patch counts, ``--bricks-report``) go to stderr, so stdout is
  what mlx-lm prints.
"""
from __future__ import annotations

import sys

from mlx_bricks.entry.session import run_command

PROG = "mlx_bricks.generate"


def main(argv: list[str] | None = None, *, prog: str = PROG) -> int:
    """``mlx_bricks.generate``: ``mlx_lm.generate`` with the bricks on by default.

    Args:
        argv: the flags (default ``sys.argv[1:]``).
        prog: program name in help and error lines.

    Returns:
        0 on success.

    Raises:
        SystemExit: 2 on bad input (one line on stderr), 130 on Ctrl-C; argparse's own exits
            (``--help``: 0).
    """
    return run_command("generate", argv, use_bricks_default=True, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
