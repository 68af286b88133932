"""The mlx-lm commands that take ``--use-bricks``: one table, read by the import hook (which
program is this?) and the session (what to swap in it). Standard library only: the hook reads
it at interpreter start.

Adding a command is one line here when its module follows mlx-lm's CLI shape: a module-level
``main()``, an ``argparse.ArgumentParser`` built by it (or by ``setup_arg_parser()``), and the
model loaded through the module's own ``load`` / ``sharded_load`` names.
"""
from __future__ import annotations

#: Attribute of a hooked mlx-lm module that keeps its original ``main``.
STOCK_MAIN = "_mlx_bricks_stock_main"


class Command:
    """One target command.

    Attributes:
        name: the subcommand of ``python -m mlx_lm NAME`` (``"server"``).
        module: the module that runs it (``"mlx_lm.server"``), also its console script's name
            and the program name in its help and error lines.
        announce: where the patch summary of each loaded model goes: ``"stderr"`` (one line)
            or ``"log"`` (``logging.info``: the server's log).
        tune: default of ``--bricks-tune``: ``"cached"`` where a user waits for the first
            token of a fresh process (nothing is measured on that path), ``"auto"`` where the
            command warms up before it measures (``benchmark``).
        tune_at_load: measure the missing decisions right after loading, before the first
            request, then serve from them (``--bricks-tune auto`` or ``force``; the server).
        first_token: the first-token guard (``nn.gate``): a prompt too short to pay for the
            bricks' one-off first-prefill cost in a fresh process runs stock (commands a user
            runs once per prompt: ``generate``, and ``chat``'s first turns).
    """

    __slots__ = ("name", "module", "announce", "tune", "tune_at_load", "first_token")

    def __init__(self, name: str, announce: str = "stderr", tune: str = "cached",
                 tune_at_load: bool = False, first_token: bool = False):
        self.name = name
        self.module = f"mlx_lm.{name}"
        self.announce = announce
        self.tune = tune
        self.tune_at_load = tune_at_load
        self.first_token = first_token

    def __repr__(self) -> str:
        return f"Command({self.name!r}, announce={self.announce!r}, tune={self.tune!r})"


#: name -> Command, for every command the hook serves.
COMMANDS = {c.name: c for c in (
    Command("generate", first_token=True),
    Command("server", announce="log", tune="auto", tune_at_load=True),
    Command("chat", first_token=True),
    Command("benchmark", tune="auto"),
)}
#: module name (``"mlx_lm.server"``) -> Command.
BY_MODULE = {c.module: c for c in COMMANDS.values()}
