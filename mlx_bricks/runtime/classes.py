"""What a piece reads of an mlx-lm module's class: the class itself under a patched instance's
bricks class (``nn.classes``) and its short name, the key of the pieces' tables of known forms.
Beneath the bricks and ``nn`` alike (no imports)."""
from __future__ import annotations


def base_class(module) -> type:
    """``module``'s mlx-lm class (a patched module's class is the bricks class over it)."""
    return getattr(type(module), "_bricks_base", type(module))


def class_key(cls: type) -> str:
    """``"<module>.<qualname>"`` of ``cls`` without the ``mlx_lm.models.`` prefix
    (``"jamba.JambaMambaMixer"``): how the pieces' tables of known forms name a class."""
    return f"{cls.__module__.removeprefix('mlx_lm.models.')}.{cls.__qualname__}"
