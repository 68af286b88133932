"""Shared fixtures: every kernel test is written once and parametrised over backends.

``kernel_backend`` runs a test on ``metal`` (skipped without a Mac), ``emulator`` (the real MSL
on the CPU, skipped without clang-19) and ``reference``. Emulator fault checks (bounds, races,
unwritten outputs) are on by default, so any fault fails the test.
"""
from __future__ import annotations

import pytest

from tests.support import require_backend

KERNEL_BACKENDS = ("metal", "emulator", "reference")


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request) -> str:
    """Backend name for a kernel test; skips when that backend cannot run here."""
    require_backend(request.param)
    return request.param


@pytest.fixture(params=("metal", "emulator"))
def msl_backend(request) -> str:
    """Backends that run the MSL itself (metal, emulator): for kernel-only properties."""
    require_backend(request.param)
    return request.param


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    monkeypatch.delenv("MLX_BRICKS_BACKEND", raising=False)
