"""Adapters for dynamic_cudnn_sdpa, sage_attn_3 and ascend_fa, against faithful fakes.

The fakes enforce the documented API of each package (sources in the adapter
modules' headers): exact keyword names, the layout (sageattn3: HND;
npu_fusion_attention: BSND with ``head_num``), dtypes, head sizes, the fixed
softmax scale of sageattn3 and its in-place centring of ``k``, and the inverted
boolean mask of npu_fusion_attention (``True`` masks a position out). They
compute in float64 on the CPU, so the tests check the numbers each adapter
produces against the float64 reference.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from reference import reference as expected
from reference import relative_error
from test_kernels_fakes import TOLERANCE, Calls, _fake_core, make_inputs

from attnres.kernels import KernelUnavailableError, clear_kernel_cache, get_kernel


@pytest.fixture(autouse=True)
def fresh_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(sys.modules):
        if name.split(".")[0] in ("sageattn3", "torch_npu"):
            monkeypatch.delitem(sys.modules, name)
    clear_kernel_cache()
    yield
    clear_kernel_cache()


def fake_sageattn3(calls: Calls) -> types.ModuleType:
    """sageattn3_blackwell: HND, fixed scale, mask ignored, k centred in place."""

    def sageattn3_blackwell(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        per_block_mean: bool = True,
        **kwargs: Any,
    ) -> torch.Tensor:
        calls.seen.append({"attn_mask": attn_mask, "is_causal": is_causal, **kwargs})
        if q.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("sageattn3: fp16/bf16 only")
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("sageattn3: q, k, v need the same number of heads")
        if q.shape[-1] not in (64, 128):
            raise RuntimeError(f"sageattn3: unsupported head dim {q.shape[-1]}")
        if is_causal and q.shape[2] != k.shape[2]:
            raise AssertionError("fake: causal with qo_len != kv_len is undocumented")
        # the real kernel subtracts k's mean in place (softmax is shift-invariant per row)
        k -= k.mean(dim=-2, keepdim=True)
        q_, k_, v_ = (t.transpose(1, 2) for t in (q, k, v))
        out = _fake_core(
            q_, k_, v_, scale=q.shape[-1] ** -0.5, causal="top_left" if is_causal else None
        )
        return out.transpose(1, 2)

    module = types.ModuleType("sageattn3")
    module.sageattn3_blackwell = sageattn3_blackwell  # type: ignore[attr-defined]
    return module


def fake_torch_npu(calls: Calls) -> types.ModuleType:
    """npu_fusion_attention: BSND, head_num, scale multiplier, True masks out."""

    def npu_fusion_attention(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        head_num: int,
        input_layout: str,
        pse: torch.Tensor | None = None,
        padding_mask: torch.Tensor | None = None,
        atten_mask: torch.Tensor | None = None,
        scale: float = 1.0,
        keep_prob: float = 1.0,
        pre_tockens: int = 2147483647,
        next_tockens: int = 2147483647,
        inner_precise: int = 0,
        prefix: list[int] | None = None,
        actual_seq_qlen: list[int] | None = None,
        actual_seq_kvlen: list[int] | None = None,
        sparse_mode: int = 0,
        gen_mask_parallel: bool = True,
        sync: bool = False,
    ) -> tuple[torch.Tensor, ...]:
        calls.seen.append(
            {"atten_mask": atten_mask, "scale": scale, "sparse_mode": sparse_mode,
             "head_num": head_num, "input_layout": input_layout}
        )  # fmt: skip
        if input_layout != "BSND":
            raise NotImplementedError("the fake implements BSND only")
        if query.dtype not in (torch.float16, torch.bfloat16):
            raise RuntimeError("npu_fusion_attention: fp16/bf16 only")
        batch, seq_q, heads, head_size = query.shape
        if head_num != heads:
            raise RuntimeError(f"head_num {head_num} != query heads {heads}")
        if heads % key.shape[2]:
            raise RuntimeError("query heads must be a multiple of key/value heads")
        if head_size % 16 or head_size > 512:
            raise RuntimeError(f"head dim {head_size} not supported")
        if sparse_mode != 0 or keep_prob != 1.0:
            raise NotImplementedError("the fake implements sparse_mode=0, keep_prob=1 only")
        seq_kv = key.shape[1]
        bias = None
        if atten_mask is not None:
            if atten_mask.dtype not in (torch.bool, torch.uint8):
                raise RuntimeError("atten_mask must be bool or uint8")
            allowed = {(seq_q, seq_kv), (batch, 1, seq_q, seq_kv), (batch, heads, seq_q, seq_kv)}
            if tuple(atten_mask.shape) not in allowed:
                raise RuntimeError(f"atten_mask shape {tuple(atten_mask.shape)} not supported")
            full = atten_mask.bool().expand(batch, heads, seq_q, seq_kv)
            bias = torch.zeros(full.shape, dtype=torch.float64).masked_fill(full, float("-inf"))
        out = _fake_core(query, key, value, scale=scale, causal=None, bias=bias)
        extra = torch.zeros(1)
        return (out, extra, extra, extra, 0, 0, 0)

    module = types.ModuleType("torch_npu")
    module.npu_fusion_attention = npu_fusion_attention  # type: ignore[attr-defined]
    return module


# ------------------------------------------------------------------ sage_attn_3


def sage3(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Calls]:
    calls = Calls()
    monkeypatch.setitem(sys.modules, "sageattn3", fake_sageattn3(calls))
    kernel = get_kernel("sage_attn_3")
    assert kernel is not None
    return kernel, calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_size", [64, 128])
def test_sage_attn_3_matches_reference(
    dtype: torch.dtype, causal: bool, head_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel, calls = sage3(monkeypatch)
    q, k, v = make_inputs(3, dtype=dtype, head_size=head_size, seq_q=20, seq_kv=20)
    k_before = k.clone()
    out = kernel(q, k, v, None, causal, None)
    assert out.shape == q.shape and out.dtype == dtype
    assert relative_error(out, expected(q, k, v, None, causal, None)) < TOLERANCE[dtype]
    assert torch.equal(k, k_before), "the adapter must not let the kernel centre the caller's k"
    assert calls.seen[0]["attn_mask"] is None


def test_sage_attn_3_refuses_what_it_cannot_do(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel, calls = sage3(monkeypatch)
    q, k, v = make_inputs(4, dtype=torch.float16, seq_q=8, seq_kv=12)
    with pytest.raises(ValueError, match="does not support attn_mask"):
        kernel(q, k, v, torch.ones(8, 12, dtype=torch.bool), False, None)
    with pytest.raises(ValueError, match="fixed softmax scale"):
        kernel(q, k, v, None, False, 0.3)
    with pytest.raises(ValueError, match="bottom-right"):
        kernel(q, k, v, None, True, None)
    qg, kg, vg = make_inputs(4, dtype=torch.float16, heads_q=8, heads_kv=2)
    with pytest.raises(ValueError, match="grouped-query"):
        kernel(qg, kg, vg, None, False, None)
    assert calls.seen == []
    # the default scale given explicitly is the kernel's own: accepted
    out = kernel(q, k, v, None, False, 64**-0.5)
    assert relative_error(out, expected(q, k, v, None, False, None)) < TOLERANCE[torch.float16]


# --------------------------------------------------------------------- ascend_fa


def npu(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Calls]:
    calls = Calls()
    monkeypatch.setitem(sys.modules, "torch_npu", fake_torch_npu(calls))
    kernel = get_kernel("ascend_fa")
    assert kernel is not None
    return kernel, calls


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("mask_shape", "causal", "shape"),
    [
        (None, False, {}),
        (None, True, {}),
        (None, True, {"seq_q": 9, "seq_kv": 23}),  # causal cross: top-left like SDPA
        ((2, 4, 24, 24), False, {}),
        ((24, 24), True, {}),
        ((2, 1, 1, 24), False, {}),
        ((4, 24, 24), True, {}),  # 3-D: (heads, seq_q, seq_kv), as SDPA broadcasts it
        (None, False, {"heads_q": 8, "heads_kv": 2}),
    ],
)
def test_ascend_fa_matches_reference(
    dtype: torch.dtype,
    mask_shape: tuple[int, ...] | None,
    causal: bool,
    shape: dict[str, int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel, calls = npu(monkeypatch)
    q, k, v = make_inputs(5, dtype=dtype, **shape)
    mask = None
    if mask_shape is not None:
        gen = torch.Generator().manual_seed(11)
        mask = torch.rand(mask_shape, generator=gen) > 0.3
        mask[..., 0] = True  # no fully masked row
    out = kernel(q, k, v, mask, causal, None)
    assert out.shape == q.shape and out.dtype == dtype
    want = expected(q, k, v, mask, causal, None)
    assert relative_error(out, want) < TOLERANCE[dtype]
    seen = calls.seen[0]
    assert seen["scale"] == pytest.approx(q.shape[-1] ** -0.5)  # npu's default is 1.0
    assert seen["head_num"] == q.shape[2] and seen["sparse_mode"] == 0


def test_ascend_fa_passes_the_layer_scale_and_refuses_float_masks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kernel, calls = npu(monkeypatch)
    q, k, v = make_inputs(6, dtype=torch.float16)
    out = kernel(q, k, v, None, False, 0.2)
    assert relative_error(out, expected(q, k, v, None, False, 0.2)) < TOLERANCE[torch.float16]
    assert calls.seen[0]["scale"] == 0.2
    with pytest.raises(ValueError, match="boolean masks only"):
        kernel(q, k, v, torch.zeros(24, 24), False, None)


def test_new_adapters_say_how_to_install_a_missing_package() -> None:
    with pytest.raises(KernelUnavailableError, match="torch-npu"):
        get_kernel("ascend_fa")
    with pytest.raises(KernelUnavailableError, match="sageattention3_blackwell"):
        get_kernel("sage_attn_3")


# ------------------------------------------------------------ dynamic_cudnn_sdpa


def test_dynamic_cudnn_sdpa_is_sdpa_with_cudnn_first_and_no_math(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[bool, bool, bool]] = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(
            (
                torch.backends.cuda.cudnn_sdp_enabled(),
                torch.backends.cuda.flash_sdp_enabled(),
                torch.backends.cuda.math_sdp_enabled(),
            )
        )
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    kernel = get_kernel("dynamic_cudnn_sdpa")
    assert kernel is not None
    q, k, v = make_inputs(7, dtype=torch.float32, seq_q=10, seq_kv=10)
    out = kernel(q, k, v, None, True, None)
    assert relative_error(out, expected(q, k, v, None, True, None)) < TOLERANCE[torch.float32]
    assert seen == [(True, True, False)]
    assert torch.backends.cuda.math_sdp_enabled()  # the selection is scoped to the call


# ------------------------------------------------------------ cuDNN refusals (issue 31)


@pytest.fixture
def deterministic_mode() -> Iterator[None]:
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_cudnn_sdpa_refuses_a_single_key_typed_before_torch_raises() -> None:
    """sdp_utils.cpp check_cudnn_tensor_shapes refuses seq_kv == 1; with only cuDNN
    enabled torch raises 'No available kernel'. The adapter names the check first."""
    from attnres.errors import KernelRefusedError
    from attnres.kernels import torch_cudnn_sdpa

    kernel = get_kernel("torch_cudnn_sdpa")
    assert kernel is not None
    q, k, v = make_inputs(3, dtype=torch.float16, seq_q=5, seq_kv=1)
    with pytest.raises(KernelRefusedError, match="key/value sequence length 1") as info:
        kernel(q, k, v, None, False, None)
    assert info.value.backend == "torch_cudnn_sdpa"
    assert info.value.because == torch_cudnn_sdpa.SEQ_KV_1
    assert isinstance(info.value, RuntimeError)  # what torch raised before


def test_cudnn_sdpa_refuses_deterministic_mode_typed(deterministic_mode: None) -> None:
    """sdp_utils.cpp check_cudnn_deterministic: no cuDNN SDPA under
    torch.use_deterministic_algorithms(True) (warn_only lets it run)."""
    from attnres.errors import KernelRefusedError

    kernel = get_kernel("torch_cudnn_sdpa")
    assert kernel is not None
    q, k, v = make_inputs(4, dtype=torch.float16, seq_q=6, seq_kv=6)
    with pytest.raises(KernelRefusedError, match="is not deterministic"):
        kernel(q, k, v, None, False, None)
    torch.use_deterministic_algorithms(True, warn_only=True)
    # warn_only passes the check: the call reaches torch, which on this CPU-only
    # machine finds no cuDNN (its own RuntimeError, not the adapter's refusal)
    with pytest.raises(RuntimeError, match=r"(?i)no (viable backend|available kernel)") as info:
        kernel(q, k, v, None, False, None)
    assert not isinstance(info.value, KernelRefusedError)


def test_every_cudnn_refusal_the_catalogue_states_is_enforced() -> None:
    """Each BackendSpec.refuses line of torch_cudnn_sdpa names the sdp_utils.cpp
    check the adapter applies, and no check goes unstated."""
    from attnres.backends import get_spec
    from attnres.kernels import torch_cudnn_sdpa

    refuses = get_spec("torch_cudnn_sdpa").refuses
    for check in ("check_cudnn_tensor_shapes", "check_cudnn_deterministic"):
        (line,) = [r for r in refuses if check in r]
        assert "001f694a" in line and "KernelRefusedError" in line
    assert "check_cudnn_tensor_shapes" in torch_cudnn_sdpa.SEQ_KV_1
    assert "check_cudnn_deterministic" in torch_cudnn_sdpa.DETERMINISTIC


def test_dynamic_cudnn_sdpa_serves_what_cudnn_refuses(deterministic_mode: None) -> None:
    """select_sdp_backend goes on down the list (flash, then efficient) where cuDNN
    refuses: dynamic_cudnn_sdpa runs a single key and deterministic mode, with
    SDPA's numbers."""
    kernel = get_kernel("dynamic_cudnn_sdpa")
    assert kernel is not None
    q, k, v = make_inputs(5, dtype=torch.float32, seq_q=7, seq_kv=1)
    out = kernel(q, k, v, None, False, None)
    assert relative_error(out, expected(q, k, v, None, False, None)) < TOLERANCE[torch.float32]
