"""Text encoders on fast kernels (issue 22): attnres's own attention and mask
functions in transformers, selected per model, running the decided kernel with
padding kept. The kernels are the varlen fakes of tests/test_masks.py."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
import transformers
from test_kernels_fakes import Calls
from tiny_pipelines import clip_text_encoder, t5_text_encoder
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from attnres import Platform
from attnres.errors import BackendOptionError
from attnres.integrations import _hf_attention
from attnres.integrations import transformers as itf
from attnres.layer import SelectionConfig

HOPPER = Platform.simulate("cuda:sm90+flash_attn+sageattention")
#: the same facts, installable: the stand-in kernels run them on this CPU
#: (apply refuses a plan made for simulated facts)
STAND_IN = attrs.evolve(HOPPER, simulated=False)
SAGE = SelectionConfig(global_backend="sage_attn", global_backend_explicit=True)


def _qwen25vl_text() -> Any:
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(0)
    config = Qwen2_5_VLTextConfig(
        hidden_size=64, intermediate_size=37, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, vocab_size=64, bos_token_id=0, eos_token_id=1,
        rope_scaling={"type": "default", "mrope_section": [2, 3, 3]},
    )  # fmt: skip
    return Qwen2_5_VLTextModel(config).eval().to(torch.float16)


def _padded(lengths: list[int], seq: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(2, 60, (len(lengths), seq), generator=gen)
    positions = torch.arange(seq)
    counts = torch.tensor(lengths)[:, None]
    mask = positions >= seq - counts if left else positions < counts
    return ids, mask.long()


def _compare(model: Any, ids: torch.Tensor, mask: torch.Tensor, calls: Calls) -> None:
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).last_hidden_state
        plan = itf.apply(model, "text_encoder", SAGE, STAND_IN)
        try:
            assert {s.backend for s in plan.sites} == {"sage_attn"}
            assert model.config._attn_implementation == _hf_attention.NAME
            after = model(input_ids=ids, attention_mask=mask).last_hidden_state
            assert calls.seen, "the sage varlen fake ran"
        finally:
            assert itf.remove(model) >= 1
        assert model.config._attn_implementation == "sdpa"
        valid = mask.bool()
        got, want = after[valid].double(), before[valid].double()
        assert float((got - want).norm() / want.norm()) < 5e-3
        again = model(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.equal(again, before)  # remove restored the untouched model


@pytest.mark.parametrize("left", [False, True])
def test_qwen25vl_text_encoder_with_padding_runs_sage(varlen_fakes: Calls, left: bool) -> None:
    _compare(_qwen25vl_text(), *_padded([9, 4, 6], 9, left), varlen_fakes)


def test_clip_text_encoder_with_padding_runs_sage(varlen_fakes: Calls) -> None:
    model, _ = clip_text_encoder(torch.float16)
    ids, mask = _padded([7, 3], 7, left=False)
    ids[0, 6] = ids[1, 2] = 1  # the eos token CLIP pools at
    _compare(model, ids, mask, varlen_fakes)


def test_clip_plan_names_causal_with_key_padding() -> None:
    model, _ = clip_text_encoder(torch.float16)
    plan = itf.plan(model, "text_encoder", SAGE, HOPPER)
    assert {s.backend for s in plan.sites} == {"sage_attn"}
    assert {s.spec.requirements.mask_kind for s in plan.sites} == {"causal with key padding"}


def test_t5_keeps_torch_sdpa_naming_the_additive_mask() -> None:
    model, _ = t5_text_encoder(torch.float16)
    plan = itf.plan(model, "text_encoder_2", SAGE, HOPPER)
    assert plan.sites and {s.backend for s in plan.sites} == {"torch_sdpa"}
    for site in plan.sites:
        assert site.trace is not None
        failures = [f.message for r in site.trace.records if r.kind == "check" for f in r.failures]
        assert any("does not implement additive masks" in m for m in failures), failures


def test_selection_is_per_model_never_the_process_default(varlen_fakes: Calls) -> None:
    applied = _qwen25vl_text()
    untouched = _qwen25vl_text()
    itf.apply(applied, "text_encoder", SAGE, STAND_IN)
    try:
        assert applied.config._attn_implementation == _hf_attention.NAME
        assert untouched.config._attn_implementation == "sdpa"
        assert _hf_attention.NAME in ALL_ATTENTION_FUNCTIONS
        assert _hf_attention.NAME in ALL_MASK_ATTENTION_FUNCTIONS  # padding never dropped
    finally:
        itf.remove(applied)
    assert not any("_attnres_kernel" in m.__dict__ for m in applied.modules())


def test_the_function_refuses_a_module_attnres_did_not_bind() -> None:
    model = _qwen25vl_text()
    _hf_attention.register()
    model.config._attn_implementation_internal = _hf_attention.NAME
    with pytest.raises(RuntimeError, match="attnres installed no kernel on this module"):
        model(input_ids=torch.tensor([[3, 4]]))


@pytest.mark.parametrize("component", ["text_encoder", "transformer"])
def test_a_call_fact_the_plan_did_not_allow_is_checked_at_the_first_call(
    varlen_fakes: Calls, component: str
) -> None:
    # issue 19: attnres's own attention function checks each call signature's facts
    # against the plan, through the first-call check every routed site uses: a
    # component that may fall back resolves again (traced), a strict one raises
    # ResolutionError naming the site and the fact; sage is never reached with it
    from attnres.errors import ResolutionError

    model = _qwen25vl_text()
    plan = itf.apply(model, component, SAGE, STAND_IN)
    try:
        site = plan.sites[0]
        module = dict(model.named_modules())[site.name]
        route = _hf_attention.bound_route(module)
        assert route is not None and route.name == site.name
        q = torch.randn(1, 4, 5, 16, dtype=torch.float16)
        kv = torch.randn(1, 2, 5, 16, dtype=torch.float16)
        before = len(varlen_fakes.seen)
        if component == "text_encoder":
            torch.manual_seed(0)
            out, _ = _hf_attention.attention_forward(module, q, kv, kv, None, dropout=0.5)
            assert out.shape == (1, 5, 4, 16)
            first = route.first_calls[-1]
            assert "dropout" in first.describe() and first.backend.name == "torch_sdpa"
            assert first.trace.outcome.status == "selected"
        else:
            with pytest.raises(ResolutionError) as info:
                _hf_attention.attention_forward(module, q, kv, kv, None, dropout=0.5)
            assert site.name in str(info.value) and "dropout" in str(info.value)
            assert route.first_calls[-1].error == str(info.value)
        assert len(varlen_fakes.seen) == before  # the kernel never saw the call
        # a custom softmax scale is a fact too (sage takes it: resolved, traced)
        _hf_attention.attention_forward(module, q, kv, kv, None, scaling=0.5)
        assert "custom softmax scale" in route.first_calls[-1].describe()
        assert len(varlen_fakes.seen) == before + 1  # sage ran that one
    finally:
        itf.remove(model)
    assert _hf_attention.bound_route(module) is None


def test_rule_backend_options_reach_the_kernel_through_attnres_function(
    varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 23: options for the decided backend run attnres's own attention function
    (transformers' ``flash_attention_2`` would take none of them); a class that opts
    out of other functions is refused, nothing changed."""
    config = SelectionConfig(
        global_backend="fa", global_backend_explicit=True,
        backend_options={"fa": {"deterministic": True}},
    )  # fmt: skip
    model = _qwen25vl_text()
    ids, mask = _padded([9, 4, 6], 9, left=False)
    with torch.no_grad():
        plan = itf.apply(model, "text_encoder", config, STAND_IN)
        try:
            assert {s.backend for s in plan.sites} == {"fa"}
            assert model.config._attn_implementation == _hf_attention.NAME
            model(input_ids=ids, attention_mask=mask)
        finally:
            itf.remove(model)
    assert varlen_fakes.seen and all(c.get("deterministic") is True for c in varlen_fakes.seen)
    monkeypatch.setattr(type(model), "_supports_attention_backend", False)
    with pytest.raises(BackendOptionError, match="transformers' own attention function") as info:
        itf.plan(model, "text_encoder", config, STAND_IN)  # refused at plan time, naming the site
    assert "attention site 'layers.0.self_attn' of component 'text_encoder'" in str(info.value)
    with pytest.raises(BackendOptionError):
        itf.apply(model, "text_encoder", config, STAND_IN)
    assert model.config._attn_implementation == "sdpa"


def _informer() -> tuple[Any, dict[str, torch.Tensor]]:
    """Informer, tiny: it leaves ``_supports_sdpa`` unset (PreTrainedModel's False)."""
    torch.manual_seed(0)
    cfg = transformers.InformerConfig(
        prediction_length=4, context_length=8, d_model=32, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=37, decoder_ffn_dim=37, lags_sequence=[1, 2], num_time_features=1,
        attention_type="full",
    )  # fmt: skip
    n = cfg.context_length + max(cfg.lags_sequence)
    g = torch.Generator().manual_seed(2)
    inputs = {
        "past_values": torch.randn(2, n, generator=g),
        "past_time_features": torch.randn(2, n, 1, generator=g),
        "past_observed_mask": torch.ones(2, n),
        "future_values": torch.randn(2, 4, generator=g),
        "future_time_features": torch.randn(2, 4, 1, generator=g),
    }
    return transformers.InformerModel(cfg).eval(), inputs


def test_a_class_not_declaring_sdpa_gets_the_masks_its_code_was_written_for() -> None:
    # issue 19 (found by the deferred-scores sweep): sdpa's boolean masks reached
    # code written for eager's additive ones (BigBirdPegasus's by-hand attention
    # adds its mask to the scores) and moved outputs by up to 42%; attnres's
    # function now runs such a class under "attnres_eager_masks"
    assert _hf_attention.name_for(transformers.InformerModel) == _hf_attention.EAGER_MASKS
    assert _hf_attention.name_for(transformers.Qwen2Model) == _hf_attention.NAME
    model, inputs = _informer()
    with torch.no_grad():
        torch.manual_seed(5)
        ref = model(**inputs).last_hidden_state
        plan = itf.apply(model, "transformer", SelectionConfig(global_backend="torch_sdpa"))
        try:
            interface = [s for s in plan.sites if s.route == itf.ROUTE]
            assert interface and {s.backend.name for s in interface} == {"torch_sdpa"}
            assert model.config._attn_implementation == _hf_attention.EAGER_MASKS
            masks = ALL_MASK_ATTENTION_FUNCTIONS[_hf_attention.EAGER_MASKS]
            assert masks is _hf_attention.eager_mask_function
            torch.manual_seed(5)
            out = model(**inputs).last_hidden_state
        finally:
            itf.remove(model)
    assert float((out - ref).norm() / ref.norm()) < 1e-5


# -- a class written for eager's masks: a call without a mask is unmasked --------------------------


def eager_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager function, as a modeling file defines it: no causal flag."""
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


class _EagerOnlyConfig(transformers.PretrainedConfig):
    model_type = "attnres_eager_only"

    def __init__(self, hidden_size: int = 16, num_attention_heads: int = 2, **kwargs: Any) -> None:
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        super().__init__(**kwargs)


class _EagerOnlyAttention(torch.nn.Module):
    """ChineseCLIP's vision attention as transformers 5.0.0 wrote it: no ``is_causal``,
    no mask passed, the query scaled before the call (``scaling=1.0``)."""

    def __init__(self, config: _EagerOnlyConfig) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.q_proj = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = torch.nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2) * self.scale
        key = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        value = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        attention_interface: Any = eager_attention_forward
        if self.config._attn_implementation != "eager":
            attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        out, _ = attention_interface(self, query, key, value, None, dropout=0.0, scaling=1.0)
        return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1))


class _EagerOnlyModel(transformers.PreTrainedModel):
    """Declares no ``_supports_sdpa``: transformers runs it eager."""

    config_class = _EagerOnlyConfig

    def __init__(self, config: _EagerOnlyConfig) -> None:
        super().__init__(config)
        self.layers = torch.nn.ModuleList(_EagerOnlyAttention(config) for _ in range(2))
        self.post_init()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden_states = layer(hidden_states)
        return hidden_states


@pytest.mark.parametrize("flag", ["torch_sdpa", "eager"])
def test_a_class_written_for_eager_masks_runs_a_call_without_a_mask_unmasked(flag: str) -> None:
    # make test-oldest found it: under SDPA's rule a missing mask and a module without
    # is_causal read as causal, and ChineseCLIP's vision tower moved (error 2.2)
    torch.manual_seed(0)
    model = _EagerOnlyModel(_EagerOnlyConfig()).eval()
    assert model.config._attn_implementation == "eager"
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        want = model(x)
    plan = itf.apply(model, "transformer", SelectionConfig(global_backend=flag))
    try:
        assert [s.backend.name for s in plan.sites] == [flag, flag]
        expected = {"eager": "eager", "torch_sdpa": _hf_attention.EAGER_MASKS}[flag]
        assert model.config._attn_implementation == expected
        with torch.no_grad():
            got = model(x)
    finally:
        itf.remove(model)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_remove_after_apply_again_leaves_no_binding_of_the_first_apply(
    varlen_fakes: Calls,
) -> None:
    # the first apply binds each site to attnres's function (sage); applied again
    # with torch_sdpa, the config names transformers' sdpa and the bindings are
    # unused; remove() restores the untouched model: no binding is left behind
    model = _qwen25vl_text()
    itf.apply(model, "text_encoder", SAGE, STAND_IN)
    assert any(_hf_attention.bound_route(m) for m in model.modules())
    sdpa = SelectionConfig(global_backend="torch_sdpa", global_backend_explicit=True)
    itf.apply(model, "text_encoder", sdpa, STAND_IN)
    assert model.config._attn_implementation == "sdpa"
    itf.remove(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any(_hf_attention.bound_route(m) for m in model.modules())


def test_apply_again_leaves_only_the_bindings_its_own_install_needs(varlen_fakes: Calls) -> None:
    # applied again with transformers' sdpa, the config no longer ran attnres's
    # function but every module kept the first apply's binding (its route) until
    # remove(); applied again with attnres's function, each site is bound anew
    model = _qwen25vl_text()
    ids, mask = _padded([9, 4, 6], 9, left=False)

    def out() -> torch.Tensor:
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).last_hidden_state

    def bound() -> dict[str, Any]:
        return {n: _hf_attention.bound_route(m) for n, m in model.named_modules()}

    untouched = out()
    plan = itf.apply(model, "text_encoder", SAGE, STAND_IN)
    first, sites = bound(), {s.name for s in plan.sites}
    assert {n for n, r in first.items() if r is not None} == sites and len(sites) == 2
    sage = out()
    sdpa = SelectionConfig(global_backend="torch_sdpa", global_backend_explicit=True)

    def fails(*args: Any) -> None:
        raise RuntimeError("a later step fails")

    with pytest.MonkeyPatch.context() as patch:  # failed, it leaves the bindings as they were
        patch.setattr(itf, "_govern", fails)
        with pytest.raises(RuntimeError, match="a later step fails"):
            itf.apply(model, "text_encoder", sdpa, STAND_IN)
    assert bound() == first and torch.equal(out(), sage)
    itf.apply(model, "text_encoder", sdpa, STAND_IN)
    assert model.config._attn_implementation == "sdpa" and itf.verify(model) == []
    assert not any(bound().values())
    assert torch.equal(out(), untouched)
    itf.apply(model, "text_encoder", SAGE, STAND_IN)
    again = bound()
    assert {n for n, r in again.items() if r is not None} == sites
    assert all(again[n] is not first[n] for n in sites)  # routes of its own
    assert torch.equal(out(), sage)
    assert itf.remove(model) == len(sites)
    assert not any(bound().values()) and torch.equal(out(), untouched)
