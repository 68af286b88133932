"""The GEMM brick's tuner kind ``linear``: ``y = x @ W.T (+ bias) (+ residual)`` against what
``nn.Linear`` / ``nn.QuantizedLinear`` compute (``mx.addmm`` with a bias,
``mx.quantized_matmul(..., transpose=True)`` for an affine weight), plus the block's residual
add. Arguments: ``x, weight, bias, residual`` (weight an array or a ``QuantizedWeight``).

Composites (affine and microscaled weights): ``dequant`` / ``dequant_brick`` (affine only),
the weight dequantized in row tiles (``mx.dequantize`` / the dequantize brick), then
``nn.Linear``'s float computation (``bricks/dequantize/composite.py``). A microscaled weight
(``mxfp4``, ``nvfp4``, ``mxfp8``) has no kernel variant."""
from __future__ import annotations

import math

from mlx_bricks.bricks.dequantize.composite import dequant_composites, quantized
from mlx_bricks.bricks.gemm.op import run_linear, tile_names
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats import dense, format_of, formats_key, kernel_readable
from mlx_bricks.runtime.kind import Key, TokenRowsKind, flags, high_precision, register_kind
from mlx_bricks.tune.buckets import m_bucket


def _dequant_linear(args, tiles):
    y = tiles.linear(args["x"], (args["weight"],), (args.get("bias"),))
    res = args.get("residual")
    return y if res is None else res + y


class Linear(TokenRowsKind):
    """The ``linear`` kind (module docstring)."""

    name = "linear"
    op_name = "linear"
    activations = ("x", "residual")
    cuda_kernels = ("gemm", "gemm_splitk", "gemm_splitk_reduce", "qgemm")
    composites = dequant_composites(_dequant_linear, lambda a: quantized(a["weight"]))

    def key(self, args):
        x, w = args["x"], args["weight"]
        N, K = w.shape
        params = flags(N=N, K=K, bias=args.get("bias") is not None,
                       res=args.get("residual") is not None)
        return Key(self.name, params, m_bucket(math.prod(x.shape[:-1])), dtype_name(x.dtype),
                   formats_key(w))

    def brick(self, args, backend, **kwargs):
        return run_linear(args["x"], args["weight"], args.get("bias"), args.get("residual"),
                          backend=backend, **kwargs)

    def stock(self, args):
        w = args["weight"]
        y = format_of(w).linear(args["x"], w, args.get("bias"))
        res = args.get("residual")
        return y if res is None else res + y  # the block's "h = x + r"

    def listing(self, backend, dtype, args):
        if args is not None and not kernel_readable(args["weight"]):
            return ()  # a microscaled weight (mxfp4, nvfp4, mxfp8): the composites only
        bits = None if args is None else (format_of(args["weight"]).bits or None)
        return tile_names(backend, dtype, bits)

    def variant_kwargs(self, name):
        return {"tile": name}

    def reference_tail(self, args, rows):
        x, w, b, res = args["x"], args["weight"], args.get("bias"), args.get("residual")
        with high_precision(x.dtype) as hp:
            y = x.reshape(-1, x.shape[-1])[-rows:].astype(hp) @ dense(w).astype(hp).T
            if b is not None:
                y = y + b.astype(hp)
            if res is not None:
                y = y + res.reshape(-1, res.shape[-1])[-rows:].astype(hp)
        return y


LINEAR = register_kind(Linear())
