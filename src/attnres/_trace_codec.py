"""The strict codec of traces: their records and input to JSON documents and back.

One cattrs converter (``_CONVERTER``) does both directions. Records are a
tagged union on their ``kind`` (cattrs' ``configure_tagged_union``); every
other record class is (un)structured field by field from its attrs definition
(a field marked ``omit_default`` is written only when set, so older traces keep
their bytes). Structuring is strict: every field must be present and of its
JSON type (no ``"64"`` for ``64``, no ``"false"`` for ``false``), every closed
vocabulary (states, events, origins, checks, codes, reasons, platform kinds) is
checked, and the first problem is raised as :class:`_Invalid` with the JSON path
it applies to and a message. The trace document (:mod:`attnres.trace`) turns it
into a :class:`~attnres.errors.TraceFormatError` in the format every file loader
shares (:func:`attnres._codec.located`: file, path, message).

Structuring reads JSON and looks backend names up in the registry; it never
imports a module, unpickles, or evaluates anything. A backend name must look
like one (letters, digits, ``_``, ``-``) before the registry is even asked, so a
name such as ``os:system`` is an error, never an import path.
"""

from __future__ import annotations

import enum
import json
import re
import typing
from collections.abc import Callable
from typing import Any, Protocol, TypeGuard, TypeVar

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override
from cattrs.strategies import configure_tagged_union

from attnres._codec import (
    field_names,
    is_bool,
    is_int,
    is_str,
    located,
    missing_keys,
    optional_field_names,
    optional_inner,
    unknown_keys,
)
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
)
from attnres._vocab import (
    PLATFORM_KINDS,
    CausalAlignment,
    MaskKind,
    Requirement,
    Role,
    normalize_dtype,
)
from attnres.backends import Backend
from attnres.errors import TraceFormatError, UnknownBackendError
from attnres.layer import LayerSpec, Requirements, SelectionConfig, split_component_key
from attnres.layout import SequenceLayout, _degree, _heads
from attnres.platform import HostResolution, PackageFact, Platform
from attnres.records import (
    KERNELS_SCHEMA_VERSION,
    LAYOUT_KINDS_SCHEMA_VERSION,
    LAYOUT_SCHEMA_VERSION,
    MASK_SCHEMA_VERSION,
    PRECISION_SCHEMA_VERSION,
    RECORD_KINDS,
    SCHEMA_1_REQUIREMENTS,
    SCHEMA_VERSION,
    TUNED_EVENTS,
    TUNED_KINDS,
    TUNED_SCHEMA_VERSION,
    TUNED_STATES,
    CheckRecord,
    ErrorMeasurement,
    Failure,
    MeasurementRecord,
    PrecisionRecord,
    Record,
    ScopeState,
    SkipRecord,
    TraceInput,
    TransitionRecord,
    TuningRecord,
)

__all__ = [
    "Document",
    "TraceLike",
    "describe",
    "format_error",
    "loads",
    "record_to_dict",
    "structure_document",
    "trace_body",
]

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


def describe(value: Any) -> str:
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


def _under(step: str | int, exc: Exception) -> _Invalid:
    """``exc`` one step deeper: its path under an object key or a list index
    (``.name``, ``["odd key"]``, ``[0]``); any other exception is the problem
    at ``step`` itself, in its own words."""
    if not isinstance(exc, _Invalid):
        exc = _Invalid("", str(exc) or type(exc).__name__)
    where = f"[{step}]" if isinstance(step, int) else _key_path(step)
    return _Invalid(where + exc.path, exc.message)


def _within(steps: tuple[str | int, ...], exc: Exception) -> Exception:
    for step in reversed(steps):
        exc = _under(step, exc)
    return exc


# =============================================================================
# Strict structuring hooks (JSON -> attrs), all on one converter
# =============================================================================

#: What a backend name in a trace may look like before the registry is asked.
_BACKEND_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_\-]{0,63}")

_T = TypeVar("_T")


def _object(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid("", f"{what} must be a JSON object, got {describe(value)}")
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


def _scalar(check: Callable[[Any], TypeGuard[_T]], expected: str) -> Callable[..., _T]:
    """The strict hook of a JSON scalar type: the value itself, else ``expected, got ...``."""

    def structure(value: Any, _: Any = None) -> _T:
        if not check(value):
            raise _Invalid("", f"expected {expected}, got {describe(value)}")
        return value

    return structure


_structure_str = _scalar(is_str, "a string")
_structure_int = _scalar(is_int, "an integer")
_structure_bool = _scalar(is_bool, "true or false")


def _structure_float(value: Any, _: Any = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid("", f"expected a number, got {describe(value)}")
    number = float(value)
    if number != number or number in (float("inf"), float("-inf")):  # pragma: no cover
        raise _Invalid("", f"expected a finite number, got {value!r}")
    return number


def _structure_backend(value: Any, _: Any = None) -> Backend:
    """A backend by name, from the registry only (never an import path)."""
    if not isinstance(value, str):
        raise _Invalid("", f"expected a backend name (a string), got {describe(value)}")
    if not _BACKEND_NAME.fullmatch(value):
        raise _Invalid(
            "",
            f"{describe(value)} is not a backend name (names are letters, digits, '_' and '-'; "
            f"a trace names registered backends, never code to import)",
        )
    try:
        return Backend.parse(value)
    except UnknownBackendError as exc:
        raise _Invalid("", f"{exc} (a trace can only name registered backends)") from None


def _structure_enum(cls: type[enum.Enum]) -> Callable[[Any, Any], Any]:
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
    unknown = _one_of(what, [str(m.value) for m in cls])

    def structure(value: Any, _: Any) -> Any:
        if not isinstance(value, str):
            raise _Invalid("", f"expected a {what} name (a string), got {describe(value)}")
        problem = unknown(value)
        if problem is not None:
            raise _Invalid("", problem)
        return cls(value)

    return structure


def _one_of(what: str, allowed: typing.Iterable[str]) -> Callable[[Any], str | None]:
    """The check of a closed list of names, on a string (its JSON type is checked first)."""
    names = list(allowed)
    shown = ", ".join(json.dumps(n) if " " in n else n for n in names)

    def check(value: Any) -> str | None:
        if value in names:
            return None
        return f"unknown {what} {json.dumps(value, ensure_ascii=True)}; expected one of: {shown}"

    return check


def _at_least(what: str, low: float) -> Callable[[Any], str | None]:
    """The check of a number's lower bound; null reaches it only for an optional
    field (its JSON type is checked first)."""

    def check(value: Any) -> str | None:
        if value is None or value >= low:
            return None
        return f"{what} must be at least {low}, got {value!r}"

    return check


def _fraction(what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if 0 <= value < 1:
            return None
        return f"{what} is a fraction in [0, 1) (0.02 is 2%), got {value!r}"

    return check


#: Closed vocabularies checked after a field's JSON type (class, field) -> check.
_FIELD_CHECKS: dict[tuple[type[Any], str], Callable[[Any], str | None]] = {}


def _structure_at(conv: cattrs.Converter, value: Any, tp: Any, *steps: str | int) -> Any:
    """Structure ``value`` as ``tp``; a failure is nested under ``steps``."""
    try:
        inner = optional_inner(tp)
        if inner is not None:
            return None if value is None else conv.structure(value, inner)
        if value is None:
            raise _Invalid("", f"expected {_expected(tp)}, got null")
        return conv.structure(value, tp)
    except Exception as exc:
        raise _within(steps, exc) from None


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


def _make_tuple_hook(conv: cattrs.Converter, tp: Any) -> Callable[[Any, Any], Any]:
    items = typing.get_args(tp)
    if len(items) == 2 and items[1] is Ellipsis:  # tuple[X, ...]
        item = items[0]

        def structure_many(value: Any, _: Any) -> tuple[Any, ...]:
            if not isinstance(value, list):
                raise _Invalid("", f"expected a list, got {describe(value)}")
            return tuple(_structure_at(conv, v, item, i) for i, v in enumerate(value))

        return structure_many

    def structure_fixed(value: Any, _: Any) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) != len(items):
            raise _Invalid("", f"expected a list of {len(items)} items, got {describe(value)}")
        return tuple(
            _structure_at(conv, v, t, i) for i, (v, t) in enumerate(zip(value, items, strict=True))
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
            v = _structure_at(conv, obj[a.name], a.type, a.name)
            check = _FIELD_CHECKS.get((cls, a.name))
            problem = None if check is None else check(v)
            if problem is not None:
                raise _under(a.name, _Invalid("", problem))
            kwargs[a.name] = v
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise _Invalid("", f"not a valid {what}: {exc}") from None

    return structure


_LAYER_KEYS = field_names(LayerSpec)
_CONFIG_KEYS = field_names(SelectionConfig)
_SCOPE_KEYS = field_names(ScopeState)


def _field(obj: Any, key: str | int, fn: Callable[[Any], Any]) -> Any:
    """``fn`` of ``obj[key]`` (an object's key or a list's index); a failure is nested under it."""
    try:
        return fn(obj[key])
    except Exception as exc:
        raise _under(key, exc) from None


def _optional(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else fn(v)


def _backend_list(value: Any) -> list[Backend]:
    if not isinstance(value, list):
        raise _Invalid("", f"expected a list of backend names or null, got {describe(value)}")
    if not value:
        raise _Invalid("", "an empty supported set admits no backend; use null for no constraint")
    return [_field(value, i, _structure_backend) for i in range(len(value))]


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
    problem = _role_name(text)
    if problem is not None:
        raise _Invalid("", problem)
    return Role(text)


#: The keys a version-4 trace adds to its requirements (issue 22).
_MASK_KEYS: tuple[str, ...] = ("mask", "causal_alignment")
#: Requirements written only when on (issue 19: attention sinks), so every trace
#: written before them keeps its bytes and its digest
_OPTIONAL_REQUIREMENTS: tuple[str, ...] = (Requirement.SINKS.value, Requirement.WEIGHTS.value)


def _requirement_names(obj: dict[str, Any]) -> list[str]:
    """The requirement keys a trace's requirements must hold: every one, the
    optional ones only where present."""
    return [r.value for r in Requirement if r.value not in _OPTIONAL_REQUIREMENTS or r.value in obj]


def _requirements(value: Any) -> Requirements:
    """A layer's requirements, whose keys :func:`_check_requirement_keys` has checked
    against the trace's schema version before the document is structured."""
    obj = _object(value, "requirements")
    flags: dict[str, Any] = {
        name: _field(obj, name, _structure_bool) for name in obj if name not in _MASK_KEYS
    }
    for name in _MASK_KEYS:
        if name in obj:
            text = _field(obj, name, _structure_str)
            kinds: type[MaskKind] | type[CausalAlignment] = (
                MaskKind if name == "mask" else CausalAlignment
            )
            try:
                flags[name] = kinds(text)
            except ValueError:
                raise _Invalid(
                    "." + name,
                    f"unknown {name.replace('_', ' ')} {json.dumps(text)}; expected one of "
                    + ", ".join(v.value for v in kinds),
                ) from None
    try:
        return Requirements(**flags)
    except ValueError as exc:
        raise _Invalid("", str(exc)) from None


def _unstructure_requirements(r: Requirements) -> dict[str, Any]:
    """The flags; the mask kind and alignment only where a 0.2 trace cannot say them."""
    out: dict[str, Any] = {
        req.value: getattr(r, req.value)
        for req in Requirement
        if req.value not in _OPTIONAL_REQUIREMENTS or getattr(r, req.value)
    }
    if r.extended:
        out["mask"] = r.mask.value
        out["causal_alignment"] = r.causal_alignment.value
    return out


def _check_requirement_keys(doc: dict[str, Any], version: int) -> None:
    """A schema-1 trace has the 0.1 requirement keys; a later one has every key."""
    try:
        obj = doc["input"]["layer"]["requirements"]
    except (KeyError, TypeError):
        return  # structuring reports the missing or malformed part, with its path
    if not isinstance(obj, dict):
        return
    keys = list(SCHEMA_1_REQUIREMENTS) if version == 1 else _requirement_names(obj)
    if version >= MASK_SCHEMA_VERSION and any(k in obj for k in _MASK_KEYS):
        keys += list(_MASK_KEYS)  # issue 22: a mask kind and alignment, both or neither
    try:
        _exact_keys(obj, keys, f"requirements in schema version {version}")
    except _Invalid as exc:
        raise _within(("input", "layer", "requirements"), exc) from None


def _structure_layer(value: Any, _: Any) -> LayerSpec:
    obj = _object(value, "a layer")
    _exact_keys(obj, _LAYER_KEYS, "a layer", optional_field_names(LayerSpec))
    layer = {key: _field(obj, key, fn) for key, fn in _LAYER_FIELDS.items()}
    # exact_route (issue 21, written only when set): an integration route that
    # runs exactly the supported set, so it needs one
    route = _field(obj, "exact_route", _structure_str) if "exact_route" in obj else None
    if route is not None and not route.strip():
        raise _Invalid(".exact_route", "a route's name must not be empty")
    if route is not None and layer["supported"] is None:
        raise _Invalid(".exact_route", "an exact route needs a supported set (supported is null)")
    layer.update((key, _field(obj, key, fn)) for key, fn in _LAYER_EXTRAS.items() if key in obj)
    try:
        # issue 23: typed per-backend options, checked against the specs (a
        # BackendOptionError is a ValueError: reported as invalid)
        return LayerSpec(**layer, exact_route=route, backend_options=obj.get("backend_options"))
    except ValueError as exc:  # issue 23: preferred/required outside supported
        raise _Invalid("", f"not a valid layer: {exc}") from None


_LAYOUT_KEYS = ("ulysses", "ring", "num_heads", "num_kv_heads")


def _degree_of(value: Any) -> int:
    # bounded as where it is parsed (attnres.layout: MAX_DEGREE)
    return _degree(_head_size(value))


#: issue 35 (schema 7): keys a layout carries only when set, and their readers
_LAYOUT_KIND_KEYS: dict[str, Callable[[Any], Any]] = {
    "allgather": _degree_of,
    "pad_heads": _structure_bool,
    "rule": _structure_str,
    "why": _structure_str,
}


def _layout(value: Any) -> SequenceLayout:
    """A layer's sequence-parallel layout (issue 24): degrees and head counts; issue
    35: the AllGather-KV degree, head padding and an auto layout's rule, when set."""
    obj = _object(value, "a layout")
    _exact_keys(obj, [*_LAYOUT_KEYS, *(k for k in _LAYOUT_KIND_KEYS if k in obj)], "a layout")
    kinds = {key: _field(obj, key, fn) for key, fn in _LAYOUT_KIND_KEYS.items() if key in obj}
    degrees = {key: _field(obj, key, _degree_of) for key in ("ulysses", "ring")}
    # bounded as where they are parsed (attnres.layout: MAX_HEADS)
    heads = {
        key: _field(obj, key, _optional(lambda v: _heads(_head_size(v))))
        for key in ("num_heads", "num_kv_heads")
    }
    try:
        return SequenceLayout(**degrees, **heads, **kinds)
    except ValueError as exc:
        raise _Invalid("", f"not a valid layout: {exc}") from None


#: A layer's keys in a trace and their strict readers, in the order they are checked.
_LAYER_FIELDS: dict[str, Callable[[Any], Any]] = {
    "head_size": _head_size,
    "dtype": _dtype,
    "supported": _optional(_backend_list),
    "default": _optional(_structure_backend),
    "role": _role,
    "requirements": _requirements,
    "name": _optional(_structure_str),
}
#: Keys written only when set: issue 24 (a sequence-parallel layer's layout) and
#: issue 23 (preferred, required)
_LAYER_EXTRAS: dict[str, Callable[[Any], Any]] = {
    "layout": _layout,
    "preferred": _optional(_backend_list),
    "required": _optional(_structure_backend),
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
            f"component name {json.dumps(key)} is not normalised (expected {json.dumps(canonical)})"
        )
    return None


def _role_name(key: str) -> str | None:
    return (
        None
        if key in ("self", "cross")
        else (f"unknown role {json.dumps(key)}; expected self or cross")
    )


def _error_budget_map(value: Any) -> dict[str, Any]:
    """Issue 34: ``{"vae": "exact", "*": 0.02}`` (checked by ``SelectionConfig``)."""
    obj = _object(value, "an error budget map")
    for key, budget in obj.items():
        if not (
            budget == "exact" or (isinstance(budget, float | int) and not isinstance(budget, bool))
        ):
            raise _Invalid(
                f".{key}", f"expected 'exact' or a relative L2 error, got {describe(budget)}"
            )
    return dict(obj)


#: A selection config's keys in a trace and their strict readers, in the order they
#: are checked; an absent key (written only when set) keeps its default
_CONFIG_FIELDS: dict[str, Callable[[Any], Any]] = {
    "global_backend_env": _structure_str,
    "global_backend": _optional(_structure_backend),
    "global_backend_explicit": _structure_bool,
    "forced_backend": _optional(_structure_backend),
    "component_backends": lambda v: _backend_map(v, _component_name),
    # issue 23: the selection profile, written only when not "attnres"
    "profile": _structure_str,
    # issue 34: the error budget, written only when set (schema 6)
    "attention_error": _error_budget_map,
}


def _structure_config(value: Any, _: Any) -> SelectionConfig:
    obj = _object(value, "a selection config")
    _exact_keys(obj, _CONFIG_KEYS, "a selection config", optional_field_names(SelectionConfig))
    config = {key: _field(obj, key, fn) for key, fn in _CONFIG_FIELDS.items() if key in obj}
    try:
        return SelectionConfig(**config)
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
    # Generated by cattrs from each attrs class; what a trace writes differently
    # from the field's Python form is a field override (_unstructure_overrides).
    conv.register_unstructure_hook(Backend, lambda b: b.name)
    conv.register_unstructure_hook(Requirements, _unstructure_requirements)  # issue 22
    # (issue 23: Platform too, before TraceInput whose hook embeds it, so its
    # host facts are written only when present)
    for cls in (
        SequenceLayout,  # issue 35: its kind's keys only when set
        LayerSpec,
        SelectionConfig,
        ScopeState,
        PackageFact,  # issue 31: its distribution only when known (before Platform)
        Platform,
        ErrorMeasurement,  # issue 34 (before TraceInput and PrecisionRecord)
        TraceInput,
        *RECORD_KINDS.values(),
    ):
        conv.register_unstructure_hook(
            cls,
            make_dict_unstructure_fn(cls, conv, **_unstructure_overrides(cls)),
        )

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
        (HostResolution, "a host resolution"),  # issue 23
        (Failure, "a failure"),
        (ErrorMeasurement, "an error measurement"),  # issue 34
    ):
        conv.register_structure_hook(cls, _make_attrs_hook(conv, cls, what))
    # Records: one hook per kind (the tag is popped before the hook sees the
    # object, so ``kind`` is listed as an allowed key, never required), then
    # cattrs' tagged union dispatches on ``kind`` both ways.
    for kind, cls in RECORD_KINDS.items():
        conv.register_structure_hook(
            cls, _make_attrs_hook(conv, cls, f"a {kind!r} record", optional=("kind",))
        )
    configure_tagged_union(Record, conv, tag_generator=_KIND_OF.__getitem__, tag_name="kind")
    tagged = conv.get_structure_hook(Record)

    def structure_record(value: Any, _: Any) -> Any:
        # what the tagged union cannot say: which object, which kind, and which
        # kinds there are (it raises a bare KeyError)
        obj = _object(value, "a record")
        if "kind" not in obj:
            raise _Invalid(".kind", "missing field (every record is tagged by its kind)")
        kind = obj["kind"]
        if not isinstance(kind, str) or kind not in RECORD_KINDS:
            raise _Invalid(
                ".kind",
                f"unknown record kind {json.dumps(kind, ensure_ascii=True)}; known kinds: "
                + ", ".join(RECORD_KINDS),
            )
        return tagged(obj, Record)

    conv.register_structure_hook(Record, structure_record)
    return conv


#: the tag of each record class (``kind`` in JSON)
_KIND_OF: dict[type[Any], str] = {cls: kind for kind, cls in RECORD_KINDS.items()}


def _backend_names(value: frozenset[Backend] | None) -> list[str] | None:
    """A set of backends as its sorted names (``null`` for no constraint)."""
    return None if value is None else sorted(b.name for b in value)


def _options_object(value: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...]) -> Any:
    """Per-backend options (issue 23) as ``{backend: {option: value}}``."""
    return {backend: dict(pairs) for backend, pairs in value}


def _pairs_to_object(pairs: tuple[tuple[Any, Backend], ...]) -> dict[str, str]:
    """``((key, backend), ...)`` (component or role overrides) as a JSON object."""
    return {getattr(k, "value", k): b.name for k, b in pairs}


#: Fields a trace writes in another shape than their Python form.
_WRITTEN_AS: dict[tuple[type[Any], str], Callable[[Any], Any]] = {
    (LayerSpec, "supported"): _backend_names,
    (LayerSpec, "preferred"): _backend_names,  # issue 23
    (LayerSpec, "backend_options"): _options_object,  # issue 23
    (SelectionConfig, "component_backends"): _pairs_to_object,
    (SelectionConfig, "attention_error"): dict,  # issue 34
    (ScopeState, "role_backends"): _pairs_to_object,
}


def _unstructure_overrides(cls: type[Any]) -> dict[str, Any]:
    """cattrs field overrides from the attrs metadata: ``trace=False`` is never
    written (the autotune settings of a SelectionConfig), ``omit_default`` only
    when set (so older traces keep their bytes), and ``_WRITTEN_AS`` reshapes."""
    out: dict[str, Any] = {}
    for a in attrs.fields(cls):
        if a.metadata.get("trace") is False:
            out[a.name] = override(omit=True)
        elif a.metadata.get("omit_default") or (cls, a.name) in _WRITTEN_AS:
            out[a.name] = override(
                omit_if_default=bool(a.metadata.get("omit_default")),
                unstruct_hook=_WRITTEN_AS.get((cls, a.name)),
            )
    return out


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
        (MeasurementRecord, "median_ns"): _at_least("median_ns", 0),
        (MeasurementRecord, "spread_ns"): _at_least("spread_ns", 0),
        (MeasurementRecord, "deviation"): _at_least("deviation", 0),
    }
)

_CONVERTER = _make_converter()


_TOP_KEYS = ("schema_version", "input", "records", "outcome", "digest")
_HEX64 = re.compile(r"[0-9a-f]{64}")


class TraceLike(Protocol):
    """What :func:`trace_body` reads of a trace (:class:`attnres.trace.Trace`)."""

    @property
    def input(self) -> TraceInput: ...
    @property
    def records(self) -> tuple[Record, ...]: ...
    @property
    def outcome(self) -> Outcome: ...
    @property
    def schema_version(self) -> int: ...


def trace_body(trace: TraceLike) -> dict[str, Any]:
    """A trace's JSON document without its digest (what the digest is computed over)."""
    inp = _CONVERTER.unstructure(trace.input)
    if trace.schema_version == 1:  # as attnres 0.1 wrote it: its digest covers these keys
        flags = inp["layer"]["requirements"]
        for key in [k for k in flags if k not in SCHEMA_1_REQUIREMENTS]:
            if not flags[key]:
                del flags[key]
    return {
        "schema_version": trace.schema_version,
        "input": inp,
        "records": [_CONVERTER.unstructure(r, unstructure_as=Record) for r in trace.records],
        "outcome": _CONVERTER.unstructure(trace.outcome),
    }


def record_to_dict(record: Record) -> dict[str, Any]:
    """One record as its JSON object (``kind`` included)."""
    out: dict[str, Any] = _CONVERTER.unstructure(record, unstructure_as=Record)
    return out


@attrs.frozen
class Document:
    """A structured trace document, every part checked; the digest as written
    (its match with the content is the trace's to check)."""

    input: TraceInput
    records: tuple[Record, ...]
    outcome: Outcome
    schema_version: int
    digest: str


def structure_document(doc: Any, *, source: str) -> Document:
    """Structure a trace's JSON document; the first problem is a
    :class:`TraceFormatError` naming ``source`` and its JSON path."""
    try:
        return _structure_document(doc)
    except _Invalid as exc:
        raise format_error(source, "$" + exc.path, exc.message) from None


def format_error(source: str, where: str, message: str) -> TraceFormatError:
    """A trace file's error, in the format every loader shares (file, path, message)."""
    return TraceFormatError(located(source, where, message=message), source, where)


def _structure_document(doc: Any) -> Document:
    if not isinstance(doc, dict):
        raise _Invalid("", f"a trace must be a JSON object, got {describe(doc)}")
    if "schema_version" not in doc:
        raise _Invalid(".schema_version", "missing field; this is not an attnres trace")
    version = doc["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int):
        raise _Invalid(".schema_version", f"expected an integer, got {describe(version)}")
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
    inp = _structure_at(_CONVERTER, doc["input"], TraceInput, "input")
    records_doc = doc["records"]
    if not isinstance(records_doc, list):
        raise _Invalid(".records", f"expected a list of records, got {describe(records_doc)}")
    if not records_doc:
        raise _Invalid(".records", "a trace has at least one record (origin detection)")
    records = tuple(
        _structure_at(_CONVERTER, r, Record, "records", i) for i, r in enumerate(records_doc)
    )
    if version < TUNED_SCHEMA_VERSION:
        _check_base_version(records, version)
    outcome = _structure_at(_CONVERTER, doc["outcome"], Outcome, "outcome")
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
    layout = inp.layer.layout
    if version < LAYOUT_KINDS_SCHEMA_VERSION and layout is not None and _has_kind(layout):
        raise _Invalid(
            ".input.layer.layout",
            f"an AllGather-KV, head-padded or chosen layout belongs to schema version "
            f"{LAYOUT_KINDS_SCHEMA_VERSION}, but the file says version {version}",
        )
    if version < LAYOUT_SCHEMA_VERSION and inp.layer.layout is not None:
        raise _Invalid(
            ".input.layer.layout",
            f"a sequence-parallel layout belongs to schema version {LAYOUT_SCHEMA_VERSION}, "
            f"but the file says version {version}",
        )
    if version < PRECISION_SCHEMA_VERSION:  # issue 34
        _check_precision_version(inp, records, version)
    digest = doc["digest"]
    if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
        raise _Invalid(
            ".digest",
            f"expected a SHA-256 hex digest (64 lower-case hex digits), got {describe(digest)}",
        )
    return Document(inp, records, outcome, version, digest)


def _check_precision_version(inp: TraceInput, records: tuple[Any, ...], version: int) -> None:
    """Issue 34: error budgets, measured errors and precision checks and records
    belong to schema version 6."""
    what = ""
    if inp.config.attention_error:
        what = ".input.config.attention_error"
    elif inp.measured_error:
        what = ".input.measured_error"
    else:
        for i, record in enumerate(records):
            if isinstance(record, PrecisionRecord) or (
                isinstance(record, CheckRecord) and record.check is Check.PRECISION
            ):
                what = f".records[{i}]"
                break
    if what:
        raise _Invalid(
            what,
            f"error budgets and precision records belong to schema version "
            f"{PRECISION_SCHEMA_VERSION}, but the file says version {version}",
        )


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
        if record.kind in TUNED_KINDS:
            raise fail(at + ".kind", f"a {record.kind!r} record")
        if isinstance(record, TransitionRecord):
            if record.event in TUNED_EVENTS:
                raise fail(at + ".event", f"event {record.event}")
            for name in ("source", "target"):
                if getattr(record, name) in TUNED_STATES:
                    raise fail(at + "." + name, f"state {getattr(record, name)}")
            if record.reason == Reason.MEASURED_FASTER.value:
                raise fail(at + ".reason", "reason 'measured faster'")
        elif isinstance(record, (CheckRecord, SkipRecord)) and record.stage in TUNED_STATES:
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
            "", f"an integer of {digits} digits (a trace holds none longer than {_MAX_INT_DIGITS})"
        )
    return int(text)


def loads(text: str, *, source: str) -> Any:
    """Parse JSON text strictly: a duplicate key, ``NaN``/``Infinity`` or an
    absurdly long integer is a :class:`TraceFormatError` (``json.JSONDecodeError``
    and ``RecursionError`` pass through for the caller to word)."""
    try:
        return json.loads(
            text,
            object_pairs_hook=_reject_duplicate_keys,
            parse_constant=_reject_constant,
            parse_int=_parse_int,
        )
    except _Invalid as exc:
        raise format_error(source, "$" + exc.path, exc.message) from None


def _has_kind(layout: SequenceLayout) -> bool:
    """Issue 35: whether a layout holds what schema version 7 added."""
    return layout.allgather > 1 or layout.pad_heads or layout.rule is not None
