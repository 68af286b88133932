"""Measurement tools that are not part of the bricks' product path (drivers, accuracy and memory
scripts). Run them with ``python -m mlx_bricks.tools.<name>``."""
