"""``python -m mlx_bricks.gguf PATH.gguf OUT_DIR``: convert a GGUF file to an mlx-lm directory."""
from __future__ import annotations

import argparse
import logging
import sys

DEFAULT_DTYPE = "float16"


def setup_arg_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m mlx_bricks.gguf PATH.gguf OUT_DIR [...]``."""
    parser = argparse.ArgumentParser(
        prog="python -m mlx_bricks.gguf",
        description="Convert a GGUF model (llama, qwen2, qwen3) into a directory that "
                    "mlx_lm.load opens.",
    )
    parser.add_argument("gguf", metavar="PATH.gguf", help="the GGUF file")
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the directory to create")
    parser.add_argument("--dtype", default=DEFAULT_DTYPE,
                        choices=("float16", "bfloat16", "float32"),
                        help=f"dtype of dense tensors and quantization scales "
                             f"(default: {DEFAULT_DTYPE})")
    parser.add_argument("--keep-quantized", action="store_true",
                        help="keep Q4_0/Q4_1/Q8_0 weights as MLX 4/8-bit affine quantized "
                             "tensors (exact); dequantize everything else")
    parser.add_argument("--force", action="store_true",
                        help="replace OUT_DIR if it exists and is not empty")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Convert a GGUF file; returns the exit status (0 ok, 2 bad input, one line on stderr)."""
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(format="%(message)s", level=logging.INFO)
    from .convert import convert_gguf

    try:
        out = convert_gguf(args.gguf, args.out_dir, dtype=args.dtype,
                           keep_quantized=args.keep_quantized, force=args.force,
                           progress=not args.no_progress)
    except (ValueError, OSError) as e:  # OSError: missing file, OUT_DIR exists, disk full...
        message = " ".join(str(e).split())
        print(f"python -m mlx_bricks.gguf: error: {message}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
