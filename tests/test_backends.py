"""The backend catalogue, names and aliases, the registry and plugin loading."""

from __future__ import annotations

import contextlib
import importlib.metadata
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import attnres
from attnres import backends as B
from attnres._vocab import DTYPES, PLATFORM_KINDS, Requirement
from attnres.backends import (
    ENTRY_POINT_GROUP,
    Backend,
    BackendSpec,
    CapabilityRule,
    HeadSizeRule,
    get_spec,
    plugin_failures,
    register_backend,
    registered_backends,
    reload_plugins,
    unregister_backend,
)
from attnres.errors import PluginError, UnknownBackendError
from attnres.platform import KNOWN_PACKAGES

R = Requirement

#: SPEC 2a: name -> (sparse?, platform kinds it runs on, kernel package or None).
SPEC_TABLE: dict[str, tuple[bool, frozenset[str], str | None]] = {
    "torch_sdpa": (False, frozenset(PLATFORM_KINDS), None),
    "eager": (False, frozenset(PLATFORM_KINDS), None),
    "torch_cudnn_sdpa": (False, frozenset({"cuda"}), None),
    "dynamic_cudnn_sdpa": (False, frozenset({"cuda"}), None),
    "flex_attention": (False, frozenset({"cpu", "cuda"}), None),
    "fa": (False, frozenset({"cuda", "rocm"}), "flash_attn"),
    "fa3": (False, frozenset({"cuda"}), "flash_attn_interface"),
    "fa4": (False, frozenset({"cuda"}), "flash_attn_4"),
    "sage_attn": (False, frozenset({"cuda"}), "sageattention"),
    "sage_attn_3": (False, frozenset({"cuda"}), "sageattn3"),
    "xformers": (False, frozenset({"cuda"}), "xformers"),
    "aiter": (False, frozenset({"rocm"}), "aiter"),
    "ascend_fa": (False, frozenset({"npu"}), "torch_npu"),
    "sliding_tile_attn": (True, frozenset({"cuda"}), "fastvideo_kernel"),
    "video_sparse_attn": (True, frozenset({"cuda"}), "fastvideo_kernel"),
    "vmoba_attn": (True, frozenset({"cuda"}), "fastvideo_kernel"),
    "sparse_video_gen_2_attn": (True, frozenset({"cuda"}), "svg"),
}

HOPPER, BLACKWELL = (9, 0), (10, 0)


def _spec(name: str, **kw: object) -> BackendSpec:
    base: dict[str, object] = {
        "name": name,
        "sparse": False,
        "platforms": ("cpu",),
        "dtypes": ("float32",),
    }
    base.update(kw)
    return BackendSpec(**base)  # type: ignore[arg-type]


def _cap_allows(rule: CapabilityRule, cap: tuple[int, int]) -> bool:
    """A CapabilityRule's documented meaning: inclusive range and/or explicit set."""
    if rule.exact is not None and cap not in rule.exact:
        return False
    if rule.min is not None and cap < rule.min:
        return False
    return not (rule.max is not None and cap > rule.max)


def _registry_snapshot() -> tuple[tuple[str, ...], tuple[str, ...]]:
    specs = registered_backends()
    return tuple(s.name for s in specs), tuple(sorted(B._REGISTRY._aliases))


# -- fixtures -----------------------------------------------------------------


@pytest.fixture
def registered() -> Iterator[list[str]]:
    """Names appended here are unregistered after the test (if still there)."""
    before = _registry_snapshot()
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(UnknownBackendError):
            unregister_backend(name)
    assert _registry_snapshot() == before


class _FakeEP:
    """The part of importlib.metadata.EntryPoint the registry uses."""

    def __init__(self, name: str, value: str, load: Callable[[], object]) -> None:
        self.name, self.value, self.group = name, value, ENTRY_POINT_GROUP
        self._load = load

    def load(self) -> object:
        return self._load()


def _returns(obj: object) -> Callable[[], object]:
    return lambda: obj


_REAL_ENTRY_POINTS = importlib.metadata.entry_points


def _our_group(make: Callable[[], list[object]]) -> Callable[..., object]:
    """An ``entry_points()`` that answers the ``attnres.backends`` group with
    ``make()`` and every other query (torch asks for its own) for real."""

    def entry_points(**kw: object) -> object:
        if kw.get("group") == ENTRY_POINT_GROUP:
            return make()
        return _REAL_ENTRY_POINTS(**kw)  # type: ignore[arg-type]

    return entry_points


@pytest.fixture
def plugins() -> Iterator[Callable[..., tuple[B.PluginFailure, ...]]]:
    """``plugins(ep, ...)`` makes those the ``attnres.backends`` entry points and
    reloads; afterwards the real entry points are reloaded."""
    real = reload_plugins()
    before = _registry_snapshot()
    mp = pytest.MonkeyPatch()

    def install(*eps: object) -> tuple[B.PluginFailure, ...]:
        mp.setattr(importlib.metadata, "entry_points", _our_group(lambda: list(eps)))
        return reload_plugins()

    yield install
    mp.undo()
    assert reload_plugins() == real
    assert _registry_snapshot() == before


# -- parsing ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("SAGE_ATTN", "sage_attn"),
        (" Fa ", "fa"),
        ("fa", "fa"),
        ("Torch_SDPA", "torch_sdpa"),
        ("sdpa", "torch_sdpa"),
        ("SDPA", "torch_sdpa"),
        ("flash_attn", "fa"),
        ("flash-attn", "fa"),
        ("flash_attention_2", "fa"),
        ("Flash-Attention-2", "fa"),
        ("sage-attn", "sage_attn"),
        ("sliding-tile-attn", "sliding_tile_attn"),
        ("\tvideo_sparse_attn\n", "video_sparse_attn"),
    ],
)
def test_parse_is_case_insensitive_and_knows_aliases(text: str, name: str) -> None:
    b = Backend.parse(text)
    assert b == Backend(name)
    assert b.name == name
    assert str(b) == name


def test_parse_returns_a_backend_unchanged_and_rejects_non_strings() -> None:
    b = Backend("fa")
    assert Backend.parse(b) is b
    with pytest.raises(TypeError, match="Backend or a str"):
        Backend.parse(3)  # type: ignore[arg-type]


def test_backend_is_hashable_and_reprs_its_name() -> None:
    assert {Backend.parse("sdpa"), Backend.parse("torch_sdpa")} == {Backend("torch_sdpa")}
    assert repr(Backend("fa")) == "Backend('fa')"


def test_public_surface_exports_backend() -> None:
    assert attnres.Backend is Backend
    assert attnres.UnknownBackendError is UnknownBackendError


@pytest.mark.parametrize(
    ("text", "suggestion"),
    [("sage_atn", "sage_attn"), ("flash_atn", "fa"), ("torch_sdp", "torch_sdpa"), ("FA_3", "fa3")],
)
def test_unknown_name_lists_valid_names_and_suggests_the_closest(
    text: str, suggestion: str
) -> None:
    with pytest.raises(UnknownBackendError) as info:
        Backend.parse(text)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.name == text
    assert err.suggestion == suggestion
    msg = str(err)
    assert repr(text) in msg
    assert f"Did you mean {suggestion!r}?" in msg
    for name in SPEC_TABLE:
        assert name in msg


def test_unknown_name_far_from_everything_has_no_suggestion() -> None:
    with pytest.raises(UnknownBackendError) as info:
        Backend.parse("qqqqqqqqqqqqqqqqq")
    assert info.value.suggestion is None
    assert "Did you mean" not in str(info.value)
    assert "Valid backends: " in str(info.value)


@pytest.mark.parametrize("text", ["", "   ", "fa fa", "no_such_backend"])
def test_unknown_or_empty_names_raise(text: str) -> None:
    with pytest.raises(UnknownBackendError):
        Backend.parse(text)


# -- the catalogue (SPEC 2a) --------------------------------------------------


def test_every_spec_table_name_is_registered_with_kind_platforms_and_package() -> None:
    for name, (sparse, kinds, package) in SPEC_TABLE.items():
        spec = get_spec(name)
        assert spec.name == name
        assert spec.sparse is sparse, name
        assert spec.kind == ("sparse" if sparse else "dense"), name
        assert Backend(name).is_sparse is sparse, name
        assert spec.platforms == kinds, name
        assert spec.package == package, name
        assert spec.backend == Backend(name)
        assert Backend(name).spec is spec


def test_builtins_come_first_in_registration_order() -> None:
    names = [s.name for s in registered_backends()]
    assert names[: len(B.BUILTIN_SPECS)] == [s.name for s in B.BUILTIN_SPECS]
    assert set(SPEC_TABLE) <= set(names)


def test_sparse_backends_are_exactly_the_four_sparse_kernels() -> None:
    builtin = {s.name for s in B.BUILTIN_SPECS}
    sparse = {s.name for s in B.BUILTIN_SPECS if s.sparse}
    assert sparse == {
        "sliding_tile_attn",
        "video_sparse_attn",
        "vmoba_attn",
        "sparse_video_gen_2_attn",
    }
    assert builtin == set(SPEC_TABLE)


def test_catalogue_requirement_facts() -> None:
    sage, fa = get_spec("sage_attn"), get_spec("fa")
    assert R.ATTN_MASK not in sage.implements
    assert R.ATTN_MASK not in fa.implements
    assert R.PACKED_VARLEN in fa.implements
    sdpa = get_spec("torch_sdpa")
    assert {R.CAUSAL, R.ATTN_MASK, R.GQA, R.DROPOUT} <= sdpa.implements
    assert {R.CAUSAL, R.ATTN_MASK} <= get_spec("eager").implements
    for spec in B.BUILTIN_SPECS:
        assert all(isinstance(r, Requirement) for r in spec.implements)


def test_satisfies_groups() -> None:
    assert frozenset({"torch_sdpa"}) in get_spec("torch_cudnn_sdpa").satisfies
    assert frozenset({"fa", "torch_sdpa"}) in get_spec("dynamic_cudnn_sdpa").satisfies
    # dynamic_cudnn_sdpa stands in for both, never for one of them alone
    assert frozenset({"fa"}) not in get_spec("dynamic_cudnn_sdpa").satisfies
    assert frozenset({"torch_sdpa"}) not in get_spec("dynamic_cudnn_sdpa").satisfies
    assert get_spec("torch_sdpa").satisfies == ()


def test_torch_sdpa_and_eager_run_everywhere_without_a_package() -> None:
    for name in ("torch_sdpa", "eager"):
        spec = get_spec(name)
        assert spec.platforms == frozenset(PLATFORM_KINDS)
        assert spec.package is None
        assert spec.capabilities == {}
        assert {"float16", "bfloat16", "float32"} <= spec.dtypes


def test_every_package_is_a_known_probe() -> None:
    probes = {p.name for p in KNOWN_PACKAGES}
    for spec in B.BUILTIN_SPECS:
        for package in spec.packages:
            assert package in probes, (spec.name, package)


def test_every_builtin_spec_is_well_formed() -> None:
    seen: set[str] = set()
    for spec in B.BUILTIN_SPECS:
        assert spec.dtypes and spec.dtypes <= set(DTYPES), spec.name
        assert spec.platforms, spec.name
        assert set(spec.capabilities) <= spec.platforms, spec.name
        names = {spec.name, *(B._key(a) for a in spec.aliases)}
        assert not names & seen, f"{spec.name} shares a name or alias"
        seen |= names
        for group in spec.satisfies:
            assert group <= set(SPEC_TABLE), spec.name


def test_hardware_generations_in_the_table() -> None:
    def cuda(name: str) -> CapabilityRule:
        return get_spec(name).capabilities.get("cuda", CapabilityRule())

    for name in ("fa3", "sliding_tile_attn", "video_sparse_attn"):  # Hopper
        assert _cap_allows(cuda(name), HOPPER), name
    assert _cap_allows(cuda("fa4"), HOPPER)
    assert _cap_allows(cuda("fa4"), BLACKWELL)
    assert not _cap_allows(cuda("sage_attn_3"), HOPPER)
    assert not _cap_allows(cuda("fa3"), (8, 0))
    assert _cap_allows(cuda("fa"), (8, 0))
    assert not _cap_allows(cuda("fa"), (7, 5))


def test_capability_helper_agrees_with_rule_semantics() -> None:
    assert _cap_allows(CapabilityRule(), (7, 0))
    assert not _cap_allows(CapabilityRule(exact={(9, 0)}), (8, 0))
    assert _cap_allows(CapabilityRule(min=(8, 0), max=(9, 0)), (9, 0))
    assert not _cap_allows(CapabilityRule(min=(8, 0), max=(9, 0)), (10, 0))


# -- rules --------------------------------------------------------------------


def test_head_size_rule_collects_every_failure() -> None:
    rule = HeadSizeRule(min=16, max=128, multiple_of=8, power_of_two=True)
    assert rule.failures(64) == []
    fails = rule.failures(260)
    assert any("exceeds the maximum 128" in f for f in fails)
    assert any("not a multiple of 8" in f for f in fails)
    assert any("not a power of two" in f for f in fails)
    assert len(fails) == 3
    assert rule.failures(8) == ["head size 8 is below the minimum 16"]
    assert rule.failures(24) == ["head size 24 is not a power of two"]


def test_head_size_rule_allowed_set() -> None:
    rule = HeadSizeRule(allowed={64, 128})
    assert rule.allowed == frozenset({64, 128})
    assert rule.failures(64) == []
    assert rule.failures(96) == ["head size 96 is not one of [64, 128]"]
    assert rule.describe() == "{64, 128}"


def test_head_size_rule_describe() -> None:
    assert HeadSizeRule().describe() == "any"
    assert HeadSizeRule().failures(1) == []
    assert HeadSizeRule().failures(10_000) == []
    assert HeadSizeRule(max=256).describe() == "<= 256"
    assert HeadSizeRule(max=128, multiple_of=8).describe() == "<= 128, multiple of 8"
    assert HeadSizeRule(min=16, power_of_two=True).describe() == ">= 16, power of two"


def test_capability_rule_describe() -> None:
    assert CapabilityRule().describe() == "any"
    assert CapabilityRule(exact={(9, 0), (8, 0)}).describe() == "sm80/90"
    assert CapabilityRule(min=(8, 0)).describe() == ">= sm80"
    assert CapabilityRule(min=(8, 0), max=(12, 1)).describe() == "sm80-sm121"
    assert CapabilityRule(archs=["gfx950", "gfx942"]).describe() == "gfx942/gfx950"
    assert CapabilityRule(archs=["gfx942"]).archs == frozenset({"gfx942"})


# -- BackendSpec validation ---------------------------------------------------


@pytest.mark.parametrize(
    "name", ["", "Fa", "my-attn", "my attn", "caf\u00e9", "_", "fa!", "\u0661\u0662"]
)
def test_spec_rejects_bad_names(name: str) -> None:
    with pytest.raises(ValueError, match="backend name must be lower-case letters"):
        _spec(name)


@pytest.mark.parametrize("name", ["my_attn", "fa5", "x", "_private_2"])
def test_spec_accepts_good_names(name: str) -> None:
    assert _spec(name).name == name


def test_spec_rejects_unknown_platform_kind() -> None:
    with pytest.raises(ValueError, match=r"unknown platform kinds \['gpu'\]"):
        _spec("my_attn", platforms=("cpu", "gpu"))


def test_spec_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match=r"unknown dtype names \['float4'\]"):
        _spec("my_attn", dtypes=("float32", "float4"))


def test_spec_rejects_unknown_requirement() -> None:
    with pytest.raises(ValueError):
        _spec("my_attn", implements=("telepathy",))


def test_spec_converts_its_fields() -> None:
    spec = _spec(
        "my_attn",
        platforms=["cpu", "cuda"],
        implements=["causal", R.GQA],
        satisfies=[["torch_sdpa"]],
        sparse=True,
    )
    assert spec.platforms == frozenset({"cpu", "cuda"})
    assert spec.implements == frozenset({R.CAUSAL, R.GQA})
    assert spec.satisfies == (frozenset({"torch_sdpa"}),)
    assert spec.kind == "sparse"


# -- register_backend / unregister_backend ------------------------------------


def test_register_makes_a_custom_backend_parseable(registered: list[str]) -> None:
    spec = _spec("my_attn", aliases=("Mine", "my-alias"))
    registered.append("my_attn")
    with pytest.raises(UnknownBackendError):
        Backend.parse("my_attn")
    b = register_backend(spec)
    assert b == Backend("my_attn")
    for text in ("my_attn", "MY_ATTN", "my-attn", "mine", " MINE ", "my-alias", "my_alias"):
        assert Backend.parse(text) == b, text
    assert get_spec("mine") is spec
    assert registered_backends()[-1] is spec
    assert "my_attn" in str(B._REGISTRY.unknown("zzz"))
    unregister_backend("my_attn")
    for text in ("my_attn", "mine", "my-alias"):
        with pytest.raises(UnknownBackendError):
            Backend.parse(text)


def test_register_rejects_a_builtin_name(registered: list[str]) -> None:
    with pytest.raises(PluginError) as info:
        register_backend(_spec("fa"))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'fa'" in msg
    assert "already registered" in msg
    assert "built-in catalogue" in msg
    assert "replace=True" in msg
    assert get_spec("fa").package == "flash_attn"


@pytest.mark.parametrize(
    ("spec_kw", "name", "owner"),
    [
        ({"name": "my_attn", "aliases": ("sdpa",)}, "'sdpa'", "'torch_sdpa'"),
        ({"name": "my_attn", "aliases": ("Flash-Attn",)}, "'flash_attn'", "'fa'"),
        ({"name": "flash_attn"}, "'flash_attn'", "'fa'"),
    ],
)
def test_register_rejects_a_name_or_alias_of_another_backend(
    registered: list[str], spec_kw: dict[str, object], name: str, owner: str
) -> None:
    registered.append(str(spec_kw["name"]))
    spec = _spec(**spec_kw)  # type: ignore[arg-type]
    for replace in (False, True):
        with pytest.raises(PluginError) as info:
            register_backend(spec, replace=replace)
        msg = str(info.value)
        assert name in msg
        assert f"belongs to backend {owner}" in msg
    assert Backend.parse("sdpa") == Backend("torch_sdpa")
    assert Backend.parse("flash_attn") == Backend("fa")


def test_register_twice_raises_and_replace_true_replaces(registered: list[str]) -> None:
    registered.append("my_attn")
    first = _spec("my_attn", aliases=("mine",), description="v1")
    register_backend(first)
    with pytest.raises(PluginError, match=r"'my_attn' \(from register_backend\(\)\) is already"):
        register_backend(_spec("my_attn", description="v2"))
    assert get_spec("my_attn") is first
    order = B.catalogue_order(Backend("my_attn"))

    second = _spec("my_attn", aliases=("mine_v2",), description="v2")
    assert register_backend(second, replace=True) == Backend("my_attn")
    assert get_spec("my_attn") is second
    assert Backend.parse("mine_v2") == Backend("my_attn")
    with pytest.raises(UnknownBackendError):
        Backend.parse("mine")  # the old alias went with the old spec
    assert B.catalogue_order(Backend("my_attn")) == order
    assert [s.name for s in registered_backends()].count("my_attn") == 1


def test_register_rejects_non_specs() -> None:
    with pytest.raises(TypeError, match="takes a BackendSpec"):
        register_backend("fa")  # type: ignore[arg-type]


def test_unregister_unknown_name_raises(registered: list[str]) -> None:
    with pytest.raises(UnknownBackendError):
        unregister_backend("never_registered_attn")


def test_catalogue_order_is_unique_after_removals(registered: list[str]) -> None:
    registered.extend(["aaa_attn", "bbb_attn", "ccc_attn"])
    register_backend(_spec("aaa_attn"))
    register_backend(_spec("bbb_attn"))
    unregister_backend("aaa_attn")
    register_backend(_spec("ccc_attn"))
    orders = [B.catalogue_order(s.backend) for s in registered_backends()]
    assert len(set(orders)) == len(orders)
    assert B.catalogue_order(Backend("bbb_attn")) < B.catalogue_order(Backend("ccc_attn"))


# -- plugins ------------------------------------------------------------------


def _failure(failures: tuple[B.PluginFailure, ...], ep_name: str) -> B.PluginFailure:
    found = [f for f in failures if f.entry_point.startswith(f"{ep_name} = ")]
    assert len(found) == 1, failures
    return found[0]


def test_plugin_returning_a_spec_is_registered(plugins: Callable[..., object]) -> None:
    spec = _spec("plug_attn", aliases=("plug",))
    failures = plugins(
        _FakeEP("plug", "plugpkg:spec", _returns(spec)),
        _FakeEP("many", "plugpkg:many", _returns(lambda: [_spec("plug2_attn"), _spec("plug3")])),
    )
    assert failures == ()
    assert plugin_failures() == ()
    assert Backend.parse("PLUG") == Backend("plug_attn")
    assert get_spec("plug_attn") is spec
    assert Backend.parse("plug2_attn").name == "plug2_attn"
    assert Backend.parse("plug3").name == "plug3"
    assert {"plug_attn", "plug2_attn", "plug3"} <= {s.name for s in registered_backends()}
    # a plugin's backend is owned by it: a register_backend() of its name is refused
    with pytest.raises(PluginError, match=r"already registered by plugin plug = plugpkg:spec"):
        register_backend(_spec("plug_attn"))


def test_real_entry_point_objects_load(plugins: Callable[..., object]) -> None:
    mod = ModuleType("attnres_test_plugin_mod")
    mod.SPEC = _spec("ep_attn")  # type: ignore[attr-defined]
    sys.modules[mod.__name__] = mod
    try:
        ep = importlib.metadata.EntryPoint(
            name="ep", value=f"{mod.__name__}:SPEC", group=ENTRY_POINT_GROUP
        )
        assert plugins(ep) == ()
        assert Backend.parse("ep_attn").name == "ep_attn"
    finally:
        del sys.modules[mod.__name__]


@pytest.mark.parametrize(
    ("exc", "text"),
    [
        (ImportError("No module named 'triton'"), "ImportError: No module named 'triton'"),
        (RuntimeError("CUDA driver too old"), "RuntimeError: CUDA driver too old"),
        (SystemExit(3), "SystemExit: 3"),
        (OSError("libfoo.so: undefined symbol: _ZN3c10"), "OSError: libfoo.so: undefined"),
    ],
)
def test_plugin_failing_on_load_is_recorded_never_raised(
    plugins: Callable[..., tuple[B.PluginFailure, ...]], exc: BaseException, text: str
) -> None:
    def boom() -> object:
        raise exc

    good = _spec("good_attn")
    failures = plugins(
        _FakeEP("broken", "brokenpkg:spec", boom),
        _FakeEP("good", "goodpkg:spec", _returns(good)),
    )
    fail = _failure(failures, "broken")
    assert fail.entry_point == "broken = brokenpkg:spec"
    assert fail.error.startswith(text)
    assert plugin_failures() == failures
    assert len(failures) == 1
    assert get_spec("good_attn") is good  # one broken plugin does not stop the others
    # the failure is visible, and a later lookup does not retry or raise it
    with pytest.raises(UnknownBackendError):
        Backend.parse("broken")
    assert plugin_failures() == failures


def test_plugin_whose_callable_raises_is_recorded(
    plugins: Callable[..., tuple[B.PluginFailure, ...]],
) -> None:
    def factory() -> BackendSpec:
        raise RuntimeError("no GPU")

    failures = plugins(_FakeEP("factory", "pkg:factory", _returns(factory)))
    assert _failure(failures, "factory").error == "RuntimeError: no GPU"


def test_plugin_module_that_fails_to_import(
    plugins: Callable[..., tuple[B.PluginFailure, ...]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "attnres_test_bad_plugin.py").write_text(
        textwrap.dedent(
            """
            raise ImportError("libcudart.so.12: cannot open shared object file")
            """
        )
    )
    (tmp_path / "attnres_test_exit_plugin.py").write_text("import sys\nsys.exit(7)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    eps = [
        importlib.metadata.EntryPoint(name=n, value=f"{m}:SPEC", group=ENTRY_POINT_GROUP)
        for n, m in (
            ("bad", "attnres_test_bad_plugin"),
            ("exit", "attnres_test_exit_plugin"),
            ("absent", "attnres_test_no_such_module"),
        )
    ]
    failures = plugins(*eps)
    assert len(failures) == 3
    assert _failure(failures, "bad").error == (
        "ImportError: libcudart.so.12: cannot open shared object file"
    )
    assert _failure(failures, "exit").error == "SystemExit: 7"
    assert _failure(failures, "absent").error.startswith("ModuleNotFoundError: ")


def test_two_plugins_claiming_one_name(
    plugins: Callable[..., tuple[B.PluginFailure, ...]],
) -> None:
    one, two = _spec("twin_attn", description="one"), _spec("twin_attn", description="two")
    # registration is in sorted entry-point order, whatever order they are found in
    failures = plugins(
        _FakeEP("zzz_second", "pkg_b:spec", _returns(two)),
        _FakeEP("aaa_first", "pkg_a:spec", _returns(one)),
    )
    assert get_spec("twin_attn") is one
    fail = _failure(failures, "zzz_second")
    assert len(failures) == 1
    assert fail.error.startswith("PluginError: ")
    assert "'twin_attn'" in fail.error
    assert "plugin zzz_second = pkg_b:spec" in fail.error
    assert "already registered by plugin aaa_first = pkg_a:spec" in fail.error


def test_plugin_alias_colliding_with_a_builtin(
    plugins: Callable[..., tuple[B.PluginFailure, ...]],
) -> None:
    thief = _spec("thief_attn", aliases=("sdpa",))
    failures = plugins(_FakeEP("thief", "pkg:spec", _returns(thief)))
    assert "the name 'sdpa' already belongs to backend 'torch_sdpa'" in (
        _failure(failures, "thief").error
    )
    assert Backend.parse("sdpa") == Backend("torch_sdpa")
    with pytest.raises(UnknownBackendError):
        Backend.parse("thief_attn")


@pytest.mark.parametrize(
    ("obj", "type_name"),
    [(42, "int"), (["not a spec"], "list"), (None, "NoneType"), (lambda: "fa", "str")],
)
def test_plugin_returning_the_wrong_type(
    plugins: Callable[..., tuple[B.PluginFailure, ...]], obj: object, type_name: str
) -> None:
    failures = plugins(
        _FakeEP("wrong", "pkg:obj", _returns(obj)),
        _FakeEP("right", "pkg:spec", _returns(_spec("right_attn"))),
    )
    fail = _failure(failures, "wrong")
    assert fail.error.startswith("ArgumentTypeError: an attnres.backends entry point must give")
    assert f"got {type_name}" in fail.error
    assert Backend.parse("right_attn").name == "right_attn"


def test_entry_points_that_cannot_be_listed_are_a_failure(
    plugins: Callable[..., tuple[B.PluginFailure, ...]], monkeypatch: pytest.MonkeyPatch
) -> None:
    plugins()

    def broken() -> list[object]:
        raise RuntimeError("corrupt METADATA")

    monkeypatch.setattr(importlib.metadata, "entry_points", _our_group(broken))
    failures = reload_plugins()
    monkeypatch.undo()
    assert failures == (B.PluginFailure("<entry points>", "RuntimeError: corrupt METADATA"),)
    assert Backend.parse("fa") == Backend("fa")


def test_reload_drops_plugin_backends_but_keeps_register_backend_ones(
    plugins: Callable[..., tuple[B.PluginFailure, ...]], registered: list[str]
) -> None:
    registered.append("manual_attn")
    register_backend(_spec("manual_attn"))
    plugins(_FakeEP("p", "pkg:spec", _returns(_spec("plugged_attn"))))
    assert Backend.parse("plugged_attn").name == "plugged_attn"
    plugins()
    with pytest.raises(UnknownBackendError):
        Backend.parse("plugged_attn")
    assert Backend.parse("manual_attn").name == "manual_attn"


def test_lookup_on_another_thread_waits_for_plugins_still_loading(
    plugins: Callable[..., tuple[B.PluginFailure, ...]],
) -> None:
    plugins()  # install an empty fake, so the reload below uses the fakes
    started = threading.Event()

    def slow() -> BackendSpec:
        started.set()
        time.sleep(0.3)
        return _spec("slow_attn")

    mp = pytest.MonkeyPatch()
    mp.setattr(
        importlib.metadata, "entry_points", _our_group(lambda: [_FakeEP("slow", "pkg:slow", slow)])
    )
    try:
        loader = threading.Thread(target=reload_plugins)
        loader.start()
        assert started.wait(5)
        assert Backend.parse("slow_attn").name == "slow_attn"
        loader.join(5)
    finally:
        mp.undo()


def test_plugin_that_parses_a_name_while_loading_does_not_recurse(
    plugins: Callable[..., tuple[B.PluginFailure, ...]],
) -> None:
    def needs_parse() -> BackendSpec:
        with pytest.raises(UnknownBackendError):
            Backend.parse("not_yet_attn")
        Backend.parse("fa")
        return _spec("reentrant_attn")

    assert plugins(_FakeEP("re", "pkg:re", needs_parse)) == ()
    assert Backend.parse("reentrant_attn").name == "reentrant_attn"


def _catalogue_row(spec: BackendSpec) -> str:
    """The row docs/backends.md shows for ``spec``, built from the spec itself."""
    kinds = [k for k in PLATFORM_KINDS if k in spec.platforms]
    runs = f"all ({', '.join(kinds)})" if len(kinds) == len(PLATFORM_KINDS) else ", ".join(kinds)
    caps = "; ".join(f"{k}: {r.describe()}" for k, r in sorted(spec.capabilities.items()))
    implements = ", ".join(r.value for r in Requirement if r in spec.implements) or "none"
    if spec.package is None:
        package = "— (torch)"
    else:
        package = f"`{spec.package}`"
        package += "".join(f" or `{a}`" for a in spec.package_alternatives)
        package += "".join(f" and `{e}`" for e in spec.extra_packages)
    dtypes = ", ".join(d for d in DTYPES if d in spec.dtypes)
    return (
        f"| `{spec.name}` | {spec.kind} | {runs} | {caps or 'any'} | {dtypes} | "
        f"{spec.head_sizes.describe()} | {implements} | {package} |"
    )


def test_docs_catalogue_table_and_limits_repeat_the_specs() -> None:
    """docs/backends.md shows every fact of the catalogue: a changed spec changes the page."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "backends.md").read_text("utf-8")
    for spec in B.BUILTIN_SPECS:
        assert _catalogue_row(spec) + "\n" in text, spec.name
        for limit in spec.limits:
            assert f"| `{spec.name}` | {limit.describe()} | {limit.because} |" in text


# =============================================================================
# issue 31: facts keyed by version and GPU, rendered in docs/backends.md
# =============================================================================

_DOC = Path(__file__).resolve().parent.parent / "docs" / "backends.md"


def _changed(name: str, value: object) -> str:
    """One replaced fact of a KernelFacts entry, in words."""
    if value is None or value == ():
        return f"{name}: none"
    if isinstance(value, B.HeadSizeRule):
        return f"head sizes {value.describe()}"
    if name == "capabilities":
        return "runs on " + "; ".join(f"{k} {r.describe()}" for k, r in value.items())  # type: ignore[attr-defined]
    if name == "implements":
        return "implements " + ", ".join(r.value for r in Requirement if r in value)  # type: ignore[operator]
    if name == "options":
        return "options " + ", ".join(o.name for o in value)  # type: ignore[attr-defined]
    if name == "masks":
        return "masks " + ", ".join(f"{m.kind.value} {m.route.value}" for m in value)  # type: ignore[attr-defined]
    return f"{name}: {value}"


def _chains_block() -> str:
    from attnres.platform import CUDA_CHAINS, ROCM_CHAINS

    rows = ["| device | chain | source |", "|---|---|---|"]
    rows += [
        f"| {kind} {rule.capabilities.describe()} | "
        + ", then ".join(f"`{b}`" for b in rule.chain)
        + f" | {rule.source} |"
        for kind, rules in (("cuda", CUDA_CHAINS), ("rocm", ROCM_CHAINS))
        for rule in rules
    ]
    return "\n".join(rows)


def _facts_block() -> str:
    specs = B.BUILTIN_SPECS
    out = ["| backend | the catalogue's own facts describe |", "|---|---|"]
    out += [f"| `{s.name}` | {s.release} |" for s in specs if s.release]
    out += [
        "",
        "Where another version or GPU differs (`BackendSpec.variants`; every matching entry "
        "applies, in this order):",
        "",
        "| backend | applies to | kernel | facts it replaces | source |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| `{s.name}` | {v.describe()} | {v.kernel} | "
        + "; ".join(_changed(k, v.changes[k]) for k in sorted(v.changes))
        + f" | {v.source} |"
        for s in specs
        for v in s.variants
    ]
    out += [
        "",
        "Option values a kernel refuses (`BackendSpec.option_limits`): a layer that gives one "
        "where it applies gets a `BackendOptionError` when it is built:",
        "",
        "| backend | refuses | because |",
        "|---|---|---|",
    ]
    out += [
        f"| `{s.name}` | {o.describe()} | {o.because} |" for s in specs for o in s.option_limits
    ]
    out += [
        "",
        "What a kernel refuses at call time that no layer fact decides (`BackendSpec.refuses`; "
        "shown by `attnres backends`):",
        "",
        "| backend | refuses |",
        "|---|---|",
    ]
    out += [f"| `{s.name}` | {r} |" for s in specs for r in s.refuses]
    return "\n".join(out)


def test_docs_show_the_facts_by_version_and_gpu(update_golden: bool) -> None:
    """docs/backends.md's version/GPU facts and CUDA chains are generated from the
    catalogue (``--update-golden`` rewrites them): every fact there has its source."""
    from generated_docs import check_generated

    for spec in B.BUILTIN_SPECS:
        for variant in spec.variants:
            assert variant.source and variant.kernel, spec.name
        for limit in spec.option_limits:
            assert limit.because, spec.name
    check_generated(
        _DOC,
        "<!-- BEGIN generated: CUDA chains (tests/test_backends.py) -->",
        "<!-- END generated: CUDA chains -->",
        _chains_block(),
        update_golden,
    )
    check_generated(
        _DOC,
        "<!-- BEGIN generated: kernel facts (tests/test_backends.py) -->",
        "<!-- END generated: kernel facts -->",
        _facts_block(),
        update_golden,
    )


def _outcome(backend: str, platform: str, head: int = 128, **req: Any) -> list[str]:
    """The failure messages of ``backend`` for one layer (empty: it passes every check)."""
    from attnres.layer import LayerSpec, Requirements
    from attnres.machine import check_candidate
    from attnres.platform import Platform

    layer = LayerSpec(head, "bf16", requirements=Requirements(**req))
    checks = check_candidate(Backend(backend), layer, Platform.simulate(platform))
    return [f.message for _, failures in checks for f in failures]


def test_ascend_fa_takes_boolean_masks_only() -> None:
    """npu_fusion_attention's atten_mask is BOOL/UINT8 and the adapter refuses float
    masks: additive masks and (possibly float) key padding are not taken."""
    assert _outcome("ascend_fa", "npu+torch_npu", mask="boolean") == []
    for kind in ("additive", "key_padding"):
        (message,) = _outcome("ascend_fa", "npu+torch_npu", mask=kind)
        assert "it takes boolean masks" in message
    assert _outcome("ascend_fa", "npu+torch_npu", attn_mask=True)  # 0.2's any mask


def test_sage_key_padding_is_not_taken_on_sm120() -> None:
    """sageattn_varlen is Triton-only, 'currently not usable on sm120' (core.py)."""
    assert _outcome("sage_attn", "cuda:sm90+sageattention", mask="key_padding") == []
    for sm in ("sm120", "sm121"):
        (message,) = _outcome("sage_attn", f"cuda:{sm}+sageattention", mask="key_padding")
        assert "key-padding masks" in message
    assert _outcome("sage_attn", "cuda:sm120+sageattention") == []


def test_fa4_b36_runs_forward_on_sm8x_and_head_256_on_sm90_and_sm100() -> None:
    assert _outcome("fa4", "cuda:sm80+fa4") == []
    (message,) = _outcome("fa4", "cuda:sm86+fa4", backward=True)
    assert "the backward pass on sm80-sm89" in message
    for sm in ("sm90", "sm100", "sm103"):
        assert _outcome("fa4", f"cuda:{sm}+fa4", head=256) == [], sm
    assert _outcome("fa4", "cuda:sm100+fa4", head=192)  # (192, 128) only: other v head
    assert _outcome("fa4", "cuda:sm90+fa4", head=192) == []
    assert _outcome("fa4", "cuda:sm120+fa4", head=256)


def test_cudnn_sdpa_refusals_are_stated_with_sources() -> None:
    refuses = get_spec(Backend("torch_cudnn_sdpa")).refuses
    assert any("seq_kv == 1" in r and "sdp_utils.cpp" in r for r in refuses)
    assert any("deterministic" in r and "check_cudnn_deterministic" in r for r in refuses)


def test_every_builtin_names_the_release_its_facts_describe() -> None:
    for spec in B.BUILTIN_SPECS:
        assert spec.release, spec.name


def test_kernel_facts_match_by_distribution_version_and_gpu() -> None:
    entry = B.KernelFacts("K1", "src", {"lse": None}, distribution="pkg-x", since="1", before="2")
    assert entry.matches("pkg_x", "1.0.6", "cuda", None)
    assert entry.matches("PKG-X", "1.9.0rc1", "cpu", None)
    assert not entry.matches("pkg-x", "2.0.0", "cuda", None)
    assert not entry.matches("pkg-x", "0.9", "cuda", None)
    assert not entry.matches("pkg-y", "1.0", "cuda", None)
    assert not entry.matches("pkg-x", "simulated", "cuda", None)
    assert not entry.matches(None, "1.0", "cuda", None)
    gpu = B.KernelFacts("K2", "src", {}, capabilities=B.CapabilityRule(min=(12, 0)))
    assert gpu.matches(None, None, "cuda", (12, 1))
    assert not gpu.matches(None, None, "cuda", None)  # unknown capability: not applied
    assert not gpu.matches(None, None, "rocm", (12, 0))
    with pytest.raises(ValueError, match="cannot vary by version or GPU"):
        B.KernelFacts("K3", "src", {"name": "other"})
