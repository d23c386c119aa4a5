"""Explanations built from traces: what was decided, every check, and why, as data.

:func:`explain` reads a :class:`~attnres.trace.Trace` (fresh or loaded from a
file) and returns an :class:`Explanation`: the outcome, the candidate rows
(every check in order, the skips and the machine's transitions), the stage
that accepted, what the requested backend failed, and one sentence saying why.
``attnres explain`` renders it as text and puts :meth:`Explanation.to_dict` in
its ``--json`` output; ``attnres plan`` uses :attr:`Explanation.fallback_failures`.
Nothing here prints.
"""

from __future__ import annotations

from typing import Any

from attrs import frozen

from attnres._states import Check, Event, Reason, State, Status
from attnres.backends import Backend
from attnres.errors import ResolutionError
from attnres.layer import LayerSpec, SelectionConfig
from attnres.machine import (
    GLOBAL_EXPLICIT_ORIGINS,
    TUNABLE_ORIGINS,
    Relaxation,
    global_flag_relaxation,
)
from attnres.platform import Platform
from attnres.runtime import resolve
from attnres.trace import (
    CheckRecord,
    OriginRecord,
    Outcome,
    SkipRecord,
    Trace,
    TransitionRecord,
)
from attnres.tuning import is_tunable, is_tuned

__all__ = [
    "CandidateRow",
    "Explanation",
    "autotune_plan",
    "describe_layer",
    "explain",
    "resolution_trace",
]


@frozen
class CandidateRow:
    """One row of an explanation: a check, a skipped candidate, or a transition."""

    kind: str  # "check" | "skip" | "transition"
    stage: State | None
    candidate: Backend | None
    check: Check | None
    passed: bool | None
    #: the failures' messages (check), why it was skipped (skip), or
    #: ``event: to target (sets reason: ...)`` (transition)
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "stage": None if self.stage is None else self.stage.value,
            "candidate": None if self.candidate is None else self.candidate.name,
            "check": None if self.check is None else self.check.value,
            "passed": self.passed,
            "detail": self.detail,
        }


@frozen
class Explanation:
    """Why a resolution ended as it did, in fields (see the module docstring)."""

    outcome: Outcome
    #: the origin record's words (where the request came from, how strict)
    origin_detail: str | None
    #: the backend origin detection found requested (``None``: nothing)
    requested: Backend | None
    #: the stage whose candidate was accepted (``None`` when rejected)
    accepted_stage: State | None
    #: what relaxes the operator's global backend here (``global_cli``, ``global_env``)
    relaxation: Relaxation | None
    #: the requested backend's failures when it failed, else every failed candidate's
    fallback_failures: str
    rows: tuple[CandidateRow, ...]
    #: one sentence: why this backend (or the rejection message)
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "why": self.why,
            "origin_detail": self.origin_detail,
            "requested": None if self.requested is None else self.requested.name,
            "accepted_stage": None if self.accepted_stage is None else self.accepted_stage.value,
            "fallback_failures": self.fallback_failures,
            "rows": [row.to_dict() for row in self.rows],
        }


def resolution_trace(layer: LayerSpec, config: SelectionConfig, platform: Platform) -> Trace:
    """Resolve ``layer`` in the current scope; its trace, selected or rejected."""
    try:
        return resolve(layer, config=config, platform=platform).trace
    except ResolutionError as exc:
        rejected: Trace = exc.trace  # annotated Any in attnres.errors (the floor)
        return rejected


def describe_layer(layer: LayerSpec) -> str:
    """``name: head size 64, bfloat16, self-attention; supported: ...; default: ...``."""
    supported = (
        "any" if layer.supported is None else ", ".join(sorted(b.name for b in layer.supported))
    )
    needed = ", ".join(r.value for r in layer.requirements.needed()) or "nothing"
    if layer.requirements.extended:  # issue 22: the mask kind in words
        needed += f" (mask: {layer.requirements.mask_kind})"
    name = f"{layer.name}: " if layer.name else ""
    # an integration route that runs exactly the supported set (no stand-in)
    route = f" (exactly, by its route: {layer.exact_route})" if layer.exact_route else ""
    return (
        f"{name}head size {layer.head_size}, {layer.dtype}, {layer.role.value}-attention; "
        f"supported: {supported}{route}; "
        f"default: {layer.default.name if layer.default else 'none'}; "
        f"requires: {needed}"
        # issue 24: the sequence-parallel layout, when the layer has one
        + ("" if layer.layout is None else f"; layout: {layer.layout.describe()}")
    )


def _rows(trace: Trace) -> tuple[CandidateRow, ...]:
    rows: list[CandidateRow] = []
    for record in trace.records:
        if isinstance(record, CheckRecord):
            rows.append(
                CandidateRow(
                    "check",
                    record.stage,
                    record.candidate,
                    record.check,
                    record.passed,
                    "; ".join(f.message for f in record.failures),
                )
            )
        elif isinstance(record, SkipRecord):
            rows.append(
                CandidateRow("skip", record.stage, record.candidate, None, None, record.detail)
            )
        elif isinstance(record, TransitionRecord):
            text = f"{record.event.value}: to {record.target.value}"
            if record.reason:
                text += f" (sets reason: {record.reason})"
            rows.append(CandidateRow("transition", record.source, record.candidate, None, None,
                                     text))  # fmt: skip
    return tuple(rows)


def _fallback_failures(failed: list[CheckRecord]) -> str:
    requested = [r for r in failed if r.stage is State.REQUESTED]
    chosen = requested or failed
    by_candidate: dict[str, list[str]] = {}
    for record in chosen:
        by_candidate.setdefault(record.candidate.name, []).extend(
            f.message for f in record.failures
        )
    return "; ".join(f"{name}: {'; '.join(msgs)}" for name, msgs in by_candidate.items())


def explain(trace: Trace) -> Explanation:
    """The :class:`Explanation` of one resolution's trace."""
    outcome = trace.outcome
    origin = next((r for r in trace.records if isinstance(r, OriginRecord)), None)
    requested = None if origin is None else origin.backend
    accepted = next(
        (
            r.source
            for r in trace.records
            if isinstance(r, TransitionRecord) and r.event is Event.ACCEPTED
        ),
        None,
    )
    failed = [r for r in trace.records if isinstance(r, CheckRecord) and not r.passed]
    relaxation = (
        global_flag_relaxation(trace.input) if outcome.origin in GLOBAL_EXPLICIT_ORIGINS else None
    )
    return Explanation(
        outcome=outcome,
        origin_detail=None if origin is None else origin.detail,
        requested=requested,
        accepted_stage=accepted,
        relaxation=relaxation,
        fallback_failures=_fallback_failures(failed),
        rows=_rows(trace),
        why=_why(outcome, requested, accepted, failed, relaxation),
    )


def _why(
    outcome: Outcome,
    requested_backend: Backend | None,
    accepted: State | None,
    failed: list[CheckRecord],
    relaxation: Relaxation | None,
) -> str:
    if outcome.status is not Status.SELECTED:
        return str(outcome.error)
    assert outcome.backend is not None
    chosen = outcome.backend.name
    requested = None if requested_backend is None else requested_backend.name
    stage = "?" if accepted is None else accepted.value
    requested_failures = "; ".join(
        f.message for r in failed if r.stage is State.REQUESTED for f in r.failures
    )
    others = sorted({r.candidate.name for r in failed if r.stage is not State.REQUESTED})
    skipped = f" (after {', '.join(others)} failed)" if others else ""
    reason = outcome.reason
    if reason is None:
        if requested is None:
            return (
                f"nothing was requested and the layer declares no default; {chosen} is the "
                f"first candidate of stage {stage} and passed every check."
            )
        return f"{chosen} was requested (origin {outcome.origin}) and passed every check."
    if reason is Reason.GLOBAL_BACKEND_FALLBACK:
        detail = " and ".join(relaxation.reasons()) if relaxation is not None else ""
        return (
            f"the operator's --attention-backend {requested} cannot serve this layer "
            f"({requested_failures}). The flag is relaxed here ({detail}), so the machine "
            f"fell back to {chosen}, accepted at stage {stage}{skipped}."
        )
    if reason is Reason.DENSE_CROSS_ATTENTION_FALLBACK:
        return (
            f"{requested} is a sparse backend and sparse backends never serve "
            f"cross-attention, so the machine fell back to the dense {chosen}, accepted at "
            f"stage {stage}{skipped}."
        )
    if reason is Reason.WRITTEN_BY_HAND:
        return (
            f"this layer is softmax attention its own code computes by hand, which only "
            f"that code runs ({chosen}): no kernel is offered there (issue 30). "
            f"{requested} (origin {outcome.origin}) cannot serve it ({requested_failures}), "
            f"so the site keeps its own code, accepted at stage {stage}{skipped}."
        )
    if reason is Reason.COMPONENT_CONSTRAINT:
        return (
            f"nothing was requested and the layer supports exactly one backend, {chosen}, "
            f"which passed every check."
        )
    if requested is not None and requested_failures:
        return (
            f"{requested} (origin {outcome.origin}) cannot serve this layer "
            f"({requested_failures}); as a preference it may fall back, and {chosen} was "
            f"accepted at stage {stage}{skipped} ({reason})."
        )
    return f"{chosen} was accepted at stage {stage}{skipped} ({reason})."


def autotune_plan(trace: Trace, config: SelectionConfig) -> dict[str, Any] | None:
    """What autotuning would do with this decision (``None`` when ``config`` does not tune).

    The ``autotune`` entry of ``attnres explain --json`` (and its text line).
    """
    if not config.autotune:
        return None
    origin = trace.outcome.origin
    if trace.outcome.status != Status.SELECTED:
        return {"tunable": False, "detail": "nothing to measure: the resolution was rejected"}
    if not is_tunable(trace):
        # say the rule that applies (issue 32 item 17: a layout's refusal was
        # worded as an explicit choice, origin none included)
        layout = trace.input.layer.layout
        if is_tuned(trace):
            detail = "not measured again: the decision holds a measurement already"
        elif origin in TUNABLE_ORIGINS and layout is not None:
            detail = (
                f"not measured: the layer runs under a sequence-parallel layout "
                f"({layout.ulysses_ring()}), where each rank would time its own shard and "
                f"could tune apart from the others"
            )
        else:
            detail = (
                f"not measured: origin {origin} is an explicit choice (only none, "
                f"layer_default and global_preference are tuned)"
            )
        return {"tunable": False, "detail": detail}
    return {
        "tunable": True,
        "detail": f"measured against every candidate that passes its checks on the layer's "
        f"first forward of at least {config.autotune_min_elements} query elements; "
        f"{trace.outcome.backend} stays unless one agrees and is more than "
        f"{config.autotune_margin:.0%} faster",
    }
