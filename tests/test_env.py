"""The environment variables (``mlx_bricks.env``): each bad value is one line naming the
variable and what it takes, and every command stops on it with exit 2 before any work."""
from __future__ import annotations

import subprocess
import sys

import pytest

from mlx_bricks import _cli, env

#: A bad value of every variable, and a good one with what it parses to.
BAD = {
    "MLX_BRICKS_BACKEND": "tpu",
    "MLX_BRICKS_HOME": "/etc/passwd",  # a file, not a directory
    "MLX_BRICKS_DEQUANT_CAP": "abc",
    "MLX_BRICKS_SWIGLU_VARIANT": "abc",
    "MLX_BRICKS_CUDA_CACHE": "sometimes",
    "MLX_BRICKS_NVRTC": "/nonexistent/libnvrtc.so",
    "MLX_BRICKS_CLANG": "/nonexistent/clang++",
    "MLX_BRICKS_EMULATOR_CHECKS": "2",
    "MLX_BRICKS_EMULATOR_OPT": "fast",
    "MLX_BRICKS_EMULATOR_PERTURB": "lots",
    "MLX_BRICKS_EMULATOR_THREADS": "0",
    "MLX_BRICKS_BENCH_WORK": "/etc/passwd",
}
GOOD = {
    "MLX_BRICKS_BACKEND": ("reference", "reference"),
    "MLX_BRICKS_HOME": ("/tmp/mlx-bricks-home-test", "/tmp/mlx-bricks-home-test"),
    "MLX_BRICKS_DEQUANT_CAP": (" 0.5 ", 1 << 19),
    "MLX_BRICKS_SWIGLU_VARIANT": ("split", "split"),
    "MLX_BRICKS_CUDA_CACHE": ("OFF", "off"),
    "MLX_BRICKS_NVRTC": (sys.executable, sys.executable),
    "MLX_BRICKS_CLANG": ("sh", "sh"),
    "MLX_BRICKS_EMULATOR_CHECKS": ("no", False),
    "MLX_BRICKS_EMULATOR_OPT": ("3", "3"),
    "MLX_BRICKS_EMULATOR_PERTURB": ("17", 17),
    "MLX_BRICKS_EMULATOR_THREADS": ("2", 2),
    "MLX_BRICKS_BENCH_WORK": ("/tmp/mlx-bricks-work-test", "/tmp/mlx-bricks-work-test"),
}


@pytest.fixture
def clean(monkeypatch):
    for name in env.VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_every_variable_has_a_bad_and_a_good_case():
    assert set(BAD) == set(GOOD) == set(env.VARIABLES)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_names_the_variable_and_what_it_takes(clean, name):
    clean.setenv(name, BAD[name])
    with pytest.raises(env.EnvError) as e:
        env.get(name)
    assert str(e.value) == f"{name}={BAD[name]!r}: expected {env.VARIABLES[name].takes}"


@pytest.mark.parametrize("name", sorted(GOOD))
def test_good_values_and_unset(clean, name):
    text, value = GOOD[name]
    clean.setenv(name, text)
    got = env.get(name)
    assert (str(got) if name in ("MLX_BRICKS_HOME", "MLX_BRICKS_BENCH_WORK") else got) == value
    clean.setenv(name, "  ")  # empty counts as unset
    assert env.get(name) == env.VARIABLES[name].default
    clean.delenv(name)
    assert env.get(name) == env.VARIABLES[name].default


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_command_stops_before_its_work(clean, capsys, name):
    """``_cli.run_cli`` (every command's runner) checks the environment first: one line,
    exit 2, the command's body never runs."""
    clean.setenv(name, BAD[name])
    ran = []
    with pytest.raises(SystemExit) as e:
        _cli.run_cli("prog", lambda: ran.append(1))
    assert e.value.code == 2 and ran == []
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"prog: error: {name}={BAD[name]!r}: expected {env.VARIABLES[name].takes}"


def test_every_bad_value_at_once_is_one_line(clean):
    for name, value in BAD.items():
        clean.setenv(name, value)
    with pytest.raises(env.EnvError) as e:
        env.check()
    assert "\n" not in str(e.value) and all(f"{n}=" in str(e.value) for n in BAD)


def test_readers_check_their_variable(clean):
    """The modules read through env.get: a bad value surfaces where it is read."""
    from mlx_bricks import backends, home
    from mlx_bricks.bricks.dequantize.composite import resolve_cap
    from mlx_bricks.bricks.swiglu.variants import resolve_variant
    from mlx_bricks.cuda import build, toolchain

    cases = [("MLX_BRICKS_HOME", home.home, env.EnvError),
             ("MLX_BRICKS_DEQUANT_CAP", resolve_cap, env.EnvError),
             ("MLX_BRICKS_SWIGLU_VARIANT", lambda: resolve_variant(None), env.EnvError),
             ("MLX_BRICKS_CUDA_CACHE", build.mode, env.EnvError),
             ("MLX_BRICKS_NVRTC", toolchain.find_nvrtc, toolchain.Unavailable),
             ("MLX_BRICKS_BACKEND", backends.active_backend, backends.BackendError)]
    for name, read, error in cases:
        clean.setenv(name, BAD[name])
        with pytest.raises(error, match=f"^{name}="):
            read()
        clean.delenv(name)


@pytest.mark.parametrize("module, argv", [
    ("mlx_bricks.patch.__main__", ["/nonexistent-model"]),
    ("mlx_bricks.tune.__main__", ["/nonexistent-model"]),
    ("mlx_bricks.bench.__main__", ["--only", "emulator_gemm_256"]),
    ("mlx_bricks.bench.user_path", ["--out-dir", "/nonexistent/out", "--models", "nope"]),
    ("mlx_bricks.generate", ["--model", "/nonexistent-model", "--prompt", "hi"]),
])
def test_the_commands_check_the_environment_first(clean, capsys, module, argv):
    """Each command's ``main`` with a bad variable and an input that would fail later (a
    missing model, an unknown model name): the variable is what is reported, so it was checked
    before any work (``mlx_lm.generate --use-bricks`` runs ``mlx_bricks.generate``'s code)."""
    import importlib

    clean.setenv("MLX_BRICKS_DEQUANT_CAP", "abc")
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv)
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith("error: MLX_BRICKS_DEQUANT_CAP='abc': expected a number of MiB above 0")


def test_gguf_checks_the_environment_first(clean, capsys, tmp_path):
    from mlx_bricks.gguf.__main__ import main

    clean.setenv("MLX_BRICKS_SWIGLU_VARIANT", "abc")
    assert main([str(tmp_path / "missing.gguf"), str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("python -m mlx_bricks.gguf: error: MLX_BRICKS_SWIGLU_VARIANT='abc': "
                    "expected one of fused, split")


def test_patch_command_in_a_fresh_process(tmp_path):
    """The issue's case: ``python -m mlx_bricks.patch`` with a bad cap exits 2 with one line
    before it loads the default model (nothing is written to the home it would convert into)."""
    import os

    home = tmp_path / "home"
    r = subprocess.run([sys.executable, "-m", "mlx_bricks.patch"], capture_output=True,
                       text=True, env={**os.environ, "MLX_BRICKS_DEQUANT_CAP": "-1",
                                       "MLX_BRICKS_HOME": str(home)})
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["python -m mlx_bricks.patch: error: "
                                     "MLX_BRICKS_DEQUANT_CAP='-1': expected a number of MiB "
                                     "above 0"]
    assert not home.exists()
