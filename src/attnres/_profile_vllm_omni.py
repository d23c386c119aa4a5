"""The ``vllm_omni`` selection profile: vLLM-Omni's diffusion rules as tables (issue 36).

``SelectionConfig(profile="vllm_omni")`` makes :func:`attnres.machine.run_machine`
decide the way vLLM-Omni 0.30.0's ``get_attn_backend_for_role(role, head_size,
attention_config, role_category, allow_trtllm_default)``
(``vllm_omni/diffusion/attention/selector.py``) does:

- :data:`ORIGIN_ROWS`: which entry of the ``AttentionConfig`` wins, in
  vLLM-Omni's order (``per_role[role]``, ``per_role[role_category]``,
  ``default``; none: the platform's default). ``"auto"`` never reaches the
  selector: ``AttentionConfig`` turns it into "no entry" at construction, so it
  is the absence of a row. The plugin writes them into the input as the
  layer's backend, the scope's backend (the scope's component is the role
  category) and ``SelectionConfig.global_backend``;
- :data:`FALLBACK_ROWS`: whether a candidate that cannot run the layer may be
  replaced. vLLM-Omni has no fallback: its platform refuses a configured
  backend it cannot run (the error is the answer, unchanged); where it would
  answer with a class the layer cannot run -- the class states it cannot take
  the layer's head size, which vLLM-Omni only checks for some backends and
  otherwise meets as a crash when the layer is built or run -- attnres does
  what this table says and records why;
- :data:`SOURCES`: the words vLLM-Omni logs for each origin.

The platform is observed, never enumerated: vLLM-Omni's per-platform chains
(``current_omni_platform.get_diffusion_attn_backend_cls``) are read through its
own ``_cached_get_backend_cls`` and recorded as
:class:`~attnres.platform.HostResolution` facts, so a trace replays without
vLLM-Omni.

The walker here is small on purpose and separate from the ``sglang`` one: both
are candidates for one rule engine (a profile as data read by ``run_machine``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from attrs import frozen

from attnres._outcome import Outcome
from attnres._states import Check, Code, Event, Origin, Reason, State, Status
from attnres.backends import Backend
from attnres.trace import (
    CheckRecord,
    Failure,
    OriginRecord,
    Record,
    RejectedRecord,
    SelectedRecord,
    Trace,
    TraceInput,
)

__all__ = [
    "FALLBACK_ROWS",
    "ORIGIN_ROWS",
    "SOURCES",
    "UNOBSERVED",
    "VLLM_OMNI_VERSION",
    "run_vllm_omni",
]

#: The vLLM-Omni release these rows were read from.
VLLM_OMNI_VERSION: Final = "0.30.0"


@frozen
class OriginRow:
    """One ``AttentionConfig`` entry: ``backend`` reads it from the input."""

    origin: Origin
    words: str
    backend: Callable[[TraceInput], Backend | None]


#: vLLM-Omni's precedence (``AttentionConfig.resolve_with_source``): the first
#: row whose backend is set wins; none set: the platform's default.
ORIGIN_ROWS: Final[tuple[OriginRow, ...]] = (
    OriginRow(Origin.LAYER, "attention_config.per_role[role]", lambda inp: inp.backend),
    OriginRow(
        Origin.COMPONENT_OVERRIDE,
        "attention_config.per_role[role_category] (role_category fallback)",
        lambda inp: None if inp.scope is None else inp.scope.backend,
    ),
    OriginRow(Origin.GLOBAL_CLI, "attention_config.default", lambda inp: inp.config.global_backend),
)

#: What vLLM-Omni logs as the source of each origin (``{role}``, ``{category}``:
#: the call's role and role category, as ``repr``).
SOURCES: Final[dict[Origin, str]] = {
    Origin.LAYER: "attention_config.per_role[{role}]",
    Origin.COMPONENT_OVERRIDE: "attention_config.per_role[{category}] (role_category fallback)",
    Origin.GLOBAL_CLI: "attention_config.default",
    Origin.NONE: "platform default",
}


@frozen
class FallbackRow:
    """When the served class cannot run the layer: ``replacement`` (``None``:
    refuse, typed, before the layer is built) and the reason recorded."""

    condition: str
    requested: bool
    replacement: Backend | None
    reason: Reason | None
    why: str


#: Keyed by "a backend was configured": the first row whose ``requested`` matches.
FALLBACK_ROWS: Final[tuple[FallbackRow, ...]] = (
    FallbackRow(
        "a configured backend (per_role or default)",
        True,
        None,
        None,
        "the operator chose it: vLLM-Omni would build the layer and fail at its first "
        "forward; attnres refuses at selection with the class's own head sizes",
    ),
    FallbackRow(
        "the platform's default",
        False,
        Backend("torch_sdpa"),
        Reason.PLATFORM_DEFAULT_FALLBACK,
        "nobody chose it: the platform picked it from a name and a head size "
        "(vllm-omni#3079, #3121); TORCH_SDPA takes every head size",
    ),
)

#: The failure of a candidate whose host resolution the input does not hold:
#: the plugin observes it and runs the machine again.
UNOBSERVED: Final = "not resolved by the host platform"

Step = Callable[
    [State, Event, list[Record], Reason | None, Backend | None], tuple[State, Reason | None]
]


def _origin(inp: TraceInput) -> tuple[OriginRow | None, Backend | None]:
    for row in ORIGIN_ROWS:
        backend = row.backend(inp)
        if backend is not None:
            return row, backend
    return None, None


def first_request(inp: TraceInput) -> Backend | None:
    """The backend the profile asks the host for first (``None``: its default)."""
    return _origin(inp)[1]


def run_vllm_omni(inp: TraceInput, step: Step) -> Trace:
    """The ``vllm_omni`` profile's machine: a pure function of the input."""
    row, requested = _origin(inp)
    origin = Origin.NONE if row is None else row.origin
    fallback = next(f for f in FALLBACK_ROWS if f.requested is (requested is not None))
    records: list[Record] = [
        OriginRecord(
            origin,
            requested,
            fallback.replacement is None,
            ("nothing configured: the platform default" if row is None else row.words)
            + f"; vllm_omni profile: {fallback.condition}",
        )
    ]
    if requested is not None:
        state, _ = step(State.ORIGIN_DETECTION, Event.REQUEST_FOUND, records, None, None)
    else:
        state, _ = step(State.ORIGIN_DETECTION, Event.NOTHING_REQUESTED, records, None, None)
        state, _ = step(state, Event.EXHAUSTED, records, None, None)
    candidates: list[Backend | None] = [requested]
    if fallback.replacement is not None:
        candidates.append(fallback.replacement)
    failure: Failure | None = None
    for index, candidate in enumerate(candidates):
        fact = inp.platform.host_resolution("" if candidate is None else candidate.name)
        if fact is None or fact.served is None:
            refused = Failure(Code.HOST_PLATFORM, UNOBSERVED if fact is None else str(fact.error))
            failure = failure or refused
            if candidate is not None:
                records.append(CheckRecord(state, candidate, Check.PLATFORM, False, (refused,)))
            # vLLM-Omni's platform refused: its error is the answer, never replaced
            event = Event.STRICT_FAILURE if state is State.REQUESTED else Event.CANDIDATE_FAILED
            state, _ = step(state, event, records, None, candidate)
            break
        served = Backend(fact.served)
        records.append(CheckRecord(state, served, Check.PLATFORM, True, ()))
        missing = tuple(
            Failure(Code.REQUIREMENT_UNMET, f"{served.name} cannot take {m}") for m in fact.missing
        )
        records.append(CheckRecord(state, served, Check.REQUIREMENTS, not missing, missing))
        if not missing:
            reason = fallback.reason if index > 0 else None
            step(state, Event.ACCEPTED, records, None, served)
            records.append(SelectedRecord(served, origin, reason))
            return Trace(inp, tuple(records), Outcome(Status.SELECTED, origin, served, reason))
        failure = failure or Failure(
            Code.REQUIREMENT_UNMET, f"{missing[0].message} ({fallback.why})"
        )
        if state is State.REQUESTED:
            state, _ = step(state, Event.STRICT_FAILURE, records, None, served)
            break
        state, _ = step(state, Event.CANDIDATE_FAILED, records, None, served)
    while state is not State.REJECTED:
        state, _ = step(state, Event.EXHAUSTED, records, None, None)
    assert failure is not None
    records.append(RejectedRecord(origin, failure.code, failure.message))
    outcome = Outcome(Status.REJECTED, origin, None, None, failure.code, failure.message)
    return Trace(inp, tuple(records), outcome)
