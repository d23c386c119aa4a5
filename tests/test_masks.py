"""Mask kinds (issue 22): the vocabulary, the catalogue's claims, the checks, the
observed-kind classifier and the unpad -> varlen kernel -> pad route.

The varlen kernels are fakes with the real signatures (sources in the adapter
modules: flash-attn ``flash_attn_varlen_func``, FA3's, SageAttention's
``sageattn_varlen``): int32 contiguous ``cu_seqlens`` where the real kernel
needs them, packed (total, heads, head_size) tensors, fp16/bf16 only, head
sizes and GQA divisibility as the real ones check. They compute in float64 and
cast back; the route's output is compared with the float64 reference
(tests/reference.py) on every valid row, and padded rows must be zeros.
"""

from __future__ import annotations

import itertools
import sys
import types
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference import reference
from test_kernels_fakes import (
    Calls,
    _fake_core,
    fake_flash_attn,
    fake_flash_attn_interface,
    fake_sageattention,
)

import attnres
from attnres import Attention, LayerSpec, Platform, ResolutionError, resolve
from attnres._varlen import (
    MaskKindError,
    clear_varlen_cache,
    is_prefix,
    observe_mask,
    pad,
    padded_kernel,
    route_kernel,
    unpad,
)
from attnres._vocab import CausalAlignment, MaskKind, MaskRoute
from attnres.backends import BackendSpec, MaskSupport, get_spec, registered_backends
from attnres.kernels import clear_kernel_cache, get_kernel
from attnres.layer import Requirements, SelectionConfig
from attnres.trace import MASK_SCHEMA_VERSION, trace_from_json

HOPPER = Platform.simulate("cuda:sm90+flash_attn+flash_attn_interface+sageattention")
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.5e-2, torch.float32: 1e-5}

# ------------------------------------------------------------------ fakes


def _check_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor
) -> tuple[list[int], list[int]]:
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise RuntimeError("varlen q, k, v must be (total, nheads, headdim)")
    if q.shape[1] % k.shape[1] != 0:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    starts_q, starts_k = cu_q.tolist(), cu_k.tolist()
    if len(starts_q) != len(starts_k) or starts_q[-1] != q.shape[0] or starts_k[-1] != k.shape[0]:
        raise RuntimeError("cu_seqlens do not match the packed tensors")
    return starts_q, starts_k


def _per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts_q: list[int],
    starts_k: list[int],
    scale: float | None,
    causal: bool,
) -> torch.Tensor:
    out = torch.empty_like(q)
    factor = q.shape[-1] ** -0.5 if scale is None else scale
    for i in range(len(starts_q) - 1):
        qs, ks = slice(starts_q[i], starts_q[i + 1]), slice(starts_k[i], starts_k[i + 1])
        assert ks.stop > ks.start, "fake: a sequence of no keys (real kernels: unspecified)"
        out[qs] = _fake_core(
            q[qs].unsqueeze(0), k[ks].unsqueeze(0), v[ks].unsqueeze(0),
            scale=factor, causal="bottom_right" if causal else None,
        )[0]  # fmt: skip
    return out


def fake_fa3(calls: Calls) -> types.ModuleType:
    """FA3 (hopper/flash_attn_interface.py): the dense fake plus the varlen signature."""

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        seqused_q: torch.Tensor | None = None,
        seqused_k: torch.Tensor | None = None,
        softmax_scale: float | None = None,
        causal: bool = False,
        qv: torch.Tensor | None = None,
        q_descale: torch.Tensor | None = None,
        k_descale: torch.Tensor | None = None,
        v_descale: torch.Tensor | None = None,
        window_size: tuple[int, int] = (-1, -1),
        attention_chunk: int = 0,
        softcap: float = 0.0,
        num_splits: int = 1,
        pack_gqa: bool | None = None,
        deterministic: bool = False,
        sm_margin: int = 0,
        return_attn_probs: bool = False,
    ) -> Any:
        calls.seen.append({"causal": causal, "cu_seqlens_k": cu_seqlens_k})
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
        for cu in (cu_seqlens_q, cu_seqlens_k):
            if cu.dtype != torch.int32 or not cu.is_contiguous():
                raise RuntimeError("cu_seqlens must be contiguous int32")
        starts_q, starts_k = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        out = _per_sequence(q, k, v, starts_q, starts_k, softmax_scale, causal)
        return (out, None) if return_attn_probs else out

    module = fake_flash_attn_interface(calls, always_tuple=False)
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    return module


def fake_sage(calls: Calls) -> types.ModuleType:
    """sageattention/core.py ``sageattn_varlen`` (Triton): fp16/bf16, head <= 128,
    cu_seqlens int32 or int64 and contiguous, causal only with qo_len == kv_len."""

    def sageattn_varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        is_causal: bool = False,
        sm_scale: float | None = None,
        smooth_k: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        calls.seen.append({"is_causal": is_causal, **kwargs})
        assert q.dtype in [torch.float16, torch.bfloat16], (
            "Input tensors must be in dtype of torch.float16 or torch.bfloat16"
        )
        assert q.dtype == k.dtype == v.dtype, "All tensors must have the same dtype."
        if q.size(-1) > 128:
            raise ValueError(f"Unsupported head_dim: {q.size(-1)}")
        assert cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous(), (
            "cu_seqlens_q and cu_seqlens_k must be contiguous."
        )
        assert cu_seqlens_q.dtype in (torch.int32, torch.int64)
        starts_q, starts_k = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if is_causal:
            lengths_q = [b - a for a, b in itertools.pairwise(starts_q)]
            lengths_k = [b - a for a, b in itertools.pairwise(starts_k)]
            assert lengths_q == lengths_k, "fake: is_causal only when qo_len == kv_len"
        return _per_sequence(q, k, v, starts_q, starts_k, sm_scale, is_causal)

    module = fake_sageattention(calls)
    module.sageattn_varlen = sageattn_varlen  # type: ignore[attr-defined]
    return module


# ------------------------------------------------------------------ vocabulary


def test_requirements_name_the_mask_kind() -> None:
    assert Requirements().mask_kind == "none"
    assert Requirements(causal=True).mask_kind == "causal"
    padded = Requirements.of(["causal", "key_padding"])
    assert (padded.mask, padded.attn_mask) == (MaskKind.KEY_PADDING, True)
    assert padded.mask_kind == "causal with key padding"
    assert Requirements.of(["additive"]).mask_kind == "additive mask"
    assert Requirements.of(["bottom_right"]).mask_kind == "causal (bottom-right)"


def test_legacy_attn_mask_means_any_boolean_or_additive_mask() -> None:
    legacy = Requirements(attn_mask=True)
    assert legacy.mask is MaskKind.ANY
    assert legacy == Requirements(mask="any")
    assert not legacy.extended  # a 0.2 trace says it


def test_two_mask_kinds_for_one_layer_is_an_error() -> None:
    with pytest.raises(ValueError, match="two mask kinds, 'additive' and 'key_padding'"):
        Requirements.of(["additive", "key_padding"])
    with pytest.raises(ValueError, match="mask: unknown mask kind 'padded'"):
        Requirements(mask="padded")


def test_a_mask_kind_trace_is_schema_4_and_round_trips() -> None:
    spec = LayerSpec(128, "bf16", requirements=["key_padding"], name="joint")
    config = SelectionConfig(global_backend="sage_attn", global_backend_explicit=True)
    trace = resolve(spec, config=config, platform=HOPPER).trace
    assert trace.schema_version == MASK_SCHEMA_VERSION
    doc = trace.to_dict()
    assert doc["input"]["layer"]["requirements"]["mask"] == "key_padding"
    again = trace_from_json(trace.to_json())
    assert again == trace and again.input.layer.requirements.mask is MaskKind.KEY_PADDING


def test_a_version_3_trace_cannot_carry_a_mask_kind() -> None:
    spec = LayerSpec(128, "bf16", requirements=["key_padding"])
    trace = resolve(spec, platform=HOPPER).trace
    text = trace.to_json().replace('"schema_version": 4', '"schema_version": 3')
    with pytest.raises(attnres.TraceFormatError, match="requirements in schema version 3"):
        trace_from_json(text)


def test_a_legacy_layer_still_writes_the_old_schema() -> None:
    trace = resolve(LayerSpec(128, "bf16", requirements=["attn_mask"]), platform=HOPPER).trace
    assert trace.schema_version == 2
    assert "mask" not in trace.to_dict()["input"]["layer"]["requirements"]


# ------------------------------------------------------------------ catalogue and checks


def test_every_mask_claim_has_a_source_and_unpad_claims_a_varlen_adapter() -> None:
    for spec in registered_backends():
        for support in spec.masks:
            assert support.source, (spec.name, support.kind)
            if support.route is MaskRoute.UNPAD:
                assert spec.varlen_kernel is not None


def test_the_unpad_claims_are_the_tested_ones() -> None:
    """A new unpad claim must join the numerics below (this fails until it does)."""
    unpads = {
        s.name for s in registered_backends() if any(m.route is MaskRoute.UNPAD for m in s.masks)
    }
    assert unpads == set(UNPAD_BACKENDS)


def test_mask_support_rejects_unpadding_anything_but_key_padding() -> None:
    with pytest.raises(ValueError, match="only key padding can be taken by unpadding"):
        MaskSupport(MaskKind.ADDITIVE, MaskRoute.UNPAD, "x")
    with pytest.raises(ValueError, match="needs a varlen_kernel"):
        BackendSpec(
            name="no_varlen", sparse=False, platforms=("cuda",), dtypes=("float16",),
            masks=(MaskSupport("key_padding", "unpad", "x"),),
        )  # fmt: skip


def _strict(backend: str, requires: list[str], role: str = "self") -> Any:
    spec = LayerSpec(128, "bf16", requirements=requires, role=role, name="site")
    config = SelectionConfig(global_backend=backend, global_backend_explicit=True)
    return resolve(spec, config=config, platform=HOPPER)


@pytest.mark.parametrize("backend", ["sage_attn", "fa", "fa3"])
def test_rule_key_padding_is_taken_by_unpadding(backend: str) -> None:
    resolution = _strict(backend, ["causal", "key_padding"])
    assert resolution.backend.name == backend


@pytest.mark.parametrize("kind", ["additive", "boolean"])
def test_rule_a_varlen_kernel_rejects_other_mask_kinds_naming_them(kind: str) -> None:
    with pytest.raises(ResolutionError) as info:
        _strict("sage_attn", [kind])
    message = str(info.value)
    assert f"does not implement {kind} masks" in message
    assert f"the layer's mask kind is {kind} mask" in message
    assert "takes key-padding masks by unpadding" in message


def test_rule_legacy_attn_mask_keeps_the_0_2_message() -> None:
    with pytest.raises(ResolutionError, match=r"'sage_attn' does not implement attention masks$"):
        _strict("sage_attn", ["attn_mask"])


def test_rule_a_kernel_with_no_mask_and_no_varlen_takes_no_key_padding() -> None:
    platform = Platform.simulate("cuda:sm120+sageattn3")
    spec = LayerSpec(128, "bf16", requirements=["key_padding"])
    config = SelectionConfig(global_backend="sage_attn_3", global_backend_explicit=True)
    with pytest.raises(ResolutionError, match=r"key-padding masks \(.*no mask at all\)"):
        resolve(spec, config=config, platform=platform)


def test_rule_native_mask_kernels_take_every_kind() -> None:
    for kind in ("key_padding", "boolean", "additive"):
        assert _strict("torch_sdpa", [kind]).backend.name == "torch_sdpa"


def test_rule_bottom_right_causal_cross_attention() -> None:
    assert _strict("fa", ["bottom_right"], role="cross").backend.name == "fa"
    with pytest.raises(ResolutionError, match="bottom-right aligned causal cross-attention"):
        _strict("torch_sdpa", ["bottom_right"], role="cross")
    with pytest.raises(ResolutionError, match="no varlen adapter"):
        _strict("fa4", ["bottom_right"], role="cross")


# ------------------------------------------------------------------ observing a mask


def _padding(lengths: list[int], seq: int, left: bool = False) -> torch.Tensor:
    """(batch, seq) valid keys: a prefix of each length (right padding) or a suffix."""
    positions = torch.arange(seq)
    counts = torch.tensor(lengths)[:, None]
    return positions >= seq - counts if left else positions < counts


def test_observe_key_padding_right_and_left() -> None:
    for left in (False, True):
        valid = _padding([5, 3, 0], 5, left=left)
        seen = observe_mask(valid[:, None, None, :], 3, 5, 5)
        assert seen.kind is MaskKind.KEY_PADDING and not seen.causal
        assert torch.equal(seen.valid, valid)


def test_observe_transformers_additive_padding_is_key_padding() -> None:
    valid = _padding([4, 2], 4)
    additive = torch.zeros(2, 1, 4, 4).masked_fill(
        ~valid[:, None, None, :], torch.finfo(torch.float32).min
    )
    seen = observe_mask(additive, 2, 4, 4)
    assert (seen.kind, seen.causal) == (MaskKind.KEY_PADDING, False)


def test_observe_ltx_minus_10000_bias_is_key_padding() -> None:
    valid = _padding([4, 2], 4)
    bias = (1 - valid.float()) * -10000.0  # diffusers' LTX / LTX-2
    seen = observe_mask(bias[:, None, None, :], 2, 4, 4)
    assert seen.kind is MaskKind.KEY_PADDING and torch.equal(seen.valid, valid)
    assert observe_mask((1 - valid.float())[:, None, None, :] * -100.0, 2, 4, 4).kind is (
        MaskKind.ADDITIVE
    )


def test_observe_chroma_query_and_key_padding_is_key_padding() -> None:
    valid = _padding([4, 2], 4)
    both = valid[:, None, None, :] & valid[:, None, :, None]  # Chroma's outer product
    seen = observe_mask(both, 2, 4, 4)
    assert (seen.kind, seen.causal) == (MaskKind.KEY_PADDING, False)
    assert torch.equal(seen.valid, valid)


def _refiner_mask(valid: torch.Tensor) -> torch.Tensor:
    """HunyuanVideo's token refiner (diffusers 0.42.1): query-and-key padding, then
    every query also sees the first token (no fully masked row)."""
    keep = valid[:, None, None, :] & valid[:, None, :, None]
    keep[:, :, :, 0] = True
    return keep


def test_observe_padded_queries_that_see_a_valid_key_is_key_padding() -> None:
    """A padded query may see any valid keys (the unpad route drops it: zeros)."""
    valid = _padding([4, 2], 4)
    seen = observe_mask(_refiner_mask(valid), 2, 4, 4)
    assert (seen.kind, seen.causal) == (MaskKind.KEY_PADDING, False)
    assert torch.equal(seen.valid, valid)


def test_observe_a_padded_key_some_valid_query_sees_is_not_key_padding() -> None:
    """Left padding under the refiner's rule: every query sees the padded first
    token, which the padded query 0 sees alone -- packing it would change what
    the valid queries attend to, so the mask is boolean."""
    seen = observe_mask(_refiner_mask(_padding([4, 2], 4, left=True)), 2, 4, 4)
    assert seen.kind is MaskKind.BOOLEAN


def test_observe_causal_with_key_padding() -> None:
    valid = _padding([4, 2], 4)
    keep = valid[:, None, None, :] & torch.ones(4, 4, dtype=torch.bool).tril()
    seen = observe_mask(keep, 2, 4, 4)
    assert (seen.kind, seen.causal, seen.words) == (
        MaskKind.KEY_PADDING,
        True,
        "causal with key padding",
    )


def test_observe_padding_in_the_middle_is_key_padding_not_a_prefix() -> None:
    """Qwen-Image's joint mask: [text valid, text padding, image valid]."""
    valid = torch.tensor([[True, True, False, True, True], [True, True, True, True, True]])
    seen = observe_mask(valid[:, None, None, :], 2, 5, 5)
    assert seen.kind is MaskKind.KEY_PADDING and torch.equal(seen.valid, valid)
    assert not is_prefix(valid)
    assert is_prefix(_padding([5, 2], 5)) and not is_prefix(_padding([5, 2], 5, left=True))


def test_observe_queries_that_see_different_keys_is_boolean() -> None:
    keep = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    keep[0, 0, 1, 3] = False
    seen = observe_mask(keep, 1, 4, 4)
    assert seen.kind is MaskKind.BOOLEAN
    assert "the queries of a row see different keys" in seen.detail


def test_observe_bias_and_per_head_masks() -> None:
    assert observe_mask(torch.randn(1, 2, 3, 3), 1, 3, 3).kind is MaskKind.ADDITIVE
    per_head = torch.ones(1, 2, 3, 3, dtype=torch.bool)
    per_head[0, 1, :, 2] = False
    assert observe_mask(per_head, 1, 3, 3).kind is MaskKind.BOOLEAN
    assert observe_mask(None, 1, 3, 3).kind is MaskKind.NONE


def test_unpad_pad_round_trip_and_cu_seqlens() -> None:
    x = torch.randn(3, 5, 2, 4)
    valid = _padding([5, 0, 2], 5, left=True)
    packed = unpad(x, valid)
    assert packed.cu_seqlens.dtype == torch.int32 and packed.cu_seqlens.is_contiguous()
    assert packed.cu_seqlens.tolist() == [0, 5, 7]  # the empty row leaves no sequence
    assert packed.max_seqlen == 5
    back = pad(packed.packed, packed.indices, 3, 5)
    assert torch.equal(back, x * valid[:, :, None, None])


# ------------------------------------------------------------------ numerics

UNPAD_BACKENDS = ("fa", "fa3", "sage_attn")


def _route(backend: str) -> Any:
    spec = get_spec(backend)
    dense = get_kernel(backend)
    assert dense is not None
    return route_kernel(spec, dense, MaskKind.KEY_PADDING)


def _check(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    causal: bool,
    marks_queries: bool = False,
) -> None:
    """Computed rows match the float64 reference; the rest are zeros (docs/masks.md):
    a key-padding mask every query shares computes every query of a row that has
    a valid key; a causal one, or one that marks the padded queries
    (``marks_queries``), drops the padded queries of self-attention."""
    batch, seq_q = q.shape[:2]
    mask = valid[:, None, None, :]
    ref = reference(q, k, v, mask, causal)
    has_keys = valid.any(dim=1)
    drops = seq_q == k.shape[1] and (causal or marks_queries)
    rows = valid if drops else has_keys[:, None].expand(batch, seq_q)
    rows = rows & has_keys[:, None]
    tolerance = TOLERANCE[q.dtype]
    got, want = out.double()[rows], ref[rows]
    if got.numel():
        assert float((got - want).norm() / want.norm()) < tolerance
    assert torch.all(out[~rows] == 0)


def _qkv(
    batch: int, seq_q: int, seq_kv: int, heads: int, kv_heads: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq_q, heads, 64, generator=gen).to(dtype)
    k = torch.randn(batch, seq_kv, kv_heads, 64, generator=gen).to(dtype)
    v = torch.randn(batch, seq_kv, kv_heads, 64, generator=gen).to(dtype)
    return q, k, v


CASES = {
    # name: (lengths, seq_q, seq_kv, heads, kv_heads, left, causal)
    "right-padding": ([7, 4, 1], 7, 7, 4, 4, False, False),
    "left-padding": ([7, 4, 1], 7, 7, 4, 4, True, False),
    "fully-padded-row": ([6, 0, 3], 6, 6, 4, 4, False, False),
    "padding-in-the-middle": ("joint", 9, 9, 4, 2, False, False),
    "causal-padding-in-the-middle": ("joint", 9, 9, 4, 4, False, True),
    "gqa": ([5, 2], 5, 5, 8, 2, True, False),
    "causal-right": ([6, 3], 6, 6, 4, 2, False, True),
    "causal-left": ([6, 3], 6, 6, 4, 4, True, True),
    "cross-attention": ([9, 2, 0], 4, 9, 4, 4, False, False),
    "cross-left-gqa": ([9, 5], 3, 9, 4, 1, True, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("backend", UNPAD_BACKENDS)
def test_unpad_route_matches_the_float64_reference(
    varlen_fakes: Calls, backend: str, case: str
) -> None:
    lengths, seq_q, seq_kv, heads, kv_heads, left, causal = CASES[case]
    if lengths == "joint":  # [text (5, padded to 2 and 4), image (4, all valid)]
        valid = torch.cat([_padding([2, 4, 0], 5), torch.ones(3, 4, dtype=torch.bool)], dim=1)
    else:
        valid = _padding(lengths, seq_kv, left=left)
    q, k, v = _qkv(valid.shape[0], seq_q, seq_kv, heads, kv_heads, torch.float16, 3)
    out = _route(backend)(q, k, v, valid[:, None, None, :], causal, None)
    assert out.shape == q.shape and out.dtype == q.dtype
    _check(out, q, k, v, valid, causal)
    assert varlen_fakes.seen, "the varlen kernel ran"


@pytest.mark.parametrize("backend", ["torch_sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("kind", ["key_padding", "boolean", "additive"])
def test_native_mask_kernels_match_the_reference(backend: str, kind: str) -> None:
    assert get_spec(backend).mask_support(MaskKind(kind)) is not None
    q, k, v = _qkv(2, 16, 16, 4, 2, torch.float32, 5)
    valid = _padding([16, 9], 16, left=True)
    if kind == "key_padding":
        mask: torch.Tensor = valid[:, None, None, :]
    elif kind == "boolean":
        mask = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(1)) > 0.3
        mask[..., 0] = True  # no empty row (SDPA: NaN)
    else:
        mask = torch.randn(2, 4, 16, 16, generator=torch.Generator().manual_seed(2))
    kernel = get_kernel(backend)
    assert kernel is not None
    out = kernel(q, k, v, mask, False, None)
    ref = reference(q, k, v, mask, False)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    backend=st.sampled_from(UNPAD_BACKENDS),
    cross=st.booleans(),
    causal=st.booleans(),
    left=st.booleans(),
    group=st.sampled_from([1, 2, 4]),
)
def test_unpad_route_property(
    data: st.DataObject, backend: str, cross: bool, causal: bool, left: bool, group: int
) -> None:
    batch = data.draw(st.integers(1, 4))
    seq_kv = data.draw(st.integers(1, 12))
    seq_q = data.draw(st.integers(1, 12)) if cross else seq_kv
    causal = causal and seq_q == seq_kv
    lengths = data.draw(st.lists(st.integers(0, seq_kv), min_size=batch, max_size=batch))
    q, k, v = _qkv(
        batch, seq_q, seq_kv, 4, 4 // group, torch.bfloat16, data.draw(st.integers(0, 2**31))
    )
    valid = _padding(lengths, seq_kv, left=left)
    if data.draw(st.booleans()):  # any set of valid keys (padding in the middle)
        cells = st.lists(st.booleans(), min_size=batch * seq_kv, max_size=batch * seq_kv)
        valid = torch.tensor(data.draw(cells)).reshape(batch, seq_kv)
    with _installed():
        out = _route(backend)(q, k, v, valid[:, None, None, :], causal, 0.2)
    ref_scale_out = reference(q, k, v, valid[:, None, None, :], causal, 0.2)
    # a shared key-padding mask computes every query; causal ties query i to key i
    rows = valid if causal else valid.any(1, keepdim=True).expand(batch, seq_q)
    rows = rows & valid.any(1, keepdim=True)
    if rows.any():
        got, want = out.double()[rows], ref_scale_out[rows]
        assert float((got - want).norm() / want.norm()) < TOLERANCE[torch.bfloat16]
    assert torch.all(out[~rows] == 0)


class _installed:
    """The fakes for one Hypothesis example (function-scoped fixtures do not reset)."""

    def __enter__(self) -> None:
        self.saved = {n: sys.modules.get(n) for n in ("flash_attn", "flash_attn_interface",
                                                      "sageattention")}  # fmt: skip
        calls = Calls()
        sys.modules["flash_attn"] = fake_flash_attn(calls)
        sys.modules["flash_attn_interface"] = fake_fa3(calls)
        sys.modules["sageattention"] = fake_sage(calls)
        clear_kernel_cache()
        clear_varlen_cache()

    def __exit__(self, *exc: object) -> None:
        for name, module in self.saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        clear_kernel_cache()
        clear_varlen_cache()


def test_route_refuses_a_mask_of_another_kind_naming_it(varlen_fakes: Calls) -> None:
    q, k, v = _qkv(1, 4, 4, 2, 2, torch.float16, 0)
    per_query = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    per_query[0, 0, 1, 3] = False
    with pytest.raises(MaskKindError, match="this call's mask is boolean mask") as info:
        _route("sage_attn")(q, k, v, per_query, False, None)
    assert info.value.observed == "boolean mask"
    with pytest.raises(MaskKindError, match="additive mask"):
        _route("fa")(q, k, v, torch.randn(1, 1, 4, 4), False, None)


def test_route_without_a_mask_runs_the_dense_kernel() -> None:
    seen: list[str] = []

    def dense(*args: Any, **kw: Any) -> torch.Tensor:
        seen.append("dense")
        return args[0]

    def never() -> Any:
        raise AssertionError("no varlen kernel is built for a call with no mask")

    route = padded_kernel("x", dense, never)
    q = torch.zeros(1, 2, 1, 8)
    assert route(q, q, q, None, False, None) is q and seen == ["dense"]


def test_bottom_right_causal_cross_runs_the_varlen_kernel(varlen_fakes: Calls) -> None:
    q, k, v = _qkv(2, 3, 7, 2, 2, torch.float16, 4)
    route = route_kernel(get_spec("fa"), get_kernel("fa"), MaskKind.NONE,  # type: ignore[arg-type]
                         CausalAlignment.BOTTOM_RIGHT)  # fmt: skip
    out = route(q, k, v, None, True, None)
    bottom_right = torch.ones(3, 7, dtype=torch.bool).tril(7 - 3)
    ref = reference(q, k, v, bottom_right, False)
    assert float((out.double() - ref).norm() / ref.norm()) < TOLERANCE[torch.float16]


# ------------------------------------------------------------------ attnres.Attention


def test_attention_layer_with_key_padding_runs_sage_varlen(varlen_fakes: Calls) -> None:
    layer = Attention(
        4, 64, num_kv_heads=2, dtype=torch.float16, requirements=["key_padding"],
        backend="sage_attn", platform=HOPPER, name="joint",
    )  # fmt: skip
    assert layer.backend is not None and layer.backend.name == "sage_attn"
    q, k, v = _qkv(3, 8, 8, 4, 2, torch.float16, 9)
    valid = _padding([8, 5, 0], 8, left=True)
    out = layer(q, k, v, valid[:, None, None, :])
    _check(out, q, k, v, valid, False)
    assert varlen_fakes.seen and "attn_mask" not in varlen_fakes.seen[0]


@pytest.mark.parametrize("backend", UNPAD_BACKENDS)
def test_unpad_route_takes_chroma_and_transformers_4d_masks(
    varlen_fakes: Calls, backend: str
) -> None:
    """Query-and-key padding (Chroma) and causal with padding (transformers' 4-D
    masks) are key padding: valid rows match the reference, padded rows are zeros."""
    valid = _padding([6, 3], 6, left=True)
    q, k, v = _qkv(2, 6, 6, 4, 2, torch.float16, 11)
    tril = torch.ones(6, 6, dtype=torch.bool).tril()
    for mask, causal in (
        (valid[:, None, None, :] & valid[:, None, :, None], False),
        (valid[:, None, None, :] & tril, True),
    ):
        out = _route(backend)(q, k, v, mask, False, None)
        _check(out, q, k, v, valid, causal, marks_queries=True)
