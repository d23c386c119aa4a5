"""The selection contract (SPEC 3.1-3.5, 4): origins, relaxation, sparse/cross,
candidates and checks, reasons and messages, the trace, and the cache.

Every rule of SPEC section 3 has a test named ``test_rule_<section>_...``; the
seed incident of SPEC 1 has one ``test_seed_...`` test per case.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnres
from attnres import (
    Backend,
    BackendNotAppliedError,
    LayerSpec,
    Platform,
    Requirements,
    Resolution,
    ResolutionError,
    Role,
    SelectionConfig,
    UnknownBackendError,
    component_scope,
    force_backend,
    resolve,
)
from attnres import machine as M
from attnres import runtime as R
from attnres import scope as S
from attnres._profile_sglang import ROLE_OVERRIDE_REASONS
from attnres._states import Check, Event, Origin, Reason, State
from attnres._vocab import DTYPES
from attnres.backends import BUILTIN_SPECS, BackendSpec, register_backend, unregister_backend
from attnres.platform import PackageFact
from attnres.replayer import replay
from attnres.scope import ComponentLoader, ScopeState, component_kind
from attnres.trace import (
    BASE_SCHEMA_VERSION,
    CheckRecord,
    OriginRecord,
    RejectedRecord,
    SelectedRecord,
    SkipRecord,
    Trace,
    TraceInput,
    TransitionRecord,
)

CPU = Platform.simulate("cpu")
CUDA = Platform.simulate("cuda:sm90")  # no optional kernel package
CUDA_FA = Platform.simulate("cuda:sm90+flash_attn")
CUDA_SAGE = Platform.simulate("cuda:sm90+flash_attn+sageattention")
CUDA_ALL = Platform.simulate("cuda:sm90+all")

SPARSE = tuple(s.name for s in BUILTIN_SPECS if s.sparse)
REASONS = {
    None,
    "global backend fallback",
    "platform default fallback",
    "dense cross-attention fallback",
    "component constraint",
    # issue 30: an integration site whose own code computes softmax attention by hand
    "softmax attention written by hand",
}


@pytest.fixture(autouse=True)
def _restore_component_kinds() -> Iterator[None]:
    loaders, aliases = dict(S._LOADERS), dict(S._NAME_ALIASES)
    yield
    S._LOADERS.clear()
    S._LOADERS.update(loaders)
    S._NAME_ALIASES.clear()
    S._NAME_ALIASES.update(aliases)


def rejected(layer: LayerSpec, **kwargs: Any) -> ResolutionError:
    with pytest.raises(ResolutionError) as info:
        resolve(layer, **kwargs)
    return info.value


def evaluated(trace: Trace) -> list[tuple[str, str]]:
    """(stage, candidate) of every candidate the machine checked, in order."""
    out: list[tuple[str, str]] = []
    for rec in trace.records:
        if isinstance(rec, CheckRecord) and rec.check is Check.KNOWN:
            out.append((rec.stage.value, rec.candidate.name))
    return out


def skipped(trace: Trace) -> list[tuple[str, str]]:
    return [(r.stage.value, r.candidate.name) for r in trace.records if isinstance(r, SkipRecord)]


def checks_of(trace: Trace, candidate: str) -> list[CheckRecord]:
    return [
        r for r in trace.records if isinstance(r, CheckRecord) and r.candidate.name == candidate
    ]


def failure_codes(trace: Trace, candidate: str) -> dict[str, list[str]]:
    return {
        r.check.value: [f.code for f in r.failures]
        for r in checks_of(trace, candidate)
        if r.failures
    }


def transitions(trace: Trace) -> list[tuple[str, str, str]]:
    return [
        (r.source.value, r.event.value, r.target.value)
        for r in trace.records
        if isinstance(r, TransitionRecord)
    ]


def assert_well_formed(trace: Trace) -> None:
    """Origin record first, one terminal record last, every transition from the table,
    every check record at the current stage, checks of a candidate in CHECK_ORDER."""
    records = trace.records
    assert isinstance(records[0], OriginRecord)
    assert isinstance(records[-1], (SelectedRecord, RejectedRecord))
    terminals = [r for r in records if isinstance(r, (SelectedRecord, RejectedRecord))]
    assert len(terminals) == 1
    assert sum(isinstance(r, OriginRecord) for r in records) == 1
    state = State.ORIGIN_DETECTION
    reason: str | None = None
    current: tuple[State, Backend] | None = None
    seq: list[Check] = []
    groups: list[list[Check]] = []
    for rec in records[1:-1]:
        if isinstance(rec, TransitionRecord):
            assert rec.source is state, (rec, state)
            assert rec.event in M.TRANSITIONS[rec.source], rec
            target, sets = M.TRANSITIONS[rec.source][rec.event]
            assert rec.target is target
            assert rec.reason == (None if sets is None else sets.value)
            if reason is None and sets is not None:
                reason = sets.value
            state = target
        elif isinstance(rec, CheckRecord):
            assert rec.stage is state
            assert rec.passed is (not rec.failures)
            key = (rec.stage, rec.candidate)
            if key != current:
                if seq:
                    groups.append(seq)
                current, seq = key, []
            seq.append(rec.check)
        elif isinstance(rec, SkipRecord):
            assert rec.stage is state
        else:  # pragma: no cover - a failure path
            raise AssertionError(f"unexpected record {rec!r}")
    if seq:
        groups.append(seq)
    for group in groups:
        assert tuple(group) in (M.CHECK_ORDER, (Check.KNOWN,)), group
    last = records[-1]
    if isinstance(last, SelectedRecord):
        assert state is State.SELECTED
        assert last.reason == reason == trace.outcome.reason
        assert trace.outcome.status == "selected"
        assert trace.outcome.backend == last.backend
    else:
        assert state is State.REJECTED
        assert trace.outcome.status == "rejected"
        assert trace.outcome.error == last.error
    assert trace.outcome.origin is records[0].origin


# =============================================================================
# 3.1 Origin detection
# =============================================================================


def test_rule_3_1_layer_origin_beats_forced() -> None:
    cfg = SelectionConfig(forced_backend="eager", global_backend="eager")
    res = resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU, backend="torch_sdpa")
    assert (res.backend.name, res.origin, res.reason) == ("torch_sdpa", "layer", None)


def test_rule_3_1_layer_origin_beats_force_backend_context() -> None:
    with force_backend("eager"):
        res = resolve(LayerSpec(64, "fp32"), platform=CPU, backend="sdpa")
    assert (res.backend.name, res.origin) == ("torch_sdpa", "layer")


def test_rule_3_1_forced_beats_role_override() -> None:
    cfg = SelectionConfig(forced_backend="eager")
    found = []
    # the role override then ran on no layer: checked on exit whatever require_selection says
    with (
        pytest.raises(BackendNotAppliedError),
        component_scope(
            "transformer",
            backend="torch_sdpa",
            role_backends={"self": "torch_sdpa"},
            require_selection=False,
        ),
    ):
        found.append(resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU))
    assert (found[0].backend.name, found[0].origin) == ("eager", "forced")


def test_rule_3_1_force_backend_context_manager_is_forced_origin() -> None:
    layer = LayerSpec(64, "fp32", name="x")
    cfg = SelectionConfig(global_backend="torch_sdpa")
    with force_backend("EAGER") as forced:
        assert forced == Backend("eager")
        res = resolve(layer, config=cfg, platform=CPU)
        assert (res.backend.name, res.origin) == ("eager", "forced")
        assert res.trace.input.config.forced_backend == Backend("eager")
    after = resolve(layer, config=cfg, platform=CPU)
    assert (after.backend.name, after.origin) == ("torch_sdpa", "global_cli")


def test_rule_3_1_force_backend_context_beats_config_forced_backend() -> None:
    cfg = SelectionConfig(forced_backend="torch_sdpa")
    with force_backend("eager"):
        res = resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU)
    assert (res.backend.name, res.origin) == ("eager", "forced")


def test_rule_3_1_force_backend_rejects_none_and_unknown_names() -> None:
    with pytest.raises(ValueError, match="must be a backend name"), force_backend(None):  # type: ignore[arg-type]
        pass
    with pytest.raises(UnknownBackendError), force_backend("eagr_x"):
        pass


def test_rule_3_1_forced_beats_component_override() -> None:
    cfg = SelectionConfig(forced_backend="eager")
    with component_scope("vae", backend="torch_sdpa", require_selection=False):
        res = resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU)
    assert (res.backend.name, res.origin) == ("eager", "forced")


def test_rule_3_1_role_override_beats_component_override() -> None:
    with component_scope(
        "transformer", backend="eager", role_backends={"cross": "torch_sdpa"}
    ) as scope:
        cross = resolve(LayerSpec(64, "fp32", role="cross"), platform=CPU)
        self_ = resolve(LayerSpec(64, "fp32", role="self"), platform=CPU)
    assert (cross.backend.name, cross.origin) == ("torch_sdpa", "role_override")
    assert (self_.backend.name, self_.origin) == ("eager", "component_override")
    assert [d.origin for d in scope.decisions] == ["role_override", "component_override"]


def test_rule_3_1_component_override_beats_global_cli() -> None:
    cfg = SelectionConfig(global_backend="torch_sdpa")
    with component_scope("vae", backend="eager"):
        res = resolve(LayerSpec(64, "fp32", default="torch_sdpa"), config=cfg, platform=CPU)
    assert (res.backend.name, res.origin, res.reason) == ("eager", "component_override", None)


def test_rule_3_1_config_component_backends_are_a_component_override() -> None:
    cfg = SelectionConfig(global_backend="torch_sdpa", component_backends={"vae": "eager"})
    with component_scope("vae"):
        res = resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU)
    assert (res.backend.name, res.origin) == ("eager", "component_override")
    with component_scope("text_encoder"):
        other = resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU)
    assert (other.backend.name, other.origin) == ("torch_sdpa", "global_cli")
    # no scope: a per-component backend applies to no layer
    bare = resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU)
    assert bare.origin == "global_cli"


def test_rule_3_1_scope_backend_beats_config_component_backends() -> None:
    """Implementation choice (SPEC is silent): the scope's own backend wins."""
    cfg = SelectionConfig(component_backends={"vae": "eager"})
    with component_scope("vae", backend="torch_sdpa"):
        res = resolve(LayerSpec(64, "fp32"), config=cfg, platform=CPU)
    assert (res.backend.name, res.origin) == ("torch_sdpa", "component_override")


def test_rule_3_1_global_cli_beats_layer_default() -> None:
    cfg = SelectionConfig(global_backend="eager")
    res = resolve(LayerSpec(64, "fp32", default="torch_sdpa"), config=cfg, platform=CPU)
    assert (res.backend.name, res.origin, res.reason) == ("eager", "global_cli", None)


def test_rule_3_1_global_preference_when_not_typed_by_the_operator() -> None:
    cfg = SelectionConfig(global_backend="eager", global_backend_explicit=False)
    res = resolve(LayerSpec(64, "fp32", default="torch_sdpa"), config=cfg, platform=CPU)
    assert (res.backend.name, res.origin, res.reason) == ("eager", "global_preference", None)
    origin = res.trace.records[0]
    assert isinstance(origin, OriginRecord) and origin.strict is False


def test_rule_3_1_layer_default_when_nothing_requested() -> None:
    res = resolve(LayerSpec(64, "fp32", default="eager"), platform=CPU)
    assert (res.backend.name, res.origin, res.reason) == ("eager", "layer_default", None)


def test_rule_3_1_none_when_nothing_requested_and_no_default() -> None:
    res = resolve(LayerSpec(64, "fp32"), platform=CPU)
    assert (res.backend.name, res.origin, res.reason) == ("torch_sdpa", "none", None)
    origin = res.trace.records[0]
    assert isinstance(origin, OriginRecord)
    assert origin.backend is None and origin.strict is False


def _strict_request(kind: str, backend: str, layer: LayerSpec, platform: Platform) -> Trace:
    """Resolve ``layer`` with ``backend`` requested through a strict origin ``kind``."""
    if kind == "layer":
        return rejected(layer, platform=platform, backend=backend).trace
    if kind == "forced":
        cfg = SelectionConfig(forced_backend=backend)
        return rejected(layer, platform=platform, config=cfg).trace
    if kind == "force_backend":
        with force_backend(backend):
            return rejected(layer, platform=platform).trace
    if kind == "role_override":
        with (
            pytest.raises(ResolutionError) as info,
            component_scope("vae", role_backends={layer.role: backend}),
        ):
            resolve(layer, platform=platform)
        return info.value.trace
    if kind == "component_override":
        with pytest.raises(ResolutionError) as info, component_scope("vae", backend=backend):
            resolve(layer, platform=platform)
        return info.value.trace
    if kind == "config_component_override":
        cfg = SelectionConfig(component_backends={"vae": backend})
        with pytest.raises(ResolutionError) as info, component_scope("vae"):
            resolve(layer, platform=platform, config=cfg)
        return info.value.trace
    raise AssertionError(kind)


STRICT_KINDS = [
    ("layer", "layer"),
    ("forced", "forced"),
    ("force_backend", "forced"),
    ("role_override", "role_override"),
    ("component_override", "component_override"),
    ("config_component_override", "component_override"),
]


@pytest.mark.parametrize(("kind", "origin"), STRICT_KINDS)
def test_rule_3_1_strict_origins_reject_with_no_fallback(kind: str, origin: str) -> None:
    # the layer declares a default and fa cannot run on cpu: a relaxed origin
    # would fall back to eager; a strict one must not.
    layer = LayerSpec(64, "fp32", default="eager", supported={"fa", "eager", "torch_sdpa"})
    trace = _strict_request(kind, "fa", layer, CPU)
    assert trace.outcome.status == "rejected"
    assert str(trace.outcome.origin) == origin
    assert evaluated(trace) == [("requested", "fa")]
    assert transitions(trace) == [
        ("origin_detection", "request_found", "requested"),
        ("requested", "strict_failure", "rejected"),
    ]
    origin_record = trace.records[0]
    assert isinstance(origin_record, OriginRecord) and origin_record.strict is True
    assert_well_formed(trace)


def test_rule_3_1_strict_origins_constant() -> None:
    assert (
        frozenset(
            {
                Origin.REQUEST,
                Origin.LAYER,
                Origin.FORCED,
                Origin.ROLE_OVERRIDE,
                Origin.COMPONENT_OVERRIDE,
            }
        )
        == M.STRICT_ORIGINS
    )


def test_rule_3_1_origin_vocabulary_is_exact() -> None:
    assert [o.value for o in Origin] == [
        "request",
        "layer",
        "forced",
        "role_override",
        "component_override",
        "global_cli",
        "global_env",
        "global_preference",
        "layer_default",
        "none",
    ]


@pytest.mark.parametrize(
    ("cfg", "origin"),
    [
        (SelectionConfig(global_backend="fa", global_backend_explicit=False), "global_preference"),
        (SelectionConfig(), "layer_default"),
    ],
)
def test_rule_3_1_relaxed_origins_fall_back(cfg: SelectionConfig, origin: str) -> None:
    default = "fa" if origin == "layer_default" else "eager"
    res = resolve(LayerSpec(64, "fp32", default=default), config=cfg, platform=CPU)
    assert res.origin == origin
    assert res.reason == "platform default fallback"
    assert res.backend.name in ("eager", "torch_sdpa")


# =============================================================================
# 3.2 The global flag is relaxed for auxiliary components
# =============================================================================

SAGE = SelectionConfig(global_backend="sage_attn")
FA_SDPA = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"})
FA_SDPA_DEFAULT = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}, default="torch_sdpa")


@pytest.mark.parametrize("name", ["transformer", "dit", "transformer_2", "unet", "mmdit"])
def test_rule_3_2_global_cli_strict_for_transformer_scopes(name: str) -> None:
    with pytest.raises(ResolutionError) as info, component_scope(name) as scope:
        resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert scope.state.kind == "transformer"
    assert scope.state.allow_global_fallback is False
    trace = info.value.trace
    assert str(trace.outcome.origin) == "global_cli"
    assert evaluated(trace) == [("requested", "sage_attn")]
    assert str(info.value).endswith(f" for component {name!r}")


@pytest.mark.parametrize("name", ["foley_model", "my_upsampler", "prior"])
def test_rule_3_2_global_cli_strict_for_unknown_kinds(name: str) -> None:
    with pytest.raises(ResolutionError) as info, component_scope(name) as scope:
        resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert scope.state.kind == "generic"
    assert scope.state.loader == "GenericComponentLoader"
    assert evaluated(info.value.trace) == [("requested", "sage_attn")]


def test_rule_3_2_global_cli_strict_without_scope() -> None:
    err = rejected(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    origin = err.trace.records[0]
    assert isinstance(origin, OriginRecord)
    assert origin.origin is Origin.GLOBAL_CLI and origin.strict is True
    assert "no component scope" in origin.detail


def test_rule_3_2_global_cli_relaxed_when_layer_declares_default() -> None:
    with component_scope("transformer"):
        res = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    assert (res.backend.name, res.origin, res.reason) == (
        "torch_sdpa",
        "global_cli",
        "global backend fallback",
    )
    origin = res.trace.records[0]
    assert isinstance(origin, OriginRecord) and origin.strict is False
    assert "declares default 'torch_sdpa'" in origin.detail


def test_rule_3_2_global_cli_relaxed_when_layer_declares_default_without_scope() -> None:
    res = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    assert (res.backend.name, res.reason) == ("torch_sdpa", "global backend fallback")


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("text_encoder", "text_encoder"),
        ("text_encoder_2", "text_encoder"),
        ("image_encoder", "image_encoder"),
        ("vae", "vae"),
        ("audio_vae", "audio_vae"),
        ("vocoder", "vocoder"),
        ("connector", "connector"),
        ("bridge", "bridge"),
    ],
)
def test_rule_3_2_global_cli_relaxed_when_scope_allows_global_fallback(
    name: str, kind: str
) -> None:
    with component_scope(name) as scope:
        res = resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert scope.state.kind == kind
    assert scope.state.allow_global_fallback is True
    # sage_attn is installed and runs on sm90: only the supported set refuses it
    assert (res.backend.name, res.origin, res.reason) == (
        "fa",
        "global_cli",
        "global backend fallback",
    )
    assert res.component == name


def test_rule_3_2_base_component_loader_allows_global_fallback() -> None:
    assert ComponentLoader.allow_global_fallback is True
    with component_scope("anything", kind="component") as scope:
        res = resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert scope.state.loader == "ComponentLoader"
    assert res.reason == "global backend fallback"


def test_rule_3_2_allow_global_fallback_true_overrides_a_strict_loader() -> None:
    with component_scope("transformer", allow_global_fallback=True):
        res = resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert (res.backend.name, res.reason) == ("fa", "global backend fallback")
    with component_scope("foley_model", allow_global_fallback=True):
        res = resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert res.reason == "global backend fallback"


def test_rule_3_2_allow_global_fallback_false_overrides_a_relaxed_loader() -> None:
    with (
        pytest.raises(ResolutionError, match=r"for component 'vae'$"),
        component_scope("vae", allow_global_fallback=False),
    ):
        resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)


def test_rule_3_2_allow_global_fallback_false_still_relaxed_by_layer_default() -> None:
    with component_scope("vae", allow_global_fallback=False):
        res = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    assert (res.backend.name, res.reason) == ("torch_sdpa", "global backend fallback")


def test_rule_3_2_register_component_kind_with_custom_loader() -> None:
    class UpsamplerLoader(ComponentLoader):
        kind = "upsampler"
        allow_global_fallback = True

    class PriorLoader(ComponentLoader):
        kind = "prior_model"
        allow_global_fallback = False

    assert (
        attnres.register_component_kind("upsampler", UpsamplerLoader, aliases=("latent_upsampler",))
        is UpsamplerLoader
    )
    attnres.register_component_kind("prior_model", PriorLoader)
    assert component_kind("latent_upsampler") == "upsampler"
    assert component_kind("upsampler_2") == "upsampler"
    with component_scope("latent_upsampler") as scope:
        res = resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert scope.state.loader == "UpsamplerLoader"
    assert res.reason == "global backend fallback"
    with pytest.raises(ResolutionError), component_scope("prior_model"):
        resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)


def test_rule_3_2_register_component_kind_from_a_policy() -> None:
    loader = attnres.register_component_kind("refiner", allow_global_fallback=False)
    assert issubclass(loader, ComponentLoader)
    assert loader.kind == "refiner" and loader.allow_global_fallback is False
    with pytest.raises(ResolutionError), component_scope("refiner"):
        resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    relaxed = attnres.register_component_kind("refiner", allow_global_fallback=True)
    assert relaxed.allow_global_fallback is True
    with component_scope("refiner"):
        assert resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE).backend.name == "fa"


@pytest.mark.parametrize("kind", ["Upsampler", "2d", "", "a-b"])
def test_rule_3_2_register_component_kind_rejects_bad_names(kind: str) -> None:
    with pytest.raises(ValueError, match="snake_case"):
        attnres.register_component_kind(kind)


def test_rule_3_2_register_component_kind_rejects_non_loaders() -> None:
    with pytest.raises(TypeError, match="ComponentLoader"):
        attnres.register_component_kind("thing", object)  # type: ignore[arg-type]


def test_rule_3_2_component_scope_rejects_unregistered_kind() -> None:
    with (
        pytest.raises(ValueError, match="unknown component kind 'nonesuch'"),
        component_scope("x", kind="nonesuch"),
    ):
        pass


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("transformer", "transformer"),
        ("Transformer", "transformer"),
        ("transformer_2", "transformer"),
        ("dit", "transformer"),
        ("text_encoder", "text_encoder"),
        ("text_encoder_2", "text_encoder"),
        ("text_encoder_3", "text_encoder"),
        ("t5_text_encoder", "text_encoder"),
        ("image_encoder", "image_encoder"),
        ("vae", "vae"),
        ("video_vae", "vae"),
        ("audio_vae", "audio_vae"),
        ("my_audio_vae", "audio_vae"),
        ("vocoder", "vocoder"),
        ("connector", "connector"),
        ("connectors", "connector"),
        ("bridge", "bridge"),
        ("foley_model", "generic"),
        ("vaetransformer", "generic"),
    ],
)
def test_rule_3_2_component_kind_maps_names_to_kinds(name: str, kind: str) -> None:
    assert component_kind(name) == kind


def test_rule_3_2_global_preference_is_relaxed_with_platform_default_fallback() -> None:
    cfg = SelectionConfig(global_backend="sage_attn", global_backend_explicit=False)
    with component_scope("transformer"):
        res = resolve(FA_SDPA, config=cfg, platform=CUDA_FA)
    assert (res.backend.name, res.origin, res.reason) == (
        "fa",
        "global_preference",
        "platform default fallback",
    )
    assert transitions(res.trace)[1] == ("requested", "preference_fallback", "component_default")


# =============================================================================
# 3.3 Sparse backends never serve cross-attention
# =============================================================================

CROSS_128 = LayerSpec(128, "bf16", role="cross")
SELF_128 = LayerSpec(128, "bf16", role="self")


def _request(kind: str, backend: str, layer: LayerSpec, platform: Platform) -> Resolution:
    if kind == "layer":
        return resolve(layer, platform=platform, backend=backend)
    if kind == "forced":
        return resolve(layer, platform=platform, config=SelectionConfig(forced_backend=backend))
    if kind == "force_backend":
        with force_backend(backend):
            return resolve(layer, platform=platform)
    if kind in ("role_override", "component_override"):
        # the scope-exit check (an override that ran on no layer) is tested in test_scope
        roles = {layer.role: backend} if kind == "role_override" else None
        found: list[Resolution] = []
        with (
            contextlib.suppress(BackendNotAppliedError),
            component_scope(
                "transformer",
                backend=None if roles else backend,
                role_backends=roles,
            ),
        ):
            found.append(resolve(layer, platform=platform))
        return found[0]
    if kind == "config_component_override":
        cfg = SelectionConfig(component_backends={"transformer": backend})
        with component_scope("transformer"):
            return resolve(layer, platform=platform, config=cfg)
    if kind == "global_cli_strict":
        with component_scope("transformer"):
            return resolve(layer, platform=platform, config=SelectionConfig(global_backend=backend))
    if kind == "global_cli_relaxed":
        with component_scope("vae"):
            return resolve(layer, platform=platform, config=SelectionConfig(global_backend=backend))
    if kind == "global_preference":
        cfg = SelectionConfig(global_backend=backend, global_backend_explicit=False)
        return resolve(layer, platform=platform, config=cfg)
    if kind == "layer_default":
        import attrs

        return resolve(attrs.evolve(layer, default=backend), platform=platform)
    raise AssertionError(kind)


ALL_REQUEST_KINDS = [
    ("layer", "layer"),
    ("forced", "forced"),
    ("force_backend", "forced"),
    ("role_override", "role_override"),
    ("component_override", "component_override"),
    ("config_component_override", "component_override"),
    ("global_cli_strict", "global_cli"),
    ("global_cli_relaxed", "global_cli"),
    ("global_preference", "global_preference"),
    ("layer_default", "layer_default"),
]


@pytest.mark.parametrize(("kind", "origin"), ALL_REQUEST_KINDS)
def test_rule_3_3_sparse_on_cross_falls_back_to_dense_for_every_origin(
    kind: str, origin: str
) -> None:
    res = _request(kind, "sliding_tile_attn", CROSS_128, CUDA_ALL)
    assert res.origin == origin
    assert res.reason == "dense cross-attention fallback"
    assert res.backend.name == "fa3"  # the Hopper chain's first, usable here (issue 31)
    assert not res.backend.is_sparse
    trans = transitions(res.trace)
    assert ("requested", "sparse_cross_fallback", "component_default") in trans
    role = [r for r in checks_of(res.trace, "sliding_tile_attn") if r.check is Check.ROLE]
    assert len(role) == 1 and not role[0].passed
    assert [f.code for f in role[0].failures] == ["sparse_cross_attention"]
    assert_well_formed(res.trace)


@pytest.mark.parametrize("sparse", SPARSE)
@pytest.mark.parametrize(("kind", "origin"), ALL_REQUEST_KINDS)
def test_rule_3_3_sparse_never_serves_cross_attention_even_without_supported_set(
    sparse: str, kind: str, origin: str
) -> None:
    layer = LayerSpec(128, "bf16", role="cross")
    res = _request(kind, sparse, layer, CUDA_ALL)
    assert layer.supported is None
    assert not res.backend.is_sparse
    assert res.reason == "dense cross-attention fallback"


@pytest.mark.parametrize(
    "supported",
    [
        {"sliding_tile_attn"},
        {"sliding_tile_attn", "video_sparse_attn"},
        set(SPARSE),
    ],
)
def test_rule_3_3_sparse_never_serves_cross_attention_even_when_only_sparse_supported(
    supported: set[str],
) -> None:
    layer = LayerSpec(128, "bf16", role="cross", supported=supported)
    err = rejected(layer, platform=CUDA_ALL)
    assert err.code == "no_compatible_backend"
    assert "No compatible attention backend is available" in str(err)
    for name in supported:
        role = [r for r in checks_of(err.trace, name) if r.check is Check.ROLE]
        assert role and not role[0].passed
    assert_well_formed(err.trace)


def test_rule_3_3_sparse_requested_on_cross_with_only_sparse_supported_is_rejected() -> None:
    layer = LayerSpec(128, "bf16", role="cross", supported={"sliding_tile_attn"})
    with (
        pytest.raises(ResolutionError) as info,
        component_scope("transformer", backend="sliding_tile_attn"),
    ):
        resolve(layer, platform=CUDA_ALL)
    err = info.value
    assert "Sparse attention backend 'sliding_tile_attn' cannot serve cross-attention" in str(err)
    assert "No compatible attention backend is available" in str(err)
    assert str(err).endswith(" for component 'transformer'")


@pytest.mark.parametrize(("kind", "origin"), ALL_REQUEST_KINDS)
def test_rule_3_3_sparse_on_self_attention_is_served(kind: str, origin: str) -> None:
    res = _request(kind, "sliding_tile_attn", SELF_128, CUDA_ALL)
    assert (res.backend.name, res.origin, res.reason) == ("sliding_tile_attn", origin, None)


def test_rule_3_3_sparse_on_self_attention_still_needs_the_platform() -> None:
    # sliding_tile_attn: Hopper only, bf16 only, head sizes {64, 128}
    ok = resolve(SELF_128, platform=CUDA_ALL, backend="sliding_tile_attn")
    assert ok.backend.name == "sliding_tile_attn"
    for platform, layer, code in [
        (Platform.simulate("cuda:sm80+all"), SELF_128, "compute_capability"),
        (CUDA_ALL, LayerSpec(128, "fp16"), "dtype"),
        (CUDA_ALL, LayerSpec(96, "bf16"), "head_size"),
        (CUDA_FA, SELF_128, "package_missing"),
    ]:
        err = rejected(layer, platform=platform, backend="sliding_tile_attn")
        codes = [c for cs in failure_codes(err.trace, "sliding_tile_attn").values() for c in cs]
        assert code in codes


def test_rule_3_3_sparse_cross_fallback_reason_kept_over_later_failures() -> None:
    # on cuda without flash-attn the platform chain's fa fails too: the reason
    # is still the first one set, dense cross-attention fallback
    res = resolve(CROSS_128, platform=CUDA, backend="sliding_tile_attn")
    assert (res.backend.name, res.reason) == ("torch_sdpa", "dense cross-attention fallback")


# =============================================================================
# 3.4 Candidates and stages
# =============================================================================


def test_rule_3_4_candidates_evaluated_in_stage_order_skipping_duplicates() -> None:
    # requested torch_sdpa (layer default) cannot do packed varlen; fa is not
    # installed; xformers (supported set) can.
    layer = LayerSpec(
        64,
        "bf16",
        supported={"torch_sdpa", "xformers"},
        default="torch_sdpa",
        requirements=["packed_varlen"],
    )
    platform = Platform.simulate("cuda:sm90+xformers")
    res = resolve(layer, platform=platform)
    assert (res.backend.name, res.origin, res.reason) == (
        "xformers",
        "layer_default",
        "platform default fallback",
    )
    # fa3 and fa are preferred by the Hopper chain only where usable: neither
    # package is installed, so they are passed over (a skip record says why), not
    # evaluated.
    assert evaluated(res.trace) == [
        ("requested", "torch_sdpa"),
        ("supported_set", "xformers"),
    ]
    assert skipped(res.trace) == [
        ("component_default", "torch_sdpa"),
        ("platform_default", "fa3"),
        ("platform_default", "fa"),
        ("platform_default", "torch_sdpa"),
        ("supported_set", "torch_sdpa"),
    ]
    fa_skip = next(
        r for r in res.trace.records if isinstance(r, SkipRecord) and r.candidate.name == "fa"
    )
    assert fa_skip.detail == (
        "preferred on cuda only where usable: package 'flash_attn' is not installed"
    )
    skip = next(r for r in res.trace.records if isinstance(r, SkipRecord))
    assert skip.detail == "already evaluated at requested"
    assert_well_formed(res.trace)


def test_rule_3_4_stage_order_requested_default_platform_supported() -> None:
    layer = LayerSpec(64, "bf16", supported={"eager", "torch_cudnn_sdpa", "fa"}, default="fa3")
    with component_scope("vae"):
        err = rejected(
            attrs_evolve(layer, requirements=Requirements(packed_varlen=True)),
            platform=CUDA,
            config=SAGE,
        )
    assert evaluated(err.trace) == [
        ("requested", "sage_attn"),
        ("component_default", "fa3"),
        ("platform_default", "torch_sdpa"),
        ("supported_set", "eager"),
        ("supported_set", "torch_cudnn_sdpa"),
        ("supported_set", "fa"),
    ]
    # flash_attn is not installed: the Hopper chain passes over fa3 (evaluated
    # already) and fa (not usable here), so fa is first evaluated in the
    # supported-set stage.
    assert skipped(err.trace) == [("platform_default", "fa3"), ("platform_default", "fa")]
    assert [s.value for s in M.CANDIDATE_STAGES] == [
        "requested",
        "component_default",
        "platform_default",
        "supported_set",
    ]


def attrs_evolve(layer: LayerSpec, **changes: Any) -> LayerSpec:
    import attrs

    return attrs.evolve(layer, **changes)


def test_rule_3_4_supported_set_order_is_deterministic() -> None:
    a = LayerSpec(64, "bf16", supported=["xformers", "eager", "fa", "torch_cudnn_sdpa"])
    b = LayerSpec(64, "bf16", supported=["torch_cudnn_sdpa", "fa", "eager", "xformers"])
    ta = M.run_machine(TraceInput(a, SelectionConfig(), None, CUDA))
    tb = M.run_machine(TraceInput(b, SelectionConfig(), None, CUDA))
    assert ta == tb and ta.digest == tb.digest
    # fa (not installed) is passed over by the chain, torch_sdpa is not in the
    # supported set, then the supported set in catalogue order: eager first.
    assert [n for _, n in evaluated(ta)] == ["torch_sdpa", "eager"]


def test_rule_3_4_checks_run_in_order_and_collect_every_failure() -> None:
    layer = LayerSpec(
        256, "fp32", supported={"torch_sdpa"}, requirements=["attn_mask", "packed_varlen"]
    )
    with pytest.raises(ResolutionError) as info, component_scope("vae", backend="sage_attn"):
        resolve(layer, platform=CPU)
    trace = info.value.trace
    records = checks_of(trace, "sage_attn")
    assert [r.check for r in records] == list(M.CHECK_ORDER)
    assert [c.value for c in M.CHECK_ORDER] == [
        "known",
        "available",
        "platform",
        "role",
        "supported",
        "requirements",
    ]
    assert [r.passed for r in records] == [True, False, False, True, False, False]
    assert failure_codes(trace, "sage_attn") == {
        "available": ["package_missing"],
        "platform": ["platform_kind", "dtype", "head_size"],
        "supported": ["not_in_supported_set"],
        "requirements": ["requirement_unmet", "requirement_unmet"],
    }
    messages = {r.check.value: [f.message for f in r.failures] for r in records}
    assert messages["available"] == ["package 'sageattention' is not installed"]
    assert messages["platform"][0] == "runs on cuda, not on cpu"
    assert "float32" in messages["platform"][1]
    assert "256" in messages["platform"][2]
    assert messages["supported"] == ["not in the layer's supported set ['torch_sdpa']"]
    assert messages["requirements"] == [
        "does not implement attention masks",
        "does not implement packed varlen attention",
    ]
    # the error names the primary failure and still lists every other one
    text = str(info.value)
    assert text.startswith(
        "Attention backend 'sage_attn' is not supported by this attention layer; "
        "supported backends: ['torch_sdpa']"
    )
    for part in [
        "package 'sageattention' is not installed",
        "runs on cuda, not on cpu",
        "does not implement attention masks",
        "does not implement packed varlen attention",
    ]:
        assert part in text
    assert info.value.code == "not_in_supported_set"


def test_rule_3_4_check_candidate_returns_every_check_in_order() -> None:
    results = M.check_candidate(Backend("fa"), LayerSpec(64, "bf16"), CUDA_FA)
    assert [c for c, _ in results] == list(M.CHECK_ORDER)
    assert all(not f for _, f in results)


def test_rule_3_4_check_known_fails_for_an_unregistered_backend() -> None:
    ghost = Backend("ghost_attn")  # a name the registry does not hold
    results = M.check_candidate(ghost, LayerSpec(64, "bf16"), CPU)
    assert len(results) == 1
    check, failures = results[0]
    assert check is Check.KNOWN
    assert [f.code for f in failures] == ["unknown_backend"]
    # strict: rejected naming the backend; relaxed: moves on
    err = rejected(LayerSpec(64, "fp32"), platform=CPU, backend=ghost)
    assert str(err).startswith("Unknown attention backend 'ghost_attn'")
    assert err.code == "unknown_backend"
    res = resolve(LayerSpec(64, "fp32", default=ghost), platform=CPU)
    assert (res.backend.name, res.reason) == ("torch_sdpa", "platform default fallback")


def test_rule_3_4_known_check_follows_the_registry() -> None:
    spec = BackendSpec(
        name="test_machine_dense", sparse=False, platforms=("cpu",), dtypes=("float32",)
    )
    backend = register_backend(spec)
    try:
        res = resolve(LayerSpec(64, "fp32"), platform=CPU, backend=backend)
        assert res.backend == backend
    finally:
        unregister_backend(backend)
    attnres.clear_cache()
    err = rejected(LayerSpec(64, "fp32"), platform=CPU, backend=backend)
    assert err.code == "unknown_backend"


def test_rule_3_4_alias_torch_cudnn_sdpa_satisfies_torch_sdpa() -> None:
    layer = LayerSpec(64, "bf16", supported={"torch_sdpa"})
    res = resolve(layer, platform=CUDA, backend="torch_cudnn_sdpa")
    assert (res.backend.name, res.reason) == ("torch_cudnn_sdpa", None)
    supported = [r for r in checks_of(res.trace, "torch_cudnn_sdpa") if r.check is Check.SUPPORTED]
    assert supported[0].passed


def test_rule_3_4_alias_dynamic_cudnn_sdpa_needs_both_fa_and_torch_sdpa() -> None:
    both = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"})
    assert resolve(both, platform=CUDA, backend="dynamic_cudnn_sdpa").backend.name == (
        "dynamic_cudnn_sdpa"
    )
    for partial in ({"torch_sdpa"}, {"fa"}):
        err = rejected(
            LayerSpec(64, "bf16", supported=partial), platform=CUDA, backend="dynamic_cudnn_sdpa"
        )
        assert err.code == "not_in_supported_set"
        assert str(err).startswith(
            "Attention backend 'dynamic_cudnn_sdpa' is not supported by this attention layer"
        )


def test_rule_3_4_alias_does_not_work_the_other_way() -> None:
    layer = LayerSpec(64, "bf16", supported={"torch_cudnn_sdpa"})
    err = rejected(layer, platform=CUDA, backend="torch_sdpa")
    assert err.code == "not_in_supported_set"


ROUTE = "transformers attention interface"


def test_rule_3_4_exact_route_admits_no_stand_in_strict_rejects_naming_the_route() -> None:
    # SUPPORTED_RULES row 2: a layer whose route runs exactly its supported set
    # (LayerSpec.exact_route) takes only the named backends; the machine decides
    # it (code not_on_route), not the integration after the fact (issue 21)
    layer = LayerSpec(64, "bf16", supported={"torch_sdpa", "eager"}, exact_route=ROUTE)
    err = rejected(layer, platform=CUDA, backend="torch_cudnn_sdpa")
    assert err.code == "not_on_route"
    assert str(err).startswith(
        f"Attention backend 'torch_cudnn_sdpa' cannot run on this layer's route ({ROUTE}), "
        f"which runs exactly ['eager', 'torch_sdpa']: 'torch_cudnn_sdpa' only stands in for "
        f"['torch_sdpa']; request one of ['eager', 'torch_sdpa']"
    )
    assert err.trace.outcome.status == "rejected" and err.trace.outcome.code == "not_on_route"
    assert failure_codes(err.trace, "torch_cudnn_sdpa") == {"supported": ["not_on_route"]}
    # the same set without a route: the stand-in is admitted (row 1)
    plain = attrs.evolve(layer, exact_route=None)
    assert resolve(plain, platform=CUDA, backend="torch_cudnn_sdpa").backend.name == (
        "torch_cudnn_sdpa"
    )
    # a named backend passes; one outside the set keeps its own code
    assert resolve(layer, platform=CUDA, backend="torch_sdpa").backend.name == "torch_sdpa"
    assert rejected(layer, platform=CUDA, backend="sage_attn").code == "not_in_supported_set"
    both = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}, exact_route=ROUTE)
    assert rejected(both, platform=CUDA, backend="dynamic_cudnn_sdpa").code == "not_on_route"


def test_rule_requirements_before_supported_weights_named_before_the_set() -> None:
    # machine.REQUIREMENTS_BEFORE_SUPPORTED (issue 19): an MHA whose caller asks for
    # its attention weights runs only its own code (eager math), a route limited *by*
    # the requirement: a strict kernel that fails both is rejected for the weights
    weights = Requirements(weights=True)
    layer = LayerSpec(64, "bf16", supported={"eager"}, exact_route=ROUTE, requirements=weights)
    err = rejected(layer, platform=CUDA, backend="sage_attn")
    assert err.code == "requirement_unmet"
    assert str(err).startswith(
        "Attention backend 'sage_attn' does not implement returning the attention weights"
    )
    assert "supported: not in the layer's supported set ['eager']" in str(err)  # still said
    assert failure_codes(err.trace, "sage_attn")["supported"] == ["not_in_supported_set"]
    assert err.trace.outcome.code == "requirement_unmet"
    assert replay(err.trace).ok
    # eager meets it; without the requirement the same set names the set (as before)
    assert resolve(layer, platform=CUDA, backend="eager").backend.name == "eager"
    plain = attrs.evolve(layer, requirements=Requirements())
    assert rejected(plain, platform=CUDA, backend="sage_attn").code == "not_in_supported_set"
    # another requirement the candidate lacks does not move the set behind it
    softcap = attrs.evolve(layer, requirements=Requirements(softcap=True))
    assert rejected(softcap, platform=CUDA, backend="sage_attn").code == "not_in_supported_set"


def test_rule_3_4_exact_route_a_relaxed_origin_falls_back_traced() -> None:
    layer = LayerSpec(64, "bf16", supported={"torch_sdpa"}, default="torch_sdpa", exact_route=ROUTE)
    flag = SelectionConfig(global_backend="torch_cudnn_sdpa")  # relaxed by the default
    res = resolve(layer, platform=CUDA, config=flag)
    assert (res.backend.name, res.reason, res.origin) == (
        "torch_sdpa",
        Reason.GLOBAL_BACKEND_FALLBACK,
        Origin.GLOBAL_CLI,
    )
    assert failure_codes(res.trace, "torch_cudnn_sdpa") == {"supported": ["not_on_route"]}
    assert res.trace.input.layer.exact_route == ROUTE
    # a derived preference (relaxed, no default) falls back to the platform's chain
    cudnn = LayerSpec(64, "bf16", supported={"torch_sdpa"}, exact_route=ROUTE)
    pref = SelectionConfig(global_backend="torch_cudnn_sdpa", global_backend_explicit=False)
    res = resolve(cudnn, platform=CUDA, config=pref)
    assert (res.backend.name, res.reason) == ("torch_sdpa", Reason.PLATFORM_DEFAULT_FALLBACK)


def test_rule_3_5_reason_softmax_attention_written_by_hand() -> None:
    # issue 30 (machine.written_by_hand, REQUEST_FAILURE_GUARDS): a layer whose route
    # runs exactly eager -- the site's own code, computing softmax attention by hand,
    # where no kernel is offered -- falls back for a relaxed request with this reason
    # (not the origin's generic one); a strict request is rejected as before
    by_hand = "the site's own code (softmax attention written by hand in X)"
    layer = LayerSpec(64, "bf16", supported={"eager"}, default="eager", exact_route=by_hand)
    assert M.written_by_hand(layer)
    flag = SelectionConfig(global_backend="torch_sdpa")  # relaxed by the default
    res = resolve(layer, platform=CUDA, config=flag)
    assert (res.backend.name, res.reason, res.origin) == (
        "eager",
        Reason.WRITTEN_BY_HAND,
        Origin.GLOBAL_CLI,
    )
    assert str(res.reason) == "softmax attention written by hand"
    assert replay(res.trace).ok
    # a derived preference too (the platform's fallback reason otherwise)
    pref = SelectionConfig(global_backend="sage_attn", global_backend_explicit=False)
    assert resolve(layer, platform=CUDA, config=pref).reason is Reason.WRITTEN_BY_HAND
    # an explicit eager is the site's own code: selected, no reason
    assert resolve(layer, platform=CUDA, backend="eager").reason is None
    # strict: rejected, naming the set (the integration appends the route)
    strict = attrs.evolve(layer, default=None)
    assert rejected(strict, platform=CUDA, backend="torch_sdpa").code == "not_in_supported_set"
    # not by hand: a route that runs another set, or eager with no route
    assert not M.written_by_hand(attrs.evolve(layer, exact_route=None))
    other = LayerSpec(64, "bf16", supported={"torch_sdpa"}, default="torch_sdpa", exact_route=ROUTE)
    assert not M.written_by_hand(other)
    assert resolve(other, platform=CUDA, config=flag).reason is None  # torch_sdpa itself


@pytest.mark.parametrize(
    ("platform", "backend", "reason"),
    [
        ("cuda:sm90+flash_attn", "fa", None),
        ("cuda:sm80+flash_attn", "fa", None),
        # a preference that is not usable here is passed over, not a fallback
        ("cuda:sm90", "torch_sdpa", None),
        ("cuda:sm70+flash_attn", "torch_sdpa", None),
        ("rocm:gfx942+aiter", "aiter", None),
        ("rocm:gfx942", "torch_sdpa", None),
        ("npu+torch_npu", "ascend_fa", None),
        ("npu", "torch_sdpa", None),
        ("cpu", "torch_sdpa", None),
        ("cpu+all", "torch_sdpa", None),
        ("mps", "torch_sdpa", None),
        ("xpu", "torch_sdpa", None),
    ],
)
def test_rule_3_4_platform_default_chain_per_kind(
    platform: str, backend: str, reason: str | None
) -> None:
    res = resolve(LayerSpec(64, "bf16"), platform=Platform.simulate(platform))
    assert (res.backend.name, res.origin, res.reason) == (backend, "none", reason)
    assert {s for s, _ in evaluated(res.trace)} == {"platform_default"}


@pytest.mark.parametrize(
    ("kind", "chain"),
    [
        ("cuda", ["fa", "torch_sdpa"]),
        ("rocm", ["aiter", "torch_sdpa"]),
        ("npu", ["ascend_fa", "torch_sdpa"]),
        ("cpu", ["torch_sdpa"]),
        ("mps", ["torch_sdpa"]),
        ("xpu", ["torch_sdpa"]),
    ],
)
def test_rule_3_4_platform_default_stage_candidates(kind: str, chain: list[str]) -> None:
    inp = TraceInput(LayerSpec(64, "bf16"), SelectionConfig(), None, Platform.simulate(kind))
    assert [b.name for b in M.stage_candidates(State.PLATFORM_DEFAULT, inp, None)] == chain


def test_rule_3_4_package_missing_is_recorded() -> None:
    err = rejected(LayerSpec(64, "bf16"), platform=CUDA, backend="sage_attn")
    assert failure_codes(err.trace, "sage_attn") == {"available": ["package_missing"]}
    assert err.code == "package_missing"
    assert str(err) == (
        "Attention backend 'sage_attn' is not available: package 'sageattention' is not installed"
    )


def test_rule_3_4_package_broken_is_recorded_with_the_import_error() -> None:
    detail = "import failed: OSError: libcudart.so.13: undefined symbol: cudaFoo"
    broken = Platform(
        kind="cuda",
        device_name="H100",
        capability=(9, 0),
        arch="sm90",
        torch_version="2.9.0",
        packages=[PackageFact("sageattention", "broken", None, detail)],
    )
    err = rejected(LayerSpec(64, "bf16"), platform=broken, backend="sage_attn")
    assert failure_codes(err.trace, "sage_attn") == {"available": ["package_broken"]}
    assert err.code == "package_broken"
    assert "package 'sageattention' is broken" in str(err)
    assert "undefined symbol: cudaFoo" in str(err)
    # relaxed: the broken package is recorded and the machine moves on
    res = resolve(LayerSpec(64, "bf16", default="sage_attn"), platform=broken)
    assert (res.backend.name, res.reason) == ("torch_sdpa", "platform default fallback")
    avail = [r for r in checks_of(res.trace, "sage_attn") if r.check is Check.AVAILABLE]
    assert "undefined symbol" in avail[0].failures[0].message


def test_rule_3_4_missing_package_with_a_reason_keeps_it() -> None:
    p = Platform(
        kind="cuda",
        capability=(9, 0),
        arch="sm90",
        packages=[PackageFact("flash_attn", "missing", None, "module 'flash_attn' belongs to X")],
    )
    err = rejected(LayerSpec(64, "bf16"), platform=p, backend="fa")
    assert "package 'flash_attn' is not installed (module 'flash_attn' belongs to X)" in str(err)


def test_rule_3_4_compute_capability_sage_attn_refused_on_sm100() -> None:
    sm100 = Platform.simulate("cuda:sm100+all")
    err = rejected(LayerSpec(64, "bf16"), platform=sm100, backend="sage_attn")
    assert failure_codes(err.trace, "sage_attn") == {"platform": ["compute_capability"]}
    assert err.code == "compute_capability"
    assert "sm100" in str(err)
    # and accepted on Hopper
    assert resolve(LayerSpec(64, "bf16"), platform=CUDA_ALL, backend="sage_attn").reason is None


def test_rule_3_4_unknown_compute_capability_is_a_failure() -> None:
    err = rejected(
        LayerSpec(64, "bf16"), platform=Platform.simulate("cuda+all"), backend="sage_attn"
    )
    assert failure_codes(err.trace, "sage_attn") == {"platform": ["compute_capability"]}
    assert "unknown" in str(err)


def test_rule_3_4_head_size_limit() -> None:
    err = rejected(LayerSpec(256, "bf16"), platform=CUDA_ALL, backend="sage_attn")
    assert failure_codes(err.trace, "sage_attn") == {"platform": ["head_size"]}
    assert "head size 256 exceeds the maximum 128" in str(err)
    assert resolve(LayerSpec(128, "bf16"), platform=CUDA_ALL, backend="sage_attn")


def test_rule_3_4_dtype_limit() -> None:
    err = rejected(LayerSpec(64, "fp32"), platform=CUDA_ALL, backend="sage_attn")
    assert failure_codes(err.trace, "sage_attn") == {"platform": ["dtype"]}
    assert "does not take dtype float32" in str(err)


def test_rule_3_4_platform_kind_mismatch() -> None:
    err = rejected(
        LayerSpec(64, "bf16"), platform=Platform.simulate("rocm:gfx942+all"), backend="sage_attn"
    )
    assert failure_codes(err.trace, "sage_attn") == {"platform": ["platform_kind"]}


def test_rule_3_4_rocm_architecture() -> None:
    err = rejected(
        LayerSpec(64, "bf16"), platform=Platform.simulate("rocm:gfx90a+aiter"), backend="aiter"
    )
    assert failure_codes(err.trace, "aiter") == {"platform": ["architecture"]}


@pytest.mark.parametrize(("kind", "origin"), ALL_REQUEST_KINDS)
def test_rule_3_4_requirement_attn_mask_never_gets_sage_attn(kind: str, origin: str) -> None:
    layer = LayerSpec(64, "bf16", requirements=["attn_mask"])
    strict = origin in {"layer", "forced", "role_override", "component_override"} or (
        kind == "global_cli_strict"
    )
    if strict:
        with pytest.raises(ResolutionError) as info:
            _request(kind, "sage_attn", layer, CUDA_ALL)
        assert "Attention backend 'sage_attn' does not implement attention masks" in str(info.value)
        assert info.value.code == "requirement_unmet"
    else:
        res = _request(kind, "sage_attn", layer, CUDA_ALL)
        assert res.backend.name == "torch_sdpa"  # fa does not take masks either
        assert res.reason in {"global backend fallback", "platform default fallback"}


def test_rule_3_4_packed_varlen_selects_fa() -> None:
    layer = LayerSpec(128, "bf16", requirements=["packed_varlen"])
    res = resolve(layer, platform=CUDA_FA)
    assert (res.backend.name, res.reason) == ("fa", None)
    err = rejected(layer, platform=CUDA_FA, backend="torch_sdpa")
    assert "Attention backend 'torch_sdpa' does not implement packed varlen attention" in str(err)


def test_rule_3_4_selected_backend_passes_every_check() -> None:
    res = resolve(LayerSpec(64, "bf16", requirements=["causal", "gqa"]), platform=CUDA_FA)
    checks = checks_of(res.trace, res.backend.name)
    assert [r.check for r in checks] == list(M.CHECK_ORDER)
    assert all(r.passed for r in checks)


# =============================================================================
# 3.5 Outcome and reasons
# =============================================================================


def test_rule_3_5_reason_strings_are_exact() -> None:
    # the machine's reasons, and autotune's (set after measuring, never by the machine)
    # (issue 23: and the sglang profile's role-override reasons, tests/test_profile_sglang.py)
    sglang = {r.value for r in ROLE_OVERRIDE_REASONS.values()}
    assert {r.value for r in Reason} == (REASONS - {None}) | {"measured faster"} | sglang


def test_rule_3_5_reason_none_when_first_candidate_accepted() -> None:
    ok = resolve(LayerSpec(64, "bf16"), platform=CUDA_SAGE, config=SAGE)
    assert (ok.backend.name, ok.reason) == ("sage_attn", None)
    assert SelectedRecord(Backend("sage_attn"), Origin.GLOBAL_CLI, None) == ok.trace.records[-1]


def test_rule_3_5_reason_global_backend_fallback() -> None:
    with component_scope("text_encoder"):
        res = resolve(LayerSpec(64, "bf16"), config=SAGE, platform=CUDA_FA)
    assert (res.backend.name, res.reason) == ("fa", "global backend fallback")


def test_rule_3_5_reason_platform_default_fallback() -> None:
    # the layer's default (a relaxed request) cannot run here: the platform
    # default serves, and the reason says so
    res = resolve(LayerSpec(64, "bf16", default="fa"), platform=CUDA)
    assert (res.backend.name, res.origin, res.reason) == (
        "torch_sdpa",
        "layer_default",
        "platform default fallback",
    )


def test_rule_3_4_unusable_platform_preference_is_passed_over_without_a_reason() -> None:
    res = resolve(LayerSpec(64, "bf16"), platform=CUDA)
    assert (res.backend.name, res.reason) == ("torch_sdpa", None)
    assert skipped(res.trace) == [("platform_default", "fa3"), ("platform_default", "fa")]
    # fp32 on a machine with flash-attn: neither takes fp32, passed over too
    res32 = resolve(LayerSpec(64, "fp32"), platform=CUDA_ALL)
    assert (res32.backend.name, res32.reason) == ("torch_sdpa", None)
    assert skipped(res32.trace) == [("platform_default", "fa3"), ("platform_default", "fa")]


def test_rule_3_5_reason_dense_cross_attention_fallback() -> None:
    with component_scope("transformer", backend="video_sparse_attn"):
        resolve(LayerSpec(128, "bf16"), platform=CUDA_ALL)  # the override runs here
        res = resolve(CROSS_128, platform=CUDA_ALL)
    assert (res.backend.name, res.reason) == ("fa3", "dense cross-attention fallback")


def test_rule_3_5_reason_component_constraint() -> None:
    res = resolve(LayerSpec(64, "fp32", supported={"eager"}), platform=CPU)
    assert (res.backend.name, res.origin, res.reason) == ("eager", "none", "component constraint")
    assert transitions(res.trace)[0] == ("origin_detection", "single_supported", "supported_set")
    assert evaluated(res.trace) == [("supported_set", "eager")]


def test_rule_3_5_component_constraint_only_when_nothing_requested() -> None:
    layer = LayerSpec(64, "fp32", supported={"eager"})
    res = resolve(layer, platform=CPU, config=SelectionConfig(global_backend="eager"))
    assert (res.origin, res.reason) == ("global_cli", None)
    with_default = resolve(
        LayerSpec(64, "fp32", supported={"eager"}, default="eager"), platform=CPU
    )
    assert (with_default.origin, with_default.reason) == ("layer_default", None)
    two = resolve(LayerSpec(64, "fp32", supported={"eager", "torch_sdpa"}), platform=CPU)
    assert (two.backend.name, two.reason) == ("torch_sdpa", None)


def test_rule_3_5_component_constraint_single_backend_that_cannot_run_is_rejected() -> None:
    err = rejected(LayerSpec(64, "bf16", supported={"fa"}), platform=CPU)
    assert err.code == "no_compatible_backend"
    assert str(err).startswith("No compatible attention backend is available")


def test_rule_3_5_resolution_error_is_a_value_error_carrying_the_trace() -> None:
    err = rejected(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert isinstance(err, ValueError)
    assert isinstance(err.trace, Trace)
    assert err.trace.outcome.status == "rejected"
    assert err.trace.outcome.error == str(err)
    assert isinstance(err.trace.records[-1], RejectedRecord)
    assert err.trace.records[-1].error == str(err)
    assert issubclass(ResolutionError, ValueError)


def test_rule_3_5_error_ends_with_component_inside_a_scope() -> None:
    with pytest.raises(ResolutionError) as info, component_scope("text_encoder_2", backend="fa"):
        resolve(LayerSpec(64, "fp32"), platform=CPU)
    assert str(info.value).endswith(" for component 'text_encoder_2'")


def test_rule_3_5_error_has_no_component_suffix_outside_a_scope() -> None:
    err = rejected(LayerSpec(64, "fp32"), platform=CPU, backend="fa")
    assert "for component" not in str(err)


def test_rule_3_5_message_not_supported_by_this_layer() -> None:
    err = rejected(
        LayerSpec(64, "bf16", supported={"torch_sdpa", "fa"}),
        platform=CUDA_ALL,
        backend="sage_attn",
    )
    assert str(err) == (
        "Attention backend 'sage_attn' is not supported by this attention layer; "
        "supported backends: ['fa', 'torch_sdpa']"
    )


def test_rule_3_5_message_sparse_backend_cannot_serve_cross_attention() -> None:
    layer = LayerSpec(128, "bf16", role="cross", supported={"sliding_tile_attn"})
    err = rejected(layer, platform=CUDA_ALL, backend="sliding_tile_attn")
    assert "Sparse attention backend 'sliding_tile_attn' cannot serve cross-attention" in str(err)


def test_rule_3_5_message_packed_varlen() -> None:
    err = rejected(
        LayerSpec(64, "bf16", requirements=["packed_varlen"]),
        platform=CUDA_ALL,
        backend="sage_attn",
    )
    assert str(err) == "Attention backend 'sage_attn' does not implement packed varlen attention"


def test_rule_3_5_message_no_compatible_backend() -> None:
    layer = LayerSpec(64, "bf16", supported={"fa", "sage_attn"})
    err = rejected(layer, platform=CPU)
    assert str(err).startswith("No compatible attention backend is available: tried ")
    for part in [
        "torch_sdpa (platform_default)",
        "fa (supported_set)",
        "sage_attn (supported_set)",
    ]:
        assert part in str(err)
    assert err.code == "no_compatible_backend"
    assert err.trace.outcome.code == "no_compatible_backend"


def test_rule_3_5_unknown_backend_lists_valid_names_and_suggests() -> None:
    with pytest.raises(UnknownBackendError) as info:
        resolve(LayerSpec(64, "bf16"), platform=CPU, backend="sage_atten")
    err = info.value
    assert isinstance(err, ValueError)
    assert err.suggestion == "sage_attn"
    assert "Did you mean 'sage_attn'?" in str(err)
    for name in ("torch_sdpa", "fa", "sage_attn", "sliding_tile_attn", "xformers", "aiter"):
        assert name in str(err)
    with pytest.raises(UnknownBackendError, match="Valid backends: "):
        Backend.parse("qqqqqqqqqqqq")


def test_rule_3_5_backend_names_are_case_insensitive_with_aliases() -> None:
    assert Backend.parse("SAGE_ATTN") == Backend("sage_attn")
    assert Backend.parse("sdpa") == Backend("torch_sdpa")
    assert Backend.parse("flash_attn") == Backend("fa")
    res = resolve(LayerSpec(64, "fp32"), platform=CPU, backend="SDPA")
    assert res.backend == Backend("torch_sdpa")


def test_rule_3_5_resolution_fields() -> None:
    with component_scope("vae"):
        res = resolve(LayerSpec(64, "fp32", name="decoder.attn"), platform=CPU)
    assert isinstance(res, Resolution)
    assert (res.component, res.layer) == ("vae", "decoder.attn")
    assert isinstance(res.backend, Backend)
    assert isinstance(res.origin, str)


# =============================================================================
# The seed incident (SPEC 1), one test per case
# =============================================================================


def test_seed_global_sage_attn_on_audio_vae_falls_back_to_the_layer_default() -> None:
    with component_scope("audio_vae"):
        res = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    assert (res.backend.name, res.origin, res.reason) == (
        "torch_sdpa",
        "global_cli",
        "global backend fallback",
    )
    assert evaluated(res.trace) == [
        ("requested", "sage_attn"),
        ("component_default", "torch_sdpa"),
    ]


def test_seed_global_sage_attn_on_transformer_without_default_is_rejected() -> None:
    with pytest.raises(ResolutionError) as info, component_scope("transformer"):
        resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    text = str(info.value)
    assert text.startswith(
        "Attention backend 'sage_attn' is not supported by this attention layer; "
        "supported backends: ['fa', 'torch_sdpa']"
    )
    assert text.endswith(" for component 'transformer'")


def test_seed_component_override_stays_strict_where_global_fallback_is_allowed() -> None:
    with pytest.raises(ResolutionError) as info, component_scope("audio_vae", backend="sage_attn"):
        resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    assert str(info.value.trace.outcome.origin) == "component_override"
    assert evaluated(info.value.trace) == [("requested", "sage_attn")]
    assert str(info.value).endswith(" for component 'audio_vae'")


def test_seed_unknown_component_kind_is_strict() -> None:
    with pytest.raises(ResolutionError) as info, component_scope("foley_generator"):
        resolve(FA_SDPA, config=SAGE, platform=CUDA_SAGE)
    assert "Attention backend 'sage_attn' is not supported by this attention layer" in str(
        info.value
    )
    assert str(info.value).endswith(" for component 'foley_generator'")


def test_seed_sparse_global_backend_on_cross_attention_without_supported_set() -> None:
    cfg = SelectionConfig(global_backend="sliding_tile_attn")
    with component_scope("transformer"):
        self_ = resolve(SELF_128, config=cfg, platform=CUDA_ALL)
        cross = resolve(CROSS_128, config=cfg, platform=CUDA_ALL)
    assert (self_.backend.name, self_.reason) == ("sliding_tile_attn", None)
    assert (cross.backend.name, cross.origin, cross.reason) == (
        "fa3",
        "global_cli",
        "dense cross-attention fallback",
    )


def test_seed_derived_preference_falls_back_with_platform_default_fallback() -> None:
    cfg = SelectionConfig(global_backend="sage_attn", global_backend_explicit=False)
    with component_scope("transformer"):
        res = resolve(FA_SDPA, config=cfg, platform=CUDA_SAGE)
    assert (res.backend.name, res.origin, res.reason) == (
        "fa",
        "global_preference",
        "platform default fallback",
    )


def test_seed_unmet_requirement_moves_on_when_relaxed() -> None:
    layer = LayerSpec(64, "bf16", requirements=["attn_mask"], default="torch_sdpa")
    with component_scope("vae"):
        res = resolve(layer, config=SAGE, platform=CUDA_SAGE)
    assert (res.backend.name, res.reason) == ("torch_sdpa", "global backend fallback")
    req = [r for r in checks_of(res.trace, "sage_attn") if r.check is Check.REQUIREMENTS]
    assert req[0].failures[0].message == "does not implement attention masks"


def test_seed_unmet_requirement_is_named_when_strict() -> None:
    layer = LayerSpec(64, "bf16", requirements=["attn_mask"])
    with pytest.raises(ResolutionError) as info, component_scope("transformer"):
        resolve(layer, config=SAGE, platform=CUDA_SAGE)
    assert str(info.value) == (
        "Attention backend 'sage_attn' does not implement attention masks "
        "for component 'transformer'"
    )
    assert info.value.code == "requirement_unmet"


def test_seed_single_supported_backend_is_a_component_constraint() -> None:
    with component_scope("vocoder"):
        res = resolve(LayerSpec(64, "bf16", supported={"torch_sdpa"}), platform=CUDA_ALL)
    assert (res.backend.name, res.origin, res.reason) == (
        "torch_sdpa",
        "none",
        "component constraint",
    )


# =============================================================================
# 4. The trace
# =============================================================================


def _corpus() -> list[Trace]:
    out: list[Trace] = []
    scenarios: list[tuple[LayerSpec, SelectionConfig, Platform, str | None]] = [
        (FA_SDPA, SAGE, CUDA_SAGE, None),
        (FA_SDPA_DEFAULT, SAGE, CUDA_SAGE, None),
        (CROSS_128, SelectionConfig(global_backend="sliding_tile_attn"), CUDA_ALL, None),
        (LayerSpec(64, "bf16", supported={"fa"}), SelectionConfig(), CPU, None),
        (LayerSpec(64, "fp32"), SelectionConfig(), CPU, None),
        (LayerSpec(64, "bf16"), SelectionConfig(), CUDA, None),
        (LayerSpec(64, "bf16"), SelectionConfig(), CUDA, "sage_attn"),
    ]
    for layer, cfg, platform, backend in scenarios:
        b = None if backend is None else Backend.parse(backend)
        out.append(M.run_machine(TraceInput(layer, cfg, None, platform, b)))
    return out


def test_trace_starts_with_an_origin_record_and_ends_with_a_terminal_record() -> None:
    traces = _corpus()
    assert {t.outcome.status for t in traces} == {"selected", "rejected"}
    for trace in traces:
        assert isinstance(trace.records[0], OriginRecord)
        assert isinstance(trace.records[-1], (SelectedRecord, RejectedRecord))


def test_trace_every_transition_follows_the_table() -> None:
    for trace in _corpus():
        assert_well_formed(trace)


def test_trace_transition_table_is_closed() -> None:
    assert set(M.TRANSITIONS) == set(State)
    assert M.TRANSITIONS[State.REJECTED] == {}
    # selected is left only to measure (autotune), which comes back to selected
    assert M.TRANSITIONS[State.SELECTED] == {Event.MEASURE: (State.MEASURING, None)}
    assert {target for target, _ in M.TRANSITIONS[State.MEASURING].values()} == {State.SELECTED}
    for source, events in M.TRANSITIONS.items():
        for event, (target, reason) in events.items():
            assert isinstance(event, Event)
            assert target in State
            assert reason is None or isinstance(reason, Reason)
            assert source is not State.REJECTED


def test_trace_two_runs_give_equal_traces_and_digests() -> None:
    for first, second in zip(_corpus(), _corpus(), strict=True):
        assert first == second
        assert first.digest == second.digest
        assert first.to_json() == second.to_json()
        assert len(first.digest) == 64
        int(first.digest, 16)


def test_trace_resolve_after_clear_cache_gives_an_equal_trace() -> None:
    with component_scope("audio_vae"):
        a = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    attnres.clear_cache()
    with component_scope("audio_vae"):
        b = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    assert a is not b
    assert a.trace == b.trace and a.trace.digest == b.trace.digest


def test_trace_holds_the_full_input() -> None:
    with component_scope("audio_vae") as scope:
        res = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE, backend=None)
    inp = res.trace.input
    assert inp.layer == FA_SDPA_DEFAULT
    assert inp.config == SAGE
    assert inp.scope == scope.state
    assert inp.platform == CUDA_SAGE
    assert res.trace.schema_version == BASE_SCHEMA_VERSION  # (tuned traces: version 3)
    doc = json.loads(res.trace.to_json())
    assert set(doc) >= {"schema_version", "input", "records", "outcome"}


def test_trace_has_no_timestamps_addresses_or_ids() -> None:
    """The same input gives the same digest in another process."""
    script = textwrap.dedent(
        """
        import attnres
        from attnres import LayerSpec, Platform, SelectionConfig
        with attnres.component_scope("audio_vae"):
            r = attnres.resolve(
                LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}, default="torch_sdpa"),
                config=SelectionConfig(global_backend="sage_attn"),
                platform=Platform.simulate("cuda:sm90+flash_attn+sageattention"),
            )
        print(r.trace.digest)
        """
    )
    with component_scope("audio_vae"):
        here = resolve(FA_SDPA_DEFAULT, config=SAGE, platform=CUDA_SAGE)
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == here.trace.digest
    text = here.trace.to_json()
    assert "0x" not in text
    for key in ("time", "timestamp", "pid", "thread", "id"):
        assert f'"{key}"' not in text


def test_trace_records_are_immutable() -> None:
    import attrs

    res = resolve(LayerSpec(64, "fp32"), platform=CPU)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        res.trace.records[0].strict = True  # type: ignore[misc]
    assert isinstance(res.trace.records, tuple)


# -- property: the machine over the whole input space ----------------------------

NAMES = tuple(s.name for s in BUILTIN_SPECS)
PLATFORMS = tuple(
    Platform.simulate(s)
    for s in (
        "cpu",
        "cpu+all",
        "cuda:sm90",
        "cuda:sm90+all",
        "cuda:sm80+flash_attn",
        "cuda:sm100+all",
        "cuda:sm120+all",
        "rocm:gfx942+aiter",
        "rocm:gfx90a+all",
        "npu+torch_npu",
        "mps",
        "xpu",
    )
)
backend_names = st.sampled_from(NAMES)
layers = st.builds(
    LayerSpec,
    head_size=st.one_of(st.sampled_from([32, 64, 80, 96, 128, 192, 256]), st.integers(1, 600)),
    dtype=st.sampled_from(DTYPES),
    supported=st.one_of(st.none(), st.frozensets(backend_names, min_size=1, max_size=4)),
    default=st.one_of(st.none(), backend_names),
    role=st.sampled_from([Role.SELF, Role.CROSS]),
    requirements=st.builds(
        Requirements, st.booleans(), st.booleans(), st.booleans(), st.booleans(), st.booleans()
    ),
)
configs = st.builds(
    SelectionConfig,
    global_backend=st.one_of(st.none(), backend_names),
    global_backend_explicit=st.booleans(),
    forced_backend=st.one_of(st.none(), st.none(), backend_names),
)
scopes = st.one_of(
    st.none(),
    st.builds(
        lambda name, backend, roles, allow: ScopeState(
            component=name,
            kind=component_kind(name),
            loader=S.loader_for(component_kind(name)).__name__,
            backend=None if backend is None else Backend(backend),
            role_backends=tuple(sorted((Role(r), Backend(b)) for r, b in roles.items())),
            allow_global_fallback=allow,
        ),
        st.sampled_from(["transformer", "vae", "audio_vae", "text_encoder_2", "foley"]),
        st.one_of(st.none(), st.none(), backend_names),
        st.dictionaries(st.sampled_from(["self", "cross"]), backend_names, max_size=1),
        st.booleans(),
    ),
)


@given(
    layer=layers,
    config=configs,
    scope=scopes,
    platform=st.sampled_from(PLATFORMS),
    backend=st.one_of(st.none(), st.none(), st.none(), backend_names),
)
def test_rule_3_property_the_machine_keeps_the_contract_over_the_input_space(
    layer: LayerSpec,
    config: SelectionConfig,
    scope: ScopeState | None,
    platform: Platform,
    backend: str | None,
) -> None:
    inp = TraceInput(layer, config, scope, platform, None if backend is None else Backend(backend))
    trace = M.run_machine(inp)
    assert_well_formed(trace)
    assert trace == M.run_machine(inp)
    origin = trace.records[0]
    assert isinstance(origin, OriginRecord)
    found = M.detect_origin(inp)
    assert (origin.origin, origin.backend, origin.strict) == (
        found.origin,
        found.backend,
        found.strict,
    )
    outcome = trace.outcome
    assert outcome.reason in REASONS
    if outcome.status == "selected":
        assert outcome.backend is not None
        # 3.3: never sparse on cross
        if layer.role is Role.CROSS:
            assert not outcome.backend.is_sparse
        # the chosen backend passes every check
        assert all(not f for _, f in M.check_candidate(outcome.backend, layer, platform))
        # a strict origin gets exactly what it asked for, unless 3.3 applied
        if origin.strict and outcome.reason != "dense cross-attention fallback":
            assert outcome.backend == origin.backend
            assert outcome.reason is None
        if outcome.reason is None:  # the first candidate was accepted
            assert len(evaluated(trace)) == 1
    else:
        assert outcome.error
        if scope is not None:
            assert outcome.error.endswith(f" for component {scope.component!r}")
        else:
            assert "for component" not in outcome.error
        if origin.strict:
            role_failed = any(
                r.check is Check.ROLE and not r.passed
                for r in checks_of(trace, origin.backend.name)  # type: ignore[union-attr]
            )
            if not role_failed:
                assert len(evaluated(trace)) == 1
    # 3.2: an explicit global flag is strict iff no default and the scope forbids fallback
    if origin.origin is Origin.GLOBAL_CLI:
        allows = scope is not None and scope.allow_global_fallback
        assert origin.strict is (layer.default is None and not allows)
    # 3.4: no candidate is evaluated twice
    cands = [c for _, c in evaluated(trace)]
    assert len(cands) == len(set(cands))


# =============================================================================
# The cache
# =============================================================================


def test_cache_hit_returns_the_same_resolution_object() -> None:
    layer = LayerSpec(64, "fp32", name="blocks.0.attn")
    first = resolve(layer, platform=CPU)
    second = resolve(LayerSpec(64, "float32", name="blocks.0.attn"), platform=CPU)
    assert second is first
    assert R.cache_info()["size"] == 1


def test_cache_hit_still_records_the_decision() -> None:
    layer = LayerSpec(64, "fp32", name="blocks.0.attn")
    with component_scope("vae") as scope:
        a = resolve(layer, platform=CPU)
        b = resolve(layer, platform=CPU)
    assert a is b
    decisions = attnres.decisions()
    assert len(decisions) == 2
    assert decisions[0] == decisions[1]
    d = decisions[0]
    assert (d.component, d.layer, d.backend, d.reason, d.origin) == (
        "vae",
        "blocks.0.attn",
        "torch_sdpa",
        None,
        "none",
    )
    assert d.digest == a.trace.digest
    assert len(scope.decisions) == 2


def test_cache_entries_are_not_shared_across_scopes_configs_platforms() -> None:
    layer = LayerSpec(64, "bf16", supported={"fa", "torch_sdpa"}, name="attn")
    with component_scope("vae"):
        in_vae = resolve(layer, config=SAGE, platform=CUDA_SAGE)
    with component_scope("text_encoder"):
        in_te = resolve(layer, config=SAGE, platform=CUDA_SAGE)
    assert in_vae is not in_te
    assert (in_vae.component, in_te.component) == ("vae", "text_encoder")
    with pytest.raises(ResolutionError), component_scope("transformer"):
        resolve(layer, config=SAGE, platform=CUDA_SAGE)
    other_cfg = resolve(layer, platform=CUDA_SAGE)
    assert other_cfg.origin == "none"
    other_platform = resolve(layer, platform=CUDA)
    assert other_platform.backend.name == "torch_sdpa"
    assert resolve(layer, platform=CUDA_SAGE) is other_cfg
    # the layer-level backend is part of the key
    explicit = resolve(layer, platform=CUDA_SAGE, backend="torch_sdpa")
    assert explicit is not other_cfg and explicit.origin == "layer"
    # so is the forced backend of force_backend()
    with force_backend("torch_sdpa"):
        forced = resolve(layer, platform=CUDA_SAGE)
    assert forced.origin == "forced"


def test_clear_cache_forgets_every_entry() -> None:
    layer = LayerSpec(64, "fp32")
    first = resolve(layer, platform=CPU)
    assert R.cache_info()["size"] == 1
    attnres.clear_cache()
    assert R.cache_info()["size"] == 0
    second = resolve(layer, platform=CPU)
    assert second is not first and second == first
    # decisions already recorded stay
    assert len(attnres.decisions()) == 2


def test_cache_is_bounded() -> None:
    limit = R._CACHE_MAX
    assert R.cache_info()["max_size"] == limit
    last: Resolution | None = None
    for i in range(limit + limit // 4):
        last = resolve(LayerSpec(64, "fp32", name=f"layer.{i}"), platform=CPU)
        assert R.cache_info()["size"] <= limit
    assert R.cache_info()["size"] > 0
    # the newest entry is still cached
    assert (
        resolve(LayerSpec(64, "fp32", name=f"layer.{limit + limit // 4 - 1}"), platform=CPU) is last
    )


def test_cache_rejection_is_cached_and_reraised_with_the_trace() -> None:
    layer = LayerSpec(64, "fp32", name="attn")
    first = rejected(layer, platform=CPU, backend="fa")
    assert R.cache_info()["size"] == 1
    second = rejected(layer, platform=CPU, backend="fa")
    assert first is not second
    assert second.trace is first.trace
    assert str(second) == str(first)
    assert second.code == first.code
    decisions = attnres.decisions()
    assert len(decisions) == 2
    assert all(d.backend is None and d.status == "rejected" for d in decisions)


def test_resolve_rejects_a_non_layer() -> None:
    with pytest.raises(TypeError, match="LayerSpec"):
        resolve({"head_size": 64}, platform=CPU)  # type: ignore[arg-type]


def test_rule_3_4_requirements_causal_cross_attention_needs_top_left_alignment() -> None:
    # flash-attn aligns its causal mask bottom-right when lengths differ; SDPA's
    # convention (the layer's) is top-left: a causal cross layer never gets fa.
    causal_cross = LayerSpec(64, "bf16", role="cross", requirements=["causal"])
    res = resolve(causal_cross, platform=CUDA_ALL)
    assert res.backend.name == "torch_sdpa"
    fa_checks = [r for r in checks_of(res.trace, "fa") if r.check is Check.REQUIREMENTS]
    assert fa_checks and not fa_checks[0].passed
    assert "bottom-right" in fa_checks[0].failures[0].message
    # a causal self-attention layer (equal lengths) still gets a flash kernel (fa3,
    # the Hopper chain's first; fa where FA3 is not installed)
    causal_self = LayerSpec(64, "bf16", requirements=["causal"])
    assert resolve(causal_self, platform=CUDA_ALL).backend.name == "fa3"
    assert resolve(causal_self, platform=CUDA_FA).backend.name == "fa"
    with pytest.raises(ResolutionError, match="top-left aligned causal cross-attention"):
        resolve(causal_cross, platform=CUDA_ALL, backend="fa")


def test_cache_layers_differing_only_by_name_run_the_machine_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str | None] = []
    real = M.run_machine

    def counting(inp: TraceInput) -> Trace:
        calls.append(inp.layer.name)
        return real(inp)

    monkeypatch.setattr(M, "run_machine", counting)
    config = SelectionConfig(global_backend="sage_attn")
    with component_scope("audio_vae") as scope:
        results = [
            resolve(
                LayerSpec(
                    128,
                    "bf16",
                    supported={"fa", "torch_sdpa"},
                    default="torch_sdpa",
                    name=f"blocks.{i}.attn",
                ),
                platform=CUDA_ALL,
                config=config,
            )
            for i in range(5)
        ]
    assert calls == ["blocks.0.attn"]
    assert [r.layer for r in results] == [f"blocks.{i}.attn" for i in range(5)]
    assert {(r.backend.name, r.reason) for r in results} == {
        ("torch_sdpa", "global backend fallback")
    }
    assert [d.layer for d in scope.decisions] == [f"blocks.{i}.attn" for i in range(5)]
    # each trace is the machine's own for that named input: replays, own digest
    for r in results:
        assert r.trace.input.layer.name == r.layer
        assert r.trace == real(r.trace.input)
    assert len({r.trace.digest for r in results}) == 5
    assert R.cache_info()["size"] == 5 and R.cache_info()["shapes"] == 1


def test_cache_renamed_rejection_is_raised_with_its_own_trace() -> None:
    config = SelectionConfig(global_backend="sage_attn")
    layers = [LayerSpec(128, "bf16", supported={"fa"}, name=f"b{i}") for i in range(2)]
    with component_scope("transformer"):
        errors = []
        for layer in layers:
            with pytest.raises(ResolutionError) as info:
                resolve(layer, platform=CUDA_ALL, config=config)
            errors.append(info.value)
    assert [e.trace.input.layer.name for e in errors] == ["b0", "b1"]
    assert str(errors[0]) == str(errors[1])
    assert "for component 'transformer'" in str(errors[1])


def test_rule_3_4_platform_check_torch_version() -> None:
    # flex_attention ships on CPU from torch 2.6: a platform recording 2.5.1 refuses it
    import attrs

    old_torch = attrs.evolve(Platform.simulate("cpu"), torch_version="2.5.1")
    layer = LayerSpec(64, "fp32")
    with pytest.raises(ResolutionError) as info:
        resolve(layer, platform=old_torch, backend="flex_attention")
    assert info.value.code == "torch_version"
    assert "needs torch >= 2.6 on cpu, this platform has torch 2.5.1" in str(info.value)
    # the same request on the simulated (current) torch is accepted
    assert resolve(layer, platform=Platform.simulate("cpu"), backend="flex_attention").backend == (
        Backend("flex_attention")
    )


def test_rule_3_2_relaxation_is_structured_and_renders_the_origin_detail() -> None:
    """What relaxes the global flag is data (layer default, scope), not parsed text."""
    from attnres.machine import global_flag_relaxation

    config = SelectionConfig(global_backend="sage_attn", global_backend_explicit=True)
    vae = S.scope_state("audio_vae")
    dit = S.scope_state("transformer")
    layer = LayerSpec(64, "bf16", default="torch_sdpa")
    cases = [
        (layer, vae, True, ["the layer declares default 'torch_sdpa'",
                            "component 'audio_vae' (audio_vae, AudioVAELoader) allows "
                            "global fallback"]),
        (LayerSpec(64, "bf16"), dit, False, []),
        (LayerSpec(64, "bf16"), None, False, []),
    ]  # fmt: skip
    for spec, scope, relaxed, reasons in cases:
        inp = TraceInput(spec, config, scope, Platform.simulate("cuda:sm90+all"))
        relaxation = global_flag_relaxation(inp)
        assert relaxation.relaxed is relaxed and relaxation.reasons() == reasons
        origin = M.run_machine(inp).records[0]
        assert origin.detail == "--attention-backend set by the operator; " + (
            relaxation.describe()
        )
        assert origin.strict is (not relaxed)


def test_guard_tables_end_with_otherwise_and_fire_only_events_of_their_state() -> None:
    """Each guard table is total (its last row always holds) and matches TRANSITIONS."""
    for guards, state in (
        (M.START_GUARDS, State.ORIGIN_DETECTION),
        (M.REQUEST_FAILURE_GUARDS, State.REQUESTED),
    ):
        assert guards[-1].holds(M.GuardFacts()) and guards[-1].condition.startswith("otherwise")
        for guard in guards:
            assert guard.event in M.TRANSITIONS[state], (state, guard.event)
    # the order is the rule: sparse-on-cross beats strictness, strictness the global flag
    facts = M.GuardFacts(requested=True, role_failed=True, strict=True, global_explicit=True)
    assert M.first_event(M.REQUEST_FAILURE_GUARDS, facts) is Event.SPARSE_CROSS_FALLBACK
    facts = M.GuardFacts(requested=True, strict=True, global_explicit=True)
    assert M.first_event(M.REQUEST_FAILURE_GUARDS, facts) is Event.STRICT_FAILURE
    facts = M.GuardFacts(requested=True, global_explicit=True)
    assert M.first_event(M.REQUEST_FAILURE_GUARDS, facts) is Event.GLOBAL_FALLBACK
    assert M.first_event(M.REQUEST_FAILURE_GUARDS, M.GuardFacts()) is Event.PREFERENCE_FALLBACK
