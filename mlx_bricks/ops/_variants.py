"""Which kernel variants an op offers on a backend (what the tuner, ``mlx_bricks.tune``, times).

Each op module has a small public listing function built on :func:`kernel_variants`
(``gemm.tile_names``, ``mlp.variant_names`` / ``mlp.tile_names``, ``norm_qkv.tile_names``,
``attention.variant_names``); the tuner enumerates candidates from those, never from lists of
its own, so a new tile or a CUDA twin's variants reach it by editing the op alone.
"""
from __future__ import annotations


def kernel_variants(backend: str, kernels: str | tuple[str, ...],
                    names: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` when every kernel in ``kernels`` can run on ``backend``, else ``()``.

    ``metal`` and ``emulator`` run the MSL of every registered kernel; ``cuda`` only the kernels
    with a CUDA twin (``KernelSpec.cuda_body``); ``reference`` runs MLX ops, no kernel at all.
    A CUDA twin with variants of its own names them in its op's listing function.

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
    return tuple(names) if all(has_kernel(k, backend) for k in kernels) else ()
