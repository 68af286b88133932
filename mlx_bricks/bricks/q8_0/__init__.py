"""The q8_0 brick."""
