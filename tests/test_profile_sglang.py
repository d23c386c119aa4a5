"""The ``sglang`` selection profile's rows (issue 23), one test per rule.

SGLang itself is not needed: the platform facts SGLang's platform would give
are written as :class:`HostResolution` facts, as the plugin records them.
SGLang's own tests exercise the same rows through the plugin (make test-sglang).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import attnres
from attnres import LayerSpec, Requirements, SelectionConfig
from attnres._profile_sglang import ALIASES, FALLBACK_ROWS, HOST_FACTS, ORIGIN_ROWS, UNOBSERVED
from attnres._states import Code, Origin, Reason
from attnres.layout import SequenceLayout
from attnres.machine import run_machine
from attnres.platform import HostResolution, Platform
from attnres.scope import ScopeState
from attnres.trace import CheckRecord, TraceInput, trace_from_json, trace_to_dict

SGLANG = SelectionConfig(profile="sglang")
VARLEN = "packed varlen attention"


def served(*facts: tuple[str, str | None], sparse: tuple[str, ...] = ()) -> Platform:
    """A cuda platform whose host resolves ``candidate -> served`` (None: refuses)."""
    return Platform(
        "cuda",
        host=[
            HostResolution(
                candidate,
                target,
                None if target else f"Invalid attention backend {candidate}",
                candidate in sparse,
                target in sparse,
            )
            for candidate, target in facts
        ],
    )


def run(layer: LayerSpec, platform: Platform, *, config=SGLANG, scope=None, backend=None):
    return run_machine(TraceInput(layer, config, scope, platform, backend))


def layer(**kw: object) -> LayerSpec:
    kw.setdefault("head_size", 128)
    kw.setdefault("dtype", "bf16")
    return LayerSpec(**kw)  # type: ignore[arg-type]


def test_sglang_explicit_backend_is_admitted_outside_the_declared_set() -> None:
    # PR 37441: supported_attention_backends constrains automatic choices only
    trace = run(
        layer(supported={"fa", "torch_sdpa"}),
        served(("aiter", "aiter")),
        backend=attnres.Backend("aiter"),
    )
    assert trace.outcome.backend == attnres.Backend("aiter")
    assert trace.outcome.origin is Origin.LAYER
    assert trace.outcome.reason is None


def test_sglang_automatic_choice_stays_inside_the_declared_set() -> None:
    # nothing requested: the platform's pick (fa) is outside {torch_sdpa}, so the
    # supported set's own backend is chosen, with SGLang's fallback reason
    trace = run(
        layer(supported={"torch_sdpa", "sage_attn"}),
        served(("", "fa"), ("sage_attn", "sage_attn"), ("torch_sdpa", "torch_sdpa")),
    )
    assert trace.outcome.backend == attnres.Backend("sage_attn")
    assert trace.outcome.reason is Reason.PLATFORM_DEFAULT_FALLBACK


def test_sglang_explicit_backend_still_needs_its_capability() -> None:
    platform = Platform("cuda", host=[HostResolution("fa", "fa", None, False, False, (VARLEN,))])
    trace = run(
        layer(supported={"fa"}, requirements=Requirements(packed_varlen=True)),
        platform,
        backend=attnres.Backend("fa"),
    )
    assert trace.outcome.status.value == "rejected"
    assert trace.outcome.code is Code.REQUIREMENT_UNMET
    assert trace.outcome.error == f"Attention backend 'fa' does not implement {VARLEN}"


def test_sglang_global_cli_backend_is_strict_without_a_relaxation() -> None:
    config = SelectionConfig(global_backend="sage_attn", profile="sglang")
    trace = run(layer(), served(("sage_attn", None)), config=config)
    assert trace.outcome.status.value == "rejected"
    assert trace.outcome.origin is Origin.GLOBAL_CLI
    assert trace.outcome.code is Code.HOST_PLATFORM


def test_sglang_global_cli_backend_falls_back_where_the_layer_declares_a_default() -> None:
    config = SelectionConfig(global_backend="sage_attn", profile="sglang")
    trace = run(
        layer(default="torch_sdpa"),
        served(("sage_attn", None), ("torch_sdpa", "torch_sdpa")),
        config=config,
    )
    assert trace.outcome.backend == attnres.Backend("torch_sdpa")
    assert trace.outcome.reason is Reason.GLOBAL_BACKEND_FALLBACK


def test_sglang_global_cli_backend_falls_back_where_the_component_allows_it() -> None:
    config = SelectionConfig(global_backend="sage_attn", profile="sglang")
    scope = ScopeState("vae", "sglang", "test", allow_global_fallback=True)
    trace = run(
        layer(),
        served(("sage_attn", None), ("", "torch_sdpa")),
        config=config,
        scope=scope,
    )
    assert trace.outcome.backend == attnres.Backend("torch_sdpa")
    assert trace.outcome.reason is Reason.GLOBAL_BACKEND_FALLBACK


def test_sglang_component_override_is_strict_and_names_the_component() -> None:
    scope = ScopeState("transformer", "sglang", "test", backend=attnres.Backend("sage_attn"))
    trace = run(layer(), served(("sage_attn", None)), scope=scope)
    assert trace.outcome.origin is Origin.COMPONENT_OVERRIDE
    assert trace.outcome.error is not None
    assert trace.outcome.error.endswith(" for component 'transformer'")


def test_sglang_sparse_backend_on_cross_attention_falls_back_to_dense() -> None:
    trace = run(
        layer(role="cross"),
        served(
            ("video_sparse_attn", "video_sparse_attn"), ("", "fa"), sparse=("video_sparse_attn",)
        ),
        backend=attnres.Backend("video_sparse_attn"),
    )
    assert trace.outcome.backend == attnres.Backend("fa")
    assert trace.outcome.reason is Reason.DENSE_CROSS_ATTENTION_FALLBACK


def test_sglang_cpu_serves_every_backend_by_sdpa() -> None:
    # SGLang's CPU platform answers any request with its SDPA class (and warns)
    platform = Platform("cpu", host=[HostResolution("fa", "torch_sdpa")])
    trace = run(layer(), platform, backend=attnres.Backend("fa"))
    assert trace.outcome.backend == attnres.Backend("torch_sdpa")
    assert trace.outcome.origin is Origin.LAYER


@pytest.mark.parametrize(
    ("backend", "supported", "admitted"),
    [
        ("torch_cudnn_sdpa", {"torch_sdpa"}, True),
        ("dynamic_cudnn_sdpa", {"torch_sdpa"}, False),
        ("dynamic_cudnn_sdpa", {"fa", "torch_sdpa"}, True),
    ],
)
def test_sglang_supported_set_admits_cudnn_sdpa_through_its_aliases(
    backend: str, supported: set[str], admitted: bool
) -> None:
    facts = [("", backend), *((s, s) for s in sorted(supported))]
    trace = run(layer(supported=supported), served(*facts))
    assert (trace.outcome.backend == attnres.Backend(backend)) is admitted


def test_sglang_folds_fa3_into_fa() -> None:
    assert ALIASES == {"fa3": "fa"}
    trace = run(layer(), served(("fa", "fa")), backend=attnres.Backend("fa3"))
    assert trace.outcome.backend == attnres.Backend("fa")


def test_sglang_role_override_records_its_role_as_the_reason() -> None:
    scope = ScopeState(
        "transformer",
        "sglang",
        "test",
        backend=attnres.Backend("fa"),
        role_backends=((attnres.Role.CROSS, attnres.Backend("torch_sdpa")),),
    )
    trace = run(layer(role="cross"), served(("torch_sdpa", "torch_sdpa")), scope=scope)
    assert trace.outcome.origin is Origin.ROLE_OVERRIDE
    assert trace.outcome.reason is Reason.CROSS_ATTENTION_OVERRIDE


def test_sglang_single_supported_backend_is_a_component_constraint() -> None:
    trace = run(layer(supported={"torch_sdpa"}), served(("", "torch_sdpa")))
    assert trace.outcome.reason is Reason.COMPONENT_CONSTRAINT


def test_sglang_unobserved_platform_fact_is_a_named_failure() -> None:
    trace = run(layer(), Platform("cuda"), backend=attnres.Backend("fa"))
    # issue 33: outside the plugin the profile says which facts it needs and how
    # to supply them; the check's failure keeps the plugin's marker word for word
    assert trace.outcome.error == f"{UNOBSERVED}: {HOST_FACTS}"
    assert "Platform(host=...)" in HOST_FACTS and "attnres.integrations.sglang" in HOST_FACTS
    checks = [r for r in trace.records if isinstance(r, CheckRecord)]
    assert [f.message for f in checks[0].failures] == [UNOBSERVED]


def test_sglang_trace_round_trips_and_replays() -> None:
    trace = run(
        layer(supported={"fa", "torch_sdpa"}),
        served(("aiter", None), ("", "fa")),
        config=SelectionConfig(
            global_backend="aiter", global_backend_explicit=False, profile="sglang"
        ),
    )
    text = json.dumps(trace_to_dict(trace))
    loaded = trace_from_json(text)
    assert loaded == trace
    assert loaded.input.config.profile == "sglang"
    assert attnres.replay(loaded).ok


@pytest.mark.parametrize(
    "spec",
    [
        {"requirements": Requirements(mask="key_padding")},
        {"layout": SequenceLayout(ulysses=2, num_heads=8)},
    ],
    ids=["mask-kind", "layout"],
)
def test_sglang_trace_of_a_mask_kind_or_layout_loads_and_replays(
    spec: dict[str, object], tmp_path: Path
) -> None:
    # issue 32 item 14: the profile wrote every trace as schema 2, which cannot
    # express a mask kind or a layout, so the file it wrote could not be loaded
    trace = run(layer(**spec), served(("", "torch_sdpa")))
    assert trace.outcome.backend == attnres.Backend("torch_sdpa")
    assert trace.schema_version == trace.input.schema_version() > 2
    path = tmp_path / "trace.json"
    attnres.dump_trace(trace, path)
    loaded = attnres.load_trace(path)
    assert loaded == trace
    assert attnres.replay(loaded).ok


def test_attnres_profile_traces_do_not_name_a_profile_or_host_facts() -> None:
    trace = run(layer(), Platform("cpu"), config=SelectionConfig())
    doc = trace_to_dict(trace)
    assert "profile" not in doc["input"]["config"]
    assert "host" not in doc["input"]["platform"]


def test_sglang_rows_are_rendered_in_the_state_machine_doc() -> None:
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "state-machine.md").read_text()
    for row in ORIGIN_ROWS:
        assert row.words in text
    for fallback in FALLBACK_ROWS:
        assert fallback.condition in text


def test_every_profile_is_a_value_walked_by_the_one_machine() -> None:
    # issue 33 item 1: a profile is data run_machine reads; no second walker
    from attnres import _profile_sglang, machine
    from attnres import layer as layer_mod
    from attnres._profile import Profile

    assert set(machine.PROFILES) == set(layer_mod.PROFILES)
    assert all(isinstance(p, Profile) for p in machine.PROFILES.values())
    assert machine.PROFILES["sglang"] is _profile_sglang.SGLANG
    assert not hasattr(_profile_sglang, "run_sglang")
    assert not hasattr(machine, "PROFILE_MACHINES")
    # issue 36's vllm_omni profile too: a value, not a walker of its own
    from attnres import _profile_vllm_omni

    assert machine.PROFILES["vllm_omni"] is _profile_vllm_omni.VLLM_OMNI
    assert not hasattr(_profile_vllm_omni, "run_vllm_omni")
    assert not hasattr(machine, "_OWN_WALKERS")


def test_a_second_host_profile_is_one_more_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # issue 33: changing a rule is changing data, not a walker: the same machine
    # walks an evolved value (no alias, another host's facts)
    import attrs

    from attnres import _profile_sglang, machine

    other = attrs.evolve(_profile_sglang.SGLANG, aliases={}, host_facts="observe OTHER's answers")
    monkeypatch.setitem(machine.PROFILES, "sglang", other)  # type: ignore[index]
    trace = run(layer(), Platform("cuda"), backend=attnres.Backend("fa3"))
    assert trace.outcome.error == f"{UNOBSERVED}: observe OTHER's answers"
    assert trace.records[0].backend == attnres.Backend("fa3")  # not folded into fa
