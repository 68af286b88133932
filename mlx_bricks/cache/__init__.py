"""A Q8_0 KV cache that follows mlx-lm's cache protocol, and attention over it.

:class:`Q8KVCache` stores K and V as ggml's Q8_0 blocks along head_dim (int8 quants ``qs`` and a
float16 scale ``d`` per 32 values: 34 bytes per 32 values, exactly 34/64 of a float16 cache).
New K/V are quantized once, on append (``mlx_bricks.ops.quantize_q8_0``, ggml's rounding), into
buffers that grow in ``step``-sized chunks as mlx-lm's ``KVCache`` does; ``update_and_fetch``
returns the Q8_0 views ``(qs, d)`` of K and V up to ``offset``, which the attention bricks read
directly (:func:`q8_0_cache_attention`: decode brick for a few query tokens, the prefill brick's
Q8_0 path otherwise). Nothing full precision is kept.

mlx-lm protocol (0.32, ``mlx_lm/models/cache.py``): ``update_and_fetch``, ``offset``,
``state`` (arrays and the offset; mlx-lm 0.32 has no ``meta_state``: scalars ride in ``state``
and ``save_prompt_cache`` serialises them), ``from_state`` (inherited), ``is_trimmable`` /
``trim`` (so ``trim_prompt_cache`` and speculative decoding work), ``make_mask`` (what
``create_attention_mask`` asks the first layer's cache), ``size``, ``empty``, ``nbytes``.
It has no ``to_quantized`` (mlx-lm's ``--kv-bits`` conversion leaves it alone) and no ``bits``
attribute (mlx-lm's attention would take it for its own affine cache). Batching (``mlx_lm.server``,
``batch_generate``): ``Q8KVCache.merge`` gives a :class:`BatchQ8KVCache`, mlx-lm's
``BatchKVCache`` protocol over Q8_0 blocks (``prepare`` / ``finalize`` / ``make_mask`` /
``filter`` / ``extend`` / ``extract`` / ``trim``); its attention takes the array mask, so it
runs on K/V dequantized for the call (``q8_0_cache_attention``).

Loading: ``mlx_lm.models.cache.load_prompt_cache`` rebuilds each cache from its class *name*
looked up in its own module's globals. :func:`register_with_mlx_lm` adds ``Q8KVCache`` there
(explicitly; nothing happens at import), and :func:`load_prompt_cache` is mlx-lm's loader with
that registration done first. ``save_prompt_cache`` needs nothing.

Attention over this cache needs the bricks: mlx-lm's stock attention cannot read ``(qs, d)``
tuples. :func:`q8_0_cache_attention` is the drop-in for mlx-lm's ``scaled_dot_product_attention``
on such a layer, and :func:`route_attention` makes a model's stock attention call it for every
layer whose cache is a ``Q8KVCache`` (what the patch's ``kv_cache="q8_0"`` needs for the calls
it leaves stock, decode included).

Modules: ``q8.py`` (the two cache classes, loading), ``model.py`` (a model's cache plan and the
attention over the cache).
"""
from __future__ import annotations

from mlx_bricks.cache.model import (
    _ROUTES,
    LayerCache,
    make_prompt_cache,
    plan_prompt_cache,
    q8_0_cache_attention,
    route_attention,
)
from mlx_bricks.cache.q8 import (
    Q8_CACHES,
    BatchQ8KVCache,
    Q8KVCache,
    load_prompt_cache,
    register_with_mlx_lm,
)

__all__ = ["BatchQ8KVCache", "LayerCache", "Q8KVCache", "Q8_CACHES", "load_prompt_cache",
           "make_prompt_cache", "plan_prompt_cache", "q8_0_cache_attention",
           "register_with_mlx_lm", "route_attention"]
