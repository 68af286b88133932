"""The short-conv brick's tuner kind: a causal depthwise short convolution over a prefill
(``(y, state)`` of :func:`~mlx_bricks.bricks.short_conv.op.short_conv`) against mlx-lm's own
ops for the same arguments (:func:`~mlx_bricks.bricks.short_conv.op.short_conv_stock`: the
gates, the concatenated state and ``nn.Conv1d(groups=channels)``).

Arguments as the op takes them: ``x, weight`` and optionally ``bias, state, mask, gate_in,
gate_out, activation, lengths``. The key: channels, K, which parts are present; the bucket of
the tokens ``batch * T``; x's dtype. Kernel variant: ``kernel`` (the MSL kernel on metal /
emulator, its CUDA twin on cuda; 2 to 8 taps); one composite, ``shifted`` (K shifted
multiply-adds in float32), offered on every backend.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.short_conv import msl
from mlx_bricks.bricks.short_conv.op import (
    conv_input,
    next_state,
    short_conv,
    short_conv_composite,
    short_conv_stock,
)
from mlx_bricks.checks import dtype_name
from mlx_bricks.runtime.kind import Composite, Key, flags, register_kind
from mlx_bricks.runtime.scan import ScanKind
from mlx_bricks.tune.buckets import m_bucket
from mlx_bricks.tune.check import dtype_close, worst

_ARGS = ("x", "weight", "bias", "state", "mask", "gate_in", "gate_out", "activation",
         "lengths")


def _op_args(args) -> list:
    return [args.get(n) for n in _ARGS]


def _shifted(args, backend, settings):
    return short_conv_composite(*_op_args(args))


def reference(x, weight, bias=None, state=None, mask=None, gate_in=None, gate_out=None,
              activation=None, lengths=None, *, dtype=mx.float32):
    """The op in ``dtype`` (the check's reference): the convolution's input formed and rounded
    in x's dtype as every path forms it (it is also the next state), the rest in ``dtype``."""
    w = weight.reshape(weight.shape[0], -1).astype(dtype)
    K, T = w.shape[1], x.shape[1]
    u = conv_input(x, gate_in, mask)
    if state is None:
        state = mx.zeros((x.shape[0], K - 1, x.shape[2]), x.dtype)
    padded = mx.concatenate([state, u], axis=1)
    up = padded.astype(dtype)
    acc = sum(up[:, k:k + T] * w[:, k] for k in range(K))
    if bias is not None:
        acc = acc + bias.astype(dtype)
    if activation == "silu":  # not nn.silu: a compiled function, which float64 fails on GPUs
        acc = acc * mx.sigmoid(acc)
    if gate_out is not None:
        acc = acc * gate_out.astype(dtype)
    return acc, next_state(padded, K, lengths)


#: The fewest tokens (batch x T) from which ``tune="cached"`` runs the composite without a
#: measurement, per backend: on the CPU the shifted multiply-adds beat MLX's grouped
#: ``conv1d`` at every prefill length measured (LFM2-1.2B's conv, 2,048 channels, 3 taps, 512
#: tokens, bf16: 4.7 ms vs 13.3 ms of CPU time; docs/ssd.md). Elsewhere: stock until measured.
PRIOR_MIN_TOKENS = {"reference": 2}


class ShortConv(ScanKind):
    """The short-conv kind (module docstring). Its rows are the tokens; the output is the pair
    ``(y, next state)``: y checked by the dtype rule, the state bit-exact (it is a copy)."""

    name = "short_conv"
    cuda_kernels = ("short_conv",)
    op_name = "short_conv"
    activations = ("x", "gate_in", "gate_out")
    composites = (Composite("shifted", _shifted),)
    prior_min_tokens = PRIOR_MIN_TOKENS
    prior_composite = "shifted"

    def kernel_reason(self, args):
        return msl.kernel_reason(args["weight"], tuple(args["x"].shape))

    def key(self, args):
        b, T, C = args["x"].shape
        values = dict(C=C, K=args["weight"].shape[1], act=args.get("activation") or "none",
                      gin=args.get("gate_in") is not None, gout=args.get("gate_out") is not None,
                      bias=args.get("bias") is not None, state=args.get("state") is not None,
                      mask=args.get("mask") is not None)
        return Key(self.name, flags(**values), m_bucket(max(1, b * T)),
                   dtype_name(args["x"].dtype), "-")

    def brick(self, args, backend, **kwargs):
        x, weight, bias, state, mask, gin, gout, act, lengths = _op_args(args)
        return short_conv(x, weight, bias, state, mask, gate_in=gin, gate_out=gout,
                          activation=act, lengths=lengths, backend=backend, **kwargs)

    def stock(self, args):
        """mlx-lm's ops (``short_conv_stock``)."""
        return short_conv_stock(*_op_args(args))

    def synthetic(self, args, seed=0):
        """Normal activations, a normal state; weight, bias and options kept; mask as given
        (None or all True)."""
        out = super().synthetic(args, seed)
        s = args.get("state")
        if s is not None:
            out["state"] = mx.random.normal(tuple(s.shape), key=mx.random.key(seed + 7)).astype(
                s.dtype)
        if args.get("mask") is not None:
            out["mask"] = mx.ones(tuple(args["mask"].shape), dtype=mx.bool_)
        return out

    def reference(self, args, dtype):
        return reference(*_op_args(args), dtype=dtype)

    def check(self, out, naive, args):
        """The dtype rule on y against :func:`reference` in high precision; the state must
        equal the reference's (both are copies of the rounded inputs)."""
        rows = min(8, self.n_rows(args))
        (ry, rS), (oy, oS) = self.reference_tail(args, rows), self.tail(out, rows)
        ny = None if naive is None else self.tail(naive, rows)[0]
        dtype = args["x"].dtype
        return worst([dtype_close(oy, ry, ny, dtype=dtype),
                      dtype_close(oS, rS, None, dtype=dtype, factor=0.0, ulps=0.0)])


SHORT_CONV = register_kind(ShortConv())
