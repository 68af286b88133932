"""Backend selection: explicit argument > MLX_BRICKS_BACKEND > auto; clear errors."""
import mlx.core as mx
import pytest

from mlx_bricks import backends
from mlx_bricks.backends import BACKENDS, BackendError, active_backend, resolve_backend


def test_auto_selection_matches_this_machine():
    choice = active_backend()
    assert choice.source == "auto"
    if mx.metal.is_available():
        assert choice.name == "metal"
    else:
        # No Metal here; CUDA only counts once bricks have CUDA twins.
        assert choice.name in ("cuda", "reference")
        assert "metal" in choice.reason
    if not mx.metal.is_available() and not mx.cuda.is_available():
        assert choice.name == "reference"


def test_emulator_is_never_chosen_automatically():
    assert active_backend().name != "emulator"


def test_env_override(monkeypatch):
    monkeypatch.setenv("MLX_BRICKS_BACKEND", "reference")
    choice = active_backend()
    assert (choice.name, choice.source) == ("reference", "env")


def test_argument_beats_env(monkeypatch):
    monkeypatch.setenv("MLX_BRICKS_BACKEND", "not-a-backend")
    assert resolve_backend("reference") == "reference"
    assert active_backend("reference").source == "argument"


@pytest.mark.parametrize("bad", ["gpu", "Metal", "", 3])
def test_unknown_backend_lists_valid_ones(bad):
    with pytest.raises(BackendError) as e:
        active_backend(bad)
    for name in BACKENDS:
        assert name in str(e.value)


def test_unknown_env_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("MLX_BRICKS_BACKEND", "tpu")
    with pytest.raises(BackendError, match="MLX_BRICKS_BACKEND"):
        active_backend()


def test_unavailable_backend_is_an_error_with_reason(monkeypatch):
    monkeypatch.setitem(backends._status_cache, "metal", (False, "no Apple GPU in this test"))
    with pytest.raises(BackendError, match="no Apple GPU in this test"):
        active_backend("metal")
    monkeypatch.setenv("MLX_BRICKS_BACKEND", "metal")
    with pytest.raises(BackendError, match="unavailable"):
        active_backend()


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the non-Metal path")
def test_metal_unavailable_here_says_why():
    ok, why = backends.backend_status("metal")
    assert not ok and "mx.metal.is_available()" in why


def test_available_backends_reports_every_backend():
    table = backends.available_backends()
    assert set(table) == set(BACKENDS)
    assert table["reference"][0] is True


def test_availability_is_falsy_when_unavailable(monkeypatch, request):
    from mlx_bricks import emulator
    from mlx_bricks.emulator import compile as emulator_compile

    monkeypatch.setenv("MLX_BRICKS_CLANG", "/nonexistent/clang++")
    emulator_compile.find_clang.cache_clear()  # the compiler is probed once per process
    request.addfinalizer(emulator_compile.find_clang.cache_clear)
    status = emulator.is_available()
    ok, why = status
    assert not ok and not status and "nonexistent" in why
    assert bool(backends.backend_status("reference")) is True
