"""The trace document: a resolution's records with its full input, the canonical
JSON and digest that identify it, and its files (dump and load).

A trace is data: the full input of one resolution (layer, selection config,
scope snapshot, platform facts, per-layer backend), the ordered records the
machine emitted, the outcome, and a schema version. Its digest is the SHA-256
of its canonical JSON (sorted keys, two-space indent, trailing newline) without
the digest field. Nothing in a trace differs between two runs of the same
input: no timestamps, addresses or ids. ``docs/trace-format.md`` documents the
schema.

Three modules, one concern each: the records and the input are
:mod:`attnres.records` (re-exported here); their strict JSON codec is
:mod:`attnres._trace_codec`; this module holds the :class:`Trace`, its digest,
and the text and files. A malformed trace is a :class:`TraceFormatError` in the
format every file loader shares (``traces/x.json: $.input.layer.head_size:
expected an integer, got the string "64"``: file, JSON path, message).

Loading a trace reads JSON and looks backend names up in the registry; it never
imports a module, unpickles, or evaluates anything.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from attrs import frozen

from attnres import _trace_codec as codec
from attnres import records as _records
from attnres._codec import field_names, located
from attnres._files import atomic_write_text, read_bounded
from attnres._outcome import Outcome
from attnres._trace_codec import record_to_dict
from attnres.errors import ArgumentTypeError, TraceFormatError
from attnres.records import *  # noqa: F403  (re-exported: the records are part of a trace)
from attnres.records import BASE_SCHEMA_VERSION, Record, TraceInput

__all__ = [
    *_records.__all__,
    "Outcome",
    "Trace",
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
        body = canonical_json(codec.trace_body(self))
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
# Documents: trace <-> dict <-> text <-> file
# =============================================================================


def trace_to_dict(trace: Trace) -> dict[str, Any]:
    """The JSON document of a trace, digest included."""
    doc = codec.trace_body(trace)
    doc["digest"] = trace.digest
    return doc


_format_error = codec.format_error


def trace_from_dict(doc: Any, *, source: str = "<trace>") -> Trace:
    """Rebuild a trace from its JSON document; :class:`TraceFormatError` if invalid.

    The error's message is one line: ``SOURCE: JSONPATH: what is wrong``; its
    ``.path`` is ``source`` and its ``.where`` the JSON path.
    """
    parts = codec.structure_document(doc, source=source)
    trace = Trace(
        input=parts.input,
        records=parts.records,
        outcome=parts.outcome,
        schema_version=parts.schema_version,
    )
    if parts.digest != trace.digest:
        raise _format_error(
            source,
            "$.digest",
            f"recorded digest {parts.digest[:12]}... does not match the content "
            f"(sha256 {trace.digest[:12]}...): the file was edited by hand or corrupted; "
            f"regenerate it (make golden for traces/, or re-run the command that wrote it)",
        )
    return trace


def trace_from_json(text: str, *, source: str = "<trace>") -> Trace:
    """Parse a trace from its JSON text; :class:`TraceFormatError` if invalid."""
    if not text.strip():
        raise _format_error(source, "$", "the file is empty, not a trace")
    try:
        doc = codec.loads(text, source=source)
    except json.JSONDecodeError as exc:
        # json reports a string cut off by the end of the text at its start
        # ("Unterminated string starting at"): that is a truncated file too
        unterminated = exc.msg.startswith("Unterminated string")
        truncated = unterminated or exc.pos >= len(text.rstrip())
        raise _format_error(
            source,
            "$",
            f"not valid JSON: {exc.msg.removesuffix(' at')} at line {exc.lineno}, "
            f"column {exc.colno}" + ("; the file looks truncated" if truncated else ""),
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
            located(source, message=f"cannot read the trace file: {exc.strerror or exc}"),
            source,
            None,
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
        raise ArgumentTypeError(f"dump_trace takes a Trace, got {type(trace).__name__}")
    target = Path(path)
    atomic_write_text(target, canonical_json(trace_to_dict(trace)))
    return target
