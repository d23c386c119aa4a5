"""JSON documents of the catalogue and the platform, through one cattrs converter.

``attnres backends --json`` and ``attnres doctor --json`` print these; the CLI
no longer serialises specs and platforms by hand. Every attrs field of a
:class:`~attnres.backends.BackendSpec` or :class:`~attnres.platform.Platform`
appears (a new field appears without more code), with a few readable
additions: a spec's ``kind`` (dense or sparse) and ``kernel_source``, and the
``description`` of every record that can describe itself (rules, the
platform). Sets come out as lists in the vocabulary's order (platform kinds,
dtypes, requirements), capabilities in numeric order, else sorted.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs

from attnres._vocab import DTYPES, PLATFORM_KINDS, Requirement
from attnres.backends import Backend, BackendSpec
from attnres.kernels import kernel_source
from attnres.layer import ENV_VAR, SelectionConfig
from attnres.platform import Platform

__all__ = ["environment_document", "platform_document", "spec_document", "vocabulary_sorted"]

_ORDER: dict[str, int] = {
    name: i for i, name in enumerate([*PLATFORM_KINDS, *DTYPES, *(r.value for r in Requirement)])
}


def _sort_key(value: Any) -> tuple[int, str]:
    text = value.value if isinstance(value, enum.Enum) else str(value)
    return (_ORDER.get(text, len(_ORDER)), text)


def vocabulary_sorted(value: frozenset[Any]) -> list[Any]:
    """A set in the vocabulary's order (``_ORDER``), capabilities in numeric order."""
    if all(isinstance(v, tuple) for v in value):
        return sorted(value)  # capabilities: (major, minor) in numeric order
    return sorted(value, key=_sort_key)


def _value(value: Any) -> Any:
    """JSON data for any value a spec or a platform holds."""
    if isinstance(value, frozenset):
        return [_value(v) for v in vocabulary_sorted(value)]
    if isinstance(value, (tuple, list)):
        return [_value(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _value(value[k]) for k in sorted(value)}
    if isinstance(value, enum.Enum):
        return value.value
    return _CONVERTER.unstructure(value)


def _attrs_hook(cls: type[Any]) -> Callable[[Any], dict[str, Any]]:
    """Every field (through :func:`_value`), plus ``description`` when the class has one."""
    names = [a.name for a in attrs.fields(cls)]
    describe = callable(getattr(cls, "describe", None))

    def unstructure(obj: Any) -> dict[str, Any]:
        doc = {n: _value(getattr(obj, n)) for n in names}
        if describe:
            doc["description"] = obj.describe()
        return doc

    return unstructure


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter()
    conv.register_unstructure_hook(Backend, lambda b: b.name)
    conv.register_unstructure_hook_factory(attrs.has, _attrs_hook)
    return conv


_CONVERTER = _make_converter()


def spec_document(spec: BackendSpec) -> dict[str, Any]:
    """One catalogue entry as JSON data (``attnres backends --json``)."""
    fields: dict[str, Any] = _CONVERTER.unstructure(spec)
    doc: dict[str, Any] = {"name": spec.name, "kind": spec.kind}
    doc.update((k, v) for k, v in fields.items() if k != "name")
    doc["kernel_source"] = kernel_source(spec.name).value
    return doc


def platform_document(platform: Platform) -> dict[str, Any]:
    """The platform facts as JSON data, with a one-line ``description``."""
    doc: dict[str, Any] = _CONVERTER.unstructure(platform)
    return doc


def environment_document() -> dict[str, Any]:
    """What ``ATTNRES_ATTENTION_BACKEND`` holds and what attnres makes of it."""
    raw = os.environ.get(ENV_VAR)
    doc: dict[str, Any] = {"variable": ENV_VAR, "value": raw, "backend": None, "error": None}
    if raw is None or not raw.strip():
        doc["status"] = "unset"
        doc["summary"] = "not set (no global backend from the environment)"
        return doc
    try:
        config = SelectionConfig.from_env({ENV_VAR: raw})
    except ValueError as exc:
        doc["status"] = "invalid"
        doc["error"] = str(exc)
        doc["summary"] = f"{raw!r} is invalid: {exc}"
        return doc
    backend = config.global_backend.name if config.global_backend else None
    doc["status"] = "set"
    doc["backend"] = backend
    doc["summary"] = (
        f"{backend} (global backend, origin global_env: relaxed and strict like "
        f"--attention-backend, which beats it when typed)"
    )
    return doc
