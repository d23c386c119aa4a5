"""Numerics of the CPU-runnable kernel adapters against a float64 reference.

Every case draws fresh random inputs from a seed taken from ``os.urandom``
(``ATTNRES_TEST_SEED`` pins it); a failure message carries the seed.

"Every output element was written" is checked honestly: the tests run with
``torch.use_deterministic_algorithms(True)`` and
``torch.utils.deterministic.fill_uninitialized_memory = True``, so any tensor a
kernel allocates with ``torch.empty`` starts as NaN; the output must then be
finite everywhere and match the reference elementwise (``allclose``), not only
in norm.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from attnres.kernels import KernelFn, get_kernel

# torch's own one-time performance notice when flex_attention runs outside
# torch.compile (it is raised inside torch, not by attnres; see
# attnres/kernels/flex_attention.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile:UserWarning"
)

CPU_KERNELS = ("torch_sdpa", "eager", "flex_attention")
FP32_RELATIVE_TOLERANCE = 1e-5


def _seed() -> int:
    pinned = os.environ.get("ATTNRES_TEST_SEED")
    return int(pinned) if pinned else int.from_bytes(os.urandom(6), "little")


@pytest.fixture
def poisoned_allocations() -> Iterator[None]:
    """Make ``torch.empty`` return NaN-filled tensors for the duration of a test."""
    import torch.utils.deterministic as deterministic

    was_enabled = torch.are_deterministic_algorithms_enabled()
    was_warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    was_filling = getattr(deterministic, "fill_uninitialized_memory")  # noqa: B009
    torch.use_deterministic_algorithms(True)
    setattr(deterministic, "fill_uninitialized_memory", True)  # noqa: B010
    try:
        assert torch.empty(4).isnan().all(), "uninitialised memory is not poisoned"
        yield
    finally:
        setattr(deterministic, "fill_uninitialized_memory", was_filling)  # noqa: B010
        torch.use_deterministic_algorithms(was_enabled, warn_only=was_warn_only)


@dataclass(frozen=True)
class Case:
    name: str
    batch: int = 2
    seq_q: int = 37
    seq_kv: int = 37
    heads_q: int = 4
    heads_kv: int = 4
    head_size: int = 32
    causal: bool = False
    mask: str | None = None  # None, "bool", "float"
    mask_shape: str = "full"  # full (B, Hq, Sq, Skv), "2d" (Sq, Skv), "keys" (B, 1, 1, Skv)
    scale: float | None = None
    strided: bool = False  # q/k/v are non-contiguous views of fused projections


CASES = (
    Case("self"),
    Case("cross", seq_q=19, seq_kv=45),
    Case("cross_longer_queries", seq_q=50, seq_kv=13),
    Case("gqa", heads_q=8, heads_kv=2),
    Case("mqa", heads_q=8, heads_kv=1, head_size=64),
    Case("causal", causal=True),
    Case("causal_cross_fewer_queries", seq_q=17, seq_kv=41, causal=True),
    Case("causal_cross_more_queries", seq_q=41, seq_kv=17, causal=True),
    Case("bool_mask", mask="bool"),
    Case("bool_mask_2d", mask="bool", mask_shape="2d", seq_q=23, seq_kv=29),
    Case("bool_key_padding", mask="bool", mask_shape="keys", seq_kv=40),
    Case("float_mask", mask="float"),
    Case("float_mask_2d", mask="float", mask_shape="2d", seq_q=21, seq_kv=33),
    Case("causal_bool_mask", causal=True, mask="bool"),
    Case("causal_float_mask_cross", causal=True, mask="float", seq_q=30, seq_kv=44),
    Case("custom_scale", scale=0.3),
    Case("head_size_16", head_size=16, scale=1.7),
    Case("strided_views", strided=True, seq_q=33, seq_kv=33),
    Case(
        "everything",
        batch=3,
        seq_q=29,
        seq_kv=53,
        heads_q=6,
        heads_kv=2,
        head_size=64,
        causal=True,
        mask="float",
        mask_shape="keys",
        scale=0.11,
    ),
)


def _inputs(
    case: Case, generator: torch.Generator, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    b, sq, skv = case.batch, case.seq_q, case.seq_kv
    hq, hkv, d = case.heads_q, case.heads_kv, case.head_size

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=dtype)

    if case.strided:
        # One fused projection output, sliced: non-contiguous q, k, v views.
        qkv = randn(b, sq, hq + 2 * hkv, d)
        q, k, v = torch.split(qkv, [hq, hkv, hkv], dim=2)
        assert not q.is_contiguous()
    else:
        q, k, v = randn(b, sq, hq, d), randn(b, skv, hkv, d), randn(b, skv, hkv, d)

    mask: torch.Tensor | None = None
    if case.mask is not None:
        shape = {"full": (b, hq, sq, skv), "2d": (sq, skv), "keys": (b, 1, 1, skv)}[case.mask_shape]
        if case.mask == "bool":
            mask = torch.rand(*shape, generator=generator) > 0.35
            # Key 0 always takes part, so no row is fully masked (causal keeps it too).
            mask[..., 0] = True
        else:
            mask = randn(*shape) * 2.0
            # A few -inf entries, never on key 0.
            drop = torch.rand(*shape, generator=generator) < 0.2
            drop[..., 0] = False
            mask = mask.masked_fill(drop, float("-inf"))
    return q, k, v, mask


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    causal: bool,
    scale: float | None,
) -> torch.Tensor:
    """Float64 attention, one (batch, head) at a time, written from the definition."""
    batch, seq_q, heads_q, head_size = q.shape
    seq_kv, heads_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    factor = 1.0 / math.sqrt(head_size) if scale is None else scale
    mask = None
    if attn_mask is not None:
        mask = attn_mask.expand(batch, heads_q, seq_q, seq_kv)
    out = torch.zeros(batch, seq_q, heads_q, head_size, dtype=torch.float64)
    q_pos = torch.arange(seq_q).unsqueeze(1)
    kv_pos = torch.arange(seq_kv).unsqueeze(0)
    for b in range(batch):
        for h in range(heads_q):
            kv_head = h // group  # query heads [g*i, g*(i+1)) share kv head i
            scores = (q[b, :, h].double() @ k[b, :, kv_head].double().T) * factor
            allowed = torch.ones(seq_q, seq_kv, dtype=torch.bool)
            if causal:
                allowed &= kv_pos <= q_pos  # top-left aligned, as SDPA's is_causal
            if mask is not None:
                if mask.dtype == torch.bool:
                    allowed &= mask[b, h]
                else:
                    scores = scores + mask[b, h].double()
            scores = scores.masked_fill(~allowed, float("-inf"))
            weights = torch.exp(scores - scores.max(dim=-1, keepdim=True).values)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out[b, :, h] = weights @ v[b, :, kv_head].double()
    return out


def _check(out: torch.Tensor, expected: torch.Tensor, *, rel_tol: float, context: str) -> None:
    assert out.shape == expected.shape, f"{context}: shape {tuple(out.shape)}"
    assert torch.isfinite(out).all(), f"{context}: output has NaN/inf (unwritten elements?)"
    got = out.double()
    relative = ((got - expected).norm() / expected.norm()).item()
    assert relative < rel_tol, f"{context}: relative error {relative:.3e} >= {rel_tol:.0e}"
    scale = expected.abs().max().item()
    assert torch.allclose(got, expected, rtol=rel_tol * 10, atol=rel_tol * 10 * scale), (
        f"{context}: elementwise mismatch, max abs diff {(got - expected).abs().max().item():.3e}"
    )


@pytest.fixture(scope="module", params=CPU_KERNELS)
def kernel(request: pytest.FixtureRequest) -> tuple[str, KernelFn]:
    fn = get_kernel(request.param)
    assert fn is not None, f"no kernel for {request.param}"
    return request.param, fn


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_fp32_matches_float64_reference(kernel: tuple[str, KernelFn], case: Case) -> None:
    name, fn = kernel
    seed = _seed()
    q, k, v, mask = _inputs(case, torch.Generator().manual_seed(seed))
    out = fn(q, k, v, mask, case.causal, case.scale)
    expected = reference(q, k, v, mask, case.causal, case.scale)
    assert out.dtype == torch.float32
    _check(
        out,
        expected,
        rel_tol=FP32_RELATIVE_TOLERANCE,
        context=f"{name}/{case.name} (ATTNRES_TEST_SEED={seed})",
    )


@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize(
    ("dtype", "rel_tol"), [(torch.float64, 1e-12), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)]
)
def test_other_dtypes_keep_q_dtype(
    kernel: tuple[str, KernelFn], dtype: torch.dtype, rel_tol: float
) -> None:
    name, fn = kernel
    seed = _seed()
    case = Case("dtype", heads_q=4, heads_kv=2, seq_q=21, seq_kv=30, mask="float", causal=True)
    q, k, v, mask = _inputs(case, torch.Generator().manual_seed(seed), dtype=dtype)
    out = fn(q, k, v, mask, case.causal, case.scale)
    assert out.dtype == dtype
    _check(
        out,
        reference(q, k, v, mask, case.causal, case.scale),
        rel_tol=rel_tol,
        context=f"{name}/{dtype} (ATTNRES_TEST_SEED={seed})",
    )


@pytest.mark.usefixtures("poisoned_allocations")
def test_fully_masked_rows_give_zeros(kernel: tuple[str, KernelFn]) -> None:
    """A query row with no key allowed returns 0 (torch SDPA's CPU behaviour), not NaN."""
    name, fn = kernel
    generator = torch.Generator().manual_seed(_seed())
    q = torch.randn(1, 5, 2, 16, generator=generator)
    k = torch.randn(1, 7, 2, 16, generator=generator)
    v = torch.randn(1, 7, 2, 16, generator=generator)
    mask = torch.ones(5, 7, dtype=torch.bool)
    mask[2] = False
    out = fn(q, k, v, mask, False, None)
    assert torch.equal(out[0, 2], torch.zeros(2, 16)), name
    others = torch.tensor([0, 1, 3, 4])
    expected = reference(q[:, others], k, v, mask[others], False, None)
    _check(out[:, others], expected, rel_tol=FP32_RELATIVE_TOLERANCE, context=name)


@pytest.mark.parametrize("case", [CASES[0], CASES[-1]], ids=["plain", "everything"])
def test_traces_as_one_graph(kernel: tuple[str, KernelFn], case: Case) -> None:
    """The adapters stay graph-break free under torch.compile(fullgraph=True)."""
    name, fn = kernel
    q, k, v, mask = _inputs(case, torch.Generator().manual_seed(_seed()))
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    out = compiled(q, k, v, mask, case.causal, case.scale)
    torch.testing.assert_close(out, fn(q, k, v, mask, case.causal, case.scale), msg=name)


@pytest.mark.usefixtures("poisoned_allocations")
def test_harness_catches_an_unwritten_element() -> None:
    """The checks above fail for a kernel that leaves one output element unwritten."""
    sdpa = get_kernel("torch_sdpa")
    assert sdpa is not None

    def lazy_kernel(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        attn_mask: torch.Tensor | None,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        good = sdpa(q, k, v, attn_mask, causal, scale)
        out = torch.empty_like(good)
        out.view(-1)[1:] = good.reshape(-1)[1:]  # element 0 never written
        return out

    case = CASES[0]
    q, k, v, mask = _inputs(case, torch.Generator().manual_seed(_seed()))
    out = lazy_kernel(q, k, v, mask, case.causal, case.scale)
    with pytest.raises(AssertionError, match="NaN/inf"):
        _check(out, reference(q, k, v, mask, False, None), rel_tol=1e-5, context="lazy")


def test_cudnn_adapter_never_falls_back_to_another_sdpa_kernel() -> None:
    """torch_cudnn_sdpa restricts SDPA to cuDNN: on CPU it raises instead of running math."""
    fn = get_kernel("torch_cudnn_sdpa")
    assert fn is not None
    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match=r"(?i)no (viable backend|available kernel)"):
        fn(q, q, q, None, False, None)
    # The restriction is scoped to the call: plain SDPA still works afterwards.
    sdpa = get_kernel("torch_sdpa")
    assert sdpa is not None
    assert torch.isfinite(sdpa(q, q, q, None, False, None)).all()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_specialized_torch_sdpa_equals_the_general_kernel(
    causal: bool, scale: float | None, gqa: bool, mask: str | None
) -> None:
    from attnres.kernels import get_kernel, specialized

    kernel = get_kernel("torch_sdpa")
    assert kernel is not None and hasattr(kernel, "specialize")
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(2, 5, 4, 16, generator=gen)
    k = torch.randn(2, 7, 2 if gqa else 4, 16, generator=gen)
    v = torch.randn(2, 7, 2 if gqa else 4, 16, generator=gen)
    attn_mask = None
    if mask == "bool":
        attn_mask = torch.rand(2, 1, 5, 7, generator=gen) > 0.3
        attn_mask[..., 0] = True  # no fully masked row
    elif mask == "float":
        attn_mask = torch.randn(2, 1, 5, 7, generator=gen)
    bound = specialized(kernel, causal, scale, gqa)
    expected = kernel(q, k, v, attn_mask, causal, scale)
    torch.testing.assert_close(bound(q, k, v, attn_mask), expected, rtol=0, atol=0)


def test_specialized_wraps_a_kernel_without_specialize() -> None:
    from attnres.kernels import specialized

    seen: list[tuple[object, ...]] = []

    def plain(q, k, v, attn_mask, causal, scale):  # type: ignore[no-untyped-def]
        seen.append((attn_mask, causal, scale))
        return q

    q = torch.zeros(1, 2, 1, 4)
    assert specialized(plain, True, 0.5, False)(q, q, q, None) is q
    assert seen == [(None, True, 0.5)]
