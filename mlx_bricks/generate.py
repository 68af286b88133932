"""``mlx_lm.generate`` with the bricks: every ``mlx_lm.generate`` flag, plus ``--use-bricks``.

One code path, four ways to run it (docs/cli.md):

    mlx_lm.generate --use-bricks [FLAGS]            through the import hook (mlx_bricks/_hook.py)
    python -m mlx_lm generate --use-bricks [FLAGS]  same
    mlx_bricks.generate [FLAGS]                     console script, no hook; bricks on by default
    python -m mlx_bricks.generate [FLAGS]           same

mlx-lm's own ``main()`` does the work (prompt, chat template, sampling, ``--verbose`` output with
mlx-lm's prompt tokens/s); this module parses the command line with mlx-lm's parser plus the
mlx-bricks flags, and swaps in a ``load`` that patches the model right after mlx-lm loads it.
Differences from stock ``mlx_lm.generate``:

* without ``--model`` (and without ``--prompt-cache-file``), the embedded default model
  (SmolLM2-135M-Instruct, converted from its GGUF once) instead of mlx-lm's default;
* ``--model`` may also be a ``.gguf`` file (converted once into the cache, see ``_cli``);
* bad input (missing model directory, no config.json, unsupported model_type, unreadable
  weights, empty prompt, bad flag value, unavailable backend) is one line on stderr and exit 2;
  Ctrl-C exits 130 without a traceback;
* mlx-bricks' own lines (backend, patch counts, ``--bricks-report``) go to stderr, so stdout is
  what mlx-lm prints.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from mlx_bricks import _cli
from mlx_bricks.bricks.swiglu.variants import VARIANT_ENV_VAR as SWIGLU_VARIANT_ENV
from mlx_bricks.bricks.swiglu.variants import VARIANTS as SWIGLU_VARIANTS

PROG = "mlx_bricks.generate"
#: ``--bricks-kv``: mlx-lm's KV cache, or the Q8_0 cache (``patch_model(kv_cache=...)``).
BRICKS_KV_CHOICES = ("fp16", "q8_0")
#: ``patch_model(tune=...)`` values (kept here so --help does not import MLX).
BRICKS_TUNE_CHOICES = ("auto", "off", "force")
DEFAULT_BRICKS_KV = "fp16"


def setup_arg_parser(
    *, use_bricks_default: bool = True, prog: str = PROG
) -> argparse.ArgumentParser:
    """mlx-lm's ``generate`` parser plus the mlx-bricks flags.

    Args:
        use_bricks_default: default of ``--use-bricks/--no-use-bricks`` (True for
            ``mlx_bricks.generate``; the hooked ``mlx_lm.generate`` only runs us when
            ``--use-bricks`` is given).
        prog: program name in help and error lines.

    Returns:
        The parser; a bad flag value exits 2 with one line (``PROG: error: ...``).
    """
    from mlx_lm.generate import setup_arg_parser as mlx_lm_parser

    from mlx_bricks.backends import BACKENDS, ENV_VAR

    parser = mlx_lm_parser()
    parser.prog = prog
    parser.description = "LLM inference with mlx-lm, prefill through the mlx-bricks kernels"
    # mlx-lm's help names its own default model; ours is the embedded one. argparse has no public
    # way to edit an added argument, and this attribute has been stable since Python 3.2.
    parser._option_string_actions["--model"].help = (
        "The path to a local model directory, a .gguf file or a Hugging Face repo. Default: "
        "the embedded default model (SmolLM2-135M-Instruct)."
    )
    group = parser.add_argument_group("mlx-bricks")
    group.add_argument(
        "--use-bricks",
        action=argparse.BooleanOptionalAction,
        default=use_bricks_default,
        help="Patch the model with the mlx-bricks kernels before generating "
        f"(default: {'on' if use_bricks_default else 'off'}).",
    )
    group.add_argument(
        "--bricks-backend",
        choices=BACKENDS,
        default=None,
        help=f"Backend of the bricks (default: ${ENV_VAR}, else auto: metal, cuda, reference).",
    )
    group.add_argument(
        "--bricks-kv",
        choices=BRICKS_KV_CHOICES,
        default=DEFAULT_BRICKS_KV,
        help="KV cache: fp16 (mlx-lm's own cache, whatever its float dtype) or q8_0 (K and V "
        "stored as Q8_0 blocks, 34/64 of the float16 bytes, read directly by the attention "
        "and decode bricks; sliding-window layers keep mlx-lm's rotating cache). "
        f"Default: {DEFAULT_BRICKS_KV}.",
    )
    group.add_argument(
        "--bricks-mlp-variant",
        choices=("auto", *SWIGLU_VARIANTS),
        default="auto",
        help=f"SwiGLU brick variant: fused, split, or auto (${SWIGLU_VARIANT_ENV}, else the "
        "brick's rule). Default: auto.",
    )
    group.add_argument(
        "--bricks-tune",
        choices=BRICKS_TUNE_CHOICES,
        default="auto",
        help="Tuning on a kernel backend (metal, cuda): auto (cached decisions; the missing "
        "ones are measured at the first prefill), force (measure again), off (the bricks' own "
        "rules, unmeasured). Default: auto.",
    )
    group.add_argument(
        "--bricks-report",
        action="store_true",
        help="Print the per-layer patch report, with the calls each brick served, to stderr "
        "after generating.",
    )
    return _cli.one_line_errors(parser)


class _ParsedArgs:
    """Stands in for mlx-lm's parser inside its ``main()``: returns our parsed namespace."""

    def __init__(self, args: argparse.Namespace):
        self._args = args

    def parse_args(self, *_, **__) -> argparse.Namespace:
        return self._args


class _PatchingLoad:
    """Stands in for ``mlx_lm.generate.load``: loads like mlx-lm, then patches the first model
    it loads (the main one; a ``--draft-model`` stays stock)."""

    def __init__(self, load, args: argparse.Namespace):
        self._load = load
        self._args = args
        self.report = None

    def __call__(self, path_or_hf_repo, *args, **kwargs):
        try:
            result = self._load(path_or_hf_repo, *args, **kwargs)
        except (OSError, ValueError) as e:  # mlx-lm's errors for a bad model (or hub failure)
            raise _cli.CliError(f"cannot load {str(path_or_hf_repo)!r}: {_cli.one_line(e)}") \
                from None
        if not self._args.use_bricks or self.report is not None:
            return result
        model = result[0]
        if len(result) == 3:  # mlx-lm's main asks for the config: check what a hub repo holds
            _cli.check_model_type(result[2], path_or_hf_repo)
        from mlx_bricks.patch import patch_model

        variant = self._args.bricks_mlp_variant
        self.report = patch_model(model, kv_cache=self._args.bricks_kv,
                                  mlp_variant=None if variant == "auto" else variant,
                                  backend=self._args.bricks_backend,
                                  tune=self._args.bricks_tune)
        if self._args.verbose:
            print(f"[mlx-bricks] {summary_line(self.report)}", file=sys.stderr)
        sys.stderr.flush()
        self.model = model
        return result


class _BricksPromptCache:
    """Stands in for ``mlx_lm.generate.make_prompt_cache``: the patched model gets
    ``mlx_bricks.make_prompt_cache`` (Q8_0 K/V) under ``--bricks-kv q8_0``; any other model (a
    ``--draft-model``) gets mlx-lm's own cache."""

    def __init__(self, make_prompt_cache, load: _PatchingLoad):
        self._stock = make_prompt_cache
        self._load = load

    def __call__(self, model, max_kv_size=None):
        if model is getattr(self._load, "model", None):
            from mlx_bricks.cache import make_prompt_cache

            return make_prompt_cache(model, "q8_0", max_kv_size=max_kv_size)
        return self._stock(model, max_kv_size=max_kv_size)


def summary_line(report) -> str:
    """One line for ``--verbose``: the backend, what was patched, and why nothing was when
    the model was left stock on purpose (no kernel backend)."""
    line = (f"backend: {report.backend}; patched {report.n_patched} modules, "
            f"{report.n_fallback + report.n_stock} kept stock")
    stock = sorted({m.reason for m in report.modules if m.status == "stock"})
    if stock:
        line += f" ({'; '.join(stock)})"
    tuning = report.tuning()
    if tuning["applies"]:
        line += f"; tuning: {report.options['tune']}"
    return line


def _check_args(args: argparse.Namespace) -> None:
    """Bad flag values mlx-lm would accept or fail on late (raises ``CliError``)."""
    if not args.prompt.strip():
        raise _cli.CliError("--prompt is empty")
    if getattr(args, "bricks_kv", DEFAULT_BRICKS_KV) == "q8_0":
        if not args.use_bricks:
            raise _cli.CliError("--bricks-kv q8_0 needs --use-bricks (the stock attention "
                                "cannot read a Q8_0 cache)")
        if args.kv_bits is not None:
            raise _cli.CliError("--kv-bits and --bricks-kv q8_0 exclude each other (both "
                                "quantize the KV cache); choose one")
    if args.prefill_step_size < 1:
        raise _cli.CliError(f"--prefill-step-size must be >= 1, got {args.prefill_step_size}")
    if args.max_tokens == 0 or args.max_tokens < -1:
        raise _cli.CliError(
            f"--max-tokens must be a positive integer or -1 (no limit), got {args.max_tokens}"
        )


def _generate(argv: list[str] | None, prog: str, use_bricks_default: bool) -> int:
    # Not `import mlx_lm.generate as ...`: the package attribute `generate` is the function.
    mlx_lm_generate = importlib.import_module("mlx_lm.generate")
    from mlx_bricks._hook import STOCK_MAIN

    stock_main = getattr(mlx_lm_generate, STOCK_MAIN, mlx_lm_generate.main)
    args = setup_arg_parser(use_bricks_default=use_bricks_default, prog=prog).parse_args(argv)
    if not args.use_bricks and not use_bricks_default:
        # The hook fired on a "--use-bricks" that was not the flag (--prompt=--use-bricks):
        # this is plain mlx_lm.generate.
        return stock_main() or _cli.EXIT_OK
    _check_args(args)
    if args.use_bricks:
        from mlx_bricks.backends import active_backend

        active_backend(args.bricks_backend)  # an unavailable backend fails before loading
    if args.model is not None or args.prompt_cache_file is None:
        model = _cli.resolve_model(args.model, what="--model", allow_hub=True,
                                   need_patchable=args.use_bricks)
        args.model = str(model)

    saved = (mlx_lm_generate.setup_arg_parser, mlx_lm_generate.load,
             mlx_lm_generate.make_prompt_cache)
    mlx_lm_generate.setup_arg_parser = lambda: _ParsedArgs(args)
    mlx_lm_generate.load = load = _PatchingLoad(mlx_lm_generate.load, args)
    if args.use_bricks and args.bricks_kv == "q8_0":
        from mlx_bricks.cache import register_with_mlx_lm

        register_with_mlx_lm()  # --prompt-cache-file is read before the model is loaded
        mlx_lm_generate.make_prompt_cache = _BricksPromptCache(saved[2], load)
    try:
        stock_main()
    finally:
        (mlx_lm_generate.setup_arg_parser, mlx_lm_generate.load,
         mlx_lm_generate.make_prompt_cache) = saved
    if args.bricks_report and load.report is not None:
        # After the run, so the report's call counters say which bricks really ran.
        print(load.report, file=sys.stderr)
    return _cli.EXIT_OK


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
    return _cli.run_cli(prog, lambda: _generate(argv, prog, use_bricks_default=True))


def _hooked_main(argv: list[str] | None = None) -> int:
    """What ``mlx_lm.generate``'s ``main`` becomes while the hook is installed."""
    prog = "mlx_lm.generate"
    return _cli.run_cli(prog, lambda: _generate(argv, prog, use_bricks_default=False))


if __name__ == "__main__":
    sys.exit(main())
