"""What a trace says about precision (issue 34), without torch: the lines
``attnres plan`` and ``explain`` show per site (:mod:`attnres.precision` re-exports)."""

from __future__ import annotations

from attnres.layer import describe_budget
from attnres.machine import layer_budget
from attnres.records import PrecisionRecord
from attnres.trace import Trace

__all__ = ["describe_precision", "precision_of_trace"]


def precision_of_trace(trace: Trace) -> PrecisionRecord | None:
    """The trace's precision record (``None``: its layer had no budget)."""
    return next((r for r in trace.records if isinstance(r, PrecisionRecord)), None)


def describe_precision(trace: Trace) -> str:
    """One line for ``plan`` and ``explain``: exact or lossy, the budget and any
    measurement (``''`` when the layer had no budget)."""
    record = precision_of_trace(trace)
    if record is None:
        budget = layer_budget(trace.input)
        if budget is None:
            return ""
        return f"budget {budget.key}: {describe_budget(budget.value)}"
    text = f"{record.precision}, budget {record.budget_key}: {record.budget}"
    m = record.measured
    if m is not None:
        how = "emulated" if m.emulated else m.source
        text += f"; measured rel L2 {m.rel_l2:.3g}, cosine {m.cosine:.6f} ({how})"
    elif record.precision != "exact":
        text += "; not measured yet"
    return text
