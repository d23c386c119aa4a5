"""The strict codec both file loaders share: traces (``attnres.trace``, JSON) and
pipeline files (``attnres.plan``, TOML).

One place answers, for either format: which keys a record has (derived from its
attrs class, never restated), which of a table's keys are missing or unknown,
and whether a value has the type a field wants (a bool is never an integer).
Each loader words its errors for its own readers (a trace names a JSON path, a
pipeline file names the component and layer), from the same answers.
"""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeGuard

import attrs

__all__ = [
    "closest_key",
    "field_names",
    "field_types",
    "is_bool",
    "is_int",
    "is_str",
    "is_str_list",
    "located",
    "missing_keys",
    "optional_field_names",
    "optional_inner",
    "required_field_names",
    "unknown_keys",
]


def located(source: str, *where: str, message: str) -> str:
    """The one error format of every file attnres loads: ``FILE: WHERE...: MESSAGE``,
    on one line (traces name a JSON path, pipeline files a component and layer,
    folders a file in the folder: each loader words where, this joins them)."""
    return " ".join(": ".join([source, *where, message]).split())


def field_names(cls: type[Any]) -> tuple[str, ...]:
    """The init fields of an attrs class, in order: the one source of every key list
    the strict loaders check (traces in :mod:`attnres.trace`, pipeline files in
    :mod:`attnres.plan`).

    A field marked ``metadata={"trace": False}`` (the autotune settings of a
    SelectionConfig) is not part of a trace; one marked ``omit_default`` is
    written only when set (:func:`optional_field_names`), so it is not listed.
    """
    return tuple(
        a.name
        for a in attrs.fields(cls)
        if a.init and a.metadata.get("trace") is not False and not a.metadata.get("omit_default")
    )


def optional_field_names(cls: type[Any]) -> tuple[str, ...]:
    """The init fields of an attrs class a trace writes only when not their default."""
    return tuple(a.name for a in attrs.fields(cls) if a.init and a.metadata.get("omit_default"))


def required_field_names(cls: type[Any]) -> tuple[str, ...]:
    """The init fields of an attrs class that have no default (a file must give them)."""
    return tuple(a.name for a in attrs.fields(cls) if a.init and a.default is attrs.NOTHING)


def optional_inner(tp: Any) -> Any | None:
    """``X`` when ``tp`` is ``X | None`` (or ``Optional[X]``), else ``None``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [t for t in typing.get_args(tp) if t is not type(None)]
        if len(args) == 1:
            return args[0]
    return None


def field_types(cls: type[Any]) -> dict[str, Any]:
    """Each init field's declared type, ``X | None`` reduced to ``X``."""
    hints = typing.get_type_hints(cls)
    return {
        a.name: optional_inner(hints[a.name]) or hints[a.name] for a in attrs.fields(cls) if a.init
    }


def missing_keys(table: Mapping[str, Any], required: Collection[str]) -> list[str]:
    """The required keys ``table`` lacks, in ``required``'s order."""
    return [key for key in required if key not in table]


def unknown_keys(table: Mapping[str, Any], allowed: Collection[str]) -> list[str]:
    """The keys of ``table`` that ``allowed`` does not name, in the table's order."""
    return [key for key in table if key not in allowed]


def closest_key(key: str, allowed: Collection[str]) -> str | None:
    """The allowed key ``key`` is most likely a misspelling of, if any."""
    close = difflib.get_close_matches(key, list(allowed), n=1, cutoff=0.6)
    return close[0] if close else None


def is_str(value: Any) -> TypeGuard[str]:
    return isinstance(value, str)


def is_int(value: Any) -> TypeGuard[int]:
    """An integer, and not a bool (``true`` is no head size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_bool(value: Any) -> TypeGuard[bool]:
    return isinstance(value, bool)


def is_str_list(value: Any) -> TypeGuard[list[str]]:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def is_table(value: Any) -> TypeGuard[Mapping[str, Any]]:
    return isinstance(value, Mapping)


#: the checks a loader picks from by a field's kind
CHECKS: dict[str, Callable[[Any], bool]] = {
    "integer": is_int,
    "string": is_str,
    "boolean": is_bool,
    "array of strings": is_str_list,
    "table": is_table,  # issue 23: a layer's backend_options
}
