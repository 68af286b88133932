"""The Gated DeltaNet brick's public op: the gated delta rule over a prefill, in chunks.

The recurrence (per value head; state ``S`` of shape (Dv, Dk), mlx-lm's layout) is, for each
token t::

    S = g_t * S                      (g_t a scalar, or a (Dk,) vector scaling S's columns)
    S = S + beta_t * (v_t - S k_t) k_t^T
    y_t = S q_t

as mlx-lm 0.32.2's ``gated_delta_update`` runs it token by token (``models/gated_delta.py``).
The chunked form (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks: Improving Mamba2 with
Delta Rule", section 3 and appendix; the WY / UT representation of Householder products) turns
it into matrix products: within a chunk of C tokens, with ``G_t`` the decay from the chunk's
start to token t (a cumulative product) and ``S0`` the state at the chunk's start, the state
after token t is ``G_t S0 + sum_{i<=t} (G_t / G_i) u_i k_i^T`` where the pseudo-values ``u``
solve the unit lower-triangular system ``(I + diag(beta) A) U = diag(beta) (V - diag(G) K S0^T)``
with ``A_ti = (G_t / G_i) k_t . k_i`` for i < t. So per chunk: ``T = (I + diag(beta) A)^-1``
(one triangular inverse per chunk and head), ``W_v = T diag(beta) V`` and
``W_k = T diag(beta G) K`` (independent of the state, all chunks at once), then the only
sequential part, the inter-chunk state recurrence in float32::

    U = W_v - W_k S0^T;  S1 = G_C S0 + U^T (K * G_C / G)

and the outputs ``Y = diag(G) Q S0^T + (tril(Q K^T * G_t / G_i)) U`` (all chunks at once).
Decay ratios are formed as ``exp(log G_t - log G_i)`` over the causal triangle only, so they
never overflow; a decay of exactly 0 is floored at ``exp(LOG_DECAY_FLOOR)``.
"""
from __future__ import annotations

import math

import mlx.core as mx

from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.gated_delta import msl
from mlx_bricks.checks import check_array, check_float_dtype, dtype_name

#: Tokens per chunk of the composite. The state products cost 3 * 2 * Dk * Dv flops per token
#: whatever the chunk, the intra-chunk ones about 8 * C * D: smaller chunks do less work but
#: more sequential steps. MLX 0.32.4's CPU build (reference BLAS, ~5 GFLOP/s of CPU time), a
#: Qwen3.5-shaped layer (16/32 heads of 128, 512 tokens, bf16), CPU seconds: C=16 0.40,
#: C=32 0.44, C=64 0.54, stock's token loop 0.87 (2026-12-05; flash-linear-attention uses 64
#: on GPUs).
CHUNK = 32
#: Per-token log-decay floor: a decay g below exp(-60) ~ 1e-26 (0 included) is taken as
#: exp(-60); the state it multiplies is then below float32's resolution of any kept value.
LOG_DECAY_FLOOR = -60.0
#: Decay factors below exp(-16) ~ 1.1e-7, float32's epsilon (from one token to another, or to a
#: chunk's edge), are taken as 0, and so are entries of the triangular inverse below
#: :data:`INVERSE_FLUSH`: what they scale is then below float32's resolution of the values it
#: adds to, and left in, their products reach float32's subnormal range, where x86 arithmetic
#: is many times slower (a Qwen3.5-shaped layer with model-like decays, mlx-lm's A in [1, 16],
#: ran 3-4x slower before this).
LOG_DECAY_FLUSH = -16.0
INVERSE_FLUSH = 1e-12


def _decay(x):
    """exp(x) for log decays x <= 0, with x < LOG_DECAY_FLUSH (and -inf) giving exactly 0."""
    return mx.exp(mx.where(x < LOG_DECAY_FLUSH, -math.inf, x))


def check_gated_delta_args(q, k, v, g, beta, state=None, mask=None) -> tuple:
    """Validate the op's arguments; returns ``(B, T, Hk, Hv, Dk, Dv, vectorized)``.

    Raises:
        TypeError: an argument is not an ``mx.array`` or has a non-float dtype (``mask``:
            not bool).
        ValueError: shapes that do not match the layout of :func:`gated_delta`.
    """
    for name, a in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        check_array(name, a)
        check_float_dtype(name, a)
    check_array("q", q, ndim=4)
    B, T, Hk, Dk = q.shape
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"k and v must have q's dtype {dtype_name(q.dtype)}, got "
                        f"{dtype_name(k.dtype)} and {dtype_name(v.dtype)}")
    check_array("v", v, ndim=4)
    if tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must be (B, T, Hv, Dv) with B, T = {B}, {T}, got {tuple(v.shape)}")
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"v's heads ({Hv}) must be a multiple of q/k's heads ({Hk})")
    if tuple(beta.shape) != (B, T, Hv):
        raise ValueError(f"beta must have shape {(B, T, Hv)}, got {tuple(beta.shape)}")
    if tuple(g.shape) == (B, T, Hv):
        vectorized = False
    elif tuple(g.shape) == (B, T, Hv, Dk):
        vectorized = True
    else:
        raise ValueError(f"g must have shape {(B, T, Hv)} (per head) or {(B, T, Hv, Dk)} "
                         f"(per key dim), got {tuple(g.shape)}")
    if state is not None:
        check_array("state", state)
        check_float_dtype("state", state)
        if tuple(state.shape) != (B, Hv, Dv, Dk):
            raise ValueError(f"state must have shape {(B, Hv, Dv, Dk)}, got "
                             f"{tuple(state.shape)}")
    if mask is not None:
        check_array("mask", mask)
        if mask.dtype != mx.bool_:
            raise TypeError(f"mask must be bool, got {dtype_name(mask.dtype)}")
        if tuple(mask.shape) != (B, T):
            raise ValueError(f"mask must have shape {(B, T)}, got {tuple(mask.shape)}")
    return B, T, Hk, Hv, Dk, Dv, vectorized


def _chunks(x, n: int, c: int, pad: int, value: float = 0.0):
    """(B, T, H, ...) -> (B, H, N, C, ...) float32, T padded at the end with ``value``."""
    x = x.astype(mx.float32)
    if pad:
        widths = [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)
        x = mx.pad(x, widths, constant_values=value)
    B, _, H = x.shape[:3]
    x = x.reshape(B, n, c, H, *x.shape[3:])
    return x.transpose(0, 3, 1, 2, *range(4, x.ndim))


def _causal_bias(c: int):
    """(C, C) float32: 0 on and below the diagonal, -inf above (added before an exp)."""
    causal = mx.tril(mx.ones((c, c), dtype=mx.bool_))
    return mx.where(causal, 0.0, -math.inf).astype(mx.float32)


def _ratios(L, bias):
    """exp(L_t - L_i) on and below the diagonal, 0 above, for L (..., C) (scalar gate): the
    upper triangle is set to -inf before the exp, so a ratio above 1 (never needed) cannot
    overflow."""
    return _decay(L[..., :, None] - L[..., None, :] + bias)


def _pair_products(x, y, L, bias):
    """sum_d x_td y_id exp(L_td - L_id) on and below the diagonal, 0 above: the per-key-dim
    (vectorized) gate's decayed products, for x, y, L (..., C, Dk)."""
    d = _decay(L[..., :, None, :] - L[..., None, :, :] + bias[..., None])
    return (x[..., :, None, :] * y[..., None, :, :] * d).sum(-1)


def gated_delta_chunked(q, k, v, g, beta, state=None, mask=None, *, chunk: int = CHUNK):
    """The gated delta rule in chunks, in MLX ops (the brick's composite; module docstring).

    Args and returns as :func:`gated_delta` (arguments not re-checked). The triangular inverse
    runs on the CPU stream (MLX's ``linalg.tri_inv`` has no GPU kernel); the rest on the
    default device. Per-key-dim gates (g of shape (B, T, Hv, Dk)) build their decayed products
    one chunk at a time (a (C, C, Dk) tensor per head).

    Source: Yang, Kautz, Hatamizadeh 2024 (Gated Delta Networks), the chunkwise form.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if T == 0:  # no token: no output, the state passes through (as the kernels do)
        S = (mx.zeros((B, Hv, Dv, Dk), mx.float32) if state is None
             else state.astype(state.dtype))
        return mx.zeros((B, 0, Hv, Dv), q.dtype), S
    r = Hv // Hk
    vectorized = g.ndim == 4
    c = int(chunk)
    pad = (-T) % c
    n = (T + pad) // c
    f32 = mx.float32
    g = g.astype(f32)
    beta = beta.astype(f32)
    if mask is not None:  # a masked token leaves the state as it is (decay 1, no write)
        m = mask[:, :, None, None] if vectorized else mask[:, :, None]
        g = mx.where(m, g, 1.0)
        beta = mx.where(mask[:, :, None], beta, 0.0)
    lg = mx.maximum(mx.log(g), LOG_DECAY_FLOOR)
    # key side (B, Hk, 1, N, C, Dk), value side (B, Hk, r, N, C, ...): GQA by broadcasting
    Q = _chunks(q, n, c, pad)[:, :, None]
    K = _chunks(k, n, c, pad)[:, :, None]
    V = _chunks(v.reshape(B, T, Hk, r, Dv), n, c, pad)  # (B, Hk, N, C, r, Dv)
    V = V.transpose(0, 1, 4, 2, 3, 5)
    beta = _chunks(beta.reshape(B, T, Hk, r), n, c, pad).transpose(0, 1, 4, 2, 3)
    if vectorized:
        lg = _chunks(lg.reshape(B, T, Hk, r, Dk), n, c, pad).transpose(0, 1, 4, 2, 3, 5)
    else:
        lg = _chunks(lg.reshape(B, T, Hk, r), n, c, pad).transpose(0, 1, 4, 2, 3)[..., None]
    L = mx.cumsum(lg, axis=-2)  # (B, Hk, r, N, C, 1 | Dk): log decay from the chunk's start
    L_end = L[..., -1:, :]
    gam = _decay(L)
    Kd = K * _decay(L_end - L)  # keys decayed to the chunk's end (ratios <= 1)
    causal = _causal_bias(c)
    strict = mx.tril(mx.ones((c, c), dtype=f32), -1)
    if vectorized:
        A, QK = [], []
        for j in range(n):  # (C, C, Dk) per head and chunk: one chunk at a time
            Kj, Lj = K[:, :, :, j], L[:, :, :, j]
            A.append(_pair_products(Kj, Kj, Lj, causal) * strict)
            QK.append(_pair_products(Q[:, :, :, j], Kj, Lj, causal))
        A, QK = mx.stack(A, axis=3), mx.stack(QK, axis=3)
    else:
        ratio = _ratios(L[..., 0], causal)  # one exp per pair, shared by A and QK
        A = (K @ K.swapaxes(-1, -2)) * (ratio * strict)
        QK = (Q @ K.swapaxes(-1, -2)) * ratio
    eye = mx.eye(c, dtype=f32)
    Tinv = mx.linalg.tri_inv(eye + beta[..., None] * A, upper=False, stream=mx.cpu)
    Tinv = mx.where(mx.abs(Tinv) < INVERSE_FLUSH, 0.0, Tinv)
    # W_v and W_k in one product: T [beta V | beta G K]
    bV = beta[..., None] * V
    W = Tinv @ mx.concatenate([bV, (beta[..., None] * gam) * K], axis=-1)
    Wv = W[..., :Dv]
    # [W_k; G Q] against the chunk's start state in one product per chunk
    WQ = mx.concatenate([W[..., Dv:], Q * gam], axis=-2)  # (B, Hk, r, N, 2C, Dk)
    decay_end = _decay(L_end[..., 0, :])[..., :, None]  # (B, Hk, r, N, 1 | Dk, 1)
    # the state as (B, Hk, r, Dk, Dv): S^T of mlx-lm's (B, Hv, Dv, Dk)
    if state is None:
        S = mx.zeros((B, Hk, r, Dk, Dv), dtype=f32)
    else:
        S = state.astype(f32).reshape(B, Hk, r, Dv, Dk).swapaxes(-1, -2)
    us, inter = [], []
    for j in range(n):
        P = WQ[:, :, :, j] @ S
        u = Wv[:, :, :, j] - P[..., :c, :]
        us.append(u)
        inter.append(P[..., c:, :])
        S = decay_end[:, :, :, j] * S + Kd[:, :, :, j].swapaxes(-1, -2) @ u
    Y = mx.stack(inter, axis=3) + QK @ mx.stack(us, axis=3)  # (B, Hk, r, N, C, Dv)
    y = Y.reshape(B, Hv, n * c, Dv)[:, :, :T].transpose(0, 2, 1, 3)
    if mask is not None:
        y = mx.where(mask[:, :, None, None], y, 0.0)
    out_dtype = f32 if state is None else state.dtype
    S = S.swapaxes(-1, -2).reshape(B, Hv, Dv, Dk).astype(out_dtype)
    return y.astype(q.dtype), S


def gated_delta(q, k, v, g, beta, state=None, mask=None, *, chunk: int = CHUNK,
                backend: str | None = None):
    """The gated delta rule over a prefill (module docstring), from an optional initial state.

    Shapes as mlx-lm 0.32.2's ``gated_delta_update`` takes them after its gate computation
    (``models/gated_delta.py``):

    Args:
        q, k: (B, T, Hk, Dk), float16 / bfloat16 / float32, the same dtype; q already scaled
            (mlx-lm's ``normalize_qk`` folds ``Dk**-0.5`` into q; the op applies no scale).
        v: (B, T, Hv, Dv), q's dtype; Hv a multiple of Hk (value head h reads key head
            ``h // (Hv // Hk)``, GQA-style).
        g: decay in [0, 1], (B, T, Hv) (per head) or (B, T, Hv, Dk) (per key dim), any float
            dtype (mlx-lm passes float32).
        beta: write strength (B, T, Hv), in [0, 1], or [0, 2] with ``allow_neg_eigval``.
        state: (B, Hv, Dv, Dk) initial state (mlx-lm's cache layout), or None for zeros.
        mask: (B, T) bool or None: False tokens (left padding of a batch) leave the state
            unchanged and give y = 0 (as mlx-lm's Metal kernel).
        chunk: tokens per chunk (> 0) of the MLX-ops composite (the kernel's is
            ``msl.CHUNK``).
        backend: ``None`` (auto) or a name of ``mlx_bricks.backends.BACKENDS``: ``metal`` /
            ``emulator`` run the MSL kernel, ``cuda`` its twin, where the kernel computes the
            arguments (``msl.kernel_reason``: a gate per head, Dk <= 128, Dv a multiple of
            8); ``reference`` and the other cases run the chunked composite in MLX ops.

    Returns:
        ``(y, state)``: y (B, T, Hv, Dv) in q's dtype; the final state (B, Hv, Dv, Dk) in
        ``state``'s dtype (float32 when None), computed in float32.

    Raises:
        TypeError, ValueError: see :func:`check_gated_delta_args`; ``chunk`` not a positive
            int.
    """
    check_gated_delta_args(q, k, v, g, beta, state, mask)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")
    b = op_backend("gated_delta", backend)
    if b == "reference" or msl.kernel_reason(q, v, g) is not None:
        return gated_delta_chunked(q, k, v, g, beta, state, mask, chunk=chunk)
    return run_kernel(q, k, v, g, beta, state, mask, backend=b)


def run_kernel(q, k, v, g, beta, state=None, mask=None, *, backend: str):
    """The MSL kernel (``metal``, ``emulator``) or its CUDA twin (``cuda``) on checked
    arguments the kernel computes (``msl.kernel_reason`` None). A mask becomes g = 1 and
    beta = 0 at masked tokens (the state passes them unchanged) and y = 0 there."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if mask is not None:
        g = mx.where(mask[:, :, None], g.astype(mx.float32), 1.0)
        beta = mx.where(mask[:, :, None], beta.astype(mx.float32), 0.0)
    s = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32) if state is None else state
    y, S = msl.launch_gated_delta(q, k, v, g, beta, s, backend=backend)
    if mask is not None:
        y = mx.where(mask[:, :, None, None], y, mx.zeros((), y.dtype))
    return y, S if state is None else S.astype(state.dtype)


def gated_delta_gates(a, b, A_log, dt_bias, *, lower_bound: float | None = None,
                      allow_neg_eigval: bool = False) -> tuple:
    """``(g, beta)`` from the projections as mlx-lm's ``gated_delta_update`` forms them (its
    own compiled ``compute_g`` / ``compute_lower_bound_g``): ``beta = sigmoid(b)`` (times 2
    with ``allow_neg_eigval``), ``g = exp(-exp(A_log) * softplus(a + dt_bias))`` or, with
    ``lower_bound``, ``exp(lower_bound * sigmoid(exp(A_log) * (a + dt_bias)))``.

    Args:
        a, b: (B, T, Hv) projections; A_log, dt_bias: (Hv,) (or broadcastable, as mlx-lm).
    """
    from mlx_lm.models.gated_delta import compute_g, compute_lower_bound_g

    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        g = compute_g(A_log, a, dt_bias)
    else:
        g = compute_lower_bound_g(A_log, a, dt_bias, lower_bound)
    return g, beta


def gated_delta_stock(q, k, v, g, beta, state=None, mask=None):
    """mlx-lm's own recurrence for these arguments, as ``gated_delta_update`` dispatches it
    after the gates: its Metal kernel on a Metal GPU (Dk a multiple of 32), else its
    token-by-token MLX-ops loop (``gated_delta_ops``). ``state`` None starts from float32
    zeros, as mlx-lm."""
    from mlx_lm.models import gated_delta as gd

    if state is None:
        B, _, _, Dk = q.shape
        Hv, Dv = v.shape[-2:]
        state = mx.zeros((B, Hv, Dv, Dk), dtype=mx.float32)
    if (mx.default_device() != mx.gpu or not mx.metal.is_available() or k.shape[-1] < 32
            or k.shape[-1] % 32 != 0):
        return gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    return gd.gated_delta_kernel(q, k, v, g, beta, state, mask)
