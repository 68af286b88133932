"""Drop-in patch of mlx-lm models: ``patch_model(model)`` runs prefill through the bricks.

Table-driven (``table.py``: what each architecture's block looks like), one patch routine
(``core.py``), a report of what was patched and why not (``report.py``). See docs/patch.md.

Names resolve lazily (PEP 562), so ``python -m mlx_bricks.patch --help`` and its bad-input
errors do not pay for importing mlx-lm.
"""
from __future__ import annotations

import importlib

_LAZY = {
    "patch_model": "core",
    "patch_report": "core",
    "unpatch_model": "core",
    "ModuleReport": "report",
    "PatchReport": "report",
    "ALIASES": "table",
    "ARCHITECTURES": "table",
    "supported_model_types": "table",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mlx_bricks.patch' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"mlx_bricks.patch.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
