"""Small helpers shared by the test modules."""
from __future__ import annotations

import pytest


def require_backend(name: str) -> None:
    """Skip the calling test, with the reason, when backend ``name`` cannot run here."""
    from mlx_bricks.backends import backend_status

    ok, why = backend_status(name)
    if not ok:
        pytest.skip(f"backend {name} unavailable: {why}")
