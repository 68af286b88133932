"""Packaging glue: ``mlx_bricks/metal_src`` and ``mlx_bricks/cuda_src`` are links to the top-level
``metal_src/`` and ``cuda_src/`` folders, so the kernel sources are the subpackages
``mlx_bricks.metal_src`` and ``mlx_bricks.cuda_src`` from the source tree, an editable install
and a wheel alike (the wheel gets real copies).

It also puts ``mlx_bricks_hook.pth`` at the root of the wheel (regular and editable), so
``site`` finds it in site-packages: that one line is the hook of ``mlx_lm.generate``,
``mlx_lm.server``, ``mlx_lm.chat`` and ``mlx_lm.benchmark --use-bricks`` (see
``mlx_bricks/entry/hook.py``). It is in the wheel's RECORD, so uninstalling removes it.
"""
import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# Same text as mlx_bricks.entry.hook.PTH_LINE (tests/test_cli.py checks the installed file);
# setup.py does not import the package it is building.
PTH_NAME = "mlx_bricks_hook.pth"
PTH_LINE = (
    "import sys; {'--use-bricks', '--help', '-h'} & set(getattr(sys, 'argv', ())) "
    "and __import__('mlx_bricks.entry.hook').entry.hook.install()\n"
)


class build_py_with_pth(build_py):
    """build_py that also writes the hook's ``.pth`` file at the root of the wheel."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            # An editable wheel ships build_lib only through links/finders; files written to
            # the install dir (the unpacked wheel) go into it as they are.
            root = self.get_finalized_command("install").install_lib
        else:
            root = self.build_lib
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, PTH_NAME), "w", encoding="ascii") as f:
            f.write(PTH_LINE)


setup(
    packages=find_packages(include=["mlx_bricks", "mlx_bricks.*"]),
    cmdclass={"build_py": build_py_with_pth},
)
