"""The short-conv brick's piece in a patched mlx-lm model: LFM2's ``ShortConv`` mixer (lfm2,
lfm2_moe; mlx-lm 0.32.2) whose prefill runs its own in-projection, then the brick
(:data:`~mlx_bricks.bricks.short_conv.kind.SHORT_CONV`: ``B * x``, the mask, the depthwise
convolution from the cache's conv state, ``C * y``) instead of its split-concatenate-conv ops,
then its own out-projection; the conv state and the offset are written as the module writes
them.

Only the vetted forwards are patched (``vetted``); another module of a class named
``ShortConv`` stays stock with the reason.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_bricks.bricks.short_conv.kind import SHORT_CONV
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.runtime.scan import arrays_cache_reason, mask_reason
from mlx_bricks.runtime.classes import base_class

#: The mixer's name in reports.
MIXER = "short conv"


def depthwise_reason(conv, channels: int, K: int, name: str = "conv") -> str | None:
    """Why ``conv`` is not a depthwise causal ``nn.Conv1d`` of ``channels`` and ``K`` taps (no
    padding, stride or dilation), as the mixers build it (None: it is)."""
    if not isinstance(conv, nn.Conv1d):
        return f"{name} is not an nn.Conv1d"
    w = conv.get("weight")
    if not isinstance(w, mx.array) or tuple(w.shape) != (channels, K, 1):
        return f"{name}.weight is not ({channels}, {K}, 1) (depthwise, {K} taps)"
    if (getattr(conv, "groups", None), conv.padding, conv.stride, conv.dilation) != \
            (channels, 0, 1, 1):
        return f"{name} is not depthwise without padding, stride or dilation"
    return None


def conv_bias_reason(conv, dtype, name: str = "conv") -> str | None:
    """Why ``conv``'s bias cannot join inputs of ``dtype`` in the brick (None: it can): the op
    takes a bias of the input's dtype, where mlx-lm's conv promotes (a checkpoint of mixed
    dtypes: a float32 mixer output makes the next layer's input float32)."""
    bias = conv.get("bias") if isinstance(conv, nn.Module) else None
    if dtype is None or bias is None or bias.dtype == dtype:
        return None
    return (f"{name}.bias is {dtype_name(bias.dtype)} but the input is {dtype_name(dtype)}: "
            "mlx-lm promotes, the brick takes one dtype")


def short_conv_reason(module, dtype=None) -> str | None:
    """Why ``module`` cannot run the short-conv piece (None: it can)."""
    for name in ("in_proj", "out_proj"):
        if not isinstance(module.get(name), nn.Module):
            return f"{name} is missing"
    K = getattr(module, "L_cache", None)
    C = getattr(getattr(module, "args", None), "hidden_size", None)
    if not isinstance(K, int) or not isinstance(C, int):
        return "L_cache or args.hidden_size is not an int"
    r = depthwise_reason(module.get("conv"), C, K) or conv_bias_reason(module.get("conv"), dtype)
    if r is not None:
        return r
    if dtype is not None and dtype not in FLOAT_DTYPES:
        return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
    return None


class ShortConvPiece:
    """LFM2's ``ShortConv`` as one piece (``mlx_bricks.nn.mixer.BricksMixer``'s protocol)."""

    name = MIXER
    role = "conv"
    kind = SHORT_CONV
    bricks = (SHORT_CONV.op_name,)
    watched = ("conv",)
    call_names = ("mask", "cache")
    input_name = "x"
    #: The forwards this piece follows (``patch.vetted`` fingerprints, mlx-lm 0.32.2).
    vetted = ("mlx_lm.models.lfm2.ShortConv.__call__=bfe649d9def5",
              "mlx_lm.models.lfm2_moe.ShortConv.__call__=bfe649d9def5")

    def matches(self, module) -> bool:
        """Whether ``module`` is a short-conv mixer (a class named ``ShortConv``)."""
        return base_class(module).__name__ == "ShortConv"

    def call_reason(self, module, inputs, call) -> str | None:
        """Why this call's mask or cache is not one the piece follows (None: it is)."""
        return mask_reason(call["mask"], inputs) or arrays_cache_reason(call["cache"], 1, "conv")

    def shape_key(self, module, inputs, call) -> tuple:
        cache = call["cache"]
        return (inputs.shape, inputs.dtype, call["mask"] is not None, cache is None,
                cache is not None and cache[0] is not None)

    def stage_names(self, module, dtype) -> tuple[str, ...]:
        """The projections that run as ``linear`` stages: ``in_proj`` and ``out_proj`` where
        ``bricks.gemm.piece.stage_names`` takes them."""
        from mlx_bricks.bricks.gemm.piece import stage_names

        return stage_names(module, ("in_proj", "out_proj"), dtype)

    def stages(self, module, inputs, call) -> dict:
        """The ``linear`` stages of :meth:`stage_names` around the conv (``out_proj`` reads the
        (b, T, C) gated conv output)."""
        from mlx_bricks.bricks.gemm import piece as linear_piece
        from mlx_bricks.runtime.kind import Act

        x = Act(tuple(inputs.shape), inputs.dtype)
        return {n: (linear_piece.KIND, linear_piece.linear_args(module[n], x))
                for n in self.stage_names(module, inputs.dtype)}

    def prologue(self, module, inputs, call, run):
        """The module's in-projection (a ``linear`` stage or its own layer) and split into B,
        C, x; the kind's arguments."""
        from mlx_bricks.bricks.gemm.piece import projector

        proj = projector(self.stage_names(module, inputs.dtype), run)
        cache = call["cache"]
        Bg, Cg, x = mx.split(proj(module, "in_proj", inputs), 3, axis=-1)
        conv = module.conv
        return {"x": x, "weight": conv.weight, "bias": conv.get("bias"),
                "state": None if cache is None else cache[0], "mask": call["mask"],
                "gate_in": Bg, "gate_out": Cg, "activation": None,
                "lengths": None if cache is None else cache.lengths}, proj

    def epilogue(self, module, out, ctx, inputs, call):
        """The conv state and offset into the cache, the out-projection (through the
        prologue's ``proj``)."""
        y, state = out
        cache = call["cache"]
        if cache is not None:
            cache[0] = state
            cache.advance(inputs.shape[1])
        return ctx(module, "out_proj", y)

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        return ("in_proj", "out_proj")

    def reason(self, module, layout=None, dtype=None) -> str | None:
        return short_conv_reason(module, dtype)

    def placeholders(self, module, inputs, call) -> dict:
        """The kind's arguments as shapes (``runtime.kind.Act``) for the dispatcher's key."""
        from mlx_bricks.runtime.kind import Act

        mask, cache = call["mask"], call["cache"]
        b, T, C = inputs.shape
        dt = inputs.dtype
        act = Act((b, T, C), dt)
        state = None if cache is None else cache[0]
        conv = module.conv
        return {"x": act, "weight": conv.weight, "bias": conv.get("bias"),
                "state": None if state is None else Act(tuple(state.shape), state.dtype),
                "mask": None if mask is None else Act((b, T), mx.bool_),
                "gate_in": act, "gate_out": act, "activation": None}


SHORT_CONV_PIECE = ShortConvPiece()
