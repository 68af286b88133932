"""The conventions of the command-line tools (``mlx_bricks.generate`` and the hooked mlx-lm
commands, ``python -m mlx_bricks.patch``, ``.tune``, ``.bench``, ``.gguf``): one-line errors
with exit status 2, clean Ctrl-C. Model arguments: ``mlx_bricks.entry.resolve``.

Conventions (docs/cli.md):
    exit 0 success, 1 the check failed (patch CLI), 2 bad input, 130 interrupted (Ctrl-C).
Bad input is one line on stderr, ``PROG: error: MESSAGE``, never a traceback.
"""
from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

EXIT_OK = 0
EXIT_FAIL = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """Bad input: reported as one line, exit status 2."""


def one_line(message: object) -> str:
    """``message`` with every run of whitespace (newlines included) collapsed to one space."""
    return " ".join(str(message).split())


def fail(prog: str, message: object, code: int = EXIT_BAD_INPUT) -> NoReturn:
    """Print ``PROG: error: MESSAGE`` on stderr and exit with ``code``."""
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    raise SystemExit(code)


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Make ``parser`` report a bad flag as one line (``PROG: error: ...``), exit 2.

    argparse prints the usage block first; the brief for these tools is one line per error,
    with ``--help`` for the usage.
    """

    def error(message: str) -> NoReturn:
        fail(parser.prog, f"{message} (see --help)")

    parser.error = error  # argparse calls self.error(); an instance attribute overrides it
    return parser


def positive_int(text: str) -> int:
    """argparse ``type=`` for a positive integer flag (the error names the bad text)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def run_cli(prog: str, body: Callable[[], int | None]) -> int:
    """Run ``body`` with the CLI conventions: the environment is checked first
    (``mlx_bricks.env.check``: a bad ``MLX_BRICKS_*`` value stops the command before any
    work); ``CliError``, ``BackendError`` and ``EnvError`` become one line and exit 2; Ctrl-C
    exits 130 without a traceback.

    Raises:
        SystemExit: on every failure (so callers that ignore the return value, such as
            ``python -m mlx_lm generate``, still exit with the right status).
    """
    from mlx_bricks import env
    from mlx_bricks.backends import BackendError

    try:
        env.check()
        return body() or EXIT_OK
    except (CliError, BackendError, env.EnvError) as e:
        fail(prog, e)
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"\n{prog}: interrupted", file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
