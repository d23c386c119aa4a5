"""One outcome shape: Resolution, Decision and the plan row compose the trace's Outcome."""

from __future__ import annotations

import pytest

import attnres
from attnres.backends import Backend
from attnres.layer import LayerSpec, SelectionConfig
from attnres.ledger import Decision
from attnres.plan import LayerEntry, _plan_layer
from attnres.platform import Platform
from attnres.runtime import Resolution
from attnres.trace import Outcome


def test_resolution_and_decision_read_through_to_the_traces_outcome() -> None:
    res = attnres.resolve(LayerSpec(64, "float16"), platform=Platform.simulate("cpu"))
    assert res.outcome is res.trace.outcome
    assert (res.backend, res.reason, res.origin) == (
        res.outcome.backend,
        res.outcome.reason,
        res.outcome.origin,
    )
    decision = Decision(None, "attn", res.outcome, res.trace)
    assert decision.backend == res.backend.name
    assert (decision.status, decision.origin, decision.reason) == (
        "selected",
        res.origin,
        res.reason,
    )


def test_a_resolution_holds_only_a_selected_outcome() -> None:
    res = attnres.resolve(LayerSpec(64, "float16"), platform=Platform.simulate("cpu"))
    with pytest.raises(ValueError, match="selected outcome, got rejected"):
        Resolution(Outcome("rejected", "layer", code="package_missing", error="x"), res.trace)


def test_a_rejected_plan_row_carries_the_rejection_outcome() -> None:
    entry = LayerEntry("blocks.*", 2, LayerSpec(64, "float16"), backend=Backend.parse("fa3"))
    row = _plan_layer("transformer", entry, SelectionConfig(), Platform.simulate("cpu"))
    assert row.outcome is row.trace.outcome
    assert (row.status, row.backend, row.origin) == ("rejected", None, "layer")
    assert row.code is not None and row.error is not None
    assert row.to_dict()["error"] == row.error
