"""Public names of a package imported on first use (PEP 562), for package ``__init__`` files.

A package lists each public name and the submodule that defines it; importing the package
imports none of them. The command line relies on it: ``pipetrain train`` parses its words
and starts its fork server (runtime/process/forkserver.py) before anything imports torch.
"""
from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module-level ``__getattr__`` and ``__dir__`` of ``package`` whose public names are
    ``names`` (name -> submodule, relative to the package). A name's first lookup imports its
    submodule and keeps the value in the package's namespace."""

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
