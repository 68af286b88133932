"""The op kinds the tuner decides for, in one place: for each, the brick call, the stock MLX /
mlx-lm computation it replaces, its decision key, its candidate variants (enumerated from the
ops' listing functions), synthetic inputs for timing, and the high-precision reference of the
numeric check.

Arguments travel as one ``dict`` per call, named as the op names them (``x``, ``weight``, ``q``,
...). An activation that does not exist yet when a decision is taken (the patch decides every
piece of a block before running it) may be an :class:`Act` placeholder with its shape and dtype;
keys and synthetic inputs need nothing else.

Kinds:

* ``linear``: ``ops.linear`` vs ``nn.Linear`` / ``nn.QuantizedLinear``'s computation
  (``x @ W.T``, ``mx.addmm`` with a bias, ``mx.quantized_matmul(..., transpose=True)`` for
  quantized weights), plus the residual add of the block;
* ``swiglu_mlp``: ``ops.swiglu_mlp`` vs mlx-lm's ``MLP`` (``down(swiglu(gate(x), up(x)))``);
* ``rms_norm_qkv``: ``ops.rms_norm_qkv`` vs ``nn.RMSNorm`` then the q/k/v ``nn.Linear`` layers,
  reshaped to heads as mlx-lm's ``Attention`` does;
* ``attention``: ``ops.flash_attention`` vs ``mx.fast.scaled_dot_product_attention`` (what
  mlx-lm's ``scaled_dot_product_attention`` runs for a ``KVCache``).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.checks import dtype_name
from mlx_bricks.tune.buckets import (
    attention_bucket,
    m_bucket,
    weight_format,
    weights_format,
)
from mlx_bricks.tune.check import CloseResult, dtype_close, worst

#: Output rows (the last ones) the numeric check compares: the reference is computed for these
#: only, so its cost does not grow with M. The last rows see every key under a causal mask.
CHECK_ROWS = 8


@dataclass(frozen=True)
class Act:
    """Placeholder for an activation that is not computed yet: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: object

    @property
    def ndim(self) -> int:
        return len(self.shape)


@dataclass(frozen=True)
class Key:
    """What a decision is keyed by (besides device, versions and backend: ``cache.Context``).

    Attributes:
        kind: op kind (``linear``, ``swiglu_mlp``, ``rms_norm_qkv``, ``attention``).
        params: the op's fixed shape parameters, e.g. ``"N=4096,K=4096,bias=0,res=1"``.
        bucket: the varying sizes' bucket (``buckets.m_bucket`` / ``attention_bucket``).
        dtype: activation dtype name (``float16``, ...).
        weights: weight format (``float`` or ``q<bits>g<group_size>``; for several weights one
            format, or each one's joined by ``/`` when they differ (``buckets.weights_format``);
            ``-`` for attention).
    """

    kind: str
    params: str
    bucket: str
    dtype: str
    weights: str

    def __str__(self) -> str:
        return f"{self.kind}[{self.params}] {self.bucket} {self.dtype} w={self.weights}"


@dataclass(frozen=True)
class Variant:
    """One candidate implementation of an op kind.

    Attributes:
        name: the variant's name (a tile such as ``"64x64"``, a SwiGLU variant ``"fused"``).
        kwargs: keyword arguments that select it in the op (``{"tile": "64x64"}``).
        run: ``run(args) -> output`` replacing the op call (tests inject slow, fast or wrong
            variants through it); None calls the op.
    """

    name: str
    kwargs: dict = field(default_factory=dict)
    run: Callable | None = field(default=None, compare=False)


def _is_quantized(weight) -> bool:
    return getattr(weight, "bits", None) is not None


def _dense(weight):
    """The float weight (dequantized when quantized)."""
    return weight.dequantize() if _is_quantized(weight) else weight


def _weight_shape(weight) -> tuple[int, int]:
    return tuple(weight.shape)


@contextlib.contextmanager
def _high_precision(dtype):
    """Yields the reference dtype: float32 for float16/bfloat16 inputs (its rounding error is
    about 2^-24, far below theirs), float64 on the CPU for float32 inputs (GPUs have none)."""
    if dtype == mx.float32:
        with mx.stream(mx.cpu):
            yield mx.float64
    else:
        yield mx.float32


def stock_linear(x, weight, bias=None):
    """What ``nn.Linear`` / ``nn.QuantizedLinear`` computes for ``x`` (mlx 0.32's modules)."""
    if _is_quantized(weight):
        y = mx.quantized_matmul(x, weight.w, weight.scales, weight.biases, transpose=True,
                                group_size=weight.group_size, bits=weight.bits,
                                mode=weight.mode)
        return y if bias is None else y + bias
    if bias is not None:
        return mx.addmm(bias, x, weight.T)
    return x @ weight.T


def _random(shape, dtype, key):
    return mx.random.normal(tuple(shape), key=key).astype(dtype)


def _rows(n: int) -> int:
    return max(1, min(CHECK_ROWS, n))


class OpKind:
    """One op kind (see the module docstring); subclasses fill in the op-specific parts."""

    name = ""
    #: Argument names that are activations (synthesised for timing, sliced for the check).
    activations: tuple[str, ...] = ()

    def key(self, args: dict) -> Key:
        raise NotImplementedError

    def dtype(self, args: dict):
        return args[self.activations[0]].dtype

    def brick(self, args: dict, backend: str, **kwargs):
        """The brick op on ``backend`` with variant keyword arguments ``kwargs``."""
        raise NotImplementedError

    def stock(self, args: dict):
        """The stock MLX / mlx-lm computation of the same values."""
        raise NotImplementedError

    def variant_names(self, backend: str, dtype=None) -> tuple[str, ...]:
        """The op's own listing of its variants on ``backend`` for activations of ``dtype``."""
        raise NotImplementedError

    def variant_kwargs(self, name: str) -> dict:
        raise NotImplementedError

    def variants(self, backend: str, dtype=None, args: dict | None = None) -> list[Variant]:
        """The candidates on ``backend`` for ``dtype`` (and, given ``args``, for their weight
        formats: a CUDA tile may not take every width), from the op's own listing function."""
        names = (self.variant_names(backend, dtype) if args is None
                 else self.variant_names_for(backend, dtype, args))
        return [Variant(n, self.variant_kwargs(n)) for n in names]

    def variant_names_for(self, backend: str, dtype, args: dict) -> tuple[str, ...]:
        """:meth:`variant_names` for these arguments' weights (default: the same)."""
        return self.variant_names(backend, dtype)

    def run(self, variant: Variant, args: dict, backend: str):
        """Output of ``variant`` (its injected ``run``, or the op with its kwargs)."""
        if variant.run is not None:
            return variant.run(args)
        return self.brick(args, backend, **variant.kwargs)

    def synthetic(self, args: dict, seed: int = 0) -> dict:
        """``args`` with every activation replaced by standard-normal values of its shape and
        dtype (weights, scalars and options kept): the inputs the tuner times."""
        out = dict(args)
        names = [n for n in self.activations if args.get(n) is not None]
        keys = mx.random.split(mx.random.key(seed), max(2, len(names)))
        for n, k in zip(names, keys):
            out[n] = _random(args[n].shape, args[n].dtype, k)
        return out

    def tail(self, out, rows: int):
        """The last ``rows`` output rows (what :meth:`reference_tail` computes)."""
        raise NotImplementedError

    def reference_tail(self, args: dict, rows: int):
        """The last ``rows`` output rows in high precision (see :func:`_high_precision`)."""
        raise NotImplementedError

    def n_rows(self, args: dict) -> int:
        raise NotImplementedError

    def check(self, out, naive, args: dict) -> CloseResult:
        """The tolerance rule for ``out`` against stock's ``naive`` output on the same ``args``
        (real arrays), on the last :data:`CHECK_ROWS` rows."""
        rows = _rows(self.n_rows(args))
        ref = self.reference_tail(args, rows)
        dtype = self.dtype(args)
        outs, naives, refs = self.tail(out, rows), self.tail(naive, rows), ref
        if isinstance(outs, tuple):
            return worst([dtype_close(o, r, n, dtype=dtype)
                          for o, n, r in zip(outs, naives, refs)])
        return dtype_close(outs, refs, naives, dtype=dtype)


def _flags(**flags) -> str:
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in flags.items())



def _bits(weight) -> int | None:
    """Bits of an affine weight, None for a float one."""
    return getattr(weight, "bits", None)


class _TokenRows(OpKind):
    """An op whose rows are the tokens of ``x`` (all leading axes flattened): the GEMM kinds."""

    def n_rows(self, args):
        return math.prod(args["x"].shape[:-1])

    def tail(self, out, rows):
        return out.reshape(-1, out.shape[-1])[-rows:]


class Linear(_TokenRows):
    """``y = x @ W.T (+ bias) (+ residual)``; args ``x, weight, bias, residual``."""

    name = "linear"
    activations = ("x", "residual")

    def key(self, args):
        x, w = args["x"], args["weight"]
        N, K = _weight_shape(w)
        params = _flags(N=N, K=K, bias=args.get("bias") is not None,
                        res=args.get("residual") is not None)
        return Key(self.name, params, m_bucket(math.prod(x.shape[:-1])), dtype_name(x.dtype),
                   weight_format(w))

    def brick(self, args, backend, **kwargs):
        from mlx_bricks.bricks.gemm.msl import linear

        return linear(args["x"], args["weight"], args.get("bias"), args.get("residual"),
                      backend=backend, **kwargs)

    def stock(self, args):
        y = stock_linear(args["x"], args["weight"], args.get("bias"))
        res = args.get("residual")
        return y if res is None else res + y  # the block's "h = x + r"

    def variant_names(self, backend, dtype=None, bits=None):
        from mlx_bricks.bricks.gemm.msl import tile_names

        return tile_names(backend, dtype, bits)

    def variant_names_for(self, backend, dtype, args):
        return self.variant_names(backend, dtype, _bits(args["weight"]))

    def variant_kwargs(self, name):
        return {"tile": name}

    def reference_tail(self, args, rows):
        x, w, b, res = args["x"], args["weight"], args.get("bias"), args.get("residual")
        with _high_precision(x.dtype) as hp:
            y = x.reshape(-1, x.shape[-1])[-rows:].astype(hp) @ _dense(w).astype(hp).T
            if b is not None:
                y = y + b.astype(hp)
            if res is not None:
                y = y + res.reshape(-1, res.shape[-1])[-rows:].astype(hp)
        return y


class SwigluMLP(_TokenRows):
    """``down(act(gate(x)) * up(x)) (+ residual)``; args ``x, w_gate, w_up, w_down, b_gate,
    b_up, b_down, residual`` and optionally ``activation`` (``"silu"`` when absent, or
    ``"gelu_tanh"``: gemma's ``nn.gelu_approx``)."""

    name = "swiglu_mlp"
    activations = ("x", "residual")

    def key(self, args):
        x, wg = args["x"], args["w_gate"]
        N, K = _weight_shape(wg)
        flags = dict(K=K, N=N, bias=args.get("b_gate") is not None,
                     res=args.get("residual") is not None)
        if args.get("activation", "silu") != "silu":  # SiLU keys stay as they were
            flags["act"] = args["activation"]
        params = _flags(**flags)
        return Key(self.name, params, m_bucket(math.prod(x.shape[:-1])), dtype_name(x.dtype),
                   weights_format(wg, args["w_up"], args["w_down"]))

    def brick(self, args, backend, **kwargs):
        from mlx_bricks.bricks.swiglu.msl import swiglu_mlp

        return swiglu_mlp(args["x"], args["w_gate"], args["w_up"], args["w_down"],
                          args.get("residual"), b_gate=args.get("b_gate"),
                          b_up=args.get("b_up"), b_down=args.get("b_down"),
                          activation=args.get("activation", "silu"), backend=backend, **kwargs)

    def stock(self, args):
        from mlx_lm.models.activations import swiglu

        x = args["x"]
        gate = stock_linear(x, args["w_gate"], args.get("b_gate"))
        up = stock_linear(x, args["w_up"], args.get("b_up"))
        if args.get("activation", "silu") == "gelu_tanh":
            act = nn.gelu_approx(gate) * up  # mlx_lm.models.gemma3_text.MLP
        else:
            act = swiglu(gate, up)
        y = stock_linear(act, args["w_down"], args.get("b_down"))
        res = args.get("residual")
        return y if res is None else res + y

    def variant_names(self, backend, dtype=None):
        from mlx_bricks.bricks.swiglu.msl import variant_names

        return variant_names(backend, dtype)

    def variant_names_for(self, backend, dtype, args):
        """Without ``fused`` when gate and up differ in format: the fused kernel stages both
        with one loader (``ops.mlp.same_format``)."""
        from mlx_bricks.bricks.swiglu.msl import same_format

        names = self.variant_names(backend, dtype)
        if same_format(args["w_gate"], args["w_up"]):
            return names
        return tuple(n for n in names if n != "fused")

    def variant_kwargs(self, name):
        return {"variant": name}

    def reference_tail(self, args, rows):
        x, res = args["x"], args.get("residual")
        with _high_precision(x.dtype) as hp:
            x2 = x.reshape(-1, x.shape[-1])[-rows:].astype(hp)

            def lin(a, w, b):
                y = a @ _dense(w).astype(hp).T
                return y if b is None else y + b.astype(hp)

            g = lin(x2, args["w_gate"], args.get("b_gate"))
            u = lin(x2, args["w_up"], args.get("b_up"))
            if args.get("activation", "silu") == "gelu_tanh":
                a = 0.5 * g * (1 + mx.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g ** 3)))
            else:
                a = g * mx.sigmoid(g)
            y = lin(a * u, args["w_down"], args.get("b_down"))
            if res is not None:
                y = y + res.reshape(-1, res.shape[-1])[-rows:].astype(hp)
        return y


class RmsNormQKV(OpKind):
    """``q, k, v = proj(rms_norm(x))`` in head layout; args ``x, norm_weight, eps, wq, wk, wv,
    bq, bk, bv, n_heads, n_kv_heads, head_dim``."""

    name = "rms_norm_qkv"
    activations = ("x",)

    def key(self, args):
        x = args["x"]
        B, L, K = x.shape
        params = _flags(K=K, heads=f"{args['n_heads']}/{args['n_kv_heads']}x{args['head_dim']}",
                        bias=args.get("bq") is not None)
        return Key(self.name, params, m_bucket(B * L), dtype_name(x.dtype),
                   weights_format(args["wq"], args["wk"], args["wv"]))

    def brick(self, args, backend, **kwargs):
        from mlx_bricks.bricks.norm_qkv.msl import rms_norm_qkv

        a = args
        return rms_norm_qkv(a["x"], a["norm_weight"], a["eps"], a["wq"], a["wk"], a["wv"],
                            a.get("bq"), a.get("bk"), a.get("bv"), n_heads=a["n_heads"],
                            n_kv_heads=a["n_kv_heads"], head_dim=a["head_dim"],
                            backend=backend, **kwargs)

    def stock(self, args):
        x = args["x"]
        B, L, _ = x.shape
        h = mx.fast.rms_norm(x, args["norm_weight"], args["eps"])  # nn.RMSNorm

        def proj(w, b, n):
            return stock_linear(h, w, b).reshape(B, L, n, -1).transpose(0, 2, 1, 3)

        return (proj(args["wq"], args.get("bq"), args["n_heads"]),
                proj(args["wk"], args.get("bk"), args["n_kv_heads"]),
                proj(args["wv"], args.get("bv"), args["n_kv_heads"]))

    def variant_names(self, backend, dtype=None, bits=None):
        from mlx_bricks.bricks.norm_qkv.msl import tile_names

        return tile_names(backend, dtype, bits)

    def variant_names_for(self, backend, dtype, args):
        return self.variant_names(backend, dtype,
                                  max((_bits(args[w]) or 0) for w in ("wq", "wk", "wv")) or None)

    def variant_kwargs(self, name):
        return {"tile": name}

    def n_rows(self, args):
        return args["x"].shape[1]

    def tail(self, out, rows):
        return tuple(o[:, :, -rows:, :] for o in out)

    def reference_tail(self, args, rows):
        x = args["x"]
        B = x.shape[0]
        with _high_precision(x.dtype) as hp:
            xt = x[:, -rows:, :].astype(hp)
            h = xt * mx.rsqrt(mx.mean(xt * xt, axis=-1, keepdims=True) + args["eps"])
            h = h * args["norm_weight"].astype(hp)
            outs = []
            for w, b, n in (("wq", "bq", "n_heads"), ("wk", "bk", "n_kv_heads"),
                            ("wv", "bv", "n_kv_heads")):
                y = h @ _dense(args[w]).astype(hp).T
                if args.get(b) is not None:
                    y = y + args[b].astype(hp)
                outs.append(y.reshape(B, rows, args[n], -1).transpose(0, 2, 1, 3))
        return tuple(outs)


class Attention(OpKind):
    """``softmax(mask(softcap(q k^T * scale))) v`` with GQA; args ``q, k, v, scale, mask,
    kv_quant`` and optionally ``window``, ``softcap`` (mask None or ``"causal"``, bottom-right
    aligned; window None or a sliding-window length; softcap None or > 0; kv_quant None or
    ``"q8_0"``), as ``ops.flash_attention`` takes them."""

    #: Options that change the values and have no stock fast path (their stock is the brick's
    #: MLX-ops reference, what mlx-lm's gemma-style attention computes).
    _OPTIONS = ("window", "softcap")

    name = "attention"
    activations = ("q", "k", "v")

    def key(self, args):
        q, k = args["q"], args["k"]
        _, Hq, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        flags = dict(head_dim=D, gqa=Hq // Hkv, kv_quant=args.get("kv_quant") or "none",
                     mask=args.get("mask") or "none")
        flags.update({o: args[o] for o in self._OPTIONS if args.get(o) is not None})
        return Key(self.name, _flags(**flags), attention_bucket(Lq, Lk), dtype_name(q.dtype),
                   "-")

    def _options(self, args) -> dict:
        return {o: args.get(o) for o in self._OPTIONS}

    def brick(self, args, backend, **kwargs):
        from mlx_bricks.bricks.attention.msl import flash_attention

        return flash_attention(args["q"], args["k"], args["v"], scale=args["scale"],
                               mask=args.get("mask"), kv_quant=args.get("kv_quant"),
                               backend=backend, **self._options(args), **kwargs)

    def stock(self, args):
        if args.get("kv_quant") is not None or any(self._options(args).values()):
            # Q8_0 K/V, a window or a soft-cap: no stock fast op; the brick's MLX-ops reference.
            from mlx_bricks.bricks.attention.msl import flash_attention_reference

            return flash_attention_reference(args["q"], args["k"], args["v"],
                                             scale=args["scale"], mask=args.get("mask"),
                                             kv_quant=args.get("kv_quant"),
                                             **self._options(args))
        return mx.fast.scaled_dot_product_attention(args["q"], args["k"], args["v"],
                                                    scale=args["scale"], mask=args.get("mask"))

    def variant_names(self, backend, dtype=None):
        from mlx_bricks.bricks.attention.msl import variant_names

        return variant_names(backend, dtype)

    def variant_kwargs(self, name):
        return {}  # one kernel so far, selected by no argument

    def n_rows(self, args):
        return args["q"].shape[2]

    def tail(self, out, rows):
        return out[:, :, -rows:, :]

    def reference_tail(self, args, rows):
        q, k, v = args["q"], args["k"], args["v"]
        if args.get("kv_quant") == "q8_0":
            from mlx_bricks.bricks.q8_0.op import dequantize_q8_0_reference, quantize_q8_0_reference

            # The values the brick attends over: Q8_0 round trip in q's dtype.
            k, v = (dequantize_q8_0_reference(*quantize_q8_0_reference(a), q.dtype)
                    for a in (k, v))
        Hq, Hkv, Lk = q.shape[1], k.shape[1], k.shape[2]
        with _high_precision(q.dtype) as hp:
            qt = q[:, :, -rows:, :].astype(hp)
            kh = mx.repeat(k.astype(hp), Hq // Hkv, axis=1)
            vh = mx.repeat(v.astype(hp), Hq // Hkv, axis=1)
            s = (qt @ kh.transpose(0, 1, 3, 2)) * args["scale"]
            if args.get("softcap") is not None:
                s = mx.tanh(s / args["softcap"]) * args["softcap"]
            if args.get("mask") == "causal":
                # bottom-right aligned: query row r sits at position p = Lk - rows + r and sees
                # keys j <= p (and j > p - window with a sliding window)
                pos = (Lk - rows + mx.arange(rows))[:, None]
                j = mx.arange(Lk)[None, :]
                visible = j <= pos
                if args.get("window") is not None:
                    visible = visible & (j > pos - args["window"])
                s = mx.where(visible, s, mx.array(-math.inf, hp))
            s = s - mx.max(s, axis=-1, keepdims=True)
            p = mx.exp(s)
            out = (p / mx.sum(p, axis=-1, keepdims=True)) @ vh
        return out


#: The op kinds by name.
KINDS: dict[str, OpKind] = {k.name: k for k in (Linear(), SwigluMLP(), RmsNormQKV(), Attention())}


def kind(name: str) -> OpKind:
    """The op kind called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"unknown op kind {name!r}; expected one of: {', '.join(KINDS)}") \
            from None
