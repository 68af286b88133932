"""The import hook behind ``mlx_lm.generate --use-bricks``, ``mlx_lm.server --use-bricks``, ...

mlx-lm has no plugin mechanism, so the wheel installs one line into site-packages,
``mlx_bricks_hook.pth`` (written by ``setup.py``, see ``PTH_LINE``). ``site`` runs it at every
interpreter start; it only tests whether ``--use-bricks`` is in ``sys.argv`` and imports this
module when it is, so an unrelated process pays one list scan and imports nothing.

``install()`` then checks that the program is one of the commands of
``mlx_bricks.entry.commands.COMMANDS``, started in any of mlx-lm's three forms
(``mlx_lm.server ...``, ``python -m mlx_lm server ...``, the deprecated
``python -m mlx_lm.server ...``), and puts a finder at the front of ``sys.meta_path``. When that
command's module is imported, the finder lets the normal loader run and then replaces the
module's ``main`` with the session's (``mlx_bricks.entry.session.hooked_main``, imported only
then), which runs mlx-lm's own ``main``, kept as ``<module>._mlx_bricks_stock_main``.
Uninstalling the wheel removes the ``.pth`` file, and with it the hook.

This module must stay cheap to import: standard library only, no ``mlx``.
"""
from __future__ import annotations

import importlib.abc
import sys

from mlx_bricks.entry.commands import BY_MODULE, COMMANDS, STOCK_MAIN, Command

FLAG = "--use-bricks"
PTH_NAME = "mlx_bricks_hook.pth"
# Kept in sync with setup.py (which cannot import the package while it builds it);
# tests/test_cli.py compares both, and the installed file, with this line.
PTH_LINE = (
    "import sys; {'--use-bricks', '--help', '-h'} & set(getattr(sys, 'argv', ())) "
    "and __import__('mlx_bricks.entry.hook').entry.hook.install()\n"
)

# How the deprecated `python -m mlx_lm.X` runs: runpy executes the module's code object as
# __main__; we hand runpy this code instead, which runs the same CLI through the session.
_RUNPY_SHIM = (
    "import sys\n"
    "from mlx_bricks.entry.session import hooked_main\n"
    "sys.exit(hooked_main({name!r})())\n"
)


def target_command(argv: list[str], orig_argv: list[str]) -> Command | None:
    """The command of ``COMMANDS`` this process runs, or None.

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
        return BY_MODULE.get(name)
    module, rest = _module_run(orig_argv[1:])
    if module in BY_MODULE:
        return BY_MODULE[module]
    if module == "mlx_lm" and rest:
        return COMMANDS.get(rest[0])
    return None


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


class _CommandLoader(importlib.abc.Loader):
    """Delegates to mlx-lm's loader, then swaps ``main`` for the session's."""

    def __init__(self, loader, command: Command):
        self._loader = loader
        self._command = command

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        from mlx_bricks.entry.session import hooked_main

        setattr(module, STOCK_MAIN, module.main)
        module.main = hooked_main(self._command.name)

    def get_code(self, fullname):
        # Only runpy asks for the code object (imports go through exec_module).
        return compile(_RUNPY_SHIM.format(name=self._command.name), "<mlx_bricks hook>", "exec")

    def get_source(self, fullname):
        return self._loader.get_source(fullname)

    def is_package(self, fullname):
        return False


class CommandFinder(importlib.abc.MetaPathFinder):
    """Meta-path finder that wraps the loader of one command's module (and nothing else)."""

    def __init__(self, command: Command):
        self.command = command

    def find_spec(self, fullname, path, target=None):
        if fullname != self.command.module:
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
        spec.loader = _CommandLoader(spec.loader, self.command)
        return spec


def install() -> bool:
    """Register the finder when this process is ``<command> ... --use-bricks`` (or ``--help``)
    for a command of the table.

    Called by the ``.pth`` line; idempotent (a venv may process site-packages twice through
    its ``lib64`` link). Returns whether a finder is (now) registered.
    """
    if any(isinstance(f, CommandFinder) for f in sys.meta_path):
        return True
    # --help too: the command's help then lists the mlx-bricks flags (it exits before running)
    if FLAG not in sys.argv and not {"-h", "--help"} & set(sys.argv[1:]):
        return False
    command = target_command(sys.argv, getattr(sys, "orig_argv", []))
    if command is None:
        return False
    sys.meta_path.insert(0, CommandFinder(command))
    return True
