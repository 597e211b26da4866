"""The same plugin or strategy for the ``pytorch_lightning`` namespace.

Lightning ships two namespaces (``lightning.pytorch`` and ``pytorch_lightning``) whose base classes are distinct, so
each of our classes keeps its logic in a mixin and gets a second flavour built on the other namespace's base.
"""

from __future__ import annotations

import importlib


def build_flavour(logic: type, base_module: str, base_name: str, name: str, module: str, doc: str | None) -> type:
    """``type(name, (logic, <base_module>.<base_name>), ...)`` registered under ``module`` so it pickles by name."""
    base = getattr(importlib.import_module(base_module), base_name)
    return type(name, (logic, base), {"__module__": module, "__qualname__": name, "__doc__": doc})
