"""One way to keep a generated block of a document current (the coverage tables)."""

from __future__ import annotations

from pathlib import Path


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
