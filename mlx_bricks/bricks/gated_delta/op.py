"""The Gated DeltaNet brick's public op: the gated delta rule over a prefill, in chunks, with a
decay per head (Gated DeltaNet) or per key dim (Kimi Delta Attention).

The recurrence, per value head and token (state ``S`` (Dv, Dk), mlx-lm's layout)::

    S = S diag(g_t);  S = S + beta_t (v_t - S k_t) k_t^T;  y_t = S q_t

as mlx-lm 0.32.2's ``gated_delta_update`` runs it token by token (``models/gated_delta.py``).
The chunked form and its sources: ``chunked.py`` (one algorithm over MLX ops or NumPy).
"""
from __future__ import annotations


import mlx.core as mx
import numpy as np

from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.gated_delta import msl
from mlx_bricks.bricks.gated_delta.chunked import LEAF, MLX, NUMPY, chunked
from mlx_bricks.checks import check_array, check_float_dtype, dtype_name
from mlx_bricks.cpu import one_blas_thread

#: Tokens per chunk of the MLX-ops composite. The state products cost 3 * 2 * Dk * Dv flops per
#: token whatever the chunk, the intra-chunk ones about 8 * C * D: smaller chunks do less work
#: but more sequential steps. MLX 0.32.4's CPU build (reference BLAS, ~5 GFLOP/s of CPU time),
#: a Qwen3.5-shaped layer (16/32 heads of 128, 512 tokens, bf16), CPU seconds: C=16 0.40,
#: C=32 0.44, C=64 0.54, stock's token loop 0.87 (2026-12-05; flash-linear-attention uses 64
#: on GPUs).
CHUNK = 32
#: Tokens per chunk of the NumPy composite (``blas``): this CPU, 512 tokens, CPU seconds
#: (2026-12-06): Qwen3.5-shaped C=32 0.126, 64 0.14, 128 0.20; Kimi-Linear-shaped C=32 0.215,
#: 64 0.23, 128 0.31.
BLAS_CHUNK = 32


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


def gated_delta_chunked(q, k, v, g, beta, state=None, mask=None, *, chunk: int = CHUNK,
                        leaf: int = LEAF):
    """The gated delta rule in chunks, in MLX ops (the brick's ``chunked`` composite; the
    algorithm: ``chunked.py``).

    Args and returns as :func:`gated_delta` (arguments not re-checked); ``leaf``: see
    ``chunked.decayed_products``. The triangular inverse runs on the CPU stream (MLX's
    ``linalg.tri_inv`` has no GPU kernel); the rest on the default device, lazily.
    """
    y, S = chunked(MLX, q, k, v, g, beta, state, mask, chunk=chunk, leaf=leaf)
    return y.astype(q.dtype), S.astype(mx.float32 if state is None else state.dtype)


def gated_delta_blas(q, k, v, g, beta, state=None, mask=None, *, chunk: int = BLAS_CHUNK,
                     leaf: int = LEAF):
    """The same chunked form in NumPy float32 (the brick's ``blas`` composite, for the CPU):
    its matrix products run NumPy's BLAS (OpenBLAS in the wheels), several times MLX 0.32.4's
    CPU matmuls (the reference BLAS for float32; its own loops for half types).

    Eager: the arguments are evaluated and copied to NumPy, the outputs copied back (no lazy
    graph across the op). NumPy's OpenBLAS runs one thread meanwhile (:func:`one_blas_thread`).
    Args and returns as :func:`gated_delta`.
    """
    def host(a):
        return None if a is None else np.asarray(a.astype(mx.float32) if a.dtype != mx.bool_
                                                 else a)

    with np.errstate(divide="ignore"), one_blas_thread():  # log(0): floored in chunked()
        y, S = chunked(NUMPY, *map(host, (q, k, v, g, beta, state, mask)), chunk=chunk,
                       leaf=leaf)
    return (mx.array(y).astype(q.dtype),
            mx.array(S).astype(mx.float32 if state is None else state.dtype))


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
            arguments (``msl.kernel_reason``: Dk <= 128 and a multiple of 8, Dv a multiple of
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
        keep = mask[:, :, None, None] if g.ndim == 4 else mask[:, :, None]
        g = mx.where(keep, g.astype(mx.float32), 1.0)
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
