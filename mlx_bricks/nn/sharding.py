"""MLX's tensor-parallel linear layers as the bricks see them (``mlx.nn.layers.distributed``).

mlx-lm's ``Model.shard(group)`` (llama, qwen2, qwen3, ... in mlx-lm 0.32) replaces, in every
decoder layer, q/k/v and gate/up with ``AllToShardedLinear`` (column-sharded: this rank keeps
``N / size`` output rows of the weight and bias) and o/down with ``ShardedToAllLinear``
(row-sharded: this rank keeps ``K / size`` input columns, the bias whole), and divides the
attention module's ``n_heads`` / ``n_kv_heads`` by the group size. Their forwards (mlx 0.32):

* ``AllToShardedLinear``: ``sum_gradients(group)(x)`` (the identity in the forward pass; its VJP
  all-sums the input gradient), then ``mx.addmm(b, x, W.T)`` or ``x @ W.T``: on the local shard
  exactly what ``nn.Linear`` computes. The bricks are forward-only (no VJP), so a brick on the
  local shard computes the same values; the stock path calls the layer itself.
* ``ShardedToAllLinear``: ``y = x @ W.T`` on the local shard, ``y = mx.distributed.all_sum(y,
  group)``, then ``y + b``. The bricks keep that order: the brick computes the local partial
  product only (no bias, no residual in its epilogue), then the same ``all_sum`` with the
  layer's group, then the bias, then the block's residual, once, after the reduction (adding
  it in every rank's epilogue would add it ``size`` times).

The quantized variants (``QuantizedAllToShardedLinear``, ``QuantizedShardedToAllLinear``) have
the same structure around ``mx.quantized_matmul``; the bricks take their local shard as a
``QuantizedWeight``, as for ``nn.QuantizedLinear`` (same format rules).
"""
from __future__ import annotations

import mlx.core as mx
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

#: Column-sharded layers (output rows split across the group; identity forward on the input).
COLUMN_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)
#: Row-sharded layers (input columns split; the partial products are all-summed).
ROW_SHARDED = (ShardedToAllLinear, QuantizedShardedToAllLinear)
#: The float sharded layers (the quantized ones are read like ``nn.QuantizedLinear``).
FLOAT_SHARDED = (AllToShardedLinear, ShardedToAllLinear)
QUANTIZED_SHARDED = (QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)


def is_float_sharded(module) -> bool:
    """True for a float ``AllToShardedLinear`` / ``ShardedToAllLinear`` (exact type)."""
    return type(module) in FLOAT_SHARDED


def is_row_sharded(module) -> bool:
    """True for a ``ShardedToAllLinear`` or ``QuantizedShardedToAllLinear`` (exact type): its
    local product is a partial sum that the layer all-sums before adding its bias."""
    return type(module) in ROW_SHARDED


def role_reason(names_in: tuple[str, ...], names_out: tuple[str, ...], module) -> str | None:
    """Why the sharding of ``module``'s linears does not fit their place (None: it does).

    Input projections (``names_in``: q/k/v, gate/up) must be plain or column-sharded; output
    projections (``names_out``: o, down) plain or row-sharded, as mlx-lm's ``shard()`` makes
    them. Another arrangement is not mlx-lm's layout: the bricks leave it to stock.
    """
    roles = ((names_in, ROW_SHARDED, "row", "an input", "column", "AllToShardedLinear"),
             (names_out, COLUMN_SHARDED, "column", "an output", "row", "ShardedToAllLinear"))
    for names, wrong, got, role, want, want_class in roles:
        for n in names:
            layer = module.get(n) if hasattr(module, "get") else None
            if type(layer) in wrong:
                return (f"{n} is {type(layer).__name__} ({got}-sharded): {role} projection "
                        f"must be nn.Linear or {want}-sharded ({want_class}), as mlx-lm's "
                        "shard() makes it")
    return None


def reduce_partial(linear, y, residual=None):
    """Finish a row-sharded layer's output from this rank's partial product ``y``, as the
    stock layer does: ``all_sum(y, group=linear.group)``, then ``+ bias`` (if the layer has
    one), then ``residual + ...`` (the block's residual, added once, after the reduction).

    Args:
        linear: the ``ShardedToAllLinear`` / ``QuantizedShardedToAllLinear`` layer.
        y: ``(..., N)`` the local partial product ``x_local @ W_local.T``.
        residual: None or an array broadcastable to ``y`` (the block's ``x`` or ``h``).

    Returns:
        ``(..., N)``, the same on every rank of the group.
    """
    y = mx.distributed.all_sum(y, group=linear.group)
    if "bias" in linear:
        y = y + linear["bias"]
    return y if residual is None else residual + y
