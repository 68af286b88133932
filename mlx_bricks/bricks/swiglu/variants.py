"""The SwiGLU brick's variants and the rule that picks one, and its gate activations, without
importing MLX (the CLIs list them in ``--help``). The rule and its reasons are in
``docs/bricks.md`` (Brick 3)."""
from __future__ import annotations

from mlx_bricks import env
from mlx_bricks.options import SWIGLU_VARIANTS as VARIANTS  # noqa: F401  (this brick's name)
#: What ``variant=None`` runs when ``MLX_BRICKS_SWIGLU_VARIANT`` is unset (rule: docs/bricks.md).
DEFAULT_VARIANT = "fused"
#: Environment variable that overrides the default variant (e.g. to benchmark both per chip).
VARIANT_ENV_VAR = "MLX_BRICKS_SWIGLU_VARIANT"

#: The gate activations, by name, and the kernels' ``ACT`` template value for each:
#: ``"silu"`` (SwiGLU: llama, qwen; ``mlx_lm.models.activations.swiglu``) and ``"gelu_tanh"``
#: (GeGLU with GELU's tanh approximation: gemma's ``nn.gelu_approx``).
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}


def activation_code(activation) -> int:
    """The kernels' ``ACT`` template value for ``activation`` (a key of :data:`ACTIVATIONS`).

    Raises:
        TypeError: ``activation`` is not a str.
        ValueError: an unknown activation.
    """
    if not isinstance(activation, str):
        raise TypeError(f"activation must be a str, got {type(activation).__name__}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(map(repr, ACTIVATIONS))}, "
                         f"got {activation!r}")
    return ACTIVATIONS[activation]


def resolve_variant(variant: str | None, name: str = "variant") -> str:
    """The variant that runs: ``variant`` if given, else ``MLX_BRICKS_SWIGLU_VARIANT`` if set,
    else :data:`DEFAULT_VARIANT`. ``name`` is the argument named in the error.

    Raises:
        ValueError: an unknown variant, listing :data:`VARIANTS`; ``env.EnvError`` (a
            ``ValueError``) for an unknown one in the environment.
    """
    if variant is None:
        return env.get(VARIANT_ENV_VAR) or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(
            f"{name} must be None or one of {', '.join(map(repr, VARIANTS))}, got {variant!r}"
        )
    return variant
