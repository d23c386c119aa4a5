"""The ``sglang`` selection profile: SGLang multimodal_gen's rules as tables (issue 23).

``SelectionConfig(profile="sglang")`` makes :func:`attnres.machine.run_machine`
decide the way SGLang 0.5.23's ``get_attn_backend``
(``sglang/multimodal_gen/runtime/layers/attention/selector.py``) does. Where
SGLang's rules differ from attnres's own contract, the difference is a row
here, rendered in ``docs/state-machine.md``:

- ``ORIGIN_ROWS``: which request wins, in SGLang's order (the layer's explicit
  backend, the process-wide forced one, the component's role override, the
  component override, ``--attention-backend``, the layer's default);
- ``FALLBACK_ROWS``: whether a failed request may fall back, and the reason it
  records (SGLang PR 37441: an explicit backend is strict unless one of the
  relaxations holds);
- ``EXPLICIT_BYPASSES_SUPPORTED``: an explicit backend is admitted by
  capability outside a layer's declared (preferred) set -- SGLang's
  ``supported_attention_backends`` constrains automatic selection only (PR
  37441, the strict rule its users hit in issues 39070 and 34389);
- ``SATISFIES``: backends a supported set admits through another name
  (SGLang's ``_is_backend_supported``);
- ``ALIASES``: attnres names SGLang folds into one of its own (``fa3`` is
  SGLang's ``fa``).

The platform is observed, never enumerated: SGLang's platform (its chains, its
CPU behaviour of serving every backend by SDPA with a warning, its packed-varlen
facts per backend class) is recorded by the plugin as
:class:`~attnres.platform.HostResolution` facts in the trace's platform, and
this profile reads only those. A trace therefore replays without SGLang.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Final, NamedTuple, Protocol

from attrs import frozen

from attnres._outcome import Outcome
from attnres._states import Check, Code, Event, Origin, Reason, State, Status
from attnres._vocab import Role
from attnres.backends import Backend
from attnres.layer import LayerSpec, SelectionConfig
from attnres.platform import HostResolution
from attnres.scope import ScopeState
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
    "ALIASES",
    "EXPLICIT_BYPASSES_SUPPORTED",
    "FALLBACK_ROWS",
    "ORIGIN_ROWS",
    "SATISFIES",
    "SGLANG_VERSION",
    "UNOBSERVED",
    "first_request",
    "run_sglang",
]

#: The SGLang release these rows were read from.
SGLANG_VERSION: Final = "0.5.23"


class Asked(Protocol):
    """What the origin rows read: a :class:`~attnres.trace.TraceInput`, or the
    plugin's :class:`Request` before the platform is observed."""

    @property
    def layer(self) -> LayerSpec: ...
    @property
    def config(self) -> SelectionConfig: ...
    @property
    def scope(self) -> ScopeState | None: ...
    @property
    def backend(self) -> Backend | None: ...


class Request(NamedTuple):
    """The request part of an input (no platform yet): enough for the origin rows."""

    layer: LayerSpec
    config: SelectionConfig
    scope: ScopeState | None
    backend: Backend | None


@frozen
class OriginRow:
    """One way a backend is requested: ``backend`` reads it from the input."""

    origin: Origin
    words: str
    #: SGLang's ``selection_is_explicit`` for this origin
    explicit: bool
    backend: Callable[[Asked], Backend | None]


def _role_override(inp: Asked) -> Backend | None:
    return None if inp.scope is None else inp.scope.role_backend(inp.layer.role)


def _global(explicit: bool) -> Callable[[Asked], Backend | None]:
    def read(inp: Asked) -> Backend | None:
        cfg = inp.config
        return cfg.global_backend if cfg.global_backend_explicit is explicit else None

    return read


#: SGLang's order of origins: the first row whose backend is set wins.
ORIGIN_ROWS: Final[tuple[OriginRow, ...]] = (
    OriginRow(
        Origin.LAYER,
        "selected_attention_backend passed for this layer",
        True,
        lambda inp: inp.backend,
    ),
    OriginRow(
        Origin.FORCED,
        "global_force_attn_backend (process-wide)",
        True,
        lambda inp: inp.config.forced_backend,
    ),
    OriginRow(Origin.ROLE_OVERRIDE, "the component's role override", True, _role_override),
    OriginRow(
        Origin.COMPONENT_OVERRIDE,
        "the component override",
        True,
        lambda inp: None if inp.scope is None else inp.scope.backend,
    ),
    OriginRow(
        Origin.GLOBAL_CLI,
        "--attention-backend set explicitly by the operator",
        True,
        _global(True),
    ),
    OriginRow(
        Origin.GLOBAL_PREFERENCE,
        "server_args.attention_backend, not set explicitly",
        False,
        _global(False),
    ),
    OriginRow(
        Origin.LAYER_DEFAULT,
        "the layer's default_attention_backend",
        False,
        lambda inp: inp.layer.default,
    ),
)


@frozen
class FallbackFacts:
    """What the fallback rows may look at."""

    requested: bool
    explicit: bool
    #: the requested backend is sparse (SGLang's enum) and the layer is cross-attention
    sparse_on_cross: bool
    global_cli: bool
    #: the layer declares a default, or its component allows global fallback
    relaxed: bool


@frozen
class FallbackRow:
    """When ``holds``, a failed request may fall back, recording ``reason``
    (``None``: strict, the request alone is evaluated)."""

    condition: str
    holds: Callable[[FallbackFacts], bool]
    reason: Reason | None


#: Whether the request may fall back, in order: the first row that holds decides.
FALLBACK_ROWS: Final[tuple[FallbackRow, ...]] = (
    FallbackRow("nothing requested", lambda f: not f.requested, Reason.PLATFORM_DEFAULT_FALLBACK),
    FallbackRow(
        "a sparse backend requested for cross-attention",
        lambda f: f.sparse_on_cross,
        Reason.DENSE_CROSS_ATTENTION_FALLBACK,
    ),
    FallbackRow(
        "--attention-backend, and the layer declares a default or its component allows "
        "global fallback",
        lambda f: f.global_cli and f.relaxed,
        Reason.GLOBAL_BACKEND_FALLBACK,
    ),
    FallbackRow(
        "not explicit (a preference or a layer default)",
        lambda f: not f.explicit,
        Reason.PLATFORM_DEFAULT_FALLBACK,
    ),
    FallbackRow("otherwise: explicit, strict", lambda f: True, None),
)

#: An explicit request (the first candidate of an explicit origin) skips the
#: supported-set check: the layer's set constrains automatic selection only.
EXPLICIT_BYPASSES_SUPPORTED: Final = True

#: Backends a layer's supported set admits through other names (any one group).
SATISFIES: Final[dict[str, tuple[frozenset[str], ...]]] = {
    "torch_cudnn_sdpa": (frozenset({"torch_sdpa"}),),
    "dynamic_cudnn_sdpa": (frozenset({"fa", "torch_sdpa"}),),
}

#: attnres names SGLang folds into one of its own backends.
ALIASES: Final[dict[str, str]] = {"fa3": "fa"}

#: The reason a role override's own selection records.
ROLE_OVERRIDE_REASONS: Final[dict[Role, Reason]] = {
    Role.SELF: Reason.SELF_ATTENTION_OVERRIDE,
    Role.CROSS: Reason.CROSS_ATTENTION_OVERRIDE,
}

#: The failure of a candidate whose host resolution the input does not hold:
#: the plugin observes it and runs the machine again (a replayed trace holds
#: every fact its decision consulted, so it never meets this).
UNOBSERVED: Final = "not resolved by the host platform"


def _supported(served: Backend, supported: frozenset[Backend]) -> bool:
    # a Backend equals (and hashes like) its name, so name groups test directly
    if served in supported:
        return True
    return any(group <= supported for group in SATISFIES.get(served.name, ()))


def _origin(inp: Asked) -> tuple[OriginRow | None, Backend | None]:
    """The first origin row that is set, and the backend it requests (aliases folded)."""
    for row in ORIGIN_ROWS:
        requested = row.backend(inp)
        if requested is not None:
            alias = ALIASES.get(requested.name)
            return row, (requested if alias is None else Backend(alias))
    return None, None


def first_request(
    layer: LayerSpec, config: SelectionConfig, scope: ScopeState | None, backend: Backend | None
) -> Backend | None:
    """The backend the profile evaluates first (``None``: the platform's own pick)."""
    return _origin(Request(layer, config, scope, backend))[1]


@functools.lru_cache(maxsize=256)
def _sglang_order(backends: frozenset[Backend]) -> tuple[Backend, ...]:
    """A supported set in SGLang's order (it sorts its enum members by their
    upper-case names). Memoised per set: a pure function of the names, so no
    registry change or cleared cache can make it stale."""
    return tuple(sorted(backends, key=lambda b: b.name.upper()))


def _names(backends: tuple[Backend, ...]) -> str:
    return "[" + ", ".join(repr(b.name) for b in backends) + "]"


#: The core's step: ``(state, event, records, reason, candidate) -> (state, reason)``,
#: which checks the transition against ``attnres.machine.TRANSITIONS`` and records it.
Step = Callable[
    [State, Event, list[Record], Reason | None, Backend | None], tuple[State, Reason | None]
]

#: How a failed request leaves ``requested``: by the reason its fallback row set.
_REQUEST_FAILED: Final[dict[Reason | None, Event]] = {
    None: Event.STRICT_FAILURE,
    Reason.GLOBAL_BACKEND_FALLBACK: Event.GLOBAL_FALLBACK,
    Reason.DENSE_CROSS_ATTENTION_FALLBACK: Event.SPARSE_CROSS_FALLBACK,
    Reason.PLATFORM_DEFAULT_FALLBACK: Event.PREFERENCE_FALLBACK,
}


def _slots(
    first_stage: State,
    requested: Backend | None,
    may_fall_back: bool,
    default: Backend | None,
    automatic: frozenset[Backend],
) -> Iterator[tuple[State, Backend | None]]:
    """The candidates in order, each once: the request (or the platform's pick),
    then, when the request may fall back, the layer default, the platform's
    pick and the supported set in SGLang's order. Generated as the machine
    consumes them: a decision its first candidate serves builds no more."""
    yield first_stage, requested
    if not may_fall_back:
        return
    taken: set[Backend | None] = {requested}
    if default is not None and default not in taken:
        taken.add(default)
        yield State.COMPONENT_DEFAULT, default
    if None not in taken:
        taken.add(None)
        yield State.PLATFORM_DEFAULT, None
    for backend in _sglang_order(automatic) if automatic else ():
        if backend not in taken:
            taken.add(backend)
            yield State.SUPPORTED_SET, backend


def run_sglang(inp: TraceInput, step: Step) -> Trace:
    """The ``sglang`` profile's machine: a pure function of the input.

    It walks the core's transition table (``step``): the stages and events are
    attnres's, the rows above decide which fire.
    """
    layer, platform = inp.layer, inp.platform
    row, requested = _origin(inp)
    origin = Origin.NONE if row is None else row.origin
    explicit = row is not None and row.explicit
    requested_fact = None if requested is None else platform.host_resolution(requested.name)
    facts = FallbackFacts(
        requested=requested is not None,
        explicit=explicit,
        sparse_on_cross=(
            layer.role is Role.CROSS and requested_fact is not None and requested_fact.sparse
        ),
        global_cli=origin is Origin.GLOBAL_CLI,
        relaxed=layer.default is not None
        or (inp.scope is not None and inp.scope.allow_global_fallback),
    )
    fallback = FALLBACK_ROWS[-1]
    for fallback in FALLBACK_ROWS:
        if fallback.holds(facts):
            break
    records: list[Record] = [
        OriginRecord(
            origin,
            requested,
            fallback.reason is None,
            ("nothing requested" if row is None else row.words)
            + f"; sglang profile: {fallback.condition}",
        )
    ]
    automatic = layer.supported or frozenset()
    first_stage = State.REQUESTED if requested is not None else State.PLATFORM_DEFAULT
    selection_error: Failure | None = None
    unmet: tuple[str, tuple[str, ...]] | None = None
    state, _ = step(
        State.ORIGIN_DETECTION,
        Event.NOTHING_REQUESTED if requested is None else Event.REQUEST_FOUND,
        records,
        None,
        None,
    )
    request_failed = _REQUEST_FAILED[fallback.reason]

    def failed(stage: State, candidate: Backend | None) -> State:
        event = request_failed if stage is State.REQUESTED else Event.CANDIDATE_FAILED
        return step(stage, event, records, None, candidate)[0]

    slots = _slots(first_stage, requested, fallback.reason is not None, layer.default, automatic)
    for index, (stage, candidate) in enumerate(slots):
        while state is not stage:  # the stages between hold no candidate
            state, _ = step(state, Event.EXHAUSTED, records, None, None)
        fact = platform.host_resolution("" if candidate is None else candidate.name)
        served = _served(fact)
        if served is None:
            error = UNOBSERVED if fact is None else str(fact.error)
            failure = Failure(Code.HOST_PLATFORM, error)
            if candidate is not None:
                records.append(CheckRecord(stage, candidate, Check.PLATFORM, False, (failure,)))
            selection_error = selection_error or failure
            state = failed(stage, candidate)
            continue
        assert fact is not None
        role: tuple[Failure, ...] = ()
        if layer.role is Role.CROSS and fact.served_sparse:
            role = (
                Failure(
                    Code.SPARSE_CROSS_ATTENTION,
                    f"Sparse attention backend '{served.name}' cannot serve cross-attention",
                ),
            )
        explicit_first = explicit and index == 0 and EXPLICIT_BYPASSES_SUPPORTED
        unsupported: tuple[Failure, ...] = ()
        if automatic and not explicit_first and not _supported(served, automatic):
            unsupported = (
                Failure(
                    Code.NOT_IN_SUPPORTED_SET,
                    f"Attention backend '{served.name}' is not supported by this attention "
                    f"layer; supported backends: {_names(_sglang_order(automatic))}",
                ),
            )
        records.append(CheckRecord(stage, served, Check.PLATFORM, True, ()))
        records.append(CheckRecord(stage, served, Check.ROLE, not role, role))
        records.append(CheckRecord(stage, served, Check.SUPPORTED, not unsupported, unsupported))
        if role or unsupported:
            selection_error = selection_error or (role or unsupported)[0]
            state = failed(stage, served)
            continue
        missing = (
            tuple(Failure(Code.REQUIREMENT_UNMET, f"does not implement {m}") for m in fact.missing)
            if fact.missing
            else ()
        )
        records.append(CheckRecord(stage, served, Check.REQUIREMENTS, not missing, missing))
        if missing:
            unmet = unmet or (served.name, fact.missing)
            state = failed(stage, served)
            continue
        reason = fallback.reason if index > 0 else None
        if reason is None and origin is Origin.ROLE_OVERRIDE:
            reason = ROLE_OVERRIDE_REASONS[layer.role]
        if reason is None and requested is None and len(automatic) == 1 and served in automatic:
            reason = Reason.COMPONENT_CONSTRAINT  # the layer's only supported backend
        step(stage, Event.ACCEPTED, records, None, served)
        records.append(SelectedRecord(served, origin, reason))
        return Trace(inp, tuple(records), Outcome(Status.SELECTED, origin, served, reason))
    while state is not State.REJECTED:
        state, _ = step(state, Event.EXHAUSTED, records, None, None)
    # SGLang names the component only when its context has a name
    component = None if inp.scope is None else inp.scope.component
    suffix = f" for component '{component}'" if component else ""
    if unmet is not None:
        message = f"Attention backend '{unmet[0]}' does not implement {', '.join(unmet[1])}"
        code = Code.REQUIREMENT_UNMET
    elif selection_error is not None:
        message, code = selection_error.message, selection_error.code
    else:
        message, code = "No compatible attention backend is available", Code.NO_COMPATIBLE_BACKEND
    message += suffix
    records.append(RejectedRecord(origin, code, message))
    return Trace(inp, tuple(records), Outcome(Status.REJECTED, origin, None, None, code, message))


def _served(fact: HostResolution | None) -> Backend | None:
    if fact is None or fact.served is None:
        return None
    return Backend(fact.served)
