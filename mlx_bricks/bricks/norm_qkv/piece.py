"""The RMSNorm + QKV brick's piece in a patched mlx-lm block: the input RMSNorm and the q/k/v
projections as one ``rms_norm_qkv`` piece, with its arguments and stock path, and how the
bricks read an RMSNorm module (``nn.RMSNorm``, or an architecture's ``1 + w`` RMSNorm)."""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.bricks.norm_qkv.kind import RMS_NORM_QKV
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats.layers import bias_of, weight_of

#: The op kind of the piece.
KIND = RMS_NORM_QKV


def is_offset_norm(module, layout) -> bool:
    """True for the model file's own ``RMSNorm`` of an ``offset_norm`` layout (gemma:
    ``mx.fast.rms_norm(x, 1 + weight, eps)``)."""
    cls = type(module)
    return layout.offset_norm and (cls.__module__, cls.__name__) == (layout.module, "RMSNorm")


def norm_weight(norm, layout):
    """The weight ``mx.fast.rms_norm`` takes for ``norm``: ``norm.weight`` for ``nn.RMSNorm``,
    ``1 + norm.weight`` (in the weight's dtype, as the gemma module computes it) for an
    ``offset_norm`` layout's RMSNorm."""
    return 1.0 + norm.weight if is_offset_norm(norm, layout) else norm.weight


def rms_norm_reason(name: str, module, layout, dtype=None) -> str | None:
    """Why ``module`` cannot be fused as an RMSNorm (None if it is a plain ``nn.RMSNorm``, or
    the layout's own ``1 + w`` RMSNorm, whose weight the bricks take as :func:`norm_weight`)."""
    if type(module) is not nn.RMSNorm and not is_offset_norm(module, layout):
        return f"{name} is {type(module).__name__}, not nn.RMSNorm"
    if dtype is not None and module.weight.dtype != dtype:
        return (f"{name}.weight is {dtype_name(module.weight.dtype)} but the input is "
                f"{dtype_name(dtype)}")
    return None


def heads(y, B, L, n):
    """(B, L, n * head_dim) -> (B, n, L, head_dim), as mlx-lm's attention reshapes."""
    return y.reshape(B, L, n, -1).transpose(0, 2, 1, 3)


def qkv_args(block, layout, x, head_dim) -> dict:
    """The piece's arguments from the block's input norm and its attention's q/k/v."""
    attn = block[layout.attention]
    norm = block[layout.input_norm]
    qp, kp, vp = (attn[n] for n in (layout.q_proj, layout.k_proj, layout.v_proj))
    return {"x": x, "norm_weight": norm_weight(norm, layout), "eps": norm.eps,
            "wq": weight_of(qp), "wk": weight_of(kp), "wv": weight_of(vp),
            "bq": bias_of(qp), "bk": bias_of(kp), "bv": bias_of(vp),
            **dict(zip(("n_heads", "n_kv_heads"), layout.head_counts(attn))),
            "head_dim": head_dim}


def qkv_stock(block, layout, x):
    """mlx-lm's computation: ``input_layernorm`` then ``q_proj``/``k_proj``/``v_proj``, in
    head layout."""
    attn = block[layout.attention]
    B, L, _ = x.shape
    h = block[layout.input_norm](x)
    n_heads, n_kv_heads = layout.head_counts(attn)
    return (heads(attn[layout.q_proj](h), B, L, n_heads),
            heads(attn[layout.k_proj](h), B, L, n_kv_heads),
            heads(attn[layout.v_proj](h), B, L, n_kv_heads))
