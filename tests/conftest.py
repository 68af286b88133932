"""Shared fixtures: every kernel test is written once and parametrised over backends.

``kernel_backend`` runs a test on ``metal`` (skipped without a Mac), ``emulator`` (the real MSL
on the CPU, skipped without clang-19) and ``reference``. Emulator fault checks (bounds, races,
unwritten outputs) are on by default, so any fault fails the test.
"""
from __future__ import annotations

import pytest

KERNEL_BACKENDS = ("metal", "emulator", "reference")


def _require(name: str) -> None:
    from mlx_bricks.backends import backend_status

    ok, why = backend_status(name)
    if not ok:
        pytest.skip(f"backend {name} unavailable: {why}")


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request) -> str:
    """Backend name for a kernel test; skips when that backend cannot run here."""
    _require(request.param)
    return request.param


@pytest.fixture(params=("metal", "emulator"))
def msl_backend(request) -> str:
    """Backends that run the MSL itself (metal, emulator): for kernel-only properties."""
    _require(request.param)
    return request.param


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    monkeypatch.delenv("MLX_BRICKS_BACKEND", raising=False)
