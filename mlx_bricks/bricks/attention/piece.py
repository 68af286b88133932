"""The attention brick's piece in a patched mlx-lm attention module: the arguments of the
``attention`` kind (before q/k/v exist: shapes only), the masking the brick takes for
mlx-lm's mask, and the stock path (mlx-lm's attention function, with the module's attention
sinks where the layout has them, or the brick's MLX reference where mlx-lm's module computes
something that function does not: Q8_0 K/V, a soft-cap)."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import BatchKVCache, ChunkedKVCache, RotatingKVCache

from mlx_bricks.bricks.attention.kind import ATTENTION
from mlx_bricks.bricks.attention.op import flash_attention_reference
from mlx_bricks.runtime.kind import Act

#: The op kind of the piece.
KIND = ATTENTION


def kv_length(cache, L: int) -> int:
    """Keys ``cache.update_and_fetch`` returns for L new tokens (``RotatingKVCache`` with
    ``keep == 0``: at most ``max_size - 1`` earlier ones, in temporal order; ``BatchKVCache``:
    every row's ``_idx`` positions, left padding included; ``ChunkedKVCache``: those from its
    ``start_position`` on)."""
    if cache is None:
        return L
    if type(cache) is RotatingKVCache:
        return min(cache.offset, cache.max_size - 1) + L
    if type(cache) is BatchKVCache:
        return cache._idx + L
    if type(cache) is ChunkedKVCache:  # keys from start_position on (maybe_trim_front)
        return cache.offset - cache.start_position + L
    return cache.offset + L


def is_padded_batch(cache, mask) -> bool:
    """True when the call is a left-padded batch the brick takes with ``kv_start``: the cache
    is mlx-lm's ``BatchKVCache`` and the mask an array (its ``make_mask``, checked by shape in
    ``nn.calls``; its values are never read)."""
    return type(cache) is BatchKVCache and isinstance(mask, mx.array)


def softcap_of(attn, layout):
    """The layout's logit soft-cap of ``attn``, or None."""
    return getattr(attn, layout.softcap) if layout.softcap is not None else None


def masking(attn, layout, mask, window, cache=None) -> dict:
    """The brick's masking arguments for mlx-lm's ``mask`` (already accepted by the module's
    call checks): an array mask is causal (with the layer's ``window``, if any), plus the
    layout's soft-cap and attention sinks. A padded batch (:func:`is_padded_batch`) adds
    ``kv_start = cache.left_padding`` ((B,) int32, read on the device: ``make_mask`` is
    ``create_causal_mask(L, offset=_idx, left_padding=left_padding)``, bottom-right causal
    over the ``_idx + L`` keys with row b's keys below ``left_padding[b]`` hidden)."""
    out = {"mask": "causal" if isinstance(mask, mx.array) else mask}
    if is_padded_batch(cache, mask):
        out["kv_start"] = cache.left_padding
    if window is not None:
        out["window"] = window
    softcap = softcap_of(attn, layout)
    if softcap is not None:
        out["softcap"] = softcap
    sinks = layout.sinks_of(attn)
    if sinks is not None:
        out["sinks"] = sinks
    return out


def attention_args(attn, layout, B, L, cache, dtype, mask, *, head_dim, kv_quant,
                   window=None) -> dict:
    """Arguments of the attention piece before q/k/v exist (shapes only): keys are the ones
    the cache returns (the cached ones plus this chunk's); masking by :func:`masking`."""
    n_heads, n_kv_heads = layout.head_counts(attn)
    kv = Act((B, n_kv_heads, kv_length(cache, L), head_dim), dtype)
    args = {"q": Act((B, n_heads, L, head_dim), dtype), "k": kv, "v": kv,
            "scale": layout.scale_of(attn), "kv_quant": kv_quant}
    args.update(masking(attn, layout, mask, window, cache))
    return args


def attention_stock(attn, layout, q, k, v, mask, cache, *, kv_quant, window=None):
    """The stock path of the attention piece: mlx-lm's ``scaled_dot_product_attention`` with
    its own mask (and the layout's sinks, as gpt-oss calls it), or, for the requested Q8_0 K/V
    or a soft-cap that function does not apply, the brick's MLX-ops reference."""
    scale = layout.scale_of(attn)
    if kv_quant is not None or layout.softcap is not None:
        return flash_attention_reference(q, k, v, scale=scale, kv_quant=kv_quant,
                                         **masking(attn, layout, mask, window, cache))
    sinks = layout.sinks_of(attn)
    if sinks is not None:
        return scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=mask,
                                            sinks=sinks)
    return scaled_dot_product_attention(q, k, v, cache=cache, scale=scale, mask=mask)
