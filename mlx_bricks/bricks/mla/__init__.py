"""Multi-head latent attention (MLA): prefill of mlx-lm's MLA modules on the attention and GEMM bricks."""
