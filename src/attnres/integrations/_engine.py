"""The install-time check of a serving engine's attnres plugin (issues 32, 36).

A plugin is written against one range of an engine's releases (SGLang's
``multimodal_gen``, vLLM-Omni) and takes over a function by name; on a release
it was not written for it would install silently and fail on every later call,
after writing decisions that never took effect. :func:`require` refuses first,
typed (:class:`~attnres.errors.EngineSupportError`): the engine is not
importable, its release is outside the range, or a hook the plugin reads is
missing. Nothing here imports an engine until a plugin asks.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import re
import sys
import types
from collections.abc import Mapping

from attrs import frozen

from attnres.errors import EngineSupportError

__all__ = ["Engine", "rebind_imports", "release", "require"]


@frozen
class Engine:
    """What one plugin needs of its engine."""

    #: the engine's name in messages (``SGLang``)
    name: str
    #: its distribution on the package index (``sglang``)
    distribution: str
    #: the extra that installs it with attnres (``sglang``: ``attnres[sglang]``)
    extra: str
    #: the release range the plugin was written for: ``low <= release < high``
    low: tuple[int, ...]
    high: tuple[int, ...]
    #: module -> the attributes the plugin reads from it (its hooks); a dotted
    #: attribute is read through (``Context.backend_by_role``: a field of a class)
    hooks: Mapping[str, tuple[str, ...]]

    @property
    def supported(self) -> str:
        return f">={_dotted(self.low)},<{_dotted(self.high)}"


def _dotted(numbers: tuple[int, ...]) -> str:
    return ".".join(str(n) for n in numbers)


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string (``0.5.23.post1`` -> ``(0, 5, 23)``)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return None if match is None else tuple(int(n) for n in match.group(1).split("."))


def _has(obj: object, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def require(engine: Engine, what: str) -> dict[str, types.ModuleType]:
    """The engine's hook modules, when the installed release is one the plugin
    was written for and has every hook; ``what`` is the call being made
    (``attnres.integrations.sglang.install()``). Raises
    :class:`~attnres.errors.EngineSupportError` otherwise, naming the range."""
    install = f"pip install 'attnres[{engine.extra}]' ({engine.distribution}{engine.supported})"
    try:
        version: str | None = importlib.metadata.version(engine.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None
    modules: dict[str, types.ModuleType] = {}
    for name in engine.hooks:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as exc:
            if version is None:
                raise EngineSupportError(
                    f"{what}: {engine.name} is not installed here ({type(exc).__name__}: {exc}); "
                    f"install it with {install}",
                    engine.name,
                    None,
                    engine.supported,
                ) from exc
            raise EngineSupportError(
                f"{what}: {engine.name} {version} has no module {name} "
                f"({type(exc).__name__}: {exc}); the attnres plugin was written for "
                f"{engine.distribution}{engine.supported}: install a release in that range "
                f"({install})",
                engine.name,
                version,
                engine.supported,
            ) from exc
    found = None if version is None else release(version)
    if found is None or not engine.low <= found < engine.high:
        raise EngineSupportError(
            f"{what}: {engine.name} {version or '(no installed distribution)'} is not a release "
            f"the attnres plugin was written for ({engine.distribution}{engine.supported}); "
            f"nothing was changed: install a release in that range ({install})",
            engine.name,
            version,
            engine.supported,
        )
    missing = [
        f"{module}.{attribute}"
        for module, attributes in engine.hooks.items()
        for attribute in attributes
        if not _has(modules[module], attribute)
    ]
    if missing:
        raise EngineSupportError(
            f"{what}: {engine.name} {version} lacks what the attnres plugin reads "
            f"({', '.join(missing)}); nothing was changed: the plugin was written for "
            f"{engine.distribution}{engine.supported}",
            engine.name,
            version,
            engine.supported,
        )
    return modules


def rebind_imports(old: object, new: object) -> None:
    """Replace every module-level binding of ``old`` (``from selector import ...``):
    how a plugin's hook on an engine's selector, and its removal, reach every
    module that imported the selector's function."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        try:
            names = [k for k, v in vars(module).items() if v is old]
        except TypeError:
            continue
        for name in names:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(module, name, new)
