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
    fake_aiter,
    fake_flash_attn,
    fake_flash_attn_cute,
    fake_flash_attn_interface,
    fake_sageattention,
)

import attnres
from attnres import Attention, LayerSpec, Platform, ResolutionError, resolve
from attnres._varlen import (
    PLANS_KEPT,
    MaskKindError,
    clear_varlen_cache,
    is_prefix,
    mask_plan,
    observe_mask,
    pack,
    packing,
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


Runs = list[tuple[int, int]]  # (first token, one past the last) of each sequence


def _check_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    seqused_q: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    longest: tuple[int | None, int | None] = (None, None),
) -> tuple[Runs, Runs]:
    """The sequences the kernel reads: ``cu[i]:cu[i + 1]``, or with ``seqused``
    (FA3/FA4: hopper/seqlen.h, flash_attn/cute/seqlen_info.py) the ``seqused[i]``
    tokens from ``cu[i]`` on. dtype, contiguity and shape of ``seqused`` are
    checked by each fake with its kernel's own message."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise RuntimeError("varlen q, k, v must be (total, nheads, headdim)")
    if q.shape[1] % k.shape[1] != 0:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    if len(cu_q) != len(cu_k):
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k have different batch sizes")
    runs = []
    sides = ((cu_q, seqused_q, q.shape[0], longest[0]), (cu_k, seqused_k, k.shape[0], longest[1]))
    for cu, used, total, most in sides:
        starts = cu.tolist()
        if used is None:
            if starts[-1] != total:
                raise RuntimeError("cu_seqlens do not match the packed tensors")
            ends = starts[1:]
        else:
            ends = [a + n for a, n in zip(starts, used.tolist(), strict=False)]
        pairs = list(zip(starts[:-1], ends, strict=True))
        # what the kernel reads must lie in the tensor (it would read past the end),
        # and the sequences must not overlap (the output rows would be written twice)
        inside = all(0 <= a <= b <= total for a, b in pairs)
        if not inside or any(b > a2 for (_, b), (a2, _) in itertools.pairwise(pairs)):
            raise RuntimeError("fake: sequences outside the tensor or overlapping")
        if most is not None and any(b - a > most for a, b in pairs):
            raise RuntimeError("fake: a sequence longer than max_seqlen (the grid is sized by it)")
        runs.append(pairs)
    return runs[0], runs[1]


def _per_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    runs_q: Runs,
    runs_k: Runs,
    scale: float | None,
    causal: bool,
) -> torch.Tensor:
    # the real kernels allocate the output empty: rows no sequence covers are left
    # unwritten, NaN here so that a route which forgets them fails
    out = torch.full(q.shape[:2] + v.shape[-1:], float("nan"), dtype=q.dtype)
    factor = q.shape[-1] ** -0.5 if scale is None else scale
    for (qa, qb), (ka, kb) in zip(runs_q, runs_k, strict=True):
        qs, ks = slice(qa, qb), slice(ka, kb)
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
        calls.seen.append({"causal": causal, "cu_seqlens_k": cu_seqlens_k, "q": q,
                           "seqused_q": seqused_q, "seqused_k": seqused_k})  # fmt: skip
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
        for cu in (cu_seqlens_q, cu_seqlens_k):
            if cu.dtype != torch.int32 or not cu.is_contiguous():
                raise RuntimeError("cu_seqlens must be contiguous int32")
        # hopper/flash_api.cpp mha_fwd: TORCH_CHECK dtype, CHECK_CONTIGUOUS, CHECK_SHAPE
        for name, used in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
            if used is not None:
                if used.dtype != torch.int32:
                    raise RuntimeError(f"{name} must have dtype int32")
                if not used.is_contiguous():
                    raise RuntimeError(f"{name} must be contiguous")
                if used.shape != (cu_seqlens_q.shape[0] - 1,):
                    raise RuntimeError(f"{name} must have shape (batch_size)")
        runs_q, runs_k = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                       (max_seqlen_q, max_seqlen_k))  # fmt: skip
        out = _per_sequence(q, k, v, runs_q, runs_k, softmax_scale, causal)
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
        # smooth_k is its one option (issue 23); anything else **kwargs swallows
        calls.seen.append({"is_causal": is_causal, "smooth_k": smooth_k, **kwargs})
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
        runs_q, runs_k = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if is_causal:
            lengths_q = [b - a for a, b in runs_q]
            lengths_k = [b - a for a, b in runs_k]
            assert lengths_q == lengths_k, "fake: is_causal only when qo_len == kv_len"
        return _per_sequence(q, k, v, runs_q, runs_k, sm_scale, is_causal)

    module = fake_sageattention(calls)
    module.sageattn_varlen = sageattn_varlen  # type: ignore[attr-defined]
    return module


def fake_fa4(calls: Calls, *, qv_fourth: bool = True) -> types.ModuleType:
    """flash-attn-4 (flash_attn/cute/interface.py, flash-attention 0251105a): the
    dense fake plus ``flash_attn_varlen_func``. ``qv_fourth``: today's signature,
    ``qv`` fourth (since f219c89c); False: the older one, ``cu_seqlens_q`` fourth."""

    def varlen(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        qv: torch.Tensor | None,
        cu_seqlens_q: torch.Tensor | None,
        cu_seqlens_k: torch.Tensor | None,
        max_seqlen_q: int | None,
        max_seqlen_k: int | None,
        seqused_q: torch.Tensor | None,
        seqused_k: torch.Tensor | None,
        softmax_scale: float | None,
        causal: bool,
        extra: dict[str, Any],
    ) -> Any:
        calls.seen.append({"causal": causal, "cu_seqlens_k": cu_seqlens_k, "q": q,
                           "seqused_q": seqused_q, "seqused_k": seqused_k, **extra})  # fmt: skip
        assert qv is None, "fake: qv (MLA weight absorption) is not modelled"
        assert cu_seqlens_q is not None and cu_seqlens_k is not None, "fake: packed layout only"
        assert v.dtype in [torch.float16, torch.bfloat16], (  # fp8 (forward only): not modelled
            "inputs must be float16, bfloat16, fp8 e4m3fn, or fp8 e5m2"
        )
        assert q.dtype == k.dtype == v.dtype, "q, k, v, and qv must have the same dtype"
        batch = cu_seqlens_q.shape[0] - 1
        assert seqused_q is None or seqused_q.shape == (batch,), (
            "seqused_q must have shape (batch_size,)"
        )
        assert seqused_k is None or seqused_k.shape == (batch,), (
            "seqused_k must have shape (batch_size,)"
        )
        for cu in (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
            if cu is None:
                continue
            assert cu.dtype == torch.int32, (
                "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be int32"
            )
            assert cu.stride(0) == 1, (
                "cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k must be contiguous"
            )
        assert q.shape[1] % k.shape[1] == 0, "num_head must be divisible by num_head_kv"
        alignment = 16 // q.element_size()
        assert 8 <= q.shape[-1] <= 256 and q.shape[-1] % alignment == 0, (
            f"head_dim must be between 8 and 256 and divisible by {alignment}"
        )
        runs_q, runs_k = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k,
                                       (max_seqlen_q, max_seqlen_k))  # fmt: skip
        out = _per_sequence(q, k, v, runs_q, runs_k, softmax_scale, causal)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        return out, lse  # FlashAttnVarlenFunc.forward returns (out, lse)

    if qv_fourth:

        def flash_attn_varlen_func(
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            qv: torch.Tensor | None = None,
            cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None,
            min_seqlen_k: int | None = None,
            seqused_q: torch.Tensor | None = None,
            seqused_k: torch.Tensor | None = None,
            gather_kv_indices: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None,
            softmax_scale: float | None = None,
            causal: bool = False,
            window_size: tuple[int | None, int | None] = (None, None),
            learnable_sink: torch.Tensor | None = None,
            softcap: float = 0.0,
            num_splits: int = 1,
            pack_gqa: bool | None = None,
            deterministic: bool = False,
            **rest: Any,  # score_mod ... disable_scheduler_metadata: not modelled
        ) -> Any:
            extra = {"deterministic": deterministic, "pack_gqa": pack_gqa}
            return varlen(q, k, v, qv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          seqused_q, seqused_k, softmax_scale, causal, extra)  # fmt: skip

    else:

        def flash_attn_varlen_func(  # type: ignore[misc]
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            cu_seqlens_q: torch.Tensor | None = None,
            cu_seqlens_k: torch.Tensor | None = None,
            max_seqlen_q: int | None = None,
            max_seqlen_k: int | None = None,
            seqused_q: torch.Tensor | None = None,
            seqused_k: torch.Tensor | None = None,
            page_table: torch.Tensor | None = None,
            softmax_scale: float | None = None,
            causal: bool = False,
            **rest: Any,
        ) -> Any:
            return varlen(q, k, v, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          seqused_q, seqused_k, softmax_scale, causal, {})  # fmt: skip

    cute = fake_flash_attn_cute(calls, returns_tuple=True)["flash_attn.cute"]
    cute.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    return cute


def fake_aiter_varlen(calls: Calls) -> types.ModuleType:
    """AMD aiter (aiter/ops/mha.py, ROCm/aiter e4048607): the dense fake plus
    ``flash_attn_varlen_func`` with the checks of mha_varlen_fwd_kernels.cu."""

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        min_seqlen_q: int = 0,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        logits_soft_cap: float = 0.0,
        causal: bool = False,
        window_size: tuple[int, ...] = (-1, -1, 0),
        bias: torch.Tensor | None = None,
        alibi_slopes: torch.Tensor | None = None,
        deterministic: bool = False,
        return_lse: bool = False,
        return_attn_probs: bool = False,
        **rest: Any,  # how_v3_bf16_cvt, block_table, out, cu_seqlens_*_padded, sink_ptr
    ) -> Any:
        calls.seen.append({"causal": causal, "cu_seqlens_k": cu_seqlens_k,
                           "dropout_p": dropout_p, "min_seqlen_q": min_seqlen_q})  # fmt: skip
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("FlashAttention only support fp16, bf16 and fp8_e4m3 data type")
        if k.dtype != q.dtype or v.dtype != q.dtype:
            raise RuntimeError("query and key must have the same dtype")
        for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            if cu.dtype != torch.int32:
                raise RuntimeError(f"{name} must have dtype int32")
            if not cu.is_contiguous():
                raise RuntimeError(f"{name} must be contiguous")
        if any(t.stride(-1) != 1 for t in (q, k, v)):
            raise RuntimeError("Input tensor must have contiguous last dimension")
        if q.shape[-1] > 256:
            raise RuntimeError("CK only supports head dimension at most 256")
        if dropout_p != 0.0:
            raise NotImplementedError("the fake implements dropout_p == 0 only")
        runs_q, runs_k = _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
        out = _per_sequence(q, k, v, runs_q, runs_k, softmax_scale, causal)
        result = [out]
        if return_lse:
            result.append(torch.zeros(q.shape[1], q.shape[0]))
        return result[0] if len(result) == 1 else tuple(result)

    module = fake_aiter(calls, one_tuple=False)
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
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


@pytest.mark.parametrize(
    ("backend", "platform"), [("fa4", "cuda:sm90+flash_attn_4"), ("aiter", "rocm:gfx942+all")]
)
def test_rule_key_padding_is_taken_by_unpadding_on_fa4_and_aiter(
    backend: str, platform: str
) -> None:
    spec = LayerSpec(128, "bf16", requirements=["causal", "key_padding"], name="site")
    config = SelectionConfig(global_backend=backend, global_backend_explicit=True)
    resolution = resolve(spec, config=config, platform=Platform.simulate(platform))
    assert resolution.backend.name == backend
    support = get_spec(backend).mask_support(MaskKind.KEY_PADDING)
    assert support is not None and support.route is MaskRoute.UNPAD


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
    # sageattn_varlen: causal "Only applicable when qo_len == kv_len for each sequence"
    with pytest.raises(ResolutionError, match="takes causal only with equal query and key"):
        _strict("sage_attn", ["causal", "bottom_right"], role="cross")
    blackwell = Platform.simulate("cuda:sm120+sageattn3")
    cross = LayerSpec(128, "bf16", requirements=["causal", "bottom_right"], role="cross")
    config = SelectionConfig(global_backend="sage_attn_3", global_backend_explicit=True)
    with pytest.raises(ResolutionError, match="no varlen adapter"):
        resolve(cross, config=config, platform=blackwell)


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
    back = pad(packed.packed, packing(valid), 3, 5)
    assert torch.equal(back, x * valid[:, :, None, None])


# ------------------------------------------------------------------ numerics

UNPAD_BACKENDS = ("fa", "fa3", "fa4", "sage_attn", "aiter")


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
        self.saved = {n: sys.modules.get(n) for n in ("flash_attn", "flash_attn.cute",
                      "flash_attn_interface", "sageattention", "aiter")}  # fmt: skip
        calls = Calls()
        sys.modules["flash_attn"] = fake_flash_attn(calls)
        sys.modules["flash_attn.cute"] = fake_fa4(calls)
        sys.modules["flash_attn_interface"] = fake_fa3(calls)
        sys.modules["sageattention"] = fake_sage(calls)
        sys.modules["aiter"] = fake_aiter_varlen(calls)
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


def test_a_mask_that_does_not_broadcast_is_a_typed_error_naming_the_shapes(
    varlen_fakes: Calls,
) -> None:
    """SDPA itself raises a bare RuntimeError from broadcasting; attnres says which
    dimension is off and what to pass (a RuntimeError too, as SDPA's is)."""
    from attnres.errors import MaskShapeError

    q, k, v = _qkv(2, 4, 5, 2, 2, torch.float16, 0)
    wrong_keys = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    with pytest.raises(MaskShapeError, match=r"its key length is 7, not 1 or 5") as info:
        _route("sage_attn")(q, k, v, wrong_keys, False, None)
    assert isinstance(info.value, RuntimeError)
    assert "(2, 1, 1, 7)" in str(info.value)
    with pytest.raises(MaskShapeError, match=r"its batch is 3, not 1 or 2"):
        observe_mask(torch.ones(3, 1, 4, 5, dtype=torch.bool), 2, 4, 5)
    with pytest.raises(MaskShapeError, match=r"its query length is 3, not 1 or 4"):
        observe_mask(torch.ones(3, 5, dtype=torch.bool), 2, 4, 5)
    # what broadcasts is classified as before: per batch row, shared by every row
    assert (
        observe_mask(torch.ones(1, 1, 1, 5, dtype=torch.bool), 2, 4, 5).kind is MaskKind.KEY_PADDING
    )
    assert observe_mask(torch.ones(5, dtype=torch.bool), 2, 4, 5).kind is MaskKind.KEY_PADDING


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


def test_attention_layer_on_fa3_reads_a_left_padded_batch_in_place(varlen_fakes: Calls) -> None:
    """attnres.Attention decided fa3, under no_grad (as pipelines run): the span route."""
    layer = Attention(
        4, 64, num_kv_heads=2, dtype=torch.float16, causal=True, requirements=["key_padding"],
        backend="fa3", platform=HOPPER, name="decoder",
    )  # fmt: skip
    assert layer.backend is not None and layer.backend.name == "fa3"
    q, k, v = _qkv(3, 8, 8, 4, 2, torch.float16, 10)
    valid = _padding([8, 5, 0], 8, left=True)
    with torch.no_grad():
        out = layer(q, k, v, valid[:, None, None, :])
    _check(out, q, k, v, valid, True)
    assert varlen_fakes.seen[-1]["seqused_k"].tolist() == [8, 5]
    assert varlen_fakes.seen[-1]["cu_seqlens_k"].tolist() == [0, 11, 24]


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


# ------------------------------------------------------------------ mask plans (kept per mask)


def test_mask_plan_is_kept_for_the_same_mask_and_matches_a_fresh_one() -> None:
    valid = _padding([5, 2, 0], 5, left=True)
    mask = valid[:, None, None, :]
    first = mask_plan(mask, 3, 5, 5, causal=True)
    assert first.keys is not None and first.keys is first.queries  # query i tied to key i
    assert first.keys.padded is None  # a mask used once: pad zero-fills
    second = mask_plan(mask, 3, 5, 5, causal=True)  # used again: padded positions, once
    assert second.keys is not None and second.keys.padded is not None
    assert mask_plan(mask, 3, 5, 5, causal=True) is second  # further layers: nothing rebuilt
    shared = mask_plan(mask, 3, 5, 5)  # not causal: a mask every query shares
    assert shared is not second and shared.queries is not None
    assert shared.queries.cu_seqlens.tolist() == [0, 5, 10]  # every query of rows 0 and 1
    fresh = unpad(torch.zeros(3, 5, 1, 1), valid)
    assert torch.equal(second.keys.indices, fresh.indices)
    assert torch.equal(second.keys.cu_seqlens, fresh.cu_seqlens)
    assert sorted([*second.keys.indices.tolist(), *second.keys.padded.tolist()]) == list(range(15))
    assert torch.equal(second.keys.padded, packing(valid, with_padded=True).padded)
    cross = mask_plan(mask, 3, 2, 5)  # other shapes: another plan
    assert cross is not second and cross.queries is not None
    assert cross.queries.cu_seqlens.tolist() == [0, 2, 4]
    cross = mask_plan(mask, 3, 2, 5)
    assert cross.queries is not None and cross.queries.padded is not None
    assert cross.queries.padded.tolist() == [4, 5]  # the fully padded row's queries


def test_mask_plan_sees_a_mask_changed_in_place(varlen_fakes: Calls) -> None:
    """The version counter: a change through the mask or any view of it is a new plan,
    and the route's output follows the new mask."""
    valid = _padding([6, 4], 6)
    q, k, v = _qkv(2, 6, 6, 4, 2, torch.float16, 21)
    mask = valid[:, None, None, :].clone()
    route = _route("fa")
    for _ in range(3):  # first use (scattered), then the kept plan (gathered by its source)
        _check(route(q, k, v, mask, False, None), q, k, v, valid, False)
    before = mask_plan(mask, 2, 6, 6)
    assert before.queries is not None and before.queries.source is not None
    mask[1, 0, 0, 5] = True  # in place, on the mask itself
    valid[1, 5] = True
    assert mask_plan(mask, 2, 6, 6) is not before
    for _ in range(3):  # not the stale plan's source: position 11 is a valid row now
        _check(route(q, k, v, mask, False, None), q, k, v, valid, False)
    base = torch.ones(2, 6, dtype=torch.bool)
    view = base[:, None, None, :]
    kept = mask_plan(view, 2, 6, 6)
    base[0, :3] = False  # through the base: the view shares its version counter
    assert mask_plan(view, 2, 6, 6) is not kept
    _check(route(q, k, v, view, False, None), q, k, v, base, False)


def test_mask_plan_of_another_mask_with_the_same_shape_is_its_own(varlen_fakes: Calls) -> None:
    q, k, v = _qkv(2, 6, 6, 4, 4, torch.float16, 22)
    route = _route("sage_attn")
    for lengths in ([6, 1], [2, 5], [6, 1]):  # equal shapes, other objects and contents
        valid = _padding(lengths, 6, left=True)
        mask = valid[:, None, None, :]
        for _ in range(3):  # first use (zero-filled pad), then the kept plan (padded rows)
            _check(route(q, k, v, mask, False, None), q, k, v, valid, False)
    q = _qkv(3, 4, 6, 4, 4, torch.float16, 23)[0]  # cross-attention, a fully padded row
    k, v = _qkv(3, 6, 6, 4, 4, torch.float16, 24)[1:]
    valid = _padding([6, 0, 2], 6)
    mask = valid[:, None, None, :]
    for _ in range(3):
        _check(route(q, k, v, mask, False, None), q, k, v, valid, False)


def test_mask_plans_are_bounded_dropped_with_their_mask_and_cleared() -> None:
    from attnres import _varlen

    clear_varlen_cache()
    masks = [_padding([4, n], 4)[:, None, None, :] for n in range(PLANS_KEPT + 3)]
    for each in masks:
        mask_plan(each, 2, 4, 4)
    del each
    assert len(_varlen._PLANS) == PLANS_KEPT
    masks.pop()  # freed: its plan goes with it
    assert len(_varlen._PLANS) == PLANS_KEPT - 1
    clear_varlen_cache()  # one invalidation with the varlen adapters (registry changes)
    assert not _varlen._PLANS


def test_mask_plans_keep_inference_apart_and_keep_no_inference_tensor() -> None:
    mask = _padding([3, 1], 3)[:, None, None, :]
    with torch.inference_mode():
        inside = mask_plan(mask, 2, 3, 3)
        built_inside = torch.ones(2, 1, 1, 3, dtype=torch.bool)
        assert mask_plan(built_inside, 2, 3, 3) is not mask_plan(built_inside, 2, 3, 3)
    outside = mask_plan(mask, 2, 3, 3)
    assert outside is not inside  # inference-mode indices cannot be saved for backward
    assert outside.keys is not None and not outside.keys.indices.is_inference()
    q = torch.randn(2, 3, 1, 4, requires_grad=True)
    pack(q, outside.keys).sum().backward()
    assert q.grad is not None and torch.equal(q.grad[:, :, 0, 0], mask[:, 0, 0].float())


@pytest.mark.parametrize("lengths", [[3, 0, 2], [4, 4, 4], [0, 0, 0], [1, 4, 0]])
@pytest.mark.parametrize("left", [False, True])
def test_pad_by_gather_is_bit_identical_to_pad_by_scatter(lengths: list[int], left: bool) -> None:
    """A kept plan pads by gathering (Packing.source) and zeroing the padded rows; a
    plan used once, or a call autograd records, scatters into zeros: the same bits,
    negative zeros and NaNs included, and the same gradient."""
    valid = _padding(lengths, 4, left=left)
    once, kept = packing(valid), packing(valid, with_padded=True)
    assert once.source is None and kept.source is not None and kept.padded is not None
    assert kept.source.shape == (12,) and kept.source[valid.reshape(-1)].tolist() == list(
        range(int(valid.sum()))
    )
    rows = torch.randn(int(valid.sum()), 2, 3)
    if rows.shape[0]:
        rows[0, 0] = torch.tensor([-0.0, float("nan"), float("inf")])
    scattered, gathered = pad(rows, once, 3, 4), pad(rows, kept, 3, 4)
    assert scattered.view(torch.int32).equal(gathered.view(torch.int32))
    assert sorted([*kept.indices.tolist(), *kept.padded.tolist()]) == list(range(12))
    grads = []
    for where in (once, kept):
        leaf = rows.clone().requires_grad_()
        out = pad(leaf, where, 3, 4)
        assert out.view(torch.int32).equal(scattered.view(torch.int32))
        out.backward(torch.arange(out.numel(), dtype=torch.float32).view(out.shape))
        grads.append(leaf.grad)
    assert grads[0] is not None and torch.equal(grads[0], grads[1])


# ------------------------------------------------------------------ fa4 and aiter varlen adapters


@pytest.mark.parametrize("qv_fourth", [True, False], ids=["qv-fourth", "cu-seqlens-fourth"])
def test_fa4_varlen_adapter_passes_by_keyword_for_either_signature(
    monkeypatch: pytest.MonkeyPatch, qv_fourth: bool
) -> None:
    """flash-attention f219c89c put ``qv`` where ``cu_seqlens_q`` was: the adapter
    names every argument after ``v``, so both signatures get the right ones."""
    calls = Calls()
    monkeypatch.setitem(sys.modules, "flash_attn.cute", fake_fa4(calls, qv_fourth=qv_fourth))
    clear_varlen_cache()
    try:
        valid = _padding([5, 2], 5, left=True)
        q, k, v = _qkv(2, 5, 5, 4, 2, torch.bfloat16, 31)
        out = _route("fa4")(q, k, v, valid[:, None, None, :], True, None)
        _check(out, q, k, v, valid, True)
        assert calls.seen and calls.seen[-1]["causal"] is True
    finally:
        clear_varlen_cache()


@pytest.mark.parametrize("backend", ["fa4", "aiter"])
def test_fa4_and_aiter_varlen_get_int32_cu_seqlens_and_refuse_fp32(
    varlen_fakes: Calls, backend: str
) -> None:
    from attnres._varlen import get_varlen_kernel

    varlen = get_varlen_kernel(get_spec(backend))
    q, k, v = (torch.randn(7, 4, 64).half() for _ in range(3))
    cu = torch.tensor([0, 3, 7])  # int64: the adapter passes contiguous int32 on
    out = varlen(q, k, v, cu, cu, 4, 4, False, None)
    assert out.shape == q.shape and out.dtype == torch.float16
    assert varlen_fakes.seen[-1]["cu_seqlens_k"].dtype == torch.int32
    with pytest.raises((AssertionError, RuntimeError), match=r"float16|fp16"):
        varlen(q.float(), k.float(), v.float(), cu, cu, 4, 4, False, None)


def test_fa4_options_reach_its_varlen_entry_point(varlen_fakes: Calls) -> None:
    """Issue 23's options on the unpad route: FA4's flash_attn_varlen_func takes
    deterministic and pack_gqa (interface.py at 0251105a)."""
    valid = _padding([6, 3], 6)
    q, k, v = _qkv(2, 6, 6, 4, 2, torch.float16, 41)
    out = _route("fa4")(q, k, v, valid[:, None, None, :], False, None, deterministic=True,
                        pack_gqa=False)  # fmt: skip
    _check(out, q, k, v, valid, False)
    assert varlen_fakes.seen[-1]["deterministic"] is True
    assert varlen_fakes.seen[-1]["pack_gqa"] is False


# ------------------------------------------------------------------ the span route (seqused)

SEQUSED_BACKENDS = ("fa3", "fa4")  # their varlen functions take seqused_q/seqused_k

SPAN_CASES = {
    # name: (lengths, seq_q, seq_kv, heads, kv_heads, left, causal, marks the queries)
    "right-padding": ([7, 4, 1], 7, 7, 4, 4, False, False, False),
    "left-padding-marked": ([7, 4, 1], 7, 7, 4, 4, True, False, True),
    "fully-padded-row": ([6, 0, 3], 6, 6, 4, 4, True, False, True),
    "gqa-causal-left": ([5, 2], 5, 5, 8, 2, True, True, False),
    "cross-different-lengths": ([9, 2, 0], 4, 9, 4, 1, True, False, False),
}


@pytest.mark.parametrize("case", sorted(SPAN_CASES))
@pytest.mark.parametrize("backend", SEQUSED_BACKENDS)
def test_span_route_reads_the_padded_layout_and_matches_the_reference(
    varlen_fakes: Calls, backend: str, case: str
) -> None:
    """One run of valid tokens per row (right or left padding): the kernel is handed
    the batch flattened as it lies (no gather: the very storage of q) with
    cu_seqlens at each run's first token and seqused its length; the rows it
    leaves unwritten (NaN in the fakes) come back as zeros."""
    lengths, seq_q, seq_kv, heads, kv_heads, left, causal, marks = SPAN_CASES[case]
    valid = _padding(lengths, seq_kv, left=left)
    q, k, v = _qkv(valid.shape[0], seq_q, seq_kv, heads, kv_heads, torch.float16, 51)
    mask = valid[:, None, None, :] & valid[:, None, :, None] if marks else valid[:, None, None, :]
    out = _route(backend)(q, k, v, mask, causal, None)
    assert out.shape == q.shape and not out.isnan().any()
    _check(out, q, k, v, valid, causal, marks_queries=marks)
    seen = varlen_fakes.seen[-1]
    assert seen["seqused_k"] is not None and seen["seqused_q"] is not None
    assert seen["q"].data_ptr() == q.data_ptr(), "the padded layout as it lies: no copy"
    rows = valid.any(dim=1)
    assert seen["seqused_k"].tolist() == valid.sum(1)[rows].tolist()
    first = valid.int().argmax(1)[rows]
    row_ids = rows.nonzero().reshape(-1)
    assert seen["cu_seqlens_k"].tolist() == [*(row_ids * seq_kv + first).tolist(), valid.numel()]


@pytest.mark.parametrize("backend", SEQUSED_BACKENDS)
def test_span_route_is_not_taken_for_padding_in_the_middle(
    varlen_fakes: Calls, backend: str
) -> None:
    """Qwen-Image's joint mask has two runs in a row: gathered, as before."""
    valid = torch.cat([_padding([2, 4, 0], 5), torch.ones(3, 4, dtype=torch.bool)], dim=1)
    q, k, v = _qkv(3, 9, 9, 4, 2, torch.float16, 52)
    out = _route(backend)(q, k, v, valid[:, None, None, :], False, None)
    _check(out, q, k, v, valid, False)
    assert varlen_fakes.seen[-1]["seqused_k"] is None


@pytest.mark.parametrize("backend", SEQUSED_BACKENDS)
def test_span_route_gathers_when_a_gradient_is_needed(varlen_fakes: Calls, backend: str) -> None:
    """FA3's and FA4's backward leave dq/dk/dv of uncovered rows unwritten
    (torch::empty / torch.empty): with a gradient to compute, the route gathers,
    so padded positions get zero gradients; under no_grad it reads in place."""
    valid = _padding([6, 3], 6, left=True)
    q, k, v = (t.requires_grad_() for t in _qkv(2, 6, 6, 4, 2, torch.float16, 53))
    out = _route(backend)(q, k, v, valid[:, None, None, :], True, None)
    assert varlen_fakes.seen[-1]["seqused_k"] is None
    out.float().sum().backward()
    assert q.grad is not None and torch.all(q.grad[~valid] == 0)
    assert k.grad is not None and torch.all(k.grad[~valid] == 0)
    with torch.no_grad():
        again = _route(backend)(q, k, v, valid[:, None, None, :], True, None)
    assert varlen_fakes.seen[-1]["seqused_k"] is not None
    torch.testing.assert_close(again, out.detach(), rtol=0, atol=0)


def test_only_adapters_whose_function_takes_seqused_say_so(
    varlen_fakes: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    from attnres._varlen import get_varlen_kernel
    from attnres.kernels._common import VarlenAdapter, varlen_style_kernel

    takes = {b: getattr(get_varlen_kernel(get_spec(b)), "takes_seqused", None)
             for b in UNPAD_BACKENDS}  # fmt: skip
    # flash_attn_varlen_func (FA2), sageattn_varlen and aiter's have no seqused argument
    assert takes == {"fa": False, "fa3": True, "fa4": True, "sage_attn": False, "aiter": False}
    plain = varlen_style_kernel(lambda *args, **kw: args[0])
    x = torch.zeros(4, 1, 8)
    cu = torch.tensor([0, 4])
    with pytest.raises(TypeError, match="takes no seqused_q/seqused_k"):
        plain(x, x, x, cu, cu, 4, 4, False, None, seqused_k=torch.tensor([4]))
    # an FA3 build whose varlen function has no seqused arguments: gathered
    calls = Calls()
    old = fake_fa3(calls)
    real = old.flash_attn_varlen_func

    def without_seqused(
        q: Any,
        k: Any,
        v: Any,
        cu_q: Any,
        cu_k: Any,
        max_q: int,
        max_k: int,
        softmax_scale: Any = None,
        causal: bool = False,
    ) -> Any:
        return real(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=softmax_scale,
                    causal=causal)  # fmt: skip

    old.flash_attn_varlen_func = without_seqused  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn_interface", old)
    clear_varlen_cache()
    adapter = get_varlen_kernel(get_spec("fa3"))
    assert isinstance(adapter, VarlenAdapter) and not adapter.takes_seqused
    valid = _padding([5, 2], 5)
    q, k, v = _qkv(2, 5, 5, 4, 4, torch.float16, 54)
    _check(_route("fa3")(q, k, v, valid[:, None, None, :], False, None), q, k, v, valid, False)
    assert calls.seen[-1]["seqused_k"] is None


def test_mask_plan_spans_are_kept_apart_from_packings() -> None:
    valid = _padding([5, 0, 2], 5, left=True)
    mask = valid[:, None, None, :]
    plan = mask_plan(mask, 3, 5, 5, causal=True, spans=True)
    assert plan.keys is None and plan.queries is None and plan.spans is not None
    assert plan.key_padding
    spans = plan.spans
    assert spans.cu_seqlens_k.tolist() == [0, 13, 15] and spans.seqused_k.tolist() == [5, 2]
    assert spans.cu_seqlens_q is spans.cu_seqlens_k  # causal: query i is key i
    assert spans.padded_q is not None and spans.padded_q.tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    assert mask_plan(mask, 3, 5, 5, causal=True, spans=True) is plan
    gathered = mask_plan(mask, 3, 5, 5, causal=True)
    assert gathered.spans is None and gathered.keys is not None
    shared = mask_plan(mask, 3, 2, 5, spans=True)  # cross: every query of rows 0 and 2
    assert shared.spans is not None
    assert shared.spans.cu_seqlens_q.tolist() == [0, 4, 6]
    assert shared.spans.seqused_q.tolist() == [2, 2] and shared.spans.padded_q is not None
    assert shared.spans.padded_q.tolist() == [2, 3]
    middle = torch.tensor([[True, False, True]])[:, None, None, :]
    assert mask_plan(middle, 1, 3, 3, spans=True).spans is None


@pytest.mark.parametrize("backend", SEQUSED_BACKENDS)
def test_seqused_reaches_the_kernel_as_int32_and_the_fakes_refuse_other_dtypes(
    varlen_fakes: Calls, backend: str
) -> None:
    from attnres._varlen import get_varlen_kernel

    adapter = get_varlen_kernel(get_spec(backend))
    x = torch.randn(8, 2, 64).half()
    cu, used = torch.tensor([1, 4, 8]), torch.tensor([3, 2])  # int64 in, int32 out
    out = adapter(x, x, x, cu, cu, 3, 3, False, None, seqused_q=used, seqused_k=used)
    seen = varlen_fakes.seen[-1]
    assert seen["seqused_q"].dtype == torch.int32 and seen["seqused_k"].dtype == torch.int32
    assert out[[0, 6, 7]].isnan().all() and not out[[1, 2, 3, 4, 5]].isnan().any()
    module = sys.modules["flash_attn_interface" if backend == "fa3" else "flash_attn.cute"]
    cu32 = cu.int()
    with pytest.raises((AssertionError, RuntimeError), match="seqused_q"):
        module.flash_attn_varlen_func(
            x, x, x, cu_seqlens_q=cu32, cu_seqlens_k=cu32, max_seqlen_q=3, max_seqlen_k=3,
            seqused_q=used, seqused_k=used.int(),
        )  # fmt: skip
    with pytest.raises((AssertionError, RuntimeError), match="seqused_k must have shape"):
        module.flash_attn_varlen_func(
            x, x, x, cu_seqlens_q=cu32, cu_seqlens_k=cu32, max_seqlen_q=3, max_seqlen_k=3,
            seqused_q=used.int(), seqused_k=torch.tensor([3], dtype=torch.int32),
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="longer than max_seqlen"):
        module.flash_attn_varlen_func(
            x, x, x, cu_seqlens_q=cu32, cu_seqlens_k=cu32, max_seqlen_q=2, max_seqlen_k=3,
            seqused_q=used.int(), seqused_k=used.int(),
        )  # fmt: skip


def _classified_by_definition(keep: torch.Tensor) -> tuple[str, bool, bool]:
    """docs/masks.md's rules with plain all/any, for a boolean (B, H, Sq, Skv) mask:
    (kind, causal, marks the queries)."""
    if not torch.equal(keep, keep[:, :1].expand_as(keep)):
        return "boolean", False, False
    rows = keep[:, 0]
    valid = rows.any(dim=1)
    if rows.shape[1] == 1 or bool((rows == valid[:, None, :]).all()):
        return "key_padding", False, False
    if rows.shape[1] == rows.shape[2]:
        tril = torch.ones(rows.shape[1:], dtype=torch.bool).tril()
        for pattern, causal in ((valid[:, None, :], False), (valid[:, None, :] & tril, True)):
            if bool(((rows == pattern) | ~valid[:, :, None]).all()):
                return "key_padding", causal, True
    return "boolean", False, False


@settings(max_examples=60, deadline=None)
@given(data=st.data(), shape=st.sampled_from(["padding", "causal", "refiner", "random"]))
def test_observe_mask_follows_its_definition(data: st.DataObject, shape: str) -> None:
    batch, heads = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    seq_q = data.draw(st.integers(1, 7))
    seq_kv = (
        seq_q if shape != "random" or data.draw(st.booleans()) else data.draw(st.integers(1, 7))
    )
    cells = st.lists(st.booleans(), min_size=batch * seq_kv, max_size=batch * seq_kv)
    valid = torch.tensor(data.draw(cells)).reshape(batch, seq_kv)
    if shape == "random":
        size = batch * heads * seq_q * seq_kv
        flat = data.draw(st.lists(st.booleans(), min_size=size, max_size=size))
        keep = torch.tensor(flat).reshape(batch, heads, seq_q, seq_kv)
    else:
        keep = valid[:, None, None, :].expand(batch, heads, seq_q, seq_kv).clone()
        if seq_q == seq_kv:
            keep &= valid[:, None, :, None]  # the padded queries marked
            if shape == "causal":
                keep &= torch.ones(seq_q, seq_kv, dtype=torch.bool).tril()
            if shape == "refiner":
                keep[..., 0] = True
    seen = observe_mask(keep, batch, seq_q, seq_kv)
    kind, causal, marks = _classified_by_definition(keep)
    assert (seen.kind.value, seen.causal, seen.marks_queries) == (kind, causal, marks)
    if kind == "key_padding":
        assert seen.valid is not None and torch.equal(seen.valid, keep[:, 0].any(dim=1))


def test_a_mask_of_another_kind_is_named_before_a_missing_varlen_package() -> None:
    """The varlen kernel is built before the plan (its adapter says whether it takes
    seqused); a mask the route cannot take is still the error reported first."""
    from attnres.errors import KernelUnavailableError

    def missing() -> Any:
        raise KernelUnavailableError("attention backend 'x' needs the Python package 'y'")

    route = padded_kernel("x", _never_dense, missing)
    q = torch.zeros(1, 4, 1, 8)
    per_query = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    per_query[0, 0, 1, 3] = False
    with pytest.raises(MaskKindError, match="this call's mask is boolean mask"):
        route(q, q, q, per_query, False, None)
    with pytest.raises(KernelUnavailableError, match="needs the Python package"):
        route(q, q, q, _padding([4], 4)[:, None, None, :], False, None)


def _never_dense(*args: Any) -> torch.Tensor:
    raise AssertionError("a masked call never runs the dense kernel")


# ------------------------------------------------------------------ issue 32 item 1

INTEGER_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.int8)


def _integer_padding(dtype: torch.dtype, additive: bool) -> torch.Tensor:
    """A (2, 1, 1, 6) padding mask as integers: 0/-10000 (an additive bias, int64
    in some pipelines) or 1/0 (a keep mask); row 1 has 4 valid keys."""
    valid = _padding([6, 4], 6)[:, None, None, :]
    if additive and dtype.is_signed:
        return torch.where(valid, 0, -100 if dtype == torch.int8 else -10000).to(dtype)
    return valid.to(dtype)


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
@pytest.mark.parametrize("additive", [True, False], ids=["bias", "keep"])
@pytest.mark.parametrize("backend", ["torch_sdpa", "eager", "flex_attention"])
def test_integer_mask_refused_everywhere(backend: str, dtype: torch.dtype, additive: bool) -> None:
    """torch SDPA raised its bare RuntimeError, eager and flex added the integers
    (1 is then no mask): one meaning everywhere, a typed refusal."""
    layer = Attention(4, 64, dtype=torch.float32, requirements=["key_padding"], backend=backend,
                      platform=Platform.simulate("cpu"))  # fmt: skip
    assert layer.backend is not None and layer.backend.name == backend
    q, k, v = _qkv(2, 6, 6, 4, 4, torch.float32, 1)
    with pytest.raises(MaskKindError, match=r"integer tensor .*Pass mask\.bool\(\)") as info:
        layer(q, k, v, _integer_padding(dtype, additive))
    assert info.value.observed.startswith("integer mask")
    layer(q, k, v, _integer_padding(dtype, additive).bool())  # the bool form runs


@pytest.mark.parametrize("dtype", INTEGER_DTYPES, ids=str)
@pytest.mark.parametrize("backend", UNPAD_BACKENDS)
def test_integer_mask_refused_on_the_unpad_route(
    varlen_fakes: Calls, backend: str, dtype: torch.dtype
) -> None:
    """The unpad route read non-zero as "takes part": an int64 0/-10000 padding
    mask was inverted."""
    q, k, v = _qkv(2, 6, 6, 4, 4, torch.float16, 2)
    with pytest.raises(MaskKindError, match="integer tensor"):
        _route(backend)(q, k, v, _integer_padding(dtype, additive=True), False, None)
    assert not varlen_fakes.seen  # refused before any kernel ran
    with pytest.raises(MaskKindError, match="integer tensor"):
        observe_mask(_integer_padding(dtype, additive=False), 2, 6, 6)


def test_integer_mask_refused_by_an_attention_layer_on_sage(varlen_fakes: Calls) -> None:
    layer = Attention(
        4, 64, num_kv_heads=2, dtype=torch.float16, requirements=["key_padding"],
        backend="sage_attn", platform=HOPPER, name="joint",
    )  # fmt: skip
    q, k, v = _qkv(2, 6, 6, 4, 2, torch.float16, 9)
    with pytest.raises(MaskKindError, match="integer tensor"):
        layer(q, k, v, _integer_padding(torch.int64, additive=True))
    assert not varlen_fakes.seen
