"""The chunked gated delta rule, written once over an array namespace: MLX ops (lazy, every
device: the brick's ``chunked`` composite) or NumPy (eager, float32 through its BLAS: the
``blas`` composite on the CPU, where MLX 0.32.4's own CPU matmuls run the reference BLAS).

The recurrence (per value head; state ``S`` of shape (Dv, Dk), mlx-lm's layout), for each
token t::

    S = S diag(g_t)                  (g_t a scalar per head, or a (Dk,) vector: per key dim)
    S = S + beta_t (v_t - S k_t) k_t^T
    y_t = S q_t

Chunked form (Yang, Kautz, Hatamizadeh 2024, "Gated Delta Networks", section 3 and appendix:
the WY / UT representation; per-key-dim decay as in Kimi Delta Attention, Kimi Team 2025,
"Kimi Linear", section 3, and gated linear attention's secondary chunking, Yang et al. 2024,
"Gated Linear Attention Transformers", section 4.2). Within a chunk of C tokens let
``L_t = sum_{s<=t} log g_s`` (per key dim; from the chunk's start) and ``S0`` the state at the
chunk's start, transposed to (Dk, Dv). The state after token t is
``diag(e^{L_t}) S0 + sum_{i<=t} (k_i e^{L_t - L_i}) u_i^T`` where the pseudo-values u solve the
unit lower-triangular system ``(I + diag(beta) A) U = diag(beta) (V - (K e^{L}) S0)`` with
``A_ti = sum_d k_td k_id e^{L_td - L_id}`` (i < t). Per chunk: ``T = (I + diag(beta) A)^-1``,
``W = T [diag(beta) V | diag(beta) K e^{L}]`` (state-independent, all chunks at once), then
the one sequential part, the chunk-to-chunk state recurrence in float32::

    U = W_v - W_k S0;  S1 = diag(e^{L_C}) S0 + (K e^{L_C - L})^T U

and the outputs ``Y = (Q e^{L}) S0 + P U`` with ``P_ti = sum_d q_td k_id e^{L_td - L_id}``
(i <= t).

The decayed products A and P (:func:`decayed_products`): with a gate per head the decay is
one ratio per pair (``exp(L_t - L_i)``, formed over the causal triangle only). With a gate per
key dim it differs per dim, so the chunk is halved recursively: the block of rows in the
second half against columns in the first is one matrix product of factors that are both at
most 1, ``(x_t e^{L_t - L_r}) . (k_i e^{L_r - L_i})`` with r the first half's last token
(i <= r < t, L non-increasing), and the two diagonal blocks recurse, down to ``leaf`` tokens,
whose pairs take ``exp(L_t - L_i)`` per dim directly. No factor exceeds 1, so nothing
overflows however strong the decay; one that underflows scales a product that is smaller
still. Decay factors below float32's epsilon are flushed to 0 (:data:`LOG_DECAY_FLUSH`).
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

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
#: Tokens of the diagonal blocks whose per-key-dim decays are formed pair by pair (a
#: (LEAF, LEAF, Dk) tensor per block); larger blocks are halved (module docstring). On this
#: CPU (Kimi-Linear-shaped layer, 32 heads of 128, 512 tokens, bf16, CPU seconds,
#: 2026-12-06): NumPy C=32 leaf 1 0.215, C=64 leaf 1 / 2 / 4 0.23 / 0.26 / 0.29; MLX ops
#: C=16 leaf 1 0.77, C=32 leaf 1 / 4 / 8 0.93 / 1.00 / 1.28.
LEAF = 1


class Namespace:
    """The array operations the chunked form uses, from MLX or NumPy (module docstring).

    Attributes:
        xp: the module (``mlx.core`` or ``numpy``); other functions are taken from it.
        f32: its float32 dtype.
    """

    def __init__(self, xp, f32, tri_inv):
        self.xp = xp
        self.f32 = f32
        self._tri_inv = tri_inv

    def __getattr__(self, name):
        return getattr(self.xp, name)

    def tri_inv(self, m):
        """The inverse of the unit lower-triangular matrices ``m`` (..., C, C), entries below
        :data:`INVERSE_FLUSH` flushed to 0."""
        inv = self._tri_inv(m)
        return self.xp.where(self.xp.abs(inv) < INVERSE_FLUSH, 0.0, inv)

    def decay(self, x):
        """exp(x) for log decays x <= 0, with x < LOG_DECAY_FLUSH (and -inf) giving 0."""
        return self.xp.exp(self.xp.where(x < LOG_DECAY_FLUSH, -math.inf, x))


#: MLX ops: the triangular inverse on the CPU stream (``linalg.tri_inv`` has no GPU kernel).
MLX = Namespace(mx, mx.float32, lambda m: mx.linalg.tri_inv(m, upper=False, stream=mx.cpu))
#: NumPy: float32 matrix products through its BLAS; the inverse by LU (LAPACK).
NUMPY = Namespace(np, np.float32, np.linalg.inv)


def _chunks(o, x, n: int, c: int, pad: int):
    """(B, T, H, ...) -> (B, H, N, C, ...) float32, T padded at the end with zeros."""
    x = x.astype(o.f32)
    if pad:
        x = o.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    B, _, H = x.shape[:3]
    x = x.reshape(B, n, c, H, *x.shape[3:])
    return x.transpose(0, 3, 1, 2, *range(4, x.ndim))


def _causal(o, c: int):
    """(C, C) float32: 0 on and below the diagonal, -inf above (added to a log decay before
    the exp)."""
    keep = o.tril(o.ones((c, c), dtype=o.f32)) > 0
    return o.where(keep, 0.0, -math.inf).astype(o.f32)


def _pairs(o, x, k, L):
    """sum_d x_td k_id exp(L_td - L_id) for i <= t, 0 above; x, k, L (..., n, Dk)."""
    d = o.decay(L[..., :, None, :] - L[..., None, :, :] + _causal(o, x.shape[-2])[:, :, None])
    return (x[..., :, None, :] * k[..., None, :, :] * d).sum(-1)


def decayed_products(o, x, k, L, leaf: int = LEAF):
    """``P[..., t, i] = sum_d x_td k_id exp(L_td - L_id)`` for i <= t, 0 above, for a gate per
    key dim (module docstring: the recursive halving).

    Args:
        o: the namespace (:data:`MLX` or :data:`NUMPY`).
        x, k, L: (..., n, Dk) float32; L non-increasing along n (cumulative log decays);
            n is ``leaf`` times a power of two, or at most ``leaf``.
        leaf: the block size whose pairs are formed directly.

    Returns:
        (..., n, n) float32.
    """
    n = x.shape[-2]
    if n <= leaf or n % 2:
        return _pairs(o, x, k, L)
    h = n // 2
    halves = [a.reshape(*a.shape[:-2], 2, h, a.shape[-1]) for a in (x, k, L)]
    diag = decayed_products(o, *halves, leaf=leaf)  # (..., 2, h, h)
    xs, ks, Ls = halves
    ref = Ls[..., 0, h - 1:h, :]  # the first half's last token
    left = xs[..., 1, :, :] * o.decay(Ls[..., 1, :, :] - ref)
    right = ks[..., 0, :, :] * o.decay(ref - Ls[..., 0, :, :])
    off = left @ right.swapaxes(-1, -2)
    top = o.concatenate([diag[..., 0, :, :], o.zeros(off.shape, dtype=o.f32)], axis=-1)
    return o.concatenate([top, o.concatenate([off, diag[..., 1, :, :]], axis=-1)], axis=-2)


def chunked(o, q, k, v, g, beta, state, mask, *, chunk: int, leaf: int = LEAF):
    """The gated delta rule in chunks (module docstring) on arrays of namespace ``o``.

    Args:
        o: :data:`MLX` or :data:`NUMPY`; the arrays are of its kind.
        q, k: (B, T, Hk, Dk); v: (B, T, Hv, Dv), Hv a multiple of Hk; g: (B, T, Hv) or
            (B, T, Hv, Dk) decays in [0, 1]; beta: (B, T, Hv); any float dtype.
        state: (B, Hv, Dv, Dk) or None (zeros); mask: (B, T) bool or None (False tokens keep
            the state and give y = 0).
        chunk: tokens per chunk (> 0). leaf: see :func:`decayed_products`.

    Returns:
        ``(y, S)``: y (B, T, Hv, Dv) and the final state (B, Hv, Dv, Dk), both float32.
    """
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    f32 = o.f32
    if T == 0:  # no token: no output, the state passes through
        S = o.zeros((B, Hv, Dv, Dk), dtype=f32) if state is None else state.astype(f32)
        return o.zeros((B, 0, Hv, Dv), dtype=f32), S
    r = Hv // Hk
    vectorized = g.ndim == 4
    c = int(chunk)
    pad = (-T) % c
    n = (T + pad) // c
    g, beta = g.astype(f32), beta.astype(f32)
    if mask is not None:  # a masked token leaves the state as it is (decay 1, no write)
        g = o.where(mask[:, :, None, None] if vectorized else mask[:, :, None], g, 1.0)
        beta = o.where(mask[:, :, None], beta, 0.0)
    lg = o.maximum(o.log(g), LOG_DECAY_FLOOR)
    # key side (B, Hk, 1, N, C, Dk), value side (B, Hk, r, N, C, ...): GQA by broadcasting
    Q = _chunks(o, q, n, c, pad)[:, :, None]
    K = _chunks(o, k, n, c, pad)[:, :, None]
    V = _chunks(o, v.reshape(B, T, Hk, r, Dv), n, c, pad).transpose(0, 1, 4, 2, 3, 5)
    beta = _chunks(o, beta.reshape(B, T, Hk, r), n, c, pad).transpose(0, 1, 4, 2, 3)
    if vectorized:
        lg = _chunks(o, lg.reshape(B, T, Hk, r, Dk), n, c, pad).transpose(0, 1, 4, 2, 3, 5)
    else:
        lg = _chunks(o, lg.reshape(B, T, Hk, r), n, c, pad).transpose(0, 1, 4, 2, 3)[..., None]
    L = o.cumsum(lg, axis=-2)  # (B, Hk, r, N, C, 1 | Dk): log decay from the chunk's start
    L_end = L[..., -1:, :]
    gam = o.decay(L)
    strict = o.tril(o.ones((c, c), dtype=f32), -1)  # A's triangle: i < t
    if vectorized:
        QK = decayed_products(o, Q, K, L, leaf)
        A = decayed_products(o, K, K, L, leaf) * strict
    else:
        ratio = o.decay(L[..., :, None, 0] - L[..., None, :, 0] + _causal(o, c))
        QK = (Q @ K.swapaxes(-1, -2)) * ratio
        A = (K @ K.swapaxes(-1, -2)) * (ratio * strict)
    Tinv = o.tri_inv(o.eye(c, dtype=f32) + beta[..., None] * A)
    # W_v and W_k in one product: T [beta V | beta e^L K]
    W = Tinv @ o.concatenate([beta[..., None] * V, (beta[..., None] * gam) * K], axis=-1)
    Wv = W[..., :Dv]
    # [W_k; e^L Q] against the chunk's start state in one product per chunk
    WQ = o.concatenate([W[..., Dv:], Q * gam], axis=-2)  # (B, Hk, r, N, 2C, Dk)
    Kd = K * o.decay(L_end - L)  # keys decayed to the chunk's end
    decay_end = o.decay(L_end[..., 0, :])[..., :, None]  # (B, Hk, r, N, 1 | Dk, 1)
    # the state as (B, Hk, r, Dk, Dv): S^T of mlx-lm's (B, Hv, Dv, Dk)
    if state is None:
        S = o.zeros((B, Hk, r, Dk, Dv), dtype=f32)
    else:
        S = state.astype(f32).reshape(B, Hk, r, Dv, Dk).swapaxes(-1, -2)
    us, inter = [], []
    for j in range(n):
        P = WQ[:, :, :, j] @ S
        u = Wv[:, :, :, j] - P[..., :c, :]
        us.append(u)
        inter.append(P[..., c:, :])
        S = decay_end[:, :, :, j] * S + Kd[:, :, :, j].swapaxes(-1, -2) @ u
    Y = o.stack(inter, axis=3) + QK @ o.stack(us, axis=3)  # (B, Hk, r, N, C, Dv)
    y = Y.reshape(B, Hv, n * c, Dv)[:, :, :T].transpose(0, 2, 1, 3)
    if mask is not None:
        y = o.where(mask[:, :, None, None], y, 0.0)
    return y, S.swapaxes(-1, -2).reshape(B, Hv, Dv, Dk)
