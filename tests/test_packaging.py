"""Packaging: the wheel ships metal_src, an installed wheel hands the registry the same MSL as the
source tree, and importing mlx_bricks stays cheap."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
METAL_SOURCES = sorted(p.name for p in (ROOT / "metal_src").iterdir()
                       if p.suffix in (".metal", ".h"))


def _not_for_the_wheel(folder, names):
    """copytree filter: VCS, venvs, caches and earlier build output stay behind."""
    top = Path(folder) == ROOT
    return [n for n in names
            if n == "__pycache__" or n.endswith(".egg-info")
            or (top and (n.startswith(".") or n in ("build", "dist")))]


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: setuptools writes build/ and *.egg-info into the tree it builds, and two
    # pytest-xdist workers building in the repo at once could mix their files.
    src = tmp_path_factory.mktemp("src") / "mlx-bricks"
    shutil.copytree(ROOT, src, symlinks=True, ignore=_not_for_the_wheel)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(src)],
        check=True,
    )
    (whl,) = out.glob("mlx_bricks-*.whl")
    return whl


@pytest.fixture(scope="session")
def installed(wheel, tmp_path_factory) -> Path:
    """The wheel installed into a folder of its own (a pure wheel is a zip: unpacking it is the
    install, less the scripts and RECORD bookkeeping that nothing here uses)."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    return site


def run_installed(code: str, site: Path, cwd: Path, *args: str) -> str:
    """stdout of ``python -c code site *args`` importing mlx_bricks from ``site``: PYTHONPATH is
    ``site`` alone and, for a wheel, cwd is outside the repo (the interpreter's own site-packages
    still give mlx; an editable install of the repo there comes after PYTHONPATH). The code must
    assert that every loaded ``mlx_bricks`` module comes from ``site``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", code, str(site), *args], cwd=cwd, env=env,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


# Asserts that every loaded mlx_bricks module lives under sys.argv[1].
_ONLY_FROM_SITE = """
import sys
from pathlib import Path
site = Path(sys.argv[1]).resolve()
for name, mod in list(sys.modules.items()):
    if name.partition(".")[0] == "mlx_bricks" and getattr(mod, "__file__", None):
        assert Path(mod.__file__).resolve().is_relative_to(site), (name, mod.__file__)
"""


def test_wheel_contains_every_metal_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert METAL_SOURCES, "no MSL sources found in metal_src/"
    for name in METAL_SOURCES:
        assert f"mlx_bricks/metal_src/{name}" in names, f"{name} missing from the wheel"


def test_installed_wheel_loads_sources_via_resources(installed, tmp_path):
    code = (
        "import importlib.resources, json, mlx_bricks\n"
        "fs = importlib.resources.files('mlx_bricks.metal_src')\n"
        "print(json.dumps(sorted(p.name for p in fs.iterdir()"
        " if p.name.endswith(('.metal', '.h')))))\n"
    ) + _ONLY_FROM_SITE
    assert json.loads(run_installed(code, installed, tmp_path)) == METAL_SOURCES


# In the installed copy: register every brick (brick modules register at import), then dump what
# the registry would give metal_kernel for each kernel, and every source file it can read.
_DUMP_REGISTRY = """
import importlib, json, pkgutil, sys
import mlx_bricks.bricks
from mlx_bricks import kernels
for m in pkgutil.walk_packages(mlx_bricks.bricks.__path__, "mlx_bricks.bricks."):
    importlib.import_module(m.name)
print(json.dumps({
    "kernels": {f"{n}/{b}": list(kernels.kernel_source(n, b)) for n in kernels.registered()
                for b in ("metal", "cuda") if kernels.has_kernel(n, b)},
    "files": {f: kernels.read_source(f) for f in json.loads(sys.argv[2])},
}))
""" + _ONLY_FROM_SITE


def test_installed_wheel_gives_the_registry_the_repo_sources(installed, tmp_path):
    # The same dump from the repo's tree, also in a fresh process: kernels registered by other
    # tests in this one must not count.
    args = (json.dumps(METAL_SOURCES),)
    from_repo = json.loads(run_installed(_DUMP_REGISTRY, ROOT, ROOT, *args))
    from_wheel = json.loads(run_installed(_DUMP_REGISTRY, installed, tmp_path, *args))

    assert from_repo["kernels"], "no kernels registered"
    # Every file byte for byte as in the repo's metal_src/.
    for f in METAL_SOURCES:
        assert from_wheel["files"][f] == (ROOT / "metal_src" / f).read_text(encoding="utf-8"), f
    # Every kernel: unique name, header and body exactly as the repo's registry builds them.
    assert sorted(from_wheel["kernels"]) == sorted(from_repo["kernels"])
    for name, source in from_repo["kernels"].items():
        assert from_wheel["kernels"][name] == source, name


def test_import_does_not_load_mlx():
    code = "import sys, mlx_bricks; print('mlx.core' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, cwd=ROOT)
    assert out.stdout.strip() == "False"
