"""Selection contract v2, section 1: late binding of ``attnres.Attention``.

A layer built without ``dtype`` is pending until its dtype is known -- a cast of
the module, its first forward, or ``attnres.bind`` -- and then resolves with the
scope, config and forced backend captured when it was built. A cast of a bound
layer resolves again and its ledger entry is replaced.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import attnres
from attnres import (
    Attention,
    BackendNotAppliedError,
    Platform,
    ResolutionError,
    SelectionConfig,
    component_scope,
    force_backend,
)
from attnres import kernels as kernels_mod
from attnres import runtime as runtime_mod
from attnres.kernels import register_kernel
from tests.reference import reference, relative_error

HOPPER = Platform.simulate("cuda:sm90+flash_attn+sageattention")
CPU = Platform.simulate("cpu")


@pytest.fixture
def stand_ins(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """SDPA-backed stand-ins for the fa, fa3 and sage_attn kernels (no GPU packages
    here); each call records the backend's name."""
    monkeypatch.setattr(kernels_mod, "_entries", dict(kernels_mod._entries))
    monkeypatch.setattr(kernels_mod, "_built", dict(kernels_mod._built))
    calls: list[str] = []

    def make(name: str) -> Any:
        def kernel(
            q: Tensor,
            k: Tensor,
            v: Tensor,
            mask: Tensor | None,
            causal: bool,
            scale: float | None,
        ) -> Tensor:
            calls.append(name)
            out = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                attn_mask=mask,
                is_causal=causal,
                scale=scale,
            )
            return out.transpose(1, 2)

        return kernel

    for name in ("fa", "fa3", "sage_attn"):
        register_kernel(name, make(name), replace=True)
    yield calls


class Block(nn.Module):
    def __init__(self, name: str = "attn1", **kwargs: Any) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)
        self.attn = Attention(4, 16, name=name, **kwargs)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        h = self.proj(x).view(b, s, 4, 16)
        out: Tensor = self.attn(h, h, h)
        return out.reshape(b, s, 64)


def _strict_sage() -> SelectionConfig:
    return SelectionConfig(global_backend="sage_attn")


# -- the done-when of the issue ------------------------------------------------------------


def test_rule_late_binding_build_in_float32_then_cast_under_a_strict_global_flag(
    stand_ins: list[str],
) -> None:
    """0.1.0 raised at construction here (sage_attn takes no float32)."""
    attnres.set_selection_config(_strict_sage())
    with component_scope("transformer"):  # strict: the flag is aimed at the main model
        block = Block(platform=HOPPER)
    assert block.attn.pending and block.attn.backend is None and block.attn.resolution is None
    assert attnres.decisions() == ()
    block.to(torch.bfloat16)
    assert not block.attn.pending
    assert block.attn.backend is not None and block.attn.backend.name == "sage_attn"
    assert block.attn.layer_spec.dtype == "bfloat16"
    assert block.attn.resolution.origin == "global_cli"  # type: ignore[union-attr]
    (decision,) = attnres.decisions()
    assert (decision.component, decision.backend) == ("transformer", "sage_attn")
    with torch.no_grad():  # inference: sage_attn has no backward pass (section 5)
        out = block(torch.randn(2, 5, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and stand_ins == ["sage_attn"]


def test_rule_late_binding_a_cast_to_bf16_on_hopper_gets_fa(stand_ins: list[str]) -> None:
    layer = Attention(4, 64, platform=HOPPER, name="attn1")
    layer.half()
    assert layer.backend is not None and layer.backend.name == "fa"
    assert layer.layer_spec.dtype == "float16"


@pytest.mark.parametrize(
    ("cast", "dtype"),
    [
        (lambda m: m.to(torch.bfloat16), "bfloat16"),
        (lambda m: m.to(dtype=torch.float16), "float16"),
        (lambda m: m.half(), "float16"),
        (lambda m: m.bfloat16(), "bfloat16"),
        (lambda m: m.float(), "float32"),
        (lambda m: m.double(), "float64"),
    ],
)
def test_rule_late_binding_the_layer_follows_every_cast(cast: Any, dtype: str) -> None:
    block = Block(platform=CPU)
    cast(block)
    assert block.attn.layer_spec.dtype == dtype and not block.attn.pending
    assert block.proj.weight.dtype == getattr(torch, dtype)


def test_rule_late_binding_a_device_move_is_not_a_cast() -> None:
    block = Block(platform=CPU)
    block.to("cpu")
    block.to(torch.device("cpu"))
    assert block.attn.pending
    assert attnres.decisions() == ()


def test_rule_late_binding_first_forward_resolves_for_the_query_dtype() -> None:
    layer = Attention(4, 16, platform=CPU, name="attn1")
    q = torch.randn(1, 3, 4, 16, dtype=torch.float64)
    out = layer(q, q, q)
    assert layer.layer_spec.dtype == "float64" and not layer.pending
    assert relative_error(out, reference(q, q, q)) < 1e-6
    runs = runtime_mod.cache_info()["size"]
    layer(q, q, q)
    assert runtime_mod.cache_info()["size"] == runs  # no second decision
    assert len(attnres.decisions()) == 1


def test_rule_late_binding_explicit_dtype_still_resolves_at_construction() -> None:
    layer = Attention(4, 16, dtype="bf16", platform=CPU)
    assert not layer.pending and layer.layer_spec.dtype == "bfloat16"
    with pytest.raises(ResolutionError, match="sage_attn"):
        Attention(4, 16, dtype="float32", backend="sage_attn", platform=HOPPER)


def test_rule_late_binding_uses_the_scope_config_and_forced_backend_of_construction() -> None:
    with force_backend("eager"):
        forced = Attention(4, 16, platform=CPU, name="forced")
    attnres.set_selection_config(SelectionConfig(global_backend="flex_attention"))
    with component_scope("vae", backend="eager", require_selection=False):
        scoped = Attention(4, 16, platform=CPU, name="scoped")
    configured = Attention(4, 16, platform=CPU, name="configured")
    attnres.set_selection_config(SelectionConfig())
    # bound later, in another scope and under another force: neither is seen
    with (
        component_scope("transformer", backend="torch_sdpa", require_selection=False),
        force_backend("torch_sdpa"),
    ):
        attnres.bind(forced)
        attnres.bind(scoped)
        attnres.bind(configured)
    assert (forced.backend.name, forced.resolution.origin) == ("eager", "forced")  # type: ignore[union-attr]
    assert (scoped.backend.name, scoped.resolution.origin) == (  # type: ignore[union-attr]
        "eager",
        "component_override",
    )
    assert scoped.resolution.component == "vae"  # type: ignore[union-attr]
    assert (configured.backend.name, configured.resolution.origin) == (  # type: ignore[union-attr]
        "flex_attention",
        "global_cli",
    )


def test_rule_late_binding_a_cast_of_a_bound_layer_replaces_its_ledger_entry(
    stand_ins: list[str],
) -> None:
    with component_scope("transformer"):
        layer = Attention(4, 64, platform=HOPPER, name="blocks.0.attn1")
        other = Attention(4, 64, platform=HOPPER, name="blocks.1.attn1")
    attnres.bind(layer)
    attnres.bind(other)
    first = layer.resolution
    assert first is not None and first.backend.name == "torch_sdpa"  # float32: fa takes none
    layer.to(torch.bfloat16)
    second = layer.resolution
    assert second is not None and second.backend.name == "fa"
    assert second.trace is not first.trace and second.trace.input.layer.dtype == "bfloat16"
    ledger = attnres.decisions()
    assert [(d.layer, d.backend) for d in ledger] == [
        ("blocks.0.attn1", "fa"),  # replaced in place, not appended
        ("blocks.1.attn1", "torch_sdpa"),
    ]
    assert ledger[0].digest == second.trace.digest


def test_rule_late_binding_a_failed_recast_keeps_the_old_decision() -> None:
    layer = Attention(4, 16, backend="flex_attention", platform=CPU, name="attn1")
    attnres.bind(layer)
    with pytest.raises(ResolutionError, match="float64"):
        layer.double()
    assert layer.backend is not None and layer.backend.name == "flex_attention"
    assert layer.layer_spec.dtype == "float32"
    assert [d.backend for d in attnres.decisions()] == ["flex_attention"]


def test_rule_late_binding_bind_resolves_pending_layers_and_fails_fast() -> None:
    model = nn.Sequential(Block("a", platform=CPU), Block("b", platform=CPU))
    resolutions = attnres.bind(model, dtype=torch.bfloat16)
    assert [r.layer for r in resolutions] == ["a", "b"]
    assert all(r.trace.input.layer.dtype == "bfloat16" for r in resolutions)
    assert attnres.bind(model, dtype="bf16") == resolutions  # already bound: kept
    assert len(attnres.decisions()) == 2
    attnres.set_selection_config(_strict_sage())
    with component_scope("transformer"):
        strict = Block(platform=CPU)
    with pytest.raises(ResolutionError, match="sage_attn"):
        attnres.bind(strict)  # at start-up, not at the first request
    assert strict.attn.pending


def test_rule_late_binding_bind_takes_a_platform(stand_ins: list[str]) -> None:
    layer = Attention(4, 64, name="attn1")
    (resolution,) = attnres.bind(layer, dtype=torch.float16, platform=HOPPER)
    assert resolution.backend.name == "fa"
    assert resolution.trace.input.platform == HOPPER


def test_bind_arguments_are_checked() -> None:
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        attnres.bind("model")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dtype"):
        attnres.bind(Attention(4, 16), dtype="int7")
    with pytest.raises(TypeError, match=r"attnres\.Platform"):
        attnres.bind(Attention(4, 16), platform="cpu")  # type: ignore[arg-type]


def test_rule_late_binding_pending_layers_are_checked_against_the_override_when_they_bind() -> None:
    with component_scope("vae", backend="eager") as scope:
        ok = Attention(4, 16, platform=CPU, name="ok")
        pinned = Attention(4, 16, platform=CPU, name="pinned", backend="torch_sdpa")
    assert scope.pending == 2 and scope.decisions == ()  # nothing decided yet: no error
    attnres.bind(ok)
    with pytest.raises(BackendNotAppliedError, match=r"pinned runs torch_sdpa \(origin layer\)"):
        attnres.bind(pinned)
    assert pinned.backend is not None  # bound; the error reports the unexplained layer
    assert scope.pending == 0


def test_rule_late_binding_an_override_that_ran_on_no_pending_layer_is_an_error(
    stand_ins: list[str],
) -> None:
    cuda = Platform.simulate("cuda:sm90+all")
    with component_scope("transformer", backend="video_sparse_attn") as scope:
        cross = Attention(8, 128, role="cross", platform=cuda, name="attn2")
    assert scope.pending == 1
    with pytest.raises(BackendNotAppliedError, match="ran on none of its 1 layer"):
        cross.to(torch.bfloat16)
    assert cross.resolution is not None
    assert cross.resolution.reason == "dense cross-attention fallback"


def test_late_binding_pickle_and_deepcopy_keep_a_pending_layer_pending() -> None:
    with component_scope("vae", backend="eager", require_selection=False):
        layer = Attention(4, 16, platform=CPU, name="attn1")
    for other in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert other.pending
        q = torch.randn(1, 3, 4, 16)
        other(q, q, q)
        assert other.backend is not None and other.backend.name == "eager"
        assert other.resolution.component == "vae"  # type: ignore[union-attr]
