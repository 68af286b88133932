"""The selective-scan brick's tuner kind: Mamba-1's selective state space over a prefill
(``(y, state)`` of :func:`~mlx_bricks.bricks.selective_scan.op.selective_scan`) against mlx-lm's
own token loop for the same arguments
(:func:`~mlx_bricks.bricks.selective_scan.op.selective_scan_stock`).

Arguments as the op takes them: ``x, dt, A_log, B, C`` and optionally ``D, state``. The key:
channels, N, whether D and a state come in; the bucket of the tokens ``batch * T``
(``tune.buckets.m_bucket``); x's dtype. Kernel variant: ``kernel`` (the MSL kernel on metal /
emulator, its CUDA twin on cuda; N / lanes <= 16); one composite, ``chunked`` (the op's chunked
doubling scan in MLX ops, float32), offered on every backend.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.selective_scan import msl
from mlx_bricks.bricks.selective_scan.op import (
    CHUNK,
    gates,
    out_dtype,
    selective_scan,
    selective_scan_chunked,
    selective_scan_stock,
)
from mlx_bricks.checks import dtype_name
from mlx_bricks.runtime.kind import Composite, Key, flags, register_kind
from mlx_bricks.runtime.scan import ScanKind
from mlx_bricks.tune.buckets import m_bucket

_ARRAYS = ("x", "dt", "A_log", "B", "C", "D", "state")


def _op_args(args) -> list:
    return [args.get(n) for n in _ARRAYS]


def _chunked(args, backend, settings):
    x, dt, A_log, B, C, D, state = _op_args(args)
    delta, A = gates(dt, A_log)
    return selective_scan_chunked(x, delta, A, B, C, D, state,
                                  chunk=settings.get("chunk", CHUNK),
                                  dtype=out_dtype(x, dt, B, C, D))


def sequential(x, dt, A_log, B, C, D=None, state=None, *, dtype=mx.float32):
    """The recurrence token by token in MLX ops in ``dtype`` (the check's reference: float32
    for half inputs, float64 on the CPU for float32 ones), the time steps formed in ``dtype``
    too. Returns ``(y, state)`` in ``dtype``."""
    b, T, ch = x.shape
    x, dt, A_log, B, C = (a.astype(dtype) for a in (x, dt, A_log, B, C))
    delta = mx.logaddexp(dt, mx.zeros((), dtype))
    A = -mx.exp(A_log)
    h = mx.zeros((b, ch, A.shape[1]), dtype) if state is None else state.astype(dtype)
    ys = []
    for t in range(T):
        dl = delta[:, t, :, None]
        h = mx.exp(dl * A) * h + (dl * x[:, t, :, None]) * B[:, t, None, :]
        ys.append((h * C[:, t, None, :]).sum(-1))
    y = mx.stack(ys, axis=1) if T else mx.zeros((b, 0, ch), dtype)
    if D is not None:
        y = y + x * D.astype(dtype)
    return y, h


#: The fewest tokens (batch x T) from which ``tune="cached"`` runs the chunked composite
#: without a measurement, per backend, on the edges of the decision buckets
#: (``tune.buckets.m_bucket``: one decision per bucket). The CPU (2 cores, bf16, N 16):
#: 0.4-1.1x stock below 128 tokens (noisy), 1.1-1.3x at 128, 3.8x at 512 with 1024 channels
#: (docs/ssm.md, "Mamba-1"): from the bucket above 128. CUDA: stock is a token loop of a few
#: launches per token over a (batch, T, channels, N) array, the composite a few dozen launches
#: per chunk of 32 (the kernel measured 714x stock at 2,048 tokens, H100): from the bucket
#: above 32. Metal: stock until measured.
PRIOR_MIN_TOKENS = {"reference": 129, "cuda": 33}
#: Seconds per prompt token and state element (channels x N) of one layer that the brick saves
#: against stock's token loop once warm (the first-token guard's cost model,
#: ``tune.prior.saved_s_per_token``): H100, one Jamba layer (8192 x 16), 2,048 tokens: stock
#: 0.778 s, the kernel 0.0011 s (bench/results/2026-12-07-h100-issue42.md); 0.777 s / 2,048 /
#: 131,072. The prior runs the chunked composite (no build), not timed on a GPU: the same rate
#: is assumed (stock's loop is the cost, a few launches a token against a few dozen a chunk).
SAVED_S_PER_TOKEN_STATE = {"cuda": 2.9e-9}


class SelectiveScan(ScanKind):
    """The selective-scan kind (module docstring). Its rows are the tokens; the output is the
    pair ``(y, final state)``, both checked."""

    name = "selective_scan"
    cuda_kernels = ("selective_scan",)
    op_name = "selective_scan"
    activations = ("x", "dt", "B", "C")
    composites = (Composite("chunked", _chunked),)
    prior_min_tokens = PRIOR_MIN_TOKENS
    prior_composite = "chunked"

    def kernel_reason(self, args):
        return msl.kernel_reason(args["A_log"].shape[1])

    def key(self, args):
        x, A_log = args["x"], args["A_log"]
        b, T, ch = x.shape
        values = dict(ch=ch, N=A_log.shape[1], D=args.get("D") is not None,
                      state=args.get("state") is not None)
        return Key(self.name, flags(**values), m_bucket(max(1, b * T)), dtype_name(x.dtype), "-")

    def brick(self, args, backend, **kwargs):
        return selective_scan(*_op_args(args), backend=backend, **kwargs)

    def stock(self, args):
        """mlx-lm's token loop (``selective_scan_stock``)."""
        return selective_scan_stock(*_op_args(args))

    def synthetic(self, args, seed=0):
        """Model-like values of the arguments' shapes: x, B, C normal, raw time steps normal
        around -4 (softplus about 0.02: Mamba's initialisation spans 0.001-0.1), A_log of
        ``A = 1..N`` per channel (mlx-lm's initialisation), D normal, a normal state scaled by
        0.1."""
        x, A_log = args["x"], args["A_log"]
        b, T, ch = x.shape
        N = A_log.shape[1]
        ks = mx.random.split(mx.random.key(seed), 6)
        normal = lambda shape, k: mx.random.normal(tuple(shape), key=k)  # noqa: E731
        out = dict(args)
        out.update(x=normal(x.shape, ks[0]).astype(x.dtype),
                   dt=(normal((b, T, ch), ks[1]) - 4.0).astype(args["dt"].dtype),
                   B=normal((b, T, N), ks[2]).astype(args["B"].dtype),
                   C=normal((b, T, N), ks[3]).astype(args["C"].dtype),
                   A_log=mx.log(mx.broadcast_to(mx.arange(1, N + 1, dtype=mx.float32),
                                                (ch, N))).astype(A_log.dtype))
        if args.get("D") is not None:
            out["D"] = normal((ch,), ks[4]).astype(args["D"].dtype)
        if args.get("state") is not None:
            s = args["state"]
            out["state"] = (0.1 * normal(s.shape, ks[5])).astype(s.dtype)
        return out

    def reference(self, args, dtype):
        return sequential(*_op_args(args), dtype=dtype)


SELECTIVE_SCAN_KIND = register_kind(SelectiveScan())
