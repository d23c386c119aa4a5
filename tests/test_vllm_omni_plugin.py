"""The vLLM-Omni plugin (issue 36), without vLLM-Omni: small stand-ins in
``sys.modules`` mirror the API of vLLM-Omni 0.30.0 that the plugin reads
(``vllm_omni/diffusion/attention/selector.py``: ``get_attn_backend_for_role``,
``_cached_get_backend_cls``, ``_log_backend_resolution``;
``vllm_omni/diffusion/data.py``: ``AttentionConfig.per_role`` / ``default`` /
``resolve_with_source``, ``AttentionSpec.backend``;
``backends/registry.py``: ``DiffusionAttentionBackendEnum``). The stand-in
platform is a table: backend name -> class, and a default by head size.
vLLM-Omni's own selection tests run against the real wheel in
``make test-vllm-omni``.
"""

from __future__ import annotations

import enum
import importlib.metadata
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

import attnres
from attnres._profile_vllm_omni import HOST_FACTS, UNOBSERVED, WHY
from attnres._states import Event, Origin, Reason, Status
from attnres.backends import get_spec, lookup_spec, unregister_backend
from attnres.errors import EngineSupportError
from attnres.integrations import vllm_omni as plugin
from attnres.platform import HostResolution, Platform
from attnres.trace import CheckRecord, trace_from_json, trace_to_dict

SELECTOR = "vllm_omni.diffusion.attention.selector"


def _backend(name: str, sizes: tuple[int, ...] = ()) -> type:
    return type(
        name.title().replace("_", "") + "Backend",
        (),
        {
            "get_name": staticmethod(lambda: name),
            "get_supported_head_sizes": staticmethod(lambda: list(sizes)),
            "supports_head_size": classmethod(lambda cls, h: not sizes or h in sizes),
            "supported_platforms": None,
        },
    )


CLASSES = {
    "TORCH_SDPA": _backend("TORCH_SDPA"),
    "FLASH_ATTN": _backend("FLASH_ATTN"),
    "CUDNN_ATTN": _backend("CUDNN_ATTN", (64, 128)),
    "FLASHINFER_ATTN": _backend("FLASHINFER_ATTN", (64, 128, 256)),
}


@dataclass
class AttentionSpec:
    backend: str


@dataclass
class AttentionConfig:
    default: AttentionSpec | None = None
    per_role: dict[str, AttentionSpec] = field(default_factory=dict)

    def resolve_with_source(
        self, role: str = "self", role_category: str | None = None
    ) -> tuple[AttentionSpec | None, str | None]:
        if role in self.per_role:
            return self.per_role[role], f"attention_config.per_role[{role!r}]"
        if role_category is not None and role_category in self.per_role:
            return (
                self.per_role[role_category],
                f"attention_config.per_role[{role_category!r}] (role_category fallback)",
            )
        if self.default is not None:
            return self.default, "attention_config.default"
        return None, None


@pytest.fixture
def omni(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Stand-ins for vLLM-Omni 0.30.0; ``state["default"]``: the platform's pick."""
    state: dict[str, Any] = {"default": "CUDNN_ATTN", "calls": [], "logs": []}
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda d: "0.30.0" if d == "vllm-omni" else real(d),
    )
    members = {n: f"stand_in.{n}" for n in CLASSES}
    registry_enum = enum.Enum("DiffusionAttentionBackendEnum", members)  # type: ignore[misc]
    registry_enum.get_class = lambda self: CLASSES[self.name]  # type: ignore[attr-defined]

    def cached(name: str | None, head_size: int, allow_trtllm_default: bool = True) -> type:
        state["calls"].append((name, head_size, allow_trtllm_default))
        if name is None:
            return CLASSES[state["default"]]
        if name.upper() not in CLASSES:
            raise ValueError(f"Unknown diffusion attention backend: '{name}'")
        return CLASSES[name.upper()]

    def log(role: str, role_category: str | None, backend_name: str, source: str) -> None:
        state["logs"].append((role, role_category, backend_name, source))

    def get_attn_backend_for_role(
        role: str,
        head_size: int,
        attention_config: AttentionConfig | None = None,
        role_category: str | None = None,
        allow_trtllm_default: bool = True,
    ) -> tuple[type, AttentionSpec | None]:
        spec, source = (None, None)
        if attention_config is not None:
            spec, source = attention_config.resolve_with_source(role, role_category)
        selector = sys.modules[SELECTOR]
        if spec is not None:
            cls = selector._cached_get_backend_cls(spec.backend, head_size)
            selector._log_backend_resolution(
                role=role, role_category=role_category, backend_name=cls.get_name(), source=source
            )
            return cls, spec
        cls = selector._cached_get_backend_cls(None, head_size, allow_trtllm_default)
        selector._log_backend_resolution(
            role=role, role_category=role_category, backend_name=cls.get_name(),
            source="platform default",
        )  # fmt: skip
        return cls, None

    abstract = types.SimpleNamespace(
        get_name=None, supports_head_size=None, get_supported_head_sizes=None
    )
    modules: dict[str, dict[str, Any]] = {
        "vllm_omni": {},
        "vllm_omni.diffusion": {},
        "vllm_omni.diffusion.attention": {},
        SELECTOR: {
            "get_attn_backend_for_role": get_attn_backend_for_role,
            "_cached_get_backend_cls": cached,
            "_log_backend_resolution": log,
        },
        "vllm_omni.diffusion.data": {
            "AttentionConfig": AttentionConfig,
            "AttentionSpec": AttentionSpec,
        },
        "vllm_omni.diffusion.attention.backends": {},
        "vllm_omni.diffusion.attention.backends.registry": {
            "DiffusionAttentionBackendEnum": registry_enum
        },
        "vllm_omni.diffusion.attention.backends.abstract": {"AttentionBackend": abstract},
        # a module that bound the selector by name, as layer.py does
        "vllm_omni.diffusion.attention.layer": {
            "get_attn_backend_for_role": get_attn_backend_for_role
        },
        "vllm_omni.platforms": {"current_omni_platform": types.SimpleNamespace(device_type="cuda")},
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__path__ = []  # type: ignore[attr-defined]
        vars(module).update(attributes)
        monkeypatch.setitem(sys.modules, name, module)
    attnres.clear_decisions()
    yield state
    plugin.uninstall()
    for name in ("cudnn_attn", "flashinfer_attn"):
        if lookup_spec(attnres.Backend(name)) is not None:
            unregister_backend(name)


def _both(state: dict[str, Any], *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """(vLLM-Omni's answer, the plugin's answer, the plugin's decision)."""
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    stock = layer.get_attn_backend_for_role(*args, **kwargs)
    plugin.install()
    try:
        attnres.clear_decisions()
        routed = layer.get_attn_backend_for_role(*args, **kwargs)
        decisions = attnres.decisions()
    finally:
        plugin.uninstall()
    return stock, routed, decisions[-1] if decisions else None


CONFIG = AttentionConfig(
    default=AttentionSpec("TORCH_SDPA"),
    per_role={"cross": AttentionSpec("FLASH_ATTN"), "ltx2.audio_to_video": AttentionSpec("sdpa")},
)


@pytest.mark.parametrize(
    ("role", "category", "backend", "origin"),
    [
        ("joint", None, "torch_sdpa", Origin.GLOBAL_CLI),  # attention_config.default
        ("ltx2.video_to_audio", "cross", "fa", Origin.COMPONENT_OVERRIDE),  # the category
    ],
)
def test_rule_vllm_omni_precedence_is_its_own_and_decided_by_attnres(
    omni: dict[str, Any], role: str, category: str | None, backend: str, origin: Origin
) -> None:
    stock, routed, decision = _both(omni, role, 128, CONFIG, category)
    assert routed == stock  # the same class, the same AttentionSpec object
    assert decision.backend == backend and decision.origin is origin
    assert decision.trace.input.config.profile == "vllm_omni"
    # one platform call per answer, as vLLM-Omni makes it (two: stock, then routed)
    assert omni["calls"][0] == omni["calls"][1]
    assert omni["logs"][0] == omni["logs"][1]  # it logs what vLLM-Omni logs


def test_rule_vllm_omni_exact_role_name_vllm_omni_refuses_is_refused_unchanged(
    omni: dict[str, Any],
) -> None:
    # per_role[role] = "sdpa": attnres knows the alias, vLLM-Omni's platform does not
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    with pytest.raises(ValueError, match="Unknown diffusion attention backend: 'sdpa'"):
        layer.get_attn_backend_for_role("ltx2.audio_to_video", 128, CONFIG, "cross")
    plugin.install()
    with pytest.raises(ValueError, match="Unknown diffusion attention backend: 'sdpa'"):
        layer.get_attn_backend_for_role("ltx2.audio_to_video", 128, CONFIG, "cross")
    (decision,) = attnres.decisions()
    assert decision.backend is None and decision.origin is Origin.LAYER


def test_rule_vllm_omni_platform_default_unchanged_where_the_layer_can_run_it(
    omni: dict[str, Any],
) -> None:
    stock, routed, decision = _both(omni, "self", 128, None, None, False)
    assert routed == stock == (CLASSES["CUDNN_ATTN"], None)
    assert omni["calls"] == [(None, 128, False), (None, 128, False)]
    assert decision.backend == "cudnn_attn" and decision.origin is Origin.NONE
    assert decision.reason is None
    assert get_spec("cudnn_attn").head_sizes.allowed == {64, 128}  # read from its class


def test_rule_vllm_omni_platform_default_the_layer_cannot_run_falls_back_to_sdpa(
    omni: dict[str, Any],
) -> None:
    # the platform picks by name and head size only; its class cannot take 80
    stock, routed, decision = _both(omni, "self", 80, None)
    assert stock == (CLASSES["CUDNN_ATTN"], None)  # vLLM-Omni: built, then fails
    assert routed == (CLASSES["TORCH_SDPA"], None)
    assert decision.backend == "torch_sdpa"
    assert decision.reason is Reason.PLATFORM_DEFAULT_FALLBACK
    assert "cudnn_attn cannot take head size 80" in json.dumps(trace_to_dict(decision.trace))


def test_rule_vllm_omni_configured_backend_the_layer_cannot_run_is_refused_typed(
    omni: dict[str, Any],
) -> None:
    config = AttentionConfig(default=AttentionSpec("CUDNN_ATTN"))
    plugin.install()
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    with pytest.raises(ValueError, match="cudnn_attn cannot take head size 80"):
        layer.get_attn_backend_for_role("self", 80, config)


def test_rule_vllm_omni_decision_trace_replays_without_vllm_omni(omni: dict[str, Any]) -> None:
    _, _, decision = _both(omni, "self", 80, None)
    text = json.dumps(trace_to_dict(decision.trace))
    for name in list(sys.modules):
        if name.startswith("vllm_omni"):
            del sys.modules[name]
    result = attnres.replay(trace_from_json(text))
    assert result.ok, result.diff


def test_rule_vllm_omni_name_nobody_knows_is_a_recorded_refusal(
    omni: dict[str, Any],
) -> None:
    # neither attnres nor vLLM-Omni's platform knows "EXACT": vLLM-Omni's error is
    # the answer, unchanged, and it is an attnres decision (the name registered on
    # first sight, so its trace replays)
    config = AttentionConfig(default=AttentionSpec("EXACT"))
    plugin.install()
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    with pytest.raises(ValueError, match="Unknown diffusion attention backend: 'EXACT'"):
        layer.get_attn_backend_for_role("self", 64, config)
    (decision,) = attnres.decisions()
    assert decision.outcome.status is Status.REJECTED and decision.origin is Origin.GLOBAL_CLI
    assert "Unknown diffusion attention backend: 'EXACT'" in decision.outcome.error
    assert plugin.stats()["delegated"] == 0
    assert "exact" in plugin.seen_backends()
    assert attnres.replay(decision.trace).ok


def test_rule_vllm_omni_backend_only_vllm_omni_knows_becomes_an_attnres_backend(
    omni: dict[str, Any],
) -> None:
    # a name and a class only vLLM-Omni's platform knows (a platform plugin's own
    # backend; vLLM-Omni's selection tests use such fakes): both are registered
    # on first sight from what the class states, and the call is decided
    custom = _backend("OOT_FLASH", (64, 128))
    CLASSES["OOT_FLASH"] = custom
    try:
        config = AttentionConfig(per_role={"cross": AttentionSpec("OOT_FLASH")})
        layer = sys.modules["vllm_omni.diffusion.attention.layer"]
        stock = layer.get_attn_backend_for_role("ltx2.audio_to_video", 128, config, "cross")
        plugin.install()
        routed = layer.get_attn_backend_for_role("ltx2.audio_to_video", 128, config, "cross")
        assert routed == stock == (custom, config.per_role["cross"])
        (decision,) = attnres.decisions()
        assert decision.backend == "oot_flash" and decision.origin is Origin.COMPONENT_OVERRIDE
        assert get_spec("oot_flash").head_sizes.allowed == {64, 128}  # read from its class
        assert "oot_flash" in plugin.seen_backends()
        assert attnres.replay(decision.trace).ok
        # a head size its class refuses: refused typed, as for vLLM-Omni's own members
        with pytest.raises(ValueError, match="oot_flash cannot take head size 80"):
            layer.get_attn_backend_for_role("ltx2.audio_to_video", 80, config, "cross")
        plugin.uninstall()  # the backends first seen are removed with the plugin
        assert lookup_spec(attnres.Backend("oot_flash")) is None
        assert plugin.seen_backends() == {}
    finally:
        del CLASSES["OOT_FLASH"]


def test_rule_vllm_omni_install_uninstall_rebinds_every_module(omni: dict[str, Any]) -> None:
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    before = layer.get_attn_backend_for_role
    plugin.plugin()
    plugin.plugin()  # idempotent: vLLM-Omni may load plugins more than once
    assert plugin.installed() and layer.get_attn_backend_for_role is not before
    plugin.uninstall()
    assert not plugin.installed() and layer.get_attn_backend_for_role is before


def test_rule_vllm_omni_other_release_is_refused(
    omni: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "0.29.1")
    with pytest.raises(EngineSupportError, match=r"vllm-omni>=0\.30\.0,<0\.31"):
        plugin.install()
    assert not plugin.installed()


def test_rule_vllm_omni_repeated_call_is_a_recorded_decision_and_follows_the_platform(
    omni: dict[str, Any],
) -> None:
    plugin.install()
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    first = layer.get_attn_backend_for_role("self", 128, None)
    again = layer.get_attn_backend_for_role("self", 128, None)
    assert first == again == (CLASSES["CUDNN_ATTN"], None)
    # recorded once, when decided; the repeat asks vLLM-Omni's platform and logs
    # as vLLM-Omni does, and adds no entry while the ledger holds the decision
    (decision,) = attnres.decisions()
    assert omni["calls"] == [(None, 128, True)] * 2 and len(omni["logs"]) == 2
    attnres.clear_decisions()  # the ledger forgot it: the next call records it again
    assert layer.get_attn_backend_for_role("self", 128, None) == first
    assert attnres.decisions() == (decision,)
    # the platform now answers differently: the memo's answer is not reused
    omni["default"] = "FLASH_ATTN"
    assert layer.get_attn_backend_for_role("self", 128, None) == (CLASSES["FLASH_ATTN"], None)
    assert attnres.decisions()[-1].backend == "fa"


# -- the vllm_omni profile's rows, without the plugin (issues 33, 36) --------------


def _decide(platform: Platform, **config: Any) -> Any:
    from attnres.machine import run_machine
    from attnres.trace import TraceInput

    layer = attnres.LayerSpec(head_size=80, dtype="bf16", name="self")
    cfg = attnres.SelectionConfig(profile="vllm_omni", **config)
    return run_machine(TraceInput(layer, cfg, None, platform, None))


def test_rule_vllm_omni_platform_default_refused_by_the_platform_is_never_replaced() -> None:
    # vLLM-Omni's platform refused its own default: that error is the answer;
    # TORCH_SDPA replaces only a class the layer cannot run
    refused = HostResolution("", None, "RuntimeError: no diffusion backend for this device")
    trace = _decide(Platform("cuda", host=[refused, HostResolution("torch_sdpa", "torch_sdpa")]))
    assert trace.outcome.status is Status.REJECTED
    assert trace.outcome.error == "RuntimeError: no diffusion backend for this device"
    assert not [r for r in trace.records if isinstance(r, CheckRecord)]


def test_rule_vllm_omni_configured_class_the_layer_cannot_run_says_why_it_is_refused() -> None:
    cannot = HostResolution("fa", "fa", missing=("head size 80 (its supports_head_size)",))
    trace = _decide(Platform("cuda", host=[cannot]), global_backend="fa")
    assert trace.outcome.status is Status.REJECTED
    assert trace.outcome.error.startswith("fa cannot take head size 80")
    assert WHY[Event.STRICT_FAILURE] in trace.outcome.error


def test_rule_vllm_omni_unobserved_fact_outside_the_plugin_names_how_to_supply_it() -> None:
    # a missing host fact is a rejection that says how to supply it, as sglang's
    trace = _decide(Platform("cuda"), global_backend="fa")
    assert trace.outcome.error == f"{UNOBSERVED}: {HOST_FACTS}"
    checks = [r for r in trace.records if isinstance(r, CheckRecord)]
    assert [f.message for f in checks[0].failures] == [UNOBSERVED]  # what the plugin observes


# -- AttentionSpec options as attnres backend options (issue 36) ------------------


def _quant(**given: Any) -> types.SimpleNamespace:
    fields = {"dtype_qk": None, "dtype_vo": None, "q_block_size": 1, "k_block_size": 16}
    return types.SimpleNamespace(**{**fields, "flashinfer_backend": None, **given})


def test_rule_vllm_omni_spec_options_are_checked_attnres_backend_options_in_the_record(
    omni: dict[str, Any],
) -> None:
    # vLLM-Omni's typed AttentionSpec.quant on FLASHINFER_ATTN (a SimpleNamespace
    # stands in for its AttnQuantSpec): the same answer, and the options are the
    # decision's backend options, by their dotted names
    spec = types.SimpleNamespace(backend="FLASHINFER_ATTN", quant=_quant(dtype_qk="fp8_e4m3"))
    config = AttentionConfig(default=spec)  # type: ignore[arg-type]
    stock, routed, decision = _both(omni, "self", 128, config)
    assert routed == stock and routed[1] is spec
    assert decision.trace.input.layer.backend_options == (
        (
            "flashinfer_attn",
            (("quant.dtype_qk", "fp8_e4m3"), ("quant.k_block_size", 16), ("quant.q_block_size", 1)),
        ),
    )
    declared = {o.name for o in get_spec("flashinfer_attn").options}
    assert "quant.dtype_vo" in declared and "skip_softmax.threshold" not in declared
    assert attnres.replay(decision.trace).ok


def test_rule_vllm_omni_spec_option_attnres_refuses_is_a_typed_error(
    omni: dict[str, Any],
) -> None:
    # a value vLLM-Omni's __post_init__ would refuse, set after construction:
    # attnres's option check refuses it at selection, naming the option
    from attnres.errors import BackendOptionError

    spec = types.SimpleNamespace(backend="FLASHINFER_ATTN", quant=_quant(q_block_size=8))
    plugin.install()
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    with pytest.raises(BackendOptionError, match=r"flashinfer_attn\.quant\.q_block_size=8"):
        layer.get_attn_backend_for_role("self", 128, AttentionConfig(default=spec))  # type: ignore[arg-type]


def test_rule_vllm_omni_spec_options_convert_lists_and_enums() -> None:
    import enum as enum_module

    class Precision(str, enum_module.Enum):
        FP8 = "fp8"

    block = types.SimpleNamespace(
        sparsity=0.5, start_step=2, end_step=0, precision=Precision.FP8, skip_layers=[0, 3]
    )
    spec = types.SimpleNamespace(backend="RAINFUSION_ATTN", block_sparse=block)
    assert plugin.spec_options(spec) == {
        "block_sparse.sparsity": 0.5,
        "block_sparse.start_step": 2,
        "block_sparse.end_step": 0,
        "block_sparse.precision": "fp8",
        "block_sparse.skip_layers": "0,3",
    }
    assert plugin.spec_options(types.SimpleNamespace(backend="TORCH_SDPA")) == {}


def test_rule_vllm_omni_memo_belongs_to_one_registry_generation(omni: dict[str, Any]) -> None:
    # a repeated call is a memo hit; a registry change (a backend registered)
    # empties the memo (GenerationMemo): the next call is decided again
    from attnres._vocab import DTYPES
    from attnres.backends import BackendSpec, register_backend

    plugin.install()
    layer = sys.modules["vllm_omni.diffusion.attention.layer"]
    before = plugin.stats()["decided"]
    layer.get_attn_backend_for_role("self", 128, None)
    layer.get_attn_backend_for_role("self", 128, None)
    assert plugin.stats()["decided"] == before + 1  # the second call: a hit
    register_backend(BackendSpec(name="memo_probe", sparse=False, platforms=(), dtypes=DTYPES))
    try:
        layer.get_attn_backend_for_role("self", 128, None)
        assert plugin.stats()["decided"] == before + 2  # decided anew
    finally:
        unregister_backend("memo_probe")
