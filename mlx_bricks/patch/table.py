"""What each supported mlx-lm architecture's decoder block looks like.

One entry per ``model_type`` (mlx-lm's ``config.json`` field); the patch routine is the same for
all of them. Biases are found on the modules themselves (qwen2 has q/k/v biases, llama has them
with ``attention_bias``/``mlp_bias``), so they need no entry here.
"""
from __future__ import annotations

from mlx_bricks.nn.modules import BlockLayout

ARCHITECTURES: dict[str, BlockLayout] = {
    "llama": BlockLayout(source="mlx_lm/models/llama.py"),
    "qwen2": BlockLayout(source="mlx_lm/models/qwen2.py"),
    # qwen3: per-head RMSNorm of q and k (over head_dim) before RoPE.
    "qwen3": BlockLayout(source="mlx_lm/models/qwen3.py", qk_norm=("q_norm", "k_norm")),
}

# model_type -> ARCHITECTURES key, for types mlx-lm builds with another type's model file
# (mlx_lm.utils.MODEL_REMAPPING maps "mistral" to llama.py).
ALIASES: dict[str, str] = {"mistral": "llama"}


def lookup(model_type) -> tuple[str | None, BlockLayout | None]:
    """``(architecture name, layout)`` for ``model_type``, or ``(None, None)`` if unsupported."""
    if not isinstance(model_type, str):
        return None, None
    name = ALIASES.get(model_type, model_type)
    layout = ARCHITECTURES.get(name)
    return (name, layout) if layout is not None else (None, None)


def supported_model_types() -> tuple[str, ...]:
    """mlx-lm ``model_type`` values the patch knows (architectures and their aliases), sorted."""
    return tuple(sorted([*ARCHITECTURES, *ALIASES]))
