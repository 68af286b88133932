"""``python -m mlx_bricks.bench``: run the benchmarks, print (or write) one JSON object."""
from __future__ import annotations

import argparse
import json
import os
import sys

from mlx_bricks import _cli
from mlx_bricks.entry import flags

PROG = "python -m mlx_bricks.bench"


def build_parser() -> argparse.ArgumentParser:
    from mlx_bricks.bench.core import BENCHMARKS, GROUPS

    parser = argparse.ArgumentParser(
        prog=PROG, description="Time the bricks against stock MLX in the same run; JSON out.")
    parser.add_argument("--only", nargs="+", choices=[*BENCHMARKS, *GROUPS], metavar="NAME",
                        help="benchmarks or groups to run (default: all); benchmarks: "
                        f"{', '.join(n for n in BENCHMARKS if not n.startswith('cuda_'))}, "
                        f"cuda_* ({sum(n.startswith('cuda_') for n in BENCHMARKS)} CUDA twin "
                        "benchmarks); groups: "
                        + ", ".join(f"{g} ({len(m)} benchmarks)" for g, m in GROUPS.items()))
    parser.add_argument("--repeats", type=_cli.positive_int, default=3,
                        help="timed rounds per side, alternating, after a warm-up; a round "
                        "evaluates several calls when one is short (default: 3)")
    flags.add_backend_flag(parser, "--backend", dest="backend")
    parser.add_argument("--out", help="write the JSON here instead of standard output")
    return _cli.one_line_errors(parser)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)

    def body() -> int:
        from mlx_bricks.backends import active_backend
        from mlx_bricks.bench.core import run_benchmarks

        if args.backend is not None:  # the patch and the ops read it
            from mlx_bricks.backends import ENV_VAR

            os.environ[ENV_VAR] = args.backend
        active_backend()  # an unknown or unavailable MLX_BRICKS_BACKEND fails, as elsewhere

        if args.out:  # before the run, so a bad path does not cost the results
            parent = os.path.dirname(os.path.abspath(args.out))
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK):
                raise _cli.CliError(f"--out {args.out!r}: {parent} is not a writable directory")

        def write(doc):
            try:
                with open(args.out + ".tmp", "w") as f:
                    f.write(json.dumps(doc, indent=2) + "\n")
                os.replace(args.out + ".tmp", args.out)
            except OSError as e:
                raise _cli.CliError(f"--out {args.out!r}: {_cli.one_line(e)}") from None

        # With --out the file is rewritten after each benchmark: a run stopped by a time limit
        # keeps what it measured.
        doc = run_benchmarks(args.only, args.repeats, on_result=write if args.out else None)
        if args.out:
            write(doc)
        else:
            print(json.dumps(doc, indent=2))
        return 0

    return _cli.run_cli(PROG, body)


if __name__ == "__main__":
    sys.exit(main())
