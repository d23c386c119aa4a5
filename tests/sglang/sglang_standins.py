"""Stand-ins for ``triton`` and ``torchvision`` while SGLang's unit tests run on CPU.

Loaded as a pytest plugin by ``make test-sglang`` (``-p sglang_standins``),
never by ``make test``. SGLang imports ``triton`` at module level in many
files and ``torchvision`` in a few; neither is needed by the attention
selection tests, and installing either pulls a CUDA torch. SGLang's own
``sglang/_platform_stubs.py`` does the same for ``triton`` on macOS (a
meta-path finder serving placeholder modules); this is a small independent
version for Linux CPU. Real packages win: a stand-in is installed only when
the package cannot be found.

``ATTNRES_SGLANG_PLUGIN=1`` additionally activates SGLang's plugin lifecycle
(``load_plugins()`` then ``apply_plugin_hooks()``, as SGLang's worker
bootstrap does) before the first test, so the attnres plugin, discovered
through its entry point, is in place for every test of the session.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any, ClassVar

_STANDIN_PACKAGES = tuple(os.environ.get("SGLANG_STANDINS", "triton,torchvision").split(","))


class _Placeholder:
    """Subclassable, callable, falsy: what kernel definitions need at import."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs


class _StandIn(types.ModuleType):
    """A package whose attributes are sub-stand-ins (classes for CamelCase names)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.__path__: list[str] = []
        self.__spec__ = importlib.machinery.ModuleSpec(name, _Finder, is_package=True)
        self.__file__ = __file__

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr[:1].isupper():
            value: Any = type(attr, (_Placeholder,), {"__module__": self.__name__})
        else:
            value = _module(f"{self.__name__}.{attr}")
        setattr(self, attr, value)
        return value

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # ``@triton.jit`` and ``@triton.jit(...)``: the function is kept as written
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn

    def __bool__(self) -> bool:
        return False


def _module(name: str) -> _StandIn:
    existing = sys.modules.get(name)
    if isinstance(existing, _StandIn):
        return existing
    mod = _StandIn(name)
    sys.modules[name] = mod
    parent, _, child = name.rpartition(".")
    if parent and isinstance(sys.modules.get(parent), _StandIn):
        setattr(sys.modules[parent], child, mod)
    return mod


class _Finder:
    """Serves ``import triton.x.y`` for the packages stood in."""

    roots: ClassVar[set[str]] = set()

    @classmethod
    def find_spec(cls, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.partition(".")[0] not in cls.roots:
            return None
        return _module(fullname).__spec__

    @classmethod
    def create_module(cls, spec: Any) -> Any:
        return sys.modules[spec.name]

    @classmethod
    def exec_module(cls, module: Any) -> None:
        return None


def _fill_triton(triton: _StandIn) -> None:
    triton.__version__ = "3.0.0"  # type: ignore[attr-defined]
    triton.cdiv = lambda a, b: -(a // -b)  # type: ignore[attr-defined]
    triton.next_power_of_2 = lambda n: 1 << (n - 1).bit_length() if n > 0 else 1  # type: ignore[attr-defined]
    # torch's Inductor imports these exception classes by name
    autotuner = _module("triton.runtime.autotuner")
    autotuner.OutOfResources = type("OutOfResources", (Exception,), {})  # type: ignore[attr-defined]
    autotuner.PTXASError = type("PTXASError", (Exception,), {})  # type: ignore[attr-defined]
    _module("triton.runtime.cache").triton_key = lambda: "triton-standin"  # type: ignore[attr-defined]
    _module("triton.compiler.compiler").triton_key = lambda: "triton-standin"  # type: ignore[attr-defined]
    lang = _module("triton.language")
    lang.constexpr = type("constexpr", (_Placeholder,), {})  # type: ignore[attr-defined]


def _fill_torchvision(tv: _StandIn) -> None:
    tv.__version__ = "0.0.0+standin"  # type: ignore[attr-defined]
    # transformers' image utilities map PIL's resampling names onto this enum
    modes = ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")
    _module("torchvision.transforms").InterpolationMode = enum.Enum(  # type: ignore[attr-defined]
        "InterpolationMode", {m.upper().replace("-", "_"): m for m in modes}
    )


def install() -> list[str]:
    """Install the stand-ins for the packages that are not installed; returns their names."""
    missing = [
        name
        for name in _STANDIN_PACKAGES
        if name not in sys.modules and importlib.util.find_spec(name) is None
    ]
    if not missing:
        return []
    _Finder.roots.update(missing)
    sys.meta_path.insert(0, _Finder)  # type: ignore[arg-type]
    for name in missing:
        root = _module(name)
        {"triton": _fill_triton, "torchvision": _fill_torchvision}[name](root)
    return missing


STOOD_IN = install()


def pytest_report_header(config: Any) -> str:
    plugin = "on" if os.environ.get("ATTNRES_SGLANG_PLUGIN") == "1" else "off"
    return f"sglang stand-ins: {', '.join(STOOD_IN) or 'none'}; attnres plugin: {plugin}"


def pytest_configure(config: Any) -> None:
    if os.environ.get("ATTNRES_SGLANG_PLUGIN") != "1":
        return
    # what SGLang's worker bootstrap does: discover plugins, then apply hooks
    from sglang.multimodal_gen.runtime.platforms.plugins import apply_plugin_hooks, load_plugins

    load_plugins()
    apply_plugin_hooks()
    from attnres.integrations import sglang as plugin

    if not plugin.installed():
        raise RuntimeError("the attnres SGLang plugin did not take over the selector")


_VERDICT: list[str] = []


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    """With the plugin: every selector call was decided by attnres, is in
    ``attnres.decisions()`` and replays; otherwise the session fails."""
    if os.environ.get("ATTNRES_SGLANG_PLUGIN") != "1":
        return
    import attnres
    from attnres.integrations import sglang as plugin

    decisions = attnres.decisions()
    replayed = sum(attnres.replay(d.trace).ok for d in decisions)
    stats = plugin.stats()
    _VERDICT.append(
        f"attnres plugin: {stats['decided']} selector calls decided by attnres, "
        f"{stats['delegated']} delegated to SGLang; {len(decisions)} in attnres.decisions(), "
        f"{replayed} replay identically; installed at the end: {plugin.installed()}"
    )
    # uninstall() restores SGLang's own selector in every module that bound it
    plugin.uninstall()
    stale = [
        f"{m.__name__}.{name}"
        for m in list(sys.modules.values())
        if isinstance(m, types.ModuleType)
        for name, value in list(vars(m).items())
        if callable(value) and plugin._TAKEOVER.original(value) is not None
    ]
    restored = not plugin.installed() and not stale
    if stale:
        _VERDICT.append(f"attnres plugin: still bound after uninstall(): {', '.join(stale)}")
    _VERDICT.append(f"attnres plugin: uninstall() restored SGLang's selector: {restored}")
    complete = (
        stats["decided"] > 0
        and stats["delegated"] == 0
        and len(decisions) == stats["decided"]
        and replayed == len(decisions)
        and restored
    )
    if not complete and session.exitstatus == 0:
        session.exitstatus = 1
        _VERDICT.append("attnres plugin: FAILED (a call was not decided, recorded or replayed)")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for line in _VERDICT:
        terminalreporter.write_line(line)
