"""Files attnres writes and reads (issue 11, cases 1-5): the shared trace writer
never clobbers what is not a regular file, keeps modes, leaves no debris, marks a
trace folder complete; the reader takes regular files only, bounded; ``replay
DIR`` never passes by omission. ``docs/errors.md`` ("Files") documents all of it.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import attrs
import pytest

from attnres import Platform, SelectionConfig, resolve
from attnres._files import MANIFEST_NAME, MAX_INPUT_BYTES, atomic_write_text, read_bounded
from attnres.cli import main
from attnres.errors import TraceFormatError
from attnres.layer import LayerSpec
from attnres.plan import PipelineError, load_pipeline
from attnres.trace import dump_trace, load_trace

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu-small.toml"
EXPLAIN = ["explain", "--head-size", "64", "--dtype", "bf16", "--platform", "cpu"]


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _trace() -> object:
    return resolve(
        LayerSpec(head_size=64, dtype="bf16"),
        config=SelectionConfig(),
        platform=Platform.simulate("cpu"),
    ).trace


def _debris(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


# -- case 1: never clobber what is not a regular file ------------------------------------


def test_trace_out_symlink_to_a_character_device_writes_through(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    link = tmp_path / "null.json"
    link.symlink_to("/dev/null")
    code, _, err = _cli([*EXPLAIN, "--trace-out", str(link)], capsys)
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == "/dev/null"
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)


def test_trace_out_to_a_full_device_is_an_error_not_a_replacement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    link = tmp_path / "full.json"
    link.symlink_to("/dev/full")
    code, out, err = _cli([*EXPLAIN, "--trace-out", str(link)], capsys)
    assert code == 2 and out == ""
    assert "No space left on device" in " ".join(err.split())
    assert link.is_symlink()
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)


def test_trace_out_fifo_with_a_reader_is_written_through(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    got: list[bytes] = []

    def reader() -> None:
        with open(fifo, "rb") as fh:
            got.append(fh.read())

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    trace = _trace()
    # the reader may not have opened its end yet: a FIFO without one is refused
    for _ in range(200):
        try:
            dump_trace(trace, fifo)  # type: ignore[arg-type]
            break
        except OSError as exc:
            assert "no process is reading" in str(exc.strerror)
            thread.join(0.05)
    thread.join(30)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)  # still the FIFO
    assert got and json.loads(got[0])["digest"] == trace.digest  # type: ignore[attr-defined]


def test_trace_out_fifo_without_a_reader_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "pipe.json"
    os.mkfifo(fifo)
    code, out, err = _cli([*EXPLAIN, "--trace-out", str(fifo)], capsys)
    assert code == 2 and out == ""
    assert "it is a FIFO (named pipe) that no process is reading" in " ".join(err.split())
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_symlink_to_a_regular_file_is_followed_and_stays_a_link(tmp_path: Path) -> None:
    real = tmp_path / "real" / "t.json"
    real.parent.mkdir()
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    trace = _trace()
    dump_trace(trace, link)  # type: ignore[arg-type]
    assert link.is_symlink()
    assert load_trace(real).digest == trace.digest  # type: ignore[attr-defined]
    assert _debris(tmp_path) == [] and _debris(real.parent) == []


def test_dangling_symlink_and_directory_targets_are_refused(tmp_path: Path) -> None:
    dangling = tmp_path / "d.json"
    dangling.symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(OSError, match="which does not exist"):
        atomic_write_text(dangling, "{}")
    assert dangling.is_symlink() and not (tmp_path / "nowhere.json").exists()
    folder = tmp_path / "f.json"
    folder.mkdir()
    with pytest.raises(IsADirectoryError, match="it is a directory"):
        atomic_write_text(folder, "{}")


def test_trace_out_under_a_file_says_not_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.json"
    good.write_text("x")
    code, out, err = _cli([*EXPLAIN, "--trace-out", str(good / "x.json")], capsys)
    assert code == 2 and out == ""
    assert "not a directory" in " ".join(err.split()) and "File exists" not in err
    code, out, err = _cli(
        ["plan", str(EXAMPLE), "--platform", "cpu", "--trace-out", str(good / "sub")], capsys
    )
    assert code == 2 and out == ""
    assert "not a directory" in " ".join(err.split()) and "File exists" not in err


@pytest.mark.parametrize("command", ["explain", "plan"])
def test_empty_trace_out_is_a_usage_error(
    command: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    argv = EXPLAIN if command == "explain" else ["plan", str(EXAMPLE), "--platform", "cpu"]
    code, out, err = _cli([*argv, "--trace-out", ""], capsys)
    assert code == 2 and out == ""
    assert "--trace-out needs a" in err and "got an empty string" in " ".join(err.split())
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder


# -- case 2: modes ------------------------------------------------------------------------


def test_new_files_follow_the_umask_and_rewritten_files_keep_their_mode(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        fresh = tmp_path / "fresh.json"
        atomic_write_text(fresh, "{}\n")
        assert stat.S_IMODE(fresh.stat().st_mode) == 0o640
        kept = tmp_path / "kept.json"
        kept.write_text("{}\n")
        os.chmod(kept, 0o644)
        atomic_write_text(kept, "[]\n")
        assert stat.S_IMODE(kept.stat().st_mode) == 0o644
        assert kept.read_text() == "[]\n"
    finally:
        os.umask(old)


def test_replay_update_keeps_the_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = load_trace(sorted((ROOT / "traces").glob("*.json"))[0])
    path = tmp_path / "t.json"
    # a valid trace whose recorded outcome the machine does not produce
    edited = attrs.evolve(trace, outcome=attrs.evolve(trace.outcome, error="edited"))
    dump_trace(edited, path)
    os.chmod(path, 0o644)
    code, out, err = _cli(["replay", "--update", str(path)], capsys)
    assert code == 0, err
    assert "updated" in out
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# -- case 3: interruptions ---------------------------------------------------------------


_SIGTERM_DURING_WRITE = """
import os, signal, sys
import attnres._files as files
real = os.fsync
def fsync(fd):
    real(fd)
    os.kill(os.getpid(), signal.SIGTERM)
files.os.fsync = fsync
from attnres.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_during_a_write_is_clean_like_sigint(tmp_path: Path) -> None:
    target = tmp_path / "t.json"
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_DURING_WRITE, *EXPLAIN, "--trace-out", str(target)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 143, proc.stderr
    assert "terminated" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # neither the trace nor its temporary file


def test_stale_temporary_files_of_ours_are_swept(tmp_path: Path) -> None:
    dead = tmp_path / ".t.json.attnres-999999999-0123abcd.tmp"  # no such process
    dead.write_text("half")
    foreign = tmp_path / ".t.json.abcd1234.tmp"  # not our pattern: not ours to remove
    foreign.write_text("theirs")
    live = tmp_path / f".u.json.attnres-{os.getpid()}-89abcdef.tmp"  # a live writer's
    live.write_text("busy")
    atomic_write_text(tmp_path / "t.json", "{}\n")
    assert not dead.exists()
    assert foreign.exists() and live.exists()


def test_an_interrupted_plan_trace_folder_fails_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import attnres.plan as plan

    out_dir = tmp_path / "traces"
    real = plan.dump_trace
    calls = []

    def write_then_die(trace: object, path: Path) -> Path:
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(trace, path)  # type: ignore[arg-type]

    monkeypatch.setattr(plan, "dump_trace", write_then_die)
    code, _, _ = _cli(
        [
            "plan",
            str(ROOT / "examples" / "ltx2.toml"),
            "--platform",
            "cpu",
            "--trace-out",
            str(out_dir),
        ],
        capsys,
    )
    assert code == 130
    monkeypatch.undo()
    assert len(list(out_dir.glob("*.json"))) == 2
    code, out, err = _cli(["replay", str(out_dir)], capsys)
    assert code == 2
    assert f"ERR  {out_dir}" in out.splitlines()
    assert "incomplete: attnres plan" in " ".join(err.split())
    # written again, completely: the folder replays clean
    code, _, err = _cli(
        [
            "plan",
            str(ROOT / "examples" / "ltx2.toml"),
            "--platform",
            "cpu",
            "--trace-out",
            str(out_dir),
        ],
        capsys,
    )
    assert code == 0, err
    code, out, err = _cli(["replay", str(out_dir)], capsys)
    assert code == 0, err
    # a listed file that went missing is reported
    victim = sorted(out_dir.glob("*.json"))[0]
    victim.unlink()
    code, out, err = _cli(["replay", str(out_dir)], capsys)
    assert code == 2
    assert f"{victim}: listed in {MANIFEST_NAME} but missing" in " ".join(err.split())


# -- case 4: reads are of regular files, bounded --------------------------------------------


def test_character_devices_are_not_read(tmp_path: Path) -> None:
    with pytest.raises(PipelineError, match="it is a character device; a pipeline file must"):
        load_pipeline("/dev/zero")
    with pytest.raises(TraceFormatError, match="it is a character device; a trace file must"):
        load_trace("/dev/zero")


def test_a_fifo_argument_does_not_block(tmp_path: Path) -> None:
    fifo = tmp_path / "p.toml"
    os.mkfifo(fifo)
    # A FIFO is refused when opened, without waiting for a writer; the timeout is
    # only a guard so that a regression fails rather than hangs.
    proc = subprocess.run(
        [sys.executable, "-m", "attnres", "plan", str(fifo), "--platform", "cpu"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2
    assert "it is a FIFO (named pipe); a pipeline file must be a regular file" in " ".join(
        proc.stderr.split()
    )


def test_files_over_the_cap_are_refused_and_the_limit_is_named(tmp_path: Path) -> None:
    big = tmp_path / "big.toml"
    with open(big, "wb") as fh:
        fh.truncate(MAX_INPUT_BYTES + 1)
    with pytest.raises(PipelineError, match=r"over the 4 MiB limit for a pipeline file"):
        load_pipeline(big)
    big_trace = tmp_path / "big.json"
    os.link(big, big_trace)
    with pytest.raises(TraceFormatError, match=r"over the 4 MiB limit for a trace file"):
        load_trace(big_trace)
    exact = tmp_path / "exact.bin"
    exact.write_bytes(b"x" * 10)
    assert read_bounded(exact, what="file", limit=10) == b"x" * 10


# -- case 5: replay DIR reports every entry -----------------------------------------------


def test_replay_folder_reports_every_unreplayable_entry(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = tmp_path / "good.json"
    good.write_bytes(sorted((ROOT / "traces").glob("*.json"))[0].read_bytes())
    (tmp_path / "dangling.json").symlink_to(tmp_path / "gone.json")
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    os.mkfifo(tmp_path / "fifo.json")
    (tmp_path / "sub.json").mkdir()
    code, out, err = _cli(["replay", str(tmp_path)], capsys)
    assert code == 2
    lines = out.splitlines()
    assert f"ok   {good}" in lines
    for name in ("dangling", "loop", "fifo", "sub"):
        assert f"ERR  {tmp_path / name}.json" in lines, out
    text = " ".join(err.split())
    assert "which does not exist" in text
    assert "symlink loop" in text
    assert "it is a FIFO (named pipe)" in text
    assert "it is a directory" in text
    assert lines[-1] == "replayed 5 traces: 1 ok, 0 differ, 4 invalid"
    assert all(line.startswith("attnres replay: error: ") for line in err.splitlines())
