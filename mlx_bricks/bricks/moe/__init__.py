"""The MoE MLP brick: mlx-lm's ``SwitchGLU`` experts on a grouped (ragged) GEMM, MSL and CUDA.

``op`` has the public ops (:func:`moe_mlp`, :func:`moe_mlp_combine`), their checks and the
MLX-ops reference (``SwitchGLU`` itself); ``msl`` the kernel specs, MSL tiles and launch;
``cuda`` the CUDA twins' tiles and launch. docs/moe.md describes the design.
"""
from mlx_bricks.bricks.moe.op import (  # noqa: F401
    ACTIVATIONS,
    as_expert_weight,
    moe_mlp,
    moe_mlp_combine,
    moe_mlp_combine_reference,
    moe_mlp_reference,
)
