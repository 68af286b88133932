"""Run an unpatched mlx-lm model with :class:`mlx_bricks.cache.Q8KVCache` layers.

A context manager over :func:`mlx_bricks.cache.route_attention`: inside the block the model's
stock attention sends layers whose cache is a ``Q8KVCache`` to
:func:`mlx_bricks.cache.q8_0_cache_attention` (on each cache's ``backend``), every other call
to mlx-lm's own function. A measurement and test driver for a model left otherwise stock; the
patch (``kv_cache="q8_0"``) takes the same route for as long as the model is patched.
"""
from __future__ import annotations

from contextlib import contextmanager

from mlx_bricks.cache import route_attention


@contextmanager
def q8_0_attention(model):
    """Within the block, ``model``'s layers with a ``Q8KVCache`` attend through the bricks.

    Raises:
        ValueError: the model's module has no ``scaled_dot_product_attention``.
    """
    undo = route_attention(model)
    try:
        yield
    finally:
        undo()
