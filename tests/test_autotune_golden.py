"""Golden tuned decisions (``traces/tuned/``): every file replays clean, every
scenario has its file, and each scenario ends as it says.

``pytest tests/test_autotune_golden.py --update-golden`` (``make golden``)
regenerates the folder from ``tests/tuned_scenarios.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from scenarios import corpus_status, update_corpus
from tuned_scenarios import TUNED_SCENARIOS, TunedScenario

from attnres._states import Event, Verdict
from attnres.cli import render_replay
from attnres.replayer import replay, replay_paths
from attnres.trace import MeasurementRecord, load_trace

TUNED = Path(__file__).resolve().parent.parent / "traces" / "tuned"


@pytest.fixture(scope="module")
def corpus(request: pytest.FixtureRequest) -> Path:
    if request.config.getoption("--update-golden"):
        change = update_corpus(TUNED, TUNED_SCENARIOS)  # type: ignore[arg-type]
        print(change.summary().replace("golden traces", "golden tuned traces"))
    return TUNED


@pytest.mark.parametrize("scenario", TUNED_SCENARIOS, ids=lambda s: s.name)
def test_golden_tuned_trace_replays(scenario: TunedScenario, corpus: Path) -> None:
    path = corpus / f"{scenario.name}.json"
    assert path.exists(), f"no golden file traces/tuned/{path.name}: run `make golden`"
    result = replay(path)
    assert result.ok, result.diff
    # 3, or 6 for a layer with an error budget (issue 34)
    assert result.recorded.schema_version == max(3, scenario.input().schema_version())
    assert result.recorded.input == scenario.input()
    assert scenario.problems(result.recorded) == []


def test_tuned_scenarios_and_files_match_one_to_one(corpus: Path) -> None:
    change, _ = corpus_status(corpus, TUNED_SCENARIOS)  # type: ignore[arg-type]
    assert not change.new, f"tuned scenarios without a file (run `make golden`): {change.new}"
    assert not change.removed, f"files in traces/tuned/ without a scenario: {change.removed}"
    assert not change.changed, f"files that differ from their scenario: {change.changed}"


def test_tuned_corpus_covers_every_verdict_and_both_endings(corpus: Path) -> None:
    traces = [load_trace(p) for p in sorted(corpus.glob("*.json"))]
    verdicts = {r.verdict for t in traces for r in t.records if isinstance(r, MeasurementRecord)}
    assert verdicts == set(Verdict)
    events = {getattr(r, "event", None) for t in traces for r in t.records}
    assert {Event.MEASURE, Event.MEASURED_FASTER, Event.INCUMBENT_KEPT} <= events
    origins = {t.outcome.origin.value for t in traces}
    assert origins == {"none", "layer_default", "global_preference"}


def test_attnres_replay_command_replays_the_tuned_folder(corpus: Path) -> None:
    import io

    out, err = io.StringIO(), io.StringIO()
    code = render_replay(replay_paths([corpus]), False, out, err)
    assert code == 0, out.getvalue()
    assert f"replayed {len(TUNED_SCENARIOS)} traces: {len(TUNED_SCENARIOS)} ok" in out.getvalue()
