"""Selection contract v2, section 5: a forward that needs gradients needs a backward pass.

The ``backward`` requirement itself (``Requirements(backward=True)``, the
catalogue's facts per kernel, the check) is tested in ``test_requirements.py``;
this file tests the layer: a forward that needs gradients on a layer whose
kernel has no backward pass resolves again with the requirement added.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor

import attnres
from attnres import Attention, Platform, ResolutionError, SelectionConfig, component_scope
from attnres import kernels as kernels_mod
from attnres.kernels import register_kernel

HOPPER = Platform.simulate("cuda:sm90+flash_attn+sageattention")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """SDPA-backed stand-ins for the fa and sage_attn kernels; each call is recorded."""
    monkeypatch.setattr(kernels_mod, "_entries", dict(kernels_mod._entries))
    monkeypatch.setattr(kernels_mod, "_built", dict(kernels_mod._built))
    seen: list[str] = []

    def make(name: str) -> Any:
        def kernel(
            q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None
        ) -> Tensor:
            seen.append(name)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=causal,
                scale=scale,
            )
            return out.transpose(1, 2)

        return kernel

    for name in ("fa", "sage_attn"):
        register_kernel(name, make(name), replace=True)
    yield seen


def _qkv(grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    q = torch.randn(1, 6, 4, 64, dtype=torch.bfloat16, requires_grad=grad)
    return q, q.detach(), q.detach()


def _sage_layer(component: str) -> Attention:
    attnres.set_selection_config(SelectionConfig(global_backend="sage_attn"))
    with component_scope(component):
        layer = Attention(4, 64, dtype="bf16", platform=HOPPER, name="attn1")
    attnres.set_selection_config(SelectionConfig())
    assert layer.backend is not None and layer.backend.name == "sage_attn"
    return layer


def test_rule_backward_a_relaxed_decision_falls_back_for_a_training_forward(
    calls: list[str],
) -> None:
    layer = _sage_layer("vae")  # the global flag is relaxed for a VAE
    q, k, v = _qkv(grad=True)
    layer(q, k, v).float().sum().backward()
    assert calls == ["fa"] and q.grad is not None
    training = layer.backward_resolution
    assert training is not None
    assert (training.backend.name, training.reason) == ("fa", "global backend fallback")
    assert training.trace.input.layer.requirements.backward  # traced with the requirement
    assert layer.resolution is not None and layer.resolution.backend.name == "sage_attn"
    assert [d.backend for d in attnres.decisions()] == ["sage_attn"]  # inference kept
    layer(*_qkv(grad=False))
    assert calls == ["fa", "sage_attn"]


def test_rule_backward_a_strict_decision_raises_before_computing(calls: list[str]) -> None:
    layer = _sage_layer("transformer")  # strict: the flag is aimed at the main model
    with pytest.raises(ResolutionError) as info:
        layer(*_qkv(grad=True))
    assert calls == []  # nothing was computed
    message = str(info.value)
    assert "does not implement the backward pass" in message
    assert "this forward needs gradients; nothing was computed" in message
    assert info.value.trace.input.layer.requirements.backward


def test_rule_backward_inference_and_train_mode_alone_never_add_it(calls: list[str]) -> None:
    layer = _sage_layer("transformer")
    layer.train()
    layer(*_qkv(grad=False))  # inputs that require no grad
    with torch.no_grad():
        layer(*_qkv(grad=True))  # grad mode off
    with torch.inference_mode():
        layer(*_qkv(grad=False))
    assert calls == ["sage_attn"] * 3
    assert layer.backward_resolution is None


def test_rule_backward_kernels_with_a_backward_pass_are_not_guarded() -> None:
    layer = Attention(4, 16, dtype="float32", platform=Platform.simulate("cpu"))
    q = torch.randn(1, 3, 4, 16, requires_grad=True)
    layer(q, q.detach(), q.detach()).sum().backward()  # torch_sdpa has a backward pass
    assert layer.backward_resolution is None  # so nothing was resolved again
    assert q.grad is not None
    flex = Attention(
        4, 16, dtype="float32", backend="flex_attention", platform=Platform.simulate("cpu")
    )  # no backward on cpu: guarded
    with pytest.raises(ResolutionError, match="backward pass"):
        flex(q, q.detach(), q.detach())  # origin layer: strict


def test_rule_backward_a_layer_that_requires_backward_is_resolved_for_it(calls: list[str]) -> None:
    attnres.set_selection_config(SelectionConfig(global_backend="sage_attn"))
    with component_scope("vae"):
        layer = Attention(
            4,
            64,
            dtype="bf16",
            platform=HOPPER,
            name="attn1",
            requirements=attnres.Requirements(backward=True),
        )
    assert layer.backend is not None and layer.backend.name == "fa"
    assert layer.resolution is not None and layer.resolution.reason == "global backend fallback"
