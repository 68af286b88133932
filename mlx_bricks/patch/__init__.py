"""Drop-in patch of mlx-lm models: ``patch_model(model)`` runs prefill through the bricks.

Table-driven (``table.py``: what each architecture's block looks like), one patch routine
(``core.py``), a report of what was patched and why not (``report.py``). See docs/patch.md.
"""
from __future__ import annotations

from mlx_bricks.patch.core import patch_model, patch_report, unpatch_model
from mlx_bricks.patch.report import ModuleReport, PatchReport
from mlx_bricks.patch.table import ALIASES, ARCHITECTURES, supported_model_types

__all__ = [
    "ALIASES",
    "ARCHITECTURES",
    "ModuleReport",
    "PatchReport",
    "patch_model",
    "patch_report",
    "supported_model_types",
    "unpatch_model",
]
