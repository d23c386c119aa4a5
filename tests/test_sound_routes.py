"""Issue 30: never change an output attnres did not decide to change. Each test
here fails on the code before the fix it names (the issue's listed defects)."""

from __future__ import annotations

import functools
import sys
import tomllib
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

# imported before any test installs kernel fakes (transformers probes flash_attn's
# spec when it first imports its hub kernels)
import transformers.models.qwen2_5_vl.modeling_qwen2_5_vl  # noqa: F401
from test_kernels_fakes import VARIANTS, Calls, fake_xformers, kernel_for

from attnres import Platform
from attnres._states import RouteKind
from attnres.layer import SelectionConfig

ROOT = Path(__file__).resolve().parents[1]
#: a simulated H100 with xformers, installable: the stand-in kernels run on this CPU
XFORMERS = attrs.evolve(Platform.simulate("cuda:sm90+xformers"), simulated=False)


def _explicit(backend: str) -> SelectionConfig:
    return SelectionConfig(global_backend=backend, global_backend_explicit=True)


@pytest.fixture
def xformers_fake(monkeypatch: pytest.MonkeyPatch) -> Calls:
    from attnres.kernels import clear_kernel_cache

    calls = Calls()
    for name in list(sys.modules):
        if name.split(".")[0] == "xformers":
            monkeypatch.delitem(sys.modules, name)
    for name, module in fake_xformers(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    clear_kernel_cache()
    yield calls
    clear_kernel_cache()


# -- T5's decoder keeps its causal mask under attnres's function ------------------------------


def _t5() -> Any:
    from transformers import T5Config, T5Model

    torch.manual_seed(3)
    config = T5Config(
        d_model=32, d_kv=8, d_ff=37, num_heads=4, num_layers=1, num_decoder_layers=1,
        vocab_size=64, relative_attention_num_buckets=8,
    )  # fmt: skip
    return T5Model(config).eval()


def test_t5_decoder_under_a_stand_in_backend_is_causal(xformers_fake: Calls) -> None:
    from attnres.integrations import transformers as itf

    model = _t5()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    later = torch.tensor([[5, 11, 12, 13, 14]])  # the same first token, other later ones

    def run(decoder_ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            out = model(input_ids=ids, decoder_input_ids=decoder_ids)
        return out.last_hidden_state

    want, want_later = run(ids), run(later)
    plan = itf.apply(model, "text_encoder", _explicit("xformers"), XFORMERS)
    try:
        got, got_later = run(ids), run(later)
        if {s.kind for s in plan.sites} == {RouteKind.INTERFACE}:  # transformers >= 5.16
            assert {s.backend for s in plan.sites} == {"xformers"}
            assert xformers_fake.seen, "the xformers stand-in ran"
        else:  # older T5 computes its attention by hand: its own code, and the plan says so
            assert {s.kind for s in plan.sites} == {RouteKind.OWN_CODE}
            assert {(s.backend.name, s.resolution.reason.value) for s in plan.sites} == {
                ("eager", "softmax attention written by hand")
            }
            assert not xformers_fake.seen
    finally:
        itf.remove(model)
    # causal: decoder position 0 sees only itself, whatever the later tokens are
    assert torch.allclose(got[:, 0], got_later[:, 0], atol=1e-6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got_later, want_later, atol=1e-5, rtol=1e-4)


# -- zero-length keys: every adapter answers as torch SDPA does -----------------------------------


@pytest.mark.parametrize("variant", ["eager", "torch_sdpa", "flex_attention", *VARIANTS])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "bool-mask"])
def test_every_kernel_answers_zero_keys_as_sdpa(
    variant: str, masked: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Wan 2.x i2v's image cross-attention with zero image tokens: explicit eager
    # raised IndexError (amax over an empty dimension) where the site's SDPA runs
    from attnres.kernels import clear_kernel_cache, get_kernel

    clear_kernel_cache()
    if variant in VARIANTS:
        kernel, calls = kernel_for(variant, monkeypatch)
    else:
        kernel, calls = get_kernel(variant), Calls()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 16, generator=gen).half().requires_grad_()
    k, v = torch.empty(2, 0, 2, 16).half(), torch.empty(2, 0, 2, 16).half()
    mask = torch.ones(2, 1, 5, 0, dtype=torch.bool) if masked else None
    want = torch.nn.functional.scaled_dot_product_attention(
        q.detach().float().transpose(1, 2), k.float().transpose(1, 2),
        v.float().transpose(1, 2), attn_mask=mask, enable_gqa=True,
    ).transpose(1, 2)  # fmt: skip
    try:
        out = kernel(q, k, v, mask if variant in ("eager", "torch_sdpa") else None, False, None)
    finally:
        clear_kernel_cache()
    assert out.shape == (2, 5, 4, 16) and out.dtype == torch.float16
    assert torch.equal(out.float(), want) and not calls.seen  # zeros, no kernel reached
    out.float().sum().backward()  # gradients flow as through SDPA (zero)
    assert q.grad is not None and not q.grad.any()


# -- Python 3.11 or newer ------------------------------------------------------------------------


def test_python_311_or_newer_is_declared() -> None:
    # the bytecode reader of attention written with @ knows 3.11's BINARY_OP only
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["requires-python"] == ">=3.11"
    assert not any(d.startswith("tomli") for d in project["project"]["dependencies"])
    assert project["tool"]["mypy"]["python_version"] == "3.11"
    assert project["tool"]["ruff"]["target-version"] == "py311"


# -- no flag: nothing changes --------------------------------------------------------------------


def test_no_flag_never_moves_a_site_off_its_own_implementation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # transformers 4.x ran Gemma 2 on sdpa (which ignored its softcap); attnres's
    # plan finds sdpa lacks softcap and its fallback chose eager: an output changed
    # (7.9e-7) with no flag. Reproduced on 5.x by declaring sdpa as 4.x did.
    import transformers
    from transformers.models.gemma2 import modeling_gemma2

    from attnres.integrations import transformers as itf

    monkeypatch.setattr(modeling_gemma2.Gemma2PreTrainedModel, "_supports_sdpa", True)
    config = transformers.Gemma2Config(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_hidden_layers=1, vocab_size=64,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = transformers.Gemma2Model(config).eval()
    plan = itf.apply(model, "text_encoder", SelectionConfig(), Platform.detect())
    try:
        assert plan.sites and all(s.backend is None for s in plan.sites)
        assert all("nothing requested" in (s.note or "") for s in plan.sites)
        assert model.config._attn_implementation == "sdpa"  # untouched
    finally:
        itf.remove(model)
    # an explicit flag still decides (and says why)
    plan = itf.plan(model, "text_encoder", _explicit("eager"), Platform.detect())
    assert {s.backend.name for s in plan.sites if s.backend} == {"eager"}


@pytest.mark.parametrize(
    ("package", "installed"),
    [("transformers", "4.57.1"), ("transformers", "6.0.0"), ("diffusers", "0.35.2")],
)
def test_apply_refuses_a_library_outside_the_declared_range(
    package: str, installed: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnres.errors import AttnresError, UnsupportedVersionError
    from attnres.integrations import diffusers as idf
    from attnres.integrations import transformers as itf
    from attnres.integrations._plan import SUPPORTED_VERSIONS

    model = _t5()
    before = model.config._attn_implementation
    # the attribute the check reads: the module each integration imported
    library = getattr(idf if package == "diffusers" else itf, package)
    monkeypatch.setattr(library, "__version__", installed)
    low, high = SUPPORTED_VERSIONS[package]
    with pytest.raises(UnsupportedVersionError) as info:
        if package == "transformers":
            itf.apply(model, "text_encoder", _explicit("eager"), Platform.detect())
        else:
            idf.apply(object(), _explicit("eager"), Platform.detect())
    assert isinstance(info.value, AttnresError)
    assert installed in str(info.value) and f"{package}>={low},<{high}" in str(info.value)
    assert (info.value.package, info.value.installed) == (package, installed)
    assert model.config._attn_implementation == before  # nothing changed


def test_the_declared_ranges_live_in_one_table() -> None:
    from attnres.integrations._plan import SUPPORTED_VERSIONS

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extras = project["project"]["optional-dependencies"]
    for extra in ("diffusers", "transformers"):
        for package, (low, high) in SUPPORTED_VERSIONS.items():
            declared = [d for d in extras[extra] if d.startswith(f"{package}>")]
            if declared:
                assert declared == [f"{package}>={low},<{high}"], (extra, declared)


# -- an applied model deep-copies (its copy runs its own weights) and refuses pickle, typed -----


def test_an_applied_flux_pipeline_deep_copies_and_its_copy_follows_its_own_weights() -> None:
    import copy
    import io
    import pickle

    import tiny_pipelines as tp

    from attnres.errors import AppliedModelPickleError, AttnresError
    from attnres.integrations import diffusers as idf

    def run(pipe: Any) -> torch.Tensor:
        with torch.no_grad():
            return pipe.transformer(**tp.flux_inputs()).sample

    pipe = tp.flux()
    idf.apply(pipe, _explicit("eager"), Platform.detect())
    before = run(pipe)
    twin = copy.deepcopy(pipe)  # raised TypeError: cannot pickle '_thread.lock' object
    assert torch.equal(run(twin), before)  # the same weights, the same routes
    with torch.no_grad():  # the copy's weights change: its attention projections
        for name, p in twin.transformer.named_parameters():
            if ".attn.to_" in name:
                p.mul_(1.5)
    changed = run(twin)
    assert not torch.equal(changed, before)  # the copy runs its own weights
    assert torch.equal(run(pipe), before)  # the original is unchanged
    # the copy keeps its routes (eager), which its own remove() undoes (torch SDPA)
    assert idf.remove(twin) >= 1
    torch.testing.assert_close(run(twin), changed, rtol=1e-4, atol=1e-5)
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(AppliedModelPickleError, match=r"remove\(\)") as info:
            save(pipe.transformer)
        assert isinstance(info.value, AttnresError) and isinstance(info.value, TypeError)
    idf.remove(pipe)
    pickle.dumps(pipe.transformer)  # removed: an ordinary model again


def test_a_deep_copy_keeps_routes_of_its_own_and_its_first_calls_land_on_them() -> None:
    # issue 30: the copy shared the original's routes, so a call of the copy that
    # its plan did not describe was recorded on the original's route (and the
    # original's remove() closed a route the copy still ran). Each installed shape:
    # a routed processor (diffusers' Attention), a rebound forward (a module that
    # calls SDPA itself), the module's own math (MultiheadAttention)
    import copy

    from diffusers.models.attention_processor import Attention

    from attnres.integrations import _route
    from attnres.integrations import diffusers as idf

    class Own(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads, self.head_dim, self.proj = 2, 8, torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor, mask: Any = None) -> torch.Tensor:
            q = self.proj(x).view(1, -1, 2, 8).transpose(1, 2)
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            return out.transpose(1, 2).reshape(1, -1, 16)

    holder = torch.nn.Module()
    holder.attn = Attention(query_dim=16, heads=2, dim_head=8)
    holder.own = Own()
    holder.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    holder.eval()
    x = torch.randn(1, 6, 16)
    mask = torch.zeros(1, 1, 6, 6)
    mask[..., -1] = float("-inf")

    def calls(model: Any, masked: bool) -> list[torch.Tensor]:
        with torch.no_grad():
            if not masked:
                return [model.attn(x), model.own(x), model.mha(x, x, x, need_weights=False)[0]]
            pad = mask[0, 0, :1, :] != 0  # (1, 6): True leaves the last key out
            return [
                model.attn(x, attention_mask=mask[0]),
                model.own(x, mask),
                model.mha(x, x, x, key_padding_mask=pad, need_weights=False)[0],
            ]

    comps = {"vae": holder}
    idf.apply(comps, _explicit("eager"), Platform.detect())
    twin = copy.deepcopy(holder)
    ours, theirs = idf.routes(comps), idf.routes({"vae": twin})
    assert ours.keys() == theirs.keys() and len(ours) == 3
    assert all(theirs[k] is not ours[k] for k in ours)  # distinct routes
    for a, b in zip(calls(twin, False), calls(holder, False), strict=True):
        assert torch.equal(a, b)
    calls(twin, masked=True)  # a signature the plan did not describe: first calls
    assert all(len(r.first_calls) == 1 for r in theirs.values())
    assert all(not r.first_calls for r in ours.values())  # none on the original's
    with torch.no_grad():  # the copy runs its own weights, through its routes
        for p in twin.parameters():
            p.mul_(1.5)
    for a, b in zip(calls(twin, False), calls(holder, False), strict=True):
        assert not torch.equal(a, b)
    assert idf.remove(comps) == 3  # the original's remove leaves the copy's routes
    assert all(_route.installed_route(m) is None for m in (holder.own, holder.mha))
    assert len(idf.routes({"vae": twin})) == 3
    calls(twin, masked=True)  # still routed: no new first call
    assert all(len(r.first_calls) == 1 for r in theirs.values())
    assert idf.remove({"vae": twin}) == 3


# -- one install mechanism: a copy where the instance reaches the call, else a pin ------------


class _Nested(torch.nn.Module):
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


class _Through(torch.nn.Module):
    """Calls SDPA in a method its forward reaches through ``self`` (diffusers'
    ``VidTokAttnBlock``), and holds a module that calls SDPA too."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Nested()

    def attention(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.5)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.attention(q) + self.inner(q[..., :3, :]).sum()


class _Recording:
    """A route stand-in: records the calls it is handed, runs torch SDPA."""

    name = component = where = "recorded"

    def __init__(self) -> None:
        self.seen: list[tuple[int, ...]] = []
        self.homes: list[Any] = []

    def __call__(self, q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.seen.append(tuple(q.shape))
        return torch.nn.functional.scaled_dot_product_attention(q, *args, **kwargs)

    def close(self) -> None:
        from attnres.integrations import _route

        _route._forget_homes(self.homes)  # type: ignore[attr-defined]


def test_a_call_in_a_method_reached_through_self_is_rebound_and_only_the_sites_own() -> None:
    """The copy goes where the instance reaches the call (its ``attention``
    method, an instance attribute; its ``forward`` stays the class's): before,
    such a site ran under a per-call TorchFunctionMode. A nested module's call,
    and the nested module's own route, are not the site's."""
    from attnres.integrations import _route

    site, q = _Through(), torch.randn(1, 2, 5, 4)
    want = site(q)
    outer, inner = _Recording(), _Recording()
    _route.install_route(site, outer)  # type: ignore[arg-type]
    try:
        assert set(site.__dict__) >= {"attention"} and "forward" not in site.__dict__
        assert torch.equal(site(q), want)
        assert outer.seen == [(1, 2, 5, 4)]  # the nested module's call is not the site's
        _route.install_route(site.inner, inner)  # type: ignore[arg-type]
        assert torch.equal(site(q), want)
        assert outer.seen == [(1, 2, 5, 4)] * 2 and inner.seen == [(1, 2, 3, 4)]
        compiled = torch.compile(site, fullgraph=True, backend="eager")  # one graph
        assert torch.equal(compiled(q), want) and len(outer.seen) == 3
    finally:
        _route.remove_route(site.inner)
        _route.remove_route(site)
    assert "attention" not in site.__dict__ and torch.equal(site(q), want)
    assert len(outer.seen) == 3 and not outer.homes


def test_a_route_installs_inside_an_accelerate_hook_added_before_apply() -> None:
    """accelerate's hook holds a ``forward`` of its own and calls the module's as
    ``_old_forward``: the copy goes there, so the hook still runs around the
    route (before, the site ran under a per-call mode); ``remove`` puts the
    bound forward back, under the hook."""
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    from attnres.integrations import _route

    class Counting(ModelHook):  # type: ignore[misc]
        calls = 0

        def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return args, kwargs

    site, q, hook, route = _Spelled(), torch.randn(1, 2, 5, 4), Counting(), _Recording()
    add_hook_to_module(site, hook)
    want = site(q)
    _route.install_route(site, route)  # type: ignore[arg-type]
    assert site.__dict__["_old_forward"] is not None
    assert getattr(site._old_forward, "__func__", None) is not _Spelled.forward
    assert torch.equal(site(q), want) and route.seen == [(1, 2, 5, 4)] and hook.calls == 2
    assert _route.remove_route(site)
    assert site._old_forward.__func__ is _Spelled.forward and site._old_forward.__self__ is site
    assert torch.equal(site(q), want) and hook.calls == 3 and len(route.seen) == 1
    remove_hook_from_module(site)
    assert torch.equal(site(q), want) and hook.calls == 3


def test_the_mha_route_runs_inside_an_accelerate_hook_added_before_apply() -> None:
    """A ``MultiheadAttention`` under accelerate's hook: its route is built where
    the hook calls the forward (``_old_forward``), so the hook still runs (it
    moves weights and inputs where offloading puts them) and the decided kernel
    runs inside it."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from attnres.integrations import diffusers as idf

    class Counting(ModelHook):  # type: ignore[misc]
        calls = 0

        def pre_forward(self, module: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return args, kwargs

    torch.manual_seed(0)
    holder, hook = torch.nn.Module(), Counting()
    holder.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 5, 8)
    want = holder.attn(x, x, x, need_weights=False)[0]
    add_hook_to_module(holder.attn, hook)
    idf.apply({"vae": holder}, _explicit("eager"), Platform.detect())
    try:
        assert getattr(holder.attn._old_forward, "__func__", None) is None  # the route's
        (route,) = idf.routes({"vae": holder}).values()
        ran: list[int] = []

        def counted(kernel: Any) -> Any:
            return lambda *args: ran.append(1) or kernel(*args)

        route.kernels = {key: k and counted(k) for key, k in route.kernels.items()}
        got = holder.attn(x, x, x, need_weights=False)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert hook.calls == 1 and ran == [1]  # the hook ran, and the decided kernel
    finally:
        idf.remove({"vae": holder})
    mha = torch.nn.MultiheadAttention.forward
    assert holder.attn._old_forward.__func__ is mha and hook.calls == 1
    assert torch.equal(holder.attn(x, x, x, need_weights=False)[0], want) and hook.calls == 2


def _logged(forward: Any) -> Any:
    @functools.wraps(forward)
    def logged(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    return logged


class _Decorated(torch.nn.Module):
    """Calls SDPA from a decorated forward: the decorator's function calls it
    from its closure, where no copy can reach."""

    def __init__(self, facts: bool) -> None:
        super().__init__()
        if facts:
            self.heads, self.head_dim = 2, 4

    @_logged
    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


class _Attended(torch.nn.Module):
    """Reaches SDPA through an attribute of its class: its code names no SDPA,
    and no global leads to it (before, no site at all: an explicit flag left it
    on torch's SDPA without a word)."""

    attend = staticmethod(torch.nn.functional.scaled_dot_product_attention)

    def __init__(self, facts: bool) -> None:
        super().__init__()
        if facts:
            self.heads, self.head_dim = 2, 4

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.attend(q, q, q)


def _bert() -> Any:
    from transformers import BertConfig, BertModel

    config = BertConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8,
        vocab_size=20,
    )  # fmt: skip
    return BertModel(config).eval()


@pytest.mark.parametrize("facts", [True, False], ids=["head facts", "decided at first call"])
@pytest.mark.parametrize("library", ["diffusers", "transformers"])
@pytest.mark.parametrize("kind", [_Decorated, _Attended])
def test_a_call_no_copy_can_take_is_a_pin_that_falls_back_or_is_refused(
    facts: bool, library: str, kind: type
) -> None:
    """Planned as a pin to what its code runs, with the reason in its route: a
    relaxed component falls back (bit-identical), a strict one refuses the
    flag, typed; nothing runs under a mode. In a module of its own (the
    diffusers integration's sites) and in a transformers model."""
    from attnres.errors import ResolutionError
    from attnres.integrations import IntegrationError
    from attnres.integrations import diffusers as idf

    q = torch.randn(1, 2, 5, 4)
    for component, relaxed in (("vae", True), ("transformer", False)):
        holder = torch.nn.Module() if library == "diffusers" else _bert()
        holder.attn = kind(facts)
        want = holder.attn(q)
        plan = idf.plan({component: holder}, _explicit("eager"), Platform.detect())
        (site,) = [s for s in plan.sites if s.name == "attn"]
        why = "decorator" if kind is _Decorated else "attribute holding SDPA"
        assert site.kind is RouteKind.PIN and why in site.route
        assert site.current is not None and site.current.name == "torch_sdpa"
        if not relaxed and facts:  # refused at plan time, naming the route
            assert not plan.ok and site.error is not None and why in site.error.message
            with pytest.raises(IntegrationError):
                idf.apply({component: holder}, _explicit("eager"), Platform.detect())
            continue
        idf.apply({component: holder}, _explicit("eager"), Platform.detect())
        try:
            if relaxed:
                assert torch.equal(holder.attn(q), want)
                if not facts:  # its first call was checked, and fell back
                    (route,) = idf.routes({component: holder}).values()
                    (first,) = route.first_calls
                    assert first.backend is not None and first.backend.name == "torch_sdpa"
            else:
                with pytest.raises(ResolutionError):
                    holder.attn(q)
        finally:
            idf.remove({component: holder})
        assert torch.equal(holder.attn(q), want)


# -- a watched site's calls are its own code's, never a nested module's ---------------------------


class _Heads(torch.nn.Module):
    """Attention of its own inside a watched site: SDPA over 4 heads of size 2,
    under a boolean mask."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = x.view(b, s, 4, 2).transpose(1, 2)
        mask = torch.ones(s, s, dtype=torch.bool).tril()
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        return out.transpose(1, 2).reshape(b, s, 8)


class _AroundNested(torch.nn.Module):
    """Softmax attention by hand, one head over its 8 channels, holding no head
    facts (decided at its first call, watched), whose forward first calls a
    nested attention module (:class:`_Heads`)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Heads()
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.inner(x)
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        scores = q @ k.transpose(-1, -2) / 8**0.5
        probs = torch.softmax(scores, dim=-1)
        return probs @ v


def _nested_then_by_hand(attn: Any, x: torch.Tensor) -> torch.Tensor:
    """The nested module's ``forward`` run directly, then softmax attention by hand."""
    x = x + attn.inner.forward(x)
    q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    scores = torch.bmm(q, k.transpose(1, 2)) / 8**0.5
    return torch.bmm(torch.softmax(scores, dim=-1), v)


class _CalledProcessor(torch.nn.Module):
    """A processor that is an ``nn.Module`` with a ``__call__`` of its own (as
    diffusers' IP-adapter and custom diffusion processors)."""

    def __call__(self, attn: Any, x: torch.Tensor) -> torch.Tensor:
        return _nested_then_by_hand(attn, x)


class _ModuleProcessor(torch.nn.Module):
    """A processor that is an ``nn.Module`` called as one (its ``forward``)."""

    def forward(self, attn: Any, x: torch.Tensor) -> torch.Tensor:
        return _nested_then_by_hand(attn, x)


class _HandingOver(torch.nn.Module):
    """A module handing its call to its processor, holding no head facts: the
    processor is the site's own code, however it is called."""

    def __init__(self, processor: torch.nn.Module) -> None:
        super().__init__()
        self.inner = _Heads()
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(8, 8) for _ in range(3))
        self.processor = processor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.processor(self, x)


@pytest.mark.parametrize(
    "kind",
    [
        _AroundNested,
        functools.partial(_HandingOver, _CalledProcessor()),
        functools.partial(_HandingOver, _ModuleProcessor()),
    ],
    ids=["nested module called", "processor's __call__", "processor called as a module"],
)
def test_a_watched_site_reads_its_own_call_not_a_nested_modules(kind: Any) -> None:
    """A by-hand site that holds no head facts is watched at its first call (its
    head facts read from its own scores product): the nested module's SDPA call,
    met first (called as a module, or its ``forward`` run directly), is not the
    site's, and runs untouched. Before, the watch took it as the site's: one head
    of size 8 was recorded (and decided) as 4 heads of size 2 under a boolean
    mask. A graph traced later (no frames to read) passes the nested call by
    too; with no eager call first, it takes it (and refuses, typed)."""
    import torch._dynamo

    from attnres.integrations import diffusers as idf

    torch.manual_seed(0)
    holder, x = torch.nn.Module(), torch.randn(2, 5, 8)
    holder.attn = kind().eval()
    want = holder.attn(x)
    plan = idf.apply({"vae": holder}, _explicit("torch_sdpa"), Platform.detect())
    try:
        (site,) = plan.sites
        assert plan.ok and site.pending and site.kind is RouteKind.OWN_CODE
        (route,) = idf.routes({"vae": holder}).values()
        torch._dynamo.reset()
        whole = torch.compile(holder.attn, fullgraph=True, backend="eager")
        with pytest.raises(Exception, match=r"met a call no decision covers inside torch\.compile"):
            whole(x)  # not run eagerly first
        assert not route.first_calls
        assert torch.equal(holder.attn(x), want)
        (first,) = route.first_calls
        facts = first.facts
        assert (facts.heads, facts.kv_heads, facts.head_size) == (1, 1, 8)
        assert not facts.mask.present and first.backend.name == "eager"
        assert first.trace.outcome.reason == "softmax attention written by hand"
        torch._dynamo.reset()
        whole = torch.compile(holder.attn, fullgraph=True, backend="eager")
        torch.testing.assert_close(whole(x), want)
        assert len(route.first_calls) == 1  # nothing new, nothing refused
    finally:
        torch._dynamo.reset()
        idf.remove({"vae": holder})
    assert torch.equal(holder.attn(x), want)


# -- the mask's kind is in a call's signature; the kernel table is read under its lock ---------


def _qwen_site(varlen_fakes: Calls) -> tuple[Any, Any, Any]:
    from test_hf_attention import SAGE, STAND_IN, _qwen25vl_text

    from attnres.integrations import _hf_attention
    from attnres.integrations import transformers as itf

    model = _qwen25vl_text()
    plan = itf.apply(model, "text_encoder", SAGE, STAND_IN)
    module = dict(model.named_modules())[plan.sites[0].name]
    route = _hf_attention.bound_route(module)
    assert route is not None
    return model, module, route


@pytest.mark.parametrize("another_thread_compiling", [False, True])
def test_a_later_call_with_another_mask_kind_is_checked(
    varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch, another_thread_compiling: bool
) -> None:
    """A later call of the same signature with another mask kind is checked, not
    run on the first call's kernel. Also while another thread compiles:
    ``torch.compiler.is_compiling()`` is a process-wide flag, and an eager call
    must still classify its own mask and decide its first call, not reuse the
    last call's mask kind nor refuse as if inside a graph."""
    from attnres.integrations import _hf_attention
    from attnres.integrations import transformers as itf

    model, module, route = _qwen_site(varlen_fakes)
    try:
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(2, 4, 5, 16, generator=gen).half()
        kv = torch.randn(2, 2, 5, 16, generator=gen).half()
        padding = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
        causal_padded = torch.ones(5, 5, dtype=torch.bool).tril() & padding[:, None, None, :]
        _hf_attention.attention_forward(module, q, kv, kv, causal_padded)  # the planned kind
        assert len(varlen_fakes.seen) == 1 and not route.first_calls
        # a later call of the same signature but a boolean mask no varlen kernel takes
        # (the queries of a row see different keys): checked, not the first's kernel
        scattered = torch.rand(2, 1, 5, 5, generator=gen) > 0.4
        scattered[..., 0] = True
        if another_thread_compiling:
            monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
            assert torch.compiler.is_compiling() and not torch.compiler.is_dynamo_compiling()
        out, _ = _hf_attention.attention_forward(module, q, kv, kv, scattered)
        monkeypatch.undo()
        (first,) = route.first_calls
        assert "boolean mask" in first.describe() and first.backend.name == "torch_sdpa"
        want = torch.nn.functional.scaled_dot_product_attention(
            q, kv, kv, attn_mask=scattered, enable_gqa=True
        ).transpose(1, 2)
        torch.testing.assert_close(out, want)
        assert len(varlen_fakes.seen) == 1  # sage never saw it
    finally:
        itf.remove(model)


def test_the_kernel_table_is_read_safely_between_threads(varlen_fakes: Calls) -> None:
    import threading

    from attnres.integrations import transformers as itf

    model, _, route = _qwen_site(varlen_fakes)
    try:
        gen = torch.Generator().manual_seed(2)
        q = torch.randn(1, 4, 5, 16, generator=gen).half()
        kv = torch.randn(1, 2, 5, 16, generator=gen).half()
        masks = [None, torch.ones(1, 1, 1, 5, dtype=torch.bool)]
        masks += [torch.rand(1, 1, 5, 5, generator=gen) > 0.3 for _ in range(6)]
        for m in masks[2:]:
            m[..., 0] = True
        start, errors = threading.Barrier(8), []

        def call(mask: Any) -> None:
            try:
                start.wait()
                for _ in range(20):
                    route.kernel_for(q, kv, mask, 0.0, False, None, -3)
            except Exception as exc:
                errors.append(exc)

        threads = [threading.Thread(target=call, args=(m,)) for m in masks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        # one decision per signature, each taken once
        keys = [f.facts.key() for f in route.first_calls]
        assert len(keys) == len(set(keys))
    finally:
        itf.remove(model)


# -- torch's functional multi-head attention is a site -----------------------------------------


def test_hunyuandit_attention_pool_is_a_site_of_its_own_code_path() -> None:
    import tiny_models

    from attnres.errors import IntegrationError
    from attnres.integrations import diffusers as idf

    model, _ = tiny_models.build("HunyuanDiT2DModel")
    name = "time_extra_emb.pooler"  # F.multi_head_attention_forward, SDPA inside torch

    def pooler(comp: str, config: SelectionConfig) -> Any:
        plan = idf.plan({comp: model}, config, Platform.detect())
        (site,) = [s for s in plan.sites if s.name == name]
        return site

    assert pooler("transformer", SelectionConfig()).backend.name == "torch_sdpa"
    # explicit eager: honoured by a fallback that says so, or refused in a strict component
    relaxed = pooler("text_encoder", _explicit("eager"))
    assert relaxed.backend.name == "torch_sdpa" and relaxed.resolution.reason is not None
    assert "multi_head_attention_forward" in relaxed.route
    strict = pooler("transformer", _explicit("eager"))
    assert strict.backend is None and "'eager' is not supported" in str(strict.error)
    with pytest.raises(IntegrationError) as info:  # every other site runs eager
        idf.apply({"transformer": model}, _explicit("eager"), Platform.detect())
    assert all(s.backend is not None for s in info.value.plan.sites if s.name != name)


# -- a routed copy reads the module's globals live ------------------------------------------------


def _rotate(x: torch.Tensor) -> torch.Tensor:
    return x


class _Rotating(torch.nn.Module):
    """A site that calls SDPA itself and a module-level helper of its module."""

    heads, head_dim = 2, 4

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        q = _rotate(q)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def test_a_rebound_forward_sees_a_global_reassigned_after_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # issue 30: rebind copied the module's globals when it installed the route, so
    # a helper the library or the user reassigned later was not seen by the routed
    # copy (the site ran the old helper: an output attnres did not decide)
    import gc

    from attnres.integrations import _route
    from attnres.integrations import diffusers as idf

    holder = torch.nn.Module()
    holder.attn = _Rotating()
    q = torch.randn(1, 2, 5, 4)
    idf.apply({"vae": holder}, _explicit("eager"), Platform.detect())
    route = _route.installed_route(holder.attn)
    assert route is not None and route.homes  # rebound, not run under the mode
    assert all(namespace is globals() for namespace, _ in route.homes)
    monkeypatch.setitem(globals(), "_rotate", lambda x: x * 2)
    with torch.no_grad():
        got = holder.attn(q)
    want = torch.nn.functional.scaled_dot_product_attention(q * 2, q * 2, q * 2)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    added = [key for _, key in route.homes]
    assert all(key in globals() for key in added)
    idf.remove({"vae": holder})  # the names the route added go with it
    assert not any(key in globals() for key in added)
    idf.apply({"vae": holder}, _explicit("eager"), Platform.detect())
    route = _route.installed_route(holder.attn)
    added = [key for _, key in route.homes]
    del holder, route
    gc.collect()  # dropped without remove(): the names go with the module
    assert added and not any(key in globals() for key in added)


# -- a name the code reads both as a global and as an attribute --------------------------------

nn = torch.nn  # a module global named as torch's attribute is (transformers' SAM, Falcon)


class _Spelled(torch.nn.Module):
    """Calls SDPA as ``torch.nn.functional.scaled_dot_product_attention`` in a module
    that also holds ``nn`` as a global: ``nn`` is read as an attribute there."""

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q)


def test_a_global_the_code_also_reads_as_an_attribute_is_rebound_not_moded() -> None:
    """Only what the code loads as a global is stood in (``torch``), so its copy is
    rebound; before, ``nn`` (an attribute there, a global here) made the copy
    impossible and the site ran under the per-call mode (416 sweep sites: SAM,
    Falcon, Granite Speech, Data2Vec vision)."""
    from attnres.integrations import _route

    site, q = _Spelled(), torch.randn(1, 2, 5, 4)
    want = site(q)
    route = _Recording()
    _route.install_route(site, route)  # type: ignore[arg-type]
    try:
        forward = site.__dict__["forward"]
        assert forward.func.__func__.__code__ is not _Spelled.forward.__code__  # a copy
        assert forward.func.__func__.__code__.co_code == _Spelled.forward.__code__.co_code
        assert torch.equal(site(q), want)
        assert route.seen == [(1, 2, 5, 4)]  # its call reached the route
    finally:
        _route.remove_route(site)
        _route._forget_homes(route.homes)  # type: ignore[attr-defined]
    assert torch.equal(site(q), want) and route.seen == [(1, 2, 5, 4)]


def test_remove_keeps_a_wrapper_added_after_install() -> None:
    """A forward wrapped after install (accelerate's hooks, added after ``apply``,
    keep the forward they wrap and call it) stays wrapped after ``remove``; the
    wrapped forward then runs the module's own code, not the route."""
    import functools

    from attnres.integrations import _route

    site, q = _Spelled(), torch.randn(1, 2, 5, 4)
    want = site(q)
    route = _Recording()
    _route.install_route(site, route)  # type: ignore[arg-type]
    hooked: list[int] = []

    def new_forward(module: Any, *args: Any) -> Any:  # as accelerate's add_hook_to_module
        hooked.append(1)
        return module._old_forward(*args)

    site._old_forward = site.forward
    site.forward = functools.partial(new_forward, site)  # type: ignore[method-assign]
    assert torch.equal(site(q), want) and route.seen == [(1, 2, 5, 4)] and hooked == [1]
    assert _route.remove_route(site)
    assert torch.equal(site(q), want)
    assert hooked == [1, 1]  # the wrapper is still there
    assert route.seen == [(1, 2, 5, 4)]  # and the route no longer runs
    _route._forget_homes(route.homes)  # type: ignore[attr-defined]


# -- a call no decision covers, met inside torch.compile -----------------------------------------


class _Masked(torch.nn.Module):
    heads, head_dim = 2, 4

    def forward(self, q: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_call_no_decision_covers_inside_compile_says_what_to_do() -> None:
    """A masked call the plan did not describe, met while dynamo traces: under
    ``fullgraph=True`` torch's error carries attnres's (before, dynamo failed
    first, reading the mask's values: "Could not guard on data-dependent
    expression"); without it the call breaks the graph and is decided eagerly
    (on torch 2.13; the floor's dynamo raises attnres's error there too)."""
    import torch._dynamo

    from attnres.errors import CompiledGraphError
    from attnres.integrations import diffusers as idf

    holder = torch.nn.Module()
    holder.attn = _Masked()
    q, mask = torch.randn(1, 2, 5, 4), torch.ones(5, 5, dtype=torch.bool).tril()
    want = holder.attn(q, mask)
    idf.apply({"vae": holder}, _explicit("eager"), Platform.detect())
    try:
        torch._dynamo.reset()
        whole = torch.compile(holder.attn, fullgraph=True, backend="eager")
        torch.testing.assert_close(
            whole(q), torch.nn.functional.scaled_dot_product_attention(q, q, q)
        )
        with pytest.raises(Exception, match=r"met a call no decision covers inside torch\.compile"):
            whole(q, mask)
        (route,) = idf.routes({"vae": holder}).values()
        assert not route.first_calls  # nothing recorded from inside the graph
        torch._dynamo.reset()
        broken = torch.compile(holder.attn, backend="eager")
        if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13):
            # the floor's dynamo (2.6) does not break the graph at a raise: typed
            with pytest.raises(CompiledGraphError, match=r"met a call no decision covers"):
                broken(q, mask)
            return
        torch.testing.assert_close(broken(q, mask), want)
        (first,) = route.first_calls
        assert first.backend is not None and first.backend.name == "eager"
    finally:
        torch._dynamo.reset()
        idf.remove({"vae": holder})


# -- an applied model, planned again ---------------------------------------------------------------


def test_an_applied_model_plans_and_applies_again_as_it_did() -> None:
    """Planning an applied model (to apply it again, or verify it) reads the routed
    copies as the code they copy: the same sites, kinds and routes. Before, a
    routed processor read as a site no copy can take, and a second apply under
    a flag was refused."""
    from accelerate.hooks import ModelHook, add_hook_to_module
    from tiny_pipelines import unet

    from attnres.integrations import diffusers as idf

    holder = torch.nn.Module()
    holder.through, holder.spelled = _Through(), _Spelled()
    add_hook_to_module(holder.spelled, ModelHook())
    comps, explicit = {"unet": unet(), "vae": holder}, _explicit("eager")

    def seen(plan: Any) -> list[tuple[str, str, RouteKind, str]]:
        return sorted((s.component, s.name, s.kind, s.route) for s in plan.sites)

    first = idf.apply(comps, explicit, Platform.detect())
    try:
        assert {s.kind for s in first.sites} == {RouteKind.INTERCEPT} and len(first.sites) > 2
        assert seen(idf.plan(comps, explicit, Platform.detect())) == seen(first)
        assert seen(idf.apply(comps, explicit, Platform.detect())) == seen(first)
        assert idf.verify(comps) == []
        q = torch.randn(1, 2, 5, 4)
        torch.testing.assert_close(holder.spelled(q), _Spelled.forward(holder.spelled, q))
    finally:
        idf.remove(comps)
