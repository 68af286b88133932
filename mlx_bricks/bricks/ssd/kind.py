"""The SSD brick's tuner kind: Mamba-2's selective state space over a prefill (``(y, state)`` of
:func:`~mlx_bricks.bricks.ssd.op.ssd`) against mlx-lm's own ``ssm_update`` for the same
arguments (:func:`~mlx_bricks.bricks.ssd.op.ssd_stock`: ``ssm_attn`` in steps of 256).

Arguments as the op takes them: ``x, dt, A_log, B, C`` and optionally ``D, dt_bias, state,
mask``, ``lengths`` (stock's only: a mixer's right-padded batch, which the mask already
covers) and ``time_step_limit``. The key: H, P, G, N, whether a state and a mask come in; the
bucket of the tokens ``batch * T`` (``tune.buckets.m_bucket``); x's dtype. Kernel variant:
``kernel`` (the MSL kernel on metal / emulator, its CUDA twin on cuda; N <= 128); one
composite, ``chunked`` (the op's chunked form in MLX ops, float32), offered on every backend.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.ssd import msl
from mlx_bricks.bricks.ssd.op import (
    CHUNK,
    DEFAULT_TIME_STEP_LIMIT,
    ssd,
    ssd_chunked,
    ssd_gates,
    ssd_stock,
)
from mlx_bricks.checks import dtype_name
from mlx_bricks.runtime.kind import Composite, Key, flags, register_kind
from mlx_bricks.runtime.scan import ScanKind
from mlx_bricks.tune.buckets import m_bucket

_ARRAYS = ("x", "dt", "A_log", "B", "C", "D", "dt_bias", "state", "mask")


def _limit(args) -> tuple:
    return tuple(args.get("time_step_limit") or DEFAULT_TIME_STEP_LIMIT)


def _chunked(args, backend, settings):
    dtp, A = ssd_gates(args["dt"], args["A_log"], args.get("dt_bias"), args.get("mask"),
                       _limit(args))
    return ssd_chunked(args["x"], dtp, A, args["B"], args["C"], args.get("D"),
                       args.get("state"), chunk=settings.get("chunk", CHUNK))


def sequential(x, dt, A_log, B, C, D=None, dt_bias=None, state=None, mask=None, *,
               time_step_limit=DEFAULT_TIME_STEP_LIMIT, dtype=mx.float32):
    """The recurrence token by token in MLX ops in ``dtype`` (the check's reference: float32
    for half inputs, float64 on the CPU for float32 ones), the time steps formed in ``dtype``
    too; masked tokens keep the state. Returns ``(y, state)`` in ``dtype``."""
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    r = H // G
    lo, hi = time_step_limit
    x, dt, A_log = (a.astype(dtype) for a in (x, dt, A_log))
    B, C = (mx.repeat(a.astype(dtype), r, axis=2) for a in (B, C))
    if dt_bias is not None:
        dt = dt + dt_bias.astype(dtype)
    dt = mx.clip(mx.logaddexp(dt, mx.zeros((), dtype)), lo, hi)
    if mask is not None:
        dt = mx.where(mask[..., None], dt, 0)
    decay = mx.exp(dt * -mx.exp(A_log))
    S = mx.zeros((b, H, P, N), dtype) if state is None else state.astype(dtype)
    ys = []
    for t in range(T):
        S = decay[:, t, :, None, None] * S + (dt[:, t, :, None] * x[:, t])[..., None] * \
            B[:, t, :, None, :]
        ys.append((S * C[:, t, :, None, :]).sum(-1))
    y = mx.stack(ys, axis=1) if T else mx.zeros((b, 0, H, P), dtype)
    if D is not None:
        y = y + x * D.astype(dtype).reshape(1, 1, -1, 1)
    return y, S


#: The fewest tokens (batch x T) from which ``tune="cached"`` runs the chunked composite
#: without a measurement, per backend. On the CPU against mlx-lm's ``ssm_attn`` (Nemotron-3-
#: shaped layer, 64 heads of 64, 8 groups, N = 128, bf16, CPU seconds): docs/ssd.md,
#: "Measured". CUDA: stock is the same ops (about a dozen launches and (256 x 256) decay
#: matrices per head every 256 tokens); not measured yet, so from 64 tokens. Metal: stock
#: until measured.
PRIOR_MIN_TOKENS = {"reference": 16, "cuda": 64}
#: Seconds per prompt token and state element (H x P x N) of one Mamba-2 layer that the bricks
#: save once warm (the first-token guard's cost model, ``tune.prior.saved_s_per_token``): H100,
#: 4-layer Nemotron-3-Nano-shaped model (3 Mamba-2 layers of 64 x 64 x 128), 2,048 tokens,
#: the three-step kernels: stock 14.4 ms, patched 5.9 ms (bench/results/2026-12-07-h100-ssd/);
#: 8.5 ms / 2,048 / 3 / 524,288 (8,192 tokens: 3.9e-12; the single-pass kernel: 2.0e-12).
SAVED_S_PER_TOKEN_STATE = {"cuda": 2.7e-12}


class SSD(ScanKind):
    """The SSD kind (module docstring). Its rows are the tokens; the output is the pair
    ``(y, final state)``, both checked."""

    name = "ssd"
    cuda_kernels = msl.KERNELS
    op_name = "ssd"
    activations = ("x", "B", "C", "dt")
    composites = (Composite("chunked", _chunked),)
    prior_min_tokens = PRIOR_MIN_TOKENS
    prior_composite = "chunked"

    def kernel_reason(self, args):
        return msl.kernel_reason(args["x"], args["B"])

    def key(self, args):
        x, B = args["x"], args["B"]
        b, T, H, P = x.shape
        G, N = B.shape[2:]
        values = dict(H=H, P=P, G=G, N=N, D=args.get("D") is not None,
                      state=args.get("state") is not None, mask=args.get("mask") is not None)
        return Key(self.name, flags(**values), m_bucket(max(1, b * T)), dtype_name(x.dtype), "-")

    def _op_args(self, args):
        return [args.get(n) for n in _ARRAYS]

    def brick(self, args, backend, **kwargs):
        return ssd(*self._op_args(args), time_step_limit=_limit(args), backend=backend,
                   **kwargs)

    def stock(self, args):
        """mlx-lm's ``ssm_update`` (``ssd_stock``)."""
        return ssd_stock(*self._op_args(args), lengths=args.get("lengths"),
                         time_step_limit=_limit(args))

    def synthetic(self, args, seed=0):
        """Model-like values of the arguments' shapes: x, B, C normal, raw time steps normal
        around a dt_bias that gives softplus values of 0.001-0.1 (Mamba-2's initialisation),
        A in [1, 16], D normal, a normal state scaled by 0.1; mask as given (None or all
        True)."""
        x, B = args["x"], args["B"]
        b, T, H, P = x.shape
        ks = mx.random.split(mx.random.key(seed), 8)
        out = dict(args)
        normal = lambda shape, k: mx.random.normal(tuple(shape), key=k)  # noqa: E731
        out.update(x=normal(x.shape, ks[0]).astype(x.dtype),
                   B=normal(B.shape, ks[1]).astype(B.dtype),
                   C=normal(B.shape, ks[2]).astype(B.dtype),
                   dt=normal((b, T, H), ks[3]).astype(args["dt"].dtype),
                   A_log=mx.log(mx.random.uniform(1.0, 16.0, (H,), key=ks[4])))
        step = mx.random.uniform(0.001, 0.1, (H,), key=ks[5])
        out["dt_bias"] = mx.log(mx.expm1(step))
        if args.get("D") is not None:
            out["D"] = normal((H,), ks[6]).astype(args["D"].dtype)
        if args.get("state") is not None:
            s = args["state"]
            out["state"] = (0.1 * normal(s.shape, ks[7])).astype(s.dtype)
        if args.get("mask") is not None:
            out["mask"] = mx.ones((b, T), dtype=mx.bool_)
        out.pop("lengths", None)
        return out

    def reference(self, args, dtype):
        return sequential(*self._op_args(args), time_step_limit=_limit(args), dtype=dtype)


SSD_KIND = register_kind(SSD())
