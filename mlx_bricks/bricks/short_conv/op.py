"""The short-conv brick's public op: a causal depthwise convolution of a few taps over a
prefill, continuing from the conv state mlx-lm's caches hold, with the gates and activation
the families put around it.

Per batch row, channel c and token t (K taps; ``u`` the convolution's input, ``s`` the K - 1
inputs before the prompt, mlx-lm's conv state)::

    u_t = gate_in_t * x_t            (LFM2's ShortConv: B * x; plain x without gate_in)
    u_t = 0 where the mask is False  (mlx-lm's padded batches)
    y_t = act(sum_k w[c, k] u_{t + k - (K - 1)} + bias[c]) * gate_out_t
    state = the K - 1 inputs before position ``lengths`` of [s, u] (the last K - 1 without)

as mlx-lm 0.32.2's mixers compute it: LFM2 / LFM2-MoE ``ShortConv`` (gate_in B, gate_out C, no
activation), the Mamba-2 mixers' ``_conv`` and the Gated DeltaNet's conv (SiLU, no gates), each
with ``nn.Conv1d(groups=channels)`` on the concatenation of the cache's state and the input.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.backends import op_backend
from mlx_bricks.bricks.short_conv import msl
from mlx_bricks.checks import check_array, check_float_dtype, check_optional, dtype_name

#: Activations the op applies after the convolution (None: none).
ACTIVATIONS = (None, "silu")


def check_short_conv_args(x, weight, bias=None, state=None, mask=None, gate_in=None,
                          gate_out=None, activation=None, lengths=None) -> tuple:
    """Validate the op's arguments; returns ``(batch, T, channels, K)``.

    Raises:
        TypeError: an argument is not an ``mx.array`` or has the wrong dtype (float arrays of
            x's dtype; ``mask`` bool; ``lengths`` integer).
        ValueError: shapes that do not match the layout of :func:`short_conv`; an unknown
            ``activation``.
    """
    check_array("x", x, ndim=3)
    check_float_dtype("x", x)
    b, T, C = x.shape
    check_array("weight", weight)
    check_float_dtype("weight", weight)
    w_shape = tuple(weight.shape)
    if len(w_shape) not in (2, 3) or w_shape[0] != C or (len(w_shape) == 3 and w_shape[2] != 1):
        raise ValueError(f"weight must be (channels={C}, K) or nn.Conv1d's depthwise (C, K, 1),"
                         f" got {w_shape}")
    K = w_shape[1]
    if K < 1:
        raise ValueError(f"weight must have at least one tap, got {w_shape}")
    for name, a, shape in (("gate_in", gate_in, (b, T, C)), ("gate_out", gate_out, (b, T, C)),
                           ("state", state, (b, K - 1, C)), ("bias", bias, (C,))):
        check_optional(name, a, shape, x.dtype)
    check_optional("mask", mask, (b, T), mx.bool_)
    if lengths is not None:
        check_array("lengths", lengths)
        if not mx.issubdtype(lengths.dtype, mx.integer):
            raise TypeError(f"lengths must be integer, got {dtype_name(lengths.dtype)}")
        if tuple(lengths.shape) != (b,):
            raise ValueError(f"lengths must have shape {(b,)}, got {tuple(lengths.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return b, T, C, K


def conv_input(x, gate_in=None, mask=None):
    """``u``: the convolution's input in x's dtype (``gate_in * x``, 0 at masked tokens), as
    the modules form it before concatenating the state."""
    u = x if gate_in is None else gate_in * x
    return u if mask is None else mx.where(mask[..., None], u, mx.zeros((), u.dtype))


def next_state(padded, K: int, lengths=None):
    """The conv state after the prompt from ``padded`` = [state, u] (batch, K - 1 + T, C): its
    last K - 1 rows, or (``lengths``) the K - 1 rows before each row's length, as mlx-lm's
    mixers take them (``ends = clip(lengths, 0, T)``)."""
    n_keep = K - 1
    T = padded.shape[1] - n_keep
    if lengths is None:
        return padded[:, T:, :]
    ends = mx.clip(lengths, 0, T)
    positions = (ends[:, None] + mx.arange(n_keep))[..., None]
    return mx.take_along_axis(padded, positions, axis=1)


def _padded(u, state, K):
    if state is None:
        state = mx.zeros((u.shape[0], K - 1, u.shape[2]), u.dtype)
    return mx.concatenate([state, u], axis=1)


def short_conv_composite(x, weight, bias=None, state=None, mask=None, gate_in=None,
                         gate_out=None, activation=None, lengths=None):
    """The op in MLX ops (the brick's composite): K shifted multiply-adds in float32 over
    [state, u] instead of a grouped convolution, then the bias, activation and output gate,
    rounded to x's dtype once. Arguments as :func:`short_conv` (not re-checked)."""
    T = x.shape[1]
    w = weight.reshape(weight.shape[0], -1).astype(mx.float32)
    K = w.shape[1]
    padded = _padded(conv_input(x, gate_in, mask), state, K)
    up = padded.astype(mx.float32)
    acc = up[:, 0:T] * w[:, 0]
    for k in range(1, K):
        acc = acc + up[:, k:k + T] * w[:, k]
    if bias is not None:
        acc = acc + bias.astype(mx.float32)
    if activation == "silu":
        acc = nn.silu(acc)
    if gate_out is not None:
        acc = acc * gate_out.astype(mx.float32)
    return acc.astype(x.dtype), next_state(padded, K, lengths)


def short_conv_stock(x, weight, bias=None, state=None, mask=None, gate_in=None,
                     gate_out=None, activation=None, lengths=None):
    """mlx-lm's own ops for these arguments, as its mixers run them: ``gate_in * x``, the mask,
    the state concatenated, ``nn.Conv1d(groups=channels)`` (``mx.conv1d`` plus the bias), the
    activation, ``gate_out * y``, each rounded to x's dtype."""
    C = x.shape[2]
    w = weight if weight.ndim == 3 else weight[..., None]
    K = w.shape[1]
    padded = _padded(conv_input(x, gate_in, mask), state, K)
    y = mx.conv1d(padded, w, groups=C)
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = nn.silu(y)
    if gate_out is not None:
        y = gate_out * y
    return y, next_state(padded, K, lengths)


def short_conv(x, weight, bias=None, state=None, mask=None, *, gate_in=None, gate_out=None,
               activation=None, lengths=None, backend: str | None = None):
    """A causal depthwise short convolution over a prefill (module docstring), from the conv
    state of an mlx-lm cache.

    Args:
        x: (batch, T, channels) float16 / bfloat16 / float32: the convolution's input (before
            ``gate_in``).
        weight: (channels, K) or ``nn.Conv1d``'s depthwise (channels, K, 1), any float dtype.
        bias: (channels,) or None, x's dtype.
        state: (batch, K - 1, channels) x's dtype: the K - 1 inputs before the prompt (mlx-lm's
            ``cache[0]``), or None for zeros.
        mask: (batch, T) bool or None: False tokens' inputs are 0 (mlx-lm's padded batches).
        gate_in, gate_out: (batch, T, channels) x's dtype, or None: ``u = gate_in * x`` and
            ``y = act(conv) * gate_out`` (LFM2's B and C).
        activation: None or ``"silu"`` (the Mamba-2 and Gated DeltaNet mixers').
        lengths: (batch,) integer or None: the state is taken before each row's length (a
            right-padded batch, mlx-lm's ``ArraysCache.lengths``).
        backend: ``None`` (auto) or a name of ``mlx_bricks.backends.BACKENDS``: ``metal`` /
            ``emulator`` run the MSL kernel, ``cuda`` its twin (K <= ``msl.MAX_K``);
            ``reference`` and the other cases the composite in MLX ops.

    Returns:
        ``(y, state)``: y (batch, T, channels) in x's dtype, computed in float32 and rounded
        once; the next conv state (batch, K - 1, channels) in x's dtype, bit-equal to
        mlx-lm's.

    Raises:
        TypeError, ValueError: see :func:`check_short_conv_args`.
    """
    check_short_conv_args(x, weight, bias, state, mask, gate_in, gate_out, activation, lengths)
    args = (x, weight, bias, state, mask, gate_in, gate_out, activation, lengths)
    b = op_backend("short_conv", backend)
    if b == "reference" or msl.kernel_reason(weight, x.shape) is not None:
        return short_conv_composite(*args)
    return run_kernel(*args, backend=b)


def run_kernel(*args, backend: str):
    """The MSL kernel (``metal``, ``emulator``) or its CUDA twin (``cuda``) on checked
    arguments (:func:`short_conv`'s, positionally) whose taps the kernel keeps
    (``msl.kernel_reason`` None). Returns ``(y, state)``."""
    if backend == "cuda":
        from mlx_bricks.bricks.short_conv.cuda import launch_short_conv_cuda

        return launch_short_conv_cuda(*args)
    return msl.launch_short_conv(*args, backend=backend)
