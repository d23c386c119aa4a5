"""Audit events, emitted through ``structlog.get_logger("attnres")``.

attnres never configures structlog and never prints on its own. When the
application has configured structlog, every event goes through its
configuration (and ``structlog.testing.capture_logs`` sees it). When it has
not, events go to the standard ``logging`` logger ``attnres``, which is silent
unless the application turns it on.

Events (SPEC 5):

- one DEBUG event ``attention record`` per record of a resolution that ran the
  machine (keys: ``component``, ``layer``, ``index`` and the record's fields; a
  transition's ``event`` field is logged as ``machine_event``);
- one INFO event ``attention backend selected`` per resolution (keys
  ``backend``, ``reason``, ``origin``, ``component``, ``layer``), or a WARNING
  ``attention backend rejected`` with ``error`` and ``code`` too;
- one DEBUG event ``attention cache hit`` per cached resolution;
- one WARNING ``attention autotune failed`` when measuring a layer failed (the
  layer keeps its incumbent; keys ``backend``, ``error``, ``component``,
  ``layer``);
- one INFO summary line per component scope on exit
  (``Attention backends for audio_vae: torch_sdpa (global backend fallback)``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog

from attnres._states import Status
from attnres._vocab import Role
from attnres.records import ScopeProblem
from attnres.trace import record_to_dict

if TYPE_CHECKING:
    from attnres.ledger import Decision
    from attnres.scope import ScopeState
    from attnres.trace import Trace

__all__ = [
    "LOGGER_NAME",
    "emit_autotune_failed",
    "emit_cache_hit",
    "emit_resolution",
    "emit_scope_problems",
    "emit_summary",
    "summary_line",
]

LOGGER_NAME = "attnres"
_STDLIB = logging.getLogger(LOGGER_NAME)
_KEY_VALUES = structlog.processors.KeyValueRenderer(sort_keys=True)


def _render_plain(logger: Any, method_name: str, event_dict: Any) -> str:
    """``<event> key=value ...``: the event text first and unquoted, for stdlib logging."""
    event = str(event_dict.pop("event", ""))
    rest = _KEY_VALUES(logger, method_name, event_dict)
    return f"{event} {rest}" if rest else event


_FALLBACK = structlog.wrap_logger(
    _STDLIB,
    processors=[_render_plain],
    wrapper_class=structlog.stdlib.BoundLogger,
).bind()


def _always(_level: int) -> bool:
    return True


def _sink() -> tuple[Any, Any]:
    """The logger to emit through and its level test, fetched once per emission.

    A configured structlog's logger is assembled from its configuration as it is
    now (never one cached at import, so a later ``structlog.configure`` or
    ``capture_logs`` is honoured). When that configuration asks for
    ``cache_logger_on_first_use``, the assembled logger is kept while the
    configuration stays the same objects (processors, wrapper class, logger
    factory, context class): assembling one per event cost more than the rest of
    the event. Otherwise the stdlib ``attnres`` logger decides.
    """
    if structlog.is_configured():
        config = structlog.get_config()
        if not config["cache_logger_on_first_use"]:
            return _assembled()
        key = (
            config["processors"],
            config["wrapper_class"],
            config["logger_factory"],
            config["context_class"],
        )
        kept = _KEPT[0] if _KEPT else None
        if kept is not None and all(a is b for a, b in zip(kept[0], key, strict=True)):
            return kept[1]
        sink = _assembled()
        _KEPT[:] = [(key, sink)]  # holds the configuration's objects: no id is reused
        return sink
    return _FALLBACK, _STDLIB.isEnabledFor


#: the logger assembled for the configuration it was assembled under (see _sink)
_KEPT: list[tuple[tuple[Any, ...], tuple[Any, Any]]] = []


def _assembled() -> tuple[Any, Any]:
    log = structlog.get_logger(LOGGER_NAME).bind()
    enabled = getattr(log, "is_enabled_for", None) or getattr(log, "isEnabledFor", None)
    return log, (enabled if enabled is not None else _always)


def _logger(level: int) -> Any | None:
    """A bound logger that will emit at ``level``, or ``None`` when it would drop it."""
    log, enabled = _sink()
    try:
        return log if enabled(level) else None
    except Exception:  # an unusual wrapper: let it decide itself
        return log


def emit_resolution(trace: Trace, decision: Decision) -> None:
    """The DEBUG record events and the INFO/WARNING outcome of one cold resolution."""
    outcome = trace.outcome
    log, enabled = _sink()
    try:
        # the outcome's own level gates it: a rejection (WARNING) is seen by an
        # application that filters at WARNING
        outcome_on = enabled(logging.INFO if outcome.status == Status.SELECTED else logging.WARNING)
        debug_on = outcome_on and enabled(logging.DEBUG)
    except Exception:  # an unusual wrapper: let it decide itself
        outcome_on = debug_on = True
    if not outcome_on:
        return
    common = {"component": decision.component, "layer": decision.layer}
    if debug_on:
        for index, record in enumerate(trace.records):
            fields = record_to_dict(record)
            if "event" in fields:  # a transition's event: not the log event's name
                fields["machine_event"] = fields.pop("event")
            log.debug("attention record", index=index, **common, **fields)
    if outcome.status is Status.SELECTED:
        # the outcome's fields read directly (the members' values are their text)
        backend, reason = outcome.backend, outcome.reason
        log.info(
            "attention backend selected",
            backend=None if backend is None else backend.name,
            reason=None if reason is None else reason.value,
            origin=outcome.origin.value,
            component=decision.component,
            layer=decision.layer,
        )
    else:
        log.warning(
            "attention backend rejected",
            backend=None,
            requested=_requested(trace),
            reason=None,
            origin=_text(decision.origin),
            error=outcome.error,
            code=_text(outcome.code),
            **common,
        )


def _text(value: object) -> str | None:
    """A vocabulary member as its plain text (renderers print ``repr`` otherwise)."""
    return None if value is None else str(value)


def _requested(trace: Trace) -> str | None:
    first = trace.records[0] if trace.records else None
    backend = getattr(first, "backend", None)
    return None if backend is None else str(backend)


def emit_cache_hit(decision: Decision) -> None:
    if not structlog.is_configured():
        if not _STDLIB.isEnabledFor(logging.DEBUG):
            return  # the common production case: one cheap check
        log: Any = _FALLBACK
    else:
        log = _logger(logging.DEBUG)
        if log is None:
            return
    log.debug(
        "attention cache hit",
        backend=None if decision.backend is None else decision.backend.name,
        reason=_text(decision.reason),
        origin=_text(decision.origin),
        component=decision.component,
        layer=decision.layer,
    )


def emit_autotune_failed(
    component: str | None, layer: str | None, backend: str, error: str
) -> None:
    """WARNING: measuring a layer failed; it keeps its incumbent (``backend``)."""
    log = _logger(logging.WARNING)
    if log is None:
        return
    log.warning(
        "attention autotune failed",
        backend=backend,
        error=error,
        component=component,
        layer=layer,
    )


def summary_line(component: str, entries: Sequence[tuple[Role, Decision]]) -> str:
    """``Attention backends for vae: torch_sdpa (global backend fallback)``."""
    if not entries:
        return f"Attention backends for {component}: no attention layers"
    counts: Counter[tuple[str, str | None]] = Counter()
    for _, d in entries:
        counts[(d.backend.name if d.backend else "rejected", d.reason)] += 1
    parts = []
    for (backend, reason), n in counts.items():
        text = backend + (f" ({reason})" if reason else "")
        parts.append(text + (f" x{n}" if n > 1 else ""))
    return f"Attention backends for {component}: " + ", ".join(parts)


def emit_summary(state: ScopeState, entries: Sequence[tuple[Role, Decision]]) -> None:
    log = _logger(logging.INFO)
    if log is None:
        return
    log.info(
        summary_line(state.component, entries),
        component=state.component,
        kind=state.kind,
        layers=len(entries),
        summary=True,
    )


def emit_request_switch(action: str, backend: str, layers: int, previous: str) -> None:
    """``attention backend switched for request`` / ``... restored after request``
    (INFO): ``backend`` is the request's, ``previous`` what the layers ran before."""
    log = _logger(logging.INFO)
    if log is None:
        return
    text = (
        "attention backend switched for request"
        if action == "switch"
        else "attention backend restored after request"
    )
    log.info(text, backend=backend, layers=layers, previous=previous, request=True)


def emit_scope_problems(state: ScopeState, problems: Sequence[ScopeProblem]) -> None:
    """INFO: a scope's overrides did not explain its layers (SPEC 3.6): one event
    per failed check, with its code. INFO, not WARNING: the
    BackendNotAppliedError that follows is what alerts; this is the record."""
    log = _logger(logging.INFO)
    if log is None:
        return
    for problem in problems:
        log.info(
            "attention scope check failed",
            code=problem.code.value,
            component=state.component,
            kind=state.kind,
            message=problem.message,
        )


def emit_schedule_switch(step: int, backend: str, layers: int, previous: str) -> None:
    """``attention backend switched for step`` (INFO) at each switch of an
    :func:`attnres.schedule`; ``step`` -1 with no backend: restored at its end
    (issue 23)."""
    log = _logger(logging.INFO)
    if log is None:
        return
    if step < 0:
        log.info("attention backend restored after schedule", layers=layers, previous=previous)
        return
    log.info(
        "attention backend switched for step",
        step=step,
        backend=backend,
        layers=layers,
        previous=previous,
        schedule=True,
    )
