"""Component scopes and the loader policies behind them (SPEC 3.2, 3.6): the data.

This module holds what a scope *is*: the component kinds and their loader
policies and the context variable holding the open scopes (the
:class:`ScopeState` snapshot a resolution sees is a record,
:mod:`attnres.records`). Opening one with bookkeeping (the summary line on
exit, the "was the override applied" check) is
:func:`attnres.runtime.component_scope`.

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
from collections.abc import Mapping
from typing import ClassVar

from attnres._vocab import Role, normalize_component
from attnres.backends import Backend
from attnres.errors import ArgumentTypeError, InvalidArgumentError
from attnres.layer import optional_backend
from attnres.ledger import Decision
from attnres.records import ScopeState

__all__ = [
    "BUILTIN_KINDS",
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
    "current_handle",
    "current_scope",
    "enter_scope",
    "exit_scope",
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
        raise InvalidArgumentError(f"{name}: expected True, False or None, got {value!r}")
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
        raise InvalidArgumentError(f"component kind must be lower-case snake_case, got {kind!r}")
    if loader is None:
        policy = (
            True
            if allow_global_fallback is None
            else _flag("allow_global_fallback", allow_global_fallback)
        )
        loader = type(
            f"{kind.title().replace('_', '')}Loader",
            (ComponentLoader,),
            {"kind": kind, "allow_global_fallback": policy},
        )
    elif not (isinstance(loader, type) and issubclass(loader, ComponentLoader)):
        raise ArgumentTypeError(f"loader must be a ComponentLoader subclass, got {loader!r}")
    with _KINDS_LOCK:
        _LOADERS[kind] = loader
        for alias in (kind, *aliases):
            _NAME_ALIASES[alias.lower()] = kind
    return loader


#: The built-in component kinds: each loader (its kind and whether the explicit
#: global flag may fall back for it) and the component names that map to it
#: (rendered in docs/state-machine.md). register_component_kind adds more.
BUILTIN_KINDS: tuple[tuple[type[ComponentLoader], tuple[str, ...]], ...] = (
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
)
for _loader, _aliases in BUILTIN_KINDS:
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
            raise InvalidArgumentError(
                f"unknown component kind {kind!r}; registered kinds: {', '.join(sorted(_LOADERS))}"
                " (add one with attnres.register_component_kind)"
            ) from None


def _role_backends(
    value: Mapping[Role | str, Backend | str] | None,
) -> tuple[tuple[Role, Backend], ...]:
    if not value:
        return ()
    if not isinstance(value, Mapping):
        raise InvalidArgumentError(
            f"role_backends: expected a mapping role -> backend, got {value!r}"
        )
    out: dict[Role, Backend] = {}
    for role, backend in value.items():
        parsed_role = Role.parse(role)
        parsed = optional_backend(f"role_backends[{parsed_role.value!r}]")(backend)
        if parsed is None:
            raise InvalidArgumentError(
                f"role_backends[{parsed_role.value!r}]: backend must not be None"
            )
        out[parsed_role] = parsed
    return tuple(sorted(out.items(), key=lambda kv: kv[0].value))


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

    def bound(self) -> tuple[bool, bool]:
        """A pending layer of this scope resolved: ``(closed, last)``.

        ``closed``: the scope has exited, so the layer's decision (already in
        ``entries``) must be checked against the scope's overrides now; ``last``:
        no layer is pending any more, so the whole scope is checked too. The
        checks themselves are the runtime's (:func:`attnres.runtime.bind_pending`),
        which raises what they find.
        """
        with _KINDS_LOCK:
            self.pending -= 1
            last = self.pending == 0
        return self.closed, last

    @property
    def decisions(self) -> tuple[Decision, ...]:
        return tuple(d for _, d in self.entries)

    def record(self, role: Role, decision: Decision) -> None:
        """Note that a layer of ``role`` was decided inside this scope."""
        self.entries.append((role, decision))


_SCOPE: contextvars.ContextVar[ScopeHandle | None] = contextvars.ContextVar(
    "attnres_component_scope", default=None
)


def current_scope() -> ScopeState | None:
    """The innermost open scope in this thread / task, if any."""
    handle = _SCOPE.get()
    return None if handle is None else handle.state


def current_handle() -> ScopeHandle | None:
    """The innermost open scope's handle (its state and the layers it recorded)."""
    return _SCOPE.get()


def enter_scope(state: ScopeState) -> tuple[ScopeHandle, contextvars.Token[ScopeHandle | None]]:
    """Open a scope for ``state`` in this thread / task; :func:`exit_scope` closes it."""
    handle = ScopeHandle(state)
    return handle, _SCOPE.set(handle)


def exit_scope(token: contextvars.Token[ScopeHandle | None]) -> None:
    _SCOPE.reset(token)


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
        raise InvalidArgumentError(
            f"component_scope: name must be a non-empty string, got {name!r}"
        )
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
