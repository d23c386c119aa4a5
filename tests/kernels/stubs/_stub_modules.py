"""Permissive stand-ins for compilers the kernel packages import (ours).

Triton (aiter, SageAttention) and NVIDIA's CuTe DSL (``cutlass``, ``quack``,
``cuda.bindings``, ``tvm_ffi``: flash-attn-4) compile kernels at run time; the
wrappers import them at module level (decorators, type names, constants).
:func:`install` puts a meta-path finder in front that answers every module
under the given top-level names with a module whose every attribute is an
:class:`Anything`: callable, subscriptable, usable as a decorator, a base class
or a type annotation. A kernel *launch* through one (``kernel[grid](...)``)
raises, so a path that would really run a stubbed compiler cannot pass
unnoticed; the tests stub the Python functions that launch instead (each stub
module says which).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any


class StubLaunchError(RuntimeError):
    """A kernel compiled by a stubbed compiler was launched."""


class Anything:
    """Whatever a compiler module's attribute is asked to be."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return f"<stub {self._name}>"

    def __getattr__(self, attr: str) -> Anything:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        return Anything(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (
            len(args) == 1
            and not kwargs
            and callable(args[0])
            and not isinstance(args[0], Anything)
        ):
            return Kernel(args[0], self._name)  # used as a decorator
        return Anything(f"{self._name}()")

    def __getitem__(self, item: Any) -> Anything:
        return Anything(f"{self._name}[...]")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __or__(self, other: Any) -> Any:
        return self

    __ror__ = __or__

    def __iter__(self) -> Any:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __int__(self) -> int:
        return 0

    def __index__(self) -> int:
        return 0

    def __lt__(self, other: Any) -> bool:
        return False

    __gt__ = __le__ = __ge__ = __lt__

    def __eq__(self, other: Any) -> bool:
        return other is self

    def __hash__(self) -> int:
        return id(self)


class Kernel:
    """A function given to a stubbed compiler's decorator (``@triton.jit``, ``@cute.jit``)."""

    def __init__(self, fn: Any, decorator: str) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)
        self._decorator = decorator

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            raise StubLaunchError(
                f"stub: {self._decorator} kernel {self.__name__} was launched; the test must "
                "stub the function that launches it"
            )

        return launch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self[None](*args, **kwargs)

    def __get__(self, instance: Any, owner: Any) -> Any:
        return self if instance is None else types.MethodType(self, instance)


class _Module(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        value = Anything(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: Sequence[str], versions: dict[str, str]) -> None:
        self.roots = frozenset(roots)
        self.versions = versions

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = self.versions.get(spec.name.split(".")[0], "0.0.0")
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


_installed: list[_Finder] = []


def install(roots: Sequence[str], versions: dict[str, str] | None = None) -> None:
    """Answer every import under ``roots`` with a permissive stand-in."""
    finder = _Finder(roots, versions or {})
    sys.meta_path.insert(0, finder)
    _installed.append(finder)


def uninstall() -> None:
    while _installed:
        finder = _installed.pop()
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
