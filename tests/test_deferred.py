"""Softmax attention computed by hand, run by any kernel (issue 19).

A transformers module that computes its attention by hand (Bloom, GPT-Neo,
XLNet, XGLM, GPT-1, ...) gets the deferred-scores route: its code runs as it
is, the scores product is deferred, and the operations on it are read as one
attention call of the decided kernel, checked against the plan before it runs.
What no kernel call expresses is a fact of the call (``own math``).
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import pytest
import torch
import transformers

from attnres import Platform, SelectionConfig
from attnres.errors import ResolutionError
from attnres.integrations import _deferred, _route
from attnres.integrations import transformers as itf

F = torch.nn.functional
HOPPER = Platform.simulate("cuda:sm90+flash_attn+sageattention")
STAND_IN = attrs.evolve(HOPPER, simulated=False)
SAGE = SelectionConfig(global_backend="sage_attn")
SDPA = SelectionConfig(global_backend="torch_sdpa")
STRICT_SDPA = SelectionConfig(global_backend="torch_sdpa")

IDS = torch.tensor([[2, 5, 9, 4, 7, 6, 3], [3, 8, 6, 5, 4, 1, 1]])
MASK = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])


def _tiny(name: str) -> Any:
    """A tiny model with two heads of 16, one layer, from the library's own config."""
    t = transformers
    torch.manual_seed(0)
    common = {"vocab_size": 32}
    if name == "bloom":
        cfg = t.BloomConfig(hidden_size=32, n_head=2, n_layer=1, **common)
        return t.BloomModel(cfg)
    if name == "gpt_neo":
        cfg = t.GPTNeoConfig(hidden_size=32, num_heads=2, num_layers=1,
                             attention_types=[[["global"], 1]], max_position_embeddings=16,
                             **common)  # fmt: skip
        return t.GPTNeoModel(cfg)
    if name == "xglm":
        cfg = t.XGLMConfig(d_model=32, attention_heads=2, num_layers=1, ffn_dim=37,
                           max_position_embeddings=16, **common)  # fmt: skip
        return t.XGLMModel(cfg)
    if name == "xlnet":
        cfg = t.XLNetConfig(d_model=32, n_head=2, n_layer=1, d_inner=37, **common)
        return t.XLNetModel(cfg)
    if name == "openai-gpt":
        cfg = t.OpenAIGPTConfig(n_embd=32, n_head=2, n_layer=1, n_positions=16, **common)
        return t.OpenAIGPTModel(cfg)
    if name == "roformer":
        cfg = t.RoFormerConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                               intermediate_size=37, embedding_size=32, **common)  # fmt: skip
        return t.RoFormerModel(cfg)
    if name == "deberta":
        cfg = t.DebertaConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                              intermediate_size=37, **common)  # fmt: skip
        return t.DebertaModel(cfg)
    raise AssertionError(name)


def _run(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).last_hidden_state


def _valid(out: torch.Tensor) -> torch.Tensor:
    return out[MASK.bool()].double()


ROUTED = ["gpt_neo", "xglm", "openai-gpt", "roformer", "deberta"]


@pytest.mark.parametrize("name", ROUTED)
def test_a_by_hand_site_runs_the_decided_kernel_and_remove_restores(name, monkeypatch):
    model = _tiny(name).eval()
    ref = _run(model)
    plain = itf.apply(model, "text_encoder")
    assert {s.backend.name for s in plain.sites} == {"eager"}  # its own math, kept
    assert all("softmax by hand" in s.route for s in plain.sites)
    assert itf.routes(model) == {}  # nothing wrapped
    assert torch.equal(_run(model), ref)
    itf.remove(model)
    seen = []
    real = _route.get_kernel("torch_sdpa")

    def spy(q, k, v, mask, causal, scale):  # type: ignore[no-untyped-def]
        seen.append((tuple(q.shape), None if mask is None else tuple(mask.shape), scale))
        return real(q, k, v, mask, causal, scale)

    monkeypatch.setattr(_route, "get_kernel", lambda n: spy if n == "torch_sdpa" else real)
    plan = itf.apply(model, "text_encoder", SDPA)
    assert {s.backend.name for s in plan.sites} == {"torch_sdpa"}
    out = _run(model)
    assert len(seen) == len(plan.sites)  # each attention: one kernel call
    assert all(len(q) == 4 for q, _, _ in seen)
    torch.testing.assert_close(_valid(out), _valid(ref), rtol=1e-4, atol=1e-5)
    assert itf.remove(model) == len(plan.sites)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert torch.equal(_run(model), ref)


def test_a_position_bias_is_a_mask_sage_cannot_take(varlen_fakes):
    # Bloom adds ALiBi to its scores (baddbmm): an additive bias, which sage
    # cannot take -- a real limit, typed, at the first call; never a route limit
    model = _tiny("bloom").eval().half()
    with torch.no_grad():
        ref = _run(model)
    plan = itf.apply(model, "transformer", SAGE, STAND_IN)  # strict
    assert {s.backend.name for s in plan.sites} == {"sage_attn"}
    with pytest.raises(ResolutionError, match="additive mask") as err:
        _run(model)
    assert "h.0.self_attention" in str(err.value)
    assert not varlen_fakes.seen
    itf.remove(model)
    # a component that may fall back runs its own math for the call, traced,
    # bit-identical to the untouched model
    itf.apply(model, "text_encoder", SAGE, STAND_IN)
    assert torch.equal(_run(model), ref)
    ((first,),) = [r.first_calls for r in itf.routes(model).values()]
    assert "additive mask" in first.describe() and first.backend.name == "eager"
    assert not varlen_fakes.seen
    itf.remove(model)


@pytest.mark.parametrize("name", ["xglm", "openai-gpt", "roformer"])
def test_under_a_strict_sage_a_by_hand_site_reaches_sage(name, varlen_fakes):
    model = _tiny(name).eval().half()
    with torch.no_grad():
        ref = _run(model)
    plan = itf.apply(model, "transformer", SAGE, STAND_IN)  # strict
    assert {s.backend.name for s in plan.sites} == {"sage_attn"}
    out = _run(model)
    assert len(varlen_fakes.seen) == len(plan.sites)
    got, want = _valid(out), _valid(ref)
    assert float((got - want).norm() / want.norm()) < 5e-3
    itf.remove(model)


# --- reading the code's operations as one attention ---------------------------


class _Runner:
    """Runs each attention read with torch SDPA, recording what it read."""

    def __init__(self) -> None:
        self.read: list[Any] = []

    def __call__(self, found: Any, probs: Any) -> Any:
        self.read.append(found)
        if isinstance(found, str):
            return None
        out = F.scaled_dot_product_attention(
            found.q, found.k, found.v, attn_mask=found.mask, scale=found.scale
        )
        return found.finish(out)


def _qkv(b: int = 2, h: int = 3, s: int = 5, d: int = 8) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    return tuple(torch.randn(b, h, s, d, generator=g) for _ in range(3))


def _both(fn: Any, *args: Any) -> tuple[Any, Any, _Runner]:
    runner = _Runner()
    want = fn(*args)
    with _deferred.DeferScores(runner):
        got = fn(*args)
    return got, want, runner


def _pad_mask(b: int = 2, s: int = 5) -> torch.Tensor:
    keep = torch.ones(b, 1, 1, s, dtype=torch.bool)
    keep[1, ..., -2:] = False
    return keep


def test_scaled_masked_scores_with_dropout_in_eval_are_one_attention() -> None:
    q, k, v = _qkv()
    bias = torch.zeros(2, 1, 1, 5).masked_fill(~_pad_mask(), torch.finfo(torch.float32).min)

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8)
        s = s + bias
        p = F.softmax(s.float(), dim=-1).to(q.dtype)
        p = F.dropout(p, p=0.1, training=False)
        return torch.matmul(p, v)

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert not isinstance(read, str)
    assert read.scale == pytest.approx(1 / math.sqrt(8)) and read.mask.shape == (2, 1, 1, 5)
    torch.testing.assert_close(got, want)


def test_heads_folded_into_the_batch_and_viewed_back_for_the_mask() -> None:
    # BART-era code: bmm over (batch * heads), the mask added under a 4-D view
    q, k, v = (t.reshape(6, 5, 8) for t in _qkv())
    keep = _pad_mask()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.bmm(q * 0.5, k.transpose(1, 2))
        s = s.view(2, 3, 5, 5).masked_fill(~keep, torch.finfo(s.dtype).min).view(6, 5, 5)
        return torch.bmm(s.softmax(-1), v)

    got, want, runner = _both(attn, q, k, v)
    assert not isinstance(runner.read[0], str)
    torch.testing.assert_close(got, want)


def test_baddbmm_with_a_bias_reads_the_bias_as_an_additive_mask() -> None:
    q, k, v = (t.reshape(6, 5, 8) for t in _qkv())
    alibi = torch.randn(6, 1, 5)

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=0.25)
        return torch.bmm(F.softmax(s, dim=-1), v)

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert read.scale == 0.25 and read.mask is not None
    torch.testing.assert_close(got, want)


def test_einsum_with_the_batch_letters_permuted_is_one_attention() -> None:
    # XLNet: (seq, batch, heads, size) in, scores (batch, heads, seq_q, seq_kv)
    q, k, v = (t.permute(2, 0, 1, 3).contiguous() for t in _qkv())

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.einsum("ibnd,jbnd->bnij", q, k) * 0.3
        return torch.einsum("bnij,jbnd->ibnd", torch.softmax(s, dim=3), v)

    got, want, runner = _both(attn, q, k, v)
    assert not isinstance(runner.read[0], str)
    torch.testing.assert_close(got, want)


def test_einsum_with_an_ellipsis_over_blocks_is_one_attention() -> None:
    # LongT5's local attention: (batch, blocks, len, heads, size), scores
    # (batch, blocks, heads, len, 3 * len), a bias added in place
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 3, 4, 2, 8, generator=g)
    k, v = (torch.randn(2, 3, 12, 2, 8, generator=g) for _ in range(2))
    bias = torch.randn(1, 1, 2, 4, 12, generator=g)

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.einsum("...qhd,...khd->...hqk", q, k)
        s += bias
        p = F.softmax(s.float(), dim=-1).type_as(s)
        return torch.einsum("...hqk,...khd->...qhd", p, v)

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert not isinstance(read, str) and read.q.shape == (2, 3, 2, 4, 8)
    torch.testing.assert_close(got, want)
    # an ellipsis for different numbers of dimensions: not read, the code's einsum
    a, b = torch.randn(2, 3, 4, 8), torch.randn(3, 8, 5)
    with _deferred.DeferScores(_Runner()):
        out = torch.einsum("...qd,...dk->...qk", a, b)
    assert type(out) is torch.Tensor and torch.equal(out, torch.einsum("...qd,...dk->...qk", a, b))


def test_a_causal_buffer_read_with_where_and_gpt_s_zero_one_product() -> None:
    q, k, v = _qkv()
    tril = torch.ones(5, 5).tril().view(1, 1, 5, 5)

    def neo(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2))
        low = torch.tensor(torch.finfo(s.dtype).min, dtype=s.dtype, device=s.device)
        s = torch.where(tril.bool(), s, low)
        return torch.matmul(torch.softmax(s, -1), v)

    def gpt(q, k, v):  # type: ignore[no-untyped-def]
        w = torch.matmul(q, k.transpose(-1, -2))
        w = w * tril + -1e4 * (1 - tril)
        return torch.matmul(F.softmax(w, dim=-1), v)

    def zeroed_only(q, k, v):  # type: ignore[no-untyped-def]
        return torch.matmul(F.softmax(torch.matmul(q, k.transpose(-1, -2)) * tril, -1), v)

    for fn in (neo, gpt):
        got, want, runner = _both(fn, q, k, v)
        assert not isinstance(runner.read[0], str), fn.__name__
        torch.testing.assert_close(got, want)
    # zeroed scores that no mask masks: not a mask (the code's own math, exactly)
    got, want, runner = _both(zeroed_only, q, k, v)
    assert runner.read == ["mul by a tensor"]
    assert torch.equal(got, want)


def test_in_place_operations_on_the_scores_are_followed() -> None:
    q, k, v = _qkv()
    keep = _pad_mask()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2))
        s /= 4.0
        s.masked_fill_(~keep, -1e9)
        return torch.matmul(s.softmax(-1), v)

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert not isinstance(read, str) and read.scale == 0.25
    torch.testing.assert_close(got, want)


def test_a_positive_factor_per_head_is_folded_into_the_query() -> None:
    # Swin V2's cosine attention: normalised q and k, times exp(logit_scale) per
    # head (num_heads, 1, 1), then a position bias and a mask
    q, k, v = _qkv()
    logit = torch.tensor([0.5, 1.5, 2.5]).view(3, 1, 1)
    bias = torch.randn(1, 3, 5, 5)

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        s = s * torch.clamp(logit, max=math.log(100.0)).exp()
        s = (s + bias).masked_fill(~_pad_mask(), -1e9) / 2.0  # a factor after the masks
        return F.softmax(s, dim=-1) @ v

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert not isinstance(read, str) and read.scale == 0.5
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("factor", "why"),
    [
        # not positive: masked scores would become the largest
        (torch.tensor([1.0, -1.0, 2.0]).view(3, 1, 1), "mul by a tensor"),
        # varies along the keys: no query scaling expresses it
        (torch.rand(1, 1, 5) + 0.5, "mul by a tensor"),
    ],
)
def test_a_factor_that_is_not_a_positive_row_scale_stays_own_math(factor, why) -> None:
    q, k, v = _qkv()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = (q @ k.transpose(-2, -1)) * factor
        return F.softmax(s.masked_fill(~_pad_mask(), -1e9), dim=-1) @ v

    got, want, runner = _both(attn, q, k, v)
    assert runner.read == [why]
    assert torch.equal(got, want)


def test_scores_viewed_apart_for_a_decomposed_bias_and_viewed_back() -> None:
    # SegGPT / SAM: the positions split into rows and columns, a bias added per
    # row and per column, then the scores viewed back before the softmax
    b, h, rows, cols, d = 2, 3, 2, 3, 8
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b * h, rows * cols, d, generator=g) for _ in range(3))
    rel_h = torch.randn(b * h, rows, cols, rows, generator=g)
    rel_w = torch.randn(b * h, rows, cols, cols, generator=g)

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = (q * d**-0.5) @ k.transpose(-2, -1)
        s = s.reshape(b * h, rows, cols, rows, cols)
        s = s + rel_h[:, :, :, :, None] + rel_w[:, :, :, None, :]
        s = s.reshape(b * h, rows * cols, rows * cols)
        return torch.softmax(s, dim=-1) @ v

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert not isinstance(read, str) and read.mask is not None
    torch.testing.assert_close(got, want)

    def softmax_apart(q, k, v):  # type: ignore[no-untyped-def]
        s = (q @ k.transpose(-2, -1)).reshape(b * h, rows, cols, rows, cols)
        return torch.softmax(s, dim=-1).reshape(b * h, rows * cols, rows * cols) @ v

    got, want, runner = _both(softmax_apart, q, k, v)
    assert runner.read == ["softmax of the scores viewed as [6, 2, 3, 2, 3]"]
    assert torch.equal(got, want)


def test_a_boolean_mask_added_to_the_scores_adds_its_values() -> None:
    # scores + a boolean tensor adds 1.0 where it is True (type promotion); a
    # by-hand site fed the boolean mask of the sdpa mask function does that
    q, k, v = _qkv()
    keep = _pad_mask()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8) + keep
        return torch.matmul(F.softmax(s, dim=-1), v)

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert not isinstance(read, str) and read.mask.dtype == torch.float32
    assert set(read.mask.unique().tolist()) == {0.0, 1.0}  # its values, not a keep mask
    torch.testing.assert_close(got, want)


def test_five_dimensional_scores_are_one_attention() -> None:
    # Hiera's mask units: (batch, heads, windows, tokens, size)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 3, 4, 5, 8, generator=g) for _ in range(3))

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        return ((q * 0.25) @ k.transpose(-1, -2)).softmax(dim=-1) @ v

    got, want, runner = _both(attn, q, k, v)
    (read,) = runner.read
    assert not isinstance(read, str) and read.q.shape == (2, 3, 4, 5, 8)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    ("what", "why"),
    [
        ("pow", "pow of the scores"),
        ("softmax-dim", "softmax over dimension 2"),
        ("head-mask", "mul of the attention probabilities"),
        ("no-softmax", "no softmax of the scores"),
    ],
)
def test_what_no_kernel_call_expresses_is_the_code_s_own_math_exactly(what, why) -> None:
    q, k, v = _qkv()
    head_mask = torch.rand(1, 3, 1, 1)

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2))
        if what == "pow":
            s = s.pow(2)
        if what == "no-softmax":
            return torch.matmul(s, v)
        p = s.softmax(2 if what == "softmax-dim" else -1)
        if what == "head-mask":
            p = p * head_mask
        return torch.matmul(p, v)

    got, want, runner = _both(attn, q, k, v)
    if what == "pow":  # pow computes the scores: the softmax takes real ones
        assert runner.read == []
    else:
        assert runner.read == [why]
    assert torch.equal(got, want)  # the code's own operations, in its order


def test_probabilities_the_code_returns_are_computed_as_its_code_computes_them() -> None:
    q, k, v = _qkv()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / 4, dim=-1)
        return torch.matmul(p, v), p

    (out, probs), (want_out, want_probs), runner = _both(attn, q, k, v)
    # returned deferred (a caller that drops them never pays), computed at their use
    assert isinstance(probs, _deferred.Deferred)
    assert torch.equal(probs * 1, want_probs) and repr(probs) == repr(want_probs)
    torch.testing.assert_close(out, want_out)
    assert not isinstance(runner.read[0], str)


def test_a_product_that_is_not_scores_is_computed_when_used() -> None:
    a, b = torch.randn(2, 4, 6), torch.randn(2, 6, 3)
    with _deferred.DeferScores(_Runner()):
        out = torch.matmul(a, b).permute(0, 2, 1).sum()
    assert type(out) is torch.Tensor and torch.equal(out, torch.matmul(a, b).permute(0, 2, 1).sum())


def _longformer() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LongformerConfig(
        hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=37,
        vocab_size=32, attention_window=4, max_position_embeddings=64, pad_token_id=1,
    )  # fmt: skip
    return transformers.LongformerModel(cfg).eval()


def test_a_forward_whose_attention_the_route_cannot_read_is_a_fact_of_the_call() -> None:
    # Longformer's banded chunks: no product of deferred probabilities and values
    model = _longformer()
    ids = torch.tensor([[2, 5, 9, 4, 7, 6, 3, 8]])
    with torch.no_grad():
        ref = model(input_ids=ids).last_hidden_state
        itf.apply(model, "text_encoder", SDPA)  # may fall back: its own math, traced
        assert torch.equal(model(input_ids=ids).last_hidden_state, ref)
        ((first,),) = [r.first_calls for r in itf.routes(model).values()]
        # what its code did to the deferred scores is named: its chunks padded
        assert first.changed == (
            "own math: no softmax attention the route could read (pad of the scores)",
        )
        assert first.backend.name == "eager"
        itf.remove(model)
        itf.apply(model, "transformer", SDPA)  # strict: typed, naming the site and why
        with pytest.raises(ResolutionError, match="no softmax attention the route could read"):
            model(input_ids=ids)
        itf.remove(model)


class _OtherAxis:
    """A by-hand processor whose softmax normalises the queries' axis."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):  # type: ignore[no-untyped-def]
        q = attn.head_to_batch_dim(attn.to_q(hidden_states))
        k = attn.head_to_batch_dim(attn.to_k(hidden_states))
        v = attn.head_to_batch_dim(attn.to_v(hidden_states))
        p = (torch.bmm(q, k.transpose(1, 2)) * attn.scale).softmax(dim=1)
        return attn.to_out[0](attn.batch_to_head_dim(torch.bmm(p, v)))


def test_own_math_in_a_strict_component_names_what_the_code_did() -> None:
    from diffusers.models.attention_processor import Attention

    from attnres.integrations import diffusers as idf

    torch.manual_seed(0)
    holder = torch.nn.Module()
    holder.attn = Attention(32, heads=2, dim_head=16, processor=_OtherAxis())
    holder.eval()
    x = torch.randn(2, 5, 32)
    ref = holder.attn(x)
    (site,) = idf.apply({"transformer": holder}, SDPA).sites  # strict
    assert site.route == "generic route (softmax by hand in _OtherAxis)"
    with pytest.raises(ResolutionError, match="own math: softmax over dimension 1") as err:
        holder.attn(x)
    assert "the site's own softmax attention by hand" in str(err.value)
    idf.remove({"transformer": holder})
    idf.apply({"vae": holder}, SDPA)  # may fall back: its own math, bit-identical
    assert torch.equal(holder.attn(x), ref)
    idf.remove({"vae": holder})


@pytest.mark.slow
def test_compile_of_an_applied_model_runs_the_route_eagerly_with_the_same_result() -> None:
    model = _tiny("xglm").eval()
    ref = _run(model)
    itf.apply(model, "transformer", SDPA)
    routed = _run(model)
    compiled = torch.compile(model)
    with torch.no_grad():
        out = compiled(input_ids=IDS, attention_mask=MASK).last_hidden_state
    torch.testing.assert_close(_valid(out), _valid(routed), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_valid(out), _valid(ref), rtol=1e-4, atol=1e-5)
    itf.remove(model)


def test_products_of_a_submodule_and_a_softmax_written_out_are_sites() -> None:
    # SqueezeBERT multiplies through a MatMulWrapper submodule: found by what that
    # submodule's code does, and read as one kernel call; Reformer writes its
    # softmax out as exp(x - logsumexp(x)) over chunks: a site, whose chunked
    # attention the route cannot read (its own math, a fact of the call)
    t = transformers
    torch.manual_seed(0)
    squeeze = t.SqueezeBertModel(t.SqueezeBertConfig(
        vocab_size=32, hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
        intermediate_size=37, embedding_size=32, q_groups=1, k_groups=1, v_groups=1,
        post_attention_groups=1, intermediate_groups=1, output_groups=1,
    )).eval()  # fmt: skip
    reformer = t.ReformerModel(t.ReformerConfig(
        vocab_size=32, hidden_size=32, num_attention_heads=2, attention_head_size=16,
        feed_forward_size=37, axial_pos_embds=False, max_position_embeddings=64,
        local_attn_chunk_length=4, attn_layers=["local"], is_decoder=False, pad_token_id=1,
    )).eval()  # fmt: skip
    ids = torch.tensor([[2, 5, 9, 4, 7, 6, 3, 8], [3, 8, 6, 5, 4, 7, 1, 1]])
    mask = (ids != 1).long()
    for model, read in ((squeeze, True), (reformer, False)):
        with torch.no_grad():
            ref = model(input_ids=ids, attention_mask=mask)[0]
            plan = itf.apply(model, "text_encoder", SDPA)
            assert plan.sites and all("softmax by hand" in s.route for s in plan.sites)
            out = model(input_ids=ids, attention_mask=mask)[0]
        firsts = [f for r in itf.routes(model).values() for f in r.first_calls]
        assert firsts and {f.backend.name for f in firsts} == (
            {"torch_sdpa"} if read else {"eager"}
        ), type(model).__name__
        if read:
            torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
        else:
            assert all("own math" in f.describe() for f in firsts)
            assert torch.equal(out, ref)  # its own math, exactly
        itf.remove(model)


@pytest.mark.parametrize("factor", [-1.0, 0.0, float("inf")])
def test_a_scale_that_is_not_positive_and_finite_is_the_code_s_own_math(factor) -> None:
    q, k, v = _qkv()
    keep = _pad_mask()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2)).masked_fill(~keep, -1e9) * factor
        return torch.matmul(s.softmax(-1), v)

    got, want, runner = _both(attn, q, k, v)
    assert runner.read == [f"mul by {factor}"]
    assert torch.equal(got.nan_to_num(), want.nan_to_num())  # its own ops, in its order


# --- issue 30: what the capture does not model is the code's own math ---------


@pytest.mark.parametrize(
    ("write", "why"),
    [
        (lambda s: s.__setitem__((..., 0), 0.5), "__setitem__ of the scores"),
        (lambda s: s.tril_(), "tril_ of the scores"),
        (lambda s: s.clamp_(min=-0.1), "clamp_ of the scores"),
        (lambda s: s.index_fill_(-1, torch.tensor([1]), 2.0), "index_fill_ of the scores"),
        (lambda s: s.copy_(torch.ones(2, 3, 5, 5)), "copy_ of the scores"),
        # followed in place, but a view of them was read before: not followed
        (lambda s: (s.view(6, 5, 5), s.div_(2.0)), "div_ of the scores"),
    ],
)
def test_an_in_place_write_on_the_scores_is_the_code_s_own_math(write, why) -> None:
    q, k, v = _qkv()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8)
        write(s)
        return torch.matmul(s.softmax(-1), v)

    got, want, runner = _both(attn, q, k, v)
    assert runner.read == [why]
    assert torch.equal(got, want)


def test_a_write_after_the_softmax_leaves_the_probabilities_as_the_code_took_them() -> None:
    q, k, v = _qkv()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2))
        p = s.softmax(-1)
        s.tril_()
        return torch.matmul(p, v)

    got, want, runner = _both(attn, q, k, v)
    assert runner.read == ["tril_ of the scores"] and torch.equal(got, want)


def test_a_mask_changed_in_place_after_its_use_is_read_as_the_code_used_it() -> None:
    q, k, v = _qkv()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        bias = torch.zeros(1, 1, 1, 5)
        s = torch.matmul(q, k.transpose(-1, -2)) + bias
        bias[..., 0] = -1e9  # after the code added it
        return torch.matmul(s.softmax(-1), v)

    got, want, runner = _both(attn, q, k, v)
    assert runner.read == [
        "a tensor of shape [1, 1, 1, 5] it read changed in place after its use (__setitem__)"
    ]
    assert torch.equal(got, want)


def test_detach_and_autograd_reads_of_the_scores_are_the_code_s() -> None:
    q, k, v = (t.requires_grad_() for t in _qkv())

    def detached(q, k, v):  # type: ignore[no-untyped-def]
        return torch.matmul(torch.matmul(q, k.transpose(-1, -2)).detach().softmax(-1), v)

    def asks(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2))
        assert s.requires_grad and s.grad_fn is not None and not s.is_leaf
        return torch.matmul(s.softmax(-1), v)

    for fn in (detached, asks):
        got, want, runner = _both(fn, q, k, v)
        assert torch.equal(got, want), fn.__name__
        grads = torch.autograd.grad(got.sum(), (q, k, v), allow_unused=True)
        wants = torch.autograd.grad(want.sum(), (q, k, v), allow_unused=True)
        for g, w in zip(grads, wants, strict=True):
            assert (g is None and w is None) or torch.equal(g, w), fn.__name__
    assert runner.read == ["requires_grad of the scores"]


def test_values_cast_before_the_product_are_the_code_s_own_math() -> None:
    # issue 32 item 12: one kernel call takes one dtype
    q, k, v = _qkv()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)), dim=-1)
        return torch.matmul(p.double(), v.double())

    got, want, runner = _both(attn, q, k, v)
    assert runner.read == ["scores in float32, probabilities in float64, values in float64"]
    assert torch.equal(got, want)


def test_a_mask_expanded_as_the_scores_reads_only_their_shape() -> None:
    # XLM: mask.view(...).expand_as(scores) then masked_fill_: the scores are not
    # computed for it, and the attention is one kernel call
    q, k, v = _qkv()

    def attn(q, k, v):  # type: ignore[no-untyped-def]
        s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(8)
        mask = (~_pad_mask()).expand_as(s)
        s.masked_fill_(mask, torch.finfo(s.dtype).min)
        return torch.matmul(s.softmax(-1), v)

    got, want, runner = _both(attn, q, k, v)
    assert not isinstance(runner.read[0], str)
    torch.testing.assert_close(got, want)
