"""Lazy package exports: `from openglm.model import X` imports X's module on first use only, so that
`openglm --help` and the agent runtime do not pay for torch, FastAPI or FAISS they never touch."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """Return a module `__getattr__` resolving each name in `exports` from its (absolute) module."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
