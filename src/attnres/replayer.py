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

:func:`run_replay_command` is what ``attnres replay PATH... [--update]`` runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from attrs import field, frozen

from attnres._files import check_manifest
from attnres.errors import TraceFormatError
from attnres.trace import Outcome, Trace, TuningRecord, dump_trace, load_trace, record_to_dict

__all__ = ["ReplayResult", "describe_outcome", "diff_traces", "replay", "run_replay_command"]

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
    from attnres.machine import run_machine  # the machine imports trace; keep this lazy

    if isinstance(path_or_trace, Trace):
        recorded, path = path_or_trace, None
    elif isinstance(path_or_trace, (str, os.PathLike)):
        path = os.fspath(path_or_trace)
        recorded = load_trace(path)
    else:
        raise TypeError(
            f"replay() takes a trace file path or a Trace, got {type(path_or_trace).__name__}"
        )
    replayed = run_machine(recorded.input)
    if any(isinstance(r, TuningRecord) for r in recorded.records):
        # a tuned decision: the measurements are recorded facts; every verdict
        # and the outcome are derived from them again (no device needed)
        from attnres.tuning import replay_tuned

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
    if outcome.status == "selected" and outcome.backend is not None:
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


def _problem(stderr: TextIO, path: str, message: str) -> None:
    print(f"attnres replay: error: {path}: {message}", file=stderr)


def _expand(
    paths: Iterable[str | os.PathLike[str]], stdout: TextIO, stderr: TextIO
) -> tuple[list[str], int]:
    """Files to replay (folders: every ``*.json`` entry, sorted), and how many
    problems were reported already (a missing path, an incomplete folder).

    Every ``*.json`` entry of a folder is replayed, whatever it is: a dangling
    symlink, a FIFO or a sub-folder becomes an error line, never a silent skip.
    """
    files: list[str] = []
    seen: set[str] = set()
    problems = 0
    for raw in paths:
        text = os.fspath(raw)
        path = Path(text)
        if path.is_dir():
            try:
                names = sorted(e.name for e in os.scandir(path) if e.name.endswith(".json"))
            except OSError as exc:
                _problem(stderr, text, f"cannot list the folder: {exc.strerror or exc}")
                problems += 1
                continue
            for where, message in check_manifest(path):
                print(f"ERR  {where}", file=stdout)
                _problem(stderr, where, message)
                problems += 1
            if not names:
                _problem(stderr, text, "no trace files (*.json) in this folder")
                problems += 1
            candidates = [str(path / name) for name in names]
        elif os.path.lexists(text):
            candidates = [text]
        else:
            _problem(stderr, text, "no such file or folder")
            problems += 1
            candidates = []
        for c in candidates:
            key = os.path.normpath(c)
            if key not in seen:
                seen.add(key)
                files.append(c)
    return files, problems


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines())


def run_replay_command(
    paths: Sequence[str | os.PathLike[str]], *, update: bool, stdout: TextIO, stderr: TextIO
) -> int:
    """Replay files and folders; print ``ok   PATH`` / ``DIFF PATH`` (+ diff) per file.

    With ``update``, a diverging file is rewritten from the replay (atomically).
    Returns 0 when everything matches (or was updated), 1 when a replay diverged
    (without ``update``), 2 when a path does not exist or a file is not a valid
    trace (the message goes to ``stderr``, no traceback).
    """
    files, problems = _expand(paths, stdout, stderr)
    diverged = ok = invalid = 0
    for path in files:
        try:
            result = replay(path)
        except TraceFormatError as exc:
            print(f"ERR  {path}", file=stdout)
            print(f"attnres replay: error: {exc}", file=stderr)
            invalid += 1
            continue
        except Exception as exc:  # a machine failure must not become a traceback
            print(f"ERR  {path}", file=stdout)
            _problem(
                stderr,
                path,
                f"the machine failed on the recorded input: {type(exc).__name__}: {exc} "
                f"(this is a bug in attnres)",
            )
            invalid += 1
            continue
        if result.ok:
            ok += 1
            print(f"ok   {path}", file=stdout)
            continue
        diverged += 1
        print(f"DIFF {path}", file=stdout)
        print(_indent(result.diff), file=stdout)
        if update:
            try:
                dump_trace(result.replayed, path)
            except OSError as exc:
                _problem(stderr, path, f"cannot update the trace file: {exc.strerror or exc}")
                invalid += 1
                continue
            print(f"    updated {path} from the replay", file=stdout)
    if len(files) > 1:
        parts = [f"{ok} ok", f"{diverged} {'updated' if update else 'differ'}"]
        if invalid:
            parts.append(f"{invalid} invalid")
        if problems:
            parts.append(_count(problems, "other error"))
        print(f"replayed {_count(len(files), 'trace')}: {', '.join(parts)}", file=stdout)
    if problems or invalid:
        return 2
    if diverged and not update:
        return 1
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
