"""The bricks, one package each: public op with checks and reference, MSL and CUDA launch."""
