"""attnres.plan: pipeline files, their strict validation, and plans."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import attnres
from attnres.layer import SelectionConfig
from attnres.plan import (
    Pipeline,
    PipelineError,
    load_pipeline,
    parse_pipeline,
    plan_pipeline,
    trace_file_name,
)
from attnres.platform import Platform

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("*.toml"))
CPU = Platform.simulate("cpu")
HOPPER_ALL = Platform.simulate("cuda:sm90+all")


def _write(tmp_path: Path, text: str, name: str = "pipeline.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _doc(*layers: dict[str, object], **component: object) -> dict[str, object]:
    return {"components": [{"name": "vae", **component, "layers": list(layers)}]}


LAYER = {"name": "mid.attn", "head_size": 64, "dtype": "bf16"}


# -- the examples ---------------------------------------------------------------


def test_there_are_at_least_four_examples() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"image-video-dit.toml", "audio-video.toml", "ltx2.toml", "cpu-small.toml"} <= names


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads_and_plans_cleanly_on_cpu(path: Path) -> None:
    pipeline = load_pipeline(path)
    assert pipeline.components and pipeline.layer_count > 0
    result = plan_pipeline(pipeline, SelectionConfig(), CPU)
    assert result.ok, [(la.component, la.name, la.error) for la in result.layers]
    assert all(layer.backend == "torch_sdpa" for layer in result.layers)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_plans_cleanly_on_hopper_without_a_flag(path: Path) -> None:
    result = plan_pipeline(load_pipeline(path), SelectionConfig(), HOPPER_ALL)
    assert result.ok


def test_audio_video_seed_incident_auxiliaries_fall_back_transformer_takes_sage() -> None:
    pipeline = load_pipeline(ROOT / "examples" / "audio-video.toml")
    config = SelectionConfig(global_backend="sage_attn", global_backend_explicit=True)
    result = plan_pipeline(pipeline, config, HOPPER_ALL)
    assert result.ok
    by_component = {c.name: c for c in result.components}
    assert {la.backend for la in by_component["transformer"].layers} == {"sage_attn"}
    assert {la.origin for la in by_component["transformer"].layers} == {"global_cli"}
    for name in ("audio_vae", "video_vae", "text_encoder"):
        for layer in by_component[name].layers:
            assert layer.backend == "torch_sdpa", (name, layer.name)
            assert layer.reason == "global backend fallback", (name, layer.name)
    # the audio VAE falls back to its declared default
    assert by_component["audio_vae"].kind == "audio_vae"


def test_ltx2_cross_attention_is_the_layers_with_a_context() -> None:
    pipeline = load_pipeline(ROOT / "examples" / "ltx2.toml")
    transformer = next(c for c in pipeline.components if c.name == "transformer")
    cross = {la.name for la in transformer.layers if la.spec.role.value == "cross"}
    assert cross == {
        "transformer_blocks.attn2",
        "transformer_blocks.audio_attn2",
        "transformer_blocks.audio_to_video_attn",
        "transformer_blocks.video_to_audio_attn",
    }


def test_ltx2_sparse_request_never_serves_cross_attention() -> None:
    pipeline = load_pipeline(ROOT / "examples" / "ltx2.toml")
    config = SelectionConfig(global_backend="video_sparse_attn")
    result = plan_pipeline(pipeline, config, HOPPER_ALL)
    assert result.ok
    transformer = next(c for c in result.components if c.name == "transformer")
    for layer in transformer.layers:
        if layer.trace.input.layer.role.value == "cross":
            assert layer.backend != "video_sparse_attn"
            assert layer.reason == "dense cross-attention fallback"
        else:
            assert layer.backend == "video_sparse_attn"


def test_ltx2_explicit_sage_is_rejected_on_masked_cross_attention() -> None:
    pipeline = load_pipeline(ROOT / "examples" / "ltx2.toml")
    result = plan_pipeline(pipeline, SelectionConfig(global_backend="sage_attn"), HOPPER_ALL)
    assert not result.ok and result.status == "rejected"
    rejected = {(la.component, la.name) for la in result.layers if la.status == "rejected"}
    assert rejected == {
        ("transformer", "transformer_blocks.attn2"),
        ("transformer", "transformer_blocks.audio_attn2"),
    }
    for layer in result.layers:
        if layer.status == "rejected":
            assert layer.error is not None
            assert "does not implement attention masks" in layer.error
            assert layer.error.endswith("for component 'transformer'")
    # every other layer is still reported
    assert sum(1 for la in result.layers if la.status == "selected") == len(result.layers) - 2


# -- planning semantics -----------------------------------------------------------


def test_identical_layers_are_resolved_once_and_counted() -> None:
    pipeline = parse_pipeline(_doc({**LAYER, "count": 40}))
    attnres.clear_decisions()
    result = plan_pipeline(pipeline, SelectionConfig(), CPU)
    (layer,) = result.layers
    assert layer.count == 40
    assert len(attnres.decisions()) == 1
    assert result.to_dict()["components"][0]["layers"][0]["count"] == 40


def test_role_override_component_override_and_layer_backend() -> None:
    pipeline = parse_pipeline(
        {
            "components": [
                {
                    "name": "transformer",
                    "backend": "eager",
                    "role_backends": {"cross": "torch_sdpa"},
                    "layers": [
                        {**LAYER, "name": "attn1"},
                        {**LAYER, "name": "attn2", "role": "cross"},
                        {**LAYER, "name": "pinned", "backend": "flex_attention"},
                    ],
                }
            ]
        }
    )
    result = plan_pipeline(pipeline, SelectionConfig(), CPU)
    got = {la.name: (la.backend, la.origin) for la in result.layers}
    assert got == {
        "attn1": ("eager", "component_override"),
        "attn2": ("torch_sdpa", "role_override"),
        "pinned": ("flex_attention", "layer"),
    }
    # v2: the override must explain every layer; the role override does, the pinned
    # layer (its own backend, no recorded reason) does not
    assert not result.ok
    (component,) = result.components
    assert component.error is not None
    assert "pinned runs flex_attention (origin layer)" in component.error
    assert "attn2" not in component.error


def test_override_that_applies_to_no_layer_is_reported_not_raised() -> None:
    pipeline = parse_pipeline(
        {
            "components": [
                {
                    "name": "transformer",
                    "role_backends": {"cross": "torch_sdpa"},
                    "layers": [{**LAYER, "name": "attn1"}],
                }
            ]
        }
    )
    result = plan_pipeline(pipeline, SelectionConfig(), CPU)
    assert not result.ok
    (component,) = result.components
    assert component.error is not None and "cross-attention" in component.error
    assert component.layers[0].status == "selected"
    assert result.to_dict()["components"][0]["status"] == "rejected"


def test_a_rejected_layer_is_not_reported_twice_as_not_applied() -> None:
    pipeline = parse_pipeline(_doc({**LAYER, "requires": ["packed_varlen"]}, backend="torch_sdpa"))
    result = plan_pipeline(pipeline, SelectionConfig(), CPU)
    (component,) = result.components
    assert component.layers[0].status == "rejected"
    assert component.error is None
    assert not result.ok


def test_component_kind_from_the_file_and_opt_in_fallback() -> None:
    doc = {
        "components": [
            {"name": "my_decoder", "layers": [{**LAYER, "head_size": 512, "dtype": "fp32"}]},
            {
                "name": "my_other_decoder",
                "allow_global_fallback": True,
                "layers": [{**LAYER, "head_size": 512, "dtype": "fp32"}],
            },
            {
                "name": "custom",
                "kind": "vae",
                "layers": [{**LAYER, "head_size": 512, "dtype": "fp32"}],
            },
        ]
    }
    config = SelectionConfig(global_backend="sage_attn")
    result = plan_pipeline(parse_pipeline(doc), config, HOPPER_ALL)
    status = {c.name: (c.kind, c.layers[0].status) for c in result.components}
    assert status == {
        "my_decoder": ("generic", "rejected"),  # unknown kind: strict
        "my_other_decoder": ("generic", "selected"),
        "custom": ("vae", "selected"),
    }


def test_plan_uses_the_process_config_by_default() -> None:
    pipeline = parse_pipeline(_doc(LAYER))
    previous = attnres.set_selection_config(SelectionConfig(global_backend="eager"))
    try:
        result = plan_pipeline(pipeline, platform=CPU)
    finally:
        attnres.set_selection_config(previous)
    assert result.layers[0].backend == "eager"


def test_trace_file_names_are_safe_and_distinct() -> None:
    assert trace_file_name("vae", "mid.attn") == "vae__mid.attn.json"
    name = trace_file_name("../evil", "a/b c")
    assert "/" not in name and ".." not in name.removesuffix(".json")
    assert re.fullmatch(r"[A-Za-z0-9_.-]+", name)
    assert trace_file_name("...", "") == "____.json"


# -- validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "needles"),
    [
        ({}, ["no components"]),
        ({"components": []}, ["non-empty array"]),
        ({"pipelin": {}}, ["unknown key 'pipelin'", "did you mean 'pipeline'"]),
        ({"components": [{"layers": [LAYER]}]}, ["components[0]", "missing required key 'name'"]),
        ({"components": [{"name": "vae"}]}, ["component 'vae'", "no layers"]),
        (_doc({"name": "a", "dtype": "bf16"}), ["layer 'a'", "missing required key 'head_size'"]),
        (_doc({"name": "a", "head_size": 64}), ["missing required key 'dtype'"]),
        (_doc({**LAYER, "head_sise": 1}), ["unknown key 'head_sise'", "did you mean 'head_size'"]),
        (_doc({**LAYER, "head_size": "64"}), ["head_size must be an integer", "a string"]),
        (_doc({**LAYER, "head_size": True}), ["head_size must be an integer"]),
        (_doc({**LAYER, "head_size": 0}), ["head_size: must be at least 1"]),
        (_doc({**LAYER, "count": 0}), ["count must be a positive integer"]),
        (_doc({**LAYER, "dtype": "bfloat17"}), ["unknown dtype 'bfloat17'"]),
        (_doc({**LAYER, "role": "crosss"}), ["role must be 'self' or 'cross'"]),
        (_doc({**LAYER, "requires": ["masks"]}), ["unknown requirement 'masks'"]),
        (_doc({**LAYER, "requires": "causal"}), ["requires must be an array of strings"]),
        (_doc({**LAYER, "supported": ["fa", "flashy"]}), ["Unknown attention backend 'flashy'"]),
        (_doc({**LAYER, "supported": []}), ["empty set"]),
        (_doc({**LAYER, "default": "sage_atn"}), ["Did you mean 'sage_attn'"]),
        (_doc(LAYER, backend="sage_atn"), ["backend:", "Did you mean 'sage_attn'"]),
        (_doc(LAYER, role_backends={"crosss": "fa"}), ["role_backends", "'crosss'"]),
        (_doc(LAYER, role_backends={"cross": "nope"}), ["role_backends.cross"]),
        (_doc(LAYER, kind="vea"), ["unknown component kind 'vea'"]),
        (_doc(LAYER, allow_global_fallback="yes"), ["allow_global_fallback must be true"]),
        (_doc(LAYER, LAYER), ["duplicate layer name 'mid.attn'", "count = N"]),
        (
            {"components": [{"name": "vae", "layers": [LAYER]}] * 2},
            ["duplicate component name 'vae'"],
        ),
    ],
)
def test_validation_errors_name_file_component_and_layer(
    doc: dict[str, object], needles: list[str]
) -> None:
    with pytest.raises(PipelineError) as info:
        parse_pipeline(doc, source="p.toml")
    message = str(info.value)
    assert message.startswith("p.toml: ")
    for needle in needles:
        assert needle in message, message
    assert isinstance(info.value, ValueError)


def test_validation_error_carries_where(tmp_path: Path) -> None:
    path = _write(tmp_path, '[[components]]\nname = "vae"\n[[components.layers]]\nname = "a"\n')
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert info.value.component == "vae" and info.value.layer == "a"
    assert info.value.path == str(path)


def test_toml_syntax_error_names_the_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '[[components]]\nname = "vae"\nhead_size = \n')
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert info.value.line == 3
    assert str(info.value).startswith(f"{path}:3: invalid TOML")


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (lambda p: p / "missing.toml", "cannot read pipeline file"),
        (lambda p: p, "is a directory"),
    ],
)
def test_unreadable_files(tmp_path: Path, make: object, needle: str) -> None:
    assert callable(make)
    with pytest.raises(PipelineError, match=needle):
        load_pipeline(make(tmp_path))


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(PipelineError, match="not UTF-8"):
        load_pipeline(path)


def test_pipeline_name_defaults_to_the_file_stem(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        '[[components]]\nname = "vae"\n[[components.layers]]\nname = "a"\n'
        'head_size = 64\ndtype = "bf16"\n',
        name="my-pipe.toml",
    )
    pipeline = load_pipeline(path)
    assert isinstance(pipeline, Pipeline)
    assert pipeline.name == "my-pipe"
    assert pipeline.components[0].layers[0].count == 1
    assert pipeline.components[0].layers[0].spec.role.value == "self"


def test_write_plan_traces_writes_one_file_per_layer_without_collisions(tmp_path: Path) -> None:
    from attnres.plan import parse_pipeline, plan_pipeline, write_plan_traces
    from attnres.trace import load_trace

    pipeline = parse_pipeline(
        {
            "pipeline": {"name": "twins"},
            "components": [
                {"name": "vae", "layers": [
                    {"name": "attn/a", "head_size": 64, "dtype": "float32"},
                    {"name": "attn:a", "head_size": 64, "dtype": "float32"},
                ]},
            ],
        }
    )  # fmt: skip
    result = plan_pipeline(pipeline, platform=Platform.simulate("cpu"))
    paths = write_plan_traces(result, tmp_path / "out")
    assert [p.name for p in paths] == ["vae__attn_a.json", "vae__attn_a-2.json"]
    for path, layer in zip(paths, result.layers, strict=True):
        assert load_trace(path).digest == layer.trace.digest
    # the folder's manifest is complete and lists exactly the files written
    from attnres._files import MANIFEST_NAME, check_manifest

    manifest = json.loads((tmp_path / "out" / MANIFEST_NAME).read_text())
    assert manifest["complete"] and manifest["files"] == sorted(p.name for p in paths)
    assert check_manifest(tmp_path / "out") == []
