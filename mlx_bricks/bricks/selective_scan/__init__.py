"""The selective-scan brick: Mamba-1's selective state space over a prefill (jamba, mamba)."""
