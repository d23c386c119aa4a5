"""The runtime around the pure machine: context, config, cache, ledger, audit, scopes.

:func:`attnres.machine.run_machine` is a pure function of a
:class:`~attnres.trace.TraceInput`. This module is everything a live process
adds around it:

- the process-wide :class:`~attnres.layer.SelectionConfig` and the forced
  backend of :func:`force_backend` (a context variable);
- :func:`resolve`: gathers the input from the caller's context (scope, config,
  detected platform), runs the machine on a cache miss, records the decision in
  the ledger and the open scope, and emits the audit events;
- the two-level resolution cache (full input; the same input up to the layer's
  name), bounded and cleared on any registry change;
- :func:`component_scope`: opens a scope, and on exit logs its summary line and
  runs the machine's scope checks (SPEC 3.6, ``attnres.machine.SCOPE_CHECKS``).
"""

from __future__ import annotations

import contextvars
import operator
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Final

import attrs
from attrs import field, frozen

from attnres import machine as _machine
from attnres._memo import GenerationMemo
from attnres._outcome import Outcome, OutcomeView
from attnres._states import Status
from attnres._vocab import Role
from attnres.audit import emit_cache_hit, emit_resolution, emit_scope_problems, emit_summary
from attnres.backends import (
    _REGISTRY,
    Backend,
    registered_backends,
    registry_generation,
)
from attnres.errors import (
    ArgumentTypeError,
    BackendNotAppliedError,
    InvalidArgumentError,
    ResolutionError,
)
from attnres.kernels import KernelSource, kernel_source
from attnres.layer import LayerSpec, SelectionConfig, optional_backend
from attnres.ledger import Decision, record_decision
from attnres.platform import Platform, detected_platform
from attnres.records import ScopeProblem
from attnres.scope import (
    ScopeHandle,
    ScopeState,
    current_handle,
    enter_scope,
    exit_scope,
    scope_state,
)
from attnres.trace import Trace, TraceInput

__all__ = [
    "Resolution",
    "bind_pending",
    "cache_epoch",
    "cache_info",
    "capture_config",
    "clear_cache",
    "component_scope",
    "force_backend",
    "lookup",
    "lookup_traced",
    "rejection",
    "resolve",
    "resolve_entry",
    "selection_config",
    "set_selection_config",
]

# =============================================================================
# Outcome, config and forced state
# =============================================================================


def _selected_outcome(_: object, __: attrs.Attribute[Outcome], value: Outcome) -> None:
    if value.status is not Status.SELECTED or value.backend is None:
        raise InvalidArgumentError(
            f"a Resolution holds a selected outcome, got {value.status.value}"
        )


@frozen
class Resolution(OutcomeView):
    """The backend a layer runs, why, and the trace that proves it.

    It composes the selected :class:`~attnres.trace.Outcome` (``outcome``);
    ``backend``, ``reason`` and ``origin`` read through to it (OutcomeView).
    """

    outcome: Outcome = field(validator=_selected_outcome)
    trace: Trace = field(eq=False, repr=False)
    component: str | None = None
    layer: str | None = None

    @property
    def backend(self) -> Backend:
        backend = self.outcome.backend
        assert backend is not None  # the validator saw to it
        return backend


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
        raise ArgumentTypeError(f"expected a SelectionConfig, got {type(config).__name__}")
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
        raise InvalidArgumentError("force_backend: backend must be a backend name, not None")
    token = _FORCED.set(parsed)
    try:
        yield parsed
    finally:
        _FORCED.reset(token)


_CacheEntry = tuple[Resolution | None, Decision, Trace]
#: :func:`lookup`'s cache key: layer, config, scope, platform, backend, request, and
#: whether the layer will run (needs a kernel); a machine input's fields, in its order
_Key = tuple[
    LayerSpec, SelectionConfig, ScopeState | None, Platform, Backend | None, Backend | None, bool
]
_CACHE_MAX: Final = 4096
# A registration change (register_backend, unregister_backend, a plugin loading,
# a kernel registered) can change any answer: both memos belong to one registry
# generation (attnres._memo), and _resolve_cold stores nothing computed against
# an older registry.
_CACHE: GenerationMemo[tuple[object, ...], _CacheEntry] = GenerationMemo(_CACHE_MAX)
#: the same resolutions keyed without the layer's name (see _shape_key)
_SHAPES: GenerationMemo[tuple[object, ...], _CacheEntry] = GenerationMemo(_CACHE_MAX)
_CACHE_LOCK = threading.Lock()
#: a scope's state -> the equal state of the first scope opened so (issue 32):
#: the cache keys of a model built again hold the identical state, so each of
#: its layers' lookups compares it by identity, not field by field
_SCOPES: GenerationMemo[ScopeState, ScopeState] = GenerationMemo(256)


def _interned(state: ScopeState) -> ScopeState:
    """``state``, or an equal one opened before (the same snapshot)."""
    with _CACHE_LOCK:
        known = _SCOPES.get(state)
        if known is None:
            _SCOPES.put(state, state)
            return state
        return known


def clear_cache() -> None:
    """Forget every cached resolution (decisions already recorded stay)."""
    with _CACHE_LOCK:
        _CACHE.clear()
        _SHAPES.clear()


def cache_epoch() -> int:
    """Changes whenever a cached resolution may have left the cache within a registry
    generation (:func:`clear_cache`, an eviction, a replacement): a memo of
    :func:`lookup`'s entries (itself a GenerationMemo) keys on it."""
    return _CACHE.epoch


def cache_info() -> dict[str, int]:
    """``size``: cached inputs; ``shapes``: distinct inputs up to the layer name."""
    return {"size": len(_CACHE), "shapes": len(_SHAPES), "max_size": _CACHE_MAX}


def resolve(
    layer: LayerSpec,
    *,
    config: SelectionConfig | None = None,
    platform: Platform | None = None,
    backend: Backend | str | None = None,
    needs_kernel: bool = False,
) -> Resolution:
    """Decide which backend ``layer`` runs, inside the current component scope.

    ``needs_kernel=True`` resolves for a layer that will run (``attnres.Attention``
    passes it): a backend with no kernel in this process then fails like any
    other capability (code ``no_kernel``) -- a relaxed request falls back, a
    strict one is rejected with a message saying how to register a kernel.

    Raises :class:`~attnres.errors.ResolutionError` (with ``.trace``) when no
    backend can serve it. Resolutions are cached on their full input; a hit
    returns the same :class:`Resolution` and still records the decision.
    """
    if type(layer) is not LayerSpec and not isinstance(layer, LayerSpec):
        raise ArgumentTypeError(f"resolve() takes a LayerSpec, got {type(layer).__name__}")
    cfg = capture_config(config)
    if platform is None:
        platform = detected_platform()
    if backend is not None and type(backend) is not Backend:
        backend = optional_backend("backend")(backend)
    return resolve_entry(
        layer, cfg, current_handle(), platform, backend, needs_kernel=needs_kernel
    )[0]


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
    *,
    needs_kernel: bool = False,
    ledger: bool = True,
) -> tuple[Resolution, Decision]:
    """:func:`resolve` with its context given rather than read: the decision is
    recorded in the ledger (unless ``ledger`` is false: an integration's plan
    records nothing there) and in ``handle``'s scope; rejected raises."""
    resolution, decision, trace = lookup(
        layer,
        cfg,
        None if handle is None else handle.state,
        platform,
        backend,
        needs_kernel=needs_kernel,
    )
    if ledger:
        record_decision(decision)
    if handle is not None:
        handle.record(layer.role, decision)
    if resolution is None:
        raise rejection(trace)
    return resolution, decision


def rejection(trace: Trace) -> ResolutionError:
    """The error of a rejected resolution."""
    code = trace.outcome.code
    assert code is not None  # a rejected outcome carries its code
    return ResolutionError(str(trace.outcome.error), trace, code)


def lookup(
    layer: LayerSpec,
    cfg: SelectionConfig,
    scope: ScopeState | None,
    platform: Platform | None,
    backend: Backend | None,
    request: Backend | None = None,
    *,
    needs_kernel: bool = False,
) -> tuple[Resolution | None, Decision, Trace]:
    """The cached (or newly computed, traced and audited) outcome of one input.

    Records nothing: the caller decides whether the decision is the server's
    (the ledger, the scope) or one request's (neither). ``request`` is a
    per-request backend (origin ``request``); ``needs_kernel`` resolves for a
    layer that will run (see :func:`resolve`). The resolution is ``None`` when
    the outcome is a rejection.
    """
    if platform is None:
        platform = detected_platform()
    needs_kernel = needs_kernel is True
    key: _Key = (layer, cfg, scope, platform, backend, request, needs_kernel)
    try:
        # GenerationMemo.get inlined (the hit path): the generation compared, then dict.get
        memo = _CACHE._data if _CACHE._generation == _REGISTRY.generation else _CACHE.current()
        entry = memo.get(key)
    except TypeError:  # an unhashable argument (a dict for a config, say): say which
        _check_arguments(cfg, platform)
        raise
    if entry is None:
        # argument types are checked on the cold path only: a hit costs nothing more
        _check_arguments(cfg, platform)
        entry = _resolve_renamed(key)
        if entry is None:
            entry = _resolve_cold(_trace_input(key), key)
    else:
        emit_cache_hit(entry[1])
    return entry


def _trace_input(key: _Key) -> TraceInput:
    """The machine's input of :func:`lookup`'s ``key``; a layer that will run carries
    this process's kernel facts."""
    needs_kernel = key[6]
    no_kernel = _no_kernel() if needs_kernel else None
    return TraceInput(*key[:6], needs_kernel=needs_kernel, no_kernel=no_kernel)


#: the registered backends with no kernel in this process (one entry, key ``()``)
_NO_KERNEL: GenerationMemo[tuple[()], tuple[str, ...]] = GenerationMemo()


def _no_kernel() -> tuple[str, ...]:
    """The registered backends that have no kernel here (sorted names): the kernel
    facts a resolution for a layer that will run carries in its input, computed
    once per registry generation."""
    memo = _NO_KERNEL.get(())
    if memo is not None:
        return memo
    generation = registry_generation()
    names = tuple(
        sorted(s.name for s in registered_backends() if kernel_source(s.name) is KernelSource.NONE)
    )
    _NO_KERNEL.put((), names, generation)
    return names


def _check_arguments(config: object, platform: object) -> None:
    if not isinstance(config, SelectionConfig):
        raise ArgumentTypeError(
            f"resolve(): config must be an attnres.SelectionConfig, got {type(config).__name__}"
        )
    if not isinstance(platform, Platform):
        raise ArgumentTypeError(
            f"resolve(): platform must be an attnres.Platform (Platform.detect() or "
            f"Platform.simulate('cuda:sm90+flash_attn')), got {type(platform).__name__}"
        )


def _shape_key(layer: LayerSpec, *rest: object) -> tuple[object, ...]:
    """The cache key without the layer's name (``rest``: the other fields of
    :func:`lookup`'s key, in its order).

    The machine never reads a layer's name (it is carried in the trace's input
    only), so layers that differ by name alone -- ``blocks.0.attn1`` ...
    ``blocks.47.attn1`` -- share one run of the machine. Every other field of
    :class:`LayerSpec` is in the key, read by one getter derived from the attrs
    fields: a field added later cannot be forgotten (a hand-kept list missed
    ``exact_route`` and then ``layout``).
    """
    return (_SHAPE_MARK, _SHAPE_FIELDS(layer), *rest)


_SHAPE_MARK: Final = object()
#: every LayerSpec field but the name, as one tuple (operator.attrgetter: one C call)
_SHAPE_FIELDS: Final = operator.attrgetter(
    *(f.name for f in attrs.fields(LayerSpec) if f.name != "name")
)


def _resolve_renamed(key: _Key) -> _CacheEntry | None:
    """A resolution of an identical layer under another name, renamed; or ``None``."""
    twin = _SHAPES.get(_shape_key(*key))
    if twin is None:
        return None
    generation = registry_generation()
    recorded = twin[2]
    trace = Trace(
        _trace_input(key),
        recorded.records,
        recorded.outcome,
        recorded.schema_version,
    )
    entry = _entry_for(trace)
    emit_cache_hit(entry[1])
    _store(key, entry, generation)
    return entry


def _entry_for(trace: Trace) -> _CacheEntry:
    inp, outcome = trace.input, trace.outcome
    component = None if inp.scope is None else inp.scope.component
    decision = Decision(component, inp.layer.name, outcome, trace)
    resolution = (
        None if outcome.backend is None else Resolution(outcome, trace, component, inp.layer.name)
    )
    return (resolution, decision, trace)


def _store(
    key: tuple[object, ...],
    entry: _CacheEntry,
    generation: int,
    cache: GenerationMemo[tuple[object, ...], _CacheEntry] | None = None,
) -> None:
    target = _CACHE if cache is None else cache
    with _CACHE_LOCK:  # nothing computed against an older registry; the oldest eighth
        target.put(key, entry, generation)  # goes when full


def lookup_traced(trace: Trace, generation: int) -> tuple[Resolution | None, Decision, Trace]:
    """:func:`lookup` for an input whose trace the caller has just computed with
    :func:`attnres.machine.run_machine` (issue 23: the SGLang plugin runs the pure
    machine itself to learn which host facts the decision consults, and hands
    the finished trace here rather than running the machine a second time).

    ``generation`` is :func:`~attnres.backends.registry_generation` read before
    the machine ran: when the registry changed since, nothing is cached (as on
    :func:`lookup`'s cold path). Cached, audited and returned exactly as that
    path does; records nothing. A cached entry for the same input wins (it holds
    the same outcome: the machine is a pure function of the input).
    """
    inp = trace.input
    key = _input_key(inp)
    entry = _CACHE.get(key)
    if entry is not None:
        emit_cache_hit(entry[1])
        return entry
    return _resolve_cold(inp, key, (trace, generation))


def _resolve_cold(
    inp: TraceInput, key: tuple[object, ...], computed: tuple[Trace, int] | None = None
) -> _CacheEntry:
    if computed is None:
        generation = registry_generation()
        trace = _machine.run_machine(inp)
    else:
        trace, generation = computed
    entry = _entry_for(trace)
    emit_resolution(trace, entry[1])
    _store(key, entry, generation)
    if inp.layer.name is not None:
        _store(_shape_key(*_input_key(inp)), entry, generation, _SHAPES)
    return entry


def _input_key(inp: TraceInput) -> _Key:
    """:func:`lookup`'s cache key of a machine input (the same fields, in its order)."""
    return (
        inp.layer,
        inp.config,
        inp.scope,
        inp.platform,
        inp.backend,
        inp.request,
        inp.needs_kernel,
    )


# =============================================================================
# Component scopes: open, summarise, check the override was applied
# =============================================================================


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
    when they bind (:func:`bind_pending`).
    """
    state = _interned(
        scope_state(
            name, backend, role_backends, allow_global_fallback, require_selection, kind=kind
        )
    )
    handle, token = enter_scope(state)
    try:
        yield handle
    finally:
        exit_scope(token)
        handle.closed = True
        emit_summary(state, handle.entries)
    _check_applied(handle)


def bind_pending(handle: ScopeHandle, role: Role, decision: Decision | None) -> None:
    """A pending (late-bound) layer of ``handle``'s scope resolved (``decision``
    ``None``: it raised). Once the scope has exited, the layer is checked against
    the scope's overrides now, and the whole scope once its last pending layer
    has bound; raises :class:`~attnres.errors.BackendNotAppliedError`."""
    closed, last = handle.bound()
    if not closed:
        return
    state = handle.state
    problems = [] if decision is None else _machine.scope_unexplained(state, [(role, decision)])
    if last:
        problems += _machine.scope_not_applied(state, handle.entries)
    _raise_problems(state, problems)


def _raise_problems(state: ScopeState, problems: list[ScopeProblem]) -> None:
    if problems:
        emit_scope_problems(state, problems)
        raise BackendNotAppliedError(
            "; ".join(p.message for p in problems)
            + ". Build the component's layers inside the scope with attnres.Attention "
            "(or attnres.resolve), or pass require_selection=False if that is intended "
            "(role overrides are checked regardless).",
            tuple(problems),
        )


def _check_applied(handle: ScopeHandle) -> None:
    state = handle.state
    problems = _machine.scope_unexplained(state, handle.entries)
    if handle.pending == 0:
        problems += _machine.scope_not_applied(state, handle.entries)
    _raise_problems(state, problems)
