"""The swiglu brick."""
