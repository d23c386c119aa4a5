"""The docs cannot drift: the state diagram is generated from the table, and
every relative link in docs/ and the README resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gen_state_diagram.py"
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CHANGELOG.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _load_script():  # type: ignore[no-untyped-def]
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_state_diagram", SCRIPT)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_state_diagram_in_docs_matches_the_transition_table() -> None:
    rendered = _load_script().render()
    current = (ROOT / "docs" / "state-machine.md").read_text(encoding="utf-8")
    assert current == rendered, "docs/state-machine.md is stale: run `make docs`"


def test_state_diagram_has_one_arrow_per_table_entry() -> None:
    from attnres.machine import TRANSITIONS

    rendered = _load_script().render()
    arrows = [line for line in rendered.splitlines() if " --> " in line and "[*]" not in line]
    assert len(arrows) == sum(len(events) for events in TRANSITIONS.values())
    for source, events in TRANSITIONS.items():
        for event, (target, _) in events.items():
            assert any(
                a.strip().startswith(f"{source.value} --> {target.value}: {event.value}")
                for a in arrows
            ), (source, event)


def test_diagram_changes_when_the_table_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnres import machine
    from attnres._states import Event, State

    patched = {k: dict(v) for k, v in machine.TRANSITIONS.items()}
    patched[State.SUPPORTED_SET][Event.EXHAUSTED] = (State.SELECTED, None)
    monkeypatch.setattr(machine, "TRANSITIONS", patched)
    rendered = _load_script().render()
    assert "supported_set --> selected: exhausted" in rendered
    assert rendered != (ROOT / "docs" / "state-machine.md").read_text(encoding="utf-8")


def test_check_mode_of_the_script_passes() -> None:
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            continue
        path = target.split("#", 1)[0]
        if path and not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to missing files: {broken}"


def test_generated_docs_show_every_policy_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Guards, platform chains and component kinds are rendered, and follow the code."""
    from attnres import machine, platform, scope
    from attnres._states import Event

    rendered = _load_script().render()
    for guard in (*machine.START_GUARDS, *machine.REQUEST_FAILURE_GUARDS):
        assert f"| {guard.condition} | `{guard.event.value}` |" in rendered
    for kind, chain in platform.DEFAULT_CHAINS.items():
        assert f"| `{kind}` | " + ", then ".join(f"`{b}`" for b in chain) + " |" in rendered
    for loader, _ in scope.BUILTIN_KINDS:
        assert f"| `{loader.kind}` | `{loader.__name__}` |" in rendered
    for code, rule in machine.SUPPORTED_RULES:  # an exact route's rule among them
        assert f"| `{code.value}` | {rule} |" in rendered
    for req, why in machine.REQUIREMENTS_BEFORE_SUPPORTED:  # issue 19: the weights
        assert f"| `{req.value}` | {why} |" in rendered
    swapped = (machine.REQUEST_FAILURE_GUARDS[1], machine.REQUEST_FAILURE_GUARDS[0],
               *machine.REQUEST_FAILURE_GUARDS[2:])  # fmt: skip
    monkeypatch.setattr(machine, "REQUEST_FAILURE_GUARDS", swapped)
    monkeypatch.setattr(platform, "DEFAULT_CHAINS", {"cpu": ("eager", "torch_sdpa")})
    changed = _load_script().render()
    assert f"| 1 | the request is strict | `{Event.STRICT_FAILURE.value}` |" in changed
    assert "| `cpu` | `eager`, then `torch_sdpa` |" in changed


def test_a_sliced_coverage_check_fails_on_a_stale_row_or_a_missing_type(tmp_path: Path) -> None:
    """The sliced coverage tables (issue 33): a row that changed, or a type the block
    does not list, fails ``make test`` even though only a slice was computed."""
    from generated_docs import check_rows

    doc = tmp_path / "page.md"
    doc.write_text(
        "<!-- b -->\nheader\n\n| key | value |\n|---|---|\n| a | 1 |\n| b | 2 |\n<!-- e -->\n",
        encoding="utf-8",
    )
    check_rows(doc, "<!-- b -->", "<!-- e -->", ["| b | 2 |"], ["a", "b"])
    with pytest.raises(AssertionError, match="stale"):
        check_rows(doc, "<!-- b -->", "<!-- e -->", ["| b | 3 |"], ["a", "b"])
    with pytest.raises(AssertionError, match="does not list what is installed"):
        check_rows(doc, "<!-- b -->", "<!-- e -->", ["| b | 2 |"], ["a", "b", "c"])
