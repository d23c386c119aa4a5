"""replay() and the `attnres replay PATH... [--update]` command behind the CLI."""

from __future__ import annotations

import io
import json
import shutil
import time
from pathlib import Path
from typing import Any

import attrs
import pytest
from scenarios import SCENARIOS, scenario_by_name

import attnres
from attnres import TraceFormatError, machine
from attnres._states import Event, Reason, State
from attnres.cli import render_replay
from attnres.replayer import ReplayResult, describe_outcome, diff_traces, replay, replay_paths
from attnres.trace import (
    Outcome,
    SelectedRecord,
    Trace,
    dump_trace,
    load_trace,
    trace_from_json,
    trace_to_dict,
)

ROOT = Path(__file__).resolve().parent.parent
SEED = scenario_by_name("audio-vae-global-sage-falls-back-to-default")
STRICT = scenario_by_name("transformer-global-sage-not-supported-rejected")


def _run(paths: list[str], *, update: bool = False) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = render_replay(replay_paths(paths, update=update), update, out, err)
    return code, out.getvalue(), err.getvalue()


def test_replay_paths_returns_results_and_prints_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.json"
    dump_trace(SEED.run(), good)
    bad = tmp_path / "bad.json"
    bad.write_text("{}", encoding="utf-8")
    run = replay_paths([str(good), str(bad), str(tmp_path / "missing.json")])
    assert [(e.path, e.status) for e in run.entries] == [
        (str(good), "ok"), (str(bad), "invalid")
    ]  # fmt: skip
    assert run.entries[0].result is not None and run.entries[0].result.ok
    assert "schema_version" in str(run.entries[1].error)
    assert run.path_problems == (f"{tmp_path / 'missing.json'}: no such file or folder",)
    assert run.invalid and not run.diverged
    assert capsys.readouterr() == ("", "")


def _rewrite(path: Path, trace: Trace) -> None:
    """Store ``trace`` at ``path`` as a self-consistent file (fresh digest)."""
    dump_trace(trace, path)


def _with_outcome(trace: Trace, **changes: Any) -> Trace:
    return attrs.evolve(trace, outcome=attrs.evolve(trace.outcome, **changes))


@pytest.fixture
def seed_file(tmp_path: Path) -> Path:
    return dump_trace(SEED.run(), tmp_path / "seed.json")


@pytest.fixture
def diverged_file(tmp_path: Path) -> Path:
    """A valid trace file whose recorded outcome the machine no longer produces."""
    trace = SEED.run()
    records = list(trace.records)
    last = records[-1]
    assert isinstance(last, SelectedRecord)
    records[-1] = attrs.evolve(last, reason=Reason.PLATFORM_DEFAULT_FALLBACK.value)
    edited = attrs.evolve(
        trace,
        records=tuple(records),
        outcome=attrs.evolve(trace.outcome, reason=Reason.PLATFORM_DEFAULT_FALLBACK.value),
    )
    path = tmp_path / "diverged.json"
    _rewrite(path, edited)
    return path


# =============================================================================
# replay()
# =============================================================================


def test_replay_of_a_clean_file(seed_file: Path) -> None:
    result = replay(seed_file)
    assert isinstance(result, ReplayResult)
    assert result.ok is True and bool(result)
    assert result.diff == ""
    assert result.path == str(seed_file)
    assert result.first_divergence is None
    assert result.recorded == load_trace(seed_file)
    assert result.replayed.records == result.recorded.records
    assert attrs.has(ReplayResult)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        result.ok = False  # type: ignore[misc]


def test_replay_of_a_trace_object_and_of_a_path_string(seed_file: Path) -> None:
    assert replay(SEED.run()).ok
    assert replay(SEED.run()).path is None
    assert replay(str(seed_file)).ok


def test_public_replay_is_this_one() -> None:
    assert attnres.replay is replay


def test_replay_rejects_other_arguments() -> None:
    with pytest.raises(TypeError, match="takes a trace file path or a Trace"):
        replay(42)  # type: ignore[arg-type]


def test_replay_needs_neither_the_gpu_nor_the_packages() -> None:
    # the recorded platform is a Hopper with every kernel package; this machine is neither
    trace = scenario_by_name("transformer-global-sage-selected-when-supported").run()
    assert trace.input.platform.kind == "cuda"
    result = replay(trace)
    assert result.ok
    assert result.replayed.outcome.backend is not None
    assert result.replayed.outcome.backend.name == "sage_attn"


def test_replay_of_an_invalid_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text("[]", encoding="utf-8")
    with pytest.raises(TraceFormatError, match=r"bad\.json: \$: a trace must be a JSON object"):
        replay(path)


def test_diff_shows_the_first_divergent_record_and_both_sides(diverged_file: Path) -> None:
    result = replay(diverged_file)
    assert not result.ok
    index = len(result.recorded.records) - 1
    assert result.first_divergence == index
    lines = result.diff.splitlines()
    assert lines[0] == f"{diverged_file}: the replay differs from the recorded trace"
    assert lines[1] == f"first divergent record: records[{index}] (selected)"
    assert '    backend: "torch_sdpa"' in lines
    assert '    origin:  "global_cli"' in lines
    assert "  ! reason:" in lines
    assert '      recorded: "platform default fallback"' in lines
    assert '      replayed: "global backend fallback"' in lines
    assert "no other record differs" in lines
    assert lines[-1] == (
        "outcome: selected torch_sdpa (platform default fallback) -> "
        "selected torch_sdpa (global backend fallback)"
    )


def test_diff_summarises_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded = STRICT.run()
    # a rule change: a strict failure falls back like a relaxed global flag
    patched = {s: dict(e) for s, e in machine.TRANSITIONS.items()}
    patched[State.REQUESTED][Event.STRICT_FAILURE] = patched[State.REQUESTED][Event.GLOBAL_FALLBACK]
    monkeypatch.setattr(machine, "TRANSITIONS", patched)
    result = replay(recorded)
    assert not result.ok
    assert "(transition)" in result.diff
    assert '"strict_failure"' in result.diff
    assert '      replayed: "component_default"' in result.diff
    assert "more records differ: records[" in result.diff
    assert f"the recorded trace has {len(recorded.records)} records, the replay" in result.diff
    assert "outcome: rejected (not_in_supported_set) -> selected fa (global backend fallback)" in (
        result.diff
    )


def test_diff_of_records_only_on_one_side() -> None:
    recorded = SEED.run()
    shorter = attrs.evolve(recorded, records=recorded.records[:-1])
    first, diff = diff_traces(recorded, shorter, label="x.json")
    assert first == len(recorded.records) - 1
    assert "(selected), only in the recorded trace" in diff
    assert f"the recorded trace has {len(recorded.records)} records, the replay" in diff
    assert "outcome unchanged: selected torch_sdpa (global backend fallback)" in diff


def test_diff_of_an_outcome_that_differs_only_in_its_error() -> None:
    trace = STRICT.run()
    other = _with_outcome(trace, error="something else")
    first, diff = diff_traces(trace, other)
    assert first is None
    assert "every record matches" in diff
    assert "outcome: rejected (not_in_supported_set), but it differs:" in diff
    assert "  ! error:" in diff
    assert '      replayed: "something else"' in diff


def test_describe_outcome() -> None:
    assert describe_outcome(SEED.run().outcome) == "selected torch_sdpa (global backend fallback)"
    assert describe_outcome(STRICT.run().outcome) == "rejected (not_in_supported_set)"
    assert describe_outcome(scenario_by_name("none-cuda-hopper-picks-fa").run().outcome) == (
        "selected fa"
    )
    assert describe_outcome(Outcome("rejected", STRICT.run().outcome.origin)) == "rejected"


def test_replay_of_the_whole_corpus_is_clean_and_quick() -> None:
    files = sorted((ROOT / "traces").glob("*.json"))
    assert len(files) == len(SCENARIOS)
    start = time.perf_counter()
    results = [replay(p) for p in files]
    elapsed = time.perf_counter() - start
    assert all(r.ok for r in results), [r.diff for r in results if not r.ok]
    # reported, not asserted: timing on shared machines is noise
    print(f"replayed {len(files)} golden traces in {elapsed:.3f}s")


# =============================================================================
# replay_paths rendered by the CLI
# =============================================================================


def test_command_all_clean_exits_0(seed_file: Path, tmp_path: Path) -> None:
    other = dump_trace(STRICT.run(), tmp_path / "strict.json")
    code, out, err = _run([str(seed_file), str(other)])
    assert code == 0, err
    assert out.splitlines() == [
        f"ok   {seed_file}",
        f"ok   {other}",
        "replayed 2 traces: 2 ok, 0 differ",
    ]
    assert err == ""


def test_command_single_file_prints_one_line(seed_file: Path) -> None:
    code, out, err = _run([str(seed_file)])
    assert (code, out, err) == (0, f"ok   {seed_file}\n", "")


def test_command_divergence_exits_1_and_prints_the_diff(
    seed_file: Path, diverged_file: Path
) -> None:
    before = diverged_file.read_bytes()
    code, out, err = _run([str(seed_file), str(diverged_file)])
    assert code == 1
    assert err == ""
    lines = out.splitlines()
    assert lines[0] == f"ok   {seed_file}"
    assert lines[1] == f"DIFF {diverged_file}"
    assert lines[2] == f"    {diverged_file}: the replay differs from the recorded trace"
    assert any(line.startswith("    first divergent record: records[") for line in lines)
    assert '          recorded: "platform default fallback"' in lines
    assert lines[-1] == "replayed 2 traces: 1 ok, 1 differ"
    assert diverged_file.read_bytes() == before  # without --update nothing is written


def test_command_update_rewrites_diverging_files(seed_file: Path, diverged_file: Path) -> None:
    seed_before = seed_file.stat().st_mtime_ns
    code, out, err = _run([str(seed_file), str(diverged_file)], update=True)
    assert code == 0, err
    assert f"DIFF {diverged_file}" in out
    assert f"    updated {diverged_file} from the replay" in out
    assert out.splitlines()[-1] == "replayed 2 traces: 1 ok, 1 updated"
    assert replay(diverged_file).ok
    assert diverged_file.read_bytes() == seed_file.read_bytes()
    assert seed_file.stat().st_mtime_ns == seed_before  # a clean file is not rewritten
    assert sorted(p.name for p in diverged_file.parent.iterdir()) == ["diverged.json", "seed.json"]
    code, out, _ = _run([str(diverged_file)])
    assert code == 0 and out.startswith("ok   ")


def test_command_replays_folders_sorted(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    folder.mkdir()
    for scenario in SCENARIOS[:3]:
        dump_trace(scenario.run(), folder / scenario.filename)
    (folder / "notes.txt").write_text("not a trace", encoding="utf-8")
    (folder / "nested").mkdir()
    dump_trace(SEED.run(), folder / "nested" / "deeper.json")
    code, out, err = _run([str(folder)])
    assert code == 0, err
    names = sorted(s.filename for s in SCENARIOS[:3])
    assert out.splitlines()[:-1] == [f"ok   {folder / n}" for n in names]


def test_command_replays_the_golden_folder() -> None:
    code, out, err = _run([str(ROOT / "traces")])
    assert code == 0, out + err
    assert out.count("\nok   ") + out.startswith("ok   ") == len(SCENARIOS)


def test_command_invalid_file_exits_2_without_traceback(seed_file: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema_version": 1, "input": ', encoding="utf-8")
    code, out, err = _run([str(bad), str(seed_file)])
    assert code == 2
    assert f"ERR  {bad}" in out.splitlines()
    assert f"ok   {seed_file}" in out.splitlines()  # the other files are still replayed
    assert err.startswith(f"attnres replay: error: {bad}: $: not valid JSON")
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_command_invalid_file_beats_divergence(diverged_file: Path, tmp_path: Path) -> None:
    bad = tmp_path / "empty.json"
    bad.write_bytes(b"")
    code, _, err = _run([str(diverged_file), str(bad)])
    assert code == 2
    assert f"{bad}: $: the file is empty" in err


def test_command_update_does_not_touch_invalid_files(tmp_path: Path) -> None:
    doc = trace_to_dict(SEED.run())
    doc["schema_version"] = 99
    bad = tmp_path / "future.json"
    bad.write_text(json.dumps(doc), encoding="utf-8")
    before = bad.read_bytes()
    code, _, err = _run([str(bad)], update=True)
    assert code == 2
    assert "schema version 99 is newer" in err
    assert bad.read_bytes() == before


def test_command_missing_path_exits_2(seed_file: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    code, out, err = _run([str(missing), str(seed_file)])
    assert code == 2
    assert err == f"attnres replay: error: {missing}: no such file or folder\n"
    assert out == f"ok   {seed_file}\n"


def test_command_empty_folder_exits_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    code, out, err = _run([str(empty)])
    assert code == 2
    assert out == ""
    assert err == f"attnres replay: error: {empty}: no trace files (*.json) in this folder\n"


def test_command_replays_each_file_once(seed_file: Path) -> None:
    code, out, _ = _run([str(seed_file), str(seed_file.parent), str(seed_file)])
    assert code == 0
    assert out.splitlines().count(f"ok   {seed_file}") == 1


def test_command_reports_a_machine_failure_without_traceback(
    seed_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(_: object) -> Trace:
        raise AssertionError("no transition from state 'requested' on event 'teleport'")

    monkeypatch.setattr(machine, "run_machine", broken)
    code, out, err = _run([str(seed_file)])
    assert code == 2
    assert out == f"ERR  {seed_file}\n"
    assert "the machine failed on the recorded input: AssertionError: no transition" in err


def test_an_edited_but_consistent_trace_diverges(tmp_path: Path) -> None:
    # the outcome is edited and the digest recomputed: the file loads, replay catches it
    edited = _with_outcome(SEED.run(), backend=attnres.Backend.parse("fa"))
    path = tmp_path / "edited.json"
    dump_trace(edited, path)
    result = replay(path)
    assert not result.ok
    assert result.first_divergence is None
    assert "every record matches" in result.diff
    assert (
        "outcome: selected fa (global backend fallback) -> "
        "selected torch_sdpa (global backend fallback)" in result.diff
    )


def test_copying_a_golden_file_elsewhere_still_replays(tmp_path: Path) -> None:
    source = ROOT / "traces" / f"{SEED.name}.json"
    target = tmp_path / "copy.json"
    shutil.copyfile(source, target)
    assert replay(target).ok


def test_replay_statuses_are_one_enum() -> None:
    """Issue 21: a replay entry's status is a ReplayStatus (a str enum, so the JSON
    and the old string comparisons keep working), not a loose string."""
    from attnres._states import ReplayStatus
    from attnres.replayer import ReplayEntry

    entry = ReplayEntry("x.json", "diff")
    assert entry.status is ReplayStatus.DIFF and entry.status == "diff"
    with pytest.raises(ValueError):
        ReplayEntry("x.json", "fine")


def test_replay_reads_the_kernel_facts_of_the_trace_not_of_this_process() -> None:
    """Issue 21: whether a trace replays no longer depends on which kernels the
    replaying process registered (schema 4 carries them in the input)."""
    import torch

    from attnres import Attention, BackendSpec, Platform, register_backend, unregister_backend
    from attnres.kernels import get_kernel, register_kernel, unregister_kernel

    register_backend(
        BackendSpec(name="rk_fake", sparse=False, platforms=("cpu",), dtypes=("float32",))
    )
    try:
        register_kernel("rk_fake", get_kernel("torch_sdpa"))  # type: ignore[arg-type]
        cpu = Platform.simulate("cpu")
        ran = Attention(2, 16, dtype=torch.float32, platform=cpu, backend="rk_fake")
        unregister_kernel("rk_fake")
        fell_back = Attention(
            2,
            16,
            dtype=torch.float32,
            platform=cpu,
            default="rk_fake",
            supported={"rk_fake", "torch_sdpa"},
        )
        assert fell_back.backend == "torch_sdpa"
        register_kernel("rk_fake", get_kernel("torch_sdpa"))  # type: ignore[arg-type]
        for layer, kernel_now in ((ran, False), (fell_back, True)):
            trace = layer.resolution.trace  # type: ignore[union-attr]
            assert trace.schema_version == 4
            assert ("rk_fake" in (trace.input.no_kernel or ())) is (layer is fell_back)
            if not kernel_now:
                unregister_kernel("rk_fake")
            result = replay(trace_from_json(trace.to_json()))
            assert result.ok, result
            register_kernel("rk_fake", get_kernel("torch_sdpa"), replace=True)  # type: ignore[arg-type]
    finally:
        unregister_kernel("rk_fake")
        unregister_backend("rk_fake")
