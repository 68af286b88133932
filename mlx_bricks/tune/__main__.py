"""``python -m mlx_bricks.tune [MODEL_DIR]``: tune a model ahead of time; show or clear the cache.

Tuning patches the model (``patch_model(tune="auto")``, or ``"force"`` with ``--force``) and runs
one prefill per ``--m`` value (a prompt of M random tokens in one chunk, so the attention pieces
see q_len = kv_len = M): every piece's decision for those shape buckets is then taken (from the
cache, or measured) and written to the cache, so later runs of the same model on this device
start without measuring. Decisions are printed (``--json``: one JSON object).

``--show`` prints this device's cached decisions; ``--clear`` deletes the cache file. Exit
status: 0 done, 2 bad input (one line on stderr), 130 Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import sys

from mlx_bricks import _cli
from mlx_bricks.entry import flags

PROG = "python -m mlx_bricks.tune"
from mlx_bricks.tune.buckets import DEFAULT_M


def setup_arg_parser() -> argparse.ArgumentParser:
    """Parser of ``python -m mlx_bricks.tune``; a bad flag value exits 2 with one line."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Measure, on this device, which mlx-bricks variants beat stock MLX for a "
        "model's shapes, and cache the decisions (docs/tuning.md). Exit status: 0 done, 2 bad "
        "input.")
    parser.add_argument(
        "model_dir", metavar="MODEL_DIR", nargs="?", default=None,
        help="mlx-lm model directory or .gguf file (default: the embedded default model)")
    parser.add_argument("--m", type=_cli.positive_int, nargs="+", default=list(DEFAULT_M),
                        metavar="M", help="prefill chunk sizes (tokens) to tune for "
                        f"(default: {' '.join(map(str, DEFAULT_M))}: one per M bucket)")
    flags.add_backend_flag(parser, "--backend", "--bricks-backend", dest="backend")
    parser.add_argument("--force", action="store_true",
                        help="measure again even where the cache has a decision")
    parser.add_argument("--show", action="store_true",
                        help="print this device's cached decisions and exit")
    parser.add_argument("--clear", action="store_true", help="delete the cache file and exit")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return _cli.one_line_errors(parser)


def _print_decisions(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    print(f"tuning cache: {result['cache']}")
    if result.get("context"):
        print(f"context: {result['context']}")
    if result.get("note"):
        print(result["note"])
    decisions = result.get("decisions", [])
    if decisions:
        print("decisions (ratio = stock time / best brick time):")
        for d in decisions:
            ratio = "-" if d.get("ratio") is None else f"x{d['ratio']:.2f}"
            print(f"  {d['key']}: {d['winner']} ({ratio}) {d.get('source', '')}".rstrip())
    elif not result.get("note"):
        print("no decisions")


def _show(cache) -> dict:
    from mlx_bricks.tune.tuner import Decision

    decisions = []
    for key, data in sorted(cache.decisions().items()):
        try:
            d = Decision.from_dict(key, data)
        except ValueError:
            continue
        decisions.append({"key": key, "winner": d.winner, "ratio": d.ratio,
                          "reason": d.reason, "source": "cache"})
    return {"cache": str(cache.path), "context": cache.context.id, "decisions": decisions}


def _tune(args) -> dict:
    from mlx_lm.utils import load_model

    from mlx_bricks.entry.resolve import load_patchable
    from mlx_bricks.patch import patch_model
    from mlx_bricks.tune.ahead import measure_ahead
    from mlx_bricks.tune.cache import default_path

    # no tokenizer needed: the tokens are random
    model_dir, (model, config) = load_patchable(args.model_dir, args.backend, load_model)
    report = patch_model(model, backend=args.backend, tune="force" if args.force else "auto")
    result = {"cache": str(default_path()), "model": str(model_dir),
              "backend": report.backend.name, "m": list(args.m)}
    tuning = report.tuning()
    if not tuning["applies"]:
        result["note"] = f"nothing to tune: {tuning['why']}"
        result["decisions"] = []
        return result
    measure_ahead(model, report, args.m, int(config.get("vocab_size", 2)))
    tuning = report.tuning()
    result["context"] = report.dispatch.cache.context.id
    result["decisions"] = tuning["decisions"]
    result["disabled"] = tuning["disabled"]
    return result


def run(args: argparse.Namespace) -> int:
    """The command; returns the exit status."""
    if args.show and args.clear:
        raise _cli.CliError("--show and --clear are exclusive")
    if args.show or args.clear:
        from mlx_bricks.tune.cache import DecisionCache

        cache = DecisionCache()
        if args.clear:
            existed = cache.clear()
            result = {"cache": str(cache.path), "cleared": existed,
                      "note": "deleted" if existed else "no cache file"}
        else:
            result = _show(cache)
    else:
        result = _tune(args)
    _print_decisions(result, args.json)
    return _cli.EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point; see the module docstring.

    Raises:
        SystemExit: 2 on bad input (one line on stderr), 130 on Ctrl-C.
    """
    args = setup_arg_parser().parse_args(argv)
    return _cli.run_cli(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
