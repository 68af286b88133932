"""The SSD brick's public op: Mamba-2's selective state space over a prefill, in chunks.

The recurrence (per batch row and head h; state ``S`` of shape (P, N), mlx-lm's layout) is, for
each token t, with ``dt_t = clip(softplus(dt_raw_t + dt_bias), *time_step_limit)`` and
``A = -exp(A_log)`` (one scalar per head)::

    S = exp(dt_t A) S + dt_t x_t B_t^T        (x_t: (P,), B_t: (N,) of head h's group)
    y_t = S C_t + D x_t

as mlx-lm 0.32.2's ``ssm_update`` computes it (``models/ssm.py``: ``ssm_attn`` in steps of 256
tokens for a prefill, ``ssm_update_kernel`` token by token for decode). Head h reads group
``h // (H // G)`` of B and C.

The chunked form is the state space duality of Dao & Gu 2024 ("Transformers are SSMs", section
6, the SSD algorithm; mamba_ssm's ``ssd_combined`` has the same four steps): within a chunk of
Q tokens, with ``L_t`` the log decay from the chunk's start to token t (inclusive cumulative
sum of ``dt A``) and ``S0`` the state at the chunk's start::

    y_t = sum_{i <= t} (C_t . B_i) exp(L_t - L_i) dt_i x_i      (a masked "attention": matmuls)
        + exp(L_t) S0 C_t + D x_t
    S1  = exp(L_Q) S0 + sum_i exp(L_Q - L_i) dt_i x_i B_i^T

so the quadratic part of every chunk, and every chunk's own state contribution, are batched
matrix products over all chunks at once; only the chunk-to-chunk state passing
``S_{c+1} = exp(L_Q^c) S_c + dS_c`` is sequential (float32). Decay ratios are formed as
``exp(L_t - L_i)`` over the causal triangle only (log decays are <= 0, so nothing overflows).
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.ssd import cuda as ssd_cuda
from mlx_bricks.bricks.ssd import msl
from mlx_bricks.checks import check_array, check_float_dtype, check_optional, dtype_name

#: Tokens per chunk of the composite. Per token and head the chunk costs about 2 * Q * (P + N
#: / heads-per-group) flops of intra-chunk products plus 4 * P * N of state products whatever
#: Q; stock (mlx-lm's ``ssm_attn``) works in steps of 256 with (256 x 256) decay matrices per
#: head. Measured on this CPU (docs/ssd.md, "Measured").
CHUNK = 64
#: mlx-lm's ``ssm_update`` default ``time_step_limit`` (plamo2 passes none).
DEFAULT_TIME_STEP_LIMIT = (0.001, 100.0)


def check_ssd_args(x, dt, A_log, B, C, D=None, dt_bias=None, state=None, mask=None) -> tuple:
    """Validate the op's arguments; returns ``(batch, T, H, P, G, N)``.

    Raises:
        TypeError: an argument is not an ``mx.array`` or has a non-float dtype (``mask``: not
            bool); B and C not of x's dtype.
        ValueError: shapes that do not match the layout of :func:`ssd`.
    """
    for name, a in (("x", x), ("dt", dt), ("A_log", A_log), ("B", B), ("C", C)):
        check_array(name, a)
        check_float_dtype(name, a)
    check_array("x", x, ndim=4)
    b, T, H, P = x.shape
    check_array("B", B, ndim=4)
    if tuple(B.shape[:2]) != (b, T):
        raise ValueError(f"B must be (batch, T, G, N) with batch, T = {b}, {T}, got "
                         f"{tuple(B.shape)}")
    G, N = B.shape[2:]
    if G == 0 or H % G:
        raise ValueError(f"x's heads ({H}) must be a multiple of B's groups ({G})")
    if tuple(C.shape) != tuple(B.shape):
        raise ValueError(f"C must have B's shape {tuple(B.shape)}, got {tuple(C.shape)}")
    if B.dtype != x.dtype or C.dtype != x.dtype:
        raise TypeError(f"B and C must have x's dtype {dtype_name(x.dtype)}, got "
                        f"{dtype_name(B.dtype)} and {dtype_name(C.dtype)}")
    if tuple(dt.shape) != (b, T, H):
        raise ValueError(f"dt must have shape {(b, T, H)}, got {tuple(dt.shape)}")
    for name, a in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        check_optional(name, a, (H,))
    check_optional("state", state, (b, H, P, N))
    check_optional("mask", mask, (b, T), mx.bool_)
    return b, T, H, P, G, N


def check_time_step_limit(limit) -> tuple[float, float]:
    """``(lo, hi)`` floats with lo <= hi (ValueError naming ``time_step_limit`` otherwise)."""
    try:
        lo, hi = (float(v) for v in limit)
    except (TypeError, ValueError):
        raise ValueError(f"time_step_limit must be a pair of numbers, got {limit!r}") from None
    if not lo <= hi:
        raise ValueError(f"time_step_limit must have lo <= hi, got {limit!r}")
    return lo, hi


def ssd_gates(dt, A_log, dt_bias=None, mask=None, time_step_limit=DEFAULT_TIME_STEP_LIMIT):
    """``(dt, A)``: the time steps as mlx-lm forms them (its own compiled ``compute_dt``:
    ``clip(softplus(dt + dt_bias), lo, hi)`` in float32; 0 at masked tokens, which then neither
    decay nor write the state) and ``A = -exp(A_log)`` (float32, (H,))."""
    from mlx_lm.models.ssm import compute_dt

    bias = mx.zeros(dt.shape[-1:], mx.float32) if dt_bias is None else dt_bias
    dtp = compute_dt(dt, bias, tuple(time_step_limit))
    if mask is not None:
        dtp = mx.where(mask[..., None], dtp, 0.0)
    return dtp, -mx.exp(A_log.astype(mx.float32))


def _skip(y, x, D):
    """mlx-lm's output: the scan's y in x's dtype, plus ``x * D`` (in their common dtype)."""
    y = y.astype(x.dtype)
    return y if D is None else y + x * D.reshape(1, 1, -1, 1)


def ssd_chunked(x, dtp, A, B, C, D=None, state=None, *, chunk: int = CHUNK):
    """The SSD scan in chunks, in MLX ops (the brick's composite; module docstring), float32.

    Args: x (batch, T, H, P), B, C (batch, T, G, N) as :func:`ssd`; ``dtp`` (batch, T, H) and
    ``A`` (H,) float32 from :func:`ssd_gates`; D (H,) or None; state (batch, H, P, N) or None.
    Returns ``(y, state)`` as :func:`ssd`. Not re-checked.

    Layout: heads fold into their group (h = g * r + j), so the chunk's products with B and C
    are one (Q x N) @ (N x r P) product per group instead of r broadcast ones.

    Source: Dao & Gu 2024, section 6 (SSD: intra-chunk quadratic form, chunk states, state
    passing, state-to-output).
    """
    b, T, H, P = x.shape
    G, N = B.shape[2:]
    r = H // G
    f32 = mx.float32
    if T == 0:  # no token: no output, the state passes through
        S = mx.zeros((b, H, P, N), f32) if state is None else state
        return _skip(mx.zeros((b, 0, H, P), f32), x, D), S
    q = min(int(chunk), T)  # a short prompt is one chunk, not padded to a full one
    pad = (-T) % q
    n = (T + pad) // q

    def chunks(a):  # (b, T, ...) -> (b, n, q, ...) float32, T padded with zeros at the end
        a = a.astype(f32)
        if pad:
            a = mx.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(b, n, q, *a.shape[2:])

    # (b, G, n, q, ...): the group first, heads of a group together
    Xd = chunks(x.astype(f32) * dtp[..., None]).reshape(b, n, q, G, r, P)
    Xd = Xd.transpose(0, 3, 1, 2, 4, 5)                       # (b, G, n, q, r, P)
    Bc = chunks(B).transpose(0, 3, 1, 2, 4)                   # (b, G, n, q, N)
    Cc = chunks(C).transpose(0, 3, 1, 2, 4)                   # (b, G, n, q, N)
    a = chunks(dtp * A).reshape(b, n, q, G, r).transpose(0, 3, 1, 4, 2)  # (b, G, n, r, q)
    L = mx.cumsum(a, axis=-1)                                 # log decay from the chunk's start
    L_end = L[..., -1:]                                       # (b, G, n, r, 1)
    # intra-chunk: (C B^T) per group, decayed per head over the causal triangle
    causal = mx.where(mx.tril(mx.ones((q, q), dtype=mx.bool_)), 0.0, -math.inf).astype(f32)
    decay = mx.exp(L[..., :, None] - L[..., None, :] + causal)  # (b, G, n, r, q, q)
    CB = Cc @ Bc.swapaxes(-1, -2)                             # (b, G, n, q, q)
    M = CB[:, :, :, None] * decay                             # (b, G, n, r, q, q)
    Y = M @ Xd.transpose(0, 1, 2, 4, 3, 5)                    # (b, G, n, r, q, P)
    # each chunk's own state contribution (from zero): (X decayed to the chunk's end)^T B
    to_end = mx.exp(L_end - L).transpose(0, 1, 2, 4, 3)[..., None]  # (b, G, n, q, r, 1)
    Xe = (Xd * to_end).reshape(b, G, n, q, r * P)
    dS = Xe.swapaxes(-1, -2) @ Bc                             # (b, G, n, rP, N)
    chunk_decay = mx.exp(L_end).reshape(b, G, n, r, 1, 1)
    # state passing, sequential over chunks, float32, S as (b, G, r, P, N) = (b, H, P, N); each
    # chunk's start state to its outputs, C S0^T: one (q x N) @ (N x rP) product per group
    # (no initial state: the first chunk starts from zeros, no product, no decay)
    S = None if state is None else state.astype(f32).reshape(b, G, r, P, N)
    inter = []
    for c in range(n):
        if S is None:
            inter.append(mx.zeros((b, G, q, r * P), f32))
            S = dS[:, :, c].reshape(b, G, r, P, N)
            continue
        inter.append(Cc[:, :, c] @ S.reshape(b, G, r * P, N).swapaxes(-1, -2))
        S = chunk_decay[:, :, c] * S + dS[:, :, c].reshape(b, G, r, P, N)
    y = Y.transpose(0, 2, 4, 1, 3, 5)                         # (b, n, q, G, r, P)
    if state is not None or n > 1:  # exp(L_t) C_t . S0
        Yi = mx.stack(inter, axis=2).reshape(b, G, n, q, r, P)
        Yi = Yi * mx.exp(L).transpose(0, 1, 2, 4, 3)[..., None]
        y = y + Yi.transpose(0, 2, 3, 1, 4, 5)
    y = y.reshape(b, n * q, H, P)[:, :T]
    out_dtype = f32 if state is None else state.dtype
    return _skip(y, x, D), S.reshape(b, H, P, N).astype(out_dtype)


def ssd(x, dt, A_log, B, C, D=None, dt_bias=None, state=None, mask=None, *,
        time_step_limit=DEFAULT_TIME_STEP_LIMIT, chunk: int = CHUNK,
        backend: str | None = None):
    """Mamba-2's selective state space (SSD) over a prefill (module docstring), from an
    optional initial state: what mlx-lm 0.32.2's ``ssm_update`` returns for a prompt.

    Args:
        x: (batch, T, H, P) float16 / bfloat16 / float32: the heads' inputs (the conv output's
            first part, as mlx-lm's Mamba-2 mixers reshape it).
        dt: (batch, T, H) raw time steps (the in-projection's last part, any float dtype).
        A_log: (H,): ``A = -exp(A_log)``.
        B, C: (batch, T, G, N), x's dtype; H a multiple of G (head h reads group
            ``h // (H // G)``).
        D: (H,) skip weights or None (no skip): ``y += x * D`` in x's and D's common dtype,
            as mlx-lm adds it.
        dt_bias: (H,) or None (zeros).
        state: (batch, H, P, N) initial state (mlx-lm's cache layout), or None for zeros.
        mask: (batch, T) bool or None: False tokens (padding of a batch) leave the state
            unchanged (their time step is 0), as mlx-lm's masked ``ssm_attn``; their y is not
            defined by mlx-lm and is whatever the scan gives there.
        time_step_limit: ``(lo, hi)`` clip of the time steps (mlx-lm's default (0.001,
            100.0); Nemotron-H and Falcon-H1 pass (0, inf)).
        chunk: tokens per chunk (> 0) of the MLX-ops composite (the kernels choose theirs:
            ``msl.tiles``).
        backend: ``None`` (auto) or a name of ``mlx_bricks.backends.BACKENDS``: ``metal`` /
            ``emulator`` run the MSL kernels, ``cuda`` their twins, where they compute the
            arguments (``msl.kernel_reason``: P and N multiples of 4 whose slices fit
            threadgroup memory); ``reference`` and the other cases run the chunked composite
            in MLX ops.

    Returns:
        ``(y, state)``: y (batch, T, H, P) in x's dtype (x's and D's common dtype with D); the
        final state (batch, H, P, N) in ``state``'s dtype (float32 when None), computed in
        float32.

    Raises:
        TypeError, ValueError: see :func:`check_ssd_args`; ``chunk`` not a positive int;
            ``time_step_limit`` not an ordered pair of numbers.
    """
    check_ssd_args(x, dt, A_log, B, C, D, dt_bias, state, mask)
    limit = check_time_step_limit(time_step_limit)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    b = op_backend(msl.KERNELS[-1], backend)  # every step has its CUDA twin
    dtp, A = ssd_gates(dt, A_log, dt_bias, mask, limit)
    if b == "reference" or msl.kernel_reason(x, B, b) is not None:
        return ssd_chunked(x, dtp, A, B, C, D, state, chunk=chunk)
    return run_kernel(x, dtp, A, B, C, D, state, backend=b)


def run_kernel(x, dtp, A, B, C, D=None, state=None, *, backend: str):
    """The MSL kernels (``metal``, ``emulator``) or their CUDA twins (``cuda``) on checked
    arguments they compute (``msl.kernel_reason`` None); ``dtp``, ``A`` from
    :func:`ssd_gates`. Returns ``(y, state)`` as :func:`ssd`."""
    b, T, H, P = x.shape
    N = B.shape[-1]
    s = mx.zeros((b, H, P, N), dtype=mx.float32) if state is None else state
    out_dtype = x.dtype if D is None else mx.result_type(x.dtype, D.dtype)
    d = mx.zeros((H,), mx.float32) if D is None else D
    if backend == "cuda":
        y, S = ssd_cuda.launch_ssd_cuda(x, dtp, A, B, C, d, s, out_dtype)
    else:
        y, S = msl.run_steps(x, dtp, A, B, C, d, s, out_dtype, backend=backend)
    return y, S if state is None else S.astype(state.dtype)


def ssd_stock(x, dt, A_log, B, C, D=None, dt_bias=None, state=None, mask=None, lengths=None,
              time_step_limit=DEFAULT_TIME_STEP_LIMIT):
    """mlx-lm's own computation for these arguments: ``ssm_update`` (its ``ssm_attn`` in steps
    of 256 for a prefill; ``lengths`` as a mixer passes them). D None is a zero skip."""
    from mlx_lm.models.ssm import ssm_update

    H = x.shape[2]
    bias = mx.zeros((H,), mx.float32) if dt_bias is None else dt_bias
    d = mx.zeros((H,), x.dtype) if D is None else D
    return ssm_update(x, A_log, B, C, d, dt, bias, state, tuple(time_step_limit), mask=mask,
                      lengths=lengths)
