"""Packaging: the wheel ships metal_src, and importing mlx_bricks stays cheap."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(ROOT)],
        check=True,
    )
    (whl,) = out.glob("mlx_bricks-*.whl")
    return whl


def test_wheel_contains_every_metal_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "metal_src").iterdir()
                     if p.suffix in (".metal", ".h"))
    for name in sources:
        assert f"mlx_bricks/metal_src/{name}" in names, f"{name} missing from the wheel"


def test_installed_wheel_loads_sources_via_resources(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                    str(target), str(wheel)], check=True)
    code = (
        "import importlib.resources, mlx_bricks, sys;"
        "assert mlx_bricks.__file__.startswith(sys.argv[1]), mlx_bricks.__file__;"
        "fs = importlib.resources.files('mlx_bricks.metal_src');"
        "print(sorted(p.name for p in fs.iterdir() if p.name.endswith(('.metal', '.h'))))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, check=True,
                         capture_output=True, text=True, env={"PYTHONPATH": str(target)})
    expected = sorted(p.name for p in (ROOT / "metal_src").iterdir()
                      if p.suffix in (".metal", ".h"))
    assert out.stdout.strip() == str(expected)


def test_import_does_not_load_mlx():
    code = "import sys, mlx_bricks; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
