"""Lazy module attributes (PEP 562), so importing a package does not import its heavy parts."""
from __future__ import annotations

import importlib


def lazy_exports(package: str, table: dict[str, str]):
    """``(__getattr__, __dir__)`` for ``package`` resolving ``name`` from module ``table[name]``.

    ``table`` maps a public name to the module that defines it (absolute, or relative to
    ``package`` when it starts with "."). A name equal to its module's last component resolves to
    the module itself. Resolved values are cached in the package's namespace.
    """
    names = sorted(table)

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        mod = importlib.import_module(module, package)
        value = mod if module.rsplit(".", 1)[-1] == name else getattr(mod, name)
        vars(importlib.import_module(package))[name] = value
        return value

    def __dir__():
        return names

    return __getattr__, __dir__
