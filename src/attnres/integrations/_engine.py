"""What the serving engines' attnres plugins share (issues 32, 33, 36).

SGLang's plugin (:mod:`attnres.integrations.sglang`) and vLLM-Omni's
(:mod:`attnres.integrations.vllm_omni`) each take over one selector function by
name and decide its calls with attnres's machine on the engine's observed
platform answers. Shared here: the install-time check (:func:`require`: a
plugin refuses, typed, an engine release it was not written for, which would
otherwise fail on every later call), taking the selector over and giving it
back with the plugin's counts and memo (:class:`Takeover`: each plugin's
``install``, ``installed``, ``uninstall``, ``stats`` and ``clear_memo``),
registering engine backends attnres lacks, reading the engine's platform
(:class:`PlatformReader`) and the decision on observed answers (:func:`decide`).
Nothing here imports an engine until a plugin asks.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

from attrs import define, field, frozen

from attnres._memo import GenerationMemo
from attnres._profile import UNOBSERVED, requested_by
from attnres._states import Event
from attnres._vocab import release as _release
from attnres.backends import (
    Backend,
    BackendSpec,
    lookup_spec,
    register_backend,
    registry_generation,
)
from attnres.errors import EngineSupportError
from attnres.layer import LayerSpec, SelectionConfig
from attnres.ledger import Decision
from attnres.machine import PROFILES, run_machine
from attnres.platform import HostResolution, Platform
from attnres.records import TraceInput
from attnres.runtime import lookup_traced
from attnres.scope import ScopeState
from attnres.trace import CheckRecord, Trace, TransitionRecord

__all__ = [
    "Engine",
    "PlatformFacts",
    "PlatformReader",
    "Takeover",
    "decide",
    "lacks",
    "rebind_imports",
    "register_lacking",
    "release",
    "require",
    "unobserved",
    "why",
]


@frozen
class Engine:
    """What one plugin needs of its engine."""

    #: the engine's name in messages (``SGLang``)
    name: str
    #: its distribution on the package index, and the extra that installs it
    #: with attnres (``sglang``: ``attnres[sglang]``)
    distribution: str
    #: the release range the plugin was written for: ``low <= release < high``
    low: tuple[int, ...]
    high: tuple[int, ...]
    #: module -> the attributes the plugin reads from it (its hooks); a dotted
    #: attribute is read through (``Context.backend_by_role``: a field of a class)
    hooks: Mapping[str, tuple[str, ...]]

    @property
    def supported(self) -> str:
        return f">={'.'.join(map(str, self.low))},<{'.'.join(map(str, self.high))}"


def release(version: str) -> tuple[int, ...] | None:
    """The numeric release of a version string (``0.5.23.post1`` -> ``(0, 5, 23)``;
    :func:`attnres._vocab.release`), ``None`` for one that is not a version."""
    return _release(version) or None


def why(exc: BaseException | None) -> str:
    """An exception as the plugins report it (``ValueError: ...``)."""
    return "unknown error" if exc is None else f"{type(exc).__name__}: {exc}"


def _has(obj: object, dotted: str) -> bool:
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def require(engine: Engine, what: str) -> dict[str, types.ModuleType]:
    """The engine's hook modules, when the installed release is one the plugin
    was written for and has every hook; ``what`` is the call being made
    (``attnres.integrations.sglang.install()``). Raises
    :class:`~attnres.errors.EngineSupportError` otherwise, naming the range."""
    written = f"{engine.distribution}{engine.supported}"
    install = f"pip install 'attnres[{engine.distribution}]' ({written})"
    try:
        version: str | None = importlib.metadata.version(engine.distribution)
    except importlib.metadata.PackageNotFoundError:
        version = None

    def refuse(message: str) -> EngineSupportError:
        return EngineSupportError(f"{what}: {message}", engine.name, version, engine.supported)

    modules: dict[str, types.ModuleType] = {}
    for name in engine.hooks:
        try:
            modules[name] = importlib.import_module(name)
        except ImportError as exc:
            if version is None:
                raise refuse(
                    f"{engine.name} is not installed here ({why(exc)}); install it with {install}"
                ) from exc
            raise refuse(
                f"{engine.name} {version} has no module {name} ({why(exc)}); the attnres "
                f"plugin was written for {written}: install a release in that range ({install})"
            ) from exc
    found = None if version is None else release(version)
    if found is None or not engine.low <= found < engine.high:
        raise refuse(
            f"{engine.name} {version or '(no installed distribution)'} is not a release "
            f"the attnres plugin was written for ({written}); "
            f"nothing was changed: install a release in that range ({install})"
        )
    missing = [
        f"{module}.{attribute}"
        for module, attributes in engine.hooks.items()
        for attribute in attributes
        if not _has(modules[module], attribute)
    ]
    if missing:
        raise refuse(
            f"{engine.name} {version} lacks what the attnres plugin reads "
            f"({', '.join(missing)}); nothing was changed: the plugin was written for {written}"
        )
    return modules


# -- taking the selector over ------------------------------------------------------


def rebind_imports(old: Any, new: Any) -> None:
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


@define(eq=False)
class Takeover:
    """A plugin's hold on the engine function it takes over, and its state: its
    wrapper is bound in place of the engine's own in every module that bound it
    by name, and given back. Each plugin's public ``install``, ``installed``,
    ``uninstall``, ``stats`` and ``clear_memo`` are these methods."""

    engine: Engine
    #: the module that defines the function, and its name there
    module: str
    function: str
    #: the plugin's module: its wrapper is a function of that name defined there
    home: str
    #: ``wrap(modules, original)``: the plugin's wrapper of the engine's function
    #: (``modules``: :func:`require`'s)
    wrap: Callable[[dict[str, types.ModuleType], Callable[..., Any]], Callable[..., Any]]
    #: what else the plugin undoes when it is uninstalled (under :attr:`lock`)
    forget: Callable[[], None] = lambda: None
    #: the name of a function of :attr:`home` that an engine's wrapper holding it
    #: in its closure makes the plugin's too (SGLang's hook registry wraps the
    #: plugin's hook)
    hook: str | None = None
    #: held while installing or giving back
    lock: threading.Lock = field(factory=threading.Lock)
    #: ``decided``: calls attnres decided (each one is in :func:`attnres.decisions`);
    #: ``delegated``: calls the engine answered itself (a call attnres cannot
    #: translate: a malformed argument)
    counts: dict[str, int] = field(factory=lambda: {"decided": 0, "delegated": 0})
    #: the plugin's decided calls; they belong to one registry generation (attnres._memo)
    memo: GenerationMemo[tuple[Any, ...], Any] = field(factory=lambda: GenerationMemo(maxsize=4096))
    _done: bool = False

    def install(self) -> None:
        """Route the engine's function through attnres now: check the engine
        (:func:`require`), then bind the plugin's wrapper in place of the
        engine's function, with the original as its ``__wrapped__``; nothing
        when already installed.

        Raises :class:`~attnres.errors.EngineSupportError` when the engine is not
        installed, or is a release the plugin was not written for (its
        ``ENGINE``); nothing is changed then.
        """
        with self.lock:
            if self._done:
                return
            modules = require(self.engine, f"{self.home}.install()")
            original = getattr(modules[self.module], self.function)
            wrapper = self.wrap(modules, original)
            wrapper.__wrapped__ = original  # type: ignore[attr-defined]
            rebind_imports(original, wrapper)
            self._done = True

    def installed(self) -> bool:
        """Whether the engine's function currently routes through attnres."""
        selector = sys.modules.get(self.module)
        return selector is not None and self.original(getattr(selector, self.function)) is not None

    def uninstall(self) -> None:
        """Bind the engine's own function back wherever the plugin's is bound,
        however it was put in place, and undo what else the plugin did (:attr:`forget`)."""
        with self.lock:
            self._done = False
            selector = sys.modules.get(self.module)
            if selector is not None:
                current = getattr(selector, self.function)
                original = self.original(current)
                if original is not None:
                    rebind_imports(current, original)
            self.forget()

    def stats(self) -> dict[str, int]:
        """The plugin's calls (:attr:`counts`)."""
        return dict(self.counts)

    def clear_memo(self) -> None:
        """Forget the plugin's decided calls (a registry change forgets them too)."""
        self.memo.clear()

    def original(self, function: Any) -> Callable[..., Any] | None:
        """The engine's own function under ``function`` when ``function`` is the
        plugin's wrapper (``None`` otherwise)."""
        if not isinstance(function, types.FunctionType):
            return None
        ours = function.__module__ == self.home and function.__name__ == self.function
        if not ours and self.hook is not None:
            hook = getattr(sys.modules[self.home], self.hook)
            ours = any(_holds(cell, hook) for cell in function.__closure__ or ())
        if not ours:
            return None
        wrapped = getattr(function, "__wrapped__", None)
        return wrapped if callable(wrapped) else None


def _holds(cell: types.CellType, value: object) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def register_lacking(spec: BackendSpec) -> bool:
    """Register an engine backend's ``spec`` unless attnres has a spec or an alias
    for its name by now (another thread may have registered it meanwhile)."""
    if not lacks(spec.name):
        return False
    register_backend(spec)
    return True


def lacks(name: str) -> bool:
    """Whether attnres has neither a spec nor an alias for an engine's backend
    ``name`` (attnres folds SGLang's ``fa2`` into its ``fa``)."""
    if lookup_spec(Backend(name)) is not None:
        return False
    try:
        Backend.parse(name)
    except ValueError:
        return True
    return False


# -- observing the engine's platform ----------------------------------------------

#: a platform as the plugins record it: (kind, compute capability, device name)
PlatformFacts = tuple[str, tuple[int, int] | None, str]
_CPU: PlatformFacts = ("cpu", None, "")


@define(eq=False)
class PlatformReader:
    """attnres's facts of an engine's current platform object (read at every
    decision: a test may swap it): its kind (``cpu`` when it cannot say), and,
    with ``details``, the compute capability and device name a CUDA platform
    states (recorded in the trace; the engine profiles decide from the observed
    answers, never from them). Read again only when the object or its device
    type changes."""

    #: the engine's platforms module and its current-platform attribute
    module: str
    attribute: str
    #: the engine's device types as attnres's platform kinds (any other: ``cpu``)
    kinds: Mapping[str, str]
    details: bool = False
    #: (the platform object, its device type, its facts) last read
    _last: tuple[Any, Any, PlatformFacts] = (None, None, _CPU)

    def __call__(self) -> PlatformFacts:
        try:
            module = sys.modules.get(self.module) or importlib.import_module(self.module)
            platform = getattr(module, self.attribute)
            device = getattr(platform, "device_type", "cpu")
            kind = self.kinds.get(str(device or "cpu"), "cpu")
        except Exception:  # a platform that cannot say is observed through its answers only
            return _CPU
        last = self._last
        if last[0] is platform and last[1] == device:
            return last[2]
        capability: tuple[int, int] | None = None
        name = ""
        if self.details and kind == "cuda":
            with contextlib.suppress(Exception):  # a platform that cannot say states nothing
                major, minor = platform.get_device_capability()
                capability = (int(major), int(minor))
            with contextlib.suppress(Exception):
                name = str(platform.get_device_name())
        facts = (kind, capability, name)
        self._last = (platform, device, facts)
        return facts


# -- the decision on observed answers ---------------------------------------------


def unobserved(trace: Trace, observed: Mapping[str, HostResolution]) -> str | None:
    """The candidate the decision consulted without an observed fact, if any
    (``""``: the platform's own default)."""
    for record in trace.records:
        if isinstance(record, CheckRecord):
            if not record.passed and any(f.message == UNOBSERVED for f in record.failures):
                name = record.candidate.name
                return name if name not in observed else None
        elif (
            isinstance(record, TransitionRecord)
            and record.event is Event.CANDIDATE_FAILED
            and record.candidate is None
            and "" not in observed
        ):
            return ""
    return None


def decide(
    layer: LayerSpec,
    config: SelectionConfig,
    scope: ScopeState | None,
    requested: Backend | None,
    platform: PlatformFacts,
    observed: dict[str, HostResolution],
    observe: Callable[[str], None],
) -> tuple[Decision, int]:
    """The decision on the engine's platform answers in ``observed``: the pure
    machine runs on the facts observed so far; each candidate it consulted
    without one is observed (``observe(name)`` adds its fact) and it runs again.
    The run that consulted only observed facts is the decision: it is handed to
    the resolver's cache as it is (traced, cached and audited there), not run
    again. Not recorded: the plugin records it. Returns it with the registry
    generation it was decided in (a memo of it belongs to that one)."""
    kind, capability, device_name = platform
    # The machine consults the profile's first request (or the platform's own
    # pick) always: observe it before the first run, one run fewer
    first = requested_by(
        PROFILES[config.profile], TraceInput(layer, config, scope, Platform(kind), requested)
    )[1]
    if (first_name := "" if first is None else first.name) not in observed:
        observe(first_name)
    while True:
        generation = registry_generation()
        host = Platform(
            kind, capability=capability, device_name=device_name, host=tuple(observed.values())
        )
        trace = run_machine(TraceInput(layer, config, scope, host, requested))
        pending = unobserved(trace, observed)
        if pending is None:
            return lookup_traced(trace, generation)[1], generation
        observe(pending)
