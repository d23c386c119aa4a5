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
import importlib
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, Final

from attrs import frozen

from attnres._memo import GenerationMemo
from attnres._profile_vllm_omni import SOURCES, UNOBSERVED, first_request
from attnres._states import Origin, Status
from attnres._vocab import DTYPES, PLATFORM_KINDS, Role
from attnres.backends import (
    Backend,
    BackendSpec,
    HeadSizeRule,
    lookup_spec,
    register_backend,
    registry_generation,
)
from attnres.errors import UnknownBackendError
from attnres.integrations._engine import Engine, require
from attnres.layer import LayerSpec, SelectionConfig
from attnres.ledger import Decision, record_decision
from attnres.machine import run_machine
from attnres.platform import HostResolution, Platform
from attnres.runtime import lookup_traced
from attnres.scope import ScopeState
from attnres.trace import CheckRecord, TraceInput

__all__ = [
    "ENGINE",
    "TARGET",
    "install",
    "installed",
    "plugin",
    "register_backends",
    "stats",
    "uninstall",
]

_SELECTOR: Final = "vllm_omni.diffusion.attention.selector"
_REGISTRY: Final = "vllm_omni.diffusion.attention.backends.registry"
#: the function attnres takes over
TARGET: Final = f"{_SELECTOR}.get_attn_backend_for_role"

#: The vLLM-Omni releases the plugin was written for, and what it reads of them.
ENGINE: Final = Engine(
    name="vLLM-Omni",
    distribution="vllm-omni",
    extra="vllm-omni",
    low=(0, 30, 0),
    high=(0, 31),
    hooks={
        _SELECTOR: (
            "get_attn_backend_for_role",
            "_cached_get_backend_cls",
            "_log_backend_resolution",
        ),
        "vllm_omni.diffusion.data": ("AttentionConfig.resolve_with_source", "AttentionSpec"),
        _REGISTRY: ("DiffusionAttentionBackendEnum",),
        "vllm_omni.diffusion.attention.backends.abstract": (
            "AttentionBackend.get_name",
            "AttentionBackend.supports_head_size",
            "AttentionBackend.get_supported_head_sizes",
        ),
    },
)

_LOCK = threading.Lock()
_INSTALLED: list[tuple[types.ModuleType, Callable[..., Any]]] = []
_STATS = {"decided": 0, "delegated": 0}
_PROFILE: Final = SelectionConfig(profile="vllm_omni")


def plugin() -> None:
    """vLLM-Omni's general plugin: route its selector through attnres (idempotent:
    vLLM-Omni may call it in several processes, and more than once)."""
    install()


def install() -> None:
    """Route vLLM-Omni's ``get_attn_backend_for_role`` through attnres now.

    Raises :class:`~attnres.errors.EngineSupportError` when vLLM-Omni is not
    installed or is a release the plugin was not written for (:data:`ENGINE`);
    nothing is changed then.
    """
    with _LOCK:
        if _INSTALLED:
            return
        modules = require(ENGINE, "attnres.integrations.vllm_omni.install()")
        selector = modules[_SELECTOR]
        original = selector.get_attn_backend_for_role
        register_backends(modules[_REGISTRY].DiffusionAttentionBackendEnum)

        def get_attn_backend_for_role(*args: Any, **kwargs: Any) -> Any:
            return _route(original, *args, **kwargs)

        get_attn_backend_for_role.__wrapped__ = original  # type: ignore[attr-defined]
        _rebind(original, get_attn_backend_for_role)
        _INSTALLED.append((selector, original))


def installed() -> bool:
    """Whether vLLM-Omni's selector currently routes through attnres."""
    selector = sys.modules.get(_SELECTOR)
    return selector is not None and _ours(selector.get_attn_backend_for_role) is not None


def uninstall() -> None:
    """Restore vLLM-Omni's own selector in every module that bound it."""
    with _LOCK:
        selector = sys.modules.get(_SELECTOR)
        if selector is not None:
            current = selector.get_attn_backend_for_role
            original = _ours(current)
            if original is not None:
                _rebind(current, original)
        _INSTALLED.clear()


def stats() -> dict[str, int]:
    """``decided``: calls attnres decided; ``delegated``: calls vLLM-Omni
    answered itself (a backend name or class attnres has no backend for)."""
    return dict(_STATS)


def _ours(function: Any) -> Callable[..., Any] | None:
    if (
        isinstance(function, types.FunctionType)
        and function.__module__ == __name__
        and function.__name__ == "get_attn_backend_for_role"
    ):
        wrapped = getattr(function, "__wrapped__", None)
        return wrapped if callable(wrapped) else None
    return None


def _rebind(old: Any, new: Any) -> None:
    """Replace every module-level binding of ``old`` (``from selector import ...``)."""
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        try:
            names = [k for k, v in vars(module).items() if v is old]
        except TypeError:
            continue
        for name in names:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(module, name, new)


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
        if not _lacks(name):
            continue
        head_sizes: HeadSizeRule = HeadSizeRule()
        platforms: tuple[str, ...] = PLATFORM_KINDS
        try:
            cls = member.get_class()
            sizes = tuple(int(s) for s in cls.get_supported_head_sizes())
            if sizes:
                head_sizes = HeadSizeRule(allowed=sizes)
            stated = getattr(cls, "supported_platforms", None)
            if stated:
                platforms = tuple(sorted({_KINDS.get(str(p), str(p)) for p in stated}))
                platforms = tuple(p for p in platforms if p in PLATFORM_KINDS) or PLATFORM_KINDS
            source = f"{cls.__module__}.{cls.__qualname__}"
        except Exception as exc:  # a kernel package this host lacks, typically
            source = f"{member.value} (not importable here: {type(exc).__name__}: {exc})"
        if _lacks(name):
            register_backend(
                BackendSpec(
                    name=name,
                    sparse=name in _SPARSE,
                    platforms=platforms,
                    dtypes=DTYPES,
                    head_sizes=head_sizes,
                    description=(
                        f"vLLM-Omni diffusion backend (vllm_omni plugin), read from {source}; "
                        "dtypes and requirements left open (its classes do not state them; "
                        "the vllm_omni profile reads vLLM-Omni's platform at each decision)"
                    ),
                )
            )
            out.append(name)
    return tuple(out)


def _lacks(name: str) -> bool:
    if lookup_spec(Backend(name)) is not None:
        return False
    try:
        Backend.parse(name)
    except ValueError:
        return True
    return False


def _attnres(name: str) -> Backend | None:
    """attnres's backend for one of vLLM-Omni's names (``None``: none)."""
    try:
        return Backend.parse(name.lower())
    except (UnknownBackendError, ValueError, AttributeError):
        return None


# -- the decision ----------------------------------------------------------------


@frozen
class _Memo:
    """One decided call: the decision, vLLM-Omni's class, and the platform calls
    it consulted (asked again on a hit: vLLM-Omni's own cache answers)."""

    decision: Decision
    cls: Any
    #: which AttentionConfig entry is the answer's spec (``None``: the platform default)
    entry: int | None
    #: what vLLM-Omni logs: the class's name and the source
    name: str
    source: str
    asked: tuple[tuple[tuple[Any, ...], Any], ...]


#: the index of each origin's entry in (per_role[role], per_role[category], default)
_ENTRIES: Final = {Origin.LAYER: 0, Origin.COMPONENT_OVERRIDE: 1, Origin.GLOBAL_CLI: 2}


_MEMO: GenerationMemo[tuple[Any, ...], _Memo] = GenerationMemo()
_MEMO_MAX: Final = 4096


def clear_memo() -> None:
    """Forget the plugin's decided calls (a registry change empties the memo too)."""
    _MEMO.clear()


def _route(
    original: Callable[..., Any],
    role: Any,
    head_size: Any,
    attention_config: Any = None,
    role_category: Any = None,
    allow_trtllm_default: bool = True,
) -> Any:
    """vLLM-Omni's ``get_attn_backend_for_role``, decided by attnres."""
    selector = sys.modules[_SELECTOR]
    try:
        if attention_config is None:
            exact = category = default = None
        else:
            per_role = attention_config.per_role
            exact = per_role.get(role)
            category = None if role_category is None else per_role.get(role_category)
            default = attention_config.default
        entries = (exact, category, default)
        key = (
            role,
            role_category,
            head_size,
            allow_trtllm_default,
            None if exact is None else exact.backend,
            None if category is None else category.backend,
            None if default is None else default.backend,
            selector._cached_get_backend_cls,
        )
        memo = _MEMO.get(key)
        if memo is not None:  # the cached path: vLLM-Omni's own cache answers again
            for args, cls in memo.asked:
                if selector._cached_get_backend_cls(*args) is not cls:
                    break
            else:
                _STATS["decided"] += 1
                record_decision(memo.decision)
                selector._log_backend_resolution(
                    role=role,
                    role_category=role_category,
                    backend_name=memo.name,
                    source=memo.source,
                )
                return memo.cls, None if memo.entry is None else entries[memo.entry]
        specs = {
            Origin.LAYER: exact,
            Origin.COMPONENT_OVERRIDE: category,
            Origin.GLOBAL_CLI: default,
        }
        names = {o: None if s is None else str(s.backend) for o, s in specs.items()}
        backends = {o: None if n is None else _attnres(n) for o, n in names.items()}
        known = all((names[o] is None) == (backends[o] is None) for o in names)
        layer = LayerSpec(
            head_size=int(head_size),
            dtype="bfloat16",
            role=Role.CROSS if "cross" in (role, role_category) else Role.SELF,
            name=str(role),
        )
    except (AttributeError, TypeError, ValueError):
        known = False
    if not known:  # a name attnres has no backend for: vLLM-Omni answers (and refuses)
        _STATS["delegated"] += 1
        return original(role, head_size, attention_config, role_category, allow_trtllm_default)
    scope = None
    if backends[Origin.COMPONENT_OVERRIDE] is not None:
        scope = ScopeState(
            component=str(role_category),
            kind="vllm_omni",
            loader="attention_config.per_role",
            backend=backends[Origin.COMPONENT_OVERRIDE],
        )
    config = _PROFILE
    if backends[Origin.GLOBAL_CLI] is not None:
        config = SelectionConfig(global_backend=backends[Origin.GLOBAL_CLI], profile="vllm_omni")
    inp = TraceInput(layer, config, scope, Platform("cpu"), backends[Origin.LAYER])
    kind = _platform_kind()
    observed: dict[str, HostResolution] = {}
    classes: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    by_backend: dict[str, str | None] = {}  # the winning origin's spelling first
    for o, b in backends.items():
        if b is not None:
            by_backend.setdefault(b.name, names[o])

    asked: list[tuple[tuple[Any, ...], Any]] = []

    def observe(candidate: str) -> None:
        # vLLM-Omni passes a configured name as the config spells it
        args: tuple[Any, ...] = (
            (None, head_size, allow_trtllm_default)
            if candidate == ""
            else (by_backend.get(candidate, candidate.upper()), head_size)
        )
        try:
            cls = selector._cached_get_backend_cls(*args)
            asked.append((args, cls))
        except Exception as exc:
            errors[candidate] = exc
            observed[candidate] = HostResolution(candidate, None, f"{type(exc).__name__}: {exc}")
            return
        served = _attnres(str(cls.get_name()))
        classes[candidate] = cls
        if served is None:
            observed[candidate] = HostResolution(candidate, None, "unknown class")
            return
        supports = getattr(cls, "supports_head_size", None)
        fits = head_size <= 0 or supports is None or bool(supports(head_size))
        missing = () if fits else (f"head size {head_size} (its supports_head_size)",)
        observed[candidate] = HostResolution(candidate, served.name, None, missing=missing)

    first = first_request(inp)
    observe("" if first is None else first.name)
    while True:
        if any(h.error == "unknown class" for h in observed.values()):
            # vLLM-Omni's platform gave a class attnres has no backend for: its answer stands
            _STATS["delegated"] += 1
            cls = next(iter(classes.values()))
            return _answer(selector, role, role_category, specs, first, cls)
        platform = Platform(kind, host=tuple(observed.values()))
        trace = run_machine(TraceInput(layer, config, scope, platform, backends[Origin.LAYER]))
        pending = _unobserved(trace, observed)
        if pending is None:
            break
        observe(pending)
    _, decision, _ = lookup_traced(trace, registry_generation())
    _STATS["decided"] += 1
    record_decision(decision)
    outcome = decision.outcome
    if outcome.status is not Status.SELECTED or outcome.backend is None:
        wanted = "" if first is None else first.name
        if wanted in errors:
            raise errors[wanted]  # vLLM-Omni's own refusal, unchanged
        raise ValueError(f"{outcome.error}")
    candidate = next(c for c, h in observed.items() if h.served == outcome.backend.name)
    if len(_MEMO) >= _MEMO_MAX:
        _MEMO.clear()
    cls = classes[candidate]
    _MEMO[key] = _Memo(
        decision,
        cls,
        _ENTRIES.get(outcome.origin),
        str(cls.get_name()),
        SOURCES[outcome.origin].format(role=repr(role), category=repr(role_category)),
        tuple(asked),
    )
    return _answer(selector, role, role_category, specs, first, cls, outcome.origin)


def _answer(
    selector: types.ModuleType,
    role: Any,
    role_category: Any,
    specs: dict[Origin, Any],
    first: Backend | None,
    cls: Any,
    origin: Origin | None = None,
) -> tuple[Any, Any]:
    """vLLM-Omni's answer and its log line."""
    if origin is None:
        origin = next((o for o, s in specs.items() if s is not None), Origin.NONE)
    source = SOURCES[origin].format(role=repr(role), category=repr(role_category))
    selector._log_backend_resolution(
        role=role, role_category=role_category, backend_name=cls.get_name(), source=source
    )
    return cls, specs.get(origin)


def _unobserved(trace: Any, observed: dict[str, HostResolution]) -> str | None:
    for record in trace.records:
        if (
            isinstance(record, CheckRecord)
            and not record.passed
            and any(f.message == UNOBSERVED for f in record.failures)
        ):
            name = record.candidate.name
            return None if name in observed else name
    return None


def _platform_kind() -> str:
    """attnres's platform kind of vLLM-Omni's ``current_omni_platform`` (read at
    every decision: a test may swap it); ``cpu`` when it cannot say."""
    try:
        platform = importlib.import_module("vllm_omni.platforms").current_omni_platform
        kind = str(getattr(platform, "device_type", "cpu") or "cpu")
    except Exception:
        return "cpu"
    return _KINDS.get(kind, "cpu")
