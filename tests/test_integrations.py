"""attnres.integrations: diffusers pipelines and transformers models, governed.

Tiny offline pipelines (tests/tiny_pipelines.py); the facts the issue found by
trying them are checked against the installed diffusers and transformers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

# The dev extra installs diffusers and transformers (make test): a missing one is
# an import error here, never a silently skipped module.
import diffusers  # noqa: F401
import pytest
import tiny_pipelines as tp
import torch
import transformers  # noqa: F401
from diffusers.models.attention_dispatch import _AttentionBackendRegistry

from attnres import Platform, SelectionConfig
from attnres._states import Status
from attnres._vocab import MaskKind
from attnres.cli import main
from attnres.integrations import IntegrationError
from attnres.integrations import diffusers as idf
from attnres.integrations import transformers as itf
from attnres.scope import scope_state

SIM = "cuda:sm90+flash_attn+sageattention"
SAGE = SelectionConfig(global_backend="sage_attn")
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def flux_bf16():
    """The done-when pipeline: DiT and text encoders in bf16, VAE in float32."""
    return tp.flux(dtype=torch.bfloat16, vae_dtype=torch.float32)


def _processors(pipe):
    return {
        (c, n): (m.processor, dict(getattr(m.processor, "__dict__", {})))
        for c, model in pipe.components.items()
        if isinstance(model, torch.nn.Module)
        for n, m in model.named_modules()
        if hasattr(m, "processor")
    }


def test_import_attnres_imports_neither_diffusers_nor_transformers():
    code = (
        "import sys, attnres, attnres.integrations, attnres.cli\n"
        "bad = [m for m in ('diffusers', 'transformers', 'torch') if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


# --- Done when --------------------------------------------------------------


def test_done_when_global_sage_on_tiny_flux(flux_bf16):
    plan = idf.plan(flux_bf16, SAGE, Platform.simulate(SIM))
    assert plan.ok, plan.errors
    groups = plan.by_component()
    assert groups["transformer"] and all(
        s.backend.name == "sage_attn" for s in groups["transformer"]
    )
    assert all(
        s.resolution.origin == "global_cli" and s.resolution.reason is None
        for s in groups["transformer"]
    )
    # issue 22: CLIP's causal-with-key-padding sites run sage through attnres's
    # transformers function; T5 passes an additive mask and falls back
    assert groups["text_encoder"] and all(
        s.backend.name == "sage_attn" and s.resolution.reason is None
        for s in groups["text_encoder"]
    )
    for comp in ("vae", "text_encoder_2"):
        assert groups[comp], comp
        for site in groups[comp]:
            assert site.backend.name == "torch_sdpa", (comp, site.name)
            assert site.resolution.reason == "global backend fallback"
            # the reason is readable in the trace
            assert site.trace.outcome.reason == "global backend fallback"
            assert "sage_attn" in json.dumps(
                site.trace.to_dict() if hasattr(site.trace, "to_dict") else str(site.trace.records)
            )
    # strict components get no declared default; auxiliary ones their current route's
    assert all(s.spec.default is None for s in groups["transformer"])
    assert all(s.spec.default is not None for s in groups["vae"])


def test_done_when_head_size_sage_cannot_take_is_an_error_and_apply_changes_nothing():
    pipe = tp.flux(head_dim=256, dtype=torch.bfloat16)
    plan = idf.plan(pipe, SAGE, Platform.simulate(SIM))
    assert not plan.ok
    bad = [s for s in plan.sites if s.error]
    assert bad and all(s.component == "transformer" for s in bad)
    assert "head size 256" in str(bad[0].error)
    before = _processors(pipe)
    impl = pipe.text_encoder.config._attn_implementation
    with pytest.raises(IntegrationError) as info:
        idf.apply(pipe, SAGE, Platform.simulate(SIM))
    assert isinstance(info.value, ValueError)
    assert info.value.plan.errors == plan.errors
    assert _processors(pipe) == before
    assert pipe.text_encoder.config._attn_implementation == impl


def test_done_when_through_attnres_plan_dir(tmp_path, capsys):
    pipe = tp.flux(dtype=torch.bfloat16, vae_dtype=torch.float32)
    pipe.save_pretrained(tmp_path / "flux")
    code = main(
        [
            "plan",
            str(tmp_path / "flux"),
            "--platform",
            SIM,
            "--attention-backend",
            "sage_attn",
            "--json",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 0, doc
    comps = {c["name"]: c for c in doc["components"]}
    assert comps["transformer"]["dtype"] == "bfloat16"
    assert comps["transformer"]["dtype_source"] == "weights"
    assert comps["vae"]["dtype"] == "float32"
    assert {s["backend"] for s in comps["transformer"]["layers"]} == {"sage_attn"}
    assert {(s["backend"], s["reason"]) for s in comps["text_encoder"]["layers"]} == {
        ("sage_attn", None)
    }  # issue 22: CLIP runs sage through attnres's function
    for name in ("vae", "text_encoder_2"):
        assert {(s["backend"], s["reason"]) for s in comps[name]["layers"]} == {
            ("torch_sdpa", "global backend fallback")
        }
    big = tp.flux(head_dim=256, dtype=torch.bfloat16)
    big.save_pretrained(tmp_path / "big")
    code = main(
        ["plan", str(tmp_path / "big"), "--platform", SIM, "--attention-backend", "sage_attn"]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "REJECTED" in out and "head size 256" in out


# --- apply / verify / remove ------------------------------------------------


def test_apply_without_flag_is_bit_identical_and_remove_restores():
    pipe = tp.flux()
    before = tp.run_flux(pipe)
    procs = _processors(pipe)
    plan = idf.apply(pipe)
    assert plan.ok and all(s.backend.name == "torch_sdpa" for s in plan.sites)
    after = tp.run_flux(pipe)
    assert torch.equal(before, after)
    assert idf.verify(pipe) == []
    # the decision is what every site runs already: nothing wrapped, nothing pinned
    assert _processors(pipe) == procs
    assert idf.routes(pipe) == {}
    # every governed site is restored, text encoders' included (issue 20, item 17)
    assert idf.remove(pipe) == len(plan.sites)
    assert _processors(pipe) == procs


def test_apply_emits_one_installed_event_per_site():
    import structlog
    from structlog.testing import capture_logs

    pipe = tp.flux()
    try:
        with capture_logs() as events:
            plan = idf.apply(pipe)
    finally:
        structlog.reset_defaults()  # capture_logs leaves structlog "configured"
    installed = [e for e in events if e["event"] == "attention backend installed"]
    assert len(installed) == len(plan.sites)
    first = installed[0]
    site = plan.sites[0]
    assert (first["component"], first["layer"], first["backend"]) == (
        site.component,
        site.name,
        site.backend.name,
    )
    assert first["route"] == site.route and first["digest"] == site.trace.digest
    assert {"reason", "origin"} <= set(first)
    idf.remove(pipe)


def test_set_attention_backend_is_process_wide_so_attnres_pins_processors():
    pipe = tp.flux()
    active = _AttentionBackendRegistry._active_backend
    try:
        pipe.vae.set_attention_backend("_native_math")
        # the untouched transformer now runs it (its processors follow the active one)...
        assert str(_AttentionBackendRegistry._active_backend.value) == "_native_math"
        # ...and the VAE's legacy processors have no backend to set
        vae_procs = [m.processor for m in pipe.vae.modules() if hasattr(m, "processor")]
        assert vae_procs and not any(hasattr(p, "_attention_backend") for p in vae_procs)
    finally:
        _AttentionBackendRegistry._active_backend = active
    idf.apply(pipe)
    assert _AttentionBackendRegistry._active_backend == active
    idf.remove(pipe)


def test_shared_processor_is_never_changed_in_place_not_even_across_models():
    # issue 20, item 11: a second, ungoverned model shares the processor objects
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    pipe, other = tp.flux(), tp.flux()
    shared = FluxAttnProcessor()
    pipe.transformer.set_attn_processor(shared)
    other.transformer.set_attn_processor(shared)
    x = tp.flux_inputs()
    ref = other.transformer(**x).sample
    idf.apply(pipe, SelectionConfig(global_backend="eager"))
    procs = [m.processor for m in pipe.transformer.modules() if hasattr(m, "processor")]
    assert len({id(p) for p in procs}) == len(procs) and shared not in procs
    assert shared.__dict__ == FluxAttnProcessor().__dict__ and type(shared) is FluxAttnProcessor
    assert all(
        m.processor is shared for m in other.transformer.modules() if hasattr(m, "processor")
    )
    assert torch.equal(other.transformer(**x).sample, ref)
    idf.remove(pipe)
    assert all(m.processor is shared for m in pipe.transformer.modules() if hasattr(m, "processor"))


def test_verify_reports_replaced_processor_and_cast():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    pipe = tp.flux()
    idf.apply(pipe)
    pipe.transformer.transformer_blocks[0].attn.set_processor(FluxAttnProcessor())
    pipe.vae.to(torch.float64)
    problems = idf.verify(pipe)
    text = [str(p) for p in problems]
    assert any("transformer_blocks.0.attn" in t and "processor replaced" in t for t in text)
    assert any(t.startswith("vae/") and "cast since apply" in t for t in text)
    idf.remove(pipe)


def test_verify_reports_a_changed_context_parallel_pin():
    from diffusers.models.attention_dispatch import AttentionBackendName

    pipe = tp.flux()
    attn = pipe.transformer.transformer_blocks[0].attn
    attn.processor._parallel_config = object()
    try:
        idf.apply(pipe, SelectionConfig(global_backend="torch_sdpa"))
        pinned = attn.processor  # a copy, pinned to diffusers' native backend
        assert pinned._attention_backend == AttentionBackendName.NATIVE
        pinned._attention_backend = AttentionBackendName._NATIVE_MATH
        text = [str(p) for p in idf.verify(pipe)]
        assert any(
            "transformer_blocks.0.attn" in t
            and "pinned backend changed since apply (was native)" in t
            for t in text
        )
        idf.remove(pipe)
    finally:
        del attn.processor._parallel_config


def test_layerwise_casting_plans_for_the_compute_dtype():
    pipe = tp.flux(dtype=torch.bfloat16)
    pipe.transformer.enable_layerwise_casting(
        storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16
    )
    plan = idf.plan(pipe, SAGE, Platform.simulate(SIM))
    sites = plan.by_component()["transformer"]
    assert {s.spec.dtype for s in sites} == {"bfloat16"}
    assert {s.backend.name for s in sites} == {"sage_attn"}


def test_context_parallel_route_keeps_diffusers_check():
    pipe = tp.flux()
    proc = pipe.transformer.transformer_blocks[0].attn.processor
    proc._parallel_config = object()
    try:
        supported = idf.route_backends(proc)
        names = {b.name for b in supported}
        assert "torch_sdpa" in names and "flex_attention" not in names
        assert names <= {
            k
            for k, v in idf._DISPATCHER_BACKENDS.items()
            if v in _AttentionBackendRegistry._supports_context_parallel
        }
    finally:
        del proc._parallel_config


def test_apply_refuses_a_simulated_platform():
    pipe = tp.flux()
    with pytest.raises(IntegrationError, match="simulated"):
        idf.apply(pipe, platform=Platform.simulate("cpu"))


# --- per-class facts --------------------------------------------------------


def test_fact_clip_is_causal_per_call_not_by_attribute(flux_bf16):
    attns = [m for m in flux_bf16.text_encoder.modules() if type(m).__name__ == "CLIPAttention"]
    assert attns and all(a.is_causal is False for a in attns)
    plan = itf.plan(flux_bf16.text_encoder, "text_encoder")
    assert all(s.spec.requirements.causal for s in plan.sites)


def test_fact_t5_needs_float_masks(flux_bf16):
    plan = itf.plan(
        flux_bf16.text_encoder_2,
        "text_encoder_2",
        SelectionConfig(global_backend="fa"),
        Platform.simulate(SIM),
    )
    assert all(s.spec.requirements.attn_mask for s in plan.sites)
    assert all(s.backend.name == "torch_sdpa" for s in plan.sites)


def test_fact_flux_added_kv_proj_dim_is_joint_self_attention(flux_bf16):
    block = flux_bf16.transformer.transformer_blocks[0].attn
    assert block.added_kv_proj_dim is not None
    plan = idf.plan({"transformer": flux_bf16.transformer})
    assert {s.spec.role.value for s in plan.sites} == {"self"}


def _qwen2(heads=4, kv=2):
    from transformers import Qwen2Config, Qwen2Model

    torch.manual_seed(0)
    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=2,
        vocab_size=64,
    )
    return Qwen2Model(cfg).eval()


def test_fact_qwen2_heads_come_from_the_config():
    model = _qwen2()
    attn = model.layers[0].self_attn
    assert not hasattr(attn, "num_heads")
    plan = itf.plan(model, "text_encoder")
    site = plan.sites[0]
    assert (site.heads, site.kv_heads, site.spec.head_size) == (4, 2, 8)
    assert site.spec.requirements.gqa and site.spec.requirements.causal


def test_fact_function_without_mask_function_drops_padding():
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = _qwen2()
    ids = torch.tensor([[0, 0, 5, 6, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1]])
    ref = model(input_ids=ids, attention_mask=mask).last_hidden_state
    AttentionInterface.register("attnres_test_nomask", sdpa_attention_forward)
    model.config._attn_implementation = "attnres_test_nomask"
    out = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert not torch.allclose(ref[:, 2:], out[:, 2:], atol=1e-3)
    # attnres's route never counts such a name
    assert "attnres_test_nomask" not in itf._FUNCTIONS.values()


def test_route_counts_only_functions_with_a_mask_function(monkeypatch):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model = _qwen2()
    assert any(b.name == "flex_attention" for b in itf._native_backends(model))
    mapping = dict(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping)
    mapping.pop("flex_attention")
    monkeypatch.setattr(ALL_MASK_ATTENTION_FUNCTIONS, "_global_mapping", mapping)
    assert not any(b.name == "flex_attention" for b in itf._native_backends(model))
    # issue 22: it still runs, through attnres's function and its mask function
    assert any(b.name == "flex_attention" for b in itf.route_backends(model))


def test_transformers_apply_no_flag_identical_and_remove():
    model = _qwen2()
    ids = torch.tensor([[1, 2, 3, 4]])
    ref = model(input_ids=ids).last_hidden_state
    plan = itf.apply(model, "text_encoder")
    assert plan.ok
    assert torch.equal(ref, model(input_ids=ids).last_hidden_state)
    assert itf.verify(model) == []
    model.config._attn_implementation_internal = "eager"
    assert any("implementation" in p.problem for p in itf.verify(model))
    assert itf.remove(model) == len(plan.sites)


def test_fact_unet_attention_head_dim_holds_heads():
    unet = tp.unet()
    plan = idf.plan({"unet": unet})
    # config attention_head_dim=2 -> two heads per attention; block_out_channels 32 -> 16
    assert {(s.heads, s.spec.head_size) for s in plan.sites} == {(2, 16)}
    assert {s.spec.role.value for s in plan.sites} == {"self", "cross"}
    assert {s.route for s in plan.sites} == {"generic route (SDPA in AttnProcessor2_0)"}


# --- other pipelines --------------------------------------------------------


def test_sd3_processor_calling_sdpa_itself_gets_sage_through_the_generic_route():
    pipe = tp.sd3()
    import copy

    bf16 = copy.deepcopy(pipe["transformer"]).to(torch.bfloat16)
    plan = idf.plan({"transformer": bf16}, SAGE, Platform.simulate(SIM))
    assert plan.ok, plan.errors
    assert {s.backend.name for s in plan.sites} == {"sage_attn"}
    assert all(
        s.route.startswith("generic route (SDPA in JointAttnProcessor2_0")
        or s.route.startswith("generic route (SDPA in")
        for s in plan.sites
    )
    x = tp.sd3_inputs()
    ref = pipe["transformer"](**x).sample
    idf.apply(pipe)
    assert torch.equal(ref, pipe["transformer"](**x).sample)


def test_unet_pipeline_no_flag_identical():
    unet = tp.unet()
    x = tp.unet_inputs()
    ref = unet(**x).sample
    plan = idf.apply({"unet": unet})
    assert plan.ok
    assert torch.equal(ref, unet(**x).sample)


def test_wan_video_pipeline_vae_attention_is_found():
    comps = tp.wan()
    plan = idf.plan(comps, SAGE, Platform.simulate(SIM))
    vae_sites = plan.by_component()["vae"]
    assert vae_sites and {s.module_class for s in vae_sites} == {"WanAttentionBlock"}
    # WanAttentionBlock holds no head count: decided at its first call
    assert all(s.status is Status.PENDING and "decided at first call" in s.note for s in vae_sites)
    assert "decided at first call" in " ".join(plan.render().split())  # wrapped at 80 columns
    x = tp.wan_vae_input()
    calls = idf.find_sdpa_calls(comps["vae"], x)
    assert {n for n in calls} == {s.name for s in vae_sites}
    ref = comps["vae"](x).sample
    idf.apply(comps)
    assert torch.equal(ref, comps["vae"](x).sample)
    routes = idf.routes(comps)
    assert set(routes) == {f"vae/{s.name}" for s in vae_sites}
    for route in routes.values():
        (first,) = route.first_calls
        assert first.backend.name == "torch_sdpa" and first.trace.outcome.status is Status.SELECTED
        assert first.facts.heads == 1 and "decided at first call" in first.describe()
    assert idf.remove(comps) >= len(vae_sites)
    assert idf.routes(comps) == {}
    ids = torch.tensor([[1, 2, 3]])
    assert comps["text_encoder"](input_ids=ids).last_hidden_state.shape[-1] == 32


class _Block(torch.nn.Module):
    """A module attnres has never seen, calling SDPA itself (no head facts)."""

    def forward(self, q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Block()
        self.proj = torch.nn.Linear(4, 4)


def test_an_unknown_module_calling_sdpa_is_a_site_decided_at_first_call():
    strict = idf.plan({"transformer": _Model()}, SAGE, Platform.simulate(SIM))
    assert strict.ok
    (site,) = strict.sites
    assert site.status is Status.PENDING and site.routed and site.name == "block"


def test_a_site_calling_sdpa_with_no_heads_dimension_runs_as_one_head():
    # SDPA takes (batch, seq, dim) with no heads dimension (the HunyuanImage VAE's
    # attention block calls it so): the route sees one head and runs every query
    # over the whole sequence; before, it swapped batch and sequence, and each
    # token attended to itself only
    model = _Model()
    q = torch.randn(2, 5, 8)
    ref = model.block(q)
    idf.apply({"transformer": model}, SelectionConfig(global_backend="eager"))
    try:
        out = model.block(q)
        (route,) = idf.routes({"transformer": model}).values()
        (first,) = route.first_calls
    finally:
        idf.remove({"transformer": model})
    assert first.backend.name == "eager"
    assert (first.facts.heads, first.facts.head_size) == (1, 8)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_not_softmax_attention_is_recorded_with_its_reason():
    from diffusers.models.attention_processor import Attention, SanaLinearAttnProcessor2_0

    model = torch.nn.Module()
    model.attn = Attention(
        query_dim=16, heads=2, dim_head=8, processor=SanaLinearAttnProcessor2_0()
    )
    plan = idf.plan({"transformer": model}, SAGE, Platform.simulate(SIM))
    assert plan.ok
    (site,) = plan.sites
    assert site.status is Status.UNGOVERNED and "not softmax attention" in site.note


@pytest.mark.slow
@pytest.mark.parametrize("flag", [None, "eager"])
def test_compile_fullgraph_of_an_applied_transformer(flag):
    """Dynamo captures an applied transformer in one graph: a pinned processor
    backend is a constant to it (backend="eager" as in test_compile.py: the
    capture is what fullgraph checks; inductor's C++ build is minutes on CPU)."""
    pipe = tp.flux()
    x = tp.flux_inputs()
    ref = pipe.transformer(**x).sample
    config = None if flag is None else SelectionConfig(global_backend=flag)
    plan = idf.apply(pipe, config)
    assert {s.backend.name for s in plan.by_component()["transformer"]} == {flag or "torch_sdpa"}
    torch._dynamo.reset()
    compiled = torch.compile(pipe.transformer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(**x).sample, ref, rtol=1e-5, atol=1e-5)


# --- attnres plan DIR -------------------------------------------------------


def _write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc))


def _safetensors(path: Path, dtypes: dict[str, str]) -> None:
    import struct

    header = {
        name: {"dtype": dt, "shape": [4, 4], "data_offsets": [0, 0]} for name, dt in dtypes.items()
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw)


def test_plan_dir_dtype_sources_in_order(tmp_path, capsys):
    folder = tmp_path / "flux"
    for sub in ("transformer", "vae", "text_encoder", "text_encoder_2"):
        src = ROOT / "examples" / "flux.1-dev" / sub / "config.json"
        (folder / sub).mkdir(parents=True)
        (folder / sub / "config.json").write_text(src.read_text())
    (folder / "model_index.json").write_text(
        (ROOT / "examples" / "flux.1-dev" / "model_index.json").read_text()
    )
    # weights headers win over the config; float8 storage is not a compute dtype
    _safetensors(folder / "text_encoder" / "model.safetensors", {"w": "F16"})
    _safetensors(folder / "vae" / "diffusion_pytorch_model.safetensors", {"w": "F8_E4M3"})
    code = main(["plan", str(folder), "--json", "--dtype", "transformer=bf16"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    got = {c["name"]: (c["dtype"], c["dtype_source"]) for c in doc["components"]}
    assert got == {
        "transformer": ("bfloat16", "--dtype transformer="),
        "text_encoder": ("float16", "weights"),
        "text_encoder_2": ("bfloat16", "config torch_dtype"),
        "vae": ("float32", "default float32"),
    }
    assert main(["plan", str(folder), "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "text_encoder float16 (--dtype)" in out and "Dtypes:" in out


def test_plan_dir_full_flux_has_57_transformer_sites(capsys):
    code = main(["plan", str(ROOT / "examples" / "flux.1-dev"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    comps = {c["name"]: c for c in doc["components"]}
    assert sum(la["count"] for la in comps["transformer"]["layers"]) == 57
    assert sum(len(la["sites"]) for la in comps["transformer"]["layers"]) == 57
    assert {la["head_size"] for la in comps["transformer"]["layers"]} == {128}
    assert sum(la["count"] for la in comps["text_encoder_2"]["layers"]) == 24


def test_plan_dir_transformers_model_folder(tmp_path, capsys):
    from transformers import Qwen2Config

    cfg = Qwen2Config(
        hidden_size=64,
        intermediate_size=37,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=3,
        vocab_size=64,
        architectures=["Qwen2ForCausalLM"],
    )
    cfg.save_pretrained(tmp_path / "text_encoder")
    code = main(
        ["plan", str(tmp_path / "text_encoder"), "--json", "--trace-out", str(tmp_path / "traces")]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    (comp,) = doc["components"]
    assert comp["name"] == "text_encoder" and sum(la["count"] for la in comp["layers"]) == 3
    assert {(la["heads"], la["kv_heads"]) for la in comp["layers"]} == {(8, 2)}
    # one trace per row of like sites, and the manifest (issue 20, item 15)
    (layer,) = comp["layers"]
    assert [p.name for p in (tmp_path / "traces").glob("*.json")] == [
        Path(layer["trace_file"]).name
    ]
    assert (tmp_path / "traces" / "attnres.manifest").is_file()


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--dtype", "vae=fp32", str(ROOT / "examples" / "cpu-small.toml")], "model folder"),
        (["--dtype", "nope=fp32", str(ROOT / "examples" / "flux.1-dev")], "no model component"),
        (["--dtype", "fp7", str(ROOT / "examples" / "flux.1-dev")], "unknown dtype"),
        ([str(ROOT / "examples")], "neither a diffusers pipeline folder"),
    ],
)
def test_plan_dir_mistakes_exit_2(argv, needle, capsys):
    assert main(["plan", *argv]) == 2
    assert needle in " ".join(capsys.readouterr().err.split())


def test_plan_dir_reads_no_weights_and_is_bounded(tmp_path):
    from attnres._files import MAX_HEADER_BYTES
    from attnres.integrations._untrusted import dtype_from_weights

    big = tmp_path / "model.safetensors"
    import struct

    big.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(ValueError, match="over the 64 MiB limit for a safetensors header"):
        dtype_from_weights(tmp_path)


# --- more facts, idempotence, the ledger, the example folders ---------------


def test_fact_ltx_cross_attention_is_told_by_place_and_gets_the_prompt_mask():
    from diffusers import LTXVideoTransformer3DModel

    model = LTXVideoTransformer3DModel(
        in_channels=4,
        out_channels=4,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=1,
        caption_channels=16,
    ).eval()
    attn1 = model.transformer_blocks[0].attn1
    # the attribute lies: self-attention carries a cross_attention_dim too
    assert attn1.cross_attention_dim == attn1.query_dim
    plan = idf.plan({"transformer": model}, SAGE, Platform.simulate(SIM))
    by_name = {s.name.rsplit(".", 1)[-1]: s for s in plan.sites}
    assert by_name["attn1"].spec.role.value == "self" and by_name["attn1"].backend is None
    assert by_name["attn2"].spec.role.value == "cross"
    assert by_name["attn2"].spec.requirements.attn_mask
    plan = idf.plan({"transformer": model.to(torch.bfloat16)}, SAGE, Platform.simulate(SIM))
    by_name = {s.name.rsplit(".", 1)[-1]: s for s in plan.sites}
    assert by_name["attn1"].backend.name == "sage_attn"
    # issue 22: the prompt's padding bias is key padding, which sage takes by unpadding
    assert by_name["attn2"].spec.requirements.mask_kind == "key padding"
    assert by_name["attn2"].backend.name == "sage_attn"


def test_apply_twice_then_remove_restores_the_first_state():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    pipe = tp.flux()
    shared = FluxAttnProcessor()
    pipe.transformer.set_attn_processor(shared)
    idf.apply(pipe)
    idf.apply(pipe)
    assert idf.verify(pipe) == []
    idf.remove(pipe)
    assert all(m.processor is shared for m in pipe.transformer.modules() if hasattr(m, "processor"))
    assert "_attention_backend" not in shared.__dict__


def _site_keys():
    import attnres

    return [(d.component, d.layer) for d in attnres.decisions()]


def test_the_ledger_holds_one_current_entry_per_applied_site():
    # issue 33: plan() changes nothing, so it records nothing; apply records each
    # site it installs once, and again replaces; remove removes what it restores
    import attnres

    attnres.clear_decisions()
    pipe = tp.flux()
    plan = idf.plan(pipe)
    assert attnres.decisions() == ()
    sites = [(s.component, s.name) for s in plan.sites if s.trace is not None]
    assert sites
    idf.apply(pipe)
    assert sorted(_site_keys()) == sorted(sites)
    idf.plan(pipe)
    idf.apply(pipe)
    assert sorted(_site_keys()) == sorted(sites)
    idf.remove(pipe)
    assert attnres.decisions() == ()


def test_transformers_remove_removes_the_ledger_entries_of_its_sites():
    import attnres

    attnres.clear_decisions()
    model = _qwen2()
    plan = itf.apply(model, "text_encoder")
    itf.apply(model, "text_encoder", SelectionConfig(global_backend="eager"))
    assert sorted(_site_keys()) == sorted((s.component, s.name) for s in plan.sites)
    assert {d.backend for d in attnres.decisions()} == {"eager"}  # the current decisions
    assert itf.remove(model) == len(plan.sites)
    assert attnres.decisions() == ()


def test_consensus_compares_current_decisions_not_how_often_a_rank_planned():
    # a rank that printed one more plan, or applied twice, agrees with the others
    import attnres
    from attnres.distributed import verify_consensus

    attnres.clear_decisions()
    idf.apply(tp.flux())
    once = verify_consensus()
    attnres.clear_decisions()
    pipe = tp.flux()
    idf.plan(pipe)
    idf.apply(pipe)
    idf.plan(pipe)
    idf.apply(pipe)
    assert verify_consensus().digest == once.digest
    assert verify_consensus().layers == once.layers


def test_transformers_apply_refuses_rejections_and_changes_nothing():
    model = _qwen2()
    with pytest.raises(IntegrationError) as info:
        itf.apply(model, "transformer", SAGE, Platform.simulate(SIM))
    assert info.value.plan.sites and not info.value.plan.ok
    assert not hasattr(model, "_attnres_installed")


@pytest.mark.parametrize("folder", ["flux.1-dev", "sd3.5-large", "wan2.1-t2v-1.3b", "ltx-video"])
def test_example_folders_plan_on_this_machine(folder, capsys):
    assert main(["plan", str(ROOT / "examples" / folder)]) == 0
    out = capsys.readouterr().out
    assert "Verdict: ok" in out
    # LTX-Video's VAE has no attention: said in one line, not as an empty table
    assert ("vae  [vae, VAELoader" in out) and (
        ("(no attention sites)" in out) == (folder == "ltx-video")
    )


def test_a_training_forward_needs_backward_and_flex_on_cpu_refuses_it():
    pipe = tp.flux()
    flex = SelectionConfig(global_backend="flex_attention")
    inference = idf.plan({"transformer": pipe.transformer}, flex)
    assert inference.ok and {s.backend.name for s in inference.sites} == {"flex_attention"}
    pipe.transformer.train()
    training = idf.plan({"transformer": pipe.transformer}, flex)
    assert all(s.spec.requirements.backward for s in training.sites)
    assert not training.ok and "backward" in training.errors[0]
    pipe.text_encoder.train()
    plan = itf.plan(pipe.text_encoder, "text_encoder", flex)
    assert all(s.spec.requirements.backward and s.backend.name == "torch_sdpa" for s in plan.sites)


def test_plan_dir_per_component_flag_is_an_override_and_must_name_a_component(capsys):
    flux = str(ROOT / "examples" / "flux.1-dev")
    code = main(
        [
            "plan",
            flux,
            "--json",
            "--attention-backend",
            "eager",
            "--attention-backend",
            "text_encoder_2=torch_sdpa",
        ]
    )
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    got = {c["name"]: {(s["backend"], s["origin"]) for s in c["layers"]} for c in doc["components"]}
    assert got["text_encoder_2"] == {("torch_sdpa", "component_override")}
    assert got["transformer"] == {("eager", "global_cli")}
    # the VAE's legacy processors run only torch SDPA: the flag falls back there
    # the VAE's processors call SDPA themselves: the generic route runs eager there
    assert got["vae"] == {("eager", "global_cli")}
    assert main(["plan", flux, "--attention-backend", "nope=eager"]) == 2
    assert "has no component 'nope'" in " ".join(capsys.readouterr().err.split())


def _stand_in_plan(config):
    pipe = tp.flux(dtype=torch.bfloat16)
    return idf.plan(
        {"text_encoder_2": pipe.text_encoder_2, "transformer": pipe.transformer},
        config,
        Platform.simulate("cuda:sm90"),
    )


def test_rule_exact_route_a_stand_in_never_runs_and_site_trace_and_row_agree(monkeypatch):
    # issue 21: torch_cudnn_sdpa stands in for {torch_sdpa}; a transformers
    # interface kept to its own functions runs only the functions it names. 0.3
    # before this: the trace said `selected torch_cudnn_sdpa` while the site and
    # its plan row said `rejected` (code `route` on the site, no code on the row),
    # under the same digest. The machine now keeps the stand-in off the route: one
    # outcome everywhere. Issue 19: T5 is offered attnres's own function (which
    # runs cudnn SDPA) unless its class opts out, as it does here.
    from transformers.models.t5.modeling_t5 import T5PreTrainedModel

    monkeypatch.setattr(T5PreTrainedModel, "_supports_attention_backend", False, raising=False)
    ROUTE = itf.ROUTE
    relaxed = _stand_in_plan(SelectionConfig(global_backend="torch_cudnn_sdpa"))
    strict = _stand_in_plan(
        SelectionConfig(component_backends={"text_encoder_2": "torch_cudnn_sdpa"})
    )
    for plan in (relaxed, strict):
        rows = {(c.name, r.name): r for c in plan.components for r in c.layers}
        for site in plan.sites:
            assert site.status == site.trace.outcome.status  # never selected under rejected
            row = next(
                r for (c, _), r in rows.items() if c == site.component and site.name in r.sites
            )
            assert (row.outcome.status, row.outcome.code) == (
                site.trace.outcome.status,
                site.trace.outcome.code,
            )
            if site.name == row.sites[0]:  # the row's trace is its first site's
                assert row.trace.digest == site.trace.digest
    # the generic route runs the stand-in's own kernel
    assert {s.backend.name for s in relaxed.by_component()["transformer"]} == {"torch_cudnn_sdpa"}
    clip = relaxed.by_component()["text_encoder_2"]
    # the text encoder allows global fallback: it falls back, with a reason
    assert {(s.backend.name, s.resolution.reason.value) for s in clip} == {
        ("torch_sdpa", "global backend fallback")
    }
    failed = [
        f
        for r in clip[0].trace.records
        if getattr(r, "check", None) is not None and r.candidate.name == "torch_cudnn_sdpa"
        for f in r.failures
    ]
    assert [f.code.value for f in failed] == ["not_on_route"]
    assert clip[0].spec.exact_route == ROUTE and ROUTE in failed[0].message
    # a component override is strict: rejected by the machine, code and route named
    clip = strict.by_component()["text_encoder_2"]
    assert clip and all(s.status is Status.REJECTED for s in clip)
    assert {s.error.code for s in clip} == {"not_on_route"}
    assert all(
        f"route ({ROUTE})" in str(s.error) and "torch_cudnn_sdpa" in str(s.error) for s in clip
    )
    assert all(s.trace.outcome.code == "not_on_route" for s in clip)


def test_a_site_cannot_say_rejected_under_a_selected_trace():
    # the invariant behind the regression above, kept by the Site record itself
    from attnres import LayerSpec, resolve
    from attnres.integrations._plan import RouteKind, Site, SiteError

    spec = LayerSpec(64, "bf16", name="blocks.0.attn")
    res = resolve(spec, platform=Platform.simulate("cpu"))
    common = dict(
        component="c", name="blocks.0.attn", module_class="M", route="r", kind=RouteKind.INTERCEPT
    )
    common.update(heads=1, kv_heads=1, spec=spec, trace=res.trace)
    assert Site(**common, resolution=res, error=None).status is Status.SELECTED
    with pytest.raises(ValueError, match="is rejected but its trace says selected"):
        Site(**common, resolution=None, error=SiteError("not_on_route", "no"))


def test_call_facts_scale_window_softcap():
    # T5 scales by 1.0, not 1/sqrt(d): custom_scale; CLIP uses the default
    pipe = tp.flux()
    t5 = itf.plan(pipe.text_encoder_2, "text_encoder_2")
    assert all(s.spec.requirements.custom_scale for s in t5.sites)
    clip = itf.plan(pipe.text_encoder, "text_encoder")
    assert not any(s.spec.requirements.custom_scale for s in clip.sites)
    # Qwen2 with a sliding window on some layers
    from transformers import Qwen2Config, Qwen2Model

    cfg = Qwen2Config(
        hidden_size=32,
        intermediate_size=37,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=64,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"],
    )
    plan = itf.plan(Qwen2Model(cfg).eval(), "text_encoder")
    assert [s.spec.requirements.sliding_window for s in plan.sites] == [False, True]
    # a diffusers Attention built with scale_qk=False passes scale 1.0
    from diffusers.models.attention_processor import Attention

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.plain = Attention(32, heads=2, dim_head=16)
            self.unscaled = Attention(32, heads=2, dim_head=16, scale_qk=False)

    sites = {s.name: s for s in idf.plan({"vae": Model().eval()}).sites}
    assert not sites["plain"].spec.requirements.custom_scale
    assert sites["unscaled"].spec.requirements.custom_scale


def test_transformers_apply_twice_then_verify_reports_nothing_and_remove_restores():
    # issue 20, item 13
    pipe = tp.flux()
    enc = pipe.text_encoder
    before = enc.config._attn_implementation
    itf.apply(enc, "text_encoder")
    itf.apply(enc, "text_encoder", SelectionConfig(global_backend="eager"))
    assert itf.verify(enc) == []
    plan = itf.plan(enc, "text_encoder")
    assert itf.remove(enc) == len(plan.sites)
    assert enc.config._attn_implementation == before


def test_apply_that_fails_midway_undoes_what_it_installed(monkeypatch):
    # every apply ends in _plan.install: a step that raises undoes the steps done
    # before it, and no decision of the plan reaches the ledger
    from attnres.ledger import decisions

    unet, real, calls = tp.unet(), idf._install, []

    def second_fails(item, *args):
        calls.append(item.site.name)
        if len(calls) == 2:
            raise RuntimeError("the second install fails")
        return real(item, *args)

    monkeypatch.setattr(idf, "_install", second_fails)
    with pytest.raises(RuntimeError, match="the second install fails"):
        idf.apply({"undone": unet}, SelectionConfig(global_backend="flex_attention"))
    assert len(calls) == 2
    assert idf.routes({"undone": unet}) == {}
    assert not any("_attnres_pin" in m.__dict__ for m in unet.modules())
    assert not [d for d in decisions() if d.component == "undone"]


def test_transformers_apply_that_fails_midway_undoes_what_it_installed(monkeypatch):
    # transformers' steps return their undo too: a module's generic route
    # installed before the config step fails is removed, the config keeps what it
    # ran, and no decision reaches the ledger (before, the route stayed installed)
    from attnres.integrations import _route
    from attnres.ledger import decisions

    enc = tp.flux().text_encoder
    enc.extra = _Block()  # a module calling SDPA itself: a generic-route site
    before = enc.config._attn_implementation

    def fails(*args):
        raise RuntimeError("the config step fails")

    monkeypatch.setattr(itf, "_install_function", fails)
    explicit = SelectionConfig(global_backend="eager", global_backend_explicit=True)
    with pytest.raises(RuntimeError, match="the config step fails"):
        itf.apply(enc, "undone_tf", explicit)
    assert _route.installed_route(enc.extra) is None and itf.routes(enc) == {}
    assert enc.config._attn_implementation == before
    assert not [d for d in decisions() if d.component == "undone_tf"]
    monkeypatch.undo()
    itf.apply(enc, "undone_tf", explicit)  # and it applies cleanly afterwards
    assert _route.installed_route(enc.extra) is not None
    assert enc.config._attn_implementation == "eager"
    assert itf.remove(enc) and enc.config._attn_implementation == before


def _state(model):
    """Every attention site's install, as apply leaves it: its pin, processor (and
    the processor's own state), generic route and the callables it set."""
    from attnres.integrations import _route

    return {
        name: (
            m.__dict__.get("_attnres_pin"),
            getattr(m, "processor", None),
            dict(getattr(getattr(m, "processor", None), "__dict__", {})),
            _route.installed_route(m),
            {k: v for k, v in m.__dict__.items() if k in ("forward", "_old_forward")},
        )
        for name, m in model.named_modules()
    }


def _ledger(component):
    from attnres.ledger import decisions

    return sorted(
        (d.layer, d.backend, d.trace.digest) for d in decisions() if d.component == component
    )


def _unet_and_block():
    """A pipeline of a tiny UNet (processor copies) and a module routed on itself,
    and a function of their outputs."""
    unet, extra = tp.unet(), _Model()
    x, q = tp.unet_inputs(), torch.randn(1, 2, 5, 16)

    def outputs():
        with torch.no_grad():
            return unet(**x).sample, extra.block(q)

    return {"re_unet": unet, "re_extra": extra}, outputs


@pytest.mark.parametrize("seam", ["a later step", "inside the step"])
def test_a_failed_apply_again_leaves_the_earlier_install_as_it_was(monkeypatch, seam):
    # re-apply set each site's earlier install aside and, when a later step failed,
    # undid the sites done to their untouched state: the model was left mixed (some
    # sites untouched, others the first apply's), the ledger held the first apply's
    # decisions for all. A failed apply changes nothing: each site is put back as
    # the first apply left it, routes and processor copies whole (their rebound
    # globals back in place), and remove() still restores the untouched model
    from attnres.integrations import _route

    pipe, outputs = _unet_and_block()
    unet, extra = pipe["re_unet"], pipe["re_extra"]
    untouched, processors = outputs(), _processors_of(unet)
    idf.apply(pipe, SelectionConfig(global_backend="eager"))
    first, ledger = outputs(), _ledger("re_unet") + _ledger("re_extra")
    assert not torch.equal(first[0], untouched[0])  # eager is not SDPA, bit for bit
    state, routes = {k: _state(m) for k, m in pipe.items()}, idf.routes(pipe)
    assert routes["re_extra/block"] is _route.installed_route(extra.block)
    assert any(m.processor is not processors[n] for n, m in _attention(unet))  # copies
    sites = len(list(idf.plan(pipe).sites))
    assert sites >= 3
    if seam == "a later step":  # the last site's install raises before it starts
        real, calls = idf._install, []

        def last_fails(item, *args):
            calls.append(item.site.name)
            if len(calls) == sites:
                raise RuntimeError("the install fails")
            return real(item, *args)

        monkeypatch.setattr(idf, "_install", last_fails)
    else:  # the last site's install raises once it set the earlier install aside
        real_route, built = _route.site_route, []

        def last_fails(*args, **kwargs):
            built.append(args[0].name)
            if len(built) == sites:
                raise RuntimeError("the install fails")
            return real_route(*args, **kwargs)

        monkeypatch.setattr(_route, "site_route", last_fails)
    with pytest.raises(RuntimeError, match="the install fails"):
        idf.apply(pipe, SelectionConfig(global_backend="flex_attention"))
    monkeypatch.undo()
    assert {k: _state(m) for k, m in pipe.items()} == state
    assert idf.routes(pipe) == routes and idf.verify(pipe) == []
    assert all(torch.equal(a, b) for a, b in zip(outputs(), first, strict=True))
    assert _ledger("re_unet") + _ledger("re_extra") == ledger
    assert idf.remove(pipe) == sites
    assert _processors_of(unet) == processors
    assert all(torch.equal(a, b) for a, b in zip(outputs(), untouched, strict=True))
    assert not _ledger("re_unet") + _ledger("re_extra")


def test_a_processor_copy_whose_install_fails_takes_its_route_with_it(monkeypatch):
    # the copy's route had put its rebound globals in the processor's module and
    # was neither installed nor tied to the module: they stayed there for good
    from attnres.integrations import _route

    pipe, outputs = _unet_and_block()
    untouched = outputs()
    idf.apply(pipe, SelectionConfig(global_backend="eager"))
    first, state = outputs(), {k: _state(m) for k, m in pipe.items()}
    real_copy, real_set, made = _route.routed_processor, idf._set_processor, []

    def copy_made(processor, route):
        routed = real_copy(processor, route)
        made.append((routed, route, len(route.homes)))
        return routed

    def fails_on_a_copy(module, processor):
        if any(processor is routed for routed, _, _ in made):
            raise RuntimeError("setting the processor fails")
        real_set(module, processor)

    monkeypatch.setattr(_route, "routed_processor", copy_made)
    monkeypatch.setattr(idf, "_set_processor", fails_on_a_copy)
    with pytest.raises(RuntimeError, match="setting the processor fails"):
        idf.apply(pipe, SelectionConfig(global_backend="flex_attention"))
    monkeypatch.undo()
    ((routed, route, homes),) = made
    assert homes > 0 and route.homes == []
    tag = f"_attnres_route_{id(route):x}_"
    for func in vars(type(routed)).values():
        if isinstance(func, types.FunctionType):
            assert not any(key.startswith(tag) for key in func.__globals__)
    # the earlier install is as it was, its routes open
    assert {k: _state(m) for k, m in pipe.items()} == state and idf.verify(pipe) == []
    assert all(r.homes for r in idf.routes(pipe).values())
    assert all(torch.equal(a, b) for a, b in zip(outputs(), first, strict=True))
    idf.remove(pipe)
    assert all(torch.equal(a, b) for a, b in zip(outputs(), untouched, strict=True))


def test_apply_again_replaces_the_earlier_install_and_remove_restores_the_untouched_model():
    pipe, outputs = _unet_and_block()
    unet = pipe["re_unet"]
    untouched, processors = outputs(), _processors_of(unet)
    idf.apply(pipe, SelectionConfig(global_backend="eager"))
    eager = outputs()
    plan = idf.apply(pipe, SelectionConfig(global_backend="torch_sdpa"))
    assert idf.verify(pipe) == []
    assert {d for _, d, _ in _ledger("re_unet") + _ledger("re_extra")} == {"torch_sdpa"}
    again = outputs()
    assert not torch.equal(again[0], eager[0]) and torch.equal(again[0], untouched[0])
    assert idf.remove(pipe) == len(plan.sites)
    assert _processors_of(unet) == processors
    assert all(torch.equal(a, b) for a, b in zip(outputs(), untouched, strict=True))


def _attention(model):
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "processor")]


def _processors_of(model):
    return {n: m.processor for n, m in _attention(model)}


@pytest.mark.parametrize("seam", ["a later step", "inside the step"])
def test_transformers_a_failed_apply_again_leaves_the_earlier_install_as_it_was(monkeypatch, seam):
    # as for diffusers: the routes of the steps done went back to untouched and the
    # config's undo restored what it ran before the first apply, while the ledger
    # held the first apply's decisions
    from attnres.integrations import _route

    enc = tp.flux().text_encoder
    enc.extra, enc.extra2 = _Block(), _Block()  # generic-route sites, steps before the config's
    ids, q = torch.tensor([[1, 5, 7, 2]]), torch.randn(1, 2, 5, 16)
    before = enc.config._attn_implementation

    def outputs():
        with torch.no_grad():
            return enc(input_ids=ids).last_hidden_state, enc.extra(q), enc.extra2(q)

    untouched = outputs()
    explicit = SelectionConfig(global_backend="eager", global_backend_explicit=True)
    itf.apply(enc, "re_tf", explicit)
    first, ledger = outputs(), _ledger("re_tf")
    assert enc.config._attn_implementation == "eager" != before
    state, routes = _state(enc), itf.routes(enc)
    records = list(enc.__dict__["_attnres_installed"])
    assert set(routes) == {"re_tf/extra", "re_tf/extra2"}
    if seam == "a later step":  # the config's step, after the routes' steps, raises

        def fails(*args):
            raise RuntimeError("the install fails")

        monkeypatch.setattr(itf, "_install_function", fails)
    else:  # the second route's step raises once it set the earlier route aside
        real, calls = _route.install_route, []

        def second_fails(*args, **kwargs):
            calls.append(args[0])
            if len(calls) == 2:
                raise RuntimeError("the install fails")
            return real(*args, **kwargs)

        monkeypatch.setattr(_route, "install_route", second_fails)
    again = SelectionConfig(global_backend="torch_sdpa", global_backend_explicit=True)
    with pytest.raises(RuntimeError, match="the install fails"):
        itf.apply(enc, "re_tf", again)
    monkeypatch.undo()
    assert _state(enc) == state and itf.routes(enc) == routes and itf.verify(enc) == []
    assert enc.config._attn_implementation == "eager"
    assert enc.__dict__["_attnres_installed"] == records
    assert all(torch.equal(a, b) for a, b in zip(outputs(), first, strict=True))
    assert _ledger("re_tf") == ledger
    assert itf.remove(enc) and enc.config._attn_implementation == before
    assert all(torch.equal(a, b) for a, b in zip(outputs(), untouched, strict=True))
    assert _route.installed_route(enc.extra) is None and not _ledger("re_tf")


def test_a_failed_apply_again_of_a_pipeline_leaves_its_text_encoders_as_they_were(monkeypatch):
    # a config step done before a later one failed restored what its config ran
    # before the first apply: the first text encoder went back to untouched while
    # the second kept the first apply's function
    pipe = tp.flux()
    encoders = (pipe.text_encoder, pipe.text_encoder_2)
    before = [e.config._attn_implementation for e in encoders]
    untouched = tp.run_flux(pipe)
    idf.apply(pipe, SelectionConfig(global_backend="eager", global_backend_explicit=True))
    assert [e.config._attn_implementation for e in encoders] == ["eager", "eager"] != before
    first, records = tp.run_flux(pipe), [list(e.__dict__["_attnres_installed"]) for e in encoders]
    ledger = {c: _ledger(c) for c in pipe.components}
    state = {c: _state(m) for c, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    real, calls = itf._install_function, []

    def second_fails(*args):
        calls.append(args[1])
        if len(calls) == 2:
            raise RuntimeError("the second config's install fails")
        return real(*args)

    monkeypatch.setattr(itf, "_install_function", second_fails)
    again = SelectionConfig(global_backend="torch_sdpa", global_backend_explicit=True)
    with pytest.raises(RuntimeError, match="the second config's install fails"):
        idf.apply(pipe, again)
    monkeypatch.undo()
    assert calls == ["text_encoder", "text_encoder_2"]
    assert [e.config._attn_implementation for e in encoders] == ["eager", "eager"]
    assert [e.__dict__["_attnres_installed"] for e in encoders] == records
    assert {c: _state(m) for c, m in pipe.components.items() if c in state} == state
    assert idf.verify(pipe) == [] and {c: _ledger(c) for c in pipe.components} == ledger
    assert torch.equal(tp.run_flux(pipe), first)
    idf.remove(pipe)
    assert [e.config._attn_implementation for e in encoders] == before
    assert torch.equal(tp.run_flux(pipe), untouched)


def test_transformers_apply_again_removes_a_route_the_site_needs_no_more(monkeypatch):
    # a site routed by the first apply whose decision is now what it runs got no
    # step, so it kept the earlier route (eager here) while the ledger said
    # torch_sdpa and verify reported nothing; a failed apply puts that route back
    from attnres.integrations import _route

    enc = tp.flux().text_encoder
    enc.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    x = torch.randn(1, 5, 32)

    def out():
        with torch.no_grad():
            return enc.mha(x, x, x)[0]

    untouched = out()
    itf.apply(enc, "re_mha", SelectionConfig(global_backend="eager", global_backend_explicit=True))
    route, eager = _route.installed_route(enc.mha), out()
    assert route is not None and "forward" in enc.mha.__dict__

    def fails(*args):
        raise RuntimeError("the install fails")

    monkeypatch.setattr(itf, "_install_function", fails)
    sdpa = SelectionConfig(global_backend="torch_sdpa", global_backend_explicit=True)
    with pytest.raises(RuntimeError, match="the install fails"):
        itf.apply(enc, "re_mha", sdpa)
    monkeypatch.undo()
    assert _route.installed_route(enc.mha) is route and itf.verify(enc) == []
    assert torch.equal(out(), eager)
    plan = itf.apply(enc, "re_mha", sdpa)
    assert {s.backend.name for s in plan.sites if s.name == "mha"} == {"torch_sdpa"}
    assert _route.installed_route(enc.mha) is None and itf.routes(enc) == {}
    assert "forward" not in enc.mha.__dict__ and torch.equal(out(), untouched)
    assert itf.remove(enc) and torch.equal(out(), untouched)


def test_first_call_with_a_fact_the_plan_did_not_allow_falls_back_or_raises():
    # a site planned without dropout meets a call with dropout, which flex
    # attention does not implement: a component that may fall back re-resolves
    # (traced), a strict one raises ResolutionError naming the site and the fact;
    # flex's own error is never what the caller sees
    from attnres.errors import ResolutionError
    from attnres.integrations import _route

    flex = SelectionConfig(global_backend="flex_attention")
    q = torch.randn(1, 2, 5, 16)
    for comp in ("vae", "transformer"):
        unet = tp.unet()
        plan = idf.apply({comp: unet}, flex)
        assert {s.backend.name for s in plan.sites} == {"flex_attention"}
        routes = idf.routes({comp: unet})
        assert set(routes) == {f"{comp}/{s.name}" for s in plan.sites}
        route = next(iter(routes.values()))
        # the planned signature, bound at apply, and (the UNet passes its masks, so
        # the plan names key padding) the same signature with no mask: one kernel
        assert len(route.kernels) == 2 and len({id(k) for k in route.kernels.values()}) == 1
        if comp == "vae":
            out = route(q, q, q, dropout_p=0.0)
            torch.testing.assert_close(
                out, torch.nn.functional.scaled_dot_product_attention(q, q, q)
            )
            torch.manual_seed(0)
            route(q, q, q, dropout_p=0.5)
            record = route.first_calls[-1]
            assert isinstance(record, _route.FirstCall) and "dropout" in record.changed
            assert record.backend.name == "torch_sdpa" and record.error is None
            assert record.trace.input.layer.requirements.dropout
            assert "observed at first call: dropout" in record.describe()
        else:
            with pytest.raises(ResolutionError) as info:
                route(q, q, q, dropout_p=0.5)
            assert route.name in str(info.value) and "dropout" in str(info.value)
            assert route.first_calls[-1].error == str(info.value)
        assert idf.remove({comp: unet}) == len(plan.sites)
        assert idf.routes({comp: unet}) == {}


def test_generic_route_runs_the_decided_kernel_and_remove_restores(monkeypatch):
    from attnres.integrations import _route
    from attnres.kernels import get_kernel

    unet = tp.unet()
    x = tp.unet_inputs()
    ref = unet(**x).sample
    procs = [m.processor for m in unet.modules() if hasattr(m, "processor")]
    seen = []
    eager = get_kernel("eager")

    def spy(q, k, v, attn_mask, causal, scale):
        seen.append(tuple(q.shape))
        return eager(q, k, v, attn_mask, causal, scale)

    monkeypatch.setattr(
        _route, "get_kernel", lambda name: spy if name == "eager" else get_kernel(name)
    )
    plan = idf.apply({"unet": unet}, SelectionConfig(global_backend="eager"))
    out = unet(**x).sample
    assert len(seen) >= len(plan.sites)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert idf.remove({"unet": unet}) == len(plan.sites)
    assert [m.processor for m in unet.modules() if hasattr(m, "processor")] == procs
    assert torch.equal(unet(**x).sample, ref)


# --- one plan model: TOML, folder and live pipeline (issue 20, items 8, 15, 17) ----


def test_plan_dir_takes_role_overrides_as_the_toml_path_does(capsys):
    flux = str(ROOT / "examples" / "flux.1-dev")
    code = main(["plan", flux, "--json", "--attention-backend", "vae.self=eager"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 0
    vae = next(c for c in doc["components"] if c["name"] == "vae")
    assert {(la["backend"], la["origin"]) for la in vae["layers"]} == {("eager", "role_override")}


@pytest.mark.parametrize(
    "target", [str(ROOT / "examples" / "cpu-small.toml"), str(ROOT / "examples" / "flux.1-dev")]
)
def test_a_command_line_role_override_that_reaches_no_layer_is_rejected(target, capsys):
    # the VAE has no cross-attention layer: the override applies nowhere, which
    # a pipeline file's own role_backends entry is rejected for too
    code = main(["plan", target, "--json", "--attention-backend", "vae.cross=eager"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1 and doc["status"] == "rejected"
    vae = next(c for c in doc["components"] if c["name"] == "vae")
    assert "vae.cross=eager" in vae["error"] and "applies nowhere" in vae["error"]


def test_one_json_schema_for_toml_and_folder_plans(capsys):
    main(["plan", str(ROOT / "examples" / "cpu-small.toml"), "--json"])
    toml = json.loads(capsys.readouterr().out)
    main(["plan", str(ROOT / "examples" / "flux.1-dev"), "--json"])
    folder = json.loads(capsys.readouterr().out)
    assert set(toml) == set(folder)
    assert set(toml["components"][0]) == set(folder["components"][0])
    assert set(toml["components"][0]["layers"][0]) == set(folder["components"][0]["layers"][0])
    assert folder["components"][0]["layers"][0]["sites"]  # a folder row names its sites
    assert toml["components"][0]["layers"][0]["sites"] == []


def test_plan_dir_autotune_says_which_rows_would_be_measured(capsys):
    flux = str(ROOT / "examples" / "flux.1-dev")
    assert main(["plan", flux, "--json", "--autotune"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all(isinstance(la["autotune"], bool) for c in doc["components"] for la in c["layers"])
    assert any(la["autotune"] for c in doc["components"] for la in c["layers"])
    assert main(["plan", flux, "--autotune"]) == 0
    assert "Autotune:" in capsys.readouterr().out


def test_plan_dir_trace_out_writes_the_manifest_and_stale_traces_fail_replay(tmp_path, capsys):
    from attnres.replayer import replay_paths

    out = tmp_path / "traces"
    assert main(["plan", str(ROOT / "examples" / "cpu-small.toml"), "--trace-out", str(out)]) == 0
    stale = sorted(p.name for p in out.glob("*.json"))
    assert main(["plan", str(ROOT / "examples" / "flux.1-dev"), "--trace-out", str(out)]) == 0
    capsys.readouterr()
    manifest = json.loads((out / "attnres.manifest").read_text())
    assert manifest["complete"] and manifest["files"]
    assert not set(stale) & set(manifest["files"])
    run = replay_paths([out])
    assert run.invalid
    assert any("not listed in attnres.manifest" in p for p in run.path_problems)
    for name in stale:
        (out / name).unlink()
    clean = replay_paths([out])
    assert not clean.invalid and not clean.diverged


def test_the_integrations_export_no_mutable_tables():
    # issue 21: the tables are read-only and private; a fact lives in code or in a
    # read-only table naming the library version it was checked against
    for module in (idf, itf):
        for name in module.__all__:
            value = getattr(module, name)
            assert not isinstance(value, (dict, list, set)), f"{module.__name__}.{name}"
        for name, value in vars(module).items():
            if name.isupper() or (name.startswith("_") and name[1:].isupper()):
                assert not isinstance(value, (dict, list, set)), f"{module.__name__}.{name}"


def test_transformers_sites_are_found_by_the_interface_call_bert_included():
    # Bert (HunyuanDiT's text encoder) was not governed: its attention classes are
    # in no table; its code calls the attention interface
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=2,
        intermediate_size=37,
        vocab_size=64,
    )
    model = BertModel(config).eval()
    plan = itf.plan(model, "text_encoder")
    assert plan.ok and len(plan.sites) == 2
    assert {(s.heads, s.spec.head_size) for s in plan.sites} == {(4, 8)}
    eager = itf.plan(model, "text_encoder", SelectionConfig(global_backend="eager"))
    assert {s.backend.name for s in eager.sites} == {"eager"}


def test_route_kinds_are_typed_and_installs_dispatch_on_them_not_on_the_words(monkeypatch):
    # issue 30: a route has a kind (intercept, interface, pin, own code); the
    # integrations dispatch on it. Rewording every route a plan shows changes
    # nothing the apply does.
    import attrs
    from transformers import BertConfig, BertModel

    from attnres.integrations import _route
    from attnres.integrations._plan import RouteKind

    class ByHand(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads, self.head_dim = 2, 8
            self.qkv = torch.nn.Linear(16, 48)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
            weights = torch.softmax(q @ k.transpose(-1, -2) * 8**-0.5, dim=-1)
            return weights @ v

    config = BertConfig(
        hidden_size=32,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=37,
        vocab_size=64,
    )
    model = BertModel(config)
    model.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    model.hand = ByHand()
    model.config._attn_implementation = "eager"
    model = model.eval()
    plan = itf.plan(model, "text_encoder", SelectionConfig(global_backend="torch_sdpa"))
    kinds = {s.name: s.kind for s in plan.sites}
    assert kinds["encoder.layer.0.attention.self"] is RouteKind.INTERFACE
    # issue 30: softmax attention written by hand is its own code
    assert kinds["mha"] is RouteKind.INTERCEPT and kinds["hand"] is RouteKind.OWN_CODE
    by_name = {s.name: s for s in plan.sites}
    assert by_name["hand"].by_hand and not by_name["mha"].by_hand
    assert all(isinstance(k, RouteKind) for k in kinds.values())

    real_plan = itf.plan
    x = torch.randn(1, 5, 16)
    ids = torch.randint(0, 64, (1, 5))
    reference = (model(ids).last_hidden_state, model.mha(x, x, x)[0], model.hand(x))

    def run(reworded: bool):
        def reworded_plan(*args, **kwargs):
            result = real_plan(*args, **kwargs)
            if not reworded:
                return result
            components = tuple(
                attrs.evolve(c, sites=tuple(attrs.evolve(s, route=f"{s.name}!") for s in c.sites))
                for c in result.components
            )
            return attrs.evolve(result, components=components)

        monkeypatch.setattr(itf, "plan", reworded_plan)
        applied = itf.apply(model, "text_encoder", SelectionConfig(global_backend="torch_sdpa"))
        try:
            with torch.no_grad():
                out = (model(ids).last_hidden_state, model.mha(x, x, x)[0], model.hand(x))
            assert applied.ok
            installed = (
                model.config._attn_implementation,
                _route.installed_route(model.hand) is not None,
            )
        finally:
            itf.remove(model)
        return out, installed

    plain, installed = run(False)
    worded, installed_worded = run(True)
    assert installed == installed_worded == ("sdpa", False)
    for a, b, ref in zip(plain, worded, reference, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)


def test_a_padding_mask_at_a_strict_dispatcher_site_under_sage_is_a_typed_error(monkeypatch):
    # Chroma, LTX-2, Qwen-Image: a text-padding mask reached sage, which raised
    # its own "attn_mask is not supported". The route sees the mask first.
    from attnres.errors import ResolutionError
    from attnres.integrations import _route

    pipe = tp.flux(dtype=torch.bfloat16)
    sim = Platform.simulate(SIM)
    plan = idf.plan({"transformer": pipe.transformer}, SAGE, sim)
    site = plan.sites[0]
    assert site.backend.name == "sage_attn" and "dispatcher" in site.route
    reached = []

    def fake_sage(q, k, v, attn_mask, causal, scale):  # sageattn: no mask argument
        reached.append(attn_mask)
        return q

    real = _route.get_kernel
    monkeypatch.setattr(
        _route, "get_kernel", lambda name: fake_sage if name == "sage_attn" else real(name)
    )
    route = _route.GenericRoute(
        component="transformer",
        name=site.name,
        spec=site.spec,
        heads=site.heads,
        kv_heads=site.kv_heads,
        resolution=site.resolution,
        config=SAGE,
        scope=scope_state("transformer"),
        platform=sim,
    )
    dispatch = route.dispatcher(lambda *a, **k: reached.append(a))
    q = torch.randn(1, 6, site.heads, site.spec.head_size, dtype=torch.bfloat16)
    assert dispatch(q, q, q) is q and reached == [None]  # the planned signature: sage
    reached.clear()
    q = torch.randn(1, 6, site.heads, site.spec.head_size, dtype=torch.bfloat16)
    # issue 22: a key-padding mask would run sage's varlen entry point
    # (tests/test_masks_diffusers.py); a mask whose queries see different keys
    # is boolean, which sage cannot take
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool).tril()
    mask[..., 0, 1] = True
    with pytest.raises(ResolutionError) as info:
        dispatch(q, q, q, attn_mask=mask)
    assert site.name in str(info.value) and "boolean mask" in str(info.value)
    assert reached == []
    (first,) = route.first_calls
    assert first.facts.mask == _route.MaskFacts(True, "bool", (1, 1, 6, 6), MaskKind.BOOLEAN)


def test_apply_refuses_a_role_override_that_reaches_no_site():
    unet = tp.unet()
    config = SelectionConfig(component_backends={"vae.cross": "eager"})
    vae = torch.nn.Module()  # self-attention only
    vae.block = next(m for n, m in unet.named_modules() if n.endswith("attn1"))
    plan = idf.plan({"vae": vae}, config)
    assert not plan.ok and "applies nowhere" in plan.errors[0]
    assert "applies nowhere" in plan.render()
    with pytest.raises(IntegrationError):
        idf.apply({"vae": vae}, config)
    assert idf.routes({"vae": vae}) == {}


def test_a_routed_model_dropped_without_remove_leaves_nothing_in_the_library_modules():
    # issue 19: a model dropped without remove() kept its routes' rebound globals
    # (and the routes) alive for the rest of the process; issue 30: a rebound
    # site reads its module's own globals, its stand-ins under names added to that
    # module's namespace, which go with the model
    import gc
    import weakref

    def added() -> set[tuple[str, str]]:
        return {
            (name, key)
            for name, module in list(sys.modules.items())
            for key in list(getattr(module, "__dict__", {}))
            if key.startswith("_attnres_route_")
        }

    before = added()
    unet = tp.unet()
    plan = idf.apply({"unet": unet}, SelectionConfig(global_backend="eager"))
    routed = added() - before
    assert routed and len(idf.routes({"unet": unet})) == len(plan.sites)
    assert {name for name, _ in routed} == {"diffusers.models.attention_processor"}
    alive = weakref.ref(unet)
    del unet
    gc.collect()
    assert alive() is None
    assert not routed & added()


def test_plan_dir_a_pipeline_diffusers_cannot_import_is_a_folder_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # make test-oldest: diffusers 0.42's LTX-2 pipelines import a Gemma 4 class that
    # transformers has from 5.5; reading the named pipeline raised diffusers' lazy
    # RuntimeError, which `attnres plan DIR` reported as a bug in attnres (exit 70)
    def unimportable(name: str | None) -> type | None:
        try:
            raise ImportError("cannot import name 'Gemma4ForConditionalGeneration'")
        except ImportError as exc:
            raise RuntimeError(f"Failed to import diffusers.pipelines.{name}") from exc

    from attnres.errors import FolderBuildError
    from attnres.integrations import plan_folder

    monkeypatch.setattr(idf, "pipeline_class", unimportable)
    flux = ROOT / "examples" / "flux.1-dev"
    with pytest.raises(FolderBuildError) as info:
        plan_folder(flux, platform=Platform.simulate("cpu"))
    assert str(info.value).startswith(f"{flux / 'model_index.json'}: _class_name: ")
    said = "cannot import FluxPipeline, the pipeline it names: ImportError: cannot import name "
    assert said in str(info.value)
    assert main(["plan", str(flux), "--platform", "cpu"]) == 2
    assert "Gemma4ForConditionalGeneration" in capsys.readouterr().err


def test_transformers_remove_forgets_every_site_apply_decided_even_one_it_left_as_it_ran():
    # an MHA decided torch_sdpa, which it runs already, installs nothing; remove()
    # still restores it (counted) and drops its ledger entry, as diffusers does
    import attnres

    enc = tp.flux().text_encoder
    enc.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True).eval()
    sdpa = SelectionConfig(global_backend="torch_sdpa", global_backend_explicit=True)
    plan = itf.apply(enc, "rm_mha", sdpa)
    names = {s.name for s in plan.sites if s.trace is not None}
    assert "mha" in names and itf.routes(enc) == {}

    def ledger() -> set[str]:
        return {d.layer for d in attnres.decisions() if d.component == "rm_mha"}

    assert ledger() == names
    assert itf.remove(enc) == len(names)
    assert ledger() == set()
    assert itf.remove(enc) == 0  # nothing is left to restore
