"""The SSD brick (issue 42): Mamba-2's chunked selective state space (state space duality)."""
