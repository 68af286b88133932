"""``python -m mlx_bricks.gguf PATH.gguf OUT_DIR``: convert a GGUF file to an mlx-lm directory."""
from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_DTYPE = "float16"
PROG = "python -m mlx_bricks.gguf"


def setup_arg_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m mlx_bricks.gguf PATH.gguf OUT_DIR [...]``."""
    from mlx_bricks._cli import one_line_errors

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Convert a GGUF model (llama, qwen2, qwen3, gemma3) into a directory "
                    "that mlx_lm.load opens.",
    )
    parser.add_argument("gguf", metavar="PATH.gguf", help="the GGUF file")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the directory to create")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE,
                        choices=("float16", "bfloat16", "float32"),
                        help=f"dtype of dense tensors and quantization scales "
                             f"(default: {DEFAULT_DTYPE})")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="keep quantized matrices as MLX affine quantized tensors (group "
                             "size 32): Q4_0/Q4_1/Q4_K -> 4-bit, Q5_0/Q5_1/Q5_K -> 5-bit, Q8_0 "
                             "-> 8-bit (exact), Q2_K/Q3_K/Q6_K -> 3/4/8-bit and IQ4/IQ3/IQ2 -> "
                             "5/4/3-bit (re-quantized; the error is printed); dequantize other "
                             "types")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return one_line_errors(parser)


def main(argv: list[str] | None = None) -> int:
    """Convert a GGUF file; returns the exit status: 0 ok, 2 bad input (one line on stderr),
    130 interrupted (Ctrl-C: one line, no traceback, nothing left behind)."""
    from mlx_bricks._cli import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, one_line

    args = setup_arg_parser().parse_args(argv)
    try:
        from mlx_bricks import env

        env.check()  # a bad MLX_BRICKS_* value: one line, before any work
        logging.basicConfig(format="%(message)s", level=logging.INFO)
        from .convert import convert_gguf

        out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype,
                           keep_quantized=args.keep_quantized, force=args.force,
                           progress=not args.no_progress)
    except (ValueError, OSError) as e:  # OSError: missing file, OUT_DIR exists, disk full...
        # (ValueError includes env.EnvError)
        print(f"{PROG}: error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:  # convert_gguf has removed its temporary directory
        sys.stdout.flush()
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"wrote {out}")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
