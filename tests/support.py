"""Small helpers shared by the test modules."""
from __future__ import annotations

import zlib

import pytest


def require_backend(name: str) -> None:
    """Skip the calling test, with the reason, when backend ``name`` cannot run here."""
    from mlx_bricks.backends import backend_status

    ok, why = backend_status(name)
    if not ok:
        pytest.skip(f"backend {name} unavailable: {why}")


def sampled(case_id: str, one_in: int) -> bool:
    """True for about one case in ``one_in``, chosen by a stable hash of ``case_id``: the
    default suite runs a fixed, spread-out sample of a slow sweep (the same cases every run,
    on every machine), the rest stays marked slow."""
    return zlib.crc32(case_id.encode()) % one_in == 0


def tile_for(backend: str, tile):
    """``tile`` for ``backend``: the MSL tile names (64x64, 32x32, ...) are not CUDA's, so on
    ``cuda`` a name the twin does not have becomes None (its tile rule); the CUDA tiles have
    their own cases (test_gemm.test_cuda_tiles)."""
    if backend != "cuda" or tile is None:
        return tile
    from mlx_bricks.bricks.gemm import cuda as gemm_cuda
    return tile if tile in gemm_cuda.TILES else None
