"""Which kernel variants an op offers on a backend (what the tuner, ``mlx_bricks.tune``, times).

Each op module has a small public listing function built on :func:`kernel_variants`
(``gemm.tile_names``, ``mlp.variant_names`` / ``mlp.tile_names``, ``norm_qkv.tile_names``,
``attention.variant_names``); the tuner enumerates candidates from those, never from lists of
its own, so a new tile, pipeline variant or CUDA twin reaches it by editing the op alone.
"""
from __future__ import annotations

from typing import Callable


def kernel_variants(backend: str, kernels: str | tuple[str, ...], names: tuple[str, ...], *,
                    cuda_names: Callable[[], tuple[str, ...]] | None = None) -> tuple[str, ...]:
    """The variant names an op offers on ``backend``.

    Args:
        backend: one of ``mlx_bricks.backends.BACKENDS``.
        kernels: the registered kernel(s) the op launches.
        names: its variants on the MSL backends (``metal``, ``emulator``).
        cuda_names: its variants on ``cuda`` (a CUDA twin has its own tiles, which may depend on
            the GPU and the dtype); default ``names``.

    Returns:
        ``()`` on ``reference`` (MLX ops, no kernel) and where one of ``kernels`` has no kernel
        for ``backend`` (``cuda`` without a twin); else the names.

    Raises:
        mlx_bricks.backends.BackendError: ``backend`` is not one of ``BACKENDS``.
    """
    from mlx_bricks.backends import BACKENDS, BackendError
    from mlx_bricks.kernels import has_kernel

    if not isinstance(backend, str) or backend not in BACKENDS:
        raise BackendError(f"unknown backend {backend!r}; expected one of: {', '.join(BACKENDS)}")
    if backend == "reference":
        return ()
    if isinstance(kernels, str):
        kernels = (kernels,)
    if not all(has_kernel(k, backend) for k in kernels):
        return ()
    if backend == "cuda" and cuda_names is not None:
        return tuple(cuda_names())
    return tuple(names)
