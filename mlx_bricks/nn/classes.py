"""Per-instance class switching: a patched module keeps its parameters, parameter names and
every other attribute, and ``isinstance`` against its original class still holds, while its
class becomes ``(mixin, original)`` on that instance only (other instances are untouched).
This is the MLX counterpart of Liger-Kernel's per-instance method binding: MLX looks
``__call__`` up on the type, so binding a method on the instance would not take effect."""
from __future__ import annotations

import mlx.nn as nn

from mlx_bricks.nn.attention import BricksAttention
from mlx_bricks.nn.block import BricksBlock
from mlx_bricks.nn.mixer import BricksMixer
from mlx_bricks.nn.piece import BricksPiece
from mlx_bricks.nn.runner import BricksState
from mlx_bricks.nn.shared_kv import BricksSharedKVAttention

#: The mixins a patched module's class is built from.
MIXINS = (BricksAttention, BricksPiece, BricksBlock, BricksMixer, BricksSharedKVAttention)

_CLASSES: dict[tuple[type, type], type] = {}


def bricks_class(mixin: type, base: type) -> type:
    """The class ``(mixin, base)`` an instance of ``base`` is switched to (built once per pair).

    Raises:
        TypeError: ``mixin`` is not one of ``MIXINS`` or ``base`` is not an ``nn.Module`` class.
    """
    if mixin not in MIXINS:
        raise TypeError(f"mixin must be one of {[m.__name__ for m in MIXINS]}, got {mixin!r}")
    if not (isinstance(base, type) and issubclass(base, nn.Module)):
        raise TypeError(f"base must be an nn.Module subclass, got {base!r}")
    if issubclass(base, MIXINS):
        raise TypeError(f"base {base.__name__} is already a bricks class")
    key = (mixin, base)
    if key not in _CLASSES:
        short = base.__module__.rsplit(".", 1)[-1]
        _CLASSES[key] = type(f"{mixin.__name__}_{short}_{base.__name__}", (mixin, base),
                             {"_bricks_base": base, "__module__": __name__})
    return _CLASSES[key]


def is_patched(module) -> bool:
    """True if ``module``'s class was switched to a bricks class."""
    return isinstance(module, MIXINS)


def attach(module: nn.Module, mixin: type, state: BricksState) -> nn.Module:
    """Switch ``module`` (this instance only) to ``bricks_class(mixin, type(module))``.

    Parameters stay the same arrays under the same names. Returns ``module``.

    Raises:
        TypeError: ``state`` is not a :class:`BricksState`, or see :func:`bricks_class`.
        ValueError: ``module`` is already patched (call :func:`detach` first).
    """
    if not isinstance(state, BricksState):
        raise TypeError(f"state must be a BricksState, got {type(state).__name__}")
    if is_patched(module):
        raise ValueError(f"module {type(module).__name__} is already patched; detach it first")
    cls = bricks_class(mixin, type(module))
    module.__class__ = cls
    # object.__setattr__: keep the state out of the parameter tree (nn.Module is a dict).
    object.__setattr__(module, "_bricks_state", state)
    return module


def detach(module: nn.Module) -> bool:
    """Give ``module`` back its original class; returns False if it was not patched."""
    if not is_patched(module):
        return False
    module.__class__ = type(module)._bricks_base
    module.__dict__.pop("_bricks_state", None)
    return True
