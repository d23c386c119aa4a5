"""One strict codec: the pipeline loader and the trace loader share key lists and type checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnres import _codec, plan
from attnres.layer import LayerSpec
from attnres.plan import PipelineError, parse_pipeline


def test_every_layer_key_but_the_name_has_a_kind_derived_from_layerspec() -> None:
    """The pipeline loader's layer keys follow LayerSpec: the fields without a default
    are required, each field's kind comes from its type (never restated here)."""
    from attnres.backends import Backend

    assert _codec.field_types(LayerSpec)["default"] is Backend
    for key in _codec.required_field_names(LayerSpec):
        layer = {"name": "attn", "head_size": 64, "dtype": "float16"}
        del layer[key]
        doc = {"components": [{"name": "transformer", "layers": [layer]}]}
        with pytest.raises(PipelineError, match=f"missing required key '{key}'"):
            parse_pipeline(doc, source="p.toml")
    assert _codec.required_field_names(LayerSpec)  # the loop above checked something


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "supported",
            "torch_sdpa",
            "supported must be an array of strings, got a string ('torch_sdpa')",
        ),
        ("role", 1, "role must be a string, got an integer (1)"),
        ("head_size", True, "head_size must be an integer, got a boolean (True)"),
    ],
)
def test_a_layer_value_of_the_wrong_type_names_the_key_and_the_kind(
    key: str, value: object, message: str
) -> None:
    layer = {"name": "attn", "head_size": 64, "dtype": "float16", key: value}
    doc = {"components": [{"name": "transformer", "layers": [layer]}]}
    with pytest.raises(PipelineError) as info:
        parse_pipeline(doc, source="p.toml")
    assert str(info.value).endswith(message)
    assert "layer 'attn'" in str(info.value)


def test_bool_is_never_an_integer_for_either_loader() -> None:
    assert not _codec.is_int(True) and _codec.is_int(3)
    assert _codec.missing_keys({"a": 1}, ("a", "b")) == ["b"]
    assert _codec.unknown_keys({"a": 1, "z": 2}, ("a",)) == ["z"]
    assert _codec.closest_key("head_sise", plan._LAYER_KEYS) == "head_size"


def test_the_trace_pipeline_and_folder_loaders_share_one_error_format(tmp_path: Path) -> None:
    """FILE: WHERE: MESSAGE on one line, for a JSON trace (where = the JSON path), a
    TOML pipeline (where = component and layer) and a model folder (where = the
    component key, the config key, the tensor): all come from _codec.located."""
    import json

    from attnres.errors import TraceFormatError
    from attnres.trace import trace_from_json

    with pytest.raises(TraceFormatError) as trace_err:
        trace_from_json(json.dumps({"schema_version": 2, "input": {}}), source="t.json")
    assert trace_err.value.path == "t.json" and trace_err.value.where == "$.digest"
    assert str(trace_err.value).startswith("t.json: $.digest: missing field (a trace has: ")

    layer = {"name": "attn", "head_size": "64", "dtype": "float16"}
    with pytest.raises(PipelineError) as plan_err:
        parse_pipeline({"components": [{"name": "tr", "layers": [layer]}]}, source="p.toml")
    assert str(plan_err.value).startswith("p.toml: component 'tr' (components[0]): layer 'attn'")
    from attnres.integrations import FolderBuildError, plan_folder

    (tmp_path / "model_index.json").write_text(json.dumps({"vae": ["diffusers"]}))
    with pytest.raises(FolderBuildError) as folder_err:
        plan_folder(tmp_path)
    index = str(tmp_path / "model_index.json")
    assert folder_err.value.path == index and folder_err.value.where == "'vae'"
    assert str(folder_err.value) == _codec.located(
        index,
        "'vae'",
        message="expected [LIBRARY, CLASS] (two strings, or [null, null] for an absent "
        'component), got ["diffusers"]',
    )
    # a folder error with no place inside the file: FILE: MESSAGE, where is None
    (tmp_path / "model_index.json").write_text("[]")
    with pytest.raises(FolderBuildError) as whole_file:
        plan_folder(tmp_path)
    assert whole_file.value.where is None
    assert str(whole_file.value) == (
        f"{index}: not a valid model_index.json: expected a JSON object, got a list"
    )
    # located joins the parts and keeps the message on one line
    assert _codec.located("f", "$.a", message="bad\n  value") == "f: $.a: bad value"


def test_a_trace_error_names_the_json_path_through_keys_lists_and_odd_keys() -> None:
    """The path of a failure deep in a trace (the codec nests failures as cattrs'
    detailed validation does; transform_error writes the path)."""
    import copy
    import json

    from attnres.errors import TraceFormatError
    from attnres.trace import trace_from_dict

    root = Path(__file__).resolve().parent.parent / "traces"
    doc = json.loads((root / "layer-fa-float32-rejected-dtype.json").read_text())
    index = next(i for i, r in enumerate(doc["records"]) if r["kind"] == "check" and r["failures"])
    cases = []
    bad = copy.deepcopy(doc)
    bad["records"][index]["failures"][0]["code"] = 7
    cases.append((bad, f"$.records[{index}].failures[0].code"))
    bad = copy.deepcopy(doc)
    bad["input"]["config"]["component_backends"] = {"text_encoder.cross": 5}
    cases.append((bad, '$.input.config.component_backends["text_encoder.cross"]'))
    bad = copy.deepcopy(doc)
    bad["input"]["platform"]["packages"][0]["status"] = "gone"
    cases.append((bad, "$.input.platform.packages[0].status"))
    for broken, where in cases:
        with pytest.raises(TraceFormatError) as err:
            trace_from_dict(broken, source="t.json")
        assert err.value.where == where
        assert str(err.value).startswith(f"t.json: {where}: ")
