"""The records of a trace: what the machine emits for one resolution, and the
full input it resolved (:class:`TraceInput`); the schema versions that say which
records and fields a trace file may hold.

Records are data only: frozen attrs classes typed with the vocabulary's enums.
Turning them into JSON and back, strictly, is :mod:`attnres._trace_codec`'s
work; the trace document (its digest, canonical text, files) is
:mod:`attnres.trace`'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from attrs import field, frozen

from attnres._states import (
    Check,
    Code,
    Event,
    Origin,
    Reason,
    State,
    Verdict,
    optional_reason,
    to_code,
)
from attnres._vocab import Role
from attnres.backends import Backend
from attnres.errors import ArgumentTypeError, ScopeProblem
from attnres.layer import LayerSpec, SelectionConfig, optional_backend
from attnres.platform import Platform

__all__ = [
    "BASE_SCHEMA_VERSION",
    "KERNELS_SCHEMA_VERSION",
    "LAYOUT_KINDS_SCHEMA_VERSION",
    "LAYOUT_SCHEMA_VERSION",
    "MASK_SCHEMA_VERSION",
    "PRECISION_SCHEMA_VERSION",
    "RECORD_KINDS",
    "SCHEMA_VERSION",
    "TUNED_SCHEMA_VERSION",
    "CheckRecord",
    "ErrorMeasurement",
    "Failure",
    "MeasurementRecord",
    "OriginRecord",
    "PrecisionRecord",
    "Record",
    "RejectedRecord",
    "ScopeProblem",
    "ScopeState",
    "SelectedRecord",
    "SkipRecord",
    "TraceInput",
    "TransitionRecord",
    "TuningRecord",
]

#: The newest schema version this attnres reads. Bumped when a field is added,
#: removed, renamed or changes meaning (docs/trace-format.md). A trace is
#: written with the lowest version that can express it: a rule-based resolution
#: is version 2 (the backward requirement), a tuned one is version 3, one whose
#: input carries the process's kernel facts (``no_kernel``) or whose layer names
#: a mask kind or a causal alignment (issue 22) version 4, one whose layer has a
#: sequence-parallel layout version 5 (issue 24), one that holds an error
#: budget or measured errors version 6 (issue 34), one whose layout is a layout
#: kind of issue 35 version 7.
SCHEMA_VERSION = 7
#: The version of a trace whose layer names a mask kind or a causal alignment
#: (issue 22): its requirements carry ``mask`` and ``causal_alignment`` keys.
MASK_SCHEMA_VERSION = 4
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
#: Issue 34: the version of a trace whose config holds an error budget
#: (``attention_error``) or whose input holds measured errors
#: (``measured_error``), with ``precision`` checks and records; it holds what
#: version 5 holds too.
PRECISION_SCHEMA_VERSION = 6
#: Issue 35: the version of a trace whose layer's layout is AllGather-KV, pads
#: its heads, or was chosen by ``layout="auto"`` (the layout's ``allgather``,
#: ``pad_heads``, ``rule`` and ``why`` keys); version 6 is the precision issue's.
LAYOUT_KINDS_SCHEMA_VERSION = 7

#: The requirement keys of a schema-1 trace (attnres 0.1): later requirements
#: did not exist, so such a trace reads them as false, and its digest is computed
#: over the keys it has.
SCHEMA_1_REQUIREMENTS: tuple[str, ...] = ("causal", "attn_mask", "packed_varlen", "gqa", "dropout")


@frozen
class Failure:
    """One failed check: a machine-readable code and a message for people."""

    code: Code = field(converter=to_code)
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
    code: Code = field(converter=to_code)
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
    #: issue 34: its relative L2 error against a float64 reference, measured when
    #: the layer has a numeric error budget (written only then: schema 6)
    rel_l2: float | None = field(default=None, kw_only=True, metadata={"omit_default": True})
    kind: str = field(default="measurement", init=False)


@frozen
class ErrorMeasurement:
    """Issue 34: one kernel's error on a layer's own inputs, against a float64
    reference (``attnres.calibrate``, autotune, or a results file).

    ``rel_l2`` is ``||out - ref||_2 / ||ref||_2``, ``max_abs`` the largest
    absolute difference, ``cosine`` the cosine similarity of the flattened
    outputs; ``call`` describes the inputs (shapes, dtype); ``emulated`` says the
    figures come from attnres's CPU emulation of the kernel
    (:mod:`attnres.kernels.sage_emulated`), not from the kernel itself;
    ``source`` is ``measured`` or ``loaded`` (a results file).
    """

    backend: Backend
    rel_l2: float
    max_abs: float
    cosine: float
    call: str
    emulated: bool = False
    source: str = "measured"


@frozen
class PrecisionRecord:
    """Issue 34: the accepted candidate against the layer's error budget (schema 6).

    Written just before the terminal ``selected`` record when the layer has a
    budget: ``precision`` is ``exact``, ``lossy`` or ``undeclared`` (the spec
    states no precision facts), ``how`` the facts in words and their source;
    ``budget`` is ``exact`` or the relative L2 error allowed, ``budget_key``
    which ``--attention-error`` key set it (``*``: every component);
    ``measured`` the kernel's measured error on this layer's inputs (``None``:
    admitted by its facts, not measured yet).
    """

    candidate: Backend
    precision: str
    how: str
    budget: str
    budget_key: str
    measured: ErrorMeasurement | None = None
    kind: str = field(default="precision", init=False)


Record = (
    OriginRecord
    | TransitionRecord
    | CheckRecord
    | SkipRecord
    | SelectedRecord
    | RejectedRecord
    | TuningRecord
    | MeasurementRecord
    | PrecisionRecord
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
    "precision": PrecisionRecord,
}
#: Record kinds, states and events that need schema version 3 (autotune).
TUNED_KINDS = frozenset({"tuning", "measurement"})
TUNED_STATES = frozenset({State.MEASURING})
TUNED_EVENTS = frozenset({Event.MEASURE, Event.MEASURED_FASTER, Event.INCUMBENT_KEPT})


def _measurements(value: Any) -> tuple[ErrorMeasurement, ...]:
    out = tuple(value)
    for item in out:
        if not isinstance(item, ErrorMeasurement):
            raise ArgumentTypeError(
                f"measured_error: expected ErrorMeasurement records, got {item!r}"
            )
    return out


_PARSE_INPUT_BACKEND = optional_backend("backend")


def _input_backend(value: Backend | str | None) -> Backend | None:
    return _PARSE_INPUT_BACKEND(value)


def _role_pairs(value: Iterable[tuple[Role, Backend]]) -> tuple[tuple[Role, Backend], ...]:
    return tuple(value)


@frozen(cache_hash=True)
class ScopeState:
    """The snapshot of a component scope that a resolution (and its trace) sees."""

    component: str
    kind: str
    loader: str
    backend: Backend | None = None
    role_backends: tuple[tuple[Role, Backend], ...] = field(default=(), converter=_role_pairs)
    allow_global_fallback: bool = False
    require_selection: bool = False

    def role_backend(self, role: Role) -> Backend | None:
        for r, b in self.role_backends:
            if r is role:
                return b
        return None


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

    #: issue 34: kernels' measured errors on this layer's inputs (``attnres.calibrate``
    #: or a results file): the ``precision`` check reads them. Written only when
    #: set (schema 6).
    measured_error: tuple[ErrorMeasurement, ...] = field(
        default=(), kw_only=True, converter=_measurements, metadata={"omit_default": True}
    )

    def schema_version(self) -> int:
        """The lowest schema version that can express this input."""
        version = BASE_SCHEMA_VERSION if self.no_kernel is None else KERNELS_SCHEMA_VERSION
        if self.layer.requirements.extended:  # issue 22: a mask kind or an alignment
            version = max(version, MASK_SCHEMA_VERSION)
        if self.layer.layout is not None:  # issue 24: a sequence-parallel layout
            version = max(version, LAYOUT_SCHEMA_VERSION)
            layout = self.layer.layout
            if layout.allgather > 1 or layout.pad_heads or layout.rule is not None:
                version = max(version, LAYOUT_KINDS_SCHEMA_VERSION)  # issue 35
        if self.config.attention_error or self.measured_error:  # issue 34
            version = max(version, PRECISION_SCHEMA_VERSION)
        return version
