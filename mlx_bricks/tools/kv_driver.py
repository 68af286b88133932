"""Run an unpatched mlx-lm model with :class:`mlx_bricks.cache.Q8KVCache` layers.

mlx-lm's attention modules call the module-level name ``scaled_dot_product_attention`` of their
model file (``mlx_lm/models/llama.py`` etc., imported from ``models/base.py``), and the stock
function cannot read Q8_0 ``(qs, d)`` tuples. :func:`q8_0_attention` replaces that name in the
model's module, for the duration of a ``with`` block, by a function that sends layers whose cache
is a ``Q8KVCache`` to :func:`mlx_bricks.cache.q8_0_cache_attention` and every other call to the
original. It is a measurement and test driver, not the product path: the patch
(``kv_cache="q8_0"``) wires the same function into the patched attention instead.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

from mlx_bricks.cache import Q8KVCache, q8_0_cache_attention


@contextmanager
def q8_0_attention(model, *, backend: str | None = None):
    """Within the block, ``model``'s layers with a ``Q8KVCache`` attend through the bricks.

    Args:
        model: an mlx-lm model whose module defines ``scaled_dot_product_attention`` (llama,
            mistral, qwen2, qwen3, ... : the files that import it from ``models/base.py``).
        backend: bricks backend of the attention (None: auto).

    Raises:
        ValueError: the model's module has no ``scaled_dot_product_attention``.
    """
    module = sys.modules[type(model).__module__]
    original = getattr(module, "scaled_dot_product_attention", None)
    if original is None:
        raise ValueError(f"{module.__name__} has no scaled_dot_product_attention to route")

    def routed(queries, keys, values, cache, scale, mask, sinks=None):
        if isinstance(cache, Q8KVCache):
            if sinks is not None:
                raise ValueError("attention sinks are not supported with a Q8_0 KV cache")
            return q8_0_cache_attention(queries, keys, values, scale=scale, mask=mask,
                                        backend=backend)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    module.scaled_dot_product_attention = routed
    try:
        yield
    finally:
        module.scaled_dot_product_attention = original
