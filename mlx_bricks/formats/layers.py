"""MLX's linear layers as the bricks read them: ``nn.Linear``, ``nn.QuantizedLinear`` (MLX
affine) and the tensor-parallel linears of ``mlx.nn.layers.distributed``: the weight in its
format (:func:`weight_of`), the bias, whether a layer can feed a brick
(:func:`linear_reason`), and how a sharded layer's partial product is finished.

Tensor-parallel layers (``mlx.nn.layers.distributed``):

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
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)

from mlx_bricks.checks import dtype_name
from mlx_bricks.formats import format_of
from mlx_bricks.formats.affine import MODE, QuantizedWeight
from mlx_bricks.formats.microscaling import MicroscaledWeight, is_microscaled_mode, layer_reason

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


def weight_of(linear):
    """The weight a brick takes from a linear layer: the array, or a ``QuantizedWeight`` for an
    affine ``nn.QuantizedLinear`` or a quantized tensor-parallel linear (its local shard), a
    ``MicroscaledWeight`` for one in ``mxfp4`` / ``nvfp4`` / ``mxfp8``."""
    if isinstance(linear, nn.QuantizedLinear) or type(linear) in QUANTIZED_SHARDED:
        if is_microscaled_mode(getattr(linear, "mode", MODE)):
            return MicroscaledWeight.from_module(linear)
        return QuantizedWeight.from_module(linear)
    return linear.weight


def bias_of(linear):
    """The layer's bias array, or None."""
    return linear["bias"] if "bias" in linear else None


def partial_product(linear, x):
    """A row-sharded layer's local product as its stock forward computes it (``x @ W.T`` on the
    local shard, before the ``all_sum``; ``mx.quantized_matmul`` for a quantized one)."""
    w = weight_of(linear)
    return format_of(w).matmul_t(x, w)


def format_name(linear) -> str:
    """A linear layer's weight format in words: ``"q4 gs64"`` for an MLX affine
    ``nn.QuantizedLinear`` (``"mxfp4 gs32"`` for another mode), the dtype name
    (``"float16"``) for an ``nn.Linear``, the class name for anything else."""
    if isinstance(linear, nn.QuantizedLinear) or type(linear) in QUANTIZED_SHARDED:
        mode = getattr(linear, "mode", MODE)
        head = f"q{linear.bits}" if mode == MODE else mode
        return f"{head} gs{linear.group_size}"
    if isinstance(linear, nn.Linear) or is_float_sharded(linear):
        return dtype_name(linear.weight.dtype)
    return "missing" if linear is None else type(linear).__name__


def quantized_reason(name: str, module) -> str | None:
    """Why the bricks cannot read the ``nn.QuantizedLinear`` ``module`` (None if they can).

    The bricks read MLX's affine format (``mlx_bricks.formats.affine``): bits 2, 3, 4, 5, 6, 8
    and group_size 32, 64, 128, and the microscaling modes ``mxfp4``, ``nvfp4``, ``mxfp8``
    (``mlx_bricks.formats.microscaling``: through the kinds' composites only, no kernel).
    """
    mode = getattr(module, "mode", MODE)
    cls = "nn.QuantizedLinear" if type(module) is nn.QuantizedLinear else type(module).__name__
    what = f"{name} is {cls} ({format_name(module)})"
    if is_microscaled_mode(mode):
        r = layer_reason(name, module)
        return None if r is None else f"{what}: {r}"
    if mode != MODE:
        return f"{what}: mode {mode!r} is not one the bricks read"
    try:
        QuantizedWeight.from_module(module).check(name)
    except (TypeError, ValueError) as e:
        return f"{what}: {e}"
    return None


def linear_reason(name: str, module, dtype=None) -> str | None:
    """Why ``module`` cannot feed a brick (None if it can).

    It can when it is a plain ``nn.Linear``, or an ``nn.QuantizedLinear`` in MLX's affine
    format or a microscaling mode (:func:`quantized_reason`), whose float arrays have the
    input's ``dtype`` (when given; a microscaled layer's uint8 scales are codes, not floats):
    the bricks compute in one dtype, so a quantized weight's ``scales`` and ``biases`` (the
    dtype its tiles are dequantized to) and a layer's ``bias`` must be the activations' dtype
    (``formats.check_weight``). MLX's tensor-parallel linears (``AllToShardedLinear``,
    ``ShardedToAllLinear`` and their quantized variants) count as their unsharded kinds: the
    bricks run on the local shard. LoRA/DoRA adapters (``mlx_lm.tuner``), also over quantized
    layers, and every other layer type keep the stock path.
    """
    if type(module) is nn.QuantizedLinear or type(module) in QUANTIZED_SHARDED:
        r = quantized_reason(name, module)
        if r is not None:
            return r
        micro = is_microscaled_mode(getattr(module, "mode", MODE))
        arrays = ("bias",) if micro else ("scales", "biases", "bias")
    elif type(module) is nn.Linear or is_float_sharded(module):
        arrays = ("weight", "bias")
    elif module is None:
        return f"{name} is missing"
    elif type(module).__module__.startswith("mlx_lm.tuner"):
        inner = getattr(module, "linear", None)
        over = (f" over nn.QuantizedLinear ({format_name(inner)})"
                if isinstance(inner, nn.QuantizedLinear) else "")
        return (f"{name} is {type(module).__name__}{over} (LoRA/DoRA adapter): the bricks do not "
                "apply adapters")
    else:
        return f"{name} is {type(module).__name__}, not nn.Linear or nn.QuantizedLinear"
    if dtype is not None:
        for what in arrays:
            if what in module and module[what].dtype != dtype:
                return (f"{name}.{what} is {dtype_name(module[what].dtype)} but the input is "
                        f"{dtype_name(dtype)}")
    return None
