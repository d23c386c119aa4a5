"""The ``sglang`` selection profile: SGLang multimodal_gen's rules as data (issues 23, 33).

``SelectionConfig(profile="sglang")`` makes :func:`attnres.machine.run_machine`
decide the way SGLang 0.5.23's ``get_attn_backend``
(``sglang/multimodal_gen/runtime/layers/attention/selector.py``) does. The
profile is one value, :data:`SGLANG` (an :class:`attnres._profile.Profile`,
which says what each field means); ``run_machine`` walks it as it walks
attnres's own contract. Every rule is a row here, rendered in
``docs/state-machine.md``: which request wins (``ORIGIN_ROWS``), whether a
failed request may fall back and so the reason it records (``FALLBACK_ROWS``,
SGLang PR 37441), the candidate order (``_candidates``), an explicit backend
admitted outside a layer's declared set (``EXPLICIT_BYPASSES_SUPPORTED``: PR
37441, the strict rule its users hit in issues 39070 and 34389), the names a
supported set admits (``SATISFIES``) or folds (``ALIASES``), and the reasons a
selection records beyond the transitions' (``SELECTED_REASONS``).

The platform is observed, never enumerated: SGLang's platform (its chains, its
CPU behaviour of serving every backend by SDPA with a warning, its packed-varlen
facts per backend class) is recorded by the plugin as
:class:`~attnres.platform.HostResolution` facts in the trace's platform, and
this profile reads only those (``_evaluate``). A trace therefore replays
without SGLang. Outside the plugin no fact is observed: the profile rejects
with :data:`UNOBSERVED` and names how to supply them (:data:`HOST_FACTS`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Final

from attnres._profile import (
    UNOBSERVED,
    Asked,
    Evaluation,
    Given,
    Guard,
    OriginRow,
    Profile,
    ReasonRow,
    Results,
    Tried,
    host_facts,
)
from attnres._states import Check, Code, Event, Origin, Reason, State
from attnres._vocab import Role
from attnres.backends import Backend
from attnres.records import Failure, TraceInput

__all__ = [
    "ALIASES",
    "EXPLICIT_BYPASSES_SUPPORTED",
    "FALLBACK_ROWS",
    "HOST_FACTS",
    "ORIGIN_ROWS",
    "ROLE_OVERRIDE_REASONS",
    "SATISFIES",
    "SELECTED_REASONS",
    "SGLANG",
    "SGLANG_VERSION",
    "UNOBSERVED",
]

#: The SGLang release these rows were read from.
SGLANG_VERSION: Final = "0.5.23"


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
        attrgetter("backend"),
    ),
    OriginRow(
        Origin.FORCED,
        "global_force_attn_backend (process-wide)",
        True,
        attrgetter("config.forced_backend"),
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
        attrgetter("layer.default"),
    ),
)

#: Whether the request may fall back, in order: the first row that holds
#: decides (its event sets the reason, ``attnres.machine.TRANSITIONS``;
#: ``strict_failure``: strict, the request alone is evaluated).
FALLBACK_ROWS: Final[tuple[Guard, ...]] = (
    Guard("nothing requested", lambda f: not f.requested, Event.PREFERENCE_FALLBACK),
    Guard(
        "a sparse backend requested for cross-attention",
        lambda f: f.role_failed,
        Event.SPARSE_CROSS_FALLBACK,
    ),
    Guard(
        "--attention-backend, and the layer declares a default or its component allows "
        "global fallback",
        lambda f: f.global_explicit and f.relaxed,
        Event.GLOBAL_FALLBACK,
    ),
    Guard(
        "not explicit (a preference or a layer default)",
        lambda f: not f.explicit,
        Event.PREFERENCE_FALLBACK,
    ),
    Guard("otherwise: explicit, strict", lambda f: True, Event.STRICT_FAILURE),
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

#: The reasons a selection records when no transition set one, first that applies.
SELECTED_REASONS: Final[tuple[ReasonRow, ...]] = (
    ReasonRow(
        "a role override: the layer's role (`ROLE_OVERRIDE_REASONS`)",
        lambda inp, origin, served: (
            ROLE_OVERRIDE_REASONS[inp.layer.role] if origin is Origin.ROLE_OVERRIDE else None
        ),
    ),
    ReasonRow(
        "nothing requested, and the selected backend is the layer's only supported one",
        lambda inp, origin, served: (
            Reason.COMPONENT_CONSTRAINT
            if origin is Origin.NONE
            and inp.layer.supported is not None
            and len(inp.layer.supported) == 1
            and served in inp.layer.supported
            else None
        ),
    ),
)

#: How the facts this profile decides from are supplied (a rejection for a
#: missing one says so).
HOST_FACTS: Final = host_facts("sglang", "SGLang", "docs/sglang.md")


@functools.lru_cache(maxsize=256)
def _sglang_order(backends: frozenset[Backend]) -> tuple[Backend, ...]:
    """A supported set in SGLang's order (it sorts its enum members by their
    upper-case names). Memoised per set: a pure function of the names, so no
    registry change or cleared cache can make it stale."""
    return tuple(sorted(backends, key=lambda b: b.name.upper()))


def _names(backends: tuple[Backend, ...]) -> str:
    return "[" + ", ".join(repr(b.name) for b in backends) + "]"


def _candidates(stage: State, given: Given, requested: Backend | None) -> Sequence[Backend | None]:
    """The request (or the platform's own pick), then -- when the request may fall
    back -- the layer default, the platform's own pick and the supported set in
    SGLang's order; each is evaluated once."""
    inp = given.inp
    if stage is State.REQUESTED:
        return (requested,)
    if stage is State.COMPONENT_DEFAULT:
        return () if inp.layer.default is None else (inp.layer.default,)
    if stage is State.PLATFORM_DEFAULT:
        return (None,)
    return _sglang_order(inp.layer.supported) if inp.layer.supported else ()


def _supported(profile: Profile, served: Backend, supported: frozenset[Backend]) -> bool:
    # a Backend equals (and hashes like) its name, so name groups test directly
    if served in supported:
        return True
    return any(group <= supported for group in profile.satisfies.get(served.name, ()))


def _evaluate(
    profile: Profile, candidate: Backend | None, inp: TraceInput, bypass_supported: bool
) -> Evaluation:
    """The checks of one candidate, on the backend SGLang's platform serves it by
    (its observed :class:`~attnres.platform.HostResolution`): ``platform``, then
    ``role`` and ``supported``, then -- when those pass -- ``requirements``."""
    layer = inp.layer
    fact = inp.platform.host_resolution("" if candidate is None else candidate.name)
    if fact is None or fact.served is None:
        error = UNOBSERVED if fact is None else str(fact.error)
        return candidate, ((Check.PLATFORM, (Failure(Code.HOST_PLATFORM, error),)),)
    served = Backend(fact.served)
    role: tuple[Failure, ...] = ()
    if layer.role is Role.CROSS and fact.served_sparse:
        role = (
            Failure(
                Code.SPARSE_CROSS_ATTENTION,
                f"Sparse attention backend '{served.name}' cannot serve cross-attention",
            ),
        )
    automatic = layer.supported or frozenset()
    unsupported: tuple[Failure, ...] = ()
    if automatic and not bypass_supported and not _supported(profile, served, automatic):
        unsupported = (
            Failure(
                Code.NOT_IN_SUPPORTED_SET,
                f"Attention backend '{served.name}' is not supported by this attention "
                f"layer; supported backends: {_names(_sglang_order(automatic))}",
            ),
        )
    results: Results = (
        (Check.PLATFORM, ()),
        (Check.ROLE, role),
        (Check.SUPPORTED, unsupported),
    )
    if role or unsupported:
        return served, results
    missing = tuple(
        Failure(Code.REQUIREMENT_UNMET, f"does not implement {m}") for m in fact.missing
    )
    return served, (*results, (Check.REQUIREMENTS, missing))


def _reject(
    profile: Profile, inp: TraceInput, tried: Sequence[Tried], refused: bool
) -> tuple[str, str]:
    """SGLang's error: the first unmet requirement, else the first failure, else
    "no compatible backend"; a missing host fact names how to supply it."""
    unmet: tuple[str, list[str]] | None = None
    first: Failure | None = None
    for _, subject, results in tried:
        for check, failures in results:
            if not failures:
                continue
            if check is Check.REQUIREMENTS:
                if unmet is None and subject is not None:
                    unmet = (
                        subject.name,
                        [f.message.removeprefix("does not implement ") for f in failures],
                    )
            elif first is None:
                first = failures[0]
            break
    if unmet is not None:
        message = f"Attention backend '{unmet[0]}' does not implement {', '.join(unmet[1])}"
        code = Code.REQUIREMENT_UNMET
    elif first is not None:
        message, code = first.message, first.code
        if message == UNOBSERVED and profile.host_facts:
            message += f": {profile.host_facts}"
    else:
        message, code = "No compatible attention backend is available", Code.NO_COMPATIBLE_BACKEND
    # SGLang names the component only when its context has a name
    component = None if inp.scope is None else inp.scope.component
    if component:
        message += f" for component '{component}'"
    return message, str(code)


def _sparse(inp: TraceInput, backend: Backend) -> bool:
    fact = inp.platform.host_resolution(backend.name)
    return fact is not None and fact.sparse


#: The ``sglang`` profile (``SelectionConfig(profile="sglang")``).
SGLANG: Final = Profile(
    name="sglang",
    origins=ORIGIN_ROWS,
    nothing_requested="nothing requested",
    aliases=ALIASES,
    request_failure=FALLBACK_ROWS,
    states_fallback=True,
    sparse=_sparse,
    candidates=_candidates,
    evaluate=_evaluate,
    explicit_bypasses_supported=EXPLICIT_BYPASSES_SUPPORTED,
    selected_reasons=SELECTED_REASONS,
    reject=_reject,
    host_facts=HOST_FACTS,
    source=f"SGLang {SGLANG_VERSION}'s multimodal_gen selector (`get_attn_backend`)",
    satisfies=SATISFIES,
)
