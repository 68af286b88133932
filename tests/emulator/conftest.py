"""Emulator tests need clang++ >= 15 (Debian package clang-19); skipped without it."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _need_emulator():
    from mlx_bricks import emulator

    ok, why = emulator.is_available()
    if not ok:
        pytest.skip(f"emulator unavailable: {why}")
    old = emulator.set_checks(bounds=True, unwritten=True, schedules=2, address_spaces=True)
    yield
    emulator.set_checks(**old.__dict__)
