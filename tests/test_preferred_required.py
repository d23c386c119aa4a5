"""``preferred`` separate from ``supported``, and required backends (issue 23).

Rules (docs/selection-contract.md, "Preferred and required backends"):

- preferred narrows automatic choices only (the platform's chain, the supported
  set); supported stays what the layer's code can run;
- an explicit request outside preferred but inside supported that passes every
  check is admitted, and the origin record says so;
- a required backend (pinned for correctness) is kept under the global flag,
  forced backends, request_backend and autotune, and the trace says what it
  overrode.
"""

from __future__ import annotations

import json

import pytest
import torch

import attnres
from attnres import LayerSpec, SelectionConfig
from attnres._states import Origin, Reason
from attnres.machine import run_machine
from attnres.trace import SkipRecord, TraceInput, trace_from_json, trace_to_dict

HOPPER_FA = attnres.Platform.simulate("cuda:sm90+flash_attn")
CPU = attnres.Platform.simulate("cpu")


def _layer(**kw: object) -> LayerSpec:
    return LayerSpec(128, "bf16", **kw)  # type: ignore[arg-type]


def test_preferred_narrows_automatic_choices_only() -> None:
    layer = _layer(supported={"fa", "torch_sdpa"}, preferred={"torch_sdpa"})
    res = attnres.resolve(layer, platform=HOPPER_FA)
    # cuda's chain would give fa; it is outside preferred, so it is skipped
    assert res.backend == attnres.Backend("torch_sdpa")
    # (fa3, which leads the Hopper chain, is passed over first: not installed)
    skips = [
        r for r in res.trace.records if isinstance(r, SkipRecord) and r.candidate.name != "fa3"
    ]
    assert [s.candidate.name for s in skips][:1] == ["fa"]
    assert "preferred set" in skips[0].detail
    # without preferred the same layer runs fa: the rule is what changed it
    assert attnres.resolve(_layer(supported={"fa", "torch_sdpa"}), platform=HOPPER_FA).backend == (
        attnres.Backend("fa")
    )


def test_preferred_explicit_request_inside_supported_is_admitted_with_its_reason() -> None:
    layer = _layer(supported={"fa", "torch_sdpa"}, preferred={"torch_sdpa"})
    res = attnres.resolve(layer, platform=HOPPER_FA, backend="fa")
    assert res.backend == attnres.Backend("fa")
    assert res.origin is Origin.LAYER
    origin = res.trace.records[0]
    assert "outside the layer's preferred set ['torch_sdpa']" in origin.detail


def test_preferred_explicit_request_outside_supported_is_still_rejected() -> None:
    layer = _layer(supported={"fa", "torch_sdpa"}, preferred={"torch_sdpa"})
    with pytest.raises(attnres.ResolutionError, match="not supported by this attention layer"):
        attnres.resolve(layer, platform=HOPPER_FA, backend="sage_attn")


def test_preferred_must_narrow_supported() -> None:
    with pytest.raises(ValueError, match="preferred: sage_attn not in the supported set"):
        _layer(supported={"torch_sdpa"}, preferred={"sage_attn"})


def test_required_backend_is_kept_under_the_global_flag_and_says_so() -> None:
    config = SelectionConfig(global_backend="fa")
    res = attnres.resolve(_layer(required="torch_sdpa"), config=config, platform=HOPPER_FA)
    assert res.backend == attnres.Backend("torch_sdpa")
    assert res.origin is Origin.LAYER
    assert "required by the layer for correctness" in res.trace.records[0].detail


def test_required_backend_is_kept_under_a_forced_backend() -> None:
    with attnres.force_backend("fa"):
        res = attnres.resolve(_layer(required="torch_sdpa"), platform=HOPPER_FA)
    assert res.backend == attnres.Backend("torch_sdpa")


def test_required_backend_is_kept_under_a_per_request_backend_and_the_trace_says_so() -> None:
    inp = TraceInput(
        _layer(required="torch_sdpa"),
        SelectionConfig(),
        None,
        HOPPER_FA,
        request=attnres.Backend("fa"),
    )
    trace = run_machine(inp)
    assert trace.outcome.backend == attnres.Backend("torch_sdpa")
    assert "it overrides the per-request backend 'fa'" in trace.records[0].detail


def test_required_backend_keeps_its_layer_under_request_backend() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            common = {"dtype": torch.float32, "platform": CPU}
            self.pinned = attnres.Attention(4, 16, required="torch_sdpa", name="pinned", **common)
            self.free = attnres.Attention(4, 16, name="free", **common)

    model = Model()
    assert model.pinned.backend == attnres.Backend("torch_sdpa")
    with attnres.request_backend(model, "eager"):
        assert model.free.backend == attnres.Backend("eager")
        assert model.pinned.backend == attnres.Backend("torch_sdpa")


def test_required_backend_is_not_tunable() -> None:
    # autotune measures decisions of automatic origins only; a required backend is
    # origin ``layer`` (strict), so it is never measured or replaced
    res = attnres.resolve(_layer(required="torch_sdpa"), platform=HOPPER_FA)
    assert res.origin not in attnres.machine.TUNABLE_ORIGINS
    assert res.reason is not Reason.MEASURED_FASTER


def test_required_backend_must_be_supported() -> None:
    with pytest.raises(ValueError, match="required: 'fa' is not in the supported set"):
        _layer(supported={"torch_sdpa"}, required="fa")


def test_preferred_and_required_round_trip_in_a_trace_and_replay() -> None:
    layer = _layer(supported={"fa", "torch_sdpa"}, preferred={"torch_sdpa"}, required="fa")
    res = attnres.resolve(layer, platform=HOPPER_FA)
    doc = trace_to_dict(res.trace)
    assert doc["input"]["layer"]["preferred"] == ["torch_sdpa"]
    assert doc["input"]["layer"]["required"] == "fa"
    loaded = trace_from_json(json.dumps(doc))
    assert loaded == res.trace
    assert attnres.replay(loaded).ok


def test_layers_without_preferred_or_required_write_neither_key() -> None:
    doc = trace_to_dict(attnres.resolve(_layer(), platform=CPU).trace)
    assert "preferred" not in doc["input"]["layer"]
    assert "required" not in doc["input"]["layer"]


def test_the_name_blind_cache_key_holds_every_layer_field_but_the_name() -> None:
    # two layers that differ in one field must never share a cached resolution
    # (a required layer once took its unpinned twin's per-request resolution)
    import attrs

    from attnres import runtime
    from attnres.layout import SequenceLayout

    base = _layer(supported={"fa", "torch_sdpa"})
    variants = {
        "preferred": attrs.evolve(base, preferred={"torch_sdpa"}),
        "required": attrs.evolve(base, required="torch_sdpa"),
        "default": attrs.evolve(base, default="torch_sdpa"),
        "head_size": attrs.evolve(base, head_size=64),
        "exact_route": attrs.evolve(base, exact_route="a route"),
        "backend_options": attrs.evolve(base, backend_options={"fa": {"deterministic": True}}),
        # issue 24: a sequence-parallel layout is a machine input too
        "layout": attrs.evolve(base, layout=SequenceLayout(2, 1, 8, 8)),
    }
    fields = {a.name for a in attrs.fields(LayerSpec)} - {"name"}
    # every field but the name that a layer can differ in must be exercised here
    assert fields - set(variants) <= {"dtype", "supported", "role", "requirements"}
    key = runtime._shape_key(base, None, None, None, None, None, False)
    for name, variant in variants.items():
        assert runtime._shape_key(variant, None, None, None, None, None, False) != key, name


def test_rule_preferred_is_the_supported_set_stage_of_a_layer_that_runs_any_backend() -> None:
    # issue 19: an integration site whose route runs any kernel (no supported set)
    # but whose own code runs eager (softmax by hand) keeps eager with no flag:
    # the platform's chain (torch_sdpa) is outside preferred, the supported-set
    # stage tries the preferred set; a global flag is still admitted
    layer = LayerSpec(64, "fp32", preferred={"eager"})
    res = attnres.resolve(layer, platform=CPU)
    assert res.backend == attnres.Backend("eager")
    assert [
        (r.stage.value, str(r.candidate)) for r in res.trace.records if isinstance(r, SkipRecord)
    ] == [("platform_default", "torch_sdpa")]
    flagged = attnres.resolve(
        layer, config=SelectionConfig(global_backend="torch_sdpa"), platform=CPU
    )
    assert flagged.backend == attnres.Backend("torch_sdpa")
