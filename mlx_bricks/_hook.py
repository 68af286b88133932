"""The import hook behind ``mlx_lm.generate --use-bricks``.

mlx-lm has no plugin mechanism, so the wheel installs one line into site-packages,
``mlx_bricks_hook.pth`` (written by ``setup.py``, see ``PTH_LINE``). ``site`` runs it at every
interpreter start; it only tests whether ``--use-bricks`` is in ``sys.argv`` and imports this
module when it is, so an unrelated process pays one list scan and imports nothing.

``install()`` then checks that the program really is mlx-lm's generate command
(``mlx_lm.generate ...``, ``python -m mlx_lm generate ...`` or the deprecated
``python -m mlx_lm.generate ...``) and puts a finder at the front of ``sys.meta_path``. When
``mlx_lm.generate`` is imported, the finder lets the normal loader run and then replaces the
module's ``main`` with ``mlx_bricks.generate._hooked_main`` (which parses the bricks flags and
runs mlx-lm's own ``main``, kept as ``mlx_lm.generate._mlx_bricks_stock_main``). Uninstalling
the wheel removes the ``.pth`` file, and with it the hook.

This module must stay cheap to import: standard library only, no ``mlx``.
"""
from __future__ import annotations

import importlib.abc
import sys

FLAG = "--use-bricks"
TARGET = "mlx_lm.generate"
STOCK_MAIN = "_mlx_bricks_stock_main"
PTH_NAME = "mlx_bricks_hook.pth"
# Kept in sync with setup.py (which cannot import the package while it builds it);
# tests/test_cli.py compares the installed file with this line.
PTH_LINE = (
    "import sys; '--use-bricks' in getattr(sys, 'argv', ()) "
    "and __import__('mlx_bricks._hook')._hook.install()\n"
)

# How the deprecated `python -m mlx_lm.generate` runs: runpy executes the module's code object
# as __main__; we hand runpy this code instead, which runs the same CLI through our main.
_RUNPY_SHIM = (
    "import sys\n"
    "from mlx_bricks.generate import _hooked_main\n"
    "sys.exit(_hooked_main())\n"
)


def is_generate_command(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process is mlx-lm's generate CLI.

    Args:
        argv: ``sys.argv`` (``argv[0]`` is the script path, or ``"-m"`` while ``site`` runs
            for ``python -m``).
        orig_argv: ``sys.orig_argv`` (the interpreter's own command line).
    """
    if argv and argv[0] != "-m":
        name = argv[0].replace("\\", "/").rsplit("/", 1)[-1].lower()  # any OS's separator
        for suffix in ("-script.pyw", "-script.py", ".exe"):
            if name.endswith(suffix):
                name = name[: -len(suffix)]
        return name == TARGET
    module, rest = _module_run(orig_argv[1:])
    if module == TARGET:
        return True
    return module == "mlx_lm" and bool(rest) and rest[0] == "generate"


# Interpreter options that take a value (the value may also be attached: -Ximporttime).
_OPTS_WITH_VALUE = "XW"
_LONG_OPTS_WITH_VALUE = ("--check-hash-based-pycs",)


def _module_run(args: list[str]) -> tuple[str | None, list[str]]:
    """``(MODULE, its arguments)`` for ``python [options] -m MODULE ...``, else ``(None, [])``."""
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _LONG_OPTS_WITH_VALUE:
            i += 2
            continue
        if arg.startswith("--") and arg != "--":
            i += 1  # --version, --help ...: no value
            continue
        if arg in ("-", "--") or not arg.startswith("-"):
            return None, []  # a script or stdin: not a module run
        # a cluster of one-letter options, e.g. -B, -OO, -Im, -mmlx_lm
        for j, letter in enumerate(arg[1:], start=1):
            if letter == "c":
                return None, []
            if letter == "m":
                if j + 1 < len(arg):
                    return arg[j + 1 :], args[i + 1 :]
                if i + 1 < len(args):
                    return args[i + 1], args[i + 2 :]
                return None, []
            if letter in _OPTS_WITH_VALUE:
                if j + 1 == len(arg):
                    i += 1  # the value is the next argument
                break
        i += 1
    return None, []


class _GenerateLoader(importlib.abc.Loader):
    """Delegates to mlx-lm's loader, then swaps ``main`` for mlx-bricks' wrapper."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from mlx_bricks.generate import _hooked_main

        setattr(module, STOCK_MAIN, module.main)
        module.main = _hooked_main

    def get_code(self, fullname):
        # Only runpy asks for the code object (imports go through exec_module).
        return compile(_RUNPY_SHIM, "<mlx_bricks hook>", "exec")

    def get_source(self, fullname):
        return self._loader.get_source(fullname)

    def is_package(self, fullname):
        return False


class GenerateFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that wraps the loader of ``mlx_lm.generate`` (and nothing else)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        spec.loader = _GenerateLoader(spec.loader)
        return spec


def install() -> bool:
    """Register the finder when this process is ``mlx_lm.generate ... --use-bricks``.

    Called by the ``.pth`` line; idempotent (a venv may process site-packages twice through
    its ``lib64`` link). Returns whether the finder is (now) registered.
    """
    if any(isinstance(f, GenerateFinder) for f in sys.meta_path):
        return True
    if FLAG not in sys.argv or not is_generate_command(
        sys.argv, getattr(sys, "orig_argv", [])
    ):
        return False
    sys.meta_path.insert(0, GenerateFinder())
    return True
