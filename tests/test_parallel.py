"""Sequence-parallel layouts (issue 24): the layout check, its facts, the layer, the CLI,
and real gloo groups of 2 and 4 processes.

The multi-process tests start two launches in all (2 ranks, then 4): every
combination of Ulysses and ring degrees, self/cross, causal or not, MHA/GQA and
even/uneven lengths runs inside them (``tests/parallel_workers.py``), so the
cost is process start-up plus the cases, not one launch per case. Every
process is joined with a hard deadline and killed past it: a bug can fail
these tests but never hang the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from dist_workers import run_processes
from parallel_workers import TIMEOUT_S, reference, worker

import attnres
from attnres._states import Check, Code
from attnres.backends import BUILTIN_SPECS, LSE_SOURCES, Backend
from attnres.cli import main
from attnres.kernels.lse import eager_lse, has_lse_kernel, sdpa_lse
from attnres.layer import LayerSpec, Requirements
from attnres.layout import LAYOUT_KINDS, SequenceLayout
from attnres.machine import LAYOUT_CHECK_ORDER, check_candidate
from attnres.plan import load_pipeline, with_layout
from attnres.platform import Platform
from attnres.trace import trace_from_dict, trace_to_dict

HOPPER = Platform.simulate("cuda:sm90+flash_attn+sageattention")
CPU = Platform.simulate("cpu")


def _spec(layout: SequenceLayout | None, **kw: Any) -> LayerSpec:
    return LayerSpec(head_size=128, dtype=kw.pop("dtype", "bfloat16"), layout=layout, **kw)


def _layout_failures(backend: str, spec: LayerSpec, platform: Platform, run: bool = False) -> Any:
    results = dict(check_candidate(Backend.parse(backend), spec, platform, needs_kernel=run))
    return results[Check.LAYOUT]


# -- the layout check (machine.py) ------------------------------------------------------


def test_rule_layout_check_runs_only_for_a_layer_with_a_layout() -> None:
    plain = check_candidate(Backend.parse("fa"), _spec(None), HOPPER)
    assert Check.LAYOUT not in dict(plain)
    laid = check_candidate(Backend.parse("fa"), _spec(SequenceLayout(1, 2)), HOPPER)
    assert tuple(c for c, _ in laid) == LAYOUT_CHECK_ORDER


def test_rule_layout_ring_needs_a_kernel_that_returns_the_lse() -> None:
    ring = _spec(SequenceLayout(1, 2, 24, 24))
    (failure,) = _layout_failures("dynamic_cudnn_sdpa", ring, HOPPER)
    assert failure.code is Code.NO_LSE and "ring=2" in failure.message
    assert _layout_failures("fa", ring, HOPPER) == ()
    assert _layout_failures("sage_attn", ring, HOPPER) == ()
    # Ulysses alone merges nothing: any kernel
    assert _layout_failures("dynamic_cudnn_sdpa", _spec(SequenceLayout(2, 1, 24, 24)), HOPPER) == ()


def test_rule_layout_ring_needs_an_lse_adapter_in_a_running_process() -> None:
    ring = _spec(SequenceLayout(1, 2), dtype="float32")
    (failure,) = _layout_failures("flex_attention", ring, CPU, run=True)
    assert failure.code is Code.NO_LSE and "no adapter" in failure.message
    # issue 32 item 5: a plan (explain, a simulated platform) says what the runtime does
    assert _layout_failures("flex_attention", ring, CPU, run=False) == (failure,)
    assert _layout_failures("torch_sdpa", ring, CPU, run=True) == ()
    assert _layout_failures("eager", ring, CPU, run=True) == ()


def test_rule_layout_ulysses_needs_heads_and_kv_heads_divisible() -> None:
    (failure,) = _layout_failures("fa", _spec(SequenceLayout(4, 1, 8, 2)), HOPPER)
    assert failure.code is Code.HEADS_NOT_DIVISIBLE
    assert "8 heads and 2 kv heads" in failure.message
    assert _layout_failures("fa", _spec(SequenceLayout(2, 1, 8, 2)), HOPPER) == ()
    assert _layout_failures("fa", _spec(SequenceLayout(4, 1, None, None)), HOPPER) == ()


def test_rule_layout_refuses_masks_and_windows_across_ring_blocks() -> None:
    masked = _spec(SequenceLayout(2, 1), requirements=Requirements(attn_mask=True))
    (failure,) = _layout_failures("torch_sdpa", masked, HOPPER)
    assert failure.code is Code.LAYOUT_UNSUPPORTED
    windowed = Requirements(sliding_window=True)
    (failure,) = _layout_failures("fa", _spec(SequenceLayout(1, 2), requirements=windowed), HOPPER)
    assert failure.code is Code.LAYOUT_UNSUPPORTED and "ring=2" in failure.message
    assert _layout_failures("fa", _spec(SequenceLayout(2, 1), requirements=windowed), HOPPER) == ()


def test_a_ring_layout_selection_falls_back_to_a_kernel_with_the_lse() -> None:
    config = attnres.SelectionConfig(
        global_backend="dynamic_cudnn_sdpa", global_backend_explicit=False
    )
    resolution = attnres.resolve(
        _spec(SequenceLayout(1, 2, 24, 24)), config=config, platform=HOPPER
    )
    assert resolution.backend.name == "fa"
    assert str(resolution.reason) == "platform default fallback"


def test_every_lse_fact_names_a_catalogue_backend_and_a_source() -> None:
    names = {s.name for s in BUILTIN_SPECS}
    assert set(LSE_SOURCES) <= names
    for spec in BUILTIN_SPECS:
        assert spec.lse == LSE_SOURCES.get(spec.name)
        if spec.sparse:
            assert spec.lse is None
    assert all("(" in source for source in LSE_SOURCES.values())  # each cites where


def test_layout_rides_in_the_trace_and_round_trips() -> None:
    resolution = attnres.resolve(_spec(SequenceLayout(2, 2, 24, 8)), platform=HOPPER)
    doc = json.loads(json.dumps(trace_to_dict(resolution.trace)))
    assert doc["input"]["layer"]["layout"] == {
        "ulysses": 2, "ring": 2, "num_heads": 24, "num_kv_heads": 8,
    }  # fmt: skip
    assert trace_from_dict(doc) == resolution.trace
    plain = trace_to_dict(attnres.resolve(_spec(None), platform=HOPPER).trace)
    assert "layout" not in plain["input"]["layer"]  # older traces keep their bytes
    doc["input"]["layer"]["layout"]["ring"] = 0
    with pytest.raises(attnres.TraceFormatError, match="layout"):
        trace_from_dict(doc)


def test_bad_layouts_are_value_errors() -> None:
    for bad in ({"ulysses": 0}, {"ring": -1}, {"ulysses": True}, {"num_heads": 0}):
        with pytest.raises(ValueError, match="expected a positive integer"):
            SequenceLayout(**bad)
    with pytest.raises(ValueError, match=r"layout: expected an attnres\.SequenceLayout"):
        LayerSpec(head_size=64, dtype="float32", layout=(2, 1))  # type: ignore[arg-type]


def test_per_rank_words() -> None:
    text = SequenceLayout(2, 2, 24, 8).per_rank("fa")
    assert "4 ranks (ulysses=2 x ring=2): each runs fa on 12 of 24 heads (4 of 8 kv heads)" in text
    assert "log-sum-exp" in text and "all-to-all" in text
    assert "no kernel" in SequenceLayout(1, 2).per_rank(None)


# -- the lse adapters (kernels/lse.py) --------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("adapter", [eager_lse, sdpa_lse])
def test_lse_adapters_match_the_reference(adapter: Any, causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 5, 4, 8, generator=gen)
    k = torch.randn(2, 7, 2, 8, generator=gen)  # GQA, cross lengths
    v = torch.randn(2, 7, 2, 8, generator=gen)
    out, lse = adapter(q, k, v, causal, None)
    assert torch.allclose(out.double(), reference(q, k, v, causal), atol=1e-5)
    scores = reference_scores(q, k, causal)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-5)
    # differentiable in both outputs when gradients are needed
    qg = q.clone().requires_grad_()
    out, lse = adapter(qg, k, v, causal, None)
    (out.sum() + lse.sum()).backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    assert has_lse_kernel("eager") and has_lse_kernel("torch_sdpa") and has_lse_kernel("fa")
    assert has_lse_kernel("sage_attn") and not has_lse_kernel("fa3")


def reference_scores(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(q.shape[2] // k.shape[2], 1)
    scores = (qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    return scores


def test_eager_lse_with_softcap() -> None:
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 4, 2, 8)
    _, lse = eager_lse(q, k, k, False, None, 5.0)
    scores = 5.0 * torch.tanh(reference_scores(q, k, False) / 5.0)
    assert torch.allclose(lse.double(), torch.logsumexp(scores, -1), atol=1e-5)


# -- construction without a group ---------------------------------------------------------


def test_sequence_parallel_needs_an_initialised_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        attnres.SequenceParallel(ulysses=2)
    with pytest.raises(ValueError, match="positive integer"):
        attnres.SequenceParallel(ulysses=0)


def test_attention_parallel_must_be_a_sequence_parallel() -> None:
    with pytest.raises(TypeError, match=r"parallel: expected an attnres\.SequenceParallel"):
        attnres.Attention(4, 16, dtype="float32", parallel=(2, 1))  # type: ignore[arg-type]


# -- plans and the CLI --------------------------------------------------------------------


def test_plan_layout_goes_on_the_denoiser_only() -> None:
    pipeline = load_pipeline("examples/image-video-dit.toml")
    laid = with_layout(pipeline, SequenceLayout(2, 2))
    for before, after in zip(pipeline.components, laid.components, strict=True):
        expected = SequenceLayout(2, 2) if before.resolved_kind in LAYOUT_KINDS else None
        assert {layer.spec.layout for layer in after.layers} == {expected}
    assert with_layout(pipeline, None) is pipeline


def test_cli_explain_shows_the_per_rank_decision_and_the_lse_rejection(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["explain", "--head-size", "128", "--dtype", "bf16", "--platform",
            "cuda:sm90+flash_attn+sageattention", "--ring-degree", "2", "--ulysses-degree", "2",
            "--heads", "24"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Per rank:  4 ranks (ulysses=2 x ring=2): each runs fa on 12 of 24 heads" in out
    assert "layout        pass" in out
    assert main([*argv, "--attention-backend", "dynamic_cudnn_sdpa"]) == 1
    out = capsys.readouterr().out
    assert "Decision:  rejected (no_lse)" in out
    assert "cannot return the softmax log-sum-exp" in out


def test_cli_plan_with_a_layout(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "examples/image-video-dit.toml", "--platform",
            "cuda:sm90+flash_attn+sageattention", "--ring-degree", "2", "--json"]  # fmt: skip
    main(argv)
    doc = json.loads(capsys.readouterr().out)
    assert doc["layout"] == {"ulysses": 1, "ring": 2, "components": ["transformer"]}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["explain", "--head-size", "64", "--dtype", "fp32", "--heads", "8"], "--heads"),
        (["explain", "--head-size", "64", "--dtype", "fp32", "--ring-degree", "0"], "positive"),
        (["plan", "examples/flux.1-dev", "--ring-degree", "2"], "pipeline file"),
    ],
)
def test_cli_layout_flag_mistakes_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own type errors
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    assert message in capsys.readouterr().err


# -- real gloo groups -----------------------------------------------------------------------

#: the rendezvous timeout of a worker (covers the others' start-up)
RENDEZVOUS_S = 60.0


def run_ranks(tmp_path: Path, world: int, scenarios: list[str], work_s: float) -> dict[int, Any]:
    """One worker per rank running ``scenarios`` in order; fails, never hangs, past
    the rendezvous bound plus ``work_s`` (both times a wide margin)."""
    args = [(rank, world, str(tmp_path), scenarios) for rank in range(world)]
    run_processes(worker, args, 3 * (RENDEZVOUS_S + work_s))
    return {r: json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(world)}


def _numerics_ok(result: dict[str, Any]) -> None:
    assert "crashed" not in result, result.get("crashed")
    assert result["max_err"] > 0  # compared (float32 never matches float64 exactly)
    assert result["cases"] > 0 and result["grads"] > 0
    assert result["max_err"] < 2e-5, result  # float32 against a float64 reference
    assert result["max_grad_err"] < 5e-5, result


def test_two_ranks_every_layout_matches_one_process_and_errors_are_clear(tmp_path: Path) -> None:
    scenarios = [
        "numerics", "dit", "errors", "decide_differently", "mismatch", "switch_backend",
        "dead_peer",
    ]  # fmt: skip
    results = run_ranks(tmp_path, 2, scenarios, work_s=120 + 2 * TIMEOUT_S)
    _numerics_ok(results[0]["numerics"])  # rank 0 compares with the reference
    assert results[0]["dit"]["max_err"] < 2e-5, results[0]["dit"]
    for rank in (0, 1):
        got = results[rank]
        assert "crashed" not in got["dit"], got["dit"]
        assert "crashed" not in got["numerics"], got["numerics"]
        assert got["numerics"]["cases"] == 48  # (1x2: 2 kernels, 2x1: 1) x 16 combinations
        errors = got["errors"]
        assert "ulysses=2 x ring=2 spans 4 ranks, but the group has 2" in errors["wrong_degree"]
        assert errors["wrong_degree_type"] == "SequenceParallelArgumentError"  # issue 32
        assert errors["heads"][1] == "no_compatible_backend"
        assert "6 heads and 3 kv heads do not both divide by 2" in errors["heads"][0]
        assert errors["no_lse"][1] == "no_lse"
        differ = got["decide_differently"]["error"]
        assert differ.startswith("Ranks disagree on attention backends")
        assert "rank 0 -> torch_sdpa" in differ and "rank 1 -> eager" in differ
        # issue 32 item 17: the layer's origin, not "none"
        assert "(origin layer)" in differ and "origin none" not in differ, differ
        _switched_backends_are_a_typed_mismatch(got["switch_backend"])
        # issue 32: shards of different dtypes or shapes are refused before data moves
        mismatch = got["mismatch"]
        assert "crashed" not in mismatch, mismatch
        for case in ("bf16_fp16", "fp32_fp64"):
            assert mismatch[case] is not None, case
            assert "disagree on the shards" in mismatch[case], mismatch[case]
        assert "bfloat16" in mismatch["bf16_fp16"] and "float16" in mismatch["bf16_fp16"]
        assert "float32" in mismatch["fp32_fp64"] and "float64" in mismatch["fp32_fp64"]
        for case in ("gather_dtype", "gather_shape"):
            assert mismatch[case] is not None and "nothing was exchanged" in mismatch[case]
    assert results[1]["dead_peer"] == "exited"
    # issue 32: a peer that died between a ring's forward and backward
    for what in ("backward", "forward"):
        dead = results[0]["dead_peer"][what]
        assert dead["error"] is not None, dead
        assert "sequence-parallel" in dead["error"] and "restart the job" in dead["error"]
        assert dead["elapsed_s"] < 3 * TIMEOUT_S  # the protocol's bound, with a margin


def _switched_backends_are_a_typed_mismatch(got: dict[str, Any]) -> None:
    """Issue 32 item 17: a rank that switched its backend mid-run (a request block,
    a schedule step the other rank did not take; once with the new backend's run
    already verified for the shape, which ran silently) is a BackendMismatchError
    (a ConsensusError) naming both ranks' backends and origins, on every rank,
    before any data moved, by the exchange (not a dead peer's timeout); the group
    stays in step. One backend chosen in two ways names both origins."""
    assert "crashed" not in got, got["crashed"]
    for layout in ("ulysses", "ring"):
        for how, first in (("request", "layer"), ("schedule", "request"), ("verified", "layer")):
            case = got[f"{layout}.{how}"]
            # answered by the backends' exchange, not waited out: a dead peer's
            # timeout is another error type, recorded as "raw" with no "error"
            assert case["error"] is not None, (layout, how, case)
            assert case["consensus"] and case["backends"] == {"0": "torch_sdpa", "1": "eager"}
            assert f"rank 0 -> torch_sdpa (origin {first})" in case["error"], case["error"]
            assert "rank 1 -> eager (origin request)" in case["error"], case["error"]
            assert "no data was exchanged" in case["error"]
        assert got[f"{layout}.after"] == {"error": None}
    origins = got["origins"]
    assert origins is not None and "how attention backends were chosen" in origins
    assert "rank 0 -> torch_sdpa (origin layer)" in origins, origins
    assert "rank 1 -> torch_sdpa (origin forced)" in origins, origins


def test_four_ranks_ulysses_ring_and_usp_match_one_process(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 4, ["numerics", "dit"], work_s=300)
    _numerics_ok(results[0]["numerics"])  # rank 0 compares with the reference
    assert results[0]["dit"]["max_err"] < 2e-5, results[0]["dit"]
    for rank in range(4):
        assert "crashed" not in results[rank]["dit"], results[rank]["dit"]
        assert "crashed" not in results[rank]["numerics"], results[rank]["numerics"]
        assert results[rank]["numerics"]["cases"] == 80  # (1x4, 2x2: 2 kernels; 4x1: 1) x 16


def test_sequence_layout_is_exported() -> None:
    assert attnres.SequenceLayout is SequenceLayout
    assert attrs.has(SequenceLayout)


def test_a_layout_is_shared_by_copies_and_refuses_pickling() -> None:
    import copy
    import pickle

    sp = object.__new__(attnres.SequenceParallel)  # no group needed to test the protocol
    assert copy.deepcopy(sp) is sp and copy.copy(sp) is sp
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(sp)


def test_rule_layout_training_ring_needs_a_block_backward() -> None:
    training = Requirements(backward=True)
    ring = _spec(SequenceLayout(1, 2), requirements=training)
    (failure,) = _layout_failures("sage_attn", ring, HOPPER)
    assert failure.code is Code.LAYOUT_UNSUPPORTED and "no backward" in failure.message
    # inference, or Ulysses alone, is fine with sage_attn; fa and torch_sdpa train a ring
    assert _layout_failures("sage_attn", _spec(SequenceLayout(1, 2)), HOPPER) == ()
    ulysses = _spec(SequenceLayout(2, 1), requirements=training)
    assert _layout_failures("sage_attn", ulysses, HOPPER) == ()
    assert _layout_failures("torch_sdpa", ring, HOPPER) == ()
    assert _layout_failures("fa", ring, HOPPER) == ()


def _fake_flash_attn() -> Any:
    """flash-attn 2.x's ``flash_attn_func`` as documented: (b, s, h, d), fp16/bf16 only,
    causal aligned bottom-right, ``return_attn_probs`` -> (out, softmax_lse, S_dmask)
    with softmax_lse (b, h, s) in float32."""
    import types

    def flash_attn_func(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
        softmax_scale: float | None = None, causal: bool = False,
        window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
        alibi_slopes: Any = None, deterministic: bool = False, return_attn_probs: bool = False,
    ) -> Any:  # fmt: skip
        assert q.dtype in (torch.float16, torch.bfloat16), "only fp16 and bf16"
        scores = reference_scores(q, k, False)
        if softmax_scale is not None:
            scores = scores / q.shape[-1] ** -0.5 * softmax_scale
        if causal:  # bottom-right: query i sees keys j <= i + (seq_k - seq_q)
            shift = k.shape[1] - q.shape[1]
            keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(shift)
            scores = scores.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        vd = v.double().transpose(1, 2).repeat_interleave(q.shape[2] // v.shape[2], 1)
        out = (torch.softmax(scores, -1) @ vd).transpose(1, 2).to(q.dtype)
        return (out, lse.float(), None) if return_attn_probs else out

    module = types.ModuleType("flash_attn")
    module.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    return module


def test_fa_lse_adapter_through_a_fake_and_the_ring_merge(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fa adapter returns flash-attn's softmax_lse; the ring only ever asks it for
    causal blocks of equal lengths, where its bottom-right alignment is top-left's."""
    import sys

    from attnres.kernels.lse import clear_lse_cache, get_lse_kernel
    from attnres.parallel import _ParallelRun

    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    clear_lse_cache()
    try:
        fa_lse = get_lse_kernel("fa")
        assert fa_lse is not None
        q, k, v = (torch.randn(1, n, 4, 16).half() for n in (6, 6, 6))
        out, lse = fa_lse(q, k, v, True, None)
        assert torch.allclose(out.double(), reference(q, k, v, True), atol=2e-3)
        assert torch.allclose(lse.double(), torch.logsumexp(reference_scores(q, k, True), -1))
        # the ring's block arithmetic with this kernel: a query block of 5 rows at
        # global offset 7 over key blocks at offsets 0 (4 keys) and 4 (9 keys), causal
        run = object.__new__(_ParallelRun)
        run.lse, run.scale, run.softcap, run.causal, run.head_size = fa_lse, None, 0.0, True, 16
        q = torch.randn(1, 5, 4, 16).half()
        k = torch.randn(1, 13, 4, 16).half()
        v = torch.randn(1, 13, 4, 16).half()
        acc = torch.zeros(1, 5, 4, 16, dtype=torch.float32)
        acc_lse = torch.full((1, 4, 5), float("-inf"))
        for start, stop in ((0, 4), (4, 13)):
            run._attend(q, k[:, start:stop], v[:, start:stop], 7, start, acc, acc_lse)
        # query rows 7..11 see keys 0..row: the full reference over 13 keys, rows 7..11
        q_full = torch.cat([torch.zeros(1, 7, 4, 16).half(), q, torch.zeros(1, 1, 4, 16).half()], 1)
        expected = reference(q_full, k, v, True)[:, 7:12]
        assert torch.allclose(acc.double(), expected, atol=5e-3)
    finally:
        clear_lse_cache()


def test_the_ring_merge_is_the_softmax_over_every_block_in_any_order() -> None:
    """A ring merges each block's partial output into running accumulators in place
    (one lerp_ pass by the block's share of the merged softmax): parts over
    disjoint key blocks, merged in any order, give attention over every key (the
    float64 reference) and its log-sum-exp; the first part into empty accumulators
    lands exactly; a row no key has reached (both log-sum-exps -inf) keeps its zero."""
    from attnres.parallel import _merge_into

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, n, 3, 8, generator=gen) for n in (5, 12, 12))
    parts = [eager_lse(q, k[:, a:b], v[:, a:b], False, None) for a, b in ((0, 3), (3, 8), (8, 12))]
    expected = reference(q, k, v, False)
    expected_lse = torch.logsumexp(reference_scores(q, k, False), -1)
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        out = torch.zeros(q.shape)
        lse = torch.full((2, 3, 5), float("-inf"))
        for i in order:
            _merge_into(out, lse, *parts[i])
            if i == order[0]:
                assert torch.equal(out, parts[i][0]) and torch.equal(lse, parts[i][1])
        assert torch.allclose(out.double(), expected, atol=1e-6)
        assert torch.allclose(lse.double(), expected_lse, atol=1e-5)
    out = torch.zeros(1, 2, 3, 8)
    lse = torch.full((1, 3, 2), float("-inf"))
    part_lse = torch.tensor([[[float("-inf"), 0.5]] * 3])  # row 0 sees no key of the part
    _merge_into(out, lse, torch.ones(1, 2, 3, 8), part_lse)
    assert torch.equal(out[:, 0], torch.zeros(1, 3, 8))
    assert torch.equal(out[:, 1], torch.ones(1, 3, 8))
    assert torch.isneginf(lse[..., 0]).all() and torch.equal(lse[..., 1], torch.full((1, 3), 0.5))


def test_diffusers_context_parallel_config_is_read_as_the_layout() -> None:
    from diffusers import ContextParallelConfig, ParallelConfig

    from attnres.layout import context_parallel_layout

    class Model:
        _parallel_config = None

    model = Model()
    assert context_parallel_layout(model, 24) is None
    model._parallel_config = ParallelConfig(  # type: ignore[assignment]
        context_parallel_config=ContextParallelConfig(ring_degree=2, ulysses_degree=2)
    )
    assert context_parallel_layout(model, 24, 8) == SequenceLayout(2, 2, 24, 8)
    model._parallel_config = ParallelConfig(  # type: ignore[assignment]
        context_parallel_config=ContextParallelConfig(ulysses_degree=4, ulysses_anything=True)
    )
    assert context_parallel_layout(model, 6, 6) == SequenceLayout(4, 1)  # heads need not divide


def test_rule_a_layout_is_never_autotuned() -> None:
    from attnres.tuning import is_tunable

    plain = attnres.resolve(_spec(None), platform=HOPPER)
    laid = attnres.resolve(_spec(SequenceLayout(2, 1, 24, 24)), platform=HOPPER)
    assert is_tunable(plain.trace) and not is_tunable(laid.trace)


def test_the_docs_show_the_example_script_as_it_is() -> None:
    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "sequence-parallel.md").read_text(encoding="utf-8")
    marker = "<!-- the file examples/sequence_parallel.py -->\n```py-norun\n"
    shown = doc[doc.index(marker) + len(marker) :].split("```\n", 1)[0]
    assert shown == (root / "examples" / "sequence_parallel.py").read_text(encoding="utf-8")


def test_a_layout_trace_is_schema_version_5_and_older_versions_refuse_one() -> None:
    from attnres.trace import LAYOUT_SCHEMA_VERSION

    laid = attnres.resolve(_spec(SequenceLayout(1, 2, 24, 24)), platform=HOPPER).trace
    assert laid.schema_version == LAYOUT_SCHEMA_VERSION == 5
    assert attnres.resolve(_spec(None), platform=HOPPER).trace.schema_version == 2
    doc = json.loads(json.dumps(trace_to_dict(laid)))
    doc["schema_version"] = 4
    with pytest.raises(attnres.TraceFormatError, match="belongs to schema version 5"):
        trace_from_dict(doc)


def test_sage_lse_adapter_through_a_fake(monkeypatch: pytest.MonkeyPatch) -> None:
    """sageattn(..., tensor_layout="NHD", return_lse=True) -> (out, lse (b, h, s));
    is_causal only with equal lengths (the ring never asks otherwise)."""
    import sys
    import types

    from attnres.kernels.lse import clear_lse_cache, get_lse_kernel

    def sageattn(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str = "HND",
        is_causal: bool = False, sm_scale: float | None = None, return_lse: bool = False,
        **kwargs: Any,
    ) -> Any:  # fmt: skip
        assert tensor_layout == "NHD" and q.dtype in (torch.float16, torch.bfloat16)
        assert not is_causal or q.shape[1] == k.shape[1], "is_causal needs qo_len == kv_len"
        out = reference(q, k, v, is_causal).to(q.dtype)
        lse = torch.logsumexp(reference_scores(q, k, is_causal), -1).float()
        return (out, lse) if return_lse else out

    module = types.ModuleType("sageattention")
    module.sageattn = sageattn  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "sageattention", module)
    clear_lse_cache()
    try:
        sage_lse = get_lse_kernel("sage_attn")
        assert sage_lse is not None
        q, k, v = (torch.randn(1, 6, 4, 16).half() for _ in range(3))
        out, lse = sage_lse(q, k, v, True, None)
        assert torch.allclose(out.double(), reference(q, k, v, True), atol=2e-3)
        assert lse.shape == (1, 4, 6)
        with pytest.raises(ValueError, match="softcap"):
            sage_lse(q, k, v, False, None, 5.0)
    finally:
        clear_lse_cache()


def test_diffusers_context_parallel_sites_are_decided_for_the_layout() -> None:
    """Issue 24 item 4: a diffusers model with context parallelism enabled gets its
    sites resolved with that layout; the VAE and text encoder keep none."""
    import tiny_pipelines as tp
    from diffusers import ContextParallelConfig, ParallelConfig

    from attnres.integrations import diffusers as governed

    components = tp.wan()
    components["transformer"]._parallel_config = ParallelConfig(
        context_parallel_config=ContextParallelConfig(ring_degree=2)
    )
    plan = governed.plan(components, platform=HOPPER)
    for site in plan.sites:
        laid = site.component == "transformer"
        layout = None if site.spec is None else site.spec.layout
        assert (layout is not None) == laid, site.name
        if laid and site.trace is not None:
            assert site.trace.input.layer.layout == SequenceLayout(1, 2, 2, 2)
            assert any(getattr(r, "check", None) is Check.LAYOUT for r in site.trace.records)
    config = attnres.SelectionConfig(component_backends={"transformer": "dynamic_cudnn_sdpa"})
    strict = governed.plan(components, config, platform=HOPPER)
    errors = [str(s.error) for s in strict.sites if s.component == "transformer"]
    assert errors and all(e and "log-sum-exp" in e for e in errors), errors


def test_rule_a_ring_refuses_a_bottom_right_causal_layer() -> None:
    bottom_right = Requirements(causal=True, causal_alignment="bottom_right")
    spec = _spec(SequenceLayout(1, 2), requirements=bottom_right, role="cross")
    (failure,) = _layout_failures("eager", spec, HOPPER)
    assert failure.code is Code.LAYOUT_UNSUPPORTED and "bottom_right" in failure.message
    ulysses = _spec(SequenceLayout(2, 1), requirements=bottom_right, role="cross")
    assert _layout_failures("eager", ulysses, HOPPER) == ()  # each rank sees it all


# -- issue 32 / 35: the ring's backward from the log-sum-exp, bounds -----------------------


def _ring_by_hand(
    lse_fn: Any, backward: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
    cuts: tuple[int, ...], q0: int = 0,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """One rank's ring in one process: q's rows (global offset ``q0``) over the key/value
    blocks cut at ``cuts``, forward merged by the log-sum-exp, then every block's
    gradients recomputed from the merged statistics (what ``_Ring`` does per step)."""
    from attnres.parallel import _ParallelRun

    run = object.__new__(_ParallelRun)
    run.lse, run.scale, run.softcap, run.causal, run.head_size = lse_fn, None, 0.0, causal, 16
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(q.shape, dtype=acc)
    lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc)
    bounds = list(zip((0, *cuts), (*cuts, k.shape[1]), strict=True))
    for lo, hi in bounds:
        run._attend(q, k[:, lo:hi], v[:, lo:hi], q0, lo, out, lse)
    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    dq = torch.zeros(q.shape, dtype=acc)
    dk, dv = torch.zeros(k.shape, dtype=acc), torch.zeros(v.shape, dtype=acc)
    for lo, hi in bounds:
        for r0, r1, c0, c1, piece_causal in run._pieces(q.shape[1], q0, hi - lo, lo):
            gq, gk, gv = backward(
                weight[:, r0:r1].to(q.dtype), q[:, r0:r1], k[:, lo + c0 : lo + c1],
                v[:, lo + c0 : lo + c1], out[:, r0:r1], lse[..., r0:r1], piece_causal, None,
            )  # fmt: skip
            dq[:, r0:r1] += gq.to(acc)
            dk[:, lo + c0 : lo + c1] += gk.to(acc)
            dv[:, lo + c0 : lo + c1] += gv.to(acc)
    return out, dq, dk, dv, weight


def _reference_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, q0: int,
    weight: torch.Tensor,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """float64 outputs and gradients of q's rows at global offset q0 (the rows before
    it padded with zeros, then cut away)."""
    pad = torch.zeros(q.shape[0], q0, *q.shape[2:], dtype=torch.float64)
    q64, k64, v64 = (t.detach().double().clone().requires_grad_() for t in (q, k, v))
    full_q = torch.cat([pad, q64], 1)
    out = reference(full_q, k64, v64, causal)[:, q0:]
    (out * weight).sum().backward()
    assert q64.grad is not None and k64.grad is not None and v64.grad is not None
    return out.detach(), q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, 2e-5), (torch.bfloat16, 3e-2), (torch.float64, 1e-12)],
)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend", ["eager", "torch_sdpa"])
def test_ring_block_backward_from_the_merged_lse_matches_float64(
    backend: str, causal: bool, dtype: torch.dtype, tolerance: float
) -> None:
    """Issue 35 item 1: each block's gradients recomputed from the merged output and
    log-sum-exp (nothing kept from the forward's scores) add up to the full gradients;
    GQA, uneven blocks, a query block straddling the diagonal."""
    from attnres.kernels.lse import get_lse_backward, get_lse_kernel

    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 6, 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(2, 13, 2, 16, generator=gen).to(dtype) for _ in range(2))
    got = _ring_by_hand(get_lse_kernel(backend), get_lse_backward(backend), q, k, v, causal,
                        (4, 9), q0=5)  # fmt: skip
    expected = _reference_grads(q, k, v, causal, 5, got[-1])
    for mine, ref in zip(got[:4], expected, strict=True):
        assert (mine.double() - ref).abs().max() < tolerance


def test_eager_block_backward_with_softcap_matches_autograd() -> None:
    from attnres.kernels.lse import eager_lse_backward

    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 5, 2, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    out, lse = eager_lse(qg, kg, vg, True, None, 3.0)
    weight = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out * weight).sum().backward()
    grads = eager_lse_backward(weight, q, k, v, out.detach(), lse.detach(), True, None, 3.0)
    for mine, ref in zip(grads, (qg.grad, kg.grad, vg.grad), strict=True):
        assert ref is not None and torch.allclose(mine, ref, atol=1e-10)


def _fake_flash_attn_with_backward() -> tuple[Any, Any]:
    """flash-attn 2.6's ``flash_attn_interface._flash_attn_backward(dout, q, k, v, out,
    softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
    window_size_right, softcap, alibi_slopes, deterministic, rng_state=None)``: fills
    dq, dk, dv (fp16/bf16, GQA native) from the given out and softmax_lse."""
    import types

    module = _fake_flash_attn()

    def _flash_attn_backward(
        dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, softmax_lse: torch.Tensor, dq: torch.Tensor, dk: torch.Tensor,
        dv: torch.Tensor, dropout_p: float, softmax_scale: float, causal: bool,
        window_size_left: int, window_size_right: int, softcap: float, alibi_slopes: Any,
        deterministic: bool, rng_state: Any = None,
    ) -> None:  # fmt: skip
        assert q.dtype in (torch.float16, torch.bfloat16) and softmax_lse.dtype == torch.float32
        assert out.dtype == q.dtype and dout.dtype == q.dtype and window_size_left == -1
        groups = q.shape[2] // k.shape[2]
        qh = q.double().transpose(1, 2)
        kh = k.double().transpose(1, 2).repeat_interleave(groups, 1)
        vh = v.double().transpose(1, 2).repeat_interleave(groups, 1)
        scores = (qh @ kh.transpose(-1, -2)) * softmax_scale
        if causal:  # bottom-right
            keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril(
                k.shape[1] - q.shape[1]
            )
            scores = scores.masked_fill(~keep, float("-inf"))
        p = torch.exp(scores - softmax_lse.double().unsqueeze(-1))
        do = dout.double().transpose(1, 2)
        ds = p * (do @ vh.transpose(-1, -2) - (do * out.double().transpose(1, 2)).sum(-1, True))
        b, h, sk, d = kh.shape

        def fold(g: torch.Tensor) -> torch.Tensor:
            return g.reshape(b, h // groups, groups, sk, d).sum(2).transpose(1, 2)

        dq.copy_((ds @ kh * softmax_scale).transpose(1, 2))
        dk.copy_(fold(ds.transpose(-1, -2) @ qh * softmax_scale))
        dv.copy_(fold(p.transpose(-1, -2) @ do))

    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface._flash_attn_backward = _flash_attn_backward  # type: ignore[attr-defined]
    module.flash_attn_interface = interface
    return module, interface


def test_a_training_ring_on_fa_recomputes_with_flash_attn_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 32 item 13 / issue 35 item 1: a training ring on ``fa`` is allowed (the
    machine's layout check passes) and its gradients come from flash-attn's own
    ``_flash_attn_backward`` given the merged statistics, as diffusers' ring does."""
    import sys

    from attnres.kernels.lse import clear_lse_cache, get_lse_backward, get_lse_kernel

    training = Requirements(backward=True)
    assert _layout_failures("fa", _spec(SequenceLayout(1, 2), requirements=training), HOPPER) == ()
    module, interface = _fake_flash_attn_with_backward()
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
    clear_lse_cache()
    try:
        gen = torch.Generator().manual_seed(13)
        q = torch.randn(1, 5, 4, 16, generator=gen).half()
        k, v = (torch.randn(1, 13, 2, 16, generator=gen).half() for _ in range(2))
        got = _ring_by_hand(get_lse_kernel("fa"), get_lse_backward("fa"), q, k, v, True,
                            (4,), q0=7)  # fmt: skip
        expected = _reference_grads(q, k, v, True, 7, got[-1])
        for mine, ref in zip(got[:4], expected, strict=True):
            assert (mine.double() - ref).abs().max() < 2e-2
    finally:
        clear_lse_cache()


def test_a_diffusers_training_ring_on_fa_is_planned() -> None:
    """Issue 32 item 13: diffusers' context-parallel ring in training on ``fa`` was
    refused with ``layout_unsupported``; its ring runs flash-attn's backward with the
    merged log-sum-exp, so the plan selects fa."""
    import tiny_pipelines as tp
    from diffusers import ContextParallelConfig, ParallelConfig

    from attnres.integrations import diffusers as governed

    components = tp.wan()
    transformer = components["transformer"].to(torch.bfloat16).train()
    transformer._parallel_config = ParallelConfig(
        context_parallel_config=ContextParallelConfig(ring_degree=2)
    )
    config = attnres.SelectionConfig(component_backends={"transformer": "fa"})
    plan = governed.plan({"transformer": transformer}, config, platform=HOPPER)
    sites = [s for s in plan.sites if s.trace is not None]
    assert sites and all(s.error is None for s in sites), [s.error for s in sites]
    for site in sites:
        assert site.trace is not None and site.trace.input.layer.requirements.backward
        assert site.trace.input.layer.layout is not None


def test_a_training_ring_on_a_kernel_without_a_block_backward_is_refused() -> None:
    training = Requirements(backward=True)
    spec = _spec(SequenceLayout(1, 2), requirements=training)
    (failure,) = _layout_failures("sage_attn", spec, HOPPER)
    assert failure.code is Code.LAYOUT_UNSUPPORTED and "no backward" in failure.message


@pytest.mark.parametrize("timeout", [1e300, 10**400, 7 * 86400 + 1])
def test_an_unbounded_timeout_is_a_value_error_not_an_overflow(timeout: float) -> None:
    """Issue 32 item 11: ``SequenceParallel(timeout=1e300)`` raised OverflowError."""
    from datetime import timedelta

    from attnres.distributed import verify_consensus
    from attnres.errors import SequenceParallelArgumentError

    with pytest.raises(SequenceParallelArgumentError, match="timeout must be at most"):
        attnres.SequenceParallel(ring=2, timeout=timeout)
    with pytest.raises(SequenceParallelArgumentError, match="timeout must be at most"):
        verify_consensus([], timeout=timedelta(days=8))


@pytest.mark.parametrize(
    ("kwargs", "argument", "message"),
    [
        # timeouts: what was asked (SequenceParallel's timeout) and the bound (a week)
        ({"ring": 2, "timeout": 1e300}, "timeout",
         "SequenceParallel: timeout must be at most 604800 s (a week), got 1e+300"),
        ({"ring": 2, "timeout": 10**400}, "timeout",
         "SequenceParallel: timeout must be at most 604800 s (a week), got a huge number"),
        # -10**400 overflowed float() (OverflowError) before the bound was checked
        ({"ring": 2, "timeout": -(10**400)}, "timeout",
         "SequenceParallel: timeout must be a positive, finite duration of at most 604800 s"),
        ({"ring": 2, "timeout": float("nan")}, "timeout", "got nan"),
        ({"ring": 2, "timeout": 0}, "timeout", "positive, finite duration"),
        # degrees: which one, and the bound
        ({"ulysses": 0}, "ulysses degree",
         "ulysses degree: expected a positive integer (1 to 65536 ranks), got 0"),
        ({"ring": 10**400}, "ring degree", "ring degree: must be at most 65536 ranks"),
        ({"ring": "2"}, "ring degree", "ring degree: expected a positive integer"),
    ],
    ids=["timeout-1e300", "timeout-huge-int", "timeout-huge-negative", "timeout-nan",
         "timeout-zero", "ulysses-zero", "ring-huge", "ring-str"],
)  # fmt: skip
def test_bad_sequence_parallel_arguments_are_typed(
    kwargs: dict[str, Any], argument: str, message: str
) -> None:
    """Issue 32 items 11 and 16: a bad SequenceParallel argument is an AttnresError
    (still a ValueError) saying what was asked and the bound; it was a plain
    ValueError (and, for -10**400 seconds, an OverflowError)."""
    from attnres.errors import AttnresError, SequenceParallelArgumentError

    with pytest.raises(SequenceParallelArgumentError) as info:
        attnres.SequenceParallel(**kwargs)
    assert isinstance(info.value, AttnresError) and isinstance(info.value, ValueError)
    assert message in str(info.value), str(info.value)
    assert info.value.argument == argument
    with pytest.raises(SequenceParallelArgumentError):  # the layout alone, as the CLI builds it
        if argument != "timeout":
            SequenceLayout(**kwargs)
        else:
            from attnres.distributed import verify_consensus

            verify_consensus([], timeout=kwargs["timeout"])


def test_zigzag_blocks_give_every_rank_an_early_and_a_late_half() -> None:
    """Issue 35 item 2: a causal ring's rank r works on halves r and 2R-1-r, so the
    causal work is balanced (rank 0 no longer idles while the last rank does most)."""
    from attnres.parallel import _halves, _zigzag

    halves = _halves([5, 4, 4, 3])  # uneven blocks: each split into halves, first the longer
    assert halves == [(3, 0), (2, 3), (2, 5), (2, 7), (2, 9), (2, 11), (2, 13), (1, 15)]
    assert _zigzag(halves) == [
        ((3, 0), (1, 15)), ((2, 3), (2, 13)), ((2, 5), (2, 11)), ((2, 7), (2, 9)),
    ]  # fmt: skip

    def causal_pairs(segments: tuple[tuple[int, int], ...]) -> int:
        # query-key pairs a rank computes: each row sees the keys at or before it
        return sum(offset + i + 1 for n, offset in segments for i in range(n))

    work = [causal_pairs(segs) for segs in _zigzag(_halves([64, 64, 64, 64]))]
    assert max(work) - min(work) <= 0.02 * max(work)


# -- issue 35 quality bar: the ring's backward in chunks, memory per rank -------------------


def test_a_ring_backward_in_chunks_matches_float64_and_bounds_memory(tmp_path: Path) -> None:
    """The ring's backward goes in chunks of key/value heads and sequence parts, each
    around the ring in turn: forced into the smallest chunks, every ring layout
    (causal or not, GQA, uneven lengths; float32 on eager and torch_sdpa, bfloat16)
    matches the float64 reference with gradients; at a size where chunks start on
    their own, torch's allocations (the profiler's events, counted per tensor, in
    units of one rank's shard of q) stay bounded: the forward keeps the output and
    its log-sum-exp, and the backward's peak is the three gradients plus what is in
    flight (about 1/16 of a block, and the CPU kernel's scratch), where the
    unchunked backward peaked at 8.5 shards (the next block, its gradients and the
    kernel's whole-block outputs). A causal (zig-zag) ring is bounded the same way:
    it kept zig-zag copies of q, k, v and the output besides the caller's (5 shards)."""
    results = run_ranks(tmp_path, 2, ["chunked", "ring_memory"], work_s=240)
    for rank in (0, 1):
        assert "crashed" not in results[rank]["chunked"], results[rank]["chunked"]
        assert results[rank]["chunked"]["cases"] == 24
        assert "crashed" not in results[rank]["ring_memory"], results[rank]["ring_memory"]
    errors = results[0]["chunked"]["max_err"]
    assert 0 < errors["float32"] < 5e-5, errors
    assert 0 < errors["bfloat16"] < 3e-2, errors
    for rank in (0, 1):
        plain, causal = results[rank]["ring_memory"]["False"], results[rank]["ring_memory"]["True"]
        assert plain["kept"] < 1.1, plain  # the output (one shard) and the log-sum-exp
        assert plain["backward_peak"] < 4.5, plain  # dq, dk, dv and ~1/16 of a block
        # a causal ring keeps the same as a non-causal one: its zig-zag exchange lives
        # inside the ring's autograd function, which saves the caller's q, k, v and the
        # output (the zig-zag copies of q, k, v and the output it kept, 5.03 shards, with
        # a forward peak of 7.3 and a backward peak of 5.0); the backward moves one head
        # chunk's received query halves at a time, keys and values not at all
        assert causal["kept"] < 1.1, causal
        assert causal["forward_peak"] < 3.0, causal  # one head chunk's zig-zag copies
        assert causal["backward_peak"] < 4.5, causal
        assert causal["kept"] + causal["backward_peak"] < 5.5, causal
