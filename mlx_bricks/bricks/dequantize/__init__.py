"""The dequantize brick."""
