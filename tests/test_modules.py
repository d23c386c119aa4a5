"""``attnres.Attention``: numerics, input checks, resolution at construction only.

Outputs are compared with a float64 reference written here (not with another
kernel): fp32 results must be within 1e-5 relative error (Frobenius norm) for
every CPU backend (torch_sdpa, eager, flex_attention).
"""

from __future__ import annotations

import copy
import importlib.util
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from reference import reference, relative_error
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import attnres
from attnres import (
    Backend,
    BackendSpec,
    Platform,
    Requirements,
    ResolutionError,
    Role,
    component_scope,
    force_backend,
)
from attnres import machine as machine_mod
from attnres import modules as modules_mod
from attnres.kernels import KernelUnavailableError, get_kernel, register_kernel, unregister_kernel
from attnres.modules import Attention, KernelNotRegisteredError

# torch's own one-time notice when flex_attention runs outside torch.compile
# (raised inside torch; see attnres/kernels/flex_attention.py).
pytestmark = pytest.mark.filterwarnings(
    "ignore:flex_attention called without torch.compile:UserWarning"
)

CPU_BACKENDS = ("torch_sdpa", "eager", "flex_attention")
FP32_RELATIVE_ERROR = 1e-5


# The float64 reference and relative_error come from tests/reference.py.


@dataclass(frozen=True)
class Case:
    name: str
    batch: int = 2
    seq_q: int = 24
    seq_kv: int = 24
    heads: int = 4
    kv_heads: int = 4
    head_size: int = 32
    causal: bool = False
    mask: str | None = None  # "bool" | "float"
    scale: float | None = None
    role: str = "self"


CASES = (
    Case("self"),
    Case("cross", seq_q=19, seq_kv=41, role="cross"),
    Case("gqa", heads=8, kv_heads=2),
    Case("causal", causal=True),
    Case("bool_mask", mask="bool"),
    Case("float_mask", mask="float"),
    Case("custom_scale", scale=0.37),
    Case(
        "cross_gqa_float_mask", seq_q=9, seq_kv=33, heads=8, kv_heads=4, mask="float", role="cross"
    ),
    Case("causal_bool_mask", causal=True, mask="bool"),
)


def _inputs(case: Case, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(case.batch, case.seq_q, case.heads, case.head_size, generator=gen)
    k = torch.randn(case.batch, case.seq_kv, case.kv_heads, case.head_size, generator=gen)
    v = torch.randn(case.batch, case.seq_kv, case.kv_heads, case.head_size, generator=gen)
    mask: Tensor | None = None
    if case.mask == "bool":
        mask = torch.rand(case.batch, 1, case.seq_q, case.seq_kv, generator=gen) > 0.3
        mask[..., 0] = True  # every query keeps at least one key
    elif case.mask == "float":
        mask = torch.randn(case.batch, case.heads, case.seq_q, case.seq_kv, generator=gen)
    return q, k, v, mask


def _layer(case: Case, backend: str, **extra: Any) -> Attention:
    return Attention(
        case.heads,
        case.head_size,
        num_kv_heads=case.kv_heads,
        role=case.role,
        causal=case.causal,
        softmax_scale=case.scale,
        requirements=Requirements(attn_mask=case.mask is not None),
        name=f"test.{case.name}",
        backend=backend,
        **{"dtype": torch.float32, **extra},
    )


# =============================================================================
# Numerics
# =============================================================================


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_output_matches_float64_reference(case: Case, backend: str) -> None:
    layer = _layer(case, backend)
    assert layer.backend.name == backend
    q, k, v, mask = _inputs(case)
    out = layer(q, k, v, mask)
    assert out.shape == q.shape
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    ref = reference(q, k, v, mask, causal=case.causal, scale=case.scale)
    error = relative_error(out, ref)
    assert error < FP32_RELATIVE_ERROR, f"{backend} {case.name}: relative error {error:.3g}"


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_backend_chosen_by_force_backend_and_by_scope(backend: str) -> None:
    case = Case("self")
    q, k, v, _ = _inputs(case)
    ref = reference(q, k, v)
    with force_backend(backend):
        forced = Attention(case.heads, case.head_size, name="forced", dtype=torch.float32)
    with component_scope("transformer", backend=backend):
        scoped = Attention(case.heads, case.head_size, name="scoped", dtype=torch.float32)
    assert (forced.backend.name, forced.resolution.origin) == (backend, "forced")
    assert (scoped.backend.name, scoped.resolution.origin) == (backend, "component_override")
    for layer in (forced, scoped):
        assert layer.kernel is get_kernel(backend)
        assert relative_error(layer(q, k, v), ref) < FP32_RELATIVE_ERROR


def test_keyword_arguments_and_non_contiguous_inputs() -> None:
    layer = Attention(4, 16, backend="torch_sdpa")
    qkv = torch.randn(2, 10, 3, 4, 16)  # a fused projection, split into views
    q, k, v = qkv.unbind(dim=2)
    assert not q.is_contiguous()
    out = layer(q=q, k=k, v=v, attn_mask=None)
    assert relative_error(out, reference(q, k, v)) < FP32_RELATIVE_ERROR


def test_default_is_the_platform_default_and_the_default_dtype() -> None:
    layer = Attention(4, 32)
    assert layer.pending and layer.backend is None
    attnres.bind(layer)
    assert layer.backend == Backend("torch_sdpa")
    assert layer.resolution.origin == "none"
    assert layer.layer_spec.dtype == "float32"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert Attention(4, 32).layer_spec.dtype == "float64"
    finally:
        torch.set_default_dtype(previous)


def test_requirements_follow_the_layer() -> None:
    plain = Attention(8, 32)
    assert plain.layer_spec.requirements == Requirements()
    gqa_causal = Attention(8, 32, num_kv_heads=2, causal=True)
    assert gqa_causal.layer_spec.requirements == Requirements(causal=True, gqa=True)
    merged = Attention(8, 32, causal=True, requirements=["attn_mask"])
    assert merged.layer_spec.requirements == Requirements(causal=True, attn_mask=True)


# =============================================================================
# Input checks in forward: ValueError saying what did not match
# =============================================================================


def _qkv(
    q: tuple[int, ...] = (2, 5, 8, 64),
    k: tuple[int, ...] = (2, 7, 2, 64),
    v: tuple[int, ...] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    return torch.randn(q), torch.randn(k), torch.randn(k if v is None else v)


@pytest.fixture
def gqa_layer() -> Attention:
    return Attention(8, 64, num_kv_heads=2, name="checked", backend="torch_sdpa")


def test_matching_inputs_pass(gqa_layer: Attention) -> None:
    assert gqa_layer(*_qkv()).shape == (2, 5, 8, 64)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (dict(q=(5, 8, 64)), r"rank: q must have 4 dims .* got 3"),
        (dict(k=(2, 7, 2, 1, 64)), r"rank: k must have 4 dims .* got 5"),
        (dict(v=(2, 7, 128)), r"rank: v must have 4 dims .* got 3"),
        (dict(q=(2, 5, 8, 32)), r"head size: expected 64; got q \(2, 5, 8, 32\)"),
        (
            dict(k=(2, 7, 2, 32), v=(2, 7, 2, 64)),
            r"head size: expected 64; got q .* k \(2, 7, 2, 32\)",
        ),
        (dict(v=(2, 7, 2, 32)), r"head size: expected 64; .* v \(2, 7, 2, 32\)"),
        (dict(q=(2, 5, 4, 64)), r"heads: q has 4 heads, expected 8"),
        (
            dict(k=(2, 7, 4, 64)),
            r"heads: k and v must have 2 heads \(grouped-query: 8 query heads share 2\)",
        ),
        (dict(v=(2, 7, 8, 64)), r"heads: k and v must have 2 heads"),
        (dict(k=(3, 7, 2, 64)), r"batch: q, k and v must have the same batch size"),
        (dict(v=(2, 9, 2, 64)), r"seq_kv: k and v must have the same shape"),
    ],
)
def test_shape_mismatch_is_a_value_error(
    gqa_layer: Attention, shapes: dict[str, tuple[int, ...]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        gqa_layer(*_qkv(**shapes))


def test_shape_message_states_what_the_layer_takes(gqa_layer: Attention) -> None:
    with pytest.raises(ValueError) as info:
        gqa_layer(*_qkv(q=(2, 5, 8, 32)))
    assert "this layer takes q (batch, seq, 8, 64) and k, v (batch, seq_kv, 2, 64)" in str(
        info.value
    )


def test_dtype_the_kernel_cannot_take_is_a_value_error() -> None:
    sdpa = Attention(4, 32, backend="torch_sdpa", dtype=torch.float32)
    q = torch.ones(1, 3, 4, 32, dtype=torch.int32)
    with pytest.raises(
        ValueError,
        match=r"dtype: backend 'torch_sdpa' cannot take torch.int32 "
        r"\(it takes bfloat16, float16, float32, float64\)",
    ):
        sdpa(q, q, q)
    flex = Attention(4, 32, backend="flex_attention", dtype=torch.float32)
    q64 = torch.randn(1, 3, 4, 32, dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"dtype: backend 'flex_attention' cannot take "
        r"torch.float64 \(it takes bfloat16, float16, float32\)",
    ):
        flex(q64, q64, q64)


def test_mixed_dtypes_are_a_value_error_not_a_kernel_crash() -> None:
    layer = Attention(4, 32, backend="torch_sdpa")
    q = torch.randn(1, 3, 4, 32)
    k = torch.randn(1, 3, 4, 32, dtype=torch.float64)
    with pytest.raises(
        ValueError,
        match=r"dtype: q, k and v must have the same dtype, got "
        r"torch.float32, torch.float64, torch.float32",
    ) as info:
        layer(q, k, q)
    assert isinstance(info.value.__cause__, RuntimeError)  # the kernel's own error is kept


def test_a_kernel_error_on_matching_inputs_is_not_rewritten() -> None:
    layer = Attention(4, 32, backend="torch_sdpa", requirements=["attn_mask"])
    q = torch.randn(1, 3, 4, 32)
    bad_mask = torch.ones(5, 7, dtype=torch.bool)  # does not broadcast to (1, 4, 3, 3)
    with pytest.raises(RuntimeError):
        layer(q, q, q, bad_mask)


# =============================================================================
# Construction: arguments, role, errors
# =============================================================================


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_heads=0, head_size=64), r"num_heads: expected a positive integer, got 0"),
        (dict(num_heads=True, head_size=64), r"num_heads: expected a positive integer"),
        (dict(num_heads=8, head_size=64.0), r"head_size: expected a positive integer"),
        (dict(num_heads=8, head_size=64, num_kv_heads=3), r"num_kv_heads: 3 does not divide"),
        (dict(num_heads=8, head_size=64, num_kv_heads=-1), r"num_kv_heads: expected a positive"),
        (dict(num_heads=8, head_size=64, softmax_scale="0.1"), r"softmax_scale: expected a num"),
        (dict(num_heads=8, head_size=64, softmax_scale=float("nan")), r"softmax_scale: .* finite"),
        (dict(num_heads=8, head_size=64, role="diagonal"), r"role must be 'self' or 'cross'"),
        (
            dict(num_heads=8, head_size=64, role="cross", is_cross_attention=False),
            r"role='cross' contradicts is_cross_attention=False",
        ),
        (dict(num_heads=8, head_size=64, is_cross_attention=1), r"is_cross_attention: expected"),
        (dict(num_heads=8, head_size=64, causal="yes"), r"causal: expected a bool"),
        (dict(num_heads=8, head_size=64, dtype="float7"), r"dtype: unknown dtype 'float7'"),
    ],
)
def test_bad_arguments_are_value_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Attention(**kwargs)
    assert attnres.decisions() == ()  # nothing was resolved


def test_is_cross_attention_is_a_synonym_of_role_cross() -> None:
    by_flag = Attention(8, 64, is_cross_attention=True)
    by_role = Attention(8, 64, role="cross")
    by_enum = Attention(8, 64, role=Role.CROSS, is_cross_attention=True)
    for layer in (by_flag, by_role, by_enum):
        assert layer.role is Role.CROSS
        assert layer.layer_spec.role is Role.CROSS
    assert Attention(8, 64, is_cross_attention=False).role is Role.SELF
    assert by_flag.layer_spec == by_role.layer_spec


def test_role_reaches_the_resolver_through_the_scope() -> None:
    with component_scope("transformer", role_backends={"cross": "eager"}) as scope:
        attn1 = Attention(4, 32, name="attn1", dtype=torch.float32)
        attn2 = Attention(4, 32, role="cross", name="attn2", dtype=torch.float32)
        attn2_flag = Attention(4, 32, is_cross_attention=True, name="attn2b", dtype="fp32")
    assert attn1.backend.name == "torch_sdpa"
    assert (attn2.backend.name, attn2.resolution.origin) == ("eager", "role_override")
    assert (attn2_flag.backend.name, attn2_flag.resolution.origin) == ("eager", "role_override")
    # different kernels are bound, not only different names
    assert attn2.kernel is get_kernel("eager")
    assert attn1.kernel is get_kernel("torch_sdpa")
    assert attn1.kernel is not attn2.kernel
    assert [d.backend for d in scope.decisions] == ["torch_sdpa", "eager", "eager"]
    q, k, v, _ = _inputs(Case("x", seq_kv=11))
    for layer in (attn1, attn2):
        assert relative_error(layer(q, k, v), reference(q, k, v)) < FP32_RELATIVE_ERROR


def test_decision_is_recorded_under_the_layer_name_and_scope_component() -> None:
    with component_scope("text_encoder"):
        layer = Attention(4, 32, name="blocks.0.attn1", dtype=torch.float32)
    (decision,) = attnres.decisions()
    assert decision.component == "text_encoder"
    assert decision.layer == "blocks.0.attn1"
    assert decision.backend == "torch_sdpa" == layer.backend.name
    assert decision.origin == layer.resolution.origin
    assert decision.reason is None
    assert decision.digest == layer.resolution.trace.digest
    assert layer.resolution.component == "text_encoder"
    assert layer.resolution.layer == "blocks.0.attn1"


def test_decision_outside_a_scope_has_no_component() -> None:
    attnres.bind(Attention(4, 32, name="loose"))
    (decision,) = attnres.decisions()
    assert (decision.component, decision.layer) == (None, "loose")


def test_rejected_resolution_is_a_resolution_error() -> None:
    with pytest.raises(ResolutionError, match=r"Attention backend 'fa'") as info:
        Attention(4, 64, backend="fa", name="needs_fa", dtype=torch.float32)
    assert isinstance(info.value, ValueError)
    assert info.value.trace.outcome.status == "rejected"
    (decision,) = attnres.decisions()
    assert decision.backend is None


def test_unknown_backend_name_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"backend"):
        Attention(4, 64, backend="flahs_attn")


def test_rule_no_kernel_strict_request_is_rejected_saying_how_to_register() -> None:
    """Selected means runnable: a strict request for a kernel-less backend is rejected."""
    platform = Platform.simulate("cuda:sm90+all")
    with pytest.raises(attnres.ResolutionError) as info:
        Attention(
            8,
            128,
            dtype=torch.bfloat16,
            backend="sliding_tile_attn",
            name="blocks.0.attn1",
            platform=platform,
        )
    error = info.value
    assert error.code == "no_kernel"
    message = str(error)
    assert message.startswith("Attention backend 'sliding_tile_attn' is not available")
    assert "a sparse backend" in message
    assert "attnres.kernels.register_kernel('sliding_tile_attn', fn)" in message
    assert error.trace.input.needs_kernel is True
    (decision,) = attnres.decisions()  # the resolver rejected it: no backend recorded
    assert decision.backend is None


def test_rule_no_kernel_in_a_scope_names_the_component() -> None:
    platform = Platform.simulate("cuda:sm90+all")
    with (
        pytest.raises(attnres.ResolutionError, match=r"for component 'transformer'$"),
        component_scope("transformer", backend="video_sparse_attn", require_selection=False),
    ):
        Attention(8, 128, dtype="bf16", platform=platform, name="attn1")


def test_rule_no_kernel_relaxed_request_falls_back() -> None:
    """A relaxed origin (the operator's global flag here) falls back, reason and all."""
    platform = Platform.simulate("cuda:sm90+all")
    config = attnres.SelectionConfig(
        global_backend="sliding_tile_attn", global_backend_explicit=True
    )
    previous = attnres.set_selection_config(config)
    try:
        with component_scope("text_encoder"):
            layer = Attention(8, 64, dtype="float32", platform=platform, name="attn")
    finally:
        attnres.set_selection_config(previous)
    assert layer.backend == Backend("torch_sdpa")
    assert layer.resolution.reason == "global backend fallback"
    codes = [
        f.code
        for r in layer.resolution.trace.records
        if getattr(r, "check", None) == "available"
        for f in r.failures
    ]
    assert "no_kernel" in codes


def test_kernel_removed_after_resolution_is_kernel_not_registered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The defensive path: a kernel gone between resolve() and binding (another thread)."""
    from attnres.kernels import clear_kernel_cache

    monkeypatch.setattr(modules_mod, "get_kernel", lambda name: None)
    # layers bound earlier memoised torch_sdpa's kernel: a registry change (the
    # public clear_kernel_cache) drops every memo, as a real unregister would
    clear_kernel_cache()
    with pytest.raises(KernelNotRegisteredError, match="no kernel is registered") as info:
        Attention(4, 32, dtype="float32", name="attn")
    assert isinstance(info.value, RuntimeError)
    assert info.value.backend == Backend("torch_sdpa")


def test_a_kernel_registered_after_a_layer_bound_serves_the_next_layer() -> None:
    """The bound-kernel memo follows the kernel registry (register, then unregister)."""
    from attnres.kernels import register_kernel, unregister_kernel

    first = Attention(4, 32, dtype="float32", name="before")
    calls: list[str] = []

    def mine(
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None
    ) -> Tensor:
        calls.append("mine")
        return q

    register_kernel("torch_sdpa", mine, replace=True)
    try:
        second = Attention(4, 32, dtype="float32", name="after")
        q = torch.zeros(1, 3, 4, 32)
        second(q, q, q)
        assert calls == ["mine"]
        assert first.kernel is not second.kernel
    finally:
        unregister_kernel("torch_sdpa")
        register_kernel("torch_sdpa", "attnres.kernels.torch_sdpa:make_kernel")
    third = Attention(4, 32, dtype="float32", name="restored")
    third(q, q, q)
    assert calls == ["mine"]  # the built-in adapter again


def test_a_plan_that_does_not_run_still_selects_a_kernel_less_backend() -> None:
    """resolve() without needs_kernel plans (a plugin may supply the kernel)."""
    platform = Platform.simulate("cuda:sm90+all")
    spec = attnres.LayerSpec(head_size=128, dtype="bf16")
    res = attnres.resolve(spec, platform=platform, backend="sliding_tile_attn")
    assert res.backend == Backend("sliding_tile_attn")
    assert res.trace.input.needs_kernel is False


def test_sparse_backend_with_a_registered_kernel_is_used() -> None:
    platform = Platform.simulate("cuda:sm90+all")
    calls: list[tuple[int, ...]] = []

    def tile_kernel(
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None
    ) -> Tensor:
        calls.append(tuple(q.shape))
        return q

    register_kernel("sliding_tile_attn", tile_kernel)
    try:
        layer = Attention(
            8, 128, dtype=torch.bfloat16, backend="sliding_tile_attn", platform=platform
        )
        q = torch.randn(1, 4, 8, 128, dtype=torch.bfloat16)
        assert layer(q, q, q) is q
        assert calls == [(1, 4, 8, 128)]
    finally:
        unregister_kernel("sliding_tile_attn")


def test_kernel_package_that_cannot_be_imported_is_an_import_error() -> None:
    if importlib.util.find_spec("flash_attn") is not None:  # pragma: no cover
        pytest.skip("flash_attn is importable here")
    platform = Platform.simulate("cuda:sm90+flash_attn")
    with pytest.raises(
        KernelUnavailableError, match=r"'fa' was selected for layer 'attn1'"
    ) as info:
        Attention(8, 128, dtype=torch.bfloat16, backend="fa", name="attn1", platform=platform)
    assert isinstance(info.value, ImportError)
    assert "flash_attn" in str(info.value)


@pytest.fixture
def custom_backend() -> Iterator[tuple[str, list[tuple[bool, float | None]]]]:
    """A third-party backend (fp32 only) with a kernel that records its calls."""
    name = "test_modules_attn"
    calls: list[tuple[bool, float | None]] = []
    eager = get_kernel("eager")
    assert eager is not None

    def kernel(
        q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float | None
    ) -> Tensor:
        calls.append((causal, scale))
        return eager(q, k, v, mask, causal, scale)

    attnres.register_backend(
        BackendSpec(
            name=name,
            sparse=False,
            platforms=("cpu", "cuda"),
            dtypes=("float32",),
            implements=("causal", "attn_mask", "gqa", "custom_scale"),
        )
    )
    try:
        register_kernel(name, kernel)
        yield name, calls
    finally:
        unregister_kernel(name)
        attnres.unregister_backend(name)


def test_registered_custom_kernel_is_used(
    custom_backend: tuple[str, list[tuple[bool, float | None]]],
) -> None:
    name, calls = custom_backend
    layer = Attention(4, 32, causal=True, softmax_scale=0.25, backend=name, dtype="float32")
    assert layer.backend == Backend(name)
    q, k, v, _ = _inputs(Case("x"))
    out = layer(q, k, v)
    assert calls == [(True, 0.25)]
    ref = reference(q, k, v, causal=True, scale=0.25)
    assert relative_error(out, ref) < FP32_RELATIVE_ERROR
    with pytest.raises(
        ValueError,
        match=rf"dtype: backend '{name}' cannot take torch.float64 "
        r"\(it takes float32\)",
    ):
        layer(q.double(), k.double(), v.double())


def test_late_binding_and_requests_resolve_for_a_kernel_too(
    custom_backend: tuple[str, list[Any]],
) -> None:
    """Issue 12 with issue 13: a layer that binds late, and a request's backend,
    are resolved for a layer that will run (no_kernel), like one built bound."""
    name, _ = custom_backend
    unregister_kernel(name)
    layer = Attention(4, 32, backend=name)  # no dtype: pending, nothing resolved
    assert layer.pending
    with pytest.raises(attnres.ResolutionError, match=r"no kernel is registered") as info:
        attnres.bind(layer, dtype="float32")
    assert info.value.code == "no_kernel"
    assert info.value.trace.input.needs_kernel
    bound = Attention(4, 32, dtype="float32")
    assert bound.resolution is not None and bound.resolution.trace.input.needs_kernel
    with (
        pytest.raises(attnres.RequestBackendError, match=r"no kernel is registered"),
        attnres.request_backend(bound, name),
    ):
        pass
    assert bound.backend != Backend(name)


def test_custom_backend_without_kernel_says_how_to_register_one(
    custom_backend: tuple[str, list[Any]],
) -> None:
    name, _ = custom_backend
    unregister_kernel(name)
    with pytest.raises(attnres.ResolutionError, match=r"no kernel is registered for it") as info:
        Attention(4, 32, backend=name, dtype="float32")
    assert info.value.code == "no_kernel"
    assert f"attnres.kernels.register_kernel('{name}', fn)" in str(info.value)
    # registering the kernel changes the answer at once (the resolver's cache forgets)
    register_kernel(name, "attnres.kernels.eager:make_kernel")
    assert Attention(4, 32, backend=name, dtype="float32").backend == Backend(name)


# =============================================================================
# Resolution happens once, at construction
# =============================================================================


@pytest.fixture
def machine_runs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every run of the resolution machine (the cold path of resolve)."""
    runs: list[object] = []
    real = machine_mod.run_machine

    def counting(inp: Any) -> Any:
        runs.append(inp)
        return real(inp)

    monkeypatch.setattr(machine_mod, "run_machine", counting)
    return runs


def test_identical_layers_run_the_machine_once(machine_runs: list[object]) -> None:
    with component_scope("transformer"):
        layers = [Attention(8, 64, name="attn1", dtype="float32") for _ in range(10)]
    assert len(machine_runs) == 1
    assert len(attnres.decisions()) == 10  # every layer still records its decision
    assert {layer.backend.name for layer in layers} == {"torch_sdpa"}
    assert len({id(layer.resolution) for layer in layers}) == 1  # the cached Resolution


def test_a_48_block_model_resolves_each_distinct_layer_once(machine_runs: list[object]) -> None:
    with component_scope("transformer", role_backends={"cross": "eager"}):
        blocks = [
            (
                Attention(8, 64, name="attn1", dtype="float32"),
                Attention(8, 64, role="cross", name="attn2", dtype="float32"),
            )
            for _ in range(48)
        ]
    assert len(machine_runs) == 2
    assert len(attnres.decisions()) == 96
    assert {(a.backend.name, b.backend.name) for a, b in blocks} == {("torch_sdpa", "eager")}


def test_forward_makes_no_decision_and_no_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    with component_scope("transformer"):
        layer = Attention(8, 32, num_kv_heads=4, causal=True, name="attn1")
    attnres.bind(layer)
    recorded = attnres.decisions()

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("forward must not resolve or look anything up")

    for target, attr in [
        (attnres.runtime, "resolve"),
        (machine_mod, "run_machine"),
        (machine_mod, "detect_origin"),
        (modules_mod, "lookup"),
        (modules_mod, "get_kernel"),
        (modules_mod, "lookup_spec"),
        (attnres.kernels, "get_kernel"),
        (attnres.backends, "get_spec"),
        (attnres.backends, "lookup_spec"),
        (Platform, "detect"),
    ]:
        monkeypatch.setattr(target, attr, forbidden)
    q, k, v, _ = _inputs(Case("x", heads=8, kv_heads=4))
    for _ in range(3):
        out = layer(q, k, v)
    assert attnres.decisions() == recorded
    assert relative_error(out, reference(q, k, v, causal=True)) < FP32_RELATIVE_ERROR


# =============================================================================
# Meta device, copies, hooks
# =============================================================================


class _NoTensorOps(TorchFunctionMode):
    """Fails on any torch function call: resolution must not touch tensors."""

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        raise AssertionError(f"construction called {func}")


def test_layers_build_on_the_meta_device_without_touching_tensors() -> None:
    with torch.device("meta"), component_scope("transformer"), _NoTensorOps():
        layers = [
            Attention(8, 64, name="attn1", dtype="float32"),
            Attention(8, 64, role="cross", name="attn2", dtype="float32"),
        ]
    assert [layer.backend.name for layer in layers] == ["torch_sdpa", "torch_sdpa"]
    assert list(layers[0].parameters()) == [] and list(layers[0].buffers()) == []
    assert len(attnres.decisions()) == 2


def test_a_block_builds_on_meta_and_runs_there() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.to_q = nn.Linear(64, 64)
            self.to_k = nn.Linear(64, 64)
            self.to_v = nn.Linear(64, 64)
            self.attn = Attention(4, 16, name="attn1")

        def forward(self, x: Tensor) -> Tensor:
            b, s, _ = x.shape
            q, k, v = (p(x).view(b, s, 4, 16) for p in (self.to_q, self.to_k, self.to_v))
            out: Tensor = self.attn(q, k, v)
            return out.reshape(b, s, 64)

    with torch.device("meta"):
        block = Block()
    assert block.to_q.weight.is_meta
    out = block(torch.empty(2, 7, 64, device="meta"))
    assert out.is_meta and out.shape == (2, 7, 64)


def test_deepcopy_and_pickle_keep_the_decision_without_resolving(
    machine_runs: list[object],
) -> None:
    layer = Attention(4, 32, causal=True, backend="eager", name="attn1", dtype="float32")
    copied = copy.deepcopy(layer)
    restored = pickle.loads(pickle.dumps(layer))
    assert len(machine_runs) == 1
    q, k, v, _ = _inputs(Case("x"))
    expected = layer(q, k, v)
    for other in (copied, restored):
        assert other.backend == layer.backend
        assert other.resolution == layer.resolution
        assert other.kernel is get_kernel("eager")
        torch.testing.assert_close(other(q, k, v), expected, rtol=0, atol=0)


def test_module_hooks_still_run() -> None:
    layer = Attention(4, 32)
    q, k, v, _ = _inputs(Case("x"))
    plain = layer(q, k, v)
    seen: list[str] = []

    def pre(module: nn.Module, args: tuple[Any, ...]) -> None:
        seen.append("pre")

    def post(module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        seen.append("post")
        return out * 2

    handles = [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    torch.testing.assert_close(layer(q, k, v), plain * 2)
    assert seen == ["pre", "post"]
    for handle in handles:
        handle.remove()
    global_handle = nn.modules.module.register_module_forward_hook(
        lambda module, args, out: out + 1 if isinstance(module, Attention) else None
    )
    try:
        torch.testing.assert_close(layer(q, k, v), plain + 1)
    finally:
        global_handle.remove()
    torch.testing.assert_close(layer(q, k, v), plain)


def test_torch_still_has_the_call_path_the_fast_call_reads() -> None:
    """Fails loudly when a torch release changes nn.Module's call internals.

    attnres._fastcall skips nn.Module.__call__ only when torch's own hook
    registries say nothing would happen; if they move, the shortcut would be
    blind to hooks. (The hook test above checks that they still fire.)
    """
    from attnres._fastcall import torch_call_path_problems

    assert torch_call_path_problems() == []
    layer = Attention(4, 32, backend="torch_sdpa")
    q, k, v, _ = _inputs(Case("x"))
    fired: list[str] = []
    handle = nn.modules.module.register_module_forward_pre_hook(
        lambda module, args: fired.append(type(module).__name__)
    )
    try:
        layer(q, k, v)
    finally:
        handle.remove()
    assert fired == ["Attention"]


def test_gradients_flow_through_the_layer() -> None:
    layer = Attention(4, 32, backend="torch_sdpa")
    q, k, v, _ = _inputs(Case("x"))
    q.requires_grad_(True)
    (grad,) = torch.autograd.grad(layer(q, k, v).sum(), q)
    assert grad.shape == q.shape and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_extra_repr_names_the_backend_and_reason() -> None:
    layer = Attention(8, 64, num_kv_heads=2, causal=True, role="cross")
    assert "backend=pending (dtype float32 so far)" in repr(layer)
    attnres.bind(layer)
    text = repr(layer)
    assert "num_heads=8, num_kv_heads=2, head_size=64, role=cross, causal=True" in text
    assert "backend=torch_sdpa" in text
    with attnres.component_scope("vae"):
        attnres.set_selection_config(attnres.SelectionConfig(global_backend="fa"))
        fallback = Attention(8, 64)
    attnres.bind(fallback)
    assert fallback.resolution.reason == "global backend fallback"
    assert "reason='global backend fallback'" in repr(fallback)


def test_configuration_is_read_only_after_construction() -> None:
    layer = Attention(8, 64, num_kv_heads=4, causal=True, softmax_scale=0.5)
    assert (layer.num_heads, layer.num_kv_heads, layer.head_size) == (8, 4, 64)
    assert (layer.causal, layer.softmax_scale, layer.role) == (True, 0.5, Role.SELF)
    for name, value in [("causal", False), ("num_heads", 4), ("softmax_scale", 1.0)]:
        with pytest.raises(AttributeError):
            setattr(layer, name, value)
    assert layer.causal is True
