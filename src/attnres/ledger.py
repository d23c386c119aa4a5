"""The process-wide ledger of decisions: what every layer was given, and why.

``attnres.decisions()`` returns it; :mod:`attnres.distributed` compares it
across ranks. Appending is thread-safe and never drops an entry.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from attrs import field, frozen

if TYPE_CHECKING:
    from attnres.trace import Trace

__all__ = ["Decision", "clear_decisions", "decisions", "record_decision", "replace_decision"]


@frozen
class Decision:
    """One resolution: where it happened, what it chose, and its trace."""

    component: str | None
    layer: str | None
    backend: str | None  # None when the resolution was rejected
    reason: str | None
    origin: str
    trace: Trace = field(eq=False, repr=False)

    @property
    def digest(self) -> str:
        """The SHA-256 of the trace's canonical JSON (computed on first use)."""
        return self.trace.digest

    @property
    def status(self) -> str:
        return "selected" if self.backend is not None else "rejected"

    def key(self) -> tuple[str, str]:
        """What identifies the call site across ranks: component and layer name."""
        return (self.component or "", self.layer or "")


_LOCK = threading.Lock()
_DECISIONS: list[Decision] = []


def record_decision(decision: Decision) -> None:
    # list.append is atomic: no lock on the hot path of a cache hit.
    _DECISIONS.append(decision)


def replace_decision(stale: Decision | None, fresh: Decision) -> None:
    """Put ``fresh`` where ``stale`` (the same object) was last recorded; append it
    when ``stale`` is not in the ledger (cleared meanwhile, or ``None``).

    A layer that resolves again (cast to another dtype) keeps one entry: the
    ledger says what every layer runs now.
    """
    with _LOCK:
        if stale is not None:
            for index in range(len(_DECISIONS) - 1, -1, -1):
                if _DECISIONS[index] is stale:
                    _DECISIONS[index] = fresh
                    return
        _DECISIONS.append(fresh)


def decisions() -> tuple[Decision, ...]:
    """Every decision this process recorded, oldest first."""
    with _LOCK:
        return tuple(_DECISIONS)


def clear_decisions() -> None:
    with _LOCK:
        _DECISIONS.clear()
