"""The SwiGLU brick's piece for MLPs whose gate and up projections are one fused linear layer
(``(2N, D)``: the gate's rows, then the up's), patched by module whatever the model_type:
granitemoehybrid's ``GraniteMoeHybridSharedMLP`` (``input_linear``, ``output_linear``: Granite
4.0-H's shared expert) and plamo2's ``MLP`` (``gate_up_proj``, ``down_proj``), mlx-lm 0.32.2.

The piece hands the ``swiglu_mlp`` kind the fused weight's two row halves (views of the same
arrays, any weight format: a float array, an affine ``QuantizedWeight`` or a
``MicroscaledWeight`` sliced field by field), so it runs as a plain gate / up / down MLP.
"""
from __future__ import annotations

import dataclasses

import mlx.nn as nn

from mlx_bricks.bricks.swiglu.kind import SWIGLU_MLP
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.formats.layers import linear_reason, weight_of
from mlx_bricks.runtime.classes import base_class, class_key

#: ``"<module>.<Class>"`` -> (fused gate|up layer, down layer) of the MLPs this piece follows.
FORMS = {"granitemoehybrid.GraniteMoeHybridSharedMLP": ("input_linear", "output_linear"),
         "plamo2.MLP": ("gate_up_proj", "down_proj")}
#: Their vetted forwards (``patch.vetted`` fingerprints, mlx-lm 0.32.2): ``swiglu`` of the
#: fused output's two halves (gate first), then the down projection; no bias.
VETTED = ("mlx_lm.models.granitemoehybrid.GraniteMoeHybridSharedMLP.__call__=d647cf2c3709",
          "mlx_lm.models.plamo2.MLP.__call__=769fdf161f9a")


def form_name(module) -> str | None:
    """The :data:`FORMS` key of ``module``'s class or of a class it derives from, or None."""
    return next((class_key(c) for c in base_class(module).__mro__ if class_key(c) in FORMS),
                None)


def rows(weight, start: int, stop: int):
    """Rows ``start:stop`` (output features) of a linear layer's weight in any format."""
    if dataclasses.is_dataclass(weight):
        fields = {f: getattr(weight, f)[start:stop] for f in ("w", "scales", "biases")
                  if getattr(weight, f, None) is not None and
                  f in {x.name for x in dataclasses.fields(weight)}}
        return dataclasses.replace(weight, **fields)
    return weight[start:stop]


class FusedMLPPiece:
    """An MLP with a fused gate|up layer as one ``swiglu_mlp`` piece (what
    ``mlx_bricks.nn.piece.BricksPiece`` runs)."""

    role = "mlp"
    kind = SWIGLU_MLP
    bricks = (SWIGLU_MLP.op_name,)
    vetted = VETTED

    def matches(self, module) -> bool:
        """Whether ``module`` is of one of :data:`FORMS`' classes (a subclass included: its
        forward is then not a vetted one, and it is reported stock)."""
        return form_name(module) is not None

    def linears(self, layout=None) -> tuple[str, ...]:
        return tuple(n for pair in FORMS.values() for n in pair)

    def call_reason(self, args, kwargs) -> str | None:
        if args or kwargs:
            return f"extra call arguments ({len(args)} positional, {sorted(kwargs)}): stock"
        return None

    def reason(self, module, layout=None, dtype=None) -> str | None:
        """Why ``module`` cannot run the piece for ``dtype`` (None: it can)."""
        names = FORMS.get(form_name(module) or "")
        if names is None:
            return f"{type(module).__name__} is not a fused gate|up MLP this piece follows"
        for n in names:
            layer = module.get(n)
            r = linear_reason(n, layer, dtype)
            if r is not None:
                return r
            if "bias" in layer:
                return f"{n} has a bias (the fused MLPs this piece follows have none)"
        fused, down = (module.get(n) for n in names)
        if fused.weight.shape[0] % 2 or fused.weight.shape[0] // 2 != _inputs(down):
            return (f"{names[0]} has {fused.weight.shape[0]} rows, not twice {names[1]}'s "
                    f"{_inputs(down)} inputs")
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
        return None

    def args(self, module, layout, x) -> dict:
        fused, down = (module.get(n) for n in FORMS[form_name(module)])
        w = weight_of(fused)
        n = fused.weight.shape[0] // 2
        return {"x": x, "w_gate": rows(w, 0, n), "w_up": rows(w, n, 2 * n),
                "w_down": weight_of(down), "b_gate": None, "b_up": None, "b_down": None,
                "residual": None}

    def stock(self, module, layout, x, call):
        return call(x)

    def finish(self, module, layout, y):
        return y


def _inputs(linear) -> int:
    """A linear layer's input features (a quantized layer's packed columns unpacked)."""
    cols = linear.weight.shape[1]
    bits = getattr(linear, "bits", None)
    return cols * 32 // bits if isinstance(linear, nn.QuantizedLinear) and bits else cols


FUSED_MLP_PIECE = FusedMLPPiece()
