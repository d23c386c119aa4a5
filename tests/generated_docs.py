"""One way to keep a generated block of a document current (the coverage tables)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def check_generated(doc: Path, begin: str, end: str, body: str, update: bool) -> None:
    """Assert that ``doc`` holds ``body`` between the markers ``begin`` and ``end``;
    with ``update`` (``--update-golden``), write it there first."""
    text = doc.read_text(encoding="utf-8")
    assert begin in text and end in text, f"{doc} has no {begin} ... {end} markers"
    head, _, rest = text.partition(begin)
    _, _, tail = rest.partition(end)
    fresh = f"{head}{begin}\n{body}\n{end}{tail}"
    if update:
        doc.write_text(fresh, encoding="utf-8")
        text = fresh
    assert text == fresh, (
        f"{doc}: the block between {begin} and {end} is stale: run with --update-golden"
    )


#: ``make test`` sweeps one item in this many of a generated table's rows (issue 33:
#: a five-minute suite); ``ATTNRES_COVERAGE_TABLE=1`` (``make test-deep``) or
#: ``--update-golden`` computes every row and checks or writes the whole block
SLICE_STEP = 4


def whole_table(update: bool) -> bool:
    """Whether this run computes every row of the generated tables."""
    return update or os.environ.get("ATTNRES_COVERAGE_TABLE") == "1"


def sliced(items: list[T], update: bool) -> list[T]:
    """Every item for a whole-table run, else one in :data:`SLICE_STEP` (always
    the same ones: a deterministic slice spread over the whole enumeration)."""
    return list(items) if whole_table(update) else list(items[::SLICE_STEP])


TESTED = Path(__file__).resolve().parent / "tested-versions.txt"


def pinned_release(package: str) -> str:
    """The release of ``package`` the committed tables were made with (the pin in
    ``tests/tested-versions.txt``, which ``make setup`` installs)."""
    for line in TESTED.read_text(encoding="utf-8").splitlines():
        name, sep, version = line.partition("==")
        if sep and name.strip() == package:
            return version.strip()
    raise AssertionError(f"{TESTED.name} pins no {package}")


def check_installed(package: str, installed: str) -> None:
    """A sliced run checks rows against tables made with the tested release: another
    one installed is said as such (not as a table out of date)."""
    tested = pinned_release(package)
    assert installed == tested, (
        f"{package} {installed} is installed, but the committed tables were made with "
        f"{tested} ({TESTED.name}): `make setup` installs it; to move to {installed}, "
        f"run make test-deep with --update-golden and move the pin"
    )


def check_rows(doc: Path, begin: str, end: str, lines: list[str], keys: list[str]) -> None:
    """A sliced run's check: every row it computed stands verbatim in the committed
    block of ``doc``, and the block has one row for each of ``keys`` (the first
    column), so the table covers everything installed."""
    text = doc.read_text(encoding="utf-8")
    assert begin in text and end in text, f"{doc} has no {begin} ... {end} markers"
    block = text.partition(begin)[2].partition(end)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ") and "---" not in line]
    have = [row.split("|")[1].strip() for row in rows[1:]]  # rows[0]: the header
    assert have == keys, (
        f"{doc}: the block between {begin} and {end} does not list what is installed: "
        "run with --update-golden"
    )
    stale = [line for line in lines if line not in rows]
    assert stale == [], (
        f"{doc}: rows of the block between {begin} and {end} are stale ({len(stale)}; "
        f"first: {stale[0] if stale else ''!r}): run with --update-golden"
    )
