"""A differential harness for softmax attention written by hand (issue 30).

Each module below computes its attention by hand in a way written to break an
eager capture of it (the deferred-scores route, ``_deferred.py``): in-place
writes on its scores, ``detach``, a mask changed in place after the code used
it, hooks, autocast, ``inference_mode``, ``torch.compile``, probabilities
returned to the caller, backward, values cast to another dtype, boolean and
additive masks. Each runs under no flag, an explicit ``eager``, an explicit
``torch_sdpa`` and a stand-in ``sage_attn`` (the fake kernels of
``tests/test_masks.py``), as a plain torch module held by a component
(``attnres.integrations.diffusers.apply({"vae": holder})``: a component that may
fall back), and is compared with the untouched module:

- no flag: bit-identical (outputs and gradients);
- a forward where the route ran a kernel: within the kernel's tolerance
  (float32, outputs and gradients: ``max|d| <= 2e-5 + 2e-4 * max|ref|``; the
  fp16 stand-in: relative norm under ``5e-3``);
- a forward where it did not: bit-identical, and the route's first-call record
  says why (``own math: ...``).

A failure names the case, the site, its route, the kernel and the difference.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch

from attnres import Platform, SelectionConfig
from attnres.errors import DeferredScoresError, ResolutionError
from attnres.integrations import _deferred
from attnres.integrations import diffusers as idf

F = torch.nn.functional
STAND_IN = attrs.evolve(Platform.simulate("cuda:sm90+flash_attn+sageattention"), simulated=False)
NO_FLAG, EAGER, SDPA, SAGE = "no flag", "eager", "torch_sdpa", "sage_attn"
B, S, D, H = 2, 6, 16, 2
HD = D // H


class Hand(torch.nn.Module):
    """Softmax attention by hand, ``case`` picking what its code does."""

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
            bias[..., 0] = -1e9
        elif case == "buffer changed after use":
            s = s + self.bias
            self.bias.add_(1.0)
            self.bias.sub_(1.0)  # the same values, a changed version
        elif case == "requires_grad read" and s.requires_grad:
            s = s * 2.0
        elif case == "hook" and s.requires_grad:
            s.register_hook(lambda g: g * 0.5)
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


#: what each case's forward runs under a decided kernel (True: the kernel; a
#: string: its own math, the record saying that)
CASES: dict[str, bool | str] = {
    "plain": True,
    "bool mask": True,
    "additive mask": True,
    "probabilities returned": True,
    "setitem": "__setitem__ of the scores",
    "tril_": "tril_ of the scores",
    "clamp_": "clamp_ of the scores",
    "index_fill_": "index_fill_ of the scores",
    "copy_": "copy_ of the scores",
    "masked_fill_ not a mask": "masked_fill with a value that is not a mask's",
    "write through a view": "the scores changed in place",
    "write after softmax": "tril_ of the scores",
    "detach": "detach of the scores",
    "mask changed after use": "changed in place after its use",
    "buffer changed after use": "changed in place after its use",
    "requires_grad read": "requires_grad of the scores",
    "hook": True,  # no grad: no hook; with grad: requires_grad read (below)
    "forward hook": "clamp of the attention probabilities",
    "values cast": "probabilities in float64, values in float64",
}
GRAD_OWN = {"hook": "requires_grad of the scores", "detach": "detach of the scores"}


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


def _build(case: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.attn = Hand(case).to(dtype)
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


def _differs(got: Any, want: Any, fp16: bool) -> float | None:
    """The difference of ``got`` from ``want`` where it is over the tolerance."""
    if got is None or want is None:
        return None if got is None and want is None else float("inf")
    d = (got.detach().double() - want.detach().double()).abs()
    if fp16:
        norm = float(d.norm() / want.detach().double().norm().clamp_min(1e-12))
        return norm if norm > 5e-3 else None
    worst = float(d.max())
    return worst if worst > 2e-5 + 2e-4 * float(want.detach().double().abs().max()) else None


class _Spy:
    """Wraps one route's ``run_deferred``: whether the last forward ran its kernel."""

    def __init__(self, route: Any) -> None:
        self.route, self.kernel = route, 0
        real = route.run_deferred

        def run(found: Any, probs: Any) -> Any:
            out = real(found, probs)
            self.kernel += out is not None
            return out

        route.run_deferred = run


def _check(case: str, flag: str, how: str = "", grads: tuple[bool, ...] = (False, True)) -> None:
    """Run ``case`` untouched, then applied under ``flag``, forward and (each of
    ``grads``) backward, and compare (the module docstring says how)."""
    fp16 = flag == SAGE
    dtype = torch.float16 if fp16 else torch.float32
    module = _build(case, dtype)
    wants = [_context(how, lambda g=g: _run(module.attn, case, dtype, g)) for g in grads]
    config = None if flag == NO_FLAG else SelectionConfig(global_backend=flag)
    plan = idf.apply({"vae": module}, config, STAND_IN if fp16 else None)
    try:
        (site,) = plan.sites
        routes = idf.routes({"vae": module})
        if flag == NO_FLAG:
            assert not routes, f"case {case!r}: no flag installed a route at {site.name!r}"
        spy = _Spy(next(iter(routes.values()))) if routes else None
        for grad, want in zip(grads, wants, strict=True):
            if spy is not None:
                spy.kernel = 0
            got = _context(how, lambda g=grad: _run(module.attn, case, dtype, g))
            firsts = [f for r in routes.values() for f in r.first_calls]
            ran = spy is not None and spy.kernel > 0
            _compare(case, flag, how, grad, site, ran, firsts, got, want)
    finally:
        idf.remove({"vae": module})


def _compare(
    case: str, flag: str, how: str, grad: bool, site: Any, kernel: bool, firsts: list[Any],
    got: list[Any], want: list[Any],
) -> None:  # fmt: skip
    decided = sorted({f.backend.name for f in firsts}) or [getattr(site.backend, "name", "-")]
    where = (
        f"case {case!r} ({'backward' if grad else 'forward'}{how and ', ' + how}) at site "
        f"{site.name!r}, route {site.route!r}, flag {flag}, kernel {decided}"
    )
    expect = GRAD_OWN.get(case, CASES[case]) if grad else CASES[case]
    if how == "autocast":  # autocast picks each product's dtype: the code's own math
        expect = "scores under autocast"
    if not kernel:
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            same = (a is None and b is None) or (
                a is not None and b is not None and torch.equal(a, b)
            )
            d = None if same else (float("inf") if a is None or b is None else (a - b).abs().max())
            assert same, f"{where}: its own math, yet tensor {i} differs by {d}"
        if flag in (SDPA, SAGE):  # the record says it did not run there, and why
            assert "eager" in decided, f"{where}: no record of its own code"
            if flag == SDPA and expect is not True:
                reasons = [f.facts.own_math for f in firsts]
                assert any(expect in r for r in reasons), f"{where}: own math, records {reasons}"
        return
    assert flag in (SDPA, SAGE) and expect is True, f"{where}: a kernel ran where it must not"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        d = _differs(a, b, fp16=flag == SAGE)
        assert d is None, f"{where}: the kernel's tensor {i} differs by {d}"


def _context(how: str, run: Any) -> Any:
    if how == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return run()
    if how == "inference_mode":
        with torch.inference_mode():
            return run()
    return run()


@pytest.mark.parametrize("flag", [NO_FLAG, EAGER, SDPA])
@pytest.mark.parametrize("case", list(CASES))
def test_a_by_hand_site_changes_no_output_its_route_did_not_decide(case: str, flag: str) -> None:
    _check(case, flag)


@pytest.mark.parametrize("case", ["plain", "bool mask", "setitem", "mask changed after use"])
def test_the_stand_in_sage_kernel_too(case: str, varlen_fakes: Any) -> None:
    _check(case, SAGE, grads=(False,))


@pytest.mark.parametrize("how", ["autocast", "inference_mode"])
@pytest.mark.parametrize("case", ["plain", "mask changed after use", "tril_"])
def test_under_autocast_and_inference_mode(case: str, how: str) -> None:
    for flag in (NO_FLAG, SDPA):
        _check(case, flag, how=how, grads=(False,))


def test_compiled_module_runs_the_route_eagerly_with_the_same_result() -> None:
    module = _build("plain", torch.float32)
    want = _run(module.attn, "plain", torch.float32, False)
    idf.apply({"vae": module}, SelectionConfig(global_backend=SDPA))
    compiled = torch.compile(module.attn, backend="eager")
    got = _run(compiled, "plain", torch.float32, False)
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    idf.remove({"vae": module})


def test_a_strict_component_refuses_own_math_typed_and_plans_the_site() -> None:
    # issue 32 item 8: softmax attention by hand in a plain torch module is a site
    # (its plan under a strict flag is not "ok - 0 layers"), and a call only its
    # own math computes raises, typed, naming what the code did
    module = _build("tril_", torch.float32)
    plan = idf.plan({"transformer": module}, SelectionConfig(global_backend=SDPA))
    (site,) = plan.sites
    assert site.name == "attn" and "softmax by hand in Hand" in site.route
    idf.apply({"transformer": module}, SelectionConfig(global_backend=SDPA))
    with pytest.raises(ResolutionError, match=r"by hand .*: tril_ of the scores"):
        _run(module.attn, "tril_", torch.float32, False)
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
    assert site.name == "attn" and "softmax by hand in Hand" in site.route, site
    assert site.status.value == "pending"  # decided at its first call
    text = plan.render()
    assert "pending: attn (Hand): decided at first call" in text, text
    assert "1 site decided at first call" in text.split("Verdict:")[1], text


def test_probabilities_used_after_an_input_changed_in_place_are_refused() -> None:
    # the weights returned deferred: computed at their use from what the code read;
    # a tensor they read changed since -- computing them would not be the code's
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 4, 8, generator=g) for _ in range(3))
    bias = torch.zeros(1, 1, 1, 4)

    def attn() -> Any:
        p = torch.softmax(q @ k.transpose(-1, -2) + bias, dim=-1)
        return p @ v, p

    def kernel(found: Any, probs: Any) -> Any:  # the attention run by a kernel
        out = F.scaled_dot_product_attention(found.q, found.k, found.v, found.mask)
        return found.finish(out)

    with _deferred.DeferScores(kernel):
        _, p = attn()
    assert isinstance(p, _deferred.Deferred)
    bias[..., 0] = -1e9
    with pytest.raises(DeferredScoresError, match="changed in place after its use"):
        p.sum()
