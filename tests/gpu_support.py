"""The ``gpu`` marker's skip: tests that need an NVIDIA GPU with MLX's CUDA backend.

``@gpu`` marks a test ``gpu`` (registered in pyproject.toml) and skips it, with the reason,
where the ``cuda`` backend cannot run (``mlx_bricks.backends.backend_status``). On the GPU
machine ``python3 -m pytest -m gpu tests`` runs them all (scripts/gpu/session.sh, step
``gpu-tests``).
"""
from __future__ import annotations

import pytest


def _cuda_status() -> tuple[bool, str]:
    from mlx_bricks.backends import backend_status

    return backend_status("cuda")


_OK, _WHY = _cuda_status()
needs_cuda_gpu = pytest.mark.skipif(not _OK, reason=f"backend cuda unavailable: {_WHY}")


def gpu(fn):
    """Mark ``fn`` as a GPU test (``-m gpu``) that is skipped without a CUDA GPU."""
    return pytest.mark.gpu(needs_cuda_gpu(fn))
