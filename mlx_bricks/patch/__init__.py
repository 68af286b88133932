"""Drop-in patch of mlx-lm models: ``patch_model(model)`` runs prefill through the bricks.

Table-driven (``table.py``: what each architecture's block looks like), one patch routine
(``core.py``), a report of what was patched and why not (``report.py``). See docs/patch.md.

Names resolve lazily (PEP 562), so ``python -m mlx_bricks.patch --help`` and its bad-input
errors do not pay for importing mlx-lm.
"""
from __future__ import annotations

from mlx_bricks._lazy import lazy_exports

_LAZY = {
    "patch_model": ".core",
    "patch_report": ".core",
    "unpatch_model": ".core",
    "ModuleReport": ".report",
    "PatchReport": ".report",
    "ALIASES": ".table",
    "ARCHITECTURES": ".table",
    "supported_model_types": ".table",
}

__all__ = sorted(_LAZY)


__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
