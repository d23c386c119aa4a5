"""Own code paths made sites with a route (issue 19, item 1).

- ``torch.nn.MultiheadAttention``: its own math (in-projection, heads split,
  the decided kernel, out-projection) for batch-first or not, kdim/vdim,
  ``key_padding_mask`` (a key-padding mask), ``attn_mask``, unbatched inputs
  and ``is_causal``; ``need_weights=True`` is a call fact only its own path
  serves (falls back, traced, or a strict ``ResolutionError``);
  ``add_bias_kv``/``add_zero_attn`` keep the own path, and a request for
  another kernel is a typed error naming the fact.
- diffusers' legacy ``AttnProcessor`` (``get_attention_scores`` + ``bmm``):
  the pair runs as one call of the decided kernel.

With no flag nothing is wrapped and the output is bit-identical; ``remove``
restores the module; ``torch.compile(fullgraph=True)`` still captures one graph.
"""

from __future__ import annotations

import pytest
import tiny_pipelines as tp
import torch
from diffusers.models.attention_processor import Attention, AttnProcessor

from attnres import Platform, SelectionConfig
from attnres.errors import IntegrationError, ResolutionError
from attnres.integrations import _route
from attnres.integrations import diffusers as idf
from attnres.integrations._plan import RouteKind
from attnres.kernels import get_kernel

SIM = "cuda:sm90+flash_attn+sageattention"
EAGER = SelectionConfig(global_backend="eager")
SDPA = SelectionConfig(global_backend="torch_sdpa")


class _Holder(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn


def _spy(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[int, ...]]:
    """Record each call of ``name``'s kernel the route makes (its q shape)."""
    seen: list[tuple[int, ...]] = []
    real = get_kernel(name)
    assert real is not None

    def spy(q, k, v, attn_mask, causal, scale):  # type: ignore[no-untyped-def]
        seen.append(tuple(q.shape))
        return real(q, k, v, attn_mask, causal, scale)

    monkeypatch.setattr(_route, "get_kernel", lambda n: spy if n == name else get_kernel(n))
    return seen


# --- torch.nn.MultiheadAttention ---------------------------------------------

_MHA_CASES = {
    "seq-first": ({}, {}),
    "batch-first": ({"batch_first": True}, {}),
    "kdim-vdim": ({"kdim": 24, "vdim": 20}, {}),
    "no-bias": ({"bias": False, "batch_first": True}, {}),
    "key-padding": ({"batch_first": True}, {"key_padding_mask": True}),
    "attn-mask-bool": ({}, {"attn_mask": "bool"}),
    "attn-mask-float-and-padding": (
        {"batch_first": True},
        {"attn_mask": "float", "key_padding_mask": True},
    ),
    "causal": ({"batch_first": True}, {"attn_mask": "causal", "is_causal": True}),
    "unbatched": ({}, {"unbatched": True}),
}


def _mha_call(mha: torch.nn.MultiheadAttention, how: dict) -> tuple[tuple, dict]:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(1)
    batch, seq_q, seq_kv = 2, 5, 7
    kdim, vdim = mha.kdim, mha.vdim
    if how.get("attn_mask") == "causal":
        seq_kv = seq_q

    def t(seq: int, dim: int) -> torch.Tensor:
        if how.get("unbatched"):
            return torch.randn(seq, dim, generator=g)
        shape = (batch, seq, dim) if mha.batch_first else (seq, batch, dim)
        return torch.randn(*shape, generator=g)

    args = (t(seq_q, mha.embed_dim), t(seq_kv, kdim), t(seq_kv, vdim))
    kwargs: dict = {"need_weights": False}  # type: ignore[type-arg]
    mask = how.get("attn_mask")
    if how.get("key_padding_mask"):
        pad = torch.zeros(batch, seq_kv, dtype=torch.bool)
        pad[1, -3:] = True  # True: not attended (torch's convention)
        if mask == "float":  # torch wants both masks of one type
            pad = torch.zeros(batch, seq_kv).masked_fill(pad, float("-inf"))
        kwargs["key_padding_mask"] = pad
    if mask == "bool":
        kwargs["attn_mask"] = torch.rand(seq_q, seq_kv, generator=g) > 0.7
        kwargs["attn_mask"][:, 0] = False  # every query sees a key
    elif mask == "float":
        kwargs["attn_mask"] = torch.randn(seq_q, seq_kv, generator=g)
    elif mask == "causal":
        kwargs["attn_mask"] = torch.ones(seq_q, seq_kv, dtype=torch.bool).triu(1)
        kwargs["is_causal"] = True
    return args, kwargs


@pytest.mark.parametrize("case", sorted(_MHA_CASES))
def test_mha_runs_the_decided_kernel_through_its_own_math(case, monkeypatch):
    build, how = _MHA_CASES[case]
    torch.manual_seed(0)
    model = _Holder(torch.nn.MultiheadAttention(32, 4, **build)).eval()
    args, kwargs = _mha_call(model.attn, how)
    ref, _ = model.attn(*args, **kwargs)
    # no flag: what torch runs there is kept, nothing wrapped, bit-identical
    plain = idf.apply({"transformer": model})
    (site,) = plain.sites
    assert site.backend.name == "torch_sdpa" and site.routed
    assert "forward" not in model.attn.__dict__
    assert torch.equal(model.attn(*args, **kwargs)[0], ref)
    # an explicit eager, strict: the MHA route runs the eager kernel
    seen = _spy(monkeypatch, "eager")
    plan = idf.apply({"transformer": model}, EAGER)
    assert {s.backend.name for s in plan.sites} == {"eager"}
    out, weights = model.attn(*args, **kwargs)
    assert weights is None and len(seen) == 1 and seen[0][-2:] == (4, 8)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    (route,) = idf.routes({"transformer": model}).values()
    if how.get("key_padding_mask") and not how.get("attn_mask"):
        (first,) = route.first_calls  # a mask the plan did not describe: key padding
        assert "key-padding mask" in first.describe() and first.backend.name == "eager"
    assert idf.remove({"transformer": model}) == 1
    assert "forward" not in model.attn.__dict__
    assert torch.equal(model.attn(*args, **kwargs)[0], ref)


def test_mha_returning_its_weights_falls_back_or_raises_naming_the_fact():
    torch.manual_seed(0)
    flex = SelectionConfig(global_backend="flex_attention")
    for comp in ("vae", "transformer"):  # may fall back / strict
        model = _Holder(torch.nn.MultiheadAttention(64, 4, batch_first=True)).eval()
        x = torch.randn(2, 5, 64)
        ref_out, ref_weights = model.attn(x, x, x)  # need_weights=True: torch's default
        plan = idf.apply({comp: model}, flex)
        assert plan.sites[0].backend.name == "flex_attention"
        (route,) = idf.routes({comp: model}).values()
        if comp == "vae":
            out, weights = model.attn(x, x, x)
            assert torch.equal(out, ref_out) and torch.equal(weights, ref_weights)
            (first,) = route.first_calls
            assert "attention weights returned (need_weights=True)" in first.describe()
            assert first.backend.name == "eager" and first.error is None
            assert first.trace.input.layer.exact_route == _route.WEIGHTS_ROUTE
            assert first.trace.input.layer.requirements.weights
            # issue 30: only its own code runs it, which computes softmax attention
            # by hand (torch's own math returns the weights): the machine's reason
            assert first.trace.outcome.reason == "softmax attention written by hand"
        else:
            with pytest.raises(ResolutionError) as info:
                model.attn(x, x, x)
            text = str(info.value)
            assert "attn" in text and "need_weights=True" in text and "transformer" in text
            # issue 19: the weights named as the kernel's limit (a requirement)
            assert info.value.code == "requirement_unmet"
            assert "does not implement returning the attention weights" in text
        idf.remove({comp: model})


def test_mha_with_add_bias_kv_keeps_its_own_path_and_says_which_fact():
    model = _Holder(torch.nn.MultiheadAttention(32, 4, add_bias_kv=True)).eval()
    plain = idf.plan({"transformer": model})
    assert plain.ok and plain.sites[0].backend.name == "torch_sdpa"
    sage = idf.plan(
        {"transformer": model.to(torch.bfloat16)},
        SelectionConfig(global_backend="sage_attn"),
        Platform.simulate(SIM),
    )
    (site,) = sage.sites
    assert site.error is not None and site.error.code == "not_in_supported_set"
    assert "add_bias_kv" in site.error.message
    zero = _Holder(torch.nn.MultiheadAttention(32, 4, add_zero_attn=True))
    assert "add_zero_attn" in idf.plan({"vae": zero}).sites[0].route


def test_mha_under_a_global_sage_on_a_simulated_hopper_gets_sage():
    model = _Holder(torch.nn.MultiheadAttention(64, 2)).eval().to(torch.bfloat16)
    plan = idf.plan(
        {"transformer": model}, SelectionConfig(global_backend="sage_attn"), Platform.simulate(SIM)
    )
    assert plan.ok and plan.sites[0].backend.name == "sage_attn"


# --- diffusers' AttnProcessor: get_attention_scores + bmm --------------------


def _by_hand_unet():
    unet = tp.unet()
    unet.set_attn_processor(AttnProcessor())
    return unet


def test_by_hand_processor_runs_its_own_code_under_any_flag_and_remove_restores():
    # issue 30, choice (a): softmax attention written by hand runs its own code;
    # a flag in a component that may fall back is decided eager, saying why
    unet = _by_hand_unet()
    x = tp.unet_inputs()
    ref = unet(**x).sample
    procs = [m.processor for m in unet.modules() if hasattr(m, "processor")]
    plain = idf.apply({"vae": unet})
    assert {s.backend.name for s in plain.sites} == {"eager"}  # its own code, kept
    assert {s.route for s in plain.sites} == {_route.by_hand_route("AttnProcessor")}
    assert {s.kind for s in plain.sites} == {RouteKind.OWN_CODE}
    assert idf.routes({"vae": unet}) == {}
    assert torch.equal(unet(**x).sample, ref)
    plan = idf.apply({"vae": unet}, SDPA)
    assert {(s.backend.name, str(s.resolution.reason)) for s in plan.sites} == {
        ("eager", "softmax attention written by hand")
    }
    assert idf.routes({"vae": unet}) == {}  # nothing wrapped
    assert torch.equal(unet(**x).sample, ref)
    assert idf.remove({"vae": unet}) == len(plan.sites)
    assert [m.processor for m in unet.modules() if hasattr(m, "processor")] == procs
    assert torch.equal(unet(**x).sample, ref)


def test_by_hand_under_a_strict_global_sage_is_refused_typed_naming_why():
    # 0.2/0.3: a typed route error; 0.4: sage ran there (the by-hand route); issue
    # 30: no kernel is offered there, so a strict flag is refused at plan time
    model = _Holder(Attention(128, heads=2, dim_head=64, processor=AttnProcessor()))
    config = SelectionConfig(global_backend="sage_attn")
    plan = idf.plan(
        {"transformer": model.eval().to(torch.bfloat16)}, config, Platform.simulate(SIM)
    )
    assert not plan.ok and "softmax attention written by hand" in str(plan.sites[0].error)
    with pytest.raises(IntegrationError, match="softmax attention written by hand"):
        idf.apply({"transformer": model}, config)


@pytest.mark.slow
def test_compile_fullgraph_of_own_path_routes():
    torch.manual_seed(0)
    mha = _Holder(torch.nn.MultiheadAttention(32, 4, batch_first=True)).eval()
    x = torch.randn(2, 5, 32)
    ref = mha.attn(x, x, x, need_weights=False)[0]
    idf.apply({"transformer": mha}, EAGER)
    mha.attn(x, x, x, need_weights=False)  # decided outside the graph
    torch._dynamo.reset()
    compiled = torch.compile(mha.attn, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(x, x, x, need_weights=False)[0], ref, rtol=1e-5, atol=1e-5)


def test_siglip_pooling_head_asking_for_weights_is_planned_on_its_own_path():
    # a MultiheadAttention inside a transformers model (SigLIP's pooling head): its
    # caller leaves need_weights at torch's default (True), read from the caller's
    # source, so the plan says before anything runs that only its own path (eager
    # math) serves it: eager is admitted, a strict flex_attention is a typed plan
    # error naming the fact (never a first-call crash), nothing is installed there
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from attnres.integrations import transformers as itf

    config = SiglipVisionConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=2,
        image_size=8, patch_size=4,
    )  # fmt: skip
    torch.manual_seed(0)
    model = SiglipVisionModel(config).eval()
    x = torch.randn(1, 3, 8, 8)
    ref = model(pixel_values=x).pooler_output
    head = dict(model.named_modules())["head.attention"]
    plain = itf.apply(model, "image_encoder")
    site = {s.name: s for s in plain.sites}["head.attention"]
    assert site.backend.name == "eager" and _route.WEIGHTS_ROUTE in site.route
    assert "SiglipMultiheadAttentionPoolingHead.forward" in site.route
    assert "forward" not in head.__dict__  # nothing wrapped with no flag
    assert torch.equal(model(pixel_values=x).pooler_output, ref)
    itf.remove(model)
    plan = itf.apply(model, "image_encoder", EAGER)
    assert {s.backend.name for s in plan.sites} == {"eager"}
    torch.testing.assert_close(model(pixel_values=x).pooler_output, ref, rtol=1e-5, atol=1e-5)
    assert _route.installed_route(head) is None and "forward" not in head.__dict__
    # the encoder's site and the head's, which ran its own path (both were decided,
    # and both ledger entries go)
    assert itf.remove(model) == 2
    strict = idf.plan({"transformer": model}, SelectionConfig(global_backend="flex_attention"))
    rejected = {s.name: s for s in strict.sites}["head.attention"]
    assert rejected.error is not None
    # issue 19: returning the weights is a kernel limit (a requirement only eager
    # implements), named as such: not a supported set that hides why
    assert rejected.error.code == "requirement_unmet"
    assert "does not implement returning the attention weights" in str(rejected.error)
    assert "need_weights left at its default (True)" in str(rejected.error)
    assert rejected.spec is not None and rejected.spec.requirements.weights


class _Caller(torch.nn.Module):
    """Calls its MultiheadAttention in the way ``how`` says (source read by the plan)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(32, 4, batch_first=True)


class _Default(_Caller):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.attn(x, x, x)[0]


class _AskTrue(_Caller):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.attn(x, x, x, need_weights=True)[0]


class _AskFalse(_Caller):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.attn(x, x, x, need_weights=False)[0]


class _AskVariable(_Caller):
    def forward(self, x, weights=False):  # type: ignore[no-untyped-def]
        return self.attn(x, x, x, need_weights=weights)[0]


def test_mha_caller_asking_for_weights_is_read_from_the_callers_source():
    asked = {
        cls.__name__: _route.mha_weights_asked(cls(), "attn")
        for cls in (_Default, _AskTrue, _AskFalse, _AskVariable)
    }
    asked["_Holder"] = _route.mha_weights_asked(_Holder(_Caller().attn), "attn")
    assert "left at its default (True)" in (asked["_Default"] or "")
    assert "need_weights True" in (asked["_AskTrue"] or "")
    # need_weights=False, a value decided at the call, or no call in the holder's
    # own code: nothing known before the call (its first call checks it)
    assert asked["_AskFalse"] is None and asked["_AskVariable"] is None
    assert asked["_Holder"] is None
    # the plan follows: under an explicit eager on a strict component, the default
    # caller's site keeps its own path (nothing installed); the others are routed
    x = torch.randn(2, 5, 32)
    for cls, routed in ((_Default, False), (_AskFalse, True), (_AskVariable, True)):
        model = cls().eval()
        ref = model(x)
        plan = idf.apply({"transformer": model}, EAGER)
        (site,) = plan.sites
        assert site.backend.name == "eager", cls.__name__
        assert ("forward" in model.attn.__dict__) == routed, cls.__name__
        assert (_route.WEIGHTS_ROUTE in site.route) != routed, cls.__name__
        torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
        assert idf.remove({"transformer": model}) == 1  # its one site, pinned or routed
        assert "forward" not in model.attn.__dict__


class _Storing:
    """A by-hand processor that keeps the probabilities (as attention-map pipelines'
    processors do): the scores are used besides ``bmm``, so it is not routed."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):  # type: ignore[no-untyped-def]
        query = attn.head_to_batch_dim(attn.to_q(hidden_states))
        key = attn.head_to_batch_dim(attn.to_k(hidden_states))
        value = attn.head_to_batch_dim(attn.to_v(hidden_states))
        probs = attn.get_attention_scores(query, key, attention_mask)
        self.last = probs
        out = attn.batch_to_head_dim(torch.bmm(probs, value))
        return attn.to_out[0](out)


def test_a_by_hand_processor_that_keeps_its_probabilities_runs_its_own_code():
    # issue 30: its stored probabilities are what its code computed, under any flag
    torch.manual_seed(0)
    processor = _Storing()
    model = _Holder(Attention(32, heads=2, dim_head=16, processor=processor)).eval()
    (site,) = idf.plan({"vae": model}).sites
    assert site.by_hand and site.route == _route.by_hand_route("_Storing")
    x = torch.randn(2, 5, 32)
    ref = model.attn(x)
    probs = processor.last.clone()
    idf.apply({"vae": model}, SDPA)
    assert torch.equal(model.attn(x), ref) and torch.equal(processor.last, probs)
    assert idf.remove({"vae": model}) == 1 and torch.equal(model.attn(x), ref)


def test_a_decided_weights_call_runs_the_own_path_without_projecting_twice(monkeypatch):
    model = _Holder(torch.nn.MultiheadAttention(64, 4, batch_first=True)).eval()
    idf.apply({"vae": model}, SelectionConfig(global_backend="flex_attention"))
    x = torch.randn(2, 5, 64)
    model.attn(x, x, x)  # the first call decides the signature (its own path)
    projected = []
    real = _route._mha_projections
    monkeypatch.setattr(_route, "_mha_projections", lambda *a: projected.append(1) or real(*a))
    ref = model.attn(x, x, x)
    assert projected == [] and ref[1] is not None
    with torch.no_grad():  # flex attention has no backward on CPU
        model.attn(x, x, x, need_weights=False)  # the flex signature projects, once
    assert projected == [1]
    idf.remove({"vae": model})


class _ByHandNoFacts(torch.nn.Module):
    """A module handing its call to a processor that computes softmax attention by
    hand, holding no head count or head size (one head over the channels, as a
    VAE's attention block): issue 19, decided at its first call."""

    def __init__(self) -> None:
        super().__init__()
        self.to_q, self.to_k, self.to_v = (torch.nn.Linear(8, 8) for _ in range(3))
        self.processor = _ByHandProcessor()

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.processor(self, x)


class _ByHandProcessor:
    def __call__(self, attn, x):  # type: ignore[no-untyped-def]
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        scores = torch.bmm(q, k.transpose(1, 2)) / 8**0.5
        return torch.bmm(torch.softmax(scores, dim=-1), v)


def test_a_by_hand_processor_with_no_head_facts_is_decided_at_its_first_call() -> None:
    # issue 19: was unclassified (a strict component refused it, even with no flag);
    # issue 30: its own code runs it under any flag; under a flag its first call is
    # watched (head facts read, nothing run but its code), which decides it
    model = _Holder(_ByHandNoFacts()).eval()
    x = torch.randn(2, 5, 8)
    ref = model.attn(x)
    plain = idf.plan({"transformer": model})
    assert plain.ok
    (site,) = plain.sites
    assert site.pending and site.route == _route.by_hand_route("_ByHandProcessor")
    # with no flag: untouched (nothing installed, its own code)
    applied = idf.apply({"transformer": model})
    assert applied.ok and idf.routes({"transformer": model}) == {}
    assert "forward" not in model.attn.__dict__ and torch.equal(model.attn(x), ref)
    assert idf.remove({"transformer": model}) == 1
    for component, config, reason in (
        ("transformer", EAGER, None),
        ("vae", SDPA, "softmax attention written by hand"),
    ):
        applied = idf.apply({component: model}, config)
        assert torch.equal(model.attn(x), ref)
        (route,) = idf.routes({component: model}).values()
        (first,) = route.first_calls
        assert (first.facts.heads, first.facts.head_size) == (1, 8)
        assert first.backend.name == "eager" and first.error is None
        assert first.trace.outcome.reason == reason
        assert applied.ok and idf.remove({component: model}) == 1
        assert "forward" not in model.attn.__dict__ and torch.equal(model.attn(x), ref)
    # a strict flag: refused, typed, at that first call (nothing computed)
    idf.apply({"transformer": model}, SDPA)
    with pytest.raises(ResolutionError, match="softmax attention written by hand"):
        model.attn(x)
    idf.remove({"transformer": model})


def test_a_sliced_by_hand_processor_runs_its_own_code():
    # SlicedAttnProcessor computes get_attention_scores + bmm per slice of the
    # batch-times-heads rows: softmax attention written by hand, its own code
    from diffusers.models.attention_processor import SlicedAttnProcessor

    unet = tp.unet()
    unet.set_attn_processor(SlicedAttnProcessor(slice_size=1))
    x = tp.unet_inputs()
    with torch.no_grad():
        ref = unet(**x).sample
        plain = idf.apply({"vae": unet})
        assert {s.route for s in plain.sites} == {_route.by_hand_route("SlicedAttnProcessor")}
        assert idf.routes({"vae": unet}) == {}  # no flag: its own code, nothing wrapped
        assert torch.equal(unet(**x).sample, ref)
        plan = idf.apply({"vae": unet}, SDPA)
        assert idf.routes({"vae": unet}) == {}
        assert torch.equal(unet(**x).sample, ref)
    assert idf.remove({"vae": unet}) == len(plan.sites)
