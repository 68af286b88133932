"""The gemm brick."""
