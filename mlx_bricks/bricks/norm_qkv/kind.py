"""The RMSNorm + QKV brick's tuner kind: ``q, k, v = proj(rms_norm(x))`` in head layout against
``nn.RMSNorm`` then the q/k/v ``nn.Linear`` / ``nn.QuantizedLinear`` layers, reshaped to heads
as mlx-lm's ``Attention`` does. Arguments: ``x, norm_weight, eps, wq, wk, wv, bq, bk, bv,
n_heads, n_kv_heads, head_dim``.

Composites (any of q/k/v quantized, affine or microscaled): ``dequant`` / ``dequant_brick``
(affine only): ``mx.fast.rms_norm``, then each projection's weight dequantized in row tiles and
multiplied in float (``bricks/dequantize/composite.py``)."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.dequantize.composite import dequant_composites, quantized
from mlx_bricks.bricks.norm_qkv.msl import QKV_SPEC
from mlx_bricks.bricks.norm_qkv.op import run_rms_norm_qkv, tile_names
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats import dense, format_of, formats_key, kernel_readable, widest_bits
from mlx_bricks.runtime.kind import Key, OpKind, flags, high_precision, register_kind
from mlx_bricks.tune.buckets import m_bucket

_PROJECTIONS = (("wq", "bq", "n_heads"), ("wk", "bk", "n_kv_heads"), ("wv", "bv", "n_kv_heads"))


def _dequant_qkv(args, tiles):
    x = args["x"]
    B, L, _ = x.shape
    h = mx.fast.rms_norm(x, args["norm_weight"], args["eps"])  # nn.RMSNorm
    return tuple(tiles.linear(h, (args[w],), (args.get(b),)).reshape(B, L, args[n], -1)
                 .transpose(0, 2, 1, 3) for w, b, n in _PROJECTIONS)


class RmsNormQKV(OpKind):
    """The RMSNorm + QKV kind (module docstring)."""

    name = QKV_SPEC.name
    op_name = name
    activations = ("x",)
    cuda_kernels = (QKV_SPEC.name,)
    composites = dequant_composites(_dequant_qkv,
                                    lambda a: quantized(a["wq"], a["wk"], a["wv"]))

    def key(self, args):
        x = args["x"]
        B, L, K = x.shape
        params = flags(K=K, heads=f"{args['n_heads']}/{args['n_kv_heads']}x{args['head_dim']}",
                       bias=args.get("bq") is not None)
        return Key(self.name, params, m_bucket(B * L), dtype_name(x.dtype),
                   formats_key(args["wq"], args["wk"], args["wv"]))

    def brick(self, args, backend, **kwargs):
        a = args
        return run_rms_norm_qkv(a["x"], a["norm_weight"], a["eps"], a["wq"], a["wk"], a["wv"],
                                a.get("bq"), a.get("bk"), a.get("bv"), n_heads=a["n_heads"],
                                n_kv_heads=a["n_kv_heads"], head_dim=a["head_dim"],
                                backend=backend, **kwargs)

    def stock(self, args):
        x = args["x"]
        B, L, _ = x.shape
        h = mx.fast.rms_norm(x, args["norm_weight"], args["eps"])  # nn.RMSNorm
        out = []
        for w, b, n in _PROJECTIONS:
            y = format_of(args[w]).linear(h, args[w], args.get(b))
            out.append(y.reshape(B, L, args[n], -1).transpose(0, 2, 1, 3))
        return tuple(out)

    def listing(self, backend, dtype, args):
        if args is not None and not kernel_readable(args["wq"], args["wk"], args["wv"]):
            return ()  # a microscaled projection: the composites only
        bits = None if args is None else widest_bits(args["wq"], args["wk"], args["wv"])
        return tile_names(backend, dtype, bits)

    def variant_kwargs(self, name):
        return {"tile": name}

    def n_rows(self, args):
        return args["x"].shape[1]

    def measured(self, args):
        return {"M": args["x"].shape[0] * args["x"].shape[1]}

    def tail(self, out, rows):
        return tuple(o[:, :, -rows:, :] for o in out)

    def reference_tail(self, args, rows):
        x = args["x"]
        B = x.shape[0]
        with high_precision(x.dtype) as hp:
            xt = x[:, -rows:, :].astype(hp)
            h = xt * mx.rsqrt(mx.mean(xt * xt, axis=-1, keepdims=True) + args["eps"])
            h = h * args["norm_weight"].astype(hp)
            outs = []
            for w, b, n in _PROJECTIONS:
                y = h @ dense(args[w]).astype(hp).T
                if args.get(b) is not None:
                    y = y + args[b].astype(hp)
                outs.append(y.reshape(B, rows, args[n], -1).transpose(0, 2, 1, 3))
        return tuple(outs)


RMS_NORM_QKV = register_kind(RmsNormQKV())
