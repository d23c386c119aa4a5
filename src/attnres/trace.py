"""Trace records, the Trace itself, its canonical JSON and digest, dump and load.

A trace is data: the full input of one resolution (layer, selection config,
scope snapshot, platform facts, per-layer backend), the ordered records the
machine emitted, the outcome, and a schema version. Its digest is the SHA-256
of its canonical JSON (sorted keys, two-space indent, trailing newline) without
the digest field. Nothing in a trace differs between two runs of the same
input: no timestamps, addresses or ids.

Loading a trace reads JSON and looks backend names up in the registry; it never
imports a module, unpickles, or evaluates anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Union

import cattrs
from attrs import field, frozen

from attnres._states import Check, Event, Origin, State
from attnres._vocab import Role
from attnres.backends import Backend
from attnres.errors import TraceFormatError, UnknownBackendError
from attnres.layer import LayerSpec, Requirements, SelectionConfig
from attnres.platform import PackageFact, Platform
from attnres.scope import ScopeState

__all__ = [
    "SCHEMA_VERSION",
    "CheckRecord",
    "Failure",
    "OriginRecord",
    "Outcome",
    "Record",
    "RejectedRecord",
    "SelectedRecord",
    "SkipRecord",
    "Trace",
    "TraceInput",
    "TransitionRecord",
    "canonical_json",
    "dump_trace",
    "load_trace",
    "record_to_dict",
    "trace_from_dict",
    "trace_to_dict",
]

SCHEMA_VERSION = 1


@frozen
class Failure:
    """One failed check: a machine-readable code and a message for people."""

    code: str
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
    reason: str | None = None
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
    reason: str | None
    kind: str = field(default="selected", init=False)


@frozen
class RejectedRecord:
    """Terminal: no backend could serve the layer."""

    origin: Origin
    code: str
    error: str
    kind: str = field(default="rejected", init=False)


Record = Union[
    OriginRecord, TransitionRecord, CheckRecord, SkipRecord, SelectedRecord, RejectedRecord
]
RECORD_KINDS: dict[str, type[Any]] = {
    "origin": OriginRecord,
    "transition": TransitionRecord,
    "check": CheckRecord,
    "skip": SkipRecord,
    "selected": SelectedRecord,
    "rejected": RejectedRecord,
}


@frozen(cache_hash=True)
class TraceInput:
    """Everything a resolution depends on."""

    layer: LayerSpec
    config: SelectionConfig
    scope: ScopeState | None
    platform: Platform
    backend: Backend | None = None


@frozen
class Outcome:
    status: str  # "selected" | "rejected"
    origin: Origin
    backend: Backend | None = None
    reason: str | None = None
    code: str | None = None
    error: str | None = None


@frozen
class Trace:
    """The ordered, typed records of one resolution, with its full input."""

    input: TraceInput
    records: tuple[Record, ...]
    outcome: Outcome
    schema_version: int = SCHEMA_VERSION

    @functools.cached_property
    def digest(self) -> str:
        """Hex SHA-256 of the canonical JSON of the trace (without the digest)."""
        body = canonical_json(_CONVERTER.unstructure(self))
        return hashlib.sha256(body.encode("utf-8")).hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return trace_to_dict(self)

    def to_json(self) -> str:
        return canonical_json(trace_to_dict(self))


# -- canonical JSON -----------------------------------------------------------


def canonical_json(obj: Any) -> str:
    """Sorted keys, two-space indent, ``": "`` separators, trailing newline."""
    return json.dumps(obj, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def _make_converter() -> cattrs.Converter:
    conv = cattrs.Converter(forbid_extra_keys=True)
    conv.register_unstructure_hook(Backend, lambda b: b.name)
    conv.register_structure_hook(Backend, lambda v, _: _structure_backend(v))

    def unstructure_backend_set(value: frozenset[Backend] | None) -> list[str] | None:
        return None if value is None else sorted(b.name for b in value)

    conv.register_unstructure_hook(
        LayerSpec,
        lambda s: {
            "head_size": s.head_size,
            "dtype": s.dtype,
            "supported": unstructure_backend_set(s.supported),
            "default": None if s.default is None else s.default.name,
            "role": s.role.value,
            "requirements": conv.unstructure(s.requirements),
            "name": s.name,
        },
    )
    conv.register_structure_hook(LayerSpec, lambda v, _: _structure_layer(conv, v))
    conv.register_unstructure_hook(
        SelectionConfig,
        lambda c: {
            "global_backend": None if c.global_backend is None else c.global_backend.name,
            "global_backend_explicit": c.global_backend_explicit,
            "forced_backend": None if c.forced_backend is None else c.forced_backend.name,
            "component_backends": {n: b.name for n, b in c.component_backends},
        },
    )
    conv.register_structure_hook(SelectionConfig, lambda v, _: _structure_config(v))
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
    conv.register_structure_hook(ScopeState, lambda v, _: _structure_scope(v))

    def unstructure_record(rec: Any) -> dict[str, Any]:
        out: dict[str, Any] = conv.unstructure(rec, unstructure_as=type(rec))
        return out

    def structure_record(value: Any, _: Any) -> Any:
        if not isinstance(value, dict):
            raise ValueError(f"a record must be an object, got {type(value).__name__}")
        kind = value.get("kind")
        cls = RECORD_KINDS.get(kind) if isinstance(kind, str) else None
        if cls is None:
            raise ValueError(
                f"unknown record kind {kind!r}; known kinds: {', '.join(sorted(RECORD_KINDS))}"
            )
        body = {k: v for k, v in value.items() if k != "kind"}
        return conv.structure(body, cls)

    conv.register_unstructure_hook(Record, unstructure_record)
    conv.register_structure_hook(Record, structure_record)
    for cls in RECORD_KINDS.values():
        conv.register_unstructure_hook(cls, _record_unstructurer(conv, cls))

    def unstructure_trace(t: Trace) -> dict[str, Any]:
        return {
            "schema_version": t.schema_version,
            "input": conv.unstructure(t.input),
            "records": [unstructure_record(r) for r in t.records],
            "outcome": conv.unstructure(t.outcome),
        }

    conv.register_unstructure_hook(Trace, unstructure_trace)
    return conv


def _record_unstructurer(conv: cattrs.Converter, cls: type[Any]) -> Any:
    import attrs

    names = [a.name for a in attrs.fields(cls)]

    def unstructure(rec: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for n in names:
            v = getattr(rec, n)
            out[n] = conv.unstructure(v)
        return out

    return unstructure


def _structure_backend(value: Any) -> Backend:
    if not isinstance(value, str):
        raise ValueError(f"a backend must be a name (string), got {type(value).__name__}")
    try:
        return Backend.parse(value)
    except UnknownBackendError as exc:
        raise ValueError(str(exc)) from None


def _structure_layer(conv: cattrs.Converter, v: Any) -> LayerSpec:
    if not isinstance(v, dict):
        raise ValueError(f"layer must be an object, got {type(v).__name__}")
    _exact_keys(v, {"head_size", "dtype", "supported", "default", "role", "requirements", "name"})
    head_size = v["head_size"]
    if isinstance(head_size, bool) or not isinstance(head_size, int):
        raise ValueError(f"head_size must be an integer, got {head_size!r}")
    for key in ("dtype", "role"):
        if not isinstance(v[key], str):
            raise ValueError(f"{key} must be a string, got {v[key]!r}")
    supported = v["supported"]
    if supported is not None and not isinstance(supported, list):
        raise ValueError(f"supported must be a list or null, got {supported!r}")
    reqs = v["requirements"]
    if not isinstance(reqs, dict):
        raise ValueError(f"requirements must be an object, got {reqs!r}")
    _exact_keys(reqs, {"causal", "attn_mask", "packed_varlen", "gqa", "dropout"})
    for key, flag in reqs.items():
        if not isinstance(flag, bool):
            raise ValueError(f"requirements.{key} must be true or false, got {flag!r}")
    return LayerSpec(
        head_size=head_size,
        dtype=v["dtype"],
        supported=None if supported is None else [_structure_backend(b) for b in supported],
        default=None if v["default"] is None else _structure_backend(v["default"]),
        role=v["role"],
        requirements=Requirements(**reqs),
        name=v["name"],
    )


def _structure_config(v: Any) -> SelectionConfig:
    if not isinstance(v, dict):
        raise ValueError(f"config must be an object, got {type(v).__name__}")
    _exact_keys(v, {"global_backend", "global_backend_explicit", "forced_backend",
                    "component_backends"})
    if not isinstance(v["global_backend_explicit"], bool):
        raise ValueError("global_backend_explicit must be true or false")
    cb = v["component_backends"]
    if not isinstance(cb, dict):
        raise ValueError("component_backends must be an object")
    return SelectionConfig(
        global_backend=_opt_backend(v["global_backend"]),
        global_backend_explicit=v["global_backend_explicit"],
        forced_backend=_opt_backend(v["forced_backend"]),
        component_backends={k: _structure_backend(b) for k, b in cb.items()},
    )


def _structure_scope(v: Any) -> ScopeState:
    if not isinstance(v, dict):
        raise ValueError(f"scope must be an object or null, got {type(v).__name__}")
    _exact_keys(v, {"component", "kind", "loader", "backend", "role_backends",
                    "allow_global_fallback", "require_selection"})
    for key in ("component", "kind", "loader"):
        if not isinstance(v[key], str):
            raise ValueError(f"{key} must be a string, got {v[key]!r}")
    for key in ("allow_global_fallback", "require_selection"):
        if not isinstance(v[key], bool):
            raise ValueError(f"{key} must be true or false, got {v[key]!r}")
    rb = v["role_backends"]
    if not isinstance(rb, dict):
        raise ValueError("role_backends must be an object")
    return ScopeState(
        component=v["component"],
        kind=v["kind"],
        loader=v["loader"],
        backend=_opt_backend(v["backend"]),
        role_backends=_sorted_roles(
            [(Role.parse(r), _structure_backend(b)) for r, b in rb.items()]
        ),
        allow_global_fallback=v["allow_global_fallback"],
        require_selection=v["require_selection"],
    )


def _sorted_roles(pairs: list[tuple[Role, Backend]]) -> tuple[tuple[Role, Backend], ...]:
    return tuple(sorted(pairs, key=lambda kv: kv[0].value))


def _opt_backend(v: Any) -> Backend | None:
    return None if v is None else _structure_backend(v)


def _exact_keys(v: dict[str, Any], keys: set[str]) -> None:
    missing = keys - set(v)
    extra = set(v) - keys
    if missing:
        raise ValueError(f"missing field(s): {', '.join(sorted(missing))}")
    if extra:
        raise ValueError(f"unexpected field(s): {', '.join(sorted(extra))}")


_CONVERTER = _make_converter()


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """The JSON document of a trace, digest included."""
    doc: dict[str, Any] = _CONVERTER.unstructure(trace)
    doc["digest"] = trace.digest
    return doc


def trace_from_dict(doc: Any, *, source: str = "<trace>") -> Trace:
    """Rebuild a trace from its JSON document; :class:`TraceFormatError` if invalid."""
    if not isinstance(doc, dict):
        raise TraceFormatError(
            f"{source}: $: a trace must be a JSON object, got {type(doc).__name__}", source, "$"
        )
    version = doc.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int):
        raise TraceFormatError(
            f"{source}: $.schema_version: missing or not an integer", source, "$.schema_version"
        )
    if version > SCHEMA_VERSION:
        raise TraceFormatError(
            f"{source}: $.schema_version: schema version {version} is newer than this attnres "
            f"understands ({SCHEMA_VERSION}); upgrade attnres to read it",
            source,
            "$.schema_version",
        )
    if version < 1:
        raise TraceFormatError(
            f"{source}: $.schema_version: unsupported schema version {version}",
            source,
            "$.schema_version",
        )
    expected = {"schema_version", "input", "records", "outcome", "digest"}
    for key in sorted(expected - set(doc)):
        raise TraceFormatError(f"{source}: $.{key}: missing field", source, f"$.{key}")
    for key in sorted(set(doc) - expected):
        raise TraceFormatError(f"{source}: $.{key}: unexpected field", source, f"$.{key}")
    inp = _structure_at(doc["input"], TraceInput, source, "$.input")
    records_doc = doc["records"]
    if not isinstance(records_doc, list):
        raise TraceFormatError(f"{source}: $.records: must be a list", source, "$.records")
    records = tuple(
        _structure_at(r, Record, source, f"$.records[{i}]")
        for i, r in enumerate(records_doc)
    )
    outcome = _structure_at(doc["outcome"], Outcome, source, "$.outcome")
    trace = Trace(input=inp, records=records, outcome=outcome, schema_version=version)
    digest = doc["digest"]
    if not isinstance(digest, str):
        raise TraceFormatError(f"{source}: $.digest: must be a string", source, "$.digest")
    if digest != trace.digest:
        raise TraceFormatError(
            f"{source}: $.digest: recorded digest {digest[:12]}... does not match the content "
            f"({trace.digest[:12]}...); the file was edited or corrupted - regenerate it "
            f"(attnres replay --update, or make golden)",
            source,
            "$.digest",
        )
    return trace


def _structure_at(value: Any, cls: Any, source: str, where: str) -> Any:
    try:
        return _CONVERTER.structure(value, cls)
    except Exception as exc:
        raise TraceFormatError(f"{source}: {where}: {_explain(exc)}", source, where) from None


def _explain(exc: BaseException) -> str:
    if isinstance(exc, cattrs.BaseValidationError):
        msgs = cattrs.transform_error(exc)
        return "; ".join(msgs) if msgs else str(exc)
    return str(exc) or type(exc).__name__


def dump_trace(trace: Trace, path: str | os.PathLike[str]) -> Path:
    """Write ``trace`` as canonical JSON, atomically (temporary file, then rename)."""
    target = Path(path)
    text = canonical_json(trace_to_dict(trace))
    atomic_write_text(target, text)
    return target


def atomic_write_text(target: Path, text: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load_trace(path: str | os.PathLike[str]) -> Trace:
    """Read a trace file; any problem is a :class:`TraceFormatError` naming the file."""
    source = os.fspath(path)
    try:
        raw = Path(source).read_bytes()
    except OSError as exc:
        raise TraceFormatError(
            f"{source}: cannot read trace file: {exc.strerror or exc}", source, None
        ) from None
    if not raw.strip():
        raise TraceFormatError(f"{source}: $: the file is empty, not a trace", source, "$")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{source}: $: not UTF-8 text ({exc.reason})", source, "$") from None
    except json.JSONDecodeError as exc:
        raise TraceFormatError(
            f"{source}: $: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); "
            f"the file may be truncated",
            source,
            "$",
        ) from None
    return trace_from_dict(doc, source=source)


# cattrs needs these to be importable for PackageFact structuring
_ = PackageFact


def record_to_dict(record: Record) -> dict[str, Any]:
    """One record as its JSON object (``kind`` included)."""
    out: dict[str, Any] = _CONVERTER.unstructure(record, unstructure_as=type(record))
    return out
