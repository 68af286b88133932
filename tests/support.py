"""Small helpers shared by the test modules."""
from __future__ import annotations

import zlib

import pytest


def require_backend(name: str) -> None:
    """Skip the calling test, with the reason, when backend ``name`` cannot run here."""
    from mlx_bricks.backends import backend_status

    ok, why = backend_status(name)
    if not ok:
        pytest.skip(f"backend {name} unavailable: {why}")


def sampled(case_id: str, one_in: int) -> bool:
    """True for about one case in ``one_in``, chosen by a stable hash of ``case_id``: the
    default suite runs a fixed, spread-out sample of a slow sweep (the same cases every run,
    on every machine), the rest stays marked slow."""
    return zlib.crc32(case_id.encode()) % one_in == 0
