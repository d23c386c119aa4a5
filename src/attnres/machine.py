"""The resolution machine: states, the transition table, the checks, resolve().

Everything that decides which backend a layer runs lives in this module: the
transition table (``TRANSITIONS``), origin detection (``detect_origin``), the
candidate lists of each stage (``stage_candidates``), the checks
(``check_candidate``) and the rejection messages. Other modules only name
things (``_states``), record them (``trace``), or act on the outcome.

Theory of operation
-------------------
A resolution starts in ``origin_detection``. Origin detection finds the
requested backend and whether the request is strict (SPEC 3.1, 3.2). The
machine then walks the candidate stages in order -- ``requested``,
``component_default``, ``platform_default``, ``supported_set`` -- evaluating
each stage's candidates (skipping ones already evaluated). Every candidate runs
every check (known, available, platform, role, supported, requirements) and
every check is recorded. The first candidate that passes every check moves the
machine to ``selected``; a failure moves it along the table. A strict request
that fails goes to ``rejected``, except a sparse backend on a cross-attention
layer, which always falls back to a dense one (SPEC 3.3). Running out of
candidates is ``rejected``.

Reasons come from the table too: the first transition that carries a reason
fixes the outcome's reason (``None`` when the first candidate was accepted).

The machine itself (:func:`run_machine`) is a pure function of its input
(:class:`~attnres.trace.TraceInput`); :func:`resolve` gathers the input from the
caller's context (scope, config, platform), caches the outcome, records the
decision and emits the audit events.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final

import attrs
from attrs import field, frozen

from attnres import platform as _platform_mod
from attnres._states import Check, Code, Event, Origin, Reason, State
from attnres._vocab import REQUIREMENT_PHRASES, Requirement, Role
from attnres.audit import emit_cache_hit, emit_resolution
from attnres.backends import (
    Backend,
    BackendSpec,
    catalogue_order,
    lookup_spec,
    on_registry_change,
    registry_generation,
)
from attnres.errors import ResolutionError
from attnres.layer import LayerSpec, SelectionConfig, optional_backend
from attnres.ledger import Decision, record_decision
from attnres.platform import Platform
from attnres.scope import ScopeHandle, ScopeState, current_handle
from attnres.trace import (
    CheckRecord,
    Failure,
    OriginRecord,
    Outcome,
    Record,
    RejectedRecord,
    SelectedRecord,
    SkipRecord,
    Trace,
    TraceInput,
    TransitionRecord,
)

__all__ = [
    "CANDIDATE_STAGES",
    "CHECK_ORDER",
    "GLOBAL_EXPLICIT_ORIGINS",
    "STRICT_ORIGINS",
    "TRANSITIONS",
    "TUNABLE_ORIGINS",
    "Resolution",
    "cache_info",
    "capture_config",
    "check_candidate",
    "clear_cache",
    "detect_origin",
    "force_backend",
    "lookup",
    "rejection",
    "resolve",
    "resolve_entry",
    "run_machine",
    "selection_config",
    "set_selection_config",
]

# =============================================================================
# The transition table: state -> event -> (next state, reason it sets)
# =============================================================================
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

#: Origins whose failure rejects (SPEC 3.1); ``global_cli`` depends on 3.2.
STRICT_ORIGINS: Final = frozenset(
    {Origin.REQUEST, Origin.LAYER, Origin.FORCED, Origin.ROLE_OVERRIDE, Origin.COMPONENT_OVERRIDE}
)

#: Origins of an explicit global backend the operator chose (relaxed per SPEC 3.2).
GLOBAL_EXPLICIT_ORIGINS: Final = frozenset({Origin.GLOBAL_CLI, Origin.GLOBAL_ENV})
#: Origins whose decision autotune may measure and replace: the automatic ones.
#: A backend the operator or the code asked for (every other origin) is never
#: tuned. Adding an origin to the vocabulary means deciding here whether it is
#: automatic.
TUNABLE_ORIGINS: Final = frozenset({Origin.NONE, Origin.LAYER_DEFAULT, Origin.GLOBAL_PREFERENCE})

#: Which check's failure names a strict rejection, most fundamental first.
_PRIMARY_ORDER: Final = (
    Check.KNOWN,
    Check.SUPPORTED,
    Check.ROLE,
    Check.REQUIREMENTS,
    Check.PLATFORM,
    Check.AVAILABLE,
)


# =============================================================================
# Origin detection (SPEC 3.1, 3.2)
# =============================================================================


@frozen
class DetectedOrigin:
    origin: Origin
    backend: Backend | None
    strict: bool
    detail: str


def detect_origin(inp: TraceInput) -> DetectedOrigin:
    """The first origin that applies, the backend it requests, and its strictness."""
    layer, config, scope = inp.layer, inp.config, inp.scope
    if inp.request is not None:
        return DetectedOrigin(
            Origin.REQUEST,
            inp.request,
            True,
            "backend requested for one request (attnres.request_backend)",
        )
    if inp.backend is not None:
        return DetectedOrigin(
            Origin.LAYER, inp.backend, True, "backend passed explicitly for this layer"
        )
    if config.forced_backend is not None:
        return DetectedOrigin(
            Origin.FORCED, config.forced_backend, True, "process-wide forced backend"
        )
    if scope is not None:
        role_backend = scope.role_backend(layer.role)
        via = ""
        if role_backend is None:
            role_backend = config.role_backend(scope.component, layer.role)
            via = f" (--attention-backend {scope.component}.{layer.role.value}=...)"
        if role_backend is not None:
            return DetectedOrigin(
                Origin.ROLE_OVERRIDE,
                role_backend,
                True,
                f"component {scope.component!r} override for {layer.role.value}-attention "
                f"layers ({scope.component}.{layer.role.value}){via}",
            )
        component_backend = scope.backend or config.component_backend(scope.component)
        if component_backend is not None:
            return DetectedOrigin(
                Origin.COMPONENT_OVERRIDE,
                component_backend,
                True,
                f"component {scope.component!r} override",
            )
    if config.global_backend is not None:
        if not config.global_backend_explicit:
            return DetectedOrigin(
                Origin.GLOBAL_PREFERENCE,
                config.global_backend,
                False,
                "global backend preference, derived or defaulted (not typed by the operator)",
            )
        relaxed_by: list[str] = []
        if layer.default is not None:
            relaxed_by.append(f"the layer declares default {layer.default.name!r}")
        if scope is not None and scope.allow_global_fallback:
            relaxed_by.append(
                f"component {scope.component!r} ({scope.kind}, {scope.loader}) allows "
                f"global fallback"
            )
        if relaxed_by:
            detail = "relaxed: " + " and ".join(relaxed_by)
        elif scope is None:
            detail = "strict: no component scope (a component of unknown kind)"
        else:
            detail = (
                f"strict: component {scope.component!r} ({scope.kind}, {scope.loader}) does "
                f"not allow global fallback and the layer declares no default"
            )
        if config.global_backend_env is not None:
            return DetectedOrigin(
                Origin.GLOBAL_ENV,
                config.global_backend,
                not relaxed_by,
                f"{config.global_backend_env} set in the environment by the operator; {detail}",
            )
        return DetectedOrigin(
            Origin.GLOBAL_CLI,
            config.global_backend,
            not relaxed_by,
            f"--attention-backend set by the operator; {detail}",
        )
    if layer.default is not None:
        return DetectedOrigin(
            Origin.LAYER_DEFAULT, layer.default, False, "nothing requested: the layer's default"
        )
    return DetectedOrigin(Origin.NONE, None, False, "nothing requested and no layer default")


def stage_candidates(stage: State, inp: TraceInput, requested: Backend | None) -> list[Backend]:
    """The candidates a stage evaluates, in order (duplicates skipped later)."""
    if stage is State.REQUESTED:
        return [] if requested is None else [requested]
    if stage is State.COMPONENT_DEFAULT:
        return [] if inp.layer.default is None else [inp.layer.default]
    if stage is State.PLATFORM_DEFAULT:
        return list(inp.platform.default_chain())
    if stage is State.SUPPORTED_SET:
        supported = inp.layer.supported or frozenset()
        return sorted(supported, key=lambda b: (catalogue_order(b), b.name))
    raise ValueError(f"state {stage.value!r} evaluates no candidates")


# =============================================================================
# Checks: pure functions of (spec, layer, platform); every failure collected
# =============================================================================


def _package_failure(
    name: str, platform: Platform, alternatives: tuple[str, ...] = ()
) -> list[Failure]:
    """Why neither ``name`` nor one of its ``alternatives`` works here ([] if one does)."""
    facts = [platform.package(n) for n in (name, *alternatives)]
    if any(f.status == "present" for f in facts):
        return []
    broken = [f for f in facts if f.status == "broken"]
    if broken:
        return [
            Failure(Code.PACKAGE_BROKEN, f"package {f.name!r} is broken: {f.detail}")
            for f in broken
        ]
    fact = facts[0]
    detail = "" if fact.detail in (None, "not installed") else f" ({fact.detail})"
    nor = "".join(f" (nor its older packaging {a!r})" for a in alternatives)
    return [Failure(Code.PACKAGE_MISSING, f"package {name!r} is not installed{detail}{nor}")]


def _check_available(spec: BackendSpec, platform: Platform) -> list[Failure]:
    if spec.package is None:
        return []
    out = _package_failure(spec.package, platform, spec.package_alternatives)
    for extra in spec.extra_packages:
        out += _package_failure(extra, platform)
    return out


def _check_platform(spec: BackendSpec, layer: LayerSpec, platform: Platform) -> list[Failure]:
    out: list[Failure] = []
    kind = platform.kind
    if kind not in spec.platforms:
        runs_on = ", ".join(k for k in ("cpu", "cuda", "rocm", "mps", "xpu", "npu")
                            if k in spec.platforms)
        out.append(Failure(Code.PLATFORM_KIND, f"runs on {runs_on}, not on {kind}"))
    else:
        rule = spec.capabilities.get(kind)
        if rule is not None:
            if rule.restricts_capability:
                cap = platform.capability
                if cap is None:
                    out.append(
                        Failure(
                            Code.COMPUTE_CAPABILITY,
                            f"needs compute capability {rule.describe()}; this platform's "
                            f"is unknown",
                        )
                    )
                else:
                    if not rule.fits(cap):
                        out.append(
                            Failure(
                                Code.COMPUTE_CAPABILITY,
                                f"needs compute capability {rule.describe()}, this device is "
                                f"sm{cap[0]}{cap[1]}",
                            )
                        )
            if rule.archs is not None and platform.arch not in rule.archs:
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
    if layer.dtype not in spec.dtypes:
        takes = ", ".join(sorted(spec.dtypes))
        out.append(Failure(Code.DTYPE, f"does not take dtype {layer.dtype} (takes {takes})"))
    else:
        dtype_rule = spec.dtype_capabilities.get(layer.dtype)
        if dtype_rule is not None and kind == "cuda":
            cap = platform.capability
            if cap is None or not dtype_rule.fits(cap):
                here = "this platform's is unknown" if cap is None else (
                    f"this device is sm{cap[0]}{cap[1]}"
                )
                out.append(
                    Failure(
                        Code.DTYPE,
                        f"takes dtype {layer.dtype} only on compute capability "
                        f"{dtype_rule.describe()}, {here}",
                    )
                )
    for problem in spec.head_sizes.failures(layer.head_size):
        out.append(Failure(Code.HEAD_SIZE, problem))
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


def _check_supported(spec: BackendSpec, layer: LayerSpec) -> list[Failure]:
    if supported_by(spec, layer.supported):
        return []
    return [
        Failure(
            Code.NOT_IN_SUPPORTED_SET,
            f"not in the layer's supported set {_names(layer.supported)}",
        )
    ]


def _check_requirements(spec: BackendSpec, layer: LayerSpec, platform: Platform) -> list[Failure]:
    needed = layer.requirements.needed()
    out = [
        Failure(Code.REQUIREMENT_UNMET, f"does not implement {REQUIREMENT_PHRASES[req]}")
        for req in needed
        if req not in spec.implements
    ]
    # a limit withdraws what the spec claims (an unclaimed requirement failed above)
    out += [
        Failure(Code.REQUIREMENT_UNMET, f"does not implement {limit.describe()} ({limit.because})")
        for limit in spec.limits
        if limit.requirements <= spec.implements
        and limit.applies(needed, platform.kind, platform.capability)
    ]
    # causal masks and sliding windows are laid along one diagonal; when query and
    # key lengths differ (cross-attention) flash-style kernels take the bottom-right one
    for req, what in _ALIGNED:
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


#: The requirements whose mask follows the diagonal, and how a failure names them.
_ALIGNED: Final = ((Requirement.CAUSAL, "causal"), (Requirement.SLIDING_WINDOW, "sliding-window"))


def check_candidate(
    backend: Backend, layer: LayerSpec, platform: Platform
) -> tuple[tuple[Check, tuple[Failure, ...]], ...]:
    """Run every check of SPEC 3.4 on one candidate; every failure is kept.

    Returns ``(check, failures)`` pairs in :data:`CHECK_ORDER`; a check passed
    when its failures are empty. An unknown backend stops after ``known``.
    """
    spec = lookup_spec(backend)
    if spec is None:
        return (
            (
                Check.KNOWN,
                (Failure(Code.UNKNOWN_BACKEND, f"backend {backend.name!r} is not registered"),),
            ),
        )
    return (
        (Check.KNOWN, ()),
        (Check.AVAILABLE, tuple(_check_available(spec, platform))),
        (Check.PLATFORM, tuple(_check_platform(spec, layer, platform))),
        (Check.ROLE, tuple(_check_role(spec, layer))),
        (Check.SUPPORTED, tuple(_check_supported(spec, layer))),
        (Check.REQUIREMENTS, tuple(_check_requirements(spec, layer, platform))),
    )


def _unusable_here(backend: Backend, layer: LayerSpec, platform: Platform) -> str:
    """Why a conditional platform preference does not apply ('' when it does).

    A platform's chain prefers a kernel "when it is usable" (SPEC 3.4: cuda -> fa
    when flash-attn is usable): its package works and the device, dtype and head
    size fit. Only the last entry of a chain is unconditional.
    """
    spec = lookup_spec(backend)
    if spec is None:
        return f"backend {backend.name!r} is not registered"
    failures = _check_available(spec, platform) + _check_platform(spec, layer, platform)
    return "; ".join(f.message for f in failures)


# =============================================================================
# Messages
# =============================================================================


def _names(backends: frozenset[Backend] | None) -> str:
    if backends is None:
        return "[any]"
    return "[" + ", ".join(repr(name) for name in sorted(b.name for b in backends)) + "]"


def _primary_message(
    backend: Backend,
    results: tuple[tuple[Check, tuple[Failure, ...]], ...],
    layer: LayerSpec,
    platform: Platform,
) -> tuple[str, str]:
    """The rejection message of a strict request, and its code."""
    failed = {check: failures for check, failures in results if failures}
    primary = next(c for c in _PRIMARY_ORDER if c in failed)
    name = backend.name
    first = failed[primary]
    if primary is Check.KNOWN:
        text = f"Unknown attention backend {name!r}"
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
    elif primary is Check.PLATFORM:
        text = (
            f"Attention backend {name!r} cannot run this layer on {platform.describe()}: "
            + "; ".join(f.message for f in first)
        )
    else:
        text = f"Attention backend {name!r} is not available: " + "; ".join(
            f.message for f in first
        )
    others = [
        f"{check.value}: {f.message}"
        for check, failures in results
        if check is not primary
        for f in failures
    ]
    if others:
        text += "; also " + "; ".join(others)
    return text, str(first[0].code)


def _exhausted_message(tried: list[tuple[State, Backend, tuple[Failure, ...]]]) -> str:
    if not tried:
        return (
            "No compatible attention backend is available: no candidate to evaluate (nothing "
            "requested, no layer default, and the platform's default chain is empty)"
        )
    parts = [
        f"{b.name} ({stage.value}): " + "; ".join(f.message for f in failures)
        for stage, b, failures in tried
    ]
    return "No compatible attention backend is available: tried " + " | ".join(parts)


# =============================================================================
# The machine
# =============================================================================


def _step(
    state: State, event: Event, records: list[Record], reason: Reason | None,
    candidate: Backend | None = None,
) -> tuple[State, Reason | None]:
    try:
        target, sets = TRANSITIONS[state][event]
    except KeyError:
        raise AssertionError(
            f"no transition from state {state.value!r} on event {event.value!r}"
        ) from None
    records.append(TransitionRecord(state, event, target, candidate, sets.value if sets else None))
    return target, (reason if reason is not None else sets)


def run_machine(inp: TraceInput) -> Trace:
    """Run the machine on one input; a pure function (no context, no cache, no I/O)."""
    records: list[Record] = []
    found = detect_origin(inp)
    records.append(OriginRecord(found.origin, found.backend, found.strict, found.detail))
    layer, platform = inp.layer, inp.platform
    reason: Reason | None = None
    state = State.ORIGIN_DETECTION
    if found.backend is not None:
        event = Event.REQUEST_FOUND
    elif layer.default is None and layer.supported is not None and len(layer.supported) == 1:
        event = Event.SINGLE_SUPPORTED
    else:
        event = Event.NOTHING_REQUESTED
    state, reason = _step(state, event, records, reason)

    seen: dict[Backend, State] = {}
    tried: list[tuple[State, Backend, tuple[Failure, ...]]] = []
    while state not in (State.SELECTED, State.REJECTED):
        stage = state
        accepted: Backend | None = None
        candidates = stage_candidates(stage, inp, found.backend)
        for position, candidate in enumerate(candidates):
            if candidate in seen:
                records.append(
                    SkipRecord(stage, candidate, f"already evaluated at {seen[candidate].value}")
                )
                continue
            if stage is State.PLATFORM_DEFAULT and position < len(candidates) - 1:
                unusable = _unusable_here(candidate, layer, platform)
                if unusable:
                    records.append(
                        SkipRecord(
                            stage,
                            candidate,
                            f"preferred on {platform.kind} only where usable: {unusable}",
                        )
                    )
                    continue
            seen[candidate] = stage
            results = check_candidate(candidate, layer, platform)
            for check, failures in results:
                records.append(CheckRecord(stage, candidate, check, not failures, failures))
            all_failures = tuple(f for _, failures in results for f in failures)
            if not all_failures:
                accepted = candidate
                break
            tried.append((stage, candidate, all_failures))
            if stage is State.REQUESTED:
                role_failed = any(c is Check.ROLE and f for c, f in results)
                if role_failed:
                    event = Event.SPARSE_CROSS_FALLBACK
                elif found.strict:
                    event = Event.STRICT_FAILURE
                elif found.origin in GLOBAL_EXPLICIT_ORIGINS:
                    event = Event.GLOBAL_FALLBACK
                else:
                    event = Event.PREFERENCE_FALLBACK
                state, reason = _step(stage, event, records, reason, candidate)
                if state is State.REJECTED:
                    message, code = _primary_message(candidate, results, layer, platform)
                    return _finish_rejected(inp, records, found, message, code)
                break
            state, reason = _step(stage, Event.CANDIDATE_FAILED, records, reason, candidate)
        if accepted is not None:
            state, reason = _step(stage, Event.ACCEPTED, records, reason, accepted)
            reason_text = reason.value if reason is not None else None
            records.append(SelectedRecord(accepted, found.origin, reason_text))
            outcome = Outcome("selected", found.origin, accepted, reason_text)
            return Trace(inp, tuple(records), outcome)
        if state is stage:  # the stage ran out of candidates
            state, reason = _step(stage, Event.EXHAUSTED, records, reason)
    return _finish_rejected(
        inp, records, found, _exhausted_message(tried), str(Code.NO_COMPATIBLE_BACKEND)
    )


def _finish_rejected(
    inp: TraceInput, records: list[Record], found: DetectedOrigin, message: str, code: str
) -> Trace:
    if inp.scope is not None:
        message += f" for component {inp.scope.component!r}"
    records.append(RejectedRecord(found.origin, code, message))
    outcome = Outcome("rejected", found.origin, None, None, code, message)
    return Trace(inp, tuple(records), outcome)


# =============================================================================
# resolve(): context, cache, ledger, audit
# =============================================================================


@frozen
class Resolution:
    """The backend a layer runs, why, and the trace that proves it."""

    backend: Backend
    reason: str | None
    origin: str
    trace: Trace = field(eq=False, repr=False)
    component: str | None = None
    layer: str | None = None


_CONFIG_LOCK = threading.Lock()
#: the process-wide config; ``None`` until first needed, then built from the
#: environment (ATTNRES_ATTENTION_BACKEND) unless set_selection_config ran first
_CONFIG: SelectionConfig | None = None
_FORCED: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "attnres_forced_backend", default=None
)


def selection_config() -> SelectionConfig:
    """The process-wide selection config that :func:`resolve` uses by default.

    Until :func:`set_selection_config` is called it is built, once, from the
    environment: ``ATTNRES_ATTENTION_BACKEND`` sets the global backend (origin
    ``global_env``); a bad value raises a ``ValueError`` naming the variable.
    """
    global _CONFIG
    config = _CONFIG
    if config is None:
        with _CONFIG_LOCK:
            if _CONFIG is None:
                _CONFIG = SelectionConfig.from_env()
            config = _CONFIG
    return config


def set_selection_config(config: SelectionConfig) -> SelectionConfig:
    """Replace the process-wide config; returns the previous one."""
    global _CONFIG
    if not isinstance(config, SelectionConfig):
        raise TypeError(f"expected a SelectionConfig, got {type(config).__name__}")
    with _CONFIG_LOCK:
        previous, _CONFIG = _CONFIG, config
    return SelectionConfig() if previous is None else previous


@contextmanager
def force_backend(backend: Backend | str) -> Iterator[Backend]:
    """Force every resolution in this block (this thread / task) to ``backend``.

    The origin is ``forced``, which is strict: a layer that cannot run it is
    rejected (a sparse backend on a cross-attention layer falls back to dense).
    """
    parsed = optional_backend("backend")(backend)
    if parsed is None:
        raise ValueError("force_backend: backend must be a backend name, not None")
    token = _FORCED.set(parsed)
    try:
        yield parsed
    finally:
        _FORCED.reset(token)


_CacheEntry = tuple[Resolution | None, Decision, Trace]
_CACHE_MAX: Final = 4096
_CACHE: dict[tuple[object, ...], _CacheEntry] = {}
#: the same resolutions keyed without the layer's name (see _shape_key)
_SHAPES: dict[tuple[object, ...], _CacheEntry] = {}
_CACHE_LOCK = threading.Lock()


def clear_cache() -> None:
    """Forget every cached resolution (decisions already recorded stay)."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _SHAPES.clear()


# A registration change (register_backend, unregister_backend, a plugin loading)
# can change any answer: the cache forgets everything, and _resolve_cold stores
# nothing computed against an older registry.
on_registry_change(clear_cache)


def cache_info() -> dict[str, int]:
    """``size``: cached inputs; ``shapes``: distinct inputs up to the layer name."""
    return {"size": len(_CACHE), "shapes": len(_SHAPES), "max_size": _CACHE_MAX}


def resolve(
    layer: LayerSpec,
    *,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
    backend: Backend | str | None = None,
) -> Resolution:
    """Decide which backend ``layer`` runs, inside the current component scope.

    Raises :class:`~attnres.errors.ResolutionError` (with ``.trace``) when no
    backend can serve it. Resolutions are cached on their full input; a hit
    returns the same :class:`Resolution` and still records the decision.
    """
    if type(layer) is not LayerSpec and not isinstance(layer, LayerSpec):
        raise TypeError(f"resolve() takes a LayerSpec, got {type(layer).__name__}")
    cfg = capture_config(config)
    if platform is None:
        platform = _platform_mod._DETECTED or Platform.detect()
    if backend is not None and type(backend) is not Backend:
        backend = optional_backend("backend")(backend)
    return resolve_entry(layer, cfg, current_handle(), platform, backend)[0]


def capture_config(config: SelectionConfig | None = None) -> SelectionConfig:
    """The config a resolution made here and now uses: ``config`` (default: the
    process-wide one) with this context's :func:`force_backend` folded in."""
    cfg = (_CONFIG or selection_config()) if config is None else config
    forced = _FORCED.get()
    # (getattr: a config of the wrong type is reported on the cold path)
    if forced is not None and getattr(cfg, "forced_backend", forced) != forced:
        cfg = attrs.evolve(cfg, forced_backend=forced)
    return cfg


def resolve_entry(
    layer: LayerSpec,
    cfg: SelectionConfig,
    handle: ScopeHandle | None,
    platform: Platform | None,
    backend: Backend | None,
) -> tuple[Resolution, Decision]:
    """:func:`resolve` with its context given rather than read: the decision is
    recorded in the ledger and in ``handle``'s scope; rejected raises."""
    resolution, decision, trace = lookup(
        layer, cfg, None if handle is None else handle.state, platform, backend
    )
    record_decision(decision)
    if handle is not None:
        handle.entries.append((layer.role, decision))
    if resolution is None:
        raise rejection(trace)
    return resolution, decision


def rejection(trace: Trace) -> ResolutionError:
    """The error of a rejected resolution."""
    return ResolutionError(str(trace.outcome.error), trace, str(trace.outcome.code))


def lookup(
    layer: LayerSpec,
    cfg: SelectionConfig,
    scope: ScopeState | None,
    platform: Platform | None,
    backend: Backend | None,
    request: Backend | None = None,
) -> tuple[Resolution | None, Decision, Trace]:
    """The cached (or newly computed, traced and audited) outcome of one input.

    Records nothing: the caller decides whether the decision is the server's
    (the ledger, the scope) or one request's (neither). ``request`` is a
    per-request backend (origin ``request``). The resolution is ``None`` when
    the outcome is a rejection.
    """
    if platform is None:
        platform = _platform_mod._DETECTED or Platform.detect()
    key = (layer, cfg, scope, platform, backend, request)
    try:
        entry = _CACHE.get(key)
    except TypeError:  # an unhashable argument (a dict for a config, say): say which
        _check_arguments(cfg, platform)
        raise
    if entry is None:
        # argument types are checked on the cold path only: a hit costs nothing more
        _check_arguments(cfg, platform)
        entry = _resolve_renamed(layer, cfg, scope, platform, backend, request, key)
        if entry is None:
            entry = _resolve_cold(TraceInput(layer, cfg, scope, platform, backend, request), key)
    else:
        emit_cache_hit(entry[1])
    return entry


def _check_arguments(config: object, platform: object) -> None:
    if not isinstance(config, SelectionConfig):
        raise TypeError(
            f"resolve(): config must be an attnres.SelectionConfig, got {type(config).__name__}"
        )
    if not isinstance(platform, Platform):
        raise TypeError(
            f"resolve(): platform must be an attnres.Platform (Platform.detect() or "
            f"Platform.simulate('cuda:sm90+flash_attn')), got {type(platform).__name__}"
        )


def _shape_key(
    layer: LayerSpec,
    cfg: object,
    scope: object,
    platform: object,
    backend: object,
    request: object = None,
) -> tuple[object, ...]:
    """The cache key without the layer's name.

    The machine never reads a layer's name (it is carried in the trace's input
    only), so layers that differ by name alone -- ``blocks.0.attn1`` ...
    ``blocks.47.attn1`` -- share one run of the machine.
    """
    return (
        _SHAPE_MARK,
        layer.head_size,
        layer.dtype,
        layer.supported,
        layer.default,
        layer.role,
        layer.requirements,
        cfg,
        scope,
        platform,
        backend,
        request,
    )


_SHAPE_MARK: Final = object()


def _resolve_renamed(
    layer: LayerSpec,
    cfg: SelectionConfig,
    scope: ScopeState | None,
    platform: Platform,
    backend: Backend | None,
    request: Backend | None,
    key: tuple[object, ...],
) -> _CacheEntry | None:
    """A resolution of an identical layer under another name, renamed; or ``None``."""
    twin = _SHAPES.get(_shape_key(layer, cfg, scope, platform, backend, request))
    if twin is None:
        return None
    generation = registry_generation()
    recorded = twin[2]
    trace = Trace(
        TraceInput(layer, cfg, scope, platform, backend, request),
        recorded.records,
        recorded.outcome,
    )
    entry = _entry_for(trace)
    emit_cache_hit(entry[1])
    _store(key, entry, generation)
    return entry


def _entry_for(trace: Trace) -> _CacheEntry:
    inp, outcome = trace.input, trace.outcome
    component = None if inp.scope is None else inp.scope.component
    backend_name = None if outcome.backend is None else outcome.backend.name
    decision = Decision(
        component, inp.layer.name, backend_name, outcome.reason, str(outcome.origin), trace
    )
    resolution = (
        None
        if outcome.backend is None
        else Resolution(
            outcome.backend, outcome.reason, str(outcome.origin), trace, component, inp.layer.name
        )
    )
    return (resolution, decision, trace)


def _store(
    key: tuple[object, ...],
    entry: _CacheEntry,
    generation: int,
    cache: dict[tuple[object, ...], _CacheEntry] | None = None,
) -> None:
    target = _CACHE if cache is None else cache
    with _CACHE_LOCK:
        if generation != registry_generation():  # the registry changed meanwhile
            return
        if len(target) >= _CACHE_MAX:
            for old in list(target)[: _CACHE_MAX // 8]:
                del target[old]
        target[key] = entry


def _resolve_cold(inp: TraceInput, key: tuple[object, ...]) -> _CacheEntry:
    generation = registry_generation()
    trace = run_machine(inp)
    entry = _entry_for(trace)
    emit_resolution(trace, entry[1])
    _store(key, entry, generation)
    layer = inp.layer
    if layer.name is not None:
        shape = _shape_key(
            layer, inp.config, inp.scope, inp.platform, inp.backend, inp.request
        )
        _store(shape, entry, generation, _SHAPES)
    return entry
