"""The norm_qkv brick."""
