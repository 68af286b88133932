"""The CUDA twins' build cache: each twin variant compiled once per machine (docs/backends.md).

* :mod:`.source`: the source MLX's ``cuda_kernel`` builds, and the units the cache compiles;
* :mod:`.toolchain`: NVRTC through ``ctypes`` with MLX's options, and the device it targets;
* :mod:`.build`: the disk cache and :class:`~.build.CudaKernel`, the object behind
  ``kernels.launch`` on ``cuda``.

One direction: the kernel registry (``mlx_bricks.kernels``) and the compile checks
(``mlx_bricks.cudacheck``) sit on this package; nothing here imports either.
"""
