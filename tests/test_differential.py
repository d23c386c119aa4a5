"""A differential harness for softmax attention written by hand (issue 30).

Each module below computes its attention by hand in a way written to break a
capture of it: in-place writes on its scores, ``detach``, a mask changed in
place after the code used it, hooks, autocast, ``inference_mode``,
``torch.compile``, probabilities returned to the caller, backward, values cast
to another dtype, boolean and additive masks. attnres offers no kernel there
(issue 30, choice (a): a by-hand site runs its own code). Each runs under no
flag, an explicit ``eager``, an explicit ``torch_sdpa`` and a stand-in
``sage_attn`` (the fake kernels of ``tests/test_masks.py``), as a plain torch
module held by a component (``attnres.integrations.diffusers.apply({"vae":
holder})``: a component that may fall back), once holding its head facts
(planned: decided at plan time) and once holding none (decided at its first
call), and is compared with the untouched module:

- no flag: nothing wrapped, bit-identical (outputs and gradients);
- an explicit flag: bit-identical too (the site's own code runs), and the
  decision says why (``eager``, reason ``softmax attention written by hand``);
- a strict component (``transformer``): the flag is refused, typed
  (``IntegrationError`` at apply for a planned site, ``ResolutionError`` at
  the first call of one decided there).

A failure names the case, the site, its route, the decision and the difference.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch

from attnres import Platform, SelectionConfig
from attnres.errors import IntegrationError, ResolutionError
from attnres.integrations import diffusers as idf

STAND_IN = attrs.evolve(Platform.simulate("cuda:sm90+flash_attn+sageattention"), simulated=False)
NO_FLAG, EAGER, SDPA, SAGE = "no flag", "eager", "torch_sdpa", "sage_attn"
B, S, D, H = 2, 6, 16, 2
HD = D // H


class Hand(torch.nn.Module):
    """Softmax attention by hand, ``case`` picking what its code does; it holds no
    head facts (decided at its first call)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.case = case
        self.q = torch.nn.Linear(D, D)
        self.k = torch.nn.Linear(D, D)
        self.v = torch.nn.Linear(D, D)
        self.drop = torch.nn.Dropout(0.0)
        self.register_buffer("bias", torch.zeros(1, 1, 1, S))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        case = self.case
        q = self.q(x).view(B, S, H, HD).transpose(1, 2)
        k = self.k(x).view(B, S, H, HD).transpose(1, 2)
        v = self.v(x).view(B, S, H, HD).transpose(1, 2)
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HD)
        if case == "bool mask":
            s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
        elif case == "additive mask":
            s = s + mask
        elif case == "setitem":
            s[..., 0] = 0.5
        elif case == "tril_":
            s.tril_()
        elif case == "clamp_":
            s.clamp_(min=-0.1)
        elif case == "index_fill_":
            s.index_fill_(-1, torch.tensor([1]), 2.0)
        elif case == "copy_":
            s.copy_(torch.ones(B, H, S, S))
        elif case == "masked_fill_ not a mask":
            s.masked_fill_(torch.eye(S, dtype=torch.bool), 3.0)
        elif case == "write through a view":
            s.view(B * H, S, S)[:, :, 0] = -1.0
        elif case == "detach":
            s = s.detach()
        elif case == "mask changed after use":
            bias = self.bias.clone()
            s = s + bias
            # the dtype's own minimum: torch 2.6 refuses -1e9 into float16 (overflow)
            bias[..., 0] = torch.finfo(bias.dtype).min
        elif case == "buffer changed after use":
            s = s + self.bias
            self.bias.add_(1.0)
            self.bias.sub_(1.0)  # the same values, a changed version
        elif case == "requires_grad read" and s.requires_grad:
            s = s * 2.0
        elif case == "hook" and s.requires_grad:
            s.register_hook(lambda g: g * 0.5)
        if case == "float32 softmax, values cast":
            # issue 32 item 12's other form: the probabilities in float32 (as
            # transformers' eager functions take them), the values cast to them
            p = torch.softmax(s, dim=-1, dtype=torch.float32)
            return torch.matmul(p, v.to(p.dtype)).to(v.dtype)
        p = torch.softmax(s, dim=-1)
        if case == "write after softmax":
            s.tril_()  # the probabilities were taken before
        if case == "forward hook":
            p = self.drop(p)  # a hook on it returns what it likes
        if case == "values cast":
            return torch.matmul(p.double(), v.double()).float()
        out = torch.matmul(p, v)
        if case == "probabilities returned":
            return out, p
        return out


#: the battery: what each case's code does to its attention
CASES = (
    "plain",
    "bool mask",
    "additive mask",
    "probabilities returned",
    "setitem",
    "tril_",
    "clamp_",
    "index_fill_",
    "copy_",
    "masked_fill_ not a mask",
    "write through a view",
    "write after softmax",
    "detach",
    "mask changed after use",
    "buffer changed after use",
    "requires_grad read",
    "hook",
    "forward hook",
    "values cast",
    "float32 softmax, values cast",
)
WRITTEN_BY_HAND = "softmax attention written by hand"


class HandWithFacts(Hand):
    """The same code, holding its head facts: planned, decided at plan time."""

    heads, head_dim = H, HD


def _inputs(dtype: torch.dtype, case: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, S, D, generator=g).to(dtype)
    keep = torch.ones(B, 1, 1, S, dtype=torch.bool)
    keep[1, ..., -2:] = False
    if case == "bool mask":
        return x, keep
    if case == "additive mask":
        return x, torch.zeros(B, 1, 1, S, dtype=dtype).masked_fill(~keep, -1e4)
    return x, None


def _build(case: str, dtype: torch.dtype, facts: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.attn = (HandWithFacts if facts else Hand)(case).to(dtype)
    if case == "forward hook":
        holder.attn.drop.register_forward_hook(lambda m, a, out: out.clamp(max=0.9))
    return holder


def _run(module: torch.nn.Module, case: str, dtype: torch.dtype, grad: bool) -> list[Any]:
    """The outputs, then (with ``grad``) the gradient of the input and of each
    parameter (``None`` where none reaches it)."""
    x, mask = _inputs(dtype, case)
    x.requires_grad_(grad)
    module.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(grad):
        out = module(x, mask)
    outs = list(out) if isinstance(out, tuple) else [out]
    if case == "probabilities returned":
        outs[1] = outs[1] * 1.0  # the caller uses them
    if not grad:
        return outs
    w = torch.Generator().manual_seed(5)
    loss = sum((o.float() * torch.randn(o.shape, generator=w)).sum() for o in outs)
    loss.backward()  # type: ignore[union-attr]
    return [*outs, x.grad, *(p.grad for p in module.parameters())]


def _check(
    case: str,
    flag: str,
    facts: bool,
    how: str = "",
    grads: tuple[bool, ...] = (False, True),
) -> None:
    """Run ``case`` untouched, then applied under ``flag`` in a component that may
    fall back, forward and (each of ``grads``) backward, and compare (the module
    docstring says how)."""
    fp16 = flag == SAGE
    dtype = torch.float16 if fp16 else torch.float32
    module = _build(case, dtype, facts)
    wants = [_context(how, lambda g=g: _run(module.attn, case, dtype, g)) for g in grads]
    config = None if flag == NO_FLAG else SelectionConfig(global_backend=flag)
    plan = idf.apply({"vae": module}, config, STAND_IN if fp16 else None)
    try:
        (site,) = plan.sites
        where = f"case {case!r}{how and ' (' + how + ')'} at site {site.name!r}, flag {flag}"
        owner = type(module.attn).__name__
        assert site.route == f"the site's own code (softmax attention written by hand in {owner})"
        assert site.kind.value == "own code" and site.by_hand, where
        routes = idf.routes({"vae": module})
        if flag == NO_FLAG or facts:
            assert not routes, f"{where}: a route is installed on its own code"
        for grad, want in zip(grads, wants, strict=True):
            got = _context(how, lambda g=grad: _run(module.attn, case, dtype, g))
            for i, (a, b) in enumerate(zip(got, want, strict=True)):
                same = (a is None and b is None) or (
                    a is not None and b is not None and torch.equal(a, b)
                )
                assert same, f"{where} ({'backward' if grad else 'forward'}): tensor {i} differs"
        # the decision: the site's own code (eager), and why the flag did not run
        if facts:
            assert site.resolution is not None, where
            backend, reason = site.resolution.backend.name, site.resolution.reason
        else:
            assert site.status.value == "pending", where
            firsts = [f for r in routes.values() for f in r.first_calls]
            if flag == NO_FLAG:
                assert not firsts, where
                return
            assert firsts and firsts[0].trace is not None, where
            backend, reason = firsts[0].backend.name, firsts[0].trace.outcome.reason
        want_reason = None if flag in (NO_FLAG, EAGER) else WRITTEN_BY_HAND
        got_reason = None if reason is None else str(reason)
        assert (backend, got_reason) == ("eager", want_reason), f"{where}: {backend}, {reason}"
    finally:
        idf.remove({"vae": module})


def _context(how: str, run: Any) -> Any:
    if how == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run()
    if how == "inference_mode":
        with torch.inference_mode():
            return run()
    return run()


@pytest.mark.parametrize("facts", [False, True], ids=["first call", "planned"])
@pytest.mark.parametrize("flag", [NO_FLAG, EAGER, SDPA])
@pytest.mark.parametrize("case", CASES)
def test_a_by_hand_site_runs_its_own_code_and_says_why(case: str, flag: str, facts: bool) -> None:
    _check(case, flag, facts)


@pytest.mark.parametrize("facts", [False, True], ids=["first call", "planned"])
@pytest.mark.parametrize(
    "case",
    [
        "plain", "bool mask", "setitem", "mask changed after use",
        # issue 32 item 12: values cast before p @ v (float16 here: a real cast)
        "values cast", "float32 softmax, values cast",
    ],
)  # fmt: skip
def test_the_stand_in_sage_kernel_too(case: str, facts: bool, varlen_fakes: Any) -> None:
    _check(case, SAGE, facts, grads=(False,))


@pytest.mark.parametrize("how", ["autocast", "inference_mode"])
@pytest.mark.parametrize("case", ["plain", "mask changed after use", "tril_"])
def test_under_autocast_and_inference_mode(case: str, how: str) -> None:
    for flag in (NO_FLAG, SDPA):
        for facts in (False, True):
            _check(case, flag, facts, how=how, grads=(False,))


@pytest.mark.parametrize("facts", [False, True], ids=["first call", "planned"])
def test_a_compiled_module_runs_its_own_code(facts: bool) -> None:
    module = _build("plain", torch.float32, facts)
    want = _run(module.attn, "plain", torch.float32, False)
    idf.apply({"vae": module}, SelectionConfig(global_backend=SDPA))
    try:
        _run(module.attn, "plain", torch.float32, False)  # decided outside the graph
        compiled = torch.compile(module.attn, backend="eager")
        got = _run(compiled, "plain", torch.float32, False)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    finally:
        idf.remove({"vae": module})


def test_a_strict_component_refuses_a_flag_at_a_planned_site_typed() -> None:
    # a strict component's flag that its by-hand site cannot run: apply refuses,
    # typed, naming the route; nothing is changed
    module = _build("plain", torch.float32, facts=True)
    config = SelectionConfig(global_backend=SDPA)
    plan = idf.plan({"transformer": module}, config)
    (site,) = plan.sites
    assert site.status.value == "rejected" and WRITTEN_BY_HAND in str(site.error), site.error
    with pytest.raises(IntegrationError, match=WRITTEN_BY_HAND):
        idf.apply({"transformer": module}, config)
    assert not idf.routes({"transformer": module})


def test_a_strict_component_refuses_at_the_first_call_typed() -> None:
    # issue 32 item 8: softmax attention by hand in a plain torch module is a site
    # (its plan under a strict flag is not "ok - 0 layers"); decided at its first
    # call, that call raises, typed, naming the route, and computes nothing
    module = _build("tril_", torch.float32)
    plan = idf.plan({"transformer": module}, SelectionConfig(global_backend=SDPA))
    (site,) = plan.sites
    assert site.name == "attn" and site.by_hand
    idf.apply({"transformer": module}, SelectionConfig(global_backend=SDPA))
    try:
        with pytest.raises(ResolutionError, match=WRITTEN_BY_HAND):
            _run(module.attn, "tril_", torch.float32, False)
    finally:
        idf.remove({"transformer": module})


@pytest.mark.parametrize("case", ["plain", "bool mask", "additive mask", "values cast"])
@pytest.mark.parametrize("component", ["transformer", "vae"])
def test_a_strict_plan_of_a_plain_module_names_its_by_hand_site(case: str, component: str) -> None:
    """Issue 32 item 8, variants: whatever the by-hand code does, a strict flag's
    plan of a plain torch module has its site (it said "ok - 0 layers"), in a
    strict component and in one that may fall back, and the rendered plan says so."""
    module = _build(case, torch.float32)
    config = SelectionConfig(global_backend=SDPA, global_backend_explicit=True)
    plan = idf.plan({component: module}, config, Platform.simulate("cpu"))
    assert plan.ok, plan.errors
    (site,) = plan.sites
    assert site.name == "attn" and site.by_hand, site
    assert site.status.value == "pending"  # decided at its first call
    text = plan.render()
    assert "pending: attn (Hand): decided at first call" in text, text
    assert "1 site decided at first call" in text.split("Verdict:")[1], text
