"""The requirements a layer states beyond the 0.1 set, and the catalogue's facts
about them: ``backward`` (gradients flow through the kernel), with the limits
that withdraw a claim on some platforms or in some combinations.

Every rule has a ``test_rule_3_4_requirement_*`` test (SPEC 3.4: a candidate
implements every requirement the layer needs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import attnres
from attnres import LayerSpec, Platform, Requirements, ResolutionError, resolve
from attnres._vocab import REQUIREMENT_PHRASES, Requirement
from attnres.backends import (
    BUILTIN_SPECS,
    BackendSpec,
    CapabilityRule,
    RequirementLimit,
    get_spec,
    register_backend,
    unregister_backend,
)
from attnres.errors import TraceFormatError
from attnres.machine import check_candidate
from attnres.replayer import replay
from attnres.trace import (
    BASE_SCHEMA_VERSION,
    MASK_SCHEMA_VERSION,
    CheckRecord,
    load_trace,
    trace_from_dict,
    trace_to_dict,
)

ROOT = Path(__file__).resolve().parent.parent
HOPPER_ALL = Platform.simulate("cuda:sm90+all")


def _requirement_failures(backend: str, layer: LayerSpec, platform: Platform) -> list[str]:
    for check, failures in check_candidate(get_spec(backend).backend, layer, platform):
        if check.value == "requirements":
            return [f.message for f in failures]
    raise AssertionError("no requirements check")


def _rejected(layer: LayerSpec, platform: Platform, backend: str) -> ResolutionError:
    with pytest.raises(ResolutionError) as info:
        resolve(layer, platform=platform, backend=backend)
    return info.value


# -- the vocabulary --------------------------------------------------------------


def test_rule_3_4_requirement_every_requirement_has_a_phrase_and_a_flag() -> None:
    for req in Requirement:
        assert REQUIREMENT_PHRASES[req]
        assert Requirements(**{req.value: True}).needed() == (req,)
    assert Requirements.of(["backward"]).backward is True
    with pytest.raises(ValueError, match="backward: expected True or False"):
        Requirements(backward="yes")  # type: ignore[arg-type]


# -- backward ---------------------------------------------------------------------

#: The catalogue's backward facts (docs/backends.md gives the source of each).
NO_BACKWARD = {
    "sage_attn",
    "sage_attn_3",
    "sliding_tile_attn",
    "ascend_fa",
    "dynamic_cudnn_sdpa",
    "sparse_video_gen_2_attn",
}


def test_rule_3_4_requirement_backward_claims_follow_the_catalogue() -> None:
    claims = {s.name for s in BUILTIN_SPECS if Requirement.BACKWARD in s.implements}
    assert claims == {s.name for s in BUILTIN_SPECS} - NO_BACKWARD


@pytest.mark.parametrize("backend", ["sage_attn", "sage_attn_3", "sliding_tile_attn"])
def test_rule_3_4_requirement_backward_never_gets_a_kernel_without_one(backend: str) -> None:
    platform = Platform.simulate("cuda:sm120+all" if backend == "sage_attn_3" else "cuda:sm90+all")
    layer = LayerSpec(128, "bf16", requirements=["backward"])
    err = _rejected(layer, platform, backend)
    assert f"Attention backend {backend!r} does not implement the backward pass" in str(err)
    assert err.code == "requirement_unmet"
    # the same layer for inference runs it
    inference = resolve(LayerSpec(128, "bf16"), platform=platform, backend=backend)
    assert inference.backend.name == backend


def test_rule_3_4_requirement_backward_relaxed_request_falls_back() -> None:
    from attnres import SelectionConfig

    config = SelectionConfig(global_backend="sage_attn", global_backend_explicit=False)
    layer = LayerSpec(128, "bf16", requirements=["backward"])
    res = resolve(layer, config=config, platform=HOPPER_ALL)
    # fa3 leads the Hopper chain (issue 31) and has a backward pass
    assert (res.backend.name, res.reason) == ("fa3", "platform default fallback")
    inference = resolve(LayerSpec(128, "bf16"), config=config, platform=HOPPER_ALL)
    assert inference.backend.name == "sage_attn"


def test_rule_3_4_requirement_backward_flex_attention_not_on_cpu() -> None:
    layer = LayerSpec(64, "float32", requirements=["backward"])
    err = _rejected(layer, Platform.simulate("cpu"), "flex_attention")
    assert (
        "Attention backend 'flex_attention' does not implement the backward pass on cpu "
        "(flex_attention.py: 'FlexAttention does not support backward on CPU')"
    ) in str(err)
    cuda = resolve(layer, platform=Platform.simulate("cuda:sm90"), backend="flex_attention")
    assert cuda.backend.name == "flex_attention"
    # inference on cpu is untouched
    assert (
        resolve(
            LayerSpec(64, "float32"), platform=Platform.simulate("cpu"), backend="flex_attention"
        ).backend.name
        == "flex_attention"
    )


def test_rule_3_4_requirement_backward_xformers_has_no_gqa_backward() -> None:
    sm80 = Platform.simulate("cuda:sm80+xformers")
    both = LayerSpec(64, "fp16", requirements=["gqa", "backward"])
    failures = _requirement_failures("xformers", both, sm80)
    assert failures == [
        "does not implement the backward pass together with grouped-query attention (the "
        "cutlass forward op takes the 5-D GQA layout, its backward op does not)"
    ]
    for alone in (["gqa"], ["backward"]):
        assert (
            _requirement_failures("xformers", LayerSpec(64, "fp16", requirements=alone), sm80) == []
        )


def test_rule_3_4_requirement_backward_fa4_limit_is_by_compute_capability() -> None:
    (limit,) = [lim for lim in get_spec("fa4").limits if lim.requirements == {Requirement.BACKWARD}]
    assert limit.applies([Requirement.BACKWARD], "cuda", (8, 6))
    assert not limit.applies([Requirement.BACKWARD], "cuda", (9, 0))
    assert not limit.applies([Requirement.BACKWARD], "cuda", (12, 0))
    assert not limit.applies([Requirement.CAUSAL], "cuda", (8, 6))


def test_rule_3_4_requirement_limit_applies_to_a_plugin_spec() -> None:
    spec = BackendSpec(
        name="test_limited_kernel",
        sparse=False,
        platforms=("cuda",),
        dtypes=("bfloat16",),
        implements=("causal", "backward"),
        limits=(
            RequirementLimit(
                {"backward", "causal"},
                "no causal backward before sm90",
                capabilities=CapabilityRule(max=(8, 9)),
            ),
        ),
    )
    register_backend(spec)
    try:
        layer = LayerSpec(64, "bf16", requirements=["causal", "backward"])
        err = _rejected(layer, Platform.simulate("cuda:sm86"), "test_limited_kernel")
        assert (
            "does not implement the backward pass together with causal attention on "
            "<= sm89 (no causal backward before sm90)"
        ) in str(err)
        res = resolve(layer, platform=Platform.simulate("cuda:sm90"), backend="test_limited_kernel")
        assert res.backend.name == "test_limited_kernel"
    finally:
        unregister_backend("test_limited_kernel")


def test_rule_3_4_requirement_limit_validates_its_fields() -> None:
    with pytest.raises(ValueError, match="at least one requirement"):
        RequirementLimit(set(), "nothing")
    with pytest.raises(ValueError):
        RequirementLimit({"teleport"}, "unknown requirement")
    with pytest.raises(ValueError, match="unknown platform kinds"):
        RequirementLimit({"backward"}, "x", platforms={"tpu"})
    with pytest.raises(TypeError, match="RequirementLimit"):
        BackendSpec(
            name="x_kernel",
            sparse=False,
            platforms=("cpu",),
            dtypes=("float32",),
            limits=("backward",),
        )  # type: ignore[arg-type]


# -- traces: the requirement travels, and 0.1 traces still load ---------------------


def test_trace_records_the_backward_requirement_and_replays() -> None:
    res = resolve(LayerSpec(64, "bf16", requirements=["backward"]), platform=HOPPER_ALL)
    doc = trace_to_dict(res.trace)
    assert doc["schema_version"] == BASE_SCHEMA_VERSION == 2
    assert doc["input"]["layer"]["requirements"]["backward"] is True
    again = trace_from_dict(json.loads(json.dumps(doc)))
    assert again.input.layer.requirements.backward is True
    assert replay(again).ok


def _schema_1_doc() -> dict[str, Any]:
    """A trace as attnres 0.1 wrote it: schema 1, the five 0.1 requirement keys."""
    res = resolve(LayerSpec(64, "bf16", requirements=["causal"]), platform=HOPPER_ALL)
    doc = trace_to_dict(res.trace)
    doc["schema_version"] = 1
    for key in ("backward", "custom_scale", "softcap", "sliding_window"):
        del doc["input"]["layer"]["requirements"][key]
    return _with_digest(doc)


def test_trace_schema_1_files_load_with_their_own_digest(tmp_path: Path) -> None:
    doc = _schema_1_doc()
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc), encoding="utf-8")
    loaded = load_trace(path)  # the digest of a 0.1 file covers the keys it has
    assert loaded.digest == doc["digest"]
    assert loaded.schema_version == 1
    assert loaded.input.layer.requirements == Requirements(causal=True)
    assert replay(path).ok


def _with_digest(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the digest a schema-1 writer gave it."""
    import hashlib

    from attnres.trace import canonical_json

    body = {k: v for k, v in doc.items() if k != "digest"}
    return {**body, "digest": hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()}


def test_trace_schema_versions_hold_their_own_requirement_keys() -> None:
    new_keys = _schema_1_doc()
    new_keys["schema_version"] = 2
    with pytest.raises(
        TraceFormatError,
        match=r"\$\.input\.layer\.requirements\.backward: "
        r"missing field \(requirements in schema version 2",
    ):
        trace_from_dict(_with_digest(new_keys))
    doc = _schema_1_doc()
    doc["input"]["layer"]["requirements"]["backward"] = False
    with pytest.raises(
        TraceFormatError,
        match=r"requirements\.backward: unexpected field "
        r"\(requirements in schema version 1",
    ):
        trace_from_dict(_with_digest(doc))


def test_golden_corpus_is_written_in_the_current_schema() -> None:
    # the lowest version that expresses each trace: a layer that names a mask
    # kind is version 4 (issue 22), every other rule-based trace the base version
    for path in sorted((ROOT / "traces").glob("*.json")):
        trace = load_trace(path)
        # issue 24: a layer with a sequence-parallel layout is written as version 5;
        # issue 35: version 7 when the layout is AllGather-KV, padded or chosen;
        # issue 34: version 6 (at least) when it holds an error budget or measurements
        layout = trace.input.layer.layout
        expected = (
            7
            if layout is not None
            and (layout.allgather > 1 or layout.pad_heads or layout.rule is not None)
            else 5
            if layout is not None
            else MASK_SCHEMA_VERSION
            if trace.input.layer.requirements.extended
            else BASE_SCHEMA_VERSION
        )
        if trace.input.config.attention_error or trace.input.measured_error:
            expected = max(expected, 6)
        assert trace.schema_version == expected, path.name


# -- custom scale, softcap, sliding window: the catalogue ---------------------------

#: Kernels whose call has no softmax-scale argument (docs/backends.md gives the sources).
NO_SCALE = {
    "sliding_tile_attn",
    "video_sparse_attn",
    "vmoba_attn",
    "sage_attn_3",
    "sparse_video_gen_2_attn",
    "dynamic_cudnn_sdpa",
}


def test_rule_3_4_requirement_custom_scale_claims_follow_the_catalogue() -> None:
    claims = {s.name for s in BUILTIN_SPECS if Requirement.CUSTOM_SCALE in s.implements}
    assert claims == {s.name for s in BUILTIN_SPECS} - NO_SCALE


def test_rule_3_4_requirement_softcap_and_window_claims_follow_the_catalogue() -> None:
    softcap = {s.name for s in BUILTIN_SPECS if Requirement.SOFTCAP in s.implements}
    assert softcap == {"fa", "fa3", "fa4", "eager", "flex_attention"}
    window = {s.name for s in BUILTIN_SPECS if Requirement.SLIDING_WINDOW in s.implements}
    # the kernels' own window_size, and the adapters that build the window as a mask
    assert window == {
        "fa",
        "fa3",
        "fa4",
        "aiter",
        "torch_sdpa",
        "eager",
        "torch_cudnn_sdpa",
        "flex_attention",
        "xformers",
    }


SIMULATED = [
    "cuda:sm90+all",
    "cuda:sm100+all",
    "cuda:sm120+all",
    "cuda:sm121+all",
    "cuda:sm80+all",
    "cpu",
    "rocm:gfx942+all",
]


@pytest.mark.parametrize("platform", SIMULATED)
@pytest.mark.parametrize("head_size", [64, 128])
def test_rule_3_4_requirement_custom_scale_never_gets_a_kernel_without_a_scale(
    platform: str, head_size: int
) -> None:
    """A layer with a custom scale never gets sliding_tile_attn, vmoba_attn or
    sage_attn_3, whatever asked for them, on every simulated platform."""
    from attnres import Attention, SelectionConfig, force_backend

    sim = Platform.simulate(platform)
    for backend in ("sliding_tile_attn", "vmoba_attn", "sage_attn_3", "video_sparse_attn"):
        layer = LayerSpec(head_size, "bf16", requirements=["custom_scale"])
        for config in (
            SelectionConfig(global_backend=backend),
            SelectionConfig(global_backend=backend, global_backend_explicit=False),
        ):
            try:
                res = resolve(layer, config=config, platform=sim)
            except ResolutionError:
                continue  # a strict request: rejected, nothing runs
            assert res.backend.name not in NO_SCALE, (platform, backend, res.backend)
        with pytest.raises(ResolutionError):
            resolve(layer, platform=sim, backend=backend)
        # the layer states the requirement itself: forced, it is refused before any kernel
        with force_backend(backend), pytest.raises(ResolutionError) as info:
            Attention(2, head_size, softmax_scale=0.5, dtype="bf16", platform=sim)
        failed = {
            f.message
            for r in info.value.trace.records
            if isinstance(r, CheckRecord)
            for f in r.failures
        }
        assert "does not implement a custom softmax scale" in failed


@pytest.mark.parametrize("backend", ["sliding_tile_attn", "vmoba_attn", "sage_attn_3"])
def test_rule_3_4_requirement_custom_scale_message(backend: str) -> None:
    platform = Platform.simulate("cuda:sm120+all" if backend == "sage_attn_3" else "cuda:sm90+all")
    err = _rejected(LayerSpec(128, "bf16", requirements=["custom_scale"]), platform, backend)
    assert f"Attention backend {backend!r} does not implement a custom softmax scale" in str(err)
    assert resolve(LayerSpec(128, "bf16"), platform=platform, backend=backend)


def test_rule_3_4_requirement_custom_scale_is_declared_by_the_layer() -> None:
    from attnres import Attention

    cpu = Platform.simulate("cpu")
    assert Attention(2, 64, softmax_scale=0.2, platform=cpu).layer_spec.requirements.custom_scale
    for same in (None, 64**-0.5, 0.125):
        layer = Attention(2, 64, softmax_scale=same, platform=cpu)
        assert not layer.layer_spec.requirements.custom_scale


def test_rule_3_4_requirement_softcap_fa_not_with_dropout() -> None:
    hopper = Platform.simulate("cuda:sm90+flash_attn")
    both = LayerSpec(128, "bf16", requirements=["softcap", "dropout"])
    err = _rejected(both, hopper, "fa")
    assert (
        "Attention backend 'fa' does not implement logit softcapping together with "
        "attention dropout (flash_api.cpp: 'Softcapping does not support dropout for now')"
    ) in str(err)
    assert (
        resolve(LayerSpec(128, "bf16", requirements=["softcap"]), platform=hopper).backend.name
        == "fa"
    )


def test_rule_3_4_requirement_softcap_never_gets_a_kernel_without_one() -> None:
    hopper = Platform.simulate("cuda:sm90+all")
    layer = LayerSpec(128, "bf16", requirements=["softcap"])
    for backend in ("torch_sdpa", "sage_attn", "xformers", "aiter", "torch_cudnn_sdpa"):
        failures = _requirement_failures(backend, layer, hopper)
        assert "does not implement logit softcapping" in failures, backend
    for backend in ("fa", "fa3", "fa4", "eager", "flex_attention"):
        assert "does not implement logit softcapping" not in _requirement_failures(
            backend, layer, hopper
        )
    # nothing requested on Hopper: the chain's fa3 takes it (fa where FA3 is missing)
    assert resolve(layer, platform=hopper).backend.name == "fa3"
    assert resolve(layer, platform=Platform.simulate("cuda:sm90+flash_attn")).backend.name == "fa"


def test_rule_3_4_requirement_softcap_and_window_unverified_on_rocm_for_fa() -> None:
    mi300 = Platform.simulate("rocm:gfx942+all")
    softcap = LayerSpec(128, "bf16", requirements=["softcap"])
    assert any("on rocm" in m for m in _requirement_failures("fa", softcap, mi300))
    window = LayerSpec(128, "bf16", requirements=["sliding_window"])
    assert any("on rocm" in m for m in _requirement_failures("fa", window, mi300))
    # aiter implements windows on ROCm: the rocm chain takes it
    assert resolve(window, platform=mi300).backend.name == "aiter"


def test_rule_3_4_requirement_sliding_window_never_gets_a_kernel_without_one() -> None:
    hopper = Platform.simulate("cuda:sm90+all")
    layer = LayerSpec(128, "bf16", requirements=["sliding_window"])
    for backend in ("sage_attn", "dynamic_cudnn_sdpa", "sliding_tile_attn"):
        assert "does not implement sliding-window attention" in _requirement_failures(
            backend, layer, hopper
        ), backend
    assert resolve(layer, platform=hopper).backend.name == "fa3"
    assert resolve(layer, platform=Platform.simulate("cpu")).backend.name == "torch_sdpa"


def test_rule_3_4_requirement_sliding_window_cross_needs_top_left_alignment() -> None:
    hopper = Platform.simulate("cuda:sm90+all")
    cross = LayerSpec(128, "bf16", role="cross", requirements=["sliding_window"])
    err = _rejected(cross, hopper, "fa")
    assert (
        "does not implement top-left aligned sliding-window cross-attention (its "
        "sliding-window mask is bottom-right aligned when query and key lengths differ)"
    ) in str(err)
    res = resolve(cross, platform=hopper)
    assert (res.backend.name, res.reason) == ("torch_sdpa", "platform default fallback")


# -- the layer: arguments, and numbers against the float64 reference ----------------


def test_attention_softcap_and_window_arguments() -> None:
    from attnres import Attention

    cpu = Platform.simulate("cpu")
    layer = Attention(2, 32, window=(4, None), platform=cpu)
    assert layer.window == (4, None)
    assert layer.layer_spec.requirements.sliding_window
    assert Attention(2, 32, window=(None, None), platform=cpu).window is None
    assert Attention(2, 32, window=(-1, 3), platform=cpu).window == (None, 3)
    capped = Attention(2, 32, softcap=30.0, backend="eager", platform=cpu)
    assert capped.softcap == 30.0 and capped.layer_spec.requirements.softcap
    assert Attention(2, 32, softcap=0, platform=cpu).softcap is None
    for bad in ((1,), (1, 2, 3), "ab", (1.5, 2), (-2, 1), (True, 1), 5):
        with pytest.raises(ValueError, match="window"):
            Attention(2, 32, window=bad, platform=cpu)  # type: ignore[arg-type]
    for bad_cap in (-1.0, float("inf"), "30", True):
        with pytest.raises(ValueError, match="softcap"):
            Attention(2, 32, softcap=bad_cap, backend="eager", platform=cpu)  # type: ignore[arg-type]
    pending = Attention(2, 32, softcap=30.0, platform=cpu)  # resolves when its dtype is known
    with pytest.raises(ResolutionError, match="does not implement logit softcapping"):
        attnres.bind(pending)  # torch_sdpa, the cpu default, has none


LAYER_CASES = [
    ("torch_sdpa", "float64"),
    ("eager", "float64"),
    ("eager", "float32"),
    ("flex_attention", "float32"),
]


@pytest.mark.parametrize(("backend", "dtype"), LAYER_CASES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, (3, 0), (2, 4), (None, 2), (5, None)])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_layer_window_scale_softcap_match_the_reference(
    backend: str,
    dtype: str,
    causal: bool,
    window: tuple[int | None, int | None] | None,
    mask_kind: str | None,
) -> None:
    import torch
    from reference import reference, relative_error

    from attnres import Attention

    torch_dtype = getattr(torch, dtype)
    softcap = 3.0 if backend in ("eager", "flex_attention") else None
    layer = Attention(
        4,
        16,
        num_kv_heads=2,
        causal=causal,
        softmax_scale=0.4,
        softcap=softcap,
        window=window,
        dtype=dtype,
        backend=backend,
        platform=Platform.simulate("cpu"),
    )
    assert layer.backend.name == backend
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 19, h, 16, generator=generator).to(torch_dtype) for h in (4, 2, 2))
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 19, 19, generator=generator) > 0.2
        mask[..., 0] = True
    elif mask_kind == "float":
        mask = torch.randn(1, 4, 19, 19, generator=generator).to(torch_dtype)
    out = layer(q, k, v, mask)
    band = None if window is None else tuple(-1 if s is None else s for s in window)
    ref = reference(q, k, v, mask, causal, 0.4, softcap=softcap or 0.0, window=band)  # type: ignore[arg-type]
    finite = torch.isfinite(ref).all(dim=-1)  # rows the window and mask leave empty
    error = relative_error(out[finite], ref[finite])
    assert error < (1e-12 if dtype == "float64" else 2e-5), (backend, error)


def test_layer_window_matters() -> None:
    """The window changes the numbers (the test above could not pass by ignoring it)."""
    import torch
    from reference import reference, relative_error

    from attnres import Attention

    layer = Attention(2, 16, window=(1, 1), dtype="float64", platform=Platform.simulate("cpu"))
    generator = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, 12, 2, 16, generator=generator, dtype=torch.float64) for _ in range(3)
    )
    out = layer(q, k, v)
    assert relative_error(out, reference(q, k, v, window=(1, 1))) < 1e-12
    assert relative_error(out, reference(q, k, v)) > 0.05


@pytest.mark.parametrize(
    ("requirement", "phrase"),
    [
        # issue 19: sageattn has no sink argument, nor has flash-attn 2's
        # flash_attn_func (docs/backends.md gives each source)
        ("sinks", "attention sinks"),
        # issue 19: nn.MultiheadAttention's need_weights: no fused kernel
        # materialises the softmax matrix
        ("weights", "returning the attention weights"),
    ],
)
def test_rule_3_4_requirement_sinks_and_weights_only_eager_implements_them(
    requirement: str, phrase: str
) -> None:
    layer = LayerSpec(64, "bf16", requirements=[requirement])
    for backend in ("sage_attn", "fa", "fa3", "torch_sdpa", "flex_attention"):
        assert f"does not implement {phrase}" in _requirement_failures(
            backend, layer, HOPPER_ALL), backend  # fmt: skip
    eager = attnres.SelectionConfig(global_backend="eager")
    res = resolve(layer, platform=HOPPER_ALL, config=eager)
    assert res.backend.name == "eager"
    # written to a trace only when on: a trace without it keeps its bytes
    doc = trace_to_dict(res.trace)
    assert doc["input"]["layer"]["requirements"][requirement] is True
    assert replay(res.trace).ok
    plain = trace_to_dict(resolve(LayerSpec(64, "bf16"), platform=HOPPER_ALL).trace)
    assert requirement not in plain["input"]["layer"]["requirements"]
    sage = attnres.SelectionConfig(global_backend="sage_attn")
    with pytest.raises(ResolutionError, match=f"does not implement {phrase}"):
        resolve(layer, platform=HOPPER_ALL, config=sage)
