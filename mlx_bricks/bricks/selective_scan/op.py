"""The selective-scan brick's public op: Mamba-1's selective state space over a prefill.

The recurrence (Gu & Dao 2023, "Mamba: Linear-Time Sequence Modeling with Selective State
Spaces", algorithm 2), per batch row, channel d and state entry n, for each token t, with
``delta_t = softplus(dt_t)`` (per channel) and ``A = -exp(A_log)`` of shape (channels, N)::

    h[d, n] = exp(delta_t[d] A[d, n]) h[d, n] + delta_t[d] x_t[d] B_t[n]
    y_t[d]  = sum_n h[d, n] C_t[n] + D[d] x_t[d]

as mlx-lm 0.32.2's Mamba-1 mixers compute it (``jamba.JambaMambaMixer.ssm_step``: a token loop
over a (batch, T, channels, N) array; ``mamba.MambaBlock``: one ``ssm_step`` per token). B and
C are shared by every channel (one group). Unlike Mamba-2's SSD the decay differs per channel
and state entry, so there is no per-head matrix form: the kernel walks the tokens with each
(channel, state entry) state in a register (the channels and state entries are independent),
and the composite scans chunks of tokens in parallel (Hillis & Steele's doubling scan of the
linear recurrence ``h_t = a_t h_{t-1} + u_t``, log2(chunk) steps), passing the state from chunk
to chunk (Blelloch 1990, "Prefix sums and their applications", section 1.4: recurrences).
Both work in float32; every decay factor is <= 1, so nothing overflows.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.selective_scan import msl
from mlx_bricks.checks import check_array, check_float_dtype, check_optional

#: Tokens per chunk of the composite: log2(CHUNK) doubling steps over (batch, CHUNK, channels,
#: N) float32 arrays per chunk (docs/ssm.md, "Mamba-1").
CHUNK = 32


def check_selective_scan_args(x, dt, A_log, B, C, D=None, state=None) -> tuple:
    """Validate the op's arguments; returns ``(batch, T, channels, N)``.

    Raises:
        TypeError: an argument is not an ``mx.array`` or has a non-float dtype.
        ValueError: shapes that do not match the layout of :func:`selective_scan`.
    """
    for name, a in (("x", x), ("dt", dt), ("A_log", A_log), ("B", B), ("C", C)):
        check_array(name, a)
        check_float_dtype(name, a)
    check_array("x", x, ndim=3)
    b, T, ch = x.shape
    check_array("A_log", A_log, ndim=2)
    if A_log.shape[0] != ch or A_log.shape[1] == 0:
        raise ValueError(f"A_log must be (channels, N) with channels = {ch}, got "
                         f"{tuple(A_log.shape)}")
    N = A_log.shape[1]
    if tuple(dt.shape) != (b, T, ch):
        raise ValueError(f"dt must have x's shape {(b, T, ch)}, got {tuple(dt.shape)}")
    for name, a in (("B", B), ("C", C)):
        if tuple(a.shape) != (b, T, N):
            raise ValueError(f"{name} must have shape (batch, T, N) = {(b, T, N)}, got "
                             f"{tuple(a.shape)}")
    check_optional("D", D, (ch,))
    check_optional("state", state, (b, ch, N))
    return b, T, ch, N


def gates(dt, A_log):
    """``(delta, A)`` in float32: ``softplus(dt)`` (mlx-lm's ``nn.softplus``) and
    ``-exp(A_log)``."""
    return nn.softplus(dt.astype(mx.float32)), -mx.exp(A_log.astype(mx.float32))


def out_dtype(x, dt, B, C, D=None):
    """y's dtype: what mlx-lm's ``ssm_step`` gives (the product of the time steps, x, B and C,
    plus ``D * x``)."""
    dtype = mx.result_type(x.dtype, dt.dtype, B.dtype, C.dtype)
    return dtype if D is None else mx.result_type(dtype, D.dtype)


def selective_scan_chunked(x, delta, A, B, C, D=None, state=None, *, chunk: int = CHUNK,
                           dtype=None):
    """The scan in chunks in MLX ops, float32 (the brick's composite; module docstring).

    Args: x (batch, T, channels), B, C (batch, T, N) as :func:`selective_scan`; ``delta``
    (batch, T, channels) and ``A`` (channels, N) float32 from :func:`gates`; D (channels,) or
    None; state (batch, channels, N) or None; ``dtype``: y's (None: x's). Returns ``(y,
    state)``, the state float32. Not re-checked.

    Per chunk of q tokens: ``a = exp(delta A)``, ``u = delta x B`` as (batch, q, channels, N);
    log2(q) doubling steps ``u_t += a_t u_{t-k}``, ``a_t *= a_{t-k}`` make ``u_t`` the state
    from zero and ``a_t`` the decay from the chunk's start; then ``h_t = u_t + a_t h0`` and
    ``y_t = h_t C_t``.
    """
    b, T, ch = x.shape
    N = A.shape[1]
    f32 = mx.float32
    h = mx.zeros((b, ch, N), f32) if state is None else state.astype(f32)
    q = max(1, min(int(chunk), T))
    ys = []
    for t0 in range(0, T, q):
        t1 = min(t0 + q, T)
        dl = delta[:, t0:t1, :, None]
        a = mx.exp(dl * A)
        u = (dl * x[:, t0:t1, :, None].astype(f32)) * B[:, t0:t1, None, :].astype(f32)
        k = 1
        while k < t1 - t0:
            u = mx.concatenate([u[:, :k], u[:, k:] + a[:, k:] * u[:, :-k]], axis=1)
            a = mx.concatenate([a[:, :k], a[:, k:] * a[:, :-k]], axis=1)
            k *= 2
        hs = u + a * h[:, None]
        ys.append((hs @ C[:, t0:t1, :, None].astype(f32)).squeeze(-1))
        h = hs[:, -1]
    y = mx.concatenate(ys, axis=1) if ys else mx.zeros((b, 0, ch), f32)
    if D is not None:
        y = y + x.astype(f32) * D.astype(f32)
    return y.astype(x.dtype if dtype is None else dtype), h


def selective_scan(x, dt, A_log, B, C, D=None, state=None, *, chunk: int = CHUNK,
                   backend: str | None = None):
    """Mamba-1's selective state space over a prefill (module docstring), from an optional
    initial state: what mlx-lm 0.32.2's Mamba-1 mixers compute from the conv output on.

    Args:
        x: (batch, T, channels) float16 / bfloat16 / float32: the conv output after SiLU.
        dt: (batch, T, channels) raw time steps (``dt_proj``'s output, bias included; any
            float dtype): ``delta = softplus(dt)`` in float32.
        A_log: (channels, N): ``A = -exp(A_log)``.
        B, C: (batch, T, N), any float dtype: the input and output projections of the state,
            shared by every channel.
        D: (channels,) skip weights or None (no skip).
        state: (batch, channels, N) initial state (mlx-lm's cache layout), or None for zeros.
        chunk: tokens per chunk (> 0) of the MLX-ops composite.
        backend: ``None`` (auto) or a name of ``mlx_bricks.backends.BACKENDS``: ``metal`` /
            ``emulator`` run the MSL kernel, ``cuda`` its twin, where the kernel computes the
            arguments (``msl.kernel_reason``: N up to 128); ``reference`` and the other cases
            the chunked composite in MLX ops.

    Returns:
        ``(y, state)``: y (batch, T, channels) in mlx-lm's dtype (:func:`out_dtype`),
        computed in float32 and rounded once; the final state (batch, channels, N) float32.

    Raises:
        TypeError, ValueError: see :func:`check_selective_scan_args`; ``chunk`` not a
            positive int.
    """
    check_selective_scan_args(x, dt, A_log, B, C, D, state)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    b = op_backend("selective_scan", backend)
    delta, A = gates(dt, A_log)
    dtype = out_dtype(x, dt, B, C, D)
    if b == "reference" or msl.kernel_reason(A_log.shape[1]) is not None:
        return selective_scan_chunked(x, delta, A, B, C, D, state, chunk=chunk, dtype=dtype)
    return run_kernel(x, delta, A, B, C, D, state, dtype=dtype, backend=b)


def run_kernel(x, delta, A, B, C, D=None, state=None, *, dtype=None, backend: str):
    """The MSL kernel (``metal``, ``emulator``) or its CUDA twin (``cuda``) on checked
    arguments the kernel computes (``msl.kernel_reason`` None); ``delta``, ``A`` from
    :func:`gates`, ``dtype`` y's (None: x's). Returns ``(y, state)`` as :func:`selective_scan`."""
    b, T, ch = x.shape
    if b * T * ch == 0:  # nothing to scan: no launch (an empty grid), the state passes through
        N = A.shape[1]
        s = mx.zeros((b, ch, N), mx.float32) if state is None else state.astype(mx.float32)
        return mx.zeros((b, T, ch), x.dtype if dtype is None else dtype), s
    kwargs = msl.launch_kwargs(x, delta, A, B, C, D, state, x.dtype if dtype is None else dtype)
    if backend == "cuda":
        from mlx_bricks.bricks.selective_scan.cuda import launch_cuda

        return launch_cuda(kwargs)
    return msl.launch(kwargs, backend=backend)


def selective_scan_stock(x, dt, A_log, B, C, D=None, state=None):
    """mlx-lm's computation for these arguments, as ``JambaMambaMixer.ssm_step`` does it from
    the conv output on (in the inputs' dtypes, a token loop over a (batch, T, channels, N)
    array). D None is a zero skip. Returns ``(y, state)``."""
    from mlx_lm.models.jamba import fma

    delta = nn.softplus(dt)
    A = -mx.exp(A_log)
    new_state = mx.expand_dims(delta * x, -1) * mx.expand_dims(B, -2)
    dtA = mx.exp(mx.expand_dims(delta, -1) * A)
    for t in range(x.shape[1]):
        if state is not None:
            new_state[:, t] = fma(state, dtA[:, t], new_state[:, t])
        state = new_state[:, t]
    y = (new_state @ mx.expand_dims(C, -1)).squeeze(-1)
    if D is not None:
        y = y + D * x
    return y, new_state[:, -1]
