"""The golden corpus: every file in traces/ replays clean, every scenario has its
file (and every file its scenario), each scenario does what its name says, and
together they cover the whole selection contract.

``pytest tests/test_golden.py --update-golden`` (``make golden``) regenerates
traces/ from ``attnres.scenarios.SCENARIOS`` (atomically, touching only what
changed) and prints what changed.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest

from attnres import machine
from attnres._states import Code, Event, Origin, Reason, State
from attnres._vocab import PLATFORM_KINDS
from attnres.replayer import replay
from attnres.scenarios import (
    NAME_RE,
    SCENARIOS,
    CorpusChange,
    Scenario,
    corpus_status,
    update_corpus,
)
from attnres.trace import CheckRecord, SkipRecord, Trace, TransitionRecord, load_trace

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT / "traces"
SEED = "audio-vae-global-sage-falls-back-to-default"
SCENARIO_NAMES = {s.name for s in SCENARIOS}
ALL_NAMES = sorted(SCENARIO_NAMES | {p.stem for p in TRACES.glob("*.json")})

#: Codes a loadable trace can never carry as a rejection code, and why:
#: unknown_backend - a trace naming an unregistered backend does not load;
#: sparse_cross_attention - a sparse request on a cross layer always falls back
#: to dense (SPEC 3.3), so it ends as selected or no_compatible_backend.
NOT_A_REJECTION_CODE = {Code.UNKNOWN_BACKEND.value, Code.SPARSE_CROSS_ATTENTION.value}


def _report(config: pytest.Config, text: str) -> None:
    """Show ``text`` on the terminal now, past pytest's output capture."""
    capture = config.pluginmanager.get_plugin("capturemanager")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        if reporter is not None:
            reporter.ensure_newline()
            for line in text.splitlines():
                reporter.write_line(line)
        else:  # pragma: no cover - pytest without its terminal reporter
            print(text, file=sys.__stdout__, flush=True)


@pytest.fixture(scope="module")
def corpus(request: pytest.FixtureRequest) -> Path:
    """traces/, regenerated first when pytest runs with --update-golden."""
    if request.config.getoption("--update-golden"):
        change = update_corpus(TRACES)
        _report(request.config, change.summary())
    return TRACES


# -- every file replays ---------------------------------------------------------


@pytest.mark.parametrize("name", ALL_NAMES)
def test_golden_file_replays(name: str, corpus: Path) -> None:
    path = corpus / f"{name}.json"
    if name not in SCENARIO_NAMES:
        if not path.exists():
            pytest.skip(f"traces/{name}.json was removed by --update-golden")
        pytest.fail(
            f"traces/{name}.json has no scenario in attnres.scenarios.SCENARIOS: add one, or "
            f"run `make golden` to delete the file"
        )
    assert path.exists(), (
        f"scenario {name!r} has no golden file traces/{name}.json: run `make golden`"
    )
    result = replay(path)
    assert result.ok, result.diff
    scenario = next(s for s in SCENARIOS if s.name == name)
    assert result.recorded.input == scenario.input(), (
        f"the input of scenario {name!r} changed since traces/{name}.json was written: run "
        f"`make golden` and review the diff"
    )


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_scenario_does_what_its_name_says(scenario: Scenario) -> None:
    assert scenario.problems(scenario.run()) == []


def test_scenarios_and_files_match_one_to_one(corpus: Path) -> None:
    change, _ = corpus_status(corpus)
    assert not change.new, f"scenarios without a golden file (run `make golden`): {change.new}"
    assert not change.removed, f"golden files without a scenario: {change.removed}"
    assert not change.changed, (
        f"golden files that differ from what their scenario renders (run `make golden` and "
        f"review the diff): {change.changed}"
    )


def test_scenario_names_are_unique_file_names() -> None:
    names = [s.name for s in SCENARIOS]
    assert len(names) == len(set(names))
    assert all(NAME_RE.fullmatch(n) for n in names), [n for n in names if not NAME_RE.fullmatch(n)]
    assert all(s.description.strip() for s in SCENARIOS)
    assert len(SCENARIOS) >= 40


# -- the corpus covers the contract --------------------------------------------


def _corpus_traces(corpus: Path) -> list[Trace]:
    """The rule-based corpus and the tuned one (traces/tuned/, tests/test_autotune_golden.py)."""
    paths = sorted(corpus.glob("*.json")) + sorted((corpus / "tuned").glob("*.json"))
    return [load_trace(p) for p in paths]


def test_corpus_covers_the_selection_contract(corpus: Path) -> None:
    traces = _corpus_traces(corpus)
    assert len(traces) >= 40
    origins = {str(t.outcome.origin) for t in traces}
    reasons = {t.outcome.reason for t in traces if t.outcome.status == "selected"}
    rejection_codes = {t.outcome.code for t in traces if t.outcome.status == "rejected"}
    kinds = {t.input.platform.kind for t in traces}
    transitions = [r for t in traces for r in t.records if isinstance(r, TransitionRecord)]
    failure_codes = {
        f.code for t in traces for r in t.records if isinstance(r, CheckRecord) for f in r.failures
    }
    reached = {r.target for r in transitions}
    accepting = {r.source for r in transitions if r.event is Event.ACCEPTED}
    exercised = {(r.source, r.event) for r in transitions}
    table = {(s, e) for s, events in machine.TRANSITIONS.items() for e in events}
    stages = {State.REQUESTED, State.COMPONENT_DEFAULT, State.PLATFORM_DEFAULT, State.SUPPORTED_SET}

    assert origins == {o.value for o in Origin}
    assert reasons == {None, *(r.value for r in Reason)}
    assert rejection_codes == {c.value for c in Code} - NOT_A_REJECTION_CODE
    assert failure_codes >= {c.value for c in Code} - {"unknown_backend", "no_compatible_backend"}
    assert kinds == set(PLATFORM_KINDS)
    assert stages <= reached and stages <= accepting
    assert exercised == table, f"transitions no golden trace exercises: {table - exercised}"
    assert any(isinstance(r, SkipRecord) for t in traces for r in t.records)
    # role overrides, aliases, requirements, broken packages
    assert any(t.input.scope and t.input.scope.role_backends for t in traces)
    selected = {t.outcome.backend.name for t in traces if t.outcome.backend is not None}
    assert {"torch_cudnn_sdpa", "dynamic_cudnn_sdpa"} <= selected
    assert any(t.input.layer.requirements.packed_varlen for t in traces)
    assert any(t.input.layer.requirements.attn_mask for t in traces)
    assert any(p.status == "broken" for t in traces for p in t.input.platform.packages)


# -- a changed rule is caught, readably -------------------------------------------


def test_changed_transition_reason_makes_replay_fail_readably(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    patched = {state: dict(events) for state, events in machine.TRANSITIONS.items()}
    patched[State.REQUESTED][Event.GLOBAL_FALLBACK] = (
        State.COMPONENT_DEFAULT,
        Reason.PLATFORM_DEFAULT_FALLBACK,
    )
    monkeypatch.setattr(machine, "TRANSITIONS", patched)
    path = corpus / f"{SEED}.json"
    result = replay(path)
    assert result.ok is False
    diff = result.diff
    index = result.first_divergence
    assert index is not None
    assert diff.startswith(f"{path}: the replay differs from the recorded trace")
    assert f"first divergent record: records[{index}] (transition)" in diff
    assert '"global_fallback"' in diff  # the unchanged fields are shown too
    assert 'recorded: "global backend fallback"' in diff
    assert 'replayed: "platform default fallback"' in diff
    assert "more record" in diff  # the selected record differs as well
    assert (
        "outcome: selected torch_sdpa (global backend fallback) -> "
        "selected torch_sdpa (platform default fallback)" in diff
    )


def test_changed_check_makes_replay_fail_readably(
    corpus: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a regression that forgets the supported-set check
    monkeypatch.setattr(machine, "_check_supported", lambda spec, layer: [])
    result = replay(corpus / "transformer-global-sage-not-supported-rejected.json")
    assert not result.ok
    assert "(check)" in result.diff
    assert '"not_in_supported_set"' in result.diff
    assert "outcome: rejected (not_in_supported_set) -> selected sage_attn" in result.diff


# -- regeneration -----------------------------------------------------------------


def test_update_corpus_writes_only_what_changed(tmp_path: Path) -> None:
    few = SCENARIOS[:3]
    first = update_corpus(tmp_path, few)
    assert first == CorpusChange(new=tuple(sorted(s.name for s in few)))
    assert "3 new, 0 changed, 0 unchanged, 0 removed" in first.summary()

    edited = tmp_path / f"{few[0].name}.json"
    edited.write_text(edited.read_text(encoding="utf-8").replace("  ", "   "), encoding="utf-8")
    (tmp_path / "orphan.json").write_text("{}", encoding="utf-8")
    untouched = tmp_path / f"{few[1].name}.json"
    mtime = untouched.stat().st_mtime_ns

    second = update_corpus(tmp_path, few)
    assert second.changed == (few[0].name,)
    assert second.removed == ("orphan",)
    assert set(second.unchanged) == {few[1].name, few[2].name}
    assert untouched.stat().st_mtime_ns == mtime
    assert "  changed " + f"{few[0].name}.json" in second.summary()
    assert "  removed orphan.json" in second.summary()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{s.name}.json" for s in few)

    third = update_corpus(tmp_path, few)
    assert third.new == third.changed == third.removed == ()
    for scenario in few:
        assert replay(tmp_path / f"{scenario.name}.json").ok
