"""RMSNorm fused with the Q/K/V projections, written straight in head layout."""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.backends import resolve_backend


def rms_norm_qkv_reference(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *,
                           n_heads, n_kv_heads, head_dim):
    """Reference of :func:`rms_norm_qkv` in MLX ops."""
    B, L, _ = x.shape
    h = mx.fast.rms_norm(x, norm_weight, eps)

    def proj(w, b, n):
        y = h @ w.T
        if b is not None:
            y = y + b
        return y.reshape(B, L, n, head_dim).transpose(0, 2, 1, 3)

    return proj(wq, bq, n_heads), proj(wk, bk, n_kv_heads), proj(wv, bv, n_kv_heads)


def rms_norm_qkv(x, norm_weight, eps, wq, wk, wv, bq=None, bk=None, bv=None, *, n_heads,
                 n_kv_heads, head_dim, backend=None):
    """``q, k, v = proj(rms_norm(x))`` with each output in head layout (B, H, L, head_dim).

    Args:
        x: (B, L, K); norm_weight: (K,); eps: RMSNorm epsilon.
        wq: (n_heads * head_dim, K); wk, wv: (n_kv_heads * head_dim, K); optional biases.

    Returns:
        (q, k, v): (B, n_heads, L, head_dim), (B, n_kv_heads, L, head_dim) twice.
    """
    name = resolve_backend(backend)
    if name == "reference":
        return rms_norm_qkv_reference(x, norm_weight, eps, wq, wk, wv, bq, bk, bv,
                                      n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim)
    raise NotImplementedError(f"the RMSNorm+QKV brick is not yet available on backend {name!r}")
