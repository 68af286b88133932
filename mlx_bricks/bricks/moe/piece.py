"""The MoE brick's piece in a patched mlx-lm model: a ``SwitchGLU`` module
(``mlx_lm/models/switch_layers.py``: ``gate_proj``, ``up_proj``, ``down_proj`` ``SwitchLinear`` /
``QuantizedSwitchLinear`` layers and an ``activation`` module) as one MoE piece (the kind
:data:`~mlx_bricks.bricks.moe.kind.MOE_MLP`), with its arguments, its stock path and its
structure check.

:data:`MOE_PIECE` is what the generic single-piece module (``mlx_bricks.nn.piece.BricksPiece``)
runs for a ``SwitchGLU``, whatever model holds it: the call ``SwitchGLU(x, indices)`` (the
model's router chose ``indices``; its combine with the scores stays the model's). Activations:
``SwiGLU`` (``"silu"``), gpt-oss's ``SwigluOAI`` (``"swiglu_oai"`` with its alpha and limit),
gemma4's ``GeGLU`` (``"gelu_tanh"``), kimi_k3's ``SiTU`` (``"situ"``); any other stays stock
with the reason. :data:`SWITCH_MLP_PIECE` runs a gate-less ``SwitchMLP`` (``fc1``, activation,
``fc2``; nemotron_h's experts, ``nn.ReLU2``: ``"relu2"``) on the same kind, ``w_gate`` None.
"""
from __future__ import annotations

import mlx.core as mx

from mlx_bricks.bricks.moe.kind import MOE_MLP
from mlx_bricks.bricks.moe.op import expert_shape, stacked_weight
from mlx_bricks.checks import dtype_name
from mlx_bricks.formats.affine import MODE
from mlx_bricks.formats.microscaling import is_microscaled_mode
from mlx_bricks.formats.layers import bias_of

#: The projections of ``SwitchGLU`` (fixed names, whatever the architecture).
LINEARS = ("gate_proj", "up_proj", "down_proj")
#: The projections of ``SwitchMLP`` (up, down: no gate).
MLP_LINEARS = ("fc1", "fc2")


def switch_classes() -> tuple[type, type, type, type]:
    """mlx-lm's ``(SwitchGLU, SwitchMLP, SwitchLinear, QuantizedSwitchLinear)``."""
    from mlx_lm.models.switch_layers import (
        QuantizedSwitchLinear,
        SwitchGLU,
        SwitchLinear,
        SwitchMLP,
    )

    return SwitchGLU, SwitchMLP, SwitchLinear, QuantizedSwitchLinear


def activation_of(module) -> tuple[str | None, dict, str | None]:
    """``(activation name, its kwargs, reason)`` of a ``SwitchGLU``'s ``activation`` module:
    ``SwiGLU`` -> ``"silu"``, ``SwigluOAI`` -> ``"swiglu_oai"`` (``alpha``, ``limit``), gemma4's
    ``GeGLU`` -> ``"gelu_tanh"``, kimi_k3's ``SiTU`` -> ``"situ"`` (``beta``, ``linear_beta``);
    anything else ``(None, {}, reason)``."""
    from mlx_lm.models.activations import SwigluOAI
    from mlx_lm.models.switch_layers import SwiGLU, SwitchMLP

    act = getattr(module, "activation", None)
    if isinstance(module, SwitchMLP):  # gate-less experts
        import mlx.nn as nn

        if type(act) is nn.ReLU2:
            return "relu2", {}, None
        return None, {}, (f"SwitchMLP activation {type(act).__name__} is not one the MoE brick "
                          "computes (ReLU2)")
    if type(act) is SwiGLU:
        return "silu", {}, None
    if type(act) is SwigluOAI:
        return "swiglu_oai", {"alpha": float(act._alpha), "limit": float(act._limit)}, None
    if type(act).__name__ == "GeGLU" and type(act).__module__.startswith("mlx_lm.models."):
        return "gelu_tanh", {}, None
    if type(act).__name__ == "SiTU" and type(act).__module__ == "mlx_lm.models.kimi_k3":
        beta, lb = act.beta, act.linear_beta
        if not (beta > 0 and (lb is None or lb > 0)):
            return None, {}, (f"SiTU with beta={beta!r}, linear_beta={lb!r}: the MoE brick "
                              "takes them > 0")
        return "situ", {"beta": float(beta),
                        "linear_beta": None if lb is None else float(lb)}, None
    return None, {}, (f"activation {type(act).__name__} is not one the MoE brick computes "
                      "(SwiGLU, SwigluOAI, GeGLU, SiTU)")


def expert_format_name(layer) -> str:
    """A switch layer's weight format in words: ``"q4 gs64"`` (``"mxfp4 gs32"`` for another
    mode), the dtype name for a ``SwitchLinear``, else the class name (``"missing"``)."""
    _, _, linear, quantized = switch_classes()
    if isinstance(layer, quantized):
        mode = getattr(layer, "mode", MODE)
        return f"{f'q{layer.bits}' if mode == MODE else mode} gs{layer.group_size}"
    if isinstance(layer, linear):
        return dtype_name(layer.weight.dtype)
    return "missing" if layer is None else type(layer).__name__


def expert_reason(name: str, layer, dtype=None) -> str | None:
    """Why the switch layer ``name`` cannot feed the MoE brick for inputs of ``dtype`` (None:
    it can): a plain ``SwitchLinear``, or a ``QuantizedSwitchLinear`` in MLX's affine format
    without a global scale or in a microscaling mode (``mxfp4``, ``nvfp4`` with or without its
    global scale, ``mxfp8``: the kind's ``dequant`` composite only, no kernel), its float
    arrays of the input's dtype."""
    _, _, linear, quantized = switch_classes()
    if layer is None:
        return f"{name} is missing"
    if type(layer) is quantized:
        mode = getattr(layer, "mode", MODE)
        if is_microscaled_mode(mode):
            arrays = ("bias",)  # the scales are uint8 codes
        elif mode != MODE or getattr(layer, "global_scale", None) is not None:
            return (f"{name} is QuantizedSwitchLinear ({expert_format_name(layer)}): the MoE "
                    "brick reads MLX affine and microscaled (mxfp4 / nvfp4 / mxfp8) weights")
        else:
            arrays = ("scales", "biases", "bias")
    elif type(layer) is linear:
        arrays = ("weight", "bias")
    else:
        return f"{name} is {type(layer).__name__}, not SwitchLinear or QuantizedSwitchLinear"
    try:
        stacked_weight(layer, name)
    except (TypeError, ValueError) as e:
        return f"{name}: {e}"
    if dtype is not None:
        for what in arrays:
            if what in layer and layer[what].dtype != dtype:
                return (f"{name}.{what} is {dtype_name(layer[what].dtype)} but the input is "
                        f"{dtype_name(dtype)}")
    return None


def moe_reason(module, dtype=None) -> str | None:
    """Why ``module`` cannot run the MoE brick for inputs of ``dtype`` (None: it can): not a
    ``SwitchGLU``, an activation the brick lacks, a projection it cannot read, expert shapes
    that do not chain (gate / up ``(E, N, D)``, down ``(E, D, N)``)."""
    glu, switch_mlp, _, _ = switch_classes()
    if not isinstance(module, (glu, switch_mlp)):
        return f"{type(module).__name__} is not a SwitchGLU or SwitchMLP"
    names = MLP_LINEARS if isinstance(module, switch_mlp) else LINEARS
    reason = activation_of(module)[2]
    if reason is not None:
        return reason
    for n in names:
        reason = expert_reason(n, getattr(module, n, None), dtype)
        if reason is not None:
            return reason
    E, N, D = expert_shape(stacked_weight(getattr(module, names[0])))
    want = {"gate_proj": (E, N, D), "up_proj": (E, N, D), "down_proj": (E, D, N),
            "fc2": (E, D, N)}
    for n in names[1:]:
        got = expert_shape(stacked_weight(getattr(module, n)))
        if got != want[n]:
            return f"{n} has expert shape {got}, expected {want[n]} ({names[0]}'s {(E, N, D)})"
    return None


def moe_args(module, x, indices) -> dict:
    """The MoE piece's arguments from a ``SwitchGLU`` or ``SwitchMLP`` module (structure already
    checked; a ``SwitchMLP``: ``w_gate`` and ``b_gate`` None, fc1 as up, fc2 as down)."""
    act, act_kwargs, _ = activation_of(module)
    args = {"x": x, "indices": indices}
    names = LINEARS
    if isinstance(module, switch_classes()[1]):
        args["w_gate"] = args["b_gate"] = None
        names = (None, *MLP_LINEARS)
    for w, b, n in zip(("w_gate", "w_up", "w_down"), ("b_gate", "b_up", "b_down"), names):
        if n is None:
            continue
        layer = getattr(module, n)
        args[w], args[b] = stacked_weight(layer, n), bias_of(layer)
    if act != "silu":  # SwiGLU experts keep their arguments (and tuning keys)
        args["activation"] = act
        args.update(act_kwargs)
    return args


class MoEPiece:
    """An mlx-lm ``SwitchGLU`` module as one piece (what ``mlx_bricks.nn.piece.BricksPiece``
    runs): the call ``(x, indices)``.

    Attributes:
        role: the module's role in reports (``"moe"``).
        kind: the op kind (:data:`~mlx_bricks.bricks.moe.kind.MOE_MLP`).
        bricks: the brick ops the module runs in prefill (for the report).
        watched: children besides the switch layers the structure check depends on
            (``nn.structure.structure_reason`` re-checks when one is replaced).
    """

    role = "moe"
    kind = MOE_MLP
    bricks = (MOE_MLP.op_name,)
    #: Children besides the switch layers whose replacement the structure check notices.
    watched = ("activation",)

    def __init__(self, names: tuple[str, ...] = LINEARS):
        self.names = names

    def linears(self, layout=None) -> tuple[str, ...]:
        """The switch layers the piece reads (structure fingerprint, weight formats)."""
        return self.names

    def call_reason(self, args, kwargs) -> str | None:
        """Why a call with these extra arguments (besides ``x``) is not ``SwitchGLU``'s
        ``(x, indices)``: one integer array with x's leading dims and a last axis k."""
        if kwargs or len(args) != 1:
            return (f"call arguments other than (x, indices) ({len(args)} positional, "
                    f"{sorted(kwargs)}): stock")
        idx = args[0]
        if not isinstance(idx, mx.array) or not mx.issubdtype(idx.dtype, mx.integer) \
                or idx.ndim < 1:
            return "indices is not an integer array: stock"
        return None

    def reason(self, module, layout=None, dtype=None) -> str | None:
        return moe_reason(module, dtype)

    def args(self, module, layout, x, indices) -> dict:
        return moe_args(module, x, indices)

    def stock(self, module, layout, x, indices, call):
        """The module's own ``SwitchGLU.__call__(x, indices)`` (``call``)."""
        return call(x, indices)

    def finish(self, module, layout, y):
        return y

    def weight_formats(self, module) -> dict[str, str]:
        """``{projection: format in words}`` of the switch layers (:func:`expert_format_name`)."""
        return {n: expert_format_name(getattr(module, n, None)) for n in self.names}


MOE_PIECE = MoEPiece()
#: A gate-less ``SwitchMLP`` (fc1, activation, fc2) on the MoE kind (``w_gate`` None).
SWITCH_MLP_PIECE = MoEPiece(MLP_LINEARS)
