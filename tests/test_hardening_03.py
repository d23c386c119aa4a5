"""Issue 32: hardening 0.3's new surface (masks, schedules, plans, files, messages).

One regression test per defect, named after it, with a variant or two so that
the fix is not shaped to one case (items 3, 18 and 19 live in test_schedule.py,
test_errors.py and test_bench_detection.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_folders import tiny_folder

import attnres
from attnres import Platform
from attnres.cli import main
from attnres.integrations import FolderBuildError, plan_folder

CPU = Platform.simulate("cpu")


# -- item 7: a duplicate key in a JSON file attnres reads ---------------------------------


def _duplicate(folder: Path, name: str, first: str, second: str) -> None:
    """Rewrite ``folder/name`` with the key ``first`` (its value) followed by ``second``."""
    path = folder / name
    text = path.read_text()
    assert text.startswith("{")
    path.write_text("{" + first + ", " + second + ", " + text[1:])


@pytest.mark.parametrize(
    ("name", "first", "second", "key"),
    [
        # the component dropped: its entry, then null
        ("model_index.json", '"vae": ["diffusers", "AutoencoderKL"]', '"vae": [null, null]', "vae"),
        # the folder built as the other class
        (
            "model_index.json",
            '"_class_name": "FluxPipeline"',
            '"_class_name": "StableDiffusionPipeline"',
            "_class_name",
        ),
        # a component's config: the value that counts depends on the reader
        ("vae/config.json", '"latent_channels": 4', '"latent_channels": 16', "latent_channels"),
    ],
    ids=["component-dropped", "class-changed", "config-value"],
)
def test_duplicate_json_key_in_a_model_folder_is_refused(
    tmp_path: Path, name: str, first: str, second: str, key: str
) -> None:
    folder = tiny_folder(tmp_path / "pipe")
    _duplicate(folder, name, first, second)
    with pytest.raises(FolderBuildError, match=f'the key "{key}" appears twice'):
        plan = plan_folder(folder, platform=CPU)
        assert plan.ok  # a plan that says ok here is the defect itself
        raise AssertionError(plan.errors)


def test_duplicate_json_key_is_refused_by_the_one_reader() -> None:
    from attnres._files import parse_json

    with pytest.raises(ValueError, match='the key "a" appears twice'):
        parse_json(b'{"a": 1, "b": {"a": 2}, "a": 3}')
    with pytest.raises(ValueError, match='the key "x" appears twice'):
        parse_json(b'[{"k": {"x": 1, "x": 1}}]')  # nested, even with equal values
    assert parse_json(b'{"a": {"a": 1}}') == {"a": {"a": 1}}  # one key per object is fine


# -- item 15: every trace attnres writes reads back ---------------------------------------

N100 = "9" * 100


def _explain(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    try:
        code = main(["explain", "--head-size", "64", "--dtype", "bf16", *argv])
    except SystemExit as exc:  # argparse's own refusals exit 2 too
        code = exc.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    return code, " ".join((out + err).split())  # the text report wraps at the terminal width


@pytest.mark.parametrize(
    "argv",
    [
        ("--platform", "cpu", "--ulysses-degree", N100),
        ("--platform", "cpu", "--ring-degree", "65537"),
        ("--platform", "cpu", "--ulysses-degree", "2", "--heads", N100),
        ("--platform", "cpu", "--ulysses-degree", "2", "--heads", "8", "--kv-heads", N100),
        ("--platform", "cuda:sm" + "9" * 102),
        ("--platform", "cuda:" + "9" * 40 + ".0"),
    ],
    ids=["ulysses", "ring", "heads", "kv-heads", "capability", "capability-dotted"],
)
def test_layout_degrees_heads_and_capabilities_are_bounded_where_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: tuple[str, ...]
) -> None:
    out = tmp_path / "t.json"
    code, text = _explain(capsys, *argv, "--trace-out", str(out))
    if code == 0:  # the defect: a trace written that replay refuses
        assert main(["replay", str(out)]) == 0
    assert code == 2, text
    assert "Traceback" not in text and not out.exists()


def test_every_written_layout_trace_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The largest values the parsers take still give a trace that replays."""
    out = tmp_path / "t.json"
    code, text = _explain(
        capsys, "--platform", "cuda:sm9999", "--ulysses-degree", "65536", "--ring-degree", "65536",
        "--heads", "65536", "--kv-heads", "65536", "--trace-out", str(out),
    )  # fmt: skip
    assert code == 0, text
    assert main(["replay", str(out)]) == 0


def test_trace_with_an_unbounded_layout_is_refused_typed() -> None:
    from attnres.errors import TraceFormatError
    from attnres.layer import LayerSpec
    from attnres.layout import SequenceLayout
    from attnres.trace import trace_from_json, trace_to_dict

    layer = LayerSpec(head_size=64, dtype="bf16", layout=SequenceLayout(ulysses=2, num_heads=8))
    doc = trace_to_dict(attnres.resolve(layer, platform=CPU).trace)
    doc["input"]["layer"]["layout"]["ring"] = 10**50
    with pytest.raises(TraceFormatError, match="at most 65536"):
        trace_from_json(json.dumps(doc), source="t.json")


# -- item 16: Python's own messages never escape ------------------------------------------


@pytest.mark.parametrize(
    "arch", ["sm" + "9" * 4302, "9" * 5000 + ".0", "sm" + "9" * 5], ids=["sm", "dotted", "five"]
)
def test_huge_integers_in_platform_simulate_are_typed(arch: str) -> None:
    with pytest.raises(ValueError, match="cannot parse CUDA architecture"):
        Platform.simulate("cuda:" + arch)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ulysses": 10**4300, "ring": 10**4300}, "degree: must be at most 65536"),
        ({"ulysses": 2, "num_heads": 10**5000}, "heads: must be at most 65536"),
        ({"ring": -(10**5000)}, "degree: expected a positive integer"),
    ],
)
def test_huge_integers_in_sequence_layout_are_typed(kwargs: dict[str, int], message: str) -> None:
    from attnres import SequenceLayout

    with pytest.raises(ValueError, match=message):
        SequenceLayout(**kwargs).per_rank("fa")


@pytest.mark.parametrize(
    "spec",
    ["\u00b2:fa", "0:fa,\u0661:eager", "9" * 5000 + ":fa", "0:fa,99999999999:eager"],
    ids=["superscript", "arabic-indic", "huge", "past-max"],
)
def test_schedule_spec_with_unicode_or_huge_digits_is_typed(
    spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from attnres._schedule_plan import parse_schedule

    with pytest.raises(ValueError, match="--schedule"):
        parse_schedule(spec)
    code, text = _explain(capsys, "--platform", "cpu", "--schedule", spec)
    assert code == 2 and "--schedule" in text and "invalid literal" not in text


@pytest.mark.parametrize("key", ["vae\n", "vae\r\n", "\nvae"], ids=["lf", "crlf", "leading"])
def test_component_name_ending_in_a_newline_is_refused(key: str) -> None:
    from attnres.integrations._untrusted import check_component_key

    with pytest.raises(FolderBuildError, match="is not a component name"):
        check_component_key(key, "model_index.json")


def test_component_name_with_a_newline_in_model_index_is_refused(tmp_path: Path) -> None:
    folder = tiny_folder(tmp_path / "pipe", index=lambda d: d.update({"vae\n": d.pop("vae")}))
    with pytest.raises(FolderBuildError, match="is not a component name"):
        plan_folder(folder, platform=CPU)


@pytest.mark.parametrize(
    "name", ["t\ud800.json", "\udfff", "a/\ud83d/b.json"], ids=["ud800", "udfff", "in-a-folder"]
)
def test_trace_path_with_a_lone_surrogate_is_typed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    from attnres.errors import TraceFormatError

    trace = attnres.resolve(attnres.LayerSpec(head_size=64, dtype="bf16"), platform=CPU).trace
    target = str(tmp_path) + "/" + name
    with pytest.raises(OSError, match="lone surrogate"):
        attnres.dump_trace(trace, target)
    with pytest.raises(TraceFormatError, match="lone surrogate"):
        attnres.load_trace(target)
    code, text = _explain(capsys, "--platform", "cpu", "--trace-out", target)
    assert code == 2 and "lone surrogate" in text


# -- item 6: an unavailable preferred set falls back, saying so ---------------------------


@pytest.mark.parametrize(
    ("platform", "kwargs", "expected"),
    [
        ("cpu", {"preferred": {"sage_attn"}}, "torch_sdpa"),
        (
            "cuda:sm90",
            {"preferred": {"sage_attn", "fa"}, "supported": {"sage_attn", "fa", "torch_sdpa"}},
            "torch_sdpa",
        ),
        ("cuda:sm90+flash_attn", {"preferred": {"sage_attn"}}, "fa"),
    ],
    ids=["cpu", "cuda-supported-set", "cuda-chain"],
)
def test_unavailable_preferred_set_falls_back_with_a_reason(
    platform: str, kwargs: dict[str, object], expected: str
) -> None:
    layer = attnres.LayerSpec(head_size=64, dtype="bf16", **kwargs)  # type: ignore[arg-type]
    res = attnres.resolve(layer, platform=Platform.simulate(platform))
    assert res.backend.name == expected
    assert res.reason is not None and res.reason.value == "platform default fallback"
    detail = res.trace.records[0].detail
    assert "none of the layer's preferred set" in detail and "fall back outside it" in detail
    for name in kwargs["preferred"]:  # type: ignore[attr-defined]
        assert f"{name}:" in detail  # each preferred backend, and why it cannot run
    assert attnres.replay(res.trace).ok  # the trace replays as it was decided


@pytest.mark.parametrize(
    ("platform", "kwargs"),
    [
        ("cpu", {"preferred": {"sage_attn"}}),  # unusable: the fallback's every rule reads it
        ("cuda:sm90+flash_attn", {"preferred": {"sage_attn"}}),  # unusable, a chain stage
        ("cuda:sm90+flash_attn", {"supported": {"fa", "torch_sdpa"}, "preferred": {"torch_sdpa"}}),
    ],
    ids=["cpu-unusable", "cuda-chain-unusable", "usable"],
)
def test_whether_the_preferred_set_can_run_is_computed_once_per_resolution(
    platform: str, kwargs: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The origin note, the candidates and both skip rules read one fact the engine
    computed once for the resolution (each used to check the preferred set again)."""
    from attnres import machine

    layer = attnres.LayerSpec(head_size=64, dtype="bf16", **kwargs)  # type: ignore[arg-type]
    decided = attnres.resolve(layer, platform=Platform.simulate(platform)).trace
    calls = []
    real = machine._preferred_unusable

    def counted(inp: object) -> str:
        calls.append(inp)
        return real(inp)  # type: ignore[arg-type]

    monkeypatch.setattr(machine, "_preferred_unusable", counted)
    again = machine.run_machine(decided.input)  # a cold resolution: run_machine caches nothing
    assert len(calls) == 1
    assert again == decided  # the same records, the same outcome


def test_usable_preferred_set_still_narrows() -> None:
    hopper = Platform.simulate("cuda:sm90+flash_attn")
    layer = attnres.LayerSpec(
        head_size=64, dtype="bf16", supported={"fa", "torch_sdpa"}, preferred={"torch_sdpa"}
    )
    res = attnres.resolve(layer, platform=hopper)
    assert (res.backend.name, res.reason) == ("torch_sdpa", None)
    assert "preferred set" not in res.trace.records[0].detail


def test_attention_layer_with_an_unavailable_preferred_set_runs() -> None:
    import torch

    layer = attnres.Attention(4, 16, platform=CPU, preferred={"sage_attn"})
    q = torch.randn(1, 3, 4, 16)
    assert layer(q, q, q).shape == q.shape
    assert layer.backend is not None and layer.backend.name == "torch_sdpa"


# -- item 17: messages --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "label"),
    [
        ({"required": "fa_x"}, "required: "),
        ({"required": 3}, "required: "),
        ({"preferred": {"fa_x"}}, "preferred: "),
        ({"preferred": set()}, "preferred: "),
        ({"supported": set()}, "supported: "),
        ({"default": "fa_x"}, "default: "),
    ],
    ids=[
        "required-unknown",
        "required-type",
        "preferred-unknown",
        "preferred-empty",
        "supported-empty",
        "default-unknown",
    ],
)
def test_required_and_preferred_errors_are_labelled_with_their_own_name(
    kwargs: dict[str, object], label: str
) -> None:
    for build in (
        lambda: attnres.LayerSpec(head_size=64, dtype="bf16", **kwargs),  # type: ignore[arg-type]
        lambda: attnres.Attention(4, 16, platform=CPU, **kwargs),  # type: ignore[arg-type]
    ):
        with pytest.raises(ValueError) as raised:
            build()
        assert str(raised.value).startswith(label), str(raised.value)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("fa.deterministic=true", "fa.deterministic=false"),
        ("fa.deterministic=true", "flash_attn.deterministic=false"),  # an alias, same option
    ],
    ids=["same-name", "alias"],
)
def test_conflicting_duplicate_backend_option_is_refused(
    capsys: pytest.CaptureFixture[str], first: str, second: str
) -> None:
    code, text = _explain(
        capsys, "--platform", "cpu", "--backend-option", first, "--backend-option", second
    )
    assert code == 2 and "fa.deterministic is given twice with different values" in text


def test_repeated_equal_backend_option_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _explain(
        capsys, "--platform", "cpu", "--backend-option", "fa.deterministic=true",
        "--backend-option", "flash_attn.deterministic=TRUE",
    )  # fmt: skip
    assert code == 0, text


@pytest.mark.parametrize(
    ("kv", "heads"), [("48", "24"), ("5", "24"), ("24", "16")], ids=["more", "not-dividing", "odd"]
)
def test_explain_refuses_kv_heads_that_do_not_divide_heads(
    capsys: pytest.CaptureFixture[str], kv: str, heads: str
) -> None:
    code, text = _explain(
        capsys, "--platform", "cpu", "--ulysses-degree", "2", "--heads", heads, "--kv-heads", kv
    )
    assert code == 2 and "--kv-heads must divide --heads" in text
    from attnres import SequenceLayout

    with pytest.raises(ValueError, match="must divide num_heads"):
        SequenceLayout(ulysses=2, num_heads=int(heads), num_kv_heads=int(kv))


@pytest.mark.parametrize("flags", [("--ring-degree", "2"), ("--ulysses-degree", "2")])
def test_explain_autotune_under_a_layout_says_the_layout_rule(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, str]
) -> None:
    code, text = _explain(
        capsys, "--platform", "cuda:sm90+flash_attn", *flags, "--heads", "8", "--autotune"
    )
    assert code == 0, text
    assert "explicit choice" not in text  # origin none is not an explicit choice
    assert "sequence-parallel layout" in text.split("autotune:")[1]


def test_plan_dir_layout_refusal_is_documented(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tiny_folder(tmp_path / "pipe")
    capsys.readouterr()
    code = main(["plan", str(folder), "--platform", "cpu", "--ring-degree", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "docs/sequence-parallel.md" in err
    root = Path(__file__).resolve().parents[1] / "docs"
    for page in ("cli.md", "sequence-parallel.md"):
        text = " ".join((root / page).read_text().split())
        assert "`attnres plan DIR` (a model folder) refuses" in text or any(
            f"(`attnres plan DIR`) takes no {what}layout yet" in text for what in ("", "fixed ")
        ), page


# -- item 5: explain agrees with the runtime under a ring layout ---------------------------


@pytest.mark.parametrize("platform", ["cpu", "cuda:sm90+all", "cuda:sm100+all", "rocm:gfx942+all"])
def test_explain_ring_kernel_agrees_with_the_runtime(platform: str) -> None:
    """For every backend, a ring layout's plan (needs_kernel=False: explain, a
    simulated platform, a schedule step) decides as the runtime's resolution
    (needs_kernel=True) does on its layout check: flex_attention planned ok
    under --ring-degree 2 and the runtime refused it."""
    from attnres._states import Check
    from attnres.backends import registered_backends
    from attnres.layout import SequenceLayout
    from attnres.machine import check_candidate

    plat = Platform.simulate(platform)
    layer = attnres.LayerSpec(
        head_size=64, dtype="bf16", layout=SequenceLayout(2, 2, num_heads=8, num_kv_heads=8)
    )
    for spec in registered_backends():
        checks = {}
        for run in (False, True):
            results = check_candidate(attnres.Backend(spec.name), layer, plat, run)
            checks[run] = dict(results).get(Check.LAYOUT)
        assert checks[False] == checks[True], spec.name


@pytest.mark.parametrize("backend", ["flex_attention", "fa3"])
def test_explain_refuses_a_ring_kernel_with_no_adapter(
    capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    code, text = _explain(
        capsys, "--platform", "cuda:sm90+all", "--ring-degree", "2",
        "--attention-backend", backend,
    )  # fmt: skip
    assert code == 1 and "no ring runs it" in text
    code, text = _explain(
        capsys, "--platform", "cuda:sm90+all", "--ring-degree", "2",
        "--schedule", f"0:torch_sdpa,5:{backend}",
    )  # fmt: skip
    assert code == 1 and "step 5+" in text and "no ring runs it" in text


# -- item 4: a sliding window passed by the call is planned --------------------------------

_SIM_SAGE = Platform.simulate("cuda:sm90+flash_attn+sageattention")


def _tiny_text_model(name: str, window: int | None) -> object:
    import torch
    import transformers as t

    config_cls, model_cls = {
        "mistral": ("MistralConfig", "MistralModel"),
        "phi3": ("Phi3Config", "Phi3Model"),
        "starcoder2": ("Starcoder2Config", "Starcoder2Model"),
        "mixtral": ("MixtralConfig", "MixtralModel"),
    }[name]
    cfg = getattr(t, config_cls)(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_key_value_heads=4,
        num_hidden_layers=1, vocab_size=64, sliding_window=window, pad_token_id=0,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return getattr(t, model_cls)(cfg).eval().to(torch.bfloat16)


@pytest.mark.parametrize("name", ["mistral", "phi3", "starcoder2", "mixtral"])
def test_sliding_window_passed_by_the_call_is_planned(name: str) -> None:
    """``sliding_window=getattr(self.config, "sliding_window", None)`` at the call:
    a strict sage_attn plan said ok, and the first call longer than the window
    raised ResolutionError."""
    from attnres.integrations import transformers as itf
    from attnres.layer import SelectionConfig

    strict = SelectionConfig(component_backends={"text_encoder": "sage_attn"})
    plan = itf.plan(_tiny_text_model(name, 4), "text_encoder", strict, _SIM_SAGE)
    assert [s.spec.requirements.sliding_window for s in plan.sites] == [True]
    assert not plan.ok and "does not implement sliding-window attention" in plan.errors[0]
    relaxed = itf.plan(_tiny_text_model(name, 4), "text_encoder", None, _SIM_SAGE)
    assert [s.spec.requirements.sliding_window for s in relaxed.sites] == [True]


def test_no_sliding_window_in_the_config_is_not_a_requirement() -> None:
    from attnres.integrations import transformers as itf
    from attnres.layer import SelectionConfig

    strict = SelectionConfig(component_backends={"text_encoder": "sage_attn"})
    plan = itf.plan(_tiny_text_model("mistral", None), "text_encoder", strict, _SIM_SAGE)
    assert [s.spec.requirements.sliding_window for s in plan.sites] == [False]
    assert plan.ok, plan.errors
