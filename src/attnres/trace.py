"""Trace records, the Trace itself, its canonical JSON and digest, dump and load.

A trace is data: the full input of one resolution (layer, selection config,
scope snapshot, platform facts, per-layer backend), the ordered records the
machine emitted, the outcome, and a schema version. Its digest is the SHA-256
of its canonical JSON (sorted keys, two-space indent, trailing newline) without
the digest field. Nothing in a trace differs between two runs of the same
input: no timestamps, addresses or ids. ``docs/trace-format.md`` documents the
schema.

One cattrs converter (``_CONVERTER``) turns traces into JSON documents and back.
Its structuring hooks are strict: every field must be present and of its JSON
type (no ``"64"`` for ``64``, no ``"false"`` for ``false``), every closed
vocabulary (states, events, origins, checks, codes, reasons, platform kinds)
is checked, and the first problem becomes a :class:`TraceFormatError` whose
message names the file and the JSON path (``traces/x.json:
$.input.layer.head_size: expected an integer, got the string "64"``).

Loading a trace reads JSON and looks backend names up in the registry; it never
imports a module, unpickles, or evaluates anything. A backend name must look
like one (letters, digits, ``_``, ``-``) before the registry is even asked, so a
name such as ``os:system`` is an error, never an import path.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
import os
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Union

import attrs
import cattrs
from attrs import field, frozen

from attnres._codec import (
    field_names,
    is_bool,
    is_int,
    is_str,
    missing_keys,
    optional_field_names,
    unknown_keys,
)
from attnres._files import atomic_write_text, read_bounded
from attnres._outcome import Outcome
from attnres._states import (
    Check,
    Code,
    Event,
    Origin,
    PackageStatus,
    Reason,
    State,
    Status,
    Verdict,
    optional_reason,
)
from attnres._vocab import PLATFORM_KINDS, Requirement, Role, normalize_dtype
from attnres.backends import Backend
from attnres.errors import TraceFormatError, UnknownBackendError
from attnres.layer import (
    LayerSpec,
    Requirements,
    SelectionConfig,
    optional_backend,
    split_component_key,
)
from attnres.layout import SequenceLayout
from attnres.platform import PackageFact, Platform
from attnres.scope import ScopeState

__all__ = [
    "BASE_SCHEMA_VERSION",
    "KERNELS_SCHEMA_VERSION",
    "LAYOUT_SCHEMA_VERSION",
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "TUNED_SCHEMA_VERSION",
    "CheckRecord",
    "Failure",
    "MeasurementRecord",
    "OriginRecord",
    "Outcome",
    "Record",
    "RejectedRecord",
    "SelectedRecord",
    "SkipRecord",
    "Trace",
    "TraceInput",
    "TransitionRecord",
    "TuningRecord",
    "atomic_write_text",
    "canonical_json",
    "dump_trace",
    "field_names",
    "load_trace",
    "record_to_dict",
    "trace_from_dict",
    "trace_from_json",
    "trace_to_dict",
]

#: The newest schema version this attnres reads. Bumped when a field is added,
#: removed, renamed or changes meaning (docs/trace-format.md). A trace is
#: written with the lowest version that can express it: a rule-based resolution
#: is version 2 (the backward requirement), a tuned one is version 3, one whose
#: input carries the process's kernel facts (``no_kernel``) version 4, one whose
#: layer has a sequence-parallel layout version 5 (issue 24).
SCHEMA_VERSION = 5
#: The version of a trace that holds autotune records (tuning, measurement).
TUNED_SCHEMA_VERSION = 3
#: The version of a trace whose input records which backends had no kernel.
KERNELS_SCHEMA_VERSION = 4
#: The version of a rule-based trace.
BASE_SCHEMA_VERSION = 2
#: Issue 24: the version of a trace whose layer has a sequence-parallel layout
#: (``input.layer.layout``, the ``layout`` check and its codes); it holds what
#: version 4 holds too. Such a layer is never autotuned.
LAYOUT_SCHEMA_VERSION = 5

#: The requirement keys of a schema-1 trace (attnres 0.1): later requirements
#: did not exist, so such a trace reads them as false, and its digest is computed
#: over the keys it has.
_SCHEMA_1_REQUIREMENTS: tuple[str, ...] = ("causal", "attn_mask", "packed_varlen", "gqa", "dropout")


@frozen
class Failure:
    """One failed check: a machine-readable code and a message for people."""

    code: Code = field(converter=Code)
    message: str


@frozen
class OriginRecord:
    """Origin detection: where the requested backend came from, and how strict."""

    origin: Origin
    backend: Backend | None
    strict: bool
    detail: str
    kind: str = field(default="origin", init=False)


@frozen
class TransitionRecord:
    """One transition of the machine (``source --event--> target``)."""

    source: State
    event: Event
    target: State
    candidate: Backend | None = None
    reason: Reason | None = field(default=None, converter=optional_reason)
    kind: str = field(default="transition", init=False)


@frozen
class CheckRecord:
    """One check of one candidate at one stage; ``failures`` empty when it passed."""

    stage: State
    candidate: Backend
    check: Check
    passed: bool
    failures: tuple[Failure, ...] = ()
    kind: str = field(default="check", init=False)


@frozen
class SkipRecord:
    """A candidate not evaluated again (already evaluated at an earlier stage)."""

    stage: State
    candidate: Backend
    detail: str
    kind: str = field(default="skip", init=False)


@frozen
class SelectedRecord:
    """Terminal: the backend chosen, its origin and reason."""

    backend: Backend
    origin: Origin
    reason: Reason | None = field(converter=optional_reason)
    kind: str = field(default="selected", init=False)


@frozen
class RejectedRecord:
    """Terminal: no backend could serve the layer."""

    origin: Origin
    code: Code = field(converter=Code)
    error: str
    kind: str = field(default="rejected", init=False)


@frozen
class TuningRecord:
    """Autotune starts on a selected automatic decision (schema version 3).

    ``call`` describes the real inputs the candidates ran on; ``elements`` is
    the query's element count; ``margin`` and ``tolerance`` are the rule's
    parameters (a candidate must be faster than the incumbent by more than
    ``margin``, relative, and deviate from it by at most ``tolerance``,
    relative); ``warmup`` and ``repeats`` say how each candidate was timed;
    ``considered`` lists the backends the tuner checked (the registry of the
    recording process, in catalogue order); ``source`` is ``measured`` (timed
    in this process) or ``loaded`` (from a results file); ``detail`` says where
    the numbers come from and notes loaded results that were ignored, and why.
    """

    call: str
    elements: int
    margin: float
    tolerance: float
    warmup: int
    repeats: int
    considered: tuple[Backend, ...]
    source: str
    detail: str
    kind: str = field(default="tuning", init=False)


@frozen
class MeasurementRecord:
    """One candidate timed on the real inputs (schema version 3).

    ``median_ns`` and ``spread_ns`` (max - min) summarise its timed repeats, in
    nanoseconds; ``deviation`` is the largest absolute difference from the
    incumbent's output divided by the incumbent's largest magnitude (``null``
    for the incumbent itself, for a candidate that raised, and for an output
    that is not finite); ``error`` is the exception a candidate raised
    (``null`` when it ran). ``verdict`` follows from these facts and the
    tuning record's margin and tolerance by one rule (:mod:`attnres.tuning`),
    which replay applies again.
    """

    candidate: Backend
    median_ns: int | None
    spread_ns: int | None
    deviation: float | None
    error: str | None
    verdict: Verdict
    kind: str = field(default="measurement", init=False)


Record = (
    OriginRecord
    | TransitionRecord
    | CheckRecord
    | SkipRecord
    | SelectedRecord
    | RejectedRecord
    | TuningRecord
    | MeasurementRecord
)
RECORD_KINDS: dict[str, type[Any]] = {
    "origin": OriginRecord,
    "transition": TransitionRecord,
    "check": CheckRecord,
    "skip": SkipRecord,
    "selected": SelectedRecord,
    "rejected": RejectedRecord,
    "tuning": TuningRecord,
    "measurement": MeasurementRecord,
}
#: Record kinds, states and events that need schema version 3 (autotune).
_TUNED_KINDS = frozenset({"tuning", "measurement"})
_TUNED_STATES = frozenset({State.MEASURING})
_TUNED_EVENTS = frozenset({Event.MEASURE, Event.MEASURED_FASTER, Event.INCUMBENT_KEPT})


def _input_backend(value: Backend | str | None) -> Backend | None:
    return optional_backend("backend")(value)


@frozen(cache_hash=True)
class TraceInput:
    """Everything a resolution depends on."""

    layer: LayerSpec
    config: SelectionConfig
    scope: ScopeState | None
    platform: Platform
    #: the backend passed explicitly for this one layer (a name is parsed)
    backend: Backend | None = field(default=None, converter=_input_backend)
    #: the backend one request asked for (attnres.request_backend; origin
    #: ``request``); written to JSON only when set, so older traces keep their bytes
    request: Backend | None = field(
        default=None, converter=_input_backend, metadata={"omit_default": True}
    )
    #: the layer will run (``attnres.Attention``): a backend with no kernel in
    #: this process fails the ``available`` check (code ``no_kernel``). Written
    #: to a trace only when true (older traces, and plans, omit it).
    needs_kernel: bool = field(default=False, kw_only=True, metadata={"omit_default": True})
    #: with ``needs_kernel``: the registered backends that had no kernel in the
    #: process that resolved (sorted names), so the ``available`` check reads
    #: the trace, never the replaying process (schema 4). ``None`` in older
    #: traces: their replay reads this process's kernel registry.
    no_kernel: tuple[str, ...] | None = field(
        default=None, kw_only=True, metadata={"omit_default": True}
    )

    def schema_version(self) -> int:
        """The lowest schema version that can express this input."""
        if self.layer.layout is not None:  # issue 24: a sequence-parallel layout
            return LAYOUT_SCHEMA_VERSION
        return BASE_SCHEMA_VERSION if self.no_kernel is None else KERNELS_SCHEMA_VERSION


@frozen
class Trace:
    """The ordered, typed records of one resolution, with its full input."""

    input: TraceInput
    records: tuple[Record, ...]
    outcome: Outcome
    schema_version: int = BASE_SCHEMA_VERSION

    @functools.cached_property
    def digest(self) -> str:
        """Hex SHA-256 of the canonical JSON of the trace (without the digest)."""
        body = canonical_json(_CONVERTER.unstructure(self))
        return hashlib.sha256(body.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return trace_to_dict(self)

    def to_json(self) -> str:
        return canonical_json(trace_to_dict(self))


# =============================================================================
# Canonical JSON
# =============================================================================


def canonical_json(obj: Any) -> str:
    """Sorted keys, two-space indent, ``": "`` separators, UTF-8 text, trailing newline.

    A lone surrogate (a non-UTF-8 path decoded with ``surrogateescape``) has no
    UTF-8 form: it is written as its JSON escape (``\\udcff``), which loads back
    as the same string, so every trace has a digest and a file.
    """
    text = json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# =============================================================================
# Structuring errors: a message and the JSON path it applies to
# =============================================================================


class _Invalid(Exception):
    """A value that is not what the schema says, at ``path`` (relative, ``.a[0].b``)."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(message)
        self.path = path
        self.message = message


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _key_path(key: str) -> str:
    """The JSON-path step for an object key: ``.name`` or ``["odd key"]``."""
    return f".{key}" if _IDENT.fullmatch(key) else f"[{json.dumps(key, ensure_ascii=True)}]"


def _got(value: Any) -> str:
    """A short, printable, unambiguous description of a JSON value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=True)
        if len(text) > 60:
            text = text[:56] + '..."'
        return f"the string {text}"
    if isinstance(value, list):
        return f"a list of {len(value)} item{'' if len(value) == 1 else 's'}"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def _locate(exc: BaseException) -> tuple[str, str]:
    """The relative path and message of the first leaf failure inside ``exc``."""
    if isinstance(exc, _Invalid):
        return exc.path, exc.message
    if isinstance(exc, cattrs.ClassValidationError):  # defensive: hooks here never make these
        with_notes, without = exc.group_exceptions()
        if with_notes:
            sub, note = with_notes[0]
            inner, message = _locate(sub)
            return _key_path(note.name) + inner, message
        if without:
            return _locate(without[0])
    if isinstance(exc, cattrs.IterableValidationError):
        with_idx, without = exc.group_exceptions()
        if with_idx:
            sub, idx_note = with_idx[0]
            inner, message = _locate(sub)
            return f"[{idx_note.index}]" + inner, message
        if without:
            return _locate(without[0])
    return "", str(exc) or type(exc).__name__


def _one_line(text: str) -> str:
    return " ".join(text.split())


# =============================================================================
# Strict structuring hooks (JSON -> attrs), all on one converter
# =============================================================================

#: What a backend name in a trace may look like before the registry is asked.
_BACKEND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")

_NONE_TYPE = type(None)


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid("", f"{what} must be a JSON object, got {_got(value)}")
    return value


def _exact_keys(
    value: dict[str, Any],
    keys: typing.Collection[str],
    what: str,
    optional: typing.Collection[str] = (),
) -> None:
    """Every key of ``keys`` present, and nothing else but ``optional`` keys."""
    known = sorted({*keys, *optional})
    for key in missing_keys(value, sorted(keys)):
        raise _Invalid(_key_path(key), f"missing field ({what} has: {', '.join(known)})")
    for key in sorted(unknown_keys(value, known)):
        raise _Invalid(_key_path(key), f"unexpected field ({what} has: {', '.join(known)})")


def _structure_str(value: Any, _: Any = None) -> str:
    if not is_str(value):
        raise _Invalid("", f"expected a string, got {_got(value)}")
    return value


def _structure_int(value: Any, _: Any = None) -> int:
    if not is_int(value):
        raise _Invalid("", f"expected an integer, got {_got(value)}")
    return value


def _structure_float(value: Any, _: Any = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid("", f"expected a number, got {_got(value)}")
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):  # pragma: no cover
        raise _Invalid("", f"expected a finite number, got {value!r}")
    return number


def _structure_bool(value: Any, _: Any = None) -> bool:
    if not is_bool(value):
        raise _Invalid("", f"expected true or false, got {_got(value)}")
    return value


def _structure_backend(value: Any, _: Any = None) -> Backend:
    """A backend by name, from the registry only (never an import path)."""
    if not isinstance(value, str):
        raise _Invalid("", f"expected a backend name (a string), got {_got(value)}")
    if not _BACKEND_NAME.fullmatch(value):
        raise _Invalid(
            "",
            f"{_got(value)} is not a backend name (names are letters, digits, '_' and '-'; "
            f"a trace names registered backends, never code to import)",
        )
    try:
        return Backend.parse(value)
    except UnknownBackendError as exc:
        raise _Invalid("", f"{exc} (a trace can only name registered backends)") from None


def _structure_enum(cls: type[enum.Enum]) -> Callable[[Any, Any], Any]:
    values = [str(m.value) for m in cls]
    what = {
        State: "state",
        Event: "event",
        Origin: "origin",
        Check: "check",
        Code: "code",
        Reason: "reason",
        Status: "outcome status",
        PackageStatus: "package status",
        Verdict: "verdict",
    }.get(cls, cls.__name__)
    shown = ", ".join(json.dumps(v) if " " in v else v for v in values)

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, str):
            raise _Invalid("", f"expected a {what} name (a string), got {_got(value)}")
        try:
            return cls(value)
        except ValueError:
            raise _Invalid(
                "",
                f"unknown {what} {json.dumps(value, ensure_ascii=True)}; "
                f"expected one of: {shown}",
            ) from None

    return structure


def _one_of(
    what: str, allowed: typing.Iterable[str], optional: bool = False
) -> Callable[[Any], str | None]:
    names = list(allowed)

    def check(value: Any) -> str | None:
        if value is None and optional:
            return None
        if value not in names:
            shown = json.dumps(value, ensure_ascii=True) if isinstance(value, str) else _got(value)
            return (
                f"unknown {what} {shown}; expected one of: "
                + ", ".join(json.dumps(n) if " " in n else n for n in names)
                + (" or null" if optional else "")
            )
        return None

    return check


def _at_least(
    what: str, low: float, optional: bool = False
) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if value is None:
            return None if optional else f"{what} must not be null"
        return None if value >= low else f"{what} must be at least {low}, got {value!r}"

    return check


def _fraction(what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if 0 <= value < 1:
            return None
        return f"{what} is a fraction in [0, 1) (0.02 is 2%), got {value!r}"

    return check


#: Closed vocabularies checked after a field's JSON type (class, field) -> check.
_FIELD_CHECKS: dict[tuple[type[Any], str], Callable[[Any], str | None]] = {}


def _optional_inner(tp: Any) -> Any | None:
    """``X`` when ``tp`` is ``X | None`` (or ``Optional[X]``), else ``None``."""
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        args = [a for a in typing.get_args(tp) if a is not _NONE_TYPE]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _structure_at(conv: cattrs.Converter, value: Any, tp: Any, path: str) -> Any:
    """Structure ``value`` as ``tp``; failures come out as ``_Invalid`` under ``path``."""
    try:
        inner = _optional_inner(tp)
        if inner is not None:
            return None if value is None else conv.structure(value, inner)
        if value is None:
            raise _Invalid("", f"expected {_expected(tp)}, got null")
        return conv.structure(value, tp)
    except _Invalid as exc:
        raise _Invalid(path + exc.path, exc.message) from None
    except Exception as exc:
        inner_path, message = _locate(exc)
        raise _Invalid(path + inner_path, message) from None


def _expected(tp: Any) -> str:
    if tp is str:
        return "a string"
    if tp is int:
        return "an integer"
    if tp is bool:
        return "true or false"
    if tp is float:
        return "a number"
    if typing.get_origin(tp) is tuple:
        return "a list"
    if tp is Backend:
        return "a backend name"
    return "an object" if attrs.has(tp) else "a value"


def _is_tuple_type(tp: Any) -> bool:
    return typing.get_origin(tp) is tuple


def _is_homogeneous_tuple(tp: Any) -> bool:
    args = typing.get_args(tp)
    return typing.get_origin(tp) is tuple and len(args) == 2 and args[1] is Ellipsis


def _make_tuple_hook(conv: cattrs.Converter, tp: Any) -> Callable[[Any, Any], Any]:
    if _is_homogeneous_tuple(tp):
        item = typing.get_args(tp)[0]

        def structure_many(value: Any, _: Any) -> tuple[Any, ...]:
            if not isinstance(value, list):
                raise _Invalid("", f"expected a list, got {_got(value)}")
            return tuple(_structure_at(conv, v, item, f"[{i}]") for i, v in enumerate(value))

        return structure_many
    items = typing.get_args(tp)

    def structure_fixed(value: Any, _: Any) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) != len(items):
            raise _Invalid("", f"expected a list of {len(items)} items, got {_got(value)}")
        return tuple(
            _structure_at(conv, v, t, f"[{i}]")
            for i, (v, t) in enumerate(zip(value, items, strict=True))
        )

    return structure_fixed


def _make_attrs_hook(
    conv: cattrs.Converter,
    cls: type[Any],
    what: str,
    tag: str | None = None,
    optional: typing.Collection[str] = (),
) -> Callable[[Any, Any], Any]:
    """A strict hook for an attrs class: every init field present, typed, checked
    (``optional`` fields may be absent: they keep their default)."""
    fields = [a for a in attrs.fields(attrs.resolve_types(cls)) if a.init]
    optional = {*optional, *(a.name for a in fields if a.metadata.get("omit_default"))}
    keys = [a.name for a in fields if a.name not in optional] + ([] if tag is None else ["kind"])

    def structure(value: Any, _: Any) -> Any:
        obj = _object(value, what)
        _exact_keys(obj, keys, what, optional)
        kwargs: dict[str, Any] = {}
        for a in fields:
            if a.name not in obj:  # an omitted optional field: its default
                continue
            path = _key_path(a.name)
            v = _structure_at(conv, obj[a.name], a.type, path)
            check = _FIELD_CHECKS.get((cls, a.name))
            problem = None if check is None else check(v)
            if problem is not None:
                raise _Invalid(path, problem)
            kwargs[a.name] = v
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise _Invalid("", f"not a valid {what}: {exc}") from None

    return structure


_LAYER_KEYS = field_names(LayerSpec)
_CONFIG_KEYS = field_names(SelectionConfig)
_SCOPE_KEYS = field_names(ScopeState)


def _field(obj: dict[str, Any], key: str, fn: Callable[[Any], Any]) -> Any:
    try:
        return fn(obj[key])
    except _Invalid as exc:
        raise _Invalid(_key_path(key) + exc.path, exc.message) from None


def _optional(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else fn(v)


def _backend_list(value: Any) -> list[Backend]:
    if not isinstance(value, list):
        raise _Invalid("", f"expected a list of backend names or null, got {_got(value)}")
    if not value:
        raise _Invalid("", "an empty supported set admits no backend; use null for no constraint")
    out: list[Backend] = []
    for i, item in enumerate(value):
        try:
            out.append(_structure_backend(item))
        except _Invalid as exc:
            raise _Invalid(f"[{i}]" + exc.path, exc.message) from None
    return out


def _backend_map(value: Any, key_check: Callable[[str], str | None]) -> dict[str, Backend]:
    obj = _object(value, "this mapping")
    out: dict[str, Backend] = {}
    for key in sorted(obj):
        problem = key_check(key)
        if problem is not None:
            raise _Invalid(_key_path(key), problem)
        out[key] = _field(obj, key, _structure_backend)
    return out


def _head_size(value: Any) -> int:
    n = _structure_int(value)
    if n < 1:
        raise _Invalid("", f"a head size must be at least 1, got {n}")
    return n


def _dtype(value: Any) -> str:
    text = _structure_str(value)
    try:
        return normalize_dtype(text)
    except ValueError as exc:
        raise _Invalid("", str(exc).removeprefix("dtype: ")) from None


def _role(value: Any) -> Role:
    text = _structure_str(value)
    try:
        return Role(text)
    except ValueError:
        raise _Invalid("", f"unknown role {json.dumps(text)}; expected self or cross") from None


def _requirements(value: Any) -> Requirements:
    obj = _object(value, "requirements")
    names = [r.value for r in Requirement]
    if set(obj) != set(_SCHEMA_1_REQUIREMENTS):  # (which set a version needs: _structure_trace)
        _exact_keys(obj, names, "requirements")
    flags = {name: _field(obj, name, _structure_bool) for name in obj}
    return Requirements(**flags)


def _check_requirement_keys(doc: dict[str, Any], version: int) -> None:
    """A schema-1 trace has the 0.1 requirement keys; a later one has every key."""
    try:
        obj = doc["input"]["layer"]["requirements"]
    except (KeyError, TypeError):
        return  # structuring reports the missing or malformed part, with its path
    if not isinstance(obj, dict):
        return
    keys = _SCHEMA_1_REQUIREMENTS if version == 1 else [r.value for r in Requirement]
    try:
        _exact_keys(obj, keys, f"requirements in schema version {version}")
    except _Invalid as exc:
        raise _Invalid(".input.layer.requirements" + exc.path, exc.message) from None


def _structure_layer(value: Any, _: Any) -> LayerSpec:
    obj = _object(value, "a layer")
    _exact_keys(obj, _LAYER_KEYS, "a layer", ("layout",))
    return LayerSpec(
        head_size=_field(obj, "head_size", _head_size),
        dtype=_field(obj, "dtype", _dtype),
        supported=_field(obj, "supported", _optional(_backend_list)),
        default=_field(obj, "default", _optional(_structure_backend)),
        role=_field(obj, "role", _role),
        requirements=_field(obj, "requirements", _requirements),
        name=_field(obj, "name", _optional(_structure_str)),
        # issue 24: present only in traces of a sequence-parallel layer
        layout=_field(obj, "layout", _layout) if "layout" in obj else None,
    )


_LAYOUT_KEYS = ("ulysses", "ring", "num_heads", "num_kv_heads")


def _layout(value: Any) -> SequenceLayout:
    """A layer's sequence-parallel layout (issue 24): degrees and head counts."""
    obj = _object(value, "a layout")
    _exact_keys(obj, _LAYOUT_KEYS, "a layout")
    degrees = {key: _field(obj, key, _head_size) for key in ("ulysses", "ring")}
    heads = {
        key: _field(obj, key, _optional(_head_size)) for key in ("num_heads", "num_kv_heads")
    }
    return SequenceLayout(**degrees, **heads)


def _unstructure_layout(layout: SequenceLayout) -> dict[str, Any]:
    return {
        "ulysses": layout.ulysses,
        "ring": layout.ring,
        "num_heads": layout.num_heads,
        "num_kv_heads": layout.num_kv_heads,
    }


def _component_name(key: str) -> str | None:
    if not key:
        return "a component name must not be empty"
    try:
        component, role = split_component_key(key)
    except ValueError as exc:
        return str(exc)
    canonical = component if role is None else f"{component}.{role.value}"
    if canonical != key:
        return (
            f"component name {json.dumps(key)} is not normalised "
            f"(expected {json.dumps(canonical)})"
        )
    return None


def _role_name(key: str) -> str | None:
    return (
        None
        if key in ("self", "cross")
        else (f"unknown role {json.dumps(key)}; expected self or cross")
    )


def _structure_config(value: Any, _: Any) -> SelectionConfig:
    obj = _object(value, "a selection config")
    _exact_keys(obj, _CONFIG_KEYS, "a selection config", optional_field_names(SelectionConfig))
    env = _field(obj, "global_backend_env", _structure_str) if "global_backend_env" in obj else None
    try:
        return SelectionConfig(
            global_backend=_field(obj, "global_backend", _optional(_structure_backend)),
            global_backend_explicit=_field(obj, "global_backend_explicit", _structure_bool),
            forced_backend=_field(obj, "forced_backend", _optional(_structure_backend)),
            component_backends=_field(
                obj, "component_backends", lambda v: _backend_map(v, _component_name)
            ),
            global_backend_env=env,
        )
    except ValueError as exc:
        raise _Invalid("", f"not a valid selection config: {exc}") from None


def _structure_scope(value: Any, _: Any) -> ScopeState:
    obj = _object(value, "a scope")
    _exact_keys(obj, _SCOPE_KEYS, "a scope")
    roles = _field(obj, "role_backends", lambda v: _backend_map(v, _role_name))
    return ScopeState(
        component=_field(obj, "component", _structure_str),
        kind=_field(obj, "kind", _structure_str),
        loader=_field(obj, "loader", _structure_str),
        backend=_field(obj, "backend", _optional(_structure_backend)),
        role_backends=tuple(sorted(((Role(r), b) for r, b in roles.items()), key=_role_key)),
        allow_global_fallback=_field(obj, "allow_global_fallback", _structure_bool),
        require_selection=_field(obj, "require_selection", _structure_bool),
    )


def _role_key(pair: tuple[Role, Backend]) -> str:
    return pair[0].value


# =============================================================================
# The converter
# =============================================================================


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)

    # -- unstructure (attrs -> JSON) ------------------------------------------
    conv.register_unstructure_hook(Backend, lambda b: b.name)

    def unstructure_backend_set(value: frozenset[Backend] | None) -> list[str] | None:
        return None if value is None else sorted(b.name for b in value)

    def unstructure_layer(s: LayerSpec) -> dict[str, Any]:
        out: dict[str, Any] = {
            "head_size": s.head_size,
            "dtype": s.dtype,
            "supported": unstructure_backend_set(s.supported),
            "default": None if s.default is None else s.default.name,
            "role": s.role.value,
            "requirements": conv.unstructure(s.requirements),
            "name": s.name,
        }
        if s.layout is not None:  # issue 24: absent otherwise, older traces keep their bytes
            out["layout"] = _unstructure_layout(s.layout)
        return out

    conv.register_unstructure_hook(LayerSpec, unstructure_layer)
    def unstructure_config(c: SelectionConfig) -> dict[str, Any]:
        out: dict[str, Any] = {
            "global_backend": None if c.global_backend is None else c.global_backend.name,
            "global_backend_explicit": c.global_backend_explicit,
            "forced_backend": None if c.forced_backend is None else c.forced_backend.name,
            "component_backends": {n: b.name for n, b in c.component_backends},
        }
        if c.global_backend_env is not None:  # absent otherwise: older traces keep their bytes
            out["global_backend_env"] = c.global_backend_env
        return out

    conv.register_unstructure_hook(SelectionConfig, unstructure_config)

    conv.register_unstructure_hook(
        ScopeState,
        lambda s: {
            "component": s.component,
            "kind": s.kind,
            "loader": s.loader,
            "backend": None if s.backend is None else s.backend.name,
            "role_backends": {r.value: b.name for r, b in s.role_backends},
            "allow_global_fallback": s.allow_global_fallback,
            "require_selection": s.require_selection,
        },
    )
    for cls in RECORD_KINDS.values():
        conv.register_unstructure_hook(cls, _record_unstructurer(conv, cls))
    conv.register_unstructure_hook(TraceInput, _record_unstructurer(conv, TraceInput))

    def unstructure_record(rec: Any) -> dict[str, Any]:
        out: dict[str, Any] = conv.unstructure(rec, unstructure_as=type(rec))
        return out

    def unstructure_trace(t: Trace) -> dict[str, Any]:
        inp = conv.unstructure(t.input)
        if t.schema_version == 1:  # as attnres 0.1 wrote it: its digest covers these keys
            flags = inp["layer"]["requirements"]
            for key in [k for k in flags if k not in _SCHEMA_1_REQUIREMENTS]:
                if not flags[key]:
                    del flags[key]
        return {
            "schema_version": t.schema_version,
            "input": inp,
            "records": [unstructure_record(r) for r in t.records],
            "outcome": conv.unstructure(t.outcome),
        }

    conv.register_unstructure_hook(Trace, unstructure_trace)

    # -- structure (JSON -> attrs), strict -------------------------------------
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(float, _structure_float)
    conv.register_structure_hook(Backend, _structure_backend)
    for enum_cls in (State, Event, Origin, Check, Code, Reason, Status, PackageStatus, Verdict):
        conv.register_structure_hook(enum_cls, _structure_enum(enum_cls))
    conv.register_structure_hook_factory(_is_tuple_type, lambda t: _make_tuple_hook(conv, t))
    conv.register_structure_hook(LayerSpec, _structure_layer)
    conv.register_structure_hook(SelectionConfig, _structure_config)
    conv.register_structure_hook(ScopeState, _structure_scope)
    for cls, what in (
        (TraceInput, "a trace input"),
        (Outcome, "an outcome"),
        (Platform, "a platform"),
        (PackageFact, "a package fact"),
        (Failure, "a failure"),
    ):
        conv.register_structure_hook(cls, _make_attrs_hook(conv, cls, what))
    record_hooks = {
        kind: _make_attrs_hook(conv, cls, f"a {kind!r} record", tag=kind)
        for kind, cls in RECORD_KINDS.items()
    }

    def structure_record(value: Any, _: Any) -> Any:
        obj = _object(value, "a record")
        if "kind" not in obj:
            raise _Invalid(".kind", "missing field (every record is tagged by its kind)")
        kind = obj["kind"]
        if not isinstance(kind, str) or kind not in record_hooks:
            raise _Invalid(
                ".kind",
                f"unknown record kind {json.dumps(kind, ensure_ascii=True)}; known kinds: "
                + ", ".join(RECORD_KINDS),
            )
        return record_hooks[kind](obj, None)

    conv.register_structure_hook_func(lambda t: bool(t == Record), structure_record)
    return conv


def _record_unstructurer(conv: cattrs.Converter, cls: type[Any]) -> Callable[[Any], Any]:
    """Every field, in order; a field marked ``omit_default`` only when not its default."""
    fields = attrs.fields(cls)
    names = [a.name for a in fields if not a.metadata.get("omit_default")]
    omissible = [(a.name, a.default) for a in fields if a.metadata.get("omit_default")]

    def unstructure(rec: Any) -> dict[str, Any]:
        out = {n: conv.unstructure(getattr(rec, n)) for n in names}
        for name, default in omissible:
            value = getattr(rec, name)
            if value != default:
                out[name] = conv.unstructure(value)
        return out

    return unstructure


_FIELD_CHECKS.update(
    {
        # a platform kind is a closed list of names, not an enum (yet)
        (Platform, "kind"): _one_of("platform kind", PLATFORM_KINDS),
        (TuningRecord, "source"): _one_of("tuning source", ("measured", "loaded")),
        (TuningRecord, "margin"): _fraction("margin"),
        (TuningRecord, "tolerance"): _fraction("tolerance"),
        (TuningRecord, "elements"): _at_least("elements", 0),
        (TuningRecord, "warmup"): _at_least("warmup", 0),
        (TuningRecord, "repeats"): _at_least("repeats", 1),
        (MeasurementRecord, "median_ns"): _at_least("median_ns", 0, optional=True),
        (MeasurementRecord, "spread_ns"): _at_least("spread_ns", 0, optional=True),
        (MeasurementRecord, "deviation"): _at_least("deviation", 0, optional=True),
    }
)

_CONVERTER = _make_converter()



# =============================================================================
# Documents: trace <-> dict <-> text <-> file
# =============================================================================

_TOP_KEYS = ("schema_version", "input", "records", "outcome", "digest")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """The JSON document of a trace, digest included."""
    doc: dict[str, Any] = _CONVERTER.unstructure(trace)
    doc["digest"] = trace.digest
    return doc


def record_to_dict(record: Record) -> dict[str, Any]:
    """One record as its JSON object (``kind`` included)."""
    out: dict[str, Any] = _CONVERTER.unstructure(record, unstructure_as=type(record))
    return out


def _format_error(source: str, where: str, message: str) -> TraceFormatError:
    return TraceFormatError(_one_line(f"{source}: {where}: {message}"), source, where)


def trace_from_dict(doc: Any, *, source: str = "<trace>") -> Trace:
    """Rebuild a trace from its JSON document; :class:`TraceFormatError` if invalid.

    The error's message is one line: ``SOURCE: JSONPATH: what is wrong``; its
    ``.path`` is ``source`` and its ``.where`` the JSON path.
    """
    try:
        return _structure_trace(doc)
    except _Invalid as exc:
        raise _format_error(source, "$" + exc.path, exc.message) from None


def _structure_trace(doc: Any) -> Trace:
    if not isinstance(doc, dict):
        raise _Invalid("", f"a trace must be a JSON object, got {_got(doc)}")
    if "schema_version" not in doc:
        raise _Invalid(".schema_version", "missing field; this is not an attnres trace")
    version = doc["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise _Invalid(".schema_version", f"expected an integer, got {_got(version)}")
    if version > SCHEMA_VERSION:
        raise _Invalid(
            ".schema_version",
            f"schema version {version} is newer than this attnres reads (up to "
            f"{SCHEMA_VERSION}); upgrade attnres to read this trace",
        )
    if version < 1:
        raise _Invalid(".schema_version", f"unsupported schema version {version}")
    _exact_keys(doc, _TOP_KEYS, "a trace")
    _check_requirement_keys(doc, version)
    inp = _structure_at(_CONVERTER, doc["input"], TraceInput, ".input")
    records_doc = doc["records"]
    if not isinstance(records_doc, list):
        raise _Invalid(".records", f"expected a list of records, got {_got(records_doc)}")
    if not records_doc:
        raise _Invalid(".records", "a trace has at least one record (origin detection)")
    records = tuple(
        _structure_at(_CONVERTER, r, Record, f".records[{i}]") for i, r in enumerate(records_doc)
    )
    if version < TUNED_SCHEMA_VERSION:
        _check_base_version(records, version)
    outcome = _structure_at(_CONVERTER, doc["outcome"], Outcome, ".outcome")
    if version < KERNELS_SCHEMA_VERSION and inp.no_kernel is not None:
        raise _Invalid(
            ".input.no_kernel",
            f"the input's kernel facts belong to schema version {KERNELS_SCHEMA_VERSION}, but "
            f"the file says version {version}: the file was edited or corrupted",
        )
    if version < TUNED_SCHEMA_VERSION and outcome.reason == Reason.MEASURED_FASTER.value:
        raise _Invalid(
            ".outcome.reason", _needs_tuned_version("the reason 'measured faster'", version)
        )
    if version < LAYOUT_SCHEMA_VERSION and inp.layer.layout is not None:
        raise _Invalid(
            ".input.layer.layout",
            f"a sequence-parallel layout belongs to schema version {LAYOUT_SCHEMA_VERSION}, "
            f"but the file says version {version}",
        )
    trace = Trace(input=inp, records=records, outcome=outcome, schema_version=version)
    digest = doc["digest"]
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise _Invalid(
            ".digest",
            f"expected a SHA-256 hex digest (64 lower-case hex digits), got {_got(digest)}",
        )
    if digest != trace.digest:
        raise _Invalid(
            ".digest",
            f"recorded digest {digest[:12]}... does not match the content "
            f"(sha256 {trace.digest[:12]}...): the file was edited by hand or corrupted; "
            f"regenerate it (make golden for traces/, or re-run the command that wrote it)",
        )
    return trace


def _needs_tuned_version(what: str, version: int) -> str:
    return (
        f"{what} belongs to schema version {TUNED_SCHEMA_VERSION} (autotune), but the file "
        f"says version {version}"
    )


def _check_base_version(records: tuple[Any, ...], version: int) -> None:
    """A trace older than version 3 holds no autotune record, state, event or reason."""

    def fail(where: str, what: str) -> _Invalid:
        return _Invalid(where, _needs_tuned_version(what, version))

    for i, record in enumerate(records):
        at = f".records[{i}]"
        if record.kind in _TUNED_KINDS:
            raise fail(at + ".kind", f"a {record.kind!r} record")
        if isinstance(record, TransitionRecord):
            if record.event in _TUNED_EVENTS:
                raise fail(at + ".event", f"event {record.event}")
            for name in ("source", "target"):
                if getattr(record, name) in _TUNED_STATES:
                    raise fail(at + "." + name, f"state {getattr(record, name)}")
            if record.reason == Reason.MEASURED_FASTER.value:
                raise fail(at + ".reason", "reason 'measured faster'")
        elif isinstance(record, (CheckRecord, SkipRecord)) and record.stage in _TUNED_STATES:
            raise fail(at + ".stage", f"state {record.stage}")


def _reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Invalid("", f"duplicate key {json.dumps(key, ensure_ascii=True)} in an object")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise _Invalid("", f"{name} is not valid JSON")


#: No integer in a trace has more digits than this (Python itself refuses to
#: convert more than 4300 with a bare ValueError that names no file).
_MAX_INT_DIGITS = 100


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > _MAX_INT_DIGITS:
        raise _Invalid(
            "", f"an integer of {digits} digits (a trace holds none longer than "
            f"{_MAX_INT_DIGITS})"
        )
    return int(text)


def trace_from_json(text: str, *, source: str = "<trace>") -> Trace:
    """Parse a trace from its JSON text; :class:`TraceFormatError` if invalid."""
    if not text.strip():
        raise _format_error(source, "$", "the file is empty, not a trace")
    try:
        doc = json.loads(
            text,
            object_pairs_hook=_reject_duplicate_keys,
            parse_constant=_reject_constant,
            parse_int=_parse_int,
        )
    except _Invalid as exc:
        raise _format_error(source, "$" + exc.path, exc.message) from None
    except json.JSONDecodeError as exc:
        # json reports a string cut off by the end of the text at its start
        # ("Unterminated string starting at"): that is a truncated file too
        unterminated = exc.msg.startswith("Unterminated string")
        truncated = unterminated or exc.pos >= len(text.rstrip())
        raise _format_error(
            source,
            "$",
            f"not valid JSON: {exc.msg.removesuffix(' at')} at line {exc.lineno}, "
            f"column {exc.colno}"
            + ("; the file looks truncated" if truncated else ""),
        ) from None
    except RecursionError:
        raise _format_error(source, "$", "not a trace: JSON nested too deeply") from None
    return trace_from_dict(doc, source=source)


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; any problem is a :class:`TraceFormatError` naming the file.

    Reading is data only: JSON is parsed, backend names are looked up in the
    registry; nothing is imported, unpickled or evaluated.
    """
    source = os.fspath(path)
    try:
        raw = read_bounded(source, what="trace file")
    except OSError as exc:
        raise TraceFormatError(
            _one_line(f"{source}: cannot read the trace file: {exc.strerror or exc}"), source, None
        ) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _format_error(
            source,
            "$",
            f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); "
            f"a trace file is UTF-8 JSON",
        ) from None
    return trace_from_json(text, source=source)


def dump_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as canonical JSON, atomically (temporary file, then rename)."""
    if not isinstance(trace, Trace):
        raise TypeError(f"dump_trace takes a Trace, got {type(trace).__name__}")
    target = Path(path)
    atomic_write_text(target, canonical_json(trace_to_dict(trace)))
    return target
