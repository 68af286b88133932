"""Brick 4: FlashAttention prefill (online softmax, causal tile skipping, GQA, Q8_0 K/V)."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.backends import resolve_backend


def flash_attention_reference(q, k, v, *, scale, mask=None):
    """Reference of :func:`flash_attention`: ``mx.fast.scaled_dot_product_attention``.

    ``mask`` is None or "causal" (bottom-right aligned when Lk > Lq).
    """
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def flash_attention(q, k, v, *, scale, mask=None, kv_quant=None, backend=None):
    """Softmax attention ``softmax(q @ k.T * scale + mask) @ v`` on the attention brick.

    Args:
        q: (B, Hq, Lq, D); k, v: (B, Hkv, Lk, D), Hq % Hkv == 0, Lk >= Lq.
        scale: float multiplier of the scores (usually D ** -0.5).
        mask: None or "causal" (query i sees keys 0 .. Lk - Lq + i).
        kv_quant: None or "q8_0".
        backend: see ``mlx_bricks.backends``.

    Returns:
        (B, Hq, Lq, D) of q's dtype.
    """
    name = resolve_backend(backend)
    if name == "reference":
        return flash_attention_reference(q, k, v, scale=scale, mask=mask)
    raise NotImplementedError(f"the attention brick is not yet available on backend {name!r}")
