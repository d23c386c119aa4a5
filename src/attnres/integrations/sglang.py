"""attnres as SGLang multimodal_gen's attention selector (issue 23).

Install with ``pip install attnres[sglang]``; SGLang finds the plugin through
the entry point ``attnres = attnres.integrations.sglang:plugin`` in the group
``sglang.multimodal_gen.plugins`` and calls :func:`plugin` in its
``load_plugins()``; ``apply_plugin_hooks()`` then puts the hook in place (SGLang
rebinds every module that imported the selector). ``import attnres`` never
imports this module, nor SGLang.

What is routed (docs/sglang.md): every call of SGLang's
``get_attn_backend(head_size, dtype, supported, selected, requirements,
default, is_cross_attention)``, which is how SGLang's layers, component
loaders (component and role contexts), per-request override and autotune
candidates reach a backend. It is translated into attnres's types (a
:class:`~attnres.LayerSpec`, a ``SelectionConfig(profile="sglang")``, a
:class:`~attnres.scope.ScopeState` for SGLang's component context) and decided
under the ``sglang`` profile (:mod:`attnres._profile_sglang`). SGLang's
platform is observed, not re-implemented: each candidate the decision consults
is resolved by SGLang's own ``_cached_get_attn_backend`` and recorded as a
:class:`~attnres.platform.HostResolution` in the trace. The decision is in
:func:`attnres.decisions`, audited, and its trace replays without SGLang.
SGLang's side effects are kept: the selection is recorded in its component
context (its ``ComponentAttentionBackendNotAppliedError`` checks keep working),
and it logs what SGLang logs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
import sys
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, NamedTuple

from attrs import frozen

from attnres._states import Origin, Reason
from attnres._vocab import DTYPES, PLATFORM_KINDS, Requirement, Role
from attnres.backends import Backend, BackendSpec, HeadSizeRule
from attnres.errors import InvalidArgumentError
from attnres.integrations import _engine
from attnres.layer import LayerSpec, Requirements, SelectionConfig
from attnres.ledger import Decision, record_decision
from attnres.platform import HostResolution
from attnres.scope import ScopeState
from attnres.trace import OriginRecord

__all__ = [
    "ENGINE",
    "TARGET",
    "BackendFacts",
    "backend_facts",
    "install",
    "installed",
    "plugin",
    "read_backend_facts",
    "register_backends",
    "spec_from_facts",
    "stats",
    "uninstall",
]

_SELECTOR: Final = "sglang.multimodal_gen.runtime.layers.attention.selector"
#: the function attnres takes over
TARGET: Final = f"{_SELECTOR}.get_attn_backend"

_PROFILE: Final = SelectionConfig(profile="sglang")
_PLUGINS: Final = "sglang.multimodal_gen.runtime.platforms.plugins"
_BACKEND_BASE: Final = "sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend"
_PLATFORMS: Final = "sglang.multimodal_gen.runtime.platforms"

#: What the plugin reads of SGLang, by module (issue 36: 0.5.21 lacks
#: ``AttentionRole`` and the context's ``backend_by_role``; 0.5.20 has no
#: ``multimodal_gen`` plugin loader).
_HOOKS: Final = {
    _SELECTOR: (
        "get_attn_backend",
        "_cached_get_attn_backend",
        "component_attn_backend_context",
        "forced_attn_backend",
        "get_global_server_args",
        "ServerArgs",
        "AttentionBackendEnum",
        "AttentionRequirements",
        "AttentionRole.SELF",
        "AttentionRole.CROSS",
        "get_component_attn_backend_context",
        "get_global_forced_attn_backend",
        "get_component_attn_backend_name",
        "make_component_role_key",
        "logger",
        "_record_component_attn_backend",
        "ComponentAttnBackendContext.backend",
        "ComponentAttnBackendContext.component_name",
        "ComponentAttnBackendContext.backend_by_role",
        "ComponentAttnBackendContext.allow_global_backend_fallback",
        "ComponentAttnBackendContext.require_backend_selection",
    ),
    _PLUGINS: ("HookRegistry", "HookType.AROUND"),
    _BACKEND_BASE: ("AttentionBackend",),
    _PLATFORMS: ("AttentionBackendEnum", "current_platform"),
}
#: The SGLang releases the plugin was written for (``sglang>=0.5.23,<0.6``).
ENGINE: Final = _engine.Engine("SGLang", "sglang", (0, 5, 23), (0, 6), _HOOKS)


def plugin() -> None:
    """SGLang's entry point: register the hook (SGLang applies it later).

    Raises :class:`~attnres.errors.EngineSupportError` on a SGLang release the
    plugin was not written for (:data:`ENGINE`), before registering anything.
    """
    modules = _engine.require(ENGINE, "attnres.integrations.sglang.plugin()")
    plugins = modules[_PLUGINS]
    _register(modules)
    plugins.HookRegistry.register(TARGET, _route, plugins.HookType.AROUND)


def _wrap(modules: dict[str, types.ModuleType], original: Callable[..., Any]) -> Callable[..., Any]:
    _register(modules)

    def get_attn_backend(*args: Any, **kwargs: Any) -> Any:
        return _route(original, *args, **kwargs)

    return get_attn_backend


def _forget_hook() -> None:
    """Take the plugin's hook out of SGLang's hook registry, if it was registered."""
    plugins = sys.modules.get(_PLUGINS)
    if plugins is None:  # nothing was registered with SGLang's hook registry
        return
    registry = plugins.HookRegistry
    hooks = [h for h in registry._hooks.get(TARGET, []) if h[1] is not _route]
    if hooks:
        registry._hooks[TARGET] = hooks
    else:
        registry._hooks.pop(TARGET, None)
        registry._patched.discard(TARGET)


#: SGLang's selector, as the plugin takes it over (its hook registry's wrapper
#: holds :func:`_route`), and the plugin's calls and memo of decided calls
_TAKEOVER: Final = _engine.Takeover(
    ENGINE, _SELECTOR, "get_attn_backend", __name__, _wrap, _forget_hook, hook="_route"
)
#: Route SGLang's selector through attnres now, without SGLang's plugin loader
install: Final = _TAKEOVER.install
#: Whether SGLang's selector currently routes through attnres
installed: Final = _TAKEOVER.installed
#: Restore SGLang's own selector, however the plugin was put in place
uninstall: Final = _TAKEOVER.uninstall
#: ``decided``: calls attnres decided; ``delegated``: calls it could not
#: translate (a malformed argument), answered by SGLang's own selector
stats: Final = _TAKEOVER.stats
clear_memo: Final = _TAKEOVER.clear_memo
_MEMO: Final = _TAKEOVER.memo
_STATS: Final = _TAKEOVER.counts


def _register(modules: dict[str, types.ModuleType]) -> None:
    enum, base = modules[_PLATFORMS].AttentionBackendEnum, modules[_BACKEND_BASE].AttentionBackend
    register_backends(enum, base)


def register_backends(enum: Any, base: Any) -> tuple[BackendFacts, ...]:
    """Register every member of ``enum`` (SGLang's ``AttentionBackendEnum``) that
    attnres lacks, with the facts of the ``base`` (``AttentionBackend``)
    subclasses in ``base``'s package (:func:`read_backend_facts`); returns the
    facts registered. No platform fact is read from them: the ``sglang``
    profile reads what SGLang's platform resolves at every decision."""
    lacking = [m for m in enum if _engine.lacks(m.name.lower())]
    if not lacking:
        return ()
    classes, failures = _backend_classes(base)
    out: list[BackendFacts] = []
    for member in lacking:
        facts = read_backend_facts(member, classes.get(member, ()), failures)
        if _engine.register_lacking(spec_from_facts(facts)):
            _FACTS[facts.name] = facts
            out.append(facts)
    return tuple(out)


@frozen
class BackendFacts:
    """What SGLang's own classes say about one backend attnres did not know (issue 23).

    Read when the plugin is installed, from every ``AttentionBackend`` subclass
    in SGLang's backends package whose ``get_enum()`` is the member
    (``sglang/multimodal_gen/runtime/layers/attention/backends/attention_backend.py``
    defines the API). ``None`` is a fact no class states; ``unknown`` says why,
    per fact. :func:`spec_from_facts` turns them into a :class:`BackendSpec`.
    """

    name: str
    #: ``AttentionBackendEnum.is_sparse``
    sparse: bool
    #: ``module.Class`` of each class whose ``get_enum()`` is the member
    classes: tuple[str, ...]
    #: ``get_supported_head_sizes()`` (a class may not define it)
    head_sizes: tuple[int, ...] | None
    #: ``supports_packed_varlen()``: the impl overrides ``forward_varlen``
    packed_varlen: bool | None
    #: ``supports_ring_rotation()``: ``forward_ring_kv_chunk`` returns the softmax LSE
    ring_rotation: bool | None
    #: ``accept_output_buffer`` (SGLang allocates the output; attnres has no such fact)
    accept_output_buffer: bool | None
    #: the keyword parameters of ``get_impl_cls().__init__``
    impl_parameters: tuple[str, ...] | None
    #: (fact, why no class states it)
    unknown: tuple[tuple[str, str], ...] = ()


#: what a parameter of SGLang's ``AttentionImpl.__init__`` says its impl serves
_IMPL_PARAMETERS: Final = {
    "causal": Requirement.CAUSAL,
    "num_kv_heads": Requirement.GQA,
    "softmax_scale": Requirement.CUSTOM_SCALE,
    "dropout_p": Requirement.DROPOUT,
}
#: facts of the registered backends, by name (:func:`backend_facts`)
_FACTS: dict[str, BackendFacts] = {}


def backend_facts() -> tuple[BackendFacts, ...]:
    """The facts of every SGLang backend the plugin registered, by name."""
    return tuple(_FACTS[name] for name in sorted(_FACTS))


def _backend_classes(base: Any) -> tuple[dict[Any, tuple[Any, ...]], dict[str, str]]:
    """Every ``base`` subclass in ``base``'s package, by its ``get_enum()``, and the
    modules of that package that cannot be imported here (with why)."""
    package = importlib.import_module(base.__module__.rpartition(".")[0])
    found: dict[Any, tuple[Any, ...]] = {}
    failures: dict[str, str] = {}

    def failed(name: str) -> None:
        failures[name] = _engine.why(sys.exc_info()[1])

    for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".", onerror=failed):
        try:
            module = importlib.import_module(info.name)
        except Exception as exc:  # a kernel package this host lacks, typically
            failures[info.name] = _engine.why(exc)
            continue
        for cls in vars(module).values():
            if not (isinstance(cls, type) and issubclass(cls, base) and cls is not base):
                continue
            if cls.__module__ != module.__name__:
                continue
            try:
                member = cls.get_enum()  # type: ignore[attr-defined]
            except Exception:  # an intermediate class without a member of its own
                continue
            found[member] = (*found.get(member, ()), cls)
    return found, failures


def read_backend_facts(
    member: Any,
    classes: Iterable[Any],
    failures: Mapping[str, str],
) -> BackendFacts:
    """One ``AttentionBackendEnum`` member's facts, as its SGLang classes state them.

    ``classes``: the ``AttentionBackend`` subclasses whose ``get_enum()`` is
    ``member``; ``failures``: modules of SGLang's backends package that could
    not be imported here (``module: error``). Several classes (one per
    platform) are combined permissively: a fact holds when one class states it.
    """
    name = member.name.lower()
    found = tuple(classes)
    if not found:
        # which module would have held it: the one named after it, else every failure
        named = {m: why for m, why in failures.items() if m.rpartition(".")[2].startswith(name)}
        causes = named or failures
        why = "no class importable here returns it from get_enum()"
        if causes:
            why += "; not importable here: " + "; ".join(
                f"{m.rpartition('.')[2]} ({causes[m]})" for m in sorted(causes)
            )
        return BackendFacts(
            name, bool(member.is_sparse), (), None, None, None, None, None, (("classes", why),)
        )
    declared = [c for c in found if hasattr(c, "get_supported_head_sizes")]
    sizes = {int(s) for c in declared for s in c.get_supported_head_sizes()}
    undeclared = [c.__qualname__ for c in found if c not in declared]
    unknown = (
        (("head_sizes", f"{', '.join(undeclared)} does not define get_supported_head_sizes()"),)
        if undeclared
        else ()
    )
    parameters = {
        p
        for c in found
        for p in inspect.signature(c.get_impl_cls().__init__).parameters
        if p != "self"
    }
    return BackendFacts(
        name=name,
        sparse=bool(member.is_sparse),
        classes=tuple(f"{c.__module__}.{c.__qualname__}" for c in found),
        head_sizes=None if undeclared else tuple(sorted(sizes)),
        packed_varlen=any(bool(c.supports_packed_varlen()) for c in found),
        ring_rotation=any(bool(c.supports_ring_rotation()) for c in found),
        accept_output_buffer=any(bool(getattr(c, "accept_output_buffer", False)) for c in found),
        impl_parameters=tuple(sorted(parameters)),
        unknown=unknown,
    )


#: what no SGLang backend class states, and so what every registered spec leaves open
_NEVER_STATED: Final = (
    "platforms and dtypes: SGLang's classes do not state them (its platform resolvers "
    "decide, observed at each decision as HostResolution)"
)


def spec_from_facts(facts: BackendFacts) -> BackendSpec:
    """The :class:`BackendSpec` of an SGLang backend: its classes' facts, and
    the permissive value, with the reason in the description, where they state none.

    - head sizes: ``get_supported_head_sizes()`` (none declared: any);
    - requirements: what ``AttentionImpl.__init__`` takes (``causal``,
      ``num_kv_heads``, ``softmax_scale``, ``dropout_p``) and
      ``supports_packed_varlen()``; unknown: all of these; never masks, since
      ``AttentionImpl.forward(query, key, value, attn_metadata)`` takes none;
    - ``lse``: only when ``supports_ring_rotation()`` (no class: none, fail closed);
    - platforms and dtypes: every one (no class states them; the ``sglang``
      profile reads SGLang's platform instead);
    - no kernel: SGLang runs it, attnres does not.
    """
    given = facts.impl_parameters  # None: unknown, so permissive
    implements = {r for p, r in _IMPL_PARAMETERS.items() if given is None or p in given}
    if facts.packed_varlen is not False:
        implements.add(Requirement.PACKED_VARLEN)
    lse = None
    if facts.ring_rotation:
        lse = f"SGLang {', '.join(facts.classes)}: forward_ring_kv_chunk (supports_ring_rotation)"
    source = ", ".join(facts.classes) or "no class (every class fact unknown)"
    unknown = "; ".join(f"{fact}: {why}" for fact, why in facts.unknown)
    return BackendSpec(
        name=facts.name,
        sparse=facts.sparse,
        platforms=PLATFORM_KINDS,
        dtypes=DTYPES,
        head_sizes=HeadSizeRule()
        if facts.head_sizes is None
        else HeadSizeRule(allowed=facts.head_sizes),
        implements=implements,
        lse=lse,
        description=(
            f"SGLang multimodal_gen backend (sglang plugin), read from {source}; "
            f"left open: {_NEVER_STATED}" + (f"; unknown: {unknown}" if unknown else "")
        ),
    )


@frozen
class _Memo:
    """One decided call: the decision, SGLang's class, and the host answers it
    consulted, as (arguments, class) (each is asked again on a hit: SGLang's own
    cache answers)."""

    decision: Decision
    cls: Any
    consulted: tuple[tuple[Any, Any], ...]


class _Call(NamedTuple):
    """A call of SGLang's ``get_attn_backend``: its arguments, in its order."""

    head_size: Any
    dtype: Any
    supported_attention_backends: Any = None
    selected_attention_backend: Any = None
    attention_requirements: Any = None
    default_attention_backend: Any = None
    is_cross_attention: bool = False


def _route(
    original: Callable[..., Any],
    head_size: Any,
    dtype: Any,
    supported_attention_backends: Any = None,
    selected_attention_backend: Any = None,
    attention_requirements: Any = None,
    default_attention_backend: Any = None,
    is_cross_attention: bool = False,
) -> Any:
    """SGLang's ``get_attn_backend``, decided by attnres."""
    selector = sys.modules[_SELECTOR]
    context = selector.component_attn_backend_context.get()
    server_args = _server_args(selector)
    supported = frozenset(supported_attention_backends) if supported_attention_backends else None
    key: tuple[Any, ...] = (
        head_size,
        dtype,
        supported,
        selected_attention_backend,
        attention_requirements,
        default_attention_backend,
        is_cross_attention,
        selector.forced_attn_backend,
        None
        if context is None
        else (
            context.backend,
            context.component_name,
            tuple(context.backend_by_role.items()),
            context.allow_global_backend_fallback,
            context.require_backend_selection,
        ),
        getattr(server_args, "attention_backend", None),
        server_args if isinstance(server_args, selector.ServerArgs) else None,
        selector._cached_get_attn_backend,
    )
    try:
        memo = _MEMO.get(key)
    except TypeError:  # an unhashable argument: decide without the memo
        memo, key = None, ()
    if memo is not None and _still_answers(selector, memo):
        return _finish(selector, is_cross_attention, memo.decision, memo.cls)
    call = _Call(
        head_size,
        dtype,
        supported_attention_backends,
        selected_attention_backend,
        attention_requirements,
        default_attention_backend,
        is_cross_attention,
    )
    translated = _translate(selector, call)
    if translated is None:
        _STATS["delegated"] += 1
        return original(*call)
    layer, scope, config, requested = translated
    be_tuple = _be_tuple(supported)
    requirements = call.attention_requirements or selector.AttentionRequirements()
    observed: dict[str, HostResolution] = {}
    classes: dict[str, Any] = {}
    answers: dict[str, tuple[Any, Any]] = {}
    enum_by_name = _enum_by_name(selector.AttentionBackendEnum)

    def observe(name: str) -> None:
        member = None if name == "" else enum_by_name.get(name)
        sparse = member is not None and _member(member)[1]
        args = (call.head_size, call.dtype, be_tuple, member)
        try:
            cls = selector._cached_get_attn_backend(*args)
        except ValueError as exc:
            cls, observed[name] = None, HostResolution(name, None, str(exc), sparse)
        else:
            served, served_sparse = _member(cls.get_enum())
            classes[served.name] = cls
            missing = tuple(cls.unsupported_requirements(requirements))
            observed[name] = HostResolution(name, served.name, None, sparse, served_sparse, missing)
        answers[name] = (args, cls)

    decision, generation = _engine.decide(
        layer, config, scope, requested, _PLATFORM(), observed, observe
    )
    outcome = decision.outcome
    cls = None if outcome.backend is None else classes[outcome.backend.name]
    if key:
        _MEMO.put(key, _Memo(decision, cls, tuple(answers.values())), generation)
    return _finish(selector, call.is_cross_attention, decision, cls)


def _server_args(selector: types.ModuleType) -> Any:
    """SGLang's global server args for the memo key, ``None`` while they are unset
    (issue 32: SGLang reads them only when no earlier origin chose a backend, and
    raises there; :func:`_translate` does the same)."""
    try:
        return selector.get_global_server_args()
    except ValueError:
        return None


@functools.cache
def _enum_by_name(enum: Any) -> dict[str, Any]:
    return {m.name.lower(): m for m in enum}


@functools.lru_cache(maxsize=256)
def _be_tuple(supported: frozenset[Any] | None) -> tuple[Any, ...]:
    # SGLang's own cache key: the supported backends sorted by name (a pure
    # function of the set, memoised per set)
    return tuple(sorted(supported or (), key=lambda b: str(b.name)))


def _still_answers(selector: types.ModuleType, memo: _Memo) -> bool:
    """Whether SGLang's platform still gives the answers the memo's decision read."""
    for args, cls in memo.consulted:
        try:
            now = selector._cached_get_attn_backend(*args)
        except ValueError:
            now = None
        if now is not cls:
            return False
    return True


#: SGLang's device types as attnres's platform kinds (any other: ``cpu``)
_KINDS: Final = {
    **{k: k for k in ("cpu", "cuda", "rocm", "mps", "xpu", "npu")},
    "musa": "cuda",
}
#: attnres's platform kind of SGLang's ``current_platform``
_PLATFORM: Final = _engine.PlatformReader(_PLATFORMS, "current_platform", _KINDS)


@functools.cache
def _member(member: Any) -> tuple[Backend, bool]:
    """An SGLang enum member as attnres sees it: the Backend of its lower-case
    name, and its ``is_sparse``. Facts of SGLang's (immutable) enum, not of any
    decision: neither ``attnres.clear_cache()`` nor :func:`clear_memo` forgets them."""
    return Backend(member.name.lower()), bool(member.is_sparse)


def _backend(member: Any) -> Backend | None:
    return None if member is None else _member(member)[0]


#: attnres's requirements for SGLang's ``AttentionRequirements.packed_varlen``
_REQUIREMENTS: Final = {False: Requirements(), True: Requirements(packed_varlen=True)}


def _translate(
    selector: types.ModuleType, call: _Call
) -> tuple[LayerSpec, ScopeState | None, SelectionConfig, Backend | None] | None:
    role = Role.CROSS if call.is_cross_attention else Role.SELF
    requirements = call.attention_requirements
    try:
        layer = LayerSpec(
            head_size=int(call.head_size),
            dtype=str(call.dtype).removeprefix("torch."),
            supported=frozenset([_member(b)[0] for b in call.supported_attention_backends or ()])
            or None,
            default=_backend(call.default_attention_backend),
            role=role,
            requirements=_REQUIREMENTS[bool(getattr(requirements, "packed_varlen", False))],
        )
    except (TypeError, ValueError, AttributeError):
        return None
    context = selector.get_component_attn_backend_context()
    scope = None
    if context is not None:
        role_backends = tuple(
            (Role(r.value), Backend(b.name.lower())) for r, b in context.backend_by_role.items()
        )
        scope = ScopeState(
            component=context.component_name or "",
            kind="sglang",
            loader="sglang component context",
            backend=_backend(context.backend),
            role_backends=tuple(sorted(role_backends, key=lambda rb: rb[0].value)),
            allow_global_fallback=bool(context.allow_global_backend_fallback),
            require_selection=bool(context.require_backend_selection),
        )
    forced = selector.get_global_forced_attn_backend()
    config = _PROFILE
    if forced is not None:
        config = SelectionConfig(forced_backend=_backend(forced), profile="sglang")
    elif call.selected_attention_backend is None and (
        scope is None or (scope.role_backend(role) is None and scope.backend is None)
    ):  # no earlier origin: SGLang reads its server args
        server_args = selector.get_global_server_args()
        name = server_args.attention_backend
        if name is not None:
            enum = selector.AttentionBackendEnum
            try:
                member = enum[name.upper()]
            except KeyError:
                raise InvalidArgumentError(
                    f"Invalid attention backend '{name}' specified via command line. "
                    f"Available options are: {[e.name.lower() for e in enum]}"
                ) from None
            explicit = isinstance(
                server_args, selector.ServerArgs
            ) and server_args.is_arg_explicitly_set("attention_backend")
            config = SelectionConfig(
                global_backend=_backend(member),
                global_backend_explicit=bool(explicit),
                profile="sglang",
            )
    return layer, scope, config, _backend(call.selected_attention_backend)


def _finish(
    selector: types.ModuleType, is_cross_attention: bool, decision: Decision, cls: Any
) -> Any:
    """SGLang's answer and side effects for an attnres decision, counted and recorded."""
    _STATS["decided"] += 1
    record_decision(decision)
    outcome = decision.outcome
    if outcome.backend is None:
        raise InvalidArgumentError(outcome.error)
    role = selector.AttentionRole.CROSS if is_cross_attention else selector.AttentionRole.SELF
    backend_name = outcome.backend.name
    reason = None if outcome.reason is None else outcome.reason.value
    fallback_reasons = (
        Reason.PLATFORM_DEFAULT_FALLBACK,
        Reason.GLOBAL_BACKEND_FALLBACK,
        Reason.DENSE_CROSS_ATTENTION_FALLBACK,
    )
    if outcome.origin is Origin.ROLE_OVERRIDE and outcome.reason in fallback_reasons:
        component = selector.get_component_attn_backend_name() or "component"
        requested = decision.trace.records[0]
        assert isinstance(requested, OriginRecord) and requested.backend is not None
        selector.logger.warning_once(
            f"Attention backend '{requested.backend.name}' was requested for "
            f"'{selector.make_component_role_key(component, role)}' but could not be used "
            f"({reason}); using {backend_name} instead"
        )
    if not selector._record_component_attn_backend(backend_name, reason, role):
        suffix = f" ({reason})" if reason else ""
        selector.logger.info_once(f"Using {backend_name} attention backend{suffix}")
    return cls
