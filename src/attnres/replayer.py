"""Replay traces: rebuild the input, run the machine again, compare (SPEC 4).

A trace holds the full input of a resolution, platform facts included, so a
replay needs neither the GPU nor the kernel packages the trace recorded:
:func:`replay` loads the file (data only, see :mod:`attnres.trace`), runs
:func:`attnres.machine.run_machine` on the recorded input and compares the
records and the outcome. A tuned trace (autotune) is re-derived from its
recorded measurements by :func:`attnres.tuning.replay_tuned`: the same rule,
no device. A mismatch is described by :attr:`ReplayResult.diff`:
the first divergent record, field by field with both sides, then a summary of
the rest and of the outcome.

:func:`replay_paths` replays files and folders and returns a :class:`ReplayRun`;
``attnres replay PATH... [--update]`` renders it (the CLI prints, this module
never does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from attrs import field, frozen

from attnres import machine as _machine
from attnres._files import check_manifest
from attnres._states import ReplayStatus, Status
from attnres.errors import ArgumentTypeError, TraceFormatError
from attnres.trace import Outcome, Trace, TuningRecord, dump_trace, load_trace, record_to_dict
from attnres.tuning import replay_tuned

__all__ = [
    "ReplayEntry",
    "ReplayResult",
    "ReplayRun",
    "describe_outcome",
    "diff_traces",
    "replay",
    "replay_paths",
]

#: How many further divergent records the summary names before "...".
_NAMED_IN_SUMMARY = 5


@frozen
class ReplayResult:
    """What a replay found: ``ok`` when records and outcome match, else a ``diff``."""

    ok: bool
    diff: str
    path: str | None
    recorded: Trace = field(repr=False)
    replayed: Trace = field(repr=False)
    #: index of the first record that differs (``None`` when every record matches)
    first_divergence: int | None = None

    def __bool__(self) -> bool:
        return self.ok


def replay(path_or_trace: str | os.PathLike[str] | Trace) -> ReplayResult:
    """Replay a trace file (or a :class:`~attnres.trace.Trace`) and compare.

    Raises :class:`~attnres.errors.TraceFormatError` when the file is not a
    valid trace. The platform facts come from the trace, never from this
    machine.
    """

    if isinstance(path_or_trace, Trace):
        recorded, path = path_or_trace, None
    elif isinstance(path_or_trace, (str, os.PathLike)):
        path = os.fspath(path_or_trace)
        recorded = load_trace(path)
    else:
        raise ArgumentTypeError(
            f"replay() takes a trace file path or a Trace, got {type(path_or_trace).__name__}"
        )
    replayed = _machine.run_machine(recorded.input)
    if any(isinstance(r, TuningRecord) for r in recorded.records):
        # a tuned decision: the measurements are recorded facts; every verdict
        # and the outcome are derived from them again (no device needed)
        replayed = replay_tuned(recorded, replayed)
    first, diff = diff_traces(recorded, replayed, label=path or "<trace>")
    return ReplayResult(
        ok=not diff,
        diff=diff,
        path=path,
        recorded=recorded,
        replayed=replayed,
        first_divergence=first,
    )


# =============================================================================
# The diff
# =============================================================================


def _render(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def describe_outcome(outcome: Outcome) -> str:
    """``selected torch_sdpa (global backend fallback)`` / ``rejected (code)``."""
    if outcome.status == Status.SELECTED and outcome.backend is not None:
        text = f"selected {outcome.backend.name}"
        return text + (f" ({outcome.reason})" if outcome.reason else "")
    return f"{outcome.status} ({outcome.code})" if outcome.code else outcome.status


def _record_block(
    index: int, recorded: dict[str, Any] | None, replayed: dict[str, Any] | None
) -> list[str]:
    if recorded is None or replayed is None:
        present = recorded if recorded is not None else replayed
        assert present is not None
        side = "the recorded trace" if recorded is not None else "the replay"
        lines = [
            f"first divergent record: records[{index}] ({present.get('kind')}), only in {side}"
        ]
        lines += [f"    {key}: {_render(value)}" for key, value in present.items() if key != "kind"]
        return lines
    kind_a, kind_b = recorded.get("kind"), replayed.get("kind")
    kinds = str(kind_a) if kind_a == kind_b else f"recorded {kind_a}, replayed {kind_b}"
    lines = [f"first divergent record: records[{index}] ({kinds})"]
    keys = list(recorded) + [k for k in replayed if k not in recorded]
    width = max(len(k) for k in keys) + 1
    for key in keys:
        if key == "kind" and kind_a == kind_b:
            continue
        a = _render(recorded[key]) if key in recorded else "(absent)"
        b = _render(replayed[key]) if key in replayed else "(absent)"
        if a == b:
            lines.append(f"    {key + ':':<{width}} {a}")
        else:
            lines.append(f"  ! {key}:")
            lines.append(f"      recorded: {a}")
            lines.append(f"      replayed: {b}")
    return lines


def _outcome_lines(recorded: Outcome, replayed: Outcome) -> list[str]:
    if recorded == replayed:
        return [f"outcome unchanged: {describe_outcome(recorded)}"]
    a, b = describe_outcome(recorded), describe_outcome(replayed)
    lines = [f"outcome: {a} -> {b}" if a != b else f"outcome: {a}, but it differs:"]
    # status, backend, reason and code are in the line above when it shows a change
    shown = (
        ("origin", "error")
        if a != b
        else ("status", "backend", "origin", "reason", "code", "error")
    )
    for name in shown:
        va, vb = getattr(recorded, name), getattr(replayed, name)
        if va != vb:
            lines.append(f"  ! {name}:")
            lines.append(f"      recorded: {_render(None if va is None else str(va))}")
            lines.append(f"      replayed: {_render(None if vb is None else str(vb))}")
    return lines


def diff_traces(
    recorded: Trace, replayed: Trace, *, label: str = "<trace>"
) -> tuple[int | None, str]:
    """Compare two traces of one input; ``(first divergent index, readable diff)``.

    The diff is empty when records and outcome match. Records are compared
    position by position, as their JSON objects.
    """
    a = [record_to_dict(r) for r in recorded.records]
    b = [record_to_dict(r) for r in replayed.records]
    differing = [
        i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]
    ]
    if not differing and recorded.outcome == replayed.outcome:
        return None, ""
    lines = [f"{label}: the replay differs from the recorded trace"]
    first: int | None = None
    if differing:
        first = differing[0]
        lines += _record_block(
            first, a[first] if first < len(a) else None, b[first] if first < len(b) else None
        )
        rest = differing[1:]
        if rest:
            named = ", ".join(
                f"records[{i}] {(a[i] if i < len(a) else b[i]).get('kind')}"
                for i in rest[:_NAMED_IN_SUMMARY]
            )
            more = ", ..." if len(rest) > _NAMED_IN_SUMMARY else ""
            noun = "record differs" if len(rest) == 1 else "records differ"
            lines.append(f"and {len(rest)} more {noun}: {named}{more}")
        else:
            lines.append("no other record differs")
        if len(a) != len(b):
            lines.append(f"the recorded trace has {len(a)} records, the replay {len(b)}")
    else:
        lines.append("every record matches")
    lines += _outcome_lines(recorded.outcome, replayed.outcome)
    return first, "\n".join(lines)


# =============================================================================
# attnres replay PATH... [--update]
# =============================================================================


@frozen
class ReplayEntry:
    """One file of a replay run: ``ok``, ``diff`` or ``invalid``."""

    path: str
    status: ReplayStatus = field(converter=ReplayStatus)
    result: ReplayResult | None = field(default=None, repr=False)
    #: why the file could not be replayed (``invalid``), or -- on a ``diff`` --
    #: why it could not be rewritten from the replay (``update``)
    error: str | None = None
    #: the diverging file was rewritten from the replay
    updated: bool = False


@frozen
class ReplayRun:
    """What replaying some files and folders found; rendering is the caller's."""

    entries: tuple[ReplayEntry, ...]
    #: ``"PATH: message"`` for each path that names nothing to replay (missing,
    #: unreadable, a folder without traces) or a folder whose manifest says it
    #: is incomplete or lists a missing file
    path_problems: tuple[str, ...] = ()
    #: the paths of the manifest problems, which a listing shows as failed files
    flagged: tuple[str, ...] = ()

    def count(self, status: ReplayStatus | str) -> int:
        wanted = ReplayStatus(status)
        return sum(1 for e in self.entries if e.status is wanted)

    @property
    def invalid_count(self) -> int:
        """Files that are not valid traces (or broke the machine), or that an
        update could not rewrite."""
        return sum(1 for e in self.entries if e.error is not None)

    @property
    def invalid(self) -> bool:
        """A path named nothing, or a file was not a valid trace (or broke the
        machine, or could not be updated)."""
        return bool(self.path_problems) or self.invalid_count > 0

    @property
    def diverged(self) -> bool:
        """Some replay differs from its file and was not rewritten."""
        return any(e.status is ReplayStatus.DIFF and not e.updated for e in self.entries)


def _expand(
    paths: Iterable[str | os.PathLike[str]],
) -> tuple[list[str], list[str], list[str]]:
    """Files to replay (folders: every ``*.json`` entry, sorted), the problems
    (``"PATH: message"``) and the paths of manifest problems.

    Every ``*.json`` entry of a folder is replayed, whatever it is: a dangling
    symlink, a FIFO or a sub-folder becomes an invalid entry, never a silent skip.
    """
    files: list[str] = []
    seen: set[str] = set()
    problems: list[str] = []
    flagged: list[str] = []
    for raw in paths:
        text = os.fspath(raw)
        path = Path(text)
        if path.is_dir():
            try:
                names = sorted(e.name for e in os.scandir(path) if e.name.endswith(".json"))
            except OSError as exc:
                problems.append(f"{text}: cannot list the folder: {exc.strerror or exc}")
                continue
            for where, message in check_manifest(path):
                flagged.append(where)
                problems.append(f"{where}: {message}")
            if not names:
                problems.append(f"{text}: no trace files (*.json) in this folder")
            candidates = [str(path / name) for name in names]
        elif os.path.lexists(text):
            candidates = [text]
        else:
            problems.append(f"{text}: no such file or folder")
            candidates = []
        for c in candidates:
            key = os.path.normpath(c)
            if key not in seen:
                seen.add(key)
                files.append(c)
    return files, problems, flagged


def replay_paths(paths: Sequence[str | os.PathLike[str]], *, update: bool = False) -> ReplayRun:
    """Replay files and folders (a folder: its ``*.json``, sorted); never raises for a file.

    With ``update``, a diverging file is rewritten from the replay (atomically).
    A file that is not a valid trace, or on which the machine fails, is an
    ``invalid`` entry with the reason; a rewrite that fails keeps the ``diff``
    entry with the reason in ``error``.
    """
    files, problems, flagged = _expand(paths)
    entries: list[ReplayEntry] = []
    for path in files:
        try:
            result = replay(path)
        except TraceFormatError as exc:
            entries.append(ReplayEntry(path, ReplayStatus.INVALID, error=str(exc)))
            continue
        except Exception as exc:  # a machine failure must not become a traceback
            entries.append(
                ReplayEntry(
                    path,
                    ReplayStatus.INVALID,
                    error=f"{path}: the machine failed on the recorded input: "
                    f"{type(exc).__name__}: {exc} (this is a bug in attnres)",
                )
            )
            continue
        if result.ok:
            entries.append(ReplayEntry(path, ReplayStatus.OK, result))
            continue
        if update:
            try:
                dump_trace(result.replayed, path)
            except OSError as exc:
                error = f"{path}: cannot update the trace file: {exc.strerror or exc}"
                entries.append(ReplayEntry(path, ReplayStatus.DIFF, result, error=error))
                continue
        entries.append(ReplayEntry(path, ReplayStatus.DIFF, result, updated=update))
    return ReplayRun(tuple(entries), tuple(problems), tuple(flagged))
