"""Selected means runnable: a layer that will run is never handed a kernel-less backend.

Issue 12, section 1. ``resolve(..., needs_kernel=True)`` (what ``attnres.Attention``
does) checks that a kernel serves the backend in this process like any other
capability (failure code ``no_kernel``); plans (``needs_kernel=False``) still plan
kernel-less backends and mark the layers that would need one.
"""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch

import attnres
from attnres import LayerSpec, Platform, SelectionConfig, component_scope, resolve
from attnres.backends import BUILTIN_SPECS
from attnres.kernels import KernelSource, kernel_source, register_kernel, unregister_kernel
from attnres.modules import Attention, KernelNotRegisteredError
from attnres.plan import parse_pipeline, plan_pipeline

PLATFORMS = ("npu+torch_npu", "cuda:sm90+all", "rocm:gfx942+all", "cuda:sm120+all", "cpu")
BACKENDS = [s.name for s in BUILTIN_SPECS]


def _layers() -> list[LayerSpec]:
    out = []
    for head, dtype, role, supported in itertools.product(
        (64, 128, 256), ("bfloat16", "float16", "float32"), ("self", "cross"),
        (None, ("fa", "torch_sdpa"), ("sliding_tile_attn", "torch_sdpa")),
    ):  # fmt: skip
        out.append(LayerSpec(head_size=head, dtype=dtype, role=role, supported=supported))
    return out


@pytest.mark.parametrize("platform", PLATFORMS)
def test_rule_no_kernel_a_running_layer_always_gets_a_kernel(platform: str) -> None:
    """Every request origin, every layer shape: what is selected has a kernel here."""
    plat = Platform.simulate(platform)
    configs = [
        SelectionConfig(),
        *(SelectionConfig(global_backend=b, global_backend_explicit=True) for b in BACKENDS),
        *(SelectionConfig(global_backend=b, global_backend_explicit=False) for b in BACKENDS),
    ]
    selected = 0
    for layer, config in itertools.product(_layers(), configs):
        with component_scope("text_encoder"):
            try:
                res = resolve(layer, config=config, platform=plat, needs_kernel=True)
            except attnres.ResolutionError:
                continue
        selected += 1
        assert kernel_source(res.backend.name) is not KernelSource.NONE, (layer, config)
    assert selected > 0


@pytest.mark.parametrize("platform", ["npu+torch_npu", "cuda:sm90+all", "rocm:gfx942+all"])
def test_attention_with_no_request_never_raises_kernel_not_registered(platform: str) -> None:
    """The issue's done-when: building a layer with no request on these platforms."""
    plat = Platform.simulate(platform)
    for head, dtype, role in itertools.product(
        (64, 128), ("bf16", "fp16", "fp32"), ("self", "cross")
    ):
        try:
            layer = Attention(8, head, dtype=dtype, role=role, platform=plat)
        except KernelNotRegisteredError:  # pragma: no cover - the failure this test is for
            pytest.fail(f"KernelNotRegisteredError on {platform} for {head} {dtype} {role}")
        except ImportError:
            continue  # the kernel package is simulated, not installed: that is a real adapter
        assert kernel_source(layer.backend.name) is not KernelSource.NONE


def test_attention_on_an_npu_runs_ascend_fa_through_its_adapter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[str] = []

    def npu_fusion_attention(query, key, value, head_num, input_layout, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(input_layout)
        return (query, None)

    fake = types.ModuleType("torch_npu")
    fake.npu_fusion_attention = npu_fusion_attention  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    attnres.kernels.clear_kernel_cache()
    try:
        layer = Attention(8, 128, dtype=torch.bfloat16, platform=Platform.simulate("npu+torch_npu"))
        assert layer.backend.name == "ascend_fa"
        q = torch.zeros(1, 4, 8, 128, dtype=torch.bfloat16)
        assert layer(q, q, q) is q
        assert seen == ["BSND"]
    finally:
        attnres.kernels.clear_kernel_cache()


def test_rule_no_kernel_platform_chain_skips_a_preference_without_kernel() -> None:
    """A chain entry with no kernel is not 'usable here' for a running layer."""
    plat = Platform.simulate("cuda:sm90+all")
    layer = LayerSpec(head_size=128, dtype="bf16")
    unregister_kernel("fa3")
    unregister_kernel("fa")
    try:
        res = resolve(layer, platform=plat, needs_kernel=True)
        assert res.backend.name == "torch_sdpa" and res.reason is None
        skips = [r for r in res.trace.records if r.kind == "skip"]
        assert [(str(r.candidate), "no kernel in this process" in r.detail) for r in skips] == [
            ("fa3", True),
            ("fa", True),
        ]
        # a plan of the same layer still prefers fa3: an operator may supply its kernel
        assert resolve(layer, platform=plat).backend.name == "fa3"
        register_kernel("fa", "attnres.kernels.fa:make_kernel")
        assert resolve(layer, platform=plat, needs_kernel=True).backend.name == "fa"
    finally:
        register_kernel("fa3", "attnres.kernels.fa3:make_kernel", replace=True)
        register_kernel("fa", "attnres.kernels.fa:make_kernel", replace=True)
    assert resolve(layer, platform=plat, needs_kernel=True).backend.name == "fa3"


def test_rule_no_kernel_what_if_plan_marks_layers_needing_a_kernel() -> None:
    pipeline = parse_pipeline(
        {
            "pipeline": {"name": "sparse-what-if"},
            "components": [
                {
                    "name": "transformer",
                    "layers": [
                        {"name": "self_attn", "head_size": 128, "dtype": "bf16", "count": 4},
                        {"name": "cross_attn", "head_size": 128, "dtype": "bf16",
                         "role": "cross"},
                    ],
                }
            ],
        }
    )  # fmt: skip
    config = SelectionConfig(global_backend="video_sparse_attn", global_backend_explicit=True)
    result = plan_pipeline(pipeline, config, Platform.simulate("cuda:sm90+all"))
    assert result.ok
    by_name = {la.name: la for la in result.layers}
    assert by_name["self_attn"].backend == "video_sparse_attn"
    assert by_name["self_attn"].needs_kernel
    assert by_name["self_attn"].to_dict()["kernel"] == "none"
    assert by_name["cross_attn"].backend == "fa3" and not by_name["cross_attn"].needs_kernel
    assert by_name["cross_attn"].to_dict()["kernel"] == "builtin"
