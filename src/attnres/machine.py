"""The decision core: the transition table, origin detection, the checks, run_machine().

Everything that decides which backend a layer runs lives in this module; other
modules only name things (``_states``), record them (``trace``) or act on the
outcome. The core is pure: no context variables, cache, ledger, logging or I/O
-- :mod:`attnres.runtime` gathers a :class:`~attnres.trace.TraceInput` and
calls :func:`run_machine`.

The policy as tables
--------------------
One machine walks every selection profile (issue 33): a profile is a value
(:class:`attnres._profile.Profile`); :data:`ATTNRES` is attnres's own contract,
``attnres._profile_sglang.SGLANG`` and ``attnres._profile_vllm_omni.VLLM_OMNI``
the hosts', and :data:`PROFILES` maps ``SelectionConfig.profile`` to them.
attnres's rows, each table with its rule and source beside it:
``TRANSITIONS`` (shared by every profile), ``ORIGIN_ROWS`` (SPEC 3.1, 3.2),
``START_GUARDS`` and ``REQUEST_FAILURE_GUARDS``, ``CANDIDATE_STAGES``,
``CHECK_ORDER``, ``STRICT_ORIGINS``, ``_PRIMARY_ORDER``, ``SUPPORTED_RULES``,
``REQUIREMENTS_BEFORE_SUPPORTED``, ``PRECISION_RULES`` (issue 34),
``REQUEST_RULES`` and the training re-resolution (SPEC 3.8), the measuring
stage of autotune (``TUNABLE_ORIGINS``, ``VERDICT_RULES``; the timing is
:mod:`attnres.autotuner`'s), ``LAYOUT_RULES`` (issue 35) and ``SCOPE_CHECKS``
(SPEC 3.6). Beside the core, read by it: the platform chains
(:data:`attnres.platform.DEFAULT_CHAINS`), the component kinds
(:data:`attnres.scope.BUILTIN_KINDS`) and the backend catalogue
(:data:`attnres.backends.BUILTIN_SPECS`). ``docs/state-machine.md`` renders
these tables (``scripts/gen_state_diagram.py``; ``tests/test_docs.py`` fails
when it drifts).

What is code, not data, and why:

- the checks themselves (``_check_*``): each reads several spec fields with
  its own rule (capability ranges, head-size rules, requirement limits);
- the "usable here" skip of a platform chain: every entry but the last is
  passed over when its package, kernel, device, dtype or head size fail here
  (``_not_usable_here``, the ``available`` and ``platform`` checks reused);
- the candidate lists (``stage_candidates``) and skipping a candidate
  already evaluated at an earlier stage;
- the rejection messages.

Theory of operation
-------------------
A resolution starts in ``origin_detection``, which finds the requested
backend and whether the request is strict (SPEC 3.1, 3.2). The machine then
walks the candidate stages in order -- ``requested``, ``component_default``,
``platform_default``, ``supported_set`` -- skipping candidates already
evaluated. Every candidate runs every check, and every check is recorded. The
first candidate that passes every check moves the machine to ``selected``; a
failure moves it along the table. A strict request that fails goes to
``rejected``, except a sparse backend on a cross-attention layer, which always
falls back to a dense one (SPEC 3.3). Running out of candidates is
``rejected``. The first transition that carries a reason fixes the outcome's
reason (``None`` when the first candidate was accepted).

:func:`run_machine` is a pure function of its input (which carries the
platform's package facts and -- for a layer that will run -- the process's
kernel facts, ``no_kernel``) and of the backend specs it reads, whose changes
clear the runtime's cache.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Final

import attrs
from attrs import field, frozen

from attnres._profile import (
    Asked,
    Evaluation,
    Given,
    Guard,
    GuardFacts,
    OriginRow,
    Profile,
    Results,
    Tried,
    first_event,
    first_guard,
    requested_by,
)
from attnres._profile_sglang import SGLANG
from attnres._profile_vllm_omni import VLLM_OMNI
from attnres._states import (
    Check,
    Code,
    Event,
    Origin,
    PackageStatus,
    Reason,
    ScopeCode,
    State,
    Status,
    Verdict,
)
from attnres._vocab import (
    MASK_KIND_PHRASES,
    PLATFORM_KINDS,
    REQUIREMENT_PHRASES,
    CausalAlignment,
    MaskKind,
    MaskRoute,
    Requirement,
    Role,
)
from attnres.backends import (
    Backend,
    BackendSpec,
    KernelFacts,
    Precision,
    catalogue_order,
    lookup_spec,
    precision_of,
)
from attnres.errors import InvalidArgumentError
from attnres.kernels import KernelSource, kernel_source
from attnres.kernels.lse import has_lse_kernel, lse_has_gradient, lse_kernel_names
from attnres.layer import EVERY_COMPONENT, EXACT, ErrorBudget, LayerSpec, describe_budget
from attnres.layout import LAYOUT_KINDS, MAX_PAD_COST, SequenceLayout, _degree
from attnres.platform import Platform
from attnres.records import ScopeProblem
from attnres.scope import ScopeState, component_kind
from attnres.trace import (
    TUNED_SCHEMA_VERSION,
    CheckRecord,
    ErrorMeasurement,
    Failure,
    MeasurementRecord,
    OriginRecord,
    Outcome,
    PrecisionRecord,
    Record,
    RejectedRecord,
    SelectedRecord,
    SkipRecord,
    Trace,
    TraceInput,
    TransitionRecord,
    TuningRecord,
)

if TYPE_CHECKING:
    from attnres.ledger import Decision

__all__ = [
    "ATTNRES",
    "CANDIDATE_STAGES",
    "CHECK_ORDER",
    "GLOBAL_EXPLICIT_ORIGINS",
    "LAYOUT_CHECK_ORDER",
    "LAYOUT_RULES",
    "NO_KERNEL",
    "ORIGIN_ROWS",
    "PRECISION_RULES",
    "PREFERRED_STAGES",
    "PROFILES",
    "REQUEST_FAILURE_GUARDS",
    "REQUEST_RULES",
    "REQUIREMENTS_BEFORE_SUPPORTED",
    "SCOPE_CHECKS",
    "START_GUARDS",
    "STRICT_ORIGINS",
    "SUPPORTED_RULES",
    "TRANSITIONS",
    "TUNABLE_ORIGINS",
    "VERDICT_RULES",
    "Budget",
    "Guard",
    "GuardFacts",
    "LayoutFacts",
    "Measured",
    "Relaxation",
    "RequestRefusal",
    "ScopeProblem",
    "backward_everywhere",
    "check_candidate",
    "choose_layout",
    "detect_origin",
    "first_event",
    "global_flag_relaxation",
    "has_backward_pass",
    "is_tunable",
    "is_tuned",
    "layer_budget",
    "measuring_checks",
    "numeric_budget",
    "primary_check",
    "replay_tuned",
    "request_refusal",
    "run_machine",
    "scope_not_applied",
    "scope_unexplained",
    "stage_candidates",
    "training_spec",
    "tuned_trace",
    "verdicts",
    "written_by_hand",
]

# -- The transition table: state -> event -> (next state, reason it sets) --
# A reason is set by the first transition that carries one and then kept; the
# outcome's reason is the one set when the machine reaches ``selected``.

TRANSITIONS: Final[Mapping[State, Mapping[Event, tuple[State, Reason | None]]]] = {
    State.ORIGIN_DETECTION: {
        # something was requested (SPEC 3.1): evaluate it first
        Event.REQUEST_FOUND: (State.REQUESTED, None),
        # nothing requested: the layer's default, then the platform's chain
        Event.NOTHING_REQUESTED: (State.COMPONENT_DEFAULT, None),
        # nothing requested, no default, exactly one supported backend (SPEC 3.5)
        Event.SINGLE_SUPPORTED: (State.SUPPORTED_SET, Reason.COMPONENT_CONSTRAINT),
    },
    State.REQUESTED: {
        Event.ACCEPTED: (State.SELECTED, None),
        # a strict origin stops after stage 1 (SPEC 3.1)
        Event.STRICT_FAILURE: (State.REJECTED, None),
        # an explicit global flag, relaxed for this layer (SPEC 3.2)
        Event.GLOBAL_FALLBACK: (State.COMPONENT_DEFAULT, Reason.GLOBAL_BACKEND_FALLBACK),
        # a derived preference or a layer default that cannot serve
        Event.PREFERENCE_FALLBACK: (State.COMPONENT_DEFAULT, Reason.PLATFORM_DEFAULT_FALLBACK),
        # sparse never serves cross-attention, whatever the origin (SPEC 3.3)
        Event.SPARSE_CROSS_FALLBACK: (
            State.COMPONENT_DEFAULT,
            Reason.DENSE_CROSS_ATTENTION_FALLBACK,
        ),
        # issue 30: a relaxed request on softmax attention written by hand, whose
        # route runs only the site's own code
        Event.BY_HAND_FALLBACK: (State.COMPONENT_DEFAULT, Reason.WRITTEN_BY_HAND),
    },
    State.COMPONENT_DEFAULT: {
        Event.ACCEPTED: (State.SELECTED, None),
        Event.CANDIDATE_FAILED: (State.COMPONENT_DEFAULT, Reason.PLATFORM_DEFAULT_FALLBACK),
        Event.EXHAUSTED: (State.PLATFORM_DEFAULT, None),
    },
    State.PLATFORM_DEFAULT: {
        Event.ACCEPTED: (State.SELECTED, None),
        Event.CANDIDATE_FAILED: (State.PLATFORM_DEFAULT, Reason.PLATFORM_DEFAULT_FALLBACK),
        Event.EXHAUSTED: (State.SUPPORTED_SET, None),
    },
    State.SUPPORTED_SET: {
        Event.ACCEPTED: (State.SELECTED, None),
        Event.CANDIDATE_FAILED: (State.SUPPORTED_SET, Reason.PLATFORM_DEFAULT_FALLBACK),
        Event.EXHAUSTED: (State.REJECTED, None),
    },
    # autotune (SelectionConfig(autotune=True)): a selected decision of a
    # TUNABLE_ORIGINS origin is measured against its candidates on its first
    # large forward (attnres.tuning); the terminal record follows the measurement
    State.SELECTED: {Event.MEASURE: (State.MEASURING, None)},
    State.MEASURING: {
        # a candidate agreed with the incumbent and beat it by more than the margin
        Event.MEASURED_FASTER: (State.SELECTED, Reason.MEASURED_FASTER),
        Event.INCUMBENT_KEPT: (State.SELECTED, None),
    },
    State.REJECTED: {},
}

#: The stages that evaluate candidates, in order.
CANDIDATE_STAGES: Final = (
    State.REQUESTED,
    State.COMPONENT_DEFAULT,
    State.PLATFORM_DEFAULT,
    State.SUPPORTED_SET,
)

#: The checks every candidate runs, in order (SPEC 3.4).
CHECK_ORDER: Final = (
    Check.KNOWN,
    Check.AVAILABLE,
    Check.PLATFORM,
    Check.ROLE,
    Check.SUPPORTED,
    Check.REQUIREMENTS,
)

#: Issue 24: the checks a candidate runs when the layer has a sequence-parallel
#: layout (``LayerSpec.layout``): every check above, then ``layout``.
LAYOUT_CHECK_ORDER: Final = (*CHECK_ORDER, Check.LAYOUT)

#: Origins whose failure rejects (SPEC 3.1); ``global_cli`` depends on 3.2.
STRICT_ORIGINS: Final = frozenset(
    {Origin.REQUEST, Origin.LAYER, Origin.FORCED, Origin.ROLE_OVERRIDE, Origin.COMPONENT_OVERRIDE}
)

#: Origins of an explicit global backend the operator chose (relaxed per SPEC 3.2).
GLOBAL_EXPLICIT_ORIGINS: Final = frozenset({Origin.GLOBAL_CLI, Origin.GLOBAL_ENV})

# -- The guards: which event fires, as ordered (condition, event) rows --
# Where the table above has more than one way out of a state, the first row
# whose condition holds picks the event. Conditions read a GuardFacts: the
# facts about the request, nothing else (attnres._profile defines both).


#: Leaving ``origin_detection``, in order.
START_GUARDS: Final[tuple[Guard, ...]] = (
    Guard("something was requested", lambda f: f.requested, Event.REQUEST_FOUND),
    Guard(
        "no layer default, exactly one supported backend",
        lambda f: f.single_supported,
        Event.SINGLE_SUPPORTED,
    ),
    Guard("otherwise", lambda f: True, Event.NOTHING_REQUESTED),
)

#: When the requested candidate fails at ``requested``, in order (SPEC 3.1-3.3).
REQUEST_FAILURE_GUARDS: Final[tuple[Guard, ...]] = (
    Guard(
        "its role check failed (sparse on cross-attention), whatever the origin",
        lambda f: f.role_failed,
        Event.SPARSE_CROSS_FALLBACK,
    ),
    Guard("the request is strict", lambda f: f.strict, Event.STRICT_FAILURE),
    Guard(
        "the layer is softmax attention written by hand: its route runs exactly `eager`, "
        "the site's own code (`written_by_hand`)",
        lambda f: f.by_hand,
        Event.BY_HAND_FALLBACK,
    ),
    Guard(
        "the operator's explicit global backend (flag or environment), relaxed for this layer",
        lambda f: f.global_explicit,
        Event.GLOBAL_FALLBACK,
    ),
    Guard("otherwise (a preference or a layer default)", lambda f: True, Event.PREFERENCE_FALLBACK),
)


#: Origins whose decision autotune may measure and replace: the automatic ones.
#: A backend the operator or the code asked for (every other origin) is never
#: tuned. Adding an origin to the vocabulary means deciding here whether it is
#: automatic.
TUNABLE_ORIGINS: Final = frozenset({Origin.NONE, Origin.LAYER_DEFAULT, Origin.GLOBAL_PREFERENCE})

#: The ``supported`` check, one row per rule: (code, the rule). A candidate
#: passes when every row holds; the first row that fails is its failure. A
#: layer's ``exact_route`` is what an integration route executes exactly (the
#: transformers attention interface, a module's own code path): the machine,
#: not the integration after the fact, keeps a stand-in off it, so a relaxed
#: origin falls back and a strict one is rejected, traced like any failure.
SUPPORTED_RULES: Final[tuple[tuple[Code, str], ...]] = (
    (
        Code.NOT_IN_SUPPORTED_SET,
        "the backend is in the layer's supported set, or stands in for every name of one "
        "group of its `satisfies` (`torch_cudnn_sdpa` for `torch_sdpa`); a layer with no "
        "set admits any backend",
    ),
    (
        Code.NOT_ON_ROUTE,
        "a layer whose route runs exactly its supported set (`LayerSpec.exact_route`: "
        "the transformers attention interface, diffusers' context-parallel dispatcher, a "
        "module's own code path) takes only the backends the set names: a stand-in does "
        "not count",
    ),
)

#: Requirements named before the layer's supported set (issue 19), one row per
#: requirement: (requirement, why). A route limited to the backends that meet one
#: of them is limited *by* it, so a strict candidate that fails both the set and
#: the requirement is rejected for the requirement (``requirement_unmet``, the
#: kernel's limit), the set named after it.
REQUIREMENTS_BEFORE_SUPPORTED: Final[tuple[tuple[Requirement, str], ...]] = (
    (
        Requirement.WEIGHTS,
        "returning the attention weights (`torch.nn.MultiheadAttention` called with "
        "`need_weights`): no fused kernel materialises the softmax matrix, so the route "
        "that returns them runs only its own code (eager math)",
    ),
)

#: Which check's failure names a strict rejection, most fundamental first
#: (:func:`primary_check`: a requirement of ``REQUIREMENTS_BEFORE_SUPPORTED`` first).
_PRIMARY_ORDER: Final = (
    Check.KNOWN,
    Check.SUPPORTED,
    Check.ROLE,
    Check.REQUIREMENTS,
    Check.LAYOUT,
    Check.PRECISION,
    Check.PLATFORM,
    Check.AVAILABLE,
)


# -- Origin detection (SPEC 3.1, 3.2) --


@frozen
class Relaxation:
    """What relaxes the operator's explicit global flag for one layer (SPEC 3.2).

    Structured, so that explanations are rendered from fields rather than parsed
    back from the origin record's text (which :meth:`describe` writes).
    """

    #: the layer's declared default, when it has one (it relaxes the flag)
    layer_default: Backend | None
    #: the component scope, if any; ``scope.allow_global_fallback`` relaxes it
    scope: ScopeState | None

    @property
    def by_scope(self) -> bool:
        return self.scope is not None and self.scope.allow_global_fallback

    @property
    def relaxed(self) -> bool:
        return self.layer_default is not None or self.by_scope

    def reasons(self) -> list[str]:
        """Each thing that relaxes the flag, in words (empty when it is strict)."""
        out: list[str] = []
        if self.layer_default is not None:
            out.append(f"the layer declares default {self.layer_default.name!r}")
        if self.scope is not None and self.scope.allow_global_fallback:
            scope = self.scope
            out.append(
                f"component {scope.component!r} ({scope.kind}, {scope.loader}) allows "
                f"global fallback"
            )
        return out

    def describe(self) -> str:
        """``relaxed: ...`` or ``strict: ...``: the origin record's words."""
        if self.relaxed:
            return "relaxed: " + " and ".join(self.reasons())
        if self.scope is None:
            return "strict: no component scope (a component of unknown kind)"
        scope = self.scope
        return (
            f"strict: component {scope.component!r} ({scope.kind}, {scope.loader}) does "
            f"not allow global fallback and the layer declares no default"
        )


def global_flag_relaxation(inp: Asked) -> Relaxation:
    """What would relax an explicit global flag for this input's layer."""
    return Relaxation(inp.layer.default, inp.scope)


@frozen
class DetectedOrigin:
    origin: Origin
    backend: Backend | None
    strict: bool
    detail: str
    #: the origin row is explicit
    explicit: bool = False
    #: the fallback row that decides a failed request (``Profile.request_failure``),
    #: when the origin record names it (``Profile.states_fallback``)
    on_failure: Guard | None = None


#: issue 23: the stages whose candidates are automatic choices, which a layer's
#: ``preferred`` set narrows (a candidate outside it is skipped, with a record).
PREFERRED_STAGES: Final = frozenset({State.PLATFORM_DEFAULT, State.SUPPORTED_SET})


def _preferred_unusable(inp: TraceInput) -> str:
    """Why no backend of the layer's ``preferred`` set can run here, one clause
    each; ``''`` when one can (or the layer declares no preferred set)."""
    layer = inp.layer
    if layer.preferred is None:
        return ""
    why = []
    for backend in _in_catalogue_order(layer.preferred):
        results = check_candidate(backend, layer, inp.platform, inp.needs_kernel, inp.no_kernel)
        failures = [f for _, found in results for f in found]
        if not failures:
            return ""
        why.append(f"{backend.name}: {failures[0].message}")
    return "; ".join(why)


def _in_catalogue_order(backends: Iterable[Backend]) -> list[Backend]:
    """The catalogue's order, then the name (a deterministic order for any set)."""
    return sorted(backends, key=lambda b: (catalogue_order(b), b.name))


def _preferred_note(given: Given) -> str:
    """Issue 32 item 6: the origin record names a preferred set that cannot run here."""
    unusable, preferred = given.preferred_unusable, given.inp.layer.preferred
    if not unusable:
        return ""
    assert preferred is not None
    return (
        f"; none of the layer's preferred set {_names(preferred)} can run here "
        f"({unusable}), so automatic choices fall back outside it"
    )


def _overridden(inp: Asked) -> str:
    """What a layer's required backend overrides, in words (issue 23)."""
    parts = []
    if inp.request is not None:
        parts.append(f"the per-request backend {inp.request.name!r}")
    if inp.backend is not None and inp.backend != inp.layer.required:
        parts.append(f"the backend {inp.backend.name!r} passed for this layer")
    return "; it overrides " + " and ".join(parts) if parts else ""


def _explicit(
    words: str, detail: Callable[[Asked], str] | None = None
) -> Callable[[Asked, Backend], str]:
    """An explicit origin's words; issue 23: a backend outside the layer's
    preferred set is admitted on its checks, and the record says so."""

    def describe(inp: Asked, backend: Backend) -> str:
        text = words if detail is None else detail(inp)
        preferred = inp.layer.preferred
        if preferred is None or backend in preferred:
            return text
        return (
            text + f"; outside the layer's preferred set {_names(preferred)}, admitted by "
            f"its supported set when every check passes"
        )

    return describe


def _role_backend(inp: Asked) -> Backend | None:
    scope = inp.scope
    if scope is None:
        return None
    return scope.role_backend(inp.layer.role) or inp.config.role_backend(
        scope.component, inp.layer.role
    )


def _role_words(inp: Asked) -> str:
    scope, role = inp.scope, inp.layer.role.value
    assert scope is not None  # the row is set only under a scope
    via = ""
    if scope.role_backend(inp.layer.role) is None:
        via = f" (--attention-backend {scope.component}.{role}=...)"
    return (
        f"component {scope.component!r} override for {role}-attention layers "
        f"({scope.component}.{role}){via}"
    )


def _component_backend(inp: Asked) -> Backend | None:
    scope = inp.scope
    if scope is None:
        return None
    return scope.backend or inp.config.component_backend(scope.component)


def _component_words(inp: Asked) -> str:
    assert inp.scope is not None  # the row is set only under a scope
    return f"component {inp.scope.component!r} override"


def _global(preference: bool, env: bool) -> Callable[[Asked], Backend | None]:
    """The global backend as a preference, or as the operator's flag or variable."""

    def read(inp: Asked) -> Backend | None:
        cfg = inp.config
        if cfg.global_backend_explicit is preference:
            return None
        if not preference and (cfg.global_backend_env is not None) is not env:
            return None
        return cfg.global_backend

    return read


def _global_env_words(inp: Asked) -> str:
    return (
        f"{inp.config.global_backend_env} set in the environment by the operator; "
        f"{global_flag_relaxation(inp).describe()}"
    )


def _global_cli_words(inp: Asked) -> str:
    return f"--attention-backend set by the operator; {global_flag_relaxation(inp).describe()}"


#: SPEC 3.1, 3.2: attnres's origins in order -- the first row whose backend is
#: set wins. Explicit origins are strict (SPEC 3.1) except the operator's
#: global backend, relaxed per layer (SPEC 3.2: ``Relaxation``).
ORIGIN_ROWS: Final[tuple[OriginRow, ...]] = (
    OriginRow(  # issue 23: pinned for correctness, whatever is asked
        Origin.LAYER,
        "required by the layer for correctness (LayerSpec.required)",
        True,
        attrgetter("layer.required"),
        _explicit(
            "",
            lambda inp: (
                "required by the layer for correctness (LayerSpec.required)" + _overridden(inp)
            ),
        ),
    ),
    OriginRow(
        Origin.REQUEST,
        "backend requested for one request (attnres.request_backend)",
        True,
        attrgetter("request"),
        _explicit("backend requested for one request (attnres.request_backend)"),
    ),
    OriginRow(
        Origin.LAYER,
        "backend passed explicitly for this layer",
        True,
        attrgetter("backend"),
        _explicit("backend passed explicitly for this layer"),
    ),
    OriginRow(
        Origin.FORCED,
        "process-wide forced backend",
        True,
        attrgetter("config.forced_backend"),
        _explicit("process-wide forced backend"),
    ),
    OriginRow(
        Origin.ROLE_OVERRIDE,
        "the component's override for the layer's role (scope, or --attention-backend "
        "COMPONENT.ROLE=...)",
        True,
        _role_backend,
        _explicit("", _role_words),
    ),
    OriginRow(
        Origin.COMPONENT_OVERRIDE,
        "the component override (scope, or --attention-backend COMPONENT=...)",
        True,
        _component_backend,
        _explicit("", _component_words),
    ),
    OriginRow(
        Origin.GLOBAL_PREFERENCE,
        "global backend preference, derived or defaulted (not typed by the operator)",
        False,
        _global(preference=True, env=False),
    ),
    OriginRow(
        Origin.GLOBAL_ENV,
        "the global backend set in the environment by the operator",
        True,
        _global(preference=False, env=True),
        _explicit("", _global_env_words),
    ),
    OriginRow(
        Origin.GLOBAL_CLI,
        "--attention-backend set by the operator",
        True,
        _global(preference=False, env=False),
        _explicit("", _global_cli_words),
    ),
    OriginRow(
        Origin.LAYER_DEFAULT,
        "nothing requested: the layer's default",
        False,
        attrgetter("layer.default"),
    ),
)


def detect_origin(inp: TraceInput) -> DetectedOrigin:
    """The first origin that applies (by the input's profile), the backend it
    requests, its strictness and the fallback row that decides its failure."""
    return _detect(PROFILES[inp.config.profile], inp)


def _detect(profile: Profile, inp: TraceInput) -> DetectedOrigin:
    row, backend = requested_by(profile, inp)
    if row is None:
        found = DetectedOrigin(Origin.NONE, None, False, profile.nothing_requested)
    else:
        assert backend is not None  # a row is found by its backend
        detail = row.words if row.detail is None else row.detail(inp, backend)
        strict = row.explicit and not (row.origin in GLOBAL_EXPLICIT_ORIGINS and _relaxed(inp))
        found = DetectedOrigin(row.origin, backend, strict, detail, row.explicit)
    if not profile.states_fallback:
        return found  # the fallback row is read when the request fails
    guard = _failure_guard(profile, inp, found)
    return DetectedOrigin(
        found.origin,
        backend,
        guard.event is Event.STRICT_FAILURE,
        found.detail + f"; {profile.name} profile: {guard.condition}",
        found.explicit,
        guard,
    )


def _failure_guard(profile: Profile, inp: TraceInput, found: DetectedOrigin) -> Guard:
    """The fallback row that decides a failed request (``Profile.request_failure``)."""
    backend, layer = found.backend, inp.layer
    facts = GuardFacts(
        requested=backend is not None,
        role_failed=(
            backend is not None and layer.role is Role.CROSS and profile.sparse(inp, backend)
        ),
        strict=found.strict,
        global_explicit=found.origin in GLOBAL_EXPLICIT_ORIGINS,
        explicit=found.explicit,
        relaxed=_relaxed(inp),
        by_hand=written_by_hand(layer),
    )
    return first_guard(profile.request_failure, facts)


#: the backend of a route that runs the site's own softmax attention by hand
_BY_HAND: Final = frozenset({Backend("eager")})


def written_by_hand(layer: LayerSpec) -> bool:
    """Issue 30: whether ``layer`` is softmax attention its own code writes by hand,
    run only by that code: its route (``LayerSpec.exact_route``, an integration
    site) runs exactly ``eager``, the site's own code path. No kernel is offered
    there (a capture of hand-written attention is not sound by construction), so
    a relaxed request falls back with the reason ``softmax attention written by
    hand`` and a strict one is rejected."""
    return layer.exact_route is not None and layer.supported == _BY_HAND


def _relaxed(inp: Asked) -> bool:
    """``Relaxation.relaxed`` without building one (the hot path's question)."""
    scope = inp.scope
    return inp.layer.default is not None or (scope is not None and scope.allow_global_fallback)


def stage_candidates(stage: State, inp: TraceInput, requested: Backend | None) -> list[Backend]:
    """The candidates a stage evaluates, in order (duplicates skipped later)."""
    if stage is State.REQUESTED:
        return [] if requested is None else [requested]
    if stage is State.COMPONENT_DEFAULT:
        return [] if inp.layer.default is None else [inp.layer.default]
    if stage is State.PLATFORM_DEFAULT:
        return list(inp.platform.default_chain())
    if stage is State.SUPPORTED_SET:
        # issue 19: a layer that runs any backend (no supported set) narrowed by a
        # preferred set tries that set here (its supported set, narrowed)
        layer = inp.layer
        supported = layer.supported if layer.supported is not None else layer.preferred
        return _in_catalogue_order(supported or ())
    raise InvalidArgumentError(f"state {stage.value!r} evaluates no candidates")


# -- Checks: pure functions of (spec, layer, platform); every failure collected --


def _check_kernel(
    spec: BackendSpec, needs_kernel: bool, no_kernel: Collection[str] | None = None
) -> list[Failure]:
    """A layer that will run needs a kernel for the backend in the process that
    resolved: the input's kernel facts (``no_kernel``) when it carries them, else
    this process's kernel registry (a trace older than schema 4)."""
    if not needs_kernel or (
        spec.name not in no_kernel
        if no_kernel is not None
        else kernel_source(spec.name) is not KernelSource.NONE
    ):
        return []
    why = (
        "a sparse backend: attnres ships no adapter, its kernels need model-specific "
        "layout metadata"
        if spec.sparse
        else "no kernel is registered for it"
    )
    return [
        Failure(
            Code.NO_KERNEL,
            f"no kernel in this process ({why}); register one with "
            f"attnres.kernels.register_kernel({spec.name!r}, fn) before building the layer "
            f"(docs/layers.md)",
        )
    ]


def _check_available(
    spec: BackendSpec,
    platform: Platform,
    needs_kernel: bool = False,
    no_kernel: Collection[str] | None = None,
) -> list[Failure]:
    return _check_package(spec, platform) + _check_kernel(spec, needs_kernel, no_kernel)


def _package_failure(
    name: str, platform: Platform, alternatives: tuple[str, ...] = ()
) -> list[Failure]:
    """Why neither ``name`` nor one of its ``alternatives`` works here ([] if one does)."""
    facts = [platform.package(n) for n in (name, *alternatives)]
    if any(f.status == PackageStatus.PRESENT for f in facts):
        return []
    broken = [f for f in facts if f.status == PackageStatus.BROKEN]
    if broken:
        return [
            Failure(Code.PACKAGE_BROKEN, f"package {f.name!r} is broken: {f.detail}")
            for f in broken
        ]
    fact = facts[0]
    detail = "" if fact.detail in (None, "not installed") else f" ({fact.detail})"
    nor = "".join(f" (nor its older packaging {a!r})" for a in alternatives)
    return [Failure(Code.PACKAGE_MISSING, f"package {name!r} is not installed{detail}{nor}")]


def _check_package(spec: BackendSpec, platform: Platform) -> list[Failure]:
    if spec.package is None:
        return []
    out = _package_failure(spec.package, platform, spec.package_alternatives)
    for extra in spec.extra_packages:
        out += _package_failure(extra, platform)
    return out


def _check_platform(spec: BackendSpec, layer: LayerSpec, platform: Platform) -> list[Failure]:
    out: list[Failure] = []
    kind, cap = platform.kind, platform.capability
    here = "this platform's is unknown" if cap is None else f"this device is sm{cap[0]}{cap[1]}"
    if kind not in spec.platforms:
        runs_on = ", ".join(k for k in PLATFORM_KINDS if k in spec.platforms)
        out.append(Failure(Code.PLATFORM_KIND, f"runs on {runs_on}, not on {kind}"))
    else:
        rule = spec.capabilities.get(kind)
        if rule is not None and rule.restricts_capability and (cap is None or not rule.fits(cap)):
            needs = f"needs compute capability {rule.describe()}"
            out.append(
                Failure(Code.COMPUTE_CAPABILITY, f"{needs}{';' if cap is None else ','} {here}")
            )
        if rule is not None and rule.archs is not None and platform.arch not in rule.archs:
            out.append(
                Failure(
                    Code.ARCHITECTURE,
                    f"needs architecture {'/'.join(sorted(rule.archs))}, this device is "
                    f"{platform.arch or 'of unknown architecture'}",
                )
            )
        min_torch = spec.min_torch.get(kind)
        if min_torch is not None and platform.torch_at_least(min_torch) is False:
            out.append(
                Failure(
                    Code.TORCH_VERSION,
                    f"needs torch >= {min_torch[0]}.{min_torch[1]} on {kind}, this platform "
                    f"has torch {platform.torch_version}",
                )
            )
    dtype_rule = spec.dtype_capabilities.get(layer.dtype)
    if layer.dtype not in spec.dtypes:
        takes = ", ".join(sorted(spec.dtypes))
        out.append(Failure(Code.DTYPE, f"does not take dtype {layer.dtype} (takes {takes})"))
    elif dtype_rule is not None and kind == "cuda" and (cap is None or not dtype_rule.fits(cap)):
        out.append(
            Failure(
                Code.DTYPE,
                f"takes dtype {layer.dtype} only on compute capability "
                f"{dtype_rule.describe()}, {here}",
            )
        )
    out += [
        Failure(Code.HEAD_SIZE, problem) for problem in spec.head_sizes.failures(layer.head_size)
    ]
    return out


def _check_role(spec: BackendSpec, layer: LayerSpec) -> list[Failure]:
    if spec.sparse and layer.role is Role.CROSS:
        return [
            Failure(
                Code.SPARSE_CROSS_ATTENTION,
                # SPEC 3.5's searchable wording: the only place it can reach a
                # user is this failure, since a sparse-on-cross request always
                # falls back (3.3) and is never a strict rejection
                f"Sparse attention backend {spec.name!r} cannot serve cross-attention",
            )
        ]
    return []


def supported_by(spec: BackendSpec, supported: frozenset[Backend] | None) -> bool:
    """Whether a layer's supported set admits ``spec``, aliases included."""
    if supported is None:
        return True
    names = {b.name for b in supported}
    if spec.name in names:
        return True
    return any(group <= names for group in spec.satisfies)


def _stands_in_for(spec: BackendSpec, supported: frozenset[Backend]) -> str:
    """The names of ``supported`` that ``spec`` is admitted as a stand-in for."""
    names = {b.name for b in supported}
    group = sorted({n for g in spec.satisfies if g <= names for n in g})
    return "[" + ", ".join(repr(n) for n in group) + "]"


def _check_supported(spec: BackendSpec, layer: LayerSpec) -> list[Failure]:
    """The rows of ``SUPPORTED_RULES``, in order; the first that fails is the failure."""
    if not supported_by(spec, layer.supported):
        return [
            Failure(
                Code.NOT_IN_SUPPORTED_SET,
                f"not in the layer's supported set {_names(layer.supported)}",
            )
        ]
    route, supported = layer.exact_route, layer.supported
    if route is not None and supported is not None and spec.name not in {b.name for b in supported}:
        return [
            Failure(
                Code.NOT_ON_ROUTE,
                f"stands in for {_stands_in_for(spec, supported)}, but this layer's route "
                f"({route}) runs exactly {_names(supported)}: a stand-in is not one of them",
            )
        ]
    return []


def _check_requirements(spec: BackendSpec, layer: LayerSpec, platform: Platform) -> list[Failure]:
    needed = layer.requirements.needed()
    # a named mask kind is checked by kind (issue 22); 0.2's attn_mask by the flag
    typed_mask = layer.requirements.mask not in (MaskKind.NONE, MaskKind.ANY)
    out = [
        Failure(Code.REQUIREMENT_UNMET, f"does not implement {REQUIREMENT_PHRASES[req]}")
        for req in needed
        if req not in spec.implements and not (typed_mask and req is Requirement.ATTN_MASK)
    ]
    out += _check_mask_kind(spec, layer)
    # a limit withdraws what the spec claims (an unclaimed requirement failed above)
    out += [
        Failure(Code.REQUIREMENT_UNMET, f"does not implement {limit.describe()} ({limit.because})")
        for limit in spec.limits
        if limit.requirements <= spec.implements
        and limit.applies(needed, platform.kind, platform.capability)
    ]
    # causal masks and sliding windows are laid along one diagonal; when query and
    # key lengths differ (cross-attention) flash-style kernels take the bottom-right one
    bottom_right = layer.requirements.causal_alignment is CausalAlignment.BOTTOM_RIGHT
    for req, what in _ALIGNED:
        if req is Requirement.CAUSAL and bottom_right:
            continue  # _check_mask_kind checks a bottom-right causal layer
        if (
            req in needed
            and layer.role is Role.CROSS
            and req in spec.implements
            and not spec.causal_top_left
        ):
            out.append(
                Failure(
                    Code.REQUIREMENT_UNMET,
                    f"does not implement top-left aligned {what} cross-attention (its {what} "
                    f"mask is bottom-right aligned when query and key lengths differ)",
                )
            )
    return out


def _check_mask_kind(spec: BackendSpec, layer: LayerSpec) -> list[Failure]:
    """The layer's mask kind and causal alignment against what the kernel takes (issue 22).

    A kind the spec declares (``BackendSpec.masks``) or, for a spec that claims
    ``attn_mask``, any kind passes; a key-padding mask taken by unpadding also
    passes. A bottom-right causal cross-attention layer needs a kernel whose
    causal mask is bottom-right and that attnres runs through its varlen entry
    point (the dense flash adapters refuse unequal lengths with causal).
    """
    req = layer.requirements
    out: list[Failure] = []
    if req.mask not in (MaskKind.NONE, MaskKind.ANY) and spec.mask_support(req.mask) is None:
        takes = [
            f"{MASK_KIND_PHRASES[m.kind]} by unpadding"
            if m.route is MaskRoute.UNPAD
            else MASK_KIND_PHRASES[m.kind]
            for m in spec.masks
        ]
        out.append(
            Failure(
                Code.REQUIREMENT_UNMET,
                f"does not implement {MASK_KIND_PHRASES[req.mask]} (the layer's mask kind is "
                f"{req.mask_kind}; it takes {', '.join(takes) or 'no mask at all'})",
            )
        )
    if (
        req.causal
        and req.causal_alignment is CausalAlignment.BOTTOM_RIGHT
        and layer.role is Role.CROSS
    ):
        if spec.causal_top_left or Requirement.CAUSAL not in spec.implements:
            why = " (its causal mask is top-left aligned when query and key lengths differ)"
        elif spec.varlen_kernel is None:
            why = (
                " through attnres (it runs that through a varlen entry point, and attnres has "
                "no varlen adapter for this kernel)"
            )
        elif not spec.varlen_causal_unequal:
            why = " (its varlen entry point takes causal only with equal query and key lengths)"
        else:
            return out
        what = "does not implement bottom-right aligned causal cross-attention"
        out.append(Failure(Code.REQUIREMENT_UNMET, what + why))
    return out


#: The requirements whose mask follows the diagonal, and how a failure names them.
_ALIGNED: Final = ((Requirement.CAUSAL, "causal"), (Requirement.SLIDING_WINDOW, "sliding-window"))


def check_candidate(
    backend: Backend,
    layer: LayerSpec,
    platform: Platform,
    needs_kernel: bool = False,
    no_kernel: Collection[str] | None = None,
    budget: Budget | None = None,
) -> Results:
    """Run every check of SPEC 3.4 on one candidate; every failure is kept.

    Returns ``(check, failures)`` pairs in :data:`CHECK_ORDER` (:data:`LAYOUT_CHECK_ORDER`
    for a layer with a sequence-parallel layout); a check passed
    when its failures are empty. An unknown backend stops after ``known``.
    ``needs_kernel``: the layer will run, so ``available`` also needs a kernel
    for the backend (code ``no_kernel``): one not in ``no_kernel`` (the input's
    kernel facts), or -- without them -- one this process has.
    """
    spec = lookup_spec(backend)
    if spec is None:
        return (
            (
                Check.KNOWN,
                (Failure(Code.UNKNOWN_BACKEND, f"backend {backend.name!r} is not registered"),),
            ),
        )
    # issue 31: the installed version's facts on this GPU, named in what they fail
    spec, applied = platform.installed(spec)
    results: Results = (
        (Check.KNOWN, ()),
        (Check.AVAILABLE, tuple(_check_available(spec, platform, needs_kernel, no_kernel))),
        (Check.PLATFORM, _as_installed(_check_platform(spec, layer, platform), applied)),
        (Check.ROLE, tuple(_check_role(spec, layer))),
        (Check.SUPPORTED, tuple(_check_supported(spec, layer))),
        (Check.REQUIREMENTS, _as_installed(_check_requirements(spec, layer, platform), applied)),
    )
    if layer.layout is not None:  # issue 24: the layout check exists only for a layout
        results = (*results, (Check.LAYOUT, tuple(_check_layout(spec, layer, layer.layout))))
    if budget is None:  # issue 34: the precision check exists only under a budget
        return results
    return (*results, (Check.PRECISION, tuple(_check_precision(spec, platform, budget))))


def _as_installed(failures: list[Failure], applied: tuple[KernelFacts, ...]) -> tuple[Failure, ...]:
    """``failures``, each saying which kernel's facts it read where a version- or
    GPU-keyed entry replaced the catalogue's own (issue 31)."""
    if not applied or not failures:
        return tuple(failures)
    note = " (facts of " + "; ".join(f"{v.kernel}: {v.describe()}" for v in applied) + ")"
    return tuple(Failure(f.code, f.message + note) for f in failures)


def _check_layout(spec: BackendSpec, layer: LayerSpec, layout: SequenceLayout) -> list[Failure]:
    """Issue 24: what a sequence-parallel layout needs from the per-rank kernel.

    A ring merges the partial results of its key/value blocks by their softmax
    log-sum-exp, so the kernel must return it (``BackendSpec.lse``) through an
    entry point attnres has an adapter for.
    Ulysses gives each rank ``1/ulysses`` of the query and key/value heads, so
    both counts must divide (a fact of the layer, recorded for every candidate).
    attnres's layouts apply no attention mask (each rank holds a shard of the
    sequence) and no sliding window across ring blocks: a layer that requires
    one fails for every candidate too.
    """
    out: list[Failure] = []
    needed = layer.requirements
    # issue 35: key-padding masks are gathered with the keys (Ulysses, AllGather-KV);
    # a ring merges blocks without masks, and other mask kinds are not gathered
    if needed.attn_mask and needed.mask is not MaskKind.KEY_PADDING:
        out.append(
            Failure(
                Code.LAYOUT_UNSUPPORTED,
                f"the layer requires attention masks, which attnres's sequence-parallel "
                f"layouts do not apply ({layout.ulysses_ring()})",
            )
        )
    elif needed.attn_mask and layout.ring > 1:
        out.append(
            Failure(
                Code.LAYOUT_UNSUPPORTED,
                f"the layer requires key-padding masks, which attnres's sequence-parallel "
                f"layouts gather with the keys under Ulysses and AllGather-KV, never on a ring "
                f"({layout.ulysses_ring()})",
            )
        )
    out.extend(_check_layout_kinds(layer, layout))
    if (
        needed.backward
        and layout.needs_lse
        and spec.lse is not None
        and not lse_has_gradient(spec.name)
    ):
        out.append(
            Failure(
                Code.LAYOUT_UNSUPPORTED,
                f"attnres has no backward from its log-sum-exp, and a training forward under "
                f"ring={layout.ring} recomputes each key/value block's gradients from the "
                f"merged log-sum-exp (kernels with one: "
                f"{', '.join(n for n in lse_kernel_names() if lse_has_gradient(n))})",
            )
        )
    bottom_right = needed.causal_alignment is not CausalAlignment.TOP_LEFT
    if needed.causal and bottom_right and layout.ring > 1:
        out.append(
            Failure(
                Code.LAYOUT_UNSUPPORTED,
                f"the layer requires a {needed.causal_alignment.value} causal mask; the blocks of "
                f"ring={layout.ring} are merged with a top-left one",
            )
        )
    if needed.sliding_window and layout.ring > 1:
        out.append(
            Failure(
                Code.LAYOUT_UNSUPPORTED,
                f"the layer requires a sliding window, which crosses the key/value blocks of "
                f"ring={layout.ring}",
            )
        )
    if layout.needs_lse:
        if spec.lse is None:
            out.append(
                Failure(
                    Code.NO_LSE,
                    f"cannot return the softmax log-sum-exp, which ring={layout.ring} needs "
                    f"to merge the partial results of its key/value blocks",
                )
            )
        elif not has_lse_kernel(spec.name):
            # attnres's own adapters, not this process's install: a plan (a
            # simulated platform, explain, a schedule step) says what the runtime
            # does (issue 32 item 5: explain predicted flex_attention's ring)
            out.append(
                Failure(
                    Code.NO_LSE,
                    f"returns the log-sum-exp ({spec.lse}), but attnres has no adapter for "
                    f"that entry point, so no ring runs it (ring={layout.ring}; adapters: "
                    f"{', '.join(lse_kernel_names())})",
                )
            )
    if layout.ulysses > 1 and not layout.pad_heads:
        heads, kv = layout.num_heads, layout.num_kv_heads
        if heads is not None and (heads % layout.ulysses or (kv or heads) % layout.ulysses):
            out.append(
                Failure(
                    Code.HEADS_NOT_DIVISIBLE,
                    f"ulysses={layout.ulysses} gives each rank a share of the heads, but "
                    f"{heads} heads and {kv or heads} kv heads do not both divide by "
                    f"{layout.ulysses}",
                )
            )
    return out


def _check_layout_kinds(layer: LayerSpec, layout: SequenceLayout) -> list[Failure]:
    """Issue 35: the checks of the head-padded and AllGather-KV layout kinds.

    Head padding (``pad_heads``) zero-pads the query and key/value heads to a
    multiple of ``ulysses`` (whole GQA groups) and drops the padding after: never
    wrong, but refused (``padding_too_costly``) when the padded query heads are
    at least ``MAX_PAD_COST`` times the real ones. AllGather-KV (``allgather``)
    gives every rank its query shard against the whole key/value sequence, so a
    causal layer is refused (``allgather_causal``): the shard would need a
    bottom-right-aligned causal mask over the gathered keys, which no kernel is
    handed here (vllm-omni#4968: "only valid for causal=False attention").
    """
    out: list[Failure] = []
    cost = layout.pad_cost()
    if cost is not None and cost >= MAX_PAD_COST:
        padded = layout.padding()
        assert padded is not None
        out.append(
            Failure(
                Code.PADDING_TOO_COSTLY,
                f"ulysses={layout.ulysses} with padded heads pads {layout.num_heads} heads "
                f"({layout.num_kv_heads or layout.num_heads} kv heads) to {padded[0]} "
                f"({padded[1]}): {cost:.2f}x the attention work, at least the bound "
                f"{MAX_PAD_COST:g}x (use a ring or allgather layout)",
            )
        )
    if layout.allgather > 1 and layer.requirements.causal:
        out.append(
            Failure(
                Code.ALLGATHER_CAUSAL,
                f"allgather={layout.allgather} gives each rank its query shard against every "
                f"key; a causal layer would need a bottom-right-aligned mask over the "
                f"gathered keys (use ulysses or a zig-zag ring for causal attention)",
            )
        )
    return out


# -- Issue 34: the precision check -- a lossy candidate against the layer's budget --


@frozen
class Budget:
    """The error budget one layer is held to (``SelectionConfig.error_budget``),
    the ``--attention-error`` key that set it, and the errors measured on the
    layer's own inputs (``TraceInput.measured_error``)."""

    key: str
    value: ErrorBudget
    measured: tuple[ErrorMeasurement, ...] = ()

    def flag(self) -> str:
        """``--attention-error vae=exact`` (``--attention-error 0.02`` for ``*``)."""
        value = EXACT if self.value == EXACT else f"{self.value:g}"
        return (
            f"--attention-error {value if self.key == EVERY_COMPONENT else self.key + '=' + value}"
        )

    def measured_for(self, backend: str) -> ErrorMeasurement | None:
        found = [m for m in self.measured if m.backend == backend]
        return max(found, key=lambda m: m.rel_l2) if found else None


#: Issue 34, one row per rule of the ``precision`` check: (code, the rule). It
#: runs only on a layer with an error budget (``--attention-error``); with none,
#: the machine is what it was. Facts are :data:`attnres.backends.PRECISION_FACTS`.
PRECISION_RULES: Final[tuple[tuple[Code, str], ...]] = (
    (
        Code.LOSSY_KERNEL,
        "a budget of `exact` admits only kernels whose precision facts say exact to the "
        "dtype: a lossy kernel, or one that declares no facts here (fail closed), fails",
    ),
    (
        Code.ERROR_OVER_BUDGET,
        "a numeric budget admits a lossy kernel by its facts until it is measured; once "
        "its relative L2 error on the layer's own inputs is measured (`attnres calibrate`, "
        "autotune, a results file) it fails when that error exceeds the budget",
    ),
)


def layer_budget(inp: TraceInput) -> Budget | None:
    """The budget of the input's layer, by its component, kind and role (``None``:
    no budget, no precision check)."""
    scope = inp.scope
    found = inp.config.error_budget(
        None if scope is None else scope.component,
        None if scope is None else scope.kind,
        inp.layer.role,
    )
    if found is None:
        return None
    return Budget(found[0], found[1], inp.measured_error)


def numeric_budget(inp: TraceInput) -> float | None:
    """The layer's numeric error budget (``None``: none, or ``exact``): what
    autotune measures each candidate's error against (``VERDICT_RULES``)."""
    budget = layer_budget(inp)
    return None if budget is None or budget.value == EXACT else float(budget.value)


def precision_here(spec: BackendSpec, platform: Platform) -> Precision | None:
    """The precision facts of the kernel installed here (``None``: none declared)."""
    return precision_of(spec, *platform.distribution(spec), platform.kind, platform.capability)


def _figures(m: ErrorMeasurement) -> str:
    how = "emulated on CPU" if m.emulated else m.source
    return (
        f"relative L2 {m.rel_l2:.3g}, max abs {m.max_abs:.3g}, cosine {m.cosine:.6f} "
        f"({how}, {m.call})"
    )


def _check_precision(spec: BackendSpec, platform: Platform, budget: Budget) -> list[Failure]:
    """The rows of ``PRECISION_RULES``."""
    fact = precision_here(spec, platform)
    if fact is not None and not fact.lossy:
        return []
    if budget.value == EXACT:
        what = (
            "it declares no precision facts here (fail closed)"
            if fact is None
            else f"{fact.applies.kernel}; `attnres backends` shows how"
        )
        return [
            Failure(
                Code.LOSSY_KERNEL,
                f"is lossy ({what}) and the layer's error budget is exact ({budget.flag()})",
            )
        ]
    measured = budget.measured_for(spec.name)
    if measured is not None and not measured.rel_l2 <= float(budget.value):
        return [
            Failure(
                Code.ERROR_OVER_BUDGET,
                f"its measured error on this layer's inputs ({_figures(measured)}) exceeds "
                f"the layer's budget, relative L2 <= {float(budget.value):g} ({budget.flag()})",
            )
        ]
    return []


def _precision_record(
    inp: TraceInput, accepted: Backend, results: Results
) -> PrecisionRecord | None:
    """The accepted candidate against its layer's budget (only when it has one)."""
    if not any(check is Check.PRECISION for check, _ in results):
        return None
    budget = layer_budget(inp)
    spec = lookup_spec(accepted)
    assert budget is not None and spec is not None  # the precision check ran on both
    fact = precision_here(spec, inp.platform)
    if fact is None:
        kind, how = "undeclared", "no precision facts declared for this kernel here"
    else:
        kind, how = fact.kind, f"{fact.applies.kernel}: {fact.describe()} ({fact.source})"
    measured = budget.measured_for(accepted.name)
    return PrecisionRecord(accepted, kind, how, describe_budget(budget.value), budget.key, measured)


# -- Messages --


def _names(backends: frozenset[Backend] | None) -> str:
    if backends is None:
        return "[any]"
    return "[" + ", ".join(repr(name) for name in sorted(b.name for b in backends)) + "]"


def primary_check(failed: set[Check], layer: LayerSpec, spec: BackendSpec | None) -> Check:
    """The check whose failure names a strict rejection: the first of
    ``_PRIMARY_ORDER`` that failed, except that a requirement of
    ``REQUIREMENTS_BEFORE_SUPPORTED`` the backend does not implement is named
    before the layer's supported set."""
    primary = next(c for c in _PRIMARY_ORDER if c in failed)
    if primary is Check.SUPPORTED and Check.REQUIREMENTS in failed and spec is not None:
        needed = layer.requirements.needed()
        if any(r in needed and r not in spec.implements for r, _ in REQUIREMENTS_BEFORE_SUPPORTED):
            return Check.REQUIREMENTS
    return primary


def _primary_message(
    backend: Backend,
    results: Results,
    layer: LayerSpec,
    platform: Platform,
) -> tuple[str, str]:
    """The rejection message of a strict request, and its code."""
    failed = {check: failures for check, failures in results if failures}
    primary = primary_check(set(failed), layer, lookup_spec(backend))
    name = backend.name
    first = failed[primary]
    if primary is Check.KNOWN:
        text = f"Unknown attention backend {name!r}"
    elif primary is Check.SUPPORTED and first[0].code is Code.NOT_ON_ROUTE:
        spec = lookup_spec(backend)
        assert spec is not None and layer.supported is not None  # the check ran on both
        text = (
            f"Attention backend {name!r} cannot run on this layer's route "
            f"({layer.exact_route}), which runs exactly {_names(layer.supported)}: "
            f"{name!r} only stands in for {_stands_in_for(spec, layer.supported)}; "
            f"request one of {_names(layer.supported)}"
        )
    elif primary is Check.SUPPORTED:
        text = (
            f"Attention backend {name!r} is not supported by this attention layer; "
            f"supported backends: {_names(layer.supported)}"
        )
    elif primary is Check.ROLE:
        text = f"Sparse attention backend {name!r} cannot serve cross-attention"
    elif primary is Check.REQUIREMENTS:
        phrases = [f.message.removeprefix("does not implement ") for f in first]
        text = f"Attention backend {name!r} does not implement {', '.join(phrases)}"
    else:
        what = {
            Check.LAYOUT: "cannot serve this layer's sequence-parallel layout",
            Check.PRECISION: "is outside this layer's error budget",  # issue 34
            Check.PLATFORM: f"cannot run this layer on {platform.describe()}",
        }.get(primary, "is not available")
        text = f"Attention backend {name!r} {what}: " + "; ".join(f.message for f in first)
    others = [
        f"{check.value}: {f.message}"
        for check, failures in results
        if check is not primary
        for f in failures
    ]
    if others:
        text += "; also " + "; ".join(others)
    return text, str(first[0].code)


def _exhausted_message(tried: Sequence[Tried]) -> str:
    if not tried:
        return (
            "No compatible attention backend is available: no candidate to evaluate (nothing "
            "requested, no layer default, and the platform's default chain is empty)"
        )
    parts = [
        f"{'' if b is None else b.name} ({stage.value}): "
        + "; ".join(f.message for _, failures in results for f in failures)
        for stage, b, results in tried
    ]
    return "No compatible attention backend is available: tried " + " | ".join(parts)


# -- The machine --


def _step(
    state: State,
    event: Event,
    records: list[Record],
    reason: Reason | None,
    candidate: Backend | None = None,
) -> tuple[State, Reason | None]:
    try:
        target, sets = TRANSITIONS[state][event]
    except KeyError:
        raise AssertionError(
            f"no transition from state {state.value!r} on event {event.value!r}"
        ) from None
    records.append(TransitionRecord(state, event, target, candidate, sets))
    return target, (reason if reason is not None else sets)


def run_machine(inp: TraceInput) -> Trace:
    """Run the machine on one input; a pure function (no context, no cache, no I/O).

    It walks ``TRANSITIONS`` by the rules of the input's profile
    (``SelectionConfig.profile``: :data:`PROFILES`, attnres's own :data:`ATTNRES`
    by default).
    """
    profile = PROFILES[inp.config.profile]
    found = _detect(profile, inp)
    # what the rules share, computed once for this resolution
    given = Given(inp, _preferred_unusable(inp) if profile.preferred_stages else "")
    detail = (
        found.detail if profile.origin_note is None else found.detail + profile.origin_note(given)
    )
    records: list[Record] = [OriginRecord(found.origin, found.backend, found.strict, detail)]
    layer = inp.layer
    start = GuardFacts(
        requested=found.backend is not None,
        single_supported=(
            layer.default is None and layer.supported is not None and len(layer.supported) == 1
        ),
    )
    state, reason = _step(State.ORIGIN_DETECTION, first_event(profile.start, start), records, None)
    seen: dict[Backend | None, State] = {}
    tried: list[Tried] = []
    refused = False
    skips, evaluate = profile.skips, profile.evaluate
    while state not in (State.SELECTED, State.REJECTED):
        stage = state
        accepted: Backend | None = None
        candidates = profile.candidates(stage, given, found.backend)
        for position, candidate in enumerate(candidates):
            if candidate in seen:
                if profile.records_repeats and candidate is not None:
                    records.append(
                        SkipRecord(
                            stage, candidate, f"already evaluated at {seen[candidate].value}"
                        )
                    )
                continue
            skipped = ""
            for stages, skip in skips:
                if stage in stages:
                    skipped = skip(position, candidates, given)
                    if skipped:
                        break
            if skipped:
                if candidate is not None:
                    records.append(SkipRecord(stage, candidate, skipped))
                continue
            bypass = profile.explicit_bypasses_supported and found.explicit and not seen
            seen[candidate] = stage
            subject, results = evaluate(profile, candidate, inp, bypass)
            if subject is not None:
                for check, failures in results:
                    records.append(CheckRecord(stage, subject, check, not failures, failures))
            if not any(failures for _, failures in results):
                accepted = subject
                break
            tried.append((stage, subject, results))
            if stage is State.REQUESTED:
                guard = found.on_failure or _failure_guard(profile, inp, found)
                state, reason = _step(stage, guard.event, records, reason, subject)
                refused = state is State.REJECTED
                break
            state, reason = _step(stage, Event.CANDIDATE_FAILED, records, reason, subject)
        if accepted is not None:
            note = _precision_record(inp, accepted, results)  # issue 34
            if note is not None:
                records.append(note)
            _step(stage, Event.ACCEPTED, records, reason, accepted)
            for row in profile.selected_reasons if reason is None else ():
                reason = row.reason(inp, found.origin, accepted)
                if reason is not None:
                    break
            records.append(SelectedRecord(accepted, found.origin, reason))
            outcome = Outcome(Status.SELECTED, found.origin, accepted, reason)
            return Trace(inp, tuple(records), outcome, inp.schema_version())
        if state is stage:  # the stage ran out of candidates
            state, reason = _step(stage, Event.EXHAUSTED, records, reason)
    message, code = profile.reject(profile, inp, tried, refused)
    records.append(RejectedRecord(found.origin, code, message))
    outcome = Outcome(Status.REJECTED, found.origin, None, None, code, message)
    return Trace(inp, tuple(records), outcome, inp.schema_version())


def _attnres_evaluate(
    _: Profile, candidate: Backend | None, inp: TraceInput, __: bool
) -> Evaluation:
    assert candidate is not None  # attnres's stages name every candidate
    return candidate, check_candidate(
        candidate, inp.layer, inp.platform, inp.needs_kernel, inp.no_kernel, layer_budget(inp)
    )


def _outside_preferred(position: int, candidates: Sequence[Backend | None], given: Given) -> str:
    """Issue 23: automatic choices stay inside the layer's preferred set -- unless
    none of it can run here (issue 32 item 6: it narrows nothing then)."""
    preferred = given.inp.layer.preferred
    if (
        preferred is not None
        and candidates[position] not in preferred
        and not given.preferred_unusable
    ):
        return f"an automatic choice outside the layer's preferred set {_names(preferred)}"
    return ""


def _attnres_candidates(
    stage: State, given: Given, requested: Backend | None
) -> Sequence[Backend | None]:
    """The stage's candidates; a preferred set none of which can run here is tried
    first in the automatic stages, each failure recorded (issue 32 item 6)."""
    candidates = stage_candidates(stage, given.inp, requested)
    preferred = given.inp.layer.preferred
    if stage not in PREFERRED_STAGES or preferred is None or not given.preferred_unusable:
        return candidates
    first = _in_catalogue_order(preferred)
    return [*first, *(c for c in candidates if c not in preferred)]


def _not_usable_here(position: int, candidates: Sequence[Backend | None], given: Given) -> str:
    """Why a conditional platform preference does not apply ('' when it does).

    A platform's chain prefers a kernel "when it is usable" (SPEC 3.4: cuda -> fa
    when flash-attn is usable): its package works, a layer that will run has a
    kernel for it, and the device, dtype and head size fit. Only the last entry
    of a chain is unconditional.
    """
    candidate = candidates[position]
    if position == len(candidates) - 1 or candidate is None:
        return ""
    inp, preferred = given.inp, given.inp.layer.preferred
    if preferred is not None and candidate in preferred and given.preferred_unusable:
        return ""  # tried first, its failures recorded (issue 32 item 6)
    spec = lookup_spec(candidate)
    if spec is None:
        unusable = f"backend {candidate.name!r} is not registered"
    else:
        spec = inp.platform.installed(spec)[0]
        failures = _check_available(spec, inp.platform, inp.needs_kernel, inp.no_kernel)
        failures += _check_platform(spec, inp.layer, inp.platform)
        unusable = "; ".join(f.message for f in failures)
    return f"preferred on {inp.platform.kind} only where usable: {unusable}" if unusable else ""


def _attnres_reject(
    profile: Profile, inp: TraceInput, tried: Sequence[Tried], refused: bool
) -> tuple[str, str]:
    """A strict request refused: named by its primary check; else every candidate tried."""
    if refused:
        _, candidate, results = tried[-1]
        assert candidate is not None
        message, code = _primary_message(candidate, results, inp.layer, inp.platform)
    else:
        message, code = _exhausted_message(tried), str(Code.NO_COMPATIBLE_BACKEND)
    if inp.scope is not None:
        message += f" for component {inp.scope.component!r}"
    return message, code


def _spec_sparse(inp: TraceInput, backend: Backend) -> bool:
    spec = lookup_spec(backend)
    return spec is not None and spec.sparse


#: attnres's own contract (SPEC 3): ``SelectionConfig(profile="attnres")``.
ATTNRES: Final = Profile(
    name="attnres",
    origins=ORIGIN_ROWS,
    nothing_requested="nothing requested and no layer default",
    start=START_GUARDS,
    request_failure=REQUEST_FAILURE_GUARDS,
    states_fallback=False,
    sparse=_spec_sparse,
    candidates=_attnres_candidates,
    skips=(
        (PREFERRED_STAGES, _outside_preferred),
        (frozenset({State.PLATFORM_DEFAULT}), _not_usable_here),
    ),
    records_repeats=True,
    evaluate=_attnres_evaluate,
    reject=_attnres_reject,
    origin_note=_preferred_note,
    preferred_stages=PREFERRED_STAGES,
)

#: issue 23, 33: the rules of each selection profile (``SelectionConfig.profile``),
#: every one walked by :func:`run_machine`.
PROFILES: Final[Mapping[str, Profile]] = {
    "attnres": ATTNRES,
    "sglang": SGLANG,
    "vllm_omni": VLLM_OMNI,
}


# -- SPEC 3.6: a scope's overrides must explain its layers --


#: SPEC 3.6, one row per scope check: (code, when it runs, the rule it enforces).
#: ``require_selection`` defaults to on when a component or role backend is given.
SCOPE_CHECKS: Final[tuple[tuple[ScopeCode, str, str], ...]] = (
    (
        ScopeCode.UNEXPLAINED,
        "each layer, with require_selection and a component backend",
        "a layer that runs another backend than the component's carries a recorded "
        "reason or is governed by a role override",
    ),
    (
        ScopeCode.NO_LAYER,
        "scope exit (all layers bound), with require_selection and a component backend",
        "the scope built at least one attnres layer",
    ),
    (
        ScopeCode.REJECTED,
        "scope exit, with require_selection and a component backend",
        "the component backend was not rejected for the layers while no layer runs it",
    ),
    (
        ScopeCode.NOT_APPLIED,
        "scope exit, with require_selection and a component backend",
        "the component backend ran on at least one layer, unless every selected layer "
        "went to a role override",
    ),
    (
        ScopeCode.ROLE_NO_LAYER,
        "scope exit, always",
        "each role override governed at least one layer of its role",
    ),
    (
        ScopeCode.ROLE_NOT_APPLIED,
        "scope exit, always",
        "each role override ran on at least one layer it governed",
    ),
)


def _selected(entries: Iterable[tuple[Role, Decision]]) -> list[tuple[Role, Decision]]:
    return [(r, d) for r, d in entries if d.backend is not None]


def scope_unexplained(
    state: ScopeState, entries: Iterable[tuple[Role, Decision]]
) -> list[ScopeProblem]:
    """Layers that chose another backend than the component override, with no
    recorded reason and no role override (only under ``require_selection``)."""
    if not state.require_selection or state.backend is None:
        return []
    wanted = state.backend.name
    bad = [
        d
        for _, d in _selected(entries)
        if not (d.origin is Origin.COMPONENT_OVERRIDE and d.backend == wanted)
        and d.reason is None
        and d.origin is not Origin.ROLE_OVERRIDE
    ]
    if not bad:
        return []
    shown = ", ".join(
        f"{d.layer or '<unnamed>'} runs {d.backend} (origin {d.origin.value})" for d in bad[:5]
    )
    more = f", and {len(bad) - 5} more" if len(bad) > 5 else ""
    return [
        ScopeProblem(
            ScopeCode.UNEXPLAINED,
            f"backend {wanted!r} was requested for component {state.component!r}, but "
            f"{len(bad)} layer(s) chose another backend without a recorded reason "
            f"({shown}{more})",
        )
    ]


def scope_not_applied(
    state: ScopeState, entries: list[tuple[Role, Decision]]
) -> list[ScopeProblem]:
    """SPEC 3.6: overrides that ran on no layer (all layers bound)."""
    problems: list[ScopeProblem] = []
    if state.require_selection and state.backend is not None:
        wanted = state.backend.name
        selected = _selected(entries)
        ran = any(
            d.origin is Origin.COMPONENT_OVERRIDE and d.backend == wanted for _, d in selected
        )
        all_roles = bool(selected) and all(d.origin is Origin.ROLE_OVERRIDE for _, d in selected)
        rejected = [
            d.layer or "<unnamed>"
            for _, d in entries
            if d.origin is Origin.COMPONENT_OVERRIDE and d.backend is None
        ]
        if not ran and not all_roles:
            if not entries:
                code, what = ScopeCode.NO_LAYER, "the scope built no attnres attention layer"
            elif rejected:
                code, what = (
                    ScopeCode.REJECTED,
                    f"it was rejected for {len(rejected)} layer(s) "
                    f"({', '.join(rejected[:5])}{', ...' if len(rejected) > 5 else ''}) and "
                    f"no layer runs it (each rejection raised a ResolutionError saying why)",
                )
            else:
                origins = sorted({d.origin.value for _, d in entries})
                reasons = sorted({d.reason.value for _, d in entries if d.reason})
                why = f"; recorded reasons: {', '.join(reasons)}" if reasons else ""
                code, what = (
                    ScopeCode.NOT_APPLIED,
                    f"it ran on none of its {len(entries)} layer(s) (they were decided "
                    f"by origin {', '.join(origins)}{why})",
                )
            asked = f"backend {wanted!r} was requested for component {state.component!r}"
            problems.append(ScopeProblem(code, f"{asked}, but {what}"))
    for role, backend in state.role_backends:
        governed = [d for r, d in entries if r is role and d.origin is Origin.ROLE_OVERRIDE]
        asked = (
            f"backend {backend.name!r} was requested for the {role.value}-attention "
            f"layers of component {state.component!r}"
        )
        if not governed:
            problems.append(
                ScopeProblem(
                    ScopeCode.ROLE_NO_LAYER,
                    f"{asked}, but the scope built no {role.value}-attention layer that used it",
                )
            )
        elif not any(d.backend == backend.name for d in governed):
            reasons = sorted({d.reason.value for d in governed if d.reason})
            why = f" (recorded reasons: {', '.join(reasons)})" if reasons else ""
            problems.append(
                ScopeProblem(
                    ScopeCode.ROLE_NOT_APPLIED,
                    f"{asked}, but it ran on none of its {len(governed)} {role.value}-attention "
                    f"layer(s){why}",
                )
            )
    return problems


# -- SPEC 3.8: what a per-request switch never touches; the training re-resolution --


@frozen
class RequestRefusal:
    """Why a request cannot switch one layer (before anything is resolved)."""

    code: str
    message: str


#: SPEC 3.8, one row per rule: (code, the rule). ``attnres.request_backend``
#: refuses the whole request, naming every layer a rule refuses.
REQUEST_RULES: Final[tuple[tuple[str, str], ...]] = (
    (
        "sparse_layer",
        "a request never switches a layer that runs a sparse backend: its kernel needs "
        "layout metadata a dense request cannot carry",
    ),
)


def request_refusal(current: Backend | None) -> RequestRefusal | None:
    """The rule of ``REQUEST_RULES`` that keeps a request off a layer running
    ``current``, or ``None`` (the layer is then resolved for the request)."""
    spec = None if current is None else lookup_spec(current)
    if spec is not None and spec.sparse:
        return RequestRefusal(
            REQUEST_RULES[0][0],
            f"it runs the sparse backend {spec.name!r}, whose kernel needs layout metadata "
            f"the request cannot carry; a request never switches a sparse layer",
        )
    return None


def training_spec(layer: LayerSpec) -> LayerSpec:
    """The layer as a forward that needs gradients sees it: ``backward`` required.

    A layer whose bound kernel has no backward pass resolves this spec (traced,
    origin and strictness as for inference) the first time a forward needs
    gradients, and runs that decision for such forwards.
    """
    return attrs.evolve(layer, requirements=attrs.evolve(layer.requirements, backward=True))


def backward_everywhere(spec: BackendSpec) -> bool:
    """Whether ``spec`` has a backward pass on every platform and layer (no check
    at forward time is needed then)."""
    return Requirement.BACKWARD in spec.implements and not any(
        Requirement.BACKWARD in limit.requirements for limit in spec.limits
    )


def has_backward_pass(backend: Backend, layer: LayerSpec, platform: Platform) -> bool:
    """Whether ``backend`` passes every check for :func:`training_spec` of ``layer``."""
    checks = check_candidate(backend, training_spec(layer), platform)
    return all(not failures for _, failures in checks)


# -- The measuring stage (autotune): tuned decisions, checks, verdicts, the tuned trace --

#: The detail of a ``skip`` record for a candidate without a kernel here.
NO_KERNEL: Final = "no kernel in this process"


def is_tunable(trace: Trace) -> bool:
    """Whether autotune may measure this decision: selected, automatic, untuned, and
    not under a sequence-parallel layout (issue 24: each rank would time its own
    shard and could tune apart from the others)."""
    return (
        trace.outcome.status == Status.SELECTED
        and trace.outcome.origin in TUNABLE_ORIGINS
        and not is_tuned(trace)
        and trace.input.layer.layout is None
    )


def is_tuned(trace: Trace) -> bool:
    """Whether the trace records a measurement (it holds a ``tuning`` record)."""
    return any(isinstance(r, TuningRecord) for r in trace.records)


@frozen
class Measured:
    """The facts of one candidate's measurement (what a device has to tell)."""

    candidate: Backend
    median_ns: int | None = None
    spread_ns: int | None = None
    deviation: float | None = None
    error: str | None = None
    #: issue 34: relative L2 error against a float64 reference (under a numeric budget)
    rel_l2: float | None = None

    @classmethod
    def of(cls, record: MeasurementRecord) -> Measured:
        """The facts of a recorded measurement (its fields but the verdict)."""
        return cls(*(getattr(record, f.name) for f in attrs.fields(cls)))


@frozen
class _Against:
    """What a verdict compares one measurement with: the incumbent's median, the
    margin, the tolerance and the layer's numeric error budget."""

    incumbent: int | None
    margin: float
    tolerance: float
    budget: float | None


#: The verdict of each measured candidate but the incumbent: the first row whose
#: condition holds (verdict, condition, what it says). Of the ``outpaced``
#: candidates the fastest (the first in order on a tie) is then ``chosen``.
VERDICT_RULES: Final[tuple[tuple[Verdict, Callable[[Measured, _Against], bool], str], ...]] = (
    (
        Verdict.RAISED,
        lambda m, a: m.error is not None or m.median_ns is None,
        "it raised (no median)",
    ),
    (
        Verdict.OVER_BUDGET,
        lambda m, a: a.budget is not None and m.rel_l2 is not None and not m.rel_l2 <= a.budget,
        "issue 34: the layer has a numeric error budget and the candidate's relative L2 "
        "error against a float64 reference exceeds it, whatever its speed",
    ),
    (
        Verdict.DISAGREES,
        lambda m, a: m.deviation is None or not m.deviation <= a.tolerance,
        "its deviation from the incumbent is unknown (not finite) or above the tolerance, "
        "whatever its speed",
    ),
    (
        Verdict.OUTPACED,
        lambda m, a: (
            a.incumbent is not None
            and m.median_ns is not None
            and m.median_ns < a.incumbent * (1.0 - a.margin)
        ),
        "faster than the incumbent by more than the margin "
        "(median < incumbent median * (1 - margin))",
    ),
    (Verdict.WITHIN_MARGIN, lambda m, a: True, "otherwise"),
)


def verdicts(
    measured: Sequence[Measured], margin: float, tolerance: float, budget: float | None = None
) -> tuple[tuple[Verdict, ...], Backend | None]:
    """Each measurement's verdict by ``VERDICT_RULES``, and the winner (``None``:
    the incumbent stays). ``measured[0]`` is the incumbent (verdict ``incumbent``)."""
    if not measured:
        raise InvalidArgumentError("verdicts: no measurement (the incumbent comes first)")
    against = _Against(measured[0].median_ns, margin, tolerance, budget)
    out: list[Verdict] = [Verdict.INCUMBENT]
    for m in measured[1:]:
        out.append(next(v for v, holds, _ in VERDICT_RULES if holds(m, against)))
    fast = [
        (m.median_ns or 0, position)
        for position, (m, v) in enumerate(zip(measured, out, strict=True))
        if v is Verdict.OUTPACED
    ]
    if not fast:
        return tuple(out), None
    _, best = min(fast)
    out[best] = Verdict.CHOSEN
    return tuple(out), measured[best].candidate


def _evaluated(trace: Trace) -> dict[Backend, State]:
    """Backends the machine checked, and the stage where it first did."""
    seen: dict[Backend, State] = {}
    for record in trace.records:
        if isinstance(record, CheckRecord):
            seen.setdefault(record.candidate, record.stage)
    return seen


def _machine_part(trace: Trace) -> tuple[Record, ...]:
    """The machine's records without its terminal ``selected`` record."""
    if is_tuned(trace) or not isinstance(trace.records[-1], SelectedRecord):
        raise InvalidArgumentError("only a selected, untuned decision can be tuned")
    return trace.records[:-1]


def measuring_checks(
    trace: Trace, considered: Iterable[Backend]
) -> tuple[tuple[Record, ...], tuple[Backend, ...]]:
    """The ``measuring`` stage's check and skip records, and the passing backends.

    A backend the machine already evaluated is skipped (its checks are pure
    functions of the input, so they would fail, or pass, again); the incumbent
    is among those. Every other considered backend runs every check.
    """
    incumbent = trace.outcome.backend
    seen = _evaluated(trace)
    inp = trace.input
    records: list[Record] = []
    passing: list[Backend] = []
    done: set[Backend] = set()
    for backend in considered:
        if backend in done:
            continue
        done.add(backend)
        if backend in seen:
            what = "the incumbent" if backend == incumbent else "failed"
            records.append(
                SkipRecord(
                    State.MEASURING,
                    backend,
                    f"already evaluated at {seen[backend].value} ({what})",
                )
            )
            continue
        # issue 34: an exact budget refuses lossy candidates here too, by their facts
        results = check_candidate(backend, inp.layer, inp.platform, budget=layer_budget(inp))
        for check, failures in results:
            records.append(CheckRecord(State.MEASURING, backend, check, not failures, failures))
        if not any(failures for _, failures in results):
            passing.append(backend)
    return tuple(records), tuple(passing)


def _tuning_step(source: State, event: Event, candidate: Backend) -> TransitionRecord:
    records: list[Record] = []
    _step(source, event, records, None, candidate)  # the one transition writer
    record = records[0]
    assert isinstance(record, TransitionRecord)
    return record


def tuned_trace(
    trace: Trace,
    tuning: TuningRecord,
    no_kernel: Mapping[Backend, str],
    measured: Sequence[Measured],
) -> Trace:
    """The tuned trace of a selected decision, from the measurement facts.

    ``trace`` is the machine's trace; ``no_kernel`` maps each passing
    candidate without a kernel to why; ``measured`` holds the incumbent's facts
    first, then each measured candidate's. A passing candidate with neither a
    kernel note nor a measurement is recorded as ``raised`` ("not measured"),
    so that a replay under changed rules shows it.
    """
    incumbent = trace.outcome.backend
    if incumbent is None:
        raise InvalidArgumentError("only a selected decision can be tuned")
    checks, passing = measuring_checks(trace, tuning.considered)
    by_backend = {m.candidate: m for m in measured}
    if incumbent not in by_backend:
        raise InvalidArgumentError(f"the incumbent {incumbent.name!r} has no measurement")
    records: list[Record] = [
        *_machine_part(trace),
        _tuning_step(State.SELECTED, Event.MEASURE, incumbent),
        tuning,
        *checks,
    ]
    ordered: list[Measured] = [by_backend[incumbent]]
    for backend in passing:
        if backend in no_kernel:
            detail = NO_KERNEL + (f": {no_kernel[backend]}" if no_kernel[backend] else "")
            records.append(SkipRecord(State.MEASURING, backend, detail))
        else:
            ordered.append(
                by_backend.get(
                    backend,
                    Measured(backend, error="not measured (it passed no check when recorded)"),
                )
            )
    judged, winner = verdicts(ordered, tuning.margin, tuning.tolerance, numeric_budget(trace.input))
    records += [
        MeasurementRecord(verdict=verdict, **attrs.asdict(m, recurse=False))
        for m, verdict in zip(ordered, judged, strict=True)
    ]
    origin = trace.outcome.origin
    if winner is None:
        records.append(_tuning_step(State.MEASURING, Event.INCUMBENT_KEPT, incumbent))
        records.append(SelectedRecord(incumbent, origin, trace.outcome.reason))
        outcome = trace.outcome
    else:
        reason = Reason.MEASURED_FASTER.value
        records.append(_tuning_step(State.MEASURING, Event.MEASURED_FASTER, winner))
        records.append(SelectedRecord(winner, origin, reason))
        outcome = Outcome("selected", origin, winner, reason)
    version = max(TUNED_SCHEMA_VERSION, trace.input.schema_version())
    return Trace(trace.input, tuple(records), outcome, version)


def replay_tuned(recorded: Trace, machine_trace: Trace) -> Trace:
    """A tuned trace again: the machine's part from ``machine_trace`` (a fresh run
    on the recorded input), the measuring stage's checks again, and every
    verdict and the outcome recomputed from the recorded facts."""
    tuning = next(r for r in recorded.records if isinstance(r, TuningRecord))
    no_kernel: dict[Backend, str] = {}
    for r in recorded.records:
        if (
            isinstance(r, SkipRecord)
            and r.stage is State.MEASURING
            and r.detail.startswith(NO_KERNEL)
        ):
            no_kernel[r.candidate] = r.detail[len(NO_KERNEL) :].removeprefix(": ")
    measured = [Measured.of(r) for r in recorded.records if isinstance(r, MeasurementRecord)]
    if machine_trace.outcome.status != Status.SELECTED or machine_trace.outcome.backend is None:
        return machine_trace  # the rules changed: the decision is no longer tunable
    if not measured or measured[0].candidate != machine_trace.outcome.backend:
        # the rules now select another incumbent: its facts were never recorded
        measured = [Measured(machine_trace.outcome.backend, error="not measured"), *measured]
    return tuned_trace(machine_trace, tuning, no_kernel, measured)


# -- Issue 35: the layout as a decision (``SequenceParallel(layout="auto")``) --


@frozen
class LayoutFacts:
    """What the layout rules read about one layer and its group.

    ``size``: the group's ranks; ``heads`` / ``kv_heads``: the layer's; ``causal``;
    ``mask``: it takes a key-padding mask; ``seq_len``: the full sequence when
    declared (``None``: unknown); ``kv_bytes``: bytes per key/value element
    pair (``2 * head_size * itemsize``: one key and one value element row of one
    head); ``kv_budget``: the most bytes of gathered keys and values one rank may
    hold; ``interconnect``: ``nvlink`` or ``pcie`` (or ``unknown``) and
    ``interconnect_source``: declared, or measured and how.
    """

    size: int
    heads: int
    kv_heads: int
    causal: bool = False
    mask: bool = False
    seq_len: int | None = None
    kv_bytes: int = 0
    kv_budget: int = 1 << 30
    interconnect: str = "unknown"
    interconnect_source: str = "not declared"

    def gathered_kv_bytes(self) -> int | None:
        """Bytes of the whole sequence's keys and values on one rank (AllGather-KV)."""
        return None if self.seq_len is None else self.seq_len * self.kv_heads * self.kv_bytes


def _divides(f: LayoutFacts, u: int) -> bool:
    return f.heads % u == 0 and f.kv_heads % u == 0


def _largest_ulysses(f: LayoutFacts) -> int:
    return max(u for u in range(1, f.size + 1) if f.size % u == 0 and _divides(f, u))


def _gqa_gather(f: LayoutFacts) -> bool:
    gathered = f.gathered_kv_bytes()
    return (
        f.size > 1
        and not f.causal
        and f.heads >= 4 * f.kv_heads
        and gathered is not None
        and gathered <= f.kv_budget
    )


def _pcie_pair(f: LayoutFacts) -> bool:
    return f.size == 2 and f.interconnect == "pcie" and not f.mask


def _pad_cost(f: LayoutFacts) -> float:
    return SequenceLayout(f.size, 1, f.heads, f.kv_heads, pad_heads=True).pad_cost() or 1.0


#: (rule, condition, the layout it gives, the rule in words with its source)
_LayoutRule = tuple[
    str, Callable[[LayoutFacts], bool], Callable[[LayoutFacts], SequenceLayout], str
]

#: Issue 35: how ``SequenceParallel(layout="auto")`` lays out one layer: the
#: first row whose condition holds (rule, condition, the layout it gives, the rule
#: in words with its source). Every rank reads the same facts (the interconnect
#: declared, or measured once by a timed all-reduce whose slowest rank's time
#: every rank uses), so every rank chooses alike, and the choice is verified
#: across ranks at the first forward like any decision.
LAYOUT_RULES: Final[tuple[_LayoutRule, ...]] = (
    (
        "one_rank",
        lambda f: f.size == 1,
        lambda f: SequenceLayout(1, 1),
        "a group of one rank: nothing to split",
    ),
    (
        "gqa_allgather_kv",
        _gqa_gather,
        lambda f: SequenceLayout(1, 1, allgather=f.size),
        "non-causal, at least 4 query heads per key/value head, and the whole sequence's "
        "keys and values fit the per-rank budget: one all-gather of K and V moves about "
        "2/g of what Ulysses' four all-to-alls move (g: query heads per kv head; vLLM-Omni "
        "RFC vllm-omni#5092's volume table, 0.25 against 2.25 at g=8), measured 1.24x "
        "faster than Ulysses at 2 ranks (vllm-omni#4968)",
    ),
    (
        "pcie_pair_ring",
        _pcie_pair,
        lambda f: SequenceLayout(1, 2),
        "two ranks on a PCIe-class link and no mask: the ring's point-to-point shifts "
        "overlap with compute, which pays on a slow link at 2 ranks; the crossover "
        "reverses at 4 (vllm-omni#5092's Wan2.2 characterization)",
    ),
    (
        "ulysses_divides",
        lambda f: _divides(f, f.size),
        lambda f: SequenceLayout(f.size, 1),
        "the heads and kv heads divide by the group's size: Ulysses' all-to-all volume "
        "per rank does not grow with the degree, and every rank runs the dense kernel "
        "(DeepSpeed-Ulysses; xDiT's USP, arXiv 2405.07719, puts Ulysses first)",
    ),
    (
        "usp",
        lambda f: not f.mask and _largest_ulysses(f) > 1,
        lambda f: SequenceLayout(_largest_ulysses(f), f.size // _largest_ulysses(f)),
        "the heads divide by part of the group and no mask: Ulysses over the largest "
        "degree that divides them, a ring over the rest (xDiT's USP, arXiv 2405.07719)",
    ),
    (
        "pad_heads",
        lambda f: _pad_cost(f) < MAX_PAD_COST,
        lambda f: SequenceLayout(f.size, 1, pad_heads=True),
        "the heads do not divide and padding them to the next multiple costs less than "
        "the bound: Ulysses on zero-padded heads (vLLM-Omni's advanced_uaa, 14.3% for 14 "
        "heads on 4 ranks, vllm-omni#7641)",
    ),
    (
        "ring",
        lambda f: not f.mask,
        lambda f: SequenceLayout(1, f.size),
        "no mask: a ring of the whole group puts no condition on the heads",
    ),
    (
        "allgather_kv",
        lambda f: not f.causal,
        lambda f: SequenceLayout(1, 1, allgather=f.size),
        "a masked, non-causal layer whose heads neither divide nor pad cheaply: "
        "AllGather-KV gathers the mask with the keys and puts no condition on the heads "
        "(vllm-omni#4968)",
    ),
    (
        "pad_heads_anyway",
        lambda f: True,
        lambda f: SequenceLayout(f.size, 1, pad_heads=True),
        "otherwise (a masked causal layer whose heads do not divide): padded Ulysses, "
        "which the layout check refuses when padding costs too much (padding_too_costly)",
    ),
)


def choose_layout(facts: LayoutFacts) -> SequenceLayout:
    """Issue 35: the first row of ``LAYOUT_RULES`` that holds, as a layout with the
    layer's head counts, the rule and why (the facts read)."""
    for rule, holds, make, words in LAYOUT_RULES:
        if holds(facts):
            chosen = make(facts)
            gathered = facts.gathered_kv_bytes()
            why = (
                f"{words} [facts: {facts.size} ranks, {facts.heads}/{facts.kv_heads} heads, "
                f"{'causal' if facts.causal else 'non-causal'}, "
                f"{'key-padding mask' if facts.mask else 'no mask'}, sequence "
                f"{'undeclared' if facts.seq_len is None else facts.seq_len}"
                + ("" if gathered is None else f" ({gathered} B of gathered K/V per rank)")
                + f", interconnect {facts.interconnect} ({facts.interconnect_source})]"
            )
            return attrs.evolve(
                chosen, num_heads=facts.heads, num_kv_heads=facts.kv_heads, rule=rule, why=why
            )
    raise AssertionError("LAYOUT_RULES ends with a row that always holds")


# -- issue 35: the automatic layout of a plan's sites (attnres plan DIR --sp-degree) --


_ITEMSIZE: Final = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@frozen
class AutoLayout:
    """Issue 35: ``attnres plan DIR --sp-degree N``: the layout
    ``SequenceParallel(layout="auto")`` would choose for each denoiser site of a
    group of ``degree`` ranks (:data:`LAYOUT_RULES`), from the site's
    head facts, the declared interconnect and sequence."""

    degree: int = field(converter=_degree)
    interconnect: str = "unknown"
    seq_len: int | None = None
    kv_budget: int = 1 << 30

    def choose_for_site(self, component: str, site: Any) -> Any:
        """``site`` (an integration's site description) with the chosen layout, when
        its component takes one (:data:`attnres.layout.LAYOUT_KINDS`) and its head
        facts are known."""
        if component_kind(component) not in LAYOUT_KINDS or site.heads is None:
            return site
        kv_heads = site.kv_heads or site.heads
        facts = LayoutFacts(
            self.degree,
            site.heads,
            kv_heads,
            site.requirements.causal,
            site.requirements.mask is not MaskKind.NONE,
            self.seq_len,
            2 * (site.head_size or 0) * _ITEMSIZE.get(site.dtype, 2),
            self.kv_budget,
            self.interconnect,
            "declared" if self.interconnect != "unknown" else "not declared",
        )
        return attrs.evolve(site, layout=choose_layout(facts))
