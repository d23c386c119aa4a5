"""Issue 22's Done-when on a tiny Qwen-Image DiT: two prompts of different
lengths (a text-padding mask in the joint attention), a global ``sage_attn`` on
a simulated ``cuda:sm90+flash_attn+sageattention``: every DiT site plans
``sage_attn`` for key padding, and, installed with the varlen stand-ins of
tests/test_masks.py, the DiT gives the untouched model's output."""

from __future__ import annotations

import sys
from typing import Any

import attrs
import pytest
import torch
from test_kernels_fakes import Calls

from attnres import Platform
from attnres.integrations import diffusers as idf
from attnres.layer import SelectionConfig

SIM = Platform.simulate("cuda:sm90+flash_attn+sageattention")
#: the same facts, installable: the stand-ins run them on this CPU
STAND_IN = attrs.evolve(SIM, simulated=False)
SAGE = SelectionConfig(global_backend="sage_attn", global_backend_explicit=True)


def _qwen_image() -> Any:
    import tiny_pipelines as tp

    return tp.qwen_image_transformer().eval().to(torch.bfloat16)


def _inputs() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    batch, text, side = 2, 7, 4
    mask = torch.zeros(batch, text, dtype=torch.long)
    mask[0, :7] = 1  # two prompts of different lengths: 7 and 3 tokens
    mask[1, :3] = 1
    return {
        "hidden_states": torch.randn(batch, side * side, 16, generator=gen).bfloat16(),
        "encoder_hidden_states": torch.randn(batch, text, 16, generator=gen).bfloat16(),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.tensor([1.0, 1.0]),
        "img_shapes": [(1, side, side)] * batch,
        "return_dict": False,
    }


def test_qwen_image_plans_sage_for_key_padding_at_every_dit_site() -> None:
    plan = idf.plan({"transformer": _qwen_image()}, SAGE, SIM)
    assert plan.ok, plan.errors
    assert plan.sites and {s.backend.name for s in plan.sites} == {"sage_attn"}
    assert {s.spec.requirements.mask_kind for s in plan.sites} == {"key padding"}
    for site in plan.sites:
        assert site.trace.input.layer.requirements.mask.value == "key_padding"


def test_qwen_image_runs_sage_varlen_with_the_untouched_output(varlen_fakes: Calls) -> None:
    model = _qwen_image()
    with torch.no_grad():
        before = model(**_inputs())[0]
        plan = idf.apply({"transformer": model}, SAGE, STAND_IN)
        try:
            assert {s.backend.name for s in plan.sites} == {"sage_attn"}
            after = model(**_inputs())[0]
        finally:
            idf.remove({"transformer": model})
        again = model(**_inputs())[0]
    varlen = [c for c in varlen_fakes.seen if "tensor_layout" not in c]  # sageattn_varlen's calls
    assert varlen and len(varlen) == len(varlen_fakes.seen)  # every DiT call unpadded
    error = float((after.double() - before.double()).norm() / before.double().norm())
    assert error < 2e-2, error
    assert torch.equal(again, before)  # remove restored the untouched model


def _route_for(mask_kind: str) -> Any:
    """A generic-route site of a strict transformer planned for ``mask_kind``
    (``none``: it declared no mask), decided sage_attn."""
    from attnres import LayerSpec, resolve
    from attnres.integrations import _route
    from attnres.scope import scope_state

    spec = LayerSpec(16, "bf16", requirements={"none": []}.get(mask_kind, [mask_kind]),
                     name="blocks.0.attn")  # fmt: skip
    resolution = resolve(spec, config=SAGE, platform=STAND_IN)
    assert resolution.backend.name == "sage_attn"
    return _route.GenericRoute(
        component="transformer", name="blocks.0.attn", spec=spec, heads=2, kv_heads=2,
        resolution=resolution, config=SAGE, scope=scope_state("transformer"),
        platform=STAND_IN,
    )  # fmt: skip


def test_first_call_observes_key_padding_and_runs_varlen(varlen_fakes: Calls) -> None:
    from reference import reference

    route = _route_for("none")  # a Chroma-like site: its plan saw no mask
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 6, 16, generator=gen).bfloat16() for _ in range(3))
    valid = torch.arange(6) < torch.tensor([[6], [2]])
    mask = valid[:, None, :, None] & valid[:, None, None, :]  # query-and-key padding
    out = route(q, k, v, attn_mask=mask)
    (first,) = route.first_calls
    assert first.backend is not None and first.backend.name == "sage_attn"
    assert first.changed == ("key-padding mask (bool, shape [2, 1, 6, 6]),)"[:-2],)
    assert first.trace.input.layer.requirements.mask.value == "key_padding"
    ref = reference(*(t.transpose(1, 2) for t in (q, k, v)), valid[:, None, None, :])
    got = out.transpose(1, 2).double()[valid]
    assert float((got - ref[valid]).norm() / ref[valid].norm()) < 2e-2
    assert varlen_fakes.seen and "tensor_layout" not in varlen_fakes.seen[-1]  # sageattn_varlen


def test_first_call_additive_mask_on_a_strict_site_names_the_kind(varlen_fakes: Calls) -> None:
    from attnres import ResolutionError

    route = _route_for("key_padding")
    q = torch.randn(1, 2, 4, 16).bfloat16()
    bias = torch.randn(1, 2, 4, 4).bfloat16()
    with pytest.raises(ResolutionError) as info:
        route(q, q, q, attn_mask=bias)
    message = str(info.value)
    assert "observed at first call: additive mask" in message
    assert "does not implement additive masks" in message
    assert not varlen_fakes.seen  # no kernel ran with a fact the plan did not allow


def test_context_parallel_key_padding_site_never_pins_an_unpad_only_kernel() -> None:
    """A pinned dispatcher backend gets the mask as is: sage, which takes key
    padding only through attnres's unpad route, is not in such a site's set."""
    model = _qwen_image()
    procs = [m.processor for m in model.modules() if hasattr(m, "processor")]
    for proc in procs:
        proc._parallel_config = object()
    try:
        plan = idf.plan({"transformer": model}, SAGE, SIM)
    finally:
        for proc in procs:
            del proc._parallel_config
    assert plan.sites
    for site in plan.sites:
        assert site.spec.requirements.mask_kind == "key padding"
        assert "sage_attn" not in {b.name for b in site.spec.supported or ()}
        assert site.backend is None and site.error  # strict: a typed error, not a crash later


# --- whole pipelines and the other DiTs that pass a text-padding mask ----------


def _spy_varlen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int]]:
    """Wrap the stand-in ``sageattn_varlen``: (heads, head size, sequences) per call,
    so a call tells its site's shape."""
    import sys

    fake = sys.modules["sageattention"]
    real = fake.sageattn_varlen
    seen: list[tuple[int, int, int]] = []

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
            *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        seen.append((int(q.shape[1]), int(q.shape[2]), int(cu_q.numel()) - 1))
        return real(q, k, v, cu_q, *args, **kwargs)

    monkeypatch.setattr(fake, "sageattn_varlen", spy)
    return seen


def _rel_error(after: torch.Tensor, before: torch.Tensor) -> float:
    return float((after.double() - before.double()).norm() / before.double().norm())


def _apply_and_compare(pipe: Any, run: Any) -> tuple[Any, dict[str, Any]]:
    """Run untouched, applied (global sage_attn, stand-ins) and removed: the applied
    output is the untouched one within tolerance, and remove restores it exactly.
    Returns the plan and the routes that were installed."""
    with torch.no_grad():
        before = run()
        plan = idf.apply(pipe, SAGE, STAND_IN)
        try:
            after = run()
            routes = idf.routes(pipe)
        finally:
            idf.remove(pipe)
        again = run()
    assert torch.equal(again, before)  # remove restored the untouched pipeline
    assert _rel_error(after, before) < 2e-2, _rel_error(after, before)
    return plan, routes


@pytest.fixture(scope="module")
def qwen_pipe() -> Any:
    import tiny_pipelines as tp

    return tp.qwen_image()


def test_whole_qwen_image_pipeline_plans_sage_for_its_padded_prompts(qwen_pipe: Any) -> None:
    plan = idf.plan(qwen_pipe, SAGE, SIM)
    assert plan.ok, plan.errors
    groups = plan.by_component()
    dit = groups["transformer"]
    assert dit and {s.backend.name for s in dit if s.backend} == {"sage_attn"}
    assert all(s.backend is not None and s.resolution.reason is None for s in dit)
    assert {s.spec.requirements.mask_kind for s in dit} == {"key padding"}
    # the Qwen2.5-VL text encoder: its decoder layers pass causal with key padding
    text = groups["text_encoder"]
    assert text and {s.backend.name for s in text if s.backend} == {"sage_attn"}
    language = [s for s in text if ".language_model." in s.name]
    assert language and {s.spec.requirements.mask_kind for s in language} == {
        "causal with key padding"
    }
    # the VAE's attention blocks are sites, decided at their first call
    vae = groups["vae"]
    assert vae and all(s.pending for s in vae)


def test_whole_qwen_image_pipeline_runs_sage_varlen_with_the_untouched_output(
    qwen_pipe: Any, varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiny_pipelines as tp

    spied = _spy_varlen(monkeypatch)
    plan, routes = _apply_and_compare(qwen_pipe, lambda: tp.run_qwen_image(qwen_pipe))
    dit = [s for s in plan.sites if s.component == "transformer"]
    heads, size = dit[0].heads, dit[0].spec.head_size
    # every DiT call (2 blocks x 2 steps) ran sageattn_varlen on the two prompts
    assert spied.count((heads, size, 2)) == 2 * len(dit), spied
    # the text encoder's padded batch ran varlen too (causal with key padding)
    text = [s for s in plan.sites if s.component == "text_encoder" and ".language_" in s.name]
    assert (text[0].heads, text[0].spec.head_size, 2) in spied
    assert any(c.get("is_causal") for c in varlen_fakes.seen)
    # the VAE's sites were governed: decided at their first call, traced
    vae = [r for name, r in routes.items() if name.startswith("vae/")]
    assert vae and any(r.first_calls for r in vae)
    for route in vae:
        for first in route.first_calls:
            assert first.backend is not None, first.error


def test_whole_hunyuan_video_pipeline_runs_sage_varlen_with_the_untouched_output(
    varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HunyuanVideo: its token refiner's padded queries see the first token, its
    joint blocks get [B, 1, 1, N] prompt padding; its Llama encoder passes causal
    with key padding; its VAE (float32) falls back, traced."""
    import tiny_pipelines as tp

    pipe = tp.hunyuan_video()
    plan = idf.plan(pipe, SAGE, SIM)
    assert plan.ok, plan.errors
    groups = plan.by_component()
    dit = groups["transformer"]
    assert dit and {s.backend.name for s in dit} == {"sage_attn"}
    assert {s.spec.requirements.mask_kind for s in dit} == {"key padding"}
    llama = groups["text_encoder"]
    assert {(s.backend.name, s.spec.requirements.mask_kind) for s in llama} == {
        ("sage_attn", "causal with key padding")
    }
    assert all(s.resolution.reason == "global backend fallback" for s in groups["vae"])
    spied = _spy_varlen(monkeypatch)
    _, routes = _apply_and_compare(pipe, lambda: tp.run_hunyuan_video(pipe))
    # every DiT call (3 sites x 2 steps) and every Llama layer ran sageattn_varlen
    assert spied.count((dit[0].heads, dit[0].spec.head_size, 2)) == 2 * len(dit), spied
    assert spied.count((llama[0].heads, llama[0].spec.head_size, 2)) == len(llama), spied
    for site in dit:  # each verified its planned kind at its first call
        assert not routes[f"transformer/{site.name}"].first_calls, site.name


@pytest.mark.parametrize("side", [4, 2], ids=["32-video-tokens", "8-video-tokens"])
def test_ltx2_dit_with_padded_prompts_plans_and_runs_sage_varlen(
    side: int, varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LTX-2: a -10000 prompt-padding bias in attn2 and audio_attn2: the plan names
    key padding there, the applied DiT runs sageattn_varlen there and gives the
    untouched output -- also when the video has as many tokens as the prompt
    (8): a cross-attention of equal lengths, whose video queries at the prompt's
    padded positions are computed, not dropped as padding."""
    import tiny_pipelines as tp

    model, inputs = tp.ltx2(side=side)
    plan = idf.plan({"transformer": model}, SAGE, SIM)
    assert plan.ok, plan.errors
    padded = [s for s in plan.sites if s.spec.requirements.mask_kind == "key padding"]
    assert padded and {s.backend.name for s in plan.sites} == {"sage_attn"}
    spied = _spy_varlen(monkeypatch)
    _, routes = _apply_and_compare({"transformer": model}, lambda: model(**inputs)[0])
    assert len(spied) == len(padded)  # one varlen call per key-padding site, no other
    for site in padded:  # each verified its planned kind at the first call
        assert not routes[f"transformer/{site.name}"].first_calls, site.name


@pytest.mark.parametrize("registers", [None, 4], ids=["padding", "registers"])
def test_ltx2_prompt_connectors_plan_and_run_sage_varlen(
    registers: int | None, varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LTX-2's prompt connectors pass the prompt padding as a -finfo.max bias (or an
    all-zero one where registers replace the padding): key padding, named by the
    plan and verified at the first call."""
    import tiny_pipelines as tp

    model, (states, mask) = tp.ltx2_connectors(registers)
    plan = idf.plan({"connectors": model}, SAGE, SIM)
    assert plan.ok, plan.errors
    assert {(s.backend.name, s.spec.requirements.mask_kind) for s in plan.sites} == {
        ("sage_attn", "key padding")
    }
    spied = _spy_varlen(monkeypatch)
    _, routes = _apply_and_compare({"connectors": model}, lambda: model(states, mask)[0])
    assert len(spied) == len(plan.sites)
    assert all(not route.first_calls for route in routes.values())


def test_chroma_pipeline_plan_names_its_additive_mask_before_any_call() -> None:
    """ChromaPipeline (diffusers 0.42.1) hands its DiT the prompt mask in the
    prompt's float dtype, which SDPA adds as a 0/1 bias: no key-padding route can
    reproduce it. Under a strict global sage_attn the plan fails with the kind
    named, and apply changes nothing -- never a plan that passes and then meets
    the mask at the first call."""
    import tiny_pipelines as tp

    from attnres.integrations import IntegrationError

    pipe = tp.chroma()
    plan = idf.plan(pipe, SAGE, SIM)
    dit = plan.by_component()["transformer"]
    assert dit and {s.spec.requirements.mask_kind for s in dit} == {"additive mask"}
    assert all(
        s.backend is None and "does not implement additive masks" in str(s.error) for s in dit
    )
    with pytest.raises(IntegrationError):
        idf.apply(pipe, SAGE, STAND_IN)
    assert not idf.routes(pipe)
    # with no flag it plans what it runs: torch SDPA takes every kind
    assert idf.plan(pipe, SelectionConfig(), SIM).ok


def _pinned_qwen_image(backend: str) -> tuple[Any, torch.Tensor]:
    """The tiny Qwen-Image DiT and its untouched output, then every processor
    pinned to diffusers' ``backend`` (what ``set_attention_backend`` sets)."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    model = _qwen_image()
    with torch.no_grad():
        before = model(**_inputs())[0]
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(type(processor), "_attention_backend"):
            processor._attention_backend = AttentionBackendName(backend)
    return model, before


def test_a_dispatcher_site_decided_torch_sdpa_never_runs_the_processors_own_backend() -> None:
    """diffusers' ``sage_varlen``/``flash_varlen`` assume right padding: a site whose
    processor pins one and that attnres decided torch_sdpa runs diffusers' native
    SDPA, as decided (here the pinned sage_varlen has no kernel on this CPU, so
    reaching it would fail)."""
    model, before = _pinned_qwen_image("sage_varlen")
    sdpa = SelectionConfig(global_backend="torch_sdpa", global_backend_explicit=True)
    with torch.no_grad():
        plan = idf.apply({"transformer": model}, sdpa, STAND_IN)
        try:
            assert {s.backend.name for s in plan.sites} == {"torch_sdpa"}
            after = model(**_inputs())[0]
        finally:
            idf.remove({"transformer": model})
    assert torch.equal(after, before)


def test_a_dispatcher_pinned_to_a_dense_kernel_is_routed_for_its_key_padding_mask(
    varlen_fakes: Calls,
) -> None:
    """A processor pinned to diffusers' ``flash`` (the decision, fa, is what it
    runs) would hand its key-padding mask to the dense kernel, which raises
    "attn_mask is not supported": the site is routed anyway, through attnres's
    unpad route and flash_attn_varlen_func."""
    model, before = _pinned_qwen_image("flash")
    with torch.no_grad():
        plan = idf.apply({"transformer": model}, SelectionConfig(), STAND_IN)
        try:
            assert {(s.backend.name, s.current.name) for s in plan.sites} == {("fa", "fa")}
            assert set(idf.routes({"transformer": model})) == {
                f"transformer/{s.name}" for s in plan.sites
            }
            after = model(**_inputs())[0]
        finally:
            idf.remove({"transformer": model})
    assert _rel_error(after, before) < 2e-2, _rel_error(after, before)
    assert varlen_fakes.seen and all("cu_seqlens_q" in c for c in varlen_fakes.seen)


def test_whole_ltx2_pipeline_plans_and_runs_sage_varlen_with_the_untouched_output(
    varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole tiny LTX2Pipeline, two prompts of different lengths (left-padded by
    the pipeline): the DiT's prompt cross-attentions (attn2, audio_attn2) and the
    prompt connectors plan sage for key padding, every other DiT site sage with no
    mask; the Gemma3 text encoder's decoder layers are causal with key padding and
    sliding-window, which sage does not implement: they fall back to torch SDPA,
    traced with that reason. Applied through the stand-ins, video and audio match
    the untouched pipeline; remove restores it exactly."""
    import tiny_pipelines as tp

    pipe = tp.ltx2_pipeline()
    plan = idf.plan(pipe, SAGE, SIM)
    assert plan.ok, plan.errors
    groups = plan.by_component()
    dit = groups["transformer"]
    assert dit and {s.backend.name for s in dit} == {"sage_attn"}
    assert all(s.resolution.reason is None for s in dit)
    padded = [s for s in dit if s.spec.requirements.mask_kind == "key padding"]
    assert {s.name.rsplit(".", 1)[1] for s in padded} == {"attn2", "audio_attn2"}
    assert {s.spec.requirements.mask_kind for s in dit if s not in padded} == {"none"}
    connectors = groups["connectors"]
    assert {(s.backend.name, s.spec.requirements.mask_kind) for s in connectors} == {
        ("sage_attn", "key padding")
    }
    language = [s for s in groups["text_encoder"] if ".language_model." in s.name]
    assert language and {
        (s.backend.name, s.spec.requirements.mask_kind, s.resolution.reason.value) for s in language
    } == {("torch_sdpa", "causal with key padding", "global backend fallback")}
    for site in language:
        assert site.spec.requirements.sliding_window
        assert "does not implement sliding-window attention" in str(site.trace)

    spied = _spy_varlen(monkeypatch)
    fake = sys.modules["sageattention"]
    inner = fake.sageattn_varlen
    keys: list[list[int]] = []  # the valid key lengths of each varlen call

    def lengths(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor,
                cu_k: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # fmt: skip
        keys.append(torch.diff(cu_k).tolist())
        return inner(q, k, v, cu_q, cu_k, *args, **kwargs)

    monkeypatch.setattr(fake, "sageattn_varlen", lengths)
    with torch.no_grad():
        before = tp.run_ltx2_pipeline(pipe)
        applied = idf.apply(pipe, SAGE, STAND_IN)
        try:
            after = tp.run_ltx2_pipeline(pipe)
            routes = idf.routes(pipe)
        finally:
            idf.remove(pipe)
        again = tp.run_ltx2_pipeline(pipe)
    assert [s.backend.name for s in applied.sites] == [s.backend.name for s in plan.sites]
    for untouched, got, restored in zip(before, after, again, strict=True):
        assert torch.equal(restored, untouched)  # remove restored the untouched pipeline
        assert _rel_error(got, untouched) < 2e-2, _rel_error(got, untouched)
    # every key-padding DiT call (2 sites x 2 blocks x 2 steps) and each connector
    # ran sageattn_varlen on the two prompts; nothing else did
    steps = 2
    expected = [(s.heads, s.spec.head_size, 2) for s in padded] * steps
    expected += [(s.heads, s.spec.head_size, 2) for s in connectors]
    assert sorted(spied) == sorted(expected), spied
    # the connectors (first) see the prompts' own lengths; diffusers 0.42.1's
    # connectors hand the DiT ``video_attn_mask < 1e-6`` of their 0/-finfo.max bias,
    # true at every position: the DiT's key-padding calls see all 16 tokens valid
    assert keys == [[6, 2]] * len(connectors) + [[16, 16]] * len(padded) * steps, keys
    # each verified its planned kind at its first call; the no-mask sites met none
    for site in [*dit, *connectors]:
        assert not routes[f"{site.component}/{site.name}"].first_calls, site.name


def _ltx2_in_context(model: Any) -> Any:
    """An ``LTX2InContextPipeline`` (IC-LoRA) around ``model``, with the other
    components of the tiny LTX2Pipeline (planned and applied, never called)."""
    import tiny_pipelines as tp
    from diffusers import LTX2InContextPipeline

    components = {k: v for k, v in tp.ltx2_pipeline().components.items() if v is not None}
    return LTX2InContextPipeline(**{**components, "transformer": model})


def _ic_lora_mask(inputs: dict[str, Any], strength: float = 0.5) -> torch.Tensor:
    """The video self-attention mask LTX2InContextPipeline builds (its own
    ``_build_video_self_attention_mask``): the last quarter of the video tokens a
    reference group attended at ``strength``, per batch row."""
    from diffusers import LTX2InContextPipeline

    batch, tokens = inputs["hidden_states"].shape[:2]
    refs = tokens // 4
    mask = LTX2InContextPipeline._build_video_self_attention_mask(
        num_noisy_tokens=tokens - refs, num_prefix_tokens=tokens - refs,
        extras_cross_masks=[torch.full((1, refs), strength)], device=torch.device("cpu"),
    )  # fmt: skip
    return mask.expand(batch, -1, -1)


def test_ltx2_ic_lora_video_self_attention_mask_is_named_by_the_plan_of_its_pipeline() -> None:
    """LTX-2's ``video_self_attention_mask`` reaches ``attn1`` as an additive bias
    (IC-LoRA's reference strengths); only LTX2InContextPipeline's code passes it.
    Its plan names the kind at attn1 and a strict sage fails up front with it
    named; LTX2Pipeline's plan (its code passes no such mask) keeps attn1 on sage;
    a bare model, whose caller is not known, leaves it to the first call."""
    import tiny_pipelines as tp

    model, _ = tp.ltx2()
    ic = _ltx2_in_context(model)
    assert "video_self_attention_mask" in idf.passed_arguments(ic, "transformer")
    plan = idf.plan(ic, SAGE, SIM)
    dit = plan.by_component()["transformer"]
    kinds = {s.name.rsplit(".", 1)[1]: s.spec.requirements.mask_kind for s in dit}
    assert kinds == {
        "attn1": "additive mask", "attn2": "key padding", "audio_attn1": "none",
        "audio_attn2": "key padding", "audio_to_video_attn": "none",
        "video_to_audio_attn": "none",
    }  # fmt: skip
    for site in dit:
        if site.name.endswith(".attn1"):
            assert site.backend is None and "does not implement additive masks" in str(site.error)
        else:
            assert site.backend.name == "sage_attn"
    plain = idf.plan(tp.ltx2_pipeline(), SAGE, SIM).by_component()["transformer"]
    assert {s.spec.requirements.mask_kind for s in plain if s.name.endswith(".attn1")} == {"none"}
    alone = idf.plan({"transformer": model}, SAGE, SIM)
    assert alone.ok and {s.spec.requirements.mask_kind for s in alone.sites} == {
        "none", "key padding"
    }  # fmt: skip


def test_ltx2_ic_lora_mask_meets_the_planned_kind_at_every_call() -> None:
    """Under an explicit eager (every site routed), the IC-LoRA mask each attn1
    call brings is the additive mask the plan named: no site re-resolved at its
    first call, and the output is the untouched model's."""
    import tiny_pipelines as tp
    import tiny_sweep

    model, inputs = tp.ltx2()
    inputs = {**inputs, "video_self_attention_mask": _ic_lora_mask(inputs)}
    ic = _ltx2_in_context(model)
    with torch.no_grad():
        before = model(**inputs)[0]
        with tiny_sweep._Spy() as spy:
            plan = idf.apply(ic, tiny_sweep.EAGER)
            try:
                after = model(**inputs)[0]
                routes = idf.routes(ic)
            finally:
                idf.remove(ic)
    attn1 = [s for s in plan.sites if s.component == "transformer" and s.name.endswith(".attn1")]
    assert attn1 and {s.spec.requirements.mask_kind for s in attn1} == {"additive mask"}
    for site in attn1:
        assert {c.mask.kind.value for c in spy.calls[site.name]} == {"additive"}
    assert all(not r.first_calls for r in routes.values())
    assert _rel_error(after, before) < 1e-2, _rel_error(after, before)


def test_ltx2_ic_lora_mask_on_a_bare_model_is_caught_at_the_first_call(
    varlen_fakes: Calls,
) -> None:
    """The net: a bare LTX-2 DiT (no pipeline, its caller not known) planned sage
    at attn1; its first call with an IC-LoRA mask raises the typed error naming
    the additive mask, before any kernel runs at attn1."""
    import tiny_pipelines as tp

    from attnres import ResolutionError

    model, inputs = tp.ltx2()
    inputs = {**inputs, "video_self_attention_mask": _ic_lora_mask(inputs)}
    comps = {"transformer": model}
    idf.apply(comps, SAGE, STAND_IN)
    try:
        with torch.no_grad(), pytest.raises(ResolutionError) as info:
            model(**inputs)
    finally:
        idf.remove(comps)
    assert "observed at first call: additive mask" in str(info.value)
    assert "attn1" in str(info.value)


def test_plan_dir_reads_the_pipeline_class_its_model_index_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``plan DIR`` plans a pipeline folder as that pipeline's plan: the class
    ``model_index.json`` names is the caller whose code is read for the masks it
    passes; a name diffusers exports as no pipeline is no caller."""
    from diffusers import LTX2InContextPipeline, LTXPipeline

    from attnres.integrations._folder import plan_folder

    assert idf.pipeline_class("LTX2InContextPipeline") is LTX2InContextPipeline
    for name in ("AutoencoderKL", "os.system", "__import__", "", None):
        assert idf.pipeline_class(name) is None
    seen: list[Any] = []
    real = idf.plan

    def spy(*args: Any, **kwargs: Any) -> Any:
        seen.append(kwargs.get("caller"))
        return real(*args, **kwargs)

    monkeypatch.setattr(idf, "plan", spy)
    from pathlib import Path

    plan_folder(Path(__file__).resolve().parent.parent / "examples" / "ltx-video")
    assert seen and seen[-1] is LTXPipeline
    assert "encoder_attention_mask" in idf.passed_arguments(LTXPipeline, "transformer")


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_mask_refused_at_an_applied_site(varlen_fakes: Calls, dtype: torch.dtype) -> None:
    """Issue 32 item 1: an integration site refuses an integer mask typed, at its
    first call and at any later one (the call signature holds no mask dtype)."""
    from attnres.errors import MaskKindError

    route = _route_for("key_padding")
    q = torch.randn(2, 2, 6, 16).bfloat16()
    valid = torch.arange(6) < torch.tensor([[6], [2]])
    ints = torch.where(valid, 0, -10000) if dtype.is_signed else valid.long()
    with pytest.raises(MaskKindError, match="integer tensor"):
        route(q, q, q, attn_mask=ints[:, None, None, :].to(dtype))  # first call
    assert not varlen_fakes.seen
    route(q, q, q, attn_mask=valid[:, None, None, :])  # a boolean mask runs
    with pytest.raises(MaskKindError, match="integer tensor"):
        route(q, q, q, attn_mask=ints[:, None, None, :].to(dtype))  # a later call


# -- issue 32 item 4: a (batch, key length) mask at diffusers' dispatcher ------------------
#
# diffusers' ``dispatch_attention_fn`` reads a 2-D mask of shape (batch, key length)
# as key padding (its native backend unsqueezes it to (batch, 1, 1, key length));
# diffusers 0.38's QwenImage ControlNet passes its joint prompt mask so, and any
# processor that hands ``attention_mask`` to the dispatcher as given (Flux's) does
# when a caller passes one. The applied site read it as torch SDPA's (query length,
# key length) and raised MaskShapeError at the first call of a plan that said ok.


def _qwen_controlnet() -> Any:
    import tiny_models
    import torch

    model = tiny_models.build_model("QwenImageControlNetModel").to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    for block in model.controlnet_blocks:  # zero-initialised: the output would be 0
        torch.nn.init.normal_(block.weight, generator=gen)
    return model


def _qwen_controlnet_inputs(model: Any, lengths: tuple[int, ...]) -> dict[str, Any]:
    import torch

    cfg = model.config
    gen = torch.Generator().manual_seed(1)
    batch, text = len(lengths), max(lengths)
    mask = torch.zeros(batch, text, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1  # prompts of different lengths
    return {
        "hidden_states": torch.randn(batch, 16, cfg.in_channels, generator=gen).bfloat16(),
        "controlnet_cond": torch.randn(batch, 16, cfg.in_channels, generator=gen).bfloat16(),
        "encoder_hidden_states": torch.randn(
            batch, text, cfg.joint_attention_dim, generator=gen
        ).bfloat16(),
        "encoder_hidden_states_mask": mask,
        "timestep": torch.ones(batch),
        "img_shapes": [(1, 4, 4)] * batch,
        "return_dict": False,
    }


def _relative(after: Any, before: Any) -> float:
    import torch

    assert isinstance(after, torch.Tensor) and isinstance(before, torch.Tensor)
    return float((after.double() - before.double()).norm() / before.double().norm())


@pytest.mark.parametrize("backend", ["sage_attn", "flash_attn"])
@pytest.mark.parametrize("lengths", [(8, 3), (5, 5, 2)], ids=["two-prompts", "three-prompts"])
def test_qwen_image_controlnet_plan_and_forward_agree_on_its_prompt_mask(
    varlen_fakes: Calls, backend: str, lengths: tuple[int, ...]
) -> None:
    """The installed diffusers' QwenImage ControlNet with padded prompts: the plan
    names key padding at every site, and the applied model gives the untouched
    model's output (the varlen stand-ins run it)."""
    import torch

    from attnres.integrations import diffusers as idf
    from attnres.layer import SelectionConfig

    config = SelectionConfig(global_backend=backend, global_backend_explicit=True)
    model = _qwen_controlnet()
    with torch.no_grad():
        before = model(**_qwen_controlnet_inputs(model, lengths))[0]
        plan = idf.plan({"controlnet": model}, config, SIM)
        assert plan.ok, plan.errors
        assert {s.spec.requirements.mask_kind for s in plan.sites} == {"key padding"}
        idf.apply({"controlnet": model}, config, STAND_IN)
        try:
            after = model(**_qwen_controlnet_inputs(model, lengths))[0]
        finally:
            idf.remove({"controlnet": model})
    assert varlen_fakes.seen
    for got, want in zip(after, before, strict=True):
        assert _relative(got, want) < 2e-2


@pytest.mark.parametrize("backend", ["sage_attn", "flash_attn"])
@pytest.mark.parametrize("batch", [2, 3])
def test_dispatcher_reads_a_batch_by_keys_mask_as_key_padding(
    varlen_fakes: Calls, backend: str, batch: int
) -> None:
    """Diffusers 0.38's QwenImage ControlNet: the joint mask [prompt mask, ones over
    the image] reaches ``dispatch_attention_fn`` as (batch, text + image). The
    applied site's dispatcher gives what diffusers' own dispatcher gives for it."""
    import torch
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    from attnres.integrations import diffusers as idf
    from attnres.layer import SelectionConfig

    config = SelectionConfig(global_backend=backend, global_backend_explicit=True)
    model = _qwen_controlnet()
    idf.apply({"controlnet": model}, config, STAND_IN)
    try:
        processor = model.transformer_blocks[0].attn.processor
        call = type(processor).__call__
        # the site's own stand-in, read under a name of its route's own
        (key,) = (n for n in call.__code__.co_names if n.endswith("_dispatch_attention_fn"))
        routed = call.__globals__[key]
        assert key.startswith("_attnres_route_") and routed is not dispatch_attention_fn
        assert call.__globals__["dispatch_attention_fn"] is dispatch_attention_fn  # untouched
        gen = torch.Generator().manual_seed(4)
        text, image, heads, dim = 6, 16, 3, 16
        q, k, v = (
            torch.randn(batch, text + image, heads, dim, generator=gen).bfloat16() for _ in range(3)
        )
        prompt = torch.arange(text) < torch.tensor([[text], [2], [4]][:batch])
        joint = torch.cat([prompt, torch.ones(batch, image, dtype=torch.bool)], dim=1)
        want = dispatch_attention_fn(q, k, v, attn_mask=joint)
        got = routed(q, k, v, attn_mask=joint)
    finally:
        idf.remove({"controlnet": model})
    assert varlen_fakes.seen
    assert got.shape == want.shape
    assert _relative(got, want) < 2e-2


@pytest.mark.parametrize("backend", ["sage_attn", "flash_attn"])
def test_flux_with_a_batch_by_keys_attention_mask_matches_the_untouched_model(
    varlen_fakes: Calls, backend: str
) -> None:
    """A variant: Flux's processor hands ``attention_mask`` (passed through
    ``joint_attention_kwargs``) to the dispatcher as given."""
    import tiny_models
    import torch

    from attnres.integrations import diffusers as idf
    from attnres.layer import SelectionConfig

    model, make = tiny_models.build("FluxTransformer2DModel")
    model = model.to(torch.bfloat16)
    inputs = make()
    for key in ("hidden_states", "encoder_hidden_states", "pooled_projections"):
        inputs[key] = torch.cat([inputs[key], inputs[key]]).bfloat16()
    tokens = inputs["hidden_states"].shape[1] + inputs["encoder_hidden_states"].shape[1]
    mask = torch.ones(2, tokens, dtype=torch.bool)
    mask[1, 1:5] = False  # the second prompt padded inside
    inputs["joint_attention_kwargs"] = {"attention_mask": mask}
    config = SelectionConfig(global_backend=backend, global_backend_explicit=True)
    with torch.no_grad():
        before = model(**inputs)[0]
        idf.apply({"transformer": model}, config, STAND_IN)
        try:
            after = model(**inputs)[0]
        finally:
            idf.remove({"transformer": model})
    assert varlen_fakes.seen
    assert _relative(after, before) < 2e-2


def test_dispatcher_mask_keeps_the_sdpa_reading_of_other_2d_masks() -> None:
    """Only (batch, key length) is read as key padding; a (query length, key length)
    mask keeps torch SDPA's reading, and any other mask is passed as it is."""
    import torch

    from attnres.integrations._route import dispatcher_mask

    q = torch.zeros(2, 5, 1, 4)
    k = torch.zeros(2, 7, 1, 4)
    padding = torch.ones(2, 7, dtype=torch.bool)
    assert dispatcher_mask(padding, q, k).shape == (2, 1, 1, 7)
    square = torch.ones(5, 7, dtype=torch.bool)  # (query length, key length)
    assert dispatcher_mask(square, q, k) is square
    four = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    assert dispatcher_mask(four, q, k) is four
    assert dispatcher_mask(None, q, k) is None
