"""The bricks, one package each: the public op with its checks and MLX reference, the MSL spec,
tiles and launch, the CUDA tiles and launch, the tuner kind and the piece (what a patched
mlx-lm module hands the brick). ``mlx_bricks.ops`` is the public front over them."""
