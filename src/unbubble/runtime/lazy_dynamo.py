"""Eager stage processes without ``torch._dynamo``: it is imported only if something really needs it.

[Note: eager stage processes without Dynamo]
Every ``torch.optim.Optimizer`` imports ``torch._dynamo`` (and with it sympy) the first time it is
built or stepped, although an eager process never compiles: ``add_param_group``, ``zero_grad``,
``state_dict`` and the functional kernels are wrapped in ``torch._disable_dynamo``, whose first
call imports the package to build ``torch._dynamo.disable(fn)``, and ``step`` is wrapped in
``_use_grad_for_differentiable``, which imports it to call ``torch._dynamo.graph_break()``. In a
stage process of the default run that import is about 70 MiB of resident memory with sympy (35 MiB
for Dynamo itself on the stages where ``backward(grad)`` imports sympy anyway) and about 1 s of CPU
at start-up (``python -c "import torch, torch._dynamo"`` against ``import torch``), paid by every
stage process at once.

``defer()`` puts a stand-in module under ``sys.modules["torch._dynamo"]`` that answers those two
calls as Dynamo itself does when nothing is being compiled: ``disable(fn)`` only switches Dynamo's
frame hook off while ``fn`` runs, and with no hook installed that is ``fn`` itself; ``graph_break()``
does nothing outside a trace. Anything else (another attribute, a submodule import such as
``torch._dynamo.config``, ``torch.compile``) imports the real package first and continues with
it, so correctness never depends on the stand-in; only the memory saving does. Functions that
were resolved through the stand-in keep running without Dynamo's disable wrapper, which matters
only inside a compiled region — hence ``defer()`` is used only in processes that compile nothing
(stage processes with ``compile_backend=None``, before any torch optimizer exists, and after
``init_process_group``, which touches an imported ``torch._dynamo``).
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
