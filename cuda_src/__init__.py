"""CUDA twins of the bricks, shipped as package data (``mlx_bricks.cuda_src``).

Files are kernel *bodies* as given to ``mx.fast.cuda_kernel`` (``*.cu``) and shared headers
(``*.cuh``) passed through its ``header=`` argument, one file per brick beside its MSL twin in
``metal_src/``. Load them with ``mlx_bricks.kernels.read_source(name, CUDA_SOURCE_PACKAGE)``.
"""
