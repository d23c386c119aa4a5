"""The process-wide ledger of decisions: what every layer was given, and why.

``attnres.decisions()`` returns it; :mod:`attnres.distributed` compares it
across ranks. Appending is thread-safe.

The ledger is bounded, so a long-running server that builds layers per request
does not grow without end: it keeps the newest :data:`DEFAULT_LIMIT` (65,536)
decisions and drops the oldest beyond that, counting what it dropped
(:func:`dropped_decisions`). :func:`set_decision_limit` changes the bound (it
keeps the newest entries); :func:`clear_decisions` empties the ledger and the
count. A model builds its layers at start-up, so its decisions sit well inside
the bound; consensus (:mod:`attnres.distributed`) compares what is kept.

The ledger says what runs now (issue 33): a layer that resolves again replaces
its own entry (:func:`replace_decision`); an integration's sites, named by
(component, site), have one current entry each -- ``plan()`` records nothing,
``apply()`` replaces the entries of the sites it installs
(:func:`set_decisions`) and ``remove()`` removes those of the sites it restores
(:func:`forget_decisions`).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from attrs import field, frozen

from attnres._outcome import Outcome, OutcomeView
from attnres.errors import InvalidArgumentError

if TYPE_CHECKING:
    from attnres.trace import Trace

__all__ = [
    "DEFAULT_LIMIT",
    "Decision",
    "clear_decisions",
    "decision_limit",
    "decisions",
    "dropped_decisions",
    "forget_decisions",
    "record_decision",
    "replace_decision",
    "set_decision_limit",
    "set_decisions",
]

#: How many decisions the ledger keeps by default (the newest ones).
DEFAULT_LIMIT = 65_536


@frozen
class Decision(OutcomeView):
    """One resolution: where it happened, what it chose, and its trace."""

    component: str | None
    layer: str | None
    #: how it ended (the trace's outcome); status, backend (its name), reason,
    #: origin, error and code read through to it (OutcomeView)
    outcome: Outcome
    trace: Trace = field(eq=False, repr=False)

    @property
    def digest(self) -> str:
        """The SHA-256 of the trace's canonical JSON (computed on first use)."""
        return self.trace.digest

    def key(self) -> tuple[str, str]:
        """What identifies the call site across ranks: component and layer name."""
        return (self.component or "", self.layer or "")


_LOCK = threading.Lock()
_DECISIONS: deque[Decision] = deque(maxlen=DEFAULT_LIMIT)
_RECORDED = [0]  # every decision ever appended since the last clear
#: (issue 36) bumped whenever entries leave the ledger other than by its bound
#: (a clear, a forget, a replacement of keys, a new limit): a memo that recorded
#: a decision once compares it to know the entry may be gone and records again
_REMOVALS = [0]


def record_decision(decision: Decision) -> None:
    # deque.append (bounded: the oldest entry drops out) is atomic, like the
    # counter's item assignment under the GIL: no lock on a cache hit's path.
    _DECISIONS.append(decision)
    _RECORDED[0] += 1


def replace_decision(stale: Decision | None, fresh: Decision) -> None:
    """Put ``fresh`` where ``stale`` (the same object) was last recorded; append it
    when ``stale`` is not in the ledger (cleared meanwhile, or ``None``).

    A layer that resolves again (cast to another dtype) keeps one entry: the
    ledger says what every layer runs now. (A stale entry the bound dropped
    already is not found: ``fresh`` is appended, and counted.)
    """
    with _LOCK:
        if stale is not None:
            for index in range(len(_DECISIONS) - 1, -1, -1):
                if _DECISIONS[index] is stale:
                    _DECISIONS[index] = fresh
                    return
        _DECISIONS.append(fresh)
        _RECORDED[0] += 1


def set_decisions(fresh: Iterable[Decision]) -> None:
    """Make ``fresh`` the one current entry of each of their (component, layer)
    keys: every entry of those keys goes, and ``fresh`` is appended in order (an
    integration's ``apply``: applying again replaces, it does not add)."""
    current = list(fresh)
    keys = {d.key() for d in current}
    with _LOCK:
        kept = [d for d in _DECISIONS if d.key() not in keys]
        _RECORDED[0] -= len(_DECISIONS) - len(kept)
        _REMOVALS[0] += 1
        _DECISIONS.clear()
        _DECISIONS.extend(kept)
        for decision in current:
            _DECISIONS.append(decision)
            _RECORDED[0] += 1


def forget_decisions(keys: Iterable[tuple[str | None, str | None]]) -> int:
    """Remove every entry of these (component, layer) keys (an integration's
    ``remove``: the restored sites run nothing of attnres's); returns how many."""
    gone = {(component or "", layer or "") for component, layer in keys}
    with _LOCK:
        kept = [d for d in _DECISIONS if d.key() not in gone]
        removed = len(_DECISIONS) - len(kept)
        _RECORDED[0] -= removed
        _REMOVALS[0] += 1
        _DECISIONS.clear()
        _DECISIONS.extend(kept)
    return removed


def decisions() -> tuple[Decision, ...]:
    """The decisions this process recorded (the newest ``decision_limit()``), oldest first."""
    with _LOCK:
        return tuple(_DECISIONS)


def dropped_decisions() -> int:
    """How many of the oldest decisions the bound dropped since the last clear."""
    with _LOCK:
        return max(0, _RECORDED[0] - len(_DECISIONS))


def decision_limit() -> int:
    limit = _DECISIONS.maxlen
    assert limit is not None
    return limit


def set_decision_limit(limit: int) -> int:
    """Keep at most ``limit`` decisions (the newest); returns the previous limit.

    Meant for start-up (a decision recorded by another thread while the bound
    changes may be lost).
    """
    global _DECISIONS
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise InvalidArgumentError(f"limit: expected a positive integer, got {limit!r}")
    with _LOCK:
        previous = decision_limit()
        # the entries trimmed here count as dropped (recorded - kept)
        _DECISIONS = deque(_DECISIONS, maxlen=limit)
        _REMOVALS[0] += 1
    return previous


def clear_decisions() -> None:
    with _LOCK:
        _DECISIONS.clear()
        _RECORDED[0] = 0
        _REMOVALS[0] += 1
