"""What a selection profile is: the rules :func:`attnres.machine.run_machine` reads.

One machine, several rule sets (issue 33). A :class:`Profile` is a value: its
origins and their order, the rows that say whether a failed request falls back
(and so the reason it records), the candidates of each stage, the checks one
candidate runs, whether an explicit backend bypasses the layer's declared set,
the names it folds into others, the reasons a selection records beyond the
transitions', the rejection message, and -- for a profile that decides from a
host framework's own answers -- how those facts are supplied. attnres's own
contract is one such value (``attnres.machine.ATTNRES``), SGLang's another
(``attnres._profile_sglang.SGLANG``); ``attnres.machine.PROFILES`` maps each
``SelectionConfig.profile`` name to its value.

Adding a host profile (vLLM-Omni, say) is one more value in one module:

1. its origins as :class:`OriginRow` rows, in the host's order;
2. its fallback rows as :class:`Guard` rows (``request_failure``) over
   :class:`GuardFacts`; with ``states_fallback`` the origin record names the
   row that applies;
3. ``candidates`` (the candidates of each candidate stage, ``None`` for "the
   platform's own pick") and ``evaluate`` (one candidate's checks, as
   ``(check, failures)`` pairs on the backend that would serve);
4. ``reject`` (the message and code of a rejection) and, if it reads host
   facts (:class:`~attnres.platform.HostResolution`), ``host_facts``: how to
   supply them, which its rejection names;
5. its name in ``attnres.layer.PROFILES`` and the value in
   ``attnres.machine.PROFILES``; ``scripts/gen_state_diagram.py`` renders it.

A host profile close to SGLang's is ``attrs.evolve(SGLANG, name=..., origins=...,
request_failure=..., aliases=..., satisfies=..., source=..., host_facts=...)``:
its ``evaluate`` and ``reject`` read the profile they are given (its
``satisfies``, its ``host_facts``), and a missing host fact fails with
:data:`UNOBSERVED` whatever the host.

The stages, events and transitions are the core's (``attnres.machine.TRANSITIONS``):
a profile chooses which fire, never new ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Final, Protocol

import attrs
from attrs import frozen

from attnres._states import Check, Event, Origin, Reason, State
from attnres.backends import Backend
from attnres.layer import LayerSpec, SelectionConfig
from attnres.records import Failure, TraceInput
from attnres.scope import ScopeState

__all__ = [
    "REQUEST_START",
    "UNOBSERVED",
    "Asked",
    "Evaluation",
    "Given",
    "Guard",
    "GuardFacts",
    "OriginRow",
    "Profile",
    "ReasonRow",
    "Results",
    "Tried",
    "first_event",
    "first_guard",
    "host_facts",
    "requested_by",
]


@frozen
class Given:
    """What the engine hands a profile's rules for one resolution: the input and
    the facts it computed from it, once (a rule reads them, never recomputes them).
    """

    inp: TraceInput
    #: issue 32 item 6: why no backend of the layer's ``preferred`` set can run
    #: here, one clause each; ``""`` when one can, when the layer declares none,
    #: or when the profile narrows no stage by it (``Profile.preferred_stages``)
    preferred_unusable: str = ""


class Asked(Protocol):
    """What the origin rows read: a :class:`~attnres.trace.TraceInput`, or a
    host plugin's request before the platform is observed."""

    @property
    def layer(self) -> LayerSpec: ...
    @property
    def config(self) -> SelectionConfig: ...
    @property
    def scope(self) -> ScopeState | None: ...
    @property
    def backend(self) -> Backend | None: ...
    @property
    def request(self) -> Backend | None: ...


@frozen
class OriginRow:
    """One way a backend is requested: ``backend`` reads it from the input (``None``:
    this origin does not apply); ``words`` say so in the docs and, without
    ``detail``, in the origin record."""

    origin: Origin
    words: str
    #: the request is explicit (the operator or the code named it); explicit
    #: requests are strict unless a fallback row relaxes them
    explicit: bool
    #: (``operator.attrgetter`` for a plain field: the machine reads every row
    #: of an input that requests nothing)
    backend: Callable[[Asked], Backend | None]
    #: the origin record's words for this input and the backend the row read
    #: (default: ``words``)
    detail: Callable[[Asked, Backend], str] | None = None


@frozen
class GuardFacts:
    """What the guards may look at."""

    #: something was requested (any origin but ``none``)
    requested: bool = False
    #: the layer declares no default and supports exactly one backend
    single_supported: bool = False
    #: the request is a sparse backend and the layer cross-attention (its role
    #: check fails)
    role_failed: bool = False
    #: the request is strict (SPEC 3.1, 3.2): explicit, and not the operator's
    #: global backend relaxed for this layer
    strict: bool = False
    #: the request is the operator's explicit global backend (the flag or the
    #: environment variable: ``attnres.machine.GLOBAL_EXPLICIT_ORIGINS``)
    global_explicit: bool = False
    #: the request's origin row is explicit
    explicit: bool = False
    #: the layer declares a default, or its component allows global fallback
    relaxed: bool = False
    #: issue 30: the layer's route runs exactly ``eager``, the site's own code,
    #: which computes softmax attention by hand (``attnres.machine.written_by_hand``)
    by_hand: bool = False


@frozen
class Guard:
    """One row: when ``condition`` (its words, for the docs) holds, ``event`` fires."""

    condition: str
    holds: Callable[[GuardFacts], bool]
    event: Event


def first_guard(guards: tuple[Guard, ...], facts: GuardFacts) -> Guard:
    """The first guard that holds (the last guard always holds)."""
    for guard in guards:
        if guard.holds(facts):
            return guard
    raise AssertionError("no guard holds: a guard table must end with 'otherwise'")


def first_event(guards: tuple[Guard, ...], facts: GuardFacts) -> Event:
    """The event of the first guard that holds (the last guard always holds)."""
    return first_guard(guards, facts).event


#: Leaving ``origin_detection`` where nothing else decides: a request is evaluated
#: first, else the candidate stages run (``Profile.start``'s default).
REQUEST_START: Final = (
    Guard("something was requested", lambda f: f.requested, Event.REQUEST_FOUND),
    Guard("otherwise", lambda f: True, Event.NOTHING_REQUESTED),
)


#: One candidate's checks: ``(check, failures)`` pairs; a check passed when its
#: failures are empty.
Results = tuple[tuple[Check, tuple[Failure, ...]], ...]


#: One candidate evaluated: (the backend the checks name -- the one that would
#: serve: a host may serve a candidate by another backend; ``None``: no check was
#: recorded -- and the checks' results).
Evaluation = tuple[Backend | None, Results]


#: A failed candidate: (stage, the backend its checks name, their results).
Tried = tuple[State, Backend | None, Results]


@frozen
class ReasonRow:
    """A reason a selection records when no transition set one: ``reason`` of
    (input, origin, selected backend), ``None`` when the row does not apply."""

    condition: str
    reason: Callable[[TraceInput, Origin, Backend], Reason | None]


@frozen(kw_only=True)
class Profile:
    """The rules of one selection profile (see the module docstring)."""

    name: str
    #: the origins in order: the first row whose backend is set wins
    origins: tuple[OriginRow, ...]
    #: the origin record's words when no row is set
    nothing_requested: str
    #: names folded into another before anything is evaluated
    aliases: Mapping[str, str] = attrs.field(factory=dict)
    #: leaving ``origin_detection``: the first row that holds fires
    start: tuple[Guard, ...] = REQUEST_START
    #: a failed request: the first row that holds picks the event, and so the
    #: reason (``attnres.machine.TRANSITIONS``); ``strict_failure``: rejected
    request_failure: tuple[Guard, ...]
    #: the origin record names the fallback row that applies (its words appended,
    #: strict when it rejects); otherwise it records the origin's own strictness
    states_fallback: bool
    #: whether a backend is sparse (read by the fallback rows)
    sparse: Callable[[TraceInput, Backend], bool]
    #: the candidates of a stage, in order (``None``: the platform's own pick);
    #: one already evaluated is not evaluated again
    candidates: Callable[[State, Given, Backend | None], Sequence[Backend | None]]
    #: a candidate passed over (recorded as a ``skip``) when a row gives words:
    #: (the stages it reads, (position, the stage's candidates, input) -> why, or "")
    skips: tuple[
        tuple[frozenset[State], Callable[[int, Sequence[Backend | None], Given], str]],
        ...,
    ] = ()
    #: a candidate already evaluated at an earlier stage is recorded as a skip
    records_repeats: bool = False
    #: one candidate's checks (given the profile, for its data); the flag says the
    #: layer's declared set is bypassed
    evaluate: Callable[[Profile, Backend | None, TraceInput, bool], Evaluation]
    #: the first candidate of an explicit origin bypasses the layer's declared set
    explicit_bypasses_supported: bool = False
    #: reasons a selection records when its transitions set none (first that applies)
    selected_reasons: tuple[ReasonRow, ...] = ()
    #: a rejection's message and code from the failed candidates (given the
    #: profile); the flag says a strict request was refused (otherwise the
    #: candidates ran out)
    reject: Callable[[Profile, TraceInput, Sequence[Tried], bool], tuple[str, str]]
    #: how to supply the host facts this profile decides from (``None``: it reads
    #: none); its rejection for a missing fact names this
    host_facts: str | None = None
    #: what the rules were read from (the docs say so)
    source: str = "attnres's selection contract (SPEC 3)"
    #: backends a layer's declared set admits through other names, any one group
    #: (attnres's own: ``BackendSpec.satisfies`` in the catalogue)
    satisfies: Mapping[str, tuple[frozenset[str], ...]] = attrs.field(factory=dict)
    #: words appended to the origin record, from the whole input (``None``: none)
    origin_note: Callable[[Given], str] | None = None
    #: issue 23: the stages whose automatic choices a layer's ``preferred`` set
    #: narrows; with any, the engine computes once per resolution whether that set
    #: can run here (``Given.preferred_unusable``)
    preferred_stages: frozenset[State] = frozenset()


#: The failure of a candidate whose host resolution the input does not hold (a
#: host profile's plugin observes it and runs the machine again; a replayed
#: trace holds every fact its decision consulted, so it never meets this).
UNOBSERVED: Final = "not resolved by the host platform"


def host_facts(profile: str, host: str, doc: str) -> str:
    """How a host profile's facts are supplied (``Profile.host_facts``): its plugin
    (``attnres.integrations.<profile>``) observes and records them."""
    return (
        f"the {profile} profile decides from {host}'s own platform answers, one "
        "attnres.platform.HostResolution per candidate in Platform(host=...); run the model "
        f"with the {host} plugin installed (attnres.integrations.{profile}, {doc}), "
        "which observes and records them, or pass a platform that holds them"
    )


def requested_by(profile: Profile, asked: Asked) -> tuple[OriginRow | None, Backend | None]:
    """The first origin row of ``profile`` that is set, and the backend it
    requests (the profile's aliases folded); ``(None, None)``: nothing requested."""
    for row in profile.origins:
        requested = row.backend(asked)
        if requested is not None:
            alias = profile.aliases.get(requested.name)
            return row, (requested if alias is None else Backend(alias))
    return None, None
