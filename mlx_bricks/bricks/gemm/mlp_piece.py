"""The GEMM brick's piece for a gate-less MLP: nemotron_h's ``NemotronHMLP``
(``down_proj(nn.relu2(up_proj(x)))``, mlx-lm 0.32.2), its dense layers and its MoE blocks'
shared experts, as two ``linear`` pieces (each tuned and guarded as every linear) with the
ReLU^2 between them in MLX ops. Which projections run as pieces is the mixers' rule
(``bricks.gemm.piece.stage_names``: not row-sharded, weights the dispatch admits); any other
runs the module's own layer.

It follows the several-pieces form of the mixer protocol (``mlx_bricks.nn.mixer``: ``pieces``
and ``forward``; the module is called ``(x)`` alone), so decode and unknown calls run the
module's own ``__call__``. Only the class whose forward was read (``vetted``) is patched; any
other gate-less MLP stays stock.
"""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.bricks.gemm import piece as linear_piece
from mlx_bricks.bricks.gemm.piece import run_linear
from mlx_bricks.bricks.gemm.kind import LINEAR
from mlx_bricks.checks import FLOAT_DTYPES, dtype_name
from mlx_bricks.formats.layers import linear_reason

#: The projections, in call order.
LINEARS = ("up_proj", "down_proj")


class Relu2MlpPiece:
    """``NemotronHMLP`` as two ``linear`` pieces (module docstring).

    Attributes:
        option: the ``patch_model`` option that enables it (``mlp``).
    """

    name = "ReLU^2 MLP"
    role = "mlp"
    option = "mlp"
    kind = LINEAR
    bricks = (LINEAR.op_name,)
    watched = ()
    call_names = ()
    vetted = ("mlx_lm.models.nemotron_h.NemotronHMLP.__call__=558cc50b0201",)

    def matches(self, module) -> bool:
        from mlx_lm.models.nemotron_h import NemotronHMLP

        return isinstance(module, NemotronHMLP)

    def reason(self, module, layout=None, dtype=None) -> str | None:
        for n in LINEARS:
            why = linear_reason(n, module.get(n), dtype)
            if why is not None:
                return why
        if dtype is not None and dtype not in FLOAT_DTYPES:
            return f"input dtype {dtype_name(dtype)} is not float16/bfloat16/float32"
        return None

    def linears(self, layout=None, module=None) -> tuple[str, ...]:
        return LINEARS

    def call_reason(self, module, inputs, call) -> str | None:
        return None

    def shape_key(self, module, inputs, call) -> tuple:
        return (inputs.shape, inputs.dtype)

    def stage_names(self, module, dtype) -> tuple[str, ...]:
        """The projections that run as ``linear`` pieces (``bricks.gemm.piece.stage_names``;
        ``patch.coverage`` counts them on the GEMM brick)."""
        return linear_piece.stage_names(module, LINEARS, dtype)

    def pieces(self, module, inputs, call) -> dict:
        """The linears of :meth:`stage_names` with their arguments as shapes."""
        from mlx_bricks.runtime.kind import Act

        B, L, _ = inputs.shape
        ins = {"up_proj": Act(tuple(inputs.shape), inputs.dtype),
               "down_proj": Act((B, L, module.up_proj.weight.shape[0]), inputs.dtype)}
        return {n: (LINEAR, linear_piece.linear_args(module[n], ins[n]))
                for n in self.stage_names(module, inputs.dtype)}

    def forward(self, module, inputs, call, run):
        """``down_proj(relu2(up_proj(x)))``, each projection of :meth:`stage_names` brick or
        stock as chosen, any other the module's own layer."""
        staged = self.stage_names(module, inputs.dtype)

        def step(name, x):
            return run_linear(run, module, name, x) if name in staged else module[name](x)

        return step("down_proj", nn.relu2(step("up_proj", inputs)))


RELU2_MLP_PIECE = Relu2MlpPiece()
