"""SPEC 7: an ``attnres.Attention`` layer stays a single graph under
``torch.compile(fullgraph=True)``.

Dynamo-level checks (graph count, graph breaks, ``fullgraph=True``) use the
``"eager"`` compile backend: it runs Dynamo's full tracing but skips Inductor's
code generation, which on this CPU costs seconds per graph. One real Inductor
compile of ``torch_sdpa`` runs too.

``flex_attention`` is checked at the Dynamo level only: Inductor's CPU code
generation for the flex kernel takes about a minute per shape on a 2-core
machine (measured: 58 s for one (1, 16, 4, 32) causal layer, torch 2.13), too
slow for ``make test``; its Dynamo graph, which is what "no graph break" is
about, is checked here.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor, nn

import attnres
from attnres import Requirements
from attnres.modules import Attention

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile:UserWarning"),
]


@dataclass(frozen=True)
class Case:
    name: str
    heads: int = 4
    kv_heads: int = 4
    seq_q: int = 12
    seq_kv: int = 12
    causal: bool = False
    mask: str | None = None


CASES = (
    Case("self"),
    Case("gqa_causal", heads=4, kv_heads=2, causal=True),
    Case("cross_float_mask", seq_q=6, seq_kv=10, mask="float"),
    Case("bool_mask", mask="bool"),
)
BACKENDS = ("torch_sdpa", "eager", "flex_attention")
HEAD_SIZE = 16


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _layer(case: Case, backend: str) -> Attention:
    layer = Attention(
        case.heads,
        HEAD_SIZE,
        num_kv_heads=case.kv_heads,
        causal=case.causal,
        requirements=Requirements(attn_mask=case.mask is not None),
        backend=backend,
        name=f"compile.{case.name}",
    )
    attnres.bind(layer)  # built without dtype: bound before compiling
    return layer


def _inputs(case: Case) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, case.seq_q, case.heads, HEAD_SIZE, generator=gen)
    k = torch.randn(2, case.seq_kv, case.kv_heads, HEAD_SIZE, generator=gen)
    v = torch.randn(2, case.seq_kv, case.kv_heads, HEAD_SIZE, generator=gen)
    mask: Tensor | None = None
    if case.mask == "float":
        mask = torch.randn(2, 1, case.seq_q, case.seq_kv, generator=gen)
    elif case.mask == "bool":
        mask = torch.rand(1, 1, case.seq_q, case.seq_kv, generator=gen) > 0.3
        mask[..., 0] = True
    return q, k, v, mask


# flex_attention: two cases (block mask; score_mod over a float mask) keep the
# Dynamo tracing time modest (several seconds each here).
PAIRS = [
    pytest.param(case, backend, id=f"{case.name}-{backend}")
    for backend in BACKENDS
    for case in CASES
    if backend != "flex_attention" or case.name in ("gqa_causal", "cross_float_mask")
]


@pytest.mark.parametrize(("case", "backend"), PAIRS)
def test_layer_is_one_graph_without_breaks(case: Case, backend: str) -> None:
    layer = _layer(case, backend)
    q, k, v, mask = _inputs(case)
    expected = layer(q, k, v, mask)

    explained = torch._dynamo.explain(layer)(q, k, v, mask)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1

    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v, mask), expected, rtol=1e-5, atol=1e-6)


def test_layer_inside_a_compiled_model_is_one_graph() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4 * HEAD_SIZE, 3 * 4 * HEAD_SIZE)
            self.attn = Attention(4, HEAD_SIZE, causal=True, name="attn1")
            self.out = nn.Linear(4 * HEAD_SIZE, 4 * HEAD_SIZE)

        def forward(self, x: Tensor) -> Tensor:
            b, s, _ = x.shape
            q, k, v = self.proj(x).view(b, s, 3, 4, HEAD_SIZE).unbind(dim=2)
            out: Tensor = self.out(self.attn(q, k, v).reshape(b, s, -1))
            return out

    block = Block()
    assert [r.backend.name for r in attnres.bind(block)] == ["torch_sdpa"]
    x = torch.randn(2, 9, 4 * HEAD_SIZE)
    explained = torch._dynamo.explain(block)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x), block(x), rtol=1e-5, atol=1e-6)


def test_module_compile_and_hooks_keep_working() -> None:
    """``Module.compile()`` and hooks route through ``nn.Module.__call__``."""
    layer = Attention(4, HEAD_SIZE, name="attn1")
    q, k, v, _ = _inputs(Case("self"))
    expected = layer(q, k, v)  # the first forward binds it
    assert not layer.pending
    layer.register_forward_hook(lambda module, args, out: out * 3)
    layer.compile(fullgraph=True, backend="eager")
    torch.testing.assert_close(layer(q, k, v), expected * 3, rtol=1e-5, atol=1e-6)


# torch's own Inductor imports a deprecated torch.jit API (not attnres code)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_compile_of_torch_sdpa() -> None:
    case = Case("gqa_causal", heads=4, kv_heads=2, causal=True)
    layer = _layer(case, "torch_sdpa")
    q, k, v, _ = _inputs(case)
    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), layer(q, k, v), rtol=1e-5, atol=1e-5)


def test_rule_late_binding_a_pending_layer_inside_torch_compile_says_bind_first() -> None:
    layer = Attention(4, HEAD_SIZE, name="attn1")
    q, k, v, _ = _inputs(Case("self"))
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=r"call attnres.bind\(model\)"):
        compiled(q, k, v)
    assert layer.pending
    torch._dynamo.reset()
    attnres.bind(layer)
    torch.testing.assert_close(compiled(q, k, v), layer(q, k, v), rtol=1e-5, atol=1e-6)


def test_a_pending_layer_binds_eagerly_while_another_thread_compiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``torch.compiler.is_compiling()`` is process-wide (true while any thread
    compiles): a pending layer's eager first call in another thread binds as
    usual instead of refusing as if it were inside a graph."""
    layer = Attention(4, HEAD_SIZE, name="attn1")
    q, k, v, _ = _inputs(Case("self"))
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling() and not torch.compiler.is_dynamo_compiling()
    out = layer(q, k, v)
    monkeypatch.undo()
    assert not layer.pending
    torch.testing.assert_close(out, layer(q, k, v), rtol=0, atol=0)
