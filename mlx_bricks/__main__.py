"""``python -m mlx_bricks``: what there is to run, in short (the commands, the flags
``--use-bricks`` adds to mlx-lm, the environment variables). Exit 0; any argument other than
``-h`` / ``--help`` is one line and exit 2."""
from __future__ import annotations

import argparse
import sys

from mlx_bricks import _cli

PROG = "python -m mlx_bricks"

#: (command, what it does), in the order a new user meets them (docs/cli.md).
COMMANDS = (
    ("mlx_lm.generate --use-bricks ...", "mlx-lm's generate with the bricks (also server, "
     "chat, benchmark)"),
    ("python -m mlx_bricks.patch [MODEL]", "check a model: stock vs patched tokens, logits, "
     "speed"),
    ("python -m mlx_bricks.tune [MODEL]", "measure ahead which bricks beat stock here; cache "
     "the decisions"),
    ("python -m mlx_bricks.bench [--only ...]", "benchmarks, bricks vs stock in one run, JSON"),
    ("python -m mlx_bricks.gguf FILE DIR", "convert a GGUF file into an mlx-lm directory"),
)


#: One line per flag of the ``mlx-bricks`` group (``entry.flags.add_bricks_flags``), by dest.
FLAGS = {
    "use_bricks": "patch every model the command loads (default: off)",
    "bricks_backend": "the bricks' backend (default: $MLX_BRICKS_BACKEND, else auto)",
    "bricks_kv": "KV cache: mlx-lm's float cache, or Q8_0 blocks (default: fp16)",
    "bricks_mlp_variant": "SwiGLU brick variant (default: auto, the brick's rule)",
    "bricks_tune": "measure missing decisions (auto), never measure (cached), measure again "
                   "(force), no tuning (off); generate and chat: cached",
    "bricks_report": "print the per-layer patch report when the command ends",
}


def _flag_lines() -> list[str]:
    """The flags ``--use-bricks`` adds to mlx-lm's commands: names and choices from the parser
    itself, the words from :data:`FLAGS` (KeyError for a flag it lacks: a test keeps them
    together)."""
    from mlx_bricks.entry.flags import add_bricks_flags

    group = add_bricks_flags(argparse.ArgumentParser(add_help=False))
    rows = []
    for action in group._group_actions:  # argparse's own list of the group's flags
        names = " / ".join(action.option_strings)
        if action.choices:
            names += " {" + ",".join(action.choices) + "}"
        rows.append((names, FLAGS[action.dest]))
    width = max(len(n) for n, _ in rows)
    return [f"  {n:<{width}}  {h}" for n, h in rows]


def help_text() -> str:
    """The whole text ``python -m mlx_bricks`` prints."""
    import textwrap

    from mlx_bricks.env import VARIABLES

    width = max(len(c) for c, _ in COMMANDS)
    lines = ["mlx-bricks: fused prefill kernels for MLX and mlx-lm (README.md, docs/).", "",
             "commands (each one's --help gives its flags):"]
    lines += [f"  {c:<{width}}  {what}" for c, what in COMMANDS]
    lines += ["", "flags --use-bricks adds to mlx-lm's generate, server, chat and benchmark:"]
    lines += _flag_lines()
    lines += ["", "environment variables (docs/cli.md):"]
    lines += textwrap.wrap(", ".join(VARIABLES), 94, initial_indent="  ",
                           subsequent_indent="  ")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print :func:`help_text`; returns 0.

    Raises:
        SystemExit: 2 on any argument but ``-h`` / ``--help`` (one line on stderr).
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a not in ("-h", "--help") for a in argv):
        _cli.fail(PROG, f"unknown argument {next(a for a in argv if a not in ('-h', '--help'))!r}"
                  f"; it takes none (the commands: {PROG} --help)")
    print(help_text())
    return _cli.EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
