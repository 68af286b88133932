"""The decode brick."""
