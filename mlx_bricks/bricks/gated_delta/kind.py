"""The Gated DeltaNet brick's tuner kind: the gated delta rule over a prefill (``(y, state)`` of
:func:`~mlx_bricks.bricks.gated_delta.op.gated_delta`) against mlx-lm's own recurrence for the
same arguments (:func:`~mlx_bricks.bricks.gated_delta.op.gated_delta_stock`: its Metal kernel
on a Metal GPU, its token-by-token MLX-ops loop elsewhere).

Arguments as the op takes them: ``q, k, v, g, beta`` and optionally ``state``, ``mask``. The
key: Hk, Hv, Dk, Dv, the gating (``vec``: per key dim), whether a state and a mask come in; the
bucket of the tokens ``B * T`` (``tune.buckets.m_bucket``); q's dtype. Kernel variant:
``kernel`` (the MSL kernel on metal / emulator, its CUDA twin on cuda; a gate per head or
per key dim, Dk <= 128); two composites: ``chunked`` (the op's chunked form in MLX ops),
offered on every backend, and ``blas`` (the same form in NumPy float32 through its BLAS),
offered where MLX runs on the CPU; so on a machine without a kernel backend the tuner weighs
both against stock's token loop.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.gated_delta import msl
from mlx_bricks.bricks.gated_delta.op import (
    BLAS_CHUNK,
    CHUNK,
    gated_delta,
    gated_delta_blas,
    gated_delta_chunked,
    gated_delta_stock,
)
from mlx_bricks.checks import dtype_name
from mlx_bricks.cpu import on_cpu
from mlx_bricks.runtime.kind import Composite, Key, OpKind, flags, high_precision, register_kind
from mlx_bricks.tune.buckets import m_bucket
from mlx_bricks.tune.check import dtype_close, worst

_OPTIONAL = ("state", "mask")
#: The kernel variant's name (the MSL kernel, or its CUDA twin on cuda).
KERNEL = "kernel"


def _chunked(args, backend, settings):
    return gated_delta_chunked(*(args[n] for n in ("q", "k", "v", "g", "beta")),
                               *(args.get(n) for n in _OPTIONAL),
                               chunk=settings.get("chunk", CHUNK))


def _blas(args, backend, settings):
    return gated_delta_blas(*(args[n] for n in ("q", "k", "v", "g", "beta")),
                            *(args.get(n) for n in _OPTIONAL),
                            chunk=settings.get("blas_chunk", BLAS_CHUNK))


def sequential(q, k, v, g, beta, state=None, mask=None, *, dtype=mx.float32):
    """The recurrence token by token in MLX ops in ``dtype`` (the check's reference: float32
    for half inputs, float64 on the CPU for float32 ones); masked tokens keep the state and
    give 0. Returns ``(y, state)`` in ``dtype``."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    r = Hv // Hk
    q, k = (mx.repeat(a.astype(dtype), r, axis=2) for a in (q, k))
    v, g, beta = (a.astype(dtype) for a in (v, g, beta))
    S = (mx.zeros((B, Hv, Dv, Dk), dtype) if state is None else state.astype(dtype))
    ys = []
    for t in range(T):
        decay = g[:, t, :, None, None] if g.ndim == 3 else g[:, t, :, None, :]
        S1 = S * decay
        delta = (v[:, t] - (S1 * k[:, t, :, None, :]).sum(-1)) * beta[:, t, :, None]
        S1 = S1 + delta[..., None] * k[:, t, :, None, :]
        y = (S1 * q[:, t, :, None, :]).sum(-1)
        if mask is not None:
            keep = mask[:, t]
            S1 = mx.where(keep[:, None, None, None], S1, S)
            y = mx.where(keep[:, None, None], y, 0)
        S = S1
        ys.append(y)
    return mx.stack(ys, axis=1), S


#: The composite and the fewest tokens (B x T) from which ``tune="cached"`` runs it without a
#: measurement, per backend. On the CPU, ``blas`` against mlx-lm's token loop (bf16, CPU
#: seconds, one OpenBLAS thread, 2026-12-06): 16/32 heads of 128, a gate per head: x1.2 at 8
#: tokens, x3.4 at 16, x7.2 at 32, x7.7 at 64; 32 heads of 128, a gate per key dim: x1.05 at 8,
#: x2.2 at 16, x4.2 at 32, x4.0 at 64 (the MLX-ops ``chunked`` composite: x2.0 at 512 with a
#: gate per head, x1.0 with a gate per key dim). CUDA: stock is the same token loop there
#: (about ten op launches per token and layer) against about fifteen per 32-token chunk; not
#: measured yet, so ``chunked`` from 64 tokens. Metal: stock is mlx-lm's own kernel: stock
#: until measured.
PRIOR_MIN_TOKENS = {"reference": ("blas", 16), "cuda": ("chunked", 64)}
#: Seconds per prompt token and state element (Hv x Dk x Dv) of one layer that the brick saves
#: against stock's token loop once warm: H100, T = 2,048, 32 x 128 x 128: stock 0.173 s, the
#: kernel 0.0034 s (bench/results/2026-12-06-h100-gated-delta.json); 0.17 s / 2,048 / 524,288.
#: The prior runs the chunked composite (no build), not yet timed on a GPU: the same rate is
#: assumed (stock's loop is the cost; both forms are a few launches per chunk).
SAVED_S_PER_TOKEN_STATE = {"cuda": 1.58e-10}
#: Tokens of the first-call check (:meth:`GatedDelta.check_call`): several chunks of the
#: kernel (16 tokens in the MSL kernel) and of the composite (:data:`CHUNK`).
CHECK_TOKENS = 160


class GatedDelta(OpKind):
    """The gated delta rule kind (module docstring). Its rows are the tokens; the output is the
    pair ``(y, final state)``, both checked."""

    name = "gated_delta"
    op_name = "gated_delta"
    activations = ("q", "k", "v")
    cuda_kernels = ("gated_delta",)
    composites = (Composite("chunked", _chunked), Composite("blas", _blas, applies=on_cpu))

    def prior(self, args, backend):
        """``tune="cached"`` without a measurement: the composite of :data:`PRIOR_MIN_TOKENS`
        from its tokens (B x T) on a backend listed there (where it applies), else defer
        (stock)."""
        name, min_tokens = PRIOR_MIN_TOKENS.get(backend, (None, 0))
        if name is None or (name == "blas" and not on_cpu(args, backend)):
            return None
        m = self.measured(args)
        return name if m.get("T", 0) * m.get("batch", 1) >= min_tokens else "stock"

    def key(self, args):
        q, v, g = args["q"], args["v"], args["g"]
        B, T, Hk, Dk = q.shape
        Hv, Dv = v.shape[2:]
        values = dict(Hk=Hk, Hv=Hv, Dk=Dk, Dv=Dv, vec=len(g.shape) == 4,
                      state=args.get("state") is not None, mask=args.get("mask") is not None)
        return Key(self.name, flags(**values), m_bucket(max(1, B * T)), dtype_name(q.dtype), "-")

    def brick(self, args, backend, **kwargs):
        return gated_delta(*(args[n] for n in ("q", "k", "v", "g", "beta")),
                           *(args.get(n) for n in _OPTIONAL), backend=backend, **kwargs)

    def stock(self, args):
        """mlx-lm's recurrence (``gated_delta_stock``)."""
        return gated_delta_stock(*(args[n] for n in ("q", "k", "v", "g", "beta")),
                                 *(args.get(n) for n in _OPTIONAL))

    def listing(self, backend, dtype, args):
        """``("kernel",)`` on metal / emulator / cuda where the kernel computes the arguments
        (``msl.kernel_reason``), else none (the composite competes alone)."""
        if backend not in ("metal", "emulator", "cuda"):
            return ()
        if args is not None and msl.kernel_reason(args["q"], args["v"], args["g"]) is not None:
            return ()
        return (KERNEL,)

    def variant_kwargs(self, name):
        if name != KERNEL:
            raise ValueError(f"unknown gated_delta variant {name!r}")
        return {}

    def n_rows(self, args):
        return args["q"].shape[1]

    def measured(self, args):
        B, T = args["q"].shape[:2]
        return {"T": T, "batch": B}

    def synthetic(self, args, seed=0):
        """Model-like values of the arguments' shapes: q, k L2-normalised (q scaled by
        Dk**-0.5, as mlx-lm's ``normalize_qk``), v normal, g as mlx-lm's ``compute_g`` makes
        it from normal projections (A in [1, 16]), beta = sigmoid(normal), a normal state
        scaled by 0.1; mask as given (None or all True)."""
        q, v, g = args["q"], args["v"], args["g"]
        B, T, Hk, Dk = q.shape
        Hv = v.shape[2]
        ks = mx.random.split(mx.random.key(seed), 7)
        qq = mx.random.normal(tuple(q.shape), key=ks[0])
        kk = mx.random.normal(tuple(q.shape), key=ks[1])
        qq = qq * mx.rsqrt((qq * qq).sum(-1, keepdims=True)) * Dk ** -0.5
        kk = kk * mx.rsqrt((kk * kk).sum(-1, keepdims=True))
        A = mx.random.uniform(1.0, 16.0, (Hv,), key=ks[2])
        a = mx.random.normal(tuple(g.shape[:3]), key=ks[3])
        gg = mx.exp(-A * mx.logaddexp(a + 1.0, 0.0))
        if len(g.shape) == 4:
            gg = mx.broadcast_to(gg[..., None], tuple(g.shape)) ** mx.random.uniform(
                0.5, 1.5, tuple(g.shape), key=ks[4])
        out = dict(args)
        out.update(q=qq.astype(q.dtype), k=kk.astype(q.dtype),
                   v=mx.random.normal(tuple(v.shape), key=ks[5]).astype(q.dtype),
                   g=gg.astype(mx.float32),
                   beta=mx.sigmoid(mx.random.normal((B, T, Hv), key=ks[6])))
        if args.get("state") is not None:
            s = args["state"]
            out["state"] = (0.1 * mx.random.normal(tuple(s.shape), key=ks[0])).astype(s.dtype)
        if args.get("mask") is not None:
            out["mask"] = mx.ones((B, T), dtype=mx.bool_)
        return out

    def check_call(self, args):
        """The first :data:`CHECK_TOKENS` tokens of the call (state in, mask rows too): the
        recurrence is causal, so its output there is the call's, and the reference and stock
        (mlx-lm's token loop) then run a few chunks instead of the whole prompt. Two chunks
        of the kernel's own size at least: the state handed from one chunk to the next is
        checked too."""
        T = args["q"].shape[1]
        if T <= CHECK_TOKENS:
            return args
        cut = dict(args)
        for n in ("q", "k", "v", "g", "beta", "mask"):
            if args.get(n) is not None:
                cut[n] = args[n][:, :CHECK_TOKENS]
        return cut

    def tail(self, out, rows):
        y, S = out
        return y[:, -rows:], S

    def reference_tail(self, args, rows):
        with high_precision(args["q"].dtype) as hp:
            y, S = sequential(*(args[n] for n in ("q", "k", "v", "g", "beta")),
                              *(args.get(n) for n in _OPTIONAL), dtype=hp)
            return y[:, -rows:], S  # sliced on the CPU stream: float64 has no GPU

    def check(self, out, naive, args):
        """The dtype rule on y (float32 inputs: 64 ulps, the chunked products and the
        triangular inverse round a few times per chunk where mlx-lm's loop is near exact)
        and on the float32 state (factor 4, 64 ulps), against :func:`sequential` in high
        precision; ``naive``: stock's output."""
        rows = min(8, self.n_rows(args))
        (ry, rS), (oy, oS) = self.reference_tail(args, rows), self.tail(out, rows)
        ny = nS = None
        if naive is not None:
            ny, nS = self.tail(naive, rows)
        dtype = args["q"].dtype
        return worst([
            dtype_close(oy, ry, ny, dtype=dtype, ulps=64 if dtype == mx.float32 else 4),
            dtype_close(oS, rS, nS, dtype=mx.float32, factor=4.0, ulps=64)])


GATED_DELTA = register_kind(GatedDelta())
