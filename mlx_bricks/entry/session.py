"""One run of an mlx-lm command with the bricks: the command's own ``main()`` does the work.

While :meth:`Session.run` runs the command's original ``main``, three names are swapped (and
restored afterwards):

* ``argparse`` in the command's module: the first ``ArgumentParser`` it builds is the
  command's; it gets the ``mlx-bricks`` flags (``mlx_bricks.entry.flags``), the program name,
  one-line errors, and a ``parse_args`` that checks the bricks' arguments and resolves the model
  (:meth:`Session.prepare`) before ``main`` loads anything;
* ``load`` and ``sharded_load`` in the command's module: mlx-lm loads the model, then
  ``patch_model`` patches it (every model the command loads, the server's later ones included;
  a draft model stays stock);
* ``make_prompt_cache`` in the command's module and in ``mlx_lm.generate`` (where
  ``generate_step`` and ``BatchGenerator`` build the caches nobody passed): a model patched with
  ``kv_cache="q8_0"`` gets ``mlx_bricks.make_prompt_cache``'s Q8_0 cache, any other mlx-lm's.

* ``generate_step`` and ``speculative_generate_step`` in ``mlx_lm.generate`` (commands with
  ``Command.first_token``): each prompt's length goes to the model's gate first, so a prompt
  too short to pay for the bricks' one-off first-prefill cost runs stock
  (``tune.prior.min_prompt_tokens``) and the line says so.

This works for any command of ``mlx_bricks.entry.commands.COMMANDS`` because mlx-lm's CLIs share
that shape (``main()``, argparse, the module's own ``load`` name); nothing here names a command.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from mlx_bricks import _cli
from mlx_bricks.entry import flags
from mlx_bricks.entry.commands import COMMANDS, STOCK_MAIN
from mlx_bricks.entry.resolve import check_model_type, default_model_dir, resolve_model

#: mlx-lm's module whose ``generate_step`` and ``BatchGenerator`` make the caches callers omit.
GENERATE_MODULE = "mlx_lm.generate"
#: Its per-prompt generators (first arguments: the prompt's tokens, the model).
PROMPT_STEPS = ("generate_step", "speculative_generate_step")
#: The loaders a command module may hold (each swapped where present).
LOADERS = ("load", "sharded_load")
#: ``--model`` help while the flags are on (mlx-lm's names its own default).
MODEL_HELP = ("The path to a local model directory, a .gguf file or a Hugging Face repo. "
              "Default with --use-bricks: the embedded default model (SmolLM2-135M-Instruct).")

LOG = logging.getLogger("mlx_bricks")


def summary_line(report) -> str:
    """One line about a patch: the backend, what was patched, why nothing was when the model
    was left stock on purpose (no kernel backend), the Q8_0 KV cache's layers when asked for,
    and the tuning mode when it applies."""
    line = (f"backend: {report.backend}; patched {report.n_patched} modules, "
            f"{report.n_fallback + report.n_stock} kept stock")
    stock = sorted({m.reason for m in report.modules if m.status == "stock"})
    if stock:
        line += f" ({'; '.join(stock)})"
    if report.kv_caches:  # patch_model(kv_cache="q8_0"): the cache is a patch too
        q8 = sum(k == "Q8KVCache" for _, k, _ in report.kv_caches)
        line += (f"; KV cache: Q8_0 in {q8}/{len(report.kv_caches)} layers (the cache is "
                 "patched apart from the modules: stock and brick attention both read it)")
    if report.tuning()["applies"]:
        line += f"; tuning: {report.options['tune']}"
    return line


def check_args(args: argparse.Namespace) -> None:
    """Bad values mlx-lm would accept or fail on late, for the flags the command has.

    Raises:
        CliError: an empty ``--prompt``; ``--bricks-kv q8_0`` without ``--use-bricks`` or with
            ``--kv-bits``; ``--prefill-step-size`` below 1; ``--max-tokens`` 0 or below -1.
    """
    prompt = getattr(args, "prompt", None)
    if isinstance(prompt, str) and not prompt.strip():
        raise _cli.CliError("--prompt is empty")
    if args.bricks_kv == "q8_0":
        if not args.use_bricks:
            raise _cli.CliError("--bricks-kv q8_0 needs --use-bricks (the stock attention "
                                "cannot read a Q8_0 cache)")
        if getattr(args, "kv_bits", None) is not None:
            raise _cli.CliError("--kv-bits and --bricks-kv q8_0 exclude each other (both "
                                "quantize the KV cache); choose one")
    step = getattr(args, "prefill_step_size", None)
    if isinstance(step, int) and step < 1:
        raise _cli.CliError(f"--prefill-step-size must be >= 1, got {step}")
    max_tokens = getattr(args, "max_tokens", None)
    if isinstance(max_tokens, int) and (max_tokens == 0 or max_tokens < -1):
        raise _cli.CliError(
            f"--max-tokens must be a positive integer or -1 (no limit), got {max_tokens}")


class _ArgparseProxy:
    """``argparse`` as the command's module sees it during the session: the same module, except
    that the first parser it builds is handed to :meth:`Session.adopt`."""

    def __init__(self, session: "Session"):
        self._session = session

    def __getattr__(self, name):
        return getattr(argparse, name)

    def ArgumentParser(self, *args, **kwargs):  # noqa: N802 (argparse's name)
        parser = argparse.ArgumentParser(*args, **kwargs)
        if self._session.parser is None:
            self._session.adopt(parser)
        return parser


class _PatchingLoad:
    """Stands in for a command module's ``load`` / ``sharded_load``: loads like mlx-lm, then
    patches the model. A call with the path alone is mlx-lm 0.32's draft-model load
    (``mlx_lm.generate`` and ``mlx_lm.server`` load ``--draft-model`` so; every main load passes
    keyword arguments): that model stays stock."""

    def __init__(self, session: "Session", load):
        self._session = session
        self._load = load

    def __call__(self, path_or_hf_repo, *args, **kwargs):
        s = self._session
        bricks = s.args is not None and s.args.use_bricks and bool(args or kwargs)
        path = path_or_hf_repo
        if bricks:  # a model named later (a server request) gets the checks --model got
            path = resolve_model(str(path), what="model", allow_hub=True, need_patchable=True)
            path = str(path)
        try:
            result = self._load(path, *args, **kwargs)
        except (OSError, ValueError) as e:  # mlx-lm's errors for a bad model (or hub failure)
            raise _cli.CliError(f"cannot load {str(path)!r}: {_cli.one_line(e)}") from None
        if not bricks:
            return result
        if len(result) == 3:  # the config came back: check what a hub repo holds
            check_model_type(result[2], path)
        s.patch(result[0], str(path))
        return result


class _BricksPromptCache:
    """Stands in for ``make_prompt_cache``: a model patched with ``kv_cache="q8_0"`` gets
    ``mlx_bricks.make_prompt_cache(model, "q8_0")``; any other model (stock, a draft model, a
    model patched with the fp16 cache) gets mlx-lm's own."""

    def __init__(self, make_prompt_cache):
        self._stock = make_prompt_cache

    def __call__(self, model, max_kv_size=None):
        from mlx_bricks.patch import patch_report

        report = patch_report(model)
        if report is not None and report.options.get("kv_cache") == "q8_0":
            from mlx_bricks.cache import make_prompt_cache

            return make_prompt_cache(model, "q8_0", max_kv_size=max_kv_size)
        return self._stock(model, max_kv_size=max_kv_size)


class _FirstTokenGuard:
    """Stands in for ``generate_step`` / ``speculative_generate_step``: tells the model's gate
    the prompt's length before the original generator starts (``nn.gate``'s first-token
    guard); says once per session when a prompt runs stock because of it."""

    def __init__(self, session: "Session", step):
        self._session = session
        self._step = step

    def __call__(self, prompt, model, *args, **kwargs):
        from mlx_bricks.nn.gate import model_gate

        gate = model_gate(model)
        if gate is not None and gate.min_prompt:
            embeddings = kwargs.get("input_embeddings")
            n = int(prompt.size) if embeddings is None else int(embeddings.shape[0])
            if gate.expect_prompt(n):
                self._session.announce_guard(gate, n)
        return self._step(prompt, model, *args, **kwargs)


class Session:
    """One run of an mlx-lm command with the mlx-bricks flags (module docstring).

    Args:
        command: a name of ``COMMANDS`` (``"generate"``, ``"server"``, ``"chat"``,
            ``"benchmark"``).
        use_bricks_default: default of ``--use-bricks`` (True for ``mlx_bricks.generate``;
            under the hook the flag is on the command line).
        prog: program name in help and error lines (default: the command's module name).
        argv: the command's arguments (default: ``sys.argv[1:]``, as mlx-lm parses them).

    Attributes:
        args: the parsed namespace (None until the command parsed its arguments).
        loaded: ``[(model path, PatchReport)]`` of every model patched so far.

    Raises:
        ValueError: unknown ``command``.
    """

    def __init__(self, command: str, *, use_bricks_default: bool = False,
                 prog: str | None = None, argv: list[str] | None = None):
        if command not in COMMANDS:
            raise ValueError(f"command must be one of {', '.join(COMMANDS)}, got {command!r}")
        self.command = COMMANDS[command]
        self.prog = prog or self.command.module
        self.use_bricks_default = use_bricks_default
        self.argv = argv
        self.args: argparse.Namespace | None = None
        self.parser: argparse.ArgumentParser | None = None
        self.loaded: list[tuple[str, object]] = []
        self._swapped: list[tuple[object, str, object]] = []
        self._guard_announced = False

    # --- the command's parser --------------------------------------------------------------

    def adopt(self, parser: argparse.ArgumentParser) -> None:
        """Make ``parser`` the command's: the bricks flags, our program name, one-line errors,
        and :meth:`prepare` after parsing."""
        self.parser = parser
        parser.prog = self.prog
        c = self.command
        flags.add_bricks_flags(parser, use_bricks_default=self.use_bricks_default,
                               tune_default=c.tune,
                               tune_when="right after loading, before the first request"
                               if c.tune_at_load else "at the first prefill")
        _cli.one_line_errors(parser)
        parse = parser.parse_args

        def parse_args(args=None, namespace=None):
            stock_default = self._model_flag_default(parser)
            ns = parse(self.argv if args is None else args, namespace)
            self.prepare(ns, stock_default)
            return ns

        parser.parse_args = parse_args  # an instance attribute overrides the method

    @staticmethod
    def _model_flag_default(parser) -> object:
        """Set ``--model``'s default to None (so :meth:`prepare` sees whether it was given) and
        its help to ours; return mlx-lm's default. argparse has no public way to edit an added
        argument; these attributes have been stable since Python 3.2."""
        action = parser._option_string_actions.get("--model")
        if action is None:
            return None
        stock, action.default, action.help = action.default, None, MODEL_HELP
        return stock

    def prepare(self, args: argparse.Namespace, stock_model_default=None) -> None:
        """Check the parsed arguments and resolve the model, before the command loads it.

        Without ``--use-bricks`` under the hook (``--use-bricks --no-use-bricks``) the command
        runs as stock, with mlx-lm's default model. ``mlx_bricks.generate --no-use-bricks`` is
        stock with the embedded default model.

        Raises:
            CliError: bad input (:func:`check_args`, :func:`resolve_model`).
            mlx_bricks.backends.BackendError: unknown or unavailable ``--bricks-backend``.
        """
        self.args = args
        has_model = hasattr(args, "model")
        if not args.use_bricks and not self.use_bricks_default:
            if has_model and args.model is None:
                args.model = stock_model_default
            return
        check_args(args)
        if args.use_bricks:
            from mlx_bricks.backends import active_backend
            from mlx_bricks.bricks.dequantize.composite import resolve_cap

            try:  # a bad MLX_BRICKS_DEQUANT_CAP: one line, exit 2, before loading
                resolve_cap()
            except (TypeError, ValueError) as e:
                raise _cli.CliError(str(e)) from None

            active_backend(args.bricks_backend)  # an unavailable backend fails before loading
        if args.bricks_kv == "q8_0":
            from mlx_bricks.cache import register_with_mlx_lm

            register_with_mlx_lm()  # --prompt-cache-file is read before the model is loaded
        if not has_model:
            return
        if args.model is None and getattr(args, "prompt_cache_file", None) is not None:
            return  # mlx_lm.generate takes the model from the cache file's metadata
        if args.model is None:
            args.model = str(default_model_dir())
        else:
            args.model = str(resolve_model(args.model, what="--model", allow_hub=True,
                                           need_patchable=args.use_bricks))

    # --- loading and patching --------------------------------------------------------------

    def patch(self, model, path: str):
        """``patch_model(model)`` with the session's flags; announce and record it."""
        from mlx_bricks.patch import patch_model

        a = self.args
        report = patch_model(model, kv_cache=a.bricks_kv,
                             mlp_variant=flags.mlp_variant(a.bricks_mlp_variant),
                             backend=a.bricks_backend, tune=a.bricks_tune)
        if self.command.tune_at_load and report.dispatch is not None and a.bricks_tune in (
                "auto", "force"):
            if report.backend.name in ("metal", "cuda"):
                self._tune_at_load(model, report)
            else:  # no kernel backend: the CPU prior is measured (tune/prior.py); no waiting
                report.dispatch.mode = "cached"
        if self.command.first_token:
            self._guard_first_token(model, report)
        self.loaded.append((path, report))
        if self.command.announce == "log":  # the per-layer report only with --bricks-report
            LOG.info("[mlx-bricks] %s: %s", path, summary_line(report))
        elif getattr(a, "verbose", True):
            print(f"[mlx-bricks] {summary_line(report)}", file=sys.stderr, flush=True)
        return report

    @staticmethod
    def _guard_first_token(model, report) -> None:
        """Set the model's first-token guard: the shortest prompt whose first bricks prefill in
        this process is expected no later than stock's (``tune.prior.min_prompt_tokens``).
        Only with ``--bricks-tune cached`` (the default here): ``auto``, ``force`` and ``off``
        ask for the bricks to be measured or run."""
        from mlx_bricks.nn.gate import model_gate
        from mlx_bricks.tune.prior import min_prompt_tokens, saved_s_per_token

        gate = model_gate(model)
        if gate is not None and report.options.get("tune") == "cached":
            backend = report.backend.name
            gate.min_prompt = min_prompt_tokens(
                backend, saved_s_per_token(backend, (m for m, _, _ in gate.modules)))

    def announce_guard(self, gate, tokens: int) -> None:
        """Say (once per session) that a prompt of ``tokens`` runs stock because of the
        first-token guard."""
        if self._guard_announced or not getattr(self.args, "verbose", True):
            return
        self._guard_announced = True
        pays = (f"they pay from about {gate.min_prompt:,.0f} tokens for this model"
                if gate.min_prompt != float("inf") else
                "nothing they would run here is measured faster for this model's weights")
        line = (f"[mlx-bricks] prompt of {tokens:,} tokens: stock prefill (the bricks' first "
                f"prefill in a fresh process on {gate.backend} costs more than it saves; "
                f"{pays}; tune/prior.py)")
        if self.command.announce == "log":
            LOG.info(line)
        else:
            print(line, file=sys.stderr, flush=True)

    def _tune_at_load(self, model, report) -> None:
        """Take every piece's decision for one chunk per M bucket now (cached ones are read,
        missing ones measured: only the first start on a device waits), then serve in
        ``cached`` mode: no request waits for a measurement."""
        from mlx_bricks.tune.ahead import measure_ahead
        from mlx_bricks.tune.buckets import DEFAULT_M

        vocab = getattr(getattr(model, "args", None), "vocab_size", 2)
        LOG.info("[mlx-bricks] taking the tuning decisions before the first request "
                 "(measured once per device, then read from the cache)")
        measure_ahead(model, report, DEFAULT_M, vocab if isinstance(vocab, int) else 2)
        report.dispatch.mode = "cached"

    def final_report(self) -> None:
        """``--bricks-report``: each patched model's report, with the calls its bricks served
        (after the command, so the counters are final)."""
        for path, report in self.loaded:
            if self.command.announce == "log":
                LOG.info("[mlx-bricks] final patch report of %s:\n%s", path, report)
            else:
                print(report, file=sys.stderr)

    # --- running ---------------------------------------------------------------------------

    def _swap(self, module, name: str, value) -> None:
        self._swapped.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def run(self) -> int:
        """Run the command's original ``main`` with the swaps in place; returns 0.

        Raises:
            CliError, BackendError: bad input (``_cli.run_cli`` makes them one line, exit 2).
        """
        module = importlib.import_module(self.command.module)
        stock_main = getattr(module, STOCK_MAIN, module.main)
        self._swap(module, "argparse", _ArgparseProxy(self))
        for name in LOADERS:
            if hasattr(module, name):
                self._swap(module, name, _PatchingLoad(self, getattr(module, name)))
        generate = importlib.import_module(GENERATE_MODULE)
        for m in dict.fromkeys((module, generate)):
            if hasattr(m, "make_prompt_cache"):
                self._swap(m, "make_prompt_cache", _BricksPromptCache(m.make_prompt_cache))
        if self.command.first_token:
            for name in PROMPT_STEPS:
                if hasattr(generate, name):
                    self._swap(generate, name, _FirstTokenGuard(self, getattr(generate, name)))
        reported = []
        restore = self._report_on_interrupt(reported)
        try:
            stock_main()
        finally:
            restore()
            while self._swapped:
                m, name, value = self._swapped.pop()
                setattr(m, name, value)
        if self._reporting() and not reported:
            self.final_report()
        return _cli.EXIT_OK

    def _reporting(self) -> bool:
        return self.args is not None and self.args.use_bricks and self.args.bricks_report

    def _report_on_interrupt(self, reported: list):
        """With ``--bricks-report``, the final report is logged when Ctrl-C / SIGINT arrives,
        before the command's own shutdown (a server joins its generation thread then, which can
        take long or end in an abort inside MLX); returns the function that restores the
        previous handler."""
        import signal
        import threading

        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = signal.getsignal(signal.SIGINT)

        def on_interrupt(signum, frame):
            if self._reporting() and not reported:
                reported.append(True)
                self.final_report()
            if previous is signal.SIG_IGN:
                return None
            if callable(previous):
                return previous(signum, frame)
            raise KeyboardInterrupt

        signal.signal(signal.SIGINT, on_interrupt)
        return lambda: signal.signal(signal.SIGINT, previous)


def run_command(command: str, argv: list[str] | None = None, *, use_bricks_default=False,
                prog: str | None = None) -> int:
    """Run mlx-lm's ``command`` with the bricks flags and the CLI conventions (bad input: one
    line, exit 2; Ctrl-C: exit 130).

    Args:
        command, use_bricks_default, prog, argv: as :class:`Session`.

    Returns:
        0 on success.

    Raises:
        SystemExit: 2 on bad input, 130 on Ctrl-C; argparse's own exits (``--help``: 0).
    """
    session = Session(command, use_bricks_default=use_bricks_default, prog=prog, argv=argv)
    return _cli.run_cli(session.prog, session.run)


def hooked_main(command: str):
    """What a hooked module's ``main`` becomes (``mlx_bricks.entry.hook``): ``command`` run
    through :func:`run_command`."""

    def main() -> int:
        return run_command(command)

    main.__doc__ = f"mlx_lm.{command} with the mlx-bricks flags (mlx_bricks.entry.session)."
    return main
