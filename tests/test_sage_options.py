"""Issue 23: SageAttention's options through the function ``sageattn`` runs per GPU.

``sageattn`` (thu-ml/SageAttention d1a57a54, sageattention/core.py) picks one
function by compute capability, passes it fixed settings and drops any keyword it
does not know; a layer with options calls that function itself. The fakes
(tests/test_kernels_fakes.py ``_add_sage_functions``, tests/test_masks.py
``fake_sage``) keep the real signatures, swallow unknown keywords and refuse the
values the real bodies refuse. The device is simulated by patching
``torch.cuda.get_device_capability``, the call ``sageattn`` itself makes.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_kernels_fakes import Calls, _fake_core, _scale
from test_masks import fake_sage

import attnres
from attnres.backends import entry_point_options, get_spec
from attnres.errors import BackendOptionError
from attnres.kernels import clear_kernel_cache
from attnres.kernels.lse import clear_lse_cache


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    seen = Calls()
    monkeypatch.setitem(sys.modules, "sageattention", fake_sage(seen))
    clear_kernel_cache()
    clear_lse_cache()
    yield seen
    clear_kernel_cache()
    clear_lse_cache()


def _device(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def _platform(capability: tuple[int, int]) -> attnres.Platform:
    return attnres.Platform.simulate(f"cuda:sm{capability[0]}{capability[1]}+sageattention")


def _layer(capability: tuple[int, int], options: dict[str, Any], **kw: Any) -> attnres.Attention:
    return attnres.Attention(
        4, 64, num_kv_heads=2, dtype=torch.float16, platform=_platform(capability),
        backend="sage", name="attn", backend_options={"sage": options}, **kw,
    )  # fmt: skip


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 8, 4, 64, generator=gen).half()
    k, v = (torch.randn(2, 8, 2, 64, generator=gen).half() for _ in range(2))
    return q, k, v


@pytest.mark.parametrize(
    ("capability", "options", "function", "expected"),
    [
        # sm80: sageattn passes pv_accum_dtype="fp32"; the user's granularity on top
        ((8, 0), {"qk_quant_gran": "per_warp"}, "sageattn_qk_int8_pv_fp16_cuda",
         {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32"}),
        ((8, 6), {"quantization_backend": "cuda", "smooth_k": False},
         "sageattn_qk_int8_pv_fp16_triton", {"quantization_backend": "cuda", "smooth_k": False}),
        ((8, 9), {"pv_accum_dtype": "fp32", "smooth_v": True}, "sageattn_qk_int8_pv_fp8_cuda",
         {"pv_accum_dtype": "fp32", "smooth_v": True, "qk_quant_gran": "per_thread"}),
        ((9, 0), {"qk_quant_gran": "per_warp"}, "sageattn_qk_int8_pv_fp8_cuda_sm90",
         {"qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp32"}),
        # sm120: sageattn's own per_warp and fp32+fp16 stay under the user's smooth_k
        ((12, 0), {"smooth_k": False}, "sageattn_qk_int8_pv_fp8_cuda",
         {"smooth_k": False, "qk_quant_gran": "per_warp", "pv_accum_dtype": "fp32+fp16"}),
    ],
)  # fmt: skip
def test_rule_sage_options_reach_the_function_sageattn_runs_on_the_device(
    calls: Calls,
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int],
    options: dict[str, Any],
    function: str,
    expected: dict[str, Any],
) -> None:
    _device(monkeypatch, capability)
    layer = _layer(capability, options)
    q, k, v = _qkv()
    out = layer(q, k, v)
    ref = _fake_core(q, k, v, scale=_scale(None, 64), causal=None)
    assert torch.equal(out, ref)
    assert [c["function"] for c in calls.seen] == [function]
    assert expected.items() <= calls.seen[0].items()
    # recorded in the trace, as every option is
    recorded = layer.resolution.trace.input.layer.backend_options  # type: ignore[union-attr]
    assert recorded == (("sage_attn", tuple(sorted(options.items()))),)


def test_sage_without_options_calls_sageattn_itself(
    calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    layer = attnres.Attention(
        4, 64, num_kv_heads=2, dtype=torch.float16, platform=_platform((8, 9)), backend="sage"
    )
    layer(*_qkv())
    assert len(calls.seen) == 1 and "function" not in calls.seen[0]  # sageattn's own record


@pytest.mark.parametrize(
    ("capability", "options", "expected"),
    [
        ((8, 6), {"qk_quant_gran": "per_warp"},
         "sage_attn.qk_quant_gran is not taken by sageattn_qk_int8_pv_fp16_triton, the function "
         "sage_attn runs on sm86"),
        ((9, 0), {"pv_accum_dtype": "fp32"},
         "sage_attn.pv_accum_dtype='fp32' is not taken by sageattn_qk_int8_pv_fp8_cuda_sm90"),
        ((9, 0), {"smooth_v": True}, "smooth_v is not taken by sageattn_qk_int8_pv_fp8_cuda_sm90"),
        ((12, 1), {"qk_quant_gran": "per_thread"},
         "runs on sm121; expected one of 'per_warp'"),
        ((8, 0), {"pv_accum_dtype": "fp32+fp16"},
         "not taken by sageattn_qk_int8_pv_fp16_cuda, the function sage_attn runs on sm80"),
    ],
)  # fmt: skip
def test_rule_sage_option_the_gpus_function_does_not_take_is_refused_at_bind(
    calls: Calls, capability: tuple[int, int], options: dict[str, Any], expected: str
) -> None:
    with pytest.raises(BackendOptionError) as info:
        _layer(capability, options)
    message = " ".join(str(info.value).split())
    assert expected in message and "for layer 'attn'" in message, message
    assert "Drop" in message or "expected" in message
    assert (info.value.backend, info.value.option) == ("sage_attn", next(iter(options)))
    assert calls.seen == []  # refused before any kernel ran


def test_rule_sage_option_no_function_takes_is_refused_by_the_one_checker() -> None:
    with pytest.raises(BackendOptionError, match=r"pv_accum_dtype='bf16' is not allowed"):
        attnres.LayerSpec(64, "fp16", backend_options={"sage": {"pv_accum_dtype": "bf16"}})
    with pytest.raises(BackendOptionError, match=r"did you mean 'qk_quant_gran'"):
        attnres.LayerSpec(64, "fp16", backend_options={"sage": {"qk_quant_gra": "per_warp"}})


def test_rule_sage_options_are_checked_again_on_the_tensors_device(
    calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Planned for sm89, run on an sm86 device: sageattn would run the Triton
    function there, which takes no granularity."""
    layer = _layer((8, 9), {"qk_quant_gran": "per_warp"})
    _device(monkeypatch, (8, 6))
    with pytest.raises(BackendOptionError, match=r"on sm86 .*tensors' device|tensors' device"):
        layer(*_qkv())
    assert calls.seen == []


def test_the_fakes_keep_sageattentions_signatures() -> None:
    """What the adapter works around, as the fakes (and the real package) behave."""
    module = fake_sage(Calls())
    q = torch.randn(1, 4, 2, 64).half()
    # sageattn swallows what it does not know: no error, the option is lost
    module.sageattn(q, q, q, tensor_layout="NHD", qk_quant_gran="per_warp")
    with pytest.raises(NotImplementedError, match="fp32\\+fp32' for sm90"):
        module.sageattn_qk_int8_pv_fp8_cuda_sm90(
            q, q, q, tensor_layout="NHD", pv_accum_dtype="fp32"
        )
    with pytest.raises(ValueError, match="Unsupported quantization backend"):
        module.sageattn_qk_int8_pv_fp16_triton(
            q, q, q, tensor_layout="NHD", quantization_backend="x"
        )
    with pytest.raises(AssertionError, match="qk_quant_gran must be"):
        module.sageattn_qk_int8_pv_fp16_cuda(q, q, q, tensor_layout="NHD", qk_quant_gran="x")


def test_every_sage_gpu_has_a_function_and_each_option_is_declared() -> None:
    """The table covers every capability the spec admits (the dispatcher's own list),
    and each function's option is the declared option with a subset of its values."""
    spec = get_spec("sage_attn")
    rule = spec.capabilities["cuda"]
    assert rule.exact is not None
    declared = {o.name: o for o in spec.options}
    for capability in rule.exact:
        entry = entry_point_options("sage_attn", (("smooth_k", True),), capability)
        assert entry is not None and capability in entry.capabilities
    for entry in spec.entry_points:
        for option in entry.options:
            assert set(option.choices) <= set(declared[option.name].choices)
            assert option.kind == declared[option.name].kind
    assert {e.name for e in spec.entry_points} == {
        "sageattn_qk_int8_pv_fp16_cuda", "sageattn_qk_int8_pv_fp16_triton",
        "sageattn_qk_int8_pv_fp8_cuda", "sageattn_qk_int8_pv_fp8_cuda_sm90", "sageattn_varlen",
    }  # fmt: skip


# -- the unpad route: sageattn_varlen takes smooth_k only ---------------------------


def test_rule_sage_options_on_the_unpad_route(
    calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    _device(monkeypatch, (8, 9))
    layer = _layer((8, 9), {"smooth_k": False}, requirements=["key_padding"])
    q, k, v = _qkv()
    valid = torch.tensor([[True] * 8, [True] * 5 + [False] * 3])
    layer(q, k, v, valid[:, None, None, :])  # masked: sageattn_varlen
    layer(q, k, v)  # no mask: the dense function of the device
    varlen, dense = calls.seen
    assert "function" not in varlen and varlen["smooth_k"] is False  # sageattn_varlen's record
    assert dense["function"] == "sageattn_qk_int8_pv_fp8_cuda" and dense["smooth_k"] is False
    # an option the varlen function does not take is refused for such a layer
    with pytest.raises(
        BackendOptionError,
        match=r"unpad route.*not taken by sageattn_varlen.*its key-padding masks",
    ):
        _layer((8, 9), {"qk_quant_gran": "per_warp"}, requirements=["key_padding"])


# -- plans ---------------------------------------------------------------------------

PIPELINE = """
[pipeline]
name = "sage"

[[components]]
name = "transformer"

[[components.layers]]
name = "blocks.attn"
head_size = 64
dtype = "fp16"
"""


def test_rule_sage_options_plan_checks_the_platforms_function(tmp_path: Any) -> None:
    from test_backend_options import _main

    path = tmp_path / "sage.toml"
    path.write_text(PIPELINE)
    flags = ("--attention-backend", "sage", "--backend-option", "sage.qk_quant_gran=per_warp")
    code, out, _ = _main(
        "plan", str(path), "--platform", "cuda:sm89+sageattention", *flags, "--json"
    )
    assert code == 0
    layer = json.loads(out)["components"][0]["layers"][0]
    assert layer["backend_options"] == {"sage_attn": {"qk_quant_gran": "per_warp"}}
    code, _, err = _main("plan", str(path), "--platform", "cuda:sm86+sageattention", *flags)
    message = " ".join(err.split())
    assert code == 2 and "Traceback" not in err
    assert "for layer 'blocks.attn' of component 'transformer'" in message
    layer_flags = ("--head-size", "64", "--dtype", "fp16")  # explain: one layer, same check
    code, _, err = _main("explain", *layer_flags, "--platform", "cuda:sm86+sageattention", *flags)
    assert code == 2 and "sage_attn.qk_quant_gran is not taken by" in " ".join(err.split())
    code, _, _ = _main("explain", *layer_flags, "--platform", "cuda:sm89+sageattention", *flags)
    assert code == 0
    assert (
        "not taken by sageattn_qk_int8_pv_fp16_triton, the function sage_attn runs on sm86"
        in message
    )


# -- ring layouts: the log-sum-exp kernel takes the layer's options ------------------


def _ring(
    backend: str, options: tuple[tuple[str, Any], ...], ulysses: int = 1, ring: int = 2
) -> Any:
    from attnres.modules import _LayerShape
    from attnres.parallel import _ParallelRun

    shape = _LayerShape(
        4, 4, 16, True, None, backend, "float16", backend_options=((backend, options),)
    )
    # what _ParallelRun reads of it (issue 35: no AllGather-KV, no padding, no text)
    sp = types.SimpleNamespace(
        ulysses=ulysses, ring=ring, allgather=1, pad_heads=False, text_tokens=0
    )
    local = lambda shape, kernel, dtypes: shape  # noqa: E731 - the local run's shape, to look at
    return _ParallelRun(sp, shape, None, frozenset({torch.float16}), local)  # type: ignore[arg-type]


def test_rule_options_reach_the_dense_kernel_of_a_ulysses_layout() -> None:
    run = _ring("fa", (("deterministic", True),), ulysses=2, ring=1)
    # the per-rank run is the dense one, built for a shape that keeps the options
    assert run.local.backend_options == (("fa", (("deterministic", True),)),)
    assert run.local.num_heads == 2 and run.lse is None


def test_rule_options_reach_the_ring_lse_kernel_fa(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_parallel import _fake_flash_attn

    module = _fake_flash_attn()
    seen: list[dict[str, Any]] = []
    real = module.flash_attn_func

    def flash_attn_func(*args: Any, deterministic: bool = False, **kwargs: Any) -> Any:
        seen.append({"deterministic": deterministic})  # flash_attn_func(..., deterministic=False)
        return real(*args, **kwargs)

    module.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    clear_lse_cache()
    try:
        run = _ring("fa", (("deterministic", True),))
        q = torch.randn(1, 6, 4, 16).half()
        _out, lse = run.lse(q, q, q, True, None)
        assert seen == [{"deterministic": True}] and lse.shape == (1, 4, 6)
    finally:
        clear_lse_cache()


def test_rule_options_reach_the_ring_lse_kernel_sage(
    calls: Calls, monkeypatch: pytest.MonkeyPatch
) -> None:
    _device(monkeypatch, (9, 0))
    run = _ring("sage_attn", (("qk_quant_gran", "per_warp"),))
    q = torch.randn(1, 6, 4, 16).half()
    _out, lse = run.lse(q, q, q, True, None)
    assert lse.shape == (1, 4, 6)
    assert calls.seen[-1]["function"] == "sageattn_qk_int8_pv_fp8_cuda_sm90"
    assert calls.seen[-1]["qk_quant_gran"] == "per_warp"
    # on an sm86 device the Triton function runs, which takes no granularity: refused
    # (a device's function is read once per device: a fresh adapter for another one)
    clear_lse_cache()
    _device(monkeypatch, (8, 6))
    with pytest.raises(BackendOptionError, match="sageattn_qk_int8_pv_fp16_triton"):
        _ring("sage_attn", (("qk_quant_gran", "per_warp"),)).lse(q, q, q, True, None)


@pytest.mark.parametrize("options", [{}, {"smooth_v": True}])
def test_sage_gets_a_contiguous_last_dim(
    calls: Calls, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any]
) -> None:
    """Issue 31: SageAttention 2's functions assert "Last dim of qkv must be
    contiguous." (sageattention/core.py, thu-ml/SageAttention d1a57a54), which
    flash-attn's wrappers do for themselves: the adapter copies such an input."""
    _device(monkeypatch, (8, 9))
    layer = _layer((8, 9), options)
    q, k, v = _qkv()
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, stride(-1) != 1
    assert strided.stride(-1) != 1
    out = layer(strided, k, v)
    assert torch.equal(out, _fake_core(q, k, v, scale=_scale(None, 64), causal=None))
