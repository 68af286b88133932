"""Brick 3: SwiGLU MLP, ``down(SiLU(gate(x)) * up(x))`` as in llama-family models."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.backends import resolve_backend
from mlx_bricks.ops.gemm import linear, linear_reference


def silu_reference(g):
    """SiLU in float32: ``g * sigmoid(g)`` (sigmoid is stable for any magnitude)."""
    g32 = g.astype(mx.float32)
    return g32 * mx.sigmoid(g32)


def swiglu_reference(x, w_gate, w_up, b_gate=None, b_up=None):
    """Reference of :func:`swiglu` in MLX ops: ``SiLU(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)``."""
    gate = linear_reference(x, w_gate, b_gate)
    up = linear_reference(x, w_up, b_up)
    return (silu_reference(gate) * up.astype(mx.float32)).astype(x.dtype)


def swiglu_mlp_reference(x, w_gate, w_up, w_down, residual=None, b_gate=None, b_up=None,
                         b_down=None):
    """Reference of :func:`swiglu_mlp` in MLX ops."""
    act = swiglu_reference(x, w_gate, w_up, b_gate, b_up)
    return linear_reference(act, w_down, b_down, residual)


def swiglu(x, w_gate, w_up, *, b_gate=None, b_up=None, variant=None, backend=None):
    """``SiLU(x @ w_gate.T + b_gate) * (x @ w_up.T + b_up)`` on the SwiGLU brick.

    Args:
        x: (..., K) float16/bfloat16/float32.
        w_gate, w_up: (N_mlp, K), x's dtype (nn.Linear layout).
        b_gate, b_up: optional (N_mlp,) biases (``mlp_bias`` models).
        variant: ``None`` (rule in docs/bricks.md), ``"fused"`` or ``"split"``.
        backend: see ``mlx_bricks.backends``.

    Returns:
        (..., N_mlp) of x's dtype.
    """
    name = resolve_backend(backend)
    if name == "reference":
        return swiglu_reference(x, w_gate, w_up, b_gate, b_up)
    raise NotImplementedError(f"the SwiGLU brick is not yet available on backend {name!r}")


def swiglu_mlp(x, w_gate, w_up, w_down, residual=None, *, b_gate=None, b_up=None, b_down=None,
               variant=None, backend=None):
    """The llama MLP ``down(SiLU(gate(x)) * up(x)) (+ residual)`` on the bricks.

    Args:
        x: (..., K); w_gate, w_up: (N_mlp, K); w_down: (K, N_mlp); residual: optional (..., K).
        b_gate, b_up, b_down: optional biases.
        variant, backend: as in :func:`swiglu`.

    Returns:
        (..., K) of x's dtype.
    """
    act = swiglu(x, w_gate, w_up, b_gate=b_gate, b_up=b_up, variant=variant, backend=backend)
    return linear(act, w_down, b_down, residual, backend=backend)
