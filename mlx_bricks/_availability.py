"""``Availability``: whether something can run here, and why (not).

A tiny value type at the bottom of the package so that ``backends``, ``kernels`` and the
emulator can all use it without importing each other.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Availability:
    """Whether something can run here, and why (not).

    Truthy exactly when ``available`` is True, and unpacks as ``ok, reason = ...``.
    """

    available: bool
    reason: str

    def __bool__(self) -> bool:
        return self.available

    def __iter__(self):
        return iter((self.available, self.reason))

    def __getitem__(self, i):
        return (self.available, self.reason)[i]
