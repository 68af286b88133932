"""The short-conv brick (issue 42): causal depthwise short convolutions with state (LFM2's ShortConv, the conv before Mamba-2 / Gated DeltaNet mixers)."""
