"""Text conventions shared by the CLI and the library: wrapped fields and tables.

``attnres plan`` prints a plan with :func:`attnres.plan.render_plan`, and
``PlanResult.render()`` returns the same text, so the library renders without
importing the CLI. The helpers (``_wrap``, ``_field``, ``_table``...) are the
CLI's text conventions: at most 100 columns (``COLUMNS``), wrapped at word
boundaries, never breaking a name.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

from attnres._states import PackageStatus
from attnres.layer import EVERY_COMPONENT, EXACT, SelectionConfig
from attnres.platform import Platform

__all__ = ["budget_flags", "request_text"]

_MAX_WIDTH = 100


def _width() -> int:
    columns = shutil.get_terminal_size((_MAX_WIDTH, 24)).columns
    return max(60, min(_MAX_WIDTH, columns))


def _wrap(text: str, width: int, indent: str = "", subsequent: str | None = None) -> list[str]:
    lines = textwrap.wrap(
        text,
        width,
        initial_indent=indent,
        subsequent_indent=indent if subsequent is None else subsequent,
        break_long_words=False,
        break_on_hyphens=False,
    )
    return lines or [indent.rstrip()]


def _field(label: str, value: str, width: int, label_width: int = 11) -> list[str]:
    head = f"{label:<{label_width}}"
    return _wrap(value, width, head, " " * label_width)


def _table(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int,
    wrap: Sequence[int],
    indent: int = 2,
    gap: int = 2,
    min_width: int = 12,
    right: Sequence[int] = (),
    notes: Sequence[str] | None = None,
    ordered: bool = False,
) -> list[str]:
    """Left-aligned columns; the ``wrap`` columns shrink and wrap to fit ``width``.

    The widest wrappable column shrinks first (``ordered``: the first one of
    ``wrap`` does, down to its floor, then the next). ``notes`` (one per row,
    optional) are printed under their row, indented.
    """
    count = len(headers)
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    available = width - indent - gap * (count - 1)
    shrinkable = [i for i in wrap if i < count]
    # The widest wrappable column gives up a character at a time, down to its
    # floor: its header, its longest word (a name is never broken), or min_width.
    floors = {
        i: max(
            min_width,
            len(headers[i]),
            max((len(w) for row in rows for w in row[i].split()), default=0),
        )
        for i in shrinkable
    }
    while sum(widths) > available:
        candidates = [i for i in shrinkable if widths[i] > floors[i]]
        if not candidates:
            break
        widest = candidates[0] if ordered else max(candidates, key=lambda i: widths[i])
        widths[widest] -= 1
    if sum(widths) > available:
        # Too narrow for columns without breaking a name: one record per row.
        return _records(headers, rows, width=width, indent=indent, prose=wrap, notes=notes)
    pad = " " * indent
    sep = " " * gap

    def align(i: int, text: str) -> str:
        return text.rjust(widths[i]) if i in right else text.ljust(widths[i])

    out = [pad + sep.join(align(i, h) for i, h in enumerate(headers)).rstrip()]
    out.append(pad + sep.join("-" * widths[i] for i in range(count)))
    for index, row in enumerate(rows):
        cells = [
            (_wrap_cell(cell, widths[i]) if i in shrinkable else [cell]) or [""]
            for i, cell in enumerate(row)
        ]
        height = max(len(c) for c in cells)
        for line in range(height):
            parts = [align(i, c[line] if line < len(c) else "") for i, c in enumerate(cells)]
            out.append(pad + sep.join(parts).rstrip())
        note = notes[index] if notes is not None else ""
        if note:
            out += _wrap(note, width, pad + "    ", pad + "    ")
    return out


def _records(
    headers: Sequence[str],
    rows: Sequence[Sequence[str]],
    *,
    width: int,
    indent: int,
    prose: Sequence[int],
    notes: Sequence[str] | None,
) -> list[str]:
    """A table too wide for ``width``: each row as its first cell, then its short
    ``header: value`` pairs on one line and each long prose cell on its own,
    all wrapped at word boundaries."""
    pad = " " * indent
    out: list[str] = []
    for index, row in enumerate(rows):
        if row[0]:  # a blank first cell continues the record above
            out.append(pad + row[0])
        short: list[str] = []
        long: list[str] = []
        for i in range(1, len(headers)):
            if row[i]:
                pair = f"{headers[i]}: {row[i]}"
                (long if i in prose and len(row[i]) > 30 else short).append(pair)
        for paragraph in (["; ".join(short)] if short else []) + long:
            out += _wrap(paragraph, width, pad + "    ", pad + "      ")
        note = notes[index] if notes is not None else ""
        if note:
            out += _wrap(note, width, pad + "    ", pad + "      ")
    return out


def _wrap_cell(text: str, width: int) -> list[str]:
    """Wrap at spaces, never inside a word (the column is at least as wide as
    its longest word: see the floors in :func:`_table`)."""
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=False, break_on_hyphens=False)


def _platform_text(platform: Platform) -> str:
    present = [f for f in platform.packages if f.status == PackageStatus.PRESENT]
    if platform.simulated:
        how, names = "simulated", [f.name for f in present]
    else:  # a detected package with its version
        how, names = "detected", [f"{f.name} {f.version or ''}".rstrip() for f in present]
    packages = ", ".join(names) or "none"
    return f"{platform.device()}, {how}; kernel packages present: {packages}"


def _opt(value: object) -> str:
    return "-" if value is None or value == "" else str(value)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def budget_flags(config: SelectionConfig) -> str:
    """Issue 34: ``"; error budget: --attention-error transformer=0.02,vae=exact"``
    (``''`` without a budget)."""
    if not config.attention_error:
        return ""
    items = [
        ("" if k == EVERY_COMPONENT else f"{k}=") + (EXACT if v == EXACT else f"{v:g}")
        for k, v in config.attention_error
    ]
    return "; error budget: --attention-error " + ",".join(items)


def request_text(config: SelectionConfig, preference: str, flag: str = "") -> str:
    """What the operator asked for (the ``Request:`` field): the global backend and
    how it was given (``preference`` names an implicit one), the per-component
    backends (each ``{flag}name=backend``) and the error budgets."""
    backend = config.global_backend
    if backend is None:
        request = "no global --attention-backend"
    elif config.global_backend_env is not None:
        request = f"{config.global_backend_env}={backend.name} (set in the environment)"
    else:
        how = "typed by the operator" if config.global_backend_explicit else preference
        request = f"--attention-backend {backend.name} ({how})"
    if config.component_backends:
        request += "; per component: " + ", ".join(
            f"{flag}{n}={b.name}" for n, b in config.component_backends
        )
    return request + budget_flags(config)  # issue 34
