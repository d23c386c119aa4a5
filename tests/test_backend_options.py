"""Issue 23: typed per-backend options (``BackendSpec.options``).

Declared per spec from the kernels' own signatures, checked up front with a
did-you-mean, given to the kernel when it is bound, recorded in the trace.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import attnres
from attnres import LayerSpec, SelectionConfig
from attnres.backends import get_spec, normalize_backend_options
from attnres.errors import AttnresError, BackendOptionError, UnknownBackendError
from attnres.runtime import set_selection_config
from attnres.trace import trace_from_json, trace_to_dict

HOPPER_FA = attnres.Platform.simulate("cuda:sm90+flash_attn")
CPU = attnres.Platform.simulate("cpu")
DETERMINISTIC = {"fa": {"deterministic": True}}


def _fa_layer(**kw: Any) -> attnres.Attention:
    return attnres.Attention(
        4, 64, dtype=torch.float16, platform=HOPPER_FA, backend="fa", name="attn", **kw
    )


def _run(layer: attnres.Attention) -> None:
    q = torch.randn(1, 8, 4, 64, dtype=torch.float16)
    layer(q, q, q)


def test_rule_backend_options_unknown_option_is_refused_with_did_you_mean() -> None:
    with pytest.raises(BackendOptionError, match="did you mean 'deterministic'") as info:
        LayerSpec(64, "bf16", backend_options={"fa": {"determinstic": True}})
    assert isinstance(info.value, AttnresError) and isinstance(info.value, ValueError)
    assert (info.value.backend, info.value.option) == ("fa", "determinstic")
    assert info.value.suggestion == "deterministic"
    assert "its options: deterministic" in str(info.value)
    # a backend that declares none says so
    with pytest.raises(BackendOptionError, match="its options: none"):
        normalize_backend_options({"xformers": {"qk_quant_gran": "per_warp"}})


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"fa": {"deterministic": 1}}, r"fa.deterministic=1 is not allowed; expected a bool"),
        ({"fa": {"deterministic": "yes"}}, r"expected a bool \(from flash-attention"),
        ({"fa3": {"pack_gqa": "no"}}, r"fa3.pack_gqa='no' .* expected a bool or None"),
        ({"fa": {"deterministic": None}}, r"expected a bool \("),  # not nullable
        ({"fa": True}, r"'fa' takes a mapping \{option: value\}"),
        (["fa"], r"expected a mapping \{backend: \{option: value\}\}"),
    ],
)
def test_rule_backend_options_bad_values_are_refused(options: Any, expected: str) -> None:
    with pytest.raises(BackendOptionError, match=expected):
        normalize_backend_options(options)


def test_rule_backend_options_unknown_backend_says_did_you_mean() -> None:
    with pytest.raises(UnknownBackendError, match="Did you mean 'fa'"):
        normalize_backend_options({"flash": {"deterministic": True}})


def test_backend_options_are_declared_from_the_kernels_signatures() -> None:
    (deterministic,) = get_spec("fa").options
    assert (deterministic.name, deterministic.kind, deterministic.default) == (
        "deterministic",
        "bool",
        False,
    )
    assert "flash_attn_func" in deterministic.source
    assert {o.name for o in get_spec("fa3").options} == {"deterministic", "pack_gqa"}
    # aliases normalise; the result is sorted plain data
    assert normalize_backend_options({"fa3": {"pack_gqa": None, "deterministic": True}}) == (
        ("fa3", (("deterministic", True), ("pack_gqa", None))),
    )


def test_rule_backend_options_reach_the_kernel_at_bind_time(varlen_fakes: Any) -> None:
    plain = _fa_layer()
    _run(plain)
    assert varlen_fakes.seen[-1]["deterministic"] is False
    pinned = _fa_layer(backend_options=DETERMINISTIC)
    assert pinned.backend == attnres.Backend("fa")
    _run(pinned)
    assert varlen_fakes.seen[-1]["deterministic"] is True
    # options of a backend the layer does not run are not passed to this one
    other = _fa_layer(backend_options={"fa3": {"pack_gqa": True}})
    _run(other)
    assert varlen_fakes.seen[-1]["deterministic"] is False
    assert "pack_gqa" not in varlen_fakes.seen[-1]


def test_rule_backend_options_reach_the_varlen_entry_point(varlen_fakes: Any) -> None:
    # flash_attn_varlen_func(..., deterministic=False): the unpad route passes the
    # layer's options to it (it raised "softcap and sliding windows ..." before)
    layer = _fa_layer(requirements=["key_padding"], backend_options=DETERMINISTIC)
    q = torch.randn(2, 8, 4, 64, dtype=torch.float16)
    valid = torch.ones(2, 8, dtype=torch.bool)
    valid[1, 5:] = False
    out = layer(q, q, q, valid[:, None, None, :])
    varlen = [call for call in varlen_fakes.seen if "cu_seqlens_q" in call]
    assert varlen and varlen[-1]["deterministic"] is True
    # a key-only [B,1,1,S] mask: every query is computed, padded rows included, as
    # SDPA does (docs/masks.md); the fake runs the math of the real kernel
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(),
        q.transpose(1, 2).float(),
        q.transpose(1, 2).float(),
        valid[:, None, None, :],
    ).transpose(1, 2)
    assert out.shape == q.shape
    torch.testing.assert_close(out.float(), ref, rtol=2e-3, atol=2e-3)
    plain = _fa_layer(requirements=["key_padding"])
    plain(q, q, q, valid[:, None, None, :])
    assert varlen_fakes.seen[-1]["deterministic"] is False


def test_rule_backend_options_from_the_config_apply_under_the_layers_own(
    varlen_fakes: Any,
) -> None:
    previous = set_selection_config(SelectionConfig(backend_options=DETERMINISTIC))
    try:
        from_config = _fa_layer()
        overridden = _fa_layer(backend_options={"fa": {"deterministic": False}})
    finally:
        set_selection_config(previous)
    assert from_config.layer_spec.backend_options == (("fa", (("deterministic", True),)),)
    _run(from_config)
    assert varlen_fakes.seen[-1]["deterministic"] is True
    _run(overridden)
    assert varlen_fakes.seen[-1]["deterministic"] is False
    with pytest.raises(BackendOptionError, match="did you mean 'pack_gqa'"):
        SelectionConfig(backend_options={"fa4": {"pack_gq": True}})


def test_rule_backend_options_fa3_and_fa4_adapters_pass_them(varlen_fakes: Any) -> None:
    from attnres.kernels import get_kernel, specialized

    kernel = get_kernel("fa3")
    assert kernel is not None
    call = specialized(kernel, False, None, False, options=(("pack_gqa", True),))
    q = torch.randn(1, 8, 4, 64, dtype=torch.float16)
    call(q, q, q, None)
    assert varlen_fakes.seen[-1]["pack_gqa"] is True


def test_rule_backend_options_are_recorded_in_the_trace_and_replay() -> None:
    layer = LayerSpec(128, "bf16", supported={"fa", "torch_sdpa"}, backend_options=DETERMINISTIC)
    res = attnres.resolve(layer, platform=HOPPER_FA)
    doc = trace_to_dict(res.trace)
    assert doc["input"]["layer"]["backend_options"] == {"fa": {"deterministic": True}}
    loaded = trace_from_json(json.dumps(doc))
    assert loaded == res.trace
    assert attnres.replay(loaded).ok
    # a trace whose options the catalogue refuses is not a valid trace
    doc["input"]["layer"]["backend_options"] = {"fa": {"deterministc": True}}
    with pytest.raises(attnres.errors.TraceFormatError, match="did you mean 'deterministic'"):
        trace_from_json(json.dumps(doc))


def test_layers_without_backend_options_write_no_key() -> None:
    doc = trace_to_dict(attnres.resolve(LayerSpec(128, "bf16"), platform=CPU).trace)
    assert "backend_options" not in doc["input"]["layer"]
    config = SelectionConfig(backend_options=DETERMINISTIC)
    doc = trace_to_dict(attnres.resolve(LayerSpec(128, "bf16"), config=config, platform=CPU).trace)
    assert "backend_options" not in doc["input"]["config"]  # the layer records them


def test_layers_differing_only_in_backend_options_do_not_share_a_resolution() -> None:
    from attnres import runtime

    base = LayerSpec(128, "bf16", supported={"fa", "torch_sdpa"})
    variant = attrs.evolve(base, backend_options=DETERMINISTIC)
    args = (None, None, None, None, None, False)
    assert runtime._shape_key(base, *args) != runtime._shape_key(variant, *args)


def _main(*args: str) -> tuple[int, str, str]:
    import contextlib
    import io

    from attnres import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return code, out.getvalue(), err.getvalue()


def _explain(*flags: str) -> tuple[int, str, str]:
    head = ("explain", "--head-size", "128", "--dtype", "bf16")
    return _main(*head, "--platform", "cuda:sm90+flash_attn", *flags)


def test_rule_backend_options_cli_flag_types_values_and_records_them() -> None:
    code, out, _ = _explain("--backend-option", "fa.deterministic=true", "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["backend"] == "fa"
    assert doc["trace"]["input"]["layer"]["backend_options"] == {"fa": {"deterministic": True}}
    code, out, _ = _explain(
        "--backend-option", "fa3.pack_gqa=none", "--backend-option", "fa3.deterministic=False",
        "--json",
    )  # fmt: skip
    assert code == 0
    assert json.loads(out)["trace"]["input"]["layer"]["backend_options"] == {
        "fa3": {"deterministic": False, "pack_gqa": None}
    }


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("fa.determinstic=true", "did you mean 'deterministic'"),
        ("fa.deterministic=maybe", "fa.deterministic='maybe' is not allowed; expected a bool"),
        ("fadeterministic", "expected BACKEND.OPTION=VALUE"),
        ("flash.deterministic=true", "Did you mean 'fa'"),
    ],
)
def test_rule_backend_options_cli_mistakes_are_usage_errors(flag: str, expected: str) -> None:
    code, _, err = _explain("--backend-option", flag)
    assert code == 2
    assert "--backend-option:" in err and expected in " ".join(err.split())
    assert "Traceback" not in err


# -- pipeline files and `attnres plan` (one checker: normalize_backend_options) --

PIPELINE = """
[pipeline]
name = "opts"

[[components]]
name = "transformer"

[[components.layers]]
name = "blocks.attn"
count = 4
head_size = 128
dtype = "bf16"
backend_options = {OPTIONS}

[[components.layers]]
name = "blocks.cross"
head_size = 128
dtype = "bf16"
role = "cross"
"""


def _pipeline(tmp_path: Any, options: str) -> str:
    path = tmp_path / "opts.toml"
    path.write_text(PIPELINE.replace("{OPTIONS}", options))
    return str(path)


def _plan_options(out: str) -> dict[str, Any]:
    """Each layer's options, as its trace (``plan --trace-out``) records them."""
    doc = json.loads(out)
    layers = [la for c in doc["components"] for la in c["layers"]]
    traces = {la["name"]: json.loads(Path(la["trace_file"]).read_text()) for la in layers}
    return {name: t["input"]["layer"].get("backend_options") for name, t in traces.items()}


def test_rule_backend_options_in_a_pipeline_file_are_checked_planned_and_traced(
    tmp_path: Any,
) -> None:
    from attnres.plan import load_pipeline, plan_pipeline

    path = _pipeline(tmp_path, "{ fa = { deterministic = true } }")
    pipeline = load_pipeline(path)
    entry = pipeline.components[0].layers[0]
    assert entry.spec.backend_options == (("fa", (("deterministic", True),)),)
    result = plan_pipeline(pipeline, SelectionConfig(global_backend="fa"), HOPPER_FA)
    planned = result.components[0].layers[0]
    assert planned.outcome.backend == attnres.Backend("fa")
    assert planned.trace.input.layer.backend_options == entry.spec.backend_options
    assert attnres.replay(trace_from_json(json.dumps(trace_to_dict(planned.trace)))).ok
    # the layer without options plans as before: nothing is written
    assert result.components[0].layers[1].trace.input.layer.backend_options == ()


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("{ fa = { determinstic = true } }", "has no option 'determinstic' (did you mean"),
        ("{ fa = { deterministic = 1 } }", "fa.deterministic=1 is not allowed; expected a bool"),
        ('"fa"', "backend_options must be a table, got a string"),
        ("{ flsh = { deterministic = true } }", "Did you mean 'fa'?"),
    ],
)
def test_rule_backend_options_mistakes_in_a_pipeline_file_name_the_layer(
    tmp_path: Any, options: str, expected: str
) -> None:
    from attnres.errors import PipelineError
    from attnres.plan import load_pipeline

    path = _pipeline(tmp_path, options)
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    message = str(info.value)
    assert message.startswith(f"{path}: component 'transformer' (components[0]): layer ")
    assert "'blocks.attn' (layers[0])" in message and expected in message
    code, _, err = _main("plan", path)
    assert code == 2 and expected in " ".join(err.split()) and "Traceback" not in err


def test_rule_backend_options_plan_flag_applies_under_each_layers_own(tmp_path: Any) -> None:
    path = _pipeline(tmp_path, "{ fa = { deterministic = false } }")
    code, out, _ = _main(
        "plan", path, "--platform", "cuda:sm90+flash_attn", "--attention-backend", "fa",
        "--backend-option", "fa.deterministic=true", "--backend-option", "fa3.pack_gqa=true",
        "--json", "--trace-out", str(tmp_path / "traces"),
    )  # fmt: skip
    assert code == 0
    expected = {
        # the file's own option wins, option by option; the flag fills the rest
        "blocks.attn": {"fa": {"deterministic": False}, "fa3": {"pack_gqa": True}},
        "blocks.cross": {"fa": {"deterministic": True}, "fa3": {"pack_gqa": True}},
    }
    assert _plan_options(out) == expected  # in each layer's trace
    layers = json.loads(out)["components"][0]["layers"]
    assert {la["name"]: la["backend_options"] for la in layers} == expected  # and in --json
    code, _, err = _main("plan", path, "--backend-option", "fa.determinstic=true")
    assert code == 2 and "--backend-option:" in err and "did you mean 'deterministic'" in err


def test_rule_backend_options_plan_flag_reaches_a_model_folders_sites(tmp_path: Any) -> None:
    """``plan DIR --backend-option``: each site's trace and the --json carry the
    options; the platform's function is checked (sage on sm86 takes no granularity)."""
    from tiny_folders import tiny_folder

    vae = tiny_folder(tmp_path / "tiny") / "vae"
    flags = ("--dtype", "float16", "--attention-backend", "sage",
             "--backend-option", "sage.qk_quant_gran=per_warp")  # fmt: skip
    code, out, _ = _main("plan", str(vae), "--platform", "cuda:sm89+sageattention", *flags,
                         "--json", "--trace-out", str(tmp_path / "traces"))  # fmt: skip
    assert code == 0
    wanted = {"sage_attn": {"qk_quant_gran": "per_warp"}}
    layers = json.loads(out)["components"][0]["layers"]
    assert layers and all(la["backend"] == "sage_attn" for la in layers)
    assert all(la["backend_options"] == wanted for la in layers)
    assert list(_plan_options(out).values()) == [wanted] * len(layers)  # in each trace
    code, _, err = _main("plan", str(vae), "--platform", "cuda:sm86+sageattention", *flags)
    message = " ".join(err.split())
    assert code == 2 and "Traceback" not in err
    assert "for attention site 'encoder.mid_block.attentions.0' of component 'vae'" in message
    assert "not taken by sageattn_qk_int8_pv_fp16_triton" in message


def test_rule_backend_options_reach_the_kernel_of_an_applied_model(
    request: pytest.FixtureRequest,
) -> None:
    """``apply(model, SelectionConfig(backend_options=...))``: the routed sites call
    their kernel with the options (key padding: sageattn_varlen's smooth_k)."""
    from test_masks_diffusers import SAGE, STAND_IN, _inputs, _qwen_image

    from attnres.integrations import diffusers as idf

    varlen_fakes = request.getfixturevalue("varlen_fakes")  # after diffusers is imported

    model = _qwen_image()
    config = attrs.evolve(SAGE, backend_options={"sage": {"smooth_k": False}})
    with torch.no_grad():
        plan = idf.apply({"transformer": model}, config, STAND_IN)
        try:
            model(**_inputs())
        finally:
            idf.remove({"transformer": model})
    options = (("sage_attn", (("smooth_k", False),)),)
    assert plan.sites and all(s.trace.input.layer.backend_options == options for s in plan.sites)
    varlen = [c for c in varlen_fakes.seen if "tensor_layout" not in c]  # sageattn_varlen's
    assert varlen and all(c["smooth_k"] is False for c in varlen)
    # an option sageattn_varlen does not take is refused before anything is installed
    config = attrs.evolve(SAGE, backend_options={"sage": {"qk_quant_gran": "per_warp"}})
    with pytest.raises(BackendOptionError, match=r"attention site '.*' of component 'transformer'"):
        idf.apply({"transformer": model}, config, STAND_IN)
    assert not idf.routes({"transformer": model})


def test_rule_backend_options_refused_where_diffusers_dispatcher_runs_the_kernel() -> None:
    """A context-parallel site is pinned on diffusers' dispatcher, which calls the
    kernel itself: options cannot reach it, so the plan refuses them, naming the site."""
    import tiny_pipelines as tp

    from attnres.integrations import diffusers as idf

    transformer = tp.flux(dtype=torch.bfloat16).transformer
    processor = transformer.transformer_blocks[0].attn.processor
    processor._parallel_config = object()
    config = SelectionConfig(global_backend="fa", global_backend_explicit=True)
    try:
        plan = idf.plan({"transformer": transformer}, config, HOPPER_FA)
        assert plan.ok  # without options the pinned site plans fa
        with pytest.raises(BackendOptionError) as info:
            idf.plan(
                {"transformer": transformer},
                attrs.evolve(config, backend_options=DETERMINISTIC),
                HOPPER_FA,
            )
    finally:
        del processor._parallel_config
    message = str(info.value)
    assert "attention site 'transformer_blocks.0.attn' of component 'transformer'" in message
    assert "fa.deterministic cannot reach its kernel: diffusers' dispatcher" in message


def test_rule_backend_options_reach_a_site_decided_at_its_first_call(
    varlen_fakes: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A site with no head facts at plan time (decided at its first call) takes the
    config's options: traced in its first-call record and passed to the kernel."""
    from attnres.integrations import _route
    from attnres.scope import scope_state

    sage = SelectionConfig(global_backend="sage_attn", global_backend_explicit=True)
    stand_in = attrs.evolve(attnres.Platform.simulate("cuda:sm90+sageattention"), simulated=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    config = attrs.evolve(sage, backend_options={"sage": {"smooth_k": False}})
    route = _route.GenericRoute(
        component="vae", name="mid.attn", spec=None, heads=None, kv_heads=None,
        resolution=None, config=config, scope=scope_state("vae"), platform=stand_in,
    )  # fmt: skip
    q = torch.randn(1, 2, 6, 16).bfloat16()
    route(q, q, q)
    (first,) = route.first_calls
    assert first.backend is not None and first.backend.name == "sage_attn"
    assert first.trace.input.layer.backend_options == (("sage_attn", (("smooth_k", False),)),)
    assert varlen_fakes.seen[-1]["function"] == "sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert varlen_fakes.seen[-1]["smooth_k"] is False


# -- issue 31: option limits and options of the installed kernel version --------


def _check(backend: str, options: dict[str, Any], platform: str, **layer: Any) -> None:
    from attnres._varlen import check_layer_options
    from attnres.backends import Backend
    from attnres.platform import Platform

    spec = LayerSpec(
        layer.pop("head_size", 128), "bf16", backend_options={backend: options}, **layer
    )
    check_layer_options(get_spec(Backend(backend)), spec, Platform.simulate(platform))


def test_rule_option_limits_fa4_deterministic_backward_on_sm12x() -> None:
    """flash-attn-4's _flash_attn_bwd: 'deterministic backward not supported on SM 12.0'."""
    training = {"requirements": {"backward": True}}
    with pytest.raises(BackendOptionError, match=r"fa4 refuses deterministic=True with the "
                       r"backward pass on sm120-sm121 .*SM 12\.0"):  # fmt: skip
        _check("fa4", {"deterministic": True}, "cuda:sm120+fa4", **training)
    _check("fa4", {"deterministic": True}, "cuda:sm121+fa4")  # inference: no backward
    _check("fa4", {"deterministic": True}, "cuda:sm90+fa4", **training)
    _check("fa4", {"deterministic": False}, "cuda:sm120+fa4", **training)


def test_rule_option_limits_fa3_deterministic_backward_at_head_sizes_193_to_256() -> None:
    """hopper/flash_api.cpp: 'Deterministic backward not supported for hdim 256.'."""
    training = {"requirements": {"backward": True}}
    for head in (200, 256):
        with pytest.raises(BackendOptionError, match="at head sizes <= 256, >= 193"):
            _check("fa3", {"deterministic": True}, "cuda:sm90+fa3", head_size=head, **training)
    _check("fa3", {"deterministic": True}, "cuda:sm90+fa3", head_size=192, **training)
    _check("fa3", {"deterministic": True}, "cuda:sm90+fa3", head_size=256)


def test_rule_options_of_sageattention_1_are_its_own() -> None:
    """SageAttention 1 (sageattention 1.0.6) has no per-GPU functions: qk_quant_gran,
    a SageAttention 2 option, is refused when the layer is built, smooth_k is taken."""
    with pytest.raises(BackendOptionError, match=r"sage_attn.qk_quant_gran is not taken by "
                       r"the sage_attn kernel installed here \(SageAttention 1"):  # fmt: skip
        _check("sage_attn", {"qk_quant_gran": "per_warp"}, "cuda:sm89+sageattention==1.0.6")
    _check("sage_attn", {"smooth_k": False}, "cuda:sm89+sageattention==1.0.6")
    _check("sage_attn", {"qk_quant_gran": "per_warp"}, "cuda:sm89+sageattention==2.2.0")


def test_rule_option_limits_through_explain() -> None:
    code, _, err = _main(
        "explain", "--head-size", "128", "--dtype", "bf16", "--requires", "backward",
        "--platform", "cuda:sm120+fa4", "--attention-backend", "fa4",
        "--backend-option", "fa4.deterministic=true",
    )  # fmt: skip
    # the message is wrapped at the terminal width: read it with the wrapping undone
    assert code != 0 and "deterministic backward not supported on SM 12.0" in " ".join(err.split())
