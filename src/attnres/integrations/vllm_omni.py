"""attnres as vLLM-Omni's diffusion attention selector (issue 36).

Install with ``pip install attnres[vllm-omni]``; vLLM-Omni finds the plugin
through the entry point ``attnres = attnres.integrations.vllm_omni:plugin`` in
the group ``vllm_omni.general_plugins`` and calls :func:`plugin` in every
process before the model is built (``load_omni_general_plugins``; its
``VLLM_PLUGINS`` allow-list applies). ``import attnres`` never imports this
module, nor vLLM-Omni.

What is routed (docs/vllm-omni.md): every call of vLLM-Omni's
``get_attn_backend_for_role(role, head_size, attention_config, role_category,
allow_trtllm_default)``, which is how its ``Attention`` layers
(``vllm_omni/diffusion/attention/layer.py``, which binds it by name) reach a
backend. The call is translated into attnres's types and decided under the
``vllm_omni`` profile (:mod:`attnres._profile_vllm_omni`); vLLM-Omni's platform
is observed through its own ``_cached_get_backend_cls`` and recorded as
:class:`~attnres.platform.HostResolution` facts. The answer is vLLM-Omni's
``(backend class, AttentionSpec or None)``, it logs what vLLM-Omni logs, and
the decision is in :func:`attnres.decisions` with a trace that replays without
vLLM-Omni.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import importlib
import types
from collections.abc import Callable
from typing import Any, Final

from attrs import frozen

from attnres._memo import GenerationMemo
from attnres._profile_vllm_omni import OPTIONS, SOURCES
from attnres._states import KernelSource, Origin, Status
from attnres._vocab import DTYPES, PLATFORM_KINDS, Role
from attnres.backends import (
    BUILTIN_SPECS,
    Backend,
    BackendOptions,
    BackendSpec,
    HeadSizeRule,
    OptionValue,
    get_spec,
    normalize_backend_options,
    registry_generation,
    unregister_backend,
)
from attnres.errors import InvalidArgumentError
from attnres.integrations import _engine
from attnres.kernels import get_kernel, kernel_source
from attnres.layer import LayerSpec, SelectionConfig
from attnres.ledger import _REMOVALS, Decision, record_decision
from attnres.platform import HostResolution
from attnres.scope import ScopeState

__all__ = [
    "ENGINE",
    "TARGET",
    "custom_backend",
    "install",
    "installed",
    "plugin",
    "register_backends",
    "seen_backends",
    "spec_options",
    "stats",
    "uninstall",
    "vllm_omni_backend",
]

_SELECTOR: Final = "vllm_omni.diffusion.attention.selector"
_REGISTRY: Final = "vllm_omni.diffusion.attention.backends.registry"
#: the function attnres takes over
TARGET: Final = f"{_SELECTOR}.get_attn_backend_for_role"

#: What the plugin reads of vLLM-Omni, by module.
_HOOKS: Final = {
    _SELECTOR: ("get_attn_backend_for_role", "_cached_get_backend_cls", "_log_backend_resolution"),
    "vllm_omni.diffusion.data": ("AttentionConfig.resolve_with_source", "AttentionSpec"),
    _REGISTRY: ("DiffusionAttentionBackendEnum",),
    "vllm_omni.diffusion.attention.backends.abstract": (
        "AttentionBackend.get_name",
        "AttentionBackend.supports_head_size",
        "AttentionBackend.get_supported_head_sizes",
    ),
}
#: The vLLM-Omni releases the plugin was written for (``vllm-omni>=0.30.0,<0.31``).
ENGINE: Final = _engine.Engine("vLLM-Omni", "vllm-omni", (0, 30, 0), (0, 31), _HOOKS)

_PROFILE: Final = SelectionConfig(profile="vllm_omni")
_MISSING: Final = object()


def _wrap(modules: dict[str, types.ModuleType], original: Callable[..., Any]) -> Callable[..., Any]:
    enum = modules[_REGISTRY].DiffusionAttentionBackendEnum
    register_backends(enum)
    _MEMBERS.update(b.name for b in map(_attnres, (m.name for m in enum)) if b is not None)
    return _selector_for(modules[_SELECTOR], original)


def _forget_seen() -> None:
    """Remove the backends the plugin registered on first sight (:func:`seen_backends`)."""
    for name in list(_SEEN):
        with contextlib.suppress(Exception):
            unregister_backend(name)
        del _SEEN[name]


#: vLLM-Omni's selector, as the plugin takes it over, and the plugin's calls and
#: memo of decided calls
_TAKEOVER: Final = _engine.Takeover(
    ENGINE, _SELECTOR, "get_attn_backend_for_role", __name__, _wrap, _forget_seen
)
#: Route vLLM-Omni's ``get_attn_backend_for_role`` through attnres now; also
#: vLLM-Omni's general plugin (idempotent: vLLM-Omni may call it in several
#: processes, and more than once)
install: Final = _TAKEOVER.install
plugin: Final = _TAKEOVER.install
#: Whether vLLM-Omni's selector currently routes through attnres
installed: Final = _TAKEOVER.installed
#: Restore vLLM-Omni's own selector in every module that bound it, and remove
#: the backends the plugin registered on first sight (:func:`seen_backends`)
uninstall: Final = _TAKEOVER.uninstall
#: ``decided``: calls attnres decided (each one is in :func:`attnres.decisions`);
#: ``delegated``: calls vLLM-Omni answered itself (a call attnres cannot take:
#: a head size that is no positive int, a backend name that is no name)
stats: Final = _TAKEOVER.stats
clear_memo: Final = _TAKEOVER.clear_memo


# -- backends ------------------------------------------------------------------

#: vLLM-Omni's sparse members (video sparse attention and RainFusion sparse
#: attention; vLLM-Omni's enum states no ``is_sparse``)
_SPARSE: Final = frozenset({"fastvideo_vsa", "rainfusion_attn"})
#: vLLM-Omni's platform names as attnres's platform kinds
_KINDS: Final = {"cuda": "cuda", "rocm": "rocm", "npu": "npu", "xpu": "xpu", "musa": "cuda"}


def register_backends(enum: Any) -> tuple[str, ...]:
    """Register every ``DiffusionAttentionBackendEnum`` member attnres lacks, with
    the facts its vLLM-Omni class states (``get_supported_head_sizes()``,
    ``supported_platforms``); a class that cannot be imported here leaves them
    open, with why. Returns the names registered."""
    out: list[str] = []
    for member in enum:
        name = member.name.lower()
        if not _engine.lacks(name):
            continue
        head_sizes = HeadSizeRule()
        platforms: tuple[str, ...] = PLATFORM_KINDS
        try:
            cls = member.get_class()
            head_sizes = _head_sizes(cls)
            stated = getattr(cls, "supported_platforms", None)
            if stated:
                platforms = tuple(sorted({_KINDS.get(str(p), str(p)) for p in stated}))
                platforms = tuple(p for p in platforms if p in PLATFORM_KINDS) or PLATFORM_KINDS
            source = f"{cls.__module__}.{cls.__qualname__}"
        except Exception as exc:  # a kernel package this host lacks, typically
            source = f"{member.value} (not importable here: {_engine.why(exc)})"
        if _engine.register_lacking(
            BackendSpec(
                name=name,
                sparse=name in _SPARSE,
                platforms=platforms,
                dtypes=DTYPES,
                head_sizes=head_sizes,
                options=OPTIONS.get(member.name, ()),
                description=(
                    f"vLLM-Omni diffusion backend (vllm_omni plugin), read from {source}; "
                    "dtypes and requirements left open (its classes do not state them; "
                    "the vllm_omni profile reads vLLM-Omni's platform at each decision)"
                ),
            )
        ):
            out.append(name)
    return tuple(out)


def _head_sizes(cls: Any) -> HeadSizeRule:
    """The head sizes a vLLM-Omni class states (``get_supported_head_sizes()``; none: any)."""
    sizes = tuple(int(s) for s in cls.get_supported_head_sizes())
    return HeadSizeRule(allowed=sizes) if sizes else HeadSizeRule()


#: attnres's backend per vLLM-Omni name (``None``: none); one registry generation
_PARSED: GenerationMemo[str, Backend | None] = GenerationMemo(maxsize=1024)


def _attnres(name: str) -> Backend | None:
    """attnres's backend for one of vLLM-Omni's names (``None``: none)."""
    backend = _PARSED.get(name, _MISSING)  # type: ignore[arg-type]
    if backend is _MISSING:
        generation = registry_generation()
        try:
            backend = Backend.parse(name.lower())
        except (ValueError, AttributeError):  # UnknownBackendError is a ValueError
            backend = None
        _PARSED.put(name, backend, generation)  # hashable: get() hashed it
    return backend


# -- backends first seen at a decision (issue 36) ---------------------------------

#: backends registered because a decision met them (name -> what they were read
#: from); :func:`uninstall` removes them again
_SEEN: dict[str, str] = {}


def seen_backends() -> dict[str, str]:
    """The backends the plugin registered on first sight, with what each was read
    from: a name an ``AttentionConfig`` gives, or a class vLLM-Omni's platform
    served, that attnres had no backend for (a platform plugin's own backend, a
    test's fake). Each is then an ordinary attnres backend, so the decision that
    met it is recorded and its trace replays while it stays registered."""
    return dict(_SEEN)


def _first_sight(name: str, cls: Any = None) -> Backend | None:
    """attnres's backend for vLLM-Omni's ``name``, registered now if attnres has
    none: with the facts ``cls`` (the class vLLM-Omni's platform serves for it)
    states; ``cls=None``: a name no class was asked for (its facts open, no
    platform of attnres's own selection runs it). ``None``: a name attnres cannot
    take as a backend name."""
    known = _attnres(name)
    if known is not None:
        return known
    canonical = name.strip().lower()
    platforms: tuple[str, ...] = ()
    head_sizes = HeadSizeRule()
    if cls is None:
        source = "a name vLLM-Omni's AttentionConfig gives; no class was asked for it"
    else:
        source = f"the class vLLM-Omni's platform serves for it, {_qualname(cls)}"
        with contextlib.suppress(Exception):  # a class that states nothing leaves it open
            head_sizes = _head_sizes(cls)
        kind = _PLATFORM()[0]
        platforms = (kind,) if kind != "cpu" else ()
    try:
        with _TAKEOVER.lock:
            if _engine.register_lacking(
                BackendSpec(
                    name=canonical,
                    sparse=False,
                    platforms=platforms,
                    dtypes=DTYPES,
                    head_sizes=head_sizes,
                    description=(
                        "first seen by the vllm_omni plugin at a decision, read from "
                        f"{source}; attnres runs no kernel for it (vLLM-Omni's class does)"
                    ),
                )
            ):
                _SEEN[canonical] = source
    except (ValueError, TypeError):
        return None
    return _attnres(canonical)


def _qualname(cls: Any) -> str:
    return f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"


# -- attnres's own backends inside vLLM-Omni (issue 36) ---------------------------

#: the vLLM-Omni backend class built for each custom attnres backend
_BRIDGES: dict[str, Any] = {}
#: attnres's names of vLLM-Omni's enum members (read at install)
_MEMBERS: set[str] = set()
_BUILTIN: Final = frozenset(spec.name for spec in BUILTIN_SPECS)


def custom_backend(name: str) -> Backend | None:
    """The attnres backend ``name`` (as vLLM-Omni's config spells it) when it is one
    vLLM-Omni cannot select itself: registered through attnres's plugin registry
    (:func:`attnres.register_backend` or the ``attnres.backends`` entry-point
    group, not one of attnres's built-ins), not a member of vLLM-Omni's
    ``DiffusionAttentionBackendEnum``, not a name the plugin registered on first
    sight, and with an attnres kernel (:mod:`attnres.kernels`). ``None``
    otherwise."""
    backend = _attnres(name)
    if backend is None or any(backend.name in known for known in (_BUILTIN, _MEMBERS, _SEEN)):
        return None
    return None if kernel_source(backend.name) is KernelSource.NONE else backend


def vllm_omni_backend(backend: Backend) -> Any:
    """A vLLM-Omni ``AttentionBackend`` class that runs attnres's kernel for
    ``backend`` (built once per backend): vLLM-Omni's enum cannot take a new
    member (vllm-omni RFC #3715), so the plugin answers a configured custom name
    with this class. Its impl calls the kernel with attnres's calling convention
    (``q, k, v`` as ``(batch, seq, heads, head_size)``, vLLM-Omni's layout too;
    the mask from ``attn_metadata.attn_mask``), on every platform vLLM-Omni
    dispatches to; the head sizes it states are the backend spec's."""
    cls = _BRIDGES.get(backend.name)
    if cls is not None:
        return cls
    abstract = importlib.import_module("vllm_omni.diffusion.attention.backends.abstract")
    spec = get_spec(backend)
    name = backend.name

    class AttnresImpl(abstract.AttentionImpl):  # type: ignore[misc, name-defined]
        def __init__(
            self,
            num_heads: int,
            head_size: int,
            softmax_scale: float,
            causal: bool = False,
            num_kv_heads: int | None = None,
            prefix: str = "",
            qkv_layout: str | None = None,
            backend_kwargs: dict[str, Any] | None = None,
            **extra_impl_args: Any,
        ) -> None:
            self.num_heads, self.head_size = num_heads, head_size
            self.softmax_scale, self.causal = softmax_scale, causal
            self.kernel: Any = get_kernel(name)

        def _run(self, query: Any, key: Any, value: Any, attn_metadata: Any = None) -> Any:
            mask = None if attn_metadata is None else getattr(attn_metadata, "attn_mask", None)
            return self.kernel(query, key, value, mask, self.causal, self.softmax_scale)

        forward_cuda = forward_hip = forward_npu = forward_xpu = forward_musa = _run

    allowed = spec.head_sizes.allowed

    class AttnresBackend(abstract.AttentionBackend):  # type: ignore[misc, name-defined]
        @staticmethod
        def get_name() -> str:
            return name.upper()

        @staticmethod
        def get_impl_cls() -> Any:
            return AttnresImpl

        @staticmethod
        def get_supported_head_sizes() -> list[int]:
            return sorted(allowed or ())

        @classmethod
        def supports_head_size(cls, head_size: int) -> bool:
            return not spec.head_sizes.failures(head_size)

    for made in (AttnresImpl, AttnresBackend):
        made.__qualname__ = made.__name__ = f"{made.__name__}[{name}]"
    _BRIDGES[name] = AttnresBackend
    return AttnresBackend


# -- the decision ----------------------------------------------------------------


@frozen
class _Hit:
    """One decided call, answered again without deciding: the decision, vLLM-Omni's
    answer, and the platform calls it consulted (asked again on every hit, as
    vLLM-Omni asks its own cache: a platform that now answers otherwise is
    decided anew)."""

    decision: Decision
    answer: tuple[Any, Any]
    #: ``selector._cached_get_backend_cls`` when it was decided (a test swaps it)
    resolver: Any
    #: the first platform call and its class (``None``: vLLM-Omni was not asked,
    #: :func:`custom_backend`), and any further calls (a replacement)
    args: tuple[Any, ...] | None
    cls: Any
    more: tuple[tuple[tuple[Any, ...], Any], ...]
    #: vLLM-Omni's log call (its own cache logs once per argument set)
    log: dict[str, Any]
    #: the AttentionConfig entry picked (held: its id is in the key, and no other
    #: object takes that id while it lives) and its backend string then
    spec: Any
    backend: Any
    #: the ledger's removal count when recorded: a repeated call adds no entry
    #: while the ledger still holds it
    removals: int


def _selector_for(selector: types.ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM-Omni's ``get_attn_backend_for_role``, decided by attnres: its own
    signature, so a repeated call costs a key, a dict lookup and vLLM-Omni's own
    cache calls (``make bench-vllm-omni``)."""
    # decided calls by (role, role_category, head_size, allow_trtllm_default, the
    # id of the AttentionConfig entry picked: the profile has no fallback between
    # entries)
    memo = _TAKEOVER.memo
    registry = GenerationMemo._registry
    removals = _REMOVALS

    def get_attn_backend_for_role(
        role: Any,
        head_size: Any,
        attention_config: Any = None,
        role_category: Any = None,
        allow_trtllm_default: bool = True,
    ) -> Any:
        # the entry vLLM-Omni's resolve_with_source answers with, found as it does
        spec = None
        try:
            if attention_config is not None:
                per_role = attention_config.per_role
                spec = per_role.get(role)
                if spec is None:
                    if role_category is not None:
                        spec = per_role.get(role_category)
                    if spec is None:
                        spec = attention_config.default
            key: tuple[Any, ...] = (role, role_category, head_size, allow_trtllm_default, id(spec))
            # GenerationMemo.get, inlined (the hit path's one compare): entries of
            # an older registry generation are never read
            hit = memo._data.get(key) if memo._generation == registry.generation else None
        except (TypeError, AttributeError):  # not vLLM-Omni's types: no memo
            hit, key = None, ()
        if (
            hit is not None
            and hit.resolver is selector._cached_get_backend_cls
            and (spec is None or spec.backend is hit.backend)
            and (hit.args is None or hit.resolver(*hit.args) is hit.cls)
            and (not hit.more or all(hit.resolver(*a) is c for a, c in hit.more))
            and hit.removals == removals[0]  # the ledger still holds its decision
        ):
            selector._log_backend_resolution(**hit.log)
            return hit.answer
        call = (role, head_size, attention_config, role_category, allow_trtllm_default)
        return _decide(selector, original, key, call)

    get_attn_backend_for_role.__doc__ = original.__doc__
    return get_attn_backend_for_role


@functools.lru_cache(maxsize=256)
def _config(default: Backend | None) -> SelectionConfig:
    """The SelectionConfig of an ``attention_config.default`` backend."""
    if default is None:
        return _PROFILE
    return SelectionConfig(global_backend=default, profile="vllm_omni")


@functools.lru_cache(maxsize=4096)
def _layer(head_size: int, role: str, cross: bool, options: BackendOptions = ()) -> LayerSpec:
    kind = Role.CROSS if cross else Role.SELF
    return LayerSpec(
        head_size=head_size, dtype="bfloat16", role=kind, name=role, backend_options=options
    )


@functools.lru_cache(maxsize=4096)
def _fits(cls: Any, head_size: int) -> bool:
    """The class's own ``supports_head_size`` (some build a list of every size on
    each call: asked once per class and size)."""
    supports = getattr(cls, "supports_head_size", None)
    return supports is None or bool(supports(head_size))


def _decide(
    selector: types.ModuleType,
    original: Callable[..., Any],
    key: tuple[Any, ...],
    call: tuple[Any, Any, Any, Any, bool],
) -> Any:
    """The cold path: translate, observe vLLM-Omni's platform, decide, memoize.
    ``call``: the selector's arguments, in its order."""
    role, head_size, attention_config, role_category, allow_trtllm_default = call
    entries: tuple[Any, Any, Any] = (None, None, None)
    try:
        if attention_config is not None:
            per_role = attention_config.per_role
            entries = (
                per_role.get(role),
                None if role_category is None else per_role.get(role_category),
                attention_config.default,
            )
        names = tuple(None if s is None else str(s.backend) for s in entries)
        layer = _layer(int(head_size), str(role), "cross" in (role, role_category))
    except (AttributeError, TypeError, ValueError):  # not a layer attnres can take
        _TAKEOVER.counts["delegated"] += 1
        return original(*call)
    resolver = selector._cached_get_backend_cls
    win = next((i for i, n in enumerate(names) if n is not None), None)
    asked: list[tuple[tuple[Any, ...], Any]] = []

    def ask(args: tuple[Any, ...]) -> tuple[Any, Exception | None]:
        try:
            cls = resolver(*args)
        except Exception as exc:
            return None, exc
        asked.append((args, cls))
        return cls, None

    # vLLM-Omni asks its platform for the winning entry (or its default) first:
    # asked before anything is registered, as vLLM-Omni would
    custom = None if win is None else custom_backend(str(names[win]))
    if custom is not None:  # attnres's own backend: attnres answers, vLLM-Omni is not asked
        first_cls, refused = vllm_omni_backend(custom), None
    else:
        first_cls, refused = ask(
            (None, head_size, allow_trtllm_default) if win is None else (names[win], head_size)
        )
    backends = [
        None if name is None else _first_sight(name, first_cls if i == win else None)
        for i, name in enumerate(names)
    ]
    if any(b is None and n is not None for b, n in zip(backends, names, strict=True)):
        # a name attnres cannot take as a backend name: vLLM-Omni answers
        _TAKEOVER.counts["delegated"] += 1
        return original(*call)
    first = "" if win is None else backends[win].name  # type: ignore[union-attr]
    if win is not None:
        # the winning entry's typed options, as attnres backend options: checked by
        # attnres's option checks (a BackendOptionError names the one it refuses)
        # and recorded in the decision's trace
        options = spec_options(entries[win])
        if options:
            checked = normalize_backend_options({first: options})
            layer = _layer(layer.head_size, str(role), layer.role is Role.CROSS, checked)
    platform = _PLATFORM()
    kind = platform[0]
    classes: dict[str, Any] = {}
    observed: dict[str, HostResolution] = {}
    size = layer.head_size

    def note(candidate: str, cls: Any, error: Exception | None = None) -> None:
        # what vLLM-Omni's platform served for the candidate (a class attnres has
        # no backend for is registered on first sight), or why it served none
        served = None
        if error is None and cls is not None:
            try:
                served = _first_sight(str(cls.get_name()), cls)
            except Exception as exc:  # a class without get_name(): no backend to name
                error = exc
        if error is not None:
            observed[candidate] = HostResolution(candidate, None, _engine.why(error))
        elif served is not None:
            classes[served.name] = cls
            missing = () if _fits(cls, size) else (f"head size {size} (its supports_head_size)",)
            observed[candidate] = HostResolution(candidate, served.name, None, missing=missing)
        elif cls is not None:
            observed[candidate] = HostResolution(candidate, None, f"unnamed class {_qualname(cls)}")

    runs = () if custom is None else get_spec(custom).platforms
    if custom is not None and kind not in runs:
        on = ", ".join(sorted(runs)) or "no platform"
        refused = InvalidArgumentError(f"attnres backend {first} runs on {on}, not {kind}")
        observed[first] = HostResolution(first, None, str(refused))
    else:
        note(first, first_cls, refused)
    spelled = {b.name: n for b, n in zip(backends, names, strict=True) if b is not None}
    scope = None
    if backends[1] is not None:
        scope = ScopeState(
            component=str(role_category),
            kind="vllm_omni",
            loader="attention_config.per_role",
            backend=backends[1],
        )

    def observe(pending: str) -> None:
        nonlocal refused
        # vLLM-Omni passes a configured name as the config spells it
        cls, error = ask((spelled.get(pending, pending.upper()), head_size))
        if pending == first and error is not None:  # a first answer asked again
            refused = error
        note(pending, cls, error)

    decision, generation = _engine.decide(
        layer, _config(backends[2]), scope, backends[0], platform, observed, observe
    )
    removals = _REMOVALS[0]
    _TAKEOVER.counts["decided"] += 1
    record_decision(decision)
    outcome = decision.outcome
    if outcome.status is not Status.SELECTED or outcome.backend is None:
        if refused is not None:
            raise refused  # vLLM-Omni's own refusal, unchanged
        raise InvalidArgumentError(f"{outcome.error}")
    cls = classes[outcome.backend.name]
    index = _INDEX.get(outcome.origin)
    spec = None if index is None else entries[index]
    source = SOURCES[outcome.origin].format(role=repr(role), category=repr(role_category))
    log = {
        "role": role,
        "role_category": role_category,
        "backend_name": cls.get_name(),
        "source": source,
    }
    answer = (cls, spec)
    if key and (asked or custom is not None):
        args, asked_cls = asked[0] if asked else (None, None)
        backend = None if spec is None else spec.backend
        hit = _Hit(
            decision,
            answer,
            resolver,
            args,
            asked_cls,
            tuple(asked[1:]),
            log,
            spec,
            backend,
            removals,
        )
        _TAKEOVER.memo.put(key, hit, generation)
    selector._log_backend_resolution(**log)
    return answer


def spec_options(spec: Any) -> dict[str, OptionValue]:
    """vLLM-Omni's ``AttentionSpec`` options as attnres backend options of its
    backend (:data:`attnres._profile_vllm_omni.OPTIONS`): each typed field that
    is set, by its dotted name; a list (``block_sparse.skip_layers``) is written
    comma-separated, an enum as its value."""
    out: dict[str, OptionValue] = {}
    for option in OPTIONS.get(str(spec.backend).upper(), ()):
        head, _, tail = option.name.partition(".")
        value = getattr(spec, head, None)
        if tail and value is not None:
            value = getattr(value, tail, None)
        if value is None:
            continue
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, (list, tuple, set, frozenset)):
            value = ",".join(str(v) for v in value)
        out[option.name] = value
    return out


#: the AttentionConfig entry each origin answers with (``None``: the platform default)
_INDEX: Final = {Origin.LAYER: 0, Origin.COMPONENT_OVERRIDE: 1, Origin.GLOBAL_CLI: 2}


#: vLLM-Omni's ``current_omni_platform``: attnres's platform kind, and the
#: compute capability and device name it states
_PLATFORM: Final = _engine.PlatformReader(
    "vllm_omni.platforms", "current_omni_platform", _KINDS, True
)
