"""The attention brick."""
