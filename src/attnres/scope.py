"""Component scopes and the loader policies behind them (SPEC 3.2, 3.6).

A component scope says "the layers built now belong to component X": it
carries X's kind, its loader's global-fallback policy, and any explicit
component or role backend. Scopes live in a ``contextvars.ContextVar``, so
threads and asyncio tasks never see each other's scope, and the innermost open
scope is the one a layer sees.

Loader policies (whether an explicit global ``--attention-backend`` may fall
back for this component):

==========================  =======  ===========================================
loader                      policy   why
==========================  =======  ===========================================
``ComponentLoader`` (base)  allow    auxiliary by default
``TransformerLoader``       strict   the flag is aimed at the main model
``GenericComponentLoader``  strict   an unknown component may be the main model
text/image encoders, VAEs,  allow    auxiliary components
vocoders, connectors,
bridges
==========================  =======  ===========================================
"""

from __future__ import annotations

import contextvars
import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import ClassVar

from attrs import field, frozen

from attnres._vocab import Role, normalize_component
from attnres.backends import Backend
from attnres.errors import BackendNotAppliedError
from attnres.layer import optional_backend
from attnres.ledger import Decision

__all__ = [
    "AudioVAELoader",
    "BridgeLoader",
    "ComponentLoader",
    "ConnectorLoader",
    "GenericComponentLoader",
    "ImageEncoderLoader",
    "ScopeHandle",
    "ScopeState",
    "TextEncoderLoader",
    "TransformerLoader",
    "VAELoader",
    "VocoderLoader",
    "component_kind",
    "component_scope",
    "current_scope",
    "loader_for",
    "register_component_kind",
    "scope_state",
]


class ComponentLoader:
    """The base loader: auxiliary components may fall back from the global flag."""

    kind: ClassVar[str] = "component"
    allow_global_fallback: ClassVar[bool] = True


class TransformerLoader(ComponentLoader):
    """The transformer / DiT loader: the global flag is aimed at it (strict)."""

    kind = "transformer"
    allow_global_fallback = False


class GenericComponentLoader(ComponentLoader):
    """Unknown, out-of-tree components: strict until they opt in."""

    kind = "generic"
    allow_global_fallback = False


class TextEncoderLoader(ComponentLoader):
    kind = "text_encoder"


class ImageEncoderLoader(ComponentLoader):
    kind = "image_encoder"


class VAELoader(ComponentLoader):
    kind = "vae"


class AudioVAELoader(ComponentLoader):
    kind = "audio_vae"


class VocoderLoader(ComponentLoader):
    kind = "vocoder"


class ConnectorLoader(ComponentLoader):
    kind = "connector"


class BridgeLoader(ComponentLoader):
    kind = "bridge"


_KINDS_LOCK = threading.Lock()
_LOADERS: dict[str, type[ComponentLoader]] = {}
_NAME_ALIASES: dict[str, str] = {}


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}: expected True, False or None, got {value!r}")
    return value


def register_component_kind(
    kind: str,
    loader: type[ComponentLoader] | None = None,
    *,
    allow_global_fallback: bool | None = None,
    aliases: tuple[str, ...] = (),
) -> type[ComponentLoader]:
    """Register a component kind (and the component names that map to it).

    Give a ``loader`` class, or just ``allow_global_fallback`` to get one made.
    Returns the loader class registered for the kind.
    """
    if not isinstance(kind, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", kind):
        raise ValueError(f"component kind must be lower-case snake_case, got {kind!r}")
    if loader is None:
        policy = True if allow_global_fallback is None else _flag(
            "allow_global_fallback", allow_global_fallback
        )
        loader = type(
            f"{kind.title().replace('_', '')}Loader",
            (ComponentLoader,),
            {"kind": kind, "allow_global_fallback": policy},
        )
    elif not (isinstance(loader, type) and issubclass(loader, ComponentLoader)):
        raise TypeError(f"loader must be a ComponentLoader subclass, got {loader!r}")
    with _KINDS_LOCK:
        _LOADERS[kind] = loader
        for alias in (kind, *aliases):
            _NAME_ALIASES[alias.lower()] = kind
    return loader


for _loader, _aliases in (
    (ComponentLoader, ()),
    (TransformerLoader, ("dit", "transformer", "unet", "denoiser", "mmdit")),
    (GenericComponentLoader, ()),
    (TextEncoderLoader, ("text_encoder", "text_model")),
    (ImageEncoderLoader, ("image_encoder", "vision_encoder", "vision_model")),
    (VAELoader, ("vae", "video_vae", "image_vae")),
    (AudioVAELoader, ("audio_vae",)),
    (VocoderLoader, ("vocoder",)),
    (ConnectorLoader, ("connector", "connectors")),
    (BridgeLoader, ("bridge",)),
):
    register_component_kind(_loader.kind, _loader, aliases=_aliases)


def component_kind(name: str) -> str:
    """Map a component name to its kind: ``text_encoder_2`` -> ``text_encoder``.

    Exact names first (a trailing ``_<number>`` ignored), then the longest
    registered name the component name ends with (``t5_text_encoder``); anything
    else is ``generic``.
    """
    key = re.sub(r"(_\d+)+$", "", normalize_component(name))
    with _KINDS_LOCK:
        if key in _NAME_ALIASES:
            return _NAME_ALIASES[key]
        best = ""
        for alias in _NAME_ALIASES:
            if key.endswith("_" + alias) and len(alias) > len(best):
                best = alias
        return _NAME_ALIASES[best] if best else GenericComponentLoader.kind


def loader_for(kind: str) -> type[ComponentLoader]:
    with _KINDS_LOCK:
        try:
            return _LOADERS[kind]
        except KeyError:
            raise ValueError(
                f"unknown component kind {kind!r}; registered kinds: {', '.join(sorted(_LOADERS))}"
                " (add one with attnres.register_component_kind)"
            ) from None


def _role_backends(
    value: Mapping[Role | str, Backend | str] | None,
) -> tuple[tuple[Role, Backend], ...]:
    if not value:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError(f"role_backends: expected a mapping role -> backend, got {value!r}")
    out: dict[Role, Backend] = {}
    for role, backend in value.items():
        parsed_role = Role.parse(role)
        parsed = optional_backend(f"role_backends[{parsed_role.value!r}]")(backend)
        if parsed is None:
            raise ValueError(f"role_backends[{parsed_role.value!r}]: backend must not be None")
        out[parsed_role] = parsed
    return tuple(sorted(out.items(), key=lambda kv: kv[0].value))


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


class ScopeHandle:
    """What ``with component_scope(...) as scope`` gives: the state and its layers.

    ``pending`` counts the layers built in the scope that have not resolved yet
    (late binding): they are checked against the scope's overrides when they
    bind, after the scope has exited (``closed``).
    """

    __slots__ = ("closed", "entries", "pending", "state")

    def __init__(self, state: ScopeState) -> None:
        self.state = state
        self.entries: list[tuple[Role, Decision]] = []
        self.pending = 0
        self.closed = False

    def add_pending(self) -> None:
        with _KINDS_LOCK:
            self.pending += 1

    def bound(self, role: Role, decision: Decision | None) -> None:
        """A pending layer of this scope resolved (``decision`` ``None``: it raised).

        Its decision was added to ``entries`` by the resolver. Once the scope has
        exited, the layer is checked against the scope's overrides now, and
        the whole scope once its last pending layer has bound.
        """
        with _KINDS_LOCK:
            self.pending -= 1
            last = self.pending == 0
        if not self.closed:
            return
        problems = [] if decision is None else _unexplained(self.state, [(role, decision)])
        if last:
            problems += _not_applied(self.state, self.entries)
        _raise_problems(problems)

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(d for _, d in self.entries)

    def record(self, role: Role, decision: Decision) -> None:
        self.entries.append((role, decision))


_SCOPE: contextvars.ContextVar[ScopeHandle | None] = contextvars.ContextVar(
    "attnres_component_scope", default=None
)


def current_scope() -> ScopeState | None:
    """The innermost open scope in this thread / task, if any."""
    handle = _SCOPE.get()
    return None if handle is None else handle.state


def current_handle() -> ScopeHandle | None:
    return _SCOPE.get()


def scope_state(
    name: str,
    backend: Backend | str | None = None,
    role_backends: Mapping[Role | str, Backend | str] | None = None,
    allow_global_fallback: bool | None = None,
    require_selection: bool | None = None,
    *,
    kind: str | None = None,
) -> ScopeState:
    """The snapshot ``component_scope(name, ...)`` gives its layers (validated).

    Also how traces and the golden scenarios build a scope without entering it.
    """
    if not isinstance(name, str) or not normalize_component(name):
        raise ValueError(f"component_scope: name must be a non-empty string, got {name!r}")
    name = normalize_component(name)
    resolved_kind = component_kind(name) if kind is None else kind
    loader = loader_for(resolved_kind)
    parsed_backend = optional_backend("backend")(backend)
    roles = _role_backends(role_backends)
    explicit = parsed_backend is not None or bool(roles)
    return ScopeState(
        component=name,
        kind=resolved_kind,
        loader=loader.__name__,
        backend=parsed_backend,
        role_backends=roles,
        allow_global_fallback=(
            loader.allow_global_fallback
            if allow_global_fallback is None
            else _flag("allow_global_fallback", allow_global_fallback)
        ),
        require_selection=(
            explicit if require_selection is None else _flag("require_selection", require_selection)
        ),
    )


@contextmanager
def component_scope(
    name: str,
    backend: Backend | str | None = None,
    role_backends: Mapping[Role | str, Backend | str] | None = None,
    allow_global_fallback: bool | None = None,
    require_selection: bool | None = None,
    *,
    kind: str | None = None,
) -> Iterator[ScopeHandle]:
    """Build the layers of component ``name`` inside this block.

    ``name`` is normalised (``Text-Encoder`` -> ``text_encoder``); ``kind``
    overrides the kind inferred from the name; ``allow_global_fallback``
    overrides the loader's policy. On exit the scope's overrides must explain
    its layers, else :class:`~attnres.errors.BackendNotAppliedError`:

    - with ``require_selection`` (default: on when a component or role backend
      is given), every layer runs the component backend, carries a recorded
      reason, or is governed by a role override; and the component backend ran
      on at least one layer (unless every layer went to a role override);
    - whatever ``require_selection`` says, each role override ran on at least
      one layer of its role.

    Layers still pending (built without a dtype, not yet bound) are checked
    when they bind.
    """
    state = scope_state(
        name, backend, role_backends, allow_global_fallback, require_selection, kind=kind
    )
    handle = ScopeHandle(state)
    token = _SCOPE.set(handle)
    try:
        yield handle
    finally:
        _SCOPE.reset(token)
        handle.closed = True
        from attnres.audit import emit_summary

        emit_summary(state, handle.entries)
    _check_applied(handle)


def _selected(entries: Iterable[tuple[Role, Decision]]) -> list[tuple[Role, Decision]]:
    return [(r, d) for r, d in entries if d.backend is not None]


def _unexplained(state: ScopeState, entries: Iterable[tuple[Role, Decision]]) -> list[str]:
    """Layers that chose another backend than the component override, with no
    recorded reason and no role override (only under ``require_selection``)."""
    if not state.require_selection or state.backend is None:
        return []
    wanted = state.backend.name
    bad = [
        d
        for _, d in _selected(entries)
        if not (d.origin == "component_override" and d.backend == wanted)
        and d.reason is None
        and d.origin != "role_override"
    ]
    if not bad:
        return []
    shown = ", ".join(f"{d.layer or '<unnamed>'} runs {d.backend} (origin {d.origin})"
                      for d in bad[:5])
    more = f", and {len(bad) - 5} more" if len(bad) > 5 else ""
    return [
        f"backend {wanted!r} was requested for component {state.component!r}, but "
        f"{len(bad)} layer(s) chose another backend without a recorded reason ({shown}{more})"
    ]


def _not_applied(state: ScopeState, entries: list[tuple[Role, Decision]]) -> list[str]:
    """Overrides that ran on no layer (all layers bound)."""
    problems: list[str] = []
    if state.require_selection and state.backend is not None:
        wanted = state.backend.name
        selected = _selected(entries)
        ran = any(d.origin == "component_override" and d.backend == wanted for _, d in selected)
        all_roles = bool(selected) and all(d.origin == "role_override" for _, d in selected)
        if not ran and not all_roles:
            if not entries:
                problems.append(
                    f"backend {wanted!r} was requested for component {state.component!r}, but "
                    f"the scope built no attnres attention layer"
                )
            elif any(d.origin == "component_override" and d.backend is None for _, d in entries):
                rejected = [d.layer or "<unnamed>" for _, d in entries
                            if d.origin == "component_override" and d.backend is None]
                problems.append(
                    f"backend {wanted!r} was requested for component {state.component!r}, but "
                    f"it was rejected for {len(rejected)} layer(s) ({', '.join(rejected[:5])}"
                    f"{', ...' if len(rejected) > 5 else ''}) and no layer runs it "
                    f"(each rejection raised a ResolutionError saying why)"
                )
            else:
                origins = sorted({d.origin for _, d in entries})
                reasons = sorted({d.reason for _, d in entries if d.reason})
                why = f"; recorded reasons: {', '.join(reasons)}" if reasons else ""
                problems.append(
                    f"backend {wanted!r} was requested for component {state.component!r}, but "
                    f"it ran on none of its {len(entries)} layer(s) (they were decided by "
                    f"origin {', '.join(origins)}{why})"
                )
    for role, backend in state.role_backends:
        governed = [d for r, d in entries if r is role and d.origin == "role_override"]
        if not governed:
            problems.append(
                f"backend {backend.name!r} was requested for the {role.value}-attention layers "
                f"of component {state.component!r}, but the scope built no "
                f"{role.value}-attention layer that used it"
            )
        elif not any(d.backend == backend.name for d in governed):
            reasons = sorted({d.reason for d in governed if d.reason})
            why = f" (recorded reasons: {', '.join(reasons)})" if reasons else ""
            problems.append(
                f"backend {backend.name!r} was requested for the {role.value}-attention layers "
                f"of component {state.component!r}, but it ran on none of its "
                f"{len(governed)} {role.value}-attention layer(s){why}"
            )
    return problems


def _raise_problems(problems: list[str]) -> None:
    if problems:
        raise BackendNotAppliedError(
            "; ".join(problems)
            + ". Build the component's layers inside the scope with attnres.Attention "
            "(or attnres.resolve), or pass require_selection=False if that is intended "
            "(role overrides are checked regardless)."
        )


def _check_applied(handle: ScopeHandle) -> None:
    state = handle.state
    problems = _unexplained(state, handle.entries)
    if handle.pending == 0:
        problems += _not_applied(state, handle.entries)
    _raise_problems(problems)
