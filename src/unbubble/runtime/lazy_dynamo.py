"""Eager stage processes without ``torch._dynamo``: it is imported only if something really needs it.

Every torch optimizer imports ``torch._dynamo`` (and sympy) when built or stepped, ~70 MiB and ~1 s of
CPU per stage process that never compiles; a stand-in answers what Dynamo answers when nothing is traced:
[Note: eager stage processes without Dynamo] in docs/architecture.md#runtimelazy_dynamopy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from typing import Any

import torch

_NAME = "torch._dynamo"


class _Finder(importlib.abc.MetaPathFinder):
    """Imports the real package before any ``torch._dynamo.*`` submodule is looked up."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname.startswith(_NAME + "."):
            _load()
        return None  # the normal finders continue, now under the real package


_FINDER = _Finder()


class _Standin(types.ModuleType):
    """``torch._dynamo`` as seen by eager code; everything else loads the real module."""

    @staticmethod
    def disable(fn: Any = None, recursive: bool = True, *, reason: str | None = None, wrapping: bool = True) -> Any:
        if fn is None:  # decorator form: @disable(recursive=False)
            return lambda f: f
        return fn

    @staticmethod
    def graph_break(msg: str = "") -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(_load(), name)


def _load() -> types.ModuleType:
    """Replaces the stand-in by the real ``torch._dynamo`` (once) and returns it."""
    module = sys.modules.get(_NAME)
    if module is not None and not isinstance(module, _Standin):
        return module
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    sys.modules.pop(_NAME, None)
    if isinstance(torch.__dict__.get("_dynamo"), _Standin):
        del torch._dynamo
    return importlib.import_module(_NAME)  # also sets torch._dynamo


def defer() -> bool:
    """Installs the stand-in ([Note: eager stage processes without Dynamo]) unless the real
    ``torch._dynamo`` is already imported.

    Returns:
        True if the stand-in is now in place (a process that never compiles saves ~70 MiB and ~1 s).
    """
    if _NAME in sys.modules:
        return isinstance(sys.modules[_NAME], _Standin)
    standin = _Standin(_NAME, "stand-in for torch._dynamo in an eager process (unbubble.runtime.lazy_dynamo)")
    standin.__spec__ = importlib.util.find_spec(_NAME)  # the real package's (found, not imported)
    sys.modules[_NAME] = standin
    torch._dynamo = standin  # type: ignore[attr-defined]  # what `import torch._dynamo` binds
    sys.meta_path.insert(0, _FINDER)
    return True


def is_deferred() -> bool:
    """Whether this process still runs on the stand-in (the real ``torch._dynamo`` is not imported)."""
    return isinstance(sys.modules.get(_NAME), _Standin)
