"""MSL sources of the bricks, shipped as package data (``mlx_bricks.metal_src``).

Files are kernel *bodies* as given to ``mx.fast.metal_kernel`` (``*.metal``) and shared headers
(``*.h``) passed through its ``header=`` argument. Load them with
``mlx_bricks.kernels.read_source`` (``importlib.resources``), never by a path relative to the repo.
"""
