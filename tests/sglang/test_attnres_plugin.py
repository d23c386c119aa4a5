"""attnres's own tests against SGLang 0.5.23 (issue 23), run by ``make test-sglang``
in SGLang's environment (never by ``make test``: tests/conftest.py ignores this folder).

- The backends attnres lacks are registered with the facts SGLang's own classes
  state (``sglang/multimodal_gen/runtime/layers/attention/backends/*.py``).
- Decisions made through the plugin are covered by ``attnres.verify_consensus``
  across two real gloo ranks: ranks that decide alike agree; a rank with another
  request, or on another platform, is named on every rank by a ``ConsensusError``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from attnres import distributed
from attnres._vocab import Requirement
from attnres.backends import Backend, get_spec
from attnres.integrations import sglang as plugin

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: dist_workers
from dist_workers import run_processes
from sglang_workers import worker

_BACKENDS = "sglang.multimodal_gen.runtime.layers.attention.backends"


@pytest.fixture(scope="module")
def registered() -> dict[str, plugin.BackendFacts]:
    plugin.install()
    try:
        return {f.name: f for f in plugin.backend_facts()}
    finally:
        plugin.uninstall()


def test_rule_every_sglang_backend_is_known_to_attnres_after_install(
    registered: dict[str, plugin.BackendFacts],
) -> None:
    from sglang.multimodal_gen.runtime.platforms import AttentionBackendEnum

    for member in AttentionBackendEnum:
        Backend.parse(member.name.lower())  # a spec or an alias; raises otherwise
    # the plugin registered exactly the members attnres had no spec or alias for
    assert {"laser_attn", "sol_attn", "hybrid_window_attn_h3"} <= set(registered)
    assert "fa2" not in registered and "torch_sdpa" not in registered
    for name in registered:
        assert AttentionBackendEnum[name.upper()]


@pytest.mark.parametrize(
    ("name", "module", "cls"),
    [
        ("hybrid_window_attn_h3", "hybrid_window_attn_h3", "HybridWindowAttentionH3Backend"),
        ("sol_attn", "sol_attn", "SolAttnBackend"),
        ("sla_attn", "sparse_linear_attn", "SparseLinearAttentionBackend"),
        ("video_sparse_attn_h3", "video_sparse_attn_h3", "VideoSparseAttentionH3Backend"),
    ],
)
def test_rule_sglang_backend_facts_are_those_its_class_states(
    registered: dict[str, plugin.BackendFacts], name: str, module: str, cls: str
) -> None:
    import importlib

    backend = getattr(importlib.import_module(f"{_BACKENDS}.{module}"), cls)
    facts = registered[name]
    assert facts.classes == (f"{_BACKENDS}.{module}.{cls}",)
    assert facts.head_sizes == tuple(sorted(backend.get_supported_head_sizes()))
    assert facts.packed_varlen is backend.supports_packed_varlen()
    assert facts.ring_rotation is backend.supports_ring_rotation()
    assert facts.accept_output_buffer is backend.accept_output_buffer
    assert facts.sparse is backend.get_enum().is_sparse
    spec = get_spec(name)
    assert spec.head_sizes.allowed == set(backend.get_supported_head_sizes())
    assert (Requirement.PACKED_VARLEN in spec.implements) is backend.supports_packed_varlen()


def test_rule_sglang_backend_whose_kernel_package_is_missing_is_unknown_with_why(
    registered: dict[str, plugin.BackendFacts],
) -> None:
    # laser_attn.py raises ImportError at import without its NPU package ('attentions')
    laser = registered["laser_attn"]
    assert laser.classes == () and laser.head_sizes is None
    ((fact, why),) = laser.unknown
    assert fact == "classes" and "laser_attn (ImportError:" in why and "'attentions'" in why
    assert why in get_spec("laser_attn").description


# -- verify_consensus over plugin decisions, two gloo ranks ---------------------

#: verify_consensus's timeout in the workers
TIMEOUT_S = 10.0
#: the group's rendezvous timeout: it covers the other rank's SGLang import
RENDEZVOUS_S = 120.0
#: a rank's own SGLang import and decisions before it joins (about 15 s here when
#: idle); an allowance, not a measurement
IMPORT_S = 120.0
#: every bound is multiplied by this before the test calls it a hang
MARGIN = 3.0


def test_rule_plugin_decisions_are_covered_by_verify_consensus_across_ranks(
    tmp_path: Path,
) -> None:
    # three verify_consensus calls, each bounded by its timeout plus its grace
    per_call = TIMEOUT_S + max(distributed._GRACE_MIN_S, 0.25 * TIMEOUT_S)
    bound = IMPORT_S + RENDEZVOUS_S + 3 * per_call
    run_processes(
        worker,
        [(rank, 2, str(tmp_path), TIMEOUT_S, RENDEZVOUS_S) for rank in range(2)],
        MARGIN * bound,
    )
    results = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(2)]
    for result in results:
        # every selector call was an attnres decision, in the ledger, and replays
        assert result["decided"] == result["in_ledger"] == result["replayed"] == 2 * 9 + 1
        assert result["agreed"]["layers"] == 9
    assert results[0]["agreed"]["digest"] == results[1]["agreed"]["digest"]
    assert results[0]["origins"] == ["component_override", "none"]
    assert results[1]["origins"] == ["component_override", "global_cli"]
    message = results[0]["differing"]
    assert message == results[1]["differing"]  # the same typed error on every rank
    # the same backend, chosen differently: still a disagreement, named per rank
    assert message.startswith("ConsensusError: Ranks disagree on how attention backends were ")
    assert "component 'vae'" in message and "component 'transformer'" not in message
    assert "rank 0 -> torch_sdpa (origin none), rank 1 -> torch_sdpa (origin global_cli)" in message
    assert "1 of 2 call sites differ across 2 ranks" in message
    # a rank on another platform: another backend for the same layer, on every rank
    message = results[0]["platform"]
    assert message == results[1]["platform"]
    assert message.startswith("ConsensusError: Ranks disagree on attention backends: ")
    assert "component 'vae'" in message
    assert "rank 0 -> torch_sdpa (origin none), rank 1 -> fa (origin none)" in message


# -- issue 32 (item 9): SGLang's global server args unset ------------------------


def _answer(call: Any) -> tuple[str, Any]:
    """What a selector call gives: the class, or the error's type."""
    try:
        return "class", call()
    except Exception as exc:  # SGLang's own refusal (ValueError) is an answer too
        return "error", type(exc).__name__


def test_rule_plugin_answers_every_call_sglang_answers_with_server_args_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # an explicit selected_attention_backend, a forced or a component backend never
    # reach SGLang's server args; the plugin read them first and raised
    # "ValueError: Global sgl_diffusion args is not set." (issue 32, item 9)
    import itertools

    import torch
    from sglang.multimodal_gen.runtime.layers.attention import selector
    from sglang.multimodal_gen.runtime.server_args import server_args

    monkeypatch.setattr(server_args, "_global_server_args", None)
    enum = selector.AttentionBackendEnum
    members = [enum.TORCH_SDPA, enum.FA, enum.SAGE_ATTN, enum.SLIDING_TILE_ATTN]
    contexts = [
        ("none", lambda: contextlib.nullcontext()),
        ("forced", lambda: selector.global_force_attn_backend_context_manager(enum.TORCH_SDPA)),
        (
            "component",
            lambda: selector.component_attn_backend_context_manager(
                enum.TORCH_SDPA, "transformer", require_backend_selection=False
            ),
        ),
    ]
    probes = list(itertools.product(contexts, [None, *members], [False, True], [64, 128]))

    def answers() -> list[tuple[str, Any]]:
        out = []
        for (_, context), selected, cross, head in probes:

            def call(
                context: Any = context,
                selected: Any = selected,
                cross: bool = cross,
                head: int = head,
            ) -> Any:
                with context():
                    return selector.get_attn_backend(
                        head, torch.bfloat16, None, selected, None, None, cross
                    )

            out.append(_answer(call))
        return out

    stock = answers()
    assert ("error", "ValueError") in stock  # nothing chosen: SGLang reads the args
    assert sum(kind == "class" for kind, _ in stock) > len(probes) // 2
    plugin.install()
    try:
        routed = answers()
    finally:
        plugin.uninstall()
    differing = [
        (name, selected, cross, head, s, r)
        for ((name, _), selected, cross, head), s, r in zip(probes, stock, routed, strict=True)
        if s[0] == "class" and s != r
    ]
    assert differing == []
    # and where SGLang refuses, the plugin refuses too
    assert [r[0] for r in routed] == [s[0] for s in stock]
