"""attnres's own tests against vLLM-Omni 0.30.0 (issue 36), run by ``make
test-vllm-omni`` in vLLM-Omni's environment (never by ``make test``:
tests/conftest.py ignores this folder).

- vLLM-Omni's 11 backends are all known to attnres after install, the ones it
  lacked registered with the head sizes their vLLM-Omni classes state.
- On vLLM-Omni's own platform of this machine, the plugin answers every call
  as vLLM-Omni does, and each answer is an attnres decision that replays.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

import attnres
from attnres.backends import Backend, get_spec
from attnres.integrations import vllm_omni as plugin


@pytest.fixture
def routed() -> Iterator[None]:
    plugin.install()
    try:
        yield
    finally:
        plugin.uninstall()


def test_rule_every_vllm_omni_backend_is_known_to_attnres_after_install(routed: None) -> None:
    from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

    assert len(DiffusionAttentionBackendEnum) == 11
    for member in DiffusionAttentionBackendEnum:
        Backend.parse(member.name.lower())  # a spec or an alias; raises otherwise
    cudnn = DiffusionAttentionBackendEnum.CUDNN_ATTN.get_class()
    sizes = set(cudnn.get_supported_head_sizes())
    assert get_spec("cudnn_attn").head_sizes.allowed == (sizes or None)


def test_rule_plugin_answers_as_vllm_omni_on_this_platform() -> None:
    from vllm_omni.diffusion.attention import selector
    from vllm_omni.diffusion.data import AttentionConfig, AttentionSpec

    configs = [
        None,
        AttentionConfig(),
        AttentionConfig(default=AttentionSpec(backend="TORCH_SDPA")),
        AttentionConfig(per_role={"cross": AttentionSpec(backend="TORCH_SDPA")}),
        AttentionConfig(default=AttentionSpec(backend="FLASH_ATTN")),
    ]
    probes = list(itertools.product(configs, [("self", None), ("ltx2.a2v", "cross")], [64, 128]))

    def answers() -> list[object]:
        out: list[object] = []
        for config, (role, category), head in probes:
            try:
                out.append(selector.get_attn_backend_for_role(role, head, config, category))
            except Exception as exc:
                out.append(type(exc).__name__)
        return out

    stock = answers()
    before = plugin.stats()["decided"]
    plugin.install()
    try:
        attnres.clear_decisions()
        mine = answers()
        decisions = attnres.decisions()
    finally:
        plugin.uninstall()
    assert mine == stock
    assert len(decisions) == plugin.stats()["decided"] - before > 0
    assert all(attnres.replay(d.trace) for d in decisions)


def test_rule_typed_attention_spec_options_are_attnres_backend_options(routed: None) -> None:
    # vLLM-Omni's own AttentionSpec, validated at construction by vLLM-Omni, is
    # converted into attnres backend options of its backend, checked again by
    # attnres and recorded in the decision (this CPU platform refuses both
    # backends: the refusal is the decision, the options are in its input)
    from vllm_omni.diffusion.attention import selector
    from vllm_omni.diffusion.data import AttentionConfig, AttentionSpec

    from attnres.backends import get_spec

    rainfusion = AttentionSpec(
        backend="RAINFUSION_ATTN", block_sparse={"sparsity": 0.5, "skip_layers": "0-3,38"}
    )
    trtllm = AttentionSpec(backend="TRTLLM_ATTN", skip_softmax={"threshold": 0.25})
    attnres.clear_decisions()
    for spec in (rainfusion, trtllm):
        with pytest.raises(Exception):  # noqa: B017 (vLLM-Omni's own refusal, unchanged)
            selector.get_attn_backend_for_role("self", 128, AttentionConfig(default=spec))
    first, second = attnres.decisions()
    assert dict(first.trace.input.layer.backend_options)["rainfusion_attn"] == (
        ("block_sparse.end_step", 0),
        ("block_sparse.precision", "bf16"),
        ("block_sparse.skip_layers", "0-3,38"),
        ("block_sparse.sparsity", 0.5),
        ("block_sparse.start_step", 0),
    )
    assert dict(second.trace.input.layer.backend_options)["trtllm_attn"] == (
        ("skip_softmax.disabled_until_timestep", 0.0),
        ("skip_softmax.threshold", 0.25),
    )
    assert all(attnres.replay(d.trace).ok for d in (first, second))
    # the ranges are vLLM-Omni's own: attnres refuses what its __post_init__ refuses
    sparsity = next(o for o in get_spec("rainfusion_attn").options if o.name.endswith("sparsity"))
    assert not sparsity.takes(1.5) and sparsity.takes(1) and sparsity.takes(0.8)
