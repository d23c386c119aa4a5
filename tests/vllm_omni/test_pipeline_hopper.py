"""A tiny pipeline built through vLLM-Omni's own ``Attention`` layer class on a
simulated Hopper (issue 36), run by ``make test-vllm-omni`` in vLLM-Omni's
environment (never by ``make test``).

The platform is vLLM-Omni's real ``CudaOmniPlatform`` (its
``get_diffusion_attn_backend_cls``, its package probes), told it runs on an
H100 (compute capability 9.0) by overriding the two device queries a CPU
machine cannot answer. One compiled module is stubbed, and only it:
``vllm._C_stable_libtorch``, which ``vllm/platforms/cuda.py`` imports for its
side effect of loading CUDA kernels and which needs ``libcuda.so.1``; nothing
the selection or the layers run reads from it. The layers are vLLM-Omni's
``vllm_omni/diffusion/attention/layer.py`` ``Attention``, unchanged, built
inside vLLM-Omni's ``set_current_diffusion_config`` with an ``AttentionConfig``.

The same pipeline is built twice, as vLLM-Omni ships and with the attnres
plugin installed: every layer gets the same backend class and spec, the
forward outputs are identical, and every layer's selection is an attnres
decision whose trace holds vLLM-Omni's platform answers and replays.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import attnres
from attnres._states import Origin, Status
from attnres.integrations import vllm_omni as plugin


@pytest.fixture
def hopper(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """vLLM-Omni's CudaOmniPlatform on a simulated H100, as current_omni_platform."""
    if "vllm.platforms.cuda" not in sys.modules:  # the one compiled module stubbed
        monkeypatch.setitem(
            sys.modules, "vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch")
        )
    import vllm_omni.platforms as platforms
    from vllm.platforms.interface import DeviceCapability
    from vllm_omni.diffusion.attention import selector
    from vllm_omni.platforms.cuda.platform import CudaOmniPlatform

    class SimulatedHopper(CudaOmniPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3"

    simulated, before = SimulatedHopper(), platforms.current_omni_platform
    monkeypatch.setattr(platforms, "current_omni_platform", simulated, raising=False)
    # every vLLM-Omni module that bound the platform by name sees the simulated one
    for name, module in list(sys.modules.items()):
        if name.startswith("vllm_omni") and vars(module).get("current_omni_platform") is before:
            monkeypatch.setattr(module, "current_omni_platform", simulated)
    selector._cached_get_backend_cls.cache_clear()
    yield SimulatedHopper
    selector._cached_get_backend_cls.cache_clear()
    plugin.uninstall()


#: (role, role_category, head size) of each layer of the tiny pipeline
LAYERS = (
    ("self", None, 64),  # the platform's default
    ("cross", None, 64),  # per_role["cross"]
    ("ltx2.audio_to_video", "cross", 64),  # per_role["cross"], the category fallback
    ("joint", None, 32),  # per_role["joint"]
)


class TinyPipeline(nn.Module):
    """Four attention blocks through vLLM-Omni's Attention, one projection each."""

    def __init__(self) -> None:
        super().__init__()
        from vllm_omni.diffusion.attention.layer import Attention

        torch.manual_seed(0)
        self.heads = 2
        self.proj = nn.ModuleList(nn.Linear(16, 3 * self.heads * h) for _, _, h in LAYERS)
        self.attn = nn.ModuleList(
            Attention(
                num_heads=self.heads,
                head_size=h,
                causal=False,
                softmax_scale=h**-0.5,
                role=role,
                role_category=category,
                prefix=f"blocks.{i}.attn",
            )
            for i, (role, category, h) in enumerate(LAYERS)
        )

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for proj, attn, (_, _, h) in zip(self.proj, self.attn, LAYERS, strict=True):
            q, k, v = proj(x).view(*x.shape[:2], 3, self.heads, h).unbind(2)
            out.append(attn(q, k, v))
        return out


def _build() -> TinyPipeline:
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.data import AttentionConfig

    config = types.SimpleNamespace(
        diffusion_attention_config=AttentionConfig(
            per_role={"cross": "TORCH_SDPA", "joint": {"backend": "TORCH_SDPA"}},
        ),
        model_class_name=None,
        parallel_config=types.SimpleNamespace(ring_degree=1, allgather_degree=1),
    )
    with set_current_diffusion_config(config):  # type: ignore[arg-type]
        return TinyPipeline()


def test_rule_tiny_pipeline_on_simulated_hopper_gets_attnres_decisions(hopper: Any) -> None:
    from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend

    x = torch.randn(1, 8, 16)
    stock = _build()
    plugin.install()
    attnres.clear_decisions()
    routed = _build()
    decisions = attnres.decisions()
    plugin.uninstall()

    # vLLM-Omni's own classes and specs, layer by layer; identical outputs
    for mine, theirs in zip(routed.attn, stock.attn, strict=True):
        assert mine.attn_backend is theirs.attn_backend is SDPABackend
        assert type(mine.attention) is type(theirs.attention)
        assert (mine.attn_spec is None) == (theirs.attn_spec is None)
    with torch.no_grad():
        for mine, theirs in zip(routed(x), stock(x), strict=True):
            assert torch.equal(mine, theirs)

    # every layer's selection is an attnres decision, with vLLM-Omni's precedence
    assert [d.layer for d in decisions] == [role for role, _, _ in LAYERS]
    assert [d.origin for d in decisions] == [
        Origin.NONE,
        Origin.LAYER,
        Origin.COMPONENT_OVERRIDE,
        Origin.LAYER,
    ]
    for decision in decisions:
        assert decision.outcome.status is Status.SELECTED
        assert decision.backend == "torch_sdpa"
        platform = decision.trace.input.platform
        assert platform.kind == "cuda" and platform.capability == (9, 0)
        assert platform.device_name == "NVIDIA H100 80GB HBM3"
        # the trace holds vLLM-Omni's platform answer it was decided from
        assert [h.served for h in platform.host] == ["torch_sdpa"]
        assert attnres.replay(decision.trace).ok
    # the platform default on this Hopper (no flash-attn package here): vLLM-Omni's own pick
    assert decisions[0].trace.input.platform.host[0].candidate == ""
    # two of these decisions are golden traces, replayed without vLLM-Omni by make test
    traces = Path(__file__).resolve().parents[2] / "traces"
    for decision, name in (
        (decisions[0], "vllm-omni-profile-platform-default-on-a-simulated-hopper"),
        (decisions[1], "vllm-omni-profile-exact-role-entry-on-a-simulated-hopper"),
    ):
        golden = json.loads((traces / f"{name}.json").read_text(encoding="utf-8"))
        assert decision.digest == golden["digest"], name


def test_rule_explicit_backend_hopper_refuses_is_refused_unchanged(hopper: Any) -> None:
    # FLASH_ATTN configured on a Hopper without the flash-attn package: vLLM-Omni's
    # platform refuses; the plugin answers with that error, and records it
    from vllm_omni.diffusion.attention.layer import Attention
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.data import AttentionConfig, AttentionSpec

    config = types.SimpleNamespace(
        diffusion_attention_config=AttentionConfig(default=AttentionSpec(backend="FLASH_ATTN")),
        model_class_name=None,
        parallel_config=types.SimpleNamespace(ring_degree=1, allgather_degree=1),
    )

    def build() -> str:
        with set_current_diffusion_config(config), pytest.raises(ValueError) as error:  # type: ignore[arg-type]
            Attention(num_heads=2, head_size=64, causal=False, softmax_scale=0.125)
        return str(error.value)

    stock = build()
    plugin.install()
    attnres.clear_decisions()
    assert build() == stock
    (decision,) = attnres.decisions()
    assert decision.outcome.status is Status.REJECTED and decision.origin is Origin.GLOBAL_CLI
    assert stock in str(decision.outcome.error)
    assert attnres.replay(decision.trace).ok


def test_rule_custom_attnres_backend_is_selectable_in_vllm_omni(hopper: Any) -> None:
    # a backend registered through attnres's registry, with its kernel: vLLM-Omni's
    # enum cannot take it (its platform refuses the name); with the plugin the
    # layer runs it, through vLLM-Omni's own Attention layer
    from vllm_omni.diffusion.attention.layer import Attention
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.data import AttentionConfig

    from attnres._vocab import DTYPES
    from attnres.backends import BackendSpec, HeadSizeRule, register_backend, unregister_backend
    from attnres.kernels import register_kernel, unregister_kernel

    calls: list[tuple[int, ...]] = []

    def my_kernel(q: Any, k: Any, v: Any, attn_mask: Any, causal: bool, scale: Any) -> Any:
        calls.append(tuple(q.shape))
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, is_causal=causal, scale=scale,
        )  # fmt: skip
        return out.transpose(1, 2)

    register_backend(
        BackendSpec(
            name="my_attn",
            sparse=False,
            platforms=("cuda",),
            dtypes=DTYPES,
            head_sizes=HeadSizeRule(allowed=(64, 128)),
            description="a test's kernel",
        )
    )
    register_kernel("my_attn", my_kernel)
    config = types.SimpleNamespace(
        diffusion_attention_config=AttentionConfig(
            per_role={"self": "MY_ATTN", "cross": "TORCH_SDPA"}
        ),
        model_class_name=None,
        parallel_config=types.SimpleNamespace(ring_degree=1, allgather_degree=1),
    )

    def build(role: str, head_size: int = 64) -> Any:
        with set_current_diffusion_config(config):  # type: ignore[arg-type]
            return Attention(
                num_heads=2, head_size=head_size, causal=False, softmax_scale=0.125, role=role
            )

    try:
        with pytest.raises(ValueError, match="Unknown diffusion attention backend: 'MY_ATTN'"):
            build("self")  # vLLM-Omni alone
        plugin.install()
        attnres.clear_decisions()
        mine, sdpa = build("self"), build("cross")
        assert plugin.custom_backend("MY_ATTN") == "my_attn"
        assert mine.attn_backend is plugin.vllm_omni_backend(attnres.Backend("my_attn"))
        assert mine.attn_backend.get_name() == "MY_ATTN"
        decision = attnres.decisions()[0]
        assert decision.backend == "my_attn" and decision.origin is Origin.LAYER
        assert attnres.replay(decision.trace).ok
        q, k, v = (torch.randn(1, 8, 2, 64) for _ in range(3))
        with torch.no_grad():
            torch.testing.assert_close(mine(q, k, v), sdpa(q, k, v))
        assert calls == [(1, 8, 2, 64)]  # attnres's kernel ran, once
        # a head size the spec does not take: refused typed at selection
        with pytest.raises(ValueError, match="my_attn cannot take head size 80"):
            build("self", 80)
    finally:
        plugin.uninstall()
        unregister_kernel("my_attn")
        unregister_backend("my_attn")
