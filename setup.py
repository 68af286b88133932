"""Packaging glue: ``mlx_bricks/metal_src`` is a link to the top-level ``metal_src/`` folder, so
the MSL sources are the subpackage ``mlx_bricks.metal_src`` from the source tree, an editable
install and a wheel alike (the wheel gets real copies)."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["mlx_bricks", "mlx_bricks.*"]))
