"""Issue 22's Done-when on a tiny Qwen-Image DiT: two prompts of different
lengths (a text-padding mask in the joint attention), a global ``sage_attn`` on
a simulated ``cuda:sm90+flash_attn+sageattention``: every DiT site plans
``sage_attn`` for key padding, and, installed with the varlen stand-ins of
tests/test_masks.py, the DiT gives the untouched model's output."""

from __future__ import annotations

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
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    )  # fmt: skip
    return model.eval().to(torch.bfloat16)


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
