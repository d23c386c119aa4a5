"""The requirements a layer states beyond the 0.1 set, and the catalogue's facts
about them: ``backward`` (gradients flow through the kernel), with the limits
that withdraw a claim on some platforms or in some combinations.

Every rule has a ``test_rule_3_4_requirement_*`` test (SPEC 3.4: a candidate
implements every requirement the layer needs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from attnres import LayerSpec, Platform, Requirements, ResolutionError, resolve
from attnres._vocab import REQUIREMENT_PHRASES, Requirement
from attnres.backends import (
    BUILTIN_SPECS,
    BackendSpec,
    CapabilityRule,
    RequirementLimit,
    get_spec,
    register_backend,
    unregister_backend,
)
from attnres.errors import TraceFormatError
from attnres.machine import check_candidate
from attnres.replayer import replay
from attnres.trace import SCHEMA_VERSION, load_trace, trace_from_dict, trace_to_dict

ROOT = Path(__file__).resolve().parent.parent
HOPPER_ALL = Platform.simulate("cuda:sm90+all")


def _requirement_failures(backend: str, layer: LayerSpec, platform: Platform) -> list[str]:
    for check, failures in check_candidate(get_spec(backend).backend, layer, platform):
        if check.value == "requirements":
            return [f.message for f in failures]
    raise AssertionError("no requirements check")


def _rejected(layer: LayerSpec, platform: Platform, backend: str) -> ResolutionError:
    with pytest.raises(ResolutionError) as info:
        resolve(layer, platform=platform, backend=backend)
    return info.value


# -- the vocabulary --------------------------------------------------------------


def test_rule_3_4_requirement_every_requirement_has_a_phrase_and_a_flag() -> None:
    for req in Requirement:
        assert REQUIREMENT_PHRASES[req]
        assert Requirements(**{req.value: True}).needed() == (req,)
    assert Requirements.of(["backward"]).backward is True
    with pytest.raises(ValueError, match="backward: expected True or False"):
        Requirements(backward="yes")  # type: ignore[arg-type]


# -- backward ---------------------------------------------------------------------

#: The catalogue's backward facts (docs/backends.md gives the source of each).
NO_BACKWARD = {"sage_attn", "sage_attn_3", "sliding_tile_attn", "ascend_fa",
               "dynamic_cudnn_sdpa", "sparse_video_gen_2_attn"}


def test_rule_3_4_requirement_backward_claims_follow_the_catalogue() -> None:
    claims = {s.name for s in BUILTIN_SPECS if Requirement.BACKWARD in s.implements}
    assert claims == {s.name for s in BUILTIN_SPECS} - NO_BACKWARD


@pytest.mark.parametrize("backend", ["sage_attn", "sage_attn_3", "sliding_tile_attn"])
def test_rule_3_4_requirement_backward_never_gets_a_kernel_without_one(backend: str) -> None:
    platform = Platform.simulate("cuda:sm120+all" if backend == "sage_attn_3" else "cuda:sm90+all")
    layer = LayerSpec(128, "bf16", requirements=["backward"])
    err = _rejected(layer, platform, backend)
    assert f"Attention backend {backend!r} does not implement the backward pass" in str(err)
    assert err.code == "requirement_unmet"
    # the same layer for inference runs it
    inference = resolve(LayerSpec(128, "bf16"), platform=platform, backend=backend)
    assert inference.backend.name == backend


def test_rule_3_4_requirement_backward_relaxed_request_falls_back() -> None:
    from attnres import SelectionConfig

    config = SelectionConfig(global_backend="sage_attn", global_backend_explicit=False)
    layer = LayerSpec(128, "bf16", requirements=["backward"])
    res = resolve(layer, config=config, platform=HOPPER_ALL)
    assert (res.backend.name, res.reason) == ("fa", "platform default fallback")
    inference = resolve(LayerSpec(128, "bf16"), config=config, platform=HOPPER_ALL)
    assert inference.backend.name == "sage_attn"


def test_rule_3_4_requirement_backward_flex_attention_not_on_cpu() -> None:
    layer = LayerSpec(64, "float32", requirements=["backward"])
    err = _rejected(layer, Platform.simulate("cpu"), "flex_attention")
    assert (
        "Attention backend 'flex_attention' does not implement the backward pass on cpu "
        "(flex_attention.py: 'FlexAttention does not support backward on CPU')"
    ) in str(err)
    cuda = resolve(layer, platform=Platform.simulate("cuda:sm90"), backend="flex_attention")
    assert cuda.backend.name == "flex_attention"
    # inference on cpu is untouched
    assert resolve(LayerSpec(64, "float32"), platform=Platform.simulate("cpu"),
                   backend="flex_attention").backend.name == "flex_attention"


def test_rule_3_4_requirement_backward_xformers_has_no_gqa_backward() -> None:
    sm80 = Platform.simulate("cuda:sm80+xformers")
    both = LayerSpec(64, "fp16", requirements=["gqa", "backward"])
    failures = _requirement_failures("xformers", both, sm80)
    assert failures == [
        "does not implement the backward pass together with grouped-query attention (the "
        "cutlass forward op takes the 5-D GQA layout, its backward op does not)"
    ]
    for alone in (["gqa"], ["backward"]):
        assert _requirement_failures("xformers", LayerSpec(64, "fp16", requirements=alone),
                                     sm80) == []


def test_rule_3_4_requirement_backward_fa4_limit_is_by_compute_capability() -> None:
    (limit,) = [lim for lim in get_spec("fa4").limits if lim.requirements == {Requirement.BACKWARD}]
    assert limit.applies([Requirement.BACKWARD], "cuda", (8, 6))
    assert not limit.applies([Requirement.BACKWARD], "cuda", (9, 0))
    assert not limit.applies([Requirement.BACKWARD], "cuda", (12, 0))
    assert not limit.applies([Requirement.CAUSAL], "cuda", (8, 6))


def test_rule_3_4_requirement_limit_applies_to_a_plugin_spec() -> None:
    spec = BackendSpec(
        name="test_limited_kernel",
        sparse=False,
        platforms=("cuda",),
        dtypes=("bfloat16",),
        implements=("causal", "backward"),
        limits=(
            RequirementLimit({"backward", "causal"}, "no causal backward before sm90",
                             capabilities=CapabilityRule(max=(8, 9))),
        ),
    )
    register_backend(spec)
    try:
        layer = LayerSpec(64, "bf16", requirements=["causal", "backward"])
        err = _rejected(layer, Platform.simulate("cuda:sm86"), "test_limited_kernel")
        assert ("does not implement the backward pass together with causal attention on "
                "<= sm89 (no causal backward before sm90)") in str(err)
        res = resolve(layer, platform=Platform.simulate("cuda:sm90"), backend="test_limited_kernel")
        assert res.backend.name == "test_limited_kernel"
    finally:
        unregister_backend("test_limited_kernel")


def test_rule_3_4_requirement_limit_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="at least one requirement"):
        RequirementLimit(set(), "nothing")
    with pytest.raises(ValueError):
        RequirementLimit({"teleport"}, "unknown requirement")
    with pytest.raises(ValueError, match="unknown platform kinds"):
        RequirementLimit({"backward"}, "x", platforms={"tpu"})
    with pytest.raises(TypeError, match="RequirementLimit"):
        BackendSpec(name="x_kernel", sparse=False, platforms=("cpu",), dtypes=("float32",),
                    limits=("backward",))  # type: ignore[arg-type]


# -- traces: the requirement travels, and 0.1 traces still load ---------------------


def test_trace_records_the_backward_requirement_and_replays() -> None:
    res = resolve(LayerSpec(64, "bf16", requirements=["backward"]), platform=HOPPER_ALL)
    doc = trace_to_dict(res.trace)
    assert doc["schema_version"] == SCHEMA_VERSION == 2
    assert doc["input"]["layer"]["requirements"]["backward"] is True
    again = trace_from_dict(json.loads(json.dumps(doc)))
    assert again.input.layer.requirements.backward is True
    assert replay(again).ok


def _schema_1_doc() -> dict[str, Any]:
    """A trace as attnres 0.1 wrote it: schema 1, the five 0.1 requirement keys."""
    res = resolve(LayerSpec(64, "bf16", requirements=["causal"]), platform=HOPPER_ALL)
    doc = trace_to_dict(res.trace)
    doc["schema_version"] = 1
    for key in ("backward",):
        del doc["input"]["layer"]["requirements"][key]
    return _with_digest(doc)


def test_trace_schema_1_files_load_with_their_own_digest(tmp_path: Path) -> None:
    doc = _schema_1_doc()
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    loaded = load_trace(path)  # the digest of a 0.1 file covers the keys it has
    assert loaded.digest == doc["digest"]
    assert loaded.schema_version == 1
    assert loaded.input.layer.requirements == Requirements(causal=True)
    assert replay(path).ok


def _with_digest(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the digest a schema-1 writer gave it."""
    import hashlib

    from attnres.trace import canonical_json

    body = {k: v for k, v in doc.items() if k != "digest"}
    return {**body, "digest": hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()}


def test_trace_schema_versions_hold_their_own_requirement_keys() -> None:
    new_keys = _schema_1_doc()
    new_keys["schema_version"] = 2
    with pytest.raises(TraceFormatError, match=r"\$\.input\.layer\.requirements\.backward: "
                       r"missing field \(requirements, in schema version 2"):
        trace_from_dict(_with_digest(new_keys))
    doc = _schema_1_doc()
    doc["input"]["layer"]["requirements"]["backward"] = False
    with pytest.raises(TraceFormatError, match=r"requirements\.backward: unexpected field "
                       r"\(requirements, in schema version 1"):
        trace_from_dict(_with_digest(doc))


def test_golden_corpus_is_written_in_the_current_schema() -> None:
    for path in sorted((ROOT / "traces").glob("*.json")):
        assert load_trace(path).schema_version == SCHEMA_VERSION, path.name
