"""Issue 35 items 3-5: head padding, AllGather-KV, joint attention with replicated
text tokens, key-padding masks under Ulysses, and the layout as a decision
(``SequenceParallel(layout="auto")``, ``attnres plan DIR --sp-degree N``).

The multi-process tests start one launch per world size (2, then 4 ranks); every
layout kind runs inside it (``tests/layout_workers.py``) against a float64
one-process reference, forward and gradients. Every process is joined with a
deadline derived from the protocol's own timeout (``TIMEOUT_S``) with a wide
margin, and killed past it: a bug fails these tests, never hangs them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dist_workers import run_processes
from layout_workers import TIMEOUT_S, worker

import attnres
from attnres._states import Check, Code
from attnres.backends import Backend
from attnres.cli import main
from attnres.layer import LayerSpec, Requirements
from attnres.layout import MAX_PAD_COST, SequenceLayout, padded_heads
from attnres.machine import LAYOUT_RULES, AutoLayout, LayoutFacts, check_candidate, choose_layout
from attnres.platform import Platform
from attnres.trace import trace_from_dict, trace_to_dict

HOPPER = Platform.simulate("cuda:sm90+flash_attn+sageattention")


def _layout_failures(layout: SequenceLayout, **kw: Any) -> Any:
    spec = LayerSpec(head_size=128, dtype="bfloat16", layout=layout, **kw)
    return dict(check_candidate(Backend.parse("fa"), spec, HOPPER))[Check.LAYOUT]


# -- the layout kinds and their codes (machine.py) ---------------------------------------


def test_padded_heads_keep_whole_gqa_groups() -> None:
    assert padded_heads(14, 14, 4) == (16, 16)  # vllm-omni#7641's 14.3%
    assert padded_heads(6, 3, 4) == (8, 4)  # groups of 2 kept: kv 3 -> 4, q 4 x 2
    assert padded_heads(24, 24, 4) == (24, 24)  # divides: nothing padded
    layout = SequenceLayout(4, 1, 14, 14, pad_heads=True)
    assert layout.rank_heads() == (4, 4)
    assert layout.pad_cost() == pytest.approx(16 / 14)
    assert "heads zero-padded from 14 to 16 (kv 14 to 16) and dropped after: +14.3%" in (
        layout.per_rank("fa")
    )


def test_rule_padding_is_checked_for_its_cost_not_for_division() -> None:
    # padded: heads that do not divide pass (the plain Ulysses layout fails them)
    assert _layout_failures(SequenceLayout(4, 1, 6, 6, pad_heads=True)) == ()
    (plain,) = _layout_failures(SequenceLayout(4, 1, 6, 6))
    assert plain.code is Code.HEADS_NOT_DIVISIBLE
    # 2 heads / 1 kv head over 4 ranks: kv 1 -> 4, q 2 -> 8: 4x the work
    (costly,) = _layout_failures(SequenceLayout(4, 1, 2, 1, pad_heads=True))
    assert costly.code is Code.PADDING_TOO_COSTLY
    assert "4.00x the attention work" in costly.message and f"{MAX_PAD_COST:g}x" in costly.message


def test_rule_allgather_kv_refuses_causal_layers_and_composes_with_ulysses_only() -> None:
    (failure,) = _layout_failures(
        SequenceLayout(1, 1, 8, 8, allgather=2), requirements=Requirements(causal=True)
    )
    assert failure.code is Code.ALLGATHER_CAUSAL
    assert _layout_failures(SequenceLayout(2, 1, 8, 2, allgather=2)) == ()
    with pytest.raises(ValueError, match="do not compose"):
        SequenceLayout(1, 2, allgather=2)
    assert SequenceLayout(2, 1, allgather=2).degree == 4
    assert SequenceLayout(2, 1, allgather=2).kind == "allgather_kv"


def test_rule_key_padding_masks_pass_under_ulysses_and_allgather_not_on_a_ring() -> None:
    padding = Requirements(mask="key_padding")
    assert _layout_failures(SequenceLayout(2, 1, 8, 8), requirements=padding) == ()
    assert _layout_failures(SequenceLayout(1, 1, 8, 8, allgather=2), requirements=padding) == ()
    (ring,) = _layout_failures(SequenceLayout(1, 2, 8, 8), requirements=padding)
    assert ring.code is Code.LAYOUT_UNSUPPORTED and "never on a ring" in ring.message
    # an arbitrary mask is not gathered with the keys
    (anything,) = _layout_failures(
        SequenceLayout(2, 1, 8, 8), requirements=Requirements(attn_mask=True)
    )
    assert anything.code is Code.LAYOUT_UNSUPPORTED


# -- the layout rules (LAYOUT_RULES, choose_layout) ---------------------------------------


@pytest.mark.parametrize(
    ("facts", "rule", "layout"),
    [
        (LayoutFacts(1, 8, 8), "one_rank", "ulysses=1 x ring=1"),
        (
            LayoutFacts(4, 24, 3, seq_len=4096, kv_bytes=512),
            "gqa_allgather_kv",
            "ulysses=1 x ring=1 x allgather=4",
        ),
        # the memory fact: the gathered K/V must fit the budget, and be known
        (LayoutFacts(4, 24, 6, seq_len=1 << 20, kv_bytes=512), "usp", "ulysses=2 x ring=2"),
        (LayoutFacts(4, 24, 6, kv_bytes=512), "usp", "ulysses=2 x ring=2"),
        # 3 kv heads divide by no degree of 4 ranks: padded to 4 (queries 24 -> 32)
        (LayoutFacts(4, 24, 3, kv_bytes=512), "pad_heads", "ulysses=4 x ring=1 (padded heads)"),
        (LayoutFacts(2, 24, 24, interconnect="pcie"), "pcie_pair_ring", "ulysses=1 x ring=2"),
        (LayoutFacts(4, 24, 24, interconnect="pcie"), "ulysses_divides", "ulysses=4 x ring=1"),
        (LayoutFacts(2, 24, 24, interconnect="nvlink"), "ulysses_divides", "ulysses=2 x ring=1"),
        (LayoutFacts(4, 6, 6), "usp", "ulysses=2 x ring=2"),
        (LayoutFacts(4, 6, 6, mask=True), "pad_heads", "ulysses=4 x ring=1 (padded heads)"),
        (LayoutFacts(4, 3, 3), "pad_heads", "ulysses=4 x ring=1 (padded heads)"),
        (LayoutFacts(4, 2, 1), "ring", "ulysses=1 x ring=4"),
        (LayoutFacts(4, 2, 1, mask=True), "allgather_kv", "ulysses=1 x ring=1 x allgather=4"),
        (
            LayoutFacts(4, 2, 1, mask=True, causal=True),
            "pad_heads_anyway",
            "ulysses=4 x ring=1 (padded heads)",
        ),
        # causal never gathers K/V
        (LayoutFacts(4, 24, 6, causal=True, seq_len=64, kv_bytes=512), "usp", "ulysses=2 x ring=2"),
    ],
)
def test_rule_layout_choice(facts: LayoutFacts, rule: str, layout: str) -> None:
    chosen = choose_layout(facts)
    assert (chosen.rule, chosen.ulysses_ring()) == (rule, layout)
    assert chosen.degree == facts.size
    assert (chosen.num_heads, chosen.num_kv_heads) == (facts.heads, facts.kv_heads)
    assert chosen.why is not None and f"{facts.size} ranks" in chosen.why


def test_every_layout_rule_names_its_source() -> None:
    names = [rule for rule, *_ in LAYOUT_RULES]
    assert len(set(names)) == len(names)
    for rule, _, _, words in LAYOUT_RULES:
        if rule not in ("one_rank", "ring", "pad_heads_anyway"):
            assert any(s in words for s in ("vllm-omni#", "arXiv", "DeepSpeed")), rule
    # the last row always holds: every layer gets a layout
    assert LAYOUT_RULES[-1][1](LayoutFacts(3, 1, 1, causal=True, mask=True))


# -- the trace (schema version 7) ---------------------------------------------------------


def test_a_layout_kind_trace_is_schema_7_and_round_trips() -> None:
    from attnres.trace import LAYOUT_KINDS_SCHEMA_VERSION

    chosen = choose_layout(LayoutFacts(4, 24, 3, seq_len=4096, kv_bytes=512))
    for layout in (chosen, SequenceLayout(4, 1, 6, 6, pad_heads=True)):
        trace = attnres.resolve(
            LayerSpec(head_size=128, dtype="bfloat16", layout=layout), platform=HOPPER
        ).trace
        assert trace.schema_version == LAYOUT_KINDS_SCHEMA_VERSION == 7
        doc = json.loads(json.dumps(trace_to_dict(trace)))
        assert trace_from_dict(doc) == trace
        doc["schema_version"] = 5
        with pytest.raises(attnres.TraceFormatError, match="belongs to schema version 7"):
            trace_from_dict(doc)
    # a plain layout keeps version 5 and its keys (older traces keep their bytes)
    plain = attnres.resolve(
        LayerSpec(head_size=128, dtype="bfloat16", layout=SequenceLayout(2, 1, 8, 8)),
        platform=HOPPER,
    ).trace
    assert plain.schema_version == 5
    assert set(trace_to_dict(plain)["input"]["layer"]["layout"]) == {
        "ulysses", "ring", "num_heads", "num_kv_heads",
    }  # fmt: skip


# -- construction ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layout": "fastest"}, "expected 'auto' or None"),
        ({"layout": "auto", "ulysses": 2}, "leave ulysses, ring, allgather"),
        ({"allgather": 2, "ring": 2}, "do not compose"),
        ({"interconnect": "infiniband"}, "interconnect"),
        ({"text_tokens": -1}, "text_tokens"),
        ({"seq_len": 0}, "seq_len"),
    ],
)
def test_bad_layout_arguments_are_value_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        attnres.SequenceParallel(**kwargs)


# -- the CLI: plan DIR --sp-degree N -------------------------------------------------------


def test_cli_plan_sp_degree_shows_the_choice_per_site(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "examples/flux.1-dev", "--platform", "cuda:sm90+flash_attn",
            "--sp-degree", "5"]  # fmt: skip
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    sites = doc["layout_choice"]["sites"]
    assert doc["layout_choice"]["sp_degree"] == 5
    assert {s["component"] for s in sites} == {"transformer"}  # the denoiser only
    assert sum(s["count"] for s in sites) == 57  # FLUX.1: 19 + 38 blocks
    # 24 heads over 5 ranks: padded to 25 (+4.2%)
    assert {(s["layout"], s["rule"]) for s in sites} == {
        ("ulysses=5 x ring=1 (padded heads)", "pad_heads")
    }
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped: any terminal width
    assert "Layout: chosen for 5 ranks (layout='auto'), per site" in text
    assert "rule pad_heads" in text and "24/24 heads" in text
    assert main([*argv[:-1], "4", "--interconnect", "pcie"]) == 0
    assert "ulysses=4 x ring=1 on torch_sdpa, rule" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "examples/image-video-dit.toml", "--sp-degree", "2"], "model folder"),
        (["plan", "examples/flux.1-dev", "--sp-degree", "2", "--ring-degree", "2"], "one or"),
        (["plan", "examples/flux.1-dev", "--interconnect", "pcie"], "give it too"),
    ],
)
def test_cli_sp_degree_mistakes_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_auto_layout_skips_sites_outside_the_denoiser() -> None:
    class Site:
        heads, kv_heads, head_size, dtype = 8, 8, 64, "bfloat16"
        requirements = Requirements()

    site = Site()
    assert AutoLayout(2).choose_for_site("vae", site) is site
    site.heads = None  # type: ignore[assignment]  # decided at its first call: no facts
    assert AutoLayout(2).choose_for_site("transformer", site) is site


# -- real gloo groups --------------------------------------------------------------------

#: the rendezvous timeout of a worker (covers the others' start-up)
RENDEZVOUS_S = 60.0


def run_ranks(tmp_path: Path, world: int, scenarios: list[str], work_s: float) -> dict[int, Any]:
    """One worker per rank; fails, never hangs, past the rendezvous bound plus
    ``work_s`` (both times a wide margin)."""
    args = [(rank, world, str(tmp_path), scenarios) for rank in range(world)]
    run_processes(worker, args, 3 * (RENDEZVOUS_S + work_s))
    return {r: json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(world)}


def _kinds_ok(result: dict[str, Any], world: int) -> None:
    assert "crashed" not in result, result.get("crashed")
    cases = result["cases"]
    assert len(cases) == (10 if world == 2 else 13)
    kinds = set()
    for case in cases:
        assert 0 < case["err"] < 2e-5, case  # compared: float32 never matches exactly
        assert 0 < case["grad_err"] < 5e-5, case
        kinds.add(case["layout"])
    # every kind ran: padded Ulysses, AllGather-KV, plain Ulysses (masks, joint text)
    assert f"ulysses={world} x ring=1 (padded heads)" in kinds
    assert f"ulysses=1 x ring=1 x allgather={world}" in kinds
    assert f"ulysses={world} x ring=1" in kinds
    if world == 4:
        assert "ulysses=2 x ring=1 x allgather=2" in kinds
        assert "ulysses=2 x ring=2 (padded heads)" in kinds


def _auto_ok(result: dict[str, Any], world: int) -> None:
    assert "crashed" not in result, result.get("crashed")
    declared = result["declared"]["layers"]
    # 4 heads divide the group: Ulysses; 8/2 GQA with the sequence declared: AllGather-KV
    assert declared["attn1"]["rule"] == "ulysses_divides"
    assert declared["attn1"]["layout"] == f"ulysses={world} x ring=1"
    assert declared["attn2"]["rule"] == "gqa_allgather_kv"
    assert declared["attn2"]["layout"] == f"ulysses=1 x ring=1 x allgather={world}"
    measured = result["measured"]
    kind, source = measured["interconnect"]
    assert kind in ("nvlink", "pcie") and source.startswith("measured ")
    for name in ("declared", "measured"):
        got = result[name]
        assert 0 < got["err"] < 2e-5 and 0 < got["grad_err"] < 5e-5, got
        for layer in got["layers"].values():
            assert layer["schema"] == 7 and layer["why"] and "[facts:" in layer["why"]
            assert f"{world} ranks" in layer["why"]


def test_two_ranks_every_layout_kind_and_auto_match_one_process(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 2, ["kinds", "auto", "auto_disagree"], work_s=60 + TIMEOUT_S)
    for rank in (0, 1):
        _kinds_ok(results[rank]["kinds"], 2)
        _auto_ok(results[rank]["auto"], 2)
        # the same measured fact on every rank (the slowest rank's time)
        assert (
            results[rank]["auto"]["measured"]["interconnect"]
            == (results[0]["auto"]["measured"]["interconnect"])
        )
        # ranks that chose differently stop together before any data moves
        differ = results[rank]["auto_disagree"]
        assert differ["error"] is not None, differ
        assert differ["error"].startswith("Ranks disagree on attention backends")
        assert "rule pcie_pair_ring" in differ["error"]
        assert "rule ulysses_divides" in differ["error"]
        assert differ["elapsed_s"] < 3 * TIMEOUT_S  # the protocol's bound, with a margin


def test_four_ranks_every_layout_kind_and_auto_match_one_process(tmp_path: Path) -> None:
    results = run_ranks(tmp_path, 4, ["kinds", "auto"], work_s=120)
    for rank in range(4):
        _kinds_ok(results[rank]["kinds"], 4)
        _auto_ok(results[rank]["auto"], 4)


def test_the_docs_show_the_layout_rules_as_they_are() -> None:
    page = (Path(__file__).resolve().parent.parent / "docs" / "sequence-parallel.md").read_text()
    for rule, _, _, words in LAYOUT_RULES:
        assert f"| `{rule}` | {words} |" in page, rule
    for code in ("padding_too_costly", "allgather_causal"):
        assert f"| `{code}` |" in page


def test_cli_explain_shows_padding_cost_and_the_allgather_refusal(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["explain", "--head-size", "128", "--dtype", "bf16", "--platform",
            "cuda:sm90+flash_attn+sageattention"]  # fmt: skip
    assert main([*base, "--ulysses-degree", "4", "--pad-heads", "--heads", "14"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "heads zero-padded from 14 to 16 (kv 14 to 16) and dropped after: +14.3%" in out
    argv = [*base, "--allgather-degree", "2", "--heads", "8", "--kv-heads", "2"]
    assert main([*argv, "--requires", "causal", "--attention-backend", "fa"]) == 1
    assert "Decision:  rejected (allgather_causal)" in capsys.readouterr().out
    assert main(argv) == 0
    assert "all-gather every key/value block" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--pad-heads"], "give --ulysses-degree too"),
        (["--allgather-degree", "2", "--ring-degree", "2"], "both split the query rows"),
    ],
)
def test_cli_layout_kind_flag_mistakes_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", "--head-size", "64", "--dtype", "fp32", *argv]) == 2
    assert message in " ".join(capsys.readouterr().err.split())
