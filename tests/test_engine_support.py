"""A serving engine's plugin refuses typed where it was not written for (issues 32, 36).

Without SGLang: the engine's modules are small stand-ins in ``sys.modules`` and
its installed release is what ``importlib.metadata`` is made to say. Each case
is one SGLang release the issue names: 0.5.21 (no ``AttentionRole``, no
context ``backend_by_role``: the plugin used to install silently and fail on
every selector call), 0.5.20 (no ``multimodal_gen`` plugin loader), none at all
(``install()`` was a bare ``ModuleNotFoundError``). SGLang's real release is
checked in ``tests/sglang/test_attnres_plugin.py`` (make test-sglang). The
plugins' shared takeover and platform reader (``attnres.integrations._engine``)
are checked here too.
"""

from __future__ import annotations

import importlib.metadata
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest

from attnres.errors import AttnresError, EngineSupportError
from attnres.integrations import _engine
from attnres.integrations import sglang as plugin

SUPPORTED = "sglang>=0.5.23,<0.6"


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No module of SGLang's in this process (a stand-in is added per test)."""
    for name in list(sys.modules):
        if name == "sglang" or name.startswith("sglang."):
            monkeypatch.delitem(sys.modules, name)
    yield


def _version(monkeypatch: pytest.MonkeyPatch, release: str | None) -> None:
    real = importlib.metadata.version

    def version(distribution: str) -> str:
        if distribution != "sglang":
            return real(distribution)
        if release is None:
            raise importlib.metadata.PackageNotFoundError(distribution)
        return release

    monkeypatch.setattr(importlib.metadata, "version", version)


def _sglang(monkeypatch: pytest.MonkeyPatch, *, roles: bool, loader: bool) -> None:
    """Stand-ins for the SGLang modules the plugin reads: ``roles`` as in 0.5.23
    (``AttentionRole``, the context's ``backend_by_role``), ``loader`` a
    ``multimodal_gen`` plugin loader (none before 0.5.21)."""

    class Context(NamedTuple):
        backend: Any
        component_name: Any
        allow_global_backend_fallback: bool = False
        require_backend_selection: bool = False

    selector: dict[str, Any] = {
        name: (lambda *a, **k: None)
        for name in (
            "get_attn_backend",
            "_cached_get_attn_backend",
            "get_global_server_args",
            "get_component_attn_backend_context",
            "get_global_forced_attn_backend",
            "get_component_attn_backend_name",
            "make_component_role_key",
            "_record_component_attn_backend",
        )
    }
    selector.update(
        component_attn_backend_context=None,
        forced_attn_backend=None,
        ServerArgs=object,
        AttentionBackendEnum=object,
        AttentionRequirements=object,
        logger=object(),
        ComponentAttnBackendContext=Context,
    )
    if roles:
        selector["AttentionRole"] = types.SimpleNamespace(SELF="self", CROSS="cross")
        selector["ComponentAttnBackendContext"] = NamedTuple(  # type: ignore[misc]
            "Context",
            [(f, Any) for f in (*Context._fields, "backend_by_role")],
        )
    modules: dict[str, dict[str, Any]] = {
        "sglang": {},
        "sglang.multimodal_gen": {},
        "sglang.multimodal_gen.runtime": {},
        "sglang.multimodal_gen.runtime.platforms": {
            "AttentionBackendEnum": object,
            "current_platform": object(),
        },
        "sglang.multimodal_gen.runtime.layers": {},
        "sglang.multimodal_gen.runtime.layers.attention": {},
        "sglang.multimodal_gen.runtime.layers.attention.selector": selector,
        "sglang.multimodal_gen.runtime.layers.attention.backends": {},
        "sglang.multimodal_gen.runtime.layers.attention.backends.attention_backend": {
            "AttentionBackend": object
        },
    }
    if loader:
        modules["sglang.multimodal_gen.runtime.platforms.plugins"] = {
            "HookRegistry": object,
            "HookType": types.SimpleNamespace(AROUND="around"),
        }
    else:  # an import of it fails, as on 0.5.20
        monkeypatch.setitem(sys.modules, "sglang.multimodal_gen.runtime.platforms.plugins", None)
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        vars(module).update(attributes)
        monkeypatch.setitem(sys.modules, name, module)


def test_rule_sglang_install_without_sglang_is_typed_and_names_the_extra(
    no_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _version(monkeypatch, None)
    monkeypatch.setitem(sys.modules, "sglang", None)  # not importable
    with pytest.raises(EngineSupportError) as caught:
        plugin.install()
    error = caught.value
    assert isinstance(error, AttnresError) and isinstance(error, ImportError)
    assert error.engine == "SGLang" and error.version is None
    assert error.supported == ">=0.5.23,<0.6"
    message = str(error)
    assert message.startswith("attnres.integrations.sglang.install(): SGLang is not installed")
    assert f"pip install 'attnres[sglang]' ({SUPPORTED})" in message
    assert not plugin.installed()


@pytest.mark.parametrize("entry", ["install", "plugin"])
def test_rule_sglang_0_5_21_is_refused_before_anything_changes(
    no_engine: None, monkeypatch: pytest.MonkeyPatch, entry: str
) -> None:
    # 0.5.21 has the plugin loader but neither AttentionRole nor backend_by_role:
    # the plugin used to install, then every selector call raised AttributeError
    _version(monkeypatch, "0.5.21")
    _sglang(monkeypatch, roles=False, loader=True)
    selector = sys.modules["sglang.multimodal_gen.runtime.layers.attention.selector"]
    before = selector.get_attn_backend
    with pytest.raises(EngineSupportError) as caught:
        getattr(plugin, entry)()
    message = str(caught.value)
    assert f"SGLang 0.5.21 is not a release the attnres plugin was written for ({SUPPORTED})" in (
        message
    )
    assert caught.value.version == "0.5.21"
    assert selector.get_attn_backend is before and not plugin.installed()


def test_rule_sglang_0_5_20_without_plugin_loader_is_refused(
    no_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _version(monkeypatch, "0.5.20")
    _sglang(monkeypatch, roles=False, loader=False)
    with pytest.raises(EngineSupportError) as caught:
        plugin.plugin()
    message = str(caught.value)
    assert "SGLang 0.5.20 has no module sglang.multimodal_gen.runtime.platforms.plugins" in message
    assert SUPPORTED in message


def test_rule_sglang_release_in_range_lacking_a_hook_is_refused_naming_it(
    no_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a build that says 0.5.23 but has 0.5.21's selector: the hooks are checked too
    _version(monkeypatch, "0.5.23.post1")
    _sglang(monkeypatch, roles=False, loader=True)
    with pytest.raises(EngineSupportError) as caught:
        plugin.install()
    message = str(caught.value)
    assert "SGLang 0.5.23.post1 lacks what the attnres plugin reads" in message
    assert "selector.AttentionRole.SELF" in message
    assert "selector.ComponentAttnBackendContext.backend_by_role" in message
    assert not plugin.installed()


def test_rule_sglang_supported_release_with_every_hook_passes_the_check(
    no_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _version(monkeypatch, "0.5.23")
    _sglang(monkeypatch, roles=True, loader=True)
    modules = _engine.require(plugin.ENGINE, "check")
    assert set(modules) == set(plugin.ENGINE.hooks)


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.5.23", (0, 5, 23)), ("0.5.23.post1", (0, 5, 23)), ("0.6.0rc1", (0, 6, 0)), ("x", None)],
)
def test_rule_engine_release_reads_the_numeric_part(
    version: str, release: tuple[int, ...] | None
) -> None:
    assert _engine.release(version) == release


SELECTOR = "sglang.multimodal_gen.runtime.layers.attention.selector"


def test_rule_sglang_takeover_is_given_back_in_every_module_however_it_was_put_in_place(
    no_engine: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _version(monkeypatch, "0.5.23")
    _sglang(monkeypatch, roles=True, loader=True)
    monkeypatch.setattr(
        sys.modules["sglang.multimodal_gen.runtime.platforms"], "AttentionBackendEnum", ()
    )
    registry = types.SimpleNamespace(_hooks={}, _patched=set())
    plugins = sys.modules["sglang.multimodal_gen.runtime.platforms.plugins"]
    monkeypatch.setattr(plugins, "HookRegistry", registry)
    selector = sys.modules[SELECTOR]
    own = selector.get_attn_backend
    user = types.ModuleType("a_model_module")  # bound it by name: from selector import ...
    user.get_attn_backend = own  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, user.__name__, user)
    # install(): attnres's wrapper is bound everywhere, once
    plugin.install()
    try:
        wrapper = selector.get_attn_backend
        assert plugin.installed() and wrapper is not own and user.get_attn_backend is wrapper
        plugin.install()
        assert selector.get_attn_backend is wrapper
    finally:
        plugin.uninstall()
    assert not plugin.installed() and selector.get_attn_backend is own
    assert user.get_attn_backend is own
    # SGLang's hook registry wraps the plugin's hook itself: its wrapper is
    # recognised by the hook in its closure, and the hook leaves the registry
    hook = plugin._route

    def around(*args: Any, **kwargs: Any) -> Any:
        return hook(own, *args, **kwargs)

    around.__wrapped__ = own  # type: ignore[attr-defined]
    registry._hooks[plugin.TARGET] = [("around", hook)]
    registry._patched.add(plugin.TARGET)
    selector.get_attn_backend = user.get_attn_backend = around
    assert plugin.installed()
    plugin.uninstall()
    assert selector.get_attn_backend is own and user.get_attn_backend is own
    assert registry._hooks == {} and registry._patched == set()


def test_rule_platform_reader_maps_the_engine_device_and_reads_cuda_details_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []

    class Musa:
        device_type = "musa"

        def get_device_capability(self) -> tuple[int, int]:
            asked.append("capability")
            return (9, 0)

        def get_device_name(self) -> str:
            return "H100"

    module = types.ModuleType("an_engine_platforms")
    module.current = Musa()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    read = _engine.PlatformReader(module.__name__, "current", {"musa": "cuda"}, details=True)
    assert read() == read() == ("cuda", (9, 0), "H100") and asked == ["capability"]
    assert _engine.PlatformReader(module.__name__, "current", {"musa": "cuda"})() == (
        "cuda",
        None,
        "",
    )
    module.current = types.SimpleNamespace(device_type="tpu")  # type: ignore[attr-defined]
    assert read() == ("cpu", None, "")
    del module.current  # type: ignore[attr-defined]
    assert read() == ("cpu", None, "")
